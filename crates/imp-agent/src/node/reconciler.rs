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
//! are torn down once the watch has listed the node's VMs.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use imp_api::class::ImpVMClass;
use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::shared::{VmDesiredState, VmLifecycle};
use imp_api::template::ImpVMTemplate;
use imp_api::vm::{ImpVM, ImpVMSpec, ImpVMStatus, VmPhase};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
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
use super::scale::{self, ScaleToZero, SleepingTap};
use crate::net::NodeNet;
use crate::runtime::shim::{self, ShimCommand};
use crate::runtime::state::{Owner, StateDir, StateError, VmRecord, VmStatus};

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

/// The guest endpoints of this node's VMs by `(namespace, name)`, refreshed from the records
/// every poll, so the agent API finds a VM without touching the disk.
#[derive(Debug, Default)]
pub struct NodeVms {
    map: std::sync::RwLock<HashMap<(String, String), crate::api::GuestEndpoint>>,
}

impl NodeVms {
    fn refresh(&self, records: &[(VmRecord, bool)]) {
        // Oldest first, so that when a recreated VM's record sits beside its predecessor's
        // (still being torn down), the newest one is kept.
        let mut sorted: Vec<&(VmRecord, bool)> = records.iter().collect();
        sorted.sort_by_key(|(r, _)| r.created_unix);
        let map = sorted
            .into_iter()
            .filter_map(|(r, alive)| {
                let o = r.owner.as_ref()?;
                let endpoint = crate::api::GuestEndpoint {
                    vsock: r.vsock.clone(),
                    agent_port: r.agent_port,
                    serial_log: r.serial_log.clone(),
                    running: *alive && r.status == VmStatus::Running,
                };
                Some(((o.namespace.clone(), o.name.clone()), endpoint))
            })
            .collect();
        *self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = map;
    }
}

