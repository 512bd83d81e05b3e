//! Reservation Pods kept in step with what every VM holds ([`crate::placement::reservation`] decides).
//!
//! Two paths write them:
//! - placement creates the reservation of the node it booked **before** `spec.nodeName` is
//!   written ([`Context::reserve`]), so a ResourceQuota that refuses it keeps the VM unplaced
//!   (`QuotaExceeded`, the quota's own message) instead of running it over quota;
//! - [`sync`] compares, whenever a VM or a reservation Pod changes (and every
//!   [`SYNC_EVERY`] as a safety net), the share of every VM the ledger counts with the
//!   reservation Pods that exist, and creates and deletes Pods until they agree (a VM that
//!   moved, resized, suspended or ended; a Pod deleted by hand or refused by its kubelet).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use imp_api::shared::PlacedSize;
use imp_api::vm::ImpVM;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::Store;
use tokio::sync::Notify;

use super::{Context, key};
use crate::placement::reservation::{self, Existing, Op, PodSettings, Reservation};

/// The longest a change goes unnoticed if a watch event was missed.
pub const SYNC_EVERY: Duration = Duration::from_secs(30);

/// How soon a refused reservation is tried again.
const RETRY_REFUSED: Duration = Duration::from_secs(5);

/// Event reason on a VM whose reservation Pod could not be made.
const REFUSED_REASON: &str = "ReservationRefused";

/// Why a reservation was not created.
enum Refusal {
    /// A ResourceQuota of the namespace said no: the API server's message, which names it.
    Quota(String),
    /// Anything else (another admission rule, RBAC, the API server unreachable).
    Other(kube::Error),
}

impl Context {
    fn reservation_settings(&self) -> Option<&PodSettings> {
        self.settings.reservations.as_ref()
    }

    /// Creates the reservation of `vm` on `node` before its placement is written. `Some(why)`:
    /// a ResourceQuota refused it, and the VM must stay unplaced. Any other failure (a
    /// Pod Security rule, a namespace without its default ServiceAccount yet, RBAC) does not
    /// hold the VM back: it is logged, told in a Warning Event, and [`sync`] tries again.
    pub(super) async fn reserve(&self, vm: &ImpVM, node: &str, size: PlacedSize) -> Option<String> {
        let settings = self.reservation_settings()?;
        let ns = vm.namespace().unwrap_or_default();
        let uid = vm.uid().unwrap_or_default();
        let share = (size.vcpu, size.memory_mib);
        let r = Reservation::of(&ns, &vm.name_any(), &uid, node, share, false, true)?;
        match create(&self.client, &r, settings).await {
            Ok(()) => None,
            Err(Refusal::Quota(why)) => Some(why),
            Err(Refusal::Other(e)) => {
                tracing::warn!(vm = %key(vm), node, error = %imp_api::chain::DisplayChain(&e), "reservation Pod not created; placing the VM anyway");
                self.event(
                    vm,
                    EventType::Warning,
                    REFUSED_REASON,
                    refused_note(&r, &e.to_string()),
                )
                .await;
                None
            }
        }
    }
}

fn refused_note(r: &Reservation, why: &str) -> String {
    format!(
        "the reservation Pod holding this VM's {}m CPU and {}MiB on node {} was refused: {why}",
        r.load.cpu_milli, r.load.memory_mib, r.node
    )
}

/// Creates the Pod of `r`; one that exists already is left to [`sync`].
async fn create(
    client: &kube::Client,
    r: &Reservation,
    settings: &PodSettings,
) -> Result<(), Refusal> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &r.namespace);
    match api
        .create(&PostParams::default(), &reservation::pod(r, settings))
        .await
    {
        Ok(_) => {
            tracing::info!(vm = %r.vm, namespace = %r.namespace, node = %r.node,
                cpu_milli = r.load.cpu_milli, memory_mib = r.load.memory_mib, "reservation Pod created");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(kube::Error::Api(s)) if imp_api::refusal::quota(&s).is_some() => {
            Err(Refusal::Quota(s.message))
        }
        Err(e) => Err(Refusal::Other(e)),
    }
}

