//! ImpVMTemplate: a reusable VM shape that VMs and pools refer to.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::GoDuration;
use crate::shared::{ClusterObjectRef, GuestAgentConfig, LocalObjectRef, ProbeSpec, RestartPolicy};

/// A template: class, image, network and policies a VM inherits unless it sets its own.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpVMTemplate",
    plural = "impvmtemplates",
    singular = "impvmtemplate",
    shortname = "impvmt",
    category = "imp",
    namespaced,
    printcolumn(name = "Class", type_ = "string", json_path = ".spec.classRef.name"),
    printcolumn(
        name = "Network",
        type_ = "string",
        json_path = ".spec.networkRef.name"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    derive = "Default",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpVMTemplateSpec {
    /// Machine class of VMs made from this template.
    pub class_ref: ClusterObjectRef,
    /// Network to attach to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_ref: Option<LocalObjectRef>,
    /// OCI image reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probes: Option<ProbeSpec>,
    /// Guest-agent switch VMs inherit (see the ImpVM's `guestAgent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_agent: Option<GuestAgentConfig>,
    /// Restart policy of persistent VMs made from this template, unless they set their own. When
    /// neither they, this template nor the class set one, a persistent VM restarts in place after
    /// 10s, with the delay doubling up to 5m, at most 5 attempts, then stays Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Network group to draw IPs from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_group: Option<String>,
    /// Runner tooling layer VMs inherit (an OCI image applied over theirs; see ImpVM runnerLayer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_layer: Option<String>,
    /// Cilium agent layer VMs inherit (an OCI image applied over the runner layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium_layer: Option<String>,
    /// Expiry of VMs made from it; 0 or at least 60s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::expire_after)]
    pub expire_after: Option<GoDuration>,
    /// Node labels VMs from this template require (imp extension).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations VMs from this template get (imp extension; unioned with class and VM), for
    /// placement and `NoExecute` eviction (with `tolerationSeconds`, as on the VM).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

spec_may_be_absent!(ImpVMTemplateSpec);
