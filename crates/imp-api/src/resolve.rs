//! Resolution of what a VM really asks for: class ← template ← VM.
//!
//! Every inherited field (image, classRef, networkRef, probes, guestAgent, restartPolicy,
//! networkGroup, runner/cilium layers, expireAfter, nodeSelector) is taken from the VM when the VM
//! sets it, else from its template, else from its class (for the fields a class carries).
//! Tolerations are the union of all three. The fields the VM and the template declare alike are
//! one struct, [`Inherited`](crate::inherited::Inherited), filled in one call.
//!
//! # Missing references: `Pending`, not `Failed`
//!
//! A missing ImpVMTemplate, ImpVMClass or ImpNetwork leaves the VM in phase `Pending` with
//! `Ready=False, reason=InvalidSpec`, a message naming the missing object and the fix, and a
//! Warning Event. `Pending` (not `Failed`) because the object may simply not have been applied yet
//! (`kubectl apply -f dir/` creates in any order) and `Failed` is terminal: a VM that had to be
//! recreated after its class arrived a second later would be a trap. The controller watches
//! templates, classes and networks, so creating the missing object recovers the VM at once.

use std::collections::BTreeMap;

use crate::class::ImpVMClassSpec;
use crate::inherited::fill;
use crate::template::ImpVMTemplateSpec;
use crate::vm::ImpVMSpec;
use k8s_openapi::api::core::v1::Toleration;

/// Fills every field the VM leaves unset from its template; the VM's own values win.
///
/// Tolerations are the union (VM's first, then the template's not already present); node
/// selector keys the VM does not set are taken from the template.
pub fn apply_template(vm: &ImpVMSpec, template: &ImpVMTemplateSpec) -> ImpVMSpec {
    let mut out = vm.clone();
    if out.class_ref.is_none() {
        out.class_ref = Some(template.class_ref.clone());
    }
    fill(&mut out.network_ref, &template.network_ref);
    out.inherited.fill_from(&template.inherited);
    merge_selector(&mut out.node_selector, &template.node_selector);
    union_tolerations(&mut out.tolerations, &template.tolerations);
    out
}

/// Fills what the VM (already merged with its template) leaves unset from its class.
///
/// A class carries probes, the guest-agent switch, the restart policy and tolerations.
pub fn apply_class(vm: &ImpVMSpec, class: &ImpVMClassSpec) -> ImpVMSpec {
    let mut out = vm.clone();
    let inherited = &mut out.inherited;
    fill(&mut inherited.probes, &class.probes);
    fill(&mut inherited.guest_agent, &class.guest_agent);
    fill(&mut inherited.restart_policy, &class.restart_policy);
    union_tolerations(&mut out.tolerations, &class.tolerations);
    out
}

/// The full resolution: VM over template (if any) over class.
pub fn resolve(
    vm: &ImpVMSpec,
    template: Option<&ImpVMTemplateSpec>,
    class: &ImpVMClassSpec,
) -> ImpVMSpec {
    let merged = match template {
        Some(t) => apply_template(vm, t),
        None => vm.clone(),
    };
    apply_class(&merged, class)
}

/// `spec` with the cluster's `defaultHttpCheck` (ClusterImpConfig `cluster`) when it is
/// enabled, `spec` is on a network (the check GETs the VM's address) and `spec` has no HTTP
/// check of its own: a VM's (or template's, or class's) check, even a disabled one, wins.
pub fn with_default_http_check(
    mut spec: ImpVMSpec,
    default: Option<&crate::shared::HttpCheckSpec>,
) -> ImpVMSpec {
    let Some(default) = default.filter(|d| d.enabled) else {
        return spec;
    };
    if spec.network_ref.is_none() {
        return spec;
    }
    let probes = spec.inherited.probes.get_or_insert_with(Default::default);
    if probes.http_check.is_none() {
        probes.http_check = Some(default.clone());
    }
    spec
}

/// A reference a VM makes that points at nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MissingRef {
    /// `spec.templateRef` names no ImpVMTemplate in the VM's namespace.
    Template {
        /// Namespace searched.
        namespace: String,
        /// Name referenced.
        name: String,
    },
    /// The class (from the VM or its template) names no ImpVMClass.
    Class {
        /// Name referenced.
        name: String,
        /// Where the reference came from (`spec.classRef` or `template <name>`).
        via: String,
    },
    /// The network (from the VM or its template) names no ImpNetwork in the VM's namespace.
    Network {
        /// Namespace searched.
        namespace: String,
        /// Name referenced.
        name: String,
    },
    /// Neither the VM nor its template names a class.
    NoClass,
    /// The VM's own spec is one the admission webhook refuses ([`crate::validation::vm`],
    /// [`crate::unsupported::vm`]): it reached the API without the webhook (turned off, a
    /// by-hand install) and is never placed.
    Refused {
        /// The webhook's message, naming each field.
        message: String,
    },
}

