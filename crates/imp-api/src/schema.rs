//! Schema adjustments where what schemars derives differs from the Go project's CRDs, applied
//! with `#[schemars(transform = ...)]` on the fields concerned (tests/go_compat.rs measures the
//! result against the Go CRDs themselves), and the CEL rules of the specs that may be absent.
//!
//! Those specs (`spec_may_be_absent!`) carry `#[serde(remote = "Self")]`; kube's `KubeSchema`
//! derive would copy that onto a private twin of the struct whose serde code nobody calls, so
//! their rules are added here, exactly as `#[x_kube(validation)]` adds them
//! (`kube::core::validate`), and they derive plain `JsonSchema`.

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

/// Appends CEL rule `rule`, with `message`, to `schema`'s `x-kubernetes-validations`.
fn add_rule(schema: &mut Schema, rule: kube::core::Rule) {
    // Serialising a Rule (strings and an optional enum) cannot fail.
    let _ = kube::core::validate(schema, rule);
}

fn rule(cel: &str, message: &str) -> kube::core::Rule {
    kube::core::Rule::new(cel).message(message)
}

/// `expireAfter`: a free string (its CEL rule is the check) of 0 (never) or at least 60s.
pub fn expire_after(schema: &mut Schema) {
    no_pattern(schema);
    add_rule(
        schema,
        rule(
            "duration(self) == duration('0s') || duration(self) >= duration('60s')",
            "must be 0 or at least 60s",
        ),
    );
}

/// `ImpVM.spec.idleTimeout`: a free string of at least 10s.
pub fn idle_timeout(schema: &mut Schema) {
    no_pattern(schema);
    add_rule(
        schema,
        rule("duration(self) >= duration('10s')", "must be at least 10s"),
    );
}

/// `ImpVM.spec`: a class or a template, and an image unless a template gives one.
pub fn vm_spec(schema: &mut Schema) {
    add_rule(
        schema,
        rule(
            "has(self.classRef) != has(self.templateRef)",
            "exactly one of spec.classRef or spec.templateRef must be set",
        ),
    );
    add_rule(
        schema,
        rule(
            "has(self.templateRef) || (has(self.image) && self.image != '')",
            "spec.image is required when spec.classRef is used without a template",
        ),
    );
}

/// `ImpNetwork.spec`: a cilium pool names its pool.
pub fn network_spec(schema: &mut Schema) {
    add_rule(
        schema,
        rule(
            "!has(self.ipam) || self.ipam.provider != 'cilium' || (has(self.ipam.cilium) && has(self.ipam.cilium.poolRef) && self.ipam.cilium.poolRef != '')",
            "spec.ipam.cilium.poolRef is required when spec.ipam.provider is cilium",
        ),
    );
}

/// `ImpVMRunnerPool.spec`: the scaling rules of github-actions pools, as in the Go project's CRD.
pub fn runner_pool_spec(schema: &mut Schema) {
    const GITHUB: &str = "self.platform.type != 'github-actions' || ";
    let rules = [
        (
            "has(self.scaling)",
            "spec.scaling is required for github-actions",
        ),
        (
            "!has(self.scaling) || has(self.scaling.mode)",
            "spec.scaling.mode is required for github-actions",
        ),
        (
            "!has(self.scaling) || (has(self.scaling.minIdle) && has(self.scaling.maxConcurrent) && has(self.scaling.scaleUpStep) && has(self.scaling.cooldownSeconds))",
            "spec.scaling.minIdle, maxConcurrent, scaleUpStep and cooldownSeconds must all be set for github-actions",
        ),
        (
            "!has(self.scaling) || !has(self.scaling.minIdle) || !has(self.scaling.maxConcurrent) || self.scaling.minIdle <= self.scaling.maxConcurrent",
            "spec.scaling.minIdle must not exceed spec.scaling.maxConcurrent",
        ),
        (
            "!has(self.scaling) || !has(self.scaling.mode) || self.scaling.mode == 'webhook' || has(self.scaling.polling)",
            "spec.scaling.polling is required for polling and hybrid modes",
        ),
        (
            "!has(self.scaling) || !has(self.scaling.mode) || self.scaling.mode == 'polling' || (has(self.scaling.webhook) && has(self.scaling.webhook.secretRef) && size(self.scaling.webhook.secretRef) > 0)",
            "spec.scaling.webhook.secretRef is required for webhook and hybrid modes",
        ),
    ];
    for (cel, message) in rules {
        add_rule(schema, rule(&format!("{GITHUB}{cel}"), message));
    }
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
