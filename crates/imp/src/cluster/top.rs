//! `imp top -n NS` (and `kubectl imp top`): the CPU, memory and disk figures of a namespace's
//! ImpVMs as their guests last reported them to their nodes' agents.
//!
//! The figures are read from each node's agent API (`GET /v1/namespaces/NS/guest-metrics`,
//! [`imp_agent::api::top`]), reached as `imp exec` reaches it: the address and certificate the
//! Node publishes, the kubeconfig user's bearer token. Not from the agents' `/metrics` through
//! the API server's node proxy: that needs `nodes/proxy` (which opens the kubelet too) and
//! shows every namespace; the agent API asks the API server whether the caller may `list` the
//! namespace's ImpVMs, as `kubectl top` asks for pods. One request per node that runs a VM of
//! the namespace; the agents answer from what they last polled, so no guest is woken or asked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use imp_agent::api::client::{self, Target};
use imp_agent::api::top::{GuestReading, GuestReadingList};
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};

use super::{agent_of, bearer_token, load_config, node_of, runtime};
use crate::args::{ClusterArgs, parse_duration};

/// What `imp top --help` ends with.
pub const HELP: &str = "Columns: NAME, NODE, CPU (busy share of the guest's CPU time), IOWAIT, \
MEMORY and DISK (used/total of the guest's memory and root filesystem), as each VM's guest last \
reported them to its node's agent (every 15 s by default), and NET (bytes the guest received/sent \
since its interface was made, for a VM on an ImpNetwork). A VM that does not run (or sleeps) \
shows -. Always acts on the cluster: the namespace of -n, else the kubeconfig context's. Needs \
`list impvms` in the namespace and a kubeconfig user with a bearer token, which each node's \
agent checks with the API server.";

/// `imp top`.
#[derive(Args, Debug)]
#[command(after_help = HELP)]
pub struct TopArgs {
    /// How long to wait for the API server and for each node's agent.
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
    let token = bearer_token(&config.auth_info)?;
    let namespace = args
        .cluster
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    config.connect_timeout = Some(args.timeout);
    let kube = kube::Client::try_from(config).context("building the Kubernetes client")?;
    let mut vms = Api::<ImpVM>::namespaced(kube.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing the ImpVMs of namespace {namespace}"))?
        .items;
    vms.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut asked = tokio::task::JoinSet::new();
    for node in nodes_to_ask(&vms) {
        let (kube, token, namespace) = (kube.clone(), token.clone(), namespace.clone());
        let timeout = args.timeout;
        asked.spawn(async move {
            let got = readings_of(&kube, &node, token, &namespace, timeout).await;
            (node, got)
        });
    }
    let mut readings: BTreeMap<String, GuestReadingList> = BTreeMap::new();
    let mut failures = Vec::new();
    while let Some(joined) = asked.join_next().await {
        let (node, got) = joined.context("asking a node's agent")?;
        match got {
            Ok(list) => {
                readings.insert(node, list);
            }
            Err(e) => failures.push((node, e)),
        }
    }
    if readings.is_empty()
        && let Some((_, e)) = failures.pop()
    {
        return Err(e);
    }
    for (node, e) in &failures {
        eprintln!("imp: no figures from node {node}: {e:#}");
    }
    Ok(rows(&vms, &readings))
}

/// The nodes that run a VM of the list now (only a running VM has figures).
fn nodes_to_ask(vms: &[ImpVM]) -> BTreeSet<String> {
    vms.iter()
        .filter(|vm| vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running))
        .filter_map(node_of)
        .collect()
}

/// What node `node`'s agent last read from the guests of `namespace`'s VMs.
async fn readings_of(
    kube: &kube::Client,
    node: &str,
    token: String,
    namespace: &str,
    timeout: Duration,
) -> anyhow::Result<GuestReadingList> {
    let found = Api::<Node>::all(kube.clone())
        .get(node)
        .await
        .with_context(|| format!("reading Node {node}"))?;
    let (endpoint, fingerprint) = agent_of(&found)?;
    let target = Target {
        endpoint,
        fingerprint,
        token,
    };
    tokio::time::timeout(timeout, client::guest_metrics(&target, namespace))
        .await
        .with_context(|| format!("the agent of node {node} did not answer within {timeout:?}"))?
        .with_context(|| {
            format!("reading the guest metrics of namespace {namespace} on node {node}")
        })
}

/// The table's rows: every VM, with its node's reading of it (the same uid: a VM recreated
/// under the same name is another VM).
fn rows(vms: &[ImpVM], readings: &BTreeMap<String, GuestReadingList>) -> Vec<Row> {
    vms.iter()
        .map(|vm| {
            let name = vm.metadata.name.clone().unwrap_or_default();
            let uid = vm.metadata.uid.as_deref().unwrap_or_default();
            let node = node_of(vm);
            let reading = node
                .as_ref()
                .and_then(|n| readings.get(n))
                .and_then(|list| list.items.iter().find(|r| r.name == name && r.uid == uid))
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
    use imp_agent::api::top::NetworkBytes;
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
    fn only_nodes_running_a_vm_are_asked() {
        let vms = [
            vm("a", "u1", "Running", Some("n1")),
            vm("b", "u2", "Suspended", Some("n2")),
            vm("c", "u3", "Pending", None),
            vm("d", "u4", "Running", Some("n1")),
        ];
        assert_eq!(nodes_to_ask(&vms), BTreeSet::from(["n1".to_owned()]));
    }

    #[test]
    fn every_vm_gets_a_line_and_only_its_own_figures() {
        let vms = [
            vm("web", "u1", "Running", Some("n1")),
            vm("again", "new", "Running", Some("n1")),
            vm("asleep", "u3", "Suspended", Some("n2")),
        ];
        let readings = BTreeMap::from([(
            "n1".to_owned(),
            GuestReadingList {
                namespace: "team".into(),
                items: vec![reading("web", "u1"), reading("again", "old")],
            },
        )]);
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
