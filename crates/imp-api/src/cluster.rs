//! ClusterImpConfig (the `cluster` singleton) and ClusterImpNodeProfile (per-node capacity).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::HttpCheckSpec;

/// A capacity fraction between 0 and 1 written as a string ("0.9").
pub const FRACTION_PATTERN: &str = r"^(0(\.[0-9]+)?|1(\.0+)?)$";
/// The only name a ClusterImpConfig may have.
pub const CLUSTER_CONFIG_NAME: &str = "cluster";

/// Cluster-wide settings, read from the object named `cluster`.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ClusterImpConfig",
    plural = "clusterimpconfigs",
    singular = "clusterimpconfig",
    shortname = "impcfg",
    category = "imp",
    validation = kube::core::Rule::new("self.metadata.name == 'cluster'").message("ClusterImpConfig is a singleton: metadata.name must be cluster"),
    printcolumn(name = "CNI", type_ = "string", json_path = ".spec.networking.cni.provider"),
    printcolumn(name = "DefaultFraction", type_ = "string", json_path = ".spec.capacity.defaultFraction"),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ClusterImpConfigSpec {
    /// CNI and IPAM settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networking: Option<NetworkingConfig>,
    /// Scheduling capacity defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityConfig>,
    /// Metrics and tracing. The operator and agents serve metrics where their `--metrics-addr`
    /// flags say and export no traces: any value other than the defaults is not supported yet
    /// (refused by the admission webhook).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observability: Option<ObservabilityConfig>,
    /// HTTP check booked into every VM on a network that has none of its own (a VM's,
    /// template's or class's check wins, even a disabled one); VMs already placed keep the
    /// check they were booked with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_http_check: Option<HttpCheckSpec>,
}

spec_may_be_absent!(ClusterImpConfigSpec);

/// Networking settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NetworkingConfig {
    /// CNI settings. Nothing detects or configures the CNI: `autoDetect: false`, `provider` and
    /// `natBackend: iptables` are not supported yet (refused by the admission webhook).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cni: Option<CniConfig>,
    /// Default IPAM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<ClusterIpamConfig>,
}

/// CNI settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CniConfig {
    /// Detect the CNI from the cluster. Nothing detects it yet; false: Not supported yet: refused by the admission webhook.
    #[serde(default = "default_true")]
    pub auto_detect: bool,
    /// CNI provider, overriding detection (cilium-kubeproxy-free, cilium, flannel, calico,
    /// unknown). Not supported yet: refused by the admission webhook when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// NAT backend on nodes: node agents write nftables rules; iptables: Not supported yet: refused by the admission webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat_backend: Option<NatBackend>,
}

impl Default for CniConfig {
    fn default() -> Self {
        Self {
            auto_detect: true,
            provider: None,
            nat_backend: None,
        }
    }
}

fn default_true() -> bool {
    true
}

/// NAT implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NatBackend {
    /// nft.
    Nftables,
    /// iptables.
    Iptables,
}

/// Cluster IPAM default.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ClusterIpamConfig {
    /// Only the internal allocator exists cluster-wide (ImpNetwork `ipam.provider` chooses per
    /// network).
    #[serde(default)]
    pub provider: ClusterIpamProvider,
}

/// Cluster IPAM providers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ClusterIpamProvider {
    /// imp's allocator.
    #[default]
    Internal,
}

/// Capacity defaults.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapacityConfig {
    /// Share of each node's allocatable CPU and memory imp may use.
    #[serde(default = "default_fraction")]
    #[schemars(regex(pattern = FRACTION_PATTERN))]
    pub default_fraction: String,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        Self {
            default_fraction: default_fraction(),
        }
    }
}

fn default_fraction() -> String {
    "0.9".to_owned()
}

/// Observability settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ObservabilityConfig {
    /// Prometheus metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<MetricsConfig>,
    /// OTLP tracing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingConfig>,
}

/// Metrics endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MetricsConfig {
    /// Serve /metrics. The `--metrics-addr` flags decide; false: Not supported yet: refused by the admission webhook.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Port of /metrics. The `--metrics-addr` flags decide; other than 9090: Not supported yet: refused by the admission webhook.
    #[serde(default = "default_metrics_port")]
    pub port: i32,
}

/// `observability.metrics.port` when absent, the only port admission accepts.
pub const DEFAULT_METRICS_PORT: i32 = 9090;

fn default_metrics_port() -> i32 {
    DEFAULT_METRICS_PORT
}

/// Tracing export.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TracingConfig {
    /// Export spans of every VM's way to Running (a trace per VM: the operator's schedule, the
    /// agent's start and its steps) to `endpoint`, over OTLP/HTTP with the JSON encoding.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub enabled: bool,
    /// OTLP/HTTP collector, `http://host[:port][/path]` (port 4318 by default; spans go to
    /// `<path>/v1/traces`). Required when enabled. Not supported yet: refused by the admission
    /// webhook for any other scheme (OTLP over gRPC, as `host:4317`, or HTTPS).
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub endpoint: String,
}

/// Capacity of one node for imp; its name must equal the node's.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ClusterImpNodeProfile",
    plural = "clusterimpnodeprofiles",
    singular = "clusterimpnodeprofile",
    shortname = "impnp",
    category = "imp",
    printcolumn(
        name = "Fraction",
        type_ = "string",
        json_path = ".spec.capacityFraction"
    ),
    printcolumn(name = "MaxVMs", type_ = "integer", json_path = ".spec.maxImpVMs"),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ClusterImpNodeProfileSpec {
    /// Share of the node's allocatable imp may use; overrides the cluster default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = FRACTION_PATTERN))]
    pub capacity_fraction: Option<String>,
    /// Hard cap on VMs on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "maxImpVMs")]
    #[schemars(range(min = 0))]
    pub max_imp_vms: Option<i32>,
    /// Explicit vCPU capacity; non-zero makes it (and memoryMiB) the node's hard capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub vcpu_capacity: Option<i32>,
    /// Explicit memory capacity in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 0))]
    pub memory_mib: Option<i64>,
    /// CPU model of the node (the first "model name" of its /proc/cpuinfo), written by the
    /// node's agent into this profile whenever it exists (the agent creates no profile; a
    /// node whose kernel names no model gets none). Meant for matching migration targets;
    /// nothing reads it yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
}

spec_may_be_absent!(ClusterImpNodeProfileSpec);
