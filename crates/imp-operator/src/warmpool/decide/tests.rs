#![allow(clippy::unwrap_used)]

use super::*;
use serde_json::{Value, json};

const NS: &str = "ci";
const POOL_UID: &str = "pool-uid";

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

fn pool(size: i32) -> ImpWarmPool {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
        "metadata": {"name": "py", "namespace": NS, "uid": POOL_UID, "generation": 4},
        "spec": {"snapshotRef": "py-warm", "templateName": "python", "size": size,
                 "expireAfter": "1h"}
    }))
    .unwrap()
}

fn with_status(mut p: ImpWarmPool, status: Value) -> ImpWarmPool {
    p.status = Some(serde_json::from_value(status).unwrap());
    p
}

fn parent(base: Option<&str>, phase: Option<&str>) -> ImpVMSnapshot {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
        "metadata": {"name": "py-warm", "namespace": NS},
        "spec": {"sourceVMName": "src", "sourceVMNamespace": NS,
                 "storage": {"type": "node-local"}},
        "status": {"baseSnapshot": base, "phase": phase}
    }))
    .unwrap()
}

fn template(agent: bool) -> ImpVMTemplate {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate",
        "metadata": {"name": "python", "namespace": NS},
        "spec": {"classRef": {"name": "small"}, "image": "python:3",
                 "guestAgent": {"enabled": agent}}
    }))
    .unwrap()
}

/// A member created at `t(created)`, restoring from `base`, in `phase`, Ready or not.
fn vm(name: &str, created: i64, base: &str, phase: &str, ready: bool) -> ImpVM {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": format!("rv-{name}"),
                     "creationTimestamp": t(created).to_string(),
                     "labels": {LABEL_WARM_POOL: "py"},
                     "ownerReferences": [{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
                                          "name": "py", "uid": POOL_UID, "controller": true}]},
        "spec": {"templateRef": {"name": "python"}, "snapshotRef": base, "lifecycle": "ephemeral"},
        "status": {"phase": phase, "nodeName": "n1", "runningAt": t(created + 5).to_string(),
                   "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"},
                                   "reason": "R", "message": "m",
                                   "lastTransitionTime": t(0).to_string()}]}
    }))
    .unwrap()
}

fn running(name: &str, created: i64, base: &str) -> ImpVM {
    vm(name, created, base, "Running", true)
}

fn starting(name: &str, created: i64, base: &str) -> ImpVM {
    vm(name, created, base, "Starting", false)
}

struct Case {
    pool: ImpWarmPool,
    parent: Option<ImpVMSnapshot>,
    template: Option<ImpVMTemplate>,
    members: Vec<ImpVM>,
    claimants: Vec<ImpVM>,
    unusable: BTreeMap<String, String>,
    now: Timestamp,
}

impl Case {
    fn new(size: i32, members: Vec<ImpVM>) -> Self {
        Self {
            pool: pool(size),
            parent: Some(parent(Some("e1"), Some("Succeeded"))),
            template: Some(template(true)),
            members,
            claimants: Vec::new(),
            unusable: BTreeMap::new(),
            now: t(100),
        }
    }

    fn plan(&self) -> Plan {
        plan(
            &self.pool,
            &World {
                parent: self.parent.as_ref(),
                template: self.template.as_ref(),
                members: &self.members,
                claimants: &self.claimants,
                unusable_nodes: &self.unusable,
                now: self.now,
            },
        )
    }
}

