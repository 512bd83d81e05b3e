//! Who may do what: the caller's bearer token checked by a TokenReview, the action checked by a
//! SubjectAccessReview, as the kubelet does for its own API.
//!
//! The decisions are pure functions ([`bearer_token`], [`user_from_review`], [`access_review`],
//! [`access_decision`]); the two Kubernetes calls are behind [`Reviewer`], which
//! [`KubeReviewer`] implements with a kube client and tests replace. [`Authorizer`] strings
//! them together and keeps positive answers for a short while, keyed by a hash of the token and
//! the attributes, so a command run in a loop does not cost two API calls each time. A refusal
//! is never cached, and nothing is answered when the API server cannot be asked.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use http::{HeaderValue, StatusCode};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec, SubjectAccessReviewStatus,
};
use sha2::{Digest, Sha256};

/// The API group whose resource the reviews name.
pub const GROUP: &str = "imp.dev";
/// The resource the reviews name.
pub const RESOURCE: &str = "impvms";
/// The verb the reviews of exec and console ask for (both `create`, like `pods/exec`).
pub const VERB: &str = "create";

/// The subresource of an ImpVM a request acts on (or, for [`Subresource::GuestMetrics`], the
/// namespace's ImpVMs it reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Subresource {
    /// `impvms/exec`: run a command.
    Exec,
    /// `impvms/console`: read the serial console.
    Console,
    /// The guests' figures of a namespace's VMs: reviewed as `list` on `impvms` there (no
    /// subresource, no name), the right `kubectl top` asks of its readers.
    GuestMetrics,
}

impl Subresource {
    /// Its name in logs and in the answer cache.
    pub fn as_str(self) -> &'static str {
        match self {
            Subresource::Exec => "exec",
            Subresource::Console => "console",
            Subresource::GuestMetrics => "guest-metrics",
        }
    }

    /// The verb its SubjectAccessReview asks for.
    pub fn verb(self) -> &'static str {
        match self {
            Subresource::Exec | Subresource::Console => VERB,
            Subresource::GuestMetrics => "list",
        }
    }

    /// The subresource its SubjectAccessReview (and RBAC rules) name, if any.
    pub fn subresource(self) -> Option<&'static str> {
        match self {
            Subresource::Exec | Subresource::Console => Some(self.as_str()),
            Subresource::GuestMetrics => None,
        }
    }

    /// What is asked, for a refusal: `create impvms/exec of ns/name`, `list impvms in ns`.
    fn describe(self, namespace: &str, name: &str) -> String {
        match self.subresource() {
            Some(sub) => format!("{} {RESOURCE}/{sub} of {namespace}/{name}", self.verb()),
            None => format!("{} {RESOURCE} in namespace {namespace}", self.verb()),
        }
    }
}

/// What a request wants to do, the attributes of its SubjectAccessReview.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attributes {
    /// The VM's namespace.
    pub namespace: String,
    /// The VM's name.
    pub name: String,
    /// The subresource.
    pub subresource: Subresource,
}

/// The caller, as the TokenReview described them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct User {
    /// Username.
    pub username: String,
    /// UID, when the authenticator gives one.
    pub uid: Option<String>,
    /// Groups.
    pub groups: Vec<String>,
    /// Extra attributes, passed on to the SubjectAccessReview.
    pub extra: BTreeMap<String, Vec<String>>,
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    /// No `Authorization: Bearer` header.
    #[error("Unauthorized: no bearer token (send Authorization: Bearer <token>)")]
    NoToken,
    /// The token is malformed or the API server does not know it.
    #[error("Unauthorized: {0}")]
    BadToken(String),
    /// The SubjectAccessReview did not allow the action.
    #[error("Forbidden: user {user:?} may not {what}{}",
        reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Forbidden {
        /// Who asked.
        user: String,
        /// What they asked for: `create impvms/exec of ns/name`, `list impvms in namespace ns`.
        what: String,
        /// The authorizer's reason, if it gave one.
        reason: Option<String>,
    },
    /// A review could not be made; the request is refused rather than let through.
    #[error("Cannot check the request with the API server: {0}")]
    Unavailable(String),
}