impl crate::api::VmLookup for NodeVms {
    fn find(&self, namespace: &str, name: &str) -> Option<crate::api::GuestEndpoint> {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }
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
            settings,
            caps,
            metrics,
            recorder,
            announced: Mutex::new(HashMap::new()),
            vms: Arc::default(),
            net: None,
            scale: None,
            reconcile_tx: std::sync::OnceLock::new(),
        }
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

    /// This node's VMs, as the agent API looks them up.
    pub fn vms(&self) -> Arc<NodeVms> {
        self.vms.clone()
    }

    fn api(&self, vm: &ImpVM) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &vm.namespace().unwrap_or_default())
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
            tracing::warn!(vm = %key(vm), node = %self.settings.node, reason, error = %e, "publishing event failed");
        }
    }

    /// Writes the fields of `status` that differ from the VM's, with a resourceVersion
    /// precondition (409 on a stale read: the reconcile is retried on the newer version).
    async fn patch_status(&self, vm: &ImpVM, status: &ImpVMStatus) -> Result<(), Error> {
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
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                diff.insert(k.clone(), Value::Null);
            }
        }
        if diff.is_empty() {
            return Ok(());
        }
        let body = json!({
            "metadata": {"resourceVersion": vm.resource_version()},
            "status": Value::Object(diff),
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

    /// Clears `spec.nodeName`: the marker that the node has nothing left of the VM.
    async fn release(&self, vm: &ImpVM) -> Result<(), Error> {
        let body = json!({"spec": {"nodeName": null}});
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

/// The VM's local record and whether its shim lives, read off the async runtime. No record is
/// `None`; a record that cannot be read is an error (retried), never taken for a lost VM.
/// Liveness is checked before the record is trusted: a shim seen dead is read again, since it
/// writes the VM's end just before it exits.
async fn local_state(state: &StateDir, uid: &str) -> Result<Option<(VmRecord, bool)>, Error> {
    let (state, id) = (state.clone(), uid.to_owned());
    let read = tokio::task::spawn_blocking(move || -> Result<_, StateError> {
        let load = || match state.load(&id) {
            Ok(r) => Ok(Some(r)),
            Err(StateError::NoSuchVm(_)) => Ok(None),
            Err(e) => Err(e),
        };
        let Some(first) = load()? else {
            return Ok(None);
        };
        if first.supervisor_alive() {
            return Ok(Some((first, true)));
        }
        Ok(load()?.map(|r| (r, false)))
    })
    .await;
    let local = |source: Box<dyn std::error::Error + Send + Sync>| Error::Local {
        doing: "reading the record of",
        vm: uid.to_owned(),
        source,
    };
    match read {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(local(Box::new(e))),
        Err(e) => Err(local(Box::new(e))),
    }
}

fn observed(vm: &ImpVM) -> Observed {
    let status = vm.status.clone().unwrap_or_default();
    Observed {
        phase: status.phase.unwrap_or_default(),
        deleting: vm.meta().deletion_timestamp.is_some(),
        started: status.started_at.is_some(),
        attempt: status.restart_count.unwrap_or(0),
        ephemeral: vm.spec.lifecycle == VmLifecycle::Ephemeral,
        suspend_wanted: vm.spec.desired_state == VmDesiredState::Suspended,
        scale_to_zero: vm.spec.desired_state == VmDesiredState::ScaleToZero,
        cold_boot_fallback: vm
            .annotations()
            .get(imp_api::shared::ANNOTATION_RESUME_FALLBACK)
            .is_some_and(|v| v == imp_api::shared::RESUME_FALLBACK_COLD_BOOT),
    }
}

/// Reconciles one VM.
pub async fn reconcile(vm: Arc<ImpVM>, ctx: Arc<Context>) -> Result<Action, Error> {
    let uid = vm.uid().ok_or_else(|| Error::NoUid(key(&vm)))?;
    let local = local_state(&ctx.settings.state, &uid).await?;
    let obs = observed(&vm);
    let facts = scale_facts(&ctx, &vm, &uid, &obs, local.as_ref()).await;
    let here = local.as_ref().map(|(record, alive)| Local {
        record,
        shim_alive: *alive,
        now_unix: crate::runtime::state::now_unix(),
        suspend_retry_secs: ctx.settings.suspend_retry.as_secs(),
        idle: facts.idle_since.is_some(),
        woken: facts.woken,
    });
    let decision = decide::decide(&obs, here);
    tracing::debug!(vm = %key(&vm), node = %ctx.settings.node, ?decision, "reconcile");
    ctx.metrics.set_phase(&uid, Some(obs.phase));
    let sleeper = decide::wants_sleeper(&obs, here) && decision != Decision::Resume;
    let unheld = !sync_sleeper(&ctx, &vm, &uid, sleeper, facts.tap.as_ref(), &decision).await;
    match decision {
        Decision::Wait => Ok(Action::requeue(Duration::from_secs(300))),
        Decision::Start { clear_previous } => {
            if clear_previous {
                teardown(&ctx, &vm, &uid, local.as_ref().map(|(r, _)| r)).await?;
            }
            start(&ctx, &vm, &uid).await
        }
        Decision::Report(report) => {
            let record = local.as_ref().map(|(r, _)| r);
            let retry = matches!(report, Report::SuspendFailed { .. });
            let running = matches!(report, Report::Running);
            write_report(&ctx, &vm, report, record).await?;
            if running {
                inject_stashed(&ctx, &uid).await;
            }
            if retry {
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
        Decision::Suspend => {
            let Some((record, _)) = local else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            suspend(&ctx, &vm, record, facts.idle_since).await
        }
        Decision::Resume => {
            let Some((record, _)) = local else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            resume(&ctx, &vm, record, facts.spec.as_ref()).await
        }
        Decision::ColdBoot { why } => {
            tracing::warn!(vm = %key(&vm), node = %ctx.settings.node, why, "the snapshot cannot be restored; cold booting as imp.dev/resume-fallback asks");
            let note = format!(
                "{why}; booting the VM afresh from its image as {}: {} asks (its memory is lost)",
                imp_api::shared::ANNOTATION_RESUME_FALLBACK,
                imp_api::shared::RESUME_FALLBACK_COLD_BOOT
            );
            ctx.event(
                &vm,
                EventType::Warning,
                ConditionReason::ResumeFailed.as_str(),
                note,
            )
            .await;
            teardown(&ctx, &vm, &uid, local.as_ref().map(|(r, _)| r)).await?;
            start(&ctx, &vm, &uid).await
        }
        Decision::Teardown { release } => {
            teardown(&ctx, &vm, &uid, local.as_ref().map(|(r, _)| r)).await?;
            if release {
                ctx.release(&vm).await?;
                ctx.metrics.set_phase(&uid, None);
                tracing::info!(vm = %key(&vm), node = %ctx.settings.node, "VM removed from the node; released");
            }
            Ok(Action::await_change())
        }
        Decision::Release => {
            ctx.release(&vm).await?;
            ctx.metrics.set_phase(&uid, None);
            Ok(Action::await_change())
        }
    }
}

/// What scale-to-zero knows of a VM before the decision.
#[derive(Default)]
struct ScaleFacts {
    /// The VM's spec on disk (its TAP, its memory).
    spec: Option<crate::runtime::spec::VmSpec>,
    /// Its TAP as a sleeper holds it.
    tap: Option<SleepingTap>,
    /// Idle since then (a running ScaleToZero VM whose guest sent nothing for idleTimeout).
    idle_since: Option<std::time::SystemTime>,
    /// A frame arrived for it while it slept.
    woken: bool,
    /// When to look at a running ScaleToZero VM's TAP again.
    sample_every: Option<Duration>,
}

/// Samples a running ScaleToZero VM's TAP, and tells whether a sleeping one was woken.
async fn scale_facts(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    obs: &Observed,
    local: Option<&(VmRecord, bool)>,
) -> ScaleFacts {
    let Some((record, alive)) = local else {
        return ScaleFacts::default();
    };
    if !obs.scale_to_zero && record.status != VmStatus::Suspended {
        return ScaleFacts::default();
    }
    let state = ctx.settings.state.clone();
    let id = uid.to_owned();
    let spec = tokio::task::spawn_blocking(move || shim::read_spec(&state, &id).ok())
        .await
        .ok()
        .flatten();
    let tap = spec
        .as_ref()
        .and_then(|s| s.network.as_ref())
        .map(|n| SleepingTap {
            tap: n.tap.clone(),
            ip: n.config.address,
            mac: n.mac.clone(),
        });
    let mut facts = ScaleFacts {
        woken: ctx.scale.as_ref().is_some_and(|s| s.woken(uid)),
        ..ScaleFacts::default()
    };
    if let (Some(scale), Some(t)) = (&ctx.scale, &tap)
        && obs.scale_to_zero
        && *alive
        && record.status == VmStatus::Running
        && obs.phase == VmPhase::Running
    {
        let timeout = idle_timeout(vm);
        let activity = scale.activity(uid, &t.tap, record.vmm_pid, timeout).await;
        if let crate::net::idle::Activity::Idle { since } = activity {
            facts.idle_since = Some(since);
        }
        facts.sample_every = Some(scale::sample_every(timeout));
    }
    facts.spec = spec;
    facts.tap = tap;
    facts
}

/// `spec.idleTimeout`, or the default 5m when unset or unreadable (the webhook refuses both).
fn idle_timeout(vm: &ImpVM) -> Duration {
    vm.spec
        .idle_timeout
        .as_ref()
        .and_then(|d| d.parse().ok())
        .unwrap_or(scale::DEFAULT_IDLE_TIMEOUT)
}

/// Holds a sleeping ScaleToZero VM's TAP (before it is reported Suspended, so Suspended means
/// wakeable), or lets go of it once nobody should wake the VM (the user asked for Suspended).
/// A resume takes the TAP itself. False when the TAP should be held and is not.
async fn sync_sleeper(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    wanted: bool,
    tap: Option<&SleepingTap>,
    decision: &Decision,
) -> bool {
    let Some(scale) = &ctx.scale else {
        return true;
    };
    match tap {
        Some(tap) if wanted => {
            let on_wake = ctx.reconcile_tx.get().cloned().map(|tx| {
                let obj = ObjectRef::from_obj(vm);
                async move {
                    let _ = tx.send(obj).await;
                }
            });
            let on_wake = async move {
                if let Some(f) = on_wake {
                    f.await;
                }
            };
            if let Err(e) = scale.hold(uid, tap, on_wake).await {
                tracing::warn!(vm = %key(vm), node = %ctx.settings.node, tap = %tap.tap, error = %error_chain(&e), "cannot hold a sleeping VM's TAP; it cannot be woken by traffic yet");
                return false;
            }
        }
        _ if !wanted && *decision != Decision::Resume && scale.holds(uid) => {
            scale.release(uid).await;
        }
        _ => {}
    }
    true
}

/// Delivers the frames held for a VM whose VMM opens its TAP by name (Firecracker), once it
/// runs again.
async fn inject_stashed(ctx: &Context, uid: &str) {
    let Some(scale) = &ctx.scale else { return };
    scale.inject_stashed(uid).await;
}

/// Asks the VM's shim to suspend it and says `Suspending`; the record tells how it ended.
/// An idle ScaleToZero VM's last activity (`idle_since`) is written as `lastActivityTime`.
async fn suspend(
    ctx: &Context,
    vm: &ImpVM,
    record: VmRecord,
    idle_since: Option<std::time::SystemTime>,
) -> Result<Action, Error> {
    let state = ctx.settings.state.clone();
    let asked = tokio::task::spawn_blocking(move || {
        crate::runtime::suspend::request_suspend(&state, &record)
    })
    .await;
    let token = match asked {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(local_error("asking for the suspend of", vm, Box::new(e))),
        Err(e) => return Err(local_error("asking for the suspend of", vm, Box::new(e))),
    };
    let idle =
        idle_since.map(|t| Time(Timestamp::try_from(t).unwrap_or_else(|_| Timestamp::now())));
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Suspending", token, idle = idle.is_some(), "suspending");
    ctx.metrics.suspend_asked(if idle.is_some() {
        Trigger::ScaleToZero
    } else {
        Trigger::Requested
    });
    write_report_with(ctx, vm, Report::Suspending, None, |status| {
        if let Some(t) = idle {
            status.last_activity_time = Some(t);
        }
    })
    .await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Starts a shim that restores the suspended VM and says `Resuming`; when a sleeper held the
/// VM's TAP, the TAP goes to the new VMM and the held frames into the VM. A node without the
/// free memory to run the VM keeps it Suspended and says so.
async fn resume(
    ctx: &Context,
    vm: &ImpVM,
    record: VmRecord,
    spec: Option<&crate::runtime::spec::VmSpec>,
) -> Result<Action, Error> {
    if let Some(spec) = spec
        && let Some(why) = no_room_to_resume(ctx, spec.memory_mib).await
    {
        return cannot_resume(ctx, vm, why).await;
    }
    let uid = record.name.clone();
    let by_name = spec.is_some_and(|s| s.runtime == crate::runtime::spec::Runtime::Firecracker);
    let woke = match &ctx.scale {
        Some(scale) => scale.wake_handover(&uid, by_name).await,
        None => scale::Wake::default(),
    };
    let (state, cmd) = (ctx.settings.state.clone(), ctx.settings.shim.clone());
    let tap = woke.tap;
    let started = tokio::task::spawn_blocking(move || {
        crate::runtime::suspend::start_resume(&cmd, &state, &record, tap.as_ref())
    })
    .await;
    let pid = match started {
        Ok(Ok(pid)) => pid,
        Ok(Err(e)) => return Err(local_error("resuming", vm, Box::new(e))),
        Err(e) => return Err(local_error("resuming", vm, Box::new(e))),
    };
    if let Some(scale) = &ctx.scale {
        scale.resumed(&uid);
    }
    let since_wake_ms = woke.at.map(|t| t.elapsed().as_secs_f64() * 1e3);
    ctx.metrics.resume_started(if woke.at.is_some() {
        Trigger::ScaleToZero
    } else {
        Trigger::Requested
    });
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Resuming", shim = pid, held_frames = woke.frames, since_wake_ms, "resuming");
    write_report(ctx, vm, Report::Resuming, None).await?;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Why the node cannot resume a VM of `memory_mib` now, if it cannot.
async fn no_room_to_resume(ctx: &Context, memory_mib: u32) -> Option<String> {
    let available = tokio::fs::read_to_string("/proc/meminfo")
        .await
        .ok()
        .and_then(|m| decide::mem_available_mib(&m))?;
    decide::room_to_resume(available, memory_mib, ctx.settings.resume_reserve_mib)
        .err()
        .map(|e| format!("node {}: {e}", ctx.settings.node))
}

/// Keeps a VM that cannot resume Suspended, with `Ready=False/InsufficientMemory` saying why
/// (once per message), and tries again in 10 s.
async fn cannot_resume(ctx: &Context, vm: &ImpVM, why: String) -> Result<Action, Error> {
    let mut status = vm.status.clone().unwrap_or_default();
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        ConditionReason::InsufficientMemory,
        &why,
        vm.meta().generation,
        now(),
    );
    let said = vm.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.reason == ConditionReason::InsufficientMemory.as_str() && c.message == why)
    });
    ctx.patch_status(vm, &status).await?;
    if !said {
        tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "cannot resume: not enough memory");
        ctx.event(
            vm,
            EventType::Warning,
            ConditionReason::InsufficientMemory.as_str(),
            why,
        )
        .await;
    }
    Ok(Action::requeue(Duration::from_secs(10)))
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
async fn remove_vm(
    ctx: &Context,
    uid: &str,
    record: Option<&VmRecord>,
) -> Result<(), shim::ShimError> {
    let state = &ctx.settings.state;
    if let Some(r) = record
        && let Err(e) = shim::stop(state, r, ctx.settings.stop_grace).await
    {
        tracing::warn!(uid, node = %ctx.settings.node, error = %error_chain(&e), "the shim did not stop; killing the VM");
        let _ = shim::signal(r, nix::sys::signal::Signal::SIGKILL);
    }
    let cgroup = shim::read_spec(state, uid)
        .ok()
        .and_then(|s| s.cgroup.map(|c| c.path));
    if cgroup.is_none()
        && let Some(r) = record
    {
        shim::kill_orphans(state, r);
    }
    shim::remove(state, uid, cgroup.as_deref()).await?;
    ctx.unwire(uid).await;
    Ok(())
}

/// The resolved spec and class of a VM, or why they cannot be had yet.
async fn resolve(
    ctx: &Context,
    vm: &ImpVM,
) -> Result<(ImpVMSpec, imp_api::class::ImpVMClassSpec), String> {
    let ns = vm.namespace().unwrap_or_default();
    let template = match &vm.spec.template_ref {
        Some(t) => {
            let api: Api<ImpVMTemplate> = Api::namespaced(ctx.client.clone(), &ns);
            match api.get_opt(&t.name).await {
                Ok(Some(t)) => Some(t.spec),
                Ok(None) => return Err(format!("ImpVMTemplate {ns}/{} does not exist", t.name)),
                Err(e) => return Err(format!("reading ImpVMTemplate {ns}/{}: {e}", t.name)),
            }
        }
        None => None,
    };
    let class_name = vm
        .spec
        .class_ref
        .as_ref()
        .map(|c| c.name.clone())
        .or_else(|| template.as_ref().map(|t| t.class_ref.name.clone()))
        .ok_or_else(|| "spec.classRef is not set (and no template gives one)".to_owned())?;
    let classes: Api<ImpVMClass> = Api::all(ctx.client.clone());
    let class = match classes.get_opt(&class_name).await {
        Ok(Some(c)) => c.spec,
        Ok(None) => return Err(format!("ImpVMClass {class_name} does not exist")),
        Err(e) => return Err(format!("reading ImpVMClass {class_name}: {e}")),
    };
    let spec = imp_api::resolve::resolve(&vm.spec, template.as_ref(), &class);
    Ok((spec, class))
}

/// The workload's environment, reading the Secrets and ConfigMaps `env` and `envFrom` name.
async fn environment(
    ctx: &Context,
    vm: &ImpVM,
    spec: &ImpVMSpec,
) -> Result<Vec<imp_proto::message::EnvVar>, String> {
    let ns = vm.namespace().unwrap_or_default();
    let (secret_names, map_names) = env::references(spec);
    let mut sources = env::Sources::default();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    for name in secret_names {
        match secrets.get_opt(&name).await {
            Ok(Some(s)) => {
                let data = s
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()));
                sources.secrets.insert(name, data.collect());
            }
            Ok(None) => {}
            Err(e) => return Err(format!("reading Secret {ns}/{name}: {e}")),
        }
    }
    let maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    for name in map_names {
        match maps.get_opt(&name).await {
            Ok(Some(m)) => {
                sources.config_maps.insert(name, m.data.unwrap_or_default());
            }
            Ok(None) => {}
            Err(e) => return Err(format!("reading ConfigMap {ns}/{name}: {e}")),
        }
    }
    env::resolve(spec, &sources)
}

/// Merges the `.dockerconfigjson` of the VM's pull secrets into one credentials file.
async fn pull_credentials(
    ctx: &Context,
    vm: &ImpVM,
    spec: &ImpVMSpec,
) -> Result<Option<Value>, String> {
    if spec.image_pull_secrets.is_empty() {
        return Ok(None);
    }
    let ns = vm.namespace().unwrap_or_default();
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let mut auths = serde_json::Map::new();
    for s in &spec.image_pull_secrets {
        let secret = api
            .get(&s.name)
            .await
            .map_err(|e| format!("reading pull secret {ns}/{}: {e}", s.name))?;
        let data = secret
            .data
            .as_ref()
            .and_then(|d| d.get(".dockerconfigjson"))
            .ok_or_else(|| format!("pull secret {ns}/{} has no .dockerconfigjson", s.name))?;
        let parsed: Value = serde_json::from_slice(&data.0)
            .map_err(|e| format!("pull secret {ns}/{}: .dockerconfigjson: {e}", s.name))?;
        if let Some(Value::Object(a)) = parsed.get("auths") {
            for (k, v) in a {
                auths.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
    }
    Ok(Some(json!({ "auths": auths })))
}

/// Says on the VM why it cannot start yet (phase unchanged), once per distinct message.
async fn not_startable(
    ctx: &Context,
    vm: &ImpVM,
    reason: ConditionReason,
    message: String,
) -> Result<Action, Error> {
    let mut status = vm.status.clone().unwrap_or_default();
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        reason,
        &message,
        vm.meta().generation,
        now(),
    );
    ctx.patch_status(vm, &status).await?;
    let uid = vm.uid().unwrap_or_default();
    let first = {
        let mut announced = ctx
            .announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        announced.insert(uid, message.clone()).as_deref() != Some(message.as_str())
    };
    if first {
        tracing::warn!(vm = %key(vm), node = %ctx.settings.node, %reason, %message, "cannot start the VM");
        ctx.event(vm, EventType::Warning, reason.as_str(), message)
            .await;
        ctx.metrics.failure(reason.as_str());
    }
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// Starts the VM's shim and records phase `Starting`.
async fn start(ctx: &Context, vm: &ImpVM, uid: &str) -> Result<Action, Error> {
    let (spec, class) = match resolve(ctx, vm).await {
        Ok(r) => r,
        // The operator reports missing references (InvalidSpec); try again later.
        Err(why) => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, why, "not starting yet");
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
    };
    let runtime = boot::runtime_for(&class, &ctx.caps);
    if let Some(problem) = ctx.caps.problem(runtime) {
        return not_startable(ctx, vm, ConditionReason::RuntimeStartFailed, problem).await;
    }
    let env = match environment(ctx, vm, &spec).await {
        Ok(env) => env,
        Err(why) => return not_startable(ctx, vm, ConditionReason::InvalidSpec, why).await,
    };
    let credentials = match pull_credentials(ctx, vm, &spec).await {
        Ok(c) => c,
        Err(why) => return not_startable(ctx, vm, ConditionReason::ImagePullFailed, why).await,
    };
    let network = match wire(ctx, vm, uid, &spec).await {
        Ok(n) => n,
        Err(NotWired::Waiting(why)) => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, why, "not starting yet");
            return Ok(Action::requeue(Duration::from_secs(2)));
        }
        Err(NotWired::Refused(why)) => {
            return not_startable(ctx, vm, ConditionReason::NetworkSetupFailed, why).await;
        }
    };
    let state = &ctx.settings.state;
    let auth_file = credentials.as_ref().map(|_| auth_file(state, uid));
    let owner = Owner {
        namespace: vm.namespace().unwrap_or_default(),
        name: vm.name_any(),
        uid: uid.to_owned(),
        attempt: observed(vm).attempt,
    };
    let choices = boot::Choices {
        runtime,
        env,
        auth_file: auth_file.clone(),
    };
    let mut vm_spec = match boot::vm_spec(owner, &spec, &class, choices, &ctx.settings.boot) {
        Ok(s) => s,
        Err(e) => {
            ctx.unwire(uid).await;
            return end_invalid(ctx, vm, e.0).await;
        }
    };
    vm_spec.network = network;
    let (st, id, cmd) = (state.clone(), uid.to_owned(), ctx.settings.shim.clone());
    let started = tokio::task::spawn_blocking(
        move || -> Result<u32, Box<dyn std::error::Error + Send + Sync>> {
            // Only a start cut short (an agent killed mid-way) leaves a directory without a
            // record, and nothing runs there: it is removed so the start can proceed.
            st.remove(&id)?;
            st.create_vm_dir(&id)?;
            let launched = (|| -> Result<u32, Box<dyn std::error::Error + Send + Sync>> {
                if let (Some(path), Some(creds)) = (auth_file, credentials) {
                    write_private(&path, &creds)?;
                }
                Ok(shim::start(&cmd, &st, &id, &vm_spec)?)
            })();
            if launched.is_err() {
                let _ = st.remove(&id);
            }
            launched
        },
    )
    .await;
    if !matches!(started, Ok(Ok(_))) {
        ctx.unwire(uid).await;
    }
    let pid = match started {
        Ok(Ok(pid)) => pid,
        Ok(Err(source)) => {
            return Err(Error::Local {
                doing: "starting the shim of",
                vm: key(vm),
                source,
            });
        }
        Err(e) => {
            return Err(Error::Local {
                doing: "starting the shim of",
                vm: key(vm),
                source: Box::new(e),
            });
        }
    };
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, shim = pid, runtime = runtime.as_str(), image = spec.image.as_deref().unwrap_or(""), "starting");
    let mut status = vm.status.clone().unwrap_or_default();
    status.phase = Some(VmPhase::Starting);
    status.started_at = Some(now());
    status.running_at = None;
    status.finished_at = None;
    status.exit_code = None;
    status.runtime_pid = None;
    status.node_name = Some(ctx.settings.node.clone());
    status.runtime = Some(runtime.as_str().to_owned());
    let msg = format!(
        "pulling {} and booting under {}",
        spec.image.as_deref().unwrap_or(""),
        runtime.as_str()
    );
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        ConditionReason::Starting,
        &msg,
        vm.meta().generation,
        now(),
    );
    ctx.patch_status(vm, &status).await?;
    ctx.event(
        vm,
        EventType::Normal,
        "Starting",
        format!("{msg} on node {}", ctx.settings.node),
    )
    .await;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Wires the VM's network, or says why not (a VM with a networkRef on an agent without
