//! The chart as shipped, run as Pods on a real node (issue 24, "Pods for real"): a kubelet and
//! kube-proxy of the control plane's release and Debian's containerd and runc, in a network
//! namespace of the test's own (imp-testenv's `podnode`). The operator and agent images are the
//! archives `scripts/images` builds, imported into containerd; `helm install --wait` waits
//! for the operator's Deployment and the agent's DaemonSet to be ready. Then:
//! - the troubleshooting guide's commands answer: `kubectl logs -n imp-system ds/imp-agent`
//!   and `kubectl logs -n imp-system deploy/imp-controller-manager -c manager`;
//! - a VM boots through the operator's and the agent's Pods, its reservation Pod runs on the
//!   node (the kubelet admits the VM's requests), and `imp exec` reaches its guest
//!   through the API server and the gateway served from the operator's Pod; its QEMU runs
//!   confined (the container runtime's seccomp profile refuses `pivot_root` to the jail);
//! - the agent's Pod is deleted (its container and sandbox torn down, its processes killed) and
//!   the DaemonSet makes another: the VM's QEMU is the same process, its guest the same boot,
//!   and exec works through the new agent;
//! - the VM is suspended, `helm upgrade --wait` rolls the operator and the agent (new Pod
//!   templates), and the VM resumes on the new agent: the same guest boot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::podnode::{NodeNet, PodNode};
use imp_testenv::{ControlPlane, Options, workspace_root};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};

use common::nodes::text;

const NS: &str = "imp-system";
const VM_NS: &str = "default";
const NODE: &str = "pod-node";
const AGENT_PODS: &str = "app.kubernetes.io/component=agent";

/// Whether everything the node and a guest boot need is here (else skip, or fail in CI).
fn ready() -> Option<()> {
    common::guest_boot_ready()?;
    common::control_plane_ready()?;
    let mut ok = true;
    for what in imp_testenv::podnode::missing() {
        ok &= imp_testenv::guard::require(false, &what);
    }
    for image in ["imp-operator", "imp-agent"] {
        ok &= imp_testenv::guard::require(
            archive(image).is_file(),
            &format!("target/images/{image}.oci.tar (scripts/images)"),
        );
    }
    ok.then_some(())
}

fn archive(image: &str) -> PathBuf {
    workspace_root().join(format!("target/images/{image}.oci.tar"))
}

/// Runs kubectl as the admin; returns its output whatever its status.
fn kubectl(cp: &ControlPlane, args: &[&str]) -> Output {
    cp.kubectl()
        .expect("kubectl")
        .args(args)
        .output()
        .expect("running kubectl")
}