impl Denial {
    /// The HTTP status that answers this refusal.
    pub fn status(&self) -> StatusCode {
        match self {
            Denial::NoToken | Denial::BadToken(_) => StatusCode::UNAUTHORIZED,
            Denial::Forbidden { .. } => StatusCode::FORBIDDEN,
            Denial::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer_token(header: Option<&HeaderValue>) -> Result<&str, Denial> {
    let Some(header) = header else {
        return Err(Denial::NoToken);
    };
    let value = header
        .to_str()
        .map_err(|_| Denial::BadToken("the Authorization header is not ASCII".into()))?;
    let (scheme, token) = value.split_once(' ').unwrap_or((value, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(Denial::BadToken(format!(
            "the Authorization scheme is {scheme:?}, not Bearer"
        )));
    }
    match token.trim() {
        "" => Err(Denial::NoToken),
        t => Ok(t),
    }
}

/// The TokenReview that asks who `token` belongs to.
pub fn token_review(token: &str) -> TokenReview {
    TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_owned()),
            audiences: None,
        },
        ..Default::default()
    }
}

/// The user an answered TokenReview names, or why the token is refused.
pub fn user_from_review(status: Option<&TokenReviewStatus>) -> Result<User, Denial> {
    let Some(status) = status else {
        return Err(Denial::Unavailable(
            "the TokenReview came back without a status".into(),
        ));
    };
    if status.authenticated != Some(true) {
        let why = status.error.as_deref().unwrap_or("token not authenticated");
        return Err(Denial::BadToken(format!("invalid bearer token ({why})")));
    }
    let user = status.user.clone().unwrap_or_default();
    match user.username {
        Some(username) if !username.is_empty() => Ok(User {
            username,
            uid: user.uid.filter(|u| !u.is_empty()),
            groups: user.groups.unwrap_or_default(),
            extra: user.extra.unwrap_or_default(),
        }),
        _ => Err(Denial::BadToken(
            "the TokenReview authenticated the token but named no user".into(),
        )),
    }
}

/// The SubjectAccessReview asking whether `user` may act as `attrs` says.
pub fn access_review(user: &User, attrs: &Attributes) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.username.clone()),
            uid: user.uid.clone(),
            groups: Some(user.groups.clone()),
            extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(attrs.namespace.clone()),
                name: attrs.subresource.subresource().map(|_| attrs.name.clone()),
                verb: Some(attrs.subresource.verb().to_owned()),
                group: Some(GROUP.to_owned()),
                resource: Some(RESOURCE.to_owned()),
                subresource: attrs.subresource.subresource().map(str::to_owned),
                ..Default::default()
            }),
            non_resource_attributes: None,
        },
        ..Default::default()
    }
}

/// Whether an answered SubjectAccessReview allows the action: `allowed` and not `denied`.
pub fn access_decision(
    user: &User,
    attrs: &Attributes,
    status: Option<&SubjectAccessReviewStatus>,
) -> Result<(), Denial> {
    let Some(status) = status else {
        return Err(Denial::Unavailable(
            "the SubjectAccessReview came back without a status".into(),
        ));
    };
    if status.allowed && status.denied != Some(true) {
        return Ok(());
    }
    let reason = status
        .reason
        .clone()
        .or_else(|| status.evaluation_error.clone())
        .filter(|r| !r.is_empty());
    Err(Denial::Forbidden {
        user: user.username.clone(),
        what: attrs.subresource.describe(&attrs.namespace, &attrs.name),
        reason,
    })
}

/// A review could not be made.
#[derive(Debug, thiserror::Error)]
#[error("Creating a {kind} failed")]
pub struct ReviewError {
    /// "TokenReview" or "SubjectAccessReview".
    pub kind: &'static str,
    /// What the client said.
    #[source]
    pub source: kube::Error,
}

/// The two Kubernetes calls authorization needs; a fake stands in for tests.
pub trait Reviewer: Send + Sync + 'static {
    /// Creates the TokenReview and returns the answered object.
    fn review_token(&self, review: TokenReview) -> BoxFuture<'_, Result<TokenReview, ReviewError>>;
    /// Creates the SubjectAccessReview and returns the answered object.
    fn review_access(
        &self,
        review: SubjectAccessReview,
    ) -> BoxFuture<'_, Result<SubjectAccessReview, ReviewError>>;
}

/// [`Reviewer`] against the real API server (the agent's service account needs `create` on
/// `tokenreviews` and `subjectaccessreviews`, as the kubelet's `system:auth-delegator` gives).
#[derive(Clone)]
pub struct KubeReviewer {
    client: kube::Client,
}

impl KubeReviewer {
    /// Reviews through `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl Reviewer for KubeReviewer {
    fn review_token(&self, review: TokenReview) -> BoxFuture<'_, Result<TokenReview, ReviewError>> {
        Box::pin(async move {
            kube::Api::<TokenReview>::all(self.client.clone())
                .create(&Default::default(), &review)
                .await
                .map_err(|source| ReviewError {
                    kind: "TokenReview",
                    source,
                })
        })
    }

    fn review_access(
        &self,
        review: SubjectAccessReview,
    ) -> BoxFuture<'_, Result<SubjectAccessReview, ReviewError>> {
        Box::pin(async move {
            kube::Api::<SubjectAccessReview>::all(self.client.clone())
                .create(&Default::default(), &review)
                .await
                .map_err(|source| ReviewError {
                    kind: "SubjectAccessReview",
                    source,
                })
        })
    }
}

