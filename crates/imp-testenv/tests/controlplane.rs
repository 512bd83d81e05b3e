//! The test control plane is the real thing: TLS with its own CA, certificate and
//! ServiceAccount-token users, RBAC that refuses, TokenReview, kubectl with a bearer token (which
//! the old test server could not serve), the controller-manager's namespace deletion, garbage
//! collection and ResourceQuota accounting (so quota admission refuses), and kube-scheduler
//! counting the Pods bound to a Node by `spec.nodeName` (imp's reservation Pods).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use imp_testenv::controlplane::available_for;
use imp_testenv::{ControlPlane, Options};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, ResourceQuota};
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

/// A Pod requesting `memory` (and a little CPU), bound to `node` when given: never run, as
/// there is no kubelet, so only its binding is observable.
fn pod(name: &str, memory: &str, node: Option<&str>) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "containers": [{"name": "vm", "image": "registry.invalid/vm",
                            "resources": {"requests": {"cpu": "100m", "memory": memory}}}],
        },
    }))
    .unwrap()
}

/// The `PodScheduled` condition of `pod`, if the scheduler has set one.
fn scheduled_condition(pod: &Pod) -> Option<k8s_openapi::api::core::v1::PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")
        .cloned()
}

#[tokio::test]
async fn the_scheduler_counts_pods_bound_by_node_name_and_leaves_what_does_not_fit_pending() {
    let opts = Options {
        scheduler: true,
        ..Options::default()
    };
    if !available_for(&opts) {
        return;
    }
    let cp = ControlPlane::start(opts).await.unwrap();
    let c = cp.admin().await.unwrap();
    let nodes: Api<Node> = Api::all(c.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "vm-host"}})).unwrap(),
        )
        .await
        .unwrap();
    imp_testenv::nodes::set_ready(&c, "vm-host", "4", "4Gi", true)
        .await
        .unwrap();
    let ns = cp.namespace(&c, "sched").await.unwrap();
    cp.default_service_account(&c, &ns).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    let pp = PostParams::default();
    // A VM's reservation Pod: bound by the operator, never seen by the scheduler's queue.
    pods.create(&pp, &pod("reservation", "3Gi", Some("vm-host")))
        .await
        .unwrap();
    // 512Mi fits beside it (3.5Gi of 4Gi).
    pods.create(&pp, &pod("small", "512Mi", None))
        .await
        .unwrap();
    wait_until("the scheduler binds the 512Mi Pod to vm-host", || {
        let pods = pods.clone();
        async move {
            let p = pods.get("small").await.unwrap();
            p.spec.unwrap().node_name.as_deref() == Some("vm-host")
        }
    })
    .await;
    // 2Gi would fit on the empty Node, but not beside the reservation.
    pods.create(&pp, &pod("large", "2Gi", None)).await.unwrap();
    wait_until("the scheduler marks the 2Gi Pod unschedulable", || {
        let pods = pods.clone();
        async move {
            let p = pods.get("large").await.unwrap();
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            assert_eq!(
                node, None,
                "the 2Gi Pod was bound beside the 3Gi reservation"
            );
            scheduled_condition(&p).is_some_and(|c| c.status == "False")
        }
    })
    .await;
    let large = pods.get("large").await.unwrap();
    assert_eq!(large.spec.as_ref().unwrap().node_name, None);
    assert_eq!(
        large.status.as_ref().unwrap().phase.as_deref(),
        Some("Pending")
    );
    let cond = scheduled_condition(&large).unwrap();
    assert_eq!(cond.reason.as_deref(), Some("Unschedulable"), "{cond:?}");
    let msg = cond.message.unwrap_or_default();
    assert!(msg.contains("Insufficient memory"), "{msg}");
}

