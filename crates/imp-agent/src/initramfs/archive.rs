//! newc ("070701") cpio archives, the format the kernel unpacks as an initramfs.
//!
//! A VM's initramfs is two archives back to back: a [`BaseInitramfs`] (imp-guest as `/init`,
//! the kernel modules, device nodes) cached by the identity (path, size, mtime, inode) of what goes in it, and a small
//! per-VM archive holding `/.imp/config.json` ([`build_for_vm`]). The kernel unpacks both in
//! order, so only the few kilobytes of config are written per VM.

use std::io::Write;
use std::path::{Path, PathBuf};

use imp_proto::config::{CONFIG_PATH, GuestConfig};
use sha2::{Digest, Sha256};

use super::modules::{self, KernelError, Module};

/// Bumped whenever the base archive's layout changes, so old cache entries are not reused.
const FORMAT: &str = "imp-initramfs-v1";

/// Why an initramfs could not be built.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    /// A file could not be read or written.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The module set could not be worked out.
    #[error("Choosing the guest's kernel modules")]
    Modules(#[from] KernelError),
    /// The guest config is not valid.
    #[error("Encoding the guest config")]
    Config(#[from] imp_proto::config::ConfigError),
    /// An entry is larger than newc can describe (4 GiB).
    #[error("Initramfs entry {0} is larger than 4 GiB")]
    TooLarge(String),
    /// A blocking task died.
    #[error("Initramfs build task failed")]
    Join(#[from] tokio::task::JoinError),
}

/// An archive under construction.
#[derive(Debug, Default)]
pub struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    /// An empty archive.
    pub fn new() -> Self {
        Self {
            buf: Vec::new(),
            ino: 1,
        }
    }

    fn pad4(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        data: &[u8],
        rdev: (u32, u32),
    ) -> Result<(), InitramfsError> {
        let too_large = || InitramfsError::TooLarge(name.to_string());
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            u32::try_from(data.len()).map_err(|_| too_large())?,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            u32::try_from(name.len() + 1).map_err(|_| too_large())?,
            0, // check
        ];
        self.ino += 1;
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad4();
        self.buf.extend_from_slice(data);
        self.pad4();
        Ok(())
    }

    /// Adds a directory (0755).
    pub fn dir(&mut self, name: &str) -> Result<(), InitramfsError> {
        self.entry(name, 0o040755, &[], (0, 0))
    }

    /// Adds a regular file (its parent directories must have been added).
    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> Result<(), InitramfsError> {
        self.entry(name, 0o100000 | (mode & 0o7777), data, (0, 0))
    }

    /// Adds a symlink.
    pub fn symlink(&mut self, name: &str, target: &str) -> Result<(), InitramfsError> {
        self.entry(name, 0o120777, target.as_bytes(), (0, 0))
    }

    /// Adds a character device node.
    pub fn char_dev(
        &mut self,
        name: &str,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), InitramfsError> {
        self.entry(name, 0o020000 | (mode & 0o7777), &[], (major, minor))
    }

    /// Ends the archive (trailer, padded to 512-byte blocks as cpio writes it).
    pub fn finish(mut self) -> Result<Vec<u8>, InitramfsError> {
        self.entry("TRAILER!!!", 0, &[], (0, 0))?;
        while !self.buf.len().is_multiple_of(512) {
            self.buf.push(0);
        }
        Ok(self.buf)
    }
}

/// The cached part of every VM's initramfs: imp-guest as `/init` and the kernel modules.
#[derive(Debug, Clone)]
pub struct BaseInitramfs {
    path: PathBuf,
    modules: Vec<String>,
    cached: bool,
}

impl BaseInitramfs {
    /// Builds (or reuses from `cache_dir`) the base for `guest` and the modules `wanted` from
    /// `modules_dir`; the cache key covers each input file's path, size, mtime and inode.
    pub async fn cached(
        cache_dir: &Path,
        guest: &Path,
        modules_dir: &Path,
        wanted: &[&str],
    ) -> Result<Self, InitramfsError> {
        let (cache_dir, guest, modules_dir) = (
            cache_dir.to_path_buf(),
            guest.to_path_buf(),
            modules_dir.to_path_buf(),
        );
        let wanted: Vec<String> = wanted.iter().map(|s| s.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
            build_base(&cache_dir, &guest, &modules_dir, &wanted)
        })
        .await?
    }

    /// The archive file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The modules' paths inside the guest, in load order (for `GuestConfig::modules`).
    pub fn module_paths(&self) -> &[String] {
        &self.modules
    }

    /// Whether this call found the base in the cache.
    pub fn was_cached(&self) -> bool {
        self.cached
    }
}

