//! The VM's status as the agent writes it from a [`Report`], and the Events of each
//! transition.

use super::*;

pub(super) fn now() -> Time {
    Time(Timestamp::now())
}

fn unix_time(secs: Option<u64>) -> Time {
    secs.and_then(|s| i64::try_from(s).ok())
        .and_then(|s| Timestamp::from_second(s).ok())
        .map_or_else(now, Time)
}

/// Makes the status say what `report` says, with an Event on each transition.
pub(super) async fn write_report(
    ctx: &Context,
    vm: &ImpVM,
    report: Report,
    record: Option<&VmRecord>,
) -> Result<(), Error> {
    write_report_with(ctx, vm, report, record, |_| {}).await
}

/// [`write_report`], with `edit` applied to the status too (in the same write).
pub(super) async fn write_report_with(
    ctx: &Context,
    vm: &ImpVM,
    report: Report,
    record: Option<&VmRecord>,
    edit: impl FnOnce(&mut ImpVMStatus),
) -> Result<(), Error> {
    let old = vm.status.clone().unwrap_or_default();
    let mut status = old.clone();
    edit(&mut status);
    let generation = vm.meta().generation;
    status.node_name = Some(ctx.settings.node.clone());
    if let Some(r) = record {
        status.runtime = Some(r.runtime.clone());
    }
    apply(&mut status, &report, record, generation);
    if matches!(report, Report::Running | Report::SuspendFailed { .. })
        && let (Some(spec), Some(v)) = (
            super::probe::spec_of(vm),
            vm.uid().and_then(|u| ctx.probes.verdicts(&u)),
        )
    {
        super::probe::conditions(&mut status, &spec, &v, generation);
    }
    if let Report::SuspendFailed { request, error } = &report {
        announce_suspend_failure(ctx, vm, request, error).await;
    }
    if status == old {
        return Ok(());
    }
    ctx.patch_status(vm, &status).await?;
    trace(ctx, vm, &old, &status, &report, record);
    announce_probes(ctx, vm, &old, &status).await;
    if old.phase != status.phase {
        announce(ctx, vm, &report, record).await;
    }
    Ok(())
}

/// Exports, in one request, the spans the write of `status` over `old` ends: a boot's
/// ([`crate::node::trace::start_spans`], ended now, as the guest agent has just answered; a
/// resume is no boot) and, when the VM first ran, its trace's root
/// ([`imp_telemetry::trace::vm_root`]), which only this report knows the end of.
fn trace(
    ctx: &Context,
    vm: &ImpVM,
    old: &ImpVMStatus,
    status: &ImpVMStatus,
    report: &Report,
    record: Option<&VmRecord>,
) {
    let mut spans = Vec::new();
    let booted = old.phase != status.phase && matches!(report, Report::Running);
    if let Some(r) = record.filter(|r| booted && r.timings.resume_ms == 0)
        && let Some(owner) = r.owner.as_ref()
    {
        let now = std::time::SystemTime::now();
        spans = crate::node::trace::start_spans(owner, &ctx.settings.node, &r.timings, now);
    }
    if let (None, Some(ran), Some(uid), Some(created)) = (
        &old.running_at,
        &status.running_at,
        vm.uid(),
        vm.metadata.creation_timestamp.as_ref(),
    ) {
        spans.push(imp_telemetry::trace::vm_root(
            &uid,
            &vm.namespace().unwrap_or_default(),
            &vm.name_any(),
            std::time::SystemTime::from(created.0),
            std::time::SystemTime::from(ran.0),
        ));
    }
    if !spans.is_empty() {
        crate::node::trace::export(ctx.client.clone(), spans);
    }
}

