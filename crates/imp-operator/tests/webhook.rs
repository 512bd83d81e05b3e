//! The admission webhook as the API server sees it, two ways:
//!
//! - directly: a real HTTPS server with a certificate made by `openssl`, real AdmissionReview
//!   JSON posted by a client that trusts only that certificate;
//! - through a real kube-apiserver (imp-testenv): registered by URL with a
//!   ValidatingWebhookConfiguration and a MutatingWebhookConfiguration, so the server itself
//!   calls it on creates and updates from the kube client and from `kubectl apply`, and its
//!   failurePolicy decides what happens when it cannot be called.
//!
//! Either way the webhook reads the template and class that mutation inherits from the real
//! API server, as the operator's ServiceAccount with the role the chart ships.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use imp_operator::webhook::{self, WebhookConfig, WebhookError};
use imp_testenv::scratch::scratch_dir;
use imp_testenv::{ControlPlane, rbac};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

/// A self-signed P-256 certificate for 127.0.0.1, made by the openssl CLI.
fn make_cert(openssl: &Path, dir: &Path, cn: &str) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let out = std::process::Command::new(openssl)
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "1", "-subj"])
        .arg(format!("/CN={cn}"))
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .args(["-addext", "extendedKeyUsage=serverAuth", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl req failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

/// A running webhook, as the operator's ServiceAccount, on a real control plane that holds
/// class `small` (with a restart policy) and template `edge/web` (image, expireAfter, classRef
/// small). The objects are shared by the tests of this binary (same content, created once).
struct Fixture {
    cp: &'static ControlPlane,
    /// The admin, for what the tests set up (the operator may only read templates and classes).
    admin: kube::Client,
    addr: SocketAddr,
    /// The certificate a client (or the API server, as `caBundle`) trusts.
    trust: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

/// Creates `obj` unless it exists (tests running at once create the same shared objects).
async fn create_once<K>(api: &Api<K>, obj: Value) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api
        .create(&PostParams::default(), &serde_json::from_value(obj)?)
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        other => other.map(|_| ()).map_err(Into::into),
    }
}

/// Template `web` in `ns`: the image, `expireAfter: 10m` and class `small`.
async fn web_template(admin: &kube::Client, ns: &str) -> Result<()> {
    let templates: Api<imp_api::ImpVMTemplate> = Api::namespaced(admin.clone(), ns);
    create_once(
        &templates,
        json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"classRef": {"name": "small"}, "image": "registry.local/web:1",
                     "expireAfter": "10m"}
        }),
    )
    .await
    .with_context(|| format!("creating template {ns}/web"))
}

impl Fixture {
    /// The webhook serving `cert`/`key`, trusted through `trust`.
    async fn start(
        cp: &'static ControlPlane,
        cert: PathBuf,
        key: PathBuf,
        trust: PathBuf,
    ) -> Result<Self> {
        let admin = cp.admin().await?;
        cp.install_crds(&admin, &imp_api::crd::all()).await?;
        cp.ensure_namespace(&admin, "edge").await?;
        let classes: Api<imp_api::ImpVMClass> = Api::all(admin.clone());
        create_once(
            &classes,
            json!({
                "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                "metadata": {"name": "small"},
                "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1, "arch": "amd64",
                         "restartPolicy": {"mode": "in-place", "onExhaustion": "cool-down",
                                           "coolDownPeriod": "7m"}}
            }),
        )
        .await
        .context("creating class small")?;
        web_template(&admin, "edge").await?;

        // The webhook reads templates and classes as the operator does in a cluster: with its
        // own ServiceAccount and the chart's role (a namespace of its own per test, so the
        // kubeconfigs of tests running at once never meet).
        let install = cp.namespace(&admin, "imp-system").await?;
        let ids = rbac::install(cp, &install).await?;
        let operator = cp.client_from(&ids.operator).await?;
        let hook = webhook::bind(
            WebhookConfig {
                addr: "127.0.0.1:0".parse()?,
                cert,
                key,
            },
            operator,
        )
        .await?;
        let addr = hook.local_addr()?;
        let (tx, rx) = oneshot::channel();
        let server = tokio::spawn(hook.run(async move {
            let _ = rx.await;
        }));
        Ok(Self {
            cp,
            admin,
            addr,
            trust,
            stop: Some(tx),
            server,
        })
    }

    /// POSTs `body` to `path` over HTTPS trusting only `trust`; returns status and body.
    async fn post_trusting(
        &self,
        trust: &Path,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(StatusCode, Bytes)> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(trust)? {
            roots.add(c?)?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(ServerName::IpAddress(self.addr.ip().into()), tcp)
            .await?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let req = hyper::Request::post(path)
            .header("host", self.addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let resp = send.send_request(req).await?;
        let status = resp.status();
        Ok((status, resp.into_body().collect().await?.to_bytes()))
    }

    async fn post(&self, path: &str, body: Vec<u8>) -> Result<(StatusCode, Bytes)> {
        self.post_trusting(&self.trust, path, body).await
    }

    /// POSTs an AdmissionReview and returns its `response` object.
    async fn review(&self, path: &str, request: Value) -> Value {
        let uid = request["uid"].as_str().unwrap().to_owned();
        let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request});
        let (status, body) = self
            .post(path, serde_json::to_vec(&body).unwrap())
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["kind"], "AdmissionReview");
        assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
        let resp = v["response"].clone();
        assert_eq!(
            resp["uid"],
            uid.as_str(),
            "the response must carry the request's uid"
        );
        resp
    }

    async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(std::time::Duration::from_secs(5), &mut self.server)
            .await
            .expect("the webhook stops when asked")
            .unwrap();
    }
}

