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
pub mod batch;
pub mod groups;
pub mod pool;

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use imp_api::conditions::{self, ConditionType};
use imp_api::network::{ImpNetwork, ImpNetworkStatus};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use crate::metrics::Metrics;

/// Attempts of one allocation or release against 409 conflicts.
pub const CONFLICT_ATTEMPTS: u32 = 8;

/// Why a VM got no address (cloned to every VM of a batch that failed together).
#[derive(Clone, Debug, thiserror::Error)]
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
    /// The network has not been reconciled yet (just created, or its spec just changed): the
    /// VM waits for it without a failure being reported.
    #[error("network {network} is not Ready yet: {why}")]
    Unreconciled {
        /// namespace/name.
        network: String,
        /// What is not reconciled yet.
        why: String,
    },
    /// The network's Ready condition is not True.
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
        source: Arc<kube::Error>,
    },
    /// The table kept changing under us.
    #[error("ImpNetwork {0} kept changing: gave up after {CONFLICT_ATTEMPTS} conflicting writes")]
    Conflicts(String),
}

impl Error {
    /// Whether this is about the network (reported on the VM as `NetworkSetupFailed`), rather
    /// than a failed request that is retried.
    pub fn is_setup_failure(&self) -> bool {
        !matches!(
            self,
            Self::Kube { .. } | Self::Conflicts(_) | Self::Unreconciled { .. }
        )
    }

    /// Whether the network only has to catch up (reported on the VM as `Waiting`, no warning).
    pub fn is_wait(&self) -> bool {
        matches!(self, Self::Unreconciled { .. })
    }
}

/// namespace/name of a network.
pub fn network_key(net: &ImpNetwork) -> String {
    format!("{}/{}", net.namespace().unwrap_or_default(), net.name_any())
}

/// Why a network hands out no addresses, from its Ready condition: `Unreconciled` while the
/// operator has not looked at its current spec, `NotReady` when it found it wanting; `None`
/// when it is Ready for its current generation.
/// `network` is how the errors name it (namespace/name, and group if any).
pub fn not_ready(net: &ImpNetwork, network: &str) -> Option<Error> {
    let unreconciled = |why: &str| {
        Some(Error::Unreconciled {
            network: network.to_owned(),
            why: why.to_owned(),
        })
    };
    let status = net.status.clone().unwrap_or_default();
    let Some(c) = conditions::find(&status.conditions, ConditionType::Ready) else {
        return unreconciled("not reconciled yet");
    };
    match (c.observed_generation, net.metadata.generation) {
        (Some(seen), Some(current)) if seen < current => {
            unreconciled("its new spec is not reconciled yet")
        }
        _ if c.status != "True" => Some(Error::NotReady {
            network: network.to_owned(),
            why: format!("{}: {}", c.reason, c.message),
        }),
        _ => None,
    }
}

/// The resource label of ImpNetwork writes in `imp_operator_conflicts_total`.
pub const CONFLICT_RESOURCE: &str = "impnetwork";

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
        field_manager: Some(crate::FIELD_MANAGER.to_owned()),
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

/// A request waiting in a network's queue, and where its answer goes.
type Queued = (
    batch::Want,
    tokio::sync::oneshot::Sender<Result<Ipv4Addr, Error>>,
);

