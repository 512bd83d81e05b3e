//! Who may read the agent's `/metrics` (VM names, namespaces, guests' figures): a caller on
//! the node itself (loopback), or one whose bearer token the API server authenticates
//! (TokenReview) and allows `get` on the non-resource URL `/metrics` (SubjectAccessReview), as
//! controller-runtime's metrics filter and kube-rbac-proxy do. The chart grants that to
//! ClusterRole `imp-metrics-reader`, which a Prometheus' ServiceAccount is bound to. Decisions
//! are kept a minute per token (by its SHA-256), so a scrape every 15 s costs the API server
//! two reviews a minute. The health routes are never guarded (the kubelet probes them).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode, header};
use imp_telemetry::{Admission, Guard, Refusal};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::PostParams;
use sha2::{Digest, Sha256};

/// How long a decision about one token is kept.
pub const KEEP: Duration = Duration::from_secs(60);
/// How many tokens' decisions are kept at most (the oldest are dropped past it).
const KEPT_TOKENS: usize = 256;
/// The ClusterRole the chart ships for scrapers (named in refusals).
pub const READER_ROLE: &str = "imp-metrics-reader";

/// A decision about one token and when it was made, by the token's SHA-256.
type Kept = HashMap<[u8; 32], (Instant, Result<(), Refusal>)>;

/// The API server's judgement of scrapers' tokens.
pub struct KubeAuth {
    client: kube::Client,
    kept: Mutex<Kept>,
}

impl KubeAuth {
    /// Asks the API server `client` talks to (as the agent).
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            kept: Mutex::new(HashMap::new()),
        }
    }

    async fn decide(&self, token: &str) -> Result<(), Refusal> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(kept) = self.kept_decision(&key) {
            return kept;
        }
        let verdict = self.review(token).await;
        // A failure to ask is not remembered: the next scrape asks again.
        if verdict
            .as_ref()
            .err()
            .is_none_or(|r| r.status != StatusCode::SERVICE_UNAVAILABLE)
        {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            if kept.len() >= KEPT_TOKENS {
                kept.retain(|_, (at, _)| at.elapsed() < KEEP);
            }
            if kept.len() < KEPT_TOKENS {
                kept.insert(key, (Instant::now(), verdict.clone()));
            }
        }
        verdict
    }

    fn kept_decision(&self, key: &[u8; 32]) -> Option<Result<(), Refusal>> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.get(key)
            .filter(|(at, _)| at.elapsed() < KEEP)
            .map(|(_, v)| v.clone())
    }

    async fn review(&self, token: &str) -> Result<(), Refusal> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| unavailable("reviewing the scraper's token", &e))?;
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => user,
            _ => {
                return Err(Refusal {
                    status: StatusCode::UNAUTHORIZED,
                    message: format!(
                        "the API server did not authenticate the bearer token{}",
                        status.error.map(|e| format!(": {e}")).unwrap_or_default()
                    ),
                });
            }
        };
        let name = user.username.clone().unwrap_or_default();
        let access = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &access_review(user))
            .await
            .map_err(|e| unavailable("asking whether the scraper may get /metrics", &e))?;
        if access.status.is_some_and(|s| s.allowed) {
            Ok(())
        } else {
            Err(Refusal {
                status: StatusCode::FORBIDDEN,
                message: format!(
                    "{name} may not get /metrics (bind it to ClusterRole {READER_ROLE})"
                ),
            })
        }
    }
}

/// Whether `user` may `get` the non-resource URL `/metrics`.
fn access_review(user: UserInfo) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username,
            groups: user.groups,
            uid: user.uid,
            extra: user.extra,
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some("/metrics".into()),
                verb: Some("get".into()),
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn unavailable(doing: &str, e: &kube::Error) -> Refusal {
    Refusal {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!("{doing}: {}", imp_api::chain::chain(e)),
    }
}

/// The bearer token of a request, if it carries one.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

impl Guard for KubeAuth {
    fn admit<'a>(&'a self, peer: Option<SocketAddr>, headers: &'a HeaderMap) -> Admission<'a> {
        Box::pin(async move {
            if peer.is_some_and(|p| p.ip().is_loopback()) {
                return Ok(());
            }
            let Some(token) = bearer(headers) else {
                return Err(Refusal {
                    status: StatusCode::UNAUTHORIZED,
                    message: format!(
                        "/metrics needs a bearer token the API server authenticates, of a user \
                         allowed to get /metrics (ClusterRole {READER_ROLE})"
                    ),
                });
            };
            self.decide(token).await
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_token_is_read_from_a_bearer_authorization_only() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        for other in ["Basic abc", "Bearer ", "Bearer"] {
            h.insert(header::AUTHORIZATION, other.parse().unwrap());
            assert_eq!(bearer(&h), None, "{other}");
        }
    }
}
