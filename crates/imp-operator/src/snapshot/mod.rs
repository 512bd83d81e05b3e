//! The ImpVMSnapshot controller (operator side): schedules, retention and base election.
//!
//! One kind plays two roles. A **parent** (no `imp.dev/snapshot-parent` label) holds the
//! configuration and, optionally, a `schedule`; its **executions** are ImpVMSnapshots labelled
//! `imp.dev/snapshot-parent=<parent>`, controlled by the parent (an owner reference, so deleting
//! the parent deletes them), with the parent's spec minus the schedule. The node agent takes the
//! snapshot an execution asks for and writes the execution's status (`phase`, `terminatedAt`,
//! where the files went); this controller never reads a VM and never touches an execution's
//! status. A missing source VM is the agent's to report, on the execution.
//!
//! One reconcile of a parent lists its executions from the API (a consistent read, not a cache,
//! so an execution created a moment ago is never missed and never made twice), asks the pure
//! [`decide::plan`] what to do (sparing, when it would prune, the executions a VM of the namespace
//! restores from: [`decide::spare`]), and does it: delete the executions beyond retention, create the
//! due execution, write the parent's status (a merge patch of what changed, preconditioned on
//! the resourceVersion it was decided on), then publish Events (`ExecutionCreated`, `Pruned`,
//! `InvalidSchedule`, `BaseElected`). It requeues at the schedule's next tick ([`cron`], UTC);
//! an execution's status changes trigger its parent through a watch of executions, and a VM being
//! deleted that names an execution triggers its namespace's parents.
//!
//! A snapshot acts only on a VM of its own namespace, with or without the admission webhook: a
//! parent whose `spec.sourceVMNamespace` names another makes no execution (`Scheduled` and
//! `Ready` False with reason `InvalidSpec` naming the field, and a Warning Event
//! `InvalidSpec`), and an unfinished execution that names one is failed the same way before
//! any VM is read (the node agent refuses it too).
//!
//! Differences from the Go project: the schedule really fires (Go created an execution only when
//! the next tick was under 5 s away, which its requeue after the tick never saw); it is UTC, not
//! the operator's local time; a one-shot parent makes one execution ever (Go made a new one when
//! the last was deleted); retention never deletes a newer execution to make room for the base
//! one, and counts only finished executions; the parent's `phase`, `Ready` and `Scheduled`
//! conditions tell how it is doing (Go left it `Pending` and wrote no condition).

pub mod cron;
pub mod decide;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::conditions::ConditionReason;
use imp_api::shared::LABEL_SNAPSHOT_PARENT;
use imp_api::snapshot::{ImpVMSnapshot, ImpVMSnapshotStatus};
use imp_api::vm::ImpVM;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;

use self::decide::{Note, Plan};
use crate::FIELD_MANAGER;
use crate::api_call::params;
use crate::metrics::{Metrics, Write};
use crate::names;
use imp_api::shared::ANNOTATION_SNAPSHOT_NODE as SNAPSHOT_NODE;

/// The resource label of this controller's writes in `imp_operator_conflicts_total`.
const CONFLICT_RESOURCE: &str = "impvmsnapshot";

/// A parent is looked at again at least this often (a safety net: watches and the schedule's
/// requeue do the real work).
const RESYNC: Duration = Duration::from_secs(300);

/// Requeue after a failed reconcile.
const RETRY: Duration = Duration::from_secs(5);

/// Requeue after a write refused with 409 (the watch event of the newer version usually comes
/// first).
const CONFLICT_RETRY: Duration = Duration::from_millis(200);

/// How late after a tick the requeue lands, so that the clock has surely passed it.
const TICK_MARGIN: Duration = Duration::from_millis(20);

/// What can go wrong in one reconcile: an API call.
pub type Error = crate::api_call::Error;

fn kube_err(doing: &'static str, what: String) -> impl FnOnce(kube::Error) -> Error {
    crate::api_call::failed(doing, "ImpVMSnapshot", what)
}

fn key(s: &ImpVMSnapshot) -> String {
    format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any())
}

struct Ctx {
    client: kube::Client,
    recorder: Recorder,
    metrics: Option<Arc<Metrics>>,
}

impl Ctx {
    async fn event(&self, parent: &ImpVMSnapshot, note: &Note) {
        let ev = crate::api_call::event::<ImpVMSnapshot>(
            note.warning,
            note.reason,
            &note.message,
            note.execution.as_deref(),
            parent.namespace(),
        );
        crate::api_call::publish(&self.recorder, &ev, &parent.object_ref(&())).await;
    }

    fn conflict(&self, write: Write) {
        if let Some(m) = &self.metrics {
            m.conflict(CONFLICT_RESOURCE, write);
        }
    }

