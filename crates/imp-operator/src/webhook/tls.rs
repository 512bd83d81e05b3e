//! The webhook's serving certificate, swappable while the listener stays open.
//!
//! The TLS configuration never holds a certificate itself: it asks a [`LiveCert`] on every
//! handshake, so a rotation ([`super::certs`]) or a reload is one [`LiveCert::set`] — the
//! connections already open keep the certificate they were made with, the next handshake gets
//! the new one, and the listener is never closed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::WebhookError;

/// The certificate the webhook presents now; cheap to read on every handshake.
#[derive(Debug)]
pub struct LiveCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl LiveCert {
    /// Starts with `key`.
    pub fn new(key: CertifiedKey) -> Self {
        Self {
            current: RwLock::new(Arc::new(key)),
        }
    }

    /// Presents `key` from the next handshake on.
    pub fn set(&self, key: CertifiedKey) {
        let key = Arc::new(key);
        match self.current.write() {
            Ok(mut guard) => *guard = key,
            // A writer panicked mid-assignment of an Arc: the value is whole either way.
            Err(poisoned) => *poisoned.into_inner() = key,
        }
    }

    /// The certificate presented now.
    pub fn get(&self) -> Arc<CertifiedKey> {
        match self.current.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The DER of the leaf certificate presented now.
    pub fn leaf_der(&self) -> Option<Vec<u8>> {
        self.get().cert.first().map(|c| c.as_ref().to_vec())
    }
}

impl ResolvesServerCert for LiveCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

/// Pairs a certificate chain (leaf first) with its private key, checking that they match.
pub fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, rustls::Error> {
    CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider())
}

/// The server side of TLS: ring only, HTTP/1.1, the certificate from `live` on every
/// handshake, and client certificates checked by `clients` if given.
pub fn server_config(
    live: Arc<LiveCert>,
    clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let builder = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?;
    let builder = match clients {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut tls = builder.with_cert_resolver(live);
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tls)
}

/// Reads a PEM certificate chain and key from files (the cert-manager mode: a mounted Secret),
/// off the runtime's worker threads.
pub async fn load_files(cert: &Path, key: &Path) -> Result<CertifiedKey, WebhookError> {
    let (cert_path, key_path) = (cert.to_owned(), key.to_owned());
    let loaded = tokio::task::spawn_blocking(move || read_pem_files(cert_path, key_path)).await;
    let (chain, private) = match loaded {
        Ok(r) => r?,
        Err(join) => {
            return Err(WebhookError::Cert {
                path: cert.to_owned(),
                source: rustls::pki_types::pem::Error::Io(std::io::Error::other(join)),
            });
        }
    };
    certified_key(chain, private).map_err(|source| WebhookError::Tls {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    })
}

/// Keeps `live` equal to the files (the files mode: cert-manager renews the mounted Secret, the
/// kubelet swaps the files in place): every `every` they are read again, and a new leaf is served
/// from the next handshake on. A read that fails (mid-update, removed) keeps what is served and
/// says so; the next read tries again. Ends when `shutdown` resolves.
pub async fn follow_files(
    cert: PathBuf,
    key: PathBuf,
    live: Arc<LiveCert>,
    every: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(every) => {}
        }
        match load_files(&cert, &key).await {
            Ok(read) => {
                let leaf = read.cert.first().map(|c| c.as_ref().to_vec());
                if leaf.is_some() && leaf != live.leaf_der() {
                    live.set(read);
                    tracing::info!(cert = %cert.display(), "serving the webhook certificate renewed in its file");
                }
            }
            Err(e) => {
                tracing::warn!(cert = %cert.display(), error = %imp_api::chain::DisplayChain(&e), "reading the webhook certificate files again failed; serving the one read before");
            }
        }
    }
}

fn read_pem_files(
    cert_path: PathBuf,
    key_path: PathBuf,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), WebhookError> {
    let certs = CertificateDer::pem_file_iter(&cert_path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| WebhookError::Cert {
            path: cert_path.clone(),
            source,
        })?;
    if certs.is_empty() {
        return Err(WebhookError::NoCert { path: cert_path });
    }
    let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|source| WebhookError::Key {
        path: key_path,
        source,
    })?;
    Ok((certs, key))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn self_signed(name: &str) -> CertifiedKey {
        let made = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        let key =
            PrivateKeyDer::from_pem_slice(made.signing_key.serialize_pem().as_bytes()).unwrap();
        certified_key(vec![made.cert.der().clone()], key).unwrap()
    }

    #[test]
    fn a_set_certificate_is_what_the_next_lookup_gets() {
        let (a, b) = (self_signed("a.test"), self_signed("b.test"));
        let (a_der, b_der) = (a.cert[0].to_vec(), b.cert[0].to_vec());
        let live = LiveCert::new(a);
        let before = live.get();
        assert_eq!(live.leaf_der(), Some(a_der.clone()));
        live.set(b);
        assert_eq!(live.leaf_der(), Some(b_der));
        // What a handshake already took stays whole.
        assert_eq!(before.cert[0].to_vec(), a_der);
    }

    /// Writes a new self-signed certificate for `name` into `dir`'s tls.crt and tls.key, as the
    /// kubelet does for a renewed Secret (whole files); its DER.
    fn write_pair(dir: &Path, name: &str) -> Vec<u8> {
        let made = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        std::fs::write(dir.join("tls.crt"), made.cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), made.signing_key.serialize_pem()).unwrap();
        made.cert.der().to_vec()
    }

    #[tokio::test]
    async fn a_certificate_renewed_in_its_files_is_served_and_a_bad_read_keeps_the_last() {
        let dir = std::env::temp_dir().join(format!("imp-tls-follow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = write_pair(&dir, "a.test");
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let live = Arc::new(LiveCert::new(load_files(&cert, &key).await.unwrap()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let follower = tokio::spawn(follow_files(
            cert.clone(),
            key.clone(),
            live.clone(),
            std::time::Duration::from_millis(20),
            async {
                let _ = stopped.await;
            },
        ));
        assert_eq!(live.leaf_der(), Some(first));
        let renewed = write_pair(&dir, "a.test");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while live.leaf_der().as_ref() != Some(&renewed) {
            assert!(
                std::time::Instant::now() < deadline,
                "the renewal was not served"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // A file caught mid-update does not take the certificate away.
        std::fs::write(&cert, "not a certificate").unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(live.leaf_der(), Some(renewed));
        let _ = stop.send(());
        follower.await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let made = rcgen::generate_simple_self_signed(vec!["a.test".to_owned()]).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        let key = PrivateKeyDer::from_pem_slice(other.serialize_pem().as_bytes()).unwrap();
        assert!(certified_key(vec![made.cert.der().clone()], key).is_err());
    }
}
