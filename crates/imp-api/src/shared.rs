//! Types shared by several kinds: object references, probes, restart policy, HTTP check,
//! guest-agent switch, and the lifecycle enums.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::GoDuration;

/// Label on a snapshot execution (child) naming its parent ImpVMSnapshot.
pub const LABEL_SNAPSHOT_PARENT: &str = "imp.dev/snapshot-parent";
/// Annotation the node agent writes on an ImpVMSnapshot execution it takes: the node that
/// holds its node-local files (and deletes them), and where a VM restored from it must run.
pub const ANNOTATION_SNAPSHOT_NODE: &str = "imp.dev/snapshot-node";
/// Label on a warm-pool member naming its ImpWarmPool.
pub const LABEL_WARM_POOL: &str = "imp.dev/warm-pool";
/// Annotation on a warm-pool member taken by a claim: the claimant's name (its uid is the
/// member's owner reference). The pool no longer counts it and deletes it once the claimant
/// runs, or when the claim is given up.
pub const ANNOTATION_CLAIMED_BY: &str = "imp.dev/claimed-by";
/// Annotation on an ImpWarmPool, copied onto its members: how a ready member waits for its
/// claim. `paused` (the default: its vCPUs stopped, no CPU spent, the claim resumes it) or
/// `running` (for a workload that must go on working while it waits).
pub const ANNOTATION_MEMBER_STATE: &str = "imp.dev/member-state";
/// [`ANNOTATION_MEMBER_STATE`]'s value that keeps members running.
pub const MEMBER_STATE_RUNNING: &str = "running";
/// Label on a VM that took over a warm pool's member, naming the pool (its `claimedCount`).
pub const LABEL_CLAIMED_FROM: &str = "imp.dev/claimed-from";
/// Label on a runner VM naming its ImpVMRunnerPool.
pub const LABEL_RUNNER_POOL: &str = "imp.dev/runner-pool";
/// Node label that makes a node eligible for ImpVMs.
pub const LABEL_NODE_ENABLED: &str = "imp/enabled";
/// Annotation a user sets to `"true"` to reset an exhausted VM's retries.
pub const ANNOTATION_RESET_RETRIES: &str = "imp/reset-retries";
/// Annotation carrying the operator's HTTP-check failure count.
pub const ANNOTATION_HTTPCHECK_FAILURES: &str = "imp/httpcheck-failures";
/// Annotation on a runner pool carrying the externally signalled runner demand.
pub const ANNOTATION_RUNNER_DEMAND: &str = "imp.dev/runner-demand";
/// Annotation carrying the W3C traceparent from the operator to the agent.
pub const ANNOTATION_TRACE_CONTEXT: &str = "imp.dev/trace-context";
/// Annotation carrying the W3C tracestate from the operator to the agent.
pub const ANNOTATION_TRACE_STATE: &str = "imp.dev/trace-state";
/// Annotation the operator writes with `spec.nodeName`: the [`PlacedSize`] the node was booked
/// for, so the booking outlives a deleted ImpVMClass across operator restarts.
pub const ANNOTATION_PLACED_RESOURCES: &str = "imp.dev/placed-resources";
/// ImpVM annotation: `cold-boot` lets the node agent boot the VM afresh from its image when
/// its suspend snapshot cannot be restored (missing or corrupt), instead of failing it. The
/// guest's memory (its processes, tmpfs) is lost; a Warning Event says so.
pub const ANNOTATION_RESUME_FALLBACK: &str = "imp.dev/resume-fallback";
/// The one value of [`ANNOTATION_RESUME_FALLBACK`].
pub const RESUME_FALLBACK_COLD_BOOT: &str = "cold-boot";
/// Node annotation the agent publishes: `host:port` of its authenticated exec/console API.
pub const ANNOTATION_AGENT_ENDPOINT: &str = "imp.dev/agent-endpoint";
/// Node annotation the agent publishes: the IPv4 address other nodes send its VXLAN traffic to
/// (the agent's `--node-ip`); the operator copies it into each network's VTEP table.
pub const ANNOTATION_VTEP_ADDRESS: &str = "imp.dev/vtep-address";
/// Node annotation the agent publishes: the lowercase hex SHA-256 of its API's TLS certificate,
/// which clients pin (the API server vouches for it, so no CA is needed).
pub const ANNOTATION_AGENT_CERT_SHA256: &str = "imp.dev/agent-cert-sha256";
/// Node annotation the agent publishes: the runtimes its capability probe found able to run VMs
/// there, comma-separated [`VmRuntime`] names in order (`firecracker,qemu`; empty: none). The
/// scheduler places a class that names a runtime only on nodes listing it.
pub const ANNOTATION_RUNTIMES: &str = "imp.dev/runtimes";

