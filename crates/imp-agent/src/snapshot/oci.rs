//! Snapshots in an OCI registry (`storage.type: oci-registry`): [`push`] a snapshot directory as
//! an OCI artifact, [`pull`] it back into a directory on any node, [`delete`] it when retention
//! prunes the execution.
//!
//! # Registry format (version 1)
//!
//! One OCI image manifest (`application/vnd.oci.image.manifest.v1+json`, schema version 2):
//!
//! | Part | Media type | Content |
//! |---|---|---|
//! | `artifactType` | [`ARTIFACT_TYPE`] `application/vnd.imp.snapshot.v1` | |
//! | config | [`CONFIG_MEDIA_TYPE`] `application/vnd.imp.snapshot.config.v1+json` | the directory's `snapshot.json`, byte for byte |
//! | layers | [`CHUNK_GZIP`] `application/vnd.imp.snapshot.chunk.v1+gzip` | one gzip member per chunk |
//! | (read only) | [`CHUNK_ZSTD`] `application/vnd.imp.snapshot.chunk.v1+zstd` | one zstd frame per chunk |
//!
//! The files [`FILES`] (`vmstate`, `memory`, `disk.ext4`, `initramfs.cpio`, `vmm.json`) are cut into chunks of
//! [`CHUNK_BYTES`] (32 MiB; the last one shorter), in file order then offset order. A chunk whose
//! bytes are all zero — a hole, or zeros the guest wrote — is not uploaded and has no layer: any
//! range of a file that no layer covers is zero, and a pull leaves it a hole. Each layer carries
//! the annotations [`ANNOTATION_FILE`] (`dev.imp.snapshot.file`: the file's name),
//! [`ANNOTATION_OFFSET`] (`dev.imp.snapshot.offset`) and [`ANNOTATION_LENGTH`]
//! (`dev.imp.snapshot.length`: the chunk's uncompressed bytes), both decimal. The manifest carries
//! `dev.imp.snapshot.size.<file>` ([`ANNOTATION_SIZE_PREFIX`]) for every file, so a file that is
//! all holes is still recreated at its size, and [`ANNOTATION_CHUNK_BYTES`] for information.
//!
//! Chunks are compressed with gzip (flate2, fastest level): measured on 32 MiB of a QEMU binary
//! in release builds, ruzstd 0.9's encoder (its only implemented level) ran at 133 MB/s to
//! 20.4 % and gzip at 373 MB/s to 17.1 %, so gzip is both faster and smaller here; pulls also
//! accept zstd chunks for a later encoder. The output is deterministic, so chunks that did not
//! change since the previous execution (most of the disk) have the same digest and are not
//! uploaded again.
//!
//! # Bounds
//! A push holds at most [`PushOptions::in_flight`] chunks in memory (each read, compressed and
//! uploaded in turn; reading and compressing run on the blocking pool), and a pull as many
//! (downloaded, then decompressed and written), so either needs about 2 × 32 MiB and a fixed
//! few tens of MiB whatever the guest's size (measured: 65 MiB of peak RSS growth for a 96 MiB
//! guest with default options; 28–33 MiB for 64 and 256 MiB guests with 4 MiB chunks). A pull refuses a manifest over 4 MiB, a config over 1 MiB,
//! a file over [`MAX_FILE_BYTES`], a chunk over [`MAX_CHUNK_BYTES`], a compressed chunk larger
//! than its data can be, overlapping chunks and unknown files, verifies every blob's sha256, and
//! decompresses no more than the chunk's declared length.
//!
//! Deleting removes the manifest (by digest, after checking it is a snapshot); its blobs stay
//! until the registry's garbage collection, which also keeps blobs other executions still use.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::ops::Range;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _, stream};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::{Client, Reference, RegistryOperation};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::{DISK, FORMAT, INITRD, MANIFEST, MEMORY, Manifest, VMM_NOTE, VMSTATE};
use imp_image::manifest::{ACCEPT, MAX_DOCUMENT_BYTES, OCI_MANIFEST};
use imp_image::reference::is_loopback_registry;
use imp_image::registry::install_crypto_provider;
use imp_image::{ImageError, RegistryAuth, auth_from_docker_config};

/// The manifest's `artifactType`: an imp snapshot, registry format 1.
pub const ARTIFACT_TYPE: &str = "application/vnd.imp.snapshot.v1";
/// The config blob's media type: the snapshot's `snapshot.json`.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.imp.snapshot.config.v1+json";
/// A chunk of a file, gzip-compressed (what [`push`] writes).
pub const CHUNK_GZIP: &str = "application/vnd.imp.snapshot.chunk.v1+gzip";
/// A chunk of a file, zstd-compressed (read by [`pull`], not written yet).
pub const CHUNK_ZSTD: &str = "application/vnd.imp.snapshot.chunk.v1+zstd";
/// Layer annotation: which file the chunk belongs to.
pub const ANNOTATION_FILE: &str = "dev.imp.snapshot.file";
/// Layer annotation: the chunk's offset in its file (decimal bytes).
pub const ANNOTATION_OFFSET: &str = "dev.imp.snapshot.offset";
/// Layer annotation: the chunk's uncompressed length (decimal bytes).
pub const ANNOTATION_LENGTH: &str = "dev.imp.snapshot.length";
/// Manifest annotation prefix: `dev.imp.snapshot.size.<file>` is the file's size (decimal).
pub const ANNOTATION_SIZE_PREFIX: &str = "dev.imp.snapshot.size.";
/// Manifest annotation: the chunk size the pusher used (informational).
pub const ANNOTATION_CHUNK_BYTES: &str = "dev.imp.snapshot.chunk-bytes";
/// The files of a snapshot directory stored as layers, in layer order.
pub const FILES: [&str; 5] = [VMSTATE, MEMORY, DISK, INITRD, VMM_NOTE];
/// The default chunk size.
pub const CHUNK_BYTES: u64 = 32 << 20;
/// The largest chunk a pull accepts (and a push may use).
pub const MAX_CHUNK_BYTES: u64 = 256 << 20;
/// The largest file a pull accepts.
pub const MAX_FILE_BYTES: u64 = 16 << 40;
/// The largest config (`snapshot.json`) either side accepts.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Chunks in flight by default (each: its data and its compressed form).
const IN_FLIGHT: usize = 2;
/// The block size below which pulled data is not checked for zeros (holes are whole blocks).
const BLOCK: usize = 4096;
/// A bound on one layer's descriptor in the manifest JSON, to refuse a push that would need a
/// manifest the registry (or our own pull) will not take, before uploading anything.
const LAYER_JSON_BYTES: u64 = 400;

/// The result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a snapshot could not be pushed, pulled or deleted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The reference cannot be used.
    #[error("Invalid snapshot reference {input:?}: {reason}")]
    Reference {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The credentials of a `.dockerconfigjson` cannot be used.
    #[error("Reading registry credentials for {reference}")]
    Credentials {
        /// The reference they were wanted for.
        reference: String,
        /// Why.
        #[source]
        source: Box<ImageError>,
    },
    /// The snapshot directory to push is not complete or not readable as one.
    #[error("Snapshot directory {dir:?}: {reason}")]
    Directory {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The push options cannot be used.
    #[error("Invalid push options: {reason}")]
    Options {
        /// What is wrong.
        reason: String,
    },
    /// A file operation failed.
    #[error("{op} {path:?}")]
    Io {
        /// What was being done, starting with a capital.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// The registry refused the credentials (or asked for some and got none).
    #[error("Registry {registry} refused the credentials (HTTP 401) while {what}: {detail}")]
    Unauthorized {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// What the registry or token endpoint said.
        detail: String,
    },
    /// The credentials were accepted but do not allow the operation.
    #[error("Registry {registry} denied access (HTTP 403) while {what}: {detail}")]
    Forbidden {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// What the registry said.
        detail: String,
    },
    /// The registry has no manifest under the reference.
    #[error("Snapshot {reference} not found in registry {registry}")]
    NotFound {
        /// The registry host.
        registry: String,
        /// The reference looked up.
        reference: String,
    },
    /// The registry does not allow deleting manifests.
    #[error("Registry {registry} does not allow deleting {reference} (HTTP {status}): {detail}")]
    DeleteUnsupported {
        /// The registry host.
        registry: String,
        /// The reference to delete.
        reference: String,
        /// The HTTP status.
        status: u16,
        /// What the registry said.
        detail: String,
    },
    /// A registry request failed in oci-client.
    #[error("Registry {registry}: {what}")]
    Registry {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: OciDistributionError,
    },
    /// A registry request failed in the HTTP client.
    #[error("Registry {registry}: {what}")]
    Http {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: reqwest::Error,
    },
    /// The registry answered with an unexpected status.
    #[error("Registry {registry} answered HTTP {status} while {what}: {detail}")]
    Status {
        /// The registry host.
        registry: String,
        /// What was being done.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The body, shortened.
        detail: String,
    },
    /// The reference names something that is not an imp snapshot.
    #[error("{reference} is not an imp snapshot: {found}")]
    NotASnapshot {
        /// The reference.
        reference: String,
        /// What was found instead.
        found: String,
    },
    /// The snapshot uses a media type or format this agent cannot read.
    #[error("Snapshot {reference} uses {found}, which this agent cannot read")]
    Unsupported {
        /// The reference.
        reference: String,
        /// What it uses.
        found: String,
    },
    /// The snapshot's manifest or config is malformed or out of bounds.
    #[error("Snapshot {reference} is invalid: {reason}")]
    Invalid {
        /// The reference.
        reference: String,
        /// What is wrong.
        reason: String,
    },
    /// Content does not hash to the digest that names it.
    #[error("Digest mismatch for {what} of {reference}: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The reference.
        reference: String,
        /// Which blob or manifest.
        what: String,
        /// The digest it should have.
        expected: String,
        /// The digest it has.
        actual: String,
    },
    /// Downloading a blob failed part way (including oci-client's own digest check).
    #[error("Downloading {what} of {reference}")]
    Download {
        /// The reference.
        reference: String,
        /// Which blob.
        what: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// A chunk's compressed data cannot be decompressed to its declared length.
    #[error("Decompressing {what} of {reference}")]
    Decompress {
        /// The reference.
        reference: String,
        /// Which chunk.
        what: String,
        /// What the decoder found.
        #[source]
        source: io::Error,
    },
    /// A task on the blocking pool panicked or was cancelled.
    #[error("Background task for {what}")]
    Task {
        /// What it was doing.
        what: String,
        /// Why it ended.
        #[source]
        source: tokio::task::JoinError,
    },
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io { op, path, source }
}

/// How [`push_with`] cuts and uploads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushOptions {
    /// Bytes per chunk: a multiple of 4096, at most [`MAX_CHUNK_BYTES`].
    pub chunk_bytes: u64,
    /// Chunks read, compressed and uploaded at once (at least 1).
    pub in_flight: usize,
}

impl Default for PushOptions {
    fn default() -> Self {
        Self {
            chunk_bytes: CHUNK_BYTES,
            in_flight: IN_FLIGHT,
        }
    }
}

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushOutcome {
    /// The pushed reference with its digest: `registry/repository:tag@sha256:…`.
    pub reference: String,
    /// The manifest's digest, the name to pull it by.
    pub digest: String,
    /// Bytes sent: blobs the registry did not have already, and the manifest.
    pub bytes_uploaded: u64,
    /// Compressed bytes of every blob the artifact references (config and chunks).
    pub bytes_stored: u64,
    /// Uncompressed bytes of the chunks stored (the files' size less their zero chunks).
    pub bytes_data: u64,
    /// Chunks stored as layers.
    pub chunks: u32,
    /// Of those, chunks the registry already had (unchanged since an earlier push).
    pub chunks_reused: u32,
    /// Chunks not stored because they are all zero.
    pub holes: u32,
}

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullOutcome {
    /// The manifest's digest.
    pub digest: String,
    /// The snapshot's `snapshot.json`, as written into the directory.
    pub manifest: Manifest,
    /// Compressed bytes downloaded (chunks and config).
    pub bytes_downloaded: u64,
    /// Bytes written to the files (zero blocks are left as holes, not written).
    pub bytes_written: u64,
}

/// What a delete did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deleted {
    /// The manifest with this digest was deleted (with every tag naming it).
    Manifest {
        /// Its digest.
        digest: String,
    },
    /// There was nothing under the reference.
    Absent,
}

