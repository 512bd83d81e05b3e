//! End-to-end: `spec.desiredState` of an ImpVM, set by `imp suspend|resume -n NS VM`, acted on
//! by the real `imp agent` and `imp operator` against a real kube-apiserver, with a real Linux guest
//! under QEMU/TCG. The VM is suspended (phase Suspended with suspendedAt and the snapshot's
//! place, its QEMU gone), survives its agent's container being killed and restarted, and is
//! resumed on the same node with its processes and files, exec answering.
//!
//! Needs what `agent_e2e.rs` needs (`scripts/setup`): without it, it skips on a developer
//! machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::phase;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::{TestImage, TestRegistry, push, scratch_dir};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "default";
const VM: &str = "sp-cluster-vm";

/// A counter in a tmpfs of the workload's own, one step a second.
fn image() -> TestImage {
    common::counter_image()
}

async fn node(c: &Client, name: &str) {
    common::ready_node(c, name).await;
}

/// Runs `imp ARGS` with `kubeconfig`, off the async runtime.
async fn imp(kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    let (kubeconfig, args) = (
        kubeconfig.to_path_buf(),
        args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>(),
    );
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_imp"))
            .args(&args)
            .env("KUBECONFIG", &kubeconfig)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        eprintln!(
            "imp {args:?}: {:?} in {:.2}s\n{}{}",
            out.status,
            started.elapsed().as_secs_f64(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    })
    .await
    .unwrap()
}

