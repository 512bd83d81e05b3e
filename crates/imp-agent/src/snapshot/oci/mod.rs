//! Snapshots in an OCI registry (`storage.type: oci-registry`): [`push()`] a snapshot directory as
//! an OCI artifact, [`pull()`] it back into a directory on any node, [`delete`] it when retention
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
//!
//! # Parts
//! The registry is spoken to through imp-image's one client ([`imp_image::registry::Session`]:
//! credentials, challenges, uploads, bounded and verified downloads, deletion); this module
//! keeps what is about snapshots: the artifact's format and its checks (`format.rs`), the push
//! (`push.rs`) and pull (`pull.rs`) of a snapshot directory, and its deletion (here).

mod format;
mod pull;
mod push;

use std::io;
use std::path::{Path, PathBuf};

use imp_image::manifest::Digest;
use imp_image::registry::{self, Reference, Session};
use imp_image::{ImageError, RegistryAuth, auth_from_docker_config};

use super::{DISK, INITRD, MEMORY, Manifest, VMM_NOTE, VMSTATE};

pub use pull::pull;
pub use push::{push, push_with};

/// The manifest's `artifactType`: an imp snapshot, registry format 1.
pub const ARTIFACT_TYPE: &str = "application/vnd.imp.snapshot.v1";
/// The config blob's media type: the snapshot's `snapshot.json`.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.imp.snapshot.config.v1+json";
/// A chunk of a file, gzip-compressed (what [`push()`] writes).
pub const CHUNK_GZIP: &str = "application/vnd.imp.snapshot.chunk.v1+gzip";
/// A chunk of a file, zstd-compressed (read by [`pull()`], not written yet).
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
    /// The registry has no manifest under the reference.
    #[error("Snapshot {reference} not found in registry {registry}")]
    NotFound {
        /// The registry host.
        registry: String,
        /// The reference looked up.
        reference: String,
    },
    /// A registry request failed; the error names the registry, what was being done and to
    /// which snapshot.
    #[error(transparent)]
    Registry(#[from] registry::Error),
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
        let hash = Digest::of(name.as_bytes());
        tag.truncate(128 - 17);
        tag.push('-');
        tag.push_str(&hash.hex()[..16]);
    }
    tag
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

/// The manifest under the session's reference (bounded and verified by the session), with the
/// registry's "no such manifest" said of the snapshot `reference`.
async fn fetch_manifest(session: &Session, reference: &str) -> Result<(Vec<u8>, Digest)> {
    session.manifest().await.map_err(|e| match e {
        registry::Error::NotFound { registry, .. } => Error::NotFound {
            registry,
            reference: reference.to_owned(),
        },
        e => Error::Registry(e),
    })
}

/// Deletes the snapshot `reference` (its manifest, by digest, and so every tag naming it) for
/// retention pruning; [`Deleted::Absent`] when there is nothing there. Refuses to delete what is
/// not an imp snapshot, and says so when the registry does not allow deletion.
pub async fn delete(reference: &str, auth: &RegistryAuth) -> Result<Deleted> {
    let parsed = parse_reference(reference)?;
    let session = Session::new(parsed, auth);
    let (bytes, digest) = match fetch_manifest(&session, reference).await {
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
    if !session.delete(&digest).await? {
        return Ok(Deleted::Absent);
    }
    tracing::info!(reference, %digest, "snapshot deleted from registry");
    Ok(Deleted::Manifest {
        digest: digest.to_string(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

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
