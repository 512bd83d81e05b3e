//! The gateway's side of the agent API: mutual TLS to `host:port` pinned both ways, the user
//! the API server authenticated named in headers, and the upgraded exec connection, the
//! console's byte stream or the guests' figures. The pinned connection itself ([`connect`])
//! serves the moves' sender too ([`crate::moves`]).

use bytes::Bytes;
use http::header::{CONNECTION, HOST, UPGRADE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::tls::{ClientIdentity, TlsError};
use crate::{EXEC_UPGRADE, GROUP_HEADER, USER_HEADER};

/// Where the agent is.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` (the Node's `imp.dev/agent-endpoint`).
    pub endpoint: String,
    /// The certificate's SHA-256 (the Node's `imp.dev/agent-cert-sha256`).
    pub fingerprint: String,
}

/// Who asks: the gateway's certificate, and the user the API server authenticated.
#[derive(Debug, Clone)]
pub struct Caller<'a> {
    /// The gateway's client certificate and key.
    pub identity: &'a ClientIdentity,
    /// The user's name.
    pub user: &'a str,
    /// The user's groups.
    pub groups: &'a [String],
}

/// Why a request to the agent failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint is not `host:port`.
    #[error("Invalid agent endpoint {0:?}: expected host:port")]
    Endpoint(String),
    /// The fingerprint is unusable.
    #[error("Invalid agent certificate fingerprint")]
    Tls(#[from] TlsError),
    /// The user's name or a group cannot be sent as a header.
    #[error("The user name or a group contains characters that cannot be sent in a header")]
    User,
    /// No TCP connection.
    #[error("Connecting to the node agent at {endpoint} failed")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake failed (e.g. the certificate is not the pinned one).
    #[error("TLS with the node agent at {endpoint} failed")]
    Handshake {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The agent's certificate is not the one its Node's annotation pins.
    #[error(
        "The node agent at {endpoint} presented another certificate than its Node pins: {detail}"
    )]
    Pin {
        /// The endpoint.
        endpoint: String,
        /// Both fingerprints.
        detail: String,
    },
    /// HTTP failed.
    #[error("HTTP with the node agent failed")]
    Http(#[from] hyper::Error),
    /// The agent's answer could not be read (cut short, too long, or not what was asked).
    #[error("Reading the node agent's answer failed")]
    Answer(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The agent refused the request.
    #[error("The node agent refused the request ({status}): {message}")]
    Refused {
        /// The status.
        status: StatusCode,
        /// The agent's message.
        message: String,
    },
}

/// How long the TCP connection and then the TLS handshake to an agent may each take (a node
/// that is down must not hold a user's request until the API server gives up).
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The upgraded exec connection: speak imp-proto on it (hello, exec, stream).
pub type ExecStream = TokioIo<hyper::upgrade::Upgraded>;

/// Asks for an exec in `namespace/name`; on success the stream carries the guest protocol.
pub async fn exec(
    target: &Target,
    caller: &Caller<'_>,
    namespace: &str,
    name: &str,
) -> Result<ExecStream, ClientError> {
    let path = crate::exec_path(namespace, name);
    let mut resp = send(target, caller, Method::POST, &path, true).await?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(refusal(resp).await);
    }
    let upgraded = hyper::upgrade::on(&mut resp).await?;
    Ok(TokioIo::new(upgraded))
}

/// Asks for the console log of `namespace/name`; the body streams it.
pub async fn console(
    target: &Target,
    caller: &Caller<'_>,
    namespace: &str,
    name: &str,
    follow: bool,
) -> Result<Incoming, ClientError> {
    let path = crate::console_path(namespace, name, follow);
    let resp = send(target, caller, Method::GET, &path, false).await?;
    if !resp.status().is_success() {
        return Err(refusal(resp).await);
    }
    Ok(resp.into_body())
}

/// The most bytes of a guest-metrics answer read (a few hundred bytes per VM).
const MAX_READINGS_BYTES: usize = 8 << 20;

