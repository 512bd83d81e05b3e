//! A Node made of the real parts, where Pods run for real: Debian's containerd and runc, and the
//! kubelet and kube-proxy of the control plane's release (`scripts/kube/build`), in a network
//! namespace of the test's own. A veth joins it to the host, where the API server listens
//! ([`NodeNet::host`]); Pods get addresses in [`NodeNet::pod_cidr`] on a CNI bridge inside the
//! namespace, and the host routes that range to the node, so the API server reaches webhooks,
//! aggregated APIs and the kubelet. Nothing leaves the namespaces the test made.
//!
//! What this machine needs, found by running it (docs/testing.md, "A node with a kubelet"):
//! - cgroups v1: the kubelet runs with `failCgroupV1: false`, the cgroupfs driver, and a
//!   cgroup root of its own made beforehand in every hierarchy.
//! - No `CAP_SYS_RESOURCE`, even as root: runc cannot lower a process's `oom_score_adj`
//!   (the sandbox's -998), so containerd clamps it (`restrict_oom_score_adj`).
//! - `nsenter --net`, not `ip netns exec`: the latter mounts a fresh /sys, hiding the cgroup
//!   hierarchies from the kubelet.
//! - No registry can be reached: images come from OCI archives (`ctr images import`), the
//!   sandbox's `pause` too ([`pause_image`]).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

use crate::controlplane::{ControlPlane, Error, bin_dir, pin, still_running};
use crate::process::{self, Proc};
use crate::registry::{TestImage, TestLayer, write_archive};

/// How long the node's components may take to come up.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// Where Debian's CNI plugins live.
const CNI_BIN: &str = "/usr/lib/cni";

/// The sandbox image's reference (what containerd's CRI runs every Pod's sandbox from), on
/// every node: a Pod may run it too.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:imp-test";

/// The host-wide kernel settings the kubelet sets at its start (`vm.overcommit_memory=1`,
/// `kernel.panic=10`, `kernel.panic_on_oops=1` …, none of them per network namespace): saved
/// before it starts and written back when the node is dropped, so the tests that run after
/// it find the machine as it was.
const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Where the kubelet links every container's log, whatever its configuration says.
const CONTAINER_LOG_LINKS: &str = "/var/log/containers";

/// The tools a node needs from the machine, with the Debian package that has each.
const TOOLS: &[(&str, &str)] = &[
    ("containerd", "containerd"),
    ("ctr", "containerd"),
    ("runc", "runc"),
    ("nsenter", "util-linux"),
    ("ip", "iproute2"),
    ("nft", "nftables"),
];

/// What is missing for a node on this machine (tools, CNI plugins, binaries), as one message
/// per item; empty when a node can start.
pub fn missing() -> Vec<String> {
    let mut out: Vec<String> = TOOLS
        .iter()
        .filter(|(tool, _)| crate::guard::which(tool).is_none())
        .map(|(tool, pkg)| format!("{tool} (apt-get install {pkg})"))
        .collect();
    for plugin in ["bridge", "host-local", "loopback"] {
        if !Path::new(CNI_BIN).join(plugin).is_file() {
            out.push(format!(
                "{CNI_BIN}/{plugin} (apt-get install containernetworking-plugins)"
            ));
        }
    }
    for (tool, name) in [
        ("kubelet", "kubelet"),
        ("kubelet", "kube-proxy"),
        ("pause", "pause"),
    ] {
        match pin("KUBERNETES") {
            Ok(v) if bin_dir(tool, v).join(name).is_file() => {}
            _ => out.push(format!("{name} (scripts/kube/build)")),
        }
    }
    out
}

fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}

/// Runs `cmd`; fails with its stderr unless it succeeds.
fn run(cmd: &mut Command) -> Result<String, Error> {
    let what = format!("{cmd:?}");
    let out = cmd.output().map_err(io("running", &what))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Err(Error::Io {
        op: "running",
        path: what.into(),
        source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
    })
}

/// `ip ARGS…`, which must succeed.
fn ip(args: &[&str]) -> Result<String, Error> {
    run(Command::new("ip").args(args))
}

/// The node's network: namespace `netns`, a veth from the host (`host`) to the node (`node`,
/// its InternalIP), and the Pods' range routed from the host to the node. Removed when
/// dropped.
#[derive(Debug)]
pub struct NodeNet {
    /// The network namespace.
    pub netns: String,
    /// The host's end of the veth: where the API server must listen.
    pub host: Ipv4Addr,
    /// The node's address.
    pub node: Ipv4Addr,
    /// The Pods' addresses (a /24 on the node's CNI bridge).
    pub pod_cidr: String,
    host_veth: String,
}

