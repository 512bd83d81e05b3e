//! The node agent assembled: what `imp agent` runs once its flags are parsed into a
//! [`Config`]. [`run`] probes what the node can run, serves `/metrics`, `/healthz` and
//! `/readyz`, wires VM networks, keeps the node's Lease (and fences its VMs when it cannot),
//! serves the exec and console API, publishes the API's address on the Node, and reconciles
//! the ImpVMs placed on the node until the stop flag is raised; VMs run under their own shims
//! and keep running when the agent stops.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use imp_net::{NetSettings, NodeNet};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::advertise::{self, Published};
use super::boot::BootSettings;
use super::capabilities::{self, Capabilities, DefaultRuntime, HostFiles};
use super::metrics::Metrics;
use super::reconciler::{self, Context, Settings};
use super::{disk, fence, guest_metrics, network, serial, snapshots};
use crate::api::auth::{Gateway, follow_pins};
use crate::api::server::{AgentApi, ApiConfig};
use crate::api::sessions::SessionLimits;
use crate::api::tls::{Identity, Kept, TlsError};
use crate::runtime::control::ShimCommand;
use crate::runtime::state::StateDir;
use imp_telemetry::Health;

/// Everything the agent is told at start.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's name, as the Node object has it.
    pub node: String,
    /// This node's address: the VXLAN endpoint, and where the API is advertised.
    pub node_ip: Option<Ipv4Addr>,
    /// Where VM directories and records live.
    pub state_dir: PathBuf,
    /// Directories, besides the defaults, node-local snapshots may go in (`--snapshot-root`).
    pub snapshot_roots: Vec<PathBuf>,
    /// The host-wide record of claimed VMM uids, shared with `imp run` and any other agent of
    /// the host (`None`: `vmm-uids/` of the state directory, this agent's VMs alone).
    pub vmm_uid_dir: Option<PathBuf>,
    /// The image cache (default: `cache/` in the state directory).
    pub image_cache: Option<PathBuf>,
    /// The most bytes one image may unpack to.
    pub image_max_bytes: Option<u64>,
    /// The image cache's budget in bytes; 0: none.
    pub image_cache_max_bytes: u64,
    /// The kernel, modules, guest init and Firecracker binary.
    pub files: HostFiles,
    /// Kernel arguments added to imp's own.
    pub kernel_args: Option<String>,
    /// The VMM for VMs whose class names none.
    pub default_runtime: DefaultRuntime,
    /// Parent of every VM's cgroup; `None`: VMs get no cgroup of their own.
    pub cgroup_parent: Option<String>,
    /// Address of /metrics, /healthz and /readyz.
    pub metrics_addr: SocketAddr,
    /// Serve /metrics to anyone who reaches the address; else only to the node itself and to
    /// bearer tokens allowed to `get /metrics` ([`crate::node::metrics_auth`]).
    pub metrics_open: bool,
    /// Address of the exec and console API.
    pub api_addr: SocketAddr,
    /// `host:port` published for the API (default: the node's address and the API's port).
    pub api_advertise: Option<String>,
    /// The API's certificate and key (PEM); `None`: a self-signed one kept in `tls/`.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Exec and console sessions allowed at once.
    pub sessions: SessionLimits,
    /// Bytes per second a VM moving away may be sent at (`None`: no cap).
    pub migration_bandwidth: Option<u64>,
    /// The ConfigMap (`namespace/name`) in which the operator publishes its gateway's client
    /// certificates, the only callers the API serves.
    pub gateway_configmap: String,
    /// How long a guest may take until its agent answers.
    pub boot_timeout: Duration,
    /// How long a deleted VM's workload gets to exit.
    pub stop_grace: Duration,
    /// How long after a failed suspend it is tried again.
    pub suspend_retry: Duration,
    /// Memory (MiB) a resume leaves free beyond the VM's.
    pub resume_reserve_mib: u64,
    /// Which serial console lines reach the agent's log, and how fast.
    pub serial: serial::Policy,
    /// Bytes a serial log may hold before it is rotated; 0: never.
    pub serial_log_max_bytes: u64,
    /// VM networking; `None`: VMs with a networkRef are refused on this node.
    pub network: Option<NetworkConfig>,
    /// How often guests are asked for their figures; zero: never.
    pub guest_metrics_interval: Duration,
    /// How long one guest may take to answer.
    pub guest_metrics_timeout: Duration,
    /// The namespace of the agent's Lease.
    pub lease_namespace: String,
    /// How long the Lease may go unrenewed before the node's VMs are fenced; zero: never.
    pub fence_after: Duration,
}