fn ready(p: &Plan) -> (String, String, String) {
    let c = conditions::find(&p.status.conditions, ConditionType::Ready).unwrap();
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

fn deleted(p: &Plan) -> Vec<&str> {
    p.delete.iter().map(|d| d.name.as_str()).collect()
}

fn bases(p: &Plan) -> Vec<&str> {
    p.create
        .iter()
        .map(|v| v.spec.snapshot_ref.as_deref().unwrap())
        .collect()
}

#[test]
fn an_empty_pool_makes_size_members_restoring_from_the_base() {
    let p = Case::new(2, vec![]).plan();
    assert_eq!(bases(&p), ["e1", "e1"]);
    let m = &p.create[0];
    assert_eq!(m.metadata.generate_name.as_deref(), Some("py-"));
    assert_eq!(m.namespace().as_deref(), Some(NS));
    assert_eq!(
        m.labels().get(LABEL_WARM_POOL).map(String::as_str),
        Some("py")
    );
    let owner = &m.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("ImpWarmPool", POOL_UID, Some(true))
    );
    assert_eq!(m.spec.template_ref.as_ref().unwrap().name, "python");
    assert_eq!(m.spec.lifecycle, VmLifecycle::Ephemeral);
    assert_eq!(
        m.spec
            .inherited
            .expire_after
            .as_ref()
            .map(ToString::to_string),
        Some("1h".into())
    );
    assert!(m.spec.class_ref.is_none() && m.spec.env.is_empty());
    // What the pool makes passes the rules a user's VM must pass.
    validation::vm(&m.spec).unwrap();
    assert_eq!(p.status.base_snapshot.as_deref(), Some("e1"));
    assert_eq!(p.status.observed_generation, Some(4));
    assert_eq!(p.status.ready_count, 0);
    // Members wait paused unless the pool says they wait running, which they are told.
    assert!(m.annotations().is_empty());
    let mut c = Case::new(1, vec![]);
    c.pool.metadata.annotations =
        Some([(ANNOTATION_MEMBER_STATE.to_owned(), "running".to_owned())].into());
    assert_eq!(
        c.plan().create[0]
            .annotations()
            .get(ANNOTATION_MEMBER_STATE)
            .map(String::as_str),
        Some("running")
    );
    let (status, reason, msg) = ready(&p);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "Waiting"));
    assert_eq!(msg, "0 of 2 members ready, 0 on their way");
    assert!(p.notes.is_empty());
}

#[test]
fn a_full_pool_is_ready_and_does_nothing() {
    let p = Case::new(2, vec![running("a", 1, "e1"), running("b", 2, "e1")]).plan();
    assert!(p.create.is_empty() && p.delete.is_empty());
    assert_eq!(p.status.ready_count, 2);
    assert_eq!(
        ready(&p),
        (
            "True".into(),
            "Reconciled".into(),
            "2 of 2 members ready".into()
        )
    );
}

#[test]
fn filling_members_are_counted_and_not_doubled() {
    let p = Case::new(2, vec![running("a", 1, "e1"), starting("b", 2, "e1")]).plan();
    assert!(p.create.is_empty() && p.delete.is_empty());
    assert_eq!(p.status.ready_count, 1);
    assert_eq!(ready(&p).2, "1 of 2 members ready, 1 on their way");
}

#[test]
fn vms_the_pool_does_not_control_are_not_members() {
    let mut stranger = running("x", 1, "e1");
    stranger.metadata.owner_references = None;
    let mut other_pool = running("y", 1, "e1");
    other_pool.metadata.owner_references.as_mut().unwrap()[0].uid = "older-pool".into();
    let p = Case::new(1, vec![stranger, other_pool]).plan();
    assert_eq!(p.create.len(), 1);
    assert!(p.delete.is_empty(), "{:?}", p.delete);
}

#[test]
fn no_base_makes_nothing_and_says_how_to_elect_one() {
    let mut c = Case::new(2, vec![]);
    c.parent = Some(parent(None, Some("Succeeded")));
    let p = c.plan();
    assert!(p.create.is_empty());
    let (status, reason, msg) = ready(&p);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "NoBase"));
    assert!(
        msg.contains("ImpVMSnapshot ci/py-warm has no status.baseSnapshot")
            && msg.contains("kubectl patch impvmsnapshot py-warm -n ci"),
        "{msg}"
    );
    // Its newest execution failed: said so.
    c.parent = Some(parent(None, Some("Failed")));
    assert_eq!(ready(&c.plan()).1, "SnapshotFailed");
}

#[test]
fn a_spec_naming_what_cannot_serve_is_invalid_and_makes_nothing() {
    let mut c = Case::new(2, vec![]);
    c.template = None;
    let (_, reason, msg) = ready(&c.plan());
    assert_eq!(reason, "InvalidSpec");
    assert!(
        msg.starts_with("spec.templateName: ImpVMTemplate ci/python does not exist"),
        "{msg}"
    );
    let p = c.plan();
    assert!(p.create.is_empty());
    assert_eq!(p.notes[0].reason, reason::INVALID_SPEC);
    assert!(p.notes[0].warning);

    let mut c = Case::new(2, vec![]);
    c.template = Some(template(false));
    assert!(ready(&c.plan()).2.contains("turns the guest agent off"));

    let mut c = Case::new(2, vec![]);
    c.parent = None;
    assert!(
        ready(&c.plan())
            .2
            .starts_with("spec.snapshotRef: ImpVMSnapshot ci/py-warm does not exist")
    );

    let mut c = Case::new(2, vec![]);
    let mut exec = parent(Some("e1"), None);
    exec.metadata.labels = Some(BTreeMap::from([(
        LABEL_SNAPSHOT_PARENT.into(),
        "py-warm".into(),
    )]));
    c.parent = Some(exec);
    let p = c.plan();
    assert!(p.create.is_empty());
    assert!(
        ready(&p).2.contains("is an execution of py-warm"),
        "{:?}",
        ready(&p)
    );

    let mut c = Case::new(-1, vec![]);
    c.pool.spec.size = -1;
    assert!(ready(&c.plan()).2.contains("spec.size: must be at least 0"));

    let mut c = Case::new(1, vec![]);
    c.pool.metadata.name = Some("p".repeat(64));
    assert!(ready(&c.plan()).2.contains("holds at most 63"));
}

