//! Container images on the node: turning OCI images into a microVM's disks.
//!
//! The pipeline is: resolve an [`ImageSource`] (a registry reference, a local OCI layout
//! directory or an `oci-archive` tar) to one platform's manifest, fetch and verify every blob
//! into a content-addressed [`blobs::BlobStore`], apply the layers with [`layers`] into a
//! temporary directory, build a cached ext4 base with [`ext4`], and give every VM its own
//! writable copy of that base with [`disk::clone_disk`]. Every input (manifests, blobs, layer
//! tars) is treated as untrusted: digests and sizes are checked before use and nothing is
//! written outside the cache root.

pub mod auth;
pub mod blobs;
pub mod disk;
pub mod evict;
pub mod ext4;
pub mod layers;
pub mod layout;
pub mod manifest;
pub mod progress;
pub mod reference;
pub mod registry;
pub mod store;

use std::io;
use std::path::PathBuf;

pub use auth::{RegistryAuth, auth_from_docker_config};
pub use disk::clone_disk;
pub use layers::Limits;
pub use manifest::Platform;
pub use progress::{Event as ProgressEvent, Observer, Reporter};
pub use reference::ImageSource;
pub use store::{BaseRootfs, ImageStore, LayerDescriptor, Pruned, PulledImage};

/// The result type of the image pipeline.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// Why an image could not be pulled, unpacked or turned into a disk.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The image source text cannot be understood.
    #[error("Invalid image source {input:?}: {reason}")]
    InvalidSource {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The registry reference cannot be parsed.
    #[error("Invalid image reference {input:?}")]
    InvalidReference {
        /// The text given.
        input: String,
        /// Why it failed.
        #[source]
        source: oci_client::ParseError,
    },
    /// The docker config JSON (a `.dockerconfigjson` Secret value) cannot be used.
    #[error("Invalid docker config JSON for registry {registry}: {reason}")]
    DockerConfig {
        /// The registry whose credentials were looked up.
        registry: String,
        /// What is wrong.
        reason: String,
    },
    /// A request to the registry failed (including authentication); the error names the
    /// registry and what was being fetched.
    #[error(transparent)]
    Registry(#[from] registry::Error),
    /// A digest is not of the form `sha256:<64 lowercase hex>`.
    #[error("Invalid digest {digest:?} in {what}")]
    InvalidDigest {
        /// The digest as found.
        digest: String,
        /// Where it was found.
        what: String,
    },
    /// A manifest, index or config is malformed or not what the pipeline can use.
    #[error("Invalid {what}: {reason}")]
    Manifest {
        /// Which document.
        what: String,
        /// What is wrong.
        reason: String,
    },
    /// The index has no manifest for the wanted platform.
    #[error("Image {image} has no manifest for platform {platform}")]
    NoPlatform {
        /// The image.
        image: String,
        /// The platform looked for.
        platform: String,
    },
    /// Content does not hash to the digest that names it.
    #[error("Digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The blob or manifest.
        what: String,
        /// The digest it should have.
        expected: String,
        /// The digest it has.
        actual: String,
    },
    /// Streaming a blob from the registry failed, including oci-client's own digest check.
    #[error("Downloading {what} {digest}")]
    Download {
        /// Which blob.
        what: String,
        /// Its digest.
        digest: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// Content is not of the size its descriptor says.
    #[error("Size mismatch for {what}: expected {expected} bytes, got {actual}")]
    SizeMismatch {
        /// The blob.
        what: String,
        /// The size it should have.
        expected: u64,
        /// The size found (or read so far).
        actual: u64,
    },
    /// A layer's media type cannot be unpacked.
    #[error("Layer {digest} has unsupported media type {media_type:?}")]
    UnsupportedMediaType {
        /// The layer.
        digest: String,
        /// Its media type.
        media_type: String,
    },
    /// Applying a layer failed (the message names the layer and entry).
    #[error("Unpacking the image layers")]
    Layer(#[source] layers::Error),
    /// A layer's compressed stream is damaged (e.g. a gzip trailer whose CRC or length is
    /// wrong).
    #[error("Layer {index} ({digest}): decompressing")]
    Decompress {
        /// Index of the layer, from 0.
        index: usize,
        /// Digest of the compressed blob.
        digest: String,
        /// What the decoder found.
        #[source]
        source: io::Error,
    },
    /// A layer's uncompressed content is not what the config's `rootfs.diff_ids` says.
    #[error(
        "Layer {index} ({digest}): uncompressed content is {actual}, the config's rootfs.diff_ids says {expected}"
    )]
    DiffIdMismatch {
        /// Index of the layer, from 0.
        index: usize,
        /// Digest of the compressed blob.
        digest: String,
        /// The diff_id from the config.
        expected: String,
        /// The sha256 of the uncompressed tar.
        actual: String,
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
    /// An external tool (mkfs.ext4, resize2fs) failed.
    #[error("Running {tool} on {path:?} failed: {detail}")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// The file it worked on.
        path: PathBuf,
        /// Exit status and stderr.
        detail: String,
    },
    /// A per-VM disk was asked to be smaller than its base image.
    #[error(
        "Disk size {requested} bytes for {dest:?} is smaller than the base image {base:?} ({base_size} bytes)"
    )]
    DiskTooSmall {
        /// The disk to create.
        dest: PathBuf,
        /// The requested size.
        requested: u64,
        /// The base image.
        base: PathBuf,
        /// Its size.
        base_size: u64,
    },
    /// A blocking task panicked or was cancelled.
    #[error("Blocking image task failed")]
    Task(#[source] tokio::task::JoinError),
}

impl ImageError {
    /// Shorthand for an [`ImageError::Io`] closure.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { op, path, source }
    }

    /// True when the filesystem written to ran out of space or quota (ENOSPC, EDQUOT, or a
    /// tool saying so): the node's disk is full, not the image or the VM at fault.
    pub fn is_storage_full(&self) -> bool {
        match self {
            Self::Io { source, .. } => source.raw_os_error().is_some_and(|code| {
                [nix::errno::Errno::ENOSPC, nix::errno::Errno::EDQUOT]
                    .contains(&nix::errno::Errno::from_raw(code))
            }),
            Self::Tool { detail, .. } => detail.contains("No space left on device"),
            _ => false,
        }
    }
}

/// Runs blocking `f` on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ImageError::Task)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_full_filesystem_is_storage_full() {
        let io = |errno: nix::errno::Errno| {
            ImageError::io("Copying the base image to", "/d")(io::Error::from(errno))
        };
        assert!(io(nix::errno::Errno::ENOSPC).is_storage_full());
        assert!(io(nix::errno::Errno::EDQUOT).is_storage_full());
        assert!(!io(nix::errno::Errno::EIO).is_storage_full());
        let tool = |detail: &str| ImageError::Tool {
            tool: "resize2fs",
            path: "/d".into(),
            detail: detail.into(),
        };
        assert!(tool("exit status: 1: resize2fs: No space left on device").is_storage_full());
        assert!(!tool("exit status: 1: bad superblock").is_storage_full());
    }
}
