//! The requests that reach the shim while it works: a stop (SIGTERM, SIGINT or the API), a
//! suspend (SIGUSR1 or the API), a snapshot, a claim and a pause (the API), and the grace a stop gives
//! the guest.

use std::path::Path;
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};

use super::super::contract::STOP_GRACE_FILE;
use super::serve;

/// SIGTERM and SIGINT (stop), and SIGUSR1 (suspend, see [`suspend`](super::suspend)),
/// installed before anything else so no request is lost, and a stop asked on the shim's API
/// ([`serve`]).
pub(super) struct StopSignals {
    pub(super) term: Signal,
    pub(super) int: Signal,
    pub(super) usr1: Signal,
    pub(super) asked: std::sync::Arc<tokio::sync::Notify>,
    /// Snapshots asked on the API, answered by the supervision loop.
    pub(super) snapshots: tokio::sync::mpsc::Receiver<serve::SnapshotAsked>,
    pub(super) snapshots_tx: tokio::sync::mpsc::Sender<serve::SnapshotAsked>,
    /// Suspends asked on the API (their tokens), taken by the supervision loop.
    pub(super) suspends: tokio::sync::mpsc::Receiver<String>,
    pub(super) suspends_tx: tokio::sync::mpsc::Sender<String>,
    /// Claims asked on the API, answered by the supervision loop.
    pub(super) claims: tokio::sync::mpsc::Receiver<serve::ClaimAsked>,
    pub(super) claims_tx: tokio::sync::mpsc::Sender<serve::ClaimAsked>,
    /// Pauses asked on the API, answered by the supervision loop.
    pub(super) pauses: tokio::sync::mpsc::Receiver<serve::PauseAsked>,
    pub(super) pauses_tx: tokio::sync::mpsc::Sender<serve::PauseAsked>,
}

impl StopSignals {
    pub(super) fn install() -> std::io::Result<Self> {
        let (snapshots_tx, snapshots) = tokio::sync::mpsc::channel(4);
        let (suspends_tx, suspends) = tokio::sync::mpsc::channel(4);
        let (claims_tx, claims) = tokio::sync::mpsc::channel(1);
        let (pauses_tx, pauses) = tokio::sync::mpsc::channel(1);
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            usr1: signal(SignalKind::user_defined1())?,
            asked: Default::default(),
            snapshots,
            snapshots_tx,
            suspends,
            suspends_tx,
            claims,
            claims_tx,
            pauses,
            pauses_tx,
        })
    }

    pub(super) async fn requested(&mut self) {
        either(&mut self.term, &mut self.int, &self.asked).await;
    }
}

/// Waits for SIGTERM, SIGINT or a stop asked on the API.
pub(super) async fn either(term: &mut Signal, int: &mut Signal, asked: &tokio::sync::Notify) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        () = asked.notified() => {}
    }
}

pub(super) async fn stop_grace(dir: &Path) -> Duration {
    tokio::fs::read_to_string(dir.join(STOP_GRACE_FILE))
        .await
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(10))
}
