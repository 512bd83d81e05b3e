//! What the `imp` binary's end-to-end tests and benchmarks share: where the build tree is,
//! the check that a real guest can boot here, polling with a deadline, free ports, and a real
//! control plane with imp's CRDs, RBAC and users.
#![allow(dead_code)] // each test binary uses its own part of this module

pub mod agent;
pub mod nodes;
pub mod plugin;
pub mod pods;
pub mod snapshots;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kube::api::{Api, PostParams};

pub use imp_testenv::workspace_root;

/// The guest kernel `scripts/setup` fetched.
pub fn kernel() -> PathBuf {
    workspace_root().join("target/guest-kernel/vmlinux")
}

/// The static guest init `scripts/build-guest.sh` built.
pub fn guest() -> PathBuf {
    workspace_root().join("target/imp-guest/imp-guest")
}

/// Everything a real guest boot from a local registry needs, or `None` when the caller must
/// skip (the guard has said why; under CI=true it fails instead).
pub fn guest_boot_ready() -> Option<()> {
    let checks = [
        (imp_testenv::guard::is_root(), "root"),
        (
            imp_testenv::guard::which("qemu-system-x86_64").is_some(),
            "qemu-system-x86_64 (scripts/setup)",
        ),
        (
            imp_testenv::guard::which("docker-registry").is_some(),
            "docker-registry (apt-get install docker-registry)",
        ),
        (
            imp_testenv::guard::which("skopeo").is_some(),
            "skopeo (apt-get install skopeo)",
        ),
        (
            imp_testenv::guard::which("mkfs.ext4").is_some(),
            "mkfs.ext4 (apt-get install e2fsprogs)",
        ),
        (
            Path::new("/bin/busybox").is_file(),
            "static /bin/busybox (apt-get install busybox-static)",
        ),
        (
            kernel().is_file(),
            "target/guest-kernel/vmlinux (scripts/fetch-guest-kernel.sh)",
        ),
        (
            guest().is_file(),
            "target/imp-guest/imp-guest (scripts/build-guest.sh)",
        ),
    ];
    for (ok, what) in checks {
        if !imp_testenv::guard::require(ok, what) {
            return None;
        }
    }
    Some(())
}

/// Polls `f` until it returns Some, or panics after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `GET path` from the plain-HTTP server on loopback `port` (an ops server: `/metrics`,
/// `/healthz`, `/readyz`): the status code (0 if unreadable) and the whole response.
pub async fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, out))
}

