//! What one reconcile does next, as pure functions of the VM and a [`World`] snapshot.
//!
//! [`decide`] returns the first thing the VM needs; a [`Plan`] says what to write, in which order
//! ([`super::apply`] is the one place that writes it), and whether to decide again on the written
//! VM ([`Next::Continue`]) or stop. Placement books a node in the ledger, so it only gets
//! [`Decision::Place`] here and happens in [`super::place`]; deletion is [`super::finalize`].

use std::time::Duration;

use imp_api::conditions::{self, ConditionReason, ConditionType};
use imp_api::shared::{
    ANNOTATION_PLACED_RESOURCES, ANNOTATION_RESET_RETRIES, PlacedSize, RestartMode, VmLifecycle,
};
use imp_api::vm::{ImpVM, ImpVMStatus, VmPhase};
use k8s_openapi::api::core::v1::{Node, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde_json::{Value, json};

use super::address::needs_address;
use super::conditions::{Note, has_cond, set_cond};
use super::evict;
use super::lifecycle::{self, RestartDecision, RestartState};
use super::world::Resolved;
use super::{FINALIZER, Settings};
use crate::resolve::MissingRef;

/// Everything a decision reads besides the VM, read once per reconcile.
pub(super) struct World<'a> {
    /// The time the decision is made at.
    pub now: Timestamp,
    /// A uniform value in [0, 1) for backoff jitter.
    pub jitter: f64,
    /// Timings of the controller.
    pub settings: &'a Settings,
    /// The VM's resolved spec, or the reference that is missing.
    pub resolved: &'a Result<Resolved, MissingRef>,
    /// The VM's node, when it is placed and the node exists (looked up only when a decision
    /// needs it: placed, and deleting or in a non-terminal phase).
    pub node: Option<&'a Node>,
    /// How long the agent of the VM's node has been silent, when it keeps a Lease (it fences
    /// its VMs once silent past the deadline; see [`crate::placement::fencing`]).
    pub agent: Option<crate::placement::fencing::Silence>,
}

/// After a plan is written: decide again on the written VM, or end the reconcile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Next {
    /// Decide again on the VM as written.
    Continue,
    /// Reconcile again after this long.
    Requeue(Duration),
    /// Wait for a change of the VM or what it references.
    #[default]
    AwaitChange,
}

/// The writes of one decision, applied in field order by [`super::apply`].
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Plan {
    /// A merge patch of `metadata` (finalizers, annotations), written first.
    pub metadata: Option<Value>,
    /// Clear `spec.nodeName`.
    pub clear_node: bool,
    /// The whole desired status (written as a diff against the current one).
    pub status: Option<ImpVMStatus>,
    /// What the writes are doing, for errors.
    pub doing: &'static str,
    /// The Event after the writes.
    pub event: Option<Note>,
    /// Delete the VM (expired).
    pub delete: bool,
    /// Remove the `imp/reset-retries` annotation, last.
    pub drop_reset: bool,
    /// What happens after the writes.
    pub next: Next,
}

impl Plan {
    fn stop(next: Next) -> Self {
        Self {
            next,
            ..Self::default()
        }
    }
}

/// The first thing a VM needs.
#[derive(Debug, PartialEq)]
pub(super) enum Decision {
    /// Deleting: see [`super::finalize`].
    Finalize,
    /// Unplaced with a resolved spec: allocate its address, then pick a node.
    Place,
    /// Placed (pinned by a user, or placed before it had a network) without its address.
    Address,
    /// Write this (possibly nothing).
    Write(Box<Plan>),
    /// A claimant's claim of a warm pool's member goes on: see [`super::claim`].
    Claim,
}

fn left(until: Timestamp, now: Timestamp) -> Duration {
    Duration::try_from(until.duration_since(now)).unwrap_or_default()
}

/// The first thing `vm` needs, given the world `w`.
pub(super) fn decide(vm: &ImpVM, w: &World) -> Decision {
    if vm.metadata.deletion_timestamp.is_some() {
        return Decision::Finalize;
    }
    let status = vm.status.clone().unwrap_or_default();
    let phase = status.phase.unwrap_or_default();
    // Before anything that could clear the node (a reset): a VM leaving its node stays on it
    // until the node's agent has stopped it.
    if let Some(plan) = leaving(vm, &status, w) {
        return Decision::Write(Box::new(plan));
    }
    // Before the booking: a claimant bound to its member's node is booked by its claim.
    if w.resolved.is_ok()
        && crate::warmpool::claim::step(vm) != crate::warmpool::claim::Step::NotClaiming
    {
        return Decision::Claim;
    }
    if vm
        .annotations()
        .get(ANNOTATION_RESET_RETRIES)
        .map(String::as_str)
        == Some("true")
    {
        return Decision::Write(Box::new(reset(vm, status)));
    }
    if let Some(meta) = placed_metadata(vm, w.resolved) {
        return Decision::Write(Box::new(Plan {
            metadata: Some(meta),
            doing: "adding the finalizer and size to",
            next: Next::Continue,
            ..Plan::default()
        }));
    }
    if let Some(plan) = book(vm, &status, w.resolved) {
        return Decision::Write(Box::new(plan));
    }
    if ended(phase) {
        return Decision::Write(Box::new(finished(vm, status, w)));
    }
    let Some(node) = vm.spec.node_name.as_deref() else {
        if let Some(plan) = released(&status) {
            return Decision::Write(Box::new(plan));
        }
        return match w.resolved {
            Ok(_) => Decision::Place,
            Err(missing) => Decision::Write(Box::new(invalid_spec(vm, status, missing, w))),
        };
    };
    if let Some(plan) = record_node(vm, status.clone(), node, w) {
        return Decision::Write(Box::new(plan));
    }
    if w.resolved.as_ref().is_ok_and(|r| needs_address(vm, r)) {
        return Decision::Address;
    }
    Decision::Write(Box::new(on_node(vm, status, node, w)))
}

/// Whether a VM in `phase` has ended: Succeeded, Failed, or RetryExhausted.
fn ended(phase: VmPhase) -> bool {
    matches!(
        phase,
        VmPhase::Succeeded | VmPhase::Failed | VmPhase::RetryExhausted
    )
}

/// A VM on a node without a booking (pinned by a user, or placed by an operator that wrote
/// none) is booked with what it resolves to now; terminal VMs are not.
fn book(vm: &ImpVM, status: &ImpVMStatus, resolved: &Result<Resolved, MissingRef>) -> Option<Plan> {
    vm.spec.node_name.as_ref()?;
    let terminal = ended(status.phase.unwrap_or_default());
    let r = resolved.as_ref().ok()?;
    if status.booking.is_some() || terminal {
        return None;
    }
    let mut status = status.clone();
    status.booking = Some(imp_api::vm::Booking {
        class: r.class.clone(),
        spec: r.spec.clone(),
        revision: 0,
    });
    Some(Plan {
        status: Some(status),
        doing: "recording the booking of",
        next: Next::Continue,
        ..Plan::default()
    })
}

/// The reset annotation: run again from scratch (clears the node so it is really placed anew).
fn reset(vm: &ImpVM, mut status: ImpVMStatus) -> Plan {
    let mut plan = Plan {
        drop_reset: true,
        doing: "resetting retries of",
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    };
    if matches!(
        status.phase.unwrap_or_default(),
        VmPhase::Failed | VmPhase::RetryExhausted
    ) {
        plan.clear_node = vm.spec.node_name.is_some();
        status.phase = Some(VmPhase::Pending);
        status.restart_count = None;
        status.next_retry_after = None;
        status.exhausted_at = None;
        status.node_name = None;
        run_again(&mut status);
        plan.status = Some(status);
        plan.event = Some(Note::normal(
            "RetriesReset",
            "imp/reset-retries: counters cleared, scheduling again",
        ));
    }
    plan
}

