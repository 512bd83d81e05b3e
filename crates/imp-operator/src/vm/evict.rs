//! Eviction for `NoExecute` taints, as Kubernetes' taint manager does it for Pods: a VM on a
//! node with a `NoExecute` taint it does not tolerate leaves the node at once; one it tolerates
//! with `tolerationSeconds` leaves once those have passed; one it tolerates without a limit
//! stays.
//!
//! A tolerated taint is counted from when the operator first saw it on the VM's node (the
//! `DisruptionTarget` condition's `lastTransitionTime`, so an operator restart does not start
//! the count again), as the taint manager counts from when it first sees a Pod on the tainted
//! node. The taint's `timeAdded` is not used: it is the tainting client's clock, and a VM
//! placed anew on the same node (it tolerates the taint) would be evicted at once, again and
//! again. Of the tolerations that match a taint, the shortest limit counts; a limit of 0 or
//! less evicts at once (both as Kubernetes).
//!
//! The node lifecycle's own taints ([`NODE_LOSS_TAINTS`]) are not evicted on here: a node
//! carrying them is not Ready, and the VM leaves it only after the node-loss grace and once its
//! agent has surely fenced it ([`super::decide`]'s node loss), never at once.
//!
//! What an eviction does is [`super::decide`]'s: the VM fails with `Evicted` where it is, its
//! node's agent stops and removes it and releases it (clears `spec.nodeName`), and then it is
//! placed anew (ephemeral, or `rescheduleOnNodeLoss`) or its restart policy applies.

use k8s_openapi::api::core::v1::{Taint, Toleration};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// The taints the node lifecycle controller puts on a node that is not Ready; node loss, not
/// eviction, decides about them.
pub(super) const NODE_LOSS_TAINTS: [&str; 2] = [
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/not-ready",
];

/// What a VM's node's taints mean for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// No `NoExecute` taint asks the VM to leave.
    Stay,
    /// Tolerated until `until`, by the taint that ends first (`key=value:NoExecute`).
    TolerateUntil { until: Timestamp, taint: String },
    /// Evict now, for `taint`: not tolerated (`limit` None), or tolerated for `limit`
    /// seconds, which have passed.
    Evict { taint: String, limit: Option<i64> },
}

/// The verdict of `taints` on a VM with `tolerations` at `now`; `first_seen` is when the
/// operator first saw a tolerated taint on the VM's node (`None`: now).
pub(super) fn verdict(
    taints: &[Taint],
    tolerations: &[Toleration],
    first_seen: Option<Timestamp>,
    now: Timestamp,
) -> Verdict {
    let mut first_end: Option<(Timestamp, String, i64)> = None;
    for taint in taints.iter().filter(|t| applies(t)) {
        let Some(limit) = limit(taint, tolerations) else {
            return Verdict::Evict {
                taint: describe(taint),
                limit: None,
            };
        };
        let Some(seconds) = limit else {
            continue; // tolerated without a limit
        };
        let since = first_seen.unwrap_or(now);
        let until = since
            .checked_add(SignedDuration::from_secs(seconds.max(0)))
            .unwrap_or(Timestamp::MAX);
        if first_end.as_ref().is_none_or(|(end, ..)| until < *end) {
            first_end = Some((until, describe(taint), seconds));
        }
    }
    match first_end {
        None => Verdict::Stay,
        Some((until, taint, seconds)) if until <= now => Verdict::Evict {
            taint,
            limit: Some(seconds),
        },
        Some((until, taint, _)) => Verdict::TolerateUntil { until, taint },
    }
}

/// Whether `taint` can evict: `NoExecute`, and not one of the node lifecycle's.
fn applies(taint: &Taint) -> bool {
    taint.effect == "NoExecute" && !NODE_LOSS_TAINTS.contains(&taint.key.as_str())
}

/// How long `tolerations` tolerate `taint`: `None` when none matches, `Some(None)` without a
/// limit, `Some(Some(s))` for the shortest `tolerationSeconds` among those that match.
fn limit(taint: &Taint, tolerations: &[Toleration]) -> Option<Option<i64>> {
    let matching: Vec<&Toleration> = tolerations
        .iter()
        .filter(|t| crate::placement::schedule::tolerated(taint, std::slice::from_ref(*t)))
        .collect();
    if matching.is_empty() {
        return None;
    }
    Some(matching.iter().filter_map(|t| t.toleration_seconds).min())
}

