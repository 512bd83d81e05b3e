//! Placement of an unplaced VM: a node chosen and booked under the scheduling lock,
//! `spec.nodeName` written first, then status.

use std::time::Duration;

use imp_api::conditions::{ConditionReason, ConditionType};
use imp_api::shared::PlacedSize;
use imp_api::vm::{ImpVM, ImpVMStatus, VmPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;

use super::decide::{Note, has_cond, set_cond};
use super::world::{Resolved, live_size};
use super::{Context, Error, key};
use crate::schedule::{self, Request};

/// The status of a VM just placed on `node` (whose node was Ready in the cache it was picked
/// from: say so now, as the next reconcile would, so that one has nothing to write).
pub(super) fn placed_status(
    mut status: ImpVMStatus,
    node: &str,
    booking: imp_api::vm::Booking,
    generation: Option<i64>,
    now: Timestamp,
) -> ImpVMStatus {
    status.phase = Some(VmPhase::Scheduled);
    status.booking = Some(booking);
    status.node_name = Some(node.to_owned());
    status.scheduled_at.get_or_insert(Time(now));
    let conds = [
        (
            ConditionType::Scheduled,
            true,
            ConditionReason::NodeAssigned,
            format!("assigned to node {node}"),
        ),
        (
            ConditionType::Ready,
            false,
            ConditionReason::Waiting,
            format!("waiting for the agent on node {node}"),
        ),
        (
            ConditionType::NodeHealthy,
            true,
            ConditionReason::NodeReady,
            format!("node {node} is Ready"),
        ),
    ];
    for (type_, ok, reason, msg) in conds {
        set_cond(&mut status, type_, ok, reason, msg, generation, now);
    }
    status
}

/// The status of a VM that stays unplaced for `reason`, and the Event to publish when that is
/// news (the same reason and message were not already there).
pub(super) fn unplaced_status(
    mut status: ImpVMStatus,
    reason: ConditionReason,
    message: &str,
    event_reason: &'static str,
    generation: Option<i64>,
    now: Timestamp,
) -> (ImpVMStatus, Option<Note>) {
    let was = has_cond(&status, ConditionType::Scheduled, reason, message);
    status.phase = Some(VmPhase::Pending);
    for type_ in [ConditionType::Scheduled, ConditionType::Ready] {
        set_cond(&mut status, type_, false, reason, message, generation, now);
    }
    let note = (!was).then(|| Note::warning(event_reason, message));
    (status, note)
}

impl Context {
    /// Places an unplaced VM: under the scheduling lock, spec.nodeName first, then status.
    pub(super) async fn place(&self, vm: ImpVM, r: &Resolved) -> Result<Action, Error> {
        let req = Request {
            vcpu: r.vcpu,
            memory_mib: r.memory_mib,
            node_selector: r.spec.node_selector.clone(),
            tolerations: r.spec.tolerations.clone(),
        };
        let k = key(&vm);
        let size = PlacedSize {
            vcpu: r.vcpu,
            memory_mib: r.memory_mib,
        };
        let nodes = self.node_views();
        let policy = self.policy();
        // The choice is booked in the ledger before the write, so the lock covers only the
        // decision; a failed write takes the booking back (over-counting briefly is the safe
        // side).
        let (choice, booking) = {
            let mut ledger = self.ledger();
            ledger.refresh_sizes(|s| live_size(&self.classes, &self.templates, s));
            let choice = schedule::pick(&req, &nodes, ledger.usage(), &policy);
            let booking = choice
                .as_ref()
                .ok()
                .map(|node| ledger.book(&k, Some(node), Some(size)));
            (choice, booking)
        };
        let vm = match (&choice, booking) {
            (Ok(node), Some(booking)) => self.write_placement(&vm, node, size, booking).await?,
            _ => vm,
        };
        // The nodeName write raised the generation: conditions observe the new one.
        let generation = vm.metadata.generation;
        let status = vm.status.clone().unwrap_or_default();
        let now = Timestamp::now();
        match choice {
            Ok(node) => {
                let first = status.scheduled_at.is_none();
                let booked = imp_api::vm::Booking {
                    class: r.class.clone(),
                    spec: r.spec.clone(),
                };
                let status = placed_status(status, &node, booked, generation, now);
                let vm = self
                    .patch_status(&vm, &status, "recording the placement of")
                    .await?;
                if first
                    && let (Some(m), Some(created)) =
                        (&self.metrics, &vm.metadata.creation_timestamp)
                {
                    let lat = now.duration_since(created.0);
                    m.observe_schedule_latency(Duration::try_from(lat).unwrap_or_default());
                }
                tracing::info!(vm = %k, node = %node, vcpu = r.vcpu, memory_mib = r.memory_mib, "scheduled");
                self.note(
                    &vm,
                    Note::normal("Scheduled", format!("Assigned to node {node}")),
                )
                .await;
                Ok(Action::requeue(self.settings.requeue_active))
            }
            Err(no) => {
                let (status, note) = unplaced_status(
                    status,
                    ConditionReason::NoNodeAvailable,
                    &no.message,
                    "Unschedulable",
                    generation,
                    now,
                );
                let vm = self
                    .patch_status(&vm, &status, "reporting no node for")
                    .await?;
                if let Some(note) = note {
                    tracing::info!(vm = %k, why = %no.message, "no node available");
                    self.note(&vm, note).await;
                }
                Ok(Action::requeue(self.settings.requeue_pending))
            }
        }
    }
}
