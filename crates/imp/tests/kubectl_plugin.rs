//! `kubectl imp`, the kubectl plugin, as a user meets it: the `imp` binary linked as
//! `kubectl-imp` on a `PATH` of its own, run by the real kubectl against the real API server of
//! the test control plane (imp-testenv), with imp's shipped user roles.
//!
//! kubectl lists and runs the plugin; `kubectl imp ps` lists ImpVMs with their node, phase and
//! address; `kubectl imp suspend|resume` set `spec.desiredState` and wait for the phase (the
//! test plays the node agent's part by writing the status); `kubectl imp logs` reads an ImpVM's
//! serial console through the API server (which authorizes `get impvms/console` of
//! `subresources.imp.dev`), imp's gateway and a real node-agent API, both served in-process
//! (mutual TLS pinned both ways), and says why when the VM is not placed or its node's agent
//! cannot be reached. No VM boots: the console is a
//! file the test writes, as a VMM would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::plugin::Plugin;
use imp_agent::api::auth::{Gateway, follow_pins};
use imp_agent::api::{AgentApi, ApiConfig, GuestEndpoint, Identity, VmLookup};
use imp_api::shared::{ANNOTATION_AGENT_CERT_SHA256, ANNOTATION_AGENT_ENDPOINT};
use imp_api::vm::ImpVM;
use imp_testenv::ControlPlane;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

/// How long one kubectl run may take before the test fails.
const RUN_LIMIT: Duration = Duration::from_secs(60);

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `kubectl imp ARGS…` with `KUBECONFIG` set to `kubeconfig` (the plugin reads it as kubectl
/// does), run to its end and logged.
async fn kubectl_imp(plugin: &Plugin, kubeconfig: &Path, args: &[&str]) -> Output {
    let mut cmd = plugin.kubectl(&[&["imp"], args].concat());
    cmd.env("KUBECONFIG", kubeconfig);
    let what = format!("{cmd:?}");
    let out = common::output_within(cmd.into(), RUN_LIMIT, &what).await;
    imp_testenv::report::logged(what, out)
}

/// An ImpVM with `status` written as its node's agent would.
async fn vm(client: &kube::Client, ns: &str, name: &str, status: Option<serde_json::Value>) {
    let api: Api<ImpVM> = Api::namespaced(client.clone(), ns);
    let object: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name},
        "spec": {"image": format!("registry.example/{name}:1"), "classRef": {"name": "small"}},
    }))
    .unwrap();
    api.create(&PostParams::default(), &object).await.unwrap();
    if let Some(status) = status {
        set_status(client, ns, name, status).await;
    }
}

async fn set_status(client: &kube::Client, ns: &str, name: &str, status: serde_json::Value) {
    Api::<ImpVM>::namespaced(client.clone(), ns)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
}

/// A Node whose agent publishes `endpoint` and certificate `fingerprint`, as `imp agent` does.
async fn node(client: &kube::Client, name: &str, endpoint: &str, fingerprint: &str) {
    let node: Node = serde_json::from_value(json!({"metadata": {
        "name": name,
        "annotations": BTreeMap::from([
            (ANNOTATION_AGENT_ENDPOINT, endpoint),
            (ANNOTATION_AGENT_CERT_SHA256, fingerprint),
        ]),
    }}))
    .unwrap();
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap();
}

