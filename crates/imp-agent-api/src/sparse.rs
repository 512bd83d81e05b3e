//! Where a sparse file holds data (`SEEK_DATA`/`SEEK_HOLE`): what a move sends of a VM's
//! files ([`crate::moves`]) and what the agent's snapshots copy, so holes are never read,
//! sent or written. Blocking calls: run them off the async runtime.

use std::fs::File;
use std::io;

use nix::unistd::{Whence, lseek};

/// The `[start, end)` byte ranges of `file` that hold data, in order. A file system without
/// `SEEK_DATA` reports the whole file as one range.
pub fn data_ranges(file: &File) -> io::Result<Vec<(u64, u64)>> {
    let len = file.metadata()?.len();
    let mut ranges = Vec::new();
    let mut at = 0u64;
    while at < len {
        let start = match seek(file, at, Whence::SeekData) {
            Ok(s) => s,
            // No data past `at`.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(nix::errno::Errno::EINVAL) if at == 0 => return Ok(vec![(0, len)]),
            Err(e) => return Err(e.into()),
        };
        let end = seek(file, start, Whence::SeekHole)
            .map_err(io::Error::from)?
            .min(len);
        if end <= start {
            break;
        }
        ranges.push((start, end));
        at = end;
    }
    Ok(ranges)
}

fn seek(file: &File, at: u64, whence: Whence) -> nix::Result<u64> {
    let at = i64::try_from(at).map_err(|_| nix::errno::Errno::EOVERFLOW)?;
    let to = lseek(file, at, whence)?;
    u64::try_from(to).map_err(|_| nix::errno::Errno::EOVERFLOW)
}
