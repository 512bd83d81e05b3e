//! The ImpVM controller: resolves, schedules and keeps every ImpVM's status honest.
//!
//! It watches ImpVMs and maps changes of Nodes, ImpVMClasses, ImpVMTemplates, ImpNetworks,
//! ClusterImpConfig and ClusterImpNodeProfiles to the VMs they affect. The decisions live in
//! [`crate::resolve`], [`crate::schedule`] and [`crate::lifecycle`]; this module reads the caches,
//! writes, and emits Events.
//!
//! # Writes
//! Every write is a JSON merge patch that carries the `metadata.resourceVersion` it was computed
//! from, so a write based on a stale read fails with 409 instead of clobbering someone else's.
//! On 409 the reconcile re-reads the VM from the API server and decides again, at most
//! [`CONFLICT_ATTEMPTS`] times with jittered backoff ([`crate::lifecycle::conflict_backoff`]).
//! Status is written to the status subresource only. Reconciles are idempotent: each step
//! checks whether its effect is already there.
//!
//! The finalizer is added in the same patch that writes `spec.nodeName` (an unplaced VM has
//! nothing for an agent to clean up), and a placed VM without it (pinned by a user) gets it
//! first thing.
//!
//! A reconcile handed a cached VM whose resourceVersion this process already wrote over (the
//! watch has not caught up with its own write yet) stops without a request: every write would be
//! refused with 409, and the watch event of the newer version reconciles the VM again.
//!
//! # No overbooking
//! The choice of a node and its booking happen under one scheduling lock, over the per-node usage
//! the [`Ledger`] keeps incrementally from the VM watch and this process's own `spec.nodeName`
//! writes (a booking holds until the watch shows the write, and is taken back if the write
//! fails); the write itself happens outside the lock. `spec.nodeName` is written before anything
//! else, in one patch with the finalizer and annotation [`ANNOTATION_PLACED_RESOURCES`] (the size
//! the node was booked for), then `status.nodeName` and phase `Scheduled`; so placement and the
//! size it booked are durable together: after an operator restart the ledger is rebuilt from the
//! VM list, which holds every placement made before the crash and, for VMs whose class has been
//! deleted since, the size to keep counting. A VM whose `spec.nodeName` is set but whose status
//! says otherwise (the operator died between the two writes, or a user pinned it) is completed to
//! `Scheduled` on that node.
//!
//! # Contract with the node agent
//! - The agent acts on VMs with `spec.nodeName` equal to its node and phase `Scheduled` (or later
//!   non-terminal phases); it writes phases `Starting` (with `status.startedAt`), `Running`,
//!   `Succeeded`/`Failed` (with `status.exitCode`), `Suspending`/`Suspended`/`Resuming`.
//! - When an **ephemeral** VM finishes, the agent sets `Succeeded`/`Failed` and may clear
//!   `spec.nodeName`; the operator never schedules a VM in a terminal phase again (only the
//!   `imp/reset-retries: "true"` annotation does).
//! - Deletion: the operator holds finalizer [`FINALIZER`]. While `metadata.deletionTimestamp` is
//!   set and `spec.nodeName` is non-empty, the phase is `Terminating` and the operator waits. The
//!   agent stops the VM, frees its node resources, then **clears `spec.nodeName`** (a merge patch
//!   `{"spec":{"nodeName":null}}`); that is the cleanup marker, and the operator then removes the
//!   finalizer. If the node object is gone, no agent can clean up: the operator sets
//!   `NodeHealthy=False/NodeNotReady` saying so and removes the finalizer after
//!   [`Settings::node_gone_grace`]. In any case it removes it after
//!   [`Settings::termination_timeout`] with a Warning Event `TerminationTimeout`.
//! - Restart in place: the operator moves a Failed VM back to `Scheduled` on the same node; the
//!   agent starts it again. Reschedule: the operator clears `spec.nodeName` and the VM is placed
//!   anew.
//! - Conditions: the operator owns `Scheduled` and `NodeHealthy`, and writes `Ready` only to say
//!   why a VM cannot get going (`InvalidSpec`, `NoNodeAvailable`, `NodeNotReady`, start timeout);
//!   the agent owns `Ready` from `Starting` on.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use imp_api::class::ImpVMClass;
use imp_api::cluster::{CLUSTER_CONFIG_NAME, ClusterImpConfig, ClusterImpNodeProfile};
use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::network::ImpNetwork;
use imp_api::shared::{
    ANNOTATION_PLACED_RESOURCES, ANNOTATION_RESET_RETRIES, FINALIZER_VM, PlacedSize, RestartMode,
    VmLifecycle,
};
use imp_api::template::ImpVMTemplate;
use imp_api::vm::{ImpVM, ImpVMSpec, ImpVMStatus, VmPhase};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use crate::ledger::{Booking, Ledger, SizeRef};
use crate::lifecycle::{self, RestartDecision, RestartState};
use crate::metrics::{Health, Metrics};
use crate::resolve::{self, MissingRef};
use crate::schedule::{self, NodeView, Policy, Request};

/// Finalizer the operator holds on every placed ImpVM until the agent has cleaned up.
pub const FINALIZER: &str = "imp.dev/vm-cleanup";

/// Field manager of every operator write.
pub const FIELD_MANAGER: &str = "imp-operator";

/// Attempts of one reconcile against 409 conflicts before it is requeued.
pub const CONFLICT_ATTEMPTS: u32 = 5;

/// Name the controller reports in Events and metrics.
pub const CONTROLLER_NAME: &str = "impvm";

/// Timings and switches of the controller.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Requeue of a VM waiting for a node or for a referenced object.
    pub requeue_pending: Duration,
    /// Requeue of a placed VM that is not Running yet (or is Terminating).
    pub requeue_active: Duration,
    /// Requeue of a Running VM (a safety net; watches do the real work).
    pub requeue_running: Duration,
    /// Requeue after a reconcile error.
    pub requeue_error: Duration,
    /// Finalizer removal without agent cleanup after this long.
    pub termination_timeout: Duration,
    /// Finalizer removal when the VM's node object no longer exists.
    pub node_gone_grace: Duration,
    /// How long a node may be NotReady (since its Ready condition's lastTransitionTime)
    /// before its VMs are moved or failed, so a short blip does not restart workloads.
    pub node_loss_grace: Duration,
    /// A VM `Starting` for longer fails.
    pub start_timeout: Duration,
    /// Count suspended VMs' memory as free (the Go overcommit rule).
    pub overcommit_suspended: bool,
    /// Reconciles running at once.
    pub concurrency: u16,
    /// Reporter instance in Events (the replica identity).
    pub instance: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            requeue_pending: Duration::from_secs(30),
            requeue_active: Duration::from_secs(10),
            requeue_running: Duration::from_secs(300),
            requeue_error: Duration::from_secs(5),
            termination_timeout: Duration::from_secs(120),
            node_gone_grace: Duration::from_secs(10),
            node_loss_grace: Duration::from_secs(40),
            start_timeout: Duration::from_secs(300),
            overcommit_suspended: true,
            concurrency: 8,
            instance: None,
        }
    }
}

