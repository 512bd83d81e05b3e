//! Placement of an unplaced VM: a node chosen and booked under the scheduling lock,
//! `spec.nodeName` written first, then status.

use std::time::Duration;

use imp_api::conditions::{ConditionReason, ConditionType};
use imp_api::shared::LABEL_SNAPSHOT_PARENT;
use imp_api::shared::PlacedSize;
use imp_api::snapshot::{ImpVMSnapshot, SnapshotPhase, StorageType};
use imp_api::vm::{ImpVM, ImpVMStatus, VmPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::Api;
use kube::runtime::controller::Action;

use super::conditions::{Note, has_cond, set_cond};
use super::world::{Resolved, live_size};
use super::{Context, Error, key};
use crate::placement::ledger;
use crate::placement::schedule::{self, Request};

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
    event_reason: Option<&'static str>,
    generation: Option<i64>,
    now: Timestamp,
) -> (ImpVMStatus, Option<Note>) {
    let was = has_cond(&status, ConditionType::Scheduled, reason, message);
    status.phase = Some(VmPhase::Pending);
    for type_ in [ConditionType::Scheduled, ConditionType::Ready] {
        set_cond(&mut status, type_, false, reason, message, generation, now);
    }
    let note = event_reason
        .filter(|_| !was)
        .map(|e| Note::warning(e, message));
    (status, note)
}

/// Where a VM restored from snapshot execution `name` (`spec.snapshotRef`) can run: on the
/// node holding its files (node-local storage), anywhere (a registry), or not yet / never
/// (the reason, and whether waiting can help).
pub(super) fn snapshot_binding(
    name: &str,
    exec: Option<&ImpVMSnapshot>,
) -> Result<Option<(String, String)>, (ConditionReason, String)> {
    let invalid = |why: String| Err((ConditionReason::InvalidSpec, why));
    let Some(exec) = exec else {
        return invalid(format!("spec.snapshotRef: ImpVMSnapshot {name} not found"));
    };
    if !exec.labels().contains_key(LABEL_SNAPSHOT_PARENT) {
        return invalid(format!(
            "spec.snapshotRef: ImpVMSnapshot {name} is a parent (a schedule), not an execution; \
             name one of its executions (label {LABEL_SNAPSHOT_PARENT}={name})"
        ));
    }
    // Taken of another namespace's VM (before imp refused such snapshots): that VM's memory,
    // disk and Secrets are never restored here.
    if let Some(why) = crate::snapshot::decide::foreign_source(exec) {
        return invalid(format!(
            "spec.snapshotRef: ImpVMSnapshot {name} was not taken of a VM of its own namespace: {why}"
        ));
    }
    let status = exec.status.clone().unwrap_or_default();
    match status.phase {
        Some(SnapshotPhase::Succeeded) => {}
        Some(SnapshotPhase::Failed) => {
            return invalid(format!("spec.snapshotRef: snapshot {name} failed"));
        }
        p => {
            return Err((
                ConditionReason::Waiting,
                format!(
                    "waiting for snapshot {name} (phase {})",
                    p.map_or("Pending", |p| match p {
                        SnapshotPhase::Pending => "Pending",
                        SnapshotPhase::Running => "Running",
                        SnapshotPhase::Succeeded | SnapshotPhase::Failed => "",
                    })
                ),
            ));
        }
    }
    if exec.spec.storage.type_ == StorageType::OciRegistry {
        return Ok(None);
    }
    match exec.annotations().get(SNAPSHOT_NODE) {
        Some(node) => Ok(Some((
            node.clone(),
            format!("snapshot {name}'s files are there"),
        ))),
        None => invalid(format!(
            "spec.snapshotRef: snapshot {name} names no node (annotation {SNAPSHOT_NODE})"
        )),
    }
}

use imp_api::shared::ANNOTATION_SNAPSHOT_NODE as SNAPSHOT_NODE;

/// What the scheduler is asked for `r`, bound to `only_node` when its snapshot's files are
/// there; a VM that starts suspended needs room for its memory snapshot on the node's disk.
fn request(r: &Resolved, only_node: Option<(String, String)>) -> Request {
    Request {
        vcpu: r.vcpu,
        memory_mib: r.memory_mib,
        node_selector: r.spec.node_selector.clone(),
        tolerations: r.spec.tolerations.clone(),
        only_node,
        arch: r.class.arch,
        runtime: r.class.runtime,
        disk_gib: i64::from(r.class.disk_gib),
        snapshot_mib: match r.spec.desired_state {
            imp_api::shared::VmDesiredState::Running => 0,
            imp_api::shared::VmDesiredState::Suspended
            | imp_api::shared::VmDesiredState::ScaleToZero => r.memory_mib,
        },
    }
}

