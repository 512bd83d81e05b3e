//! What the agent does about one ImpVM, decided from the VM as the API shows it and the VM's
//! local record: a pure function, so every case is a unit test.
//!
//! The contract with the operator (see `imp_operator::vm`): the agent acts on VMs whose
//! `spec.nodeName` is its node; it starts a `Scheduled` VM whose `status.startedAt` is unset
//! (the operator clears it when it restarts a VM in place, with a new `restartCount`, or rolls
//! a change of its spec into its booking, with a new `booking.revision`: a boot of another
//! attempt or revision that still runs is stopped first), writes `Starting` → `Running` →
//! `Succeeded`/`Failed`, and on deletion stops and removes the VM and then clears
//! `spec.nodeName`, the marker that lets the operator drop its finalizer.
//!
//! Suspend and resume follow `spec.desiredState`: a VM that runs and should be `Suspended` is
//! suspended by its shim (`Suspending` → `Suspended`, with `suspendedAt` and the snapshot's
//! place), a suspended VM that should run is restored by a new shim (`Resuming` → `Running`).
//! A suspend that failed (the VM runs on) is reported as a Warning and tried again after
//! [`Local::suspend_retry_secs`] (the agent's `--suspend-retry`).

use imp_api::conditions::ConditionReason;
use imp_api::vm::{MovePhase, VmPhase};

use crate::runtime::state::{Stage, VmRecord, VmStatus};

/// The VM as the API shows it, reduced to what the decision needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// `status.phase` (Pending when unset).
    pub phase: VmPhase,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `status.startedAt` is set: the agent started this attempt already.
    pub started: bool,
    /// `status.restartCount` (0 when unset): which attempt the operator asks for.
    pub attempt: i32,
    /// `status.booking.revision` (0 when unset): which rollout of the VM's spec it asks for.
    pub revision: i64,
    /// `spec.lifecycle` is ephemeral (a job) rather than persistent.
    pub ephemeral: bool,
    /// The operator takes the VM off this node (`DisruptionTarget=True`: evicted for a
    /// `NoExecute` taint, or its class or template changed): stop and remove it, then release
    /// it, so that it is placed anew only once nothing of it runs here.
    pub leaving: bool,
    /// `spec.desiredState` is `Suspended`.
    pub suspend_wanted: bool,
    /// `spec.desiredState` is `ScaleToZero`: suspend when idle, resume when woken.
    pub scale_to_zero: bool,
    /// The user opted in to a cold boot when the snapshot cannot be restored
    /// (`imp.dev/resume-fallback: cold-boot`).
    pub cold_boot_fallback: bool,
    /// A warm pool's claimant booked onto this node: the uid of the member whose running VM
    /// it takes over (`status.warmClaim.memberUID`).
    pub claim: Option<String>,
    /// A warm pool's member taken by a claim (`imp.dev/claimed-by`): its VM is, or is becoming,
    /// its claimant's, so having no record of its own is no loss.
    pub claimed: bool,
    /// A warm pool's member not taken, meant to run (not suspended or ScaleToZero), `Running`
    /// and `Ready`: it waits for a claim with its vCPUs paused.
    pub pause_wanted: bool,
    /// A move of the VM away from this node (`status.move` naming this node its source), and
    /// where it is.
    pub moving_out: Option<MovePhase>,
    /// This node's agent holds the files a move sent it for this VM, checked, and has no
    /// record of it yet: after the commit it takes them as the VM's own.
    pub moved_in: bool,
}

/// The VM's local state: its record and whether its shim still runs.
#[derive(Debug, Clone, Copy)]
pub struct Local<'a> {
    /// The record the shim wrote.
    pub record: &'a VmRecord,
    /// Whether the shim process is alive.
    pub shim_alive: bool,
    /// The node's clock, seconds since the Unix epoch (to age the record's times).
    pub now_unix: u64,
    /// How long after a failed suspend it is tried again, in seconds.
    pub suspend_retry_secs: u64,
    /// Scale-to-zero: the VM's TAP saw no frame from the guest for its `idleTimeout`.
    pub idle: bool,
    /// Scale-to-zero: a frame for the sleeping VM arrived (its sleeper holds it).
    pub woken: bool,
    /// Its shim refused to pause it (a shim of an earlier release, or its VMM could not): it
    /// is not asked again.
    pub pause_refused: bool,
}

impl Local<'_> {
    fn attempt(&self) -> i32 {
        self.record.owner.as_ref().map_or(0, |o| o.attempt)
    }

    fn revision(&self) -> i64 {
        self.record.owner.as_ref().map_or(0, |o| o.revision)
    }
}

