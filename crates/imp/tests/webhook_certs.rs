//! The operator keeps its webhook's certificates itself, without cert-manager: real `imp
//! operator` processes with the chart's RBAC (the ServiceAccount token of `rbac::install`: the
//! ClusterRole for the webhook configurations, the Role of `imp-system` for the Secret), against
//! a real kube-apiserver that calls the webhook by URL (`https://127.0.0.1:PORT`) through
//! configurations registered with no `caBundle`, as a chart installs them.
//!
//! - first install: from an empty `imp-system` the operator makes Secret `imp-webhook-tls`,
//!   publishes its CA in both configurations, and the server admits, defaults and denies through
//!   the webhook; a second replica started later serves the same certificate and makes nothing;
//! - two replicas starting at once make one CA between them;
//! - rotation: with a 6 s serving validity and an 18 s CA, two replicas rotate the serving
//!   certificate several times and the CA once while creates and dry-runs go through the server
//!   without a pause, and not one admission fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use imp_operator::webhook::certs::material::{Material, pem_certs};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

/// The operator's namespace (where `rbac::install` puts its Role and ServiceAccount).
const NS: &str = "imp-system";
/// The Secret, as the chart's Role names it.
const SECRET: &str = "imp-webhook-tls";
/// The configurations, as the chart's ClusterRole names them.
const VALIDATING: &str = "imp-validating-webhook";
const MUTATING: &str = "imp-mutating-webhook";
/// Where the tests create ImpVMs (the only namespace the configurations select).
const VMS: &str = "edge";
/// What the server says when the validating webhook denies.
const DENIED: &str = "admission webhook \"validate.imp.dev\" denied the request";
/// The webhook's own message for [`invalid_vm`] (the CRD schema lets that VM through).
const BACKOFF_INVERTED: &str =
    "spec.restartPolicy.backoff.initialDelay: must not exceed backoff.maxDelay (10s), got 5m";

/// A control plane of the test's own, the operators it starts, and their logs (printed if the
/// test fails).
struct Env {
    c: common::Cluster,
    dir: PathBuf,
    logs: Vec<PathBuf>,
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in &self.logs {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(80).collect();
                eprintln!("---- {} (last lines) ----", log.display());
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
    }
}

/// An `imp operator` process serving the webhook on its own loopback port.
struct Operator {
    _child: Child,
    port: u16,
    metrics_port: u16,
    log: PathBuf,
}

impl Operator {
    /// The log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `/readyz`'s status code and body, once the ops server answers.
    async fn readyz(&self) -> (u16, String) {
        let port = self.metrics_port;
        common::wait_for("the ops server", Duration::from_secs(20), || async move {
            common::http_get(port, "/readyz").await.ok()
        })
        .await
    }
}

/// A control plane with imp's CRDs and RBAC, class `small` and template `web` (expireAfter
/// 10m: only the mutating webhook copies it into a VM), or `None` when it is not built.
async fn env(tag: &str) -> Option<Env> {
    common::control_plane_ready()?;
    let c = common::cluster(&[VMS]).await;
    common::create_imp(
        &c.client,
        "ImpVMClass",
        "impvmclasses",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
               "metadata": {"name": "small"}, "spec": {"vcpu": 1, "memoryMiB": 128, "diskGiB": 1}}),
    )
    .await;
    common::create_imp(
        &c.client,
        "ImpVMTemplate",
        "impvmtemplates",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
               "metadata": {"name": "web", "namespace": VMS},
               "spec": {"classRef": {"name": "small"}, "image": "registry.local/web:1",
                        "expireAfter": "10m"}}),
    )
    .await;
    let dir = imp_testenv::registry::scratch_dir(&format!("imp-webhook-certs-{tag}")).unwrap();
    Some(Env {
        c,
        dir,
        logs: Vec::new(),
    })
}