impl Context {
    /// Places an unplaced VM: under the scheduling lock, spec.nodeName first, then status.
    pub(super) async fn place(&self, vm: ImpVM, r: &Resolved) -> Result<Action, Error> {
        let only_node = match &r.spec.snapshot_ref {
            None => None,
            Some(name) => {
                let exec = self.snapshot_execution(&vm, name).await?;
                match snapshot_binding(name, exec.as_ref()) {
                    Ok(binding) => binding,
                    Err((reason, why)) => return self.unplaceable(vm, reason, &why).await,
                }
            }
        };
        let k = key(&vm);
        let size = PlacedSize {
            vcpu: r.vcpu,
            memory_mib: r.memory_mib,
        };
        let (node, booking) = match self.choose(&k, &request(r, only_node), size) {
            Ok(chosen) => chosen,
            Err(no) => {
                return self
                    .unplaceable(vm, ConditionReason::NoNodeAvailable, &no.message)
                    .await;
            }
        };
        // The reservation first: a quota that refuses it keeps the VM off the node.
        if let Some(why) = self.reserve(&vm, &node, size).await {
            self.ledger().abort(&k, booking);
            let why = format!("reserving {node} for the VM: {why}");
            return self
                .unplaceable(vm, ConditionReason::QuotaExceeded, &why)
                .await;
        }
        let vm = self.write_placement(&vm, &node, size, booking).await?;
        self.record_placement(vm, r, &node).await
    }

    /// The snapshot execution `name` that `vm` is restored from (`spec.snapshotRef`).
    async fn snapshot_execution(
        &self,
        vm: &ImpVM,
        name: &str,
    ) -> Result<Option<ImpVMSnapshot>, Error> {
        let ns = vm.namespace().unwrap_or_default();
        let api: Api<ImpVMSnapshot> = Api::namespaced(self.client.clone(), &ns);
        api.get_opt(name).await.map_err(|source| Error::Kube {
            doing: "reading the spec.snapshotRef of",
            vm: key(vm),
            source,
        })
    }

    /// A node for `req`, booked for `size` under the scheduling lock. The choice is booked in
    /// the ledger before the write, so the lock covers only the decision; a failed write takes
    /// the booking back (over-counting briefly is the safe side).
    fn choose(
        &self,
        k: &str,
        req: &Request,
        size: PlacedSize,
    ) -> Result<(String, ledger::Booking), schedule::NoNode> {
        let (node, mut ledger) = self.pick(req, &self.node_views())?;
        let booking = ledger.book(k, Some(&node), Some(size));
        Ok((node, booking))
    }

    /// The scheduler's pick among `nodes` for `req`, and the scheduling lock (the ledger, its
    /// live sizes looked up again) held for the caller to book it.
    fn pick(
        &self,
        req: &Request,
        nodes: &[schedule::NodeView],
    ) -> Result<(String, std::sync::MutexGuard<'_, ledger::Ledger>), schedule::NoNode> {
        let policy = self.policy();
        let mut ledger = self.ledger();
        ledger.refresh_sizes(|s| live_size(&self.classes, &self.templates, s));
        let node = schedule::pick(req, nodes, ledger.usage(), &policy)?;
        Ok((node, ledger))
    }

    /// A node other than its own for placed `vm` to move to (`asked`: only that one), booked
    /// for its whole size in the ledger under the scheduling lock until the move's write shows
    /// (a failed write gives it back: [`Context::unbook_move`]); or why none can take it.
    pub(crate) fn book_move_target(
        &self,
        vm: &ImpVM,
        asked: Option<&str>,
    ) -> Result<String, String> {
        let Some(Ok(r)) = self.booked(vm) else {
            return Err("the VM has no booking to move with (it was never placed)".into());
        };
        let source = vm.spec.node_name.clone().unwrap_or_default();
        let nodes: Vec<_> = self
            .node_views()
            .into_iter()
            .filter(|n| n.name != source && asked.is_none_or(|a| n.name == a))
            .collect();
        if let Some(a) = asked
            && nodes.is_empty()
        {
            return Err(format!("spec.targetNode {a}: no such node"));
        }
        let (node, mut ledger) =
            self.pick(&request(&r, None), &nodes)
                .map_err(|no| match asked {
                    Some(a) => format!("spec.targetNode {a} cannot take the VM: {}", no.message),
                    None => format!("no other node can take the VM: {}", no.message),
                })?;
        ledger.book_move(&key(vm), &node);
        Ok(node)
    }

    /// The move booked by [`Context::book_move_target`] was not written.
    pub(crate) fn unbook_move(&self, vm: &ImpVM) {
        self.ledger().abort_move(&key(vm));
    }

