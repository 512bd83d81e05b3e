//! The gateway's client certificates, the one credential node agents accept.
//!
//! Each operator replica makes its own key and self-signed certificate when it starts and keeps
//! the key in memory only. No Secret holds it: agents read Secrets (a VM's pull secrets, its
//! environment), so a key kept in one would let a compromised node act as the gateway towards
//! every other node. Each replica publishes only its certificate, in ConfigMap
//! `<namespace>/imp-gateway-client` under a key of its own (`<unix time>-<replica>.crt`), which
//! every agent reads and pins ([`imp-agent`'s `api::auth`]). A replica that restarts publishes
//! a new certificate and drops its old entry; the entries of replicas that are gone are harmless
//! (their keys died with them) and the oldest are dropped beyond [`MAX_ENTRIES`]. Each replica
//! looks at its entry every [`KEEP_EVERY`] and writes it again if it is gone.

use std::collections::BTreeMap;
use std::time::Duration;

use imp_agent_api::tls::ClientIdentity;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

/// Name of the ConfigMap.
pub const NAME: &str = "imp-gateway-client";
/// The most certificates the ConfigMap holds (the oldest are dropped first).
pub const MAX_ENTRIES: usize = 16;
/// How often a replica looks that its certificate is still published.
pub const KEEP_EVERY: Duration = Duration::from_secs(60);
/// How many times a write lost to another replica is tried again at once.
const WRITE_ATTEMPTS: usize = 5;

/// Why the identity could not be made or published.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The API server refused or failed a read or write.
    #[error("{what} ConfigMap {namespace}/{NAME} failed")]
    Kube {
        /// What was done ("reading", "creating", "updating").
        what: &'static str,
        /// The namespace.
        namespace: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// Other replicas kept writing the ConfigMap between this one's read and write.
    #[error("ConfigMap {namespace}/{NAME} changed under each of {WRITE_ATTEMPTS} writes")]
    Contended {
        /// The namespace.
        namespace: String,
    },
    /// Making the certificate failed.
    #[error("Generating the gateway's client certificate failed")]
    Generate(#[source] rcgen::Error),
    /// The certificate made could not be used (never expected).
    #[error("Using the gateway's client certificate failed")]
    Unusable(#[source] imp_agent_api::tls::TlsError),
}

/// A fresh self-signed client certificate: the identity (key in memory) and its PEM.
pub fn generate() -> Result<(ClientIdentity, String), IdentityError> {
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(IdentityError::Generate)?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "imp-gateway");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let key = rcgen::KeyPair::generate().map_err(IdentityError::Generate)?;
    let cert = params.self_signed(&key).map_err(IdentityError::Generate)?;
    let identity = ClientIdentity::from_pem(&cert.pem(), &key.serialize_pem())
        .map_err(IdentityError::Unusable)?;
    Ok((identity, cert.pem()))
}

/// The ConfigMap key of replica `replica`'s certificate made at `unix` (characters a key may
/// not hold become `_`); keys sort by time.
pub fn entry_key(replica: &str, unix: i64) -> String {
    let name: String = replica
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' | '.' => c,
            _ => '_',
        })
        .collect();
    format!("{unix:011}-{name}.crt")
}

/// The replica part of an entry key (after the time).
fn replica_of(key: &str) -> Option<&str> {
    key.split_once('-')
        .and_then(|(_, rest)| rest.strip_suffix(".crt"))
}

/// The ConfigMap's data with `cert` under `key`: any older entry of the same replica dropped,
/// then the oldest entries beyond [`MAX_ENTRIES`].
pub fn with_entry(
    mut data: BTreeMap<String, String>,
    key: &str,
    cert: &str,
) -> BTreeMap<String, String> {
    let replica = replica_of(key);
    data.retain(|k, _| k == key || replica.is_none() || replica_of(k) != replica);
    data.insert(key.to_owned(), cert.to_owned());
    while data.len() > MAX_ENTRIES {
        let Some(oldest) = data.keys().find(|k| *k != key).cloned() else {
            break;
        };
        data.remove(&oldest);
    }
    data
}

