//! End-to-end: VMs and Pods share nodes and quotas, against a real kube-apiserver,
//! kube-controller-manager (its ResourceQuota controller) and kube-scheduler, with the real
//! `imp operator` running under the RBAC the chart ships.
//!
//! Both directions of issue 27's "capacity that Pods respect": the operator subtracts what the
//! Pods bound to a node request before it places a VM there, and kube-scheduler sees each VM's
//! reservation Pod and places no Pod onto the VM's share. ResourceQuota counts VMs: their
//! number at admission (`count/impvms.imp.dev`), their vCPU and memory through the reservation
//! Pod, refused before the VM gets a node, with the quota's own message. The nodes have no
//! kubelet (the tests play it), so a Pod's binding is what is observed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use imp_api::vm::ImpVM;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const NS: &str = "tenant";
const NODE: &str = "n1";

fn pod(name: &str, node: Option<&str>, memory: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": "100m", "memory": memory}}}]
        }
    }))
    .unwrap()
}

async fn create_vm(c: &Client, name: &str, class: &str) -> Result<ImpVM, kube::Error> {
    let obj: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"classRef": {"name": class}, "image": "example.test/app:1"}
    }))
    .unwrap();
    Api::<ImpVM>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &obj)
        .await
}

/// The Node annotation of an agent reporting `free` bytes in its state directory.
fn disk(free: u64) -> Value {
    json!({"metadata": {"annotations": {
        imp_api::shared::ANNOTATION_DISK: format!("free={free},total={}", 8u64 << 30)}}})
}

/// The VM's `Scheduled` condition.
fn scheduled_cond(v: &ImpVM) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    v.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Scheduled")
}

fn scheduled(v: &ImpVM) -> Option<&str> {
    scheduled_cond(v).map(|c| c.message.as_str())
}

fn scheduled_reason(v: &ImpVM) -> Option<&str> {
    scheduled_cond(v).map(|c| c.reason.as_str())
}

/// Waits for Pod `name` to satisfy `pred` (`None` while it does not exist).
async fn wait_pod(
    pods: &Api<Pod>,
    name: &str,
    what: &str,
    pred: impl Fn(Option<&Pod>) -> bool,
) -> Option<Pod> {
    common::wait_for(what, Duration::from_secs(30), || async {
        let p = pods.get_opt(name).await.unwrap();
        pred(p.as_ref()).then_some(p)
    })
    .await
}

fn requests(p: &Pod) -> Value {
    serde_json::to_value(&p.spec.as_ref().unwrap().containers[0].resources).unwrap()["requests"]
        .clone()
}

