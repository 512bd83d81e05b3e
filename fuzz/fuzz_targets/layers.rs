//! Layer application with hostile tar streams: entries of every type, whiteouts, opaque
//! markers, symlinks and hardlinks whose names and targets climb, loop or point at absolute
//! paths. Either raw bytes are applied as tar layers, or layers are built from structured
//! entries (so the checksums are right and the fuzzer reaches the interesting cases). After
//! each run nothing outside the rootfs may have changed: a sibling directory and its canary
//! file must be exactly as before.
#![no_main]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use imp_image::layers::{Applier, Limits};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    /// Raw bytes, each a decompressed layer.
    Raw(Vec<Vec<u8>>),
    /// Layers of entries built into valid tar streams.
    Built(Vec<Vec<Entry>>),
}

#[derive(Arbitrary, Debug)]
struct Entry {
    kind: Kind,
    absolute: bool,
    path: Vec<Name>,
    link: Vec<Name>,
    link_absolute: bool,
    mode: u16,
    owner: u8,
    data: Vec<u8>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Kind {
    File,
    Dir,
    Symlink,
    Hardlink,
    Fifo,
    Char,
    Block,
    Other(u8),
}

/// Path components, from a small pool so entries meet each other.
#[derive(Arbitrary, Debug)]
enum Name {
    A,
    B,
    C,
    Dot,
    DotDot,
    Empty,
    Whiteout(Box<Name>),
    Opaque,
    Outside,
    Canary,
    Raw(Vec<u8>),
}

impl Name {
    fn push(&self, out: &mut Vec<u8>) {
        match self {
            Name::A => out.extend_from_slice(b"a"),
            Name::B => out.extend_from_slice(b"b"),
            Name::C => out.extend_from_slice(b"c"),
            Name::Dot => out.push(b'.'),
            Name::DotDot => out.extend_from_slice(b".."),
            Name::Empty => {}
            Name::Whiteout(inner) => {
                out.extend_from_slice(b".wh.");
                inner.push(out);
            }
            Name::Opaque => out.extend_from_slice(b".wh..wh..opq"),
            Name::Outside => out.extend_from_slice(b"outside"),
            Name::Canary => out.extend_from_slice(b"canary"),
            Name::Raw(bytes) => out.extend(bytes.iter().filter(|&&b| b != b'/' && b != 0)),
        }
    }
}

fn join(absolute: bool, names: &[Name]) -> Vec<u8> {
    let mut out = Vec::new();
    if absolute {
        out.push(b'/');
    }
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        n.push(&mut out);
    }
    out
}

fn build(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        let kind = match e.kind {
            Kind::File => tar::EntryType::Regular,
            Kind::Dir => tar::EntryType::Directory,
            Kind::Symlink => tar::EntryType::Symlink,
            Kind::Hardlink => tar::EntryType::Link,
            Kind::Fifo => tar::EntryType::Fifo,
            Kind::Char => tar::EntryType::Char,
            Kind::Block => tar::EntryType::Block,
            Kind::Other(b) => tar::EntryType::new(b),
        };
        h.set_entry_type(kind);
        h.set_mode(u32::from(e.mode) & 0o7777);
        h.set_uid(u64::from(e.owner));
        h.set_gid(u64::from(e.owner));
        h.set_mtime(1_700_000_000);
        // A null device (1:3) at most: the fuzzer never needs a node that reaches real hardware.
        if matches!(e.kind, Kind::Char | Kind::Block) {
            let _ = h.set_device_major(1);
            let _ = h.set_device_minor(3);
        }
        let data: &[u8] = if matches!(e.kind, Kind::File | Kind::Other(_)) {
            &e.data
        } else {
            &[]
        };
        h.set_size(data.len() as u64);
        if let Some(gnu) = h.as_gnu_mut() {
            let path = join(e.absolute, &e.path);
            let n = path.len().min(gnu.name.len());
            gnu.name[..n].copy_from_slice(&path[..n]);
            let link = join(e.link_absolute, &e.link);
            let n = link.len().min(gnu.linkname.len());
            gnu.linkname[..n].copy_from_slice(&link[..n]);
        }
        h.set_cksum();
        if builder.append(&h, data).is_err() {
            break;
        }
    }
    builder.into_inner().unwrap_or_default()
}

static RUN: AtomicU64 = AtomicU64::new(0);

fn scratch() -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "imp-fuzz-layers-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ))
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fuzz_target!(|input: Input| {
    let layers: Vec<Vec<u8>> = match &input {
        Input::Raw(raw) => raw.clone(),
        Input::Built(layers) => layers.iter().map(|l| build(l)).collect(),
    };
    let work = scratch();
    let root = work.join("root");
    let outside = work.join("outside");
    fs::create_dir_all(&root).expect("making the scratch rootfs");
    fs::create_dir_all(&outside).expect("making the scratch outside directory");
    fs::write(outside.join("canary"), b"canary").expect("writing the canary");

    let limits = Limits {
        max_bytes: 1 << 20,
        max_entries: 256,
    };
    let applied = Applier::new(&root, limits).and_then(|mut applier| {
        for (i, layer) in layers.iter().enumerate() {
            applier.apply(&format!("sha256:{i:064}"), &layer[..])?;
        }
        Ok(())
    });
    if let Err(e) = &applied {
        let mut text = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            text.push_str(&s.to_string());
            source = s.source();
        }
        assert!(!text.is_empty());
    }

    assert_eq!(
        listing(&work),
        ["outside", "root"],
        "something was written beside the rootfs"
    );
    assert_eq!(
        listing(&outside),
        ["canary"],
        "the outside directory changed"
    );
    let canary = fs::symlink_metadata(outside.join("canary")).expect("the canary is there");
    assert!(canary.file_type().is_file(), "the canary was replaced");
    assert_eq!(
        fs::read(outside.join("canary")).ok().as_deref(),
        Some(&b"canary"[..])
    );
    remove_tree(&work);
});

/// Removes the scratch directory, making read-only directories writable as it goes.
fn remove_tree(dir: &Path) {
    if fs::remove_dir_all(dir).is_ok() {
        return;
    }
    for entry in walk(dir) {
        use std::os::unix::fs::PermissionsExt;
        let _ = fs::set_permissions(&entry, fs::Permissions::from_mode(0o700));
    }
    let _ = fs::remove_dir_all(dir);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        let here = out[i].clone();
        if fs::symlink_metadata(&here).is_ok_and(|m| m.is_dir())
            && let Ok(rd) = fs::read_dir(&here)
        {
            out.extend(rd.filter_map(Result::ok).map(|e| e.path()));
        }
        i += 1;
    }
    out
}
