//! A VMM's jail, set up between fork and exec by the (privileged) process that starts it: new
//! mount, network, IPC and UTS namespaces; a root of its own (a tmpfs) holding only the host's
//! `/usr` read-only (the VMM's binary, libraries and firmware), a few device nodes, and the
//! files of its VM that the caller names; a uid and gid of its own with no supplementary
//! groups; no capabilities (bounding set emptied too); `no_new_privs`. A guest that breaks out
//! of the VMM lands as that uid, in that root, with no network but the descriptors it was given
//! (the TAP), no way back to root, and a seccomp filter on top (QEMU's `-sandbox`).
//!
//! [`Jail::plan`] is a pure function from the jail's description to the list of steps;
//! [`Jail::apply_to`] turns those steps into C strings and installs them in a `pre_exec` hook,
//! where only async-signal-safe system calls run (the child of a multithreaded parent must not
//! allocate).
#![allow(unsafe_code)] // mount(2), pivot_root(2), setresuid(2) between fork and exec

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

/// Why a jail could not be described.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// A path holds a NUL byte.
    #[error("jail path {0} holds a NUL byte")]
    Nul(PathBuf),
    /// A path inside the jail is not absolute.
    #[error("jail path {0} must be absolute")]
    Relative(PathBuf),
}

/// A host file or directory that appears inside the jail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bind {
    /// On the host.
    pub host: PathBuf,
    /// Inside the jail (absolute).
    pub inside: PathBuf,
    /// Whether the VMM may write it.
    pub writable: bool,
    /// A directory (else a file).
    pub dir: bool,
}

/// Who the VMM runs as and what it sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Jail {
    /// Its uid (never 0).
    pub uid: u32,
    /// Its gid (never 0).
    pub gid: u32,
    /// Where the jail's tmpfs root is mounted (in the child's own mount namespace only, so
    /// the host never sees it): any existing directory.
    pub mount_point: PathBuf,
    /// Host device nodes it may open (`/dev/null`, `/dev/urandom`, `/dev/kvm` …).
    pub devices: Vec<PathBuf>,
    /// Its VM's files. A bind never lies under a bound directory (its mount point would be
    /// made in the host's directory).
    pub binds: Vec<Bind>,
}

/// One step of the jail's set-up, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// An empty directory at this path (under the new root).
    Dir(PathBuf),
    /// An empty file at this path (a bind target).
    File(PathBuf),
    /// A symbolic link `path` → `target`.
    Symlink {
        /// The link.
        path: PathBuf,
        /// Where it points.
        target: PathBuf,
    },
    /// A bind mount of `host` on `target`, read-only unless `writable`.
    Bind {
        /// On the host.
        host: PathBuf,
        /// The mount point (under the new root).
        target: PathBuf,
        /// Whether it stays writable.
        writable: bool,
    },
}

impl Jail {
    /// The steps that build the root under [`Jail::mount_point`], after the tmpfs is mounted
    /// there and before `pivot_root`: system files, devices, the VM's binds (parents first).
    pub fn plan(&self) -> Result<Vec<Step>, JailError> {
        let root = &self.mount_point;
        let at = |p: &Path| -> Result<PathBuf, JailError> {
            let rel = p
                .strip_prefix("/")
                .map_err(|_| JailError::Relative(p.to_path_buf()))?;
            Ok(root.join(rel))
        };
        let mut steps = vec![
            Step::Dir(root.join("usr")),
            Step::Bind {
                host: "/usr".into(),
                target: root.join("usr"),
                writable: false,
            },
            Step::Dir(root.join("dev")),
            Step::Dir(root.join("tmp")),
        ];
        // Merged /usr (Debian): the loader and libraries are reached through these links.
        for (link, target) in [
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
            ("bin", "usr/bin"),
        ] {
            steps.push(Step::Symlink {
                path: root.join(link),
                target: target.into(),
            });
        }
        for d in &self.devices {
            steps.push(Step::File(at(d)?));
            steps.push(Step::Bind {
                host: d.clone(),
                target: at(d)?,
                writable: true,
            });
        }
        let mut made: Vec<PathBuf> = vec![root.join("usr"), root.join("dev"), root.join("tmp")];
        for b in &self.binds {
            let target = at(&b.inside)?;
            let mut parents: Vec<PathBuf> = target
                .ancestors()
                .skip(1)
                .take_while(|p| *p != root.as_path())
                .map(Path::to_path_buf)
                .collect();
            parents.reverse();
            for p in parents {
                if !made.contains(&p) {
                    steps.push(Step::Dir(p.clone()));
                    made.push(p);
                }
            }
            steps.push(if b.dir {
                made.push(target.clone());
                Step::Dir(target.clone())
            } else {
                Step::File(target.clone())
            });
            steps.push(Step::Bind {
                host: b.host.clone(),
                target,
                writable: b.writable,
            });
        }
        Ok(steps)
    }