#[test]
fn an_invalid_spec_is_warned_of_once() {
    let mut c = Case::new(2, vec![]);
    c.template = None;
    let first = c.plan();
    c.pool.status = Some(first.status.clone());
    let again = c.plan();
    assert!(again.notes.is_empty(), "{:?}", again.notes);
    assert_eq!(again.status, first.status);
}

#[test]
fn a_dead_member_is_deleted_counted_and_replaced() {
    let mut dead = vm("a", 1, "e1", "Failed", false);
    let cond = &mut dead.status.as_mut().unwrap().conditions[0];
    cond.reason = "VmmExited".into();
    cond.message = "qemu said no".into();
    let p = Case::new(2, vec![dead, running("b", 2, "e1")]).plan();
    assert_eq!(deleted(&p), ["a"]);
    assert!(p.delete[0].note.warning);
    assert_eq!(
        p.delete[0].note.message,
        "deleted member a: it ended (Failed: VmmExited: qemu said no)"
    );
    assert_eq!(p.delete[0].resource_version.as_deref(), Some("rv-a"));
    assert_eq!(p.create.len(), 1);
    assert_eq!(p.status.failed_in_a_row, 1);
    assert_eq!(p.status.last_failure_at, Some(Time(t(100))));
}

#[test]
fn the_third_failure_in_a_row_backs_off_and_says_why_once() {
    let mut c = Case::new(1, vec![vm("c", 1, "e1", "Failed", false)]);
    c.pool = with_status(
        pool(1),
        json!({"readyCount": 0, "failedInARow": 2, "lastFailureAt": t(90).to_string()}),
    );
    let p = c.plan();
    assert_eq!(deleted(&p), ["c"]);
    assert!(p.create.is_empty(), "made a member during the back-off");
    assert_eq!(p.status.failed_in_a_row, 3);
    assert_eq!(p.requeue_at, Some(t(110)));
    let (status, reason, msg) = ready(&p);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "MembersFailing")
    );
    assert!(
        msg.starts_with("3 members failed in a row, the last: member c Failed: R: m;")
            && msg.contains(&t(110).to_string()),
        "{msg}"
    );
    assert_eq!(p.notes.len(), 1);
    assert_eq!(p.notes[0].reason, reason::MEMBERS_FAILING);

    // Looked at again within the back-off (the member's deletion): the same, and no Event.
    c.members.clear();
    c.pool.status = Some(p.status.clone());
    c.now = t(105);
    let again = c.plan();
    assert!(again.create.is_empty() && again.notes.is_empty());
    assert_eq!(again.status, p.status);
    assert_eq!(again.requeue_at, Some(t(110)));

    // Once it ends, one member is made.
    c.now = t(111);
    let after = c.plan();
    assert_eq!(after.create.len(), 1);
    assert_eq!(ready(&after).1, "Waiting");
}

#[test]
fn backoff_doubles_from_ten_seconds_to_five_minutes() {
    let secs = |n| backoff(n).map(|d| d.as_secs());
    assert_eq!(
        [
            secs(0),
            secs(2),
            secs(3),
            secs(4),
            secs(5),
            secs(8),
            secs(9),
            secs(1000)
        ],
        [
            None,
            None,
            Some(10),
            Some(20),
            Some(40),
            Some(300),
            Some(300),
            Some(300)
        ]
    );
}

#[test]
fn a_member_ready_after_the_last_failure_ends_the_streak() {
    let mut c = Case::new(1, vec![running("a", 95, "e1")]);
    c.pool = with_status(
        pool(1),
        json!({"failedInARow": 2, "lastFailureAt": t(90).to_string()}),
    );
    assert_eq!(c.plan().status.failed_in_a_row, 0);
    // Running since before the failure: it proves nothing about new members.
    c.members = vec![running("a", 10, "e1")];
    assert_eq!(c.plan().status.failed_in_a_row, 2);
}