/// Warm pools' members taken by a claim, each to its claimant (uids): the member's Pod is the
/// claimant's ([`reservation::plan`]).
fn claimed_members(vms: &Store<ImpVM>) -> BTreeMap<String, String> {
    vms.state()
        .iter()
        .filter(|vm| {
            vm.annotations()
                .contains_key(imp_api::shared::ANNOTATION_CLAIMED_BY)
        })
        .filter_map(|vm| {
            let claimant = vm
                .owner_references()
                .iter()
                .find(|o| o.kind == "ImpVM" && o.controller == Some(true))?;
            Some((vm.uid()?, claimant.uid.clone()))
        })
        .collect()
}

/// The reservations the ledger's shares call for, one per VM that holds something.
fn wanted(ctx: &Context, vms: &Store<ImpVM>) -> Vec<Reservation> {
    let ledger = ctx.ledger();
    let overcommit = ctx.settings.overcommit_suspended;
    vms.state()
        .iter()
        .filter(|vm| vm.metadata.deletion_timestamp.is_none())
        .filter_map(|vm| {
            let (node, size, suspended) = ledger.held(&key(vm))?;
            Reservation::of(
                &vm.namespace().unwrap_or_default(),
                &vm.name_any(),
                &vm.uid().unwrap_or_default(),
                node,
                (size.vcpu, size.memory_mib),
                suspended,
                overcommit,
            )
        })
        .collect()
}

/// Keeps reservation Pods in step with the VMs until the process ends; `changed` is notified
/// by the VM and reservation-Pod watches. Runs once the caches have filled (`ready`).
pub(super) async fn sync(
    ctx: Arc<Context>,
    vms: Store<ImpVM>,
    pods: Store<Pod>,
    changed: Arc<Notify>,
    ready: impl Future<Output = ()>,
) {
    let Some(settings) = ctx.reservation_settings().cloned() else {
        return;
    };
    ready.await;
    // The other caches have filled; the VMs' (and the ledger fed by the same watch) may not
    // have: an empty ledger would make every reservation Pod look orphaned and delete it.
    while !ctx.ledger().listed() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut refused: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let existing: Vec<Existing> = pods
            .state()
            .iter()
            .filter_map(|p| Existing::of(p))
            .collect();
        let wanted = wanted(&ctx, &vms);
        let vms_wanted: std::collections::BTreeSet<String> = wanted
            .iter()
            .map(|r| format!("{}/{}", r.namespace, r.vm))
            .collect();
        refused.retain(|k, _| vms_wanted.contains(k));
        let ops = reservation::plan(&wanted, &existing, &claimed_members(&vms));
        for op in ops {
            apply(&ctx, &vms, &settings, op, &mut refused).await;
        }
        // A refused Pod is tried again soon: most refusals pass (a namespace's default
        // ServiceAccount appears, a quota is raised or freed).
        let next = if refused.is_empty() {
            SYNC_EVERY
        } else {
            RETRY_REFUSED
        };
        tokio::select! {
            () = changed.notified() => {}
            () = tokio::time::sleep(next) => {}
        }
    }
}

async fn apply(
    ctx: &Context,
    vms: &Store<ImpVM>,
    settings: &PodSettings,
    op: Op,
    refused: &mut BTreeMap<String, String>,
) {
    match op {
        Op::Delete(ns, name) => {
            let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
            // At once: a reservation holds no work to wind down.
            match api
                .delete(&name, &DeleteParams::default().grace_period(0))
                .await
            {
                Ok(_) => tracing::info!(namespace = %ns, pod = %name, "reservation Pod deleted"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    tracing::warn!(namespace = %ns, pod = %name, error = %imp_api::chain::DisplayChain(&e),
                    "deleting a reservation Pod failed")
                }
            }
        }
        Op::Create(r) => {
            let k = format!("{}/{}", r.namespace, r.vm);
            let why = match create(&ctx.client, &r, settings).await {
                Ok(()) => {
                    refused.remove(&k);
                    return;
                }
                Err(Refusal::Quota(why)) => why,
                Err(Refusal::Other(e)) => e.to_string(),
            };
            if refused.get(&k) == Some(&why) {
                return;
            }
            tracing::warn!(vm = %k, node = %r.node, error = %why, "reservation Pod refused");
            let vm = vms
                .state()
                .into_iter()
                .find(|v| v.uid().as_deref() == Some(r.vm_uid.as_str()));
            if let Some(vm) = vm {
                ctx.event(
                    &vm,
                    EventType::Warning,
                    REFUSED_REASON,
                    refused_note(&r, &why),
                )
                .await;
            }
            refused.insert(k, why);
        }
    }
}
