//! Compatibility fixtures: realistic manifests written from the Go project's documentation
//! must deserialise unchanged, pass validation, and be accepted by an API server serving our
//! generated CRDs (a real kube-apiserver, from imp-testenv); invalid ones must be rejected with
//! the message each file names.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};

use imp_api::validation::{self, ValidationErrors};
use imp_api::*;
use kube::ResourceExt;
use serde_json::Value;

fn fixtures(dir: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no fixtures in {}", root.display());
    v
}

fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| {
            let v: Value = serde::Deserialize::deserialize(d).unwrap();
            v
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// Lines `# KEY: text` at the top of a fixture.
fn expectations(path: &Path, key: &str) -> Vec<String> {
    let prefix = format!("# {key}: ");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
        .collect()
}

/// Deserialises by kind, validates, and returns the re-serialised object.
fn check(doc: &Value) -> Result<Result<Value, ValidationErrors>, String> {
    fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(
        doc: &Value,
        validate: impl Fn(&T) -> Result<(), ValidationErrors>,
    ) -> Result<Result<Value, ValidationErrors>, String> {
        let obj: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
        Ok(validate(&obj).map(|()| serde_json::to_value(&obj).unwrap()))
    }
    match doc["kind"].as_str().unwrap() {
        "ImpVM" => typed(doc, |o: &ImpVM| {
            let ns = o.metadata.namespace.as_deref().unwrap_or_default();
            validation::both(validation::vm(&o.spec), validation::warm_claim(ns, &o.spec))
        }),
        "ImpVMClass" => typed(doc, |o: &ImpVMClass| validation::class(&o.spec)),
        "ImpVMTemplate" => typed(doc, |o: &ImpVMTemplate| validation::template(&o.spec)),
        "ImpNetwork" => typed(doc, |o: &ImpNetwork| validation::network(&o.spec)),
        "ImpVMSnapshot" => typed(doc, |o: &ImpVMSnapshot| {
            validation::snapshot(&o.spec, &o.namespace().unwrap_or_default())
        }),
        "ImpVMMigration" => typed(doc, |o: &ImpVMMigration| {
            validation::migration(&o.spec, &o.namespace().unwrap_or_default())
        }),
        "ImpWarmPool" => typed(doc, |o: &ImpWarmPool| validation::warm_pool(&o.spec)),
        "ImpVMRunnerPool" => typed(doc, |o: &ImpVMRunnerPool| validation::runner_pool(&o.spec)),
        "ClusterImpConfig" => typed(doc, validation::cluster_config),
        "ClusterImpNodeProfile" => typed(doc, |o: &ClusterImpNodeProfile| {
            validation::node_profile(&o.spec)
        }),
        k => panic!("fixture of unknown kind {k}"),
    }
}

/// Every value the user wrote is still there, unchanged, after a typed round trip.
fn assert_subset(original: &Value, round_tripped: &Value, path: &str) {
    match (original, round_tripped) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let other = b
                    .get(k)
                    .unwrap_or_else(|| panic!("{path}.{k} was dropped by the typed round trip"));
                assert_subset(v, other, &format!("{path}.{k}"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{path}: list length changed");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_subset(x, y, &format!("{path}[{i}]"));
            }
        }
        (a, b) => assert_eq!(a, b, "{path} changed in the typed round trip"),
    }
}

