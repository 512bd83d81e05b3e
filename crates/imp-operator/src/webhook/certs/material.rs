//! What the webhook's Secret holds, parsed into a [`Material`], and the certificates that
//! replace it, made with rcgen.
//!
//! Parsing checks everything a decision relies on, so a [`Material`] always has a CA first in
//! `ca.crt` whose key is `ca.key`, and a serving certificate whose key is `tls.key` and which one
//! of the CAs signed; anything else is [`Unusable`] and is replaced whole.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::ByteString;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer;

use super::{Names, Policy, secs};

/// Key of the serving certificate in the Secret.
pub const TLS_CRT: &str = "tls.crt";
/// Key of the serving certificate's private key.
pub const TLS_KEY: &str = "tls.key";
/// Key of the CAs to trust, the signing one first.
pub const CA_CRT: &str = "ca.crt";
/// Key of the signing CA's private key.
pub const CA_KEY: &str = "ca.key";

/// How far before its making a certificate's notBefore is set, so that an API server whose
/// clock is a little behind accepts it; [`Cert::issued_at`] counts from the making.
pub const BACKDATE_SECS: i64 = 60;

/// One certificate, with what the decisions read (times in Unix seconds, X.509's resolution).
#[derive(Clone, PartialEq, Eq)]
pub struct Cert {
    /// The DER encoding.
    pub der: Vec<u8>,
    /// Start of validity.
    pub not_before: i64,
    /// End of validity.
    pub not_after: i64,
    /// The serial number, hex bytes separated by `:` (as openssl prints it).
    pub serial: String,
    /// DNS names of the subjectAltName extension.
    pub dns: Vec<String>,
    /// IP addresses of the subjectAltName extension.
    pub ips: Vec<IpAddr>,
    /// Whether basicConstraints says CA.
    pub is_ca: bool,
    /// The subject public key's bits, to match a private key against.
    public_key: Vec<u8>,
}

impl fmt::Debug for Cert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cert")
            .field("serial", &self.serial)
            .field("not_before", &super::rfc3339(self.not_before))
            .field("not_after", &super::rfc3339(self.not_after))
            .field("is_ca", &self.is_ca)
            .finish_non_exhaustive()
    }
}