/// The credentials for `reference` from a `kubernetes.io/dockerconfigjson` Secret's
/// `.dockerconfigjson` (how `storage.ociRegistry.pullSecretRef` arrives); anonymous without one.
pub fn auth_for(reference: &str, dockerconfigjson: Option<&[u8]>) -> Result<RegistryAuth> {
    let Some(json) = dockerconfigjson else {
        return Ok(RegistryAuth::Anonymous);
    };
    let r = parse_reference(reference)?;
    auth_from_docker_config(json, r.registry()).map_err(|source| Error::Credentials {
        reference: reference.to_owned(),
        source: Box::new(source),
    })
}

/// A valid tag for execution `name`: characters outside `[A-Za-z0-9_.-]` become `-`, a leading
/// `.` or `-` gets a `_` before it, and a name over 128 characters is cut and given a hash suffix
/// so two long names stay distinct.
pub fn tag_for(name: &str) -> String {
    let mut tag: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if tag.is_empty() || tag.starts_with(['.', '-']) {
        tag.insert(0, '_');
    }
    if tag.len() > 128 {
        let hash = hex(&Sha256::digest(name.as_bytes()));
        tag.truncate(128 - 17);
        tag.push('-');
        tag.push_str(&hash[..16]);
    }
    tag
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn is_sha256(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

fn parse_reference(input: &str) -> Result<Reference> {
    input.parse::<Reference>().map_err(|e| Error::Reference {
        input: input.to_owned(),
        reason: e.to_string(),
    })
}

/// The reference to push to: `registry/repository:tag`, the tag written out (no default
/// `latest`) and no digest.
fn push_target(input: &str) -> Result<Reference> {
    let bad = |reason: &str| Error::Reference {
        input: input.to_owned(),
        reason: reason.to_owned(),
    };
    if input.contains('@') {
        return Err(bad("a push names a tag, not a digest"));
    }
    let last = input.rsplit('/').next().unwrap_or(input);
    if !input.contains('/') || !last.contains(':') {
        return Err(bad("expected registry/repository:tag"));
    }
    parse_reference(input)
}

// ---------------------------------------------------------------------------------------------
// Pure decisions: chunks, zeros, the manifest and its validation, challenges.

/// One chunk of a file to push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Planned {
    offset: u64,
    len: u64,
    /// False when the file system says the range is a hole: it is skipped without reading.
    may_hold_data: bool,
}

/// Cuts a file of `size` bytes into chunks of `chunk` bytes, marking those that no data range
/// (`[start, end)`, from `SEEK_DATA`) touches.
fn plan_chunks(size: u64, chunk: u64, data: &[(u64, u64)]) -> Vec<Planned> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    let mut offset = 0;
    while offset < size {
        let len = chunk.min(size - offset);
        let end = offset + len;
        let may_hold_data = data.iter().any(|&(s, e)| s < end && e > offset);
        out.push(Planned {
            offset,
            len,
            may_hold_data,
        });
        offset = end;
    }
    out
}

/// True when every byte is zero (checked a block at a time so it stops early and vectorises).
fn is_zero(bytes: &[u8]) -> bool {
    bytes
        .chunks(BLOCK)
        .all(|b| b.iter().fold(0u8, |acc, &x| acc | x) == 0)
}

/// The byte ranges of `bytes` to write, in `block`-sized steps: runs of blocks that are not all
/// zero, merged. What is left out stays a hole in a file created empty.
fn nonzero_runs(bytes: &[u8], block: usize) -> Vec<Range<usize>> {
    let block = block.max(1);
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, b) in bytes.chunks(block).enumerate() {
        if is_zero(b) {
            continue;
        }
        let start = i * block;
        let end = start + b.len();
        match runs.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => runs.push(start..end),
        }
    }
    runs
}

/// How a chunk's blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Codec {
    Gzip,
    Zstd,
}

impl Codec {
    fn of(media_type: &str) -> Option<Self> {
        match media_type {
            CHUNK_GZIP => Some(Self::Gzip),
            CHUNK_ZSTD => Some(Self::Zstd),
            _ => None,
        }
    }

    fn media_type(self) -> &'static str {
        match self {
            Self::Gzip => CHUNK_GZIP,
            Self::Zstd => CHUNK_ZSTD,
        }
    }
}

/// Compresses one chunk (gzip, fastest level; deterministic: no name, no time).
fn encode(data: &[u8]) -> io::Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(
        Vec::with_capacity(data.len() / 4),
        flate2::Compression::fast(),
    );
    gz.write_all(data)?;
    gz.finish()
}

/// Decompresses one chunk, refusing output that is not exactly `length` bytes without ever
/// holding more than `length + 1`.
fn decode(codec: Codec, data: &[u8], length: u64) -> io::Result<Vec<u8>> {
    let cap = usize::try_from(length).map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(cap);
    match codec {
        Codec::Gzip => {
            flate2::read::GzDecoder::new(data)
                .take(length + 1)
                .read_to_end(&mut out)?;
        }
        Codec::Zstd => {
            ruzstd::decoding::StreamingDecoder::new(data)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
                .take(length + 1)
                .read_to_end(&mut out)?;
        }
    }
    if out.len() as u64 != length {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} bytes decompressed, the layer says {length}",
                if out.len() as u64 > length {
                    format!("more than {length}")
                } else {
                    out.len().to_string()
                }
            ),
        ));
    }
    Ok(out)
}

/// The most a compressed chunk of `length` bytes can take (deflate's stored blocks cost 5 bytes
/// per 64 KiB, zstd's raw blocks 3 per 128 KiB; with room for headers).
fn max_compressed(length: u64) -> u64 {
    length + length / 1024 + 4096
}

/// An OCI descriptor as this module writes and reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Desc {
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

/// An OCI image manifest as this module writes and reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ManifestDoc {
    schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    media_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    artifact_type: Option<String>,
    config: Desc,
    #[serde(default)]
    layers: Vec<Desc>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

/// One stored chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chunk {
    offset: u64,
    length: u64,
    digest: String,
    size: u64,
    codec: Codec,
}

/// One file of the artifact: its size and its stored chunks, by offset.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileEntry {
    name: &'static str,
    size: u64,
    chunks: Vec<Chunk>,
}

/// A validated snapshot artifact.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Artifact {
    config_digest: String,
    config_size: u64,
    files: Vec<FileEntry>,
}

/// The manifest JSON of `artifact` (layers in file order, then offset order).
fn build_manifest(artifact: &Artifact, chunk_bytes: u64) -> Result<Vec<u8>, serde_json::Error> {
    let mut annotations = BTreeMap::new();
    annotations.insert(ANNOTATION_CHUNK_BYTES.to_owned(), chunk_bytes.to_string());
    let mut layers = Vec::new();
    for f in &artifact.files {
        annotations.insert(
            format!("{ANNOTATION_SIZE_PREFIX}{}", f.name),
            f.size.to_string(),
        );
        for c in &f.chunks {
            layers.push(Desc {
                media_type: c.codec.media_type().to_owned(),
                digest: c.digest.clone(),
                size: c.size,
                annotations: BTreeMap::from([
                    (ANNOTATION_FILE.to_owned(), f.name.to_owned()),
                    (ANNOTATION_OFFSET.to_owned(), c.offset.to_string()),
                    (ANNOTATION_LENGTH.to_owned(), c.length.to_string()),
                ]),
            });
        }
    }
    serde_json::to_vec(&ManifestDoc {
        schema_version: 2,
        media_type: Some(OCI_MANIFEST.to_owned()),
        artifact_type: Some(ARTIFACT_TYPE.to_owned()),
        config: Desc {
            media_type: CONFIG_MEDIA_TYPE.to_owned(),
            digest: artifact.config_digest.clone(),
            size: artifact.config_size,
            annotations: BTreeMap::new(),
        },
        layers,
        annotations,
    })
}

