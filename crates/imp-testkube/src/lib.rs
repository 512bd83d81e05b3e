//! Test infrastructure for imp: never shipped, only a dev-dependency.
//!
//! It holds a Kubernetes API server subset that runs in-process (or as the `imp-testkube`
//! binary) on 127.0.0.1 (or a given address) over plain HTTP, with the semantics controllers depend on:
//! resourceVersion and 409 on stale writes, watches with bookmarks and `410 Gone`, the status
//! subresource, generation, finalizers, ownerReference garbage collection, label and field
//! selectors, merge/JSON/strategic/server-side-apply patches, CRD registration with structural
//! schema and CEL validation, discovery, OpenAPI v2/v3 documents (so kubectl validates and
//! explains) and Table output for kubectl. It is not a full API server: there is no persistence,
//! no admission webhooks, no aggregation, no protobuf objects (only the OpenAPI v2 document is
//! served as protobuf), no server-side field validation and no RBAC enforcement
//! (SubjectAccessReview answers from simple rules).
//!
//! It also holds the guard that decides whether a test whose environment is missing (root, a
//! tool, a binary) skips or fails: it skips on a developer machine and fails when `CI=true`, so
//! a skip can never pass as green in CI. [`registry`] runs a real OCI registry on loopback and
//! writes test images (OCI layouts) to push to it.

pub mod auth;
pub mod cel;
pub mod discovery;
pub mod error;
pub mod events;
pub mod meta;
pub mod openapi;
pub mod patch;
pub mod resource;
pub mod schema;
pub mod selector;
pub mod server;
pub mod store;
pub mod table;
pub mod watch;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

pub use auth::{Auth, Rule, User};
pub use store::Store;

/// Errors building a client for the server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig written for the server could not be read or used.
    #[error("loading the test API server's kubeconfig")]
    Kubeconfig(#[source] kube::config::KubeconfigError),
    /// kube-rs refused the configuration.
    #[error("building a kube client for the test API server")]
    Client(#[source] kube::Error),
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Binding the listening socket failed.
    #[error("binding {host}:{port}")]
    Bind {
        /// Requested address.
        host: std::net::IpAddr,
        /// Requested port.
        port: u16,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing the kubeconfig failed.
    #[error("writing kubeconfig {path}")]
    Kubeconfig {
        /// Where it was to go.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// How to run the server; the default suits most tests.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on: 127.0.0.1 by default; an address inside a test's own network
    /// namespaces when processes in them must reach the server.
    pub host: std::net::IpAddr,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// How many events watches can resume from; older versions get `410 Gone`.
    pub history: usize,
    /// Interval between BOOKMARK events on watches that allow them.
    pub bookmark_interval: Duration,
    /// Tokens and SubjectAccessReview rules; empty means no authentication.
    pub auth: Auth,
    /// Token written into the kubeconfig (when authentication is on).
    pub kubeconfig_token: Option<String>,
    /// Where to write the kubeconfig; None puts it in a fresh temporary directory.
    pub kubeconfig: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            host: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            port: 0,
            history: 10_000,
            bookmark_interval: Duration::from_secs(5),
            auth: Auth::default(),
            kubeconfig_token: None,
            kubeconfig: None,
        }
    }
}

/// Requests served so far, by User-Agent header ("" when absent); benchmarks read it.
type RequestCounts = Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>;

/// A running test API server; it stops when dropped.
#[derive(Debug)]
pub struct TestKube {
    url: String,
    addr: SocketAddr,
    kubeconfig: PathBuf,
    temp_dir: Option<PathBuf>,
    store: Arc<Store>,
    requests: RequestCounts,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

/// Renders a kubeconfig pointing at `url`, so kubectl and kube-rs find the server.
pub fn kubeconfig_yaml(url: &str, token: Option<&str>) -> String {
    let user = match token {
        Some(t) => format!("    token: {t}\n"),
        None => "    username: imp-testkube\n".to_string(),
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: imp-testkube\n  cluster:\n    server: {url}\ncontexts:\n- name: imp-testkube\n  context:\n    cluster: imp-testkube\n    user: imp-testkube\n    namespace: default\ncurrent-context: imp-testkube\nusers:\n- name: imp-testkube\n  user:\n{user}"
    )
}

impl TestKube {
    /// Starts a server with the default configuration on a free port.
    pub async fn start() -> Result<Self, StartError> {
        Self::start_with(Config::default()).await
    }

    /// Starts a server with `config`.
    pub async fn start_with(config: Config) -> Result<Self, StartError> {
        let bind_err = |source| StartError::Bind {
            host: config.host,
            port: config.port,
            source,
        };
        let listener = tokio::net::TcpListener::bind((config.host, config.port))
            .await
            .map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let url = format!("http://{addr}");
        let (kubeconfig, temp_dir) = match &config.kubeconfig {
            Some(p) => (p.clone(), None),
            None => {
                let dir = std::env::temp_dir().join(format!(
                    "imp-testkube-{}-{}",
                    std::process::id(),
                    addr.port()
                ));
                (dir.join("kubeconfig"), Some(dir))
            }
        };
        if let Some(parent) = kubeconfig.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|source| StartError::Kubeconfig {
                    path: kubeconfig.clone(),
                    source,
                })?;
        }
        tokio::fs::write(
            &kubeconfig,
            kubeconfig_yaml(&url, config.kubeconfig_token.as_deref()),
        )
        .await
        .map_err(|source| StartError::Kubeconfig {
            path: kubeconfig.clone(),
            source,
        })?;
        let store = Arc::new(Store::new(config.history));
        let server = Arc::new(server::Server {
            store: store.clone(),
            auth: config.auth.clone(),
            bookmark_every: config.bookmark_interval,
            addr: addr.to_string(),
        });
        let (tx, rx) = oneshot::channel::<()>();
        let requests: RequestCounts = Arc::default();
        let counts = requests.clone();
        let app = server::router(server).layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let counts = counts.clone();
                async move {
                    let agent = req
                        .headers()
                        .get(axum::http::header::USER_AGENT)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    if let Ok(mut m) = counts.lock() {
                        *m.entry(agent).or_insert(0) += 1;
                    }
                    next.run(req).await
                }
            },
        ));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        });
        Ok(Self {
            url,
            addr,
            kubeconfig,
            temp_dir,
            store,
            requests,
            shutdown: Some(tx),
            task,
        })
    }

    /// Base URL, e.g. `http://127.0.0.1:34567`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The socket address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Path of the kubeconfig written for this server.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A kube-rs client configured from this server's kubeconfig, as a controller would be.
    pub async fn client(&self) -> Result<kube::Client, ClientError> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)
            .map_err(ClientError::Kubeconfig)?;
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(ClientError::Kubeconfig)?;
        kube::Client::try_from(cfg).map_err(ClientError::Client)
    }

    /// HTTP requests served so far, by User-Agent, so a benchmark can count a client's calls.
    pub fn requests_by_user_agent(&self) -> std::collections::BTreeMap<String, u64> {
        self.requests.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// The store, for tests that want to look behind the HTTP surface.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
}

impl Drop for TestKube {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.abort();
        if let Some(d) = &self.temp_dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
