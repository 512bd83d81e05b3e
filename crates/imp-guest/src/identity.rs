//! A clone taking its own identity ([`imp_proto::Message::Reidentify`]): a guest restored from
//! a snapshot that other VMs share wakes up as its source, with the source's generator
//! state, clock, hostname, MAC, address and TCP connections. This makes it a machine of its
//! own, in an order chosen so nothing of the source's identity leaves it:
//!
//! 1. the host's bytes are mixed into the entropy pool and credited, and the CRNG reseeded
//!    at once, so every random number after this differs from the other clones';
//! 2. the clock is set;
//! 3. with a new network: the interface goes down (its routes and neighbours go with it),
//!    then the TCP connections on the source's address are destroyed — with the link down,
//!    so the resets the kernel sends for them go nowhere and the source's peers keep their
//!    connections to the source — then the new MAC, the old addresses removed, the new
//!    address, netmask and default route, and the interface up (announcing the address);
//! 4. the hostname, then /etc/hosts' own entry and /etc/resolv.conf, which the init writes
//!    at boot from the same values.
//!
//! A step that fails is reported and the others still run, except that connections are not
//! destroyed while the link is up. The side effects go through [`System`], so the order and
//! the report are tested without a VM.

use crate::entropy::{self, Reseed};
use crate::net;
use crate::sockdiag::{self, DiagError};
use crate::system;
use imp_proto::config::NetworkConfig;
use imp_proto::message::{Identity, ReidentifyReport, Step, StepStatus, parse_mac, steps};
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

/// The system calls a reidentification makes; errors are their full text for the report.
pub trait System {
    /// Mixes bytes into the entropy pool, crediting them; returns the bits credited.
    fn add_entropy(&mut self, bytes: &[u8]) -> Result<u32, String>;
    /// Reseeds the CRNG from the pool.
    fn reseed_crng(&mut self) -> Result<Reseed, String>;
    /// Sets the wall clock.
    fn set_clock(&mut self, unix_nanos: u64) -> Result<(), String>;
    /// The interface's IPv4 address.
    fn address_of(&mut self, interface: &str) -> Result<Option<Ipv4Addr>, String>;
    /// Takes the interface down.
    fn link_down(&mut self, interface: &str) -> Result<(), String>;
    /// Destroys the connected TCP sockets on an address.
    fn close_connections(&mut self, local: Ipv4Addr) -> Result<sockdiag::Closed, DiagError>;
    /// Counts the connected TCP sockets on an address.
    fn count_connections(&mut self, local: Ipv4Addr) -> Result<usize, String>;
    /// Gives the interface a new MAC.
    fn set_mac(&mut self, interface: &str, mac: [u8; 6]) -> Result<(), String>;
    /// Removes the interface's IPv4 addresses; returns them.
    fn remove_addresses(&mut self, interface: &str) -> Result<Vec<Ipv4Addr>, String>;
    /// Sets address, netmask, MTU and default route and brings the interface up.
    fn configure(&mut self, network: &NetworkConfig) -> Result<(), String>;
    /// The kernel hostname.
    fn hostname(&mut self) -> Option<String>;
    /// Sets the kernel hostname.
    fn set_hostname(&mut self, name: &str) -> Result<(), String>;
    /// A file's contents; `None` when it does not exist.
    fn read_file(&mut self, path: &str) -> Result<Option<String>, String>;
    /// Replaces a file.
    fn write_file(&mut self, path: &str, contents: &str) -> Result<(), String>;
}

/// An error and its sources, on one line.
pub(crate) fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// The guest's own kernel and files.
#[derive(Debug, Default)]
pub struct Live;

impl System for Live {
    fn add_entropy(&mut self, bytes: &[u8]) -> Result<u32, String> {
        entropy::add(bytes).map_err(|e| format!("RNDADDENTROPY on /dev/urandom: {e}"))
    }

