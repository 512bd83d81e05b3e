//! The shim's side of suspend: when a front end's request arrives ([`take_request`]), the
//! shim checks the free space, pauses its VMM and writes the full snapshot
//! ([`suspend_vm`]); a restore checks that the snapshot is whole ([`snapshot_present`]); a
//! sleeping VM's RAM file is written back and dropped from the page cache
//! ([`release_memory_file`]). The front ends' side is `runtime::control::suspend`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::super::contract::{self, SUSPEND_REQUEST_FILE};
use super::super::state::{self, StateDir, SuspendRecord, VmRecord, VmStatus};
use imp_vmm::{SnapshotFiles, Vmm};

/// Free disk space kept beyond the guest's memory when a snapshot is written: the device
/// state, and room for the node's other writes.
pub const SPACE_MARGIN_BYTES: u64 = 64 << 20;

/// Bytes a snapshot of a guest with `memory_mib` may need: its memory plus the margin.
pub fn space_needed(memory_mib: u32) -> u64 {
    (u64::from(memory_mib) << 20) + SPACE_MARGIN_BYTES
}

/// Whether `free` bytes hold the snapshot of a guest with `memory_mib`; the shortfall if not.
pub fn check_space(free: u64, memory_mib: u32) -> std::result::Result<(), u64> {
    let needed = space_needed(memory_mib);
    if free >= needed { Ok(()) } else { Err(needed) }
}

/// How long a suspended VM's new shim waits for its starter to record it as the VM's shim.
const ADOPTION_WAIT: Duration = Duration::from_secs(5);

/// In a new shim: whether this shim was started to resume the VM, waiting briefly for its
/// starter to record it (`control::suspend::start_resume` writes the record just after the spawn).
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
    let path = dir.join(SUSPEND_REQUEST_FILE);
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
        // Owner-only: the VM's memory holds its Secrets.
        crate::host_fs::create_private_dir_all(&d)?;
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
    let paused_unix_ms = state::now_unix_ms();
    if let Err(e) = vm.pause().await {
        return Err(SnapshotError::Vmm {
            step: "pausing",
            resumed: true,
            source: Box::new(e),
        });
    }
    let files = contract::snapshot_files(dir);
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
        paused_unix_ms: Some(paused_unix_ms),
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
pub(crate) mod tests {
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

    /// A VMM that records what it was asked and fails the step it is told to.
    pub(crate) struct FakeVmm {
        pub(crate) calls: Vec<&'static str>,
        pub(crate) fail_snapshot: bool,
        pub(crate) serial: PathBuf,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("fake VMM refused {0}")]
    pub(crate) struct FakeError(&'static str);

    impl Vmm for FakeVmm {
        type Launcher = ();
        type Stream = tokio::io::DuplexStream;
        type Error = FakeError;

        async fn boot(_: &(), _: &imp_vmm::VmConfig) -> Result<Self, FakeError> {
            Err(FakeError("boot"))
        }
        async fn restore(
            _: &(),
            _: &imp_vmm::VmConfig,
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
        async fn stop(self, _: Duration) -> Result<imp_vmm::StopOutcome, FakeError> {
            Ok(imp_vmm::StopOutcome::Killed)
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
        fn state(&self) -> imp_vmm::VmState {
            imp_vmm::VmState::Running
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
        let files = contract::snapshot_files(&dir);
        std::fs::write(&files.state, b"s").unwrap();
        assert_eq!(snapshot_present(&files), Err(files.memory.clone()));
        std::fs::write(&files.memory, b"m").unwrap();
        assert_eq!(snapshot_present(&files), Ok(()));
        assert_eq!(dir_bytes(&dir), 2);
        assert!(free_bytes(&dir).unwrap() > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