fn unschedulable_message(p: Option<&Pod>) -> Option<String> {
    p?.status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.message.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_and_vms_share_a_node_and_a_namespaces_quota() {
    if common::control_plane_ready().is_none() {
        return;
    }
    let _run = common::test_run("capacity_e2e", Duration::from_secs(240));
    let opts = imp_testenv::Options {
        scheduler: true,
        ..Default::default()
    };
    let kube = common::cluster_with(opts, &[NS, "imp-system"]).await;
    let c = kube.client.clone();
    kube.cp
        .default_service_account(&c, NS)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // One node of 4 CPU and 4096 MiB: imp's share is 0.9 of it (3686 MiB).
    common::ready_node(&c, NODE).await;
    imp_testenv::nodes::set_ready(&c, NODE, "4", "4Gi", true)
        .await
        .unwrap();
    // Its agent reported 2 GiB free in its state directory (before the operator starts, so its
    // first list holds it).
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.clone());
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(&disk(2 << 30)))
        .await
        .unwrap();
    for (name, mem, disk) in [("small", 1024, 1), ("big", 2048, 1), ("wide", 256, 3)] {
        common::create_imp(
            &c,
            "ImpVMClass",
            "impvmclasses",
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass",
                   "metadata": {"name": name},
                   "spec": {"vcpu": 1, "memoryMiB": mem, "diskGiB": disk}}),
        )
        .await;
    }
    let pods: Api<Pod> = Api::namespaced(c.clone(), NS);
    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);

    // 1. Pods count against VMs: a Pod bound to the node requests 2500Mi, leaving 1596 MiB,
    //    though imp's share alone would have room for the 2048 MiB VM. (Made before the
    //    operator starts, so that its first list holds it.)
    pods.create(&PostParams::default(), &pod("db", Some(NODE), "2500Mi"))
        .await
        .unwrap();
    let _operator = common::start_operator(&kube);
    create_vm(&c, "big", "big").await.unwrap();
    let v = common::wait_vm(&vms, "big", "refused for the Pod's requests", 30, |v| {
        scheduled(v).is_some_and(|m| m.contains("Pods request"))
    })
    .await;
    let msg = scheduled(&v).unwrap();
    assert!(
        msg.contains("1596MiB free of 2048MiB needed") && msg.contains("2500MiB"),
        "{msg}"
    );
    // The Pod goes: the VM is placed (on the Pod's deletion, not a timer of minutes).
    pods.delete("db", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    common::wait_vm(&vms, "big", "placed once the Pod is gone", 30, |v| {
        v.spec.node_name.as_deref() == Some(NODE)
    })
    .await;

    // 2. VMs count against Pods: the VM's reservation Pod holds its share on the node.
    let r = wait_pod(&pods, "imp-vm-big", "the reservation Pod of big", |p| {
        p.is_some()
    })
    .await
    .unwrap();
    assert_eq!(r.spec.as_ref().unwrap().node_name.as_deref(), Some(NODE));
    assert_eq!(requests(&r), json!({"cpu": "1", "memory": "2Gi"}), "{r:?}");
    let owner = &r.owner_references()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("ImpVM", "big"));
    // kube-scheduler: 4096 − 2048 leaves room for a 1Gi Pod, then none for a 2500Mi one. The
    //    scheduler sees Pods in the order they were written: once it has bound the 1Gi Pod,
    //    it has seen the reservation made before it.
    pods.create(&PostParams::default(), &pod("cache", None, "1Gi"))
        .await
        .unwrap();
    wait_pod(&pods, "cache", "cache bound to the node", |p| {
        p.and_then(|p| p.spec.as_ref()?.node_name.as_deref()) == Some(NODE)
    })
    .await;
    pods.create(&PostParams::default(), &pod("web", None, "2500Mi"))
        .await
        .unwrap();
    let web = wait_pod(&pods, "web", "web unschedulable", |p| {
        unschedulable_message(p).is_some()
    })
    .await;
    let why = unschedulable_message(web.as_ref()).unwrap();
    assert!(why.contains("Insufficient memory"), "{why}");
    pods.delete("web", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();

    // 3. Quotas: VMs are counted at admission, and their memory through their reservations.
    //    Used now: big's 2Gi and cache's 1Gi, the whole 3Gi.
    let quotas: Api<ResourceQuota> = Api::namespaced(c.clone(), NS);
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "tenant-compute"},
        "spec": {"hard": {"requests.memory": "3Gi", "count/impvms.imp.dev": "2"}}
    }))
    .unwrap();
    quotas.create(&PostParams::default(), &quota).await.unwrap();
    common::wait_for(
        "the quota controller to count the namespace",
        Duration::from_secs(30),
        || async {
            let q = quotas.get("tenant-compute").await.unwrap();
            let used = q.status?.used?;
            (used.get("requests.memory")?.0 == "3Gi" && used.get("count/impvms.imp.dev")?.0 == "1")
                .then_some(())
        },
    )
    .await;
    create_vm(&c, "extra", "small").await.unwrap();
    let v = common::wait_vm(&vms, "extra", "held back by the quota", 30, |v| {
        scheduled_reason(v) == Some("QuotaExceeded")
    })
    .await;
    let msg = scheduled(&v).unwrap();
    assert!(
        msg.contains("exceeded quota: tenant-compute") && msg.contains("requests.memory"),
        "{msg}"
    );
    assert!(v.spec.node_name.is_none(), "a VM over quota gets no node");
    assert!(pods.get_opt("imp-vm-extra").await.unwrap().is_none());
    // The third VM is refused at admission, by the quota's name.
    let err = create_vm(&c, "third", "small").await.unwrap_err();
    let kube::Error::Api(s) = err else {
        panic!("{err}")
    };
    assert!(
        s.code == 403 && s.message.contains("exceeded quota: tenant-compute"),
        "{s:?}"
    );
    // More quota: the VM is placed and reserved.
    let more = json!({"spec": {"hard": {"requests.memory": "8Gi", "count/impvms.imp.dev": "3"}}});
    quotas
        .patch(
            "tenant-compute",
            &PatchParams::default(),
            &Patch::Merge(&more),
        )
        .await
        .unwrap();
    common::wait_vm(&vms, "extra", "placed under the raised quota", 30, |v| {
        v.spec.node_name.as_deref() == Some(NODE)
    })
    .await;
    wait_pod(&pods, "imp-vm-extra", "the reservation of extra", |p| {
        p.is_some()
    })
    .await;

    // 4. A suspended VM's memory is free (the overcommit default): its reservation goes, and
    //    comes back when it runs again. A deleted VM's reservation goes.
    for (phase, there) in [("Suspended", false), ("Running", true)] {
        let status = json!({"status": {"phase": phase}});
        vms.patch_status("extra", &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
        let what = format!("extra's reservation there={there} once {phase}");
        wait_pod(&pods, "imp-vm-extra", &what, |p| p.is_some() == there).await;
    }
    vms.delete("big", &DeleteParams::default()).await.unwrap();
    // Play the agent's cleanup: it clears spec.nodeName once the VM is stopped.
    let cleared = json!({"spec": {"nodeName": null}});
    vms.patch("big", &PatchParams::default(), &Patch::Merge(&cleared))
        .await
        .unwrap();
    wait_pod(&pods, "imp-vm-big", "big's reservation gone", |p| {
        p.is_none()
    })
    .await;
    assert!(pods.get_opt("imp-vm-extra").await.unwrap().is_some());

    // 5. Disk: with 2 GiB free in the node's state directory, a VM with a 3 GiB disk is not
    //    placed there, and is once the agent reports more.
    create_vm(&c, "disky", "wide").await.unwrap();
    let v = common::wait_vm(&vms, "disky", "refused for disk", 30, |v| {
        scheduled(v).is_some_and(|m| m.contains("disk free"))
    })
    .await;
    let msg = scheduled(&v).unwrap();
    assert!(msg.contains("2.0GiB disk free of 3.0GiB needed"), "{msg}");
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(&disk(4 << 30)))
        .await
        .unwrap();
    common::wait_vm(&vms, "disky", "placed once the disk has room", 30, |v| {
        v.spec.node_name.as_deref() == Some(NODE)
    })
    .await;
}
