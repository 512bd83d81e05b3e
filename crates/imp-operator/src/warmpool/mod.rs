//! The ImpWarmPool controller: keeps `size` members, ImpVMs restored from the parent
//! snapshot's elected base, running ([docs/warm-pools.md](../../../../docs/warm-pools.md)).
//!
//! One reconcile of a pool reads its parent ImpVMSnapshot and its ImpVMTemplate (both in the
//! pool's namespace: a pool names nothing of another), lists its members from the API (a
//! consistent list by label, so a member created a moment ago is never missed and never made
//! twice), reads the nodes they run on, asks the pure [`decide::plan`] and applies it:
//! deletions (each preconditioned on the member's resourceVersion), creations, the status (a
//! merge patch of what changed, preconditioned on the pool's resourceVersion), then Events.
//!
//! Members are ordinary ImpVMs, placed, started, expired and reported by the VM controller and
//! the node agents like any VM restored from a snapshot; the pool is their controlling owner,
//! so deleting it deletes them. A create a quota refuses leaves the pool `QuotaExceeded`
//! quoting the API server. Claims (`ImpVM.spec.warmPoolRef`) are not built yet: the webhook and
//! the VM controller refuse them (`imp_api::unsupported::WARM_CLAIM`).

pub mod claim;
pub mod decide;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::conditions::{self, ConditionReason, ConditionStatus, ConditionType};
use imp_api::refusal;
use imp_api::shared::{LABEL_CLAIMED_FROM, LABEL_SNAPSHOT_PARENT, LABEL_WARM_POOL};
use imp_api::snapshot::ImpVMSnapshot;
use imp_api::template::ImpVMTemplate;
use imp_api::vm::ImpVM;
use imp_api::{ImpWarmPool, pools::ImpWarmPoolStatus};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;

use self::decide::{Note, Plan, World};
use crate::FIELD_MANAGER;
use crate::api_call::params;
use crate::metrics::{Metrics, Write};
use crate::names;

/// The resource label of this controller's writes in `imp_operator_conflicts_total`.
const CONFLICT_RESOURCE: &str = "impwarmpool";

/// A pool is looked at again at least this often (a safety net: the watches do the work).
const RESYNC: Duration = Duration::from_secs(60);

/// Requeue after a failed reconcile.
const RETRY: Duration = Duration::from_secs(5);

/// Requeue after a write refused with 409.
const CONFLICT_RETRY: Duration = Duration::from_millis(200);

/// What can go wrong in one reconcile: an API call.
pub type Error = crate::api_call::Error;

fn kube_err(doing: &'static str, pool: &ImpWarmPool) -> impl FnOnce(kube::Error) -> Error {
    crate::api_call::failed(doing, "ImpWarmPool", key(pool))
}

fn key(p: &ImpWarmPool) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
}

struct Ctx {
    client: kube::Client,
    recorder: Recorder,
    metrics: Option<Arc<Metrics>>,
}

/// Why a Node should hold no member, or `None` when it may: not Ready, or cordoned.
pub fn unusable(node: &Node) -> Option<String> {
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Some("cordoned".into());
    }
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => None,
        Some(c) => Some(format!(
            "not Ready ({})",
            c.reason.as_deref().unwrap_or("no reason")
        )),
        None => Some("not Ready (no Ready condition)".into()),
    }
}

impl Ctx {
    async fn event(&self, pool: &ImpWarmPool, note: &Note) {
        if note.warning {
            tracing::warn!(pool = %key(pool), reason = note.reason, message = %note.message, "warm pool");
        } else {
            tracing::info!(pool = %key(pool), reason = note.reason, message = %note.message, "warm pool");
        }
        let ev = crate::api_call::event::<ImpVM>(
            note.warning,
            note.reason,
            &note.message,
            note.member.as_deref(),
            pool.namespace(),
        );
        crate::api_call::publish(&self.recorder, &ev, &pool.object_ref(&())).await;
    }

    /// Event `note` on member `member` itself.
    async fn member_event(&self, member: &ImpVM, note: &Note) {
        let ev =
            crate::api_call::event::<ImpVM>(note.warning, note.reason, &note.message, None, None);
        crate::api_call::publish(&self.recorder, &ev, &member.object_ref(&())).await;
    }

