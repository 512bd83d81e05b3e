//! Answering a registry's `WWW-Authenticate` challenge ourselves, for the requests oci-client
//! does not make (DELETE): basic credentials, or a bearer token from the challenge's realm.
//! Credentials go to a realm only over HTTPS or on loopback.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::error::shorten;
use super::{Error, Result};
use crate::auth::RegistryAuth;
use crate::reference::is_loopback_registry;

/// A `WWW-Authenticate` challenge this module can answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

/// Parses the first challenge of a `WWW-Authenticate` header value.
pub(super) fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, rest) = header
        .split_once(char::is_whitespace)
        .unwrap_or((header, ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let params = parse_params(rest);
    Some(Challenge::Bearer {
        realm: params.get("realm")?.clone(),
        service: params.get("service").cloned(),
    })
}

/// `k=v, k="quoted, \"v\""` pairs, keys lowercased.
fn parse_params(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace() || *c == ',').is_some() {}
        let key: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != ','))
            .collect::<String>()
            .trim()
            .to_ascii_lowercase();
        if key.is_empty() && chars.peek().is_none() {
            return out;
        }
        if chars.next_if_eq(&'=').is_none() {
            continue;
        }
        let value = if chars.next_if_eq(&'"').is_some() {
            let mut v = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => v.extend(chars.next()),
                    '"' => break,
                    c => v.push(c),
                }
            }
            v
        } else {
            std::iter::from_fn(|| chars.next_if(|c| *c != ','))
                .collect::<String>()
                .trim()
                .to_owned()
        };
        if !key.is_empty() {
            out.insert(key, value);
        }
    }
}

/// Whether credentials may be sent to a token `realm`: HTTPS, or plain HTTP on loopback.
fn realm_allowed(realm: &reqwest::Url) -> bool {
    match realm.scheme() {
        "https" => true,
        "http" => realm.host_str().is_some_and(is_loopback_registry),
        _ => false,
    }
}

/// A bearer token from `realm` for `scope` (`repository:<repo>:<action>`) on `registry`, sending
/// basic credentials when there are some; `what` is the operation it is for, for messages.
pub(super) async fn fetch_token(
    http: &reqwest::Client,
    registry: &str,
    scope: &str,
    auth: &RegistryAuth,
    (realm, service): (&str, Option<&str>),
    what: &str,
) -> Result<String> {
    let mut params = vec![("scope", scope)];
    if let Some(s) = service {
        params.push(("service", s));
    }
    let url = reqwest::Url::parse_with_params(realm, &params).map_err(|e| Error::Status {
        registry: registry.to_owned(),
        what: what.to_owned(),
        status: 401,
        detail: format!("the token realm {realm:?} is not a URL: {e}"),
    })?;
    let refused = |detail: String| Error::Unauthorized {
        registry: registry.to_owned(),
        what: what.to_owned(),
        detail,
    };
    if !realm_allowed(&url) {
        return Err(refused(format!(
            "not sending credentials to the token realm {realm} (not HTTPS)"
        )));
    }
    let mut req = http.get(url);
    if let RegistryAuth::Basic { username, password } = auth {
        req = req.basic_auth(username, Some(password));
    }
    let resp = req.send().await.map_err(|source| Error::Http {
        registry: registry.to_owned(),
        what: format!("getting a token for {what}"),
        source,
    })?;
    let status = resp.status();
    let body = capped_text(resp, MAX_ANSWER_BYTES).await;
    if !status.is_success() {
        return Err(refused(format!(
            "token endpoint {realm} answered {status}: {}",
            shorten(&body)
        )));
    }
    #[derive(Deserialize)]
    struct Token {
        token: Option<String>,
        access_token: Option<String>,
    }
    let t: Token = serde_json::from_str(&body)
        .map_err(|e| refused(format!("token endpoint {realm} sent no token: {e}")))?;
    t.token
        .or(t.access_token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| refused(format!("token endpoint {realm} sent an empty token")))
}

/// The most of a token endpoint's or a DELETE's answer that is read: a token is a few KiB, and
/// what a registry sends is untrusted.
pub(super) const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The body of `resp` as text, at most `limit` bytes of it (the rest is never read); a body
/// that breaks off reads as what arrived.
pub(super) async fn capped_text(mut resp: reqwest::Response, limit: usize) -> String {
    let mut out = Vec::new();
    while out.len() < limit {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - out.len();
                out.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn an_answer_is_read_only_up_to_its_cap() {
        use std::io::{Read as _, Write as _};
        // A server on loopback that answers with far more than the cap, and more still.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = [0u8; 1024];
            let _ = conn.read(&mut request).unwrap();
            let body = vec![b'x'; 1 << 20];
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body);
        });
        super::super::install_crypto_provider();
        let resp = reqwest::get(format!("http://{addr}/token")).await.unwrap();
        let text = capped_text(resp, MAX_ANSWER_BYTES).await;
        assert_eq!(text.len(), MAX_ANSWER_BYTES);
        server.join().unwrap();
    }

    #[test]
    fn challenges_parse() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a:pull""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("registry.example".into())
            })
        );
        assert_eq!(
            parse_challenge(r#"bearer Realm=http://127.0.0.1:9/t , service="a, \"b\"""#),
            Some(Challenge::Bearer {
                realm: "http://127.0.0.1:9/t".into(),
                service: Some("a, \"b\"".into())
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="imp-test""#),
            Some(Challenge::Basic)
        );
        assert_eq!(parse_challenge(r#"Bearer service="x""#), None);
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(parse_challenge(""), None);
    }

    #[test]
    fn params_without_values_or_with_stray_commas_are_skipped() {
        let p = parse_params(r#", ,flag, k = v ,q="x\\y",="nokey""#);
        assert_eq!(p.get("k").map(String::as_str), Some("v"));
        assert_eq!(p.get("q").map(String::as_str), Some("x\\y"));
        assert!(!p.contains_key("flag"));
        assert_eq!(p.len(), 2, "{p:?}");
    }

    #[test]
    fn credentials_go_to_https_or_loopback_realms_only() {
        let ok = |s: &str| realm_allowed(&reqwest::Url::parse(s).unwrap());
        assert!(ok("https://auth.example/token"));
        assert!(ok("http://127.0.0.1:5000/token"));
        assert!(ok("http://localhost/token"));
        assert!(ok("http://[::1]:8080/token"));
        assert!(!ok("http://auth.example/token"));
        assert!(!ok("ftp://auth.example/token"));
    }
}
