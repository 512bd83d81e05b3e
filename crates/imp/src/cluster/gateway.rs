//! The CLI's side of imp's aggregated API (`subresources.imp.dev/v1alpha1`, served by the
//! operator's gateway): requests go to the Kubernetes API server with the kubeconfig's own
//! credentials, whatever kind they are (token, client certificate, exec plugin), and the API
//! server decides who may do what. Nothing of the user's reaches a node.

use anyhow::{Context, bail};
use bytes::Bytes;
use http::header::{CONNECTION, UPGRADE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use imp_agent_api::top::GuestReadingList;
use imp_agent_api::{CONSOLE_UPGRADE, EXEC_UPGRADE};
use kube::client::Body;

/// The aggregated API's base path.
const BASE: &str = "/apis/subresources.imp.dev/v1alpha1";

/// The most bytes of a refusal or of the guests' figures read.
const MAX_ANSWER: usize = 8 << 20;

/// An upgraded connection through the API server.
pub type Upgraded = TokioIo<hyper::upgrade::Upgraded>;

/// What a console request gives: the raw stream of an upgraded connection (followed), or the
/// answer's body.
pub enum Console {
    /// Followed: the log's bytes until the VM's console ends or the caller stops.
    Upgraded(Upgraded),
    /// Not followed: the log so far.
    Body(Body),
}

/// Starts an exec in ImpVM `namespace/vm`: on success, the connection speaks the guest
/// protocol.
pub async fn exec(kube: &kube::Client, namespace: &str, vm: &str) -> anyhow::Result<Upgraded> {
    let path = format!("{BASE}/namespaces/{namespace}/impvms/{vm}/exec");
    let resp = send(kube, Method::POST, &path, Some(EXEC_UPGRADE)).await?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(refusal(resp, "exec", namespace, vm).await);
    }
    let upgraded = hyper::upgrade::on(resp)
        .await
        .context("switching the connection to the exec protocol")?;
    Ok(TokioIo::new(upgraded))
}

/// Opens the console of ImpVM `namespace/vm`.
pub async fn console(
    kube: &kube::Client,
    namespace: &str,
    vm: &str,
    follow: bool,
) -> anyhow::Result<Console> {
    let path = format!("{BASE}/namespaces/{namespace}/impvms/{vm}/console?follow={follow}");
    let upgrade = follow.then_some(CONSOLE_UPGRADE);
    let resp = send(kube, Method::GET, &path, upgrade).await?;
    match resp.status() {
        StatusCode::SWITCHING_PROTOCOLS => {
            let upgraded = hyper::upgrade::on(resp)
                .await
                .context("switching the connection to the console stream")?;
            Ok(Console::Upgraded(TokioIo::new(upgraded)))
        }
        s if s.is_success() => Ok(Console::Body(resp.into_body())),
        _ => Err(refusal(resp, "console", namespace, vm).await),
    }
}

/// The guests' latest figures of `namespace`'s VMs, from every node that runs one.
pub async fn guest_metrics(
    kube: &kube::Client,
    namespace: &str,
) -> anyhow::Result<GuestReadingList> {
    let path = format!("{BASE}/namespaces/{namespace}/guestmetrics");
    let resp = send(kube, Method::GET, &path, None).await?;
    if !resp.status().is_success() {
        return Err(refusal(resp, "guest metrics", namespace, "").await);
    }
    let body = read(resp).await?;
    serde_json::from_slice(&body).context("reading the guests' figures")
}

async fn send(
    kube: &kube::Client,
    method: Method,
    path: &str,
    upgrade: Option<&'static str>,
) -> anyhow::Result<Response<Body>> {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(protocol) = upgrade {
        req = req.header(CONNECTION, "Upgrade").header(UPGRADE, protocol);
    }
    let req = req
        .body(Body::empty())
        .with_context(|| format!("building the request {path}"))?;
    kube.send(req)
        .await
        .with_context(|| format!("asking the Kubernetes API server for {path}"))
}

async fn read(resp: Response<Body>) -> anyhow::Result<Bytes> {
    Ok(http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the API server's answer: {e}"))?
        .to_bytes())
}

/// A refusal's message (a Kubernetes `Status`, else the text), with a hint where one helps.
async fn refusal(resp: Response<Body>, what: &str, namespace: &str, vm: &str) -> anyhow::Error {
    let status = resp.status();
    let body = read(resp).await.unwrap_or_default();
    let message = message_of(&body);
    let hint = match status {
        StatusCode::SERVICE_UNAVAILABLE if message.contains("service unavailable") => {
            " (is the imp operator's gateway running? `kubectl get apiservice \
             v1alpha1.subresources.imp.dev` says)"
        }
        StatusCode::NOT_FOUND if message.contains("the server could not find") => {
            " (the aggregated API subresources.imp.dev is not installed: the chart installs \
             its APIService)"
        }
        _ => "",
    };
    let target = if vm.is_empty() {
        format!("namespace {namespace}")
    } else {
        format!("ImpVM {namespace}/{vm}")
    };
    anyhow::anyhow!("{what} of {target} refused ({status}): {message}{hint}")
}

/// The `message` of a Kubernetes `Status`, else the text itself.
fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned())
}

/// Fails unless `s` is a name the API accepts in a path.
pub fn check_name(what: &str, s: &str) -> anyhow::Result<()> {
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if !ok {
        bail!("{what} {s:?} is not a Kubernetes name (lowercase letters, digits, '-' and '.')");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_gives_its_message_and_other_text_itself() {
        let status =
            br#"{"kind":"Status","message":"impvms.subresources.imp.dev \"w\" is forbidden"}"#;
        assert_eq!(
            message_of(status),
            "impvms.subresources.imp.dev \"w\" is forbidden"
        );
        assert_eq!(message_of(b" service unavailable\n"), "service unavailable");
    }

    #[test]
    fn names_that_cannot_be_in_a_path_are_refused() {
        assert!(check_name("ImpVM", "web-1.a").is_ok());
        for bad in ["", "Web", "a/b", "a?b"] {
            assert!(check_name("ImpVM", bad).is_err(), "{bad}");
        }
    }
}
