//! The ImpVMMigration controller: moves a VM to another node, the same object with its name,
//! uid, address and disk, through its status (`status.move`) and one commit write of
//! `spec.nodeName` ([docs/migration.md](../../../../docs/migration.md)).
//!
//! One reconcile reads the migration's VM from the API (never a cache: the commit depends on
//! the agent's latest word), asks the pure [`decide::next`] and applies the step, each write
//! preconditioned on the resourceVersion it was decided on. The target is chosen and booked
//! through the VM controller's scheduler and ledger ([`crate::vm::Context`]), so a move and a
//! placement never take the same last slot. A finalizer holds a migration's deletion until
//! its move is undone (before the commit) or finished (after it).

pub mod decide;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::snapshot::{ImpVMMigration, ImpVMMigrationStatus, MigrationPhase};
use imp_api::vm::{ImpVM, MovePhase, VmMove};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;

use self::decide::Step;
use crate::api_call::params;

/// The finalizer that holds a migration's deletion until its move is undone or finished.
pub const FINALIZER: &str = "imp.dev/migration";

/// How often a migration in flight is looked at again without a change (its deadline).
const RESYNC: Duration = Duration::from_secs(30);

/// Requeue after a failed reconcile.
const RETRY: Duration = Duration::from_secs(5);

/// What can go wrong in one reconcile: an API call.
pub type Error = crate::api_call::Error;

/// What the controller works with: the VM controller's context (its scheduler and ledger)
/// and an Event recorder.
pub struct Ctx {
    client: kube::Client,
    vms: Arc<crate::vm::Context>,
    recorder: Recorder,
}

fn key(m: &ImpVMMigration) -> String {
    format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any())
}

fn failed(doing: &'static str, m: &ImpVMMigration) -> impl FnOnce(kube::Error) -> Error {
    crate::api_call::failed(doing, "ImpVMMigration", key(m))
}

impl Ctx {
    fn migrations(&self, m: &ImpVMMigration) -> Api<ImpVMMigration> {
        Api::namespaced(self.client.clone(), &decide::vm_namespace(m))
    }

