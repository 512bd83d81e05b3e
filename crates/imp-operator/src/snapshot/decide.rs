//! What a snapshot parent needs, as a pure function of the parent, its executions and the time.
//!
//! [`plan`] never calls the API: the controller ([`super`]) lists the executions, asks for a
//! [`Plan`], and applies it (deletions, the new execution, the status, then the Events).

use std::collections::{BTreeMap, BTreeSet};

use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::shared::{CoreLocalObjectRef, LABEL_SNAPSHOT_PARENT};
use imp_api::snapshot::{ImpVMSnapshot, ImpVMSnapshotStatus, SnapshotPhase};
use imp_api::validation;
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use k8s_openapi::jiff::tz::Offset;
use kube::{Resource, ResourceExt};

use super::cron::Schedule;

/// Annotation on each execution the operator creates: the operator's clock (RFC 3339, UTC,
/// whole seconds) when it decided to create it. The next tick of a schedule is counted from the
/// newest execution's value (its `creationTimestamp` when absent, e.g. for executions the Go
/// operator made), so an API server whose clock lags the operator's cannot make a tick fire twice.
pub const ANNOTATION_SCHEDULED_AT: &str = "imp.dev/scheduled-at";

/// The longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;

/// The longest label value; a parent's name must fit, since its executions carry it.
const MAX_LABEL_VALUE: usize = 63;

/// Event reasons the controller publishes.
pub mod reason {
    /// An execution was created.
    pub const EXECUTION_CREATED: &str = "ExecutionCreated";
    /// An execution beyond retention was deleted.
    pub const PRUNED: &str = "Pruned";
    /// `spec.schedule` does not parse, or never fires.
    pub const INVALID_SCHEDULE: &str = "InvalidSchedule";
    /// The parent's name cannot label its executions.
    pub const INVALID_NAME: &str = "InvalidName";
    /// `spec.baseSnapshot`'s execution succeeded and became `status.baseSnapshot`.
    pub const BASE_ELECTED: &str = "BaseElected";
    /// The spec names what a snapshot may not act on (`spec.sourceVMNamespace` of another
    /// namespace): nothing is taken.
    pub const INVALID_SPEC: &str = "InvalidSpec";
}

/// An Event to publish about the parent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// Warning rather than Normal.
    pub warning: bool,
    /// One of [`reason`].
    pub reason: &'static str,
    /// The Event's message.
    pub message: String,
    /// The execution the Event is about, if any (the Event's `related` object). Besides
    /// pointing at it, this keeps Events about different executions apart: the event recorder
    /// folds a repeat of the same reason about the same objects into a series that keeps the
    /// first message.
    pub execution: Option<String>,
}

impl Note {
    fn normal(reason: &'static str, message: String, execution: Option<String>) -> Self {
        Self {
            warning: false,
            reason,
            message,
            execution,
        }
    }

    fn warning(reason: &'static str, message: String) -> Self {
        Self {
            warning: true,
            reason,
            message,
            execution: None,
        }
    }
}

/// A new execution and the Event that tells of it once it is created.
#[derive(Clone, Debug, PartialEq)]
pub struct Execution {
    /// The object to create.
    pub object: ImpVMSnapshot,
    /// Published after the create succeeded.
    pub note: Note,
}

/// An execution to delete and the Event that tells of it once it is deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prune {
    /// The execution's name.
    pub name: String,
    /// Published after the delete succeeded.
    pub note: Note,
}

/// Everything one reconcile of a parent does, in the order the controller does it.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Executions beyond retention.
    pub prune: Vec<Prune>,
    /// The execution to create now, if one is due.
    pub create: Option<Execution>,
    /// The parent's whole desired status.
    pub status: ImpVMSnapshotStatus,
    /// Events published after the status is written.
    pub notes: Vec<Note>,
    /// When to look at the parent again without a watch event (the next tick); `None` waits
    /// for a change (no schedule, an invalid one, or an execution still running: its end
    /// triggers the parent).
    pub requeue_at: Option<Timestamp>,
}

/// When an execution was decided: [`ANNOTATION_SCHEDULED_AT`], else its creation time.
pub fn scheduled_at(child: &ImpVMSnapshot) -> Option<Timestamp> {
    child
        .annotations()
        .get(ANNOTATION_SCHEDULED_AT)
        .and_then(|v| v.parse::<Timestamp>().ok())
        .or_else(|| child.meta().creation_timestamp.as_ref().map(|t| t.0))
}

/// Whether `child` is an execution of `parent`: labelled with its name and not controlled by an
/// earlier object of the same name (whose executions the garbage collector is about to delete).
pub fn is_execution_of(child: &ImpVMSnapshot, parent: &ImpVMSnapshot) -> bool {
    if child.labels().get(LABEL_SNAPSHOT_PARENT) != Some(&parent.name_any())
        || child.namespace() != parent.namespace()
    {
        return false;
    }
    match (
        child
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true)),
        parent.uid(),
    ) {
        (Some(owner), Some(uid)) => owner.kind != "ImpVMSnapshot" || owner.uid == uid,
        _ => true,
    }
}

/// Marks an execution's status Failed at `now` for `why` (the Ready condition says so, with
/// `reason`: `SnapshotFailed`, or `InvalidSpec` for a spec that may never be taken).
pub fn fail_execution(
    status: &mut ImpVMSnapshotStatus,
    reason: ConditionReason,
    why: &str,
    now: Timestamp,
) {
    status.phase = Some(SnapshotPhase::Failed);
    status.terminated_at = Some(Time(now));
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        reason,
        why,
        None,
        Time(now),
    );
}

/// Why snapshot `s` (a parent or an execution) may never act: its `spec.sourceVMNamespace`
/// names another namespace than its own ([`validation::source_vm_namespace`]; the message
/// names the field). Judged before anything reads or takes the VM, so with the admission
/// webhook off no VM of another namespace is ever read, snapshotted or reported on.
pub fn foreign_source(s: &ImpVMSnapshot) -> Option<String> {
    let own = s.namespace().unwrap_or_default();
    validation::source_vm_namespace("snapshot", &s.spec.source_vm_namespace, &own)
        .err()
        .map(|f| f.to_string())
}

