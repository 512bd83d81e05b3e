//! Applying OCI image layers, in order, onto a rootfs directory, treating every layer as
//! untrusted input.
//!
//! A layer is a tar stream, already decompressed. Entries are applied with OCI semantics:
//! regular files, directories, symlinks, hardlinks, device nodes and FIFOs keep their mode bits
//! (including setuid, setgid and sticky), owner and mtime; `.wh.NAME` removes `NAME` of lower
//! layers and `.wh..wh..opq` makes its directory opaque.
//!
//! Nothing from an image is made usable on the host: the staging directory never holds a
//! device node or a setuid/setgid file. A character or block device is staged as an empty
//! 0600 placeholder file, and a setuid/setgid file is staged without those bits; both are
//! recorded as [`Special`]s ([`Applier::specials`]) and applied only inside the finished ext4
//! image (see [`super::ext4`]). FIFOs are staged as FIFOs (they grant nothing).
//!
//! Nothing is ever written outside the rootfs: entry paths with a `..` component are rejected,
//! absolute entry paths are taken relative to the rootfs, and every path is resolved here one
//! component at a time with `lstat`, so an entry is never written *through* a symlink: a symlink
//! met on the way is followed inside the rootfs only: an absolute target is resolved from the
//! rootfs (as the guest will see it), and one that climbs above the rootfs fails the entry. A symlink's own target is data and may be anything.
//! Hardlink targets are resolved the same way and must already exist inside the rootfs.
//!
//! The code is blocking (plain `std::fs` calls); async callers run it in
//! `tokio::task::spawn_blocking`. The resolution assumes nobody else writes to the rootfs while
//! layers are applied. An error can leave the rootfs half-built (never anything outside it), so
//! the caller builds into a fresh temporary directory and discards it on error.

use std::collections::{BTreeMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::{Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use tar::EntryType;

/// Prefix of a whiteout entry's file name.
const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// Prefix of whiteout-metadata names (aufs); only the opaque marker means something to OCI.
const WHITEOUT_META_PREFIX: &[u8] = b".wh..wh.";
/// File name marking its directory as opaque.
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// Most symlinks followed while resolving one path, as Linux's `MAXSYMLINKS`.
const MAX_SYMLINKS: usize = 40;

/// The result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Bounds on what the layers of one image may write, so a hostile image cannot fill the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of regular-file data written, over all layers.
    pub max_bytes: u64,
    /// Most tar entries (whiteouts included), over all layers.
    pub max_entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_bytes: 32 << 30,
            max_entries: 1 << 20,
        }
    }
}

/// What kind of inode a [`Special`] becomes inside the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialKind {
    /// A regular file with setuid or setgid (staged without them).
    File,
    /// A character device (staged as an empty placeholder file).
    Char {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// A block device (staged as an empty placeholder file).
    Block {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
}

/// An inode the staging directory holds only in a harmless form, to be made real in the ext4
/// image: the full mode (permission bits with setuid/setgid/sticky), owner and mtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Special {
    /// What it becomes.
    pub kind: SpecialKind,
    /// Permission bits (`0o7777` mask) as the layer says.
    pub mode: u32,
    /// Owner as the layer says.
    pub uid: u32,
    /// Group as the layer says.
    pub gid: u32,
    /// Modification time (seconds since the epoch).
    pub mtime: i64,
}

/// Setuid and setgid: bits that never reach a file on the host.
const SET_ID_BITS: u32 = 0o6000;

/// Makes text that may carry names from an image safe for a terminal: control characters
/// (escape sequences, newlines) are shown escaped (`\u{1b}`, `\n`), everything else as is.
pub fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

/// An I/O error whose message (the tar crate puts entry names in it) is safe to print.
fn escaped(e: io::Error) -> io::Error {
    let text = e.to_string();
    if text.chars().any(char::is_control) {
        io::Error::new(e.kind(), escape_controls(&text))
    } else {
        e
    }
}

impl Limits {
    /// The limits for a VM whose disk holds `disk_bytes`: no image may unpack to more than
    /// fits on it, nor to more than the node-wide `cap` when one is set.
    pub fn for_disk(disk_bytes: u64, cap: Option<u64>) -> Self {
        Self {
            max_bytes: disk_bytes.min(cap.unwrap_or(u64::MAX)),
            ..Self::default()
        }
    }
}

/// Counts what layers would write from their tar headers alone, before anything is written,
/// so a layer over the [`Limits`] is refused after its headers are read, not after its files
/// are created.
#[derive(Debug, Default)]
pub struct Census {
    next_layer: usize,
    entries: u64,
    bytes: u64,
}

impl Census {
    /// Reads the next layer's headers (skipping file data) and adds them to the counts,
    /// failing as soon as a count passes its limit. Blocking.
    pub fn count(&mut self, digest: &str, layer: impl Read, limits: Limits) -> Result<()> {
        let index = self.next_layer;
        self.next_layer += 1;
        let locate = |entry: &str| Location {
            layer: index,
            digest: digest.to_owned(),
            entry: entry.to_owned(),
        };
        let mut archive = tar::Archive::new(layer);
        let mut last = String::new();
        let stream = |after: &str, source| Error::Stream {
            layer: index,
            digest: digest.to_owned(),
            after: after.to_owned(),
            source: escaped(source),
        };
        for entry in archive.entries().map_err(|e| stream("", e))? {
            let entry = entry.map_err(|e| stream(&last, e))?;
            let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            self.entries += 1;
            if self.entries > limits.max_entries {
                let limit = limits.max_entries;
                return Err(Error::TooManyEntries {
                    at: locate(&name),
                    limit,
                });
            }
            if matches!(
                entry.header().entry_type(),
                EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse
            ) {
                self.bytes = self.bytes.saturating_add(entry.size());
                if self.bytes > limits.max_bytes {
                    let limit = limits.max_bytes;
                    return Err(Error::TooManyBytes {
                        at: locate(&name),
                        limit,
                    });
                }
            }
            last = name;
        }
        Ok(())
    }
}

/// Names the entry an error is about: layer index (from 0, as in the manifest), digest, path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Index of the layer in the order applied, from 0.
    pub layer: usize,
    /// The layer's digest as the caller gave it, e.g. `sha256:ab…`.
    pub digest: String,
    /// The entry's path as written in the tar stream (lossily UTF-8).
    pub entry: String,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layer {} ({}): entry {:?}",
            self.layer, self.digest, self.entry
        )
    }
}

