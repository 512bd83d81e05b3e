//! What a warm pool needs, as a pure function of the pool, its parent snapshot, its template,
//! its members, the nodes they run on and the time ([`plan`]).
//!
//! The controller ([`super`]) reads those, asks for a [`Plan`] and applies it in order:
//! deletions (each preconditioned on the member's resourceVersion), creations, the status,
//! then the Events. Members are ordinary ImpVMs restored from the parent's
//! `status.baseSnapshot` and placed by the VM controller; nothing here places a VM.

use std::collections::BTreeMap;
use std::time::Duration;

use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::shared::{
    ANNOTATION_CLAIMED_BY, ANNOTATION_MEMBER_STATE, LABEL_SNAPSHOT_PARENT, LABEL_WARM_POOL,
    LocalObjectRef, VmLifecycle,
};
use imp_api::snapshot::{ImpVMSnapshot, SnapshotPhase};
use imp_api::template::ImpVMTemplate;
use imp_api::validation;
use imp_api::vm::{ImpVM, ImpVMSpec, VmPhase};
use imp_api::{ImpWarmPool, pools::ImpWarmPoolStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};

/// The longest label value: a pool's name must fit, since its members carry it.
const MAX_LABEL_VALUE: usize = 63;

/// A member whose `expiresAt` is this close no longer counts as ready (a claim needs time).
const EXPIRY_MARGIN: Duration = Duration::from_secs(10);

/// Failures in a row from which new members wait ([`backoff`]).
pub const FAILURES_BEFORE_BACKOFF: i32 = 3;

/// The first back-off, doubled for every further failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(10);

/// The longest back-off.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// How long, from its claimant's creation, a member being handed over defers its
/// replacement: the replacement's restore would take the node's CPU from the claim it
/// follows (on two cores it slowed the claim's guest step from ~50 to ~120 ms). A claim that
/// takes longer (its agent down) no longer holds the pool short.
const REFILL_AFTER_CLAIM: Duration = Duration::from_secs(5);

/// Event reasons the controller publishes on the pool.
pub mod reason {
    /// A member was created.
    pub const MEMBER_CREATED: &str = "MemberCreated";
    /// A member was deleted (failed, ended, on a lost node, scaled down or rolled over).
    pub const MEMBER_DELETED: &str = "MemberDeleted";
    /// New members restore from another execution.
    pub const BASE_CHANGED: &str = "BaseChanged";
    /// The pool cannot make members: its spec names what is missing or unusable.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// A quota refused a new member.
    pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";
    /// Members fail in a row: new ones wait.
    pub const MEMBERS_FAILING: &str = "MembersFailing";
    /// A member became a claimant's VM: the member object is deleted.
    pub const CLAIMED: &str = "Claimed";
}

/// An Event to publish about the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// Warning rather than Normal.
    pub warning: bool,
    /// One of [`reason`].
    pub reason: &'static str,
    /// The Event's message.
    pub message: String,
    /// The member the Event is about (its `related` object), if any.
    pub member: Option<String>,
}

/// A member to delete, and why (the Event published once it is deleted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removal {
    /// The member's name.
    pub name: String,
    /// The resourceVersion it was judged at: the delete's precondition.
    pub resource_version: Option<String>,
    /// Published after the delete succeeded.
    pub note: Note,
}

/// Everything one reconcile of a pool does, in the order the controller does it.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Members to delete.
    pub delete: Vec<Removal>,
    /// Members to create (each with `generateName`).
    pub create: Vec<ImpVM>,
    /// The pool's whole desired status.
    pub status: ImpWarmPoolStatus,
    /// Events published after the status is written.
    pub notes: Vec<Note>,
    /// When to look again without a watch event (a back-off's end, a member's expiry).
    pub requeue_at: Option<Timestamp>,
}

/// What the plan reads besides the pool.
#[derive(Clone, Copy, Debug)]
pub struct World<'a> {
    /// The ImpVMSnapshot `spec.snapshotRef` names, if it exists.
    pub parent: Option<&'a ImpVMSnapshot>,
    /// The ImpVMTemplate `spec.templateName` names, if it exists.
    pub template: Option<&'a ImpVMTemplate>,
    /// The VMs labelled with the pool's name (those it does not control are ignored).
    pub members: &'a [ImpVM],
    /// The VMs labelled as claiming from the pool (`imp.dev/claimed-from`).
    pub claimants: &'a [ImpVM],
    /// Nodes no member should stay on, with why (NotReady, cordoned).
    pub unusable_nodes: &'a BTreeMap<String, String>,
    /// The decision's time.
    pub now: Timestamp,
}

