//! Where a VM's address may come from: a [`PoolSource`] turns a network (and the VM's group)
//! into a [`Pool`]. The internal source carves the network's own subnet; a Cilium source
//! (reading a CiliumPodIPPool) can be added beside it without touching the allocator.

use std::net::Ipv4Addr;

use imp_api::ipv4::Ipv4Cidr;
use imp_api::network::{ImpNetworkSpec, IpamProvider};

use super::groups;

/// A range to draw addresses from, minus what must never be handed out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// The range addresses come from.
    pub range: Ipv4Cidr,
    /// Ranges inside `range` that belong to someone else (group CIDRs, for ungrouped VMs).
    pub exclude: Vec<Ipv4Cidr>,
    /// Single addresses never handed out (the gateway, the subnet's network and broadcast).
    pub reserved: Vec<Ipv4Addr>,
}

impl Pool {
    /// Whether `addr` may be handed out (ignoring who holds what).
    pub fn admits(&self, addr: Ipv4Addr) -> bool {
        self.range.contains(addr)
            && !self.range.is_reserved(addr)
            && !self.reserved.contains(&addr)
            && !self.exclude.iter().any(|c| c.contains(addr))
    }

    /// How many addresses the pool can hand out in all.
    pub fn usable(&self) -> u64 {
        let mut n = self.range.size();
        if self.range.prefix() <= 30 {
            n -= 2;
        }
        for c in &self.exclude {
            if self.range.covers(c) {
                // Excluded blocks never hold the range's own network or broadcast address
                // unless they start or end it.
                let edges =
                    u64::from(c.contains(self.range.network()) && self.range.prefix() <= 30)
                        + u64::from(
                            c.contains(self.range.broadcast()) && self.range.prefix() <= 30,
                        );
                n = n.saturating_sub(c.size() - edges);
            }
        }
        let mut extra: Vec<Ipv4Addr> = self
            .reserved
            .iter()
            .copied()
            .filter(|a| {
                self.range.contains(*a)
                    && !self.range.is_reserved(*a)
                    && !self.exclude.iter().any(|c| c.contains(*a))
            })
            .collect();
        extra.sort();
        extra.dedup();
        n.saturating_sub(extra.len() as u64)
    }
}

/// Why no pool could be found for a VM.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// `spec.subnet` does not parse (admission refuses such a spec).
    #[error("spec.subnet {subnet:?} is not an IPv4 CIDR")]
    Subnet {
        /// What the spec says.
        subnet: String,
    },
    /// The groups do not fit.
    #[error(transparent)]
    Groups(#[from] groups::CarveError),
    /// The VM names a group the network does not have.
    #[error("it has no group {0:?} (spec.networkGroup of the VM)")]
    NoGroup(String),
    /// The provider is not implemented yet.
    #[error("ipam.provider {0} is not supported yet")]
    Unsupported(&'static str),
}

/// Source of the address range of a VM on a network.
pub trait PoolSource: Send + Sync {
    /// The pool a VM in `group` (or none) of the network with `spec` draws from.
    fn pool(&self, spec: &ImpNetworkSpec, group: Option<&str>) -> Result<Pool, PoolError>;
}

/// The network's own subnet: group VMs draw from their group's CIDR, the others from the
/// subnet outside every group CIDR.
#[derive(Clone, Copy, Debug, Default)]
pub struct Internal;

impl PoolSource for Internal {
    fn pool(&self, spec: &ImpNetworkSpec, group: Option<&str>) -> Result<Pool, PoolError> {
        let subnet = spec.subnet_cidr().map_err(|_| PoolError::Subnet {
            subnet: spec.subnet.clone(),
        })?;
        let carved = groups::carve(subnet, &spec.groups)?;
        let mut reserved = vec![subnet.network(), subnet.broadcast()];
        reserved.extend(spec.gateway_addr());
        let (range, exclude) = match group {
            Some(g) => {
                let cidr = carved
                    .iter()
                    .find(|(n, _)| n == g)
                    .map(|(_, c)| *c)
                    .ok_or_else(|| PoolError::NoGroup(g.to_owned()))?;
                (cidr, Vec::new())
            }
            None => (subnet, carved.into_iter().map(|(_, c)| c).collect()),
        };
        Ok(Pool {
            range,
            exclude,
            reserved,
        })
    }
}

/// The pool source of a network's `ipam.provider`.
pub fn source_for(spec: &ImpNetworkSpec) -> Result<&'static dyn PoolSource, PoolError> {
    match spec.ipam.as_ref().map(|i| i.provider) {
        None | Some(IpamProvider::Internal) => Ok(&Internal),
        Some(IpamProvider::Cilium) => Err(PoolError::Unsupported("cilium")),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::network::NetworkGroup;

    fn spec(subnet: &str, groups: &[(&str, i32)]) -> ImpNetworkSpec {
        ImpNetworkSpec {
            subnet: subnet.into(),
            groups: groups
                .iter()
                .map(|(n, s)| NetworkGroup {
                    name: (*n).into(),
                    expected_size: *s,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn ungrouped_vms_skip_gateway_edges_and_group_cidrs() {
        let p = Internal.pool(&spec("10.0.0.0/29", &[]), None).unwrap();
        let admitted: Vec<u8> = (0..8u8)
            .filter(|i| p.admits(Ipv4Addr::new(10, 0, 0, *i)))
            .collect();
        assert_eq!(admitted, [2, 3, 4, 5, 6]);
        assert_eq!(p.usable(), 5);

        let g = Internal
            .pool(&spec("10.0.0.0/24", &[("a", 14)]), None)
            .unwrap();
        assert!(!g.admits("10.0.0.5".parse().unwrap()));
        assert!(g.admits("10.0.0.16".parse().unwrap()));
        assert_eq!(g.usable(), 256 - 16 - 1);
    }

    #[test]
    fn group_vms_draw_from_their_group_only() {
        let s = spec("10.0.0.0/24", &[("a", 2), ("b", 14)]);
        let a = Internal.pool(&s, Some("a")).unwrap();
        assert_eq!(a.range.to_string(), "10.0.0.0/30");
        // 10.0.0.1 is the gateway: group a keeps only .2.
        assert_eq!(a.usable(), 1);
        let b = Internal.pool(&s, Some("b")).unwrap();
        assert_eq!(b.range.to_string(), "10.0.0.16/28");
        assert_eq!(b.usable(), 14);
        assert_eq!(
            Internal.pool(&s, Some("c")).unwrap_err(),
            PoolError::NoGroup("c".into())
        );
    }

    #[test]
    fn the_cilium_provider_is_refused_clearly() {
        let mut s = spec("10.0.0.0/24", &[]);
        s.ipam = Some(imp_api::network::IpamSpec {
            provider: IpamProvider::Cilium,
            cilium: None,
        });
        let err = source_for(&s).err().unwrap();
        assert_eq!(err.to_string(), "ipam.provider cilium is not supported yet");
    }
}
