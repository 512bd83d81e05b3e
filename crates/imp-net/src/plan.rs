//! What the node's network should look like: a pure function of the VMs attached on this node,
//! the ImpNetworks they use and what the node has of its own. [`super::NodeNet`] applies it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::Ipv4Addr;

use imp_api::ipv4::Ipv4Cidr;

use crate::NetAttachment;
use crate::names::check_interface;

/// Bytes a VXLAN encapsulation adds on IPv4 (outer IP 20 + UDP 8 + VXLAN 8 + inner Ethernet 14).
pub const VXLAN_OVERHEAD: u32 = 50;

/// A MAC address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    /// The all-zeros MAC: on a VXLAN device, the entry that floods broadcast and unknown
    /// unicast (ARP) to a remote endpoint.
    pub const FLOOD: Mac = Mac([0; 6]);

    /// Parses `aa:bb:cc:dd:ee:ff`.
    pub fn parse(s: &str) -> Option<Mac> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let p = parts.next()?;
            if p.len() != 2 {
                return None;
            }
            *b = u8::from_str_radix(p, 16).ok()?;
        }
        parts.next().is_none().then_some(Mac(out))
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// One forwarding entry of a VXLAN device: frames for `mac` go to the node at `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FdbEntry {
    /// The destination MAC ([`Mac::FLOOD`] for broadcast and unknown unicast).
    pub mac: Mac,
    /// The remote node's underlay address.
    pub dst: Ipv4Addr,
}

/// What an ImpNetwork says that the node needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkView {
    /// `namespace/name`.
    pub key: String,
    /// The network's subnet.
    pub subnet: Ipv4Cidr,
    /// The bridge's address.
    pub gateway: Ipv4Addr,
    /// `Some(interface)` when NAT is enabled (`None` inside: the default route's interface).
    pub nat: Option<Option<String>>,
    /// CIDRs of groups with `connectivity: subnet`: they reach only themselves.
    pub isolated_groups: Vec<Ipv4Cidr>,
    /// `spec.egress.allow`: destinations denied by default that its guests may reach.
    pub egress_allow: Vec<Ipv4Cidr>,
    /// The network's VXLAN identifier.
    pub vni: u32,
    /// Every VM of the network: (MAC, node address) from the VTEP table.
    pub vteps: Vec<(Mac, Ipv4Addr)>,
}

/// What the node has of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    /// The address VXLAN traffic leaves from and arrives at; no overlay without it.
    pub vtep: Option<Ipv4Addr>,
    /// The overlay's UDP port (the same on every node).
    pub vxlan_port: u16,
    /// MTU of the underlay interface (the one holding [`NodeView::vtep`]).
    pub underlay_mtu: u32,
    /// IPv4 addresses on interfaces that are not imp's: `(interface, address, prefix)`.
    pub addresses: Vec<(String, Ipv4Addr, u8)>,
    /// The interface of the default route, if any.
    pub default_interface: Option<String>,
    /// The API server's addresses (its Service's and its endpoints'): never reachable from
    /// guests.
    pub api_servers: Vec<Ipv4Addr>,
    /// `--egress-deny`: ranges guests may not reach unless their network allows them (the
    /// cluster's pod and service ranges).
    pub egress_deny: Vec<Ipv4Cidr>,
}

/// Link-local IPv4 (169.254.0.0/16): where clouds serve instance metadata and credentials.
pub const LINK_LOCAL: Ipv4Cidr = Ipv4Cidr::LINK_LOCAL;

impl NodeView {
    /// What no guest may ever reach, whatever its network says: link-local, every network the
    /// node is on (its neighbours: other nodes, the API server) and the API server's addresses;
    /// nested ranges folded into the wider one (nft refuses overlapping set elements). A range
    /// holding the guest's own network stays: its own subnet is let through before.
    pub fn egress_never(&self) -> Vec<Ipv4Cidr> {
        let own = self
            .addresses
            .iter()
            .filter_map(|(_, a, p)| Ipv4Cidr::containing(*a, *p));
        let api = self
            .api_servers
            .iter()
            .filter_map(|a| Ipv4Cidr::containing(*a, 32));
        let all: Vec<Ipv4Cidr> = std::iter::once(LINK_LOCAL).chain(own).chain(api).collect();
        fold_nested(&all)
    }
}

