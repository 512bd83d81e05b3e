//! Kinds no controller acts on yet (`imp_api::unsupported::NO_CONTROLLER_KINDS`): the
//! admission webhook refuses them, and this watcher says so on every one that reached the API
//! without it (webhook off, a by-hand install, an object older than the webhook), so none is
//! stored and silently ignored.
//!
//! Each object gets `Ready=False`, reason [`REASON`], the webhook's own message, for its
//! current generation, and one Warning Event. [`refusal`] decides, [`run`] applies.

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

/// The condition's reason.
pub const REASON: &str = "NotSupported";

/// The field manager of these status writes.
pub const FIELD_MANAGER: &str = "imp-operator-unsupported";

/// The status patch that says `kind` is not supported on `obj`, or `None` when its status
/// already says so for its generation (a relist writes nothing). `now` stamps a new condition.
pub fn refusal(kind: &str, obj: &DynamicObject, now: Timestamp) -> Option<Value> {
    let message = imp_api::unsupported::kind(kind)?;
    let generation = obj.metadata.generation;
    let status = obj.data.get("status");
    let said = status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            c.get("type") == Some(&json!("Ready"))
                && c.get("reason") == Some(&json!(REASON))
                && c.get("observedGeneration").and_then(Value::as_i64) == generation
        });
    if said {
        return None;
    }
    let mut condition = json!({
        "type": "Ready",
        "status": "False",
        "reason": REASON,
        "message": message,
        "lastTransitionTime": now.to_string(),
    });
    if let Some(g) = generation {
        condition["observedGeneration"] = json!(g);
    }
    let mut conditions: Vec<Value> = status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    conditions.retain(|c| c.get("type") != Some(&json!("Ready")));
    conditions.push(condition);
    Some(json!({ "status": { "conditions": conditions } }))
}

/// Watches every kind with no controller, in every namespace, and writes [`refusal`] on each
/// object that needs it, until `shutdown`.
pub async fn run(
    client: kube::Client,
    instance: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        },
    );
    let watches = imp_api::unsupported::NO_CONTROLLER_KINDS
        .map(|kind| Box::pin(watch_kind(client.clone(), recorder.clone(), kind)));
    tokio::select! {
        _ = futures::future::join_all(watches) => {}
        () = shutdown => {}
    }
}

/// The watch of one kind with no controller.
async fn watch_kind(client: kube::Client, recorder: Recorder, kind: &'static str) {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("imp.dev", "v1alpha1", kind));
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let mut objects = Box::pin(
        watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects(),
    );
    while let Some(obj) = objects.next().await {
        match obj {
            Ok(obj) => refuse(&client, &recorder, &resource, kind, &obj).await,
            Err(e) => {
                tracing::warn!(kind, error = %imp_api::chain::DisplayChain(&e), "watching a kind with no controller");
            }
        }
    }
}

/// Writes the refusal on `obj` if it needs it, with one Warning Event.
async fn refuse(
    client: &kube::Client,
    recorder: &Recorder,
    resource: &ApiResource,
    kind: &str,
    obj: &DynamicObject,
) {
    let Some(body) = refusal(kind, obj, Timestamp::now()) else {
        return;
    };
    let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, resource);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..Default::default()
    };
    match api.patch_status(&name, &params, &Patch::Merge(&body)).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return,
        Err(e) => {
            tracing::warn!(kind, namespace = %ns, name = %name, error = %imp_api::chain::DisplayChain(&e), "writing that a kind has no controller");
            return;
        }
    }
    tracing::info!(kind, namespace = %ns, name = %name, "refused: no controller acts on this kind");
    let note = imp_api::unsupported::kind(kind).unwrap_or_default();
    let event = Event {
        type_: EventType::Warning,
        reason: REASON.to_owned(),
        note: Some(note),
        action: "Refuse".to_owned(),
        secondary: None,
    };
    crate::api_call::publish(recorder, &event, &obj.object_ref(resource)).await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn obj(generation: i64, status: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1",
            "kind": "ImpVMRunnerPool",
            "metadata": {"name": "p", "namespace": "ns", "generation": generation},
            "spec": {},
            "status": status
        }))
        .unwrap()
    }

    #[test]
    fn each_kind_without_a_controller_is_refused_once_per_generation() {
        let now = Timestamp::UNIX_EPOCH;
        for kind in imp_api::unsupported::NO_CONTROLLER_KINDS {
            let body = refusal(kind, &obj(1, json!({})), now).unwrap();
            let c = &body["status"]["conditions"][0];
            assert_eq!(c["type"], "Ready");
            assert_eq!(c["status"], "False");
            assert_eq!(c["reason"], REASON);
            assert_eq!(c["observedGeneration"], 1);
            assert!(
                c["message"].as_str().unwrap().starts_with(kind)
                    && c["message"]
                        .as_str()
                        .unwrap()
                        .contains(imp_api::unsupported::NOT_SUPPORTED_YET),
                "{c}"
            );
            // Written: a relist writes nothing; a new generation is refused again.
            let said = obj(1, body["status"].clone());
            assert_eq!(refusal(kind, &said, now), None);
            let edited = obj(2, body["status"].clone());
            let again = refusal(kind, &edited, now).unwrap();
            assert_eq!(again["status"]["conditions"].as_array().unwrap().len(), 1);
            assert_eq!(again["status"]["conditions"][0]["observedGeneration"], 2);
        }
    }

    #[test]
    fn other_conditions_are_kept() {
        let now = Timestamp::UNIX_EPOCH;
        let other = json!({"type": "Progressing", "status": "True", "reason": "X", "message": ""});
        let body = refusal(
            "ImpVMRunnerPool",
            &obj(3, json!({"conditions": [other]})),
            now,
        )
        .unwrap();
        let conds = body["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 2);
        assert_eq!(conds[0], other);
        assert!(body["status"].get("phase").is_none());
    }

    #[test]
    fn a_kind_with_a_controller_is_left_alone() {
        for kind in ["ImpVM", "ImpWarmPool"] {
            assert_eq!(
                refusal(kind, &obj(1, json!({})), Timestamp::UNIX_EPOCH),
                None,
                "{kind}"
            );
        }
    }
}