/// A placed VM holds the finalizer and the size it was booked for; one written by the
/// scheduler has both from its placement patch, one pinned by a user gets them here.
fn placed_metadata(vm: &ImpVM, resolved: &Result<Resolved, MissingRef>) -> Option<Value> {
    vm.spec.node_name.as_ref()?;
    let mut meta = serde_json::Map::new();
    if !vm.finalizers().iter().any(|f| f == FINALIZER) {
        let mut fins = vm.finalizers().to_vec();
        fins.push(FINALIZER.to_owned());
        meta.insert("finalizers".to_owned(), json!(fins));
    }
    if let Ok(r) = resolved
        && !vm.annotations().contains_key(ANNOTATION_PLACED_RESOURCES)
    {
        let size = PlacedSize {
            vcpu: r.vcpu,
            memory_mib: r.memory_mib,
        };
        meta.insert(
            "annotations".to_owned(),
            json!({ ANNOTATION_PLACED_RESOURCES: size.to_annotation() }),
        );
    }
    (!meta.is_empty()).then_some(Value::Object(meta))
}

/// What only the controller can know is missing: Pending with `InvalidSpec`.
fn invalid_spec(vm: &ImpVM, mut status: ImpVMStatus, missing: &MissingRef, w: &World) -> Plan {
    let msg = missing.message();
    let was = has_cond(
        &status,
        ConditionType::Ready,
        ConditionReason::InvalidSpec,
        &msg,
    );
    let generation = vm.metadata.generation;
    status.phase = Some(VmPhase::Pending);
    for type_ in [ConditionType::Ready, ConditionType::Scheduled] {
        set_cond(
            &mut status,
            type_,
            false,
            ConditionReason::InvalidSpec,
            msg.clone(),
            generation,
            w.now,
        );
    }
    Plan {
        status: Some(status),
        doing: "reporting the invalid spec of",
        event: (!was).then(|| Note::warning("InvalidSpec", msg)),
        next: Next::Requeue(w.settings.requeue_pending),
        ..Plan::default()
    }
}

/// Placed: make status say so (pinned by a user, or the operator died between its writes).
fn record_node(vm: &ImpVM, mut status: ImpVMStatus, node: &str, w: &World) -> Option<Plan> {
    let phase = status.phase.unwrap_or_default();
    if status.node_name.as_deref() == Some(node) && phase != VmPhase::Pending {
        return None;
    }
    status.node_name = Some(node.to_owned());
    if phase == VmPhase::Pending {
        status.phase = Some(VmPhase::Scheduled);
    }
    if status.scheduled_at.is_none() {
        status.scheduled_at = Some(Time(w.now));
    }
    set_cond(
        &mut status,
        ConditionType::Scheduled,
        true,
        ConditionReason::NodeAssigned,
        format!("assigned to node {node}"),
        vm.metadata.generation,
        w.now,
    );
    Some(Plan {
        status: Some(status),
        doing: "recording the node of",
        event: Some(Note::normal(
            "Scheduled",
            format!("Assigned to node {node}"),
        )),
        next: Next::Continue,
        ..Plan::default()
    })
}

/// Whether `node`'s Ready condition is True.
pub(super) fn node_ready(node: &Node) -> bool {
    ready_condition(node).is_some_and(|c| c.status == "True")
}

fn ready_condition(node: &Node) -> Option<&k8s_openapi::api::core::v1::NodeCondition> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
}

/// How long `node` has been not Ready, from its Ready condition's lastTransitionTime;
/// `None` when that time is unknown (then the node counts as lost at once).
fn not_ready_for(node: &Node, now: Timestamp) -> Option<Duration> {
    ready_condition(node)
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| left(now, t.0))
}

/// A placed VM in a non-terminal phase: node health, then expiry and start timeout.
fn on_node(vm: &ImpVM, mut status: ImpVMStatus, node: &str, w: &World) -> Plan {
    if !w.node.is_some_and(node_ready) {
        return node_lost(vm, status, node, w);
    }
    set_cond(
        &mut status,
        ConditionType::NodeHealthy,
        true,
        ConditionReason::NodeReady,
        format!("node {node} is Ready"),
        vm.metadata.generation,
        w.now,
    );
    let taint_wait = match taints(vm, &mut status, node, w) {
        Ok(wait) => wait,
        Err(plan) => return *plan,
    };
    let s = w.settings;
    let phase = status.phase.unwrap_or_default();
    let started = status.started_at.as_ref().map(|t| t.0);
    if phase == VmPhase::Starting && lifecycle::start_timed_out(started, w.now, s.start_timeout) {
        return start_timeout(vm, status, node, w);
    }
    if let Some(plan) = roll(vm, &status, w) {
        return plan;
    }
    let mut requeue = match phase {
        VmPhase::Running => s.requeue_running,
        _ => s.requeue_active,
    };
    if let Some(wait) = taint_wait {
        requeue = requeue.min(wait);
    }
    if matches!(
        phase,
        VmPhase::Running | VmPhase::Suspending | VmPhase::Suspended | VmPhase::Resuming
    ) {
        if status.running_at.is_none() && phase == VmPhase::Running {
            status.running_at = Some(Time(w.now));
        }
        match expiry(vm, &mut status, w) {
            Some(at) if w.now >= at => return expire(status, w),
            Some(at) => requeue = requeue.min(until_expiry(at, w.now)),
            None => {}
        }
    }
    Plan {
        status: Some(status),
        doing: "updating the status of",
        next: Next::Requeue(requeue),
        ..Plan::default()
    }
}

/// The VM's node's `NoExecute` taints ([`evict`]): `Err` with the plan that evicts the VM, or
/// how long it may stay tolerated (the `DisruptionTarget` condition says until when; it is
/// removed when no taint applies).
fn taints(
    vm: &ImpVM,
    status: &mut ImpVMStatus,
    node: &str,
    w: &World,
) -> Result<Option<Duration>, Box<Plan>> {
    let taints = w
        .node
        .and_then(|n| n.spec.as_ref())
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    // The API keeps whole seconds of the condition's time: the first sight was within the
    // second after it, and counting from its end evicts at worst a second late, never early.
    let first_seen = conditions::find(&status.conditions, ConditionType::DisruptionTarget)
        .filter(|c| c.reason == ConditionReason::TaintTolerated.as_str())
        .map(|c| c.last_transition_time.0 + Duration::from_secs(1));
    match evict::verdict(taints, tolerations(vm, status, w), first_seen, w.now) {
        evict::Verdict::Stay => {
            conditions::remove(&mut status.conditions, ConditionType::DisruptionTarget);
            Ok(None)
        }
        evict::Verdict::TolerateUntil { until, taint } => {
            let msg = format!(
                "node {node} has taint {taint}, tolerated until {until}: the VM is evicted then"
            );
            let reason = ConditionReason::TaintTolerated;
            set_cond(
                status,
                ConditionType::DisruptionTarget,
                false,
                reason,
                msg,
                vm.metadata.generation,
                w.now,
            );
            Ok(Some(until_expiry(until, w.now)))
        }
        evict::Verdict::Evict { taint, limit } => Err(Box::new(evicted(
            vm,
            status.clone(),
            node,
            &taint,
            limit,
            w,
        ))),
    }
}

/// The tolerations the VM was booked with (class ∪ template ∪ VM), else its own.
fn tolerations<'a>(vm: &'a ImpVM, status: &'a ImpVMStatus, w: &'a World) -> &'a [Toleration] {
    match (w.resolved, &status.booking) {
        (Ok(r), _) => &r.spec.tolerations,
        (Err(_), Some(b)) => &b.spec.tolerations,
        (Err(_), None) => &vm.spec.tolerations,
    }
}

/// Evicts the VM from `node` for `taint`: it fails with `Evicted` where it is, and
/// `DisruptionTarget=True` asks the node's agent to stop, remove and release it; what follows
/// is [`after_eviction`]'s.
fn evicted(
    vm: &ImpVM,
    mut status: ImpVMStatus,
    node: &str,
    taint: &str,
    limit: Option<i64>,
    w: &World,
) -> Plan {
    let why = match limit {
        None => format!("node {node} has taint {taint}, which the VM does not tolerate"),
        Some(s) => format!("node {node} has taint {taint}, tolerated for {s}s, which have passed"),
    };
    let generation = vm.metadata.generation;
    status.phase = Some(VmPhase::Failed);
    status.finished_at = Some(Time(w.now));
    let msg = format!("{why}: evicted; the node's agent stops and removes it");
    mark_leaving(
        &mut status,
        ConditionReason::Evicted,
        &msg,
        generation,
        w.now,
    );
    Plan {
        status: Some(status),
        doing: "evicting",
        event: Some(Note::warning("Evicted", format!("{why}: evicting"))),
        next: Next::Requeue(w.settings.requeue_active),
        ..Plan::default()
    }
}

