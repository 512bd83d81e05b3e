//! The image cache on one node: pulling images into the blob cache and building cached ext4
//! bases from them.
//!
//! Layout of the cache root: `blobs/sha256/<hex>` (content-addressed blobs),
//! `rootfs/<key>.ext4` (bases keyed by manifest digests and [`FORMAT_VERSION`]) and `tmp/`
//! (unpack directories and extracted archives, removed after use).
//!
//! The cache root and `tmp/` are private to their owner (0700): a layer's files are staged
//! there, and no other user may reach them while it is unpacked. Temporaries carry the id of
//! the process that made them; [`ImageStore::remove_stale`] removes those whose process is
//! gone (an unpack killed half-way), and [`ImageStore::prune`] also drops cached bases.
//! Using a cached base or blob touches its mtime, which [`super::evict`] reads as "last used"
//! to keep the cache within a byte budget.

use std::io::{BufReader, Read};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::auth::RegistryAuth;
use super::blobs::{BlobStore, HashingReader, check, sync_dir, temp_owner, temp_path};
use super::layers::{Applier, Census, Limits};
use super::layout::{LayoutFetcher, extract_archive};
use super::manifest::{
    Descriptor, Digest, Document, Platform, parse_config, parse_diff_ids, select_platform,
};
use super::progress::{Event, LayerInfo, Meter, Metered, Reporter};
use super::reference::ImageSource;
use super::registry::RegistryFetcher;
use super::{ImageError, Result, blocking, ext4};

/// Bumped whenever the way a base rootfs is built changes, so old cached bases are not reused.
pub const FORMAT_VERSION: u32 = 1;
/// Deepest index nesting followed (an index may point to an index).
const MAX_INDEX_DEPTH: usize = 4;

/// One layer of a pulled image, its blob in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerDescriptor {
    /// `sha256:…` of the compressed blob.
    pub digest: String,
    /// Blob size in bytes.
    pub size: u64,
    /// Media type (tar, tar+gzip).
    pub media_type: String,
    /// `sha256:…` of the uncompressed tar, from the config's `rootfs.diff_ids`.
    pub diff_id: String,
}

/// An image whose manifest, config and layers are all in the blob cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledImage {
    /// The source as given, for messages.
    pub source: String,
    /// Digest of the platform's image manifest (not of the index).
    pub manifest_digest: String,
    /// Digest of the config blob.
    pub config_digest: String,
    /// The process the image runs: Entrypoint, Cmd, Env, WorkingDir, User.
    pub config: imp_proto::config::ImageConfig,
    /// Layers, lowest first.
    pub layers: Vec<LayerDescriptor>,
    /// Blobs fetched over the network or copied from a layout by this pull (0 when all cached).
    pub blobs_fetched: usize,
}

/// A cached ext4 base image, shared read-only by every VM of that image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseRootfs {
    /// The ext4 file; never attach it writable: use [`super::clone_disk`].
    pub path: PathBuf,
    /// Its cache key (hex).
    pub key: String,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// True when it was already in the cache.
    pub cached: bool,
}

enum Fetcher {
    Registry(RegistryFetcher),
    Layout(LayoutFetcher),
}

impl Fetcher {
    async fn root(&self, blobs: &BlobStore) -> Result<(Vec<u8>, Digest)> {
        match self {
            Self::Registry(f) => f.root(blobs).await,
            Self::Layout(f) => f.root().await,
        }
    }
    async fn manifest(&self, d: &Descriptor) -> Result<Vec<u8>> {
        match self {
            Self::Registry(f) => f.manifest(d).await,
            Self::Layout(f) => f.manifest(d).await,
        }
    }
    async fn blob(&self, blobs: &BlobStore, d: &Descriptor, what: &str, m: Meter) -> Result<bool> {
        match self {
            Self::Registry(f) => f.blob(blobs, d, what, m).await,
            Self::Layout(f) => f.blob(blobs, d, what, m).await,
        }
    }
}

/// The image cache rooted at one directory.
#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
    limits: Limits,
    platform: Platform,
    blobs: BlobStore,
    reporter: Reporter,
}

impl ImageStore {
    /// A cache at `root` (created on first use) whose unpacked images stay within `limits`.
    pub fn new(root: PathBuf, limits: Limits) -> Self {
        Self {
            blobs: BlobStore::new(&root),
            root,
            limits,
            platform: Platform::host(),
            reporter: Reporter::default(),
        }
    }

