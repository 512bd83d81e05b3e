//! The per-node reconciler: watches the ImpVMs placed on this node (a field selector on
//! `spec.nodeName`, so the agent never sees another node's VMs), decides with
//! [`super::decide::decide`] and applies the decision: starts shims, writes status and Events,
//! tears down and releases deleted VMs.
//!
//! Reconciles of different VMs run concurrently, and a start only writes the VM's spec and
//! spawns its shim (the shim pulls and boots), so a slow image pull for one VM delays no other.
//! A poller reads the VMs' records every [`Settings::poll`] and asks for a reconcile of every
//! VM whose record changed, so a VM that ends is reported at once, not on the next unrelated
//! event. On start nothing is assumed: records on disk are the truth, live shims are simply
//! re-adopted (a VM is never started twice), and records whose ImpVM no longer belongs here
//! are torn down once the watch has listed the node's VMs. The poller also relays the VMs'
//! serial consoles to the agent's log ([`super::serial`]), and removing a VM reads the rest of
//! its console first.
//!
//! Here: the context, the reconcile that applies each [`Decision`], teardown and the record
//! poller. `start` starts VMs, `sleep` suspends, resumes and runs scale-to-zero, `status`
//! writes the status and Events.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::refusal;
use imp_api::shared::{VmDesiredState, VmLifecycle};
use imp_api::vm::{ImpVM, ImpVMSpec, ImpVMStatus, VmPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::boot::{self, BootSettings};
use super::capabilities::Capabilities;
use super::decide::{self, Decision, Local, Observed, Report};
use super::env;
use super::metrics::{Metrics, Trigger};
use super::network::{self, NotWired};
use super::probes::Probes;
use super::scale::{self, ScaleToZero, SleepingTap};
use super::serial::{self, Consoles};
use super::vms::NodeVms;
use crate::runtime::control::ShimCommand;
use crate::runtime::state::{Owner, StateDir, VmRecord, VmStatus};
use crate::runtime::{PrivateFile, Shims, ShimsError};
use imp_net::NodeNet;

mod claim;
mod follow;
mod moving;
mod pause;
mod probe;
mod sleep;
mod start;
mod status;

use sleep::{ScaleFacts, resume, runs_again, scale_facts, suspend, sync_sleeper};
use start::start;
use status::{now, write_report, write_report_with};

/// Field manager of every agent write.
pub const FIELD_MANAGER: &str = "imp-agent";

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// Where VM directories live.
    pub state: StateDir,
    /// How to start a shim.
    pub shim: ShimCommand,
    /// Kernel, guest, cgroups, boot timeout.
    pub boot: BootSettings,
    /// How long a deleted VM's workload gets to exit before the VM is killed.
    pub stop_grace: Duration,
    /// How often records are read for changes.
    pub poll: Duration,
    /// How long after a failed suspend it is tried again.
    pub suspend_retry: Duration,
    /// Memory (MiB) a resume leaves free on the node beyond the VM's own and its VMM's.
    pub resume_reserve_mib: u64,
    /// Which VMs' serial consoles reach the agent's log, and how many lines per second.
    pub serial: serial::Policy,
    /// The directories node-local snapshots may be in (a restore reads only from them).
    pub snapshot_roots: crate::snapshot::place::Roots,
}

