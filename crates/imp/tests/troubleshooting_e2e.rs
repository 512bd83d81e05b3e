//! End-to-end: what the troubleshooting guide (`docs/troubleshooting.md`) tells a user to look
//! for is there, without booting a guest. The real `imp agent` and `imp operator` run against a
//! real kube-apiserver with their own ServiceAccounts; the agent's stderr is what
//! `kubectl logs -n imp-system ds/imp-agent` shows of its container.
//!
//! "RuntimeStartFailed — Firecracker binary not found": `kubectl logs … | grep FC_BIN` finds the
//! agent's line at startup, whether Firecracker is the node's default runtime or only a class
//! asks for it, and the VM that needs it says the same in its condition and Event.
//!
//! A Firecracker with no jailer beside it is refused the same way (`RuntimeStartFailed`, naming
//! the jailer's path and `--allow-unjailed-firecracker`): it would run as root, unconfined.
//!
//! "NoNodeAvailable — runs no firecracker": the agent publishes the runtimes it can run on its
//! Node (`imp.dev/runtimes`) and its CPU model in its ClusterImpNodeProfile.
//!
//! Needs only the control plane (and `qemu-system-x86_64` for the QEMU-default agent to be
//! ready, which the test does not require): without it, it skips on a developer machine and
//! fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use imp_api::vm::ImpVM;
use imp_testenv::registry::scratch_dir;
use kube::ResourceExt as _;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::process::{Child, Command};

const NS: &str = "default";

/// Where the agents are told the Firecracker binary is: nothing there.
const MISSING_FC: &str = "/nonexistent/imp-troubleshooting/firecracker";

/// One `imp agent` whose stderr the test reads (and passes on to the test's log).
struct Agent {
    child: Child,
    lines: common::LogLines,
    metrics_port: u16,
    state: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

impl Agent {
    /// Starts an agent for `node` with `runtime` as its default and Firecracker missing; the
    /// kernel and guest init are empty files (the agent only checks they exist).
    async fn start(kube: &common::Cluster, node: &str, runtime: &str, files: &Path) -> Self {
        Self::start_with(kube, node, runtime, files, Path::new(MISSING_FC)).await
    }

