//! End-to-end: an ImpVMSnapshot of a running ImpVM, through the real `imp operator` (which
//! makes the parent's execution) and the real `imp agent` (whose VM's shim takes it), against a
//! real kube-apiserver with the chart's RBAC and a real Linux guest under QEMU/TCG.
//!
//! The guest holds a secret in a tmpfs (memory only); the execution ends Succeeded with its
//! files under `storage.nodeLocal.path/<ns>/<parent>/<execution>/`, the guest's memory image
//! holds the secret, the source VM was paused for the reported time and runs on in the same
//! QEMU, and deleting the execution removes its files (finalizer). A snapshot that cannot be
//! stored fails with a condition naming the cause, and the VM still runs. A path that is not
//! one of the agent's snapshot roots, or a root with a link planted in it, fails the snapshot
//! naming the cause, with nothing made outside the roots. A `* * * * *` schedule with
//! retention 1 snapshots the running guest each minute through its agent, prunes the older
//! execution (object and files) once a newer one succeeded, and a VM restored from the newest
//! holds what the guest wrote into its memory between the two.
//!
//! Needs what `agent_e2e.rs` needs (`scripts/setup`): without it, it skips on a developer
//! machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::phase;
use common::snapshots::{self, ready_of};

use std::path::{Path, PathBuf};
use std::time::Duration;

use imp_api::snapshot::{ImpVMSnapshot, SnapshotPhase};
use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::{TestRegistry, push, scratch_dir};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "default";
const VM: &str = "snap-vm";
const NODE: &str = "snap-node";

async fn exec(kubeconfig: &Path, script: &str) -> String {
    exec_in(kubeconfig, VM, script).await
}

async fn exec_in(kubeconfig: &Path, vm: &str, script: &str) -> String {
    snapshots::exec_in(kubeconfig, NS, vm, script).await
}

async fn parent(c: &Client, name: &str, storage: serde_json::Value) {
    snapshots::parent(c, NS, name, VM, storage).await;
}

async fn terminated_execution(c: &Client, name: &str) -> ImpVMSnapshot {
    snapshots::terminated_execution(c, NS, name).await
}

/// Whether `needle` occurs in `file` (read in pieces).
fn file_contains(file: &Path, needle: &[u8]) -> bool {
    use std::io::Read as _;
    let mut f = std::fs::File::open(file).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return false;
        }
        carry.extend_from_slice(&buf[..n]);
        if carry.windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        let keep = carry.len().saturating_sub(needle.len());
        carry.drain(..keep);
    }
}

/// The running VM, snapshotted on a schedule into node-local storage.
struct Scheduled<'a> {
    c: &'a Client,
    alice: &'a Path,
    image: &'a str,
    store: &'a Path,
}

