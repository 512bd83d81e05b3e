//! A plain HTTP/1.1 GET read up to its status line, blocking, bounded by a timeout: the
//! guest makes it to its own loopback for an HTTP probe ([`crate::Message::HttpGet`]), and the
//! node agent to a VM's address for its `httpCheck`. The same request and the same strict
//! reading of the answer on both sides.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::message::{HttpGetResult, escape};

/// The most of the response read while looking for the status line.
const MAX_HEAD: usize = 8192;

/// GETs `path` from `addr` within `timeout` (connection included) and returns the status
/// (or why there is none). `path` must be a request target without whitespace (see
/// [`crate::HttpGetRequest::validate`]).
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> HttpGetResult {
    let started = Instant::now();
    match status(addr, path, timeout) {
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

fn status(addr: SocketAddr, path: &str, timeout: Duration) -> Result<u16, String> {
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
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: imp-probe/1\r\nAccept: */*\r\nConnection: close\r\n\r\n"
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
            escape(&String::from_utf8_lossy(line))
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
    use std::net::{Ipv4Addr, TcpListener};

    /// A server on loopback that answers one request with `answer`; yields what it was sent.
    fn serve_once(answer: &'static [u8]) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut req = [0u8; 512];
            let n = c.read(&mut req).unwrap();
            c.write_all(answer).unwrap();
            String::from_utf8_lossy(&req[..n]).into_owned()
        });
        (addr, t)
    }

    const T: Duration = Duration::from_secs(2);

    #[test]
    fn a_status_line_is_the_result_and_2xx_3xx_succeed() {
        let (addr, t) = serve_once(b"HTTP/1.1 204 No Content\r\n\r\n");
        let r = get(addr, "/healthz?x=1", T);
        assert_eq!(r.status, Some(204), "{}", r.detail);
        assert!(r.ok());
        let sent = t.join().unwrap();
        assert!(sent.starts_with("GET /healthz?x=1 HTTP/1.1\r\n"), "{sent}");
        assert!(sent.contains(&format!("\r\nHost: {addr}\r\n")), "{sent}");
        let (addr, _t) = serve_once(b"HTTP/1.0 503 Service Unavailable\r\n\r\n");
        let r = get(addr, "/", T);
        assert_eq!(r.status, Some(503));
        assert!(!r.ok());
    }

    #[test]
    fn no_listener_garbage_and_silence_fail_with_the_reason() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let r = get(addr, "/", T);
        assert!(
            r.status.is_none() && r.detail.contains("connecting"),
            "{}",
            r.detail
        );
        let (addr, _t) = serve_once(b"SSH-2.0-OpenSSH\r\n");
        let r = get(addr, "/", T);
        assert!(r.detail.contains("not an HTTP status line"), "{}", r.detail);
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let started = Instant::now();
        let r = get(l.local_addr().unwrap(), "/", Duration::from_millis(200));
        assert!(r.status.is_none(), "{}", r.detail);
        assert!(started.elapsed() < Duration::from_secs(2));
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
