//! A VM's address on its ImpNetwork, chosen before the VM reaches its node: allocated (or
//! found) in the network's table by [`crate::ipam`], then written to `status.ip`.

use imp_api::conditions::{ConditionReason, ConditionType};
use imp_api::vm::ImpVM;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::conditions::{Note, has_cond, set_cond};
use super::place::unplaced_status;
use super::world::Resolved;
use super::{Context, Error, key};

/// Whether the VM's resolved spec names a network and its status has no address yet.
pub(super) fn needs_address(vm: &ImpVM, r: &Resolved) -> bool {
    r.spec.network_ref.is_some() && vm.status.as_ref().and_then(|s| s.ip.as_ref()).is_none()
}

impl Context {
    /// Makes sure a VM on a network has its address in `status.ip`: `Ok(Ok(vm))` with the
    /// written VM (or the VM as it was, without a network), `Ok(Err(action))` when the network
    /// gives none (reported as `NetworkSetupFailed`, the VM stays where it is).
    pub(super) async fn address(
        &self,
        vm: ImpVM,
        r: &Resolved,
    ) -> Result<Result<ImpVM, Action>, Error> {
        let Some(net) = &r.spec.network_ref else {
            return Ok(Ok(vm));
        };
        let ns = vm.namespace().unwrap_or_default();
        let owner = key(&vm);
        match self
            .ipam
            .ensure(
                &ns,
                &net.name,
                &owner,
                r.spec.inherited.network_group.as_deref(),
            )
            .await
        {
            Ok(ip) => {
                let ip = ip.to_string();
                let mut status = vm.status.clone().unwrap_or_default();
                if status.ip.as_deref() == Some(&ip) {
                    return Ok(Ok(vm));
                }
                status.ip = Some(ip.clone());
                let vm = self
                    .patch_status(&vm, &status, "recording the address of")
                    .await?;
                tracing::info!(vm = %owner, namespace = %ns, network = %net.name, ip = %ip, "address recorded");
                Ok(Ok(vm))
            }
            Err(e) if e.is_setup_failure() || e.is_wait() => {
                Ok(Err(self.no_address(vm, &e).await?))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Reports that the network gives the VM no address: an unplaced VM stays Pending with
    /// Scheduled=False, a placed one gets Ready=False; both with reason `NetworkSetupFailed`
    /// and a warning, or `Waiting` and no event while the network is only catching up (created
    /// together with the VM). A change of the network wakes the VM again.
    async fn no_address(&self, vm: ImpVM, why: &crate::ipam::Error) -> Result<Action, Error> {
        let generation = vm.metadata.generation;
        let now = Timestamp::now();
        let message = why.to_string();
        let status = vm.status.clone().unwrap_or_default();
        let (reason, event) = reported_as(why);
        let (status, note) = if vm.spec.node_name.is_none() {
            unplaced_status(status, reason, &message, event, generation, now)
        } else {
            let was = has_cond(&status, ConditionType::Ready, reason, &message);
            let mut status = status;
            set_cond(
                &mut status,
                ConditionType::Ready,
                false,
                reason,
                message.clone(),
                generation,
                now,
            );
            let note = event
                .filter(|_| !was)
                .map(|e| Note::warning(e, message.clone()));
            (status, note)
        };
        let vm = self
            .patch_status(&vm, &status, "reporting no address for")
            .await?;
        if let Some(note) = note {
            tracing::info!(vm = %key(&vm), why = %message, "no address");
            self.note(&vm, note).await;
        }
        Ok(Action::requeue(self.settings.requeue_pending))
    }

    /// Releases every address the VM holds on the networks of its namespace (before its
    /// finalizer goes, so the address is not reused while its agent may still use it).
    pub(super) async fn release_addresses(&self, vm: &ImpVM) -> Result<(), Error> {
        let ns = vm.namespace().unwrap_or_default();
        let owner = key(vm);
        let holding: Vec<String> = self
            .networks
            .state()
            .iter()
            .filter(|n| n.namespace().as_deref() == Some(ns.as_str()))
            .filter(|n| {
                n.status
                    .as_ref()
                    .is_some_and(|s| s.allocations.values().any(|o| *o == owner))
            })
            .map(|n| n.name_any())
            .collect();
        for name in holding {
            self.ipam.release(&ns, &name, &owner).await?;
        }
        Ok(())
    }
}

/// The condition reason and the warning (if any) a VM gets for the network's refusal.
fn reported_as(why: &crate::ipam::Error) -> (ConditionReason, Option<&'static str>) {
    match why.is_wait() {
        true => (ConditionReason::Waiting, None),
        false => (
            ConditionReason::NetworkSetupFailed,
            Some("NetworkSetupFailed"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::Error as Ipam;

    #[test]
    fn a_network_catching_up_is_waited_for_and_a_refusal_is_a_warning() {
        let network = "ns/net".to_owned();
        let catching_up = Ipam::Unreconciled {
            network: network.clone(),
            why: "not reconciled yet".into(),
        };
        assert_eq!(reported_as(&catching_up), (ConditionReason::Waiting, None));
        let full = Ipam::Full {
            network,
            range: "10.0.0.0/30".into(),
            usable: 1,
        };
        assert_eq!(
            reported_as(&full),
            (
                ConditionReason::NetworkSetupFailed,
                Some("NetworkSetupFailed")
            )
        );
    }
}
