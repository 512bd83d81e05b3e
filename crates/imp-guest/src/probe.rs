//! The guest's side of an HTTP probe ([`imp_proto::Message::HttpGet`]): a GET to the
//! workload's own port on loopback, read up to its status line ([`imp_proto::http::get`]).
//! The host never reaches into the VM's network for it, so a probe is no traffic on the VM's
//! interface (a ScaleToZero VM is not kept awake by its probes).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use imp_proto::{HttpGetRequest, HttpGetResult};

/// Makes the GET `req` describes against 127.0.0.1 and returns its status (or why none).
pub fn http_get(req: &HttpGetRequest) -> HttpGetResult {
    if let Err(why) = req.validate() {
        return HttpGetResult {
            status: None,
            detail: why,
        };
    }
    let timeout = Duration::from_millis(req.timeout_ms.clamp(1, 60_000));
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, req.port));
    imp_proto::http::get(addr, &req.path, timeout)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn the_get_goes_to_loopback_on_the_port_and_a_bad_request_is_refused() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut req = [0u8; 512];
            let n = c.read(&mut req).unwrap();
            c.write_all(b"HTTP/1.1 200 OK\r\n\r\n").unwrap();
            String::from_utf8_lossy(&req[..n]).into_owned()
        });
        let req = |path: &str| HttpGetRequest {
            port,
            path: path.into(),
            timeout_ms: 2000,
        };
        let r = http_get(&req("/ready"));
        assert!(r.ok(), "{}", r.detail);
        assert!(t.join().unwrap().starts_with("GET /ready HTTP/1.1\r\n"));
        let r = http_get(&req("no-slash"));
        assert!(r.status.is_none() && r.detail.contains("does not start with /"));
    }
}