/// Label (value `"true"`) on each node agent's own Lease (`imp-agent-<node>`, in the agent's
/// namespace): the agent renews it, fences its VMs when it cannot, and the operator moves VMs
/// off a lost node only once it has been silent past its `leaseDurationSeconds` and a margin.
pub const LABEL_AGENT_LEASE: &str = "imp.dev/agent-lease";
/// What the name of a node agent's Lease starts with; the rest is the node's name.
pub const AGENT_LEASE_PREFIX: &str = "imp-agent-";

/// The name of node `node`'s agent Lease (`imp-agent-<node>`): the agent writes it, and the
/// operator counts only the Lease of that name whose holder is `node`.
pub fn agent_lease_name(node: &str) -> String {
    format!("{AGENT_LEASE_PREFIX}{node}")
}
/// Node annotation the agent publishes: the free and total bytes of the filesystem holding its
/// state directory (VM disks, snapshots, the image cache), as [`DiskReport::render`] writes it
/// (`free=<bytes>,total=<bytes>`), refreshed while it runs. The scheduler reads it with
/// [`DiskReport::parse`] to refuse a node that cannot hold a VM's disk.
pub const ANNOTATION_DISK: &str = "imp.dev/disk";
/// The Node label kubelet sets to the node's Go architecture (`amd64`, `arm64`), which the
/// scheduler compares with a class's `arch`.
pub const LABEL_NODE_ARCH: &str = "kubernetes.io/arch";
/// Finalizer the operator holds on every ImpVM until the agent has cleaned up.
pub const FINALIZER_VM: &str = "imp/finalizer";
/// Finalizer the operator holds on every ImpNetwork until its node state is torn down.
pub const FINALIZER_NETWORK: &str = "imp/network-finalizer";

/// vCPU and memory a VM was placed with: the JSON value of [`ANNOTATION_PLACED_RESOURCES`],
/// e.g. `{"vcpu":2,"memoryMiB":1024}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedSize {
    /// vCPUs booked on the node.
    pub vcpu: i64,
    /// Memory booked on the node, in MiB.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: i64,
}

impl PlacedSize {
    /// The annotation value.
    pub fn to_annotation(&self) -> String {
        format!(
            "{{\"vcpu\":{},\"memoryMiB\":{}}}",
            self.vcpu, self.memory_mib
        )
    }

    /// Parses an annotation value; `None` when it is not the JSON above or holds a negative size.
    pub fn from_annotation(value: &str) -> Option<Self> {
        serde_json::from_str::<Self>(value)
            .ok()
            .filter(|s| s.vcpu >= 0 && s.memory_mib >= 0)
    }
}

/// The free and total bytes of a node's state directory filesystem: the value of
/// [`ANNOTATION_DISK`], `free=<bytes>,total=<bytes>` (decimal bytes, keys in any order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskReport {
    /// Bytes an unprivileged writer can still use (statvfs `f_bavail * f_frsize`).
    pub free: u64,
    /// Size of the filesystem (statvfs `f_blocks * f_frsize`).
    pub total: u64,
}

