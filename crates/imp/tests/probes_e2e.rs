//! End-to-end: an ImpVM's probes, through the real `imp operator` and `imp agent`, a real
//! kube-apiserver with the chart's RBAC and a real Linux guest under QEMU/TCG.
//!
//! One VM: its workload serves HTTP on 8080 (busybox httpd) and marks itself started after a
//! few seconds. Its startup probe (exec) holds `Ready` back until then; its readiness probe
//! (exec: a file) flips `Ready` as the file comes and goes, with Events; its liveness probe
//! (an HTTP GET the guest makes to its own port) keeps `Healthy` True until the server is
//! killed, when the agent stops the VM as failed (`ProbeFailed`, an Event naming the probe and
//! what it saw) and its restart policy boots it again: a new QEMU, `restartCount` 1, healthy.
//! Then its own image is changed: the operator rolls the change into its booking and the agent
//! boots it again with the new image (a `SpecChanged` Event, a new QEMU, `restartCount` still 1).
//! Last, its classRef moves to a larger class and it gains a runnerLayer: it leaves its node and
//! is placed anew with the new size (a new QEMU with the class's memory) and the layer's file
//! over its image.
//!
//! Then a second VM whose startup probe never passes is stopped as failed (`ProbeFailed`),
//! booted again by its restart policy, and ends `RetryExhausted`.
//!
//! Needs what `agent_e2e.rs` needs (`scripts/setup`): without it, it skips on a developer
//! machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::phase;
use common::snapshots::exec_in;

use std::time::Duration;

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::scratch_dir;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

const NS: &str = "default";
const VM: &str = "probed";
const NODE: &str = "probe-node";
/// The memory of the class the VM moves to at the end.
const ROOMY_MIB: i32 = 160;

/// What the workload and the probes run.
const APPLETS: &[&str] = &[
    "sh", "sleep", "mkdir", "echo", "httpd", "touch", "rm", "test", "killall", "true",
];

/// Serves /www on 8080, marks itself started after 4 s, then idles.
const WORKLOAD: &str = "mkdir -p /www && echo ok > /www/index.html && httpd -p 8080 -h /www && \
     sleep 4 && touch /tmp/started; while true; do sleep 1; done";

