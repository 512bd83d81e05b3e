//! End-to-end: the real `imp operator` binary against a real kube-apiserver, running with its
//! own ServiceAccount's token and only the RBAC rules the product ships.
//!
//! The node agent does not exist yet, so tests play the agent by patching status the way the
//! contract in `imp_operator::vm` says (phases, clearing `spec.nodeName` on cleanup).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::phase;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use imp_api::class::ImpVMClass;
use imp_api::template::ImpVMTemplate;
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

const NS: &str = "default";
/// How long each wait for an ImpVM to reach a state may take, in seconds.
const WAIT_SECS: u64 = 20;

struct Env {
    kube: common::Cluster,
    client: Client,
}

/// A control plane of the test's own, or `None` when it is not built (skip; fails under CI).
async fn env() -> Option<Env> {
    common::control_plane_ready()?;
    let kube = common::cluster(&[NS, "imp-system"]).await;
    let client = kube.client.clone();
    Some(Env { kube, client })
}

struct Operator {
    child: Child,
    metrics_port: u16,
    identity: String,
}

impl Operator {
    async fn start(env: &Env, identity: &str, extra: &[&str]) -> Self {
        Self::start_with(env, identity, extra, None).await
    }

    /// An operator that dies by SIGKILL at fault point `point` (`imp_telemetry::fault`).
    async fn start_dying_at(env: &Env, identity: &str, point: &str) -> Self {
        Self::start_with(env, identity, &[], Some(point)).await
    }

    async fn start_with(env: &Env, identity: &str, extra: &[&str], fault: Option<&str>) -> Self {
        let metrics_port = common::free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp"));
        cmd.arg("operator")
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--identity", identity])
            .args(["--requeue-pending", "2", "--requeue-active", "1"])
            .args(["--node-gone-grace", "1", "--node-loss-grace", "3"])
            .args(extra)
            .env("KUBECONFIG", env.kube.operator_kubeconfig())
            .env("RUST_LOG", common::rust_log())
            .stdout(Stdio::null())
            .stderr(common::logs())
            .kill_on_drop(true);
        if let Some(point) = fault {
            cmd.env(imp_telemetry::fault::ENV, point);
        }
        let child = cmd.spawn().unwrap();
        Self {
            child,
            metrics_port,
            identity: identity.to_owned(),
        }
    }

    /// Waits until the operator has died by SIGKILL (at its fault point), failing after
    /// `WAIT_SECS`.
    async fn died(&mut self, point: &str) {
        use std::os::unix::process::ExitStatusExt as _;
        let status = tokio::time::timeout(Duration::from_secs(WAIT_SECS), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the operator never reached fault point {point}"))
            .unwrap();
        assert_eq!(status.signal(), Some(9), "{point}: {status}");
    }

    /// SIGKILL, like a crashed pod.
    async fn kill9(&mut self) {
        self.child.start_kill().unwrap();
        let _ = self.child.wait().await;
    }

    async fn scrape(&self) -> Option<String> {
        common::http_get(self.metrics_port, "/metrics")
            .await
            .ok()
            .map(|(_, out)| out)
    }

    /// Waits until this operator has reconciled each of ImpVMs `names` from start to end since
    /// the call, so that a check that nothing changed runs after the operator looked, not after
    /// a sleep. Each VM gets a test annotation (a watch event, which marks it in the ImpVM
    /// controller's reconcile backlog); once the reconciles counter has grown by as many and the
    /// backlog is empty, every marked VM's reconcile has started. Done twice: the controller
    /// runs one reconcile of an object at a time, so the second round's start means the first
    /// round's reconciles, which began after the call, have ended.
    async fn looked_at(&self, c: &Client, names: &[&str]) {
        for round in 0..2 {
            let before = self.reconciles().await;
            for name in names {
                vms(c)
                    .patch(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"metadata": {"annotations": {
                            "test.imp.dev/looked": format!("{before}-{round}")
                        }}})),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("annotating {name}: {e}"));
            }
            let want = before + names.len() as f64;
            common::wait_for(
                &format!("the operator to reconcile {names:?} (round {round})"),
                Duration::from_secs(WAIT_SECS),
                || async move {
                    let t = self.scrape().await?;
                    let n = sample(&t, RECONCILES)?;
                    let backlog = sample(&t, BACKLOG)?;
                    (n >= want && backlog == 0.0).then_some(())
                },
            )
            .await;
        }
    }

    /// The ImpVM controller's reconciles so far.
    async fn reconciles(&self) -> f64 {
        common::wait_for(
            "the operator's metrics",
            Duration::from_secs(WAIT_SECS),
            || async { sample(&self.scrape().await?, RECONCILES) },
        )
        .await
    }
}

/// The ImpVM controller's reconcile counter and backlog gauge.
const RECONCILES: &str = "imp_operator_reconciles_total{controller=\"impvm\"}";
const BACKLOG: &str = "imp_operator_reconcile_backlog{controller=\"impvm\"}";

fn sample(text: &str, key: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

async fn node(c: &Client, name: &str, cpu: &str, mem: &str, enabled: bool, ready: bool) {
    let api: Api<Node> = Api::all(c.clone());
    let mut labels = BTreeMap::from([(
        imp_api::shared::LABEL_NODE_ARCH.to_owned(),
        common::kubelet_arch().to_owned(),
    )]);
    if enabled {
        labels.insert("imp/enabled".to_owned(), "true".to_owned());
    }
    let n: Node =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    api.create(&PostParams::default(), &n).await.unwrap();
    set_node_ready(c, name, cpu, mem, ready).await;
}

async fn set_node_ready(c: &Client, name: &str, cpu: &str, mem: &str, ready: bool) {
    imp_testenv::nodes::set_ready(c, name, cpu, mem, ready)
        .await
        .unwrap();
}

async fn class(c: &Client, name: &str, vcpu: i32, mem: i32) {
    let api: Api<ImpVMClass> = Api::all(c.clone());
    let obj: ImpVMClass = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
        "metadata": {"name": name}, "spec": {"vcpu": vcpu, "memoryMiB": mem, "diskGiB": 1}
    }))
    .unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
}

async fn vm(c: &Client, name: &str, spec: Value) -> ImpVM {
    let api: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS}, "spec": spec
    }))
    .unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap()
}

fn vms(c: &Client) -> Api<ImpVM> {
    Api::namespaced(c.clone(), NS)
}

fn cond<'a>(
    v: &'a ImpVM,
    t: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    v.status.as_ref()?.conditions.iter().find(|c| c.type_ == t)
}

/// Plays the agent: patches the VM's status.
async fn agent_status(c: &Client, name: &str, status: Value) {
    vms(c)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": status})),
        )
        .await
        .unwrap();
}

async fn agent_clear_node(c: &Client, name: &str) {
    vms(c)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"nodeName": null}})),
        )
        .await
        .unwrap();
}

async fn events_for(c: &Client, name: &str) -> Vec<Event> {
    common::events_of(c, NS, name).await
}

