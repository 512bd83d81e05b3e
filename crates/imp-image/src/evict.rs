//! Keeping the image cache within a byte budget: the least recently used cached bases and
//! blobs go first, never one a VM on the node uses.
//!
//! The cache's entries are the bases (`rootfs/<key>.ext4`) and the blobs
//! (`blobs/sha256/<hex>`); temporaries (`.…tmp`) are never entries. An entry's "last used" is
//! its mtime: a base is touched each time a VM's disk is cloned from it, a blob each time a pull
//! needs it ([`super::store::touch`]); atime is not used (relatime makes it unreliable). An
//! entry is in use when a VM record of the node names the image it belongs to: the base keyed
//! by the record's manifest digest, and that manifest's own blob, config and layers. An entry used within the
//! grace period also stays: a VM whose record does not name its digest yet may be between its
//! pull and its disk clone.
//!
//! [`choose`] decides (a pure function of the entries); [`ImageStore::evict`] scans, decides and
//! removes, each file renamed into `tmp/` under a temporary name first and deleted there, so a
//! reader never sees a half-removed entry and an eviction killed half-way leaves only what
//! [`ImageStore::remove_stale`] removes.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::blobs::{temp_owner, temp_path};
use super::manifest::{Digest, Document};
use super::store::{ImageStore, Pruned};
use super::{ImageError, Result, blocking};

/// How long after its last use an entry is kept whatever the budget.
pub const GRACE: Duration = Duration::from_secs(15 * 60);

/// One cached base or blob, as [`choose`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// The file.
    pub path: PathBuf,
    /// Bytes it holds on disk (allocated blocks).
    pub size: u64,
    /// When it was last used (its mtime).
    pub last_used: SystemTime,
    /// A VM record of the node names its image.
    pub in_use: bool,
}

/// The entries to remove so the cache holds at most `budget` bytes: the least recently used
/// first (ties by path), never one in use or used within `grace` of `now`, stopping as soon as
/// the rest fits. When the entries that must stay exceed the budget alone, every other one is
/// chosen and the cache stays over budget.
pub fn choose(
    entries: &[CacheEntry],
    budget: u64,
    now: SystemTime,
    grace: Duration,
) -> Vec<&CacheEntry> {
    let mut total: u64 = entries.iter().map(|e| e.size).sum();
    if total <= budget {
        return Vec::new();
    }
    let recent = |e: &CacheEntry| {
        now.duration_since(e.last_used)
            .map_or(true, |age| age < grace)
    };
    let mut candidates: Vec<&CacheEntry> =
        entries.iter().filter(|e| !e.in_use && !recent(e)).collect();
    candidates.sort_by(|a, b| {
        a.last_used
            .cmp(&b.last_used)
            .then_with(|| a.path.cmp(&b.path))
    });
    let mut doomed = Vec::new();
    for e in candidates {
        if total <= budget {
            break;
        }
        total = total.saturating_sub(e.size);
        doomed.push(e);
    }
    doomed
}

/// What an eviction did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Entries removed and the bytes they held.
    pub removed: Pruned,
    /// Bytes the cache still holds.
    pub remaining: u64,
}