impl MissingRef {
    /// The condition/Event message: what is missing and how to fix it.
    pub fn message(&self) -> String {
        match self {
            Self::Template { namespace, name } => format!(
                "ImpVMTemplate {namespace}/{name} (spec.templateRef) does not exist: create it or fix spec.templateRef"
            ),
            Self::Class { name, via } => format!(
                "ImpVMClass {name} ({via}) does not exist: create it (kubectl get impvmclasses) or fix the reference"
            ),
            Self::Network { namespace, name } => format!(
                "ImpNetwork {namespace}/{name} (networkRef) does not exist: create it or fix spec.networkRef"
            ),
            Self::NoClass => {
                "neither spec.classRef nor a template names an ImpVMClass: set spec.classRef or spec.templateRef"
                    .to_owned()
            }
            Self::Refused { message } => {
                format!("the spec is refused (as the admission webhook would refuse it): {message}")
            }
        }
    }
}

/// The checks the admission webhook makes of a new ImpVM's own spec, for a controller that
/// must hold them without the webhook: [`MissingRef::Refused`] naming every field refused.
pub fn admissible(spec: &ImpVMSpec) -> Result<(), MissingRef> {
    crate::validation::both(crate::validation::vm(spec), crate::unsupported::vm(spec)).map_err(
        |e| MissingRef::Refused {
            message: e.to_string(),
        },
    )
}

fn merge_selector(target: &mut BTreeMap<String, String>, source: &BTreeMap<String, String>) {
    for (k, v) in source {
        target.entry(k.clone()).or_insert_with(|| v.clone());
    }
}

