//! An upgrade from the previous release (issue 24; docs/upgrade.md): the chart and images of
//! the commit `scripts/previous-release` names are installed on a real node (imp-testenv's
//! `podnode`: a kubelet, containerd and runc), VMs are made in each state a user leaves them
//! in, and `helm upgrade` moves the release to this commit's chart and images. Then:
//! - the Running VM was re-adopted: the same QEMU process, the same guest boot, and `imp exec`
//!   reaches it through the new operator's gateway and the new agent;
//! - the Suspended VM (suspended by the previous agent, its snapshot written by it) resumes on
//!   the new agent into the same guest boot;
//! - the ScaleToZero VM, asleep since the previous agent suspended it for being idle, is woken
//!   by the first TCP connection sent to it from the node, into the same guest boot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::workspace_root;
use kube::api::{Api, DeleteParams};
use serde_json::json;

use common::nodes::text;
use common::pods::{Cluster, archive};
use common::{phase, wait_vm};

const VM_NS: &str = "default";
const REGISTRY: &str = "ghcr.io/imp-dev";
const IMAGES: [&str; 2] = ["imp-operator", "imp-agent"];
/// The tag the previous release's images are given on the node (they carry the workspace
/// version, which this release's images may share).
const PREVIOUS_TAG: &str = "previous";
/// Serves TCP on 9000: answers with its name.
const SERVER: &str = r#"printf '#!/bin/sh\necho "pong from $(hostname)"\n' > /tmp/h; chmod +x /tmp/h; exec nc -ll -p 9000 -e /tmp/h"#;

/// What `scripts/previous-release` wrote.
fn previous(file: &str) -> PathBuf {
    workspace_root().join("target/previous").join(file)
}