/// Failures of one reconcile; all are retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes request failed.
    #[error("{doing} {vm}")]
    Kube {
        /// What was being done.
        doing: &'static str,
        /// `namespace/name`.
        vm: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// A local operation on the VM failed.
    #[error("{doing} {vm}")]
    Local {
        /// What was being done.
        doing: &'static str,
        /// `namespace/name`.
        vm: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The object has no uid (never seen from a real API server).
    #[error("ImpVM {0} has no uid")]
    NoUid(String),
}

/// What every reconcile shares.
pub struct Context {
    client: kube::Client,
    settings: Settings,
    caps: Capabilities,
    metrics: Arc<Metrics>,
    recorder: Recorder,
    /// The `Ready` message last published as an Event per VM, so repeats are not re-sent.
    announced: Mutex<HashMap<String, String>>,
    /// This node's VMs for the agent API.
    vms: Arc<NodeVms>,
    /// The node's networking, when the agent wires VM networks.
    net: Option<Arc<NodeNet>>,
    /// Idle tracking and sleepers of ScaleToZero VMs (with networking only: a VM without a
    /// TAP has no traffic to count and none to wake it).
    scale: Option<Arc<ScaleToZero>>,
    /// Asks the controller for a reconcile (a sleeping VM's wake); set when it runs.
    reconcile_tx: std::sync::OnceLock<mpsc::Sender<ObjectRef<ImpVM>>>,
    /// The VMs' serial consoles, followed into the agent's log.
    consoles: Arc<Consoles>,
    /// The probes of the running VMs.
    probes: Arc<Probes>,
    /// The node's fence: while it holds, no VM starts, resumes or cold-boots.
    fence: Option<Arc<super::fence::Fence>>,
    /// The VMs' shims: every start, stop, suspend and resume goes through it.
    shims: Shims,
    /// The shims whose events are followed ([`follow`]).
    followed: follow::Followed,
    /// The shims that refused to pause a warm pool's member ([`pause`]).
    pause_refused: pause::Refused,
    /// Sending and taking in moved VMs ([`moving`]); `None` without the agent API.
    moves: Option<MoveKit>,
}

/// What moving VMs between nodes needs: this agent's certificate (presented to the agent a VM
/// moves to), the files moves sent here, and a bandwidth cap for sending.
pub struct MoveKit {
    /// The agent API's certificate and key.
    pub identity: imp_agent_api::tls::ClientIdentity,
    /// The files moves sent to this node ([`crate::api::moves::Moves`]).
    pub store: Arc<crate::api::moves::Moves>,
    /// Bytes per second a send may use (`None`: no cap).
    pub bandwidth: Option<u64>,
}

fn key(vm: &ImpVM) -> String {
    format!("{}/{}", vm.namespace().unwrap_or_default(), vm.name_any())
}

impl Context {
    /// A context for the controller.
    pub fn new(
        client: kube::Client,
        settings: Settings,
        caps: Capabilities,
        metrics: Arc<Metrics>,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(settings.node.clone()),
            },
        );
        Self {
            client,
            consoles: Arc::new(Consoles::new(settings.serial)),
            shims: Shims::new(settings.state.clone(), settings.shim.clone()),
            settings,
            caps,
            metrics,
            recorder,
            announced: Mutex::new(HashMap::new()),
            vms: Arc::default(),
            net: None,
            scale: None,
            reconcile_tx: std::sync::OnceLock::new(),
            probes: Arc::default(),
            fence: None,
            followed: Default::default(),
            pause_refused: Default::default(),
            moves: None,
        }
    }

    /// Sends VMs that move away and takes in those that move here with `kit`.
    pub fn with_moves(mut self, kit: MoveKit) -> Self {
        self.moves = Some(kit);
        self
    }

    /// Holds every start, resume and cold boot while `fence` is up (see [`super::fence`]).
    pub fn with_fence(mut self, fence: Arc<super::fence::Fence>) -> Self {
        self.fence = Some(fence);
        self
    }

    fn fenced(&self) -> bool {
        self.fence.as_ref().is_some_and(|f| f.is_fenced())
    }

    /// Wires VM networks on this node with `net` (without it, VMs with a networkRef wait).
    pub fn with_network(mut self, net: Arc<NodeNet>) -> Self {
        self.scale = Some(Arc::new(ScaleToZero::new(net.netlink())));
        self.net = Some(net);
        self
    }

    async fn unwire(&self, uid: &str) {
        if let Some(scale) = &self.scale {
            scale.release(uid).await;
        }
        if let Some(net) = &self.net {
            net.detach(uid).await;
        }
    }

    /// Reads every VM record (and whether its shim lives) and refreshes what the agent API
    /// looks up from them; `None` when the records cannot be listed. The agent calls it once
    /// before it serves its API, so a restarted agent never answers "not on this node" for a
    /// VM it runs.
    pub async fn load_vms(&self) -> Option<Vec<(VmRecord, bool)>> {
        let listed = self.shims.list().await.ok()?;
        self.vms.refresh(&listed);
        Some(listed)
    }

    /// This node's VMs, as the agent API looks them up.
    pub fn vms(&self) -> Arc<NodeVms> {
        self.vms.clone()
    }

    fn api(&self, vm: &ImpVM) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &vm.namespace().unwrap_or_default())
    }

    async fn event(&self, vm: &ImpVM, type_: EventType, reason: &str, note: String) {
        self.event_of(vm, type_, reason, reason, note).await;
    }

    /// An Event with its own `action`: Events of one reason and action are one series (a
    /// count), which keeps the first note; another action keeps another note.
    async fn event_of(
        &self,
        vm: &ImpVM,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: action.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &vm.object_ref(&())).await {
            tracing::warn!(vm = %key(vm), node = %self.settings.node, reason, error = %imp_api::chain::DisplayChain(&e), "publishing event failed");
        }
    }

    /// Writes the fields of `status` that differ from the VM's (and `observedGeneration`), with a resourceVersion
    /// precondition (409 on a stale read: the reconcile is retried on the newer version).
    async fn patch_status(&self, vm: &ImpVM, status: &ImpVMStatus) -> Result<(), Error> {
        let Some(diff) = imp_api::status_patch::vm_status(vm, status) else {
            return Ok(());
        };
        let body = json!({
            "metadata": {"resourceVersion": vm.resource_version()},
            "status": diff,
        });
        self.api(vm)
            .patch_status(
                &vm.name_any(),
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Merge(&body),
            )
            .await
            .map(|_| ())
            .map_err(|source| Error::Kube {
                doing: "writing the status of",
                vm: key(vm),
                source,
            })
    }

    /// Clears `spec.nodeName`: the marker that the node has nothing left of the VM. With a
    /// resourceVersion precondition: a reconcile of a stale copy (the watch behind the
    /// release it already made) gets 409 and looks again, instead of releasing a VM that is no
    /// longer on this node (which the admission policy refuses, with a Warning Event).
    async fn release(&self, vm: &ImpVM) -> Result<(), Error> {
        let body = json!({
            "metadata": {"resourceVersion": vm.resource_version()},
            "spec": {"nodeName": null},
        });
        self.api(vm)
            .patch(
                &vm.name_any(),
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Merge(&body),
            )
            .await
            .map(|_| ())
            .map_err(|source| Error::Kube {
                doing: "releasing",
                vm: key(vm),
                source,
            })
    }
}

