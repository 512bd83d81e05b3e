//! A VM moving between nodes (ImpVMMigration, cold: docs/migration.md): on the source, its
//! files sent to the target's agent once the move has suspended it ([`send`]); on the
//! target, the files received taken as the VM's own once the commit made it this node's
//! ([`take_in`]), after which the VM resumes as any suspended VM does.
//!
//! What travels, and where it lands, is [`crate::runtime::moved`]'s.

use std::time::Duration;

use imp_api::vm::{ImpVM, MovePhase};
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use serde_json::json;

use super::{Context, Error, FIELD_MANAGER, key, local_error};
use crate::runtime::moved::{RECORD, files_to_send};
use crate::runtime::state::VmRecord;

/// How long one attempt to send may take before it is given up (a cut link is retried by the
/// next reconcile, resuming where the target's copy ends).
const SEND_TIMEOUT: Duration = Duration::from_secs(600);

/// The phase of a move away from `node` that `vm` holds, if it holds one: `status.move`
/// naming `node` its source while `spec.nodeName` is still `node`.
pub(super) fn moving_out(vm: &ImpVM, node: &str) -> Option<MovePhase> {
    let mv = vm.status.as_ref()?.moving.as_ref()?;
    (mv.source == node && vm.spec.node_name.as_deref() == Some(node)).then_some(mv.phase)
}

/// The source: sends suspended `record`'s files to the move's target and says `Sent` with the
/// bytes sent and when the VM stopped; a failure says `SendFailed` with why (the operator
/// aborts: the VM wakes here).
pub(super) async fn send(ctx: &Context, vm: &ImpVM, record: VmRecord) -> Result<Action, Error> {
    let Some(kit) = &ctx.moves else {
        return say(
            ctx,
            vm,
            Err("this node's agent cannot send VMs (its API is off)".into()),
        )
        .await;
    };
    let Some(mv) = vm.status.as_ref().and_then(|s| s.moving.clone()) else {
        return Ok(Action::await_change());
    };
    let target = match target_of(&mv) {
        Ok(t) => t,
        Err(why) => return say(ctx, vm, Err(why)).await,
    };
    let dir = ctx.settings.state.vm_dir(&record.name);
    let files = {
        let (dir, record) = (dir.clone(), record.clone());
        tokio::task::spawn_blocking(move || files_to_send(&dir, &record)).await
    };
    let files = match files {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            return say(
                ctx,
                vm,
                Err(format!("listing the VM's files in {}: {e}", dir.display())),
            )
            .await;
        }
        Err(e) => return Err(local_error("listing the files of", vm, Box::new(e))),
    };
    let (ns, name) = (vm.namespace().unwrap_or_default(), vm.name_any());
    let to = imp_agent_api::moves::MoveTo {
        target: &target,
        identity: &kit.identity,
        namespace: &ns,
        name: &name,
        token: &mv.token,
    };
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, target = %mv.target, files = files.len(), "sending the VM to its new node");
    let started = std::time::Instant::now();
    let sent = tokio::time::timeout(
        SEND_TIMEOUT,
        imp_agent_api::moves::send_files(&to, &files, kit.bandwidth),
    )
    .await;
    match sent {
        Ok(Ok(s)) => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, target = %mv.target, bytes = s.bytes_sent, ms = started.elapsed().as_millis() as u64, "sent the VM");
            let paused = record
                .suspend
                .as_ref()
                .map(|s| s.paused_unix_ms.unwrap_or(s.suspended_unix * 1000));
            say(ctx, vm, Ok((s.bytes_sent, paused))).await
        }
        Ok(Err(e)) => say(ctx, vm, Err(imp_api::chain::chain(&e))).await,
        Err(_) => {
            say(
                ctx,
                vm,
                Err(format!(
                    "sending took more than {} s",
                    SEND_TIMEOUT.as_secs()
                )),
            )
            .await
        }
    }
}

/// The target agent as the operator wrote it into the move (from the target's Node).
fn target_of(mv: &imp_api::vm::VmMove) -> Result<imp_agent_api::client::Target, String> {
    match (&mv.target_endpoint, &mv.target_cert_sha256) {
        (Some(endpoint), Some(fingerprint)) => Ok(imp_agent_api::client::Target {
            endpoint: endpoint.clone(),
            fingerprint: fingerprint.clone(),
        }),
        _ => Err(format!(
            "the move names no API of node {}'s agent",
            mv.target
        )),
    }
}

