//! The one place a [`Plan`] is written, in its field order.

use imp_api::shared::ANNOTATION_RESET_RETRIES;
use imp_api::vm::ImpVM;
use kube::ResourceExt;
use kube::api::DeleteParams;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use serde_json::{Value, json};

use super::conditions::Note;
use super::decide::{Next, Plan};
use super::write::kube_err;
use super::{Context, Error};

/// What a written plan leaves: the VM to decide again on, or the end of the reconcile.
pub(super) enum Outcome {
    /// Decide again on this (written) VM.
    Continue(Box<ImpVM>),
    /// The reconcile is over.
    Done(Action),
}

impl Context {
    /// Writes `plan` for `vm`: metadata, `spec.nodeName`, status, Event, deletion, then the
    /// reset annotation. Each write carries the resourceVersion of the one before.
    ///
    /// A VM whose node is cleared loses its booking with it: it is booked anew where it is
    /// placed next.
    pub(super) async fn apply(&self, mut vm: ImpVM, mut plan: Plan) -> Result<Outcome, Error> {
        if plan.clear_node {
            let status = plan
                .status
                .get_or_insert_with(|| vm.status.clone().unwrap_or_default());
            status.booking = None;
        }
        if let Some(meta) = plan.metadata {
            vm = self
                .patch_main(&vm, json!({ "metadata": meta }), plan.doing)
                .await?;
        }
        if plan.clear_node {
            vm = self.set_node_name(&vm, None).await?;
        }
        if let Some(status) = &plan.status {
            vm = self.patch_status(&vm, status, plan.doing).await?;
        }
        if let Some(note) = plan.event {
            self.note(&vm, note).await;
        }
        if plan.delete {
            self.delete(&vm).await?;
        }
        if plan.drop_reset {
            let mut anns = serde_json::Map::new();
            anns.insert(ANNOTATION_RESET_RETRIES.to_owned(), Value::Null);
            vm = self
                .patch_main(
                    &vm,
                    json!({"metadata": {"annotations": anns}}),
                    "removing the reset annotation from",
                )
                .await?;
        }
        Ok(match plan.next {
            Next::Continue => Outcome::Continue(Box::new(vm)),
            Next::Requeue(d) => Outcome::Done(Action::requeue(d)),
            Next::AwaitChange => Outcome::Done(Action::await_change()),
        })
    }

    /// Publishes `note` as an Event about `vm`.
    pub(super) async fn note(&self, vm: &ImpVM, note: Note) {
        let type_ = if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let action = note.action.unwrap_or(note.reason);
        self.event_with(vm, type_, note.reason, action, note.message)
            .await;
    }

    async fn delete(&self, vm: &ImpVM) -> Result<(), Error> {
        match self
            .api(vm)
            .delete(&vm.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            // Already gone (deleted by someone else or by an earlier attempt): done.
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(kube_err("deleting the expired", vm)(e)),
        }
    }
}
