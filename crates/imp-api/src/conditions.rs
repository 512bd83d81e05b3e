//! Condition types, reasons and the helpers that keep `status.conditions` honest: one entry
//! per type, and `lastTransitionTime` moves only when the status does.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::{Deserialize, Serialize};

macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vm])* $variant),+
        }

        impl $name {
            /// The string written to the API.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => stringify!($variant)),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $(stringify!($variant) => Ok(Self::$variant),)+
                    _ => Err(UnknownValue(s.to_owned())),
                }
            }
        }
    };
}

/// A condition string that is not one imp knows.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown value {0:?}")]
pub struct UnknownValue(pub String);

string_enum! {
    /// The condition types imp writes.
    ConditionType {
        /// The VM has (or lacks) a node.
        Scheduled,
        /// The VM (or network) is ready for use.
        Ready,
        /// The VM's node exists and is Ready.
        NodeHealthy,
        /// The startup probe has passed.
        Started,
        /// The liveness probe passes.
        Healthy,
        /// (Operator) the VM is to leave its node for a `NoExecute` taint, as Kubernetes marks
        /// a Pod its taint manager evicts: `False` with reason `TaintTolerated` while the VM
        /// tolerates the taint for its `tolerationSeconds` (the message says until when; the
        /// condition's `lastTransitionTime` is when the operator first saw the taint), `True`
        /// with reason `Evicted` once it is evicted (the node's agent then stops and removes it
        /// and releases it, and the operator places it anew or applies its restart policy).
        DisruptionTarget,
    }
}

string_enum! {
    /// The reasons imp writes, one word each as Kubernetes convention wants.
    ConditionReason {
        /// A node was chosen.
        NodeAssigned,
        /// No node can take the VM now; the message says why per node.
        NoNodeAvailable,
        /// (Operator) the namespace's ResourceQuota refused the VM's reservation Pod (the
        /// Pod that holds its vCPU and memory where Kubernetes sees them); the message quotes
        /// the quota.
        QuotaExceeded,
        /// The spec refers to something missing or contradicts itself; the message names the fix.
        InvalidSpec,
        /// The node is Ready.
        NodeReady,
        /// The node is gone or not Ready.
        NodeNotReady,
        /// (Operator) evicted from its node by a `NoExecute` taint it does not tolerate (or no
        /// longer: its `tolerationSeconds` ran out); the message names the node and the taint.
        Evicted,
        /// (Operator) the VM's own `classRef` or `templateRef` changed while it ran: it leaves
        /// its node (whose agent stops and releases it) and is placed anew with the new spec.
        SpecChanged,
        /// (Operator) the VM's node has a `NoExecute` taint the VM tolerates for its
        /// `tolerationSeconds`; the message names the taint and when the VM is evicted.
        TaintTolerated,
        /// The VM runs.
        Running,
        /// The ephemeral workload finished successfully.
        Completed,
        /// The workload failed.
        Failed,
        /// The VM is on its way to running.
        Waiting,
        /// The VM's HTTP check (`probes.httpCheck`, made by its node's agent) fails.
        HealthCheckFailed,
        /// A guest probe passed.
        ProbeSucceeded,
        /// A guest probe failed.
        ProbeFailed,
        /// The object has been reconciled.
        Reconciled,
        /// The VM is suspended to a snapshot.
        Suspended,
        /// A suspend failed (e.g. too little disk for the snapshot); the VM runs on.
        SuspendFailed,
        /// The VM could not be restored from its suspend snapshot (missing or corrupt, or the
        /// guest did not answer after the restore); the message says why.
        ResumeFailed,
        /// The node lacks the free memory to resume the suspended VM; it stays Suspended and
        /// the agent tries again.
        InsufficientMemory,
        /// The node agent is pulling the image and booting the VM.
        Starting,
        /// The node cannot run VMs as configured (a missing VMM binary or kernel); the message
        /// names the path and the agent flag or variable that sets it.
        RuntimeStartFailed,
        /// The image could not be pulled or unpacked.
        ImagePullFailed,
        /// The VM's root filesystem or disk could not be built (e.g. the class's disk is too
        /// small for the image).
        DiskSetupFailed,
        /// The guest booted but its agent never answered within the boot timeout.
        GuestAgentTimeout,
        /// (Operator) the VM stayed `Starting` past the operator's start timeout: the operator
        /// cannot confirm that the node ran the start (its agent is down, stuck, or cannot
        /// write the VM's status); the message names the node and the timeout.
        AgentTimeout,
        /// The VMM ended without the workload's exit report.
        VmmExited,
        /// The node agent has no trace of a VM it had started (its state was lost), or the
        /// VM's supervisor died.
        VmLost,
        /// The VM's network could not be set up: its ImpNetwork is missing, not Ready, full, or
        /// the node could not wire it; the message names the network and the cause.
        NetworkSetupFailed,
        /// (ImpNetwork) the subnet overlaps another ImpNetwork's or the node's own network; the
        /// message names both.
        SubnetOverlap,
        /// (ImpNetwork) two networks derive the same VXLAN identifier; the message names both.
        VniConflict,
        /// (ImpVMSnapshot execution) the source VM's node agent is taking it.
        Snapshotting,
        /// (ImpVMSnapshot execution) taken and stored; the message says where and the pause.
        SnapshotSucceeded,
        /// (ImpVMSnapshot execution) could not be taken or stored; the message says why (the
        /// source VM runs on).
        SnapshotFailed,
        /// (ImpWarmPool) the parent snapshot has no `status.baseSnapshot` for members to
        /// restore from; the message says to set its `spec.baseSnapshot`.
        NoBase,
        /// (ImpWarmPool) members fail at restore or soon after, three or more in a row; new
        /// ones are made after a back-off, and the message quotes the last one's reason.
        MembersFailing,
        /// (Operator) a VM with `spec.warmPoolRef` took over a running member of its pool.
        Claimed,
        /// (ImpVMMigration) the VM is on its way to another node.
        Moving,
        /// (ImpVMMigration) the VM runs on its new node.
        Moved,
        /// (ImpVMMigration) the move failed or was given up; the VM runs where it was.
        MoveFailed,
    }
}

