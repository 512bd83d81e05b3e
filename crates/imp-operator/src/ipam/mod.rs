//! IPAM: one allocator per ImpNetwork for the whole cluster, run by the operator.
//!
//! The allocation table is `ImpNetwork.status.allocations` (address → `namespace/name` of the
//! VM, mirrored in the Go-shaped `allocatedIPs`). It is the only source of truth: nothing lives
//! only in memory, so an operator restart or failover continues where the last one stopped.
//!
//! # Protocol
//! [`Ipam::ensure`] runs under a per-network lock (so reconciles of one process never race
//! each other) and reads the network from the API server, not a cache: an address the VM
//! already holds is returned as it is (stable for the VM's life); otherwise the lowest free
//! address of the VM's [`pool::Pool`] is added to the table by a status merge patch carrying
//! the resourceVersion it was computed from. A concurrent writer in another process (an old
//! leader still finishing) makes it fail with 409, and the allocation is decided again on a
//! fresh read; so no address is ever given twice. [`Ipam::release`] removes a VM's entries
//! the same way. The operator's VM controller calls `ensure` before it writes the placement,
//! and `release` before it removes a deleted VM's finalizer; the network controller
//! ([`crate::network`]) collects entries whose VM no longer exists.
//!
//! Where the addresses come from is a [`pool::PoolSource`]: today the network's own subnet
//! ([`pool::Internal`]); a Cilium pool can be added beside it.

pub mod allocator;
pub mod groups;
pub mod pool;

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use imp_api::conditions::{self, ConditionType};
use imp_api::network::{ImpNetwork, ImpNetworkStatus};
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use crate::metrics::Metrics;

/// Field manager of the operator's ImpNetwork writes.
pub const FIELD_MANAGER: &str = "imp-operator";

/// Attempts of one allocation or release against 409 conflicts.
pub const CONFLICT_ATTEMPTS: u32 = 8;

/// Why a VM got no address.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The network does not exist.
    #[error("network {network} does not exist")]
    Missing {
        /// namespace/name.
        network: String,
    },
    /// The network is being deleted: it hands out no new address.
    #[error("network {network} is being deleted")]
    Deleting {
        /// namespace/name.
        network: String,
    },
    /// The network's Ready condition is not True (yet).
    #[error("network {network} is not Ready: {why}")]
    NotReady {
        /// namespace/name.
        network: String,
        /// The condition's reason and message, or that it has not been reconciled yet.
        why: String,
    },
    /// No pool for the VM.
    #[error("network {network}: {source}")]
    Pool {
        /// namespace/name.
        network: String,
        /// Why.
        #[source]
        source: pool::PoolError,
    },
    /// Every address of the pool is held.
    #[error("network {network} {range} has no free address ({usable} usable)")]
    Full {
        /// namespace/name (and group, if any).
        network: String,
        /// The pool's range.
        range: String,
        /// Addresses the pool can hand out in all.
        usable: u64,
    },
    /// An API call failed.
    #[error("Kubernetes API call failed while {doing} ImpNetwork {network}")]
    Kube {
        /// What was being done.
        doing: &'static str,
        /// namespace/name.
        network: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The table kept changing under us.
    #[error("ImpNetwork {0} kept changing: gave up after {CONFLICT_ATTEMPTS} conflicting writes")]
    Conflicts(String),
}

impl Error {
    /// Whether this is about the network (reported on the VM as `NetworkSetupFailed`), rather
    /// than a failed request that is retried.
    pub fn is_setup_failure(&self) -> bool {
        !matches!(self, Self::Kube { .. } | Self::Conflicts(_))
    }
}

/// namespace/name of a network.
pub fn network_key(net: &ImpNetwork) -> String {
    format!("{}/{}", net.namespace().unwrap_or_default(), net.name_any())
}

/// Why a network hands out no addresses, from its Ready condition; `None` when it is Ready
/// for its current generation.
pub fn not_ready(net: &ImpNetwork) -> Option<String> {
    let status = net.status.clone().unwrap_or_default();
    let Some(c) = conditions::find(&status.conditions, ConditionType::Ready) else {
        return Some("not reconciled yet".to_owned());
    };
    if c.status != "True" {
        return Some(format!("{}: {}", c.reason, c.message));
    }
    match (c.observed_generation, net.metadata.generation) {
        (Some(seen), Some(current)) if seen < current => {
            Some("its new spec is not reconciled yet".into())
        }
        _ => None,
    }
}

