//! Warm pool benchmark (issue 39): through the real `imp operator` and `imp agent` on a node
//! namespace, with QEMU 10 (restored memory mapped from the snapshot's image), a 256 MiB guest
//! and a pool of one, measured per round, each from the ImpVM's create until a watch sees it
//! `Running`:
//! - claim: a VM with `spec.warmPoolRef` takes over the pool's member, waiting paused (the
//!   default) and, the pool annotated `imp.dev/member-state: running`, waiting running;
//! - cold create: a plain VM of the same template boots from its image;
//! - cold claim: the pool empty, the claim restores from the pool's base;
//! - the claim's control-plane part: the claim minus the guest's identity step (the shim's
//!   `guest_ms`, from the claimant's `Claimed` Event).
//!
//! It prints each round, the medians, claim / cold create (aim: at most 0.1) and the
//! control-plane part (aim: at most 50 ms), and what a member waiting paused or running costs
//! (CPU over 5 s, its own memory). `cargo bench -p imp --bench warm_pool` (10 rounds),
//! or `cargo test -p imp --bench warm_pool` for a debug build (3 rounds, as CI runs it);
//! `IMP_BENCH_ROUNDS` sets the rounds. Needs what `snapshot_clones_e2e` needs (root, iproute2,
//! nftables, QEMU 10, the guest kernel and init); without it, it skips on a developer machine
//! and fails under CI=true.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::nodes::{Agent, Topology, ready};
use common::snapshots::{self, parent, snapshot_root, terminated_execution};
use futures::TryStreamExt;
use imp_api::ImpWarmPool;
use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::figures::{figure, median};
use imp_testenv::registry::scratch_dir;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

const NS: &str = "default";

fn vm(name: &str, spec: serde_json::Value) -> ImpVM {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS}, "spec": spec
    }))
    .unwrap()
}

/// Creates `obj` and returns how long until a watch of it sees phase `Running`.
async fn create_until_running(vms: &Api<ImpVM>, obj: &ImpVM) -> Duration {
    let name = obj.name_any();
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut seen = Box::pin(watcher(vms.clone(), config).applied_objects());
    let t0 = Instant::now();
    vms.create(&PostParams::default(), obj).await.unwrap();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(300), seen.try_next())
            .await
            .unwrap_or_else(|_| panic!("{name} did not run within 300 s"))
            .unwrap();
        let v = next.unwrap_or_else(|| panic!("the watch of {name} ended"));
        match common::phase(&v) {
            Some(VmPhase::Running) => return t0.elapsed(),
            Some(VmPhase::Failed) => panic!("{name} failed: {:?}", v.status),
            _ => {}
        }
    }
}

/// Deletes `name` and waits until it is gone (its node let go of it).
async fn delete(vms: &Api<ImpVM>, name: &str) {
    vms.delete(name, &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(vms, name, 120).await;
}

/// Sets the pool's size and waits until it holds that many ready members and nothing else.
async fn pool_at(c: &kube::Client, vms: &Api<ImpVM>, size: i32) {
    let pools: Api<ImpWarmPool> = Api::namespaced(c.clone(), NS);
    pools
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"size": size}})),
        )
        .await
        .unwrap();
    common::wait_for(
        &format!("the pool at {size}"),
        Duration::from_secs(300),
        || async {
            let members = vms
                .list(&ListParams::default().labels("imp.dev/warm-pool=py"))
                .await
                .ok()?
                .items;
            let running = members
                .iter()
                .filter(|m| common::phase(m) == Some(VmPhase::Running))
                .count();
            let ready = pools.get("py").await.ok()?.status?.ready_count;
            (members.len() == running && running == usize::try_from(size).ok()? && ready == size)
                .then_some(())
        },
    )
    .await;
}