/// A loopback port nothing listens on now, below the kernel's range of ephemeral ports, so no
/// outgoing connection takes it in the minutes between a test's cluster and its operator.
pub fn gateway_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000).max(1));
    let mut seed = std::process::id().wrapping_mul(2_654_435_761)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for _ in 0..200 {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let port = 10_000 + u16::try_from(seed % span).unwrap_or(0);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 10000 and {low}");
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// A real Kubernetes control plane of the test's own (etcd, kube-apiserver,
/// kube-controller-manager from `scripts/kube/build`) with imp's CRDs, the namespaces the
/// test names, and imp's RBAC: the operator and the agents run with the tokens of their own
/// ServiceAccounts (`imp-system/imp-operator`, `imp-system/imp-agent`) and only the rules the
/// product ships (`charts/imp/files/rbac/`), so a missing permission fails the test. A test
/// takes one of its own because the operator watches every namespace and Nodes are
/// cluster-wide: two tests on one server would place each other's VMs.
pub struct Cluster {
    /// The control plane.
    pub cp: imp_testenv::ControlPlane,
    /// A client as the admin (`system:masters`), for the test's own reads and writes.
    pub client: kube::Client,
    /// Kubeconfigs of the operator's and the agents' ServiceAccounts.
    pub ids: imp_testenv::rbac::Identities,
    /// The port of the operator's HTTPS listener on 127.0.0.1, where the API server's
    /// aggregator reaches the gateway (APIService `v1alpha1.subresources.imp.dev`).
    pub gateway_port: u16,
}

impl Cluster {
    /// The kubeconfig the operator runs with.
    pub fn operator_kubeconfig(&self) -> &Path {
        &self.ids.operator
    }

    /// The agent ServiceAccount's kubeconfig with a token bound to no Pod: refused every write
    /// by the chart's policy (`charts/imp/files/policy/agent.yaml`); agents run with
    /// [`Cluster::agent_kubeconfig_for`].
    pub fn unbound_agent_kubeconfig(&self) -> &Path {
        &self.ids.agent
    }

    /// The kubeconfig the agent of `node` runs with: the token of a stand-in Pod
    /// `imp-system/imp-agent-<node>` on that node, as the DaemonSet's Pod has, so the API
    /// server admits its writes for that node only.
    pub async fn agent_kubeconfig_for(&self, node: &str) -> PathBuf {
        imp_testenv::rbac::agent_kubeconfig_for(&self.cp, "imp-system", node)
            .await
            .unwrap_or_else(|e| panic!("a node-bound agent token for {node}: {e}"))
    }

    /// The admin's kubeconfig.
    pub fn admin_kubeconfig(&self) -> &Path {
        self.cp.admin_kubeconfig()
    }
}

/// A QEMU ≥ 8.2 beside the system's (`IMP_TEST_QEMU_10`, else where
/// `scripts/fetch-qemu-10.sh` unpacks 10.0); `None` means skip (under `CI=true` the guard
/// fails the test instead).
pub fn qemu_10() -> Option<PathBuf> {
    let path = std::env::var_os("IMP_TEST_QEMU_10").map_or_else(
        || PathBuf::from("/usr/local/lib/imp-test/qemu-10/usr/bin/qemu-system-x86_64"),
        PathBuf::from,
    );
    imp_testenv::guard::require(
        path.is_file(),
        &format!(
            "QEMU ≥ 8.2 at {} (scripts/fetch-qemu-10.sh, as root)",
            path.display()
        ),
    )
    .then_some(path)
}

/// `PATH` with the directory of `qemu` first: an agent started with it runs that QEMU.
pub fn path_with(qemu: &Path) -> String {
    let dir = qemu.parent().expect("a QEMU binary sits in a directory");
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// Whether the test control plane is built; `None` means skip (under `CI=true` the guard
/// fails the test instead).
pub fn control_plane_ready() -> Option<()> {
    imp_testenv::controlplane::available(imp_testenv::Release::Newest).then_some(())
}

/// [`Cluster`] with default options (the API server on 127.0.0.1).
pub async fn cluster(namespaces: &[&str]) -> Cluster {
    cluster_with(imp_testenv::Options::default(), namespaces).await
}

/// [`Cluster`] with `opts` (e.g. the API server on an address network namespaces reach).
pub async fn cluster_with(mut opts: imp_testenv::Options, namespaces: &[&str]) -> Cluster {
    // Before the controller-manager starts: its garbage collector then honours owner
    // references to ImpVMs, and its quota controller counts them, from the first moment.
    opts.crds = imp_api::crd::all();
    let cp = imp_testenv::ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("starting the test control plane: {e}"));
    let client = cp.admin().await.expect("an admin client");
    cp.install_crds(&client, &imp_api::crd::all())
        .await
        .unwrap_or_else(|e| panic!("installing imp's CRDs: {e}"));
    for ns in namespaces {
        cp.ensure_namespace(&client, ns)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let ids = imp_testenv::rbac::install(&cp, "imp-system")
        .await
        .unwrap_or_else(|e| panic!("installing imp's RBAC: {e}"));
    let gateway_port = gateway_port();
    Cluster {
        cp,
        client,
        ids,
        gateway_port,
    }
}

/// The people of the exec tests, as ServiceAccount token users in namespace `ns`: alice holds
/// `imp-edit` there (she may exec and open consoles), bob `imp-view` (he may read the VM but
/// the agent's SubjectAccessReview refuses him); both hold `imp-cli` (read Nodes and Events, as
/// `imp exec -n` does). Returns their kubeconfigs (alice, bob).
pub async fn exec_users(c: &Cluster, ns: &str) -> (PathBuf, PathBuf) {
    let alice = imp_testenv::rbac::user(&c.cp, ns, "alice", &["imp-view", "imp-edit"])
        .await
        .unwrap_or_else(|e| panic!("making user alice: {e}"));
    let bob = imp_testenv::rbac::user(&c.cp, ns, "bob", &["imp-view"])
        .await
        .unwrap_or_else(|e| panic!("making user bob: {e}"));
    (alice, bob)
}

/// Where a test's child processes log: inherited with `IMP_TEST_LOGS` set; else, while a
/// [`TestRun`] is on, appended to this test process's log file ([`log_file`]), whose tail a
/// failing or hung test prints; else nowhere.
pub fn logs() -> std::process::Stdio {
    if std::env::var_os("IMP_TEST_LOGS").is_some() {
        return std::process::Stdio::inherit();
    }
    if !LOGGING.load(std::sync::atomic::Ordering::SeqCst) {
        return std::process::Stdio::null();
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file())
        .map(std::process::Stdio::from)
        .unwrap_or_else(|_| std::process::Stdio::null())
}

/// The lines a child process wrote to its stderr, as `kubectl logs` shows a container's.
pub type LogLines = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// Reads `child`'s piped stderr into `lines` and passes each line on to where [`logs`] would
/// have sent it, so a test can look for a log line (a restarted child appends to the same
/// lines).
pub fn tee_stderr(child: &mut tokio::process::Child, lines: &LogLines) {
    use tokio::io::AsyncBufReadExt;
    let Some(stderr) = child.stderr.take() else {
        panic!("tee_stderr needs a child started with a piped stderr");
    };
    let kept = lines.clone();
    tokio::spawn(async move {
        let mut reader = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            log_line(&line);
            kept.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    });
}

/// Waits up to 60 s for a line of `lines` that contains every one of `needles` (as `grep`
/// would find it), and returns it.
pub async fn logged(lines: &LogLines, needles: &[&str]) -> String {
    wait_for(
        &format!("a log line with {needles:?}"),
        Duration::from_secs(60),
        || async {
            lines
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|l| needles.iter().all(|n| l.contains(n)))
                .cloned()
        },
    )
    .await
}

/// Writes one line of a child's log where [`logs`] sends children's output.
fn log_line(line: &str) {
    use std::io::Write;
    if std::env::var_os("IMP_TEST_LOGS").is_some() {
        to_stderr(&format!("{line}\n"));
    } else if LOGGING.load(std::sync::atomic::Ordering::SeqCst)
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_file())
    {
        let _ = writeln!(f, "{line}");
    }
}

