//! The ImpNetwork status the operator wants, as pure functions of the network, the other
//! networks, and where its VMs run.

use std::collections::BTreeMap;

use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::ipv4::Ipv4Cidr;
use imp_api::network::{self, ImpNetwork, ImpNetworkStatus, IpamProvider, VtepEntry};
use imp_api::shared::ANNOTATION_VTEP_ADDRESS;
use imp_api::validation;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::ipam::{groups, network_key};

/// The Ready condition a network should carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Readiness {
    /// Ready=True.
    pub ok: bool,
    /// Why.
    pub reason: ConditionReason,
    /// Said to the user.
    pub message: String,
}

impl Readiness {
    fn not(reason: ConditionReason, message: String) -> Self {
        Self {
            ok: false,
            reason,
            message,
        }
    }
}

/// Which of two networks came first: creationTimestamp, then namespace/name.
fn age(net: &ImpNetwork) -> (Timestamp, String) {
    let created = net
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(Timestamp::MAX, |t| t.0);
    (created, network_key(net))
}

/// Whether `net` may be used: a spec the webhook accepts, a supported provider, and no older
/// network (in any namespace) holding an overlapping subnet or the same VNI.
pub fn readiness(net: &ImpNetwork, others: &[&ImpNetwork]) -> Readiness {
    if let Err(e) = validation::network(&net.spec) {
        return Readiness::not(ConditionReason::InvalidSpec, e.to_string());
    }
    // What the webhook refuses as not supported yet is refused here too (a network stored
    // without the webhook is never used with a switch nothing honours).
    if let Err(e) = imp_api::unsupported::network(&net.spec) {
        return Readiness::not(ConditionReason::InvalidSpec, e.to_string());
    }
    let Ok(subnet) = net.spec.subnet_cidr() else {
        return Readiness::not(
            ConditionReason::InvalidSpec,
            format!("spec.subnet {:?} is not an IPv4 CIDR", net.spec.subnet),
        );
    };
    if let Err(e) = groups::carve(subnet, &net.spec.groups) {
        return Readiness::not(ConditionReason::InvalidSpec, format!("spec.groups: {e}"));
    }
    if net.spec.ipam.as_ref().map(|i| i.provider) == Some(IpamProvider::Cilium) {
        return Readiness::not(
            ConditionReason::NetworkSetupFailed,
            "ipam.provider cilium is not supported yet; use internal".into(),
        );
    }
    let me = age(net);
    let vni = network::vni(&net.namespace().unwrap_or_default(), &net.name_any());
    let mut older: Vec<&&ImpNetwork> = others
        .iter()
        .filter(|o| network_key(o) != me.1 && age(o) < me)
        .collect();
    older.sort_by_key(|o| age(o));
    for o in &older {
        if let Ok(theirs) = o.spec.subnet_cidr()
            && theirs.overlaps(&subnet)
        {
            return Readiness::not(
                ConditionReason::SubnetOverlap,
                format!(
                    "subnet {subnet} of {} overlaps subnet {theirs} of the older network {}",
                    me.1,
                    network_key(o)
                ),
            );
        }
    }
    for o in &older {
        if network::vni(&o.namespace().unwrap_or_default(), &o.name_any()) == vni {
            return Readiness::not(
                ConditionReason::VniConflict,
                format!(
                    "VNI {vni} of {} is also the VNI of the older network {}; rename one",
                    me.1,
                    network_key(o)
                ),
            );
        }
    }
    Readiness {
        ok: true,
        reason: ConditionReason::Reconciled,
        message: format!("subnet {subnet} ready"),
    }
}

/// The node's underlay address for VXLAN: its `imp.dev/vtep-address` annotation (published by
/// the agent), else its InternalIP.
pub fn node_address(node: &Node) -> Option<String> {
    if let Some(a) = node.annotations().get(ANNOTATION_VTEP_ADDRESS) {
        return Some(a.clone());
    }
    node.status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .find(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone())
}

/// One VTEP entry per allocation whose VM has a node with a known address, sorted by address.
/// `node_of` gives the node of VM `namespace/name`, `address_of` the underlay address of a node.
pub fn vtep_table(
    allocations: &BTreeMap<String, String>,
    node_of: impl Fn(&str) -> Option<String>,
    address_of: impl Fn(&str) -> Option<String>,
) -> Vec<VtepEntry> {
    let mut table: Vec<VtepEntry> = allocations
        .iter()
        .filter_map(|(ip, owner)| {
            let node_ip = address_of(&node_of(owner)?)?;
            let (ns, name) = owner.split_once('/')?;
            Some(VtepEntry {
                node_ip,
                vm_ip: ip.clone(),
                vm_mac: network::vm_mac(ns, name),
            })
        })
        .collect();
    table.sort_by_key(|e| e.vm_ip.parse::<std::net::Ipv4Addr>().ok());
    table
}

/// `current` with the group CIDRs, VTEP table and Ready condition the operator wants (the
/// allocation table is left as it is: only the allocator changes it).
pub fn desired(
    net: &ImpNetwork,
    ready: &Readiness,
    vtep: Vec<VtepEntry>,
    now: Timestamp,
) -> ImpNetworkStatus {
    let mut status = net.status.clone().unwrap_or_default();
    status.group_cidrs = net
        .spec
        .subnet_cidr()
        .ok()
        .and_then(|s| groups::carve(s, &net.spec.groups).ok())
        .map(|c| groups::status_shape(&c))
        .unwrap_or_default();
    status.vtep_table = vtep;
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::from(ready.ok),
        ready.reason,
        ready.message.clone(),
        net.metadata.generation,
        Time(now),
    );
    status
}

