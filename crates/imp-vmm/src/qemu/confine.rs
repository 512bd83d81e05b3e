//! Where QEMU finds its VM's files: the host's paths for a QEMU that runs as its caller, or
//! the paths inside its [`Jail`] for a confined one, with the jail that makes them so.
//!
//! A confined QEMU sees, besides `/usr` (read-only) and a few devices: its serial log
//! `/log/serial.log`, its kernel and initramfs under `/boot` (read-only) and each drive as
//! `/drives/ID`, and its guest-memory file (when the RAM is one) as `/mem/ram`. It may write
//! no directory of the host: its sockets (QMP, the guest channel) are descriptors it
//! inherits (see [`super::argv::Fds`]), so there is no path of its making that the driver,
//! as root, could be led to connect to. Everything else in the VM's directory — the records
//! the shim and the agent trust (`vm.json`, `spec.json`), the host end of the guest channel
//! (`vsock.sock`), the snapshot — stays out of its reach; a snapshot reaches it as a
//! descriptor.

use std::path::{Path, PathBuf};

use super::super::jail::{Bind, Jail};
use super::super::{Confine, VmConfig};

/// The empty directory its jail's root is mounted on (in its own mount namespace only).
pub const JAIL_ROOT: &str = "vmm-root";

/// The paths QEMU is given, and where their host side is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// The serial log as QEMU names it.
    pub serial_arg: PathBuf,
    /// The kernel as QEMU names it.
    pub kernel_arg: PathBuf,
    /// The initramfs as QEMU names it.
    pub initrd_arg: Option<PathBuf>,
    /// Each drive's file as QEMU names it, in the config's order.
    pub drive_args: Vec<PathBuf>,
    /// The guest memory's file as QEMU names it, when the RAM is a file.
    pub memory_arg: Option<PathBuf>,
    /// The jail, for a confined QEMU.
    pub jail: Option<Jail>,
}

/// The paths for `config` in `run_dir` (the serial log is `serial`); `kvm` adds `/dev/kvm` to a
/// jail's devices.
pub fn paths(config: &VmConfig, run_dir: &Path, serial: &Path, kvm: bool) -> Paths {
    let Some(Confine { uid, gid }) = config.confine else {
        return Paths {
            serial_arg: serial.to_path_buf(),
            kernel_arg: config.kernel.clone(),
            initrd_arg: config.initrd.clone(),
            drive_args: config.drives.iter().map(|d| d.path.clone()).collect(),
            memory_arg: config.memory.file().map(Path::to_path_buf),
            jail: None,
        };
    };
    let bind = |host: &Path, inside: &str, writable, dir| Bind {
        host: host.to_path_buf(),
        inside: inside.into(),
        writable,
        dir,
    };
    let mut binds = vec![
        bind(serial, "/log/serial.log", true, false),
        bind(&config.kernel, "/boot/kernel", false, false),
    ];
    if let Some(initrd) = &config.initrd {
        binds.push(bind(initrd, "/boot/initrd", false, false));
    }
    let mut drive_args = Vec::new();
    for d in &config.drives {
        let inside = format!("/drives/{}", d.id);
        binds.push(bind(&d.path, &inside, !d.read_only, false));
        drive_args.push(PathBuf::from(inside));
    }
    // A VM's own memory file is its RAM, written; a snapshot's image mapped private is
    // read-only here too, so no clone can write what the others map.
    let writable = matches!(config.memory, super::super::GuestMemory::Shared(_));
    let memory_arg = config.memory.file().map(|file| {
        binds.push(bind(file, "/mem/ram", writable, false));
        PathBuf::from("/mem/ram")
    });
    let mut devices: Vec<PathBuf> = ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"]
        .into_iter()
        .map(PathBuf::from)
        .collect();
    if kvm {
        devices.push("/dev/kvm".into());
    }
    Paths {
        serial_arg: "/log/serial.log".into(),
        kernel_arg: "/boot/kernel".into(),
        initrd_arg: config.initrd.as_ref().map(|_| "/boot/initrd".into()),
        drive_args,
        memory_arg,
        jail: Some(Jail {
            uid,
            gid,
            mount_point: run_dir.join(JAIL_ROOT),
            devices,
            binds,
        }),
    }
}

