//! The ops server on a real loopback socket: `/metrics`, `/healthz` and `/readyz` as a scraper
//! and a kubelet probe see them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use imp_operator::metrics::Metrics;
use imp_telemetry::{self as ops, Health, OPENMETRICS_CONTENT_TYPE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A plain HTTP/1.1 GET; returns (status, content-type, body).
async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw)).await??;
    let text = String::from_utf8(raw)?;
    let (head, body) = text.split_once("\r\n\r\n").context("no header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    Ok((status, content_type, body.to_string()))
}

#[tokio::test]
async fn ops_server_serves_metrics_and_flips_probes() -> Result<()> {
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(ops::serve_listener(
        listener,
        metrics.clone(),
        health.clone(),
        async move {
            let _ = stopped.await;
        },
    ));

    // Starting: live, not ready, with the reason on one line.
    let (code, _, body) = get(addr, "/healthz").await?;
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let (code, _, body) = get(addr, "/readyz").await?;
    assert_eq!((code, body.as_str()), (503, "not ready: starting\n"));

    health.set_ready();
    let (code, _, body) = get(addr, "/readyz").await?;
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    health.set_not_ready("leader lease unknown");
    let (code, _, body) = get(addr, "/readyz").await?;
    assert_eq!(
        (code, body.as_str()),
        (503, "not ready: leader lease unknown\n")
    );
    health.set_not_live("reconciler task exited");
    let (code, _, body) = get(addr, "/healthz").await?;
    assert_eq!(
        (code, body.as_str()),
        (503, "not live: reconciler task exited\n")
    );

    // Metrics reflect what the controllers recorded.
    let counts: BTreeMap<String, i64> = [("Running".to_string(), 3), ("Pending".to_string(), 1)]
        .into_iter()
        .collect();
    metrics.set_phase_counts(&counts);
    metrics.observe_schedule_latency(Duration::from_millis(120));
    metrics.reconcile("impvm");
    metrics.reconcile_error("impvm", "conflict");
    metrics.set_queue_depth(4);
    metrics.set_leader(true);
    let (code, content_type, body) = get(addr, "/metrics").await?;
    assert_eq!(code, 200);
    assert_eq!(content_type, OPENMETRICS_CONTENT_TYPE);
    for line in [
        "imp_operator_vms{phase=\"Running\"} 3",
        "imp_operator_vms{phase=\"Pending\"} 1",
        "imp_operator_vms{phase=\"Failed\"} 0",
        "imp_operator_schedule_latency_seconds_count 1",
        "imp_operator_reconciles_total{controller=\"impvm\"} 1",
        "imp_operator_reconcile_errors_total{controller=\"impvm\",reason=\"conflict\"} 1",
        "imp_operator_queue_depth 4",
        "imp_operator_is_leader 1",
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "missing {line:?} in\n{body}"
        );
    }
    assert!(body.ends_with("# EOF\n"));

    let (code, _, _) = get(addr, "/nope").await?;
    assert_eq!(code, 404);

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), server).await???;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "server still accepts after shutdown"
    );
    Ok(())
}

#[tokio::test]
async fn binding_a_taken_address_names_it() -> Result<()> {
    let taken = TcpListener::bind("127.0.0.1:0").await?;
    let addr = taken.local_addr()?;
    let err = ops::serve(
        addr,
        Arc::new(Metrics::new()),
        Arc::new(Health::new()),
        std::future::pending(),
    )
    .await
    .expect_err("the port is in use");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    Ok(())
}