impl Env {
    /// Starts `imp operator` (leader election on, so only one runs the controllers) in the
    /// self-managed mode, with the chart's flags and `extra`.
    fn operator(&mut self, identity: &str, extra: &[&str]) -> Operator {
        let port = common::free_port();
        let metrics_port = common::free_port();
        let log = self.dir.join(format!("operator-{identity}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_imp"))
            .arg("operator")
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--identity", identity, "--leader-elect"])
            .args(["--webhook-addr", &format!("127.0.0.1:{port}")])
            .args([
                "--webhook-secret",
                SECRET,
                "--webhook-service",
                "imp-webhook",
            ])
            .args(["--namespace", NS, "--webhook-ip", "127.0.0.1"])
            .args(extra)
            .env("KUBECONFIG", self.c.operator_kubeconfig())
            .env("RUST_LOG", common::rust_log())
            .env_remove("POD_NAMESPACE")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.logs.push(log.clone());
        Operator {
            _child: child,
            port,
            metrics_port,
            log,
        }
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.c.client.clone(), NS)
    }

    /// The Secret once it exists.
    async fn secret(&self) -> Secret {
        let api = self.secrets();
        common::wait_for("the operator's Secret", Duration::from_secs(30), || {
            let api = api.clone();
            async move { api.get_opt(SECRET).await.unwrap() }
        })
        .await
    }

    fn vms(&self) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.c.client.clone(),
            VMS,
            &ApiResource::erase::<imp_api::ImpVM>(&()),
        )
    }

    /// The `caBundle` of the validating and of the mutating configuration.
    async fn bundles(&self) -> (Vec<u8>, Vec<u8>) {
        let v = Api::<ValidatingWebhookConfiguration>::all(self.c.client.clone())
            .get(VALIDATING)
            .await
            .unwrap();
        let m = Api::<MutatingWebhookConfiguration>::all(self.c.client.clone())
            .get(MUTATING)
            .await
            .unwrap();
        let bundle = |b: Option<k8s_openapi::ByteString>| b.map(|b| b.0).unwrap_or_default();
        (
            bundle(v.webhooks.unwrap()[0].client_config.ca_bundle.clone()),
            bundle(m.webhooks.unwrap()[0].client_config.ca_bundle.clone()),
        )
    }
}

/// Registers both configurations by URL at `port`, for namespace [`VMS`], with failurePolicy
/// Fail and no `caBundle` (the operator publishes it).
async fn register(admin: &kube::Client, port: u16) {
    let hook = |name: &str, path: &str, operations: Value, resources: Value| {
        json!({
            "name": name,
            "clientConfig": {"url": format!("https://127.0.0.1:{port}{path}")},
            "rules": [{"apiGroups": ["imp.dev"], "apiVersions": ["v1alpha1"],
                       "operations": operations, "resources": resources, "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": VMS}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5,
        })
    };
    let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": VALIDATING},
        "webhooks": [hook("validate.imp.dev", "/validate", json!(["CREATE", "UPDATE"]), json!(["*"]))],
    }))
    .unwrap();
    let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": MUTATING},
        "webhooks": [hook("mutate.imp.dev", "/mutate", json!(["CREATE"]), json!(["impvms"]))],
    }))
    .unwrap();
    Api::<ValidatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &validating)
        .await
        .unwrap();
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &mutating)
        .await
        .unwrap();
}

fn vm(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                                  "metadata": {"name": name, "namespace": VMS}, "spec": spec}))
    .unwrap()
}

/// A VM only the validating webhook refuses (the schema lets it through).
fn invalid_vm() -> DynamicObject {
    vm(
        "backoff",
        json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": "persistent",
               "restartPolicy": {"backoff": {"initialDelay": "5m", "maxDelay": "10s"}}}),
    )
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

