//! End-to-end: ImpVMSnapshot parents under the real `imp operator` binary, against a real
//! kube-apiserver, with the operator's own ServiceAccount and only the RBAC the chart ships.
//!
//! No node agent runs: the test plays it where needed, writing an execution's status as the
//! agent does when it ends (`phase` Succeeded + `terminatedAt`). Proves: a `* * * * *` schedule
//! makes an execution within its minute (labelled, owned by the parent, the parent's status
//! naming it and the next tick); a one-shot parent makes exactly one; ticks missed before the
//! parent was seen collapse into one execution; retention deletes the oldest finished
//! executions but never the elected base, which is copied to the status once Succeeded; an
//! invalid schedule is a condition and a Warning Event naming the field and the token.
//!
//! Needs the test control plane (`scripts/kube/build`): without it, it skips on a developer
//! machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use imp_api::shared::LABEL_SNAPSHOT_PARENT;
use imp_api::snapshot::{ImpVMSnapshot, SnapshotPhase};
use imp_operator::snapshot::cron::Schedule;
use imp_operator::snapshot::decide::{ANNOTATION_SCHEDULED_AT, scheduled_at};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

const NS: &str = "default";

fn api(c: &Client) -> Api<ImpVMSnapshot> {
    Api::namespaced(c.clone(), NS)
}

fn spec(schedule: Option<&str>, retention: i32, base: Option<&str>) -> Value {
    let mut s = json!({
        "sourceVMName": "some-vm",
        "sourceVMNamespace": NS,
        "retention": retention,
        "storage": {"type": "node-local", "nodeLocal": {"path": "/var/lib/imp/snapshots"}},
    });
    if let Some(x) = schedule {
        s["schedule"] = json!(x);
    }
    if let Some(b) = base {
        s["baseSnapshot"] = json!(b);
    }
    s
}

async fn create(c: &Client, name: &str, spec: Value, meta: Value) -> ImpVMSnapshot {
    let mut metadata = json!({"name": name, "namespace": NS});
    if let (Some(m), Some(extra)) = (metadata.as_object_mut(), meta.as_object()) {
        m.extend(extra.clone());
    }
    let obj: ImpVMSnapshot = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
        "metadata": metadata, "spec": spec,
    }))
    .unwrap();
    api(c).create(&PostParams::default(), &obj).await.unwrap()
}

/// An execution of `parent` made by hand, decided at `at`, owned by `owner` if given.
async fn execution(
    c: &Client,
    parent: &str,
    name: &str,
    at: Timestamp,
    owner: Option<&ImpVMSnapshot>,
) {
    let mut meta = json!({
        "labels": {LABEL_SNAPSHOT_PARENT: parent},
        "annotations": {ANNOTATION_SCHEDULED_AT: at.to_string()},
    });
    if let Some(o) = owner {
        meta["ownerReferences"] = json!([o.controller_owner_ref(&()).unwrap()]);
    }
    create(c, name, spec(None, 3, None), meta).await;
}

/// Writes an execution's end as the node agent does.
async fn finish(c: &Client, name: &str) {
    api(c)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Succeeded",
                "terminatedAt": Timestamp::now().to_string(),
                "completedAt": Timestamp::now().to_string(),
            }})),
        )
        .await
        .unwrap_or_else(|e| panic!("writing the end of execution {name}: {e}"));
}

async fn executions(c: &Client, parent: &str) -> Vec<ImpVMSnapshot> {
    let mut v = api(c)
        .list(&ListParams::default().labels(&format!("{LABEL_SNAPSHOT_PARENT}={parent}")))
        .await
        .unwrap()
        .items;
    v.sort_by_key(|e| (scheduled_at(e), e.name_any()));
    v
}

fn names(v: &[ImpVMSnapshot]) -> BTreeSet<String> {
    v.iter().map(ResourceExt::name_any).collect()
}

fn cond<'a>(
    s: &'a ImpVMSnapshot,
    t: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    s.status.as_ref()?.conditions.iter().find(|c| c.type_ == t)
}

fn phase(s: &ImpVMSnapshot) -> Option<SnapshotPhase> {
    s.status.as_ref().and_then(|s| s.phase)
}

fn last(s: &ImpVMSnapshot) -> Option<String> {
    Some(s.status.as_ref()?.last_execution_ref.as_ref()?.name.clone())
}