/// An admission request for `obj` (old object for UPDATE), as the API server builds it.
fn request(op: &str, obj: &Value, old: Option<&Value>) -> Value {
    static N: AtomicU32 = AtomicU32::new(0);
    let kind = obj["kind"].as_str().unwrap();
    let api_version = obj["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let mut r = json!({
        "uid": format!("uid-{}", N.fetch_add(1, Ordering::Relaxed)),
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": format!("{}s", kind.to_lowercase())},
        "name": obj["metadata"]["name"],
        "operation": op,
        "userInfo": {"username": "system:serviceaccount:imp-system:imp-operator"},
        "object": obj,
        "oldObject": old.cloned().unwrap_or(Value::Null),
        "dryRun": false,
    });
    if let Some(ns) = obj["metadata"]["namespace"].as_str() {
        r["namespace"] = json!(ns);
    }
    r
}

fn vm(spec: Value) -> Value {
    json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
           "metadata": {"name": "vm1", "namespace": "edge"}, "spec": spec})
}

fn fixture_dir(which: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../imp-api/tests/fixtures")
        .join(which);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no fixtures in {}", root.display());
    v
}

fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| -> Value { serde::Deserialize::deserialize(d).unwrap() })
        .filter(|v| !v.is_null())
        .collect()
}

/// Applies an RFC 6902 patch of `add` operations on object members (all this webhook emits).
fn apply_patch(mut doc: Value, patch: &Value) -> Value {
    for op in patch.as_array().unwrap() {
        assert_eq!(op["op"], "add", "unexpected operation {op}");
        let path = op["path"].as_str().unwrap();
        let mut tokens: Vec<&str> = path.strip_prefix('/').unwrap().split('/').collect();
        let last = tokens.pop().unwrap();
        let mut at = &mut doc;
        for t in tokens {
            at = at
                .get_mut(t)
                .unwrap_or_else(|| panic!("patch path {path} has no parent"));
        }
        at.as_object_mut()
            .unwrap()
            .insert(last.to_owned(), op["value"].clone());
    }
    doc
}

fn decode_patch(resp: &Value) -> Value {
    assert_eq!(resp["patchType"], "JSONPatch", "{resp}");
    let b64 = resp["patch"].as_str().unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

/// The webhook with an openssl self-signed certificate on the shared control plane; leaves
/// the test (skip, or fail under `CI=true`) without openssl or the control plane.
macro_rules! fixture {
    () => {{
        let openssl = imp_testenv::require_tool!("openssl");
        let Some(cp) = ControlPlane::shared() else {
            return;
        };
        let (cert, key) = make_cert(
            &openssl,
            &scratch_dir("imp-webhook-srv").unwrap(),
            "127.0.0.1",
        );
        (
            Fixture::start(cp, cert.clone(), key, cert).await.unwrap(),
            openssl,
        )
    }};
}

#[tokio::test]
async fn valid_objects_of_every_kind_are_allowed() {
    let (f, _) = fixture!();
    let (mut n, mut not_yet) = (0, 0);
    for path in fixture_dir("valid") {
        for doc in documents(&path) {
            let resp = f.review("/validate", request("CREATE", &doc, None)).await;
            n += 1;
            if resp["allowed"] == true {
                continue;
            }
            // A valid manifest may only be refused for what imp does not support yet
            // (imp_api::unsupported, docs/fields.md): a kind with no controller, or values
            // nothing honours.
            let msg = resp["status"]["message"].as_str().unwrap_or_default();
            assert!(
                msg.split("; ")
                    .all(|m| m.contains(imp_api::unsupported::NOT_SUPPORTED_YET)),
                "{}: {} denied: {resp}",
                path.display(),
                doc["kind"]
            );
            not_yet += 1;
        }
    }
    assert!(n >= 10, "only {n} valid documents");
    assert!(
        not_yet < n / 2,
        "{not_yet} of {n} valid documents refused as not supported yet"
    );
    // The Go project's per-kind path is accepted too.
    let resp = f
        .review(
            "/validate-imp-dev-v1alpha1-impvm",
            request("CREATE", &vm(json!({"templateRef": {"name": "web"}})), None),
        )
        .await;
    assert_eq!(resp["allowed"], true, "{resp}");
    f.shutdown().await;
}

#[tokio::test]
async fn invalid_objects_are_denied_with_the_field_path() {
    let (f, _) = fixture!();
    let mut checked = 0;
    for path in fixture_dir("invalid") {
        let text = std::fs::read_to_string(&path).unwrap();
        let expect: Vec<&str> = text
            .lines()
            .filter_map(|l| {
                l.strip_prefix("# expect: ")
                    .or_else(|| l.strip_prefix("# expect-parse: "))
            })
            .collect();
        if expect.is_empty() {
            continue; // a rule only the CRD schema enforces
        }
        let docs = documents(&path);
        let doc = docs.last().unwrap();
        let resp = f.review("/validate", request("CREATE", doc, None)).await;
        assert_eq!(resp["allowed"], false, "{} allowed: {resp}", path.display());
        let msg = resp["status"]["message"].as_str().unwrap();
        for e in expect {
            assert!(
                msg.contains(e),
                "{}: message {msg:?} lacks {e:?}",
                path.display()
            );
        }
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} invalid fixtures checked");
    // One by hand, with the status the API server shows the user.
    let resp = f
        .review(
            "/validate",
            request(
                "CREATE",
                &vm(json!({"classRef": {"name": "small"}, "expireAfter": "30s"})),
                None,
            ),
        )
        .await;
    assert_eq!(resp["allowed"], false);
    assert_eq!(resp["status"]["code"], 422);
    let msg = resp["status"]["message"].as_str().unwrap();
    assert!(msg.contains("spec.image: is required"), "{msg}");
    assert!(msg.contains("spec.expireAfter"), "{msg}");
    f.shutdown().await;
}

fn snapshot_in(ns: &str, source_ns: &str, path: &str) -> Value {
    json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
           "metadata": {"name": "snap", "namespace": ns},
           "spec": {"sourceVMName": "db", "sourceVMNamespace": source_ns, "retention": 3,
                    "storage": {"type": "node-local", "nodeLocal": {"path": path}}}})
}

