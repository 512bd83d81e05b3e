//! `imp ps -n NS` and `imp ps -A`: a cluster's ImpVMs as a table, read with the kubeconfig's
//! user (any way of authenticating the client accepts; only exec and console need a token).

use anyhow::Context;
use imp_api::vm::ImpVM;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};

use super::{load_config, runtime};
use crate::args::{ClusterArgs, PsArgs, age};

/// Whether `imp ps` lists a cluster's ImpVMs rather than local VMs.
pub fn wanted(args: &PsArgs) -> bool {
    args.all_namespaces || super::wanted(&args.cluster)
}

/// `imp ps -n NS | -A`: one line per ImpVM, sorted by namespace and name.
pub fn ps(args: PsArgs) -> anyhow::Result<()> {
    let vms = runtime()?.block_on(list(&args.cluster, args.all_namespaces))?;
    print!("{}", table(&vms, args.all_namespaces, Timestamp::now()));
    Ok(())
}

async fn list(args: &ClusterArgs, all_namespaces: bool) -> anyhow::Result<Vec<ImpVM>> {
    let config = load_config(args).await?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let kube = kube::Client::try_from(config).context("building the Kubernetes client")?;
    let (api, what) = if all_namespaces {
        (
            Api::<ImpVM>::all(kube),
            "listing the ImpVMs of every namespace".to_owned(),
        )
    } else {
        (
            Api::<ImpVM>::namespaced(kube, &namespace),
            format!("listing the ImpVMs of namespace {namespace}"),
        )
    };
    let mut vms = api.list(&ListParams::default()).await.context(what)?.items;
    vms.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    Ok(vms)
}

/// The table `imp ps` prints, ages counted at `now`.
fn table(vms: &[ImpVM], all_namespaces: bool, now: Timestamp) -> String {
    let dash = |v: Option<&str>| v.filter(|s| !s.is_empty()).unwrap_or("-").to_owned();
    let mut rows = vec![
        [
            "NAMESPACE",
            "NAME",
            "PHASE",
            "NODE",
            "ADDRESS",
            "AGE",
            "IMAGE",
        ]
        .map(str::to_owned),
    ];
    for vm in vms {
        let status = vm.status.as_ref();
        let age = vm
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| age(u64::try_from(now.as_second() - t.0.as_second()).unwrap_or(0)))
            .unwrap_or_else(|| "-".into());
        rows.push([
            dash(vm.metadata.namespace.as_deref()),
            dash(vm.metadata.name.as_deref()),
            status.and_then(|s| s.phase).unwrap_or_default().to_string(),
            dash(status.and_then(|s| s.node_name.as_deref())),
            dash(status.and_then(|s| s.ip.as_deref())),
            age,
            dash(vm.spec.inherited.image.as_deref()),
        ]);
    }
    let skip = usize::from(!all_namespaces);
    let widths: Vec<usize> = (0..7)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = (skip..7)
            .map(|c| {
                if c == 6 {
                    row[c].clone()
                } else {
                    format!("{:<w$}", row[c], w = widths[c])
                }
            })
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

    fn vm(ns: &str, name: &str, status: serde_json::Value, created: &str) -> ImpVM {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
            "spec": {"image": "busybox:1", "classRef": {"name": "small"}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn the_table_has_node_phase_address_and_age() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let vms = [
            vm(
                "a",
                "web",
                serde_json::json!({"phase": "Running", "nodeName": "n1", "ip": "10.0.0.5"}),
                "2026-01-01T00:58:00Z",
            ),
            vm("b", "new", serde_json::json!(null), "2026-01-01T00:59:30Z"),
        ];
        assert_eq!(
            table(&vms, false, now),
            "NAME   PHASE     NODE   ADDRESS    AGE   IMAGE\n\
             web    Running   n1     10.0.0.5   2m    busybox:1\n\
             new    Pending   -      -          30s   busybox:1\n"
        );
        assert!(table(&vms, true, now).starts_with(
            "NAMESPACE   NAME   PHASE     NODE   ADDRESS    AGE   IMAGE\n\
             a           web    Running   n1     10.0.0.5   2m    busybox:1\n"
        ));
    }
}