impl Cert {
    /// Parses a DER certificate; the error says what is wrong with it.
    pub fn parse(der: &[u8]) -> Result<Self, String> {
        let (_, x) = X509Certificate::from_der(der).map_err(|e| e.to_string())?;
        let validity = x.validity();
        let mut dns = Vec::new();
        let mut ips = Vec::new();
        if let Some(san) = x.subject_alternative_name().map_err(|e| e.to_string())? {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(n) => dns.push((*n).to_owned()),
                    GeneralName::IPAddress(b) => {
                        if let Some(ip) = ip_from(b) {
                            ips.push(ip);
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(Cert {
            der: der.to_vec(),
            not_before: validity.not_before.timestamp(),
            not_after: validity.not_after.timestamp(),
            serial: x.raw_serial_as_string(),
            dns,
            ips,
            is_ca: x.is_ca(),
            public_key: x.public_key().subject_public_key.data.to_vec(),
        })
    }

    /// The certificate as one PEM block.
    pub fn pem(&self) -> String {
        pem_block("CERTIFICATE", &self.der)
    }

    /// When it was made: notBefore plus the [`BACKDATE_SECS`] new certificates carry.
    pub fn issued_at(&self) -> i64 {
        self.not_before
            .saturating_add(BACKDATE_SECS)
            .min(self.not_after)
    }

    /// When two thirds of its life since [`Self::issued_at`] have passed.
    pub fn renew_at(&self) -> i64 {
        let issued = self.issued_at();
        issued.saturating_add(self.not_after.saturating_sub(issued).saturating_mul(2) / 3)
    }

    /// Whether it is no longer valid at `now`.
    pub fn expired(&self, now: i64) -> bool {
        now >= self.not_after
    }

    /// Whether `ca`'s key made this certificate's signature.
    pub fn signed_by(&self, ca: &Cert) -> bool {
        let (Ok((_, leaf)), Ok((_, issuer))) = (
            X509Certificate::from_der(&self.der),
            X509Certificate::from_der(&ca.der),
        ) else {
            return false;
        };
        leaf.verify_signature(Some(issuer.public_key())).is_ok()
    }

    /// Whether it holds every name of `names`.
    pub fn covers(&self, names: &Names) -> bool {
        names.dns.iter().all(|n| self.dns.contains(n))
            && names.ips.iter().all(|i| self.ips.contains(i))
    }

    fn matches_key(&self, key: &KeyPair) -> bool {
        rcgen::PublicKeyData::der_bytes(key) == self.public_key.as_slice()
    }
}

fn ip_from(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from),
        _ => None,
    }
}

/// A DER object as a PEM block with 64-column lines.
fn pem_block(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The DER of every certificate in a PEM bundle (a `caBundle`, `ca.crt`).
pub fn pem_certs(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    CertificateDer::pem_slice_iter(bytes)
        .map(|c| c.map(|c| c.as_ref().to_vec()).map_err(|e| e.to_string()))
        .collect()
}

/// Why what a Secret holds cannot be used (it is then replaced by a new CA and certificate).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// A key of the Secret is missing.
    #[error("it has no {0}")]
    Missing(&'static str),
    /// A key holds no certificate, or PEM that does not decode.
    #[error("{key} holds no readable PEM certificate: {detail}")]
    NoCert {
        /// The Secret's key.
        key: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A certificate does not parse as X.509.
    #[error("a certificate in {key} does not parse: {detail}")]
    BadCert {
        /// The Secret's key.
        key: &'static str,
        /// What the parser said.
        detail: String,
    },
    /// A private key does not parse.
    #[error("{key} is not a PEM private key: {detail}")]
    BadKey {
        /// The Secret's key.
        key: &'static str,
        /// What the parser said.
        detail: String,
    },
    /// The first certificate of `ca.crt` is not a CA.
    #[error("the first certificate of ca.crt is not a CA")]
    NotCa,
    /// A private key is not the key of its certificate.
    #[error("{key} is not the key of {cert}")]
    KeyMismatch {
        /// The key's Secret key.
        key: &'static str,
        /// The certificate's Secret key.
        cert: &'static str,
    },
    /// No CA of `ca.crt` signed `tls.crt`.
    #[error("no CA of ca.crt signed tls.crt")]
    Unsigned,
}

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    /// rcgen refused the parameters or the key.
    #[error("Making the webhook {what} with rcgen")]
    Rcgen {
        /// The CA or the serving certificate.
        what: &'static str,
        /// What rcgen said.
        #[source]
        source: rcgen::Error,
    },
    /// A validity bound is outside what a certificate can carry.
    #[error("The webhook certificate time @{0} is out of range")]
    Time(i64),
    /// A certificate just made does not parse back.
    #[error("The webhook {what} just made does not parse: {detail}")]
    Parse {
        /// The CA or the serving certificate.
        what: &'static str,
        /// What the parser said.
        detail: String,
    },
}

/// The webhook's certificates, as its Secret holds them.
#[derive(Clone, PartialEq, Eq)]
pub struct Material {
    /// The CAs to trust; the first one signs.
    pub cas: Vec<Cert>,
    /// PEM PKCS#8 key of `cas[0]`.
    ca_key: String,
    /// The serving certificate.
    pub serving: Cert,
    /// PEM PKCS#8 key of the serving certificate.
    serving_key: String,
    /// Which of `cas` signed `serving`.
    pub serving_signer: usize,
}

impl fmt::Debug for Material {
    /// Never the keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Material")
            .field("cas", &self.cas)
            .field("serving", &self.serving)
            .field("serving_signer", &self.serving_signer)
            .finish_non_exhaustive()
    }
}

fn entry<'a>(
    data: &'a BTreeMap<String, ByteString>,
    key: &'static str,
) -> Result<&'a [u8], Unusable> {
    data.get(key)
        .map(|b| b.0.as_slice())
        .filter(|b| !b.is_empty())
        .ok_or(Unusable::Missing(key))
}