#[tokio::test]
async fn a_snapshot_or_migration_reaches_only_its_own_namespace_and_keeps_its_storage() {
    let (f, _) = fixture!();
    let denied = |resp: &Value| -> String {
        assert_eq!(resp["allowed"], false, "{resp}");
        assert_eq!(resp["status"]["code"], 422, "{resp}");
        resp["status"]["message"].as_str().unwrap().to_owned()
    };
    // Another namespace's VM: refused by name.
    let theirs = snapshot_in("evil", "victim", "/var/lib/imp/snapshots");
    let resp = f
        .review("/validate", request("CREATE", &theirs, None))
        .await;
    let msg = denied(&resp);
    assert!(
        msg.contains(
            "spec.sourceVMNamespace: must be the snapshot's own namespace \"evil\" (or empty), got \"victim\""
        ),
        "{msg}"
    );
    // Its own, or empty: allowed.
    for own in ["evil", ""] {
        let ok = snapshot_in("evil", own, "/var/lib/imp/snapshots");
        let resp = f.review("/validate", request("CREATE", &ok, None)).await;
        assert_eq!(resp["allowed"], true, "{own:?}: {resp}");
    }
    // An update may not move it to another namespace's VM, nor its storage elsewhere.
    let old = snapshot_in("evil", "evil", "/var/lib/imp/snapshots");
    let resp = f
        .review("/validate", request("UPDATE", &theirs, Some(&old)))
        .await;
    assert!(denied(&resp).contains("spec.sourceVMNamespace"), "{resp}");
    let moved = snapshot_in("evil", "evil", "/etc");
    let resp = f
        .review("/validate", request("UPDATE", &moved, Some(&old)))
        .await;
    let msg = denied(&resp);
    assert!(
        msg.contains(&format!(
            "spec.storage: {}",
            imp_api::validation::STORAGE_IMMUTABLE
        )),
        "{msg}"
    );
    let mut kept = old.clone();
    kept["spec"]["retention"] = json!(5);
    let resp = f
        .review("/validate", request("UPDATE", &kept, Some(&old)))
        .await;
    assert_eq!(resp["allowed"], true, "{resp}");
    // A migration names the same field the same way (beside its kind not being supported).
    let migration = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMMigration",
        "metadata": {"name": "move", "namespace": "evil"},
        "spec": {"sourceVMName": "db", "sourceVMNamespace": "victim"}});
    let resp = f
        .review("/validate", request("CREATE", &migration, None))
        .await;
    let msg = denied(&resp);
    assert!(
        msg.contains(
            "spec.sourceVMNamespace: must be the migration's own namespace \"evil\" (or empty), got \"victim\""
        ),
        "{msg}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn controllers_updates_are_never_blocked_but_moving_a_node_is() {
    let (f, _) = fixture!();
    let spec =
        json!({"classRef": {"name": "small"}, "image": "registry.local/a:1", "nodeName": "node-a"});
    let old = vm(spec.clone());

    // The agent or operator clears nodeName (completion, reschedule, deletion cleanup).
    let mut cleared = old.clone();
    cleared["spec"].as_object_mut().unwrap().remove("nodeName");
    let resp = f
        .review("/validate", request("UPDATE", &cleared, Some(&old)))
        .await;
    assert_eq!(resp["allowed"], true, "clearing nodeName: {resp}");

    // The scheduler sets it on an unscheduled VM.
    let resp = f
        .review("/validate", request("UPDATE", &old, Some(&cleared)))
        .await;
    assert_eq!(resp["allowed"], true, "setting nodeName: {resp}");

    // Moving it is a migration, not an update.
    let mut moved = old.clone();
    moved["spec"]["nodeName"] = json!("node-b");
    let resp = f
        .review("/validate", request("UPDATE", &moved, Some(&old)))
        .await;
    assert_eq!(resp["allowed"], false, "{resp}");
    let msg = resp["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("spec.nodeName: cannot move from node-a to node-b"),
        "{msg}"
    );

    // Even a stored VM that today's rules reject can have nodeName cleared and finalizers removed.
    let stale = vm(
        json!({"classRef": {"name": "small"}, "image": "registry.local/a:1",
                          "expireAfter": "5s", "nodeName": "node-a"}),
    );
    let mut stale_cleared = stale.clone();
    stale_cleared["spec"]
        .as_object_mut()
        .unwrap()
        .remove("nodeName");
    let resp = f
        .review("/validate", request("UPDATE", &stale_cleared, Some(&stale)))
        .await;
    assert_eq!(
        resp["allowed"], true,
        "clearing nodeName on a stale VM: {resp}"
    );
    let mut finalizing = stale.clone();
    finalizing["metadata"]["finalizers"] = json!(["imp.dev/agent-cleanup"]);
    finalizing["metadata"]["deletionTimestamp"] = json!("2026-12-02T10:00:00Z");
    let mut released = finalizing.clone();
    released["metadata"]["finalizers"] = json!([]);
    let resp = f
        .review("/validate", request("UPDATE", &released, Some(&finalizing)))
        .await;
    assert_eq!(
        resp["allowed"], true,
        "finalizer removal during deletion: {resp}"
    );

    // Status-only updates and deletes pass whatever the object holds.
    let mut status = request("UPDATE", &stale, Some(&stale));
    status["subResource"] = json!("status");
    let resp = f.review("/validate", status).await;
    assert_eq!(resp["allowed"], true, "status update: {resp}");
    let mut del = request("DELETE", &stale, Some(&stale));
    del["object"] = Value::Null;
    let resp = f.review("/validate", del).await;
    assert_eq!(resp["allowed"], true, "delete: {resp}");

    // A metadata-only update (labels) of a stale object is not re-judged.
    let mut labelled = stale.clone();
    labelled["metadata"]["labels"] = json!({"team": "edge"});
    let resp = f
        .review("/validate", request("UPDATE", &labelled, Some(&stale)))
        .await;
    assert_eq!(resp["allowed"], true, "label update: {resp}");

    // A real spec change of that stale VM is judged by today's rules.
    let mut edited = stale.clone();
    edited["spec"]["image"] = json!("registry.local/a:2");
    let resp = f
        .review("/validate", request("UPDATE", &edited, Some(&stale)))
        .await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("spec.expireAfter"),
        "{resp}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn the_placed_size_annotation_is_neither_rejected_nor_stripped() {
    let (f, _) = fixture!();
    let ann = json!({"imp.dev/placed-resources": r#"{"vcpu":1,"memoryMiB":256}"#});
    // The operator's placement: nodeName, finalizer and the booked size in one update.
    let old = vm(json!({"classRef": {"name": "small"}, "image": "registry.local/a:1"}));
    let mut placed = old.clone();
    placed["spec"]["nodeName"] = json!("node-a");
    placed["metadata"]["finalizers"] = json!(["imp.dev/vm-cleanup"]);
    placed["metadata"]["annotations"] = ann.clone();
    let resp = f
        .review("/validate", request("UPDATE", &placed, Some(&old)))
        .await;
    assert_eq!(resp["allowed"], true, "placement: {resp}");
    // Added later to a VM a user pinned (metadata only).
    let mut pinned = placed.clone();
    pinned["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    let resp = f
        .review("/validate", request("UPDATE", &placed, Some(&pinned)))
        .await;
    assert_eq!(resp["allowed"], true, "backfill: {resp}");
    // A VM created with it (restored from a backup) keeps it: mutation writes spec fields only.
    let mut obj = vm(json!({"classRef": {"name": "small"}, "image": "registry.local/a:1"}));
    obj["metadata"]["annotations"] = ann.clone();
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    let patch = decode_patch(&resp);
    assert!(
        patch
            .as_array()
            .unwrap()
            .iter()
            .all(|op| op["path"].as_str().unwrap().starts_with("/spec/")),
        "{patch}"
    );
    let patched = apply_patch(obj, &patch);
    assert_eq!(patched["metadata"]["annotations"], ann, "{patched}");
    let resp = f
        .review("/validate", request("CREATE", &patched, None))
        .await;
    assert_eq!(resp["allowed"], true, "{resp}");
    f.shutdown().await;
}

#[tokio::test]
async fn warnings_come_from_the_validation_module() {
    let (f, _) = fixture!();
    let resp = f
        .review(
            "/validate",
            request(
                "CREATE",
                &vm(json!({"templateRef": {"name": "web"}, "desiredState": "ScaleToZero"})),
                None,
            ),
        )
        .await;
    assert_eq!(resp["allowed"], true, "{resp}");
    let w = resp["warnings"].as_array().unwrap();
    for unset in ["spec.idleTimeout is unset", "spec.networkRef is unset"] {
        assert!(
            w.iter().any(|w| w.as_str().unwrap().contains(unset)),
            "{unset}: {resp}"
        );
    }
    // A restore keeps its snapshot's environment: the env it sets is said to be ignored.
    let resp = f
        .review(
            "/validate",
            request(
                "CREATE",
                &vm(
                    json!({"templateRef": {"name": "web"}, "snapshotRef": "web-20260101-000000",
                           "env": [{"name": "A", "value": "1"}]}),
                ),
                None,
            ),
        )
        .await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert_eq!(
        resp["warnings"],
        json!([format!(
            "spec.env {}",
            imp_api::validation::RESTORE_KEEPS_ITS_OWN
        )]),
        "{resp}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn mutation_really_inherits_from_the_template_and_class() {
    let (f, _) = fixture!();
    let obj = vm(json!({"templateRef": {"name": "web"}}));
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    let patched = apply_patch(obj.clone(), &decode_patch(&resp));
    let spec = &patched["spec"];
    assert_eq!(spec["expireAfter"], "10m", "from the template: {patched}");
    assert_eq!(spec["lifecycle"], "ephemeral", "the Go default: {patched}");
    assert_eq!(
        spec["restartPolicy"]["onExhaustion"], "cool-down",
        "from the class: {patched}"
    );
    assert_eq!(
        spec["restartPolicy"]["coolDownPeriod"], "7m",
        "from the class: {patched}"
    );
    assert!(
        spec.get("classRef").is_none(),
        "classRef must not be added next to templateRef: {patched}"
    );
    // The mutated object is still valid.
    let resp = f
        .review("/validate", request("CREATE", &patched, None))
        .await;
    assert_eq!(resp["allowed"], true, "{resp}");

    // The VM's own values win.
    let obj = vm(
        json!({"templateRef": {"name": "web"}, "expireAfter": "2h", "lifecycle": "persistent",
                        "restartPolicy": {"mode": "reschedule"}}),
    );
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    let patched = match resp.get("patch") {
        Some(_) => apply_patch(obj.clone(), &decode_patch(&resp)),
        None => obj.clone(),
    };
    assert_eq!(patched["spec"]["expireAfter"], "2h");
    assert_eq!(patched["spec"]["lifecycle"], "persistent");
    assert_eq!(patched["spec"]["restartPolicy"]["mode"], "reschedule");

    // A classRef VM takes the class's restart policy directly.
    let obj = vm(json!({"classRef": {"name": "small"}, "image": "registry.local/a:1"}));
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    let patched = apply_patch(obj.clone(), &decode_patch(&resp));
    assert_eq!(
        patched["spec"]["restartPolicy"]["coolDownPeriod"], "7m",
        "{patched}"
    );
    assert!(patched["spec"].get("expireAfter").is_none(), "{patched}");

    // A template created after this webhook started is read too (no caching of absence).
    let templates: Api<imp_api::ImpVMTemplate> = Api::namespaced(f.admin.clone(), "edge");
    templates
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
                "metadata": {"name": "late", "namespace": "edge"},
                "spec": {"classRef": {"name": "small"}, "expireAfter": "3h"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let obj = vm(json!({"templateRef": {"name": "late"}}));
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    let patched = apply_patch(obj.clone(), &decode_patch(&resp));
    assert_eq!(patched["spec"]["expireAfter"], "3h", "{patched}");
    f.shutdown().await;
}

#[tokio::test]
async fn a_vm_over_its_namespaces_memory_quota_is_refused_at_admission_naming_the_quota() {
    let (f, _) = fixture!();
    let ns = f.cp.namespace(&f.admin, "quota").await.unwrap();
    // Pod admission wants the namespace's ServiceAccount before it looks at quotas.
    f.cp.default_service_account(&f.admin, &ns).await.unwrap();
    let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> =
        Api::namespaced(f.admin.clone(), &ns);
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "vm-memory"},
                "spec": {"hard": {"requests.memory": "128Mi"}}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    while quotas
        .get("vm-memory")
        .await
        .unwrap()
        .status
        .and_then(|s| s.hard)
        .is_none()
    {
        assert!(
            t0.elapsed().as_secs() < 30,
            "the quota controller never counted {ns}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut obj = vm(json!({"classRef": {"name": "small"}, "image": "registry.local/a:1"}));
    obj["metadata"]["namespace"] = json!(ns);
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    assert_eq!(resp["allowed"], false, "256Mi over a 128Mi quota: {resp}");
    let msg = resp["status"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("spec.classRef: the VM's 1 vCPU and 256MiB")
            && msg.contains("exceeded quota: vm-memory"),
        "{msg}"
    );
    // Room in the quota: allowed, and nothing was created by asking.
    quotas
        .patch(
            "vm-memory",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"hard": {"requests.memory": "1Gi"}}})),
        )
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
        if resp["allowed"] == true {
            break;
        }
        assert!(t0.elapsed().as_secs() < 30, "never allowed: {resp}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(f.admin.clone(), &ns);
    let listed = pods.list(&Default::default()).await.unwrap();
    assert!(listed.items.is_empty(), "a preview is a dry run");
    f.shutdown().await;
}

#[tokio::test]
async fn a_missing_template_is_allowed_with_a_warning() {
    let (f, _) = fixture!();
    let obj = vm(json!({"templateRef": {"name": "nope"}}));
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    let w = resp["warnings"]
        .as_array()
        .expect("a warning for the missing template");
    assert!(
        w.iter().any(|w| w
            .as_str()
            .unwrap()
            .contains("ImpVMTemplate edge/nope not found")),
        "{resp}"
    );
    // Only the lifecycle default is patched in; nothing is invented for the missing template.
    let patched = apply_patch(obj.clone(), &decode_patch(&resp));
    assert_eq!(patched["spec"]["lifecycle"], "ephemeral");
    assert!(patched["spec"].get("expireAfter").is_none(), "{patched}");

    let obj = vm(json!({"classRef": {"name": "ghost"}, "image": "registry.local/a:1"}));
    let resp = f.review("/mutate", request("CREATE", &obj, None)).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert!(
        resp["warnings"][0]
            .as_str()
            .unwrap()
            .contains("ImpVMClass ghost not found"),
        "{resp}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_a_clear_400() {
    let (f, _) = fixture!();
    let (s, body) = f.post("/validate", b"{not json".to_vec()).await.unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&body).contains("Decoding the AdmissionReview JSON"),
        "{body:?}"
    );

    let (s, body) = f
        .post(
            "/mutate",
            serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "Pod"})).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&body).contains("Expected kind AdmissionReview"),
        "{body:?}"
    );

    let (s, body) = f
        .post(
            "/validate",
            serde_json::to_vec(
                &json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&body).contains("has no request"),
        "{body:?}"
    );

    let big = vec![b' '; webhook::MAX_BODY_BYTES + 1];
    let (s, _) = f.post("/validate", big).await.unwrap();
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);

    let (s, _) = f.post("/elsewhere", b"{}".to_vec()).await.unwrap();
    assert_eq!(s, StatusCode::NOT_FOUND);

    // A kind this webhook does not know is denied by name, not waved through.
    let pod =
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "edge"}});
    let mut req = request("CREATE", &pod, None);
    req["kind"] = json!({"group": "", "version": "v1", "kind": "Pod"});
    let resp = f.review("/validate", req).await;
    assert_eq!(resp["allowed"], false);
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("only the imp.dev group"),
        "{resp}"
    );

    // An object that does not decode as its kind names the kind.
    let resp = f
        .review(
            "/validate",
            request("CREATE", &vm(json!({"lifecycle": 7})), None),
        )
        .await;
    assert_eq!(resp["allowed"], false);
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("Decoding the object ImpVM"),
        "{resp}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn health_answers_and_only_tls_with_the_right_cert_gets_in() {
    let (f, openssl) = fixture!();
    // /healthz over HTTPS.
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&f.trust).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let (s, body) = {
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(f.addr).await.unwrap();
        let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(ServerName::IpAddress(f.addr.ip().into()), tcp)
            .await
            .unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let resp = send
            .send_request(
                hyper::Request::get("/healthz")
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        (
            resp.status(),
            resp.into_body().collect().await.unwrap().to_bytes(),
        )
    };
    assert_eq!(s, StatusCode::OK);
    assert_eq!(&body[..], b"ok\n");

    // A client that trusts a different certificate refuses the server.
    let other = scratch_dir("imp-webhook-other").unwrap();
    let (other_cert, _) = make_cert(&openssl, &other, "127.0.0.1");
    let err = f
        .post_trusting(&other_cert, "/validate", b"{}".to_vec())
        .await
        .expect_err("a client trusting another CA must not connect");
    assert!(
        format!("{err:#}").to_lowercase().contains("certificate"),
        "{err:#}"
    );

    // Plain HTTP gets no HTTP answer.
    let mut tcp = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    tcp.write_all(b"POST /validate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ =
        tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/"),
        "plain HTTP was answered: {:?}",
        String::from_utf8_lossy(&buf)
    );
    f.shutdown().await;
}