/// Why an [`ANNOTATION_DISK`] value cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiskReportError {
    /// A comma-separated part is not `key=value`.
    #[error("{ANNOTATION_DISK} part {0:?} is not key=value")]
    NotPair(String),
    /// A key's value is not a decimal byte count.
    #[error("{ANNOTATION_DISK} {key}={value:?} is not a byte count")]
    NotBytes {
        /// `free` or `total`.
        key: &'static str,
        /// The text given.
        value: String,
    },
    /// `free` or `total` is missing, or given twice.
    #[error("{ANNOTATION_DISK} must name {0} exactly once")]
    Count(&'static str),
    /// More is free than the filesystem holds.
    #[error("{ANNOTATION_DISK} says free={free} of total={total}")]
    FreeAboveTotal {
        /// The free bytes given.
        free: u64,
        /// The total bytes given.
        total: u64,
    },
}

impl DiskReport {
    /// The annotation value, e.g. `free=1073741824,total=10737418240`.
    pub fn render(&self) -> String {
        format!("free={},total={}", self.free, self.total)
    }

    /// Parses an annotation value. Keys other than `free` and `total` (a newer agent's) are
    /// skipped; a malformed part, a missing or repeated key, a non-decimal count or more free
    /// than total is refused.
    pub fn parse(value: &str) -> Result<Self, DiskReportError> {
        let (mut free, mut total) = (Vec::new(), Vec::new());
        for part in value.split(',') {
            let (key, raw) = part
                .split_once('=')
                .ok_or_else(|| DiskReportError::NotPair(part.to_owned()))?;
            let (key, slot) = match key.trim() {
                "free" => ("free", &mut free),
                "total" => ("total", &mut total),
                "" => return Err(DiskReportError::NotPair(part.to_owned())),
                _ => continue,
            };
            let raw = raw.trim();
            let bytes = raw
                .parse::<u64>()
                .ok()
                .filter(|_| raw.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| DiskReportError::NotBytes {
                    key,
                    value: raw.to_owned(),
                })?;
            slot.push(bytes);
        }
        let once = |v: &[u64], key| match v {
            [b] => Ok(*b),
            _ => Err(DiskReportError::Count(key)),
        };
        let report = Self {
            free: once(&free, "free")?,
            total: once(&total, "total")?,
        };
        if report.free > report.total {
            return Err(DiskReportError::FreeAboveTotal {
                free: report.free,
                total: report.total,
            });
        }
        Ok(report)
    }
}

/// A reference to an object in the same namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LocalObjectRef {
    /// Name of the referenced object.
    pub name: String,
}

/// A core/v1 LocalObjectReference: as in Kubernetes (and the Go project), `name` may be left
/// out and is then empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CoreLocalObjectRef {
    /// Name of the referenced object.
    #[serde(default)]
    pub name: String,
}

/// A reference to a cluster-scoped object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ClusterObjectRef {
    /// Name of the referenced object.
    pub name: String,
}

/// Health probes run inside the guest, plus an HTTP check of the VM's address from its node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProbeSpec {
    /// Gates readiness until the workload has started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_probe: Option<Probe>,
    /// Decides the VM's Ready condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<Probe>,
    /// Decides whether the workload is healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_probe: Option<Probe>,
    /// HTTP check of the VM's address, made by its node's agent (by the guest on its own
    /// loopback for a ScaleToZero VM, so the check does not keep it awake); failing turns Ready
    /// False (HealthCheckFailed) until it passes again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_check: Option<HttpCheckSpec>,
}

impl ProbeSpec {
    /// Whether a probe runs in the guest (through its agent): startup, readiness or liveness.
    pub fn in_guest(&self) -> bool {
        self.startup_probe.is_some()
            || self.readiness_probe.is_some()
            || self.liveness_probe.is_some()
    }
}

