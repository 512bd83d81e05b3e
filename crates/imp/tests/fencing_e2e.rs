//! End-to-end: a node cut off from the API server stops its VMs before the operator runs them
//! elsewhere, and never runs them again once it is back (issue 27, fencing).
//!
//! Two real `imp agent`s on this host serve nodes `fence-a` and `fence-b`, with the real
//! `imp operator`, a real kube-apiserver with the chart's RBAC and a real Linux guest under
//! QEMU/TCG. Agent a reaches the API server only through a TCP proxy the test can cut, as a
//! node whose link to the control plane fails while the node itself runs on. The test plays
//! the kubelets (Node Ready). A persistent VM with `rescheduleOnNodeLoss` runs on a; the proxy
//! is cut and node a reported NotReady; from then on the test counts, every 100 ms, the QEMU
//! processes of the VM on this host: at no moment two. It records the timeline: cut → a's QEMU
//! gone (fenced) → the VM placed on b → running on b; then restores the link and checks that
//! agent a removes what is left of the VM without starting it. Last, node b is drained with a
//! `NoExecute` taint the VM tolerates for a few seconds: it leaves b only after them, and runs
//! on a only once b has stopped and removed it.
//!
//! Needs what `agent_e2e.rs` needs (`scripts/setup`): without it, it skips on a developer
//! machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::phase;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::scratch_dir;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};

const NS: &str = "default";
const VM: &str = "fenced";
const A: &str = "fence-a";
const B: &str = "fence-b";
/// The agents' fence deadline, and the operator's margin and node-loss grace.
const FENCE_AFTER: u64 = 6;
const MARGIN: u64 = 2;
/// The taint that drains node b at the end, and how long the VM tolerates it.
const DRAIN: &str = "imp.test/drain";
const TOLERATED: u64 = 3;

/// A TCP proxy to the API server that the test can cut (every connection dropped, new ones
/// refused) and restore.
struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c2, k2) = (cut.clone(), conns.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = listener.accept().await else {
                    continue;
                };
                if c2.load(Ordering::SeqCst) {
                    continue; // dropped: refused
                }
                let task = tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                k2.lock().unwrap().push(task);
            }
        });
        Self { addr, cut, conns }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for t in self.conns.lock().unwrap().drain(..) {
            t.abort();
        }
    }

    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// The QEMU processes of VM `uid` on this host (both agents' alike).
