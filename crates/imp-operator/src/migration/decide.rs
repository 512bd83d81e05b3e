//! What one look at an ImpVMMigration and its VM calls for: pure, tested on its own. The
//! controller ([`super`]) reads the migration and the VM, asks [`next`] and applies the step.
//!
//! A move is carried by the VM's own status (`status.move`, docs/migration.md section 2): the
//! operator writes it (`Transferring`), the source's agent suspends the VM, sends its files to
//! the target's agent and says `Sent` (or `SendFailed`), the operator commits by writing
//! `spec.nodeName: <target>` and marks the move `Committed`; the target's agent resumes the
//! VM and reports it `Running` there, and the operator clears the move and says `Succeeded`.
//! Before the commit, anything that goes wrong aborts (`Aborting`): the source's agent resumes
//! the VM where it was and the operator clears the move once it runs there again.

use imp_api::snapshot::{ImpVMMigration, MigrationPhase};
use imp_api::vm::{ImpVM, MovePhase, VmMove, VmPhase};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

/// How long a move may take from its start to its commit before it is given up.
pub const DEADLINE: SignedDuration = SignedDuration::from_mins(10);

/// The only mode built: suspended, its files copied, resumed on the target.
pub const MODE_COLD: &str = "cold";

/// Why a migration failed, as its condition's reason says it.
pub mod reason {
    /// The VM named is not in the namespace.
    pub const NO_VM: &str = "VMNotFound";
    /// The VM is not on a node, or not in a phase that can move.
    pub const NOT_MOVABLE: &str = "VMNotMovable";
    /// Another migration moves the VM.
    pub const BUSY: &str = "AlreadyMoving";
    /// No node can take the VM, or the one asked for cannot.
    pub const TARGET_UNFIT: &str = "TargetUnfit";
    /// The source's agent could not send the VM.
    pub const SEND_FAILED: &str = "SendFailed";
    /// The move did not reach its commit in time.
    pub const TIMED_OUT: &str = "TimedOut";
    /// The VM went away during the move.
    pub const VM_GONE: &str = "VMGone";
    /// The spec names another namespace.
    pub const INVALID: &str = "InvalidSpec";
}

/// The step the controller is to take now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do until the migration or its VM changes.
    Wait,
    /// Choose (or check) the target, book it and write `status.move` on the VM.
    Start {
        /// The VM's node.
        source: String,
    },
    /// Write `spec.nodeName: target` on the VM (the commit).
    Commit {
        /// The node the VM goes to.
        target: String,
    },
    /// The commit is in `spec.nodeName`: mark the move `Committed` in the VM's status.
    MarkCommitted,
    /// Give the move up before its commit: `status.move.phase: Aborting`.
    Abort {
        /// The migration's reason.
        reason: &'static str,
        /// Why.
        message: String,
    },
    /// The aborted move's VM runs where it was again: clear `status.move`, fail the migration.
    ClearAborted,
    /// The VM runs on the target: clear `status.move`, the migration `Succeeded`.
    Succeed,
    /// Fail the migration with nothing to undo.
    Fail {
        /// The migration's reason.
        reason: &'static str,
        /// Why.
        message: String,
    },
}

/// The namespace the migration's VM is in (the migration's own; the webhook refuses any
/// other, and so does [`next`]).
pub fn vm_namespace(m: &ImpVMMigration) -> String {
    m.namespace().unwrap_or_default()
}

/// The move of `vm` that migration `m` started, if the VM's status holds one.
pub fn own_move<'a>(m: &ImpVMMigration, vm: &'a ImpVM) -> Option<&'a VmMove> {
    let uid = m.uid().unwrap_or_default();
    vm.status
        .as_ref()?
        .moving
        .as_ref()
        .filter(|mv| mv.migration_uid == uid)
}

/// Whether the migration is over (nothing more is done for it).
pub fn finished(m: &ImpVMMigration) -> bool {
    matches!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::Cancelled)
    )
}