fn read(path: &Path) -> Result<Vec<u8>, InitramfsError> {
    std::fs::read(path).map_err(|source| InitramfsError::Io {
        what: "Reading",
        path: path.to_path_buf(),
        source,
    })
}

/// What identifies a file's version without reading it: path, size, mtime and inode.
fn identity(path: &Path) -> Result<String, InitramfsError> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).map_err(|source| InitramfsError::Io {
        what: "Reading",
        path: path.to_path_buf(),
        source,
    })?;
    Ok(format!(
        "{}\0{}\0{}.{}\0{}\0",
        path.display(),
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.ino()
    ))
}

fn build_base(
    cache_dir: &Path,
    guest: &Path,
    modules_dir: &Path,
    wanted: &[&str],
) -> Result<BaseInitramfs, InitramfsError> {
    let modules: Vec<Module> = modules::load_order(modules_dir, wanted)?;
    // The key covers each input's path, size, mtime and inode: a rebuilt guest or kernel gets
    // a new base, and a lookup reads no file contents (imp run pays it on every start).
    let mut hash = Sha256::new();
    hash.update(FORMAT.as_bytes());
    hash.update(identity(guest)?.as_bytes());
    for m in &modules {
        hash.update(m.guest_path.as_bytes());
        hash.update(identity(&m.host_path)?.as_bytes());
    }
    let key = format!("{:x}", hash.finalize());
    let path = cache_dir.join(format!("base-{}.cpio", &key[..32]));
    let module_paths = modules.iter().map(|m| m.guest_path.clone()).collect();
    if path.is_file() {
        return Ok(BaseInitramfs {
            path,
            modules: module_paths,
            cached: true,
        });
    }
    let guest_bytes = read(guest)?;
    let mut contents = Vec::with_capacity(modules.len());
    for m in &modules {
        contents.push((m.guest_path.clone(), read(&m.host_path)?));
    }
    let mut c = Cpio::new();
    for d in [
        "dev",
        "proc",
        "sys",
        "run",
        "tmp",
        "etc",
        ".imp",
        "lib",
        "lib/modules",
    ] {
        c.dir(d)?;
    }
    c.char_dev("dev/console", 0o600, 5, 1)?;
    c.char_dev("dev/null", 0o666, 1, 3)?;
    c.file("init", 0o755, &guest_bytes)?;
    let mut made = std::collections::BTreeSet::new();
    for (guest_path, bytes) in &contents {
        let rel = guest_path.trim_start_matches('/');
        let mut parent = String::new();
        for part in rel
            .split('/')
            .collect::<Vec<_>>()
            .iter()
            .rev()
            .skip(1)
            .rev()
        {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(part);
            if parent != "lib" && parent != "lib/modules" && made.insert(parent.clone()) {
                c.dir(&parent)?;
            }
        }
        c.file(rel, 0o644, bytes)?;
    }
    write_atomically(&path, &c.finish()?)?;
    tracing::info!(path = %path.display(), modules = modules.len(), "guest initramfs built");
    Ok(BaseInitramfs {
        path,
        modules: module_paths,
        cached: false,
    })
}

/// Writes `base` followed by an archive holding `config` to `dest` (atomically); a config
/// without `modules` gets the base's modules in load order.
pub async fn build_for_vm(
    base: &BaseInitramfs,
    config: &GuestConfig,
    dest: &Path,
) -> Result<(), InitramfsError> {
    let json = if config.modules.is_empty() {
        let mut with_modules = config.clone();
        with_modules.modules = base.modules.clone();
        with_modules.to_json()?
    } else {
        config.to_json()?
    };
    let (base_path, dest) = (base.path.clone(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let mut bytes = read(&base_path)?;
        bytes.extend_from_slice(&config_archive(&json)?);
        write_atomically(&dest, &bytes)
    })
    .await?
}

