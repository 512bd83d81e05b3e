//! A warm pool's claim on the node: a claimant the operator booked onto this node with the
//! member it took takes over that member's running VM. In order: the VM's spec names its new
//! owner, hostname and attachment, the TAP is renamed for the claimant and its port's rules
//! loaded for its MAC ([`imp_net::NodeNet::rebind`]), then its shim gives the guest the
//! claimant's identity and saves the record with the claimant as its owner (the commit), and
//! the claimant is reported `Running`.
//!
//! Fault points (`imp_telemetry::fault`), for the crash tests: `claim.spec-written`,
//! `claim.tap-rebound`, `claim.committed` (the shim has committed; nothing reported yet).
//!
//! When the member's VM no longer runs here, or its shim refuses, the claim falls back: what
//! is left of the member's VM is removed and the claimant starts from its booking (a restore
//! from the pool's base), with a Warning Event `ClaimFailed` saying why.

use std::time::{Duration, Instant};

use imp_api::vm::ImpVM;
use imp_telemetry::fault;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::decide::Report;
use super::{Context, Error, key, remove_vm, start, write_report};
use crate::runtime::shim_api::ClaimRequest;
use crate::runtime::state::{Owner, VmRecord, VmStatus};

/// How long the member's shim has to hand the VM over (the guest's identity step is 30 s).
const CLAIM_TIMEOUT: Duration = Duration::from_secs(40);

/// Takes over member `member`'s running VM for claimant `vm` (of uid `uid`), or falls back to
/// starting `vm` from its booking.
pub(super) async fn take_over(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    member: &str,
) -> Result<Action, Error> {
    let t = Instant::now();
    let found = ctx.shims.observe(member).await.map_err(|e| Error::Local {
        doing: "reading the claimed member's record for",
        vm: key(vm),
        source: Box::new(e),
    })?;
    let running = found.as_ref().filter(|(r, alive)| {
        *alive && r.status == VmStatus::Running && r.owner.as_ref().is_some_and(|o| o.uid == member)
    });
    let Some((record, _)) = running else {
        let why = match &found {
            None => format!("member VM {member} is not on this node"),
            Some((r, _)) => format!("member VM {member} is {}", r.effective_status().as_str()),
        };
        return fall_back(ctx, vm, uid, found.map(|(r, _)| r), &why).await;
    };
    match hand_over(ctx, vm, uid, record).await {
        Ok((took, taken)) => {
            // Reported at once, as the claimant's next reconcile would: a claim is waited on.
            let reported = Instant::now();
            write_report(ctx, vm, Report::Running, Some(&taken)).await?;
            let report_ms = reported.elapsed().as_millis();
            let total = t.elapsed().as_millis();
            let Took {
                spec_ms,
                net_ms,
                shim_ms,
                guest_ms,
            } = took;
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, member, spec_ms, net_ms, shim_ms, guest_ms, report_ms, total_ms = total, "took over a warm pool's running member");
            let note = format!(
                "took over the running VM of member {} on node {}; {total} ms on the node \
                 ({guest_ms} ms for the guest's new identity)",
                vm.status
                    .as_ref()
                    .and_then(|s| s.warm_claim.as_ref())
                    .and_then(|c| c.member.clone())
                    .unwrap_or_else(|| member.to_owned()),
                ctx.settings.node
            );
            ctx.event(vm, EventType::Normal, "Claimed", note).await;
            Ok(Action::requeue(Duration::from_secs(1)))
        }
        Err(why) => fall_back(ctx, vm, uid, Some(record.clone()), &why).await,
    }
}

/// Milliseconds of the node's steps of a claim, for its log line.
struct Took {
    /// Rewriting the VM's spec.
    spec_ms: u128,
    /// Renaming its TAP and loading its port's rules.
    net_ms: u128,
    /// The shim's hand-over, the guest's step included.
    shim_ms: u128,
    /// The guest's identity step alone, as the shim measured it.
    guest_ms: u64,
}

