//! End-to-end: one ImpVMSnapshot restored into two new VMs at once, on one network, and a
//! snapshot that a node's QEMU cannot load; through the real `imp operator` and a real
//! `imp agent` in a node network namespace (`common::nodes`), a real kube-apiserver with the
//! chart's RBAC, and real Linux guests under QEMU/TCG.
//!
//! The node's agent runs QEMU 10 (`scripts/fetch-qemu-10.sh`), which maps a read-only file
//! as private RAM. Proves: a snapshot of a VM holding 16 MiB of random data in a tmpfs is
//! restored into two VMs created together; both run with the snapshot's image mapped
//! private and read-only (QEMU's command line), each with its own address on the network,
//! its own hostname and its own random numbers, each holding the source's data; each
//! answers a ping from the node and from the other clone and the source.
//!
//! The same snapshot then serves a warm pool of two (issue 39): no member until it is elected
//! the base; members restored from it run under their own names and are replaced when
//! deleted; they wait running while the pool says `imp.dev/member-state: running`, else paused
//! (their records say so); a VM with `spec.warmPoolRef` takes over a member, resumed (the same
//! QEMU process,
//! the source's data, the claimant's hostname, the member's address answering the node, the
//! member's reservation Pod and no other), the member object goes and the pool refills; a
//! claim booked while the node's agent is down is finished by the restarted agent, and so is
//! a claim whose agent dies by SIGKILL at each of its named steps (`imp_telemetry::fault`);
//! an empty pool gives a cold start restoring from the base, with a `ColdStart` Event.
//!
//! Then the node's QEMU changes to Debian's 7.2 (the agent restarted with it; running VMs keep
//! theirs): a third VM from the same snapshot fails with a Ready condition naming both QEMU
//! versions, and the pool's replacements fail likewise until it backs off (`MembersFailing`).
//!
//! Needs root, iproute2, nftables, what a guest boot needs and QEMU 10 (`scripts/setup`):
//! without them it skips on a developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::nodes::{Agent, Topology, ready, text};
use common::snapshots::{self, exec_in, parent, terminated_execution};
use common::{phase, wait_vm};

use std::time::Duration;

use imp_api::ImpWarmPool;
use imp_api::snapshot::SnapshotPhase;
use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::{TestImage, scratch_dir};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "default";

/// Busybox with what the workload and the checks run.
fn image() -> TestImage {
    common::busybox_image(
        &[
            "sh", "cat", "sleep", "hostname", "ping", "mkdir", "mount", "head", "md5sum",
            "hexdump", "test", "mv",
        ],
        "eval \"$SCRIPT\"",
    )
}

/// 16 MiB of random data in a tmpfs (guest memory only), then idle.
const WORKLOAD: &str = "mkdir -p /mnt/t && mount -t tmpfs -o size=32m t /mnt/t && \
     head -c 16777216 /dev/urandom > /mnt/t/blob.tmp && mv /mnt/t/blob.tmp /mnt/t/blob; \
     while true; do sleep 1; done";

fn ip_of(v: &ImpVM) -> String {
    v.status.as_ref().and_then(|s| s.ip.clone()).unwrap()
}

/// A persistent VM of class `small` on network `net1` running the workload, from snapshot
/// execution `from` if given.
fn vm(name: &str, image: &str, from: Option<&str>) -> ImpVM {
    let mut spec = json!({"classRef": {"name": "small"}, "image": image,
        "lifecycle": "persistent", "networkRef": {"name": "net1"},
        "env": [{"name": "SCRIPT", "value": WORKLOAD}]});
    if let Some(from) = from {
        spec["snapshotRef"] = json!(from);
    } else {
        spec["nodeName"] = json!("node-a");
    }
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS}, "spec": spec
    }))
    .unwrap()
}