    /// Reports what [`Self::pull`] and [`Self::rootfs`] do to `reporter` (by default nobody
    /// is told).
    pub fn with_reporter(mut self, reporter: Reporter) -> Self {
        self.reporter = reporter;
        self
    }

    /// Where this store reports progress.
    pub fn reporter(&self) -> &Reporter {
        &self.reporter
    }

    /// Picks `platform` from multi-platform indexes instead of linux on the host architecture.
    pub fn with_platform(mut self, platform: Platform) -> Self {
        self.platform = platform;
        self
    }

    /// The blob cache, for inspection.
    pub fn blobs(&self) -> &BlobStore {
        &self.blobs
    }

    /// The cache root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// Creates the cache root and `tmp/` mode 0700, or makes them so.
    async fn private_dirs(&self) -> Result<()> {
        let root = self.root.clone();
        blocking(move || {
            for d in [root.clone(), root.join("tmp")] {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&d)
                    .map_err(ImageError::io("Creating directory", &d))?;
                std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
                    .map_err(ImageError::io("Making private", &d))?;
            }
            Ok(())
        })
        .await
    }

    /// Removes temporaries (unpack directories, extracted archives, half-written blobs and
    /// bases) whose process is gone: what an unpack killed half-way leaves. Those of running
    /// processes (another `imp run` unpacking now) are kept.
    pub async fn remove_stale(&self) -> Result<Pruned> {
        let root = self.root.clone();
        let pruned = blocking(move || {
            let mut pruned = Pruned::default();
            for dir in ["tmp", "rootfs", "blobs/sha256"] {
                prune_dir(&root.join(dir), &mut pruned, |name| {
                    temp_owner(name).is_some_and(|pid| !process_alive(pid))
                })?;
            }
            Ok(pruned)
        })
        .await?;
        if pruned.entries > 0 {
            tracing::info!(cache = %self.root.display(), entries = pruned.entries, bytes = pruned.bytes, "removed stale image temporaries");
        }
        Ok(pruned)
    }

    /// [`Self::remove_stale`], then every cached base (rebuilt from the blobs when next
    /// needed) and, with `blobs`, every blob (fetched again when next pulled). A VM being
    /// created at that moment may fail and can be started again.
    pub async fn prune(&self, blobs: bool) -> Result<Pruned> {
        let mut pruned = self.remove_stale().await?;
        let root = self.root.clone();
        let more = blocking(move || {
            let mut more = Pruned::default();
            prune_dir(&root.join("rootfs"), &mut more, |n| n.ends_with(".ext4"))?;
            if blobs {
                prune_dir(&root.join("blobs/sha256"), &mut more, |_| true)?;
            }
            Ok(more)
        })
        .await?;
        pruned.entries += more.entries;
        pruned.bytes += more.bytes;
        tracing::info!(cache = %self.root.display(), entries = pruned.entries, bytes = pruned.bytes, "pruned the image cache");
        Ok(pruned)
    }

    /// Resolves `source` to this store's platform and brings its config and layers into the blob
    /// cache, verifying every digest and size. A cached blob is not fetched again.
    pub async fn pull(&self, source: &ImageSource, auth: &RegistryAuth) -> Result<PulledImage> {
        let name = source.to_string();
        match source {
            ImageSource::Registry(r) => {
                let f = Fetcher::Registry(RegistryFetcher::new(r, auth));
                self.pull_with(&f, &name).await
            }
            ImageSource::OciLayout { dir, tag } => {
                let f = Fetcher::Layout(LayoutFetcher::open(dir, tag.clone()).await?);
                self.pull_with(&f, &name).await
            }
            ImageSource::OciArchive { file, tag } => {
                self.private_dirs().await?;
                let tmp = self.tmp_dir();
                let dir = temp_path(&tmp, "archive");
                let result = async {
                    extract_archive(file, &dir).await?;
                    let f = Fetcher::Layout(LayoutFetcher::open(&dir, tag.clone()).await?);
                    self.pull_with(&f, &name).await
                }
                .await;
                let _ = tokio::fs::remove_dir_all(&dir).await;
                result
            }
        }
    }

    async fn pull_with(&self, f: &Fetcher, name: &str) -> Result<PulledImage> {
        let (mut bytes, mut digest) = f.root(&self.blobs).await?;
        let mut depth = 0;
        // The indexes passed on the way to the manifest, marked used with it.
        let mut visited = Vec::new();
        let (config, layers) = loop {
            // Manifests and indexes are kept too, so a pull by digest needs no request.
            self.blobs.put(&digest, &bytes).await?;
            match Document::parse(&bytes, &format!("manifest {digest} of {name}"))? {
                Document::Manifest { config, layers } => break (config, layers),
                Document::Index(entries) => {
                    depth += 1;
                    if depth > MAX_INDEX_DEPTH {
                        return Err(ImageError::Manifest {
                            what: format!("index {digest} of {name}"),
                            reason: "indexes nested too deep".into(),
                        });
                    }
                    let desc = select_platform(&entries, &self.platform, name)?;
                    bytes = f.manifest(&desc).await?;
                    visited.push(std::mem::replace(&mut digest, desc.digest));
                }
            }
        };
        let mut fetched = 0;
        let what = format!("config of {name}");
        let unreported = Reporter::default().meter(0, fetching);
        fetched += usize::from(f.blob(&self.blobs, &config, &what, unreported).await?);
        let config_bytes = self.blobs.read_verified(&config, &what).await?;
        let (image_config, platform) = parse_config(&config_bytes, &what)?;
        let diff_ids = parse_diff_ids(&config_bytes, &what)?;
        if diff_ids.len() != layers.len() {
            return Err(ImageError::Manifest {
                what,
                reason: format!(
                    "rootfs.diff_ids names {} layers, the manifest has {}",
                    diff_ids.len(),
                    layers.len()
                ),
            });
        }
        if let Some(p) = platform
            && (p.os != self.platform.os || p.architecture != self.platform.architecture)
        {
            return Err(ImageError::NoPlatform {
                image: format!("{name} (config says {p})"),
                platform: self.platform.to_string(),
            });
        }
        self.reporter.emit(Event::Resolved {
            digest: digest.to_string(),
            layers: layers
                .iter()
                .map(|l| LayerInfo {
                    digest: l.digest.to_string(),
                    size: l.size,
                })
                .collect(),
        });
        for (i, layer) in layers.iter().enumerate() {
            layer_codec(layer)?;
            let what = format!("layer {i} of {name}");
            let meter = self.reporter.meter(i, fetching);
            let got = f.blob(&self.blobs, layer, &what, meter).await?;
            // At once, not after the pull: an eviction meanwhile must not take a cached layer
            // this build is about to read.
            self.mark_used([&layer.digest]).await;
            fetched += usize::from(got);
            self.reporter.emit(Event::Fetched {
                index: i,
                bytes: if got { layer.size } else { 0 },
            });
        }
        self.mark_used(visited.iter().chain([&digest, &config.digest]))
            .await;
        tracing::info!(image = name, manifest = %digest, layers = layers.len(), blobs_fetched = fetched, "pulled image");
        Ok(PulledImage {
            source: name.to_owned(),
            manifest_digest: digest.to_string(),
            config_digest: config.digest.to_string(),
            config: image_config,
            layers: layers
                .into_iter()
                .zip(diff_ids)
                .map(|(l, diff_id)| LayerDescriptor {
                    digest: l.digest.to_string(),
                    size: l.size,
                    media_type: l.media_type,
                    diff_id: diff_id.to_string(),
                })
                .collect(),
            blobs_fetched: fetched,
        })
    }

    /// Touches the blobs of `digests` ([`touch`]): they were just used, so an
    /// eviction keeps them for its grace period.
    async fn mark_used(&self, digests: impl IntoIterator<Item = &Digest>) {
        let paths: Vec<PathBuf> = digests.into_iter().map(|d| self.blobs.path(d)).collect();
        let _ = blocking(move || {
            paths.iter().for_each(|p| touch(p));
            Ok(())
        })
        .await;
    }

    /// The cache key of the base for `image` with `extra` images' layers on top.
    pub fn rootfs_key(image: &PulledImage, extra: &[PulledImage]) -> String {
        Self::rootfs_key_of(
            std::iter::once(image)
                .chain(extra)
                .map(|i| i.manifest_digest.as_str()),
        )
    }

    /// The cache key of the base built from the images of `manifest_digests`, lowest first.
    pub fn rootfs_key_of<'a>(manifest_digests: impl IntoIterator<Item = &'a str>) -> String {
        let mut h = Sha256::new();
        h.update(format!("imp-rootfs-v{FORMAT_VERSION}\n"));
        for d in manifest_digests {
            h.update(d);
            h.update("\n");
        }
        format!("{:x}", h.finalize())
    }

    /// The ext4 base of `image` with the layers of each `extra` image (e.g. a runner or Cilium
    /// layer) applied on top, from the cache or built now (atomically, into the cache).
    pub async fn rootfs(&self, image: &PulledImage, extra: &[PulledImage]) -> Result<BaseRootfs> {
        let key = Self::rootfs_key(image, extra);
        let dir = self.root.join("rootfs");
        let path = dir.join(format!("{key}.ext4"));
        if let Some(base) = self.cached_base(&path, &key).await {
            return Ok(base);
        }
        self.private_dirs().await?;
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(ImageError::io("Creating directory", &dir))?;
        let build = BaseBuild {
            layers: layer_plan(image, extra)?,
            unpack: temp_path(&self.tmp_dir(), &format!("unpack-{key}")),
            image_tmp: temp_path(&dir, &key),
            path: path.clone(),
            dir,
            blobs: self.blobs.clone(),
            limits: self.limits,
            reporter: self.reporter.clone(),
        };
        let (unpack, image_tmp) = (build.unpack.clone(), build.image_tmp.clone());
        let started = std::time::Instant::now();
        let result = blocking(move || build.run()).await;
        let _ = blocking(move || {
            let _ = std::fs::remove_dir_all(&unpack);
            Ok(())
        })
        .await;
        let size_bytes = match result {
            Ok(s) => s,
            Err(e) => {
                let _ = tokio::fs::remove_file(&image_tmp).await;
                return Err(e);
            }
        };
        tracing::info!(image = %image.source, key, size_bytes, elapsed_ms = started.elapsed().as_millis() as u64, "built rootfs");
        self.reporter.emit(Event::Built {
            size_bytes,
            cached: false,
        });
        Ok(BaseRootfs {
            path,
            key,
            size_bytes,
            cached: false,
        })
    }

    /// The base at `path` when it is cached, touched as just used ([`touch`]) and reported.
    async fn cached_base(&self, path: &Path, key: &str) -> Option<BaseRootfs> {
        let md = tokio::fs::metadata(path).await.ok()?;
        if !md.is_file() {
            return None;
        }
        let used = path.to_path_buf();
        let _ = blocking(move || {
            touch(&used);
            Ok(())
        })
        .await;
        self.reporter.emit(Event::Built {
            size_bytes: md.len(),
            cached: true,
        });
        Some(BaseRootfs {
            path: path.to_path_buf(),
            key: key.to_owned(),
            size_bytes: md.len(),
            cached: true,
        })
    }
}

