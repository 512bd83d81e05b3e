//! The HTTP surface: storage, errors, status, generation, finalizers, selectors, patches,
//! watches, discovery, tables, CRD validation, garbage collection and auth.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::{call, create_widget_crd, patch, send, watch_events};
use imp_testkube::{Auth, Config, Rule, TestKube, User};
use serde_json::{Value, json};

const CM: &str = "/api/v1/namespaces/default/configmaps";
const W: &str = "/apis/test.imp.dev/v1/namespaces/default/widgets";

fn cm(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": {"app": "a"}}, "data": {"k": "v"}})
}

fn widget(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "test.imp.dev/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec})
}

#[tokio::test]
async fn create_get_list_and_errors() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (code, o) = call(u, "POST", CM, Some(cm("one"))).await;
    assert_eq!(code, 201, "{o}");
    assert!(!o["metadata"]["uid"].as_str().unwrap().is_empty());
    assert!(o["metadata"]["creationTimestamp"].is_string());
    let rv1: u64 = o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();

    let (code, e) = call(u, "POST", CM, Some(cm("one"))).await;
    assert_eq!(code, 409);
    assert_eq!(e["kind"], "Status");
    assert_eq!(e["apiVersion"], "v1");
    assert_eq!(e["status"], "Failure");
    assert_eq!(e["reason"], "AlreadyExists");
    assert_eq!(e["message"], "configmaps \"one\" already exists");
    assert_eq!(
        e["details"],
        json!({"name": "one", "group": "", "kind": "configmaps"})
    );
    assert_eq!(e["code"], 409);

    let (code, e) = call(u, "POST", CM, Some(cm("Bad_Name"))).await;
    assert_eq!(code, 422);
    assert_eq!(e["reason"], "Invalid");
    assert_eq!(e["details"]["causes"][0]["field"], "metadata.name");

    let (code, o) = call(
        u,
        "POST",
        CM,
        Some(json!({"metadata": {"generateName": "gen-"}, "data": {}})),
    )
    .await;
    assert_eq!(code, 201);
    let n = o["metadata"]["name"].as_str().unwrap();
    assert!(n.starts_with("gen-") && n.len() == 9, "{n}");
    let rv2: u64 = o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(rv2 > rv1);

    let (code, e) = call(u, "GET", &format!("{CM}/missing"), None).await;
    assert_eq!(code, 404);
    assert_eq!(e["reason"], "NotFound");
    assert_eq!(e["message"], "configmaps \"missing\" not found");

    let (code, l) = call(u, "GET", CM, None).await;
    assert_eq!(code, 200);
    assert_eq!(l["kind"], "ConfigMapList");
    assert_eq!(l["items"].as_array().unwrap().len(), 2);
    let lrv: u64 = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(lrv >= rv2);

    let (code, e) = call(
        u,
        "POST",
        "/api/v1/namespaces/nope/configmaps",
        Some(cm("x")),
    )
    .await;
    assert_eq!(code, 404);
    assert_eq!(e["message"], "namespaces \"nope\" not found");

    // Paging with limit/continue.
    let (_, p1) = call(u, "GET", &format!("{CM}?limit=1"), None).await;
    assert_eq!(p1["items"].as_array().unwrap().len(), 1);
    let cont = p1["metadata"]["continue"].as_str().unwrap().to_string();
    let (_, p2) = call(
        u,
        "GET",
        &format!("{CM}?limit=1&continue={}", cont.replace('|', "%7C")),
        None,
    )
    .await;
    assert_eq!(p2["items"].as_array().unwrap().len(), 1);
    assert_ne!(
        p1["items"][0]["metadata"]["name"],
        p2["items"][0]["metadata"]["name"]
    );
    assert!(p2["metadata"].get("continue").is_none());

    // Cluster-scoped resources and all-namespace lists.
    let (code, _) = call(
        u,
        "POST",
        "/api/v1/namespaces",
        Some(json!({"metadata": {"name": "other"}})),
    )
    .await;
    assert_eq!(code, 201);
    call(
        u,
        "POST",
        "/api/v1/namespaces/other/configmaps",
        Some(cm("one")),
    )
    .await;
    let (_, all) = call(u, "GET", "/api/v1/configmaps", None).await;
    assert_eq!(all["items"].as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn update_conflicts_on_stale_resource_version() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (_, o) = call(u, "POST", CM, Some(cm("c"))).await;
    let mut a = o.clone();
    a["data"]["k"] = json!("a");
    let (code, a2) = call(u, "PUT", &format!("{CM}/c"), Some(a)).await;
    assert_eq!(code, 200);
    assert_ne!(
        a2["metadata"]["resourceVersion"],
        o["metadata"]["resourceVersion"]
    );
    let mut b = o.clone();
    b["data"]["k"] = json!("b");
    let (code, e) = call(u, "PUT", &format!("{CM}/c"), Some(b)).await;
    assert_eq!(code, 409);
    assert_eq!(e["reason"], "Conflict");
    assert_eq!(
        e["message"],
        "Operation cannot be fulfilled on configmaps \"c\": the object has been modified; please apply your changes to the latest version and try again"
    );
    let (_, now) = call(u, "GET", &format!("{CM}/c"), None).await;
    assert_eq!(now["data"]["k"], "a");
    // A no-op update keeps the resourceVersion.
    let (_, same) = call(u, "PUT", &format!("{CM}/c"), Some(now.clone())).await;
    assert_eq!(
        same["metadata"]["resourceVersion"],
        now["metadata"]["resourceVersion"]
    );
}

