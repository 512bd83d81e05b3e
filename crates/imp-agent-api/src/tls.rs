//! Mutual TLS between the gateway and a node agent, both ends pinned: the gateway accepts only
//! the certificate whose SHA-256 the agent's Node publishes (`imp.dev/agent-cert-sha256`), and
//! presents its own client certificate, whose SHA-256 the agent finds in the ConfigMap the
//! operator publishes. No CA is involved: the API server vouches for both fingerprints.
//! Handshake signatures are verified as usual, so only the holder of a pinned certificate's
//! key gets through. ring is named explicitly: no process-wide crypto provider is needed.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

/// Why a TLS setting could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A fingerprint is not 64 hex digits.
    #[error("Invalid certificate fingerprint {0:?}: expected a SHA-256 as 64 hex digits")]
    Fingerprint(String),
    /// A PEM text holds no usable certificate or key.
    #[error("Reading {what} from PEM failed")]
    Pem {
        /// "the certificate" or "the private key".
        what: &'static str,
        /// The cause.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// rustls refused the certificate, key or protocol settings.
    #[error("Setting up TLS failed")]
    Rustls(#[source] rustls::Error),
}

/// The SHA-256 of a DER certificate as lowercase hex.
pub fn fingerprint(der: &[u8]) -> String {
    hex(&Sha256::digest(der))
}

/// The SHA-256 of a DER certificate.
pub fn digest(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

/// Bytes as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
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

/// The certificates of a PEM text, in order (empty if it holds none).
pub fn certificates_from_pem(pem: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .collect()
}

/// A client certificate and its key: the gateway's, presented to every agent, or a source
/// agent's own agent certificate, presented to the agent a VM moves to.
pub struct ClientIdentity {
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("fingerprint", &fingerprint(&self.cert))
            .field("key", &"<redacted>")
            .finish()
    }
}

impl ClientIdentity {
    /// The first certificate of `cert_pem` and the private key of `key_pem`.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|source| {
            TlsError::Pem {
                what: "the certificate",
                source,
            }
        })?;
        let key =
            PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|source| TlsError::Pem {
                what: "the private key",
                source,
            })?;
        Ok(Self { cert, key })
    }

    /// A certificate and its key, as rustls holds them (an agent presenting its own
    /// certificate as a client).
    pub fn new(cert: CertificateDer<'static>, key: PrivateKeyDer<'static>) -> Self {
        Self { cert, key }
    }

    /// A DER certificate and its DER (PKCS#8) key.
    pub fn from_der(cert: Vec<u8>, pkcs8_key: Vec<u8>) -> Self {
        Self {
            cert: CertificateDer::from(cert),
            key: PrivateKeyDer::Pkcs8(pkcs8_key.into()),
        }
    }

    /// The certificate's SHA-256 as lowercase hex.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert)
    }

    /// A configuration that presents this identity and accepts only the server certificate
    /// with SHA-256 `server_fingerprint`.
    pub fn pinned_config(&self, server_fingerprint: &str) -> Result<Arc<ClientConfig>, TlsError> {
        let verifier = PinnedCert {
            want: parse_fingerprint(server_fingerprint)?,
            signatures: Signatures::default(),
        };
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Rustls)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(TlsError::Rustls)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// ring, named explicitly.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The handshake-signature checks of ring's algorithms, which every certificate verifier of
/// imp's (pins here, the agent's and the gateway's client verifiers) hands its own three
/// methods to: what a verifier decides is which certificate, never how a signature is checked.
#[derive(Debug, Clone)]
pub struct Signatures(Arc<CryptoProvider>);

impl Default for Signatures {
    fn default() -> Self {
        Self(provider())
    }
}

impl Signatures {
    /// A TLS 1.2 handshake signature made with `cert`'s key.
    pub fn tls12(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    /// A TLS 1.3 handshake signature made with `cert`'s key.
    pub fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    /// The signature schemes ring checks.
    pub fn schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The three handshake-signature methods every rustls verifier of imp has, delegated to its
/// [`Signatures`] field `$field` (a verifier decides which certificate it trusts; how a
/// handshake's signature is checked is the same for all of them). Expands inside an
/// `impl ServerCertVerifier` or `impl ClientCertVerifier` block.
#[macro_export]
macro_rules! delegate_signatures {
    ($field:ident) => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &rustls::pki_types::CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            self.$field.tls12(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &rustls::pki_types::CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            self.$field.tls13(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.$field.schemes()
        }
    };
}

/// Accepts the one certificate whose SHA-256 is `want` (the name is not checked: the pin is
/// stronger), and verifies handshake signatures with it as usual.
#[derive(Debug)]
struct PinnedCert {
    want: [u8; 32],
    signatures: Signatures,
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
        let got = digest(end_entity.as_ref());
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

    crate::delegate_signatures!(signatures);
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
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn fingerprints_parse_in_either_case_with_or_without_colons() {
        let hexed = "ab".repeat(32);
        assert_eq!(parse_fingerprint(&hexed).unwrap(), [0xab; 32]);
        assert_eq!(
            parse_fingerprint(&hexed.to_uppercase()).unwrap(),
            [0xab; 32]
        );
        let colons = vec!["AB"; 32].join(":");
        assert_eq!(parse_fingerprint(&colons).unwrap(), [0xab; 32]);
        for bad in ["", "ab", &"zz".repeat(32), &"é".repeat(32)] {
            assert!(parse_fingerprint(bad).is_err(), "{bad:?}");
        }
        assert_eq!(fingerprint(b"x"), hex(&digest(b"x")));
    }

    #[test]
    fn a_pem_text_gives_its_certificates_and_garbage_none() {
        assert!(certificates_from_pem("no pem here").is_empty());
        assert!(ClientIdentity::from_pem("nope", "nope").is_err());
    }
}
