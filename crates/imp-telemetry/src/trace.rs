//! OpenTelemetry traces of a VM's way to Running, exported over OTLP/HTTP with its JSON
//! encoding (`POST <endpoint>/v1/traces`, `application/json`), when ClusterImpConfig
//! `observability.tracing` asks for it.
//!
//! One trace per ImpVM: its trace id is the VM's uid (a UUID is 128 bits, as a trace id is),
//! so the operator and the node agents put their spans into the same trace without passing a
//! context between them, and every span id is derived from the uid and the span's role
//! ([`span_id`]): the root span `ImpVM ns/name` ([`vm_root`]: creation → first Running, by
//! the agent that reports it), `schedule` under it (creation → placed, by the operator) and
//! `start` under it (the agent's boot of one attempt → Running), with the boot's steps under
//! `start`.
//!
//! Exports are fire-and-forget: a collector that is down costs a log line, never a reconcile.
//! Plain `http://` endpoints only (admission refuses others, [`Endpoint::parse`]).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// A parsed OTLP/HTTP endpoint: `http://host[:port][/base]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port (4318, OTLP/HTTP's, when not given).
    pub port: u16,
    /// The path traces are posted to: the base path and `/v1/traces`.
    pub path: String,
}

/// Why an endpoint cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct BadEndpoint(pub String);

impl Endpoint {
    /// Parses `http://host[:port][/base]`; traces go to `<base>/v1/traces`, as OTLP/HTTP
    /// exporters do with a base endpoint.
    pub fn parse(text: &str) -> Result<Self, BadEndpoint> {
        let rest = text.strip_prefix("http://").ok_or_else(|| {
            BadEndpoint(format!(
                "{text:?}: only http:// endpoints are supported (OTLP over HTTP, JSON encoding, \
                 no TLS): point it at a collector on the cluster or node network"
            ))
        })?;
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = split_host_port(authority)
            .ok_or_else(|| BadEndpoint(format!("{text:?}: expected http://host[:port][/path]")))?;
        Ok(Self {
            host,
            port,
            path: format!("{base}/v1/traces"),
        })
    }
}

fn split_host_port(authority: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':');
    if host.is_empty() || !host.chars().all(valid) {
        return None;
    }
    let port = match port {
        Some(p) => p.parse().ok().filter(|&p| p != 0)?,
        None => 4318,
    };
    Some((host.to_owned(), port))
}

/// One finished span.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The trace (a VM's: [`trace_id`]).
    pub trace: [u8; 16],
    /// This span.
    pub id: [u8; 8],
    /// The parent span, if any.
    pub parent: Option<[u8; 8]>,
    /// What it measures.
    pub name: String,
    /// When it began and ended.
    pub start: SystemTime,
    /// When it ended.
    pub end: SystemTime,
    /// String attributes (`k8s.namespace.name`, `imp.vm`, `k8s.node.name` …).
    pub attributes: Vec<(&'static str, String)>,
}

/// The trace id of VM `uid`: its 128 bits when it is a UUID, else the first 16 bytes of its
/// SHA-256.
pub fn trace_id(uid: &str) -> [u8; 16] {
    let hex: String = uid.chars().filter(|c| *c != '-').collect();
    let mut id = [0u8; 16];
    if hex.len() == 32 && decode_hex(&hex, &mut id) {
        return id;
    }
    id.copy_from_slice(&sha256(uid.as_bytes())[..16]);
    id
}

/// The span id of role `role` (e.g. `vm`, `schedule`, `start/0/1`) in VM `uid`'s trace: the
/// same in every process, so each can name its parent without asking the other.
pub fn span_id(uid: &str, role: &str) -> [u8; 8] {
    let digest = sha256(format!("{uid}/{role}").as_bytes());
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest[..8]);
    id
}

/// The root span of VM `uid`'s trace, `ImpVM ns/name`: from its creation to when it first ran.
pub fn vm_root(
    uid: &str,
    namespace: &str,
    name: &str,
    created: SystemTime,
    ran: SystemTime,
) -> Span {
    Span {
        trace: trace_id(uid),
        id: span_id(uid, "vm"),
        parent: None,
        name: format!("ImpVM {namespace}/{name}"),
        start: created,
        end: ran,
        attributes: vec![
            ("k8s.namespace.name", namespace.to_owned()),
            ("imp.vm", name.to_owned()),
        ],
    }
}

fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(data).into()
}

