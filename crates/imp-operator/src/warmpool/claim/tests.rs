#![allow(clippy::unwrap_used)]

use super::*;
use serde_json::json;

const POOL_UID: &str = "pool-uid";

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

fn pool(base: Option<&str>) -> ImpWarmPool {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
        "metadata": {"name": "py", "namespace": "ci", "uid": POOL_UID},
        "spec": {"snapshotRef": "py-warm", "templateName": "python", "size": 2},
        "status": {"readyCount": 0, "baseSnapshot": base}
    }))
    .unwrap()
}

/// A Ready member of `pool` running since `t(since)` from `base` on `node`.
fn member(name: &str, since: i64, base: &str, node: &str) -> ImpVM {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": "ci", "uid": format!("uid-{name}"),
                     "resourceVersion": "7",
                     "labels": {LABEL_WARM_POOL: "py"},
                     "ownerReferences": [{"apiVersion": "imp.dev/v1alpha1", "kind": "ImpWarmPool",
                                          "name": "py", "uid": POOL_UID, "controller": true}]},
        "spec": {"templateRef": {"name": "python"}, "snapshotRef": base},
        "status": {"phase": "Running", "nodeName": node, "runningAt": t(since).to_string(),
                   "booking": {"class": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1},
                               "spec": {"templateRef": {"name": "python"},
                                        "classRef": {"name": "small"},
                                        "networkRef": {"name": "net1"},
                                        "snapshotRef": base, "image": "python:3"}},
                   "conditions": [{"type": "Ready", "status": "True", "reason": "Running",
                                   "message": "", "lastTransitionTime": t(since).to_string()}]}
    }))
    .unwrap()
}

fn claimant(status: serde_json::Value) -> ImpVM {
    serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "job", "namespace": "ci", "uid": "uid-job"},
        "spec": {"templateRef": {"name": "python"}, "warmPoolRef": {"name": "py"}},
        "status": status
    }))
    .unwrap()
}

fn any_node(_: &str) -> bool {
    true
}

#[test]
fn a_claimant_chooses_then_hands_over_then_is_an_ordinary_vm() {
    assert_eq!(step(&claimant(json!({}))), Step::Choose);
    let taken = claimant(json!({"warmClaim": {"pool": "py", "member": "py-a"}}));
    assert_eq!(
        step(&taken),
        Step::HandOver {
            member: "py-a".into()
        }
    );
    let booked = claimant(json!({"warmClaim": {"pool": "py", "member": "py-a"},
        "booking": {"class": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1}, "spec": {}}}));
    assert_eq!(step(&booked), Step::NotClaiming);
    let cold = claimant(json!({"warmClaim": {"pool": "py", "cold": "no member"}}));
    assert_eq!(step(&cold), Step::NotClaiming);
    let mut plain = claimant(json!({}));
    plain.spec.warm_pool_ref = None;
    assert_eq!(step(&plain), Step::NotClaiming);
    let mut going = claimant(json!({}));
    going.metadata.deletion_timestamp = Some(Time(t(0)));
    assert_eq!(step(&going), Step::NotClaiming);
    // Ended before any claim (e.g. its claim refused, then failed): nothing to choose.
    assert_eq!(
        step(&claimant(json!({"phase": "Failed"}))),
        Step::NotClaiming
    );
}

#[test]
fn the_member_handed_out_is_ready_of_the_current_base_and_the_longest_running() {
    let p = pool(Some("e2"));
    let old_base = member("py-old", 1, "e1", "n1");
    let young = member("py-young", 50, "e2", "n1");
    let senior = member("py-senior", 10, "e2", "n1");
    let members = [old_base.clone(), young.clone(), senior.clone()];
    let job = claimant(json!({}));
    let pick_name = |ms: &[ImpVM], usable: &dyn Fn(&str) -> bool| {
        pick(&job, &p, ms, usable, t(100)).map(ResourceExt::name_any)
    };
    assert_eq!(pick_name(&members, &any_node).as_deref(), Some("py-senior"));
    // Only the old base left: taken rather than starting cold.
    assert_eq!(
        pick_name(std::slice::from_ref(&old_base), &any_node).as_deref(),
        Some("py-old")
    );
    // On a node that may not keep it: none.
    assert_eq!(pick_name(&members, &|n: &str| n != "n1"), None);
    // Not Ready, taken, expiring, being deleted, or not the pool's: none of them.
    let mut not_ready = senior.clone();
    not_ready.status.as_mut().unwrap().conditions[0].status = "False".into();
    let mut taken = senior.clone();
    taken
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(ANNOTATION_CLAIMED_BY.into(), "other".into());
    let mut expiring = senior.clone();
    expiring.status.as_mut().unwrap().expires_at = Some(Time(t(105)));
    let mut deleting = senior.clone();
    deleting.metadata.deletion_timestamp = Some(Time(t(90)));
    let mut stranger = senior.clone();
    stranger.metadata.owner_references = None;
    for m in [not_ready, taken, expiring, deleting, stranger] {
        assert!(!claimable(&m, &p, &any_node, t(100)), "{m:?}");
    }
}