impl Scheduled<'_> {
    /// A `* * * * *` schedule with retention 1 snapshots the running guest through its agent
    /// each minute: an execution taken before a mark is written into the guest's memory is
    /// pruned (object, files, Event) once a later one has succeeded, and a new VM restored from
    /// the newest execution holds the mark and the secret.
    async fn snapshots_prune_and_restore_the_newest(&self, secret: &str) {
        let snaps: Api<ImpVMSnapshot> = Api::namespaced(self.c.clone(), NS);
        let parent: ImpVMSnapshot = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
            "metadata": {"name": "every-minute", "namespace": NS},
            "spec": {"sourceVMName": VM, "sourceVMNamespace": NS, "schedule": "* * * * *",
                     "retention": 1,
                     "storage": {"type": "node-local",
                                 "nodeLocal": {"path": self.store.to_str().unwrap()}}}
        }))
        .unwrap();
        snaps.create(&PostParams::default(), &parent).await.unwrap();
        // The first tick is at most a minute away; the rest is for a loaded machine.
        let first = self.succeeded_after(None, 150).await;
        let first_dir = PathBuf::from(first.status.clone().unwrap().snapshot_path.unwrap());
        assert!(
            first_dir.join("memory").is_file(),
            "{}",
            first_dir.display()
        );
        // A mark only the memory of executions decided after this moment holds.
        let mark = format!("after-{}", first.name_any());
        let marked_at = k8s_openapi::jiff::Timestamp::now();
        exec(self.alice, &format!("echo {mark} > /mnt/t/mark")).await;
        let newer = self.succeeded_after(Some(marked_at), 150).await;
        common::wait_for(
            "retention 1 to prune the execution before the mark",
            Duration::from_secs(60),
            || async {
                let gone = snaps.get_opt(&first.name_any()).await.unwrap().is_none();
                (gone && !first_dir.exists()).then_some(())
            },
        )
        .await;
        let evs = common::events_with(self.c, NS, "every-minute", &["Pruned"]).await;
        assert!(
            evs.iter().any(|e| e.reason.as_deref() == Some("Pruned")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains(&first.name_any()))),
            "no Pruned Event names {}",
            first.name_any()
        );
        // No more pruning while a VM is restored from the newest (a later tick may have
        // succeeded meanwhile: it holds the mark too).
        snaps
            .patch(
                "every-minute",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"retention": 10}})),
            )
            .await
            .unwrap();
        let newest = self.succeeded_after(Some(marked_at), 10).await;
        assert!(
            newest.name_any() >= newer.name_any(),
            "{} < {}",
            newest.name_any(),
            newer.name_any()
        );
        self.restored_holds(&newest.name_any(), &mark, secret).await;
        snaps
            .delete("every-minute", &DeleteParams::default())
            .await
            .unwrap();
    }

    /// The newest Succeeded execution of `every-minute` decided after `after` (any, without),
    /// waited for up to `secs`.
    async fn succeeded_after(
        &self,
        after: Option<k8s_openapi::jiff::Timestamp>,
        secs: u64,
    ) -> ImpVMSnapshot {
        let snaps: Api<ImpVMSnapshot> = Api::namespaced(self.c.clone(), NS);
        let selector = format!("{}=every-minute", imp_api::shared::LABEL_SNAPSHOT_PARENT);
        common::wait_for(
            "a scheduled execution succeeded",
            Duration::from_secs(secs),
            || async {
                let list = snaps
                    .list(&kube::api::ListParams::default().labels(&selector))
                    .await
                    .unwrap();
                list.items
                    .into_iter()
                    .filter(|e| phase_of(e) == Some(SnapshotPhase::Succeeded))
                    .filter(|e| {
                        let at = imp_operator::snapshot::decide::scheduled_at(e);
                        after.is_none_or(|t| at.is_some_and(|at| at > t))
                    })
                    .max_by_key(imp_operator::snapshot::decide::scheduled_at)
            },
        )
        .await
    }

    /// A new VM from execution `from` holds `mark` and `secret` in its memory.
    async fn restored_holds(&self, from: &str, mark: &str, secret: &str) {
        let vms: Api<ImpVM> = Api::namespaced(self.c.clone(), NS);
        let name = "snap-scheduled";
        common::create_vm(
            &vms,
            json!({
                "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"classRef": {"name": "small"}, "image": self.image,
                         "lifecycle": "persistent", "snapshotRef": from}
            }),
        )
        .await;
        common::wait_vm(&vms, name, "Running", 300, |v| {
            phase(v) == Some(VmPhase::Running)
        })
        .await;
        assert_eq!(
            exec_in(self.alice, name, "cat /mnt/t/mark").await.trim(),
            mark
        );
        assert_eq!(
            exec_in(self.alice, name, "cat /mnt/t/secret").await.trim(),
            secret
        );
        vms.delete(name, &DeleteParams::default()).await.unwrap();
    }
}