/// Reads and checks a manifest: that it is an imp snapshot of a kind this agent reads, and that
/// every size, offset and digest in it is in bounds. `reference` names it in errors.
fn parse_artifact(reference: &str, bytes: &[u8]) -> Result<Artifact> {
    let why = Refusal { reference };
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| why.not_snapshot(format!("its manifest is not JSON ({e})")))?;
    check_artifact_type(&value, why)?;
    let doc: ManifestDoc = serde_json::from_value(value)
        .map_err(|e| why.invalid(format!("manifest does not parse: {e}")))?;
    check_config_desc(&doc, why)?;
    let mut files = file_entries(&doc.annotations, why)?;
    for (i, layer) in doc.layers.iter().enumerate() {
        let (file, chunk) = layer_chunk(i, layer, &files, why)?;
        files[file].chunks.push(chunk);
    }
    sort_chunks(&mut files, why)?;
    Ok(Artifact {
        config_digest: doc.config.digest,
        config_size: doc.config.size,
        files,
    })
}

/// The errors a manifest of `reference` is refused with.
#[derive(Debug, Clone, Copy)]
struct Refusal<'a> {
    reference: &'a str,
}

impl Refusal<'_> {
    /// Not an imp snapshot at all.
    fn not_snapshot(self, found: String) -> Error {
        Error::NotASnapshot {
            reference: self.reference.to_owned(),
            found,
        }
    }

    /// An imp snapshot (or OCI feature) this agent does not read.
    fn unsupported(self, found: String) -> Error {
        Error::Unsupported {
            reference: self.reference.to_owned(),
            found,
        }
    }

    /// An imp snapshot whose manifest is broken or out of bounds.
    fn invalid(self, reason: String) -> Error {
        Error::Invalid {
            reference: self.reference.to_owned(),
            reason,
        }
    }
}

/// Checks the manifest's media type and `artifactType` before anything else is read, so
/// something that is no imp snapshot is named as such.
fn check_artifact_type(value: &serde_json::Value, why: Refusal<'_>) -> Result<()> {
    let text = |k: &str| value.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    let media_type = text("mediaType");
    if media_type.as_deref().is_some_and(|m| m != OCI_MANIFEST) {
        return Err(why.not_snapshot(format!(
            "manifest media type {:?}",
            media_type.unwrap_or_default()
        )));
    }
    let config_type = value
        .get("config")
        .and_then(|c| c.get("mediaType"))
        .and_then(|m| m.as_str())
        .map(str::to_owned);
    match text("artifactType") {
        Some(t) if t == ARTIFACT_TYPE => Ok(()),
        Some(t) if t.starts_with("application/vnd.imp.snapshot.") => {
            Err(why.unsupported(format!("artifactType {t:?}")))
        }
        Some(t) => Err(why.not_snapshot(format!("artifactType {t:?}"))),
        None => Err(why.not_snapshot(format!(
            "no artifactType (config media type {:?})",
            config_type.unwrap_or_default()
        ))),
    }
}

/// Checks the schema version and the config's descriptor: media type, digest and size.
fn check_config_desc(doc: &ManifestDoc, why: Refusal<'_>) -> Result<()> {
    if doc.schema_version != 2 {
        return Err(why.unsupported(format!("schemaVersion {}", doc.schema_version)));
    }
    if doc.config.media_type != CONFIG_MEDIA_TYPE {
        return Err(why.unsupported(format!("config media type {:?}", doc.config.media_type)));
    }
    check_digest(&doc.config.digest, "the config", why)?;
    if doc.config.size > MAX_CONFIG_BYTES {
        return Err(why.invalid(format!(
            "config of {} bytes is over the limit of {MAX_CONFIG_BYTES}",
            doc.config.size
        )));
    }
    Ok(())
}

/// The artifact's files (each of [`FILES`], in that order, no other) with the sizes the
/// manifest's annotations give them, their chunks still to be added.
fn file_entries(
    annotations: &BTreeMap<String, String>,
    why: Refusal<'_>,
) -> Result<Vec<FileEntry>> {
    let mut files = Vec::new();
    for name in FILES {
        let key = format!("{ANNOTATION_SIZE_PREFIX}{name}");
        let size = annotations
            .get(&key)
            .ok_or_else(|| why.invalid(format!("annotation {key} is missing")))?;
        let size: u64 = size
            .parse()
            .map_err(|_| why.invalid(format!("annotation {key} is {size:?}, not a size")))?;
        if size > MAX_FILE_BYTES {
            return Err(why.invalid(format!(
                "{name} of {size} bytes is over the limit of {MAX_FILE_BYTES}"
            )));
        }
        files.push(FileEntry {
            name,
            size,
            chunks: Vec::new(),
        });
    }
    if let Some(k) = annotations
        .keys()
        .filter_map(|k| k.strip_prefix(ANNOTATION_SIZE_PREFIX))
        .find(|f| !FILES.contains(f))
    {
        return Err(why.unsupported(format!("a file named {k:?}")));
    }
    Ok(files)
}

/// Reads layer `i` as a chunk of one of `files`: its codec, digest and annotations, its range
/// inside the file and its compressed size all in bounds. Returns the file's index and the chunk.
fn layer_chunk(
    i: usize,
    layer: &Desc,
    files: &[FileEntry],
    why: Refusal<'_>,
) -> Result<(usize, Chunk)> {
    let what = format!("layer {i} ({})", layer.digest);
    let codec = Codec::of(&layer.media_type)
        .ok_or_else(|| why.unsupported(format!("{what} of media type {:?}", layer.media_type)))?;
    check_digest(&layer.digest, &what, why)?;
    let ann = |k: &str| {
        layer
            .annotations
            .get(k)
            .ok_or_else(|| why.invalid(format!("{what} has no annotation {k}")))
    };
    let file = ann(ANNOTATION_FILE)?;
    let num = |k: &str| -> Result<u64> {
        let v = ann(k)?;
        v.parse()
            .map_err(|_| why.invalid(format!("{what}: annotation {k} is {v:?}, not a number")))
    };
    let (offset, length) = (num(ANNOTATION_OFFSET)?, num(ANNOTATION_LENGTH)?);
    let index = files
        .iter()
        .position(|f| f.name == file.as_str())
        .ok_or_else(|| why.unsupported(format!("{what} for a file named {file:?}")))?;
    let entry = &files[index];
    if length == 0 || length > MAX_CHUNK_BYTES {
        return Err(why.invalid(format!(
            "{what} has length {length}, outside 1..={MAX_CHUNK_BYTES}"
        )));
    }
    if offset
        .checked_add(length)
        .is_none_or(|end| end > entry.size)
    {
        return Err(why.invalid(format!(
            "{what} covers {offset}+{length}, past the end of {file} ({} bytes)",
            entry.size
        )));
    }
    if layer.size == 0 || layer.size > max_compressed(length) {
        return Err(why.invalid(format!(
            "{what} is {} bytes compressed for {length} bytes of data",
            layer.size
        )));
    }
    let chunk = Chunk {
        offset,
        length,
        digest: layer.digest.clone(),
        size: layer.size,
        codec,
    };
    Ok((index, chunk))
}

/// Puts each file's chunks in offset order and refuses overlapping ones.
fn sort_chunks(files: &mut [FileEntry], why: Refusal<'_>) -> Result<()> {
    for f in files {
        f.chunks.sort_by_key(|c| c.offset);
        if let Some(w) = f
            .chunks
            .windows(2)
            .find(|w| w[0].offset + w[0].length > w[1].offset)
        {
            return Err(why.invalid(format!(
                "chunks of {} at {} and {} overlap",
                f.name, w[0].offset, w[1].offset
            )));
        }
    }
    Ok(())
}

/// Checks a digest is `sha256:<64 hex>`: a malformed one is invalid, another algorithm is
/// unsupported.
fn check_digest(digest: &str, what: &str, why: Refusal<'_>) -> Result<()> {
    if is_sha256(digest) {
        return Ok(());
    }
    if digest.starts_with("sha256:") || !digest.contains(':') {
        return Err(why.invalid(format!("{what} has a malformed digest {digest:?}")));
    }
    Err(why.unsupported(format!("a digest algorithm in {digest:?}")))
}

/// Checks a config blob: its `format` first (so a newer agent's snapshot is named as such), then
/// the whole [`Manifest`].
fn parse_config(reference: &str, bytes: &[u8]) -> Result<Manifest> {
    let invalid = |reason: String| Error::Invalid {
        reference: reference.to_owned(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| invalid(format!("config is not JSON: {e}")))?;
    match value.get("format").and_then(serde_json::Value::as_u64) {
        Some(f) if f == u64::from(FORMAT) => {}
        Some(f) => {
            return Err(Error::Unsupported {
                reference: reference.to_owned(),
                found: format!("snapshot format {f} (not {FORMAT})"),
            });
        }
        None => return Err(invalid("config has no numeric format".into())),
    }
    serde_json::from_value(value).map_err(|e| invalid(format!("config does not parse: {e}")))
}

/// A `WWW-Authenticate` challenge this module can answer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

/// Parses the first challenge of a `WWW-Authenticate` header value.
fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, rest) = header
        .split_once(char::is_whitespace)
        .unwrap_or((header, ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let params = parse_params(rest);
    Some(Challenge::Bearer {
        realm: params.get("realm")?.clone(),
        service: params.get("service").cloned(),
    })
}

/// `k=v, k="quoted, \"v\""` pairs, keys lowercased.
fn parse_params(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace() || *c == ',').is_some() {}
        let key: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != ','))
            .collect::<String>()
            .trim()
            .to_ascii_lowercase();
        if key.is_empty() && chars.peek().is_none() {
            return out;
        }
        if chars.next_if_eq(&'=').is_none() {
            continue;
        }
        let value = if chars.next_if_eq(&'"').is_some() {
            let mut v = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => v.extend(chars.next()),
                    '"' => break,
                    c => v.push(c),
                }
            }
            v
        } else {
            std::iter::from_fn(|| chars.next_if(|c| *c != ','))
                .collect::<String>()
                .trim()
                .to_owned()
        };
        if !key.is_empty() {
            out.insert(key, value);
        }
    }
}

