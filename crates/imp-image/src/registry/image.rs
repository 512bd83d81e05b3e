//! An image pull's use of a [`Session`]: the manifest a reference names (from the blob cache
//! when it is named by a digest already there) and blobs streamed into the cache.

use futures::StreamExt as _;
use oci_client::Reference;

use super::Session;
use crate::auth::RegistryAuth;
use crate::blobs::BlobStore;
use crate::manifest::{Descriptor, Digest};
use crate::progress::Meter;
use crate::{ImageError, Result};

/// One pull's session with one registry and repository.
pub(crate) struct RegistryFetcher {
    session: Session,
}

impl RegistryFetcher {
    pub(crate) fn new(reference: &Reference, auth: &RegistryAuth) -> Self {
        Self {
            session: Session::new(reference.clone(), auth),
        }
    }

    /// The manifest or index the reference names: a tag is resolved on every pull, a digest
    /// already in `blobs` is read from there (verified) without asking the registry.
    pub(crate) async fn root(&self, blobs: &BlobStore) -> Result<(Vec<u8>, Digest)> {
        let reference = self.session.reference();
        if let Some(d) = reference.digest() {
            let what = format!("manifest {}", reference.whole());
            let digest = Digest::parse(d, &what)?;
            if let Some(bytes) = blobs.read_cached_document(&digest, &what).await? {
                return Ok((bytes, digest));
            }
        }
        Ok(self.session.manifest().await?)
    }

    /// A manifest an index points to, by digest.
    pub(crate) async fn manifest(&self, desc: &Descriptor) -> Result<Vec<u8>> {
        Ok(self.session.manifest_by_digest(&desc.digest).await?)
    }

    /// Downloads blob `desc` into `blobs` unless it is cached, counting its bytes into `meter`;
    /// true when it was downloaded.
    pub(crate) async fn blob(
        &self,
        blobs: &BlobStore,
        desc: &Descriptor,
        what: &str,
        mut meter: Meter,
    ) -> Result<bool> {
        if blobs.has(desc).await {
            return Ok(false);
        }
        tracing::debug!(registry = %self.session.registry(), digest = %desc.digest, size = desc.size, "downloading blob");
        let stream = self
            .session
            .blob_stream(
                &desc.media_type,
                &desc.digest,
                desc.size,
                &format!("{what} {}", desc.digest),
            )
            .await
            .map_err(ImageError::Registry)?;
        let stream = stream.map(move |chunk| {
            if let Ok(c) = &chunk {
                meter.add(c.len());
            }
            chunk
        });
        blobs.put_stream(desc, stream, what).await?;
        Ok(true)
    }
}
