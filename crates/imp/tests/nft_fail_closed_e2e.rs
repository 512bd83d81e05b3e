//! End-to-end, failing closed: a node whose `nft` refuses imp's rules starts no VM on an
//! ImpNetwork. The real `imp agent` runs in a network namespace of the test's (a "node"), with
//! `--nft` pointing at a wrapper that refuses every script it is given to load (and passes
//! the rest to the real `nft`); the real `imp operator` and a real kube-apiserver place the VM
//! and give it its address.
//!
//! Proves: the VM's Ready condition says `NetworkSetupFailed` with nft's own message, with a
//! Warning Event; no shim or VMM runs for it and no TAP or bridge is left on the node; once
//! `nft` loads again, the agent's retry starts the VM with its port's chain in the rules.
//!
//! Needs root, iproute2, nftables and what a guest boot needs (`scripts/setup`): without them
//! it skips on a developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::nodes::{Agent, Topology, ready, text};
use common::{phase, wait_vm};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::scratch_dir;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

const NS: &str = "default";

/// What the wrapper says when it refuses a script, as nft would.
const REFUSAL: &str = "Error: Could not process rule: refused by the test";

/// Writes the `nft` the agent runs: refusing scripts (`-f`) when `refuse`, else the real one.
fn write_nft(path: &Path, refuse: bool) {
    let body = if refuse {
        format!(
            "#!/bin/sh\nif [ \"$1\" = -f ]; then cat >/dev/null; echo '{REFUSAL}' >&2; exit 1; fi\nexec nft \"$@\"\n"
        )
    } else {
        "#!/bin/sh\nexec nft \"$@\"\n".to_owned()
    };
    // A new file renamed over the old: the agent never runs a half-written one.
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, body).unwrap();
    let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(&tmp, mode).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn ready_reason(v: &ImpVM) -> Option<(String, String)> {
    v.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| (c.reason.clone(), c.message.clone()))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_nft_refuses_the_rules_starts_no_vm_on_a_network() {
    if ready().is_none() {
        return;
    }
    let _run = common::test_run("nft_fail_closed_e2e", Duration::from_secs(600));
    let _ = rustls::crypto::ring::default_provider().install_default();
    let topo = Topology::create();
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
    common::small_class(&c, 128).await;
    common::create_imp(
        &c,
        "ImpNetwork",
        "impnetworks",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
               "metadata": {"name": "net", "namespace": NS},
               "spec": {"subnet": topo.subnet(216)}}),
    )
    .await;
    let layout = scratch_dir("imp-nft-e2e-layout").unwrap();
    common::counter_image().write_layout(&layout, "1").unwrap();
    let cache = scratch_dir("imp-nft-e2e-cache").unwrap();
    let nft = scratch_dir("imp-nft-e2e-bin").unwrap().join("nft");
    write_nft(&nft, true);

    let _operator = common::start_operator(&kube);
    let mut a = Agent::new(&topo, "a", topo.underlay(1));
    a.extra_args = vec!["--nft".into(), nft.to_str().unwrap().into()];
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let vm: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "guarded", "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "nodeName": "node-a",
                 "image": format!("oci:{}:1", layout.display()),
                 "lifecycle": "persistent", "networkRef": {"name": "net"}}
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let refused = wait_vm(&vms, "guarded", "NetworkSetupFailed", 120, |v| {
        ready_reason(v).is_some_and(|(r, _)| r == "NetworkSetupFailed")
    })
    .await;
    let (_, message) = ready_reason(&refused).unwrap();
    assert!(
        message.contains("wiring ImpNetwork default/net: nft refused imp's rules")
            && message.contains(REFUSAL),
        "{message}"
    );
    assert!(
        !matches!(phase(&refused), Some(VmPhase::Starting | VmPhase::Running)),
        "{:?}",
        refused.status
    );
    let events = common::events_with(&c, NS, "guarded", &["NetworkSetupFailed"]).await;
    assert!(events.iter().any(|e| e.type_.as_deref() == Some("Warning")));
    let uid = refused.uid().unwrap();
    assert_eq!(
        common::vm_processes(&a.state, &uid),
        Vec::<u32>::new(),
        "no shim or VMM"
    );
    // Each try wires the TAP for a moment and removes it again when the rules do not load.
    common::wait_for(
        "no TAP, bridge or VXLAN device on node a",
        Duration::from_secs(30),
        || {
            let links = topo.imp_links("a");
            async move { links.is_empty().then_some(()) }
        },
    )
    .await;
    assert_eq!(
        common::vm_processes(&a.state, &uid),
        Vec::<u32>::new(),
        "no shim or VMM after the tries either"
    );

    // nft loads again: the agent's retry (its usual backoff) starts the VM, its port guarded.
    write_nft(&nft, false);
    wait_vm(&vms, "guarded", "Starting after nft loads", 120, |v| {
        matches!(phase(v), Some(VmPhase::Starting | VmPhase::Running))
    })
    .await;
    let tap = imp_net::names::tap(NS, "guarded");
    let table = text(&topo.exec("a", &["nft", "list", "table", "bridge", "imp"]));
    assert!(table.contains(&format!("chain port-{tap}")), "{table}");

    vms.delete("guarded", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_vm_gone(&vms, "guarded", 120).await;
}