/// Whether credentials may be sent to a token `realm`: HTTPS, or plain HTTP on loopback.
fn realm_allowed(realm: &reqwest::Url) -> bool {
    match realm.scheme() {
        "https" => true,
        "http" => realm.host_str().is_some_and(is_loopback_registry),
        _ => false,
    }
}

/// What a DELETE's answer means.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DeleteVerdict {
    Deleted,
    Absent,
    Unsupported,
    Unauthorized,
    Forbidden,
    Other,
}

/// Reads a DELETE's status and OCI error body.
fn delete_verdict(status: u16, body: &str) -> DeleteVerdict {
    let code = |c: &str| body.contains(&format!("\"{c}\""));
    match status {
        200..=299 => DeleteVerdict::Deleted,
        404 => DeleteVerdict::Absent,
        405 => DeleteVerdict::Unsupported,
        401 => DeleteVerdict::Unauthorized,
        403 => DeleteVerdict::Forbidden,
        _ if code("UNSUPPORTED") => DeleteVerdict::Unsupported,
        _ => DeleteVerdict::Other,
    }
}

fn shorten(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

// ---------------------------------------------------------------------------------------------
// Registry errors.

/// What an oci-client error means here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Unauthorized,
    Forbidden,
    NotFound,
    Other,
}

fn kind_of(e: &OciDistributionError) -> Kind {
    let by_status = |s: u16| match s {
        401 => Kind::Unauthorized,
        403 => Kind::Forbidden,
        404 => Kind::NotFound,
        _ => Kind::Other,
    };
    match e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => Kind::Unauthorized,
        OciDistributionError::ImageManifestNotFoundError(_) => Kind::NotFound,
        OciDistributionError::ServerError { code, .. } => by_status(*code),
        OciDistributionError::RequestError(r) => {
            r.status().map_or(Kind::Other, |s| by_status(s.as_u16()))
        }
        OciDistributionError::RegistryError { envelope, .. } => {
            let has = |c: OciErrorCode| envelope.errors.iter().any(|e| e.code == c);
            if has(OciErrorCode::Unauthorized) {
                Kind::Unauthorized
            } else if has(OciErrorCode::Denied) {
                Kind::Forbidden
            } else if has(OciErrorCode::ManifestUnknown)
                || has(OciErrorCode::NameUnknown)
                || has(OciErrorCode::NotFound)
            {
                Kind::NotFound
            } else {
                Kind::Other
            }
        }
        _ => Kind::Other,
    }
}

/// Maps an oci-client error; `reference` is given where a 404 means "no such snapshot".
fn registry_error(
    registry: &str,
    what: String,
    reference: Option<&str>,
    e: OciDistributionError,
) -> Error {
    match (kind_of(&e), reference) {
        (Kind::Unauthorized, _) => Error::Unauthorized {
            registry: registry.to_owned(),
            what,
            detail: shorten(&e.to_string()),
        },
        (Kind::Forbidden, _) => Error::Forbidden {
            registry: registry.to_owned(),
            what,
            detail: shorten(&e.to_string()),
        },
        (Kind::NotFound, Some(r)) => Error::NotFound {
            registry: registry.to_owned(),
            reference: r.to_owned(),
        },
        _ => Error::Registry {
            registry: registry.to_owned(),
            what,
            source: e,
        },
    }
}

// ---------------------------------------------------------------------------------------------
// The registry session.

/// One operation's client, reference and credentials.
struct Session {
    client: Client,
    reference: Reference,
    /// The reference as the caller wrote it, for messages.
    input: String,
    auth: oci_client::secrets::RegistryAuth,
}

impl Session {
    fn new(reference: Reference, input: &str, auth: &RegistryAuth) -> Self {
        install_crypto_provider();
        let registry = reference.resolve_registry().to_owned();
        let protocol = if is_loopback_registry(&registry) {
            ClientProtocol::HttpsExcept(vec![registry])
        } else {
            ClientProtocol::Https
        };
        let config = ClientConfig {
            protocol,
            platform_resolver: None,
            // One PUT per blob: chunks are small enough, and it halves the round trips.
            use_monolithic_push: true,
            connect_timeout: Some(Duration::from_secs(30)),
            read_timeout: Some(Duration::from_secs(300)),
            ..ClientConfig::default()
        };
        Self {
            client: Client::new(config),
            reference,
            input: input.to_owned(),
            auth: auth.into(),
        }
    }

    fn registry(&self) -> &str {
        self.reference.registry()
    }

    fn fail(&self, what: String) -> impl FnOnce(OciDistributionError) -> Error + '_ {
        move |e| registry_error(self.registry(), what, None, e)
    }

    /// The manifest under the reference, its bytes checked against its digest and bounded.
    async fn manifest(&self) -> Result<(Vec<u8>, String)> {
        let (bytes, header_digest) = self
            .client
            .pull_manifest_raw(&self.reference, &self.auth, ACCEPT)
            .await
            .map_err(|e| {
                registry_error(
                    self.registry(),
                    format!("fetching manifest {}", self.input),
                    Some(&self.input),
                    e,
                )
            })?;
        if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
            return Err(Error::Invalid {
                reference: self.input.clone(),
                reason: format!(
                    "manifest of {} bytes is over the limit of {MAX_DOCUMENT_BYTES}",
                    bytes.len()
                ),
            });
        }
        let actual = sha256(&bytes);
        let expected = self.reference.digest().unwrap_or(&header_digest);
        if expected != actual {
            return Err(Error::DigestMismatch {
                reference: self.input.clone(),
                what: "the manifest".into(),
                expected: expected.to_owned(),
                actual,
            });
        }
        Ok((bytes.to_vec(), actual))
    }

    /// Downloads blob `digest` of `size` bytes into memory and checks its digest.
    async fn blob(&self, media_type: &str, digest: &str, size: u64, what: &str) -> Result<Bytes> {
        let desc = OciDescriptor {
            media_type: media_type.to_owned(),
            digest: digest.to_owned(),
            size: i64::try_from(size).unwrap_or(i64::MAX),
            ..OciDescriptor::default()
        };
        let mut stream = self
            .client
            .pull_blob_stream(&self.reference, &desc)
            .await
            .map_err(self.fail(format!("fetching {what} of {}", self.input)))?;
        let mut buf = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        // Hashed piece by piece as it arrives, so no long hash blocks the runtime.
        let mut hasher = Sha256::new();
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(|source| Error::Download {
                reference: self.input.clone(),
                what: what.to_owned(),
                source,
            })?;
            if (buf.len() + piece.len()) as u64 > size {
                return Err(Error::Invalid {
                    reference: self.input.clone(),
                    reason: format!("{what} is larger than the {size} bytes its descriptor says"),
                });
            }
            hasher.update(&piece);
            buf.extend_from_slice(&piece);
        }
        let actual = format!("sha256:{}", hex(&hasher.finalize()));
        if actual != digest || buf.len() as u64 != size {
            return Err(Error::DigestMismatch {
                reference: self.input.clone(),
                what: what.to_owned(),
                expected: format!("{digest} ({size} bytes)"),
                actual: format!("{actual} ({} bytes)", buf.len()),
            });
        }
        Ok(Bytes::from(buf))
    }

    /// Uploads `data` as blob `digest` unless the registry has it; true when uploaded.
    async fn put_blob(&self, data: Bytes, digest: &str, what: &str) -> Result<bool> {
        let exists = self
            .client
            .blob_exists(&self.reference, digest)
            .await
            .map_err(self.fail(format!("checking for {what} in {}", self.input)))?;
        if exists {
            return Ok(false);
        }
        self.client
            .push_blob(&self.reference, data, digest)
            .await
            .map_err(self.fail(format!("uploading {what} to {}", self.input)))?;
        Ok(true)
    }
}

// ---------------------------------------------------------------------------------------------
// Push.

/// A file of the directory being pushed.
struct Source {
    name: &'static str,
    path: PathBuf,
    file: Arc<File>,
    size: u64,
}

/// A chunk read and compressed, ready to upload.
struct Prepared {
    data: Bytes,
    digest: String,
}

/// What became of one planned chunk.
enum ChunkResult {
    Hole,
    Stored { chunk: Chunk, uploaded: bool },
}

/// Pushes the snapshot directory `dir` to `reference` (`registry/repository:tag`) with the
/// default [`PushOptions`].
pub async fn push(dir: &Path, reference: &str, auth: &RegistryAuth) -> Result<PushOutcome> {
    push_with(dir, reference, auth, PushOptions::default()).await
}

