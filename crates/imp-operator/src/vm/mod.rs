//! The ImpVM controller: resolves, schedules and keeps every ImpVM's status honest.
//!
//! It watches ImpVMs and maps changes of Nodes, ImpVMClasses, ImpVMTemplates, ImpNetworks,
//! ClusterImpConfig and ClusterImpNodeProfiles to the VMs they affect. One reconcile reads the
//! world once ([`world`]: resolution through [`crate::resolve`], the VM's node), asks the pure
//! [`decide`] (on top of [`crate::placement::schedule`] and [`lifecycle`]) what the VM needs, and
//! writes the resulting plan in one place ([`apply`]); placement ([`place`]) and deletion
//! ([`finalize`]) have their own rooms, [`conditions`] the status conditions and Events they all
//! write, and [`write`] holds the preconditioned patches.
//!
//! # Writes
//! Every write is a JSON merge patch that carries the `metadata.resourceVersion` it was computed
//! from, so a write based on a stale read fails with 409 instead of clobbering someone else's.
//! On 409 the reconcile re-reads the VM from the API server and decides again, at most
//! [`CONFLICT_ATTEMPTS`] times with jittered backoff ([`lifecycle::conflict_backoff`]).
//! Each 409 is counted in `imp_operator_conflicts_total`, and the VMs whose watch triggers wait
//! for a reconcile to start in `imp_operator_reconcile_backlog` ([`backlog`]).
//! Status is written to the status subresource only, with `status.observedGeneration` set to
//! the `metadata.generation` of the VM the write was decided on. Reconciles are idempotent: each
//! step checks whether its effect is already there.
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
//!   anew. A persistent VM without a restart policy follows
//!   [`lifecycle::default_restart_policy`].
//! - Expiry: a VM with `expireAfter` is deleted at `status.expiresAt` (from `runningAt`, else
//!   from `finishedAt`), running or ended; its deletion then goes as any other.
//! - Conditions: the operator owns `Scheduled` and `NodeHealthy`, and writes `Ready` only to say
//!   why a VM cannot get going (`InvalidSpec`, `NoNodeAvailable`, `NodeNotReady`, and
//!   `AgentTimeout` when a start is not confirmed within the start timeout);
//!   the agent owns `Ready` from `Starting` on.

mod address;
mod apply;
pub mod backlog;
mod claim;
mod conditions;
mod decide;
mod evict;
mod finalize;
pub mod lifecycle;
mod place;
mod reserve;
mod rollout;
mod trace;
mod watches;
mod world;
mod write;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::class::ImpVMClass;
use imp_api::cluster::{ClusterImpConfig, ClusterImpNodeProfile};
use imp_api::network::ImpNetwork;
use imp_api::refusal;
use imp_api::template::ImpVMTemplate;
use imp_api::vm::ImpVM;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;

use self::apply::Outcome;
use self::decide::{Decision, World};
use crate::ipam::{self, Ipam};
use crate::metrics::Metrics;
use crate::names;
use crate::placement::ledger::Ledger;
use backlog::Tracker;
use imp_telemetry::Health;

/// Decide-and-write rounds of one reconcile before it requeues (each round that continues
/// removes its own cause, so real VMs need at most three).
const MAX_ROUNDS: usize = 6;

/// Finalizer the operator holds on every placed ImpVM until the agent has cleaned up.
pub const FINALIZER: &str = "imp.dev/vm-cleanup";

