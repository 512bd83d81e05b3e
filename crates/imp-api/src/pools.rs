//! ImpWarmPool (pre-restored VMs ready to hand out) and ImpVMRunnerPool (CI runners on demand).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::GoDuration;

/// A pool of VMs restored from an elected snapshot, kept at `size`.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpWarmPool",
    plural = "impwarmpools",
    singular = "impwarmpool",
    shortname = "impwp",
    category = "imp",
    namespaced,
    status = "ImpWarmPoolStatus",
    printcolumn(name = "Snapshot", type_ = "string", json_path = ".spec.snapshotRef"),
    printcolumn(name = "Size", type_ = "integer", json_path = ".spec.size"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyCount"),
    printcolumn(
        name = "Claimed",
        type_ = "integer",
        json_path = ".status.claimedCount"
    ),
    printcolumn(name = "Base", type_ = "string", json_path = ".status.baseSnapshot"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpWarmPoolSpec {
    /// Parent ImpVMSnapshot whose elected base members restore from.
    pub snapshot_ref: String,
    /// Members to keep.
    #[serde(default = "default_pool_size")]
    pub size: i32,
    /// Template members are made from.
    pub template_name: String,
    /// Expiry of members; 0 or at least 60s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::expire_after)]
    pub expire_after: Option<GoDuration>,
}

spec_may_be_absent!(ImpWarmPoolSpec);

fn default_pool_size() -> i32 {
    2
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// Warm-pool status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpWarmPoolStatus {
    /// Members Running.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub ready_count: i32,
    /// VMs of the namespace that took over one of its members and still exist.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub claimed_count: i32,
    /// The snapshot execution new members restore from: the parent's `status.baseSnapshot`
    /// when the pool was last reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_snapshot: Option<String>,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Members that failed or ended since one last became ready; from the third, new members
    /// are made only after a back-off (10s doubling to 5m) from `lastFailureAt`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_in_a_row: i32,
    /// When the pool last found a member failed or ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_at: Option<Time>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]), transform = crate::schema::conditions)]
    pub conditions: Vec<Condition>,
}

/// CI runner VMs created on demand from a template.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMRunnerPool",
    plural = "impvmrunnerpools",
    singular = "impvmrunnerpool",
    shortname = "imprp",
    category = "imp",
    namespaced,
    status = "ImpVMRunnerPoolStatus",
    printcolumn(name = "Platform", type_ = "string", json_path = ".spec.platform.type"),
    printcolumn(name = "Template", type_ = "string", json_path = ".spec.templateName"),
    printcolumn(name = "Idle", type_ = "integer", json_path = ".status.idleCount"),
    printcolumn(name = "Active", type_ = "integer", json_path = ".status.activeCount"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    derive = "Default",
    derive = "PartialEq"
)]
#[schemars(transform = crate::schema::runner_pool_spec)]
// The scaling rules apply to github-actions pools only, as in the Go project's CRD.
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpVMRunnerPoolSpec {
    /// Template runner VMs are made from.
    pub template_name: String,
    /// CI platform and credentials.
    pub platform: RunnerPlatform,
    /// Runner tooling layer, overriding the template's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_layer: Option<String>,
    /// Labels runners register with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// How demand is detected and how fast to scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<RunnerScaling>,
    /// Deprecated demand detection switches, mapped onto scaling.mode when that is unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_detection: Option<JobDetection>,
    /// Expiry of runner VMs; 0 or at least 60s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::expire_after)]
    pub expire_after: Option<GoDuration>,
}

spec_may_be_absent!(ImpVMRunnerPoolSpec);

/// The CI platform.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerPlatform {
    /// Platform kind.
    #[serde(rename = "type")]
    pub type_: PlatformType,
    /// Server URL for self-hosted platforms.
    #[serde(default, rename = "serverURL", skip_serializing_if = "Option::is_none")]
    pub server_url: Option<String>,
    /// Organisation or repository the runners serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<RunnerScope>,
    /// Name of the Secret holding the registration token or PAT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
}

/// Platform kinds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PlatformType {
    /// GitHub Actions.
    #[default]
    #[serde(rename = "github-actions")]
    GithubActions,
    /// GitLab CI.
    #[serde(rename = "gitlab")]
    Gitlab,
    /// Forgejo Actions.
    #[serde(rename = "forgejo")]
    Forgejo,
}

/// Exactly one of org or repo.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, kube::KubeSchema)]
#[x_kube(validation = kube::core::Rule::new("has(self.org) != has(self.repo)").message("exactly one of scope.org or scope.repo must be set"))]
pub struct RunnerScope {
    /// Organisation (or GitLab group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub org: Option<String>,
    /// Repository as owner/name (or GitLab project).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub repo: Option<String>,
}

/// Scaling settings; unset numbers take the controller's defaults.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerScaling {
    /// Demand source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ScalingMode>,
    /// Idle runners to keep (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub min_idle: Option<i32>,
    /// Upper bound of runners (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_concurrent: Option<i32>,
    /// Runners added per step (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub scale_up_step: Option<i32>,
    /// Seconds between scaling steps (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10))]
    pub cooldown_seconds: Option<i32>,
    /// Webhook demand source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookDetection>,
    /// Polling demand source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub polling: Option<PollingDetection>,
}

/// Demand sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScalingMode {
    /// Platform webhooks.
    Webhook,
    /// Polling the platform's queue.
    Polling,
    /// Both.
    Hybrid,
}

/// Webhook detection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookDetection {
    /// On.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub enabled: bool,
    /// Name of the Secret with the webhook HMAC key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
}

/// Polling detection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PollingDetection {
    /// On.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub enabled: bool,
    /// Seconds between polls.
    #[serde(default = "default_poll_interval")]
    #[schemars(range(min = 10))]
    pub interval_seconds: i32,
}

fn default_poll_interval() -> i32 {
    30
}

/// Deprecated detection switches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct JobDetection {
    /// Webhook detection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookDetection>,
    /// Polling detection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub polling: Option<PollingDetection>,
}

/// Runner-pool status.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpVMRunnerPoolStatus {
    /// Runners waiting for a job.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub idle_count: i32,
    /// Runners not terminal.
    #[serde(default)]
    #[schemars(transform = crate::schema::no_default)]
    pub active_count: i32,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]), transform = crate::schema::conditions)]
    pub conditions: Vec<Condition>,
}