/// Per node, the sum of vCPU and count of placed VMs (every VM uses class `small`: 1 vCPU).
async fn placements(c: &Client) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for v in vms(c).list(&ListParams::default()).await.unwrap().items {
        if let Some(n) = v.spec.node_name {
            *m.entry(n).or_insert(0) += 1;
        }
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_references_wait_in_pending_and_recover_when_created() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    let _op = Operator::start(&e, "solo", &[]).await;
    node(c, "w1", "4", "8Gi", true, true).await;
    vm(
        c,
        "direct",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    vm(c, "via-template", json!({"templateRef": {"name": "tmpl"}})).await;

    let d = common::wait_vm(&vms(c), "direct", "InvalidSpec on direct", WAIT_SECS, |v| {
        cond(v, "Ready").is_some_and(|c| c.reason == "InvalidSpec")
    })
    .await;
    assert_eq!(phase(&d), Some(VmPhase::Pending));
    let msg = &cond(&d, "Ready").unwrap().message;
    assert!(
        msg.contains("ImpVMClass small") && msg.contains("create it"),
        "{msg}"
    );
    assert_eq!(cond(&d, "Ready").unwrap().status, "False");
    let t = common::wait_vm(
        &vms(c),
        "via-template",
        "InvalidSpec on via-template",
        WAIT_SECS,
        |v| cond(v, "Ready").is_some_and(|c| c.reason == "InvalidSpec"),
    )
    .await;
    assert!(
        cond(&t, "Ready")
            .unwrap()
            .message
            .contains("ImpVMTemplate default/tmpl")
    );
    let evs = common::wait_for(
        "a Warning InvalidSpec event",
        Duration::from_secs(10),
        || async {
            let evs = events_for(c, "direct").await;
            evs.iter()
                .any(|e| {
                    e.reason.as_deref() == Some("InvalidSpec")
                        && e.type_.as_deref() == Some("Warning")
                })
                .then_some(evs)
        },
    )
    .await;
    assert!(!evs.is_empty());

    // Fix the references: the same objects recover, without being recreated.
    class(c, "small", 1, 256).await;
    let tmpl: ImpVMTemplate = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
        "metadata": {"name": "tmpl", "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "image": "busybox"}
    }))
    .unwrap();
    Api::<ImpVMTemplate>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &tmpl)
        .await
        .unwrap();
    for name in ["direct", "via-template"] {
        let v = common::wait_vm(&vms(c), name, "Scheduled after the fix", WAIT_SECS, |v| {
            phase(v) == Some(VmPhase::Scheduled)
        })
        .await;
        assert_eq!(v.spec.node_name.as_deref(), Some("w1"));
        assert_eq!(v.status.as_ref().unwrap().node_name.as_deref(), Some("w1"));
        assert!(v.status.as_ref().unwrap().scheduled_at.is_some());
        let s = cond(&v, "Scheduled").unwrap();
        assert_eq!(
            (s.status.as_str(), s.reason.as_str()),
            ("True", "NodeAssigned")
        );
        assert!(v.finalizers().iter().any(|f| f == "imp.dev/vm-cleanup"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creation_never_overbooks_and_metrics_count_phases() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    // 3 vCPU × 0.9 = 2.7 → two 1-vCPU VMs per node; 4 enabled nodes → 8 slots.
    for i in 0..4 {
        node(c, &format!("n{i}"), "3", "16Gi", true, true).await;
    }
    node(c, "off", "64", "64Gi", false, true).await;
    class(c, "small", 1, 256).await;
    let op = Operator::start(&e, "solo", &[]).await;
    let creates = (0..24).map(|i| {
        let c = c.clone();
        async move {
            vm(
                &c,
                &format!("vm{i:02}"),
                json!({"classRef": {"name": "small"}, "image": "busybox"}),
            )
            .await
        }
    });
    futures::future::join_all(creates).await;

    let list = common::wait_for(
        "8 Scheduled and 16 NoNodeAvailable",
        Duration::from_secs(30),
        || async {
            let items = vms(c).list(&ListParams::default()).await.unwrap().items;
            let scheduled = items
                .iter()
                .filter(|v| phase(v) == Some(VmPhase::Scheduled))
                .count();
            let unsched = items
                .iter()
                .filter(|v| cond(v, "Scheduled").is_some_and(|c| c.reason == "NoNodeAvailable"))
                .count();
            (scheduled == 8 && unsched == 16).then_some(items)
        },
    )
    .await;
    let per_node = placements(c).await;
    assert_eq!(per_node.len(), 4, "{per_node:?}");
    assert!(
        per_node.values().all(|n| *n == 2),
        "overbooked: {per_node:?}"
    );
    let pending = list
        .iter()
        .find(|v| phase(v) == Some(VmPhase::Pending))
        .unwrap();
    let msg = &cond(pending, "Scheduled").unwrap().message;
    assert!(msg.starts_with("5 nodes: "), "{msg}");
    assert!(msg.contains("1 lacks label imp/enabled=true"), "{msg}");
    assert!(msg.contains("4 have 0.7 vCPU free of 1 needed"), "{msg}");
    // No more placements happen later either: not once the operator looked at every VM again.
    let names: Vec<String> = list.iter().map(|v| v.name_any()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    op.looked_at(c, &names).await;
    assert_eq!(placements(c).await.values().sum::<usize>(), 8);

    let text = common::wait_for("phase gauges", Duration::from_secs(10), || async {
        let t = op.scrape().await?;
        (sample(&t, "imp_operator_vms{phase=\"Scheduled\"}") == Some(8.0)).then_some(t)
    })
    .await;
    assert_eq!(
        sample(&text, "imp_operator_vms{phase=\"Pending\"}"),
        Some(16.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_killed_mid_scheduling_neither_loses_nor_double_places() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    // 5 nodes × 4 slots (5 vCPU × 0.9 = 4.5) = 20 slots for 30 VMs.
    for i in 0..5 {
        node(c, &format!("n{i}"), "5", "16Gi", true, true).await;
    }
    class(c, "small", 1, 256).await;
    for i in 0..30 {
        vm(
            c,
            &format!("vm{i:02}"),
            json!({"classRef": {"name": "small"}, "image": "busybox"}),
        )
        .await;
    }
    let mut op = Operator::start(&e, "first", &[]).await;
    common::wait_for("the first placements", Duration::from_secs(20), || async {
        let n: usize = placements(c).await.values().sum();
        (n >= 1).then_some(())
    })
    .await;
    op.kill9().await;
    let at_kill: usize = placements(c).await.values().sum();
    eprintln!("operator killed with {at_kill} of 20 placements made");
    let _op2 = Operator::start(&e, "second", &[]).await;
    common::wait_for(
        "20 placed after the restart",
        Duration::from_secs(30),
        || async {
            let items = vms(c).list(&ListParams::default()).await.unwrap().items;
            let sched = items
                .iter()
                .filter(|v| {
                    phase(v) == Some(VmPhase::Scheduled)
                        && v.status.as_ref().unwrap().node_name == v.spec.node_name
                })
                .count();
            let unsched = items
                .iter()
                .filter(|v| cond(v, "Scheduled").is_some_and(|c| c.reason == "NoNodeAvailable"))
                .count();
            (sched == 20 && unsched == 10).then_some(())
        },
    )
    .await;
    let per_node = placements(c).await;
    assert!(
        per_node.values().all(|n| *n == 4),
        "killed with {at_kill} placed; now {per_node:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_terminal_restart_reset_node_loss_and_deletion() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let op = Operator::start(
        &e,
        "solo",
        &["--termination-timeout", "30", "--start-timeout", "1"],
    )
    .await;

    // A start that hangs fails after the stuck-start timeout, with a reason and an Event.
    vm(
        c,
        "stuck",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(&vms(c), "stuck", "stuck Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    agent_status(c, "stuck", json!({"phase": "Starting", "startedAt": now})).await;
    let stuck = common::wait_vm(&vms(c), "stuck", "stuck Failed", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Failed)
    })
    .await;
    let ready = cond(&stuck, "Ready").unwrap();
    assert_eq!(ready.reason, "AgentTimeout", "{}", ready.message);
    assert!(
        ready.message.contains("still Starting") && ready.message.contains("node a"),
        "{}",
        ready.message
    );
    common::events_with(c, NS, "stuck", &["AgentTimeout"]).await;
    // Failed ephemeral VMs are terminal too: still Failed once the operator looked again.
    op.looked_at(c, &["stuck"]).await;
    assert_eq!(
        phase(&vms(c).get("stuck").await.unwrap()),
        Some(VmPhase::Failed)
    );

    // A finished ephemeral VM is never scheduled again.
    vm(
        c,
        "job",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(&vms(c), "job", "job Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    agent_status(c, "job", json!({"phase": "Running"})).await;
    let run = common::wait_vm(&vms(c), "job", "runningAt stamped", WAIT_SECS, |v| {
        v.status.as_ref().unwrap().running_at.is_some()
    })
    .await;
    assert_eq!(cond(&run, "NodeHealthy").unwrap().status, "True");
    agent_status(c, "job", json!({"phase": "Succeeded", "exitCode": 0})).await;
    agent_clear_node(c, "job").await;
    op.looked_at(c, &["job"]).await;
    let job = vms(c).get("job").await.unwrap();
    assert_eq!(phase(&job), Some(VmPhase::Succeeded));
    assert_eq!(
        job.spec.node_name, None,
        "a Succeeded ephemeral VM was scheduled again"
    );

    // Restart policy: reschedule after backoff, exhaust to RetryExhausted, reset really runs again.
    vm(
        c,
        "svc",
        json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": "persistent",
               "restartPolicy": {"mode": "reschedule", "onExhaustion": "manual-reset",
                                 "backoff": {"maxRetries": 1, "initialDelay": "1s", "maxDelay": "2s"}}}),
    )
    .await;
    common::wait_vm(&vms(c), "svc", "svc Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    agent_status(c, "svc", json!({"phase": "Failed", "exitCode": 3})).await;
    let restarted = common::wait_vm(&vms(c), "svc", "svc restarted", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled) && v.status.as_ref().unwrap().restart_count == Some(1)
    })
    .await;
    assert!(restarted.spec.node_name.is_some());
    agent_status(c, "svc", json!({"phase": "Failed", "exitCode": 3})).await;
    let ex = common::wait_vm(&vms(c), "svc", "svc RetryExhausted", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::RetryExhausted)
    })
    .await;
    assert!(ex.status.as_ref().unwrap().exhausted_at.is_some());
    vms(c)
        .patch(
            "svc",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"imp/reset-retries": "true"}}})),
        )
        .await
        .unwrap();
    let reset = common::wait_vm(
        &vms(c),
        "svc",
        "svc scheduled again after reset",
        WAIT_SECS,
        |v| {
            phase(v) == Some(VmPhase::Scheduled)
                && v.status.as_ref().unwrap().restart_count.is_none()
                && !v.annotations().contains_key("imp/reset-retries")
        },
    )
    .await;
    assert_eq!(reset.spec.node_name.as_deref(), Some("a"));
    common::events_with(
        c,
        NS,
        "svc",
        &[
            "Scheduled",
            "Restarting",
            "RetriesExhausted",
            "RetriesReset",
        ],
    )
    .await;

    // Node loss: the opted-in persistent VM moves, the other fails.
    vm(c, "mover", json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": "persistent", "rescheduleOnNodeLoss": true})).await;
    vm(
        c,
        "stayer",
        json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": "persistent"}),
    )
    .await;
    for n in ["mover", "stayer"] {
        common::wait_vm(&vms(c), n, "on node a", WAIT_SECS, |v| {
            phase(v) == Some(VmPhase::Scheduled)
        })
        .await;
        agent_status(c, n, json!({"phase": "Running"})).await;
    }
    node(c, "b", "8", "16Gi", true, true).await;
    set_node_ready(c, "a", "8", "16Gi", false).await;
    // Within the node-loss grace (3 s here) the VMs stay put and say why.
    let noted = common::wait_vm(
        &vms(c),
        "mover",
        "mover noting node a NotReady",
        WAIT_SECS,
        |v| cond(v, "NodeHealthy").is_some_and(|c| c.status == "False"),
    )
    .await;
    assert_eq!(noted.spec.node_name.as_deref(), Some("a"));
    assert!(
        cond(&noted, "NodeHealthy")
            .unwrap()
            .message
            .contains("if it stays so for 3s"),
        "{:?}",
        cond(&noted, "NodeHealthy")
    );
    let moved = common::wait_vm(&vms(c), "mover", "mover on node b", WAIT_SECS, |v| {
        v.spec.node_name.as_deref() == Some("b") && phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    assert_eq!(
        moved.status.as_ref().unwrap().node_name.as_deref(),
        Some("b")
    );
    let failed = common::wait_vm(&vms(c), "stayer", "stayer Failed", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Failed)
    })
    .await;
    let nh = cond(&failed, "NodeHealthy").unwrap();
    assert_eq!(
        (nh.status.as_str(), nh.reason.as_str()),
        ("False", "NodeNotReady")
    );
    // stayer sets no restartPolicy: being persistent, it follows the default one (in place,
    // after about 10 s).
    common::wait_vm(
        &vms(c),
        "stayer",
        "stayer's default restart planned",
        WAIT_SECS,
        |v| {
            phase(v) == Some(VmPhase::Failed)
                && v.status.as_ref().unwrap().next_retry_after.is_some()
        },
    )
    .await;

    // Deletion waits for the agent's cleanup marker (spec.nodeName cleared).
    vms(c)
        .delete("mover", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_vm(&vms(c), "mover", "mover Terminating", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Terminating)
    })
    .await;
    op.looked_at(c, &["mover"]).await;
    assert!(
        vms(c).get_opt("mover").await.unwrap().is_some(),
        "finalizer removed before cleanup"
    );
    agent_clear_node(c, "mover").await;
    common::wait_for("mover gone", Duration::from_secs(10), || async {
        vms(c)
            .get_opt("mover")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;

    // Deletion when the node object is gone: released after the grace, with an Event.
    Api::<Node>::all(c.clone())
        .delete("a", &DeleteParams::default())
        .await
        .unwrap();
    vms(c)
        .delete("stayer", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_for("stayer gone", Duration::from_secs(15), || async {
        vms(c)
            .get_opt("stayer")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_failover_within_the_lease_duration() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let flags = [
        "--leader-elect",
        "--lease-duration",
        "3",
        "--renew-deadline",
        "2",
        "--retry-period",
        "0.5",
    ];
    let mut one = Operator::start(&e, "one", &flags).await;
    let mut two = Operator::start(&e, "two", &flags).await;
    let leases: Api<Lease> = Api::namespaced(c.clone(), "imp-system");
    let holder = common::wait_for("a leader", Duration::from_secs(15), || async {
        leases
            .get_opt("imp-operator")
            .await
            .ok()
            .flatten()?
            .spec?
            .holder_identity
    })
    .await;
    vm(
        c,
        "before",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(&vms(c), "before", "before Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    // Only the leader wrote: every event comes from it.
    let evs = common::events_with(c, NS, "before", &["Scheduled"]).await;
    for ev in &evs {
        assert_eq!(
            ev.reporting_instance.as_deref(),
            Some(holder.as_str()),
            "event from a non-leader: {ev:?}"
        );
    }
    let (leader, follower) = if holder == one.identity {
        (&mut one, &two)
    } else {
        (&mut two, &one)
    };
    let text = follower.scrape().await.unwrap();
    assert_eq!(sample(&text, "imp_operator_is_leader"), Some(0.0), "{text}");
    leader.kill9().await;
    let killed = Instant::now();
    vm(
        c,
        "after",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(
        &vms(c),
        "after",
        "after Scheduled by the new leader",
        WAIT_SECS,
        |v| phase(v) == Some(VmPhase::Scheduled),
    )
    .await;
    let took = killed.elapsed();
    // lease 3 s + one retry period + the reconcile itself
    assert!(took < Duration::from_secs(5), "takeover took {took:?}");
    let new_holder = leases
        .get("imp-operator")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity
        .unwrap();
    assert_eq!(new_holder, follower.identity);
    let text = follower.scrape().await.unwrap();
    assert_eq!(sample(&text, "imp_operator_is_leader"), Some(1.0), "{text}");
    eprintln!("takeover after kill -9: {took:?}");
}

/// Creates VMs `second` and `third` of class `class` and waits until one of them is placed
/// beside `first` and the other refused (NoNodeAvailable).
async fn second_and_third_one_placed(c: &Client, class: &str) {
    for name in ["second", "third"] {
        vm(
            c,
            name,
            json!({"classRef": {"name": class}, "image": "busybox"}),
        )
        .await;
    }
    common::wait_for("one of two placed", Duration::from_secs(20), || async {
        let items = vms(c).list(&ListParams::default()).await.unwrap().items;
        let placed = items.iter().filter(|v| v.spec.node_name.is_some()).count();
        let refused = items
            .iter()
            .filter(|v| cond(v, "Scheduled").is_some_and(|c| c.reason == "NoNodeAvailable"))
            .count();
        (placed == 2 && refused == 1).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_class_still_counts_against_its_node() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    // 3 vCPU × 0.9 = 2.7 → room for two 1-vCPU VMs.
    node(c, "only", "3", "16Gi", true, true).await;
    class(c, "old", 1, 256).await;
    let op = Operator::start(&e, "solo", &[]).await;
    vm(
        c,
        "first",
        json!({"classRef": {"name": "old"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(&vms(c), "first", "first Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    // The class of the placed VM goes away; its vCPU must stay booked on the node.
    Api::<ImpVMClass>::all(c.clone())
        .delete("old", &DeleteParams::default())
        .await
        .unwrap();
    class(c, "new", 1, 256).await;
    second_and_third_one_placed(c, "new").await;
    op.looked_at(c, &["second", "third"]).await;
    assert_eq!(placements(c).await.get("only"), Some(&2), "node overbooked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_class_still_counts_after_an_operator_restart() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    // 3 vCPU × 0.9 = 2.7 → room for two 1-vCPU VMs.
    node(c, "only", "3", "16Gi", true, true).await;
    class(c, "old", 1, 256).await;
    let mut op = Operator::start(&e, "first", &[]).await;
    vm(
        c,
        "first",
        json!({"classRef": {"name": "old"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(&vms(c), "first", "first Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    // The class goes away, then the operator: the new one never saw the class, only the VM.
    Api::<ImpVMClass>::all(c.clone())
        .delete("old", &DeleteParams::default())
        .await
        .unwrap();
    op.kill9().await;
    class(c, "new", 1, 256).await;
    for name in ["second", "third"] {
        vm(
            c,
            name,
            json!({"classRef": {"name": "new"}, "image": "busybox"}),
        )
        .await;
    }
    let op = Operator::start(&e, "second", &[]).await;
    common::wait_for(
        "second and third each placed or refused",
        Duration::from_secs(20),
        || async {
            let items = vms(c).list(&ListParams::default()).await.unwrap().items;
            items
                .iter()
                .filter(|v| v.name_any() != "first")
                .all(|v| {
                    phase(v) == Some(VmPhase::Scheduled)
                        || cond(v, "Scheduled").is_some_and(|c| c.reason == "NoNodeAvailable")
                })
                .then_some(())
        },
    )
    .await;
    op.looked_at(c, &["second", "third"]).await;
    assert_eq!(
        placements(c).await.get("only"),
        Some(&2),
        "node overbooked after the restart"
    );
    // The size the node was booked for is on the VM, written with its placement.
    let first = vms(c).get("first").await.unwrap();
    assert_eq!(
        first
            .annotations()
            .get("imp.dev/placed-resources")
            .map(String::as_str),
        Some(r#"{"vcpu":1,"memoryMiB":256}"#)
    );
}

/// Plays the agent of node `name`: publishes the runtimes its probe found.
async fn advertise_runtimes(c: &Client, name: &str, runtimes: &str) {
    Api::<Node>::all(c.clone())
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"imp.dev/runtimes": runtimes}}})),
        )
        .await
        .unwrap();
}

/// The message of `name`'s `Scheduled` condition once it is `NoNodeAvailable` and `pred`
/// holds of it, with the phase still Pending and no node.
async fn unschedulable_message(c: &Client, name: &str, pred: impl Fn(&str) -> bool) -> String {
    let v = common::wait_vm(
        &vms(c),
        name,
        &format!("{name} NoNodeAvailable"),
        WAIT_SECS,
        |v| cond(v, "Scheduled").is_some_and(|s| s.reason == "NoNodeAvailable" && pred(&s.message)),
    )
    .await;
    assert_eq!(phase(&v), Some(VmPhase::Pending));
    assert_eq!(v.spec.node_name, None);
    cond(&v, "Scheduled").unwrap().message.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_runtime_and_arch_place_vms_only_where_they_can_run() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    let arch = common::kubelet_arch();
    let other_arch = if arch == "arm64" { "amd64" } else { "arm64" };
    node(c, "qemu-only", "8", "16Gi", true, true).await;
    advertise_runtimes(c, "qemu-only", "qemu").await;
    for (name, spec) in [
        (
            "fc",
            json!({"vcpu": 1, "memoryMiB": 256, "diskGiB": 1, "runtime": "firecracker"}),
        ),
        (
            "foreign",
            json!({"vcpu": 1, "memoryMiB": 256, "diskGiB": 1, "arch": other_arch}),
        ),
    ] {
        common::create_imp(
            c,
            "ImpVMClass",
            "impvmclasses",
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                   "metadata": {"name": name}, "spec": spec}),
        )
        .await;
    }
    let _op = Operator::start(&e, "solo", &[]).await;
    vm(
        c,
        "needs-fc",
        json!({"classRef": {"name": "fc"}, "image": "busybox"}),
    )
    .await;
    vm(
        c,
        "foreign",
        json!({"classRef": {"name": "foreign"}, "image": "busybox"}),
    )
    .await;

    // One QEMU-only node: the Firecracker VM stays Pending, and says why.
    let m = unschedulable_message(c, "needs-fc", |_| true).await;
    assert_eq!(
        m, "1 node: 1 runs no firecracker (imp.dev/runtimes=qemu)",
        "the runtime is named"
    );
    let events = common::events_with(c, NS, "needs-fc", &["Unschedulable"]).await;
    assert!(
        events.iter().any(|e| e
            .message
            .as_deref()
            .is_some_and(|m| m.contains("runs no firecracker"))),
        "{events:?}"
    );
    let m = unschedulable_message(c, "foreign", |_| true).await;
    assert_eq!(m, format!("1 node: 1 is {arch} not {other_arch}"));

    // A node whose agent runs Firecracker takes it, and only it.
    node(c, "fc-node", "8", "16Gi", true, true).await;
    advertise_runtimes(c, "fc-node", "firecracker,qemu").await;
    let v = common::wait_vm(&vms(c), "needs-fc", "needs-fc Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    assert_eq!(v.spec.node_name.as_deref(), Some("fc-node"));

    // The other-arch class finds no node of its arch among two of this host's.
    let m = unschedulable_message(c, "foreign", |m| m.starts_with("2 nodes")).await;
    assert_eq!(m, format!("2 nodes: 2 are {arch} not {other_arch}"));
    assert_eq!(
        placements(c).await,
        BTreeMap::from([("fc-node".to_owned(), 1)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_pinned_by_a_user_gets_the_finalizer_and_its_booked_size() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let _op = Operator::start(&e, "solo", &[]).await;
    vm(
        c,
        "pinned",
        json!({"classRef": {"name": "small"}, "image": "busybox", "nodeName": "a"}),
    )
    .await;
    let v = common::wait_vm(&vms(c), "pinned", "pinned Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    assert_eq!(v.status.as_ref().unwrap().node_name.as_deref(), Some("a"));
    assert!(v.finalizers().iter().any(|f| f == "imp.dev/vm-cleanup"));
    assert_eq!(
        v.annotations()
            .get("imp.dev/placed-resources")
            .map(String::as_str),
        Some(r#"{"vcpu":1,"memoryMiB":256}"#)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expire_after_deletes_running_and_ended_vms() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let op = Operator::start(&e, "solo", &[]).await;
    vm(
        c,
        "short",
        json!({"classRef": {"name": "small"}, "image": "busybox", "expireAfter": "60s"}),
    )
    .await;
    common::wait_vm(&vms(c), "short", "short Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    // expireAfter must be at least 60s, so the VM "first ran" 55–56 s ago (whole seconds, as the
    // API stores times): 4–5 s are left, room for a slow CI machine to look in between.
    let running_at = Timestamp::from_second(Timestamp::now().as_second() - 55).unwrap();
    agent_status(
        c,
        "short",
        json!({"phase": "Running", "runningAt": running_at.to_string()}),
    )
    .await;
    let expiring = common::wait_vm(&vms(c), "short", "expiresAt written", WAIT_SECS, |v| {
        v.status.as_ref().unwrap().expires_at.is_some()
    })
    .await;
    let st = expiring.status.as_ref().unwrap();
    assert_eq!(
        st.running_at.as_ref().map(|t| t.0),
        Some(running_at),
        "the first runningAt was overwritten"
    );
    let expires_at = st.expires_at.as_ref().unwrap().0;
    assert_eq!(expires_at, running_at + SignedDuration::from_secs(60));
    assert_eq!(
        st.observed_generation, expiring.metadata.generation,
        "the operator's status write names the generation it acted on"
    );

    // Not deleted before its time: not once the operator looked at it again.
    op.looked_at(c, &["short"]).await;
    let early = vms(c).get("short").await.unwrap();
    assert!(
        Timestamp::now() < expires_at,
        "too slow to check for an early deletion"
    );
    assert!(
        early.metadata.deletion_timestamp.is_none(),
        "deleted before expiresAt {expires_at}"
    );
    assert_eq!(phase(&early), Some(VmPhase::Running));

    // Then deleted through the finalizer: Terminating until the agent has cleaned up.
    let term = common::wait_vm(
        &vms(c),
        "short",
        "short Terminating after expiry",
        WAIT_SECS,
        |v| phase(v) == Some(VmPhase::Terminating),
    )
    .await;
    let late = Timestamp::now().duration_since(expires_at);
    assert!(
        late < SignedDuration::from_secs(3),
        "deleted {late:?} after expiresAt"
    );
    let deleted_at = term.metadata.deletion_timestamp.as_ref().unwrap().0;
    assert!(
        deleted_at >= expires_at,
        "deleted at {deleted_at}, before expiresAt {expires_at}"
    );
    let expired = common::events_with(c, NS, "short", &["Expired"])
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("Expired"))
        .expect("no Expired event");
    assert_eq!(expired.type_.as_deref(), Some("Normal"));
    agent_clear_node(c, "short").await;
    common::wait_for("short gone", Duration::from_secs(10), || async {
        vms(c)
            .get_opt("short")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    eprintln!("expired VM deleted {late:?} after expiresAt");

    // Ended VMs expire too, like a Job past its TTL. `done` Succeeded after first running two
    // minutes ago (its node already released, as the agent does for an ended ephemeral VM);
    // `broke`, persistent, Failed without ever running: its expiry counts from finishedAt and
    // comes before its (default) restart.
    for n in ["done", "broke"] {
        let lifecycle = if n == "done" {
            "ephemeral"
        } else {
            "persistent"
        };
        vm(
            c,
            n,
            json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": lifecycle,
                   "expireAfter": "60s"}),
        )
        .await;
        common::wait_vm(&vms(c), n, "Scheduled", WAIT_SECS, |v| {
            phase(v) == Some(VmPhase::Scheduled)
        })
        .await;
    }
    let long_ago = Timestamp::from_second(Timestamp::now().as_second() - 120).unwrap();
    agent_status(
        c,
        "done",
        json!({"phase": "Succeeded", "exitCode": 0, "runningAt": long_ago.to_string(),
               "finishedAt": Timestamp::now().to_string()}),
    )
    .await;
    agent_clear_node(c, "done").await;
    agent_status(
        c,
        "broke",
        json!({"phase": "Failed", "exitCode": 3, "finishedAt": long_ago.to_string()}),
    )
    .await;
    common::wait_for("done gone", Duration::from_secs(10), || async {
        vms(c)
            .get_opt("done")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let term = common::wait_vm(
        &vms(c),
        "broke",
        "broke Terminating after expiry",
        WAIT_SECS,
        |v| phase(v) == Some(VmPhase::Terminating),
    )
    .await;
    let st = term.status.as_ref().unwrap();
    assert_eq!(
        st.expires_at.as_ref().map(|t| t.0),
        Some(long_ago + SignedDuration::from_secs(60)),
        "expiry of a VM that never ran counts from finishedAt"
    );
    assert_eq!(st.restart_count, None, "restarted instead of expiring");
    for (n, since) in [("done", "first ran"), ("broke", "ended")] {
        let expired = common::events_with(c, NS, n, &["Expired"])
            .await
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Expired"))
            .unwrap();
        let note = expired.message.unwrap_or_default();
        assert!(note.contains(since), "{n}: {note}");
    }
    agent_clear_node(c, "broke").await;
    common::wait_for("broke gone", Duration::from_secs(10), || async {
        vms(c)
            .get_opt("broke")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cool_down_after_exhausted_retries_runs_the_vm_again() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let op = Operator::start(&e, "solo", &[]).await;
    // coolDownPeriod has no minimum; 3 s leaves room to see the VM wait.
    vm(
        c,
        "flaky",
        json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": "persistent",
               "restartPolicy": {"mode": "in-place", "onExhaustion": "cool-down", "coolDownPeriod": "3s",
                                 "backoff": {"maxRetries": 1, "initialDelay": "1s", "maxDelay": "1s"}}}),
    )
    .await;
    common::wait_vm(&vms(c), "flaky", "flaky Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    agent_status(c, "flaky", json!({"phase": "Failed", "exitCode": 3})).await;
    common::wait_vm(&vms(c), "flaky", "flaky restarted", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled) && v.status.as_ref().unwrap().restart_count == Some(1)
    })
    .await;
    agent_status(c, "flaky", json!({"phase": "Failed", "exitCode": 3})).await;

    // Retries used up: exhaustedAt is stamped and the VM stays Failed (not RetryExhausted, which
    // waits for a manual reset) for the cool-down.
    let ex = common::wait_vm(&vms(c), "flaky", "flaky exhaustedAt", WAIT_SECS, |v| {
        v.status.as_ref().unwrap().exhausted_at.is_some()
    })
    .await;
    assert_eq!(phase(&ex), Some(VmPhase::Failed));
    let exhausted_at = ex.status.as_ref().unwrap().exhausted_at.as_ref().unwrap().0;
    let cool_end = exhausted_at + SignedDuration::from_secs(3);
    // Still cooling down once the operator looked at it again.
    op.looked_at(c, &["flaky"]).await;
    let cooling = vms(c).get("flaky").await.unwrap();
    assert!(
        Timestamp::now() < cool_end,
        "too slow to check the cool-down"
    );
    let st = cooling.status.as_ref().unwrap();
    assert_eq!(phase(&cooling), Some(VmPhase::Failed));
    assert_eq!(st.restart_count, Some(1));
    assert_eq!(st.exhausted_at.as_ref().map(|t| t.0), Some(exhausted_at));

    // After the cool-down the counters are zeroed and the VM is really placed again.
    let again = common::wait_vm(
        &vms(c),
        "flaky",
        "flaky scheduled again after the cool-down",
        WAIT_SECS,
        |v| {
            let st = v.status.as_ref().unwrap();
            phase(v) == Some(VmPhase::Scheduled)
                && st.restart_count.is_none()
                && st.exhausted_at.is_none()
        },
    )
    .await;
    assert!(
        Timestamp::now() >= cool_end,
        "scheduled again before the cool-down ended at {cool_end}"
    );
    let st = again.status.as_ref().unwrap();
    assert_eq!(again.spec.node_name.as_deref(), Some("a"));
    assert_eq!(st.node_name.as_deref(), Some("a"));
    assert_eq!(st.next_retry_after, None);
    assert_eq!(st.exit_code, None, "the last run's exit code is kept");
    let s = cond(&again, "Scheduled").unwrap();
    assert_eq!(
        (s.status.as_str(), s.reason.as_str()),
        ("True", "NodeAssigned")
    );

    // It runs, and the next failure gets a fresh retry budget instead of exhausting at once.
    agent_status(c, "flaky", json!({"phase": "Running"})).await;
    common::wait_vm(&vms(c), "flaky", "flaky running again", WAIT_SECS, |v| {
        cond(v, "NodeHealthy").is_some_and(|c| c.status == "True")
            && phase(v) == Some(VmPhase::Running)
    })
    .await;
    agent_status(c, "flaky", json!({"phase": "Failed", "exitCode": 3})).await;
    common::wait_vm(
        &vms(c),
        "flaky",
        "flaky restarted after the cool-down",
        WAIT_SECS,
        |v| {
            let st = v.status.as_ref().unwrap();
            phase(v) == Some(VmPhase::Scheduled)
                && st.restart_count == Some(1)
                && st.exhausted_at.is_none()
        },
    )
    .await;
    let events = common::events_with(
        c,
        NS,
        "flaky",
        &["Restarting", "CoolingDown", "CoolDownOver"],
    )
    .await;
    for (reason, type_) in [
        ("Restarting", "Normal"),
        ("CoolingDown", "Warning"),
        ("CoolDownOver", "Normal"),
    ] {
        assert!(
            events
                .iter()
                .any(|e| e.reason.as_deref() == Some(reason) && e.type_.as_deref() == Some(type_)),
            "no {type_} {reason} event in {:?}",
            events.iter().map(|e| &e.reason).collect::<Vec<_>>()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placed_vm_keeps_its_booking_when_its_class_changes_and_users_cannot_edit_it() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    // 4 vCPU × 0.9 = 3.6.
    node(c, "only", "4", "16Gi", true, true).await;
    class(c, "grow", 1, 256).await;
    let op = Operator::start(&e, "solo", &[]).await;
    vm(
        c,
        "first",
        json!({"classRef": {"name": "grow"}, "image": "busybox"}),
    )
    .await;
    let first = common::wait_vm(
        &vms(c),
        "first",
        "first Scheduled with its booking",
        WAIT_SECS,
        |v| {
            phase(v) == Some(VmPhase::Scheduled)
                && v.status.as_ref().is_some_and(|s| s.booking.is_some())
        },
    )
    .await;
    let booked = first.status.unwrap().booking.unwrap();
    assert_eq!((booked.class.vcpu, booked.class.memory_mib), (1, 256));
    assert_eq!(booked.spec.inherited.image.as_deref(), Some("busybox"));
    // The class grows to 2 vCPU: the placed VM keeps 1 booked, so two more 2-vCPU VMs find
    // 2.6 vCPU free (room for one). Counting the live class would leave 1.6 (room for none).
    Api::<ImpVMClass>::all(c.clone())
        .patch(
            "grow",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"vcpu": 2}})),
        )
        .await
        .unwrap();
    second_and_third_one_placed(c, "grow").await;
    // The class is deleted: the placed VMs keep their bookings and stay valid.
    Api::<ImpVMClass>::all(c.clone())
        .delete("grow", &DeleteParams::default())
        .await
        .unwrap();
    op.looked_at(c, &["first", "second", "third"]).await;
    let first = vms(c).get("first").await.unwrap();
    assert!(
        cond(&first, "Ready").is_none_or(|c| c.reason != "InvalidSpec"),
        "{:?}",
        first.status
    );
    let status = first.status.unwrap();
    assert_eq!(status.booking.unwrap().class.vcpu, 1);
    assert_eq!(status.phase, Some(VmPhase::Scheduled));
    assert_eq!(placements(c).await.get("only"), Some(&2), "node overbooked");
    // A user who may edit the VM may not write its status, so not its booking either.
    let (alice, _) = common::exec_users(&e.kube, NS).await;
    let as_alice = e.kube.cp.client_from(&alice).await.unwrap();
    let refused = Api::<ImpVM>::namespaced(as_alice, NS)
        .patch_status(
            "first",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"booking": {"class": {"vcpu": 64}}}})),
        )
        .await;
    match refused {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("a user rewrote the booking: {other:?}"),
    }
}

/// The sum of `imp_operator_conflicts_total` over both writes of `resource`.
fn conflicts(text: &str, resource: &str) -> f64 {
    ["main", "status"]
        .iter()
        .filter_map(|w| {
            sample(
                text,
                &format!("imp_operator_conflicts_total{{resource=\"{resource}\",write=\"{w}\"}}"),
            )
        })
        .sum()
}

/// Changes VM `name` (an annotation) as fast as the API server takes it, until `stop`.
async fn keep_changing(
    c: Client,
    name: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let mut n = 0u64;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        n += 1;
        let body = json!({"metadata": {"annotations": {"test.imp.dev/tick": n.to_string()}}});
        vms(&c)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .unwrap();
    }
}

/// The guide's "status patch conflict loops" and "reconciliation backlog growth" made visible:
/// writers that race the operator (another controller, a user's script) make its
/// preconditioned writes meet real 409s from the API server, counted in
/// `imp_operator_conflicts_total`; once they stop, every VM converges and the backlog gauge
/// drains to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_writers_are_counted_and_the_backlog_drains() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "c1", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let names: Vec<String> = (0..6).map(|i| format!("race{i}")).collect();
    for name in &names {
        vm(
            c,
            name,
            json!({"classRef": {"name": "small"}, "image": "busybox"}),
        )
        .await;
    }
    let op = Operator::start(&e, "solo", &[]).await;
    let before = common::wait_for("the operator's metrics", Duration::from_secs(20), || {
        op.scrape()
    })
    .await;
    assert_eq!(conflicts(&before, "impvm"), 0.0, "{before}");
    // The writers change every VM while the operator places them; the node going NotReady and
    // Ready again makes the operator write each VM's NodeHealthy condition over and over.
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = names
        .iter()
        .map(|n| tokio::spawn(keep_changing(c.clone(), n.clone(), stop.clone())))
        .collect();
    let flipper = {
        let (c, stop) = (c.clone(), stop.clone());
        tokio::spawn(async move {
            let mut ready = true;
            while !stop.load(Ordering::SeqCst) {
                ready = !ready;
                set_node_ready(&c, "c1", "8", "16Gi", ready).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    let counted = common::wait_for("a 409 counted", Duration::from_secs(60), || async {
        let t = op.scrape().await?;
        (conflicts(&t, "impvm") > 0.0).then_some(t)
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    flipper.await.unwrap();
    set_node_ready(c, "c1", "8", "16Gi", true).await;
    eprintln!(
        "conflicts counted: {} (impvm), {} (impnetwork)",
        conflicts(&counted, "impvm"),
        conflicts(&counted, "impnetwork")
    );

    // Once nothing races it, every VM converges and no reconcile is left waiting.
    common::wait_for("every VM Scheduled", Duration::from_secs(30), || async {
        let items = vms(c).list(&ListParams::default()).await.unwrap().items;
        items
            .iter()
            .all(|v| {
                phase(v) == Some(VmPhase::Scheduled)
                    && cond(v, "NodeHealthy").is_some_and(|h| h.status == "True")
            })
            .then_some(())
    })
    .await;
    let backlog = "imp_operator_reconcile_backlog{controller=\"impvm\"}";
    let idle = common::wait_for("the backlog drained", Duration::from_secs(20), || async {
        let t = op.scrape().await?;
        (sample(&t, backlog) == Some(0.0)).then_some(t)
    })
    .await;
    assert!(
        idle.contains("# HELP imp_operator_reconcile_backlog Objects a watch event asked"),
        "{idle}"
    );
}

/// Plays node `node`'s agent renewing its Lease (deadline `secs`), every 300 ms until dropped.
fn renew_agent_lease(c: &Client, node: &str, secs: i64) -> tokio::task::JoinHandle<()> {
    renew_lease(c, "imp-system", &format!("imp-agent-{node}"), node, secs)
}

/// Renews Lease `ns/name`, labelled as an agent's, held by `node` with a deadline of `secs`,
/// every 300 ms until dropped (an agent, or someone playing one).
fn renew_lease(
    c: &Client,
    ns: &str,
    name: &str,
    node: &str,
    secs: i64,
) -> tokio::task::JoinHandle<()> {
    let api: Api<Lease> = Api::namespaced(c.clone(), ns);
    let name = name.to_owned();
    let node = node.to_owned();
    tokio::spawn(async move {
        loop {
            let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                k8s_openapi::jiff::Timestamp::now(),
            );
            let body = json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "labels": {imp_api::shared::LABEL_AGENT_LEASE: "true"}},
                "spec": {"holderIdentity": node, "leaseDurationSeconds": secs, "renewTime": now}
            });
            api.patch(
                &name,
                &PatchParams::apply("test-agent").force(),
                &Patch::Apply(&body),
            )
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_nodes_vm_moves_only_once_its_agent_has_surely_fenced_it() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    // Node-loss grace 3 s (Operator::start), agent deadline 3 s, margin 1 s.
    let op = Operator::start(
        &e,
        "solo",
        &["--fence-margin", "1", "--agent-fence-after", "3s"],
    )
    .await;
    let renewing = renew_agent_lease(c, "a", 3);
    vm(
        c,
        "mover",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    common::wait_vm(&vms(c), "mover", "on node a", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    agent_status(c, "mover", json!({"phase": "Running"})).await;
    node(c, "b", "8", "16Gi", true, true).await;
    set_node_ready(c, "a", "8", "16Gi", false).await;
    // Past the node-loss grace, the VM stays while node a's agent renews: it may run it.
    let held = common::wait_vm(
        &vms(c),
        "mover",
        "held while the agent renews",
        WAIT_SECS,
        |v| cond(v, "NodeHealthy").is_some_and(|c| c.message.contains("renewed its Lease")),
    )
    .await;
    assert_eq!(held.spec.node_name.as_deref(), Some("a"));
    let msg = &cond(&held, "NodeHealthy").unwrap().message;
    assert!(msg.contains("silent 4s"), "{msg}");
    // Still there after the agent's whole deadline (3 s + 1 s margin) while it keeps renewing:
    // every time the operator looked at the VM over those 4 s, it left it on node a.
    let whole_deadline = Instant::now() + Duration::from_secs(4);
    let mut looks = 0;
    while looks == 0 || Instant::now() < whole_deadline {
        op.looked_at(c, &["mover"]).await;
        looks += 1;
        let still = vms(c).get("mover").await.unwrap();
        assert_eq!(
            still.spec.node_name.as_deref(),
            Some("a"),
            "moved under a live agent (look {looks})"
        );
    }
    // The agent falls silent (cut off): the VM moves once 3 s + 1 s have surely passed.
    renewing.abort();
    let _ = renewing.await;
    let cut = Instant::now();
    // ... whatever Leases others write meanwhile claiming to be node a's agent: a tenant's in
    // its own namespace and one of another name in the agents' namespace, both renewed with a
    // deadline of 10^6 s (the VM would never move), and the agent's own rewritten with a
    // deadline of 1 s (it would move at once, while a's copy may still run; the API server
    // itself refuses 0), then of 10^6 s.
    let forgers = [
        renew_lease(c, NS, "imp-agent-a", "a", 1_000_000),
        renew_lease(c, "imp-system", "imp-agent-forged", "a", 1_000_000),
    ];
    let own = Api::<Lease>::namespaced(c.clone(), "imp-system");
    for secs in [1, 1_000_000] {
        own.patch(
            "imp-agent-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"leaseDurationSeconds": secs}})),
        )
        .await
        .unwrap();
    }
    // The operator saw those of the agents' namespace (it watches no other), in order, and
    // ignored them.
    let ignored = |t: &str, why: &str| {
        sample(
            t,
            &format!("imp_operator_agent_leases_ignored_total{{reason=\"{why}\"}}"),
        )
        .unwrap_or(0.0)
    };
    common::wait_for(
        "the forged Leases counted as ignored",
        Duration::from_secs(WAIT_SECS),
        || async {
            let t = op.scrape().await?;
            (ignored(&t, "holder") >= 1.0 && ignored(&t, "duration") >= 1.0).then_some(())
        },
    )
    .await;
    // The placement writes spec.nodeName, then the status that says Scheduled: wait for both.
    let moved = common::wait_vm(&vms(c), "mover", "mover on node b", WAIT_SECS, |v| {
        v.spec.node_name.as_deref() == Some("b") && phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    let after = cut.elapsed();
    eprintln!(
        "fencing timeline: moved {:.1} s after the agent's last renewal (deadline 3 s + margin 1 s)",
        after.as_secs_f64()
    );
    assert!(
        after >= Duration::from_millis(3700),
        "moved after {after:?}"
    );
    assert_eq!(moved.status.unwrap().node_name.as_deref(), Some("b"));
    for f in forgers {
        assert!(!f.is_finished(), "a forger stopped early");
        f.abort();
    }
}

/// With no admission webhook (these tests register none), what the webhook would refuse is
/// refused by the controllers instead, never stored and silently ignored: a VM whose env
/// names a source nothing reads waits in Pending with `InvalidSpec` naming the field (a
/// valid class is there, so it would otherwise be placed), and every object of a kind no
/// controller acts on says so in its status (a migration fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_webhook_refuses_the_controllers_refuse_too() {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    let _op = Operator::start(&e, "solo", &[]).await;
    node(c, "w1", "4", "8Gi", true, true).await;
    class(c, "small", 1, 256).await;
    vm(
        c,
        "field-ref",
        json!({"classRef": {"name": "small"}, "image": "busybox",
               "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}),
    )
    .await;
    vm(
        c,
        "fine",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    let v = common::wait_vm(
        &vms(c),
        "field-ref",
        "InvalidSpec on field-ref",
        WAIT_SECS,
        |v| cond(v, "Ready").is_some_and(|c| c.reason == "InvalidSpec"),
    )
    .await;
    let msg = &cond(&v, "Ready").unwrap().message;
    assert!(
        msg.contains("spec.env[0].valueFrom.fieldRef") && msg.contains("not supported yet"),
        "{msg}"
    );
    // The operator placed the other VM after it judged this one: it is not merely slow.
    common::wait_vm(&vms(c), "fine", "fine Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    let v = vms(c).get("field-ref").await.unwrap();
    assert_eq!(phase(&v), Some(VmPhase::Pending));
    assert_eq!(v.spec.node_name, None);

    for (kind, spec) in [(
        "ImpVMRunnerPool",
        json!({"templateName": "t",
                   "platform": {"type": "github-actions", "scope": {"repo": "o/r"},
                                "credentialsSecret": "gh"},
                   "scaling": {"mode": "webhook", "minIdle": 0, "maxConcurrent": 2, "scaleUpStep": 1, "cooldownSeconds": 30,
                               "webhook": {"secretRef": "hook"}}}),
    )] {
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("imp.dev", "v1alpha1", kind));
        let api: Api<DynamicObject> = Api::namespaced_with(c.clone(), NS, &resource);
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": kind,
            "metadata": {"name": "x", "namespace": NS}, "spec": spec
        }))
        .unwrap();
        api.create(&PostParams::default(), &obj).await.unwrap();
        let got = common::wait_for(
            &format!("{kind} refused in its status"),
            Duration::from_secs(WAIT_SECS),
            || async {
                let o = api.get("x").await.ok()?;
                let conds = o.data["status"]["conditions"].as_array()?.clone();
                conds
                    .iter()
                    .any(|c| c["type"] == "Ready" && c["reason"] == "NotSupported")
                    .then_some(o)
            },
        )
        .await;
        let cond = got.data["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()
            .clone();
        assert_eq!(cond["status"], "False");
        let msg = cond["message"].as_str().unwrap();
        assert!(
            msg.starts_with(kind) && msg.contains("not supported yet"),
            "{msg}"
        );
    }
}

fn pools(c: &Client) -> Api<imp_api::ImpWarmPool> {
    Api::namespaced(c.clone(), NS)
}

/// Waits until pool `py`'s Ready condition has `reason` and `pred` holds of the pool.
async fn wait_pool(
    c: &Client,
    reason: &str,
    pred: impl Fn(&imp_api::ImpWarmPool) -> bool,
) -> imp_api::ImpWarmPool {
    common::wait_for(
        &format!("pool py with Ready reason {reason}"),
        Duration::from_secs(WAIT_SECS),
        || async {
            let p = pools(c).get("py").await.ok()?;
            let status = p.status.as_ref()?;
            let ready = status.conditions.iter().find(|c| c.type_ == "Ready")?;
            (ready.reason == reason && pred(&p)).then_some(p)
        },
    )
    .await
}

/// The pool's members not being deleted (a deleted one waits for its node's agent to let
/// go of it, which no agent here does), oldest first.
async fn members(c: &Client) -> Vec<ImpVM> {
    let mut m: Vec<ImpVM> = vms(c)
        .list(&ListParams::default().labels("imp.dev/warm-pool=py"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|v| v.metadata.deletion_timestamp.is_none())
        .collect();
    m.sort_by_key(|v| (v.creation_timestamp(), v.name_any()));
    m
}

/// Plays the agent: member `name` runs and is Ready.
async fn member_runs(c: &Client, name: &str) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    agent_status(
        c,
        name,
        json!({"phase": "Running", "runningAt": now,
               "conditions": [{"type": "Ready", "status": "True", "reason": "Running",
                               "message": "", "lastTransitionTime": now}]}),
    )
    .await;
}

/// Issue 39, layer 3: a pool names what it lacks (its parent, a base), fills from the elected
/// base with members the VM controller places like any restore, counts them ready, scales
/// down, and replaces a member that fails. The test plays the node agent (members' phases,
/// the execution's end), as the rest of this file does; `snapshot_clones_e2e.rs` fills a
/// pool with real guests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_pool_fills_scales_and_says_what_it_lacks() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    node(c, "a", "8", "16Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let op = Operator::start(&e, "solo", &[]).await;
    python_template(c).await;
    warm_pool(c, 2).await;
    let p = wait_pool(c, "InvalidSpec", |_| true).await;
    let msg = &p.status.as_ref().unwrap().conditions[0].message;
    assert!(
        msg.starts_with("spec.snapshotRef: ImpVMSnapshot default/py-warm does not exist"),
        "{msg}"
    );

    // The parent exists; its one execution waits for the source's node: no base yet.
    vm(
        c,
        "src",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    common::create_imp(
        c,
        "ImpVMSnapshot",
        "impvmsnapshots",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
               "metadata": {"name": "py-warm", "namespace": NS},
               "spec": {"sourceVMName": "src", "sourceVMNamespace": NS,
                        "storage": {"type": "node-local"}}}),
    )
    .await;
    let p = wait_pool(c, "NoBase", |_| true).await;
    assert!(
        p.status.as_ref().unwrap().conditions[0]
            .message
            .contains("set its spec.baseSnapshot")
    );
    assert!(members(c).await.is_empty());

    // The node takes the execution (played here); the user elects it.
    let snaps: Api<imp_api::snapshot::ImpVMSnapshot> = Api::namespaced(c.clone(), NS);
    let exec = common::wait_for(
        "the parent's execution",
        Duration::from_secs(WAIT_SECS),
        || async {
            snaps
                .list(&ListParams::default().labels("imp.dev/snapshot-parent=py-warm"))
                .await
                .ok()?
                .items
                .into_iter()
                .next()
        },
    )
    .await
    .name_any();
    snaps
        .patch(
            &exec,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"imp.dev/snapshot-node": "a"}}})),
        )
        .await
        .unwrap();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    snaps
        .patch_status(
            &exec,
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"status": {"phase": "Succeeded", "terminatedAt": now,
                                             "completedAt": now,
                                             "snapshotPath": "/var/lib/imp/snapshots/x"}}),
            ),
        )
        .await
        .unwrap();
    snaps
        .patch(
            "py-warm",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"baseSnapshot": exec}})),
        )
        .await
        .unwrap();

    // Two members, made from the template, restoring from the base, placed on its node.
    let p = wait_pool(c, "Waiting", |p| {
        p.status.as_ref().unwrap().base_snapshot.as_deref() == Some(exec.as_str())
    })
    .await;
    assert_eq!(p.status.as_ref().unwrap().ready_count, 0);
    let placed = members_placed(c, 2).await;
    for m in &placed {
        assert!(m.name_any().starts_with("py-"), "{}", m.name_any());
        assert_eq!(m.spec.snapshot_ref.as_deref(), Some(exec.as_str()));
        assert_eq!(m.spec.template_ref.as_ref().unwrap().name, "python");
        assert_eq!(m.spec.node_name.as_deref(), Some("a"));
        assert_eq!(m.owner_references()[0].name, "py");
        assert_eq!(m.owner_references()[0].controller, Some(true));
    }

    // Ready once both run.
    for m in &placed {
        member_runs(c, &m.name_any()).await;
    }
    let p = wait_pool(c, "Reconciled", |p| {
        p.status.as_ref().unwrap().ready_count == 2
    })
    .await;
    assert_eq!(
        p.status.as_ref().unwrap().observed_generation,
        p.metadata.generation
    );
    let text = op.scrape().await.unwrap();
    assert_eq!(
        sample(&text, "imp_operator_warmpool_ready{pool=\"default/py\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "imp_operator_warmpool_size{pool=\"default/py\"}"),
        Some(2.0)
    );

    // size 2 → 1: the oldest ready member goes.
    pools(c)
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"size": 1}})),
        )
        .await
        .unwrap();
    wait_pool(c, "Reconciled", |p| {
        p.status.as_ref().unwrap().ready_count == 1
    })
    .await;
    let left = common::wait_for(
        "one member left",
        Duration::from_secs(WAIT_SECS),
        || async {
            let m = members(c).await;
            (m.len() == 1).then_some(m)
        },
    )
    .await;
    assert_eq!(left[0].name_any(), placed[1].name_any());

    // The member fails: deleted, counted and replaced.
    agent_status(
        c,
        &left[0].name_any(),
        json!({"phase": "Failed",
               "conditions": [{"type": "Ready", "status": "False", "reason": "VmmExited",
                               "message": "the VMM exited", "lastTransitionTime": now}]}),
    )
    .await;
    let p = wait_pool(c, "Waiting", |p| {
        p.status.as_ref().unwrap().failed_in_a_row == 1
    })
    .await;
    assert_eq!(p.status.as_ref().unwrap().ready_count, 0);
    let replaced = common::wait_for("a replacement", Duration::from_secs(WAIT_SECS), || async {
        let m = members(c).await;
        (m.len() == 1 && m[0].name_any() != left[0].name_any()).then_some(m)
    })
    .await;
    let events = common::events_of(c, NS, "py").await;
    let said = |reason: &str, needle: &str| {
        events.iter().any(|ev| {
            ev.reason.as_deref() == Some(reason)
                && ev.message.as_deref().is_some_and(|m| m.contains(needle))
        })
    };
    assert!(said("MemberDeleted", "the VMM exited"), "{events:?}");
    assert!(said("MemberCreated", &replaced[0].name_any()), "{events:?}");

    // Claims the webhook would refuse (it is off here) are refused by the operator too,
    // naming the field, and take no member: another namespace's pool, a pool that does not
    // exist, a class of its own.
    for (name, spec, field) in [
        (
            "across",
            json!({"templateRef": {"name": "python"},
                   "warmPoolRef": {"name": "py", "namespace": "other"}}),
            "spec.warmPoolRef.namespace",
        ),
        (
            "nopool",
            json!({"templateRef": {"name": "python"}, "warmPoolRef": {"name": "nope"}}),
            "spec.warmPoolRef: ImpWarmPool default/nope does not exist",
        ),
        (
            "othertemplate",
            json!({"classRef": {"name": "small"}, "image": "busybox",
                   "warmPoolRef": {"name": "py"}}),
            "spec.classRef: may not be set beside spec.warmPoolRef",
        ),
    ] {
        vm(c, name, spec).await;
        let v = common::wait_vm(&vms(c), name, "InvalidSpec", WAIT_SECS, |v| {
            cond(v, "Ready").is_some_and(|c| c.reason == "InvalidSpec")
        })
        .await;
        let msg = &cond(&v, "Ready").unwrap().message;
        assert!(msg.contains(field), "{name}: {msg}");
        assert!(v.spec.node_name.is_none(), "{name} was placed");
    }
    let untouched = members(c).await;
    assert!(
        untouched
            .iter()
            .all(|m| !m.annotations().contains_key("imp.dev/claimed-by")),
        "a refused claim took a member"
    );
}

/// Template `python` (class `small`, image busybox), which the pools of these tests name.
async fn python_template(c: &Client) {
    common::create_imp(
        c,
        "ImpVMTemplate",
        "impvmtemplates",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
               "metadata": {"name": "python", "namespace": NS},
               "spec": {"classRef": {"name": "small"}, "image": "busybox"}}),
    )
    .await;
}

/// Pool `py` of `size` members of template `python`, from parent snapshot `py-warm`.
async fn warm_pool(c: &Client, size: i32) {
    common::create_imp(
        c,
        "ImpWarmPool",
        "impwarmpools",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
               "metadata": {"name": "py", "namespace": NS},
               "spec": {"snapshotRef": "py-warm", "templateName": "python", "size": size}}),
    )
    .await;
}