/// The layers of `image` then of each `extra` image, lowest first, each with its diff_id.
fn layer_plan(image: &PulledImage, extra: &[PulledImage]) -> Result<Vec<(Descriptor, Digest)>> {
    let mut layers = Vec::new();
    for img in std::iter::once(image).chain(extra) {
        for l in &img.layers {
            let what = format!("layer of {}", img.source);
            layers.push((
                Descriptor {
                    media_type: l.media_type.clone(),
                    digest: Digest::parse(&l.digest, &what)?,
                    size: l.size,
                },
                Digest::parse(&l.diff_id, &what)?,
            ));
        }
    }
    Ok(layers)
}

/// One base being built, run blocking: the layers it is built from and where it unpacks,
/// writes and finally lands in the cache.
struct BaseBuild {
    layers: Vec<(Descriptor, Digest)>,
    /// The unpack directory (under `tmp/`); the caller removes it.
    unpack: PathBuf,
    /// The ext4 file being written, renamed to `path` when whole.
    image_tmp: PathBuf,
    path: PathBuf,
    /// The cache's `rootfs/` directory, synced after the rename.
    dir: PathBuf,
    blobs: BlobStore,
    limits: Limits,
    reporter: Reporter,
}

impl BaseBuild {
    /// Verifies every layer, applies them into the unpack directory, builds the ext4 and
    /// renames it into the cache. Returns its size in bytes. Blocking.
    fn run(&self) -> Result<u64> {
        self.verify()?;
        let applier = self.extract()?;
        self.reporter.emit(Event::Building);
        let size = ext4::build_blocking(&self.unpack, &self.image_tmp, applier.specials())?;
        std::fs::rename(&self.image_tmp, &self.path).map_err(ImageError::io(
            "Renaming the rootfs into the cache",
            &self.path,
        ))?;
        sync_dir(&self.dir)?;
        Ok(size)
    }

