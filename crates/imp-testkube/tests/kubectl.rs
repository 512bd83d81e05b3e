//! kubectl against the test server as a user types it (no `--validate=false`: it validates on
//! the client from the served OpenAPI): apply, create, replace, explain, get with printer
//! columns, get -o yaml, describe, patch, delete. Skips without kubectl locally; fails under CI=true.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::path::Path;

use imp_testkube::TestKube;

struct Kubectl<'a> {
    bin: std::path::PathBuf,
    kubeconfig: &'a Path,
    cache: std::path::PathBuf,
}

impl Kubectl<'_> {
    async fn run(&self, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
        use tokio::io::AsyncWriteExt;
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("--kubeconfig")
            .arg(self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut input = child.stdin.take().unwrap();
        input
            .write_all(stdin.unwrap_or("").as_bytes())
            .await
            .unwrap();
        drop(input);
        let out = child.wait_with_output().await.unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    async fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let (ok, out, err) = self.run(args, stdin).await;
        assert!(ok, "kubectl {args:?} failed:\n{out}\n{err}");
        out
    }
}

fn kubectl<'a>(bin: std::path::PathBuf, k: &'a TestKube, name: &str) -> Kubectl<'a> {
    Kubectl {
        bin,
        kubeconfig: k.kubeconfig(),
        cache: k.kubeconfig().with_file_name(format!("cache-{name}")),
    }
}

const WIDGET: &str = "apiVersion: test.imp.dev/v1
kind: Widget
metadata:
  name: w1
spec:
  image: busybox
  size: 3
";

#[tokio::test]
async fn kubectl_apply_get_describe_patch_delete_crs() {
    let bin = imp_testkube::require_tool!("kubectl");
    let k = TestKube::start().await.unwrap();
    let crd = kubectl(bin.clone(), &k, "crd");
    let out = crd
        .ok(&["apply", "-f", "-"], Some(common::WIDGET_CRD))
        .await;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/widgets.test.imp.dev created"),
        "{out}"
    );
    // A fresh cache, so discovery sees the new resource.
    let kc = kubectl(bin, &k, "cr");
    let out = kc.ok(&["apply", "-f", "-"], Some(WIDGET)).await;
    assert!(out.contains("widget.test.imp.dev/w1 created"), "{out}");

    let out = kc.ok(&["get", "widgets"], None).await;
    let header: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        vec!["NAME", "SIZE", "PHASE", "READY", "AGE"],
        "{out}"
    );
    assert!(out.lines().nth(1).unwrap().starts_with("w1"), "{out}");
    let out = kc.ok(&["get", "wd", "w1", "-o", "yaml"], None).await;
    assert!(out.contains("mode: fast"), "defaults are applied: {out}");
    assert!(out.contains("kind: Widget"), "{out}");
    // An event recorded through events.k8s.io/v1 shows in describe (which reads core events).
    let (_, w) = common::call(
        k.url(),
        "GET",
        "/apis/test.imp.dev/v1/namespaces/default/widgets/w1",
        None,
    )
    .await;
    let ev = serde_json::json!({"metadata": {"name": "w1.1"}, "regarding": {"apiVersion": "test.imp.dev/v1", "kind": "Widget",
        "name": "w1", "namespace": "default", "uid": w["metadata"]["uid"]}, "reason": "Scheduled", "note": "placed on node-a",
        "type": "Normal", "action": "Schedule", "reportingController": "imp-operator", "reportingInstance": "imp-operator-0",
        "eventTime": "2026-01-01T00:00:00.000000Z"});
    let (code, e) = common::call(
        k.url(),
        "POST",
        "/apis/events.k8s.io/v1/namespaces/default/events",
        Some(ev),
    )
    .await;
    assert_eq!(code, 201, "{e}");
    let out = kc.ok(&["describe", "widget", "w1"], None).await;
    assert!(
        out.contains("Name:") && out.contains("w1") && out.contains("Image:"),
        "{out}"
    );
    assert!(
        out.contains("Scheduled") && out.contains("placed on node-a"),
        "{out}"
    );

    let out = kc
        .ok(
            &[
                "patch",
                "widget",
                "w1",
                "--type",
                "merge",
                "-p",
                r#"{"spec":{"size":4}}"#,
            ],
            None,
        )
        .await;
    assert!(out.contains("patched"), "{out}");
    let out = kc
        .ok(
            &[
                "get",
                "widget",
                "w1",
                "-o",
                "jsonpath={.spec.size} {.metadata.generation}",
            ],
            None,
        )
        .await;
    assert_eq!(out.trim(), "4 2");
    let out = kc.ok(&["apply", "-f", "-"], Some(WIDGET)).await;
    assert!(out.contains("configured"), "{out}");

    let (ok, _, err) = kc
        .run(
            &[
                "patch",
                "widget",
                "w1",
                "--type",
                "merge",
                "-p",
                r#"{"spec":{"size":0}}"#,
            ],
            None,
        )
        .await;
    assert!(!ok);
    assert!(
        err.contains(
            "spec.size: Invalid value: 0: spec.size in body should be greater than or equal to 1"
        ),
        "{err}"
    );

    let out = kc.ok(&["delete", "widget", "w1"], None).await;
    assert!(out.contains("\"w1\" deleted"), "{out}");
    let (ok, _, err) = kc.run(&["get", "widget", "w1"], None).await;
    assert!(!ok);
    assert!(
        err.contains("NotFound") || err.contains("not found"),
        "{err}"
    );
}