    fn reseed_crng(&mut self) -> Result<Reseed, String> {
        entropy::reseed().map_err(|e| format!("RNDRESEEDCRNG on /dev/urandom: {e}"))
    }

    fn set_clock(&mut self, unix_nanos: u64) -> Result<(), String> {
        system::set_clock(unix_nanos).map_err(|e| chain(&e))
    }

    fn address_of(&mut self, interface: &str) -> Result<Option<Ipv4Addr>, String> {
        net::address_of(interface).map_err(|e| chain(&e))
    }

    fn link_down(&mut self, interface: &str) -> Result<(), String> {
        net::bring_down(interface).map_err(|e| chain(&e))
    }

    fn close_connections(&mut self, local: Ipv4Addr) -> Result<sockdiag::Closed, DiagError> {
        sockdiag::close_tcp(local)
    }

    fn count_connections(&mut self, local: Ipv4Addr) -> Result<usize, String> {
        sockdiag::count_open(local).map_err(|e| format!("reading /proc/net/tcp: {e}"))
    }

    fn set_mac(&mut self, interface: &str, mac: [u8; 6]) -> Result<(), String> {
        net::set_mac(interface, mac).map_err(|e| chain(&e))
    }

    fn remove_addresses(&mut self, interface: &str) -> Result<Vec<Ipv4Addr>, String> {
        net::remove_addresses(interface).map_err(|e| chain(&e))
    }

    fn configure(&mut self, network: &NetworkConfig) -> Result<(), String> {
        net::configure(network).map_err(|e| chain(&e))
    }

    fn hostname(&mut self) -> Option<String> {
        system::hostname()
    }

    fn set_hostname(&mut self, name: &str) -> Result<(), String> {
        system::set_hostname(name).map_err(|e| chain(&e))
    }

    fn read_file(&mut self, path: &str) -> Result<Option<String>, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("reading {path}: {e}")),
        }
    }

    fn write_file(&mut self, path: &str, contents: &str) -> Result<(), String> {
        system::write_file(Path::new(path), contents).map_err(|e| chain(&e))
    }
}

/// The report being written.
#[derive(Default)]
struct Report(Vec<Step>);

impl Report {
    fn push(&mut self, name: &str, status: StepStatus, detail: impl Into<String>) {
        self.0.push(Step {
            name: name.to_string(),
            status,
            detail: detail.into(),
        });
    }

    fn done(&mut self, name: &str, detail: impl Into<String>) {
        self.push(name, StepStatus::Done, detail);
    }

    fn skipped(&mut self, name: &str, reason: impl Into<String>) {
        self.push(name, StepStatus::Skipped, reason);
    }

    fn failed(&mut self, name: &str, error: impl Into<String>) {
        self.push(name, StepStatus::Failed, error);
    }

    fn outcome<T>(
        &mut self,
        name: &str,
        result: Result<T, String>,
        done: impl FnOnce(T) -> String,
    ) {
        match result {
            Ok(v) => self.done(name, done(v)),
            Err(e) => self.failed(name, e),
        }
    }
}

/// One reidentification at a time: two at once would interleave their link changes.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Makes this guest the machine `identity` describes; `entropy` and `identity` are checked by
/// the caller ([`imp_proto::Entropy::validate`], [`Identity::validate`]).
pub fn reidentify(
    sys: &mut impl System,
    identity: &Identity,
    entropy: &[u8],
    unix_nanos: u64,
) -> ReidentifyReport {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let mut report = Report::default();

    entropy_steps(sys, &mut report, entropy);
    let clock = sys.set_clock(unix_nanos);
    report.outcome(steps::CLOCK, clock, |()| {
        format!("set to {unix_nanos} ns since the epoch")
    });

    let old_hostname = sys.hostname();
    let addresses = address_steps(sys, &mut report, identity);
    let new_hostname = hostname_step(sys, &mut report, identity, old_hostname.as_ref());

    // The init writes /etc/hosts at boot when it has a hostname or a network, and
    // /etc/resolv.conf when the network names servers; the same rules apply here.
    if identity.hostname.is_some() || identity.network.is_some() {
        let hostnames = Renamed {
            old: old_hostname.as_deref(),
            new: new_hostname.as_deref(),
        };
        hosts_step(sys, &mut report, hostnames, addresses);
    }
    if let Some(network) = identity.network.as_ref().filter(|n| !n.dns.is_empty()) {
        let written = sys.write_file("/etc/resolv.conf", &net::resolv_conf(network));
        report.outcome(steps::RESOLV_CONF, written, |()| {
            format!("{} name servers", network.dns.len())
        });
    }
    ReidentifyReport { steps: report.0 }
}

