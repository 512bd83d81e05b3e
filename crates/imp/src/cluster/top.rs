//! `imp top -n NS` (and `kubectl imp top`): the CPU, memory and disk figures of a namespace's
//! ImpVMs as their guests last reported them to their nodes' agents.
//!
//! The figures come from the `guestmetrics` resource of imp's aggregated API
//! (`subresources.imp.dev`, [`super::gateway`]): the API server authorizes `list guestmetrics`
//! in the namespace (the `imp-view` role grants it, as Kubernetes' `view` grants `pods` of
//! `metrics.k8s.io`) and the operator's gateway asks every node that runs one of the
//! namespace's VMs, so no user credential reaches a node. Not from the agents' `/metrics`
//! through the API server's node proxy: that needs `nodes/proxy` (which opens the kubelet too)
//! and shows every namespace. The agents answer from what they last polled, so no guest is
//! woken or asked.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use imp_agent_api::top::{GuestReading, GuestReadingList};
use imp_api::vm::ImpVM;
use kube::api::{Api, ListParams};

use super::{gateway, load_config, node_of, runtime};
use crate::args::{ClusterArgs, parse_duration};

/// What `imp top --help` ends with.
pub const HELP: &str = "Columns: NAME, NODE, CPU (busy share of the guest's CPU time), IOWAIT, \
MEMORY and DISK (used/total of the guest's memory and root filesystem), as each VM's guest last \
reported them to its node's agent (every 15 s by default), and NET (bytes the guest received/sent \
since its interface was made, for a VM on an ImpNetwork). A VM that does not run (or sleeps) \
shows -. Always acts on the cluster: the namespace of -n, else the kubeconfig context's. Needs \
`list impvms` and `list guestmetrics` (of subresources.imp.dev) in the namespace: the imp-view \
role grants both.";

/// `imp top`.
#[derive(Args, Debug)]
#[command(after_help = HELP)]
pub struct TopArgs {
    /// How long to wait for the API server's answer (the gateway gives each node's agent 10 s).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// One line of the table.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    name: String,
    node: Option<String>,
    reading: Option<GuestReading>,
}

/// `imp top -n NS`: one line per ImpVM of the namespace, by name.
pub fn top(args: TopArgs) -> anyhow::Result<()> {
    let rows = runtime()?.block_on(gather(&args))?;
    print!("{}", table(&rows));
    Ok(())
}