impl ImageStore {
    /// Brings the cache within `budget` bytes: scans its bases and blobs, [`choose`]s with
    /// [`GRACE`], and removes the chosen ones (renamed into `tmp/`, then deleted). `in_use`
    /// holds the images the node's VM records name, each as its chain of manifest digests
    /// (`sha256:…`): the VM's image, then the images of its extra layers, lowest first. The
    /// base of each chain and the blobs of every image in it stay. An entry another process
    /// removed meanwhile is skipped.
    pub async fn evict(&self, budget: u64, in_use: BTreeSet<Vec<String>>) -> Result<Evicted> {
        let root = self.root().to_path_buf();
        let evicted = blocking(move || {
            let keep = kept_paths(&root, &in_use);
            let entries = scan(&root, &keep)?;
            let doomed = choose(&entries, budget, SystemTime::now(), GRACE);
            let mut evicted = Evicted {
                remaining: entries.iter().map(|e| e.size).sum(),
                ..Evicted::default()
            };
            if doomed.is_empty() {
                return Ok(evicted);
            }
            let tmp = root.join("tmp");
            std::fs::create_dir_all(&tmp).map_err(ImageError::io("Creating directory", &tmp))?;
            for e in doomed {
                if remove(&e.path, &tmp)? {
                    evicted.removed.entries += 1;
                    evicted.removed.bytes += e.size;
                    evicted.remaining = evicted.remaining.saturating_sub(e.size);
                }
            }
            Ok(evicted)
        })
        .await?;
        if evicted.removed.entries > 0 {
            tracing::info!(cache = %self.root().display(), entries = evicted.removed.entries, bytes = evicted.removed.bytes, remaining = evicted.remaining, budget, "evicted least recently used images from the cache");
        }
        if evicted.remaining > budget {
            tracing::warn!(cache = %self.root().display(), remaining = evicted.remaining, budget, "the image cache stays over its budget: the rest is in use or was used in the last {} minutes", GRACE.as_secs() / 60);
        }
        Ok(evicted)
    }
}

/// The bases and blobs of the image chains `in_use` ([`ImageStore::evict`]): the base of each
/// chain (its image with its extra layers on top), and of every image in it the manifest blob
/// and the config and layer blobs it names when it is cached and readable. Blocking.
fn kept_paths(root: &Path, in_use: &BTreeSet<Vec<String>>) -> BTreeSet<PathBuf> {
    let blobs = root.join("blobs").join("sha256");
    let mut keep = BTreeSet::new();
    for chain in in_use {
        let key = ImageStore::rootfs_key_of(chain.iter().map(String::as_str));
        keep.insert(root.join("rootfs").join(format!("{key}.ext4")));
        for digest in chain {
            keep_image(&blobs, digest, &mut keep);
        }
    }
    keep
}

/// Adds the manifest blob of image `digest` and the blobs it names to `keep`.
fn keep_image(blobs: &Path, digest: &str, keep: &mut BTreeSet<PathBuf>) {
    let Ok(d) = Digest::parse(digest, "a VM record's image digest") else {
        return;
    };
    let manifest = blobs.join(d.hex());
    if let Ok(Document::Manifest { config, layers }) = std::fs::read(&manifest)
        .map_err(ImageError::io("Reading", &manifest))
        .and_then(|bytes| Document::parse(&bytes, digest))
    {
        for desc in std::iter::once(config).chain(layers) {
            keep.insert(blobs.join(desc.digest.hex()));
        }
    }
    keep.insert(manifest);
}

/// The cache's bases and blobs (temporaries left out), `in_use` when `keep` holds them.
/// Blocking.
fn scan(root: &Path, keep: &BTreeSet<PathBuf>) -> Result<Vec<CacheEntry>> {
    let mut entries = Vec::new();
    for (dir, wanted) in [
        (
            root.join("rootfs"),
            (|n: &str| n.ends_with(".ext4")) as fn(&str) -> bool,
        ),
        (root.join("blobs").join("sha256"), |_: &str| true),
    ] {
        let listing = match std::fs::read_dir(&dir) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(ImageError::io("Listing", &dir)(e)),
        };
        for entry in listing {
            let entry = entry.map_err(ImageError::io("Listing", &dir))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if temp_owner(name).is_some() || !wanted(name) {
                continue;
            }
            let path = entry.path();
            // Gone meanwhile (another eviction), or not a plain file: not an entry.
            let Ok(md) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if !md.is_file() {
                continue;
            }
            entries.push(CacheEntry {
                in_use: keep.contains(&path),
                size: md.blocks() * 512,
                last_used: md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                path,
            });
        }
    }
    Ok(entries)
}