/// What to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing now; a change of the VM or of its record will ask again.
    Wait,
    /// Start the VM; `clear_previous` removes what an earlier attempt left first.
    Start {
        /// An earlier attempt's record, disk and cgroup are still there.
        clear_previous: bool,
    },
    /// Make the status say what the record says.
    Report(Report),
    /// Stop the VM if it still runs and remove its files and cgroup; with `release`, then
    /// clear `spec.nodeName` (deletion).
    Teardown {
        /// Clear `spec.nodeName` afterwards so the operator drops its finalizer.
        release: bool,
    },
    /// Deletion of a VM that has nothing on this node: clear `spec.nodeName`.
    Release,
    /// Ask the VM's shim to suspend it (phase `Suspending`).
    Suspend,
    /// Start a shim that restores the suspended VM from its snapshot (phase `Resuming`).
    Resume,
    /// The snapshot could not be restored and the user opted in to a cold boot: remove what
    /// is left and boot the VM afresh from its image (its memory is lost).
    ColdBoot {
        /// Why the restore failed.
        why: String,
    },
    /// A warm pool's claimant with no record yet: take over the running VM of member
    /// `member` (its uid), or, if it no longer runs, start from the booking.
    Claim {
        /// The member's uid.
        member: String,
    },
    /// A warm pool's member ready for a claim: ask its shim to pause its vCPUs (a claim
    /// resumes them).
    Pause,
    /// A move away from this node: the VM is suspended (its shim gone, its snapshot on
    /// disk): send its files to the target's agent and say `Sent` (or `SendFailed`).
    SendMove,
    /// A VM moved here (committed), whose files this agent received: make them its record,
    /// suspended, which a resume then brings back.
    MoveIn,
}

/// A status the record calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The shim is preparing or booting: phase `Starting`.
    Starting,
    /// The guest agent answered: phase `Running`, `Ready=True`.
    Running,
    /// The VM should be suspended, but its last suspend failed and it runs on: phase
    /// `Running` and a Warning Event with the cause (once per failure).
    SuspendFailed {
        /// The failed request (one Event each).
        request: String,
        /// Why.
        error: String,
    },
    /// The shim is writing the snapshot: phase `Suspending`.
    Suspending,
    /// The VM is in its snapshot: phase `Suspended`.
    Suspended {
        /// When the snapshot was complete.
        at_unix: u64,
        /// The snapshot's directory on the node.
        path: String,
    },
    /// A new shim is restoring the VM: phase `Resuming`.
    Resuming,
    /// The VM ended.
    Ended {
        /// `Succeeded` or `Failed`.
        phase: VmPhase,
        /// The workload's exit code, if it reported one.
        exit_code: Option<i32>,
        /// The `Ready` condition's reason.
        reason: ConditionReason,
        /// What happened, for the condition and the Event.
        message: String,
    },
}

/// Decides what to do about one VM of this node. (Whether the node can run the VM at all is
/// checked when a start is decided, against [`super::capabilities::Capabilities`].)
pub fn decide(vm: &Observed, local: Option<Local<'_>>) -> Decision {
    if vm.deleting {
        return match local {
            Some(_) => Decision::Teardown { release: true },
            None => Decision::Release,
        };
    }
    if vm.leaving {
        // Released only once nothing of it is left here: the operator places it anew only
        // then, so it never runs on two nodes.
        return match local {
            Some(_) => Decision::Teardown { release: true },
            None => Decision::Release,
        };
    }
    if vm.phase.is_terminal() {
        // Reported already (or the operator ended it, e.g. a start timeout): free the node.
        return match local {
            Some(_) => Decision::Teardown { release: false },
            None => Decision::Wait,
        };
    }
    // Only once the operator has finished placing it (Scheduled): acting on the placement's
    // first write would race the operator's own status write.
    let fresh_request = vm.phase == VmPhase::Scheduled && !vm.started;
    if local.is_none() && vm.moved_in {
        return Decision::MoveIn;
    }
    if let Some(l) = local
        && let Some(d) = move_out(vm, l)
    {
        return d;
    }
    if local.is_none() {
        if vm.claimed {
            // Its VM went to its claimant: the pool deletes it (released then).
            return Decision::Wait;
        }
        if let Some(member) = &vm.claim
            && fresh_request
        {
            return Decision::Claim {
                member: member.clone(),
            };
        }
    }
    if let Some(l) = local
        && let Some(d) = suspend_or_resume(vm, l)
    {
        return d;
    }
    if let Some(l) = local
        && let Some(why) = failed_restore(vm, l)
    {
        return Decision::ColdBoot { why };
    }
    if let Some(l) = local
        && pause(vm, l)
    {
        return Decision::Pause;
    }
    match local {
        // Another attempt (a restart), or the same with a changed spec rolled in: the boot
        // that runs gives way to the new one.
        Some(l) if fresh_request && (l.attempt(), l.revision()) != (vm.attempt, vm.revision) => {
            Decision::Start {
                clear_previous: true,
            }
        }
        Some(l) if fresh_request && !l.shim_alive && l.record.status.is_final() => {
            // The same attempt ended, but the API still says Scheduled: our earlier status
            // write was lost. Report the end rather than booting the attempt twice.
            Decision::Report(report(vm, l))
        }
        Some(l) => Decision::Report(report(vm, l)),
        None if fresh_request => Decision::Start {
            clear_previous: false,
        },
        None if matches!(
            vm.phase,
            VmPhase::Starting
                | VmPhase::Running
                | VmPhase::Suspending
                | VmPhase::Suspended
                | VmPhase::Resuming
        ) =>
        {
            Decision::Report(Report::Ended {
                phase: VmPhase::Failed,
                exit_code: None,
                reason: ConditionReason::VmLost,
                message: "the node agent has no record of this VM (its state directory was lost, \
                          or the node restarted); the VM is gone"
                    .into(),
            })
        }
        None => Decision::Wait,
    }
}

