//! ImpVMSnapshot (a schedule/config parent and its executions) and ImpVMMigration.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::CoreLocalObjectRef;

/// A snapshot of a VM, once or on a schedule.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMSnapshot",
    plural = "impvmsnapshots",
    singular = "impvmsnapshot",
    shortname = "impsnap",
    category = "imp",
    namespaced,
    status = "ImpVMSnapshotStatus",
    printcolumn(name = "Source", type_ = "string", json_path = ".spec.sourceVMName"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpVMSnapshotSpec {
    /// VM to snapshot.
    #[serde(rename = "sourceVMName")]
    pub source_vm_name: String,
    /// Namespace of that VM: empty or the snapshot's own (imp refuses any other).
    #[serde(rename = "sourceVMNamespace")]
    pub source_vm_namespace: String,
    /// Cron schedule; absent means one execution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// Executions to keep.
    #[serde(default = "default_retention")]
    #[schemars(range(min = 1, max = 10))]
    pub retention: i32,
    /// Where snapshot files go; fixed at creation.
    pub storage: SnapshotStorage,
    /// Execution elected as base for warm pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_snapshot: Option<String>,
}

spec_may_be_absent!(ImpVMSnapshotSpec);

fn default_retention() -> i32 {
    3
}

/// Snapshot storage.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.type != 'oci-registry' || has(self.ociRegistry)").message("storage.ociRegistry is required when storage.type is oci-registry"),
    validation = kube::core::Rule::new("self == oldSelf").message("spec.storage cannot change after creation; create a new ImpVMSnapshot for another storage"),
)]
// The second rule is a transition rule (checked on updates only): the node agent removes the
// files where it wrote them, so the place may not move under it (the webhook's
// `validation::snapshot_update` says the same).
pub struct SnapshotStorage {
    /// Storage kind.
    #[serde(rename = "type")]
    pub type_: StorageType,
    /// Node-local directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_local: Option<NodeLocalStorage>,
    /// OCI registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_registry: Option<OciRegistryStorage>,
}

/// Storage kinds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum StorageType {
    /// A directory on the VM's node.
    #[default]
    #[serde(rename = "node-local")]
    NodeLocal,
    /// Pushed to an OCI registry.
    #[serde(rename = "oci-registry")]
    OciRegistry,
}

/// Node-local storage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeLocalStorage {
    /// Directory on the node.
    #[serde(default = "default_snapshot_path")]
    pub path: String,
}

fn default_snapshot_path() -> String {
    "/var/lib/imp/snapshots".to_owned()
}

/// Registry storage.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciRegistryStorage {
    /// Repository to push to.
    pub repository: String,
    /// Secret with registry credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_secret_ref: Option<CoreLocalObjectRef>,
}

/// Phase of a snapshot parent or execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SnapshotPhase {
    /// Waiting.
    Pending,
    /// Being taken.
    Running,
    /// Taken.
    Succeeded,
    /// Could not be taken.
    Failed,
}

/// Snapshot status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMSnapshotStatus {
    /// Phase (a free string in the Go schema, so no enum here either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub phase: Option<SnapshotPhase>,
    /// Digest of the pushed OCI artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Directory of the node-local files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_path: Option<String>,
    /// When it completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// Next scheduled execution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_scheduled_at: Option<Time>,
    /// Latest execution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_execution_ref: Option<CoreLocalObjectRef>,
    /// Elected base execution, once Succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_snapshot: Option<String>,
    /// When the execution ended, successfully or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminated_at: Option<Time>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]), transform = crate::schema::conditions)]
    pub conditions: Vec<Condition>,
}

/// Moving a VM to another node through a snapshot.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMMigration",
    plural = "impvmmigrations",
    singular = "impvmmigration",
    shortname = "impmig",
    category = "imp",
    namespaced,
    status = "ImpVMMigrationStatus",
    printcolumn(name = "Source", type_ = "string", json_path = ".spec.sourceVMName"),
    printcolumn(name = "Target", type_ = "string", json_path = ".spec.targetNode"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".status.mode"),
    printcolumn(name = "Downtime", type_ = "integer", json_path = ".status.downtimeMs"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpVMMigrationSpec {
    /// VM to move.
    #[serde(rename = "sourceVMName")]
    pub source_vm_name: String,
    /// Namespace of that VM: empty or the migration's own (imp refuses any other).
    #[serde(rename = "sourceVMNamespace")]
    pub source_vm_namespace: String,
    /// Node to move to; absent means any CPU-compatible node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node: Option<String>,
}

spec_may_be_absent!(ImpVMMigrationSpec);

/// Phase of a migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MigrationPhase {
    /// Choosing a target.
    Pending,
    /// Snapshotting the source (Go's phase; imp's moves say `Transferring`).
    Snapshotting,
    /// The source's agent suspends the VM and sends its state and disk to the target's.
    Transferring,
    /// Restoring on the target (after the commit).
    Restoring,
    /// Done: the VM runs on the target, nothing of it is left on the source.
    Succeeded,
    /// Failed; the message says why (the VM runs where it was).
    Failed,
    /// Deleted before the commit: the VM runs where it was.
    Cancelled,
}

/// Migration status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMMigrationStatus {
    /// Phase (a free string in the Go schema, so no enum here either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub phase: Option<MigrationPhase>,
    /// Human-readable detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Node chosen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected_node: Option<String>,
    /// Snapshot used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_ref: Option<String>,
    /// VM created on the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "targetVMName")]
    pub target_vm_name: Option<String>,
    /// When it completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]), transform = crate::schema::conditions)]
    pub conditions: Vec<Condition>,
    /// The node the VM left (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_node: Option<String>,
    /// `cold` or `live` (imp extension; only `cold` is built).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// The VM's vCPUs stopped on the source to running on the target, in milliseconds (imp
    /// extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_ms: Option<i64>,
    /// Creation of the migration to `Succeeded`, in milliseconds (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<i64>,
    /// Bytes sent from the source's agent to the target's (imp extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_moved: Option<i64>,
}