/// Writes what `report` says into `status`: the phase, its times, the VMM's pid and the
/// `Ready` condition (at `generation`).
fn apply(
    status: &mut ImpVMStatus,
    report: &Report,
    record: Option<&VmRecord>,
    generation: Option<i64>,
) {
    match report {
        Report::Starting => {
            status.phase = Some(VmPhase::Starting);
            status.started_at.get_or_insert_with(now);
        }
        Report::Running | Report::SuspendFailed { .. } => {
            status.phase = Some(VmPhase::Running);
            status
                .running_at
                .get_or_insert_with(|| unix_time(record.and_then(|r| r.running_unix)));
            status.runtime_pid = record.and_then(|r| r.vmm_pid).map(i64::from);
            status.suspended_at = None;
            status.suspend_snapshot_path = None;
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::True,
                ConditionReason::Running,
                match record.is_some_and(|r| !r.guest_agent) {
                    true => "the VMM runs (the VM runs without its guest agent)",
                    false => "the guest agent answers",
                },
                generation,
                now(),
            );
        }
        Report::Suspending | Report::Resuming => {
            let (phase, message) = match report {
                Report::Suspending => (VmPhase::Suspending, "pausing and writing the snapshot"),
                _ => (VmPhase::Resuming, "restoring from the snapshot"),
            };
            status.phase = Some(phase);
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::False,
                ConditionReason::Suspended,
                message,
                generation,
                now(),
            );
        }
        Report::Suspended { at_unix, path } => {
            status.phase = Some(VmPhase::Suspended);
            status.runtime_pid = None;
            status.suspended_at = Some(unix_time(Some(*at_unix)));
            status.suspend_snapshot_path = Some(path.clone());
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::False,
                ConditionReason::Suspended,
                format!("suspended to the snapshot in {path}; its memory is freed"),
                generation,
                now(),
            );
        }
        Report::Ended {
            phase,
            exit_code,
            reason,
            message,
        } => {
            status.phase = Some(*phase);
            status.exit_code = *exit_code;
            status.runtime_pid = None;
            status
                .finished_at
                .get_or_insert_with(|| unix_time(record.and_then(|r| r.finished_unix)));
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::False,
                *reason,
                message,
                generation,
                now(),
            );
        }
    }
}

/// The Warning Event of a failed suspend, once per failed request.
async fn announce_suspend_failure(ctx: &Context, vm: &ImpVM, request: &str, error: &str) {
    let slot = format!("{}/suspend", vm.uid().unwrap_or_default());
    {
        let mut announced = ctx
            .announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if announced.get(&slot).map(String::as_str) == Some(request) {
            return;
        }
        announced.insert(slot, request.to_owned());
    }
    tracing::warn!(vm = %key(vm), node = %ctx.settings.node, error, "suspend failed; the VM keeps running");
    let note = format!(
        "suspend failed, the VM keeps running (tried again in {:?}): {error}",
        ctx.settings.suspend_retry
    );
    ctx.event(
        vm,
        EventType::Warning,
        ConditionReason::SuspendFailed.as_str(),
        note,
    )
    .await;
}

/// The Event (and metrics) of a phase transition.
async fn announce(ctx: &Context, vm: &ImpVM, report: &Report, record: Option<&VmRecord>) {
    match report {
        // The start's own Event is sent with its status write; this one is for a start whose
        // write was refused (409) and is now reported from the record.
        Report::Starting => {
            let image = record.map(|r| r.image.as_str()).unwrap_or_default();
            let note = format!("pulling {image} and booting on node {}", ctx.settings.node);
            ctx.event(vm, EventType::Normal, "Starting", note).await;
        }
        Report::SuspendFailed { .. } => {}
        Report::Suspending | Report::Resuming => {
            let (reason, note) = match report {
                Report::Suspending => ("Suspending", "pausing the VM and writing its snapshot"),
                _ => ("Resuming", "restoring the VM from its snapshot"),
            };
            let note = format!("{note} on node {}", ctx.settings.node);
            ctx.event(vm, EventType::Normal, reason, note).await;
        }
        Report::Suspended { path, .. } => {
            let t = record.map(|r| r.timings).unwrap_or_default();
            let bytes = record
                .and_then(|r| r.suspend.as_ref())
                .map_or(0, |s| s.bytes);
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Suspended", suspend_ms = t.suspend_ms, bytes, "VM suspended");
            ctx.metrics.observe_suspend(t.suspend_ms);
            let note = format!(
                "snapshot of {} MiB written to {path} in {} ms; the VMM is stopped",
                bytes >> 20,
                t.suspend_ms
            );
            ctx.event(vm, EventType::Normal, "Suspended", note).await;
        }
        Report::Running if record.is_some_and(|r| r.timings.resume_ms > 0) => {
            let t = record.map(|r| r.timings).unwrap_or_default();
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Running", resume_ms = t.resume_ms, "VM resumed");
            ctx.metrics.observe_resume(t.resume_ms);
            let note = format!(
                "restored from its snapshot; the guest agent answered after {} ms",
                t.resume_ms
            );
            ctx.event(vm, EventType::Normal, "Resumed", note).await;
        }
        Report::Running => {
            let t = record.map(|r| r.timings).unwrap_or_default();
            ctx.metrics.observe_start(&t);
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Running", image_ms = t.image_ms, disk_ms = t.disk_ms, boot_ms = t.boot_ms, ready_ms = t.ready_ms, "VM running");
            ctx.event(
                vm,
                EventType::Normal,
                "Running",
                format!(
                    "the guest agent answered (image {} ms, disk {} ms, boot {} ms, guest ready {} ms)",
                    t.image_ms, t.disk_ms, t.boot_ms, t.ready_ms
                ),
            )
            .await;
        }
        Report::Ended {
            phase,
            reason,
            message,
            ..
        } => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = phase.as_str(), %reason, message, "VM ended");
            if *phase == VmPhase::Succeeded {
                ctx.event(vm, EventType::Normal, reason.as_str(), message.clone())
                    .await;
                return;
            }
            ctx.metrics.failure(reason.as_str());
            let mut note = message.clone();
            if let Some(tail) = record.and_then(|r| r.console_tail.as_deref()) {
                note.push_str("\nlast console lines:\n");
                note.push_str(tail);
            }
            ctx.event(vm, EventType::Warning, reason.as_str(), note)
                .await;
        }
    }
}

