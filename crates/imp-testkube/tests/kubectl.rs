//! kubectl against the test server: apply, get with printer columns, get -o yaml, describe,
//! patch, delete. Skips without kubectl locally; fails under CI=true.
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
        .ok(
            &["apply", "--validate=false", "-f", "-"],
            Some(common::WIDGET_CRD),
        )
        .await;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/widgets.test.imp.dev created"),
        "{out}"
    );
    // A fresh cache, so discovery sees the new resource.
    let kc = kubectl(bin, &k, "cr");
    let out = kc
        .ok(&["apply", "--validate=false", "-f", "-"], Some(WIDGET))
        .await;
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
    let out = kc
        .ok(&["apply", "--validate=false", "-f", "-"], Some(WIDGET))
        .await;
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
    kc.ok(&["apply", "--validate=false", "-f", "-"], Some(cm))
        .await;
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
