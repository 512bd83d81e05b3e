//! The HTTPS server: accepts TLS connections, routes each request, authorizes it, then hands
//! it to [`super::exec`] or [`super::console`], answers it with the guests' figures
//! ([`super::top`]), or hands a move's request to [`super::moves`].
//!
//! Order per request: route ([`super::route::parse_request`]; 404/405/400). The gateway's
//! endpoints: the caller (401 unless it is imp's gateway, [`super::auth`]; 503 while the
//! gateway's certificates are unknown), and only then the VM lookup (404 naming
//! namespace/name), so another caller learns nothing about which VMs exist, then the session
//! limits ([`super::sessions`]; 429). A move's endpoints: 404 unless the API receives moves
//! ([`AgentApi::with_moves`]), then the move's token and the caller's certificate, which
//! [`super::moves::MoveAuthority`] admits (401/403/404) before anything is read or written.
//! Refusals are Kubernetes `Status` objects (JSON) whose `message` says why.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use http::header::{CONNECTION, CONTENT_TYPE, UPGRADE};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::auth::Gateway;
use super::console::Tail;
use super::moves::MoveReceiver;
use super::route::{self, Action, Route};
use super::sessions::{Session, SessionLimits, Sessions};
use super::{EXEC_UPGRADE, VmLookup, exec};

pub use super::reply::Body;
use super::reply::status;

/// Timeouts and intervals; the defaults suit production.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// How long to try reaching the guest agent over vsock.
    pub guest_connect_timeout: Duration,
    /// How long a caller has, after the upgrade, to send its hello and exec.
    pub exec_opening_timeout: Duration,
    /// How long a TLS handshake and a request's headers may take.
    pub handshake_timeout: Duration,
    /// Pause between looks at the end of a followed console log.
    pub console_poll: Duration,
    /// How long an exec waits for a VM that scale-to-zero put to sleep to run again.
    pub wake_timeout: Duration,
    /// How many exec and console sessions may be open per VM and per caller.
    pub sessions: SessionLimits,
    /// How long a move's `PUT` may go without a byte before what arrived is recorded and the
    /// request ends (a connection gone silent must not hold the move's lock for ever).
    pub move_idle_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            guest_connect_timeout: Duration::from_secs(10),
            exec_opening_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            console_poll: Duration::from_millis(200),
            wake_timeout: Duration::from_secs(60),
            sessions: SessionLimits::default(),
            move_idle_timeout: Duration::from_secs(60),
        }
    }
}

/// The agent's exec and console API, and the receiving end of VMs' moves.
pub struct AgentApi {
    lookup: Arc<dyn VmLookup>,
    gateway: Arc<Gateway>,
    moves: Option<MoveReceiver>,
    config: ApiConfig,
    exec_sessions: Arc<AtomicUsize>,
    console_streams: Arc<AtomicUsize>,
    sessions: Arc<Sessions>,
}

impl AgentApi {
    /// An API that finds VMs with `lookup` and serves the callers `gateway` pins; it receives
    /// no moves.
    pub fn new(lookup: Arc<dyn VmLookup>, gateway: Arc<Gateway>, config: ApiConfig) -> Arc<Self> {
        Self::build(lookup, gateway, None, config)
    }

    /// [`AgentApi::new`], receiving the files of VMs moving to this node as `moves` admits
    /// them.
    pub fn with_moves(
        lookup: Arc<dyn VmLookup>,
        gateway: Arc<Gateway>,
        moves: MoveReceiver,
        config: ApiConfig,
    ) -> Arc<Self> {
        Self::build(lookup, gateway, Some(moves), config)
    }

    fn build(
        lookup: Arc<dyn VmLookup>,
        gateway: Arc<Gateway>,
        moves: Option<MoveReceiver>,
        config: ApiConfig,
    ) -> Arc<Self> {
        Arc::new(Self {
            lookup,
            gateway,
            moves,
            sessions: Sessions::new(config.sessions),
            config,
            exec_sessions: Arc::default(),
            console_streams: Arc::default(),
        })
    }

    /// Exec sessions relaying now.
    pub fn exec_sessions(&self) -> usize {
        self.exec_sessions.load(Ordering::SeqCst)
    }

    /// Console streams open now.
    pub fn console_streams(&self) -> usize {
        self.console_streams.load(Ordering::SeqCst)
    }

