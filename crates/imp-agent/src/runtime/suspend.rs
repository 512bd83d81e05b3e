//! Suspend and resume: a running VM is paused, its full snapshot (device state and memory) is
//! written under `snapshots/<id>/` of the state directory, and its VMM and shim end, so the
//! VM costs no memory; a new shim later restores it from that snapshot in a new VMM process on
//! the same machine. The VM's disk, TAP, bridge port and address are left as they are (nothing
//! here unwires the network), so the restored guest finds its devices where it left them.
//!
//! Both front ends (`imp suspend|resume`, the node agent) use the request side here: a
//! suspend is a request file in the VM's directory plus SIGUSR1 to its shim, which owns the
//! VMM and does the work ([`suspend_vm`] inside the shim); a resume starts a new shim for the
//! suspended VM ([`start_resume`]), which sees the record's `resuming` status and restores.
//! The decisions (is there room for the snapshot, may this VM be suspended or resumed now) are
//! pure functions with unit tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::shim::{self, ShimCommand, ShimError};
use super::state::{self, StateDir, StateError, SuspendRecord, VmRecord, VmStatus};
use crate::vmm::{SnapshotFiles, Vmm};

/// The request file a front end writes (holding its token) before it sends SIGUSR1.
pub const REQUEST_FILE: &str = "suspend-request";

/// Free disk space kept beyond the guest's memory when a snapshot is written: the device
/// state, and room for the node's other writes.
pub const SPACE_MARGIN_BYTES: u64 = 64 << 20;

/// How long a suspended VM's new shim waits for its starter to record it as the VM's shim.
const ADOPTION_WAIT: Duration = Duration::from_secs(5);

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

/// The snapshot files inside a VM's snapshot directory.
pub fn snapshot_files(dir: &Path) -> SnapshotFiles {
    SnapshotFiles {
        state: dir.join("vmstate"),
        memory: dir.join("memory"),
    }
}

/// Bytes a snapshot of a guest with `memory_mib` may need: its memory plus the margin.
pub fn space_needed(memory_mib: u32) -> u64 {
    (u64::from(memory_mib) << 20) + SPACE_MARGIN_BYTES
}

/// Whether `free` bytes hold the snapshot of a guest with `memory_mib`; the shortfall if not.
pub fn check_space(free: u64, memory_mib: u32) -> std::result::Result<(), u64> {
    let needed = space_needed(memory_mib);
    if free >= needed { Ok(()) } else { Err(needed) }
}

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