#[test]
fn a_member_on_a_lost_node_or_to_be_evicted_is_replaced() {
    let mut evicted = running("b", 2, "e1");
    evicted.status.as_mut().unwrap().node_name = Some("n2".into());
    evicted.status.as_mut().unwrap().conditions.push(
        serde_json::from_value(json!({"type": "DisruptionTarget", "status": "True",
            "reason": "Evicted", "message": "taint x", "lastTransitionTime": t(0).to_string()}))
        .unwrap(),
    );
    let mut c = Case::new(2, vec![running("a", 1, "e1"), evicted]);
    c.unusable.insert("n1".into(), "cordoned".into());
    let p = c.plan();
    assert_eq!(deleted(&p), ["a", "b"]);
    assert_eq!(
        p.delete[0].note.message,
        "deleted member a: its node n1 is cordoned"
    );
    assert!(!p.delete[0].note.warning);
    assert!(p.delete[1].note.message.contains("Evicted: taint x"));
    assert_eq!(p.create.len(), 2);
    assert_eq!(p.status.failed_in_a_row, 0);
}

#[test]
fn scaling_down_deletes_filling_members_newest_first_then_the_oldest_ready() {
    let members = vec![
        running("old", 1, "e1"),
        running("young", 2, "e1"),
        starting("f1", 3, "e1"),
        starting("f2", 4, "e1"),
    ];
    assert_eq!(deleted(&Case::new(2, members.clone()).plan()), ["f2", "f1"]);
    assert_eq!(
        deleted(&Case::new(1, members.clone()).plan()),
        ["f2", "f1", "old"]
    );
    let none = Case::new(0, members).plan();
    assert_eq!(deleted(&none), ["f2", "f1", "old", "young"]);
    assert!(none.create.is_empty());
    assert_eq!(ready(&none).0, "True");
}

#[test]
fn a_new_base_rolls_over_one_member_at_a_time_without_a_gap() {
    let mut c = Case::new(2, vec![running("a", 1, "e1"), running("b", 2, "e1")]);
    c.pool = with_status(pool(2), json!({"baseSnapshot": "e1"}));
    c.parent = Some(parent(Some("e2"), Some("Succeeded")));
    // One surge member of the new base; nothing deleted; the change said.
    let p = c.plan();
    assert_eq!(bases(&p), ["e2"]);
    assert!(p.delete.is_empty());
    assert_eq!(p.notes[0].reason, reason::BASE_CHANGED);
    assert_eq!(p.status.ready_count, 2);
    // While it fills, nothing more.
    c.pool.status = Some(p.status.clone());
    c.members.push(starting("n1", 3, "e2"));
    let p = c.plan();
    assert!(p.create.is_empty() && p.delete.is_empty(), "{p:?}");
    assert!(p.notes.is_empty());
    // Ready: the oldest old member goes, the next surge member comes.
    c.members[2] = running("n1", 3, "e2");
    let p = c.plan();
    assert_eq!(deleted(&p), ["a"]);
    assert!(p.delete[0].note.message.contains("rolled over"));
    assert_eq!(bases(&p), ["e2"]);
    assert_eq!(p.status.ready_count, 2);
    // An old member not ready yet is not waited for: the pool is one short, and fills.
    c.members = vec![starting("a", 1, "e1"), running("b", 2, "e1")];
    let p = c.plan();
    assert_eq!(deleted(&p), ["a"]);
    assert_eq!(bases(&p), ["e2", "e2"]);
}

#[test]
fn a_member_about_to_expire_is_not_ready_and_the_pool_looks_again_before() {
    let mut soon = running("a", 1, "e1");
    soon.status.as_mut().unwrap().expires_at = Some(Time(t(105)));
    let mut later = running("b", 2, "e1");
    later.status.as_mut().unwrap().expires_at = Some(Time(t(200)));
    let p = Case::new(2, vec![soon, later]).plan();
    assert_eq!(p.status.ready_count, 1);
    assert_eq!(p.requeue_at, Some(t(190)));
    assert!(p.create.is_empty(), "the expiring member is still counted");
}