    /// Checks every layer whole (digests, gzip trailers, diff_ids, counts from the headers)
    /// before the first file is written.
    fn verify(&self) -> Result<()> {
        let mut census = Census::default();
        for (i, (layer, diff_id)) in self.layers.iter().enumerate() {
            let meter = self.reporter.meter(i, verifying);
            verify_layer(
                &self.blobs,
                &mut census,
                self.limits,
                layer,
                diff_id,
                i,
                meter,
            )?;
        }
        Ok(())
    }

    /// Creates the unpack directory (0700) and applies every layer into it, in order.
    fn extract(&self) -> Result<Applier> {
        let u = &self.unpack;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(u)
            .map_err(ImageError::io("Creating the unpack directory", u))?;
        let mut applier = Applier::new(u, self.limits).map_err(ImageError::Layer)?;
        for (i, (layer, _)) in self.layers.iter().enumerate() {
            let meter = self.reporter.meter(i, extracting);
            apply_layer(&self.blobs, &mut applier, layer, i, meter)?;
            self.reporter.emit(Event::Extracted { index: i });
        }
        Ok(applier)
    }
}

/// Sets `path`'s mtime to now: it was just used, which [`super::evict`] reads as "last used".
/// A failure is logged (the entry may then be evicted sooner than it should, nothing worse).
pub fn touch(path: &Path) {
    let touched =
        std::fs::File::open(path).and_then(|f| f.set_modified(std::time::SystemTime::now()));
    if let Err(e) = touched {
        tracing::debug!(path = %path.display(), error = %e, "marking a cache entry used");
    }
}

