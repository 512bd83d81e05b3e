//! A warm pool's claim, driven by the VM controller for a VM with `spec.warmPoolRef`: what
//! [`crate::warmpool::claim`] decides, written in its order. Each step is found done or not
//! from the API, so a claim interrupted anywhere (the operator killed) resumes where it
//! stopped; none waits on anything but its own writes. Fault points
//! (`imp_telemetry::fault`) after each write, for the crash tests: `claim.labelled`,
//! `claim.member-marked`, `claim.written`, `claim.pod-handed` (the Pod's patch, while the
//! address may be moving), `claim.address-moved` (both done),
//! `claim.placed`, `claim.recorded`.

use imp_api::conditions::{ConditionReason, ConditionType};
use imp_api::shared::{ANNOTATION_PLACED_RESOURCES, LABEL_CLAIMED_FROM, PlacedSize};
use imp_api::vm::{ImpVM, WarmClaim};
use imp_api::{ImpWarmPool, validation};
use imp_telemetry::fault;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, ListParams, Patch};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use serde_json::json;

use super::conditions::{Note, set_cond};
use super::place::placed_status;
use super::world::Resolved;
use super::{Context, Error, key};
use crate::placement::reservation;
use crate::warmpool::claim::{self as decide, Step};

/// What one claim step leaves the reconcile with.
pub(super) enum Claimed {
    /// Go on deciding with this (written) VM.
    Continue(Box<ImpVM>),
    /// The reconcile ends here.
    Done(Action),
}

fn api_err(doing: &'static str, vm: &ImpVM) -> impl FnOnce(kube::Error) -> Error {
    super::write::kube_err(doing, vm)
}

impl Context {
    /// The next step of claimant `vm`'s claim (its spec resolved as `r`).
    pub(super) async fn claim(&self, vm: ImpVM, r: &Resolved) -> Result<Claimed, Error> {
        let ns = vm.namespace().unwrap_or_default();
        if let Err(e) = validation::warm_claim(&ns, &decide::as_asked(&vm)) {
            return self.refuse_claim(vm, e.to_string()).await;
        }
        let Some(pool_ref) = vm.spec.warm_pool_ref.clone() else {
            return Ok(Claimed::Continue(Box::new(vm)));
        };
        let pools: Api<ImpWarmPool> = Api::namespaced(self.client.clone(), &ns);
        let Some(pool) = pools
            .get_opt(&pool_ref.name)
            .await
            .map_err(api_err("reading the warm pool of", &vm))?
        else {
            let why = format!(
                "spec.warmPoolRef: ImpWarmPool {ns}/{} does not exist: create it or fix spec.warmPoolRef",
                pool_ref.name
            );
            return self.refuse_claim(vm, why).await;
        };
        if vm.spec.template_ref.as_ref().map(|t| t.name.as_str())
            != Some(pool.spec.template_name.as_str())
        {
            let why = format!(
                "spec.templateRef: a claimant names its pool's template {:?}, as its members were \
                 made from it",
                pool.spec.template_name
            );
            return self.refuse_claim(vm, why).await;
        }
        match decide::step(&vm) {
            Step::NotClaiming => Ok(Claimed::Continue(Box::new(vm))),
            Step::Choose => self.choose_member(vm, &pool, r).await,
            Step::HandOver { member } => self.hand_over(vm, &pool, &member, r).await,
        }
    }

    /// A claim whose spec cannot be served: `InvalidSpec` naming the field, as any VM's.
    async fn refuse_claim(&self, vm: ImpVM, why: String) -> Result<Claimed, Error> {
        tracing::warn!(vm = %key(&vm), why, "claim refused");
        self.unplaceable(vm, ConditionReason::InvalidSpec, &why)
            .await
            .map(Claimed::Done)
    }

