//! Per-VM writable disks: a copy-on-write clone (or sparse copy) of a cached base image, grown
//! to the VM class's size. No VM ever writes to the shared base.

#![allow(unsafe_code)]

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::blobs::{sync_dir, temp_path};
use super::{ImageError, Result, blocking};

nix::ioctl_write_int!(
    /// `FICLONE` (`_IOW(0x94, 9, int)`): clone all extents of the fd argument into the target.
    ficlone,
    0x94,
    9
);

/// Asks the filesystem to share `src`'s extents with `dst` (btrfs, xfs, bcachefs…).
fn try_reflink(src: &File, dst: &File) -> bool {
    // SAFETY: FICLONE takes the source fd as its argument; both fds are open for the whole call
    // and the kernel does not keep them.
    unsafe { ficlone(dst.as_raw_fd(), src.as_raw_fd() as u64) }.is_ok()
}

/// Copies the data extents of `src` to `dst`, leaving holes as holes (SEEK_DATA/SEEK_HOLE).
fn sparse_copy(src: &mut File, dst: &File, len: u64) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        let data = match nix::unistd::lseek(&*src, pos as i64, nix::unistd::Whence::SeekData) {
            Ok(off) => off as u64,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = match nix::unistd::lseek(&*src, data as i64, nix::unistd::Whence::SeekHole) {
            Ok(off) => off as u64,
            Err(e) => return Err(e.into()),
        };
        src.seek(SeekFrom::Start(data))?;
        let mut off = data;
        while off < hole {
            let want = usize::try_from((hole - off).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = src.read(&mut buf[..want])?;
            if n == 0 {
                break;
            }
            // A block of zeros stays a hole.
            if buf[..n].iter().any(|&b| b != 0) {
                dst.write_all_at(&buf[..n], off)?;
            }
            off += n as u64;
        }
        pos = hole;
    }
    Ok(())
}

/// How the clone was made, for logs and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneMethod {
    /// FICLONE: extents shared copy-on-write.
    Reflink,
    /// Data extents copied, holes kept.
    SparseCopy,
}

fn clone_blocking(base: &Path, dest: &Path, size_bytes: u64) -> Result<CloneMethod> {
    let mut src = File::open(base).map_err(ImageError::io("Opening the base image", base))?;
    let base_size = src
        .metadata()
        .map_err(ImageError::io("Inspecting the base image", base))?
        .len();
    if size_bytes < base_size {
        return Err(ImageError::DiskTooSmall {
            dest: dest.to_path_buf(),
            requested: size_bytes,
            base: base.to_path_buf(),
            base_size,
        });
    }
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let stem = dest
        .file_name()
        .map_or_else(|| "disk".into(), |n| n.to_string_lossy().into_owned());
    let tmp = temp_path(&dir, &stem);
    let result = (|| {
        let dst = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(ImageError::io("Creating the disk", &tmp))?;
        let method = if try_reflink(&src, &dst) {
            CloneMethod::Reflink
        } else {
            dst.set_len(base_size)
                .map_err(ImageError::io("Sizing the disk", &tmp))?;
            sparse_copy(&mut src, &dst, base_size)
                .map_err(ImageError::io("Copying the base image to", &tmp))?;
            CloneMethod::SparseCopy
        };
        if size_bytes > base_size {
            dst.set_len(size_bytes)
                .map_err(ImageError::io("Growing the disk", &tmp))?;
            dst.sync_all()
                .map_err(ImageError::io("Syncing the disk", &tmp))?;
            let out = Command::new("resize2fs")
                .arg(&tmp)
                .output()
                .map_err(ImageError::io("Running resize2fs on", &tmp))?;
            if !out.status.success() {
                return Err(ImageError::Tool {
                    tool: "resize2fs",
                    path: tmp.clone(),
                    detail: format!(
                        "{}: {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                });
            }
        }
        dst.sync_all()
            .map_err(ImageError::io("Syncing the disk", &tmp))?;
        std::fs::rename(&tmp, dest)
            .map_err(ImageError::io("Renaming the disk into place at", dest))?;
        sync_dir(&dir)?;
        Ok(method)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Makes `dest` a private, writable copy of the ext4 image `base` of `size_bytes` bytes
/// (at least the base's size; the filesystem is grown to fill it), atomically. Never shares
/// writable blocks with the base: a reflink is copy-on-write, otherwise the data is copied.
pub async fn clone_disk(base: &Path, dest: &Path, size_bytes: u64) -> Result<CloneMethod> {
    let (b, d) = (base.to_path_buf(), dest.to_path_buf());
    let method = blocking(move || clone_blocking(&b, &d, size_bytes)).await?;
    tracing::info!(base = %base.display(), dest = %dest.display(), size_bytes, ?method, "cloned disk");
    Ok(method)
}
