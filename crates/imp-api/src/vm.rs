//! ImpVM: one microVM running an OCI image on some node.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvFromSource, EnvVar, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::GoDuration;
use crate::inherited::Inherited;
use crate::shared::{ClusterObjectRef, LocalObjectRef, VmDesiredState, VmLifecycle};

/// What the user asks for: an image in a class of machine on a network.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVM",
    plural = "impvms",
    singular = "impvm",
    shortname = "impvm",
    category = "imp",
    namespaced,
    status = "ImpVMStatus",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.nodeName"),
    printcolumn(name = "IP", type_ = "string", json_path = ".status.ip"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    selectable = ".spec.nodeName",
    derive = "Default",
    derive = "PartialEq"
)]
#[schemars(transform = crate::schema::vm_spec)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpVMSpec {
    /// Template to inherit image, class, network and policies from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_ref: Option<LocalObjectRef>,
    /// Machine class (vCPU, memory, disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_ref: Option<ClusterObjectRef>,
    /// Network to attach to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_ref: Option<LocalObjectRef>,
    /// Image, probes, guest agent, restart policy, network group, layers and expiry; each taken
    /// from the template when unset here.
    #[serde(flatten)]
    pub inherited: Inherited,
    /// Secrets (kubernetes.io/dockerconfigjson) used to pull the image (imp extension).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectRef>,
    /// One-shot job or long-running service.
    #[serde(default)]
    pub lifecycle: VmLifecycle,
    /// Node the VM runs on; set by the scheduler, or by the user to pin it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Name of a snapshot execution (child ImpVMSnapshot) to boot from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_ref: Option<String>,
    /// Node labels that must match exactly.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints this VM tolerates, in addition to its template's and class's: for placement, and
    /// for eviction from a node with a `NoExecute` taint (at once when not tolerated, after
    /// `tolerationSeconds` when tolerated for a limited time, never when tolerated without one;
    /// the node-loss taints `node.kubernetes.io/unreachable`/`not-ready` are left to node loss).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Environment of the workload; `valueFrom` reads `secretKeyRef` and `configMapKeyRef` when
    /// the VM starts. `fieldRef`, `resourceFieldRef` and `fileKeyRef`: Not supported yet: refused by the admission webhook.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = crate::schema::core_env)]
    pub env: Vec<EnvVar>,
    /// Environment taken from ConfigMaps and Secrets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = crate::schema::core_env)]
    pub env_from: Vec<EnvFromSource>,
    /// cloud-init style user data: a ConfigMap's `user-data` key (a `#!` script, or a
    /// `#cloud-config` with write_files, users and runcmd), applied by the guest's init before
    /// the workload starts; a failure fails the VM naming the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<UserDataSource>,
    /// For persistent VMs: move to another node when the node is lost.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reschedule_on_node_loss: bool,
    /// Running, Suspended, or ScaleToZero (suspend when idle, wake on traffic).
    #[serde(default)]
    pub desired_state: VmDesiredState,
    /// Idle time before a ScaleToZero VM suspends; at least 10s, default 5m.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::idle_timeout)]
    pub idle_timeout: Option<GoDuration>,
    /// Take a running member of this ImpWarmPool instead of booting (imp's extension to the Go
    /// API): beside the pool's template (`templateRef`), in the pool's namespace; with no ready
    /// member, the VM restores from the pool's base instead (docs/warm-pools.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_pool_ref: Option<WarmPoolRef>,
}

/// The ImpWarmPool a VM claims a member of.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WarmPoolRef {
    /// The pool's name.
    pub name: String,
    /// The pool's namespace: only the VM's own (a claim never crosses namespaces); written out
    /// so that naming another is refused rather than quietly dropped by the schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

spec_may_be_absent!(ImpVMSpec);

/// Where user data comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UserDataSource {
    /// ConfigMap holding the user data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<LocalObjectRef>,
}

