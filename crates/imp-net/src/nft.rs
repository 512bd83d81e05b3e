//! The node's packet filter and NAT for imp's networks: two nftables tables owned by imp
//! (`inet imp` and `bridge imp`), rendered whole from the plan and swapped in one `nft -f`
//! transaction, so a rule set is never half applied and nothing outside the tables is touched.
//!
//! What the rules say, per network on the node (bridge B, subnet S):
//! - **input** from B: only replies and ICMP reach the node; a guest cannot open connections
//!   to the node's services (the agent's API, metrics, anything bound to 0.0.0.0).
//! - **forward** (routed through the gateway): B to B is allowed (group rules first); B to
//!   another imp bridge is dropped (networks are isolated); B to the NAT egress interface is
//!   allowed when NAT is on, otherwise nothing leaves; toward B only replies are forwarded.
//! - **postrouting**: S masquerades out of the egress interface when NAT is on.
//! - **egress**, a chain per network jumped to from prerouting (after conntrack, before
//!   kube-proxy's DNAT, so a Service address is seen as the guest sent it) and from forward
//!   (after DNAT, so its endpoint is checked too): a new connection from B to anything outside
//!   S is dropped when it is VXLAN, or its destination is never reachable
//!   ([`super::plan::NodeView::egress_never`]: link-local, the node's networks, the API
//!   server) or denied by `--egress-deny` and not allowed by the network
//!   (`spec.egress.allow`); DNS to the guests' name servers passes; counted in
//!   [`EGRESS_DENIED`].
//! - **bridge forward** (switched inside B between its ports, the VMs' TAPs and the VXLAN
//!   device, so also between nodes): a group with `connectivity: subnet` exchanges IPv4 and
//!   ARP only with itself. (Ports are matched by name: `meta ibrname` is not available on
//!   every kernel.)
//! - **bridge prerouting** (every frame a VM's TAP puts on the bridge, before the bridge learns
//!   its source or the node sees it; so also a sleeping VM's holder): the source MAC must be
//!   the VM's, ARP must name the VM's MAC and address as its sender, IPv4 must come from the
//!   VM's address, no DHCP server answers, and nothing but IPv4 and ARP passes (imp has no
//!   IPv6, so router advertisements and DHCPv6 go too). Each port has its own chain, reached
//!   through one verdict map, and a named counter per reason ([`PortDrop`]).
//! - **input**, VXLAN: a packet for one of the node's networks (its VNI, at the UDP port) is
//!   dropped unless it comes from a node holding VMs of that network (the VTEP table), counted
//!   in [`VXLAN_FOREIGN`].

use std::fmt::Write;

use super::names::{BadName, check_interface};
use super::plan::{NetPlan, Port, fold_nested};
use imp_api::ipv4::Ipv4Cidr;

/// The tables' name (in the `inet` and `bridge` families).
pub const TABLE: &str = "imp";

/// The counter (in `inet imp`) of VXLAN packets dropped because their sender is no VTEP of
/// their network.
pub const VXLAN_FOREIGN: &str = "vxlan-foreign";

/// The counter (in `inet imp`) of guests' packets to destinations they may not reach.
pub const EGRESS_DENIED: &str = "egress-denied";

/// Why a VM's port dropped a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, strum::VariantArray)]
pub enum PortDrop {
    /// Its source MAC is not the VM's.
    Mac,
    /// ARP whose sender MAC or address is not the VM's.
    Arp,
    /// IPv4 whose source is not the VM's address.
    Ip,
    /// A DHCP server's answer (UDP from port 67).
    DhcpServer,
    /// Neither IPv4 nor ARP (IPv6 with its router advertisements, VLAN tags, anything else).
    NotIpv4,
}