#[tokio::test]
async fn bad_certificate_files_are_named_in_the_error() {
    let openssl = imp_testenv::require_tool!("openssl");
    // bind() reads the files and never calls the API server: a client of an address where no
    // server listens is enough.
    let client =
        kube::Client::try_from(kube::Config::new("https://127.0.0.1:1".parse().unwrap())).unwrap();
    let dir = scratch_dir("imp-webhook-bad").unwrap();
    let (cert, key) = make_cert(&openssl, &dir, "127.0.0.1");
    let missing = dir.join("missing.crt");
    let cfg = |cert: &Path, key: &Path| WebhookConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        cert: cert.to_owned(),
        key: key.to_owned(),
    };

    let err = webhook::bind(cfg(&missing, &key), client.clone())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, WebhookError::Cert { .. }), "{err:?}");
    assert!(err.to_string().contains("missing.crt"), "{err}");

    let empty = dir.join("empty.crt");
    std::fs::write(&empty, "no pem here\n").unwrap();
    let err = webhook::bind(cfg(&empty, &key), client.clone())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, WebhookError::NoCert { .. }), "{err:?}");
    assert!(err.to_string().contains("empty.crt"), "{err}");

    // The key file holds a certificate, not a key.
    let err = webhook::bind(cfg(&cert, &cert), client.clone())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, WebhookError::Key { .. }), "{err:?}");
    assert!(err.to_string().contains("tls.crt"), "{err}");

    // A key that does not match the certificate.
    let (_, other_key) = make_cert(
        &openssl,
        &scratch_dir("imp-webhook-bad2").unwrap(),
        "127.0.0.1",
    );
    let err = webhook::bind(cfg(&cert, &other_key), client.clone())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, WebhookError::Tls { .. }), "{err:?}");

    // serve() surfaces the same errors.
    let err = webhook::serve(cfg(&missing, &key), client, async {})
        .await
        .unwrap_err();
    assert!(err.to_string().contains("missing.crt"), "{err}");
}