/// Why a layer could not be applied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The rootfs to apply onto cannot be inspected.
    #[error("inspecting the rootfs {path:?}")]
    Rootfs {
        /// The rootfs given.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// The rootfs to apply onto is not a directory.
    #[error("rootfs {path:?} is not a directory")]
    RootfsNotDirectory {
        /// The rootfs given.
        path: PathBuf,
    },
    /// The layer's tar stream is unreadable or malformed.
    #[error("layer {layer} ({digest}): entry after {after:?}: reading the tar stream")]
    Stream {
        /// Index of the layer.
        layer: usize,
        /// Digest of the layer.
        digest: String,
        /// Path of the last entry read well (empty at the start).
        after: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// An entry path (or hardlink target) has a `..` component.
    #[error("{at}: path has a `..` component")]
    ParentComponent {
        /// The entry.
        at: Location,
    },
    /// Resolving the path leaves the rootfs through a symlink.
    #[error("{at}: path escapes the rootfs")]
    Escapes {
        /// The entry.
        at: Location,
    },
    /// Resolving the path met too many symlinks.
    #[error("{at}: too many levels of symbolic links")]
    SymlinkLoop {
        /// The entry.
        at: Location,
    },
    /// A parent of the path exists and is not a directory.
    #[error("{at}: a parent is not a directory")]
    NotADirectory {
        /// The entry.
        at: Location,
    },
    /// A hardlink's target is not in the rootfs.
    #[error("{at}: hardlink target {target:?} does not exist")]
    HardlinkTargetMissing {
        /// The entry.
        at: Location,
        /// The target as written.
        target: String,
    },
    /// A hardlink's target is a directory.
    #[error("{at}: hardlink target {target:?} is a directory")]
    HardlinkToDirectory {
        /// The entry.
        at: Location,
        /// The target as written.
        target: String,
    },
    /// A symlink or hardlink entry has no link name.
    #[error("{at}: link has no target")]
    MissingLinkName {
        /// The entry.
        at: Location,
    },
    /// A whiteout names nothing (`.wh.`) or `.`/`..`.
    #[error("{at}: invalid whiteout")]
    InvalidWhiteout {
        /// The entry.
        at: Location,
    },
    /// The entry is of a type that cannot be applied.
    #[error("{at}: unsupported entry type {kind}")]
    Unsupported {
        /// The entry.
        at: Location,
        /// The tar type, as debug text.
        kind: String,
    },
    /// The layers write more file data than [`Limits::max_bytes`].
    #[error("{at}: layers exceed the limit of {limit} bytes")]
    TooManyBytes {
        /// The entry.
        at: Location,
        /// The limit.
        limit: u64,
    },
    /// The layers hold more entries than [`Limits::max_entries`].
    #[error("{at}: layers exceed the limit of {limit} entries")]
    TooManyEntries {
        /// The entry.
        at: Location,
        /// The limit.
        limit: u64,
    },
    /// A filesystem operation failed.
    #[error("{at}: {op}")]
    Io {
        /// The entry.
        at: Location,
        /// What was being done.
        op: &'static str,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
}

/// An entry's failure before it is located; [`Fail::at`] makes it an [`Error`].
#[derive(Debug)]
enum Fail {
    ParentComponent,
    Escapes,
    SymlinkLoop,
    NotADirectory,
    /// A component is missing while resolving without creating.
    Missing,
    HardlinkTargetMissing(String),
    HardlinkToDirectory(String),
    MissingLinkName,
    InvalidWhiteout,
    Unsupported(String),
    TooManyBytes(u64),
    Io(&'static str, io::Error),
}

impl Fail {
    fn at(self, at: Location) -> Error {
        match self {
            Self::ParentComponent => Error::ParentComponent { at },
            Self::Escapes => Error::Escapes { at },
            Self::SymlinkLoop => Error::SymlinkLoop { at },
            Self::NotADirectory => Error::NotADirectory { at },
            Self::Missing => Error::Io {
                at,
                op: "resolving the path",
                source: io::ErrorKind::NotFound.into(),
            },
            Self::HardlinkTargetMissing(target) => Error::HardlinkTargetMissing { at, target },
            Self::HardlinkToDirectory(target) => Error::HardlinkToDirectory { at, target },
            Self::MissingLinkName => Error::MissingLinkName { at },
            Self::InvalidWhiteout => Error::InvalidWhiteout { at },
            Self::Unsupported(kind) => Error::Unsupported { at, kind },
            Self::TooManyBytes(limit) => Error::TooManyBytes { at, limit },
            Self::Io(op, source) => Error::Io { at, op, source },
        }
    }
}

/// Shorthand to tag an `io::Error` with the operation that failed.
fn io(op: &'static str) -> impl FnOnce(io::Error) -> Fail {
    move |e| Fail::Io(op, escaped(e))
}

/// Applies layers in order onto one rootfs, keeping the [`Limits`] across layers.
#[derive(Debug)]
pub struct Applier {
    root: PathBuf,
    limits: Limits,
    next_layer: usize,
    bytes: u64,
    entries: u64,
    privileged: bool,
    /// Inodes to make real in the image, by resolved path relative to the root.
    specials: BTreeMap<PathBuf, Special>,
}

/// What one layer has written so far: the state whiteouts and directory mtimes need.
#[derive(Default)]
struct LayerState {
    /// Resolved paths (relative to the root) this layer created, with all their ancestors.
    touched: HashSet<PathBuf>,
    /// Directories whose mtime is set once the layer's entries are all written.
    dirs: Vec<(PathBuf, i64, String)>,
}

impl LayerState {
    fn touch(&mut self, rel: &Path) {
        for p in rel.ancestors() {
            if p.as_os_str().is_empty() || !self.touched.insert(p.to_path_buf()) {
                break;
            }
        }
    }
}

/// Applies `layers` (`(digest, decompressed tar stream)`, lowest first) onto `root`. Blocking.
pub fn apply_layers<R: Read>(
    root: &Path,
    layers: impl IntoIterator<Item = (String, R)>,
    limits: Limits,
) -> Result<()> {
    let mut applier = Applier::new(root, limits)?;
    for (digest, layer) in layers {
        applier.apply(&digest, layer)?;
    }
    Ok(())
}

impl Applier {
    /// Starts applying onto `root`, an existing directory (normally a fresh temporary one).
    pub fn new(root: impl Into<PathBuf>, limits: Limits) -> Result<Self> {
        let root = root.into();
        match fs::metadata(&root) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => return Err(Error::RootfsNotDirectory { path: root }),
            Err(source) => return Err(Error::Rootfs { path: root, source }),
        }
        Ok(Self {
            root,
            limits,
            next_layer: 0,
            bytes: 0,
            entries: 0,
            privileged: nix::unistd::geteuid().is_root(),
            specials: BTreeMap::new(),
        })
    }

    /// Bytes of file data written so far, over all layers.
    pub fn bytes_written(&self) -> u64 {
        self.bytes
    }

    /// Device nodes and setuid/setgid files staged in a harmless form, by path relative to
    /// the root: the ext4 image gets them real ([`super::ext4::apply_specials`]).
    pub fn specials(&self) -> &BTreeMap<PathBuf, Special> {
        &self.specials
    }

    /// Drops the records of `rel` and everything below it (it was removed or replaced).
    fn forget(&mut self, rel: &Path) {
        let below: Vec<PathBuf> = self
            .specials
            .range(rel.to_path_buf()..)
            .take_while(|(p, _)| p.starts_with(rel))
            .map(|(p, _)| p.clone())
            .collect();
        for p in below {
            self.specials.remove(&p);
        }
    }

    /// Applies the next layer, identified in errors by its index and `digest`. Blocking.
    pub fn apply(&mut self, digest: &str, layer: impl Read) -> Result<()> {
        let index = self.next_layer;
        self.next_layer += 1;
        let locate = |entry: &str| Location {
            layer: index,
            digest: digest.to_owned(),
            entry: entry.to_owned(),
        };
        let stream = |after: &str, source| Error::Stream {
            layer: index,
            digest: digest.to_owned(),
            after: after.to_owned(),
            source: escaped(source),
        };
        let mut state = LayerState::default();
        let mut archive = tar::Archive::new(layer);
        let mut last = String::new();
        for entry in archive.entries().map_err(|e| stream("", e))? {
            let mut entry = entry.map_err(|e| stream(&last, e))?;
            let raw = entry.path_bytes().into_owned();
            let name = String::from_utf8_lossy(&raw).into_owned();
            self.entries += 1;
            if self.entries > self.limits.max_entries {
                return Err(Error::TooManyEntries {
                    at: locate(&name),
                    limit: self.limits.max_entries,
                });
            }
            self.apply_entry(&mut state, &mut entry, &raw)
                .map_err(|f| f.at(locate(&name)))?;
            last = name;
        }
        // Children change their directory's mtime, so directories get theirs last, deepest first.
        for (path, mtime, name) in state.dirs.iter().rev() {
            set_mtime(path, *mtime)
                .map_err(|e| Fail::Io("setting the mtime", e).at(locate(name)))?;
        }
        Ok(())
    }

    /// Applies one entry: the root's own metadata, a whiteout, or an inode of one kind.
    fn apply_entry<R: Read>(
        &mut self,
        state: &mut LayerState,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
    ) -> Result<(), Fail> {
        let kind = entry.header().entry_type();
        let comps = components(raw)?;
        let Some((name, parents)) = comps.split_last() else {
            return self.apply_root(state, entry.header());
        };
        if let Some(whiteout) = Whiteout::of(name.as_bytes()) {
            return self.apply_whiteout(state, parents, whiteout);
        }

        let rel = self.resolve_dir(parents, true)?.join(name);
        let path = self.root.join(&rel);
        if !kind.is_dir() {
            // Whatever was at the path is replaced: its record goes with it.
            self.forget(&rel);
        }
        match kind {
            EntryType::Directory => self.apply_dir(state, entry.header(), &path, &rel, raw)?,
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                self.apply_file(entry, &path, &rel)?;
            }
            EntryType::Symlink => self.apply_symlink(entry, &path)?,
            EntryType::Link => self.apply_hardlink(entry, &path, &rel)?,
            EntryType::Char | EntryType::Block => {
                self.apply_device(kind, entry.header(), &path, &rel)?;
            }
            EntryType::Fifo => self.apply_fifo(entry.header(), &path)?,
            EntryType::XGlobalHeader
            | EntryType::XHeader
            | EntryType::GNULongName
            | EntryType::GNULongLink => return Ok(()),
            other => return Err(Fail::Unsupported(format!("{other:?}"))),
        }
        state.touch(&rel);
        Ok(())
    }

    /// The root itself (`./`): a directory entry gives it its metadata, nothing else does.
    fn apply_root(&mut self, state: &mut LayerState, header: &tar::Header) -> Result<(), Fail> {
        if !header.entry_type().is_dir() {
            return Err(Fail::NotADirectory);
        }
        let root = self.root.clone();
        self.set_owner_mode(&root, header)?;
        state.dirs.push((root, mtime(header)?, ".".into()));
        Ok(())
    }

    /// Applies a whiteout found among `parents`: nothing when they are missing (nothing below
    /// to white out), an opaque marker empties the directory of lower layers' entries, and a
    /// `.wh.NAME` removes `NAME` unless this layer wrote it.
    fn apply_whiteout(
        &mut self,
        state: &mut LayerState,
        parents: &[OsString],
        whiteout: Whiteout<'_>,
    ) -> Result<(), Fail> {
        let parent = match self.resolve_dir(parents, false) {
            Ok(parent) => parent,
            Err(Fail::Missing) => return Ok(()),
            Err(e) => return Err(e),
        };
        let hidden = match whiteout {
            Whiteout::Opaque => return self.make_opaque(state, &parent),
            Whiteout::Meta => return Ok(()),
            Whiteout::Invalid => return Err(Fail::InvalidWhiteout),
            Whiteout::Hide(hidden) => hidden,
        };
        let rel = parent.join(OsStr::from_bytes(hidden));
        // A whiteout hides lower layers only, never this layer's own entries.
        if !state.touched.contains(&rel) {
            remove_any(&self.root.join(&rel))?;
            self.forget(&rel);
        }
        Ok(())
    }

    /// Makes `path` a directory (replacing whatever else is there) with the entry's owner and
    /// mode; its mtime waits for the end of the layer.
    fn apply_dir(
        &mut self,
        state: &mut LayerState,
        header: &tar::Header,
        path: &Path,
        rel: &Path,
        raw: &[u8],
    ) -> Result<(), Fail> {
        match fs::symlink_metadata(path) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                remove_any(path)?;
                self.forget(rel);
                mkdir(path)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => mkdir(path)?,
            Err(e) => return Err(Fail::Io("inspecting the path", e)),
        }
        self.set_owner_mode(path, header)?;
        let name = String::from_utf8_lossy(raw).into_owned();
        state.dirs.push((path.to_path_buf(), mtime(header)?, name));
        Ok(())
    }

    /// Writes a regular file within the byte limit, never through a symlink, and records it
    /// as a [`Special`] when it carries setuid/setgid (which the staged file never does).
    fn apply_file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        path: &Path,
        rel: &Path,
    ) -> Result<(), Fail> {
        let size = entry.size();
        let limit = self.limits.max_bytes;
        if self.bytes.saturating_add(size) > limit {
            return Err(Fail::TooManyBytes(limit));
        }
        let (mode, owner, mtime) = (
            mode(entry.header())?,
            owner(entry.header())?,
            mtime(entry.header())?,
        );
        remove_any(path)?;
        let mut file = create_new_private(path).map_err(io("creating the file"))?;
        let remaining = limit - self.bytes;
        let copied = copy_sparse(&mut entry.take(remaining.saturating_add(1)), &mut file)
            .map_err(io("writing the file"))?;
        if copied > remaining {
            return Err(Fail::TooManyBytes(limit));
        }
        self.bytes += copied;
        let (uid, gid) = owner;
        if self.privileged {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
                .map_err(io("setting the owner"))?;
        }
        // Setuid/setgid never reach the host; the image gets them from the record.
        file.set_permissions(fs::Permissions::from_mode(mode & !SET_ID_BITS))
            .map_err(io("setting the mode"))?;
        file.set_modified(system_time(mtime))
            .map_err(io("setting the mtime"))?;
        if mode & SET_ID_BITS != 0 {
            let special = Special {
                kind: SpecialKind::File,
                mode,
                uid,
                gid,
                mtime,
            };
            self.specials.insert(rel.to_path_buf(), special);
        }
        Ok(())
    }

    /// Creates a symlink; its target is data and is never followed here.
    fn apply_symlink<R: Read>(&self, entry: &tar::Entry<'_, R>, path: &Path) -> Result<(), Fail> {
        let target = entry.link_name_bytes().ok_or(Fail::MissingLinkName)?;
        if target.is_empty() {
            return Err(Fail::MissingLinkName);
        }
        remove_any(path)?;
        std::os::unix::fs::symlink(OsStr::from_bytes(&target), path)
            .map_err(io("creating the symlink"))?;
        let header = entry.header();
        if self.privileged {
            let (uid, gid) = owner(header)?;
            std::os::unix::fs::lchown(path, Some(uid), Some(gid))
                .map_err(io("setting the owner"))?;
        }
        set_mtime(path, mtime(header)?).map_err(io("setting the mtime"))
    }

    /// Hardlinks to an existing non-directory inside the root (resolved like any path); the
    /// link shares its target's [`Special`] record.
    fn apply_hardlink<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        path: &Path,
        rel: &Path,
    ) -> Result<(), Fail> {
        let target = entry.link_name_bytes().ok_or(Fail::MissingLinkName)?;
        let shown = String::from_utf8_lossy(&target).into_owned();
        let target_comps = components(&target)?;
        let Some((target_name, target_parents)) = target_comps.split_last() else {
            return Err(Fail::HardlinkToDirectory(shown));
        };
        let target_rel = match self.resolve_dir(target_parents, false) {
            Ok(dir) => dir.join(target_name),
            Err(Fail::Missing) => return Err(Fail::HardlinkTargetMissing(shown)),
            Err(e) => return Err(e),
        };
        let target_path = self.root.join(&target_rel);
        match fs::symlink_metadata(&target_path) {
            Ok(md) if md.is_dir() => return Err(Fail::HardlinkToDirectory(shown)),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Fail::HardlinkTargetMissing(shown));
            }
            Err(e) => return Err(Fail::Io("inspecting the hardlink target", e)),
        }
        if target_rel != rel {
            remove_any(path)?;
            // linkat(2) without AT_SYMLINK_FOLLOW: a symlink target is linked itself.
            fs::hard_link(&target_path, path).map_err(io("creating the hardlink"))?;
            if let Some(special) = self.specials.get(&target_rel).copied() {
                self.specials.insert(rel.to_path_buf(), special);
            }
        }
        Ok(())
    }

    /// Stages a character or block device as an empty root-only placeholder and records it:
    /// the device itself exists only in the image.
    fn apply_device(
        &mut self,
        kind: EntryType,
        header: &tar::Header,
        path: &Path,
        rel: &Path,
    ) -> Result<(), Fail> {
        let (major, minor) = device_numbers(header)?;
        let kind = if kind == EntryType::Char {
            SpecialKind::Char { major, minor }
        } else {
            SpecialKind::Block { major, minor }
        };
        let (uid, gid) = owner(header)?;
        let (mode, mtime) = (mode(header)?, mtime(header)?);
        remove_any(path)?;
        create_new_private(path).map_err(io("creating the placeholder of a device node"))?;
        let special = Special {
            kind,
            mode,
            uid,
            gid,
            mtime,
        };
        self.specials.insert(rel.to_path_buf(), special);
        Ok(())
    }

    /// Creates a FIFO (it needs no device numbers: GNU tar leaves those fields NUL-filled).
    fn apply_fifo(&self, header: &tar::Header, path: &Path) -> Result<(), Fail> {
        remove_any(path)?;
        nix::sys::stat::mknod(path, SFlag::S_IFIFO, Mode::from_bits_truncate(0o600), 0)
            .map_err(|e| Fail::Io("creating the FIFO", e.into()))?;
        self.set_owner_mode(path, header)?;
        set_mtime(path, mtime(header)?).map_err(io("setting the mtime"))
    }

    /// Sets owner (when root) then mode (chown clears setuid) of a path that is no symlink.
    fn set_owner_mode(&self, path: &Path, header: &tar::Header) -> Result<(), Fail> {
        if self.privileged {
            let (uid, gid) = owner(header)?;
            std::os::unix::fs::lchown(path, Some(uid), Some(gid))
                .map_err(io("setting the owner"))?;
        }
        fs::set_permissions(
            path,
            fs::Permissions::from_mode(mode(header)? & !SET_ID_BITS),
        )
        .map_err(io("setting the mode"))
    }

    /// Resolves directory components below the root, one at a time with `lstat`, following
    /// symlinks only while they stay inside the root. Returns the symlink-free path relative to
    /// the root. With `create`, missing directories are made (mode 0755); without, a missing one
    /// is [`Fail::Missing`].
    fn resolve_dir(&self, comps: &[OsString], create: bool) -> Result<PathBuf, Fail> {
        let mut resolved = PathBuf::new();
        let mut pending: Vec<OsString> = comps.iter().rev().cloned().collect();
        let mut links = 0;
        while let Some(comp) = pending.pop() {
            match comp.as_bytes() {
                b"" | b"." => continue,
                b".." => {
                    // Only symlink targets get here; entry paths with `..` are rejected earlier.
                    if !resolved.pop() {
                        return Err(Fail::Escapes);
                    }
                    continue;
                }
                _ => {}
            }
            let path = self.root.join(&resolved).join(&comp);
            match fs::symlink_metadata(&path) {
                Ok(md) if md.file_type().is_symlink() => {
                    links += 1;
                    if links > MAX_SYMLINKS {
                        return Err(Fail::SymlinkLoop);
                    }
                    let target = fs::read_link(&path).map_err(io("reading a symlink"))?;
                    // An absolute target means the image's root, as it will inside the VM
                    // (Debian's /var/run -> /run): resolve it from the rootfs, never the host's.
                    if target.has_root() {
                        resolved = PathBuf::new();
                    }
                    pending.extend(
                        target
                            .as_os_str()
                            .as_bytes()
                            .split(|b| *b == b'/')
                            .rev()
                            .map(|c| OsStr::from_bytes(c).to_owned()),
                    );
                }
                Ok(md) if md.is_dir() => resolved.push(&comp),
                Ok(_) => return Err(Fail::NotADirectory),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if !create {
                        return Err(Fail::Missing);
                    }
                    mkdir(&path)?;
                    resolved.push(&comp);
                }
                Err(e) => return Err(Fail::Io("resolving the path", e)),
            }
        }
        Ok(resolved)
    }

    /// Removes everything below `dir` (relative, resolved) that this layer did not write.
    fn make_opaque(&mut self, state: &LayerState, dir: &Path) -> Result<(), Fail> {
        let mut stack = vec![dir.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let listing =
                fs::read_dir(self.root.join(&dir)).map_err(io("listing the directory"))?;
            for child in listing {
                let child = child.map_err(io("listing the directory"))?;
                let rel = dir.join(child.file_name());
                if !state.touched.contains(&rel) {
                    remove_any(&self.root.join(&rel))?;
                    self.forget(&rel);
                } else if child
                    .file_type()
                    .map_err(io("listing the directory"))?
                    .is_dir()
                {
                    stack.push(rel);
                }
            }
        }
        Ok(())
    }
}

