//! Snapshots of a running VM that runs on (an ImpVMSnapshot execution): the shim pauses the
//! VM, writes its device state, copies its memory and its disk as they are at that instant
//! into the destination directory (sparse: only what holds data), and resumes it. The VM's
//! pause is what the copy costs; the execution reports it.
//!
//! Like a suspend, a request is a file in the VM's directory ([`REQUEST_FILE`], naming the
//! destination and a token) plus SIGUSR1 to the VM's shim; the shim answers in
//! [`OUTCOME_FILE`]. The destination then holds the files `crate::snapshot` describes, with
//! its manifest, or nothing (a failed snapshot removes what it wrote; the VM runs on either
//! way).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::shim::{self, ShimError};
use super::state::{self, StateDir, StateError, VmRecord, VmStatus};
use crate::snapshot::{self as format, Manifest, sparse};
use crate::vmm::{GuestMemory, SnapshotFiles, Vmm};

/// The request file a front end writes before it sends SIGUSR1.
pub const REQUEST_FILE: &str = "snapshot-request";
/// Where the shim answers.
pub const OUTCOME_FILE: &str = "snapshot-outcome";

/// What a front end asks for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Request {
    /// Names the request in its outcome.
    pub token: String,
    /// The directory to fill (created; must not exist).
    pub dest: PathBuf,
    /// The source VM as the manifest names it.
    pub source: format::Source,
}

/// What the shim answers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Outcome {
    /// The request's token.
    pub token: String,
    /// The manifest written, or why none was.
    pub result: Result<Manifest, String>,
    /// Bytes written into the destination.
    pub bytes: u64,
}

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

/// Asks VM `record`'s shim to snapshot it into `dest`; returns the token to wait for.
pub fn request(
    state: &StateDir,
    record: &VmRecord,
    dest: &Path,
    source: format::Source,
) -> Result<String, TakeError> {
    if record.status != VmStatus::Running || !record.supervisor_alive() {
        return Err(TakeError::NotRunning {
            id: record.name.clone(),
            status: if record.status == VmStatus::Running {
                "lost (its supervisor died)"
            } else {
                record.status.as_str()
            },
        });
    }
    let token = format!("{}-{}", std::process::id(), state::now_unix_nanos());
    let dir = state.vm_dir(&record.name);
    let _ = std::fs::remove_file(dir.join(OUTCOME_FILE));
    let req = Request {
        token: token.clone(),
        dest: dest.to_path_buf(),
        source,
    };
    state::write_json(&dir.join(REQUEST_FILE), &req)?;
    shim::signal(record, nix::sys::signal::Signal::SIGUSR1)?;
    tracing::info!(vm = %record.name, dest = %dest.display(), "snapshot requested");
    Ok(token)
}

/// Waits for the shim's answer to the request `token` of VM `id`.
pub async fn wait(
    state: &StateDir,
    id: &str,
    token: &str,
    timeout: Duration,
) -> Result<(Manifest, u64), TakeError> {
    let path = state.vm_dir(id).join(OUTCOME_FILE);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut died = false;
    loop {
        if let Ok(o) = state::read_json::<Outcome>(&path)
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

/// In the shim: takes the pending snapshot request, if there is one.
pub fn take_request(dir: &Path) -> Option<Request> {
    let path = dir.join(REQUEST_FILE);
    let req = state::read_json(&path).ok()?;
    let _ = std::fs::remove_file(&path);
    Some(req)
}

/// What the shim knows of its VM that a snapshot copies.
pub struct Sources<'a> {
    /// The VMM, as `kind version`.
    pub vmm: &'a str,
    /// Its machine type.
    pub machine: &'a str,
    /// vCPUs.
    pub vcpus: u8,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// Where its RAM lives.
    pub memory: &'a GuestMemory,
    /// Its root disk.
    pub disk: &'a Path,
    /// Its initramfs (a restore needs the same one: QEMU checks the ROM it made of it).
    pub initrd: &'a Path,
}

/// The VMM's files inside a snapshot directory: QEMU's stream is [`format::VMSTATE`] and its
/// note on it `vmm.json`; Firecracker's state is [`format::VMSTATE`] and its memory
/// [`format::MEMORY`].
pub fn vmm_files(dir: &Path, memory: &GuestMemory) -> SnapshotFiles {
    match memory {
        GuestMemory::Anonymous => SnapshotFiles {
            state: dir.join(format::VMSTATE),
            memory: dir.join(format::MEMORY),
        },
        GuestMemory::Shared(_) | GuestMemory::Private(_) => SnapshotFiles {
            state: dir.join(format::VMM_NOTE),
            memory: dir.join(format::VMSTATE),
        },
    }
}

/// In the shim: pauses `vm`, snapshots it into `req.dest`, resumes it; the VM runs on
/// whatever happens (an error after the pause still resumes it).
pub async fn take<V: Vmm>(vm: &mut V, src: &Sources<'_>, req: &Request) -> Outcome {
    let result = take_inner(vm, src, req).await;
    let (result, bytes) = match result {
        Ok((m, bytes)) => (Ok(m), bytes),
        Err(e) => {
            let d = req.dest.clone();
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(d)).await;
            (Err(e), 0)
        }
    };
    Outcome {
        token: req.token.clone(),
        result,
        bytes,
    }
}