fn condition(v: &ImpVM, type_: &str) -> Option<Condition> {
    v.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

/// Whether `v`'s condition `type_` has `status` and `reason`.
fn is(v: &ImpVM, type_: &str, status: &str, reason: &str) -> bool {
    condition(v, type_).is_some_and(|c| c.status == status && c.reason == reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_gate_readiness_flip_it_and_restart_a_vm_whose_liveness_fails() {
    let _run = common::test_run("probes_e2e", Duration::from_secs(600));
    let Some(env) = common::agent::single_node(NS, NODE, 128).await else {
        return;
    };
    let (kube, c, alice) = (env.kube, env.client, env.exec_kubeconfig);
    let layout = scratch_dir("imp-probes-e2e-layout").unwrap();
    common::busybox_image(APPLETS, "eval \"$SCRIPT\"")
        .write_layout(&layout, "1")
        .unwrap();
    let image = format!("oci:{}:1", layout.display());

    // Traces to a collector on loopback (issue 26, observability): set before anything runs.
    let collector = common::OtlpReceiver::start().await;
    common::create_imp(
        &c,
        "ClusterImpConfig",
        "clusterimpconfigs",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ClusterImpConfig",
               "metadata": {"name": "cluster"},
               "spec": {"observability": {"tracing": {"enabled": true,
                                                      "endpoint": collector.endpoint}}}}),
    )
    .await;
    let _operator = common::start_operator(&kube);
    let mut agent = common::agent::HostAgent::new(NODE, "probes-e2e");
    agent.start(&kube).await;
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let uid = common::create_vm(&vms, json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": VM, "namespace": NS},
        "spec": {
            "classRef": {"name": "small"}, "image": image, "lifecycle": "persistent",
            "env": [{"name": "SCRIPT", "value": WORKLOAD}],
            "restartPolicy": {"mode": "in-place",
                              "backoff": {"maxRetries": 2, "initialDelay": "1s", "maxDelay": "2s"}},
            "probes": {
                "startupProbe": {"exec": {"command": ["test", "-e", "/tmp/started"]},
                                 "periodSeconds": 1, "failureThreshold": 60},
                "readinessProbe": {"exec": {"command": ["test", "-e", "/tmp/ready"]},
                                   "periodSeconds": 1, "failureThreshold": 1},
                "livenessProbe": {"http": {"path": "/index.html", "port": 8080},
                                  "periodSeconds": 1, "failureThreshold": 2}
            }
        }
    })).await;

    // Running, but not Ready while the startup probe waits.
    let early = common::wait_vm(&vms, VM, "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    if condition(&early, "Started").is_some_and(|c| c.status == "False") {
        assert!(
            is(&early, "Ready", "False", "Waiting"),
            "{:?}",
            condition(&early, "Ready")
        );
    }
    traced_from_schedule_to_running(&collector, &uid).await;

    // Started, Healthy (the guest's own GET), not Ready (no /tmp/ready).
    let started = common::wait_vm(&vms, VM, "Started and Healthy", 120, |v| {
        is(v, "Started", "True", "ProbeSucceeded") && is(v, "Healthy", "True", "ProbeSucceeded")
    })
    .await;
    assert!(
        is(&started, "Ready", "False", "ProbeFailed"),
        "{:?}",
        condition(&started, "Ready")
    );
    let healthy = condition(&started, "Healthy").unwrap();
    assert!(
        healthy.message.contains("GET 127.0.0.1:8080/index.html")
            && healthy.message.contains("HTTP 200"),
        "{}",
        healthy.message
    );

    // Readiness follows the file, with Events.
    exec_in(&alice, NS, VM, "touch /tmp/ready").await;
    common::wait_vm(&vms, VM, "Ready by its probe", 60, |v| {
        is(v, "Ready", "True", "ProbeSucceeded")
    })
    .await;
    exec_in(&alice, NS, VM, "rm /tmp/ready").await;
    common::wait_vm(&vms, VM, "not Ready by its probe", 60, |v| {
        is(v, "Ready", "False", "ProbeFailed")
    })
    .await;
    common::events_with(&c, NS, VM, &["ProbeSucceeded", "ProbeFailed"]).await;

    // The liveness probe fails: the VM is stopped as failed and restarted in place.
    let qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(qemu.len(), 1, "{qemu:?}");
    exec_in(&alice, NS, VM, "killall httpd").await;
    let restarted = common::wait_vm(
        &vms,
        VM,
        "restarted after its liveness probe failed",
        300,
        |v| {
            v.status.as_ref().and_then(|s| s.restart_count) == Some(1)
                && phase(v) == Some(VmPhase::Running)
                && is(v, "Healthy", "True", "ProbeSucceeded")
        },
    )
    .await;
    let events = common::events_with(&c, NS, VM, &["ProbeFailed"]).await;
    let stopped = events
        .iter()
        .filter_map(|e| e.message.clone())
        .find(|m| m.contains("liveness probe failed 2 times"))
        .unwrap_or_else(|| panic!("no Event names the failed liveness probe: {events:?}"));
    assert!(
        stopped.contains("GET 127.0.0.1:8080/index.html") && stopped.contains("stopping the VM"),
        "{stopped}"
    );
    let new_qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(new_qemu.len(), 1, "{new_qemu:?}");
    assert_ne!(new_qemu, qemu, "the VM was not booted again");
    eprintln!(
        "probes: restarted VM {}: Ready {:?}",
        restarted.name_any(),
        condition(&restarted, "Ready").map(|c| (c.status, c.reason))
    );

    // A rolled image change: the VM's own image moves to one that has `id` (the first lacks
    // it); the operator books it and the agent boots the VM again with it, on its node. A
    // rollout is no failure: restartCount stays.
    let layout2 = scratch_dir("imp-probes-e2e-layout2").unwrap();
    common::busybox_image(&[APPLETS, &["id"]].concat(), "eval \"$SCRIPT\"")
        .write_layout(&layout2, "1")
        .unwrap();
    let image2 = format!("oci:{}:1", layout2.display());
    let patch = json!({"spec": {"image": image2}});
    vms.patch(VM, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let rolled = common::wait_vm(&vms, VM, "Running again with the new image", 300, |v| {
        let booking = v.status.as_ref().and_then(|s| s.booking.as_ref());
        booking
            .is_some_and(|b| b.revision == 1 && b.spec.inherited.image.as_deref() == Some(&image2))
            && phase(v) == Some(VmPhase::Running)
            && is(v, "Started", "True", "ProbeSucceeded")
    })
    .await;
    assert_eq!(
        rolled.status.as_ref().unwrap().restart_count,
        Some(1),
        "a rollout counted as a failure"
    );
    let events = common::events_with(&c, NS, VM, &["SpecChanged"]).await;
    assert!(
        events
            .iter()
            .filter_map(|e| e.message.as_deref())
            .any(|m| m.starts_with(
                "image changed: restarting the VM with the new spec (booking revision 1)"
            )),
        "{events:?}"
    );
    let rolled_qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(rolled_qemu.len(), 1, "{rolled_qemu:?}");
    assert_ne!(rolled_qemu, new_qemu, "the VM was not booted again");
    let id = exec_in(&alice, NS, VM, "id -u").await;
    assert_eq!(id.trim(), "0", "the guest runs the old image: {id}");

    // A new class (issue 26): the VM leaves its node (the agent stops, removes and releases
    // it) and is placed anew with the class's size: a new QEMU with the new memory.
    common::create_imp(
        &c,
        "ImpVMClass",
        "impvmclasses",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
               "metadata": {"name": "roomy"},
               "spec": {"vcpu": 1, "memoryMiB": ROOMY_MIB, "diskGiB": 1}}),
    )
    .await;
    // With a runner layer too (issue 26): an image of one layer whose file the guest then has.
    let runner = scratch_dir("imp-probes-e2e-runner").unwrap();
    imp_testenv::registry::TestImage::new()
        .layer(
            imp_testenv::registry::TestLayer::new()
                .dir("opt", 0o755)
                .file("opt/runner-tool", "from the runner layer\n", 0o755),
        )
        .write_layout(&runner, "1")
        .unwrap();
    let runner_layer = format!("oci:{}:1", runner.display());
    let patch = json!({"spec": {"classRef": {"name": "roomy"}, "runnerLayer": runner_layer}});
    vms.patch(VM, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let roomy = common::wait_vm(&vms, VM, "Running again with the new class", 300, |v| {
        let booking = v.status.as_ref().and_then(|s| s.booking.as_ref());
        booking.is_some_and(|b| b.class.memory_mib == ROOMY_MIB)
            && phase(v) == Some(VmPhase::Running)
            && is(v, "Started", "True", "ProbeSucceeded")
    })
    .await;
    assert!(
        condition(&roomy, "DisruptionTarget").is_none(),
        "the mark stayed"
    );
    // Its SpecChanged Event has an action of its own, so it is not folded into the image's
    // series (which keeps the series' first message).
    let events = common::events_with(&c, NS, VM, &["SpecChanged"]).await;
    assert!(
        events
            .iter()
            .filter_map(|e| e.message.as_deref())
            .any(|m| m.starts_with("classRef changed: restarting the VM with the new spec")),
        "{events:?}"
    );
    let refused: Vec<_> = events
        .iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .filter(|e| e.reason.as_deref() == Some("Forbidden"))
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
    let roomy_qemu = common::qemu_of(&agent.state, &uid);
    assert_eq!(roomy_qemu.len(), 1, "{roomy_qemu:?}");
    assert_ne!(roomy_qemu, rolled_qemu, "the VM was not booted again");
    let argv = std::fs::read(format!("/proc/{}/cmdline", roomy_qemu[0])).unwrap();
    let argv: Vec<String> = argv
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let m = argv
        .iter()
        .position(|a| a == "-m")
        .map(|i| argv[i + 1].clone());
    assert_eq!(m, Some(format!("{ROOMY_MIB}M")), "{argv:?}");
    let tool = exec_in(&alice, NS, VM, "test -e /opt/runner-tool && echo layered").await;
    assert_eq!(
        tool.trim(),
        "layered",
        "the runner layer is not in the guest"
    );
    let id = exec_in(&alice, NS, VM, "id -u").await;
    assert_eq!(
        id.trim(),
        "0",
        "the image under the layer is not the rolled one"
    );
    let _ = std::fs::remove_dir_all(&runner);

    vms.delete(VM, &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(&vms, VM, 120).await;
    startup_probe_fails(&c, &agent, &vms, &image2).await;
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&layout2);
}

