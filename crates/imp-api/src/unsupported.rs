//! Values nothing in imp honours yet, refused by the admission webhook so that none is ignored
//! silently (`docs/fields.md` lists every field and what really happens to it).
//!
//! These rules are kept apart from [`crate::validation`]: a value here is well-formed (the Go
//! project accepts it, and so do our CRDs and field rules) but this imp does nothing with it, so
//! the webhook refuses it with a message saying so. Defaults and absent values are always
//! accepted. A rule is removed when its feature lands.

use k8s_openapi::api::core::v1::EnvVar;

use crate::validation::{FieldError, ValidationErrors};
use crate::{ClusterImpConfigSpec, ImpNetworkSpec, ImpVMSpec};

/// What every refusal here says, after the field path.
pub const NOT_SUPPORTED_YET: &str = "is not supported yet";

/// An `env[].valueFrom` source other than a Secret or ConfigMap key.
pub const ENV_SOURCE: &str =
    "is not supported yet: only secretKeyRef and configMapKeyRef are read in valueFrom";
/// ImpNetwork `cilium.*` switched on.
pub const CILIUM_SWITCH: &str = "true is not supported yet: imp does not configure Cilium";
/// ClusterImpConfig `networking.cni.autoDetect: false` or `provider` set.
pub const CNI: &str = "is not supported yet: imp neither detects nor configures the CNI";
/// ClusterImpConfig `networking.cni.natBackend: iptables`.
pub const NAT_IPTABLES: &str = "iptables is not supported yet: node agents write nftables rules";
/// ClusterImpConfig `observability.metrics` other than the defaults.
pub const METRICS: &str = "is not supported yet: the operator and agents serve metrics where their --metrics-addr flags say";
/// ClusterImpConfig `observability.tracing.endpoint` that is not `http://` (OTLP over gRPC,
/// or HTTPS).
pub const TRACING: &str = "is not supported yet unless it is http://host[:port][/path]: imp exports OTLP over HTTP with the JSON encoding (a collector's port 4318), not over gRPC or HTTPS";
/// A kind no controller acts on, after the kind's name.
pub const NO_CONTROLLER: &str =
    "is not supported yet by this imp: no controller acts on it (see docs/fields.md)";

/// Kinds no controller acts on: the webhook refuses creating or changing them.
pub const NO_CONTROLLER_KINDS: [&str; 1] = ["ImpVMRunnerPool"];

/// The refusal of kind `kind` when no controller acts on it, e.g. `ImpWarmPool is not
/// supported yet by this imp: …`.
pub fn kind(kind: &str) -> Option<String> {
    NO_CONTROLLER_KINDS
        .contains(&kind)
        .then(|| format!("{kind} {NO_CONTROLLER}"))
}

/// Values of an ImpVM spec nothing honours.
pub fn vm(spec: &ImpVMSpec) -> Result<(), ValidationErrors> {
    let mut e = Vec::new();
    env(&mut e, &spec.env);
    result(e)
}

/// Values of an ImpNetwork spec nothing honours.
pub fn network(spec: &ImpNetworkSpec) -> Result<(), ValidationErrors> {
    let mut e = Vec::new();
    if let Some(c) = &spec.cilium {
        if c.exclude_from_ipam {
            push(&mut e, "spec.cilium.excludeFromIPAM", CILIUM_SWITCH);
        }
        if c.masquerade_via_cilium {
            push(&mut e, "spec.cilium.masqueradeViaCilium", CILIUM_SWITCH);
        }
    }
    result(e)
}

/// Values of the ClusterImpConfig spec nothing honours.
pub fn cluster_config(spec: &ClusterImpConfigSpec) -> Result<(), ValidationErrors> {
    use crate::cluster::NatBackend;
    let mut e = Vec::new();
    if let Some(cni) = spec.networking.as_ref().and_then(|n| n.cni.as_ref()) {
        if !cni.auto_detect {
            push(&mut e, "spec.networking.cni.autoDetect", CNI);
        }
        if cni.provider.is_some() {
            push(&mut e, "spec.networking.cni.provider", CNI);
        }
        if cni.nat_backend == Some(NatBackend::Iptables) {
            push(&mut e, "spec.networking.cni.natBackend", NAT_IPTABLES);
        }
    }
    let o = spec.observability.as_ref();
    if let Some(m) = o.and_then(|o| o.metrics.as_ref()) {
        if !m.enabled {
            push(&mut e, "spec.observability.metrics.enabled", METRICS);
        }
        if m.port != crate::cluster::DEFAULT_METRICS_PORT {
            push(&mut e, "spec.observability.metrics.port", METRICS);
        }
    }
    if let Some(t) = o.and_then(|o| o.tracing.as_ref())
        && !t.endpoint.is_empty()
        && !t.endpoint.starts_with("http://")
    {
        push(&mut e, "spec.observability.tracing.endpoint", TRACING);
    }
    result(e)
}

fn env(e: &mut Vec<FieldError>, vars: &[EnvVar]) {
    for (i, v) in vars.iter().enumerate() {
        let Some(from) = &v.value_from else { continue };
        for (name, set) in [
            ("fieldRef", from.field_ref.is_some()),
            ("resourceFieldRef", from.resource_field_ref.is_some()),
            ("fileKeyRef", from.file_key_ref.is_some()),
        ] {
            if set {
                push(e, format!("spec.env[{i}].valueFrom.{name}"), ENV_SOURCE);
            }
        }
    }
}

