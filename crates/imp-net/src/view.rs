//! From the API's objects to what the node needs: an ImpNetwork as a [`NetworkView`] and a
//! VM's place on it as a [`NetAttachment`]. Pure functions.

use std::net::{IpAddr, Ipv4Addr};

use imp_api::ipv4::Ipv4Cidr;
use imp_api::network::{GroupConnectivity, ImpNetwork};
use imp_proto::config::NetworkConfig;
use kube::ResourceExt;

use super::names;
use super::plan::{Mac, NetworkView};
use crate::NetAttachment;

/// The `namespace/name` key of a network.
pub fn key(net: &ImpNetwork) -> String {
    format!("{}/{}", net.namespace().unwrap_or_default(), net.name_any())
}

/// What the node needs of `net`, or why its spec cannot be used.
pub fn network_view(net: &ImpNetwork) -> Result<NetworkView, String> {
    let key = key(net);
    let subnet = net
        .spec
        .subnet_cidr()
        .map_err(|e| format!("ImpNetwork {key}: spec.subnet: {e}"))?;
    let gateway = net
        .spec
        .gateway_addr()
        .ok_or_else(|| format!("ImpNetwork {key}: spec.gateway is not an address in {subnet}"))?;
    let status = net.status.clone().unwrap_or_default();
    let isolated_groups = net
        .spec
        .groups
        .iter()
        .filter(|g| g.connectivity == GroupConnectivity::Subnet)
        .filter_map(|g| status.group_cidrs.iter().find(|c| c.name == g.name))
        .filter_map(|c| c.cidr.parse::<Ipv4Cidr>().ok())
        .collect();
    let vteps = status
        .vtep_table
        .iter()
        .filter_map(|v| match (Mac::parse(&v.vm_mac), v.node_ip.parse::<Ipv4Addr>()) {
            (Some(mac), Ok(ip)) => Some((mac, ip)),
            _ => {
                tracing::warn!(network = %key, vm_ip = %v.vm_ip, mac = %v.vm_mac, node_ip = %v.node_ip, "skipping a malformed VTEP entry");
                None
            }
        })
        .collect();
    let (ns, name) = (net.namespace().unwrap_or_default(), net.name_any());
    Ok(NetworkView {
        key,
        subnet,
        gateway,
        nat: net
            .spec
            .nat
            .as_ref()
            .filter(|n| n.enabled)
            .map(|n| n.egress_interface.clone()),
        isolated_groups,
        egress_allow: net.spec.egress_allow(),
        vni: imp_api::network::vni(&ns, &name),
        vteps,
    })
}

/// A VM's place on `net`, with the guest's address setup: `ip` from the VM's status, the
/// network's prefix and gateway, its DNS servers (or the node's), the node's MTU.
pub fn attachment(
    vm_namespace: &str,
    vm_name: &str,
    net: &ImpNetwork,
    ip: &str,
    mtu: u32,
    node_dns: &[IpAddr],
) -> Result<NetAttachment, String> {
    let view = network_view(net)?;
    let address: Ipv4Addr = ip
        .parse()
        .map_err(|_| format!("status.ip {ip:?} is not an IPv4 address"))?;
    if !view.subnet.contains(address) {
        return Err(format!(
            "status.ip {ip} is outside ImpNetwork {} subnet {}",
            view.key, view.subnet
        ));
    }
    let dns = if net.spec.dns.is_empty() {
        node_dns.to_vec()
    } else {
        net.spec.dns.iter().filter_map(|d| d.parse().ok()).collect()
    };
    let (ns, name) = (net.namespace().unwrap_or_default(), net.name_any());
    Ok(NetAttachment {
        network: view.key,
        bridge: names::bridge(&ns, &name),
        tap: names::tap(vm_namespace, vm_name),
        mac: imp_api::network::vm_mac(vm_namespace, vm_name),
        vm: format!("{vm_namespace}/{vm_name}"),
        config: NetworkConfig {
            interface: "eth0".into(),
            address,
            prefix_len: view.subnet.prefix(),
            gateway: Some(view.gateway),
            dns,
            search: Vec::new(),
            mtu: Some(mtu),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::network::{
        GroupCidr, ImpNetworkSpec, ImpNetworkStatus, NatSpec, NetworkGroup, VtepEntry,
    };

    fn net() -> ImpNetwork {
        let mut n = ImpNetwork::new(
            "net",
            ImpNetworkSpec {
                subnet: "10.8.0.0/24".into(),
                groups: vec![
                    NetworkGroup {
                        name: "iso".into(),
                        connectivity: GroupConnectivity::Subnet,
                        expected_size: 14,
                    },
                    NetworkGroup {
                        name: "open".into(),
                        connectivity: GroupConnectivity::PolicyOnly,
                        expected_size: 14,
                    },
                ],
                nat: Some(NatSpec {
                    enabled: true,
                    egress_interface: None,
                }),
                ..Default::default()
            },
        );
        n.metadata.namespace = Some("ns".into());
        n.status = Some(ImpNetworkStatus {
            group_cidrs: vec![
                GroupCidr {
                    name: "iso".into(),
                    cidr: "10.8.0.0/28".into(),
                },
                GroupCidr {
                    name: "open".into(),
                    cidr: "10.8.0.16/28".into(),
                },
            ],
            vtep_table: vec![
                VtepEntry {
                    node_ip: "192.168.1.2".into(),
                    vm_ip: "10.8.0.20".into(),
                    vm_mac: "02:01:02:03:04:05".into(),
                },
                VtepEntry {
                    node_ip: "nonsense".into(),
                    vm_ip: "10.8.0.21".into(),
                    vm_mac: "02:01:02:03:04:06".into(),
                },
            ],
            ..Default::default()
        });
        n
    }

    #[test]
    fn the_view_keeps_isolated_groups_nat_and_valid_vteps() {
        let v = network_view(&net()).unwrap();
        assert_eq!(v.key, "ns/net");
        assert_eq!(v.gateway, Ipv4Addr::new(10, 8, 0, 1));
        assert_eq!(v.nat, Some(None));
        assert_eq!(v.isolated_groups, ["10.8.0.0/28".parse().unwrap()]);
        assert_eq!(v.vteps.len(), 1, "the malformed entry is skipped");
        assert_eq!(v.vni, imp_api::network::vni("ns", "net"));
    }

    #[test]
    fn the_attachment_gives_the_guest_its_address_and_the_nodes_dns() {
        let dns: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap()];
        let a = attachment("ns", "vm", &net(), "10.8.0.7", 1450, &dns).unwrap();
        assert_eq!(a.config.address, Ipv4Addr::new(10, 8, 0, 7));
        assert_eq!(a.config.prefix_len, 24);
        assert_eq!(a.config.gateway, Some(Ipv4Addr::new(10, 8, 0, 1)));
        assert_eq!(a.config.mtu, Some(1450));
        assert_eq!(a.config.dns, dns);
        assert_eq!(a.mac, imp_api::network::vm_mac("ns", "vm"));
        assert_eq!(a.tap, names::tap("ns", "vm"));
        let mut with_dns = net();
        with_dns.spec.dns = vec!["9.9.9.9".into()];
        let a = attachment("ns", "vm", &with_dns, "10.8.0.7", 1450, &dns).unwrap();
        assert_eq!(a.config.dns, ["9.9.9.9".parse::<IpAddr>().unwrap()]);
        let err = attachment("ns", "vm", &net(), "10.9.0.7", 1450, &dns).unwrap_err();
        assert!(
            err.contains("outside ImpNetwork ns/net subnet 10.8.0.0/24"),
            "{err}"
        );
    }
}