// ---- Admission through the API server ----
//
// kube-apiserver itself calls the webhook: registered by URL with a ValidatingWebhookConfiguration
// and a MutatingWebhookConfiguration, its certificate signed by the control plane's CA (the
// `caBundle`). Each test registers its own configurations, limited to a namespace of its own by
// a namespaceSelector and to namespaced kinds (a selector cannot limit cluster-scoped ones), so
// the tests of this binary never judge each other's objects, and a configuration left behind by
// a failed test is harmless.

/// The name of the webhook in the ValidatingWebhookConfiguration (the server quotes it).
const VALIDATING: &str = "validate.imp.dev";
/// The name of the webhook in the MutatingWebhookConfiguration.
const MUTATING: &str = "mutate.imp.dev";

/// Registers the webhook at `base` (`https://127.0.0.1:PORT`) for namespace `ns` as a chart
/// would (one rule each: `/validate` judges every imp kind on CREATE and UPDATE, `/mutate`
/// defaults ImpVMs on CREATE), trusting `ca_pem`, with `policy` (`Fail` or `Ignore`) when the
/// server cannot call it. Server-side apply: registering again with another policy updates the
/// configurations.
async fn register(admin: &kube::Client, base: &str, ca_pem: &str, ns: &str, policy: &str) {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let hook = |name: &str, path: &str, operations: Value, resources: Value| {
        json!({
            "name": name,
            "clientConfig": {"url": format!("{base}{path}"), "caBundle": ca},
            "rules": [{"apiGroups": ["imp.dev"], "apiVersions": ["v1alpha1"],
                       "operations": operations, "resources": resources, "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "failurePolicy": policy,
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5,
        })
    };
    let name = format!("imp-{ns}");
    let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": name},
        "webhooks": [hook(VALIDATING, "/validate", json!(["CREATE", "UPDATE"]), json!(["*"]))],
    }))
    .unwrap();
    let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": name},
        "webhooks": [hook(MUTATING, "/mutate", json!(["CREATE"]), json!(["impvms"]))],
    }))
    .unwrap();
    let pp = PatchParams::apply("imp-webhook-test").force();
    Api::<ValidatingWebhookConfiguration>::all(admin.clone())
        .patch(&name, &pp, &Patch::Apply(&validating))
        .await
        .unwrap();
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .patch(&name, &pp, &Patch::Apply(&mutating))
        .await
        .unwrap();
}

