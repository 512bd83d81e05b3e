//! kube-rs against the test server: typed and dynamic `Api`, patches, errors and
//! `runtime::watcher`, including its relist after `410 Gone`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use imp_testkube::{Config, TestKube};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::ResourceExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::watcher;
use serde_json::json;

fn cm(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([("app".to_string(), "imp".to_string())])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("k".to_string(), "v".to_string())])),
        ..Default::default()
    }
}

#[tokio::test]
async fn typed_api_crud_and_errors() {
    let k = TestKube::start().await.unwrap();
    let c = k.client().await.unwrap();
    let api: Api<ConfigMap> = Api::default_namespaced(c.clone());
    let created = api.create(&PostParams::default(), &cm("a")).await.unwrap();
    assert!(created.metadata.uid.is_some());
    let err = api
        .create(&PostParams::default(), &cm("a"))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 409);
            assert_eq!(s.reason, "AlreadyExists");
        }
        other => panic!("{other:?}"),
    }
    let mut stale = created.clone();
    let mut fresh = api.get("a").await.unwrap();
    fresh.data = Some(BTreeMap::from([("k".to_string(), "new".to_string())]));
    api.replace("a", &PostParams::default(), &fresh)
        .await
        .unwrap();
    stale.data = Some(BTreeMap::new());
    let err = api
        .replace("a", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 409));

    let patched = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"m": "1"}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data.unwrap()["m"], "1");
    let applied = api
        .patch(
            "b",
            &PatchParams::apply("imp-test").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "b"}, "data": {"x": "y"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        applied.managed_fields()[0].manager.as_deref(),
        Some("imp-test")
    );
    let list = api
        .list(&ListParams::default().labels("app=imp"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    assert!(list.metadata.resource_version.is_some());
    api.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(api.get_opt("a").await.unwrap().is_none());

    let secrets: Api<Secret> = Api::default_namespaced(c.clone());
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "s"}, "stringData": {"a": "b"}}))
            .unwrap();
    let s = secrets.create(&PostParams::default(), &s).await.unwrap();
    assert_eq!(s.data.unwrap()["a"].0, b"b");

    let pods: Api<Pod> = Api::default_namespaced(c);
    let p: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]}})).unwrap();
    pods.create(&PostParams::default(), &p).await.unwrap();
    let on_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(on_n1.items.len(), 1);
    let on_n2 = pods
        .list(&ListParams::default().fields("spec.nodeName=n2"))
        .await
        .unwrap();
    assert!(on_n2.items.is_empty());
}

