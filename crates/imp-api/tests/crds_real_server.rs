//! The CRDs `imp crds` prints (and the chart ships) installed the way a user installs them, with
//! `kubectl apply` and its default validation, on real API servers: the newest release imp is
//! tested on (the shared control plane) and the oldest it supports (one of its own, API server
//! only). Every CRD must be accepted and Established: that proves each schema structural and
//! each CEL rule within the server's cost budget, which only the server can judge. Then the
//! server validates and prunes our objects: an unknown field is refused by name under
//! `--validate=strict`, and a valid ImpVM from the fixtures applies, is defaulted and lists with
//! our printer columns. `kubectl explain` is checked on the newest release only (kubectl is of
//! that release).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::io::Write;
use std::path::Path;
use std::process::{Output, Stdio};

use imp_testenv::{ControlPlane, Options, Release};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use serde_json::{Value, json};

const COMMITTED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../charts/imp/files/crds/imp.dev.yaml"
);

/// The CRD stream to install: the committed chart file, which must be what `imp crds` prints.
fn crd_stream() -> String {
    let committed = std::fs::read_to_string(Path::new(COMMITTED)).unwrap();
    assert!(
        committed == imp_api::crd::yaml_stream().unwrap(),
        "charts/imp/files/crds/imp.dev.yaml differs from `imp crds` (tests/crds.rs says how to refresh it)"
    );
    committed
}

/// Runs kubectl against `cp` as the admin, with `stdin` on its standard input.
fn kubectl(cp: &ControlPlane, args: &[&str], stdin: &str) -> Output {
    let mut child = cp
        .kubectl()
        .unwrap()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// kubectl's output, or a panic showing what it said.
fn ok(what: &str, out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}: kubectl failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The nginx ImpVM of the quickstart fixture, moved to namespace `ns`.
fn fixture_vm(ns: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid/quickstart.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut vm = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
        .find(|d| d["kind"] == "ImpVM")
        .unwrap_or_else(|| panic!("no ImpVM in {}", path.display()));
    vm["metadata"]["namespace"] = json!(ns);
    vm
}

/// Everything this file checks, on one control plane.
async fn crds_install_and_serve(cp: &ControlPlane, explain: bool) {
    let t0 = std::time::Instant::now();
    let crds = imp_api::crd::all();
    let names: Vec<String> = crds
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();

    // Installed as a user would: `imp crds | kubectl apply -f -`, validation on (the default).
    let out = kubectl(cp, &["apply", "-f", "-"], &crd_stream());
    let warnings = String::from_utf8_lossy(&out.stderr).into_owned();
    let applied = ok("applying the CRDs", out);
    assert_eq!(warnings, "", "the server warned about our CRDs");
    for name in &names {
        assert!(
            applied.contains(&format!(
                "customresourcedefinition.apiextensions.k8s.io/{name}"
            )),
            "kubectl did not report {name}:\n{applied}"
        );
    }
    let mut wait = vec!["wait", "--for=condition=Established", "--timeout=120s"];
    let crd_refs: Vec<String> = names.iter().map(|n| format!("crd/{n}")).collect();
    wait.extend(crd_refs.iter().map(String::as_str));
    ok(
        "waiting for the CRDs to be Established",
        kubectl(cp, &wait, ""),
    );
    // Served under the names we asked for, and no condition says otherwise (a non-structural
    // schema or a refused name would show here).
    let client = cp.admin().await.unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in &crds {
        let name = crd.metadata.name.as_deref().unwrap();
        let got = api.get(name).await.unwrap();
        let status = got.status.unwrap();
        assert_eq!(
            status.accepted_names.as_ref().map(|n| n.kind.as_str()),
            Some(crd.spec.names.kind.as_str()),
            "{name}"
        );
        for c in status.conditions.iter().flatten() {
            let good = match c.type_.as_str() {
                "Established" | "NamesAccepted" => c.status == "True",
                _ => c.status == "False",
            };
            assert!(
                good,
                "{name}: condition {} is {}: {:?}",
                c.type_, c.status, c.message
            );
        }
    }

    if explain {
        let text = ok(
            "kubectl explain",
            kubectl(cp, &["explain", "impvm.spec"], ""),
        );
        for want in [
            "KIND:",
            "ImpVM",
            "imp.dev",
            "classRef",
            "image",
            "restartPolicy",
        ] {
            assert!(
                text.contains(want),
                "kubectl explain lacks {want:?}:\n{text}"
            );
        }
    }

    let ns = cp.namespace(&client, "crds").await.unwrap();
    // Server-side field validation: an unknown field is refused, by its path.
    let mut bogus = fixture_vm(&ns);
    bogus["metadata"]["name"] = json!("bogus");
    bogus["spec"]["bogusField"] = json!(1);
    let out = kubectl(
        cp,
        &["apply", "--validate=strict", "-f", "-"],
        &bogus.to_string(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an unknown field was accepted");
    assert!(
        err.contains("unknown field \"spec.bogusField\""),
        "the refusal does not name the field: {err}"
    );
    // Without strict validation it is pruned, with a warning naming it.
    let out = kubectl(
        cp,
        &["apply", "--validate=warn", "-f", "-"],
        &bogus.to_string(),
    );
    ok("applying with --validate=warn", out.clone());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("spec.bogusField"), "no warning: {err}");
    let stored: Value = serde_json::from_str(&ok(
        "reading the pruned VM",
        kubectl(cp, &["get", "-n", &ns, "impvm", "bogus", "-o", "json"], ""),
    ))
    .unwrap();
    assert!(stored["spec"].get("bogusField").is_none(), "{stored}");

    // A valid manifest applies, is defaulted by the schema, and lists with our columns.
    ok(
        "applying the quickstart ImpVM",
        kubectl(
            cp,
            &["apply", "--validate=strict", "-f", "-"],
            &fixture_vm(&ns).to_string(),
        ),
    );
    let stored: Value = serde_json::from_str(&ok(
        "reading the VM",
        kubectl(cp, &["get", "-n", &ns, "impvm", "nginx", "-o", "json"], ""),
    ))
    .unwrap();
    assert_eq!(stored["spec"]["desiredState"], "Running", "{stored}");
    let typed: imp_api::ImpVM = serde_json::from_value(stored).unwrap();
    imp_api::validation::vm(&typed.spec).unwrap();
    let table = ok(
        "listing VMs",
        kubectl(cp, &["get", "-n", &ns, "impvms"], ""),
    );
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(header, ["NAME", "PHASE", "NODE", "IP", "AGE"], "{table}");
    eprintln!(
        "Kubernetes {}: CRDs installed and checked in {:.1} s",
        cp.version(),
        t0.elapsed().as_secs_f64()
    );
}

#[tokio::test]
async fn crds_install_and_serve_on_the_newest_release() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    crds_install_and_serve(cp, true).await;
}

#[tokio::test]
async fn crds_install_and_serve_on_the_oldest_release() {
    if !imp_testenv::controlplane::available(Release::Oldest) {
        return;
    }
    imp_testenv::require!(
        imp_testenv::controlplane::kubectl().is_ok(),
        "kubectl of the newest release: build it with scripts/kube/build"
    );
    let cp = ControlPlane::start(Options {
        release: Release::Oldest,
        controller_manager: false,
        ..Default::default()
    })
    .await
    .unwrap();
    crds_install_and_serve(&cp, false).await;
}
