//! The control plane's certificates, made fresh for each one: a CA that signs the API server's
//! serving certificate and every client certificate (kube-apiserver's `--client-ca-file`), and
//! the ServiceAccount signing key. ECDSA P-256 throughout (rcgen's default with ring).

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A PEM certificate and its PEM (PKCS#8) private key.
#[derive(Debug, Clone)]
pub struct Pair {
    /// The certificate.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// One control plane's certificate authority.
pub struct Pki {
    ca_pem: String,
    ca: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

impl Pki {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Result<Self, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        Ok(Pki {
            ca_pem: cert.pem(),
            ca: Issuer::new(params, key),
        })
    }

    /// The CA certificate (PEM), the trust anchor of every client and the `caBundle` of webhooks.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A serving certificate for `names` (IP addresses and DNS names).
    pub fn serving(&self, names: &[String]) -> Result<Pair, rcgen::Error> {
        let mut params = CertificateParams::new(names.to_vec())?;
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().map_or("server", |n| n));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(&params)
    }

    /// A client certificate for user `user` in `groups` (the API server reads the user from the
    /// CN and groups from the O entries; rcgen writes one O, so at most one group).
    pub fn client(&self, user: &str, group: Option<&str>) -> Result<Pair, rcgen::Error> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, user);
        if let Some(g) = group {
            params.distinguished_name.push(DnType::OrganizationName, g);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(&params)
    }

    fn sign(&self, params: &CertificateParams) -> Result<Pair, rcgen::Error> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca)?;
        Ok(Pair {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

/// A fresh key pair for signing ServiceAccount tokens: (private key PEM in PKCS#8, public key
/// PEM), for kube-apiserver's `--service-account-signing-key-file` and `--service-account-key-file`.
pub fn signing_key() -> Result<(String, String), rcgen::Error> {
    let k = KeyPair::generate()?;
    Ok((k.serialize_pem(), k.public_key_pem()))
}