use crate::FIELD_MANAGER;
/// Attempts of one reconcile against 409 conflicts before it is requeued.
pub const CONFLICT_ATTEMPTS: u32 = 5;

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
    /// Added to an agent's fence deadline (its Lease's `leaseDurationSeconds`) before the VMs
    /// of its lost node are moved: covers the agent's once-a-second check and the kill.
    pub fence_margin: Duration,
    /// Which agent Leases count: the agents' namespace and the deadline they are expected to
    /// fence by ([`crate::placement::fencing`]).
    pub agent_leases: crate::placement::fencing::Trust,
    /// Count suspended VMs' memory as free (the Go overcommit rule).
    pub overcommit_suspended: bool,
    /// Reconciles running at once.
    pub concurrency: u16,
    /// Reporter instance in Events (the replica identity).
    pub instance: Option<String>,
    /// How reservation Pods are made ([`crate::placement::reservation`]); `None`: none are made, and
    /// Kubernetes does not see what VMs hold.
    pub reservations: Option<crate::placement::reservation::PodSettings>,
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
            fence_margin: Duration::from_secs(10),
            agent_leases: crate::placement::fencing::Trust::default(),
            overcommit_suspended: true,
            concurrency: 8,
            instance: None,
            reservations: Some(crate::placement::reservation::PodSettings::default()),
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
    /// The network's allocation table could not be read or written.
    #[error("Allocating or releasing an address failed")]
    Ipam(#[from] ipam::Error),
}

impl Error {
    /// Short label for the reconcile-error metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube { .. } => "api",
            Self::Conflicts(_) => "conflict",
            Self::Ipam(_) => "ipam",
        }
    }

    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube { source: kube::Error::Api(s), .. } if refusal::conflict(s))
    }

    /// The API server's words when it refused a request for RBAC.
    fn forbidden(&self) -> Option<&str> {
        match self {
            Self::Kube {
                source: kube::Error::Api(s),
                ..
            } => refusal::forbidden(s),
            Self::Ipam(ipam::Error::Kube { source, .. }) => match source.as_ref() {
                kube::Error::Api(s) => refusal::forbidden(s),
                _ => None,
            },
            _ => None,
        }
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
    /// Pods that are not finished, for what they request of their nodes.
    pods: Store<Pod>,
    /// When each node's agent was last seen renewing its Lease.
    agent_leases: Arc<std::sync::Mutex<crate::placement::fencing::AgentLeases>>,
    recorder: Recorder,
    /// Per-node usage and this process's own writes; its lock is the scheduling lock.
    ledger: Arc<std::sync::Mutex<Ledger>>,
    /// The cluster's address allocator (shared with the network controller).
    ipam: Arc<Ipam>,
    settings: Settings,
    metrics: Option<Arc<Metrics>>,
}

fn key(vm: &ImpVM) -> String {
    format!("{}/{}", vm.namespace().unwrap_or_default(), vm.name_any())
}

