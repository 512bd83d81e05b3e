//! imp's one client of the OCI distribution protocol, for images and snapshots alike. A
//! [`Session`] talks to one registry and repository with one set of credentials: it fetches
//! manifests and blobs, uploads blobs (one PUT each or in chunks, mounted from another
//! repository of the registry when it can), pushes manifests and deletes them. Requests go
//! through `oci-client`, which answers the registry's basic or bearer challenge; the DELETE it
//! cannot send is sent here, answering the challenge itself ([`challenge`]).
//!
//! Plain HTTP is used only for loopback registries (127.0.0.1, ::1, localhost); every other
//! registry is spoken to over HTTPS with rustls (ring provider). For the DELETE imp sends
//! itself, credentials go to a token realm only over HTTPS or on loopback; for pulls and pushes
//! `oci-client` answers the challenge and sends them to the realm the registry names, whatever
//! its scheme (a registry that names a plain-HTTP realm on another host exposes them).
//!
//! Whatever a registry sends is untrusted: a manifest over [`MAX_DOCUMENT_BYTES`] is refused, a
//! manifest must hash to the digest it was asked for (or, by tag, to the one the registry
//! names), and a blob read into memory must be no longer than its descriptor says and hash to
//! its digest. A blob streamed to disk is checked by its reader ([`crate::blobs::BlobStore`]).

mod challenge;
mod delete;
mod error;
mod image;

use std::io;
use std::sync::Once;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::OciDescriptor;
use oci_client::{Client, RegistryOperation};
use sha2::{Digest as _, Sha256};

pub use error::Error;
pub(crate) use image::RegistryFetcher;
/// A parsed `registry/repository[:tag][@digest]`, what a [`Session`] is made for.
pub use oci_client::Reference;

use crate::auth::RegistryAuth;
use crate::manifest::{ACCEPT, Digest, MAX_DOCUMENT_BYTES};
use crate::reference::is_loopback_registry;
use error::registry_error;

/// The result type of registry requests.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Installs rustls' ring provider as the process default, once (a no-op if one is installed).
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// How a session uploads a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Upload {
    /// One PUT per blob: the fewest round trips, for blobs that fit in memory.
    #[default]
    Monolithic,
    /// A POST, then PATCHes of at most 4 MiB, then a PUT: for registries or proxies that
    /// limit a request's body. Falls back to one PUT when the registry does not follow the
    /// specification for chunks.
    Chunked,
}

/// How a blob came to be in the repository after [`Session::push_blob`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The repository had it already.
    Present,
    /// The registry mounted it from another repository, without its bytes being sent.
    Mounted,
    /// Its bytes were sent.
    Uploaded,
}

/// One registry, repository and set of credentials: every request of an image pull or of a
/// snapshot's push, pull or deletion.
pub struct Session {
    client: Client,
    reference: Reference,
    auth: RegistryAuth,
    mount_from: Vec<String>,
}

impl Session {
    /// A session for `reference`'s repository that uploads [`Upload::Monolithic`].
    pub fn new(reference: Reference, auth: &RegistryAuth) -> Self {
        Self::with_upload(reference, auth, Upload::default())
    }