/// The subnet of a network, if it parses.
pub fn subnet(net: &ImpNetwork) -> Option<Ipv4Cidr> {
    net.spec.subnet_cidr().ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::network::ImpNetworkSpec;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};

    fn net(ns: &str, name: &str, subnet: &str, created_s: i64) -> ImpNetwork {
        let mut n = ImpNetwork::new(
            name,
            ImpNetworkSpec {
                subnet: subnet.into(),
                ..Default::default()
            },
        );
        n.metadata.namespace = Some(ns.into());
        n.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created_s).unwrap()));
        n
    }

    #[test]
    fn the_newer_of_two_overlapping_networks_is_not_ready_and_names_both() {
        let old = net("a", "one", "10.0.0.0/16", 100);
        let new = net("b", "two", "10.0.5.0/24", 200);
        assert!(readiness(&old, &[&old, &new]).ok);
        let r = readiness(&new, &[&old, &new]);
        assert_eq!(r.reason, ConditionReason::SubnetOverlap);
        assert!(
            r.message.contains("b/two") && r.message.contains("a/one"),
            "{}",
            r.message
        );
        // Same creation time: namespace/name decides.
        let twin = net("a", "first", "10.0.9.0/24", 100);
        assert!(readiness(&twin, &[&old, &twin]).ok);
        assert!(!readiness(&old, &[&old, &twin]).ok);
        // Disjoint subnets are both fine.
        let other = net("b", "three", "10.1.0.0/24", 300);
        assert!(readiness(&other, &[&old, &new, &other]).ok);
    }

    #[test]
    fn invalid_and_unsupported_specs_are_not_ready() {
        let bad = net("a", "bad", "10.0.0.1/24", 1);
        assert_eq!(readiness(&bad, &[]).reason, ConditionReason::InvalidSpec);
        let mut cil = net("a", "cil", "10.0.0.0/24", 1);
        cil.spec.ipam = Some(imp_api::network::IpamSpec {
            provider: IpamProvider::Cilium,
            cilium: Some(imp_api::network::CiliumIpamSpec {
                pool_ref: Some("p".into()),
                cidr: None,
            }),
        });
        let r = readiness(&cil, &[]);
        assert_eq!(r.reason, ConditionReason::NetworkSetupFailed);
        assert!(r.message.contains("not supported yet"));
        // A switch the webhook refuses as not supported yet, stored without the webhook.
        let mut switch = net("a", "switch", "10.0.0.0/24", 1);
        switch.spec.cilium = Some(imp_api::network::CiliumNetworkSpec {
            masquerade_via_cilium: true,
            ..Default::default()
        });
        let r = readiness(&switch, &[]);
        assert!(!r.ok);
        assert_eq!(r.reason, ConditionReason::InvalidSpec);
        assert!(
            r.message.contains("spec.cilium.masqueradeViaCilium")
                && r.message.contains("not supported yet"),
            "{}",
            r.message
        );
    }

    #[test]
    fn an_egress_interface_holding_nftables_syntax_is_not_ready_naming_the_field() {
        let mut n = net("evil", "n", "10.0.0.0/24", 1);
        n.spec.nat = Some(imp_api::network::NatSpec {
            enabled: true,
            egress_interface: Some("x\";accept;#".into()),
        });
        let r = readiness(&n, &[]);
        assert!(!r.ok);
        assert_eq!(r.reason, ConditionReason::InvalidSpec);
        assert!(
            r.message
                .starts_with("spec.nat.egressInterface: must be a Linux interface name"),
            "{}",
            r.message
        );
        // Its status says so, and the allocator reads that as "no address here".
        let status = desired(&n, &r, Vec::new(), Timestamp::UNIX_EPOCH);
        n.status = Some(status);
        n.metadata.generation = Some(1);
        let why = crate::ipam::not_ready(&n, "ns/n").map(|e| e.to_string());
        let why = why.unwrap_or_default();
        assert!(
            why.starts_with("network ns/n is not Ready: InvalidSpec: spec.nat.egressInterface"),
            "{why}"
        );
        // A real interface name is fine.
        if let Some(nat) = n.spec.nat.as_mut() {
            nat.egress_interface = Some("eth0.100".into());
        }
        assert!(readiness(&n, &[]).ok);
    }

    #[test]
    fn vtep_entries_follow_placement_and_prefer_the_annotation() {
        let mut n1 = Node::default();
        n1.metadata.name = Some("n1".into());
        n1.status = Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: "192.168.1.1".into(),
            }]),
            ..Default::default()
        });
        assert_eq!(node_address(&n1).as_deref(), Some("192.168.1.1"));
        n1.annotations_mut()
            .insert(ANNOTATION_VTEP_ADDRESS.into(), "172.16.0.1".into());
        assert_eq!(node_address(&n1).as_deref(), Some("172.16.0.1"));

        let allocs: BTreeMap<String, String> = [
            ("10.0.0.10".to_owned(), "ns/b".to_owned()),
            ("10.0.0.9".to_owned(), "ns/a".to_owned()),
            ("10.0.0.2".to_owned(), "ns/unplaced".to_owned()),
        ]
        .into_iter()
        .collect();
        let table = vtep_table(
            &allocs,
            |vm| (vm != "ns/unplaced").then(|| "n1".to_owned()),
            |n| (n == "n1").then(|| "172.16.0.1".to_owned()),
        );
        let ips: Vec<&str> = table.iter().map(|e| e.vm_ip.as_str()).collect();
        assert_eq!(ips, ["10.0.0.9", "10.0.0.10"]);
        assert_eq!(table[0].vm_mac, network::vm_mac("ns", "a"));
        assert_eq!(table[0].node_ip, "172.16.0.1");
    }
}
