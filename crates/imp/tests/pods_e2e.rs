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
//!   templates), and the VM resumes on the new agent: the same guest boot. Throughout the
//!   roll, until the replaced operator Pods are gone, a dry-run create every 50 ms passes the
//!   admission webhooks: a replaced replica serves until its endpoint is gone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::workspace_root;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};

use common::nodes::text;
use common::pods::{Cluster, NS, archive};

const VM_NS: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_pods_run_on_a_real_kubelet_and_vms_outlive_the_agents_pod() {
    if common::pods::ready(&[archive("imp-operator"), archive("imp-agent")]).is_none() {
        return;
    }
    let _run = common::test_run("pods_e2e", Duration::from_secs(900));
    let c = Cluster::start("pods-e2e").await;
    for image in ["imp-operator", "imp-agent"] {
        c.node
            .import(&archive(image))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    common::busybox_image(&["sh", "cat", "sleep"], "sleep 3600")
        .write_layout(&c.layout(), "1")
        .unwrap();
    let t1 = Instant::now();
    let values = c.values();
    let chart = workspace_root().join("charts/imp");
    c.helm(
        "install",
        &chart,
        &["--create-namespace", "-f", &values.display().to_string()],
    );
    eprintln!("helm install --wait: {:?}", t1.elapsed());

    check_logs(&c);
    let admin = c.cp.admin().await.unwrap();
    let (qemu, boot) = boot_vm(&c, &admin).await;
    restart_agent(&c).await;
    assert!(common::alive(qemu), "QEMU {qemu} died with the agent's Pod");
    let vms: Api<ImpVM> = Api::namespaced(admin.clone(), VM_NS);
    vm_in(&vms, VmPhase::Running).await;
    assert_eq!(c.boot_id(VM_NS, "vm1").await, boot, "the guest rebooted");
    let qemu = upgrade_while_suspended(&c, &admin, qemu).await;
    assert_eq!(
        c.boot_id(VM_NS, "vm1").await,
        boot,
        "the guest rebooted instead of resuming"
    );

    vms.delete("vm1", &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(&vms, "vm1", 120).await;
    assert!(!common::alive(qemu), "QEMU {qemu} outlived its deleted VM");
}

/// Suspends vm1 (`imp suspend`), rolls the operator and the agent with `helm upgrade --wait`
/// (a new log level: new Pod templates), and resumes it (`imp resume`) on the new agent.
/// Returns the new QEMU's pid.
async fn upgrade_while_suspended(c: &Cluster, admin: &kube::Client, qemu: u32) -> u32 {
    let vms: Api<ImpVM> = Api::namespaced(admin.clone(), VM_NS);
    // `imp suspend` waits for Suspended; the wait beside it says why when that never comes.
    let suspend = c.imp(&["suspend", "-n", VM_NS, "vm1"]);
    let suspended = common::wait_vm(&vms, "vm1", "Suspended", 110, |v| {
        common::phase(v) == Some(VmPhase::Suspended)
    });
    tokio::join!(suspend, suspended);
    assert!(!common::alive(qemu), "QEMU {qemu} runs on while Suspended");
    let before = c.ready_agents().await;
    // Admission keeps answering while the operator's replicas are replaced: each serves on
    // until its endpoint is gone (the chart's operator.drainSeconds).
    let stop = Arc::new(AtomicBool::new(false));
    let image = format!("oci:{}:1", c.layout().display());
    let probe = tokio::spawn(admissions_until(admin.clone(), image, stop.clone()));
    let t0 = Instant::now();
    let chart = workspace_root().join("charts/imp");
    c.helm(
        "upgrade",
        &chart,
        &["--reuse-values", "--set", "logLevel=debug"],
    );
    // Until the replaced replicas are gone: they drain after helm has seen the new ones ready.
    c.wait_none_terminating("operator").await;
    stop.store(true, Ordering::Relaxed);
    let (admitted, refused) = probe.await.unwrap();
    eprintln!(
        "while the operator rolled: {admitted} dry-run creates admitted, {} refused",
        refused.len()
    );
    assert!(
        admitted > 0 && refused.is_empty(),
        "admission failed while the operator rolled ({admitted} admitted): {refused:#?}"
    );
    let after = c.ready_agents().await;
    assert!(
        after.len() == 1 && after != before,
        "the upgrade did not roll the agent: {before:?} then {after:?}"
    );
    eprintln!(
        "helm upgrade --wait (operator and agent rolled) with vm1 Suspended: {:?}",
        t0.elapsed()
    );
    vm_in(&vms, VmPhase::Suspended).await;
    c.imp(&["resume", "-n", VM_NS, "vm1"]).await;
    let vm = vm_in(&vms, VmPhase::Running).await;
    let uid = vm.metadata.uid.clone().unwrap();
    let now = common::qemu_of(&c.state(), &uid);
    assert_eq!(now.len(), 1, "one QEMU for the resumed vm1: {now:?}");
    now[0]
}

/// Dry-run creates of an ImpVM, one every 50 ms until `stop`, each through the operator's
/// admission webhooks: how many were admitted, and the errors of the others.
async fn admissions_until(
    admin: kube::Client,
    image: String,
    stop: Arc<AtomicBool>,
) -> (u32, Vec<String>) {
    let vms: Api<ImpVM> = Api::namespaced(admin, VM_NS);
    let vm: ImpVM = serde_json::from_value(serde_json::json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "probe", "namespace": VM_NS},
        "spec": {"classRef": {"name": "small"}, "image": image}
    }))
    .unwrap();
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let (mut admitted, mut refused) = (0, Vec::new());
    while !stop.load(Ordering::Relaxed) {
        match vms.create(&dry, &vm).await {
            Ok(_) => admitted += 1,
            Err(e) => refused.push(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (admitted, refused)
}

/// The troubleshooting guide's log commands answer, through the API server and the kubelet.
fn check_logs(c: &Cluster) {
    let agent = c.kubectl(&["logs", "-n", NS, "ds/imp-agent"]);
    assert!(
        agent.status.success() && text(&agent).contains("imp_agent"),
        "kubectl logs ds/imp-agent: {}\n{}",
        text(&agent),
        c.node.logs(20)
    );
    let operator = c.kubectl(&[
        "logs",
        "-n",
        NS,
        "deploy/imp-controller-manager",
        "-c",
        "manager",
    ]);
    assert!(
        operator.status.success() && text(&operator).contains("imp_operator"),
        "kubectl logs deploy/imp-controller-manager -c manager: {}",
        text(&operator)
    );
}

/// Creates VM `vm1` from the test image and waits until it runs; returns its QEMU's pid and
/// its guest's boot id, read with `imp exec`.
async fn boot_vm(c: &Cluster, admin: &kube::Client) -> (u32, String) {
    common::small_class(admin, 256).await;
    let image = format!("oci:{}:1", c.layout().display());
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
    let qemu = common::qemu_of(&c.state(), &uid);
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
    (qemu[0], c.boot_id(VM_NS, "vm1").await)
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
async fn restart_agent(c: &Cluster) {
    let before = c.ready_agents().await;
    assert_eq!(before.len(), 1, "one agent Pod: {before:?}");
    let old_pid = c.agent_pid();
    assert!(
        old_pid.is_some(),
        "no agent process with --state-dir={}",
        c.state().display()
    );
    let t0 = Instant::now();
    let out = c.kubectl(&[
        "delete",
        "pod",
        "-n",
        NS,
        &before[0],
        "--wait=true",
        "--timeout=120s",
    ]);
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
        let now = c.ready_agents().await;
        if now.len() == 1 && now != before {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "no new Ready agent Pod after 180 s: {now:?}\n{}",
            c.node.logs(30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "the agent's Pod deleted and the DaemonSet's next one Ready in {:?}",
        t0.elapsed()
    );
}
