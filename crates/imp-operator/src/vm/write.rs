//! The controller's writes: merge patches preconditioned on the resourceVersion they were
//! computed from, and Events.

use imp_api::shared::{ANNOTATION_PLACED_RESOURCES, PlacedSize};
use imp_api::vm::{ImpVM, ImpVMStatus};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use super::{Context, Error, FIELD_MANAGER, FINALIZER, key};
use crate::metrics::Write;
use crate::placement::ledger::Booking;

/// The resource label of the controller's writes in `imp_operator_conflicts_total`.
const CONFLICT_RESOURCE: &str = "impvm";

pub(super) fn kube_err(doing: &'static str, vm: &ImpVM) -> impl FnOnce(kube::Error) -> Error {
    let vm = key(vm);
    move |source| Error::Kube { doing, vm, source }
}

pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..Default::default()
    }
}

impl Context {
    pub(super) fn api(&self, vm: &ImpVM) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &vm.namespace().unwrap_or_default())
    }

    pub(super) async fn event(&self, vm: &ImpVM, type_: EventType, reason: &str, note: String) {
        self.event_with(vm, type_, reason, reason, note).await;
    }

    /// An Event whose action is not its reason ([`super::conditions::Note::action`]).
    pub(super) async fn event_with(
        &self,
        vm: &ImpVM,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: action.to_owned(),
            secondary: None,
        };
        crate::api_call::publish(&self.recorder, &ev, &vm.object_ref(&())).await;
    }

    /// Merge-patches the main resource with a resourceVersion precondition.
    pub(super) async fn patch_main(
        &self,
        vm: &ImpVM,
        mut body: Value,
        doing: &'static str,
    ) -> Result<ImpVM, Error> {
        body["metadata"]["resourceVersion"] = json!(vm.resource_version());
        let out = self
            .api(vm)
            .patch(&vm.name_any(), &patch_params(), &Patch::Merge(&body))
            .await;
        self.note_write(vm, Write::Main, &out);
        out.map_err(kube_err(doing, vm))
    }

    /// A write that succeeded, or was refused with 409, shows the version it was based on is
    /// outdated; a 409 is counted in `imp_operator_conflicts_total`.
    pub(super) fn note_write(&self, vm: &ImpVM, write: Write, out: &Result<ImpVM, kube::Error>) {
        let conflict = matches!(out, Err(kube::Error::Api(s)) if s.code == 409);
        if conflict && let Some(m) = &self.metrics {
            m.conflict(CONFLICT_RESOURCE, write);
        }
        let outdated = out.is_ok() || conflict;
        if outdated {
            self.ledger()
                .outdated(&key(vm), vm.metadata.resource_version.as_deref());
        }
    }

    /// Writes `status` (the whole desired status, decided on `vm`) as a diff against the VM's
    /// current status ([`imp_api::status_patch::vm_status`]).
    pub(super) async fn patch_status(
        &self,
        vm: &ImpVM,
        status: &ImpVMStatus,
        doing: &'static str,
    ) -> Result<ImpVM, Error> {
        let Some(diff) = imp_api::status_patch::vm_status(vm, status) else {
            return Ok(vm.clone());
        };
        let body = json!({
            "metadata": {"resourceVersion": vm.resource_version()},
            "status": diff,
        });
        let out = self
            .api(vm)
            .patch_status(&vm.name_any(), &patch_params(), &Patch::Merge(&body))
            .await;
        self.note_write(vm, Write::Status, &out);
        out.map_err(kube_err(doing, vm))
    }

    /// Writes spec.nodeName and books the new value in the ledger until the cache shows it.
    ///
    /// The booking follows the write, so the VM still counts on its old node while the write is
    /// in flight (over-counting briefly is the safe side). Placement books before the write
    /// instead, under the scheduling lock: see [`Self::write_placement`].
    pub(super) async fn set_node_name(
        &self,
        vm: &ImpVM,
        node: Option<&str>,
    ) -> Result<ImpVM, Error> {
        let out = self
            .patch_main(
                vm,
                json!({"spec": {"nodeName": node}}),
                "writing spec.nodeName of",
            )
            .await?;
        let k = key(vm);
        let mut ledger = self.ledger();
        let _booked = ledger.book(&k, node, None);
        ledger.confirm(&k);
        Ok(out)
    }

    /// Writes a placement booked under the scheduling lock: spec.nodeName, the finalizer and
    /// the booked size in one patch, so they are durable together. A failed write gives the
    /// booking back.
    pub(super) async fn write_placement(
        &self,
        vm: &ImpVM,
        node: &str,
        size: PlacedSize,
        booking: Booking,
    ) -> Result<ImpVM, Error> {
        let mut fins = vm.finalizers().to_vec();
        if !fins.iter().any(|f| f == FINALIZER) {
            fins.push(FINALIZER.to_owned());
        }
        let mut anns = serde_json::Map::new();
        anns.insert(
            ANNOTATION_PLACED_RESOURCES.to_owned(),
            Value::String(size.to_annotation()),
        );
        let body = json!({
            "metadata": {"finalizers": fins, "annotations": anns},
            "spec": {"nodeName": node},
        });
        let out = self.patch_main(vm, body, "writing the placement of").await;
        let k = key(vm);
        match out {
            Ok(placed) => {
                self.ledger().confirm(&k);
                Ok(placed)
            }
            Err(e) => {
                self.ledger().abort(&k, booking);
                Err(e)
            }
        }
    }
}
