//! The same YAML on both: one real kube-apiserver (imp-testenv) serves the Go project's CRDs
//! (`../shared/reference/go-crds/`), another serves ours (CRDs are cluster-wide, so one server
//! cannot hold both), and every manifest of `tests/fixtures/valid` and `tests/fixtures/go` is
//! created on both. Whatever the Go CRDs accept, ours must accept; what our server stores must
//! hold every field that was written and deserialise into our types, so the operator can read
//! it, and pass our admission webhook's field rules (`validation.rs`) unless the Go project's
//! webhook refuses it too. (What our webhook refuses as not supported yet, `unsupported.rs`, is
//! a reviewed list of its own: `REFUSED_FIXTURES` in `tests/fields.rs`.)
//! Every difference is printed, not only the first. Without `../shared/reference` beside the
//! checkout the test skips (and fails under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use imp_api::*;
use imp_testenv::{ControlPlane, Options};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::{Client, discovery};
use serde_json::Value;

fn go_crd_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/reference/go-crds")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no YAML files in {}", dir.display());
    v
}

fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| {
            let v: Value = serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            v
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Registers `crds` on a control plane and creates every namespace the fixtures use.
async fn server(
    cp: &ControlPlane,
    crds: &[CustomResourceDefinition],
    namespaces: &BTreeSet<String>,
) -> Client {
    let c = cp.admin().await.unwrap();
    cp.install_crds(&c, crds)
        .await
        .unwrap_or_else(|e| panic!("the server refused the CRDs: {}", chain(&e)));
    for n in namespaces {
        cp.ensure_namespace(&c, n).await.unwrap();
    }
    c
}

use imp_testenv::report::chain;

/// Creates `doc`, replacing an object of the same name an earlier fixture made (the fixtures
/// are independent manifests, and ClusterImpConfig can only be named `cluster`).
async fn create(c: &Client, doc: &Value) -> Result<Value, String> {
    let kind = doc["kind"].as_str().unwrap_or_default();
    let gvk = GroupVersionKind::gvk("imp.dev", "v1alpha1", kind);
    let (ar, caps): (ApiResource, _) = discovery::pinned_kind(c, &gvk)
        .await
        .map_err(|e| format!("discovery of {kind}: {e}"))?;
    let api: Api<DynamicObject> = match (caps.scope, doc["metadata"]["namespace"].as_str()) {
        (discovery::Scope::Namespaced, Some(ns)) => Api::namespaced_with(c.clone(), ns, &ar),
        _ => Api::all_with(c.clone(), &ar),
    };
    let obj: DynamicObject = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
    if let Some(name) = doc["metadata"]["name"].as_str() {
        let _ = api.delete(name, &Default::default()).await; // 404 when there was none
    }
    api.create(&PostParams::default(), &obj)
        .await
        .map(|o| serde_json::to_value(o).unwrap())
        .map_err(|e| e.to_string())
}

/// Every value written is in `stored`, unchanged; a written null counts as nothing written.
fn missing_from(written: &Value, stored: &Value, path: &str, out: &mut Vec<String>) {
    match (written, stored) {
        (Value::Null, _) => {}
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(s) => missing_from(v, s, &format!("{path}.{k}"), out),
                    None if v.is_null() => {}
                    None => out.push(format!("{path}.{k} was dropped")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                missing_from(x, y, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path} was written as {a} and stored as {b}")),
    }
}

/// Reads a stored object into our typed kind, as the operator would.
fn typed(stored: &Value) -> Result<(), String> {
    fn read<T: serde::de::DeserializeOwned>(v: &Value) -> Result<(), String> {
        serde_json::from_value::<T>(v.clone())
            .map(drop)
            .map_err(|e| e.to_string())
    }
    match stored["kind"].as_str().unwrap_or_default() {
        "ImpVM" => read::<ImpVM>(stored),
        "ImpVMClass" => read::<ImpVMClass>(stored),
        "ImpVMTemplate" => read::<ImpVMTemplate>(stored),
        "ImpNetwork" => read::<ImpNetwork>(stored),
        "ImpVMSnapshot" => read::<ImpVMSnapshot>(stored),
        "ImpVMMigration" => read::<ImpVMMigration>(stored),
        "ImpWarmPool" => read::<ImpWarmPool>(stored),
        "ImpVMRunnerPool" => read::<ImpVMRunnerPool>(stored),
        "ClusterImpConfig" => read::<ClusterImpConfig>(stored),
        "ClusterImpNodeProfile" => read::<ClusterImpNodeProfile>(stored),
        k => Err(format!("unknown kind {k}")),
    }
}

/// Runs our admission webhook's field rules (validation.rs) on a stored object.
fn admitted(stored: &Value) -> Result<(), String> {
    use imp_api::validation as v;
    fn run<T: serde::de::DeserializeOwned>(
        stored: &Value,
        check: impl Fn(&T) -> Result<(), v::ValidationErrors>,
    ) -> Result<(), String> {
        let obj: T = serde_json::from_value(stored.clone()).map_err(|e| e.to_string())?;
        check(&obj).map_err(|e| e.to_string())
    }
    match stored["kind"].as_str().unwrap_or_default() {
        "ImpVM" => run(stored, |o: &ImpVM| v::vm(&o.spec)),
        "ImpVMClass" => run(stored, |o: &ImpVMClass| v::class(&o.spec)),
        "ImpVMTemplate" => run(stored, |o: &ImpVMTemplate| v::template(&o.spec)),
        "ImpNetwork" => run(stored, |o: &ImpNetwork| v::network(&o.spec)),
        "ImpVMSnapshot" => run(stored, |o: &ImpVMSnapshot| {
            v::snapshot(&o.spec, &o.metadata.namespace.clone().unwrap_or_default())
        }),
        "ImpVMMigration" => run(stored, |o: &ImpVMMigration| {
            v::migration(&o.spec, &o.metadata.namespace.clone().unwrap_or_default())
        }),
        "ImpWarmPool" => run(stored, |o: &ImpWarmPool| v::warm_pool(&o.spec)),
        "ImpVMRunnerPool" => run(stored, |o: &ImpVMRunnerPool| v::runner_pool(&o.spec)),
        "ClusterImpConfig" => run(stored, v::cluster_config),
        "ClusterImpNodeProfile" => {
            run(stored, |o: &ClusterImpNodeProfile| v::node_profile(&o.spec))
        }
        _ => Ok(()),
    }
}

/// Manifests the Go CRDs store but the Go admission webhook (internal/webhook/v1alpha1)
/// refuses, so our webhook may refuse them too: (name, the Go rule).
const GO_WEBHOOK_REFUSES: &[(&str, &str)] = &[(
    "impvm-sample",
    "validateImpVM: exactly one of classRef or templateRef must be set",
)];

fn cluster_scoped(kind: &str) -> bool {
    matches!(
        kind,
        "ImpVMClass" | "ClusterImpConfig" | "ClusterImpNodeProfile"
    )
}

#[tokio::test]
async fn whatever_the_go_crds_accept_ours_accept_and_store_unchanged() {
    imp_testenv::require!(
        go_crd_dir().is_dir(),
        "../shared/reference/go-crds beside the checkout (the Go project's CRDs)"
    );
    // Ours on the shared control plane, Go's on one of its own.
    let Some(our_cp) = ControlPlane::shared() else {
        return;
    };
    let go_cp = ControlPlane::start(Options {
        controller_manager: false,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("starting the Go CRDs' control plane: {}", chain(&e)));
    let go_crds: Vec<CustomResourceDefinition> = yaml_files(&go_crd_dir())
        .iter()
        .map(|p| serde_yaml_ng::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect();
    assert_eq!(
        go_crds.len(),
        10,
        "expected ten Go CRDs in {}",
        go_crd_dir().display()
    );

    // (file, document, whether the Go CRDs accept it)
    let mut cases: Vec<(PathBuf, Value, bool)> = Vec::new();
    for dir in ["valid", "go"] {
        for path in yaml_files(&fixture_dir(dir)) {
            // Our valid fixtures are valid Go manifests too; refused-by-go.yaml is not.
            let go_accepts = path.file_name().is_none_or(|n| n != "refused-by-go.yaml");
            for mut doc in documents(&path) {
                if cluster_scoped(doc["kind"].as_str().unwrap_or_default())
                    && let Some(m) = doc["metadata"].as_object_mut()
                {
                    m.remove("namespace");
                }
                cases.push((path.clone(), doc, go_accepts));
            }
        }
    }
    let namespaces: BTreeSet<String> = cases
        .iter()
        .filter_map(|(_, d, _)| d["metadata"]["namespace"].as_str().map(str::to_owned))
        .collect();
    let go = server(&go_cp, &go_crds, &namespaces).await;
    let ours = server(our_cp, &imp_api::crd::all(), &namespaces).await;

    let mut problems = Vec::new();
    let (mut both, mut go_refused) = (0, 0);
    for (path, doc, expect) in &cases {
        let file = path.file_name().unwrap_or_default().to_string_lossy();
        let what = format!(
            "{file}: {} {}",
            doc["kind"].as_str().unwrap_or_default(),
            doc["metadata"]["name"].as_str().unwrap_or_default()
        );
        let on_go = create(&go, doc).await;
        match (&on_go, expect) {
            (Ok(_), false) => problems.push(format!("{what}: the Go CRDs accepted it")),
            (Err(e), true) => problems.push(format!("{what}: the Go CRDs refused it: {e}")),
            _ => {}
        }
        if on_go.is_err() {
            go_refused += 1;
            continue;
        }
        match create(&ours, doc).await {
            Err(e) => problems.push(format!(
                "{what}: the Go CRDs accept it, ours refuse it: {e}"
            )),
            Ok(stored) => {
                both += 1;
                let mut dropped = Vec::new();
                let mut written = doc.clone();
                if let Some(o) = written.as_object_mut() {
                    o.remove("status"); // ignored on create with a status subresource
                }
                missing_from(&written, &stored, "", &mut dropped);
                problems.extend(dropped.into_iter().map(|d| format!("{what}: {d}")));
                if let Err(e) = typed(&stored) {
                    problems.push(format!("{what}: stored, but our types cannot read it: {e}"));
                }
                let name = doc["metadata"]["name"].as_str().unwrap_or_default();
                let go_webhook_refuses = GO_WEBHOOK_REFUSES.iter().any(|(n, _)| *n == name);
                match admitted(&stored) {
                    Err(e) if !go_webhook_refuses => {
                        problems.push(format!("{what}: refused by our admission webhook: {e}"))
                    }
                    Ok(()) if go_webhook_refuses => problems.push(format!(
                        "{what}: listed in GO_WEBHOOK_REFUSES but our webhook admits it"
                    )),
                    _ => {}
                }
            }
        }
    }
    eprintln!("{both} manifests accepted by both, {go_refused} refused by the Go CRDs");
    assert!(
        problems.is_empty(),
        "{} differences between the Go CRDs and ours:\n{}",
        problems.len(),
        problems.join("\n")
    );
    assert!(
        both >= 40,
        "only {both} manifests were accepted by both servers"
    );
    let want_refused = documents(&fixture_dir("go").join("refused-by-go.yaml")).len();
    assert_eq!(go_refused, want_refused, "refusals by the Go server");
}
