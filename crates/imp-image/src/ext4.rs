//! Building an ext4 filesystem image from a directory with `mkfs.ext4 -d` (e2fsprogs), then
//! giving it the inodes the staging directory holds only in a harmless form (device nodes,
//! setuid/setgid bits: [`super::layers::Special`]) with one `debugfs -w` script, so they exist
//! in the image and never on the host.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::layers::{Special, SpecialKind};

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
                // Allocated blocks, not the length: holes stay holes in the image too.
                bytes += (md.blocks() * 512).div_ceil(BLOCK) * BLOCK;
            }
        }
    }
    Ok((bytes, inodes))
}

/// Formats `out` (created or truncated) as ext4 holding a copy of `dir`, owned by root,
/// labelled [`LABEL`], sized for the content with room for metadata, then makes `specials`
/// (paths relative to `dir`) real in it. Blocking; returns the size.
pub fn build_blocking(
    dir: &Path,
    out: &Path,
    specials: &BTreeMap<PathBuf, Special>,
) -> Result<u64> {
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
    apply_specials(out, specials)?;
    let f = std::fs::File::open(out).map_err(ImageError::io("Opening the ext4 image", out))?;
    f.sync_all()
        .map_err(ImageError::io("Syncing the ext4 image", out))?;
    let len = f
        .metadata()
        .map_err(ImageError::io("Inspecting the ext4 image", out))?
        .size();
    Ok(len)
}

/// A path as a quoted `debugfs` argument (`"` doubled), or `None` when debugfs could not take
/// it (a control character: a newline would end the command).
fn quoted(path: &Path) -> Option<String> {
    let text = std::str::from_utf8(path.as_os_str().as_bytes()).ok()?;
    if text.chars().any(char::is_control) {
        return None;
    }
    Some(format!("\"{}\"", text.replace('"', "\"\"")))
}

/// The `debugfs -w` commands that turn the staged placeholders into `specials`.
fn specials_script(specials: &BTreeMap<PathBuf, Special>) -> std::result::Result<String, PathBuf> {
    let mut script = String::new();
    for (rel, s) in specials {
        let full = Path::new("/").join(rel);
        let path = quoted(&full).ok_or_else(|| rel.clone())?;
        let (parent, name) = match (full.parent(), full.file_name()) {
            (Some(p), Some(n)) => (p, Path::new(n)),
            _ => return Err(rel.clone()),
        };
        let (parent, name) = (
            quoted(parent).ok_or_else(|| rel.clone())?,
            quoted(name).ok_or_else(|| rel.clone())?,
        );
        let kind_bits = match s.kind {
            SpecialKind::File => 0o100000,
            SpecialKind::Char { major, minor } | SpecialKind::Block { major, minor } => {
                let t = if matches!(s.kind, SpecialKind::Char { .. }) {
                    "c"
                } else {
                    "b"
                };
                // mknod works in the current directory: go there, replace the placeholder.
                script.push_str(&format!(
                    "cd {parent}\nrm {name}\nmknod {name} {t} {major} {minor}\ncd \"/\"\n"
                ));
                if t == "c" { 0o020000 } else { 0o060000 }
            }
        };
        script.push_str(&format!(
            "sif {path} mode 0{:o}\nsif {path} uid {}\nsif {path} gid {}\nsif {path} mtime @{}\n",
            kind_bits | (s.mode & 0o7777),
            s.uid,
            s.gid,
            s.mtime.max(0)
        ));
    }
    Ok(script)
}

/// Runs the [`specials_script`] on the image `out`; any message from debugfs but its banner
/// is a failure (it exits 0 either way).
fn apply_specials(out: &Path, specials: &BTreeMap<PathBuf, Special>) -> Result<()> {
    if specials.is_empty() {
        return Ok(());
    }
    let script = specials_script(specials).map_err(|rel| ImageError::Tool {
        tool: "debugfs",
        path: out.to_path_buf(),
        detail: format!(
            "the device node or setuid file {:?} has a name debugfs cannot address",
            rel
        ),
    })?;
    let mut child = Command::new("debugfs")
        .arg("-w")
        .arg("-f")
        .arg("-")
        .arg(out)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(ImageError::io("Running debugfs on", out))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(ImageError::io("Writing the debugfs script for", out))?;
    }
    let output = child
        .wait_with_output()
        .map_err(ImageError::io("Running debugfs on", out))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("debugfs "))
        .collect();
    if !output.status.success() || !complaints.is_empty() {
        return Err(ImageError::Tool {
            tool: "debugfs",
            path: out.to_path_buf(),
            detail: format!("{}: {}", output.status, complaints.join("; ")),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn script_quotes_names_and_refuses_control_characters() {
        let special = |kind| Special {
            kind,
            mode: 0o4755,
            uid: 0,
            gid: 5,
            mtime: 7,
        };
        let mut m = BTreeMap::new();
        m.insert(PathBuf::from("bin/a \"b"), special(SpecialKind::File));
        m.insert(
            PathBuf::from("dev/null"),
            special(SpecialKind::Char { major: 1, minor: 3 }),
        );
        let script = specials_script(&m).unwrap();
        assert!(
            script.contains("sif \"/bin/a \"\"b\" mode 0104755\n"),
            "{script}"
        );
        assert!(
            script.contains("cd \"/dev\"\nrm \"null\"\nmknod \"null\" c 1 3\n"),
            "{script}"
        );
        assert!(script.contains("sif \"/dev/null\" mode 024755"), "{script}");
        m.insert(PathBuf::from("x\ny"), special(SpecialKind::File));
        assert_eq!(specials_script(&m), Err(PathBuf::from("x\ny")));
    }
}