    /// Reads what [`decide::plan`] needs besides the pool: the parent, the template, the
    /// members and the nodes they are on.
    async fn read(&self, pool: &ImpWarmPool) -> Result<Read, Error> {
        let ns = pool.namespace().unwrap_or_default();
        let snapshots: Api<ImpVMSnapshot> = Api::namespaced(self.client.clone(), &ns);
        let parent = snapshots
            .get_opt(&pool.spec.snapshot_ref)
            .await
            .map_err(kube_err("reading the parent snapshot of", pool))?;
        let templates: Api<ImpVMTemplate> = Api::namespaced(self.client.clone(), &ns);
        let template = templates
            .get_opt(&pool.spec.template_name)
            .await
            .map_err(kube_err("reading the template of", pool))?;
        // A name too long to be a label value labels no member (the plan says so).
        let (members, claimants) = if pool.name_any().len() <= 63 {
            let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), &ns);
            let list = |label: &str| {
                let selector = format!("{label}={}", pool.name_any());
                let vms = vms.clone();
                async move { vms.list(&ListParams::default().labels(&selector)).await }
            };
            let members = list(LABEL_WARM_POOL)
                .await
                .map_err(kube_err("listing the members of", pool))?
                .items;
            let claimants = list(LABEL_CLAIMED_FROM)
                .await
                .map_err(kube_err("listing the claimants of", pool))?
                .items;
            (members, claimants)
        } else {
            (Vec::new(), Vec::new())
        };
        let mut unusable_nodes = BTreeMap::new();
        let nodes: Api<Node> = Api::all(self.client.clone());
        let on: std::collections::BTreeSet<String> = members
            .iter()
            .filter_map(|m| m.status.as_ref()?.node_name.clone())
            .collect();
        for name in on {
            let why = match nodes
                .get_opt(&name)
                .await
                .map_err(kube_err("reading a member's node for", pool))?
            {
                Some(node) => unusable(&node),
                None => Some("gone".into()),
            };
            if let Some(why) = why {
                unusable_nodes.insert(name, why);
            }
        }
        Ok(Read {
            parent,
            template,
            members,
            claimants,
            unusable_nodes,
        })
    }

    /// Applies `plan`; `Ok(false)` when the status write was refused with 409 (decide again).
    async fn apply(&self, pool: &ImpWarmPool, mut plan: Plan) -> Result<bool, Error> {
        let ns = pool.namespace().unwrap_or_default();
        let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), &ns);
        for d in &plan.delete {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: d.resource_version.clone(),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            match vms.delete(&d.name, &dp).await {
                Ok(deleted) => {
                    self.event(pool, &d.note).await;
                    // The member itself says which VM it became (its last Event).
                    if d.note.reason == decide::reason::CLAIMED
                        && let Some(member) = deleted.left()
                    {
                        self.member_event(&member, &d.note).await;
                    }
                }
                // Gone already, or changed since it was judged: the next reconcile sees it.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => return Err(kube_err("deleting a member of", pool)(e)),
            }
        }
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..Default::default()
        };
        for member in &plan.create {
            match vms.create(&pp, member).await {
                Ok(made) => {
                    let name = made.name_any();
                    let note = Note {
                        warning: false,
                        reason: decide::reason::MEMBER_CREATED,
                        message: format!(
                            "created member {name}, restoring from {}",
                            member.spec.snapshot_ref.as_deref().unwrap_or_default()
                        ),
                        member: Some(name),
                    };
                    self.event(pool, &note).await;
                }
                Err(kube::Error::Api(s)) if refusal::quota(&s).is_some() => {
                    quota_refused(&mut plan.status, pool, &s.message);
                    break;
                }
                Err(e) => return Err(kube_err("creating a member of", pool)(e)),
            }
        }
        let old = pool.status.clone().unwrap_or_default();
        if let Some(diff) = imp_api::status_patch::diff(&old, &plan.status) {
            let body = json!({
                "metadata": {"resourceVersion": pool.resource_version()},
                "status": diff,
            });
            let api: Api<ImpWarmPool> = Api::namespaced(self.client.clone(), &ns);
            match api
                .patch_status(&pool.name_any(), &params(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    if let Some(m) = &self.metrics {
                        m.conflict(CONFLICT_RESOURCE, Write::Status);
                    }
                    return Ok(false);
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(true),
                Err(e) => return Err(kube_err("writing the status of", pool)(e)),
            }
        }
        for note in &plan.notes {
            self.event(pool, note).await;
        }
        Ok(true)
    }
}

/// What one reconcile read.
struct Read {
    parent: Option<ImpVMSnapshot>,
    template: Option<ImpVMTemplate>,
    members: Vec<ImpVM>,
    claimants: Vec<ImpVM>,
    unusable_nodes: BTreeMap<String, String>,
}

/// Sets `Ready=False QuotaExceeded` with the API server's `message` on `status`.
fn quota_refused(status: &mut ImpWarmPoolStatus, pool: &ImpWarmPool, message: &str) {
    tracing::warn!(pool = %key(pool), message, "a quota refused a new member");
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        ConditionReason::QuotaExceeded,
        format!("a new member was refused: {message}"),
        pool.meta().generation,
        Time(Timestamp::now()),
    );
}

fn requeue(plan: &Plan, now: Timestamp) -> Action {
    let wait = plan
        .requeue_at
        .and_then(|at| Duration::try_from(at.duration_since(now)).ok())
        .map_or(RESYNC, |d| (d + Duration::from_millis(20)).min(RESYNC));
    Action::requeue(wait)
}