/// networking waits, naming why).
async fn wire(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    spec: &ImpVMSpec,
) -> Result<Option<crate::net::NetAttachment>, NotWired> {
    match &ctx.net {
        Some(net) => network::attach(&ctx.client, net, vm, uid, spec).await,
        None if spec.network_ref.is_some() => Err(NotWired::Refused(
            "this node's agent runs without networking (--no-network)".to_owned(),
        )),
        None => Ok(None),
    }
}

/// Writes `value` as JSON readable by root only (registry credentials).
fn write_private(path: &std::path::Path, value: &Value) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(value.to_string().as_bytes())?;
    f.sync_all()
}

/// A VM that can never boot as specified: Failed with InvalidSpec.
async fn end_invalid(ctx: &Context, vm: &ImpVM, message: String) -> Result<Action, Error> {
    let report = Report::Ended {
        phase: VmPhase::Failed,
        exit_code: None,
        reason: ConditionReason::InvalidSpec,
        message,
    };
    write_report(ctx, vm, report, None).await?;
    Ok(Action::await_change())
}

fn now() -> Time {
    Time(Timestamp::now())
}

fn unix_time(secs: Option<u64>) -> Time {
    secs.and_then(|s| i64::try_from(s).ok())
        .and_then(|s| Timestamp::from_second(s).ok())
        .map_or_else(now, Time)
}

