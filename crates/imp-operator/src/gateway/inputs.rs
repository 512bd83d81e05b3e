//! The Secrets and ConfigMaps of a node's VMs, handed to that node's agent only
//! ([`imp_api::inputs`]): the Node authorizer's rule, for VMs. The caller must be the agents'
//! ServiceAccount with a token bound to a node (the API server names the node in the user's
//! extra `authentication.kubernetes.io/node-name`); the VM must be booked on that node, or the
//! snapshot taken, held or restored there; the answer holds only what the object names, in
//! its own namespace. The operator reads them with its own right; no node may.

use http::StatusCode;
use imp_api::inputs::{self, ConfigMapData, Inputs, References};
use imp_api::snapshot::ImpVMSnapshot;
use imp_api::vm::ImpVM;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::ListParams;

use super::front_proxy::RemoteUser;
use super::{Body, json, status};

/// The node the caller's token is bound to, if the caller is an agent (`agents`: the agents'
/// ServiceAccount's user name); else the refusal.
pub fn caller_node<'a>(agents: &str, user: &'a RemoteUser) -> Result<&'a str, String> {
    if user.name != agents {
        return Err(format!(
            "inputs are served to the node agents ({agents}) only, not to {}",
            user.name
        ));
    }
    match user.extra.get(inputs::NODE_EXTRA).map(Vec::as_slice) {
        Some([node]) if !node.is_empty() => Ok(node),
        _ => Err(format!(
            "the caller's token is bound to no node (no single {} in its user's extra): an \
             agent's token must be bound to its Pod",
            inputs::NODE_EXTRA
        )),
    }
}

/// Answers `GET …/namespaces/{namespace}/impvms/{name}/inputs`.
pub async fn vm(
    kube: &kube::Client,
    agents: &str,
    user: &RemoteUser,
    namespace: &str,
    name: &str,
) -> Response {
    let (node, vm) = match asked::<ImpVM>(kube, agents, user, namespace, name).await {
        Ok(asked) => asked,
        Err(refusal) => return refusal,
    };
    if let Err(why) = inputs::vm_readable_by(&vm, node) {
        tracing::warn!(vm = %format!("{namespace}/{name}"), node, why, "gateway: inputs refused");
        return status(
            StatusCode::FORBIDDEN,
            &format!("ImpVM {namespace}/{name}: {why}"),
        );
    }
    let refs = inputs::of_vm(inputs::running_spec(&vm));
    answer(
        kube,
        namespace,
        &refs,
        &format!("ImpVM {namespace}/{name}"),
        node,
    )
    .await
}

/// Answers `GET …/namespaces/{namespace}/impvmsnapshots/{name}/inputs`.
pub async fn snapshot(
    kube: &kube::Client,
    agents: &str,
    user: &RemoteUser,
    namespace: &str,
    name: &str,
) -> Response {
    let (node, exec) = match asked::<ImpVMSnapshot>(kube, agents, user, namespace, name).await {
        Ok(asked) => asked,
        Err(refusal) => return refusal,
    };
    let vms = match Api::<ImpVM>::namespaced(kube.clone(), namespace)
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        Err(e) => return failed(&format!("listing the ImpVMs of {namespace}"), &e),
    };
    if let Err(why) = inputs::snapshot_readable_by(&exec, &vms, node) {
        tracing::warn!(snapshot = %format!("{namespace}/{name}"), node, why, "gateway: inputs refused");
        return status(StatusCode::FORBIDDEN, &why);
    }
    let refs = inputs::of_snapshot(&exec);
    let what = format!("ImpVMSnapshot {namespace}/{name}");
    answer(kube, namespace, &refs, &what, node).await
}

type Response = http::Response<Body>;

/// The caller's node and the object `namespace/name` of kind `K` it asks about, or the answer:
/// 403 for a caller that is not an agent bound to a node, 404 for an object that does not
/// exist, 503 for one that could not be read.
async fn asked<'u, K>(
    kube: &kube::Client,
    agents: &str,
    user: &'u RemoteUser,
    namespace: &str,
    name: &str,
) -> Result<(&'u str, K), Response>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    let node = caller_node(agents, user).map_err(|why| status(StatusCode::FORBIDDEN, &why))?;
    let kind = K::kind(&());
    match Api::<K>::namespaced(kube.clone(), namespace)
        .get_opt(name)
        .await
    {
        Ok(Some(o)) => Ok((node, o)),
        Ok(None) => Err(status(
            StatusCode::NOT_FOUND,
            &format!("{kind} {namespace}/{name} not found"),
        )),
        Err(e) => Err(failed(&format!("reading {kind} {namespace}/{name}"), &e)),
    }
}

async fn answer(
    kube: &kube::Client,
    namespace: &str,
    refs: &References,
    what: &str,
    node: &str,
) -> Response {
    if let Err(why) = names_are_names(refs) {
        tracing::warn!(object = what, node, why, "gateway: inputs refused");
        return status(StatusCode::UNPROCESSABLE_ENTITY, &format!("{what}: {why}"));
    }
    match read(kube, namespace, refs).await {
        Ok(given) => {
            tracing::info!(
                object = what,
                node,
                secrets = given.secrets.len(),
                config_maps = given.config_maps.len(),
                "gateway: inputs handed to the node"
            );
            json(StatusCode::OK, &given)
        }
        Err((doing, e)) => failed(&doing, &e),
    }
}

