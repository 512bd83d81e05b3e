//! Kubeconfig files for the control plane's users, as kubectl and kube-rs read them (JSON is
//! YAML, so the file is written as JSON).

use base64::Engine as _;

/// How a kubeconfig's user proves who it is.
#[derive(Debug, Clone)]
pub enum Credential {
    /// A client certificate and key (PEM).
    Certificate {
        /// The certificate.
        cert: String,
        /// Its key.
        key: String,
    },
    /// A bearer token (a ServiceAccount's, from the TokenRequest API).
    Token(String),
}

/// A kubeconfig for `user` at `server` (https), trusting `ca_pem`, in namespace `namespace`.
pub fn render(
    server: &str,
    ca_pem: &str,
    user: &str,
    cred: &Credential,
    namespace: &str,
) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let user_body = match cred {
        Credential::Certificate { cert, key } => serde_json::json!({
            "client-certificate-data": b64(cert),
            "client-key-data": b64(key),
        }),
        Credential::Token(t) => serde_json::json!({ "token": t }),
    };
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "imp-test", "cluster": {
            "server": server,
            "certificate-authority-data": b64(ca_pem),
        }}],
        "contexts": [{"name": user, "context": {
            "cluster": "imp-test", "user": user, "namespace": namespace,
        }}],
        "current-context": user,
        "users": [{"name": user, "user": user_body}],
    });
    serde_json::to_string_pretty(&doc).unwrap_or_default()
}

/// The bearer token of the kubeconfig this module wrote at `path`, if it has one.
pub fn token_of(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["users"][0]["user"]["token"].as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_token_kubeconfig_names_its_user_server_and_namespace() {
        let y = render(
            "https://127.0.0.1:1",
            "CA",
            "alice",
            &Credential::Token("t0k".into()),
            "ns1",
        );
        let v: serde_json::Value = serde_json::from_str(&y).unwrap();
        assert_eq!(v["current-context"], "alice");
        assert_eq!(v["users"][0]["user"]["token"], "t0k");
        assert_eq!(v["contexts"][0]["context"]["namespace"], "ns1");
        assert_eq!(v["clusters"][0]["cluster"]["server"], "https://127.0.0.1:1");
        assert_eq!(
            v["clusters"][0]["cluster"]["certificate-authority-data"],
            "Q0E="
        );
    }
}