/// How the plan sees one member.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Running and Ready on a usable node, not about to expire: claimable.
    Ready,
    /// On its way (Pending to Starting), or not ready for a while.
    Filling,
    /// Ended: failed or finished. Deleted and counted as a failure.
    Dead(String),
    /// On a node that is going away, or marked for eviction: deleted and refilled.
    Lost(String),
    /// Being deleted or stopped: neither counted nor touched.
    Gone,
    /// Taken by a claim (`imp.dev/claimed-by`): not a member any more; deleted once its
    /// claimant runs, or when the claim is given up.
    Claimed(String),
}

/// Whether `vm` is a member of `pool`: labelled with its name and controlled by it.
pub fn is_member_of(vm: &ImpVM, pool: &ImpWarmPool) -> bool {
    vm.labels().get(LABEL_WARM_POOL) == Some(&pool.name_any())
        && vm.namespace() == pool.namespace()
        && vm
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && Some(&o.uid) == pool.meta().uid.as_ref())
}

/// Whether `vm` is a member of `pool` taken by a claim: labelled with the pool, marked
/// `imp.dev/claimed-by` (a claim makes the claimant its owner in place of the pool).
fn taken_from(vm: &ImpVM, pool: &ImpWarmPool) -> bool {
    vm.labels().get(LABEL_WARM_POOL) == Some(&pool.name_any())
        && vm.namespace() == pool.namespace()
        && vm.annotations().contains_key(ANNOTATION_CLAIMED_BY)
}

/// The reason and message of condition `type_` of `vm`, if it has one.
fn condition(vm: &ImpVM, type_: ConditionType) -> Option<(String, String, bool)> {
    let c = conditions::find(&vm.status.as_ref()?.conditions, type_)?;
    Some((c.reason.clone(), c.message.clone(), c.status == "True"))
}

fn state(vm: &ImpVM, world: &World<'_>) -> State {
    if vm.meta().deletion_timestamp.is_some() {
        return State::Gone;
    }
    if let Some(by) = vm.annotations().get(ANNOTATION_CLAIMED_BY) {
        return State::Claimed(by.clone());
    }
    let status = vm.status.clone().unwrap_or_default();
    let phase = status.phase.unwrap_or(VmPhase::Pending);
    if matches!(
        phase,
        VmPhase::Failed | VmPhase::Succeeded | VmPhase::RetryExhausted
    ) {
        let why = match condition(vm, ConditionType::Ready) {
            Some((reason, message, _)) => format!("{phase:?}: {reason}: {message}"),
            None => format!("{phase:?}"),
        };
        return State::Dead(why);
    }
    if phase == VmPhase::Terminating {
        return State::Gone;
    }
    let node = status.node_name.as_deref().or(vm.spec.node_name.as_deref());
    if let Some(why) = node.and_then(|n| world.unusable_nodes.get(n).map(|w| (n, w))) {
        return State::Lost(format!("its node {} is {}", why.0, why.1));
    }
    if let Some((reason, message, true)) = condition(vm, ConditionType::DisruptionTarget) {
        return State::Lost(format!("it is to leave its node ({reason}: {message})"));
    }
    if running_and_ready(vm, world.now) {
        State::Ready
    } else {
        State::Filling
    }
}

/// Whether `vm` runs with its guest Ready and more than [`EXPIRY_MARGIN`] from its expiry at
/// `now`: what the pool counts as ready and a claim may take (besides its node and marks).
pub fn running_and_ready(vm: &ImpVM, now: Timestamp) -> bool {
    let Some(status) = &vm.status else {
        return false;
    };
    status.phase == Some(VmPhase::Running)
        && conditions::is_true(&status.conditions, ConditionType::Ready)
        && status.expires_at.as_ref().is_none_or(|t| {
            t.0.duration_since(now)
                .try_into()
                .is_ok_and(|d: Duration| d > EXPIRY_MARGIN)
        })
}

