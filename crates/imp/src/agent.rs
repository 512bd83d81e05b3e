//! `imp agent`: the node agent, the DaemonSet's process on every node.
//!
//! Flags have environment fallbacks, and the Go agent's variable names are accepted too
//! (`NODE_NAME`, `NODE_IP`, `FC_BIN`, `FC_KERNEL`, `FC_KERNEL_ARGS`, `IMP_IMAGE_CACHE`), so the
//! same chart wiring works. The agent probes what the node can run, serves `/metrics`,
//! `/healthz` and `/readyz`, and reconciles the ImpVMs placed on its node until SIGTERM; VMs
//! run under their own shims and keep running when the agent stops.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use imp_agent::api::auth::KubeReviewer;
use imp_agent::api::server::{AgentApi, ApiConfig};
use imp_agent::api::tls::{Identity, Kept};
use imp_agent::net::{NetSettings, NodeNet};
use imp_agent::node::advertise;
use imp_agent::node::boot::BootSettings;
use imp_agent::node::capabilities::{self, DefaultRuntime, HostFiles};
use imp_agent::node::metrics::{self, Health, Metrics};
use imp_agent::node::network;
use imp_agent::node::reconciler::{self, Context, Settings};
use imp_agent::node::serial;
use imp_agent::runtime::shim::ShimCommand;
use imp_agent::runtime::spec::Runtime;
use imp_agent::runtime::state::StateDir;

use crate::local::parse_duration;
use crate::shutdown;

/// The VMM for VMs whose class names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RuntimeChoice {
    /// Firecracker where KVM boots Linux guests and the binary exists, else QEMU.
    Auto,
    /// QEMU `-M microvm` (TCG where KVM cannot boot Linux).
    Qemu,
    /// Firecracker.
    Firecracker,
}

/// Which VMs' serial consoles reach the agent's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SerialLogChoice {
    /// One-shot (ephemeral) VMs: what they printed, their exit marker included.
    Ephemeral,
    /// Every VM, services too.
    All,
    /// None.
    Off,
}