/// What can go wrong in one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("Kubernetes API call failed while {doing} ImpVM {vm}")]
    Kube {
        /// What the controller was doing.
        doing: &'static str,
        /// namespace/name of the VM.
        vm: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The VM kept changing under us.
    #[error("ImpVM {0} kept changing: gave up after {CONFLICT_ATTEMPTS} conflicting writes")]
    Conflicts(String),
}

impl Error {
    /// Short label for the reconcile-error metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube { .. } => "api",
            Self::Conflicts(_) => "conflict",
        }
    }

    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube { source: kube::Error::Api(s), .. } if s.code == 409)
    }
}

/// Errors that stop the controller as a whole.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A cache could not be filled.
    #[error("Filling the {0} cache failed")]
    Cache(&'static str),
}

/// The caches and shared state every reconcile reads.
pub struct Context {
    client: kube::Client,
    nodes: Store<Node>,
    classes: Store<ImpVMClass>,
    templates: Store<ImpVMTemplate>,
    networks: Store<ImpNetwork>,
    configs: Store<ClusterImpConfig>,
    profiles: Store<ClusterImpNodeProfile>,
    recorder: Recorder,
    /// Per-node usage and this process's own writes; its lock is the scheduling lock.
    ledger: Arc<std::sync::Mutex<Ledger>>,
    settings: Settings,
    metrics: Option<Arc<Metrics>>,
}

fn key(vm: &ImpVM) -> String {
    format!("{}/{}", vm.namespace().unwrap_or_default(), vm.name_any())
}

/// vCPU and MiB of a VM's live class (its classRef, else its template's), without resolving the
/// rest of the spec.
fn live_size(
    classes: &Store<ImpVMClass>,
    templates: &Store<ImpVMTemplate>,
    r: &SizeRef,
) -> Option<PlacedSize> {
    let class = match &r.class {
        Some(c) => c.clone(),
        None => templates
            .get(&ObjectRef::new(r.template.as_deref()?).within(&r.namespace))?
            .spec
            .class_ref
            .name
            .clone(),
    };
    let c = classes.get(&ObjectRef::new(&class))?;
    Some(PlacedSize {
        vcpu: i64::from(c.spec.vcpu),
        memory_mib: i64::from(c.spec.memory_mib),
    })
}

/// Feeds one event of the VM watch to the ledger.
fn observe(
    ledger: &std::sync::Mutex<Ledger>,
    classes: &Store<ImpVMClass>,
    templates: &Store<ImpVMTemplate>,
    event: &watcher::Event<ImpVM>,
) {
    let mut ledger = ledger
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match event {
        watcher::Event::Apply(vm) | watcher::Event::InitApply(vm) => {
            let live = live_size(classes, templates, &SizeRef::of(vm));
            ledger.observe(&key(vm), vm, live);
        }
        watcher::Event::Delete(vm) => ledger.forget(&key(vm)),
        watcher::Event::Init => ledger.relist_started(),
        watcher::Event::InitDone => ledger.relist_done(),
    }
}

/// Tells the ledger that sizes may have changed, for every item of a class or template stream.
fn resized<T>(ledger: Arc<std::sync::Mutex<Ledger>>) -> impl FnMut(&T) {
    move |_| {
        ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .classes_changed();
    }
}

fn kube_err(doing: &'static str, vm: &ImpVM) -> impl FnOnce(kube::Error) -> Error {
    let vm = key(vm);
    move |source| Error::Kube { doing, vm, source }
}

fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..Default::default()
    }
}

fn now_time() -> Time {
    Time(Timestamp::now())
}

/// A VM's resolved spec and class size.
struct Resolved {
    spec: ImpVMSpec,
    vcpu: i64,
    memory_mib: i64,
}

