//! The validating and mutating admission webhook for the `imp.dev` kinds, served over HTTPS.
//!
//! `POST /validate` checks every imp kind with [`imp_api::validation`], refuses the values and
//! kinds nothing in imp honours yet with [`imp_api::unsupported`] (`docs/fields.md`), and
//! answers `allowed: false` with the field-path messages; `POST /mutate` answers an ImpVM CREATE with a
//! JSONPatch holding the Go project's defaults, resolved for real by reading the referenced
//! ImpVMTemplate and ImpVMClass. The Go project's paths (`/validate-imp-dev-v1alpha1-impvm`, …)
//! are accepted as aliases. `GET /healthz` answers `ok`.
//!
//! # Never blocking imp's own controllers
//!
//! The Go webhook made `spec.nodeName` immutable, so every clear by the agent or operator was
//! rejected and each deletion waited for a 2-minute forced timeout. Here:
//! - DELETE and CONNECT, and any subresource (`status`, …), are always allowed;
//! - an UPDATE of an object that is being deleted, or that leaves `spec` unchanged (finalizers,
//!   labels, annotations), is allowed without re-validating the spec;
//! - an ImpVM UPDATE that only clears `spec.nodeName`, or sets it when it was empty, is allowed
//!   (only moving it from one node to another is denied: that is a migration).
//!
//! # Missing template or class at admission time: allowed, with a warning
//!
//! `kubectl apply -f dir/` creates objects in any order, and the operator already reports a
//! missing reference as `Ready=False, reason=InvalidSpec` and recovers once the object appears.
//! So the mutating webhook never denies for a missing (or unreadable) ImpVMTemplate or
//! ImpVMClass: it returns an admission warning naming the object, and the operator resolves the
//! inheritance when the object exists.
//!
//! # What the mutation writes
//!
//! Only on CREATE, and only the fields the Go defaulter wrote: `lifecycle` (default
//! `ephemeral`), `expireAfter` (from the template) and `restartPolicy` (template, else class).
//! `classRef` is never copied from the template (a VM with both refs is invalid); the other
//! inherited fields stay live until the VM is placed, when the operator books what they resolve
//! to (`status.booking`) and the VM keeps that. Metadata is never
//! judged nor patched, so the operator's annotations (`imp.dev/placed-resources`, the size a
//! placement booked, written with `spec.nodeName`) pass as they are.
//!
//! # Its certificate
//!
//! Served through [`tls::LiveCert`], which a rotation swaps without closing the listener. It
//! comes either from PEM files ([`bind`]: cert-manager's Secret mounted into the Pod) or from
//! the operator itself ([`certs`]: a CA and serving certificate it keeps in a Secret, rotates,
//! and whose CA it publishes as the `caBundle` of its webhook configurations); [`serving`]
//! starts the webhook in either mode.

pub mod certs;
pub mod serving;
pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use imp_api::unsupported;
use imp_api::validation::{self, ValidationErrors};
use imp_api::{ImpVM, ImpVMClass, ImpVMSpec, ImpVMTemplate};
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use kube::Api;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use self::tls::LiveCert;
use crate::gateway::{Gateway, Peer};

/// Largest request body accepted: an AdmissionReview carries the object and the old object, each
/// at most ~1.5 MiB in etcd.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// How long a TLS handshake or a request's headers may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one read of a template or class may take (the API server's webhook timeout is 10 s).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(4);
/// Bound of the quota preview's dry run: with the template's and the class's reads it stays
/// within the mutating webhook's 10 s (the chart's `mutatingTimeoutSeconds`); no answer in time
/// lets the VM in, and placement asks the quota for real.
const PREVIEW_TIMEOUT: Duration = Duration::from_secs(2);

/// The API group whose kinds this webhook handles.
const GROUP: &str = "imp.dev";

/// Spec fields the mutation may write, in the order written (the Go defaulter's fields).
const DEFAULTED_FIELDS: [&str; 3] = ["lifecycle", "expireAfter", "restartPolicy"];

