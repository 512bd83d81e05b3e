//! Registry credentials, including those of a `kubernetes.io/dockerconfigjson` pull Secret.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use serde::Deserialize;

use super::ImageError;

/// How to authenticate to a registry.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum RegistryAuth {
    /// No credentials (the registry may still hand out an anonymous bearer token).
    #[default]
    Anonymous,
    /// HTTP basic credentials, also used to get a bearer token when the registry asks for one.
    Basic {
        /// The user name.
        username: String,
        /// The password.
        password: String,
    },
    /// A bearer token sent as is.
    Bearer {
        /// The token.
        token: String,
    },
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Anonymous => f.write_str("Anonymous"),
            Self::Basic { username, .. } => write!(f, "Basic({username}, <redacted>)"),
            Self::Bearer { .. } => f.write_str("Bearer(<redacted>)"),
        }
    }
}

impl From<&RegistryAuth> for oci_client::secrets::RegistryAuth {
    fn from(a: &RegistryAuth) -> Self {
        match a {
            RegistryAuth::Anonymous => Self::Anonymous,
            RegistryAuth::Basic { username, password } => {
                Self::Basic(username.clone(), password.clone())
            }
            RegistryAuth::Bearer { token } => Self::Bearer(token.clone()),
        }
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    identitytoken: Option<String>,
    registrytoken: Option<String>,
}

/// The host (with port) a docker config key names: `https://host/v1/` → `host`, Docker Hub
/// aliases folded to `docker.io`.
fn normalize_host(key: &str) -> String {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = k.split('/').next().unwrap_or(k).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            "docker.io".into()
        }
        _ => host,
    }
}

/// Picks the credentials for `registry` (a host, with port if any) from a docker config JSON,
/// the bytes of a `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson` key. A registry
/// with no entry gets [`RegistryAuth::Anonymous`].
pub fn auth_from_docker_config(json: &[u8], registry: &str) -> Result<RegistryAuth, ImageError> {
    let bad = |reason: String| ImageError::DockerConfig {
        registry: registry.to_owned(),
        reason,
    };
    let config: DockerConfig =
        serde_json::from_slice(json).map_err(|e| bad(format!("parsing .dockerconfigjson: {e}")))?;
    let want = normalize_host(registry);
    let Some((key, entry)) = config.auths.iter().find(|(k, _)| normalize_host(k) == want) else {
        return Ok(RegistryAuth::Anonymous);
    };
    if let Some(token) = entry.registrytoken.as_ref().filter(|t| !t.is_empty()) {
        return Ok(RegistryAuth::Bearer {
            token: token.clone(),
        });
    }
    if let (Some(u), Some(p)) = (&entry.username, &entry.password) {
        return Ok(RegistryAuth::Basic {
            username: u.clone(),
            password: p.clone(),
        });
    }
    if let Some(auth) = entry.auth.as_ref().filter(|a| !a.is_empty()) {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|e| bad(format!("auths.{key:?}.auth is not base64: {e}")))?;
        let text =
            String::from_utf8(raw).map_err(|_| bad(format!("auths.{key:?}.auth is not UTF-8")))?;
        let (u, p) = text
            .split_once(':')
            .ok_or_else(|| bad(format!("auths.{key:?}.auth is not `user:password`")))?;
        return Ok(RegistryAuth::Basic {
            username: u.to_owned(),
            password: p.to_owned(),
        });
    }
    if let Some(token) = entry.identitytoken.as_ref().filter(|t| !t.is_empty()) {
        // An identity token is a refresh token; registries accept it as the basic password of
        // the fixed user `<token>` at their token endpoint.
        return Ok(RegistryAuth::Basic {
            username: "<token>".into(),
            password: token.clone(),
        });
    }
    Err(bad(format!(
        "auths.{key:?} has no auth, username/password or token"
    )))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn picks_the_entry_of_the_registry() {
        let json = br#"{"auths":{
            "https://index.docker.io/v1/":{"auth":"aHViOmh1YnB3"},
            "127.0.0.1:5000":{"username":"u","password":"p:w"},
            "tok.example":{"registrytoken":"t0"}}}"#;
        assert_eq!(
            auth_from_docker_config(json, "docker.io").unwrap(),
            RegistryAuth::Basic {
                username: "hub".into(),
                password: "hubpw".into()
            }
        );
        assert_eq!(
            auth_from_docker_config(json, "127.0.0.1:5000").unwrap(),
            RegistryAuth::Basic {
                username: "u".into(),
                password: "p:w".into()
            }
        );
        assert_eq!(
            auth_from_docker_config(json, "tok.example").unwrap(),
            RegistryAuth::Bearer { token: "t0".into() }
        );
        assert_eq!(
            auth_from_docker_config(json, "other:5000").unwrap(),
            RegistryAuth::Anonymous
        );
    }

    #[test]
    fn bad_config_names_registry_and_field() {
        let e = auth_from_docker_config(b"{", "r.example")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("r.example") && e.contains(".dockerconfigjson"),
            "{e}"
        );
        let e = auth_from_docker_config(br#"{"auths":{"r.example":{"auth":"!!"}}}"#, "r.example")
            .unwrap_err()
            .to_string();
        assert!(e.contains("auth is not base64"), "{e}");
        let e = auth_from_docker_config(br#"{"auths":{"r.example":{}}}"#, "r.example")
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no auth"), "{e}");
    }
}