/// One guest probe: a command or an HTTP GET, exactly one of them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("has(self.exec) != has(self.http)").message("exactly one of exec or http must be set"))]
pub struct Probe {
    /// Command run in the guest; exit 0 is success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecAction>,
    /// HTTP GET against the guest's loopback; 200..399 is success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpGetAction>,
    /// Seconds to wait after start before the first probe.
    #[serde(default)]
    pub initial_delay_seconds: i32,
    /// Seconds between probes.
    #[serde(default = "default_period_seconds")]
    pub period_seconds: i32,
    /// Consecutive failures before the probe counts as failed.
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: i32,
}

fn default_period_seconds() -> i32 {
    10
}

fn default_failure_threshold() -> i32 {
    3
}

/// A command for an exec probe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ExecAction {
    /// argv of the command; the first element is looked up on the guest's PATH.
    #[schemars(length(min = 1))]
    pub command: Vec<String>,
}

/// An HTTP GET for an http probe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HttpGetAction {
    /// Request path (required, as in the Go project).
    pub path: String,
    /// TCP port in the guest.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

/// The HTTP health check of a VM: a GET of `path` on the VM's address and `port`, made by the
/// node agent every `intervalSeconds`; 2xx passes, `failureThreshold` failures in a row turn
/// Ready False with reason HealthCheckFailed and a Warning Event, and the next pass a Normal
/// HealthCheckRecovered Event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpCheckSpec {
    /// Turns the check on; a present but disabled check switches the cluster default off.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub enabled: bool,
    /// Request path.
    #[serde(default = "default_http_check_path")]
    pub path: String,
    /// TCP port on the VM's address; without it every check fails, saying so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Seconds between checks.
    #[serde(default = "default_period_seconds")]
    pub interval_seconds: i32,
    /// Consecutive failures before Ready turns False (0 or less means 3).
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: i32,
}

fn default_http_check_path() -> String {
    "/healthz".to_owned()
}

/// Switch for the in-guest agent (exec, probes, metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GuestAgentConfig {
    /// Absent or true: the guest agent serves exec, probes, guest metrics and graceful
    /// shutdown, and the VM is Running once it answers. false: the guest runs its workload
    /// without it; the VM is Running once its VMM runs, exec and in-guest probes are refused
    /// (httpCheck from the node still works), no guest figures are reported, a stop kills the
    /// VM after the grace period, and the workload's exit code is still reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

impl GuestAgentConfig {
    /// Whether the guest agent runs, with absent meaning yes.
    pub fn is_enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }
}

/// What happens when a persistent VM's workload fails.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestartPolicy {
    /// Restart on the same node, or schedule again.
    #[serde(default)]
    pub mode: RestartMode,
    /// Exponential backoff between attempts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffPolicy>,
    /// What to do once maxRetries is reached.
    #[serde(default)]
    pub on_exhaustion: OnExhaustion,
    /// How long to wait before retrying again when onExhaustion is cool-down.
    #[serde(default = "default_cool_down")]
    #[schemars(transform = crate::schema::go_duration_pattern)]
    pub cool_down_period: GoDuration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            mode: RestartMode::default(),
            backoff: None,
            on_exhaustion: OnExhaustion::default(),
            cool_down_period: default_cool_down(),
        }
    }
}

fn default_cool_down() -> GoDuration {
    GoDuration::from_static("1h")
}

/// Where a failed VM restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RestartMode {
    /// Restart on the node it ran on.
    #[default]
    #[serde(rename = "in-place")]
    InPlace,
    /// Clear the node and schedule again.
    #[serde(rename = "reschedule")]
    Reschedule,
}

/// The end state once retries are used up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum OnExhaustion {
    /// Stay Failed.
    #[default]
    #[serde(rename = "fail")]
    Fail,
    /// Go to RetryExhausted until the reset annotation is set.
    #[serde(rename = "manual-reset")]
    ManualReset,
    /// Wait coolDownPeriod, then start over.
    #[serde(rename = "cool-down")]
    CoolDown,
}