/// Pushes the snapshot directory `dir` to `reference` as described in the module docs. The
/// directory must not change while it is pushed.
pub async fn push_with(
    dir: &Path,
    reference: &str,
    auth: &RegistryAuth,
    options: PushOptions,
) -> Result<PushOutcome> {
    check_push_options(&options)?;
    let target = push_target(reference)?;
    let started = std::time::Instant::now();

    let config_path = dir.join(MANIFEST);
    let config = read_config(dir, &config_path).await?;
    let sources = open_sources(dir).await?;
    let plans = plan_sources(&sources, options.chunk_bytes).await?;
    check_manifest_room(&plans, options.chunk_bytes)?;

    let session = Session::new(target, reference, auth);
    session
        .client
        .auth(&session.reference, &session.auth, RegistryOperation::Push)
        .await
        .map_err(session.fail(format!("authenticating to push {reference}")))?;

    let session = &session;
    let sources = &sources;
    let results: Vec<(usize, ChunkResult)> = stream::iter(plans)
        .map(
            |(i, plan)| async move { push_chunk(session, &sources[i], plan).await.map(|r| (i, r)) },
        )
        .buffered(options.in_flight)
        .try_collect()
        .await?;

    let files = sources
        .iter()
        .map(|s| FileEntry {
            name: s.name,
            size: s.size,
            chunks: Vec::new(),
        })
        .collect();
    let (mut outcome, files) = tally(files, results, config.len() as u64);
    let config_digest = sha256(&config);
    let config_len = config.len() as u64;
    if session
        .put_blob(Bytes::from(config), &config_digest, "the config")
        .await?
    {
        outcome.bytes_uploaded += config_len;
    }
    let artifact = Artifact {
        config_digest,
        config_size: config_len,
        files,
    };
    let (digest, manifest_bytes) =
        push_manifest(session, reference, &artifact, options.chunk_bytes).await?;
    outcome.bytes_uploaded += manifest_bytes;
    outcome.reference = format!("{}@{digest}", session.reference.whole());
    outcome.digest = digest;
    tracing::info!(
        reference = %outcome.reference,
        chunks = outcome.chunks,
        reused = outcome.chunks_reused,
        holes = outcome.holes,
        bytes_uploaded = outcome.bytes_uploaded,
        bytes_data = outcome.bytes_data,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "snapshot pushed"
    );
    Ok(outcome)
}

/// Refuses options a push cannot use: chunks must be whole blocks up to [`MAX_CHUNK_BYTES`],
/// and at least one chunk must be in flight.
fn check_push_options(options: &PushOptions) -> Result<()> {
    if options.chunk_bytes == 0
        || !options.chunk_bytes.is_multiple_of(BLOCK as u64)
        || options.chunk_bytes > MAX_CHUNK_BYTES
        || options.in_flight == 0
    {
        return Err(Error::Options {
            reason: format!(
                "chunk_bytes {} must be a multiple of {BLOCK} up to {MAX_CHUNK_BYTES}, in_flight {} at least 1",
                options.chunk_bytes, options.in_flight
            ),
        });
    }
    Ok(())
}

/// The chunks of every source, each with its source's index, planned from the data ranges
/// the file system reports (read on a blocking thread).
async fn plan_sources(sources: &[Source], chunk_bytes: u64) -> Result<Vec<(usize, Planned)>> {
    let mut plans = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        let file = s.file.clone();
        let path = s.path.clone();
        let ranges = tokio::task::spawn_blocking(move || super::sparse::data_ranges(&file))
            .await
            .map_err(|source| Error::Task {
                what: format!("finding the data of {path:?}"),
                source,
            })?
            .map_err(io_err("Finding the data ranges of", &s.path))?;
        plans.extend(
            plan_chunks(s.size, chunk_bytes, &ranges)
                .into_iter()
                .map(|p| (i, p)),
        );
    }
    Ok(plans)
}

/// Refuses a push whose manifest could grow past what a registry (and a pull) accepts: every
/// chunk that may hold data may become a layer.
fn check_manifest_room(plans: &[(usize, Planned)], chunk_bytes: u64) -> Result<()> {
    let candidates = plans.iter().filter(|(_, p)| p.may_hold_data).count() as u64;
    if candidates * LAYER_JSON_BYTES + 4096 > MAX_DOCUMENT_BYTES {
        return Err(Error::Options {
            reason: format!(
                "{candidates} chunks of {chunk_bytes} bytes would need a manifest over {MAX_DOCUMENT_BYTES} bytes; use larger chunks"
            ),
        });
    }
    Ok(())
}

/// Adds the chunks pushed to their `files` (by index, in plan order) and counts them: the
/// outcome so far (reference, digest and the config's and manifest's uploads still to fill
/// in) with `config_bytes` already stored.
fn tally(
    mut files: Vec<FileEntry>,
    results: Vec<(usize, ChunkResult)>,
    config_bytes: u64,
) -> (PushOutcome, Vec<FileEntry>) {
    let mut outcome = PushOutcome {
        reference: String::new(),
        digest: String::new(),
        bytes_uploaded: 0,
        bytes_stored: config_bytes,
        bytes_data: 0,
        chunks: 0,
        chunks_reused: 0,
        holes: 0,
    };
    for (i, r) in results {
        match r {
            ChunkResult::Hole => outcome.holes += 1,
            ChunkResult::Stored { chunk, uploaded } => {
                outcome.chunks += 1;
                outcome.bytes_stored += chunk.size;
                outcome.bytes_data += chunk.length;
                if uploaded {
                    outcome.bytes_uploaded += chunk.size;
                } else {
                    outcome.chunks_reused += 1;
                }
                files[i].chunks.push(chunk);
            }
        }
    }
    (outcome, files)
}

/// Pushes the manifest of `artifact` (its blobs already uploaded) under the session's tag;
/// returns its digest and its size in bytes.
async fn push_manifest(
    session: &Session,
    reference: &str,
    artifact: &Artifact,
    chunk_bytes: u64,
) -> Result<(String, u64)> {
    let manifest = build_manifest(artifact, chunk_bytes).map_err(|e| Error::Invalid {
        reference: reference.to_owned(),
        reason: format!("serialising the manifest: {e}"),
    })?;
    let digest = sha256(&manifest);
    let len = manifest.len() as u64;
    let content_type = http::HeaderValue::from_static(OCI_MANIFEST);
    session
        .client
        .push_manifest_raw(&session.reference, manifest, content_type)
        .await
        .map_err(session.fail(format!("pushing the manifest of {reference}")))?;
    Ok((digest, len))
}

/// Reads `snapshot.json` and checks it is a snapshot manifest of [`FORMAT`].
async fn read_config(dir: &Path, path: &Path) -> Result<Vec<u8>> {
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(io_err("Reading the snapshot manifest", path))?;
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(Error::Directory {
            dir: dir.to_path_buf(),
            reason: format!(
                "{MANIFEST} is {} bytes, over {MAX_CONFIG_BYTES}",
                meta.len()
            ),
        });
    }
    let bytes = tokio::fs::read(path)
        .await
        .map_err(io_err("Reading the snapshot manifest", path))?;
    match serde_json::from_slice::<Manifest>(&bytes) {
        Ok(m) if m.format == FORMAT => Ok(bytes),
        Ok(m) => Err(Error::Directory {
            dir: dir.to_path_buf(),
            reason: format!("{MANIFEST} has format {}, not {FORMAT}", m.format),
        }),
        Err(e) => Err(Error::Directory {
            dir: dir.to_path_buf(),
            reason: format!("{MANIFEST} does not parse: {e}"),
        }),
    }
}

/// Opens every file of [`FILES`]; each must be a regular file.
async fn open_sources(dir: &Path) -> Result<Vec<Source>> {
    let mut out = Vec::new();
    for name in FILES {
        let path = dir.join(name);
        let p = path.clone();
        let opened =
            tokio::task::spawn_blocking(move || -> io::Result<(File, std::fs::Metadata)> {
                let f = File::open(&p)?;
                let m = f.metadata()?;
                Ok((f, m))
            })
            .await
            .map_err(|source| Error::Task {
                what: format!("opening {path:?}"),
                source,
            })?;
        let (file, meta) = match opened {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Error::Directory {
                    dir: dir.to_path_buf(),
                    reason: format!("{name} is missing"),
                });
            }
            Err(e) => return Err(io_err("Opening", &path)(e)),
        };
        if !meta.is_file() {
            return Err(Error::Directory {
                dir: dir.to_path_buf(),
                reason: format!("{name} is not a regular file"),
            });
        }
        if meta.len() > MAX_FILE_BYTES {
            return Err(Error::Directory {
                dir: dir.to_path_buf(),
                reason: format!("{name} is {} bytes, over {MAX_FILE_BYTES}", meta.len()),
            });
        }
        out.push(Source {
            name,
            path,
            file: Arc::new(file),
            size: meta.len(),
        });
    }
    Ok(out)
}

/// Reads, checks, compresses and uploads one chunk.
async fn push_chunk(session: &Session, src: &Source, plan: Planned) -> Result<ChunkResult> {
    if !plan.may_hold_data {
        return Ok(ChunkResult::Hole);
    }
    let (file, path) = (src.file.clone(), src.path.clone());
    let prepared = tokio::task::spawn_blocking(move || prepare(&file, &path, plan))
        .await
        .map_err(|source| Error::Task {
            what: format!("reading {}@{}", src.name, plan.offset),
            source,
        })??;
    let Some(prepared) = prepared else {
        return Ok(ChunkResult::Hole);
    };
    let size = prepared.data.len() as u64;
    let what = format!("chunk {}@{}", src.name, plan.offset);
    let uploaded = session
        .put_blob(prepared.data, &prepared.digest, &what)
        .await?;
    tracing::debug!(
        file = src.name,
        offset = plan.offset,
        size,
        uploaded,
        "snapshot chunk"
    );
    Ok(ChunkResult::Stored {
        chunk: Chunk {
            offset: plan.offset,
            length: plan.len,
            digest: prepared.digest,
            size,
            codec: Codec::Gzip,
        },
        uploaded,
    })
}

/// Blocking: reads a chunk; `None` when it is all zero, else its compressed bytes and digest.
fn prepare(file: &File, path: &Path, plan: Planned) -> Result<Option<Prepared>> {
    let len =
        usize::try_from(plan.len).map_err(|e| io_err("Reading", path)(io::Error::other(e)))?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, plan.offset)
        .map_err(io_err("Reading", path))?;
    if is_zero(&buf) {
        return Ok(None);
    }
    let compressed = encode(&buf).map_err(io_err("Compressing a chunk of", path))?;
    drop(buf);
    let digest = sha256(&compressed);
    Ok(Some(Prepared {
        data: Bytes::from(compressed),
        digest,
    }))
}

