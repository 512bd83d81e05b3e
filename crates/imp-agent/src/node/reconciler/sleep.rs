//! Suspend, resume and scale-to-zero as the reconciler applies them: what the VM's TAP says
//! (idle, woken), holding a sleeping VM's TAP, asking the shim to suspend, and a resume that
//! takes the TAP and the held frames from the sleeper (see docs/suspend.md).

use super::*;

/// What scale-to-zero knows of a VM before the decision.
#[derive(Default)]
pub(super) struct ScaleFacts {
    /// The VM's spec on disk (its TAP, its memory).
    pub(super) spec: Option<crate::runtime::spec::VmSpec>,
    /// Its TAP as a sleeper holds it.
    pub(super) tap: Option<SleepingTap>,
    /// Idle since then (a running ScaleToZero VM whose guest sent nothing for idleTimeout).
    pub(super) idle_since: Option<std::time::SystemTime>,
    /// A frame arrived for it while it slept.
    pub(super) woken: bool,
    /// When to look at a running ScaleToZero VM's TAP again.
    pub(super) sample_every: Option<Duration>,
}

/// Samples a running ScaleToZero VM's TAP, and tells whether a sleeping one was woken.
pub(super) async fn scale_facts(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    obs: &Observed,
    local: Option<&(VmRecord, bool)>,
) -> ScaleFacts {
    if let Some(scale) = &ctx.scale {
        scale.observe(uid, obs.scale_to_zero);
    }
    let Some((record, alive)) = local else {
        return ScaleFacts::default();
    };
    if !obs.scale_to_zero && record.status != VmStatus::Suspended {
        return ScaleFacts::default();
    }
    let spec = ctx.shims.spec(uid).await;
    let tap = spec
        .as_ref()
        .and_then(|s| s.network.as_ref())
        .map(|n| SleepingTap {
            tap: n.tap.clone(),
            ip: n.config.address,
            mac: n.mac.clone(),
        });
    let mut facts = ScaleFacts {
        woken: ctx.scale.as_ref().is_some_and(|s| s.woken(uid)),
        ..ScaleFacts::default()
    };
    if let (Some(scale), Some(t)) = (&ctx.scale, &tap)
        && obs.scale_to_zero
        && *alive
        && record.status == VmStatus::Running
        && obs.phase == VmPhase::Running
    {
        let timeout = idle_timeout(vm);
        let in_use = ctx
            .vms
            .busy(&vm.namespace().unwrap_or_default(), &vm.name_any());
        let activity = scale
            .activity(uid, &t.tap, record.vmm_pid, timeout, in_use)
            .await;
        if let imp_net::idle::Activity::Idle { since } = activity {
            facts.idle_since = Some(since);
        }
        facts.sample_every = Some(scale::sample_every(timeout));
    }
    facts.spec = spec;
    facts.tap = tap;
    facts
}

/// `spec.idleTimeout`, or the default 5m when unset or unreadable (the webhook refuses both).
fn idle_timeout(vm: &ImpVM) -> Duration {
    vm.spec
        .idle_timeout
        .as_ref()
        .and_then(|d| d.parse().ok())
        .unwrap_or(scale::DEFAULT_IDLE_TIMEOUT)
}

/// Holds a sleeping ScaleToZero VM's TAP (before it is reported Suspended, so Suspended means
/// wakeable), or lets go of it once nobody should wake the VM (the user asked for Suspended).
/// A resume takes the TAP itself. False when the TAP should be held and is not.
pub(super) async fn sync_sleeper(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    wanted: bool,
    tap: Option<&SleepingTap>,
    decision: &Decision,
) -> bool {
    let Some(scale) = &ctx.scale else {
        return true;
    };
    match tap {
        Some(tap) if wanted => {
            let on_wake = ctx.reconcile_tx.get().cloned().map(|tx| {
                let obj = ObjectRef::from_obj(vm);
                async move {
                    let _ = tx.send(obj).await;
                }
            });
            let on_wake = async move {
                if let Some(f) = on_wake {
                    f.await;
                }
            };
            match scale.hold(uid, tap, on_wake).await {
                Ok(Some(how)) => ctx.metrics.sleeper_held(how == scale::Attached::Kept),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(vm = %key(vm), node = %ctx.settings.node, tap = %tap.tap, error = %imp_api::chain::chain(&e), "cannot hold a sleeping VM's TAP; it cannot be woken by traffic yet");
                    return false;
                }
            }
        }
        _ if !wanted && *decision != Decision::Resume && scale.holds(uid) => {
            scale.release(uid).await;
        }
        _ => {}
    }
    true
}

/// A VM runs (again): delivers the frames held for it if its VMM opens its TAP by name
/// (Firecracker), and ends an exec's wake.
pub(super) async fn runs_again(ctx: &Context, uid: &str) {
    let Some(scale) = &ctx.scale else { return };
    scale.inject_stashed(uid).await;
    scale.running(uid);
}