/// Waits until pool `py` has `n` members, each placed (`Scheduled`), and returns them.
async fn members_placed(c: &Client, n: usize) -> Vec<ImpVM> {
    common::wait_for(
        &format!("{n} members placed"),
        Duration::from_secs(WAIT_SECS),
        || async {
            let m = members(c).await;
            (m.len() == n && m.iter().all(|v| phase(v) == Some(VmPhase::Scheduled))).then_some(m)
        },
    )
    .await
}

/// A pool `py` of `size` members made from template `python`, restoring from an elected base
/// on node `a`, each played Running; returns them.
async fn filled_pool(c: &Client, size: i32) -> Vec<ImpVM> {
    python_template(c).await;
    vm(
        c,
        "src",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    let snaps: Api<imp_api::snapshot::ImpVMSnapshot> = Api::namespaced(c.clone(), NS);
    let exec = "py-warm-20260101-000000";
    common::create_imp(
        c,
        "ImpVMSnapshot",
        "impvmsnapshots",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
               "metadata": {"name": exec, "namespace": NS,
                            "labels": {"imp.dev/snapshot-parent": "py-warm"},
                            "annotations": {"imp.dev/snapshot-node": "a"}},
               "spec": {"sourceVMName": "src", "sourceVMNamespace": NS,
                        "storage": {"type": "node-local"}}}),
    )
    .await;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    snaps
        .patch_status(
            exec,
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"status": {"phase": "Succeeded", "terminatedAt": now,
                                             "completedAt": now}}),
            ),
        )
        .await
        .unwrap();
    common::create_imp(
        c,
        "ImpVMSnapshot",
        "impvmsnapshots",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
               "metadata": {"name": "py-warm", "namespace": NS},
               "spec": {"sourceVMName": "src", "sourceVMNamespace": NS, "baseSnapshot": exec,
                        "storage": {"type": "node-local"}}}),
    )
    .await;
    warm_pool(c, size).await;
    let placed = members_placed(c, usize::try_from(size).unwrap()).await;
    for m in &placed {
        member_runs(c, &m.name_any()).await;
    }
    wait_pool(c, "Reconciled", |p| {
        p.status.as_ref().unwrap().ready_count == size
    })
    .await;
    placed
}

