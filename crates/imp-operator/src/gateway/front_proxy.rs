//! Who the API server says the caller is: the aggregation layer's front proxy.
//!
//! The API server proxies a request for `subresources.imp.dev` over TLS with its front-proxy
//! client certificate (`--proxy-client-cert-file`), naming the user it authenticated in the
//! request headers (`--requestheader-username-headers`, usually `X-Remote-User`, and the group
//! headers). The gateway trusts those headers only on a connection whose client certificate
//! chains to the request-header CA and whose common name is one of the allowed names: exactly
//! what the API server publishes in ConfigMap `kube-system/extension-apiserver-authentication`
//! ([`RequestHeader::from_configmap`]), which every extension API server reads.
//!
//! [`FrontProxy`] is the listener's client-certificate verifier: it asks for a certificate,
//! lets a connection without one in (the admission webhook's callers present none), and
//! verifies a presented one against the CA as last read ([`follow`]); [`RequestHeader::user`]
//! then reads the user of one request.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use http::HeaderMap;
use imp_agent_api::tls::Signatures;
use k8s_openapi::api::core::v1::ConfigMap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DistinguishedName, RootCertStore};
use x509_parser::prelude::FromDer;

/// Namespace of the ConfigMap the API server publishes its request-header settings in.
pub const CONFIGMAP_NAMESPACE: &str = "kube-system";
/// Name of that ConfigMap.
pub const CONFIGMAP_NAME: &str = "extension-apiserver-authentication";

/// How often the ConfigMap is read again (the API server may rotate its front-proxy CA).
pub const REFRESH: Duration = Duration::from_secs(60);

/// The request-header settings of the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeader {
    /// The CA certificates (PEM) the front proxy's client certificate chains to.
    pub ca_pem: String,
    /// The common names allowed (empty: any certificate of the CA).
    pub allowed_names: Vec<String>,
    /// Headers naming the user, the first present wins.
    pub username_headers: Vec<String>,
    /// Headers naming the user's groups (each may repeat).
    pub group_headers: Vec<String>,
    /// Prefixes of the headers naming the user's extra values (`X-Remote-Extra-` then the
    /// key, percent-encoded; each may repeat).
    pub extra_prefixes: Vec<String>,
}

/// Why the request-header settings cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The ConfigMap lacks a key or it is not what the API server writes.
    #[error(
        "ConfigMap {CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME}: {0} (is the API server's aggregation layer configured? --requestheader-client-ca-file)"
    )]
    Invalid(String),
}

/// The user a request is made for, as the front proxy named them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUser {
    /// The name.
    pub name: String,
    /// The groups.
    pub groups: Vec<String>,
    /// The extra values by key (lowercase, as the API server sends them), e.g. the node a
    /// ServiceAccount token is bound to under `authentication.kubernetes.io/node-name`.
    pub extra: BTreeMap<String, Vec<String>>,
}

impl RequestHeader {
    /// The settings in the ConfigMap's data: keys `requestheader-client-ca-file` (PEM),
    /// `requestheader-allowed-names`, `requestheader-username-headers` and
    /// `requestheader-group-headers` (JSON arrays of strings).
    pub fn from_configmap(cm: &ConfigMap) -> Result<Self, SettingsError> {
        let data = cm.data.clone().unwrap_or_default();
        let list = |key: &str| -> Result<Vec<String>, SettingsError> {
            match data.get(key) {
                None => Ok(Vec::new()),
                Some(text) => serde_json::from_str(text).map_err(|e| {
                    SettingsError::Invalid(format!("{key} is not a JSON list of strings: {e}"))
                }),
            }
        };
        let ca_pem = data
            .get("requestheader-client-ca-file")
            .cloned()
            .filter(|p| !p.trim().is_empty())
            .ok_or_else(|| SettingsError::Invalid("no requestheader-client-ca-file".into()))?;
        let username_headers = list("requestheader-username-headers")?;
        if username_headers.is_empty() {
            return Err(SettingsError::Invalid(
                "no requestheader-username-headers".into(),
            ));
        }
        Ok(Self {
            ca_pem,
            allowed_names: list("requestheader-allowed-names")?,
            username_headers,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
        })
    }

    /// Whether a verified client certificate's common name may act as the front proxy.
    pub fn allows(&self, common_name: Option<&str>) -> bool {
        self.allowed_names.is_empty()
            || common_name.is_some_and(|cn| self.allowed_names.iter().any(|n| n == cn))
    }