/// ImpVMs in `ns`, as untyped objects: what the server stores, field for field.
fn vms(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::erase::<imp_api::ImpVM>(&()),
    )
}

fn vm_in(ns: &str, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                                  "metadata": {"name": name, "namespace": ns}, "spec": spec}))
    .unwrap()
}

/// Polls `f` until it gives `Some` (a configuration reaches the server's webhook cache a moment
/// after it is written).
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let t0 = std::time::Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "timed out: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Waits until a dry-run create of `obj` fails with a message containing `needle`; returns it.
async fn refused_eventually(api: &Api<DynamicObject>, obj: &DynamicObject, needle: &str) -> String {
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually(&format!("the server refuses with {needle:?}"), || async {
        match api.create(&dry, obj).await {
            Err(kube::Error::Api(s)) if s.message.contains(needle) => Some(s.message),
            _ => None,
        }
    })
    .await
}

/// Runs kubectl (as the admin) off the runtime's thread: the webhook the server calls meanwhile
/// is served by this test's runtime.
async fn kubectl(cp: &ControlPlane, args: &[&str]) -> std::process::Output {
    let mut cmd = cp.kubectl().unwrap();
    cmd.args(args);
    tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap()
}

/// The webhook with a certificate from the control plane's CA, registered (failurePolicy Fail)
/// for a namespace of its own that holds template `web`; returns the fixture and the namespace.
async fn registered() -> Option<(Fixture, String)> {
    let cp = ControlPlane::shared()?;
    let dir = scratch_dir("imp-webhook-served").unwrap();
    let pair = cp.serving_pair(&["127.0.0.1".into()]).unwrap();
    let (cert, key, ca) = (dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.crt"));
    std::fs::write(&cert, &pair.cert).unwrap();
    std::fs::write(&key, &pair.key).unwrap();
    std::fs::write(&ca, cp.ca_pem()).unwrap();
    let f = Fixture::start(cp, cert, key, ca).await.unwrap();
    let ns = cp.namespace(&f.admin, "admit").await.unwrap();
    web_template(&f.admin, &ns).await.unwrap();
    let base = format!("https://{}", f.addr);
    register(&f.admin, &base, cp.ca_pem(), &ns, "Fail").await;
    Some((f, ns))
}

/// The rule of `backoff-inverted.yaml` that only the webhook enforces (the CRD schema lets it
/// through), and its message.
const BACKOFF_INVERTED: &str =
    "spec.restartPolicy.backoff.initialDelay: must not exceed backoff.maxDelay (10s), got 5m";

fn backoff_inverted(ns: &str) -> DynamicObject {
    vm_in(
        ns,
        "backoff",
        json!({"classRef": {"name": "small"}, "image": "busybox", "lifecycle": "persistent",
               "restartPolicy": {"backoff": {"initialDelay": "5m", "maxDelay": "10s"}}}),
    )
}

#[tokio::test]
async fn the_api_server_refuses_an_invalid_vm_with_the_webhooks_message() {
    let Some((f, ns)) = registered().await else {
        return;
    };
    let api = vms(&f.admin, &ns);
    let invalid = backoff_inverted(&ns);
    let denied = format!("admission webhook \"{VALIDATING}\" denied the request");
    refused_eventually(&api, &invalid, &denied).await;

    // Through the kube client: the webhook's status (422 Invalid) with its field-named message.
    match api.create(&PostParams::default(), &invalid).await {
        Err(kube::Error::Api(s)) => {
            println!("refused by the server: {}", s.message);
            assert_eq!(s.code, 422, "{s:?}");
            assert!(s.message.contains(&denied), "{}", s.message);
            assert!(s.message.contains(BACKOFF_INVERTED), "{}", s.message);
        }
        other => panic!("an invalid VM was admitted: {other:?}"),
    }
    assert!(api.get_opt("backoff").await.unwrap().is_none());

    // Through `kubectl apply -f`, as a user meets it.
    let file = scratch_dir("imp-webhook-kubectl")
        .unwrap()
        .join("backoff.yaml");
    std::fs::write(&file, serde_yaml_ng::to_string(&invalid).unwrap()).unwrap();
    let out = kubectl(f.cp, &["apply", "-f", file.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("kubectl apply: {}", stderr.trim());
    assert!(!out.status.success(), "kubectl apply succeeded: {stderr}");
    assert!(
        stderr.contains(&denied) && stderr.contains(BACKOFF_INVERTED),
        "{stderr}"
    );

    // A valid VM goes through, and the webhook's warnings reach kubectl's user.
    let valid = vm_in(
        &ns,
        "sleepy",
        json!({"templateRef": {"name": "web"}, "desiredState": "ScaleToZero"}),
    );
    let file = file.with_file_name("sleepy.yaml");
    std::fs::write(&file, serde_yaml_ng::to_string(&valid).unwrap()).unwrap();
    let out = kubectl(f.cp, &["apply", "-f", file.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("Warning: spec.idleTimeout is unset"),
        "{stderr}"
    );

    // Updates through the server: moving nodeName is refused, a controller's clear is not.
    let placed = vm_in(
        &ns,
        "placed",
        json!({"classRef": {"name": "small"}, "image": "registry.local/a:1", "nodeName": "node-a"}),
    );
    api.create(&PostParams::default(), &placed).await.unwrap();
    match api
        .patch(
            "placed",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": "node-b"}})),
        )
        .await
    {
        Err(kube::Error::Api(s)) => assert!(
            s.message
                .contains("spec.nodeName: cannot move from node-a to node-b"),
            "{}",
            s.message
        ),
        other => panic!("a move of nodeName was admitted: {other:?}"),
    }
    let cleared = api
        .patch(
            "placed",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": null}})),
        )
        .await
        .unwrap();
    assert!(
        cleared.data["spec"].get("nodeName").is_none(),
        "{cleared:?}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn the_api_server_stores_the_defaults_the_mutating_webhook_adds() {
    let Some((f, ns)) = registered().await else {
        return;
    };
    let api = vms(&f.admin, &ns);
    let obj = vm_in(&ns, "web-1", json!({"templateRef": {"name": "web"}}));
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually("the server calls the mutating webhook", || async {
        let got = api.create(&dry, &obj).await.ok()?;
        got.data["spec"].get("expireAfter").map(|_| ())
    })
    .await;

    api.create(&PostParams::default(), &obj).await.unwrap();
    let stored = api.get("web-1").await.unwrap();
    let spec = &stored.data["spec"];
    assert_eq!(spec["expireAfter"], "10m", "from the template: {spec}");
    assert_eq!(spec["lifecycle"], "ephemeral", "the Go default: {spec}");
    assert_eq!(
        spec["restartPolicy"]["onExhaustion"], "cool-down",
        "from the class: {spec}"
    );
    assert_eq!(
        spec["restartPolicy"]["coolDownPeriod"], "7m",
        "from the class: {spec}"
    );
    assert!(spec.get("classRef").is_none(), "{spec}");
    assert_eq!(spec["templateRef"]["name"], "web", "{spec}");

    // The VM's own values win over the template's.
    let own = vm_in(
        &ns,
        "web-2",
        json!({"templateRef": {"name": "web"}, "expireAfter": "2h", "lifecycle": "persistent"}),
    );
    api.create(&PostParams::default(), &own).await.unwrap();
    let spec = api.get("web-2").await.unwrap().data["spec"].clone();
    assert_eq!(spec["expireAfter"], "2h", "{spec}");
    assert_eq!(spec["lifecycle"], "persistent", "{spec}");
    assert_eq!(spec["restartPolicy"]["coolDownPeriod"], "7m", "{spec}");
    f.shutdown().await;
}

#[tokio::test]
async fn failure_policy_decides_whether_a_create_waits_for_a_webhook_that_is_down() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    cp.install_crds(&admin, &imp_api::crd::all()).await.unwrap();
    let ns = cp.namespace(&admin, "down").await.unwrap();
    // An address where nothing listens: the server's call is refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("https://127.0.0.1:{port}");
    let api = vms(&admin, &ns);
    let valid = vm_in(
        &ns,
        "a",
        json!({"classRef": {"name": "small"}, "image": "registry.local/a:1"}),
    );

    // Fail: nothing is admitted without the webhook's word, and the error says why.
    register(&admin, &base, cp.ca_pem(), &ns, "Fail").await;
    let calling = format!("failed calling webhook \"{MUTATING}\"");
    refused_eventually(&api, &valid, &calling).await;
    match api.create(&PostParams::default(), &valid).await {
        Err(kube::Error::Api(s)) => {
            println!("refused by the server: {}", s.message);
            assert_eq!(s.code, 500, "{s:?}");
            assert!(
                s.message.contains(&calling) && s.message.contains(&format!("{base}/mutate")),
                "{}",
                s.message
            );
        }
        other => panic!("admitted while the webhook was down: {other:?}"),
    }
    assert!(api.get_opt("a").await.unwrap().is_none());

    // Ignore: the create goes through unjudged, even one the webhook would refuse.
    register(&admin, &base, cp.ca_pem(), &ns, "Ignore").await;
    eventually("the server ignores the webhook that is down", || async {
        api.create(&PostParams::default(), &valid).await.ok()
    })
    .await;
    assert!(api.get_opt("a").await.unwrap().is_some());
    api.create(&PostParams::default(), &backoff_inverted(&ns))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_api_server_refuses_what_imp_does_not_support_yet_with_a_field_named_message() {
    let Some((f, ns)) = registered().await else {
        return;
    };
    let denied = format!("admission webhook \"{VALIDATING}\" denied the request");
    let api = vms(&f.admin, &ns);
    let agentless = vm_in(
        &ns,
        "agentless",
        json!({"classRef": {"name": "small"}, "image": "busybox",
               "env": [{"name": "NODE",
                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}),
    );
    refused_eventually(&api, &agentless, &denied).await;

    // Through `kubectl apply -f`, as a user meets it: the field and why, nothing stored.
    let file = scratch_dir("imp-webhook-kubectl-unsupported")
        .unwrap()
        .join("agentless.yaml");
    std::fs::write(&file, serde_yaml_ng::to_string(&agentless).unwrap()).unwrap();
    let out = kubectl(f.cp, &["apply", "-f", file.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("kubectl apply: {}", stderr.trim());
    assert!(!out.status.success(), "kubectl apply succeeded: {stderr}");
    let want = format!(
        "spec.env[0].valueFrom.fieldRef: {}",
        imp_api::unsupported::ENV_SOURCE
    );
    assert!(
        stderr.contains(&denied) && stderr.contains(&want),
        "{stderr}"
    );
    assert!(api.get_opt("agentless").await.unwrap().is_none());

    // A kind no controller acts on is refused whole, by name.
    let pools: Api<DynamicObject> = Api::namespaced_with(
        f.admin.clone(),
        &ns,
        &ApiResource::erase::<imp_api::ImpVMRunnerPool>(&()),
    );
    let pool: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMRunnerPool",
        "metadata": {"name": "runners", "namespace": ns},
        "spec": {"templateName": "t",
                 "platform": {"type": "github-actions", "scope": {"repo": "o/r"},
                              "credentialsSecret": "gh"},
                 "scaling": {"mode": "webhook", "minIdle": 0, "maxConcurrent": 2,
                             "scaleUpStep": 1, "cooldownSeconds": 30,
                             "webhook": {"secretRef": "hook"}}}}))
    .unwrap();
    match pools.create(&PostParams::default(), &pool).await {
        Err(kube::Error::Api(s)) => {
            println!("refused by the server: {}", s.message);
            assert_eq!(s.code, 422, "{s:?}");
            assert!(
                s.message
                    .contains("ImpVMRunnerPool is not supported yet by this imp"),
                "{}",
                s.message
            );
        }
        other => panic!("an ImpVMRunnerPool was admitted: {other:?}"),
    }

    // The same VM with the default (agent on) goes through.
    let agent_on = vm_in(
        &ns,
        "agentful",
        json!({"classRef": {"name": "small"}, "image": "busybox",
               "guestAgent": {"enabled": true}}),
    );
    api.create(&PostParams::default(), &agent_on).await.unwrap();
    f.shutdown().await;
}