/// Makes the status say what `report` says, with an Event on each transition.
async fn write_report(
    ctx: &Context,
    vm: &ImpVM,
    report: Report,
    record: Option<&VmRecord>,
) -> Result<(), Error> {
    write_report_with(ctx, vm, report, record, |_| {}).await
}

/// [`write_report`], with `edit` applied to the status too (in the same write).
async fn write_report_with(
    ctx: &Context,
    vm: &ImpVM,
    report: Report,
    record: Option<&VmRecord>,
    edit: impl FnOnce(&mut ImpVMStatus),
) -> Result<(), Error> {
    let old = vm.status.clone().unwrap_or_default();
    let mut status = old.clone();
    edit(&mut status);
    let generation = vm.meta().generation;
    status.node_name = Some(ctx.settings.node.clone());
    if let Some(r) = record {
        status.runtime = Some(r.runtime.clone());
    }
    match &report {
        Report::Starting => {
            status.phase = Some(VmPhase::Starting);
            status.started_at.get_or_insert_with(now);
        }
        Report::Running | Report::SuspendFailed { .. } => {
            status.phase = Some(VmPhase::Running);
            status
                .running_at
                .get_or_insert_with(|| unix_time(record.and_then(|r| r.running_unix)));
            status.runtime_pid = record.and_then(|r| r.vmm_pid).map(i64::from);
            status.suspended_at = None;
            status.suspend_snapshot_path = None;
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::True,
                ConditionReason::Running,
                "the guest agent answers",
                generation,
                now(),
            );
        }
        Report::Suspending | Report::Resuming => {
            let (phase, message) = match &report {
                Report::Suspending => (VmPhase::Suspending, "pausing and writing the snapshot"),
                _ => (VmPhase::Resuming, "restoring from the snapshot"),
            };
            status.phase = Some(phase);
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::False,
                ConditionReason::Suspended,
                message,
                generation,
                now(),
            );
        }
        Report::Suspended { at_unix, path } => {
            status.phase = Some(VmPhase::Suspended);
            status.runtime_pid = None;
            status.suspended_at = Some(unix_time(Some(*at_unix)));
            status.suspend_snapshot_path = Some(path.clone());
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::False,
                ConditionReason::Suspended,
                format!("suspended to the snapshot in {path}; its memory is freed"),
                generation,
                now(),
            );
        }
        Report::Ended {
            phase,
            exit_code,
            reason,
            message,
        } => {
            status.phase = Some(*phase);
            status.exit_code = *exit_code;
            status.runtime_pid = None;
            status
                .finished_at
                .get_or_insert_with(|| unix_time(record.and_then(|r| r.finished_unix)));
            conditions::set(
                &mut status.conditions,
                ConditionType::Ready,
                ConditionStatus::False,
                *reason,
                message,
                generation,
                now(),
            );
        }
    }
    if let Report::SuspendFailed { request, error } = &report {
        announce_suspend_failure(ctx, vm, request, error).await;
    }
    if status == old {
        return Ok(());
    }
    ctx.patch_status(vm, &status).await?;
    if old.phase != status.phase {
        announce(ctx, vm, &report, record).await;
    }
    Ok(())
}