#[test]
fn a_member_held_back_names_why() {
    let mut held = vm("a", 1, "e1", "Pending", false);
    held.status.as_mut().unwrap().conditions.push(
        serde_json::from_value(json!({"type": "Scheduled", "status": "False",
            "reason": "QuotaExceeded", "message": "exceeded quota: q, requested: memory=256Mi",
            "lastTransitionTime": t(0).to_string()}))
        .unwrap(),
    );
    let p = Case::new(1, vec![held]).plan();
    assert_eq!(
        ready(&p),
        (
            "False".into(),
            "QuotaExceeded".into(),
            "member a: exceeded quota: q, requested: memory=256Mi".into()
        )
    );
}

/// Member `name` taken by claimant `by` (the claim makes the claimant its owner).
fn taken(name: &str, by: &str) -> ImpVM {
    let mut m = running(name, 1, "e1");
    m.metadata
        .annotations
        .get_or_insert_default()
        .insert(ANNOTATION_CLAIMED_BY.into(), by.into());
    m.metadata.owner_references = None;
    m
}

fn claimant(name: &str, phase: &str, member: Option<&str>) -> ImpVM {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS, "labels": {"imp.dev/claimed-from": "py"}},
        "spec": {"templateRef": {"name": "python"}, "warmPoolRef": {"name": "py"}},
        "status": {"phase": phase,
                   "warmClaim": {"pool": "py", "member": member,
                                 "cold": if member.is_none() { Some("none ready") } else { None }}}
    }))
    .unwrap()
}

#[test]
fn a_taken_member_is_not_counted_and_goes_once_its_claimant_runs() {
    // In flight: not a member any more (the pool refills), not deleted.
    let mut c = Case::new(1, vec![taken("py-a", "job")]);
    c.claimants = vec![claimant("job", "Scheduled", Some("py-a"))];
    let p = c.plan();
    assert!(p.delete.is_empty(), "{:?}", p.delete);
    assert_eq!(p.create.len(), 1);
    assert_eq!(p.status.ready_count, 0);
    assert_eq!(p.status.claimed_count, 1);
    // The claimant runs: the member object goes, said as a claim.
    c.claimants = vec![claimant("job", "Running", Some("py-a"))];
    let p = c.plan();
    assert_eq!(deleted(&p), ["py-a"]);
    assert_eq!(p.delete[0].note.reason, reason::CLAIMED);
    assert_eq!(
        p.delete[0].note.message,
        "member py-a became ImpVM job; the member object is deleted"
    );
    // The claimant went cold, or is gone: the member goes too.
    c.claimants = vec![claimant("job", "Scheduled", None)];
    assert!(
        c.plan().delete[0]
            .note
            .message
            .contains("started without it")
    );
    c.claimants = Vec::new();
    assert!(
        c.plan().delete[0]
            .note
            .message
            .contains("claimant job is gone")
    );
    // Marked before the claim was written: in flight.
    c.claimants = vec![
        serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "job", "namespace": NS},
            "spec": {"templateRef": {"name": "python"}, "warmPoolRef": {"name": "py"}}
        }))
        .unwrap(),
    ];
    assert!(c.plan().delete.is_empty());
}

#[test]
fn claimed_counts_the_claimants_that_took_a_member() {
    let mut c = Case::new(1, vec![running("a", 1, "e1")]);
    let mut gone = claimant("old", "Running", Some("py-z"));
    gone.metadata.deletion_timestamp = Some(Time(t(1)));
    c.claimants = vec![
        claimant("job", "Running", Some("py-a")),
        claimant("cold", "Running", None),
        gone,
    ];
    assert_eq!(c.plan().status.claimed_count, 1);
}

#[test]
fn a_claim_in_flight_defers_its_replacement_for_five_seconds_from_the_claimants_creation() {
    let mut c = Case::new(2, vec![taken("py-a", "job"), running("py-b", 1, "e1")]);
    let mut job = claimant("job", "Scheduled", Some("py-a"));
    job.metadata.creation_timestamp = Some(Time(t(98)));
    c.claimants = vec![job.clone()];
    // Being handed over: no replacement yet, a look again when it is due.
    let p = c.plan();
    assert!(p.create.is_empty() && p.delete.is_empty(), "{p:?}");
    assert_eq!(p.requeue_at, Some(t(103)));
    assert_eq!(p.status.ready_count, 1);
    // Due (the claim is slow: its agent is down): the pool refills.
    c.now = t(103);
    assert_eq!(c.plan().create.len(), 1);
    // Over before that: the member goes and the pool refills at once.
    c.now = t(100);
    job.status.as_mut().unwrap().phase = Some(VmPhase::Running);
    c.claimants = vec![job];
    let p = c.plan();
    assert_eq!((deleted(&p), p.create.len()), (vec!["py-a"], 1));
}