/// Asks the shim of `record` to suspend its VM; returns the request's token, which the
/// shim's outcome names ([`wait_suspended`]).
pub fn request_suspend(state: &StateDir, record: &VmRecord) -> Result<String> {
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
    let path = state.vm_dir(&record.name).join(REQUEST_FILE);
    state::write_json(&path, &token)?;
    shim::signal(record, nix::sys::signal::Signal::SIGUSR1)?;
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
        let read = tokio::task::spawn_blocking(move || {
            st.load(&name).map(|r| {
                let alive = r.supervisor_alive();
                (r, alive)
            })
        })
        .await
        .map_err(|e| StateError::Io {
            action: "waiting for the record of",
            path: state.vm_dir(id),
            source: std::io::Error::other(e),
        })??;
        let (record, alive) = read;
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
    let pid = shim::spawn(cmd, state, &record.name, tap)?;
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

/// In a new shim: whether this shim was started to resume the VM, waiting briefly for its
/// starter to record it ([`start_resume`] writes the record just after the spawn).
pub async fn adopted_for_resume(state: &StateDir, id: &str) -> Option<VmRecord> {
    let me = std::process::id();
    let deadline = tokio::time::Instant::now() + ADOPTION_WAIT;
    loop {
        let record = state.load(id).ok()?;
        match record.status {
            VmStatus::Resuming if record.supervisor_pid == me => return Some(record),
            VmStatus::Suspended | VmStatus::Resuming if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The starter died before recording us: the snapshot is still the VM's.
            VmStatus::Suspended => return Some(record),
            _ => return None,
        }
    }
}

/// In the shim: takes the pending suspend request's token, if there is one.
pub fn take_request(dir: &Path) -> Option<String> {
    let path = dir.join(REQUEST_FILE);
    let token: String = state::read_json(&path).ok()?;
    let _ = std::fs::remove_file(&path);
    Some(token)
}

/// Free bytes for unprivileged writers in the file system of `dir`.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

/// Bytes of the files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Why a suspend in the shim failed; the VM runs on.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The snapshot directory could not be prepared or measured.
    #[error("{action} {}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not enough free disk space.
    #[error(
        "not enough free disk space for the snapshot in {}: {free_mib} MiB free, {needed_mib} MiB needed (guest memory + {} MiB)",
        dir.display(), SPACE_MARGIN_BYTES >> 20
    )]
    NoSpace {
        /// The snapshot directory.
        dir: PathBuf,
        /// Free MiB.
        free_mib: u64,
        /// Needed MiB.
        needed_mib: u64,
    },
    /// The VMM refused or failed a step; `resumed` says whether the guest runs again.
    #[error("{step} the VM{}", if *resumed { "" } else { " (and resuming it failed too)" })]
    Vmm {
        /// `pausing`, `snapshotting`.
        step: &'static str,
        /// Whether the VM was resumed after the failure.
        resumed: bool,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// In the shim: checks the free space, pauses `vm` and writes its full snapshot into `dir`.
/// On failure the VM is resumed (if it was paused) and the snapshot's remains removed.
pub async fn suspend_vm<V: Vmm>(
    vm: &mut V,
    dir: &Path,
    memory_mib: u32,
) -> std::result::Result<SuspendRecord, SnapshotError> {
    let d = dir.to_path_buf();
    let prepared = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)?;
        free_bytes(&d)
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r);
    let free = prepared.map_err(|source| SnapshotError::Io {
        action: "preparing the snapshot directory",
        path: dir.to_path_buf(),
        source,
    })?;
    if let Err(needed) = check_space(free, memory_mib) {
        let _ = std::fs::remove_dir(dir);
        return Err(SnapshotError::NoSpace {
            dir: dir.to_path_buf(),
            free_mib: free >> 20,
            needed_mib: needed >> 20,
        });
    }
    if let Err(e) = vm.pause().await {
        return Err(SnapshotError::Vmm {
            step: "pausing",
            resumed: true,
            source: Box::new(e),
        });
    }
    let files = snapshot_files(dir);
    if let Err(e) = vm.snapshot(&files).await {
        let resumed = vm.resume().await.is_ok();
        let d = dir.to_path_buf();
        let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(d)).await;
        return Err(SnapshotError::Vmm {
            step: "snapshotting",
            resumed,
            source: Box::new(e),
        });
    }
    let d = dir.to_path_buf();
    let bytes = tokio::task::spawn_blocking(move || dir_bytes(&d))
        .await
        .unwrap_or(0);
    Ok(SuspendRecord {
        snapshot_dir: dir.to_path_buf(),
        suspended_unix: state::now_unix(),
        bytes,
        // The supervisor, which knows the VMM, names the writer.
        vmm: None,
    })
}

