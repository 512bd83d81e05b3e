//! `imp ps -n NS` and `imp ps -A` against a real API server (the test control plane of
//! imp-testenv): a user with `imp-view` in one namespace lists that namespace's ImpVMs with
//! their phase, node, address and age, and is refused the whole cluster in one line with
//! imp's exit code; the admin lists every namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

use imp_api::vm::ImpVM;
use imp_testenv::ControlPlane;
use kube::api::{Api, Patch, PatchParams, PostParams};

fn imp(kubeconfig: &Path, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_imp"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    imp_testenv::report::logged(args, out)
}

async fn vm(client: &kube::Client, ns: &str, name: &str, status: Option<serde_json::Value>) {
    let api: Api<ImpVM> = Api::namespaced(client.clone(), ns);
    let object: ImpVM = serde_json::from_value(serde_json::json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name},
        "spec": {"image": format!("registry.example/{name}:1"), "classRef": {"name": "small"}},
    }))
    .unwrap();
    api.create(&PostParams::default(), &object).await.unwrap();
    if let Some(status) = status {
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": status })),
        )
        .await
        .unwrap();
    }
}

/// The table's rows (after the header) as whitespace-separated cells.
fn rows(out: &Output) -> Vec<Vec<String>> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[tokio::test]
async fn ps_lists_a_namespace_or_every_namespace_of_the_cluster() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    cp.install_crds(&admin, &imp_api::crd::all()).await.unwrap();
    let ns = cp.namespace(&admin, "ps").await.unwrap();
    let other = cp.namespace(&admin, "ps-other").await.unwrap();
    vm(
        &admin,
        &ns,
        "web",
        Some(serde_json::json!({"phase": "Running", "nodeName": "node-a", "ip": "10.1.0.5"})),
    )
    .await;
    vm(
        &admin,
        &ns,
        "batch",
        Some(serde_json::json!({"phase": "Succeeded", "nodeName": "node-b", "exitCode": 0})),
    )
    .await;
    vm(&admin, &ns, "fresh", None).await;
    vm(
        &admin,
        &other,
        "elsewhere",
        Some(serde_json::json!({"phase": "Scheduled", "nodeName": "node-a"})),
    )
    .await;
    let alice = imp_testenv::rbac::user(cp, &ns, "alice", &["imp-view"])
        .await
        .unwrap();

    // One namespace, as a user who may read it: sorted by name, every phase.
    let out = imp(&alice, &["ps", "-n", &ns]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let header: Vec<&str> = text.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "PHASE", "NODE", "ADDRESS", "AGE", "IMAGE"],
        "{text}"
    );
    let got = rows(&out);
    assert_eq!(got.len(), 3, "{text}");
    let cells = |i: usize| got[i].iter().map(String::as_str).collect::<Vec<_>>();
    assert_eq!(
        cells(0)[..4],
        ["batch", "Succeeded", "node-b", "-"],
        "{text}"
    );
    assert_eq!(cells(1)[..4], ["fresh", "Pending", "-", "-"], "{text}");
    assert_eq!(
        cells(2)[..4],
        ["web", "Running", "node-a", "10.1.0.5"],
        "{text}"
    );
    assert_eq!(cells(2)[5], "registry.example/web:1", "{text}");
    let age = cells(2)[4];
    assert!(
        age.ends_with('s') || age.ends_with('m'),
        "a VM created seconds ago: {age}"
    );

    // The whole cluster is not hers to list: one line saying so, imp's exit code.
    let out = imp(&alice, &["ps", "-A"]);
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("imp: listing the ImpVMs of every namespace") && err.contains("forbidden"),
        "{err}"
    );
    assert!(
        !err.contains("Status {"),
        "the refusal, not a dump of it: {err}"
    );

    // The admin sees every namespace, with the namespace first.
    let out = imp(cp.admin_kubeconfig(), &["ps", "-A"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.starts_with("NAMESPACE "), "{text}");
    let ours: Vec<Vec<String>> = rows(&out)
        .into_iter()
        .filter(|r| r[0] == ns || r[0] == other)
        .collect();
    let names: Vec<(&str, &str, &str)> = ours
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str(), r[2].as_str()))
        .collect();
    assert_eq!(
        names,
        [
            (ns.as_str(), "batch", "Succeeded"),
            (ns.as_str(), "fresh", "Pending"),
            (ns.as_str(), "web", "Running"),
            (other.as_str(), "elsewhere", "Scheduled"),
        ],
        "{text}"
    );
}