/// `imp agent`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// This node's name, as the Node object has it.
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// This node's address, where the agent API is reached.
    #[arg(long, env = "NODE_IP")]
    node_ip: Option<String>,
    /// Where VM directories and records live.
    #[arg(
        long,
        env = "IMP_AGENT_STATE_DIR",
        default_value = "/var/lib/imp/agent"
    )]
    state_dir: PathBuf,
    /// The image cache (default: `cache/` in the state directory).
    #[arg(long, env = "IMP_IMAGE_CACHE")]
    image_cache: Option<PathBuf>,
    /// The most bytes one image may unpack to on this node (a VM's disk size caps it too).
    #[arg(long, env = "IMP_IMAGE_MAX_BYTES")]
    image_max_bytes: Option<u64>,
    /// The image cache's budget in bytes (cached bases and blobs): the least recently used
    /// images no VM of the node uses are evicted down to it after each pull and every 5
    /// minutes; 0: no budget.
    #[arg(long, env = "IMP_IMAGE_CACHE_MAX_BYTES", default_value_t = 20 << 30)]
    image_cache_max_bytes: u64,
    /// The guest kernel (also IMP_KERNEL; default: target/guest-kernel/vmlinux beside the
    /// binary, else /var/lib/imp/kernel/vmlinux).
    #[arg(long, env = "FC_KERNEL")]
    kernel: Option<PathBuf>,
    /// Kernel arguments added to imp's own.
    #[arg(long, env = "FC_KERNEL_ARGS")]
    kernel_args: Option<String>,
    /// The kernel's modules directory (default: `modules` beside the kernel).
    #[arg(long)]
    modules: Option<PathBuf>,
    /// The static guest init (default: target/imp-guest/imp-guest beside the binary, else
    /// /var/lib/imp/imp-guest).
    #[arg(long, env = "IMP_GUEST")]
    guest: Option<PathBuf>,
    /// The Firecracker binary.
    #[arg(long, env = "FC_BIN", default_value = "/usr/local/bin/firecracker")]
    firecracker: PathBuf,
    /// The VMM for VMs whose class names none.
    #[arg(long, env = "IMP_RUNTIME", value_enum, default_value_t = RuntimeChoice::Auto)]
    runtime: RuntimeChoice,
    /// Parent of every VM's cgroup below each hierarchy's root; empty: VMs get no cgroup of
    /// their own (then a restart of the agent's container kills them).
    #[arg(long, default_value = "imp")]
    cgroup_parent: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// Address of the authenticated exec and console API (HTTPS).
    #[arg(long, default_value = "0.0.0.0:10251")]
    api_addr: SocketAddr,
    /// `host:port` under which clients reach the API, published on the Node (default: NODE_IP
    /// and the API's port, or the bound address).
    #[arg(long)]
    api_advertise: Option<String>,
    /// The API's TLS certificate (PEM); without it a self-signed one is made on the first
    /// start and kept in `tls/` of the state directory.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The API's TLS key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The most exec and console sessions open at once into one VM (0: no limit); more are
    /// answered 429.
    #[arg(long, default_value_t = imp_agent::api::sessions::DEFAULT_PER_VM)]
    api_max_sessions_per_vm: usize,
    /// The most exec and console sessions one caller has open at once on this node (0: no
    /// limit); more are answered 429.
    #[arg(long, default_value_t = imp_agent::api::sessions::DEFAULT_PER_CALLER)]
    api_max_sessions_per_caller: usize,
    /// How long a guest may take until its agent answers.
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    boot_timeout: Duration,
    /// How long a deleted VM's workload gets to exit before the VM is killed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    stop_grace: Duration,
    /// How long after a failed suspend (the VM runs on) it is tried again, while the ImpVM's
    /// desiredState stays Suspended.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    suspend_retry: Duration,
    /// Memory (MiB) a resume leaves free for the node beyond the VM's and its VMM's own: a
    /// suspended VM that does not fit stays Suspended with a condition saying so.
    #[arg(long, env = "IMP_RESUME_RESERVE_MIB", default_value_t = 128)]
    resume_reserve_mib: u64,
    /// Which VMs' serial console lines are logged by the agent (escaped, rate-limited per VM).
    #[arg(long, env = "IMP_SERIAL_LOG", value_enum, default_value_t = SerialLogChoice::Ephemeral)]
    serial_log: SerialLogChoice,
    /// Serial console lines per second one VM may put in the agent's log; the rest are counted
    /// in a line saying how many were dropped.
    #[arg(long, default_value_t = serial::Policy::default().lines_per_sec)]
    serial_log_rate: u32,
    /// Serial console lines one VM may log at once (a boot's worth) before the rate applies.
    #[arg(long, default_value_t = serial::Policy::default().burst)]
    serial_log_burst: u32,
    /// Bytes each VM's serial log may hold before it is moved to `serial.log.1` (the previous
    /// one dropped) and started afresh; checked every 10 s. 0: never rotated.
    #[arg(long, env = "IMP_SERIAL_LOG_MAX_BYTES", default_value_t = imp_agent::runtime::console::SERIAL_LOG_MAX_BYTES)]
    serial_log_max_bytes: u64,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// UDP port of the VXLAN overlay between nodes (the same on every node).
    #[arg(long, env = "IMP_VXLAN_PORT", default_value_t = 4789)]
    vxlan_port: u16,
    /// The nftables program that loads imp's NAT and isolation rules.
    #[arg(long, env = "IMP_NFT", default_value = "nft")]
    nft: String,
    /// A range no guest may reach unless its ImpNetwork allows it (spec.egress.allow); give
    /// the cluster's pod and service ranges. Link-local, the node's own networks and the API
    /// server's address are denied without it. Repeat, or separate with commas.
    #[arg(long, env = "IMP_EGRESS_DENY", value_delimiter = ',')]
    egress_deny: Vec<imp_api::ipv4::Ipv4Cidr>,
    /// Do not wire VM networks on this node (VMs with a networkRef are refused here).
    #[arg(long)]
    no_network: bool,
    /// How often each running VM's guest is asked for its CPU, memory and disk figures
    /// (the imp_vm_guest_* metrics, `imp top`); 0s: never.
    #[arg(long, env = "IMP_GUEST_METRICS_INTERVAL", default_value = "15s", value_parser = parse_duration)]
    guest_metrics_interval: Duration,
    /// How long one guest may take to report its figures.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    guest_metrics_timeout: Duration,
    /// The namespace of the agent's Lease (`imp-agent-<node>`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "imp-system")]
    lease_namespace: String,
    /// How long the agent may fail to renew its Lease before it stops (fences) every VM of
    /// the node, so the operator can run them elsewhere; 0s: never fence (VMs of a node cut
    /// off from the API server may then run twice once the operator moves them).
    #[arg(long, env = "IMP_FENCE_AFTER", default_value = "30s", value_parser = parse_duration)]
    fence_after: Duration,
}