/// The table's rows (after the header) as whitespace-separated cells.
fn rows(out: &Output) -> Vec<Vec<String>> {
    text(&out.stdout)
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[test]
fn kubectl_finds_the_plugin_whose_help_says_kubectl_imp_and_which_refuses_local_commands() {
    let Some(plugin) = Plugin::install("help") else {
        return;
    };
    let out = plugin.kubectl(&["plugin", "list"]).output().unwrap();
    let out = imp_testenv::report::logged("kubectl plugin list", out);
    assert_eq!(out.status.code(), Some(0));
    let listed = text(&out.stdout);
    assert!(
        listed
            .lines()
            .any(|l| l.trim() == plugin.path().display().to_string()),
        "{listed}"
    );

    let out = plugin.kubectl(&["imp", "--help"]).output().unwrap();
    let out = imp_testenv::report::logged("kubectl imp --help", out);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    assert!(
        help.contains("Usage: kubectl imp [OPTIONS] <COMMAND>"),
        "{help}"
    );
    for command in ["exec", "console", "logs", "ps", "suspend", "resume"] {
        assert!(
            help.contains(&format!("\n  {command} ")),
            "{command}: {help}"
        );
    }
    assert!(!help.contains("\n  run "), "no local command: {help}");
    let out = plugin.kubectl(&["imp", "logs", "--help"]).output().unwrap();
    let help = text(&out.stdout);
    assert!(
        help.contains("Usage: kubectl imp logs [OPTIONS] <VM>") && help.contains("--follow"),
        "{help}"
    );

    // A local command through kubectl: refused, saying how to run it, with imp's exit code
    // (kubectl hands the plugin its process, so the code is the plugin's).
    let out = plugin
        .kubectl(&["imp", "run", "busybox:latest"])
        .output()
        .unwrap();
    let out = imp_testenv::report::logged("kubectl imp run", out);
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(
        err.contains("there is no `kubectl imp run`") && err.contains("run it as `imp run`"),
        "{err}"
    );
}

#[tokio::test]
async fn kubectl_imp_ps_lists_impvms_with_their_node_phase_and_address() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let Some(plugin) = Plugin::install("ps") else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    cp.install_crds(&admin, &imp_api::crd::all()).await.unwrap();
    let ns = cp.namespace(&admin, "plugin-ps").await.unwrap();
    let other = cp.namespace(&admin, "plugin-ps-other").await.unwrap();
    vm(
        &admin,
        &ns,
        "web",
        Some(json!({"phase": "Running", "nodeName": "node-a", "ip": "10.1.0.5"})),
    )
    .await;
    vm(&admin, &ns, "fresh", None).await;
    vm(
        &admin,
        &other,
        "db",
        Some(json!({"phase": "Suspended", "nodeName": "node-b", "ip": "10.1.0.9"})),
    )
    .await;

    // -A: every namespace, the namespace first.
    let out = kubectl_imp(&plugin, cp.admin_kubeconfig(), &["ps", "-A"]).await;
    assert_eq!(out.status.code(), Some(0));
    let table = text(&out.stdout);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAMESPACE",
            "NAME",
            "PHASE",
            "NODE",
            "ADDRESS",
            "AGE",
            "IMAGE"
        ],
        "{table}"
    );
    let ours: Vec<Vec<String>> = rows(&out)
        .into_iter()
        .filter(|r| r[0] == ns || r[0] == other)
        .map(|r| r[..5].to_vec())
        .collect();
    assert_eq!(
        ours,
        [
            [ns.as_str(), "fresh", "Pending", "-", "-"],
            [ns.as_str(), "web", "Running", "node-a", "10.1.0.5"],
            [other.as_str(), "db", "Suspended", "node-b", "10.1.0.9"],
        ],
        "{table}"
    );

    // Flags after `kubectl imp` (kubectl refuses them before a plugin's name), before or after
    // the command.
    let mut cmd = plugin.kubectl(&["imp", "-n", &other, "ps", "--kubeconfig"]);
    cmd.arg(cp.admin_kubeconfig());
    let out = imp_testenv::report::logged("kubectl imp ps -n", cmd.output().unwrap());
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        rows(&out).iter().map(|r| r[0].as_str()).collect::<Vec<_>>(),
        ["db"],
        "{}",
        text(&out.stdout)
    );

    // No flags: KUBECONFIG's user and its context's namespace (alice may read only hers).
    let alice = imp_testenv::rbac::user(cp, &ns, "alice", &["imp-view"])
        .await
        .unwrap();
    let out = kubectl_imp(&plugin, &alice, &["ps"]).await;
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        rows(&out).iter().map(|r| r[0].as_str()).collect::<Vec<_>>(),
        ["fresh", "web"],
        "{}",
        text(&out.stdout)
    );

    // --context names a context the kubeconfig does not have: said in one line.
    let out = kubectl_imp(&plugin, &alice, &["ps", "--context", "nowhere"]).await;
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(err.contains("nowhere") && err.lines().count() == 1, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_imp_suspend_and_resume_set_the_desired_state_and_wait_for_the_phase() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let Some(plugin) = Plugin::install("suspend") else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    cp.install_crds(&admin, &imp_api::crd::all()).await.unwrap();
    let ns = cp.namespace(&admin, "plugin-suspend").await.unwrap();
    vm(
        &admin,
        &ns,
        "web",
        Some(json!({"phase": "Running", "nodeName": "node-a"})),
    )
    .await;
    let alice = imp_testenv::rbac::user(cp, &ns, "alice", &["imp-view", "imp-edit"])
        .await
        .unwrap();
    let api: Api<ImpVM> = Api::namespaced(admin.clone(), &ns);

    for (verb, desired, phase) in [
        ("suspend", "Suspended", "Suspended"),
        ("resume", "Running", "Running"),
    ] {
        let mut cmd = plugin.kubectl(&["imp", verb, "web"]);
        cmd.env("KUBECONFIG", &alice)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // The node agent's part: once the spec asks for it, report the phase.
        common::wait_for(
            &format!("kubectl imp {verb} to set spec.desiredState {desired}"),
            RUN_LIMIT,
            || async {
                let v = api.get("web").await.unwrap();
                let spec = serde_json::to_value(&v.spec).unwrap();
                (spec["desiredState"] == desired).then_some(())
            },
        )
        .await;
        set_status(&admin, &ns, "web", json!({"phase": phase})).await;
        let out = tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("kubectl imp {verb} did not end after the phase"))
            .unwrap();
        let out = imp_testenv::report::logged(verb, out);
        assert_eq!(out.status.code(), Some(0), "{verb}");
        assert_eq!(text(&out.stdout), "web\n");
        assert!(
            text(&out.stderr).contains(&format!("ImpVM {ns}/web is {desired}")),
            "{}",
            text(&out.stderr)
        );
    }
}