/// The file the child processes of this test process log to (without `IMP_TEST_LOGS`).
pub fn log_file() -> PathBuf {
    std::env::temp_dir().join(format!("imp-test-{}.log", std::process::id()))
}

/// Whether a [`TestRun`] keeps the children's log.
static LOGGING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How many lines of the children's log a failing test prints.
const LOG_TAIL_LINES: usize = 200;

/// Writes `text` to the test process's real stderr: libtest captures `eprintln!` of test
/// threads (and of the threads they spawn), and a hung test's capture is never printed.
fn to_stderr(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Prints the last lines the test's children logged, so a failure in CI says what the agents
/// and the operator saw.
fn print_log_tail(why: &str) {
    let Ok(all) = std::fs::read(log_file()) else {
        return;
    };
    let all = String::from_utf8_lossy(&all);
    let lines: Vec<&str> = all.lines().collect();
    let from = lines.len().saturating_sub(LOG_TAIL_LINES);
    let mut out = format!(
        "---- {why}: the last {} lines the test's processes logged ({}) ----\n",
        lines.len() - from,
        log_file().display()
    );
    for l in &lines[from..] {
        out.push_str(&format!("| {l}\n"));
    }
    out.push_str("---- end of the log ----\n");
    to_stderr(&out);
}

/// One end-to-end test's run: if the test fails, the tail of its children's log is printed
/// (when this is dropped during the panic); if it runs past `limit`, a watchdog prints where
/// it is (the log tail and the test's process tree) and ends the test process, so a hang
/// fails in minutes instead of holding CI until its own timeout. Take it first, so it is
/// dropped last.
pub struct TestRun {
    name: &'static str,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Starts [`TestRun`] `name` with a hard limit of `limit`.
pub fn test_run(name: &'static str, limit: Duration) -> TestRun {
    LOGGING.store(true, std::sync::atomic::Ordering::SeqCst);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(500));
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
        }
        let why = format!("{name} is still running after {limit:?}: a hang");
        print_log_tail(&why);
        // The test's own session: its agents, shims and VMMs (not the rest of the machine).
        let session = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|st| st.rsplit_once(") ").map(|(_, r)| r.to_owned()))
            .and_then(|r| r.split_whitespace().nth(3).map(str::to_owned))
            .unwrap_or_else(|| "0".to_owned());
        let tree = std::process::Command::new("ps")
            .args(["--forest", "-s", &session])
            .args(["-o", "pid,stat,etimes,wchan:24,args"])
            .output();
        if let Ok(t) = tree {
            to_stderr(&format!(
                "---- processes ----\n{}",
                String::from_utf8_lossy(&t.stdout)
            ));
        }
        to_stderr(&format!("{why}; the test process ends now\n"));
        std::process::exit(101);
    });
    TestRun { name, done }
}