#[tokio::test]
async fn kubectl_builtins() {
    let bin = imp_testkube::require_tool!("kubectl");
    let k = TestKube::start().await.unwrap();
    let kc = kubectl(bin, &k, "builtins");
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c1\n  labels:\n    app: imp\ndata:\n  a: b\n";
    kc.ok(&["apply", "-f", "-"], Some(cm)).await;
    let out = kc.ok(&["get", "configmaps", "-l", "app=imp"], None).await;
    assert!(out.contains("c1"), "{out}");
    let out = kc.ok(&["get", "namespaces"], None).await;
    assert!(out.contains("default") && out.contains("Active"), "{out}");
    let out = kc.ok(&["get", "cm", "c1", "-o", "yaml"], None).await;
    assert!(out.contains("a: b"), "{out}");
    kc.ok(&["label", "cm", "c1", "extra=yes"], None).await;
    let out = kc
        .ok(&["get", "cm", "-l", "extra=yes", "-o", "name"], None)
        .await;
    assert_eq!(out.trim(), "configmap/c1");
    kc.ok(&["delete", "cm", "c1"], None).await;
}

/// Runs kubectl with `stdin` and returns its stderr, asserting that it failed.
async fn refused(kc: &Kubectl<'_>, args: &[&str], stdin: &str) -> String {
    let (ok, out, err) = kc.run(args, Some(stdin)).await;
    assert!(!ok, "kubectl {args:?} should have failed:\n{out}\n{err}");
    err
}

#[tokio::test]
async fn kubectl_validates_custom_resources_on_the_client() {
    let bin = imp_testkube::require_tool!("kubectl");
    let k = TestKube::start().await.unwrap();
    kubectl(bin.clone(), &k, "crd")
        .ok(&["apply", "-f", "-"], Some(common::WIDGET_CRD))
        .await;
    // The CRD was created at run time; a fresh cache sees it in discovery and OpenAPI.
    let kc = kubectl(bin, &k, "cr");
    let out = kc.ok(&["create", "-f", "-"], Some(WIDGET)).await;
    assert!(out.contains("widget.test.imp.dev/w1 created"), "{out}");
    let bigger = WIDGET.replace("size: 3", "size: 5");
    let out = kc.ok(&["replace", "-f", "-"], Some(&bigger)).await;
    assert!(out.contains("widget.test.imp.dev/w1 replaced"), "{out}");
    let out = kc
        .ok(
            &["get", "widget", "w1", "-o", "jsonpath={.spec.size}"],
            None,
        )
        .await;
    assert_eq!(out.trim(), "5");
    let out = kc.ok(&["apply", "-f", "-"], Some(WIDGET)).await;
    assert!(out.contains("configured"), "{out}");

    // An unknown field is refused by kubectl itself, before anything reaches the server.
    let typo = WIDGET.replace("size: 3", "size: 3\n  sise: 4");
    for verb in ["apply", "create", "replace"] {
        let err = refused(&kc, &[verb, "-f", "-"], &typo).await;
        assert!(
            err.contains("error validating data: ValidationError(Widget.spec): unknown field \"sise\" in dev.imp.test.v1.Widget.spec"),
            "{verb}: {err}"
        );
        assert!(err.contains("--validate=false"), "{err}");
    }
    // A wrong type too.
    let wrong = WIDGET.replace("size: 3", "size: three");
    let err = refused(&kc, &["apply", "-f", "-"], &wrong).await;
    assert!(err.contains("ValidationError(Widget.spec.size)"), "{err}");
    let out = kc
        .ok(
            &["get", "widget", "w1", "-o", "jsonpath={.spec.size}"],
            None,
        )
        .await;
    assert_eq!(out.trim(), "3", "the refused manifests changed nothing");

    let out = kc.ok(&["explain", "widget.spec"], None).await;
    assert!(out.contains("Widget"), "{out}");
    assert!(
        out.contains("image") && out.contains("<string>") && out.contains("-required-"),
        "{out}"
    );
    let out = kc.ok(&["explain", "wd.spec.tags"], None).await;
    assert!(out.contains("tags <[]string>"), "{out}");
}

