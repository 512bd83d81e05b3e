//! The `imp.dev/v1alpha1` API: the ten custom resource kinds, their defaults, the admission
//! rules that CEL cannot express, condition helpers and CRD generation.
//!
//! Manifest-compatible with the Go project of the same name: its YAML deserialises into these
//! types unchanged. This crate does no I/O and knows nothing of controllers or nodes.

// kube-derive printcolumn(...) attributes repeat keys by design; clippy mistakes them for duplicates.
#![allow(clippy::duplicated_attributes)]

pub mod class;
pub mod cluster;
pub mod conditions;
pub mod crd;
pub mod duration;
pub mod network;
pub mod pools;
pub mod resolve;
pub mod shared;
pub mod snapshot;
pub mod template;
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
