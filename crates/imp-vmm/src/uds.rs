//! Connecting to a VMM's Unix socket by path without following what the VMM may have put there.
//!
//! The shim and the node agent run as root; a confined VMM runs as a uid of its own and may
//! write the directory some of its sockets are in (Firecracker's jail root holds its API socket
//! and its hybrid vsock socket). A compromised VMM could replace such a socket with a symlink to
//! another VM's socket, or to any root-only socket of the host, and a plain `connect(2)` by root
//! would follow it. [`connect`] connects only to a socket that was made in that very directory
//! by the directory's owner: it opens the last component without following it (`O_PATH |
//! O_NOFOLLOW`), refuses anything that is not a socket (a symlink is not) or that is owned by
//! another uid than the directory (a hard link to a socket someone else bound), and connects
//! through the descriptor it checked (`/proc/self/fd/N`), so the path cannot change between the
//! check and the connect. In a directory only root may write (the VM's run directory) that is
//! a socket root made; in a jail root it is one the VMM's own uid made — the VMM itself.
//!
//! The directories above the last component are trusted: imp creates them, root-owned, and no
//! VMM may write them. QEMU has no socket path at all (its sockets are socket pairs, see
//! [`crate::qemu`]); this is for Firecracker's sockets and for the host side of the guest
//! channel, which front ends find by path in the VM's record.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat};

/// Why a socket was refused: it is not one its directory's owner made there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The socket's path.
    pub path: PathBuf,
    /// What is wrong with it.
    pub why: String,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The caller's message names the path.
        f.write_str(&self.why)
    }
}

impl std::error::Error for Refused {}

/// Whether `e` is a [`Refused`] (no retry will help) rather than a socket that is missing or
/// not listening yet.
pub fn is_refused(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Refused>())
}

/// The decision on one socket, from what `fstat` said of it and of its directory: `Ok` if it
/// is a socket owned by the directory's owner.
pub fn check(path: &Path, mode: u32, owner: u32, dir_owner: u32) -> Result<(), Refused> {
    let kind = SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits());
    let refuse = |why: String| {
        Err(Refused {
            path: path.to_path_buf(),
            why,
        })
    };
    if kind != SFlag::S_IFSOCK {
        let what = match kind {
            SFlag::S_IFLNK => "a symlink",
            SFlag::S_IFDIR => "a directory",
            SFlag::S_IFREG => "a regular file",
            _ => "not a socket",
        };
        return refuse(format!("it is {what}, not a socket"));
    }
    if owner != dir_owner {
        return refuse(format!(
            "the socket belongs to uid {owner}, its directory to uid {dir_owner}"
        ));
    }
    Ok(())
}