/// The `appVersion` of the chart in `chart`: the tag its images carry.
fn app_version(chart: &Path) -> String {
    let text = std::fs::read_to_string(chart.join("Chart.yaml")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .expect("an appVersion in the previous chart")
}

/// The image (name, and the ID the runtime runs) of each container of the Pods of `component`
/// that are not being deleted.
async fn images_of(c: &Cluster, component: &str) -> Vec<(String, String)> {
    c.pods(component)
        .await
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .flat_map(|p| {
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
        })
        .map(|s| (s.image.clone(), s.image_id.clone()))
        .collect()
}

/// Creates VM `name` on network net1 serving [`SERVER`], with `desired` state.
async fn create_vm(admin: &kube::Client, image: &str, name: &str, desired: &str) {
    let mut spec = json!({"classRef": {"name": "small"}, "image": image,
        "lifecycle": "persistent", "networkRef": {"name": "net1"}, "desiredState": desired,
        "env": [{"name": "SCRIPT", "value": SERVER}]});
    if desired == "ScaleToZero" {
        spec["idleTimeout"] = json!("10s");
    }
    common::create_imp(
        admin,
        "ImpVM",
        "impvms",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": VM_NS}, "spec": spec}),
    )
    .await;
}

/// Connects from the node's network to `ip`:9000 and returns the first line answered.
async fn connect_from_node(c: &Cluster, ip: &str) -> String {
    let mut cmd = c.node.command("bash");
    cmd.args([
        "-c",
        &format!("exec 3<>/dev/tcp/{ip}/9000 && IFS= read -r -t 60 line <&3; echo \"$line\""),
    ]);
    let out = common::output_within(cmd.into(), Duration::from_secs(120), "the connect").await;
    assert!(
        out.status.success(),
        "connecting to {ip}:9000: {}",
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The pid of VM `name`'s one QEMU.
async fn qemu(c: &Cluster, vms: &Api<ImpVM>, name: &str) -> u32 {
    let uid = vms.get(name).await.unwrap().metadata.uid.unwrap();
    let pids = common::qemu_of(&c.state(), &uid);
    assert_eq!(pids.len(), 1, "one QEMU for {name}: {pids:?}");
    pids[0]
}

/// The release of the QEMU running as `pid` (`qemu 7.2.22`), from its own binary.
fn qemu_release(pid: u32) -> String {
    let out = std::process::Command::new(format!("/proc/{pid}/exe"))
        .arg("--version")
        .output()
        .unwrap();
    imp_vmm::version::identity("qemu", &String::from_utf8_lossy(&out.stdout))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vm_survives_an_upgrade_from_the_previous_release() {
    let mut archives: Vec<PathBuf> = IMAGES.iter().map(|i| archive(i)).collect();
    archives.extend(IMAGES.iter().map(|i| previous(&format!("{i}.oci.tar"))));
    if common::pods::ready(&archives).is_none() {
        return;
    }
    let _run = common::test_run("upgrade_e2e", Duration::from_secs(900));
    let c = Cluster::start("upgrade-e2e").await;
    let release = std::fs::read_to_string(previous("release")).unwrap();
    let old = app_version(&previous("chart"));
    let new = app_version(&workspace_root().join("charts/imp"));
    for image in IMAGES {
        // The previous release's image first, named apart; then this one's, which may take
        // the same name:tag.
        let archive_name = format!("{image}.oci.tar");
        c.node
            .import(&previous(&archive_name))
            .unwrap_or_else(|e| panic!("{e}"));
        let name = format!("{REGISTRY}/{image}");
        c.node
            .tag(&format!("{name}:{old}"), &format!("{name}:{PREVIOUS_TAG}"))
            .unwrap_or_else(|e| panic!("{e}"));
        c.node
            .import(&archive(image))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    common::busybox_image(
        &[
            "sh", "echo", "cat", "sleep", "hostname", "nc", "printf", "chmod",
        ],
        "eval \"$SCRIPT\"",
    )
    .write_layout(&c.layout(), "1")
    .unwrap();
    let values = c.values().display().to_string();
    let t0 = Instant::now();
    c.helm(
        "install",
        &previous("chart"),
        &[
            "--create-namespace",
            "-f",
            &values,
            "--set",
            &format!("operator.image.tag={PREVIOUS_TAG}"),
            "--set",
            &format!("agent.image.tag={PREVIOUS_TAG}"),
        ],
    );
    eprintln!(
        "the previous release ({}) installed in {:?}",
        release.trim(),
        t0.elapsed()
    );

    let admin = c.cp.admin().await.unwrap();
    let vms: Api<ImpVM> = Api::namespaced(admin.clone(), VM_NS);
    let before = vms_in_every_state(&c, &admin, &vms).await;

    let agents = c.ready_agents().await;
    let mut previous_ids = Vec::new();
    for component in ["operator", "agent"] {
        previous_ids.extend(images_of(&c, component).await.into_iter().map(|(_, id)| id));
    }
    let t1 = Instant::now();
    c.helm(
        "upgrade",
        &workspace_root().join("charts/imp"),
        &["-f", &values],
    );
    eprintln!("helm upgrade --wait to this release: {:?}", t1.elapsed());
    // The previous release's operator stops serving at SIGTERM (it has no drainSeconds): the
    // API server may route a call to it until its Pod's endpoint is gone, which is before the
    // Pod itself is.
    c.wait_none_terminating("operator").await;
    let now = c.ready_agents().await;
    assert!(
        now.len() == 1 && now != agents,
        "the upgrade did not replace the agent's Pod: {agents:?} then {now:?}"
    );
    for (component, image) in [("operator", "imp-operator"), ("agent", "imp-agent")] {
        let running = images_of(&c, component).await;
        let want = format!("{REGISTRY}/{image}:{new}");
        assert!(
            !running.is_empty()
                && running
                    .iter()
                    .all(|(name, id)| *name == want && !previous_ids.contains(id)),
            "the {component}'s Pods run {running:?}, not {want} (the previous images: {previous_ids:?})"
        );
    }

    every_vm_survived(&c, &vms, &before).await;
    let left = common::processes_naming(&c.state().display().to_string());
    assert!(
        left.iter().all(|p| Some(*p) == c.agent_pid()),
        "VM processes outlived their deleted VMs: {left:?}"
    );
}

/// What the VMs were before the upgrade: each one's guest boot id, and the Running one's QEMU.
struct Before {
    boots: Vec<(&'static str, String)>,
    run_qemu: u32,
}

impl Before {
    fn boot(&self, name: &str) -> &str {
        &self.boots.iter().find(|(n, _)| *n == name).unwrap().1
    }
}

/// Under the previous release: VM `sus` suspended with `imp suspend`, `stz` (ScaleToZero, 10 s
/// idle timeout) asleep by itself, its QEMU gone, and `run` Running. One at a time: the node
/// has two CPUs and a VM holds one while it runs (its reservation Pod, docs/capacity.md).
async fn vms_in_every_state(c: &Cluster, admin: &kube::Client, vms: &Api<ImpVM>) -> Before {
    common::small_class(admin, 256).await;
    common::create_imp(
        admin,
        "ImpNetwork",
        "impnetworks",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
               "metadata": {"name": "net1", "namespace": VM_NS},
               "spec": {"subnet": "10.217.0.0/24"}}),
    )
    .await;
    let image = format!("oci:{}:1", c.layout().display());
    let t0 = Instant::now();
    let mut boots = Vec::new();
    // stz is read at once: it falls asleep 10 s after it runs (an exec would wake it, a wait
    // for Running would not).
    for (name, desired) in [
        ("sus", "Running"),
        ("stz", "ScaleToZero"),
        ("run", "Running"),
    ] {
        create_vm(admin, &image, name, desired).await;
        wait_vm(vms, name, "Running", 300, |v| {
            phase(v) == Some(VmPhase::Running)
        })
        .await;
        boots.push((name, c.boot_id(VM_NS, name).await));
        match name {
            "sus" => {
                let pid = qemu(c, vms, "sus").await;
                let suspend = c.imp(&["suspend", "-n", VM_NS, "sus"]);
                let suspended = wait_vm(vms, "sus", "Suspended", 110, |v| {
                    phase(v) == Some(VmPhase::Suspended)
                });
                tokio::join!(suspend, suspended);
                assert!(!common::alive(pid), "sus's QEMU runs on while Suspended");
            }
            "stz" => {
                let stz = wait_vm(vms, "stz", "idle, Suspended", 120, |v| {
                    phase(v) == Some(VmPhase::Suspended)
                })
                .await;
                let uid = stz.metadata.uid.unwrap();
                assert!(
                    common::qemu_of(&c.state(), &uid).is_empty(),
                    "the sleeping stz has a QEMU"
                );
            }
            _ => {}
        }
    }
    eprintln!(
        "sus Suspended, stz asleep and run Running under the previous release in {:?}",
        t0.elapsed()
    );
    let run_qemu = qemu(c, vms, "run").await;
    Before { boots, run_qemu }
}

/// Deletes VM `name` and waits until it is gone.
async fn delete(vms: &Api<ImpVM>, name: &str) {
    vms.delete(name, &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(vms, name, 120).await;
}

/// Under this release: `run` is the same QEMU and guest, `sus` resumes into its guest, and
/// `stz` wakes into its guest on a connection from the node.
async fn every_vm_survived(c: &Cluster, vms: &Api<ImpVM>, before: &Before) {
    // re-adopted
    assert!(
        common::alive(before.run_qemu),
        "run's QEMU {} died in the upgrade",
        before.run_qemu
    );
    let run = vms.get("run").await.unwrap();
    assert_eq!(phase(&run), Some(VmPhase::Running), "{:?}", run.status);
    assert_eq!(qemu(c, vms, "run").await, before.run_qemu);
    assert_eq!(
        c.boot_id(VM_NS, "run").await,
        before.boot("run"),
        "run's guest rebooted"
    );
    // The previous release's QEMU, which wrote sus's snapshot too.
    let writer = qemu_release(before.run_qemu);
    // Each VM is deleted once checked: the next needs its CPU.
    delete(vms, "run").await;
    assert!(
        !common::alive(before.run_qemu),
        "run's QEMU outlived its VM"
    );
    // resumable
    let sus = vms.get("sus").await.unwrap();
    assert_eq!(phase(&sus), Some(VmPhase::Suspended), "{:?}", sus.status);
    c.imp(&["resume", "-n", VM_NS, "sus"]).await;
    wait_vm(vms, "sus", "Running after the resume", 120, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    assert_eq!(
        c.boot_id(VM_NS, "sus").await,
        before.boot("sus"),
        "sus booted afresh instead of resuming"
    );
    // Resumed by a QEMU of its snapshot's writer's release, which this release's image keeps
    // beside its own newer one when they differ (IMP_QEMU_KEPT).
    assert_eq!(
        qemu_release(qemu(c, vms, "sus").await),
        writer,
        "sus was resumed by another QEMU release than the one that suspended it"
    );
    delete(vms, "sus").await;
    // wakeable
    let stz = vms.get("stz").await.unwrap();
    assert_eq!(phase(&stz), Some(VmPhase::Suspended), "{:?}", stz.status);
    let ip = stz.status.and_then(|s| s.ip).expect("stz's address");
    let t0 = Instant::now();
    let reply = connect_from_node(c, &ip).await;
    eprintln!(
        "stz woken by a connection from the node in {:?}",
        t0.elapsed()
    );
    assert_eq!(reply, "pong from stz", "the woken stz's answer");
    wait_vm(vms, "stz", "Running after the wake", 60, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    assert_eq!(
        c.boot_id(VM_NS, "stz").await,
        before.boot("stz"),
        "stz booted afresh instead of waking"
    );
    delete(vms, "stz").await;
}