/// Waits up to `secs` until warm pool `py`'s Ready condition has `reason` and `pred` holds.
async fn wait_pool(
    pools: &Api<ImpWarmPool>,
    reason: &str,
    secs: u64,
    pred: impl Fn(&ImpWarmPool) -> bool,
) -> ImpWarmPool {
    common::wait_for(
        &format!("pool py with Ready reason {reason}"),
        Duration::from_secs(secs),
        || async {
            let p = pools.get("py").await.ok()?;
            let ready = p
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")?;
            (ready.reason == reason && pred(&p)).then_some(p)
        },
    )
    .await
}

/// The pool's members not being deleted.
async fn members(vms: &Api<ImpVM>) -> Vec<ImpVM> {
    vms.list(&ListParams::default().labels("imp.dev/warm-pool=py"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|v| v.metadata.deletion_timestamp.is_none())
        .collect()
}

fn ready_count(p: &ImpWarmPool) -> i32 {
    p.status.as_ref().map_or(0, |s| s.ready_count)
}

/// A claimant of pool `py` (template `warm`).
fn claimant(name: &str) -> ImpVM {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"templateRef": {"name": "warm"}, "warmPoolRef": {"name": "py"}}
    }))
    .unwrap()
}

/// A ready member as a claim may find it: its name, address and QEMU process.
#[derive(Debug, Clone)]
struct Member {
    name: String,
    ip: String,
    qemu: u32,
}

/// Waits until pool `py` holds two ready members, each waiting paused, and returns them by
/// uid.
async fn whole_pool(
    pools: &Api<ImpWarmPool>,
    vms: &Api<ImpVM>,
    a: &Agent,
) -> std::collections::BTreeMap<String, Member> {
    wait_pool(pools, "Reconciled", 300, |p| ready_count(p) == 2).await;
    common::wait_for("the members paused", Duration::from_secs(60), || async {
        let m = members(vms).await;
        (m.len() == 2 && m.iter().all(|v| a.paused(&v.uid().unwrap()))).then_some(())
    })
    .await;
    let mut ready = std::collections::BTreeMap::new();
    for m in members(vms).await {
        let uid = m.uid().unwrap();
        let qemu = common::qemu_of(&a.state, &uid);
        assert_eq!(qemu.len(), 1, "member {}: {qemu:?}", m.name_any());
        let member = Member {
            name: m.name_any(),
            ip: ip_of(&m),
            qemu: qemu[0],
        };
        ready.insert(uid, member);
    }
    ready
}

