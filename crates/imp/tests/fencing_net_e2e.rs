//! End-to-end fencing on the network (issue 27): a node cut off from the API server while its
//! underlay stays up stops its VM before the operator runs it elsewhere, and a client on a
//! third node never gets answers from two copies.
//!
//! Three "nodes", each a network namespace on the test's underlay (`common::nodes`), each
//! running a real `imp agent` (`--fence-after 6s`); the real `imp operator`
//! (`--node-loss-grace 2 --fence-margin 2`), a real kube-apiserver on the underlay's host
//! address, real Linux guests under QEMU/TCG on one ImpNetwork (VXLAN between the nodes). The
//! test plays the kubelets (Node Ready).
//!
//! The **mover** (persistent, `rescheduleOnNodeLoss`) runs on node a and answers TCP on 9000
//! with its boot id (one per boot: the two copies are told apart although they share name,
//! address and MAC by design). The **client** on node c pings the mover every 0.2 s and asks
//! its boot id in a loop, logging what answered with its uptime. Then node a's link to the API
//! server alone is cut (nftables in node a's namespace drops TCP to the API server; VXLAN
//! between the nodes stays up) and node a is reported NotReady. Every 100 ms the test counts the
//! mover's QEMU processes on each node: at no moment two. From the client's logs: no `DUP!`
//! reply, the answers come from the first boot only, then (after a gap) from a second boot
//! only, never the first again, and the second answers within [`ANSWER_BOUND`] of the cut.
//! The link comes back: node a's agent removes the moved VM without starting it, and still no
//! duplicate answers. The figures are printed (`fencing timeline (network)`).
//!
//! Needs root, iproute2, nftables and what a guest boot needs (`scripts/setup`): without them
//! it skips on a developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::nodes::{Agent, Topology, ready, run, text};
use common::{phase, wait_vm};

use std::path::Path;
use std::time::{Duration, Instant};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::{TestImage, scratch_dir};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "default";
const MOVER: &str = "mover";
const CLIENT: &str = "client";
/// The agents' fence deadline, and the operator's margin (its node-loss grace is 2 s too).
const FENCE_AFTER: u64 = 6;
const MARGIN: u64 = 2;
/// The bound, from the cut, by which the moved VM answers again on node b: the agent's
/// deadline (6 s) plus the operator's margin (2 s) plus its requeue (1 s), then a cold boot
/// of a guest under TCG on a loaded 2-core machine (generously 230 s; typically 10–40 s).
const ANSWER_BOUND: f64 = 240.0;
/// The label that lets the mover run on nodes a and b only (the client has node c).
const MOVER_LABEL: &str = "fencing-net-e2e/mover";

/// Busybox with what the mover and the client run; the workload is `$SCRIPT`.
fn image() -> TestImage {
    common::busybox_image(
        &[
            "sh", "cat", "sleep", "ping", "nc", "echo", "true", "timeout",
        ],
        "eval \"$SCRIPT\"",
    )
}

/// The mover answers every TCP connection on 9000 with its boot id (the kernel answers ping).
const MOVER_SCRIPT: &str =
    "while true; do nc -ll -p 9000 -e cat /proc/sys/kernel/random/boot_id; done";

/// The client waits for its target's address in /tmp/target, then pings it every 0.2 s into
/// /tmp/ping and, in a loop, asks its boot id, appending `UPTIME BOOT_ID` (`-` when nothing
/// answered) to /tmp/answers. (`timeout`: a connection to a copy that dies mid-answer would
/// hang `nc` for good.)
const CLIENT_SCRIPT: &str = "while [ ! -s /tmp/target ]; do sleep 0.2; done; T=$(cat /tmp/target); \
     (while true; do ping -i 0.2 $T; sleep 0.2; done) > /tmp/ping 2>&1 & \
     while true; do a=$(timeout 2 nc -w 1 $T 9000 </dev/null 2>/dev/null); read u _ </proc/uptime; \
     echo \"$u ${a:--}\" >> /tmp/answers; sleep 0.2; done";

/// `imp exec` into VM `vm` of the test's namespace; its stdout, which must succeed.
async fn exec(kubeconfig: &Path, vm: &str, script: &str) -> String {
    common::nodes::exec_ok(kubeconfig, NS, vm, script).await
}

/// A third node namespace, `c`, on the underlay (address `.3`); deleted when dropped.
struct NodeC {
    ns: String,
}