/// The node's networking settings.
#[derive(Debug, Clone)]
pub struct NetworkConfig {
    /// The overlay's UDP port.
    pub vxlan_port: u16,
    /// The nftables program.
    pub nft: String,
    /// Ranges no guest reaches unless its network allows it.
    pub egress_deny: Vec<imp_api::ipv4::Ipv4Cidr>,
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A listener could not be bound.
    #[error("binding the {what} to {addr}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The ops server could not start.
    #[error(transparent)]
    Ops(#[from] imp_telemetry::OpsError),
    /// The API's certificate could not be loaded or made.
    #[error("the agent API's certificate")]
    Tls(#[from] TlsError),
    /// The node's netlink socket could not be opened.
    #[error("opening the node's netlink socket")]
    Net(#[from] imp_net::NetError),
    /// The binary that runs shims could not be found.
    #[error("finding the imp binary that runs the shims")]
    ShimBinary(#[source] std::io::Error),
    /// The Kubernetes client could not be built.
    #[error("building the Kubernetes client")]
    Client(#[source] kube::Error),
    /// A `--snapshot-root` cannot be one.
    #[error("--snapshot-root")]
    SnapshotRoots(#[from] crate::snapshot::place::RootError),
}

/// Runs the agent on `client_config` until `stop` is raised.
pub async fn run(
    config: Config,
    client_config: kube::Config,
    stop: watch::Receiver<bool>,
) -> Result<(), AgentError> {
    let mut state = StateDir::new(config.state_dir.clone());
    if let Some(dir) = &config.vmm_uid_dir {
        state = state.with_vmm_uid_dir(dir);
    }
    let state_abs = std::path::absolute(&config.state_dir).unwrap_or(config.state_dir.clone());
    let roots = crate::snapshot::place::Roots::new(&state_abs, &config.snapshot_roots)?;
    tracing::info!(
        roots = roots.shown(),
        "node-local snapshots go only in these directories"
    );
    let cache_dir = config.image_cache.clone().unwrap_or_else(|| state.cache());
    let mut tasks = Vec::new();
    tasks.extend(keep_image_cache(&config, &state, &cache_dir).await);
    let caps = probe(&config, &cache_dir).await;
    let health = Arc::new(Health::new());
    let metrics = Arc::new(Metrics::new());
    let ops = imp_telemetry::bind(config.metrics_addr).await?;
    let api_server = client_config
        .cluster_url
        .host()
        .and_then(|h| h.parse().ok());
    let client = kube::Client::try_from(client_config).map_err(AgentError::Client)?;
    health.set_readiness(caps.not_ready());
    let runtimes = advertise::runtimes_annotation(&caps);
    let settings = settings(&config, state.clone(), cache_dir, roots.clone())?;
    let mut ctx = Context::new(client.clone(), settings, caps, metrics.clone());
    if let Some((fence, lease, watchdog)) = fencing(&config, &client, &state, &metrics) {
        ctx = ctx.with_fence(fence);
        tasks.extend([lease, watchdog]);
    }
    let mut links = None;
    if let Some(net) = &config.network {
        let (node_net, watch) =
            wire_networks(&config, net, api_server, &client, &state, &metrics).await?;
        links = Some(node_net.netlink());
        ctx = ctx.with_network(node_net);
        tasks.push(watch);
    }
    let (api_listener, identity, advertised) = api_endpoint(&config, &state).await?;
    // VMs moving away are sent with the API's certificate; those moving here arrive through it.
    let moves = crate::api::moves::Moves::new(state.root().join("moves"));
    ctx = ctx.with_moves(reconciler::MoveKit {
        identity: identity.client_identity(),
        store: moves.clone(),
        bandwidth: config.migration_bandwidth,
    });
    let ctx = Arc::new(ctx);
    let published = Published {
        endpoint: advertised,
        fingerprint: identity.fingerprint().to_owned(),
        vtep: config.node_ip.map(|v| v.to_string()),
        runtimes,
    };
    tasks.extend(node_keepers(&config, &client, &state, &metrics, published));
    if ctx.load_vms().await.is_none() {
        tracing::warn!(state = %state.root().display(), "cannot list the VM records yet; the agent API knows no VM until the first poll");
    }
    let gateway = Gateway::reading(client.clone(), &config.gateway_configmap);
    tasks.push(tokio::spawn(follow_pins(
        gateway.clone(),
        stopped(stop.clone()),
    )));
    let receiver = crate::api::moves::MoveReceiver::new(
        crate::node::move_authority::FromApi::new(client.clone(), config.node.clone()),
        moves,
    );
    let api = AgentApi::with_moves(
        ctx.vms(),
        gateway,
        receiver,
        ApiConfig {
            sessions: config.sessions,
            ..ApiConfig::default()
        },
    );
    let tls = identity.server_config()?;
    let guard = (!config.metrics_open).then(|| {
        let auth: Arc<dyn imp_telemetry::Guard> =
            Arc::new(crate::node::metrics_auth::KubeAuth::new(client.clone()));
        auth
    });
    let served = imp_telemetry::serve_listener_guarded(
        ops,
        metrics.clone(),
        health,
        guard,
        stopped(stop.clone()),
    );
    tasks.push(tokio::spawn(async move {
        if let Err(e) = served.await {
            tracing::error!(error = %imp_api::chain::chain(&e), "serving /metrics, /healthz and /readyz");
        }
    }));
    tasks.push(tokio::spawn(api.clone().serve(
        api_listener,
        tls,
        stopped(stop.clone()),
    )));
    tasks.extend(observers(
        &config, &ctx, &client, &state, &metrics, api, &stop, links, roots,
    ));
    reconciler::run(ctx, stopped(stop)).await;
    for t in tasks {
        t.abort();
    }
    Ok(())
}

/// Completes once the flag is raised (or its sender is gone).
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Removes what killed unpacks left, and keeps the image cache within its budget.
async fn keep_image_cache(
    config: &Config,
    state: &StateDir,
    cache_dir: &std::path::Path,
) -> Option<JoinHandle<()>> {
    let images = imp_image::ImageStore::new(cache_dir.join("images"), imp_image::Limits::default());
    if let Err(e) = images.remove_stale().await {
        tracing::warn!(error = %imp_api::chain::chain(&e), "removing stale image temporaries");
    }
    let budget = Some(config.image_cache_max_bytes).filter(|b| *b > 0)?;
    Some(tokio::spawn(disk::keep_image_cache(
        images,
        state.clone(),
        budget,
    )))
}

/// What the node can run, said in the log.
async fn probe(config: &Config, cache_dir: &std::path::Path) -> Capabilities {
    let caps = capabilities::probe(&config.files, config.default_runtime, cache_dir).await;
    let node = &config.node;
    match caps.not_ready() {
        None => tracing::info!(
            node,
            runtime = caps.default_runtime.as_str(),
            "node can run VMs"
        ),
        Some(ref p) => tracing::error!(node, problem = %p, "node cannot run VMs as configured"),
    }
    if let Some(note) = capabilities::unavailable_note(&caps) {
        tracing::info!(node, problem = %note, "a runtime is unavailable");
    }
    caps
}

/// The reconciler's settings.
fn settings(
    config: &Config,
    state: StateDir,
    cache_dir: PathBuf,
    snapshot_roots: crate::snapshot::place::Roots,
) -> Result<Settings, AgentError> {
    Ok(Settings {
        node: config.node.clone(),
        state,
        shim: ShimCommand::current_exe().map_err(AgentError::ShimBinary)?,
        boot: BootSettings {
            files: config.files.clone(),
            extra_kernel_args: config.kernel_args.clone(),
            boot_timeout: config.boot_timeout,
            cgroup_parent: config.cgroup_parent.clone(),
            cache_dir,
            image_max_bytes: config.image_max_bytes,
            image_cache_max_bytes: Some(config.image_cache_max_bytes).filter(|b| *b > 0),
        },
        stop_grace: config.stop_grace,
        suspend_retry: config.suspend_retry,
        resume_reserve_mib: config.resume_reserve_mib,
        serial: config.serial,
        poll: Duration::from_millis(250),
        snapshot_roots,
    })
}

/// The node's Lease keeper and the watchdog that fences its VMs, unless fencing is off.
fn fencing(
    config: &Config,
    client: &kube::Client,
    state: &StateDir,
    metrics: &Arc<Metrics>,
) -> Option<(Arc<fence::Fence>, JoinHandle<()>, JoinHandle<()>)> {
    if config.fence_after.is_zero() {
        return None;
    }
    let s = fence::Settings {
        node: config.node.clone(),
        namespace: config.lease_namespace.clone(),
        fence_after: config.fence_after,
        renew_every: (config.fence_after / 3).max(Duration::from_millis(500)),
    };
    let f = Arc::new(fence::Fence::default());
    let lease = tokio::spawn(fence::keep_lease(client.clone(), s.clone(), f.clone()));
    let watchdog = tokio::spawn(fence::watchdog(
        state.clone(),
        s,
        f.clone(),
        metrics.clone(),
    ));
    Some((f, lease, watchdog))
}

/// Opens the node's networking, adopts the networks of the VMs already running, and keeps it
/// in step with the cluster's ImpNetworks.
async fn wire_networks(
    config: &Config,
    net: &NetworkConfig,
    api_server: Option<Ipv4Addr>,
    client: &kube::Client,
    state: &StateDir,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<NodeNet>, JoinHandle<()>), AgentError> {
    let api_servers = network::read_api_addresses(client, api_server)
        .await
        .unwrap_or_else(|| network::api_addresses(api_server, None));
    let node_net = Arc::new(NodeNet::new(NetSettings {
        vtep: config.node_ip,
        vxlan_port: net.vxlan_port,
        nft: net.nft.clone(),
        egress_deny: net.egress_deny.clone(),
        api_servers,
    })?);
    network::adopt(&node_net, state).await;
    if let Err(e) = node_net.sync().await {
        tracing::warn!(error = %imp_api::chain::chain(&e), "first sync of the node's networks");
    }
    let watch = tokio::spawn(network::watch(
        client.clone(),
        node_net.clone(),
        metrics.clone(),
        api_server,
    ));
    tracing::info!(node = config.node, vtep = ?config.node_ip, vxlan_port = net.vxlan_port, "wiring VM networks on this node");
    Ok((node_net, watch))
}

/// The API's listener, its certificate and the `host:port` published for it.
async fn api_endpoint(
    config: &Config,
    state: &StateDir,
) -> Result<(tokio::net::TcpListener, Identity, String), AgentError> {
    let bind_err = |source| AgentError::Bind {
        what: "agent API",
        addr: config.api_addr,
        source,
    };
    let listener = tokio::net::TcpListener::bind(config.api_addr)
        .await
        .map_err(bind_err)?;
    let bound = listener.local_addr().map_err(bind_err)?;
    let identity = match &config.tls {
        Some((cert, key)) => Identity::from_pem_files(cert, key)?,
        None => kept_identity(config, state)?,
    };
    let advertised = config
        .api_advertise
        .clone()
        .unwrap_or_else(|| match config.node_ip {
            Some(ip) if bound.ip().is_unspecified() => format!("{ip}:{}", bound.port()),
            _ => bound.to_string(),
        });
    tracing::info!(addr = %bound, advertise = advertised, "serving the authenticated exec and console API");
    Ok((listener, identity, advertised))
}

/// The self-signed certificate kept in `tls/` of the state directory (made on first use).
fn kept_identity(config: &Config, state: &StateDir) -> Result<Identity, TlsError> {
    let mut names = vec![config.node.clone()];
    names.extend(config.node_ip.map(|ip| ip.to_string()));
    let dir = state.root().join("tls");
    let (identity, kept) = Identity::persistent(&dir, &names)?;
    match kept {
        Kept::Reused => {}
        Kept::Created => tracing::info!(dir = %dir.display(), "made the agent API's certificate"),
        Kept::Replaced(why) => tracing::warn!(dir = %dir.display(), why,
            "the kept agent API certificate was unusable; made a new one (clients pin its new fingerprint once the Node shows it)"),
    }
    Ok(identity)
}

/// What keeps the Node and the node's disk in step: the published API address and runtimes,
/// the CPU model, serial log rotation and the disk report.
fn node_keepers(
    config: &Config,
    client: &kube::Client,
    state: &StateDir,
    metrics: &Arc<Metrics>,
    published: Published,
) -> Vec<JoinHandle<()>> {
    let node = config.node.clone();
    let mut tasks = vec![
        tokio::spawn(advertise::keep_publishing(
            client.clone(),
            node.clone(),
            published,
            reconciler::FIELD_MANAGER,
        )),
        tokio::spawn(disk::keep_disk_report(
            client.clone(),
            node.clone(),
            state.root().to_path_buf(),
            metrics.clone(),
            reconciler::FIELD_MANAGER,
        )),
    ];
    if let Some(model) = advertise::host_cpu_model() {
        tasks.push(tokio::spawn(advertise::keep_cpu_model(
            client.clone(),
            node,
            model,
            reconciler::FIELD_MANAGER,
        )));
    }
    if config.serial_log_max_bytes > 0 {
        tasks.push(tokio::spawn(disk::keep_serial_logs(
            state.clone(),
            config.serial_log_max_bytes,
        )));
    }
    tasks
}

/// The guests' figures, the API's session gauges and the snapshot executions of the node.
#[allow(clippy::too_many_arguments)]
fn observers(
    config: &Config,
    ctx: &Arc<Context>,
    client: &kube::Client,
    state: &StateDir,
    metrics: &Arc<Metrics>,
    api: Arc<AgentApi>,
    stop: &watch::Receiver<bool>,
    links: Option<imp_net::link::Netlink>,
    roots: crate::snapshot::place::Roots,
) -> Vec<JoinHandle<()>> {
    let guests = tokio::spawn(guest_metrics::run(
        ctx.vms(),
        metrics.clone(),
        guest_metrics::Settings {
            node: config.node.clone(),
            every: config.guest_metrics_interval,
            timeout: config.guest_metrics_timeout,
            links,
        },
        stopped(stop.clone()),
    ));
    let m = metrics.clone();
    let gauges = tokio::spawn(async move {
        loop {
            m.set_api_sessions(api.exec_sessions(), api.console_streams());
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let executions = tokio::spawn(snapshots::run(
        Arc::new(snapshots::Context::new(
            client.clone(),
            config.node.clone(),
            state.clone(),
            roots,
        )),
        stopped(stop.clone()),
    ));
    vec![guests, gauges, executions]
}
