//! Persistent TAP devices, made with the `/dev/net/tun` ioctls (the kernel does not create
//! TAPs over rtnetlink). A persistent TAP outlives the agent and is opened by name by the VMM.
//! [`duplicate_from`] takes a copy of the descriptor a VMM holds on one, so the TAP stays
//! attached, with the frames queued in it, once that VMM is gone.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

const TUN_PATH: &str = "/dev/net/tun";

/// An ifreq naming TAP `name` with flags `IFF_TAP | IFF_NO_PI` (single queue).
fn tap_request(name: &str) -> io::Result<libc::ifreq> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("TAP name {name:?} is empty or longer than 15 bytes"),
        ));
    }
    // SAFETY: ifreq is a plain C struct (name array + union of plain fields); all-zero is a
    // valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    Ok(req)
}

/// `/dev/net/tun` attached to TAP `name` (made if missing, not persistent then).
fn attach_tun(name: &str) -> io::Result<std::fs::File> {
    let mut req = tap_request(name)?;
    let tun = OpenOptions::new().read(true).write(true).open(TUN_PATH)?;
    // SAFETY: TUNSETIFF takes a pointer to an ifreq that lives for the call; the fd is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tun)
}

/// The index of interface `name` in this network namespace, if it exists.
pub fn index_of(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: `c` is a NUL-terminated string that lives for the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (index != 0).then_some(index)
}

/// Creates persistent TAP `name` (no packet information header, single queue). Creating one
/// that exists already with the same flags succeeds and changes nothing.
pub fn create_persistent(name: &str) -> io::Result<()> {
    let tun = attach_tun(name)?;
    // SAFETY: TUNSETPERSIST takes an integer argument; the fd is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Opens persistent TAP `name` as its VMM would (no packet information header, no virtio-net
/// header: see the QEMU driver's `-netdev`), for a VMM that is handed the descriptor because it
/// may open nothing itself. Refuses a TAP that does not exist (TUNSETIFF would make a new,
/// non-persistent one).
pub fn open_persistent(name: &str) -> io::Result<OwnedFd> {
    tap_request(name)?;
    if index_of(name).is_none() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("TAP {name} does not exist"),
        ));
    }
    Ok(attach_tun(name)?.into())
}

/// A duplicate of the descriptor process `pid` holds on TAP `name`, taken with pidfd_getfd(2)
/// (which needs ptrace rights over the process: root has them). It shares the VMM's open file:
/// while either is open the TAP stays attached, keeps its carrier, and queues what the bridge
/// sends to it, also after the VMM has exited. `Ok(None)` when the process holds no descriptor
/// on that TAP.
pub fn duplicate_from(pid: u32, name: &str) -> io::Result<Option<OwnedFd>> {
    let Some(target) = descriptor_on(Path::new(&format!("/proc/{pid}/fdinfo")), name)? else {
        return Ok(None);
    };
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that process and flags, and
    // returns a new close-on-exec descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above, a new descriptor that is ours alone.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
}

/// The number of a descriptor attached to TAP `name`, from a process's `fdinfo` directory
/// (a TUN/TAP descriptor's says `iff:\tNAME`).
fn descriptor_on(fdinfo: &Path, name: &str) -> io::Result<Option<RawFd>> {
    for entry in std::fs::read_dir(fdinfo)? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A descriptor closed since the listing is simply not the one.
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        if attached_to(&info, name) {
            return Ok(Some(fd));
        }
    }
    Ok(None)
}

/// Whether an `fdinfo` text is a TUN/TAP descriptor's attached to `name`.
fn attached_to(fdinfo: &str, name: &str) -> bool {
    fdinfo
        .lines()
        .any(|l| l.strip_prefix("iff:").is_some_and(|n| n.trim() == name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tap_descriptor_is_told_by_its_fdinfo() {
        let tap = "pos:\t0\nflags:\t0104002\nmnt_id:\t25\nino:\t1045\niff:\timptap-ab12\n";
        assert!(attached_to(tap, "imptap-ab12"));
        assert!(!attached_to(tap, "imptap-ab1"));
        assert!(!attached_to("pos:\t0\nflags:\t02\n", "imptap-ab12"));
    }

    #[test]
    fn a_process_without_the_tap_has_no_descriptor_on_it() {
        assert!(
            duplicate_from(std::process::id(), "imptap-none")
                .unwrap()
                .is_none()
        );
        let e = duplicate_from(u32::MAX - 1, "imptap-none").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }
}