/// The operator's fault points in a claim (`imp_operator::vm::claim`), in their order.
const CLAIM_POINTS: [&str; 7] = [
    "claim.labelled",
    "claim.member-marked",
    "claim.written",
    "claim.pod-handed",
    "claim.address-moved",
    "claim.placed",
    "claim.recorded",
];

/// Waits until `n` claimants (`job*`, `step*`) are booked with a member, and returns them.
async fn booked_claims(c: &Client, n: usize) -> Vec<ImpVM> {
    common::wait_for(
        &format!("{n} claims booked"),
        Duration::from_secs(30),
        || async {
            let all = vms(c).list(&ListParams::default()).await.ok()?.items;
            let booked: Vec<ImpVM> = all
                .into_iter()
                .filter(|v| v.name_any().starts_with("job") || v.name_any().starts_with("step"))
                .filter(|v| {
                    v.status.as_ref().is_some_and(|s| {
                        s.booking.is_some()
                            && s.warm_claim.as_ref().is_some_and(|w| w.member.is_some())
                    })
                })
                .collect();
            (booked.len() == n).then_some(booked)
        },
    )
    .await
}

/// Each of `claims` took one of `members` (by uid), none went to two, each is bound to its
/// member's node and holds its member's reservation Pod and no other, and every marked member
/// is marked by the claimant that booked it: the set of claims taken `taken`.
async fn assert_claims_whole(
    c: &Client,
    members: &[ImpVM],
    claims: &[ImpVM],
) -> std::collections::BTreeSet<String> {
    let mut taken = std::collections::BTreeSet::new();
    for job in claims {
        let claim = job.status.as_ref().unwrap().warm_claim.clone().unwrap();
        let member = claim.member.unwrap();
        assert!(taken.insert(member.clone()), "{member} went to two claims");
        let was = members
            .iter()
            .find(|m| m.name_any() == member)
            .unwrap_or_else(|| panic!("{} took {member}, not a member", job.name_any()));
        assert_eq!(claim.member_uid, was.uid());
        assert_eq!(job.spec.node_name.as_deref(), Some("a"));
        let held = common::reservations_of(c, NS, &job.uid().unwrap()).await;
        assert_eq!(held, [format!("imp-vm-{member}")], "{}", job.name_any());
    }
    for v in vms(c).list(&ListParams::default()).await.unwrap().items {
        if let Some(by) = v.annotations().get("imp.dev/claimed-by") {
            let job = claims
                .iter()
                .find(|j| &j.name_any() == by)
                .unwrap_or_else(|| panic!("{} marked by {by}, which booked none", v.name_any()));
            let claim = job.status.as_ref().unwrap().warm_claim.as_ref().unwrap();
            assert_eq!(claim.member.as_deref(), Some(v.name_any().as_str()));
        }
    }
    taken
}