// ---------------------------------------------------------------------------------------------
// Pull.

/// A file being written by a pull.
struct Target {
    name: &'static str,
    partial: PathBuf,
    file: Arc<File>,
}

/// Pulls the snapshot `reference` (`registry/repository:tag` or `…@sha256:…`) into `dest`
/// (created if needed): every blob verified, files written sparse, `snapshot.json` written last,
/// so a directory with a `snapshot.json` is complete. Refuses anything that is not a snapshot
/// this agent can read.
pub async fn pull(reference: &str, dest: &Path, auth: &RegistryAuth) -> Result<PullOutcome> {
    let parsed = parse_reference(reference)?;
    let session = Session::new(parsed, reference, auth);
    let started = std::time::Instant::now();
    let (bytes, digest) = session.manifest().await?;
    let artifact = parse_artifact(reference, &bytes)?;
    let config = session
        .blob(
            CONFIG_MEDIA_TYPE,
            &artifact.config_digest,
            artifact.config_size,
            "the config",
        )
        .await?;
    let manifest = parse_config(reference, &config)?;

    // Owner-only: the snapshot holds its source VM's memory and environment (Secrets).
    let d = dest.to_path_buf();
    tokio::task::spawn_blocking(move || crate::host_fs::create_private_dir_all(&d))
        .await
        .map_err(io::Error::other)
        .and_then(|r| r)
        .map_err(io_err("Creating the snapshot directory", dest))?;
    let final_manifest = dest.join(MANIFEST);
    match tokio::fs::remove_file(&final_manifest).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err(
                "Removing the old snapshot manifest",
                &final_manifest,
            )(e));
        }
        _ => {}
    }
    let mut targets = Vec::new();
    let result = pull_files(&session, &artifact, dest, &mut targets).await;
    let result = match result {
        Ok(counts) => finish(dest, &targets, &config).await.map(|()| counts),
        Err(e) => Err(e),
    };
    let (bytes_downloaded, bytes_written) = match result {
        Ok(c) => c,
        Err(e) => {
            for t in &targets {
                let _ = tokio::fs::remove_file(&t.partial).await;
            }
            return Err(e);
        }
    };
    let outcome = PullOutcome {
        digest,
        manifest,
        bytes_downloaded: bytes_downloaded + config.len() as u64,
        bytes_written,
    };
    tracing::info!(
        reference,
        digest = %outcome.digest,
        bytes_downloaded = outcome.bytes_downloaded,
        bytes_written = outcome.bytes_written,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "snapshot pulled"
    );
    Ok(outcome)
}

/// Creates the partial files at their sizes and fills in every chunk; returns (bytes
/// downloaded, bytes written).
async fn pull_files(
    session: &Session,
    artifact: &Artifact,
    dest: &Path,
    targets: &mut Vec<Target>,
) -> Result<(u64, u64)> {
    for f in &artifact.files {
        let partial = dest.join(format!(".{}.partial", f.name));
        let p = partial.clone();
        let size = f.size;
        let file = tokio::task::spawn_blocking(move || -> io::Result<File> {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&p)?;
            file.set_len(size)?;
            Ok(file)
        })
        .await
        .map_err(|source| Error::Task {
            what: format!("creating {partial:?}"),
            source,
        })?
        .map_err(io_err("Creating", &partial))?;
        targets.push(Target {
            name: f.name,
            partial,
            file: Arc::new(file),
        });
    }
    // Owned jobs: a borrowing iterator here makes the future `Send` for one lifetime only,
    // and a caller inside a kube Controller needs it for every one.
    let jobs: Vec<(usize, Chunk)> = artifact
        .files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| f.chunks.iter().map(move |c| (i, c.clone())))
        .collect();
    let targets = &targets;
    let counts: Vec<(u64, u64)> = stream::iter(jobs)
        .map(|(i, c)| async move { pull_chunk(session, &targets[i], &c).await })
        .buffered(IN_FLIGHT)
        .try_collect()
        .await?;
    Ok(counts
        .iter()
        .fold((0, 0), |(d, w), (cd, cw)| (d + cd, w + cw)))
}

/// Downloads, checks, decompresses and writes one chunk; returns (downloaded, written).
async fn pull_chunk(session: &Session, t: &Target, c: &Chunk) -> Result<(u64, u64)> {
    let what = format!("chunk {}@{} ({})", t.name, c.offset, c.digest);
    let data = session
        .blob(c.codec.media_type(), &c.digest, c.size, &what)
        .await?;
    let (file, path, chunk, reference) = (
        t.file.clone(),
        t.partial.clone(),
        c.clone(),
        session.input.clone(),
    );
    let written = tokio::task::spawn_blocking(move || -> Result<u64> {
        let plain =
            decode(chunk.codec, &data, chunk.length).map_err(|source| Error::Decompress {
                reference,
                what,
                source,
            })?;
        drop(data);
        let mut written = 0;
        for run in nonzero_runs(&plain, BLOCK) {
            file.write_all_at(&plain[run.clone()], chunk.offset + run.start as u64)
                .map_err(io_err("Writing", &path))?;
            written += run.len() as u64;
        }
        Ok(written)
    })
    .await
    .map_err(|source| Error::Task {
        what: format!("writing {}@{}", t.name, c.offset),
        source,
    })??;
    Ok((c.size, written))
}

/// Syncs and renames the partial files into place, then writes `snapshot.json`.
async fn finish(dest: &Path, targets: &[Target], config: &[u8]) -> Result<()> {
    for t in targets {
        let file = t.file.clone();
        tokio::task::spawn_blocking(move || file.sync_all())
            .await
            .map_err(|source| Error::Task {
                what: format!("syncing {:?}", t.partial),
                source,
            })?
            .map_err(io_err("Syncing", &t.partial))?;
        let to = dest.join(t.name);
        tokio::fs::rename(&t.partial, &to)
            .await
            .map_err(io_err("Moving into place", &to))?;
    }
    let tmp = dest.join(format!(".{MANIFEST}.partial"));
    let config = config.to_vec();
    let t = tmp.clone();
    tokio::task::spawn_blocking(move || -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&t)?;
        f.write_all(&config)?;
        f.sync_all()
    })
    .await
    .map_err(|source| Error::Task {
        what: format!("writing {tmp:?}"),
        source,
    })?
    .map_err(io_err("Writing", &tmp))?;
    let to = dest.join(MANIFEST);
    tokio::fs::rename(&tmp, &to)
        .await
        .map_err(io_err("Moving into place", &to))
}

// ---------------------------------------------------------------------------------------------
// Delete.

/// Deletes the snapshot `reference` (its manifest, by digest, and so every tag naming it) for
/// retention pruning; [`Deleted::Absent`] when there is nothing there. Refuses to delete what is
/// not an imp snapshot, and says so when the registry does not allow deletion.
pub async fn delete(reference: &str, auth: &RegistryAuth) -> Result<Deleted> {
    let parsed = parse_reference(reference)?;
    let session = Session::new(parsed, reference, auth);
    let (bytes, digest) = match session.manifest().await {
        Ok(x) => x,
        Err(Error::NotFound { .. }) => return Ok(Deleted::Absent),
        Err(e) => return Err(e),
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::NotASnapshot {
            reference: reference.to_owned(),
            found: format!("its manifest is not JSON ({e})"),
        })?;
    match value.get("artifactType").and_then(|v| v.as_str()) {
        Some(t) if t.starts_with("application/vnd.imp.snapshot.") => {}
        other => {
            return Err(Error::NotASnapshot {
                reference: reference.to_owned(),
                found: match other {
                    Some(t) => format!("artifactType {t:?}; not deleting it"),
                    None => "no artifactType; not deleting it".into(),
                },
            });
        }
    }

    let registry = session.reference.resolve_registry().to_owned();
    let scheme = if is_loopback_registry(&registry) {
        "http"
    } else {
        "https"
    };
    let url = format!(
        "{scheme}://{registry}/v2/{}/manifests/{digest}",
        session.reference.repository()
    );
    let http_err = |what: &str| {
        let registry = session.registry().to_owned();
        let what = what.to_owned();
        move |source| Error::Http {
            registry,
            what,
            source,
        }
    };
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(http_err("building an HTTP client"))?;
    let what = format!("deleting {reference} ({digest})");
    let resp = send_delete(&http, &url, &session, auth, &what).await?;
    let status = resp.status().as_u16();
    let body = resp.text().await.unwrap_or_default();
    let fields = || (session.registry().to_owned(), what.clone(), shorten(&body));
    match delete_verdict(status, &body) {
        DeleteVerdict::Deleted => {
            tracing::info!(reference, %digest, "snapshot deleted from registry");
            Ok(Deleted::Manifest { digest })
        }
        DeleteVerdict::Absent => Ok(Deleted::Absent),
        DeleteVerdict::Unsupported => Err(Error::DeleteUnsupported {
            registry: session.registry().to_owned(),
            reference: reference.to_owned(),
            status,
            detail: shorten(&body),
        }),
        DeleteVerdict::Unauthorized => {
            let (registry, what, detail) = fields();
            Err(Error::Unauthorized {
                registry,
                what,
                detail,
            })
        }
        DeleteVerdict::Forbidden => {
            let (registry, what, detail) = fields();
            Err(Error::Forbidden {
                registry,
                what,
                detail,
            })
        }
        DeleteVerdict::Other => {
            let (registry, what, detail) = fields();
            Err(Error::Status {
                registry,
                what,
                status,
                detail,
            })
        }
    }
}

