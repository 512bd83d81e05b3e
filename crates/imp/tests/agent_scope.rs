//! An agent writes only what belongs to its own node, and the API server is what says so: with
//! the chart's RBAC and its ValidatingAdmissionPolicy (`charts/imp/files/policy/agent.yaml`),
//! the agent of node-a (a token bound to its stand-in Pod on node-a, as the DaemonSet's Pod has)
//! may patch node-a's annotations, the status of a VM placed on node-a, profile node-a, Lease
//! `imp-agent-node-a` (held by node-a, never naming another holder), and claim an unclaimed
//! snapshot execution for node-a; the same writes for node-b are refused with 403 and a
//! message naming the write and the node, and a token of the same ServiceAccount bound to no
//! Pod may write nothing.
//!
//! The operator's token, likewise held by its policy (`charts/imp/files/policy/operator.yaml`),
//! creates only reservation Pods (the operator's own builder's Pod is admitted; one without the
//! label, of another image, with a hostPath, in the host's network, privileged, with a token or
//! unbound is refused naming why) and deletes only labelled ones.
//!
//! Objects only, on one real control plane: no agent or operator process, no guest.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::{Duration, Instant};

use imp_operator::placement::reservation::{PodSettings, Reservation};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

const A: &str = "node-a";
const B: &str = "node-b";
const NS: &str = "default";
const INSTALL: &str = "imp-system";

/// The imp.dev objects of `kind` (`plural`), in `ns` or cluster-wide.
fn imp(c: &kube::Client, kind: &str, plural: &str, ns: Option<&str>) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("imp.dev", "v1alpha1", kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
    match ns {
        Some(ns) => Api::namespaced_with(c.clone(), ns, &ar),
        None => Api::all_with(c.clone(), &ar),
    }
}

fn vms(c: &kube::Client) -> Api<DynamicObject> {
    imp(c, "ImpVM", "impvms", Some(NS))
}

fn profiles(c: &kube::Client) -> Api<DynamicObject> {
    imp(c, "ClusterImpNodeProfile", "clusterimpnodeprofiles", None)
}

fn snapshots(c: &kube::Client) -> Api<DynamicObject> {
    imp(c, "ImpVMSnapshot", "impvmsnapshots", Some(NS))
}

fn leases(c: &kube::Client) -> Api<Lease> {
    Api::namespaced(c.clone(), INSTALL)
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

/// Creates `body` through `api` as the admin.
async fn create(api: &Api<DynamicObject>, body: Value) {
    let obj: DynamicObject = serde_json::from_value(body).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
}

/// The admin's objects: for each node a profile, a VM placed there (`vm-<node>`) and a
/// snapshot execution of it, unclaimed for node-a and claimed by node-b for node-b.
async fn objects(admin: &kube::Client) {
    for n in [A, B] {
        common::ready_node(admin, n).await;
        create(
            &profiles(admin),
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ClusterImpNodeProfile",
                   "metadata": {"name": n}, "spec": {}}),
        )
        .await;
        create(
            &vms(admin),
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                   "metadata": {"name": format!("vm-{n}")},
                   "spec": {"classRef": {"name": "small"}, "image": "busybox", "nodeName": n}}),
        )
        .await;
        let claim = if n == B {
            json!({"imp.dev/snapshot-node": B})
        } else {
            json!({})
        };
        create(
            &snapshots(admin),
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
                   "metadata": {"name": format!("snap-{n}"), "annotations": claim},
                   "spec": {"sourceVMName": format!("vm-{n}"), "sourceVMNamespace": NS,
                            "storage": {"type": "node-local"}}}),
        )
        .await;
    }
    let lease: Lease = serde_json::from_value(
        json!({"metadata": {"name": format!("imp-agent-{B}")}, "spec": {"holderIdentity": B}}),
    )
    .unwrap();
    leases(admin)
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
}

