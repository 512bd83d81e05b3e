//! A warm pool's member waits for its claim with its vCPUs paused (docs/warm-pools.md, Q1: a
//! running member spent 7.8 % of a core doing nothing; a paused one keeps its memory and costs
//! no CPU, and the claim resumes it in a QMP round trip). Once the member runs and is `Ready`
//! (its probes passed), its shim is asked to pause it; its record then says `paused`, and the
//! agent runs no probe on it. A pool annotated `imp.dev/member-state: running` keeps its
//! members running. A shim that refuses (an earlier release's) is not asked again.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use imp_api::conditions::{self, ConditionType};
use imp_api::shared::{
    ANNOTATION_CLAIMED_BY, ANNOTATION_MEMBER_STATE, LABEL_WARM_POOL, MEMBER_STATE_RUNNING,
    VmDesiredState,
};
use imp_api::vm::{ImpVM, VmPhase};
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::{Context, key};
use crate::runtime::state::VmRecord;

/// How long a shim has to pause its VM.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `vm` is a warm pool's member waiting for a claim that is to wait paused: labelled
/// with its pool, not taken, meant to run, `Running` and `Ready`.
pub(super) fn wanted(vm: &ImpVM) -> bool {
    let Some(status) = vm.status.as_ref() else {
        return false;
    };
    vm.labels().contains_key(LABEL_WARM_POOL)
        && !vm.annotations().contains_key(ANNOTATION_CLAIMED_BY)
        && vm
            .annotations()
            .get(ANNOTATION_MEMBER_STATE)
            .map(String::as_str)
            != Some(MEMBER_STATE_RUNNING)
        && vm.spec.desired_state == VmDesiredState::Running
        && status.phase == Some(VmPhase::Running)
        && conditions::find(&status.conditions, ConditionType::Ready)
            .is_some_and(|c| c.status == "True")
}

/// The shims that refused a pause, by VM directory and shim pid: not asked again.
#[derive(Debug, Default)]
pub(super) struct Refused(Mutex<HashSet<String>>);

impl Refused {
    fn key(record: &VmRecord) -> String {
        format!("{}/{}", record.name, record.supervisor_pid)
    }

    /// Whether `record`'s shim refused a pause.
    pub(super) fn has(&self, record: &VmRecord) -> bool {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&Self::key(record))
    }

    fn add(&self, record: &VmRecord) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(Self::key(record));
    }
}

/// Asks the shim of member `vm`'s VM (`record`) to pause it; its record says so once done.
pub(super) async fn pause(ctx: &Context, vm: &ImpVM, record: Option<&VmRecord>) -> Action {
    let Some(record) = record else {
        return Action::requeue(Duration::from_secs(1));
    };
    let refused = match ctx.shims.pause(&record.name, PAUSE_TIMEOUT).await {
        Ok(true) => None,
        Ok(false) => Some("its shim has no API to ask".to_owned()),
        Err(e) => Some(imp_api::chain::chain(&e)),
    };
    match refused {
        None => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, "warm pool member paused until its claim")
        }
        Some(why) => {
            tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "a warm pool member could not be paused; it waits running");
            ctx.pause_refused.add(record);
        }
    }
    Action::requeue(Duration::from_secs(300))
}