/// Sends the DELETE, answering one authentication challenge: basic credentials, or a bearer
/// token with scope `repository:<repo>:delete` from the challenge's realm.
async fn send_delete(
    http: &reqwest::Client,
    url: &str,
    session: &Session,
    auth: &RegistryAuth,
    what: &str,
) -> Result<reqwest::Response> {
    let http_err = |source| Error::Http {
        registry: session.registry().to_owned(),
        what: what.to_owned(),
        source,
    };
    let first = match auth {
        RegistryAuth::Bearer { token } => http.delete(url).bearer_auth(token),
        _ => http.delete(url),
    };
    let resp = first.send().await.map_err(http_err)?;
    if resp.status() != reqwest::StatusCode::UNAUTHORIZED
        || matches!(auth, RegistryAuth::Bearer { .. })
    {
        return Ok(resp);
    }
    let challenge = resp
        .headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_challenge);
    let retry = match (challenge, auth) {
        (Some(Challenge::Basic), RegistryAuth::Basic { username, password }) => {
            http.delete(url).basic_auth(username, Some(password))
        }
        (Some(Challenge::Bearer { realm, service }), _) => {
            let token = fetch_token(http, session, auth, &realm, service.as_deref(), what).await?;
            http.delete(url).bearer_auth(token)
        }
        _ => return Ok(resp),
    };
    retry.send().await.map_err(http_err)
}