/// Asserts that `res` is the policy's refusal of node-a's agent: 403, naming node-a, the
/// refused object and `node` (the node it belongs to).
fn refused<T: std::fmt::Debug>(res: kube::Result<T>, what: &str, node: &str) {
    match res {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{what}: {s:?}");
            let whose = format!("imp-agent of node {A} may not write");
            assert!(
                s.message.contains(&whose) && s.message.contains(node),
                "{what}: the refusal does not say '{whose}' and name {node}: {}",
                s.message
            );
            eprintln!("refused, {what}: {}", s.message);
        }
        other => panic!("{what} was admitted: {other:?}"),
    }
}

/// The admin's status patch of `vm-node-a` (as the operator writes a move).
async fn admin_vms_status(admin: &kube::Client, patch: &Patch<Value>) {
    vms(admin)
        .patch_status("vm-node-a", &PatchParams::default(), patch)
        .await
        .unwrap();
}

/// Asserts that `res` was admitted.
fn admitted<T>(res: kube::Result<T>, what: &str) {
    if let Err(e) = res {
        panic!("{what} was refused: {e}");
    }
}

/// Waits until the API server enforces the policy (its informer has seen it): the unbound
/// token's patch of node-a is refused. Returns that refusal's message.
async fn enforced(unbound: &kube::Client) -> String {
    let nodes: Api<Node> = Api::all(unbound.clone());
    let t0 = Instant::now();
    loop {
        let res = nodes
            .patch(
                A,
                &PatchParams::default(),
                &merge(json!({"metadata": {"annotations": {"imp.dev/agent-endpoint": "x:1"}}})),
            )
            .await;
        match res {
            // The policy's refusal, not RBAC's (a binding not yet seen by the authorizer).
            Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("names no node") => {
                return s.message;
            }
            other => assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the policy is not enforced after 30 s: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn an_agents_node_bound_token_writes_only_what_belongs_to_its_own_node() {
    if common::control_plane_ready().is_none() {
        return;
    }
    let kube = common::cluster(&[NS, INSTALL]).await;
    let admin = kube.client.clone();
    objects(&admin).await;
    let a = kube
        .cp
        .client_from(&kube.agent_kubeconfig_for(A).await)
        .await
        .unwrap();
    let unbound = kube
        .cp
        .client_from(kube.unbound_agent_kubeconfig())
        .await
        .unwrap();
    let message = enforced(&unbound).await;
    assert!(
        message.contains("nodes node-a") && message.contains("bound ServiceAccount token"),
        "{message}"
    );
    let p = PatchParams::default();
    let annotate = |node: &str| {
        merge(json!({"metadata": {"annotations": {"imp.dev/agent-cert-sha256": node}}}))
    };
    let placed = |node: &str| merge(json!({"status": {"nodeName": node}}));
    let cpu = merge(json!({"spec": {"cpuModel": "EPYC"}}));
    let renew = merge(json!({"spec": {"holderIdentity": A}}));
    let claim = merge(json!({"metadata": {"annotations": {"imp.dev/snapshot-node": A}}}));
    let running = merge(json!({"status": {"phase": "Running"}}));
    let nodes: Api<Node> = Api::all(a.clone());
    let lease = |name: String| -> Lease {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"holderIdentity": A}}))
            .unwrap()
    };

    // Its own node's.
    admitted(
        nodes.patch(A, &p, &annotate(A)).await,
        "node-a's annotation",
    );
    // ...but only imp.dev/ annotations of it: no label, no other annotation, no taint.
    for (what, patch) in [
        (
            "a label on node-a",
            json!({"metadata": {"labels": {"node-restriction.kubernetes.io/trusted": "yes"}}}),
        ),
        (
            "another annotation on node-a",
            json!({"metadata": {"annotations": {"example.com/x": "1"}}}),
        ),
        (
            "a taint on node-a",
            json!({"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}}),
        ),
    ] {
        refused(
            nodes.patch(A, &p, &merge(patch)).await,
            what,
            "only annotations under imp.dev/",
        );
    }
    admitted(
        vms(&a).patch_status("vm-node-a", &p, &placed(A)).await,
        "node-a's VM's status",
    );
    // A move of its VM to node-b (written by the admin as the operator would): node-a's agent
    // says how its part went, and nothing else of the move.
    let mv = |phase: &str| {
        merge(json!({"status": {"move": {
            "migration": "mv", "migrationUID": "u1", "source": A, "target": B,
            "mode": "cold", "phase": phase, "token": "t1"}}}))
    };
    admin_vms_status(&admin, &mv("Transferring")).await;
    for (what, patch) in [
        (
            "redirecting node-a's VM's move to node-c",
            json!({"status": {"move": {"target": "node-c"}}}),
        ),
        (
            "changing the token of node-a's VM's move",
            json!({"status": {"move": {"token": "t2"}}}),
        ),
        (
            "marking node-a's VM's move Committed",
            json!({"status": {"move": {"phase": "Committed"}}}),
        ),
        (
            "clearing node-a's VM's move",
            json!({"status": {"move": null}}),
        ),
    ] {
        refused(
            vms(&a).patch_status("vm-node-a", &p, &merge(patch)).await,
            what,
            "status.move is the operator's",
        );
    }
    admitted(
        vms(&a)
            .patch_status(
                "vm-node-a",
                &p,
                &merge(json!({"status": {"move": {"phase": "Sent", "bytesSent": 1}}})),
            )
            .await,
        "node-a's agent saying its VM's move was sent",
    );
    // No agent starts a move.
    refused(
        vms(&a)
            .patch_status("vm-node-a", &p, &merge(json!({"status": {"move": null}})))
            .await,
        "clearing node-a's VM's sent move",
        "status.move is the operator's",
    );
    admin_vms_status(&admin, &merge(json!({"status": {"move": null}}))).await;
    refused(
        vms(&a)
            .patch_status("vm-node-a", &p, &mv("Transferring"))
            .await,
        "starting a move of node-a's VM",
        "status.move is the operator's",
    );
    admitted(profiles(&a).patch(A, &p, &cpu).await, "profile node-a");
    admitted(
        leases(&a)
            .create(&PostParams::default(), &lease(format!("imp-agent-{A}")))
            .await,
        "creating Lease imp-agent-node-a",
    );
    admitted(
        leases(&a)
            .patch(&format!("imp-agent-{A}"), &p, &renew)
            .await,
        "renewing Lease imp-agent-node-a",
    );
    // ... but held by node-a only: the operator takes a Lease's node from its holder.
    refused(
        leases(&a)
            .patch(
                &format!("imp-agent-{A}"),
                &p,
                &merge(json!({"spec": {"holderIdentity": B}})),
            )
            .await,
        "naming node-b the holder of Lease imp-agent-node-a",
        "holderIdentity node-b",
    );
    admitted(
        snapshots(&a).patch("snap-node-a", &p, &claim).await,
        "claiming node-a's unclaimed snapshot",
    );
    admitted(
        snapshots(&a)
            .patch_status("snap-node-a", &p, &running)
            .await,
        "the status of the snapshot node-a claimed",
    );

    // Another node's.
    refused(
        nodes.patch(B, &p, &annotate(A)).await,
        "node-b's annotation",
        A,
    );
    refused(
        vms(&a).patch_status("vm-node-b", &p, &placed(A)).await,
        "node-b's VM's status",
        B,
    );
    refused(
        vms(&a)
            .patch("vm-node-b", &p, &merge(json!({"spec": {"nodeName": null}})))
            .await,
        "releasing node-b's VM",
        B,
    );
    refused(
        vms(&a)
            .patch("vm-node-a", &p, &merge(json!({"spec": {"nodeName": B}})))
            .await,
        "handing node-a's VM to node-b",
        A,
    );
    refused(profiles(&a).patch(B, &p, &cpu).await, "profile node-b", A);
    refused(
        leases(&a)
            .create(&PostParams::default(), &lease(format!("imp-agent-{B}")))
            .await,
        "creating Lease imp-agent-node-b",
        A,
    );
    refused(
        leases(&a)
            .patch(&format!("imp-agent-{B}"), &p, &renew)
            .await,
        "renewing Lease imp-agent-node-b",
        A,
    );
    refused(
        snapshots(&a).patch("snap-node-b", &p, &claim).await,
        "claiming the snapshot node-b claimed",
        B,
    );
    refused(
        snapshots(&a)
            .patch_status("snap-node-b", &p, &running)
            .await,
        "the status of the snapshot node-b claimed",
        B,
    );

    // A token bound to no Pod: no write at all, not even node-a's.
    let nothing = "names no node";
    for (what, res) in [
        (
            "node-a's VM's status",
            vms(&unbound)
                .patch_status("vm-node-a", &p, &placed(A))
                .await,
        ),
        (
            "profile node-a",
            profiles(&unbound).patch(A, &p, &cpu).await,
        ),
    ] {
        match res {
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 403, "{what}: {s:?}");
                assert!(s.message.contains(nothing), "{what}: {}", s.message);
            }
            other => panic!("an unbound token wrote {what}: {other:?}"),
        }
    }
    match leases(&unbound)
        .patch(&format!("imp-agent-{A}"), &p, &renew)
        .await
    {
        Err(kube::Error::Api(s)) => assert!(s.code == 403 && s.message.contains(nothing), "{s:?}"),
        other => panic!("an unbound token renewed Lease imp-agent-node-a: {other:?}"),
    }

    // What was refused did not happen.
    let b = Api::<Node>::all(admin.clone()).get(B).await.unwrap();
    assert!(
        !b.metadata
            .annotations
            .unwrap_or_default()
            .contains_key("imp.dev/agent-cert-sha256")
    );
    let vm_a = vms(&admin).get("vm-node-a").await.unwrap();
    assert_eq!(vm_a.data["spec"]["nodeName"], A);
    // Last, the agent's release of its own VM.
    admitted(
        vms(&a)
            .patch("vm-node-a", &p, &merge(json!({"spec": {"nodeName": null}})))
            .await,
        "releasing node-a's VM",
    );

    operator_makes_only_reservation_pods(&kube, &admin).await;
}