impl Context {
    fn api(&self, vm: &ImpVM) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &vm.namespace().unwrap_or_default())
    }

    fn resolve(&self, vm: &ImpVM) -> Result<Resolved, MissingRef> {
        let ns = vm.namespace().unwrap_or_default();
        let template = match &vm.spec.template_ref {
            Some(t) => Some(
                self.templates
                    .get(&ObjectRef::new(&t.name).within(&ns))
                    .ok_or_else(|| MissingRef::Template {
                        namespace: ns.clone(),
                        name: t.name.clone(),
                    })?,
            ),
            None => None,
        };
        let merged = match &template {
            Some(t) => resolve::apply_template(&vm.spec, &t.spec),
            None => vm.spec.clone(),
        };
        let class_name = merged
            .class_ref
            .as_ref()
            .map(|c| c.name.clone())
            .ok_or(MissingRef::NoClass)?;
        let class = self
            .classes
            .get(&ObjectRef::new(&class_name))
            .ok_or_else(|| MissingRef::Class {
                name: class_name.clone(),
                via: match &vm.spec.template_ref {
                    Some(t) if vm.spec.class_ref.is_none() => {
                        format!("classRef of template {}", t.name)
                    }
                    _ => "spec.classRef".to_owned(),
                },
            })?;
        if let Some(n) = &merged.network_ref
            && self
                .networks
                .get(&ObjectRef::new(&n.name).within(&ns))
                .is_none()
        {
            return Err(MissingRef::Network {
                namespace: ns,
                name: n.name.clone(),
            });
        }
        Ok(Resolved {
            spec: resolve::resolve(&vm.spec, template.as_ref().map(|t| &t.spec), &class.spec),
            vcpu: i64::from(class.spec.vcpu),
            memory_mib: i64::from(class.spec.memory_mib),
        })
    }

    /// The scheduling lock: the ledger (never held across an await).
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn policy(&self) -> Policy {
        let default_fraction = self
            .configs
            .get(&ObjectRef::new(CLUSTER_CONFIG_NAME))
            .and_then(|c| c.spec.capacity.as_ref().map(|c| c.default_fraction.clone()))
            .and_then(|f| schedule::parse_fraction(&f));
        Policy {
            default_fraction,
            overcommit_suspended: self.settings.overcommit_suspended,
        }
    }

    fn node_views(&self) -> Vec<NodeView> {
        let mut nodes: Vec<NodeView> = self
            .nodes
            .state()
            .iter()
            .map(|n| {
                let profile = self
                    .profiles
                    .get(&ObjectRef::new(&n.name_any()))
                    .map(|p| p.spec.clone());
                NodeView::from_node(n, profile)
            })
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        nodes
    }

    async fn event(&self, vm: &ImpVM, type_: EventType, reason: &str, note: String) {
        let ev = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: reason.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &vm.object_ref(&())).await {
            tracing::warn!(vm = %key(vm), reason, error = %e, "publishing event failed");
        }
    }

    /// Merge-patches the main resource with a resourceVersion precondition.
    async fn patch_main(
        &self,
        vm: &ImpVM,
        mut body: Value,
        doing: &'static str,
    ) -> Result<ImpVM, Error> {
        body["metadata"]["resourceVersion"] = json!(vm.resource_version());
        let out = self
            .api(vm)
            .patch(&vm.name_any(), &patch_params(), &Patch::Merge(&body))
            .await;
        self.note_write(vm, &out);
        out.map_err(kube_err(doing, vm))
    }

    /// A write that succeeded, or was refused with 409, shows the version it was based on is
    /// outdated.
    fn note_write(&self, vm: &ImpVM, out: &Result<ImpVM, kube::Error>) {
        let outdated = match out {
            Ok(_) => true,
            Err(kube::Error::Api(s)) => s.code == 409,
            Err(_) => false,
        };
        if outdated {
            self.ledger()
                .outdated(&key(vm), vm.metadata.resource_version.as_deref());
        }
    }

    /// Writes `status` (the whole desired status) as a diff against the VM's current status.
    async fn patch_status(
        &self,
        vm: &ImpVM,
        status: &ImpVMStatus,
        doing: &'static str,
    ) -> Result<ImpVM, Error> {
        let old =
            serde_json::to_value(vm.status.clone().unwrap_or_default()).unwrap_or(Value::Null);
        let new = serde_json::to_value(status).unwrap_or(Value::Null);
        let mut diff = serde_json::Map::new();
        if let (Value::Object(o), Value::Object(n)) = (&old, &new) {
            for (k, v) in n {
                if o.get(k) != Some(v) {
                    diff.insert(k.clone(), v.clone());
                }
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    diff.insert(k.clone(), Value::Null);
                }
            }
        }
        if diff.is_empty() {
            return Ok(vm.clone());
        }
        let body = json!({
            "metadata": {"resourceVersion": vm.resource_version()},
            "status": Value::Object(diff),
        });
        let out = self
            .api(vm)
            .patch_status(&vm.name_any(), &patch_params(), &Patch::Merge(&body))
            .await;
        self.note_write(vm, &out);
        out.map_err(kube_err(doing, vm))
    }

    /// Writes spec.nodeName and books the new value in the ledger until the cache shows it.
    ///
    /// The booking follows the write, so the VM still counts on its old node while the write is
    /// in flight (over-counting briefly is the safe side). Placement books before the write
    /// instead, under the scheduling lock: see [`Self::write_placement`].
    async fn set_node_name(&self, vm: &ImpVM, node: Option<&str>) -> Result<ImpVM, Error> {
        let out = self
            .patch_main(
                vm,
                json!({"spec": {"nodeName": node}}),
                "writing spec.nodeName of",
            )
            .await?;
        let k = key(vm);
        let mut ledger = self.ledger();
        let _booked = ledger.book(&k, node, None);
        ledger.confirm(&k);
        Ok(out)
    }

    /// Writes a placement booked under the scheduling lock: spec.nodeName, the finalizer and
    /// the booked size in one patch, so they are durable together. A failed write gives the
    /// booking back.
    async fn write_placement(
        &self,
        vm: &ImpVM,
        node: &str,
        size: PlacedSize,
        booking: Booking,
    ) -> Result<ImpVM, Error> {
        let mut fins = vm.finalizers().to_vec();
        if !fins.iter().any(|f| f == FINALIZER) {
            fins.push(FINALIZER.to_owned());
        }
        let mut anns = serde_json::Map::new();
        anns.insert(
            ANNOTATION_PLACED_RESOURCES.to_owned(),
            Value::String(size.to_annotation()),
        );
        let body = json!({
            "metadata": {"finalizers": fins, "annotations": anns},
            "spec": {"nodeName": node},
        });
        let out = self.patch_main(vm, body, "writing the placement of").await;
        let k = key(vm);
        match out {
            Ok(placed) => {
                self.ledger().confirm(&k);
                Ok(placed)
            }
            Err(e) => {
                self.ledger().abort(&k, booking);
                Err(e)
            }
        }
    }
}

fn set_cond(
    status: &mut ImpVMStatus,
    type_: ConditionType,
    ok: bool,
    reason: ConditionReason,
    message: impl Into<String>,
    generation: Option<i64>,
) {
    conditions::set(
        &mut status.conditions,
        type_,
        ConditionStatus::from(ok),
        reason,
        message,
        generation,
        now_time(),
    );
}

fn restart_state(s: &ImpVMStatus) -> RestartState {
    RestartState {
        restart_count: s.restart_count.unwrap_or(0),
        next_retry_after: s.next_retry_after.as_ref().map(|t| t.0),
        exhausted_at: s.exhausted_at.as_ref().map(|t| t.0),
    }
}