    fn vms(&self, m: &ImpVMMigration) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), &decide::vm_namespace(m))
    }

    /// Event `reason`/`message` on the migration and on its VM (when there is one).
    async fn tell(
        &self,
        m: &ImpVMMigration,
        vm: Option<&ImpVM>,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        if warning {
            tracing::warn!(migration = %key(m), reason, message, "migration");
        } else {
            tracing::info!(migration = %key(m), reason, message, "migration");
        }
        let ev = crate::api_call::event::<ImpVM>(warning, reason, message, None, None);
        crate::api_call::publish(&self.recorder, &ev, &m.object_ref(&())).await;
        if let Some(vm) = vm {
            crate::api_call::publish(&self.recorder, &ev, &vm.object_ref(&())).await;
        }
    }

    /// Merge-patches the migration's status with `status` (what changed only).
    async fn set_status(
        &self,
        m: &ImpVMMigration,
        status: &ImpVMMigrationStatus,
    ) -> Result<(), Error> {
        let old = m.status.clone().unwrap_or_default();
        let Some(diff) = imp_api::status_patch::diff(&old, status) else {
            return Ok(());
        };
        let body = json!({"status": diff});
        match self
            .migrations(m)
            .patch_status(&m.name_any(), &params(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(failed("writing the status of", m)(e)),
        }
    }

    /// Merge-patches `status.move` of `vm` (`None` clears it), under the VM's resourceVersion.
    async fn set_move(
        &self,
        m: &ImpVMMigration,
        vm: &ImpVM,
        mv: Option<&VmMove>,
    ) -> Result<(), Error> {
        let body = json!({
            "metadata": {"resourceVersion": vm.resource_version()},
            "status": {"move": mv},
        });
        self.vms(m)
            .patch_status(&vm.name_any(), &params(), &Patch::Merge(&body))
            .await
            .map(|_| ())
            .map_err(failed("writing status.move of the VM of", m))
    }

    /// Adds or removes [`FINALIZER`] on the migration, as it is now (this reconcile's status
    /// writes have moved its resourceVersion on).
    async fn finalizer(&self, m: &ImpVMMigration, present: bool) -> Result<(), Error> {
        let Some(m) = self
            .migrations(m)
            .get_opt(&m.name_any())
            .await
            .map_err(failed("re-reading", m))?
        else {
            return Ok(());
        };
        let m = &m;
        let mut list = m.finalizers().to_vec();
        let has = list.iter().any(|f| f == FINALIZER);
        if has == present {
            return Ok(());
        }
        if present {
            list.push(FINALIZER.to_owned());
        } else {
            list.retain(|f| f != FINALIZER);
        }
        let body = json!({
            "metadata": {"resourceVersion": m.resource_version(), "finalizers": list},
        });
        match self
            .migrations(m)
            .patch(&m.name_any(), &params(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 && !present => Ok(()),
            Err(e) => Err(failed("writing the finalizer of", m)(e)),
        }
    }
}

/// The status of `m` with `phase` and `message`, and its `Ready` condition.
fn status_with(
    m: &ImpVMMigration,
    phase: MigrationPhase,
    ready: (ConditionStatus, ConditionReason),
    message: &str,
) -> ImpVMMigrationStatus {
    let mut s = m.status.clone().unwrap_or_default();
    s.phase = Some(phase);
    s.message = Some(message.to_owned());
    conditions::set(
        &mut s.conditions,
        ConditionType::Ready,
        ready.0,
        ready.1,
        message.to_owned(),
        m.meta().generation,
        Time(Timestamp::now()),
    );
    if matches!(
        phase,
        MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::Cancelled
    ) {
        s.completed_at = Some(Time(Timestamp::now()));
    }
    s
}

/// The token of a move of migration `m` started at `now`: unique to the move (the
/// migration's uid and the start), not a secret (the target's agent trusts the source node's
/// pinned certificate; the token ties a transfer to this move).
fn token(m: &ImpVMMigration, now: Timestamp) -> String {
    format!("{}-{}", m.uid().unwrap_or_default(), now.as_nanosecond())
}

async fn reconcile(m: Arc<ImpVMMigration>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    // Targets are booked in the VM controller's ledger: only once it holds every VM.
    if !ctx.vms.ledger_listed() {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let vm = ctx
        .vms(&m)
        .get_opt(&m.spec.source_vm_name)
        .await
        .map_err(failed("reading the VM of", &m))?;
    if m.meta().deletion_timestamp.is_some() {
        return cancel(&m, vm.as_ref(), &ctx).await;
    }
    let step = decide::next(&m, vm.as_ref(), Timestamp::now());
    tracing::debug!(migration = %key(&m), ?step, "migration step");
    apply(&m, vm.as_ref(), step, &ctx).await
}

/// A migration being deleted: before the commit its move is aborted and cleared once the VM
/// runs where it was; after it, the move finishes. The finalizer goes when nothing is left.
async fn cancel(m: &ImpVMMigration, vm: Option<&ImpVM>, ctx: &Ctx) -> Result<Action, Error> {
    let own = vm.and_then(|v| decide::own_move(m, v).map(|mv| (v, mv)));
    let Some((vm, mv)) = own else {
        ctx.finalizer(m, false).await?;
        return Ok(Action::await_change());
    };
    match mv.phase {
        MovePhase::Transferring | MovePhase::SendFailed | MovePhase::Sent => {
            apply(
                m,
                Some(vm),
                Step::Abort {
                    reason: "Cancelled",
                    message: "the migration was deleted before its commit".into(),
                },
                ctx,
            )
            .await
        }
        MovePhase::Aborting | MovePhase::Committed => {
            let step = decide::next(m, Some(vm), Timestamp::now());
            if matches!(step, Step::ClearAborted | Step::Succeed) {
                ctx.set_move(m, vm, None).await?;
                ctx.finalizer(m, false).await?;
                return Ok(Action::await_change());
            }
            Ok(Action::requeue(RESYNC))
        }
    }
}

async fn apply(
    m: &ImpVMMigration,
    vm: Option<&ImpVM>,
    step: Step,
    ctx: &Ctx,
) -> Result<Action, Error> {
    match (step, vm) {
        (Step::Wait, _) => Ok(if decide::finished(m) {
            Action::await_change()
        } else {
            Action::requeue(RESYNC)
        }),
        (Step::Fail { reason, message }, vm) => fail(m, vm, reason, &message, ctx).await,
        (Step::Start { source }, Some(vm)) => start(m, vm, &source, ctx).await,
        (Step::Commit { target }, Some(vm)) => commit(m, vm, &target, ctx).await,
        (Step::MarkCommitted, Some(vm)) => {
            let mut mv = vm
                .status
                .as_ref()
                .and_then(|s| s.moving.clone())
                .unwrap_or_default();
            mv.phase = MovePhase::Committed;
            ctx.set_move(m, vm, Some(&mv)).await?;
            Ok(Action::requeue(RESYNC))
        }
        (Step::Abort { reason, message }, Some(vm)) => {
            let mut mv = vm
                .status
                .as_ref()
                .and_then(|s| s.moving.clone())
                .unwrap_or_default();
            mv.phase = MovePhase::Aborting;
            ctx.set_move(m, vm, Some(&mv)).await?;
            let st = status_with(
                m,
                MigrationPhase::Transferring,
                (ConditionStatus::False, ConditionReason::MoveFailed),
                &format!("{reason}: {message}; the VM resumes on {}", mv.source),
            );
            ctx.set_status(m, &st).await?;
            ctx.tell(
                m,
                Some(vm),
                true,
                "MigrationAborted",
                &format!("{reason}: {message}"),
            )
            .await;
            Ok(Action::requeue(RESYNC))
        }
        (Step::ClearAborted, Some(vm)) => {
            ctx.set_move(m, vm, None).await?;
            let why = m
                .status
                .as_ref()
                .and_then(|s| s.message.clone())
                .unwrap_or_else(|| "aborted".into());
            let st = status_with(
                m,
                MigrationPhase::Failed,
                (ConditionStatus::False, ConditionReason::MoveFailed),
                &why,
            );
            ctx.set_status(m, &st).await?;
            ctx.tell(m, Some(vm), true, "MigrationFailed", &why).await;
            ctx.finalizer(m, false).await?;
            Ok(Action::await_change())
        }
        (Step::Succeed, Some(vm)) => succeed(m, vm, ctx).await,
        (_, None) => Ok(Action::requeue(RESYNC)),
    }
}

/// Fails the migration (nothing of a move to undo) and tells why.
async fn fail(
    m: &ImpVMMigration,
    vm: Option<&ImpVM>,
    reason: &str,
    message: &str,
    ctx: &Ctx,
) -> Result<Action, Error> {
    let st = status_with(
        m,
        MigrationPhase::Failed,
        (ConditionStatus::False, ConditionReason::MoveFailed),
        message,
    );
    ctx.set_status(m, &st).await?;
    ctx.tell(
        m,
        vm,
        true,
        "MigrationFailed",
        &format!("{reason}: {message}"),
    )
    .await;
    ctx.finalizer(m, false).await?;
    Ok(Action::await_change())
}

/// Chooses and books the target, writes the move into the VM's status, then the migration's.
async fn start(m: &ImpVMMigration, vm: &ImpVM, source: &str, ctx: &Ctx) -> Result<Action, Error> {
    let target = match ctx.vms.book_move_target(vm, m.spec.target_node.as_deref()) {
        Ok(t) => t,
        Err(why) => return fail(m, Some(vm), decide::reason::TARGET_UNFIT, &why, ctx).await,
    };
    let (Some((endpoint, target_cert)), Some((_, source_cert))) =
        (ctx.vms.agent_of(&target), ctx.vms.agent_of(source))
    else {
        ctx.vms.unbook_move(vm);
        let why = format!(
            "the agents of {source} and {target} must both publish their API ({} and {} on their Nodes) to carry a move",
            imp_api::shared::ANNOTATION_AGENT_ENDPOINT,
            imp_api::shared::ANNOTATION_AGENT_CERT_SHA256
        );
        return fail(m, Some(vm), decide::reason::TARGET_UNFIT, &why, ctx).await;
    };
    if let Err(e) = ctx.finalizer(m, true).await {
        ctx.vms.unbook_move(vm);
        return Err(e);
    }
    let now = Timestamp::now();
    let mut mv = decide::new_move(m, source, &target, token(m, now), now);
    mv.target_endpoint = Some(endpoint);
    mv.target_cert_sha256 = Some(target_cert);
    mv.source_cert_sha256 = Some(source_cert);
    if let Err(e) = ctx.set_move(m, vm, Some(&mv)).await {
        ctx.vms.unbook_move(vm);
        return Err(e);
    }
    let mut st = status_with(
        m,
        MigrationPhase::Transferring,
        (ConditionStatus::False, ConditionReason::Moving),
        &format!(
            "moving from {source} to {target} (cold: suspended, its memory and disk sent, resumed there)"
        ),
    );
    st.selected_node = Some(target.clone());
    st.source_node = Some(source.to_owned());
    st.mode = Some(decide::MODE_COLD.to_owned());
    st.target_vm_name = Some(vm.name_any());
    ctx.set_status(m, &st).await?;
    ctx.tell(
        m,
        Some(vm),
        false,
        "MigrationStarted",
        &format!("moving {} from {source} to {target} (cold)", vm.name_any()),
    )
    .await;
    Ok(Action::requeue(RESYNC))
}

/// The commit: `spec.nodeName` from the source to the target, under the resourceVersion that
/// showed `Sent`; then the move is marked `Committed`.
async fn commit(m: &ImpVMMigration, vm: &ImpVM, target: &str, ctx: &Ctx) -> Result<Action, Error> {
    let body = json!({
        "metadata": {"resourceVersion": vm.resource_version()},
        "spec": {"nodeName": target},
    });
    let written = ctx
        .vms(m)
        .patch(&vm.name_any(), &params(), &Patch::Merge(&body))
        .await
        .map_err(failed("committing the move of the VM of", m))?;
    let mut mv = written
        .status
        .as_ref()
        .and_then(|s| s.moving.clone())
        .unwrap_or_default();
    mv.phase = MovePhase::Committed;
    ctx.set_move(m, &written, Some(&mv)).await?;
    let st = status_with(
        m,
        MigrationPhase::Restoring,
        (ConditionStatus::False, ConditionReason::Moving),
        &format!("committed to {target}: its agent resumes the VM"),
    );
    ctx.set_status(m, &st).await?;
    ctx.tell(
        m,
        Some(vm),
        false,
        "Committed",
        &format!("{} now belongs to node {target}", vm.name_any()),
    )
    .await;
    Ok(Action::requeue(RESYNC))
}

/// The VM runs on the target: the move is cleared and the migration says what it took.
async fn succeed(m: &ImpVMMigration, vm: &ImpVM, ctx: &Ctx) -> Result<Action, Error> {
    let now = Timestamp::now();
    let mv = vm.status.as_ref().and_then(|s| s.moving.clone());
    if mv.is_some() {
        ctx.set_move(m, vm, None).await?;
    }
    let target = vm.spec.node_name.clone().unwrap_or_default();
    let mut st = status_with(
        m,
        MigrationPhase::Succeeded,
        (ConditionStatus::True, ConditionReason::Moved),
        &format!("the VM runs on {target}"),
    );
    if let Some(mv) = &mv {
        st.downtime_ms = decide::downtime_ms(mv, now);
        st.bytes_moved = mv.bytes_sent;
    }
    st.total_ms = m
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| now.duration_since(t.0).as_millis() as i64);
    ctx.set_status(m, &st).await?;
    let downtime = st
        .downtime_ms
        .map_or_else(|| "unmeasured".to_owned(), |d| format!("{d} ms"));
    ctx.tell(
        m,
        Some(vm),
        false,
        "Moved",
        &format!("{} runs on {target}; downtime {downtime}", vm.name_any()),
    )
    .await;
    ctx.finalizer(m, false).await?;
    Ok(Action::await_change())
}

fn error_policy(m: Arc<ImpVMMigration>, err: &Error, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(migration = %key(&m), error = %crate::chain::DisplayChain(err), "migration reconcile failed");
    Action::requeue(RETRY)
}

/// Runs the ImpVMMigration controller until `shutdown` completes: a migration is reconciled
/// when it changes and when its VM's move does.
pub async fn run(
    client: kube::Client,
    vms: Arc<crate::vm::Context>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        recorder: vms.recorder(),
        vms,
    });
    Controller::new(
        Api::<ImpVMMigration>::all(client.clone()),
        watcher::Config::default(),
    )
    .watches(
        Api::<ImpVM>::all(client),
        watcher::Config::default(),
        |vm: ImpVM| {
            let ns = vm.namespace().unwrap_or_default();
            vm.status
                .as_ref()
                .and_then(|s| s.moving.as_ref())
                .map(|mv| ObjectRef::new(&mv.migration).within(&ns))
        },
    )
    .graceful_shutdown_on(shutdown)
    .run(reconcile, error_policy, ctx)
    .for_each(|r| async move {
        if let Err(e) = r {
            tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "migration controller event");
        }
    })
    .await;
}
