//! Creates 10,000 ConfigMaps over HTTP while 3 watchers watch; prints objects/s and the
//! watch-event latency (create sent → event received) at p50 and p99.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imp_testkube::TestKube;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

const OBJECTS: usize = 10_000;
const WATCHERS: usize = 3;
const CLIENTS: usize = 8;

type Sent = Arc<Mutex<HashMap<String, Instant>>>;

async fn create(addr: &str, name: &str) {
    let body = format!(r#"{{"metadata":{{"name":"{name}"}},"data":{{"k":"v"}}}}"#);
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    assert!(
        buf.starts_with(b"HTTP/1.1 201"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
}

async fn watch(addr: String, sent: Sent, ready: tokio::sync::mpsc::Sender<()>) -> Vec<Duration> {
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let req = format!(
        "GET /api/v1/namespaces/default/configmaps?watch=true&resourceVersion=1&timeoutSeconds=120 HTTP/1.1\r\nHost: {addr}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    // Status line and headers.
    loop {
        line.clear();
        r.read_line(&mut line).await.unwrap();
        if line == "\r\n" {
            break;
        }
    }
    ready.send(()).await.unwrap();
    let mut lat = Vec::with_capacity(OBJECTS);
    while lat.len() < OBJECTS {
        line.clear();
        if r.read_line(&mut line).await.unwrap() == 0 {
            break;
        }
        let Some(i) = line.find(r#""name":"bench-"#) else {
            continue;
        };
        let rest = &line[i + 8..];
        let name = &rest[..rest.find('"').unwrap()];
        if let Some(t) = sent.lock().unwrap().get(name) {
            lat.push(t.elapsed());
        }
    }
    lat
}

fn pct(v: &[Duration], p: f64) -> Duration {
    v[((v.len() as f64 - 1.0) * p) as usize]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let k = TestKube::start().await.unwrap();
        let addr = k.addr().to_string();
        let sent: Sent = Arc::new(Mutex::new(HashMap::with_capacity(OBJECTS)));
        let (tx, mut rx) = tokio::sync::mpsc::channel(WATCHERS);
        let watchers: Vec<_> = (0..WATCHERS)
            .map(|_| tokio::spawn(watch(addr.clone(), sent.clone(), tx.clone())))
            .collect();
        for _ in 0..WATCHERS {
            rx.recv().await.unwrap();
        }
        let start = Instant::now();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let addr = addr.clone();
                let sent = sent.clone();
                tokio::spawn(async move {
                    for i in (c..OBJECTS).step_by(CLIENTS) {
                        let name = format!("bench-{i}");
                        sent.lock().unwrap().insert(name.clone(), Instant::now());
                        create(&addr, &name).await;
                    }
                })
            })
            .collect();
        for c in clients {
            c.await.unwrap();
        }
        let elapsed = start.elapsed();
        let mut all = Vec::new();
        for w in watchers {
            all.extend(w.await.unwrap());
        }
        all.sort();
        println!(
            "imp-testkube: {OBJECTS} configmaps in {:.2} s = {:.0} objects/s with {WATCHERS} watchers ({CLIENTS} clients)",
            elapsed.as_secs_f64(),
            OBJECTS as f64 / elapsed.as_secs_f64()
        );
        println!(
            "watch-event latency over {} events: p50 {:.2} ms, p99 {:.2} ms",
            all.len(),
            pct(&all, 0.5).as_secs_f64() * 1e3,
            pct(&all, 0.99).as_secs_f64() * 1e3
        );
        assert_eq!(all.len(), OBJECTS * WATCHERS, "every watcher saw every object");
    });
}