/// An Event for each probe verdict that changed between `old` and `new` (`Started`, `Ready`
/// and `Healthy` conditions with a probe's reason): Normal when it passes, Warning when not;
/// and for the HTTP check, a Warning `HealthCheckFailed` as it turns `Ready` False and a
/// Normal `HealthCheckRecovered` when `Ready` comes back.
async fn announce_probes(ctx: &Context, vm: &ImpVM, old: &ImpVMStatus, new: &ImpVMStatus) {
    if let Some((kind, reason, note)) = health_check_news(old, new) {
        ctx.event_of(vm, kind, reason, "HttpCheck", note).await;
    }
    for type_ in [
        ConditionType::Started,
        ConditionType::Ready,
        ConditionType::Healthy,
    ] {
        let Some(c) = conditions::find(&new.conditions, type_) else {
            continue;
        };
        let by_probe = [
            ConditionReason::ProbeSucceeded,
            ConditionReason::ProbeFailed,
        ]
        .iter()
        .any(|r| r.as_str() == c.reason);
        let before = conditions::find(&old.conditions, type_);
        let same = before.is_some_and(|b| b.status == c.status && b.reason == c.reason);
        if !by_probe || same {
            continue;
        }
        let (kind, reason) = if c.status == "True" {
            (EventType::Normal, ConditionReason::ProbeSucceeded)
        } else {
            (EventType::Warning, ConditionReason::ProbeFailed)
        };
        let note = format!("{}: {}", type_.as_str(), c.message);
        ctx.event_of(vm, kind, reason.as_str(), type_.as_str(), note)
            .await;
    }
}

/// The Event an HTTP check's verdict calls for between `old` and `new`, if any.
fn health_check_news(
    old: &ImpVMStatus,
    new: &ImpVMStatus,
) -> Option<(EventType, &'static str, String)> {
    let failed = ConditionReason::HealthCheckFailed.as_str();
    let ready = |s: &ImpVMStatus| conditions::find(&s.conditions, ConditionType::Ready).cloned();
    let (before, now) = (ready(old), ready(new)?);
    let was_failing = before.as_ref().is_some_and(|b| b.reason == failed);
    if now.reason == failed && !was_failing {
        return Some((EventType::Warning, failed, now.message));
    }
    (was_failing && now.status == "True").then(|| {
        (
            EventType::Normal,
            "HealthCheckRecovered",
            format!("the VM's HTTP check passes again: {}", now.message),
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ready(status: ConditionStatus, reason: ConditionReason, message: &str) -> ImpVMStatus {
        let mut s = ImpVMStatus::default();
        conditions::set(
            &mut s.conditions,
            ConditionType::Ready,
            status,
            reason,
            message,
            Some(1),
            now(),
        );
        s
    }

    #[test]
    fn an_http_check_announces_its_failure_once_and_its_recovery() {
        let up = ready(ConditionStatus::True, ConditionReason::Running, "answers");
        let down = ready(
            ConditionStatus::False,
            ConditionReason::HealthCheckFailed,
            "the httpCheck failed 2 times in a row (every 1 s): GET 10.0.0.2:8080/: HTTP 500",
        );
        let (kind, reason, note) = health_check_news(&up, &down).unwrap();
        assert_eq!((kind, reason), (EventType::Warning, "HealthCheckFailed"));
        assert!(note.contains("HTTP 500"), "{note}");
        assert_eq!(
            health_check_news(&down, &down),
            None,
            "still failing: no news"
        );
        let (kind, reason, _) = health_check_news(&down, &up).unwrap();
        assert_eq!((kind, reason), (EventType::Normal, "HealthCheckRecovered"));
        // Ready False for another cause (a suspend) is no recovery.
        let suspending = ready(ConditionStatus::False, ConditionReason::Waiting, "pausing");
        assert_eq!(health_check_news(&down, &suspending), None);
        assert_eq!(health_check_news(&up, &up), None);
    }
}
