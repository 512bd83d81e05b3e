//! What a claim decides, as pure functions: which member a claimant takes
//! ([`pick`]), what the claim writes on the member ([`take_member`]) and on the claimant
//! ([`claimed_status`]), and whether a claimant's claim is its to drive ([`step`]).
//!
//! The VM controller drives a claimant (`spec.warmPoolRef`) with these, as
//! [docs/warm-pools.md](../../../../docs/warm-pools.md) orders it: the member is marked taken
//! (`imp.dev/claimed-by`, owned by the claimant, under its resourceVersion), then the claim is
//! written in the claimant's status; its reservation Pod and its address are handed over; the
//! claimant is bound to the member's node with the member's size, then booked with the
//! member's class and base. The node agent then hands the running VM over, and the pool
//! deletes the member once the claimant runs.

use imp_api::ImpWarmPool;
use imp_api::conditions::{self, ConditionType};
use imp_api::shared::{ANNOTATION_CLAIMED_BY, LABEL_WARM_POOL};
use imp_api::vm::{Booking, ImpVM, VmPhase, WarmClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use super::decide::{is_member_of, running_and_ready};

/// Where a claimant stands, as the VM controller reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Not a claimant, or its claim is over (booked, or started cold): the VM goes on as any.
    NotClaiming,
    /// A member is to be chosen (or found again: a crash after it was marked).
    Choose,
    /// Member `member` is its; the hand-over (Pod, address, node, booking) is to be done.
    HandOver {
        /// The member's name.
        member: String,
    },
}

/// What claimant `vm` needs next.
pub fn step(vm: &ImpVM) -> Step {
    if vm.spec.warm_pool_ref.is_none() || vm.meta().deletion_timestamp.is_some() {
        return Step::NotClaiming;
    }
    let status = vm.status.clone().unwrap_or_default();
    if status.booking.is_some() {
        return Step::NotClaiming;
    }
    match status.warm_claim {
        None if vm.spec.node_name.is_none() && !ended(status.phase) => Step::Choose,
        Some(WarmClaim {
            member: Some(member),
            ..
        }) => Step::HandOver { member },
        _ => Step::NotClaiming,
    }
}

/// Claimant `vm`'s spec as its user asked for it: once a member is claimed (its uid written in
/// `status.warmClaim`), `spec.nodeName` is the claim's own binding to the member's node, not
/// a field the user set beside `spec.warmPoolRef`.
pub fn as_asked(vm: &ImpVM) -> imp_api::vm::ImpVMSpec {
    let mut spec = vm.spec.clone();
    let claimed = vm
        .status
        .as_ref()
        .and_then(|s| s.warm_claim.as_ref())
        .is_some_and(|c| c.member_uid.is_some());
    if claimed {
        spec.node_name = None;
    }
    spec
}

fn ended(phase: Option<VmPhase>) -> bool {
    matches!(
        phase,
        Some(VmPhase::Succeeded | VmPhase::Failed | VmPhase::RetryExhausted)
    )
}

/// Whether `member` of `pool` may be handed out at `now`: Running and Ready, not taken, not
/// being deleted or evicted, not about to expire, on a node `usable` says may keep it.
pub fn claimable(
    member: &ImpVM,
    pool: &ImpWarmPool,
    usable: &dyn Fn(&str) -> bool,
    now: Timestamp,
) -> bool {
    let Some(status) = &member.status else {
        return false;
    };
    is_member_of(member, pool)
        && member.meta().deletion_timestamp.is_none()
        && !member.annotations().contains_key(ANNOTATION_CLAIMED_BY)
        && running_and_ready(member, now)
        && !conditions::is_true(&status.conditions, ConditionType::DisruptionTarget)
        && status.node_name.as_deref().is_some_and(usable)
        && member.uid().is_some()
        && status.booking.is_some()
}

/// The member claimant `claimant` takes from `members`: one it already marked (a claim
/// resumed after a crash), else a claimable one of the pool's current base (`base`) first,
/// then the longest running.
pub fn pick<'a>(
    claimant: &ImpVM,
    pool: &ImpWarmPool,
    members: &'a [ImpVM],
    usable: &dyn Fn(&str) -> bool,
    now: Timestamp,
) -> Option<&'a ImpVM> {
    if let Some(marked) = members.iter().find(|m| marked_by(m, claimant)) {
        return Some(marked);
    }
    let base = pool
        .status
        .as_ref()
        .and_then(|s| s.base_snapshot.as_deref());
    members
        .iter()
        .filter(|m| claimable(m, pool, usable, now))
        .min_by_key(|m| {
            let old_base = base.is_some() && m.spec.snapshot_ref.as_deref() != base;
            let since = m
                .status
                .as_ref()
                .and_then(|s| s.running_at.as_ref())
                .map(|t| t.0);
            (old_base, since, m.name_any())
        })
}