    /// A session for `reference`'s repository that uploads blobs as `upload` says.
    pub fn with_upload(reference: Reference, auth: &RegistryAuth, upload: Upload) -> Self {
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
            use_monolithic_push: upload == Upload::Monolithic,
            connect_timeout: Some(Duration::from_secs(30)),
            read_timeout: Some(Duration::from_secs(300)),
            ..ClientConfig::default()
        };
        Self {
            client: Client::new(config),
            reference,
            auth: auth.clone(),
            mount_from: Vec::new(),
        }
    }

    /// Lets [`Self::push_blob`] ask the registry to mount a blob it lacks from these
    /// repositories of the same registry before sending its bytes.
    pub fn mount_from(mut self, repositories: impl IntoIterator<Item = String>) -> Self {
        self.mount_from = repositories.into_iter().collect();
        self
    }

    /// The reference the session was made for.
    pub fn reference(&self) -> &Reference {
        &self.reference
    }

    /// The registry's host, as the reference names it.
    pub fn registry(&self) -> &str {
        self.reference.registry()
    }

    /// The credentials as oci-client takes them.
    fn oci_auth(&self) -> oci_client::secrets::RegistryAuth {
        (&self.auth).into()
    }

    fn fail(&self, what: String) -> impl FnOnce(OciDistributionError) -> Error + '_ {
        move |e| registry_error(self.registry(), what, None, e)
    }

    /// Gets a push token now, so missing or refused credentials fail before any upload.
    pub async fn authenticate_push(&self) -> Result<()> {
        self.client
            .auth(&self.reference, &self.oci_auth(), RegistryOperation::Push)
            .await
            .map_err(self.fail(format!("authenticating to push {}", self.reference.whole())))?;
        Ok(())
    }

    /// The manifest (or index) under the session's reference, by tag or digest: its bytes,
    /// bounded and checked against their digest, and that digest.
    pub async fn manifest(&self) -> Result<(Vec<u8>, Digest)> {
        self.manifest_at(&self.reference).await
    }

    /// The manifest `digest` of the session's repository, bounded and verified.
    pub async fn manifest_by_digest(&self, digest: &Digest) -> Result<Vec<u8>> {
        let r = Reference::with_digest(
            self.reference.registry().to_owned(),
            self.reference.repository().to_owned(),
            digest.to_string(),
        );
        Ok(self.manifest_at(&r).await?.0)
    }

    async fn manifest_at(&self, reference: &Reference) -> Result<(Vec<u8>, Digest)> {
        let what = format!("manifest {}", reference.whole());
        let (bytes, header_digest) = self
            .client
            .pull_manifest_raw(reference, &self.oci_auth(), ACCEPT)
            .await
            .map_err(|e| {
                registry_error(self.registry(), format!("fetching {what}"), Some(&what), e)
            })?;
        if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
            return Err(Error::TooLarge {
                registry: self.registry().to_owned(),
                what,
                limit: MAX_DOCUMENT_BYTES,
            });
        }
        // oci-client compares against the header or the reference; hash it ourselves anyway.
        let actual = Digest::of(&bytes);
        let expected = reference.digest().unwrap_or(&header_digest);
        if expected != actual.as_str() {
            return Err(Error::DigestMismatch {
                registry: self.registry().to_owned(),
                what,
                expected: expected.to_owned(),
                actual: actual.to_string(),
            });
        }
        Ok((bytes.to_vec(), actual))
    }

    /// Starts downloading blob `digest` (`size` bytes of `media_type`) of the session's
    /// repository; `what` names it in errors. oci-client checks the digest at the stream's end;
    /// the caller bounds what it reads by `size`.
    pub async fn blob_stream(
        &self,
        media_type: &str,
        digest: &Digest,
        size: u64,
        what: &str,
    ) -> Result<BoxStream<'static, io::Result<Bytes>>> {
        let desc = OciDescriptor {
            media_type: media_type.to_owned(),
            digest: digest.to_string(),
            size: i64::try_from(size).unwrap_or(i64::MAX),
            ..OciDescriptor::default()
        };
        let stream = self
            .client
            .pull_blob_stream(&self.reference, &desc)
            .await
            .map_err(self.fail(format!("fetching {what}")))?;
        Ok(stream.stream)
    }

    /// Downloads blob `digest` of `size` bytes into memory, refusing more bytes than that and
    /// content that does not hash to the digest. `size` is what memory is reserved for: the
    /// caller has bounded it.
    pub async fn blob(
        &self,
        media_type: &str,
        digest: &Digest,
        size: u64,
        what: &str,
    ) -> Result<Bytes> {
        let mut stream = self.blob_stream(media_type, digest, size, what).await?;
        let mut buf = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        // Hashed piece by piece as it arrives, so no long hash blocks the runtime.
        let mut hasher = Sha256::new();
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(|source| Error::Download {
                registry: self.registry().to_owned(),
                what: what.to_owned(),
                source,
            })?;
            if (buf.len() + piece.len()) as u64 > size {
                return Err(Error::TooLarge {
                    registry: self.registry().to_owned(),
                    what: what.to_owned(),
                    limit: size,
                });
            }
            hasher.update(&piece);
            buf.extend_from_slice(&piece);
        }
        let actual = Digest::from_hasher(hasher);
        if &actual != digest || buf.len() as u64 != size {
            return Err(Error::DigestMismatch {
                registry: self.registry().to_owned(),
                what: what.to_owned(),
                expected: format!("{digest} ({size} bytes)"),
                actual: format!("{actual} ({} bytes)", buf.len()),
            });
        }
        Ok(Bytes::from(buf))
    }

    /// Puts `data`, whose digest is `digest`, into the session's repository unless it is
    /// there: mounted from one of [`Self::mount_from`]'s repositories if the registry can,
    /// else uploaded as the session's [`Upload`] says. `what` names it in errors.
    pub async fn push_blob(&self, data: Bytes, digest: &Digest, what: &str) -> Result<Placed> {
        let exists = self
            .client
            .blob_exists(&self.reference, digest.as_str())
            .await
            .map_err(self.fail(format!("checking for {what}")))?;
        if exists {
            return Ok(Placed::Present);
        }
        for from in &self.mount_from {
            if self.mount(from, digest).await {
                return Ok(Placed::Mounted);
            }
        }
        self.client
            .push_blob(&self.reference, data, digest.as_str())
            .await
            .map_err(self.fail(format!("uploading {what}")))?;
        Ok(Placed::Uploaded)
    }

    /// Asks the registry to mount blob `digest` from repository `from`; false when it did not
    /// (it lacks the blob there, refuses mounts, or answers with an upload session instead),
    /// so the caller uploads it.
    async fn mount(&self, from: &str, digest: &Digest) -> bool {
        let source = Reference::with_tag(
            self.reference.registry().to_owned(),
            from.to_owned(),
            "latest".to_owned(),
        );
        match self
            .client
            .mount_blob(&self.reference, &source, digest.as_str())
            .await
        {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(registry = %self.registry(), from, %digest, error = %e, "blob not mounted; uploading it");
                false
            }
        }
    }

    /// Pushes manifest `bytes` of `media_type` under the session's reference (its tag);
    /// returns their digest.
    pub async fn push_manifest(&self, bytes: Vec<u8>, media_type: &'static str) -> Result<Digest> {
        let digest = Digest::of(&bytes);
        let content_type = reqwest::header::HeaderValue::from_static(media_type);
        self.client
            .push_manifest_raw(&self.reference, bytes, content_type)
            .await
            .map_err(self.fail(format!("pushing manifest {}", self.reference.whole())))?;
        Ok(digest)
    }
}