/// Backoff between restart attempts: initialDelay × 2^attempt, capped at maxDelay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackoffPolicy {
    /// Attempts before onExhaustion applies; 0 means the default of 5.
    #[serde(default = "default_max_retries")]
    pub max_retries: i32,
    /// Delay before the first retry.
    #[serde(default = "default_initial_delay")]
    #[schemars(transform = crate::schema::go_duration_pattern)]
    pub initial_delay: GoDuration,
    /// Upper bound of the delay.
    #[serde(default = "default_max_delay")]
    #[schemars(transform = crate::schema::go_duration_pattern)]
    pub max_delay: GoDuration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self {
            max_retries: default_max_retries(),
            initial_delay: default_initial_delay(),
            max_delay: default_max_delay(),
        }
    }
}

fn default_max_retries() -> i32 {
    5
}

fn default_initial_delay() -> GoDuration {
    GoDuration::from_static("10s")
}

fn default_max_delay() -> GoDuration {
    GoDuration::from_static("5m")
}

/// Whether a VM runs once (a job) or stays up (a service).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum VmLifecycle {
    /// Runs its workload once; exit 0 is Succeeded, anything else Failed.
    #[default]
    Ephemeral,
    /// Runs until deleted; an exit is a failure subject to the restart policy.
    Persistent,
}

/// The state a user asks a VM to be in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum VmDesiredState {
    /// Running.
    #[default]
    Running,
    /// Suspended to a snapshot on its node, memory freed.
    Suspended,
    /// Suspended after idleTimeout without traffic, woken by the next packet.
    ScaleToZero,
}

/// CPU architecture a class is meant for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// x86_64.
    Amd64,
    /// aarch64.
    Arm64,
    /// Any node's architecture.
    #[default]
    Multi,
}

/// The VMM that runs a class's VMs (an imp extension). The scheduler places them only on nodes
/// whose agent lists it in the Node annotation imp.dev/runtimes (the runtimes its probe found
/// able to run VMs there); absent means the agent's default runtime (Firecracker where KVM
/// boots Linux, else QEMU), on any node but one whose agent found none.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema, strum::VariantArray,
)]
#[serde(rename_all = "lowercase")]
pub enum VmRuntime {
    /// Firecracker (production default, needs a working KVM).
    Firecracker,
    /// QEMU `-M microvm`, with KVM or TCG.
    Qemu,
}

impl VmRuntime {
    /// Every runtime, in the order [`ANNOTATION_RUNTIMES`] lists them.
    pub const ALL: &'static [Self] = <Self as strum::VariantArray>::VARIANTS;