/// The member of `ready` that `claimed` took over: its claim names it, and its QEMU process is
/// the one the claimant runs in, alone.
fn took_over(
    claimed: &ImpVM,
    ready: &std::collections::BTreeMap<String, Member>,
    a: &Agent,
) -> Member {
    let claim = claimed.status.as_ref().unwrap().warm_claim.clone().unwrap();
    let uid = claim.member_uid.clone().unwrap_or_default();
    let member = ready
        .get(&uid)
        .unwrap_or_else(|| panic!("{} took no ready member: {claim:?}", claimed.name_any()))
        .clone();
    assert_eq!(claim.member.as_deref(), Some(member.name.as_str()));
    assert_eq!(
        common::qemu_of(&a.state, &uid),
        [member.qemu],
        "{} does not run in its member's QEMU process",
        claimed.name_any()
    );
    member
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clones_at_once_share_a_network_and_a_qemu_that_cannot_load_the_snapshot_says_so() {
    let _run = common::test_run("snapshot_clones_e2e", Duration::from_secs(600));
    if ready().is_none() {
        return;
    }
    let Some(qemu_10) = common::qemu_10() else {
        return;
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let topo = Topology::create();
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
    let (alice, _) = common::exec_users(&kube, NS).await;
    common::create_imp(
        &c,
        "ImpVMClass",
        "impvmclasses",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
               "metadata": {"name": "small"},
               "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1}}),
    )
    .await;
    common::create_imp(
        &c,
        "ImpNetwork",
        "impnetworks",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
               "metadata": {"name": "net1", "namespace": NS},
               "spec": {"subnet": topo.subnet(216)}}),
    )
    .await;
    let layout = scratch_dir("imp-clones-e2e-layout").unwrap();
    image().write_layout(&layout, "1").unwrap();
    let image = format!("oci:{}:1", layout.display());
    let cache = scratch_dir("imp-clones-e2e-cache").unwrap();

    let store = snapshots::snapshot_root("imp-clones-e2e-store");
    let _operator = common::start_operator(&kube);
    let mut a = Agent::new(&topo, "a", topo.underlay(1));
    a.env = vec![("PATH".into(), common::path_with(&qemu_10))];
    a.extra_args = vec![format!("--snapshot-root={}", store.display())];
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    vms.create(&PostParams::default(), &vm("src", &image, None))
        .await
        .unwrap();
    let src = wait_vm(&vms, "src", "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    common::wait_for("the source's data", Duration::from_secs(60), || async {
        let out = exec_in(&alice, NS, "src", "test -e /mnt/t/blob && echo ok || true").await;
        (out.trim() == "ok").then_some(())
    })
    .await;
    let data = exec_in(&alice, NS, "src", "md5sum /mnt/t/blob").await;

    parent(
        &c,
        NS,
        "base",
        "src",
        json!({"type": "node-local", "nodeLocal": {"path": store.to_str().unwrap()}}),
    )
    .await;
    let execution = terminated_execution(&c, NS, "base").await;
    let status = execution.status.clone().unwrap();
    assert_eq!(status.phase, Some(SnapshotPhase::Succeeded), "{status:?}");
    let dir = std::path::PathBuf::from(status.snapshot_path.clone().unwrap());
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("snapshot.json")).unwrap()).unwrap();
    let writer = manifest["vmm"].as_str().unwrap().to_owned();
    assert!(writer.starts_with("qemu 10."), "{manifest}");

    // Two VMs from the snapshot, created together.
    let from = execution.name_any();
    for name in ["c1", "c2"] {
        vms.create(&PostParams::default(), &vm(name, &image, Some(&from)))
            .await
            .unwrap();
    }
    let mut clones = Vec::new();
    for name in ["c1", "c2"] {
        clones.push(
            wait_vm(&vms, name, "Running", 300, |v| {
                phase(v) == Some(VmPhase::Running)
            })
            .await,
        );
    }
    let ips = [ip_of(&src), ip_of(&clones[0]), ip_of(&clones[1])];
    assert!(
        ips[0] != ips[1] && ips[0] != ips[2] && ips[1] != ips[2],
        "addresses {ips:?}"
    );
    let mut random = Vec::new();
    for (i, name) in ["c1", "c2"].into_iter().enumerate() {
        let clone = &clones[i];
        assert_eq!(
            clone.status.as_ref().and_then(|s| s.node_name.as_deref()),
            Some("node-a")
        );
        assert_eq!(
            exec_in(&alice, NS, name, "hostname").await.trim(),
            name,
            "{name} kept the source's hostname"
        );
        assert_eq!(
            exec_in(&alice, NS, name, "md5sum /mnt/t/blob").await,
            data,
            "{name} lacks the source's data"
        );
        random.push(
            exec_in(
                &alice,
                NS,
                name,
                "hexdump -n 16 -e '16/1 \"%02x\"' /dev/urandom",
            )
            .await,
        );
        // Each answers on its own address: the node, its sibling and the source reach it.
        let ip = &ips[i + 1];
        let from_node = topo.exec("a", &["busybox", "ping", "-c", "1", "-W", "10", ip]);
        assert!(
            from_node.status.success(),
            "node → {name}: {}",
            text(&from_node)
        );
        let sibling = if i == 0 { "c2" } else { "c1" };
        exec_in(&alice, NS, sibling, &format!("ping -c 1 -W 10 {ip}")).await;
        exec_in(&alice, NS, "src", &format!("ping -c 1 -W 10 {ip}")).await;
        // Its RAM is the snapshot's image, mapped private and read-only.
        let uid = clone.uid().unwrap();
        let qemu = common::qemu_of(&a.state, &uid);
        assert_eq!(qemu.len(), 1, "{name}: {qemu:?}");
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", qemu[0])).unwrap();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(
            cmdline.contains("share=off,readonly=on,rom=off"),
            "{name}: {cmdline}"
        );
    }
    assert_ne!(
        random[0], random[1],
        "the clones read the same random bytes"
    );

    // The clones have shown what they show: their guests make room for the pool's.
    for name in ["c1", "c2"] {
        vms.delete(name, &Default::default()).await.unwrap();
        common::wait_vm_gone(&vms, name, 120).await;
    }

    // A warm pool of two (issue 39, layer 3): no member until the execution is elected its
    // base; then members restored from it run under their own names, holding the source's
    // data, and a member deleted is replaced.
    common::create_imp(
        &c,
        "ImpVMTemplate",
        "impvmtemplates",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
               "metadata": {"name": "warm", "namespace": NS},
               "spec": {"classRef": {"name": "small"}, "networkRef": {"name": "net1"},
                        "image": image}}),
    )
    .await;
    common::create_imp(
        &c,
        "ImpWarmPool",
        "impwarmpools",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
               "metadata": {"name": "py", "namespace": NS,
                            "annotations": {"imp.dev/member-state": "running"}},
               "spec": {"snapshotRef": "base", "templateName": "warm", "size": 2}}),
    )
    .await;
    let pools: Api<ImpWarmPool> = Api::namespaced(c.clone(), NS);
    wait_pool(&pools, "NoBase", 30, |_| true).await;
    assert!(members(&vms).await.is_empty());
    let snaps: Api<imp_api::snapshot::ImpVMSnapshot> = Api::namespaced(c.clone(), NS);
    snaps
        .patch(
            "base",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"baseSnapshot": from}})),
        )
        .await
        .unwrap();
    let full = wait_pool(&pools, "Reconciled", 300, |p| ready_count(p) == 2).await;
    assert_eq!(
        full.status.as_ref().unwrap().base_snapshot.as_deref(),
        Some(from.as_str())
    );
    let first = members(&vms).await;
    assert_eq!(first.len(), 2, "{first:?}");
    for m in &first {
        let member = m.name_any();
        assert_eq!(m.spec.snapshot_ref.as_deref(), Some(from.as_str()));
        assert_eq!(
            exec_in(&alice, NS, &member, "hostname").await.trim(),
            member
        );
        assert_eq!(
            exec_in(&alice, NS, &member, "md5sum /mnt/t/blob").await,
            data,
            "member {member} lacks the source's data"
        );
    }
    // Kept running (the pool's annotation): exec answered, the records say not paused.
    assert!(first.iter().all(|m| !a.paused(&m.uid().unwrap())));
    // Without it, members wait paused: both deleted, their replacements run, then pause.
    snapshots::member_state(&c, NS, "py", None).await;
    let gone: Vec<String> = first.iter().map(ResourceExt::name_any).collect();
    for name in &gone {
        vms.delete(name, &Default::default()).await.unwrap();
    }
    // The replacements run; then (the pool having said Waiting when it made them) the pool is
    // whole again.
    common::wait_for(
        "the replacement members",
        Duration::from_secs(300),
        || async {
            let m = members(&vms).await;
            (m.len() == 2
                && m.iter()
                    .all(|v| !gone.contains(&v.name_any()) && phase(v) == Some(VmPhase::Running)))
            .then_some(())
        },
    )
    .await;

    // A claim: VM "job" takes over a running member, the same QEMU process holding the
    // source's data, under its own name and hostname, on the member's address; the member
    // object goes and the pool refills.
    let ready_members = whole_pool(&pools, &vms, &a).await;
    vms.create(&PostParams::default(), &claimant("job"))
        .await
        .unwrap();
    let job = wait_vm(&vms, "job", "job Running", 120, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    let taken = took_over(&job, &ready_members, &a);
    let taken_uid = job
        .status
        .as_ref()
        .unwrap()
        .warm_claim
        .as_ref()
        .unwrap()
        .member_uid
        .clone()
        .unwrap();
    assert!(!a.paused(&taken_uid), "the claimed VM is still paused");
    let (taken_name, taken_ip) = (taken.name.clone(), taken.ip.clone());
    assert_eq!(
        job.status
            .as_ref()
            .unwrap()
            .warm_claim
            .as_ref()
            .unwrap()
            .cold,
        None
    );
    assert_eq!(
        ip_of(&job),
        taken_ip,
        "the claimant left its member's address"
    );
    // Its reservation is its member's Pod, handed over: one Pod, none made for it.
    let reserved = common::reservations_of(&c, NS, &job.uid().unwrap()).await;
    assert_eq!(reserved, [format!("imp-vm-{taken_name}")]);
    assert_eq!(exec_in(&alice, NS, "job", "hostname").await.trim(), "job");
    assert_eq!(
        exec_in(&alice, NS, "job", "md5sum /mnt/t/blob").await,
        data,
        "the claimed VM lacks the source's data"
    );
    let from_node = topo.exec("a", &["busybox", "ping", "-c", "1", "-W", "10", &taken_ip]);
    assert!(
        from_node.status.success(),
        "node → job: {}",
        text(&from_node)
    );
    common::wait_for(
        "the claimed member object gone",
        Duration::from_secs(60),
        || async {
            vms.get_opt(&taken_name)
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
    wait_pool(&pools, "Reconciled", 300, |p| {
        ready_count(p) == 2 && p.status.as_ref().is_some_and(|s| s.claimed_count == 1)
    })
    .await;
    let events = common::events_of(&c, NS, "job").await;
    assert!(
        events.iter().any(|e| e.reason.as_deref() == Some("Claimed")
            && e.message
                .as_deref()
                .is_some_and(|m| m.contains(&taken_name))),
        "{events:?}"
    );
    // The member object's own last Event says which VM it became.
    let events = common::events_of(&c, NS, &taken_name).await;
    assert!(
        events.iter().any(|e| e.reason.as_deref() == Some("Claimed")
            && e.message
                .as_deref()
                .is_some_and(|m| m.contains("became ImpVM job"))),
        "{events:?}"
    );

    // The node's agent down while a claim is booked onto its node: restarted, it finishes the
    // claim (the member's VM, which ran on without it, becomes the claimant's).
    let ready_members = whole_pool(&pools, &vms, &a).await;
    a.kill().await;
    vms.create(&PostParams::default(), &claimant("job2"))
        .await
        .unwrap();
    wait_vm(
        &vms,
        "job2",
        "job2 booked onto the member's node",
        60,
        |v| {
            v.status
                .as_ref()
                .is_some_and(|s| s.booking.is_some() && s.warm_claim.is_some())
        },
    )
    .await;
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    let job2 = wait_vm(&vms, "job2", "job2 Running", 120, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    took_over(&job2, &ready_members, &a);
    assert_eq!(exec_in(&alice, NS, "job2", "hostname").await.trim(), "job2");

    // The agent killed (SIGKILL, by its fault points) at each named step of a claim on the
    // node in turn: restarted, it finishes the claim on the member's running VM, one QEMU.
    let mut done = vec!["job2".to_owned()];
    for (i, point) in ["claim.spec-written", "claim.tap-rebound", "claim.committed"]
        .into_iter()
        .enumerate()
    {
        let ready_members = whole_pool(&pools, &vms, &a).await;
        let kubeconfig = kube.agent_kubeconfig_for(&a.node).await;
        a.restart_dying_at(point, &kubeconfig, &cache).await;
        let name = format!("step{i}");
        vms.create(&PostParams::default(), &claimant(&name))
            .await
            .unwrap();
        a.died(point).await;
        a.start(&kubeconfig, &cache);
        let claimed = wait_vm(&vms, &name, "Running after the agent's crash", 120, |v| {
            phase(v) == Some(VmPhase::Running)
        })
        .await;
        let member = took_over(&claimed, &ready_members, &a);
        assert_eq!(ip_of(&claimed), member.ip, "{point}");
        assert_eq!(
            exec_in(&alice, NS, &name, "hostname").await.trim(),
            name,
            "{point}"
        );
        let from_node = topo.exec("a", &["busybox", "ping", "-c", "1", "-W", "10", &member.ip]);
        assert!(from_node.status.success(), "{point}: {}", text(&from_node));
        done.push(name);
    }

    // An empty pool: the claim starts cold, restoring from the base, and says so.
    pools
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"size": 0}})),
        )
        .await
        .unwrap();
    common::wait_for("the pool emptied", Duration::from_secs(60), || async {
        members(&vms).await.is_empty().then_some(())
    })
    .await;
    vms.create(&PostParams::default(), &claimant("cold"))
        .await
        .unwrap();
    let cold = wait_vm(&vms, "cold", "cold Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    let claim = cold.status.as_ref().unwrap().warm_claim.clone().unwrap();
    assert!(
        claim.member.is_none()
            && claim.base_snapshot.as_deref() == Some(from.as_str())
            && claim
                .cold
                .as_deref()
                .is_some_and(|c| c.contains("no ready member")),
        "{claim:?}"
    );
    assert_eq!(exec_in(&alice, NS, "cold", "hostname").await.trim(), "cold");
    assert_eq!(
        exec_in(&alice, NS, "cold", "md5sum /mnt/t/blob").await,
        data
    );
    let events = common::events_of(&c, NS, "cold").await;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("ColdStart")),
        "{events:?}"
    );
    // Room on the node for what follows.
    done.push("cold".to_owned());
    for name in &done {
        vms.delete(name, &Default::default()).await.unwrap();
    }
    for name in &done {
        common::wait_vm_gone(&vms, name, 120).await;
    }
    pools
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"size": 1}})),
        )
        .await
        .unwrap();
    let third = common::wait_for("a member again", Duration::from_secs(300), || async {
        let m = members(&vms).await;
        (m.len() == 1 && phase(&m[0]) == Some(VmPhase::Running)).then_some(m)
    })
    .await;

    // The node's QEMU becomes Debian's 7.2 (the agent restarts with it; the VMs running keep
    // their QEMU 10): a new VM from the snapshot written by 10 fails, naming both.
    a.kill().await;
    a.env.clear();
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    vms.create(&PostParams::default(), &vm("c3", &image, Some(&from)))
        .await
        .unwrap();
    let failed = wait_vm(&vms, "c3", "Failed", 300, |v| {
        phase(v) == Some(VmPhase::Failed)
    })
    .await;
    let ready = failed
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .cloned()
        .expect("a Ready condition");
    eprintln!("c3: {}: {}", ready.reason, ready.message);
    assert!(
        ready.message.contains(&format!("written by {writer}"))
            && ready.message.contains("runs qemu 7.")
            && ready
                .message
                .contains("an older VMM cannot read a newer one's snapshot"),
        "{}",
        ready.message
    );
    // The pool's running member keeps its QEMU 10; deleted, its replacements fail under 7.2
    // one after the other, and from the third the pool backs off, quoting why.
    vms.delete(&third[0].name_any(), &Default::default())
        .await
        .unwrap();
    let failing = wait_pool(&pools, "MembersFailing", 300, |_| true).await;
    let status = failing.status.clone().unwrap();
    let msg = &status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap()
        .message;
    eprintln!("pool py: {msg}");
    assert!(
        status.failed_in_a_row >= 3 && msg.contains("runs qemu 7."),
        "{status:?}"
    );
    assert_eq!(status.ready_count, 0);
    for name in ["src", "job"] {
        assert_eq!(
            phase(&vms.get(name).await.unwrap()),
            Some(VmPhase::Running),
            "{name}"
        );
    }
    let _ = std::fs::remove_dir_all(&store);
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&cache);
}