/// Publishes `cert` under `key` in the ConfigMap (created if absent), unless it is there.
pub async fn publish(
    client: &kube::Client,
    namespace: &str,
    key: &str,
    cert: &str,
) -> Result<(), IdentityError> {
    let maps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    let kube = |what| {
        let namespace = namespace.to_owned();
        move |source| IdentityError::Kube {
            what,
            namespace,
            source,
        }
    };
    for _ in 0..WRITE_ATTEMPTS {
        let written = match maps.get_opt(NAME).await.map_err(kube("reading"))? {
            Some(cm)
                if cm
                    .data
                    .as_ref()
                    .and_then(|d| d.get(key))
                    .map(String::as_str)
                    == Some(cert) =>
            {
                return Ok(());
            }
            Some(mut cm) => {
                cm.data = Some(with_entry(cm.data.take().unwrap_or_default(), key, cert));
                maps.replace(NAME, &PostParams::default(), &cm)
                    .await
                    .map(drop)
            }
            None => {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(NAME.into()),
                        ..ObjectMeta::default()
                    },
                    data: Some(with_entry(BTreeMap::new(), key, cert)),
                    ..ConfigMap::default()
                };
                maps.create(&PostParams::default(), &cm).await.map(drop)
            }
        };
        match written {
            Ok(()) => return Ok(()),
            // Another replica wrote first: read again.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(kube("writing")(e)),
        }
    }
    Err(IdentityError::Contended {
        namespace: namespace.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_generated_certificate_is_a_usable_identity() {
        let (id, pem) = generate().unwrap();
        assert_eq!(id.fingerprint().len(), 64);
        assert!(pem.contains("BEGIN CERTIFICATE"));
        let (other, _) = generate().unwrap();
        assert_ne!(id.fingerprint(), other.fingerprint(), "a key per replica");
    }

    #[test]
    fn keys_sort_by_time_and_hold_only_allowed_characters() {
        let a = entry_key("imp-controller-manager-7d9/x:1", 1_700_000_000);
        assert_eq!(a, "01700000000-imp-controller-manager-7d9_x_1.crt");
        assert!(entry_key("r", 9) < entry_key("r", 10));
        assert_eq!(replica_of(&a), Some("imp-controller-manager-7d9_x_1"));
    }

    #[test]
    fn a_replica_replaces_its_own_entry_and_the_oldest_go_beyond_the_limit() {
        let data = with_entry(BTreeMap::new(), &entry_key("a", 1), "A1");
        let data = with_entry(data, &entry_key("b", 2), "B2");
        let data = with_entry(data, &entry_key("a", 3), "A3");
        assert_eq!(
            data.values().cloned().collect::<Vec<_>>(),
            ["B2", "A3"],
            "a's restart replaced its entry, b's stayed"
        );
        let mut data = data;
        for i in 0..MAX_ENTRIES as i64 {
            data = with_entry(data, &entry_key(&format!("r{i}"), 10 + i), "R");
        }
        assert_eq!(data.len(), MAX_ENTRIES);
        assert!(!data.values().any(|v| v == "B2"), "the oldest went first");
        let newest = entry_key("late", 1000);
        let data = with_entry(data, &newest, "L");
        assert!(data.contains_key(&newest));
        // An entry of the replica's own with the same key is kept, not dropped as oldest.
        let mut full: BTreeMap<String, String> = (0..MAX_ENTRIES)
            .map(|i| (entry_key(&format!("x{i}"), 100 + i as i64), "X".to_owned()))
            .collect();
        let early = entry_key("early", 1);
        full = with_entry(full, &early, "E");
        assert!(full.contains_key(&early) && full.len() == MAX_ENTRIES);
    }
}
