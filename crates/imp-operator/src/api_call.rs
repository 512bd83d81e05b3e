//! A controller's failed Kubernetes API call, saying what it was doing and to which object,
//! and the patch parameters of the controllers' writes.

use imp_api::refusal;
use kube::api::PatchParams;

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
}
