//! Schema adjustments where what schemars derives differs from the Go project's CRDs, applied
//! with `#[schemars(transform = ...)]` on the fields concerned (tests/go_compat.rs measures the
//! result against the Go CRDs themselves).

use schemars::Schema;
use serde_json::{Value, json};

/// Drops the `default` schemars derives from a `#[serde(default)]` field, for fields whose Go
/// counterpart has none: the value is still optional, but the API server stores what was written.
pub fn no_default(schema: &mut Schema) {
    schema.remove("default");
}

/// The pattern the Go project's CRDs put on restart-policy durations.
pub const GO_DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$";

/// A duration field that carries the Go project's duration pattern instead of ours.
pub fn go_duration_pattern(schema: &mut Schema) {
    schema.insert("pattern".to_owned(), json!(GO_DURATION_PATTERN));
}

/// A duration field the Go schema leaves a free string: its CEL rule (`duration(self)`, which
/// refuses what Go's time.ParseDuration cannot read) is the check, as in the Go project.
pub fn no_pattern(schema: &mut Schema) {
    schema.remove("pattern");
}

/// An object the API server stores as written, without a schema of its own: a copy of a type
/// whose schema (with its CEL rules) is already in the CRD elsewhere, such as the booked class
/// and spec in `ImpVM.status.booking` (its rules held when the originals were admitted; writing
/// them twice would double the CRD and its CEL cost).
pub fn opaque_object(schema: &mut Schema) {
    let description = schema.get("description").cloned();
    *schema = Schema::from(serde_json::Map::from_iter([
        ("type".to_owned(), json!("object")),
        (
            "x-kubernetes-preserve-unknown-fields".to_owned(),
            json!(true),
        ),
    ]));
    if let Some(d) = description {
        schema.insert("description".to_owned(), d);
    }
}

/// A `status.conditions` list: metav1.Condition, with `status` limited to True, False and
/// Unknown as in the Go project (k8s-openapi's schema leaves it a free string).
pub fn conditions(schema: &mut Schema) {
    if let Some(status) = schema
        .get_mut("items")
        .and_then(|i| i.get_mut("properties"))
        .and_then(|p| p.get_mut("status"))
        .and_then(Value::as_object_mut)
    {
        status.insert("enum".to_owned(), json!(["True", "False", "Unknown"]));
    }
}

/// `env` and `envFrom` (core/v1 EnvVar and EnvFromSource): as in the Go CRDs, the `name` of a
/// ConfigMap or Secret reference defaults to "" instead of being required, and a file key
/// reference's `optional` defaults to false.
pub fn core_env(schema: &mut Schema) {
    if let Some(items) = schema.get_mut("items") {
        patch_env(items);
    }
}

fn patch_env(v: &mut Value) {
    let Some(props) = v.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    for (key, child) in props.iter_mut() {
        match key.as_str() {
            "configMapKeyRef" | "secretKeyRef" | "configMapRef" | "secretRef" => {
                name_defaults_to_empty(child)
            }
            "fileKeyRef" => {
                if let Some(optional) = child.pointer_mut("/properties/optional") {
                    optional["default"] = json!(false);
                }
            }
            _ => patch_env(child),
        }
    }
}

/// A core/v1 LocalObjectReference-style object: `name` optional with default "".
fn name_defaults_to_empty(obj: &mut Value) {
    if let Some(required) = obj.get_mut("required").and_then(Value::as_array_mut) {
        required.retain(|r| r != "name");
    }
    if obj["required"].as_array().is_some_and(Vec::is_empty)
        && let Some(o) = obj.as_object_mut()
    {
        o.remove("required");
    }
    if let Some(name) = obj.pointer_mut("/properties/name") {
        name["default"] = json!("");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_refs_lose_required_name_and_default_it() {
        let mut s = Schema::try_from(
            json!({"type": "array", "items": {"properties": {"valueFrom": {"properties": {
                "secretKeyRef": {"properties": {"key": {"type": "string"}, "name": {"type": "string"}},
                                 "required": ["key", "name"]},
                "configMapKeyRef": {"properties": {"name": {"type": "string"}}, "required": ["name"]},
                "fileKeyRef": {"properties": {"optional": {"type": "boolean"}}}
            }}}}}),
        )
        .unwrap();
        core_env(&mut s);
        let v = s.as_value();
        let from = &v["items"]["properties"]["valueFrom"]["properties"];
        assert_eq!(from["secretKeyRef"]["required"], json!(["key"]));
        assert_eq!(
            from["secretKeyRef"]["properties"]["name"]["default"],
            json!("")
        );
        assert!(from["configMapKeyRef"].get("required").is_none());
        assert_eq!(
            from["fileKeyRef"]["properties"]["optional"]["default"],
            json!(false)
        );
    }

    #[test]
    fn condition_status_is_an_enum() {
        let mut s = Schema::try_from(
            json!({"type": "array", "items": {"properties": {"status": {"type": "string"}}}}),
        )
        .unwrap();
        conditions(&mut s);
        assert_eq!(
            s.as_value()["items"]["properties"]["status"]["enum"],
            json!(["True", "False", "Unknown"])
        );
    }
}