/// Where a VM is in its life.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
    strum::VariantArray,
)]
pub enum VmPhase {
    /// Waiting for a node (or for a referenced object).
    #[default]
    Pending,
    /// A node is assigned; its agent has not started the VM yet.
    Scheduled,
    /// The agent is building the rootfs and booting.
    Starting,
    /// The guest runs (the guest agent answered).
    Running,
    /// Being deleted; the agent is cleaning up.
    Terminating,
    /// An ephemeral workload exited 0.
    Succeeded,
    /// The workload failed or the VM could not run.
    Failed,
    /// Restart attempts are used up; waiting for a manual reset.
    RetryExhausted,
    /// Writing a snapshot before stopping.
    Suspending,
    /// Stopped, with its memory in a snapshot on the node.
    Suspended,
    /// Restoring from the suspend snapshot.
    Resuming,
}

impl VmPhase {
    /// Every phase, in declaration order (derived: a new phase is in it without anyone having
    /// to remember it).
    pub const ALL: &'static [VmPhase] = <Self as strum::VariantArray>::VARIANTS;

    /// Phases from which the operator never schedules the VM again on its own.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::RetryExhausted)
    }

    /// The string written to the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Scheduled => "Scheduled",
            Self::Starting => "Starting",
            Self::Running => "Running",
            Self::Terminating => "Terminating",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::RetryExhausted => "RetryExhausted",
            Self::Suspending => "Suspending",
            Self::Suspended => "Suspended",
            Self::Resuming => "Resuming",
        }
    }
}

impl std::fmt::Display for VmPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the operator and the agent know about a VM.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMStatus {
    /// Where the VM is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VmPhase>,
    /// The node the VM is assigned to (mirrors spec.nodeName for the printer column).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The guest's IPv4 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// PID of the VMM process on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "runtimePID")]
    pub runtime_pid: Option<i64>,
    /// When a node was first assigned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_at: Option<Time>,
    /// When the VM was first seen Running (expiry counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_at: Option<Time>,
    /// When the VM will be deleted by expireAfter (runningAt, else finishedAt, + expireAfter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// When the agent began starting it (stuck-start timeout counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// Snapshot directory of a suspended VM on its node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend_snapshot_path: Option<String>,
    /// When the VM was suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended_at: Option<Time>,
    /// Last traffic seen before an idle suspend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_activity_time: Option<Time>,
    /// Restarts so far under the restart policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_count: Option<i32>,
    /// Earliest time of the next restart attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_after: Option<Time>,
    /// When the restart policy ran out of attempts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exhausted_at: Option<Time>,
    /// When the VM ended: the workload exited or the VM failed (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// The VMM the node agent runs the VM with, `qemu` or `firecracker` (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Exit code of the workload, once it exited (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Cilium endpoint of the VM, when enrolled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "ciliumEndpointID")]
    pub cilium_endpoint_id: Option<i64>,
    /// The spec generation this status describes (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Scheduled, Ready, NodeHealthy and probe conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]), transform = crate::schema::conditions)]
    pub conditions: Vec<Condition>,
    /// What the operator booked when it placed the VM: the node agent boots exactly this
    /// (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booking: Option<Booking>,
    /// How a VM with `spec.warmPoolRef` got going: the member it took over, or why it started
    /// cold (imp extension; written by the operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_claim: Option<WarmClaim>,
    /// A move of this VM to another node in flight (an ImpVMMigration; imp extension, written
    /// by the operator, and by the source's agent for `phase: Sent`). docs/migration.md.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "move")]
    pub moving: Option<VmMove>,
}