/// The test's directory on the host: under /var/tmp, not /tmp, where the agent's Pod mounts an
/// emptyDir (the chart refuses host directories under /tmp: when the Pod goes, the emptyDir's
/// removal would unmount the state directory nested in it under the VMs' shims).
fn host_dir() -> PathBuf {
    let dir = PathBuf::from(format!("/var/tmp/imp-pods-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The values the test installs with: the node's host directories under `dir` (not the
/// machine's /var/lib), VMs' cgroups under a parent of the test's own, the VM image's layout
/// mounted read-only into the agent and the node's pause image for reservation Pods (no
/// registry reaches the node).
fn values(dir: &Path, layout: &Path) -> String {
    let d = dir.display();
    let l = layout.display();
    format!(
        r#"operator:
  reservations:
    image: {pause}
agent:
  stateDir: {d}/state
  imageCache: {d}/cache
  snapshotPaths: [{d}/snapshots]
  cgroupParent: {parent}
  extraVolumes:
    - name: test-images
      hostPath: {{path: {l}, type: Directory}}
  extraVolumeMounts:
    - name: test-images
      mountPath: {l}
      readOnly: true
"#,
        parent = cgroup_parent(),
        pause = imp_testenv::podnode::PAUSE_IMAGE,
    )
}

/// The parent of the VMs' cgroups, the test's own.
fn cgroup_parent() -> String {
    format!("imp-pods-e2e-{}", std::process::id())
}

/// Whatever the VMs leave if the test fails half-way (their cgroups, killing what runs there),
/// and the test's directory; dropped after the node.
struct Leftovers(PathBuf);

impl Drop for Leftovers {
    fn drop(&mut self) {
        common::remove_agent_leftovers(&self.0.join("state"), &cgroup_parent());
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `helm install imp charts/imp -n imp-system --create-namespace --wait` with `values`.
fn install(cp: &ControlPlane, dir: &Path, values: &str) {
    let file = dir.join("values.yaml");
    std::fs::write(&file, values).unwrap();
    let file = file.display().to_string();
    helm(cp, &["install", "--create-namespace", "-f", &file]);
}

/// `helm VERB imp charts/imp -n imp-system --wait EXTRA…`, which must succeed.
fn helm(cp: &ControlPlane, args: &[&str]) {
    let bin = imp_testenv::controlplane::helm().expect("helm (scripts/kube/build)");
    let (verb, extra) = args.split_first().expect("a helm verb");
    let out = std::process::Command::new(bin)
        .args([verb, "imp"])
        .arg(workspace_root().join("charts/imp"))
        .args(["-n", NS, "--wait", "--timeout", "3m"])
        .args(extra)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig())
        .output()
        .expect("running helm");
    assert!(out.status.success(), "helm {verb}: {}", text(&out));
}

/// Runs `imp ARGS…` as the admin; it must succeed.
async fn imp(cp: &ControlPlane, args: &[&str]) -> String {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_imp"));
    cmd.env("KUBECONFIG", cp.admin_kubeconfig()).args(args);
    let out = common::output_within(cmd, Duration::from_secs(120), "imp").await;
    assert!(out.status.success(), "imp {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `imp exec -n default NAME -- ARGS` as the admin, through the API server.
async fn exec(cp: &ControlPlane, vm: &str, args: &[&str]) -> String {
    let mut all = vec!["exec", "-n", VM_NS, vm, "--"];
    all.extend_from_slice(args);
    imp(cp, &all).await
}

/// The names of the agent's Pods that are Ready.
async fn ready_agents(pods: &Api<Pod>) -> Vec<String> {
    let list = pods
        .list(&ListParams::default().labels(AGENT_PODS))
        .await
        .expect("listing the agent's Pods");
    list.items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|p| p.metadata.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_pods_run_on_a_real_kubelet_and_vms_outlive_the_agents_pod() {
    if ready().is_none() {
        return;
    }
    let _run = common::test_run("pods_e2e", Duration::from_secs(900));
    let t0 = Instant::now();
    let net = NodeNet::create(0).unwrap_or_else(|e| panic!("{e}"));
    let opts = Options {
        host: net.host.into(),
        kubelets: true,
        scheduler: true,
        ..Options::default()
    };
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dir = host_dir();
    let _leftovers = Leftovers(dir.clone());
    let labels = [("imp/enabled", "true")];
    let node = PodNode::start(&cp, net, NODE, &labels, dir.join("node"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("a Ready node with a kubelet in {:?}", t0.elapsed());
    for image in ["imp-operator", "imp-agent"] {
        node.import(&archive(image))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let layout = dir.join("layout");
    common::busybox_image(&["sh", "cat", "sleep"], "sleep 3600")
        .write_layout(&layout, "1")
        .unwrap();
    let t1 = Instant::now();
    install(&cp, &dir, &values(&dir, &layout));
    eprintln!("helm install --wait: {:?}", t1.elapsed());

    check_logs(&cp, &node);
    let admin = cp.admin().await.unwrap();
    let state = dir.join("state");
    let (qemu, boot) = boot_vm(&cp, &admin, &layout, &state).await;
    restart_agent(&cp, &admin, &node, &state).await;
    assert!(common::alive(qemu), "QEMU {qemu} died with the agent's Pod");
    let vms: Api<ImpVM> = Api::namespaced(admin.clone(), VM_NS);
    vm_in(&vms, VmPhase::Running).await;
    let again = exec(&cp, "vm1", &["cat", "/proc/sys/kernel/random/boot_id"]).await;
    assert_eq!(again, boot, "the guest rebooted");
    let qemu = upgrade_while_suspended(&cp, &admin, &state, qemu).await;
    let again = exec(&cp, "vm1", &["cat", "/proc/sys/kernel/random/boot_id"]).await;
    assert_eq!(again, boot, "the guest rebooted instead of resuming");

    vms.delete("vm1", &DeleteParams::default()).await.unwrap();
    let t2 = Instant::now();
    while vms.get_opt("vm1").await.unwrap().is_some() {
        assert!(
            t2.elapsed() < Duration::from_secs(120),
            "vm1 not deleted in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!common::alive(qemu), "QEMU {qemu} outlived its deleted VM");
}

/// Suspends vm1 (`imp suspend`), rolls the operator and the agent with `helm upgrade --wait`
/// (a new log level: new Pod templates), and resumes it (`imp resume`) on the new agent.
/// Returns the new QEMU's pid.
async fn upgrade_while_suspended(
    cp: &ControlPlane,
    admin: &kube::Client,
    state: &Path,
    qemu: u32,
) -> u32 {
    let vms: Api<ImpVM> = Api::namespaced(admin.clone(), VM_NS);
    // `imp suspend` waits for Suspended; the wait beside it says why when that never comes.
    let suspend = imp(cp, &["suspend", "-n", VM_NS, "vm1"]);
    let suspended = common::wait_vm(&vms, "vm1", "Suspended", 110, |v| {
        common::phase(v) == Some(VmPhase::Suspended)
    });
    tokio::join!(suspend, suspended);
    assert!(!common::alive(qemu), "QEMU {qemu} runs on while Suspended");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let before = ready_agents(&pods).await;
    let t0 = Instant::now();
    helm(
        cp,
        &["upgrade", "--reuse-values", "--set", "logLevel=debug"],
    );
    let after = ready_agents(&pods).await;
    assert!(
        after.len() == 1 && after != before,
        "the upgrade did not roll the agent: {before:?} then {after:?}"
    );
    eprintln!(
        "helm upgrade --wait (operator and agent rolled) with vm1 Suspended: {:?}",
        t0.elapsed()
    );
    vm_in(&vms, VmPhase::Suspended).await;
    imp(cp, &["resume", "-n", VM_NS, "vm1"]).await;
    let vm = vm_in(&vms, VmPhase::Running).await;
    let uid = vm.metadata.uid.clone().unwrap();
    let now = common::qemu_of(state, &uid);
    assert_eq!(now.len(), 1, "one QEMU for the resumed vm1: {now:?}");
    now[0]
}

/// The troubleshooting guide's log commands answer, through the API server and the kubelet.
fn check_logs(cp: &ControlPlane, node: &PodNode) {
    let agent = kubectl(cp, &["logs", "-n", NS, "ds/imp-agent"]);
    assert!(
        agent.status.success() && text(&agent).contains("imp_agent"),
        "kubectl logs ds/imp-agent: {}\n{}",
        text(&agent),
        node.logs(20)
    );
    let operator = kubectl(
        cp,
        &[
            "logs",
            "-n",
            NS,
            "deploy/imp-controller-manager",
            "-c",
            "manager",
        ],
    );
    assert!(
        operator.status.success() && text(&operator).contains("imp_operator"),
        "kubectl logs deploy/imp-controller-manager -c manager: {}",
        text(&operator)
    );
}

/// Creates VM `vm1` from the test image and waits until it runs; returns its QEMU's pid and
/// its guest's boot id, read with `imp exec`.
async fn boot_vm(
    cp: &ControlPlane,
    admin: &kube::Client,
    layout: &Path,
    state: &Path,
) -> (u32, String) {
    common::small_class(admin, 256).await;
    let image = format!("oci:{}:1", layout.display());
    common::create_imp(
        admin,
        "ImpVM",
        "impvms",
        serde_json::json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "vm1", "namespace": VM_NS},
            "spec": {"classRef": {"name": "small"}, "image": image}}),
    )
    .await;
    let vms: Api<ImpVM> = Api::namespaced(admin.clone(), VM_NS);
    let t0 = Instant::now();
    let vm = common::wait_vm(&vms, "vm1", "Running", 300, |v| {
        common::phase(v) == Some(VmPhase::Running)
    })
    .await;
    eprintln!("vm1 Running through the chart's Pods in {:?}", t0.elapsed());
    let uid = vm.metadata.uid.clone().unwrap();
    reservation_runs(admin).await;
    let qemu = common::qemu_of(state, &uid);
    assert_eq!(qemu.len(), 1, "one QEMU for vm1: {qemu:?}");
    // Confined in the agent's Pod too, where seccomp refuses pivot_root to the jail.
    common::assert_vmm_confined(qemu[0]);
    // Its own filter (QEMU's -sandbox) on top of the one inherited from the agent's container.
    let filters = imp_testenv::procfs::Status::of(qemu[0]).field("Seccomp_filters");
    assert!(
        filters.parse::<u32>().is_ok_and(|n| n >= 2),
        "QEMU {} has {filters:?} seccomp filters",
        qemu[0]
    );
    let boot = exec(cp, "vm1", &["cat", "/proc/sys/kernel/random/boot_id"]).await;
    assert_eq!(boot.trim().len(), 36, "a boot id: {boot:?}");
    (qemu[0], boot)
}

/// vm1, which must be in `phase`.
async fn vm_in(vms: &Api<ImpVM>, phase: VmPhase) -> ImpVM {
    let vm = vms.get("vm1").await.unwrap();
    assert_eq!(common::phase(&vm), Some(phase), "{:?}", vm.status);
    vm
}

/// Waits until vm1's reservation Pod (docs/capacity.md) runs: the kubelet admitted it with
/// the VM's requests.
async fn reservation_runs(admin: &kube::Client) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), VM_NS);
    let t0 = Instant::now();
    loop {
        let pod = pods.get_opt("imp-vm-vm1").await.unwrap();
        let phase = pod.as_ref().and_then(|p| p.status.as_ref()?.phase.clone());
        if phase.as_deref() == Some("Running") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "vm1's reservation Pod not Running after 60 s: {:?}",
            pod.map(|p| p.status)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Deletes the agent's Pod and waits for the DaemonSet's next one to be Ready.
async fn restart_agent(cp: &ControlPlane, admin: &kube::Client, node: &PodNode, state: &Path) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let before = ready_agents(&pods).await;
    assert_eq!(before.len(), 1, "one agent Pod: {before:?}");
    let old_pid = agent_pid(state);
    assert!(
        old_pid.is_some(),
        "no agent process with --state-dir={}",
        state.display()
    );
    let t0 = Instant::now();
    let out = kubectl(
        cp,
        &[
            "delete",
            "pod",
            "-n",
            NS,
            &before[0],
            "--wait=true",
            "--timeout=120s",
        ],
    );
    assert!(
        out.status.success(),
        "deleting the agent's Pod: {}",
        text(&out)
    );
    assert!(
        old_pid.is_some_and(|p| !common::alive(p)),
        "the old agent {old_pid:?} outlived its Pod"
    );
    loop {
        let now = ready_agents(&pods).await;
        if now.len() == 1 && now != before {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "no new Ready agent Pod after 180 s: {now:?}\n{}",
            node.logs(30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "the agent's Pod deleted and the DaemonSet's next one Ready in {:?}",
        t0.elapsed()
    );
}

/// The pid of the agent whose state directory is `state` (the Pod's, seen in the host's PID
/// namespace: the Pod has `hostPID`).
fn agent_pid(state: &Path) -> Option<u32> {
    let arg = format!("--state-dir={}", state.display());
    common::processes_naming(&arg).into_iter().next()
}