impl PortDrop {
    /// Every reason.
    pub const ALL: &'static [Self] = <Self as strum::VariantArray>::VARIANTS;

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            PortDrop::Mac => "mac",
            PortDrop::Arp => "arp",
            PortDrop::Ip => "ip",
            PortDrop::DhcpServer => "dhcp_server",
            PortDrop::NotIpv4 => "not_ipv4",
        }
    }

    /// The name of `tap`'s counter for this reason.
    pub fn counter(self, tap: &str) -> String {
        let suffix = match self {
            PortDrop::Mac => "mac",
            PortDrop::Arp => "arp",
            PortDrop::Ip => "ip",
            PortDrop::DhcpServer => "dhcp",
            PortDrop::NotIpv4 => "other",
        };
        format!("{tap}-{suffix}")
    }

    /// The TAP and reason a counter's name stands for.
    pub fn parse_counter(name: &str) -> Option<(&str, PortDrop)> {
        PortDrop::ALL.iter().copied().find_map(|d| {
            let tap = name.strip_suffix(d.counter("").as_str())?;
            super::names::is_imp(tap).then_some((tap, d))
        })
    }
}

/// A name that cannot be written into imp's rules: the whole script is refused, so nothing of
/// it reaches `nft`.
#[derive(Debug, thiserror::Error)]
#[error("ImpNetwork {network}: {field} {name:?} cannot go into imp's nftables rules")]
pub struct ScriptError {
    /// The network (`namespace/name`) whose plan holds the name.
    pub network: String,
    /// What the name is (`spec.nat.egressInterface`, `bridge`, …).
    pub field: &'static str,
    /// The name.
    pub name: String,
    /// What is wrong with it.
    #[source]
    pub source: BadName,
}

/// Checks every name `n` puts into the script (interface names, in quotes, and the chain and
/// counter names built from them): text is never escaped, it is refused.
fn check_names(n: &NetPlan) -> Result<(), ScriptError> {
    let refuse = |field: &'static str, name: &str| {
        check_interface(name).map_err(|source| ScriptError {
            network: n.key.clone(),
            field,
            name: name.to_owned(),
            source,
        })
    };
    refuse("bridge", &n.bridge)?;
    if let Some(vx) = &n.vxlan {
        refuse("VXLAN device", &vx.name)?;
    }
    for tap in n.ports.keys() {
        refuse("TAP", tap)?;
    }
    if let Some(egress) = &n.nat_egress {
        refuse("spec.nat.egressInterface", egress)?;
    }
    Ok(())
}

/// The `nft -f` script that makes the tables match `networks` (removes them when empty), or
/// the first name in them that cannot be written into it ([`check_names`]). Everything else
/// it writes is typed (addresses, CIDRs, MACs, numbers) or imp's own constants.
pub fn script(networks: &[NetPlan]) -> Result<String, ScriptError> {
    for n in networks {
        check_names(n)?;
    }
    let mut s = String::new();
    // Creating then deleting makes the delete valid whether or not the table exists; the
    // whole file is one transaction.
    for family in ["inet", "bridge"] {
        let _ = writeln!(s, "table {family} {TABLE}\ndelete table {family} {TABLE}");
    }
    if networks.is_empty() {
        return Ok(s);
    }
    s.push_str(&inet_table(networks));
    s.push_str(&bridge_table(networks));
    Ok(s)
}