/// How many positive answers the cache holds at most.
const CACHE_MAX: usize = 4096;

/// Checks requests: token, then access; remembers allowed (token, attributes) for a short TTL.
pub struct Authorizer {
    reviewer: Arc<dyn Reviewer>,
    ttl: Duration,
    allowed: Mutex<HashMap<[u8; 32], (User, Instant)>>,
}

impl Authorizer {
    /// Checks with `reviewer`, caching allowed requests for `ttl` (zero: no cache).
    pub fn new(reviewer: Arc<dyn Reviewer>, ttl: Duration) -> Self {
        Self {
            reviewer,
            ttl,
            allowed: Mutex::new(HashMap::new()),
        }
    }

    /// The caller, if their `Authorization` header is good for `attrs`.
    pub async fn authorize(
        &self,
        header: Option<&HeaderValue>,
        attrs: &Attributes,
    ) -> Result<User, Denial> {
        let token = bearer_token(header)?;
        let key = cache_key(token, attrs);
        if let Some(user) = self.cached(&key) {
            return Ok(user);
        }
        let answered = self
            .reviewer
            .review_token(token_review(token))
            .await
            .map_err(|e| Denial::Unavailable(imp_api::chain::chain(&e)))?;
        let user = user_from_review(answered.status.as_ref())?;
        let answered = self
            .reviewer
            .review_access(access_review(&user, attrs))
            .await
            .map_err(|e| Denial::Unavailable(imp_api::chain::chain(&e)))?;
        access_decision(&user, attrs, answered.status.as_ref())?;
        self.remember(key, &user);
        Ok(user)
    }

    fn cached(&self, key: &[u8; 32]) -> Option<User> {
        let map = self.allowed.lock().ok()?;
        let (user, until) = map.get(key)?;
        (Instant::now() < *until).then(|| user.clone())
    }

    fn remember(&self, key: [u8; 32], user: &User) {
        if self.ttl.is_zero() {
            return;
        }
        let Ok(mut map) = self.allowed.lock() else {
            return;
        };
        let now = Instant::now();
        if map.len() >= CACHE_MAX {
            map.retain(|_, (_, until)| *until > now);
            if map.len() >= CACHE_MAX {
                map.clear();
            }
        }
        map.insert(key, (user.clone(), now + self.ttl));
    }
}

