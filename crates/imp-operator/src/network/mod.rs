//! The ImpNetwork controller: group CIDRs, the VTEP table, the Ready condition, collection of
//! addresses whose VM is gone, and the finalizer that keeps a deleted network (and so its
//! allocation table) until its last VM has released its address.
//!
//! The operator is the only writer of ImpNetwork status. Every write runs under the network's
//! [`Ipam`] lock, on a fresh read, with a resourceVersion precondition, so it never races an
//! allocation. It watches ImpVMs and Nodes so the VTEP table follows placements and node
//! addresses, and every network so an overlap is re-judged when another network changes.

pub mod status;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::conditions::{self, ConditionType};
use imp_api::network::ImpNetwork;
use imp_api::shared::FINALIZER_NETWORK;
use imp_api::vm::ImpVM;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::ipam::{self, Ipam, allocator, network_key, pool};
use crate::metrics::{Metrics, Write};
use crate::names;

/// Finalizer that keeps an ImpNetwork until no VM holds an address on it.
pub const FINALIZER: &str = "imp.dev/network-addresses";

/// What can go wrong in one network reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The allocation table could not be read or written.
    #[error(transparent)]
    Ipam(#[from] ipam::Error),
    /// Another API call failed.
    #[error("Kubernetes API call failed while {doing} {what}")]
    Kube {
        /// What was being done.
        doing: &'static str,
        /// To what.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

struct Ctx {
    client: kube::Client,
    ipam: Arc<Ipam>,
    networks: Store<ImpNetwork>,
    vms: Store<ImpVM>,
    nodes: Store<Node>,
    recorder: Recorder,
    metrics: Option<Arc<Metrics>>,
    resync: Duration,
}

fn kube_err(doing: &'static str, what: String) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Kube {
        doing,
        what,
        source,
    }
}

impl Ctx {
    fn vm(&self, owner: &str) -> Option<Arc<ImpVM>> {
        let (ns, name) = owner.split_once('/')?;
        self.vms.get(&ObjectRef::new(name).within(ns))
    }

    /// Owners in `net`'s table whose VM no longer exists (a cache miss is confirmed by a read,
    /// since the cache may not show a VM created a moment ago yet).
    async fn gone_owners(&self, net: &ImpNetwork) -> Result<Vec<String>, Error> {
        let mut gone = Vec::new();
        let table = net.status.clone().unwrap_or_default().allocations;
        for owner in table.values() {
            if self.vm(owner).is_some() {
                continue;
            }
            let Some((ns, name)) = owner.split_once('/') else {
                gone.push(owner.clone());
                continue;
            };
            let found = Api::<ImpVM>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await
                .map_err(kube_err(
                    "looking up the VM holding an address",
                    owner.clone(),
                ))?;
            if found.is_none() {
                gone.push(owner.clone());
            }
        }
        Ok(gone)
    }

    fn desired(&self, net: &ImpNetwork) -> (imp_api::network::ImpNetworkStatus, status::Readiness) {
        let all = self.networks.state();
        let others: Vec<&ImpNetwork> = all.iter().map(AsRef::as_ref).collect();
        let ready = status::readiness(net, &others);
        let table = net.status.clone().unwrap_or_default().allocations;
        let vtep = status::vtep_table(
            &table,
            |owner| self.vm(owner)?.spec.node_name.clone(),
            |node| status::node_address(self.nodes.get(&ObjectRef::new(node))?.as_ref()),
        );
        (status::desired(net, &ready, vtep, Timestamp::now()), ready)
    }

    fn needs_work(&self, net: &ImpNetwork) -> bool {
        let (want, _) = self.desired(net);
        let table = net.status.clone().unwrap_or_default().allocations;
        let orphan = table.values().any(|o| self.vm(o).is_none());
        let fin = net.finalizers().iter().any(|f| f == FINALIZER);
        let deleting = net.meta().deletion_timestamp.is_some();
        !same(net.status.as_ref(), &want) || orphan || fin == deleting
    }

    async fn event(&self, net: &ImpNetwork, warning: bool, reason: &str, note: String) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_owned(),
            note: Some(note),
            action: reason.to_owned(),
            secondary: None,
        };
        crate::api_call::publish(&self.recorder, &ev, &net.object_ref(&())).await;
    }

    /// Counts a write of an ImpNetwork refused with 409.
    fn conflict(&self, write: Write) {
        if let Some(m) = &self.metrics {
            m.conflict(ipam::CONFLICT_RESOURCE, write);
        }
    }

    async fn set_finalizers(&self, net: &ImpNetwork, fins: Vec<String>) -> Result<(), Error> {
        let body =
            json!({"metadata": {"finalizers": fins, "resourceVersion": net.resource_version()}});
        let params = PatchParams {
            field_manager: Some(crate::FIELD_MANAGER.to_owned()),
            ..Default::default()
        };
        match Api::<ImpNetwork>::namespaced(
            self.client.clone(),
            &net.namespace().unwrap_or_default(),
        )
        .patch(&net.name_any(), &params, &Patch::Merge(&body))
        .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                self.conflict(Write::Main);
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(kube_err("writing the finalizers of", network_key(net))(e)),
        }
    }
}

/// Whether two statuses agree, ignoring condition timestamps.
fn same(
    current: Option<&imp_api::network::ImpNetworkStatus>,
    want: &imp_api::network::ImpNetworkStatus,
) -> bool {
    let cur = current.cloned().unwrap_or_default();
    let strip = |s: &imp_api::network::ImpNetworkStatus| {
        let mut s = s.clone();
        for c in &mut s.conditions {
            c.last_transition_time =
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH);
        }
        s
    };
    strip(&cur) == strip(want)
}

