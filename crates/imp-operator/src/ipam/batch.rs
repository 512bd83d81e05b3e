//! The allocation decision for a batch of VMs waiting on one network: every VM that already
//! holds an address keeps it, every other one gets the lowest free address of its pool, and
//! the new table is written once for the whole batch (see [`super::Ipam::ensure`]).

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;

use imp_api::network::ImpNetwork;
use kube::Resource;

use super::{Error, allocator, not_ready, pool};

/// One VM asking for an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    /// The VM, `namespace/name`.
    pub owner: String,
    /// Its group on the network, if any.
    pub group: Option<String>,
}

/// What a batch decided.
#[derive(Debug)]
pub struct Decision {
    /// The allocation table after the batch (address → owner).
    pub table: BTreeMap<String, String>,
    /// Per [`Want`], in order: its address or why it has none.
    pub results: Vec<Result<Ipv4Addr, Error>>,
    /// Indexes of the wants that got a new address (the table must be written for them).
    pub added: Vec<usize>,
}

/// Decides `wants` against `net` as it was read (`network` is its `namespace/name`).
pub fn decide(net: &ImpNetwork, network: &str, wants: &[Want]) -> Decision {
    let mut table = net.status.clone().unwrap_or_default().allocations;
    let mut held: HashMap<String, Ipv4Addr> = table
        .iter()
        .filter_map(|(ip, owner)| Some((owner.clone(), ip.parse().ok()?)))
        .collect();
    let mut taken = allocator::taken(&table);
    let gate = gate(net, network);
    let mut pools: HashMap<Option<String>, Result<pool::Pool, Error>> = HashMap::new();
    let mut results = Vec::with_capacity(wants.len());
    let mut added = Vec::new();
    for (i, want) in wants.iter().enumerate() {
        if let Some(ip) = held.get(&want.owner) {
            results.push(Ok(*ip));
            continue;
        }
        if let Some(e) = &gate {
            results.push(Err(e.clone()));
            continue;
        }
        let pool = pools
            .entry(want.group.clone())
            .or_insert_with(|| pool_of(net, network, want.group.as_deref()));
        let got = pool.clone().and_then(|pool| {
            allocator::pick(&pool, &taken).ok_or_else(|| full(network, &want.group, &pool))
        });
        if let Ok(ip) = got {
            table.insert(ip.to_string(), want.owner.clone());
            held.insert(want.owner.clone(), ip);
            taken.insert(ip);
            added.push(i);
        }
        results.push(got);
    }
    Decision {
        table,
        results,
        added,
    }
}

/// Why the network hands out no new address at all, if it does not.
fn gate(net: &ImpNetwork, network: &str) -> Option<Error> {
    if net.meta().deletion_timestamp.is_some() {
        return Some(Error::Deleting {
            network: network.to_owned(),
        });
    }
    not_ready(net, network)
}

fn pool_of(net: &ImpNetwork, network: &str, group: Option<&str>) -> Result<pool::Pool, Error> {
    pool::source_for(&net.spec)
        .and_then(|s| s.pool(&net.spec, group))
        .map_err(|source| Error::Pool {
            network: network.to_owned(),
            source,
        })
}

fn full(network: &str, group: &Option<String>, pool: &pool::Pool) -> Error {
    Error::Full {
        network: match group {
            Some(g) => format!("{network} group {g}"),
            None => network.to_owned(),
        },
        range: pool.range.to_string(),
        usable: pool.usable(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::ipam::tests::ready_net;

    fn want(owner: &str) -> Want {
        Want {
            owner: owner.into(),
            group: None,
        }
    }

    fn addrs(d: &Decision) -> Vec<String> {
        d.results
            .iter()
            .map(|r| match r {
                Ok(ip) => ip.to_string(),
                Err(e) => e.to_string(),
            })
            .collect()
    }

    #[test]
    fn a_batch_gets_distinct_addresses_and_holders_keep_theirs() {
        let mut net = ready_net("10.0.0.0/24");
        let mut table = BTreeMap::new();
        table.insert("10.0.0.2".to_owned(), "ns/old".to_owned());
        net.status.as_mut().unwrap().set_allocations(table);
        let wants = [want("ns/a"), want("ns/old"), want("ns/b"), want("ns/a")];
        let d = decide(&net, "ns/net", &wants);
        assert_eq!(addrs(&d), ["10.0.0.3", "10.0.0.2", "10.0.0.4", "10.0.0.3"]);
        assert_eq!(d.added, [0, 2]);
        assert_eq!(d.table.len(), 3);
    }

    #[test]
    fn a_full_network_names_itself_and_its_size_and_fills_up_first() {
        let net = ready_net("10.0.0.0/29");
        let wants: Vec<Want> = (0..6).map(|i| want(&format!("ns/{i}"))).collect();
        let d = decide(&net, "ns/net", &wants);
        assert_eq!(d.added, [0, 1, 2, 3, 4]);
        let err = d.results[5].as_ref().unwrap_err();
        assert_eq!(
            err.to_string(),
            "network ns/net 10.0.0.0/29 has no free address (5 usable)"
        );
        assert!(err.is_setup_failure());
    }

    #[test]
    fn a_network_not_ready_or_with_a_newer_spec_hands_out_nothing_new() {
        let mut net = ready_net("10.0.0.0/24");
        assert_eq!(
            addrs(&decide(&net, "ns/net", &[want("ns/a")])),
            ["10.0.0.2"]
        );
        let mut table = BTreeMap::new();
        table.insert("10.0.0.9".to_owned(), "ns/old".to_owned());
        net.status.as_mut().unwrap().set_allocations(table);
        net.metadata.generation = Some(2);
        let d = decide(&net, "ns/net", &[want("ns/a"), want("ns/old")]);
        let waits = d.results[0].as_ref().unwrap_err();
        assert!(waits.is_wait() && !waits.is_setup_failure(), "{waits}");
        assert!(addrs(&d)[0].contains("new spec is not reconciled yet"));
        assert_eq!(addrs(&d)[1], "10.0.0.9", "a holder keeps its address");
        assert!(d.added.is_empty());
        net.status = None;
        let d = decide(&net, "ns/net", &[want("ns/a")]);
        assert!(d.results[0].as_ref().is_err_and(Error::is_wait));
        assert_eq!(
            addrs(&d)[0],
            "network ns/net is not Ready yet: not reconciled yet"
        );
    }
}
