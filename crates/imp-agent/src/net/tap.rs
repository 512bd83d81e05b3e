//! Persistent TAP devices, made with the `/dev/net/tun` ioctls (the kernel does not create
//! TAPs over rtnetlink). A persistent TAP outlives the agent and is opened by name by the VMM.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;

const TUN_PATH: &str = "/dev/net/tun";

/// Creates persistent TAP `name` (no packet information header, single queue). Creating one
/// that exists already with the same flags succeeds and changes nothing.
pub fn create_persistent(name: &str) -> io::Result<()> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("TAP name {name:?} is empty or longer than 15 bytes"),
        ));
    }
    let tun = OpenOptions::new().read(true).write(true).open(TUN_PATH)?;
    // SAFETY: ifreq is a plain C struct (name array + union of plain fields); all-zero is a
    // valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF takes a pointer to an ifreq that lives for the call; the fd is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: TUNSETPERSIST takes an integer argument; the fd is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
