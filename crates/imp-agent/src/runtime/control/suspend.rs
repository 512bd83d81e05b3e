//! The front ends' side of suspend and resume: a running VM is paused, its full snapshot (device state and memory) is
//! written under `snapshots/<id>/` of the state directory, and its VMM and shim end, so the
//! VM costs no memory; a new shim later restores it from that snapshot in a new VMM process on
//! the same machine. The VM's disk, TAP, bridge port and address are left as they are (nothing
//! here unwires the network), so the restored guest finds its devices where it left them.
//!
//! Both front ends (`imp suspend|resume`, the node agent) use the request side here: a
//! suspend is asked on the shim's API (or, of a shim without one, is a request file in the
//! VM's directory plus SIGUSR1), and the shim, which owns the VMM, does the work (`runtime::shim::suspend` inside the shim); a resume starts a new shim for the
//! suspended VM ([`start_resume`]), which sees the record's `resuming` status and restores.
//! The decisions (is there room for the snapshot, may this VM be suspended or resumed now) are
//! pure functions with unit tests.

use std::time::Duration;

use super::super::contract::{REQUEST_SIGNAL, SUSPEND_REQUEST_FILE};
use super::super::state::{self, StateDir, StateError, VmRecord, VmStatus};
use super::{ShimCommand, ShimError, client, off_runtime};

/// Failures of a suspend or resume request.
#[derive(Debug, thiserror::Error)]
pub enum SuspendError {
    /// The VM is not in a state the operation applies to.
    #[error("VM {id} cannot be {op}: it is {status}{hint}")]
    WrongStatus {
        /// The VM.
        id: String,
        /// `suspended` or `resumed`.
        op: &'static str,
        /// What it is.
        status: &'static str,
        /// What to do instead, if anything.
        hint: &'static str,
    },
    /// The VM's files could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// The shim could not be signalled or started.
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// The shim's API failed.
    #[error("asking the shim of VM {id} to suspend it")]
    Api {
        /// The VM.
        id: String,
        /// The cause.
        #[source]
        source: crate::runtime::shim_api::WireError,
    },
    /// The shim tried and failed; for a suspend the VM runs on.
    #[error("{op} VM {id} failed: {error}")]
    Failed {
        /// The VM.
        id: String,
        /// `suspending` or `resuming`.
        op: &'static str,
        /// Why, as the shim recorded it.
        error: String,
    },
    /// The shim ended without recording an outcome.
    #[error("the supervisor of VM {id} died while {op} it")]
    ShimDied {
        /// The VM.
        id: String,
        /// `suspending` or `resuming`.
        op: &'static str,
    },
    /// No outcome within the deadline.
    #[error("VM {id} was not {want} within {waited:?} (it is {status})")]
    Timeout {
        /// The VM.
        id: String,
        /// `suspended` or `running`.
        want: &'static str,
        /// How long we waited.
        waited: Duration,
        /// What it was then.
        status: &'static str,
    },
}

/// This module's result type.
pub type Result<T, E = SuspendError> = std::result::Result<T, E>;

/// Why a VM with `status` (its shim alive or not) cannot be suspended now, if it cannot.
pub fn refuse_suspend(status: VmStatus, shim_alive: bool) -> Option<(&'static str, &'static str)> {
    match status {
        VmStatus::Running if shim_alive => None,
        VmStatus::Running => Some(("lost (its supervisor died)", "")),
        VmStatus::Suspended => Some(("suspended already", "; `imp resume` wakes it")),
        VmStatus::Suspending => Some(("being suspended already", "")),
        VmStatus::Resuming => Some(("resuming", "; suspend it once it runs")),
        VmStatus::Starting => Some(("starting", "; suspend it once it runs")),
        s => Some((s.as_str(), "")),
    }
}

/// Why a VM with `status` cannot be resumed now, if it cannot.
pub fn refuse_resume(status: VmStatus, shim_alive: bool) -> Option<(&'static str, &'static str)> {
    match status {
        VmStatus::Suspended if !shim_alive => None,
        VmStatus::Suspended => Some(("still being suspended", "")),
        VmStatus::Running => Some(("running, not suspended", "")),
        VmStatus::Resuming => Some(("resuming already", "")),
        VmStatus::Suspending => Some(("being suspended", "; resume it once it is suspended")),
        s => Some((s.as_str(), "")),
    }
}

