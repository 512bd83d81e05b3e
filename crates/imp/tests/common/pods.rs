//! A cluster whose imp runs as the chart's Pods on a real node (imp-testenv's `podnode`): the
//! control plane, one node with a kubelet, the host directories the chart's values point at,
//! and the commands a person runs against it (helm, kubectl, imp). `pods_e2e` and
//! `upgrade_e2e` share it.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use imp_testenv::podnode::{NodeNet, PodNode};
use imp_testenv::{ControlPlane, Options, workspace_root};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use super::nodes::text;

/// The chart's namespace.
pub const NS: &str = "imp-system";
/// The node's name.
pub const NODE: &str = "pod-node";

/// Whether the node can run here (else skip, or fail in CI); `archives` must exist too.
pub fn ready(archives: &[PathBuf]) -> Option<()> {
    super::guest_boot_ready()?;
    super::control_plane_ready()?;
    let mut ok = true;
    for what in imp_testenv::podnode::missing() {
        ok &= imp_testenv::guard::require(false, &what);
    }
    for archive in archives {
        let what = format!(
            "{} (scripts/images builds target/images, scripts/previous-release target/previous)",
            archive.display()
        );
        ok &= imp_testenv::guard::require(archive.is_file(), &what);
    }
    ok.then_some(())
}

/// This release's image `image`, as `scripts/images` writes it.
pub fn archive(image: &str) -> PathBuf {
    workspace_root().join(format!("target/images/{image}.oci.tar"))
}

/// The control plane and its node. Dropped in field order: the node (its containers and
/// network) first, then what the VMs left on the host, then the control plane.
pub struct Cluster {
    pub node: PodNode,
    leftovers: Leftovers,
    pub cp: ControlPlane,
    /// The test's directory on the host (its node, state and image directories).
    pub dir: PathBuf,
}

impl Cluster {
    /// Starts the control plane and a Ready node labelled for the agent; `test` names the
    /// host directory (under /var/tmp, not /tmp, where the agent's Pod mounts an emptyDir: the
    /// chart refuses host directories under /tmp, whose removal with the Pod would unmount the
    /// state directory under the VMs' shims) and the VMs' parent cgroup.
    pub async fn start(test: &str) -> Cluster {
        let t0 = Instant::now();
        let net = NodeNet::create(0).unwrap_or_else(|e| panic!("{e}"));
        let opts = Options {
            host: net.host.into(),
            kubelets: true,
            scheduler: true,
            ..Options::default()
        };
        let cp = ControlPlane::start(opts)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let name = format!("imp-{test}-{}", std::process::id());
        let dir = PathBuf::from("/var/tmp").join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let leftovers = Leftovers {
            state: dir.join("state"),
            cgroup_parent: name,
        };
        let labels = [("imp/enabled", "true")];
        let node = PodNode::start(&cp, net, NODE, &labels, dir.join("node"))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("a Ready node with a kubelet in {:?}", t0.elapsed());
        Cluster {
            node,
            leftovers,
            cp,
            dir,
        }
    }

    /// The agent's state directory on the host.
    pub fn state(&self) -> PathBuf {
        self.leftovers.state.clone()
    }

    /// Where the test writes its VM image's OCI layout (mounted into the agent by `values`).
    pub fn layout(&self) -> PathBuf {
        self.dir.join("layout")
    }

    /// The values the test installs with: the node's host directories under the test's
    /// directory (not the machine's /var/lib), VMs' cgroups under a parent of the test's own,
    /// the VM image's layout mounted read-only into the agent and the node's pause image for
    /// reservation Pods (no registry reaches the node). Written to a file; returns its path.
    pub fn values(&self) -> PathBuf {
        let d = self.dir.display();
        let l = self.layout().display().to_string();
        let values = format!(
            r#"operator:
  reservations:
    image: {pause}
agent:
  stateDir: {d}/state
  imageCache: {d}/cache
  snapshotPaths: [{d}/snapshots]
  cgroupParent: {parent}
  extraVolumes:
    - name: test-images
      hostPath: {{path: {l}, type: Directory}}
  extraVolumeMounts:
    - name: test-images
      mountPath: {l}
      readOnly: true
"#,
            parent = self.leftovers.cgroup_parent,
            pause = imp_testenv::podnode::PAUSE_IMAGE,
        );
        let file = self.dir.join("values.yaml");
        std::fs::write(&file, values).unwrap();
        file
    }