/// The per-VM archive: `/.imp/config.json`.
pub fn config_archive(json: &[u8]) -> Result<Vec<u8>, InitramfsError> {
    let mut c = Cpio::new();
    c.dir(".imp")?;
    c.file(CONFIG_PATH.trim_start_matches('/'), 0o644, json)?;
    c.finish()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), InitramfsError> {
    let io = |what: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| InitramfsError::Io {
            what,
            path: p,
            source,
        }
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io("Creating", dir))?;
    }
    // Unique per call: two builders of the same base (threads or processes) must not share it.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp-{}-{seq}", std::process::id()));
    // Owner-only from its creation: a VM's initramfs holds its config, environment included.
    let mut f = {
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io("Creating", &tmp))?
    };
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io("Writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("Renaming into place", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits a newc archive into (name, mode, data) entries, as the kernel reads it.
    fn parse(mut b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let hex =
            |s: &[u8]| u32::from_str_radix(std::str::from_utf8(s).unwrap(), 16).unwrap() as usize;
        loop {
            while b.first() == Some(&0) {
                b = &b[1..];
            }
            if b.is_empty() {
                return out;
            }
            assert_eq!(&b[..6], b"070701");
            let mode = hex(&b[14..22]) as u32;
            let size = hex(&b[54..62]);
            let namesize = hex(&b[94..102]);
            let name = String::from_utf8(b[110..110 + namesize - 1].to_vec()).unwrap();
            let data_start = (110 + namesize).div_ceil(4) * 4;
            let data = b[data_start..data_start + size].to_vec();
            b = &b[(data_start + size).div_ceil(4) * 4..];
            if name != "TRAILER!!!" {
                out.push((name, mode, data));
            }
        }
    }

    #[test]
    fn archives_concatenate_and_hold_what_was_written() {
        let mut c = Cpio::new();
        c.dir("bin").unwrap();
        c.file("bin/x", 0o755, b"hello").unwrap();
        c.symlink("bin/y", "x").unwrap();
        let mut bytes = c.finish().unwrap();
        assert_eq!(bytes.len() % 512, 0);
        bytes.extend_from_slice(&config_archive(b"{}").unwrap());
        let entries = parse(&bytes);
        let names: Vec<_> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["bin", "bin/x", "bin/y", ".imp", ".imp/config.json"]);
        assert_eq!(entries[1].1, 0o100755);
        assert_eq!(entries[1].2, b"hello");
        assert_eq!(entries[2].2, b"x");
        assert_eq!(entries[4].2, b"{}");
    }

    #[tokio::test]
    async fn the_base_is_cached_by_file_identity_and_the_vm_part_carries_the_config() {
        let dir = std::env::temp_dir().join(format!("imp-initramfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let modules = dir.join("modules");
        std::fs::create_dir_all(modules.join("kernel/drivers")).unwrap();
        std::fs::write(modules.join("kernel/drivers/a.ko"), b"\0depends=\0").unwrap();
        let guest = dir.join("guest");
        std::fs::write(&guest, b"#!guest").unwrap();
        let cache = dir.join("cache");
        let first = BaseInitramfs::cached(&cache, &guest, &modules, &["a"])
            .await
            .unwrap();
        assert!(!first.was_cached());
        assert_eq!(first.module_paths(), ["/lib/modules/kernel/drivers/a.ko"]);
        let again = BaseInitramfs::cached(&cache, &guest, &modules, &["a"])
            .await
            .unwrap();
        assert!(again.was_cached());
        assert_eq!(again.path(), first.path());
        std::fs::write(&guest, b"#!guest v2").unwrap();
        let changed = BaseInitramfs::cached(&cache, &guest, &modules, &["a"])
            .await
            .unwrap();
        assert!(!changed.was_cached());
        assert_ne!(changed.path(), first.path());

        let config = GuestConfig {
            hostname: Some("vm1".into()),
            ..GuestConfig::default()
        };
        let dest = dir.join("vm1.cpio");
        build_for_vm(&changed, &config, &dest).await.unwrap();
        // It carries the VM's environment (Secrets): owner-only from its creation.
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&dest).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the VM's initramfs");
        let entries = parse(&std::fs::read(&dest).unwrap());
        let find = |n: &str| {
            entries
                .iter()
                .find(|e| e.0 == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        assert_eq!(find("init").2, b"#!guest v2");
        assert_eq!(find("dev/console").1, 0o020600);
        assert!(entries.iter().any(|e| e.0 == "lib/modules/kernel/drivers"));
        let parsed = GuestConfig::from_json(&find(".imp/config.json").2).unwrap();
        assert_eq!(parsed.hostname.as_deref(), Some("vm1"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