/// The Warning Event of a failed suspend, once per failed request.
async fn announce_suspend_failure(ctx: &Context, vm: &ImpVM, request: &str, error: &str) {
    let slot = format!("{}/suspend", vm.uid().unwrap_or_default());
    {
        let mut announced = ctx
            .announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if announced.get(&slot).map(String::as_str) == Some(request) {
            return;
        }
        announced.insert(slot, request.to_owned());
    }
    tracing::warn!(vm = %key(vm), node = %ctx.settings.node, error, "suspend failed; the VM keeps running");
    let note = format!(
        "suspend failed, the VM keeps running (tried again in {:?}): {error}",
        ctx.settings.suspend_retry
    );
    ctx.event(
        vm,
        EventType::Warning,
        ConditionReason::SuspendFailed.as_str(),
        note,
    )
    .await;
}

/// The Event (and metrics) of a phase transition.
async fn announce(ctx: &Context, vm: &ImpVM, report: &Report, record: Option<&VmRecord>) {
    match report {
        // The start's own Event is sent with its status write; this one is for a start whose
        // write was refused (409) and is now reported from the record.
        Report::Starting => {
            let image = record.map(|r| r.image.as_str()).unwrap_or_default();
            let note = format!("pulling {image} and booting on node {}", ctx.settings.node);
            ctx.event(vm, EventType::Normal, "Starting", note).await;
        }
        Report::SuspendFailed { .. } => {}
        Report::Suspending | Report::Resuming => {
            let (reason, note) = match report {
                Report::Suspending => ("Suspending", "pausing the VM and writing its snapshot"),
                _ => ("Resuming", "restoring the VM from its snapshot"),
            };
            let note = format!("{note} on node {}", ctx.settings.node);
            ctx.event(vm, EventType::Normal, reason, note).await;
        }
        Report::Suspended { path, .. } => {
            let t = record.map(|r| r.timings).unwrap_or_default();
            let bytes = record
                .and_then(|r| r.suspend.as_ref())
                .map_or(0, |s| s.bytes);
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Suspended", suspend_ms = t.suspend_ms, bytes, "VM suspended");
            ctx.metrics.observe_suspend(t.suspend_ms);
            let note = format!(
                "snapshot of {} MiB written to {path} in {} ms; the VMM is stopped",
                bytes >> 20,
                t.suspend_ms
            );
            ctx.event(vm, EventType::Normal, "Suspended", note).await;
        }
        Report::Running if record.is_some_and(|r| r.timings.resume_ms > 0) => {
            let t = record.map(|r| r.timings).unwrap_or_default();
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Running", resume_ms = t.resume_ms, "VM resumed");
            ctx.metrics.observe_resume(t.resume_ms);
            let note = format!(
                "restored from its snapshot; the guest agent answered after {} ms",
                t.resume_ms
            );
            ctx.event(vm, EventType::Normal, "Resumed", note).await;
        }
        Report::Running => {
            let t = record.map(|r| r.timings).unwrap_or_default();
            ctx.metrics.observe_start(&t);
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = "Running", image_ms = t.image_ms, disk_ms = t.disk_ms, boot_ms = t.boot_ms, ready_ms = t.ready_ms, "VM running");
            ctx.event(
                vm,
                EventType::Normal,
                "Running",
                format!(
                    "the guest agent answered (image {} ms, disk {} ms, boot {} ms, guest ready {} ms)",
                    t.image_ms, t.disk_ms, t.boot_ms, t.ready_ms
                ),
            )
            .await;
        }
        Report::Ended {
            phase,
            reason,
            message,
            ..
        } => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, phase = phase.as_str(), %reason, message, "VM ended");
            if *phase == VmPhase::Succeeded {
                ctx.event(vm, EventType::Normal, reason.as_str(), message.clone())
                    .await;
                return;
            }
            ctx.metrics.failure(reason.as_str());
            let mut note = message.clone();
            if let Some(tail) = record.and_then(|r| r.console_tail.as_deref()) {
                note.push_str("\nlast console lines:\n");
                note.push_str(tail);
            }
            ctx.event(vm, EventType::Warning, reason.as_str(), note)
                .await;
        }
    }
}