/// `cidrs` without duplicates and without any range that another one covers.
pub fn fold_nested(cidrs: &[Ipv4Cidr]) -> Vec<Ipv4Cidr> {
    let mut out: Vec<Ipv4Cidr> = Vec::new();
    for (i, c) in cidrs.iter().enumerate() {
        let covered = cidrs
            .iter()
            .enumerate()
            .any(|(j, o)| o.covers(c) && (o != c || j < i));
        if !covered {
            out.push(*c);
        }
    }
    out.sort();
    out
}

impl NodeView {
    /// The MTU of every imp bridge, TAP and guest on this node.
    pub fn mtu(&self) -> u32 {
        let underlay = if self.underlay_mtu == 0 {
            1500
        } else {
            self.underlay_mtu
        };
        match self.vtep {
            Some(_) => underlay.saturating_sub(VXLAN_OVERHEAD).max(576),
            None => underlay,
        }
    }
}

/// A network's VXLAN device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VxlanPlan {
    /// Device name.
    pub name: String,
    /// Network identifier.
    pub vni: u32,
    /// UDP port.
    pub port: u16,
    /// Local underlay address.
    pub local: Ipv4Addr,
}

/// A VM's port on its network's bridge, and who may speak through it: frames from the TAP
/// must carry the VM's own MAC and (IPv4 and ARP) its own address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// The VM, `namespace/name` (empty in specs written before it was recorded).
    pub vm: String,
    /// The VM's MAC; `None` when its recorded MAC does not parse (the port then passes
    /// nothing: no frame carries a source MAC that matches no MAC).
    pub mac: Option<Mac>,
    /// The VM's address.
    pub ip: Ipv4Addr,
}

/// One network as it must exist on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetPlan {
    /// `namespace/name`.
    pub key: String,
    /// Bridge name.
    pub bridge: String,
    /// The bridge's address and the subnet's prefix.
    pub gateway: Ipv4Addr,
    /// The subnet.
    pub subnet: Ipv4Cidr,
    /// MTU of the bridge and its ports.
    pub mtu: u32,
    /// The overlay device, when the node has an underlay address.
    pub vxlan: Option<VxlanPlan>,
    /// Ports (by TAP name) of this node's VMs on the network.
    pub ports: BTreeMap<String, Port>,
    /// Forwarding entries toward other nodes.
    pub fdb: BTreeSet<FdbEntry>,
    /// The interface to masquerade out of, when NAT is on.
    pub nat_egress: Option<String>,
    /// Groups that reach only themselves.
    pub isolated_groups: Vec<Ipv4Cidr>,
    /// Destinations its guests never reach ([`NodeView::egress_never`]).
    pub egress_never: Vec<Ipv4Cidr>,
    /// Destinations its guests may not reach (`--egress-deny`)…
    pub egress_deny: Vec<Ipv4Cidr>,
    /// …unless listed here (`spec.egress.allow`).
    pub egress_allow: Vec<Ipv4Cidr>,
    /// Its guests' name servers: reachable on port 53 even inside a denied range.
    pub dns: BTreeSet<Ipv4Addr>,
}

/// The whole node: networks to wire and networks refused (with why).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Networks to wire, by key.
    pub networks: Vec<NetPlan>,
    /// Networks not wired, by key, with the reason naming both sides of a conflict.
    pub refused: BTreeMap<String, String>,
    /// Networks wired for the VMs already on them but closed to new ones, by key, with why:
    /// their spec asks for something the node will not write (an `egressInterface` that is
    /// no interface name); a VM about to start on one is refused.
    pub closed: BTreeMap<String, String>,
    /// What is wired with less than asked, and why.
    pub notes: Vec<String>,
}