/// Asks the shim of `record` to suspend its VM, on its API or, for a shim without one, by
/// request file and signal; returns the request's token, which a failure recorded by the shim
/// names ([`wait_suspended`]).
pub async fn request_suspend(state: &StateDir, record: &VmRecord) -> Result<String> {
    let alive = record.supervisor_alive();
    if let Some((status, hint)) = refuse_suspend(record.status, alive) {
        return Err(SuspendError::WrongStatus {
            id: record.name.clone(),
            op: "suspended",
            status,
            hint,
        });
    }
    let token = format!("{}-{}", std::process::id(), state::now_unix_nanos());
    let dir = state.vm_dir(&record.name);
    let asked = client::suspend(&dir, &token)
        .await
        .map_err(|source| SuspendError::Api {
            id: record.name.clone(),
            source,
        })?;
    if !asked {
        let (path, t) = (dir.join(SUSPEND_REQUEST_FILE), token.clone());
        let write = move || state::write_json(&path, &t);
        off_runtime(
            "waiting for the write of",
            dir.join(SUSPEND_REQUEST_FILE),
            write,
        )
        .await?;
        super::signal(record, REQUEST_SIGNAL)?;
    }
    tracing::info!(vm = %record.name, token, "suspend requested");
    Ok(token)
}

/// What a wait saw in the record, decided without I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Not yet.
    Pending,
    /// The wanted status is reached.
    Done,
    /// The shim recorded a failure.
    Failed(String),
    /// The shim died before an outcome.
    ShimDied,
}

/// How far a suspend with `token` has come, from the record and whether its shim lives.
pub fn suspend_progress(record: &VmRecord, alive: bool, token: &str) -> Progress {
    if record.status == VmStatus::Suspended {
        return Progress::Done;
    }
    if let Some(f) = &record.suspend_failure
        && f.request == token
    {
        return Progress::Failed(f.error.clone());
    }
    if !alive {
        return Progress::ShimDied;
    }
    Progress::Pending
}

/// How far a resume has come.
pub fn resume_progress(record: &VmRecord, alive: bool) -> Progress {
    match record.status {
        VmStatus::Running if alive => Progress::Done,
        VmStatus::Failed | VmStatus::Exited => Progress::Failed(
            record
                .error
                .clone()
                .unwrap_or_else(|| format!("the VM {}", record.status.as_str())),
        ),
        _ if !alive => Progress::ShimDied,
        _ => Progress::Pending,
    }
}

