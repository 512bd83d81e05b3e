//! Carrying a user's request to the node agent of their VM and its answer back: the VM's node
//! found ([`target_of`]), the agent called over mutual TLS as the gateway, naming the user
//! ([`imp_agent_api::client`]), and the exec's upgraded connection spliced, the console
//! streamed, or the guests' figures of every node merged.

use std::collections::BTreeSet;

use futures::TryStreamExt;
use http::header::{CONNECTION, UPGRADE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use imp_agent_api::client::{self, Caller, ClientError, Target};
use imp_agent_api::top::{GuestReadingList, NodeFailure};
use imp_agent_api::{CONSOLE_UPGRADE, EXEC_UPGRADE, asks_upgrade};
use imp_api::shared::{ANNOTATION_AGENT_CERT_SHA256, ANNOTATION_AGENT_ENDPOINT};
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;

use super::{Body, json, status};

/// A refusal, with its status and message.
pub type Refusal = Box<Response<Body>>;

/// The node an ImpVM runs on: `status.nodeName`, else `spec.nodeName`.
pub fn node_of(vm: &ImpVM) -> Option<String> {
    vm.status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .or_else(|| vm.spec.node_name.clone())
        .filter(|n| !n.is_empty())
}

/// Where a Node's agent listens and which certificate it presents, from its annotations.
pub fn agent_of(node: &Node) -> Result<Target, String> {
    let name = node.metadata.name.as_deref().unwrap_or("");
    let annotations = node.metadata.annotations.as_ref();
    let get = |key: &str| {
        annotations
            .and_then(|a| a.get(key))
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                format!("Node {name} has no annotation {key}: is the imp agent running there?")
            })
    };
    Ok(Target {
        endpoint: get(ANNOTATION_AGENT_ENDPOINT)?,
        fingerprint: get(ANNOTATION_AGENT_CERT_SHA256)?,
    })
}

/// The agent of node `node`.
async fn target_of_node(kube: &kube::Client, node: &str) -> Result<Target, Refusal> {
    let found = Api::<Node>::all(kube.clone())
        .get_opt(node)
        .await
        .map_err(|e| {
            unavailable(&format!(
                "reading Node {node}: {}",
                imp_api::chain::chain(&e)
            ))
        })?
        .ok_or_else(|| unavailable(&format!("Node {node} does not exist")))?;
    agent_of(&found).map_err(|m| unavailable(&m))
}