/// What a cleanup removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Files and directories removed (each directory counts once).
    pub entries: u64,
    /// Disk space they held, in bytes (allocated blocks).
    pub bytes: u64,
}

/// True while process `pid` exists (a process of another user counts).
fn process_alive(pid: i32) -> bool {
    use nix::errno::Errno;
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) | Err(Errno::EPERM) => true,
        Err(_) => false,
    }
}

/// Removes the children of `dir` (missing: nothing) whose name `doomed` picks. Blocking.
fn prune_dir(dir: &Path, pruned: &mut Pruned, doomed: impl Fn(&str) -> bool) -> Result<()> {
    let listing = match std::fs::read_dir(dir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ImageError::io("Listing", dir)(e)),
    };
    for entry in listing {
        let entry = entry.map_err(ImageError::io("Listing", dir))?;
        let name = entry.file_name();
        if !name.to_str().is_some_and(&doomed) {
            continue;
        }
        let path = entry.path();
        let bytes = disk_usage(&path);
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        removed.map_err(ImageError::io("Removing", &path))?;
        pruned.entries += 1;
        pruned.bytes += bytes;
    }
    Ok(())
}

/// Allocated bytes under `path` (links not followed); unreadable parts count as 0.
fn disk_usage(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        total += md.blocks() * 512;
        if md.is_dir() {
            stack.extend(
                std::fs::read_dir(&p)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path()),
            );
        }
    }
    total
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy)]
enum Codec {
    Plain,
    Gzip,
    Zstd,
}

fn layer_codec(layer: &Descriptor) -> Result<Codec> {
    match layer.media_type.as_str() {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar" => Ok(Codec::Plain),
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Ok(Codec::Gzip),
        "application/vnd.oci.image.layer.v1.tar+zstd"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => Ok(Codec::Zstd),
        other => Err(ImageError::UnsupportedMediaType {
            digest: layer.digest.to_string(),
            media_type: other.to_owned(),
        }),
    }
}

/// A cached layer blob, read through a hasher (of the compressed bytes) and a progress meter.
type BlobReader = HashingReader<std::io::Take<BufReader<Metered<std::fs::File>>>>;