/// Polls VM `id`'s record until `progress` says it is done or failed, for at most `timeout`.
async fn wait_for(
    state: &StateDir,
    id: &str,
    op: &'static str,
    want: &'static str,
    timeout: Duration,
    progress: impl Fn(&VmRecord, bool) -> Progress,
) -> Result<VmRecord> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut died_once = false;
    loop {
        let (st, name) = (state.clone(), id.to_owned());
        let read = move || {
            st.load(&name).map(|r| {
                let alive = r.supervisor_alive();
                (r, alive)
            })
        };
        let (record, alive) =
            off_runtime("waiting for the record of", state.vm_dir(id), read).await?;
        match progress(&record, alive) {
            Progress::Done => return Ok(record),
            Progress::Failed(error) => {
                return Err(SuspendError::Failed {
                    id: id.to_owned(),
                    op,
                    error,
                });
            }
            // The shim writes its outcome just before it exits: read once more.
            Progress::ShimDied if !died_once => died_once = true,
            Progress::ShimDied => {
                return Err(SuspendError::ShimDied {
                    id: id.to_owned(),
                    op,
                });
            }
            Progress::Pending => {}
        }
        if tokio::time::Instant::now() > deadline {
            return Err(SuspendError::Timeout {
                id: id.to_owned(),
                want,
                waited: timeout,
                status: record.status.as_str(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the suspend with `token` is done (the record says suspended) or failed.
pub async fn wait_suspended(
    state: &StateDir,
    id: &str,
    token: &str,
    timeout: Duration,
) -> Result<VmRecord> {
    wait_for(state, id, "suspending", "suspended", timeout, |r, alive| {
        suspend_progress(r, alive, token)
    })
    .await
}

/// Starts a new shim that restores suspended VM `record` from its snapshot, and records it as
/// the VM's shim (status `resuming`) before returning, so a second look never starts another.
/// `tap` is the VM's TAP as its sleeper held it (QEMU inherits it; see `net::sleeper`).
pub fn start_resume(
    cmd: &ShimCommand,
    state: &StateDir,
    record: &VmRecord,
    tap: Option<&std::os::fd::OwnedFd>,
) -> Result<u32> {
    if let Some((status, hint)) = refuse_resume(record.status, record.supervisor_alive()) {
        return Err(SuspendError::WrongStatus {
            id: record.name.clone(),
            op: "resumed",
            status,
            hint,
        });
    }
    let pid = super::spawn(cmd, state, &record.name, tap)?;
    let mut r = record.clone();
    r.status = VmStatus::Resuming;
    r.supervisor_pid = pid;
    r.supervisor_started = state::process_start_time(pid);
    r.suspend_failure = None;
    state.save(&r)?;
    tracing::info!(vm = %record.name, shim = pid, "resume started");
    Ok(pid)
}

/// Waits until a resumed VM runs again (the guest agent answered) or its resume failed.
pub async fn wait_resumed(state: &StateDir, id: &str, timeout: Duration) -> Result<VmRecord> {
    wait_for(state, id, "resuming", "running", timeout, resume_progress).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_a_running_vm_suspends_and_only_a_suspended_one_resumes() {
        assert_eq!(refuse_suspend(VmStatus::Running, true), None);
        let (what, hint) = refuse_suspend(VmStatus::Suspended, false).unwrap();
        assert!(what.contains("suspended already") && hint.contains("resume"));
        assert!(
            refuse_suspend(VmStatus::Running, false).is_some(),
            "dead shim"
        );
        for s in [
            VmStatus::Starting,
            VmStatus::Exited,
            VmStatus::Failed,
            VmStatus::Suspending,
            VmStatus::Resuming,
        ] {
            assert!(refuse_suspend(s, true).is_some(), "{s:?}");
        }
        assert_eq!(refuse_resume(VmStatus::Suspended, false), None);
        let (what, _) = refuse_resume(VmStatus::Running, true).unwrap();
        assert!(what.contains("not suspended"), "{what}");
        assert!(refuse_resume(VmStatus::Suspended, true).is_some());
        for s in [VmStatus::Exited, VmStatus::Failed, VmStatus::Resuming] {
            assert!(refuse_resume(s, false).is_some(), "{s:?}");
        }
    }

    fn record(status: VmStatus) -> VmRecord {
        crate::runtime::state::sample_record(status)
    }

    #[test]
    fn a_suspend_waits_for_its_own_outcome() {
        let mut r = record(VmStatus::Suspending);
        assert_eq!(suspend_progress(&r, true, "t1"), Progress::Pending);
        assert_eq!(suspend_progress(&r, false, "t1"), Progress::ShimDied);
        r.status = VmStatus::Running;
        r.suspend_failure = Some(state::SuspendFailure {
            request: "t0".into(),
            failed_unix: 1,
            error: "old".into(),
        });
        assert_eq!(
            suspend_progress(&r, true, "t1"),
            Progress::Pending,
            "an earlier request's failure is not this one's"
        );
        r.suspend_failure.as_mut().unwrap().request = "t1".into();
        assert_eq!(
            suspend_progress(&r, true, "t1"),
            Progress::Failed("old".into())
        );
        r.status = VmStatus::Suspended;
        assert_eq!(suspend_progress(&r, false, "t1"), Progress::Done);
    }

    #[test]
    fn a_resume_is_done_when_the_new_shim_says_running() {
        let mut r = record(VmStatus::Resuming);
        assert_eq!(resume_progress(&r, true), Progress::Pending);
        assert_eq!(resume_progress(&r, false), Progress::ShimDied);
        r.status = VmStatus::Running;
        assert_eq!(resume_progress(&r, true), Progress::Done);
        r.status = VmStatus::Failed;
        r.error = Some("restoring: the snapshot is corrupt".into());
        assert_eq!(
            resume_progress(&r, false),
            Progress::Failed("restoring: the snapshot is corrupt".into())
        );
    }
}
