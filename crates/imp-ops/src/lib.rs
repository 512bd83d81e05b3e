//! The ops server of imp's long-running processes, the operator and the node agent alike:
//! `/metrics` (the process's registry as OpenMetrics text), `/healthz` and `/readyz` (200
//! `ok`, or 503 with the one-line reason it is not). Each process keeps its own registry and
//! says how to render it ([`Exposition`]); liveness and readiness are a [`Health`] both
//! share.

pub mod trace;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
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
}

/// The ops routes (`/metrics`, `/healthz`, `/readyz`), for embedding in another server.
pub fn router(metrics: Arc<dyn Exposition>, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Ops { metrics, health })
}

async fn metrics_handler(State(ops): State<Ops>) -> Response {
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
    let addr = listener.local_addr().map_err(|source| OpsError::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    axum::serve(listener, router(metrics, health))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| OpsError::Serve { addr, source })
}

#[cfg(test)]
mod tests {
    use super::*;

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