    /// Writes the status of `vm`, just placed on `node` with `r` as its booking, and tells of
    /// it (log, Event, the schedule-latency metric on its first placement).
    async fn record_placement(&self, vm: ImpVM, r: &Resolved, node: &str) -> Result<Action, Error> {
        // The nodeName write raised the generation: conditions observe the new one.
        let generation = vm.metadata.generation;
        let status = vm.status.clone().unwrap_or_default();
        let now = Timestamp::now();
        let first = status.scheduled_at.is_none();
        let booked = imp_api::vm::Booking {
            class: r.class.clone(),
            spec: r.spec.clone(),
            revision: 0,
        };
        let status = placed_status(status, node, booked, generation, now);
        let vm = self
            .patch_status(&vm, &status, "recording the placement of")
            .await?;
        if first && let (Some(m), Some(created)) = (&self.metrics, &vm.metadata.creation_timestamp)
        {
            let lat = now.duration_since(created.0);
            m.observe_schedule_latency(Duration::try_from(lat).unwrap_or_default());
        }
        if first {
            self.trace(super::trace::schedule_span(&vm, node, now));
        }
        tracing::info!(vm = %key(&vm), node = %node, vcpu = r.vcpu, memory_mib = r.memory_mib, "scheduled");
        self.note(
            &vm,
            Note::normal("Scheduled", format!("Assigned to node {node}")),
        )
        .await;
        Ok(Action::requeue(self.settings.requeue_active))
    }

    /// Reports that `vm` stays unplaced for `reason`, and looks again later.
    pub(super) async fn unplaceable(
        &self,
        vm: ImpVM,
        reason: ConditionReason,
        why: &str,
    ) -> Result<Action, Error> {
        let generation = vm.metadata.generation;
        let status = vm.status.clone().unwrap_or_default();
        let event = match reason {
            ConditionReason::InvalidSpec => "InvalidSpec",
            _ => "Unschedulable",
        };
        let (status, note) = unplaced_status(
            status,
            reason,
            why,
            Some(event),
            generation,
            Timestamp::now(),
        );
        let vm = self
            .patch_status(&vm, &status, "reporting no node for")
            .await?;
        if let Some(note) = note {
            tracing::info!(vm = %key(&vm), why, "no node available");
            self.note(&vm, note).await;
        }
        Ok(Action::requeue(self.settings.requeue_pending))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::snapshot::ImpVMSnapshotStatus;

    fn exec(phase: Option<SnapshotPhase>, node: Option<&str>) -> ImpVMSnapshot {
        let mut e = ImpVMSnapshot::new("s-1", Default::default());
        e.metadata.labels = Some([(LABEL_SNAPSHOT_PARENT.to_owned(), "s".to_owned())].into());
        if let Some(n) = node {
            e.metadata.annotations = Some([(SNAPSHOT_NODE.to_owned(), n.to_owned())].into());
        }
        e.status = Some(ImpVMSnapshotStatus {
            phase,
            ..Default::default()
        });
        e
    }

    #[test]
    fn a_vm_from_a_snapshot_goes_where_its_files_are_once_it_succeeded() {
        let ok = exec(Some(SnapshotPhase::Succeeded), Some("n2"));
        assert_eq!(snapshot_binding("s-1", Some(&ok)).unwrap().unwrap().0, "n2");
        let (reason, why) = snapshot_binding("s-1", None).unwrap_err();
        assert_eq!(reason, ConditionReason::InvalidSpec);
        assert!(
            why.contains("spec.snapshotRef") && why.contains("s-1"),
            "{why}"
        );
        let running = exec(Some(SnapshotPhase::Running), Some("n2"));
        assert_eq!(
            snapshot_binding("s-1", Some(&running)).unwrap_err().0,
            ConditionReason::Waiting
        );
        let failed = exec(Some(SnapshotPhase::Failed), Some("n2"));
        assert_eq!(
            snapshot_binding("s-1", Some(&failed)).unwrap_err().0,
            ConditionReason::InvalidSpec
        );
        let mut parent = ok.clone();
        parent.metadata.labels = None;
        let why = snapshot_binding("s", Some(&parent)).unwrap_err().1;
        assert!(why.contains("parent"), "{why}");
        let mut foreign = ok.clone();
        foreign.metadata.namespace = Some("evil".into());
        foreign.spec.source_vm_namespace = "victim".into();
        let (reason, why) = snapshot_binding("s-1", Some(&foreign)).unwrap_err();
        assert_eq!(reason, ConditionReason::InvalidSpec);
        assert!(
            why.starts_with("spec.snapshotRef: ImpVMSnapshot s-1 was not taken of a VM of its own namespace: spec.sourceVMNamespace:"),
            "{why}"
        );
        let mut oci = ok;
        oci.spec.storage.type_ = StorageType::OciRegistry;
        assert_eq!(snapshot_binding("s-1", Some(&oci)).unwrap(), None);
    }
}
