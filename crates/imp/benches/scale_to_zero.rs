//! Scale-to-zero benchmark: a ScaleToZero ImpVM (256 MiB, 1 GiB and 2 GiB under `cargo bench`;
//! 256 MiB and 2 GiB under `cargo test`, as CI runs it, so that the README's "a wake does not
//! grow with the guest's memory" is printed in every CI run; `IMP_BENCH_MEMORY=256,1024`
//! chooses; idleTimeout 10s) through the real
//! `imp operator` and `imp agent` on a node namespace, measured per round:
//! - cold boot: ImpVM created → the first TCP connection from the node is answered;
//! - suspend (the shim's pause + snapshot + VMM stop) and the snapshot's size;
//! - wake: `connect()` from the node to the sleeping VM, i.e. its first SYN → the SYN-ACK,
//!   with the resume in between, and the resume's own time (restore → guest agent answers);
//! - the ratio wake / cold boot of the same VM in the same round, and each size's median wake
//!   beside the first size's (the guest's RAM is mapped from a file, so a wake should not
//!   grow with the guest's memory).
//!
//! `cargo bench -p imp --bench scale_to_zero`, or `cargo test -p imp --bench scale_to_zero` for
//! a debug build. `IMP_BENCH_ROUNDS` sets the rounds (default 3). Needs what the scale-to-zero
//! end-to-end test needs (root, iproute2, nftables, QEMU, the guest kernel and init); without
//! it, it skips on a developer machine and fails under CI=true.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use imp_testenv::figures::{figure, median};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::nodes::{Agent, Topology, ready};
use imp_agent::runtime::state::StateDir;
use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::scratch_dir;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

const NS: &str = "default";

/// Connects to `addr` from inside network namespace `netns` (a thread of its own enters it),
/// returning how long `connect()` took, or None if nothing answered within `timeout`.
fn connect_from(netns: &str, addr: SocketAddr, timeout: Duration) -> Option<Duration> {
    let path = format!("/var/run/netns/{netns}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap();
        #[allow(unsafe_code)]
        // SAFETY: setns on an open namespace file; it changes only this thread's namespace.
        let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "entering {path}");
        let t = Instant::now();
        TcpStream::connect_timeout(&addr, timeout)
            .ok()
            .map(|_| t.elapsed())
    })
    .join()
    .unwrap()
}

async fn phase_of(vms: &Api<ImpVM>, name: &str) -> Option<VmPhase> {
    vms.get_opt(name)
        .await
        .unwrap()
        .and_then(|v| v.status.and_then(|s| s.phase))
}

async fn wait_phase(vms: &Api<ImpVM>, name: &str, want: VmPhase, secs: u64) {
    common::wait_for(
        &format!("{name} {want:?}"),
        Duration::from_secs(secs),
        || async move { (phase_of(vms, name).await == Some(want)).then_some(()) },
    )
    .await;
}

struct Round {
    cold_boot: Duration,
    suspend_ms: u64,
    snapshot_bytes: u64,
    wake: Duration,
    resume_ms: u64,
}