fn certs_of(data: &BTreeMap<String, ByteString>, key: &'static str) -> Result<Vec<Cert>, Unusable> {
    let ders = pem_certs(entry(data, key)?).map_err(|detail| Unusable::NoCert { key, detail })?;
    if ders.is_empty() {
        return Err(Unusable::NoCert {
            key,
            detail: "no CERTIFICATE block".to_owned(),
        });
    }
    ders.iter()
        .map(|d| Cert::parse(d).map_err(|detail| Unusable::BadCert { key, detail }))
        .collect()
}

fn key_of(
    data: &BTreeMap<String, ByteString>,
    key: &'static str,
) -> Result<(String, KeyPair), Unusable> {
    let pem = String::from_utf8(entry(data, key)?.to_vec()).map_err(|e| Unusable::BadKey {
        key,
        detail: e.to_string(),
    })?;
    let pair = KeyPair::from_pem(&pem).map_err(|e| Unusable::BadKey {
        key,
        detail: e.to_string(),
    })?;
    Ok((pem, pair))
}

impl Material {
    /// Reads a Secret's data; the error says why it cannot be used.
    pub fn from_data(data: &BTreeMap<String, ByteString>) -> Result<Self, Unusable> {
        let cas = certs_of(data, CA_CRT)?;
        let (ca_key, ca_pair) = key_of(data, CA_KEY)?;
        if !cas[0].is_ca {
            return Err(Unusable::NotCa);
        }
        if !cas[0].matches_key(&ca_pair) {
            return Err(Unusable::KeyMismatch {
                key: CA_KEY,
                cert: CA_CRT,
            });
        }
        let serving = certs_of(data, TLS_CRT)?.swap_remove(0);
        let (serving_key, serving_pair) = key_of(data, TLS_KEY)?;
        if !serving.matches_key(&serving_pair) {
            return Err(Unusable::KeyMismatch {
                key: TLS_KEY,
                cert: TLS_CRT,
            });
        }
        let serving_signer = cas
            .iter()
            .position(|ca| serving.signed_by(ca))
            .ok_or(Unusable::Unsigned)?;
        Ok(Material {
            cas,
            ca_key,
            serving,
            serving_key,
            serving_signer,
        })
    }

    /// The Secret's data.
    pub fn to_data(&self) -> BTreeMap<String, ByteString> {
        let cas: String = self.cas.iter().map(Cert::pem).collect();
        [
            (TLS_CRT, self.serving.pem()),
            (TLS_KEY, self.serving_key.clone()),
            (CA_CRT, cas),
            (CA_KEY, self.ca_key.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), ByteString(v.into_bytes())))
        .collect()
    }

    /// The serving certificate's PEM private key.
    pub fn serving_key_pem(&self) -> &str {
        &self.serving_key
    }

    /// A new CA and a serving certificate it signed, made at `now`.
    pub fn issue(policy: &Policy, now: i64) -> Result<Self, IssueError> {
        let (ca, ca_key) = new_ca(now, policy.ca_validity())?;
        let (serving, serving_key) = new_serving(&ca, &ca_key, policy, now)?;
        Ok(Material {
            cas: vec![ca],
            ca_key,
            serving,
            serving_key,
            serving_signer: 0,
        })
    }

    /// A new CA in front of the others, and a fresh serving certificate from the old one (still
    /// trusted), so that the serving certificate lasts while the new CA gets published.
    pub fn with_new_ca(&self, policy: &Policy, now: i64) -> Result<Self, IssueError> {
        let (serving, serving_key) = new_serving(&self.cas[0], &self.ca_key, policy, now)?;
        let (ca, ca_key) = new_ca(now, policy.ca_validity())?;
        let mut cas = vec![ca];
        cas.extend(self.cas.iter().cloned());
        Ok(Material {
            cas,
            ca_key,
            serving,
            serving_key,
            serving_signer: 1,
        })
    }

    /// A new serving certificate signed by the first CA.
    pub fn with_new_serving(&self, policy: &Policy, now: i64) -> Result<Self, IssueError> {
        let (serving, serving_key) = new_serving(&self.cas[0], &self.ca_key, policy, now)?;
        Ok(Material {
            cas: self.cas.clone(),
            ca_key: self.ca_key.clone(),
            serving,
            serving_key,
            serving_signer: 0,
        })
    }

    /// Only the first CA (it signed the serving certificate).
    pub fn without_old_cas(&self) -> Self {
        Material {
            cas: self.cas[..1].to_vec(),
            serving_signer: 0,
            ..self.clone()
        }
    }
}

