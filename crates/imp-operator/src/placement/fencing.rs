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
//! Only an agent's own Lease counts (see [`Trust`]): `imp-agent-<node>` in the agents'
//! namespace, held by `<node>`, stating a deadline in a sane range. Anyone who may write a
//! Lease somewhere else (a tenant in their namespace) could otherwise claim to be a node's
//! agent: with a huge deadline that node's VMs would never move, with zero they would move at
//! once while they still run. A Lease that fails a check is ignored whole (it renews nothing
//! and sets no deadline); the watch logs it once and counts it
//! (`imp_operator_agent_leases_ignored_total`).
//!
//! Pure bookkeeping; the controller feeds it the Lease watch.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use imp_api::shared::{AGENT_LEASE_PREFIX, LABEL_AGENT_LEASE};
use k8s_openapi::api::coordination::v1::Lease;

/// The longest fence deadline a Lease may state unless the operator expects a longer one
/// ([`Trust::fence_after`]); a Lease stating more is ignored (a node that would never be
/// fenced).
pub const MAX_FENCE_AFTER: Duration = Duration::from_secs(600);

/// Which agent Leases this operator believes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trust {
    /// The agents' namespace (the release namespace): a Lease in any other is not an agent's.
    pub namespace: String,
    /// The agents' `--fence-after` as the operator is told it (the chart passes the agents'
    /// own value): the shortest deadline the operator assumes, whatever a Lease states, so a
    /// Lease saying less cannot hurry a move. A Lease may state more (an agent whose deadline
    /// was raised before the operator was told), up to [`MAX_FENCE_AFTER`] or this, whichever
    /// is longer; the longer of the two is waited for.
    pub fence_after: Duration,
}

impl Default for Trust {
    fn default() -> Self {
        Self {
            namespace: "imp-system".to_owned(),
            fence_after: Duration::from_secs(30),
        }
    }
}

/// Why a Lease labelled as an agent's was ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, strum::VariantArray)]
pub enum Ignored {
    /// It is not in the agents' namespace.
    Namespace,
    /// Its name is not `imp-agent-<its holderIdentity>`.
    Holder,
    /// Its `leaseDurationSeconds` is missing or out of range.
    Duration,
}

impl Ignored {
    /// Every reason, for the metric's zero series.
    pub const ALL: &'static [Self] = <Self as strum::VariantArray>::VARIANTS;

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Namespace => "namespace",
            Self::Holder => "holder",
            Self::Duration => "duration",
        }
    }
}

/// What one sight of a Lease did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not labelled as an agent's Lease: none of ours.
    Other,
    /// An agent's own Lease, taken in.
    Counted,
    /// Labelled as an agent's, but ignored; `first`: the first time for this Lease and reason
    /// (log it then, not on every renewal).
    Ignored {
        /// Why.
        why: Ignored,
        /// What was wrong, for the log: the namespace, holder or duration found.
        detail: String,
        /// First time for this Lease and reason.
        first: bool,
    },
}

/// The last renewal seen of one node's agent Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    /// `renewTime` as written (compared, never read as a time).
    renew: Option<String>,
    /// When this process saw it change.
    at: Instant,
    /// The deadline the Lease states (`leaseDurationSeconds`, in range).
    fence_after: Duration,
}

/// How silent one node's agent is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Silence {
    /// Since this process saw its Lease renewed.
    pub silent: Duration,
    /// By when the agent has fenced its VMs if it could not renew: the longer of its Lease's
    /// `leaseDurationSeconds` and [`Trust::fence_after`], plus the operator's margin (for the
    /// agent's check interval and the kill itself).
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
    trust: Trust,
    nodes: HashMap<String, Seen>,
    /// Leases (`namespace/name`) already reported ignored, by reason.
    reported: HashSet<(String, Ignored)>,
}

/// An agent's own Lease, as believed.
#[derive(Debug, PartialEq, Eq)]
struct AgentLease {
    node: String,
    renew: Option<String>,
    fence_after: Duration,
}

impl AgentLeases {
    /// Believing only the Leases `trust` allows.
    pub fn new(trust: Trust) -> Self {
        Self {
            trust,
            ..Self::default()
        }
    }

    /// The watch shows `lease` at `now`.
    pub fn observe(&mut self, lease: &Lease, now: Instant) -> Verdict {
        let found = match judge(lease, &self.trust) {
            Ok(None) => return Verdict::Other,
            Ok(Some(found)) => found,
            Err((why, detail)) => {
                let first = self.reported.insert((key(lease), why));
                return Verdict::Ignored { why, detail, first };
            }
        };
        match self.nodes.get_mut(&found.node) {
            Some(seen) if seen.renew == found.renew => seen.fence_after = found.fence_after,
            _ => {
                self.nodes.insert(
                    found.node,
                    Seen {
                        renew: found.renew,
                        at: now,
                        fence_after: found.fence_after,
                    },
                );
            }
        }
        Verdict::Counted
    }

