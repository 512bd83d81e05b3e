//! The API's TLS: the agent's certificate and its fingerprint, and the clients' verifier that
//! accepts exactly the certificate whose fingerprint the Node publishes.
//!
//! The certificate is self-signed at start ([`Identity::self_signed`]) or read from PEM files
//! ([`Identity::from_pem_files`]). Trust does not come from a CA: the agent writes the
//! certificate's SHA-256 into its Node's annotations, the API server vouches for that, and
//! [`pinned_client_config`] refuses any other certificate. Handshake signatures are still
//! verified, so only the holder of the pinned certificate's key can answer. Both sides use ring
//! explicitly, so no process-wide crypto provider needs installing.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use sha2::{Digest, Sha256};

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
    /// A fingerprint is not 64 hex digits.
    #[error("Invalid certificate fingerprint {0:?}: expected a SHA-256 as 64 hex digits")]
    Fingerprint(String),
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

    /// A server configuration presenting this certificate (HTTP/1.1 only: exec upgrades).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .with_no_client_auth()
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(TlsError::Rustls)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The SHA-256 of a DER certificate as lowercase hex.
pub fn fingerprint(der: &[u8]) -> String {
    hex(&Sha256::digest(der))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a fingerprint: 64 hex digits, either case, optionally in colon-separated pairs.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], TlsError> {
    let digits: String = s.trim().chars().filter(|c| *c != ':').collect();
    let bad = || TlsError::Fingerprint(s.to_owned());
    if digits.len() != 64 || !digits.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        let pair = digits.get(2 * i..2 * i + 2).ok_or_else(bad)?;
        *byte = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// A client configuration that accepts only the certificate with this SHA-256 fingerprint.
pub fn pinned_client_config(fingerprint: &str) -> Result<Arc<ClientConfig>, TlsError> {
    let verifier = PinnedCert {
        want: parse_fingerprint(fingerprint)?,
        provider: provider(),
    };
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts the one certificate whose SHA-256 is `want` (the name is not checked: the pin is
/// stronger), and verifies handshake signatures with it as usual.
#[derive(Debug)]
struct PinnedCert {
    want: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if got == self.want {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Other(rustls::OtherError(Arc::new(Mismatch {
                    got: hex(&got),
                    want: hex(&self.want),
                }))),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The server's certificate is not the pinned one.
#[derive(Debug, thiserror::Error)]
#[error("the agent's certificate has SHA-256 {got}, but its Node's annotation pins {want}")]
struct Mismatch {
    got: String,
    want: String,
}

#[cfg(test)]
mod tests {
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
    fn fingerprints_parse_in_either_case_with_or_without_colons() {
        let lower = "00".repeat(31) + "ff";
        let want = {
            let mut w = [0u8; 32];
            w[31] = 0xff;
            w
        };
        assert_eq!(parse_fingerprint(&lower).unwrap(), want);
        assert_eq!(
            parse_fingerprint(&lower.to_uppercase()).unwrap(),
            want,
            "uppercase"
        );
        let colons = vec!["00"; 31].join(":") + ":FF";
        assert_eq!(parse_fingerprint(&colons).unwrap(), want);
        for bad in ["", "abc", &"g".repeat(64), &"0".repeat(63), &"é".repeat(32)] {
            let err = parse_fingerprint(bad).unwrap_err();
            assert!(err.to_string().contains("64 hex digits"), "{bad}: {err}");
        }
        assert!(pinned_client_config("nope").is_err());
    }

    fn pem(label: &str, der: &[u8]) -> String {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
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
