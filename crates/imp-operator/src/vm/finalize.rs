//! Deletion: `Terminating` until the agent clears `spec.nodeName`, or a timeout; then the
//! finalizer goes.

use std::time::Duration;

use imp_api::conditions::{ConditionReason, ConditionType};
use imp_api::shared::FINALIZER_VM;
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use serde_json::json;

use super::apply::Outcome;
use super::conditions::{Note, set_cond};
use super::decide::{Next, Plan};
use super::{Context, Error, FINALIZER, Settings, key};

/// What a deleting VM needs.
#[derive(Debug, PartialEq)]
pub(super) enum Finalize {
    /// None of our finalizers is on it: nothing to do.
    NotOurs,
    /// Remove our finalizers now, after this Event if any.
    Release(Option<Note>),
    /// Keep waiting for the agent.
    Wait(Box<Plan>),
}

fn ours(f: &String) -> bool {
    f == FINALIZER || f == FINALIZER_VM
}

/// The decision for a VM being deleted `since` ago, whose node is gone or not.
pub(super) fn decide(
    vm: &ImpVM,
    node_gone: bool,
    since: Duration,
    settings: &Settings,
    now: Timestamp,
) -> Finalize {
    if !vm.finalizers().iter().any(ours) {
        return Finalize::NotOurs;
    }
    let Some(node) = vm.spec.node_name.as_deref() else {
        return Finalize::Release(None);
    };
    if since >= settings.termination_timeout || (node_gone && since >= settings.node_gone_grace) {
        let why = if node_gone {
            format!("node {node} is gone, so no agent can clean up; released after {since:?}")
        } else {
            format!(
                "the agent on node {node} did not clean up within {:?}; released",
                settings.termination_timeout
            )
        };
        return Finalize::Release(Some(Note::warning("TerminationTimeout", why)));
    }
    let mut status = vm.status.clone().unwrap_or_default();
    let was = status.phase == Some(VmPhase::Terminating);
    status.phase = Some(VmPhase::Terminating);
    if node_gone {
        set_cond(
            &mut status,
            ConditionType::NodeHealthy,
            false,
            ConditionReason::NodeNotReady,
            format!(
                "node {node} is gone: no agent can clean up; the finalizer is removed after {:?}",
                settings.node_gone_grace
            ),
            vm.metadata.generation,
            now,
        );
    }
    Finalize::Wait(Box::new(Plan {
        status: Some(status),
        doing: "marking Terminating",
        event: (!was).then(|| {
            Note::normal(
                "Terminating",
                format!("waiting for the agent on node {node} to clean up"),
            )
        }),
        next: Next::Requeue(Duration::from_secs(1).min(settings.requeue_active)),
        ..Plan::default()
    }))
}

impl Context {
    /// Applies [`decide`] to a VM being deleted, whose node is `node` (`None`: gone).
    pub(super) async fn finalize(
        &self,
        vm: ImpVM,
        node: Option<&k8s_openapi::api::core::v1::Node>,
    ) -> Result<Action, Error> {
        let now = Timestamp::now();
        let since = vm
            .metadata
            .deletion_timestamp
            .as_ref()
            .map(|t| Duration::try_from(now.duration_since(t.0)).unwrap_or_default())
            .unwrap_or_default();
        match decide(&vm, node.is_none(), since, &self.settings, now) {
            Finalize::NotOurs => Ok(Action::await_change()),
            Finalize::Release(note) => {
                if let Some(note) = note {
                    self.note(&vm, note).await;
                }
                self.release_addresses(&vm).await?;
                self.release_finalizer(&vm).await?;
                tracing::info!(vm = %key(&vm), "finalized");
                Ok(Action::await_change())
            }
            Finalize::Wait(plan) => match self.apply(vm, *plan).await? {
                Outcome::Done(action) => Ok(action),
                Outcome::Continue(_) => Ok(Action::requeue(self.settings.requeue_active)),
            },
        }
    }

    async fn release_finalizer(&self, vm: &ImpVM) -> Result<(), Error> {
        let fins: Vec<String> = vm
            .finalizers()
            .iter()
            .filter(|f| !ours(f))
            .cloned()
            .collect();
        match self
            .patch_main(
                vm,
                json!({"metadata": {"finalizers": fins}}),
                "removing the finalizer of",
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Kube {
                source: kube::Error::Api(s),
                ..
            }) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::vm::ImpVMSpec;

    fn deleting(node: Option<&str>, fins: &[&str]) -> ImpVM {
        let mut vm = ImpVM::new("v", ImpVMSpec::default());
        vm.spec.node_name = node.map(str::to_owned);
        vm.metadata.finalizers = Some(fins.iter().map(|f| (*f).to_owned()).collect());
        vm
    }

    #[test]
    fn finalize_waits_for_the_agent_then_times_out() {
        let s = Settings::default();
        let now = Timestamp::now();
        let d = decide(
            &deleting(Some("n"), &["other"]),
            false,
            Duration::ZERO,
            &s,
            now,
        );
        assert_eq!(d, Finalize::NotOurs);
        let d = decide(
            &deleting(None, &[FINALIZER]),
            false,
            Duration::ZERO,
            &s,
            now,
        );
        assert_eq!(d, Finalize::Release(None));
        let Finalize::Wait(p) = decide(
            &deleting(Some("n"), &[FINALIZER]),
            false,
            Duration::ZERO,
            &s,
            now,
        ) else {
            panic!("expected to wait");
        };
        assert_eq!(p.status.unwrap().phase, Some(VmPhase::Terminating));
        assert_eq!(p.event.unwrap().reason, "Terminating");
        let d = decide(
            &deleting(Some("n"), &[FINALIZER_VM]),
            false,
            s.termination_timeout,
            &s,
            now,
        );
        assert!(matches!(d, Finalize::Release(Some(n)) if n.reason == "TerminationTimeout"));
        let d = decide(
            &deleting(Some("n"), &[FINALIZER]),
            true,
            s.node_gone_grace,
            &s,
            now,
        );
        assert!(matches!(d, Finalize::Release(Some(n)) if n.message.contains("is gone")));
    }
}
