//! ImpNetwork: an L2 network with IPAM, NAT and groups, spanning nodes over VXLAN.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::ipv4::{CidrError, Ipv4Cidr};

/// An IPv4 CIDR as the Go project's CRD spells it (the webhook checks the octets and prefix).
pub const GO_CIDR_PATTERN: &str = r"^([0-9]{1,3}\.){3}[0-9]{1,3}/[0-9]{1,2}$";

/// The network a VM attaches to.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpNetwork",
    plural = "impnetworks",
    singular = "impnetwork",
    shortname = "impnet",
    category = "imp",
    namespaced,
    status = "ImpNetworkStatus",
    printcolumn(name = "Subnet", type_ = "string", json_path = ".spec.subnet"),
    printcolumn(name = "NAT", type_ = "boolean", json_path = ".spec.nat.enabled"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    derive = "Default",
    derive = "PartialEq"
)]
#[schemars(transform = crate::schema::network_spec)]
#[serde(rename_all = "camelCase", remote = "Self")]
pub struct ImpNetworkSpec {
    /// IPv4 subnet of the network, e.g. 10.44.0.0/24.
    #[schemars(regex(pattern = GO_CIDR_PATTERN))]
    pub subnet: String,
    /// Gateway (bridge) address; default is the subnet's first address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Masquerading egress to outside the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat: Option<NatSpec>,
    /// DNS servers the guests use.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<String>,
    /// Cilium integration switches. Setting either to true: Not supported yet: refused by the admission webhook
    /// (imp does not configure Cilium).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium: Option<CiliumNetworkSpec>,
    /// Where addresses come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<IpamSpec>,
    /// Named sub-ranges VMs can join with spec.networkGroup.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<NetworkGroup>,
    /// Where guests may go beyond what every network reaches (imp's own field; the Go project
    /// has none). By default a guest reaches its network, its gateway, its DNS servers and,
    /// with NAT, the outside; never link-local addresses (cloud metadata), the node's
    /// networks (other nodes, the API server) nor the VXLAN port, and not the ranges the
    /// agent is told to deny (`--egress-deny`: the cluster's pod and service ranges) unless
    /// listed here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressSpec>,
}

/// What a network's guests may reach that is denied by default.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressSpec {
    /// IPv4 CIDRs inside the agent's `--egress-deny` ranges that guests may reach (e.g. the
    /// cluster's DNS Service). Link-local, the node's networks and the API server stay closed
    /// whatever this says. Reaching them still needs NAT (`spec.nat.enabled`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

spec_may_be_absent!(ImpNetworkSpec);

impl ImpNetworkSpec {
    /// The subnet, parsed.
    pub fn subnet_cidr(&self) -> Result<Ipv4Cidr, CidrError> {
        self.subnet.parse()
    }

    /// The gateway (the bridge's address on every node): `spec.gateway`, else the subnet's
    /// first host address. `None` when neither parses (admission refuses such a spec).
    pub fn gateway_addr(&self) -> Option<Ipv4Addr> {
        match &self.gateway {
            Some(g) => g.parse().ok(),
            None => self.subnet_cidr().ok()?.first_host(),
        }
    }

    /// `spec.egress.allow`, parsed (entries that do not parse are left out: admission
    /// refuses them).
    pub fn egress_allow(&self) -> Vec<Ipv4Cidr> {
        self.egress
            .iter()
            .flat_map(|e| &e.allow)
            .filter_map(|c| c.parse().ok())
            .collect()
    }

    /// Whether guests masquerade out of the node.
    pub fn nat_enabled(&self) -> bool {
        self.nat.as_ref().is_some_and(|n| n.enabled)
    }
}

fn digest(namespace: &str, name: &str) -> [u8; 32] {
    Sha256::digest(format!("{namespace}/{name}").as_bytes()).into()
}

/// The MAC address of a VM's interface: locally administered unicast (`02:`) followed by five
/// bytes of SHA-256 of `namespace/name`, so the operator (for the VTEP table) and the agent
/// (for the TAP and the guest) derive the same one, and it never changes with the VM's node.
pub fn vm_mac(namespace: &str, name: &str) -> String {
    let d = digest(namespace, name);
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        d[0], d[1], d[2], d[3], d[4]
    )
}

/// The VXLAN network identifier of a network: 24 bits of SHA-256 of `namespace/name` (0 is
/// not a valid VNI and becomes 1). Every node derives the same one without coordination; two
/// networks whose VNIs collide are reported by the operator instead of being joined.
pub fn vni(namespace: &str, name: &str) -> u32 {
    let d = digest(namespace, name);
    let v = u32::from_be_bytes([0, d[0], d[1], d[2]]);
    v.max(1)
}

/// NAT settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NatSpec {
    /// Whether to masquerade.
    pub enabled: bool,
    /// Host interface to masquerade out of; default is the default-route interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_interface: Option<String>,
}