impl NodeC {
    fn create(topo: &Topology) -> Self {
        let (ns, hub) = (topo.ns("c"), topo.ns("hub"));
        let c = NodeC { ns: ns.clone() };
        run(&["ip", "netns", "add", &ns]);
        run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        run(&[
            "ip", "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", "n3", "netns",
            &hub,
        ]);
        let addr = format!("{}/24", topo.underlay(3));
        run(&["ip", "-n", &ns, "addr", "add", &addr, "dev", "eth0"]);
        run(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        run(&["ip", "-n", &hub, "link", "set", "n3", "master", "ul", "up"]);
        c
    }
}

impl Drop for NodeC {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .output();
    }
}

/// The mover's QEMU processes per node: QEMU runs in a network namespace of its own, so a
/// copy is the node's whose VMs' cgroup parent (`common::nodes::Agent`: `TAG-NODE-vms`) holds
/// it.
fn copies_per_node(topo: &Topology, states: &[&Path], uid: &str) -> Vec<usize> {
    let parents: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("/{}-{n}-vms/", topo.tag))
        .collect();
    let mut per = vec![0; parents.len()];
    for q in common::qemu_of(states[0], uid) {
        let cg = std::fs::read_to_string(format!("/proc/{q}/cgroup")).unwrap_or_default();
        if let Some(i) = parents.iter().position(|p| cg.contains(p.as_str())) {
            per[i] += 1;
        }
    }
    per
}

/// One line of the client's /tmp/answers: seconds since the cut (on the client's clock) and
/// the boot id that answered, if any.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    at: f64,
    boot: Option<String>,
}

/// The client's answers, timed from the cut (`cut_uptime` on the client's clock).
fn answers(log: &str, cut_uptime: f64) -> Vec<Answer> {
    log.lines()
        .filter_map(|l| {
            let (u, id) = l.trim().split_once(' ')?;
            let at = u.parse::<f64>().ok()? - cut_uptime;
            let boot = (id != "-").then(|| id.trim().to_owned());
            Some(Answer { at, boot })
        })
        .collect()
}

/// The distinct answerers in the order they answered, one entry per run of answers from the
/// same boot (`[X, Y]`: X only, then Y only; `[X, Y, X]` would mean two answerers at once).
fn runs(answers: &[Answer]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for b in answers.iter().filter_map(|a| a.boot.clone()) {
        if out.last() != Some(&b) {
            out.push(b);
        }
    }
    out
}

/// The ping log's replies and duplicate replies.
fn ping_counts(log: &str) -> (usize, usize) {
    let replies = log.lines().filter(|l| l.contains("bytes from")).count();
    let dups = log.lines().filter(|l| l.contains("DUP!")).count();
    (replies, dups)
}

/// The mover's timeline from the cut, as the test saw it on the host.
#[derive(Debug, Default)]
struct HostTimeline {
    fenced: Option<Duration>,
    placed_on_b: Option<Duration>,
    running_on_b: Option<Duration>,
}