/// Where the webhook listens and with which serving certificate.
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    /// Address to bind, e.g. `0.0.0.0:9443` (port 0 picks a free one).
    pub addr: SocketAddr,
    /// PEM file with the serving certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM file with the private key of the leaf certificate.
    pub key: PathBuf,
}

/// Why the webhook server could not start.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The certificate file could not be read or parsed.
    #[error("Reading the webhook certificate {path}")]
    Cert {
        /// The certificate file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The certificate file holds no certificate.
    #[error("The webhook certificate file {path} holds no PEM CERTIFICATE block")]
    NoCert {
        /// The certificate file.
        path: PathBuf,
    },
    /// The key file could not be read or parsed.
    #[error("Reading the webhook private key {path}")]
    Key {
        /// The key file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// rustls refused the certificate and key (e.g. they do not match).
    #[error("Building the webhook TLS configuration from {cert} and {key}")]
    Tls {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
    /// rustls refused the server configuration (no protocol version the provider supports).
    #[error("Building the webhook TLS server configuration")]
    TlsConfig(#[source] rustls::Error),
    /// The listening socket could not be bound.
    #[error("Binding the webhook listener on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// A bound, not yet serving, webhook: lets a caller (or a test) learn the port before serving.
pub struct Webhook {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    live: Arc<LiveCert>,
    state: Arc<State>,
}

/// What every request handler shares.
struct State {
    client: kube::Client,
    /// Whether an ImpVM CREATE is refused when a ResourceQuota would refuse its reservation
    /// Pod (see [`quota_preview`]).
    quota_preview: bool,
    /// The aggregated API served beside the webhook (`/apis/…`), if on.
    gateway: Option<Arc<Gateway>>,
}

/// Binds the listener and loads the certificate, then serves until `shutdown` resolves.
pub async fn serve(
    config: WebhookConfig,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), WebhookError> {
    bind(config, client).await?.run(shutdown).await;
    Ok(())
}

/// Loads the certificate and key and binds the listener, without serving yet.
pub async fn bind(config: WebhookConfig, client: kube::Client) -> Result<Webhook, WebhookError> {
    let key = tls::load_files(&config.cert, &config.key).await?;
    bind_live(config.addr, Arc::new(LiveCert::new(key)), client).await
}

/// Binds the listener to serve whatever certificate `live` holds at each handshake (the
/// self-managed mode: [`certs::Keeper`] swaps it on rotation), without serving yet.
pub async fn bind_live(
    addr: SocketAddr,
    live: Arc<LiveCert>,
    client: kube::Client,
) -> Result<Webhook, WebhookError> {
    let tls = tls::server_config(live.clone(), None).map_err(WebhookError::TlsConfig)?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| WebhookError::Bind { addr, source })?;
    Ok(Webhook {
        listener,
        acceptor: TlsAcceptor::from(Arc::new(tls)),
        live,
        state: Arc::new(State {
            client,
            quota_preview: true,
            gateway: None,
        }),
    })
}

impl Webhook {
    /// Whether an ImpVM CREATE that a namespace's ResourceQuota would refuse (through the VM's
    /// reservation Pod, [`crate::placement::reservation`]) is refused at admission; on by default, off
    /// when the operator makes no reservation Pods (quotas then do not count VMs' size).
    #[must_use]
    pub fn with_quota_preview(self, on: bool) -> Self {
        Self {
            state: Arc::new(State {
                client: self.state.client.clone(),
                quota_preview: on,
                gateway: self.state.gateway.clone(),
            }),
            ..self
        }
    }

    /// Serves the aggregated API ([`crate::gateway`]) beside the webhook: the listener then
    /// asks each client for a certificate and verifies one against the API server's
    /// request-header CA (the webhook's callers present none).
    pub fn with_gateway(self, gateway: Arc<Gateway>) -> Result<Self, WebhookError> {
        let tls = tls::server_config(self.live.clone(), Some(gateway.verifier()))
            .map_err(WebhookError::TlsConfig)?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(tls)),
            state: Arc::new(State {
                client: self.state.client.clone(),
                quota_preview: self.state.quota_preview,
                gateway: Some(gateway),
            }),
            ..self
        })
    }

    /// The address actually bound (useful when the configured port was 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts HTTPS connections until `shutdown` resolves; connections already open finish on
    /// their own tasks.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) {
        let addr = self.listener.local_addr().ok();
        tracing::info!(?addr, "admission webhook listening (HTTPS)");
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                a = self.listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(error) => {
                    tracing::warn!(%error, "accepting a webhook connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let acceptor = self.acceptor.clone();
            let state = self.state.clone();
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                {
                    Ok(Ok(s)) => s,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "webhook TLS handshake timed out");
                        return;
                    }
                };
                let caller = Arc::new(Peer::of(tls.get_ref().1));
                let service = hyper::service::service_fn(move |req| {
                    let (state, caller) = (state.clone(), caller.clone());
                    async move { Ok::<_, Infallible>(dispatch(state, req, &caller).await) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HANDSHAKE_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), service)
                    .with_upgrades();
                if let Err(error) = conn.await {
                    tracing::debug!(%peer, %error, "webhook connection ended with an error");
                }
            });
        }
        tracing::info!(?addr, "admission webhook stopped");
    }
}