async fn reconcile(cached: Arc<ImpNetwork>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if let Some(m) = &ctx.metrics {
        m.reconcile(names::NETWORK_CONTROLLER);
    }
    let requeue = Action::requeue(ctx.resync);
    if !ctx.needs_work(&cached) {
        return Ok(requeue);
    }
    let key = network_key(&cached);
    let (ns, name) = (cached.namespace().unwrap_or_default(), cached.name_any());
    let _guard = ctx.ipam.lock(&key).await;
    let api = Api::<ImpNetwork>::namespaced(ctx.client.clone(), &ns);
    let read = async || {
        api.get_opt(&name)
            .await
            .map_err(kube_err("reading", key.clone()))
    };
    let Some(mut net) = read().await? else {
        return Ok(Action::await_change());
    };
    let gone = ctx.gone_owners(&net).await?;
    if !gone.is_empty() {
        tracing::info!(network = %key, vms = ?gone, "collecting addresses of deleted VMs");
        ctx.ipam.release_locked(&ns, &name, &gone).await?;
        match read().await? {
            Some(n) => net = n,
            None => return Ok(Action::await_change()),
        }
    }
    let table = net.status.clone().unwrap_or_default().allocations;
    if net.meta().deletion_timestamp.is_some() {
        if table.is_empty() {
            let fins = net
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER && *f != FINALIZER_NETWORK)
                .cloned()
                .collect();
            ctx.set_finalizers(&net, fins).await?;
            tracing::info!(network = %key, "no address left; released");
            return Ok(Action::await_change());
        }
        tracing::info!(network = %key, held = table.len(), "deleted; waiting for its VMs to release their addresses");
        return Ok(Action::requeue(ctx.resync.min(Duration::from_secs(5))));
    }
    if !net.finalizers().iter().any(|f| f == FINALIZER) {
        let mut fins = net.finalizers().to_vec();
        fins.push(FINALIZER.to_owned());
        ctx.set_finalizers(&net, fins).await?;
        // The write's watch event reconciles again, on the new version.
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let (want, ready) = ctx.desired(&net);
    let before = net.status.clone().unwrap_or_default();
    if !same(Some(&before), &want) {
        match ipam::write_status(&ctx.client, &net, &want, "writing the status of").await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                ctx.conflict(Write::Status);
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            Err(e) => return Err(kube_err("writing the status of", key)(e)),
        }
        let was = conditions::find(&before.conditions, ConditionType::Ready);
        if was.is_none_or(|c| c.reason != ready.reason.as_str() || c.message != ready.message) {
            tracing::info!(network = %key, ready = ready.ok, reason = ready.reason.as_str(), message = %ready.message, "network condition");
            ctx.event(
                &net,
                !ready.ok,
                ready.reason.as_str(),
                ready.message.clone(),
            )
            .await;
        }
    }
    if let (Some(m), Ok(p)) = (
        &ctx.metrics,
        pool::source_for(&net.spec).and_then(|s| s.pool(&net.spec, None)),
    ) {
        m.set_ipam(&key, table.len() as u64, allocator::free(&p, &table));
    }
    Ok(requeue)
}

fn error_policy(net: Arc<ImpNetwork>, err: &Error, ctx: Arc<Ctx>) -> Action {
    tracing::warn!(network = %network_key(&net), error = %err, source = ?std::error::Error::source(err), "network reconcile failed");
    if let Some(m) = &ctx.metrics {
        m.reconcile_error(names::NETWORK_CONTROLLER, "api");
    }
    Action::requeue(Duration::from_secs(2))
}

fn all(store: &Store<ImpNetwork>) -> Vec<ObjectRef<ImpNetwork>> {
    store
        .state()
        .iter()
        .map(|n| ObjectRef::from_obj(n.as_ref()))
        .collect()
}

/// Runs the ImpNetwork controller until `shutdown` completes.
pub async fn run(
    client: kube::Client,
    ipam: Arc<Ipam>,
    metrics: Option<Arc<Metrics>>,
    instance: Option<String>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let wc = watcher::Config::default();
    let (vms, vm_writer) = reflector::store::<ImpVM>();
    let vm_stream = reflector::reflector(
        vm_writer,
        watcher(Api::<ImpVM>::all(client.clone()), wc.clone()),
    )
    .default_backoff()
    .touched_objects();
    let (nodes, node_writer) = reflector::store::<Node>();
    let node_stream = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), wc.clone()),
    )
    .default_backoff()
    .touched_objects();
    let controller = Controller::new(Api::<ImpNetwork>::all(client.clone()), wc.clone());
    let networks = controller.store();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        ipam,
        networks: networks.clone(),
        vms,
        nodes,
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: crate::FIELD_MANAGER.to_owned(),
                instance,
            },
        ),
        metrics,
        resync: Duration::from_secs(60),
    });
    let (n1, n2, n3) = (networks.clone(), networks.clone(), networks);
    let on_vm = move |vm: ImpVM| {
        let ns = vm.namespace();
        n1.state()
            .iter()
            .filter(|n| n.namespace() == ns)
            .map(|n| ObjectRef::from_obj(n.as_ref()))
            .collect::<Vec<_>>()
    };
    controller
        .watches_stream(vm_stream, on_vm)
        .watches_stream(node_stream, move |_| all(&n2))
        .watches(Api::<ImpNetwork>::all(client), wc, move |_| all(&n3))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "network controller event");
            }
        })
        .await;
}