    /// Installs the jail in `cmd`: the child sets it up after fork and execs the VMM inside it.
    /// The program `cmd` runs must be reachable inside the jail (under `/usr`).
    pub fn apply_to(&self, cmd: &mut tokio::process::Command) -> Result<(), JailError> {
        let prepared = Prepared::new(self)?;
        // SAFETY: the hook runs in the child between fork and exec. `Prepared::enter` only
        // makes system calls (unshare, mount, mkdir, open, close, symlink, chdir, pivot_root,
        // umount2, prctl, setgroups, setresgid, setresuid) on C strings built before the fork;
        // it neither allocates nor takes locks.
        unsafe {
            cmd.pre_exec(move || prepared.enter());
        }
        Ok(())
    }
}

fn cstring(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| JailError::Nul(p.to_path_buf()))
}

/// A step with its paths as C strings.
enum CStep {
    Dir(CString),
    File(CString),
    Symlink(CString, CString),
    Bind(CString, CString, bool),
}

/// Everything the child needs, built before the fork.
struct Prepared {
    root: CString,
    steps: Vec<CStep>,
    uid: libc::uid_t,
    gid: libc::gid_t,
}

/// The highest capability number to drop from the bounding set (the kernel ignores the
/// numbers it does not know: EINVAL).
const LAST_CAP: libc::c_int = 63;

impl Prepared {
    fn new(j: &Jail) -> Result<Self, JailError> {
        let steps = j
            .plan()?
            .into_iter()
            .map(|s| {
                Ok(match s {
                    Step::Dir(p) => CStep::Dir(cstring(&p)?),
                    Step::File(p) => CStep::File(cstring(&p)?),
                    Step::Symlink { path, target } => {
                        CStep::Symlink(cstring(&target)?, cstring(&path)?)
                    }
                    Step::Bind {
                        host,
                        target,
                        writable,
                    } => CStep::Bind(cstring(&host)?, cstring(&target)?, writable),
                })
            })
            .collect::<Result<Vec<_>, JailError>>()?;
        Ok(Prepared {
            root: cstring(&j.mount_point)?,
            steps,
            uid: j.uid,
            gid: j.gid,
        })
    }

    /// In the child: namespaces and the new root's contents, the pivot into it, then the
    /// credentials. Any failure aborts the exec (the parent's spawn returns the error).
    fn enter(&self) -> std::io::Result<()> {
        self.build_root()?;
        self.pivot()?;
        self.drop_privileges()
    }

    /// New namespaces, a private mount tree, and the tmpfs root filled with its steps.
    fn build_root(&self) -> std::io::Result<()> {
        // SAFETY: plain system calls on C strings owned by `self`, which outlives them.
        unsafe {
            check(libc::unshare(
                libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS,
            ))?;
            // Nothing mounted from here on propagates back to the host.
            check(libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,size=1m".as_ptr().cast(),
            ))?;
        }
        self.steps.iter().try_for_each(CStep::make)
    }

    /// Makes the tmpfs the root, read-only; with `pivot_root`, the old root (stacked under it)
    /// is detached.
    ///
    /// Where a seccomp filter refuses `pivot_root` (containerd's and Docker's RuntimeDefault
    /// profile do, even to a holder of `CAP_SYS_ADMIN`: the agent in a Pod), the tmpfs becomes
    /// the root with `chroot` alone. The old root then stays mounted in the VMM's namespace,
    /// out of its reach: leaving a chroot takes `CAP_SYS_CHROOT`, which the VMM drops with
    /// every other capability ([`Self::drop_privileges`]), and the kernel refuses a new user
    /// namespace (where it could gain one) to a chrooted process. The tmpfs is not moved over
    /// `/` first, as runc does without `pivot_root`: the kernel would then no longer count the
    /// process as chrooted and would let it create that user namespace.
    fn pivot(&self) -> std::io::Result<()> {
        // SAFETY: plain system calls on C strings owned by `self` or static; errno is read
        // through `__errno_location`, this thread's, right after the call that set it.
        unsafe {
            check(libc::chdir(self.root.as_ptr()))?;
            let pivoted =
                libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int;
            if pivoted == 0 {
                check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            } else if *libc::__errno_location() == libc::EPERM {
                check(libc::chroot(c".".as_ptr()))?;
            } else {
                return Err(std::io::Error::last_os_error());
            }
            check(libc::chdir(c"/".as_ptr()))?;
            // The root itself read-only (the binds keep their own flags).
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_BIND
                    | libc::MS_REMOUNT
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV,
                std::ptr::null(),
            ))
        }
    }

    /// Empties the capability bounding set, takes the jail's uid and gid with no
    /// supplementary groups, and sets `no_new_privs`.
    fn drop_privileges(&self) -> std::io::Result<()> {
        // SAFETY: plain system calls with integer arguments; `__errno_location` is this
        // thread's errno.
        unsafe {
            for cap in 0..=LAST_CAP {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0
                    && *libc::__errno_location() != libc::EINVAL
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            check(libc::setgroups(0, std::ptr::null()))?;
            check(libc::setresgid(self.gid, self.gid, self.gid))?;
            // Leaving uid 0 clears the permitted, effective and ambient capabilities.
            check(libc::setresuid(self.uid, self.uid, self.uid))?;
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        }
    }
}