/// Which admission question a path asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Validate,
    Mutate,
}

/// The aggregated API's paths to the gateway (when on), the rest to the webhook.
async fn dispatch(
    state: Arc<State>,
    req: Request<Incoming>,
    caller: &Peer,
) -> Response<crate::gateway::Body> {
    if req.uri().path().starts_with("/apis")
        && let Some(gateway) = state.gateway.clone()
    {
        return gateway.handle(req, caller).await;
    }
    route(&state, req)
        .await
        .map(|b| BodyExt::boxed_unsync(b.map_err(|never| match never {})))
}

async fn route(state: &State, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let mode = if path == "/validate" || path.starts_with("/validate-") {
        Some(Mode::Validate)
    } else if path == "/mutate" || path.starts_with("/mutate-") {
        Some(Mode::Mutate)
    } else {
        None
    };
    match (req.method(), path, mode) {
        (&Method::GET, "/healthz", _) => plain(StatusCode::OK, "ok"),
        (&Method::POST, _, Some(mode)) => {
            let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(error) => {
                    let too_big = error.is::<http_body_util::LengthLimitError>();
                    return if too_big {
                        plain(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            &format!("AdmissionReview body exceeds {MAX_BODY_BYTES} bytes"),
                        )
                    } else {
                        plain(
                            StatusCode::BAD_REQUEST,
                            &format!("Reading the AdmissionReview body: {error}"),
                        )
                    };
                }
            };
            admit(state, mode, &body).await
        }
        (_, "/healthz", _) | (_, _, Some(_)) => {
            plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => plain(StatusCode::NOT_FOUND, "not found"),
    }
}