async fn take_inner<V: Vmm>(
    vm: &mut V,
    src: &Sources<'_>,
    req: &Request,
) -> Result<(Manifest, u64), String> {
    let dest = req.dest.clone();
    blocking(move || std::fs::create_dir_all(&dest))
        .await
        .map_err(|e| format!("creating {}: {e}", req.dest.display()))?;
    let t = Instant::now();
    vm.pause().await.map_err(|e| format!("pausing: {e}"))?;
    let copied = copy_paused(vm, src, &req.dest).await;
    let resumed = vm.resume().await;
    let pause_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
    let bytes = copied?;
    resumed.map_err(|e| format!("resuming after the snapshot: {e}"))?;
    let manifest = Manifest {
        format: format::FORMAT,
        vmm: src.vmm.to_owned(),
        machine: src.machine.to_owned(),
        vcpus: src.vcpus,
        memory_mib: src.memory_mib,
        source: req.source.clone(),
        taken_unix: state::now_unix(),
        pause_ms,
    };
    let path = req.dest.join(format::MANIFEST);
    let m = manifest.clone();
    blocking(move || state::write_json(&path, &m).map_err(std::io::Error::other))
        .await
        .map_err(|e| format!("writing the manifest: {e}"))?;
    Ok((manifest, bytes))
}

/// While the VM is paused: its device state (and, under a VMM that streams it, memory), then
/// the RAM file and the disk, sparse.
async fn copy_paused<V: Vmm>(vm: &mut V, src: &Sources<'_>, dest: &Path) -> Result<u64, String> {
    let files = vmm_files(dest, src.memory);
    vm.snapshot(&files)
        .await
        .map_err(|e| format!("writing the VMM's state: {e}"))?;
    // A VM's own memory file is copied; a clone's private mapping of its snapshot's image
    // is in the stream (QEMU streams private RAM), and the image is then all holes.
    let ram = match src.memory {
        GuestMemory::Shared(f) => Some(Ok(f.clone())),
        GuestMemory::Private(_) => Some(Err(u64::from(src.memory_mib) << 20)),
        GuestMemory::Anonymous => None,
    };
    let shown = dest.display().to_string();
    let (disk, initrd, dest) = (
        src.disk.to_path_buf(),
        src.initrd.to_path_buf(),
        dest.to_path_buf(),
    );
    blocking(move || {
        let mut bytes = 0;
        match ram {
            Some(Ok(ram)) => bytes += sparse::copy(&ram, &dest.join(format::MEMORY))?,
            Some(Err(len)) => std::fs::File::create(dest.join(format::MEMORY))?.set_len(len)?,
            None => {}
        }
        bytes += sparse::copy(&disk, &dest.join(format::DISK))?;
        bytes += sparse::copy(&initrd, &dest.join(format::INITRD))?;
        // Firecracker's state needs no note; every snapshot directory has the same files.
        let note = dest.join(format::VMM_NOTE);
        if !note.exists() {
            std::fs::write(&note, b"{}")?;
        }
        for f in [&files.state, &files.memory] {
            bytes += sparse::data_bytes(f).unwrap_or(0);
        }
        Ok(bytes)
    })
    .await
    .map_err(|e| format!("copying memory and disk into {shown}: {e}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(std::io::Error::other)?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_mapped_vm_keeps_its_stream_and_its_memory_apart() {
        let d = Path::new("/s");
        let f = vmm_files(d, &GuestMemory::Shared("/vm/memory.ram".into()));
        assert_eq!(f.memory, d.join(format::VMSTATE));
        assert_ne!(f.state, d.join(format::MEMORY));
        let f = vmm_files(d, &GuestMemory::Anonymous);
        assert_eq!(
            (f.state, f.memory),
            (d.join(format::VMSTATE), d.join(format::MEMORY))
        );
    }
}
