//! The JSON merge patch that turns one status into another, field by top-level field: what
//! changed, and `null` for what went. Every controller writes its status this way, so a write
//! carries only its own changes (and, with a resourceVersion, fails on a concurrent one).

use serde::Serialize;
use serde_json::Value;

/// The merge patch from `old` to `new` (top-level fields only), or `None` when they are equal.
pub fn diff<T: Serialize>(old: &T, new: &T) -> Option<Value> {
    let old = serde_json::to_value(old).unwrap_or(Value::Null);
    let new = serde_json::to_value(new).unwrap_or(Value::Null);
    let mut out = serde_json::Map::new();
    if let (Value::Object(o), Value::Object(n)) = (&old, &new) {
        for (k, v) in n {
            if o.get(k) != Some(v) {
                out.insert(k.clone(), v.clone());
            }
        }
        for k in o.keys().filter(|k| !n.contains_key(*k)) {
            out.insert(k.clone(), Value::Null);
        }
    }
    (!out.is_empty()).then_some(Value::Object(out))
}

/// The merge patch that makes `vm`'s status `status`: the fields that differ, with
/// `observedGeneration` set to the `metadata.generation` of the VM `status` was decided on
/// (operator and agent both write it); `None` when there is nothing to write.
pub fn vm_status(vm: &crate::vm::ImpVM, status: &crate::vm::ImpVMStatus) -> Option<Value> {
    let mut status = status.clone();
    if vm.metadata.generation.is_some() {
        status.observed_generation = vm.metadata.generation;
    }
    diff(&vm.status.clone().unwrap_or_default(), &status)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::vm::{ImpVM, ImpVMSpec, ImpVMStatus, VmPhase};
    use serde_json::json;

    fn vm(generation: i64, observed: Option<i64>) -> ImpVM {
        let mut vm = ImpVM::new("v", ImpVMSpec::default());
        vm.metadata.generation = Some(generation);
        vm.status = Some(ImpVMStatus {
            phase: Some(VmPhase::Running),
            observed_generation: observed,
            ..Default::default()
        });
        vm
    }

    #[test]
    fn a_vm_status_write_records_the_generation_it_acted_on() {
        use super::vm_status;
        // A write of a changed status carries the generation of the spec it was decided on.
        let v = vm(3, Some(1));
        let mut status = v.status.clone().unwrap();
        status.phase = Some(VmPhase::Failed);
        assert_eq!(
            vm_status(&v, &status),
            Some(json!({"phase": "Failed", "observedGeneration": 3}))
        );
        // An edited spec alone is worth a write: the status now speaks for generation 3.
        assert_eq!(
            vm_status(&v, &v.status.clone().unwrap()),
            Some(json!({"observedGeneration": 3}))
        );
        // Nothing new: no write.
        let seen = vm(3, Some(3));
        assert_eq!(vm_status(&seen, &seen.status.clone().unwrap()), None);
        // A status decided with an older generation in hand does not keep it.
        let mut stale = seen.status.clone().unwrap();
        stale.observed_generation = Some(2);
        assert_eq!(vm_status(&seen, &stale), None);
    }

    #[test]
    fn only_changed_fields_and_nulls_for_removed_ones() {
        let old = json!({"phase": "Running", "ip": "10.0.0.2", "node": "a"});
        let new = json!({"phase": "Failed", "node": "a"});
        assert_eq!(
            super::diff(&old, &new),
            Some(json!({"phase": "Failed", "ip": null}))
        );
        assert_eq!(super::diff(&new, &new), None);
    }
}