/// The latest guest figures of `namespace`'s VMs on the target's node.
pub async fn guest_metrics(
    target: &Target,
    caller: &Caller<'_>,
    namespace: &str,
) -> Result<crate::top::GuestReadingList, ClientError> {
    let path = crate::top::path(namespace);
    let resp = send(target, caller, Method::GET, &path, false).await?;
    if !resp.status().is_success() {
        return Err(refusal(resp).await);
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_READINGS_BYTES)
        .collect()
        .await
        .map_err(ClientError::Answer)?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| ClientError::Answer(Box::new(e)))
}

/// The host part of `host:port` (without brackets for IPv6).
fn host_of(endpoint: &str) -> Option<&str> {
    let (host, port) = endpoint.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    (!host.is_empty()).then_some(host)
}

async fn send(
    target: &Target,
    caller: &Caller<'_>,
    method: Method,
    path: &str,
    upgrade: bool,
) -> Result<Response<Incoming>, ClientError> {
    let endpoint = &target.endpoint;
    let user = HeaderValue::from_str(caller.user).map_err(|_| ClientError::User)?;
    let groups = caller
        .groups
        .iter()
        .map(|g| HeaderValue::from_str(g).map_err(|_| ClientError::User))
        .collect::<Result<Vec<_>, _>>()?;
    let mut sender = connect(target, caller.identity).await?;
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, endpoint.as_str())
        .header(USER_HEADER, user);
    for group in groups {
        req = req.header(GROUP_HEADER, group);
    }
    if upgrade {
        req = req
            .header(CONNECTION, "upgrade")
            .header(UPGRADE, EXEC_UPGRADE);
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .map_err(|_| ClientError::Endpoint(endpoint.clone()))?;
    Ok(sender.send_request(req).await?)
}

/// An HTTP/1.1 connection to the agent at `target` over TLS, pinned to the certificate its
/// Node publishes and presenting `identity`, for requests with bodies of type `B` (one at a
/// time; the connection is kept between them).
pub(crate) async fn connect<B>(
    target: &Target,
    identity: &ClientIdentity,
) -> Result<SendRequest<B>, ClientError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let endpoint = &target.endpoint;
    let host = host_of(endpoint).ok_or_else(|| ClientError::Endpoint(endpoint.clone()))?;
    let server_name = ServerName::try_from(host.to_owned())
        .map_err(|_| ClientError::Endpoint(endpoint.clone()))?;
    let config = identity.pinned_config(&target.fingerprint)?;
    let timed_out = || {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {CONNECT_TIMEOUT:?}"),
        )
    };
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(endpoint.as_str()))
        .await
        .unwrap_or_else(|_| Err(timed_out()))
        .map_err(|source| ClientError::Connect {
            endpoint: endpoint.clone(),
            source,
        })?;
    let tls = tokio::time::timeout(
        CONNECT_TIMEOUT,
        TlsConnector::from(config).connect(server_name, tcp),
    )
    .await
    .unwrap_or_else(|_| Err(timed_out()))
    .map_err(|source| handshake_error(endpoint, source))?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "agent API connection ended with an error");
        }
    });
    Ok(sender)
}

/// A pin mismatch said plainly; any other handshake failure as it is.
fn handshake_error(endpoint: &str, source: std::io::Error) -> ClientError {
    let pin = source
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
        .and_then(|e| match e {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)) => {
                Some(other.0.to_string())
            }
            _ => None,
        });
    match pin {
        Some(detail) => ClientError::Pin {
            endpoint: endpoint.to_owned(),
            detail,
        },
        None => ClientError::Handshake {
            endpoint: endpoint.to_owned(),
            source,
        },
    }
}

/// Reads a refusal's `Status` message (or its text), bounded.
pub(crate) async fn refusal(resp: Response<Incoming>) -> ClientError {
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), 64 * 1024)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_owned());
    ClientError::Refused { status, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_split_into_host_and_port() {
        assert_eq!(host_of("10.0.0.5:10250"), Some("10.0.0.5"));
        assert_eq!(host_of("node-1.example:443"), Some("node-1.example"));
        assert_eq!(host_of("[fd00::1]:443"), Some("fd00::1"));
        assert_eq!(host_of("node-1"), None);
        assert_eq!(host_of(":443"), None);
        assert_eq!(host_of("node:http"), None);
    }
}