    /// Serves HTTPS on `listener` until `shutdown` completes (sessions in flight go on).
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl Future<Output = ()>,
    ) {
        let acceptor = TlsAcceptor::from(tls);
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: wait instead of spinning.
                        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "agent API accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = &mut shutdown => return,
            };
            let api = self.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let limit = api.config.handshake_timeout;
                let tls = match tokio::time::timeout(limit, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %imp_api::chain::DisplayChain(&e), "agent API TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "agent API TLS handshake timed out");
                        return;
                    }
                };
                let client_cert = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| imp_agent_api::tls::digest(c.as_ref()));
                let service = hyper::service::service_fn(move |req| {
                    let api = api.clone();
                    async move { Ok::<_, Infallible>(api.handle(req, client_cert.as_ref()).await) }
                });
                let served = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limit)
                    .serve_connection(TokioIo::new(tls), service)
                    .with_upgrades()
                    .await;
                if let Err(e) = served {
                    tracing::debug!(%peer, error = %imp_api::chain::DisplayChain(&e), "agent API connection ended with an error");
                }
            });
        }
    }

    /// Answers one request; `peer` is the SHA-256 of the connection's client certificate.
    pub async fn handle<B>(
        self: Arc<Self>,
        mut req: Request<B>,
        peer: Option<&[u8; 32]>,
    ) -> Response<Body>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let route = match route::parse_request(req.method(), req.uri().path(), req.uri().query()) {
            Ok(route::Request::Vm(r)) => r,
            Ok(route::Request::Move(m)) => {
                let Some(moves) = &self.moves else {
                    let msg = "This node's agent receives no VM moves";
                    return status(StatusCode::NOT_FOUND, msg);
                };
                let idle = self.config.move_idle_timeout;
                return moves.serve(m, req, peer, idle).await;
            }
            Err(e) => return status(e.status(), &e.to_string()),
        };
        let subresource = route.subresource();
        let user = match self.gateway.authorize(peer, req.headers()).await {
            Ok(u) => u,
            Err(denial) => {
                tracing::warn!(vm = %route.name, namespace = %route.namespace,
                    subresource = subresource.as_str(), reason = %denial,
                    "agent API request refused");
                return status(denial.status(), &denial.to_string());
            }
        };
        if route.action == Action::GuestMetrics {
            return guest_readings(self.lookup.as_ref(), route.namespace, &user.username);
        }
        let Some(vm) = self.lookup.find(&route.namespace, &route.name) else {
            return not_on_this_node(&route);
        };
        let user = user.username;
        if let Action::Exec = route.action
            && let Err(e) = exec::check_upgrade(req.headers())
        {
            return status(e.status(), &e.to_string());
        }
        let key = format!("{}/{}", route.namespace, route.name);
        let session = match self.sessions.open(&key, &user) {
            Ok(s) => s,
            Err(refusal) => {
                tracing::warn!(vm = %route.name, namespace = %route.namespace, user,
                    subresource = subresource.as_str(), reason = %refusal,
                    "agent API request refused: too many sessions");
                return status(StatusCode::TOO_MANY_REQUESTS, &refusal.to_string());
            }
        };
        match route.action {
            Action::Exec => {
                let (vm, in_use) = match self.admit(&route, &user).await {
                    Ok(admitted) => admitted,
                    Err(refusal) => return refusal,
                };
                let on_upgrade = hyper::upgrade::on(&mut req);
                self.start_exec(route, user, vm, (in_use, session), on_upgrade)
                    .await
            }
            Action::Console { follow } => {
                self.start_console(route, user, vm, follow, session).await
            }
            // Answered before the lookup (it is about no one VM); the same answer here.
            Action::GuestMetrics => guest_readings(self.lookup.as_ref(), route.namespace, &user),
        }
    }

    /// The endpoint of a VM for an exec, once it runs, and its use begun: a VM that
    /// scale-to-zero put to sleep is woken, as its first packet would wake it, and one whose
    /// suspend has begun is waited for and then woken. 409 for a VM that will not run by
    /// itself, 504 for one that did not wake in time (its status says why, e.g. no memory).
    async fn admit(
        &self,
        route: &Route,
        user: &str,
    ) -> Result<(super::GuestEndpoint, InUse), Response<Body>> {
        let (ns, name) = (&route.namespace, &route.name);
        let started = tokio::time::Instant::now();
        let mut asked = false;
        loop {
            match self.lookup.find(ns, name) {
                Some(vm) if !vm.guest_agent => {
                    let msg = format!(
                        "ImpVM {ns}/{name} runs without its guest agent \
                         (spec.guestAgent.enabled: false), so nothing in it can run a command"
                    );
                    return Err(status(StatusCode::CONFLICT, &msg));
                }
                Some(vm) if vm.running && self.lookup.exec_begin(ns, name) => {
                    if asked {
                        tracing::info!(vm = %name, namespace = %ns, user,
                            waited_ms = started.elapsed().as_millis() as u64, "exec woke the VM");
                    }
                    let in_use = InUse {
                        lookup: self.lookup.clone(),
                        namespace: ns.clone(),
                        name: name.clone(),
                    };
                    return Ok((vm, in_use));
                }
                None => return Err(not_on_this_node(route)),
                Some(_) => {}
            }
            if self.lookup.wake(ns, name) == super::Waking::No {
                let msg = format!(
                    "ImpVM {ns}/{name} is not running; exec needs a running VM \
                     (a VM suspended by its user runs again after `imp resume`)"
                );
                return Err(status(StatusCode::CONFLICT, &msg));
            }
            if !asked {
                tracing::info!(vm = %name, namespace = %ns, user, "exec wakes a sleeping VM");
                asked = true;
            }
            if started.elapsed() >= self.config.wake_timeout {
                tracing::warn!(vm = %name, namespace = %ns, user, "exec: the VM did not wake in time");
                let msg = format!(
                    "ImpVM {ns}/{name} did not wake within {:?}; its status and Events say why",
                    self.config.wake_timeout
                );
                return Err(status(StatusCode::GATEWAY_TIMEOUT, &msg));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn start_exec(
        self: Arc<Self>,
        route: Route,
        user: String,
        vm: super::GuestEndpoint,
        held: (InUse, Session),
        on_upgrade: hyper::upgrade::OnUpgrade,
    ) -> Response<Body> {
        let guest = match imp_vmm::vsock::connect(
            &vm.vsock,
            vm.agent_port,
            self.config.guest_connect_timeout,
        )
        .await
        {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(vm = %route.name, namespace = %route.namespace, user = %user,
                    error = %imp_api::chain::DisplayChain(&e), "exec: the guest agent cannot be reached");
                return status(
                    StatusCode::BAD_GATEWAY,
                    &format!(
                        "The guest agent of ImpVM {}/{} cannot be reached: {e}",
                        route.namespace, route.name
                    ),
                );
            }
        };
        let sessions = Counted::new(self.exec_sessions.clone());
        let opening = self.config.exec_opening_timeout;
        tokio::spawn(async move {
            let _sessions = sessions;
            let _held = held;
            let caller = match on_upgrade.await {
                Ok(up) => TokioIo::new(up),
                Err(e) => {
                    tracing::warn!(vm = %route.name, namespace = %route.namespace, user = %user,
                        error = %imp_api::chain::DisplayChain(&e), "exec: the upgrade failed");
                    return;
                }
            };
            tracing::info!(vm = %route.name, namespace = %route.namespace, user = %user,
                "exec session started");
            match exec::relay(caller, guest, opening).await {
                Ok(()) => tracing::info!(vm = %route.name, namespace = %route.namespace,
                    user = %user, "exec session ended"),
                Err(e) => tracing::warn!(vm = %route.name, namespace = %route.namespace,
                    user = %user, error = %imp_api::chain::DisplayChain(&e), "exec session ended abnormally"),
            }
        });
        let mut resp = Response::new(empty());
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("upgrade"));
        resp.headers_mut()
            .insert(UPGRADE, HeaderValue::from_static(EXEC_UPGRADE));
        resp
    }

    async fn start_console(
        self: Arc<Self>,
        route: Route,
        user: String,
        vm: super::GuestEndpoint,
        follow: bool,
        session: Session,
    ) -> Response<Body> {
        let exists = tokio::fs::try_exists(&vm.serial_log).await.unwrap_or(false);
        if !exists && !vm.running {
            tracing::info!(vm = %route.name, namespace = %route.namespace, user = %user,
                log = %vm.serial_log.display(), "console: no serial log");
            return status(
                StatusCode::NOT_FOUND,
                &format!(
                    "ImpVM {}/{} has no console log",
                    route.namespace, route.name
                ),
            );
        }
        tracing::info!(vm = %route.name, namespace = %route.namespace, user = %user, follow,
            "console stream started");
        let counted = Counted::new(self.console_streams.clone());
        let chunks = Tail {
            path: vm.serial_log,
            follow,
            namespace: route.namespace,
            name: route.name,
            lookup: self.lookup.clone(),
            poll: self.config.console_poll,
        }
        .stream()
        .map_ok(move |chunk| {
            let _alive = (&counted, &session);
            Frame::data(chunk)
        });
        let mut resp = Response::new(BodyExt::boxed_unsync(StreamBody::new(chunks)));
        resp.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        resp
    }
}

/// An exec's use of its VM, ended when dropped (the session is over, or never started).
struct InUse {
    lookup: Arc<dyn VmLookup>,
    namespace: String,
    name: String,
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.lookup.exec_end(&self.namespace, &self.name);
    }
}

/// Counts a live session: one more while it exists.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(counter: Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn empty() -> Body {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// The latest guest figures of `namespace`'s VMs on this node, as JSON (never a guest asked).
fn guest_readings(lookup: &dyn VmLookup, namespace: String, user: &str) -> Response<Body> {
    let items = lookup.guest_readings(&namespace);
    tracing::debug!(namespace = %namespace, user, vms = items.len(), "guest metrics read");
    let list = super::top::GuestReadingList {
        namespace,
        items,
        failures: Vec::new(),
    };
    let Ok(body) = serde_json::to_vec(&list) else {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The guest metrics could not be encoded",
        );
    };
    let mut resp = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// 404 for a VM this node does not have (or no longer has, while an exec waited for it).
fn not_on_this_node(route: &Route) -> Response<Body> {
    let msg = format!(
        "ImpVM {}/{} is not on this node",
        route.namespace, route.name
    );
    status(StatusCode::NOT_FOUND, &msg)
}
