//! The `imp.dev/v1alpha1` API: the ten custom resource kinds, their defaults, the admission
//! rules that CEL cannot express, condition helpers and CRD generation.
//!
//! Manifest-compatible with the Go project of the same name: its YAML deserialises into these
//! types unchanged. This crate does no I/O and knows nothing of controllers or nodes.

// kube-derive printcolumn(...) attributes repeat keys by design; clippy mistakes them for duplicates.
#![allow(clippy::duplicated_attributes)]

/// Lets a kind's `spec` be left out of a manifest, as the Go project's schemas allow: an absent
/// or null `spec` deserialises as the spec type's `Default`. The spec struct carries
/// `#[serde(remote = "Self")]`, which turns its derived serde code into inherent functions that
/// these trait impls wrap.
macro_rules! spec_may_be_absent {
    ($spec:ty) => {
        impl serde::Serialize for $spec {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                <$spec>::serialize(self, s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $spec {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Present($spec);
                impl<'de> serde::Deserialize<'de> for Present {
                    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                        <$spec>::deserialize(d).map(Present)
                    }
                }
                Ok(Option::<Present>::deserialize(d)?.map_or_else(Default::default, |p| p.0))
            }
        }
    };
}

pub mod chain;
pub mod class;
pub mod cluster;
pub mod conditions;
pub mod crd;
pub mod duration;
pub mod inherited;
pub mod inputs;
pub mod ipv4;
pub mod network;
pub mod pools;
pub mod refusal;
pub mod resolve;
pub mod schema;
pub mod shared;
pub mod snapshot;
pub mod status_patch;
pub mod template;
pub mod unsupported;
pub mod validation;
pub mod vm;

pub use class::{ImpVMClass, ImpVMClassSpec};
pub use cluster::{
    ClusterImpConfig, ClusterImpConfigSpec, ClusterImpNodeProfile, ClusterImpNodeProfileSpec,
};
pub use network::{ImpNetwork, ImpNetworkSpec, ImpNetworkStatus};
pub use pools::{ImpVMRunnerPool, ImpVMRunnerPoolSpec, ImpWarmPool, ImpWarmPoolSpec};
pub use snapshot::{ImpVMMigration, ImpVMMigrationSpec, ImpVMSnapshot, ImpVMSnapshotSpec};
pub use template::{ImpVMTemplate, ImpVMTemplateSpec};
pub use vm::{ImpVM, ImpVMSpec, ImpVMStatus, VmPhase};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_absent_or_null_spec_is_the_default_and_a_present_one_is_read() {
        let bare = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ClusterImpConfig",
                          "metadata": {"name": "cluster"}});
        let cfg: ClusterImpConfig = serde_json::from_value(bare).unwrap();
        assert_eq!(cfg.spec, ClusterImpConfigSpec::default());
        let null = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                          "metadata": {"name": "c"}, "spec": null});
        let class: ImpVMClass = serde_json::from_value(null).unwrap();
        assert_eq!(class.spec, ImpVMClassSpec::default());
        let full = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                          "metadata": {"name": "c"},
                          "spec": {"vcpu": 2, "memoryMiB": 512, "diskGiB": 4}});
        let class: ImpVMClass = serde_json::from_value(full).unwrap();
        assert_eq!(class.spec.vcpu, 2);
        assert_eq!(
            serde_json::to_value(&class).unwrap()["spec"]["memoryMiB"],
            512
        );
        let wrong = json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                           "metadata": {"name": "c"}, "spec": {"vcpu": "two"}});
        assert!(serde_json::from_value::<ImpVMClass>(wrong).is_err());
    }
}
