//! API errors, rendered as `Status` objects shaped like the real API server's.

use serde_json::{Value, json};

/// Result of an API operation; the error is what the client receives.
pub type Result<T, E = ApiError> = std::result::Result<T, E>;

/// One failing field inside an `Invalid` (422) error.
#[derive(Debug, Clone, PartialEq)]
pub struct Cause {
    /// Machine-readable reason, e.g. `FieldValueInvalid`.
    pub reason: String,
    /// Message without the field path, e.g. `Invalid value: 0: ...`.
    pub message: String,
    /// Dotted field path, e.g. `spec.vcpu`.
    pub field: String,
}

impl Cause {
    /// Builds a cause; the reason says what kind of field error it is.
    pub fn new(reason: &str, field: &str, message: impl Into<String>) -> Self {
        Self {
            reason: reason.to_string(),
            message: message.into(),
            field: field.to_string(),
        }
    }
}

/// An error answered to the client as a `Status` with an HTTP code.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// `Status.reason`, e.g. `NotFound`.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
    /// `Status.details`, or null.
    pub details: Value,
}

/// Names the resource an error is about, for messages and `details`.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// API group ("" for core).
    pub group: &'a str,
    /// Plural resource name, e.g. `configmaps`.
    pub plural: &'a str,
    /// Kind, e.g. `ConfigMap`.
    pub kind: &'a str,
}

impl Target<'_> {
    fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
    fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }
}

impl ApiError {
    fn with(code: u16, reason: &'static str, message: String, details: Value) -> Self {
        Self {
            code,
            reason,
            message,
            details,
        }
    }

    /// 404 for an object that does not exist.
    pub fn not_found(t: Target<'_>, name: &str) -> Self {
        Self::with(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", t.qualified()),
            json!({"name": name, "group": t.group, "kind": t.plural}),
        )
    }

    /// 404 for a path that names no resource.
    pub fn no_route(path: &str) -> Self {
        Self::with(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
            json!({}),
        )
    }

    /// 409 for a create whose name is taken.
    pub fn already_exists(t: Target<'_>, name: &str) -> Self {
        Self::with(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", t.qualified()),
            json!({"name": name, "group": t.group, "kind": t.plural}),
        )
    }

    /// 409 for a write based on a stale resourceVersion or a failed precondition.
    pub fn conflict(t: Target<'_>, name: &str, why: &str) -> Self {
        Self::with(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                t.qualified()
            ),
            json!({"name": name, "group": t.group, "kind": t.plural}),
        )
    }

    /// 409 for a server-side apply that touches fields another manager owns.
    pub fn apply_conflict(t: Target<'_>, name: &str, conflicts: &[(String, String)]) -> Self {
        let list: Vec<String> = conflicts
            .iter()
            .map(|(m, f)| format!("conflict with \"{m}\": {f}"))
            .collect();
        let message = if list.len() == 1 {
            format!("Apply failed with 1 conflict: {}", list[0])
        } else {
            format!(
                "Apply failed with {} conflicts: {}",
                list.len(),
                list.join("\n")
            )
        };
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(m, f)| {
                json!({"reason": "FieldManagerConflict", "message": format!("conflict with \"{m}\""), "field": f})
            })
            .collect();
        Self::with(
            409,
            "Conflict",
            message,
            json!({"name": name, "group": t.group, "kind": t.plural, "causes": causes}),
        )
    }

    /// 422 for an object that fails validation, listing each failing field.
    pub fn invalid(t: Target<'_>, name: &str, causes: &[Cause]) -> Self {
        let parts: Vec<String> = causes
            .iter()
            .map(|c| {
                if c.field.is_empty() {
                    c.message.clone()
                } else {
                    format!("{}: {}", c.field, c.message)
                }
            })
            .collect();
        let joined = if parts.len() == 1 {
            parts[0].clone()
        } else {
            format!("[{}]", parts.join(", "))
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
            .collect();
        Self::with(
            422,
            "Invalid",
            format!("{} \"{name}\" is invalid: {joined}", t.qualified_kind()),
            json!({"name": name, "group": t.group, "kind": t.kind, "causes": causes}),
        )
    }

    /// 400 for a malformed request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::with(400, "BadRequest", message.into(), Value::Null)
    }

    /// 405 for a verb the resource does not support.
    pub fn method_not_allowed() -> Self {
        Self::with(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource".into(),
            Value::Null,
        )
    }

    /// 410 for a watch or list from a resourceVersion older than the retained history.
    pub fn gone(message: impl Into<String>) -> Self {
        Self::with(410, "Expired", message.into(), Value::Null)
    }

    /// 401 for a missing or unknown bearer token.
    pub fn unauthorized() -> Self {
        Self::with(401, "Unauthorized", "Unauthorized".into(), Value::Null)
    }

    /// 415 for a patch content type the server does not know.
    pub fn unsupported_media_type(ct: &str) -> Self {
        Self::with(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {ct})"
            ),
            Value::Null,
        )
    }

    /// 500 for a bug in this server.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::with(500, "InternalError", message.into(), Value::Null)
    }

    /// The `Status` object the client receives.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if !self.details.is_null() {
            s["details"] = self.details.clone();
        }
        s
    }
}