/// Writes `status` over `net`'s as a merge patch preconditioned on `net`'s resourceVersion
/// (lists and the allocation map replaced by their new value, removed keys set to null).
pub async fn write_status(
    client: &kube::Client,
    net: &ImpNetwork,
    status: &ImpNetworkStatus,
    doing: &'static str,
) -> Result<ImpNetwork, kube::Error> {
    let old = serde_json::to_value(net.status.clone().unwrap_or_default()).unwrap_or(Value::Null);
    let new = serde_json::to_value(status).unwrap_or(Value::Null);
    let diff = merge_diff(&old, &new);
    tracing::trace!(network = %network_key(net), doing, "writing network status");
    let body = json!({
        "metadata": {"resourceVersion": net.resource_version()},
        "status": diff,
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..Default::default()
    };
    Api::<ImpNetwork>::namespaced(client.clone(), &net.namespace().unwrap_or_default())
        .patch_status(&net.name_any(), &params, &Patch::Merge(&body))
        .await
}

/// The JSON merge patch turning `old` into `new` (objects recursively, everything else
/// replaced).
pub fn merge_diff(old: &Value, new: &Value) -> Value {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = serde_json::Map::new();
            for (k, v) in n {
                match o.get(k) {
                    Some(ov) if ov == v => {}
                    Some(ov) => {
                        out.insert(k.clone(), merge_diff(ov, v));
                    }
                    None => {
                        out.insert(k.clone(), v.clone());
                    }
                }
            }
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                out.insert(k.clone(), Value::Null);
            }
            Value::Object(out)
        }
        _ => new.clone(),
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// The cluster's allocator: per-network locks over the tables persisted in ImpNetwork status.
pub struct Ipam {
    client: kube::Client,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for Ipam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ipam").finish_non_exhaustive()
    }
}

