//! End-to-end: `spec.userData.configMapRef` through the real `imp operator` and the real
//! `imp agent`, against a real kube-apiserver with the chart's RBAC and a real Linux guest
//! under QEMU/TCG.
//!
//! One guest boots: its ConfigMap's `#cloud-config` writes a file, adds a user and runs
//! commands (a string under `sh -c` and an argv) that leave a marker, all before the workload
//! starts (the workload copies the marker it found). Two VMs never boot: one whose ConfigMap
//! does not exist and one whose cloud-config uses a key imp does not run; each gets
//! `InvalidSpec` naming what is wrong. Then, one at a time: a `#!` script as user data runs as
//! root before the workload; a cloud-config whose second step fails ends its (ephemeral) VM
//! `Failed` naming the step, its exit code and its output, and the workload never starts.
//!
//! Needs what `agent_e2e.rs` needs (`scripts/setup`): without it, it skips on a developer
//! machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::phase;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::{TestRegistry, push, scratch_dir};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tokio::process::Command;

const NS: &str = "default";
const NODE: &str = "ud-node";

/// The booted VM's user data: a file, a user, and commands leaving a marker.
const CLOUD_CONFIG: &str = r#"#cloud-config
write_files:
  - path: /etc/imp-test/greeting
    content: |
      hello from userData
    permissions: '0600'
users:
  - default
  - name: deploy
    uid: 1500
    groups: [wheel]
    ssh_authorized_keys:
      - ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOmD deploy@imp-test
runcmd:
  - [cp, /etc/imp-test/greeting, /tmp/marker]
  - echo "second step ran as $(id -u)" >> /tmp/marker
"#;

/// User data as a script: run as root before the workload, as cloud-init runs a `#!` part.
const SCRIPT: &str = "#!/bin/sh\necho \"script ran as $(id -u)\" > /tmp/marker\n";

/// User data whose second step fails: the boot ends there, before the workload.
const BROKEN: &str = r#"#cloud-config
runcmd:
  - echo first > /tmp/marker
  - [cp, /nope, /x]
  - echo never >> /tmp/marker
"#;

/// The workload: keeps what it found of the marker, then runs on.
const WORKLOAD: &str = "cat /tmp/marker > /tmp/workload-saw 2>&1; exec sleep 100000";

struct Agent {
    state: PathBuf,
    cgroup_parent: String,
    container: common::Container,
}

impl Agent {
    async fn start(kube: &common::Cluster) -> Self {
        let kubeconfig = kube.agent_kubeconfig_for(NODE).await;
        let id = format!("ud-e2e-{}", std::process::id());
        let mut a = Self {
            state: scratch_dir("imp-userdata-e2e-state").unwrap(),
            cgroup_parent: format!("{id}-vms"),
            container: common::Container::new(&format!("{id}-agent")),
        };
        let child = Command::new(env!("CARGO_BIN_EXE_imp"))
            .arg("agent")
            .env("NODE_NAME", NODE)
            .env("FC_KERNEL", common::kernel())
            .env("IMP_GUEST", common::guest())
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", common::rust_log())
            .args(["--state-dir", a.state.to_str().unwrap()])
            .args(["--runtime", "qemu", "--no-network"])
            .args(["--cgroup-parent", &a.cgroup_parent])
            .args([
                "--metrics-addr",
                &format!("127.0.0.1:{}", common::free_port()),
            ])
            .args(["--stop-grace", "3s", "--api-addr", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(common::logs())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        a.container.run(child);
        a
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.container.destroy();
        common::remove_agent_leftovers(&self.state, &self.cgroup_parent);
    }
}

/// The Ready condition's reason and message.
fn ready(v: &ImpVM) -> Option<(String, String)> {
    let c = v
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.reason.clone(), c.message.clone()))
}

async fn config_map(c: &kube::Client, name: &str, user_data: &str) {
    let api: Api<ConfigMap> = Api::namespaced(c.clone(), NS);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "data": {"user-data": user_data, "notes": "not user data"}
    }))
    .unwrap();
    api.create(&PostParams::default(), &cm).await.unwrap();
}

async fn vm(vms: &Api<ImpVM>, name: &str, image: &str, config_map: &str) {
    vm_with(vms, name, image, config_map, "persistent").await;
}

async fn vm_with(vms: &Api<ImpVM>, name: &str, image: &str, config_map: &str, lifecycle: &str) {
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "image": image, "lifecycle": lifecycle,
                 "userData": {"configMapRef": {"name": config_map}}}
    }))
    .unwrap();
    vms.create(&PostParams::default(), &obj).await.unwrap();
}