/// Why execution `exec` can never be taken, judged by the operator from its source VM, which
/// is `exec`'s own namespace's (`None` when the VM runs, or may still come to run: the node
/// agent takes it then). A `spec.sourceVMNamespace` of another namespace is
/// [`foreign_source`]'s, judged first.
pub fn source_problem(exec: &ImpVMSnapshot, vm: Option<&ImpVM>) -> Option<String> {
    let ns = exec.namespace().unwrap_or_default();
    let name = &exec.spec.source_vm_name;
    let Some(vm) = vm else {
        return Some(format!(
            "source VM {ns}/{name} not found (spec.sourceVMName)"
        ));
    };
    let phase = vm.status.as_ref().and_then(|s| s.phase);
    match phase {
        Some(p @ (VmPhase::Succeeded | VmPhase::Failed | VmPhase::Suspended)) => Some(format!(
            "source VM {ns}/{name} is {}; a snapshot is taken of a Running VM",
            p.as_str()
        )),
        _ => None,
    }
}

/// `<parent>-<UTC yyyymmdd-hhmmss>`, the parent part shortened so the whole is a valid object
/// name (at most 253 characters, no label of it ending in `-` or `.`).
pub fn execution_name(parent: &str, at: Timestamp) -> String {
    let stamp = Offset::UTC
        .to_datetime(at)
        .strftime("%Y%m%d-%H%M%S")
        .to_string();
    let room = MAX_NAME - stamp.len() - 1;
    let mut head = &parent[..parent.len().min(room)];
    while !head.is_char_boundary(head.len()) {
        head = &head[..head.len() - 1];
    }
    let head = head.trim_end_matches(['-', '.']);
    format!("{head}-{stamp}")
}