/// The VMs of the in-process node agent, as its runtime would report them.
#[derive(Default)]
struct Vms(Mutex<HashMap<(String, String), GuestEndpoint>>);

impl Vms {
    fn put(&self, ns: &str, name: &str, serial_log: PathBuf) {
        let endpoint = GuestEndpoint {
            vsock: PathBuf::from("/nonexistent/vsock.sock"),
            agent_port: imp_proto::DEFAULT_API_PORT,
            serial_log,
            running: true,
            guest_agent: true,
        };
        self.0
            .lock()
            .unwrap()
            .insert((ns.to_owned(), name.to_owned()), endpoint);
    }

    fn stop(&self, ns: &str, name: &str) {
        if let Some(e) = self
            .0
            .lock()
            .unwrap()
            .get_mut(&(ns.to_owned(), name.to_owned()))
        {
            e.running = false;
        }
    }
}

impl VmLookup for Vms {
    fn find(&self, namespace: &str, name: &str) -> Option<GuestEndpoint> {
        self.0
            .lock()
            .unwrap()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }
}

/// Reads `lines` until one equals `want`, or fails naming it.
async fn read_until(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    want: &str,
) {
    let found = tokio::time::timeout(RUN_LIMIT, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line == want {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        found,
        Ok(true),
        "kubectl imp logs -f never printed {want:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_imp_logs_reads_the_serial_console_through_the_node_agent_or_says_why_not() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let Some(plugin) = Plugin::install("logs") else {
        return;
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let admin = cp.admin().await.unwrap();
    cp.install_crds(&admin, &imp_api::crd::all()).await.unwrap();
    let ns = cp.namespace(&admin, "plugin-logs").await.unwrap();
    // alice may read consoles (imp-edit), bob may only read the VM (imp-view).
    let alice = imp_testenv::rbac::user(cp, &ns, "alice", &["imp-view", "imp-edit"])
        .await
        .unwrap();
    let bob = imp_testenv::rbac::user(cp, &ns, "bob", &["imp-view"])
        .await
        .unwrap();

    // The gateway, as `imp operator` serves it, and the node agent's API, as `imp agent`
    // serves it, reading the gateway's certificate with the agent's own ServiceAccount and the
    // shipped agent role.
    let ids = imp_testenv::rbac::install(cp, "imp-system").await.unwrap();
    let port = common::gateway_port();
    imp_testenv::aggregation::register_gateway(&admin, "imp-system", port)
        .await
        .unwrap();
    let _gateway = common::serve_gateway(cp, &ids.operator, port).await;
    let pins = Gateway::reading(
        cp.client_from(&ids.agent).await.unwrap(),
        "imp-system/imp-gateway-client",
    );
    tokio::spawn(follow_pins(pins.clone(), std::future::pending()));
    common::wait_gateway(&admin).await;
    let vms = Arc::new(Vms::default());
    let identity = Identity::self_signed(&["127.0.0.1".into()]).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let api = AgentApi::new(
        vms.clone(),
        pins,
        ApiConfig {
            console_poll: Duration::from_millis(50),
            ..Default::default()
        },
    );
    tokio::spawn(api.serve(
        listener,
        identity.server_config().unwrap(),
        std::future::pending(),
    ));
    let here = format!("{ns}-node");
    node(&admin, &here, &endpoint, identity.fingerprint()).await;
    // A node whose agent is gone: nothing listens where it says.
    let gone = format!("{ns}-gone");
    let closed = format!("127.0.0.1:{}", common::free_port());
    node(&admin, &gone, &closed, &"ab".repeat(32)).await;

    let dir = imp_testenv::registry::scratch_dir("imp-kubectl-logs").unwrap();
    let log = dir.join("serial.log");
    std::fs::write(&log, "[    0.10] Linux version 6.1\nworkload: ready\n").unwrap();
    vms.put(&ns, "web", log.clone());
    vm(
        &admin,
        &ns,
        "web",
        Some(json!({"phase": "Running", "nodeName": here})),
    )
    .await;
    vm(&admin, &ns, "pending", None).await;
    vm(
        &admin,
        &ns,
        "stranded",
        Some(json!({"phase": "Running", "nodeName": gone})),
    )
    .await;

    // What the console has so far, then the end.
    let out = kubectl_imp(&plugin, &alice, &["logs", "web", "-n", &ns]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "[    0.10] Linux version 6.1\nworkload: ready\n"
    );

    // -f: what is appended arrives, and the stream ends when the VM stops.
    let mut cmd = plugin.kubectl(&["imp", "logs", "-f", "web"]);
    cmd.env("KUBECONFIG", &alice)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    read_until(&mut lines, "workload: ready").await;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(b"workload: request 1\n").unwrap();
    }
    read_until(&mut lines, "workload: request 1").await;
    vms.stop(&ns, "web");
    assert_eq!(
        tokio::time::timeout(RUN_LIMIT, lines.next_line())
            .await
            .expect("kubectl imp logs -f did not end when the VM stopped")
            .unwrap(),
        None
    );
    let status = tokio::time::timeout(RUN_LIMIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));

    // The console's permission decides: bob may read the VM but not its console.
    let out = kubectl_imp(&plugin, &bob, &["logs", "web"]).await;
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(
        err.contains("403") && err.contains("impvms/console") && err.contains("bob"),
        "{err}"
    );

    // Not placed: the VM is named and nothing is tried.
    let out = kubectl_imp(&plugin, &alice, &["logs", "pending"]).await;
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("ImpVM {ns}/pending is not placed on a node")),
        "{err}"
    );

    // Its node's agent cannot be reached: the node and where it was tried are named.
    let out = kubectl_imp(&plugin, &alice, &["logs", "stranded"]).await;
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("ImpVM {ns}/stranded"))
            && err.contains(&format!("the node agent of {gone}"))
            && err.contains(&format!("Connecting to the node agent at {closed} failed")),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
