//! What the ImpVM controller watches besides ImpVMs, and which VMs each change concerns.
//!
//! The caches ([`Store`]s) feed decisions; the mappers turn a change of a Node, class,
//! template, network or Pod into the VMs to reconcile again.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use imp_api::class::ImpVMClass;
use imp_api::network::ImpNetwork;
use imp_api::template::ImpVMTemplate;
use imp_api::vm::{ImpVM, VmPhase};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;

use super::{key, phase_counts};
use crate::backlog::Tracker;
use crate::fencing::AgentLeases;
use crate::metrics::Metrics;

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
pub(super) fn pods(
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
    let cfg = wc
        .clone()
        .labels(&format!("{}=true", crate::reservation::LABEL_RESERVATION));
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
/// own.
pub(super) fn agent_leases(
    client: &kube::Client,
    wc: &watcher::Config,
) -> Arc<std::sync::Mutex<AgentLeases>> {
    let leases = Arc::new(std::sync::Mutex::new(AgentLeases::default()));
    let kept = leases.clone();
    let cfg = wc
        .clone()
        .labels(&format!("{}=true", imp_api::shared::LABEL_AGENT_LEASE));
    let watch = watcher(Api::<Lease>::all(client.clone()), cfg)
        .default_backoff()
        .for_each(move |event| {
            let mut l = kept
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = std::time::Instant::now();
            match event {
                Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                    l.observe(&lease, now);
                }
                Ok(watcher::Event::Delete(lease)) => l.forget(&lease),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "watching the agents' Leases"),
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