/// The execution `parent` starts at `now`: its spec without the schedule, its label, the
/// operator's time of decision, and `parent` as its controlling owner.
pub fn execution(parent: &ImpVMSnapshot, now: Timestamp) -> ImpVMSnapshot {
    let at = Timestamp::from_second(now.as_second()).unwrap_or(now);
    let mut spec = parent.spec.clone();
    spec.schedule = None;
    ImpVMSnapshot {
        metadata: ObjectMeta {
            name: Some(execution_name(&parent.name_any(), at)),
            namespace: parent.namespace(),
            labels: Some(BTreeMap::from([(
                LABEL_SNAPSHOT_PARENT.to_owned(),
                parent.name_any(),
            )])),
            annotations: Some(BTreeMap::from([(
                ANNOTATION_SCHEDULED_AT.to_owned(),
                at.to_string(),
            )])),
            owner_references: parent.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

fn phase(c: &ImpVMSnapshot) -> Option<SnapshotPhase> {
    c.status.as_ref().and_then(|s| s.phase)
}

fn terminated(c: &ImpVMSnapshot) -> bool {
    c.status.as_ref().is_some_and(|s| s.terminated_at.is_some())
}

/// The message of an execution's failing condition, if it wrote one.
fn failure(c: &ImpVMSnapshot) -> Option<&str> {
    c.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.status == "False" && !c.message.is_empty())
        .map(|c| c.message.as_str())
}

/// What the schedule says at `now`.
struct Verdict {
    /// Start an execution, for this reason (the end of the Event's message).
    start: Option<String>,
    /// `status.nextScheduledAt`.
    next: Option<Timestamp>,
    /// [`Plan::requeue_at`].
    requeue_at: Option<Timestamp>,
    /// The `Scheduled` condition: its reason and message, or the message of an invalid spec.
    health: Result<(ConditionReason, String), String>,
}

/// The schedule's verdict for `parent`, whose newest execution was decided at `anchor` (else
/// it was created then); `running` names an execution not finished yet; `never_ran` says no
/// execution exists or ever did.
fn schedule(
    parent: &ImpVMSnapshot,
    anchor: Timestamp,
    now: Timestamp,
    running: Option<&str>,
    never_ran: bool,
) -> Verdict {
    let mut v = Verdict {
        start: None,
        next: None,
        requeue_at: None,
        health: Ok((
            ConditionReason::Reconciled,
            "no schedule: one execution".to_owned(),
        )),
    };
    let expr = match parent.spec.schedule.as_deref().map(str::trim) {
        Some(e) if !e.is_empty() => e,
        _ => {
            if never_ran {
                v.start = Some("the one execution (no schedule)".to_owned());
            }
            return v;
        }
    };
    let cron = match Schedule::parse(expr) {
        Ok(c) => c,
        Err(e) => {
            v.health = Err(format!("spec.schedule {expr:?}: {e}"));
            return v;
        }
    };
    let Some(due) = cron.next_after(anchor) else {
        v.health = Err(format!("spec.schedule {expr:?} never fires"));
        return v;
    };
    let message = |next: Option<Timestamp>| match next {
        Some(n) => format!("{expr:?} (UTC): next execution at {n}"),
        None => format!("{expr:?} (UTC): no further tick"),
    };
    match running {
        _ if due > now => {
            v.next = Some(due);
            v.requeue_at = Some(due);
            v.health = Ok((ConditionReason::Reconciled, message(v.next)));
        }
        Some(r) => {
            // Its end triggers the parent; the due execution starts then.
            v.next = Some(due);
            v.health = Ok((
                ConditionReason::Waiting,
                format!(
                    "{expr:?} (UTC): the execution due at {due} waits for execution {r} to finish"
                ),
            ));
        }
        None => {
            v.start = Some(format!("the tick due at {due}"));
            v.next = cron.next_after(now);
            v.requeue_at = v.next;
            v.health = Ok((ConditionReason::Reconciled, message(v.next)));
        }
    }
    v
}

/// What `parent` needs at `now`, given every ImpVMSnapshot labelled as its execution.
///
/// - Executions being deleted are gone for every purpose but the schedule (they still count as
///   having run).
/// - Prune: of the finished executions (`status.terminatedAt` set), the newest `retention` are
///   kept and so are the base ones (`spec.baseSnapshot`, and `status.baseSnapshot` until a new
///   base is elected); the rest are deleted. A running execution is never deleted, nor counted
///   until it ends, so a new execution cannot push out a good one before it has succeeded.
/// - Base: `spec.baseSnapshot` becomes `status.baseSnapshot` once its execution has Succeeded;
///   until then the previous base stays, and clearing the spec clears it.
/// - One execution at a time: while one runs, none is created.
/// - No schedule: one execution, ever (none exists and `status.lastExecutionRef` is unset).
/// - A schedule: an execution when the next tick after the newest execution's
///   [`scheduled_at`] (else the parent's creation) has come; ticks missed meanwhile (the
///   operator was down, an execution ran long) give one execution, not one each.
/// - Status: `phase` mirrors the newest execution's (`Pending` before any or while it has
///   none), `lastExecutionRef` names it, `nextScheduledAt` is the tick the next execution is
///   due at; conditions `Scheduled` (the schedule's health) and `Ready` (the newest execution's
///   outcome).
pub fn plan(parent: &ImpVMSnapshot, children: &[ImpVMSnapshot], now: Timestamp) -> Plan {
    let old = parent.status.clone().unwrap_or_default();
    let mut status = old.clone();
    let mut notes = Vec::new();
    let execs = Executions::of(parent, children);

    status.base_snapshot = elect_base(parent, &old, &execs);
    if let Some(b) = &status.base_snapshot
        && old.base_snapshot.as_ref() != Some(b)
    {
        notes.push(Note::normal(
            reason::BASE_ELECTED,
            format!("execution {b} succeeded and is the base snapshot"),
            Some(b.clone()),
        ));
    }
    let prune = prune(parent, &old, &execs);

    let verdict = verdict(parent, &old, &execs, now);
    let create = verdict.start.map(|what| {
        let object = execution(parent, now);
        let note = Note::normal(
            reason::EXECUTION_CREATED,
            format!("created execution {} for {what}", object.name_any()),
            Some(object.name_any()),
        );
        Execution { object, note }
    });
    status.next_scheduled_at = verdict.next.map(Time);
    notes.extend(set_scheduled(
        &mut status,
        &old,
        parent,
        verdict.health,
        now,
    ));

    let newest = match &create {
        Some(c) => Some(Newest {
            name: c.object.name_any(),
            phase: None,
            failure: None,
        }),
        None => execs.newest_kept(&prune),
    };
    show_newest(&mut status, newest, parent.meta().generation, now);
    if let Some(why) = foreign_source(parent) {
        // Whatever its executions did, the parent as it stands takes nothing.
        conditions::set(
            &mut status.conditions,
            ConditionType::Ready,
            ConditionStatus::False,
            ConditionReason::InvalidSpec,
            why,
            parent.meta().generation,
            Time(now),
        );
    }

    Plan {
        prune,
        create,
        status,
        notes,
        requeue_at: verdict.requeue_at,
    }
}

/// A parent's executions as [`plan`] reads them.
struct Executions<'a> {
    /// Every execution, oldest first (by [`scheduled_at`], then name).
    all: Vec<&'a ImpVMSnapshot>,
    /// Those not being deleted: gone for every purpose but the schedule.
    live: Vec<&'a ImpVMSnapshot>,
}

impl<'a> Executions<'a> {
    fn of(parent: &ImpVMSnapshot, children: &'a [ImpVMSnapshot]) -> Self {
        let mut all: Vec<&ImpVMSnapshot> = children
            .iter()
            .filter(|c| is_execution_of(c, parent))
            .collect();
        all.sort_by_key(|c| (scheduled_at(c), c.name_any()));
        let live = all
            .iter()
            .copied()
            .filter(|c| c.meta().deletion_timestamp.is_none())
            .collect();
        Self { all, live }
    }

    /// When the schedule counts from: the newest execution's [`scheduled_at`], else the
    /// parent's creation, else `now`.
    fn anchor(&self, parent: &ImpVMSnapshot, now: Timestamp) -> Timestamp {
        self.all
            .last()
            .and_then(|c| scheduled_at(c))
            .or_else(|| parent.meta().creation_timestamp.as_ref().map(|t| t.0))
            .unwrap_or(now)
    }

    /// The first live execution that has not finished.
    fn running(&self) -> Option<String> {
        self.live
            .iter()
            .find(|c| !terminated(c))
            .map(|c| c.name_any())
    }

    /// Whether live execution `name` has Succeeded.
    fn succeeded(&self, name: &str) -> bool {
        self.live
            .iter()
            .any(|c| c.name_any() == name && phase(c) == Some(SnapshotPhase::Succeeded))
    }

    /// The live executions that have finished, oldest first.
    fn finished(&self) -> Vec<&'a ImpVMSnapshot> {
        self.live
            .iter()
            .copied()
            .filter(|c| terminated(c))
            .collect()
    }

    /// The newest live execution that `prune` does not delete.
    fn newest_kept(&self, prune: &[Prune]) -> Option<Newest> {
        self.live
            .iter()
            .rev()
            .find(|c| !prune.iter().any(|p| p.name == c.name_any()))
            .map(|c| Newest {
                name: c.name_any(),
                phase: phase(c),
                failure: failure(c).map(str::to_owned),
            })
    }
}

/// `status.baseSnapshot`: `spec.baseSnapshot` once its execution has Succeeded; until then the
/// previous base while it still has; none once the spec is cleared.
fn elect_base(
    parent: &ImpVMSnapshot,
    old: &ImpVMSnapshotStatus,
    execs: &Executions,
) -> Option<String> {
    match parent.spec.base_snapshot.as_deref() {
        Some(b) if execs.succeeded(b) => Some(b.to_owned()),
        Some(_) => old.base_snapshot.clone().filter(|b| execs.succeeded(b)),
        None => None,
    }
}