#[tokio::test]
async fn dynamic_api_for_a_crd_with_status() {
    let k = TestKube::start().await.unwrap();
    common::create_widget_crd(k.url()).await;
    let c = k.client().await.unwrap();
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("test.imp.dev", "v1", "Widget"),
        "widgets",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(c, "default", &ar);
    let w: DynamicObject = serde_json::from_value(json!({"apiVersion": "test.imp.dev/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"image": "x"}})).unwrap();
    let w = api.create(&PostParams::default(), &w).await.unwrap();
    assert_eq!(w.data["spec"]["mode"], "fast");
    let st = api
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["phase"], "Running");
    let bad: DynamicObject = serde_json::from_value(json!({"apiVersion": "test.imp.dev/v1", "kind": "Widget", "metadata": {"name": "bad"}, "spec": {"image": "x", "size": 0}})).unwrap();
    match api.create(&PostParams::default(), &bad).await.unwrap_err() {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 422);
            assert!(s.message.contains("spec.size"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn raw_watch_with_bookmarks() {
    let k = TestKube::start_with(Config {
        bookmark_interval: Duration::from_millis(100),
        ..Config::default()
    })
    .await
    .unwrap();
    let c = k.client().await.unwrap();
    let api: Api<ConfigMap> = Api::default_namespaced(c);
    let list = api.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    let mut stream = api
        .watch(&WatchParams::default().timeout(2), &rv)
        .await
        .unwrap()
        .boxed();
    api.create(&PostParams::default(), &cm("w1")).await.unwrap();
    let mut saw_added = false;
    let mut saw_bookmark = false;
    while let Some(ev) = stream.try_next().await.unwrap() {
        match ev {
            WatchEvent::Added(o) => saw_added |= o.name_any() == "w1",
            WatchEvent::Bookmark(_) => saw_bookmark = true,
            _ => {}
        }
        if saw_added && saw_bookmark {
            break;
        }
    }
    assert!(saw_added && saw_bookmark);
}

#[tokio::test]
async fn runtime_watcher_sees_changes_and_relists_after_gone() {
    let k = TestKube::start_with(Config {
        history: 5,
        bookmark_interval: Duration::from_secs(600),
        ..Config::default()
    })
    .await
    .unwrap();
    let c = k.client().await.unwrap();
    let api: Api<ConfigMap> = Api::default_namespaced(c.clone());
    api.create(&PostParams::default(), &cm("before"))
        .await
        .unwrap();
    let cfg = watcher::Config::default().timeout(1);
    let mut w = watcher(api.clone(), cfg).boxed();
    let mut inits = 0;
    let mut gone = 0;
    let mut seen = Vec::new();
    let secrets: Api<Secret> = Api::default_namespaced(c);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut phase = 0;
    while tokio::time::Instant::now() < deadline {
        let ev = tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .unwrap();
        let ev = match ev {
            Ok(ev) => ev,
            // The watcher surfaces the 410 as an error item, then relists on the next poll.
            Err(watcher::Error::WatchError(s)) if s.code == 410 => {
                gone += 1;
                continue;
            }
            Err(e) => panic!("watcher error: {e:?}"),
        };
        match ev {
            watcher::Event::Init => inits += 1,
            watcher::Event::InitApply(o) | watcher::Event::Apply(o) => seen.push(o.name_any()),
            watcher::Event::InitDone => {
                if phase == 0 {
                    // Push the list's resourceVersion out of the 5-event history, then wait
                    // for the 1 s watch to end: the re-watch gets 410 and the watcher relists.
                    for i in 0..10 {
                        let s: Secret =
                            serde_json::from_value(json!({"metadata": {"name": format!("s{i}")}}))
                                .unwrap();
                        secrets.create(&PostParams::default(), &s).await.unwrap();
                    }
                    phase = 1;
                } else if phase == 1 {
                    api.create(&PostParams::default(), &cm("after"))
                        .await
                        .unwrap();
                    phase = 2;
                }
            }
            watcher::Event::Delete(_) => {}
        }
        if seen.iter().any(|n| n == "after") {
            break;
        }
    }
    assert!(gone >= 1, "the re-watch got 410 Gone");
    assert!(
        inits >= 2,
        "the watcher relisted after 410 (inits = {inits})"
    );
    assert!(seen.contains(&"before".to_string()));
    assert!(seen.contains(&"after".to_string()), "{seen:?}");
}

#[tokio::test]
async fn recorder_events_show_in_both_event_apis() {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event as NewEvent;
    use kube::Resource;
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let k = TestKube::start().await.unwrap();
    let c = k.client().await.unwrap();
    let api: Api<ConfigMap> = Api::default_namespaced(c.clone());
    let obj = api
        .create(&PostParams::default(), &cm("target"))
        .await
        .unwrap();
    let rec = Recorder::new(
        c.clone(),
        Reporter {
            controller: "imp-operator".into(),
            instance: None,
        },
    );
    let ev = Event {
        type_: EventType::Warning,
        reason: "InvalidSpec".into(),
        note: Some("ImpVMClass \"x\" not found".into()),
        action: "Reconcile".into(),
        secondary: None,
    };
    let r = obj.object_ref(&());
    rec.publish(&ev, &r).await.unwrap();
    rec.publish(&ev, &r).await.unwrap();
    let new: Api<NewEvent> = Api::default_namespaced(c.clone());
    let list = new
        .list(&ListParams::default().fields("regarding.name=target"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.items[0].series.as_ref().unwrap().count, 2);
    let core: Api<CoreEvent> = Api::default_namespaced(c);
    let list = core
        .list(
            &ListParams::default()
                .fields("involvedObject.name=target,involvedObject.kind=ConfigMap"),
        )
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(
        list.items[0].message.as_deref(),
        Some("ImpVMClass \"x\" not found")
    );
    assert_eq!(list.items[0].reason.as_deref(), Some("InvalidSpec"));
}
