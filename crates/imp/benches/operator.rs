//! Scheduling benchmark: 1,000 ImpVMs across 50 nodes, the real `imp operator` binary (with its
//! own ServiceAccount and the shipped RBAC) against a real kube-apiserver. Prints the time until
//! all are Scheduled, create→Scheduled p50/p99 (seen through a watch), API requests per VM
//! (counted at the server from its audit log, by User-Agent) and the operator's peak RSS (VmHWM).
//!
//! `cargo bench -p imp --bench operator` (release), or `cargo test -p imp --bench operator`
//! for a debug-build run. `IMP_BENCH_VMS` / `IMP_BENCH_NODES` change the sizes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_testenv::figures::figure;
use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn setup(c: &Client, nodes: usize) {
    let api: Api<Node> = Api::all(c.clone());
    for i in 0..nodes {
        let name = format!("node-{i:02}");
        let n: Node = serde_json::from_value(
            json!({"metadata": {"name": name, "labels": {"imp/enabled": "true"}}}),
        )
        .unwrap();
        api.create(&PostParams::default(), &n).await.unwrap();
        imp_testenv::nodes::set_ready(c, &name, "32", "64Gi", true)
            .await
            .unwrap();
    }
    let classes: Api<imp_api::ImpVMClass> = Api::all(c.clone());
    let class = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
        "metadata": {"name": "small"}, "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1}
    }))
    .unwrap();
    classes
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo test --benches` passes libtest flags; the benchmark ignores them.
    let n_vms = env_usize("IMP_BENCH_VMS", 1000);
    let n_nodes = env_usize("IMP_BENCH_NODES", 50);
    if !imp_testenv::controlplane::available(imp_testenv::Release::Newest) {
        return;
    }
    let kube = imp_testenv::ControlPlane::start(imp_testenv::Options {
        audit: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let c = kube.admin().await.unwrap();
    kube.install_crds(&c, &imp_api::crd::all()).await.unwrap();
    let ids = imp_testenv::rbac::install(&kube, "imp-system")
        .await
        .unwrap();
    setup(&c, n_nodes).await;

    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut op = tokio::process::Command::new(env!("CARGO_BIN_EXE_imp"))
        .arg("operator")
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .args(["--identity", "bench"])
        .env("KUBECONFIG", &ids.operator)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = op.id().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), "default");
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let scheduled: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen = scheduled.clone();
    let watch = tokio::spawn(
        watcher(vms.clone(), watcher::Config::default()).try_for_each(move |ev| {
            let seen = seen.clone();
            async move {
                if let watcher::Event::Apply(vm) | watcher::Event::InitApply(vm) = ev
                    && vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Scheduled)
                {
                    seen.lock()
                        .unwrap()
                        .entry(vm.name_any())
                        .or_insert_with(Instant::now);
                }
                Ok(())
            }
        }),
    );
    let before = kube
        .requests_by_user_agent()
        .into_iter()
        .filter(|(k, _)| k.starts_with("imp-operator/"))
        .map(|(_, v)| v)
        .sum::<u64>();

    let start = Instant::now();
    futures::stream::iter(0..n_vms)
        .for_each_concurrent(32, |i| {
            let vms = vms.clone();
            let created = created.clone();
            async move {
                let name = format!("vm-{i:04}");
                let obj: ImpVM = serde_json::from_value(json!({
                    "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                    "metadata": {"name": name, "namespace": "default"},
                    "spec": {"classRef": {"name": "small"}, "image": "busybox"}
                }))
                .unwrap();
                let t = Instant::now();
                vms.create(&PostParams::default(), &obj).await.unwrap();
                created.lock().unwrap().insert(name, t);
            }
        })
        .await;
    let created_in = start.elapsed();
    let deadline = Instant::now() + Duration::from_secs(600);
    while scheduled.lock().unwrap().len() < n_vms {
        assert!(
            Instant::now() < deadline,
            "only {} of {n_vms} Scheduled after 600 s",
            scheduled.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all_in = start.elapsed();
    // Let the follow-up requeues of the burst land before counting requests.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = kube
        .requests_by_user_agent()
        .into_iter()
        .filter(|(k, _)| k.starts_with("imp-operator/"))
        .map(|(_, v)| v)
        .sum::<u64>()
        - before;
    let hwm = vm_hwm_kib(pid).unwrap_or(0);
    watch.abort();

    let mut lat: Vec<Duration> = {
        let created = created.lock().unwrap();
        let scheduled = scheduled.lock().unwrap();
        scheduled
            .iter()
            .filter_map(|(k, t)| created.get(k).map(|c| t.saturating_duration_since(*c)))
            .collect()
    };
    lat.sort();
    // No node may hold more than its capacity (32 × 0.9 = 28 one-vCPU VMs).
    let mut per_node: HashMap<String, usize> = HashMap::new();
    for vm in vms.list(&Default::default()).await.unwrap().items {
        *per_node
            .entry(vm.spec.node_name.unwrap_or_default())
            .or_default() += 1;
    }
    let max_per_node = per_node.values().copied().max().unwrap_or(0);
    assert!(max_per_node <= 28, "a node got {max_per_node} VMs");

    println!("operator scheduling benchmark: {n_vms} ImpVMs across {n_nodes} nodes");
    println!(
        "  created all in            {:>10.3} s",
        created_in.as_secs_f64()
    );
    println!(
        "  all Scheduled after       {:>10.3} s",
        all_in.as_secs_f64()
    );
    println!(
        "  create→Scheduled p50      {:>10.1} ms",
        pct(&lat, 0.50).as_secs_f64() * 1e3
    );
    println!(
        "  create→Scheduled p99      {:>10.1} ms",
        pct(&lat, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "  API requests per VM       {:>10.2} ({requests} total)",
        requests as f64 / n_vms as f64
    );
    println!(
        "  operator peak RSS (VmHWM) {:>10.1} MiB",
        hwm as f64 / 1024.0
    );
    println!("  most VMs on one node      {max_per_node:>10}");
    let label = format!("operator, {n_vms} VMs at once on {n_nodes} nodes");
    figure(
        &format!("{label}: all Scheduled after"),
        all_in.as_secs_f64(),
        "s",
        "aim <= 3 for 1,000",
    );
    figure(
        &format!("{label}: create -> Scheduled p50"),
        pct(&lat, 0.50).as_secs_f64() * 1e3,
        "ms",
        "",
    );
    figure(
        &format!("{label}: API requests per VM"),
        requests as f64 / n_vms as f64,
        "requests",
        "",
    );
    figure(
        &format!("{label}: peak RSS"),
        hwm as f64 / 1024.0,
        "MiB",
        "aim <= 100 at 1,000",
    );
    let _ = op.start_kill();
    let _ = op.wait().await;
}