    /// The user the headers name (header names compare without case, as HTTP's do).
    pub fn user(&self, headers: &HeaderMap) -> Option<RemoteUser> {
        let name = self.username_headers.iter().find_map(|h| {
            headers
                .get(h.as_str())
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
        })?;
        let groups = self
            .group_headers
            .iter()
            .flat_map(|h| headers.get_all(h.as_str()).iter())
            .filter_map(|v| v.to_str().ok())
            .map(str::to_owned)
            .collect();
        Some(RemoteUser {
            name: name.to_owned(),
            groups,
            extra: self.extra(headers),
        })
    }

    /// The extra values the headers name: every header starting with one of the prefixes
    /// (without case), its key the rest of the name, percent-decoded, as the API server's own
    /// request-header authenticator reads them.
    fn extra(&self, headers: &HeaderMap) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, value) in headers {
            let name = name.as_str();
            let key = self.extra_prefixes.iter().find_map(|p| {
                let head = name.get(..p.len())?;
                head.eq_ignore_ascii_case(p).then(|| &name[p.len()..])
            });
            let (Some(key), Ok(value)) = (key, value.to_str()) else {
                continue;
            };
            if let Some(key) = percent_decoded(key).filter(|k| !k.is_empty()) {
                out.entry(key.to_ascii_lowercase())
                    .or_default()
                    .push(value.to_owned());
            }
        }
        out
    }
}

/// `text` with its `%XX` escapes decoded; `None` if one is malformed or the result is not
/// UTF-8.
fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The common name of a DER certificate's subject, if it has one.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

/// What the listener knows of the front proxy now.
struct Known {
    settings: RequestHeader,
    verifier: Arc<dyn ClientCertVerifier>,
}

/// The listener's client-certificate verifier and the request-header settings, as last read.
pub struct FrontProxy {
    known: RwLock<Option<Arc<Known>>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
    signatures: Signatures,
}

impl std::fmt::Debug for FrontProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontProxy")
            .field("known", &self.settings().is_some())
            .finish()
    }
}

impl FrontProxy {
    /// Knows nothing yet: presented certificates are refused until [`FrontProxy::set`].
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            known: RwLock::new(None),
            provider: imp_agent_api::tls::provider(),
            signatures: Signatures::default(),
        })
    }

    /// Verifies client certificates against `settings`' CA from the next handshake on.
    pub fn set(&self, settings: RequestHeader) -> Result<(), SettingsError> {
        let mut roots = RootCertStore::empty();
        for der in CertificateDer::pem_slice_iter(settings.ca_pem.as_bytes()).flatten() {
            roots.add(der).map_err(|e| {
                SettingsError::Invalid(format!("a CA certificate is unusable: {e}"))
            })?;
        }
        if roots.is_empty() {
            return Err(SettingsError::Invalid(
                "requestheader-client-ca-file holds no certificate".into(),
            ));
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .allow_unauthenticated()
                .build()
                .map_err(|e| SettingsError::Invalid(format!("building the verifier: {e}")))?;
        let known = Arc::new(Known { settings, verifier });
        if let Ok(mut k) = self.known.write() {
            *k = Some(known);
        }
        Ok(())
    }

    /// The settings as last read.
    pub fn settings(&self) -> Option<RequestHeader> {
        self.current().map(|k| k.settings.clone())
    }

    fn current(&self) -> Option<Arc<Known>> {
        self.known.read().ok().and_then(|k| k.clone())
    }
}

impl ClientCertVerifier for FrontProxy {
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
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        match self.current() {
            Some(k) => k
                .verifier
                .verify_client_cert(end_entity, intermediates, now),
            None => Err(rustls::Error::General(format!(
                "no front-proxy CA known yet ({CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME} not read)"
            ))),
        }
    }

    imp_agent_api::delegate_signatures!(signatures);
}

