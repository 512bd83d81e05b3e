//! Changes of a placed VM's own spec, rolled into its booking (`status.booking`): the node
//! agent boots exactly the booking, so an edit of the VM goes through here or nowhere.
//!
//! A field the VM sets itself that differs from its booking is taken into the booking. Image,
//! env, envFrom, runnerLayer, ciliumLayer and userData shape the boot: a change of one of them restarts a running
//! persistent VM with the new spec (the booking's `revision` goes up, the phase back to
//! `Scheduled`; the agent stops the old boot and starts the new one on the same node) with a
//! Normal Event `SpecChanged`. Probes, restartPolicy, expireAfter and imagePullSecrets take
//! effect without a restart. A field the VM does not set keeps its booked value (clearing the
//! VM's `env` does not empty the booked one), and edits to the VM's class or template never
//! reach a placed VM. What a placed VM was networked or restored with (networkRef,
//! networkGroup, lifecycle, snapshotRef) cannot change: admission refuses it
//! (`imp_api::validation::vm_update`).
//!
//! A new `classRef` or `templateRef` ([`changed_refs`]) is not rolled on the node: the VM may
//! change size, so it leaves its node (its agent stops and releases it, as for an eviction) and
//! is placed anew, resolved from its class and template as they are then, with a Normal Event
//! `SpecChanged`.
//!
//! An ephemeral VM (a job) is never restarted for an edit: its changes are booked for a run
//! that never comes, so they are not rolled at all (and admission refuses a new class or
//! template on a placed one).

use imp_api::vm::ImpVMSpec;

/// What an edit of a placed VM changes in its booking.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Rollout {
    /// The booking's new spec.
    pub spec: ImpVMSpec,
    /// The fields that changed, as the VM's spec names them.
    pub changed: Vec<&'static str>,
    /// Whether the VM must boot again to take them.
    pub restart: bool,
}

/// The rollout of `own` (the VM's spec now) into `booked` (its booking's spec), or `None` when
/// every field the VM sets is booked as it is.
pub(super) fn rollout(own: &ImpVMSpec, booked: &ImpVMSpec) -> Option<Rollout> {
    let mut spec = booked.clone();
    let mut changed = Vec::new();
    let mut restart = false;
    let mut take = |field: &'static str, boots: bool, differs: bool| {
        if differs {
            changed.push(field);
            restart |= boots;
        }
        differs
    };
    // The fields a template may give too, as the VM sets them (`mine`) and as booked (`was`).
    let (mine, was) = (&own.inherited, &booked.inherited);
    // An empty image counts as unset, as in resolution.
    let image = mine.image.as_deref().filter(|i| !i.is_empty());
    if take(
        "image",
        true,
        image.is_some() && image != was.image.as_deref(),
    ) {
        spec.inherited.image = image.map(str::to_owned);
    }
    if take("env", true, !own.env.is_empty() && own.env != booked.env) {
        spec.env.clone_from(&own.env);
    }
    let env_from = !own.env_from.is_empty() && own.env_from != booked.env_from;
    if take("envFrom", true, env_from) {
        spec.env_from.clone_from(&own.env_from);
    }
    let runner = mine.runner_layer.is_some() && mine.runner_layer != was.runner_layer;
    if take("runnerLayer", true, runner) {
        spec.inherited.runner_layer.clone_from(&mine.runner_layer);
    }
    let cilium = mine.cilium_layer.is_some() && mine.cilium_layer != was.cilium_layer;
    if take("ciliumLayer", true, cilium) {
        spec.inherited.cilium_layer.clone_from(&mine.cilium_layer);
    }
    let user_data = own.user_data.is_some() && own.user_data != booked.user_data;
    if take("userData", true, user_data) {
        spec.user_data.clone_from(&own.user_data);
    }
    let probes = mine.probes.is_some() && mine.probes != was.probes;
    if take("probes", false, probes) {
        spec.inherited.probes.clone_from(&mine.probes);
    }
    let policy = mine.restart_policy.is_some() && mine.restart_policy != was.restart_policy;
    if take("restartPolicy", false, policy) {
        spec.inherited
            .restart_policy
            .clone_from(&mine.restart_policy);
    }
    let expiry = mine.expire_after.is_some() && mine.expire_after != was.expire_after;
    if take("expireAfter", false, expiry) {
        spec.inherited.expire_after.clone_from(&mine.expire_after);
    }
    let secrets =
        !own.image_pull_secrets.is_empty() && own.image_pull_secrets != booked.image_pull_secrets;
    if take("imagePullSecrets", false, secrets) {
        spec.image_pull_secrets.clone_from(&own.image_pull_secrets);
    }
    (!changed.is_empty()).then_some(Rollout {
        spec,
        changed,
        restart,
    })
}