/// The finished executions beyond the newest `spec.retention`, base ones excepted.
fn prune(parent: &ImpVMSnapshot, old: &ImpVMSnapshotStatus, execs: &Executions) -> Vec<Prune> {
    let retention = usize::try_from(parent.spec.retention.max(1)).unwrap_or(1);
    let protected = |n: &str| {
        parent.spec.base_snapshot.as_deref() == Some(n) || old.base_snapshot.as_deref() == Some(n)
    };
    let finished = execs.finished();
    let beyond = finished.len().saturating_sub(retention);
    finished[..beyond]
        .iter()
        .map(|c| c.name_any())
        .filter(|n| !protected(n))
        .map(|n| Prune {
            note: Note::normal(
                reason::PRUNED,
                format!(
                    "deleted execution {n}: the newest {retention} finished executions are kept"
                ),
                Some(n.clone()),
            ),
            name: n,
        })
        .collect()
}

/// The executions VM `vm` names: its `spec.snapshotRef` and its booking's.
pub fn snapshots_of(vm: &ImpVM) -> Vec<String> {
    let booked = vm
        .status
        .as_ref()
        .and_then(|s| s.booking.as_ref())
        .and_then(|b| b.spec.snapshot_ref.clone());
    [vm.spec.snapshot_ref.clone(), booked]
        .into_iter()
        .flatten()
        .collect()
}

/// The executions the VMs `vms` not being deleted restore from ([`snapshots_of`]): a VM
/// restarted, rescheduled or booted again restores from it.
pub fn restored_from(vms: &[ImpVM]) -> BTreeSet<String> {
    vms.iter()
        .filter(|v| v.meta().deletion_timestamp.is_none())
        .flat_map(snapshots_of)
        .collect()
}

/// Takes out of `plan`'s prunes the executions in `in_use` ([`restored_from`]): retention
/// never deletes what a live VM would restore from; they go once no VM names them.
pub fn spare(plan: &mut Plan, in_use: &BTreeSet<String>) {
    plan.prune.retain(|p| !in_use.contains(&p.name));
}

/// Whether `name` is too long to label the parent's executions with.
fn name_too_long(name: &str) -> bool {
    name.len() > MAX_LABEL_VALUE
}

/// The schedule's [`Verdict`], or an invalid one for a name that cannot label executions.
fn verdict(
    parent: &ImpVMSnapshot,
    old: &ImpVMSnapshotStatus,
    execs: &Executions,
    now: Timestamp,
) -> Verdict {
    let name = parent.name_any();
    let invalid = |why: String| Verdict {
        health: Err(why),
        start: None,
        next: None,
        requeue_at: None,
    };
    if name_too_long(&name) {
        return invalid(format!(
            "the name is {} characters long: its executions carry it in label \
             {LABEL_SNAPSHOT_PARENT}, which holds at most {MAX_LABEL_VALUE}; use a shorter name",
            name.len()
        ));
    }
    if let Some(why) = foreign_source(parent) {
        return invalid(why);
    }
    let never_ran = execs.all.is_empty() && old.last_execution_ref.is_none();
    let anchor = execs.anchor(parent, now);
    schedule(parent, anchor, now, execs.running().as_deref(), never_ran)
}

/// Sets the `Scheduled` condition from the schedule's health; an invalid spec is also told in
/// a Warning Event, unless the condition already said the same.
fn set_scheduled(
    status: &mut ImpVMSnapshotStatus,
    old: &ImpVMSnapshotStatus,
    parent: &ImpVMSnapshot,
    health: Result<(ConditionReason, String), String>,
    now: Timestamp,
) -> Option<Note> {
    let generation = parent.meta().generation;
    let (why, message) = match health {
        Ok((why, message)) => {
            conditions::set(
                &mut status.conditions,
                ConditionType::Scheduled,
                ConditionStatus::True,
                why,
                message,
                generation,
                Time(now),
            );
            return None;
        }
        Err(message) => (ConditionReason::InvalidSpec, message),
    };
    let changed = conditions::find(&old.conditions, ConditionType::Scheduled)
        .is_none_or(|c| c.status != "False" || c.message != message);
    conditions::set(
        &mut status.conditions,
        ConditionType::Scheduled,
        ConditionStatus::False,
        why,
        message.clone(),
        generation,
        Time(now),
    );
    let reason = if name_too_long(&parent.name_any()) {
        reason::INVALID_NAME
    } else if foreign_source(parent).is_some() {
        reason::INVALID_SPEC
    } else {
        reason::INVALID_SCHEDULE
    };
    changed.then(|| Note::warning(reason, message))
}

/// The newest execution, as the parent shows it.
struct Newest {
    name: String,
    phase: Option<SnapshotPhase>,
    /// The message of its failing condition.
    failure: Option<String>,
}