/// A value before and after the reidentification.
#[derive(Debug, Clone, Copy)]
struct Renamed<T> {
    old: Option<T>,
    new: Option<T>,
}

/// Mixes the host's bytes into the pool, crediting them, then reseeds the CRNG at once.
fn entropy_steps(sys: &mut impl System, report: &mut Report, entropy: &[u8]) {
    let added = sys.add_entropy(entropy);
    let credited = added.is_ok();
    report.outcome(steps::ENTROPY, added, |bits| {
        format!(
            "{} bytes mixed into the input pool, {bits} bits credited",
            entropy.len()
        )
    });
    match sys.reseed_crng() {
        Ok(Reseed::Done) => report.done(steps::CRNG, "reseeded from the input pool"),
        Ok(Reseed::Unsupported(e)) => {
            log(&format!("RNDRESEEDCRNG is not supported ({e}); the CRNG reseeds on its own schedule"));
            report.skipped(
                steps::CRNG,
                format!(
                    "the kernel has no RNDRESEEDCRNG ({e}): the CRNG takes the new entropy at its \
                     next scheduled reseed (within a minute); until then this guest's random \
                     numbers repeat the other clones'"
                ),
            );
        }
        Ok(Reseed::NotReady) => report.skipped(
            steps::CRNG,
            "the CRNG is not initialized yet: it seeds from the pool when it is",
        ),
        Err(e) if !credited => report.failed(
            steps::CRNG,
            format!("{e}; and nothing was credited, so this guest's random numbers may repeat its source's"),
        ),
        Err(e) => report.failed(steps::CRNG, e),
    }
}

/// The network steps when a network is asked for, else a skipped step; returns the guest's
/// address before and after.
fn address_steps(
    sys: &mut impl System,
    report: &mut Report,
    identity: &Identity,
) -> Renamed<Ipv4Addr> {
    match &identity.network {
        Some(network) => Renamed {
            old: network_steps(sys, report, identity, network),
            new: Some(network.address),
        },
        None => {
            let old = sys.address_of("eth0").ok().flatten();
            report.skipped(
                steps::NETWORK,
                "no network asked for: the interface, its addresses and its TCP connections \
                 are unchanged",
            );
            Renamed { old, new: old }
        }
    }
}

/// Sets the hostname asked for; returns the guest's hostname afterwards (the old one when
/// none was asked for or setting it failed).
fn hostname_step(
    sys: &mut impl System,
    report: &mut Report,
    identity: &Identity,
    old_hostname: Option<&String>,
) -> Option<String> {
    match &identity.hostname {
        Some(name) => {
            let set = sys.set_hostname(name);
            let ok = set.is_ok();
            report.outcome(steps::HOSTNAME, set, |()| name.to_string());
            ok.then(|| name.clone()).or_else(|| old_hostname.cloned())
        }
        None => {
            report.skipped(steps::HOSTNAME, "no hostname asked for");
            old_hostname.cloned()
        }
    }
}

