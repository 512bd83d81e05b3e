//! The per-User-Agent request counter benchmarks use to measure API calls.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_testkube::TestKube;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::ListParams;

#[tokio::test]
async fn counts_requests_by_user_agent() {
    let k = TestKube::start().await.unwrap();
    let kc = kube::config::Kubeconfig::read_from(k.kubeconfig()).unwrap();
    let mut cfg =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    cfg.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static("counted/1"),
    ));
    let counted = kube::Client::try_from(cfg).unwrap();
    let plain = k.client().await.unwrap();
    for _ in 0..3 {
        Api::<Namespace>::all(counted.clone())
            .list(&ListParams::default())
            .await
            .unwrap();
    }
    Api::<Namespace>::all(plain)
        .list(&ListParams::default())
        .await
        .unwrap();
    let by = k.requests_by_user_agent();
    assert_eq!(by.get("counted/1"), Some(&3), "{by:?}");
    assert_eq!(by.values().sum::<u64>(), 4, "{by:?}");
}
