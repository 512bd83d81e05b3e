//! The operator's span of a VM's trace ([`imp_telemetry::trace`]): `schedule` (created → placed,
//! under the VM's root span, which the agent that reports it Running exports), exported when
//! ClusterImpConfig `observability.tracing` is enabled with an endpoint.

use std::time::SystemTime;

use imp_api::cluster::CLUSTER_CONFIG_NAME;
use imp_api::vm::ImpVM;
use imp_telemetry::trace::{Endpoint, Span, span_id, spawn_export, trace_id};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::Context;

/// The `service.name` of the operator's spans.
pub const SERVICE: &str = "imp-operator";

fn system_time(t: Timestamp) -> SystemTime {
    SystemTime::from(t)
}

/// The attributes every span of `vm` carries.
fn attributes(vm: &ImpVM) -> Vec<(&'static str, String)> {
    vec![
        ("k8s.namespace.name", vm.namespace().unwrap_or_default()),
        ("imp.vm", vm.name_any()),
    ]
}

/// The `schedule` span of `vm`: from its creation to its placement on `node` at `now`.
pub(super) fn schedule_span(vm: &ImpVM, node: &str, now: Timestamp) -> Option<Span> {
    let uid = vm.uid()?;
    let created = vm.metadata.creation_timestamp.as_ref()?.0;
    let mut attributes = attributes(vm);
    attributes.push(("k8s.node.name", node.to_owned()));
    Some(Span {
        trace: trace_id(&uid),
        id: span_id(&uid, "schedule"),
        parent: Some(span_id(&uid, "vm")),
        name: "schedule".to_owned(),
        start: system_time(created),
        end: system_time(now),
        attributes,
    })
}

impl Context {
    /// Where spans go: ClusterImpConfig `observability.tracing`, when enabled with a usable
    /// endpoint (admission refuses the others).
    pub(super) fn trace_endpoint(&self) -> Option<Endpoint> {
        let config = self.configs.get(&ObjectRef::new(CLUSTER_CONFIG_NAME))?;
        let tracing = config.spec.observability.as_ref()?.tracing.as_ref()?;
        if !tracing.enabled {
            return None;
        }
        Endpoint::parse(&tracing.endpoint)
            .inspect_err(|e| tracing::warn!(error = %e, "ClusterImpConfig tracing endpoint"))
            .ok()
    }

    /// Exports `span`, when tracing is on.
    pub(super) fn trace(&self, span: Option<Span>) {
        if let (Some(endpoint), Some(span)) = (self.trace_endpoint(), span) {
            spawn_export(endpoint, SERVICE, vec![span]);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::vm::ImpVMSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn the_schedule_span_hangs_under_the_vms_root() {
        let mut vm = ImpVM::new("web", ImpVMSpec::default());
        vm.metadata.namespace = Some("ns".into());
        assert!(
            schedule_span(&vm, "n1", Timestamp::now()).is_none(),
            "no uid: no trace"
        );
        vm.metadata.uid = Some("06e03d12-0e36-47e2-b9a1-bbdf6e5f8898".into());
        let created = Timestamp::from_second(1_800_000_000).unwrap();
        vm.metadata.creation_timestamp = Some(Time(created));
        let placed = Timestamp::from_second(1_800_000_002).unwrap();
        let s = schedule_span(&vm, "n1", placed).unwrap();
        let uid = vm.metadata.uid.clone().unwrap();
        assert_eq!(s.trace, trace_id(&uid));
        assert_eq!(s.parent, Some(span_id(&uid, "vm")));
        assert_eq!(
            s.end.duration_since(s.start).unwrap(),
            std::time::Duration::from_secs(2)
        );
        assert!(s.attributes.contains(&("k8s.node.name", "n1".to_owned())));
    }
}