/// The VM's local record and whether its shim lives ([`Shims::observe_owned`]: a warm pool's
/// claimant's may be the one its claim handed it, of member `handed`). No record is `None`; a
/// record that cannot be read is an error (retried), never taken for a lost VM.
async fn local_state(
    ctx: &Context,
    uid: &str,
    handed: Option<&str>,
) -> Result<Option<(VmRecord, bool)>, Error> {
    ctx.shims
        .observe_owned(uid, handed)
        .await
        .map_err(|e| Error::Local {
            doing: "reading the record of",
            vm: uid.to_owned(),
            source: Box::new(e),
        })
}

fn observed(vm: &ImpVM) -> Observed {
    let status = vm.status.clone().unwrap_or_default();
    Observed {
        phase: status.phase.unwrap_or_default(),
        deleting: vm.meta().deletion_timestamp.is_some(),
        started: status.started_at.is_some(),
        attempt: status.restart_count.unwrap_or(0),
        revision: status.booking.as_ref().map_or(0, |b| b.revision),
        ephemeral: vm.spec.lifecycle == VmLifecycle::Ephemeral,
        leaving: status.leaving_node(),
        suspend_wanted: vm.spec.desired_state == VmDesiredState::Suspended,
        scale_to_zero: vm.spec.desired_state == VmDesiredState::ScaleToZero,
        cold_boot_fallback: vm
            .annotations()
            .get(imp_api::shared::ANNOTATION_RESUME_FALLBACK)
            .is_some_and(|v| v == imp_api::shared::RESUME_FALLBACK_COLD_BOOT),
        claim: claimed_member(vm),
        claimed: vm
            .annotations()
            .contains_key(imp_api::shared::ANNOTATION_CLAIMED_BY),
        pause_wanted: pause::wanted(vm),
        // Set by the reconcile, which knows the node and what it received.
        moving_out: None,
        moved_in: false,
    }
}

/// The uid of the member claimant `vm` took (`status.warmClaim`, not a cold start).
fn handed_member(vm: &ImpVM) -> Option<String> {
    vm.spec.warm_pool_ref.as_ref()?;
    let claim = vm.status.as_ref()?.warm_claim.as_ref()?;
    claim.member.as_ref()?;
    claim.member_uid.clone()
}

/// [`handed_member`], once the operator has booked the claimant onto this node.
fn claimed_member(vm: &ImpVM) -> Option<String> {
    vm.status.as_ref()?.booking.as_ref()?;
    handed_member(vm)
}

