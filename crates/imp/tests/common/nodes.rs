//! Namespaces as nodes for the end-to-end tests that need networking: a hub namespace with
//! the underlay bridge, node namespaces joined to it by veth, an "outside" namespace behind
//! node a's default route, and a real `imp agent` per node (in a cgroup of its own, so it can
//! be killed as a container is). All traffic stays inside namespaces the test made (and one
//! veth from the host into the hub, where the test API server listens).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use imp_testenv::registry::scratch_dir;
use tokio::process::Command;

/// The port of every agent's API inside its node namespace.
pub const AGENT_API_PORT: u16 = 10251;

/// A real control plane whose API server listens on the underlay (so node namespaces reach
/// it), with imp's CRDs and RBAC, and Ready nodes `node-a` and `node-b`.
pub async fn cluster(topo: &Topology) -> super::Cluster {
    let opts = imp_testenv::Options {
        host: topo.underlay(254).into(),
        ..Default::default()
    };
    let c = super::cluster_with(opts, &["default", "imp-system"]).await;
    super::ready_node(&c.client, "node-a").await;
    super::ready_node(&c.client, "node-b").await;
    c
}

/// Whether `ip` and `nft` are here (on top of what a guest boot needs).
pub fn ready() -> Option<()> {
    super::guest_boot_ready()?;
    super::control_plane_ready()?;
    let ip = imp_testenv::guard::which("ip").is_some();
    let nft = imp_testenv::guard::which("nft").is_some();
    (imp_testenv::guard::require(ip, "ip (apt-get install iproute2)")
        && imp_testenv::guard::require(nft, "nft (apt-get install nftables)"))
    .then_some(())
}

/// Runs a command that must succeed.
pub fn run(args: &[&str]) -> Output {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `imp exec -n NS VM -- sh -c SCRIPT` with `kubeconfig`, through the API server and the VM's
/// node's agent (every script the tests run ends within seconds: two minutes means a hang);
/// its stdout, which must succeed.
pub async fn exec_ok(kubeconfig: &Path, ns: &str, vm: &str, script: &str) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp"));
    cmd.args(["exec", "-n", ns, vm, "--", "sh", "-c", script])
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null());
    let out = super::output_within(
        cmd,
        Duration::from_secs(120),
        &format!("imp exec {vm} -- {script}"),
    )
    .await;
    assert!(
        out.status.success(),
        "imp exec {vm} -- {script}: {}",
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// stdout and stderr of `o`, as text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The test's namespaces and addresses: a hub namespace with the underlay bridge, node
/// namespaces `a` and `b` on it, `out` behind node a's default route, and one veth from the
/// host into the hub where the API server listens.
pub struct Topology {
    pub tag: String,
    pub octet: u8,
    host_veth: String,
}

impl Topology {
    /// Makes the hub, nodes `a` and `b`, and `out` behind node a's default route.
    pub fn create() -> Self {
        let pid = std::process::id();
        let t = Topology {
            tag: format!("impn{}", pid % 100_000),
            octet: u8::try_from(pid % 200 + 20).unwrap(),
            host_veth: format!("impn{}h", pid % 100_000),
        };
        let (hub, a, b, out) = (t.ns("hub"), t.ns("a"), t.ns("b"), t.ns("out"));
        for ns in [&hub, &a, &b, &out] {
            run(&["ip", "netns", "add", ns]);
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        run(&["ip", "-n", &hub, "link", "add", "ul", "type", "bridge"]);
        run(&["ip", "-n", &hub, "link", "set", "ul", "up"]);
        run(&[
            "ip",
            "link",
            "add",
            &t.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            "host",
            "netns",
            &hub,
        ]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", t.underlay(254)),
            "dev",
            &t.host_veth,
        ]);
        run(&["ip", "link", "set", &t.host_veth, "up"]);
        run(&[
            "ip", "-n", &hub, "link", "set", "host", "master", "ul", "up",
        ]);
        for (node, host) in [(&a, 1), (&b, 2)] {
            let port = format!("n{host}");
            run(&[
                "ip", "-n", node, "link", "add", "eth0", "type", "veth", "peer", "name", &port,
                "netns", &hub,
            ]);
            run(&[
                "ip",
                "-n",
                node,
                "addr",
                "add",
                &format!("{}/24", t.underlay(host)),
                "dev",
                "eth0",
            ]);
            run(&["ip", "-n", node, "link", "set", "eth0", "up"]);
            run(&["ip", "-n", &hub, "link", "set", &port, "master", "ul", "up"]);
        }
        run(&[
            "ip", "-n", &a, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns",
            &out,
        ]);
        run(&[
            "ip",
            "-n",
            &a,
            "addr",
            "add",
            &format!("{}/24", t.outside(1)),
            "dev",
            "up0",
        ]);
        run(&["ip", "-n", &a, "link", "set", "up0", "up"]);
        run(&[
            "ip",
            "-n",
            &out,
            "addr",
            "add",
            &format!("{}/24", t.outside(2)),
            "dev",
            "eth0",
        ]);
        run(&["ip", "-n", &out, "link", "set", "eth0", "up"]);
        run(&[
            "ip",
            "-n",
            &a,
            "route",
            "add",
            "default",
            "via",
            &t.outside(2).to_string(),
        ]);
        t
    }

    pub fn ns(&self, what: &str) -> String {
        format!("{}-{what}", self.tag)
    }

    /// An address of the underlay (`.1` node a, `.2` node b, `.254` the host).
    pub fn underlay(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.octet, host)
    }

    /// An address of the outside link (`.1` node a, `.2` the outside server).
    pub fn outside(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.octet, host)
    }

    pub fn subnet(&self, second: u8) -> String {
        format!("10.{second}.{}.0/24", self.octet)
    }

    /// Runs `args` in namespace `node`.
    pub fn exec(&self, node: &str, args: &[&str]) -> Output {
        let ns = self.ns(node);
        let mut all = vec!["ip", "netns", "exec", ns.as_str()];
        all.extend_from_slice(args);
        std::process::Command::new(all[0])
            .args(&all[1..])
            .output()
            .unwrap()
    }

    /// imp's interfaces in namespace `node`.
    pub fn imp_links(&self, node: &str) -> Vec<String> {
        text(&self.exec(node, &["ip", "-o", "link", "show"]))
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_owned())
            .filter(|n| n.starts_with("imp"))
            .collect()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for what in ["a", "b", "out", "hub"] {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.ns(what)])
                .output();
        }
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host_veth])
            .output();
    }
}

