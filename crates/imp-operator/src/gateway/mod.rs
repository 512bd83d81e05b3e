//! The gateway: imp's aggregated API (`subresources.imp.dev/v1alpha1`), through which users
//! exec into VMs, read their consoles and their guests' figures without any credential of
//! theirs reaching a node.
//!
//! The path of an `imp exec -n team web -- sh`:
//! 1. the CLI sends `POST /apis/subresources.imp.dev/v1alpha1/namespaces/team/impvms/web/exec`
//!    (upgrade `imp-exec/1`) to the Kubernetes API server, with the kubeconfig's credentials;
//! 2. the API server authenticates the user and authorizes `create impvms/exec` in the
//!    namespace (RBAC: `imp-edit`), then proxies the request to the Service its APIService
//!    `v1alpha1.subresources.imp.dev` names, with its front-proxy client certificate and the
//!    user in `X-Remote-User`/`X-Remote-Group`;
//! 3. the gateway, served on the operator's HTTPS listener beside the admission webhook, checks
//!    the front proxy's certificate against the API server's request-header CA
//!    ([`front_proxy`]), finds the VM's node ([`forward`]) and calls its agent over mutual TLS:
//!    it pins the certificate the Node publishes and presents its own client certificate
//!    ([`identity`]: each replica's own, its key never leaves the process), the only kind agents
//!    accept, naming the user for their logs;
//! 4. both upgraded connections are spliced.
//!
//! This is what KubeVirt's virt-api does for `virtctl console`: a compromised node sees no
//! user's token, and one RBAC rule in the API server decides who may exec where.
//!
//! The same API hands each node agent the Secrets and ConfigMaps of the VMs on its node, and
//! nothing else ([`inputs`]): agents may read none themselves.
//!
//! [`route`] parses the paths and answers discovery; [`Gateway::handle`] ties it together.

pub mod forward;
pub mod front_proxy;
pub mod identity;
pub mod inputs;
pub mod route;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use imp_agent_api::client::Caller;
use imp_agent_api::tls::ClientIdentity;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;

use self::front_proxy::FrontProxy;
use self::route::Route;

/// The body of every answer.
pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// An empty body.
pub fn empty() -> Body {
    bytes(Bytes::new())
}

fn bytes(b: Bytes) -> Body {
    BodyExt::boxed_unsync(Full::new(b).map_err(|never| match never {}))
}

/// A JSON answer.
pub fn json<T: serde::Serialize>(code: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut resp = Response::new(bytes(body.into()));
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// A refusal as a Kubernetes `Status`, which kubectl and the CLI print the message of.
pub fn status(code: StatusCode, message: &str) -> Response<Body> {
    json(code, &imp_agent_api::status_body(code, message))
}

/// What a connection's TLS handshake established about its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// No client certificate.
    Anonymous,
    /// A client certificate the request-header CA signed, with its common name.
    Verified(Option<String>),
}

impl Peer {
    /// The peer of a TLS server connection (a presented certificate was verified in the
    /// handshake by [`FrontProxy`]).
    pub fn of(conn: &rustls::ServerConnection) -> Self {
        match conn.peer_certificates().and_then(|c| c.first()) {
            Some(leaf) => Peer::Verified(front_proxy::common_name(leaf.as_ref())),
            None => Peer::Anonymous,
        }
    }
}

/// This replica's name: `$POD_NAME`, else the host's name and the process id.
async fn replica_name() -> String {
    if let Ok(pod) = std::env::var("POD_NAME") {
        return pod;
    }
    let host = tokio::fs::read_to_string("/proc/sys/kernel/hostname")
        .await
        .unwrap_or_default();
    format!("{}-{}", host.trim(), std::process::id())
}

/// How often publishing the gateway's certificate is tried again after a failure.
const IDENTITY_RETRY: Duration = Duration::from_secs(5);

/// How often the announcement looks whether the front proxy's settings are read.
const SETTINGS_POLL: Duration = Duration::from_millis(100);

/// The APIService annotation a replica writes when it starts serving.
pub const READY_ANNOTATION: &str = "imp.dev/gateway-serving-since";

/// The gateway's state: its Kubernetes client, the front proxy's settings and its identity.
pub struct Gateway {
    client: kube::Client,
    namespace: String,
    /// The user name of the node agents' ServiceAccount, the only caller of the inputs.
    agents: String,
    api_services: Vec<String>,
    front: Arc<FrontProxy>,
    identity: RwLock<Option<Arc<ClientIdentity>>>,
    /// Why the identity is not ready yet, when making or publishing it failed.
    not_ready: RwLock<Option<String>>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("namespace", &self.namespace)
            .field("front", &self.front)
            .finish()
    }
}

impl Gateway {
    /// A gateway whose identity lives in `namespace` (the operator's), registered as the
    /// APIServices `api_services`, handing inputs to the agents of ServiceAccount user `agents`.
    pub fn new(
        client: kube::Client,
        namespace: &str,
        agents: &str,
        api_services: &[String],
    ) -> Arc<Self> {
        Arc::new(Self {
            client,
            namespace: namespace.to_owned(),
            agents: agents.to_owned(),
            api_services: api_services.to_vec(),
            front: FrontProxy::new(),
            identity: RwLock::new(None),
            not_ready: RwLock::new(None),
        })
    }

    /// The listener's client-certificate verifier.
    pub fn verifier(&self) -> Arc<FrontProxy> {
        self.front.clone()
    }