#[tokio::test]
async fn finalizers_hold_deletion_until_removed() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let mut c = cm("f");
    c["metadata"]["finalizers"] = json!(["imp.dev/test"]);
    call(u, "POST", CM, Some(c)).await;
    let (code, o) = call(u, "DELETE", &format!("{CM}/f"), None).await;
    assert_eq!(code, 200);
    assert!(o["metadata"]["deletionTimestamp"].is_string());
    let (code, o) = call(u, "GET", &format!("{CM}/f"), None).await;
    assert_eq!(code, 200, "still there while finalizers remain");
    let mut bad = o.clone();
    bad["metadata"]["finalizers"] = json!(["imp.dev/test", "imp.dev/new"]);
    let (code, _) = call(u, "PUT", &format!("{CM}/f"), Some(bad)).await;
    assert_eq!(code, 422, "no new finalizers while deleting");
    let (code, _) = patch(
        u,
        &format!("{CM}/f"),
        "application/merge-patch+json",
        r#"{"metadata":{"finalizers":null}}"#,
    )
    .await;
    assert_eq!(code, 200);
    let (code, _) = call(u, "GET", &format!("{CM}/f"), None).await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn deletecollection_with_selector() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    for n in ["a", "b", "c"] {
        let mut c = cm(n);
        c["metadata"]["labels"]["keep"] = json!(if n == "c" { "yes" } else { "no" });
        call(u, "POST", CM, Some(c)).await;
    }
    let (code, _) = call(u, "DELETE", &format!("{CM}?labelSelector=keep%3Dno"), None).await;
    assert_eq!(code, 200);
    let (_, l) = call(u, "GET", CM, None).await;
    let names: Vec<&str> = l["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["c"]);
}

#[tokio::test]
async fn label_and_field_selectors() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    for (n, env, node) in [
        ("p1", "prod", "n1"),
        ("p2", "dev", "n2"),
        ("p3", "prod", ""),
    ] {
        let mut spec = json!({"containers": [{"name": "c", "image": "busybox"}]});
        if !node.is_empty() {
            spec["nodeName"] = json!(node);
        }
        let pod = json!({"metadata": {"name": n, "labels": {"env": env}}, "spec": spec});
        let (code, o) = call(u, "POST", "/api/v1/namespaces/default/pods", Some(pod)).await;
        assert_eq!(code, 201, "{o}");
    }
    let names = |l: &Value| -> Vec<String> {
        l["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    for (q, want) in [
        ("labelSelector=env%3Dprod", vec!["p1", "p3"]),
        ("labelSelector=env%21%3Dprod", vec!["p2"]),
        ("labelSelector=env+in+(dev,test)", vec!["p2"]),
        ("labelSelector=env+notin+(dev)", vec!["p1", "p3"]),
        ("labelSelector=env", vec!["p1", "p2", "p3"]),
        ("labelSelector=%21env", vec![]),
        ("fieldSelector=spec.nodeName%3Dn1", vec!["p1"]),
        ("fieldSelector=spec.nodeName%3D", vec!["p3"]),
        (
            "fieldSelector=metadata.name%21%3Dp1,status.phase%3DPending",
            vec!["p2", "p3"],
        ),
    ] {
        let (code, l) = call(
            u,
            "GET",
            &format!("/api/v1/namespaces/default/pods?{q}"),
            None,
        )
        .await;
        assert_eq!(code, 200, "{q}: {l}");
        assert_eq!(names(&l), want, "{q}");
    }
    let (code, e) = call(
        u,
        "GET",
        "/api/v1/namespaces/default/pods?fieldSelector=spec.bogus%3Dx",
        None,
    )
    .await;
    assert_eq!(code, 400);
    assert_eq!(e["message"], "field label not supported: spec.bogus");
}

