//! Scale-to-zero end to end: a ScaleToZero VM with a 10 s idle timeout suspends by itself, and
//! the first TCP connection sent to it wakes it, from a VM on the same node and from a VM on
//! another node over VXLAN, each time with an empty neighbour cache on the client and without
//! a single retransmitted SYN (the client kernel's `TCPSynRetrans`): the sleeping VM's ARP is
//! answered by the agent and the SYN is held and delivered once the VM runs again. Then its
//! agent's cgroup is killed while it sleeps: a SYN sent while the agent is down is answered
//! once it is back. An agent that keeps more memory free than the node has leaves a woken VM
//! Suspended with `InsufficientMemory`; with the next agent, two clients knocking at once wake
//! it: one resume, one QEMU, both answered. Last, an `imp exec` into the sleeping VM wakes it
//! and runs, and the VM stays up while the exec lasts, longer than its idle timeout. The
//! sleeper has readiness and liveness probes every second: probes are no activity.
//!
//! Two "nodes" (network namespaces) each run a real `imp agent`, with the real `imp operator`
//! and a real kube-apiserver; guests are real Linux under QEMU/TCG. Needs root, iproute2, nftables and
//! what a guest boot needs (`scripts/setup`): without them it skips on a developer machine and
//! fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::nodes::{Agent, Topology, ready, text};
use common::{phase, wait_vm};
use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::scratch_dir;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::process::Command;

const NS: &str = "default";
const SLEEPER: &str = "s";
/// Every exec here ends within a minute (the longest waits for a wake and sleeps 20 s): two
/// minutes means a hang.
const EXEC_LIMIT: Duration = Duration::from_secs(120);

/// Serves TCP on 9000, a process per connection (two clients may wake it at once): answers
/// with its name and keeps the line it was sent.
const SERVER: &str = r#"printf '#!/bin/sh\necho "pong from $(hostname)"\nread -r line\necho "$line" >> /tmp/received\n' > /tmp/h; chmod +x /tmp/h; exec nc -ll -p 9000 -e /tmp/h"#;

/// The client's count of retransmitted SYNs (`TcpExt: TCPSynRetrans`).
const SYN_RETRANS: &str = "awk '/^TcpExt:/ { if (!h) { for (i = 1; i <= NF; i++) \
     if ($i == \"TCPSynRetrans\") c = i; h = 1 } else print $c }' /proc/net/netstat";

/// `imp exec` into a VM through its agent's API.
fn exec(kubeconfig: &Path, vm: &str, script: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_imp"));
    c.args(["exec", "-n", NS, vm, "--", "sh", "-c", script])
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    c
}

/// The script a client runs: forget every neighbour (unless `neighbour` pins the sleeper's
/// MAC), connect to the sleeper, and print the reply and how many SYNs were retransmitted.
fn connect_script(to_ip: &str, msg: &str, neighbour: Option<&str>) -> String {
    let neigh = match neighbour {
        Some(mac) => format!("arp -i eth0 -s {to_ip} {mac}"),
        None => "ip neigh flush dev eth0 >/dev/null".to_owned(),
    };
    format!(
        "{neigh}; before=$({SYN_RETRANS}); reply=$(echo '{msg}' | nc -w 30 {to_ip} 9000); \
         after=$({SYN_RETRANS}); echo \"reply=$reply\"; echo \"syn_retrans=$((after - before))\""
    )
}

/// How many SYNs `client` has retransmitted so far (`TCPSynRetrans`).
async fn syn_retrans(kubeconfig: &Path, client: &str) -> u64 {
    let out = common::output_within(
        exec(kubeconfig, client, SYN_RETRANS),
        EXEC_LIMIT,
        &format!("{client}'s TCPSynRetrans"),
    )
    .await;
    let got = String::from_utf8_lossy(&out.stdout);
    got.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{client}'s TCPSynRetrans {got:?}: {e}"))
}