/// One reconcile: retries the whole decision on 409 after re-reading the VM.
async fn reconcile(vm: Arc<ImpVM>, ctx: Arc<Context>) -> Result<Action, Error> {
    if let Some(m) = &ctx.metrics {
        m.reconcile(names::VM_CONTROLLER);
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

/// How long a VM waits after the API server refused the operator for RBAC: a rule comes back
/// when an admin fixes the install, not in a moment.
const REFUSED_RETRY: Duration = Duration::from_secs(30);

fn error_policy(vm: Arc<ImpVM>, err: &Error, ctx: Arc<Context>) -> Action {
    if let Some(refused) = err.forbidden() {
        // A rule missing from the operator's RBAC: said where an operator looks (its log and
        // the VM's Events) in the server's words, which name the verb and the resource.
        let note = format!("{err}: forbidden by RBAC: {refused}");
        tracing::error!(vm = %key(&vm), error = %note, "reconcile refused by the API server");
        tokio::spawn(async move {
            ctx.event(&vm, EventType::Warning, refusal::FORBIDDEN_REASON, note)
                .await;
        });
        return Action::requeue(REFUSED_RETRY);
    }
    tracing::warn!(vm = %key(&vm), error = %err, source = ?std::error::Error::source(err), "reconcile failed");
    if let Some(m) = &ctx.metrics {
        m.reconcile_error(names::VM_CONTROLLER, err.metric_label());
    }
    Action::requeue(ctx.settings.requeue_error)
}

/// One read of the VM: the world is read once, then decisions are written until one ends the
/// reconcile. Every write carries the resourceVersion of the VM it was decided on.
async fn step(vm: ImpVM, ctx: &Context) -> Result<Action, Error> {
    let mut resolved = ctx.resolve(&vm);
    let node = ctx.node_of(&vm).await?;
    let mut vm = vm;
    // Each plan that continues makes its own condition false, so this ends in a few rounds.
    for _ in 0..MAX_ROUNDS {
        let world = World {
            now: Timestamp::now(),
            jitter: lifecycle::jitter_unit(),
            settings: &ctx.settings,
            resolved: &resolved,
            node: node.as_ref(),
            agent: ctx.agent_silence(&vm),
        };
        match decide::decide(&vm, &world) {
            Decision::Finalize => return ctx.finalize(vm, node.as_ref()).await,
            Decision::Place => {
                let Ok(r) = &resolved else {
                    return Ok(Action::requeue(ctx.settings.requeue_pending));
                };
                // The address is chosen and written before the placement.
                return match ctx.address(vm, r).await? {
                    Ok(vm) => ctx.place(vm, r).await,
                    Err(action) => Ok(action),
                };
            }
            Decision::Address => {
                let Ok(r) = &resolved else {
                    return Ok(Action::requeue(ctx.settings.requeue_pending));
                };
                match ctx.address(vm, r).await? {
                    Ok(written) => vm = written,
                    Err(action) => return Ok(action),
                }
            }
            Decision::Claim => {
                let Ok(r) = &resolved else {
                    return Ok(Action::requeue(ctx.settings.requeue_pending));
                };
                match ctx.claim(vm, r).await? {
                    // A claim written may change what the VM restores from (a cold start).
                    claim::Claimed::Continue(written) => {
                        resolved = ctx.resolve(&written);
                        vm = *written;
                    }
                    claim::Claimed::Done(action) => return Ok(action),
                }
            }
            Decision::Write(plan) => match ctx.apply(vm, *plan).await? {
                Outcome::Continue(written) => vm = *written,
                Outcome::Done(action) => return Ok(action),
            },
        }
    }
    Ok(Action::requeue(Duration::ZERO))
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

/// Whether every cache the decisions read has filled; an error names one that never can.
///
/// kube's `Store::wait_until_ready` keeps a single waker, so readiness is polled instead of
/// awaited concurrently; the VM store is left alone because the controller itself holds every
/// reconcile until it is filled (and a second waiter would steal its wake-up).
fn caches_filled(ctx: &Context, reservations: &Store<Pod>) -> Result<bool, ControllerError> {
    let ready = [
        filled(&ctx.nodes, "Node"),
        filled(&ctx.classes, "ImpVMClass"),
        filled(&ctx.templates, "ImpVMTemplate"),
        filled(&ctx.networks, "ImpNetwork"),
        filled(&ctx.configs, "ClusterImpConfig"),
        filled(&ctx.profiles, "ClusterImpNodeProfile"),
        filled(&ctx.pods, "Pod"),
        filled(reservations, "reservation Pod"),
    ];
    let mut all = true;
    for r in ready {
        all &= r?;
    }
    Ok(all)
}

/// Sets `ready` (and the operator's readiness) once every cache has filled.
async fn wait_filled(
    ctx: Arc<Context>,
    reservations: Store<Pod>,
    health: Option<Arc<Health>>,
    ready: Arc<tokio::sync::OnceCell<bool>>,
) {
    let r = loop {
        match caches_filled(&ctx, &reservations) {
            Ok(true) => break Ok(()),
            Ok(false) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => break Err(e),
        }
    };
    if let Err(e) = &r {
        tracing::error!(error = %imp_api::chain::DisplayChain(&e), "caches never filled");
    }
    if r.is_ok()
        && let Some(h) = &health
    {
        h.set_ready();
    }
    tracing::info!(ok = r.is_ok(), "caches filled");
    let _ = ready.set(r.is_ok());
}

/// Returns once [`wait_filled`] has decided.
async fn until_filled(ready: &tokio::sync::OnceCell<bool>) {
    while ready.get().is_none() {
        tokio::time::sleep(Duration::from_millis(20)).await;
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

/// Runs the ImpVM controller until `shutdown` completes; `ipam` is the cluster's address
/// allocator, shared with the network controller (its per-network locks serialize their
/// writes).
pub async fn run(
    client: kube::Client,
    settings: Settings,
    ipam: Arc<Ipam>,
    metrics: Option<Arc<Metrics>>,
    health: Option<Arc<Health>>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
    beside: impl FnOnce(Arc<Context>) -> Option<tokio::task::JoinHandle<()>>,
) -> Result<(), ControllerError> {
    let wc = watcher::Config::default();
    let (stores, streams) = watches::kinds(&client, &wc);
    let reservation_changed = Arc::new(tokio::sync::Notify::new());
    let reservation_pods = watches::reservation_pods(&client, &wc, reservation_changed.clone());
    let agent_leases =
        watches::agent_leases(&client, &wc, settings.agent_leases.clone(), metrics.clone());
    // Every trigger handed to the controller marks its VM waiting until its reconcile starts.
    let backlog = Arc::new(Tracker::new(names::VM_CONTROLLER, metrics.clone()));
    let ledger = Arc::new(std::sync::Mutex::new(Ledger::default()));
    let (vms, vm_stream) = watches::vms(
        &client,
        &wc,
        &ledger,
        &stores,
        &backlog,
        reservation_changed.clone(),
    );
    let concurrency = settings.concurrency;
    let controller = Controller::for_stream(vm_stream, vms.clone())
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency));
    let controller = watches::related(controller, streams, &vms, &backlog, &ledger);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: settings.instance.clone(),
        },
    );
    let ctx = Arc::new(Context {
        client,
        nodes: stores.nodes,
        classes: stores.classes,
        templates: stores.templates,
        networks: stores.networks,
        configs: stores.configs,
        profiles: stores.profiles,
        pods: stores.pods,
        agent_leases,
        recorder,
        ledger,
        ipam,
        settings,
        metrics: metrics.clone(),
    });
    if let Some(m) = metrics {
        watches::spawn_gauges(m, vms.clone(), backlog.clone());
    }
    let ready = gate(&ctx, vms, reservation_pods, reservation_changed, health);
    // A controller that books through this one's scheduler and ledger (migrations).
    let beside = beside(ctx.clone());
    controller
        .graceful_shutdown_on(shutdown)
        .run(
            move |vm, ctx| gated(vm, ctx, ready.clone(), backlog.clone()),
            error_policy,
            ctx,
        )
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "controller event");
            }
        })
        .await;
    if let Some(task) = beside
        && let Err(e) = task.await
    {
        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "a controller beside the VM controller failed");
    }
    Ok(())
}

