//! The ops server of imp's long-running processes, the operator and the node agent alike:
//! `/metrics` (the process's registry as OpenMetrics text), `/healthz` and `/readyz` (200
//! `ok`, or 503 with the one-line reason it is not). Each process keeps its own registry and
//! says how to render it ([`Exposition`]); liveness and readiness are a [`Health`] both
//! share. `/metrics` may be guarded ([`Guard`]: the agent's asks the API server whether the
//! caller's token may `get /metrics`); the health routes never are (the kubelet probes them).

pub mod fault;
pub mod trace;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;

/// The content type of `/metrics`.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why the ops server could not serve.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The listening socket could not be bound.
    #[error("Binding the metrics and health server to {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The server stopped with an I/O error.
    #[error("Serving metrics and health on {addr}")]
    Serve {
        /// The address served.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Why a scrape of `/metrics` is refused: its status (401, 403, 503) and a one-line message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status.
    pub status: StatusCode,
    /// What to do about it.
    pub message: String,
}

/// What a guard's decision is awaited as.
pub type Admission<'a> = Pin<Box<dyn Future<Output = Result<(), Refusal>> + Send + 'a>>;

/// Decides who may read `/metrics`: the caller's address and the request's headers.
pub trait Guard: Send + Sync + 'static {
    /// Admits the scrape or says why not.
    fn admit<'a>(
        &'a self,
        peer: Option<SocketAddr>,
        headers: &'a axum::http::HeaderMap,
    ) -> Admission<'a>;
}

/// A process's metrics registry, rendered for `/metrics`.
pub trait Exposition: Send + Sync + 'static {
    /// The registry as OpenMetrics text.
    fn render(&self) -> Result<String, std::fmt::Error>;
}

/// Liveness and readiness verdicts, each `Ok` or a one-line reason it is not.
#[derive(Debug)]
pub struct Health {
    live: Mutex<Option<String>>,
    ready: Mutex<Option<String>>,
    /// Parts that hold readiness back on their own (the webhook until it serves), by name.
    held: Mutex<std::collections::BTreeMap<&'static str, String>>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// Live, and not ready yet ("starting").
    pub fn new() -> Self {
        Self {
            live: Mutex::new(None),
            ready: Mutex::new(Some("starting".to_string())),
            held: Mutex::new(std::collections::BTreeMap::new()),
        }
    }

    /// Marks the process live (`/healthz` answers 200).
    pub fn set_live(&self) {
        *lock(&self.live) = None;
    }

    /// Marks the process not live (`/healthz` answers 503 with `reason`): it should be restarted.
    pub fn set_not_live(&self, reason: impl Into<String>) {
        *lock(&self.live) = Some(one_line(reason.into()));
    }

    /// Marks the process ready (`/readyz` answers 200).
    pub fn set_ready(&self) {
        *lock(&self.ready) = None;
    }

    /// Marks the process not ready (`/readyz` answers 503 with `reason`).
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        *lock(&self.ready) = Some(one_line(reason.into()));
    }

    /// Ready when `problem` is `None`, else not ready for that reason.
    pub fn set_readiness(&self, problem: Option<String>) {
        match problem {
            None => self.set_ready(),
            Some(why) => self.set_not_ready(why),
        }
    }

    /// `Ok` when live, else the reason.
    pub fn liveness(&self) -> Result<(), String> {
        lock(&self.live).clone().map_or(Ok(()), Err)
    }

    /// Holds readiness back while `part` is not there (`reason` says why), whatever
    /// [`Health::set_ready`] says: a replica whose webhook does not serve yet must get no
    /// admission traffic.
    pub fn hold(&self, part: &'static str, reason: impl Into<String>) {
        lock(&self.held).insert(part, one_line(reason.into()));
    }

    /// `part` no longer holds readiness back.
    pub fn release(&self, part: &'static str) {
        lock(&self.held).remove(part);
    }

    /// `Ok` when ready and nothing holds readiness back, else the reason.
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(why) = lock(&self.ready).clone() {
            return Err(why);
        }
        lock(&self.held)
            .iter()
            .next()
            .map_or(Ok(()), |(part, why)| Err(format!("{part}: {why}")))
    }
}

fn one_line(s: String) -> String {
    s.lines().map(str::trim).collect::<Vec<_>>().join(" ")
}

/// A poisoned lock only means a panic elsewhere while holding it; the data is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Clone)]
struct Ops {
    metrics: Arc<dyn Exposition>,
    health: Arc<Health>,
    guard: Option<Arc<dyn Guard>>,
}

/// The ops routes (`/metrics`, `/healthz`, `/readyz`), for embedding in another server.
pub fn router(metrics: Arc<dyn Exposition>, health: Arc<Health>) -> Router {
    guarded_router(metrics, health, None)
}

/// [`router`] with `/metrics` behind `guard` (served with the callers' addresses, see
/// [`serve_listener_guarded`]).
pub fn guarded_router(
    metrics: Arc<dyn Exposition>,
    health: Arc<Health>,
    guard: Option<Arc<dyn Guard>>,
) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Ops {
            metrics,
            health,
            guard,
        })
}