/// Writes how the send went into `status.move`: `Sent` with the bytes sent and when the VM
/// was paused (Unix milliseconds), or `SendFailed` with why.
async fn say(
    ctx: &Context,
    vm: &ImpVM,
    outcome: Result<(u64, Option<u64>), String>,
) -> Result<Action, Error> {
    let body = match &outcome {
        Ok((bytes, paused)) => {
            json!({"phase": MovePhase::Sent, "bytesSent": bytes, "pausedUnixMs": paused})
        }
        Err(why) => {
            tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "sending the VM to its new node failed");
            ctx.event(vm, EventType::Warning, "MoveSendFailed", why.clone())
                .await;
            json!({"phase": MovePhase::SendFailed, "failure": why})
        }
    };
    let patch = json!({
        "metadata": {"resourceVersion": vm.resource_version()},
        "status": {"move": body},
    });
    ctx.api(vm)
        .patch_status(
            &vm.name_any(),
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|source| Error::Kube {
            doing: "writing status.move of",
            vm: key(vm),
            source,
        })?;
    Ok(Action::await_change())
}

/// The target, after the commit: the files received for `uid` become the VM's directory,
/// snapshot and record (suspended, paths of this node), and its network is wired here; the
/// next reconcile resumes it.
pub(super) async fn take_in(ctx: &Context, vm: &ImpVM, uid: &str) -> Result<Action, Error> {
    let Some(kit) = &ctx.moves else {
        return Ok(Action::await_change());
    };
    let Some(received) = kit.store.received(uid) else {
        return Ok(Action::requeue(Duration::from_secs(1)));
    };
    let (spec, class) = match super::start::booked(vm) {
        Ok(b) => b,
        Err(why) => return Err(local_error("taking in", vm, why.into())),
    };
    let network = match super::start::wire(ctx, vm, uid, &spec).await {
        Ok(n) => n,
        Err(super::NotWired::Waiting(why)) | Err(super::NotWired::Refused(why)) => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, why, "not taking in the moved VM yet");
            return Ok(Action::requeue(Duration::from_secs(2)));
        }
    };
    let record_text = tokio::fs::read(received.join(RECORD))
        .await
        .map_err(|e| local_error("reading the moved record of", vm, Box::new(e)))?;
    let record: VmRecord = serde_json::from_slice(&record_text)
        .map_err(|e| local_error("reading the moved record of", vm, Box::new(e)))?;
    let runtime = imp_api::shared::VmRuntime::parse_list(&record.runtime)
        .first()
        .copied()
        .unwrap_or(imp_api::shared::VmRuntime::Qemu);
    let owner = record
        .owner
        .clone()
        .ok_or_else(|| local_error("taking in", vm, "the moved record names no owner".into()))?;
    let choices = crate::node::boot::Choices {
        runtime,
        env: Vec::new(),
        auth_file: None,
    };
    let mut vm_spec = crate::node::boot::vm_spec(owner, &spec, &class, choices, &ctx.settings.boot)
        .map_err(|e| local_error("building the spec of", vm, e.0.into()))?;
    vm_spec.network = network;
    ctx.shims
        .take_in(uid, vm_spec, record, &received)
        .await
        .map_err(|e| local_error("taking in the moved files of", vm, Box::new(e)))?;
    if let Err(e) = kit.store.forget(uid).await {
        tracing::warn!(vm = %key(vm), node = %ctx.settings.node, error = %e, "removing the received files' directory failed");
    }
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Suspended", "took in the moved VM; resuming it");
    ctx.event(
        vm,
        EventType::Normal,
        "MovedIn",
        format!(
            "its files arrived on node {}; resuming it here",
            ctx.settings.node
        ),
    )
    .await;
    Ok(Action::requeue(Duration::from_millis(10)))
}

/// How long the files of a move that did not become a VM of this node are kept: longer than a
/// move may take to its commit (the operator's deadline is 10 minutes).
const MOVE_FILES_KEPT: Duration = Duration::from_secs(15 * 60);

/// Removes the files moves sent here that no VM of this node took in (a move aborted after
/// they arrived, or abandoned while they arrived) once they are [`MOVE_FILES_KEPT`] old; a VM
/// of this node with their uid takes them in at its next reconcile instead.
pub(super) async fn sweep(ctx: &Context, store: &kube::runtime::reflector::Store<ImpVM>) {
    let Some(kit) = &ctx.moves else { return };
    let old = match kit.store.older_than(MOVE_FILES_KEPT).await {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(node = %ctx.settings.node, error = %e, "listing the files of moves failed");
            return;
        }
    };
    for uid in old {
        let here = store
            .state()
            .iter()
            .any(|vm| vm.uid().as_deref() == Some(uid.as_str()));
        if here {
            continue;
        }
        tracing::info!(uid, node = %ctx.settings.node, "removing the files of a move that did not come to this node");
        if let Err(e) = kit.store.forget(&uid).await {
            tracing::warn!(uid, node = %ctx.settings.node, error = %e, "removing the files of a move failed");
        }
    }
}
