//! The API's TLS: the agent's certificate and its fingerprint, and the client certificate it
//! asks of every caller.
//!
//! The certificate is self-signed once and kept in the agent's state directory
//! ([`Identity::persistent`]: the same certificate after a restart, so the fingerprint the
//! gateway pins stays), or read from PEM files ([`Identity::from_pem_files`]). Trust does not
//! come from a CA: the agent writes the certificate's SHA-256 into its Node's annotations, the
//! API server vouches for that, and the gateway refuses any other certificate
//! ([`imp_agent_api::tls`]). The other way round, the server asks each caller for a
//! certificate and accepts any whose handshake signature holds ([`AnyClientCert`]): whether it
//! is the gateway's is decided per request against the published fingerprints
//! ([`super::auth`]), so a caller without it gets an HTTP answer saying why rather than a
//! bare TLS alert. ring is named explicitly, so no process-wide crypto provider is needed.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use imp_agent_api::tls::{Signatures, fingerprint, provider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DistinguishedName, ServerConfig};

/// Why a certificate could not be made, read or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Generating the self-signed certificate failed.
    #[error("Generating a self-signed certificate failed")]
    Generate(#[source] rcgen::Error),
    /// A PEM file could not be read or holds nothing usable.
    #[error("Reading {what} from {path} failed")]
    Pem {
        /// "the certificate" or "the private key".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// rustls refused the certificate, key or protocol settings.
    #[error("Setting up TLS failed")]
    Rustls(#[source] rustls::Error),
    /// The kept certificate or key could not be written.
    #[error("Keeping the agent's certificate in {path} failed")]
    Store {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The kept certificate's file in [`Identity::persistent`]'s directory (PEM).
pub const CERT_FILE: &str = "agent-api.crt";

/// The kept private key's file in [`Identity::persistent`]'s directory (PEM, PKCS#8, 0600).
pub const KEY_FILE: &str = "agent-api.key";

/// Where [`Identity::persistent`]'s certificate came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kept {
    /// The files were there and valid: the same certificate as before.
    Reused,
    /// There were no files: a new certificate, now kept.
    Created,
    /// The files were unreadable or did not match: a new certificate replaced them (why).
    Replaced(String),
}

/// The agent's certificate, its private key and the certificate's fingerprint.
#[derive(Debug)]
pub struct Identity {
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    fingerprint: String,
}

impl Identity {
    /// A fresh self-signed certificate (ECDSA P-256) for `names` (DNS names or IP addresses;
    /// they are informative only, since clients pin the fingerprint).
    pub fn self_signed(names: &[String]) -> Result<Self, TlsError> {
        let certified =
            rcgen::generate_simple_self_signed(names.to_vec()).map_err(TlsError::Generate)?;
        let cert = certified.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
        Ok(Self::new(cert, key))
    }

    /// The certificate kept in `dir` ([`CERT_FILE`], [`KEY_FILE`]): read if both files are
    /// there and the key is the certificate's, else self-signed anew for `names` and written
    /// there (the directory 0700, the key 0600, each file replaced atomically), so an agent
    /// restarted on the same state directory presents the same certificate and its Node's
    /// fingerprint annotation stays what clients pin.
    pub fn persistent(dir: &Path, names: &[String]) -> Result<(Self, Kept), TlsError> {
        let (cert, key) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        let why = if cert.exists() || key.exists() {
            match Self::from_pem_files(&cert, &key).and_then(|id| id.server_config().map(|_| id)) {
                Ok(id) => {
                    restrict(&key, 0o600)?;
                    return Ok((id, Kept::Reused));
                }
                Err(e) => Some(imp_api::chain::chain(&e)),
            }
        } else {
            None
        };
        let certified =
            rcgen::generate_simple_self_signed(names.to_vec()).map_err(TlsError::Generate)?;
        let key_der = certified.signing_key.serialize_der();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(store(dir))?;
        restrict(dir, 0o700)?;
        // The key first: a crash between the two leaves a pair that does not match, which the
        // next start replaces.
        write_atomic(&key, pem("PRIVATE KEY", &key_der).as_bytes(), 0o600)?;
        write_atomic(
            &cert,
            pem("CERTIFICATE", certified.cert.der()).as_bytes(),
            0o644,
        )?;
        let id = Self::new(
            certified.cert.der().clone(),
            PrivateKeyDer::Pkcs8(key_der.into()),
        );
        Ok((id, why.map_or(Kept::Created, Kept::Replaced)))
    }

    /// The first certificate of `cert` and the private key of `key` (PEM files).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let pem_err = |what, path: &Path| {
            let path = path.to_owned();
            move |source| TlsError::Pem { what, path, source }
        };
        let der = CertificateDer::from_pem_file(cert).map_err(pem_err("the certificate", cert))?;
        let private = PrivateKeyDer::from_pem_file(key).map_err(pem_err("the private key", key))?;
        Ok(Self::new(der, private))
    }

    fn new(cert: CertificateDer<'static>, key: PrivateKeyDer<'static>) -> Self {
        let fingerprint = fingerprint(&cert);
        Self {
            cert,
            key,
            fingerprint,
        }
    }

    /// The certificate's SHA-256 as lowercase hex: the Node annotation's value.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The certificate (DER).
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// This certificate as a client's: what the agent presents to the agent of the node a VM
    /// moves to, which checks it against the fingerprint this agent's Node publishes.
    pub fn client_identity(&self) -> imp_agent_api::tls::ClientIdentity {
        imp_agent_api::tls::ClientIdentity::new(self.cert.clone(), self.key.clone_key())
    }

    /// A server configuration presenting this certificate and asking each caller for one
    /// ([`AnyClientCert`]); HTTP/1.1 only: exec upgrades.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = AnyClientCert {
            signatures: Signatures::default(),
        };
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .with_client_cert_verifier(Arc::new(verifier))
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(TlsError::Rustls)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// `der` as a PEM block labelled `label`.
pub(crate) fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn store(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError {
    let path = path.to_owned();
    move |source| TlsError::Store { path, source }
}

fn restrict(path: &Path, mode: u32) -> Result<(), TlsError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(store(path))
}

/// Writes `path` through a temporary file in its directory, created with `mode`, synced and
/// renamed over it.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(store(path)(e));
    }
    Ok(())
}