/// Rewrites /etc/hosts' own entry from the old hostname and address to the new ones (a new
/// file when there is none); skipped when the guest has no hostname.
fn hosts_step(
    sys: &mut impl System,
    report: &mut Report,
    hostnames: Renamed<&str>,
    addresses: Renamed<Ipv4Addr>,
) {
    let Some(name) = hostnames.new else {
        report.skipped(steps::HOSTS, "the guest has no hostname to enter");
        return;
    };
    let hosts = match sys.read_file("/etc/hosts") {
        Ok(Some(current)) => Ok(net::hosts_with_own_entry(
            &current,
            hostnames.old,
            addresses.old,
            name,
            addresses.new,
        )),
        Ok(None) => Ok(net::hosts(Some(name), addresses.new)),
        Err(e) => Err(e),
    };
    let written = hosts.and_then(|h| sys.write_file("/etc/hosts", &h));
    let entry = match addresses.new {
        Some(a) => format!("{a} {name}"),
        None => format!("127.0.1.1 {name}"),
    };
    report.outcome(steps::HOSTS, written, |()| format!("own entry is {entry}"));
}

/// Link down, connections, MAC, addresses, new network; returns the source's address.
fn network_steps(
    sys: &mut impl System,
    report: &mut Report,
    identity: &Identity,
    network: &NetworkConfig,
) -> Option<Ipv4Addr> {
    let interface = network.interface.as_str();
    let old_address = match sys.address_of(interface) {
        Ok(a) => a,
        Err(e) => {
            log(&format!("reading {interface}'s address failed: {e}"));
            None
        }
    };
    let down = sys.link_down(interface);
    let is_down = down.is_ok();
    report.outcome(steps::LINK_DOWN, down, |()| format!("{interface} down"));
    connections_step(sys, report, interface, old_address, is_down);
    mac_step(sys, report, interface, identity.mac.as_deref());

    let removed = sys.remove_addresses(interface);
    report.outcome(steps::ADDRESSES, removed, |gone| {
        let list: Vec<String> = gone.iter().map(Ipv4Addr::to_string).collect();
        format!("removed [{}] from {interface}", list.join(", "))
    });

    let configured = sys.configure(network);
    report.outcome(steps::NETWORK, configured, |()| {
        let via = network
            .gateway
            .map(|g| format!(" via {g}"))
            .unwrap_or_default();
        format!(
            "{interface} up as {}/{}{via}",
            network.address, network.prefix_len
        )
    });
    old_address
}

/// Destroys the TCP connections on the source's address, only while the link is down.
fn connections_step(
    sys: &mut impl System,
    report: &mut Report,
    interface: &str,
    old_address: Option<Ipv4Addr>,
    is_down: bool,
) {
    match old_address {
        None => report.skipped(
            steps::CONNECTIONS,
            format!("{interface} had no IPv4 address, so no connection of the source's"),
        ),
        Some(old) if !is_down => {
            let left = describe_left(sys, old);
            report.skipped(
                steps::CONNECTIONS,
                format!(
                    "not destroyed because {interface} could not be taken down: the resets would \
                     reach the source's peers and end the source's own connections; {left}"
                ),
            );
        }
        Some(old) => match sys.close_connections(old) {
            Ok(c) if c.gone == 0 => report.done(
                steps::CONNECTIONS,
                format!(
                    "{} TCP connections on {old} destroyed while {interface} was down",
                    c.closed
                ),
            ),
            Ok(c) => report.done(
                steps::CONNECTIONS,
                format!(
                    "{} TCP connections on {old} ended while {interface} was down: {} destroyed, \
                     {} closed before their turn (the other end of a connection inside the \
                     guest, reset by its destroyed peer)",
                    c.closed + c.gone,
                    c.closed,
                    c.gone
                ),
            ),
            Err(e) => {
                let left = describe_left(sys, old);
                report.failed(steps::CONNECTIONS, format!("{}; {left}", chain(&e)));
            }
        },
    }
}