impl Ipam {
    /// An allocator writing through `client`.
    pub fn new(client: kube::Client, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            client,
            locks: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The in-process lock of one network's table (held across the read and the write).
    pub async fn lock(&self, network: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = self
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(network.to_owned())
            .or_default()
            .clone();
        m.lock_owned().await
    }

    fn api(&self, namespace: &str) -> Api<ImpNetwork> {
        Api::namespaced(self.client.clone(), namespace)
    }

    async fn read(&self, namespace: &str, name: &str) -> Result<ImpNetwork, Error> {
        let network = format!("{namespace}/{name}");
        self.api(namespace)
            .get_opt(name)
            .await
            .map_err(|source| Error::Kube {
                doing: "reading",
                network: network.clone(),
                source,
            })?
            .ok_or(Error::Missing { network })
    }

    /// The address of VM `owner` (namespace/name) in `group` on network `namespace/name`:
    /// the one it holds, else a new one, persisted before it is returned.
    pub async fn ensure(
        &self,
        namespace: &str,
        name: &str,
        owner: &str,
        group: Option<&str>,
    ) -> Result<Ipv4Addr, Error> {
        let network = format!("{namespace}/{name}");
        let _guard = self.lock(&network).await;
        for attempt in 0..CONFLICT_ATTEMPTS {
            let net = self.read(namespace, name).await?;
            let mut status = net.status.clone().unwrap_or_default();
            if let Some(ip) = allocator::held_by(&status.allocations, owner) {
                return Ok(ip);
            }
            let (ip, pool) = decide(&net, &network, group)?;
            status.allocations.insert(ip.to_string(), owner.to_owned());
            let table = std::mem::take(&mut status.allocations);
            status.set_allocations(table);
            match write_status(&self.client, &net, &status, "allocating an address on").await {
                Ok(_) => {
                    tracing::info!(vm = %owner, network = %network, ip = %ip, "address allocated");
                    self.observe(&network, &pool, &status.allocations);
                    return Ok(ip);
                }
                Err(e) if is_conflict(&e) => {
                    tracing::debug!(vm = %owner, network = %network, attempt, "allocation conflict; re-reading");
                }
                Err(source) => {
                    return Err(Error::Kube {
                        doing: "allocating an address on",
                        network,
                        source,
                    });
                }
            }
        }
        Err(Error::Conflicts(network))
    }

    /// Removes every address VM `owner` holds on network `namespace/name` (absent network or
    /// entry: nothing to do).
    pub async fn release(&self, namespace: &str, name: &str, owner: &str) -> Result<(), Error> {
        let network = format!("{namespace}/{name}");
        let _guard = self.lock(&network).await;
        self.release_locked(namespace, name, &[owner.to_owned()])
            .await
    }

    /// [`Self::release`] of several owners, for a caller already holding the network's lock.
    pub async fn release_locked(
        &self,
        namespace: &str,
        name: &str,
        owners: &[String],
    ) -> Result<(), Error> {
        let network = format!("{namespace}/{name}");
        for _ in 0..CONFLICT_ATTEMPTS {
            let net = match self.read(namespace, name).await {
                Err(Error::Missing { .. }) => return Ok(()),
                other => other?,
            };
            let mut status = net.status.clone().unwrap_or_default();
            let table: BTreeMap<String, String> = status
                .allocations
                .iter()
                .filter(|(_, o)| !owners.contains(o))
                .map(|(a, o)| (a.clone(), o.clone()))
                .collect();
            if table.len() == status.allocations.len() {
                return Ok(());
            }
            status.set_allocations(table);
            match write_status(&self.client, &net, &status, "releasing addresses on").await {
                Ok(_) => {
                    tracing::info!(network = %network, vms = ?owners, "addresses released");
                    if let Ok(pool) =
                        pool::source_for(&net.spec).and_then(|s| s.pool(&net.spec, None))
                    {
                        self.observe(&network, &pool, &status.allocations);
                    }
                    return Ok(());
                }
                Err(e) if is_conflict(&e) => {}
                Err(source) => {
                    return Err(Error::Kube {
                        doing: "releasing addresses on",
                        network,
                        source,
                    });
                }
            }
        }
        Err(Error::Conflicts(network))
    }

    fn observe(&self, network: &str, pool: &pool::Pool, table: &BTreeMap<String, String>) {
        if let Some(m) = &self.metrics {
            m.set_ipam(network, table.len() as u64, allocator::free(pool, table));
        }
    }
}

/// The address a new VM in `group` gets on `net`, with the pool it came from.
fn decide(
    net: &ImpNetwork,
    network: &str,
    group: Option<&str>,
) -> Result<(Ipv4Addr, pool::Pool), Error> {
    if net.meta().deletion_timestamp.is_some() {
        return Err(Error::Deleting {
            network: network.to_owned(),
        });
    }
    if let Some(why) = not_ready(net) {
        return Err(Error::NotReady {
            network: network.to_owned(),
            why,
        });
    }
    let pool = pool::source_for(&net.spec)
        .and_then(|s| s.pool(&net.spec, group))
        .map_err(|source| Error::Pool {
            network: network.to_owned(),
            source,
        })?;
    let table = net.status.clone().unwrap_or_default().allocations;
    match allocator::pick(&pool, &table) {
        Some(ip) => Ok((ip, pool)),
        None => Err(Error::Full {
            network: match group {
                Some(g) => format!("{network} group {g}"),
                None => network.to_owned(),
            },
            range: pool.range.to_string(),
            usable: pool.usable(),
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::conditions::{ConditionReason, ConditionStatus};
    use imp_api::network::ImpNetworkSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn ready_net(subnet: &str) -> ImpNetwork {
        let mut net = ImpNetwork::new(
            "net",
            ImpNetworkSpec {
                subnet: subnet.into(),
                ..Default::default()
            },
        );
        net.metadata.generation = Some(1);
        let mut status = ImpNetworkStatus::default();
        conditions::set(
            &mut status.conditions,
            ConditionType::Ready,
            ConditionStatus::True,
            ConditionReason::Reconciled,
            "ok",
            Some(1),
            Time(k8s_openapi::jiff::Timestamp::now()),
        );
        net.status = Some(status);
        net
    }

    #[test]
    fn a_full_network_names_itself_and_its_size() {
        let mut net = ready_net("10.0.0.0/29");
        let mut table = BTreeMap::new();
        for i in 2..=6 {
            table.insert(format!("10.0.0.{i}"), format!("ns/{i}"));
        }
        net.status.as_mut().unwrap().set_allocations(table);
        let err = decide(&net, "ns/net", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "network ns/net 10.0.0.0/29 has no free address (5 usable)"
        );
        assert!(err.is_setup_failure());
    }

    #[test]
    fn a_network_not_ready_or_with_a_newer_spec_hands_out_nothing() {
        let mut net = ready_net("10.0.0.0/24");
        assert_eq!(
            decide(&net, "ns/net", None).unwrap().0.to_string(),
            "10.0.0.2"
        );
        net.metadata.generation = Some(2);
        let err = decide(&net, "ns/net", None).unwrap_err();
        assert!(err.to_string().contains("not Ready"), "{err}");
        net.status = None;
        assert!(
            decide(&net, "ns/net", None)
                .unwrap_err()
                .to_string()
                .contains("not reconciled yet")
        );
    }

    #[test]
    fn merge_diff_sets_removed_keys_to_null_and_replaces_lists() {
        let old = json!({"allocations": {"a": "x", "b": "y"}, "allocatedIPs": ["a", "b"]});
        let new = json!({"allocations": {"a": "x"}, "allocatedIPs": ["a"]});
        assert_eq!(
            merge_diff(&old, &new),
            json!({"allocations": {"b": null}, "allocatedIPs": ["a"]})
        );
    }
}