/// The node's desired network from its attachments.
pub fn plan(
    attachments: &[NetAttachment],
    networks: &BTreeMap<String, NetworkView>,
    node: &NodeView,
) -> Plan {
    let mut out = Plan::default();
    let mut by_network: BTreeMap<&str, Vec<&NetAttachment>> = BTreeMap::new();
    for a in attachments {
        // Names read back from a spec on disk: one that is not imp's is never used.
        if let Err(e) = a.check() {
            out.notes.push(imp_api::chain::chain(&e));
            continue;
        }
        by_network.entry(a.network.as_str()).or_default().push(a);
    }
    for (key, members) in by_network {
        let view = networks.get(key);
        let subnet = match view.map(|v| v.subnet).or_else(|| subnet_of(members[0])) {
            Some(s) => s,
            None => {
                out.refused
                    .insert(key.to_owned(), format!("ImpNetwork {key}: no subnet known"));
                continue;
            }
        };
        if let Some(why) = conflict(key, subnet, node, &out.networks) {
            out.refused.insert(key.to_owned(), why);
            continue;
        }
        let nat_egress = match view.and_then(|v| v.nat.clone()) {
            Some(Some(iface)) => match check_interface(&iface) {
                Ok(()) => Some(iface),
                // Without NAT nothing leaves the network: closed, not open.
                Err(e) => {
                    let why = format!(
                        "ImpNetwork {key}: spec.nat.egressInterface {iface:?} is not a valid \
                         interface name: {e}; no NAT on this node and no new VM on the network"
                    );
                    out.notes.push(why.clone());
                    out.closed.insert(key.to_owned(), why);
                    None
                }
            },
            Some(None) => match &node.default_interface {
                Some(iface) if check_interface(iface).is_ok() => Some(iface.clone()),
                Some(iface) => {
                    out.notes.push(format!(
                        "ImpNetwork {key} has nat.enabled, but the node's default route leaves \
                         through {iface:?}, which imp will not write into its rules: no NAT on \
                         this node (set spec.nat.egressInterface)"
                    ));
                    None
                }
                None => {
                    out.notes.push(format!(
                        "ImpNetwork {key} has nat.enabled, but the node has no default route and \
                         spec.nat.egressInterface is not set: no NAT on this node"
                    ));
                    None
                }
            },
            None => None,
        };
        out.networks.push(NetPlan {
            key: key.to_owned(),
            bridge: members[0].bridge.clone(),
            gateway: view
                .map(|v| v.gateway)
                .or(members[0].config.gateway)
                .unwrap_or_else(|| subnet.first_host().unwrap_or(subnet.network())),
            subnet,
            mtu: node.mtu(),
            vxlan: vxlan_plan(members[0], view, node),
            ports: members.iter().map(|a| (a.tap.clone(), port(a))).collect(),
            fdb: view.map(|v| fdb(v, node)).unwrap_or_default(),
            nat_egress,
            isolated_groups: view.map(|v| v.isolated_groups.clone()).unwrap_or_default(),
            egress_never: node.egress_never(),
            egress_deny: fold_nested(&node.egress_deny),
            egress_allow: view.map(|v| v.egress_allow.clone()).unwrap_or_default(),
            dns: members
                .iter()
                .flat_map(|a| &a.config.dns)
                .filter_map(|d| match d {
                    std::net::IpAddr::V4(v4) => Some(*v4),
                    std::net::IpAddr::V6(_) => None,
                })
                .collect(),
        });
    }
    out
}

fn port(a: &NetAttachment) -> Port {
    Port {
        vm: a.vm.clone(),
        mac: Mac::parse(&a.mac),
        ip: a.config.address,
    }
}

fn subnet_of(a: &NetAttachment) -> Option<Ipv4Cidr> {
    Ipv4Cidr::containing(a.config.address, a.config.prefix_len)
}