fn copies(state: &std::path::Path, uid: &str) -> usize {
    common::qemu_of(state, uid).len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_node_fences_its_vm_before_it_runs_elsewhere_and_never_runs_it_again() {
    let _run = common::test_run("fencing_e2e", Duration::from_secs(600));
    let Some(env) = common::agent::single_node(NS, A, 128).await else {
        return;
    };
    let (kube, c) = (env.kube, env.client);
    let layout = scratch_dir("imp-fencing-e2e-layout").unwrap();
    common::busybox_image(&["sh", "sleep"], "while true; do sleep 1; done")
        .write_layout(&layout, "1")
        .unwrap();
    let image = format!("oci:{}:1", layout.display());

    // Agent a through the proxy.
    let upstream: SocketAddr = kube
        .cp
        .url()
        .trim_start_matches("https://")
        .parse()
        .unwrap();
    let proxy = Proxy::start(upstream).await;
    let via_proxy = scratch_dir("imp-fencing-e2e-kubeconfig")
        .unwrap()
        .join("agent-a.kubeconfig");
    let text = std::fs::read_to_string(kube.agent_kubeconfig_for(A).await).unwrap();
    assert!(
        text.contains(kube.cp.url()),
        "the kubeconfig names the server"
    );
    std::fs::write(
        &via_proxy,
        text.replace(kube.cp.url(), &format!("https://{}", proxy.addr)),
    )
    .unwrap();
    let fence = format!("{FENCE_AFTER}s");
    let mut agent_a = common::agent::HostAgent::new(A, "fence-a");
    agent_a.kubeconfig = Some(via_proxy);
    agent_a.args = vec!["--fence-after".into(), fence.clone()];
    agent_a.start(&kube).await;

    let _operator = common::start_operator_with(
        &kube,
        &[
            "--node-loss-grace",
            "2",
            "--fence-margin",
            &MARGIN.to_string(),
            "--agent-fence-after",
            &format!("{FENCE_AFTER}s"),
        ],
    );

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let uid = common::create_vm(
        &vms,
        json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": VM, "namespace": NS},
            "spec": {"classRef": {"name": "small"}, "image": image, "lifecycle": "persistent",
                     "rescheduleOnNodeLoss": true,
                     "tolerations": [{"key": DRAIN, "operator": "Exists", "effect": "NoExecute",
                                      "tolerationSeconds": TOLERATED}]}
        }),
    )
    .await;
    let on_a = common::wait_vm(&vms, VM, "Running on a", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    assert_eq!(on_a.spec.node_name.as_deref(), Some(A));
    assert_eq!(copies(&agent_a.state, &uid), 1);

    // Node b joins.
    common::ready_node(&c, B).await;
    let mut agent_b = common::agent::HostAgent::new(B, "fence-b");
    agent_b.args = vec!["--fence-after".into(), fence];
    agent_b.start(&kube).await;

    // Node a loses the control plane; its kubelet's heartbeats stop too.
    let cut = Instant::now();
    proxy.cut();
    imp_testenv::nodes::set_ready(&c, A, "8", "16Gi", false)
        .await
        .unwrap();
    let mut fenced_at = None;
    let mut placed_on_b = None;
    let mut running_at = None;
    let mut max_copies = 0;
    let deadline = Duration::from_secs(300);
    while running_at.is_none() {
        assert!(cut.elapsed() < deadline, "the VM never ran again on b");
        let n = copies(&agent_a.state, &uid);
        max_copies = max_copies.max(n);
        assert!(n <= 1, "{n} copies of the VM run at {:?}", cut.elapsed());
        if n == 0 && fenced_at.is_none() {
            fenced_at = Some(cut.elapsed());
        }
        let v = vms.get(VM).await.unwrap();
        if placed_on_b.is_none() && v.spec.node_name.as_deref() == Some(B) {
            placed_on_b = Some(cut.elapsed());
            assert!(fenced_at.is_some(), "placed on b while a's copy ran");
        }
        if placed_on_b.is_some() && phase(&v) == Some(VmPhase::Running) && n == 1 {
            running_at = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (fenced, placed, running) = (
        fenced_at.unwrap(),
        placed_on_b.unwrap(),
        running_at.unwrap(),
    );
    eprintln!(
        "fencing timeline (fence after {FENCE_AFTER} s, margin {MARGIN} s): cut → fenced {:.1} s → \
         placed on b {:.1} s → running on b {:.1} s",
        fenced.as_secs_f64(),
        placed.as_secs_f64(),
        running.as_secs_f64()
    );
    assert!(
        fenced <= Duration::from_secs(FENCE_AFTER + 3),
        "fenced only after {fenced:?}"
    );
    assert!(
        placed >= Duration::from_secs(FENCE_AFTER),
        "moved after {placed:?}, before the agent's deadline"
    );

    // The link comes back: agent a lifts its fence and removes what is left of the VM, which
    // now belongs to b; it never starts it.
    proxy.restore();
    imp_testenv::nodes::set_ready(&c, A, "8", "16Gi", true)
        .await
        .unwrap();
    let leftover = agent_a.state.join("vms").join(&uid);
    common::wait_for(
        "agent a to remove the VM that moved",
        Duration::from_secs(60),
        || {
            let n = copies(&agent_a.state, &uid);
            assert!(n <= 1, "{n} copies after the link came back");
            let gone = !leftover.exists();
            async move { gone.then_some(()) }
        },
    )
    .await;
    assert_eq!(copies(&agent_a.state, &uid), 1, "b's copy runs on");
    let v = vms.get(VM).await.unwrap();
    assert_eq!(v.spec.node_name.as_deref(), Some(B));
    assert_eq!(phase(&v), Some(VmPhase::Running));
    assert!(agent_b.state.join("vms").join(&uid).exists());

    drain_evicts_after_the_toleration(&c, &agent_b.state, &uid).await;
}

/// Node b is drained with a `NoExecute` taint that the VM tolerates for [`TOLERATED`] seconds
/// (issue 26): the VM stays that long (its `DisruptionTarget` condition says until when), then
/// b's agent stops and removes it and releases it, and only then is it placed on a; never two
/// copies at once.
async fn drain_evicts_after_the_toleration(c: &kube::Client, state_b: &std::path::Path, uid: &str) {
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let nodes: Api<Node> = Api::all(c.clone());
    let taint =
        json!({"spec": {"taints": [{"key": DRAIN, "value": "yes", "effect": "NoExecute"}]}});
    let tainted = Instant::now();
    nodes
        .patch(B, &PatchParams::default(), &Patch::Merge(&taint))
        .await
        .unwrap();
    let record_b = state_b.join("vms").join(uid);
    let (mut tolerated_seen, mut gone_from_b, mut placed_on_a) = (false, None, None);
    let running_on_a = loop {
        assert!(
            tainted.elapsed() < Duration::from_secs(180),
            "the VM never ran on a after the drain of b"
        );
        let n = copies(state_b, uid);
        assert!(
            n <= 1,
            "{n} copies of the VM run {:?} after the drain",
            tainted.elapsed()
        );
        let v = vms.get(VM).await.unwrap();
        let disruption = v
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "DisruptionTarget"));
        if disruption.is_some_and(|c| c.reason == "TaintTolerated" && c.status == "False") {
            tolerated_seen = true;
        }
        if gone_from_b.is_none() && !record_b.exists() {
            gone_from_b = Some(tainted.elapsed());
        }
        if placed_on_a.is_none() && v.spec.node_name.as_deref() == Some(A) {
            placed_on_a = Some(tainted.elapsed());
            assert!(gone_from_b.is_some(), "placed on a while b still had it");
        }
        if placed_on_a.is_some() && phase(&v) == Some(VmPhase::Running) && n == 1 {
            break tainted.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (gone, placed) = (gone_from_b.unwrap(), placed_on_a.unwrap());
    eprintln!(
        "drain timeline (tolerated {TOLERATED} s): taint → removed from b {:.1} s → placed on a \
         {:.1} s → running on a {:.1} s",
        gone.as_secs_f64(),
        placed.as_secs_f64(),
        running_on_a.as_secs_f64()
    );
    assert!(
        tolerated_seen,
        "DisruptionTarget=False/TaintTolerated while tolerated"
    );
    assert!(
        gone >= Duration::from_secs(TOLERATED),
        "evicted after {gone:?}, before its {TOLERATED} s toleration ran out"
    );
    let events = common::events_with(c, NS, VM, &["Evicted"]).await;
    let evicted = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("Evicted"))
        .and_then(|e| e.message.clone())
        .unwrap_or_default();
    assert!(
        evicted.contains(&format!("node {B} has taint {DRAIN}=yes:NoExecute")),
        "{evicted}"
    );
}
