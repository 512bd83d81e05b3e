//! The test control plane is the real thing: TLS with its own CA, certificate and
//! ServiceAccount-token users, RBAC that refuses, TokenReview, kubectl with a bearer token (which
//! the old test server could not serve), and the controller-manager's namespace deletion and
//! garbage collection.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use imp_testenv::ControlPlane;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

async fn wait_until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let t0 = std::time::Instant::now();
    while !f().await {
        assert!(t0.elapsed() < Duration::from_secs(60), "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_server_reports_its_pinned_version_and_answers_the_admin() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let c = cp.admin().await.unwrap();
    let v = c.apiserver_version().await.unwrap();
    assert_eq!(
        v.git_version,
        cp.version(),
        "the version stamped by scripts/kube/build"
    );
    eprintln!("started in {:.1} s", cp.started_in().as_secs_f64());
}

#[tokio::test]
async fn a_service_account_without_a_binding_is_refused_by_rbac_and_reviewed_as_itself() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    let ns = cp.namespace(&admin, "rbac").await.unwrap();
    let kc = cp.service_account_kubeconfig(&ns, "nobody").await.unwrap();
    let nobody = cp.client_from(&kc).await.unwrap();
    let nodes: Api<Node> = Api::all(nobody);
    match nodes.list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("an unbound ServiceAccount listed Nodes: {other:?}"),
    }
    // The token is a real one: a TokenReview names the ServiceAccount.
    let token = std::fs::read_to_string(&kc).unwrap();
    let token: serde_json::Value = serde_json::from_str(&token).unwrap();
    let token = token["users"][0]["user"]["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let reviews: Api<TokenReview> = Api::all(admin);
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token),
            ..Default::default()
        },
        ..Default::default()
    };
    let r = reviews
        .create(&PostParams::default(), &review)
        .await
        .unwrap();
    let status = r.status.unwrap();
    assert_eq!(status.authenticated, Some(true));
    assert_eq!(
        status.user.unwrap().username.as_deref(),
        Some(format!("system:serviceaccount:{ns}:nobody").as_str())
    );
}

#[tokio::test]
async fn kubectl_sends_a_bearer_token_over_tls() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    let ns = cp.namespace(&admin, "kubectl").await.unwrap();
    let kc = cp.service_account_kubeconfig(&ns, "reader").await.unwrap();
    // Unbound: kubectl authenticates (403 names the ServiceAccount, not 401).
    let out = std::process::Command::new(imp_testenv::controlplane::kubectl().unwrap())
        .env("KUBECONFIG", &kc)
        .args(["get", "configmaps"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("system:serviceaccount:{ns}:reader")) && err.contains("forbidden"),
        "{err}"
    );
}

#[tokio::test]
async fn namespaces_are_deleted_and_dependents_collected_by_the_controller_manager() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let c = cp.admin().await.unwrap();
    let ns = cp.namespace(&c, "gc").await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), &ns);
    let owner = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "owner"}})).unwrap(),
        )
        .await
        .unwrap();
    let uid = owner.metadata.uid.unwrap();
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(
            json!({"metadata": {"name": "dependent", "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
            ]}}),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    cms.delete("owner", &DeleteParams::default()).await.unwrap();
    wait_until("the garbage collector deletes the dependent", || {
        let cms = cms.clone();
        async move { cms.get_opt("dependent").await.unwrap().is_none() }
    })
    .await;
    let nss: Api<Namespace> = Api::all(c.clone());
    nss.delete(&ns, &DeleteParams::default()).await.unwrap();
    wait_until("the namespace controller finishes the deletion", || {
        let nss = nss.clone();
        let ns = ns.clone();
        async move { nss.get_opt(&ns).await.unwrap().is_none() }
    })
    .await;
}