/// Whether every name `refs` holds is a Kubernetes object name (or empty, which names nothing,
/// as Kubernetes' LocalObjectReference allows): a name goes into the path of a GET the operator
/// makes with its cluster-wide right, so `../../kube-system/secrets/x` (which the Go project's
/// schema lets through) must reach nothing; the refusal names it.
fn names_are_names(refs: &References) -> Result<(), String> {
    let kinds = [("Secret", &refs.secrets), ("ConfigMap", &refs.config_maps)];
    for (kind, names) in kinds {
        if let Some(bad) = names
            .iter()
            .find(|n| !n.is_empty() && !imp_agent_api::is_kubernetes_name(n, 253, true))
        {
            return Err(format!(
                "names {kind} {bad:?}, which is not a Kubernetes name (lowercase letters, \
                 digits, '-' and '.')"
            ));
        }
    }
    Ok(())
}

/// Reads what `refs` names in `namespace`; an object that does not exist, or an empty name, is
/// left out.
async fn read(
    kube: &kube::Client,
    namespace: &str,
    refs: &References,
) -> Result<Inputs, (String, kube::Error)> {
    let mut out = Inputs::default();
    let secrets = Api::<Secret>::namespaced(kube.clone(), namespace);
    for name in refs.secrets.iter().filter(|n| !n.is_empty()) {
        let found = secrets
            .get_opt(name)
            .await
            .map_err(|e| (format!("reading Secret {namespace}/{name}"), e))?;
        if let Some(s) = found {
            out.secrets.insert(name.clone(), s.data.unwrap_or_default());
        }
    }
    let maps = Api::<ConfigMap>::namespaced(kube.clone(), namespace);
    for name in refs.config_maps.iter().filter(|n| !n.is_empty()) {
        let found = maps
            .get_opt(name)
            .await
            .map_err(|e| (format!("reading ConfigMap {namespace}/{name}"), e))?;
        if let Some(m) = found {
            let data = ConfigMapData {
                data: m.data.unwrap_or_default(),
                binary_keys: m.binary_data.unwrap_or_default().into_keys().collect(),
            };
            out.config_maps.insert(name.clone(), data);
        }
    }
    Ok(out)
}

/// A read the operator could not make: 503, naming what and why (the agent asks again).
fn failed(doing: &str, e: &kube::Error) -> Response {
    tracing::warn!(doing, error = %imp_api::chain::DisplayChain(e), "gateway: inputs not read");
    status(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("{doing}: {}", imp_api::chain::chain(e)),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeMap;

    const AGENTS: &str = "system:serviceaccount:imp-system:imp-agent";

    fn user(name: &str, nodes: &[&str]) -> RemoteUser {
        let mut extra = BTreeMap::new();
        if !nodes.is_empty() {
            extra.insert(
                inputs::NODE_EXTRA.to_owned(),
                nodes.iter().map(|n| (*n).to_owned()).collect(),
            );
        }
        RemoteUser {
            name: name.into(),
            groups: vec![],
            extra,
        }
    }

    #[test]
    fn a_name_that_is_no_name_reaches_no_read() {
        let mut refs = References::default();
        refs.secrets.insert("db-token".into());
        refs.config_maps.insert("app.settings".into());
        assert_eq!(names_are_names(&refs), Ok(()));
        // Empty names nothing (Kubernetes allows it in a LocalObjectReference).
        let mut empty = refs.clone();
        empty.secrets.insert(String::new());
        assert_eq!(names_are_names(&empty), Ok(()));
        for bad in ["../../kube-system/secrets/x", "a/b", "UPPER", "x;y", "x\"y"] {
            let mut r = refs.clone();
            r.secrets.insert(bad.into());
            let why = names_are_names(&r).unwrap_err();
            assert!(why.contains(&format!("Secret {bad:?}")), "{why}");
        }
        let mut r = refs.clone();
        r.config_maps.insert("../x".into());
        assert!(
            names_are_names(&r)
                .unwrap_err()
                .contains("ConfigMap \"../x\"")
        );
    }

    #[test]
    fn only_an_agent_with_a_token_bound_to_one_node_is_a_caller() {
        assert_eq!(
            caller_node(AGENTS, &user(AGENTS, &["node-a"])),
            Ok("node-a")
        );
        let alice = user("system:serviceaccount:team:alice", &["node-a"]);
        let e = caller_node(AGENTS, &alice).unwrap_err();
        assert!(e.contains("not to system:serviceaccount:team:alice"), "{e}");
        for nodes in [&[][..], &[""], &["a", "b"]] {
            let agent = user(AGENTS, nodes);
            let e = caller_node(AGENTS, &agent).unwrap_err();
            assert!(e.contains("bound to no node"), "{nodes:?}: {e}");
        }
    }
}
