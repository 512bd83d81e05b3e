//! Test infrastructure for imp: never shipped, only a dev-dependency.
//!
//! - [`controlplane`]: a real Kubernetes control plane (etcd, kube-apiserver,
//!   kube-controller-manager, and kube-scheduler when asked for) built from pinned Go modules by
//!   `scripts/kube/build`, with TLS, an admin client certificate, RBAC, ServiceAccount tokens,
//!   ResourceQuota and webhooks by URL; one per test binary or one per test.
//! - [`rbac`]: the ClusterRoles the product ships, bound to a ServiceAccount per component, so
//!   the operator and the agents run in tests with their production permissions.
//! - [`registry`]: a real OCI registry on loopback and a writer of test images.
//! - [`guard`]: whether a test whose environment is missing (root, a tool, a binary) skips or
//!   fails: it skips on a developer machine and fails when `CI=true`, so a skip can never pass
//!   as green in CI.
//!
//! It is not a fake: nothing here answers Kubernetes requests itself.

pub mod controlplane;
pub mod guard;
pub mod kubeconfig;
pub mod nodes;
pub mod pki;
mod process;
pub mod procfs;
pub mod rbac;
pub mod registry;
pub mod report;

pub use controlplane::{ControlPlane, Options, Release};