#[tokio::test]
async fn kubectl_validates_and_explains_builtins() {
    let bin = imp_testkube::require_tool!("kubectl");
    let k = TestKube::start().await.unwrap();
    let kc = kubectl(bin, &k, "builtin-validation");
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c1\ndata:\n  a: b\n";
    let out = kc.ok(&["create", "-f", "-"], Some(cm)).await;
    assert!(out.contains("configmap/c1 created"), "{out}");
    let out = kc
        .ok(&["replace", "-f", "-"], Some(&cm.replace("a: b", "a: c")))
        .await;
    assert!(out.contains("configmap/c1 replaced"), "{out}");
    let out = kc.ok(&["apply", "-f", "-"], Some(cm)).await;
    assert!(out.contains("configmap/c1 configured"), "{out}");
    let typo = cm.replace("\ndata:", "\ndta:");
    let err = refused(&kc, &["apply", "-f", "-"], &typo).await;
    assert!(
        err.contains("error validating data: ValidationError(ConfigMap): unknown field \"dta\" in io.k8s.api.core.v1.ConfigMap"),
        "{err}"
    );
    let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p1\nspec:\n  containers:\n  - name: c\n    image: busybox\n    imagePullPolicy: Always\n";
    kc.ok(&["create", "-f", "-"], Some(pod)).await;
    let err = refused(
        &kc,
        &["create", "-f", "-"],
        &pod.replace("p1", "p2")
            .replace("imagePullPolicy", "imagePullPolice"),
    )
    .await;
    assert!(
        err.contains("unknown field \"imagePullPolice\" in io.k8s.api.core.v1.Container"),
        "{err}"
    );

    let out = kc.ok(&["explain", "configmap.data"], None).await;
    assert!(out.contains("ConfigMap"), "{out}");
    assert!(out.contains("data <map[string]string>"), "{out}");
    let out = kc.ok(&["explain", "pods.spec.containers"], None).await;
    assert!(out.contains("image") && out.contains("<string>"), "{out}");
}

/// The imp CRDs as the chart ships them.
const IMP_CRDS: &str = include_str!("../../../charts/imp/crds/imp.dev.yaml");

const IMPVM: &str = "apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata:
  name: vm1
spec:
  classRef:
    name: small
  image: docker.io/library/nginx:1.27.4-alpine
  lifecycle: persistent
";

#[tokio::test]
async fn kubectl_applies_and_explains_impvms() {
    let bin = imp_testkube::require_tool!("kubectl");
    let k = TestKube::start().await.unwrap();
    let out = kubectl(bin.clone(), &k, "imp-crds")
        .ok(&["apply", "-f", "-"], Some(IMP_CRDS))
        .await;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/impvms.imp.dev created"),
        "{out}"
    );
    let kc = kubectl(bin, &k, "impvm");
    let out = kc.ok(&["explain", "impvm.spec"], None).await;
    assert!(out.contains("classRef") && out.contains("image"), "{out}");
    // The field's own description, as the chart's CRD has it.
    let crd = serde_yaml_ng::Deserializer::from_str(IMP_CRDS)
        .map(|d| <serde_json::Value as serde::Deserialize>::deserialize(d).unwrap())
        .find(|c| c["metadata"]["name"] == "impvms.imp.dev")
        .unwrap();
    let class_ref = crd
        .pointer("/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/classRef/description")
        .and_then(serde_json::Value::as_str)
        .unwrap();
    let out = kc.ok(&["explain", "impvm.spec.classRef"], None).await;
    assert!(out.contains("ImpVM"), "{out}");
    // kubectl wraps long descriptions: compare word by word.
    let words = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        words(&out).contains(&words(class_ref)),
        "{class_ref:?} in {out}"
    );
    let out = kc.ok(&["apply", "-f", "-"], Some(IMPVM)).await;
    assert!(out.contains("impvm.imp.dev/vm1 created"), "{out}");
    let err = refused(
        &kc,
        &["apply", "-f", "-"],
        &IMPVM.replace("lifecycle:", "lifecylce:"),
    )
    .await;
    assert!(
        err.contains(
            "ValidationError(ImpVM.spec): unknown field \"lifecylce\" in dev.imp.v1alpha1.ImpVM.spec"
        ),
        "{err}"
    );
}
