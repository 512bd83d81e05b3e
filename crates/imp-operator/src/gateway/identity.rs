//! The gateway's client certificate, the one credential node agents accept.
//!
//! Made once, self-signed, and kept in Secret `<namespace>/imp-gateway-client` (`tls.crt`,
//! `tls.key`), so every replica presents the same one; its certificate (public) is published in
//! ConfigMap `<namespace>/imp-gateway-client` (`tls.crt`), which each agent reads and pins
//! (`imp-agent`'s `api::auth`). Replicas agree through the API server: the Secret is created
//! only if absent, and the replica whose create is refused (409) uses what the winner wrote.

use std::collections::BTreeMap;
use std::sync::Arc;

use imp_agent_client::tls::ClientIdentity;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

/// Name of the Secret and of the ConfigMap.
pub const NAME: &str = "imp-gateway-client";
/// Key of the certificate (PEM) in both.
pub const CERT_KEY: &str = "tls.crt";
/// Key of the private key (PEM) in the Secret.
pub const KEY_KEY: &str = "tls.key";

/// Why the identity could not be had.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The API server refused or failed a read or write.
    #[error("{what} {namespace}/{NAME} failed")]
    Kube {
        /// What was done ("reading Secret", "creating ConfigMap", …).
        what: &'static str,
        /// The namespace.
        namespace: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// Making the certificate failed.
    #[error("Generating the gateway's client certificate failed")]
    Generate(#[source] rcgen::Error),
    /// The Secret holds something unusable.
    #[error("Secret {namespace}/{NAME} holds no usable certificate and key")]
    Unusable {
        /// The namespace.
        namespace: String,
        /// The cause.
        #[source]
        source: imp_agent_client::tls::TlsError,
    },
}

/// The certificate and key PEM of a Secret, if it holds both.
fn pair_of(secret: &Secret) -> Option<(String, String)> {
    let data = secret.data.as_ref()?;
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
    };
    Some((text(CERT_KEY)?, text(KEY_KEY)?))
}

/// A fresh self-signed client certificate and its key (PEM).
fn generate() -> Result<(String, String), IdentityError> {
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(IdentityError::Generate)?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "imp-gateway");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let key = rcgen::KeyPair::generate().map_err(IdentityError::Generate)?;
    let cert = params.self_signed(&key).map_err(IdentityError::Generate)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The gateway's identity, read from the Secret or made if it is absent, and its certificate
/// (PEM) for [`publish`].
pub async fn ensure(
    client: &kube::Client,
    namespace: &str,
) -> Result<(Arc<ClientIdentity>, String), IdentityError> {
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    let kube = |what| {
        let namespace = namespace.to_owned();
        move |source| IdentityError::Kube {
            what,
            namespace,
            source,
        }
    };
    let (cert, key) = match secrets
        .get_opt(NAME)
        .await
        .map_err(kube("reading Secret"))?
    {
        Some(s) => pair_of(&s).unwrap_or_default(),
        None => {
            let (cert, key) = generate()?;
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(NAME.into()),
                    ..ObjectMeta::default()
                },
                type_: Some("kubernetes.io/tls".into()),
                data: Some(BTreeMap::from([
                    (CERT_KEY.to_owned(), ByteString(cert.clone().into_bytes())),
                    (KEY_KEY.to_owned(), ByteString(key.clone().into_bytes())),
                ])),
                ..Secret::default()
            };
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    tracing::info!(secret = %format!("{namespace}/{NAME}"),
                        "gateway: client certificate made");
                    (cert, key)
                }
                // Another replica made it first: use theirs.
                Err(kube::Error::Api(s)) if s.code == 409 => secrets
                    .get(NAME)
                    .await
                    .map_err(kube("reading Secret"))
                    .map(|s| pair_of(&s).unwrap_or_default())?,
                Err(e) => return Err(kube("creating Secret")(e)),
            }
        }
    };
    let identity =
        ClientIdentity::from_pem(&cert, &key).map_err(|source| IdentityError::Unusable {
            namespace: namespace.to_owned(),
            source,
        })?;
    Ok((Arc::new(identity), cert))
}

/// Writes the certificate into the ConfigMap agents read, unless it is there already. The
/// gateway publishes only once it presents the certificate, so an agent that trusts it is
/// never called by a gateway without it.
pub async fn publish(
    client: &kube::Client,
    namespace: &str,
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
    let data = BTreeMap::from([(CERT_KEY.to_owned(), cert.to_owned())]);
    match maps
        .get_opt(NAME)
        .await
        .map_err(kube("reading ConfigMap"))?
    {
        Some(cm) if cm.data.as_ref() == Some(&data) => Ok(()),
        Some(mut cm) => {
            cm.data = Some(data);
            maps.replace(NAME, &PostParams::default(), &cm)
                .await
                .map(drop)
                .map_err(kube("updating ConfigMap"))
        }
        None => {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(NAME.into()),
                    ..ObjectMeta::default()
                },
                data: Some(data),
                ..ConfigMap::default()
            };
            match maps.create(&PostParams::default(), &cm).await {
                Ok(_) => Ok(()),
                // Another replica published it (the same Secret, so the same certificate).
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                Err(e) => Err(kube("creating ConfigMap")(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_generated_pair_is_a_usable_identity_and_a_secret_gives_it_back() {
        let (cert, key) = generate().unwrap();
        let id = ClientIdentity::from_pem(&cert, &key).unwrap();
        assert_eq!(id.fingerprint().len(), 64);
        let secret = Secret {
            data: Some(BTreeMap::from([
                (CERT_KEY.to_owned(), ByteString(cert.clone().into_bytes())),
                (KEY_KEY.to_owned(), ByteString(key.clone().into_bytes())),
            ])),
            ..Secret::default()
        };
        assert_eq!(pair_of(&secret), Some((cert, key)));
        assert_eq!(pair_of(&Secret::default()), None);
    }
}
