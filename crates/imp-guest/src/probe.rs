//! The guest's side of an HTTP probe ([`imp_proto::Message::HttpGet`]): a GET to the
//! workload's own port on loopback, read up to its status line. The host never reaches into
//! the VM's network for it, so a probe is no traffic on the VM's interface (a ScaleToZero VM
//! is not kept awake by its probes).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use imp_proto::{HttpGetRequest, HttpGetResult};

/// The most of the response read while looking for the status line.
const MAX_HEAD: usize = 8192;

/// Makes the GET `req` describes against 127.0.0.1 and returns its status (or why none).
pub fn http_get(req: &HttpGetRequest) -> HttpGetResult {
    let timeout = Duration::from_millis(req.timeout_ms.clamp(1, 60_000));
    let started = Instant::now();
    match get(req, timeout) {
        Ok(status) => HttpGetResult {
            status: Some(status),
            detail: format!("HTTP {status} in {} ms", started.elapsed().as_millis()),
        },
        Err(why) => HttpGetResult {
            status: None,
            detail: why,
        },
    }
}

fn get(req: &HttpGetRequest, timeout: Duration) -> Result<u16, String> {
    req.validate()?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, req.port));
    let deadline = Instant::now() + timeout;
    let mut conn = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    conn.set_write_timeout(Some(left()))
        .and_then(|()| conn.set_read_timeout(Some(left())))
        .map_err(|e| format!("setting timeouts on {addr}: {e}"))?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nUser-Agent: imp-probe/1\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        req.path, req.port
    );
    conn.write_all(request.as_bytes())
        .map_err(|e| format!("sending the request to {addr}: {e}"))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.contains(&b'\n') {
        if head.len() >= MAX_HEAD {
            return Err(format!(
                "{addr} sent {MAX_HEAD} bytes without a status line"
            ));
        }
        conn.set_read_timeout(Some(left()))
            .map_err(|e| format!("setting timeouts on {addr}: {e}"))?;
        let n = conn
            .read(&mut buf)
            .map_err(|e| format!("reading the response of {addr}: {e}"))?;
        if n == 0 {
            return Err(format!("{addr} closed the connection without a response"));
        }
        head.extend_from_slice(&buf[..n]);
    }
    status_of(&head).ok_or_else(|| {
        let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
        format!(
            "{addr} answered {:?}, not an HTTP status line",
            imp_proto::message::escape(&String::from_utf8_lossy(line))
        )
    })
}

/// The status code of a response's first line (`HTTP/1.1 204 No Content`).
fn status_of(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let mut words = line.split(' ');
    let version = words.next()?;
    if !version.starts_with("HTTP/") {
        return None;
    }
    let code = words.next()?;
    (code.len() == 3)
        .then(|| code.parse::<u16>().ok())
        .flatten()
        .filter(|c| (100..600).contains(c))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::net::TcpListener;

    fn serve_once(answer: &'static [u8]) -> (u16, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut req = [0u8; 512];
            let n = c.read(&mut req).unwrap();
            c.write_all(answer).unwrap();
            String::from_utf8_lossy(&req[..n]).into_owned()
        });
        (port, t)
    }

    fn request(port: u16, path: &str) -> HttpGetRequest {
        HttpGetRequest {
            port,
            path: path.into(),
            timeout_ms: 2000,
        }
    }

    #[test]
    fn a_status_line_is_the_result_and_2xx_3xx_succeed() {
        let (port, t) = serve_once(b"HTTP/1.1 204 No Content\r\n\r\n");
        let r = http_get(&request(port, "/healthz?x=1"));
        assert_eq!(r.status, Some(204), "{}", r.detail);
        assert!(r.ok());
        let sent = t.join().unwrap();
        assert!(sent.starts_with("GET /healthz?x=1 HTTP/1.1\r\n"), "{sent}");
        let (port, _t) = serve_once(b"HTTP/1.0 503 Service Unavailable\r\n\r\n");
        let r = http_get(&request(port, "/"));
        assert_eq!(r.status, Some(503));
        assert!(!r.ok());
    }

    #[test]
    fn no_listener_garbage_and_silence_fail_with_the_reason() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let r = http_get(&request(port, "/"));
        assert!(
            r.status.is_none() && r.detail.contains("connecting"),
            "{}",
            r.detail
        );
        let (port, _t) = serve_once(b"SSH-2.0-OpenSSH\r\n");
        let r = http_get(&request(port, "/"));
        assert!(r.detail.contains("not an HTTP status line"), "{}", r.detail);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let mut req = request(port, "/");
        req.timeout_ms = 200;
        let t = Instant::now();
        let r = http_get(&req);
        assert!(r.status.is_none(), "{}", r.detail);
        assert!(t.elapsed() < Duration::from_secs(2));
        drop(l);
    }

    #[test]
    fn status_lines_are_parsed_strictly() {
        assert_eq!(status_of(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(status_of(b"HTTP/2 301\r\n"), Some(301));
        assert_eq!(status_of(b"HTTP/1.1 2000 OK\r\n"), None);
        assert_eq!(status_of(b"http/1.1 200 OK\r\n"), None);
        assert_eq!(status_of(b"HTTP/1.1 099 x\r\n"), None);
    }
}
