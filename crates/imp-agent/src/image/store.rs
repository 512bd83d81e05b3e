//! The image cache on one node: pulling images into the blob cache and building cached ext4
//! bases from them.
//!
//! Layout of the cache root: `blobs/sha256/<hex>` (content-addressed blobs),
//! `rootfs/<key>.ext4` (bases keyed by manifest digests and [`FORMAT_VERSION`]) and `tmp/`
//! (unpack directories and extracted archives, removed after use).

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::auth::RegistryAuth;
use super::blobs::{BlobStore, HashingReader, check, sync_dir, temp_path};
use super::layers::{Applier, Limits};
use super::layout::{LayoutFetcher, extract_archive};
use super::manifest::{Descriptor, Digest, Document, Platform, parse_config, select_platform};
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
    async fn blob(&self, blobs: &BlobStore, d: &Descriptor, what: &str) -> Result<bool> {
        match self {
            Self::Registry(f) => f.blob(blobs, d, what).await,
            Self::Layout(f) => f.blob(blobs, d, what).await,
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
}

impl ImageStore {
    /// A cache at `root` (created on first use) whose unpacked images stay within `limits`.
    pub fn new(root: PathBuf, limits: Limits) -> Self {
        Self {
            blobs: BlobStore::new(&root),
            root,
            limits,
            platform: Platform::host(),
        }
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
                let tmp = self.tmp_dir();
                tokio::fs::create_dir_all(&tmp)
                    .await
                    .map_err(ImageError::io("Creating directory", &tmp))?;
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
                    digest = desc.digest;
                }
            }
        };
        let mut fetched = 0;
        let what = format!("config of {name}");
        fetched += usize::from(f.blob(&self.blobs, &config, &what).await?);
        let config_bytes = self.blobs.read_verified(&config, &what).await?;
        let (image_config, platform) = parse_config(&config_bytes, &what)?;
        if let Some(p) = platform
            && (p.os != self.platform.os || p.architecture != self.platform.architecture)
        {
            return Err(ImageError::NoPlatform {
                image: format!("{name} (config says {p})"),
                platform: self.platform.to_string(),
            });
        }
        for (i, layer) in layers.iter().enumerate() {
            layer_codec(layer)?;
            let what = format!("layer {i} of {name}");
            fetched += usize::from(f.blob(&self.blobs, layer, &what).await?);
        }
        tracing::info!(image = name, manifest = %digest, layers = layers.len(), blobs_fetched = fetched, "pulled image");
        Ok(PulledImage {
            source: name.to_owned(),
            manifest_digest: digest.to_string(),
            config_digest: config.digest.to_string(),
            config: image_config,
            layers: layers
                .into_iter()
                .map(|l| LayerDescriptor {
                    digest: l.digest.to_string(),
                    size: l.size,
                    media_type: l.media_type,
                })
                .collect(),
            blobs_fetched: fetched,
        })
    }

    /// The cache key of the base for `image` with `extra` images' layers on top.
    pub fn rootfs_key(image: &PulledImage, extra: &[PulledImage]) -> String {
        let mut h = Sha256::new();
        h.update(format!("imp-rootfs-v{FORMAT_VERSION}\n"));
        for i in std::iter::once(image).chain(extra) {
            h.update(&i.manifest_digest);
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
        if let Ok(md) = tokio::fs::metadata(&path).await
            && md.is_file()
        {
            return Ok(BaseRootfs {
                path,
                key,
                size_bytes: md.len(),
                cached: true,
            });
        }
        for d in [&dir, &self.tmp_dir()] {
            tokio::fs::create_dir_all(d)
                .await
                .map_err(ImageError::io("Creating directory", d))?;
        }
        let mut layers = Vec::new();
        for img in std::iter::once(image).chain(extra) {
            for l in &img.layers {
                layers.push(Descriptor {
                    media_type: l.media_type.clone(),
                    digest: Digest::parse(&l.digest, &format!("layer of {}", img.source))?,
                    size: l.size,
                });
            }
        }
        let unpack = temp_path(&self.tmp_dir(), &format!("unpack-{key}"));
        let image_tmp = temp_path(&dir, &key);
        let (blobs, limits) = (self.blobs.clone(), self.limits);
        let (u, t, p, d) = (unpack.clone(), image_tmp.clone(), path.clone(), dir.clone());
        let started = std::time::Instant::now();
        let result = blocking(move || {
            std::fs::create_dir(&u).map_err(ImageError::io("Creating the unpack directory", &u))?;
            let mut applier = Applier::new(&u, limits).map_err(ImageError::Layer)?;
            for (i, layer) in layers.iter().enumerate() {
                apply_layer(&blobs, &mut applier, layer, i)?;
            }
            let size = ext4::build_blocking(&u, &t)?;
            std::fs::rename(&t, &p)
                .map_err(ImageError::io("Renaming the rootfs into the cache", &p))?;
            sync_dir(&d)?;
            Ok(size)
        })
        .await;
        let cleanup = unpack.clone();
        let _ = blocking(move || {
            let _ = std::fs::remove_dir_all(&cleanup);
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
        Ok(BaseRootfs {
            path,
            key,
            size_bytes,
            cached: false,
        })
    }
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

/// Applies one cached layer blob, hashing it on the way: a blob changed in the cache since it
/// was fetched fails the build (the unpack directory is discarded). Blocking.
fn apply_layer(
    blobs: &BlobStore,
    applier: &mut Applier,
    layer: &Descriptor,
    index: usize,
) -> Result<()> {
    let path = blobs.path(&layer.digest);
    let file = std::fs::File::open(&path).map_err(ImageError::io("Opening layer blob", &path))?;
    let mut reader = HashingReader::new(BufReader::new(file).take(layer.size + 1));
    let digest = layer.digest.to_string();
    let applied = match layer_codec(layer)? {
        Codec::Plain => applier.apply(&digest, &mut reader),
        Codec::Gzip => applier.apply(&digest, flate2::read::GzDecoder::new(&mut reader)),
        Codec::Zstd => match ruzstd::decoding::StreamingDecoder::new(&mut reader) {
            Ok(decoder) => applier.apply(&digest, decoder),
            Err(e) => Err(super::layers::Error::Stream {
                layer: index,
                digest: digest.clone(),
                after: String::new(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
            }),
        },
    };
    // Check the digest first: a tampered blob is reported as such, not as a tar error.
    reader
        .drain()
        .map_err(ImageError::io("Reading layer blob", &path))?;
    let (hasher, len) = reader.finish();
    if let Err(e) = check(layer, hasher, len, &format!("layer {index}")) {
        // Drop the bad copy so the next pull fetches the blob again.
        let _ = std::fs::remove_file(&path);
        tracing::warn!(digest = %layer.digest, path = %path.display(), "cached layer blob corrupt; removed");
        return Err(e);
    }
    applied.map_err(ImageError::Layer)
}