async fn round(
    vms: &Api<ImpVM>,
    image: &str,
    state: &StateDir,
    netns: &str,
    (mib, i): (u32, usize),
) -> Round {
    let name = format!("z{mib}-{i}");
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"classRef": {"name": format!("bench-{mib}")}, "image": image, "nodeName": "node-a",
                 "lifecycle": "persistent", "networkRef": {"name": "net1"},
                 "desiredState": "ScaleToZero", "idleTimeout": "10s",
                 "env": [{"name": "SCRIPT", "value":
                     "while true; do echo pong | nc -l -p 9000 >/dev/null; done"}]}
    }))
    .unwrap();
    let t0 = Instant::now();
    let created = vms.create(&PostParams::default(), &obj).await.unwrap();
    let uid = created.uid().unwrap();
    let ip = common::wait_for("an address", Duration::from_secs(60), || async {
        vms.get(&name).await.unwrap().status.and_then(|s| s.ip)
    })
    .await;
    let addr: SocketAddr = format!("{ip}:9000").parse().unwrap();
    while connect_from(netns, addr, Duration::from_secs(1)).is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "{name} never answered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cold_boot = t0.elapsed();
    wait_phase(vms, &name, VmPhase::Suspended, 120).await;
    let asleep = state.load(&uid).unwrap();
    let wake = connect_from(netns, addr, Duration::from_secs(30)).expect("the wake answered");
    wait_phase(vms, &name, VmPhase::Running, 60).await;
    let awake = state.load(&uid).unwrap();
    vms.delete(&name, &DeleteParams::default()).await.unwrap();
    Round {
        cold_boot,
        suspend_ms: asleep.timings.suspend_ms,
        snapshot_bytes: asleep.suspend.map_or(0, |s| s.bytes),
        wake,
        resume_ms: awake.timings.resume_ms,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo test --benches` passes libtest flags; the benchmark ignores them.
    if ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rounds: usize = std::env::var("IMP_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let topo = Topology::create();
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
    // `cargo bench` passes `--bench`; `cargo test --benches` (CI) does not.
    let benching = std::env::args().any(|a| a == "--bench");
    let sizes: Vec<u32> = std::env::var("IMP_BENCH_MEMORY")
        .ok()
        .map(|v| v.split(',').filter_map(|m| m.trim().parse().ok()).collect())
        .unwrap_or_else(|| {
            if benching {
                vec![256, 1024, 2048]
            } else {
                vec![256, 2048]
            }
        });
    for mib in &sizes {
        common::create_imp(
            &c,
            "ImpVMClass",
            "impvmclasses",
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                   "metadata": {"name": format!("bench-{mib}")},
                   "spec": {"vcpu": 1, "memoryMiB": mib, "diskGiB": 1}}),
        )
        .await;
    }
    common::create_imp(
        &c,
        "ImpNetwork",
        "impnetworks",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
               "metadata": {"name": "net1", "namespace": NS},
               "spec": {"subnet": topo.subnet(217)}}),
    )
    .await;
    let layout = scratch_dir("imp-s2z-bench-layout").unwrap();
    common::busybox_image(&["sh", "echo", "nc"], "eval \"$SCRIPT\"")
        .write_layout(&layout, "1")
        .unwrap();
    let image = format!("oci:{}:1", layout.display());
    let cache = scratch_dir("imp-s2z-bench-cache").unwrap();
    let _operator = common::start_operator(&kube);
    let mut agent = Agent::new(&topo, "a", topo.underlay(1));
    agent.start(&kube.agent_kubeconfig_for(&agent.node).await, &cache);
    let state = StateDir::new(&agent.state);
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let netns = topo.ns("a");
    // A first VM fills the image cache, so every measured cold boot starts from the cache.
    let warm = round(&vms, &image, &state, &netns, (sizes[0], 0)).await;
    println!(
        "warm-up (image unpacked): cold boot {:.2} s",
        warm.cold_boot.as_secs_f64()
    );
    let mut wakes = Vec::new();
    for &mib in &sizes {
        println!("scale-to-zero, {mib} MiB guest under the node's VMM ({rounds} rounds):");
        let (mut ratios, mut wake_ms) = (Vec::new(), Vec::new());
        for i in 1..=rounds {
            let r = round(&vms, &image, &state, &netns, (mib, i)).await;
            let ratio = r.wake.as_secs_f64() / r.cold_boot.as_secs_f64();
            ratios.push(ratio);
            wake_ms.push(r.wake.as_secs_f64() * 1e3);
            println!(
                "  round {i}: cold boot → first answer {:.2} s | suspend {} ms, snapshot {} MiB \
                 of {mib} MiB ({:.0}%) | wake: first SYN → SYN-ACK {:.0} ms (resume to guest \
                 agent {} ms) | wake / cold boot {ratio:.3}",
                r.cold_boot.as_secs_f64(),
                r.suspend_ms,
                r.snapshot_bytes >> 20,
                r.snapshot_bytes as f64 / f64::from(mib << 20) * 100.0,
                r.wake.as_secs_f64() * 1e3,
                r.resume_ms,
            );
        }
        let ratio = median(&mut ratios);
        println!("  median wake / cold boot: {ratio:.3} (aim: at most 0.1)");
        let wake = median(&mut wake_ms);
        figure(
            &format!("scale-to-zero, {mib} MiB: first SYN -> SYN-ACK of a sleeping VM"),
            wake,
            "ms",
            "",
        );
        figure(
            &format!("scale-to-zero, {mib} MiB: wake / cold boot"),
            ratio,
            "x",
            "aim <= 0.1",
        );
        wakes.push((mib, wake));
    }
    if let Some(&(base, first)) = wakes.first() {
        for &(mib, ms) in &wakes[1..] {
            println!(
                "median wake of {mib} MiB / {base} MiB: {ms:.0} ms / {first:.0} ms = {:.2} \
                 (aim: at most 1.5)",
                ms / first
            );
        }
    }
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&cache);
}
