//! End-to-end IPAM: the real `imp operator` binary against a real kube-apiserver (no agents or guests;
//! the tests play the agent where a VM's deletion needs one).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::process::Stdio;
use std::time::Duration;

use imp_api::ipv4::Ipv4Cidr;
use imp_api::network::ImpNetwork;
use imp_api::vm::ImpVM;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::process::{Child, Command};

const NS: &str = "default";
const LEADER_FLAGS: [&str; 7] = [
    "--leader-elect",
    "--lease-duration",
    "2",
    "--renew-deadline",
    "1",
    "--retry-period",
    "0.3",
];

/// A control plane of the test's own, or `None` when it is not built (skip; fails under CI).
async fn env() -> Option<(common::Cluster, Client)> {
    common::control_plane_ready()?;
    let kube = common::cluster(&[NS, "imp-system"]).await;
    let client = kube.client.clone();
    Some((kube, client))
}

fn operator(kube: &common::Cluster, identity: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_imp"))
        .arg("operator")
        .args([
            "--metrics-addr",
            &format!("127.0.0.1:{}", common::free_port()),
        ])
        .args(["--identity", identity])
        .args(["--requeue-pending", "1", "--requeue-active", "1"])
        .args(LEADER_FLAGS)
        .env("KUBECONFIG", kube.operator_kubeconfig())
        .env("RUST_LOG", common::rust_log())
        .stdout(Stdio::null())
        .stderr(common::logs())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn create<K>(c: &Client, obj: Value) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(c.clone(), NS);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(obj).unwrap(),
    )
    .await
    .unwrap()
}

/// A Ready node `n1` with room for 100 VMs and a VTEP address, and class `small`.
async fn cluster(c: &Client) {
    let nodes: Api<Node> = Api::all(c.clone());
    let n: Node = serde_json::from_value(json!({"metadata": {"name": "n1",
        "labels": {"imp/enabled": "true"},
        "annotations": {"imp.dev/vtep-address": "192.0.2.10"}}}))
    .unwrap();
    nodes.create(&PostParams::default(), &n).await.unwrap();
    let status = json!({"status": {
        "allocatable": {"cpu": "100", "memory": "100Gi"},
        "capacity": {"cpu": "100", "memory": "100Gi"},
        "addresses": [{"type": "InternalIP", "address": "192.168.0.10"}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "Test",
                        "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}]
    }});
    nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    imp_testenv::nodes::set_ready(c, "n1", "100", "100Gi", true)
        .await
        .unwrap();
    let classes: Api<imp_api::class::ImpVMClass> = Api::all(c.clone());
    let class = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
        "metadata": {"name": "small"}, "spec": {"vcpu": 1, "memoryMiB": 256, "diskGiB": 1}
    }))
    .unwrap();
    classes
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
}

async fn network(c: &Client, name: &str, spec: Value) {
    create::<ImpNetwork>(
        c,
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
               "metadata": {"name": name, "namespace": NS}, "spec": spec}),
    )
    .await;
}

async fn vm(c: &Client, name: &str, net: &str, group: Option<&str>) {
    let mut spec = json!({"classRef": {"name": "small"}, "image": "busybox",
                          "networkRef": {"name": net}});
    if let Some(g) = group {
        spec["networkGroup"] = json!(g);
    }
    create::<ImpVM>(
        c,
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
               "metadata": {"name": name, "namespace": NS}, "spec": spec}),
    )
    .await;
}

fn ip_of(v: &ImpVM) -> Option<Ipv4Addr> {
    v.status.as_ref()?.ip.as_ref()?.parse().ok()
}

/// Polls the VMs until `done`, asserting on every read that no VM is placed without its
/// address (the address is written before the placement).
async fn watch_vms(c: &Client, what: &str, done: impl Fn(&[ImpVM]) -> bool) -> Vec<ImpVM> {
    let api: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    common::wait_for(what, Duration::from_secs(30), || {
        let api = api.clone();
        let done = &done;
        async move {
            let items = api.list(&ListParams::default()).await.unwrap().items;
            for v in &items {
                assert!(
                    v.spec.node_name.is_none() || ip_of(v).is_some(),
                    "{} placed before it had an address",
                    v.name_any()
                );
            }
            done(&items).then_some(items)
        }
    })
    .await
}

async fn net_status(c: &Client, name: &str) -> imp_api::network::ImpNetworkStatus {
    let api: Api<ImpNetwork> = Api::namespaced(c.clone(), NS);
    api.get(name).await.unwrap().status.unwrap_or_default()
}