fn time(unix: i64) -> Result<time::OffsetDateTime, IssueError> {
    time::OffsetDateTime::from_unix_timestamp(unix).map_err(|_| IssueError::Time(unix))
}

fn validity(
    params: &mut CertificateParams,
    now: i64,
    lifetime: Duration,
    cap: i64,
) -> Result<(), IssueError> {
    params.not_before = time(now.saturating_sub(BACKDATE_SECS))?;
    params.not_after = time(now.saturating_add(secs(lifetime)).min(cap))?;
    Ok(())
}

/// A self-signed CA made at `now`, and its PEM key. Its common name carries the time, so two
/// CAs in one bundle never share a subject.
fn new_ca(now: i64, lifetime: Duration) -> Result<(Cert, String), IssueError> {
    let rcgen_err = |source| IssueError::Rcgen { what: "CA", source };
    let key = KeyPair::generate().map_err(rcgen_err)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "imp");
    dn.push(DnType::CommonName, format!("imp-webhook-ca@{now}"));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, now, lifetime, i64::MAX)?;
    let cert = params.self_signed(&key).map_err(rcgen_err)?;
    let parsed =
        Cert::parse(cert.der()).map_err(|detail| IssueError::Parse { what: "CA", detail })?;
    Ok((parsed, key.serialize_pem()))
}