/// Marks the VM to leave its node for `reason`: `DisruptionTarget=True` (its node's agent
/// stops, removes and releases it) and `Ready=False`, both saying `msg`.
fn mark_leaving(
    status: &mut ImpVMStatus,
    reason: ConditionReason,
    msg: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    set_cond(
        status,
        ConditionType::DisruptionTarget,
        true,
        reason,
        msg,
        generation,
        now,
    );
    set_cond(
        status,
        ConditionType::Ready,
        false,
        reason,
        msg,
        generation,
        now,
    );
}

/// A VM marked to leave its node that is still on it: wait for the node's agent to stop,
/// remove and release it (clear `spec.nodeName`). The operator clears the node itself only as
/// node loss would move it: the node gone or NotReady past the grace, and its agent silent past
/// its fence deadline (or keeping no Lease), so it has stopped the VM itself by then.
fn leaving(vm: &ImpVM, status: &ImpVMStatus, w: &World) -> Option<Plan> {
    let node = vm.spec.node_name.as_deref()?;
    if !status.leaving_node() {
        return None;
    }
    let lost = w.node.is_none_or(|n| {
        !node_ready(n) && not_ready_for(n, w.now).is_none_or(|d| d >= w.settings.node_loss_grace)
    });
    let fenced = w.agent.is_none_or(|a| a.fenced());
    if !(lost && fenced) {
        return Some(Plan::stop(Next::Requeue(w.settings.requeue_active)));
    }
    Some(Plan {
        clear_node: true,
        doing: "releasing a VM whose node's agent has fenced",
        event: Some(Note::warning(
            "Released",
            format!(
                "node {node} is lost and its agent silent past its fence deadline: it has \
                 stopped the VM itself"
            ),
        )),
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    })
}

/// A VM its node's agent released that is not Failed (its class or template changed): the mark
/// goes before it is placed anew, or the next node's agent would release it at once.
fn released(status: &ImpVMStatus) -> Option<Plan> {
    let mut status = status.clone();
    if !conditions::remove(&mut status.conditions, ConditionType::DisruptionTarget) {
        return None;
    }
    // Booked anew where it is placed: the old booking would size the new placement.
    status.booking = None;
    Some(Plan {
        status: Some(status),
        doing: "clearing the release mark of",
        next: Next::Continue,
        ..Plan::default()
    })
}

/// An evicted VM its node's agent released: one that may move (ephemeral, or
/// `rescheduleOnNodeLoss`) is placed anew; `None` for any other, which follows its restart
/// policy.
fn after_eviction(vm: &ImpVM, mut status: ImpVMStatus, w: &World) -> Option<Plan> {
    let spec = w.resolved.as_ref().map(|r| &r.spec).unwrap_or(&vm.spec);
    if spec.lifecycle != VmLifecycle::Ephemeral && !spec.reschedule_on_node_loss {
        return None;
    }
    let from = status.node_name.clone().unwrap_or_default();
    status.phase = Some(VmPhase::Pending);
    status.node_name = None;
    status.booking = None;
    status.suspend_snapshot_path = None;
    status.suspended_at = None;
    run_again(&mut status);
    let msg = format!("evicted from node {from}; placing it on another node");
    let reason = ConditionReason::Evicted;
    let generation = vm.metadata.generation;
    set_cond(
        &mut status,
        ConditionType::Scheduled,
        false,
        reason,
        msg.clone(),
        generation,
        w.now,
    );
    Some(Plan {
        status: Some(status),
        doing: "rescheduling an evicted",
        event: Some(Note::normal("Rescheduling", msg)),
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    })
}

/// A running persistent VM whose own `classRef` or `templateRef` changed (`what`): it leaves
/// `node` to be placed anew with the new spec (its size may change).
fn replace(vm: &ImpVM, mut status: ImpVMStatus, node: &str, what: &str, w: &World) -> Plan {
    let generation = vm.metadata.generation;
    status.phase = Some(VmPhase::Pending);
    status.suspend_snapshot_path = None;
    status.suspended_at = None;
    run_again(&mut status);
    let msg = format!(
        "{what} changed: restarting the VM with the new spec, placed anew once node {node} has \
         stopped it"
    );
    mark_leaving(
        &mut status,
        ConditionReason::SpecChanged,
        &msg,
        generation,
        w.now,
    );
    Plan {
        status: Some(status),
        doing: "placing anew, for a changed reference,",
        event: Some(Note::normal("SpecChanged", msg).action("Reschedule")),
        next: Next::Requeue(w.settings.requeue_active),
        ..Plan::default()
    }
}

/// A running persistent VM whose own spec changed since it was booked: the change goes into
/// its booking, and a change of what it boots with restarts it on its node with a new booking
/// revision ([`super::rollout`]).
fn roll(vm: &ImpVM, status: &ImpVMStatus, w: &World) -> Option<Plan> {
    let booking = status.booking.as_ref()?;
    let running = status.phase == Some(VmPhase::Running);
    if !running || booking.spec.lifecycle != VmLifecycle::Persistent {
        return None;
    }
    let refs = super::rollout::changed_refs(&vm.spec, &booking.spec);
    if !refs.is_empty() {
        let node = vm.spec.node_name.as_deref().unwrap_or_default();
        return Some(replace(vm, status.clone(), node, &refs.join(", "), w));
    }
    let r = super::rollout::rollout(&vm.spec, &booking.spec)?;
    let what = r.changed.join(", ");
    let mut status = status.clone();
    let mut booked = booking.clone();
    booked.spec = r.spec;
    let note = if r.restart {
        booked.revision += 1;
        status.phase = Some(VmPhase::Scheduled);
        run_again(&mut status);
        set_cond(
            &mut status,
            ConditionType::Ready,
            false,
            ConditionReason::Waiting,
            format!("restarting with the changed {what}"),
            vm.metadata.generation,
            w.now,
        );
        format!(
            "{what} changed: restarting the VM with the new spec (booking revision {})",
            booked.revision
        )
    } else {
        format!("{what} changed: in effect without a restart")
    };
    status.booking = Some(booked);
    let action = if r.restart { "Restart" } else { "Update" };
    Some(Plan {
        status: Some(status),
        doing: "rolling a spec change into",
        event: Some(Note::normal("SpecChanged", note).action(action)),
        next: Next::Requeue(w.settings.requeue_active),
        ..Plan::default()
    })
}

/// The `expireAfter` of a VM: from its resolved spec, else its booking, else its own spec.
fn expire_after(vm: &ImpVM, status: &ImpVMStatus, w: &World) -> Option<Duration> {
    let spec = match (w.resolved, &status.booking) {
        (Ok(r), _) => &r.spec,
        (Err(_), Some(b)) => &b.spec,
        (Err(_), None) => &vm.spec,
    };
    spec.inherited.expire_after.as_ref()?.parse().ok()
}

/// When `vm` expires, also written to `status.expiresAt`. An ended VM that never ran and has no
/// `finishedAt` (a status written by hand) gets it now, so its expiry has a start.
fn expiry(vm: &ImpVM, status: &mut ImpVMStatus, w: &World) -> Option<Timestamp> {
    let d = expire_after(vm, status, w).filter(|d| !d.is_zero());
    if d.is_some() && status.running_at.is_none() && ended(status.phase.unwrap_or_default()) {
        status.finished_at.get_or_insert(Time(w.now));
    }
    let at = lifecycle::expires_at(
        d,
        status.running_at.as_ref().map(|t| t.0),
        status.finished_at.as_ref().map(|t| t.0),
    );
    status.expires_at = at.map(Time);
    at
}

/// How long to wait to see a VM expire at `at`.
fn until_expiry(at: Timestamp, now: Timestamp) -> Duration {
    left(at, now) + Duration::from_millis(100)
}

