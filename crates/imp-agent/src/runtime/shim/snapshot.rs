//! The shim's side of a snapshot of a running VM that runs on: the shim pauses the VM, writes
//! its device state, copies its memory and its disk as they are at that instant into the
//! destination directory (sparse: only what holds data), and resumes it. The VM's pause is
//! what the copy costs; the execution reports it. The destination then holds the files
//! `crate::snapshot` describes, with its manifest, or nothing (a failed snapshot removes what
//! it wrote; the VM runs on either way). The front ends' side is `runtime::control::snapshot`.

use std::path::Path;
use std::time::Instant;

use super::super::contract::{
    SNAPSHOT_REQUEST_FILE, SnapshotOutcome as Outcome, SnapshotRequest as Request,
};
use super::super::state;
use crate::snapshot::{self as format, Manifest, sparse};
use imp_vmm::{GuestMemory, SnapshotFiles, Vmm};

/// In the shim: takes the pending snapshot request, if there is one.
pub fn take_request(dir: &Path) -> Option<Request> {
    let path = dir.join(SNAPSHOT_REQUEST_FILE);
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
    // Owner-only: memory, disk and initramfs hold the VM's Secrets.
    blocking(move || crate::host_fs::create_private_dir_all(&dest))
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
            Some(Err(len)) => private_file(&dest.join(format::MEMORY))?.set_len(len)?,
            None => {}
        }
        bytes += sparse::copy(&disk, &dest.join(format::DISK))?;
        bytes += sparse::copy(&initrd, &dest.join(format::INITRD))?;
        // Firecracker's state needs no note; every snapshot directory has the same files.
        let note = dest.join(format::VMM_NOTE);
        if !note.exists() {
            std::io::Write::write_all(&mut private_file(&note)?, b"{}")?;
        }
        for f in [&files.state, &files.memory] {
            bytes += sparse::data_bytes(f).unwrap_or(0);
        }
        Ok(bytes)
    })
    .await
    .map_err(|e| format!("copying memory and disk into {shown}: {e}"))
}

/// A new owner-only (0600) file at `path`.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
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

    /// What a snapshot holds, and who may read it on the node: the VM's memory, disk and
    /// initramfs, whose config carries the VM's resolved environment, Secrets included (a
    /// restore does not resolve them again: docs/snapshots.md says so); so the directory is
    /// 0700 and the files imp writes into it 0600, whatever the umask.
    #[tokio::test]
    async fn a_snapshot_carries_the_vms_environment_in_owner_only_files() {
        use std::os::unix::fs::PermissionsExt as _;
        let base = std::env::temp_dir().join(format!("imp-snap-holds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let (ram, disk, initrd) = (base.join("ram"), base.join("disk"), base.join("initrd"));
        std::fs::write(&ram, b"guest memory: PASSWORD=hunter2").unwrap();
        std::fs::write(&disk, b"ext4").unwrap();
        let config = br#"{"env":[{"name":"PASSWORD","value":"hunter2"}]}"#;
        let archive = crate::initramfs::archive::config_archive(config).unwrap();
        std::fs::write(&initrd, &archive).unwrap();
        let memory = GuestMemory::Shared(ram);
        let src = Sources {
            vmm: "qemu 7.2.0",
            machine: "microvm",
            vcpus: 1,
            memory_mib: 1,
            memory: &memory,
            disk: &disk,
            initrd: &initrd,
        };
        let req = Request {
            token: "t".into(),
            dest: base.join("snapshots/ns/s1"),
            source: format::Source {
                namespace: "ns".into(),
                name: "db".into(),
                image: "app:1".into(),
            },
        };
        let mut vm = super::super::suspend::tests::FakeVmm {
            calls: Vec::new(),
            fail_snapshot: false,
            serial: "/s".into(),
        };
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let out = take(&mut vm, &src, &req).await;
        nix::sys::stat::umask(old);
        out.result.unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&req.dest), 0o700, "the snapshot directory");
        assert_eq!(mode(&base.join("snapshots/ns")), 0o700, "made with it");
        for f in [
            format::MEMORY,
            format::DISK,
            format::INITRD,
            format::MANIFEST,
        ] {
            assert_eq!(mode(&req.dest.join(f)), 0o600, "{f}");
        }
        let has_secret = |f: &str| {
            let bytes = std::fs::read(req.dest.join(f)).unwrap();
            bytes.windows(7).any(|w| w == b"hunter2")
        };
        assert!(
            has_secret(format::INITRD),
            "the environment, in the initramfs"
        );
        assert!(has_secret(format::MEMORY), "and in the guest's memory");
        let _ = std::fs::remove_dir_all(&base);
    }

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
