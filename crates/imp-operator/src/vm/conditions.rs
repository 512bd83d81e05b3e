//! The conditions a decision sets on a VM's status ([`set_cond`], [`has_cond`]) and the Event
//! it publishes about the VM ([`Note`]). [`super::decide`], [`super::place`], [`super::address`]
//! and [`super::finalize`] all use them; they live apart so that none of those rooms has to
//! import another for them.

use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::vm::ImpVMStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// An Event to publish about the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Note {
    /// Warning rather than Normal.
    pub warning: bool,
    /// The Event's reason.
    pub reason: &'static str,
    /// The Event's message.
    pub message: String,
    /// The Event's action, when it is not its reason. Events of one reason and action within
    /// a few minutes join one series that keeps its first message (as client-go's events
    /// recorder does), so happenings of one reason that say different things take actions
    /// of their own.
    pub action: Option<&'static str>,
}

impl Note {
    pub(super) fn normal(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warning: false,
            reason,
            message: message.into(),
            action: None,
        }
    }

    /// The same Note with its own `action`.
    pub(super) fn action(self, action: &'static str) -> Self {
        Self {
            action: Some(action),
            ..self
        }
    }

    pub(super) fn warning(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warning: true,
            reason,
            message: message.into(),
            action: None,
        }
    }
}

/// Sets a condition on `status` with the decision's time.
pub(super) fn set_cond(
    status: &mut ImpVMStatus,
    type_: ConditionType,
    ok: bool,
    reason: ConditionReason,
    message: impl Into<String>,
    generation: Option<i64>,
    now: Timestamp,
) {
    conditions::set(
        &mut status.conditions,
        type_,
        ConditionStatus::from(ok),
        reason,
        message,
        generation,
        Time(now),
    );
}

/// Whether `status` already carries condition `type_` with this reason and message.
pub(super) fn has_cond(
    status: &ImpVMStatus,
    type_: ConditionType,
    reason: ConditionReason,
    message: &str,
) -> bool {
    conditions::find(&status.conditions, type_)
        .is_some_and(|c| c.reason == reason.as_str() && c.message == message)
}