/// Reconciles one VM.
pub async fn reconcile(vm: Arc<ImpVM>, ctx: Arc<Context>) -> Result<Action, Error> {
    let owner_uid = vm.uid().ok_or_else(|| Error::NoUid(key(&vm)))?;
    let handed = handed_member(&vm);
    let local = local_state(&ctx, &owner_uid, handed.as_deref()).await?;
    // The VM's id on this node: its uid, unless a claim handed it another VM's.
    let uid = local
        .as_ref()
        .map_or_else(|| owner_uid.clone(), |(r, _)| r.name.clone());
    if let Some((record, alive)) = &local {
        ctx.vms.observe(record, *alive);
    }
    let mut obs = observed(&vm);
    obs.moving_out = moving::moving_out(&vm, &ctx.settings.node);
    obs.moved_in = local.is_none()
        && ctx
            .moves
            .as_ref()
            .is_some_and(|k| k.store.received(&owner_uid).is_some());
    let facts = scale_facts(&ctx, &vm, &uid, &obs, local.as_ref()).await;
    let here = local.as_ref().map(|(record, alive)| Local {
        record,
        shim_alive: *alive,
        now_unix: crate::runtime::state::now_unix(),
        suspend_retry_secs: ctx.settings.suspend_retry.as_secs(),
        idle: facts.idle_since.is_some(),
        woken: facts.woken,
        pause_refused: ctx.pause_refused.has(record),
    });
    let decision = decide::decide(&obs, here);
    if ctx.fenced()
        && matches!(
            decision,
            Decision::Start { .. } | Decision::Resume | Decision::ColdBoot { .. }
        )
    {
        tracing::warn!(vm = %key(&vm), node = %ctx.settings.node, ?decision, "the node is fenced: not starting the VM");
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    tracing::debug!(vm = %key(&vm), node = %ctx.settings.node, ?decision, "reconcile");
    let labels = super::metrics::GuestLabels {
        impvm: vm.name_any(),
        namespace: vm.namespace().unwrap_or_default(),
        node: ctx.settings.node.clone(),
    };
    ctx.metrics
        .set_phase(&owner_uid, Some((&labels, obs.phase)));
    let sleeper = decide::wants_sleeper(&obs, here) && decision != Decision::Resume;
    let unheld = !sync_sleeper(&ctx, &vm, &uid, sleeper, facts.tap.as_ref(), &decision).await;
    // Probes run while the VM runs: never while it starts, sleeps, is paused, ends or goes.
    let paused = local.as_ref().is_some_and(|(r, _)| r.paused);
    if decision != Decision::Report(Report::Running) || paused {
        ctx.probes.stop(&uid);
    } else if let Some((record, _)) = &local
        && let Some(why) = probe::run(&ctx, &vm, &uid, record)
    {
        return probe::fail(&ctx, &vm, &uid, record, why).await;
    }
    let local = local.map(|(record, _)| record);
    act(&ctx, &vm, &uid, decision, local, &obs, &facts, unheld).await
}

/// Carries out `decision` for VM `vm` (uid `uid`, its record `local`).
#[allow(clippy::too_many_arguments)]
async fn act(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    decision: Decision,
    local: Option<VmRecord>,
    obs: &Observed,
    facts: &ScaleFacts,
    unheld: bool,
) -> Result<Action, Error> {
    match decision {
        Decision::Pause => Ok(pause::pause(ctx, vm, local.as_ref()).await),
        Decision::SendMove => match local {
            Some(record) => moving::send(ctx, vm, record).await,
            None => Ok(Action::requeue(Duration::from_secs(1))),
        },
        Decision::MoveIn => moving::take_in(ctx, vm, uid).await,
        Decision::Wait => Ok(Action::requeue(Duration::from_secs(300))),
        Decision::Start { clear_previous } => {
            if clear_previous {
                teardown(ctx, vm, uid, local.as_ref()).await?;
            }
            start(ctx, vm, uid).await
        }
        Decision::Report(report) => {
            report_now(ctx, vm, uid, report, local.as_ref(), facts, unheld).await
        }
        Decision::Suspend => {
            let Some(record) = local else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            // Kept for the sleeper: a ScaleToZero VM's TAP descriptor, when its VMM takes it
            // back on resume (QEMU's has no virtio-net header; Firecracker's has one, and it
            // opens the TAP by name anyway).
            let handed_back = facts
                .spec
                .as_ref()
                .is_some_and(|s| !crate::runtime::spec::reopens_tap_by_name(s.runtime));
            let tap = facts
                .tap
                .as_ref()
                .filter(|_| obs.scale_to_zero && handed_back);
            suspend(ctx, vm, record, facts.idle_since, tap).await
        }
        Decision::Resume => {
            let Some(record) = local else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            resume(ctx, vm, record, facts.spec.as_ref()).await
        }
        Decision::ColdBoot { why } => cold_boot(ctx, vm, uid, local.as_ref(), why).await,
        Decision::Claim { member } => claim::take_over(ctx, vm, uid, &member).await,
        Decision::Teardown { release } => {
            teardown(ctx, vm, uid, local.as_ref()).await?;
            if release {
                ctx.release(vm).await?;
                ctx.metrics.set_phase(&vm.uid().unwrap_or_default(), None);
                tracing::info!(vm = %key(vm), node = %ctx.settings.node, "VM removed from the node; released");
            }
            Ok(Action::await_change())
        }
        Decision::Release => {
            ctx.release(vm).await?;
            ctx.metrics.set_phase(&vm.uid().unwrap_or_default(), None);
            Ok(Action::await_change())
        }
    }
}

/// Writes `report` into VM `vm`'s status; after a failed suspend the VM may take execs again
/// and is retried later; a VM that runs again after a sleep is said so.
async fn report_now(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    report: Report,
    record: Option<&VmRecord>,
    facts: &ScaleFacts,
    unheld: bool,
) -> Result<Action, Error> {
    let retry = matches!(report, Report::SuspendFailed { .. });
    let running = matches!(report, Report::Running);
    if retry {
        // The VM runs on: execs may start again — before the report says so, or an
        // exec sent on reading it could still meet the suspend.
        ctx.vms
            .suspend_over(&vm.namespace().unwrap_or_default(), &vm.name_any());
    }
    write_report(ctx, vm, report, record).await?;
    if running {
        runs_again(ctx, uid).await;
    }
    if retry {
        // Its TAP is its VMM's alone again.
        if let Some(scale) = &ctx.scale {
            scale.drop_kept(uid).await;
        }
        let again = ctx.settings.suspend_retry + Duration::from_millis(500);
        return Ok(Action::requeue(again));
    }
    // A sleeper that could not hold the TAP yet tries again soon: until then no
    // traffic can wake the VM.
    let again = if unheld {
        Some(Duration::from_secs(2))
    } else {
        facts.sample_every
    };
    Ok(Action::requeue(again.unwrap_or(Duration::from_secs(300))))
}

/// Boots a VM whose snapshot cannot be restored afresh from its image, as its
/// `imp.dev/resume-fallback` annotation asks, with a Warning Event saying its memory is lost.
async fn cold_boot(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    record: Option<&VmRecord>,
    why: String,
) -> Result<Action, Error> {
    tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "the snapshot cannot be restored; cold booting as imp.dev/resume-fallback asks");
    let note = format!(
        "{why}; booting the VM afresh from its image as {}: {} asks (its memory is lost)",
        imp_api::shared::ANNOTATION_RESUME_FALLBACK,
        imp_api::shared::RESUME_FALLBACK_COLD_BOOT
    );
    ctx.event(
        vm,
        EventType::Warning,
        ConditionReason::ResumeFailed.as_str(),
        note,
    )
    .await;
    teardown(ctx, vm, uid, record).await?;
    start(ctx, vm, uid).await
}