/// Issue 45, item 2: a startup probe that never passes stops the VM as failed (`ProbeFailed`,
/// an Event naming the probe), and its restart policy applies: booted again once, then
/// `RetryExhausted` with the same reason.
async fn startup_probe_fails(
    c: &kube::Client,
    agent: &common::agent::HostAgent,
    vms: &Api<ImpVM>,
    image: &str,
) {
    let name = "never-started";
    let uid = common::create_vm(vms, json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "classRef": {"name": "small"}, "image": image, "lifecycle": "persistent",
            "env": [{"name": "SCRIPT", "value": "exec sleep 100000"}],
            "restartPolicy": {"mode": "in-place", "onExhaustion": "manual-reset",
                              "backoff": {"maxRetries": 1, "initialDelay": "1s", "maxDelay": "1s"}},
            "probes": {"startupProbe": {"exec": {"command": ["test", "-e", "/tmp/never"]},
                                        "periodSeconds": 1, "failureThreshold": 3}}
        }
    })).await;
    let first = common::wait_vm(vms, name, "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    assert!(
        !is(&first, "Started", "True", "ProbeSucceeded"),
        "{:?}",
        condition(&first, "Started")
    );
    let qemu = common::qemu_of(&agent.state, &uid);
    let again = common::wait_vm(vms, name, "booted again by its restart policy", 300, |v| {
        v.status.as_ref().and_then(|s| s.restart_count) == Some(1)
    })
    .await;
    assert_eq!(again.status.as_ref().and_then(|s| s.restart_count), Some(1));
    let exhausted = common::wait_vm(vms, name, "RetryExhausted", 300, |v| {
        phase(v) == Some(VmPhase::RetryExhausted)
    })
    .await;
    let ready = condition(&exhausted, "Ready").unwrap();
    assert!(
        is(&exhausted, "Ready", "False", "ProbeFailed")
            && ready
                .message
                .starts_with("the startup probe failed 3 times in a row (every 1 s)"),
        "{ready:?}"
    );
    let events = common::events_with(c, NS, name, &["ProbeFailed"]).await;
    assert!(
        events.iter().filter_map(|e| e.message.as_deref()).any(|m| m
            .contains("the startup probe failed 3 times in a row (every 1 s)")
            && m.contains("stopping the VM")),
        "{events:?}"
    );
    assert!(!qemu.is_empty(), "no QEMU ran the first boot");
    assert!(
        common::qemu_of(&agent.state, &uid).is_empty(),
        "a QEMU runs after the retries were exhausted"
    );
}

