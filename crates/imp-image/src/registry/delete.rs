//! Deleting a manifest by digest (`DELETE /v2/<repo>/manifests/<digest>`), which oci-client
//! cannot do: a plain HTTP request that answers one authentication challenge itself.

use std::time::Duration;

use super::challenge::{Challenge, fetch_token, parse_challenge};
use super::error::shorten;
use super::{Error, Result, Session};
use crate::auth::RegistryAuth;
use crate::manifest::Digest;
use crate::reference::is_loopback_registry;

/// What a DELETE's answer means.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DeleteVerdict {
    Deleted,
    Absent,
    Unsupported,
    Unauthorized,
    Forbidden,
    Other,
}

/// Reads a DELETE's status and OCI error body.
fn delete_verdict(status: u16, body: &str) -> DeleteVerdict {
    let code = |c: &str| body.contains(&format!("\"{c}\""));
    match status {
        200..=299 => DeleteVerdict::Deleted,
        404 => DeleteVerdict::Absent,
        405 => DeleteVerdict::Unsupported,
        401 => DeleteVerdict::Unauthorized,
        403 => DeleteVerdict::Forbidden,
        _ if code("UNSUPPORTED") => DeleteVerdict::Unsupported,
        _ => DeleteVerdict::Other,
    }
}

impl Session {
    /// Deletes the manifest `digest` of the session's repository (and so every tag naming it);
    /// false when the registry has no such manifest. Says so when the registry does not allow
    /// deletion.
    pub async fn delete(&self, digest: &Digest) -> Result<bool> {
        let registry = self.reference.resolve_registry();
        let scheme = if is_loopback_registry(registry) {
            "http"
        } else {
            "https"
        };
        let repository = self.reference.repository();
        let url = format!("{scheme}://{registry}/v2/{repository}/manifests/{digest}");
        // The reference the caller gave (its tag names the snapshot execution), and the digest.
        let name = format!("{} (manifest {digest})", self.reference);
        let what = format!("deleting {name}");
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|source| Error::Http {
                registry: self.registry().to_owned(),
                what: format!("building an HTTP client for {what}"),
                source,
            })?;
        let resp = self.send_delete(&http, &url, &what).await?;
        let status = resp.status().as_u16();
        let body = super::challenge::capped_text(resp, super::challenge::MAX_ANSWER_BYTES).await;
        let registry = self.registry().to_owned();
        let detail = shorten(&body);
        match delete_verdict(status, &body) {
            DeleteVerdict::Deleted => Ok(true),
            DeleteVerdict::Absent => Ok(false),
            DeleteVerdict::Unsupported => Err(Error::DeleteUnsupported {
                registry,
                what: name,
                status,
                detail,
            }),
            DeleteVerdict::Unauthorized => Err(Error::Unauthorized {
                registry,
                what,
                detail,
            }),
            DeleteVerdict::Forbidden => Err(Error::Forbidden {
                registry,
                what,
                detail,
            }),
            DeleteVerdict::Other => Err(Error::Status {
                registry,
                what,
                status,
                detail,
            }),
        }
    }

    /// Sends the DELETE, answering one authentication challenge: basic credentials, or a
    /// bearer token with scope `repository:<repo>:delete` from the challenge's realm.
    async fn send_delete(
        &self,
        http: &reqwest::Client,
        url: &str,
        what: &str,
    ) -> Result<reqwest::Response> {
        let http_err = |source| Error::Http {
            registry: self.registry().to_owned(),
            what: what.to_owned(),
            source,
        };
        let first = match &self.auth {
            RegistryAuth::Bearer { token } => http.delete(url).bearer_auth(token),
            _ => http.delete(url),
        };
        let resp = first.send().await.map_err(http_err)?;
        if resp.status() != reqwest::StatusCode::UNAUTHORIZED
            || matches!(self.auth, RegistryAuth::Bearer { .. })
        {
            return Ok(resp);
        }
        let challenge = resp
            .headers()
            .get(reqwest::header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_challenge);
        let retry = match (challenge, &self.auth) {
            (Some(Challenge::Basic), RegistryAuth::Basic { username, password }) => {
                http.delete(url).basic_auth(username, Some(password))
            }
            (Some(Challenge::Bearer { realm, service }), auth) => {
                let scope = format!("repository:{}:delete", self.reference.repository());
                let realm = (realm.as_str(), service.as_deref());
                let token = fetch_token(http, self.registry(), &scope, auth, realm, what).await?;
                http.delete(url).bearer_auth(token)
            }
            _ => return Ok(resp),
        };
        retry.send().await.map_err(http_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delete_answers() {
        assert_eq!(delete_verdict(202, ""), DeleteVerdict::Deleted);
        assert_eq!(delete_verdict(404, ""), DeleteVerdict::Absent);
        assert_eq!(
            delete_verdict(405, r#"{"errors":[{"code":"UNSUPPORTED"}]}"#),
            DeleteVerdict::Unsupported
        );
        assert_eq!(
            delete_verdict(400, r#"{"errors":[{"code":"UNSUPPORTED","message":"x"}]}"#),
            DeleteVerdict::Unsupported
        );
        assert_eq!(delete_verdict(401, ""), DeleteVerdict::Unauthorized);
        assert_eq!(delete_verdict(403, ""), DeleteVerdict::Forbidden);
        assert_eq!(delete_verdict(500, "boom"), DeleteVerdict::Other);
    }
}