/// Why the pool cannot make members now, as the condition's reason and message.
fn blocked(pool: &ImpWarmPool, world: &World<'_>) -> Option<(ConditionReason, String)> {
    let ns = pool.namespace().unwrap_or_default();
    let invalid = |m: String| Some((ConditionReason::InvalidSpec, m));
    if let Err(e) = validation::warm_pool(&pool.spec) {
        return invalid(e.to_string());
    }
    let name = pool.name_any();
    if name.len() > MAX_LABEL_VALUE {
        return invalid(format!(
            "metadata.name: {} characters; members carry it in label {LABEL_WARM_POOL}, which \
             holds at most {MAX_LABEL_VALUE}: use a shorter name",
            name.len()
        ));
    }
    let Some(template) = world.template else {
        return invalid(format!(
            "spec.templateName: ImpVMTemplate {ns}/{} does not exist: create it or fix \
             spec.templateName",
            pool.spec.template_name
        ));
    };
    if template
        .spec
        .inherited
        .guest_agent
        .as_ref()
        .is_some_and(|a| !a.is_enabled())
    {
        return invalid(format!(
            "spec.templateName: ImpVMTemplate {ns}/{} turns the guest agent off \
             (guestAgent.enabled: false), and a VM restored from a snapshot needs it",
            pool.spec.template_name
        ));
    }
    let snap = &pool.spec.snapshot_ref;
    let Some(parent) = world.parent else {
        return invalid(format!(
            "spec.snapshotRef: ImpVMSnapshot {ns}/{snap} does not exist: create it or fix \
             spec.snapshotRef"
        ));
    };
    if let Some(of) = parent.labels().get(LABEL_SNAPSHOT_PARENT) {
        return invalid(format!(
            "spec.snapshotRef: ImpVMSnapshot {ns}/{snap} is an execution of {of}: name the \
             parent, whose elected base members restore from"
        ));
    }
    let status = parent.status.clone().unwrap_or_default();
    if status.base_snapshot.is_some() {
        return None;
    }
    if status.phase == Some(SnapshotPhase::Failed) {
        return Some((
            ConditionReason::SnapshotFailed,
            format!(
                "ImpVMSnapshot {ns}/{snap} has no base, and its newest execution failed: see \
                 its conditions"
            ),
        ));
    }
    Some((
        ConditionReason::NoBase,
        format!(
            "ImpVMSnapshot {ns}/{snap} has no status.baseSnapshot for members to restore from: \
             set its spec.baseSnapshot to one of its Succeeded executions \
             (kubectl patch impvmsnapshot {snap} -n {ns} --type merge -p \
             '{{\"spec\":{{\"baseSnapshot\":\"EXECUTION\"}}}}')"
        ),
    ))
}

/// The back-off after `failed` failures in a row, or `None` below
/// [`FAILURES_BEFORE_BACKOFF`]: 10s for the third, doubled for each further one, at most 5m.
pub fn backoff(failed: i32) -> Option<Duration> {
    let beyond = u32::try_from(failed - FAILURES_BEFORE_BACKOFF).ok()?;
    let factor = 2u32.saturating_pow(beyond.min(16));
    Some(FIRST_BACKOFF.saturating_mul(factor).min(MAX_BACKOFF))
}

/// The member object the pool creates, restoring from execution `base`.
pub fn member(pool: &ImpWarmPool, base: &str) -> ImpVM {
    let name = pool.name_any();
    let mut spec = ImpVMSpec {
        template_ref: Some(LocalObjectRef {
            name: pool.spec.template_name.clone(),
        }),
        snapshot_ref: Some(base.to_owned()),
        lifecycle: VmLifecycle::Ephemeral,
        ..ImpVMSpec::default()
    };
    spec.inherited.expire_after = pool.spec.expire_after.clone();
    ImpVM {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}-")),
            namespace: pool.namespace(),
            labels: Some(BTreeMap::from([(LABEL_WARM_POOL.to_owned(), name)])),
            annotations: pool
                .annotations()
                .get(ANNOTATION_MEMBER_STATE)
                .map(|v| BTreeMap::from([(ANNOTATION_MEMBER_STATE.to_owned(), v.clone())])),
            owner_references: pool.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// A member with its state, in creation order.
struct Sorted<'a> {
    vm: &'a ImpVM,
    state: State,
    current: bool,
}

fn created(vm: &ImpVM) -> (Option<Timestamp>, String) {
    (
        vm.meta().creation_timestamp.as_ref().map(|t| t.0),
        vm.name_any(),
    )
}

fn removal(vm: &ImpVM, warning: bool, why: String) -> Removal {
    let name = vm.name_any();
    Removal {
        resource_version: vm.resource_version(),
        note: Note {
            warning,
            reason: reason::MEMBER_DELETED,
            message: format!("deleted member {name}: {why}"),
            member: Some(name.clone()),
        },
        name,
    }
}

