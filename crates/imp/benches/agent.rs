//! Node agent benchmark: an ImpVM from create to Running through the real `imp operator` and
//! `imp agent` (against a real kube-apiserver, with their own ServiceAccounts), split into scheduling, image, disk, boot
//! and guest-ready, for a cached image; the same VM through `imp run -d` in the same run,
//! interleaved, and the ratio of the two; the agent's RSS with no VM and with three running.
//!
//! `cargo bench -p imp --bench agent`, or `cargo test -p imp --bench agent` for a debug build.
//! `IMP_BENCH_ROUNDS` changes the number of interleaved rounds (default 3);
//! `IMP_BENCH_AGENT_BIN` runs another `imp` binary as the operator, the agent and `imp run` (the images'
//! static release build, say), so both paths and the agent's RSS are that build's. Needs what the
//! agent's end-to-end test needs (root, QEMU, docker-registry, skopeo, the
//! guest kernel and init); without it, it skips on a developer machine and fails under CI=true.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use imp_agent::runtime::state::{StateDir, VmRecord};
use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::figures::figure;
use imp_testenv::registry::{TestImage, TestLayer, TestRegistry, push, scratch_dir};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

fn image() -> TestImage {
    let layer = TestLayer::new()
        .dir("bin", 0o755)
        .file("bin/busybox", std::fs::read("/bin/busybox").unwrap(), 0o755)
        .symlink("bin/sh", "busybox")
        .symlink("bin/sleep", "busybox")
        .dir("tmp", 0o1777);
    TestImage::new()
        .layer(layer)
        .entrypoint(&["/bin/sh", "-c"])
        .cmd(&["sleep 3600"])
        .env("PATH=/bin")
}

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `RssAnon`, `RssFile`), 0 if unreadable.
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// The agent's resident memory: all of it, and the part that is its own (anonymous: heap,
/// stacks) rather than its binary's pages, which a debug build has many more of.
fn rss_kib(pid: u32) -> (u64, u64) {
    (status_kib(pid, "VmRSS"), status_kib(pid, "RssAnon"))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

async fn setup(c: &Client) {
    let nodes: Api<Node> = Api::all(c.clone());
    let n: Node = serde_json::from_value(
        json!({"metadata": {"name": "bench-node", "labels": {"imp/enabled": "true"}}}),
    )
    .unwrap();
    nodes.create(&PostParams::default(), &n).await.unwrap();
    imp_testenv::nodes::set_ready(c, "bench-node", "8", "16Gi", true)
        .await
        .unwrap();
    let classes: Api<imp_api::class::ImpVMClass> = Api::all(c.clone());
    let class = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
        "metadata": {"name": "bench"}, "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1}
    }))
    .unwrap();
    classes
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
}

/// One ImpVM from create to Running: (total, scheduling, the shim's step timings).
/// The `imp` both paths run (operator, agent, shims, `imp run`): this build, or IMP_BENCH_AGENT_BIN (the
/// release binary the images ship, whose RSS is the one that counts).
fn imp_bin() -> std::path::PathBuf {
    std::env::var_os("IMP_BENCH_AGENT_BIN").map_or_else(
        || env!("CARGO_BIN_EXE_imp").into(),
        std::path::PathBuf::from,
    )
}

async fn cluster_round(
    vms: &Api<ImpVM>,
    image: &str,
    state: &StateDir,
    name: &str,
) -> (Duration, Duration, VmRecord) {
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"classRef": {"name": "bench"}, "image": image, "lifecycle": "persistent"}
    }))
    .unwrap();
    // Seen through a watch, as a client of the API server sees it (no poll's granularity).
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut changes = std::pin::pin!(watcher(vms.clone(), config).applied_objects());
    let t0 = Instant::now();
    let created = vms.create(&PostParams::default(), &obj).await.unwrap();
    let mut scheduled = None;
    loop {
        let next = tokio::time::timeout_at((t0 + Duration::from_secs(300)).into(), changes.next());
        let vm = match next.await {
            Ok(Some(Ok(vm))) => vm,
            Ok(Some(Err(e))) => panic!("watching {name}: {e}"),
            Ok(None) | Err(_) => panic!("{name} never ran"),
        };
        let phase = vm.status.as_ref().and_then(|s| s.phase);
        if scheduled.is_none() && phase.is_some_and(|p| p != VmPhase::Pending) {
            scheduled = Some(t0.elapsed());
        }
        if phase == Some(VmPhase::Running) {
            break;
        }
    }
    let total = t0.elapsed();
    let record = state.load(&created.uid().unwrap()).unwrap();
    (total, scheduled.unwrap_or_default(), record)
}

