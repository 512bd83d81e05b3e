//! The node's own name servers, for guests whose ImpNetwork names none.

use std::net::IpAddr;

/// Places the node's resolver configuration is read from, in order: the first that names a
/// server a guest can reach wins (systemd-resolved's stub at 127.0.0.53 cannot be reached
/// from a guest, its upstream list can).
pub const RESOLV_FILES: [&str; 2] = ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"];

/// The `nameserver` addresses of a resolv.conf that a guest can reach (not loopback).
pub fn nameservers(text: &str) -> Vec<IpAddr> {
    text.lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("nameserver")).then(|| words.next())?
        })
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .filter(|a| !a.is_loopback() && !a.is_unspecified())
        .collect()
}

/// The node's reachable name servers, reading [`RESOLV_FILES`] off the runtime.
pub async fn node_nameservers() -> Vec<IpAddr> {
    for f in RESOLV_FILES {
        if let Ok(text) = tokio::fs::read_to_string(f).await {
            let found = nameservers(&text);
            if !found.is_empty() {
                return found;
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_stubs_are_left_out() {
        let text = "# generated\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nsearch x\n nameserver 1.1.1.1 \nnameserver ::1\nnameserver bogus\n";
        let got: Vec<String> = nameservers(text).iter().map(ToString::to_string).collect();
        assert_eq!(got, ["10.0.0.2", "1.1.1.1"]);
        assert!(nameservers("nameserver 127.0.0.53\n").is_empty());
    }
}