/// Whether `member` is marked taken by `claimant` (its annotation and its owner).
pub fn marked_by(member: &ImpVM, claimant: &ImpVM) -> bool {
    member.annotations().get(ANNOTATION_CLAIMED_BY) == Some(&claimant.name_any())
        && member
            .owner_references()
            .iter()
            .any(|o| Some(&o.uid) == claimant.meta().uid.as_ref())
}

/// The merge patch that marks `member` taken by `claimant`: the annotation, and the claimant as
/// its one controlling owner in place of the pool (so deleting the claimant mid-claim deletes
/// the member too), under the member's resourceVersion (a member taken meanwhile is not taken
/// twice).
pub fn take_member(member: &ImpVM, claimant: &ImpVM) -> Value {
    let owner: Option<OwnerReference> = claimant.controller_owner_ref(&());
    json!({
        "metadata": {
            "resourceVersion": member.resource_version(),
            "annotations": {ANNOTATION_CLAIMED_BY: claimant.name_any()},
            "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
        }
    })
}

/// The claim written on the claimant once `member` is its (or, with `member` `None`, why it
/// starts cold).
pub fn claim_of(
    pool: &ImpWarmPool,
    member: Option<&ImpVM>,
    cold: Option<String>,
    now: Timestamp,
) -> WarmClaim {
    let base = match member {
        Some(m) => m.spec.snapshot_ref.clone(),
        None => pool.status.as_ref().and_then(|s| s.base_snapshot.clone()),
    };
    WarmClaim {
        pool: pool.name_any(),
        member: member.map(ResourceExt::name_any),
        member_uid: member.and_then(ResourceExt::uid),
        base_snapshot: base,
        cold,
        at: Some(Time(now)),
    }
}

/// Why claimant `claimant` of `pool` starts cold, when no member is ready: said in its Event.
pub fn cold_reason(pool: &ImpWarmPool, members: &[ImpVM]) -> String {
    let name = format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    );
    match pool
        .status
        .as_ref()
        .and_then(|s| s.base_snapshot.as_deref())
    {
        None => format!(
            "pool {name} has no base execution yet (its snapshot {} has no status.baseSnapshot); \
             booting from the template's image",
            pool.spec.snapshot_ref
        ),
        Some(base) => {
            let filling = members
                .iter()
                .filter(|m| {
                    is_member_of(m, pool)
                        && m.meta().deletion_timestamp.is_none()
                        && !m.annotations().contains_key(ANNOTATION_CLAIMED_BY)
                })
                .count();
            format!(
                "pool {name} had no ready member ({filling} on their way); restoring from base \
                 execution {base}"
            )
        }
    }
}

/// Why a member on `node` cannot go to a claimant whose resolved spec is `spec`: the node
/// lacks a label of its `nodeSelector`, or has a `NoSchedule`/`NoExecute` taint it does not
/// tolerate (as the scheduler would refuse the node for it); `None` when it may.
pub fn unfit(
    spec: &imp_api::vm::ImpVMSpec,
    node: &k8s_openapi::api::core::v1::Node,
) -> Option<String> {
    let labels = node.labels();
    for (k, v) in &spec.node_selector {
        if labels.get(k) != Some(v) {
            return Some(format!("does not match nodeSelector {k}={v}"));
        }
    }
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    taints
        .iter()
        .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
        .find(|t| !crate::placement::schedule::tolerated(t, &spec.tolerations))
        .map(|t| format!("has untolerated taint {}:{}", t.key, t.effect))
}

/// The booking of a claimant that took over `member`: the member's class and size as booked,
/// the claimant's resolved `spec` restoring from the member's base, revision 0.
pub fn claimed_booking(member: &ImpVM, mut spec: imp_api::vm::ImpVMSpec) -> Option<Booking> {
    let booked = member.status.as_ref()?.booking.as_ref()?;
    spec.snapshot_ref = booked.spec.snapshot_ref.clone();
    spec.network_ref = booked.spec.network_ref.clone();
    spec.class_ref = booked.spec.class_ref.clone();
    Some(Booking {
        class: booked.class.clone(),
        spec,
        revision: 0,
    })
}

/// The label selector of the members of `pool`.
pub fn members_selector(pool: &str) -> String {
    format!("{LABEL_WARM_POOL}={pool}")
}

#[cfg(test)]
mod tests;