#[test]
fn valid_fixtures_round_trip_and_validate() {
    let mut kinds = std::collections::BTreeSet::new();
    for path in fixtures("valid") {
        for doc in documents(&path) {
            let name = format!(
                "{}: {} {}",
                path.display(),
                doc["kind"],
                doc["metadata"]["name"]
            );
            let out = check(&doc)
                .unwrap_or_else(|e| panic!("{name}: does not deserialise: {e}"))
                .unwrap_or_else(|e| panic!("{name}: rejected: {e}"));
            assert_subset(&doc, &out, "");
            kinds.insert(doc["kind"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(
        kinds.len(),
        10,
        "fixtures must cover all ten kinds, got {kinds:?}"
    );
}

#[test]
fn invalid_fixtures_are_rejected_with_the_expected_message() {
    let mut checked = 0;
    for path in fixtures("invalid") {
        let doc = documents(&path).remove(0);
        let want = expectations(&path, "expect");
        let want_parse = expectations(&path, "expect-parse");
        match check(&doc) {
            Err(e) => {
                assert!(
                    !want_parse.is_empty(),
                    "{}: does not deserialise: {e}",
                    path.display()
                );
                for w in &want_parse {
                    assert!(
                        e.contains(w),
                        "{}: parse error {e:?} lacks {w:?}",
                        path.display()
                    );
                }
                checked += 1;
            }
            Ok(Ok(_)) if want.is_empty() => {
                // Only the server rejects this one (a CEL rule); the server test checks it.
                assert!(
                    !expectations(&path, "expect-server").is_empty(),
                    "{}: nothing expected",
                    path.display()
                );
            }
            Ok(Ok(_)) => panic!("{}: accepted, expected {want:?}", path.display()),
            Ok(Err(errors)) => {
                let text = errors.to_string();
                for w in &want {
                    assert!(
                        text.contains(w.as_str()),
                        "{}: error {text:?} lacks {w:?}",
                        path.display()
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 20,
        "only {checked} invalid fixtures were checked"
    );
}

mod server {
    use super::*;
    use imp_testenv::ControlPlane;
    use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
    use kube::{Client, discovery};

    /// The shared control plane with our CRDs installed and the namespaces the fixtures name;
    /// `None` when it is not built (the test skips; under `CI=true` it fails instead). Only one
    /// test of this binary creates objects, so the fixtures keep the namespaces they were
    /// written with.
    async fn setup() -> Option<Client> {
        let cp = ControlPlane::shared()?;
        let c = cp.admin().await.unwrap();
        cp.install_crds(&c, &imp_api::crd::all())
            .await
            .unwrap_or_else(|e| panic!("the server refused our CRDs: {}", chain(&e)));
        for n in ["edge", "ci"] {
            cp.ensure_namespace(&c, n).await.unwrap();
        }
        Some(c)
    }

    use imp_testenv::report::chain;

    async fn api_for(c: &Client, doc: &Value) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk("imp.dev", "v1alpha1", doc["kind"].as_str().unwrap());
        let (ar, caps): (ApiResource, _) = discovery::pinned_kind(c, &gvk).await.unwrap();
        match (caps.scope, doc["metadata"]["namespace"].as_str()) {
            (discovery::Scope::Namespaced, Some(ns)) => Api::namespaced_with(c.clone(), ns, &ar),
            _ => Api::all_with(c.clone(), &ar),
        }
    }

    #[tokio::test]
    async fn server_accepts_valid_fixtures_and_applies_defaults() {
        let Some(c) = setup().await else {
            return;
        };
        for path in fixtures("valid") {
            for doc in documents(&path) {
                let api = api_for(&c, &doc).await;
                let obj: DynamicObject = serde_json::from_value(doc.clone()).unwrap();
                let created = api
                    .create(&PostParams::default(), &obj)
                    .await
                    .unwrap_or_else(|e| {
                        panic!(
                            "{}: {} rejected by the server: {e}",
                            path.display(),
                            doc["kind"]
                        )
                    });
                // What the server stored is still what the user wrote, plus defaults.
                let stored = serde_json::to_value(&created).unwrap();
                assert_subset(&doc["spec"], &stored["spec"], "spec");
                // And what the server stored deserialises into our types.
                check(&stored).unwrap().unwrap();
            }
        }
        // Defaults from the schema: lifecycle, desiredState, probe periods.
        let vm: Api<ImpVM> = Api::namespaced(c.clone(), "default");
        let nginx = vm.get("nginx").await.unwrap();
        assert_eq!(nginx.spec.desired_state, shared::VmDesiredState::Running);
        let probe = nginx
            .spec
            .inherited
            .probes
            .unwrap()
            .readiness_probe
            .unwrap();
        assert_eq!((probe.period_seconds, probe.failure_threshold), (5, 3));
        let edge: Api<ImpNetwork> = Api::namespaced(c.clone(), "edge");
        let net = edge.get("edge-net").await.unwrap();
        assert_eq!(
            net.spec.groups[0].connectivity,
            network::GroupConnectivity::Subnet
        );
    }

    #[tokio::test]
    async fn server_rejects_invalid_fixtures_with_field_messages() {
        let Some(c) = setup().await else {
            return;
        };
        let mut checked = 0;
        for path in fixtures("invalid") {
            let want = expectations(&path, "expect-server");
            if want.is_empty() {
                continue; // Only the webhook's Rust rules can catch this one.
            }
            let doc = documents(&path).remove(0);
            let api = api_for(&c, &doc).await;
            let obj: DynamicObject = serde_json::from_value(doc.clone()).unwrap();
            match api.create(&PostParams::default(), &obj).await {
                Err(kube::Error::Api(s)) => {
                    assert_eq!(s.code, 422, "{}: {s:?}", path.display());
                    for w in &want {
                        assert!(
                            s.message.contains(w.as_str()),
                            "{}: {:?} lacks {w:?}",
                            path.display(),
                            s.message
                        );
                    }
                }
                other => panic!("{}: expected 422, got {other:?}", path.display()),
            }
            checked += 1;
        }
        assert!(
            checked >= 15,
            "only {checked} fixtures were checked against the server"
        );
    }
}