/// Why `subnet` cannot be wired here: it overlaps one of the node's own addresses or a network
/// already planned.
fn conflict(key: &str, subnet: Ipv4Cidr, node: &NodeView, planned: &[NetPlan]) -> Option<String> {
    for (iface, addr, prefix) in &node.addresses {
        let own = Ipv4Cidr::containing(*addr, *prefix)?;
        if own.overlaps(&subnet) {
            return Some(format!(
                "ImpNetwork {key} subnet {subnet} overlaps the node's own network {addr}/{prefix} on {iface}"
            ));
        }
    }
    planned
        .iter()
        .find(|p| p.subnet.overlaps(&subnet))
        .map(|p| {
            format!(
                "ImpNetwork {key} subnet {subnet} overlaps ImpNetwork {} subnet {} on this node",
                p.key, p.subnet
            )
        })
}

fn vxlan_plan(a: &NetAttachment, view: Option<&NetworkView>, node: &NodeView) -> Option<VxlanPlan> {
    let local = node.vtep?;
    let (ns, name) = a.network.split_once('/')?;
    Some(VxlanPlan {
        name: super::names::vxlan(ns, name),
        vni: view.map_or_else(|| imp_api::network::vni(ns, name), |v| v.vni),
        port: node.vxlan_port,
        local,
    })
}

/// Entries toward every remote VM and a flood entry toward every remote node.
fn fdb(view: &NetworkView, node: &NodeView) -> BTreeSet<FdbEntry> {
    let Some(local) = node.vtep else {
        return BTreeSet::new();
    };
    let mut out = BTreeSet::new();
    for &(mac, dst) in &view.vteps {
        if dst == local || dst.is_unspecified() {
            continue;
        }
        out.insert(FdbEntry { mac, dst });
        out.insert(FdbEntry {
            mac: Mac::FLOOD,
            dst,
        });
    }
    out
}

/// What to delete and what to add to turn `observed` into `desired`. Entries the kernel keeps
/// without a destination never reach here (the reader skips them); a VM that moved shows up as
/// its old entry deleted and its new one added.
pub fn fdb_changes(
    observed: &BTreeSet<FdbEntry>,
    desired: &BTreeSet<FdbEntry>,
) -> (Vec<FdbEntry>, Vec<FdbEntry>) {
    (
        observed.difference(desired).copied().collect(),
        desired.difference(observed).copied().collect(),
    )
}

