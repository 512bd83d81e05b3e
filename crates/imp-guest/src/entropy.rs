//! The kernel's random number generator, fed from the host: a guest restored from a snapshot
//! that other VMs share starts with their generator state, so until it reseeds it hands out
//! the same "random" bytes as every other clone.
//!
//! Bytes are mixed into the input pool and credited with `RNDADDENTROPY`, then the CRNG (what
//! `/dev/urandom` and `getrandom` read) is reseeded from the pool at once with
//! `RNDRESEEDCRNG`. The reseed is what counts: on Linux 6.1 a credit changes nothing the CRNG
//! hands out once it is initialized (two clones that only credit still read the same bytes,
//! see the `qemu_clone` test); it would take the pool at its own next reseed, up to a minute
//! later. Both need `CAP_SYS_ADMIN`.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::Ioctl = nix::request_code_write!(b'R', 0x03, 8) as libc::Ioctl;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)` (Linux 4.17).
const RNDRESEEDCRNG: libc::Ioctl = nix::request_code_none!(b'R', 0x07) as libc::Ioctl;

/// Where the ioctls are made (either random device takes them).
const DEVICE: &str = "/dev/urandom";

/// How a reseed request went.
#[derive(Debug)]
pub enum Reseed {
    /// The CRNG was reseeded from the input pool.
    Done,
    /// The kernel predates `RNDRESEEDCRNG` (`ENOTTY` or `EINVAL`): the credited bytes reach
    /// the CRNG at its next scheduled reseed.
    Unsupported(io::Error),
    /// The CRNG is not initialized yet (`ENODATA`): it will seed from the pool, which now
    /// holds the bytes, when it is.
    NotReady,
}

/// The `struct rand_pool_info` of `RNDADDENTROPY` for `bytes`, crediting `bits`: the credit,
/// the byte count, then the bytes, as native 32-bit words (the kernel reads exactly the byte
/// count of them).
pub fn rand_pool_info(bytes: &[u8], bits: u32) -> Vec<u32> {
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    let mut words = Vec::with_capacity(2 + bytes.len().div_ceil(4));
    words.push(bits);
    words.push(len);
    words.extend(bytes.chunks(4).map(|chunk| {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        u32::from_ne_bytes(word)
    }));
    words
}

/// Mixes `bytes` into the kernel's input pool, crediting 8 bits per byte: the host read them
/// from its own generator. Returns the bits credited.
pub fn add(bytes: &[u8]) -> io::Result<u32> {
    let bits = u32::try_from(bytes.len())
        .ok()
        .and_then(|n| n.checked_mul(8))
        .filter(|b| i32::try_from(*b).is_ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "too many bytes"))?;
    let mut info = rand_pool_info(bytes, bits);
    let device = OpenOptions::new().write(true).open(DEVICE)?;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info (two ints and then buf_size bytes) from
    // the pointer; `info` is that struct, 4-byte aligned, with at least buf_size bytes after
    // its header, and lives across the call.
    let rc = unsafe { libc::ioctl(device.as_raw_fd(), RNDADDENTROPY, info.as_mut_ptr()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(bits)
}

/// Reseeds the CRNG from the input pool now.
pub fn reseed() -> io::Result<Reseed> {
    let device = OpenOptions::new().write(true).open(DEVICE)?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let rc = unsafe { libc::ioctl(device.as_raw_fd(), RNDRESEEDCRNG) };
    if rc == 0 {
        return Ok(Reseed::Done);
    }
    let err = io::Error::last_os_error();
    Ok(match err.raw_os_error() {
        Some(libc::ENOTTY | libc::EINVAL) => Reseed::Unsupported(err),
        Some(libc::ENODATA) => Reseed::NotReady,
        _ => return Err(err),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_codes_are_the_kernels() {
        assert_eq!(RNDADDENTROPY, 0x4008_5203);
        assert_eq!(RNDRESEEDCRNG, 0x5207);
    }

    #[test]
    fn pool_info_is_credit_length_then_the_bytes() {
        let info = rand_pool_info(&[1, 2, 3, 4, 5], 40);
        assert_eq!(info.len(), 4);
        assert_eq!(info[..2], [40, 5]);
        let bytes: Vec<u8> = info[2..].iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(bytes, [1, 2, 3, 4, 5, 0, 0, 0]);
        assert_eq!(rand_pool_info(&[], 0), [0, 0]);
        assert_eq!(rand_pool_info(&[9; 64], 512).len(), 2 + 16);
    }

    #[test]
    fn without_privilege_nothing_is_credited() {
        if nix::unistd::geteuid().is_root() {
            return;
        }
        let err = add(&[0; 64]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    }
}
