//! Snapshots that outlive their VM: an ImpVMSnapshot execution's files, kept in a directory on
//! the node (`storage.nodeLocal.path/<namespace>/<parent>/<execution>/`) or pushed to an OCI
//! registry ([`oci`]), and restored into a new VM (`spec.snapshotRef`).
//!
//! A snapshot directory holds:
//! - [`MANIFEST`] (`snapshot.json`, [`Manifest`]): what took it (the VMM kind and version, the
//!   machine type), the guest's shape (vCPUs, memory), the source VM and when it was taken;
//! - [`VMSTATE`]: the VMM's device and vCPU state (QEMU: its migration stream without the RAM;
//!   Firecracker: its `vmstate`);
//! - [`MEMORY`]: the guest's RAM as a raw image, sparse (pages the guest never touched are
//!   holes), which a restore maps privately instead of reading;
//! - [`DISK`]: the root disk at the same instant, sparse;
//! - [`INITRD`]: the initramfs the source booted;
//! - [`VMM_NOTE`] (QEMU): the version that wrote the stream and whether the RAM is in it.
//!
//! Which directories a node-local snapshot may use, and how the agent reaches them without
//! following a link out of them, is [`place`].
//!
//! Suspend (`runtime::shim::suspend`) uses the same VMM calls but keeps its files beside the VM.

pub mod oci;
pub mod place;
pub mod sparse;

/// The manifest's file name.
pub const MANIFEST: &str = "snapshot.json";
/// The VMM state's file name.
pub const VMSTATE: &str = "vmstate";
/// The guest memory image's file name.
pub const MEMORY: &str = "memory";
/// The root disk's file name.
pub const DISK: &str = "disk.ext4";
/// The initramfs the source booted (a QEMU restore needs the same one).
pub const INITRD: &str = "initramfs.cpio";
/// QEMU's note on its stream (its version, whether the RAM is in it).
pub const VMM_NOTE: &str = "vmm.json";

/// The format version this agent writes and reads.
pub const FORMAT: u32 = 1;

/// What a snapshot directory's [`MANIFEST`] says.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// [`FORMAT`] when written.
    pub format: u32,
    /// The VMM that wrote it, as `kind version` (`qemu 7.2.22`, `firecracker 1.12.1`).
    pub vmm: String,
    /// The machine type (`microvm` for QEMU, `firecracker`).
    pub machine: String,
    /// The guest's vCPUs.
    pub vcpus: u8,
    /// The guest's memory in MiB.
    pub memory_mib: u32,
    /// The VM it was taken of.
    pub source: Source,
    /// When it was taken (Unix seconds).
    pub taken_unix: u64,
    /// How long the source VM was paused for it, in milliseconds.
    pub pause_ms: u64,
}

/// The VM a snapshot was taken of.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its image reference.
    pub image: String,
}

/// The guest a restore is for, to check a snapshot against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape<'a> {
    /// vCPUs.
    pub vcpus: u8,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// The VMM kind that will restore it (`qemu`, `firecracker`).
    pub vmm: &'a str,
}

/// Why snapshot `m` cannot be restored as `want`, if it cannot.
pub fn refuse(m: &Manifest, want: Shape<'_>) -> Option<String> {
    if m.format != FORMAT {
        return Some(format!(
            "its format is {}; this agent reads format {FORMAT}",
            m.format
        ));
    }
    if let Some(why) = imp_vmm::version::refuse_kind(Some(&m.vmm), want.vmm) {
        return Some(why);
    }
    if (m.vcpus, m.memory_mib) != (want.vcpus, want.memory_mib) {
        return Some(format!(
            "it was taken of a guest with {} vCPU and {} MiB; this VM's class gives {} vCPU \
             and {} MiB (use a class of the snapshot's size)",
            m.vcpus, m.memory_mib, want.vcpus, want.memory_mib
        ));
    }
    None
}

/// Where a VM restored from a snapshot takes its RAM from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeededRam {
    /// A copy of the memory image, the VM's own file from then on (mapped shared).
    Copied,
    /// The snapshot's memory image itself, which the VMM maps private and read-only: every
    /// VM restored so shares the pages none of them wrote.
    Mapped(std::path::PathBuf),
}