/// Issue 39: the operator killed (SIGKILL) as soon as a claim has marked its first member,
/// with three claims in flight; then killed by its fault points at each named step of a claim
/// in turn (`CLAIM_POINTS`). Once restarted, each claimant has exactly one member, no member
/// went to two, each claimant is bound to its member's node and holds its member's reservation
/// Pod and no other. A claimant whose nodeSelector no member's node matches starts cold. Then
/// the pool's deletion takes its unclaimed members only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_mid_claim_finishes_each_claim_once() {
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    // Room for the members, their claimants (counted beside them until a claimant runs) and
    // refills.
    node(c, "a", "32", "32Gi", true, true).await;
    class(c, "small", 1, 256).await;
    let mut op = Operator::start(&e, "first", &[]).await;
    let size = 3 + CLAIM_POINTS.len();
    let members_before = filled_pool(c, i32::try_from(size).unwrap()).await;
    let claimant = json!({"templateRef": {"name": "python"}, "warmPoolRef": {"name": "py"}});
    for i in 0..3 {
        vm(c, &format!("job{i}"), claimant.clone()).await;
    }
    common::wait_for(
        "a first member marked",
        Duration::from_secs(WAIT_SECS),
        || async {
            let all = vms(c).list(&ListParams::default()).await.ok()?.items;
            all.iter()
                .any(|v| v.annotations().contains_key("imp.dev/claimed-by"))
                .then_some(())
        },
    )
    .await;
    op.kill9().await;
    let mut op = Operator::start(&e, "second", &[]).await;
    let claims = booked_claims(c, 3).await;
    assert_claims_whole(c, &members_before, &claims).await;
    op.kill9().await;

    // Killed at each named step of one claim in turn; the next operator finishes it.
    for (i, point) in CLAIM_POINTS.iter().enumerate() {
        let mut dying = Operator::start_dying_at(&e, &format!("dies-{i}"), point).await;
        vm(c, &format!("step{i}"), claimant.clone()).await;
        dying.died(point).await;
        let mut op = Operator::start(&e, &format!("after-{i}"), &[]).await;
        let claims = booked_claims(c, 4 + i).await;
        assert_claims_whole(c, &members_before, &claims).await;
        op.kill9().await;
    }
    let claims = booked_claims(c, size).await;
    let taken = assert_claims_whole(c, &members_before, &claims).await;
    let _op = Operator::start(&e, "last", &[]).await;

    // A claimant whose own nodeSelector no member's node matches takes none: it starts cold,
    // saying why (a refill played Running first, so that a ready member exists).
    let refill = common::wait_for(
        "a refill placed",
        Duration::from_secs(WAIT_SECS),
        || async {
            members(c).await.into_iter().find(|m| {
                !m.annotations().contains_key("imp.dev/claimed-by")
                    && phase(m) == Some(VmPhase::Scheduled)
            })
        },
    )
    .await;
    member_runs(c, &refill.name_any()).await;
    common::wait_for(
        "the refill ready",
        Duration::from_secs(WAIT_SECS),
        || async {
            let p = pools(c).get("py").await.ok()?;
            (p.status?.ready_count >= 1).then_some(())
        },
    )
    .await;
    vm(
        c,
        "picky",
        json!({"templateRef": {"name": "python"}, "warmPoolRef": {"name": "py"},
               "nodeSelector": {"zone": "nowhere"}}),
    )
    .await;
    let picky = common::wait_vm(&vms(c), "picky", "a cold claim", WAIT_SECS, |v| {
        v.status
            .as_ref()
            .and_then(|s| s.warm_claim.as_ref())
            .is_some_and(|w| w.cold.is_some())
    })
    .await;
    let claim = picky.status.unwrap().warm_claim.unwrap();
    assert!(
        claim.member.is_none()
            && claim
                .cold
                .as_deref()
                .is_some_and(|w| w.contains("no ready member on a node this VM may run on")),
        "{claim:?}"
    );
    let still = vms(c).get(&refill.name_any()).await.unwrap();
    assert!(!still.annotations().contains_key("imp.dev/claimed-by"));

    // Deleting the pool deletes its unclaimed members (the garbage collector follows the
    // pool's owner reference), not the ones claims hold (their owner is the claimant now).
    pools(c)
        .delete("py", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_for(
        "the unclaimed members deleted with the pool",
        Duration::from_secs(60),
        || async {
            let left = vms(c)
                .list(&ListParams::default().labels("imp.dev/warm-pool=py"))
                .await
                .ok()?
                .items;
            left.iter()
                .filter(|v| !v.annotations().contains_key("imp.dev/claimed-by"))
                .all(|v| v.metadata.deletion_timestamp.is_some())
                .then_some(())
        },
    )
    .await;
    for member in &taken {
        let still = vms(c).get(member).await.unwrap();
        assert!(
            still.metadata.deletion_timestamp.is_none(),
            "claimed member {member} deleted with its pool"
        );
    }
}