/// The step for migration `m` whose VM is `vm` (`None`: not found), at `now`.
pub fn next(m: &ImpVMMigration, vm: Option<&ImpVM>, now: Timestamp) -> Step {
    let ns = vm_namespace(m);
    let asked_ns = m.spec.source_vm_namespace.as_str();
    if !asked_ns.is_empty() && asked_ns != ns {
        return fail(
            reason::INVALID,
            format!("spec.sourceVMNamespace {asked_ns} is not the migration's namespace {ns}"),
        );
    }
    let Some(vm) = vm else {
        return if finished(m) {
            Step::Wait
        } else if started(m) {
            fail(reason::VM_GONE, "the VM was deleted during the move".into())
        } else {
            fail(
                reason::NO_VM,
                format!("no ImpVM {} in namespace {ns}", m.spec.source_vm_name),
            )
        };
    };
    match own_move(m, vm) {
        Some(mv) => moving(vm, mv, now),
        None if finished(m) => Step::Wait,
        None if started(m) => after_move(m, vm),
        None => start(m, vm),
    }
}

/// Whether the controller has started the move (the migration's status says so).
fn started(m: &ImpVMMigration) -> bool {
    matches!(
        m.status.as_ref().and_then(|s| s.phase),
        Some(
            MigrationPhase::Transferring | MigrationPhase::Snapshotting | MigrationPhase::Restoring
        )
    )
}

fn fail(reason: &'static str, message: String) -> Step {
    Step::Fail { reason, message }
}

/// A migration not started: may its VM move now?
fn start(m: &ImpVMMigration, vm: &ImpVM) -> Step {
    let status = vm.status.as_ref();
    if let Some(other) = status.and_then(|s| s.moving.as_ref()) {
        return fail(
            reason::BUSY,
            format!(
                "the VM is being moved to {} by migration {}; one move at a time",
                other.target, other.migration
            ),
        );
    }
    if vm.metadata.deletion_timestamp.is_some() {
        return fail(reason::NOT_MOVABLE, "the VM is being deleted".into());
    }
    let Some(source) = vm.spec.node_name.clone() else {
        return fail(
            reason::NOT_MOVABLE,
            "the VM is not placed on a node yet".into(),
        );
    };
    let phase = status.and_then(|s| s.phase).unwrap_or_default();
    if !matches!(phase, VmPhase::Running | VmPhase::Suspended) {
        return fail(
            reason::NOT_MOVABLE,
            format!("the VM is {phase}; only a Running or Suspended VM moves"),
        );
    }
    if m.spec.target_node.as_deref() == Some(source.as_str()) {
        return fail(
            reason::TARGET_UNFIT,
            format!("spec.targetNode {source} is the node the VM is on"),
        );
    }
    Step::Start { source }
}

/// The VM holds this migration's move.
fn moving(vm: &ImpVM, mv: &VmMove, now: Timestamp) -> Step {
    let committed = vm.spec.node_name.as_deref() == Some(mv.target.as_str());
    match mv.phase {
        MovePhase::Sent if !committed => Step::Commit {
            target: mv.target.clone(),
        },
        MovePhase::Sent => Step::MarkCommitted,
        MovePhase::Committed => {
            if arrived(vm, &mv.target) {
                Step::Succeed
            } else {
                Step::Wait
            }
        }
        MovePhase::SendFailed => Step::Abort {
            reason: reason::SEND_FAILED,
            message: format!(
                "the source's agent could not send the VM to {}: {}",
                mv.target,
                mv.failure.as_deref().unwrap_or("no reason given")
            ),
        },
        MovePhase::Aborting => {
            if back_at_source(vm, mv) {
                Step::ClearAborted
            } else {
                Step::Wait
            }
        }
        MovePhase::Transferring => {
            let late = mv
                .started_at
                .as_ref()
                .is_some_and(|t| now.duration_since(t.0) > DEADLINE);
            if vm.metadata.deletion_timestamp.is_some() {
                Step::Abort {
                    reason: reason::VM_GONE,
                    message: "the VM is being deleted".into(),
                }
            } else if late {
                Step::Abort {
                    reason: reason::TIMED_OUT,
                    message: format!(
                        "the VM did not reach {} within {} minutes",
                        mv.target,
                        DEADLINE.as_mins()
                    ),
                }
            } else {
                Step::Wait
            }
        }
    }
}