impl NodeNet {
    /// Makes the namespace, the veth and the route, named and numbered after this process
    /// and `n` (one per node of a test).
    pub fn create(n: u8) -> Result<NodeNet, Error> {
        let pid = std::process::id();
        let octet = u8::try_from(pid % 200 + 20).unwrap_or(20);
        let net = NodeNet {
            netns: format!("imppod{}-{n}", pid % 100_000),
            host: Ipv4Addr::new(10, 218, octet, 4 * n + 1),
            node: Ipv4Addr::new(10, 218, octet, 4 * n + 2),
            pod_cidr: format!("10.{}.{octet}.0/24", 219 + n),
            host_veth: format!("imppod{}h{n}", pid % 100_000),
        };
        // Whatever an earlier process with this pid left.
        net.remove();
        ip(&["netns", "add", &net.netns])?;
        ip(&["-n", &net.netns, "link", "set", "lo", "up"])?;
        ip(&[
            "link",
            "add",
            &net.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &net.netns,
        ])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/30", net.host),
            "dev",
            &net.host_veth,
        ])?;
        ip(&["link", "set", &net.host_veth, "up"])?;
        let node = format!("{}/30", net.node);
        ip(&["-n", &net.netns, "addr", "add", &node, "dev", "eth0"])?;
        ip(&["-n", &net.netns, "link", "set", "eth0", "up"])?;
        let host = net.host.to_string();
        ip(&["-n", &net.netns, "route", "add", "default", "via", &host])?;
        let node = net.node.to_string();
        ip(&["route", "add", &net.pod_cidr, "via", &node])?;
        Ok(net)
    }

    /// `/var/run/netns/<netns>`, what `nsenter --net=` takes.
    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.netns)
    }

    fn remove(&self) {
        let _ = ip(&["route", "del", &self.pod_cidr]);
        let _ = ip(&["link", "del", &self.host_veth]);
        let _ = ip(&["netns", "del", &self.netns]);
    }
}