/// `table` (address → owner) with `from`'s addresses given to `to`, and whether anything
/// changed. `to` keeps what it already holds.
pub fn handed_over(
    table: &BTreeMap<String, String>,
    from: &str,
    to: &str,
) -> (BTreeMap<String, String>, bool) {
    let mut changed = false;
    let out = table
        .iter()
        .map(|(a, o)| {
            if o == from {
                changed = true;
                (a.clone(), to.to_owned())
            } else {
                (a.clone(), o.clone())
            }
        })
        .collect();
    (out, changed)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// The cluster's allocator: per-network locks over the tables persisted in ImpNetwork status.
pub struct Ipam {
    client: kube::Client,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Requests waiting for their network's lock, served together by whoever takes it.
    queues: Mutex<HashMap<String, Vec<Queued>>>,
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
            queues: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The in-process lock of one network's table (held across the read and the write).
    pub async fn lock(&self, network: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = lock(&self.locks)
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
                source: Arc::new(source),
            })?
            .ok_or(Error::Missing { network })
    }

    /// The address of `owner` (namespace/name) on network `namespace/name`: the one it holds,
    /// else the lowest free one of its pool (its `group`'s block, if any), recorded in the
    /// network's status before it is returned.
    ///
    /// Requests for one network are served in batches: each joins the network's queue, and
    /// whoever takes the network's lock decides the whole queue on one read and writes it
    /// with one status patch, so a thousand VMs created at once cost a few writes, not a
    /// thousand.
    pub async fn ensure(
        &self,
        namespace: &str,
        name: &str,
        owner: &str,
        group: Option<&str>,
    ) -> Result<Ipv4Addr, Error> {
        let network = format!("{namespace}/{name}");
        let (reply, answer) = tokio::sync::oneshot::channel();
        let want = batch::Want {
            owner: owner.to_owned(),
            group: group.map(str::to_owned),
        };
        lock(&self.queues)
            .entry(network.clone())
            .or_default()
            .push((want, reply));
        {
            let _guard = self.lock(&network).await;
            let queued = lock(&self.queues).remove(&network).unwrap_or_default();
            if !queued.is_empty() {
                let (wants, replies): (Vec<_>, Vec<_>) = queued.into_iter().unzip();
                let results = self.allocate(namespace, name, &network, &wants).await;
                for (reply, result) in replies.into_iter().zip(results) {
                    let _ = reply.send(result);
                }
            }
        }
        // Our request was queued before we took the lock, so it has been answered: by us, or
        // by an earlier holder (unless that one was cancelled mid-way: then try again later).
        answer.await.unwrap_or(Err(Error::Conflicts(network)))
    }

    /// Decides and writes one batch, re-deciding on a fresh read after a conflict.
    async fn allocate(
        &self,
        namespace: &str,
        name: &str,
        network: &str,
        wants: &[batch::Want],
    ) -> Vec<Result<Ipv4Addr, Error>> {
        for attempt in 0..CONFLICT_ATTEMPTS {
            let net = match self.read(namespace, name).await {
                Ok(net) => net,
                Err(e) => return vec![Err(e); wants.len()],
            };
            let mut decision = batch::decide(&net, network, wants);
            if decision.added.is_empty() {
                return decision.results;
            }
            let mut status = net.status.clone().unwrap_or_default();
            status.set_allocations(std::mem::take(&mut decision.table));
            match write_status(&self.client, &net, &status, "allocating addresses on").await {
                Ok(_) => {
                    for &i in &decision.added {
                        if let Ok(ip) = &decision.results[i] {
                            tracing::info!(vm = %wants[i].owner, network = %network, ip = %ip, "address allocated");
                        }
                    }
                    if let Ok(pool) =
                        pool::source_for(&net.spec).and_then(|s| s.pool(&net.spec, None))
                    {
                        self.observe(network, &pool, &status.allocations);
                    }
                    return decision.results;
                }
                Err(e) if is_conflict(&e) => {
                    self.conflict();
                    tracing::debug!(network = %network, attempt, batch = wants.len(), "allocation conflict; re-reading");
                }
                Err(source) => {
                    let err = Error::Kube {
                        doing: "allocating addresses on",
                        network: network.to_owned(),
                        source: Arc::new(source),
                    };
                    for &i in &decision.added {
                        decision.results[i] = Err(err.clone());
                    }
                    return decision.results;
                }
            }
        }
        vec![Err(Error::Conflicts(network.to_owned())); wants.len()]
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
                Err(e) if is_conflict(&e) => self.conflict(),
                Err(source) => {
                    return Err(Error::Kube {
                        doing: "releasing addresses on",
                        network,
                        source: Arc::new(source),
                    });
                }
            }
        }
        Err(Error::Conflicts(network))
    }

    /// Hands the addresses VM `from` holds on network `namespace/name` to VM `to` (both
    /// namespace/name), in one status write under the network's lock: a warm pool's claim,
    /// whose claimant keeps its member's address. The address `to` then holds, if any (already
    /// moved: the same, with no write).
    pub async fn transfer(
        &self,
        namespace: &str,
        name: &str,
        from: &str,
        to: &str,
    ) -> Result<Option<Ipv4Addr>, Error> {
        let network = format!("{namespace}/{name}");
        let _guard = self.lock(&network).await;
        for _ in 0..CONFLICT_ATTEMPTS {
            let net = self.read(namespace, name).await?;
            let mut status = net.status.clone().unwrap_or_default();
            let (table, changed) = handed_over(&status.allocations, from, to);
            let held = table
                .iter()
                .find(|(_, o)| o.as_str() == to)
                .and_then(|(a, _)| a.parse().ok());
            if !changed {
                return Ok(held);
            }
            status.set_allocations(table);
            match write_status(&self.client, &net, &status, "moving an address on").await {
                Ok(_) => {
                    tracing::info!(network = %network, from, to, ip = ?held, "address handed over");
                    return Ok(held);
                }
                Err(e) if is_conflict(&e) => self.conflict(),
                Err(source) => {
                    return Err(Error::Kube {
                        doing: "moving an address on",
                        network,
                        source: Arc::new(source),
                    });
                }
            }
        }
        Err(Error::Conflicts(network))
    }

    /// Counts a write of an ImpNetwork's status refused with 409.
    fn conflict(&self) {
        if let Some(m) = &self.metrics {
            m.conflict(CONFLICT_RESOURCE, crate::metrics::Write::Status);
        }
    }

    fn observe(&self, network: &str, pool: &pool::Pool, table: &BTreeMap<String, String>) {
        if let Some(m) = &self.metrics {
            m.set_ipam(network, table.len() as u64, allocator::free(pool, table));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::conditions::{ConditionReason, ConditionStatus};
    use imp_api::network::ImpNetworkSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    pub(crate) fn ready_net(subnet: &str) -> ImpNetwork {
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
    fn an_address_is_handed_from_a_member_to_its_claimant_once() {
        let table = BTreeMap::from([
            ("10.0.0.2".to_owned(), "ci/py-x7k2p".to_owned()),
            ("10.0.0.3".to_owned(), "ci/other".to_owned()),
        ]);
        let (moved, changed) = handed_over(&table, "ci/py-x7k2p", "ci/job");
        assert!(changed);
        assert_eq!(moved["10.0.0.2"], "ci/job");
        assert_eq!(moved["10.0.0.3"], "ci/other");
        // Again: nothing to move.
        let (again, changed) = handed_over(&moved, "ci/py-x7k2p", "ci/job");
        assert!(!changed);
        assert_eq!(again, moved);
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