fn local_error(
    doing: &'static str,
    vm: &ImpVM,
    source: Box<dyn std::error::Error + Send + Sync>,
) -> Error {
    Error::Local {
        doing,
        vm: key(vm),
        source,
    }
}

/// Stops the VM if its shim runs, then removes its cgroup and directory.
async fn teardown(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    record: Option<&VmRecord>,
) -> Result<(), Error> {
    remove_vm(ctx, uid, record)
        .await
        .map_err(|e| Error::Local {
            doing: "removing",
            vm: key(vm),
            source: Box::new(e),
        })?;
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, "VM stopped and its files removed");
    Ok(())
}

/// Stops VM `uid` (gracefully, then by force: a shim that does not end in time is killed with
/// everything in the VM's cgroup, or with its recorded VMM where it has no cgroup) and removes
/// its cgroup and directory.
async fn remove_vm(ctx: &Context, uid: &str, record: Option<&VmRecord>) -> Result<(), ShimsError> {
    if let Some(r) = record
        && let Err(e) = ctx.shims.stop(r, ctx.settings.stop_grace).await
    {
        tracing::warn!(uid, node = %ctx.settings.node, error = %imp_api::chain::chain(&e), "the shim did not stop; the VM was killed");
    }
    relay_rest_of_console(ctx, uid).await;
    ctx.shims.remove(uid, record).await?;
    ctx.unwire(uid).await;
    Ok(())
}