fn decode_hex(hex: &str, out: &mut [u8]) -> bool {
    let bytes = hex.as_bytes();
    for (i, o) in out.iter_mut().enumerate() {
        let pair = std::str::from_utf8(&bytes[2 * i..2 * i + 2]).ok();
        match pair.and_then(|p| u8::from_str_radix(p, 16).ok()) {
            Some(b) => *o = b,
            None => return false,
        }
    }
    true
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn nanos(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos()
        .to_string()
}

/// The OTLP/HTTP JSON body of `spans` from service `service` (`resource.service.name`).
pub fn otlp_json(service: &str, spans: &[Span]) -> Value {
    let spans: Vec<Value> = spans.iter().map(span_json).collect();
    json!({"resourceSpans": [{
        "resource": {"attributes": [attribute("service.name", service)]},
        "scopeSpans": [{"scope": {"name": "imp"}, "spans": spans}],
    }]})
}

fn span_json(s: &Span) -> Value {
    let mut v = json!({
        "traceId": hex(&s.trace),
        "spanId": hex(&s.id),
        "name": s.name,
        "kind": 1,
        "startTimeUnixNano": nanos(s.start),
        "endTimeUnixNano": nanos(s.end.max(s.start)),
        "attributes": s.attributes.iter().map(|(k, v)| attribute(k, v)).collect::<Vec<_>>(),
    });
    if let Some(p) = s.parent {
        v["parentSpanId"] = json!(hex(&p));
    }
    v
}

fn attribute(key: &str, value: &str) -> Value {
    json!({"key": key, "value": {"stringValue": value}})
}

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The collector could not be reached or the request failed.
    #[error("Posting {spans} spans to http://{host}:{port}{path}")]
    Post {
        /// Spans in the request.
        spans: usize,
        /// The collector.
        host: String,
        /// Its port.
        port: u16,
        /// The path posted to.
        path: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The collector answered with an error status.
    #[error("The collector at http://{host}:{port}{path} answered {status}")]
    Status {
        /// The collector.
        host: String,
        /// Its port.
        port: u16,
        /// The path posted to.
        path: String,
        /// Its answer.
        status: u16,
    },
}

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Posts `spans` of `service` to `endpoint`.
pub async fn export(endpoint: &Endpoint, service: &str, spans: &[Span]) -> Result<(), ExportError> {
    let body = otlp_json(service, spans).to_string();
    let post_err = |source: Box<dyn std::error::Error + Send + Sync>| ExportError::Post {
        spans: spans.len(),
        host: endpoint.host.clone(),
        port: endpoint.port,
        path: endpoint.path.clone(),
        source,
    };
    let status = tokio::time::timeout(EXPORT_TIMEOUT, post(endpoint, body))
        .await
        .map_err(|e| post_err(Box::new(e)))?
        .map_err(post_err)?;
    if (200..300).contains(&status) {
        return Ok(());
    }
    Err(ExportError::Status {
        host: endpoint.host.clone(),
        port: endpoint.port,
        path: endpoint.path.clone(),
        status,
    })
}

/// One HTTP/1.1 POST on a fresh connection; the answer's status.
async fn post(
    endpoint: &Endpoint,
    body: String,
) -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    use http_body_util::Full;
    use hyper::header::{CONTENT_TYPE, HOST};

    let stream = tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port)).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let connection = tokio::spawn(conn);
    let host = match endpoint.host.contains(':') {
        true => format!("[{}]:{}", endpoint.host, endpoint.port),
        false => format!("{}:{}", endpoint.host, endpoint.port),
    };
    let request = hyper::Request::post(endpoint.path.as_str())
        .header(HOST, host)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(bytes::Bytes::from(body)))?;
    let status = sender.send_request(request).await?.status().as_u16();
    connection.abort();
    Ok(status)
}

/// Exports `spans` in the background, logging a failure (a down collector never holds up the
/// caller).
pub fn spawn_export(endpoint: Endpoint, service: &'static str, spans: Vec<Span>) {
    tokio::spawn(async move {
        match export(&endpoint, service, &spans).await {
            Ok(()) => tracing::debug!(spans = spans.len(), "exported spans"),
            Err(e) => {
                let cause =
                    std::error::Error::source(&e).map_or(String::new(), |c| format!(": {c}"));
                tracing::warn!(error = %format!("{e}{cause}"), "exporting spans");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn endpoints_are_plain_http_with_the_traces_path() {
        let e = Endpoint::parse("http://collector.obs:4318").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.path.as_str()),
            ("collector.obs", 4318, "/v1/traces")
        );
        let e = Endpoint::parse("http://10.0.0.1/otlp/").unwrap();
        assert_eq!((e.port, e.path.as_str()), (4318, "/otlp/v1/traces"));
        let e = Endpoint::parse("http://[::1]:9999").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 9999));
        for bad in [
            "https://c:4318",
            "collector:4318",
            "http://",
            "http://c:0",
            "http://a b",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
        assert!(
            Endpoint::parse("https://c")
                .unwrap_err()
                .0
                .contains("only http://")
        );
    }

    #[test]
    fn a_vms_trace_is_its_uid_and_span_ids_agree_across_processes() {
        let uid = "06e03d12-0e36-47e2-b9a1-bbdf6e5f8898";
        assert_eq!(hex(&trace_id(uid)), "06e03d120e3647e2b9a1bbdf6e5f8898");
        assert_eq!(trace_id("not-a-uuid").len(), 16);
        assert_eq!(span_id(uid, "vm"), span_id(uid, "vm"));
        assert_ne!(span_id(uid, "vm"), span_id(uid, "schedule"));
        assert_ne!(span_id(uid, "vm"), span_id("other", "vm"));
    }

    #[test]
    fn the_json_is_otlps() {
        let t0 = UNIX_EPOCH + Duration::from_millis(1_500);
        let span = Span {
            trace: [1; 16],
            id: [2; 8],
            parent: Some([3; 8]),
            name: "start".into(),
            start: t0,
            end: t0 + Duration::from_millis(250),
            attributes: vec![("imp.vm", "web".into())],
        };
        let v = otlp_json("imp-agent", &[span]);
        let rs = &v["resourceSpans"][0];
        assert_eq!(
            rs["resource"]["attributes"][0]["value"]["stringValue"],
            "imp-agent"
        );
        let s = &rs["scopeSpans"][0]["spans"][0];
        assert_eq!(s["traceId"], "01".repeat(16));
        assert_eq!(s["spanId"], "02".repeat(8));
        assert_eq!(s["parentSpanId"], "03".repeat(8));
        assert_eq!(s["startTimeUnixNano"], "1500000000");
        assert_eq!(s["endTimeUnixNano"], "1750000000");
        assert_eq!(s["attributes"][0]["key"], "imp.vm");
    }
}
