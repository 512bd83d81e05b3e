//! The Helm chart (`charts/imp`) as users install it, with the Helm v4 `scripts/kube/build`
//! builds, against the real control plane:
//!
//! - `helm lint --strict`;
//! - `helm template` with the default values and with each documented toggle, every output
//!   checked for what matters (the names the troubleshooting guide uses, the agent's host
//!   namespaces, privileges, mounts and limits, the webhook wiring, the RBAC rules being the
//!   files' own) and created on the real server with `--dry-run=server --validate=strict`, so
//!   every object and every field is accepted as written;
//! - `helm install`, `helm upgrade` with a changed value, an ImpVM, `helm uninstall` (the CRDs
//!   and the ImpVM stay) and a reinstall that adopts the kept CRDs, under the same release and
//!   under another one;
//! - a CRD changed by a newer chart is updated by `helm upgrade` (they are templates, not
//!   `crds/`);
//! - tokens of the installed ServiceAccounts have exactly the rights of their roles.
//!
//! The chart's object names are cluster-wide (ClusterRoles, webhook configurations, CRDs), so
//! each install test starts a control plane of its own; the template checks share one and
//! only create with `--dry-run=server`. Without helm or the control plane the tests skip on
//! a developer machine and fail under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use imp_testenv::{ControlPlane, Options};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{Value, json};

/// The chart, in the checkout.
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../charts/imp");

/// The namespace the docs install into.
const NS: &str = "imp-system";

/// The kinds the CRD file defines.
const CRD_COUNT: usize = 10;

// ---- Running helm and kubectl ----

/// A scratch directory of its own (Helm's cache, config and data; a copy of the chart),
/// removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "imp-chart-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Helm, with homes of its own and optionally a cluster.
struct Helm {
    bin: PathBuf,
    home: Scratch,
    kubeconfig: Option<PathBuf>,
}

impl Helm {
    /// Helm for `kubeconfig` (none: template and lint only), or `None` when it is not built
    /// (the test skips; under CI=true it fails).
    fn new(kubeconfig: Option<&Path>) -> Option<Helm> {
        let bin = imp_testenv::controlplane::helm();
        let missing = bin.as_ref().err().map(|e| e.to_string());
        if !imp_testenv::guard::require(bin.is_ok(), &missing.unwrap_or_default()) {
            return None;
        }
        Some(Helm {
            bin: bin.unwrap(),
            home: Scratch::new("helm"),
            kubeconfig: kubeconfig.map(Path::to_path_buf),
        })
    }

    /// Runs helm with `args` and returns what it did.
    fn run(&self, args: &[&str]) -> Output {
        let mut c = Command::new(&self.bin);
        c.args(args)
            .env("HELM_CACHE_HOME", self.home.0.join("cache"))
            .env("HELM_CONFIG_HOME", self.home.0.join("config"))
            .env("HELM_DATA_HOME", self.home.0.join("data"))
            .env_remove("KUBECONFIG");
        if let Some(kc) = &self.kubeconfig {
            c.arg("--kubeconfig").arg(kc);
        }
        let t0 = Instant::now();
        let out = c.output().unwrap();
        eprintln!(
            "helm {} ({:.1} s)",
            args.first().copied().unwrap_or_default(),
            t0.elapsed().as_secs_f64()
        );
        out
    }

    /// Runs helm with `args`; its standard output, or a panic showing what it said.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "helm {args:?} failed: {}", said(&out));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs helm with `args`, which must fail; what it said.
    fn refused(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            !out.status.success(),
            "helm {args:?} succeeded: {}",
            said(&out)
        );
        said(&out)
    }
}

/// Both outputs of a command, for a message.
fn said(out: &Output) -> String {
    format!(
        "{}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// kubectl against `cp` as `kubeconfig` (none: the admin), with `stdin` on its input.
fn kubectl(cp: &ControlPlane, kubeconfig: Option<&Path>, args: &[&str], stdin: &str) -> Output {
    let mut c = cp.kubectl().unwrap();
    if let Some(kc) = kubeconfig {
        c.env("KUBECONFIG", kc);
    }
    let mut child = c
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// Waits until `check` holds, polling; panics naming `what` after a minute.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let t0 = Instant::now();
    while !check().await {
        assert!(t0.elapsed() < Duration::from_secs(60), "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---- Reading rendered manifests ----

/// The objects of a multi-document YAML stream (empty documents dropped).
fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// The rendered chart for release `imp` in `namespace`, with `args` added (`--set …`).
fn render(helm: &Helm, namespace: &str, args: &[&str]) -> (String, Vec<Value>) {
    let mut all = vec!["template", "imp", CHART, "--namespace", namespace];
    all.extend_from_slice(args);
    let yaml = helm.ok(&all);
    let objs = objects(&yaml);
    (yaml, objs)
}

/// The objects of `kind`.
fn of_kind<'a>(objs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objs.iter().filter(|o| o["kind"] == kind).collect()
}

/// The object of `kind` named `name`, or a panic listing what there is.
fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let have: Vec<String> = objs
                .iter()
                .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
                .collect();
            panic!("no {kind} {name} in the rendered chart; it has {have:?}")
        })
}

/// Whether an object of `kind` named `name` is there.
fn has(objs: &[Value], kind: &str, name: &str) -> bool {
    objs.iter()
        .any(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

/// The container `name` of a workload's Pod template.
fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name} in {}", workload["metadata"]["name"]))
}

/// A container's arguments.
fn args(c: &Value) -> Vec<&str> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect()
}

/// A container's environment variable `name` (its whole entry).
fn env<'a>(c: &'a Value, name: &str) -> &'a Value {
    c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("no env {name} in container {}", c["name"]))
}