/// Whether a memory image of `image_len` bytes can be mapped as the RAM of a guest of
/// `memory_mib` MiB: only whole (QEMU refuses a file shorter than the RAM, and a page past
/// its end would fault the guest).
pub fn maps_whole(image_len: u64, memory_mib: u32) -> bool {
    image_len == u64::from(memory_mib) << 20
}

/// Fills VM directory `dir` from snapshot directory `snap` for a restore as `want`: its disk
/// and initramfs copied (sparse) under the names the VM's files have (`disk`, `initrd` in
/// `dir`), and its memory image either copied to `memory` too or, when `map` (the VMM maps a
/// read-only file private) and the image is whole, left where it is to be mapped: then the
/// snapshot's directory is closed to all but root and the image opened for reading, which
/// only a VMM whose jail binds it can reach. Blocking.
pub fn seed(
    snap: &std::path::Path,
    want: Shape<'_>,
    (disk, initrd, memory): (&std::path::Path, &std::path::Path, &std::path::Path),
    map: bool,
) -> Result<(Manifest, SeededRam), String> {
    let path = snap.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let m: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("reading {}: {e}", path.display()))?;
    if let Some(why) = refuse(&m, want) {
        return Err(format!(
            "snapshot {} cannot be restored: {why}",
            snap.display()
        ));
    }
    let image = snap.join(MEMORY);
    let len = std::fs::metadata(&image)
        .map_err(|e| format!("reading {}: {e}", image.display()))?
        .len();
    let ram = if map && maps_whole(len, want.memory_mib) {
        SeededRam::Mapped(image)
    } else {
        SeededRam::Copied
    };
    let mut copies = vec![(DISK, disk), (INITRD, initrd)];
    if ram == SeededRam::Copied {
        copies.push((MEMORY, memory));
    }
    for (from, to) in copies {
        let src = snap.join(from);
        let _ = std::fs::remove_file(to);
        sparse::copy(&src, to)
            .map_err(|e| format!("copying {} to {}: {e}", src.display(), to.display()))?;
    }
    // A confined VMM reads a mapped image as itself (it writes its disk and memory, which its
    // jail's preparation gives it). Its initramfs, which holds the VM's environment, stays
    // owner-only (0600): the shim gives it to the VMM's uid.
    let mut modes: Vec<(&std::path::Path, u32)> = Vec::new();
    // The VMM's state too: Firecracker opens it by name, as itself.
    let state = snap.join(VMSTATE);
    if let SeededRam::Mapped(image) = &ram {
        modes.extend([
            (snap, 0o700),
            (image.as_path(), 0o644),
            (state.as_path(), 0o644),
        ]);
    }
    use std::os::unix::fs::PermissionsExt as _;
    for (path, mode) in modes {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("opening {} to the VMM: {e}", path.display()))?;
    }
    Ok((m, ram))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            format: FORMAT,
            vmm: "qemu 7.2.22".into(),
            machine: "microvm".into(),
            vcpus: 1,
            memory_mib: 256,
            source: Source {
                namespace: "ns".into(),
                name: "vm".into(),
                image: String::new(),
            },
            taken_unix: 0,
            pause_ms: 1,
        }
    }

    #[test]
    fn only_a_whole_memory_image_is_mapped() {
        assert!(maps_whole(256 << 20, 256));
        assert!(!maps_whole((256 << 20) - 4096, 256));
        assert!(!maps_whole(0, 256));
        assert!(!maps_whole(512 << 20, 256));
    }

    #[test]
    fn a_snapshot_restores_only_into_its_own_shape_and_vmm() {
        let want = Shape {
            vcpus: 1,
            memory_mib: 256,
            vmm: "qemu",
        };
        assert_eq!(refuse(&manifest(), want), None);
        let why = refuse(
            &manifest(),
            Shape {
                memory_mib: 512,
                ..want
            },
        )
        .unwrap_or_default();
        assert!(why.contains("256 MiB") && why.contains("512 MiB"), "{why}");
        let why = refuse(
            &manifest(),
            Shape {
                vmm: "firecracker",
                ..want
            },
        )
        .unwrap_or_default();
        assert!(why.contains("qemu"), "{why}");
        let old = Manifest {
            format: FORMAT + 1,
            ..manifest()
        };
        assert!(refuse(&old, want).is_some());
    }
}