/// Cilium switches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CiliumNetworkSpec {
    /// Keep the subnet out of Cilium's IPAM. true: Not supported yet: refused by the admission webhook.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[serde(rename = "excludeFromIPAM")]
    pub exclude_from_ipam: bool,
    /// Let Cilium masquerade the subnet. true: Not supported yet: refused by the admission webhook.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub masquerade_via_cilium: bool,
}

/// IPAM settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct IpamSpec {
    /// imp's own allocator or a Cilium pool.
    #[serde(default)]
    pub provider: IpamProvider,
    /// Cilium pool settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium: Option<CiliumIpamSpec>,
}

/// Source of addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum IpamProvider {
    /// imp's cluster-wide allocator.
    #[default]
    Internal,
    /// A CiliumPodIPPool.
    Cilium,
}

/// Cilium pool settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CiliumIpamSpec {
    /// Name of the CiliumPodIPPool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_ref: Option<String>,
    /// CIDR override; default is the subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = GO_CIDR_PATTERN))]
    pub cidr: Option<String>,
}

/// A named group inside the network.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkGroup {
    /// Group name, referenced by spec.networkGroup of a VM.
    pub name: String,
    /// Connectivity model of the group.
    #[serde(default)]
    pub connectivity: GroupConnectivity,
    /// Expected member count; sizes the group's CIDR.
    #[serde(default = "default_expected_size")]
    pub expected_size: i32,
}

fn default_expected_size() -> i32 {
    14
}

/// How members of a group reach each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum GroupConnectivity {
    /// A sub-subnet of its own.
    #[default]
    #[serde(rename = "subnet")]
    Subnet,
    /// Only network policy separates it.
    #[serde(rename = "policy-only")]
    PolicyOnly,
}

/// What the operator and agents know about a network.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpNetworkStatus {
    /// Every allocated IP, as the Go project lists them (kept equal to the keys of
    /// `allocations`; see [`ImpNetworkStatus::set_allocations`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[serde(rename = "allocatedIPs")]
    pub allocated_ips: Vec<String>,
    /// Address → VM (namespace/name) of every allocated IP (imp extension).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocations: BTreeMap<String, String>,
    /// VXLAN endpoints: which node hosts which VM address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["vmIP"]))]
    pub vtep_table: Vec<VtepEntry>,
    /// CIDR carved out for each group.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[serde(rename = "groupCIDRs")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub group_cidrs: Vec<GroupCidr>,
    /// Ready condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]), transform = crate::schema::conditions)]
    pub conditions: Vec<Condition>,
}

impl ImpNetworkStatus {
    /// Records the address → VM map and the Go-shaped address list derived from it, so the
    /// two never disagree.
    pub fn set_allocations(&mut self, allocations: BTreeMap<String, String>) {
        self.allocated_ips = allocations.keys().cloned().collect();
        self.allocations = allocations;
    }
}

/// One VXLAN endpoint entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VtepEntry {
    /// Underlay IP of the node hosting the VM.
    #[serde(rename = "nodeIP")]
    pub node_ip: String,
    /// The VM's address.
    #[serde(rename = "vmIP")]
    pub vm_ip: String,
    /// The VM's MAC.
    #[serde(rename = "vmMAC")]
    pub vm_mac: String,
}

/// A group's CIDR.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GroupCidr {
    /// Group name.
    pub name: String,
    /// CIDR of the group.
    pub cidr: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocated_ips_follow_the_allocation_map() {
        let mut s = ImpNetworkStatus::default();
        s.set_allocations(BTreeMap::from([
            ("10.0.0.3".to_owned(), "ns/b".to_owned()),
            ("10.0.0.2".to_owned(), "ns/a".to_owned()),
        ]));
        assert_eq!(s.allocated_ips, ["10.0.0.2", "10.0.0.3"]);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(
            json["allocatedIPs"],
            serde_json::json!(["10.0.0.2", "10.0.0.3"])
        );
        assert_eq!(json["allocations"]["10.0.0.3"], "ns/b");
        s.set_allocations(BTreeMap::new());
        assert!(s.allocated_ips.is_empty());
    }

    #[test]
    fn identities_are_stable_and_distinct() {
        assert_eq!(vm_mac("ns", "a"), vm_mac("ns", "a"));
        assert_ne!(vm_mac("ns", "a"), vm_mac("ns", "b"));
        let mac = vm_mac("default", "web");
        assert!(mac.starts_with("02:") && mac.len() == 17, "{mac}");
        let v = vni("default", "net");
        assert!((1..1 << 24).contains(&v));
        assert_eq!(v, vni("default", "net"));
        assert_ne!(v, vni("other", "net"));
    }

    #[test]
    fn gateway_defaults_to_the_first_host() {
        let mut spec = ImpNetworkSpec {
            subnet: "10.9.0.0/24".into(),
            ..Default::default()
        };
        assert_eq!(spec.gateway_addr(), Some(Ipv4Addr::new(10, 9, 0, 1)));
        spec.gateway = Some("10.9.0.254".into());
        assert_eq!(spec.gateway_addr(), Some(Ipv4Addr::new(10, 9, 0, 254)));
        assert!(!spec.nat_enabled());
    }
}