/// The agent of the node that runs VM `namespace/name`, and the node.
pub async fn target_of(
    kube: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<(Target, String), Refusal> {
    let vm = Api::<ImpVM>::namespaced(kube.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|e| {
            unavailable(&format!(
                "reading ImpVM {namespace}/{name}: {}",
                imp_api::chain::chain(&e)
            ))
        })?
        .ok_or_else(|| {
            Box::new(status(
                StatusCode::NOT_FOUND,
                &format!("ImpVM {namespace}/{name} not found"),
            ))
        })?;
    let node = node_of(&vm).ok_or_else(|| {
        Box::new(status(
            StatusCode::CONFLICT,
            &format!("ImpVM {namespace}/{name} is not placed on a node yet"),
        ))
    })?;
    Ok((target_of_node(kube, &node).await?, node))
}

fn unavailable(message: &str) -> Refusal {
    Box::new(status(StatusCode::SERVICE_UNAVAILABLE, message))
}

/// The answer for an agent call that failed: the agent's answer about the VM (404, 409, 429,
/// 504…) passed on; its refusal of the gateway itself (401, or 503 while it does not know the
/// gateway's certificates) is the gateway's failure, not the user's credentials, so it is a
/// 502 naming the node, as is any other failure to reach it.
fn failed(node: &str, e: &ClientError) -> Response<Body> {
    match e {
        ClientError::Refused {
            status: code,
            message,
        } if *code != StatusCode::UNAUTHORIZED && *code != StatusCode::SERVICE_UNAVAILABLE => {
            status(*code, message)
        }
        ClientError::Refused {
            status: code,
            message,
        } => status(
            StatusCode::BAD_GATEWAY,
            &format!("the node agent of {node} refused the gateway ({code}): {message}"),
        ),
        other => status(
            StatusCode::BAD_GATEWAY,
            &format!(
                "the node agent of {node} could not be reached: {}",
                imp_api::chain::chain(other)
            ),
        ),
    }
}

/// How long one node's agent may take to answer for its guests' figures.
pub const NODE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The 101 answer that switches to `protocol`.
fn switching(protocol: &'static str) -> Response<Body> {
    let mut resp = Response::new(super::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    resp.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("upgrade"));
    resp.headers_mut()
        .insert(UPGRADE, HeaderValue::from_static(protocol));
    resp
}

/// An exec: the agent's upgraded connection, then the caller's, spliced both ways (each
/// direction's end passed on as a half-close).
pub async fn exec<B: Send + 'static>(
    kube: &kube::Client,
    caller: &Caller<'_>,
    req: &mut http::Request<B>,
    namespace: &str,
    name: &str,
) -> Response<Body> {
    if !asks_upgrade(req.headers(), EXEC_UPGRADE) {
        return status(
            StatusCode::BAD_REQUEST,
            &format!("exec needs an upgrade: send Connection: Upgrade and Upgrade: {EXEC_UPGRADE}"),
        );
    }
    let (target, node) = match target_of(kube, namespace, name).await {
        Ok(t) => t,
        Err(refusal) => return *refusal,
    };
    let mut agent = match client::exec(&target, caller, namespace, name).await {
        Ok(stream) => stream,
        Err(e) => return failed(&node, &e),
    };
    let on_upgrade = hyper::upgrade::on(req);
    let (vm, ns, user) = (
        name.to_owned(),
        namespace.to_owned(),
        caller.user.to_owned(),
    );
    tokio::spawn(async move {
        let mut user_side = match on_upgrade.await {
            Ok(up) => TokioIo::new(up),
            Err(e) => {
                tracing::warn!(vm, namespace = ns, user, error = %e, "gateway: the caller's upgrade failed");
                return;
            }
        };
        if let Err(e) = tokio::io::copy_bidirectional(&mut user_side, &mut agent).await {
            tracing::debug!(vm, namespace = ns, user, error = %e, "gateway: an exec ended with an error");
        }
    });
    tracing::info!(
        vm = name,
        namespace,
        node,
        user = caller.user,
        "gateway: exec"
    );
    switching(EXEC_UPGRADE)
}

/// A console: the agent's stream, as the answer's body, or (followed and asked so) on the
/// upgraded connection, which the API server's request timeout does not cut.
pub async fn console<B: Send + 'static>(
    kube: &kube::Client,
    caller: &Caller<'_>,
    req: &mut http::Request<B>,
    namespace: &str,
    name: &str,
    follow: bool,
) -> Response<Body> {
    let (target, node) = match target_of(kube, namespace, name).await {
        Ok(t) => t,
        Err(refusal) => return *refusal,
    };
    let body = match client::console(&target, caller, namespace, name, follow).await {
        Ok(b) => b,
        Err(e) => return failed(&node, &e),
    };
    if !asks_upgrade(req.headers(), CONSOLE_UPGRADE) {
        let stream = body.into_data_stream().map_err(std::io::Error::other);
        return Response::new(BodyExt::boxed_unsync(StreamBody::new(
            stream.map_ok(Frame::data),
        )));
    }
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let Ok(up) = on_upgrade.await else { return };
        follow_console(TokioIo::new(up), body).await;
    });
    switching(CONSOLE_UPGRADE)
}