/// Asks each caller for a certificate, accepts a connection without one, and accepts any
/// certificate whose holder signs the handshake with its key: which certificates are the
/// gateway's is decided per request ([`super::auth`]), from the connection's peer certificate.
#[derive(Debug)]
pub struct AnyClientCert {
    signatures: Signatures,
}

impl ClientCertVerifier for AnyClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    imp_agent_api::delegate_signatures!(signatures);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_self_signed_identity_has_the_sha256_of_its_certificate_as_fingerprint() {
        let id = Identity::self_signed(&["node-1".into(), "127.0.0.1".into()]).unwrap();
        let fp = id.fingerprint();
        assert_eq!(fp.len(), 64);
        assert!(
            fp.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert_eq!(fp, fingerprint(id.certificate()));
        let other = Identity::self_signed(&["node-1".into()]).unwrap();
        assert_ne!(fp, other.fingerprint(), "each start makes a new key");
        id.server_config().unwrap();
    }

    #[test]
    fn a_kept_certificate_is_reused_and_replaced_when_it_is_unusable() {
        use std::os::unix::fs::PermissionsExt;
        let root = std::env::temp_dir().join(format!("imp-api-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("state/tls");
        let names = ["node-1".to_owned()];
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;

        let (first, kept) = Identity::persistent(&dir, &names).unwrap();
        assert_eq!(kept, Kept::Created);
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(KEY_FILE)), 0o600);
        first.server_config().unwrap();
        // The files are ordinary PEM, usable as --tls-cert/--tls-key too.
        let from_files =
            Identity::from_pem_files(&dir.join(CERT_FILE), &dir.join(KEY_FILE)).unwrap();
        assert_eq!(from_files.fingerprint(), first.fingerprint());

        // A restart: the same certificate; a key left readable by others is restricted again.
        std::fs::set_permissions(dir.join(KEY_FILE), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let (again, kept) = Identity::persistent(&dir, &names).unwrap();
        assert_eq!(kept, Kept::Reused);
        assert_eq!(again.fingerprint(), first.fingerprint());
        assert_eq!(mode(&dir.join(KEY_FILE)), 0o600);

        // Garbage in the key: a new certificate replaces both, and is kept from then on.
        std::fs::write(dir.join(KEY_FILE), "not a key").unwrap();
        let (replaced, kept) = Identity::persistent(&dir, &names).unwrap();
        assert!(
            matches!(&kept, Kept::Replaced(why) if why.contains(KEY_FILE)),
            "{kept:?}"
        );
        assert_ne!(replaced.fingerprint(), first.fingerprint());
        let (after, kept) = Identity::persistent(&dir, &names).unwrap();
        assert_eq!(
            (after.fingerprint(), kept),
            (replaced.fingerprint(), Kept::Reused)
        );

        // Another certificate's key: the pair does not match and is replaced.
        let (other, _) = Identity::persistent(&root.join("other"), &names).unwrap();
        std::fs::copy(root.join("other").join(KEY_FILE), dir.join(KEY_FILE)).unwrap();
        let (fixed, kept) = Identity::persistent(&dir, &names).unwrap();
        assert!(matches!(kept, Kept::Replaced(_)), "{kept:?}");
        assert_ne!(fixed.fingerprint(), other.fingerprint());
        assert_ne!(fixed.fingerprint(), replaced.fingerprint());
        fixed.server_config().unwrap();

        // Only one file left (the other deleted): replaced as well.
        std::fs::remove_file(dir.join(CERT_FILE)).unwrap();
        let (_, kept) = Identity::persistent(&dir, &names).unwrap();
        assert!(matches!(kept, Kept::Replaced(_)), "{kept:?}");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left.len(), 2, "no temporaries are left: {left:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn pem_files_load_and_a_missing_file_is_named() {
        let dir = std::env::temp_dir().join(format!("imp-api-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let certified = rcgen::generate_simple_self_signed(vec!["x".to_owned()]).unwrap();
        std::fs::write(
            dir.join("tls.crt"),
            pem("CERTIFICATE", certified.cert.der()),
        )
        .unwrap();
        let key = certified.signing_key.serialize_der();
        std::fs::write(dir.join("tls.key"), pem("PRIVATE KEY", &key)).unwrap();
        let id = Identity::from_pem_files(&dir.join("tls.crt"), &dir.join("tls.key")).unwrap();
        assert_eq!(id.fingerprint(), fingerprint(certified.cert.der()));
        id.server_config().unwrap();
        let err = Identity::from_pem_files(&dir.join("nope.crt"), &dir.join("tls.key"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the certificate") && err.contains("nope.crt"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