/// The VM's trace reached the collector: the operator's `schedule`, the agent's root
/// `ImpVM default/probed` and `start` with its four steps, all in the trace named by the VM's uid,
/// `schedule` and `start` under the root, the steps under `start`.
async fn traced_from_schedule_to_running(collector: &common::OtlpReceiver, uid: &str) {
    let trace: String = uid.chars().filter(|c| *c != '-').collect();
    let names = [
        "ImpVM default/probed",
        "schedule",
        "start",
        "image",
        "disk",
        "boot",
        "guest ready",
    ];
    let spans = common::wait_for(
        "the VM's spans at the collector",
        Duration::from_secs(30),
        || {
            let spans = collector.spans();
            let all = names.iter().all(|n| spans.iter().any(|s| s["name"] == *n));
            async move { all.then_some(spans) }
        },
    )
    .await;
    let by = |name: &str| spans.iter().find(|s| s["name"] == name).unwrap().clone();
    let (root, schedule, start) = (by(names[0]), by("schedule"), by("start"));
    for s in &spans {
        assert_eq!(s["traceId"], trace.as_str(), "{s}");
    }
    assert_eq!(
        root["service"], "imp-agent",
        "the agent that reports it Running"
    );
    assert_eq!(schedule["service"], "imp-operator");
    assert_eq!(start["service"], "imp-agent");
    assert_eq!(schedule["parentSpanId"], root["spanId"]);
    assert_eq!(start["parentSpanId"], root["spanId"]);
    for step in &names[3..] {
        assert_eq!(by(step)["parentSpanId"], start["spanId"], "{step}");
    }
    let nanos = |s: &serde_json::Value, k: &str| s[k].as_str().unwrap().parse::<u128>().unwrap();
    let ms = |s: &serde_json::Value| {
        (nanos(s, "endTimeUnixNano") - nanos(s, "startTimeUnixNano")) / 1_000_000
    };
    eprintln!(
        "trace: created → running {} ms; schedule {} ms; start {} ms (image {} ms, disk {} ms, boot {} ms, guest ready {} ms)",
        ms(&root),
        ms(&schedule),
        ms(&start),
        ms(&by("image")),
        ms(&by("disk")),
        ms(&by("boot")),
        ms(&by("guest ready"))
    );
    assert!(nanos(&schedule, "endTimeUnixNano") <= nanos(&start, "endTimeUnixNano"));
}