/// How long `node` has been not Ready, from its Ready condition's lastTransitionTime;
/// `None` when that time is unknown (then the node counts as lost at once).
fn not_ready_for(node: &Node) -> Option<Duration> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).unwrap_or_default())
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// One reconcile: retries the whole decision on 409 after re-reading the VM.
async fn reconcile(vm: Arc<ImpVM>, ctx: Arc<Context>) -> Result<Action, Error> {
    if let Some(m) = &ctx.metrics {
        m.reconcile(CONTROLLER_NAME);
    }
    if ctx
        .ledger()
        .is_stale(&key(&vm), vm.metadata.resource_version.as_deref())
    {
        // The watch has not shown this process's own last write yet; its event comes next.
        tracing::debug!(vm = %key(&vm), "cached version is stale; waiting for the watch");
        return Ok(Action::requeue(ctx.settings.requeue_active));
    }
    let mut current = (*vm).clone();
    for attempt in 0..CONFLICT_ATTEMPTS {
        match step(current.clone(), &ctx).await {
            Err(e) if e.is_conflict() => {
                tracing::debug!(vm = %key(&current), attempt, "conflict; re-reading");
                tokio::time::sleep(lifecycle::conflict_backoff(
                    attempt,
                    lifecycle::jitter_unit(),
                ))
                .await;
                match ctx.api(&current).get_opt(&current.name_any()).await {
                    Ok(Some(fresh)) => current = fresh,
                    Ok(None) => return Ok(Action::await_change()),
                    Err(source) => {
                        return Err(Error::Kube {
                            doing: "re-reading",
                            vm: key(&current),
                            source,
                        });
                    }
                }
            }
            other => return other,
        }
    }
    Err(Error::Conflicts(key(&current)))
}

fn error_policy(vm: Arc<ImpVM>, err: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(vm = %key(&vm), error = %err, source = ?std::error::Error::source(err), "reconcile failed");
    if let Some(m) = &ctx.metrics {
        m.reconcile_error(CONTROLLER_NAME, err.metric_label());
    }
    Action::requeue(ctx.settings.requeue_error)
}