impl Drop for NodeNet {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The sandbox image: `pause` (built by `scripts/kube/build` from the release's own sources)
/// alone, written as an OCI archive into `dir`.
pub fn pause_image(dir: &Path) -> Result<PathBuf, Error> {
    let v = pin("KUBERNETES")?;
    let bin = bin_dir("pause", v).join("pause");
    let data = std::fs::read(&bin).map_err(|_| Error::Missing { path: bin.clone() })?;
    let image = TestImage::new()
        .layer(TestLayer::new().file("pause", data, 0o755))
        .entrypoint(&["/pause"]);
    let layout = dir.join("pause-layout");
    let archive = dir.join("pause.oci.tar");
    let failed = |e: crate::registry::RegistryError| Error::Io {
        op: "writing the pause image into",
        path: dir.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    };
    image.write_layout(&layout, PAUSE_IMAGE).map_err(failed)?;
    write_archive(&layout, &archive).map_err(failed)?;
    Ok(archive)
}

/// A running node: containerd, the kubelet (registered as [`PodNode::name`]) and kube-proxy.
/// Dropping it stops them, every container and Pod network, and removes what they left.
#[derive(Debug)]
pub struct PodNode {
    /// The Node's name.
    pub name: String,
    dir: PathBuf,
    cgroup: String,
    sysctls: Vec<(PathBuf, String)>,
    // Dropped before `net`, in this order, by `Drop`.
    proxy: Option<Proc>,
    kubelet: Option<Proc>,
    containerd: Option<Proc>,
    net: NodeNet,
}

impl PodNode {
    /// Starts a node named `name` with `labels` on `net`, joined to `cp` (started with
    /// [`crate::Options::kubelets`] on `net.host`), and waits until it is Ready. The node's
    /// files live under `dir` (made here; removed on drop).
    pub async fn start(
        cp: &ControlPlane,
        net: NodeNet,
        name: &str,
        labels: &[(&str, &str)],
        dir: PathBuf,
    ) -> Result<PodNode, Error> {
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        let mut node = PodNode {
            name: name.to_owned(),
            cgroup: format!("imp-testenv-{}-{name}", std::process::id()),
            sysctls: read_sysctls(),
            dir,
            proxy: None,
            kubelet: None,
            containerd: None,
            net,
        };
        node.make_cgroups()?;
        node.containerd = Some(node.start_containerd().await?);
        let pause = pause_image(&node.dir)?;
        node.import(&pause)?;
        node.kubelet = Some(node.start_kubelet(cp, labels)?);
        node.proxy = Some(node.start_proxy(cp)?);
        node.wait_ready(cp).await?;
        Ok(node)
    }

    /// Imports the OCI archive `archive` into containerd's `k8s.io` namespace, where the
    /// kubelet finds images (a Pod with `imagePullPolicy: IfNotPresent` then pulls nothing).
    pub fn import(&self, archive: &Path) -> Result<(), Error> {
        run(Command::new("ctr")
            .arg("--address")
            .arg(self.socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive))
        .map(|_| ())
    }

    /// Names the image `from` also `to` in containerd's `k8s.io` namespace (`ctr images tag
    /// --force`): an image imported before another one with the same name keeps a name.
    pub fn tag(&self, from: &str, to: &str) -> Result<(), Error> {
        run(Command::new("ctr")
            .arg("--address")
            .arg(self.socket())
            .args(["-n", "k8s.io", "images", "tag", "--force", from, to]))
        .map(|_| ())
    }

    /// The last `lines` lines of each component's log, for a failing test's message.
    pub fn logs(&self, lines: usize) -> String {
        [&self.containerd, &self.kubelet, &self.proxy]
            .into_iter()
            .flatten()
            .map(|p| format!("--- {}:\n{}", p.name, p.log_tail(lines)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The cgroup hierarchies mounted under /sys/fs/cgroup: the v1 ones, and also the v2 one
    /// (hybrid mode's `unified`, where the kubelet makes its tree too) unless `v1_only`.
    fn hierarchies(v1_only: bool) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") else {
            return Vec::new();
        };
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("cgroup.procs").is_file())
            .filter(|p| !v1_only || !p.join("cgroup.controllers").exists())
            .collect()
    }

    /// The kubelet's cgroup root in every hierarchy (the kubelet refuses to start without
    /// it), cpuset's with the root's CPUs and memory nodes (an empty cpuset admits no task).
    fn make_cgroups(&self) -> Result<(), Error> {
        for h in Self::hierarchies(true) {
            let dir = h.join(&self.cgroup);
            std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = std::fs::read_to_string(h.join(file)) {
                    std::fs::write(dir.join(file), v).map_err(io("writing", dir.join(file)))?;
                }
            }
        }
        Ok(())
    }

    /// A command that runs `program` in the node's network namespace (only that one: the
    /// mount namespace stays the host's), as a process on the node's host network would.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.net.path()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Starts `bin` with `args` inside the node's network namespace, logging to `log` in the
    /// node's directory.
    fn spawn(&self, name: &'static str, bin: &Path, args: &[String]) -> Result<Proc, Error> {
        let mut cmd = self.command(bin);
        cmd.args(args);
        let log = self.dir.join(format!("{name}.log"));
        process::start(name, cmd, &log).map_err(io("starting", bin))
    }

    async fn start_containerd(&self) -> Result<Proc, Error> {
        let cni = self.dir.join("cni");
        std::fs::create_dir_all(&cni).map_err(io("creating", &cni))?;
        let conf = cni.join("10-pods.conflist");
        let ipam = self.dir.join("ipam");
        std::fs::write(&conf, cni_config(&self.net.pod_cidr, &ipam))
            .map_err(io("writing", &conf))?;
        let config = self.dir.join("containerd.toml");
        let text = containerd_config(&self.dir, &self.socket(), &cni);
        std::fs::write(&config, text).map_err(io("writing", &config))?;
        let args = vec!["--config".to_owned(), config.display().to_string()];
        let mut p = self.spawn("containerd", Path::new("containerd"), &args)?;
        let t0 = Instant::now();
        loop {
            let mut version = Command::new("ctr");
            version.arg("--address").arg(self.socket()).arg("version");
            if self.socket().exists() && run(&mut version).is_ok() {
                return Ok(p);
            }
            wait_or_fail(&mut p, t0).await?;
        }
    }

    fn start_kubelet(&self, cp: &ControlPlane, labels: &[(&str, &str)]) -> Result<Proc, Error> {
        let config = self.dir.join("kubelet.yaml");
        let text = kubelet_config(&self.cgroup, &self.socket(), self.net.node, &self.dir);
        std::fs::write(&config, text).map_err(io("writing", &config))?;
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let d = |sub: &str| self.dir.join(sub).display().to_string();
        let args = vec![
            format!("--config={}", config.display()),
            format!("--kubeconfig={}", cp.admin_kubeconfig().display()),
            format!("--root-dir={}", d("kubelet")),
            format!("--cert-dir={}", d("kubelet-pki")),
            format!("--hostname-override={}", self.name),
            format!("--node-ip={}", self.net.node),
            format!("--node-labels={}", labels.join(",")),
            "--v=1".to_owned(),
        ];
        let bin = bin_dir("kubelet", pin("KUBERNETES")?).join("kubelet");
        self.spawn("kubelet", &bin, &args)
    }

    fn start_proxy(&self, cp: &ControlPlane) -> Result<Proc, Error> {
        let args = vec![
            format!("--kubeconfig={}", cp.admin_kubeconfig().display()),
            format!("--hostname-override={}", self.name),
            "--proxy-mode=nftables".to_owned(),
            format!("--cluster-cidr={}", self.net.pod_cidr),
            // Leaves the machine's conntrack table size alone.
            "--conntrack-max-per-core=0".to_owned(),
            "--healthz-bind-address=127.0.0.1:10256".to_owned(),
            "--metrics-bind-address=127.0.0.1:10249".to_owned(),
        ];
        let bin = bin_dir("kubelet", pin("KUBERNETES")?).join("kube-proxy");
        self.spawn("kube-proxy", &bin, &args)
    }

    /// Waits until the Node reports Ready (the kubelet registered it, the runtime and the
    /// Pod network are up).
    async fn wait_ready(&mut self, cp: &ControlPlane) -> Result<(), Error> {
        let nodes: Api<Node> = Api::all(cp.admin().await?);
        let t0 = Instant::now();
        loop {
            if let Ok(Some(n)) = nodes.get_opt(&self.name).await
                && node_ready(&n)
            {
                return Ok(());
            }
            for p in [&mut self.containerd, &mut self.proxy]
                .into_iter()
                .flatten()
            {
                still_running(p)?;
            }
            if let Some(p) = self.kubelet.as_mut() {
                wait_or_fail(p, t0).await?;
            }
        }
    }

    /// Stops every container and sandbox (their processes are in the kubelet's cgroups),
    /// then containerd's shims, and removes the mounts and cgroups they leave.
    fn teardown(&mut self) {
        self.proxy.take();
        self.kubelet.take();
        restore_sysctls(&self.sysctls);
        for h in Self::hierarchies(false) {
            kill_tree(&h.join(&self.cgroup));
        }
        self.containerd.take();
        let sock = self.socket().display().to_string();
        for pid in crate::procfs::processes_naming(&sock).unwrap_or_default() {
            // SAFETY: kill(2) on a pid whose command line names this node's socket: one of
            // its shims.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
        unmount_below(&self.dir);
        for h in Self::hierarchies(false) {
            remove_tree(&h.join(&self.cgroup));
        }
        remove_links_into(Path::new(CONTAINER_LOG_LINKS), &self.dir);
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("imp-testenv: removing {}: {e}", self.dir.display());
        }
    }
}

impl Drop for PodNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("imp-testenv: node {}'s logs:\n{}", self.name, self.logs(30));
        }
        self.teardown();
    }
}