    /// [`Agent::start`] with the Firecracker binary `fc`.
    async fn start_with(
        kube: &common::Cluster,
        node: &str,
        runtime: &str,
        files: &Path,
        fc: &Path,
    ) -> Self {
        let kubeconfig = kube.agent_kubeconfig_for(node).await;
        let metrics_port = common::free_port();
        let state = scratch_dir(&format!("imp-troubleshooting-{node}")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_imp"))
            .arg("agent")
            .env("NODE_NAME", node)
            .env("FC_BIN", fc)
            .env("FC_KERNEL", files.join("vmlinux"))
            .env("IMP_GUEST", files.join("imp-guest"))
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", common::rust_log())
            .args(["--runtime", runtime, "--no-network"])
            .arg("--state-dir")
            .arg(&state)
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--api-addr", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = common::LogLines::default();
        common::tee_stderr(&mut child, &lines);
        Self {
            child,
            lines,
            metrics_port,
            state,
        }
    }

    /// Waits for a log line containing every one of `needles` (as `grep` would find it).
    async fn logged(&self, needles: &[&str]) -> String {
        common::logged(&self.lines, needles).await
    }

    async fn readyz(&self) -> (u16, String) {
        common::http_get(self.metrics_port, "/readyz")
            .await
            .unwrap_or_else(|e| panic!("the agent's ops port {}: {e}", self.metrics_port))
    }
}

/// The host files an agent checks at startup: a kernel, its modules directory, a guest init,
/// in a directory named after `tag` (one per test).
fn host_files(tag: &str) -> PathBuf {
    let dir = scratch_dir(&format!("imp-troubleshooting-files-{tag}")).unwrap();
    std::fs::write(dir.join("vmlinux"), b"").unwrap();
    std::fs::create_dir_all(dir.join("modules")).unwrap();
    std::fs::write(dir.join("imp-guest"), b"").unwrap();
    dir
}

/// Runs a quick command of the guide as a user types it (a shell pipeline with kubectl on its
/// PATH and the admin's kubeconfig); returns its output.
async fn quick_command(kube: &common::Cluster, script: &str) -> String {
    let kubectl = imp_testenv::controlplane::kubectl().unwrap();
    let path = format!(
        "{}:{}",
        kubectl.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", script])
        .env("PATH", path)
        .env("KUBECONFIG", kube.admin_kubeconfig());
    let out = common::output_within(cmd, Duration::from_secs(30), script).await;
    assert!(out.status.success(), "{script}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ready_reason(v: &ImpVM) -> Option<(String, String)> {
    let c = v
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.reason.clone(), c.message.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_firecracker_binary_is_named_fc_bin_in_the_agent_log_and_the_vm() {
    let _run = common::test_run("troubleshooting_e2e", Duration::from_secs(300));
    if common::control_plane_ready().is_none() {
        return;
    }
    let kube = common::cluster(&[NS, "imp-system"]).await;
    let c = kube.client.clone();
    let files = host_files("fc-bin");

    // Firecracker as the node's default runtime: the agent says at once why the node cannot
    // run VMs, naming FC_BIN, and its /readyz says so too.
    common::ready_node(&c, "fc-node").await;
    let mut fc = Agent::start(&kube, "fc-node", "firecracker", &files).await;
    let line = fc.logged(&["FC_BIN", MISSING_FC]).await;
    assert!(line.contains("node cannot run VMs"), "{line}");
    assert!(line.contains("not found"), "{line}");
    let (code, body) = fc.readyz().await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("FC_BIN"), "{body}");
    fc.child.kill().await.unwrap();

    // QEMU as the default: the startup line still names FC_BIN, and a VM whose class asks for
    // Firecracker fails to start with RuntimeStartFailed, saying the same in its condition,
    // its Event and the agent's log.
    common::ready_node(&c, "qemu-node").await;
    let qemu = Agent::start(&kube, "qemu-node", "qemu", &files).await;
    let line = qemu.logged(&["FC_BIN", "runtime firecracker"]).await;
    assert!(line.contains("RuntimeStartFailed"), "{line}");
    let _operator = common::start_operator(&kube);
    common::create_imp(
        &c,
        "ImpVMClass",
        "impvmclasses",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass", "metadata": {"name": "fc"},
               "spec": {"vcpu": 1, "memoryMiB": 128, "diskGiB": 1, "runtime": "firecracker"}}),
    )
    .await;
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let vm: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "needs-fc", "namespace": NS},
        "spec": {"classRef": {"name": "fc"}, "image": "busybox", "nodeName": "qemu-node"}
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let blocked = common::wait_vm(&vms, "needs-fc", "RuntimeStartFailed", 60, |v| {
        ready_reason(v).is_some_and(|r| r.0 == "RuntimeStartFailed")
    })
    .await;
    let (_, message) = ready_reason(&blocked).unwrap();
    assert!(
        message.contains("FC_BIN") && message.contains(MISSING_FC),
        "{message}"
    );
    let events = common::events_with(&c, NS, "needs-fc", &["RuntimeStartFailed"]).await;
    assert!(
        events
            .iter()
            .any(|e| e.message.as_deref().is_some_and(|m| m.contains("FC_BIN"))),
        "{events:?}"
    );
    let line = qemu.logged(&["FC_BIN", "cannot start the VM"]).await;
    assert!(line.contains("needs-fc"), "{line}");

    // The guide's quick commands, verbatim: the reason and FC_BIN in `describe` and the Events;
    // "VM stuck with InvalidSpec" for a VM whose class does not exist.
    let described = quick_command(&kube, "kubectl describe impvm needs-fc -n default").await;
    assert!(
        described.contains("RuntimeStartFailed") && described.contains("FC_BIN"),
        "{described}"
    );
    let vm: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "no-class", "namespace": NS},
        "spec": {"classRef": {"name": "does-not-exist"}, "image": "busybox"}
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    common::wait_vm(&vms, "no-class", "InvalidSpec", 30, |v| {
        ready_reason(v).is_some_and(|r| r.0 == "InvalidSpec")
    })
    .await;
    let conditions = quick_command(
        &kube,
        "kubectl describe impvm no-class -n default | grep -A5 Conditions",
    )
    .await;
    assert!(conditions.contains("InvalidSpec"), "{conditions}");
    common::events_with(&c, NS, "no-class", &["InvalidSpec"]).await;
    let events = quick_command(
        &kube,
        "kubectl get events -A --sort-by=.lastTimestamp | tail -n 100",
    )
    .await;
    for reason in ["RuntimeStartFailed", "InvalidSpec"] {
        assert!(events.contains(reason), "no {reason} in\n{events}");
    }

    let (code, body) = qemu.readyz().await;
    eprintln!("the QEMU-default agent's /readyz: {code}");
    assert!(
        !body.contains("FC_BIN"),
        "Firecracker is not this node's default: {body}"
    );