/// Makes what a confined QEMU needs on the host: the jail's mount point; gives it the files it
/// writes (serial log, writable drives, a shared memory file) and its owner-only initramfs. No directory becomes its own.
/// Blocking file-system calls: small and few, done before the spawn.
pub fn prepare(config: &VmConfig, p: &Paths, serial: &Path) -> std::io::Result<()> {
    let Some(jail) = &p.jail else {
        return Ok(());
    };
    let own = |path: &Path| std::os::unix::fs::chown(path, Some(jail.uid), Some(jail.gid));
    std::fs::create_dir_all(&jail.mount_point)?;
    own(serial)?;
    // The initramfs holds the VM's environment, so it is owner-only (0600): the VMM reads it
    // as its own uid.
    if let Some(initrd) = &config.initrd {
        own(initrd)?;
    }
    for d in config.drives.iter().filter(|d| !d.read_only) {
        own(&d.path)?;
    }
    if let super::super::GuestMemory::Shared(file) = &config.memory {
        own(file)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::DriveConfig;

    fn config(confine: Option<Confine>) -> VmConfig {
        VmConfig {
            id: "a".into(),
            run_dir: "/s/a".into(),
            vcpus: 1,
            memory_mib: 256,
            kernel: "/k/vmlinux".into(),
            initrd: Some("/s/a/initramfs.cpio".into()),
            kernel_args: String::new(),
            drives: vec![DriveConfig {
                id: "root".into(),
                path: "/s/a/disk.ext4".into(),
                read_only: false,
                root: true,
            }],
            net: None,
            vsock: None,
            netns: None,
            confine,
            memory: crate::GuestMemory::Anonymous,
        }
    }

    #[test]
    fn an_unconfined_qemu_is_given_the_host_paths() {
        let c = config(None);
        let p = paths(&c, Path::new("/s/a"), Path::new("/s/a/serial.log"), false);
        assert_eq!(p.kernel_arg, PathBuf::from("/k/vmlinux"));
        assert_eq!(p.drive_args, [PathBuf::from("/s/a/disk.ext4")]);
        assert!(p.jail.is_none());
    }

    #[test]
    fn a_confined_qemu_sees_its_files_under_fixed_names_and_nothing_of_the_records() {
        let c = config(Some(Confine { uid: 7, gid: 8 }));
        let p = paths(&c, Path::new("/s/a"), Path::new("/s/a/serial.log"), true);
        assert_eq!(p.kernel_arg, PathBuf::from("/boot/kernel"));
        assert_eq!(p.initrd_arg, Some(PathBuf::from("/boot/initrd")));
        assert_eq!(p.drive_args, [PathBuf::from("/drives/root")]);
        let j = p.jail.unwrap();
        assert_eq!((j.uid, j.gid), (7, 8));
        assert!(j.devices.contains(&PathBuf::from("/dev/kvm")));
        let hosts: Vec<_> = j.binds.iter().map(|b| b.host.clone()).collect();
        assert!(
            !hosts.contains(&PathBuf::from("/s/a")),
            "not the whole VM directory"
        );
        let writable: Vec<_> = j
            .binds
            .iter()
            .filter(|b| b.writable)
            .map(|b| b.inside.clone())
            .collect();
        assert_eq!(
            writable,
            ["/log/serial.log", "/drives/root"].map(PathBuf::from)
        );
        assert!(
            j.binds.iter().all(|b| !(b.writable && b.dir)),
            "no directory it may write (where it could make a socket or a symlink)"
        );
    }

    #[test]
    fn a_confined_qemu_writes_its_memory_file_under_a_fixed_name() {
        let mut c = config(Some(Confine { uid: 7, gid: 8 }));
        c.memory = crate::GuestMemory::Shared("/s/a/memory.ram".into());
        let p = paths(&c, Path::new("/s/a"), Path::new("/s/a/serial.log"), false);
        assert_eq!(p.memory_arg, Some(PathBuf::from("/mem/ram")));
        let bind = p
            .jail
            .unwrap()
            .binds
            .into_iter()
            .find(|b| b.inside == Path::new("/mem/ram"))
            .unwrap();
        assert_eq!(bind.host, PathBuf::from("/s/a/memory.ram"));
        assert!(bind.writable);
        let unconfined = paths(&config(None), Path::new("/s/a"), Path::new("/s/a/s"), false);
        assert_eq!(unconfined.memory_arg, None);
    }

    #[test]
    fn a_snapshots_memory_image_mapped_private_is_read_only_in_the_jail() {
        let mut c = config(Some(Confine { uid: 7, gid: 8 }));
        c.memory = crate::GuestMemory::Private("/snaps/e1/memory".into());
        let p = paths(&c, Path::new("/s/a"), Path::new("/s/a/serial.log"), false);
        let bind = p
            .jail
            .unwrap()
            .binds
            .into_iter()
            .find(|b| b.inside == Path::new("/mem/ram"))
            .unwrap();
        assert_eq!(bind.host, PathBuf::from("/snaps/e1/memory"));
        assert!(!bind.writable);
    }
}