fn inet_table(networks: &[NetPlan]) -> String {
    let mut input = String::new();
    let mut forward = String::new();
    let mut nat = String::new();
    let mut counters = String::new();
    let mut jumps = String::new();
    let mut chains = String::new();
    for n in networks {
        input.push_str(&vxlan_senders(n));
        chains.push_str(&egress_chain(n));
        let _ = writeln!(jumps, "    iifname \"{b}\" jump egress-{b}", b = n.bridge);
    }
    if !input.is_empty() {
        let _ = writeln!(counters, "  counter {VXLAN_FOREIGN} {{}}");
    }
    let _ = writeln!(counters, "  counter {EGRESS_DENIED} {{}}");
    let prerouting = format!(
        "{chains}  chain egress {{\n    type filter hook prerouting priority -150; policy accept;\n{jumps}  }}\n"
    );
    // After DNAT too: a Service address becomes its endpoint on the way.
    forward.push_str(&jumps);
    for n in networks {
        let b = &n.bridge;
        let _ = writeln!(
            input,
            "    iifname \"{b}\" ct state established,related accept"
        );
        let _ = writeln!(input, "    iifname \"{b}\" ip protocol icmp accept");
        let _ = writeln!(input, "    iifname \"{b}\" drop");
        for g in &n.isolated_groups {
            let s = n.subnet;
            let _ = writeln!(
                forward,
                "    iifname \"{b}\" oifname \"{b}\" ip saddr {g} ip daddr != {g} drop"
            );
            let _ = writeln!(
                forward,
                "    iifname \"{b}\" oifname \"{b}\" ip saddr {s} ip saddr != {g} ip daddr {g} drop"
            );
        }
        let _ = writeln!(forward, "    iifname \"{b}\" oifname \"{b}\" accept");
        let _ = writeln!(
            forward,
            "    oifname \"{b}\" ct state established,related accept"
        );
        let _ = writeln!(forward, "    oifname \"{b}\" drop");
        if let Some(egress) = &n.nat_egress {
            let _ = writeln!(
                forward,
                "    iifname \"{b}\" oifname \"{egress}\" ip saddr {} accept",
                n.subnet
            );
            let _ = writeln!(
                nat,
                "    ip saddr {s} ip daddr != {s} oifname \"{egress}\" masquerade",
                s = n.subnet
            );
        }
        let _ = writeln!(forward, "    iifname \"{b}\" drop");
    }
    format!(
        "table inet {TABLE} {{\n{counters}  chain input {{\n    type filter hook input priority filter; policy accept;\n{input}  }}\n  \
         chain forward {{\n    type filter hook forward priority filter; policy accept;\n{forward}  }}\n  \
         chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n{nat}  }}\n{prerouting}}}\n"
    )
}

/// The chain that keeps `n`'s guests from the destinations they may not reach, jumped to
/// from prerouting (the address as the guest wrote it, before DNAT) and from forward (after
/// DNAT: a Service's endpoint): what may pass returns, so the caller's rules still apply.
/// Its own subnet and established flows pass; VXLAN to any node is dropped (a guest behind
/// NAT would otherwise speak as its node's VTEP); DNS to its name servers passes; link-local,
/// the node's networks and the API server are dropped whatever the network says; then what
/// `spec.egress.allow` names passes, and `--egress-deny` is dropped.
fn egress_chain(n: &NetPlan) -> String {
    let set = |items: &[Ipv4Cidr]| {
        let items: Vec<String> = items.iter().map(ToString::to_string).collect();
        format!("{{ {} }}", items.join(", "))
    };
    let drop = format!("counter name {EGRESS_DENIED} drop");
    let mut s = format!("  chain egress-{} {{\n", n.bridge);
    let _ = writeln!(s, "    ip daddr {} return", n.subnet);
    let _ = writeln!(s, "    ct state established,related return");
    if let Some(vx) = &n.vxlan {
        let _ = writeln!(s, "    udp dport {} {drop}", vx.port);
    }
    if !n.dns.is_empty() {
        let dns: Vec<String> = n.dns.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            s,
            "    ip daddr {{ {} }} meta l4proto {{ tcp, udp }} th dport 53 return",
            dns.join(", ")
        );
    }
    if !n.egress_never.is_empty() {
        let _ = writeln!(s, "    ip daddr {} {drop}", set(&n.egress_never));
    }
    if !n.egress_deny.is_empty() {
        if !n.egress_allow.is_empty() {
            let _ = writeln!(
                s,
                "    ip daddr {} return",
                set(&fold_nested(&n.egress_allow))
            );
        }
        let _ = writeln!(s, "    ip daddr {} {drop}", set(&n.egress_deny));
    }
    s.push_str("  }\n");
    s
}

/// The rule that drops `n`'s VXLAN packets from senders that hold none of its VMs (the VNI
/// sits 4 bytes into the VXLAN header, after the 8-byte UDP header).
fn vxlan_senders(n: &NetPlan) -> String {
    let Some(vx) = &n.vxlan else {
        return String::new();
    };
    let senders: Vec<String> = n
        .fdb
        .iter()
        .map(|e| e.dst)
        .collect::<std::collections::BTreeSet<_>>()
        .iter()
        .map(ToString::to_string)
        .collect();
    let from = if senders.is_empty() {
        String::new()
    } else {
        format!("ip saddr != {{ {} }} ", senders.join(", "))
    };
    format!(
        "    udp dport {} @th,96,24 {:#x} {from}counter name {VXLAN_FOREIGN} drop\n",
        vx.port, vx.vni
    )
}