/// Retries a failed reconcile after a short pause.
pub fn error_policy(vm: Arc<ImpVM>, error: &Error, ctx: Arc<Context>) -> Action {
    let conflict =
        matches!(error, Error::Kube { source: kube::Error::Api(s), .. } if s.code == 409);
    if conflict {
        // Someone wrote the VM since we read it: decide again on the newer version, at once.
        tracing::debug!(vm = %key(&vm), node = %ctx.settings.node, "conflict; reconciling the newer version");
        return Action::requeue(Duration::from_millis(50));
    }
    tracing::warn!(vm = %key(&vm), node = %ctx.settings.node, error = %error_chain(error), "reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// A record's fingerprint: a change of any part asks for a reconcile.
type Fingerprint = (VmStatus, bool, Option<u32>, Option<String>);

fn fingerprint(r: &VmRecord, alive: bool) -> Fingerprint {
    let failure = r.suspend_failure.as_ref().map(|f| f.request.clone());
    (r.status, alive, r.vmm_pid, failure)
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
        let state = ctx.settings.state.clone();
        let listed = tokio::task::spawn_blocking(move || {
            state.list().map(|(records, _)| {
                records
                    .into_iter()
                    .map(|r| {
                        let alive = r.supervisor_alive();
                        (r, alive)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .await;
        let Ok(Ok(listed)) = listed else {
            continue;
        };
        ctx.vms.refresh(&listed);
        let records: Vec<VmRecord> = listed.iter().map(|(r, _)| r.clone()).collect();
        for (r, alive) in &listed {
            let fp = fingerprint(r, *alive);
            let Some(owner) = &r.owner else { continue };
            if seen.get(&r.name) != Some(&fp) {
                seen.insert(r.name.clone(), fp);
                let _ = tx
                    .send(ObjectRef::new(&owner.name).within(&owner.namespace))
                    .await;
            }
        }
        seen.retain(|name, _| records.iter().any(|r| &r.name == name));
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
    let state = ctx.settings.state.clone();
    let _ = tokio::task::spawn_blocking(move || state.sweep_trash()).await;
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
            tracing::warn!(uid = %owner.uid, error = %error_chain(&e), "removing an orphaned VM failed");
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