impl Drop for TestRun {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
        if std::thread::panicking() {
            print_log_tail(&format!("{} failed", self.name));
        }
        LOGGING.store(false, std::sync::atomic::Ordering::SeqCst);
        let _ = std::fs::remove_file(log_file());
    }
}

/// Runs `cmd` to its end, or panics after `limit` naming `what` (the child is killed).
pub async fn output_within(
    mut cmd: tokio::process::Command,
    limit: Duration,
    what: &str,
) -> std::process::Output {
    cmd.kill_on_drop(true);
    match tokio::time::timeout(limit, cmd.output()).await {
        Ok(out) => out.unwrap_or_else(|e| panic!("running {what}: {e}")),
        Err(_) => panic!("{what} did not end within {limit:?}"),
    }
}

/// `RUST_LOG` for a test's child processes (`IMP_TEST_RUST_LOG` overrides it).
pub fn rust_log() -> String {
    std::env::var("IMP_TEST_RUST_LOG").unwrap_or_else(|_| "info,kube=warn".into())
}

/// Removes what an agent of a test left: the cgroup of every VM in its state directory (killing
/// what still runs there), its VMs' parent cgroup, and the state directory itself.
pub fn remove_agent_leftovers(state: &Path, cgroup_parent: &str) {
    use imp_agent::runtime::cgroup::VmCgroup;
    for dir in std::fs::read_dir(state.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let uid = dir.file_name().to_string_lossy().into_owned();
        if let Ok(cg) = VmCgroup::at(&format!("{cgroup_parent}/{uid}")) {
            let _ = cg.destroy();
        }
    }
    if let Ok(cg) = VmCgroup::at(cgroup_parent) {
        let _ = cg.destroy();
    }
    let _ = std::fs::remove_dir_all(state);
}

/// A busybox image with `applets` linked and the directories a workload expects (`/tmp`,
/// `/mnt`, root's home), whose workload is `sh -c CMD`.
pub fn busybox_image(applets: &[&str], cmd: &str) -> imp_testenv::registry::TestImage {
    let mut layer = imp_testenv::registry::TestLayer::new()
        .dir("bin", 0o755)
        .file(
            "bin/busybox",
            std::fs::read("/bin/busybox").expect("reading /bin/busybox"),
            0o755,
        )
        .dir("etc", 0o755)
        .file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", 0o644)
        .file("etc/group", "root:x:0:\n", 0o644)
        .dir("tmp", 0o1777)
        .dir("mnt", 0o755)
        .dir("root", 0o700);
    for applet in applets {
        layer = layer.symlink(&format!("bin/{applet}"), "busybox");
    }
    imp_testenv::registry::TestImage::new()
        .layer(layer)
        .entrypoint(&["/bin/sh", "-c"])
        .cmd(&[cmd])
        .env("PATH=/bin")
}

/// The `kubernetes.io/arch` label kubelet gives a Node of this host (Go's name for the
/// architecture), which tests' Nodes carry as real ones do.
pub fn kubelet_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Creates a Ready Node `name` labelled `imp/enabled=true` and, as kubelet would,
/// `kubernetes.io/arch`, with room for every test VM.
pub async fn ready_node(c: &kube::Client, name: &str) {
    use k8s_openapi::api::core::v1::Node;
    let api: Api<Node> = Api::all(c.clone());
    let n: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": {
        "imp/enabled": "true",
        imp_api::shared::LABEL_NODE_ARCH: kubelet_arch(),
    }}}))
    .expect("a Node");
    api.create(&PostParams::default(), &n)
        .await
        .expect("creating a Node");
    imp_testenv::nodes::set_ready(c, name, "8", "16Gi", true)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Whether process `pid` exists and is not a zombie (a killed VMM its shim has not reaped yet
/// counts as gone).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

/// Pids of processes whose command line names `needle` (a VM's directory).
pub fn processes_naming(needle: &str) -> Vec<u32> {
    imp_testenv::procfs::processes_naming(needle).expect("reading /proc")
}

/// Asserts that VMM process `pid` runs confined as the product starts it: not root (and not
/// the uid of any other VM's VMM, one per VM from 200000000), no capability (bounding set
/// empty), `no_new_privs`, a seccomp filter, and a root of its own without the host's `/etc`.
/// Returns its uid.
pub fn assert_vmm_confined(pid: u32) -> u32 {
    let status = imp_testenv::procfs::Status::of(pid);
    let uids = status.uids();
    assert!(
        !uids.is_empty() && uids.iter().all(|&u| u == uids[0] && u >= 200_000_000),
        "VMM {pid} runs as {uids:?}"
    );
    assert_eq!(status.field("CapEff"), "0000000000000000", "VMM {pid}");
    assert_eq!(status.field("CapBnd"), "0000000000000000", "VMM {pid}");
    assert_eq!(status.field("NoNewPrivs"), "1", "VMM {pid}");
    assert_eq!(status.field("Seccomp"), "2", "VMM {pid}");
    let root = std::path::PathBuf::from(format!("/proc/{pid}/root"));
    assert!(root.join("usr/bin").is_dir(), "VMM {pid} has no /usr");
    assert!(
        !root.join("etc").exists() && !root.join("proc").exists() && !root.join("root").exists(),
        "VMM {pid} sees the host's root"
    );
    uids[0]
}

/// The QEMU processes of VM `uid` of the agent whose state directory is `state` (a confined
/// QEMU names no host path: it is told by its `-name`).
pub fn qemu_of(state: &Path, uid: &str) -> Vec<u32> {
    vm_processes(state, uid)
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .unwrap_or_default()
                .starts_with("qemu")
        })
        .collect()
}