/// The three condition statuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConditionStatus {
    /// Holds.
    True,
    /// Does not hold.
    False,
    /// Not known yet.
    Unknown,
}

impl ConditionStatus {
    /// The string written to the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

impl From<bool> for ConditionStatus {
    fn from(b: bool) -> Self {
        if b { Self::True } else { Self::False }
    }
}

/// Finds the condition of `type_` in `conditions`.
pub fn find(conditions: &[Condition], type_: ConditionType) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == type_.as_str())
}

/// True when the condition of `type_` exists with status True.
pub fn is_true(conditions: &[Condition], type_: ConditionType) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

/// Removes the condition of `type_`; returns whether there was one.
pub fn remove(conditions: &mut Vec<Condition>, type_: ConditionType) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_.as_str());
    conditions.len() != before
}

/// Sets one condition, keeping a single entry per type; returns whether anything changed.
///
/// `lastTransitionTime` becomes `now` only when the status changes (or the condition is new),
/// so a reason or message update does not look like a transition.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    status: ConditionStatus,
    reason: ConditionReason,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Time,
) -> bool {
    let message = message.into();
    match conditions.iter_mut().find(|c| c.type_ == type_.as_str()) {
        Some(c) => {
            let changed_status = c.status != status.as_str();
            let changed = changed_status
                || c.reason != reason.as_str()
                || c.message != message
                || c.observed_generation != observed_generation;
            if changed_status {
                c.last_transition_time = now;
            }
            c.status = status.as_str().to_owned();
            c.reason = reason.as_str().to_owned();
            c.message = message;
            c.observed_generation = observed_generation;
            changed
        }
        None => {
            conditions.push(Condition {
                type_: type_.as_str().to_owned(),
                status: status.as_str().to_owned(),
                reason: reason.as_str().to_owned(),
                message,
                observed_generation,
                last_transition_time: now,
            });
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn t(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn strings_match_the_go_project() {
        assert_eq!(ConditionType::NodeHealthy.as_str(), "NodeHealthy");
        assert_eq!(
            ConditionReason::NoNodeAvailable.to_string(),
            "NoNodeAvailable"
        );
        assert_eq!(
            "Scheduled".parse::<ConditionType>(),
            Ok(ConditionType::Scheduled)
        );
        assert!("Bogus".parse::<ConditionReason>().is_err());
        assert_eq!(
            serde_json::to_string(&ConditionReason::InvalidSpec).unwrap(),
            "\"InvalidSpec\""
        );
    }

    #[test]
    fn transition_time_moves_only_with_status() {
        let mut c = Vec::new();
        assert!(set(
            &mut c,
            ConditionType::Ready,
            ConditionStatus::Unknown,
            ConditionReason::Waiting,
            "",
            Some(1),
            t(10)
        ));
        assert!(set(
            &mut c,
            ConditionType::Ready,
            ConditionStatus::Unknown,
            ConditionReason::Waiting,
            "booting",
            Some(1),
            t(20)
        ));
        assert_eq!(c[0].last_transition_time, t(10));
        assert!(!set(
            &mut c,
            ConditionType::Ready,
            ConditionStatus::Unknown,
            ConditionReason::Waiting,
            "booting",
            Some(1),
            t(25)
        ));
        assert!(set(
            &mut c,
            ConditionType::Ready,
            ConditionStatus::True,
            ConditionReason::Running,
            "up",
            Some(1),
            t(30)
        ));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].last_transition_time, t(30));
        assert!(is_true(&c, ConditionType::Ready));
        set(
            &mut c,
            ConditionType::Scheduled,
            true.into(),
            ConditionReason::NodeAssigned,
            "node-a",
            None,
            t(30),
        );
        assert_eq!(c.len(), 2);
        assert_eq!(
            find(&c, ConditionType::Scheduled).unwrap().reason,
            "NodeAssigned"
        );
    }

    #[test]
    fn remove_drops_only_that_type() {
        let mut c = Vec::new();
        for type_ in [ConditionType::Ready, ConditionType::DisruptionTarget] {
            set(
                &mut c,
                type_,
                ConditionStatus::False,
                ConditionReason::Waiting,
                "",
                None,
                t(1),
            );
        }
        assert!(remove(&mut c, ConditionType::DisruptionTarget));
        assert!(!remove(&mut c, ConditionType::DisruptionTarget));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].type_, "Ready");
    }
}