/// What pool `pool` needs now, given `world`.
pub fn plan(pool: &ImpWarmPool, world: &World<'_>) -> Plan {
    let old = pool.status.clone().unwrap_or_default();
    let base = world
        .parent
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.base_snapshot.clone());
    let mut members: Vec<Sorted<'_>> = world
        .members
        .iter()
        .filter(|vm| is_member_of(vm, pool) || taken_from(vm, pool))
        .map(|vm| Sorted {
            vm,
            state: state(vm, world),
            // With no base, what runs stays as it is: no member is of an old one.
            current: base.is_none() || vm.spec.snapshot_ref == base,
        })
        .collect();
    members.sort_by_key(|m| created(m.vm));

    let mut p = Plan {
        delete: Vec::new(),
        create: Vec::new(),
        status: ImpWarmPoolStatus {
            base_snapshot: base.clone(),
            observed_generation: pool.meta().generation,
            failed_in_a_row: old.failed_in_a_row,
            last_failure_at: old.last_failure_at.clone(),
            conditions: old.conditions.clone(),
            ..ImpWarmPoolStatus::default()
        },
        notes: Vec::new(),
        requeue_at: None,
    };
    // Claims in flight whose replacement waits (`REFILL_AFTER_CLAIM`).
    let mut deferred = 0_usize;
    let mut last_failure = None;
    // Ended, lost, or of an old base and not ready: out at once.
    members.retain(|m| match &m.state {
        State::Dead(why) => {
            p.delete
                .push(removal(m.vm, true, format!("it ended ({why})")));
            last_failure = Some(format!("member {} {why}", m.vm.name_any()));
            p.status.failed_in_a_row += 1;
            p.status.last_failure_at = Some(Time(world.now));
            false
        }
        State::Lost(why) => {
            p.delete.push(removal(m.vm, false, why.clone()));
            false
        }
        State::Filling if !m.current => {
            p.delete.push(removal(
                m.vm,
                false,
                "it restores from an old base and is not ready yet".into(),
            ));
            false
        }
        State::Claimed(by) => {
            match handed_over(m.vm, by, world.claimants) {
                Some(r) => p.delete.push(r),
                None => {
                    if let Some(due) = refill_due(by, world.claimants, world.now) {
                        deferred += 1;
                        p.requeue_at = earliest(p.requeue_at, Some(due));
                    }
                }
            }
            false
        }
        State::Gone => false,
        State::Ready | State::Filling => true,
    });
    p.status.claimed_count = count_claimed(world.claimants);
    if last_failure.is_none() && members.iter().any(|m| became_ready_since(m, &old)) {
        p.status.failed_in_a_row = 0;
    }
    resize(pool, &mut members, &mut p);
    let blocked = blocked(pool, world);
    let waiting = backoff_until(&p.status, world.now);
    let want = wanted(pool, &members);
    if let (None, None, Some(base)) = (&blocked, waiting, &base) {
        p.create = (0..want.saturating_sub(deferred))
            .map(|_| member(pool, base))
            .collect();
    }
    p.status.ready_count = count(&members, |m| m.state == State::Ready);
    if let Some(until) = waiting {
        p.requeue_at = Some(until);
    }
    p.requeue_at = earliest(p.requeue_at, next_expiry(&members, world.now));
    if let (Some(before), Some(now)) = (&old.base_snapshot, &base)
        && before != now
    {
        p.notes.push(Note {
            warning: false,
            reason: reason::BASE_CHANGED,
            message: format!(
                "new members restore from {now} (was {before}); members of {before} are \
                 replaced one at a time as new ones become ready"
            ),
            member: None,
        });
    }
    let ready = ready_condition(pool, &members, blocked, waiting, last_failure, &old);
    set_ready(&mut p, pool, ready, world.now);
    p
}

