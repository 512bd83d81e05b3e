//! Kernel modules a VM needs, in load order, from a kernel's modules directory.
//!
//! Debian's cloud kernel builds the virtio transport, block, net and vsock drivers as modules
//! and its package has no `modules.dep`, so the order comes from each module's own
//! `depends=` entry in its `.modinfo` section. A module named in `modules.builtin` needs no
//! file. Compressed modules (`.ko.xz`, `.ko.zst`, `.ko.gz`) are found too and loaded by the
//! guest with the kernel's in-kernel decompression; their dependencies cannot be read from
//! the compressed bytes, so they must be listed explicitly.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The modules every imp VM loads: the MMIO transport, the root disk, the NIC, vsock
/// (Firecracker), virtio-serial (QEMU's guest channel, the `imp.mux` port) and the TCP socket
/// diagnostics with which a clone destroys the connections it carried over from its source
/// (`tcp_diag`, with `inet_diag`; the guest has no modprobe to load them on demand).
pub const VM_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "vmw_vsock_virtio_transport",
    "virtio_console",
    "tcp_diag",
];

/// Why the module set could not be worked out.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The modules directory could not be read.
    #[error("Reading kernel modules under {dir}")]
    Read {
        /// The directory (or file) being read.
        dir: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A module is neither a file nor built in.
    #[error("Kernel module {name} (needed by {needed_by}) is not under {dir} and not built in")]
    Missing {
        /// The module's name.
        name: String,
        /// Who needs it (`imp` for the top-level set).
        needed_by: String,
        /// The modules directory.
        dir: PathBuf,
    },
    /// The dependencies loop.
    #[error("Kernel module dependencies form a cycle through {0}")]
    Cycle(String),
}

/// One module to load: where it is on the host and where the guest will find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The module's name (`virtio_blk`).
    pub name: String,
    /// The file on the host.
    pub host_path: PathBuf,
    /// Its path inside the guest (`/lib/modules/kernel/drivers/block/virtio_blk.ko`).
    pub guest_path: String,
}

/// The files of `wanted` and everything they depend on, dependencies first.
pub fn load_order(modules_dir: &Path, wanted: &[&str]) -> Result<Vec<Module>, KernelError> {
    let index = index(modules_dir)?;
    let builtin = builtin(modules_dir);
    let mut order = Vec::new();
    let mut done = BTreeSet::new();
    for name in wanted {
        visit(
            &normalize(name),
            "imp",
            modules_dir,
            &index,
            &builtin,
            &mut done,
            &mut BTreeSet::new(),
            &mut order,
        )?;
    }
    Ok(order)
}

#[allow(clippy::too_many_arguments)]
fn visit(
    name: &str,
    needed_by: &str,
    dir: &Path,
    index: &BTreeMap<String, PathBuf>,
    builtin: &BTreeSet<String>,
    done: &mut BTreeSet<String>,
    path: &mut BTreeSet<String>,
    order: &mut Vec<Module>,
) -> Result<(), KernelError> {
    if done.contains(name) {
        return Ok(());
    }
    if !path.insert(name.to_string()) {
        return Err(KernelError::Cycle(name.to_string()));
    }
    match index.get(name) {
        None if builtin.contains(name) => {}
        None => {
            return Err(KernelError::Missing {
                name: name.to_string(),
                needed_by: needed_by.to_string(),
                dir: dir.to_path_buf(),
            });
        }
        Some(file) => {
            for dep in depends(file)? {
                visit(&dep, name, dir, index, builtin, done, path, order)?;
            }
            let rel = file.strip_prefix(dir).unwrap_or(file);
            order.push(Module {
                name: name.to_string(),
                host_path: file.clone(),
                guest_path: format!("/lib/modules/{}", rel.display()),
            });
        }
    }
    path.remove(name);
    done.insert(name.to_string());
    Ok(())
}

/// Module names use `_` and `-` interchangeably; the kernel's canonical form is `_`.
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// Every module file under `dir`, by name.
fn index(dir: &Path) -> Result<BTreeMap<String, PathBuf>, KernelError> {
    let mut found = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|source| KernelError::Read {
            dir: d.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                stack.push(path);
                continue;
            }
            let file = entry.file_name().to_string_lossy().into_owned();
            let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
                .iter()
                .find_map(|ext| file.strip_suffix(ext));
            if let Some(stem) = stem {
                found.entry(normalize(stem)).or_insert(path);
            }
        }
    }
    Ok(found)
}

/// Names in `modules.builtin` (`kernel/…/name.ko` per line), which need no file.
fn builtin(dir: &Path) -> BTreeSet<String> {
    std::fs::read_to_string(dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .filter_map(|f| f.strip_suffix(".ko"))
        .map(normalize)
        .collect()
}

/// The `depends=` list of an uncompressed module (empty for compressed ones).
fn depends(file: &Path) -> Result<Vec<String>, KernelError> {
    let name = file.to_string_lossy();
    if !name.ends_with(".ko") {
        return Ok(Vec::new());
    }
    let bytes = std::fs::read(file).map_err(|source| KernelError::Read {
        dir: file.to_path_buf(),
        source,
    })?;
    Ok(modinfo_depends(&bytes))
}

/// Finds `depends=a,b` among the NUL-separated `key=value` strings of `.modinfo`.
fn modinfo_depends(bytes: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(start) = bytes.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let value = &bytes[start + KEY.len()..];
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end])
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(normalize)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_module(dir: &Path, rel: &str, depends: &str) {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut bytes = b"\x7fELF junk\0license=GPL\0".to_vec();
        bytes.extend_from_slice(format!("depends={depends}\0name=x\0").as_bytes());
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn dependencies_come_first_once_and_builtins_need_no_file() {
        let dir = std::env::temp_dir().join(format!("imp-kmod-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        fake_module(&dir, "kernel/drivers/virtio/virtio_ring.ko", "");
        fake_module(&dir, "kernel/drivers/virtio/virtio.ko", "virtio_ring");
        fake_module(
            &dir,
            "kernel/drivers/virtio/virtio_mmio.ko",
            "virtio,virtio_ring",
        );
        fake_module(
            &dir,
            "kernel/drivers/block/virtio_blk.ko",
            "virtio,virtio-ring",
        );
        fake_module(&dir, "kernel/net/x.ko", "crc_builtin");
        std::fs::write(dir.join("modules.builtin"), "kernel/lib/crc_builtin.ko\n").unwrap();
        let order = load_order(&dir, &["virtio_mmio", "virtio_blk", "x"]).unwrap();
        let names: Vec<_> = order.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            ["virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "x"]
        );
        assert_eq!(
            order[3].guest_path,
            "/lib/modules/kernel/drivers/block/virtio_blk.ko"
        );
        let err = load_order(&dir, &["nope"]).unwrap_err().to_string();
        assert!(
            err.contains("nope") && err.contains("not built in"),
            "{err}"
        );
        fake_module(&dir, "kernel/a.ko", "b");
        fake_module(&dir, "kernel/b.ko", "a");
        assert!(matches!(
            load_order(&dir, &["a"]),
            Err(KernelError::Cycle(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
