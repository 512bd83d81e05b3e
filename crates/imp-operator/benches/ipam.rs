//! IPAM benchmark (printed figures, no assertions on time): the pure allocation decision, and
//! 1,000 concurrent VMs allocating through the real protocol (per-network lock, fresh read,
//! resourceVersion-preconditioned status write) against a real kube-apiserver (imp-testenv), the
//! IPAM running as the operator's ServiceAccount with the chart's role.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::network::{ImpNetwork, ImpNetworkSpec, ImpNetworkStatus};
use imp_operator::ipam::{
    Ipam, allocator, batch,
    pool::{Internal, PoolSource},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams, PostParams};

const VMS: usize = 1000;

/// `n` decisions in `d`, said.
fn rate(what: &str, n: usize, d: Duration) -> String {
    imp_testenv::figures::figure(what, d.as_secs_f64() * 1e6 / n as f64, "us per VM", "");
    format!(
        "{n} in {:.1} ms = {:.0}/s",
        d.as_secs_f64() * 1e3,
        n as f64 / d.as_secs_f64()
    )
}

fn ready_status() -> ImpNetworkStatus {
    let mut status = ImpNetworkStatus::default();
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::True,
        ConditionReason::Reconciled,
        "bench",
        None,
        Time(k8s_openapi::jiff::Timestamp::now()),
    );
    status
}

fn pure_batch() {
    let mut net = ImpNetwork::new(
        "one",
        ImpNetworkSpec {
            subnet: "10.0.0.0/20".into(),
            ..Default::default()
        },
    );
    net.status = Some(ready_status());
    let wants: Vec<batch::Want> = (0..VMS)
        .map(|i| batch::Want {
            owner: format!("ns/vm-{i}"),
            group: None,
        })
        .collect();
    let t = Instant::now();
    let d = batch::decide(&net, "ns/one", &wants);
    let took = t.elapsed();
    assert_eq!(d.added.len(), VMS);
    println!(
        "ipam batch decision ({VMS} VMs in one batch on a /20): {}",
        rate(
            &format!("ipam batch decision ({VMS} VMs in one batch on a /20)"),
            VMS,
            took
        )
    );
}

fn pure() {
    let spec = ImpNetworkSpec {
        subnet: "10.0.0.0/20".into(),
        ..Default::default()
    };
    let pool = Internal.pool(&spec, None).unwrap();
    let mut taken = std::collections::HashSet::new();
    let t = Instant::now();
    for _ in 0..VMS {
        let ip = allocator::pick(&pool, &taken).unwrap();
        taken.insert(ip);
    }
    println!(
        "ipam decision (first free of a /20, table growing to {VMS}): {}",
        rate(
            &format!("ipam decision (first free of a /20, table growing to {VMS})"),
            VMS,
            t.elapsed()
        )
    );
}

async fn ready_network(client: &kube::Client, name: &str, subnet: &str) {
    let api: Api<ImpNetwork> = Api::namespaced(client.clone(), "default");
    let net = ImpNetwork::new(
        name,
        ImpNetworkSpec {
            subnet: subnet.into(),
            ..Default::default()
        },
    );
    api.create(&PostParams::default(), &net).await.unwrap();
    let status = ready_status();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({"status": status})),
    )
    .await
    .unwrap();
}

async fn concurrent(ipam: Arc<Ipam>, networks: &[&str]) -> Duration {
    let per = VMS / networks.len();
    let t = Instant::now();
    let tasks: Vec<_> = networks
        .iter()
        .flat_map(|net| (0..per).map(move |i| (net.to_string(), i)))
        .map(|(net, i)| {
            let ipam = ipam.clone();
            tokio::spawn(async move {
                let ip = ipam
                    .ensure("default", &net, &format!("default/{net}-vm-{i}"), None)
                    .await
                    .unwrap();
                (net, ip)
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        let got = t.await.unwrap();
        assert!(seen.insert(got.clone()), "{got:?} given twice");
    }
    t.elapsed()
}

fn main() {
    pure();
    pure_batch();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let Some(cp) = imp_testenv::ControlPlane::shared() else {
        return;
    };
    rt.block_on(async {
        // The admin creates the networks; the IPAM writes as the operator.
        let client = cp.admin().await.unwrap();
        cp.install_crds(&client, &imp_api::crd::all())
            .await
            .unwrap();
        let ids = imp_testenv::rbac::install(cp, "imp-system").await.unwrap();
        let operator = cp.client_from(&ids.operator).await.unwrap();
        ready_network(&client, "one", "10.0.0.0/20").await;
        let ipam = Arc::new(Ipam::new(operator, None));
        let d = concurrent(ipam.clone(), &["one"]).await;
        println!(
            "ipam over the API, {VMS} concurrent VMs on one network: {}",
            rate(
                &format!("ipam over the API, {VMS} concurrent VMs on one network"),
                VMS,
                d
            )
        );
        let names: Vec<String> = (0..10).map(|i| format!("net{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            ready_network(&client, n, &format!("10.{}.0.0/24", 10 + i)).await;
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let d = concurrent(ipam.clone(), &refs).await;
        println!(
            "ipam over the API, {VMS} concurrent VMs on ten networks: {}",
            rate(
                &format!("ipam over the API, {VMS} concurrent VMs on ten networks"),
                VMS,
                d
            )
        );
        let t = Instant::now();
        for i in 0..100 {
            ipam.ensure("default", "one", &format!("default/one-vm-{i}"), None)
                .await
                .unwrap();
        }
        println!(
            "ipam over the API, an existing address found again: {}",
            rate(
                "ipam over the API, an existing address found again",
                100,
                t.elapsed()
            )
        );
    });
}