/// Starts the gate every reconcile waits at (set once every cache has filled, which also
/// makes the operator ready) and the reservation sync behind it; returns the gate.
fn gate(
    ctx: &Arc<Context>,
    vms: Store<ImpVM>,
    reservation_pods: Store<Pod>,
    changed: Arc<tokio::sync::Notify>,
    health: Option<Arc<Health>>,
) -> Arc<tokio::sync::OnceCell<bool>> {
    let ready = Arc::new(tokio::sync::OnceCell::new());
    tokio::spawn(wait_filled(
        ctx.clone(),
        reservation_pods.clone(),
        health,
        ready.clone(),
    ));
    let filled_all = {
        let ready = ready.clone();
        async move { until_filled(&ready).await }
    };
    tokio::spawn(reserve::sync(
        ctx.clone(),
        vms,
        reservation_pods,
        changed,
        filled_all,
    ));
    ready
}

/// One reconcile as the controller runs it: after the gate, with the VM's wait in the backlog
/// ended.
async fn gated(
    vm: Arc<ImpVM>,
    ctx: Arc<Context>,
    ready: Arc<tokio::sync::OnceCell<bool>>,
    backlog: Arc<Tracker>,
) -> Result<Action, Error> {
    until_filled(&ready).await;
    backlog.started(&key(&vm));
    tracing::debug!(vm = %key(&vm), "reconciling");
    reconcile(vm, ctx).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::vm::{ImpVMSpec, ImpVMStatus, VmPhase};

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