/// A suspend of a running VM that should be suspended, or is idle under ScaleToZero (unless
/// a suspend failed just now), or a resume of a suspended VM that should run: asked for, or
/// woken by traffic under ScaleToZero.
fn suspend_or_resume(vm: &Observed, l: Local<'_>) -> Option<Decision> {
    let r = l.record;
    // A move suspends the VM first (its vCPUs stop here before any other node holds its
    // state), and holds it suspended until its commit; an abort lets it wake.
    let moving = vm.moving_out == Some(MovePhase::Transferring);
    let sleep = vm.suspend_wanted || (vm.scale_to_zero && l.idle) || moving;
    let held = vm.moving_out.is_some_and(|p| p != MovePhase::Aborting);
    let wake = !held
        && if vm.scale_to_zero {
            l.woken
        } else {
            !vm.suspend_wanted
        };
    match r.status {
        // Only once the API says Running: the Running write comes first.
        VmStatus::Running if sleep && l.shim_alive && vm.phase == VmPhase::Running => {
            (!failed_recently(l)).then_some(Decision::Suspend)
        }
        VmStatus::Suspended if wake && !l.shim_alive => Some(Decision::Resume),
        _ => None,
    }
}

/// A move away from this node, once the VM is suspended for it ([`suspend_or_resume`]
/// suspends it): send it, its shim gone and its snapshot complete. After `Sent` nothing more
/// until the commit takes the VM off this node (or an abort lets it wake).
fn move_out(vm: &Observed, l: Local<'_>) -> Option<Decision> {
    let sendable = l.record.status == VmStatus::Suspended && !l.shim_alive;
    (vm.moving_out == Some(MovePhase::Transferring) && sendable).then_some(Decision::SendMove)
}

/// Whether a member waiting for a claim is to be paused now: it runs (its record and the API
/// agree), its shim lives, and it is neither paused already nor refused.
fn pause(vm: &Observed, l: Local<'_>) -> bool {
    vm.pause_wanted
        && vm.phase == VmPhase::Running
        && l.shim_alive
        && l.record.status == VmStatus::Running
        && !l.record.paused
        && !l.pause_refused
}

/// Why the VM's restore failed, when the user wants a cold boot instead of a failed VM.
fn failed_restore(vm: &Observed, l: Local<'_>) -> Option<String> {
    let r = l.record;
    let restore_failed = r.status == VmStatus::Failed && r.error_stage == Some(Stage::Resume);
    (vm.cold_boot_fallback && restore_failed && !l.shim_alive && !vm.phase.is_terminal()).then(
        || {
            r.error
                .clone()
                .unwrap_or_else(|| "the restore failed".to_owned())
        },
    )
}

/// Whether the agent should hold the VM's TAP for it (answer ARP, hold frames, wake it on
/// traffic): a ScaleToZero VM that is suspended and whose shim is gone (the VMM released the
/// TAP). The caller adds "and it has a TAP".
pub fn wants_sleeper(vm: &Observed, local: Option<Local<'_>>) -> bool {
    local.is_some_and(|l| {
        vm.scale_to_zero && !vm.deleting && !l.shim_alive && l.record.status == VmStatus::Suspended
    })
}

/// Whether the VM's last suspend failed less than [`Local::suspend_retry_secs`] ago.
fn failed_recently(l: Local<'_>) -> bool {
    l.record
        .suspend_failure
        .as_ref()
        .is_some_and(|f| l.now_unix.saturating_sub(f.failed_unix) < l.suspend_retry_secs)
}

/// A running VM's report: a suspend that failed just now, one still in flight (asked for, the
/// shim has not picked it up yet), or simply running.
fn running(vm: &Observed, l: Local<'_>) -> Report {
    // Under ScaleToZero the agent asked for the suspend because the VM was idle; it stays
    // asked for even if a frame arrives before the shim picks the request up.
    let may_sleep = vm.suspend_wanted || vm.scale_to_zero;
    match &l.record.suspend_failure {
        Some(f) if may_sleep && failed_recently(l) => Report::SuspendFailed {
            request: f.request.clone(),
            error: f.error.clone(),
        },
        _ if may_sleep && vm.phase == VmPhase::Suspending => Report::Suspending,
        _ => Report::Running,
    }
}

/// The status a record calls for.
fn report(vm: &Observed, l: Local<'_>) -> Report {
    let r = l.record;
    match r.status {
        s if s.needs_shim() && !l.shim_alive => Report::Ended {
            phase: VmPhase::Failed,
            exit_code: None,
            reason: ConditionReason::VmLost,
            message: format!(
                "the VM's supervisor (pid {}) died before recording the VM's end; the VM is \
                 stopped and its files removed",
                r.supervisor_pid
            ),
        },
        VmStatus::Starting => Report::Starting,
        VmStatus::Running => running(vm, l),
        VmStatus::Suspending => Report::Suspending,
        VmStatus::Resuming => Report::Resuming,
        VmStatus::Suspended => Report::Suspended {
            at_unix: r.suspend.as_ref().map_or(0, |s| s.suspended_unix),
            path: r
                .suspend
                .as_ref()
                .map(|s| s.snapshot_dir.display().to_string())
                .unwrap_or_default(),
        },
        VmStatus::Exited => {
            let code = r.exit_code.unwrap_or(0);
            let phase = if code == 0 && vm.ephemeral {
                VmPhase::Succeeded
            } else {
                VmPhase::Failed
            };
            let (reason, message) = match phase {
                VmPhase::Succeeded => (
                    ConditionReason::Completed,
                    "the workload exited with code 0".to_owned(),
                ),
                // A failure the guest explained (its user data failed) says so.
                _ => (
                    ConditionReason::Failed,
                    r.error
                        .clone()
                        .unwrap_or_else(|| format!("the workload exited with code {code}")),
                ),
            };
            Report::Ended {
                phase,
                exit_code: Some(code),
                reason,
                message,
            }
        }
        VmStatus::Failed => Report::Ended {
            phase: VmPhase::Failed,
            exit_code: r.exit_code,
            reason: reason_for(r.error_stage),
            message: r
                .error
                .clone()
                .unwrap_or_else(|| "the VM failed".to_owned()),
        },
    }
}

