//! The contract between a front end (`imp run`, the node agent) and a VM's shim besides its
//! typed API ([`super::shim_api`], which carries the record's changes and stops): files in the
//! VM's directory (`vms/<id>/` of the state directory), signals, and inherited descriptors.
//! A shim of the previous release knows only these, so every shim still honours them. Every
//! name either side uses is here or there, so neither reads the other's code to learn it;
//! `control` is the front ends' side, `shim` the shim's.
//!
//! | what | who writes | who reads |
//! |---|---|---|
//! | [`SPEC_FILE`]: the VM's [`super::spec::VmSpec`] | front end, before the shim starts | shim |
//! | the record (`record.json`, [`super::state`]) | shim, as it learns; [`initial_record`] by the front end | both |
//! | [`STOP_GRACE_FILE`], then [`STOP_SIGNAL`] | front end, for a shim without the API; the API's stop writes it too | shim: stop, with that grace |
//! | [`FAIL_REASON_FILE`], then [`STOP_SIGNAL`] | front end (a failed probe), as above | shim: the end is a failure |
//! | [`SUSPEND_REQUEST_FILE`] or [`SNAPSHOT_REQUEST_FILE`], then [`REQUEST_SIGNAL`] | front end, for a shim without the API | shim |
//! | [`SNAPSHOT_OUTCOME_FILE`] | shim, answering a request file | front end |
//! | [`shim_log`] | shim's stdout and stderr | people |
//! | [`DISK_FILE`], [`INITRD_FILE`], [`MEMORY_FILE`] | shim | shim, restores, snapshots |
//!
//! A resumed VM's new shim inherits the TAP held while the VM slept as descriptor [`TAP_FD`];
//! every shim its API's listening socket as [`super::shim_api::CONTROL_FD`].

use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;

use super::spec::VmSpec;
use super::state::{self, VmRecord, VmStatus};
use imp_vmm::SnapshotFiles;

pub use super::spec::SPEC_FILE;

/// The file a front end writes the stop grace period into (milliseconds) before
/// [`STOP_SIGNAL`].
pub const STOP_GRACE_FILE: &str = "stop-grace-ms";
/// Why the node agent stops the VM as failed (a probe failed), when it does: the end is then
/// a failure with this reason, not the workload's exit.
pub const FAIL_REASON_FILE: &str = "fail-reason";
/// The suspend request file a front end writes (holding its token) before [`REQUEST_SIGNAL`].
pub const SUSPEND_REQUEST_FILE: &str = "suspend-request";
/// The snapshot request file ([`SnapshotRequest`]) a front end writes before
/// [`REQUEST_SIGNAL`].
pub const SNAPSHOT_REQUEST_FILE: &str = "snapshot-request";
/// Where the shim answers a snapshot request ([`SnapshotOutcome`]).
pub const SNAPSHOT_OUTCOME_FILE: &str = "snapshot-outcome";
/// The file a QEMU guest's RAM is mapped from, in the VM's directory (on disk, not tmpfs: a
/// sleeping VM's memory must leave RAM).
pub const MEMORY_FILE: &str = "memory.ram";
/// The VM's root disk, in its directory.
pub const DISK_FILE: &str = "disk.ext4";
/// The VM's initramfs, in its directory.
pub const INITRD_FILE: &str = "initramfs.cpio";

/// Asks the shim to stop its VM (SIGINT does too, for a terminal's Ctrl-C).
pub const STOP_SIGNAL: Signal = Signal::SIGTERM;
/// Tells the shim a request file is waiting (suspend or snapshot).
pub const REQUEST_SIGNAL: Signal = Signal::SIGUSR1;
/// Exit code recorded for a VM stopped before its workload reported one (128 + SIGTERM).
pub const STOPPED_EXIT_CODE: i32 = 143;
/// The descriptor number under which a shim inherits the VM's TAP (`--tap-fd`).
pub const TAP_FD: i32 = 3;

/// Writes a stop's grace period (milliseconds) and, when the end is a failure, its reason into
/// the VM directory `dir`, where the shim's stop reads them; both the API's stop (in the shim)
/// and the signal path of a shim without the API (in the front end) write them here.
pub async fn write_stop(
    dir: &Path,
    grace_ms: u64,
    fail_reason: Option<&str>,
) -> Result<(), state::StateError> {
    let write = |file: PathBuf, content: String| async move {
        tokio::fs::write(&file, content)
            .await
            .map_err(|source| state::StateError::Io {
                action: "writing",
                path: file,
                source,
            })
    };
    if let Some(why) = fail_reason {
        write(dir.join(FAIL_REASON_FILE), why.to_owned()).await?;
    }
    write(dir.join(STOP_GRACE_FILE), grace_ms.to_string()).await
}

/// Where the shim's own log goes inside the VM directory.
pub fn shim_log(dir: &Path) -> PathBuf {
    dir.join("shim.log")
}

/// The snapshot files inside a VM's snapshot directory.
pub fn snapshot_files(dir: &Path) -> SnapshotFiles {
    SnapshotFiles {
        state: dir.join("vmstate"),
        memory: dir.join("memory"),
    }
}

/// What a front end asks of a snapshot (the request file's content).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotRequest {
    /// Names the request in its outcome.
    pub token: String,
    /// The directory to fill (created; must not exist).
    pub dest: PathBuf,
    /// The source VM as the manifest names it.
    pub source: crate::snapshot::Source,
}

/// What the shim answers (the outcome file's content).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotOutcome {
    /// The request's token.
    pub token: String,
    /// The manifest written, or why none was.
    pub result: Result<crate::snapshot::Manifest, String>,
    /// Bytes written into the destination.
    pub bytes: u64,
}

/// The record of a VM whose shim `shim_pid` has just started.
pub fn initial_record(id: &str, dir: &Path, spec: &VmSpec, shim_pid: u32) -> VmRecord {
    VmRecord {
        name: id.to_owned(),
        image: spec.image.clone(),
        digest: None,
        layer_digests: Vec::new(),
        runtime: spec.runtime.as_str().to_owned(),
        supervisor_pid: shim_pid,
        supervisor_started: state::process_start_time(shim_pid),
        vmm_pid: None,
        helper_pids: Vec::new(),
        vsock: dir.join("vsock.sock"),
        agent_port: imp_proto::DEFAULT_API_PORT,
        serial_log: dir.join("serial.log"),
        created_unix: state::now_unix(),
        running_unix: None,
        finished_unix: None,
        status: VmStatus::Starting,
        exit_code: None,
        error: None,
        error_stage: None,
        console_tail: None,
        vmm: None,
        remove_on_exit: spec.remove_on_exit,
        guest_agent: spec.guest_agent,
        attach_argv: None,
        timings: Default::default(),
        owner: spec.owner.clone(),
        suspend: None,
        suspend_failure: None,
        paused: false,
    }
}