fn open_blob(blobs: &BlobStore, layer: &Descriptor, meter: Meter) -> Result<(PathBuf, BlobReader)> {
    let path = blobs.path(&layer.digest);
    let file = std::fs::File::open(&path).map_err(ImageError::io("Opening layer blob", &path))?;
    Ok((
        path,
        HashingReader::new(BufReader::new(Metered::new(file, meter)).take(layer.size + 1)),
    ))
}

/// The progress events of the three passes over a layer's bytes.
fn fetching(index: usize, bytes: u64) -> Event {
    Event::Fetching { index, bytes }
}

fn verifying(index: usize, bytes: u64) -> Event {
    Event::Verifying { index, bytes }
}

fn extracting(index: usize, bytes: u64) -> Event {
    Event::Extracting { index, bytes }
}

/// The uncompressed tar stream of a layer.
fn decoder<'a>(
    codec: Codec,
    raw: &'a mut BlobReader,
    layer: &Descriptor,
    index: usize,
) -> Result<Box<dyn Read + 'a>> {
    Ok(match codec {
        Codec::Plain => Box::new(raw),
        Codec::Gzip => Box::new(flate2::read::MultiGzDecoder::new(raw)),
        Codec::Zstd => match ruzstd::decoding::StreamingDecoder::new(raw) {
            Ok(d) => Box::new(d),
            Err(e) => {
                return Err(ImageError::Decompress {
                    index,
                    digest: layer.digest.to_string(),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
                });
            }
        },
    })
}

/// Reads the rest of the blob and checks its digest; a blob changed in the cache since it was
/// fetched is removed (the next pull fetches it again) and fails the build.
fn check_blob(mut raw: BlobReader, path: &Path, layer: &Descriptor, index: usize) -> Result<()> {
    raw.drain()
        .map_err(ImageError::io("Reading layer blob", path))?;
    let (hasher, len) = raw.finish();
    if let Err(e) = check(layer, hasher, len, &format!("layer {index}")) {
        let _ = std::fs::remove_file(path);
        tracing::warn!(digest = %layer.digest, path = %path.display(), "cached layer blob corrupt; removed");
        return Err(e);
    }
    Ok(())
}

/// Reads one cached layer whole without writing anything: counts its headers into `census`
/// (refusing past `limits`), lets the decoder check the stream to its end (a gzip trailer's
/// CRC and length), and compares the uncompressed sha256 with the config's `diff_id`. Blocking.
fn verify_layer(
    blobs: &BlobStore,
    census: &mut Census,
    limits: Limits,
    layer: &Descriptor,
    diff_id: &Digest,
    index: usize,
    meter: Meter,
) -> Result<()> {
    let (path, mut raw) = open_blob(blobs, layer, meter)?;
    let digest = layer.digest.to_string();
    let (counted, drained, actual) = {
        let mut plain = HashingReader::new(decoder(layer_codec(layer)?, &mut raw, layer, index)?);
        let counted = census.count(&digest, &mut plain, limits);
        // Past the tar's end: padding, then the compressed stream's own trailer.
        let drained = if counted.is_ok() {
            plain.drain()
        } else {
            Ok(())
        };
        (counted, drained, Digest::from_hasher(plain.finish().0))
    };
    // A tampered blob is reported as such, not as what it decodes to.
    check_blob(raw, &path, layer, index)?;
    counted.map_err(ImageError::Layer)?;
    drained.map_err(|source| ImageError::Decompress {
        index,
        digest: digest.clone(),
        source,
    })?;
    if &actual != diff_id {
        return Err(ImageError::DiffIdMismatch {
            index,
            digest,
            expected: diff_id.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

/// Applies one cached layer blob (already verified by [`verify_layer`]), hashing it again on
/// the way: a blob changed since fails the build (the unpack directory is discarded). Blocking.
fn apply_layer(
    blobs: &BlobStore,
    applier: &mut Applier,
    layer: &Descriptor,
    index: usize,
    meter: Meter,
) -> Result<()> {
    let (path, mut raw) = open_blob(blobs, layer, meter)?;
    let digest = layer.digest.to_string();
    let applied = {
        let plain = decoder(layer_codec(layer)?, &mut raw, layer, index)?;
        applier.apply(&digest, plain)
    };
    check_blob(raw, &path, layer, index)?;
    applied.map_err(ImageError::Layer)
}