/// `key=value:NoExecute`, or `key:NoExecute` without a value, as `kubectl` writes taints.
pub(super) fn describe(taint: &Taint) -> String {
    match taint.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={v}:{}", taint.key, taint.effect),
        None => format!("{}:{}", taint.key, taint.effect),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn taint(key: &str, effect: &str, added: Option<i64>) -> Taint {
        Taint {
            key: key.into(),
            value: Some("yes".into()),
            effect: effect.into(),
            time_added: added.map(|s| Time(at(s))),
        }
    }

    fn tol(key: &str, seconds: Option<i64>) -> Toleration {
        Toleration {
            key: Some(key.into()),
            operator: Some("Exists".into()),
            effect: Some("NoExecute".into()),
            toleration_seconds: seconds,
            ..Toleration::default()
        }
    }

    #[test]
    fn an_untolerated_no_execute_taint_evicts_at_once_and_other_effects_never() {
        let t = [taint("drain", "NoExecute", Some(0))];
        assert_eq!(
            verdict(&t, &[], None, at(1)),
            Verdict::Evict {
                taint: "drain=yes:NoExecute".into(),
                limit: None
            }
        );
        let soft = [
            taint("a", "NoSchedule", None),
            taint("b", "PreferNoSchedule", None),
        ];
        assert_eq!(verdict(&soft, &[], None, at(1)), Verdict::Stay);
        // A toleration of another key, or of another effect, does not count.
        let mut other = tol("drain", None);
        other.effect = Some("NoSchedule".into());
        assert!(matches!(
            verdict(&t, &[tol("other", None), other], None, at(1)),
            Verdict::Evict { .. }
        ));
    }

    #[test]
    fn toleration_seconds_count_from_the_first_sight_not_from_time_added() {
        // Added long ago (a VM placed anew on a node drained an hour ago): counted from now.
        let t = [taint("drain", "NoExecute", Some(-3600))];
        let tolerations = [tol("drain", Some(30))];
        assert_eq!(
            verdict(&t, &tolerations, None, at(20)),
            Verdict::TolerateUntil {
                until: at(50),
                taint: "drain=yes:NoExecute".into()
            }
        );
        assert_eq!(
            verdict(&t, &tolerations, Some(at(20)), at(50)),
            Verdict::Evict {
                taint: "drain=yes:NoExecute".into(),
                limit: Some(30)
            }
        );
        let bare = [taint("drain", "NoExecute", None)];
        assert_eq!(
            verdict(&bare, &tolerations, Some(at(5)), at(20)),
            Verdict::TolerateUntil {
                until: at(35),
                taint: "drain=yes:NoExecute".into()
            }
        );
        assert_eq!(
            verdict(&bare, &tolerations, None, at(20)),
            Verdict::TolerateUntil {
                until: at(50),
                taint: "drain=yes:NoExecute".into()
            }
        );
    }

    #[test]
    fn the_shortest_limit_counts_and_none_or_zero_are_as_kubernetes_has_them() {
        let t = [taint("drain", "NoExecute", Some(0))];
        // Several matching: the shortest limit; one without a limit does not lift the others'.
        let v = verdict(
            &t,
            &[
                tol("drain", Some(60)),
                tol("", None),
                tol("drain", Some(20)),
            ],
            None,
            at(1),
        );
        assert_eq!(
            v,
            Verdict::TolerateUntil {
                until: at(21),
                taint: "drain=yes:NoExecute".into()
            }
        );
        // Only unlimited tolerations: stays.
        assert_eq!(
            verdict(&t, &[tol("drain", None)], None, at(1_000_000)),
            Verdict::Stay
        );
        // Zero or negative: at once.
        for s in [0, -5] {
            assert!(matches!(
                verdict(&t, &[tol("drain", Some(s))], None, at(0)),
                Verdict::Evict { limit: Some(_), .. }
            ));
        }
        // Of two taints, the one that ends first.
        let two = [
            taint("a", "NoExecute", Some(0)),
            taint("b", "NoExecute", Some(0)),
        ];
        assert_eq!(
            verdict(&two, &[tol("a", Some(50)), tol("b", Some(10))], None, at(1)),
            Verdict::TolerateUntil {
                until: at(11),
                taint: "b=yes:NoExecute".into()
            }
        );
    }

    #[test]
    fn the_node_lifecycle_taints_are_left_to_node_loss() {
        for key in NODE_LOSS_TAINTS {
            let t = [taint(key, "NoExecute", Some(0))];
            assert_eq!(verdict(&t, &[], None, at(1_000)), Verdict::Stay, "{key}");
        }
        let bare = Taint {
            key: "k".into(),
            value: None,
            effect: "NoExecute".into(),
            time_added: None,
        };
        assert_eq!(describe(&bare), "k:NoExecute");
    }
}
