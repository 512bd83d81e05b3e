//! A tiny HTTP/1.1 client for tests of the raw API surface, and the test CRD.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The test CRD (schema, defaults, enum, pattern, CEL, status subresource, printer columns).
pub const WIDGET_CRD: &str = include_str!("../data/widget-crd.yaml");

/// Sends one request and returns the status code and the (de-chunked) body.
pub async fn send(
    base: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let code: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (code, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// Sends JSON (or nothing) and parses the JSON answer.
pub async fn call(base: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let b = body.map(|b| b.to_string()).unwrap_or_default();
    let (code, text) = send(
        base,
        method,
        path,
        &[("Content-Type", "application/json")],
        &b,
    )
    .await;
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Sends a patch of content type `ct`.
pub async fn patch(base: &str, path: &str, ct: &str, body: &str) -> (u16, Value) {
    let (code, text) = send(base, "PATCH", path, &[("Content-Type", ct)], body).await;
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Reads a finite watch (use `timeoutSeconds`) as its list of events.
pub async fn watch_events(base: &str, path: &str) -> Vec<Value> {
    let (code, text) = send(base, "GET", path, &[], "").await;
    assert_eq!(code, 200, "{text}");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Creates the test CRD through the API.
pub async fn create_widget_crd(base: &str) {
    let crd: Value = serde_yaml_ng::from_str(WIDGET_CRD).unwrap();
    let (code, body) = call(
        base,
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        Some(crd),
    )
    .await;
    assert_eq!(code, 201, "{body}");
}
