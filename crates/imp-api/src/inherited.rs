//! The fields an ImpVM takes from its ImpVMTemplate unless it sets them, declared once and
//! flattened into both specs (on the wire they are fields of `spec` itself, as in the Go project).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::GoDuration;
use crate::shared::{GuestAgentConfig, ProbeSpec, RestartPolicy};

/// What a VM and its template both say about the workload, each field the VM's when it sets it,
/// else the template's (and, for probes, the guest agent and the restart policy, else the class's).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Inherited {
    /// OCI image reference; its ENTRYPOINT/CMD is the workload. VM over template (an empty one
    /// on the VM counts as unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Guest probes and the operator's HTTP check; VM over template over class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probes: Option<ProbeSpec>,
    /// The in-guest agent switch; VM over template over class. `enabled: false`: the guest runs
    /// its workload without it (no exec, in-guest probes or guest figures; Running once the VMM
    /// runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_agent: Option<GuestAgentConfig>,
    /// What happens when a persistent workload fails; VM over template over class. When none of
    /// them sets one, a persistent VM restarts in place after 10s, with the delay doubling up to
    /// 5m, at most 5 attempts, then stays Failed. Ephemeral VMs never restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// Group of the network to draw the IP from; VM over template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_group: Option<String>,
    /// OCI image to layer on top of the base image (CI runner tooling): its layers are applied
    /// over the image's, pulled and checked as the image's own (with the VM's
    /// imagePullSecrets); VM over template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_layer: Option<String>,
    /// OCI image to layer on top of the runner layer (Cilium agent), applied as runnerLayer is;
    /// VM over template. imp itself does not enrol the VM with Cilium: what the layer runs is
    /// its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium_layer: Option<String>,
    /// Delete the VM this long after it first ran (or after it ended, if it never ran), running
    /// or finished (Succeeded, Failed); 0 means never, else at least 60s. VM over template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema::expire_after)]
    pub expire_after: Option<GoDuration>,
}

impl Inherited {
    /// Fills every field `self` (a VM's) leaves unset from `template`'s; an empty image counts
    /// as unset.
    pub fn fill_from(&mut self, template: &Inherited) {
        if self.image.as_deref().is_none_or(str::is_empty) && template.image.is_some() {
            self.image.clone_from(&template.image);
        }
        fill(&mut self.probes, &template.probes);
        fill(&mut self.guest_agent, &template.guest_agent);
        fill(&mut self.restart_policy, &template.restart_policy);
        fill(&mut self.network_group, &template.network_group);
        fill(&mut self.runner_layer, &template.runner_layer);
        fill(&mut self.cilium_layer, &template.cilium_layer);
        fill(&mut self.expire_after, &template.expire_after);
    }
}

/// Sets `target` to `source` when it is unset: how one level of class ← template ← VM yields
/// to the one above it.
pub(crate) fn fill<T: Clone>(target: &mut Option<T>, source: &Option<T>) {
    if target.is_none() {
        target.clone_from(source);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::{ImpVM, ImpVMSpec, ImpVMTemplate};

    #[test]
    fn the_fields_stay_fields_of_spec_and_a_spec_may_still_be_absent() {
        let t: ImpVMTemplate = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMTemplate", "metadata": {"name": "t"},
            "spec": {"classRef": {"name": "small"}, "image": "app:1", "expireAfter": "10m",
                     "guestAgent": {"enabled": false}}
        }))
        .unwrap();
        assert_eq!(t.spec.inherited.image.as_deref(), Some("app:1"));
        assert_eq!(
            serde_json::to_value(&t.spec).unwrap(),
            json!({"classRef": {"name": "small"}, "image": "app:1", "expireAfter": "10m",
                   "guestAgent": {"enabled": false}})
        );
        let bare: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM", "metadata": {"name": "v"}
        }))
        .unwrap();
        assert_eq!(bare.spec, ImpVMSpec::default());
    }
}