/// Runs the client script and returns its output, with how long the connection took.
async fn wake_from(kubeconfig: &Path, client: &str, to_ip: &str, msg: &str) -> (String, Duration) {
    let t = Instant::now();
    let out = common::output_within(
        exec(kubeconfig, client, &connect_script(to_ip, msg, None)),
        EXEC_LIMIT,
        &format!("the connect from {client}"),
    )
    .await;
    (text(&out), t.elapsed())
}

async fn events(c: &Client, name: &str, reason: &str) -> Vec<Event> {
    let mut all = common::events_of(c, NS, name).await;
    all.retain(|e| e.reason.as_deref() == Some(reason));
    all
}

/// How often `name` had an Event with `reason` (repeats of one Event count in its series).
async fn occurrences(c: &Client, name: &str, reason: &str) -> i32 {
    events(c, name, reason)
        .await
        .iter()
        .map(|e| {
            let series = e.series.as_ref().and_then(|s| s.count).unwrap_or(0);
            series.max(e.count.unwrap_or(0)).max(1)
        })
        .sum()
}

/// Waits until the sleeper has suspended itself for being idle, its QEMU gone.
async fn wait_idle_suspend(vms: &Api<ImpVM>, agent: &Agent, uid: &str) -> ImpVM {
    let v = wait_vm(vms, SLEEPER, "idle, Suspended", 90, |v| {
        phase(v) == Some(VmPhase::Suspended)
    })
    .await;
    let status = v.status.clone().unwrap();
    assert!(
        status.last_activity_time.is_some(),
        "an idle suspend writes lastActivityTime: {status:?}"
    );
    assert!(status.suspended_at.is_some() && status.suspend_snapshot_path.is_some());
    assert!(
        common::qemu_of(&agent.state, uid).is_empty(),
        "a suspended VM has no QEMU"
    );
    v
}

/// Waits until the sleeping VM's TAP is held (`true`: carrier and up, so the next frame for
/// the VM wakes it) or let go (`false`: no carrier, its holder is gone).
async fn wait_tap(topo: &Topology, agent: &Agent, uid: &str, held: bool) {
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(agent.state.join("vms").join(uid).join("spec.json")).unwrap(),
    )
    .unwrap();
    let tap = spec["network"]["tap"].as_str().unwrap().to_owned();
    let what = if held { "held" } else { "let go" };
    common::wait_for(
        &format!("the sleeping VM's TAP {what}"),
        Duration::from_secs(30),
        || {
            let link = text(&topo.exec("a", &["ip", "-o", "link", "show", &tap]));
            let up = link.contains("state UP") && !link.contains("NO-CARRIER");
            async move { (up == held).then_some(()) }
        },
    )
    .await;
}