#[tokio::test]
async fn a_pod_over_the_namespace_memory_quota_is_refused_at_admission() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let c = cp.admin().await.unwrap();
    let ns = cp.namespace(&c, "quota").await.unwrap();
    cp.default_service_account(&c, &ns).await.unwrap();
    let quotas: Api<ResourceQuota> = Api::namespaced(c.clone(), &ns);
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "vm-memory"},
                "spec": {"hard": {"requests.memory": "1Gi"}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // The ResourceQuota controller computes status.hard; until then admission cannot decide.
    wait_until("the quota controller sets status.hard", || {
        let quotas = quotas.clone();
        async move {
            let q = quotas.get("vm-memory").await.unwrap();
            q.status
                .and_then(|s| s.hard)
                .and_then(|h| h.get("requests.memory").map(|v| v.0 == "1Gi"))
                .unwrap_or(false)
        }
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    match pods
        .create(&PostParams::default(), &pod("big", "2Gi", None))
        .await
    {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{s:?}");
            assert!(
                s.message.contains("exceeded quota") && s.message.contains("vm-memory"),
                "{}",
                s.message
            );
        }
        other => panic!("a Pod over the quota was admitted: {other:?}"),
    }
    // Within the quota: admitted and counted in status.used.
    pods.create(&PostParams::default(), &pod("fits", "512Mi", None))
        .await
        .unwrap();
    wait_until("the quota counts the admitted Pod", || {
        let quotas = quotas.clone();
        async move {
            let q = quotas.get("vm-memory").await.unwrap();
            q.status
                .and_then(|s| s.used)
                .and_then(|u| u.get("requests.memory").map(|v| v.0 == "512Mi"))
                .unwrap_or(false)
        }
    })
    .await;
}

/// The user's extra values under `key`, as the API server reports them to the user itself.
async fn extra_of(cp: &ControlPlane, kubeconfig: &std::path::Path, key: &str) -> Vec<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let me = cp.client_from(kubeconfig).await.unwrap();
    let review: SelfSubjectReview = me
        .request(
            http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
                .header("content-type", "application/json")
                .body(
                    serde_json::to_vec(&json!({"apiVersion": "authentication.k8s.io/v1",
                                               "kind": "SelfSubjectReview"}))
                    .unwrap(),
                )
                .unwrap(),
        )
        .await
        .unwrap();
    let user = review.status.and_then(|s| s.user_info).unwrap();
    user.extra
        .unwrap_or_default()
        .get(key)
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn an_agent_token_bound_to_its_pod_names_the_pods_node_even_before_the_node_exists() {
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let admin = cp.admin().await.unwrap();
    let ns = cp.namespace(&admin, "bound").await.unwrap();
    imp_testenv::rbac::install(cp, &ns).await.unwrap();
    let node = format!("{ns}-n1");
    // No Node object: the token still carries the name (not its uid).
    let kc = imp_testenv::rbac::agent_kubeconfig_for(cp, &ns, &node)
        .await
        .unwrap();
    let name = "authentication.kubernetes.io/node-name";
    let uid = "authentication.kubernetes.io/node-uid";
    assert_eq!(extra_of(cp, &kc, name).await, std::slice::from_ref(&node));
    assert!(extra_of(cp, &kc, uid).await.is_empty());
    // With the Node, a new token (the Pod is reused) carries its uid too.
    let n: Node = serde_json::from_value(json!({"metadata": {"name": node}})).unwrap();
    let n = Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &n)
        .await
        .unwrap();
    let kc = imp_testenv::rbac::agent_kubeconfig_for(cp, &ns, &node)
        .await
        .unwrap();
    assert_eq!(extra_of(cp, &kc, name).await, std::slice::from_ref(&node));
    assert_eq!(extra_of(cp, &kc, uid).await, [n.metadata.uid.unwrap()]);
    // An unbound token of the same ServiceAccount names no node.
    let unbound = cp
        .service_account_kubeconfig(&ns, "imp-agent")
        .await
        .unwrap();
    assert!(extra_of(cp, &unbound, name).await.is_empty());
    // The token dies with its Pod.
    let pods: Api<Pod> = Api::namespaced(admin, &ns);
    let pod = imp_testenv::rbac::agent_pod_name(&node);
    // At once: no kubelet confirms a graceful deletion here.
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete(&pod, &now).await.unwrap();
    let me = cp.client_from(&kc).await.unwrap();
    wait_until("the bound token is refused once its Pod is gone", || {
        let me = me.clone();
        async move {
            Api::<Node>::all(me)
                .list(&ListParams::default())
                .await
                .is_err_and(|e| matches!(e, kube::Error::Api(s) if s.code == 401))
        }
    })
    .await;
}

/// A namespace of the test's own for [`the_tripwire_counts_a_packet_to_the_guarded_range_that_would_leave`],
/// removed when dropped.
struct TestNetns(String);

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

fn sh_in(netns: &str, script: &str) -> std::process::Output {
    std::process::Command::new("ip")
        .args(["netns", "exec", netns, "bash", "-c", script])
        .output()
        .unwrap()
}

fn needs_root_and_nft() -> bool {
    imp_testenv::guard::require(
        imp_testenv::guard::is_root() && imp_testenv::guard::which("nft").is_some(),
        "root and nft (apt-get install nftables) for the egress guard",
    )
}