#[tokio::test]
async fn patches_merge_json_strategic() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    call(u, "POST", CM, Some(cm("p"))).await;
    let path = format!("{CM}/p");
    let (code, o) = patch(
        u,
        &path,
        "application/merge-patch+json",
        r#"{"data":{"k":null,"n":"1"}}"#,
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(o["data"], json!({"n": "1"}));
    let (code, o) = patch(
        u,
        &path,
        "application/json-patch+json",
        r#"[{"op":"add","path":"/data/j","value":"2"},{"op":"test","path":"/data/n","value":"1"}]"#,
    )
    .await;
    assert_eq!(code, 200, "{o}");
    assert_eq!(o["data"]["j"], "2");
    let (code, _) = patch(
        u,
        &path,
        "application/json-patch+json",
        r#"[{"op":"test","path":"/data/n","value":"9"}]"#,
    )
    .await;
    assert_eq!(code, 422);
    let (code, o) = patch(
        u,
        &path,
        "application/strategic-merge-patch+json",
        r#"{"data":{"s":"3"}}"#,
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(o["data"]["s"], "3");
    let (code, _) = patch(u, &path, "text/plain", "{}").await;
    assert_eq!(code, 415);
    // A merge patch carrying a stale resourceVersion is a precondition.
    let (code, e) = patch(
        u,
        &path,
        "application/merge-patch+json",
        r#"{"metadata":{"resourceVersion":"1"},"data":{"x":"y"}}"#,
    )
    .await;
    assert_eq!(code, 409, "{e}");

    let pod = json!({"metadata": {"name": "sp"}, "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}});
    call(u, "POST", "/api/v1/namespaces/default/pods", Some(pod)).await;
    let (code, o) = patch(
        u,
        "/api/v1/namespaces/default/pods/sp",
        "application/strategic-merge-patch+json",
        r#"{"spec":{"containers":[{"name":"b","image":"z"}]}}"#,
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        o["spec"]["containers"],
        json!([{"name": "a", "image": "x"}, {"name": "b", "image": "z"}])
    );
}

#[tokio::test]
async fn server_side_apply_tracks_managers_and_conflicts() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let path = format!("{CM}/ssa");
    let apply = |mgr: &str, force: bool| {
        format!(
            "{path}?fieldManager={mgr}{}",
            if force { "&force=true" } else { "" }
        )
    };
    let y1 = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\n  labels:\n    a: one\ndata:\n  x: \"1\"\n  y: \"2\"\n";
    let (code, o) = patch(
        u,
        &apply("alice", false),
        "application/apply-patch+yaml",
        y1,
    )
    .await;
    assert_eq!(code, 200, "{o}");
    assert_eq!(o["data"], json!({"x": "1", "y": "2"}));
    let mf = &o["metadata"]["managedFields"][0];
    assert_eq!(mf["manager"], "alice");
    assert_eq!(mf["operation"], "Apply");
    assert_eq!(mf["fieldsV1"]["f:data"], json!({"f:x": {}, "f:y": {}}));

    // Same value from another manager: shared, no conflict.
    let y2 = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata:\n  x: \"1\"\n";
    let (code, _) = patch(u, &apply("bob", false), "application/apply-patch+yaml", y2).await;
    assert_eq!(code, 200);
    // Different value: conflict.
    let y3 =
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata:\n  x: \"1\"\n  y: \"3\"\n";
    let (code, e) = patch(u, &apply("bob", false), "application/apply-patch+yaml", y3).await;
    assert_eq!(code, 409, "{e}");
    assert_eq!(e["reason"], "Conflict");
    assert_eq!(
        e["message"],
        "Apply failed with 1 conflict: conflict with \"alice\": .data.y"
    );
    assert_eq!(e["details"]["causes"][0]["field"], ".data.y");
    // Forced: bob takes .data.y.
    let (code, o) = patch(u, &apply("bob", true), "application/apply-patch+yaml", y3).await;
    assert_eq!(code, 200, "{o}");
    assert_eq!(o["data"]["y"], "3");
    // Alice drops .data.x from her config; bob still owns it, so it stays; her label goes.
    let y4 = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata: {}\n";
    let (code, o) = patch(
        u,
        &apply("alice", false),
        "application/apply-patch+yaml",
        y4,
    )
    .await;
    assert_eq!(code, 200, "{o}");
    assert_eq!(o["data"]["x"], "1");
    assert!(o["metadata"].get("labels").is_none(), "{o}");
    // An update by a third manager takes ownership of what it changed.
    let (code, o) = patch(
        u,
        &format!("{path}?fieldManager=carol"),
        "application/merge-patch+json",
        r#"{"data":{"y":"4"}}"#,
    )
    .await;
    assert_eq!(code, 200);
    let carol = o["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["manager"] == "carol")
        .unwrap()
        .clone();
    assert_eq!(carol["operation"], "Update");
    let (code, e) = patch(u, &apply("bob", false), "application/apply-patch+yaml", y3).await;
    assert_eq!(code, 409, "{e}");
    // fieldManager is required for apply.
    let (code, _) = patch(u, &path, "application/apply-patch+yaml", y3).await;
    assert_eq!(code, 400);
}

#[tokio::test]
async fn watch_events_resume_bookmarks_and_gone() {
    let k = TestKube::start_with(Config {
        history: 5,
        bookmark_interval: std::time::Duration::from_millis(200),
        ..Config::default()
    })
    .await
    .unwrap();
    let u = k.url();
    let (_, l) = call(u, "GET", CM, None).await;
    let start = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    call(u, "POST", CM, Some(cm("w"))).await;
    patch(
        u,
        &format!("{CM}/w"),
        "application/merge-patch+json",
        r#"{"data":{"k":"2"}}"#,
    )
    .await;
    call(u, "DELETE", &format!("{CM}/w"), None).await;
    let evs = watch_events(
        u,
        &format!("{CM}?watch=true&resourceVersion={start}&timeoutSeconds=1"),
    )
    .await;
    let types: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, vec!["ADDED", "MODIFIED", "DELETED"]);
    let rvs: Vec<u64> = evs
        .iter()
        .map(|e| {
            e["object"]["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(rvs.windows(2).all(|w| w[0] < w[1]), "{rvs:?}");
    assert_eq!(evs[2]["object"]["kind"], "ConfigMap");

    // Bookmarks arrive periodically when allowed.
    let evs = watch_events(
        u,
        &format!(
            "{CM}?watch=true&resourceVersion={}&allowWatchBookmarks=true&timeoutSeconds=1",
            rvs[2]
        ),
    )
    .await;
    assert!(evs.iter().any(|e| e["type"] == "BOOKMARK"), "{evs:?}");
    assert_eq!(evs[0]["object"]["kind"], "ConfigMap");

    // sendInitialEvents: current state, then the end-of-initial-events bookmark.
    call(u, "POST", CM, Some(cm("i"))).await;
    let evs = watch_events(u, &format!("{CM}?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1")).await;
    assert_eq!(evs[0]["type"], "ADDED");
    let end = evs.iter().find(|e| e["type"] == "BOOKMARK").unwrap();
    assert_eq!(
        end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    // History is 5 events: more than that and the old version is gone.
    for i in 0..8 {
        call(u, "POST", CM, Some(cm(&format!("g{i}")))).await;
    }
    let evs = watch_events(
        u,
        &format!("{CM}?watch=true&resourceVersion={start}&timeoutSeconds=1"),
    )
    .await;
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0]["type"], "ERROR");
    assert_eq!(evs[0]["object"]["code"], 410);
    assert_eq!(evs[0]["object"]["reason"], "Expired");
    assert_eq!(evs[0]["object"]["kind"], "Status");

    // Watches honour selectors, turning changes in and out of the selector into ADDED/DELETED.
    let (_, l) = call(u, "GET", CM, None).await;
    let now = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    patch(
        u,
        &format!("{CM}/g0"),
        "application/merge-patch+json",
        r#"{"metadata":{"labels":{"sel":"yes"}}}"#,
    )
    .await;
    patch(
        u,
        &format!("{CM}/g0"),
        "application/merge-patch+json",
        r#"{"data":{"z":"1"}}"#,
    )
    .await;
    patch(
        u,
        &format!("{CM}/g0"),
        "application/merge-patch+json",
        r#"{"metadata":{"labels":{"sel":null}}}"#,
    )
    .await;
    let evs = watch_events(
        u,
        &format!("{CM}?watch=true&resourceVersion={now}&labelSelector=sel%3Dyes&timeoutSeconds=1"),
    )
    .await;
    let types: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, vec!["ADDED", "MODIFIED", "DELETED"]);
}

#[tokio::test]
async fn discovery_lists_builtins_and_crds() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (code, v) = call(u, "GET", "/version", None).await;
    assert_eq!(code, 200);
    assert_eq!(v["major"], "1");
    let (_, api) = call(u, "GET", "/api", None).await;
    assert_eq!(api["versions"], json!(["v1"]));
    let (_, core) = call(u, "GET", "/api/v1", None).await;
    let res = core["resources"].as_array().unwrap();
    let pods = res.iter().find(|r| r["name"] == "pods").unwrap();
    assert_eq!(pods["namespaced"], true);
    assert_eq!(pods["kind"], "Pod");
    assert!(pods["verbs"].as_array().unwrap().contains(&json!("watch")));
    assert!(res.iter().any(|r| r["name"] == "pods/status"));
    let ns = res.iter().find(|r| r["name"] == "namespaces").unwrap();
    assert_eq!(ns["shortNames"], json!(["ns"]));
    let (_, apis) = call(u, "GET", "/apis", None).await;
    let groups: Vec<&str> = apis["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    for g in [
        "coordination.k8s.io",
        "apiextensions.k8s.io",
        "events.k8s.io",
        "authentication.k8s.io",
        "authorization.k8s.io",
    ] {
        assert!(groups.contains(&g), "{g}");
    }
    assert!(!groups.contains(&"test.imp.dev"));
    create_widget_crd(u).await;
    let (_, apis) = call(u, "GET", "/apis", None).await;
    assert!(
        apis["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["name"] == "test.imp.dev")
    );
    let (code, gv) = call(u, "GET", "/apis/test.imp.dev/v1", None).await;
    assert_eq!(code, 200);
    let w = &gv["resources"][0];
    assert_eq!(w["name"], "widgets");
    assert_eq!(w["kind"], "Widget");
    assert_eq!(w["shortNames"], json!(["wd"]));
    assert_eq!(w["categories"], json!(["imp"]));
    assert_eq!(gv["resources"][1]["name"], "widgets/status");
    let (_, crd) = call(
        u,
        "GET",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.test.imp.dev",
        None,
    )
    .await;
    let est = crd["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Established")
        .unwrap()
        .clone();
    assert_eq!(est["status"], "True");
    // Deleting the CRD removes the resource and its objects.
    call(u, "POST", W, Some(widget("w", json!({"image": "x"})))).await;
    call(
        u,
        "DELETE",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.test.imp.dev",
        None,
    )
    .await;
    let (code, _) = call(u, "GET", W, None).await;
    assert_eq!(code, 404);
    let (code, _) = call(u, "GET", "/apis/test.imp.dev/v1", None).await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn crd_schema_validation_defaults_pruning_and_cel() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    create_widget_crd(u).await;
    let (code, o) = call(u, "POST", W, Some(widget("w1", json!({"image": "busybox", "junk": 1, "port": "http", "note": null, "extra": {"any": [1]}, "labels": {"a": "b"}})))).await;
    assert_eq!(code, 201, "{o}");
    assert_eq!(
        o["spec"],
        json!({"image": "busybox", "size": 1, "maxSize": 64, "mode": "fast", "port": "http", "note": null, "extra": {"any": [1]}, "labels": {"a": "b"}})
    );

    let (code, e) = call(
        u,
        "POST",
        W,
        Some(widget("w2", json!({"image": "busybox", "size": 0}))),
    )
    .await;
    assert_eq!(code, 422);
    assert_eq!(e["reason"], "Invalid");
    assert_eq!(
        e["message"],
        "Widget.test.imp.dev \"w2\" is invalid: spec.size: Invalid value: 0: spec.size in body should be greater than or equal to 1"
    );
    assert_eq!(
        e["details"]["causes"][0],
        json!({"reason": "FieldValueInvalid", "message": "Invalid value: 0: spec.size in body should be greater than or equal to 1", "field": "spec.size"})
    );
    assert_eq!(e["details"]["kind"], "Widget");
    assert_eq!(e["details"]["group"], "test.imp.dev");

    let cases = [
        (json!({}), "spec.image", "Required value"),
        (
            json!({"image": "UPPER"}),
            "spec.image",
            "Invalid value: \"UPPER\": spec.image in body should match '^[a-z0-9./:-]+$'",
        ),
        (
            json!({"image": "x", "mode": "turbo"}),
            "spec.mode",
            "Unsupported value: \"turbo\": supported values: \"fast\", \"slow\"",
        ),
        (
            json!({"image": "x", "size": 65}),
            "spec.size",
            "Invalid value: 65: spec.size in body should be less than or equal to 64",
        ),
        (
            json!({"image": "x", "size": "big"}),
            "spec.size",
            "Invalid value: \"big\": spec.size in body must be of type integer: \"string\"",
        ),
        (
            json!({"image": "x", "tags": ["a", "b", "c", "d"]}),
            "spec.tags",
            "Too many: 4: must have at most 3 items",
        ),
        (
            json!({"image": "x", "port": true}),
            "spec.port",
            "Invalid value: true: spec.port in body must be of type integer,string: \"boolean\"",
        ),
        (
            json!({"image": "x", "size": 10, "maxSize": 5}),
            "spec",
            "Invalid value: \"object\": size must not exceed maxSize",
        ),
        (
            json!({"image": "x", "expireAfter": "30s"}),
            "spec",
            "Invalid value: \"object\": expireAfter must be at least 1m",
        ),
    ];
    for (spec, field, msg) in cases {
        let (code, e) = call(u, "POST", W, Some(widget("bad", spec.clone()))).await;
        assert_eq!(code, 422, "{spec}: {e}");
        let causes = e["details"]["causes"].as_array().unwrap();
        assert!(
            causes
                .iter()
                .any(|c| c["field"] == field && c["message"] == msg),
            "{spec}: {e}"
        );
    }
    // Transition rule with oldSelf on update.
    let (code, _) = call(
        u,
        "POST",
        W,
        Some(widget("t", json!({"image": "x", "owner": "me"}))),
    )
    .await;
    assert_eq!(code, 201);
    let (code, e) = patch(
        u,
        &format!("{W}/t"),
        "application/merge-patch+json",
        r#"{"spec":{"owner":"you"}}"#,
    )
    .await;
    assert_eq!(code, 422, "{e}");
    assert_eq!(e["details"]["causes"][0]["field"], "spec.owner");
    assert_eq!(
        e["details"]["causes"][0]["message"],
        "Invalid value: \"string\": owner is immutable"
    );
    let (_, o) = call(u, "GET", &format!("{W}/t"), None).await;
    assert_eq!(
        o["spec"]["owner"], "me",
        "a rejected update changes nothing"
    );
}

#[tokio::test]
async fn crds_with_bad_rules_are_rejected() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let mut crd: Value = serde_yaml_ng::from_str(common::WIDGET_CRD).unwrap();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"] =
        json!([{"rule": "self.size <=", "message": "broken"}]);
    let (code, e) = call(
        u,
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        Some(crd.clone()),
    )
    .await;
    assert_eq!(code, 422, "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("compilation failed"),
        "{e}"
    );
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"] =
        json!([{"rule": "self.image.frobnicate()", "message": "unknown"}]);
    let (code, _) = call(
        u,
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        Some(crd.clone()),
    )
    .await;
    assert_eq!(code, 422);
    crd["metadata"]["name"] = json!("wrong.name");
    let (code, e) = call(
        u,
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        Some(crd),
    )
    .await;
    assert_eq!(code, 422);
    assert!(
        e["details"]["causes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["field"] == "metadata.name")
    );
    let (code, _) = call(u, "GET", "/apis/test.imp.dev/v1", None).await;
    assert_eq!(code, 404, "nothing was registered");
}

#[tokio::test]
async fn status_subresource_and_generation() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    create_widget_crd(u).await;
    let mut w = widget("s", json!({"image": "x"}));
    w["status"] = json!({"phase": "Ignored"});
    let (_, o) = call(u, "POST", W, Some(w)).await;
    assert!(
        o.get("status").is_none(),
        "status is dropped on create: {o}"
    );
    assert_eq!(o["metadata"]["generation"], 1);

    let (code, o) = patch(
        u,
        &format!("{W}/s/status"),
        "application/merge-patch+json",
        r#"{"status":{"phase":"Running","observedGeneration":1},"spec":{"size":5}}"#,
    )
    .await;
    assert_eq!(code, 200, "{o}");
    assert_eq!(o["status"]["phase"], "Running");
    assert_eq!(o["spec"]["size"], 1, "status writes ignore spec");
    assert_eq!(
        o["metadata"]["generation"], 1,
        "status writes do not bump generation"
    );

    let (code, o) = patch(
        u,
        &format!("{W}/s"),
        "application/merge-patch+json",
        r#"{"spec":{"size":2},"status":{"phase":"Hacked"}}"#,
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(o["spec"]["size"], 2);
    assert_eq!(
        o["status"]["phase"], "Running",
        "main endpoint ignores status"
    );
    assert_eq!(o["metadata"]["generation"], 2);

    let (_, o) = patch(
        u,
        &format!("{W}/s"),
        "application/merge-patch+json",
        r#"{"metadata":{"labels":{"x":"y"}}}"#,
    )
    .await;
    assert_eq!(
        o["metadata"]["generation"], 2,
        "metadata changes do not bump generation"
    );

    let mut put = o.clone();
    put["status"]["phase"] = json!("Done");
    let (code, o) = call(u, "PUT", &format!("{W}/s/status"), Some(put)).await;
    assert_eq!(code, 200);
    assert_eq!(o["status"]["phase"], "Done");

    // Server-side apply on /status.
    let (code, o) = patch(u, &format!("{W}/s/status?fieldManager=agent&force=true"), "application/apply-patch+yaml",
        "apiVersion: test.imp.dev/v1\nkind: Widget\nmetadata:\n  name: s\nstatus:\n  phase: Applied\n").await;
    assert_eq!(code, 200, "{o}");
    assert_eq!(o["status"]["phase"], "Applied");
    let agent = o["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["manager"] == "agent")
        .unwrap()
        .clone();
    assert_eq!(agent["subresource"], "status");

    // CRD selectableFields are field selectors.
    call(
        u,
        "POST",
        W,
        Some(widget("n", json!({"image": "x", "nodeName": "node-a"}))),
    )
    .await;
    let (code, l) = call(
        u,
        "GET",
        &format!("{W}?fieldSelector=spec.nodeName%3Dnode-a"),
        None,
    )
    .await;
    assert_eq!(code, 200, "{l}");
    assert_eq!(l["items"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn owner_references_are_garbage_collected() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (_, owner) = call(u, "POST", CM, Some(cm("owner"))).await;
    let uid = owner["metadata"]["uid"].as_str().unwrap();
    let mut dep = cm("dep");
    dep["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]);
    call(u, "POST", CM, Some(dep)).await;
    let mut fin = cm("dep-fin");
    fin["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]);
    fin["metadata"]["finalizers"] = json!(["imp.dev/x"]);
    call(u, "POST", CM, Some(fin)).await;
    call(u, "DELETE", &format!("{CM}/owner"), None).await;
    let (code, _) = call(u, "GET", &format!("{CM}/dep"), None).await;
    assert_eq!(code, 404);
    let (_, f) = call(u, "GET", &format!("{CM}/dep-fin"), None).await;
    assert!(f["metadata"]["deletionTimestamp"].is_string());
}

#[tokio::test]
async fn namespace_deletion_removes_contents() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    call(
        u,
        "POST",
        "/api/v1/namespaces",
        Some(json!({"metadata": {"name": "gone"}})),
    )
    .await;
    call(
        u,
        "POST",
        "/api/v1/namespaces/gone/configmaps",
        Some(cm("x")),
    )
    .await;
    let (code, _) = call(u, "DELETE", "/api/v1/namespaces/gone", None).await;
    assert_eq!(code, 200);
    let (code, _) = call(u, "GET", "/api/v1/namespaces/gone", None).await;
    assert_eq!(code, 404);
    let (code, _) = call(u, "GET", "/api/v1/namespaces/gone/configmaps/x", None).await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn tables_for_kubectl() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    create_widget_crd(u).await;
    call(
        u,
        "POST",
        W,
        Some(widget("tw", json!({"image": "x", "size": 3}))),
    )
    .await;
    patch(
        u,
        &format!("{W}/tw/status"),
        "application/merge-patch+json",
        r#"{"status":{"phase":"Running","conditions":[{"type":"Ready","status":"True"}]}}"#,
    )
    .await;
    let (code, t) = send(
        u,
        "GET",
        W,
        &[(
            "Accept",
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
        )],
        "",
    )
    .await;
    assert_eq!(code, 200);
    let t: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(t["kind"], "Table");
    assert_eq!(t["apiVersion"], "meta.k8s.io/v1");
    let cols: Vec<&str> = t["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(cols, vec!["Name", "Size", "Phase", "Ready", "Age"]);
    let cells = t["rows"][0]["cells"].as_array().unwrap();
    assert_eq!(
        cells[..4],
        [json!("tw"), json!(3), json!("Running"), json!("True")]
    );
    assert!(cells[4].as_str().unwrap().ends_with('s'));
    assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
}

#[tokio::test]
async fn bearer_tokens_and_reviews() {
    let mut auth = Auth::default();
    auth.tokens.insert(
        "admin-token".into(),
        User {
            name: "admin".into(),
            groups: vec!["system:masters".into()],
        },
    );
    auth.tokens.insert(
        "agent-token".into(),
        User {
            name: "agent".into(),
            groups: vec!["imp:agents".into()],
        },
    );
    auth.rules.push(Rule {
        subject: "imp:agents".into(),
        verbs: vec!["get".into(), "patch".into()],
        groups: vec!["imp.dev".into()],
        resources: vec!["impvms/status".into()],
    });
    let k = TestKube::start_with(Config {
        auth,
        kubeconfig_token: Some("admin-token".into()),
        ..Config::default()
    })
    .await
    .unwrap();
    let u = k.url();
    let (code, e) = call(u, "GET", CM, None).await;
    assert_eq!(code, 401);
    assert_eq!(e["reason"], "Unauthorized");
    let (code, _) = send(u, "GET", CM, &[("Authorization", "Bearer wrong")], "").await;
    assert_eq!(code, 401);
    let (code, _) = send(u, "GET", CM, &[("Authorization", "Bearer admin-token")], "").await;
    assert_eq!(code, 200);
    let hdr = [
        ("Authorization", "Bearer admin-token"),
        ("Content-Type", "application/json"),
    ];
    let (code, r) = send(u, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", &hdr,
        &json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "agent-token"}}).to_string()).await;
    assert_eq!(code, 201);
    let r: Value = serde_json::from_str(&r).unwrap();
    assert_eq!(r["status"]["authenticated"], true);
    assert_eq!(r["status"]["user"]["username"], "agent");
    let sar = |verb: &str, sub: &str| {
        json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": "agent", "groups": ["imp:agents"], "resourceAttributes": {"verb": verb, "group": "imp.dev", "resource": "impvms", "subresource": sub}}}).to_string()
    };
    let (_, r) = send(
        u,
        "POST",
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        &hdr,
        &sar("patch", "status"),
    )
    .await;
    assert_eq!(
        serde_json::from_str::<Value>(&r).unwrap()["status"]["allowed"],
        true
    );
    let (_, r) = send(
        u,
        "POST",
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        &hdr,
        &sar("delete", ""),
    )
    .await;
    assert_eq!(
        serde_json::from_str::<Value>(&r).unwrap()["status"]["allowed"],
        false
    );
    let kc = std::fs::read_to_string(k.kubeconfig()).unwrap();
    assert!(kc.contains("token: admin-token"));
}

#[tokio::test]
async fn builtins_leases_events_secrets() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (code, l) = call(u, "POST", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases",
        Some(json!({"metadata": {"name": "imp-operator"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}}))).await;
    assert_eq!(code, 201, "{l}");
    assert_eq!(l["apiVersion"], "coordination.k8s.io/v1");
    let (code, _) = call(u, "POST", "/apis/events.k8s.io/v1/namespaces/default/events",
        Some(json!({"metadata": {"name": "e1"}, "reason": "Started", "note": "hi", "type": "Normal", "action": "Start", "reportingController": "imp", "reportingInstance": "x", "eventTime": "2026-01-01T00:00:00.000000Z"}))).await;
    assert_eq!(code, 201);
    let (code, _) = call(u, "POST", "/api/v1/namespaces/default/events",
        Some(json!({"metadata": {"name": "e2"}, "involvedObject": {"kind": "Widget", "name": "w", "namespace": "default"}, "reason": "R", "message": "m", "type": "Warning"}))).await;
    assert_eq!(code, 201);
    let (_, evs) = call(u, "GET", "/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3Dw,involvedObject.kind%3DWidget", None).await;
    assert_eq!(evs["items"].as_array().unwrap().len(), 1);
    let (code, s) = call(
        u,
        "POST",
        "/api/v1/namespaces/default/secrets",
        Some(json!({"metadata": {"name": "s"}, "stringData": {"a": "hello"}})),
    )
    .await;
    assert_eq!(code, 201);
    assert_eq!(s["data"]["a"], "aGVsbG8=");
    assert_eq!(s["type"], "Opaque");
    let (code, n) = call(u, "POST", "/api/v1/nodes", Some(json!({"metadata": {"name": "node-1", "labels": {"imp/enabled": "true"}}, "status": {"allocatable": {"cpu": "4"}}}))).await;
    assert_eq!(code, 201);
    assert_eq!(
        n["status"]["allocatable"]["cpu"], "4",
        "nodes keep status on create"
    );
    let (code, _) = call(u, "GET", "/api/v1/namespaces/default/nodes", None).await;
    assert_eq!(code, 404, "nodes are cluster-scoped");
}

#[tokio::test]
async fn rules_are_enforced_when_asked() {
    let mut auth = Auth {
        enforce: true,
        ..Auth::default()
    };
    auth.tokens.insert(
        "agent-token".into(),
        User {
            name: "agent".into(),
            groups: vec!["imp:agents".into()],
        },
    );
    auth.rules.push(Rule {
        subject: "agent".into(),
        verbs: vec!["get".into(), "list".into(), "watch".into()],
        groups: vec!["".into()],
        resources: vec!["configmaps".into()],
    });
    let k = TestKube::start_with(Config {
        auth,
        ..Config::default()
    })
    .await
    .unwrap();
    let u = k.url();
    let h = [
        ("Authorization", "Bearer agent-token"),
        ("Content-Type", "application/json"),
    ];
    let (code, _) = send(u, "GET", CM, &h, "").await;
    assert_eq!(code, 200);
    let (code, e) = send(u, "POST", CM, &h, &cm("x").to_string()).await;
    assert_eq!(code, 403);
    let e: Value = serde_json::from_str(&e).unwrap();
    assert_eq!(e["reason"], "Forbidden");
    assert_eq!(
        e["message"],
        "configmaps is forbidden: User \"agent\" cannot create resource \"configmaps\" in API group \"\" in the namespace \"default\""
    );
    let (code, _) = send(u, "GET", "/api/v1/nodes", &h, "").await;
    assert_eq!(code, 403);
    let (code, _) = send(u, "GET", "/api/v1", &h, "").await;
    assert_eq!(code, 200, "discovery stays open to authenticated users");
}

#[tokio::test]
async fn orphan_propagation_keeps_dependents() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (_, owner) = call(u, "POST", CM, Some(cm("owner"))).await;
    let uid = owner["metadata"]["uid"].as_str().unwrap();
    let mut dep = cm("dep");
    dep["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]);
    call(u, "POST", CM, Some(dep)).await;
    let (code, _) = call(
        u,
        "DELETE",
        &format!("{CM}/owner"),
        Some(json!({"propagationPolicy": "Orphan"})),
    )
    .await;
    assert_eq!(code, 200);
    let (code, d) = call(u, "GET", &format!("{CM}/dep"), None).await;
    assert_eq!(code, 200);
    assert_eq!(d["metadata"]["ownerReferences"], json!([]));
    assert!(!k.store().exists_uid(uid));
}

#[tokio::test]
async fn table_watch_and_protobuf_refusal() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (_, l) = call(u, "GET", CM, None).await;
    let rv = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    call(u, "POST", CM, Some(cm("t"))).await;
    let (code, text) = send(
        u,
        "GET",
        &format!("{CM}?watch=true&resourceVersion={rv}&timeoutSeconds=1"),
        &[("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")],
        "",
    )
    .await;
    assert_eq!(code, 200);
    let ev: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(ev["type"], "ADDED");
    assert_eq!(ev["object"]["kind"], "Table");
    assert_eq!(ev["object"]["rows"][0]["cells"][0], "t");
    let (code, _) = send(
        u,
        "POST",
        CM,
        &[("Content-Type", "application/vnd.kubernetes.protobuf")],
        "\u{0}k8s",
    )
    .await;
    assert_eq!(code, 415);
}

#[tokio::test]
async fn watch_on_an_object_path() {
    let k = TestKube::start().await.unwrap();
    let u = k.url();
    let (_, l) = call(u, "GET", CM, None).await;
    let rv = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    call(u, "POST", CM, Some(cm("a"))).await;
    call(u, "POST", CM, Some(cm("b"))).await;
    let evs = watch_events(
        u,
        &format!("{CM}/b?watch=true&resourceVersion={rv}&timeoutSeconds=1"),
    )
    .await;
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0]["object"]["metadata"]["name"], "b");
}