/// Every process of VM `uid` of the state directory `state`: those whose command line names
/// its directory (its shim) and its QEMU (`-name UID`).
pub fn vm_processes(state: &Path, uid: &str) -> Vec<u32> {
    let dir = state.join("vms").join(uid);
    let mut pids = processes_naming(&dir.to_string_lossy());
    for p in processes_naming(&format!("\0-name\0{uid}\0")) {
        if !pids.contains(&p) {
            pids.push(p);
        }
    }
    pids
}

/// The real `imp operator` of cluster `c`, with its ServiceAccount's token, polling pending
/// and active VMs every 2 s and 1 s, serving the gateway (with a certificate it makes) where
/// the cluster's APIService expects it; its log with the test's; killed when dropped.
pub fn start_operator(c: &Cluster) -> tokio::process::Child {
    start_operator_with(c, &[])
}

/// [`start_operator`] with more flags (e.g. `--node-loss-grace`).
pub fn start_operator_with(c: &Cluster, extra: &[&str]) -> tokio::process::Child {
    // The APIService exists only while an operator serves it: an aggregated API nobody
    // serves would fail the controller-manager's discovery (namespace deletion, quotas).
    let (client, port) = (c.client.clone(), c.gateway_port);
    tokio::spawn(async move {
        if let Err(e) =
            imp_testenv::aggregation::register_gateway(&client, "imp-system", port).await
        {
            eprintln!("registering imp's gateway failed: {e}");
        }
    });
    tokio::process::Command::new(env!("CARGO_BIN_EXE_imp"))
        .arg("operator")
        .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
        .args(["--requeue-pending", "2", "--requeue-active", "1"])
        .args(["--webhook-addr", &format!("127.0.0.1:{}", c.gateway_port)])
        .args([
            "--webhook-secret",
            "imp-webhook-tls",
            "--namespace",
            "imp-system",
        ])
        // No admission webhook is registered in these tests: only the gateway is served.
        .arg("--webhook-configurations=")
        .args(extra)
        .env("KUBECONFIG", c.operator_kubeconfig())
        .env("RUST_LOG", rust_log())
        .stdout(std::process::Stdio::null())
        .stderr(logs())
        .kill_on_drop(true)
        .spawn()
        .expect("starting imp operator")
}

/// An ImpVM's phase.
pub fn phase(v: &imp_api::vm::ImpVM) -> Option<imp_api::vm::VmPhase> {
    v.status.as_ref().and_then(|s| s.phase)
}