fn phase_of(s: &ImpVMSnapshot) -> Option<SnapshotPhase> {
    s.status.as_ref().and_then(|s| s.phase)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_vm_is_snapshotted_with_its_memory_and_runs_on() {
    let _run = common::test_run("snapshot_e2e", Duration::from_secs(900));
    let Some(env) = common::agent::single_node(NS, NODE, 256).await else {
        return;
    };
    let (kube, c, alice) = (env.kube, env.client, env.exec_kubeconfig);
    let registry = TestRegistry::start().await.unwrap();
    let image = format!("{}/counter:1", registry.host());
    let layout = scratch_dir("imp-snapshot-e2e-layout").unwrap();
    common::counter_image().write_layout(&layout, "1").unwrap();
    push(&layout, "1", &image, None).await.unwrap();
    std::fs::remove_dir_all(&layout).unwrap();

    // The agent's snapshot roots: where snapshots go, one whose namespace directory is a file,
    // and one whose namespace directory is a link to a directory outside every root.
    let store = snapshots::snapshot_root("imp-snapshot-e2e-store");
    let blocked = snapshots::snapshot_root("imp-snapshot-e2e-blocked");
    let linked = snapshots::snapshot_root("imp-snapshot-e2e-linked");
    let _operator = common::start_operator(&kube);
    let mut agent = common::agent::HostAgent::new(NODE, "snap-e2e");
    for root in [&store, &blocked, &linked] {
        agent
            .args
            .push(format!("--snapshot-root={}", root.display()));
    }
    agent.start(&kube).await;
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let uid = common::create_vm(
        &vms,
        json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": VM, "namespace": NS},
            "spec": {"classRef": {"name": "small"}, "image": image, "lifecycle": "persistent"}
        }),
    )
    .await;
    common::wait_vm(&vms, VM, "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    // A secret only the guest's memory holds (a tmpfs), written once the tmpfs is mounted.
    let secret = format!("imp-snapshot-secret-{}", std::process::id());
    common::wait_for("the workload's tmpfs", Duration::from_secs(60), || async {
        let out = exec(&alice, "[ -e /mnt/t/count ] && echo ok || true").await;
        (out.trim() == "ok").then_some(())
    })
    .await;
    exec(&alice, &format!("echo {secret} > /mnt/t/secret")).await;
    let qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(qemu.len(), 1, "one QEMU runs the VM: {qemu:?}");

    let count_before: u64 = exec(&alice, "cat /mnt/t/count")
        .await
        .trim()
        .parse()
        .unwrap();
    parent(
        &c,
        "nightly",
        json!({"type": "node-local", "nodeLocal": {"path": store.to_str().unwrap()}}),
    )
    .await;
    let exec_obj = terminated_execution(&c, "nightly").await;
    let status = exec_obj.status.clone().unwrap();
    assert_eq!(status.phase, Some(SnapshotPhase::Succeeded), "{status:?}");
    let dir = PathBuf::from(status.snapshot_path.clone().unwrap());
    assert_eq!(
        dir,
        store.join(NS).join("nightly").join(exec_obj.name_any())
    );
    assert_eq!(
        exec_obj
            .annotations()
            .get("imp.dev/snapshot-node")
            .map(String::as_str),
        Some(NODE)
    );
    for f in [
        "snapshot.json",
        "vmstate",
        "vmm.json",
        "memory",
        "disk.ext4",
        "initramfs.cpio",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing in {}", dir.display());
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("snapshot.json")).unwrap()).unwrap();
    assert!(
        manifest["vmm"].as_str().unwrap().starts_with("qemu "),
        "{manifest}"
    );
    assert_eq!(manifest["memoryMib"], 256, "{manifest}");
    let pause_ms = manifest["pauseMs"].as_u64().unwrap();
    let stored = imp_agent::snapshot::sparse::data_bytes(&dir.join("memory")).unwrap();
    assert!(
        stored < 256 << 20,
        "the memory image stores {stored} bytes: more than the guest touched?"
    );
    assert!(
        file_contains(&dir.join("memory"), secret.as_bytes()),
        "the guest's memory image lacks the secret it held"
    );
    let ready = ready_of(&status);
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "SnapshotSucceeded")
    );
    assert!(ready.message.contains("paused"), "{}", ready.message);
    common::events_with(&c, NS, &exec_obj.name_any(), &["SnapshotSucceeded"]).await;
    // The VM ran on, in the same QEMU, with its memory.
    assert_eq!(phase(&vms.get(VM).await.unwrap()), Some(VmPhase::Running));
    assert_eq!(common::qemu_of(&agent.state, &uid), qemu);
    assert_eq!(exec(&alice, "cat /mnt/t/secret").await.trim(), secret);
    eprintln!(
        "FIGURES snapshot of a 256 MiB guest: paused {pause_ms} ms, memory image {} MiB \
         stored, {}",
        stored >> 20,
        ready.message
    );

    // A new VM from the snapshot (spec.snapshotRef): placed on the node with the files,
    // restored instead of booted, with the source's memory (the secret in its tmpfs) and its
    // workload going on; the source VM is untouched.
    let copy: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "snap-copy", "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "image": image, "lifecycle": "persistent",
                 "snapshotRef": exec_obj.name_any()}
    }))
    .unwrap();
    let t = std::time::Instant::now();
    let copy_uid = vms
        .create(&PostParams::default(), &copy)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let running = common::wait_vm(&vms, "snap-copy", "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    let restored_in = t.elapsed();
    assert_eq!(
        running.status.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(NODE)
    );
    assert_eq!(
        exec_in(&alice, "snap-copy", "cat /mnt/t/secret")
            .await
            .trim(),
        secret
    );
    let counted: u64 = exec_in(&alice, "snap-copy", "cat /mnt/t/count")
        .await
        .trim()
        .parse()
        .unwrap();
    assert!(
        counted >= count_before,
        "the workload started over instead of going on: {counted} < {count_before}"
    );
    // It took its own identity: the source's hostname was in the memory it restored.
    assert_eq!(
        exec_in(&alice, "snap-copy", "cat /proc/sys/kernel/hostname")
            .await
            .trim(),
        "snap-copy"
    );
    assert_eq!(
        exec(&alice, "cat /proc/sys/kernel/hostname").await.trim(),
        VM
    );
    let copy_qemu = common::qemu_of(&agent.state, &copy_uid);
    assert_eq!(copy_qemu.len(), 1, "{copy_qemu:?}");
    assert_ne!(copy_qemu, qemu);
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(agent.state.join("vms").join(&copy_uid).join("vm.json")).unwrap(),
    )
    .unwrap();
    eprintln!(
        "FIGURES restore of a new VM from a node-local snapshot: ImpVM created → Running {:.2} s \
         (on the node: files copied and VMM restored {} ms, then guest agent answering {} ms)",
        restored_in.as_secs_f64(),
        record["timings"]["boot_ms"],
        record["timings"]["ready_ms"]
    );
    vms.delete("snap-copy", &DeleteParams::default())
        .await
        .unwrap();

    // Deleting the execution removes its files, then the object (the finalizer).
    let snaps: Api<ImpVMSnapshot> = Api::namespaced(c.clone(), NS);
    snaps
        .delete(&exec_obj.name_any(), &DeleteParams::default())
        .await
        .unwrap();
    common::wait_for("the execution gone", Duration::from_secs(60), || async {
        snaps
            .get_opt(&exec_obj.name_any())
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(!dir.exists(), "{} left behind", dir.display());

    // Storage that cannot be written: the execution fails, saying why, and the VM runs on.
    std::fs::write(blocked.join(NS), b"a file where a directory must go").unwrap();
    parent(
        &c,
        "blocked",
        json!({"type": "node-local", "nodeLocal": {"path": blocked.to_str().unwrap()}}),
    )
    .await;
    let failed = terminated_execution(&c, "blocked").await;
    let status = failed.status.clone().unwrap();
    assert_eq!(status.phase, Some(SnapshotPhase::Failed), "{status:?}");
    let ready = ready_of(&status);
    assert_eq!(ready.reason, "SnapshotFailed");
    assert!(
        ready.message.contains(blocked.to_str().unwrap()),
        "the cause is not named: {}",
        ready.message
    );
    common::events_with(&c, NS, &failed.name_any(), &["SnapshotFailed"]).await;
    assert_eq!(phase(&vms.get(VM).await.unwrap()), Some(VmPhase::Running));
    assert_eq!(common::qemu_of(&agent.state, &uid), qemu);
    assert_eq!(exec(&alice, "cat /mnt/t/secret").await.trim(), secret);

    // A path that is not one of the node's snapshot roots: the execution fails naming the
    // field and the roots, and nothing is made there.
    let outside = scratch_dir("imp-snapshot-e2e-outside").unwrap();
    let elsewhere = outside.join("elsewhere");
    for (name, path, want) in [
        (
            "elsewhere",
            elsewhere.clone(),
            "spec.storage.nodeLocal.path",
        ),
        ("linked", linked.clone(), "symbolic link"),
    ] {
        if name == "linked" {
            std::os::unix::fs::symlink(&outside, linked.join(NS)).unwrap();
        }
        parent(
            &c,
            name,
            json!({"type": "node-local", "nodeLocal": {"path": path.to_str().unwrap()}}),
        )
        .await;
        let failed = terminated_execution(&c, name).await;
        let status = failed.status.clone().unwrap();
        assert_eq!(
            status.phase,
            Some(SnapshotPhase::Failed),
            "{name}: {status:?}"
        );
        let ready = ready_of(&status);
        assert!(
            ready.reason == "SnapshotFailed" && ready.message.contains(want),
            "{name}: {}",
            ready.message
        );
        if want.starts_with("spec.") {
            assert!(
                ready.message.contains(store.to_str().unwrap()),
                "{}",
                ready.message
            );
        }
        common::events_with(&c, NS, &failed.name_any(), &["SnapshotFailed"]).await;
        // Deleting it removes nothing through the link, and it goes.
        snaps
            .delete(&failed.name_any(), &DeleteParams::default())
            .await
            .unwrap();
        common::wait_for(
            "the refused execution gone",
            Duration::from_secs(60),
            || async {
                snaps
                    .get_opt(&failed.name_any())
                    .await
                    .unwrap()
                    .is_none()
                    .then_some(())
            },
        )
        .await;
    }
    assert!(!elsewhere.exists(), "{} was made", elsewhere.display());
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "something was written through the link into {}",
        outside.display()
    );
    assert_eq!(common::qemu_of(&agent.state, &uid), qemu);

    // A snapshot of a VM that does not exist: the operator fails the execution, naming it.
    let snaps_api: Api<ImpVMSnapshot> = Api::namespaced(c.clone(), NS);
    let ghost: ImpVMSnapshot = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
        "metadata": {"name": "ghost", "namespace": NS},
        "spec": {"sourceVMName": "no-such-vm", "sourceVMNamespace": NS,
                 "storage": {"type": "node-local", "nodeLocal": {"path": store.to_str().unwrap()}}}
    }))
    .unwrap();
    snaps_api
        .create(&PostParams::default(), &ghost)
        .await
        .unwrap();
    let ghost_exec = terminated_execution(&c, "ghost").await;
    let status = ghost_exec.status.clone().unwrap();
    assert_eq!(status.phase, Some(SnapshotPhase::Failed), "{status:?}");
    let ready = ready_of(&status);
    assert!(
        ready.message.contains("no-such-vm") && ready.message.contains("not found"),
        "{}",
        ready.message
    );
    common::events_with(&c, NS, &ghost_exec.name_any(), &["SnapshotFailed"]).await;

    // oci-registry storage: pushed (memory chunked and compressed), restored into a new VM
    // from the registry, and deleted from it with the execution.
    let repo = format!("{}/snapshots/snap-vm", registry.host());
    parent(
        &c,
        "pushed",
        json!({"type": "oci-registry", "ociRegistry": {"repository": repo}}),
    )
    .await;
    let pushed = terminated_execution(&c, "pushed").await;
    let status = pushed.status.clone().unwrap();
    assert_eq!(status.phase, Some(SnapshotPhase::Succeeded), "{status:?}");
    let digest = status.digest.clone().expect("status.digest");
    assert!(digest.starts_with("sha256:"), "{digest}");
    assert!(status.snapshot_path.is_none(), "{status:?}");
    let ready = ready_of(&status);
    assert!(ready.message.contains(&repo), "{}", ready.message);
    assert!(
        !agent
            .state
            .join("snapshot-push")
            .join(pushed.uid().unwrap())
            .exists(),
        "the pushed files were left on the node"
    );
    let from_registry: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "snap-pulled", "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "image": image, "lifecycle": "persistent",
                 "snapshotRef": pushed.name_any()}
    }))
    .unwrap();
    let t = std::time::Instant::now();
    vms.create(&PostParams::default(), &from_registry)
        .await
        .unwrap();
    common::wait_vm(&vms, "snap-pulled", "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    let pulled_in = t.elapsed();
    let cached = agent
        .state
        .join("snapshot-cache")
        .join(pushed.uid().unwrap());
    assert!(
        cached.join("snapshot.json").is_file(),
        "no pull in {}",
        cached.display()
    );
    assert_eq!(
        exec_in(&alice, "snap-pulled", "cat /mnt/t/secret")
            .await
            .trim(),
        secret
    );
    eprintln!(
        "FIGURES restore of a new VM from a registry snapshot (pull included): ImpVM created → \
         Running {:.2} s; {}",
        pulled_in.as_secs_f64(),
        ready.message
    );
    vms.delete("snap-pulled", &DeleteParams::default())
        .await
        .unwrap();
    snaps
        .delete(&pushed.name_any(), &DeleteParams::default())
        .await
        .unwrap();
    common::wait_for(
        "the pushed execution gone",
        Duration::from_secs(60),
        || async {
            snaps
                .get_opt(&pushed.name_any())
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
    // The node's pulled copy went with the execution (dropped while it was being deleted).
    assert!(
        !cached.exists(),
        "{} outlived its execution",
        cached.display()
    );
    let gone = scratch_dir("imp-snapshot-e2e-gone").unwrap();
    let refetch = imp_agent::snapshot::oci::pull(
        &format!("{repo}@{digest}"),
        &gone,
        &imp_image::RegistryAuth::Anonymous,
    )
    .await;
    assert!(refetch.is_err(), "the registry still holds {digest}");

    // A registry that refuses the push: the execution fails naming it, the VM runs on.
    let locked = TestRegistry::start_with_basic_auth("imp", "secret")
        .await
        .unwrap();
    parent(
        &c,
        "refused",
        json!({"type": "oci-registry",
               "ociRegistry": {"repository": format!("{}/snapshots/x", locked.host())}}),
    )
    .await;
    let refused = terminated_execution(&c, "refused").await;
    let status = refused.status.clone().unwrap();
    assert_eq!(status.phase, Some(SnapshotPhase::Failed), "{status:?}");
    let ready = ready_of(&status);
    assert!(
        ready.message.contains(&locked.host()) && ready.message.contains("401"),
        "{}",
        ready.message
    );
    assert_eq!(phase(&vms.get(VM).await.unwrap()), Some(VmPhase::Running));
    assert_eq!(common::qemu_of(&agent.state, &uid), qemu);

    let scheduled = Scheduled {
        c: &c,
        alice: &alice,
        image: &image,
        store: &store,
    };
    scheduled
        .snapshots_prune_and_restore_the_newest(&secret)
        .await;
    assert_eq!(common::qemu_of(&agent.state, &uid), qemu);

    vms.delete(VM, &DeleteParams::default()).await.unwrap();
    let _ = std::fs::remove_dir_all(&store);
    let _ = std::fs::remove_dir_all(&blocked);
    let _ = std::fs::remove_dir_all(&gone);
}