async fn delete_and_wait(vms: &Api<ImpVM>, name: &str) {
    vms.delete(name, &DeleteParams::default()).await.unwrap();
    while vms.get_opt(name).await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The same VM through `imp run -d`: until it prints the name (the guest agent answered).
/// `imp run -d` of the VM: how long it took, and the shim's steps (its record's timings).
fn local_round(image: &str, local_state: &Path, name: &str) -> (Duration, Duration) {
    let imp = |args: &[&str]| {
        std::process::Command::new(imp_bin())
            .args(args)
            .env("IMP_STATE_DIR", local_state)
            .env("IMP_KERNEL", common::kernel())
            .env("IMP_GUEST", common::guest())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .unwrap()
    };
    let t0 = Instant::now();
    assert!(imp(&["run", "-d", "--name", name, "--memory", "256", image]).success());
    let took = t0.elapsed();
    let record = StateDir::new(local_state).load(name).unwrap();
    assert!(imp(&["rm", "-f", name]).success());
    (took, shim_steps(&record))
}

/// The sum of the shim's own steps: image, disk, boot, guest ready.
fn shim_steps(r: &VmRecord) -> Duration {
    let t = &r.timings;
    Duration::from_millis(t.image_ms + t.disk_ms + t.boot_ms + t.ready_ms)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo test --benches` passes libtest flags; the benchmark ignores them.
    if common::guest_boot_ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rounds: usize = std::env::var("IMP_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    if common::control_plane_ready().is_none() {
        return;
    }
    let kube = common::cluster(&["imp-system"]).await;
    let c = kube.client.clone();
    setup(&c).await;
    let registry = TestRegistry::start().await.unwrap();
    let image_ref = format!("{}/bench:1", registry.host());
    let layout = scratch_dir("imp-bench-layout").unwrap();
    image().write_layout(&layout, "1").unwrap();
    push(&layout, "1", &image_ref, None).await.unwrap();
    std::fs::remove_dir_all(&layout).unwrap();

    let agent_state = scratch_dir("imp-bench-agent").unwrap();
    let local_state = scratch_dir("imp-bench-local").unwrap();
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    // IMP_BENCH_LOG: the operator's and agent's log filter (default warn).
    let log = std::env::var("IMP_BENCH_LOG").unwrap_or_else(|_| "warn".into());
    let _operator = tokio::process::Command::new(imp_bin())
        .arg("operator")
        .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--requeue-pending", "1", "--requeue-active", "1"])
        .env("KUBECONFIG", kube.operator_kubeconfig())
        .env("RUST_LOG", &log)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let agent = tokio::process::Command::new(imp_bin())
        .arg("agent")
        .env("NODE_NAME", "bench-node")
        .env("KUBECONFIG", kube.agent_kubeconfig_for("bench-node").await)
        .env("FC_KERNEL", common::kernel())
        .env("IMP_GUEST", common::guest())
        .env("RUST_LOG", &log)
        .args(["--state-dir", agent_state.to_str().unwrap()])
        .args(["--runtime", "qemu", "--stop-grace", "2s"])
        .args([
            "--cgroup-parent",
            &format!("imp-bench-{}", std::process::id()),
        ])
        .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let agent_pid = agent.id().unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_idle = rss_kib(agent_pid);
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), "default");
    let state = StateDir::new(&agent_state);

    // Warm the image, base and initramfs caches of both paths first.
    cluster_round(&vms, &image_ref, &state, "warm").await;
    delete_and_wait(&vms, "warm").await;
    let _ = local_round(&image_ref, &local_state, "warm");

    let (mut cluster, mut local, mut sched) = (Vec::new(), Vec::new(), Vec::new());
    // Per round, each path's time outside the shim's own steps (what the guest's boot, which
    // varies by hundreds of ms under TCG, does not blur); their difference is the agent's part.
    let mut own = Vec::new();
    let mut steps = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for i in 0..rounds {
        let name = format!("bench-{i}");
        let (total, scheduling, record) = cluster_round(&vms, &image_ref, &state, &name).await;
        delete_and_wait(&vms, &name).await;
        let t = record.timings;
        for (v, ms) in steps
            .iter_mut()
            .zip([t.image_ms, t.disk_ms, t.boot_ms, t.ready_ms])
        {
            v.push(Duration::from_millis(ms));
        }
        let (local_total, local_steps) = local_round(&image_ref, &local_state, &name);
        let ms_of = |d: Duration| d.as_secs_f64() * 1e3;
        let outside = ms_of(total) - ms_of(scheduling) - ms_of(shim_steps(&record));
        own.push(outside - (ms_of(local_total) - ms_of(local_steps)));
        cluster.push(total);
        sched.push(scheduling);
        local.push(local_total);
    }
    own.sort_by(f64::total_cmp);
    let own = own[own.len() / 2];
    let (cm, lm, placed) = (median(cluster), median(local), median(sched));
    let [image_s, disk_s, boot_s, ready_s] = steps.map(median);
    println!("agent bench ({rounds} interleaved rounds, medians, cached image, QEMU/TCG here):");
    println!(
        "  ImpVM create -> Running: {} ms = scheduling {} ms + image {} ms + disk {} ms + boot {} ms + guest ready {} ms (+ agent and API overhead)",
        ms(cm),
        ms(placed),
        ms(image_s),
        ms(disk_s),
        ms(boot_s),
        ms(ready_s)
    );
    println!("  imp run -d -> running:   {} ms", ms(lm));
    let secs = |d: Duration| d.as_secs_f64() * 1e3;
    figure(
        "agent: ImpVM create -> Running",
        secs(cm),
        "ms",
        "imp run -d of the same VM",
    );
    figure("agent: imp run -d -> running", secs(lm), "ms", "");
    figure(
        "agent: scheduling (create -> not Pending)",
        secs(placed),
        "ms",
        "",
    );
    figure(
        "agent: its own part (per round: create -> Running - scheduling - the shim's steps, minus imp run -d - its shim's steps)",
        own,
        "ms",
        "aim <= 30",
    );
    let steps_ms = secs(image_s) + secs(disk_s) + secs(boot_s) + secs(ready_s);
    figure(
        "agent: outside the shim's steps (create -> Running - scheduling - image, disk, boot, ready)",
        secs(cm) - secs(placed) - steps_ms,
        "ms",
        "the agent's watch, start, events and status write, and the API server",
    );
    figure(
        "agent: ratio cluster / local",
        cm.as_secs_f64() / lm.as_secs_f64().max(1e-9),
        "x",
        "",
    );

    for i in 0..3 {
        let obj: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": format!("rss-{i}"), "namespace": "default"},
            "spec": {"classRef": {"name": "bench"}, "image": image_ref, "lifecycle": "persistent"}
        }))
        .unwrap();
        vms.create(&PostParams::default(), &obj).await.unwrap();
    }
    let t0 = Instant::now();
    loop {
        let running = vms
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .filter(|v| v.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running))
            .count();
        if running == 3 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "3 VMs never ran");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rss_busy = rss_kib(agent_pid);
    // What each VM costs the host besides its guest's RAM (QEMU maps that from the VM's file,
    // so it is not anonymous memory): its shim's and its VMM's own memory.
    let (records, _) = state.list().unwrap();
    let per_vm: Vec<(u64, u64)> = records
        .iter()
        .filter(|r| r.status == imp_agent::runtime::state::VmStatus::Running)
        .filter_map(|r| {
            Some((
                status_kib(r.supervisor_pid, "RssAnon"),
                status_kib(r.vmm_pid?, "RssAnon"),
            ))
        })
        .collect();
    assert_eq!(per_vm.len(), 3, "the 3 running VMs' shims and VMMs");
    let build = match std::env::var_os("IMP_BENCH_AGENT_BIN") {
        Some(bin) => std::path::Path::new(&bin).display().to_string(),
        None if cfg!(debug_assertions) => "debug".into(),
        None => "release".into(),
    };
    let mib = |kib: u64| kib as f64 / 1024.0;
    figure(
        &format!("agent RSS, no VM ({build})"),
        mib(rss_idle.0),
        "MiB",
        "",
    );
    figure(
        &format!("agent RSS, 3 running VMs ({build})"),
        mib(rss_busy.0),
        "MiB",
        "aim <= 30 in release",
    );
    figure(
        &format!("agent RSS, anonymous (heap, stacks), no VM ({build})"),
        mib(rss_idle.1),
        "MiB",
        "the rest is the binary's pages",
    );
    figure(
        &format!("agent RSS, anonymous (heap, stacks), 3 running VMs ({build})"),
        mib(rss_busy.1),
        "MiB",
        "",
    );
    let mean = |f: fn(&(u64, u64)) -> u64| per_vm.iter().map(f).sum::<u64>() as f64 / 3.0;
    figure(
        &format!("per VM: its shim's own memory, anonymous ({build})"),
        mean(|v| v.0) / 1024.0,
        "MiB",
        "mean of 3",
    );
    figure(
        "per VM: its VMM's own memory outside guest RAM, anonymous (QEMU/TCG, 256 MiB guest)",
        mean(|v| v.1) / 1024.0,
        "MiB",
        "mean of 3; TCG's translation cache included",
    );
    for i in 0..3 {
        delete_and_wait(&vms, &format!("rss-{i}")).await;
    }
    let _ = std::fs::remove_dir_all(&agent_state);
    let _ = std::fs::remove_dir_all(&local_state);
    let parent = format!("imp-bench-{}", std::process::id());
    let _ = imp_agent::runtime::cgroup::VmCgroup::at(&parent).and_then(|cg| cg.destroy());
}