fn plain(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(format!("{text}\n"))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Decodes the review, answers it, and encodes the answer; undecodable input is a 400.
async fn admit(state: &State, mode: Mode, body: &[u8]) -> Response<Full<Bytes>> {
    let req = match decode_review(body) {
        Ok(r) => r,
        Err(msg) => {
            tracing::warn!(?mode, reason = %msg, "rejecting an undecodable admission request");
            return plain(StatusCode::BAD_REQUEST, &msg);
        }
    };
    let resp = match mode {
        Mode::Validate => validate(&req),
        Mode::Mutate => mutate(state, &req).await,
    };
    tracing::info!(
        ?mode,
        uid = %req.uid,
        kind = %req.kind.kind,
        namespace = req.namespace.as_deref().unwrap_or(""),
        name = %req.name,
        operation = ?req.operation,
        allowed = resp.allowed,
        message = %resp.result.message,
        "admission decided"
    );
    match encode_review(resp) {
        Ok(json) => {
            let mut r = Response::new(Full::new(Bytes::from(json)));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(error) => plain(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("Encoding the AdmissionReview response: {error}"),
        ),
    }
}

/// Serialises the answer with `response.patch` as a base64 string, the form of Go's `[]byte`
/// that the API server documents (kube's type would write an array of numbers).
fn encode_review(resp: AdmissionResponse) -> Result<Vec<u8>, serde_json::Error> {
    use base64::Engine as _;
    let patch = resp.patch.clone();
    let mut v = serde_json::to_value(resp.into_review())?;
    if let (Some(p), Some(r)) = (patch, v.get_mut("response").and_then(Value::as_object_mut)) {
        r.insert(
            "patch".to_owned(),
            Value::String(base64::engine::general_purpose::STANDARD.encode(p)),
        );
    }
    serde_json::to_vec(&v)
}

/// Parses an `admission.k8s.io/v1` AdmissionReview holding a request; the error says what is wrong.
fn decode_review(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, String> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body)
        .map_err(|e| format!("Decoding the AdmissionReview JSON: {e}"))?;
    if review.types.kind != "AdmissionReview" || review.types.api_version != "admission.k8s.io/v1" {
        return Err(format!(
            "Expected kind AdmissionReview of apiVersion admission.k8s.io/v1, got kind {:?} of apiVersion {:?}",
            review.types.kind, review.types.api_version
        ));
    }
    review
        .try_into()
        .map_err(|_| "The AdmissionReview has no request".to_owned())
}

/// Converts the request's object into a typed one; the error names the kind and the serde path.
fn typed<K: DeserializeOwned>(obj: &DynamicObject, kind: &str, which: &str) -> Result<K, String> {
    serde_json::to_value(obj)
        .and_then(serde_json::from_value)
        .map_err(|e| format!("Decoding the {which} {kind}: {e}"))
}

fn deny_invalid(
    resp: AdmissionResponse,
    kind: &str,
    name: &str,
    errs: &ValidationErrors,
) -> AdmissionResponse {
    let mut resp = resp.deny(format!("{kind} {name:?} is invalid: {errs}"));
    resp.result.code = 422;
    resp.result.reason = "Invalid".to_owned();
    resp
}

/// The validating webhook: field rules for every imp kind, never blocking controllers' updates.
fn validate(req: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let resp = AdmissionResponse::from(req);
    if matches!(req.operation, Operation::Delete | Operation::Connect) {
        return resp;
    }
    if req.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
        return resp;
    }
    if req.kind.group != GROUP {
        return resp.deny(format!(
            "imp's webhook handles only the {GROUP} group, got {}/{}",
            req.kind.group, req.kind.kind
        ));
    }
    let Some(obj) = &req.object else {
        return resp.deny(format!("The {} request has no object", req.kind.kind));
    };
    let old = req.old_object.as_ref();
    if req.operation == Operation::Update {
        if obj.metadata.deletion_timestamp.is_some() {
            return resp;
        }
        if old.is_some_and(|o| o.data.get("spec") == obj.data.get("spec")) {
            return resp;
        }
    }
    let kind = req.kind.kind.as_str();
    let name = obj.metadata.name.as_deref().unwrap_or(req.name.as_str());
    // The object's own namespace, which a reference to a VM may not leave.
    let namespace = obj
        .metadata
        .namespace
        .as_deref()
        .or(req.namespace.as_deref())
        .unwrap_or_default();
    let outcome = match kind {
        "ImpVM" => return validate_vm(resp, obj, old, (namespace, name)),
        "ImpVMClass" => {
            typed::<ImpVMClass>(obj, kind, "object").map(|o| validation::class(&o.spec))
        }
        "ImpVMTemplate" => {
            typed::<ImpVMTemplate>(obj, kind, "object").map(|o| validation::template(&o.spec))
        }
        "ImpNetwork" => typed::<imp_api::ImpNetwork>(obj, kind, "object")
            .map(|o| validation::both(validation::network(&o.spec), unsupported::network(&o.spec))),
        "ImpVMSnapshot" => return validate_snapshot(resp, obj, old, name, namespace),
        "ImpVMMigration" => typed::<imp_api::ImpVMMigration>(obj, kind, "object")
            .map(|o| validation::migration(&o.spec, namespace)),
        "ImpWarmPool" => typed::<imp_api::ImpWarmPool>(obj, kind, "object")
            .map(|o| validation::warm_pool(&o.spec)),
        "ImpVMRunnerPool" => typed::<imp_api::ImpVMRunnerPool>(obj, kind, "object")
            .map(|o| validation::runner_pool(&o.spec)),
        "ClusterImpConfig" => typed::<imp_api::ClusterImpConfig>(obj, kind, "object").map(|o| {
            let rules = validation::both(validation::cluster_config(&o), tracing_endpoint(&o.spec));
            validation::both(rules, unsupported::cluster_config(&o.spec))
        }),
        "ClusterImpNodeProfile" => typed::<imp_api::ClusterImpNodeProfile>(obj, kind, "object")
            .map(|o| validation::node_profile(&o.spec)),
        other => {
            return resp.deny(format!(
                "imp's webhook does not handle kind {GROUP}/{other}"
            ));
        }
    };
    match (outcome, unsupported::kind(kind)) {
        (Ok(Ok(())), None) => resp,
        (Ok(Ok(())), Some(not_yet)) => deny_unsupported(resp, &not_yet),
        (Ok(Err(errs)), Some(not_yet)) => deny_unsupported(
            resp,
            &format!("{not_yet}; {kind} {name:?} is invalid: {errs}"),
        ),
        (Ok(Err(errs)), None) => deny_invalid(resp, kind, name, &errs),
        (Err(msg), _) => resp.deny(msg),
    }
}