/// A serving certificate for the policy's names, signed by `ca` (key `ca_key`), made at `now`
/// and ending no later than `ca`.
fn new_serving(
    ca: &Cert,
    ca_key: &str,
    policy: &Policy,
    now: i64,
) -> Result<(Cert, String), IssueError> {
    let rcgen_err = |source| IssueError::Rcgen {
        what: "serving certificate",
        source,
    };
    let signer = KeyPair::from_pem(ca_key).map_err(rcgen_err)?;
    let issuer = Issuer::from_ca_cert_der(&CertificateDer::from(ca.der.as_slice()), signer)
        .map_err(rcgen_err)?;
    let key = KeyPair::generate().map_err(rcgen_err)?;
    let names = policy.names();
    let mut params = CertificateParams::default();
    let mut sans = Vec::new();
    for n in &names.dns {
        sans.push(SanType::DnsName(n.clone().try_into().map_err(rcgen_err)?));
    }
    sans.extend(names.ips.iter().copied().map(SanType::IpAddress));
    params.subject_alt_names = sans;
    let cn = names
        .dns
        .first()
        .cloned()
        .or_else(|| names.ips.first().map(IpAddr::to_string))
        .unwrap_or_default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, now, policy.serving_validity(), ca.not_after)?;
    let cert = params.signed_by(&key, &issuer).map_err(rcgen_err)?;
    let parsed = Cert::parse(cert.der()).map_err(|detail| IssueError::Parse {
        what: "serving certificate",
        detail,
    })?;
    Ok((parsed, key.serialize_pem()))
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    pub(crate) const T0: i64 = 1_900_000_000;

    pub(crate) fn policy(serving: u64, ca: u64) -> Policy {
        Policy::new(
            Names::for_service(
                "imp-webhook",
                "imp-system",
                &[],
                &["127.0.0.1".parse().unwrap()],
            ),
            Duration::from_secs(serving),
            Duration::from_secs(ca),
        )
        .unwrap()
    }

    #[test]
    fn issued_material_round_trips_through_the_secret() {
        let p = policy(600, 6000);
        let m = Material::issue(&p, T0).unwrap();
        let back = Material::from_data(&m.to_data()).unwrap();
        assert_eq!(back, m);
        assert!(m.cas[0].is_ca && !m.serving.is_ca);
        assert!(m.serving.covers(p.names()), "{:?}", m.serving.dns);
        assert_eq!(m.serving.issued_at(), T0);
        assert_eq!(m.serving.not_after, T0 + 600);
        assert_eq!(m.cas[0].not_after, T0 + 6000);
        assert_eq!(m.serving.renew_at(), T0 + 400);
        assert!(m.serving.signed_by(&m.cas[0]));
        // The key never shows in logs.
        assert!(!format!("{m:?}").contains("PRIVATE KEY"));
    }

    #[test]
    fn a_serving_certificate_never_outlives_its_ca() {
        let p = policy(600, 1800);
        let m = Material::issue(&p, T0).unwrap();
        let late = m.with_new_serving(&p, T0 + 1500).unwrap();
        assert_eq!(late.serving.not_after, m.cas[0].not_after);
    }

    #[test]
    fn a_new_ca_goes_first_and_the_old_one_signs_a_last_serving_certificate() {
        let p = policy(600, 1800);
        let m = Material::issue(&p, T0).unwrap();
        let rotated = m.with_new_ca(&p, T0 + 1200).unwrap();
        assert_eq!(rotated.cas.len(), 2);
        assert_eq!(rotated.cas[1], m.cas[0]);
        assert_ne!(rotated.cas[0], m.cas[0]);
        assert_ne!(rotated.serving, m.serving);
        assert!(rotated.serving.signed_by(&m.cas[0]));
        assert_eq!(rotated.serving.issued_at(), T0 + 1200);
        assert_eq!(rotated.serving_signer, 1);
        // It survives the Secret, and the new CA signs what comes next.
        let back = Material::from_data(&rotated.to_data()).unwrap();
        assert_eq!(back, rotated);
        let renewed = back.with_new_serving(&p, T0 + 1210).unwrap();
        assert!(renewed.serving.signed_by(&renewed.cas[0]));
        assert!(!renewed.serving.signed_by(&renewed.cas[1]));
        assert_eq!(renewed.without_old_cas().cas, renewed.cas[..1]);
    }

    fn with(m: &Material, key: &str, value: &[u8]) -> BTreeMap<String, ByteString> {
        let mut d = m.to_data();
        d.insert(key.to_owned(), ByteString(value.to_vec()));
        d
    }

    #[test]
    fn what_cannot_be_used_says_why() {
        let p = policy(600, 6000);
        let m = Material::issue(&p, T0).unwrap();
        let other = Material::issue(&p, T0).unwrap();
        let mut d = m.to_data();
        d.remove(CA_KEY);
        assert_eq!(Material::from_data(&d), Err(Unusable::Missing(CA_KEY)));
        assert!(matches!(
            Material::from_data(&with(&m, TLS_CRT, b"garbage")),
            Err(Unusable::NoCert { key: TLS_CRT, .. })
        ));
        assert!(matches!(
            Material::from_data(&with(
                &m,
                CA_KEY,
                b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
            )),
            Err(Unusable::BadKey { key: CA_KEY, .. })
        ));
        assert_eq!(
            Material::from_data(&with(&m, TLS_KEY, other.serving_key.as_bytes())),
            Err(Unusable::KeyMismatch {
                key: TLS_KEY,
                cert: TLS_CRT
            })
        );
        assert_eq!(
            Material::from_data(&with(&m, CA_KEY, other.ca_key.as_bytes())),
            Err(Unusable::KeyMismatch {
                key: CA_KEY,
                cert: CA_CRT
            })
        );
        // A serving certificate from another CA.
        let mut d = with(&m, TLS_CRT, other.serving.pem().as_bytes());
        d.insert(
            TLS_KEY.into(),
            ByteString(other.serving_key.clone().into_bytes()),
        );
        assert_eq!(Material::from_data(&d), Err(Unusable::Unsigned));
        // A leaf where the CA should be.
        let mut d = with(&m, CA_CRT, m.serving.pem().as_bytes());
        d.insert(
            CA_KEY.into(),
            ByteString(m.serving_key.clone().into_bytes()),
        );
        assert_eq!(Material::from_data(&d), Err(Unusable::NotCa));
    }

    #[test]
    fn a_bundle_reads_back_in_order() {
        let p = policy(600, 6000);
        let (a, b) = (
            Material::issue(&p, T0).unwrap(),
            Material::issue(&p, T0).unwrap(),
        );
        let bundle = format!("{}{}", a.cas[0].pem(), b.cas[0].pem());
        assert_eq!(
            pem_certs(bundle.as_bytes()).unwrap(),
            [a.cas[0].der.clone(), b.cas[0].der.clone()]
        );
        assert_eq!(pem_certs(b"").unwrap(), Vec::<Vec<u8>>::new());
    }
}