/// The decision for one read of the VM. Every write carries the read's resourceVersion.
async fn step(mut vm: ImpVM, ctx: &Context) -> Result<Action, Error> {
    let s = &ctx.settings;
    if vm.metadata.deletion_timestamp.is_some() {
        return finalize(vm, ctx).await;
    }
    let generation = vm.metadata.generation;
    let mut status = vm.status.clone().unwrap_or_default();
    let phase = status.phase.unwrap_or_default();

    // The reset annotation: run again from scratch (clears the node so it is really placed anew).
    if vm
        .annotations()
        .get(ANNOTATION_RESET_RETRIES)
        .map(String::as_str)
        == Some("true")
    {
        if matches!(phase, VmPhase::Failed | VmPhase::RetryExhausted) {
            if vm.spec.node_name.is_some() {
                vm = ctx.set_node_name(&vm, None).await?;
            }
            let mut st = vm.status.clone().unwrap_or_default();
            st.phase = Some(VmPhase::Pending);
            st.restart_count = None;
            st.next_retry_after = None;
            st.exhausted_at = None;
            st.node_name = None;
            st.exit_code = None;
            vm = ctx.patch_status(&vm, &st, "resetting retries of").await?;
            ctx.event(
                &vm,
                EventType::Normal,
                "RetriesReset",
                "imp/reset-retries: counters cleared, scheduling again".into(),
            )
            .await;
        }
        let mut anns = serde_json::Map::new();
        anns.insert(ANNOTATION_RESET_RETRIES.to_owned(), Value::Null);
        ctx.patch_main(
            &vm,
            json!({"metadata": {"annotations": anns}}),
            "removing the reset annotation from",
        )
        .await?;
        return Ok(Action::requeue(Duration::ZERO));
    }

    let resolved = ctx.resolve(&vm);

    // A placed VM holds the finalizer and the size it was booked for; one written by the
    // scheduler has both from its placement patch, one pinned by a user gets them here.
    if vm.spec.node_name.is_some() {
        let mut meta = serde_json::Map::new();
        if !vm.finalizers().iter().any(|f| f == FINALIZER) {
            let mut fins = vm.finalizers().to_vec();
            fins.push(FINALIZER.to_owned());
            meta.insert("finalizers".to_owned(), json!(fins));
        }
        if let Ok(r) = &resolved
            && !vm.annotations().contains_key(ANNOTATION_PLACED_RESOURCES)
        {
            let size = PlacedSize {
                vcpu: r.vcpu,
                memory_mib: r.memory_mib,
            };
            meta.insert(
                "annotations".to_owned(),
                json!({ ANNOTATION_PLACED_RESOURCES: size.to_annotation() }),
            );
        }
        if !meta.is_empty() {
            vm = ctx
                .patch_main(
                    &vm,
                    json!({ "metadata": meta }),
                    "adding the finalizer and size to",
                )
                .await?;
        }
    }

    // Terminal phases: never scheduled again on their own.
    match phase {
        VmPhase::Succeeded | VmPhase::RetryExhausted => return Ok(Action::await_change()),
        VmPhase::Failed => {
            return match resolved {
                Ok(r) => restart(vm, r, ctx).await,
                Err(_) => Ok(Action::await_change()),
            };
        }
        _ => {}
    }

    let Some(node_name) = vm.spec.node_name.clone() else {
        return match resolved {
            Ok(r) => place(vm, r, ctx).await,
            Err(missing) => invalid_spec(vm, missing, ctx).await,
        };
    };

    // Placed: make status say so (pinned by a user, or the operator died between its writes).
    if status.node_name.as_deref() != Some(&node_name) || matches!(phase, VmPhase::Pending) {
        status.node_name = Some(node_name.clone());
        if phase == VmPhase::Pending {
            status.phase = Some(VmPhase::Scheduled);
        }
        if status.scheduled_at.is_none() {
            status.scheduled_at = Some(now_time());
        }
        set_cond(
            &mut status,
            ConditionType::Scheduled,
            true,
            ConditionReason::NodeAssigned,
            format!("assigned to node {node_name}"),
            generation,
        );
        vm = ctx
            .patch_status(&vm, &status, "recording the node of")
            .await?;
        ctx.event(
            &vm,
            EventType::Normal,
            "Scheduled",
            format!("Assigned to node {node_name}"),
        )
        .await;
        status = vm.status.clone().unwrap_or_default();
    }

    // Node health.
    let node = match ctx.nodes.get(&ObjectRef::new(&node_name)) {
        Some(n) => Some((*n).clone()),
        None => Api::<Node>::all(ctx.client.clone())
            .get_opt(&node_name)
            .await
            .map_err(kube_err("reading the node of", &vm))?,
    };
    let healthy = node.as_ref().is_some_and(node_ready);
    let phase = status.phase.unwrap_or_default();
    if !healthy {
        let why = if node.is_none() {
            format!("node {node_name} no longer exists")
        } else {
            format!("node {node_name} is not Ready")
        };
        set_cond(
            &mut status,
            ConditionType::NodeHealthy,
            false,
            ConditionReason::NodeNotReady,
            why.clone(),
            generation,
        );
        // A node that only just went NotReady may come back: wait out the grace period.
        if let Some(elapsed) = node.as_ref().and_then(not_ready_for)
            && elapsed < s.node_loss_grace
        {
            set_cond(
                &mut status,
                ConditionType::NodeHealthy,
                false,
                ConditionReason::NodeNotReady,
                format!(
                    "{why}; its VMs are moved or failed if it stays so for {}s",
                    s.node_loss_grace.as_secs()
                ),
                generation,
            );
            ctx.patch_status(&vm, &status, "noting the node is not Ready")
                .await?;
            let left = s.node_loss_grace - elapsed;
            return Ok(Action::requeue(left.min(s.requeue_active)));
        }
        let spec = resolved
            .as_ref()
            .map(|r| r.spec.clone())
            .unwrap_or_else(|_| vm.spec.clone());
        let movable = spec.lifecycle == VmLifecycle::Ephemeral || spec.reschedule_on_node_loss;
        if movable {
            vm = ctx.set_node_name(&vm, None).await?;
            status.phase = Some(VmPhase::Pending);
            status.node_name = None;
            status.started_at = None;
            status.suspend_snapshot_path = None;
            status.suspended_at = None;
            set_cond(
                &mut status,
                ConditionType::Scheduled,
                false,
                ConditionReason::NodeNotReady,
                format!("{why}; rescheduling"),
                generation,
            );
            ctx.patch_status(&vm, &status, "rescheduling after node loss")
                .await?;
            ctx.event(
                &vm,
                EventType::Warning,
                "Rescheduling",
                format!("{why}; moving to another node"),
            )
            .await;
            return Ok(Action::requeue(Duration::ZERO));
        }
        if phase != VmPhase::Failed {
            status.phase = Some(VmPhase::Failed);
            set_cond(
                &mut status,
                ConditionType::Ready,
                false,
                ConditionReason::NodeNotReady,
                format!("{why}; set rescheduleOnNodeLoss to move persistent VMs"),
                generation,
            );
            ctx.patch_status(&vm, &status, "failing after node loss")
                .await?;
            ctx.event(&vm, EventType::Warning, "NodeLost", why).await;
        }
        return Ok(Action::requeue(s.requeue_active));
    }
    set_cond(
        &mut status,
        ConditionType::NodeHealthy,
        true,
        ConditionReason::NodeReady,
        format!("node {node_name} is Ready"),
        generation,
    );

    let mut requeue = match phase {
        VmPhase::Running => s.requeue_running,
        _ => s.requeue_active,
    };
    let mut expired = false;
    match phase {
        VmPhase::Running | VmPhase::Suspending | VmPhase::Suspended | VmPhase::Resuming => {
            if status.running_at.is_none() && phase == VmPhase::Running {
                status.running_at = Some(now_time());
            }
            let expire_after = resolved
                .as_ref()
                .ok()
                .and_then(|r| r.spec.expire_after.as_ref())
                .and_then(|d| d.parse().ok());
            let at = lifecycle::expires_at(expire_after, status.running_at.as_ref().map(|t| t.0));
            status.expires_at = at.map(Time);
            if let Some(at) = at {
                let now = Timestamp::now();
                if now >= at {
                    expired = true;
                } else {
                    let left = Duration::try_from(at.duration_since(now)).unwrap_or_default();
                    requeue = requeue.min(left + Duration::from_millis(100));
                }
            }
        }
        VmPhase::Starting
            if lifecycle::start_timed_out(
                status.started_at.as_ref().map(|t| t.0),
                Timestamp::now(),
                s.start_timeout,
            ) =>
        {
            status.phase = Some(VmPhase::Failed);
            let msg = format!(
                "still Starting after {:?} on node {node_name}",
                s.start_timeout
            );
            set_cond(
                &mut status,
                ConditionType::Ready,
                false,
                ConditionReason::Failed,
                msg.clone(),
                generation,
            );
            ctx.patch_status(&vm, &status, "failing a stuck start of")
                .await?;
            ctx.event(&vm, EventType::Warning, "StartTimeout", msg)
                .await;
            return Ok(Action::requeue(Duration::ZERO));
        }
        _ => {}
    }
    vm = ctx
        .patch_status(&vm, &status, "updating the status of")
        .await?;
    if expired {
        ctx.event(
            &vm,
            EventType::Normal,
            "Expired",
            "expireAfter elapsed since the VM first ran; deleting".into(),
        )
        .await;
        match ctx
            .api(&vm)
            .delete(&vm.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            // Already gone (deleted by someone else or by an earlier attempt): done.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(kube_err("deleting the expired", &vm)(e)),
        }
        return Ok(Action::requeue(s.requeue_active));
    }
    Ok(Action::requeue(requeue))
}

async fn invalid_spec(vm: ImpVM, missing: MissingRef, ctx: &Context) -> Result<Action, Error> {
    let mut status = vm.status.clone().unwrap_or_default();
    let msg = missing.message();
    let was = conditions::find(&status.conditions, ConditionType::Ready)
        .is_some_and(|c| c.reason == ConditionReason::InvalidSpec.as_str() && c.message == msg);
    status.phase = Some(VmPhase::Pending);
    let generation = vm.metadata.generation;
    set_cond(
        &mut status,
        ConditionType::Ready,
        false,
        ConditionReason::InvalidSpec,
        msg.clone(),
        generation,
    );
    set_cond(
        &mut status,
        ConditionType::Scheduled,
        false,
        ConditionReason::InvalidSpec,
        msg.clone(),
        generation,
    );
    let vm = ctx
        .patch_status(&vm, &status, "reporting the invalid spec of")
        .await?;
    if !was {
        ctx.event(&vm, EventType::Warning, "InvalidSpec", msg).await;
    }
    Ok(Action::requeue(ctx.settings.requeue_pending))
}