/// The values of [`KUBELET_SYSCTLS`] (those that can be read).
fn read_sysctls() -> Vec<(PathBuf, String)> {
    KUBELET_SYSCTLS
        .iter()
        .map(|k| Path::new("/proc/sys").join(k))
        .filter_map(|p| Some((p.clone(), std::fs::read_to_string(&p).ok()?)))
        .collect()
}

/// Writes back what [`read_sysctls`] read.
fn restore_sysctls(saved: &[(PathBuf, String)]) {
    for (path, value) in saved {
        if let Err(e) = std::fs::write(path, value) {
            eprintln!("imp-testenv: restoring {}: {e}", path.display());
        }
    }
}

/// Removes the symbolic links in `dir` that point into `into`.
fn remove_links_into(dir: &Path, into: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with(into)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether Node `n` has condition Ready True.
fn node_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Fails if `p` has exited or `t0` is older than [`READY_WITHIN`]; else waits a moment.
async fn wait_or_fail(p: &mut Proc, t0: Instant) -> Result<(), Error> {
    still_running(p)?;
    if t0.elapsed() > READY_WITHIN {
        return Err(Error::NotReady {
            what: p.name,
            secs: READY_WITHIN.as_secs(),
            log: p.log_tail(40),
        });
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(())
}

/// SIGKILLs every process in cgroup `dir` and below, until none is left.
fn kill_tree(dir: &Path) {
    for _ in 0..50 {
        let pids = procs_below(dir);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            // SAFETY: kill(2) on a pid listed in one of the node's own cgroups.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pids in cgroup `dir` and every cgroup below it.
fn procs_below(dir: &Path) -> Vec<libc::pid_t> {
    let mut out: Vec<libc::pid_t> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.path().is_dir() {
                out.extend(procs_below(&e.path()));
            }
        }
    }
    out
}

/// Removes cgroup `dir` and every cgroup below it (deepest first; a cgroup is removed with
/// rmdir, its files go with it), saying which one it could not.
fn remove_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            remove_tree(&e.path());
        }
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        eprintln!("imp-testenv: removing cgroup {}: {e}", dir.display());
    }
}