async fn reconcile(cached: Arc<ImpWarmPool>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if let Some(m) = &ctx.metrics {
        m.reconcile(names::WARMPOOL_CONTROLLER);
    }
    // A pool being deleted takes its members with it (the garbage collector).
    if cached.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let api: Api<ImpWarmPool> =
        Api::namespaced(ctx.client.clone(), &cached.namespace().unwrap_or_default());
    let mut pool = (*cached).clone();
    for _ in 0..3 {
        let read = ctx.read(&pool).await?;
        let now = Timestamp::now();
        let world = World {
            parent: read.parent.as_ref(),
            template: read.template.as_ref(),
            members: &read.members,
            claimants: &read.claimants,
            unusable_nodes: &read.unusable_nodes,
            now,
        };
        let plan = decide::plan(&pool, &world);
        if let Some(m) = &ctx.metrics {
            m.set_pool(&key(&pool), plan.status.ready_count, pool.spec.size);
        }
        let action = requeue(&plan, now);
        if ctx.apply(&pool, plan).await? {
            return Ok(action);
        }
        tokio::time::sleep(CONFLICT_RETRY).await;
        match api
            .get_opt(&pool.name_any())
            .await
            .map_err(kube_err("re-reading", &pool))?
        {
            Some(p) => pool = p,
            None => return Ok(Action::await_change()),
        }
    }
    Ok(Action::requeue(CONFLICT_RETRY))
}

fn error_policy(pool: Arc<ImpWarmPool>, err: &Error, ctx: Arc<Ctx>) -> Action {
    tracing::warn!(pool = %key(&pool), error = %crate::chain::DisplayChain(err), "warm pool reconcile failed");
    if let Some(m) = &ctx.metrics {
        m.reconcile_error(names::WARMPOOL_CONTROLLER, err.metric_label());
    }
    Action::requeue(RETRY)
}

/// The pools of `store` in namespace `ns` that `pick` selects.
fn pools_where(
    store: &Store<ImpWarmPool>,
    ns: Option<String>,
    pick: impl Fn(&ImpWarmPool) -> bool,
) -> Vec<ObjectRef<ImpWarmPool>> {
    store
        .state()
        .iter()
        .filter(|p| ns.is_none() || p.namespace() == ns)
        .filter(|p| pick(p))
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// Every half minute, drops the metrics of pools no longer in `store` (deleted ones are not
/// reconciled again), until the controller ends.
async fn forget_deleted_pools(metrics: Arc<Metrics>, store: Store<ImpWarmPool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    loop {
        tick.tick().await;
        let pools = store.state().iter().map(|p| key(p)).collect();
        metrics.keep_pools(&pools);
    }
}

/// Runs the ImpWarmPool controller until `shutdown` completes: a pool is reconciled when it,
/// one of its members, its parent snapshot, its template or a Node changes.
pub async fn run(
    client: kube::Client,
    metrics: Option<Arc<Metrics>>,
    instance: Option<String>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.to_owned(),
                instance,
            },
        ),
        metrics,
    });
    let controller = Controller::new(
        Api::<ImpWarmPool>::all(client.clone()),
        watcher::Config::default(),
    );
    let store = controller.store();
    let (by_snapshot, by_template, any) = (store.clone(), store.clone(), store.clone());
    let forgetting = ctx
        .metrics
        .clone()
        .map(|m| tokio::spawn(forget_deleted_pools(m, store)));
    controller
        .owns(
            Api::<ImpVM>::all(client.clone()),
            watcher::Config::default().labels(LABEL_WARM_POOL),
        )
        .watches(
            Api::<ImpVM>::all(client.clone()),
            watcher::Config::default().labels(LABEL_CLAIMED_FROM),
            |vm: ImpVM| {
                let ns = vm.namespace().unwrap_or_default();
                vm.labels()
                    .get(LABEL_CLAIMED_FROM)
                    .map(|p| ObjectRef::new(p).within(&ns))
            },
        )
        .watches(
            Api::<ImpVMSnapshot>::all(client.clone()),
            watcher::Config::default().labels(&format!("!{LABEL_SNAPSHOT_PARENT}")),
            move |s: ImpVMSnapshot| {
                pools_where(&by_snapshot, s.namespace(), |p| {
                    p.spec.snapshot_ref == s.name_any()
                })
            },
        )
        .watches(
            Api::<ImpVMTemplate>::all(client.clone()),
            watcher::Config::default(),
            move |t: ImpVMTemplate| {
                pools_where(&by_template, t.namespace(), |p| {
                    p.spec.template_name == t.name_any()
                })
            },
        )
        .watches(
            Api::<Node>::all(client),
            watcher::Config::default(),
            move |_: Node| pools_where(&any, None, |_| true),
        )
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "warm pool controller event");
            }
        })
        .await;
    if let Some(f) = forgetting {
        f.abort();
    }
}
