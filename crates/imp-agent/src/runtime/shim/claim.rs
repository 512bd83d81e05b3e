//! A warm pool's claim, on the shim's side: the running VM is handed to another owner. The
//! guest takes the new owner's identity (hostname and MAC; its address stays) with its link
//! down, then the record is saved naming the new owner: that save is the node's commit of the
//! claim. A claim that fails before it leaves the VM running as it was, its owner unchanged.
//! A member waiting for its claim may be paused ([`pause`]): the claim resumes it first, and
//! pauses it again if it is refused.

use std::time::{Duration, Instant};

use imp_vmm::Vmm;

use super::super::guest_agent;
use super::super::shim_api::{ClaimOutcome, ClaimRequest};
use super::super::state::{StateDir, VmRecord, VmStatus};
use super::ms;

/// How long the guest has to take its new identity.
const IDENTITY_TIMEOUT: Duration = Duration::from_secs(30);

/// Hands the running VM (`networked`: it has a network interface) to `req.owner`, its record
/// saved under `state`; the outcome, or why it was refused (the VM then runs on as it was).
pub(super) async fn hand_over<V: Vmm>(
    vm: &mut V,
    state: &StateDir,
    networked: bool,
    record: &mut VmRecord,
    req: ClaimRequest,
) -> Result<ClaimOutcome, String> {
    if record.status != VmStatus::Running {
        return Err(format!(
            "the VM is {}, not running: it cannot be handed over",
            record.status.as_str()
        ));
    }
    // Asked again by an agent that restarted before it read the answer: already done.
    if record.owner.as_ref() == Some(&req.owner) {
        return Ok(ClaimOutcome {
            record: record.clone(),
            guest_ms: 0,
        });
    }
    req.identity
        .validate()
        .map_err(|e| format!("the new identity is not valid: {e}"))?;
    let t = Instant::now();
    // A member waiting paused: its vCPUs run again first (the identity step sets its clock).
    let was_paused = record.paused;
    if was_paused {
        vm.resume()
            .await
            .map_err(|e| format!("resuming the paused VM: {}", imp_api::chain::chain(&e)))?;
        record.paused = false;
    }
    if networked && let Err(e) = vm.set_link(false).await {
        let why = format!(
            "taking the guest's link down: {}",
            imp_api::chain::chain(&e)
        );
        return refuse(vm, record, was_paused, why).await;
    }
    let taken = guest_agent::reidentify(
        &record.vsock,
        record.agent_port,
        &req.identity,
        IDENTITY_TIMEOUT,
    )
    .await;
    let refused = match &taken {
        Ok(report) if report.is_complete() => None,
        Ok(report) => Some(format!(
            "the guest could not take the new identity: {report}"
        )),
        Err(e) => Some(format!(
            "giving the guest the new identity: {}",
            imp_api::chain::chain(e)
        )),
    };
    if let Some(why) = refused {
        // The guest keeps its old name, MAC and link as far as it got; its owner is unchanged.
        if networked {
            let _ = vm.set_link(true).await;
        }
        tracing::warn!(vm = %record.name, why, "claim refused; the VM runs on for its owner");
        return refuse(vm, record, was_paused, why).await;
    }
    let before = record.owner.replace(req.owner.clone());
    if let Err(e) = state.save(record) {
        record.owner = before;
        if networked {
            let _ = vm.set_link(true).await;
        }
        let why = format!(
            "saving the record with its new owner: {}",
            imp_api::chain::chain(&e)
        );
        return refuse(vm, record, was_paused, why).await;
    }
    if networked && let Err(e) = vm.set_link(true).await {
        tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "bringing the claimed guest's link up failed");
    }
    let guest_ms = ms(t.elapsed());
    tracing::info!(vm = %record.name, owner = %format!("{}/{}", req.owner.namespace, req.owner.name), guest_ms, "VM handed to its claimant");
    Ok(ClaimOutcome {
        record: record.clone(),
        guest_ms,
    })
}

/// A claim refused for `why`: a member that waited paused (`was_paused`) is paused again.
async fn refuse<V: Vmm>(
    vm: &mut V,
    record: &mut VmRecord,
    was_paused: bool,
    why: String,
) -> Result<ClaimOutcome, String> {
    if was_paused && vm.pause().await.is_ok() {
        record.paused = true;
    }
    Err(why)
}

/// Pauses the running VM's vCPUs (a warm pool's member waiting for a claim) and saves the
/// record saying so; a VM paused already is left as it is. Refused (the VM runs on) when it
/// does not run or the record cannot say so.
pub(super) async fn pause<V: Vmm>(
    vm: &mut V,
    state: &StateDir,
    record: &mut VmRecord,
) -> Result<(), String> {
    if record.status != VmStatus::Running {
        return Err(format!(
            "the VM is {}, not running: it cannot be paused",
            record.status.as_str()
        ));
    }
    if record.paused {
        return Ok(());
    }
    vm.pause()
        .await
        .map_err(|e| format!("pausing the VM: {}", imp_api::chain::chain(&e)))?;
    record.paused = true;
    if let Err(e) = state.save(record) {
        record.paused = false;
        let _ = vm.resume().await;
        return Err(format!(
            "saving the record of the paused VM: {}",
            imp_api::chain::chain(&e)
        ));
    }
    tracing::info!(vm = %record.name, "paused: a warm pool's member waits for a claim");
    Ok(())
}