    // A Firecracker with no jailer beside it is not started (it would run as root,
    // unconfined): the VM fails with RuntimeStartFailed naming the missing jailer and the
    // opt-out flag, and the agent says so at startup.
    let fc_dir = files.join("fc");
    std::fs::create_dir_all(&fc_dir).unwrap();
    let bare_fc = fc_dir.join("firecracker");
    std::fs::write(&bare_fc, b"#!/bin/sh\nexit 1\n").unwrap();
    std::fs::set_permissions(
        &bare_fc,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    common::ready_node(&c, "nojail-node").await;
    let nojail = Agent::start_with(&kube, "nojail-node", "qemu", &files, &bare_fc).await;
    let line = nojail
        .logged(&["runtime firecracker", "--allow-unjailed-firecracker"])
        .await;
    assert!(line.contains("without its jailer"), "{line}");
    let vm: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "needs-jailer", "namespace": NS},
        "spec": {"classRef": {"name": "fc"}, "image": "busybox", "nodeName": "nojail-node"}
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let blocked = common::wait_vm(&vms, "needs-jailer", "RuntimeStartFailed", 60, |v| {
        ready_reason(v).is_some_and(|r| r.0 == "RuntimeStartFailed")
    })
    .await;
    let (_, message) = ready_reason(&blocked).unwrap();
    assert!(
        message.contains("without its jailer")
            && message.contains(&fc_dir.join("jailer").display().to_string())
            && message.contains("--allow-unjailed-firecracker"),
        "{message}"
    );
    drop((fc, qemu, nojail));
    std::fs::remove_dir_all(&files).unwrap();
}

/// The `cpuModel` of profile `name`, once it has one.
async fn cpu_model(profiles: &Api<imp_api::cluster::ClusterImpNodeProfile>, name: &str) -> String {
    common::wait_for(
        &format!("cpuModel of profile {name}"),
        Duration::from_secs(30),
        || async { profiles.get(name).await.unwrap().spec.cpu_model },
    )
    .await
}

/// What the scheduler reads about a node comes from its agent: the runtimes its probe found
/// (here QEMU when the host has it, never the missing Firecracker) on the Node, and the CPU
/// model of `/proc/cpuinfo` in the node's ClusterImpNodeProfile, one that exists before the
/// agent starts and one created after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_publishes_its_runtimes_and_cpu_model() {
    use imp_api::cluster::ClusterImpNodeProfile;
    use k8s_openapi::api::core::v1::Node;
    let _run = common::test_run("troubleshooting_e2e", Duration::from_secs(120));
    if common::control_plane_ready().is_none() {
        return;
    }
    let kube = common::cluster(&[NS, "imp-system"]).await;
    let c = kube.client.clone();
    let files = host_files("advertise");
    let profile = |name: &str| {
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ClusterImpNodeProfile",
               "metadata": {"name": name}, "spec": {"maxImpVMs": 3}})
    };
    common::create_imp(
        &c,
        "ClusterImpNodeProfile",
        "clusterimpnodeprofiles",
        profile("n1"),
    )
    .await;
    common::ready_node(&c, "n1").await;
    let agent = Agent::start(&kube, "n1", "auto", &files).await;

    let want = if imp_vmm::qemu::Launcher::detect().is_ok() {
        "qemu"
    } else {
        ""
    };
    let nodes: Api<Node> = Api::all(c.clone());
    let published = common::wait_for(
        "imp.dev/runtimes on Node n1",
        Duration::from_secs(30),
        || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get("n1").await.unwrap();
                n.annotations().get("imp.dev/runtimes").cloned()
            }
        },
    )
    .await;
    assert_eq!(published, want);

    let model = imp_agent::node::advertise::host_cpu_model()
        .expect("this test runs on a host whose /proc/cpuinfo names its model");
    let profiles: Api<ClusterImpNodeProfile> = Api::all(c.clone());
    assert_eq!(cpu_model(&profiles, "n1").await, model);
    let kept = profiles.get("n1").await.unwrap();
    assert_eq!(
        kept.spec.max_imp_vms,
        Some(3),
        "the rest of the profile is the admin's"
    );

    // A profile created while the agent runs is filled in too; the agent creates none.
    drop(agent);
    common::ready_node(&c, "n2").await;
    let _agent = Agent::start(&kube, "n2", "auto", &files).await;
    common::wait_for(
        "imp.dev/runtimes on Node n2",
        Duration::from_secs(30),
        || {
            let nodes = nodes.clone();
            async move {
                nodes
                    .get("n2")
                    .await
                    .unwrap()
                    .annotations()
                    .get("imp.dev/runtimes")
                    .cloned()
            }
        },
    )
    .await;
    assert!(
        profiles.get_opt("n2").await.unwrap().is_none(),
        "the agent made a profile"
    );
    common::create_imp(
        &c,
        "ClusterImpNodeProfile",
        "clusterimpnodeprofiles",
        profile("n2"),
    )
    .await;
    assert_eq!(cpu_model(&profiles, "n2").await, model);
    std::fs::remove_dir_all(&files).unwrap();
}