/// Logs what VM `uid`'s console printed since the last poll, before its files go.
async fn relay_rest_of_console(ctx: &Context, uid: &str) {
    let (consoles, id) = (ctx.consoles.clone(), uid.to_owned());
    let now = std::time::Instant::now();
    if let Ok(outs) = tokio::task::spawn_blocking(move || consoles.finish(&id, now)).await {
        serial::log(&outs, &ctx.settings.node);
    }
}

/// Logs what the consoles of `records` printed since the last poll; a VM's lifecycle comes
/// from its ImpVM in `store` (its booking's, else its spec's).
async fn relay_consoles(ctx: &Context, store: &Store<ImpVM>, records: Vec<VmRecord>) {
    let lifecycles: HashMap<String, VmLifecycle> = records
        .iter()
        .filter_map(|r| r.owner.as_ref())
        .filter_map(|o| {
            let vm = store.get(&ObjectRef::new(&o.name).within(&o.namespace))?;
            (vm.uid().as_deref() == Some(o.uid.as_str())).then(|| (o.uid.clone(), lifecycle(&vm)))
        })
        .collect();
    let consoles = ctx.consoles.clone();
    let now = std::time::Instant::now();
    let pumped = tokio::task::spawn_blocking(move || {
        consoles.pump(&records, |o| lifecycles.get(&o.uid).copied(), now)
    })
    .await;
    if let Ok(outs) = pumped {
        serial::log(&outs, &ctx.settings.node);
    }
}

/// The VM's lifecycle as it was booked (the template's applies), else as its spec says.
fn lifecycle(vm: &ImpVM) -> VmLifecycle {
    vm.status
        .as_ref()
        .and_then(|s| s.booking.as_ref())
        .map_or(vm.spec.lifecycle, |b| b.spec.lifecycle)
}

/// How long a VM waits after the API server refused the agent for RBAC: a rule comes back when
/// an admin fixes the install, not in a moment.
const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// Retries a failed reconcile after a short pause.
pub fn error_policy(vm: Arc<ImpVM>, error: &Error, ctx: Arc<Context>) -> Action {
    let refused = match error {
        Error::Kube {
            source: kube::Error::Api(s),
            ..
        } => Some(s),
        _ => None,
    };
    if let Some(refused) = refused.and_then(|s| refusal::forbidden(s)) {
        // A rule missing from the agent's RBAC, or a write the chart's admission policy keeps
        // to another node: said in its log and on the VM's Events, in the server's words
        // (they name the verb and the resource, or the policy and the node).
        let note = format!("{error}: forbidden: {refused}");
        tracing::error!(vm = %key(&vm), node = %ctx.settings.node, error = %note, "reconcile refused by the API server");
        tokio::spawn(async move {
            ctx.event(&vm, EventType::Warning, refusal::FORBIDDEN_REASON, note)
                .await;
        });
        return Action::requeue(REFUSED_RETRY);
    }
    if refused.is_some_and(|s| refusal::conflict(s)) {
        // Someone wrote the VM since we read it: decide again on the newer version, at once.
        tracing::debug!(vm = %key(&vm), node = %ctx.settings.node, "conflict; reconciling the newer version");
        return Action::requeue(Duration::from_millis(50));
    }
    tracing::warn!(vm = %key(&vm), node = %ctx.settings.node, error = %imp_api::chain::chain(error), "reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

/// A record's fingerprint: a change of any part asks for a reconcile (of its owner: a claim
/// that hands the VM over asks for the new owner's).
type Fingerprint = (VmStatus, bool, Option<u32>, Option<String>, Option<String>);

fn fingerprint(r: &VmRecord, alive: bool) -> Fingerprint {
    let failure = r.suspend_failure.as_ref().map(|f| f.request.clone());
    let owner = r.owner.as_ref().map(|o| o.uid.clone());
    (r.status, alive, r.vmm_pid, failure, owner)
}

/// Reads every record each `poll` and sends the VMs whose record changed; once the store has
/// listed the node's VMs, tears down records whose ImpVM is gone from this node.
async fn watch_records(ctx: Arc<Context>, store: Store<ImpVM>, tx: mpsc::Sender<ObjectRef<ImpVM>>) {
    let mut seen: BTreeMap<String, Fingerprint> = BTreeMap::new();
    let mut ticks = 0u64;
    let store_ready = store.wait_until_ready();
    tokio::pin!(store_ready);
    let mut ready = false;
    let mut collecting: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(ctx.settings.poll) => {}
            r = &mut store_ready, if !ready => { ready = r.is_ok(); }
        }
        ticks += 1;
        let Some(listed) = ctx.load_vms().await else {
            continue;
        };
        let records: Vec<VmRecord> = listed.iter().map(|(r, _)| r.clone()).collect();
        // Before the changes are sent: a VM that ended is removed by the reconcile they ask
        // for (which reads the rest of its console itself).
        relay_consoles(&ctx, &store, records.clone()).await;
        for (r, alive) in &listed {
            let fp = fingerprint(r, *alive);
            let Some(owner) = &r.owner else { continue };
            if *alive {
                // A shim started before this agent (it restarted): followed from now on.
                let vm = ObjectRef::new(&owner.name).within(&owner.namespace);
                ctx.follow(&r.name, r.supervisor_pid, vm);
            }
            if seen.get(&r.name) != Some(&fp) {
                seen.insert(r.name.clone(), fp);
                let _ = tx
                    .send(ObjectRef::new(&owner.name).within(&owner.namespace))
                    .await;
            }
        }
        seen.retain(|name, _| records.iter().any(|r| &r.name == name));
        ctx.followed
            .retain(&records.iter().map(|r| r.name.as_str()).collect::<Vec<_>>());
        let idle = collecting.as_ref().is_none_or(|t| t.is_finished());
        if ready && idle && ticks.is_multiple_of(40) {
            // Its own task: stopping orphans takes seconds, and status must keep flowing.
            collecting = Some(tokio::spawn(collect_orphans(
                ctx.clone(),
                store.clone(),
                records,
            )));
        }
    }
}