/// The TAPs, bridges and VXLAN devices of imp on the node that no plan wants.
pub fn stale_links<'a>(plan: &Plan, existing: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let wanted: BTreeSet<&str> = plan
        .networks
        .iter()
        .flat_map(|n| {
            let own = [
                Some(n.bridge.as_str()),
                n.vxlan.as_ref().map(|v| v.name.as_str()),
            ];
            own.into_iter()
                .flatten()
                .chain(n.ports.keys().map(String::as_str))
        })
        .collect();
    existing
        .into_iter()
        .filter(|l| super::names::is_imp(l) && !wanted.contains(l))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_proto::config::NetworkConfig;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn attach(network: &str, vm: &str, addr: &str) -> NetAttachment {
        let (ns, name) = network.split_once('/').unwrap();
        NetAttachment {
            network: network.into(),
            bridge: super::super::names::bridge(ns, name),
            tap: super::super::names::tap(ns, vm),
            mac: imp_api::network::vm_mac(ns, vm),
            vm: format!("{ns}/{vm}"),
            config: NetworkConfig {
                interface: "eth0".into(),
                address: ip(addr),
                prefix_len: 24,
                gateway: Some(ip("10.7.0.1")),
                dns: vec![],
                search: vec![],
                mtu: Some(1450),
            },
        }
    }

    fn view(key: &str, subnet: &str) -> NetworkView {
        let subnet: Ipv4Cidr = subnet.parse().unwrap();
        NetworkView {
            key: key.into(),
            subnet,
            gateway: subnet.first_host().unwrap(),
            nat: None,
            isolated_groups: vec![],
            egress_allow: vec![],
            vni: 42,
            vteps: vec![],
        }
    }

    fn node() -> NodeView {
        NodeView {
            vtep: Some(ip("192.168.5.1")),
            vxlan_port: 4789,
            underlay_mtu: 1500,
            addresses: vec![("eth0".into(), ip("192.168.5.1"), 24)],
            default_interface: Some("eth0".into()),
            api_servers: Vec::new(),
            egress_deny: vec![],
        }
    }

    #[test]
    fn guests_never_reach_link_local_the_nodes_networks_or_the_api_server() {
        let cidr = |s: &str| s.parse::<Ipv4Cidr>().unwrap();
        let mut n = node();
        n.addresses.push(("eth1".into(), ip("10.7.0.9"), 16));
        n.addresses.push(("eth2".into(), ip("192.168.5.200"), 25));
        // The Service address, and the endpoints behind it: one on a node network (folded
        // into it), one beyond NAT (a managed control plane).
        n.api_servers = vec![ip("10.96.0.1"), ip("10.7.3.4"), ip("203.0.113.30")];
        n.egress_deny = vec![cidr("10.96.0.0/12"), cidr("10.100.0.0/16")];
        // Nested ranges fold into the wider; a range holding a network's own subnet stays.
        assert_eq!(
            n.egress_never(),
            vec![
                cidr("10.7.0.0/16"),
                cidr("10.96.0.1/32"),
                cidr("169.254.0.0/16"),
                cidr("192.168.5.0/24"),
                cidr("203.0.113.30/32")
            ]
        );
        let mut a = attach("ns/net", "a", "10.9.0.2");
        a.config.dns = vec!["192.168.5.53".parse().unwrap(), "::1".parse().unwrap()];
        let p = plan(&[a], &BTreeMap::new(), &n);
        let net = &p.networks[0];
        assert_eq!(net.dns, BTreeSet::from([ip("192.168.5.53")]));
        assert_eq!(net.egress_never, n.egress_never());
        assert_eq!(net.egress_deny, vec![cidr("10.96.0.0/12")]);
    }

    #[test]
    fn one_bridge_per_network_with_every_tap_and_the_overlay() {
        let a = [
            attach("ns/net", "a", "10.7.0.2"),
            attach("ns/net", "b", "10.7.0.3"),
        ];
        let nets = BTreeMap::from([("ns/net".to_owned(), view("ns/net", "10.7.0.0/24"))]);
        let p = plan(&a, &nets, &node());
        assert!(p.refused.is_empty(), "{:?}", p.refused);
        let [n] = p.networks.as_slice() else {
            panic!("{p:?}")
        };
        assert_eq!(n.ports.len(), 2);
        let b = &n.ports[&super::super::names::tap("ns", "b")];
        assert_eq!(b.vm, "ns/b");
        assert_eq!(b.ip, ip("10.7.0.3"));
        assert_eq!(
            b.mac.map(|m| m.to_string()),
            Some(imp_api::network::vm_mac("ns", "b"))
        );
        assert_eq!(n.mtu, 1450);
        assert_eq!(n.gateway, ip("10.7.0.1"));
        let vx = n.vxlan.as_ref().unwrap();
        assert_eq!((vx.vni, vx.port, vx.local), (42, 4789, ip("192.168.5.1")));
        assert!(vx.name.starts_with("impvx-"));
        let mut no_vtep = node();
        no_vtep.vtep = None;
        let p = plan(&a, &nets, &no_vtep);
        assert!(p.networks[0].vxlan.is_none());
        assert_eq!(p.networks[0].mtu, 1500);
    }

    #[test]
    fn remote_vms_get_entries_and_remote_nodes_a_flood_entry() {
        let mut v = view("ns/net", "10.7.0.0/24");
        let m1 = Mac::parse("02:00:00:00:00:01").unwrap();
        let m2 = Mac::parse("02:00:00:00:00:02").unwrap();
        let m3 = Mac::parse("02:00:00:00:00:03").unwrap();
        v.vteps = vec![
            (m1, ip("192.168.5.1")), // local: nothing
            (m2, ip("192.168.5.2")),
            (m3, ip("192.168.5.2")),
            (Mac::parse("02:00:00:00:00:04").unwrap(), ip("0.0.0.0")),
        ];
        let nets = BTreeMap::from([("ns/net".to_owned(), v)]);
        let p = plan(&[attach("ns/net", "a", "10.7.0.2")], &nets, &node());
        let dst = ip("192.168.5.2");
        let want: BTreeSet<_> = [
            FdbEntry { mac: m2, dst },
            FdbEntry { mac: m3, dst },
            FdbEntry {
                mac: Mac::FLOOD,
                dst,
            },
        ]
        .into();
        assert_eq!(p.networks[0].fdb, want);
    }

    #[test]
    fn fdb_sync_deletes_what_is_gone_and_follows_a_moved_vm() {
        let m = Mac::parse("02:00:00:00:00:09").unwrap();
        let old = FdbEntry {
            mac: m,
            dst: ip("192.168.5.2"),
        };
        let new = FdbEntry {
            mac: m,
            dst: ip("192.168.5.3"),
        };
        let flood = FdbEntry {
            mac: Mac::FLOOD,
            dst: ip("192.168.5.3"),
        };
        let (del, add) = fdb_changes(&[old].into(), &[new, flood].into());
        assert_eq!(del, [old]);
        assert_eq!(add, [flood, new]);
        let (del, add) = fdb_changes(&[new, flood].into(), &[new, flood].into());
        assert!(
            del.is_empty() && add.is_empty(),
            "a second sync changes nothing"
        );
    }

    #[test]
    fn overlaps_with_the_node_or_another_network_are_refused_naming_both() {
        let a = [
            attach("ns/clash", "a", "192.168.5.9"),
            attach("ns/net", "b", "10.7.0.2"),
        ];
        let nets = BTreeMap::from([
            ("ns/clash".to_owned(), view("ns/clash", "192.168.0.0/16")),
            ("ns/net".to_owned(), view("ns/net", "10.7.0.0/24")),
        ]);
        let p = plan(&a, &nets, &node());
        let why = &p.refused["ns/clash"];
        assert!(
            why.contains("192.168.0.0/16") && why.contains("192.168.5.1/24 on eth0"),
            "{why}"
        );
        assert_eq!(p.networks.len(), 1);

        let a = [
            attach("ns/a", "x", "10.7.0.2"),
            attach("ns/b", "y", "10.7.0.3"),
        ];
        let nets = BTreeMap::from([
            ("ns/a".to_owned(), view("ns/a", "10.7.0.0/24")),
            ("ns/b".to_owned(), view("ns/b", "10.7.0.0/25")),
        ]);
        let p = plan(&a, &nets, &node());
        let why = &p.refused["ns/b"];
        assert!(why.contains("ImpNetwork ns/a subnet 10.7.0.0/24"), "{why}");
    }

    #[test]
    fn nat_goes_out_of_the_named_or_the_default_interface() {
        let a = [attach("ns/net", "a", "10.7.0.2")];
        let mut v = view("ns/net", "10.7.0.0/24");
        v.nat = Some(None);
        let nets = BTreeMap::from([("ns/net".to_owned(), v.clone())]);
        assert_eq!(
            plan(&a, &nets, &node()).networks[0].nat_egress.as_deref(),
            Some("eth0")
        );
        v.nat = Some(Some("uplink".into()));
        let nets = BTreeMap::from([("ns/net".to_owned(), v.clone())]);
        assert_eq!(
            plan(&a, &nets, &node()).networks[0].nat_egress.as_deref(),
            Some("uplink")
        );
        v.nat = Some(None);
        let nets = BTreeMap::from([("ns/net".to_owned(), v)]);
        let mut n = node();
        n.default_interface = None;
        let p = plan(&a, &nets, &n);
        assert_eq!(p.networks[0].nat_egress, None, "wired, without NAT");
        assert!(p.notes[0].contains("no default route"), "{:?}", p.notes);
    }

    /// `x";accept;#` as the egress interface: the network's VMs on the node keep their ports
    /// and isolation but get no NAT, new VMs are refused naming the field, and the script is
    /// made without the name.
    #[test]
    fn a_hostile_egress_interface_closes_the_network_and_never_reaches_the_rules() {
        let hostile = "x\";accept;#";
        let a = [attach("ns/net", "a", "10.7.0.2")];
        let mut v = view("ns/net", "10.7.0.0/24");
        v.nat = Some(Some(hostile.into()));
        let nets = BTreeMap::from([("ns/net".to_owned(), v.clone())]);
        let p = plan(&a, &nets, &node());
        assert_eq!(p.networks.len(), 1, "still wired for the VMs on it");
        assert_eq!(p.networks[0].nat_egress, None);
        let why = &p.closed["ns/net"];
        assert!(
            why.starts_with(
                "ImpNetwork ns/net: spec.nat.egressInterface \"x\\\";accept;#\" is not a valid \
                 interface name: holds '\"'"
            ),
            "{why}"
        );
        let script = crate::nft::script(&p.networks).unwrap();
        assert!(!script.contains("x\""), "{script}");
        assert!(!script.contains("masquerade"), "{script}");
        // The node's own default interface, if odd, is not written either (and closes nothing).
        v.nat = Some(None);
        let nets = BTreeMap::from([("ns/net".to_owned(), v)]);
        let mut n = node();
        n.default_interface = Some("e*".into());
        let p = plan(&a, &nets, &n);
        assert_eq!(p.networks[0].nat_egress, None);
        assert!(p.closed.is_empty());
        assert!(p.notes[0].contains("\"e*\""), "{:?}", p.notes);
    }

    /// Names read back from a VM's spec on disk are used only if imp could have made them.
    #[test]
    fn an_attachment_with_names_imp_did_not_make_is_left_out() {
        let good = attach("ns/net", "a", "10.7.0.2");
        let nets = BTreeMap::from([("ns/net".to_owned(), view("ns/net", "10.7.0.0/24"))]);
        for bad in [
            NetAttachment {
                tap: "imptap-\";acc".into(),
                ..good.clone()
            },
            NetAttachment {
                bridge: "eth0".into(),
                ..good.clone()
            },
            NetAttachment {
                mac: "02:00:00:00:00:01,x".into(),
                ..good.clone()
            },
        ] {
            let p = plan(&[bad], &nets, &node());
            assert!(p.networks.is_empty(), "{:?}", p.networks);
            assert!(
                p.notes[0].starts_with("VM ns/a on ImpNetwork ns/net: "),
                "{:?}",
                p.notes
            );
        }
        assert_eq!(plan(&[good], &nets, &node()).networks.len(), 1);
    }

    #[test]
    fn links_nobody_wants_are_stale_and_foreign_links_are_never() {
        let a = [attach("ns/net", "a", "10.7.0.2")];
        let nets = BTreeMap::from([("ns/net".to_owned(), view("ns/net", "10.7.0.0/24"))]);
        let p = plan(&a, &nets, &node());
        let n = &p.networks[0];
        let gone = super::super::names::tap("ns", "gone");
        let existing = [
            n.bridge.as_str(),
            n.vxlan.as_ref().unwrap().name.as_str(),
            a[0].tap.as_str(),
            gone.as_str(),
            "eth0",
            "docker0",
        ];
        assert_eq!(stale_links(&p, existing), std::slice::from_ref(&gone));
        assert_eq!(stale_links(&Plan::default(), existing).len(), 4);
    }

    #[test]
    fn macs_parse_and_print() {
        let m = Mac::parse("02:ab:00:10:ff:7e").unwrap();
        assert_eq!(m.to_string(), "02:ab:00:10:ff:7e");
        for bad in [
            "",
            "02:ab:00:10:ff",
            "02:ab:00:10:ff:7e:01",
            "02:ab:00:10:ff:zz",
            "2:ab:0:10:ff:7e",
        ] {
            assert_eq!(Mac::parse(bad), None, "{bad}");
        }
    }
}