/// The deletion of member `vm`, claimed by VM `by`, once its claim is over: the claimant runs
/// (the member is its VM now), went another way, or is gone. `None` while the claim is in
/// flight.
fn handed_over(vm: &ImpVM, by: &str, claimants: &[ImpVM]) -> Option<Removal> {
    let member = vm.name_any();
    let claimant = claimants
        .iter()
        .find(|c| c.name_any() == by && c.meta().deletion_timestamp.is_none());
    let Some(c) = claimant else {
        return Some(removal(vm, false, format!("its claimant {by} is gone")));
    };
    let status = c.status.clone().unwrap_or_default();
    let claim = status.warm_claim.as_ref();
    if claim.is_some_and(|w| w.member.as_deref() != Some(member.as_str())) {
        return Some(removal(
            vm,
            false,
            format!("its claimant {by} started without it"),
        ));
    }
    let took = claim.is_some()
        && matches!(
            status.phase,
            Some(VmPhase::Running | VmPhase::Succeeded | VmPhase::Failed | VmPhase::RetryExhausted)
        );
    took.then(|| Removal {
        resource_version: vm.resource_version(),
        note: Note {
            warning: false,
            reason: reason::CLAIMED,
            message: format!("member {member} became ImpVM {by}; the member object is deleted"),
            member: Some(member.clone()),
        },
        name: member,
    })
}

/// When the replacement of a member being handed over to claimant `by` is due, while it is
/// still deferred at `now` (`REFILL_AFTER_CLAIM` after the claimant's creation); `None` once it
/// is due.
fn refill_due(by: &str, claimants: &[ImpVM], now: Timestamp) -> Option<Timestamp> {
    let c = claimants.iter().find(|c| c.name_any() == by)?;
    let created = c.meta().creation_timestamp.as_ref()?.0;
    let due = created.checked_add(REFILL_AFTER_CLAIM).ok()?;
    (due > now).then_some(due)
}

/// The claimants that took over a member and still exist.
fn count_claimed(claimants: &[ImpVM]) -> i32 {
    let took = claimants.iter().filter(|c| {
        c.meta().deletion_timestamp.is_none()
            && c.status
                .as_ref()
                .and_then(|s| s.warm_claim.as_ref())
                .is_some_and(|w| w.member.is_some())
    });
    i32::try_from(took.count()).unwrap_or(i32::MAX)
}

/// Whether member `m` is ready and became so after the pool's last failure.
fn became_ready_since(m: &Sorted<'_>, old: &ImpWarmPoolStatus) -> bool {
    let since = |t: &Time| {
        old.last_failure_at
            .as_ref()
            .is_none_or(|failed| t.0 > failed.0)
    };
    m.state == State::Ready
        && m.vm
            .status
            .as_ref()
            .and_then(|s| s.running_at.as_ref())
            .is_some_and(since)
}

/// When the back-off of `status` ends, if it is still on at `now`.
fn backoff_until(status: &ImpWarmPoolStatus, now: Timestamp) -> Option<Timestamp> {
    let wait = backoff(status.failed_in_a_row)?;
    let from = status.last_failure_at.as_ref()?.0;
    let until = from.checked_add(wait).ok()?;
    (until > now).then_some(until)
}

fn count(members: &[Sorted<'_>], f: impl Fn(&Sorted<'_>) -> bool) -> i32 {
    i32::try_from(members.iter().filter(|m| f(m)).count()).unwrap_or(i32::MAX)
}