/// Asserts a wake worked: the reply came, no SYN was retransmitted, the VM runs again in a new
/// QEMU and one more `Resumed` Event says so.
async fn assert_woken(
    c: &Client,
    vms: &Api<ImpVM>,
    (out, took): (String, Duration),
    resumed_before: i32,
    from: &str,
) {
    println!("wake from {from}: {took:?}: {}", out.replace('\n', " | "));
    assert!(
        out.contains(&format!("reply=pong from {SLEEPER}")),
        "{from}: no reply from the sleeping VM: {out}"
    );
    assert!(
        out.contains("syn_retrans=0"),
        "{from}: the client retransmitted its SYN (the first one was not answered): {out}"
    );
    wait_vm(vms, SLEEPER, "Running after the wake", 30, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    common::wait_for("a Resumed Event", Duration::from_secs(20), || async {
        (occurrences(c, SLEEPER, "Resumed").await > resumed_before).then_some(())
    })
    .await;
    assert!(!events(c, SLEEPER, "Resuming").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_vm_sleeps_and_its_first_syn_wakes_it_from_anywhere_without_a_retransmission() {
    let _run = common::test_run("scale_to_zero_e2e", Duration::from_secs(900));
    if ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let topo = Topology::create();
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
    // `imp exec -n` as a person would run it: a token user allowed to exec in the namespace.
    let (kubeconfig, _) = common::exec_users(&kube, NS).await;
    common::create_imp(
        &c,
        "ImpVMClass",
        "impvmclasses",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
               "metadata": {"name": "small"}, "spec": {"vcpu": 1, "memoryMiB": 128, "diskGiB": 1}}),
    )
    .await;
    common::create_imp(
        &c,
        "ImpNetwork",
        "impnetworks",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
               "metadata": {"name": "net1", "namespace": NS}, "spec": {"subnet": topo.subnet(216)}}),
    )
    .await;
    let layout = scratch_dir("imp-s2z-e2e-layout").unwrap();
    common::busybox_image(
        &[
            "sh", "echo", "cat", "sleep", "hostname", "nc", "ip", "arp", "awk", "printf", "chmod",
            "true",
        ],
        "eval \"$SCRIPT\"",
    )
    .write_layout(&layout, "1")
    .unwrap();
    let image = format!("oci:{}:1", layout.display());
    let cache = scratch_dir("imp-s2z-e2e-cache").unwrap();

    let _operator = common::start_operator(&kube);
    let mut a = Agent::new(&topo, "a", topo.underlay(1));
    let mut b = Agent::new(&topo, "b", topo.underlay(2));
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    b.start(&kube.agent_kubeconfig_for(&b.node).await, &cache);

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    for (name, node, script, desired) in [
        (SLEEPER, "node-a", SERVER, "ScaleToZero"),
        ("c1", "node-a", "sleep 3600", "Running"),
        ("c2", "node-b", "sleep 3600", "Running"),
    ] {
        let mut spec = json!({"classRef": {"name": "small"}, "image": image, "nodeName": node,
            "lifecycle": "persistent", "networkRef": {"name": "net1"}, "desiredState": desired,
            "env": [{"name": "SCRIPT", "value": script}]});
        if desired == "ScaleToZero" {
            spec["idleTimeout"] = json!("10s");
            // Probes every second while it runs: they must not count as activity (it still
            // falls asleep), and pause while it sleeps.
            spec["probes"] = json!({
                "readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 1},
                "livenessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 1}
            });
        }
        let obj: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": NS}, "spec": spec
        }))
        .unwrap();
        vms.create(&PostParams::default(), &obj).await.unwrap();
    }
    let mut first_pid = None;
    for name in [SLEEPER, "c1", "c2"] {
        let v = wait_vm(&vms, name, "Running", 240, |v| {
            phase(v) == Some(VmPhase::Running)
        })
        .await;
        if name == SLEEPER {
            first_pid = v.status.and_then(|s| s.runtime_pid);
        }
    }
    let s = vms.get(SLEEPER).await.unwrap();
    let uid = s.uid().unwrap();
    let ip = s.status.as_ref().and_then(|s| s.ip.clone()).unwrap();

    // 1. Idle for 10 s: it suspends by itself; its QEMU and memory are gone.
    wait_idle_suspend(&vms, &a, &uid).await;
    let first_pid = u32::try_from(first_pid.unwrap()).unwrap();
    assert!(
        !Path::new(&format!("/proc/{first_pid}")).exists(),
        "the first QEMU (pid {first_pid}) still runs"
    );

    // 2. A VM on the same node, with an empty neighbour cache, connects: it wakes it.
    let woke = wake_from(&kubeconfig, "c1", &ip, "hello from c1").await;
    assert_woken(&c, &vms, woke, 0, "c1 (same node)").await;
    let got = text(
        &common::output_within(
            exec(&kubeconfig, SLEEPER, "cat /tmp/received"),
            EXEC_LIMIT,
            "exec cat",
        )
        .await,
    );
    assert!(got.contains("hello from c1"), "the VM kept: {got}");

    // 3. Idle again; a VM on the other node wakes it over VXLAN.
    wait_idle_suspend(&vms, &a, &uid).await;
    let resumed = occurrences(&c, SLEEPER, "Resumed").await;
    let woke = wake_from(&kubeconfig, "c2", &ip, "hello from c2").await;
    assert_woken(&c, &vms, woke, resumed, "c2 (over VXLAN)").await;

    // 4. Idle again; the agent's container dies. A SYN sent meanwhile (the client knows the
    //    VM's MAC, so it sends at once and retransmits) is answered once the agent is back.
    wait_idle_suspend(&vms, &a, &uid).await;
    a.kill_container().await;
    let mac = imp_api::network::vm_mac(NS, SLEEPER);
    let retrans_before = syn_retrans(&kubeconfig, "c2").await;
    let pending = exec(
        &kubeconfig,
        "c2",
        &connect_script(&ip, "while the agent was down", Some(&mac)),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Not a fixed wait: the client's SYN went out and went unanswered (c2 retransmitted it),
    // and the VM is still Suspended with its agent down.
    common::wait_for(
        "c2 to retransmit its SYN to the sleeper",
        Duration::from_secs(20),
        || {
            let k = kubeconfig.clone();
            async move { (syn_retrans(&k, "c2").await > retrans_before).then_some(()) }
        },
    )
    .await;
    assert_eq!(
        phase(&vms.get(SLEEPER).await.unwrap()),
        Some(VmPhase::Suspended)
    );
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    let out = text(
        &tokio::time::timeout(EXEC_LIMIT, pending.wait_with_output())
            .await
            .expect("the connect sent while the agent was down did not end")
            .unwrap(),
    );
    println!(
        "wake while the agent was down: {}",
        out.replace('\n', " | ")
    );
    assert!(
        out.contains(&format!("reply=pong from {SLEEPER}")),
        "a SYN sent while the agent was down went unanswered: {out}"
    );
    wait_vm(&vms, SLEEPER, "Running after the restart", 30, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;

    // 5. An agent that must keep more memory free than the node has cannot resume a woken VM:
    //    it stays Suspended and says why. The next agent resumes it on the next connection.
    wait_idle_suspend(&vms, &a, &uid).await;
    a.kill_container().await;
    wait_tap(&topo, &a, &uid, false).await;
    a.extra_args = vec!["--resume-reserve-mib".into(), "100000000".into()];
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    wait_tap(&topo, &a, &uid, true).await;
    let refused = assert_stays_asleep(&kubeconfig, &vms, &ip).await;
    assert!(
        refused.contains("not enough free memory to resume") && refused.contains("node-a"),
        "{refused}"
    );
    common::events_with(&c, NS, SLEEPER, &["InsufficientMemory"]).await;
    a.kill_container().await;
    wait_tap(&topo, &a, &uid, false).await;
    a.extra_args.clear();
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    let resumed = occurrences(&c, SLEEPER, "Resumed").await;
    wait_tap(&topo, &a, &uid, true).await;
    // The restarted agent's API knows the VMs on its node at once.
    let ready =
        common::output_within(exec(&kubeconfig, "c1", "true"), EXEC_LIMIT, "exec true").await;
    assert!(
        ready.status.success(),
        "exec into c1 after the agent's restart: {}",
        text(&ready)
    );
    // Both clients knock at the same moment: two wakes, one resume, both answered. (Only the
    // first is held by the sleeper; a client whose ARP arrives after the hand-over is answered
    // by the guest itself once it runs, so under load its SYN may be retransmitted.)
    let (woke, also) = tokio::join!(
        wake_from(&kubeconfig, "c2", &ip, "hello again from c2"),
        wake_from(&kubeconfig, "c1", &ip, "hello again from c1"),
    );
    println!(
        "second knock at the same time: {}",
        also.0.replace('\n', " | ")
    );
    assert!(
        woke.0.contains("reply=pong from") && also.0.contains("reply=pong from"),
        "two clients at once: {} / {}",
        woke.0,
        also.0
    );
    wait_vm(&vms, SLEEPER, "Running after two wakes", 30, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    assert_eq!(
        common::qemu_of(&a.state, &uid).len(),
        1,
        "two wakes, one VM"
    );
    common::wait_for("a Resumed Event", Duration::from_secs(20), || async {
        (occurrences(&c, SLEEPER, "Resumed").await > resumed).then_some(())
    })
    .await;

    // 6. Idle again; an exec into it wakes it as its first packet would and runs in it, and
    //    while the exec lasts (longer than the idle timeout, with no traffic) the VM stays up.
    wait_idle_suspend(&vms, &a, &uid).await;
    let resumed = occurrences(&c, SLEEPER, "Resumed").await;
    let t = Instant::now();
    let session = exec(
        &kubeconfig,
        SLEEPER,
        "cat /tmp/received; sleep 20; echo still here",
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_vm(&vms, SLEEPER, "Running after the exec's wake", 60, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    println!("exec into the sleeping VM: Running after {:?}", t.elapsed());
    let mut phases = Vec::new();
    while t.elapsed() < Duration::from_secs(19) {
        phases.push(phase(&vms.get(SLEEPER).await.unwrap()));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let out = tokio::time::timeout(EXEC_LIMIT, session.wait_with_output())
        .await
        .expect("the exec into the sleeping VM did not end")
        .unwrap();
    let got = text(&out);
    assert!(out.status.success(), "exec into a sleeping VM: {got}");
    assert!(
        got.contains("hello from c1") && got.contains("hello again from c2"),
        "the woken VM kept: {got}"
    );
    assert!(got.contains("still here"), "the exec was cut: {got}");
    assert!(
        phases.iter().all(|p| *p == Some(VmPhase::Running)),
        "the VM went to sleep under an open exec: {phases:?}"
    );
    // Once the exec is over, nothing keeps it up.
    wait_idle_suspend(&vms, &a, &uid).await;
    common::wait_for("a Resumed Event", Duration::from_secs(20), || async {
        (occurrences(&c, SLEEPER, "Resumed").await > resumed).then_some(())
    })
    .await;
    let metrics = text(&topo.exec(
        "a",
        &["busybox", "wget", "-qO-", "http://127.0.0.1:9090/metrics"],
    ));
    assert!(
        metrics.contains("imp_agent_resumes_total{trigger=\"exec\"} 1"),
        "{metrics}"
    );
    // This agent's idle suspends kept the VMM's TAP for the sleeper (its first hold, of a VM
    // that slept through its start, was by name).
    let kept = metrics
        .lines()
        .find_map(|l| l.strip_prefix("imp_agent_sleeper_holds_total{descriptor=\"kept\"} "))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(kept >= Some(2), "{metrics}");
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&cache);
}

/// Connects to the sleeper from c2 (briefly: nothing will answer) and waits for the
/// `InsufficientMemory` condition; returns its message.
async fn assert_stays_asleep(kubeconfig: &Path, vms: &Api<ImpVM>, ip: &str) -> String {
    let knock: Output = common::output_within(
        exec(
            kubeconfig,
            "c2",
            &format!("echo knock | nc -w 3 {ip} 9000; echo done"),
        ),
        EXEC_LIMIT,
        "the knock",
    )
    .await;
    assert!(
        !text(&knock).contains("pong"),
        "the VM answered: {}",
        text(&knock)
    );
    let v = wait_vm(vms, SLEEPER, "InsufficientMemory", 30, |v| {
        v.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.reason == "InsufficientMemory")
        })
    })
    .await;
    assert_eq!(phase(&v), Some(VmPhase::Suspended));
    v.status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.reason == "InsufficientMemory")
        .unwrap()
        .message
}