/// Places an unplaced VM: under the scheduling lock, spec.nodeName first, then status.
async fn place(vm: ImpVM, r: Resolved, ctx: &Context) -> Result<Action, Error> {
    let req = Request {
        vcpu: r.vcpu,
        memory_mib: r.memory_mib,
        node_selector: r.spec.node_selector.clone(),
        tolerations: r.spec.tolerations.clone(),
    };
    let k = key(&vm);
    let size = PlacedSize {
        vcpu: r.vcpu,
        memory_mib: r.memory_mib,
    };
    let nodes = ctx.node_views();
    let policy = ctx.policy();
    // The choice is booked in the ledger before the write, so the lock covers only the
    // decision; a failed write takes the booking back (over-counting briefly is the safe side).
    let (choice, booking) = {
        let mut ledger = ctx.ledger();
        ledger.refresh_sizes(|s| live_size(&ctx.classes, &ctx.templates, s));
        let choice = schedule::pick(&req, &nodes, ledger.usage(), &policy);
        let booking = choice
            .as_ref()
            .ok()
            .map(|node| ledger.book(&k, Some(node), Some(size)));
        (choice, booking)
    };
    let vm = match (&choice, booking) {
        (Ok(node), Some(booking)) => ctx.write_placement(&vm, node, size, booking).await?,
        _ => vm,
    };
    // The nodeName write raised the generation: conditions observe the new one.
    let generation = vm.metadata.generation;
    let mut status = vm.status.clone().unwrap_or_default();
    match choice {
        Ok(node) => {
            status.phase = Some(VmPhase::Scheduled);
            status.node_name = Some(node.clone());
            let first = status.scheduled_at.is_none();
            if first {
                status.scheduled_at = Some(now_time());
            }
            let msg = format!("assigned to node {node}");
            set_cond(
                &mut status,
                ConditionType::Scheduled,
                true,
                ConditionReason::NodeAssigned,
                msg,
                generation,
            );
            set_cond(
                &mut status,
                ConditionType::Ready,
                false,
                ConditionReason::Waiting,
                format!("waiting for the agent on node {node}"),
                generation,
            );
            // The node was Ready in the cache it was picked from: say so now, as the next
            // reconcile would, so that one has nothing to write.
            set_cond(
                &mut status,
                ConditionType::NodeHealthy,
                true,
                ConditionReason::NodeReady,
                format!("node {node} is Ready"),
                generation,
            );
            let vm = ctx
                .patch_status(&vm, &status, "recording the placement of")
                .await?;
            if first
                && let (Some(m), Some(created)) = (&ctx.metrics, &vm.metadata.creation_timestamp)
            {
                let lat = Timestamp::now().duration_since(created.0);
                m.observe_schedule_latency(Duration::try_from(lat).unwrap_or_default());
            }
            tracing::info!(vm = %k, node = %node, vcpu = r.vcpu, memory_mib = r.memory_mib, "scheduled");
            ctx.event(
                &vm,
                EventType::Normal,
                "Scheduled",
                format!("Assigned to node {node}"),
            )
            .await;
            Ok(Action::requeue(ctx.settings.requeue_active))
        }
        Err(no) => {
            let was =
                conditions::find(&status.conditions, ConditionType::Scheduled).is_some_and(|c| {
                    c.reason == ConditionReason::NoNodeAvailable.as_str() && c.message == no.message
                });
            status.phase = Some(VmPhase::Pending);
            set_cond(
                &mut status,
                ConditionType::Scheduled,
                false,
                ConditionReason::NoNodeAvailable,
                no.message.clone(),
                generation,
            );
            set_cond(
                &mut status,
                ConditionType::Ready,
                false,
                ConditionReason::NoNodeAvailable,
                no.message.clone(),
                generation,
            );
            let vm = ctx
                .patch_status(&vm, &status, "reporting no node for")
                .await?;
            if !was {
                tracing::info!(vm = %k, why = %no.message, "no node available");
                ctx.event(&vm, EventType::Warning, "Unschedulable", no.message)
                    .await;
            }
            Ok(Action::requeue(ctx.settings.requeue_pending))
        }
    }
}

/// The restart policy of a Failed VM.
async fn restart(vm: ImpVM, r: Resolved, ctx: &Context) -> Result<Action, Error> {
    let Some(policy) = r.spec.restart_policy.clone() else {
        return Ok(Action::await_change());
    };
    if r.spec.lifecycle != VmLifecycle::Persistent {
        return Ok(Action::await_change());
    }
    let mut status = vm.status.clone().unwrap_or_default();
    let now = Timestamp::now();
    match lifecycle::decide_restart(
        &policy,
        &restart_state(&status),
        now,
        lifecycle::jitter_unit(),
    ) {
        RestartDecision::Wait { until, record } => {
            if record {
                status.next_retry_after = Some(Time(until));
                ctx.patch_status(&vm, &status, "recording the next retry of")
                    .await?;
            }
            let left = Duration::try_from(until.duration_since(now)).unwrap_or_default();
            Ok(Action::requeue(left + Duration::from_millis(50)))
        }
        RestartDecision::Restart { mode, attempt, max } => {
            let mut vm = vm;
            status.restart_count = Some(attempt);
            status.next_retry_after = None;
            status.exit_code = None;
            status.started_at = None;
            let on_node = vm.spec.node_name.clone();
            match (mode, on_node) {
                (RestartMode::InPlace, Some(node)) => {
                    status.phase = Some(VmPhase::Scheduled);
                    status.node_name = Some(node);
                }
                _ => {
                    if vm.spec.node_name.is_some() {
                        vm = ctx.set_node_name(&vm, None).await?;
                    }
                    status.phase = Some(VmPhase::Pending);
                    status.node_name = None;
                }
            }
            let vm = ctx.patch_status(&vm, &status, "restarting").await?;
            ctx.event(
                &vm,
                EventType::Normal,
                "Restarting",
                format!("attempt {attempt}/{max} ({mode:?})"),
            )
            .await;
            Ok(Action::requeue(Duration::ZERO))
        }
        RestartDecision::StayFailed => Ok(Action::await_change()),
        RestartDecision::AwaitManualReset => {
            status.phase = Some(VmPhase::RetryExhausted);
            status.exhausted_at.get_or_insert_with(now_time);
            let vm = ctx
                .patch_status(&vm, &status, "exhausting retries of")
                .await?;
            ctx.event(
                &vm,
                EventType::Warning,
                "RetriesExhausted",
                "restart attempts used up; set annotation imp/reset-retries: \"true\" to try again"
                    .into(),
            )
            .await;
            Ok(Action::await_change())
        }
        RestartDecision::CoolingDown { until } => {
            if status.exhausted_at.is_none() {
                status.exhausted_at = Some(now_time());
                let vm = ctx
                    .patch_status(&vm, &status, "starting the cool-down of")
                    .await?;
                ctx.event(
                    &vm,
                    EventType::Warning,
                    "CoolingDown",
                    format!(
                        "restart attempts used up; retrying after {}",
                        policy.cool_down_period.as_str()
                    ),
                )
                .await;
            }
            let left = Duration::try_from(until.duration_since(now)).unwrap_or_default();
            Ok(Action::requeue(left + Duration::from_millis(50)))
        }
        RestartDecision::CoolDownOver => {
            let mut vm = vm;
            if vm.spec.node_name.is_some() {
                vm = ctx.set_node_name(&vm, None).await?;
            }
            status.phase = Some(VmPhase::Pending);
            status.node_name = None;
            status.restart_count = None;
            status.next_retry_after = None;
            status.exhausted_at = None;
            status.exit_code = None;
            status.started_at = None;
            let vm = ctx
                .patch_status(&vm, &status, "ending the cool-down of")
                .await?;
            ctx.event(
                &vm,
                EventType::Normal,
                "CoolDownOver",
                "cool-down elapsed; scheduling again".into(),
            )
            .await;
            Ok(Action::requeue(Duration::ZERO))
        }
    }
}