/// The host path mounted at `mount_path` in `container` of `workload`, if any.
fn host_path_at<'a>(workload: &'a Value, c: &Value, mount_path: &str) -> Option<&'a str> {
    let mount = c["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["mountPath"] == mount_path)?;
    workload["spec"]["template"]["spec"]["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])?["hostPath"]["path"]
        .as_str()
}

/// Every container of every workload in `objs`.
fn all_containers(objs: &[Value]) -> Vec<&Value> {
    objs.iter()
        .filter_map(|o| o["spec"]["template"]["spec"]["containers"].as_array())
        .flatten()
        .collect()
}

// ---- The real server's verdict ----

/// Creates `yaml` on the shared server with `--dry-run=server --validate=strict`: every object
/// is admitted and every field known, or the test fails with the server's words. A warning
/// fails it too. Every namespaced object names its namespace (the release's, and kube-system
/// for the gateway's RoleBinding), as Helm sends them.
fn server_accepts(cp: &ControlPlane, yaml: &str, what: &str) {
    let out = kubectl(
        cp,
        None,
        &["create", "--dry-run=server", "--validate=strict", "-f", "-"],
        yaml,
    );
    assert!(
        out.status.success(),
        "the server refused the chart rendered with {what}: {}",
        said(&out)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("Warning"),
        "the server warned about the chart rendered with {what}:\n{stderr}"
    );
    let created = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(
        created,
        objects(yaml).len(),
        "{what}: one line per object created (dry run):\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Stand-ins for the cert-manager and Prometheus operator CRDs the toggles need (their
/// projects' CRDs are not part of this checkout): each declares only the fields the chart
/// writes, with the types of cert-manager.io/v1 and monitoring.coreos.com/v1, and no
/// `x-kubernetes-preserve-unknown-fields`, so a misspelt or misplaced field is refused.
fn stand_in_crds() -> Vec<CustomResourceDefinition> {
    let s = || json!({"type": "string"});
    let labels = || json!({"type": "object", "additionalProperties": {"type": "string"}});
    let selector = || json!({"type": "object", "properties": {"matchLabels": labels()}});
    let namespaces = || {
        json!({"type": "object", "properties": {
            "matchNames": {"type": "array", "items": s()}, "any": {"type": "boolean"}}})
    };
    let endpoints = |token_file: bool| {
        let mut fields = json!({"port": s(), "path": s(), "interval": s()});
        // A ServiceMonitor endpoint's bearerTokenFile (a PodMonitor's has none).
        if token_file {
            fields["bearerTokenFile"] = s();
        }
        json!({"type": "array", "items": {"type": "object", "properties": fields}})
    };
    let crd = |group: &str, kind: &str, plural: &str, spec: Value| {
        serde_json::from_value::<CustomResourceDefinition>(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": format!("{plural}.{group}")},
            "spec": {
                "group": group,
                "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase()},
                "scope": "Namespaced",
                "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "spec": spec}}}}],
            },
        }))
        .unwrap()
    };
    vec![
        crd(
            "cert-manager.io",
            "Issuer",
            "issuers",
            json!({"type": "object", "properties": {"selfSigned": {"type": "object",
                "properties": {"crlDistributionPoints": {"type": "array", "items": s()}}}}}),
        ),
        crd(
            "cert-manager.io",
            "Certificate",
            "certificates",
            json!({"type": "object", "required": ["secretName", "issuerRef"], "properties": {
                "secretName": s(),
                "dnsNames": {"type": "array", "items": s()},
                "privateKey": {"type": "object", "properties": {
                    "algorithm": {"type": "string", "enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "rotationPolicy": {"type": "string", "enum": ["Never", "Always"]}}},
                "issuerRef": {"type": "object", "required": ["name"], "properties": {
                    "name": s(), "kind": s(), "group": s()}}}}),
        ),
        crd(
            "monitoring.coreos.com",
            "ServiceMonitor",
            "servicemonitors",
            json!({"type": "object", "properties": {
                "selector": selector(), "namespaceSelector": namespaces(),
                "endpoints": endpoints(true)}}),
        ),
        crd(
            "monitoring.coreos.com",
            "PodMonitor",
            "podmonitors",
            json!({"type": "object", "properties": {
                "selector": selector(), "namespaceSelector": namespaces(),
                "podMetricsEndpoints": endpoints(false)}}),
        ),
        crd(
            "monitoring.coreos.com",
            "PrometheusRule",
            "prometheusrules",
            json!({"type": "object", "properties": {"groups": {"type": "array", "items": {
                "type": "object", "required": ["name"], "properties": {
                    "name": s(), "interval": s(),
                    "rules": {"type": "array", "items": {"type": "object",
                        "required": ["expr"], "properties": {
                            "alert": s(), "record": s(), "expr": s(), "for": s(),
                            "labels": labels(), "annotations": labels()}}}}}}}}),
        ),
    ]
}

// ---- What the rendered chart must say ----

/// The operator: the Deployment and container the troubleshooting guide names, leader
/// election, probes, ports, a locked-down container, a PodDisruptionBudget with 2 replicas.
fn check_operator(objs: &[Value]) {
    let deploy = find(objs, "Deployment", "imp-controller-manager");
    assert_eq!(deploy["metadata"]["namespace"], NS);
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "imp-operator");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let c = container(deploy, "manager");
    // A replica being replaced serves on until its endpoint is gone, within the grace period.
    assert_eq!(c["lifecycle"]["preStop"]["sleep"]["seconds"], 5);
    assert_eq!(pod["terminationGracePeriodSeconds"], 35);
    let a = args(c);
    assert_eq!(a[0], "operator");
    for flag in [
        "--leader-elect",
        "--lease-namespace=$(POD_NAMESPACE)",
        "--metrics-addr=0.0.0.0:8080",
        "--webhook-addr=0.0.0.0:9443",
        "--webhook-secret=imp-webhook-tls",
        "--webhook-service=imp-webhook",
        "--namespace=$(POD_NAMESPACE)",
        "--reservation-image=registry.k8s.io/pause:3.10",
        "--reservation-priority-class=imp-vm-reservation",
        // Only the agents' own Leases, with their deadline (docs/node-loss.md).
        "--agent-namespace=$(POD_NAMESPACE)",
        "--agent-fence-after=30s",
    ] {
        assert!(a.contains(&flag), "operator args {a:?} lack {flag}");
    }
    // Reservation Pods' priority: nothing preempts a VM's share, and it preempts nothing.
    let pc = find(objs, "PriorityClass", "imp-vm-reservation");
    assert_eq!(pc["value"], 1_000_000_000);
    assert_eq!(pc["preemptionPolicy"], "Never");
    assert_eq!(pc["globalDefault"], false);
    assert_eq!(
        env(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        env(c, "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let ports: Vec<(&str, u64)> = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["containerPort"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(ports, [("metrics", 8080), ("webhook", 9443)]);
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert!(sc["capabilities"]["add"].is_null());
    let pdb = find(objs, "PodDisruptionBudget", "imp-controller-manager");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    let metrics = find(objs, "Service", "imp-operator-metrics");
    assert_eq!(metrics["spec"]["ports"][0]["port"], 8080);
}

/// The agent: the DaemonSet and container the guide names, on labelled nodes, in the host's
/// network and PID namespaces, not privileged, with the capabilities docs/install.md lists,
/// the host mounts VMs survive a restart in, a limit for the agent alone, and probes on its
/// metrics port.
fn check_agent(objs: &[Value]) {
    let ds = find(objs, "DaemonSet", "imp-agent");
    assert_eq!(ds["metadata"]["namespace"], NS);
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "imp-agent");
    assert_eq!(pod["nodeSelector"], json!({"imp/enabled": "true"}));
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["hostPID"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() >= 30);
    let update = &ds["spec"]["updateStrategy"];
    assert_eq!(update["type"], "RollingUpdate");
    assert_eq!(update["rollingUpdate"]["maxUnavailable"], 1);
    check_agent_container(container(ds, "agent"));
    check_agent_privileges(ds);
    check_agent_mounts(ds);
}

/// The agent's flags, environment, probes and resources.
fn check_agent_container(c: &Value) {
    let a = args(c);
    assert_eq!(a[0], "agent");
    for flag in [
        "--metrics-addr=0.0.0.0:9090",
        "--cgroup-parent=imp",
        "--state-dir=/var/lib/imp/agent",
        "--vmm-uid-dir=/var/lib/imp/vmm-uids",
        "--image-cache=/var/cache/imp",
        // 20 GiB, written as an integer (Helm would print a float as 2.147483648e+10).
        "--image-cache-max-bytes=21474836480",
        "--fence-after=30s",
        "--gateway-configmap=$(POD_NAMESPACE)/imp-gateway-client",
        // The directories node-local snapshots may name: those the chart mounts.
        "--snapshot-root=/var/lib/imp/snapshots",
    ] {
        assert!(a.contains(&flag), "agent args {a:?} lack {flag}");
    }
    // Firecracker runs only under its jailer unless agent.firecracker.allowUnjailed says so.
    assert!(
        !a.contains(&"--allow-unjailed-firecracker"),
        "agent args {a:?} allow an unjailed Firecracker by default"
    );
    let field = |name| env(c, name)["valueFrom"]["fieldRef"]["fieldPath"].clone();
    assert_eq!(field("NODE_NAME"), "spec.nodeName");
    assert_eq!(field("NODE_IP"), "status.hostIP");
    // The agent's Lease lives in the release namespace (its Role's).
    assert_eq!(field("POD_NAMESPACE"), "metadata.namespace");
    for (name, value) in [
        ("FC_BIN", "/usr/local/bin/firecracker"),
        ("FC_KERNEL", "/opt/imp/guest/vmlinux"),
        ("IMP_GUEST", "/opt/imp/guest/imp-guest"),
        ("IMP_RUNTIME", "auto"),
        ("RUST_LOG", "info"),
    ] {
        assert_eq!(env(c, name)["value"], value, "{name}");
    }
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(c[probe]["httpGet"]["port"], "metrics", "{probe}");
    }
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let ports = c["ports"].as_array().unwrap();
    let metrics = ports.iter().find(|p| p["name"] == "metrics").unwrap();
    assert_eq!(metrics["containerPort"], 9090, "as --metrics-addr");
    assert_eq!(c["resources"]["limits"]["memory"], "512Mi");
    assert_eq!(c["resources"]["requests"]["memory"], "64Mi");
}

/// The capabilities docs/install.md's "Privileges" table explains, one per row.
fn documented_capabilities() -> Vec<String> {
    let doc = Path::new(CHART).join("../../docs/install.md");
    let text = std::fs::read_to_string(doc).unwrap();
    let section = text.split("## Privileges").nth(1).unwrap();
    let mut caps: Vec<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split(" |").next())
        .flat_map(|cell| cell.split(", ").map(|c| c.trim_matches('`').to_owned()))
        .filter(|c| !c.is_empty() && c.chars().all(|ch| ch.is_ascii_uppercase() || ch == '_'))
        .collect();
    caps.sort();
    caps
}

/// Not privileged: every capability dropped, then exactly those the docs explain added; the
/// runtime's default AppArmor profile (which refuses mount) replaced by Unconfined.
fn check_agent_privileges(ds: &Value) {
    let pod = &ds["spec"]["template"]["spec"];
    let profile = &pod["securityContext"]["appArmorProfile"];
    assert_eq!(profile["type"], "Unconfined");
    let sc = &container(ds, "agent")["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    let mut added: Vec<String> = sc["capabilities"]["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect();
    added.sort();
    assert_eq!(
        added,
        documented_capabilities(),
        "the agent's capabilities and docs/install.md's table"
    );
    for cap in ["SYS_MODULE", "SYS_RAWIO", "SYS_BOOT", "SYS_TIME", "ALL"] {
        assert!(!added.iter().any(|a| a == cap), "{cap} added: {added:?}");
    }
}

/// The host paths VMs survive an agent restart in, at the same paths inside, none propagating.
fn check_agent_mounts(ds: &Value) {
    let c = container(ds, "agent");
    for path in [
        "/dev/kvm",
        "/dev/net/tun",
        "/sys/fs/cgroup",
        "/var/lib/imp/agent",
        "/var/lib/imp/vmm-uids",
        "/var/cache/imp",
        "/var/lib/imp/snapshots",
    ] {
        assert_eq!(host_path_at(ds, c, path), Some(path), "{path}");
    }
    for m in c["volumeMounts"].as_array().unwrap() {
        assert!(
            m["mountPropagation"].is_null(),
            "the agent mounts nothing the host must see: {m}"
        );
    }
}

/// The webhook: a Service on 443 to the operator's webhook port, and both configurations
/// calling it at the paths the operator serves, with the operations it judges.
fn check_webhook(objs: &[Value]) {
    let svc = find(objs, "Service", "imp-webhook");
    assert_eq!(svc["spec"]["ports"][0]["port"], 443);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "webhook");
    let deploy = find(objs, "Deployment", "imp-controller-manager");
    assert_eq!(
        svc["spec"]["selector"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    for (kind, name, path, ops, resources) in [
        (
            "ValidatingWebhookConfiguration",
            "imp-validating-webhook",
            "/validate",
            json!(["CREATE", "UPDATE"]),
            json!(["*"]),
        ),
        (
            "MutatingWebhookConfiguration",
            "imp-mutating-webhook",
            "/mutate",
            json!(["CREATE"]),
            json!(["impvms"]),
        ),
    ] {
        let hook = &find(objs, kind, name)["webhooks"][0];
        let svc_ref = &hook["clientConfig"]["service"];
        assert_eq!(svc_ref["name"], "imp-webhook", "{name}");
        assert_eq!(svc_ref["namespace"], NS, "{name}");
        assert_eq!(svc_ref["path"], path, "{name}");
        assert!(
            hook["clientConfig"]["caBundle"].is_null(),
            "{name}: the operator fills caBundle"
        );
        assert_eq!(hook["rules"][0]["apiGroups"], json!(["imp.dev"]), "{name}");
        assert_eq!(hook["rules"][0]["operations"], ops, "{name}");
        assert_eq!(hook["rules"][0]["resources"], resources, "{name}");
        assert_eq!(hook["failurePolicy"], "Fail", "{name}");
        assert_eq!(hook["sideEffects"], "None", "{name}");
    }
}

/// The CRDs: all ten, each kept by `helm uninstall`.
fn check_crds(objs: &[Value]) {
    let crds = of_kind(objs, "CustomResourceDefinition");
    assert_eq!(crds.len(), CRD_COUNT);
    for crd in crds {
        assert_eq!(
            crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep",
            "{}",
            crd["metadata"]["name"]
        );
    }
}

/// The roles of `files/rbac/<file>`, as plain YAML documents.
fn file_roles(file: &str) -> Vec<Value> {
    let path = Path::new(CHART).join("files/rbac").join(file);
    objects(&std::fs::read_to_string(path).unwrap())
}

/// RBAC: each role of the component files is rendered with the file's rules unchanged and
/// bound to its component's ServiceAccount (a ClusterRole cluster-wide, a Role in the release
/// namespace); the people's roles are rendered and bound by nobody.
fn check_rbac(objs: &[Value]) {
    for (file, sa) in [
        ("operator.yaml", "imp-operator"),
        ("agent.yaml", "imp-agent"),
    ] {
        let account = find(objs, "ServiceAccount", sa);
        assert_eq!(account["metadata"]["namespace"], NS);
        for role in file_roles(file) {
            let kind = role["kind"].as_str().unwrap();
            let name = role["metadata"]["name"].as_str().unwrap();
            let rendered = find(objs, kind, name);
            assert_eq!(rendered["rules"], role["rules"], "{kind} {name} of {file}");
            let binding = find(objs, &format!("{kind}Binding"), name);
            assert_eq!(binding["roleRef"]["kind"], kind);
            assert_eq!(binding["roleRef"]["name"], name);
            assert_eq!(
                binding["subjects"],
                json!([{"kind": "ServiceAccount", "name": sa, "namespace": NS}])
            );
            if kind == "Role" {
                assert_eq!(rendered["metadata"]["namespace"], NS);
                assert_eq!(binding["metadata"]["namespace"], NS);
            }
        }
    }
    for role in file_roles("users.yaml") {
        let name = role["metadata"]["name"].as_str().unwrap();
        let rendered = find(objs, "ClusterRole", name);
        assert_eq!(rendered["rules"], role["rules"], "{name}");
        for (k, v) in role["metadata"]["labels"].as_object().unwrap() {
            assert_eq!(&rendered["metadata"]["labels"][k], v, "{name}: label {k}");
        }
        assert!(!has(objs, "ClusterRoleBinding", name), "{name} is bound");
    }
    let names: Vec<&str> = of_kind(objs, "ClusterRole")
        .iter()
        .map(|r| r["metadata"]["name"].as_str().unwrap())
        .collect();
    for want in [
        "imp-operator",
        "imp-agent",
        "imp-view",
        "imp-edit",
        "imp-admin",
        "imp-cli",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
}

/// The admission policies: `files/policy/agent.yaml` and `files/policy/operator.yaml`
/// rendered as written, with the release namespace in place of `${RELEASE_NAMESPACE}`
/// (matching the release's own ServiceAccounts) and the reservation image in place of
/// `${RESERVATION_IMAGE}`, and bound with `Deny`.
fn check_policies(objs: &[Value]) {
    let path = Path::new(CHART).join("files/policy/agent.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("${RELEASE_NAMESPACE}"), "{}", path.display());
    let file = objects(&text.replace("${RELEASE_NAMESPACE}", NS));
    let policy = find(objs, "ValidatingAdmissionPolicy", "imp-agent-own-node");
    assert_eq!(policy["spec"], file[0]["spec"]);
    assert_eq!(
        policy["spec"]["matchConditions"][0]["expression"],
        format!("request.userInfo.username == 'system:serviceaccount:{NS}:imp-agent'")
    );
    assert_eq!(
        policy["metadata"]["labels"]["app.kubernetes.io/component"],
        "agent"
    );
    let binding = find(
        objs,
        "ValidatingAdmissionPolicyBinding",
        "imp-agent-own-node",
    );
    assert_eq!(binding["spec"]["policyName"], "imp-agent-own-node");
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    // The operator's: its Pods only reservation Pods of the chart's image.
    let path = Path::new(CHART).join("files/policy/operator.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let file = objects(
        &text
            .replace("${RELEASE_NAMESPACE}", NS)
            .replace("${RESERVATION_IMAGE}", "registry.k8s.io/pause:3.10"),
    );
    let policy = find(
        objs,
        "ValidatingAdmissionPolicy",
        "imp-operator-reservation-pods",
    );
    assert_eq!(policy["spec"], file[0]["spec"]);
    assert_eq!(
        policy["spec"]["matchConditions"][0]["expression"],
        format!("request.userInfo.username == 'system:serviceaccount:{NS}:imp-operator'")
    );
    assert_eq!(
        policy["metadata"]["labels"]["app.kubernetes.io/component"],
        "operator"
    );
    let binding = find(
        objs,
        "ValidatingAdmissionPolicyBinding",
        "imp-operator-reservation-pods",
    );
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    let rendered = serde_json::to_string(objs).unwrap();
    assert!(
        !rendered.contains("RELEASE_NAMESPACE") && !rendered.contains("RESERVATION_IMAGE"),
        "a placeholder is left"
    );
}

// ---- Lint and template ----

#[test]
fn the_chart_passes_helm_lint_strict() {
    let Some(helm) = Helm::new(None) else {
        return;
    };
    let out = helm.ok(&["lint", "--strict", CHART]);
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn the_charts_app_version_is_the_workspace_version() {
    let chart: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(Path::new(CHART).join("Chart.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "imp");
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
}

/// One way of rendering the chart, and what must hold of it.
struct Toggle {
    what: &'static str,
    args: &'static [&'static str],
    check: fn(&[Value]),
}

/// The PrometheusRule carries the alert file's groups unchanged (Prometheus's `{{ $labels }}`
/// templates untouched by Helm) and the labels asked for.
fn check_prometheus_rule(objs: &[Value]) {
    let rule = find(objs, "PrometheusRule", "imp");
    assert_eq!(rule["metadata"]["namespace"], NS);
    assert_eq!(
        rule["metadata"]["labels"]["release"], "kube-prometheus-stack",
        "monitoring.prometheusRule.labels"
    );
    let file = Path::new(CHART).join("files/alerts/imp.rules.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    let want: Value = serde_yaml_ng::from_str(&text).unwrap();
    assert_eq!(
        rule["spec"],
        want,
        "the PrometheusRule differs from {}",
        file.display()
    );
    let annotation = &rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"];
    assert!(
        annotation
            .as_str()
            .unwrap()
            .contains("{{ $labels.instance }}"),
        "{annotation}"
    );
}

/// The dashboard's ConfigMap: the sidecar's label, and the JSON file as it is.
fn check_grafana_dashboard(objs: &[Value]) {
    let cm = find(objs, "ConfigMap", "imp-grafana-dashboard");
    assert_eq!(cm["metadata"]["namespace"], NS);
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let file = Path::new(CHART).join("files/grafana/imp.json");
    let want: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let got: Value = serde_json::from_str(cm["data"]["imp.json"].as_str().unwrap()).unwrap();
    assert_eq!(
        got,
        want,
        "the ConfigMap's imp.json differs from {}",
        file.display()
    );
}

/// The gateway: its APIService names the operator's listener (Service imp-webhook, port 443)
/// with no CA of its own (the operator publishes it), and the operator may read the API
/// server's request-header settings in kube-system.
fn check_gateway(objs: &[Value]) {
    let svc = find(objs, "APIService", "v1alpha1.subresources.imp.dev");
    assert_eq!(svc["spec"]["group"], "subresources.imp.dev");
    assert_eq!(svc["spec"]["service"]["name"], "imp-webhook");
    assert_eq!(svc["spec"]["service"]["namespace"], NS);
    assert_eq!(svc["spec"]["service"]["port"], 443);
    assert!(svc["spec"]["caBundle"].is_null());
    assert!(svc["spec"]["insecureSkipTLSVerify"].is_null());
    let binding = find(objs, "RoleBinding", "imp-operator-auth-reader");
    assert_eq!(binding["metadata"]["namespace"], "kube-system");
    assert_eq!(
        binding["roleRef"]["name"],
        "extension-apiserver-authentication-reader"
    );
    assert_eq!(binding["subjects"][0]["name"], "imp-operator");
    assert!(has(objs, "Service", "imp-webhook"));
    let c = container(
        find(objs, "Deployment", "imp-controller-manager"),
        "manager",
    );
    assert!(args(c).contains(&"--webhook-addr=0.0.0.0:9443"));
    assert_eq!(c["ports"].as_array().unwrap().len(), 2);
}

/// Every documented toggle, each with what it must change.
const TOGGLES: &[Toggle] = &[
    Toggle {
        what: "no drain before SIGTERM",
        args: &["--set", "operator.drainSeconds=0"],
        check: |objs| {
            let deploy = find(objs, "Deployment", "imp-controller-manager");
            let c = container(deploy, "manager");
            assert!(c.get("lifecycle").is_none(), "{:?}", c["lifecycle"]);
            assert_eq!(
                deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
                30
            );
        },
    },
    Toggle {
        what: "no reservation Pods",
        args: &["--set", "operator.reservations.enabled=false"],
        check: |objs| {
            let deploy = find(objs, "Deployment", "imp-controller-manager");
            let a = args(container(deploy, "manager"));
            assert!(a.contains(&"--no-reservation-pods"), "{a:?}");
            assert!(!a.iter().any(|f| f.starts_with("--reservation-")), "{a:?}");
            assert!(of_kind(objs, "PriorityClass").is_empty());
        },
    },
    Toggle {
        what: "the default values",
        args: &[],
        check: |objs| {
            check_operator(objs);
            check_agent(objs);
            check_webhook(objs);
            check_gateway(objs);
            check_crds(objs);
            check_rbac(objs);
            check_policies(objs);
            for c in all_containers(objs) {
                assert_ne!(
                    c["securityContext"]["privileged"], true,
                    "{} is privileged by default",
                    c["name"]
                );
            }
            assert!(of_kind(objs, "Certificate").is_empty());
            assert!(of_kind(objs, "ServiceMonitor").is_empty());
            assert!(of_kind(objs, "PrometheusRule").is_empty());
            assert!(!has(objs, "ConfigMap", "imp-grafana-dashboard"));
        },
    },
    Toggle {
        what: "cert-manager",
        args: &[
            "--set",
            "webhook.certManager.enabled=true",
            "--api-versions",
            "cert-manager.io/v1",
        ],
        check: |objs| {
            let cert = find(objs, "Certificate", "imp-webhook-cert");
            let secret = cert["spec"]["secretName"].as_str().unwrap();
            assert_eq!(
                cert["spec"]["dnsNames"][0],
                format!("imp-webhook.{NS}.svc"),
                "the name the API server calls"
            );
            assert_eq!(cert["spec"]["issuerRef"]["name"], "imp-webhook-selfsigned");
            find(objs, "Issuer", "imp-webhook-selfsigned");
            for (kind, name) in [
                ("ValidatingWebhookConfiguration", "imp-validating-webhook"),
                ("MutatingWebhookConfiguration", "imp-mutating-webhook"),
            ] {
                assert_eq!(
                    find(objs, kind, name)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
                    format!("{NS}/imp-webhook-cert")
                );
            }
            let deploy = find(objs, "Deployment", "imp-controller-manager");
            let c = container(deploy, "manager");
            let a = args(c);
            assert!(
                a.contains(&"--webhook-cert=/etc/imp/webhook/tls.crt"),
                "{a:?}"
            );
            assert!(
                a.contains(&"--webhook-key=/etc/imp/webhook/tls.key"),
                "{a:?}"
            );
            assert!(
                !a.iter().any(|f| f.starts_with("--webhook-secret")),
                "{a:?}"
            );
            let volume = &deploy["spec"]["template"]["spec"]["volumes"][0];
            assert_eq!(volume["secret"]["secretName"], secret);
            assert_eq!(c["volumeMounts"][0]["mountPath"], "/etc/imp/webhook");
        },
    },
    Toggle {
        what: "cert-manager with an issuer of the cluster's",
        args: &[
            "--set",
            "webhook.certManager.enabled=true",
            "--set",
            "webhook.certManager.issuerRef.name=corp-ca",
            "--set",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "--api-versions",
            "cert-manager.io/v1",
        ],
        check: |objs| {
            let cert = find(objs, "Certificate", "imp-webhook-cert");
            assert_eq!(
                cert["spec"]["issuerRef"],
                json!({"name": "corp-ca", "kind": "ClusterIssuer"})
            );
            assert!(of_kind(objs, "Issuer").is_empty());
        },
    },
    Toggle {
        what: "monitoring where the Prometheus operator's API is served",
        args: &[
            "--set",
            "monitoring.serviceMonitor.enabled=true",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--set",
            "monitoring.prometheusRule.labels.release=kube-prometheus-stack",
            "--set",
            "monitoring.grafanaDashboard.enabled=true",
            "--set",
            "monitoring.metricsReaders[0].kind=ServiceAccount",
            "--set",
            "monitoring.metricsReaders[0].name=prometheus-k8s",
            "--set",
            "monitoring.metricsReaders[0].namespace=monitoring",
            "--api-versions",
            "monitoring.coreos.com/v1",
        ],
        check: |objs| {
            check_prometheus_rule(objs);
            check_grafana_dashboard(objs);
            // The agent answers only tokens allowed `get /metrics`: Prometheus sends its own,
            // and its ServiceAccount is bound to the reader role.
            let agent_monitor = find(objs, "ServiceMonitor", "imp-agent");
            assert_eq!(
                agent_monitor["spec"]["endpoints"][0]["bearerTokenFile"],
                "/var/run/secrets/kubernetes.io/serviceaccount/token"
            );
            let readers = find(objs, "ClusterRoleBinding", "imp-metrics-reader");
            assert_eq!(readers["roleRef"]["name"], "imp-metrics-reader");
            assert_eq!(readers["subjects"][0]["name"], "prometheus-k8s");
            let role = find(objs, "ClusterRole", "imp-metrics-reader");
            assert_eq!(role["rules"][0]["nonResourceURLs"][0], "/metrics");
            for kind in ["ServiceMonitor", "PodMonitor"] {
                for component in ["operator", "agent"] {
                    let m = find(objs, kind, &format!("imp-{component}"));
                    assert_eq!(
                        m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
                        component
                    );
                }
            }
            let agent_svc = find(objs, "Service", "imp-agent-metrics");
            assert_eq!(agent_svc["spec"]["clusterIP"], "None");
        },
    },
    Toggle {
        what: "monitoring where the Prometheus operator's API is not served",
        args: &[
            "--set",
            "monitoring.serviceMonitor.enabled=true",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--set",
            "monitoring.grafanaDashboard.enabled=true",
        ],
        check: |objs| {
            assert!(of_kind(objs, "ServiceMonitor").is_empty());
            assert!(of_kind(objs, "PodMonitor").is_empty());
            assert!(of_kind(objs, "PrometheusRule").is_empty());
            // The dashboard is a plain ConfigMap: it needs no Prometheus operator.
            check_grafana_dashboard(objs);
        },
    },
    Toggle {
        what: "the webhook off",
        args: &["--set", "webhook.enabled=false"],
        check: |objs| {
            assert!(of_kind(objs, "ValidatingWebhookConfiguration").is_empty());
            assert!(of_kind(objs, "MutatingWebhookConfiguration").is_empty());
            // The listener stays, for the gateway, and publishes no webhook's CA.
            check_gateway(objs);
            let c = container(
                find(objs, "Deployment", "imp-controller-manager"),
                "manager",
            );
            let a = args(c);
            assert!(a.contains(&"--webhook-configurations="), "{a:?}");
            assert!(!a.contains(&"--no-gateway"), "{a:?}");
        },
    },
    Toggle {
        what: "the gateway off",
        args: &["--set", "gateway.enabled=false"],
        check: |objs| {
            assert!(of_kind(objs, "APIService").is_empty());
            assert!(!has(objs, "RoleBinding", "imp-operator-auth-reader"));
            check_webhook(objs);
            let c = container(
                find(objs, "Deployment", "imp-controller-manager"),
                "manager",
            );
            let a = args(c);
            assert!(
                a.contains(&"--no-gateway") && a.contains(&"--api-services="),
                "{a:?}"
            );
        },
    },
    Toggle {
        what: "the webhook and the gateway off",
        args: &[
            "--set",
            "webhook.enabled=false",
            "--set",
            "gateway.enabled=false",
        ],
        check: |objs| {
            assert!(of_kind(objs, "ValidatingWebhookConfiguration").is_empty());
            assert!(of_kind(objs, "APIService").is_empty());
            assert!(!has(objs, "Service", "imp-webhook"));
            let c = container(
                find(objs, "Deployment", "imp-controller-manager"),
                "manager",
            );
            assert!(!args(c).iter().any(|a| a.starts_with("--webhook")));
            assert_eq!(c["ports"].as_array().unwrap().len(), 1);
        },
    },
    Toggle {
        what: "crds.install=false",
        args: &["--set", "crds.install=false"],
        check: |objs| assert!(of_kind(objs, "CustomResourceDefinition").is_empty()),
    },
    Toggle {
        what: "a privileged agent",
        args: &["--set", "agent.privileged=true"],
        check: |objs| {
            let ds = find(objs, "DaemonSet", "imp-agent");
            let sc = &container(ds, "agent")["securityContext"];
            assert_eq!(sc["privileged"], true);
            assert!(sc["capabilities"].is_null());
            assert_eq!(ds["spec"]["template"]["spec"]["hostPID"], true);
        },
    },
    Toggle {
        what: "Firecracker, the guest from the host, one operator replica, no KVM mount, JSON debug logs",
        args: &[
            "--set",
            "agent.runtime=firecracker",
            "--set",
            "agent.firecracker.bin=/opt/firecracker/firecracker",
            "--set",
            "agent.guest.hostPath=/opt/imp-guest",
            "--set",
            "operator.replicas=1",
            "--set",
            "agent.devices.kvm=false",
            "--set",
            "logJson=true",
            "--set",
            "logLevel=debug",
            "--set",
            "agent.logLevel=info\\,imp_agent=trace",
            "--set",
            "agent.stateDir=/srv/imp/state",
            "--set",
            "agent.firecracker.allowUnjailed=true",
        ],
        check: |objs| {
            let ds = find(objs, "DaemonSet", "imp-agent");
            let c = container(ds, "agent");
            assert_eq!(env(c, "IMP_RUNTIME")["value"], "firecracker");
            assert_eq!(env(c, "FC_BIN")["value"], "/opt/firecracker/firecracker");
            assert_eq!(env(c, "RUST_LOG")["value"], "info,imp_agent=trace");
            assert_eq!(
                host_path_at(ds, c, "/opt/imp/guest"),
                Some("/opt/imp-guest")
            );
            assert_eq!(host_path_at(ds, c, "/dev/kvm"), None);
            assert_eq!(
                host_path_at(ds, c, "/srv/imp/state"),
                Some("/srv/imp/state")
            );
            assert!(args(c).contains(&"--state-dir=/srv/imp/state"));
            assert!(args(c).contains(&"--allow-unjailed-firecracker"));
            assert!(args(c).contains(&"--log-json"));
            let deploy = find(objs, "Deployment", "imp-controller-manager");
            let m = container(deploy, "manager");
            assert!(args(m).contains(&"--log-json"));
            assert_eq!(env(m, "RUST_LOG")["value"], "debug");
            assert_eq!(deploy["spec"]["replicas"], 1);
            assert!(!has(objs, "PodDisruptionBudget", "imp-controller-manager"));
        },
    },
    Toggle {
        what: "images from a mirror with a pull secret",
        args: &[
            "--set",
            "operator.image.repository=mirror.local/imp-operator",
            "--set",
            "operator.image.tag=dev",
            "--set",
            "imagePullSecrets[0].name=mirror",
            "--set",
            "agent.priorityClassName=system-node-critical",
        ],
        check: |objs| {
            let deploy = find(objs, "Deployment", "imp-controller-manager");
            assert_eq!(
                container(deploy, "manager")["image"],
                "mirror.local/imp-operator:dev"
            );
            let ds = find(objs, "DaemonSet", "imp-agent");
            assert_eq!(
                container(ds, "agent")["image"],
                format!("ghcr.io/imp-dev/imp-agent:{}", env!("CARGO_PKG_VERSION")),
                "the agent's tag defaults to the appVersion"
            );
            for w in [deploy, ds] {
                assert_eq!(
                    w["spec"]["template"]["spec"]["imagePullSecrets"],
                    json!([{"name": "mirror"}])
                );
            }
            assert_eq!(
                ds["spec"]["template"]["spec"]["priorityClassName"],
                "system-node-critical"
            );
        },
    },
];

#[tokio::test]
async fn every_toggle_renders_what_it_says_and_the_server_accepts_it_strictly() {
    let Some(helm) = Helm::new(None) else {
        return;
    };
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    cp.install_crds(&admin, &stand_in_crds()).await.unwrap();
    cp.ensure_namespace(&admin, NS).await.unwrap();
    for t in TOGGLES {
        let t0 = Instant::now();
        let (yaml, objs) = render(&helm, NS, t.args);
        (t.check)(&objs);
        server_accepts(cp, &yaml, t.what);
        eprintln!(
            "{}: {} objects rendered, checked and accepted ({:.1} s)",
            t.what,
            objs.len(),
            t0.elapsed().as_secs_f64()
        );
    }
}

#[test]
fn values_the_chart_cannot_honour_are_refused_by_name() {
    let Some(helm) = Helm::new(None) else {
        return;
    };
    for (set, says) in [
        // cert-manager asked for where its API is not served.
        (
            "webhook.certManager.enabled=true",
            "webhook.certManager.enabled needs cert-manager",
        ),
        // values.schema.json: a misspelt key, a value out of its set, a wrong type.
        (
            "agent.privilegd=true",
            "additional properties 'privilegd' not allowed",
        ),
        ("agent.runtime=kvmtool", "/agent/runtime"),
        ("operator.replicas=two", "/operator/replicas"),
        ("agent.stateDir=var/lib/imp", "/agent/stateDir"),
        // Put into the operator's admission policy's CEL: image-reference characters only.
        (
            "operator.reservations.image=pause' || true || '",
            "/operator/reservations/image",
        ),
        // Below the Pod's /tmp emptyDir: unmounted under running VMs when the Pod goes.
        (
            "agent.stateDir=/tmp/imp",
            "agent.stateDir (/tmp/imp) must not be under /tmp",
        ),
        (
            "agent.snapshotPaths[0]=/tmp//snaps",
            "agent.snapshotPaths[0] (/tmp//snaps) must not be under /tmp",
        ),
    ] {
        let said = helm.refused(&["template", "imp", CHART, "--namespace", NS, "--set", set]);
        assert!(said.contains(says), "--set {set}: {said}");
    }
}

// ---- Installed on a control plane of its own ----

/// A control plane of this test's own with Helm pointed at it as the admin, or `None` to skip.
async fn cluster() -> Option<(ControlPlane, Helm)> {
    if !imp_testenv::controlplane::available(imp_testenv::Release::Newest) {
        return None;
    }
    let cp = ControlPlane::start(Options::default()).await.unwrap();
    let helm = Helm::new(Some(cp.admin_kubeconfig()))?;
    Some((cp, helm))
}

/// `helm install imp CHART -n imp-system --create-namespace` with `args` added.
fn install(helm: &Helm, chart: &str, args: &[&str]) -> String {
    let mut all = vec![
        "install",
        "imp",
        chart,
        "--namespace",
        NS,
        "--create-namespace",
    ];
    all.extend_from_slice(args);
    helm.ok(&all)
}

/// Waits until all of imp's CRDs are Established on `cp`.
async fn crds_established(cp: &ControlPlane) {
    let crds: Api<CustomResourceDefinition> = Api::all(cp.admin().await.unwrap());
    eventually("imp's CRDs are Established", || async {
        let list = crds.list(&Default::default()).await.unwrap();
        let ready = list
            .items
            .iter()
            .filter(|c| c.spec.group == "imp.dev")
            .filter(|c| {
                c.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    })
            })
            .count();
        ready == CRD_COUNT
    })
    .await;
}

/// The ImpVMs of namespace `ns`.
fn impvms(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("imp.dev", "v1alpha1", "ImpVM");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// A small valid ImpVM.
fn vm(ns: &str, name: &str, spec: Value) -> String {
    json!({
        "apiVersion": "imp.dev/v1alpha1",
        "kind": "ImpVM",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    })
    .to_string()
}

/// Creates `object` (JSON) as the admin with strict field validation; kubectl's output.
fn create_strict(cp: &ControlPlane, object: &str) -> Output {
    kubectl(
        cp,
        None,
        &["create", "--validate=strict", "-f", "-"],
        object,
    )
}

/// The webhook configurations, as kubectl names them.
const WEBHOOK_CONFIGURATIONS: [&str; 2] = [
    "validatingwebhookconfiguration/imp-validating-webhook",
    "mutatingwebhookconfiguration/imp-mutating-webhook",
];

/// kubectl as the admin, which must succeed; its standard output.
fn kubectl_ok(cp: &ControlPlane, args: &[&str]) -> String {
    let out = kubectl(cp, None, args, "");
    assert!(out.status.success(), "kubectl {args:?}: {}", said(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// `helm upgrade imp CHART -n imp-system` with `args`; its output.
fn upgrade(helm: &Helm, args: &[&str]) -> String {
    let mut all = vec!["upgrade", "imp", CHART, "--namespace", NS];
    all.extend_from_slice(args);
    helm.ok(&all)
}

/// The Deployment of the operator, if any.
async fn operator_deployment(admin: &kube::Client) -> Option<Deployment> {
    Api::<Deployment>::namespaced(admin.clone(), NS)
        .get_opt("imp-controller-manager")
        .await
        .unwrap()
}

/// Whether ImpVM `vms/first` is there.
async fn the_vm_is_there(admin: &kube::Client) -> bool {
    impvms(admin, "vms")
        .get_opt("first")
        .await
        .unwrap()
        .is_some()
}

/// `helm install` of the chart: the objects and containers the troubleshooting guide names.
async fn installed(cp: &ControlPlane, helm: &Helm, admin: &kube::Client) {
    let out = install(helm, CHART, &[]);
    assert!(out.contains("STATUS: deployed"), "{out}");
    assert!(
        out.contains("kubectl label node NODE imp/enabled=true"),
        "NOTES: {out}"
    );
    crds_established(cp).await;
    let deploy = operator_deployment(admin).await.unwrap();
    let pod = deploy.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.containers[0].name, "manager");
    let ds = Api::<DaemonSet>::namespaced(admin.clone(), NS)
        .get("imp-agent")
        .await
        .unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.containers[0].name, "agent");
}

/// The operator writes its CA into both configurations' caBundle (a JSON patch of its own);
/// an upgrade with a changed value changes the Deployment and leaves the caBundle.
async fn an_upgrade_keeps_the_operators_ca_bundle(
    cp: &ControlPlane,
    helm: &Helm,
    admin: &kube::Client,
) {
    let bundle = base64_std(cp.ca_pem());
    let patch = json!([{"op": "add", "path": "/webhooks/0/clientConfig/caBundle",
                        "value": bundle}])
    .to_string();
    for config in WEBHOOK_CONFIGURATIONS {
        let args = [
            "patch",
            config,
            "--type=json",
            "--field-manager=imp-operator",
        ];
        kubectl_ok(cp, &[&args[..], &["-p", &patch]].concat());
    }
    let out = upgrade(helm, &["--set", "operator.replicas=3"]);
    assert!(out.contains("REVISION: 2"), "{out}");
    let deploy = operator_deployment(admin).await.unwrap();
    assert_eq!(deploy.spec.unwrap().replicas, Some(3));
    for config in WEBHOOK_CONFIGURATIONS {
        let path = "jsonpath={.webhooks[0].clientConfig.caBundle}";
        let got = kubectl_ok(cp, &["get", config, "-o", path]);
        assert_eq!(
            got, bundle,
            "{config}: the upgrade kept the operator's caBundle"
        );
    }
}

/// Another upgrade drops the webhook and the gateway (so the operator's listener), and then a
/// VM is created. (No operator Pod runs here to answer the webhook, and a VM created while it
/// is registered would have the API server call its Service's name, which resolves to nothing
/// of this test.)
async fn an_upgrade_drops_the_webhook(cp: &ControlPlane, helm: &Helm, admin: &kube::Client) {
    let out = upgrade(
        helm,
        &[
            "--reuse-values",
            "--set",
            "webhook.enabled=false",
            "--set",
            "gateway.enabled=false",
        ],
    );
    assert!(out.contains("REVISION: 3"), "{out}");
    let spec = operator_deployment(admin).await.unwrap().spec.unwrap();
    assert_eq!(spec.replicas, Some(3), "--reuse-values kept the replicas");
    let flags = spec.template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap_or_default();
    assert!(
        !flags.iter().any(|a| a.starts_with("--webhook")),
        "{flags:?}"
    );
    let kinds =
        "validatingwebhookconfigurations,mutatingwebhookconfigurations,services,apiservices";
    let left = kubectl_ok(cp, &["get", kinds, "-A", "-o", "name"]);
    for gone in [
        "apiservice.apiregistration.k8s.io/v1alpha1.subresources.imp.dev",
        "validatingwebhookconfiguration.admissionregistration.k8s.io/imp-validating-webhook",
        "mutatingwebhookconfiguration.admissionregistration.k8s.io/imp-mutating-webhook",
        "service/imp-webhook",
    ] {
        assert!(!left.lines().any(|l| l == gone), "{gone} is left: {left}");
    }
    assert!(
        left.lines().any(|l| l == "service/imp-operator-metrics"),
        "{left}"
    );
    cp.ensure_namespace(admin, "vms").await.unwrap();
    let spec = json!({"classRef": {"name": "small"}, "image": "registry.local/a:1"});
    let created = create_strict(cp, &vm("vms", "first", spec));
    assert!(created.status.success(), "{}", said(&created));
}

/// Uninstall: the CRDs (helm.sh/resource-policy: keep) and so the VM stay; the rest goes.
async fn uninstall_keeps_the_crds_and_the_vm(helm: &Helm, admin: &kube::Client) {
    let out = helm.ok(&["uninstall", "imp", "--namespace", NS]);
    assert!(out.contains("kept due to the resource policy"), "{out}");
    assert!(the_vm_is_there(admin).await);
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    for crd in crd_names() {
        let kept = crds.get_opt(&crd).await.unwrap();
        assert!(kept.is_some(), "{crd} was deleted");
    }
    assert!(operator_deployment(admin).await.is_none());
    let roles = Api::<ClusterRole>::all(admin.clone());
    assert!(roles.get_opt("imp-operator").await.unwrap().is_none());
}

/// The same release adopts the kept CRDs (they still carry its ownership metadata); another
/// release (name or namespace) is refused them, naming the owner, until told to take them.
async fn a_reinstall_adopts_the_kept_crds(helm: &Helm, admin: &kube::Client) {
    let out = install(helm, CHART, &[]);
    assert!(out.contains("STATUS: deployed"), "{out}");
    assert!(the_vm_is_there(admin).await);
    helm.ok(&["uninstall", "imp", "--namespace", NS]);

    let other = [
        "install",
        "imp2",
        CHART,
        "--namespace",
        "imp-two",
        "--create-namespace",
    ];
    let refused = helm.refused(&other);
    assert!(
        refused.contains("invalid ownership metadata")
            && refused.contains("meta.helm.sh/release-name")
            && refused.contains("imp2"),
        "{refused}"
    );
    eprintln!("another release: {}", refused.trim());
    let out = helm.ok(&[&other[..], &["--take-ownership"]].concat());
    assert!(out.contains("STATUS: deployed"), "{out}");
    let crd = Api::<CustomResourceDefinition>::all(admin.clone())
        .get("impvms.imp.dev")
        .await
        .unwrap();
    let annotations = crd.metadata.annotations.unwrap_or_default();
    let owner = annotations.get("meta.helm.sh/release-name");
    assert_eq!(owner.map(String::as_str), Some("imp2"));
    assert!(the_vm_is_there(admin).await);
}

#[tokio::test]
async fn install_upgrade_uninstall_keeps_crds_and_vms_and_a_reinstall_adopts_them() {
    let Some((cp, helm)) = cluster().await else {
        return;
    };
    let t0 = Instant::now();
    let admin = cp.admin().await.unwrap();
    installed(&cp, &helm, &admin).await;
    an_upgrade_keeps_the_operators_ca_bundle(&cp, &helm, &admin).await;
    an_upgrade_drops_the_webhook(&cp, &helm, &admin).await;
    uninstall_keeps_the_crds_and_the_vm(&helm, &admin).await;
    a_reinstall_adopts_the_kept_crds(&helm, &admin).await;
    eprintln!(
        "install, upgrade, uninstall, reinstall, take-over: {:.1} s (control plane {:.1} s)",
        t0.elapsed().as_secs_f64(),
        cp.started_in().as_secs_f64()
    );
}

/// `data` in standard base64, as a caBundle holds it.
fn base64_std(data: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// The names of imp's CRDs, from the chart's CRD file.
fn crd_names() -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(CHART).join("files/crds/imp.dev.yaml")).unwrap();
    objects(&text)
        .iter()
        .map(|c| c["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Copies directory `from` into `to`, recursively.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// A copy of the chart as an older release would have it: ImpVM's schema without
/// `spec.imagePullSecrets` and with another description of `spec.image`.
fn older_chart() -> (Scratch, PathBuf) {
    let scratch = Scratch::new("older");
    let dir = scratch.0.join("imp");
    copy_dir(Path::new(CHART), &dir);
    let file = dir.join("files/crds/imp.dev.yaml");
    let mut crds = objects(&std::fs::read_to_string(&file).unwrap());
    let vm = crds
        .iter_mut()
        .find(|c| c["spec"]["names"]["kind"] == "ImpVM")
        .unwrap();
    let spec = &mut vm["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    assert!(
        spec.as_object_mut()
            .unwrap()
            .remove("imagePullSecrets")
            .is_some()
    );
    spec["image"]["description"] = json!("The image (an older release's words).");
    let mut text = String::new();
    for crd in &crds {
        text.push_str("---\n");
        text.push_str(&serde_yaml_ng::to_string(crd).unwrap());
    }
    std::fs::write(&file, text).unwrap();
    (scratch, dir)
}

#[tokio::test]
async fn helm_upgrade_updates_a_crd_an_older_chart_installed() {
    let Some((cp, helm)) = cluster().await else {
        return;
    };
    let t0 = Instant::now();
    let admin = cp.admin().await.unwrap();
    let (_scratch, older) = older_chart();
    // Without the webhook: no operator Pod runs here to answer it.
    install(
        &helm,
        older.to_str().unwrap(),
        &["--set", "webhook.enabled=false"],
    );
    crds_established(&cp).await;
    cp.ensure_namespace(&admin, "vms").await.unwrap();
    let spec = json!({"classRef": {"name": "small"}, "image": "registry.local/a:1",
                      "imagePullSecrets": [{"name": "pull"}]});
    let refused = create_strict(&cp, &vm("vms", "private", spec.clone()));
    assert!(
        !refused.status.success() && said(&refused).contains("imagePullSecrets"),
        "the older CRD knows no imagePullSecrets: {}",
        said(&refused)
    );
    eprintln!("the older CRD: {}", said(&refused).trim());

    helm.ok(&[
        "upgrade",
        "imp",
        CHART,
        "--namespace",
        NS,
        "--set",
        "webhook.enabled=false",
    ]);
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let crd = crds.get("impvms.imp.dev").await.unwrap();
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let spec_schema = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"];
    assert!(
        spec_schema["imagePullSecrets"].is_object(),
        "the field is back"
    );
    assert_ne!(
        spec_schema["image"]["description"],
        "The image (an older release's words)."
    );
    // The server serves the new schema once it has rebuilt its handler for the CRD.
    let vm_json = vm("vms", "private", spec);
    eventually("the upgraded CRD accepts spec.imagePullSecrets", || async {
        create_strict(&cp, &vm_json).status.success()
    })
    .await;
    let stored = impvms(&admin, "vms").get("private").await.unwrap();
    assert_eq!(
        stored.data["spec"]["imagePullSecrets"],
        json!([{"name": "pull"}]),
        "kept, not pruned"
    );
    eprintln!(
        "CRD upgrade: {:.1} s (control plane {:.1} s)",
        t0.elapsed().as_secs_f64(),
        cp.started_in().as_secs_f64()
    );
}

/// Whether `kubeconfig`'s user may do `verb resource` (`kubectl auth can-i`), with `extra`
/// arguments (`-n NS`, `--subresource=status`, `-A`).
/// Whether the holder of `kubeconfig` may `verb` `resource/subresource` of group
/// `subresources.imp.dev` in namespace `default`, as the API server answers a
/// SelfSubjectAccessReview.
async fn may(
    cp: &ControlPlane,
    kubeconfig: &Path,
    verb: &str,
    resource: &str,
    subresource: &str,
) -> bool {
    use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
    let client = cp.client_from(kubeconfig).await.unwrap();
    let review: SelfSubjectAccessReview = serde_json::from_value(serde_json::json!({
        "spec": {"resourceAttributes": {
            "group": "subresources.imp.dev", "resource": resource, "subresource": subresource,
            "verb": verb, "namespace": "default"}}
    }))
    .unwrap();
    let answer = Api::<SelfSubjectAccessReview>::all(client)
        .create(&kube::api::PostParams::default(), &review)
        .await
        .unwrap();
    answer.status.is_some_and(|s| s.allowed)
}

/// Whether `kubectl auth can-i` says yes, with what it said.
fn can_i(
    cp: &ControlPlane,
    kubeconfig: &Path,
    verb: &str,
    resource: &str,
    extra: &[&str],
) -> (bool, String) {
    let mut a = vec!["auth", "can-i", verb, resource];
    a.extend_from_slice(extra);
    let out = kubectl(cp, Some(kubeconfig), &a, "");
    match out.status.code() {
        Some(0) => (true, said(&out)),
        Some(1) => (false, said(&out)),
        _ => panic!("kubectl auth can-i {a:?}: {}", said(&out)),
    }
}

#[tokio::test]
async fn the_installed_service_accounts_hold_their_roles_and_no_more() {
    let Some((cp, helm)) = cluster().await else {
        return;
    };
    let t0 = Instant::now();
    install(&helm, CHART, &[]);
    let admin = cp.admin().await.unwrap();
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    for sa in ["imp-operator", "imp-agent"] {
        assert!(accounts.get_opt(sa).await.unwrap().is_some(), "{sa}");
    }
    // Tokens from the TokenRequest API for the chart's own ServiceAccounts.
    let operator = cp
        .service_account_kubeconfig(NS, "imp-operator")
        .await
        .unwrap();
    let agent = cp
        .service_account_kubeconfig(NS, "imp-agent")
        .await
        .unwrap();
    let all = ["-A"];
    let here = ["-n", NS];
    let elsewhere = ["-n", "default"];
    let status = ["-A", "--subresource=status"];
    let exec = ["-A", "--subresource=exec"];

    let yes: &[(&Path, &str, &str, &[&str])] = &[
        (&operator, "list", "nodes", &[]),
        (&operator, "watch", "impvms.imp.dev", &all),
        (&operator, "patch", "impvms.imp.dev", &all),
        (&operator, "delete", "impvms.imp.dev", &all),
        (&operator, "patch", "impvms.imp.dev", &status),
        (&operator, "patch", "impnetworks.imp.dev", &status),
        // Warm pools' members (warmpool/mod.rs): made and deleted, never updated.
        (&operator, "create", "impvms.imp.dev", &all),
        (&operator, "watch", "impwarmpools.imp.dev", &all),
        (&operator, "patch", "impwarmpools.imp.dev", &status),
        (&operator, "get", "impvmclasses.imp.dev", &[]),
        (&operator, "create", "events.events.k8s.io", &all),
        (&operator, "create", "leases.coordination.k8s.io", &here),
        // The agents' Leases, in the release namespace only (docs/node-loss.md).
        (&operator, "watch", "leases.coordination.k8s.io", &here),
        (
            &operator,
            "update",
            "leases.coordination.k8s.io/imp-operator",
            &here,
        ),
        // Reservation Pods (docs/capacity.md): made, removed, and handed to a warm pool's
        // claimant (the policy admits no other change).
        (&operator, "watch", "pods", &all),
        (&operator, "patch", "pods", &all),
        (&operator, "create", "pods", &elsewhere),
        (&operator, "delete", "pods", &elsewhere),
        (&agent, "patch", "nodes", &[]),
        // Its own Lease (node/fence.rs), in the install namespace only.
        (&agent, "create", "leases.coordination.k8s.io", &here),
        (&agent, "patch", "leases.coordination.k8s.io", &here),
        (&agent, "list", "impvms.imp.dev", &all),
        (&agent, "watch", "impvms.imp.dev", &all),
        (&agent, "patch", "impvms.imp.dev", &status),
        (&agent, "get", "impnetworks.imp.dev", &all),
        (&agent, "get", "configmaps/imp-gateway-client", &here),
        // A scraper's token on /metrics (node/metrics_auth.rs); a user's credential of exec
        // or console never reaches a node (agent_api_e2e).
        (&agent, "create", "tokenreviews.authentication.k8s.io", &[]),
        (
            &agent,
            "create",
            "subjectaccessreviews.authorization.k8s.io",
            &[],
        ),
        // The API server's endpoints, kept from guests (docs/networking.md).
        (
            &agent,
            "get",
            "endpointslices.discovery.k8s.io/kubernetes",
            &["-n", "default"],
        ),
        // The operator reads them for the agents (never lists or watches them).
        (&operator, "get", "secrets", &elsewhere),
        (&operator, "get", "configmaps", &elsewhere),
        (&operator, "get", "configmaps/imp-gateway-client", &here),
        (&operator, "update", "configmaps/imp-gateway-client", &here),
        (&operator, "create", "configmaps", &here),
        (
            &operator,
            "patch",
            "apiservices.apiregistration.k8s.io/v1alpha1.subresources.imp.dev",
            &[],
        ),
        (
            &operator,
            "get",
            "configmaps/extension-apiserver-authentication",
            &["-n", "kube-system"],
        ),
    ];
    let no: &[(&Path, &str, &str, &[&str])] = &[
        (&operator, "update", "impvms.imp.dev", &all),
        (&operator, "patch", "impwarmpools.imp.dev", &all),
        (&operator, "patch", "impvmrunnerpools.imp.dev", &all),
        (&operator, "delete", "nodes", &[]),
        (&operator, "list", "secrets", &elsewhere),
        (&operator, "watch", "secrets", &all),
        (&operator, "list", "secrets", &here),
        (&operator, "update", "secrets/someone-elses", &here),
        (
            &operator,
            "patch",
            "validatingwebhookconfigurations/someone-elses",
            &[],
        ),
        (&operator, "list", "validatingwebhookconfigurations", &[]),
        (&operator, "update", "pods", &all),
        (&operator, "create", "pods", &exec),
        (
            &operator,
            "update",
            "leases.coordination.k8s.io/someone-else",
            &here,
        ),
        (&operator, "list", "leases.coordination.k8s.io", &elsewhere),
        (&operator, "watch", "leases.coordination.k8s.io", &all),
        (&agent, "delete", "impvms.imp.dev", &all),
        (&agent, "create", "impvms.imp.dev", &all),
        (&agent, "update", "impvms.imp.dev", &all),
        (&agent, "get", "impvms.imp.dev", &all),
        // No Secret and no ConfigMap but the gateway's, anywhere: not the webhook's key.
        (&agent, "get", "secrets", &elsewhere),
        (&agent, "get", "secrets/imp-webhook-tls", &here),
        (&agent, "get", "configmaps", &elsewhere),
        (&agent, "get", "configmaps/someone-elses", &here),
        (&agent, "list", "secrets", &elsewhere),
        (&agent, "watch", "secrets", &elsewhere),
        (&agent, "get", "nodes", &[]),
        (&agent, "list", "nodes", &[]),
        (&agent, "get", "impvmclasses.imp.dev", &[]),
        (&agent, "create", "leases.coordination.k8s.io", &elsewhere),
        (&agent, "patch", "leases.coordination.k8s.io", &elsewhere),
        (&agent, "update", "leases.coordination.k8s.io", &here),
        (&agent, "create", "pods", &here),
        (&agent, "update", "configmaps/imp-gateway-client", &here),
        (&agent, "list", "endpointslices.discovery.k8s.io", &all),
        (
            &agent,
            "get",
            "endpointslices.discovery.k8s.io/someone-elses",
            &elsewhere,
        ),
        (&operator, "list", "configmaps", &elsewhere),
        (&operator, "update", "configmaps/someone-elses", &here),
        (
            &operator,
            "patch",
            "apiservices.apiregistration.k8s.io/v1beta1.metrics.k8s.io",
            &[],
        ),
    ];
    for (kc, verb, resource, extra) in yes {
        let (may, said) = can_i(&cp, kc, verb, resource, extra);
        assert!(
            may,
            "{} may not {verb} {resource} {extra:?}: {said}",
            kc.display()
        );
    }
    for (kc, verb, resource, extra) in no {
        let (may, said) = can_i(&cp, kc, verb, resource, extra);
        assert!(
            !may,
            "{} may {verb} {resource} {extra:?}: {said}",
            kc.display()
        );
    }
    // A VM's Secrets and ConfigMaps only through the gateway, which answers for the caller's
    // node's VMs only (docs/security.md): asked of the API server directly, since kubectl
    // cannot name a resource of an aggregated API that nobody serves here.
    for resource in ["impvms", "impvmsnapshots"] {
        assert!(
            may(&cp, &agent, "get", resource, "inputs").await,
            "the agent may not get {resource}/inputs"
        );
        assert!(
            !may(&cp, &operator, "get", resource, "inputs").await,
            "the operator may get {resource}/inputs"
        );
    }
    // What each may do, as the server lists it (printed for the record).
    for (who, kc) in [("imp-operator", &operator), ("imp-agent", &agent)] {
        let out = kubectl(&cp, Some(kc), &["auth", "can-i", "--list", "-n", NS], "");
        assert!(out.status.success(), "{}", said(&out));
        let list = String::from_utf8_lossy(&out.stdout);
        assert!(list.contains("impvms.imp.dev"), "{who}: {list}");
        eprintln!("{who} in {NS}:\n{list}");
    }
    eprintln!(
        "ServiceAccount rights: {} checks, {:.1} s (control plane {:.1} s)",
        yes.len() + no.len(),
        t0.elapsed().as_secs_f64(),
        cp.started_in().as_secs_f64()
    );
}