/// The references of `own` that differ from those it was `booked` with: `classRef` (when the
/// VM sets one; one inherited from its template is not the VM's) and `templateRef`. A VM whose
/// references changed is placed anew rather than rolled on its node: its size may change.
pub(super) fn changed_refs(own: &ImpVMSpec, booked: &ImpVMSpec) -> Vec<&'static str> {
    let mut changed = Vec::new();
    if own.class_ref.is_some() && own.class_ref != booked.class_ref {
        changed.push("classRef");
    }
    if own.template_ref != booked.template_ref {
        changed.push("templateRef");
    }
    changed
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> ImpVMSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn an_image_or_env_edit_restarts_and_a_probe_edit_does_not() {
        let booked = spec(
            json!({"image": "app:1", "env": [{"name": "A", "value": "1"}],
                                 "probes": {"httpCheck": {"enabled": true, "port": 80}}}),
        );
        let own = spec(json!({"image": "app:2", "env": [{"name": "A", "value": "1"}]}));
        let r = rollout(&own, &booked).unwrap();
        assert_eq!((r.changed.as_slice(), r.restart), (&["image"][..], true));
        assert_eq!(r.spec.inherited.image.as_deref(), Some("app:2"));
        assert!(
            r.spec.inherited.probes.is_some(),
            "a field the VM does not set keeps its booked value"
        );

        let own = spec(json!({"env": [{"name": "A", "value": "2"}],
                              "probes": {"httpCheck": {"enabled": false}}}));
        let r = rollout(&own, &booked).unwrap();
        assert_eq!(r.changed, ["env", "probes"]);
        assert!(r.restart);

        let own = spec(json!({"probes": {"httpCheck": {"enabled": false}},
                              "expireAfter": "1h"}));
        let r = rollout(&own, &booked).unwrap();
        assert_eq!(r.changed, ["probes", "expireAfter"]);
        assert!(!r.restart, "probes and expiry need no new boot");
        assert_eq!(r.spec.inherited.image.as_deref(), Some("app:1"));
    }

    #[test]
    fn a_new_layer_restarts() {
        let booked = spec(json!({"image": "app:1", "runnerLayer": "runner:1"}));
        let own = spec(json!({"runnerLayer": "runner:2", "ciliumLayer": "cilium:1"}));
        let r = rollout(&own, &booked).unwrap();
        assert_eq!(
            (r.changed.as_slice(), r.restart),
            (&["runnerLayer", "ciliumLayer"][..], true)
        );
        assert_eq!(r.spec.inherited.runner_layer.as_deref(), Some("runner:2"));
        assert_eq!(r.spec.inherited.cilium_layer.as_deref(), Some("cilium:1"));
    }

    #[test]
    fn nothing_to_roll_when_the_vm_sets_only_what_is_booked() {
        let booked = spec(json!({"image": "app:1", "env": [{"name": "A", "value": "1"}]}));
        assert_eq!(rollout(&spec(json!({"image": "app:1"})), &booked), None);
        // Inherited from a template (the VM sets no image): an edit of the template is not the
        // VM's, and its booking stands.
        assert_eq!(rollout(&spec(json!({})), &booked), None);
        assert_eq!(rollout(&spec(json!({"image": ""})), &booked), None);
    }

    #[test]
    fn a_changed_class_or_template_reference_is_named() {
        let booked = spec(json!({"classRef": {"name": "small"}, "image": "app:1"}));
        assert!(changed_refs(&spec(json!({"classRef": {"name": "small"}})), &booked).is_empty());
        assert_eq!(
            changed_refs(&spec(json!({"classRef": {"name": "big"}})), &booked),
            ["classRef"]
        );
        // From a template: its class is the template's, not the VM's.
        let from_template =
            spec(json!({"templateRef": {"name": "web"}, "classRef": {"name": "small"}}));
        assert!(
            changed_refs(
                &spec(json!({"templateRef": {"name": "web"}})),
                &from_template
            )
            .is_empty()
        );
        assert_eq!(
            changed_refs(
                &spec(json!({"templateRef": {"name": "api"}})),
                &from_template
            ),
            ["templateRef"]
        );
    }
}
