//! What the ImpVM controller watches, and which VMs each change concerns.
//!
//! The caches ([`Store`]s) feed decisions; the VM watch feeds the ledger; the mappers turn a
//! change of a Node, class, template, network, cluster config, node profile or Pod into the VMs
//! to reconcile again.

use std::sync::Arc;
use std::time::Duration;

use std::sync::Mutex;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use imp_api::class::ImpVMClass;
use imp_api::cluster::{ClusterImpConfig, ClusterImpNodeProfile};
use imp_api::network::ImpNetwork;
use imp_api::template::ImpVMTemplate;
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;

use super::backlog::Tracker;
use super::world::{observe, resized};
use super::{key, phase_counts};
use crate::metrics::Metrics;
use crate::placement::fencing::{AgentLeases, Trust, Verdict};
use crate::placement::ledger::Ledger;

/// The objects of one kind a watch sees change.
pub(super) type Changes<K> = BoxStream<'static, Result<K, watcher::Error>>;

/// The caches of the kinds a VM's decision reads besides ImpVMs.
pub(super) struct Stores {
    pub(super) nodes: Store<Node>,
    pub(super) classes: Store<ImpVMClass>,
    pub(super) templates: Store<ImpVMTemplate>,
    pub(super) networks: Store<ImpNetwork>,
    pub(super) configs: Store<ClusterImpConfig>,
    pub(super) profiles: Store<ClusterImpNodeProfile>,
    /// Pods that are not finished, for what they request of their nodes.
    pub(super) pods: Store<Pod>,
}

/// What the watches behind [`Stores`] see change, for the controller to map to VMs.
pub(super) struct Streams {
    nodes: Changes<Node>,
    classes: Changes<ImpVMClass>,
    templates: Changes<ImpVMTemplate>,
    networks: Changes<ImpNetwork>,
    configs: Changes<ClusterImpConfig>,
    profiles: Changes<ClusterImpNodeProfile>,
    pods: Changes<Pod>,
}

/// A cache of every `K` and the objects its watch sees change (the watch runs while the stream
/// is polled).
fn cache<K>(api: Api<K>, wc: &watcher::Config) -> (Store<K>, Changes<K>)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let (reader, writer) = reflector::store::<K>();
    let stream = reflector::reflector(writer, watcher(api, wc.clone()))
        .default_backoff()
        .touched_objects()
        .boxed();
    (reader, stream)
}

/// The caches of every kind besides ImpVMs that decisions read, and their change streams.
pub(super) fn kinds(client: &kube::Client, wc: &watcher::Config) -> (Stores, Streams) {
    let (nodes, node_stream) = cache(Api::<Node>::all(client.clone()), wc);
    let (classes, class_stream) = cache(Api::<ImpVMClass>::all(client.clone()), wc);
    let (templates, template_stream) = cache(Api::<ImpVMTemplate>::all(client.clone()), wc);
    let (networks, network_stream) = cache(Api::<ImpNetwork>::all(client.clone()), wc);
    let (configs, config_stream) = cache(Api::<ClusterImpConfig>::all(client.clone()), wc);
    let (profiles, profile_stream) = cache(Api::<ClusterImpNodeProfile>::all(client.clone()), wc);
    let (pods, pod_stream) = pods(client, wc);
    let stores = Stores {
        nodes,
        classes,
        templates,
        networks,
        configs,
        profiles,
        pods,
    };
    let streams = Streams {
        nodes: node_stream,
        classes: class_stream,
        templates: template_stream,
        networks: network_stream,
        configs: config_stream,
        profiles: profile_stream,
        pods: pod_stream.boxed(),
    };
    (stores, streams)
}

/// The VM cache and its stream: the watch feeds `ledger` as the cache takes each event in (so
/// per-node usage never needs a scan of every VM), notifies `changed` (the reservation sync),
/// and marks each VM it hands on waiting in `backlog`.
pub(super) fn vms(
    client: &kube::Client,
    wc: &watcher::Config,
    ledger: &Arc<Mutex<Ledger>>,
    stores: &Stores,
    backlog: &Arc<Tracker>,
    changed: Arc<Notify>,
) -> (
    Store<ImpVM>,
    impl Stream<Item = Result<ImpVM, watcher::Error>> + Send + use<>,
) {
    let (vms, writer) = reflector::store::<ImpVM>();
    let (ledger, classes, templates) = (
        ledger.clone(),
        stores.classes.clone(),
        stores.templates.clone(),
    );
    let backlog = backlog.clone();
    let stream = reflector::reflector(
        writer,
        watcher(Api::<ImpVM>::all(client.clone()), wc.clone()),
    )
    .map_ok(move |event| {
        observe(&ledger, &classes, &templates, &event);
        changed.notify_one();
        event
    })
    .applied_objects()
    .inspect_ok(move |vm| backlog.triggered(&key(vm)));
    (vms, stream)
}