/// Asks the VM's shim to suspend it and says `Suspending`; the record tells how it ended.
/// An idle ScaleToZero VM's last activity (`idle_since`) is written as `lastActivityTime`.
/// A VM that a sleeper will hold (`tap`) has its VMM's TAP descriptor kept for the sleeper.
pub(super) async fn suspend(
    ctx: &Context,
    vm: &ImpVM,
    record: VmRecord,
    idle_since: Option<std::time::SystemTime>,
    tap: Option<&SleepingTap>,
) -> Result<Action, Error> {
    let (ns, name) = (vm.namespace().unwrap_or_default(), vm.name_any());
    if !ctx.vms.suspend_begin(&ns, &name, idle_since.is_none()) {
        tracing::debug!(vm = %key(vm), node = %ctx.settings.node, "an exec session is open: the VM stays up");
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let uid = record.name.clone();
    if let (Some(scale), Some(tap), Some(pid)) = (&ctx.scale, tap, record.vmm_pid) {
        scale.keep_tap(&uid, pid, &tap.tap).await;
    }
    let token = match ctx.shims.suspend(record).await {
        Ok(t) => t,
        Err(e) => {
            ctx.vms.suspend_over(&ns, &name);
            if let Some(scale) = &ctx.scale {
                scale.drop_kept(&uid).await;
            }
            return Err(local_error("asking for the suspend of", vm, Box::new(e)));
        }
    };
    let idle =
        idle_since.map(|t| Time(Timestamp::try_from(t).unwrap_or_else(|_| Timestamp::now())));
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Suspending", token, idle = idle.is_some(), "suspending");
    ctx.metrics.suspend_asked(if idle.is_some() {
        Trigger::ScaleToZero
    } else {
        Trigger::Requested
    });
    write_report_with(ctx, vm, Report::Suspending, None, |status| {
        if let Some(t) = idle {
            status.last_activity_time = Some(t);
        }
    })
    .await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Starts a shim that restores the suspended VM and says `Resuming`; when a sleeper held the
/// VM's TAP, the TAP goes to the new VMM and the held frames into the VM. A node without the
/// free memory to run the VM keeps it Suspended and says so.
pub(super) async fn resume(
    ctx: &Context,
    vm: &ImpVM,
    record: VmRecord,
    spec: Option<&crate::runtime::spec::VmSpec>,
) -> Result<Action, Error> {
    if let Some(spec) = spec
        && let Some(why) = no_room_to_resume(ctx, spec.memory_mib).await
    {
        return cannot_resume(ctx, vm, why).await;
    }
    let uid = record.name.clone();
    let by_name = spec.is_some_and(|s| crate::runtime::spec::reopens_tap_by_name(s.runtime));
    let woke = match &ctx.scale {
        Some(scale) => scale.wake_handover(&uid, by_name).await,
        None => scale::Wake::default(),
    };
    let pid = match ctx.shims.resume(record, woke.tap).await {
        Ok(pid) => {
            ctx.follow(&uid, pid, kube::runtime::reflector::ObjectRef::from_obj(vm));
            pid
        }
        Err(e) => return Err(local_error("resuming", vm, Box::new(e))),
    };
    if let Some(scale) = &ctx.scale {
        scale.resumed(&uid);
    }
    let since_wake_ms = woke.at.map(|t| t.elapsed().as_secs_f64() * 1e3);
    ctx.metrics.resume_started(match woke.by {
        Some(scale::WokenBy::Traffic) => Trigger::ScaleToZero,
        Some(scale::WokenBy::Exec) => Trigger::Exec,
        None => Trigger::Requested,
    });
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Resuming", shim = pid, woken_by = ?woke.by, held_frames = woke.frames, since_wake_ms, "resuming");
    write_report(ctx, vm, Report::Resuming, None).await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Why the node cannot resume a VM of `memory_mib` now, if it cannot.
async fn no_room_to_resume(ctx: &Context, memory_mib: u32) -> Option<String> {
    let available = tokio::fs::read_to_string("/proc/meminfo")
        .await
        .ok()
        .and_then(|m| decide::mem_available_mib(&m))?;
    decide::room_to_resume(available, memory_mib, ctx.settings.resume_reserve_mib)
        .err()
        .map(|e| format!("node {}: {e}", ctx.settings.node))
}

/// Keeps a VM that cannot resume Suspended, with `Ready=False/InsufficientMemory` saying why
/// (once per message), and tries again in 10 s.
async fn cannot_resume(ctx: &Context, vm: &ImpVM, why: String) -> Result<Action, Error> {
    let mut status = vm.status.clone().unwrap_or_default();
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        ConditionReason::InsufficientMemory,
        &why,
        vm.meta().generation,
        now(),
    );
    let said = vm.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.reason == ConditionReason::InsufficientMemory.as_str() && c.message == why)
    });
    ctx.patch_status(vm, &status).await?;
    if !said {
        tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "cannot resume: not enough memory");
        ctx.event(
            vm,
            EventType::Warning,
            ConditionReason::InsufficientMemory.as_str(),
            why,
        )
        .await;
    }
    Ok(Action::requeue(Duration::from_secs(10)))
}