async fn counter(kubeconfig: &Path) -> u64 {
    let out = imp(
        kubeconfig,
        &["exec", "-n", NS, VM, "--", "cat", "/mnt/t/count"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn desired_state_suspends_and_resumes_an_impvm_across_an_agent_restart() {
    let _run = common::test_run("suspend_cluster_e2e", Duration::from_secs(600));
    if common::guest_boot_ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    if common::control_plane_ready().is_none() {
        return;
    }
    let kube = common::cluster(&[NS, "imp-system"]).await;
    let (alice, _) = common::exec_users(&kube, NS).await;
    let c = kube.client.clone();
    node(&c, "sp-node").await;
    let classes: Api<imp_api::class::ImpVMClass> = Api::all(c.clone());
    let small: imp_api::class::ImpVMClass = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
        "metadata": {"name": "small"}, "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1}
    }))
    .unwrap();
    classes
        .create(&PostParams::default(), &small)
        .await
        .unwrap();
    let registry = TestRegistry::start().await.unwrap();
    let dest = format!("{}/counter:1", registry.host());
    let layout = scratch_dir("imp-suspend-cluster-layout").unwrap();
    image().write_layout(&layout, "1").unwrap();
    push(&layout, "1", &dest, None).await.unwrap();
    std::fs::remove_dir_all(&layout).unwrap();

    let _operator = common::start_operator(&kube);
    let mut agent = common::agent::HostAgent::new("sp-node", "sp-e2e");
    agent.args = vec!["--suspend-retry".into(), "3s".into()];
    agent.start(&kube).await;

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": VM, "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "image": dest, "lifecycle": "persistent"}
    }))
    .unwrap();
    let created = vms.create(&PostParams::default(), &obj).await.unwrap();
    let uid = created.uid().unwrap();
    common::wait_vm(&vms, VM, "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = imp(
            &alice,
            &[
                "exec",
                "-n",
                NS,
                VM,
                "--",
                "sh",
                "-c",
                // Only once the tmpfs is mounted (the counter is written there): a file
                // written between the workload's mkdir and its mount would be hidden.
                "[ -e /mnt/t/count ] && echo kept > /mnt/t/file",
            ],
        )
        .await;
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "the workload's tmpfs never came");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let before = counter(&alice).await;
    let old_qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(old_qemu.len(), 1, "one QEMU runs the VM: {old_qemu:?}");

    // Too little disk on the node (a 16 MiB file system under the snapshot directory): the
    // agent refuses before pausing, publishes a Warning, and the VM runs on in the same QEMU.
    let snapshots = agent.state.join("snapshots");
    std::fs::create_dir_all(&snapshots).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16m", "tmpfs"])
        .arg(&snapshots)
        .status()
        .unwrap();
    assert!(mounted.success());
    let out = imp(&alice, &["suspend", "-n", NS, VM, "--timeout", "60s"]).await;
    assert!(
        !out.status.success(),
        "suspended without room for the snapshot"
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains("not enough free disk space"), "{err}");
    assert_eq!(phase(&vms.get(VM).await.unwrap()), Some(VmPhase::Running));
    assert_eq!(
        common::qemu_of(&agent.state, &uid),
        old_qemu,
        "the VM was not left running"
    );
    assert!(counter(&alice).await >= before);
    common::events_with(&c, NS, VM, &["SuspendFailed"]).await;
    // With room again, the agent tries again by itself (--suspend-retry 3s).
    let unmounted = std::process::Command::new("umount")
        .arg(&snapshots)
        .status()
        .unwrap();
    assert!(unmounted.success());

    // imp suspend sets desiredState and waits for the agent's Suspended.
    let t = Instant::now();
    let out = imp(&alice, &["suspend", "-n", NS, VM]).await;
    assert!(out.status.success());
    let suspend_took = t.elapsed();
    let vm = vms.get(VM).await.unwrap();
    let status = vm.status.clone().unwrap();
    assert_eq!(status.phase, Some(VmPhase::Suspended));
    assert!(status.suspended_at.is_some(), "{status:?}");
    let path = status.suspend_snapshot_path.clone().expect("snapshot path");
    assert!(Path::new(&path).join("memory").is_file(), "{path}");
    assert_eq!(status.node_name.as_deref(), Some("sp-node"));
    assert_eq!(vm.spec.node_name.as_deref(), Some("sp-node"));
    assert!(
        common::qemu_of(&agent.state, &uid).is_empty(),
        "QEMU still runs while Suspended"
    );

    // The agent's container is killed and restarted: the VM stays Suspended (state on disk).
    agent.kill_container().await;
    agent.start(&kube).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let vm = vms.get(VM).await.unwrap();
    assert_eq!(phase(&vm), Some(VmPhase::Suspended), "{:?}", vm.status);
    assert!(common::qemu_of(&agent.state, &uid).is_empty());

    // imp resume: Resuming → Running on the same node, the same guest, exec answers.
    let t = Instant::now();
    let out = imp(&alice, &["resume", "-n", NS, VM]).await;
    assert!(out.status.success());
    let resume_took = t.elapsed();
    let vm = vms.get(VM).await.unwrap();
    let status = vm.status.clone().unwrap();
    assert_eq!(status.phase, Some(VmPhase::Running));
    assert_eq!(status.node_name.as_deref(), Some("sp-node"));
    assert!(status.suspend_snapshot_path.is_none() && status.suspended_at.is_none());
    let new_qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(new_qemu.len(), 1);
    assert_ne!(new_qemu, old_qemu, "resumed in a new QEMU");
    let after = counter(&alice).await;
    assert!(after >= before, "counter {before} then {after}");
    let out = imp(&alice, &["exec", "-n", NS, VM, "--", "cat", "/mnt/t/file"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    common::events_with(
        &c,
        NS,
        VM,
        &["Suspending", "Suspended", "Resuming", "Resumed"],
    )
    .await;
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(agent.state.join("vms").join(&uid).join("vm.json")).unwrap(),
    )
    .unwrap();
    let timings = &record["timings"];
    assert!(timings["suspend_ms"].as_u64().unwrap() > 0, "{record}");
    assert!(timings["resume_ms"].as_u64().unwrap() > 0, "{record}");
    eprintln!(
        "FIGURES cluster: on the node, suspend {} ms and resume {} ms; imp suspend → phase \
         Suspended {:.2}s (includes the agent's retry, up to 3 s, after the full-disk check); \
         imp resume → phase Running {:.2}s",
        timings["suspend_ms"],
        timings["resume_ms"],
        suspend_took.as_secs_f64(),
        resume_took.as_secs_f64()
    );

    // The user opts in to a cold boot on a bad snapshot: suspended again, the snapshot is
    // damaged, and the resume boots the VM afresh (a Warning says why; its memory is lost)
    // instead of failing it.
    let patch = json!({"metadata": {"annotations": {
        imp_api::shared::ANNOTATION_RESUME_FALLBACK: imp_api::shared::RESUME_FALLBACK_COLD_BOOT}}});
    vms.patch(VM, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    assert!(
        imp(&alice, &["suspend", "-n", NS, VM])
            .await
            .status
            .success()
    );
    let memory = Path::new(&path).join("memory");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&memory)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let t = Instant::now();
    let out = imp(&alice, &["resume", "-n", NS, VM]).await;
    assert!(
        out.status.success(),
        "the cold boot did not bring the VM up"
    );
    let note = common::wait_for("the ResumeFailed Warning", Duration::from_secs(20), || {
        let c = c.clone();
        async move {
            common::events_of(&c, NS, VM)
                .await
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("ResumeFailed"))
                .and_then(|e| e.message)
        }
    })
    .await;
    assert!(note.contains("booting the VM afresh"), "{note}");
    assert_eq!(phase(&vms.get(VM).await.unwrap()), Some(VmPhase::Running));
    let out = imp(
        &alice,
        &[
            "exec",
            "-n",
            NS,
            VM,
            "--",
            "sh",
            "-c",
            "cat /mnt/t/file || echo gone",
        ],
    )
    .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "gone",
        "a cold boot starts with fresh memory"
    );
    eprintln!(
        "FIGURES cluster: bad snapshot → cold boot → Running {:.2}s",
        t.elapsed().as_secs_f64()
    );

    vms.delete(VM, &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(&vms, VM, 60).await;
    assert!(!Path::new(&path).exists(), "snapshot left after deletion");
}
