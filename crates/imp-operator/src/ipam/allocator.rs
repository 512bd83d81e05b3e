//! The allocation decision: which address a VM gets from a pool, given who holds what.

use std::collections::{BTreeMap, HashSet};
use std::net::Ipv4Addr;

use super::pool::Pool;

/// The address `owner` (namespace/name) already holds in `allocations` (address → owner).
pub fn held_by(allocations: &BTreeMap<String, String>, owner: &str) -> Option<Ipv4Addr> {
    allocations
        .iter()
        .find(|(_, o)| o.as_str() == owner)
        .and_then(|(ip, _)| ip.parse().ok())
}

/// The addresses held in `allocations`, as a set to pick against.
pub fn taken(allocations: &BTreeMap<String, String>) -> HashSet<Ipv4Addr> {
    allocations.keys().filter_map(|k| k.parse().ok()).collect()
}

/// The lowest address of `pool` not in `taken`; `None` when the pool is full.
pub fn pick(pool: &Pool, taken: &HashSet<Ipv4Addr>) -> Option<Ipv4Addr> {
    let start = u32::from(pool.range.network());
    let end = u32::from(pool.range.broadcast());
    let mut a = start;
    loop {
        let addr = Ipv4Addr::from(a);
        // Skip whole excluded blocks at once.
        if let Some(c) = pool.exclude.iter().find(|c| c.contains(addr)) {
            a = u32::from(c.broadcast()).checked_add(1)?;
        } else {
            if pool.admits(addr) && !taken.contains(&addr) {
                return Some(addr);
            }
            a = a.checked_add(1)?;
        }
        if a > end || a < start {
            return None;
        }
    }
}

/// How many addresses of `pool` are still free.
pub fn free(pool: &Pool, allocations: &BTreeMap<String, String>) -> u64 {
    let held = allocations
        .keys()
        .filter_map(|k| k.parse::<Ipv4Addr>().ok())
        .filter(|a| pool.admits(*a))
        .count() as u64;
    pool.usable().saturating_sub(held)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::ipam::pool::{Internal, PoolSource};
    use imp_api::network::{ImpNetworkSpec, NetworkGroup};

    fn spec(subnet: &str) -> ImpNetworkSpec {
        ImpNetworkSpec {
            subnet: subnet.into(),
            ..Default::default()
        }
    }

    #[test]
    fn fills_a_small_network_without_gateway_network_or_broadcast_then_reports_full() {
        let pool = Internal.pool(&spec("10.0.0.0/29"), None).unwrap();
        let mut allocs = BTreeMap::new();
        let mut got = Vec::new();
        while let Some(ip) = pick(&pool, &taken(&allocs)) {
            allocs.insert(ip.to_string(), format!("ns/vm{}", got.len()));
            got.push(ip.to_string());
        }
        assert_eq!(
            got,
            ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
        );
        assert_eq!(free(&pool, &allocs), 0);
        assert_eq!(
            held_by(&allocs, "ns/vm3"),
            Some("10.0.0.5".parse().unwrap())
        );
        assert_eq!(held_by(&allocs, "ns/other"), None);
        // A released address is handed out again.
        allocs.remove("10.0.0.3");
        assert_eq!(
            pick(&pool, &taken(&allocs)),
            Some("10.0.0.3".parse().unwrap())
        );
    }

    #[test]
    fn ungrouped_vms_jump_over_group_blocks_and_honour_a_custom_gateway() {
        let mut s = spec("10.0.0.0/24");
        s.gateway = Some("10.0.0.254".into());
        s.groups = vec![NetworkGroup {
            name: "g".into(),
            expected_size: 14,
            ..Default::default()
        }];
        let pool = Internal.pool(&s, None).unwrap();
        assert_eq!(
            pick(&pool, &HashSet::new()),
            Some("10.0.0.16".parse().unwrap())
        );
        let group = Internal.pool(&s, Some("g")).unwrap();
        // With the gateway elsewhere, .1 is a host address of group g.
        assert_eq!(
            pick(&group, &HashSet::new()),
            Some("10.0.0.1".parse().unwrap())
        );
        let mut all = BTreeMap::new();
        for i in 16..=253u8 {
            all.insert(format!("10.0.0.{i}"), format!("ns/{i}"));
        }
        assert_eq!(pick(&pool, &taken(&all)), None);
        assert_eq!(free(&pool, &all), 0);
    }
}
