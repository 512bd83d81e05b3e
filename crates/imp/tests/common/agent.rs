//! One `imp agent` in the test's own network namespace (`--no-network`, QEMU), in a cgroup
//! of its own like a container, so a restart can be played by killing everything in it; its
//! state and its VMs' cgroups removed on drop.

use std::path::PathBuf;
use std::process::Stdio;

use imp_testenv::registry::scratch_dir;
use tokio::process::Command;

/// A node agent for node `node`.
pub struct HostAgent {
    /// The node it serves.
    pub node: String,
    /// Its state directory.
    pub state: PathBuf,
    /// Its metrics address (`127.0.0.1:PORT`).
    pub metrics: String,
    /// More arguments for each start.
    pub args: Vec<String>,
    /// The kubeconfig it runs with, instead of the cluster's agent kubeconfig bound to `node`
    /// (e.g. that one rewritten to reach the API server through a proxy a test can cut).
    pub kubeconfig: Option<PathBuf>,
    cgroup_parent: String,
    container: super::Container,
}

impl HostAgent {
    /// An agent for `node`, not started; `tag` names its directories and cgroups.
    pub fn new(node: &str, tag: &str) -> Self {
        let id = format!("{tag}-{}", std::process::id());
        Self {
            node: node.to_owned(),
            state: scratch_dir(&format!("imp-{tag}-state")).unwrap(),
            metrics: format!("127.0.0.1:{}", super::free_port()),
            args: Vec::new(),
            kubeconfig: None,
            cgroup_parent: format!("{id}-vms"),
            container: super::Container::new(&format!("{id}-agent")),
        }
    }

    /// Starts it with the agent credentials of `kube` bound to its node.
    pub async fn start(&mut self, kube: &super::Cluster) {
        let kubeconfig = match &self.kubeconfig {
            Some(k) => k.clone(),
            None => kube.agent_kubeconfig_for(&self.node).await,
        };
        let child = Command::new(env!("CARGO_BIN_EXE_imp"))
            .arg("agent")
            .env("NODE_NAME", &self.node)
            .env("FC_KERNEL", super::kernel())
            .env("IMP_GUEST", super::guest())
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", super::rust_log())
            .args(["--state-dir", self.state.to_str().unwrap()])
            .args(["--runtime", "qemu", "--no-network"])
            .args(["--cgroup-parent", &self.cgroup_parent])
            .args(["--metrics-addr", &self.metrics])
            .args(["--stop-grace", "3s", "--api-addr", "127.0.0.1:0"])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(super::logs())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.container.run(child);
    }

    /// Kills every process in the agent's cgroup, as a container runtime does on restart.
    pub async fn kill_container(&mut self) {
        self.container.kill_all().await;
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        self.container.destroy();
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.state.join("snapshots"))
            .stderr(Stdio::null())
            .status();
        super::remove_agent_leftovers(&self.state, &self.cgroup_parent);
    }
}

/// A guest test's cluster with one node: the control plane (with namespace `ns`), `exec_users`'
/// kubeconfig for `ns`, node `node` Ready, and class `small` (1 vCPU, `memory_mib`, 1 GiB disk).
pub struct SingleNode {
    /// The control plane.
    pub kube: super::Cluster,
    /// An admin client.
    pub client: kube::Client,
    /// A kubeconfig of a token user allowed to exec into `ns`'s VMs.
    pub exec_kubeconfig: PathBuf,
}

/// [`SingleNode`], or `None` when a guest cannot boot or the control plane is not built (the
/// test skips; under `CI=true` the checks fail instead).
pub async fn single_node(ns: &str, node: &str, memory_mib: u32) -> Option<SingleNode> {
    super::guest_boot_ready()?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    super::control_plane_ready()?;
    let kube = super::cluster(&[ns, "imp-system"]).await;
    let (exec_kubeconfig, _) = super::exec_users(&kube, ns).await;
    let client = kube.client.clone();
    super::ready_node(&client, node).await;
    super::small_class(&client, memory_mib).await;
    Some(SingleNode {
        kube,
        client,
        exec_kubeconfig,
    })
}
