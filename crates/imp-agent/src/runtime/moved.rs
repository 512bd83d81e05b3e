//! The files of a VM that moves between nodes (ImpVMMigration, cold; docs/migration.md): what
//! the source's agent sends ([`files_to_send`]) and how the target's makes them the VM's own
//! ([`take_in`]).
//!
//! What travels: the snapshot the suspend wrote (device state and memory), the VM's disk, its
//! initramfs (a restore needs the one it booted), its RAM file when it has one, its serial
//! log, and its record (the source's `vm.json`, whose paths the target rewrites).

use std::path::{Path, PathBuf};

use super::contract::{DISK_FILE, INITRD_FILE, MEMORY_FILE};
use super::spec::{SPEC_FILE, VmSpec};
use super::state::{self, StateDir, StateError, VmRecord, VmStatus};

/// The record's name in a move.
pub const RECORD: &str = "record.json";
/// The prefix of the snapshot's files in a move (`snapshot.vmstate`, `snapshot.memory`).
const SNAPSHOT_PREFIX: &str = "snapshot.";
/// The serial log's name in a move.
const SERIAL: &str = "serial.log";

/// The files of suspended VM `record` (directory `dir`) a move sends: each its name in the
/// move and its path here. Blocking (it lists the snapshot's directory).
pub fn files_to_send(dir: &Path, record: &VmRecord) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut files = vec![
        (DISK_FILE.to_owned(), dir.join(DISK_FILE)),
        (INITRD_FILE.to_owned(), dir.join(INITRD_FILE)),
        (
            RECORD.to_owned(),
            dir.join(crate::runtime::state::RECORD_FILE),
        ),
    ];
    for (name, optional) in [
        (MEMORY_FILE, dir.join(MEMORY_FILE)),
        (SERIAL, record.serial_log.clone()),
    ] {
        if optional.is_file() {
            files.push((name.to_owned(), optional));
        }
    }
    if let Some(s) = &record.suspend {
        let mut names: Vec<_> = std::fs::read_dir(&s.snapshot_dir)?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for n in names {
            files.push((format!("{SNAPSHOT_PREFIX}{n}"), s.snapshot_dir.join(n)));
        }
    }
    Ok(files)
}

/// The record of a VM moved in as `id` under `vm_dir` and `snapshot_dir`, from its source's
/// `record`: suspended, no process, this node's paths.
pub fn moved_record(
    mut record: VmRecord,
    id: &str,
    vm_dir: &Path,
    snapshot_dir: &Path,
) -> VmRecord {
    record.name = id.to_owned();
    record.status = VmStatus::Suspended;
    record.supervisor_pid = 0;
    record.supervisor_started = None;
    record.vmm_pid = None;
    record.helper_pids = Vec::new();
    record.vsock = vm_dir.join("vsock.sock");
    record.serial_log = vm_dir.join(SERIAL);
    record.paused = false;
    if let Some(s) = record.suspend.as_mut() {
        s.snapshot_dir = snapshot_dir.to_path_buf();
    }
    record
}

/// Where received file `name` goes: the VM's directory, or (`snapshot.*`) its snapshot's; the
/// record is written anew, not moved. `None` for a name a move does not carry.
pub fn destination(name: &str, vm_dir: &Path, snapshot_dir: &Path) -> Option<PathBuf> {
    if let Some(n) = name.strip_prefix(SNAPSHOT_PREFIX) {
        return (!n.is_empty()).then(|| snapshot_dir.join(n));
    }
    [DISK_FILE, INITRD_FILE, MEMORY_FILE, SERIAL]
        .contains(&name)
        .then(|| vm_dir.join(name))
}

/// Why received files could not be made a VM's.
#[derive(Debug, thiserror::Error)]
pub enum TakeInError {
    /// The VM's directory or record.
    #[error(transparent)]
    State(#[from] StateError),
    /// A received file could not be listed or moved into place.
    #[error("{doing} {}", path.display())]
    Io {
        /// What was being done.
        doing: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Makes the files a move sent (directory `received`) VM `id`'s on this node: its directory
/// (anything left of an earlier VM `id` removed first) with `spec`, its snapshot, and its
/// record from the source's `record`, suspended ([`moved_record`]). Files a move does not
/// carry are left behind. Blocking.
pub fn take_in(
    state: &StateDir,
    id: &str,
    spec: &VmSpec,
    record: VmRecord,
    received: &Path,
) -> Result<(), TakeInError> {
    let io = |doing, path: &Path| {
        let path = path.to_path_buf();
        move |source| TakeInError::Io {
            doing,
            path,
            source,
        }
    };
    state.remove(id)?;
    let dir = state.create_vm_dir(id)?;
    let snap = state.snapshot_dir(id);
    std::fs::create_dir_all(&snap).map_err(io("creating", &snap))?;
    for entry in std::fs::read_dir(received).map_err(io("listing", received))? {
        let entry = entry.map_err(io("listing", received))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(to) = destination(&name, &dir, &snap) {
            std::fs::rename(entry.path(), &to).map_err(io("moving into place", &to))?;
        }
    }
    state::write_json(&dir.join(SPEC_FILE), spec)?;
    state.save(&moved_record(record, id, &dir, &snap))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn received_files_go_to_the_vm_and_its_snapshot_and_nothing_else_is_taken() {
        let (vm, snap) = (Path::new("/s/vms/u"), Path::new("/s/snapshots/u"));
        assert_eq!(
            destination("disk.ext4", vm, snap),
            Some(vm.join("disk.ext4"))
        );
        assert_eq!(
            destination("snapshot.vmstate", vm, snap),
            Some(snap.join("vmstate"))
        );
        assert_eq!(
            destination("serial.log", vm, snap),
            Some(vm.join("serial.log"))
        );
        for refused in ["record.json", "spec.json", "snapshot.", "vm.json", "other"] {
            assert_eq!(destination(refused, vm, snap), None, "{refused}");
        }
    }

    #[test]
    fn a_moved_record_is_suspended_with_no_process_and_this_nodes_paths() {
        let mut r = crate::node::decide::tests::record(VmStatus::Suspended, 2);
        r.suspend = Some(crate::runtime::state::SuspendRecord {
            snapshot_dir: "/source/snapshots/u".into(),
            suspended_unix: 5,
            paused_unix_ms: None,
            bytes: 1,
            vmm: Some("qemu 10.0.2".into()),
        });
        let m = moved_record(r, "u", Path::new("/t/vms/u"), Path::new("/t/snapshots/u"));
        assert_eq!(m.status, VmStatus::Suspended);
        assert_eq!((m.supervisor_pid, m.vmm_pid), (0, None));
        assert_eq!(m.vsock, Path::new("/t/vms/u/vsock.sock"));
        assert_eq!(m.serial_log, Path::new("/t/vms/u/serial.log"));
        let s = m.suspend.unwrap();
        assert_eq!(s.snapshot_dir, Path::new("/t/snapshots/u"));
        assert_eq!(s.vmm.as_deref(), Some("qemu 10.0.2"));
        assert_eq!(m.owner.unwrap().attempt, 2);
    }
}