fn cond_of(s: &imp_api::network::ImpNetworkStatus) -> Option<(String, String, String)> {
    let c = s.conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn vm_cond(v: &ImpVM, t: &str) -> Option<(String, String, String)> {
    let c = v
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == t)?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_vms_get_distinct_addresses_that_survive_a_kill_and_are_released_on_delete() {
    let Some((kube, c)) = env().await else {
        return;
    };
    cluster(&c).await;
    network(
        &c,
        "net",
        json!({"subnet": "10.0.0.0/24", "groups": [{"name": "db", "expectedSize": 6}]}),
    )
    .await;
    let mut first = operator(&kube, "first");
    // Created all at once, while the operator starts.
    let names: Vec<String> = (0..20).map(|i| format!("vm-{i:02}")).collect();
    futures::future::join_all(names.iter().map(|n| vm(&c, n, "net", None))).await;
    vm(&c, "db-0", "net", Some("db")).await;
    let items = watch_vms(&c, "21 placed VMs", |vs| {
        vs.len() == 21 && vs.iter().all(|v| v.spec.node_name.is_some())
    })
    .await;
    let subnet: Ipv4Cidr = "10.0.0.0/24".parse().unwrap();
    let group: Ipv4Cidr = "10.0.0.0/29".parse().unwrap();
    let mut seen = BTreeSet::new();
    let mut before = BTreeMap::new();
    for v in &items {
        let ip = ip_of(v).unwrap();
        assert!(seen.insert(ip), "{ip} given twice");
        assert!(subnet.contains(ip));
        assert!(![0, 1, 255].contains(&ip.octets()[3]), "{ip} is reserved");
        if v.name_any() == "db-0" {
            assert!(group.contains(ip), "group VM got {ip} outside {group}");
        } else {
            assert!(
                !group.contains(ip),
                "ungrouped VM got {ip} inside the group"
            );
        }
        before.insert(v.name_any(), ip);
    }
    // The table is persisted, Go-shaped too, and the VTEP table follows the placements.
    let st = common::wait_for("the VTEP table", Duration::from_secs(15), || async {
        let st = net_status(&c, "net").await;
        (st.vtep_table.len() == 21).then_some(st)
    })
    .await;
    assert_eq!(st.allocations.len(), 21);
    assert_eq!(
        st.allocated_ips,
        st.allocations.keys().cloned().collect::<Vec<_>>()
    );
    assert!(st.vtep_table.iter().all(|e| e.node_ip == "192.0.2.10"));
    assert_eq!(st.group_cidrs[0].cidr, "10.0.0.0/29");
    assert_eq!(cond_of(&st).unwrap().0, "True");

    // kill -9 and another replica takes over: nothing changes, the next VM gets a fresh one.
    first.start_kill().unwrap();
    let _ = first.wait().await;
    let _second = operator(&kube, "second");
    vm(&c, "after", "net", None).await;
    let items = watch_vms(&c, "the VM created after the failover placed", |vs| {
        vs.iter()
            .any(|v| v.name_any() == "after" && v.spec.node_name.is_some())
    })
    .await;
    let mut after_ip = None;
    for v in &items {
        match before.get(&v.name_any()) {
            Some(ip) => assert_eq!(ip_of(v), Some(*ip), "{} changed address", v.name_any()),
            None => after_ip = ip_of(v),
        }
    }
    let after_ip = after_ip.unwrap();
    assert!(!seen.contains(&after_ip), "{after_ip} given twice");

    // Deleting a VM releases its address once the agent has cleaned up.
    let api: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    api.delete("vm-00", &DeleteParams::default()).await.unwrap();
    api.patch(
        "vm-00",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"nodeName": null}})),
    )
    .await
    .unwrap();
    let gone = before["vm-00"].to_string();
    common::wait_for(
        "the address of vm-00 released",
        Duration::from_secs(15),
        || async {
            let st = net_status(&c, "net").await;
            (!st.allocations.contains_key(&gone) && !st.allocated_ips.contains(&gone)).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_network_leaves_the_vm_unplaced_and_an_overlapping_network_is_not_ready() {
    let Some((kube, c)) = env().await else {
        return;
    };
    cluster(&c).await;
    network(&c, "tiny", json!({"subnet": "10.1.0.0/29"})).await;
    let _op = operator(&kube, "only");
    for i in 0..5 {
        vm(&c, &format!("t{i}"), "tiny", None).await;
    }
    watch_vms(&c, "5 VMs placed on tiny", |vs| {
        vs.iter().filter(|v| v.spec.node_name.is_some()).count() == 5
    })
    .await;
    vm(&c, "t5", "tiny", None).await;
    let items = watch_vms(&c, "t5 refused for lack of addresses", |vs| {
        vs.iter().any(|v| {
            v.name_any() == "t5"
                && vm_cond(v, "Scheduled").is_some_and(|c| c.1 == "NetworkSetupFailed")
        })
    })
    .await;
    let t5 = items.iter().find(|v| v.name_any() == "t5").unwrap();
    let (status, _, message) = vm_cond(t5, "Scheduled").unwrap();
    assert_eq!(status, "False");
    assert_eq!(
        message,
        "network default/tiny 10.1.0.0/29 has no free address (5 usable)"
    );
    assert!(ip_of(t5).is_none() && t5.spec.node_name.is_none());

    // A later network overlapping tiny is not Ready, naming both; tiny stays Ready.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    network(&c, "late", json!({"subnet": "10.1.0.0/24"})).await;
    let st = common::wait_for("late judged", Duration::from_secs(15), || async {
        let st = net_status(&c, "late").await;
        cond_of(&st).filter(|c| c.0 == "False")
    })
    .await;
    assert_eq!(st.1, "SubnetOverlap");
    assert!(
        st.2.contains("default/late") && st.2.contains("default/tiny"),
        "{}",
        st.2
    );
    assert_eq!(cond_of(&net_status(&c, "tiny").await).unwrap().0, "True");
    // A VM on it gets no address and says why.
    vm(&c, "on-late", "late", None).await;
    let items = watch_vms(&c, "on-late refused", |vs| {
        vs.iter().any(|v| {
            v.name_any() == "on-late"
                && vm_cond(v, "Scheduled").is_some_and(|c| c.2.contains("SubnetOverlap"))
        })
    })
    .await;
    assert!(
        items
            .iter()
            .all(|v| v.name_any() != "on-late" || ip_of(v).is_none())
    );
}

/// The cluster's `defaultHttpCheck` is booked into a VM on a network that has no check of its
/// own (its node's agent then runs it: network_e2e); a VM's own check, even a disabled one,
/// wins, and a VM on no network gets none (there is no address to check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clusters_default_http_check_is_booked_into_networked_vms_without_one() {
    let Some((kube, c)) = env().await else {
        return;
    };
    cluster(&c).await;
    let configs: Api<imp_api::cluster::ClusterImpConfig> = Api::all(c.clone());
    let config = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ClusterImpConfig",
        "metadata": {"name": "cluster"},
        "spec": {"defaultHttpCheck": {"enabled": true, "port": 8080, "intervalSeconds": 5}}
    }))
    .unwrap();
    configs
        .create(&PostParams::default(), &config)
        .await
        .unwrap();
    network(&c, "net", json!({"subnet": "10.77.0.0/24"})).await;
    let _op = operator(&kube, "op-1");
    vm(&c, "checked", "net", None).await;
    let mut own = json!({"classRef": {"name": "small"}, "image": "busybox",
                         "networkRef": {"name": "net"},
                         "probes": {"httpCheck": {"enabled": false}}});
    create::<ImpVM>(
        &c,
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
               "metadata": {"name": "opted-out", "namespace": NS}, "spec": own.take()}),
    )
    .await;
    create::<ImpVM>(
        &c,
        json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
               "metadata": {"name": "offline", "namespace": NS},
               "spec": {"classRef": {"name": "small"}, "image": "busybox"}}),
    )
    .await;
    let api: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let vms = common::wait_for("all three booked", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let items = api.list(&ListParams::default()).await.unwrap().items;
            let booked = |v: &ImpVM| v.status.as_ref().is_some_and(|s| s.booking.is_some());
            (items.len() == 3 && items.iter().all(booked)).then_some(items)
        }
    })
    .await;
    let check_of = |name: &str| {
        let v = vms.iter().find(|v| v.name_any() == name).unwrap();
        let booked = &v.status.as_ref().unwrap().booking.as_ref().unwrap().spec;
        booked
            .inherited
            .probes
            .as_ref()
            .and_then(|p| p.http_check.clone())
    };
    let default = check_of("checked").expect("the default is booked");
    assert!(default.enabled);
    assert_eq!(
        (
            default.port,
            default.interval_seconds,
            default.path.as_str()
        ),
        (Some(8080), 5, "/healthz")
    );
    assert!(
        !check_of("opted-out").unwrap().enabled,
        "the VM's own check wins"
    );
    assert_eq!(check_of("offline"), None, "no network, no address to check");
}