fn bridge_table(networks: &[NetPlan]) -> String {
    let mut forward = String::new();
    for n in networks.iter().filter(|n| !n.isolated_groups.is_empty()) {
        // Frames enter a bridge through its ports: the VMs' TAPs and the VXLAN device.
        let ports: Vec<String> = n
            .ports
            .keys()
            .chain(n.vxlan.iter().map(|v| &v.name))
            .map(|p| format!("\"{p}\""))
            .collect();
        let p = format!("{{ {} }}", ports.join(", "));
        let s = n.subnet;
        for g in &n.isolated_groups {
            let _ = writeln!(forward, "    iifname {p} ip saddr {g} ip daddr != {g} drop");
            let _ = writeln!(
                forward,
                "    iifname {p} ip saddr {s} ip saddr != {g} ip daddr {g} drop"
            );
            let _ = writeln!(
                forward,
                "    iifname {p} arp saddr ip {g} arp daddr ip != {g} drop"
            );
            let _ = writeln!(
                forward,
                "    iifname {p} arp saddr ip {s} arp saddr ip != {g} arp daddr ip {g} drop"
            );
        }
    }
    let ports: Vec<(&String, &Port)> = networks.iter().flat_map(|n| &n.ports).collect();
    let mut guards = String::new();
    let mut jumps = Vec::new();
    for (tap, port) in &ports {
        guards.push_str(&port_chain(tap, port));
        jumps.push(format!("\"{tap}\" : jump port-{tap}"));
    }
    let prerouting = if jumps.is_empty() {
        String::new()
    } else {
        format!(
            "  chain prerouting {{\n    type filter hook prerouting priority filter; policy accept;\n    \
             iifname vmap {{ {} }}\n  }}\n",
            jumps.join(", ")
        )
    };
    format!(
        "table bridge {TABLE} {{\n{guards}{prerouting}  chain forward {{\n    type filter hook forward priority filter; policy accept;\n{forward}  }}\n}}\n"
    )
}

/// The counters and the chain that hold VM port `tap` to its VM's MAC and address.
fn port_chain(tap: &str, port: &Port) -> String {
    let mut s = String::new();
    for &d in PortDrop::ALL {
        let _ = writeln!(s, "  counter {} {{}}", d.counter(tap));
    }
    let _ = writeln!(s, "  chain port-{tap} {{");
    let count = |d: PortDrop| format!("counter name {} drop", d.counter(tap));
    let (ip, mac) = (port.ip, port.mac);
    match mac {
        Some(mac) => {
            let _ = writeln!(s, "    ether saddr != {mac} {}", count(PortDrop::Mac));
            let _ = writeln!(
                s,
                "    ether type != {{ ip, arp }} {}",
                count(PortDrop::NotIpv4)
            );
            let _ = writeln!(s, "    arp saddr ether != {mac} {}", count(PortDrop::Arp));
            // 0.0.0.0: an address probe (RFC 5227) asks, it claims nothing.
            let _ = writeln!(
                s,
                "    arp saddr ip != {{ {ip}, 0.0.0.0 }} {}",
                count(PortDrop::Arp)
            );
            let _ = writeln!(s, "    udp sport 67 {}", count(PortDrop::DhcpServer));
            let _ = writeln!(s, "    ip saddr != {ip} {}", count(PortDrop::Ip));
        }
        None => {
            let _ = writeln!(s, "    {}", count(PortDrop::Mac));
        }
    }
    s.push_str("  }\n");
    s
}

/// Why the rules could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// `nft` could not be started (not installed?).
    #[error("Running {program} to load imp's nftables rules (is the nftables package installed?)")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `nft` refused the rules.
    #[error("nft refused imp's rules: {stderr}")]
    Refused {
        /// What nft said.
        stderr: String,
    },
}

/// Loads `script` with `nft -f -` (one transaction).
pub async fn apply(program: &str, script: &str) -> Result<(), NftError> {
    run(program, &["-f", "-"], script).await.map(drop)
}