/// Tears down records whose ImpVM (by uid) is no longer on this node, and sweeps what
/// interrupted removals left.
async fn collect_orphans(ctx: Arc<Context>, store: Store<ImpVM>, records: Vec<VmRecord>) {
    ctx.shims.sweep_trash().await;
    moving::sweep(&ctx, &store).await;
    for r in &records {
        let Some(owner) = &r.owner else { continue };
        let key = ObjectRef::new(&owner.name).within(&owner.namespace);
        let here = store
            .get(&key)
            .is_some_and(|vm| vm.uid().as_deref() == Some(owner.uid.as_str()));
        if here {
            continue;
        }
        tracing::info!(vm = %format!("{}/{}", owner.namespace, owner.name), node = %ctx.settings.node, uid = %owner.uid, "the ImpVM left this node; removing its VM");
        let alive = r.supervisor_alive();
        if let Err(e) = remove_vm(&ctx, &r.name, alive.then_some(r)).await {
            tracing::warn!(uid = %owner.uid, error = %imp_api::chain::chain(&e), "removing an orphaned VM failed");
        }
        ctx.metrics.set_phase(&owner.uid, None);
    }
}

/// Runs the reconciler until `shutdown` completes.
pub async fn run(
    ctx: Arc<Context>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let vms: Api<ImpVM> = Api::all(ctx.client.clone());
    let selector = format!("spec.nodeName={}", ctx.settings.node);
    let config = watcher::Config::default().fields(&selector);
    let (tx, rx) = mpsc::channel(256);
    let _ = ctx.reconcile_tx.set(tx.clone());
    if let Some(scale) = &ctx.scale {
        ctx.vms.arm(scale.clone(), tx.clone());
    }
    let controller = Controller::new(vms, config);
    let store = controller.store();
    let poller = tokio::spawn(watch_records(ctx.clone(), store, tx));
    let changes =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
    tracing::info!(node = %ctx.settings.node, selector, state = %ctx.settings.state.root().display(), "watching the node's ImpVMs");
    controller
        .reconcile_on(changes)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
    poller.abort();
}

/// Where a VM's registry credentials are written (root-only), merged from its pull secrets.
pub fn auth_file(state: &StateDir, uid: &str) -> PathBuf {
    state.vm_dir(uid).join("auth.json")
}