/// Renames `path` into `tmp` under a temporary name, then deletes it there; false when it was
/// already gone. Blocking.
fn remove(path: &Path, tmp: &Path) -> Result<bool> {
    let stem = path.file_name().and_then(|n| n.to_str()).unwrap_or("entry");
    let doomed = temp_path(tmp, &format!("evict-{stem}"));
    match std::fs::rename(path, &doomed) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(ImageError::io("Moving out of the cache", path)(e)),
    }
    std::fs::remove_file(&doomed).map_err(ImageError::io("Removing", &doomed))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::store::touch;

    const MIN: Duration = Duration::from_secs(60);

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000)
    }

    fn entry(name: &str, size: u64, age: Duration, in_use: bool) -> CacheEntry {
        CacheEntry {
            path: PathBuf::from(name),
            size,
            last_used: now() - age,
            in_use,
        }
    }

    fn names(doomed: Vec<&CacheEntry>) -> Vec<&str> {
        doomed.iter().map(|e| e.path.to_str().unwrap()).collect()
    }

    #[test]
    fn nothing_goes_while_the_cache_fits() {
        let entries = [
            entry("a", 40, 90 * MIN, false),
            entry("b", 60, 80 * MIN, false),
        ];
        assert!(choose(&entries, 100, now(), GRACE).is_empty());
        assert!(choose(&[], 0, now(), GRACE).is_empty());
    }

    #[test]
    fn the_least_recently_used_go_first_until_it_fits() {
        let entries = [
            entry("newer", 30, 60 * MIN, false),
            entry("oldest", 30, 300 * MIN, false),
            entry("old", 30, 200 * MIN, false),
            entry("newest", 30, 30 * MIN, false),
        ];
        // 120 bytes, budget 70: two must go, the two oldest.
        assert_eq!(names(choose(&entries, 70, now(), GRACE)), ["oldest", "old"]);
        // Budget 90: one is enough.
        assert_eq!(names(choose(&entries, 90, now(), GRACE)), ["oldest"]);
        assert_eq!(choose(&entries, 0, now(), GRACE).len(), 4);
    }

    #[test]
    fn entries_in_use_or_used_lately_stay_even_over_budget() {
        let entries = [
            entry("used-by-a-vm", 100, 999 * MIN, true),
            entry("just-pulled", 100, 5 * MIN, false),
            entry("from-the-future", 100, Duration::ZERO, false),
            entry("idle", 10, 120 * MIN, false),
        ];
        let mut future = entries.clone();
        future[2].last_used = now() + MIN;
        assert_eq!(names(choose(&future, 50, now(), GRACE)), ["idle"]);
        // With no grace, only the VM's entry stays.
        assert_eq!(
            names(choose(&entries, 100, now(), Duration::ZERO)),
            ["idle", "just-pulled", "from-the-future"]
        );
    }

    /// Writes `bytes` to `path`, last used `age` ago.
    fn file(path: &Path, bytes: &[u8], age: Duration) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - age).unwrap();
    }

    fn hex(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    #[test]
    fn touching_an_entry_makes_it_the_most_recently_used() {
        let path = std::env::temp_dir().join(format!("imp-evict-touch-{}", std::process::id()));
        file(&path, b"base", 24 * 60 * MIN);
        let before = std::fs::metadata(&path).unwrap().modified().unwrap();
        touch(&path);
        let after = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert!(after.duration_since(before).unwrap() > 23 * 60 * MIN);
        assert!(SystemTime::now().duration_since(after).unwrap() < MIN);
        touch(&path.with_extension("missing")); // logged, not fatal
        std::fs::remove_file(&path).unwrap();
    }

    fn manifest_json(config: &str, layer: &str) -> String {
        format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
            "config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:{config}","size":4096}},
            "layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:{layer}","size":65536}}]}}"#
        )
    }

    #[tokio::test]
    async fn eviction_removes_old_unused_files_whole_and_keeps_a_vms_image() {
        let root = std::env::temp_dir().join(format!("imp-evict-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let blobs = root.join("blobs/sha256");
        let (config, layer, manifest) = (hex('c'), hex('d'), hex('e'));
        // The VM's extra layer (a runnerLayer): an image of its own.
        let (runner_layer, runner) = (hex('b'), hex('f'));
        let in_use = format!("sha256:{manifest}");
        let chain = vec![in_use.clone(), format!("sha256:{runner}")];
        let old = 24 * 60 * MIN;
        let big = vec![7u8; 64 << 10];
        // The VM's images: their manifests, config, layers and the base of both, all old.
        file(
            &blobs.join(&manifest),
            manifest_json(&config, &layer).as_bytes(),
            old,
        );
        file(&blobs.join(&config), &big[..4096], old);
        file(&blobs.join(&layer), &big, old);
        file(
            &blobs.join(&runner),
            manifest_json(&config, &runner_layer).as_bytes(),
            old,
        );
        file(&blobs.join(&runner_layer), &big, old);
        let vm_base = root.join(format!(
            "rootfs/{}.ext4",
            ImageStore::rootfs_key_of(chain.iter().map(String::as_str))
        ));
        file(&vm_base, &big, old);
        // Unused: an old base and blob, a newer blob, one just used; a temporary.
        let oldest = root.join(format!("rootfs/{}.ext4", hex('1')));
        file(&oldest, &big, old + MIN);
        let unused = blobs.join(hex('2'));
        file(&unused, &big, old);
        let newer = blobs.join(hex('3'));
        file(&newer, &big, 60 * MIN);
        let fresh = blobs.join(hex('4'));
        file(&fresh, &big, MIN);
        let temp = root.join("rootfs/.abc.1.0.tmp");
        file(&temp, &big, old);

        let store = ImageStore::new(root.clone(), crate::Limits::default());
        let all = scan(&root, &BTreeSet::new()).unwrap();
        assert_eq!(all.len(), 10, "the temporary is no entry: {all:?}");
        let size = all.iter().find(|e| e.path == unused).unwrap().size;
        // Room for the VM's image, the just-used blob and one more 64 KiB file.
        let keep: u64 = all
            .iter()
            .filter(|e| {
                [&manifest, &config, &layer, &runner, &runner_layer]
                    .iter()
                    .any(|h| e.path.ends_with(h))
                    || e.path == vm_base
                    || e.path == fresh
            })
            .map(|e| e.size)
            .sum();
        let budget = keep + size;
        let evicted = store.evict(budget, BTreeSet::from([chain])).await.unwrap();
        assert_eq!(evicted.removed.entries, 2, "{evicted:?}");
        assert!(evicted.remaining <= budget, "{evicted:?}");
        assert!(
            !oldest.exists() && !unused.exists(),
            "the two least recently used went"
        );
        for kept in [
            &newer,
            &fresh,
            &vm_base,
            &blobs.join(&manifest),
            &blobs.join(&config),
            &blobs.join(&layer),
            &blobs.join(&runner),
            &blobs.join(&runner_layer),
            &temp,
        ] {
            assert!(kept.exists(), "{} kept", kept.display());
        }
        let leftovers: Vec<_> = std::fs::read_dir(root.join("tmp")).unwrap().collect();
        assert!(
            leftovers.is_empty(),
            "nothing half-removed is left: {leftovers:?}"
        );

        // Within budget: nothing more goes; a budget of 0 takes all but what must stay.
        let again = store.evict(budget, BTreeSet::new()).await.unwrap();
        assert_eq!(again.removed.entries, 0);
        let all_out = store.evict(0, BTreeSet::new()).await.unwrap();
        assert_eq!(all_out.removed.entries, 7, "{all_out:?}");
        assert!(fresh.exists() && temp.exists());
        let _ = std::fs::remove_dir_all(&root);
    }
}