/// The parent's `phase`, `lastExecutionRef` and `Ready` condition, from its newest execution.
fn show_newest(
    status: &mut ImpVMSnapshotStatus,
    newest: Option<Newest>,
    generation: Option<i64>,
    now: Timestamp,
) {
    let (ready, why, message) = match &newest {
        None => (
            ConditionStatus::Unknown,
            ConditionReason::Waiting,
            "no execution yet".to_owned(),
        ),
        Some(Newest {
            name: n,
            phase: Some(SnapshotPhase::Succeeded),
            ..
        }) => (
            ConditionStatus::True,
            ConditionReason::Completed,
            format!("execution {n} succeeded"),
        ),
        Some(Newest {
            name: n,
            phase: Some(SnapshotPhase::Failed),
            failure,
        }) => (
            ConditionStatus::False,
            ConditionReason::Failed,
            match failure {
                Some(c) => format!("execution {n} failed: {c}"),
                None => format!("execution {n} failed"),
            },
        ),
        Some(Newest { name: n, phase, .. }) => (
            ConditionStatus::Unknown,
            ConditionReason::Waiting,
            format!(
                "execution {n} is {}",
                match phase {
                    Some(SnapshotPhase::Running) => "running",
                    _ => "pending",
                }
            ),
        ),
    };
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ready,
        why,
        message,
        generation,
        Time(now),
    );
    status.phase = Some(
        newest
            .as_ref()
            .and_then(|n| n.phase)
            .unwrap_or(SnapshotPhase::Pending),
    );
    if let Some(n) = newest {
        status.last_execution_ref = Some(CoreLocalObjectRef { name: n.name });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use imp_api::snapshot::{ImpVMSnapshotSpec, SnapshotStorage};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn parent(name: &str, schedule: Option<&str>, retention: i32) -> ImpVMSnapshot {
        let mut p = ImpVMSnapshot::new(
            name,
            ImpVMSnapshotSpec {
                source_vm_name: "vm".into(),
                source_vm_namespace: "default".into(),
                schedule: schedule.map(str::to_owned),
                retention,
                storage: SnapshotStorage::default(),
                base_snapshot: None,
            },
        );
        p.metadata.namespace = Some("default".into());
        p.metadata.uid = Some("parent-uid".into());
        p.metadata.generation = Some(1);
        p.metadata.creation_timestamp = Some(Time(t("2025-03-04T10:00:30Z")));
        p
    }

    /// An execution of `p` decided at `at`, finished (`Some(phase)` with terminatedAt) or not.
    fn child(p: &ImpVMSnapshot, at: &str, done: Option<SnapshotPhase>) -> ImpVMSnapshot {
        let mut c = execution(p, t(at));
        c.metadata.creation_timestamp = Some(Time(t(at)));
        c.status = Some(ImpVMSnapshotStatus {
            phase: done.or(Some(SnapshotPhase::Running)),
            terminated_at: done.map(|_| Time(t(at))),
            ..Default::default()
        });
        c
    }

    fn names(p: &Plan) -> Vec<&str> {
        p.prune.iter().map(|p| p.name.as_str()).collect()
    }

    fn cond<'a>(
        s: &'a ImpVMSnapshotStatus,
        ty: &str,
    ) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        s.conditions.iter().find(|c| c.type_ == ty).unwrap()
    }

    #[test]
    fn one_shot_creates_one_execution_and_only_once() {
        let p = parent("nightly", None, 3);
        let now = t("2025-03-04T10:00:31.5Z");
        let plan = plan(&p, &[], now);
        let c = plan.create.as_ref().unwrap();
        assert_eq!(c.object.name_any(), "nightly-20250304-100031");
        assert_eq!(c.object.spec.schedule, None);
        assert_eq!(c.object.spec.source_vm_name, "vm");
        assert_eq!(
            c.object
                .labels()
                .get(LABEL_SNAPSHOT_PARENT)
                .map(String::as_str),
            Some("nightly")
        );
        assert_eq!(
            c.object
                .annotations()
                .get(ANNOTATION_SCHEDULED_AT)
                .map(String::as_str),
            Some("2025-03-04T10:00:31Z")
        );
        let owner = &c.object.owner_references()[0];
        assert_eq!(
            (
                owner.kind.as_str(),
                owner.name.as_str(),
                owner.uid.as_str(),
                owner.controller
            ),
            ("ImpVMSnapshot", "nightly", "parent-uid", Some(true))
        );
        assert_eq!(c.note.reason, reason::EXECUTION_CREATED);
        assert!(
            c.note.message.contains("nightly-20250304-100031"),
            "{}",
            c.note.message
        );
        assert_eq!(plan.status.phase, Some(SnapshotPhase::Pending));
        assert_eq!(
            plan.status.last_execution_ref.as_ref().unwrap().name,
            "nightly-20250304-100031"
        );
        assert_eq!(plan.status.next_scheduled_at, None);
        assert_eq!(plan.requeue_at, None);

        // Once it exists, or once the parent says one was made (even if deleted since): none.
        let done = child(&p, "2025-03-04T10:00:31Z", Some(SnapshotPhase::Succeeded));
        assert!(
            super::plan(&p, std::slice::from_ref(&done), now)
                .create
                .is_none()
        );
        let mut p2 = p.clone();
        p2.status = Some(plan.status.clone());
        let again = super::plan(&p2, &[], now);
        assert!(again.create.is_none());
        assert_eq!(
            again.status.last_execution_ref,
            plan.status.last_execution_ref
        );
    }

    #[test]
    fn parent_mirrors_its_newest_execution() {
        let p = parent("s", None, 3);
        let now = t("2025-03-04T11:00:00Z");
        let running = child(&p, "2025-03-04T10:01:00Z", None);
        let plan1 = plan(&p, std::slice::from_ref(&running), now);
        assert_eq!(plan1.status.phase, Some(SnapshotPhase::Running));
        assert_eq!(cond(&plan1.status, "Ready").status, "Unknown");
        assert!(cond(&plan1.status, "Ready").message.contains("running"));

        let ok = child(&p, "2025-03-04T10:01:00Z", Some(SnapshotPhase::Succeeded));
        let plan2 = plan(&p, std::slice::from_ref(&ok), now);
        assert_eq!(plan2.status.phase, Some(SnapshotPhase::Succeeded));
        assert_eq!(cond(&plan2.status, "Ready").status, "True");
        assert_eq!(cond(&plan2.status, "Ready").reason, "Completed");

        let mut bad = child(&p, "2025-03-04T10:01:00Z", Some(SnapshotPhase::Failed));
        bad.status.as_mut().unwrap().conditions.push(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: "SourceNotFound".into(),
                message: "ImpVM default/vm not found".into(),
                last_transition_time: Time(now),
                observed_generation: None,
            },
        );
        let plan3 = plan(&p, std::slice::from_ref(&bad), now);
        assert_eq!(plan3.status.phase, Some(SnapshotPhase::Failed));
        let ready = cond(&plan3.status, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "Failed")
        );
        assert!(
            ready
                .message
                .ends_with("failed: ImpVM default/vm not found"),
            "{}",
            ready.message
        );

        let none = plan(&parent("fresh", Some("0 0 1 1 *"), 3), &[], now);
        assert_eq!(none.status.phase, Some(SnapshotPhase::Pending));
        assert_eq!(cond(&none.status, "Ready").message, "no execution yet");
    }

    #[test]
    fn schedule_waits_for_its_tick_then_fires_once() {
        let p = parent("s", Some("* * * * *"), 3);
        // Created 10:00:30: the first tick is 10:01.
        let before = plan(&p, &[], t("2025-03-04T10:00:45Z"));
        assert!(before.create.is_none());
        assert_eq!(before.requeue_at, Some(t("2025-03-04T10:01:00Z")));
        assert_eq!(
            before.status.next_scheduled_at,
            Some(Time(t("2025-03-04T10:01:00Z")))
        );
        assert_eq!(cond(&before.status, "Scheduled").status, "True");

        // The requeue lands at (or just after) the tick: it fires (the Go project's did not).
        let at = plan(&p, &[], t("2025-03-04T10:01:00.003Z"));
        let c = at.create.as_ref().unwrap();
        assert_eq!(c.object.name_any(), "s-20250304-100100");
        assert_eq!(at.requeue_at, Some(t("2025-03-04T10:02:00Z")));
        assert_eq!(
            at.status.next_scheduled_at,
            Some(Time(t("2025-03-04T10:02:00Z")))
        );
        assert_eq!(
            at.status.last_execution_ref.as_ref().unwrap().name,
            "s-20250304-100100"
        );

        // The next reconcile sees it: running, so nothing more even when the next tick comes.
        let running = child(&p, "2025-03-04T10:01:00Z", None);
        let wait = plan(
            &p,
            std::slice::from_ref(&running),
            t("2025-03-04T10:02:30Z"),
        );
        assert!(wait.create.is_none());
        assert_eq!(wait.requeue_at, None);
        assert_eq!(cond(&wait.status, "Scheduled").reason, "Waiting");
        assert!(
            cond(&wait.status, "Scheduled")
                .message
                .contains("s-20250304-100100"),
            "{}",
            cond(&wait.status, "Scheduled").message
        );

        // Finished before the next tick: wait for it.
        let done = child(&p, "2025-03-04T10:01:00Z", Some(SnapshotPhase::Succeeded));
        let next = plan(&p, std::slice::from_ref(&done), t("2025-03-04T10:01:20Z"));
        assert!(next.create.is_none());
        assert_eq!(next.requeue_at, Some(t("2025-03-04T10:02:00Z")));
        let fires = plan(&p, std::slice::from_ref(&done), t("2025-03-04T10:02:00Z"));
        assert_eq!(fires.create.unwrap().object.name_any(), "s-20250304-100200");
    }

    #[test]
    fn missed_ticks_collapse_into_one_execution() {
        let p = parent("s", Some("*/5 * * * *"), 3);
        let old = child(&p, "2025-03-04T10:05:00Z", Some(SnapshotPhase::Succeeded));
        // Down from 10:06 to 11:07: one execution now, the next tick after now.
        let plan = plan(&p, std::slice::from_ref(&old), t("2025-03-04T11:07:12Z"));
        let c = plan.create.unwrap();
        assert!(
            c.note.message.contains("due at 2025-03-04T10:10:00Z"),
            "{}",
            c.note.message
        );
        assert_eq!(plan.requeue_at, Some(t("2025-03-04T11:10:00Z")));
        let newer = child(&p, "2025-03-04T11:07:12Z", None);
        let after = super::plan(&p, &[old, newer], t("2025-03-04T11:07:13Z"));
        assert!(after.create.is_none());
    }

    #[test]
    fn the_operators_clock_not_the_servers_anchors_the_schedule() {
        let p = parent("s", Some("* * * * *"), 3);
        // Decided at 10:01:00 by the operator, stamped 10:00:59 by a lagging API server.
        let mut c = child(&p, "2025-03-04T10:01:00Z", Some(SnapshotPhase::Succeeded));
        c.metadata.creation_timestamp = Some(Time(t("2025-03-04T10:00:59Z")));
        assert!(
            plan(&p, std::slice::from_ref(&c), t("2025-03-04T10:01:01Z"))
                .create
                .is_none()
        );
        // Without the annotation (an execution of the Go operator) creationTimestamp counts.
        c.metadata.annotations = None;
        c.metadata.creation_timestamp = Some(Time(t("2025-03-04T10:01:00Z")));
        assert!(
            plan(&p, std::slice::from_ref(&c), t("2025-03-04T10:01:01Z"))
                .create
                .is_none()
        );
        assert!(
            plan(&p, std::slice::from_ref(&c), t("2025-03-04T10:02:00Z"))
                .create
                .is_some()
        );
    }

    #[test]
    fn retention_spares_what_a_live_vm_restores_from() {
        let p = parent("s", None, 1);
        let ok = Some(SnapshotPhase::Succeeded);
        let kids = vec![
            child(&p, "2025-03-01T00:00:00Z", ok),
            child(&p, "2025-03-02T00:00:00Z", ok),
            child(&p, "2025-03-03T00:00:00Z", ok),
            child(&p, "2025-03-04T00:00:00Z", ok),
        ];
        let vm = |name: &str, spec: serde_json::Value, status: serde_json::Value| -> ImpVM {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": spec, "status": status}))
            .unwrap()
        };
        let mut gone = vm(
            "gone",
            serde_json::json!({"snapshotRef": "s-20250303-000000"}),
            serde_json::json!({}),
        );
        gone.metadata.deletion_timestamp = Some(Time(t("2025-03-05T00:00:00Z")));
        let vms = [
            // Restores from its spec's execution.
            vm(
                "clone",
                serde_json::json!({"snapshotRef": "s-20250301-000000"}),
                serde_json::json!({}),
            ),
            // Booked with one (a warm pool member, or a spec changed since).
            vm(
                "booked",
                serde_json::json!({}),
                serde_json::json!({"booking": {"class": {"vcpu": 1, "memoryMiB": 128, "diskGiB": 1},
                                               "spec": {"snapshotRef": "s-20250302-000000"}}}),
            ),
            // Being deleted: needs nothing.
            gone,
        ];
        let in_use = restored_from(&vms);
        assert_eq!(
            in_use.iter().map(String::as_str).collect::<Vec<_>>(),
            ["s-20250301-000000", "s-20250302-000000"]
        );
        let mut plan = plan(&p, &kids, t("2025-03-05T00:00:10Z"));
        assert_eq!(
            names(&plan),
            [
                "s-20250301-000000",
                "s-20250302-000000",
                "s-20250303-000000"
            ]
        );
        spare(&mut plan, &in_use);
        assert_eq!(names(&plan), ["s-20250303-000000"]);
    }

    #[test]
    fn retention_prunes_the_oldest_finished_never_the_base_or_a_running_one() {
        let mut p = parent("s", None, 2);
        p.spec.base_snapshot = Some("s-20250301-000000".into());
        let ok = Some(SnapshotPhase::Succeeded);
        let kids = vec![
            child(&p, "2025-03-01T00:00:00Z", ok), // base
            child(&p, "2025-03-02T00:00:00Z", Some(SnapshotPhase::Failed)),
            child(&p, "2025-03-03T00:00:00Z", ok),
            child(&p, "2025-03-04T00:00:00Z", ok),
            child(&p, "2025-03-05T00:00:00Z", ok),
            child(&p, "2025-03-06T00:00:00Z", None), // running
        ];
        let plan = plan(&p, &kids, t("2025-03-06T00:00:10Z"));
        assert_eq!(names(&plan), ["s-20250302-000000", "s-20250303-000000"]);
        assert!(plan.prune.iter().all(|p| p.note.reason == reason::PRUNED));
        assert_eq!(
            plan.status.base_snapshot.as_deref(),
            Some("s-20250301-000000")
        );
        assert!(
            plan.notes.iter().any(
                |n| n.reason == reason::BASE_ELECTED && n.message.contains("s-20250301-000000")
            )
        );
        // The newest is the running one.
        assert_eq!(plan.status.phase, Some(SnapshotPhase::Running));
        assert_eq!(
            plan.status.last_execution_ref.unwrap().name,
            "s-20250306-000000"
        );

        // Within retention: nothing; being deleted already: not counted, not deleted again.
        assert!(
            super::plan(&p, &kids[3..], t("2025-03-06T00:00:10Z"))
                .prune
                .is_empty()
        );
        let mut deleting = kids.clone();
        for k in &mut deleting[1..3] {
            k.metadata.deletion_timestamp = Some(Time(t("2025-03-06T00:00:05Z")));
        }
        assert!(
            super::plan(&p, &deleting, t("2025-03-06T00:00:10Z"))
                .prune
                .is_empty()
        );
    }

    #[test]
    fn base_is_elected_once_succeeded_and_kept_until_replaced() {
        let mut p = parent("s", None, 1);
        let a = child(&p, "2025-03-01T00:00:00Z", Some(SnapshotPhase::Succeeded));
        let b = child(&p, "2025-03-02T00:00:00Z", None);
        p.spec.base_snapshot = Some(a.name_any());
        let first = plan(&p, &[a.clone(), b.clone()], t("2025-03-02T00:00:01Z"));
        assert_eq!(first.status.base_snapshot, Some(a.name_any()));
        assert_eq!(first.notes.len(), 1);

        // Electing b while it runs keeps a (and a is not pruned, b not counted yet).
        p.status = Some(first.status.clone());
        p.spec.base_snapshot = Some(b.name_any());
        let pending = plan(&p, &[a.clone(), b.clone()], t("2025-03-02T00:00:02Z"));
        assert_eq!(pending.status.base_snapshot, Some(a.name_any()));
        assert!(pending.prune.is_empty());
        assert!(pending.notes.is_empty());

        // b succeeds and is elected; a, the base until now, goes on the round after.
        let b_ok = child(&p, "2025-03-02T00:00:00Z", Some(SnapshotPhase::Succeeded));
        let elected = plan(&p, &[a.clone(), b_ok.clone()], t("2025-03-02T00:01:00Z"));
        assert_eq!(elected.status.base_snapshot, Some(b.name_any()));
        assert!(elected.prune.is_empty());
        p.status = Some(elected.status.clone());
        let next = plan(&p, &[a.clone(), b_ok.clone()], t("2025-03-02T00:01:01Z"));
        assert_eq!(names(&next), [a.name_any().as_str()]);

        // A base that failed is never elected; clearing the spec clears the status.
        let mut q = parent("q", None, 3);
        let f = child(&q, "2025-03-01T00:00:00Z", Some(SnapshotPhase::Failed));
        q.spec.base_snapshot = Some(f.name_any());
        assert_eq!(
            plan(&q, std::slice::from_ref(&f), t("2025-03-02T00:00:00Z"))
                .status
                .base_snapshot,
            None
        );
        q.spec.base_snapshot = None;
        q.status = Some(ImpVMSnapshotStatus {
            base_snapshot: Some(f.name_any()),
            ..Default::default()
        });
        assert_eq!(
            plan(&q, std::slice::from_ref(&f), t("2025-03-02T00:00:00Z"))
                .status
                .base_snapshot,
            None
        );
    }

    #[test]
    fn invalid_schedule_is_a_condition_and_one_event() {
        let p = parent("s", Some("61 * * * *"), 3);
        let plan1 = plan(&p, &[], t("2025-03-04T10:05:00Z"));
        assert!(plan1.create.is_none());
        assert_eq!(plan1.requeue_at, None);
        assert_eq!(plan1.status.next_scheduled_at, None);
        let c = cond(&plan1.status, "Scheduled");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "InvalidSpec")
        );
        assert_eq!(
            c.message,
            "spec.schedule \"61 * * * *\": minute field: \"61\": 61 is out of range 0-59"
        );
        assert_eq!(
            plan1.notes,
            [Note::warning(reason::INVALID_SCHEDULE, c.message.clone())]
        );
        // Said once: the next reconcile of the same spec is quiet.
        let mut p2 = p.clone();
        p2.status = Some(plan1.status.clone());
        let plan2 = plan(&p2, &[], t("2025-03-04T10:06:00Z"));
        assert!(plan2.notes.is_empty());
        assert_eq!(plan2.status, plan1.status);

        let never = plan(
            &parent("s", Some("0 0 30 2 *"), 3),
            &[],
            t("2025-03-04T10:05:00Z"),
        );
        assert!(
            cond(&never.status, "Scheduled")
                .message
                .ends_with("never fires")
        );
        assert!(never.create.is_none());
    }

    #[test]
    fn a_name_too_long_for_the_label_creates_nothing() {
        let long = "a".repeat(64);
        let plan = plan(&parent(&long, None, 3), &[], t("2025-03-04T10:05:00Z"));
        assert!(plan.create.is_none());
        assert_eq!(plan.notes[0].reason, reason::INVALID_NAME);
        assert!(cond(&plan.status, "Scheduled").message.contains("63"));
    }

    #[test]
    fn execution_names_are_valid_object_names() {
        let at = t("2025-03-04T10:05:09Z");
        assert_eq!(execution_name("nightly", at), "nightly-20250304-100509");
        let long = format!("{}.b-c", "x".repeat(234));
        let n = execution_name(&long, at);
        assert_eq!(n.len(), 252, "{n}");
        assert!(n.ends_with("x.b-20250304-100509"), "{n}");
        let dotted = format!("{}.-z", "y".repeat(235));
        let n = execution_name(&dotted, at);
        assert!(n.len() <= 253);
        assert!(n.ends_with("y-20250304-100509"), "{n}");
    }

    #[test]
    fn executions_of_another_parent_or_an_earlier_one_of_the_same_name_are_not_ours() {
        let p = parent("s", None, 3);
        let mut other = child(&parent("t", None, 3), "2025-03-04T10:00:00Z", None);
        assert!(!is_execution_of(&other, &p));
        other
            .labels_mut()
            .insert(LABEL_SNAPSHOT_PARENT.into(), "s".into());
        other.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "imp.dev/v1alpha1".into(),
            kind: "ImpVMSnapshot".into(),
            name: "s".into(),
            uid: "earlier-uid".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        assert!(!is_execution_of(&other, &p));
        other.metadata.owner_references = None;
        assert!(is_execution_of(&other, &p));
    }

    #[test]
    fn an_execution_whose_vm_is_gone_or_ended_cannot_be_taken() {
        let p = parent("s", None, 3);
        let mut e = child(&p, "2026-12-04T10:00:00Z", None);
        e.metadata.namespace = Some("ns".into());
        e.spec.source_vm_name = "vm".into();
        e.spec.source_vm_namespace = "ns".into();
        let why = source_problem(&e, None).unwrap_or_default();
        assert!(why.contains("ns/vm not found"), "{why}");
        let mut vm = ImpVM::new("vm", Default::default());
        assert_eq!(source_problem(&e, Some(&vm)), None, "not placed yet: wait");
        vm.status = Some(imp_api::vm::ImpVMStatus {
            phase: Some(VmPhase::Suspended),
            ..Default::default()
        });
        let why = source_problem(&e, Some(&vm)).unwrap_or_default();
        assert!(why.contains("Suspended"), "{why}");
        vm.status = Some(imp_api::vm::ImpVMStatus {
            phase: Some(VmPhase::Running),
            ..Default::default()
        });
        assert_eq!(source_problem(&e, Some(&vm)), None);
        let mut st = ImpVMSnapshotStatus::default();
        fail_execution(
            &mut st,
            ConditionReason::SnapshotFailed,
            &why,
            t("2026-12-04T10:00:00Z"),
        );
        assert_eq!(st.phase, Some(SnapshotPhase::Failed));
        assert!(st.terminated_at.is_some());
        assert_eq!(st.conditions[0].reason, "SnapshotFailed");
    }

    const FOREIGN: &str = "spec.sourceVMNamespace: must be the snapshot's own namespace \"default\" (or empty), got \"victim\"";

    #[test]
    fn a_parent_naming_another_namespaces_vm_makes_no_execution_and_says_why() {
        for schedule in [None, Some("* * * * *")] {
            let mut p = parent("s", schedule, 3);
            p.spec.source_vm_namespace = "victim".into();
            let plan = plan(&p, &[], t("2025-03-04T10:05:00Z"));
            assert!(plan.create.is_none(), "{schedule:?}");
            assert_eq!(plan.requeue_at, None);
            let s = cond(&plan.status, "Scheduled");
            assert_eq!(
                (s.status.as_str(), s.reason.as_str(), s.message.as_str()),
                ("False", "InvalidSpec", FOREIGN)
            );
            let r = cond(&plan.status, "Ready");
            assert_eq!(
                (r.status.as_str(), r.reason.as_str(), r.message.as_str()),
                ("False", "InvalidSpec", FOREIGN)
            );
            assert_eq!(
                plan.notes,
                [Note::warning(reason::INVALID_SPEC, FOREIGN.to_owned())]
            );
            // Told once: the same condition again makes no second Event.
            let mut again = p.clone();
            again.status = Some(plan.status.clone());
            let plan = super::plan(&again, &[], t("2025-03-04T10:06:00Z"));
            assert!(plan.notes.is_empty() && plan.create.is_none());
        }
        // Its own namespace, or none: executions as usual.
        for own in ["default", ""] {
            let mut p = parent("s", None, 3);
            p.spec.source_vm_namespace = own.into();
            assert!(plan(&p, &[], t("2025-03-04T10:05:00Z")).create.is_some());
        }
    }

    #[test]
    fn an_execution_naming_another_namespace_is_foreign_whoever_made_it() {
        let p = parent("s", None, 3);
        let mut e = child(&p, "2026-12-04T10:00:00Z", None);
        assert_eq!(foreign_source(&e), None);
        e.spec.source_vm_namespace = String::new();
        assert_eq!(foreign_source(&e), None);
        e.spec.source_vm_namespace = "victim".into();
        assert_eq!(foreign_source(&e).as_deref(), Some(FOREIGN));
        // The VM looked up is always the execution's own namespace's.
        let why = source_problem(&e, None).unwrap_or_default();
        assert!(why.contains("default/vm not found"), "{why}");
    }
}