/// What a `.wh.`-prefixed entry name asks for; a pure reading of the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Whiteout<'a> {
    /// `.wh..wh..opq`: the directory hides everything lower layers put in it.
    Opaque,
    /// Another `.wh..wh.` name (aufs metadata): ignored.
    Meta,
    /// `.wh.NAME`: `NAME` of lower layers is removed.
    Hide(&'a [u8]),
    /// `.wh.`, `.wh..` or `.wh...`: names nothing that could be removed.
    Invalid,
}

impl<'a> Whiteout<'a> {
    /// The whiteout a file name is, or `None` for an ordinary name.
    fn of(name: &'a [u8]) -> Option<Self> {
        let hidden = name.strip_prefix(WHITEOUT_PREFIX)?;
        Some(if name == OPAQUE_MARKER {
            Self::Opaque
        } else if name.starts_with(WHITEOUT_META_PREFIX) {
            Self::Meta
        } else if hidden.is_empty() || hidden == b"." || hidden == b".." {
            Self::Invalid
        } else {
            Self::Hide(hidden)
        })
    }
}

/// Creates a new, empty 0600 file at `path`, failing if anything (a symlink too) is there.
fn create_new_private(path: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// Splits an entry path into its components: empty and `.` dropped (so an absolute path is
/// taken relative to the root), `..` rejected.
fn components(raw: &[u8]) -> Result<Vec<OsString>, Fail> {
    let mut comps = Vec::new();
    for comp in raw.split(|b| *b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => return Err(Fail::ParentComponent),
            _ => comps.push(OsStr::from_bytes(comp).to_owned()),
        }
    }
    Ok(comps)
}