/// Gets a bearer token for deleting from `realm`, sending basic credentials when there are some.
async fn fetch_token(
    http: &reqwest::Client,
    session: &Session,
    auth: &RegistryAuth,
    realm: &str,
    service: Option<&str>,
    what: &str,
) -> Result<String> {
    let registry = session.registry().to_owned();
    let scope = format!("repository:{}:delete", session.reference.repository());
    let mut params = vec![("scope", scope.as_str())];
    if let Some(s) = service {
        params.push(("service", s));
    }
    let url = reqwest::Url::parse_with_params(realm, &params).map_err(|e| Error::Status {
        registry: registry.clone(),
        what: what.to_owned(),
        status: 401,
        detail: format!("the token realm {realm:?} is not a URL: {e}"),
    })?;
    if !realm_allowed(&url) {
        return Err(Error::Unauthorized {
            registry,
            what: what.to_owned(),
            detail: format!("not sending credentials to the token realm {realm} (not HTTPS)"),
        });
    }
    let mut req = http.get(url);
    if let RegistryAuth::Basic { username, password } = auth {
        req = req.basic_auth(username, Some(password));
    }
    let resp = req.send().await.map_err(|source| Error::Http {
        registry: registry.clone(),
        what: format!("getting a token for {what}"),
        source,
    })?;
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    if !status.is_success() {
        return Err(Error::Unauthorized {
            registry,
            what: what.to_owned(),
            detail: format!(
                "token endpoint {realm} answered {status}: {}",
                shorten(&body)
            ),
        });
    }
    #[derive(Deserialize)]
    struct Token {
        token: Option<String>,
        access_token: Option<String>,
    }
    let t: Token = serde_json::from_str(&body).map_err(|e| Error::Unauthorized {
        registry: registry.clone(),
        what: what.to_owned(),
        detail: format!("token endpoint {realm} sent no token: {e}"),
    })?;
    t.token
        .or(t.access_token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Error::Unauthorized {
            registry,
            what: what.to_owned(),
            detail: format!("token endpoint {realm} sent an empty token"),
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn chunks_cover_the_file_and_holes_are_marked() {
        let p = plan_chunks(100 * MIB, 32 * MIB, &[(0, 4096), (70 * MIB, 70 * MIB + 1)]);
        assert_eq!(p.len(), 4);
        assert_eq!(
            p.iter().map(|c| (c.offset, c.len)).collect::<Vec<_>>(),
            vec![
                (0, 32 * MIB),
                (32 * MIB, 32 * MIB),
                (64 * MIB, 32 * MIB),
                (96 * MIB, 4 * MIB)
            ]
        );
        assert_eq!(
            p.iter().map(|c| c.may_hold_data).collect::<Vec<_>>(),
            vec![true, false, true, false]
        );
        // A range ending exactly at a chunk boundary does not touch the next chunk.
        let p = plan_chunks(64 * MIB, 32 * MIB, &[(0, 32 * MIB)]);
        assert_eq!(
            p.iter().map(|c| c.may_hold_data).collect::<Vec<_>>(),
            vec![true, false]
        );
        assert!(plan_chunks(0, 32 * MIB, &[]).is_empty());
        // A file system that reports the whole file as data: every chunk is read.
        assert!(
            plan_chunks(70 * MIB, 32 * MIB, &[(0, 70 * MIB)])
                .iter()
                .all(|c| c.may_hold_data)
        );
    }

    #[test]
    fn zeros_and_nonzero_runs() {
        assert!(is_zero(&[]));
        assert!(is_zero(&[0; 10_000]));
        let mut b = vec![0u8; 5 * BLOCK + 100];
        assert!(nonzero_runs(&b, BLOCK).is_empty());
        b[BLOCK + 1] = 1;
        b[2 * BLOCK] = 1;
        b[5 * BLOCK + 99] = 1;
        assert!(!is_zero(&b));
        assert_eq!(
            nonzero_runs(&b, BLOCK),
            vec![BLOCK..3 * BLOCK, 5 * BLOCK..5 * BLOCK + 100]
        );
    }

    #[test]
    fn codecs_round_trip_and_are_bounded() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let gz = encode(&data).unwrap();
        assert_eq!(gz, encode(&data).unwrap(), "deterministic");
        assert!((gz.len() as u64) < max_compressed(data.len() as u64));
        assert_eq!(decode(Codec::Gzip, &gz, data.len() as u64).unwrap(), data);
        let e = decode(Codec::Gzip, &gz, 1000).unwrap_err().to_string();
        assert!(e.contains("more than 1000"), "{e}");
        let e = decode(Codec::Gzip, &gz, 300_000).unwrap_err().to_string();
        assert!(e.contains("200000 bytes decompressed"), "{e}");
        assert!(decode(Codec::Gzip, b"not gzip", 8).is_err());
        let zs = ruzstd::encoding::compress_to_vec(
            &data[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        assert_eq!(decode(Codec::Zstd, &zs, data.len() as u64).unwrap(), data);
        assert!(decode(Codec::Zstd, &zs, 10).is_err());
        // Random data does not compress; the bound still holds.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..(4 * MIB) as usize)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let gz = encode(&noise).unwrap();
        assert!((gz.len() as u64) <= max_compressed(noise.len() as u64));
    }

    fn artifact() -> Artifact {
        Artifact {
            config_digest: sha256(b"{}"),
            config_size: 2,
            files: vec![
                FileEntry {
                    name: VMSTATE,
                    size: 1000,
                    chunks: vec![Chunk {
                        offset: 0,
                        length: 1000,
                        digest: sha256(b"a"),
                        size: 50,
                        codec: Codec::Gzip,
                    }],
                },
                FileEntry {
                    name: MEMORY,
                    size: 96 * MIB,
                    chunks: vec![
                        Chunk {
                            offset: 0,
                            length: 32 * MIB,
                            digest: sha256(b"b"),
                            size: 4000,
                            codec: Codec::Gzip,
                        },
                        Chunk {
                            offset: 64 * MIB,
                            length: 32 * MIB,
                            digest: sha256(b"c"),
                            size: 5000,
                            codec: Codec::Gzip,
                        },
                    ],
                },
                FileEntry {
                    name: DISK,
                    size: 10 * MIB,
                    chunks: vec![],
                },
                FileEntry {
                    name: INITRD,
                    size: 0,
                    chunks: vec![],
                },
                FileEntry {
                    name: VMM_NOTE,
                    size: 0,
                    chunks: vec![],
                },
            ],
        }
    }

    #[test]
    fn push_options_and_manifest_room_are_checked_before_any_request() {
        let ok = PushOptions::default();
        assert!(check_push_options(&ok).is_ok());
        for bad in [
            PushOptions {
                chunk_bytes: 0,
                ..ok
            },
            PushOptions {
                chunk_bytes: 4097,
                ..ok
            },
            PushOptions {
                chunk_bytes: MAX_CHUNK_BYTES + BLOCK as u64,
                ..ok
            },
            PushOptions { in_flight: 0, ..ok },
        ] {
            let e = check_push_options(&bad).unwrap_err().to_string();
            assert!(e.contains("chunk_bytes"), "{e}");
        }
        let plan = |may_hold_data| Planned {
            offset: 0,
            len: 4096,
            may_hold_data,
        };
        let fits = (MAX_DOCUMENT_BYTES - 4096) / LAYER_JSON_BYTES;
        let mut plans: Vec<(usize, Planned)> = (0..fits).map(|_| (0, plan(true))).collect();
        plans.push((0, plan(false)));
        assert!(
            check_manifest_room(&plans, 4096).is_ok(),
            "holes take no room"
        );
        plans.push((1, plan(true)));
        let e = check_manifest_room(&plans, 4096).unwrap_err().to_string();
        assert!(e.contains("use larger chunks"), "{e}");
    }

    #[test]
    fn tally_puts_chunks_in_their_files_and_counts_reuse_and_holes() {
        let mut expected = artifact();
        let files: Vec<FileEntry> = expected
            .files
            .iter()
            .map(|f| FileEntry {
                chunks: Vec::new(),
                ..f.clone()
            })
            .collect();
        let stored = |file: usize, n: usize, uploaded| {
            let chunk = expected.files[file].chunks[n].clone();
            (file, ChunkResult::Stored { chunk, uploaded })
        };
        let results = vec![
            stored(0, 0, true),
            stored(1, 0, false),
            (1, ChunkResult::Hole),
            stored(1, 1, true),
            (2, ChunkResult::Hole),
        ];
        let (outcome, files) = tally(files, results, 2);
        assert_eq!(files, std::mem::take(&mut expected.files));
        assert_eq!(
            (outcome.chunks, outcome.chunks_reused, outcome.holes),
            (3, 1, 2)
        );
        assert_eq!(outcome.bytes_uploaded, 50 + 5000);
        assert_eq!(outcome.bytes_stored, 2 + 50 + 4000 + 5000);
        assert_eq!(outcome.bytes_data, 1000 + 64 * MIB);
    }

    #[test]
    fn manifest_round_trips_with_holes_absent() {
        let a = artifact();
        let bytes = build_manifest(&a, 32 * MIB).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["artifactType"], ARTIFACT_TYPE);
        assert_eq!(v["mediaType"], OCI_MANIFEST);
        assert_eq!(v["config"]["mediaType"], CONFIG_MEDIA_TYPE);
        assert_eq!(
            v["layers"].as_array().unwrap().len(),
            3,
            "the hole has no layer"
        );
        assert_eq!(v["layers"][2]["annotations"][ANNOTATION_OFFSET], "67108864");
        assert_eq!(
            v["annotations"]["dev.imp.snapshot.size.disk.ext4"],
            "10485760"
        );
        assert_eq!(parse_artifact("r", &bytes).unwrap(), a);
    }

    /// Rewrites the manifest of [`artifact`] with `f` and parses it.
    fn tampered(f: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut v: serde_json::Value =
            serde_json::from_slice(&build_manifest(&artifact(), 32 * MIB).unwrap()).unwrap();
        f(&mut v);
        parse_artifact("reg.example/snaps:x", &serde_json::to_vec(&v).unwrap())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn foreign_or_hostile_manifests_are_refused_by_name() {
        let e = tampered(|v| v["artifactType"] = "application/vnd.other".into());
        assert!(
            e.contains("reg.example/snaps:x") && e.contains("not an imp snapshot"),
            "{e}"
        );
        assert!(e.contains("application/vnd.other"), "{e}");
        let e = tampered(|v| {
            v.as_object_mut().unwrap().remove("artifactType");
        });
        assert!(
            e.contains("no artifactType") && e.contains(CONFIG_MEDIA_TYPE),
            "{e}"
        );
        let e = tampered(|v| v["artifactType"] = "application/vnd.imp.snapshot.v2".into());
        assert!(
            e.contains("cannot read") && e.contains("snapshot.v2"),
            "{e}"
        );
        let e = tampered(|v| v["mediaType"] = "application/vnd.oci.image.index.v1+json".into());
        assert!(e.contains("index"), "{e}");
        let e = tampered(|v| v["layers"][0]["mediaType"] = "application/x-tar".into());
        assert!(
            e.contains("application/x-tar") && e.contains("cannot read"),
            "{e}"
        );
        let e = tampered(|v| v["config"]["mediaType"] = "application/json".into());
        assert!(e.contains("config media type"), "{e}");
        let e = tampered(|v| v["annotations"]["dev.imp.snapshot.size.memory"] = "1e30".into());
        assert!(e.contains("not a size"), "{e}");
        let e = tampered(|v| {
            v["annotations"]["dev.imp.snapshot.size.memory"] = (u64::MAX / 2).to_string().into()
        });
        assert!(e.contains("over the limit"), "{e}");
        let e = tampered(|v| {
            v["annotations"]
                .as_object_mut()
                .unwrap()
                .remove("dev.imp.snapshot.size.disk.ext4");
        });
        assert!(e.contains("missing"), "{e}");
        let e = tampered(|v| v["annotations"]["dev.imp.snapshot.size.../etc"] = "1".into());
        assert!(e.contains("a file named"), "{e}");
        let e = tampered(|v| v["layers"][0]["annotations"][ANNOTATION_FILE] = "../x".into());
        assert!(e.contains("a file named \"../x\""), "{e}");
        let e = tampered(|v| v["layers"][1]["annotations"][ANNOTATION_OFFSET] = "-1".into());
        assert!(e.contains("not a number"), "{e}");
        let e = tampered(|v| {
            v["layers"][2]["annotations"][ANNOTATION_OFFSET] = (u64::MAX - 5).to_string().into()
        });
        assert!(e.contains("past the end"), "{e}");
        let e = tampered(|v| v["layers"][2]["annotations"][ANNOTATION_OFFSET] = "1048576".into());
        assert!(e.contains("overlap"), "{e}");
        let e = tampered(|v| {
            v["layers"][1]["annotations"][ANNOTATION_LENGTH] = (1u64 << 40).to_string().into()
        });
        assert!(e.contains("outside"), "{e}");
        let e = tampered(|v| v["layers"][1]["size"] = (40 * MIB).into());
        assert!(e.contains("compressed"), "{e}");
        let e = tampered(|v| v["layers"][1]["digest"] = "sha256:XYZ".into());
        assert!(e.contains("malformed digest"), "{e}");
        let e =
            tampered(|v| v["layers"][1]["digest"] = format!("sha512:{}", "a".repeat(128)).into());
        assert!(e.contains("digest algorithm"), "{e}");
        let e = tampered(|v| v["config"]["size"] = (2 * MIB).into());
        assert!(e.contains("config of"), "{e}");
        let e = parse_artifact("r", b"<html>").unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn config_format_is_checked_first() {
        let m = Manifest {
            format: FORMAT,
            vmm: "qemu 7.2.22".into(),
            machine: "microvm".into(),
            vcpus: 2,
            memory_mib: 256,
            source: super::super::Source {
                namespace: "ns".into(),
                name: "vm".into(),
                image: "img".into(),
            },
            taken_unix: 1,
            pause_ms: 2,
        };
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(parse_config("r", &bytes).unwrap(), m);
        let e = parse_config("reg/x:1", br#"{"format":99,"whatever":true}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("reg/x:1") && e.contains("format 99"), "{e}");
        assert!(parse_config("r", br#"{"format":1}"#).is_err());
    }

    #[test]
    fn challenges_parse() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a:pull""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("registry.example".into())
            })
        );
        assert_eq!(
            parse_challenge(r#"bearer Realm=http://127.0.0.1:9/t , service="a, \"b\"""#),
            Some(Challenge::Bearer {
                realm: "http://127.0.0.1:9/t".into(),
                service: Some("a, \"b\"".into())
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="imp-test""#),
            Some(Challenge::Basic)
        );
        assert_eq!(parse_challenge(r#"Bearer service="x""#), None);
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(parse_challenge(""), None);
    }

    #[test]
    fn credentials_go_to_https_or_loopback_realms_only() {
        let ok = |s: &str| realm_allowed(&reqwest::Url::parse(s).unwrap());
        assert!(ok("https://auth.example/token"));
        assert!(ok("http://127.0.0.1:5000/token"));
        assert!(ok("http://localhost/token"));
        assert!(ok("http://[::1]:8080/token"));
        assert!(!ok("http://auth.example/token"));
        assert!(!ok("ftp://auth.example/token"));
    }

    #[test]
    fn delete_answers() {
        assert_eq!(delete_verdict(202, ""), DeleteVerdict::Deleted);
        assert_eq!(delete_verdict(404, ""), DeleteVerdict::Absent);
        assert_eq!(
            delete_verdict(405, r#"{"errors":[{"code":"UNSUPPORTED"}]}"#),
            DeleteVerdict::Unsupported
        );
        assert_eq!(
            delete_verdict(400, r#"{"errors":[{"code":"UNSUPPORTED","message":"x"}]}"#),
            DeleteVerdict::Unsupported
        );
        assert_eq!(delete_verdict(401, ""), DeleteVerdict::Unauthorized);
        assert_eq!(delete_verdict(403, ""), DeleteVerdict::Forbidden);
        assert_eq!(delete_verdict(500, "boom"), DeleteVerdict::Other);
    }

    #[test]
    fn registry_errors_are_classified() {
        let e = registry_error(
            "r:5000",
            "pushing".into(),
            None,
            OciDistributionError::ServerError {
                code: 401,
                url: "http://r:5000/v2/".into(),
                message: "no".into(),
            },
        )
        .to_string();
        assert!(e.contains("Registry r:5000") && e.contains("401"), "{e}");
        let e = registry_error(
            "r:5000",
            "x".into(),
            None,
            OciDistributionError::UnauthorizedError { url: "u".into() },
        );
        assert!(matches!(e, Error::Unauthorized { .. }));
        let e = registry_error(
            "r:5000",
            "x".into(),
            Some("r:5000/a:b"),
            OciDistributionError::ServerError {
                code: 404,
                url: "u".into(),
                message: String::new(),
            },
        );
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        let e = registry_error(
            "r:5000",
            "x".into(),
            None,
            OciDistributionError::ServerError {
                code: 404,
                url: "u".into(),
                message: String::new(),
            },
        );
        assert!(matches!(e, Error::Registry { .. }), "{e}");
    }

    #[test]
    fn references_and_tags() {
        assert!(push_target("127.0.0.1:5000/snaps/vm:exec-1").is_ok());
        for bad in [
            "127.0.0.1:5000/snaps/vm",
            "127.0.0.1:5000/snaps/vm@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "vm:1",
            "",
        ] {
            assert!(push_target(bad).is_err(), "{bad}");
        }
        assert_eq!(tag_for("web-1-20250101-120000"), "web-1-20250101-120000");
        assert_eq!(tag_for("a/b c"), "a-b-c");
        assert_eq!(tag_for("-x"), "_-x");
        assert_eq!(tag_for(""), "_");
        let long_a = tag_for(&"a".repeat(200));
        let long_b = tag_for(&format!("{}b", "a".repeat(199)));
        assert_eq!(long_a.len(), 128);
        assert_ne!(long_a, long_b);
    }

    #[test]
    fn pull_secret_picks_the_registry() {
        let json = br#"{"auths":{"reg.example:5000":{"username":"u","password":"p"}}}"#;
        assert_eq!(
            auth_for("reg.example:5000/snaps:x", Some(json)).unwrap(),
            RegistryAuth::Basic {
                username: "u".into(),
                password: "p".into()
            }
        );
        assert_eq!(
            auth_for("other.example/snaps:x", Some(json)).unwrap(),
            RegistryAuth::Anonymous
        );
        assert_eq!(auth_for("x/y:z", None).unwrap(), RegistryAuth::Anonymous);
        let e = auth_for("reg.example:5000/snaps:x", Some(b"{"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("reg.example:5000/snaps:x"), "{e}");
    }
}