impl CStep {
    /// Makes this step's directory, file, symlink or bind mount (in the child, before the
    /// pivot).
    fn make(&self) -> std::io::Result<()> {
        // SAFETY: plain system calls on C strings owned by `self`; the descriptor `open`
        // returns is closed at once.
        unsafe {
            match self {
                CStep::Dir(p) => check(libc::mkdir(p.as_ptr(), 0o755)),
                CStep::File(p) => {
                    let fd = libc::open(
                        p.as_ptr(),
                        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                        0o644,
                    );
                    check(fd)?;
                    libc::close(fd);
                    Ok(())
                }
                CStep::Symlink(target, path) => {
                    check(libc::symlink(target.as_ptr(), path.as_ptr()))
                }
                CStep::Bind(host, target, writable) => {
                    check(libc::mount(
                        host.as_ptr(),
                        target.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND | libc::MS_REC,
                        std::ptr::null(),
                    ))?;
                    let mut flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID;
                    if !writable {
                        flags |= libc::MS_RDONLY;
                    }
                    check(libc::mount(
                        std::ptr::null(),
                        target.as_ptr(),
                        std::ptr::null(),
                        flags,
                        std::ptr::null(),
                    ))
                }
            }
        }
    }
}

/// A system call's return value as a result: negative is the call's errno.
fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn jail() -> Jail {
        Jail {
            uid: 1000,
            gid: 1000,
            mount_point: "/run/j".into(),
            devices: vec!["/dev/null".into()],
            binds: vec![
                Bind {
                    host: "/state/vms/a/vmm".into(),
                    inside: "/vm".into(),
                    writable: true,
                    dir: true,
                },
                Bind {
                    host: "/state/vms/a/disk.ext4".into(),
                    inside: "/drives/root".into(),
                    writable: true,
                    dir: false,
                },
                Bind {
                    host: "/opt/kernels/vmlinux".into(),
                    inside: "/boot/kernel".into(),
                    writable: false,
                    dir: false,
                },
            ],
        }
    }

    #[test]
    fn the_root_holds_usr_read_only_its_devices_and_its_binds_parents_first() {
        let steps = jail().plan().unwrap();
        let bind = |host: &str, target: &str, writable| Step::Bind {
            host: host.into(),
            target: target.into(),
            writable,
        };
        assert!(steps.contains(&bind("/usr", "/run/j/usr", false)));
        assert!(steps.contains(&bind("/dev/null", "/run/j/dev/null", true)));
        assert!(steps.contains(&bind("/state/vms/a/vmm", "/run/j/vm", true)));
        assert!(steps.contains(&bind("/opt/kernels/vmlinux", "/run/j/boot/kernel", false)));
        let pos = |s: &Step| steps.iter().position(|x| x == s).unwrap();
        let drives = Step::Dir("/run/j/drives".into());
        assert!(
            pos(&drives) < pos(&Step::File("/run/j/drives/root".into())),
            "a parent before its child"
        );
        assert_eq!(
            steps
                .iter()
                .filter(|s| **s == Step::Dir("/run/j/boot".into()))
                .count(),
            1
        );
        // Nothing of the host but /usr, the devices and the binds.
        let hosts: Vec<&PathBuf> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Bind { host, .. } => Some(host),
                _ => None,
            })
            .collect();
        assert_eq!(hosts.len(), 5, "{hosts:?}");
    }

    #[test]
    fn paths_inside_must_be_absolute_and_free_of_nul() {
        let mut j = jail();
        j.binds[0].inside = "vm".into();
        assert!(matches!(j.plan(), Err(JailError::Relative(_))));
        let mut j = jail();
        j.binds[0].host = PathBuf::from("/a\0b");
        assert!(matches!(Prepared::new(&j), Err(JailError::Nul(_))));
    }
}