/// The guest's identity step of claimant `name`, in ms, from its `Claimed` Event.
async fn guest_ms(c: &kube::Client, name: &str) -> f64 {
    common::wait_for(
        &format!("the Claimed Event of {name}"),
        Duration::from_secs(30),
        || async {
            let events = common::events_of(c, NS, name).await;
            events
                .iter()
                .filter(|e| e.reason.as_deref() == Some("Claimed"))
                .filter_map(|e| e.message.as_deref())
                .find_map(|m| {
                    let (_, rest) = m.split_once(" ms on the node (")?;
                    rest.split_once(" ms")?.0.parse().ok()
                })
        },
    )
    .await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo test --benches` passes libtest flags; the benchmark ignores them.
    if ready().is_none() {
        return;
    }
    let Some(qemu_10) = common::qemu_10() else {
        return;
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let benching = std::env::args().any(|a| a == "--bench");
    let rounds: usize = std::env::var("IMP_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching { 10 } else { 3 })
        .max(1);
    let topo = Topology::create();
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
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
               "spec": {"subnet": topo.subnet(218)}}),
    )
    .await;
    let layout = scratch_dir("imp-pool-bench-layout").unwrap();
    common::busybox_image(&["sh", "sleep"], "while true; do sleep 1; done")
        .write_layout(&layout, "1")
        .unwrap();
    let image = format!("oci:{}:1", layout.display());
    let cache = scratch_dir("imp-pool-bench-cache").unwrap();
    let store = snapshot_root("imp-pool-bench-store");
    let _operator = common::start_operator(&kube);
    let mut agent = Agent::new(&topo, "a", topo.underlay(1));
    agent.env = vec![("PATH".into(), common::path_with(&qemu_10))];
    agent.extra_args = vec![format!("--snapshot-root={}", store.display())];
    agent.start(&kube.agent_kubeconfig_for(&agent.node).await, &cache);
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);

    // The source, its snapshot elected the base, the template and a pool of one.
    let spec = json!({"classRef": {"name": "small"}, "image": image, "lifecycle": "persistent",
                      "networkRef": {"name": "net1"}, "nodeName": "node-a"});
    let warm_up = create_until_running(&vms, &vm("src", spec)).await;
    println!(
        "warm-up (image unpacked): source booted in {:.2} s",
        warm_up.as_secs_f64()
    );
    let storage = json!({"type": "node-local", "nodeLocal": {"path": store.to_str().unwrap()}});
    parent(&c, NS, "base", "src", storage).await;
    let execution = terminated_execution(&c, NS, "base").await.name_any();
    Api::<imp_api::snapshot::ImpVMSnapshot>::namespaced(c.clone(), NS)
        .patch(
            "base",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"baseSnapshot": execution}})),
        )
        .await
        .unwrap();
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
               "metadata": {"name": "py", "namespace": NS},
               "spec": {"snapshotRef": "base", "templateName": "warm", "size": 1}}),
    )
    .await;
    let claimant = json!({"templateRef": {"name": "warm"}, "warmPoolRef": {"name": "py"}});
    // Pinned: the topology has a second node, with no agent.
    let plain = json!({"templateRef": {"name": "warm"}, "nodeName": "node-a"});

    println!(
        "warm pool, 256 MiB guest under QEMU 10 ({rounds} rounds; create -> Running seen by a watch):"
    );
    let (mut claims, mut running_claims, mut colds, mut cold_claims, mut planes, mut ratios) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for i in 1..=rounds {
        // One guest besides the source at a time: the pool's member, then the VM measured.
        // A member waiting paused (the default), claimed; its replacement waits running (the
        // pool's annotation, set before the claim makes it), claimed in turn.
        snapshots::member_state(&c, NS, "py", None).await;
        pool_at(&c, &vms, 1).await;
        waiting(&vms, &agent, true).await;
        snapshots::member_state(&c, NS, "py", Some("running")).await;
        let name = format!("claim-{i}");
        let claim = create_until_running(&vms, &vm(&name, claimant.clone())).await;
        let guest = guest_ms(&c, &name).await;
        delete(&vms, &name).await;
        pool_at(&c, &vms, 1).await;
        waiting(&vms, &agent, false).await;
        let name = format!("claim-running-{i}");
        let running_claim = create_until_running(&vms, &vm(&name, claimant.clone())).await;
        delete(&vms, &name).await;
        snapshots::member_state(&c, NS, "py", None).await;
        pool_at(&c, &vms, 0).await;
        let name = format!("plain-{i}");
        let cold = create_until_running(&vms, &vm(&name, plain.clone())).await;
        delete(&vms, &name).await;
        let name = format!("empty-{i}");
        let cold_claim = create_until_running(&vms, &vm(&name, claimant.clone())).await;
        delete(&vms, &name).await;
        let plane = ms(claim) - guest;
        let ratio = claim.as_secs_f64() / cold.as_secs_f64();
        println!(
            "  round {i}: claim of a paused member -> Running {:.0} ms (guest's identity {guest:.0} \
             ms, control plane {plane:.0} ms) | of a running member {:.0} ms | cold create {:.0} \
             ms | cold claim (empty pool) {:.0} ms | claim / cold create {ratio:.3}",
            ms(claim),
            ms(running_claim),
            ms(cold),
            ms(cold_claim),
        );
        claims.push(ms(claim));
        running_claims.push(ms(running_claim));
        colds.push(ms(cold));
        cold_claims.push(ms(cold_claim));
        planes.push(plane);
        ratios.push(ratio);
    }
    for paused in [true, false] {
        snapshots::member_state(&c, NS, "py", (!paused).then_some("running")).await;
        pool_at(&c, &vms, 1).await;
        waiting_member_costs(&vms, &agent, paused).await;
        pool_at(&c, &vms, 0).await;
    }
    let ratio = median(&mut ratios);
    let plane = median(&mut planes);
    println!("  median claim / cold create: {ratio:.3} (aim: at most 0.1)");
    println!("  median control-plane part of a claim: {plane:.0} ms (aim: at most 50 ms)");
    figure(
        "warm pool: claim of a paused member -> Running",
        median(&mut claims),
        "ms",
        "",
    );
    figure(
        "warm pool: claim of a running member -> Running",
        median(&mut running_claims),
        "ms",
        "",
    );
    figure(
        "warm pool: cold create -> Running, same template",
        median(&mut colds),
        "ms",
        "",
    );
    figure(
        "warm pool: cold claim (empty pool) -> Running",
        median(&mut cold_claims),
        "ms",
        "",
    );
    figure("warm pool: claim / cold create", ratio, "x", "aim <= 0.1");
    figure(
        "warm pool: control-plane part of a claim",
        plane,
        "ms",
        "aim <= 50 ms",
    );
    let _ = std::fs::remove_dir_all(&store);
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&cache);
}

/// Waits until the pool's one member waits paused (or running, with `paused` false), as the
/// agent's record of it says; returns its QEMU's pid.
async fn waiting(vms: &Api<ImpVM>, agent: &Agent, paused: bool) -> u32 {
    let uid = vms
        .list(&ListParams::default().labels("imp.dev/warm-pool=py"))
        .await
        .unwrap()
        .items
        .remove(0)
        .uid()
        .unwrap();
    common::wait_for(
        &format!("the member waiting paused: {paused}"),
        Duration::from_secs(60),
        || async { (agent.paused(&uid) == paused).then_some(()) },
    )
    .await;
    let qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(qemu.len(), 1, "{qemu:?}");
    qemu[0]
}

/// What a ready member costs while it waits for a claim, paused or running (issue 39's Q1):
/// the CPU its QEMU uses over 5 s, and its memory (resident, and the part of it that is its
/// own: the private dirty pages; the rest is the base's image, mapped and shared through the
/// page cache). A suspended member would save the memory too, but its claim is a restore (the
/// cold claim above).
async fn waiting_member_costs(vms: &Api<ImpVM>, agent: &Agent, paused: bool) {
    let pid = waiting(vms, agent, paused).await;
    let before = cpu_ticks(pid);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let used = (cpu_ticks(pid) - before) as f64 / clock_ticks() / t.elapsed().as_secs_f64();
    let (rss, private) = (smaps_kib(pid, "Rss:"), smaps_kib(pid, "Private_Dirty:"));
    let how = if paused { "paused" } else { "running" };
    println!(
        "  a ready member waiting {how}: {:.1} % of a CPU; {:.0} MiB resident, {:.0} MiB of it its own",
        used * 100.0,
        rss / 1024.0,
        private / 1024.0
    );
    figure(
        &format!("warm pool: a member waiting {how}: CPU"),
        used * 100.0,
        "%",
        "",
    );
    figure(
        &format!("warm pool: a member waiting {how}: own memory"),
        private / 1024.0,
        "MiB",
        "",
    );
}

/// User and system CPU time of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the command's ')'.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |t| t as f64)
}

/// Field `key` of process `pid`'s `smaps_rollup`, in KiB.
fn smaps_kib(pid: u32, key: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}