/// Refuses a whole kind no controller acts on ([`unsupported::kind`]); `msg` says so first,
/// then any field errors, so a fixed manifest is ready for the day the kind is supported.
fn deny_unsupported(resp: AdmissionResponse, msg: &str) -> AdmissionResponse {
    let mut resp = resp.deny(msg);
    resp.result.code = 422;
    resp.result.reason = "Invalid".to_owned();
    resp
}

/// The errors of the field rules followed by those of the not-supported-yet rules.
/// A `http://` tracing endpoint that the exporter cannot use ([`imp_telemetry::trace::Endpoint`]);
/// other schemes are refused as not supported yet.
fn tracing_endpoint(spec: &imp_api::ClusterImpConfigSpec) -> Result<(), ValidationErrors> {
    let endpoint = spec
        .observability
        .as_ref()
        .and_then(|o| o.tracing.as_ref())
        .map(|t| t.endpoint.as_str())
        .filter(|e| e.starts_with("http://"));
    match endpoint.map(imp_telemetry::trace::Endpoint::parse) {
        Some(Err(e)) => Err(ValidationErrors(vec![imp_api::validation::FieldError {
            path: "spec.observability.tracing.endpoint".to_owned(),
            message: e.0,
        }])),
        _ => Ok(()),
    }
}