/// Accepts any server certificate: the tests look at what is served, and check trust apart.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Completes a TLS handshake with `127.0.0.1:port`, trusting only the CAs of `bundle` (any
/// certificate when `None`); returns the leaf certificate it presented.
async fn handshake(port: u16, bundle: Option<&[u8]>) -> Result<Vec<u8>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let config = match bundle {
        Some(pem) => {
            let mut roots = rustls::RootCertStore::empty();
            for der in pem_certs(pem)? {
                roots
                    .add(CertificateDer::from(der))
                    .map_err(|e| e.to_string())?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
            .with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .ok_or_else(|| "no certificate presented".to_owned())
}

/// The leaf `port` serves, once it serves one.
async fn served(port: u16) -> Vec<u8> {
    common::wait_for("the webhook to serve", Duration::from_secs(30), || async {
        handshake(port, None).await.ok()
    })
    .await
}

fn material(secret: &Secret) -> Material {
    Material::from_data(secret.data.as_ref().unwrap()).unwrap()
}

fn field(secret: &Secret, key: &str) -> Vec<u8> {
    secret.data.as_ref().unwrap()[key].0.clone()
}

/// Lines of `log` containing every one of `needles`.
fn lines_with(log: &str, needles: &[&str]) -> usize {
    log.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_install_issues_the_secret_and_the_server_admits_through_the_webhook() {
    let Some(mut e) = env("first").await else {
        return;
    };
    let secrets = e.secrets();
    assert!(secrets.get_opt(SECRET).await.unwrap().is_none());
    let a = e.operator("a", &[]);
    register(&e.c.client, a.port).await;

    // The Secret, as docs/webhook.md describes it.
    let secret = e.secret().await;
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let keys: Vec<&str> = secret
        .data
        .as_ref()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["ca.crt", "ca.key", "tls.crt", "tls.key"]);
    let m = material(&secret);
    assert_eq!(m.cas.len(), 1);
    for name in [
        "imp-webhook",
        "imp-webhook.imp-system",
        "imp-webhook.imp-system.svc",
        "imp-webhook.imp-system.svc.cluster.local",
    ] {
        assert!(
            m.serving.dns.iter().any(|d| d == name),
            "{name}: {:?}",
            m.serving.dns
        );
    }
    assert_eq!(
        m.serving.ips,
        ["127.0.0.1".parse::<std::net::IpAddr>().unwrap()]
    );
    let year = 365 * 86_400;
    assert!(
        (m.serving.not_after - m.serving.issued_at() - year).abs() <= 1,
        "a year of serving validity by default: {:?}",
        m.serving
    );
    assert!(
        (m.cas[0].not_after - m.cas[0].issued_at() - 10 * year).abs() <= 1,
        "ten years of CA validity by default: {:?}",
        m.cas[0]
    );
    let log = common::wait_for("the issue logged", Duration::from_secs(10), || async {
        let log = a.log();
        (lines_with(
            &log,
            &[
                "issued a new webhook CA",
                "imp-system/imp-webhook-tls",
                "not_after",
            ],
        ) == 1)
            .then_some(log)
    })
    .await;
    println!(
        "operator a: {}",
        log.lines().find(|l| l.contains("issued")).unwrap()
    );

    // Both configurations trust the CA of the Secret.
    let ca = field(&secret, "ca.crt");
    common::wait_for(
        "the caBundle published",
        Duration::from_secs(30),
        || async {
            let (v, m) = e.bundles().await;
            (v == ca && m == ca).then_some(())
        },
    )
    .await;
    assert_eq!(served(a.port).await, m.serving.der);

    // The server admits through the webhook: it refuses an invalid VM with the webhook's own
    // message, and stores a valid one with the mutating webhook's defaults.
    let vms = e.vms();
    let refused = common::wait_for(
        "the server to call the webhook",
        Duration::from_secs(30),
        || async {
            match vms.create(&dry_run(), &invalid_vm()).await {
                Err(kube::Error::Api(s)) if s.message.contains(DENIED) => Some(s),
                _ => None,
            }
        },
    )
    .await;
    assert_eq!(refused.code, 422, "{refused:?}");
    assert!(
        refused.message.contains(BACKOFF_INVERTED),
        "{}",
        refused.message
    );
    let created = vms
        .create(
            &PostParams::default(),
            &vm("web-1", json!({"templateRef": {"name": "web"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        created.data["spec"]["expireAfter"], "10m",
        "{:?}",
        created.data
    );

    // A second replica started against the same Secret serves the same certificate, trusted by
    // what is published, and writes nothing.
    let version = secret.metadata.resource_version.clone();
    let b = e.operator("b", &[]);
    assert_eq!(handshake_until_served(b.port, &ca).await, m.serving.der);
    let again = secrets.get(SECRET).await.unwrap();
    assert_eq!(
        again.metadata.resource_version, version,
        "the Secret was rewritten"
    );
    assert_eq!(lines_with(&b.log(), &["issued"]), 0, "{}", b.log());
    let (v, mu) = e.bundles().await;
    assert!(v == ca && mu == ca, "the caBundle changed");
}

/// The leaf `port` serves once it serves one, checked against `bundle` (the published CAs).
async fn handshake_until_served(port: u16, bundle: &[u8]) -> Vec<u8> {
    served(port).await;
    handshake(port, Some(bundle)).await.unwrap_or_else(|e| {
        panic!("the published caBundle does not trust what :{port} serves: {e}")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_starting_together_make_one_ca() {
    let Some(mut e) = env("race").await else {
        return;
    };
    let a = e.operator("a", &[]);
    let b = e.operator("b", &[]);
    register(&e.c.client, a.port).await;
    let (leaf_a, leaf_b) = tokio::join!(served(a.port), served(b.port));
    let secret = e.secret().await;
    let m = material(&secret);
    assert_eq!(m.cas.len(), 1, "{m:?}");
    assert_eq!(leaf_a, m.serving.der, "a serves the Secret's certificate");
    assert_eq!(leaf_b, m.serving.der, "b serves the Secret's certificate");
    let issued = lines_with(&a.log(), &["issued a new webhook CA"])
        + lines_with(&b.log(), &["issued a new webhook CA"]);
    assert_eq!(issued, 1, "one CA between them:\n{}\n{}", a.log(), b.log());
    let ca = field(&secret, "ca.crt");
    common::wait_for(
        "the caBundle published",
        Duration::from_secs(30),
        || async {
            let (v, m) = e.bundles().await;
            (v == ca && m == ca).then_some(())
        },
    )
    .await;
    handshake_until_served(a.port, &ca).await;
    handshake_until_served(b.port, &ca).await;
}

/// What the observer saw during the rotation test.
#[derive(Default)]
struct Seen {
    /// Every distinct leaf the registered replica served, in order.
    leaves: Vec<Vec<u8>>,
    /// Every distinct list of CAs published in the validating configuration, in order.
    bundles: Vec<Vec<Vec<u8>>>,
}

impl Seen {
    fn note<T: PartialEq>(list: &mut Vec<T>, item: T) {
        if list.last() != Some(&item) {
            list.push(item);
        }
    }

    /// Two serving rotations and a whole CA rotation: one CA, two, then the new one alone.
    fn enough(&self) -> bool {
        let first_ca = self.bundles.first().and_then(|b| b.first());
        self.leaves.len() >= 3
            && self.bundles.iter().any(|b| b.len() == 2)
            && self
                .bundles
                .last()
                .is_some_and(|b| b.len() == 1 && b.first() != first_ca)
    }
}

/// What the server answered, in one line.
fn said(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(s) => format!("{} {}", s.code, s.message),
        other => other.to_string(),
    }
}

/// Creates of valid VMs and dry-runs of an invalid one through the server, back to back until
/// `stop`; returns how many rounds ran and every admission that did not go as it should.
async fn admissions(vms: Api<DynamicObject>, stop: Arc<AtomicBool>) -> (usize, Vec<String>) {
    let mut rounds = 0;
    let mut failures = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        rounds += 1;
        let name = format!("vm-{rounds}");
        let obj = vm(&name, json!({"templateRef": {"name": "web"}}));
        match vms.create(&PostParams::default(), &obj).await {
            Ok(o) if o.data["spec"]["expireAfter"] == "10m" => {}
            Ok(o) => failures.push(format!("{name} stored without the defaults: {:?}", o.data)),
            Err(err) => failures.push(format!("creating {name}: {}", said(&err))),
        }
        // Deletes are not sent to the webhook; this only keeps the namespace small.
        let _ = vms.delete(&name, &DeleteParams::default()).await;
        match vms.create(&dry_run(), &invalid_vm()).await {
            Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains(BACKOFF_INVERTED) => {}
            Ok(_) => failures.push("the invalid VM was admitted".to_owned()),
            Err(err) => failures.push(format!("dry-run of the invalid VM: {}", said(&err))),
        }
    }
    (rounds, failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_swaps_the_certificate_with_no_admission_failing() {
    let Some(mut e) = env("rotation").await else {
        return;
    };
    let short = [
        "--webhook-cert-validity",
        "6s",
        "--webhook-ca-validity",
        "18s",
    ];
    let a = e.operator("a", &short);
    let b = e.operator("b", &short);
    register(&e.c.client, a.port).await;
    let vms = e.vms();
    common::wait_for(
        "the server to call the webhook",
        Duration::from_secs(30),
        || async {
            match vms.create(&dry_run(), &invalid_vm()).await {
                Err(kube::Error::Api(s)) if s.message.contains(DENIED) => Some(()),
                _ => None,
            }
        },
    )
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(admissions(vms.clone(), stop.clone()));
    let mut seen = Seen::default();
    let started = Instant::now();
    while !seen.enough() && started.elapsed() < Duration::from_secs(60) {
        if let Ok(leaf) = handshake(a.port, None).await {
            Seen::note(&mut seen.leaves, leaf);
        }
        let (validating, _) = e.bundles().await;
        Seen::note(&mut seen.bundles, pem_certs(&validating).unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let (rounds, failures) = load.await.unwrap();
    let summary = format!(
        "{rounds} rounds of admissions over {took:?}: {} serving certificates, caBundles of {:?} CAs",
        seen.leaves.len(),
        seen.bundles.iter().map(Vec::len).collect::<Vec<_>>()
    );
    println!("{summary}");
    assert!(
        failures.is_empty(),
        "{summary}; {} rounds failed, the first ones:\n{}",
        failures.len(),
        failures
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(seen.enough(), "no full rotation within 60 s: {summary}");
    assert!(
        rounds >= 20,
        "only {rounds} rounds: the load did not cover the rotations"
    );

    // The serving certificate really changed (serials), and the mutating configuration's
    // bundle followed the validating one.
    let serials: Vec<String> = seen
        .leaves
        .iter()
        .map(|d| {
            imp_operator::webhook::certs::material::Cert::parse(d)
                .unwrap()
                .serial
        })
        .collect();
    let mut unique = serials.clone();
    unique.dedup();
    assert_eq!(unique.len(), serials.len(), "{serials:?}");
    let secret = e.secrets().get(SECRET).await.unwrap();
    let ca = field(&secret, "ca.crt");
    common::wait_for(
        "both configurations on the new CA",
        Duration::from_secs(10),
        || async {
            let (v, m) = e.bundles().await;
            (v == ca && m == ca).then_some(())
        },
    )
    .await;
    // One line per write, naming the Secret and when the result ends.
    let logs = format!("{}{}", a.log(), b.log());
    for what in [
        "renewed the webhook serving certificate",
        "rotating the webhook CA",
        "dropped the old webhook CA",
    ] {
        assert!(
            lines_with(&logs, &[what, "imp-system/imp-webhook-tls", "not_after"]) >= 1,
            "no {what:?} line"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_its_certificate_is_not_ready_until_its_webhook_serves() {
    let Some(mut e) = env("unready").await else {
        return;
    };
    // The operator may not touch its Secret: it cannot get a certificate, so it must not be
    // ready (the Service would send it admission requests its port refuses).
    let bindings: Api<RoleBinding> = Api::namespaced(e.c.client.clone(), NS);
    bindings
        .delete("imp-operator", &DeleteParams::default())
        .await
        .unwrap();
    let a = e.operator("a", &[]);
    let log = common::wait_for("the refusal logged", Duration::from_secs(20), || async {
        let log = a.log();
        log.contains("getting the webhook certificate failed")
            .then_some(log)
    })
    .await;
    assert!(log.contains("forbidden"), "{log}");
    let (code, body) = a.readyz().await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("webhook: no serving certificate from Secret imp-system/imp-webhook-tls"),
        "{body}"
    );
    // Its rights back, it issues the certificate, serves, and is ready.
    imp_testenv::rbac::install(&e.c.cp, NS).await.unwrap();
    let ready = common::wait_for("ready once serving", Duration::from_secs(90), || async {
        let (code, body) = a.readyz().await;
        (code == 200).then_some(body)
    })
    .await;
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let ca = field(&e.secret().await, "ca.crt");
    handshake_until_served(a.port, &ca).await;
}