/// One `imp agent` inside a node namespace, its VMs in a cgroup parent of their own; the
/// agent itself in a cgroup of its own too, so it can be killed as a container is.
pub struct Agent {
    pub node: String,
    netns: String,
    vtep: Ipv4Addr,
    pub state: PathBuf,
    cgroup_parent: String,
    container: super::Container,
    /// More arguments for the next start.
    pub extra_args: Vec<String>,
    /// More environment for the next start (`PATH` with another QEMU first).
    pub env: Vec<(String, String)>,
}

impl Agent {
    pub fn new(topo: &Topology, node: &str, vtep: Ipv4Addr) -> Self {
        Agent {
            node: format!("node-{node}"),
            netns: topo.ns(node),
            vtep,
            state: scratch_dir(&format!("imp-{}-{node}", topo.tag)).unwrap(),
            cgroup_parent: format!("{}-{node}-vms", topo.tag),
            container: super::Container::new(&format!("{}-{node}-agent", topo.tag)),
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }

    pub fn start(&mut self, kubeconfig: &Path, cache: &Path) {
        // nsenter switches the network namespace only; `ip netns exec` would also remount
        // /sys, hiding the cgroup hierarchies the agent puts VMs in.
        let child = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", self.netns))
            .args([env!("CARGO_BIN_EXE_imp"), "agent"])
            .env("NODE_NAME", &self.node)
            .env("NODE_IP", self.vtep.to_string())
            .env("FC_KERNEL", super::kernel())
            .env("IMP_GUEST", super::guest())
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", super::rust_log())
            .args(["--state-dir", self.state.to_str().unwrap()])
            .args(["--runtime", "qemu", "--cgroup-parent", &self.cgroup_parent])
            // On every address of the node: /metrics answers the node itself, and others only
            // with a token allowed to get /metrics (network_e2e::assert_metrics_guarded).
            .args(["--metrics-addr", "0.0.0.0:9090"])
            .args(["--api-addr", &format!("0.0.0.0:{AGENT_API_PORT}")])
            .args(["--stop-grace", "2s"])
            .arg("--image-cache")
            .arg(cache)
            .args(&self.extra_args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(super::logs())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.container.run(child);
    }

    /// SIGKILL, as a crashed container; its VMs live on under their shims.
    pub async fn kill(&mut self) {
        self.container.kill().await;
    }

    /// Whether this agent's record of VM `uid` says its vCPUs are paused (a warm pool's member
    /// waiting for a claim).
    pub fn paused(&self, uid: &str) -> bool {
        let record = std::fs::read(self.state.join("vms").join(uid).join("vm.json"));
        serde_json::from_slice::<serde_json::Value>(&record.unwrap_or_default())
            .is_ok_and(|r| r["paused"] == serde_json::Value::Bool(true))
    }

    /// Restarts the agent to die by SIGKILL at fault point `point` (`imp_telemetry::fault`).
    pub async fn restart_dying_at(&mut self, point: &str, kubeconfig: &Path, cache: &Path) {
        self.kill().await;
        self.env
            .push((imp_telemetry::fault::ENV.into(), point.into()));
        self.start(kubeconfig, cache);
        self.env.retain(|(k, _)| k != imp_telemetry::fault::ENV);
    }

    /// Waits until the agent has died by SIGKILL (at its fault point `point`).
    pub async fn died(&mut self, point: &str) {
        use std::os::unix::process::ExitStatusExt as _;
        let status = self.container.exited(Duration::from_secs(120)).await;
        assert_eq!(status.signal(), Some(9), "agent at {point}: {status}");
    }

    /// Kills every process in the agent's cgroup, as a container runtime does on restart.
    pub async fn kill_container(&mut self) {
        self.container.kill_all().await;
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.container.destroy();
        super::remove_agent_leftovers(&self.state, &self.cgroup_parent);
    }
}