/// Gives the interface the MAC asked for.
fn mac_step(sys: &mut impl System, report: &mut Report, interface: &str, mac: Option<&str>) {
    match mac {
        Some(text) => match parse_mac(text) {
            Some(mac) => {
                let set = sys.set_mac(interface, mac);
                report.outcome(steps::MAC, set, |()| format!("{interface} is {text}"));
            }
            None => report.failed(steps::MAC, format!("{text:?} is not a MAC")),
        },
        None => report.skipped(steps::MAC, "no MAC asked for"),
    }
}

/// What happens to connections on `old` that are not destroyed.
fn describe_left(sys: &mut impl System, old: Ipv4Addr) -> String {
    let count = match sys.count_connections(old) {
        Ok(n) => n.to_string(),
        Err(e) => format!("an unknown number of ({e})"),
    };
    format!(
        "{count} TCP connections on {old} remain: once {old} is gone they can send nothing \
         (no route from an address the guest no longer has), receive nothing (the network \
         delivers {old} to the source), and end when their retransmissions time out \
         (net.ipv4.tcp_retries2, about 15 minutes) or, if idle, when their program gives up"
    )
}

fn log(message: &str) {
    eprintln!("imp-guest: reidentify: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records every call; fails the ones named in `fail`.
    #[derive(Default)]
    struct Fake {
        calls: Vec<String>,
        fail: Vec<&'static str>,
        reseed: Option<fn() -> Reseed>,
        address: Option<Ipv4Addr>,
        hostname: Option<String>,
        files: std::collections::BTreeMap<String, String>,
        diag: Option<fn() -> DiagError>,
    }

    impl Fake {
        fn call(&mut self, name: &'static str, arg: String) -> Result<(), String> {
            self.calls.push(format!("{name}({arg})"));
            if self.fail.contains(&name) {
                Err(format!("{name} refused"))
            } else {
                Ok(())
            }
        }
    }

    impl System for Fake {
        fn add_entropy(&mut self, bytes: &[u8]) -> Result<u32, String> {
            self.call("add_entropy", bytes.len().to_string())?;
            Ok(bytes.len() as u32 * 8)
        }
        fn reseed_crng(&mut self) -> Result<Reseed, String> {
            self.call("reseed_crng", String::new())?;
            Ok(self.reseed.map_or(Reseed::Done, |r| r()))
        }
        fn set_clock(&mut self, unix_nanos: u64) -> Result<(), String> {
            self.call("set_clock", unix_nanos.to_string())
        }
        fn address_of(&mut self, interface: &str) -> Result<Option<Ipv4Addr>, String> {
            self.call("address_of", interface.into())?;
            Ok(self.address)
        }
        fn link_down(&mut self, interface: &str) -> Result<(), String> {
            self.call("link_down", interface.into())
        }
        fn close_connections(&mut self, local: Ipv4Addr) -> Result<sockdiag::Closed, DiagError> {
            self.calls.push(format!("close_connections({local})"));
            match self.diag {
                Some(e) => Err(e()),
                None => Ok(sockdiag::Closed { closed: 2, gone: 1 }),
            }
        }
        fn count_connections(&mut self, local: Ipv4Addr) -> Result<usize, String> {
            self.call("count_connections", local.to_string())?;
            Ok(3)
        }
        fn set_mac(&mut self, interface: &str, mac: [u8; 6]) -> Result<(), String> {
            self.call("set_mac", format!("{interface} {mac:02x?}"))
        }
        fn remove_addresses(&mut self, interface: &str) -> Result<Vec<Ipv4Addr>, String> {
            self.call("remove_addresses", interface.into())?;
            Ok(self.address.take().into_iter().collect())
        }
        fn configure(&mut self, network: &NetworkConfig) -> Result<(), String> {
            self.call(
                "configure",
                format!("{}/{}", network.address, network.prefix_len),
            )
        }
        fn hostname(&mut self) -> Option<String> {
            self.hostname.clone()
        }
        fn set_hostname(&mut self, name: &str) -> Result<(), String> {
            self.call("set_hostname", name.into())?;
            self.hostname = Some(name.into());
            Ok(())
        }
        fn read_file(&mut self, path: &str) -> Result<Option<String>, String> {
            Ok(self.files.get(path).cloned())
        }
        fn write_file(&mut self, path: &str, contents: &str) -> Result<(), String> {
            self.call("write_file", path.into())?;
            self.files.insert(path.into(), contents.into());
            Ok(())
        }
    }

    const OLD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 5);
    const NEW: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 7);

    fn source() -> Fake {
        let mut fake = Fake {
            address: Some(OLD),
            hostname: Some("source".into()),
            ..Fake::default()
        };
        fake.files
            .insert("/etc/hosts".into(), net::hosts(Some("source"), Some(OLD)));
        fake
    }

    fn clone_identity() -> Identity {
        Identity {
            hostname: Some("clone-1".into()),
            mac: Some("02:00:0a:00:00:07".into()),
            network: Some(NetworkConfig {
                interface: "eth0".into(),
                address: NEW,
                prefix_len: 24,
                gateway: Some(Ipv4Addr::new(10, 0, 0, 1)),
                dns: vec!["10.0.0.1".parse().unwrap()],
                search: vec![],
                mtu: None,
            }),
        }
    }

    fn statuses(report: &ReidentifyReport) -> Vec<(String, StepStatus)> {
        report
            .steps
            .iter()
            .map(|s| (s.name.clone(), s.status))
            .collect()
    }

    #[test]
    fn a_clone_reseeds_first_and_destroys_connections_only_with_its_link_down() {
        let mut sys = source();
        let report = reidentify(&mut sys, &clone_identity(), &[7; 64], 42);
        assert_eq!(
            sys.calls,
            [
                "add_entropy(64)",
                "reseed_crng()",
                "set_clock(42)",
                "address_of(eth0)",
                "link_down(eth0)",
                "close_connections(10.0.0.5)",
                "set_mac(eth0 [02, 00, 0a, 00, 00, 07])",
                "remove_addresses(eth0)",
                "configure(10.0.0.7/24)",
                "set_hostname(clone-1)",
                "write_file(/etc/hosts)",
                "write_file(/etc/resolv.conf)",
            ]
        );
        assert!(report.is_complete(), "{report}");
        let done = |name: &str| report.step(name).map(|s| s.detail.as_str());
        assert_eq!(
            done(steps::ENTROPY),
            Some("64 bytes mixed into the input pool, 512 bits credited")
        );
        assert_eq!(
            done(steps::CONNECTIONS).map(|d| d.split(':').next()),
            Some(Some(
                "3 TCP connections on 10.0.0.5 ended while eth0 was down"
            ))
        );
        assert_eq!(done(steps::ADDRESSES), Some("removed [10.0.0.5] from eth0"));
        assert_eq!(
            done(steps::NETWORK),
            Some("eth0 up as 10.0.0.7/24 via 10.0.0.1")
        );
        assert_eq!(
            sys.files["/etc/hosts"],
            net::hosts(Some("clone-1"), Some(NEW)),
            "the boot's own entry is replaced"
        );
        assert_eq!(sys.files["/etc/resolv.conf"], "nameserver 10.0.0.1\n");
    }

    #[test]
    fn connections_stay_when_the_link_cannot_go_down_and_the_report_says_what_becomes_of_them() {
        let mut sys = source();
        sys.fail = vec!["link_down"];
        let report = reidentify(&mut sys, &clone_identity(), &[7; 64], 42);
        assert!(!sys.calls.iter().any(|c| c.starts_with("close_connections")));
        let step = report.step(steps::CONNECTIONS).unwrap();
        assert_eq!(step.status, StepStatus::Skipped);
        assert!(
            step.detail.contains("could not be taken down"),
            "{}",
            step.detail
        );
        assert!(
            step.detail.contains("3 TCP connections on 10.0.0.5 remain"),
            "{}",
            step.detail
        );
        // The rest of the identity is still taken.
        assert_eq!(
            report.step(steps::NETWORK).map(|s| s.status),
            Some(StepStatus::Done)
        );
        assert_eq!(
            report.failed().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["link_down"]
        );
    }

    #[test]
    fn a_kernel_that_cannot_destroy_sockets_is_reported_with_the_count_left() {
        for (diag, want) in [
            (
                (|| DiagError::Unavailable) as fn() -> DiagError,
                "tcp_diag module is not loaded",
            ),
            (|| DiagError::NoDestroy, "CONFIG_INET_DIAG_DESTROY"),
        ] {
            let mut sys = source();
            sys.diag = Some(diag);
            let report = reidentify(&mut sys, &clone_identity(), &[7; 64], 42);
            let step = report.step(steps::CONNECTIONS).unwrap();
            assert_eq!(step.status, StepStatus::Failed);
            assert!(step.detail.contains(want), "{}", step.detail);
            assert!(step.detail.contains("3 TCP connections on 10.0.0.5 remain"));
            assert!(step.detail.contains("tcp_retries2"));
            assert!(sys.calls.contains(&"configure(10.0.0.7/24)".to_string()));
        }
    }

    #[test]
    fn a_kernel_without_reseed_or_mac_change_still_gets_the_rest() {
        let mut sys = source();
        sys.reseed = Some(|| Reseed::Unsupported(std::io::Error::from_raw_os_error(libc::ENOTTY)));
        sys.fail = vec!["set_mac"];
        let report = reidentify(&mut sys, &clone_identity(), &[7; 64], 42);
        assert_eq!(
            statuses(&report),
            [
                ("entropy".into(), StepStatus::Done),
                ("crng".into(), StepStatus::Skipped),
                ("clock".into(), StepStatus::Done),
                ("link_down".into(), StepStatus::Done),
                ("connections".into(), StepStatus::Done),
                ("mac".into(), StepStatus::Failed),
                ("addresses".into(), StepStatus::Done),
                ("network".into(), StepStatus::Done),
                ("hostname".into(), StepStatus::Done),
                ("hosts".into(), StepStatus::Done),
                ("resolv_conf".into(), StepStatus::Done),
            ]
        );
        assert!(
            report
                .step(steps::CRNG)
                .unwrap()
                .detail
                .contains("next scheduled reseed"),
            "{report}"
        );
    }

    #[test]
    fn without_a_network_only_entropy_clock_and_names_change() {
        let mut sys = source();
        let identity = Identity {
            hostname: Some("renamed".into()),
            ..Identity::default()
        };
        let report = reidentify(&mut sys, &identity, &[1; 64], 9);
        assert!(!sys.calls.iter().any(|c| c.starts_with("link_down")
            || c.starts_with("close_connections")
            || c.starts_with("configure")));
        assert_eq!(
            report.step(steps::NETWORK).map(|s| s.status),
            Some(StepStatus::Skipped)
        );
        assert_eq!(
            sys.files["/etc/hosts"],
            net::hosts(Some("renamed"), Some(OLD))
        );
        assert!(report.step(steps::RESOLV_CONF).is_none());
        // Nothing but the generator and the clock: no files, no hostname.
        let mut sys = source();
        let report = reidentify(&mut sys, &Identity::default(), &[1; 64], 9);
        assert!(report.step(steps::HOSTS).is_none());
        assert!(!sys.calls.iter().any(|c| c.starts_with("write_file")));
        assert!(report.is_complete());
    }

    #[test]
    fn failed_entropy_is_said_loudly() {
        let mut sys = source();
        sys.fail = vec!["add_entropy", "reseed_crng"];
        let report = reidentify(&mut sys, &Identity::default(), &[1; 64], 9);
        let crng = report.step(steps::CRNG).unwrap();
        assert_eq!(crng.status, StepStatus::Failed);
        assert!(
            crng.detail.contains("may repeat its source's"),
            "{}",
            crng.detail
        );
        assert_eq!(report.failed().count(), 2);
    }
}