/// Deletion: Terminating until the agent clears spec.nodeName, or a timeout.
async fn finalize(vm: ImpVM, ctx: &Context) -> Result<Action, Error> {
    let ours = |f: &String| f == FINALIZER || f == FINALIZER_VM;
    if !vm.finalizers().iter().any(ours) {
        return Ok(Action::await_change());
    }
    let since = vm
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).unwrap_or_default())
        .unwrap_or_default();
    let remove = async |vm: &ImpVM| -> Result<(), Error> {
        let fins: Vec<String> = vm
            .finalizers()
            .iter()
            .filter(|f| !ours(f))
            .cloned()
            .collect();
        match ctx
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
    };
    let Some(node_name) = vm.spec.node_name.clone() else {
        remove(&vm).await?;
        tracing::info!(vm = %key(&vm), "finalized");
        return Ok(Action::await_change());
    };
    let node_gone = ctx.nodes.get(&ObjectRef::new(&node_name)).is_none()
        && Api::<Node>::all(ctx.client.clone())
            .get_opt(&node_name)
            .await
            .map_err(kube_err("reading the node of", &vm))?
            .is_none();
    if since >= ctx.settings.termination_timeout
        || (node_gone && since >= ctx.settings.node_gone_grace)
    {
        let why = if node_gone {
            format!(
                "node {node_name} is gone, so no agent can clean up; released after {:?}",
                since
            )
        } else {
            format!(
                "the agent on node {node_name} did not clean up within {:?}; released",
                ctx.settings.termination_timeout
            )
        };
        ctx.event(&vm, EventType::Warning, "TerminationTimeout", why)
            .await;
        remove(&vm).await?;
        return Ok(Action::await_change());
    }
    let mut status = vm.status.clone().unwrap_or_default();
    let generation = vm.metadata.generation;
    let was = status.phase == Some(VmPhase::Terminating);
    status.phase = Some(VmPhase::Terminating);
    if node_gone {
        set_cond(
            &mut status,
            ConditionType::NodeHealthy,
            false,
            ConditionReason::NodeNotReady,
            format!(
                "node {node_name} is gone: no agent can clean up; the finalizer is removed after {:?}",
                ctx.settings.node_gone_grace
            ),
            generation,
        );
    }
    let vm = ctx
        .patch_status(&vm, &status, "marking Terminating")
        .await?;
    if !was {
        ctx.event(
            &vm,
            EventType::Normal,
            "Terminating",
            format!("waiting for the agent on node {node_name} to clean up"),
        )
        .await;
    }
    Ok(Action::requeue(
        Duration::from_secs(1).min(ctx.settings.requeue_active),
    ))
}

fn all_unplaced(store: &Store<ImpVM>) -> Vec<ObjectRef<ImpVM>> {
    store
        .state()
        .iter()
        .filter(|v| v.spec.node_name.is_none())
        .map(|v| ObjectRef::from_obj(v.as_ref()))
        .collect()
}

/// Whether a cache has had its first full list (without registering a waker).
fn filled<K: kube::Resource + Clone + 'static>(
    store: &Store<K>,
    kind: &'static str,
) -> Result<bool, ControllerError>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    use futures::FutureExt;
    match store.wait_until_ready().now_or_never() {
        None => Ok(false),
        Some(Ok(())) => Ok(true),
        Some(Err(_)) => Err(ControllerError::Cache(kind)),
    }
}

/// Counts VMs by phase for the metrics.
pub fn phase_counts(vms: &[Arc<ImpVM>]) -> BTreeMap<String, i64> {
    let mut m = BTreeMap::new();
    for v in vms {
        let p = v.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        *m.entry(p.as_str().to_owned()).or_insert(0) += 1;
    }
    m
}