/// Whether the VM is as it should be on `target`, as `target`'s agent reports it (only that
/// agent writes `status.nodeName: <target>`): running, or suspended when its user wants it so
/// (`desiredState` Suspended or ScaleToZero: it moved as it was). The target takes the VM in
/// suspended before it resumes it, so `Suspended` there is not yet arrived for a VM meant to run.
fn arrived(vm: &ImpVM, target: &str) -> bool {
    let status = vm.status.as_ref();
    if status.and_then(|s| s.node_name.as_deref()) != Some(target) {
        return false;
    }
    match status.and_then(|s| s.phase) {
        Some(VmPhase::Running) => true,
        Some(VmPhase::Suspended) => {
            vm.spec.desired_state != imp_api::shared::VmDesiredState::Running
        }
        _ => false,
    }
}

/// The aborted VM is back as it was on its source: running (or suspended, if its user had
/// it so) with the source's agent reporting it.
fn back_at_source(vm: &ImpVM, mv: &VmMove) -> bool {
    let status = vm.status.as_ref();
    let wants_suspended = vm.spec.desired_state != imp_api::shared::VmDesiredState::Running;
    let phase = status.and_then(|s| s.phase);
    let on_source = vm.spec.node_name.as_deref() == Some(mv.source.as_str());
    on_source
        && (phase == Some(VmPhase::Running)
            || (wants_suspended && phase == Some(VmPhase::Suspended))
            || phase.is_some_and(VmPhase::is_terminal))
}

/// The migration's status says it started, and the VM holds no move of it: the move was
/// cleared (by this controller, whose status write did not follow) or never written.
fn after_move(m: &ImpVMMigration, vm: &ImpVM) -> Step {
    let selected = m.status.as_ref().and_then(|s| s.selected_node.as_deref());
    match selected {
        Some(t) if vm.status.as_ref().and_then(|s| s.node_name.as_deref()) == Some(t) => {
            Step::Succeed
        }
        _ => fail(
            reason::NOT_MOVABLE,
            "the VM holds no move of this migration (it was cleared); the VM stays where it is"
                .into(),
        ),
    }
}

/// A new move of `vm` from `source` to `target` for migration `m`, at `now`, with `token`.
pub fn new_move(
    m: &ImpVMMigration,
    source: &str,
    target: &str,
    token: String,
    now: Timestamp,
) -> VmMove {
    VmMove {
        migration: m.name_any(),
        migration_uid: m.uid().unwrap_or_default(),
        source: source.to_owned(),
        target: target.to_owned(),
        mode: MODE_COLD.to_owned(),
        phase: MovePhase::Transferring,
        token,
        started_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now)),
        target_endpoint: None,
        target_cert_sha256: None,
        source_cert_sha256: None,
        bytes_sent: None,
        paused_unix_ms: None,
        failure: None,
    }
}