/// Opens `path` for connecting: its directory, then the socket itself without following it,
/// both checked ([`check`]). The descriptor names the checked inode.
fn open_checked(path: &Path) -> io::Result<OwnedFd> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::other(Refused {
            path: path.to_path_buf(),
            why: "it names no file in a directory".into(),
        }));
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let dir_fd: OwnedFd = nix::fcntl::open(
        dir,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let fd: OwnedFd = openat(
        &dir_fd,
        name,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let dir_stat = fstat(&dir_fd)?;
    let stat = fstat(&fd)?;
    check(path, stat.st_mode, stat.st_uid, dir_stat.st_uid).map_err(io::Error::other)?;
    Ok(fd)
}

/// The path through which `fd` itself is reached: connecting to it reaches the socket inode
/// the descriptor holds, whatever the original path names by then.
fn via(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Connects to the socket at `path` if its directory's owner made it there (see the module);
/// a refusal is an error for which [`is_refused`] holds.
pub async fn connect(path: &Path) -> io::Result<tokio::net::UnixStream> {
    let fd = open_checked(path)?;
    let stream = tokio::net::UnixStream::connect(via(&fd)).await;
    drop(fd);
    stream
}

/// [`connect`] for blocking callers.
pub fn connect_blocking(path: &Path) -> io::Result<std::os::unix::net::UnixStream> {
    let fd = open_checked(path)?;
    std::os::unix::net::UnixStream::connect(via(&fd))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    use crate::scratch::Scratch;

    #[test]
    fn only_a_socket_of_the_directorys_owner_passes() {
        let p = Path::new("/jail/root/firecracker.sock");
        let sock = SFlag::S_IFSOCK.bits() | 0o755;
        assert_eq!(check(p, sock, 1000, 1000), Ok(()));
        assert_eq!(check(p, sock, 0, 0), Ok(()));
        let e = check(p, sock, 0, 1000).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the socket belongs to uid 0, its directory to uid 1000"
        );
        assert_eq!(e.path, p);
        let link = check(p, SFlag::S_IFLNK.bits() | 0o777, 1000, 1000).unwrap_err();
        assert!(link.why.contains("a symlink"), "{link}");
        assert!(check(p, SFlag::S_IFREG.bits(), 1000, 1000).is_err());
        assert!(check(p, SFlag::S_IFDIR.bits(), 1000, 1000).is_err());
    }

    /// A symlink where a VMM's socket should be, pointing at a socket that would answer, is
    /// refused: nothing connects to its target. The socket itself, in the same directory, is
    /// reached through the descriptor that was checked.
    #[tokio::test]
    async fn a_symlink_in_place_of_the_socket_reaches_nothing() {
        let dir = Scratch::new("uds", "symlink");
        let victim_dir = dir.0.join("victim");
        std::fs::create_dir(&victim_dir).unwrap();
        let victim = victim_dir.join("qmp.sock");
        let listener = tokio::net::UnixListener::bind(&victim).unwrap();
        let planted = dir.0.join("firecracker.sock");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let e = connect(&planted).await.unwrap_err();
        assert!(is_refused(&e), "{e}");
        assert!(e.to_string().contains("a symlink"), "{e}");
        assert!(connect_blocking(&planted).is_err());
        let accepted =
            tokio::time::timeout(std::time::Duration::from_millis(200), listener.accept()).await;
        assert!(accepted.is_err(), "the symlink's target got a connection");
        // The real socket works, and so does one in a directory reached through a symlink
        // (the directories above are trusted).
        let real = dir.0.join("real.sock");
        let real_listener = tokio::net::UnixListener::bind(&real).unwrap();
        let mut c = connect(&real).await.unwrap();
        let (mut s, _) = real_listener.accept().await.unwrap();
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        c.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.unwrap();
        std::os::unix::fs::symlink(&dir.0, dir.0.join("alias")).unwrap();
        connect(&dir.0.join("alias/real.sock")).await.unwrap();
        let missing = connect(&dir.0.join("missing.sock")).await.unwrap_err();
        assert!(!is_refused(&missing), "a missing socket is worth a retry");
    }

    /// A hard link to a socket another uid bound (as a VMM could make of a socket it can see)
    /// is refused: it is not its directory's owner's. Needs root to give the directory away.
    #[tokio::test]
    async fn a_socket_of_another_uid_is_refused() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = Scratch::new("uds", "owner");
        let vmm_dir = dir.0.join("jail");
        std::fs::create_dir(&vmm_dir).unwrap();
        std::os::unix::fs::chown(&vmm_dir, Some(4242), Some(4242)).unwrap();
        std::fs::set_permissions(&vmm_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let root_sock = dir.0.join("root.sock");
        let listener = tokio::net::UnixListener::bind(&root_sock).unwrap();
        std::fs::hard_link(&root_sock, vmm_dir.join("firecracker.sock")).unwrap();
        let e = connect(&vmm_dir.join("firecracker.sock"))
            .await
            .unwrap_err();
        assert!(is_refused(&e), "{e}");
        assert!(e.to_string().contains("belongs to uid 0"), "{e}");
        let accepted =
            tokio::time::timeout(std::time::Duration::from_millis(200), listener.accept()).await;
        assert!(accepted.is_err(), "root's socket got a connection");
    }
}