/// Removes whatever is at `path` without following a symlink there; a missing path is fine.
fn remove_any(path: &Path) -> Result<(), Fail> {
    match fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => fs::remove_dir_all(path).map_err(io("removing a directory")),
        Ok(_) => fs::remove_file(path).map_err(io("removing a file")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Fail::Io("inspecting the path", e)),
    }
}

fn mkdir(path: &Path) -> Result<(), Fail> {
    fs::DirBuilder::new()
        .mode(0o755)
        .create(path)
        .map_err(io("creating a directory"))
}

fn mode(header: &tar::Header) -> Result<u32, Fail> {
    Ok(header.mode().map_err(io("reading the header"))? & 0o7777)
}

/// A device's numbers; empty or NUL-filled fields (as GNU tar writes them) count as 0.
fn device_numbers(header: &tar::Header) -> Result<(u32, u32), Fail> {
    let fields = header
        .as_ustar()
        .map(|h| (h.dev_major, h.dev_minor))
        .or_else(|| header.as_gnu().map(|h| (h.dev_major, h.dev_minor)));
    let Some((major, minor)) = fields else {
        return Ok((0, 0));
    };
    let bad = |_| {
        Fail::Io(
            "reading the header",
            io::Error::new(io::ErrorKind::InvalidData, "device number is not octal"),
        )
    };
    Ok((
        octal_field(&major).map_err(bad)?,
        octal_field(&minor).map_err(bad)?,
    ))
}

