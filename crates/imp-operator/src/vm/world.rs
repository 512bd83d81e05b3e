//! What a reconcile reads: the caches, resolved into the snapshot its decisions take.

use std::sync::Mutex;

use imp_api::class::{ImpVMClass, ImpVMClassSpec};
use imp_api::cluster::CLUSTER_CONFIG_NAME;
use imp_api::shared::PlacedSize;
use imp_api::template::ImpVMTemplate;
use imp_api::vm::{ImpVM, ImpVMSpec, ImpVMStatus, VmPhase};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use super::write::kube_err;
use super::{Context, Error, key};
use crate::placement::ledger::{Ledger, SizeRef};
use crate::placement::schedule::{self, NodeView, Policy};
use crate::resolve::{self, MissingRef};

/// A VM's resolved spec and class size.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Resolved {
    /// class ← template ← VM.
    pub spec: ImpVMSpec,
    /// The class's spec.
    pub class: ImpVMClassSpec,
    /// vCPUs of the class.
    pub vcpu: i64,
    /// MiB of the class.
    pub memory_mib: i64,
}

/// vCPU and MiB of a VM's live class (its classRef, else its template's), without resolving the
/// rest of the spec.
pub(super) fn live_size(
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
pub(super) fn observe(
    ledger: &Mutex<Ledger>,
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
pub(super) fn resized<T>(ledger: std::sync::Arc<Mutex<Ledger>>) -> impl FnMut(&T) {
    move |_| {
        ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .classes_changed();
    }
}

impl Context {
    /// class ← template ← VM from the caches, or the first reference that is missing.
    /// A placed VM with a booking resolves to its booking.
    pub(super) fn resolve(&self, vm: &ImpVM) -> Result<Resolved, MissingRef> {
        if let Some(booked) = self.booked(vm) {
            return booked;
        }
        resolve::admissible(&vm.spec)?;
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
        let mut spec = resolve::resolve(&vm.spec, template.as_ref().map(|t| &t.spec), &class.spec);
        // A claimant that starts cold restores from its pool's base, when there is one.
        if let Some(claim) = vm.status.as_ref().and_then(|s| s.warm_claim.as_ref())
            && claim.member.is_none()
            && spec.snapshot_ref.is_none()
        {
            spec.snapshot_ref = claim.base_snapshot.clone();
        }
        Ok(Resolved {
            spec: resolve::with_default_http_check(spec, self.default_http_check().as_ref()),
            vcpu: i64::from(class.spec.vcpu),
            memory_mib: i64::from(class.spec.memory_mib),
            class: class.spec.clone(),
        })
    }

    /// A placed VM's booking ([`imp_api::vm::Booking`]) in place of its live class and template,
    /// which it no longer follows (its network must still exist); `None` for a VM without one.
    pub(super) fn booked(&self, vm: &ImpVM) -> Option<Result<Resolved, MissingRef>> {
        vm.spec.node_name.as_ref()?;
        let b = vm.status.as_ref()?.booking.as_ref()?;
        let ns = vm.namespace().unwrap_or_default();
        if let Some(n) = &b.spec.network_ref
            && self
                .networks
                .get(&ObjectRef::new(&n.name).within(&ns))
                .is_none()
        {
            return Some(Err(MissingRef::Network {
                namespace: ns,
                name: n.name.clone(),
            }));
        }
        let size = b.size();
        Some(Ok(Resolved {
            spec: b.spec.clone(),
            class: b.class.clone(),
            vcpu: size.vcpu,
            memory_mib: size.memory_mib,
        }))
    }

    /// The scheduling lock: the ledger (never held across an await).
    pub(super) fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The cluster's `defaultHttpCheck` (ClusterImpConfig `cluster`), booked into the VMs that
    /// have none ([`resolve::with_default_http_check`]).
    fn default_http_check(&self) -> Option<imp_api::shared::HttpCheckSpec> {
        self.configs
            .get(&ObjectRef::new(CLUSTER_CONFIG_NAME))
            .and_then(|c| c.spec.default_http_check.clone())
    }

    pub(super) fn policy(&self) -> Policy {
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

    /// How silent the agent of `vm`'s node is, if it keeps a Lease.
    pub(super) fn agent_silence(&self, vm: &ImpVM) -> Option<crate::placement::fencing::Silence> {
        let node = vm.spec.node_name.as_deref()?;
        let leases = self
            .agent_leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        leases.silence(node, std::time::Instant::now(), self.settings.fence_margin)
    }

    /// Whether the ledger holds every VM (the VM watch has listed them once): only then may a
    /// controller beside this one book through it.
    pub(crate) fn ledger_listed(&self) -> bool {
        self.ledger().listed()
    }

    /// The Event recorder of the operator's controllers.
    pub(crate) fn recorder(&self) -> Recorder {
        self.recorder.clone()
    }

    /// The agent API of node `node` as its Node publishes it: its endpoint and its
    /// certificate's SHA-256 (`None` when it publishes no API).
    pub(crate) fn agent_of(&self, node: &str) -> Option<(String, String)> {
        let n = self.nodes.get(&ObjectRef::new(node))?;
        let a = n.metadata.annotations.as_ref()?;
        Some((
            a.get(imp_api::shared::ANNOTATION_AGENT_ENDPOINT)?.clone(),
            a.get(imp_api::shared::ANNOTATION_AGENT_CERT_SHA256)?
                .clone(),
        ))
    }

    pub(super) fn node_views(&self) -> Vec<NodeView> {
        let pods = self.pods.state();
        let loads = crate::placement::reservation::node_loads(pods.iter().map(AsRef::as_ref));
        let mut nodes: Vec<NodeView> = self
            .nodes
            .state()
            .iter()
            .map(|n| {
                let profile = self
                    .profiles
                    .get(&ObjectRef::new(&n.name_any()))
                    .map(|p| p.spec.clone());
                let mut view = NodeView::from_node(n, profile);
                view.pods = loads.get(&view.name).copied().unwrap_or_default();
                view
            })
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        nodes
    }

    /// The node of a placed VM whose decision reads it (deleting, leaving it, or in a
    /// non-terminal phase):
    /// from the cache, else from the API server; `None` when it does not exist.
    pub(super) async fn node_of(&self, vm: &ImpVM) -> Result<Option<Node>, Error> {
        let Some(name) = &vm.spec.node_name else {
            return Ok(None);
        };
        let phase = vm.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        let terminal = matches!(
            phase,
            VmPhase::Failed | VmPhase::Succeeded | VmPhase::RetryExhausted
        );
        let leaving = vm.status.as_ref().is_some_and(ImpVMStatus::leaving_node);
        if terminal && vm.metadata.deletion_timestamp.is_none() && !leaving {
            return Ok(None);
        }
        if let Some(n) = self.nodes.get(&ObjectRef::new(name)) {
            return Ok(Some((*n).clone()));
        }
        Api::<Node>::all(self.client.clone())
            .get_opt(name)
            .await
            .map_err(kube_err("reading the node of", vm))
    }
}