/// Waits up to `secs` for parent `name` to satisfy `pred`.
async fn wait_parent(
    c: &Client,
    name: &str,
    what: &str,
    secs: u64,
    pred: impl Fn(&ImpVMSnapshot) -> bool,
) -> ImpVMSnapshot {
    let start = std::time::Instant::now();
    loop {
        let got = api(c).get_opt(name).await.unwrap();
        match got {
            Some(s) if pred(&s) => return s,
            _ if start.elapsed() >= Duration::from_secs(secs) => {
                let evs = common::events_of(c, NS, name).await;
                panic!(
                    "timed out after {secs} s waiting for {name}: {what}\nlast seen: {:#?}\n\
                     executions: {:?}\nEvents: {:#?}",
                    got.map(|s| s.status),
                    names(&executions(c, name).await),
                    evs.iter()
                        .map(|e| (&e.reason, &e.message))
                        .collect::<Vec<_>>()
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// `* * * * *`: an execution within the minute after the parent's creation, made as promised.
async fn cron_fires_within_its_minute(c: &Client) {
    let parent = create(
        c,
        "every-minute",
        spec(Some("* * * * *"), 3, None),
        json!({}),
    )
    .await;
    let created = parent.meta().creation_timestamp.clone().unwrap().0;
    let tick = Schedule::parse("* * * * *")
        .unwrap()
        .next_after(created)
        .unwrap();
    // The tick is at most 60 s away; the rest is for a loaded machine.
    let p = wait_parent(c, "every-minute", "its first execution", 75, |s| {
        last(s).is_some()
    })
    .await;
    let now = Timestamp::now();
    let children = executions(c, "every-minute").await;
    assert_eq!(children.len(), 1, "{:?}", names(&children));
    let e = &children[0];
    assert_eq!(last(&p).as_deref(), Some(e.name_any().as_str()));
    assert!(
        e.name_any().starts_with("every-minute-"),
        "{}",
        e.name_any()
    );
    let at = scheduled_at(e).unwrap();
    assert!(
        at >= tick && at < tick + SignedDuration::from_secs(60),
        "execution decided at {at}, its tick was {tick}"
    );
    assert_eq!(
        e.labels().get(LABEL_SNAPSHOT_PARENT).map(String::as_str),
        Some("every-minute")
    );
    let owner = &e.owner_references()[0];
    assert_eq!(owner.kind, "ImpVMSnapshot");
    assert_eq!(owner.name, "every-minute");
    assert_eq!(Some(owner.uid.as_str()), parent.meta().uid.as_deref());
    assert_eq!(owner.controller, Some(true));
    assert_eq!(e.spec.schedule, None);
    assert_eq!(e.spec.source_vm_name, "some-vm");
    let status = p.status.as_ref().unwrap();
    let next = status.next_scheduled_at.as_ref().unwrap().0;
    assert_eq!(
        Some(next),
        Schedule::parse("* * * * *").unwrap().next_after(at),
        "nextScheduledAt"
    );
    assert!(next > at && next <= now + SignedDuration::from_secs(60));
    assert_eq!(phase(&p), Some(SnapshotPhase::Pending));
    let s = cond(&p, "Scheduled").unwrap();
    assert_eq!(s.status, "True", "{s:?}");
    common::events_with(c, NS, "every-minute", &["ExecutionCreated"]).await;

    // Its end shows on the parent.
    finish(c, &e.name_any()).await;
    let p = wait_parent(c, "every-minute", "phase Succeeded", 20, |s| {
        phase(s) == Some(SnapshotPhase::Succeeded)
    })
    .await;
    let r = cond(&p, "Ready").unwrap();
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("True", "Completed")
    );
}

/// No schedule: one execution, and no other after it ends.
async fn one_shot_runs_once(c: &Client) {
    create(c, "once", spec(None, 3, None), json!({})).await;
    let p = wait_parent(c, "once", "its execution", 30, |s| last(s).is_some()).await;
    let children = executions(c, "once").await;
    assert_eq!(names(&children), BTreeSet::from([last(&p).unwrap()]));
    assert_eq!(p.status.as_ref().unwrap().next_scheduled_at, None);
    finish(c, &last(&p).unwrap()).await;
    // The reconcile that shows the end is the one that would have made a second.
    wait_parent(c, "once", "phase Succeeded", 20, |s| {
        phase(s) == Some(SnapshotPhase::Succeeded)
    })
    .await;
    assert_eq!(executions(c, "once").await.len(), 1);
    common::events_with(c, NS, "once", &["ExecutionCreated"]).await;
}

/// Ticks missed before the parent was seen (its newest execution is 30 minutes old) give one
/// execution now, and the next tick after now.
async fn missed_ticks_collapse(c: &Client) {
    let long_ago = Timestamp::now() - SignedDuration::from_mins(30);
    execution(c, "late", "late-old", long_ago, None).await;
    finish(c, "late-old").await;
    let before = Timestamp::now();
    create(c, "late", spec(Some("*/5 * * * *"), 3, None), json!({})).await;
    let p = wait_parent(c, "late", "an execution for the missed ticks", 30, |s| {
        last(s).is_some_and(|l| l != "late-old")
    })
    .await;
    let children = executions(c, "late").await;
    assert_eq!(children.len(), 2, "{:?}", names(&children));
    let fresh = scheduled_at(&children[1]).unwrap();
    assert!(
        fresh >= before - SignedDuration::from_secs(1),
        "{fresh} vs {before}"
    );
    let next = p
        .status
        .as_ref()
        .unwrap()
        .next_scheduled_at
        .as_ref()
        .unwrap()
        .0;
    assert_eq!(
        Some(next),
        Schedule::parse("*/5 * * * *").unwrap().next_after(fresh)
    );
}

/// Retention 2 with an elected base: the oldest finished executions go, the base stays, and
/// so does one a VM restores from until that VM is deleted.
async fn retention_keeps_the_newest_and_the_base(c: &Client) {
    let parent = create(c, "kept", spec(None, 2, Some("kept-old-0")), json!({})).await;
    let p = wait_parent(c, "kept", "its execution", 30, |s| last(s).is_some()).await;
    let own = last(&p).unwrap();
    let t0: Timestamp = "2020-01-01T00:00:00Z".parse().unwrap();
    for i in 0..4 {
        let at = t0 + SignedDuration::from_mins(i);
        execution(c, "kept", &format!("kept-old-{i}"), at, Some(&parent)).await;
    }
    // A VM restores from kept-old-1 (it waits for a node here): retention spares it.
    common::create_imp(
        c,
        "ImpVM",
        "impvms",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
               "metadata": {"name": "from-old-1", "namespace": NS},
               "spec": {"classRef": {"name": "small"}, "image": "example.invalid/none:1",
                        "snapshotRef": "kept-old-1"}}),
    )
    .await;
    for i in 0..4 {
        finish(c, &format!("kept-old-{i}")).await;
    }
    finish(c, &own).await;
    let want = BTreeSet::from([
        own.clone(),
        "kept-old-3".into(),
        "kept-old-1".into(),
        "kept-old-0".into(),
    ]);
    common::wait_for(
        "retention to delete kept-old-2 and spare kept-old-1",
        Duration::from_secs(30),
        || async { (names(&executions(c, "kept").await) == want).then_some(()) },
    )
    .await;
    // Once that VM is gone, so is the execution it held.
    Api::<imp_api::vm::ImpVM>::namespaced(c.clone(), NS)
        .delete("from-old-1", &Default::default())
        .await
        .unwrap();
    let want = BTreeSet::from([own.clone(), "kept-old-3".into(), "kept-old-0".into()]);
    common::wait_for(
        "retention to delete kept-old-1 once its VM is gone",
        Duration::from_secs(30),
        || async { (names(&executions(c, "kept").await) == want).then_some(()) },
    )
    .await;
    let p = wait_parent(c, "kept", "the base elected", 20, |s| {
        s.status.as_ref().and_then(|s| s.base_snapshot.as_deref()) == Some("kept-old-0")
            && phase(s) == Some(SnapshotPhase::Succeeded)
    })
    .await;
    assert_eq!(last(&p), Some(own));
    let evs = common::events_with(c, NS, "kept", &["Pruned", "BaseElected"]).await;
    for gone in ["kept-old-1", "kept-old-2"] {
        assert!(
            evs.iter().any(|e| e.reason.as_deref() == Some("Pruned")
                && e.message.as_deref().is_some_and(|m| m.contains(gone))),
            "no Pruned Event for {gone}"
        );
    }
}

/// An hour of 25: a condition and a Warning Event naming the field and the token, nothing made.
async fn invalid_schedule_is_reported(c: &Client) {
    create(c, "bad", spec(Some("0 25 * * *"), 3, None), json!({})).await;
    let p = wait_parent(c, "bad", "Scheduled=False", 30, |s| {
        cond(s, "Scheduled").is_some_and(|c| c.status == "False")
    })
    .await;
    let s = cond(&p, "Scheduled").unwrap();
    assert_eq!(s.reason, "InvalidSpec");
    assert!(
        s.message.contains("hour field") && s.message.contains("\"25\""),
        "{}",
        s.message
    );
    assert!(executions(c, "bad").await.is_empty());
    let evs = common::events_with(c, NS, "bad", &["InvalidSchedule"]).await;
    let ev = evs
        .iter()
        .find(|e| e.reason.as_deref() == Some("InvalidSchedule"))
        .unwrap();
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert_eq!(ev.message.as_deref(), Some(s.message.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_parents_schedule_prune_and_report() {
    let _run = common::test_run(
        "snapshot_parents_schedule_prune_and_report",
        Duration::from_secs(240),
    );
    if common::control_plane_ready().is_none() {
        return;
    }
    let kube = common::cluster(&[NS, "imp-system"]).await;
    let c = kube.client.clone();
    // The executions' source: a VM that exists and has not ended (no node takes it, so it
    // stays Pending), else the operator fails every execution at once as one no agent takes.
    common::small_class(&c, 128).await;
    common::create_imp(
        &c,
        "ImpVM",
        "impvms",
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
               "metadata": {"name": "some-vm", "namespace": NS},
               "spec": {"image": "example.invalid/none:1", "classRef": {"name": "small"}}}),
    )
    .await;
    let _op = common::start_operator(&kube);
    // One control plane for all: the minute the cron waits covers the rest.
    tokio::join!(cron_fires_within_its_minute(&c), async {
        one_shot_runs_once(&c).await;
        missed_ticks_collapse(&c).await;
        retention_keeps_the_newest_and_the_base(&c).await;
        invalid_schedule_is_reported(&c).await;
    });
}