    /// Reads the front proxy's settings and makes the identity, on tasks of their own, until
    /// `stop` completes.
    pub fn spawn(self: &Arc<Self>, stop: impl std::future::Future<Output = ()> + Send + 'static) {
        let (client, front) = (self.client.clone(), self.front.clone());
        tokio::spawn(front_proxy::follow(client, front, stop));
        let me = self.clone();
        tokio::spawn(async move {
            let (id, cert) = match identity::generate() {
                Ok(made) => made,
                Err(e) => {
                    tracing::error!(error = %imp_api::chain::DisplayChain(&e),
                        "gateway: no client certificate; exec, console and top refused");
                    me.note_not_ready(&e);
                    return;
                }
            };
            let replica = replica_name().await;
            let unix = k8s_openapi::jiff::Timestamp::now().as_second();
            let key = identity::entry_key(&replica, unix);
            while let Err(e) = identity::publish(&me.client, &me.namespace, &key, &cert).await {
                tracing::warn!(error = %imp_api::chain::DisplayChain(&e),
                    "gateway: publishing the client certificate for the agents failed");
                me.note_not_ready(&e);
                tokio::time::sleep(IDENTITY_RETRY).await;
            }
            tracing::info!(fingerprint = %id.fingerprint(), entry = %key,
                "gateway: client certificate published (its key stays in this process)");
            if let Ok(mut slot) = me.identity.write() {
                *slot = Some(Arc::new(id));
            }
            while me.front.settings().is_none() {
                tokio::time::sleep(SETTINGS_POLL).await;
            }
            me.announce().await;
            loop {
                tokio::time::sleep(identity::KEEP_EVERY).await;
                if let Err(e) = identity::publish(&me.client, &me.namespace, &key, &cert).await {
                    tracing::warn!(error = %imp_api::chain::DisplayChain(&e),
                        "gateway: checking the published client certificate failed");
                }
            }
        });
    }

    /// Tells the API server's aggregator that this replica serves now, by annotating each
    /// APIService: the aggregator checks an APIService again when it changes, instead of
    /// after its backoff (up to 30 s) from the checks that failed while no replica served.
    async fn announce(&self) {
        let api = kube::Api::<APIService>::all(self.client.clone());
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let patch = serde_json::json!({"metadata": {"annotations": {READY_ANNOTATION: now}}});
        for name in &self.api_services {
            let patched = api
                .patch(
                    name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await;
            match patched {
                Ok(_) => tracing::info!(apiservice = %name, "gateway: serving"),
                Err(e) => tracing::warn!(apiservice = %name,
                    error = %imp_api::chain::DisplayChain(&e),
                    "gateway: serving, but announcing it on the APIService failed"),
            }
        }
    }

    fn note_not_ready(&self, e: &identity::IdentityError) {
        if let Ok(mut slot) = self.not_ready.write() {
            *slot = Some(imp_api::chain::chain(e));
        }
    }

    fn identity(&self) -> Option<Arc<ClientIdentity>> {
        self.identity.read().ok().and_then(|i| i.clone())
    }

    /// Answers one request of the aggregated API.
    pub async fn handle<B: Send + 'static>(
        self: Arc<Self>,
        mut req: Request<B>,
        peer: &Peer,
    ) -> Response<Body> {
        let route = match route::parse(req.method(), req.uri().path(), req.uri().query()) {
            Ok(r) => r,
            Err(e) => return status(e.status(), &e.to_string()),
        };
        let settings = match (peer, self.front.settings()) {
            (Peer::Verified(cn), Some(s)) if s.allows(cn.as_deref()) => s,
            (_, None) => {
                return status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the gateway has not read the API server's front-proxy settings yet",
                );
            }
            _ => {
                return status(
                    StatusCode::UNAUTHORIZED,
                    "the gateway serves the Kubernetes API server's front proxy only: call \
                     /apis/subresources.imp.dev through the API server (imp exec -n, kubectl imp)",
                );
            }
        };
        if let Some(doc) = route::discovery(&route) {
            return json(StatusCode::OK, &doc);
        }
        let Some(user) = settings.user(req.headers()) else {
            return status(
                StatusCode::UNAUTHORIZED,
                "the API server named no user in its request-header headers",
            );
        };
        match &route {
            Route::VmInputs { namespace, name } => {
                return inputs::vm(&self.client, &self.agents, &user, namespace, name).await;
            }
            Route::SnapshotInputs { namespace, name } => {
                return inputs::snapshot(&self.client, &self.agents, &user, namespace, name).await;
            }
            _ => {}
        }
        let Some(identity) = self.identity() else {
            let why = self.not_ready.read().ok().and_then(|w| w.clone());
            let message = match why {
                Some(why) => format!("the gateway's client certificate is not published: {why}"),
                None => "the gateway's client certificate is not published yet".to_owned(),
            };
            return status(StatusCode::SERVICE_UNAVAILABLE, &message);
        };
        let caller = Caller {
            identity: &identity,
            user: &user.name,
            groups: &user.groups,
        };
        let kube = &self.client;
        match route {
            Route::Exec { namespace, name } => {
                forward::exec(kube, &caller, &mut req, &namespace, &name).await
            }
            Route::Console {
                namespace,
                name,
                follow,
            } => forward::console(kube, &caller, &mut req, &namespace, &name, follow).await,
            Route::GuestMetrics { namespace } => {
                forward::guest_metrics(kube, &caller, &namespace).await
            }
            Route::Groups
            | Route::Group
            | Route::Resources
            | Route::VmInputs { .. }
            | Route::SnapshotInputs { .. } => status(StatusCode::NOT_FOUND, "not found"),
        }
    }
}