/// Waits up to `secs` for ImpVM `name` to satisfy `pred` (`what` names it in the panic).
pub async fn wait_vm(
    api: &Api<imp_api::vm::ImpVM>,
    name: &str,
    what: &str,
    secs: u64,
    pred: impl Fn(&imp_api::vm::ImpVM) -> bool,
) -> imp_api::vm::ImpVM {
    let timeout = Duration::from_secs(secs);
    let start = Instant::now();
    loop {
        let last = api.get_opt(name).await.expect("reading an ImpVM");
        match last {
            Some(v) if pred(&v) => return v,
            _ if start.elapsed() >= timeout => {
                let ns = api.namespace().unwrap_or("default").to_owned();
                let events = events_of(&api.clone().into_client(), &ns, name).await;
                panic!(
                    "timed out after {timeout:?} waiting for {name}: {what}\nlast seen: {:#?}\nEvents: {:#?}",
                    last.map(|v| v.status),
                    events
                        .iter()
                        .map(|e| (&e.reason, &e.message))
                        .collect::<Vec<_>>()
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Waits up to `secs` until ImpVM `name` is gone (its finalizers done).
pub async fn wait_vm_gone(api: &Api<imp_api::vm::ImpVM>, name: &str, secs: u64) {
    wait_for(
        &format!("{name} deleted"),
        Duration::from_secs(secs),
        || {
            let api = api.clone();
            async move {
                let vm = api.get_opt(name).await.expect("reading an ImpVM");
                vm.is_none().then_some(())
            }
        },
    )
    .await;
}

/// The Events of object `name` in namespace `ns`.
pub async fn events_of(
    c: &kube::Client,
    ns: &str,
    name: &str,
) -> Vec<k8s_openapi::api::core::v1::Event> {
    let api: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(c.clone(), ns);
    api.list(&kube::api::ListParams::default())
        .await
        .expect("listing Events")
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .collect()
}

/// `name`'s Events once there is one with each of `reasons`. The operator and the agent
/// publish an Event after the status write it tells of, so a test that has just seen the
/// status waits for the Event rather than racing the writer.
pub async fn events_with(
    c: &kube::Client,
    ns: &str,
    name: &str,
    reasons: &[&str],
) -> Vec<k8s_openapi::api::core::v1::Event> {
    wait_for(
        &format!("Events {reasons:?} of {ns}/{name}"),
        Duration::from_secs(20),
        || async {
            let evs = events_of(c, ns, name).await;
            reasons
                .iter()
                .all(|r| evs.iter().any(|e| e.reason.as_deref() == Some(*r)))
                .then_some(evs)
        },
    )
    .await
}

/// A process in a cgroup of its own, killed as a container runtime kills a container: every
/// process in the cgroup at once. The cgroup goes when this is dropped.
pub struct Container {
    cgroup: imp_agent::runtime::cgroup::VmCgroup,
    child: Option<tokio::process::Child>,
}

impl Container {
    /// An empty container (cgroup `name`, 1 GiB of memory).
    pub fn new(name: &str) -> Self {
        Container {
            cgroup: imp_agent::runtime::cgroup::VmCgroup::create(name, 1 << 30)
                .expect("creating a test cgroup"),
            child: None,
        }
    }

    /// Runs `child` in the container.
    pub fn run(&mut self, child: tokio::process::Child) {
        self.cgroup
            .add(child.id().expect("a running child"))
            .expect("moving a process into its test cgroup");
        self.child = Some(child);
    }

    /// SIGKILL to the process only, as a crash.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().await.expect("killing a test process");
        }
    }

    /// Waits (at most `within`) for the process to end by itself and returns how it ended.
    pub async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("a process to wait for");
        tokio::time::timeout(within, c.wait())
            .await
            .expect("the process did not end in time")
            .expect("waiting for a test process")
    }

    /// Kills every process in the cgroup and reaps the child.
    pub async fn kill_all(&mut self) {
        let cg = self.cgroup.clone();
        tokio::task::spawn_blocking(move || cg.kill_all(Duration::from_secs(5)))
            .await
            .expect("the cgroup kill task")
            .expect("killing a test cgroup");
        if let Some(mut c) = self.child.take() {
            let _ = c.wait().await;
        }
    }
}

impl Container {
    /// Kills everything in the cgroup now and removes it (blocking; for `Drop`s).
    pub fn destroy(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.start_kill();
        }
        let _ = self.cgroup.kill_all(Duration::from_secs(5));
        let _ = self.cgroup.destroy();
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// Creates ImpVMClass `small`: 1 vCPU, `memory_mib`, a 1 GiB disk.
pub async fn small_class(c: &kube::Client, memory_mib: u32) {
    create_imp(
        c,
        "ImpVMClass",
        "impvmclasses",
        serde_json::json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
               "metadata": {"name": "small"},
               "spec": {"vcpu": 1, "memoryMiB": memory_mib, "diskGiB": 1}}),
    )
    .await;
}

/// Creates an imp.dev/v1alpha1 object of `kind` (`plural`) from its JSON, in the namespace its
/// metadata names (or cluster-wide without one).
pub async fn create_imp(c: &kube::Client, kind: &str, plural: &str, body: serde_json::Value) {
    let gvk = kube::api::GroupVersionKind::gvk("imp.dev", "v1alpha1", kind);
    let ar = kube::api::ApiResource::from_gvk_with_plural(&gvk, plural);
    let api: Api<kube::api::DynamicObject> = match body["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(c.clone(), ns, &ar),
        None => Api::all_with(c.clone(), &ar),
    };
    let obj: kube::api::DynamicObject = serde_json::from_value(body).expect("an imp object");
    api.create(&PostParams::default(), &obj)
        .await
        .expect("creating an imp object");
}

/// Creates the ImpVM `body` (the whole object as JSON) through `vms`; its uid.
pub async fn create_vm(vms: &Api<imp_api::vm::ImpVM>, body: serde_json::Value) -> String {
    let vm: imp_api::vm::ImpVM = serde_json::from_value(body).expect("an ImpVM");
    let created = vms
        .create(&PostParams::default(), &vm)
        .await
        .expect("creating an ImpVM");
    kube::ResourceExt::uid(&created).expect("a created ImpVM's uid")
}

/// A workload for the suspend tests: a tmpfs of its own and a counter in it, one step a second.
/// Each value is written beside the file and renamed over it, so a reader (even one that runs
/// the instant a restored guest continues mid-step) never sees an empty file.
pub const COUNTER: &str = "mkdir -p /mnt/t && mount -t tmpfs tmpfs /mnt/t && i=0; \
     while true; do i=$((i+1)); echo $i > /mnt/t/count.new; mv /mnt/t/count.new /mnt/t/count; \
     sleep 1; done";

/// A busybox image whose workload is [`COUNTER`] (with `date` for clock checks).
pub fn counter_image() -> imp_testenv::registry::TestImage {
    busybox_image(
        &["sh", "echo", "cat", "sleep", "mount", "mkdir", "mv", "date"],
        COUNTER,
    )
}

/// What the local (`imp run`) end-to-end tests share: a real registry holding one test image,
/// a state directory of their own (removed when dropped), and the real `imp` pointed at both
/// and at the guest kernel and init.
pub struct LocalEnv {
    /// The state directory (`IMP_STATE_DIR`).
    pub state: PathBuf,
    _registry: imp_testenv::registry::TestRegistry,
    /// The image's reference in the registry.
    pub image: String,
}

impl LocalEnv {
    /// A registry with `image` pushed as `REPO:1`; `tag` names the scratch directories.
    pub async fn new(tag: &str, repo: &str, image: imp_testenv::registry::TestImage) -> Self {
        use imp_testenv::registry::{TestRegistry, push, scratch_dir};
        let registry = TestRegistry::start()
            .await
            .expect("starting a test registry");
        let layout = scratch_dir(&format!("imp-{tag}-layout")).expect("a scratch directory");
        image
            .write_layout(&layout, "1")
            .expect("writing the test image");
        let dest = format!("{}/{repo}:1", registry.host());
        push(&layout, "1", &dest, None)
            .await
            .expect("pushing the test image");
        let _ = std::fs::remove_dir_all(&layout);
        LocalEnv {
            state: scratch_dir(&format!("imp-{tag}-state")).expect("a scratch directory"),
            _registry: registry,
            image: dest,
        }
    }

    /// The real `imp` binary with `args`, pointed at this state dir, kernel and guest.
    pub fn command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_imp"));
        cmd.env("IMP_STATE_DIR", &self.state)
            .env("IMP_KERNEL", kernel())
            .env("IMP_GUEST", guest())
            .args(args);
        cmd
    }

    /// Runs `imp ARGS` to its end; what it said and how long it took go to the test's log.
    pub fn imp(&self, args: &[&str]) -> std::process::Output {
        let started = Instant::now();
        let out = self.command(args).output().expect("running imp");
        imp_testenv::report::logged(
            format_args!("imp {args:?} in {:.1}s", started.elapsed().as_secs_f64()),
            out,
        )
    }
}