/// `controller` also reconciling the VMs each change of `streams` concerns, each marked
/// waiting in `backlog`; class and template changes make `ledger` look sizes up again.
pub(super) fn related(
    controller: Controller<ImpVM>,
    streams: Streams,
    vms: &Store<ImpVM>,
    backlog: &Arc<Tracker>,
    ledger: &Arc<Mutex<Ledger>>,
) -> Controller<ImpVM> {
    let classes = streams.classes.inspect(resized(ledger.clone()));
    let templates = streams.templates.inspect(resized(ledger.clone()));
    let b = || backlog.clone();
    controller
        .watches_stream(streams.nodes, tracked(b(), on_node(vms.clone())))
        .watches_stream(classes, tracked(b(), on_class(vms.clone())))
        .watches_stream(templates, tracked(b(), on_template(vms.clone())))
        .watches_stream(streams.networks, tracked(b(), on_network(vms.clone())))
        .watches_stream(streams.configs, tracked(b(), all_unplaced(vms.clone())))
        .watches_stream(streams.profiles, tracked(b(), all_unplaced(vms.clone())))
        // A Pod that comes, goes or finishes changes what its node has left for VMs.
        .watches_stream(streams.pods, tracked(b(), all_unplaced(vms.clone())))
}

/// `map`, marking every VM it returns waiting in `backlog`.
fn tracked<T>(backlog: Arc<Tracker>, map: impl Fn(T) -> Refs) -> impl Fn(T) -> Refs {
    move |obj| {
        let refs = map(obj);
        for r in &refs {
            backlog.triggered(&format!(
                "{}/{}",
                r.namespace.as_deref().unwrap_or_default(),
                r.name
            ));
        }
        refs
    }
}

type Refs = Vec<ObjectRef<ImpVM>>;

fn refs<'a>(vms: impl Iterator<Item = &'a Arc<ImpVM>>) -> Refs {
    vms.map(|vm| ObjectRef::from_obj(vm.as_ref())).collect()
}

/// A Node's VMs, and every unplaced VM (the node may fit them now).
pub(super) fn on_node(vms: Store<ImpVM>) -> impl Fn(Node) -> Refs {
    move |n| {
        let name = n.name_any();
        let state = vms.state();
        refs(state.iter().filter(|vm| {
            vm.spec.node_name.is_none() || vm.spec.node_name.as_deref() == Some(&name)
        }))
    }
}

/// The VMs of a class: by `classRef`, and every VM with a template (which may name it).
pub(super) fn on_class(vms: Store<ImpVM>) -> impl Fn(ImpVMClass) -> Refs {
    move |c| {
        let name = c.name_any();
        let state = vms.state();
        refs(state.iter().filter(|vm| {
            vm.spec.class_ref.as_ref().is_some_and(|r| r.name == name)
                || vm.spec.template_ref.is_some()
        }))
    }
}

/// The VMs of a template, in its namespace.
pub(super) fn on_template(vms: Store<ImpVM>) -> impl Fn(ImpVMTemplate) -> Refs {
    move |t| {
        let (name, ns) = (t.name_any(), t.namespace());
        let state = vms.state();
        refs(state.iter().filter(|vm| {
            vm.namespace() == ns
                && vm
                    .spec
                    .template_ref
                    .as_ref()
                    .is_some_and(|r| r.name == name)
        }))
    }
}

/// The unplaced VMs of a network's namespace (they may get an address now).
pub(super) fn on_network(vms: Store<ImpVM>) -> impl Fn(ImpNetwork) -> Refs {
    move |n| {
        let ns = n.namespace();
        let state = vms.state();
        refs(
            state
                .iter()
                .filter(|vm| vm.namespace() == ns && vm.spec.node_name.is_none()),
        )
    }
}