fn migrations(c: &Client) -> Api<imp_api::ImpVMMigration> {
    Api::namespaced(c.clone(), NS)
}

/// Publishes an agent API on node `name`, as its agent does.
async fn publish_agent(c: &Client, name: &str) {
    let api: Api<Node> = Api::all(c.clone());
    let annotations = json!({"metadata": {"annotations": {
        imp_api::shared::ANNOTATION_AGENT_ENDPOINT: format!("{name}.example:10251"),
        imp_api::shared::ANNOTATION_AGENT_CERT_SHA256: "ab".repeat(32),
    }}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&annotations))
        .await
        .unwrap();
}

/// Creates migration `name` of VM `mover` to node `target`.
async fn migrate(c: &Client, name: &str, target: &str) {
    let m: imp_api::ImpVMMigration = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMMigration",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"sourceVMName": "mover", "sourceVMNamespace": "", "targetNode": target}
    }))
    .unwrap();
    migrations(c)
        .create(&PostParams::default(), &m)
        .await
        .unwrap();
}

/// Waits until the move in `mover`'s status is in `phase`; the VM then.
async fn move_in_phase(c: &Client, phase: imp_api::vm::MovePhase) -> ImpVM {
    common::wait_vm(
        &vms(c),
        "mover",
        &format!("a move {phase:?}"),
        WAIT_SECS,
        |v| {
            v.status
                .as_ref()
                .and_then(|s| s.moving.as_ref())
                .is_some_and(|m| m.phase == phase)
        },
    )
    .await
}

