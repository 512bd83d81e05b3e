//! Keeps the test control plane's traffic on this machine.
//!
//! kube-apiserver gives Services ClusterIPs from [`SERVICE_RANGE`], and dials them itself when
//! it calls a webhook or an aggregated API that names a Service and no kube-proxy runs beside
//! it (the chart test installs the chart on such a control plane). Nothing routes a Service
//! range on these machines, so without a guard those packets would leave through the default
//! route. The range is in 198.18.0.0/15, which RFC 2544 reserves for benchmarking: nobody's
//! network.
//!
//! [`guard`] (run by every control plane before it starts) makes two things true on the host,
//! both idempotent and safe to leave in place:
//! - a `blackhole` route for [`GUARDED`]: a dial fails at once, inside the kernel, before any
//!   packet exists;
//! - a tripwire: nftables table [`TABLE`], whose postrouting chain counts (named counter
//!   [`COUNTER`]) and drops any packet to [`GUARDED`] that got past routing, i.e. that was about
//!   to leave. The counter stays at zero while the route holds; [`leaked`] reads it, and CI
//!   fails a run in which it is not zero (`scripts/egress-check`).

use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// The Service range of every test control plane.
pub const SERVICE_RANGE: &str = "198.18.0.0/24";

/// The ClusterIP of Service `kubernetes` (the first address of [`SERVICE_RANGE`]).
pub const KUBERNETES_SERVICE_IP: &str = "198.18.0.1";

/// The range no test packet may leave the machine for (RFC 2544's benchmarking range, which
/// holds [`SERVICE_RANGE`]).
pub const GUARDED: &str = "198.18.0.0/15";

/// The nftables table (family `inet`) of the tripwire.
pub const TABLE: &str = "imp_testenv_egress";

/// Its named counter: packets to [`GUARDED`] that reached postrouting.
pub const COUNTER: &str = "leaked";

/// Why the guard could not be put in place or read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command could not be run.
    #[error("running {what}")]
    Spawn {
        /// The command.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A command failed.
    #[error("{what} failed ({status}): {stderr}")]
    Failed {
        /// The command.
        what: String,
        /// How it ended.
        status: std::process::ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
    /// The counter's listing could not be read.
    #[error("reading nftables counter {TABLE}/{COUNTER}: {0}")]
    Counter(String),
}

/// The nftables script of the tripwire in its network namespace. Loaded as one transaction;
/// loading it again replaces the chain's rule and keeps the counter's value.
pub fn tripwire_script() -> String {
    format!(
        "add table inet {TABLE}\n\
         add counter inet {TABLE} {COUNTER}\n\
         add chain inet {TABLE} out {{ type filter hook postrouting priority 0; policy accept; }}\n\
         flush chain inet {TABLE} out\n\
         add rule inet {TABLE} out ip daddr {GUARDED} counter name {COUNTER} drop\n"
    )
}

/// Puts the route and the tripwire in place in the host's network namespace, once per process
/// (both are idempotent across processes). Needs root (`CAP_NET_ADMIN`); the caller decides
/// what a failure means ([`crate::guard::require`]).
pub fn guard() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| install(None).map_err(|e| e.to_string()))
        .clone()
}

/// Puts the route and the tripwire in place in network namespace `netns` (a name under
/// `/var/run/netns`), or the caller's when `None`.
pub fn install(netns: Option<&str>) -> Result<(), Error> {
    blackhole(netns)?;
    tripwire(netns)
}

/// The `blackhole` route for [`GUARDED`] in `netns` (the caller's when `None`).
pub fn blackhole(netns: Option<&str>) -> Result<(), Error> {
    run(
        netns,
        "ip",
        &["route", "replace", "blackhole", GUARDED],
        None,
    )
    .map(drop)
}

/// The tripwire ([`tripwire_script`]) in `netns` (the caller's when `None`).
pub fn tripwire(netns: Option<&str>) -> Result<(), Error> {
    run(netns, "nft", &["-f", "-"], Some(&tripwire_script())).map(drop)
}

/// How many packets to [`GUARDED`] got past routing in `netns` (the caller's when `None`)
/// since the tripwire was first loaded there: packets that would have left the machine.
pub fn leaked(netns: Option<&str>) -> Result<u64, Error> {
    let out = run(
        netns,
        "nft",
        &["-j", "list", "counter", "inet", TABLE, COUNTER],
        None,
    )?;
    packets(&String::from_utf8_lossy(&out.stdout)).map_err(Error::Counter)
}

/// The `packets` of the one counter in `nft -j list counter` output.
fn packets(json: &str) -> Result<u64, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    v.get("nftables")
        .and_then(|a| a.as_array())
        .into_iter()
        .flatten()
        .find_map(|item| item.get("counter")?.get("packets")?.as_u64())
        .ok_or_else(|| format!("no counter in {json:?}"))
}

/// Runs `prog args` (inside `netns` through `ip netns exec` when given), with `stdin` fed.
fn run(
    netns: Option<&str>,
    prog: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<Output, Error> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, prog]);
            c
        }
        None => Command::new(prog),
    };
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let what = format!("{prog} {}", args.join(" "));
    let spawn = |source| Error::Spawn {
        what: what.clone(),
        source,
    };
    let mut child = cmd.spawn().map_err(spawn)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        use std::io::Write;
        pipe.write_all(text.as_bytes()).map_err(spawn)?;
    }
    let out = child.wait_with_output().map_err(spawn)?;
    if !out.status.success() {
        return Err(Error::Failed {
            what,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_service_range_and_the_apiservers_address_are_inside_the_guarded_range() {
        let inside = |a: &str| {
            let ip: std::net::Ipv4Addr = a.split('/').next().unwrap().parse().unwrap();
            (u32::from(ip) >> 17) == (u32::from(std::net::Ipv4Addr::new(198, 18, 0, 0)) >> 17)
        };
        assert!(inside(SERVICE_RANGE));
        assert!(inside(KUBERNETES_SERVICE_IP));
        assert!(GUARDED.ends_with("/15"));
    }

    #[test]
    fn the_tripwire_counts_and_drops_in_postrouting_and_keeps_its_counter_on_reload() {
        let s = tripwire_script();
        assert!(s.contains("hook postrouting"), "{s}");
        assert!(
            s.contains(&format!("ip daddr {GUARDED} counter name {COUNTER} drop")),
            "{s}"
        );
        // Reloading flushes the chain's rules (no duplicates) but re-adds the counter with
        // `add`, which keeps an existing counter's value.
        assert!(s.contains("flush chain"), "{s}");
        assert!(!s.contains("flush table") && !s.contains("reset"), "{s}");
    }

    #[test]
    fn scripts_egress_check_loads_the_same_tripwire() {
        let script = include_str!("../../../scripts/egress-check");
        for line in tripwire_script().lines() {
            let line = line
                .replace(TABLE, "$table")
                .replace(COUNTER, "$counter")
                .replace(GUARDED, "$guarded");
            assert!(
                script.contains(&line),
                "scripts/egress-check lacks {line:?}"
            );
        }
        assert!(script.contains(&format!(
            "table={TABLE}\ncounter={COUNTER}\nguarded={GUARDED}"
        )));
    }

    #[test]
    fn packets_are_read_from_nfts_json() {
        let j = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"counter": {"family": "inet", "name": "leaked", "table": "imp_testenv_egress", "handle": 2, "packets": 3, "bytes": 180}}]}"#;
        assert_eq!(packets(j), Ok(3));
        assert!(packets(r#"{"nftables": []}"#).is_err());
        assert!(packets("not json").is_err());
    }
}