/// Runs the agent until SIGTERM or Ctrl-C.
pub fn main(args: Args) -> anyhow::Result<()> {
    crate::logging::init(args.log_json);
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(run(args))
}

/// A host file from its flag, else beside the binary (a build tree), else its standard place.
fn host_file(flag: Option<PathBuf>, env: &str, in_target: &str, standard: &str) -> PathBuf {
    if let Some(p) = flag.or_else(|| std::env::var_os(env).map(PathBuf::from)) {
        return p;
    }
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1).take(3) {
            let c = dir.join(in_target);
            if c.is_file() {
                return c;
            }
        }
    }
    PathBuf::from(standard)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let kernel = host_file(
        args.kernel,
        "IMP_KERNEL",
        "guest-kernel/vmlinux",
        "/var/lib/imp/kernel/vmlinux",
    );
    let modules = args.modules.unwrap_or_else(|| {
        kernel
            .parent()
            .map(|d| d.join("modules"))
            .unwrap_or_default()
    });
    let guest = host_file(
        args.guest,
        "IMP_GUEST",
        "imp-guest/imp-guest",
        "/var/lib/imp/imp-guest",
    );
    let state = StateDir::new(args.state_dir);
    let cache_dir = args.image_cache.unwrap_or_else(|| state.cache());
    // What unpacks killed half-way (an agent or shim stopped mid-pull) left behind.
    let images = imp_agent::image::ImageStore::new(
        cache_dir.join("images"),
        imp_agent::image::Limits::default(),
    );
    if let Err(e) = images.remove_stale().await {
        tracing::warn!(error = %format!("{e:#}"), "removing stale image temporaries");
    }
    let image_cache_max_bytes = Some(args.image_cache_max_bytes).filter(|b| *b > 0);
    let image_cache = image_cache_max_bytes.map(|budget| {
        tokio::spawn(imp_agent::node::disk::keep_image_cache(
            images.clone(),
            state.clone(),
            budget,
        ))
    });
    let files = HostFiles {
        kernel,
        modules,
        guest,
        firecracker: args.firecracker,
    };
    let default_runtime = match args.runtime {
        RuntimeChoice::Auto => DefaultRuntime::Auto,
        RuntimeChoice::Qemu => DefaultRuntime::Fixed(Runtime::Qemu),
        RuntimeChoice::Firecracker => DefaultRuntime::Fixed(Runtime::Firecracker),
    };
    let caps = capabilities::probe(&files, default_runtime, &cache_dir).await;
    let node = args.node_name.clone();
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
    let runtimes = advertise::runtimes_annotation(&caps);
    let health = Arc::new(Health::new());
    let metrics = Arc::new(Metrics::new());
    let listener = metrics::bind(args.metrics_addr).await?;
    tracing::info!(addr = %listener.local_addr().context("reading the ops address")?, "serving /metrics, /healthz and /readyz");

    let mut config = kube::Config::infer()
        .await
        .context("loading the Kubernetes client config (KUBECONFIG or in-cluster)")?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("imp-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    let api_server = api_server_address(&config);
    let client = kube::Client::try_from(config).context("building the Kubernetes client")?;
    let cgroup_parent = Some(args.cgroup_parent).filter(|p| !p.is_empty());
    let settings = Settings {
        node: node.clone(),
        state,
        shim: ShimCommand::current_exe().context("finding the imp binary")?,
        boot: BootSettings {
            files,
            extra_kernel_args: args.kernel_args,
            boot_timeout: args.boot_timeout,
            cgroup_parent,
            cache_dir,
            image_max_bytes: args.image_max_bytes,
            image_cache_max_bytes,
        },
        stop_grace: args.stop_grace,
        suspend_retry: args.suspend_retry,
        resume_reserve_mib: args.resume_reserve_mib,
        serial: serial::Policy {
            mode: match args.serial_log {
                SerialLogChoice::Ephemeral => serial::Mode::Ephemeral,
                SerialLogChoice::All => serial::Mode::All,
                SerialLogChoice::Off => serial::Mode::Off,
            },
            lines_per_sec: args.serial_log_rate,
            burst: args.serial_log_burst,
        },
        poll: Duration::from_millis(250),
    };
    health.set_ready(caps.not_ready());
    let vtep: Option<std::net::Ipv4Addr> = match &args.node_ip {
        Some(ip) => Some(
            ip.parse()
                .with_context(|| format!("--node-ip (NODE_IP) {ip:?} is not an IPv4 address"))?,
        ),
        None => None,
    };
    let state_dir = settings.state.clone();
    let mut ctx = Context::new(client.clone(), settings, caps, metrics.clone());
    let mut fencing = None;
    if !args.fence_after.is_zero() {
        let s = imp_agent::node::fence::Settings {
            node: node.clone(),
            namespace: args.lease_namespace.clone(),
            fence_after: args.fence_after,
            renew_every: (args.fence_after / 3).max(Duration::from_millis(500)),
        };
        let fence = Arc::new(imp_agent::node::fence::Fence::default());
        ctx = ctx.with_fence(fence.clone());
        let lease = tokio::spawn(imp_agent::node::fence::keep_lease(
            client.clone(),
            s.clone(),
            fence.clone(),
        ));
        let watchdog = tokio::spawn(imp_agent::node::fence::watchdog(
            state_dir.clone(),
            s,
            fence,
            metrics.clone(),
        ));
        fencing = Some((lease, watchdog));
    }
    let mut network_watch = None;
    let mut links = None;
    if !args.no_network {
        let net = Arc::new(
            NodeNet::new(NetSettings {
                vtep,
                vxlan_port: args.vxlan_port,
                nft: args.nft.clone(),
                egress_deny: args.egress_deny.clone(),
                api_server,
            })
            .context("opening the node's netlink socket")?,
        );
        links = Some(net.netlink());
        network::adopt(&net, &state_dir).await;
        if let Err(e) = net.sync().await {
            tracing::warn!(error = %imp_agent::net::chain(&e), "first sync of the node's networks");
        }
        network_watch = Some(tokio::spawn(network::watch(
            client.clone(),
            net.clone(),
            metrics.clone(),
        )));
        ctx = ctx.with_network(net);
        tracing::info!(node, vtep = ?vtep, vxlan_port = args.vxlan_port, "wiring VM networks on this node");
    }
    let ctx = Arc::new(ctx);
    let api_listener = tokio::net::TcpListener::bind(args.api_addr)
        .await
        .with_context(|| format!("binding the agent API to {}", args.api_addr))?;
    let bound = api_listener
        .local_addr()
        .context("reading the API address")?;
    let identity = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Identity::from_pem_files(cert, key)?,
        _ => {
            let mut names = vec![node.clone()];
            names.extend(args.node_ip.clone());
            let dir = state_dir.root().join("tls");
            let (identity, kept) = Identity::persistent(&dir, &names)?;
            match kept {
                Kept::Reused => {}
                Kept::Created => {
                    tracing::info!(dir = %dir.display(), "made the agent API's certificate")
                }
                Kept::Replaced(why) => tracing::warn!(dir = %dir.display(), why,
                    "the kept agent API certificate was unusable; made a new one (clients pin its new fingerprint once the Node shows it)"),
            }
            identity
        }
    };
    let advertise = args
        .api_advertise
        .clone()
        .unwrap_or_else(|| match &args.node_ip {
            Some(ip) if bound.ip().is_unspecified() => format!("{ip}:{}", bound.port()),
            _ => bound.to_string(),
        });
    // Published in the background: a Node that is not there yet (or a missing RBAC rule) must
    // not keep the agent from running its VMs; it is retried until it works.
    let publisher = {
        let published = Published {
            endpoint: advertise.clone(),
            fingerprint: identity.fingerprint().to_owned(),
            vtep: vtep.map(|v| v.to_string()),
            runtimes,
        };
        let (client, node) = (client.clone(), node.clone());
        tokio::spawn(async move {
            while let Err(e) = publish_endpoint(&client, &node, &published).await {
                tracing::warn!(node, error = %format!("{e:#}"), "cannot publish the agent API's address yet; retrying in 10 s");
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
            tracing::info!(
                node,
                endpoint = published.endpoint,
                runtimes = published.runtimes,
                "published the agent API's address and the node's runtimes on the Node"
            );
        })
    };
    let cpu_model = advertise::host_cpu_model().map(|model| {
        tokio::spawn(advertise::keep_cpu_model(
            client.clone(),
            node.clone(),
            model,
            reconciler::FIELD_MANAGER,
        ))
    });
    let serial_logs = (args.serial_log_max_bytes > 0).then(|| {
        tokio::spawn(imp_agent::node::disk::keep_serial_logs(
            state_dir.clone(),
            args.serial_log_max_bytes,
        ))
    });
    let disk_report = tokio::spawn(imp_agent::node::disk::keep_disk_report(
        client.clone(),
        node.clone(),
        state_dir.root().to_path_buf(),
        metrics.clone(),
        reconciler::FIELD_MANAGER,
    ));
    if ctx.load_vms().await.is_none() {
        tracing::warn!(state = %state_dir.root().display(), "cannot list the VM records yet; the agent API knows no VM until the first poll");
    }
    let api = AgentApi::new(
        ctx.vms(),
        Arc::new(KubeReviewer::new(client.clone())),
        ApiConfig {
            sessions: imp_agent::api::sessions::SessionLimits {
                per_vm: args.api_max_sessions_per_vm,
                per_caller: args.api_max_sessions_per_caller,
            },
            ..ApiConfig::default()
        },
    );
    tracing::info!(addr = %bound, advertise, "serving the authenticated exec and console API");

    let (_stop_tx, stop_rx) =
        shutdown::on_signals("shutting down; VMs keep running under their shims");
    let stopped = shutdown::stopped;
    let ops = tokio::spawn(metrics::serve(
        listener,
        metrics.clone(),
        health,
        stopped(stop_rx.clone()),
    ));
    let server = tokio::spawn(api.clone().serve(
        api_listener,
        identity.server_config()?,
        stopped(stop_rx.clone()),
    ));
    let guest_metrics = tokio::spawn(imp_agent::node::guest_metrics::run(
        ctx.vms(),
        metrics.clone(),
        imp_agent::node::guest_metrics::Settings {
            node: node.clone(),
            every: args.guest_metrics_interval,
            timeout: args.guest_metrics_timeout,
            links,
        },
        stopped(stop_rx.clone()),
    ));
    let gauges = tokio::spawn(async move {
        loop {
            metrics.set_api_sessions(api.exec_sessions(), api.console_streams());
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let snapshots = tokio::spawn(imp_agent::node::snapshots::run(
        Arc::new(imp_agent::node::snapshots::Context::new(
            client.clone(),
            args.node_name.clone(),
            state_dir.clone(),
        )),
        stopped(stop_rx.clone()),
    ));
    reconciler::run(ctx, stopped(stop_rx)).await;
    if let Some((lease, watchdog)) = fencing {
        watchdog.abort();
        lease.abort();
    }
    snapshots.abort();
    guest_metrics.abort();
    ops.abort();
    server.abort();
    gauges.abort();
    publisher.abort();
    disk_report.abort();
    if let Some(t) = serial_logs {
        t.abort();
    }
    if let Some(t) = image_cache {
        t.abort();
    }
    if let Some(t) = cpu_model {
        t.abort();
    }
    if let Some(w) = network_watch {
        w.abort();
    }
    Ok(())
}

/// What the agent publishes on its Node's annotations.
struct Published {
    /// `host:port` of the agent API.
    endpoint: String,
    /// SHA-256 of its certificate.
    fingerprint: String,
    /// The node's VXLAN address.
    vtep: Option<String>,
    /// The runtimes that can run VMs here (`imp.dev/runtimes`).
    runtimes: String,
}

/// Writes where the agent API is and its certificate's fingerprint on this node's Node object,
/// where `imp exec` and `imp console` read them, the node's VXLAN address, which the
/// operator copies into the VTEP tables, and the runtimes the node can run, which the
/// scheduler matches with classes' `runtime`.
/// The API server's address as the agent reaches it, when it is an IPv4 address (in a Pod: the
/// `kubernetes` Service's), which guests are never let reach.
fn api_server_address(config: &kube::Config) -> Option<std::net::Ipv4Addr> {
    config.cluster_url.host()?.parse().ok()
}

async fn publish_endpoint(
    client: &kube::Client,
    node: &str,
    published: &Published,
) -> anyhow::Result<()> {
    use imp_api::shared::{
        ANNOTATION_AGENT_CERT_SHA256, ANNOTATION_AGENT_ENDPOINT, ANNOTATION_RUNTIMES,
        ANNOTATION_VTEP_ADDRESS,
    };
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let patch = serde_json::json!({"metadata": {"annotations": {
        ANNOTATION_AGENT_ENDPOINT: published.endpoint,
        ANNOTATION_AGENT_CERT_SHA256: published.fingerprint,
        ANNOTATION_VTEP_ADDRESS: published.vtep,
        ANNOTATION_RUNTIMES: published.runtimes,
    }}});
    nodes
        .patch(
            node,
            &kube::api::PatchParams::apply(reconciler::FIELD_MANAGER),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .with_context(|| format!("publishing the agent API's address on Node {node}"))?;
    Ok(())
}
