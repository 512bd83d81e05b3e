//! Building an ext4 filesystem image from a directory with `mkfs.ext4 -d` (e2fsprogs).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use super::{ImageError, Result};

/// Filesystem label of every base rootfs.
pub const LABEL: &str = "imp-rootfs";
/// Block size used for the images.
const BLOCK: u64 = 4096;

/// Bytes and inodes a directory tree needs on ext4, counted with `lstat` (links not followed).
fn usage(dir: &Path) -> Result<(u64, u64)> {
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        inodes += 1;
        bytes += BLOCK;
        for entry in std::fs::read_dir(&d).map_err(ImageError::io("Reading directory", &d))? {
            let entry = entry.map_err(ImageError::io("Reading directory", &d))?;
            let md = entry
                .metadata()
                .map_err(ImageError::io("Inspecting", entry.path()))?;
            if md.is_dir() {
                stack.push(entry.path());
            } else {
                inodes += 1;
                bytes += md.len().div_ceil(BLOCK) * BLOCK;
            }
        }
    }
    Ok((bytes, inodes))
}

/// Formats `out` (created or truncated) as ext4 holding a copy of `dir`, owned by root,
/// labelled [`LABEL`], sized for the content with room for metadata. Blocking; returns the size.
pub fn build_blocking(dir: &Path, out: &Path) -> Result<u64> {
    let (bytes, inodes) = usage(dir)?;
    // Content + 25 % + 16 MiB for the journal, group descriptors, bitmaps and inode tables.
    let size = ((bytes + bytes / 4 + inodes * 256 + (16 << 20)).div_ceil(1 << 20)) << 20;
    let file =
        std::fs::File::create(out).map_err(ImageError::io("Creating the ext4 image", out))?;
    file.set_len(size)
        .map_err(ImageError::io("Sizing the ext4 image", out))?;
    drop(file);
    let inode_count = (inodes + inodes / 4 + 1024).to_string();
    let output = Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-b",
            "4096",
            "-L",
            LABEL,
            "-N",
            &inode_count,
        ])
        .args(["-E", "root_owner=0:0", "-d"])
        .arg(dir)
        .arg(out)
        .output()
        .map_err(ImageError::io("Running mkfs.ext4 for", out))?;
    if !output.status.success() {
        return Err(ImageError::Tool {
            tool: "mkfs.ext4",
            path: out.to_path_buf(),
            detail: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    let f = std::fs::File::open(out).map_err(ImageError::io("Opening the ext4 image", out))?;
    f.sync_all()
        .map_err(ImageError::io("Syncing the ext4 image", out))?;
    let len = f
        .metadata()
        .map_err(ImageError::io("Inspecting the ext4 image", out))?
        .size();
    Ok(len)
}
