//! Sparse files: where a file holds data (`SEEK_DATA`/`SEEK_HOLE`, [`data_ranges`], shared with
//! the moves' sender in `imp-agent-api`), and copies that keep the holes, so a snapshot of a
//! guest that touched 100 MiB of its 2 GiB stores 100 MiB.
//! Blocking calls: run them off the async runtime.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

pub use imp_agent_api::sparse::data_ranges;

/// The bytes of `file` that hold data.
pub fn data_bytes(path: &Path) -> io::Result<u64> {
    let f = File::open(path)?;
    Ok(data_ranges(&f)?.iter().map(|(s, e)| e - s).sum())
}

/// Copies `src` to a new file `dst` (mode 0600) of the same length, writing only its data
/// ranges (`copy_file_range`, in-kernel), so holes stay holes; returns the bytes copied.
pub fn copy(src: &Path, dst: &Path) -> io::Result<u64> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let from = File::open(src)?;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let mut copied = 0;
    for (start, end) in data_ranges(&from)? {
        copied += copy_range(&from, &to, start, end)?;
    }
    to.sync_data()?;
    Ok(copied)
}

/// Copies `[start, end)` of `from` to the same offsets of `to`.
fn copy_range(from: &File, to: &File, start: u64, end: u64) -> io::Result<u64> {
    let mut at = start;
    while at < end {
        let (mut off_in, mut off_out) = (
            i64::try_from(at).map_err(io::Error::other)?,
            i64::try_from(at).map_err(io::Error::other)?,
        );
        let want = usize::try_from(end - at).unwrap_or(usize::MAX).min(1 << 30);
        match nix::fcntl::copy_file_range(from, Some(&mut off_in), to, Some(&mut off_out), want) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            // Across file systems on older kernels: copy through a buffer.
            Err(nix::errno::Errno::EXDEV | nix::errno::Errno::ENOSYS) => {
                return copy_range_buffered(from, to, at, end).map(|n| at - start + n);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(at - start)
}

fn copy_range_buffered(from: &File, to: &File, start: u64, end: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = start;
    while at < end {
        let n = usize::try_from(end - at)
            .unwrap_or(buf.len())
            .min(buf.len());
        let got = from.read_at(&mut buf[..n], at)?;
        if got == 0 {
            break;
        }
        to.write_all_at(&buf[..got], at)?;
        at += got as u64;
    }
    Ok(at - start)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("imp-sparse-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_sparse_copy_keeps_the_data_and_the_holes() {
        let d = scratch("copy");
        let src = d.join("src");
        let f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"first", 0).unwrap();
        f.write_all_at(&[7u8; 8192], 40 << 20).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let ranges = data_ranges(&File::open(&src).unwrap()).unwrap();
        assert!(ranges.len() >= 2, "{ranges:?}");
        let dst = d.join("dst");
        let copied = copy(&src, &dst).unwrap();
        assert!(
            copied < 1 << 20,
            "copied {copied} bytes of a 64 MiB file holding 8 KiB"
        );
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        assert!(data_bytes(&dst).unwrap() < 1 << 20);
        assert!(
            copy(&src, &dst).is_err(),
            "an existing target is not overwritten"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