fn validate_vm(
    resp: AdmissionResponse,
    obj: &DynamicObject,
    old: Option<&DynamicObject>,
    (namespace, name): (&str, &str),
) -> AdmissionResponse {
    let new = match typed::<ImpVM>(obj, "ImpVM", "object") {
        Ok(v) => v,
        Err(msg) => return resp.deny(msg),
    };
    let warnings = validation::vm_warnings(&new.spec);
    let mut resp = resp;
    if !warnings.is_empty() {
        resp.warnings = Some(warnings);
    }
    let result = match old {
        None => validation::both(
            validation::both(
                validation::vm(&new.spec),
                validation::warm_claim(namespace, &new.spec),
            ),
            unsupported::vm(&new.spec),
        ),
        Some(old) => match typed::<ImpVM>(old, "ImpVM", "old object") {
            Err(msg) => return resp.deny(msg),
            Ok(old) if only_node_name_changed(&old.spec, &new.spec) => {
                // A controller clearing or setting spec.nodeName: judge only the node rule, so a
                // rule added since the VM was stored never blocks a reschedule or a deletion.
                let moving = old.status.as_ref().and_then(|s| s.moving.as_ref());
                match validation::vm_update_moving(&old.spec, &new.spec, moving) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let node: Vec<_> =
                            e.0.into_iter()
                                .filter(|f| f.path == "spec.nodeName")
                                .collect();
                        if node.is_empty() {
                            Ok(())
                        } else {
                            Err(ValidationErrors(node))
                        }
                    }
                }
            }
            Ok(old) => validation::both(
                validation::both(
                    validation::vm_update(&old.spec, &new.spec),
                    validation::warm_claim(namespace, &new.spec),
                ),
                unsupported::vm(&new.spec),
            ),
        },
    };
    match result {
        Ok(()) => resp,
        Err(errs) => deny_invalid(resp, "ImpVM", name, &errs),
    }
}

/// An ImpVMSnapshot in `namespace`: its VM in that namespace only, and on UPDATE a
/// `spec.storage` that stays as created.
fn validate_snapshot(
    resp: AdmissionResponse,
    obj: &DynamicObject,
    old: Option<&DynamicObject>,
    name: &str,
    namespace: &str,
) -> AdmissionResponse {
    let new = match typed::<imp_api::ImpVMSnapshot>(obj, "ImpVMSnapshot", "object") {
        Ok(s) => s,
        Err(msg) => return resp.deny(msg),
    };
    let result =
        match old.map(|o| typed::<imp_api::ImpVMSnapshot>(o, "ImpVMSnapshot", "old object")) {
            None => validation::snapshot(&new.spec, namespace),
            Some(Ok(old)) => validation::snapshot_update(&old.spec, &new.spec, namespace),
            Some(Err(msg)) => return resp.deny(msg),
        };
    match result {
        Ok(()) => resp,
        Err(errs) => deny_invalid(resp, "ImpVMSnapshot", name, &errs),
    }
}

fn only_node_name_changed(old: &ImpVMSpec, new: &ImpVMSpec) -> bool {
    let mut a = old.clone();
    a.node_name.clone_from(&new.node_name);
    a == *new
}

/// The mutating webhook: on ImpVM CREATE, the Go project's defaults with real inheritance.
async fn mutate(state: &State, req: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let resp = AdmissionResponse::from(req);
    if req.operation != Operation::Create
        || req.kind.group != GROUP
        || req.kind.kind != "ImpVM"
        || req.sub_resource.as_deref().is_some_and(|s| !s.is_empty())
    {
        return resp;
    }
    let Some(obj) = &req.object else {
        return resp.deny("The ImpVM CREATE request has no object");
    };
    let vm = match typed::<ImpVM>(obj, "ImpVM", "object") {
        Ok(v) => v,
        Err(msg) => return resp.deny(msg),
    };
    let namespace = obj
        .metadata
        .namespace
        .clone()
        .or_else(|| req.namespace.clone())
        .unwrap_or_else(|| "default".to_owned());
    let mut warnings = Vec::new();
    let (resolved, size) = inherit(&state.client, &namespace, &vm.spec, &mut warnings).await;
    // A claimant's share is its member's, whose reservation Pod it takes over: previewing a
    // second one would refuse a claim at the quota's edge for counting it twice.
    if state.quota_preview
        && vm.spec.warm_pool_ref.is_none()
        && let Some(size) = size
        && let Some(why) = quota_preview(&state.client, &namespace, &vm, size).await
    {
        return resp.deny(why);
    }
    let patch = default_patch(obj.data.get("spec"), &resolved);
    let mut resp = resp;
    if !warnings.is_empty() {
        resp.warnings = Some(warnings);
    }
    if patch.0.is_empty() {
        return resp;
    }
    match resp.clone().with_patch(patch) {
        Ok(r) => r,
        Err(error) => {
            tracing::error!(%error, "encoding the admission JSONPatch failed");
            resp.deny(format!("Encoding the defaulting JSONPatch: {error}"))
        }
    }
}