/// The tripwire is not a check that cannot fail: in a namespace of the test's own where the
/// guarded range is routed out through an interface, a packet to it is counted (and dropped);
/// once the blackhole route is in place, the next one never gets that far.
#[test]
fn the_tripwire_counts_a_packet_to_the_guarded_range_that_would_leave() {
    use imp_testenv::egress;
    if !needs_root_and_nft() {
        return;
    }
    let ns = TestNetns(format!("imp-egress-{}", std::process::id()));
    let ok = |o: std::process::Output| assert!(o.status.success(), "{o:?}");
    ok(std::process::Command::new("ip")
        .args(["netns", "add", &ns.0])
        .output()
        .unwrap());
    ok(sh_in(
        &ns.0,
        &format!(
            "ip link set lo up && ip link add d0 type veth peer name d1 \
             && ip link set d0 up && ip link set d1 up \
             && ip addr add 192.0.2.1/24 dev d0 && ip route add {} dev d0",
            egress::GUARDED
        ),
    ));
    egress::tripwire(Some(&ns.0)).unwrap();
    assert_eq!(egress::leaked(Some(&ns.0)).unwrap(), 0);
    // Loading it again (a second control plane, another test process) keeps the count.
    let send = || sh_in(&ns.0, "echo x > /dev/udp/198.18.7.7/9");
    // The tripwire's drop of a local packet reaches the sender as EPERM.
    let dropped = send();
    let why = String::from_utf8_lossy(&dropped.stderr).into_owned();
    assert!(why.contains("Operation not permitted"), "{dropped:?}");
    assert_eq!(egress::leaked(Some(&ns.0)).unwrap(), 1, "counted");
    // Loading it again (a second control plane, another test process) keeps the count.
    egress::tripwire(Some(&ns.0)).unwrap();
    assert_eq!(egress::leaked(Some(&ns.0)).unwrap(), 1, "kept on reload");
    // With the route, the dial fails in the kernel (EINVAL) and nothing reaches the tripwire.
    egress::blackhole(Some(&ns.0)).unwrap();
    let refused = send();
    let why = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(why.contains("Invalid argument"), "{refused:?}");
    assert_eq!(egress::leaked(Some(&ns.0)).unwrap(), 1);
}

/// kube-apiserver dials a webhook's Service at its ClusterIP (no kube-proxy, no aggregator
/// routing here): the ClusterIP comes from the guarded range, the dial fails on this machine,
/// and the host's tripwire counts nothing that left.
#[tokio::test]
async fn a_webhook_service_the_apiserver_dials_is_kept_on_this_machine() {
    use imp_testenv::egress;
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use k8s_openapi::api::core::v1::Service;
    if !needs_root_and_nft() {
        return;
    }
    let Some(cp) = ControlPlane::shared() else {
        return;
    };
    let before = egress::leaked(None).unwrap();
    let admin = cp.admin().await.unwrap();
    let ns = cp.namespace(&admin, "egress").await.unwrap();
    let services: Api<Service> = Api::namespaced(admin.clone(), &ns);
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "hook"},
        "spec": {"ports": [{"port": 443, "targetPort": 8443}]}
    }))
    .unwrap();
    let svc = services.create(&PostParams::default(), &svc).await.unwrap();
    let ip = svc.spec.unwrap().cluster_ip.unwrap();
    assert!(
        ip.starts_with("198.18.0."),
        "ClusterIP {ip} outside {}",
        egress::SERVICE_RANGE
    );
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    let name = format!("imp-egress-{ns}");
    let hook: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "egress.imp.dev",
            "clientConfig": {"service": {"namespace": ns, "name": "hook", "port": 443}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["configmaps"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5
        }]
    }))
    .unwrap();
    hooks.create(&PostParams::default(), &hook).await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), &ns);
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "c"}})).unwrap();
    // The configuration reaches the server's webhook cache a moment after it is stored: until
    // the create is refused for the dial, it is admitted without the call.
    let t0 = std::time::Instant::now();
    let refusal = loop {
        match cms.create(&PostParams::default(), &cm).await {
            Err(e) => break e.to_string(),
            Ok(_) => cms
                .delete("c", &DeleteParams::default())
                .await
                .map(drop)
                .unwrap(),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the API server never called the webhook"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    hooks.delete(&name, &DeleteParams::default()).await.unwrap();
    assert!(
        refusal.contains("failed calling webhook") && refusal.contains(&ip),
        "the refusal names the dial to {ip}: {refusal}"
    );
    assert_eq!(
        egress::leaked(None).unwrap(),
        before,
        "a packet to {} reached the host's postrouting: {refusal}",
        egress::GUARDED
    );
}
