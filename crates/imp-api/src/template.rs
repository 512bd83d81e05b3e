//! ImpVMTemplate: a reusable VM shape that VMs and pools refer to.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::inherited::Inherited;
use crate::shared::{ClusterObjectRef, LocalObjectRef};

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
    /// Image, probes, guest agent, restart policy, network group, layers and expiry of VMs made
    /// from this template, unless they set their own.
    #[serde(flatten)]
    pub inherited: Inherited,
    /// Node labels VMs from this template require (imp extension).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations VMs from this template get (imp extension; unioned with class and VM), for
    /// placement and `NoExecute` eviction (with `tolerationSeconds`, as on the VM).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

spec_may_be_absent!(ImpVMTemplateSpec);