/// A move of a VM from its node (`source`) to `target`, as the operator asked it and the
/// agents carry it out. The VM stays the same object: `spec.nodeName` changes once, at the
/// commit, which the operator writes when the source's agent says `Sent`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VmMove {
    /// The ImpVMMigration (same namespace).
    pub migration: String,
    /// Its uid.
    #[serde(rename = "migrationUID")]
    pub migration_uid: String,
    /// The node the VM leaves.
    pub source: String,
    /// The node the VM goes to.
    pub target: String,
    /// `cold` (the only mode built: suspended, its files copied, resumed on the target).
    pub mode: String,
    /// Where the move is.
    pub phase: MovePhase,
    /// A one-time value the target's agent accepts the VM's files with, beside the source
    /// node's pinned certificate (not a secret: it ties a transfer to this move).
    pub token: String,
    /// When the operator started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// The target's agent API (`host:port`), as the target's Node published it: the source's
    /// agent sends the VM's files there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_endpoint: Option<String>,
    /// The SHA-256 of the target agent's certificate, as its Node published it: the source's
    /// agent accepts no other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_cert_sha256: Option<String>,
    /// The SHA-256 of the source agent's certificate, as its Node published it: the target's
    /// agent takes the files from no other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_cert_sha256: Option<String>,
    /// Bytes the source's agent sent (memory, device state, disk, initramfs; holes not sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_sent: Option<i64>,
    /// When the source's agent stopped the VM's vCPUs for the move (downtime starts), in
    /// milliseconds since the Unix epoch (a `Time` holds whole seconds only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_unix_ms: Option<i64>,
    /// Why the source's agent could not send, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// The steps of a move, in the VM's status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MovePhase {
    /// The source's agent suspends the VM and sends its files to the target's agent.
    #[default]
    Transferring,
    /// The target's agent holds the VM's files, checked: the operator may commit.
    Sent,
    /// The source's agent could not send (`failure` says why): the operator aborts.
    SendFailed,
    /// `spec.nodeName` names the target: the target resumes the VM, the source removes it.
    Committed,
    /// Given up before the commit: the source resumes the VM; the move is then cleared.
    Aborting,
}

/// A claim of a warm pool's member: which member became this VM, or why none did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmClaim {
    /// The pool.
    pub pool: String,
    /// The member taken over (its name), unless the VM started cold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
    /// The member's uid: the node agent finds the running VM by it.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "memberUID")]
    pub member_uid: Option<String>,
    /// The snapshot execution the member (or the cold start) restored from, if the pool had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_snapshot: Option<String>,
    /// Why the VM started cold (no ready member, no base), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold: Option<String>,
    /// When the claim was decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Time>,
}

/// What the operator placed a VM with and booked on its node: its ImpVMClass and its spec with
/// the template merged, as they were at placement. The node agent boots exactly this, so
/// editing or deleting the class or the template afterwards changes nothing for a placed VM,
/// and the scheduler's books stay true. It lives in the status, which only the operator and the
/// agents may write (a user who may edit the VM may not resize it past the scheduler). A VM
/// placed anew (a restart that clears its node, `imp/reset-retries`) is booked anew.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Booking {
    /// The ImpVMClass's spec at placement (vCPU, memory, disk, runtime, probes…).
    #[schemars(transform = crate::schema::opaque_object)]
    pub class: crate::class::ImpVMClassSpec,
    /// The VM's spec with its template applied, at placement, and the changes of the VM's own
    /// spec rolled in since (a change of image, env, envFrom or userData restarts the VM).
    #[schemars(transform = crate::schema::opaque_object)]
    pub spec: ImpVMSpec,
    /// How many restarting changes of the VM's own spec were rolled into the booking; the node
    /// agent boots the VM again when it changes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revision: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

impl ImpVMStatus {
    /// Whether the operator takes the VM off its node (`DisruptionTarget=True`: evicted for a
    /// `NoExecute` taint, or its class or template changed): its node's agent stops and removes
    /// it, then clears `spec.nodeName`, and only then is it placed anew.
    pub fn leaving_node(&self) -> bool {
        crate::conditions::is_true(
            &self.conditions,
            crate::conditions::ConditionType::DisruptionTarget,
        )
    }
}

impl Booking {
    /// The vCPU and memory it books on the node.
    pub fn size(&self) -> crate::shared::PlacedSize {
        crate::shared::PlacedSize {
            vcpu: i64::from(self.class.vcpu),
            memory_mib: i64::from(self.class.memory_mib),
        }
    }
}
