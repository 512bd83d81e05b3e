//! Test infrastructure for imp: never shipped, only a dev-dependency.
//!
//! - [`controlplane`]: a real Kubernetes control plane (etcd, kube-apiserver,
//!   kube-controller-manager, and kube-scheduler when asked for) built from pinned Go modules by
//!   `scripts/kube/build`, with TLS, an admin client certificate, RBAC, ServiceAccount tokens,
//!   ResourceQuota and webhooks by URL; one per test binary or one per test.
//! - [`egress`]: the Service range's blackhole route and the nftables tripwire that keep
//!   test traffic on this machine.
//! - [`rbac`]: the ClusterRoles the product ships, bound to a ServiceAccount per component, so
//!   the operator and the agents run in tests with their production permissions.
//! - [`podnode`]: a Node made of a real kubelet, containerd and kube-proxy in a network
//!   namespace of the test's own, where the chart's Pods run for real.
//! - [`registry`]: a real OCI registry on loopback and a writer of test images.
//! - [`scratch`]: fresh per-process temporary directories; [`workspace_root`]: the checkout.
//! - [`guard`]: whether a test whose environment is missing (root, a tool, a binary) skips or
//!   fails: it skips on a developer machine and fails when `CI=true`, so a skip can never pass
//!   as green in CI.
//! - [`rerun`]: a test that runs itself again in a child (in a namespace of its own) by name,
//!   failing unless the child ran exactly that one test.
//!
//! It is not a fake: nothing here answers Kubernetes requests itself.

pub mod aggregation;
pub mod command;
pub mod controlplane;
pub mod egress;
pub mod figures;
pub mod guard;
pub mod kubeconfig;
pub mod nodes;
pub mod pki;
pub mod podnode;
mod process;
pub mod procfs;
pub mod rbac;
pub mod registry;
pub mod report;
pub mod rerun;
pub mod scratch;

pub use controlplane::{ControlPlane, Options, Release};

use std::path::{Path, PathBuf};

/// The workspace's root (the checkout): two levels above this crate's manifest directory, as
/// compiled in, so every crate's tests name the same directory however `cargo test` was started.
pub fn workspace_root() -> PathBuf {
    root_of(Path::new(env!("CARGO_MANIFEST_DIR")))
}

/// The directory two levels above `manifest_dir` (`crates/<name>` sits there), or
/// `manifest_dir` itself if it is too short to have one.
fn root_of(manifest_dir: &Path) -> PathBuf {
    manifest_dir
        .ancestors()
        .nth(2)
        .unwrap_or(manifest_dir)
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_root_holds_the_workspace_manifest_and_this_crate() {
        let root = workspace_root();
        assert!(root.join("Cargo.toml").is_file(), "{root:?}");
        assert!(
            root.join("crates/imp-testenv/Cargo.toml").is_file(),
            "{root:?}"
        );
        assert_eq!(
            root.join("crates/imp-testenv"),
            Path::new(env!("CARGO_MANIFEST_DIR"))
        );
    }

    #[test]
    fn root_is_two_levels_up() {
        assert_eq!(root_of(Path::new("/w/crates/x")), Path::new("/w"));
        assert_eq!(root_of(Path::new("/")), Path::new("/"));
    }
}