/// The downtime of a move that ended at `now`: from the source pausing the VM.
pub fn downtime_ms(mv: &VmMove, now: Timestamp) -> Option<i64> {
    let paused = mv.paused_unix_ms?;
    Some(now.as_millisecond() - paused)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::snapshot::{ImpVMMigrationSpec, ImpVMMigrationStatus};
    use imp_api::vm::{ImpVMSpec, ImpVMStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn mig(phase: Option<MigrationPhase>, target: Option<&str>) -> ImpVMMigration {
        let mut m = ImpVMMigration::new(
            "mv",
            ImpVMMigrationSpec {
                source_vm_name: "web".into(),
                source_vm_namespace: String::new(),
                target_node: target.map(str::to_owned),
            },
        );
        m.metadata.namespace = Some("ci".into());
        m.metadata.uid = Some("mig-uid".into());
        m.status = phase.map(|p| ImpVMMigrationStatus {
            phase: Some(p),
            selected_node: Some("b".into()),
            ..Default::default()
        });
        m
    }

    fn vm(node: Option<&str>, status_node: Option<&str>, phase: VmPhase) -> ImpVM {
        let mut v = ImpVM::new(
            "web",
            ImpVMSpec {
                node_name: node.map(str::to_owned),
                ..Default::default()
            },
        );
        v.metadata.namespace = Some("ci".into());
        v.status = Some(ImpVMStatus {
            phase: Some(phase),
            node_name: status_node.map(str::to_owned),
            ..Default::default()
        });
        v
    }

    fn with_move(mut v: ImpVM, phase: MovePhase, started: Timestamp) -> ImpVM {
        let m = mig(None, None);
        let mut mv = new_move(&m, "a", "b", "t".into(), started);
        mv.phase = phase;
        v.status.as_mut().unwrap().moving = Some(mv);
        v
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_800_000_000).unwrap()
    }

    #[test]
    fn a_running_or_suspended_placed_vm_starts_moving_and_others_are_refused_saying_why() {
        let m = mig(None, None);
        let running = vm(Some("a"), Some("a"), VmPhase::Running);
        assert_eq!(
            next(&m, Some(&running), now()),
            Step::Start { source: "a".into() }
        );
        let suspended = vm(Some("a"), Some("a"), VmPhase::Suspended);
        assert_eq!(
            next(&m, Some(&suspended), now()),
            Step::Start { source: "a".into() }
        );
        let cases = [
            (None, vm(None, None, VmPhase::Pending), "not placed"),
            (
                None,
                vm(Some("a"), Some("a"), VmPhase::Starting),
                "only a Running or Suspended VM moves",
            ),
            (Some("a"), running.clone(), "is the node the VM is on"),
        ];
        for (target, v, want) in cases {
            match next(&mig(None, target), Some(&v), now()) {
                Step::Fail { message, .. } => assert!(message.contains(want), "{message}"),
                other => panic!("{want}: {other:?}"),
            }
        }
        // spec.sourceVMName names no VM of the namespace.
        match next(&m, None, now()) {
            Step::Fail { reason, message } => {
                assert_eq!(reason, reason::NO_VM);
                let want = format!("no ImpVM {} in namespace ci", m.spec.source_vm_name);
                assert!(message.contains(&want), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // The target asked for is the VM's own node.
        let mut own = mig(None, None);
        own.spec.target_node = Some("a".into());
        assert!(matches!(
            next(&own, Some(&running), now()),
            Step::Fail {
                reason: reason::TARGET_UNFIT,
                ..
            }
        ));
        let mut other_ns = mig(None, None);
        other_ns.spec.source_vm_namespace = "prod".into();
        assert!(matches!(
            next(&other_ns, Some(&running), now()),
            Step::Fail {
                reason: reason::INVALID,
                ..
            }
        ));
    }

    #[test]
    fn one_move_at_a_time() {
        let mut other = mig(None, None);
        other.metadata.uid = Some("other".into());
        other.metadata.name = Some("second".into());
        let v = with_move(
            vm(Some("a"), Some("a"), VmPhase::Suspended),
            MovePhase::Transferring,
            now(),
        );
        match next(&other, Some(&v), now()) {
            Step::Fail { reason, message } => {
                assert_eq!(reason, reason::BUSY);
                assert!(message.contains("by migration mv"), "{message}");
            }
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn the_commit_comes_only_after_the_target_holds_the_files_then_success_once_it_runs_there() {
        let m = mig(Some(MigrationPhase::Transferring), None);
        let base = vm(Some("a"), Some("a"), VmPhase::Suspended);
        let transferring = with_move(base.clone(), MovePhase::Transferring, now());
        assert_eq!(next(&m, Some(&transferring), now()), Step::Wait);
        let sent = with_move(base.clone(), MovePhase::Sent, now());
        assert_eq!(
            next(&m, Some(&sent), now()),
            Step::Commit { target: "b".into() }
        );
        // The nodeName write landed, its status write not yet.
        let mut written = sent.clone();
        written.spec.node_name = Some("b".into());
        assert_eq!(next(&m, Some(&written), now()), Step::MarkCommitted);
        // Committed; the target has not resumed it yet (the source's report stands).
        let mut committed = with_move(base, MovePhase::Committed, now());
        committed.spec.node_name = Some("b".into());
        assert_eq!(next(&m, Some(&committed), now()), Step::Wait);
        let st = committed.status.as_mut().unwrap();
        st.node_name = Some("b".into());
        // Taken in on the target, not yet resumed: not there yet for a VM meant to run.
        assert_eq!(next(&m, Some(&committed), now()), Step::Wait);
        committed.status.as_mut().unwrap().phase = Some(VmPhase::Resuming);
        assert_eq!(next(&m, Some(&committed), now()), Step::Wait);
        // A VM its user keeps suspended has arrived once the target holds it suspended.
        let mut kept = committed.clone();
        kept.spec.desired_state = imp_api::shared::VmDesiredState::Suspended;
        kept.status.as_mut().unwrap().phase = Some(VmPhase::Suspended);
        assert_eq!(next(&m, Some(&kept), now()), Step::Succeed);
        committed.status.as_mut().unwrap().phase = Some(VmPhase::Running);
        assert_eq!(next(&m, Some(&committed), now()), Step::Succeed);
        // The move cleared but the migration's status write lost: success still.
        let mut cleared = committed.clone();
        cleared.status.as_mut().unwrap().moving = None;
        assert_eq!(next(&m, Some(&cleared), now()), Step::Succeed);
    }

    #[test]
    fn a_failed_send_a_late_move_or_a_deleted_vm_aborts_and_the_abort_ends_once_it_runs_at_home() {
        let m = mig(Some(MigrationPhase::Transferring), None);
        let base = vm(Some("a"), Some("a"), VmPhase::Suspended);
        let failed = {
            let mut v = with_move(base.clone(), MovePhase::SendFailed, now());
            v.status.as_mut().unwrap().moving.as_mut().unwrap().failure =
                Some("connection refused".into());
            v
        };
        match next(&m, Some(&failed), now()) {
            Step::Abort { reason, message } => {
                assert_eq!(reason, reason::SEND_FAILED);
                assert!(message.contains("connection refused"), "{message}");
            }
            s => panic!("{s:?}"),
        }
        let early = now() - SignedDuration::from_mins(11);
        let late = with_move(base.clone(), MovePhase::Transferring, early);
        assert!(matches!(
            next(&m, Some(&late), now()),
            Step::Abort {
                reason: reason::TIMED_OUT,
                ..
            }
        ));
        let mut deleting = with_move(base.clone(), MovePhase::Transferring, now());
        deleting.metadata.deletion_timestamp = Some(Time(now()));
        assert!(matches!(
            next(&m, Some(&deleting), now()),
            Step::Abort {
                reason: reason::VM_GONE,
                ..
            }
        ));
        let aborting = with_move(base, MovePhase::Aborting, now());
        assert_eq!(next(&m, Some(&aborting), now()), Step::Wait);
        let mut home = aborting.clone();
        home.status.as_mut().unwrap().phase = Some(VmPhase::Running);
        assert_eq!(next(&m, Some(&home), now()), Step::ClearAborted);
    }

    #[test]
    fn a_vm_deleted_mid_move_fails_the_migration_and_a_finished_one_waits() {
        let m = mig(Some(MigrationPhase::Transferring), None);
        assert!(matches!(
            next(&m, None, now()),
            Step::Fail {
                reason: reason::VM_GONE,
                ..
            }
        ));
        let done = mig(Some(MigrationPhase::Succeeded), None);
        assert_eq!(next(&done, None, now()), Step::Wait);
    }

    #[test]
    fn downtime_runs_from_the_pause() {
        let m = mig(None, None);
        let mut mv = new_move(&m, "a", "b", "t".into(), now());
        assert_eq!(downtime_ms(&mv, now()), None);
        mv.paused_unix_ms = Some((now() - SignedDuration::from_millis(1500)).as_millisecond());
        assert_eq!(downtime_ms(&mv, now()), Some(1500));
    }
}