/// Reads and zeroes every counter of imp's table in `family` (one atomic reset per counter):
/// `(name, packets)`.
pub async fn reset_counters(program: &str, family: &str) -> Result<Vec<(String, u64)>, NftError> {
    let out = run(
        program,
        &["-j", "reset", "counters", "table", family, TABLE],
        "",
    )
    .await?;
    Ok(parse_counters(&out))
}

/// The `(name, packets)` of each counter in `nft -j` output.
pub fn parse_counters(json: &str) -> Vec<(String, u64)> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let items = v["nftables"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    items
        .iter()
        .filter_map(|i| {
            let c = i.get("counter")?;
            Some((c["name"].as_str()?.to_owned(), c["packets"].as_u64()?))
        })
        .collect()
}

/// Runs `program args` with `stdin`; its standard output.
async fn run(program: &str, args: &[&str], stdin: &str) -> Result<String, NftError> {
    use tokio::io::AsyncWriteExt;
    let spawn_err = |source| NftError::Spawn {
        program: program.to_owned(),
        source,
    };
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_err)?;
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin.as_bytes()).await.map_err(spawn_err)?;
    }
    let out = child.wait_with_output().await.map_err(spawn_err)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(NftError::Refused {
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{FdbEntry, Mac, VxlanPlan};
    use std::collections::{BTreeMap, BTreeSet};

    fn net(bridge: &str, subnet: &str, nat: Option<&str>, groups: &[&str]) -> NetPlan {
        let subnet: imp_api::ipv4::Ipv4Cidr = subnet.parse().unwrap();
        NetPlan {
            key: format!("ns/{bridge}"),
            bridge: bridge.into(),
            gateway: subnet.first_host().unwrap(),
            subnet,
            mtu: 1450,
            vxlan: None,
            ports: BTreeMap::new(),
            egress_never: vec![],
            egress_deny: vec![],
            egress_allow: vec![],
            dns: BTreeSet::new(),
            fdb: BTreeSet::new(),
            nat_egress: nat.map(str::to_owned),
            isolated_groups: groups.iter().map(|g| g.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn no_network_removes_both_tables_and_nothing_else() {
        let s = script(&[]).unwrap();
        assert_eq!(
            s,
            "table inet imp\ndelete table inet imp\ntable bridge imp\ndelete table bridge imp\n"
        );
    }

    #[test]
    fn networks_are_isolated_and_nat_is_per_network() {
        let s = script(&[
            net("impbr-a", "10.1.0.0/24", Some("eth0"), &[]),
            net("impbr-b", "10.2.0.0/24", None, &[]),
        ])
        .unwrap();
        assert!(
            s.contains("ip saddr 10.1.0.0/24 ip daddr != 10.1.0.0/24 oifname \"eth0\" masquerade"),
            "{s}"
        );
        assert!(
            !s.contains("ip saddr 10.2.0.0/24 ip daddr != 10.2.0.0/24"),
            "{s}"
        );
        assert!(s.contains("iifname \"impbr-a\" oifname \"eth0\" ip saddr 10.1.0.0/24 accept"));
        // Each bridge ends in a drop, so nothing routes from one network to the other.
        let forward = &s[s.find("chain forward").unwrap()..s.find("chain postrouting").unwrap()];
        let a_accept = forward
            .find("iifname \"impbr-a\" oifname \"eth0\"")
            .unwrap();
        let a_drop = forward.find("    iifname \"impbr-a\" drop\n").unwrap();
        assert!(a_accept < a_drop);
        assert!(s.contains("    iifname \"impbr-b\" drop\n"));
        assert!(s.contains("oifname \"impbr-b\" ct state established,related accept"));
        assert!(s.contains("type nat hook postrouting priority srcnat"));
    }

    #[test]
    fn an_isolated_group_is_fenced_at_the_bridge_and_at_the_gateway() {
        let mut n = net("impbr-a", "10.1.0.0/24", None, &["10.1.0.16/28"]);
        n.ports = [port("imptap-1", 5), port("imptap-2", 6)].into();
        let s = script(&[n]).unwrap();
        let ports = "iifname { \"imptap-1\", \"imptap-2\" }";
        let g = "10.1.0.16/28";
        assert!(
            s.contains(&format!("{ports} ip saddr {g} ip daddr != {g} drop")),
            "{s}"
        );
        assert!(s.contains(&format!(
            "{ports} arp saddr ip {g} arp daddr ip != {g} drop"
        )));
        let group_drop = s
            .find("iifname \"impbr-a\" oifname \"impbr-a\" ip saddr 10.1.0.16/28")
            .unwrap();
        let same_accept = s
            .find("iifname \"impbr-a\" oifname \"impbr-a\" accept")
            .unwrap();
        assert!(
            group_drop < same_accept,
            "group rules come before the same-network accept"
        );
    }

    fn port(tap: &str, host: u8) -> (String, Port) {
        (
            tap.to_owned(),
            Port {
                vm: format!("ns/vm{host}"),
                mac: Some(Mac([2, 0, 0, 0, 0, host])),
                ip: std::net::Ipv4Addr::new(10, 1, 0, host),
            },
        )
    }

    #[test]
    fn each_port_passes_only_its_vms_mac_and_address_and_counts_the_rest() {
        let mut n = net("impbr-a", "10.1.0.0/24", None, &[]);
        n.ports = [port("imptap-00000005", 5), port("imptap-00000006", 6)].into();
        let s = script(&[n]).unwrap();
        let chain = &s[s.find("chain port-imptap-00000005 {").unwrap()..];
        let chain = &chain[..chain.find("  }").unwrap()];
        let c = |why: &str| format!("counter name imptap-00000005-{why} drop");
        for rule in [
            format!("ether saddr != 02:00:00:00:00:05 {}", c("mac")),
            format!("ether type != {{ ip, arp }} {}", c("other")),
            format!("arp saddr ether != 02:00:00:00:00:05 {}", c("arp")),
            format!("arp saddr ip != {{ 10.1.0.5, 0.0.0.0 }} {}", c("arp")),
            format!("udp sport 67 {}", c("dhcp")),
            format!("ip saddr != 10.1.0.5 {}", c("ip")),
        ] {
            assert!(chain.contains(&rule), "{rule} in {chain}");
        }
        // The MAC is checked before anything else, so a forged frame is never learned.
        assert!(chain.find("ether saddr").unwrap() < chain.find("arp saddr").unwrap());
        for &d in PortDrop::ALL {
            assert!(s.contains(&format!(
                "  counter {} {{}}\n",
                d.counter("imptap-00000006")
            )));
        }
        assert!(s.contains(
            "type filter hook prerouting priority filter; policy accept;\n    iifname vmap { \"imptap-00000005\" : jump port-imptap-00000005, \"imptap-00000006\" : jump port-imptap-00000006 }"
        ), "{s}");
    }

    #[test]
    fn a_port_whose_mac_is_unknown_passes_nothing_and_no_port_no_prerouting() {
        let mut n = net("impbr-a", "10.1.0.0/24", None, &[]);
        let (tap, mut p) = port("imptap-00000005", 5);
        p.mac = None;
        n.ports = [(tap, p)].into();
        let s = script(&[n]).unwrap();
        assert!(
            s.contains(
                "chain port-imptap-00000005 {\n    counter name imptap-00000005-mac drop\n  }"
            ),
            "{s}"
        );
        let s = script(&[net("impbr-a", "10.1.0.0/24", None, &[])]).unwrap();
        let bridge = &s[s.find("table bridge imp {").unwrap()..];
        assert!(
            !bridge.contains("prerouting"),
            "an empty verdict map does not load: {s}"
        );
    }

    #[test]
    fn vxlan_is_taken_only_from_the_networks_vteps() {
        let mut n = net("impbr-a", "10.1.0.0/24", None, &[]);
        n.vxlan = Some(VxlanPlan {
            name: "impvx-1".into(),
            vni: 0xabcd,
            port: 4789,
            local: "192.168.5.1".parse().unwrap(),
        });
        let s = script(std::slice::from_ref(&n)).unwrap();
        assert!(
            s.contains("udp dport 4789 @th,96,24 0xabcd counter name vxlan-foreign drop"),
            "no VTEP yet: nobody: {s}"
        );
        assert!(s.contains("  counter vxlan-foreign {}"));
        let (b, c) = (
            "192.168.5.2".parse().unwrap(),
            "192.168.5.3".parse().unwrap(),
        );
        n.fdb = [
            FdbEntry {
                mac: Mac([2, 0, 0, 0, 0, 9]),
                dst: c,
            },
            FdbEntry {
                mac: Mac::FLOOD,
                dst: b,
            },
            FdbEntry {
                mac: Mac::FLOOD,
                dst: c,
            },
        ]
        .into();
        let s = script(&[n]).unwrap();
        assert!(s.contains(
            "udp dport 4789 @th,96,24 0xabcd ip saddr != { 192.168.5.2, 192.168.5.3 } counter name vxlan-foreign drop"
        ), "{s}");
        let input = &s[s.find("chain input").unwrap()..];
        assert!(input.find("vxlan-foreign").unwrap() < input.find("ct state").unwrap());
        let s = script(&[net("impbr-a", "10.1.0.0/24", None, &[])]).unwrap();
        assert!(!s.contains("vxlan-foreign"), "no overlay, no rule: {s}");
    }

    #[test]
    fn counters_are_read_from_nft_json_and_named_back_to_their_vm() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"counter": {"family": "bridge", "name": "imptap-00000005-arp", "table": "imp", "handle": 3, "packets": 4, "bytes": 168}},
            {"counter": {"family": "bridge", "name": "imptap-00000005-mac", "table": "imp", "handle": 4, "packets": 0, "bytes": 0}},
            {"counter": {"family": "bridge", "name": "imptap-00000006-dhcp", "table": "imp", "handle": 5, "packets": 2, "bytes": 600}},
            {"counter": {"family": "inet", "name": "vxlan-foreign", "table": "imp", "handle": 6, "packets": 7, "bytes": 900}},
            {"counter": {"family": "bridge", "name": "someone-else", "table": "imp", "handle": 7, "packets": 1, "bytes": 1}}]}"#;
        let counters = parse_counters(json);
        assert_eq!(counters.len(), 5);
        assert_eq!(
            PortDrop::parse_counter("imptap-00000006-other"),
            Some(("imptap-00000006", PortDrop::NotIpv4))
        );
        assert_eq!(PortDrop::parse_counter("imptap-1-ip"), None);
        let vms = BTreeMap::from([("imptap-00000005".to_owned(), "ns/vm5".to_owned())]);
        let mut d = crate::Drops::default();
        d.add(&counters, &vms);
        d.add(&counters, &vms);
        assert_eq!(d.vxlan_foreign, 14);
        assert_eq!(
            d.ports,
            BTreeMap::from([
                (("ns/vm5".to_owned(), PortDrop::Arp), 8),
                // A TAP the rules no longer name is counted under its own name.
                (("imptap-00000006".to_owned(), PortDrop::DhcpServer), 4),
            ])
        );
        assert!(parse_counters("not json").is_empty());
    }

    #[test]
    fn guests_reach_their_network_dns_and_allowed_ranges_but_not_what_is_denied() {
        let cidr = |s: &str| s.parse::<Ipv4Cidr>().unwrap();
        let mut n = net("impbr-a", "10.1.0.0/24", Some("eth0"), &[]);
        n.vxlan = Some(VxlanPlan {
            name: "impvx-1".into(),
            vni: 7,
            port: 4789,
            local: "192.168.5.1".parse().unwrap(),
        });
        n.egress_never = vec![cidr("169.254.0.0/16"), cidr("192.168.5.0/24")];
        n.egress_deny = vec![cidr("10.96.0.0/12")];
        n.egress_allow = vec![cidr("10.96.0.10/32"), cidr("10.96.0.0/28")];
        n.dns = BTreeSet::from(["192.168.5.53".parse().unwrap()]);
        let s = script(&[n]).unwrap();
        let chain = &s[s.find("chain egress-impbr-a {").unwrap()..];
        let rules: Vec<&str> = chain.lines().skip(1).take(8).map(str::trim).collect();
        assert_eq!(
            rules,
            [
                "ip daddr 10.1.0.0/24 return",
                "ct state established,related return",
                "udp dport 4789 counter name egress-denied drop",
                "ip daddr { 192.168.5.53 } meta l4proto { tcp, udp } th dport 53 return",
                // Whatever the network allows, these stay closed.
                "ip daddr { 169.254.0.0/16, 192.168.5.0/24 } counter name egress-denied drop",
                // The /32 inside the /28 is folded: nft refuses overlapping set elements.
                "ip daddr { 10.96.0.0/28 } return",
                "ip daddr { 10.96.0.0/12 } counter name egress-denied drop",
                "}",
            ],
            "{s}"
        );
        // Jumped to before DNAT and after it.
        let hook = &s[s.find("chain egress {").unwrap()..];
        assert!(hook.starts_with(
            "chain egress {\n    type filter hook prerouting priority -150; policy accept;\n    iifname \"impbr-a\" jump egress-impbr-a\n"
        ), "{s}");
        let forward = &s[s.find("chain forward {").unwrap()..];
        assert!(forward.starts_with(
            "chain forward {\n    type filter hook forward priority filter; policy accept;\n    iifname \"impbr-a\" jump egress-impbr-a\n"
        ), "{s}");
        assert!(s.contains("  counter egress-denied {}"));
    }

    /// A tenant's `spec.nat.egressInterface` of `x";accept;#` used to close the quoted name
    /// and load as an unconditional accept in forward and postrouting; `i*` as a wildcard
    /// matching every imp bridge. Now no script is made, naming the network and the field.
    #[test]
    fn a_hostile_egress_interface_is_refused_and_no_script_is_made() {
        for hostile in [
            "x\";accept;#",
            "i*",
            "eth0\"\naccept",
            "a\\",
            "",
            "..",
            "x y",
        ] {
            let err = script(&[net("impbr-a", "10.1.0.0/24", Some(hostile), &[])]).unwrap_err();
            let msg = imp_api::chain::chain(&err);
            assert!(
                msg.starts_with(&format!(
                    "ImpNetwork ns/impbr-a: spec.nat.egressInterface {hostile:?} cannot go into"
                )),
                "{msg}"
            );
        }
    }

    #[test]
    fn every_name_written_into_the_script_is_checked() {
        let good = || {
            let mut n = net("impbr-a", "10.1.0.0/24", Some("eth0"), &["10.1.0.16/28"]);
            n.ports = [port("imptap-00000005", 5)].into();
            n.vxlan = Some(VxlanPlan {
                name: "impvx-1".into(),
                vni: 7,
                port: 4789,
                local: "192.168.5.1".parse().unwrap(),
            });
            n
        };
        assert!(script(&[good()]).is_ok());
        let hostile = "a\";accept;#";
        let mut n = good();
        n.bridge = hostile.into();
        let mut v = good();
        v.vxlan.as_mut().unwrap().name = hostile.into();
        let mut t = good();
        t.ports = [port(hostile, 5)].into();
        for (n, field) in [(n, "bridge"), (v, "VXLAN device"), (t, "TAP")] {
            let err = script(&[good(), n]).unwrap_err();
            assert_eq!(err.field, field);
            assert_eq!(err.name, hostile);
        }
    }

    /// Whatever name the tenant writes, the script either is refused or has the rules it has
    /// with `eth0`, the name standing quoted where `eth0` stood.
    #[test]
    fn no_egress_interface_changes_the_shape_of_the_rules() {
        let with = |name: &str| script(&[net("impbr-a", "10.1.0.0/24", Some(name), &[])]);
        let base = with("eth0").unwrap();
        let alphabet: Vec<char> = "ax0-_.\"';#*\\/: {}\n\té@".chars().collect();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut accepted = 0;
        for _ in 0..5_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = 1 + (seed % 16) as usize;
            let name: String = (0..len)
                .map(|i| alphabet[((seed >> (i * 3)) as usize) % alphabet.len()])
                .collect();
            if let Ok(s) = with(&name) {
                accepted += 1;
                assert_eq!(
                    s,
                    base.replace("\"eth0\"", &format!("\"{name}\"")),
                    "{name:?}"
                );
            }
        }
        assert!(accepted > 0, "the generator made no valid name");
    }
}