/// Deletes an expired VM, with an Event saying what its expiry counted from.
fn expire(status: ImpVMStatus, w: &World) -> Plan {
    let since = match status.running_at {
        Some(_) => "the VM first ran",
        None => "the VM ended",
    };
    Plan {
        status: Some(status),
        doing: "expiring",
        event: Some(Note::normal(
            "Expired",
            format!("expireAfter elapsed since {since}; deleting"),
        )),
        delete: true,
        next: Next::Requeue(w.settings.requeue_active),
        ..Plan::default()
    }
}

/// A VM that ended: deleted once it expires; until then a Failed one follows its restart
/// policy, and none is scheduled again on its own.
fn finished(vm: &ImpVM, old: ImpVMStatus, w: &World) -> Plan {
    let mut status = old.clone();
    let at = expiry(vm, &mut status, w);
    if let Some(at) = at
        && w.now >= at
    {
        return expire(status, w);
    }
    let evicted = status
        .leaving_node()
        .then(|| after_eviction(vm, status.clone(), w));
    let mut plan = match (
        evicted.flatten(),
        status.phase.unwrap_or_default(),
        w.resolved,
    ) {
        (Some(moved), _, _) => moved,
        (None, VmPhase::Failed, Ok(r)) => restart(vm, status.clone(), r, w),
        _ => Plan::stop(Next::AwaitChange),
    };
    if plan.status.is_none() && status != old {
        plan.status = Some(status);
        plan.doing = "recording the expiry of";
    }
    if let Some(at) = at {
        plan.next = match plan.next {
            Next::AwaitChange => Next::Requeue(until_expiry(at, w.now)),
            Next::Requeue(d) => Next::Requeue(d.min(until_expiry(at, w.now))),
            Next::Continue => Next::Continue,
        };
    }
    plan
}

fn start_timeout(vm: &ImpVM, mut status: ImpVMStatus, node: &str, w: &World) -> Plan {
    let timeout = w.settings.start_timeout;
    status.phase = Some(VmPhase::Failed);
    status.finished_at = Some(Time(w.now));
    let msg = format!(
        "still Starting after {timeout:?} on node {node}: the node's agent did not report the \
         VM running or failed (check the agent on {node})"
    );
    let reason = ConditionReason::AgentTimeout;
    set_cond(
        &mut status,
        ConditionType::Ready,
        false,
        reason,
        msg.clone(),
        vm.metadata.generation,
        w.now,
    );
    Plan {
        status: Some(status),
        doing: "failing a stuck start of",
        event: Some(Note::warning(reason.as_str(), msg)),
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    }
}

/// The VM's node is gone or not Ready: wait out the grace period, then move or fail the VM.
fn node_lost(vm: &ImpVM, mut status: ImpVMStatus, node: &str, w: &World) -> Plan {
    let s = w.settings;
    let generation = vm.metadata.generation;
    let why = match w.node {
        None => format!("node {node} no longer exists"),
        Some(_) => format!("node {node} is not Ready"),
    };
    // A node that only just went NotReady may come back: wait out the grace period.
    if let Some(elapsed) = w.node.and_then(|n| not_ready_for(n, w.now))
        && elapsed < s.node_loss_grace
    {
        let grace = s.node_loss_grace.as_secs();
        let msg = format!("{why}; its VMs are moved or failed if it stays so for {grace}s");
        node_unhealthy(&mut status, msg, generation, w.now);
        return Plan {
            status: Some(status),
            doing: "noting the node is not Ready",
            next: Next::Requeue((s.node_loss_grace - elapsed).min(s.requeue_active)),
            ..Plan::default()
        };
    }
    // Its agent may be cut off but alive, its VMs running: move them only once it has surely
    // fenced them, or two copies would run.
    if let Some(a) = w.agent
        && !a.fenced()
    {
        let (silent, deadline) = (a.silent.as_secs(), a.deadline.as_secs());
        let msg = format!(
            "{why}; its agent last renewed its Lease {silent}s ago: its VMs are moved or \
             failed once it has been silent {deadline}s (by then it has stopped them itself)"
        );
        node_unhealthy(&mut status, msg, generation, w.now);
        return Plan {
            status: Some(status),
            doing: "waiting for the lost node's agent to fence",
            next: Next::Requeue((a.deadline - a.silent).min(s.requeue_active)),
            ..Plan::default()
        };
    }
    node_unhealthy(&mut status, why.clone(), generation, w.now);
    let spec = w.resolved.as_ref().map(|r| &r.spec).unwrap_or(&vm.spec);
    if spec.lifecycle == VmLifecycle::Ephemeral || spec.reschedule_on_node_loss {
        reschedule_from_lost(status, why, generation, w.now)
    } else {
        fail_on_lost(status, why, generation, w)
    }
}

/// Sets `NodeHealthy=False/NodeNotReady` saying `msg`.
fn node_unhealthy(status: &mut ImpVMStatus, msg: String, generation: Option<i64>, now: Timestamp) {
    set_cond(
        status,
        ConditionType::NodeHealthy,
        false,
        ConditionReason::NodeNotReady,
        msg,
        generation,
        now,
    );
}

/// A VM of a lost node that may move (ephemeral, or `rescheduleOnNodeLoss`) goes back to
/// Pending without a node, to be placed anew.
fn reschedule_from_lost(
    mut status: ImpVMStatus,
    why: String,
    generation: Option<i64>,
    now: Timestamp,
) -> Plan {
    status.phase = Some(VmPhase::Pending);
    status.node_name = None;
    status.started_at = None;
    status.suspend_snapshot_path = None;
    status.suspended_at = None;
    set_cond(
        &mut status,
        ConditionType::Scheduled,
        false,
        ConditionReason::NodeNotReady,
        format!("{why}; rescheduling"),
        generation,
        now,
    );
    Plan {
        clear_node: true,
        status: Some(status),
        doing: "rescheduling after node loss",
        event: Some(Note::warning(
            "Rescheduling",
            format!("{why}; moving to another node"),
        )),
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    }
}

/// A persistent VM of a lost node that may not move fails (once), and stays on the node.
fn fail_on_lost(mut status: ImpVMStatus, why: String, generation: Option<i64>, w: &World) -> Plan {
    let mut plan = Plan::stop(Next::Requeue(w.settings.requeue_active));
    if status.phase != Some(VmPhase::Failed) {
        status.phase = Some(VmPhase::Failed);
        status.finished_at = Some(Time(w.now));
        set_cond(
            &mut status,
            ConditionType::Ready,
            false,
            ConditionReason::NodeNotReady,
            format!("{why}; set rescheduleOnNodeLoss to move persistent VMs"),
            generation,
            w.now,
        );
        plan.status = Some(status);
        plan.doing = "failing after node loss";
        plan.event = Some(Note::warning("NodeLost", why));
    }
    plan
}

/// An ended VM goes again: what its last run left is cleared (an expiry counted from its end
/// too; one counted from its first run stands).
fn run_again(status: &mut ImpVMStatus) {
    conditions::remove(&mut status.conditions, ConditionType::DisruptionTarget);
    status.exit_code = None;
    status.started_at = None;
    status.finished_at = None;
    if status.running_at.is_none() {
        status.expires_at = None;
    }
}

fn restart_state(s: &ImpVMStatus) -> RestartState {
    RestartState {
        restart_count: s.restart_count.unwrap_or(0),
        next_retry_after: s.next_retry_after.as_ref().map(|t| t.0),
        exhausted_at: s.exhausted_at.as_ref().map(|t| t.0),
    }
}