/// Waits until VM `vm` runs and its workload has kept its copy of the marker (so its user
/// data has run).
async fn workload_started(alice: &Path, vms: &Api<ImpVM>, vm: &str) {
    common::wait_vm(vms, vm, "Running", 300, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    common::wait_for(
        &format!("{vm}'s workload's copy of the marker"),
        Duration::from_secs(60),
        || async {
            let out = exec(alice, vm, "[ -e /tmp/workload-saw ] && echo ok || true").await;
            (out.trim() == "ok").then_some(())
        },
    )
    .await;
}

async fn exec(kubeconfig: &Path, vm: &str, script: &str) -> String {
    common::snapshots::exec_in(kubeconfig, NS, vm, script).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_data_runs_before_the_workload_and_what_is_wrong_is_named() {
    let _run = common::test_run("userdata_e2e", Duration::from_secs(600));
    let Some(env) = common::agent::single_node(NS, NODE, 256).await else {
        return;
    };
    let (kube, c, alice) = (env.kube, env.client, env.exec_kubeconfig);
    let registry = TestRegistry::start().await.unwrap();
    let image = format!("{}/userdata:1", registry.host());
    let layout = scratch_dir("imp-userdata-e2e-layout").unwrap();
    common::busybox_image(
        &["sh", "cat", "cp", "echo", "id", "sleep", "stat", "grep"],
        WORKLOAD,
    )
    .write_layout(&layout, "1")
    .unwrap();
    push(&layout, "1", &image, None).await.unwrap();
    std::fs::remove_dir_all(&layout).unwrap();

    config_map(&c, "init", CLOUD_CONFIG).await;
    config_map(&c, "unsupported", "#cloud-config\npackages: [curl]\n").await;
    let _operator = common::start_operator(&kube);
    let _agent = Agent::start(&kube).await;
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    vm(&vms, "no-config-map", &image, "absent").await;
    vm(&vms, "refused", &image, "unsupported").await;
    vm(&vms, "ud", &image, "init").await;

    // What is wrong is named on the VM, and it does not boot.
    let missing = common::wait_vm(&vms, "no-config-map", "InvalidSpec", 120, |v| {
        ready(v).is_some_and(|(reason, _)| reason == "InvalidSpec")
    })
    .await;
    let (_, message) = ready(&missing).unwrap();
    assert_eq!(
        message,
        "spec.userData.configMapRef: ConfigMap absent does not exist"
    );
    let refused = common::wait_vm(&vms, "refused", "InvalidSpec", 120, |v| {
        ready(v).is_some_and(|(reason, _)| reason == "InvalidSpec")
    })
    .await;
    let (_, message) = ready(&refused).unwrap();
    assert!(
        message.contains("ConfigMap unsupported")
            && message.contains("key `packages` is not supported"),
        "{message}"
    );
    common::events_with(&c, NS, "no-config-map", &["InvalidSpec"]).await;

    // The ConfigMap's cloud-config ran before the workload, as root.
    workload_started(&alice, &vms, "ud").await;
    let expected = "hello from userData\nsecond step ran as 0\n";
    assert_eq!(exec(&alice, "ud", "cat /tmp/marker").await, expected);
    assert_eq!(
        exec(&alice, "ud", "cat /tmp/workload-saw").await,
        expected,
        "the workload started after the user data"
    );
    assert_eq!(
        exec(&alice, "ud", "stat -c '%a %u' /etc/imp-test/greeting").await,
        "600 0\n"
    );
    assert_eq!(
        exec(
            &alice,
            "ud",
            "grep -e '^deploy:' -e '^wheel:' /etc/passwd /etc/group"
        )
        .await,
        "/etc/passwd:deploy:x:1500:1500::/home/deploy:/bin/sh\n\
         /etc/group:deploy:x:1500:\n\
         /etc/group:wheel:x:1000:deploy\n"
    );
    assert_eq!(
        exec(
            &alice,
            "ud",
            "stat -c '%a %u' /home/deploy/.ssh /home/deploy/.ssh/authorized_keys; \
             cat /home/deploy/.ssh/authorized_keys"
        )
        .await,
        "700 1500\n600 1500\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOmD deploy@imp-test\n"
    );

    script_and_failing_step(&c, &alice, &vms, &image).await;

    // The two VMs with bad user data never started.
    for name in ["no-config-map", "refused"] {
        let v = vms.get(name).await.unwrap();
        assert!(
            !matches!(phase(&v), Some(VmPhase::Starting | VmPhase::Running)),
            "{name}: {:?}",
            v.status
        );
    }
}

/// Ready's message.
fn ready_message(v: &ImpVM) -> String {
    ready(v).map(|(_, m)| m).unwrap_or_default()
}

/// Issue 45, item 2: a `#!` script runs before the workload, and a failing step ends the VM
/// naming it, each in a real guest (the node fits one VM at a time: each after the last is gone).
async fn script_and_failing_step(c: &kube::Client, alice: &Path, vms: &Api<ImpVM>, image: &str) {
    vms.delete("ud", &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(vms, "ud", 120).await;
    config_map(c, "script", SCRIPT).await;
    vm(vms, "script", image, "script").await;
    workload_started(alice, vms, "script").await;
    assert_eq!(
        exec(alice, "script", "cat /tmp/workload-saw").await,
        "script ran as 0\n",
        "the script ran as root before the workload"
    );
    vms.delete("script", &DeleteParams::default())
        .await
        .unwrap();
    common::wait_vm_gone(vms, "script", 120).await;

    config_map(c, "broken", BROKEN).await;
    vm_with(vms, "broken", image, "broken", "ephemeral").await;
    let failed = common::wait_vm(vms, "broken", "Failed", 300, |v| {
        phase(v) == Some(VmPhase::Failed)
    })
    .await;
    let message = ready_message(&failed);
    assert!(
        message.contains("userData failed, the workload was not started: runcmd[1] (cp /nope /x): exited with code 1")
            && message.contains("can't stat '/nope'"),
        "{message}"
    );
    let status = failed.status.as_ref().unwrap();
    assert_eq!(status.exit_code, Some(1), "{status:?}");
    common::events_with(c, NS, "broken", &["Failed"]).await;
}