/// An octal header field up to its first NUL, spaces trimmed; empty is 0.
fn octal_field(raw: &[u8]) -> Result<u32, std::num::ParseIntError> {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    let text = String::from_utf8_lossy(&raw[..end]);
    let text = text.trim_matches(' ');
    if text.is_empty() {
        return Ok(0);
    }
    u32::from_str_radix(text, 8)
}

/// Copies `src` into the new file `dst`, leaving blocks of zeros as holes; returns the length.
fn copy_sparse(src: &mut impl Read, dst: &mut fs::File) -> io::Result<u64> {
    let mut buf = vec![0u8; SPARSE_BLOCK];
    let mut len = 0u64;
    let mut hole = false;
    loop {
        let n = read_full(src, &mut buf)?;
        if n == 0 {
            break;
        }
        if is_zero(&buf[..n]) {
            dst.seek(SeekFrom::Current(n as i64))?;
            hole = true;
        } else {
            dst.write_all(&buf[..n])?;
            hole = false;
        }
        len += n as u64;
    }
    if hole {
        // A trailing hole needs the length set, or the file would end before it.
        dst.set_len(len)?;
    }
    Ok(len)
}

/// Size of the blocks [`copy_sparse`] looks at (a multiple of every filesystem block size).
const SPARSE_BLOCK: usize = 64 << 10;

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full(src: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match src.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn is_zero(buf: &[u8]) -> bool {
    buf.iter().all(|b| *b == 0)
}

fn owner(header: &tar::Header) -> Result<(u32, u32), Fail> {
    let id = |v: u64| {
        u32::try_from(v).map_err(|_| {
            Fail::Io(
                "reading the header",
                io::Error::new(io::ErrorKind::InvalidData, "uid or gid out of range"),
            )
        })
    };
    let uid = header.uid().map_err(io("reading the header"))?;
    let gid = header.gid().map_err(io("reading the header"))?;
    Ok((id(uid)?, id(gid)?))
}

fn mtime(header: &tar::Header) -> Result<i64, Fail> {
    let secs = header.mtime().map_err(io("reading the header"))?;
    Ok(i64::try_from(secs).unwrap_or(i64::MAX))
}

fn system_time(secs: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs.max(0).unsigned_abs())
}