/// Writes a stopped VM's RAM file back to disk and drops it from the page cache, so that a
/// sleeping VM holds no memory; returns the bytes of it that hold data (the pages the
/// guest touched; the rest are reserved but unwritten). Blocking: run it off the async runtime.
pub fn release_memory_file(file: &Path) -> std::io::Result<u64> {
    let f = std::fs::File::open(file)?;
    f.sync_data()?;
    nix::fcntl::posix_fadvise(
        &f,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .map_err(std::io::Error::from)?;
    crate::snapshot::sparse::data_bytes(file)
}

/// Whether a snapshot's files are present (what a restore needs before it starts a VMM).
pub fn snapshot_present(files: &SnapshotFiles) -> std::result::Result<(), PathBuf> {
    for f in [&files.state, &files.memory] {
        if !f.is_file() {
            return Err(f.clone());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_snapshot_needs_the_guest_memory_plus_a_margin() {
        let need = (256u64 << 20) + SPACE_MARGIN_BYTES;
        assert_eq!(space_needed(256), need);
        assert_eq!(check_space(need, 256), Ok(()));
        assert_eq!(check_space(need - 1, 256), Err(need));
        assert_eq!(check_space(0, 128), Err((128 << 20) + SPACE_MARGIN_BYTES));
    }

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
        serde_json::from_value(serde_json::json!({
            "name": "v", "image": "i", "digest": null, "runtime": "qemu",
            "supervisor_pid": 1, "vmm_pid": null, "vsock": "/v", "agent_port": 1,
            "serial_log": "/s", "created_unix": 0, "status": status, "exit_code": null,
            "error": null, "remove_on_exit": false,
        }))
        .unwrap()
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

    /// A VMM that records what it was asked and fails the step it is told to.
    struct FakeVmm {
        calls: Vec<&'static str>,
        fail_snapshot: bool,
        serial: PathBuf,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("fake VMM refused {0}")]
    struct FakeError(&'static str);

    impl Vmm for FakeVmm {
        type Launcher = ();
        type Stream = tokio::io::DuplexStream;
        type Error = FakeError;

        async fn boot(_: &(), _: &crate::vmm::VmConfig) -> Result<Self, FakeError> {
            Err(FakeError("boot"))
        }
        async fn restore(
            _: &(),
            _: &crate::vmm::VmConfig,
            _: &SnapshotFiles,
            _: bool,
        ) -> Result<Self, FakeError> {
            Err(FakeError("restore"))
        }
        async fn pause(&mut self) -> Result<(), FakeError> {
            self.calls.push("pause");
            Ok(())
        }
        async fn resume(&mut self) -> Result<(), FakeError> {
            self.calls.push("resume");
            Ok(())
        }
        async fn set_link(&mut self, _: bool) -> Result<(), FakeError> {
            self.calls.push("set_link");
            Ok(())
        }
        async fn snapshot(&mut self, files: &SnapshotFiles) -> Result<(), FakeError> {
            self.calls.push("snapshot");
            // Half-way: the memory file is written, then the VMM fails.
            std::fs::write(&files.memory, b"partial").unwrap();
            if self.fail_snapshot {
                return Err(FakeError("snapshot"));
            }
            std::fs::write(&files.state, b"state").unwrap();
            Ok(())
        }
        async fn stop(self, _: Duration) -> Result<crate::vmm::StopOutcome, FakeError> {
            Ok(crate::vmm::StopOutcome::Killed)
        }
        async fn connect_vsock(&self, _: u32, _: Duration) -> Result<Self::Stream, FakeError> {
            Err(FakeError("connect"))
        }
        fn vsock_path(&self) -> Option<PathBuf> {
            None
        }
        fn serial_log_path(&self) -> &Path {
            &self.serial
        }
        fn exited(&mut self) -> Result<bool, FakeError> {
            Ok(false)
        }
        fn state(&self) -> crate::vmm::VmState {
            crate::vmm::VmState::Running
        }
        fn pid(&self) -> Option<u32> {
            None
        }
    }

    #[tokio::test]
    async fn a_snapshot_failing_half_way_resumes_the_vm_and_leaves_no_files() {
        let dir = std::env::temp_dir().join(format!("imp-snap-fail-{}", std::process::id()));
        let mut vm = FakeVmm {
            calls: Vec::new(),
            fail_snapshot: true,
            serial: "/s".into(),
        };
        let err = suspend_vm(&mut vm, &dir, 1).await.unwrap_err();
        assert_eq!(vm.calls, ["pause", "snapshot", "resume"]);
        let msg = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(
            msg.contains("snapshotting") && msg.contains("refused snapshot"),
            "{msg}"
        );
        assert!(!dir.exists(), "a half-written snapshot was left");

        vm.calls.clear();
        vm.fail_snapshot = false;
        let done = suspend_vm(&mut vm, &dir, 1).await.unwrap();
        assert_eq!(
            vm.calls,
            ["pause", "snapshot"],
            "a good snapshot stays paused"
        );
        assert_eq!(done.bytes, 12);
        assert_eq!(done.snapshot_dir, dir);
        std::fs::remove_dir_all(&dir).unwrap();

        // Too little room: refused before the VM is even paused.
        vm.calls.clear();
        let err = suspend_vm(&mut vm, &dir, u32::MAX).await.unwrap_err();
        assert!(matches!(err, SnapshotError::NoSpace { .. }), "{err}");
        assert!(
            err.to_string().contains("not enough free disk space"),
            "{err}"
        );
        assert!(vm.calls.is_empty(), "paused despite the lack of space");
    }

    #[test]
    fn a_missing_snapshot_file_is_named() {
        let dir = std::env::temp_dir().join(format!("imp-snap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = snapshot_files(&dir);
        std::fs::write(&files.state, b"s").unwrap();
        assert_eq!(snapshot_present(&files), Err(files.memory.clone()));
        std::fs::write(&files.memory, b"m").unwrap();
        assert_eq!(snapshot_present(&files), Ok(()));
        assert_eq!(dir_bytes(&dir), 2);
        assert!(free_bytes(&dir).unwrap() > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
