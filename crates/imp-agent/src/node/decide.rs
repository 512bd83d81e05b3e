//! What the agent does about one ImpVM, decided from the VM as the API shows it and the VM's
//! local record: a pure function, so every case is a unit test.
//!
//! The contract with the operator (see `imp_operator::controller`): the agent acts on VMs whose
//! `spec.nodeName` is its node; it starts a `Scheduled` VM whose `status.startedAt` is unset
//! (the operator clears it when it restarts a VM in place), writes `Starting` → `Running` →
//! `Succeeded`/`Failed`, and on deletion stops and removes the VM and then clears
//! `spec.nodeName`, the marker that lets the operator drop its finalizer.

use imp_api::conditions::ConditionReason;
use imp_api::vm::VmPhase;

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
    /// `spec.lifecycle` is ephemeral (a job) rather than persistent.
    pub ephemeral: bool,
}

/// The VM's local state: its record and whether its shim still runs.
#[derive(Debug, Clone, Copy)]
pub struct Local<'a> {
    /// The record the shim wrote.
    pub record: &'a VmRecord,
    /// Whether the shim process is alive.
    pub shim_alive: bool,
}

impl Local<'_> {
    fn attempt(&self) -> i32 {
        self.record.owner.as_ref().map_or(0, |o| o.attempt)
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
}

/// A status the record calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The shim is preparing or booting: phase `Starting`.
    Starting,
    /// The guest agent answered: phase `Running`, `Ready=True`.
    Running,
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
    match local {
        Some(l) if fresh_request && l.attempt() != vm.attempt => Decision::Start {
            clear_previous: true,
        },
        Some(l) if fresh_request && !l.shim_alive && l.record.status.is_final() => {
            // The same attempt ended, but the API still says Scheduled: our earlier status
            // write was lost. Report the end rather than booting the attempt twice.
            Decision::Report(report(vm, l))
        }
        Some(l) => Decision::Report(report(vm, l)),
        None if fresh_request => Decision::Start {
            clear_previous: false,
        },
        None if matches!(vm.phase, VmPhase::Starting | VmPhase::Running) => {
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

/// The status a record calls for.
fn report(vm: &Observed, l: Local<'_>) -> Report {
    let r = l.record;
    match r.status {
        VmStatus::Starting | VmStatus::Running if !l.shim_alive => Report::Ended {
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
        VmStatus::Running => Report::Running,
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
                _ => (
                    ConditionReason::Failed,
                    format!("the workload exited with code {code}"),
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

/// The condition reason of a failure in `stage`.
pub fn reason_for(stage: Option<Stage>) -> ConditionReason {
    match stage {
        Some(Stage::Image) => ConditionReason::ImagePullFailed,
        Some(Stage::Disk) => ConditionReason::DiskSetupFailed,
        Some(Stage::Config | Stage::Initramfs | Stage::Boot) => ConditionReason::RuntimeStartFailed,
        Some(Stage::GuestReady) => ConditionReason::GuestAgentTimeout,
        Some(Stage::Run) => ConditionReason::VmmExited,
        None => ConditionReason::Failed,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::runtime::state::Owner;

    fn vm(phase: VmPhase, started: bool) -> Observed {
        Observed {
            phase,
            deleting: false,
            started,
            attempt: 0,
            ephemeral: true,
        }
    }

    fn record(status: VmStatus, attempt: i32) -> VmRecord {
        VmRecord {
            name: "uid-1".into(),
            image: "img".into(),
            digest: None,
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
            remove_on_exit: false,
            attach_argv: None,
            timings: Default::default(),
            owner: Some(Owner {
                namespace: "ns".into(),
                name: "vm".into(),
                uid: "uid-1".into(),
                attempt,
            }),
        }
    }

    fn local(r: &VmRecord, alive: bool) -> Option<Local<'_>> {
        Some(Local {
            record: r,
            shim_alive: alive,
        })
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
}