impl Drop for LocalEnv {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// An OTLP/HTTP collector on loopback for the tracing tests: it answers every request 200 and
/// keeps the JSON bodies posted to `/v1/traces`.
pub struct OtlpReceiver {
    /// `http://127.0.0.1:<port>`, the endpoint to configure.
    pub endpoint: String,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
}

impl OtlpReceiver {
    pub async fn start() -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 8192];
                    // Headers, then as many body bytes as Content-Length says.
                    let body = loop {
                        let Ok(n) = conn.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let text = String::from_utf8_lossy(&buf).to_string();
                        let Some(end) = text.find("\r\n\r\n") else {
                            continue;
                        };
                        let len = text[..end]
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            let head = text[..end].lines().next().unwrap_or_default().to_owned();
                            break (head, buf[end + 4..end + 4 + len].to_vec());
                        }
                    };
                    let (request_line, body) = body;
                    if request_line.starts_with("POST /v1/traces ")
                        && let Ok(v) = serde_json::from_slice(&body)
                    {
                        kept.lock().unwrap().push(v);
                    }
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        .await;
                });
            }
        });
        Self { endpoint, bodies }
    }

    /// Every span received so far, each with its `service.name` under `"service"`.
    pub fn spans(&self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for body in self.bodies.lock().unwrap().iter() {
            for rs in body["resourceSpans"].as_array().into_iter().flatten() {
                let service = rs["resource"]["attributes"][0]["value"]["stringValue"].clone();
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for span in ss["spans"].as_array().into_iter().flatten() {
                        let mut span = span.clone();
                        span["service"] = service.clone();
                        out.push(span);
                    }
                }
            }
        }
        out
    }
}