async fn metrics_handler(State(ops): State<Ops>, req: Request) -> Response {
    if let Some(guard) = &ops.guard {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        if let Err(refusal) = guard.admit(peer, req.headers()).await {
            tracing::info!(peer = ?peer, status = %refusal.status, message = %refusal.message,
                "a scrape of /metrics was refused");
            return (refusal.status, format!("{}\n", refusal.message)).into_response();
        }
    }
    match ops.metrics.render() {
        Ok(body) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics failed");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
        }
    }
}

fn verdict(v: Result<(), String>, what: &str) -> Response {
    match v {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not {what}: {reason}\n"),
        )
            .into_response(),
    }
}

async fn healthz(State(ops): State<Ops>) -> Response {
    verdict(ops.health.liveness(), "live")
}

async fn readyz(State(ops): State<Ops>) -> Response {
    verdict(ops.health.readiness(), "ready")
}

/// Binds `addr` for the ops server.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, OpsError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| OpsError::Bind { addr, source })
}

/// Binds `addr` and serves the ops routes until `shutdown` completes.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<dyn Exposition>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OpsError> {
    let listener = bind(addr).await?;
    serve_listener(listener, metrics, health, shutdown).await
}

/// Serves the ops routes on an already bound listener (tests bind 127.0.0.1:0 and read the port).
pub async fn serve_listener(
    listener: TcpListener,
    metrics: Arc<dyn Exposition>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OpsError> {
    serve_listener_guarded(listener, metrics, health, None, shutdown).await
}

/// [`serve_listener`] with `/metrics` behind `guard`.
pub async fn serve_listener_guarded(
    listener: TcpListener,
    metrics: Arc<dyn Exposition>,
    health: Arc<Health>,
    guard: Option<Arc<dyn Guard>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OpsError> {
    let addr = listener.local_addr().map_err(|source| OpsError::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    tracing::info!(%addr, guarded = guard.is_some(), "serving /metrics, /healthz and /readyz");
    let app = guarded_router(metrics, health, guard);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
    .map_err(|source| OpsError::Serve { addr, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Figures;
    impl Exposition for Figures {
        fn render(&self) -> Result<String, std::fmt::Error> {
            Ok("up 1\n".into())
        }
    }

    /// Admits a scrape that carries `Authorization: Bearer ok` from a known address.
    struct Token;
    impl Guard for Token {
        fn admit<'a>(
            &'a self,
            peer: Option<SocketAddr>,
            headers: &'a axum::http::HeaderMap,
        ) -> Admission<'a> {
            let bearer = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            let verdict = match (peer, bearer) {
                (None, _) => Err(Refusal {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "no peer address".into(),
                }),
                (Some(_), Some("Bearer ok")) => Ok(()),
                _ => Err(Refusal {
                    status: StatusCode::UNAUTHORIZED,
                    message: "a token please".into(),
                }),
            };
            Box::pin(async move { verdict })
        }
    }

    async fn get(port: u16, path: &str, extra: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let req = format!("GET {path} HTTP/1.0\r\n{extra}\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn a_guard_holds_metrics_with_the_callers_address_and_never_the_probes() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let health = Arc::new(Health::new());
        health.set_ready();
        let guard: Arc<dyn Guard> = Arc::new(Token);
        tokio::spawn(serve_listener_guarded(
            listener,
            Arc::new(Figures),
            health,
            Some(guard),
            std::future::pending(),
        ));
        let refused = get(port, "/metrics", "").await;
        assert!(refused.starts_with("HTTP/1.0 401"), "{refused}");
        assert!(
            refused.ends_with("a token please\n") && !refused.contains("up 1"),
            "{refused}"
        );
        let served = get(port, "/metrics", "Authorization: Bearer ok\r\n").await;
        assert!(
            served.starts_with("HTTP/1.0 200") && served.ends_with("up 1\n"),
            "{served}"
        );
        for probe in ["/healthz", "/readyz"] {
            let answer = get(port, probe, "").await;
            assert!(answer.starts_with("HTTP/1.0 200"), "{probe}: {answer}");
        }
    }

    #[test]
    fn a_held_part_keeps_a_ready_process_unready_until_released() {
        let h = Health::new();
        h.hold("webhook", "no serving\n certificate yet");
        h.set_ready();
        assert_eq!(
            h.readiness(),
            Err("webhook: no serving certificate yet".into())
        );
        h.release("webhook");
        assert_eq!(h.readiness(), Ok(()));
    }

    #[test]
    fn health_starts_live_but_not_ready_and_keeps_one_line_reasons() {
        let h = Health::new();
        assert_eq!(h.liveness(), Ok(()));
        assert_eq!(h.readiness(), Err("starting".into()));
        h.set_ready();
        assert_eq!(h.readiness(), Ok(()));
        h.set_not_ready("caches\n  not synced");
        assert_eq!(h.readiness(), Err("caches not synced".into()));
        h.set_readiness(Some("no KVM".into()));
        assert_eq!(h.readiness(), Err("no KVM".into()));
        h.set_readiness(None);
        assert_eq!(h.readiness(), Ok(()));
        h.set_not_live("watch task died");
        assert_eq!(h.liveness(), Err("watch task died".into()));
        h.set_live();
        assert_eq!(h.liveness(), Ok(()));
    }
}