/// A reservation Pod of vm-node-a as the operator builds it, named `name`.
fn reservation(admin_vm: &DynamicObject, name: &str) -> Pod {
    let uid = admin_vm.metadata.uid.clone().unwrap();
    let r = Reservation::of(NS, "vm-node-a", &uid, A, (1, 256), false, true).unwrap();
    let mut pod = imp_operator::placement::reservation::pod(&r, &PodSettings::default());
    pod.metadata.name = Some(name.to_owned());
    pod
}

/// Asserts that `res` is the operator policy's refusal of `what`, saying `why`.
fn refused_to_operator<T: std::fmt::Debug>(res: kube::Result<T>, what: &str, why: &str) {
    match res {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{what}: {s:?}");
            assert!(
                s.message.contains("imp-operator may not") && s.message.contains(why),
                "{what}: the refusal does not say '{why}': {}",
                s.message
            );
            eprintln!("refused, {what}: {}", s.message);
        }
        other => panic!("{what} was admitted for the operator: {other:?}"),
    }
}

/// The operator's token creates and deletes only reservation Pods.
async fn operator_makes_only_reservation_pods(kube: &common::Cluster, admin: &kube::Client) {
    let op = kube
        .cp
        .client_from(kube.operator_kubeconfig())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(op, NS);
    let as_admin: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let vm = vms(admin).get("vm-node-a").await.unwrap();
    let pp = PostParams::default();
    // Until the API server enforces the policy, an unlabelled Pod passes RBAC alone.
    let t0 = Instant::now();
    loop {
        let mut bare = reservation(&vm, "unlabelled");
        bare.metadata.labels = None;
        match pods.create(&pp, &bare).await {
            Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("imp-operator") => {
                assert!(s.message.contains("imp.dev/reservation=true"), "{s:?}");
                break;
            }
            Ok(_) => {
                as_admin
                    .delete("unlabelled", &DeleteParams::default().grace_period(0))
                    .await
                    .unwrap();
            }
            Err(e) => panic!("an unlabelled Pod: {e}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the operator's policy is not enforced after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    type Change = fn(&mut Pod);
    let cases: [(&str, &str, Change); 6] = [
        ("another image", "image registry.k8s.io/pause:3.10", |p| {
            p.spec.as_mut().unwrap().containers[0].image = Some("busybox".into());
        }),
        ("a hostPath volume", "mounts no volume", |p| {
            p.spec.as_mut().unwrap().volumes = Some(vec![
                serde_json::from_value(json!({"name": "root", "hostPath": {"path": "/"}})).unwrap(),
            ]);
        }),
        ("the host's network", "no host namespace", |p| {
            p.spec.as_mut().unwrap().host_network = Some(true);
        }),
        ("a privileged container", "not privileged", |p| {
            let sc = p.spec.as_mut().unwrap().containers[0]
                .security_context
                .as_mut()
                .unwrap();
            sc.privileged = Some(true);
            sc.allow_privilege_escalation = None;
        }),
        (
            "a ServiceAccount token",
            "automountServiceAccountToken: false",
            |p| {
                p.spec.as_mut().unwrap().automount_service_account_token = Some(true);
            },
        ),
        ("no node", "bound to its node", |p| {
            p.spec.as_mut().unwrap().node_name = None;
        }),
    ];
    for (i, (what, why, change)) in cases.into_iter().enumerate() {
        let mut pod = reservation(&vm, &format!("bad-{i}"));
        change(&mut pod);
        refused_to_operator(pods.create(&pp, &pod).await, what, why);
    }
    // The Pod the operator's own builder makes is admitted, and deleted.
    let good = reservation(&vm, "imp-vm-vm-node-a");
    admitted(pods.create(&pp, &good).await, "a reservation Pod");
    // Someone else's Pod cannot be deleted with the operator's token.
    let mut theirs = reservation(&vm, "someone-elses");
    theirs.metadata.labels = None;
    as_admin.create(&pp, &theirs).await.unwrap();
    refused_to_operator(
        pods.delete("someone-elses", &DeleteParams::default()).await,
        "deleting an unlabelled Pod",
        "imp.dev/reservation=true",
    );
    // A warm pool's claim hands a reservation Pod to another VM (its owner and
    // imp.dev/reservation-for): admitted; any other change of a Pod is not.
    let other: imp_api::vm::ImpVM = serde_json::from_value(
        serde_json::to_value(vms(admin).get("vm-node-b").await.unwrap()).unwrap(),
    )
    .unwrap();
    let pod = pods.get("imp-vm-vm-node-a").await.unwrap();
    let handed = imp_operator::placement::reservation::handed_to(&pod, &other);
    let moved = pods
        .patch(
            "imp-vm-vm-node-a",
            &PatchParams::default(),
            &Patch::Merge(&handed),
        )
        .await;
    admitted(moved, "handing the reservation Pod to another VM");
    let pod = pods.get("imp-vm-vm-node-a").await.unwrap();
    assert_eq!(
        pod.metadata.owner_references.as_ref().unwrap()[0].uid,
        other.metadata.uid.clone().unwrap()
    );
    for (what, change) in [
        (
            "a relabelled Pod",
            json!({"metadata": {"labels": {"extra": "x"}}}),
        ),
        (
            "another annotation",
            json!({"metadata": {"annotations": {"extra": "x"}}}),
        ),
        (
            "an owner that is no ImpVM",
            json!({"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                                     "name": "x", "uid": "u", "controller": true}]}}),
        ),
        ("a new image", {
            let mut containers = pod.spec.clone().unwrap().containers;
            containers[0].image = Some("busybox".into());
            json!({"spec": {"containers": containers}})
        }),
    ] {
        refused_to_operator(
            pods.patch(
                "imp-vm-vm-node-a",
                &PatchParams::default(),
                &Patch::Merge(&change),
            )
            .await,
            what,
            "only hands a reservation Pod to another ImpVM",
        );
    }
    admitted(
        pods.delete("imp-vm-vm-node-a", &DeleteParams::default().grace_period(0))
            .await,
        "deleting the reservation Pod",
    );
    assert!(as_admin.get_opt("someone-elses").await.unwrap().is_some());
}