/// Detaches every mount at or below `dir` (the runtime's overlays and network namespaces,
/// the kubelet's volumes), deepest first.
fn unmount_below(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = nix_umount(&p);
    }
}

/// A mount point as mountinfo writes it: space, tab, newline and backslash as octal escapes.
fn unescape_mount_point(s: &str) -> PathBuf {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(c) => {
                out.push(char::from(c));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    PathBuf::from(out)
}

/// umount2(`p`, MNT_DETACH).
fn nix_umount(p: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: umount2(2) with a NUL-terminated path that lives across the call.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// containerd's configuration: everything under `dir`, the CRI's sandbox image
/// [`PAUSE_IMAGE`], CNI from Debian's plugins with the configuration in `cni`.
fn containerd_config(dir: &Path, socket: &Path, cni: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: no oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  # Pod network namespaces under the state directory, not /var/run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni}"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    # runc's state under the node's directory, not the machine's /run/containerd/runc.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      Root = "{d}/runc"
"#,
        socket = socket.display(),
        cni = cni.display(),
    )
}

/// The Pod network: a bridge in the node's namespace, addresses from `pod_cidr` (leases kept
/// in `ipam`), the node as every Pod's gateway.
fn cni_config(pod_cidr: &str, ipam: &Path) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "imp-test-pods",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
             "ipam": {"type": "host-local", "dataDir": ipam.display().to_string(),
                      "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "loopback"}
        ]
    })
    .to_string()
}

/// The kubelet's configuration. The API server reaches it on the node's address (anonymous
/// and allowed: nothing but the host reaches that address); logs and Pod files stay under
/// `dir`; cgroups v1 are accepted; image garbage collection is off (the images were imported,
/// nothing could pull them again).
fn kubelet_config(cgroup: &str, socket: &Path, node: Ipv4Addr, dir: &Path) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
containerRuntimeEndpoint: unix://{socket}
failSwapOn: false
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
address: {node}
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
podLogsDir: {logs}
resolvConf: /etc/resolv.conf
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
localStorageCapacityIsolation: false
"#,
        socket = socket.display(),
        logs = dir.join("pod-logs").display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_unescaped_as_mountinfo_escapes_them() {
        assert_eq!(
            unescape_mount_point(r"/tmp/a\040b\011c\134d"),
            PathBuf::from("/tmp/a b\tc\\d")
        );
        assert_eq!(unescape_mount_point(r"/x\0"), PathBuf::from(r"/x\0"));
    }

    #[test]
    fn the_kubelet_accepts_cgroups_v1_and_keeps_its_files_in_the_node_directory() {
        let c = kubelet_config(
            "imp-testenv-1-n",
            Path::new("/d/containerd.sock"),
            Ipv4Addr::new(10, 1, 2, 3),
            Path::new("/d"),
        );
        assert!(c.contains("failCgroupV1: false"), "{c}");
        assert!(c.contains("cgroupRoot: /imp-testenv-1-n"), "{c}");
        assert!(c.contains("unix:///d/containerd.sock"), "{c}");
        assert!(c.contains("podLogsDir: /d/pod-logs"), "{c}");
        assert!(c.contains("address: 10.1.2.3"), "{c}");
    }

    #[test]
    fn containerd_clamps_oom_scores_and_uses_the_test_cni_directory() {
        let c = containerd_config(Path::new("/d"), Path::new("/d/s"), Path::new("/d/cni"));
        assert!(c.contains("restrict_oom_score_adj = true"), "{c}");
        assert!(c.contains(r#"conf_dir = "/d/cni""#), "{c}");
        assert!(
            c.contains(&format!(r#"sandbox_image = "{PAUSE_IMAGE}""#)),
            "{c}"
        );
    }
}