/// The restart policy of a Failed VM ([`lifecycle::restart_policy`]: a persistent VM without
/// one of its own follows the default).
fn restart(vm: &ImpVM, mut status: ImpVMStatus, r: &Resolved, w: &World) -> Plan {
    let Some(policy) = lifecycle::restart_policy(&r.spec) else {
        return Plan::stop(Next::AwaitChange);
    };
    let default = match r.spec.inherited.restart_policy {
        Some(_) => "",
        None => "; the default restart policy (none set on the VM, its template or class)",
    };
    let now = w.now;
    let placed = vm.spec.node_name.clone();
    match lifecycle::decide_restart(&policy, &restart_state(&status), now, w.jitter) {
        RestartDecision::Wait { until, record } => {
            let mut plan = Plan::stop(Next::Requeue(left(until, now) + Duration::from_millis(50)));
            if record {
                status.next_retry_after = Some(Time(until));
                plan.status = Some(status);
                plan.doing = "recording the next retry of";
            }
            plan
        }
        RestartDecision::Restart { mode, attempt, max } => {
            status.restart_count = Some(attempt);
            status.next_retry_after = None;
            let note = format!("attempt {attempt}/{max} ({mode:?}){default}");
            restart_now(status, mode, placed, note)
        }
        RestartDecision::StayFailed => Plan::stop(Next::AwaitChange),
        RestartDecision::AwaitManualReset => {
            status.phase = Some(VmPhase::RetryExhausted);
            status.exhausted_at.get_or_insert(Time(now));
            Plan {
                status: Some(status),
                doing: "exhausting retries of",
                event: Some(Note::warning(
                    "RetriesExhausted",
                    "restart attempts used up; set annotation imp/reset-retries: \"true\" to try again",
                )),
                next: Next::AwaitChange,
                ..Plan::default()
            }
        }
        RestartDecision::CoolingDown { until } => {
            let mut plan = Plan::stop(Next::Requeue(left(until, now) + Duration::from_millis(50)));
            if status.exhausted_at.is_none() {
                status.exhausted_at = Some(Time(now));
                plan.status = Some(status);
                plan.doing = "starting the cool-down of";
                plan.event = Some(Note::warning(
                    "CoolingDown",
                    format!(
                        "restart attempts used up; retrying after {}",
                        policy.cool_down_period.as_str()
                    ),
                ));
            }
            plan
        }
        RestartDecision::CoolDownOver => cool_down_over(status, placed.is_some()),
    }
}

/// A Failed VM goes again (`note` says which attempt): in place on the node it was `placed`
/// on, else back to Pending to be placed anew.
fn restart_now(
    mut status: ImpVMStatus,
    mode: RestartMode,
    placed: Option<String>,
    note: String,
) -> Plan {
    run_again(&mut status);
    let mut clear_node = false;
    match (mode, placed) {
        (RestartMode::InPlace, Some(node)) => {
            status.phase = Some(VmPhase::Scheduled);
            status.node_name = Some(node);
        }
        (_, placed) => {
            clear_node = placed.is_some();
            status.phase = Some(VmPhase::Pending);
            status.node_name = None;
        }
    }
    Plan {
        clear_node,
        status: Some(status),
        doing: "restarting",
        event: Some(Note::normal("Restarting", note)),
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    }
}

