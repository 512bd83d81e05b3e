//! Fetching manifests and blobs from an OCI distribution registry with `oci-client`.
//!
//! Plain HTTP is used only for loopback registries (127.0.0.1, ::1, localhost); every other
//! registry is spoken to over HTTPS with rustls (ring provider).

use std::sync::Once;

use futures::StreamExt;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::{Client, Reference};

use super::auth::RegistryAuth;
use super::blobs::BlobStore;
use super::manifest::{ACCEPT, Descriptor, Digest, MAX_DOCUMENT_BYTES};
use super::progress::Meter;
use super::reference::is_loopback_registry;
use super::{ImageError, Result};

/// Installs rustls' ring provider as the process default, once (a no-op if one is installed).
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// One pull's connection to one registry and repository, with its credentials.
pub(crate) struct RegistryFetcher {
    client: Client,
    reference: Reference,
    auth: oci_client::secrets::RegistryAuth,
}

impl RegistryFetcher {
    pub(crate) fn new(reference: &Reference, auth: &RegistryAuth) -> Self {
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
            ..ClientConfig::default()
        };
        Self {
            client: Client::new(config),
            reference: reference.clone(),
            auth: auth.into(),
        }
    }

    fn registry(&self) -> String {
        self.reference.registry().to_owned()
    }

    fn fail(
        &self,
        what: String,
    ) -> impl FnOnce(oci_client::errors::OciDistributionError) -> ImageError {
        let registry = self.registry();
        move |source| ImageError::Registry {
            registry,
            what,
            source,
        }
    }

    async fn get_manifest(&self, reference: &Reference, what: String) -> Result<(Vec<u8>, Digest)> {
        let (bytes, digest) = self
            .client
            .pull_manifest_raw(reference, &self.auth, ACCEPT)
            .await
            .map_err(self.fail(format!("fetching {what}")))?;
        if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
            return Err(ImageError::Manifest {
                what,
                reason: format!("{} bytes is more than the limit", bytes.len()),
            });
        }
        // oci-client compares against the header or the reference; hash it ourselves anyway.
        let actual = Digest::of(&bytes);
        if let Some(expected) = reference.digest() {
            Digest::parse(expected, &what)?.verify(&bytes, &what)?;
        } else if digest != actual.as_str() {
            return Err(ImageError::DigestMismatch {
                what,
                expected: digest,
                actual: actual.to_string(),
            });
        }
        Ok((bytes.to_vec(), actual))
    }

    /// The manifest or index the reference names: a tag is resolved on every pull, a digest
    /// already in `blobs` is read from there (verified) without asking the registry.
    pub(crate) async fn root(&self, blobs: &BlobStore) -> Result<(Vec<u8>, Digest)> {
        let what = format!("manifest {}", self.reference.whole());
        if let Some(d) = self.reference.digest() {
            let digest = Digest::parse(d, &what)?;
            if let Some(bytes) = blobs.read_cached_document(&digest, &what).await? {
                return Ok((bytes, digest));
            }
        }
        self.get_manifest(&self.reference, what).await
    }

    /// A manifest an index points to, by digest.
    pub(crate) async fn manifest(&self, desc: &Descriptor) -> Result<Vec<u8>> {
        let r = Reference::with_digest(
            self.reference.registry().to_owned(),
            self.reference.repository().to_owned(),
            desc.digest.to_string(),
        );
        let what = format!("manifest {}", r.whole());
        Ok(self.get_manifest(&r, what).await?.0)
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
        let od = OciDescriptor {
            media_type: desc.media_type.clone(),
            digest: desc.digest.to_string(),
            size: i64::try_from(desc.size).unwrap_or(i64::MAX),
            ..OciDescriptor::default()
        };
        tracing::debug!(registry = %self.registry(), digest = %desc.digest, size = desc.size, "downloading blob");
        let stream = self
            .client
            .pull_blob_stream(&self.reference, &od)
            .await
            .map_err(self.fail(format!("fetching {what} {}", desc.digest)))?;
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
