//! The front ends' side of a snapshot of a running VM that runs on (an ImpVMSnapshot
//! execution, [`take`]): asked on the shim's API, which answers with the outcome; a shim of the
//! previous release, without the API, gets a file in the VM's directory
//! ([`contract::SNAPSHOT_REQUEST_FILE`], naming the destination and a token) plus the request
//! signal ([`request`]) and answers in [`contract::SNAPSHOT_OUTCOME_FILE`] ([`wait`]). The
//! shim's side is `runtime::shim::snapshot`.

use std::path::Path;
use std::time::Duration;

use super::super::contract::{
    self, SNAPSHOT_OUTCOME_FILE, SNAPSHOT_REQUEST_FILE, SnapshotOutcome, SnapshotRequest,
};
use super::super::state::{self, StateDir, StateError, VmRecord, VmStatus};
use super::{ShimError, client, signal};
use crate::snapshot::{self as format, Manifest};

/// Failures of a snapshot request, seen from the front end.
#[derive(Debug, thiserror::Error)]
pub enum TakeError {
    /// The VM does not run.
    #[error("VM {id} cannot be snapshotted: it is {status}")]
    NotRunning {
        /// The VM.
        id: String,
        /// What it is.
        status: &'static str,
    },
    /// Its files could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// Its shim could not be signalled.
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// The shim tried and failed; the VM runs on.
    #[error("snapshot of VM {id} failed: {error}")]
    Failed {
        /// The VM.
        id: String,
        /// Why.
        error: String,
    },
    /// The shim's API failed (or gave no answer in time).
    #[error("snapshot of VM {id} through its shim's API")]
    Api {
        /// The VM.
        id: String,
        /// The cause.
        #[source]
        source: crate::runtime::shim_api::WireError,
    },
    /// No answer in time, or the shim died.
    #[error("snapshot of VM {id} got no answer within {waited:?}{died}")]
    NoAnswer {
        /// The VM.
        id: String,
        /// How long we waited.
        waited: Duration,
        /// ", its supervisor died" when it did.
        died: &'static str,
    },
}

/// Snapshots VM `record` into `dest` and waits up to `timeout` for the outcome: through its
/// shim's API, or for a shim without one (of the previous release), by request file and signal.
/// Returns the manifest and the bytes written.
pub async fn take(
    state: &StateDir,
    record: &VmRecord,
    dest: &Path,
    source: format::Source,
    timeout: Duration,
) -> Result<(Manifest, u64), TakeError> {
    running(record)?;
    let req = SnapshotRequest {
        token: format!("{}-{}", std::process::id(), state::now_unix_nanos()),
        dest: dest.to_path_buf(),
        source,
    };
    tracing::info!(vm = %record.name, dest = %dest.display(), "snapshot requested");
    let dir = state.vm_dir(&record.name);
    let outcome = match client::snapshot(&dir, req.clone(), timeout).await {
        Ok(Some(o)) => o,
        Ok(None) => {
            let token = request(state, record, req)?;
            return wait(state, &record.name, &token, timeout).await;
        }
        Err(e) => {
            return Err(TakeError::Api {
                id: record.name.clone(),
                source: e,
            });
        }
    };
    outcome
        .result
        .map(|m| (m, outcome.bytes))
        .map_err(|error| TakeError::Failed {
            id: record.name.clone(),
            error,
        })
}

/// Refuses a VM that does not run, or whose shim died.
fn running(record: &VmRecord) -> Result<(), TakeError> {
    if record.status == VmStatus::Running && record.supervisor_alive() {
        return Ok(());
    }
    Err(TakeError::NotRunning {
        id: record.name.clone(),
        status: if record.status == VmStatus::Running {
            "lost (its supervisor died)"
        } else {
            record.status.as_str()
        },
    })
}

/// Asks VM `record`'s shim for `req` by file and signal; returns the token to wait for.
fn request(state: &StateDir, record: &VmRecord, req: SnapshotRequest) -> Result<String, TakeError> {
    let dir = state.vm_dir(&record.name);
    let _ = std::fs::remove_file(dir.join(SNAPSHOT_OUTCOME_FILE));
    state::write_json(&dir.join(SNAPSHOT_REQUEST_FILE), &req)?;
    signal(record, contract::REQUEST_SIGNAL)?;
    Ok(req.token)
}

/// Waits for the shim's answer (the outcome file) to the request `token` of VM `id`.
async fn wait(
    state: &StateDir,
    id: &str,
    token: &str,
    timeout: Duration,
) -> Result<(Manifest, u64), TakeError> {
    let path = state.vm_dir(id).join(SNAPSHOT_OUTCOME_FILE);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut died = false;
    loop {
        if let Ok(o) = state::read_json::<SnapshotOutcome>(&path)
            && o.token == token
        {
            return o
                .result
                .map(|m| (m, o.bytes))
                .map_err(|error| TakeError::Failed {
                    id: id.to_owned(),
                    error,
                });
        }
        let alive = state
            .load(id)
            .map(|r| r.supervisor_alive())
            .unwrap_or(false);
        // The shim answers before it could die: read once more after it is gone.
        if !alive && died || tokio::time::Instant::now() > deadline {
            return Err(TakeError::NoAnswer {
                id: id.to_owned(),
                waited: timeout,
                died: if alive { "" } else { ", its supervisor died" },
            });
        }
        died = !alive;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