/// What a namespace's ResourceQuota would say to the reservation Pod of `vm` at `size`
/// (vCPU, MiB), asked with a dry-run create: `Some(message)` when it refuses. Any other
/// answer (admitted, another refusal, no answer) lets the VM in: placement asks again for
/// real, and only a quota holds a VM back.
async fn quota_preview(
    client: &kube::Client,
    namespace: &str,
    vm: &ImpVM,
    size: (i64, i64),
) -> Option<String> {
    use crate::placement::reservation::{self, PodSettings, Reservation};
    use k8s_openapi::api::core::v1::Pod;
    let name = vm
        .metadata
        .name
        .clone()
        .or_else(|| vm.metadata.generate_name.clone())
        .unwrap_or_default();
    // Not created, so no uid yet; a node is chosen later.
    let r = Reservation::of(namespace, &name, PREVIEW_UID, "-", size, false, true)?;
    let mut pod = reservation::pod(&r, &PodSettings::default());
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = None;
        spec.priority_class_name = None;
    }
    pod.metadata.name = None;
    pod.metadata.generate_name = Some("imp-vm-preview-".to_owned());
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let params = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    let answer = tokio::time::timeout(PREVIEW_TIMEOUT, api.create(&params, &pod)).await;
    match answer {
        Ok(Err(kube::Error::Api(s))) if imp_api::refusal::quota(&s).is_some() => Some(format!(
            "spec.classRef: the VM's {} vCPU and {}MiB would exceed a ResourceQuota of \
                 namespace {namespace} (VMs count through their reservation Pods): {}",
            size.0, size.1, s.message
        )),
        Ok(Err(e)) => {
            tracing::debug!(namespace, vm = %name, error = %imp_api::chain::DisplayChain(&e), "quota preview not conclusive");
            None
        }
        Ok(Ok(_)) => None,
        Err(_) => {
            tracing::debug!(namespace, vm = %name, "quota preview: no answer in time");
            None
        }
    }
}

/// The owner uid of a previewed reservation Pod (never stored: the create is a dry run).
const PREVIEW_UID: &str = "00000000-0000-0000-0000-000000000000";

/// Resolves template then class for `spec`; a missing or unreadable object adds a warning.
/// Also gives the class's size (vCPU, MiB) when the class was read.
async fn inherit(
    client: &kube::Client,
    namespace: &str,
    spec: &ImpVMSpec,
    warnings: &mut Vec<String>,
) -> (ImpVMSpec, Option<(i64, i64)>) {
    let mut size = None;
    let mut merged = spec.clone();
    let mut class_name = spec.class_ref.as_ref().map(|c| c.name.clone());
    if let Some(t) = &spec.template_ref {
        let api: Api<ImpVMTemplate> = Api::namespaced(client.clone(), namespace);
        match lookup(api.get_opt(&t.name)).await {
            Ok(Some(template)) => {
                merged = crate::resolve::apply_template(spec, &template.spec);
                class_name = Some(template.spec.class_ref.name.clone());
            }
            Ok(None) => warnings.push(format!(
                "ImpVMTemplate {namespace}/{} not found: create it; the operator keeps the VM Pending and applies its values once it exists",
                t.name
            )),
            Err(error) => {
                tracing::warn!(namespace, template = %t.name, %error, "reading the template at admission failed");
                warnings.push(format!(
                    "Could not read ImpVMTemplate {namespace}/{} ({error}); the operator resolves its values later",
                    t.name
                ));
            }
        }
    }
    if let Some(class) = class_name {
        let api: Api<ImpVMClass> = Api::all(client.clone());
        match lookup(api.get_opt(&class)).await {
            Ok(Some(c)) => {
                merged = crate::resolve::apply_class(&merged, &c.spec);
                size = Some((i64::from(c.spec.vcpu), i64::from(c.spec.memory_mib)));
            }
            Ok(None) => warnings.push(format!(
                "ImpVMClass {class} not found: create it; the operator keeps the VM Pending and applies its values once it exists"
            )),
            Err(error) => {
                tracing::warn!(%class, %error, "reading the class at admission failed");
                warnings.push(format!(
                    "Could not read ImpVMClass {class} ({error}); the operator resolves its values later"
                ));
            }
        }
    }
    // classRef stays as the user wrote it: a VM with both classRef and templateRef is invalid.
    merged.class_ref.clone_from(&spec.class_ref);
    (merged, size)
}

