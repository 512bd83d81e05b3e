//! The names the operator's controllers report themselves by: the `controller` label of
//! `imp_operator_reconciles_total`, `imp_operator_reconcile_errors_total` and
//! `imp_operator_reconcile_backlog`. They live here rather than in each controller so that
//! [`crate::metrics`], which shows the ImpVM controller's backlog at 0 from the start, needs
//! no controller.

/// The ImpVM controller ([`crate::vm`]).
pub const VM_CONTROLLER: &str = "impvm";

/// The ImpNetwork controller ([`crate::network`]).
pub const NETWORK_CONTROLLER: &str = "impnetwork";

/// The ImpVMSnapshot controller ([`crate::snapshot`]).
pub const SNAPSHOT_CONTROLLER: &str = "impvmsnapshot";

/// The ImpWarmPool controller ([`crate::warmpool`]).
pub const WARMPOOL_CONTROLLER: &str = "impwarmpool";