/// Deletes what is beyond `size`: ready members of an old base once the current base has
/// enough ready ones (a rollover never lowers the ready count), then, beyond `size` (plus one
/// member of surge while rolling over), filling members newest first, then ready ones of an
/// old base, then ready ones oldest first.
fn resize(pool: &ImpWarmPool, members: &mut Vec<Sorted<'_>>, p: &mut Plan) {
    let size = pool.spec.size.max(0);
    let ready_cur = count(members, |m| m.current && m.state == State::Ready);
    let old_ready = count(members, |m| !m.current);
    let mut retire = (ready_cur + old_ready - size).clamp(0, old_ready);
    members.retain(|m| {
        if retire > 0 && !m.current {
            retire -= 1;
            p.delete.push(removal(
                m.vm,
                false,
                "rolled over: a member of the new base is ready in its place".into(),
            ));
            return false;
        }
        true
    });
    let rolling = members.iter().any(|m| !m.current);
    let cap = size + i32::from(rolling);
    let mut excess = i32::try_from(members.len()).unwrap_or(i32::MAX) - cap;
    let order: [&dyn Fn(&Sorted<'_>) -> bool; 3] =
        [&|m| m.state == State::Filling, &|m| !m.current, &|m| {
            m.state == State::Ready
        }];
    for (i, pick) in order.iter().enumerate() {
        let mut picked: Vec<usize> = (0..members.len()).filter(|&j| pick(&members[j])).collect();
        if i == 0 {
            picked.reverse();
        }
        for j in picked {
            if excess <= 0 {
                break;
            }
            let name = members[j].vm.name_any();
            if p.delete.iter().any(|d| d.name == name) {
                continue;
            }
            p.delete.push(removal(
                members[j].vm,
                false,
                format!("the pool keeps {size}"),
            ));
            excess -= 1;
        }
    }
    members.retain(|m| !p.delete.iter().any(|d| d.name == m.vm.name_any()));
}

/// How many members to create: up to `size` of the current base, and while rolling over no
/// more than one above `size` in all.
fn wanted(pool: &ImpWarmPool, members: &[Sorted<'_>]) -> usize {
    let size = pool.spec.size.max(0);
    let cur = count(members, |m| m.current);
    let total = i32::try_from(members.len()).unwrap_or(i32::MAX);
    let rolling = total > cur;
    let room = size + i32::from(rolling) - total;
    usize::try_from((size - cur).min(room)).unwrap_or(0)
}

fn next_expiry(members: &[Sorted<'_>], now: Timestamp) -> Option<Timestamp> {
    members
        .iter()
        .filter(|m| m.state == State::Ready)
        .filter_map(|m| m.vm.status.as_ref()?.expires_at.as_ref())
        .filter_map(|t| t.0.checked_sub(EXPIRY_MARGIN).ok())
        .filter(|t| *t > now)
        .min()
}

fn earliest(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The Ready condition's status, reason and message.
type Ready = (bool, ConditionReason, String);

fn ready_condition(
    pool: &ImpWarmPool,
    members: &[Sorted<'_>],
    blocked: Option<(ConditionReason, String)>,
    waiting: Option<Timestamp>,
    last_failure: Option<String>,
    old: &ImpWarmPoolStatus,
) -> Ready {
    let size = pool.spec.size.max(0);
    let ready = count(members, |m| m.state == State::Ready);
    if let Some((reason, message)) = blocked {
        return (false, reason, message);
    }
    if let Some(until) = waiting {
        // No new failure: the back-off and its message are those already written.
        let said = conditions::find(&old.conditions, ConditionType::Ready)
            .filter(|c| c.reason == ConditionReason::MembersFailing.as_str());
        if let (None, Some(c)) = (&last_failure, said) {
            return (false, ConditionReason::MembersFailing, c.message.clone());
        }
        return (
            false,
            ConditionReason::MembersFailing,
            format!(
                "{} members failed in a row, the last: {}; the next member is made at {until}",
                old.failed_in_a_row.max(FAILURES_BEFORE_BACKOFF),
                last_failure.unwrap_or_else(|| "not recorded".into())
            ),
        );
    }
    if ready >= size {
        return (
            true,
            ConditionReason::Reconciled,
            format!("{ready} of {size} members ready"),
        );
    }
    let held = members.iter().find_map(|m| {
        let (reason, message, ok) = condition(m.vm, ConditionType::Scheduled)?;
        let reason = match reason.parse::<ConditionReason>().ok()? {
            r @ (ConditionReason::NoNodeAvailable | ConditionReason::QuotaExceeded) if !ok => r,
            _ => return None,
        };
        Some((reason, format!("member {}: {message}", m.vm.name_any())))
    });
    if let Some((reason, message)) = held {
        return (false, reason, message);
    }
    let filling = count(members, |m| m.state == State::Filling);
    (
        false,
        ConditionReason::Waiting,
        format!("{ready} of {size} members ready, {filling} on their way"),
    )
}

fn set_ready(p: &mut Plan, pool: &ImpWarmPool, (ok, reason, message): Ready, now: Timestamp) {
    let was = conditions::find(&p.status.conditions, ConditionType::Ready)
        .map(|c| (c.reason.clone(), c.message.clone()));
    conditions::set(
        &mut p.status.conditions,
        ConditionType::Ready,
        ConditionStatus::from(ok),
        reason,
        message.clone(),
        pool.meta().generation,
        Time(now),
    );
    let warn = matches!(
        reason,
        ConditionReason::InvalidSpec
            | ConditionReason::MembersFailing
            | ConditionReason::SnapshotFailed
    );
    let said = was.is_some_and(|(r, m)| r == reason.as_str() && m == message);
    if warn && !said {
        let reason = match reason {
            ConditionReason::InvalidSpec => reason::INVALID_SPEC,
            ConditionReason::MembersFailing => reason::MEMBERS_FAILING,
            _ => "SnapshotFailed",
        };
        p.notes.push(Note {
            warning: true,
            reason,
            message,
            member: None,
        });
    }
}

#[cfg(test)]
mod tests;
