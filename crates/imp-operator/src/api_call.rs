//! What the per-kind controllers share when they call the API: a failed call, saying what it
//! was doing and to which object; the patch parameters of their writes; and the Event they
//! publish about an object, and its publication.

use imp_api::refusal;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::api::PatchParams;
use kube::runtime::events::{Event, EventType, Recorder};

use crate::FIELD_MANAGER;

/// An API call failed.
#[derive(Debug, thiserror::Error)]
#[error("Kubernetes API call failed while {doing} {what}")]
pub struct Error {
    /// What was being done, e.g. "writing the status of".
    pub doing: &'static str,
    /// The object: its kind and namespace/name.
    pub what: String,
    /// The API error.
    #[source]
    pub source: kube::Error,
}

impl Error {
    /// Short label for the reconcile-error metric: `forbidden` for an RBAC refusal, else `api`.
    pub fn metric_label(&self) -> &'static str {
        match &self.source {
            kube::Error::Api(s) if refusal::forbidden(s).is_some() => "forbidden",
            _ => "api",
        }
    }
}

/// Turns the error of a call made while `doing` to `kind` `key` (namespace/name) into an
/// [`Error`].
pub fn failed(
    doing: &'static str,
    kind: &'static str,
    key: String,
) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error {
        doing,
        what: format!("{kind} {key}"),
        source,
    }
}

/// The parameters of a controller's patch: under the operator's field manager.
pub fn params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..Default::default()
    }
}

/// The Event `reason` (also its action) saying `message`, Warning or Normal, about an object
/// whose Event may name a related object of kind `K`: `related` in `namespace`. Naming it
/// also keeps apart Events of one reason about different related objects (the recorder folds
/// repeats of a reason about the same objects into a series that keeps the first message).
pub fn event<K: Resource<DynamicType = ()>>(
    warning: bool,
    reason: &str,
    message: &str,
    related: Option<&str>,
    namespace: Option<String>,
) -> Event {
    Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_owned(),
        note: Some(message.to_owned()),
        action: reason.to_owned(),
        secondary: related.map(|name| ObjectReference {
            api_version: Some(K::api_version(&()).into_owned()),
            kind: Some(K::kind(&()).into_owned()),
            name: Some(name.to_owned()),
            namespace,
            ..ObjectReference::default()
        }),
    }
}

/// Publishes `event` about the object `regarding`; a failure is logged, never returned (an
/// Event is not worth failing a reconcile for).
pub async fn publish(recorder: &Recorder, event: &Event, regarding: &ObjectReference) {
    if let Err(e) = recorder.publish(event, regarding).await {
        tracing::warn!(
            kind = regarding.kind.as_deref().unwrap_or_default(),
            namespace = regarding.namespace.as_deref().unwrap_or_default(),
            name = regarding.name.as_deref().unwrap_or_default(),
            reason = %event.reason,
            error = %imp_api::chain::DisplayChain(&e),
            "publishing event failed"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    #[test]
    fn the_error_names_the_call_and_object_and_tells_rbac_apart() {
        let e = failed("writing the status of", "ImpWarmPool", "ci/py".into())(kube::Error::Api(
            Box::new(Status::failure("no", "Forbidden").with_code(403)),
        ));
        assert_eq!(
            e.to_string(),
            "Kubernetes API call failed while writing the status of ImpWarmPool ci/py"
        );
        assert_eq!(e.metric_label(), "forbidden");
        let e = failed("reading", "ImpVMSnapshot", "ci/s".into())(kube::Error::Api(Box::new(
            Status::failure("gone", "Conflict").with_code(409),
        )));
        assert_eq!(e.metric_label(), "api");
    }

    #[test]
    fn an_event_names_its_related_object_of_the_kind_given() {
        let ev = event::<imp_api::vm::ImpVM>(true, "Claimed", "m", Some("py-a"), Some("ci".into()));
        assert_eq!(
            (ev.type_, ev.reason.as_str(), ev.action.as_str()),
            (EventType::Warning, "Claimed", "Claimed")
        );
        let related = ev.secondary.unwrap();
        assert_eq!(
            (
                related.kind.as_deref(),
                related.name.as_deref(),
                related.namespace.as_deref()
            ),
            (Some("ImpVM"), Some("py-a"), Some("ci"))
        );
        assert!(
            event::<imp_api::vm::ImpVM>(false, "R", "m", None, None)
                .secondary
                .is_none()
        );
    }
}