async fn lookup<T>(
    get: impl Future<Output = Result<Option<T>, kube::Error>>,
) -> Result<Option<T>, String> {
    match tokio::time::timeout(LOOKUP_TIMEOUT, get).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {LOOKUP_TIMEOUT:?}")),
    }
}

/// JSONPatch `add` operations (which replace an existing member) for each defaulted field whose
/// resolved value differs from what the request holds.
fn default_patch(raw_spec: Option<&Value>, resolved: &ImpVMSpec) -> Patch {
    let mut ops = Vec::new();
    let Ok(Value::Object(resolved)) = serde_json::to_value(resolved) else {
        return Patch(ops);
    };
    let raw = raw_spec.and_then(Value::as_object);
    if raw.is_none() {
        // No spec at all: nothing to default into (validation denies it).
        return Patch(ops);
    }
    for field in DEFAULTED_FIELDS {
        let Some(value) = resolved.get(field) else {
            continue;
        };
        if raw.and_then(|r| r.get(field)) == Some(value) {
            continue;
        }
        ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["spec", field]),
            value: value.clone(),
        }));
    }
    Patch(ops)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn review(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn review_without_request_or_of_the_wrong_kind_is_refused() {
        let e = decode_review(&review(serde_json::json!({
            "kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"
        })))
        .unwrap_err();
        assert!(e.contains("no request"), "{e}");
        let e = decode_review(&review(serde_json::json!({
            "kind": "Pod", "apiVersion": "v1"
        })))
        .unwrap_err();
        assert!(e.contains("got kind \"Pod\""), "{e}");
        let e = decode_review(b"{not json").unwrap_err();
        assert!(e.starts_with("Decoding the AdmissionReview JSON"), "{e}");
    }

    #[test]
    fn patch_adds_only_fields_that_differ() {
        let raw = serde_json::json!({"templateRef": {"name": "t"}, "lifecycle": "ephemeral"});
        let mut spec: ImpVMSpec = serde_json::from_value(raw.clone()).unwrap();
        spec.inherited.expire_after = Some(imp_api::duration::GoDuration("10m".into()));
        let p = default_patch(Some(&raw), &spec);
        assert_eq!(p.0.len(), 1, "{p:?}");
        let PatchOperation::Add(op) = &p.0[0] else {
            panic!("expected add, got {p:?}")
        };
        assert_eq!(op.path.to_string(), "/spec/expireAfter");
        assert_eq!(op.value, serde_json::json!("10m"));
    }

    #[test]
    fn node_name_only_change_is_detected() {
        let a: ImpVMSpec = serde_json::from_value(
            serde_json::json!({"classRef": {"name": "c"}, "image": "x", "nodeName": "n1"}),
        )
        .unwrap();
        let mut b = a.clone();
        b.node_name = None;
        assert!(only_node_name_changed(&a, &b));
        b.inherited.image = Some("y".into());
        assert!(!only_node_name_changed(&a, &b));
    }
}