/// What an exec into a VM that does not run can expect, by the VM's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecWake {
    /// A suspend or a resume is under way: it ends asleep (then knock) or running.
    Wait,
    /// It is suspended: a sleeper that holds it (scale-to-zero) wakes it; else nothing does.
    Knock,
    /// Nothing makes it run by itself: starting, ended, or failed.
    Refuse,
}

/// See [`ExecWake`].
pub fn exec_wake(status: VmStatus) -> ExecWake {
    match status {
        VmStatus::Suspending | VmStatus::Resuming => ExecWake::Wait,
        VmStatus::Suspended => ExecWake::Knock,
        VmStatus::Starting | VmStatus::Running | VmStatus::Exited | VmStatus::Failed => {
            ExecWake::Refuse
        }
    }
}

/// Memory a resumed VM's VMM needs beyond the guest's (QEMU or Firecracker, its buffers).
pub const VMM_OVERHEAD_MIB: u64 = 64;

/// `MemAvailable` of `/proc/meminfo`, in MiB.
pub fn mem_available_mib(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// Whether a VM of `memory_mib` can be resumed with `available_mib` free on the node, keeping
/// `reserve_mib` for the node itself; if not, why (the figures, for the condition).
pub fn room_to_resume(available_mib: u64, memory_mib: u32, reserve_mib: u64) -> Result<(), String> {
    let needed = u64::from(memory_mib) + VMM_OVERHEAD_MIB + reserve_mib;
    if available_mib >= needed {
        return Ok(());
    }
    Err(format!(
        "not enough free memory to resume: {available_mib} MiB available, the VM needs \
         {memory_mib} MiB + {VMM_OVERHEAD_MIB} MiB for its VMM + {reserve_mib} MiB kept for the \
         node (--resume-reserve-mib); it stays Suspended and is tried again every 10s"
    ))
}

/// The condition reason of a failure in `stage`.
pub fn reason_for(stage: Option<Stage>) -> ConditionReason {
    match stage {
        Some(Stage::Image) => ConditionReason::ImagePullFailed,
        Some(Stage::Disk) => ConditionReason::DiskSetupFailed,
        Some(Stage::Config | Stage::Initramfs | Stage::Boot) => ConditionReason::RuntimeStartFailed,
        Some(Stage::GuestReady) => ConditionReason::GuestAgentTimeout,
        Some(Stage::Run) => ConditionReason::VmmExited,
        Some(Stage::Resume) => ConditionReason::ResumeFailed,
        Some(Stage::Probe) => ConditionReason::ProbeFailed,
        None => ConditionReason::Failed,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::runtime::state::Owner;

    fn vm(phase: VmPhase, started: bool) -> Observed {
        Observed {
            phase,
            deleting: false,
            started,
            attempt: 0,
            revision: 0,
            ephemeral: true,
            leaving: false,
            suspend_wanted: false,
            scale_to_zero: false,
            cold_boot_fallback: false,
            claim: None,
            claimed: false,
            pause_wanted: false,
            moving_out: None,
            moved_in: false,
        }
    }

    #[test]
    fn a_move_suspends_the_vm_sends_it_holds_it_until_the_commit_and_an_abort_wakes_it() {
        let moving = |p: MovePhase| Observed {
            moving_out: Some(p),
            ephemeral: false,
            ..vm(VmPhase::Running, true)
        };
        let running = record(VmStatus::Running, 0);
        assert_eq!(
            decide(&moving(MovePhase::Transferring), local(&running, true)),
            Decision::Suspend
        );
        let suspended = asleep();
        let transferring = Observed {
            phase: VmPhase::Suspended,
            ..moving(MovePhase::Transferring)
        };
        assert_eq!(
            decide(&transferring, local(&suspended, false)),
            Decision::SendMove
        );
        // Sent, failed to send, committed: held, never resumed here.
        for p in [MovePhase::Sent, MovePhase::SendFailed, MovePhase::Committed] {
            let held = Observed {
                phase: VmPhase::Suspended,
                ..moving(p)
            };
            assert!(
                matches!(decide(&held, local(&suspended, false)), Decision::Report(_)),
                "{p:?}"
            );
        }
        // Aborted: the VM wakes where it was.
        let aborting = Observed {
            phase: VmPhase::Suspended,
            ..moving(MovePhase::Aborting)
        };
        assert_eq!(
            decide(&aborting, local(&suspended, false)),
            Decision::Resume
        );
        // A VM its user suspended moves as it is, and stays suspended after an abort.
        let user_suspended = Observed {
            suspend_wanted: true,
            ..aborting
        };
        assert!(matches!(
            decide(&user_suspended, local(&suspended, false)),
            Decision::Report(_)
        ));
        // The target: the files received, no record yet, the commit made: taken in; without
        // the files a VM with no record is lost as before.
        let arrived = Observed {
            moved_in: true,
            phase: VmPhase::Suspended,
            ..vm(VmPhase::Running, true)
        };
        assert_eq!(decide(&arrived, None), Decision::MoveIn);
        assert!(matches!(
            decide(
                &Observed {
                    moved_in: false,
                    ..arrived
                },
                None
            ),
            Decision::Report(Report::Ended { .. })
        ));
    }

    #[test]
    fn a_claimant_takes_over_its_member_and_a_taken_member_is_not_lost() {
        let claimant = Observed {
            claim: Some("member-uid".into()),
            ..vm(VmPhase::Scheduled, false)
        };
        assert_eq!(
            decide(&claimant, None),
            Decision::Claim {
                member: "member-uid".into()
            }
        );
        // Once the shim committed, its record is the claimant's: reported as any start.
        let r = record(VmStatus::Running, 0);
        assert_eq!(
            decide(&claimant, local(&r, true)),
            Decision::Report(Report::Running)
        );
        // Its own start written already (Starting): no second take-over.
        let started = Observed {
            started: true,
            ..claimant.clone()
        };
        assert_ne!(
            decide(&started, None),
            Decision::Claim {
                member: "member-uid".into()
            }
        );
        // The member, its VM handed over: no record of its own, and not lost for it.
        let member = Observed {
            claimed: true,
            ..vm(VmPhase::Running, true)
        };
        assert_eq!(decide(&member, None), Decision::Wait);
        let deleted = Observed {
            deleting: true,
            ..member
        };
        assert_eq!(decide(&deleted, None), Decision::Release);
        // Without the mark, a Running VM with no record is lost.
        assert!(matches!(
            decide(&vm(VmPhase::Running, true), None),
            Decision::Report(Report::Ended { .. })
        ));
    }

    pub(crate) fn record(status: VmStatus, attempt: i32) -> VmRecord {
        VmRecord {
            name: "uid-1".into(),
            image: "img".into(),
            digest: None,
            layer_digests: Vec::new(),
            runtime: "qemu".into(),
            supervisor_pid: 42,
            supervisor_started: None,
            vmm_pid: Some(43),
            helper_pids: vec![],
            vsock: "/v".into(),
            agent_port: 10000,
            serial_log: "/s".into(),
            created_unix: 0,
            running_unix: None,
            finished_unix: None,
            status,
            exit_code: None,
            error: None,
            error_stage: None,
            console_tail: None,
            vmm: None,
            remove_on_exit: false,
            guest_agent: true,
            attach_argv: None,
            timings: Default::default(),
            suspend: None,
            suspend_failure: None,
            paused: false,
            owner: Some(Owner {
                namespace: "ns".into(),
                name: "vm".into(),
                uid: "uid-1".into(),
                attempt,
                revision: 0,
            }),
        }
    }

    fn local(r: &VmRecord, alive: bool) -> Option<Local<'_>> {
        Some(Local {
            record: r,
            shim_alive: alive,
            now_unix: 1000,
            suspend_retry_secs: 60,
            idle: false,
            woken: false,
            pause_refused: false,
        })
    }

    fn asleep() -> VmRecord {
        let mut r = record(VmStatus::Suspended, 0);
        r.suspend = Some(crate::runtime::state::SuspendRecord {
            snapshot_dir: "/snap".into(),
            suspended_unix: 900,
            paused_unix_ms: None,
            bytes: 1,
            vmm: None,
        });
        r
    }

    #[test]
    fn scale_to_zero_suspends_only_an_idle_vm_and_resumes_only_a_woken_one() {
        let running = record(VmStatus::Running, 0);
        let mut v = vm(VmPhase::Running, true);
        v.scale_to_zero = true;
        assert_eq!(
            decide(&v, local(&running, true)),
            Decision::Report(Report::Running),
            "busy: stays up"
        );
        let idle = Local {
            idle: true,
            ..local(&running, true).unwrap()
        };
        assert_eq!(decide(&v, Some(idle)), Decision::Suspend);
        // Asked already: the phase says Suspending and stays so, even if a frame came since.
        v.phase = VmPhase::Suspending;
        assert_eq!(
            decide(&v, local(&running, true)),
            Decision::Report(Report::Suspending)
        );
        let sleeping = asleep();
        v.phase = VmPhase::Suspended;
        assert!(
            matches!(
                decide(&v, local(&sleeping, false)),
                Decision::Report(Report::Suspended { .. })
            ),
            "asleep and nobody knocked: stays suspended"
        );
        assert!(wants_sleeper(&v, local(&sleeping, false)));
        let woken = Local {
            woken: true,
            ..local(&sleeping, false).unwrap()
        };
        assert_eq!(decide(&v, Some(woken)), Decision::Resume);
        // The user may still wake it by hand, or put it to sleep for good.
        let mut by_hand = v.clone();
        by_hand.scale_to_zero = false;
        assert_eq!(decide(&by_hand, local(&sleeping, false)), Decision::Resume);
        by_hand.suspend_wanted = true;
        assert!(!wants_sleeper(&by_hand, local(&sleeping, false)));
        assert_ne!(decide(&by_hand, Some(woken)), Decision::Resume);
    }

    #[test]
    fn a_ready_member_is_paused_once_and_a_claim_or_a_refusal_ends_it() {
        let member = Observed {
            pause_wanted: true,
            ..vm(VmPhase::Running, true)
        };
        let running = record(VmStatus::Running, 0);
        assert_eq!(decide(&member, local(&running, true)), Decision::Pause);
        // Paused: reported running, not asked again.
        let mut paused = running.clone();
        paused.paused = true;
        assert_eq!(
            decide(&member, local(&paused, true)),
            Decision::Report(Report::Running)
        );
        // Its shim refused (an earlier release's): not asked again either.
        let refused = Local {
            pause_refused: true,
            ..local(&running, true).unwrap()
        };
        assert_eq!(
            decide(&member, Some(refused)),
            Decision::Report(Report::Running)
        );
        // Not before the API says Running, nor with its shim gone, nor once it is deleted.
        let starting = Observed {
            phase: VmPhase::Starting,
            ..member.clone()
        };
        assert_ne!(decide(&starting, local(&running, true)), Decision::Pause);
        assert_ne!(decide(&member, local(&running, false)), Decision::Pause);
        let deleted = Observed {
            deleting: true,
            ..member.clone()
        };
        assert_ne!(decide(&deleted, local(&running, true)), Decision::Pause);
        // A plain VM is never paused.
        assert_eq!(
            decide(&vm(VmPhase::Running, true), local(&running, true)),
            Decision::Report(Report::Running)
        );
    }

    #[test]
    fn a_resume_needs_the_guest_memory_the_vmm_and_the_reserve() {
        let meminfo = "MemTotal:        8000000 kB\nMemFree: 1 kB\nMemAvailable:    1048576 kB\n";
        assert_eq!(mem_available_mib(meminfo), Some(1024));
        assert_eq!(mem_available_mib("MemTotal: 1 kB\n"), None);
        assert!(room_to_resume(1024, 256, 704).is_ok());
        let why = room_to_resume(1024, 256, 705).unwrap_err();
        assert_eq!(
            why,
            "not enough free memory to resume: 1024 MiB available, the VM needs 256 MiB + 64 MiB \
             for its VMM + 705 MiB kept for the node (--resume-reserve-mib); it stays Suspended \
             and is tried again every 10s"
        );
    }

    #[test]
    fn an_exec_waits_for_a_suspend_or_resume_knocks_on_a_sleeper_and_refuses_the_rest() {
        use VmStatus::*;
        assert_eq!(exec_wake(Suspending), ExecWake::Wait);
        assert_eq!(exec_wake(Resuming), ExecWake::Wait);
        assert_eq!(exec_wake(Suspended), ExecWake::Knock);
        // A record that says Running while exec found the VM not running: its shim is dead.
        for s in [Starting, Running, Exited, Failed] {
            assert_eq!(exec_wake(s), ExecWake::Refuse, "{s:?}");
        }
    }

    #[test]
    fn a_bad_snapshot_fails_the_vm_unless_a_cold_boot_was_asked_for() {
        let mut r = record(VmStatus::Failed, 0);
        r.error_stage = Some(Stage::Resume);
        r.error = Some("restoring from its snapshot: the state file is corrupt".into());
        let mut v = vm(VmPhase::Resuming, true);
        assert!(matches!(
            decide(&v, local(&r, false)),
            Decision::Report(Report::Ended {
                reason: ConditionReason::ResumeFailed,
                ..
            })
        ));
        v.cold_boot_fallback = true;
        assert_eq!(
            decide(&v, local(&r, false)),
            Decision::ColdBoot {
                why: "restoring from its snapshot: the state file is corrupt".into()
            }
        );
        // Any other failure ends the VM as usual.
        r.error_stage = Some(Stage::Run);
        assert!(matches!(
            decide(&v, local(&r, false)),
            Decision::Report(Report::Ended { .. })
        ));
    }

    #[test]
    fn a_sleeper_only_holds_a_tap_the_vmm_let_go_of() {
        let mut v = vm(VmPhase::Suspended, true);
        v.scale_to_zero = true;
        let sleeping = asleep();
        assert!(
            !wants_sleeper(&v, local(&sleeping, true)),
            "the shim (and its VMM) may still hold the TAP"
        );
        assert!(!wants_sleeper(
            &v,
            local(&record(VmStatus::Resuming, 0), false)
        ));
        assert!(!wants_sleeper(&v, None));
        v.deleting = true;
        assert!(!wants_sleeper(&v, local(&sleeping, false)));
    }

    #[test]
    fn an_idle_vm_whose_suspend_just_failed_runs_on_and_says_why() {
        let mut r = record(VmStatus::Running, 0);
        r.suspend_failure = Some(crate::runtime::state::SuspendFailure {
            request: "t1".into(),
            failed_unix: 990,
            error: "not enough free disk space".into(),
        });
        let mut v = vm(VmPhase::Running, true);
        v.scale_to_zero = true;
        let idle = Local {
            idle: true,
            ..local(&r, true).unwrap()
        };
        assert!(matches!(
            decide(&v, Some(idle)),
            Decision::Report(Report::SuspendFailed { .. })
        ));
    }

    #[test]
    fn a_running_vm_that_should_sleep_is_suspended_and_a_sleeping_one_that_should_run_resumed() {
        let running = record(VmStatus::Running, 0);
        let mut v = vm(VmPhase::Running, true);
        v.suspend_wanted = true;
        assert_eq!(decide(&v, local(&running, true)), Decision::Suspend);
        // Not before the API says Running, and not with a dead shim.
        let starting = vm(VmPhase::Starting, true);
        let mut early = starting.clone();
        early.suspend_wanted = true;
        assert_eq!(
            decide(&early, local(&running, true)),
            Decision::Report(Report::Running)
        );
        assert!(matches!(
            decide(&v, local(&running, false)),
            Decision::Report(Report::Ended {
                reason: ConditionReason::VmLost,
                ..
            })
        ));
        // In flight: reported, not asked again.
        let suspending = record(VmStatus::Suspending, 0);
        assert_eq!(
            decide(&v, local(&suspending, true)),
            Decision::Report(Report::Suspending)
        );
        let mut asleep = record(VmStatus::Suspended, 0);
        asleep.suspend = Some(crate::runtime::state::SuspendRecord {
            snapshot_dir: "/var/lib/imp/agent/snapshots/uid-1".into(),
            suspended_unix: 900,
            paused_unix_ms: None,
            bytes: 1,
            vmm: None,
        });
        let mut s = vm(VmPhase::Suspending, true);
        s.suspend_wanted = true;
        assert_eq!(
            decide(&s, local(&asleep, false)),
            Decision::Report(Report::Suspended {
                at_unix: 900,
                path: "/var/lib/imp/agent/snapshots/uid-1".into()
            }),
            "a suspended VM has no shim, and that is not a loss"
        );
        s.suspend_wanted = false;
        s.phase = VmPhase::Suspended;
        assert_eq!(decide(&s, local(&asleep, false)), Decision::Resume);
        let resuming = record(VmStatus::Resuming, 0);
        assert_eq!(
            decide(&s, local(&resuming, true)),
            Decision::Report(Report::Resuming)
        );
        // Resuming a VM that is already running is nothing to do.
        assert_eq!(
            decide(&vm(VmPhase::Running, true), local(&running, true)),
            Decision::Report(Report::Running)
        );
    }

    #[test]
    fn a_failed_suspend_is_reported_then_retried_after_a_while() {
        let mut r = record(VmStatus::Running, 0);
        r.suspend_failure = Some(crate::runtime::state::SuspendFailure {
            request: "t1".into(),
            failed_unix: 1000 - 60 + 1,
            error: "not enough free disk space".into(),
        });
        let mut v = vm(VmPhase::Running, true);
        v.suspend_wanted = true;
        assert_eq!(
            decide(&v, local(&r, true)),
            Decision::Report(Report::SuspendFailed {
                request: "t1".into(),
                error: "not enough free disk space".into()
            })
        );
        r.suspend_failure.as_mut().unwrap().failed_unix = 1000 - 60;
        assert_eq!(decide(&v, local(&r, true)), Decision::Suspend);
        // Once the user wants it running again, the old failure is no news.
        v.suspend_wanted = false;
        assert_eq!(
            decide(&v, local(&r, true)),
            Decision::Report(Report::Running)
        );
    }

    #[test]
    fn a_suspended_vm_whose_record_is_gone_is_lost_and_a_failed_resume_says_why() {
        for phase in [VmPhase::Suspended, VmPhase::Suspending, VmPhase::Resuming] {
            assert!(
                matches!(
                    decide(&vm(phase, true), None),
                    Decision::Report(Report::Ended {
                        reason: ConditionReason::VmLost,
                        ..
                    })
                ),
                "{phase}"
            );
        }
        let mut r = record(VmStatus::Failed, 0);
        r.error = Some("cannot resume: its snapshot file /s/memory is missing".into());
        r.error_stage = Some(Stage::Resume);
        let Decision::Report(Report::Ended {
            reason, message, ..
        }) = decide(&vm(VmPhase::Resuming, true), local(&r, false))
        else {
            panic!("expected an end");
        };
        assert_eq!(reason, ConditionReason::ResumeFailed);
        assert!(message.contains("missing"), "{message}");
    }

    #[test]
    fn a_scheduled_vm_starts_and_a_half_placed_one_waits() {
        let v = vm(VmPhase::Scheduled, false);
        assert_eq!(
            decide(&v, None),
            Decision::Start {
                clear_previous: false
            }
        );
        assert_eq!(decide(&vm(VmPhase::Pending, false), None), Decision::Wait);
    }

    #[test]
    fn a_started_attempt_is_never_booted_twice() {
        // The cache still shows Scheduled after we started the VM: report, don't start.
        let r = record(VmStatus::Starting, 0);
        let v = vm(VmPhase::Scheduled, false);
        assert_eq!(
            decide(&v, local(&r, true)),
            Decision::Report(Report::Starting)
        );
        // Ended, and our Succeeded write was lost: report it again, do not start.
        let mut done = record(VmStatus::Exited, 0);
        done.exit_code = Some(0);
        assert!(matches!(
            decide(&v, local(&done, false)),
            Decision::Report(Report::Ended {
                phase: VmPhase::Succeeded,
                ..
            })
        ));
    }

    #[test]
    fn a_restart_in_place_clears_the_previous_attempt() {
        let mut r = record(VmStatus::Exited, 0);
        r.exit_code = Some(1);
        let mut v = vm(VmPhase::Scheduled, false);
        v.attempt = 1;
        assert_eq!(
            decide(&v, local(&r, false)),
            Decision::Start {
                clear_previous: true
            }
        );
    }

    #[test]
    fn a_rolled_spec_change_gives_the_running_boot_way_to_a_new_one() {
        let running = record(VmStatus::Running, 0);
        let mut v = vm(VmPhase::Scheduled, false);
        v.revision = 1;
        assert_eq!(
            decide(&v, local(&running, true)),
            Decision::Start {
                clear_previous: true
            }
        );
        // Once started (startedAt written), the new boot is reported, never booted twice.
        let mut new_boot = record(VmStatus::Running, 0);
        new_boot.owner.as_mut().unwrap().revision = 1;
        assert_eq!(
            decide(&v, local(&new_boot, true)),
            Decision::Report(Report::Running)
        );
    }

    #[test]
    fn records_become_phases() {
        let v = vm(VmPhase::Starting, true);
        let running = record(VmStatus::Running, 0);
        assert_eq!(
            decide(&v, local(&running, true)),
            Decision::Report(Report::Running)
        );
        let mut failed = record(VmStatus::Exited, 0);
        failed.exit_code = Some(3);
        let Decision::Report(Report::Ended {
            phase,
            exit_code,
            reason,
            ..
        }) = decide(&vm(VmPhase::Running, true), local(&failed, false))
        else {
            panic!("expected an end");
        };
        assert_eq!(
            (phase, exit_code, reason),
            (VmPhase::Failed, Some(3), ConditionReason::Failed)
        );
        // The guest's account of a failed user-data step is the message.
        failed.error = Some("userData failed, the workload was not started: runcmd[0]".into());
        let Decision::Report(Report::Ended {
            exit_code, message, ..
        }) = decide(&vm(VmPhase::Running, true), local(&failed, false))
        else {
            panic!("expected an end");
        };
        assert_eq!(
            (exit_code, message.as_str()),
            (
                Some(3),
                "userData failed, the workload was not started: runcmd[0]"
            )
        );
        // A persistent workload that exits 0 still ended: Failed, so the restart policy applies.
        let mut ok = record(VmStatus::Exited, 0);
        ok.exit_code = Some(0);
        let mut persistent = vm(VmPhase::Running, true);
        persistent.ephemeral = false;
        assert!(matches!(
            decide(&persistent, local(&ok, false)),
            Decision::Report(Report::Ended {
                phase: VmPhase::Failed,
                exit_code: Some(0),
                ..
            })
        ));
    }

    #[test]
    fn failures_carry_the_reason_of_their_stage() {
        let mut r = record(VmStatus::Failed, 0);
        r.error = Some("pulling x: 404".into());
        r.error_stage = Some(Stage::Image);
        let d = decide(&vm(VmPhase::Starting, true), local(&r, false));
        assert_eq!(
            d,
            Decision::Report(Report::Ended {
                phase: VmPhase::Failed,
                exit_code: None,
                reason: ConditionReason::ImagePullFailed,
                message: "pulling x: 404".into(),
            })
        );
        assert_eq!(
            reason_for(Some(Stage::Disk)),
            ConditionReason::DiskSetupFailed
        );
        assert_eq!(
            reason_for(Some(Stage::GuestReady)),
            ConditionReason::GuestAgentTimeout
        );
    }

    #[test]
    fn a_dead_shim_or_a_lost_record_is_reported_as_lost() {
        let r = record(VmStatus::Running, 0);
        let d = decide(&vm(VmPhase::Running, true), local(&r, false));
        assert!(matches!(
            d,
            Decision::Report(Report::Ended {
                reason: ConditionReason::VmLost,
                ..
            })
        ));
        let d = decide(&vm(VmPhase::Running, true), None);
        assert!(matches!(
            d,
            Decision::Report(Report::Ended {
                reason: ConditionReason::VmLost,
                ..
            })
        ));
    }

    #[test]
    fn deletion_tears_down_then_releases_and_terminal_vms_free_the_node() {
        let r = record(VmStatus::Running, 0);
        let mut v = vm(VmPhase::Running, true);
        v.deleting = true;
        assert_eq!(
            decide(&v, local(&r, true)),
            Decision::Teardown { release: true }
        );
        assert_eq!(decide(&v, None), Decision::Release);
        let done = vm(VmPhase::Succeeded, true);
        assert_eq!(
            decide(&done, local(&r, false)),
            Decision::Teardown { release: false }
        );
        assert_eq!(decide(&done, None), Decision::Wait);
    }

    #[test]
    fn a_vm_leaving_the_node_is_stopped_removed_and_released_so_it_can_move() {
        let r = record(VmStatus::Running, 0);
        let mut v = vm(VmPhase::Failed, true);
        v.leaving = true;
        assert_eq!(
            decide(&v, local(&r, true)),
            Decision::Teardown { release: true },
            "the VM still runs here: stop it before anything else may run it"
        );
        assert_eq!(decide(&v, None), Decision::Release);
        // Evicted before it started here (Scheduled, then evicted): nothing to stop.
        let mut early = vm(VmPhase::Failed, false);
        early.leaving = true;
        assert_eq!(decide(&early, None), Decision::Release);
        // A class change: Pending while its old boot still runs here.
        let mut moved = vm(VmPhase::Pending, false);
        moved.leaving = true;
        assert_eq!(
            decide(&moved, local(&r, true)),
            Decision::Teardown { release: true }
        );
    }
}