    /// Fails execution `exec`, not yet taken by a node agent, whose source VM is gone or can
    /// no longer be snapshotted (no agent would ever take it, and it would hold back the next),
    /// and any unfinished execution that names a VM of another namespace (`InvalidSpec`; the
    /// node annotation does not spare it, since whoever may create an execution may write it).
    async fn fail_if_untakeable(&self, exec: &ImpVMSnapshot) -> Result<(), Error> {
        let status = exec.status.clone().unwrap_or_default();
        if status.terminated_at.is_some() {
            return Ok(());
        }
        if let Some(why) = decide::foreign_source(exec) {
            return self
                .fail(exec, status, ConditionReason::InvalidSpec, why)
                .await;
        }
        if exec.annotations().contains_key(SNAPSHOT_NODE) {
            return Ok(());
        }
        // Its own namespace's VM: foreign_source refused any other.
        let ns = exec.namespace().unwrap_or_default();
        let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), &ns);
        let vm = vms
            .get_opt(&exec.spec.source_vm_name)
            .await
            .map_err(kube_err("reading the source VM of", key(exec)))?;
        let Some(why) = decide::source_problem(exec, vm.as_ref()) else {
            return Ok(());
        };
        self.fail(exec, status, ConditionReason::SnapshotFailed, why)
            .await
    }

    /// Writes execution `exec`'s end as Failed for `why` (Ready=False with `reason`, which also
    /// names the Warning Event).
    async fn fail(
        &self,
        exec: &ImpVMSnapshot,
        mut status: ImpVMSnapshotStatus,
        reason: ConditionReason,
        why: String,
    ) -> Result<(), Error> {
        decide::fail_execution(&mut status, reason, &why, Timestamp::now());
        let body = json!({
            "metadata": {"resourceVersion": exec.resource_version()},
            "status": status,
        });
        let api: Api<ImpVMSnapshot> =
            Api::namespaced(self.client.clone(), &exec.namespace().unwrap_or_default());
        match api
            .patch_status(&exec.name_any(), &params(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => return Ok(()),
            Err(e) => return Err(kube_err("failing", key(exec))(e)),
        }
        tracing::warn!(snapshot = %key(exec), reason = reason.as_str(), why, "execution cannot be taken");
        let reason = match reason {
            ConditionReason::InvalidSpec => decide::reason::INVALID_SPEC,
            _ => "SnapshotFailed",
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(why),
            action: "Snapshot".to_owned(),
            secondary: None,
        };
        crate::api_call::publish(&self.recorder, &ev, &exec.object_ref(&())).await;
        Ok(())
    }

    /// Applies `plan`; `Ok(false)` when a write was refused with 409 (decide again).
    async fn apply(&self, parent: &ImpVMSnapshot, plan: &Plan) -> Result<bool, Error> {
        let ns = parent.namespace().unwrap_or_default();
        let api: Api<ImpVMSnapshot> = Api::namespaced(self.client.clone(), &ns);
        for prune in &plan.prune {
            match api.delete(&prune.name, &DeleteParams::default()).await {
                Ok(_) => {
                    tracing::info!(snapshot = %key(parent), execution = %prune.name, "pruned an execution beyond retention");
                    self.event(parent, &prune.note).await;
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    return Err(kube_err(
                        "deleting an execution beyond retention of",
                        format!("{ns}/{}", prune.name),
                    )(e));
                }
            }
        }
        if let Some(exec) = &plan.create {
            let pp = PostParams {
                field_manager: Some(FIELD_MANAGER.to_owned()),
                ..Default::default()
            };
            match api.create(&pp, &exec.object).await {
                Ok(_) => {
                    tracing::info!(snapshot = %key(parent), execution = %exec.object.name_any(), "created an execution");
                    self.event(parent, &exec.note).await;
                }
                // Made a moment ago under the same name (same second): the next list shows it.
                Err(kube::Error::Api(s)) if s.code == 409 => return Ok(false),
                Err(e) => {
                    return Err(kube_err("creating an execution of", key(parent))(e));
                }
            }
        }
        let old = parent.status.clone().unwrap_or_default();
        if let Some(diff) = imp_api::status_patch::diff(&old, &plan.status) {
            let body = json!({
                "metadata": {"resourceVersion": parent.resource_version()},
                "status": diff,
            });
            match api
                .patch_status(&parent.name_any(), &params(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    self.conflict(Write::Status);
                    return Ok(false);
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(true),
                Err(e) => return Err(kube_err("writing the status of", key(parent))(e)),
            }
        }
        for note in &plan.notes {
            if note.warning {
                tracing::warn!(snapshot = %key(parent), reason = note.reason, message = %note.message, "snapshot parent");
            } else {
                tracing::info!(snapshot = %key(parent), reason = note.reason, message = %note.message, "snapshot parent");
            }
            self.event(parent, note).await;
        }
        Ok(true)
    }
}

/// The requeue for a plan decided at `now`.
fn requeue(plan: &Plan, now: Timestamp) -> Action {
    let wait = plan
        .requeue_at
        .and_then(|at| Duration::try_from(at.duration_since(now)).ok())
        .map_or(RESYNC, |d| (d + TICK_MARGIN).min(RESYNC));
    Action::requeue(wait)
}

async fn reconcile(cached: Arc<ImpVMSnapshot>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if let Some(m) = &ctx.metrics {
        m.reconcile(names::SNAPSHOT_CONTROLLER);
    }
    // Executions are the agent's; a parent being deleted takes its executions with it.
    if cached.labels().contains_key(LABEL_SNAPSHOT_PARENT)
        || cached.meta().deletion_timestamp.is_some()
    {
        return Ok(Action::await_change());
    }
    let ns = cached.namespace().unwrap_or_default();
    let name = cached.name_any();
    let api: Api<ImpVMSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let mut parent = (*cached).clone();
    for _ in 0..3 {
        // A name too long to be a label value cannot select executions either (and has none).
        let children = if name.len() <= 63 {
            api.list(&ListParams::default().labels(&format!("{LABEL_SNAPSHOT_PARENT}={name}")))
                .await
                .map_err(kube_err("listing the executions of", key(&parent)))?
                .items
        } else {
            Vec::new()
        };
        for child in &children {
            ctx.fail_if_untakeable(child).await?;
        }
        let now = Timestamp::now();
        let mut plan = decide::plan(&parent, &children, now);
        if !plan.prune.is_empty() {
            let vms: Api<ImpVM> = Api::namespaced(ctx.client.clone(), &ns);
            let live = vms.list(&ListParams::default()).await.map_err(kube_err(
                "listing the VMs that may restore from",
                key(&parent),
            ))?;
            decide::spare(&mut plan, &decide::restored_from(&live.items));
        }
        if ctx.apply(&parent, &plan).await? {
            return Ok(requeue(&plan, now));
        }
        tokio::time::sleep(CONFLICT_RETRY).await;
        match api
            .get_opt(&name)
            .await
            .map_err(kube_err("re-reading", key(&parent)))?
        {
            Some(p) => parent = p,
            None => return Ok(Action::await_change()),
        }
    }
    Ok(Action::requeue(CONFLICT_RETRY))
}

fn error_policy(parent: Arc<ImpVMSnapshot>, err: &Error, ctx: Arc<Ctx>) -> Action {
    tracing::warn!(snapshot = %key(&parent), error = %crate::chain::DisplayChain(err), "snapshot reconcile failed");
    if let Some(m) = &ctx.metrics {
        m.reconcile_error(names::SNAPSHOT_CONTROLLER, err.metric_label());
    }
    Action::requeue(RETRY)
}

/// Runs the ImpVMSnapshot controller until `shutdown` completes: parents are reconciled, and
/// a change to an execution reconciles its parent.
pub async fn run(
    client: kube::Client,
    metrics: Option<Arc<Metrics>>,
    instance: Option<String>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let api = Api::<ImpVMSnapshot>::all(client.clone());
    let parents = watcher::Config::default().labels(&format!("!{LABEL_SNAPSHOT_PARENT}"));
    let executions = watcher::Config::default().labels(LABEL_SNAPSHOT_PARENT);
    let vm_client = client.clone();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        recorder: Recorder::new(
            client,
            Reporter {
                controller: FIELD_MANAGER.to_owned(),
                instance,
            },
        ),
        metrics,
    });
    // By label rather than owner reference: executions made by hand or by the Go operator
    // without one still lead to their parent.
    let to_parent = |e: ImpVMSnapshot| {
        let ns = e.namespace().unwrap_or_default();
        e.labels()
            .get(LABEL_SNAPSHOT_PARENT)
            .map(|p| ObjectRef::new(p).within(&ns))
    };
    let controller = Controller::new(api.clone(), parents);
    let store = controller.store();
    // A VM going away may free an execution retention kept for it: its namespace's parents
    // look again. Its deletion is told apart from its changes by the watch's own events.
    let (freed_tx, freed_rx) = tokio::sync::mpsc::channel(64);
    let freeing = tokio::spawn(tell_freed(Api::<ImpVM>::all(vm_client), store, freed_tx));
    let freed = futures::stream::unfold(freed_rx, |mut rx| async move {
        rx.recv().await.map(|r| (r, rx))
    });
    controller
        .watches(api, executions, to_parent)
        .reconcile_on(freed)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "snapshot controller event");
            }
        })
        .await;
    freeing.abort();
}

/// Sends the parents of a VM's namespace (from `parents`) to `tx` whenever a VM that names a
/// snapshot execution is deleted or starts being deleted, until the receiver goes.
async fn tell_freed(
    vms: Api<ImpVM>,
    parents: kube::runtime::reflector::Store<ImpVMSnapshot>,
    tx: tokio::sync::mpsc::Sender<ObjectRef<ImpVMSnapshot>>,
) {
    let mut events = Box::pin(watcher(vms, watcher::Config::default()).default_backoff());
    while let Some(event) = events.next().await {
        let gone = match event {
            Ok(watcher::Event::Delete(vm)) => vm,
            Ok(watcher::Event::Apply(vm)) if vm.meta().deletion_timestamp.is_some() => vm,
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "watching VMs for the executions they free");
                continue;
            }
        };
        if decide::snapshots_of(&gone).is_empty() {
            continue;
        }
        let ns = gone.namespace();
        let refs: Vec<_> = parents
            .state()
            .iter()
            .filter(|p| p.namespace() == ns)
            .map(|p| ObjectRef::from_obj(p.as_ref()))
            .collect();
        for r in refs {
            if tx.send(r).await.is_err() {
                return;
            }
        }
    }
}