#[test]
fn a_claim_resumes_with_the_member_it_marked() {
    let p = pool(Some("e2"));
    let job = claimant(json!({}));
    let mut marked = member("py-b", 50, "e2", "n1");
    let patch = take_member(&marked, &job);
    assert_eq!(patch["metadata"]["resourceVersion"], "7");
    assert_eq!(
        patch["metadata"]["annotations"][ANNOTATION_CLAIMED_BY],
        "job"
    );
    let owners = patch["metadata"]["ownerReferences"].as_array().unwrap();
    assert_eq!(owners.len(), 1, "the pool is no longer its owner");
    assert_eq!(
        (
            owners[0]["kind"].as_str(),
            owners[0]["uid"].as_str(),
            owners[0]["controller"].as_bool()
        ),
        (Some("ImpVM"), Some("uid-job"), Some(true))
    );
    // As the patch leaves it: the claimant's again after a crash, though not claimable.
    marked
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(ANNOTATION_CLAIMED_BY.into(), "job".into());
    marked.metadata.owner_references =
        serde_json::from_value(patch["metadata"]["ownerReferences"].clone()).unwrap();
    let members = [member("py-a", 10, "e2", "n1"), marked.clone()];
    assert!(marked_by(&marked, &job));
    assert_eq!(
        pick(&job, &p, &members, &any_node, t(100)).map(ResourceExt::name_any),
        Some("py-b".into())
    );
}

#[test]
fn the_claim_written_names_the_member_or_why_it_starts_cold() {
    let p = pool(Some("e2"));
    let m = member("py-a", 10, "e2", "n1");
    let claim = claim_of(&p, Some(&m), None, t(5));
    assert_eq!(
        (
            claim.pool.as_str(),
            claim.member.as_deref(),
            claim.member_uid.as_deref(),
            claim.base_snapshot.as_deref()
        ),
        ("py", Some("py-a"), Some("uid-py-a"), Some("e2"))
    );
    let why = cold_reason(&p, &[member("py-b", 10, "e2", "n1")]);
    assert_eq!(
        why,
        "pool ci/py had no ready member (1 on their way); restoring from base execution e2"
    );
    let cold = claim_of(&p, None, Some(why), t(5));
    assert!(cold.member.is_none() && cold.base_snapshot.as_deref() == Some("e2"));
    let without = cold_reason(&pool(None), &[]);
    assert!(
        without.starts_with("pool ci/py has no base execution yet"),
        "{without}"
    );
}

#[test]
fn the_claimant_is_booked_with_its_members_class_network_and_base() {
    let m = member("py-a", 10, "e2", "n1");
    let spec: imp_api::vm::ImpVMSpec = serde_json::from_value(json!({
        "templateRef": {"name": "python"}, "warmPoolRef": {"name": "py"},
        "classRef": {"name": "bigger"}, "image": "python:3", "lifecycle": "persistent"
    }))
    .unwrap();
    let b = claimed_booking(&m, spec).unwrap();
    assert_eq!(b.revision, 0);
    assert_eq!(b.class.memory_mib, 256);
    assert_eq!(b.spec.snapshot_ref.as_deref(), Some("e2"));
    assert_eq!(b.spec.network_ref.as_ref().unwrap().name, "net1");
    assert_eq!(b.spec.class_ref.as_ref().unwrap().name, "small");
    // The claimant's own choices stay: its lifecycle.
    assert_eq!(b.spec.lifecycle, imp_api::shared::VmLifecycle::Persistent);
    let mut unbooked = m;
    unbooked.status.as_mut().unwrap().booking = None;
    assert!(claimed_booking(&unbooked, imp_api::vm::ImpVMSpec::default()).is_none());
}

/// An operator killed after binding a claimant to its member's node (`claim.placed`) finds
/// `spec.nodeName` set on restart: its own binding, not a user's field to refuse.
#[test]
fn a_claims_own_binding_is_not_the_users_node_name() {
    let mut bound = claimant(json!({"warmClaim": {"pool": "py", "member": "m1",
                                                  "memberUID": "uid-m1"}}));
    bound.spec.node_name = Some("a".into());
    assert_eq!(as_asked(&bound).node_name, None);
    assert_eq!(
        step(&bound),
        Step::HandOver {
            member: "m1".into()
        }
    );
    // Set before any member was claimed, it is the user's (refused beside warmPoolRef).
    let mut asked = claimant(json!({}));
    asked.spec.node_name = Some("a".into());
    assert_eq!(as_asked(&asked).node_name.as_deref(), Some("a"));
    let cold = claimant(json!({"warmClaim": {"pool": "py", "cold": "no ready member"}}));
    let mut cold = cold;
    cold.spec.node_name = Some("a".into());
    assert_eq!(as_asked(&cold).node_name.as_deref(), Some("a"));
}

/// A claimant's own nodeSelector and tolerations decide which members' nodes it may take,
/// as they would decide where it boots.
#[test]
fn a_claimant_takes_no_member_on_a_node_it_may_not_run_on() {
    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
        "metadata": {"name": "n1", "labels": {"zone": "a"}},
        "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"},
                            {"key": "soft", "effect": "PreferNoSchedule"}]}
    }))
    .unwrap();
    let mut spec = claimant(json!({})).spec;
    assert_eq!(
        unfit(&spec, &node).as_deref(),
        Some("has untolerated taint gpu:NoSchedule")
    );
    spec.tolerations =
        vec![serde_json::from_value(json!({"key": "gpu", "operator": "Exists"})).unwrap()];
    assert_eq!(unfit(&spec, &node), None);
    spec.node_selector.insert("zone".into(), "b".into());
    assert_eq!(
        unfit(&spec, &node).as_deref(),
        Some("does not match nodeSelector zone=b")
    );
    spec.node_selector.insert("zone".into(), "a".into());
    assert_eq!(unfit(&spec, &node), None);
}