async fn gather(args: &TopArgs) -> anyhow::Result<Vec<Row>> {
    let mut config = load_config(&args.cluster).await?;
    let namespace = args
        .cluster
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    gateway::check_name("namespace", &namespace)?;
    config.connect_timeout = Some(args.timeout);
    config.read_timeout = Some(args.timeout);
    let kube = kube::Client::try_from(config).context("building the Kubernetes client")?;
    let mut vms = Api::<ImpVM>::namespaced(kube.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing the ImpVMs of namespace {namespace}"))?
        .items;
    vms.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let readings = gateway::guest_metrics(&kube, &namespace).await?;
    for failure in &readings.failures {
        eprintln!(
            "imp: no figures from node {}: {}",
            failure.node, failure.message
        );
    }
    Ok(rows(&vms, &readings))
}

/// The table's rows: every VM, with its reading (the same uid: a VM recreated under the same
/// name is another VM).
fn rows(vms: &[ImpVM], readings: &GuestReadingList) -> Vec<Row> {
    vms.iter()
        .map(|vm| {
            let name = vm.metadata.name.clone().unwrap_or_default();
            let uid = vm.metadata.uid.as_deref().unwrap_or_default();
            let node = node_of(vm);
            let reading = readings
                .items
                .iter()
                .find(|r| r.name == name && r.uid == uid)
                .cloned();
            Row {
                name,
                node,
                reading,
            }
        })
        .collect()
}

/// A byte count the way `kubectl top` writes memory: binary units, whole numbers.
fn size(bytes: u64) -> String {
    const KI: u64 = 1 << 10;
    const MI: u64 = 1 << 20;
    const GI: u64 = 1 << 30;
    match bytes {
        b if b >= 10 * GI => format!("{}Gi", b / GI),
        b if b >= GI => format!("{:.1}Gi", b as f64 / GI as f64),
        b if b >= MI => format!("{}Mi", b / MI),
        b => format!("{}Ki", b.div_ceil(KI)),
    }
}

fn percent(ratio: f64) -> String {
    format!("{:.0}%", ratio * 100.0)
}

/// The columns of `imp top`'s table.
const COLUMNS: usize = 7;

/// The table `imp top` prints.
fn table(rows: &[Row]) -> String {
    let mut lines =
        vec![["NAME", "NODE", "CPU", "IOWAIT", "MEMORY", "DISK", "NET"].map(str::to_owned)];
    for row in rows {
        let dash = || "-".to_owned();
        let node = row.node.clone().unwrap_or_else(dash);
        let line = match &row.reading {
            Some(r) => {
                let m = &r.report;
                [
                    row.name.clone(),
                    node,
                    percent(m.cpu_usage_ratio),
                    percent(m.cpu_iowait_ratio),
                    format!(
                        "{}/{}",
                        size(m.memory_used_bytes),
                        size(m.memory_total_bytes)
                    ),
                    format!("{}/{}", size(m.disk_used_bytes), size(m.disk_total_bytes)),
                    r.network.map_or_else(dash, |n| {
                        format!("{}/{}", size(n.receive), size(n.transmit))
                    }),
                ]
            }
            None => [
                row.name.clone(),
                node,
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
            ],
        };
        lines.push(line);
    }
    let widths: Vec<usize> = (0..COLUMNS)
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for line in &lines {
        let cells: Vec<String> = (0..COLUMNS)
            .map(|c| format!("{:<w$}", line[c], w = widths[c]))
            .collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_agent_api::top::NetworkBytes;
    use imp_proto::MetricsReport;

    fn vm(name: &str, uid: &str, phase: &str, node: Option<&str>) -> ImpVM {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": "team", "uid": uid},
            "spec": {"image": "busybox:1"},
            "status": {"phase": phase, "nodeName": node},
        }))
        .unwrap()
    }

    fn reading(name: &str, uid: &str) -> GuestReading {
        GuestReading {
            name: name.into(),
            uid: uid.into(),
            sampled_unix: 1,
            report: MetricsReport {
                cpu_usage_ratio: 0.13,
                cpu_iowait_ratio: 0.01,
                memory_used_bytes: 90 << 20,
                memory_total_bytes: 256 << 20,
                disk_used_bytes: 300 << 20,
                disk_total_bytes: 1 << 30,
            },
            network: (name == "web").then_some(NetworkBytes {
                receive: 3 << 20,
                transmit: 512,
            }),
        }
    }

    #[test]
    fn every_vm_gets_a_line_and_only_its_own_figures() {
        let vms = [
            vm("web", "u1", "Running", Some("n1")),
            vm("again", "new", "Running", Some("n1")),
            vm("asleep", "u3", "Suspended", Some("n2")),
        ];
        let readings = GuestReadingList {
            namespace: "team".into(),
            items: vec![reading("web", "u1"), reading("again", "old")],
            failures: vec![],
        };
        let rows = rows(&vms, &readings);
        assert_eq!(rows[0].reading, Some(reading("web", "u1")));
        assert_eq!(
            rows[1].reading, None,
            "a recreated VM is not its predecessor"
        );
        assert_eq!(rows[2].node.as_deref(), Some("n2"));
        assert_eq!(
            table(&rows),
            "NAME     NODE   CPU   IOWAIT   MEMORY       DISK          NET\n\
             web      n1     13%   1%       90Mi/256Mi   300Mi/1.0Gi   3Mi/1Ki\n\
             again    n1     -     -        -            -             -\n\
             asleep   n2     -     -        -            -             -\n"
        );
    }

    #[test]
    fn sizes_are_written_in_binary_units() {
        assert_eq!(size(0), "0Ki");
        assert_eq!(size(1), "1Ki");
        assert_eq!(size(5 << 20), "5Mi");
        assert_eq!(size(3 << 29), "1.5Gi");
        assert_eq!(size(12 << 30), "12Gi");
        assert_eq!(percent(0.999), "100%");
    }
}