    /// The watch says `lease` was deleted: if it was a node's agent Lease, that node has none
    /// any more.
    pub fn forget(&mut self, lease: &Lease) {
        let k = key(lease);
        self.reported.retain(|(l, _)| *l != k);
        if let Ok(Some(found)) = judge(lease, &self.trust) {
            self.nodes.remove(&found.node);
        }
    }

    /// How silent the agent of `node` is at `now`; `None` when it has no Lease (an agent
    /// that does not fence: the node's VMs are moved on the Node's condition alone).
    pub fn silence(&self, node: &str, now: Instant, margin: Duration) -> Option<Silence> {
        let seen = self.nodes.get(node)?;
        Some(Silence {
            silent: now.saturating_duration_since(seen.at),
            deadline: seen.fence_after.max(self.trust.fence_after) + margin,
        })
    }
}

/// `namespace/name` of `lease`.
fn key(lease: &Lease) -> String {
    format!(
        "{}/{}",
        lease.metadata.namespace.as_deref().unwrap_or_default(),
        lease.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The agent Lease `lease` is; `Ok(None)` for a Lease not labelled as one, `Err` (why, what
/// was found) for one labelled but not believed under `trust`.
fn judge(lease: &Lease, trust: &Trust) -> Result<Option<AgentLease>, (Ignored, String)> {
    let labelled = lease
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get(LABEL_AGENT_LEASE).is_some_and(|v| v == "true"));
    if !labelled {
        return Ok(None);
    }
    let namespace = lease.metadata.namespace.as_deref().unwrap_or_default();
    if namespace != trust.namespace {
        return Err((
            Ignored::Namespace,
            format!(
                "namespace {namespace:?}, not the agents' {:?}",
                trust.namespace
            ),
        ));
    }
    let spec = lease.spec.as_ref();
    let holder = spec
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default();
    let node = lease
        .metadata
        .name
        .as_deref()
        .and_then(|n| n.strip_prefix(AGENT_LEASE_PREFIX))
        .unwrap_or_default();
    if node.is_empty() || holder != node {
        return Err((
            Ignored::Holder,
            format!("holderIdentity {holder:?} is not the node its name is for"),
        ));
    }
    let ceiling = trust.fence_after.max(MAX_FENCE_AFTER);
    let secs = spec.and_then(|s| s.lease_duration_seconds);
    let fence_after = secs
        .and_then(|s| u64::try_from(s).ok())
        .map(Duration::from_secs)
        .filter(|d| *d >= Duration::from_secs(1) && *d <= ceiling);
    let Some(fence_after) = fence_after else {
        return Err((
            Ignored::Duration,
            format!(
                "leaseDurationSeconds {secs:?}, not within 1..={}",
                ceiling.as_secs()
            ),
        ));
    };
    Ok(Some(AgentLease {
        node: node.to_owned(),
        renew: spec
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.to_string()),
        fence_after,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    const NS: &str = "imp-system";

    /// A Lease in `ns` named for `name`'s node, held by `holder`.
    fn forged(ns: &str, name: &str, holder: &str, renew: &str, secs: i64) -> Lease {
        serde_json::from_value(json!({
            "metadata": {"name": format!("imp-agent-{name}"), "namespace": ns,
                         "labels": {LABEL_AGENT_LEASE: "true"}},
            "spec": {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": secs}
        }))
        .unwrap()
    }

    fn lease(node: &str, renew: &str, secs: i32, labelled: bool) -> Lease {
        let mut l = forged(NS, node, node, renew, i64::from(secs));
        if !labelled {
            l.metadata.labels = None;
        }
        l
    }

    /// Trusting the agents of `imp-system` with a deadline of `secs`.
    fn leases(secs: u64) -> AgentLeases {
        AgentLeases::new(Trust {
            namespace: NS.to_owned(),
            fence_after: Duration::from_secs(secs),
        })
    }

    #[test]
    fn silence_counts_from_when_this_process_saw_the_renewal_change() {
        let t0 = Instant::now();
        let s = |secs| Duration::from_secs(secs);
        let mut l = leases(30);
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
        let mut l = leases(30);
        assert_eq!(
            l.observe(&lease("kubelet", "2026-01-01T00:00:00Z", 40, false), t0),
            Verdict::Other
        );
        assert_eq!(l.silence("kubelet", t0, Duration::ZERO), None);
        let a = lease("n1", "2026-01-01T00:00:00Z", 30, true);
        assert_eq!(l.observe(&a, t0), Verdict::Counted);
        assert!(l.silence("n1", t0, Duration::ZERO).is_some());
        l.forget(&a);
        assert_eq!(l.silence("n1", t0, Duration::ZERO), None);
    }

    /// The silence of n1, whose agent renewed at t0 (30 s), after `lease` was seen at t0 + 20 s.
    fn after(lease: &Lease) -> (Option<Silence>, Verdict) {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut l = leases(30);
        l.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:00Z", 30), t0);
        let verdict = l.observe(lease, t0 + s(20));
        (l.silence("n1", t0 + s(25), s(10)), verdict)
    }

    #[test]
    fn a_forged_lease_changes_no_silence_or_fencing_decision() {
        let honest = Some(Silence {
            silent: Duration::from_secs(25),
            deadline: Duration::from_secs(40),
        });
        let later = "2026-01-01T00:00:20Z";
        for (what, forgery, why) in [
            (
                "a tenant's Lease in its own namespace",
                forged("tenant", "n1", "n1", later, 1_000_000),
                Ignored::Namespace,
            ),
            (
                "a tenant's Lease in its own namespace, zero",
                forged("tenant", "n1", "n1", later, 0),
                Ignored::Namespace,
            ),
            (
                "another name held by n1",
                forged(NS, "n2", "n1", later, 1_000_000),
                Ignored::Holder,
            ),
            (
                "n1's name held by another",
                forged(NS, "n1", "n2", later, 30),
                Ignored::Holder,
            ),
            (
                "n1's Lease with a duration of 0",
                forged(NS, "n1", "n1", later, 0),
                Ignored::Duration,
            ),
            (
                "n1's Lease with a duration of 10^6 s",
                forged(NS, "n1", "n1", later, 1_000_000),
                Ignored::Duration,
            ),
            (
                "n1's Lease with a negative duration",
                forged(NS, "n1", "n1", later, -5),
                Ignored::Duration,
            ),
        ] {
            let (silence, verdict) = after(&forgery);
            assert_eq!(silence, honest, "{what}");
            assert!(
                matches!(verdict, Verdict::Ignored { why: w, first: true, .. } if w == why),
                "{what}: {verdict:?}"
            );
        }
        // A Lease without any duration, and one without a holder, are ignored too.
        let mut bare = forged(NS, "n1", "n1", later, 30);
        bare.spec.as_mut().unwrap().lease_duration_seconds = None;
        assert_eq!(after(&bare).0, honest);
        bare.spec.as_mut().unwrap().holder_identity = None;
        assert_eq!(after(&bare).0, honest);
    }

    #[test]
    fn the_longer_of_the_expected_and_the_stated_deadline_is_waited_for() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut l = leases(30);
        // Saying less does not hurry a move.
        l.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:00Z", 1), t0);
        assert_eq!(l.silence("n1", t0, s(10)).unwrap().deadline, s(40));
        // An agent whose deadline was raised before the operator was told is waited for.
        l.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:01Z", 90), t0);
        assert_eq!(l.silence("n1", t0, s(10)).unwrap().deadline, s(100));
        // Up to the ceiling, or the expected deadline when that is longer.
        l.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:02Z", 600), t0);
        assert_eq!(l.silence("n1", t0, s(10)).unwrap().deadline, s(610));
        let v = l.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:03Z", 601), t0);
        assert!(
            matches!(
                v,
                Verdict::Ignored {
                    why: Ignored::Duration,
                    ..
                }
            ),
            "{v:?}"
        );
        let mut slow = leases(900);
        let v = slow.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:00Z", 900), t0);
        assert_eq!(v, Verdict::Counted);
        assert_eq!(slow.silence("n1", t0, s(10)).unwrap().deadline, s(910));
    }

    #[test]
    fn an_ignored_lease_is_reported_once_per_reason_until_deleted() {
        let t0 = Instant::now();
        let mut l = leases(30);
        let first = |v: Verdict| match v {
            Verdict::Ignored { first, .. } => first,
            other => panic!("{other:?}"),
        };
        let f = forged("tenant", "n1", "n1", "2026-01-01T00:00:00Z", 0);
        let Verdict::Ignored { detail, .. } = l.observe(&f, t0) else {
            panic!("counted");
        };
        assert!(
            detail.contains("\"tenant\"") && detail.contains("\"imp-system\""),
            "{detail}"
        );
        assert!(!first(l.observe(&f, t0)));
        assert!(first(l.observe(
            &forged(NS, "n1", "n1", "2026-01-01T00:00:09Z", 0),
            t0
        )));
        l.forget(&f);
        assert!(first(l.observe(&f, t0)));
        // A forged Lease's deletion forgets nothing of the real one.
        l.observe(&forged(NS, "n1", "n1", "2026-01-01T00:00:00Z", 30), t0);
        l.forget(&forged(NS, "n2", "n1", "2026-01-01T00:00:09Z", 30));
        l.forget(&f);
        assert!(l.silence("n1", t0, Duration::ZERO).is_some());
    }
}