    /// Marks a ready member of `pool` taken by `vm` and writes the claim, or writes why `vm`
    /// starts cold. The claimant is labelled first, so the pool sees a claim in flight.
    async fn choose_member(
        &self,
        vm: ImpVM,
        pool: &ImpWarmPool,
        r: &Resolved,
    ) -> Result<Claimed, Error> {
        let vm = self.label_claimant(vm, pool).await?;
        fault::point("claim.labelled");
        let ns = vm.namespace().unwrap_or_default();
        let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), &ns);
        let members = vms
            .list(&ListParams::default().labels(&decide::members_selector(&pool.name_any())))
            .await
            .map_err(api_err("listing the pool's members for", &vm))?
            .items;
        let now = Timestamp::now();
        let keeps = |node: &str| self.node_keeps_members(node);
        let usable = |node: &str| keeps(node) && self.node_takes(node, &r.spec);
        let Some(member) = decide::pick(&vm, pool, &members, &usable, now) else {
            let why = if decide::pick(&vm, pool, &members, &keeps, now).is_some() {
                format!(
                    "pool {} has no ready member on a node this VM may run on (its nodeSelector \
                     and tolerations); starting it cold",
                    pool.name_any()
                )
            } else {
                decide::cold_reason(pool, &members)
            };
            return self.go_cold(vm, pool, why).await;
        };
        let mut marked = member.clone();
        if !decide::marked_by(member, &vm) {
            let body = decide::take_member(member, &vm);
            match vms
                .patch(
                    &member.name_any(),
                    &super::write::patch_params(),
                    &Patch::Merge(&body),
                )
                .await
            {
                Ok(written) => marked = written,
                // Taken or changed meanwhile: choose again on a fresh list.
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                    return Ok(Claimed::Done(Action::requeue(
                        std::time::Duration::from_millis(50),
                    )));
                }
                Err(e) => return Err(api_err("marking a member taken by", &vm)(e)),
            }
            fault::point("claim.member-marked");
        }
        let claim = decide::claim_of(pool, Some(member), None, now);
        tracing::info!(vm = %key(&vm), pool = %pool.name_any(), member = %member.name_any(), "claimed a running member");
        // Straight on to the hand-over with the member as the mark returned it: no second
        // reconcile, no second read of the pool or the member.
        match self.write_claim(vm, claim).await? {
            Claimed::Continue(vm) => {
                let name = marked.name_any();
                self.hand_over_member(*vm, pool, &name, Some(marked), r)
                    .await
            }
            done @ Claimed::Done(_) => Ok(done),
        }
    }

    /// Labels `vm` with the pool it claims from (its `claimedCount`, and the watch that tells
    /// the pool).
    async fn label_claimant(&self, vm: ImpVM, pool: &ImpWarmPool) -> Result<ImpVM, Error> {
        if vm.labels().get(LABEL_CLAIMED_FROM) == Some(&pool.name_any()) {
            return Ok(vm);
        }
        let body = json!({"metadata": {"labels": {LABEL_CLAIMED_FROM: pool.name_any()}}});
        self.patch_main(&vm, body, "labelling the claimant").await
    }

    /// Whether `node` may keep a pool's member (it exists, is Ready and not cordoned).
    fn node_keeps_members(&self, node: &str) -> bool {
        self.nodes
            .get(&ObjectRef::<Node>::new(node))
            .is_some_and(|n| crate::warmpool::unusable(&n).is_none())
    }

    /// Whether a member on `node` may go to a claimant of resolved spec `spec` (its own
    /// nodeSelector and tolerations).
    fn node_takes(&self, node: &str, spec: &imp_api::vm::ImpVMSpec) -> bool {
        self.nodes
            .get(&ObjectRef::<Node>::new(node))
            .is_some_and(|n| decide::unfit(spec, &n).is_none())
    }

    /// Writes that `vm` starts cold, and why (an Event too); it then goes on as a VM restoring
    /// from the pool's base, or booting from its template's image without one.
    async fn go_cold(&self, vm: ImpVM, pool: &ImpWarmPool, why: String) -> Result<Claimed, Error> {
        let claim = decide::claim_of(pool, None, Some(why.clone()), Timestamp::now());
        tracing::info!(vm = %key(&vm), pool = %pool.name_any(), why, "no member to claim; starting cold");
        let written = self.write_claim(vm, claim).await?;
        if let Claimed::Continue(vm) = &written {
            self.note(vm, Note::normal("ColdStart", why)).await;
        }
        Ok(written)
    }

    async fn write_claim(&self, vm: ImpVM, claim: WarmClaim) -> Result<Claimed, Error> {
        let mut status = vm.status.clone().unwrap_or_default();
        status.warm_claim = Some(claim);
        let vm = self
            .patch_status(&vm, &status, "writing the claim of")
            .await?;
        fault::point("claim.written");
        Ok(Claimed::Continue(Box::new(vm)))
    }

    /// Hands member `name` over to `vm`: its reservation Pod, its address, its node and size,
    /// then the booking. A member no longer running gives the claim up: `vm` starts cold.
    async fn hand_over(
        &self,
        vm: ImpVM,
        pool: &ImpWarmPool,
        name: &str,
        r: &Resolved,
    ) -> Result<Claimed, Error> {
        let ns = vm.namespace().unwrap_or_default();
        let vms: Api<ImpVM> = Api::namespaced(self.client.clone(), &ns);
        let member = vms
            .get_opt(name)
            .await
            .map_err(api_err("reading the claimed member of", &vm))?;
        self.hand_over_member(vm, pool, name, member, r).await
    }

    /// [`Self::hand_over`] with `member` as read (the member object named `name`, if any).
    async fn hand_over_member(
        &self,
        vm: ImpVM,
        pool: &ImpWarmPool,
        name: &str,
        member: Option<ImpVM>,
        r: &Resolved,
    ) -> Result<Claimed, Error> {
        let claim = vm.status.as_ref().and_then(|s| s.warm_claim.clone());
        let member = member.filter(|m| {
            m.uid() == claim.as_ref().and_then(|c| c.member_uid.clone())
                && m.metadata.deletion_timestamp.is_none()
                && decide::marked_by(m, &vm)
                && m.status.as_ref().is_some_and(|s| {
                    s.node_name.is_some() && s.phase == Some(imp_api::vm::VmPhase::Running)
                })
        });
        let Some(member) = member else {
            let why = format!(
                "member {name} of pool {} stopped running before it was handed over; starting cold",
                pool.name_any()
            );
            return self.go_cold(vm, pool, why).await;
        };
        let node = member
            .status
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        if let Some(other) = vm.spec.node_name.as_deref().filter(|n| *n != node) {
            let why = format!(
                "spec.nodeName: {other:?} is not the node {node:?} of claimed member {name}: \
                 a claimant is bound to its member's node"
            );
            return self.refuse_claim(vm, why).await;
        }
        // The Pod and the address are handed over together: neither reads the other.
        let (moved, ip) = tokio::join!(
            self.move_reservation(&vm, &member),
            self.move_address(&vm, &member)
        );
        moved?;
        let ip = ip?;
        fault::point("claim.address-moved");
        let vm = if vm.spec.node_name.is_none() {
            let size = member
                .annotations()
                .get(ANNOTATION_PLACED_RESOURCES)
                .and_then(|a| PlacedSize::from_annotation(a))
                .unwrap_or(PlacedSize {
                    vcpu: r.vcpu,
                    memory_mib: r.memory_mib,
                });
            let booking = self.ledger().book(&key(&vm), Some(&node), Some(size));
            let placed = self.write_placement(&vm, &node, size, booking).await?;
            fault::point("claim.placed");
            placed
        } else {
            vm
        };
        let Some(booked) = decide::claimed_booking(&member, r.spec.clone()) else {
            let why = format!("member {name} has no booking to hand over; starting cold");
            return self.go_cold(vm, pool, why).await;
        };
        let now = Timestamp::now();
        let generation = vm.metadata.generation;
        let mut status = placed_status(
            vm.status.clone().unwrap_or_default(),
            &node,
            booked,
            generation,
            now,
        );
        status.ip = ip.map(|a| a.to_string()).or(status.ip);
        let msg = format!(
            "took over running member {name} of pool {} on node {node}",
            pool.name_any()
        );
        set_cond(
            &mut status,
            ConditionType::Scheduled,
            true,
            ConditionReason::Claimed,
            msg.clone(),
            generation,
            now,
        );
        let vm = self
            .patch_status(&vm, &status, "recording the claim of")
            .await?;
        fault::point("claim.recorded");
        tracing::info!(vm = %key(&vm), member = name, node = %node, "claim handed to the node");
        self.note(&vm, Note::normal("Claimed", msg)).await;
        Ok(Claimed::Done(Action::requeue(self.settings.requeue_active)))
    }

    /// Gives `member`'s reservation Pod to `vm` (its owner and its `reservation-for`), once.
    async fn move_reservation(&self, vm: &ImpVM, member: &ImpVM) -> Result<(), Error> {
        let ns = vm.namespace().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let name = reservation::pod_name(&member.name_any());
        let Some(pod) = pods
            .get_opt(&name)
            .await
            .map_err(api_err("reading the member's reservation Pod for", vm))?
        else {
            return Ok(());
        };
        let owned_by = |uid: Option<String>| {
            pod.owner_references()
                .iter()
                .any(|o| Some(&o.uid) == uid.as_ref())
        };
        if owned_by(vm.uid()) || !owned_by(member.uid()) {
            return Ok(());
        }
        let body = reservation::handed_to(&pod, vm);
        pods.patch(&name, &super::write::patch_params(), &Patch::Merge(&body))
            .await
            .map_err(api_err("handing the member's reservation Pod to", vm))?;
        fault::point("claim.pod-handed");
        tracing::info!(vm = %key(vm), pod = %name, "reservation Pod handed over");
        Ok(())
    }

    /// Gives `member`'s address to `vm`: the address it then holds.
    async fn move_address(
        &self,
        vm: &ImpVM,
        member: &ImpVM,
    ) -> Result<Option<std::net::Ipv4Addr>, Error> {
        let booked = member.status.as_ref().and_then(|s| s.booking.as_ref());
        let Some(net) = booked.and_then(|b| b.spec.network_ref.as_ref()) else {
            return Ok(None);
        };
        let ns = vm.namespace().unwrap_or_default();
        self.ipam
            .transfer(
                &ns,
                &net.name,
                &format!("{ns}/{}", member.name_any()),
                &key(vm),
            )
            .await
            .map_err(Error::Ipam)
    }
}
