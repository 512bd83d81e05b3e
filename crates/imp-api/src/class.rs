//! ImpVMClass: a machine size (vCPU, memory, disk) and the defaults VMs of that size inherit.

use k8s_openapi::api::core::v1::Toleration;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::shared::{Arch, GuestAgentConfig, ProbeSpec, RestartPolicy, VmRuntime};

/// The least memory a VM may have, in MiB: below it the guest kernel and init do not fit.
/// Checked once here (admission, the agent's boot and `imp run` all use it).
pub const MIN_MEMORY_MIB: i32 = 128;

/// A machine class, cluster-scoped so every namespace can use it.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMClass",
    plural = "impvmclasses",
    singular = "impvmclass",
    shortname = "impcls",
    category = "imp",
    printcolumn(name = "VCPU", type_ = "integer", json_path = ".spec.vcpu"),
    printcolumn(name = "Memory", type_ = "integer", json_path = ".spec.memoryMiB"),
    printcolumn(name = "Disk", type_ = "integer", json_path = ".spec.diskGiB"),
    printcolumn(name = "Arch", type_ = "string", json_path = ".spec.arch"),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpVMClassSpec {
    /// Virtual CPUs per VM.
    #[schemars(range(min = 1))]
    pub vcpu: i32,
    /// Guest memory per VM in MiB.
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 128))]
    pub memory_mib: i32,
    /// Size of each VM's own writable root disk in GiB.
    #[serde(rename = "diskGiB")]
    #[schemars(range(min = 1))]
    pub disk_gib: i32,
    /// Architecture the class is for: the scheduler places its VMs only on nodes whose label
    /// kubernetes.io/arch (set by kubelet) has this value, and refuses nodes without the label;
    /// multi means any node.
    #[serde(default)]
    pub arch: Arch,
    /// VMM to run these VMs with (imp extension); where they may be placed is said on
    /// [`VmRuntime`], whose description the CRD shows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<VmRuntime>,
    /// Default probes for VMs of this class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probes: Option<ProbeSpec>,
    /// Guest-agent switch VMs of this class inherit (see the ImpVM's `guestAgent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_agent: Option<GuestAgentConfig>,
    /// Restart policy of persistent VMs of this class, unless they or their template set one.
    /// When none does, a persistent VM restarts in place after 10s, with the delay doubling up
    /// to 5m, at most 5 attempts, then stays Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Tolerations every VM of this class gets, for placement and `NoExecute` eviction (with
    /// `tolerationSeconds`, as on the VM).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

spec_may_be_absent!(ImpVMClassSpec);