/// SHA-256 over the token and the attributes, each length-prefixed so no two inputs collide.
fn cache_key(token: &str, attrs: &Attributes) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in [
        token,
        &attrs.namespace,
        &attrs.name,
        attrs.subresource.as_str(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::UserInfo;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn attrs(sub: Subresource) -> Attributes {
        Attributes {
            namespace: "team".into(),
            name: "vm1".into(),
            subresource: sub,
        }
    }

    fn alice() -> User {
        User {
            username: "alice".into(),
            uid: Some("u-1".into()),
            groups: vec!["dev".into()],
            extra: BTreeMap::from([("scopes".into(), vec!["a".into()])]),
        }
    }

    #[test]
    fn the_bearer_token_is_taken_from_the_header_or_refused_with_401() {
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(bearer_token(Some(&h("Bearer abc"))), Ok("abc"));
        assert_eq!(bearer_token(Some(&h("bearer  abc "))), Ok("abc"));
        assert_eq!(bearer_token(None), Err(Denial::NoToken));
        assert_eq!(bearer_token(Some(&h("Bearer "))), Err(Denial::NoToken));
        let basic = bearer_token(Some(&h("Basic YTpi"))).unwrap_err();
        assert!(matches!(basic, Denial::BadToken(_)), "{basic}");
        assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(Denial::NoToken.status(), StatusCode::UNAUTHORIZED);
        let binary = HeaderValue::from_bytes(b"Bearer \xff").unwrap();
        assert!(matches!(
            bearer_token(Some(&binary)),
            Err(Denial::BadToken(_))
        ));
    }

    #[test]
    fn a_token_review_yields_the_user_or_a_401() {
        let ok = TokenReviewStatus {
            authenticated: Some(true),
            user: Some(UserInfo {
                username: Some("alice".into()),
                uid: Some("u-1".into()),
                groups: Some(vec!["dev".into()]),
                extra: Some(BTreeMap::from([("scopes".into(), vec!["a".into()])])),
            }),
            ..Default::default()
        };
        assert_eq!(user_from_review(Some(&ok)), Ok(alice()));
        let bad = TokenReviewStatus {
            authenticated: Some(false),
            error: Some("invalid bearer token".into()),
            ..Default::default()
        };
        let err = user_from_review(Some(&bad)).unwrap_err();
        assert_eq!(err.status(), StatusCode::UNAUTHORIZED);
        assert!(err.to_string().contains("invalid bearer token"), "{err}");
        let nameless = TokenReviewStatus {
            authenticated: Some(true),
            ..Default::default()
        };
        assert_eq!(
            user_from_review(Some(&nameless)).unwrap_err().status(),
            StatusCode::UNAUTHORIZED
        );
        let missing = user_from_review(None).unwrap_err();
        assert_eq!(missing.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn the_access_review_names_the_subresource_of_the_vm_and_the_whole_user() {
        let review = access_review(&alice(), &attrs(Subresource::Exec));
        let spec = review.spec;
        assert_eq!(spec.user.as_deref(), Some("alice"));
        assert_eq!(spec.uid.as_deref(), Some("u-1"));
        assert_eq!(spec.groups, Some(vec!["dev".to_owned()]));
        assert_eq!(spec.extra.unwrap()["scopes"], vec!["a".to_owned()]);
        let ra = spec.resource_attributes.unwrap();
        assert_eq!(ra.verb.as_deref(), Some("create"));
        assert_eq!(ra.group.as_deref(), Some("imp.dev"));
        assert_eq!(ra.resource.as_deref(), Some("impvms"));
        assert_eq!(ra.subresource.as_deref(), Some("exec"));
        assert_eq!(ra.namespace.as_deref(), Some("team"));
        assert_eq!(ra.name.as_deref(), Some("vm1"));
        let console = access_review(&alice(), &attrs(Subresource::Console));
        assert_eq!(
            console.spec.resource_attributes.unwrap().subresource,
            Some("console".into())
        );
        // The guests' figures of a namespace: `list impvms` there, as `kubectl top` asks.
        let top = access_review(&alice(), &attrs(Subresource::GuestMetrics));
        let ra = top.spec.resource_attributes.unwrap();
        assert_eq!(ra.verb.as_deref(), Some("list"));
        assert_eq!(ra.resource.as_deref(), Some("impvms"));
        assert_eq!(ra.group.as_deref(), Some("imp.dev"));
        assert_eq!(ra.namespace.as_deref(), Some("team"));
        assert_eq!((ra.name, ra.subresource), (None, None));
        let denied = SubjectAccessReviewStatus::default();
        let err = access_decision(&alice(), &attrs(Subresource::GuestMetrics), Some(&denied))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "Forbidden: user \"alice\" may not list impvms in namespace team"
        );
    }

    #[test]
    fn only_allowed_and_not_denied_passes_otherwise_403_with_the_reason() {
        let a = attrs(Subresource::Console);
        let status = |allowed, denied, reason: Option<&str>| SubjectAccessReviewStatus {
            allowed,
            denied,
            reason: reason.map(String::from),
            ..Default::default()
        };
        assert_eq!(
            access_decision(&alice(), &a, Some(&status(true, None, None))),
            Ok(())
        );
        let err =
            access_decision(&alice(), &a, Some(&status(false, None, Some("no rule")))).unwrap_err();
        assert_eq!(err.status(), StatusCode::FORBIDDEN);
        let text = err.to_string();
        assert!(
            text.contains("\"alice\"")
                && text.contains("impvms/console")
                && text.contains("team/vm1")
                && text.contains("no rule"),
            "{text}"
        );
        // An explicit deny wins even over an allow.
        assert!(access_decision(&alice(), &a, Some(&status(true, Some(true), None))).is_err());
        assert_eq!(
            access_decision(&alice(), &a, None).unwrap_err().status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    /// Answers from a token table and an allow list; counts its calls.
    #[derive(Default)]
    struct Fake {
        tokens: HashMap<String, String>,
        allow: Vec<(String, Subresource)>,
        calls: AtomicUsize,
        down: bool,
    }

    impl Reviewer for Fake {
        fn review_token(
            &self,
            mut review: TokenReview,
        ) -> BoxFuture<'_, Result<TokenReview, ReviewError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if self.down {
                    return Err(ReviewError {
                        kind: "TokenReview",
                        source: kube::Error::ReadEvents(std::io::Error::new(
                            std::io::ErrorKind::ConnectionRefused,
                            "connection refused",
                        )),
                    });
                }
                let user = review.spec.token.as_ref().and_then(|t| self.tokens.get(t));
                review.status = Some(TokenReviewStatus {
                    authenticated: Some(user.is_some()),
                    user: user.map(|u| UserInfo {
                        username: Some(u.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                });
                Ok(review)
            })
        }

        fn review_access(
            &self,
            mut review: SubjectAccessReview,
        ) -> BoxFuture<'_, Result<SubjectAccessReview, ReviewError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let user = review.spec.user.clone().unwrap_or_default();
                let sub = review
                    .spec
                    .resource_attributes
                    .as_ref()
                    .and_then(|r| r.subresource.clone());
                let allowed = self
                    .allow
                    .iter()
                    .any(|(u, s)| *u == user && s.subresource().map(str::to_owned) == sub);
                review.status = Some(SubjectAccessReviewStatus {
                    allowed,
                    ..Default::default()
                });
                Ok(review)
            })
        }
    }

    fn fake() -> Fake {
        Fake {
            tokens: HashMap::from([
                ("t-alice".into(), "alice".into()),
                ("t-bob".into(), "bob".into()),
            ]),
            allow: vec![("alice".into(), Subresource::Exec)],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_authorizer_refuses_401_401_403_and_caches_only_what_it_allowed() {
        let reviewer = Arc::new(fake());
        let auth = Authorizer::new(reviewer.clone(), Duration::from_secs(60));
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        let exec = attrs(Subresource::Exec);
        let status = |r: Result<User, Denial>| r.map(|u| u.username).map_err(|d| d.status());
        assert_eq!(
            status(auth.authorize(None, &exec).await),
            Err(StatusCode::UNAUTHORIZED)
        );
        assert_eq!(
            reviewer.calls.load(Ordering::SeqCst),
            0,
            "no token, no call"
        );
        assert_eq!(
            status(auth.authorize(Some(&h("Bearer nope")), &exec).await),
            Err(StatusCode::UNAUTHORIZED)
        );
        assert_eq!(
            status(auth.authorize(Some(&h("Bearer t-bob")), &exec).await),
            Err(StatusCode::FORBIDDEN)
        );
        let console = attrs(Subresource::Console);
        assert_eq!(
            status(auth.authorize(Some(&h("Bearer t-alice")), &console).await),
            Err(StatusCode::FORBIDDEN),
            "allowed exec is not allowed console"
        );
        let before = reviewer.calls.load(Ordering::SeqCst);
        assert_eq!(
            status(auth.authorize(Some(&h("Bearer t-alice")), &exec).await),
            Ok("alice".into())
        );
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), before + 2);
        assert_eq!(
            status(auth.authorize(Some(&h("Bearer t-alice")), &exec).await),
            Ok("alice".into())
        );
        assert_eq!(
            reviewer.calls.load(Ordering::SeqCst),
            before + 2,
            "the second allowed request is answered from the cache"
        );
        // A refusal is never cached: bob asks again and is reviewed again.
        let before = reviewer.calls.load(Ordering::SeqCst);
        let _ = auth.authorize(Some(&h("Bearer t-bob")), &exec).await;
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), before + 2);
        // Another VM is another key.
        let other = Attributes {
            name: "vm2".into(),
            ..exec.clone()
        };
        let before = reviewer.calls.load(Ordering::SeqCst);
        let _ = auth.authorize(Some(&h("Bearer t-alice")), &other).await;
        assert_eq!(reviewer.calls.load(Ordering::SeqCst), before + 2);
    }

    #[tokio::test]
    async fn an_unreachable_api_server_refuses_with_503() {
        let reviewer = Arc::new(Fake {
            down: true,
            ..fake()
        });
        let auth = Authorizer::new(reviewer, Duration::ZERO);
        let h = HeaderValue::from_static("Bearer t-alice");
        let err = auth
            .authorize(Some(&h), &attrs(Subresource::Exec))
            .await
            .unwrap_err();
        assert_eq!(err.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(err.to_string().contains("TokenReview"), "{err}");
    }

    #[test]
    fn cache_keys_differ_by_token_and_every_attribute() {
        let a = attrs(Subresource::Exec);
        let k = cache_key("t", &a);
        assert_ne!(k, cache_key("u", &a));
        assert_ne!(k, cache_key("t", &attrs(Subresource::Console)));
        let moved = Attributes {
            namespace: "teamv".into(),
            name: "m1".into(),
            ..a.clone()
        };
        assert_ne!(
            k,
            cache_key("t", &moved),
            "length prefixes keep parts apart"
        );
    }
}