fn union_tolerations(target: &mut Vec<Toleration>, source: &[Toleration]) {
    for t in source {
        if !target.contains(t) {
            target.push(t.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::duration::GoDuration;
    use crate::inherited::Inherited;
    use crate::shared::{
        ClusterObjectRef, GuestAgentConfig, LocalObjectRef, RestartMode, RestartPolicy,
    };

    #[test]
    fn what_the_webhook_refuses_is_not_admissible_and_names_the_field() {
        let ok: ImpVMSpec = serde_json::from_value(serde_json::json!({
            "classRef": {"name": "c"}, "image": "busybox"
        }))
        .unwrap();
        assert!(admissible(&ok).is_ok());
        let field_ref: ImpVMSpec = serde_json::from_value(serde_json::json!({
            "classRef": {"name": "c"}, "image": "busybox",
            "env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
        }))
        .unwrap();
        let msg = admissible(&field_ref).unwrap_err().message();
        assert!(
            msg.contains("spec.env[0].valueFrom.fieldRef")
                && msg.contains(crate::unsupported::NOT_SUPPORTED_YET),
            "{msg}"
        );
        let mut bad = ok.clone();
        bad.inherited.image = Some("Not An Image".into());
        assert!(
            admissible(&bad)
                .unwrap_err()
                .message()
                .contains("spec.image")
        );
    }

    fn tol(key: &str) -> Toleration {
        Toleration {
            key: Some(key.to_owned()),
            operator: Some("Exists".to_owned()),
            ..Default::default()
        }
    }

    fn template() -> ImpVMTemplateSpec {
        ImpVMTemplateSpec {
            class_ref: ClusterObjectRef {
                name: "small".into(),
            },
            network_ref: Some(LocalObjectRef { name: "net".into() }),
            inherited: Inherited {
                image: Some("tmpl:1".into()),
                guest_agent: Some(GuestAgentConfig {
                    enabled: Some(false),
                }),
                restart_policy: Some(RestartPolicy {
                    mode: RestartMode::Reschedule,
                    ..Default::default()
                }),
                network_group: Some("g1".into()),
                runner_layer: Some("runner:1".into()),
                cilium_layer: Some("cilium:1".into()),
                expire_after: Some(GoDuration::from_static("10m")),
                ..Default::default()
            },
            node_selector: BTreeMap::from([
                ("zone".to_owned(), "a".to_owned()),
                ("disk".to_owned(), "ssd".to_owned()),
            ]),
            tolerations: vec![tol("t1"), tol("shared")],
        }
    }

    #[test]
    fn template_fills_every_unset_field() {
        let vm = ImpVMSpec {
            template_ref: Some(LocalObjectRef { name: "t".into() }),
            ..Default::default()
        };
        let out = apply_template(&vm, &template());
        assert_eq!(out.class_ref.unwrap().name, "small");
        assert_eq!(out.network_ref.unwrap().name, "net");
        assert_eq!(out.inherited.image.as_deref(), Some("tmpl:1"));
        assert_eq!(out.inherited.guest_agent.unwrap().enabled, Some(false));
        assert_eq!(
            out.inherited.restart_policy.unwrap().mode,
            RestartMode::Reschedule
        );
        assert_eq!(out.inherited.network_group.as_deref(), Some("g1"));
        assert_eq!(out.inherited.runner_layer.as_deref(), Some("runner:1"));
        assert_eq!(out.inherited.cilium_layer.as_deref(), Some("cilium:1"));
        assert_eq!(out.inherited.expire_after.unwrap().as_str(), "10m");
        assert_eq!(out.node_selector.len(), 2);
        assert_eq!(out.tolerations, vec![tol("t1"), tol("shared")]);
    }

    #[test]
    fn vm_values_win_and_tolerations_union() {
        let vm = ImpVMSpec {
            template_ref: Some(LocalObjectRef { name: "t".into() }),
            inherited: Inherited {
                image: Some("mine:2".into()),
                expire_after: Some(GoDuration::from_static("0s")),
                ..Default::default()
            },
            network_ref: Some(LocalObjectRef {
                name: "other".into(),
            }),
            node_selector: BTreeMap::from([("zone".to_owned(), "b".to_owned())]),
            tolerations: vec![tol("shared"), tol("v1")],
            ..Default::default()
        };
        let out = apply_template(&vm, &template());
        assert_eq!(out.inherited.image.as_deref(), Some("mine:2"));
        assert_eq!(out.network_ref.unwrap().name, "other");
        assert_eq!(out.inherited.expire_after.unwrap().as_str(), "0s");
        assert_eq!(out.node_selector.get("zone").map(String::as_str), Some("b"));
        assert_eq!(
            out.node_selector.get("disk").map(String::as_str),
            Some("ssd")
        );
        assert_eq!(out.tolerations, vec![tol("shared"), tol("v1"), tol("t1")]);
    }

    #[test]
    fn empty_image_string_counts_as_unset() {
        let vm = ImpVMSpec {
            inherited: Inherited {
                image: Some(String::new()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(
            apply_template(&vm, &template()).inherited.image.as_deref(),
            Some("tmpl:1")
        );
    }

    #[test]
    fn class_is_the_last_fallback() {
        let class = ImpVMClassSpec {
            vcpu: 1,
            memory_mib: 256,
            disk_gib: 1,
            guest_agent: Some(GuestAgentConfig {
                enabled: Some(true),
            }),
            restart_policy: Some(RestartPolicy::default()),
            tolerations: vec![tol("c1"), tol("t1")],
            ..Default::default()
        };
        let vm = ImpVMSpec {
            template_ref: Some(LocalObjectRef { name: "t".into() }),
            ..Default::default()
        };
        let out = resolve(&vm, Some(&template()), &class);
        // template beats class
        assert_eq!(out.inherited.guest_agent.unwrap().enabled, Some(false));
        assert_eq!(
            out.inherited.restart_policy.unwrap().mode,
            RestartMode::Reschedule
        );
        assert_eq!(out.tolerations, vec![tol("t1"), tol("shared"), tol("c1")]);
        // class fills when neither sets it
        let bare = ImpVMSpec {
            class_ref: Some(ClusterObjectRef {
                name: "small".into(),
            }),
            inherited: Inherited {
                image: Some("x".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let out = resolve(&bare, None, &class);
        assert_eq!(out.inherited.guest_agent.unwrap().enabled, Some(true));
        assert_eq!(
            out.inherited.restart_policy.unwrap().mode,
            RestartMode::InPlace
        );
    }

    #[test]
    fn missing_ref_messages_name_object_and_fix() {
        let m = MissingRef::Class {
            name: "huge".into(),
            via: "spec.classRef".into(),
        }
        .message();
        assert!(
            m.contains("ImpVMClass huge") && m.contains("create it"),
            "{m}"
        );
        let m = MissingRef::Template {
            namespace: "ns".into(),
            name: "t".into(),
        }
        .message();
        assert!(m.contains("ImpVMTemplate ns/t") && m.contains("spec.templateRef"));
        let m = MissingRef::Network {
            namespace: "ns".into(),
            name: "n".into(),
        }
        .message();
        assert!(m.contains("ImpNetwork ns/n"));
    }

    #[test]
    fn the_cluster_http_check_fills_in_for_networked_vms_without_one() {
        use crate::shared::HttpCheckSpec;
        let default: HttpCheckSpec =
            serde_json::from_value(serde_json::json!({"enabled": true, "port": 8080})).unwrap();
        let on_net: ImpVMSpec =
            serde_json::from_value(serde_json::json!({"networkRef": {"name": "n"}})).unwrap();
        let got = with_default_http_check(on_net.clone(), Some(&default));
        assert_eq!(
            got.inherited.probes.unwrap().http_check,
            Some(default.clone())
        );
        // A VM's own check wins, even disabled (that is how a VM opts out).
        let mut own = on_net.clone();
        own.inherited.probes =
            serde_json::from_value(serde_json::json!({"httpCheck": {"enabled": false}})).unwrap();
        let got = with_default_http_check(own.clone(), Some(&default));
        assert_eq!(got, own);
        // No network, a disabled default, no default: unchanged.
        let off_net = ImpVMSpec::default();
        assert_eq!(
            with_default_http_check(off_net.clone(), Some(&default)),
            off_net
        );
        let mut disabled = default.clone();
        disabled.enabled = false;
        assert_eq!(
            with_default_http_check(on_net.clone(), Some(&disabled)),
            on_net
        );
        assert_eq!(with_default_http_check(on_net.clone(), None), on_net);
    }
}
