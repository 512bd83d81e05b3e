//! Nodes without a kubelet: the tests play the kubelet (status, capacity) and the node
//! lifecycle controller (the `not-ready` taint). A real API server's `TaintNodesByCondition`
//! admission gives every new Node the `node.kubernetes.io/not-ready:NoSchedule` taint, which
//! the node lifecycle controller removes once the Node reports Ready; that controller is not
//! run here (with no kubelet heartbeats it would mark every Node unreachable), so
//! [`set_ready`] does its part.

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::controlplane::Error;

/// The taint a Node carries while it is not Ready.
pub const NOT_READY: &str = "node.kubernetes.io/not-ready";

/// How many Pods a Node reports room for: the kubelet's default `--max-pods`.
const MAX_PODS: &str = "110";

fn kerr(what: String) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Kube { what, source }
}

/// Reports Node `name` with `cpu` and `memory` allocatable (and room for 110 Pods, the
/// kubelet's default, which kube-scheduler checks too) and Ready `ready`, and sets the
/// `not-ready` NoSchedule taint as the node lifecycle controller would (removed when Ready).
pub async fn set_ready(
    client: &kube::Client,
    name: &str,
    cpu: &str,
    memory: &str,
    ready: bool,
) -> Result<(), Error> {
    let api: Api<Node> = Api::all(client.clone());
    let status = json!({"status": {
        "allocatable": {"cpu": cpu, "memory": memory, "pods": MAX_PODS},
        "capacity": {"cpu": cpu, "memory": memory, "pods": MAX_PODS},
        "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"},
                        "reason": "Test",
                        "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}]
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(kerr(format!("reporting Node {name} Ready={ready}")))?;
    let node = api
        .get(name)
        .await
        .map_err(kerr(format!("reading Node {name}")))?;
    let taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
    let wanted = with_not_ready(&taints, !ready);
    if wanted != taints {
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"taints": wanted}})),
        )
        .await
        .map_err(kerr(format!("setting the not-ready taint of Node {name}")))?;
    }
    Ok(())
}

/// `taints` with the `not-ready` NoSchedule taint present or absent.
pub fn with_not_ready(taints: &[Taint], present: bool) -> Vec<Taint> {
    let mut out: Vec<Taint> = taints
        .iter()
        .filter(|t| !(t.key == NOT_READY && t.effect == "NoSchedule"))
        .cloned()
        .collect();
    if present {
        out.push(Taint {
            key: NOT_READY.into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_not_ready_taint_goes_when_ready_and_other_taints_stay() {
        let mine = Taint {
            key: "dedicated".into(),
            effect: "NoSchedule".into(),
            value: Some("vms".into()),
            ..Default::default()
        };
        let tainted = with_not_ready(std::slice::from_ref(&mine), true);
        assert_eq!(tainted.len(), 2);
        assert_eq!(with_not_ready(&tainted, false), vec![mine.clone()]);
        assert_eq!(with_not_ready(&tainted, true), tainted);
    }
}