/// Reads the API server's request-header settings every [`REFRESH`] until `stop`, into
/// `front`. A read that fails keeps what was known.
pub async fn follow(
    client: kube::Client,
    front: Arc<FrontProxy>,
    stop: impl std::future::Future<Output = ()>,
) {
    let api = kube::Api::<ConfigMap>::namespaced(client, CONFIGMAP_NAMESPACE);
    let mut stop = std::pin::pin!(stop);
    let mut last: Option<Result<RequestHeader, String>> = None;
    loop {
        let read = match api.get(CONFIGMAP_NAME).await {
            Ok(cm) => RequestHeader::from_configmap(&cm)
                .and_then(|s| front.set(s.clone()).map(|()| s))
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!(
                "reading ConfigMap {CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME}: {}",
                imp_api::chain::chain(&e)
            )),
        };
        if last.as_ref() != Some(&read) {
            match &read {
                Ok(s) => tracing::info!(allowed_names = ?s.allowed_names,
                    "gateway: the API server's front-proxy settings read"),
                Err(why) => tracing::warn!(reason = %why,
                    "gateway: no front-proxy settings; the API server's requests are refused"),
            }
            last = Some(read);
        }
        tokio::select! {
            () = tokio::time::sleep(REFRESH) => {}
            () = &mut stop => return,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use http::HeaderValue;

    fn configmap(pairs: &[(&str, &str)]) -> ConfigMap {
        ConfigMap {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn ca() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn the_api_servers_settings_are_read_and_a_missing_ca_is_named() {
        let pem = ca();
        let s = RequestHeader::from_configmap(&configmap(&[
            ("requestheader-client-ca-file", &pem),
            ("requestheader-allowed-names", r#"["front-proxy-client"]"#),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
            ("requestheader-group-headers", r#"["X-Remote-Group"]"#),
            (
                "requestheader-extra-headers-prefix",
                r#"["X-Remote-Extra-"]"#,
            ),
        ]))
        .unwrap();
        assert_eq!(s.allowed_names, ["front-proxy-client"]);
        assert_eq!(s.extra_prefixes, ["X-Remote-Extra-"]);
        assert!(s.allows(Some("front-proxy-client")));
        assert!(!s.allows(Some("mallory")) && !s.allows(None));
        FrontProxy::new().set(s).unwrap();

        let e = RequestHeader::from_configmap(&configmap(&[])).unwrap_err();
        assert!(
            e.to_string().contains("requestheader-client-ca-file"),
            "{e}"
        );
        let e = RequestHeader::from_configmap(&configmap(&[
            ("requestheader-client-ca-file", &pem),
            ("requestheader-username-headers", "X-Remote-User"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("JSON list"), "{e}");
        let junk = RequestHeader {
            ca_pem: "junk".into(),
            allowed_names: vec![],
            username_headers: vec!["X-Remote-User".into()],
            group_headers: vec![],
            extra_prefixes: vec![],
        };
        assert!(
            junk.allows(Some("anyone")),
            "no names: any certificate of the CA"
        );
        assert!(FrontProxy::new().set(junk).is_err());
    }

    #[test]
    fn the_user_comes_from_the_configured_headers() {
        let s = RequestHeader {
            ca_pem: String::new(),
            allowed_names: vec![],
            username_headers: vec!["X-Remote-User".into()],
            group_headers: vec!["X-Remote-Group".into()],
            extra_prefixes: vec!["X-Remote-Extra-".into()],
        };
        let mut h = HeaderMap::new();
        assert_eq!(s.user(&h), None);
        h.insert("x-remote-user", HeaderValue::from_static("alice"));
        h.append("x-remote-group", HeaderValue::from_static("dev"));
        h.append(
            "x-remote-group",
            HeaderValue::from_static("system:authenticated"),
        );
        h.insert("x-other-user", HeaderValue::from_static("mallory"));
        // As the API server sends a bound token's node: the key percent-encoded.
        h.insert(
            "x-remote-extra-authentication.kubernetes.io%2fnode-name",
            HeaderValue::from_static("node-a"),
        );
        h.append("x-remote-extra-scopes", HeaderValue::from_static("a"));
        h.append("x-remote-extra-scopes", HeaderValue::from_static("b"));
        h.insert("x-remote-extra-bad%zz", HeaderValue::from_static("dropped"));
        assert_eq!(
            s.user(&h),
            Some(RemoteUser {
                name: "alice".into(),
                groups: vec!["dev".into(), "system:authenticated".into()],
                extra: BTreeMap::from([
                    (
                        "authentication.kubernetes.io/node-name".into(),
                        vec!["node-a".into()]
                    ),
                    ("scopes".into(), vec!["a".into(), "b".into()]),
                ]),
            })
        );
    }

    #[test]
    fn the_common_name_is_read_from_the_subject() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "front-proxy-client");
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            common_name(cert.der()).as_deref(),
            Some("front-proxy-client")
        );
        assert_eq!(common_name(b"junk"), None);
    }
}