/// Polls every 100 ms from the cut until the mover runs on node b: its QEMU processes on the
/// three nodes never number two, and it is placed on b only once a's copy is gone.
async fn watch_the_move(
    topo: &Topology,
    vms: &Api<ImpVM>,
    states: &[&Path],
    uid: &str,
    cut: Instant,
) -> HostTimeline {
    let mut t = HostTimeline::default();
    let deadline = Duration::from_secs(300);
    while t.running_on_b.is_none() {
        assert!(cut.elapsed() < deadline, "the mover never ran again on b");
        let on = copies_per_node(topo, states, uid);
        let total: usize = on.iter().sum();
        assert!(
            total <= 1,
            "two copies at {:?} after the cut: {on:?}",
            cut.elapsed()
        );
        if on[0] == 0 && t.fenced.is_none() {
            t.fenced = Some(cut.elapsed());
        }
        let v = vms.get(MOVER).await.unwrap();
        if t.placed_on_b.is_none() && v.spec.node_name.as_deref() == Some("node-b") {
            t.placed_on_b = Some(cut.elapsed());
            assert!(t.fenced.is_some(), "placed on b while a's copy ran");
        }
        if t.placed_on_b.is_some() && phase(&v) == Some(VmPhase::Running) && on[1] == 1 {
            t.running_on_b = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    t
}

/// Waits until `node`'s agent has renewed its Lease twice from now: it reaches the API server
/// and its loop runs (what it decided meanwhile is then there to check).
async fn lease_renewed_twice(c: &kube::Client, node: &str) {
    use k8s_openapi::api::coordination::v1::Lease;
    let leases: Api<Lease> = Api::namespaced(c.clone(), "imp-system");
    let name = format!("imp-agent-{node}");
    let renewed = || async {
        leases
            .get(&name)
            .await
            .ok()
            .and_then(|l| l.spec?.renew_time)
            .map(|t| t.0)
    };
    let mut seen = renewed().await;
    for n in 1..=2 {
        let prev = seen;
        seen = Some(
            common::wait_for(
                &format!("{name} renewed ({n} of 2)"),
                Duration::from_secs(60),
                || async move { renewed().await.filter(|t| Some(*t) != prev) },
            )
            .await,
        );
    }
}

/// Cuts (or restores) node a's link to the API server: TCP to `api` dropped in node a's
/// namespace, nothing else (the VXLAN underlay stays up).
fn cut_api(topo: &Topology, api: &str, cut: bool) {
    let (ip, port) = api.rsplit_once(':').unwrap();
    let rules = if cut {
        format!(
            "table inet fencecut {{ chain out {{ type filter hook output priority 0; \
             ip daddr {ip} tcp dport {port} drop; }}; }}"
        )
    } else {
        "delete table inet fencecut".to_owned()
    };
    let out = topo.exec("a", &["nft", &rules]);
    assert!(out.status.success(), "nft {rules}: {}", text(&out));
}

/// Reads the client's logs: (answers timed from the cut, ping log).
async fn client_logs(kubeconfig: &Path, cut_uptime: f64) -> (Vec<Answer>, String) {
    let a = exec(kubeconfig, CLIENT, "cat /tmp/answers").await;
    let p = exec(kubeconfig, CLIENT, "cat /tmp/ping").await;
    (answers(&a, cut_uptime), p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_the_api_server_fences_its_vm_so_a_client_never_sees_two_answerers() {
    let _run = common::test_run("fencing_net_e2e", Duration::from_secs(900));
    if ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let topo = Topology::create();
    let node_c = NodeC::create(&topo);
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
    common::ready_node(&c, "node-c").await;
    let nodes: Api<Node> = Api::all(c.clone());
    for n in ["node-a", "node-b"] {
        let labels = json!({"metadata": {"labels": {MOVER_LABEL: "true"}}});
        nodes
            .patch(n, &PatchParams::default(), &Patch::Merge(&labels))
            .await
            .unwrap();
    }
    let (kubeconfig, _) = common::exec_users(&kube, NS).await;
    common::small_class(&c, 128).await;
    common::create_imp(
        &c,
        "ImpNetwork",
        "impnetworks",
        json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
            "metadata": {"name": "net", "namespace": NS}, "spec": {"subnet": topo.subnet(214)}
        }),
    )
    .await;
    let layout = scratch_dir("imp-fencing-net-e2e-layout").unwrap();
    image().write_layout(&layout, "1").unwrap();
    let image = format!("oci:{}:1", layout.display());
    let cache = scratch_dir("imp-fencing-net-e2e-cache").unwrap();

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
    let fence = format!("{FENCE_AFTER}s");
    let mut agents: Vec<Agent> = Vec::new();
    for (n, host) in [("a", 1), ("b", 2), ("c", 3)] {
        let mut agent = Agent::new(&topo, n, topo.underlay(host));
        agent.extra_args = vec!["--fence-after".into(), fence.clone()];
        agent.start(&kube.agent_kubeconfig_for(&agent.node).await, &cache);
        agents.push(agent);
    }

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let mut uids = Vec::new();
    for (name, node, script) in [
        (MOVER, "node-a", MOVER_SCRIPT),
        (CLIENT, "node-c", CLIENT_SCRIPT),
    ] {
        let mut spec = json!({"classRef": {"name": "small"}, "image": image, "nodeName": node,
            "lifecycle": "persistent", "networkRef": {"name": "net"},
            "env": [{"name": "SCRIPT", "value": script}]});
        if name == MOVER {
            spec["rescheduleOnNodeLoss"] = json!(true);
            spec["nodeSelector"] = json!({MOVER_LABEL: "true"});
        }
        let obj: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": NS}, "spec": spec
        }))
        .unwrap();
        let made = vms.create(&PostParams::default(), &obj).await.unwrap();
        uids.push(made.uid().unwrap());
    }
    let uid = uids[0].clone();
    let mut ip = String::new();
    for name in [MOVER, CLIENT] {
        let v = wait_vm(&vms, name, "Running", 300, |v| {
            phase(v) == Some(VmPhase::Running)
        })
        .await;
        if name == MOVER {
            ip = v.status.as_ref().and_then(|s| s.ip.clone()).unwrap();
        }
    }
    let states: Vec<&Path> = agents.iter().map(|a| a.state.as_path()).collect();
    let on = copies_per_node(&topo, &states, &uid);
    assert_eq!(
        on,
        [1, 0, 0],
        "the mover's QEMU per node: {:?}",
        common::qemu_of(states[0], &uid)
            .iter()
            .map(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")))
            .collect::<Vec<_>>()
    );

    // The client starts asking; wait until the mover's first boot answers it.
    exec(&kubeconfig, CLIENT, &format!("echo {ip} > /tmp/target")).await;
    let first_boot = common::wait_for(
        "the client's first answer from the mover",
        Duration::from_secs(120),
        || {
            let k = kubeconfig.clone();
            async move {
                let log = exec(&k, CLIENT, "cat /tmp/answers 2>/dev/null; true").await;
                answers(&log, 0.0).into_iter().find_map(|a| a.boot)
            }
        },
    )
    .await;
    // A few answers from it before the cut (not a fixed wait): the client is in its stride.
    common::wait_for(
        "three answers from the mover's first boot",
        Duration::from_secs(60),
        || {
            let k = kubeconfig.clone();
            let first = first_boot.clone();
            async move {
                let log = exec(&k, CLIENT, "cat /tmp/answers 2>/dev/null; true").await;
                let from_first = answers(&log, 0.0)
                    .iter()
                    .filter(|a| a.boot.as_deref() == Some(first.as_str()))
                    .count();
                (from_first >= 3).then_some(())
            }
        },
    )
    .await;

    // Node a loses the API server (and only it); its kubelet's heartbeats stop too. The
    // client's clock at the cut: the middle of an exec just before it.
    let api = kube.cp.url().trim_start_matches("https://").to_owned();
    let before = Instant::now();
    let uptime = exec(&kubeconfig, CLIENT, "cat /proc/uptime").await;
    let half = before.elapsed().as_secs_f64() / 2.0;
    let cut_uptime = uptime
        .split_whitespace()
        .next()
        .and_then(|u| u.parse::<f64>().ok())
        .unwrap()
        + half;
    cut_api(&topo, &api, true);
    let cut = Instant::now();
    imp_testenv::nodes::set_ready(&c, "node-a", "8", "16Gi", false)
        .await
        .unwrap();
    let host = watch_the_move(&topo, &vms, &states, &uid, cut).await;

    // The client hears the second boot.
    let heard = tokio::time::timeout(
        Duration::from_secs(120),
        common::wait_for(
            "the client's first answer from the moved VM",
            Duration::from_secs(130),
            || {
                let k = kubeconfig.clone();
                let first = first_boot.clone();
                async move {
                    let (log, ping) = client_logs(&k, cut_uptime).await;
                    log.iter()
                        .any(|a| a.boot.as_ref().is_some_and(|b| *b != first))
                        .then_some((log, ping))
                }
            },
        ),
    )
    .await;
    let Ok((log, _)) = heard else {
        let nets: Api<imp_api::network::ImpNetwork> = Api::namespaced(c.clone(), NS);
        let table = nets.get("net").await.unwrap().status.map(|s| s.vtep_table);
        let (log, ping) = client_logs(&kubeconfig, cut_uptime).await;
        let neigh = exec(&kubeconfig, CLIENT, "ip neigh; ip addr").await;
        let mover = vms.get(MOVER).await.unwrap().status;
        let tail = |v: &str| v.lines().rev().take(15).collect::<Vec<_>>().join(" | ");
        panic!(
            "the client never heard the moved VM ({ip}) within 120 s of it running on b;\n\
             mover status: {mover:?}\nVTEP table: {table:?}\nclient answers (last): {:?}\n\
             client ping (last): {}\nclient neighbours: {neigh}\nfdb c: {}\nfdb b: {}\n\
             links b: {}",
            log.iter().rev().take(10).collect::<Vec<_>>(),
            tail(&ping),
            text(&topo.exec("c", &["bridge", "fdb", "show"])),
            text(&topo.exec("b", &["bridge", "fdb", "show"])),
            text(&topo.exec("b", &["ip", "-br", "link"])),
        );
    };
    let who = runs(&log);
    assert_eq!(who.len(), 2, "answerers in turn (never back): {who:?}");
    assert_eq!(who[0], first_boot);
    let last_a = log
        .iter()
        .rfind(|a| a.boot.as_deref() == Some(&who[0]))
        .unwrap()
        .at;
    let first_b = log
        .iter()
        .find(|a| a.boot.as_deref() == Some(&who[1]))
        .unwrap()
        .at;
    let v = vms.get(MOVER).await.unwrap();
    assert_eq!(v.spec.node_name.as_deref(), Some("node-b"));
    assert_eq!(
        v.status.as_ref().and_then(|s| s.ip.clone()),
        Some(ip.clone())
    );

    // The link comes back: agent a lifts its fence and removes the VM that moved, never
    // starting it; b's copy answers on alone.
    // (Its connections to the API server were dropped, not reset: how soon it notices the
    // link is back is up to TCP's retransmissions and the client's timeouts.)
    cut_api(&topo, &api, false);
    let restored = Instant::now();
    imp_testenv::nodes::set_ready(&c, "node-a", "8", "16Gi", true)
        .await
        .unwrap();
    let leftover = agents[0].state.join("vms").join(&uid);
    common::wait_for(
        "agent a to remove the VM that moved",
        Duration::from_secs(180),
        || {
            let on_a = copies_per_node(&topo, &states, &uid)[0];
            assert_eq!(on_a, 0, "node a started the moved VM again");
            let gone = !leftover.exists();
            async move { gone.then_some(()) }
        },
    )
    .await;
    let removed = restored.elapsed();
    // Agent a is back and its loop goes on (its Lease renewed twice since it removed the
    // record), and it has not started the moved VM again.
    lease_renewed_twice(&c, "node-a").await;
    assert_eq!(
        copies_per_node(&topo, &states, &uid),
        [0, 1, 0],
        "on b alone"
    );
    let (log, ping) = client_logs(&kubeconfig, cut_uptime).await;
    let who_after = runs(&log);
    assert_eq!(who_after, who, "answerers after the link came back");
    let (replies, dups) = ping_counts(&ping);
    assert_eq!(dups, 0, "duplicate ping replies (two answerers): {ping}");
    let restarts = ping.lines().filter(|l| l.starts_with("PING ")).count();
    let later = log.iter().filter(|a| a.boot.as_deref() == Some(&who[1]));
    eprintln!(
        "fencing timeline (network; fence after {FENCE_AFTER} s, margin {MARGIN} s, client on \
         node c): cut → a's QEMU gone {:.1} s → placed on b {:.1} s → running on b {:.1} s; \
         client: last answer from a's boot {last_a:.1} s → first from b's boot {first_b:.1} s \
         (no answer for {:.1} s; client clock mapped within ±{half:.1} s); {} answers from \
         b since, {replies} ping replies, 0 DUP!, ping restarted {} times; link back → a's record removed {:.1} s",
        host.fenced.unwrap().as_secs_f64(),
        host.placed_on_b.unwrap().as_secs_f64(),
        host.running_on_b.unwrap().as_secs_f64(),
        first_b - last_a,
        later.count(),
        restarts.saturating_sub(1),
        removed.as_secs_f64(),
    );
    assert!(replies > 0, "the client's ping got no reply at all: {ping}");
    assert!(
        last_a < 0.0 || last_a <= (FENCE_AFTER + 3) as f64 + half,
        "a's copy answered {last_a:.1} s after the cut: not fenced by its deadline"
    );
    assert!(
        first_b <= ANSWER_BOUND,
        "the moved VM answered only {first_b:.1} s after the cut (bound {ANSWER_BOUND} s)"
    );
    assert!(
        first_b >= FENCE_AFTER as f64 - half,
        "b's copy answered {first_b:.1} s after the cut, before a's deadline"
    );

    drop(agents);
    drop(node_c);
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&cache);
}

mod parsing {
    use super::*;

    #[test]
    fn answers_are_timed_from_the_cut_and_runs_show_who_answered_in_turn() {
        let log = "10.0 x\n11.5 -\n12.0 x\n20.25 y\n21.0 -\n22.0 y\nbroken\n";
        let a = answers(log, 11.0);
        assert_eq!(a.len(), 6);
        assert_eq!(
            a[0],
            Answer {
                at: -1.0,
                boot: Some("x".into())
            }
        );
        assert_eq!(a[1].boot, None);
        assert_eq!(runs(&a), ["x", "y"]);
        let back = answers("1 x\n2 y\n3 x\n", 0.0);
        assert_eq!(
            runs(&back),
            ["x", "y", "x"],
            "two answerers show as a return"
        );
        let ping = "PING 10.0.0.2 (10.0.0.2): 56 data bytes\n\
                    64 bytes from 10.0.0.2: seq=0 ttl=64 time=1 ms\n\
                    64 bytes from 10.0.0.2: seq=0 ttl=64 time=2 ms (DUP!)\n";
        assert_eq!(ping_counts(ping), (2, 1));
    }
}
