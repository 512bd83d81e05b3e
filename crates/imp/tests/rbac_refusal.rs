//! A rule missing from the chart's RBAC is said, not hidden: the operator and the agent, each
//! run with a ServiceAccount whose role lacks `patch impvms/status`, log the API server's refusal
//! (which names the verb and the resource) and put it on the VM as a Warning Event `Forbidden`,
//! instead of retrying in silence.
//!
//! The operator needs only the control plane; the agent also needs root and a cgroup hierarchy
//! (it makes its VMs' cgroup parent), but no guest: its VM cannot start (the Firecracker binary
//! it is pointed at does not exist), and the status write that says so is what RBAC refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use imp_api::vm::ImpVM;
use imp_testenv::registry::scratch_dir;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::process::{Child, Command};

const NS: &str = "default";
/// The rule both roles lose.
const STATUS_RULE: &str =
    "  - apiGroups: [\"imp.dev\"]\n    resources: [\"impvms/status\"]\n    verbs: [\"patch\"]\n";
/// What the API server says of the refused write (its own words, in the log and the Event).
const REFUSAL: &str = "cannot patch resource \"impvms/status\" in API group \"imp.dev\"";

/// `yaml` without the `impvms/status` rule (which must be there).
fn without_status_rule(yaml: &str) -> String {
    assert!(
        yaml.contains(STATUS_RULE),
        "the chart's role no longer has the rule this test drops: {STATUS_RULE}"
    );
    yaml.replace(STATUS_RULE, "")
}

/// Which component's role loses the rule.
#[derive(PartialEq)]
enum Refused {
    Operator,
    Agent,
}

/// A cluster whose operator's or agent's role lacks the status rule.
async fn cluster(refused: Refused) -> common::Cluster {
    let mut c = common::cluster(&[NS, "imp-system"]).await;
    let role = |yaml: &str, who| {
        if refused == who {
            without_status_rule(yaml)
        } else {
            yaml.to_owned()
        }
    };
    c.ids = imp_testenv::rbac::install_roles(
        &c.cp,
        "imp-system",
        &role(imp_testenv::rbac::OPERATOR_ROLE, Refused::Operator),
        &role(imp_testenv::rbac::AGENT_ROLE, Refused::Agent),
    )
    .await
    .unwrap();
    c
}

async fn class(c: &kube::Client) {
    common::create_imp(
        c,
        "ImpVMClass",
        "impvmclasses",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
               "metadata": {"name": "small"}, "spec": {"vcpu": 1, "memoryMiB": 128, "diskGiB": 1}}),
    )
    .await;
}

async fn vm(c: &kube::Client, name: &str, spec: serde_json::Value) {
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS}, "spec": spec
    }))
    .unwrap();
    Api::<ImpVM>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
}

/// `imp ARGS` with `kubeconfig`, its stderr in `log`.
fn spawn(kubeconfig: &Path, log: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_imp"))
        .args(args)
        .envs(env.iter().copied())
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// The Warning `Forbidden` Event of `name`, and the component's log once it has the refusal.
async fn refusal_told(c: &kube::Client, name: &str, log: &Path) -> (String, String) {
    let ev = common::events_with(c, NS, name, &[imp_api::refusal::FORBIDDEN_REASON])
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some(imp_api::refusal::FORBIDDEN_REASON))
        .unwrap();
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let note = ev.message.unwrap_or_default();
    let logged = common::wait_for(
        "the refusal in the log",
        Duration::from_secs(10),
        || async {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            text.contains(REFUSAL).then_some(text)
        },
    )
    .await;
    (note, logged)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_refused_by_rbac_says_which_verb_and_resource_in_its_log_and_an_event() {
    if common::control_plane_ready().is_none() {
        return;
    }
    let c = cluster(Refused::Operator).await;
    common::ready_node(&c.client, "n1").await;
    class(&c.client).await;
    let dir = scratch_dir("imp-rbac-refusal-operator").unwrap();
    let log = dir.join("operator.log");
    let metrics = format!("127.0.0.1:{}", common::free_port());
    let _op = spawn(
        c.operator_kubeconfig(),
        &log,
        &["operator", "--metrics-addr", &metrics],
        &[],
    );
    vm(
        &c.client,
        "refused",
        json!({"classRef": {"name": "small"}, "image": "busybox"}),
    )
    .await;
    let (note, logged) = refusal_told(&c.client, "refused", &log).await;
    assert!(note.contains(REFUSAL), "{note}");
    assert!(
        note.contains("system:serviceaccount:imp-system:imp-operator"),
        "{note}"
    );
    assert!(logged.contains("refused by the API server"), "{logged}");
}

/// Root and a cgroup hierarchy for the agent; `None` means skip (fails under `CI=true`).
fn agent_ready() -> Option<()> {
    common::control_plane_ready()?;
    imp_testenv::guard::require(
        imp_testenv::guard::is_root(),
        "root (the agent makes cgroups)",
    )
    .then_some(())?;
    let cgroups = Path::new("/sys/fs/cgroup/memory").is_dir()
        || Path::new("/sys/fs/cgroup/cgroup.procs").is_file();
    imp_testenv::guard::require(cgroups, "a mounted cgroup hierarchy").then_some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refused_by_rbac_says_which_verb_and_resource_in_its_log_and_an_event() {
    if agent_ready().is_none() {
        return;
    }
    let c = cluster(Refused::Agent).await;
    common::ready_node(&c.client, "n1").await;
    class(&c.client).await;
    // The operator (with its whole role) books and places the VM for the agent.
    let _operator = common::start_operator(&c);
    let state: PathBuf = scratch_dir("imp-rbac-refusal-agent").unwrap();
    let log = state.join("agent.log");
    let cgroup_parent = format!("imp-rbac-refusal-{}", std::process::id());
    let metrics = format!("127.0.0.1:{}", common::free_port());
    let (kernel, guest) = (common::kernel(), common::guest());
    let _agent = spawn(
        &c.agent_kubeconfig_for("n1").await,
        &log,
        &[
            "agent",
            "--runtime",
            "firecracker",
            "--state-dir",
            state.join("state").to_str().unwrap(),
            "--cgroup-parent",
            &cgroup_parent,
            "--metrics-addr",
            &metrics,
            "--api-addr",
            "127.0.0.1:0",
        ],
        &[
            ("NODE_NAME", "n1"),
            ("FC_BIN", "/nonexistent/firecracker"),
            ("FC_KERNEL", kernel.to_str().unwrap()),
            ("IMP_GUEST", guest.to_str().unwrap()),
        ],
    );
    vm(
        &c.client,
        "refused",
        json!({"classRef": {"name": "small"}, "image": "busybox", "nodeName": "n1"}),
    )
    .await;
    let (note, logged) = refusal_told(&c.client, "refused", &log).await;
    assert!(note.contains(REFUSAL), "{note}");
    assert!(
        note.contains("system:serviceaccount:imp-system:imp-agent"),
        "{note}"
    );
    assert!(logged.contains("node=n1"), "{logged}");
    common::remove_agent_leftovers(&state.join("state"), &cgroup_parent);
}