/// Sets the mtime (and atime) of `path` itself, never of a symlink's target.
fn set_mtime(path: &Path, secs: i64) -> io::Result<()> {
    let t = TimeSpec::new(secs, 0);
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &t,
        &t,
        UtimensatFlags::NoFollowSymlink,
    )
    .map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn whiteout_names_are_read_without_touching_disk() {
        assert_eq!(Whiteout::of(b"etc"), None);
        assert_eq!(Whiteout::of(b".whx"), None);
        assert_eq!(Whiteout::of(b".wh..wh..opq"), Some(Whiteout::Opaque));
        assert_eq!(Whiteout::of(b".wh..wh.plnk.1"), Some(Whiteout::Meta));
        assert_eq!(Whiteout::of(b".wh.passwd"), Some(Whiteout::Hide(b"passwd")));
        for invalid in [&b".wh."[..], b".wh..", b".wh..."] {
            assert_eq!(
                Whiteout::of(invalid),
                Some(Whiteout::Invalid),
                "{invalid:?}"
            );
        }
    }

    /// A unique scratch dir holding `root/` and `outside/`, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "imp-layers-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(dir.join("root")).unwrap();
            fs::create_dir_all(dir.join("outside")).unwrap();
            Self(dir)
        }
        fn root(&self) -> PathBuf {
            self.0.join("root")
        }
        fn outside(&self) -> PathBuf {
            self.0.join("outside")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Builds a layer in memory; paths are written raw so hostile ones are possible.
    #[derive(Default)]
    struct Tar(Vec<Spec>);

    /// Type, path, data, mode and link name of one entry.
    type Spec = (EntryType, String, Vec<u8>, u32, Option<String>);

    impl Tar {
        fn file(mut self, path: &str, data: &[u8], mode: u32) -> Self {
            self.0
                .push((EntryType::Regular, path.into(), data.into(), mode, None));
            self
        }
        fn dir(mut self, path: &str, mode: u32) -> Self {
            self.0
                .push((EntryType::Directory, path.into(), vec![], mode, None));
            self
        }
        fn symlink(mut self, path: &str, target: &str) -> Self {
            self.0.push((
                EntryType::Symlink,
                path.into(),
                vec![],
                0o777,
                Some(target.into()),
            ));
            self
        }
        fn hardlink(mut self, path: &str, target: &str) -> Self {
            self.0.push((
                EntryType::Link,
                path.into(),
                vec![],
                0o644,
                Some(target.into()),
            ));
            self
        }
        fn build(self) -> Vec<u8> {
            let mut b = tar::Builder::new(Vec::new());
            for (kind, path, data, mode, link) in self.0 {
                let mut h = tar::Header::new_gnu();
                h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
                if let Some(link) = link {
                    h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
                }
                h.set_entry_type(kind);
                h.set_mode(mode);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(1_000_000);
                h.set_size(data.len() as u64);
                h.set_cksum();
                b.append(&h, data.as_slice()).unwrap();
            }
            b.into_inner().unwrap()
        }
    }

    fn apply(root: &Path, layers: Vec<Vec<u8>>, limits: Limits) -> Result<()> {
        apply_layers(
            root,
            layers
                .into_iter()
                .enumerate()
                .map(|(i, l)| (format!("sha256:{i:02}"), io::Cursor::new(l))),
            limits,
        )
    }

    fn apply_one(root: &Path, layer: Tar) -> Result<()> {
        apply(root, vec![layer.build()], Limits::default())
    }

    #[test]
    fn files_dirs_and_modes() {
        let s = Scratch::new();
        let layer = Tar::default()
            .dir("usr/", 0o755)
            .dir("tmp/", 0o1777)
            .file("usr/bin/su", b"su", 0o4755)
            .file("/etc/shadow", b"x", 0o640);
        let mut applier = Applier::new(s.root(), Limits::default()).unwrap();
        applier
            .apply("sha256:00", io::Cursor::new(layer.build()))
            .unwrap();
        let md = |p: &str| fs::symlink_metadata(s.root().join(p)).unwrap();
        // Staged without setuid; the record carries it to the image.
        assert_eq!(md("usr/bin/su").mode() & 0o7777, 0o755);
        assert_eq!(applier.specials()[Path::new("usr/bin/su")].mode, 0o4755);
        assert_eq!(md("tmp").mode() & 0o7777, 0o1777);
        assert_eq!(md("etc/shadow").mode() & 0o7777, 0o640);
        assert_eq!(md("usr/bin/su").mtime(), 1_000_000);
        assert_eq!(md("usr").mtime(), 1_000_000);
        assert_eq!(fs::read(s.root().join("usr/bin/su")).unwrap(), b"su");
    }

    #[test]
    fn later_layer_overwrites() {
        let s = Scratch::new();
        let lower = Tar::default().file("a", b"lower", 0o644).build();
        let upper = Tar::default().file("a", b"upper", 0o600).build();
        apply(&s.root(), vec![lower, upper], Limits::default()).unwrap();
        assert_eq!(fs::read(s.root().join("a")).unwrap(), b"upper");
    }

    #[test]
    fn whiteout_removes_lower_file() {
        let s = Scratch::new();
        let lower = Tar::default()
            .file("d/a", b"", 0o644)
            .file("d/b", b"", 0o644);
        let upper = Tar::default().file("d/.wh.a", b"", 0o644);
        apply(
            &s.root(),
            vec![lower.build(), upper.build()],
            Limits::default(),
        )
        .unwrap();
        assert!(!s.root().join("d/a").exists());
        assert!(s.root().join("d/b").exists());
        assert!(!s.root().join("d/.wh.a").exists());
    }

    #[test]
    fn opaque_dir_keeps_only_this_layer() {
        let s = Scratch::new();
        let lower = Tar::default()
            .file("d/old", b"", 0o644)
            .file("d/sub/old", b"", 0o644);
        let upper = Tar::default()
            .file("d/sub/new", b"", 0o644)
            .file("d/.wh..wh..opq", b"", 0o644)
            .file("d/new", b"", 0o644);
        apply(
            &s.root(),
            vec![lower.build(), upper.build()],
            Limits::default(),
        )
        .unwrap();
        assert!(!s.root().join("d/old").exists());
        assert!(!s.root().join("d/sub/old").exists());
        assert!(s.root().join("d/sub/new").exists());
        assert!(s.root().join("d/new").exists());
    }

    #[test]
    fn dotdot_rejected() {
        let s = Scratch::new();
        let err = apply_one(&s.root(), Tar::default().file("../../x", b"x", 0o644)).unwrap_err();
        assert!(matches!(err, Error::ParentComponent { .. }), "{err}");
        assert!(!s.0.join("x").exists());
    }

    #[test]
    fn absolute_path_stays_inside() {
        let s = Scratch::new();
        let abs = format!("{}/evil", s.outside().display());
        apply_one(&s.root(), Tar::default().file(&abs, b"x", 0o644)).unwrap();
        assert!(s.root().join(abs.trim_start_matches('/')).exists());
        assert_eq!(fs::read_dir(s.outside()).unwrap().count(), 0);
    }

    #[test]
    fn writing_through_symlinks_never_leaves_the_rootfs() {
        let s = Scratch::new();
        let outside = s.outside().display().to_string();
        let layer = Tar::default()
            .symlink("link", "../outside")
            .file("link/passwd", b"x", 0o644);
        let err = apply_one(&s.root(), layer).unwrap_err();
        assert!(matches!(err, Error::Escapes { .. }), "{err}");
        assert_eq!(fs::read_dir(s.outside()).unwrap().count(), 0);
        // Absolute targets name the image's root, so the write lands inside the rootfs.
        for target in [outside.as_str(), "/etc"] {
            let layer = Tar::default()
                .symlink("abs", target)
                .file("abs/passwd", b"x", 0o644);
            apply_one(&s.root(), layer).unwrap();
            let inside = s.root().join(target.trim_start_matches('/')).join("passwd");
            assert_eq!(fs::read(&inside).unwrap(), b"x", "{target}");
            assert_eq!(fs::read_dir(s.outside()).unwrap().count(), 0);
        }
        // From an earlier layer too.
        let lower = Tar::default().symlink("link2", "../outside").build();
        let upper = Tar::default().file("link2/passwd", b"x", 0o644).build();
        let err = apply(&s.root(), vec![lower, upper], Limits::default()).unwrap_err();
        assert!(matches!(err, Error::Escapes { .. }), "{err}");
        assert_eq!(fs::read_dir(s.outside()).unwrap().count(), 0);
    }

    #[test]
    fn symlink_chains_inside_followed_escaping_rejected() {
        let s = Scratch::new();
        let layer = Tar::default()
            .dir("real/", 0o755)
            .symlink("a", "b")
            .symlink("b", "sub/../real")
            .dir("sub/", 0o755)
            .file("a/f", b"ok", 0o644)
            .symlink("loop1", "loop2")
            .symlink("loop2", "loop1");
        apply_one(&s.root(), layer).unwrap();
        assert_eq!(fs::read(s.root().join("real/f")).unwrap(), b"ok");
        assert!(
            fs::symlink_metadata(s.root().join("a"))
                .unwrap()
                .is_symlink()
        );

        let layer = Tar::default()
            .symlink("x", "y")
            .symlink("y", "real/../../outside")
            .file("x/f", b"x", 0o644);
        let err = apply_one(&s.root(), layer).unwrap_err();
        assert!(matches!(err, Error::Escapes { .. }), "{err}");
        assert_eq!(fs::read_dir(s.outside()).unwrap().count(), 0);

        let err = apply_one(&s.root(), Tar::default().file("loop1/f", b"", 0o644)).unwrap_err();
        assert!(matches!(err, Error::SymlinkLoop { .. }), "{err}");
    }

    #[test]
    fn final_symlink_is_replaced_not_followed() {
        let s = Scratch::new();
        let outside = format!("{}/victim", s.outside().display());
        let layer = Tar::default().symlink("f", &outside).file("f", b"x", 0o644);
        apply_one(&s.root(), layer).unwrap();
        assert!(fs::symlink_metadata(s.root().join("f")).unwrap().is_file());
        assert_eq!(fs::read_dir(s.outside()).unwrap().count(), 0);
    }

    #[test]
    fn hardlink_escaping_rejected() {
        let s = Scratch::new();
        fs::write(s.outside().join("secret"), b"s").unwrap();
        let err =
            apply_one(&s.root(), Tar::default().hardlink("h", "../outside/secret")).unwrap_err();
        assert!(matches!(err, Error::ParentComponent { .. }), "{err}");
        let layer = Tar::default()
            .symlink("l", "../outside")
            .hardlink("h", "l/secret");
        let err = apply_one(&s.root(), layer).unwrap_err();
        assert!(matches!(err, Error::Escapes { .. }), "{err}");
        let abs = format!("{}/secret", s.outside().display());
        let err = apply_one(&s.root(), Tar::default().hardlink("h", &abs)).unwrap_err();
        assert!(matches!(err, Error::HardlinkTargetMissing { .. }), "{err}");
        assert!(!s.root().join("h").exists());
        assert_eq!(fs::metadata(s.outside().join("secret")).unwrap().nlink(), 1);
    }

    #[test]
    fn hardlink_inside_works() {
        let s = Scratch::new();
        let layer = Tar::default()
            .file("bin/a", b"same", 0o755)
            .hardlink("bin/b", "/bin/a");
        apply_one(&s.root(), layer).unwrap();
        let a = fs::metadata(s.root().join("bin/a")).unwrap();
        let b = fs::metadata(s.root().join("bin/b")).unwrap();
        assert_eq!(a.ino(), b.ino());
        assert_eq!(a.nlink(), 2);
    }

    #[test]
    fn size_limit_enforced() {
        let s = Scratch::new();
        let limits = Limits {
            max_bytes: 10,
            ..Limits::default()
        };
        let l1 = Tar::default().file("a", &[0; 6], 0o644).build();
        let l2 = Tar::default().file("b", &[0; 6], 0o644).build();
        let err = apply(&s.root(), vec![l1, l2], limits).unwrap_err();
        assert!(
            matches!(err, Error::TooManyBytes { limit: 10, .. }),
            "{err}"
        );
        assert!(!s.root().join("b").exists());
    }

    #[test]
    fn entry_limit_enforced() {
        let s = Scratch::new();
        let limits = Limits {
            max_entries: 2,
            ..Limits::default()
        };
        let layer = Tar::default()
            .dir("a/", 0o755)
            .dir("b/", 0o755)
            .dir("c/", 0o755);
        let err = apply(&s.root(), vec![layer.build()], limits).unwrap_err();
        assert!(
            matches!(err, Error::TooManyEntries { limit: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn error_names_layer_and_entry() {
        let s = Scratch::new();
        let ok = Tar::default().file("a", b"", 0o644).build();
        let bad = Tar::default().file("../../etc/passwd", b"", 0o644).build();
        let err = apply(&s.root(), vec![ok.clone(), ok, bad], Limits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"layer 2 (sha256:02): entry "../../etc/passwd": path has a `..` component"#
        );
        let layer = Tar::default()
            .symlink("l", "../../etc")
            .file("l/passwd", b"", 0o644);
        let err = apply_one(&s.root(), layer).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"layer 0 (sha256:00): entry "l/passwd": path escapes the rootfs"#
        );
    }

    /// A layer of raw headers (device numbers, odd names) and their data.
    fn raw_layer(entries: Vec<(tar::Header, Vec<u8>)>) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (mut h, data) in entries {
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data.as_slice()).unwrap();
        }
        b.into_inner().unwrap()
    }

    fn gnu_header(kind: EntryType, path: &[u8], mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..path.len()].copy_from_slice(path);
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_000_000);
        h
    }

    fn device(kind: EntryType, path: &str, mode: u32, major: u32, minor: u32) -> tar::Header {
        let mut h = gnu_header(kind, path.as_bytes(), mode);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        h
    }

    /// Every inode under `dir` that would be dangerous on the host: device nodes and
    /// setuid/setgid files.
    fn dangerous(dir: &Path) -> Vec<PathBuf> {
        use std::os::unix::fs::FileTypeExt;
        let mut found = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let md = fs::symlink_metadata(e.path()).unwrap();
                let ft = md.file_type();
                if ft.is_dir() {
                    stack.push(e.path());
                } else if ft.is_char_device()
                    || ft.is_block_device()
                    || (ft.is_file() && md.mode() & 0o6000 != 0)
                {
                    found.push(e.path());
                }
            }
        }
        found
    }

    #[test]
    fn devices_and_setuid_never_reach_the_staging_dir() {
        let s = Scratch::new();
        let mut applier = Applier::new(s.root(), Limits::default()).unwrap();
        let lower = raw_layer(vec![
            (
                gnu_header(EntryType::Regular, b"bin/id", 0o4755),
                b"id".to_vec(),
            ),
            (
                gnu_header(EntryType::Regular, b"bin/wall", 0o2755),
                b"w".to_vec(),
            ),
            (
                gnu_header(EntryType::Regular, b"bin/gone", 0o4711),
                b"g".to_vec(),
            ),
            (gnu_header(EntryType::Link, b"bin/id2", 0o644), vec![]),
            (device(EntryType::Block, "dev/sda", 0o666, 8, 0), vec![]),
            (device(EntryType::Char, "dev/null", 0o666, 1, 3), vec![]),
        ]);
        // The hardlink's target.
        let mut lower = lower;
        let link = 3 * 512 * 2; // fourth header: after three one-block files
        lower[link + 157..link + 163].copy_from_slice(b"bin/id");
        let mut h = tar::Header::from_byte_slice(&lower[link..link + 512]).clone();
        h.set_cksum();
        lower[link..link + 512].copy_from_slice(h.as_bytes());
        applier.apply("sha256:00", io::Cursor::new(lower)).unwrap();
        let upper = Tar::default().file("bin/.wh.gone", b"", 0o644).build();
        applier.apply("sha256:01", io::Cursor::new(upper)).unwrap();

        assert_eq!(dangerous(&s.root()), Vec::<PathBuf>::new());
        let md = |p: &str| fs::symlink_metadata(s.root().join(p)).unwrap();
        assert_eq!(md("bin/id").mode() & 0o7777, 0o755);
        assert_eq!(md("bin/wall").mode() & 0o7777, 0o755);
        assert!(md("dev/sda").is_file() && md("dev/sda").len() == 0);
        assert_eq!(md("dev/sda").mode() & 0o777, 0o600);

        let specials = applier.specials();
        let get = |p: &str| *specials.get(Path::new(p)).unwrap();
        assert_eq!(get("bin/id").mode, 0o4755);
        assert_eq!(get("bin/id").kind, SpecialKind::File);
        assert_eq!(get("bin/id2").mode, 0o4755, "a hardlink keeps the bits");
        assert_eq!(get("bin/wall").mode, 0o2755);
        assert_eq!(
            get("dev/sda").kind,
            SpecialKind::Block { major: 8, minor: 0 }
        );
        assert_eq!(
            get("dev/null").kind,
            SpecialKind::Char { major: 1, minor: 3 }
        );
        assert_eq!(get("dev/null").mode, 0o666);
        assert!(!specials.contains_key(Path::new("bin/gone")), "whited out");
        assert_eq!(specials.len(), 5);

        // Replacing a recorded path (or the directory above it) drops the record.
        let over = Tar::default()
            .file("bin/id", b"plain", 0o755)
            .file("dev", b"", 0o644);
        applier
            .apply("sha256:02", io::Cursor::new(over.build()))
            .unwrap();
        let left: Vec<_> = applier.specials().keys().cloned().collect();
        assert_eq!(
            left,
            vec![PathBuf::from("bin/id2"), PathBuf::from("bin/wall")]
        );
    }

    #[test]
    fn fifo_with_nul_device_fields_is_accepted() {
        use std::os::unix::fs::FileTypeExt;
        let s = Scratch::new();
        // GNU tar's default format leaves the device fields of a FIFO all NUL.
        let h = gnu_header(EntryType::Fifo, b"run/initctl", 0o600);
        assert!(h.as_gnu().unwrap().dev_major.iter().all(|b| *b == 0));
        apply(
            &s.root(),
            vec![raw_layer(vec![(h, vec![])])],
            Limits::default(),
        )
        .unwrap();
        let md = fs::symlink_metadata(s.root().join("run/initctl")).unwrap();
        assert!(md.file_type().is_fifo());
        assert_eq!(octal_field(b"\0\0\0\0\0\0\0\0"), Ok(0));
        assert_eq!(octal_field(b"0000010\0"), Ok(8));
        assert_eq!(octal_field(b"     7 \0"), Ok(7));
        assert!(octal_field(b"zz\0").is_err());
    }

    #[test]
    fn zeros_are_written_as_holes() {
        let s = Scratch::new();
        let mut data = vec![0u8; 8 << 20];
        data[4 << 20] = 1;
        let layer = Tar::default().file("zeros", &data, 0o644).build();
        apply(&s.root(), vec![layer], Limits::default()).unwrap();
        let md = fs::metadata(s.root().join("zeros")).unwrap();
        assert_eq!(md.len(), 8 << 20);
        assert!(md.blocks() * 512 <= 256 << 10, "{} blocks", md.blocks());
        assert_eq!(fs::read(s.root().join("zeros")).unwrap(), data);
    }

    #[test]
    fn names_with_control_characters_are_printed_escaped() {
        let s = Scratch::new();
        let name = b"\x1b]0;pwned\x07\x1b[2Jx";
        let mut h = gnu_header(EntryType::Regular, name, 0o644);
        // A mode field that is not a number: the tar crate's error names the entry.
        h.as_old_mut().mode = *b"zzzzzzz\0";
        let err = apply(
            &s.root(),
            vec![raw_layer(vec![(h, vec![])])],
            Limits::default(),
        )
        .unwrap_err();
        let mut chain = err.to_string();
        let mut cur = std::error::Error::source(&err);
        while let Some(e) = cur {
            chain.push_str(&e.to_string());
            cur = e.source();
        }
        assert!(!chain.chars().any(char::is_control), "{chain:?}");
        assert!(chain.starts_with("layer 0 (sha256:00): entry"), "{chain}");
        assert!(chain.contains(r"\u{1b}]0;pwned"), "{chain}");
        assert_eq!(escape_controls("a\nb\u{1b}c"), r"a\nb\u{1b}c");
    }
}