/// A VM whose cool-down has passed starts over: no restarts counted, back to Pending (off its
/// node, when `placed`).
fn cool_down_over(mut status: ImpVMStatus, placed: bool) -> Plan {
    status.phase = Some(VmPhase::Pending);
    status.node_name = None;
    status.restart_count = None;
    status.next_retry_after = None;
    status.exhausted_at = None;
    run_again(&mut status);
    Plan {
        clear_node: placed,
        status: Some(status),
        doing: "ending the cool-down of",
        event: Some(Note::normal(
            "CoolDownOver",
            "cool-down elapsed; scheduling again",
        )),
        next: Next::Requeue(Duration::ZERO),
        ..Plan::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::duration::GoDuration;
    use imp_api::inherited::Inherited;
    use imp_api::shared::{BackoffPolicy, RestartPolicy};
    use imp_api::vm::ImpVMSpec;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn vm(node: Option<&str>, phase: Option<VmPhase>) -> ImpVM {
        let mut vm = ImpVM::new("v", ImpVMSpec::default());
        vm.metadata.namespace = Some("default".into());
        vm.metadata.generation = Some(1);
        vm.spec.node_name = node.map(str::to_owned);
        if node.is_some() {
            vm.metadata.finalizers = Some(vec![FINALIZER.into()]);
            vm.metadata.annotations = Some(
                [(ANNOTATION_PLACED_RESOURCES.to_owned(), "{}".to_owned())]
                    .into_iter()
                    .collect(),
            );
        }
        vm.status = Some(ImpVMStatus {
            phase,
            node_name: node.map(str::to_owned),
            booking: node.map(|_| imp_api::vm::Booking {
                class: resolved(ImpVMSpec::default()).unwrap().class,
                spec: ImpVMSpec::default(),
                revision: 0,
            }),
            ..Default::default()
        });
        vm
    }

    fn resolved(spec: ImpVMSpec) -> Result<Resolved, MissingRef> {
        Ok(Resolved {
            spec,
            class: imp_api::class::ImpVMClassSpec {
                vcpu: 1,
                memory_mib: 512,
                disk_gib: 1,
                ..Default::default()
            },
            vcpu: 1,
            memory_mib: 512,
        })
    }

    fn node(ready: bool, since: Timestamp) -> Node {
        Node {
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    last_transition_time: Some(Time(since)),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn decide_with(
        vm: &ImpVM,
        r: &Result<Resolved, MissingRef>,
        node: Option<&Node>,
        now: Timestamp,
    ) -> Decision {
        let settings = Settings::default();
        decide(
            vm,
            &World {
                now,
                jitter: 0.5,
                settings: &settings,
                resolved: r,
                node,
                agent: None,
            },
        )
    }

    fn plan(d: Decision) -> Plan {
        match d {
            Decision::Write(p) => *p,
            other => panic!("expected a plan, got {other:?}"),
        }
    }

    fn phase(p: &Plan) -> Option<VmPhase> {
        p.status.as_ref().and_then(|s| s.phase)
    }

    #[test]
    fn deleting_finalizes_and_unplaced_resolvable_places() {
        let now = Timestamp::now();
        let mut v = vm(None, None);
        assert_eq!(
            decide_with(&v, &resolved(v.spec.clone()), None, now),
            Decision::Place
        );
        v.metadata.deletion_timestamp = Some(Time(now));
        assert_eq!(
            decide_with(&v, &resolved(v.spec.clone()), None, now),
            Decision::Finalize
        );
    }

    #[test]
    fn a_missing_reference_is_invalid_spec_with_one_event() {
        let now = Timestamp::now();
        let v = vm(None, None);
        let missing = Err(MissingRef::NoClass);
        let p = plan(decide_with(&v, &missing, None, now));
        assert_eq!(phase(&p), Some(VmPhase::Pending));
        assert_eq!(p.event.as_ref().unwrap().reason, "InvalidSpec");
        let mut again = v.clone();
        again.status = p.status.clone();
        let p2 = plan(decide_with(&again, &missing, None, now));
        assert!(p2.event.is_none(), "no second event for the same message");
        assert_eq!(p2.next, Next::Requeue(Settings::default().requeue_pending));
    }

    #[test]
    fn reset_clears_the_node_of_a_failed_vm_and_drops_the_annotation() {
        let now = Timestamp::now();
        let mut v = vm(Some("n1"), Some(VmPhase::Failed));
        v.annotations_mut()
            .insert(ANNOTATION_RESET_RETRIES.into(), "true".into());
        let p = plan(decide_with(&v, &resolved(v.spec.clone()), None, now));
        assert!(p.clear_node && p.drop_reset);
        assert_eq!(phase(&p), Some(VmPhase::Pending));
        assert_eq!(p.status.unwrap().node_name, None);
        // On a running VM the annotation is only removed.
        let mut r = vm(Some("n1"), Some(VmPhase::Running));
        r.annotations_mut()
            .insert(ANNOTATION_RESET_RETRIES.into(), "true".into());
        let p = plan(decide_with(&r, &resolved(r.spec.clone()), None, now));
        assert!(p.drop_reset && !p.clear_node && p.status.is_none());
    }

    #[test]
    fn a_pinned_vm_gets_finalizer_and_size_then_its_node_recorded() {
        let now = Timestamp::now();
        let mut v = vm(Some("n1"), None);
        v.metadata.finalizers = None;
        v.metadata.annotations = None;
        let p = plan(decide_with(&v, &resolved(v.spec.clone()), None, now));
        let meta = p.metadata.unwrap();
        assert_eq!(meta["finalizers"], json!([FINALIZER]));
        assert!(meta["annotations"][ANNOTATION_PLACED_RESOURCES].is_string());
        assert_eq!(p.next, Next::Continue);

        // Then its booking: what it resolves to now, which it keeps from then on.
        let mut unbooked = vm(Some("n1"), Some(VmPhase::Pending));
        unbooked.status.as_mut().unwrap().booking = None;
        let p = plan(decide_with(&unbooked, &resolved(v.spec.clone()), None, now));
        assert_eq!(p.doing, "recording the booking of");
        let booking = p.status.unwrap().booking.unwrap();
        assert_eq!((booking.class.vcpu, booking.class.memory_mib), (1, 512));
        assert_eq!(p.next, Next::Continue);

        let mut pending = vm(Some("n1"), Some(VmPhase::Pending));
        pending.status.as_mut().unwrap().node_name = None;
        let p = plan(decide_with(&pending, &resolved(v.spec.clone()), None, now));
        assert_eq!(phase(&p), Some(VmPhase::Scheduled));
        assert_eq!(p.next, Next::Continue);
        assert_eq!(p.event.unwrap().reason, "Scheduled");
    }

    #[test]
    fn suspended_vms_keep_their_node_and_phase_and_never_time_out() {
        let now = Timestamp::now();
        let ready = node(true, now);
        for ph in [VmPhase::Suspending, VmPhase::Suspended, VmPhase::Resuming] {
            let mut v = vm(Some("n1"), Some(ph));
            v.spec.desired_state = imp_api::shared::VmDesiredState::Suspended;
            // Started long ago: a Starting VM this old would have timed out.
            let st = v.status.as_mut().unwrap();
            st.started_at = Some(Time(now - Duration::from_secs(3600)));
            st.suspended_at = Some(Time(now - Duration::from_secs(3000)));
            st.suspend_snapshot_path = Some("/var/lib/imp/agent/snapshots/u".into());
            let d = decide_with(&v, &resolved(v.spec.clone()), Some(&ready), now);
            let p = plan(d);
            assert!(!p.clear_node && !p.delete, "{ph}: {p:?}");
            assert!(p.event.is_none(), "{ph}: {p:?}");
            let status = p.status.unwrap();
            assert_eq!(status.phase, Some(ph));
            assert_eq!(status.node_name.as_deref(), Some("n1"));
            assert!(status.suspend_snapshot_path.is_some() && status.suspended_at.is_some());
        }
    }

    #[test]
    fn terminal_phases_wait_for_a_change() {
        let now = Timestamp::now();
        for ph in [VmPhase::Succeeded, VmPhase::RetryExhausted] {
            let v = vm(Some("n1"), Some(ph));
            let p = plan(decide_with(&v, &resolved(v.spec.clone()), None, now));
            assert_eq!(p, Plan::stop(Next::AwaitChange));
        }
        let v = vm(Some("n1"), Some(VmPhase::Failed));
        let p = plan(decide_with(&v, &Err(MissingRef::NoClass), None, now));
        assert_eq!(p, Plan::stop(Next::AwaitChange));
    }

    #[test]
    fn node_loss_waits_the_grace_then_moves_ephemeral_and_fails_persistent() {
        let now = Timestamp::now();
        let v = vm(Some("n1"), Some(VmPhase::Running));
        let fresh = node(false, now);
        let p = plan(decide_with(
            &v,
            &resolved(v.spec.clone()),
            Some(&fresh),
            now,
        ));
        assert!(!p.clear_node && matches!(p.next, Next::Requeue(d) if d > Duration::ZERO));
        assert_eq!(phase(&p), Some(VmPhase::Running));

        let mut eph = v.spec.clone();
        eph.lifecycle = VmLifecycle::Ephemeral;
        let p = plan(decide_with(&v, &resolved(eph), None, now));
        assert!(p.clear_node);
        assert_eq!(phase(&p), Some(VmPhase::Pending));
        assert_eq!(p.event.unwrap().reason, "Rescheduling");

        let mut pers = v.spec.clone();
        pers.lifecycle = VmLifecycle::Persistent;
        let old = node(
            false,
            lifecycle::add(now, Duration::ZERO) - Duration::from_secs(600),
        );
        let p = plan(decide_with(&v, &resolved(pers), Some(&old), now));
        assert!(!p.clear_node);
        assert_eq!(phase(&p), Some(VmPhase::Failed));
        assert_eq!(p.event.unwrap().reason, "NodeLost");
    }

    #[test]
    fn a_vm_leaves_a_lost_node_only_once_its_agent_has_surely_fenced_it() {
        let now = Timestamp::now();
        let v = vm(Some("n1"), Some(VmPhase::Running));
        let mut eph = v.spec.clone();
        eph.lifecycle = VmLifecycle::Ephemeral;
        let r = resolved(eph);
        // NotReady for ten minutes: past the node-loss grace.
        let lost = node(false, now - Duration::from_secs(600));
        let settings = Settings::default();
        let with = |silent: u64| {
            decide(
                &v,
                &World {
                    now,
                    jitter: 0.5,
                    settings: &settings,
                    resolved: &r,
                    node: Some(&lost),
                    agent: Some(crate::placement::fencing::Silence {
                        silent: Duration::from_secs(silent),
                        deadline: Duration::from_secs(40),
                    }),
                },
            )
        };
        let p = plan(with(25));
        assert!(!p.clear_node, "the agent may still run it");
        assert_eq!(p.next, Next::Requeue(Duration::from_secs(10)));
        let c = p
            .status
            .as_ref()
            .unwrap()
            .conditions
            .iter()
            .find(|c| c.type_ == "NodeHealthy");
        let msg = &c.unwrap().message;
        assert!(
            msg.contains("renewed its Lease 25s ago") && msg.contains("40s"),
            "{msg}"
        );
        assert_eq!(plan(with(35)).next, Next::Requeue(Duration::from_secs(5)));
        let p = plan(with(40));
        assert!(p.clear_node, "fenced: moved");
        assert_eq!(p.event.unwrap().reason, "Rescheduling");
    }

    fn tainted(key: &str, since: Timestamp) -> Node {
        let mut n = node(true, since);
        n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
            taints: Some(vec![k8s_openapi::api::core::v1::Taint {
                key: key.into(),
                effect: "NoExecute".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        n
    }

    fn cond<'a>(p: &'a Plan, type_: &str) -> Option<&'a Condition> {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
    }

    #[test]
    fn a_no_execute_taint_evicts_after_the_tolerated_seconds_and_the_agent_releases_first() {
        let now = Timestamp::now();
        let v = vm(Some("n1"), Some(VmPhase::Running));
        let drain = tainted("drain", now);
        let mut spec = v.spec.clone();
        spec.lifecycle = VmLifecycle::Ephemeral;
        spec.tolerations = vec![Toleration {
            key: Some("drain".into()),
            operator: Some("Exists".into()),
            toleration_seconds: Some(30),
            ..Default::default()
        }];
        let r = resolved(spec.clone());
        // Tolerated: stays Running, says until when, and looks again then.
        let p = plan(decide_with(&v, &r, Some(&drain), now));
        assert_eq!(phase(&p), Some(VmPhase::Running));
        let c = cond(&p, "DisruptionTarget").unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "TaintTolerated")
        );
        assert!(c.message.contains("drain:NoExecute"), "{}", c.message);
        assert!(matches!(p.next, Next::Requeue(d) if d <= Duration::from_secs(31)));

        // Past the limit: Failed with Evicted where it is; the node stays for the agent.
        let later = now + Duration::from_secs(31);
        let mut seen = v.clone();
        seen.status = p.status.clone();
        let p = plan(decide_with(&seen, &r, Some(&drain), later));
        assert_eq!(phase(&p), Some(VmPhase::Failed));
        assert!(!p.clear_node, "its agent stops it and releases it");
        let c = cond(&p, "DisruptionTarget").unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Evicted"));
        assert!(c.message.contains("tolerated for 30s"), "{}", c.message);
        assert_eq!(p.event.as_ref().unwrap().reason, "Evicted");

        // Still on its Ready node: waits for the agent (also when a reset is asked for).
        let mut evicted = seen.clone();
        evicted.status = p.status.clone();
        let p = plan(decide_with(&evicted, &r, Some(&drain), later));
        assert_eq!((p.status.is_none(), p.clear_node), (true, false));
        let mut reset = evicted.clone();
        reset
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(ANNOTATION_RESET_RETRIES.into(), "true".into());
        let p = plan(decide_with(&reset, &r, Some(&drain), later));
        assert_eq!((p.status.is_none(), p.clear_node), (true, false));
        // Its node gone and no agent Lease: released by the operator, as node loss would.
        assert!(plan(decide_with(&evicted, &r, None, later)).clear_node);

        // Released by the agent: placed anew, the mark gone.
        evicted.spec.node_name = None;
        let p = plan(decide_with(&evicted, &r, None, later));
        assert_eq!(phase(&p), Some(VmPhase::Pending));
        assert!(cond(&p, "DisruptionTarget").is_none());
        assert_eq!(cond(&p, "Scheduled").unwrap().reason, "Evicted");
        assert_eq!(p.event.unwrap().reason, "Rescheduling");

        // Without any toleration: at once; with the taint gone: no mark.
        let p = plan(decide_with(
            &v,
            &resolved(v.spec.clone()),
            Some(&drain),
            now,
        ));
        assert_eq!(phase(&p), Some(VmPhase::Failed));
        let p = plan(decide_with(&seen, &r, Some(&node(true, now)), later));
        assert_eq!(phase(&p), Some(VmPhase::Running));
        assert!(cond(&p, "DisruptionTarget").is_none());
    }

    #[test]
    fn a_new_class_takes_a_running_persistent_vm_off_its_node_to_be_placed_anew() {
        let now = Timestamp::now();
        let mut v = vm(Some("n1"), Some(VmPhase::Running));
        let small = imp_api::shared::ClusterObjectRef {
            name: "small".into(),
        };
        let mut booked = v.spec.clone();
        booked.lifecycle = VmLifecycle::Persistent;
        booked.class_ref = Some(small);
        v.status.as_mut().unwrap().booking.as_mut().unwrap().spec = booked.clone();
        v.spec = booked.clone();
        v.spec.class_ref = Some(imp_api::shared::ClusterObjectRef { name: "big".into() });
        let r = resolved(booked);
        let p = plan(decide_with(&v, &r, Some(&node(true, now)), now));
        assert_eq!(phase(&p), Some(VmPhase::Pending));
        assert!(!p.clear_node, "its agent stops it and releases it");
        let c = cond(&p, "DisruptionTarget").unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "SpecChanged")
        );
        assert!(c.message.starts_with("classRef changed"), "{}", c.message);
        let event = p.event.as_ref().unwrap();
        assert_eq!(event.reason, "SpecChanged");
        assert_eq!(
            event.action,
            Some("Reschedule"),
            "not folded into a rollout's series"
        );

        // Until released: nothing else happens (no record of the node, no restart).
        let mut marked = v.clone();
        marked.status = p.status.clone();
        let p = plan(decide_with(&marked, &r, Some(&node(true, now)), now));
        assert_eq!((p.status.is_none(), p.clear_node), (true, false));

        // Released: the mark goes first (a new node's agent would release it), then placement.
        marked.spec.node_name = None;
        let p = plan(decide_with(&marked, &r, None, now));
        assert!(cond(&p, "DisruptionTarget").is_none());
        assert_eq!(p.next, Next::Continue);
        marked.status = p.status.clone();
        assert_eq!(decide_with(&marked, &r, None, now), Decision::Place);
    }

    #[test]
    fn the_node_lifecycle_taint_does_not_evict_and_a_fenced_agent_releases_itself() {
        let now = Timestamp::now();
        let v = vm(Some("n1"), Some(VmPhase::Running));
        // Ready with the unreachable taint still on (the node just came back): stays.
        let back = tainted("node.kubernetes.io/unreachable", now);
        let p = plan(decide_with(&v, &resolved(v.spec.clone()), Some(&back), now));
        assert_eq!(phase(&p), Some(VmPhase::Running));

        // Evicted, and its agent has been silent past its deadline: the operator releases it.
        let drain = tainted("drain", now);
        let mut evicted = v.clone();
        evicted.status = plan(decide_with(
            &v,
            &resolved(v.spec.clone()),
            Some(&drain),
            now,
        ))
        .status;
        let settings = Settings::default();
        let r = resolved(v.spec.clone());
        let world = |silent| World {
            now,
            jitter: 0.5,
            settings: &settings,
            resolved: &r,
            node: None,
            agent: Some(crate::placement::fencing::Silence {
                silent: Duration::from_secs(silent),
                deadline: Duration::from_secs(40),
            }),
        };
        assert!(!plan(decide(&evicted, &world(10))).clear_node);
        let p = plan(decide(&evicted, &world(40)));
        assert!(p.clear_node);
        assert_eq!(p.event.unwrap().reason, "Released");
        // A persistent VM that may not move, once released, follows its restart policy.
        evicted.spec.node_name = None;
        let mut pers = v.spec.clone();
        pers.lifecycle = VmLifecycle::Persistent;
        let p = plan(decide_with(&evicted, &resolved(pers), None, now));
        let retry = p.status.as_ref().and_then(|s| s.next_retry_after.as_ref());
        assert!(retry.is_some(), "the default policy's first backoff: {p:?}");
    }

    #[test]
    fn a_stuck_start_fails_and_an_expired_vm_is_deleted() {
        let now = Timestamp::now();
        let ready = node(true, now);
        let mut v = vm(Some("n1"), Some(VmPhase::Starting));
        v.status.as_mut().unwrap().started_at = Some(Time(now - Duration::from_secs(3600)));
        let p = plan(decide_with(
            &v,
            &resolved(v.spec.clone()),
            Some(&ready),
            now,
        ));
        assert_eq!(phase(&p), Some(VmPhase::Failed));
        let cond = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
            .unwrap();
        assert_eq!(cond.reason, "AgentTimeout");
        assert!(cond.message.contains("node n1"), "{}", cond.message);
        assert_eq!(p.status.as_ref().unwrap().finished_at, Some(Time(now)));
        assert_eq!(p.event.unwrap().reason, "AgentTimeout");

        let mut r = vm(Some("n1"), Some(VmPhase::Running));
        r.status.as_mut().unwrap().running_at = Some(Time(now - Duration::from_secs(120)));
        let mut spec = r.spec.clone();
        spec.inherited.expire_after = Some(GoDuration::from_static("1m"));
        let p = plan(decide_with(&r, &resolved(spec.clone()), Some(&ready), now));
        assert!(p.delete);
        assert_eq!(p.event.unwrap().reason, "Expired");

        spec.inherited.expire_after = Some(GoDuration::from_static("1h"));
        let p = plan(decide_with(&r, &resolved(spec), Some(&ready), now));
        assert!(!p.delete);
        assert!(matches!(p.next, Next::Requeue(d) if d <= Settings::default().requeue_running));
        assert!(p.status.unwrap().expires_at.is_some());
    }

    #[test]
    fn a_failed_persistent_vm_restarts_in_place_after_its_backoff() {
        let now = Timestamp::now();
        let mut v = vm(Some("n1"), Some(VmPhase::Failed));
        let mut spec = v.spec.clone();
        spec.lifecycle = VmLifecycle::Persistent;
        spec.inherited.restart_policy = Some(RestartPolicy {
            mode: RestartMode::InPlace,
            backoff: Some(BackoffPolicy {
                max_retries: 3,
                initial_delay: GoDuration::from_static("1s"),
                max_delay: GoDuration::from_static("1s"),
            }),
            ..RestartPolicy::default()
        });
        let p = plan(decide_with(&v, &resolved(spec.clone()), None, now));
        assert!(
            p.status.unwrap().next_retry_after.is_some(),
            "first: record"
        );
        v.status.as_mut().unwrap().next_retry_after = Some(Time(now - Duration::from_secs(1)));
        let p = plan(decide_with(&v, &resolved(spec), None, now));
        assert!(!p.clear_node);
        let st = p.status.unwrap();
        assert_eq!(st.phase, Some(VmPhase::Scheduled));
        assert_eq!(st.node_name.as_deref(), Some("n1"));
        assert_eq!(st.restart_count, Some(1));
    }

    fn ended_vm(phase: VmPhase, ran: Option<Timestamp>, finished: Option<Timestamp>) -> ImpVM {
        let mut v = vm(Some("n1"), Some(phase));
        let st = v.status.as_mut().unwrap();
        st.running_at = ran.map(Time);
        st.finished_at = finished.map(Time);
        v
    }

    fn expiring(lifecycle: VmLifecycle, after: &'static str) -> Result<Resolved, MissingRef> {
        resolved(ImpVMSpec {
            lifecycle,
            inherited: Inherited {
                expire_after: Some(GoDuration::from_static(after)),
                ..Default::default()
            },
            ..ImpVMSpec::default()
        })
    }

    #[test]
    fn an_ended_vm_is_deleted_once_its_expiry_passes() {
        let now = Timestamp::now();
        let ago = |s: u64| now - Duration::from_secs(s);
        // Ran two minutes ago and ended since: expired at runningAt + 1m.
        for ph in [VmPhase::Succeeded, VmPhase::Failed, VmPhase::RetryExhausted] {
            let v = ended_vm(ph, Some(ago(120)), Some(ago(10)));
            let r = expiring(VmLifecycle::Persistent, "1m");
            let p = plan(decide_with(&v, &r, None, now));
            assert!(p.delete, "{ph}: {p:?}");
            let note = p.event.unwrap();
            assert_eq!(note.reason, "Expired");
            assert!(note.message.contains("first ran"), "{}", note.message);
            let st = p.status.unwrap();
            assert_eq!(st.expires_at, Some(Time(ago(60))), "{ph}");
            assert_eq!(st.phase, Some(ph), "{ph}: not restarted");
        }
        // Ended without ever running: from finishedAt.
        let v = ended_vm(VmPhase::Failed, None, Some(ago(61)));
        let p = plan(decide_with(
            &v,
            &expiring(VmLifecycle::Ephemeral, "1m"),
            None,
            now,
        ));
        assert!(p.delete);
        assert!(p.event.unwrap().message.contains("the VM ended"));
        // expireAfter 0 never expires.
        let v = ended_vm(VmPhase::Succeeded, Some(ago(3600)), None);
        let p = plan(decide_with(
            &v,
            &expiring(VmLifecycle::Ephemeral, "0s"),
            None,
            now,
        ));
        assert_eq!(p, Plan::stop(Next::AwaitChange));
    }

    #[test]
    fn an_ended_vm_not_yet_expired_records_when_and_comes_back_then() {
        let now = Timestamp::now();
        let v = ended_vm(
            VmPhase::Succeeded,
            Some(now - Duration::from_secs(30)),
            None,
        );
        let p = plan(decide_with(
            &v,
            &expiring(VmLifecycle::Ephemeral, "1m"),
            None,
            now,
        ));
        assert!(!p.delete && p.event.is_none());
        let at = now + Duration::from_secs(30);
        assert_eq!(p.status.unwrap().expires_at, Some(Time(at)));
        assert_eq!(
            p.next,
            Next::Requeue(left(at, now) + Duration::from_millis(100))
        );

        // A hand-written Failed status with neither time: the end is stamped now.
        let v = ended_vm(VmPhase::Failed, None, None);
        let p = plan(decide_with(
            &v,
            &expiring(VmLifecycle::Ephemeral, "1m"),
            None,
            now,
        ));
        let st = p.status.unwrap();
        assert_eq!(st.finished_at, Some(Time(now)));
        assert_eq!(st.expires_at, Some(Time(now + Duration::from_secs(60))));

        // A Failed persistent VM waiting out its backoff comes back at the earlier of the two.
        let v = ended_vm(VmPhase::Failed, Some(now - Duration::from_secs(55)), None);
        let p = plan(decide_with(
            &v,
            &expiring(VmLifecycle::Persistent, "1m"),
            None,
            now,
        ));
        assert!(!p.delete);
        let st = p.status.unwrap();
        assert!(
            st.next_retry_after.is_some(),
            "the restart is still planned"
        );
        assert_eq!(
            p.next,
            Next::Requeue(Duration::from_secs(5) + Duration::from_millis(100))
        );
    }

    #[test]
    fn a_failed_persistent_vm_without_a_policy_restarts_by_default() {
        let now = Timestamp::now();
        let mut v = vm(Some("n1"), Some(VmPhase::Failed));
        let pers = resolved(ImpVMSpec {
            lifecycle: VmLifecycle::Persistent,
            ..ImpVMSpec::default()
        });
        let p = plan(decide_with(&v, &pers, None, now));
        let until = p.status.unwrap().next_retry_after.unwrap().0;
        // 10 s less up to 10 % jitter.
        let wait = left(until, now);
        assert!(
            wait >= Duration::from_secs(9) && wait <= Duration::from_secs(10),
            "{wait:?}"
        );
        v.status.as_mut().unwrap().next_retry_after = Some(Time(until));
        let p = plan(decide_with(&v, &pers, None, until));
        let note = p.event.unwrap();
        assert_eq!(note.reason, "Restarting");
        assert!(
            note.message.starts_with("attempt 1/5 (InPlace)")
                && note.message.contains("default restart policy"),
            "{}",
            note.message
        );
        let st = p.status.unwrap();
        assert_eq!(st.phase, Some(VmPhase::Scheduled));
        assert_eq!(st.node_name.as_deref(), Some("n1"));

        // Attempts used up: Failed for good.
        let st = v.status.as_mut().unwrap();
        st.restart_count = Some(5);
        st.next_retry_after = None;
        let p = plan(decide_with(&v, &pers, None, now));
        assert_eq!(p, Plan::stop(Next::AwaitChange));

        // An ephemeral VM without a policy ends.
        let v = vm(Some("n1"), Some(VmPhase::Failed));
        let p = plan(decide_with(&v, &resolved(ImpVMSpec::default()), None, now));
        assert_eq!(p, Plan::stop(Next::AwaitChange));
    }

    #[test]
    fn an_edit_of_a_running_persistent_vm_is_booked_and_restarts_it_when_it_boots_differently() {
        let now = Timestamp::now();
        let ready = node(true, now - Duration::from_secs(60));
        let mut v = vm(Some("n1"), Some(VmPhase::Running));
        let st = v.status.as_mut().unwrap();
        st.started_at = Some(Time(now));
        st.running_at = Some(Time(now));
        let booking = st.booking.as_mut().unwrap();
        booking.spec.lifecycle = VmLifecycle::Persistent;
        booking.spec.inherited.image = Some("app:1".into());
        let booked = booking.spec.clone();
        v.spec.lifecycle = VmLifecycle::Persistent;
        v.spec.inherited.image = Some("app:2".into());
        let p = plan(decide_with(
            &v,
            &resolved(booked.clone()),
            Some(&ready),
            now,
        ));
        assert_eq!(phase(&p), Some(VmPhase::Scheduled), "{p:?}");
        let st = p.status.clone().unwrap();
        assert_eq!(st.started_at, None, "the agent starts the new boot");
        assert!(
            st.running_at.is_some(),
            "expiry still counts from the first run"
        );
        let b = st.booking.unwrap();
        assert_eq!(
            (b.spec.inherited.image.as_deref(), b.revision),
            (Some("app:2"), 1)
        );
        let note = p.event.unwrap();
        assert_eq!(note.reason, "SpecChanged");
        assert!(
            note.message.starts_with("image changed: restarting"),
            "{}",
            note.message
        );

        // A probe edit is booked without a restart.
        let mut v2 = v.clone();
        v2.spec.inherited.image = Some("app:1".into());
        v2.spec.inherited.probes = Some(imp_api::shared::ProbeSpec::default());
        let p = plan(decide_with(
            &v2,
            &resolved(booked.clone()),
            Some(&ready),
            now,
        ));
        assert_eq!(phase(&p), Some(VmPhase::Running));
        assert_eq!(p.status.unwrap().booking.unwrap().revision, 0);

        // An ephemeral VM is not rolled.
        let mut job = v.clone();
        job.spec.lifecycle = VmLifecycle::Ephemeral;
        let b = job.status.as_mut().unwrap().booking.as_mut().unwrap();
        b.spec.lifecycle = VmLifecycle::Ephemeral;
        let spec = b.spec.clone();
        let p = plan(decide_with(&job, &resolved(spec), Some(&ready), now));
        assert!(
            p.event.is_none() && phase(&p) == Some(VmPhase::Running),
            "{p:?}"
        );
    }
}