/// Runs the ImpVM controller until `shutdown` completes.
pub async fn run(
    client: kube::Client,
    settings: Settings,
    metrics: Option<Arc<Metrics>>,
    health: Option<Arc<Health>>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), ControllerError> {
    let wc = watcher::Config::default();
    macro_rules! cache {
        ($ty:ty, $api:expr) => {{
            let (reader, writer) = reflector::store::<$ty>();
            let stream = reflector::reflector(writer, watcher($api, wc.clone()))
                .default_backoff()
                .touched_objects();
            (reader, stream)
        }};
    }
    let (nodes, node_stream) = cache!(Node, Api::<Node>::all(client.clone()));
    let (classes, class_stream) = cache!(ImpVMClass, Api::<ImpVMClass>::all(client.clone()));
    let (templates, template_stream) =
        cache!(ImpVMTemplate, Api::<ImpVMTemplate>::all(client.clone()));
    let (networks, network_stream) = cache!(ImpNetwork, Api::<ImpNetwork>::all(client.clone()));
    let (configs, config_stream) = cache!(
        ClusterImpConfig,
        Api::<ClusterImpConfig>::all(client.clone())
    );
    let (profiles, profile_stream) = cache!(
        ClusterImpNodeProfile,
        Api::<ClusterImpNodeProfile>::all(client.clone())
    );

    // The VM watch feeds the ledger as the cache takes each event in, so per-node usage never
    // needs a scan of every VM; class and template changes make it look sizes up again.
    let ledger = Arc::new(std::sync::Mutex::new(Ledger::default()));
    let (vms, vm_writer) = reflector::store::<ImpVM>();
    let vm_stream = {
        let (ledger, classes, templates) = (ledger.clone(), classes.clone(), templates.clone());
        reflector::reflector(
            vm_writer,
            watcher(Api::<ImpVM>::all(client.clone()), wc.clone()),
        )
        .map_ok(move |event| {
            observe(&ledger, &classes, &templates, &event);
            event
        })
        .applied_objects()
    };
    let class_stream = class_stream.inspect(resized(ledger.clone()));
    let template_stream = template_stream.inspect(resized(ledger.clone()));
    let controller = Controller::for_stream(vm_stream, vms.clone());
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: settings.instance.clone(),
        },
    );
    let concurrency = settings.concurrency;
    let ctx = Arc::new(Context {
        client: client.clone(),
        nodes: nodes.clone(),
        classes: classes.clone(),
        templates: templates.clone(),
        networks: networks.clone(),
        configs: configs.clone(),
        profiles: profiles.clone(),
        recorder,
        ledger,
        settings,
        metrics: metrics.clone(),
    });

    let v = vms.clone();
    let on_node = move |n: Node| {
        let name = n.name_any();
        v.state()
            .iter()
            .filter(|vm| vm.spec.node_name.is_none() || vm.spec.node_name.as_deref() == Some(&name))
            .map(|vm| ObjectRef::from_obj(vm.as_ref()))
            .collect::<Vec<_>>()
    };
    let v = vms.clone();
    let on_class = move |c: ImpVMClass| {
        let name = c.name_any();
        v.state()
            .iter()
            .filter(|vm| {
                vm.spec.class_ref.as_ref().is_some_and(|r| r.name == name)
                    || vm.spec.template_ref.is_some()
            })
            .map(|vm| ObjectRef::from_obj(vm.as_ref()))
            .collect::<Vec<_>>()
    };
    let v = vms.clone();
    let on_template = move |t: ImpVMTemplate| {
        let (name, ns) = (t.name_any(), t.namespace());
        v.state()
            .iter()
            .filter(|vm| {
                vm.namespace() == ns
                    && vm
                        .spec
                        .template_ref
                        .as_ref()
                        .is_some_and(|r| r.name == name)
            })
            .map(|vm| ObjectRef::from_obj(vm.as_ref()))
            .collect::<Vec<_>>()
    };
    let v = vms.clone();
    let on_network = move |n: ImpNetwork| {
        let ns = n.namespace();
        v.state()
            .iter()
            .filter(|vm| vm.namespace() == ns && vm.spec.node_name.is_none())
            .map(|vm| ObjectRef::from_obj(vm.as_ref()))
            .collect::<Vec<_>>()
    };
    let (v1, v2) = (vms.clone(), vms.clone());
    let on_config = move |_: ClusterImpConfig| all_unplaced(&v1);
    let on_profile = move |_: ClusterImpNodeProfile| all_unplaced(&v2);

    // Phase-count gauge and queue depth, from the cache.
    if let Some(m) = metrics.clone() {
        let v = vms.clone();
        tokio::spawn(async move {
            loop {
                let state = v.state();
                m.set_phase_counts(&phase_counts(&state));
                let waiting = state
                    .iter()
                    .filter(|vm| {
                        vm.spec.node_name.is_none()
                            && !vm
                                .status
                                .as_ref()
                                .and_then(|s| s.phase)
                                .is_some_and(VmPhase::is_terminal)
                    })
                    .count();
                m.set_queue_depth(waiting as i64);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    // kube's Store::wait_until_ready keeps a single waker, so readiness is polled here instead of
    // awaited concurrently; the VM store is left alone because the controller itself holds every
    // reconcile until it is filled (and a second waiter would steal its wake-up).
    let gate = {
        let (n, c, t, ne, co, p) = (nodes, classes, templates, networks, configs, profiles);
        async move {
            loop {
                let ready = [
                    filled(&n, "Node"),
                    filled(&c, "ImpVMClass"),
                    filled(&t, "ImpVMTemplate"),
                    filled(&ne, "ImpNetwork"),
                    filled(&co, "ClusterImpConfig"),
                    filled(&p, "ClusterImpNodeProfile"),
                ];
                for r in &ready {
                    if let Err(ControllerError::Cache(k)) = r {
                        return Err(ControllerError::Cache(k));
                    }
                }
                if ready.iter().all(|r| matches!(r, Ok(true))) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // Reconciles wait for every cache: the gate runs beside the controller and each reconcile
    // checks readiness of the VM cache before placing (see `gated`).
    let ready = Arc::new(tokio::sync::OnceCell::new());
    let ready2 = ready.clone();
    tokio::spawn(async move {
        let r = gate.await;
        if let Err(e) = &r {
            tracing::error!(error = %e, "caches never filled");
        }
        if r.is_ok()
            && let Some(h) = &health
        {
            h.set_ready();
        }
        tracing::info!(ok = r.is_ok(), "caches filled");
        let _ = ready2.set(r.is_ok());
    });
    let gated = move |vm: Arc<ImpVM>, ctx: Arc<Context>| {
        let ready = ready.clone();
        async move {
            while ready.get().is_none() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tracing::debug!(vm = %key(&vm), "reconciling");
            reconcile(vm, ctx).await
        }
    };

    controller
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
        .watches_stream(node_stream, on_node)
        .watches_stream(class_stream, on_class)
        .watches_stream(template_stream, on_template)
        .watches_stream(network_stream, on_network)
        .watches_stream(config_stream, on_config)
        .watches_stream(profile_stream, on_profile)
        .graceful_shutdown_on(shutdown)
        .run(gated, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_counts_group_by_phase_with_missing_as_pending() {
        let mk = |p: Option<VmPhase>| {
            let mut vm = ImpVM::new("x", ImpVMSpec::default());
            vm.status = p.map(|p| ImpVMStatus {
                phase: Some(p),
                ..Default::default()
            });
            Arc::new(vm)
        };
        let counts = phase_counts(&[
            mk(None),
            mk(Some(VmPhase::Running)),
            mk(Some(VmPhase::Running)),
        ]);
        assert_eq!(counts.get("Pending"), Some(&1));
        assert_eq!(counts.get("Running"), Some(&2));
    }
}