fn push(e: &mut Vec<FieldError>, path: impl Into<String>, message: &str) {
    e.push(FieldError {
        path: path.into(),
        message: message.to_owned(),
    });
}

fn result(e: Vec<FieldError>) -> Result<(), ValidationErrors> {
    if e.is_empty() {
        Ok(())
    } else {
        Err(ValidationErrors(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{
        CniConfig, MetricsConfig, NatBackend, NetworkingConfig, ObservabilityConfig, TracingConfig,
    };
    use crate::inherited::Inherited;
    use crate::network::CiliumNetworkSpec;
    use crate::shared::GuestAgentConfig;
    use k8s_openapi::api::core::v1::{EnvVarSource, ObjectFieldSelector, SecretKeySelector};

    fn msg(r: Result<(), ValidationErrors>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn defaults_and_absent_values_are_accepted() {
        let on = Some(GuestAgentConfig {
            enabled: Some(true),
        });
        assert_eq!(vm(&ImpVMSpec::default()), Ok(()));
        let s = ImpVMSpec {
            inherited: Inherited {
                guest_agent: on.clone(),
                runner_layer: Some(String::new()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(vm(&s), Ok(()));
        let off = ImpVMSpec {
            inherited: Inherited {
                guest_agent: Some(GuestAgentConfig {
                    enabled: Some(false),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(
            vm(&off),
            Ok(()),
            "a VM without its guest agent is supported"
        );
        assert_eq!(network(&ImpNetworkSpec::default()), Ok(()));
        let cfg = ClusterImpConfigSpec {
            networking: Some(NetworkingConfig {
                cni: Some(CniConfig {
                    nat_backend: Some(NatBackend::Nftables),
                    ..Default::default()
                }),
                ipam: None,
            }),
            observability: Some(ObservabilityConfig {
                metrics: Some(MetricsConfig {
                    enabled: true,
                    port: crate::cluster::DEFAULT_METRICS_PORT,
                }),
                tracing: Some(TracingConfig::default()),
            }),
            ..Default::default()
        };
        assert_eq!(cluster_config(&cfg), Ok(()));
        assert_eq!(kind("ImpVM"), None);
    }

    #[test]
    fn env_sources_other_than_secrets_and_config_maps_are_refused() {
        let from = |source: EnvVarSource| EnvVar {
            name: "X".into(),
            value: None,
            value_from: Some(source),
        };
        let v = ImpVMSpec {
            env: vec![
                from(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: "s".into(),
                        key: "k".into(),
                        optional: None,
                    }),
                    ..Default::default()
                }),
                from(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        api_version: None,
                        field_path: "spec.nodeName".into(),
                    }),
                    ..Default::default()
                }),
            ],
            ..Default::default()
        };
        assert_eq!(
            msg(vm(&v)),
            format!("spec.env[1].valueFrom.fieldRef: {ENV_SOURCE}")
        );
    }

    #[test]
    fn cilium_switches_are_refused() {
        let n = ImpNetworkSpec {
            cilium: Some(CiliumNetworkSpec {
                exclude_from_ipam: true,
                masquerade_via_cilium: true,
            }),
            ..Default::default()
        };
        let e = network(&n).unwrap_err();
        let paths: Vec<&str> = e.0.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "spec.cilium.excludeFromIPAM",
                "spec.cilium.masqueradeViaCilium"
            ]
        );
    }

    #[test]
    fn cluster_settings_nothing_reads_are_refused() {
        let cfg = ClusterImpConfigSpec {
            networking: Some(NetworkingConfig {
                cni: Some(CniConfig {
                    auto_detect: false,
                    provider: Some("cilium".into()),
                    nat_backend: Some(NatBackend::Iptables),
                }),
                ipam: None,
            }),
            observability: Some(ObservabilityConfig {
                metrics: Some(MetricsConfig {
                    enabled: false,
                    port: 9443,
                }),
                tracing: Some(TracingConfig {
                    enabled: true,
                    endpoint: "otel:4317".into(),
                }),
            }),
            ..Default::default()
        };
        let e = cluster_config(&cfg).unwrap_err();
        let got: Vec<String> = e.0.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                format!("spec.networking.cni.autoDetect: {CNI}"),
                format!("spec.networking.cni.provider: {CNI}"),
                format!("spec.networking.cni.natBackend: {NAT_IPTABLES}"),
                format!("spec.observability.metrics.enabled: {METRICS}"),
                format!("spec.observability.metrics.port: {METRICS}"),
                format!("spec.observability.tracing.endpoint: {TRACING}"),
            ]
        );
        // OTLP over HTTP is exported (imp_telemetry::trace).
        let http = ClusterImpConfigSpec {
            observability: Some(ObservabilityConfig {
                metrics: None,
                tracing: Some(TracingConfig {
                    enabled: true,
                    endpoint: "http://otel.observability:4318".into(),
                }),
            }),
            ..Default::default()
        };
        assert_eq!(cluster_config(&http), Ok(()));
    }

    #[test]
    fn kinds_without_a_controller_are_refused_by_name() {
        assert_eq!(
            kind("ImpVMRunnerPool").as_deref(),
            Some(
                "ImpVMRunnerPool is not supported yet by this imp: no controller acts on it (see docs/fields.md)"
            )
        );
        // Warm pools and migrations have their controllers.
        assert_eq!(kind("ImpWarmPool"), None);
        assert_eq!(kind("ImpVMMigration"), None);
        for k in NO_CONTROLLER_KINDS {
            assert!(
                kind(k).is_some_and(|m| m.contains(NOT_SUPPORTED_YET)),
                "{k}"
            );
        }
    }
}