/// Writes the console's bytes to the user's upgraded connection until the log ends or the
/// user goes away; a user who leaves a quiet console is noticed at once (their side reads
/// its end), so the agent's session is not held until the VM next prints.
async fn follow_console<S>(mut user_side: S, body: hyper::body::Incoming)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut frames = body.into_data_stream();
    let mut scratch = [0u8; 512];
    loop {
        tokio::select! {
            chunk = frames.try_next() => match chunk {
                Ok(Some(chunk)) => {
                    if user_side.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
                _ => break,
            },
            read = user_side.read(&mut scratch) => match read {
                // The user hung up (what they send otherwise means nothing here).
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
        }
    }
    let _ = user_side.shutdown().await;
}

/// The nodes that run a VM of the list now (only a running VM has figures).
pub fn nodes_to_ask(vms: &[ImpVM]) -> BTreeSet<String> {
    vms.iter()
        .filter(|vm| vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running))
        .filter_map(node_of)
        .collect()
}

/// The guests' figures of `namespace`'s VMs from every node that runs one, merged; the nodes
/// that did not answer are named in `failures`.
pub async fn guest_metrics(
    kube: &kube::Client,
    caller: &Caller<'_>,
    namespace: &str,
) -> Response<Body> {
    let vms = match Api::<ImpVM>::namespaced(kube.clone(), namespace)
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        Err(e) => {
            return *unavailable(&format!(
                "listing the ImpVMs of namespace {namespace}: {}",
                imp_api::chain::chain(&e)
            ));
        }
    };
    let asks = nodes_to_ask(&vms).into_iter().map(|node| async move {
        let got = match target_of_node(kube, &node).await {
            Ok(target) => tokio::time::timeout(
                NODE_TIMEOUT,
                client::guest_metrics(&target, caller, namespace),
            )
            .await
            .map_err(|_| format!("no answer within {NODE_TIMEOUT:?}"))
            .and_then(|r| r.map_err(|e| imp_api::chain::chain(&e))),
            Err(refusal) => Err(message_of(*refusal).await),
        };
        (node, got)
    });
    let mut merged = GuestReadingList {
        namespace: namespace.to_owned(),
        items: Vec::new(),
        failures: Vec::new(),
    };
    for (node, got) in futures::future::join_all(asks).await {
        match got {
            Ok(list) => merged.items.extend(list.items),
            Err(message) => merged.failures.push(NodeFailure { node, message }),
        }
    }
    merged.items.sort_by(|a, b| a.name.cmp(&b.name));
    json(StatusCode::OK, &merged)
}

/// The message of one of the gateway's own refusals.
async fn message_of(refusal: Response<Body>) -> String {
    let code = refusal.status();
    let body = refusal
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| code.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json as j;

    fn vm(v: serde_json::Value) -> ImpVM {
        let mut base = j!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "v", "namespace": "n"}, "spec": {}});
        for (k, val) in v.as_object().unwrap() {
            base[k] = val.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn a_vm_runs_where_its_status_says_else_where_it_was_placed() {
        assert_eq!(node_of(&vm(j!({}))), None);
        let placed = vm(j!({"spec": {"nodeName": "a"}}));
        assert_eq!(node_of(&placed).as_deref(), Some("a"));
        let both = vm(j!({"spec": {"nodeName": "a"}, "status": {"nodeName": "b"}}));
        assert_eq!(node_of(&both).as_deref(), Some("b"));
        let running = vm(j!({"status": {"nodeName": "b", "phase": "Running"}}));
        let pending = vm(j!({"spec": {"nodeName": "c"}, "status": {"phase": "Pending"}}));
        assert_eq!(
            nodes_to_ask(&[running, pending])
                .into_iter()
                .collect::<Vec<_>>(),
            ["b"]
        );
    }

    #[test]
    fn a_node_without_its_agents_annotations_is_named() {
        let node: Node = serde_json::from_value(j!({"metadata": {"name": "n1",
            "annotations": {ANNOTATION_AGENT_ENDPOINT: "10.0.0.1:10250"}}}))
        .unwrap();
        let e = agent_of(&node).unwrap_err();
        assert!(
            e.contains("n1") && e.contains(ANNOTATION_AGENT_CERT_SHA256),
            "{e}"
        );
    }
}