    /// `helm VERB imp CHART -n imp-system --wait EXTRA…`, which must succeed.
    pub fn helm(&self, verb: &str, chart: &Path, extra: &[&str]) {
        let bin = imp_testenv::controlplane::helm().expect("helm (scripts/kube/build)");
        let out = std::process::Command::new(bin)
            .args([verb, "imp"])
            .arg(chart)
            .args(["-n", NS, "--wait", "--timeout", "3m"])
            .args(extra)
            .arg("--kubeconfig")
            .arg(self.cp.admin_kubeconfig())
            .output()
            .expect("running helm");
        assert!(out.status.success(), "helm {verb}: {}", text(&out));
    }

    /// Runs kubectl as the admin; returns its output whatever its status.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.cp
            .kubectl()
            .expect("kubectl")
            .args(args)
            .output()
            .expect("running kubectl")
    }

    /// Runs `imp ARGS…` as the admin; it must succeed.
    pub async fn imp(&self, args: &[&str]) -> String {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_imp"));
        cmd.env("KUBECONFIG", self.cp.admin_kubeconfig()).args(args);
        let out = super::output_within(cmd, Duration::from_secs(120), "imp").await;
        assert!(out.status.success(), "imp {args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The boot id of VM `vm` in namespace `ns`'s guest, read with `imp exec` through the API
    /// server.
    pub async fn boot_id(&self, ns: &str, vm: &str) -> String {
        let boot = self
            .imp(&[
                "exec",
                "-n",
                ns,
                vm,
                "--",
                "cat",
                "/proc/sys/kernel/random/boot_id",
            ])
            .await;
        assert_eq!(boot.trim().len(), 36, "{vm}'s boot id: {boot:?}");
        boot
    }

    /// The chart's Pods of `component` (`operator`, `agent`).
    pub async fn pods(&self, component: &str) -> Vec<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.cp.admin().await.unwrap(), NS);
        let labels = format!("app.kubernetes.io/component={component}");
        pods.list(&ListParams::default().labels(&labels))
            .await
            .expect("listing the chart's Pods")
            .items
    }

    /// The names of the agent's Pods that are Ready.
    pub async fn ready_agents(&self) -> Vec<String> {
        self.pods("agent")
            .await
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .filter_map(|p| p.metadata.name)
            .collect()
    }

    /// Waits up to 60 s until no Pod of `component` is being deleted (replaced Pods, after a
    /// roll, are gone).
    pub async fn wait_none_terminating(&self, component: &str) {
        let what = format!("the replaced {component} Pods gone");
        super::wait_for(&what, Duration::from_secs(60), || async {
            let pods = self.pods(component).await;
            let stopping = pods.iter().any(|p| p.metadata.deletion_timestamp.is_some());
            (!stopping).then_some(())
        })
        .await;
    }

    /// The pid of the agent (the Pod's, seen in the host's PID namespace: the Pod has
    /// `hostPID`).
    pub fn agent_pid(&self) -> Option<u32> {
        let arg = format!("--state-dir={}", self.state().display());
        super::processes_naming(&arg).into_iter().next()
    }
}

/// Whatever the VMs leave if the test fails half-way (their cgroups, killing what runs there),
/// and the test's directory.
struct Leftovers {
    state: PathBuf,
    cgroup_parent: String,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        super::remove_agent_leftovers(&self.state, &self.cgroup_parent);
        if let Some(dir) = self.state.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