/// The node's steps of a claim of `record` (the member's running VM) by `vm`: what each took
/// and the record as committed, or why it could not be handed over.
async fn hand_over(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    record: &VmRecord,
) -> Result<(Took, VmRecord), String> {
    let t = Instant::now();
    let id = record.name.clone();
    let Some(mut spec) = ctx.shims.spec(&id).await else {
        return Err(format!("member VM {id} has no readable spec"));
    };
    let (ns, name) = (vm.namespace().unwrap_or_default(), vm.name_any());
    let status = vm.status.clone().unwrap_or_default();
    let owner = Owner {
        namespace: ns.clone(),
        name: name.clone(),
        uid: uid.to_owned(),
        attempt: status.restart_count.unwrap_or(0),
        revision: status.booking.as_ref().map_or(0, |b| b.revision),
    };
    let attachment = spec.network.clone().map(|a| imp_net::NetAttachment {
        tap: imp_net::names::tap(&ns, &name),
        mac: imp_api::network::vm_mac(&ns, &name),
        vm: format!("{ns}/{name}"),
        ..a
    });
    let net = match (&attachment, &ctx.net) {
        (Some(_), None) => return Err("this node's agent wires no VM networks".into()),
        (_, net) => net,
    };
    // The spec first: an agent stopped before the TAP is renamed puts the TAP back under the
    // spec's name when it starts (`network::adopt`, `NodeNet::repair_tap`).
    spec.owner = Some(owner.clone());
    spec.hostname.clone_from(&name);
    spec.network = attachment.clone();
    ctx.shims
        .write_spec(&id, spec)
        .await
        .map_err(|e| format!("writing the claimant's spec: {}", imp_api::chain::chain(&e)))?;
    fault::point("claim.spec-written");
    let spec_ms = t.elapsed().as_millis();
    let t = Instant::now();
    if let (Some(a), Some(net)) = (&attachment, net) {
        net.rebind(&id, a.clone()).await?;
    }
    fault::point("claim.tap-rebound");
    let net_ms = t.elapsed().as_millis();
    let t = Instant::now();
    let identity = imp_proto::message::Identity {
        hostname: Some(name),
        mac: attachment.as_ref().map(|a| a.mac.clone()),
        network: attachment.map(|a| a.config),
    };
    let req = ClaimRequest { owner, identity };
    match ctx.shims.claim(&id, req, CLAIM_TIMEOUT).await {
        Ok(Some(outcome)) => {
            fault::point("claim.committed");
            ctx.vms.observe(&outcome.record, true);
            let took = Took {
                spec_ms,
                net_ms,
                shim_ms: t.elapsed().as_millis(),
                guest_ms: outcome.guest_ms,
            };
            Ok((took, outcome.record))
        }
        Ok(None) => Err(format!(
            "the shim of member VM {id} has no API to hand its VM over with"
        )),
        Err(e) => Err(format!(
            "the shim of member VM {id}: {}",
            imp_api::chain::chain(&e)
        )),
    }
}

/// The claim cannot be completed on this node (`why`): what is left of the member's VM
/// (`member`) goes, and the claimant starts from its booking.
async fn fall_back(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    member: Option<VmRecord>,
    why: &str,
) -> Result<Action, Error> {
    tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "claim failed on the node; starting from the booking");
    ctx.event(
        vm,
        EventType::Warning,
        "ClaimFailed",
        format!("{why}; starting the VM from its booking (a restore from the pool's base)"),
    )
    .await;
    if let Some(r) = member {
        let alive = r.supervisor_alive();
        remove_vm(ctx, &r.name.clone(), alive.then_some(&r))
            .await
            .map_err(|e| Error::Local {
                doing: "removing the claimed member's VM for",
                vm: key(vm),
                source: Box::new(e),
            })?;
    }
    start(ctx, vm, uid).await
}
