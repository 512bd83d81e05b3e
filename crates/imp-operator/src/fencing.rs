//! How long each node's agent has been silent, for moving VMs off a lost node only once the
//! agent has surely fenced them.
//!
//! Every node agent renews a Lease of its own (label [`LABEL_AGENT_LEASE`], holder the node,
//! `leaseDurationSeconds` its fence deadline) and stops every VM of its node when it cannot
//! renew for that long (`imp_agent::node::fence`). The operator does not trust the Lease's
//! `renewTime` (another machine's clock): it notes, on its own monotonic clock, when it saw the
//! renewal change, as the node lifecycle controller does with kubelets' Leases. A node's agent
//! is silent from that moment; after an operator restart every agent counts as renewed at the
//! first sight, which only makes the wait longer.
//!
//! Pure bookkeeping; the controller feeds it the Lease watch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use imp_api::shared::LABEL_AGENT_LEASE;
use k8s_openapi::api::coordination::v1::Lease;

/// The last renewal seen of one node's agent Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    /// `renewTime` as written (compared, never read as a time).
    renew: Option<String>,
    /// When this process saw it change.
    at: Instant,
    /// The agent's fence deadline (`leaseDurationSeconds`).
    fence_after: Duration,
}

/// How silent one node's agent is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Silence {
    /// Since this process saw its Lease renewed.
    pub silent: Duration,
    /// By when the agent has fenced its VMs if it could not renew: its `leaseDurationSeconds`
    /// plus the operator's margin (for the agent's check interval and the kill itself).
    pub deadline: Duration,
}

impl Silence {
    /// Whether the node's VMs are surely fenced (or the agent is gone).
    pub fn fenced(&self) -> bool {
        self.silent >= self.deadline
    }
}

/// The agents' Leases as this process has seen them, by node.
#[derive(Debug, Default)]
pub struct AgentLeases {
    nodes: HashMap<String, Seen>,
}

impl AgentLeases {
    /// The watch shows `lease` at `now`.
    pub fn observe(&mut self, lease: &Lease, now: Instant) {
        let Some((node, renew, fence_after)) = agent_lease(lease) else {
            return;
        };
        match self.nodes.get_mut(&node) {
            Some(seen) if seen.renew == renew => seen.fence_after = fence_after,
            _ => {
                self.nodes.insert(
                    node,
                    Seen {
                        renew,
                        at: now,
                        fence_after,
                    },
                );
            }
        }
    }

    /// The watch says `lease` was deleted: its node has no agent Lease any more.
    pub fn forget(&mut self, lease: &Lease) {
        if let Some((node, _, _)) = agent_lease(lease) {
            self.nodes.remove(&node);
        }
    }

    /// How silent the agent of `node` is at `now`; `None` when it has no Lease (an agent
    /// that does not fence: the node's VMs are moved on the Node's condition alone).
    pub fn silence(&self, node: &str, now: Instant, margin: Duration) -> Option<Silence> {
        let seen = self.nodes.get(node)?;
        Some(Silence {
            silent: now.saturating_duration_since(seen.at),
            deadline: seen.fence_after + margin,
        })
    }
}

/// (node, renewTime, fence deadline) of an agent Lease; `None` for any other Lease.
fn agent_lease(lease: &Lease) -> Option<(String, Option<String>, Duration)> {
    let labelled = lease
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get(LABEL_AGENT_LEASE).is_some_and(|v| v == "true"));
    let spec = lease.spec.as_ref()?;
    let node = spec.holder_identity.clone()?;
    let secs = spec.lease_duration_seconds.unwrap_or(0).max(0);
    labelled.then(|| {
        (
            node,
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
            Duration::from_secs(u64::try_from(secs).unwrap_or(0)),
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn lease(node: &str, renew: &str, secs: i32, labelled: bool) -> Lease {
        let labels = if labelled {
            json!({LABEL_AGENT_LEASE: "true"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": format!("imp-agent-{node}"), "labels": labels},
            "spec": {"holderIdentity": node, "renewTime": renew, "leaseDurationSeconds": secs}
        }))
        .unwrap()
    }

    #[test]
    fn silence_counts_from_when_this_process_saw_the_renewal_change() {
        let t0 = Instant::now();
        let s = |secs| Duration::from_secs(secs);
        let mut l = AgentLeases::default();
        let margin = s(10);
        l.observe(&lease("n1", "2026-01-01T00:00:00.000000Z", 30, true), t0);
        // The same renewal seen again (a relist) does not restart the clock.
        l.observe(
            &lease("n1", "2026-01-01T00:00:00.000000Z", 30, true),
            t0 + s(20),
        );
        let at = |t| l.silence("n1", t, margin).unwrap();
        assert_eq!(at(t0 + s(25)).silent, s(25));
        assert_eq!(at(t0 + s(25)).deadline, s(40));
        assert!(!at(t0 + s(39)).fenced());
        assert!(at(t0 + s(40)).fenced());
        // A renewal (whatever its clock says, even earlier) restarts it.
        l.observe(
            &lease("n1", "2025-01-01T00:00:00.000000Z", 30, true),
            t0 + s(35),
        );
        assert_eq!(l.silence("n1", t0 + s(40), margin).unwrap().silent, s(5));
        assert_eq!(
            l.silence("n2", t0, margin),
            None,
            "no Lease, no fencing known"
        );
    }

    #[test]
    fn only_labelled_leases_with_a_holder_count_and_a_deleted_one_is_forgotten() {
        let t0 = Instant::now();
        let mut l = AgentLeases::default();
        l.observe(&lease("kubelet", "2026-01-01T00:00:00Z", 40, false), t0);
        assert_eq!(l.silence("kubelet", t0, Duration::ZERO), None);
        let a = lease("n1", "2026-01-01T00:00:00Z", 30, true);
        l.observe(&a, t0);
        assert!(l.silence("n1", t0, Duration::ZERO).is_some());
        l.forget(&a);
        assert_eq!(l.silence("n1", t0, Duration::ZERO), None);
    }
}