/// The operator's HTTPS listener serving only the gateway (the aggregated API
/// `subresources.imp.dev`), in this process, with the operator ServiceAccount's `kubeconfig`,
/// on 127.0.0.1:`port` where the cluster's APIService expects it, exactly as `imp operator`
/// serves it; stopped when the returned sender is dropped or raised.
pub async fn serve_gateway(
    cp: &imp_testenv::ControlPlane,
    kubeconfig: &Path,
    port: u16,
) -> tokio::sync::watch::Sender<bool> {
    use imp_operator::webhook::certs::{KeeperConfig, Names, Policy};
    use imp_operator::webhook::serving::{Certificate, Serving, spawn};
    let client = cp
        .client_from(kubeconfig)
        .await
        .expect("the operator's client");
    let names = Names::for_service(
        imp_testenv::aggregation::SERVICE,
        "imp-system",
        &[],
        &["127.0.0.1".parse().expect("an address")],
    );
    let year = Duration::from_secs(365 * 86_400);
    let policy = Policy::new(names, year, year * 10).expect("a certificate policy");
    let serving = Serving {
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        certificate: Certificate::Kept(KeeperConfig {
            namespace: "imp-system".into(),
            secret: "imp-webhook-tls".into(),
            configurations: Vec::new(),
            api_services: vec![imp_testenv::aggregation::API_SERVICE.into()],
            policy,
        }),
        quota_preview: false,
        gateway: Some("imp-system".into()),
        agents: imp_api::inputs::agents_user("imp-system"),
    };
    let (stop, _) = tokio::sync::watch::channel(false);
    spawn(
        serving,
        client,
        std::sync::Arc::new(imp_telemetry::Health::new()),
        stop.clone(),
    );
    stop
}

/// Waits until the gateway answers through the API server (its APIService is Available: its
/// discovery answered the aggregator through the published CA) and has published its client
/// certificate for the agents (ConfigMap imp-system/imp-gateway-client; the gateway presents
/// its certificate only once it is published there).
pub async fn wait_gateway(client: &kube::Client) {
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
    let services: Api<APIService> = Api::all(client.clone());
    wait_for(
        "the gateway's APIService to be Available",
        Duration::from_secs(60),
        || {
            let services = services.clone();
            async move {
                let s = services
                    .get_opt(imp_testenv::aggregation::API_SERVICE)
                    .await
                    .ok()??;
                let available = s
                    .status?
                    .conditions?
                    .into_iter()
                    .any(|c| c.type_ == "Available" && c.status == "True");
                available.then_some(())
            }
        },
    )
    .await;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "imp-system");
    wait_for(
        "the gateway's client certificate",
        Duration::from_secs(60),
        || {
            let maps = maps.clone();
            async move { maps.get_opt("imp-gateway-client").await.ok()?.map(drop) }
        },
    )
    .await;
}

/// The names of the reservation Pods (label `imp.dev/reservation=true`) in `ns` owned by the
/// ImpVM of uid `uid`.
pub async fn reservations_of(c: &kube::Client, ns: &str, uid: &str) -> Vec<String> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(c.clone(), ns);
    pods.list(&kube::api::ListParams::default().labels("imp.dev/reservation=true"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == uid)
        })
        .filter_map(|p| p.metadata.name)
        .collect()
}