    /// The name the CRD and [`ANNOTATION_RUNTIMES`] use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Firecracker => "firecracker",
            Self::Qemu => "qemu",
        }
    }

    /// The value of [`ANNOTATION_RUNTIMES`] for a node that runs `runtimes`.
    pub fn list_annotation(runtimes: &[Self]) -> String {
        Self::ALL
            .iter()
            .filter(|r| runtimes.contains(r))
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The runtimes an [`ANNOTATION_RUNTIMES`] value lists; unknown names (a newer agent's) are
    /// left out.
    pub fn parse_list(value: &str) -> Vec<Self> {
        let named: Vec<&str> = value.split(',').map(str::trim).collect();
        Self::ALL
            .iter()
            .copied()
            .filter(|r| named.contains(&r.as_str()))
            .collect()
    }
}

impl Arch {
    /// The value of the Node label [`LABEL_NODE_ARCH`] a node of this architecture carries;
    /// `None` for `multi`, which fits any node.
    pub fn node_label(self) -> Option<&'static str> {
        match self {
            Self::Amd64 => Some("amd64"),
            Self::Arm64 => Some("arm64"),
            Self::Multi => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_annotation_round_trips_and_names_match_the_crd() {
        let both = [VmRuntime::Qemu, VmRuntime::Firecracker];
        assert_eq!(VmRuntime::list_annotation(&both), "firecracker,qemu");
        assert_eq!(VmRuntime::list_annotation(&[]), "");
        assert_eq!(
            VmRuntime::parse_list("qemu, cloud-hypervisor"),
            vec![VmRuntime::Qemu]
        );
        assert_eq!(VmRuntime::parse_list(""), vec![]);
        for &r in VmRuntime::ALL {
            let json = serde_json::to_value(r).unwrap_or_default();
            assert_eq!(json.as_str(), Some(r.as_str()), "{r:?}");
            assert_eq!(
                VmRuntime::parse_list(&VmRuntime::list_annotation(&[r])),
                vec![r]
            );
        }
        for (arch, label) in [(Arch::Amd64, Some("amd64")), (Arch::Arm64, Some("arm64"))] {
            assert_eq!(arch.node_label(), label);
            let json = serde_json::to_value(arch).unwrap_or_default();
            assert_eq!(
                json.as_str(),
                label,
                "the CRD's enum and the node label agree"
            );
        }
        assert_eq!(Arch::Multi.node_label(), None);
    }

    #[test]
    fn disk_report_round_trips_and_refuses_garbage() {
        let r = DiskReport {
            free: 1 << 30,
            total: 10 << 30,
        };
        assert_eq!(r.render(), "free=1073741824,total=10737418240");
        assert_eq!(DiskReport::parse(&r.render()), Ok(r));
        assert_eq!(
            DiskReport::parse(" total=10 , free=3,inodes=7"),
            Ok(DiskReport { free: 3, total: 10 }),
            "any order, spaces and unknown keys are fine"
        );
        let err = |v: &str| DiskReport::parse(v).err();
        assert_eq!(err(""), Some(DiskReportError::NotPair(String::new())));
        assert_eq!(
            err("free=1;total=2").map(|e| e.to_string()),
            Some(r#"imp.dev/disk free="1;total=2" is not a byte count"#.into())
        );
        assert!(matches!(
            err("free=1,total"),
            Some(DiskReportError::NotPair(_))
        ));
        assert!(matches!(
            err("=1,free=1,total=2"),
            Some(DiskReportError::NotPair(_))
        ));
        assert_eq!(
            err("free=-1,total=2"),
            Some(DiskReportError::NotBytes {
                key: "free",
                value: "-1".into()
            })
        );
        assert!(matches!(
            err("free=+1,total=2"),
            Some(DiskReportError::NotBytes { key: "free", .. })
        ));
        assert!(matches!(
            err("free=1,total=2GiB"),
            Some(DiskReportError::NotBytes { key: "total", .. })
        ));
        assert!(matches!(
            err("free=1,total=99999999999999999999999"),
            Some(DiskReportError::NotBytes { .. })
        ));
        assert_eq!(err("total=2"), Some(DiskReportError::Count("free")));
        assert_eq!(
            err("free=1,free=1,total=2"),
            Some(DiskReportError::Count("free"))
        );
        assert_eq!(err("free=1"), Some(DiskReportError::Count("total")));
        assert_eq!(
            err("free=3,total=2"),
            Some(DiskReportError::FreeAboveTotal { free: 3, total: 2 })
        );
    }

    #[test]
    fn placed_size_round_trips_through_its_annotation() {
        let s = PlacedSize {
            vcpu: 2,
            memory_mib: 1024,
        };
        assert_eq!(s.to_annotation(), r#"{"vcpu":2,"memoryMiB":1024}"#);
        assert_eq!(PlacedSize::from_annotation(&s.to_annotation()), Some(s));
        assert_eq!(PlacedSize::from_annotation("2 vCPU"), None);
        assert_eq!(
            PlacedSize::from_annotation(r#"{"vcpu":-1,"memoryMiB":1}"#),
            None
        );
    }
}
