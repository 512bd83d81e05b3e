//! `imp agent`: the node agent, the DaemonSet's process on every node. This file only parses
//! flags into `imp_agent::node::agent::Config` and runs it until SIGTERM.
//!
//! Flags have environment fallbacks, and the Go agent's variable names are accepted too
//! (`NODE_NAME`, `NODE_IP`, `FC_BIN`, `FC_KERNEL`, `FC_KERNEL_ARGS`, `IMP_IMAGE_CACHE`), so the
//! same chart wiring works.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use imp_agent::api::sessions::SessionLimits;
use imp_agent::node::agent::{self, Config, NetworkConfig};
use imp_agent::node::capabilities::{DefaultRuntime, HostFiles};
use imp_agent::node::serial;
use imp_api::shared::VmRuntime;

use crate::args::parse_duration;
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
    /// A directory node-local ImpVMSnapshots may be stored in (`storage.nodeLocal.path`, which
    /// must name one exactly), besides `/var/lib/imp/snapshots` and `snapshot-files/` of the
    /// state directory; any other path fails the snapshot. Repeat, or separate with commas.
    #[arg(
        long = "snapshot-root",
        env = "IMP_SNAPSHOT_ROOTS",
        value_delimiter = ',',
        value_name = "DIR"
    )]
    snapshot_roots: Vec<PathBuf>,
    /// The host-wide record of claimed VMM uids, shared with `imp run` (as root) and every
    /// other agent of the host, so no two of imp's VMMs run as one uid; empty: `vmm-uids/` of
    /// the state directory (this agent's VMs alone).
    #[arg(
        long,
        env = "IMP_VMM_UID_DIR",
        default_value = imp_agent::runtime::state::HOST_VMM_UID_DIR
    )]
    vmm_uid_dir: PathBuf,
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
    /// The Firecracker binary; its jailer must be beside it.
    #[arg(long, env = "FC_BIN", default_value = "/usr/local/bin/firecracker")]
    firecracker: PathBuf,
    /// Run Firecracker even where no jailer is beside it: its VMs then run unconfined, as
    /// root (a guest that escapes into the VMM owns the node). Without it such a node runs
    /// no Firecracker VMs (RuntimeStartFailed, naming this flag).
    #[arg(long)]
    allow_unjailed_firecracker: bool,
    /// The VMM for VMs whose class names none.
    #[arg(long, env = "IMP_RUNTIME", value_enum, default_value_t = RuntimeChoice::Auto)]
    runtime: RuntimeChoice,
    /// Parent of every VM's cgroup below each hierarchy's root; empty: VMs get no cgroup of
    /// their own (then a restart of the agent's container kills them).
    #[arg(long, default_value = "imp")]
    cgroup_parent: String,
    /// Address of /metrics, /healthz and /readyz. /metrics answers the node itself (loopback)
    /// and bearer tokens the API server authenticates and allows `get /metrics` (ClusterRole
    /// imp-metrics-reader); the health routes answer anyone.
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// Serve /metrics (VM names, namespaces, guests' figures) to anyone who reaches
    /// --metrics-addr, without asking the API server.
    #[arg(long)]
    metrics_open: bool,
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
    /// Bytes per second at most that a VM moving to another node (ImpVMMigration) is sent
    /// at (0: no cap).
    #[arg(long, default_value_t = 0)]
    migration_bandwidth: u64,
    /// The ConfigMap (NAMESPACE/NAME) in which the operator publishes its gateway's client
    /// certificates: the API serves only callers that present one of them (users reach it
    /// through the Kubernetes API server and the gateway, never directly).
    #[arg(
        long,
        default_value = "imp-system/imp-gateway-client",
        value_name = "NAMESPACE/NAME"
    )]
    gateway_configmap: String,
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
    let config = config(args)?;
    let mut client_config = kube::Config::infer()
        .await
        .context("loading the Kubernetes client config (KUBECONFIG or in-cluster)")?;
    client_config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("imp-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    let (_stop_tx, stop_rx) =
        shutdown::on_signals("shutting down; VMs keep running under their shims");
    agent::run(config, client_config, stop_rx).await?;
    Ok(())
}

/// The agent's configuration from its flags: host files found, choices mapped, the node's
/// address checked.
fn config(args: Args) -> anyhow::Result<Config> {
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
    let node_ip = match &args.node_ip {
        Some(ip) => Some(
            ip.parse()
                .with_context(|| format!("--node-ip (NODE_IP) {ip:?} is not an IPv4 address"))?,
        ),
        None => None,
    };
    Ok(Config {
        node: args.node_name,
        node_ip,
        state_dir: args.state_dir,
        snapshot_roots: args.snapshot_roots,
        vmm_uid_dir: Some(args.vmm_uid_dir).filter(|d| !d.as_os_str().is_empty()),
        image_cache: args.image_cache,
        image_max_bytes: args.image_max_bytes,
        image_cache_max_bytes: args.image_cache_max_bytes,
        files: HostFiles {
            kernel,
            modules,
            guest,
            firecracker: args.firecracker,
            allow_unjailed_firecracker: args.allow_unjailed_firecracker,
        },
        kernel_args: args.kernel_args,
        default_runtime: match args.runtime {
            RuntimeChoice::Auto => DefaultRuntime::Auto,
            RuntimeChoice::Qemu => DefaultRuntime::Fixed(VmRuntime::Qemu),
            RuntimeChoice::Firecracker => DefaultRuntime::Fixed(VmRuntime::Firecracker),
        },
        cgroup_parent: Some(args.cgroup_parent).filter(|p| !p.is_empty()),
        metrics_addr: args.metrics_addr,
        metrics_open: args.metrics_open,
        api_addr: args.api_addr,
        api_advertise: args.api_advertise,
        tls: args.tls_cert.zip(args.tls_key),
        sessions: SessionLimits {
            per_vm: args.api_max_sessions_per_vm,
            per_caller: args.api_max_sessions_per_caller,
        },
        migration_bandwidth: Some(args.migration_bandwidth).filter(|b| *b > 0),
        gateway_configmap: args.gateway_configmap,
        boot_timeout: args.boot_timeout,
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
        serial_log_max_bytes: args.serial_log_max_bytes,
        network: (!args.no_network).then_some(NetworkConfig {
            vxlan_port: args.vxlan_port,
            nft: args.nft,
            egress_deny: args.egress_deny,
        }),
        guest_metrics_interval: args.guest_metrics_interval,
        guest_metrics_timeout: args.guest_metrics_timeout,
        lease_namespace: args.lease_namespace,
        fence_after: args.fence_after,
    })
}