/// The operator's part of a move, with the agents played: the move written with both agents'
/// published API, nothing committed before the source says Sent, the commit, success once the
/// target reports the VM running there (with the downtime from the source's pause); and a
/// migration deleted before its commit held by its finalizer until the VM runs where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_commits_only_after_the_send_and_a_deleted_one_is_undone_first() {
    use imp_api::snapshot::MigrationPhase;
    use imp_api::vm::MovePhase;
    let Some(e) = env().await else {
        return;
    };
    let c = &e.client;
    for n in ["a", "b"] {
        node(c, n, "8", "16Gi", true, true).await;
        publish_agent(c, n).await;
    }
    class(c, "small", 1, 256).await;
    let _op = Operator::start(&e, "solo", &[]).await;
    vm(
        c,
        "mover",
        json!({"classRef": {"name": "small"}, "image": "busybox", "nodeName": "a"}),
    )
    .await;
    common::wait_vm(&vms(c), "mover", "mover Scheduled", WAIT_SECS, |v| {
        phase(v) == Some(VmPhase::Scheduled)
    })
    .await;
    agent_status(c, "mover", json!({"phase": "Running", "nodeName": "a"})).await;

    // Deleted before its commit: aborted, and gone only once the VM runs on a again.
    migrate(c, "cancelled", "b").await;
    let v = move_in_phase(c, MovePhase::Transferring).await;
    let mv = v.status.as_ref().unwrap().moving.clone().unwrap();
    assert_eq!((mv.source.as_str(), mv.target.as_str()), ("a", "b"));
    assert_eq!(mv.target_endpoint.as_deref(), Some("b.example:10251"));
    assert_eq!(mv.source_cert_sha256, Some("ab".repeat(32)));
    agent_status(c, "mover", json!({"phase": "Suspended"})).await;
    migrations(c)
        .delete("cancelled", &DeleteParams::default())
        .await
        .unwrap();
    move_in_phase(c, MovePhase::Aborting).await;
    let held = migrations(c).get_opt("cancelled").await.unwrap();
    assert!(
        held.is_some(),
        "the migration went before its move was undone"
    );
    assert_eq!(
        vms(c).get("mover").await.unwrap().spec.node_name.as_deref(),
        Some("a")
    );
    agent_status(c, "mover", json!({"phase": "Running"})).await;
    common::wait_for(
        "the cancelled migration gone",
        Duration::from_secs(WAIT_SECS),
        || async {
            migrations(c)
                .get_opt("cancelled")
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
    let v = vms(c).get("mover").await.unwrap();
    assert!(
        v.status.as_ref().unwrap().moving.is_none(),
        "{:?}",
        v.status
    );

    // Committed only after Sent, done only once the target runs it.
    migrate(c, "moved", "b").await;
    move_in_phase(c, MovePhase::Transferring).await;
    agent_status(c, "mover", json!({"phase": "Suspended"})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let v = vms(c).get("mover").await.unwrap();
    assert_eq!(
        v.spec.node_name.as_deref(),
        Some("a"),
        "committed before Sent"
    );
    let paused = k8s_openapi::jiff::Timestamp::now().as_millisecond() - 1500;
    agent_status(
        c,
        "mover",
        json!({"move": {"phase": "Sent", "bytesSent": 42, "pausedUnixMs": paused}}),
    )
    .await;
    let v = move_in_phase(c, MovePhase::Committed).await;
    assert_eq!(v.spec.node_name.as_deref(), Some("b"));
    let m = migrations(c).get("moved").await.unwrap();
    assert_eq!(m.status.unwrap().phase, Some(MigrationPhase::Restoring));
    agent_status(c, "mover", json!({"phase": "Running", "nodeName": "b"})).await;
    let m = common::wait_for(
        "migration moved Succeeded",
        Duration::from_secs(WAIT_SECS),
        || async {
            let m = migrations(c).get("moved").await.unwrap();
            (m.status.as_ref()?.phase == Some(MigrationPhase::Succeeded)).then_some(m)
        },
    )
    .await;
    let st = m.status.unwrap();
    assert_eq!(st.bytes_moved, Some(42));
    assert!(st.downtime_ms.is_some_and(|d| d >= 1500), "{st:?}");
    assert!(m.metadata.finalizers.unwrap_or_default().is_empty());
    let v = vms(c).get("mover").await.unwrap();
    assert!(
        v.status.as_ref().unwrap().moving.is_none(),
        "{:?}",
        v.status
    );
}