/// Every unplaced VM (a cluster setting, a profile, or what a node's Pods leave changed).
pub(super) fn all_unplaced<T>(vms: Store<ImpVM>) -> impl Fn(T) -> Refs {
    move |_| {
        let state = vms.state();
        refs(state.iter().filter(|v| v.spec.node_name.is_none()))
    }
}

/// Unfinished Pods, for what they request of their nodes.
fn pods(
    client: &kube::Client,
    wc: &watcher::Config,
) -> (
    Store<Pod>,
    impl futures::Stream<Item = Result<Pod, watcher::Error>> + Send + use<>,
) {
    let (reader, writer) = reflector::store::<Pod>();
    let cfg = wc
        .clone()
        .fields("status.phase!=Succeeded,status.phase!=Failed");
    let stream = reflector::reflector(writer, watcher(Api::<Pod>::all(client.clone()), cfg))
        .default_backoff()
        .touched_objects();
    (reader, stream)
}

/// The reservation Pods of VMs, finished ones too (a kubelet that refused one marks it
/// Failed); `changed` is notified on every change. The watch runs on a task of its own.
pub(super) fn reservation_pods(
    client: &kube::Client,
    wc: &watcher::Config,
    changed: Arc<Notify>,
) -> Store<Pod> {
    let (reader, writer) = reflector::store::<Pod>();
    let cfg = wc.clone().labels(&format!(
        "{}=true",
        crate::placement::reservation::LABEL_RESERVATION
    ));
    let stream = reflector::reflector(writer, watcher(Api::<Pod>::all(client.clone()), cfg))
        .default_backoff()
        .touched_objects()
        .for_each(move |_| {
            changed.notify_one();
            futures::future::ready(())
        });
    tokio::spawn(stream);
    reader
}

/// When each node's agent was last seen renewing its Lease, kept by a watch on a task of its
/// own. Only the agents' namespace is watched ([`Trust::namespace`]); a Lease the bookkeeping
/// ignores anyway (a holder that does not match its name, a duration out of range) is logged
/// once and counted in `imp_operator_agent_leases_ignored_total`.
pub(super) fn agent_leases(
    client: &kube::Client,
    wc: &watcher::Config,
    trust: Trust,
    metrics: Option<Arc<Metrics>>,
) -> Arc<std::sync::Mutex<AgentLeases>> {
    let namespace = trust.namespace.clone();
    let leases = Arc::new(std::sync::Mutex::new(AgentLeases::new(trust)));
    let kept = leases.clone();
    let cfg = wc
        .clone()
        .labels(&format!("{}=true", imp_api::shared::LABEL_AGENT_LEASE));
    let watch = watcher(Api::<Lease>::namespaced(client.clone(), &namespace), cfg)
        .default_backoff()
        .for_each(move |event| {
            let mut l = kept
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = std::time::Instant::now();
            match event {
                Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                    if let Verdict::Ignored { why, detail, first } = l.observe(&lease, now) {
                        if let Some(m) = &metrics {
                            m.agent_lease_ignored(why.as_str());
                        }
                        if first {
                            tracing::warn!(
                                lease = %format!("{}/{}", lease.namespace().unwrap_or_default(), lease.name_any()),
                                reason = why.as_str(),
                                %detail,
                                "an agent Lease is ignored: it renews nothing and moves no VM"
                            );
                        }
                    }
                }
                Ok(watcher::Event::Delete(lease)) => l.forget(&lease),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %imp_api::chain::DisplayChain(&e), namespace = %namespace, "watching the agents' Leases"),
            }
            futures::future::ready(())
        });
    tokio::spawn(watch);
    leases
}

/// Phase-count gauge and queue depth, from the cache, every second; the backlog forgets
/// deleted VMs.
pub(super) fn spawn_gauges(metrics: Arc<Metrics>, vms: Store<ImpVM>, backlog: Arc<Tracker>) {
    tokio::spawn(async move {
        loop {
            let state = vms.state();
            let present: std::collections::BTreeSet<String> =
                state.iter().map(|vm| key(vm)).collect();
            backlog.retain(|k| present.contains(k));
            metrics.set_phase_counts(&phase_counts(&state));
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
            metrics.set_queue_depth(waiting as i64);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}
