//! Structural OpenAPI v3 schemas of CRDs: pruning, defaulting and validation, with the field
//! paths and messages the real server gives.

use serde_json::{Map, Value};

use crate::error::Cause;

fn types(s: &Value) -> Option<&str> {
    s.get("type").and_then(Value::as_str)
}

fn flag(s: &Value, key: &str) -> bool {
    s.get(key).and_then(Value::as_bool).unwrap_or(false)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Renders a value the way Kubernetes field errors print it.
pub fn show(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Object(_) => "\"object\"".into(),
        Value::Array(_) => "\"array\"".into(),
        Value::Null => "\"null\"".into(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
            _ => n.to_string(),
        },
        other => other.to_string(),
    }
}

/// Drops fields the schema does not declare, and nulls in non-nullable fields.
pub fn prune(v: &mut Value, s: &Value, root: bool) {
    match v {
        Value::Object(m) => {
            let props = s.get("properties").and_then(Value::as_object);
            let addl = s.get("additionalProperties");
            let preserve = flag(s, "x-kubernetes-preserve-unknown-fields");
            let keys: Vec<String> = m.keys().cloned().collect();
            for k in keys {
                if root && (k == "apiVersion" || k == "kind" || k == "metadata") {
                    continue;
                }
                let child_schema = props
                    .and_then(|p| p.get(&k))
                    .or_else(|| addl.filter(|a| a.is_object()));
                match child_schema {
                    Some(cs) => {
                        let null_ok = flag(cs, "nullable");
                        let drop = m.get(&k).is_some_and(|c| c.is_null()) && !null_ok;
                        if drop {
                            m.remove(&k);
                        } else if let Some(c) = m.get_mut(&k) {
                            prune(c, cs, false);
                        }
                    }
                    None => {
                        let keep = preserve || addl.and_then(Value::as_bool) == Some(true);
                        if !keep {
                            m.remove(&k);
                        }
                    }
                }
            }
        }
        Value::Array(a) => {
            if let Some(items) = s.get("items") {
                for e in a.iter_mut() {
                    prune(e, items, false);
                }
            }
        }
        _ => {}
    }
}

/// Fills missing fields that declare a `default`, recursively.
pub fn apply_defaults(v: &mut Value, s: &Value) {
    match v {
        Value::Object(m) => {
            if let Some(props) = s.get("properties").and_then(Value::as_object) {
                for (k, ps) in props {
                    if !m.contains_key(k)
                        && let Some(d) = ps.get("default")
                    {
                        m.insert(k.clone(), d.clone());
                    }
                    if let Some(c) = m.get_mut(k) {
                        apply_defaults(c, ps);
                    }
                }
            }
            if let Some(addl) = s.get("additionalProperties").filter(|a| a.is_object()) {
                for (_, c) in m.iter_mut() {
                    apply_defaults(c, addl);
                }
            }
        }
        Value::Array(a) => {
            if let Some(items) = s.get("items") {
                for e in a.iter_mut() {
                    apply_defaults(e, items);
                }
            }
        }
        _ => {}
    }
}

fn type_ok(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        _ => true,
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Object(_) => "object",
        Value::Array(_) => "array",
        Value::String(_) => "string",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::Null => "null",
    }
}

fn format_ok(format: &str, s: &str) -> bool {
    match format {
        "date-time" => is_date_time(s),
        "date" => s.len() == 10 && is_date_time(&format!("{s}T00:00:00Z")),
        "uuid" => {
            let parts: Vec<&str> = s.split('-').collect();
            parts.iter().map(|p| p.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
                && parts
                    .iter()
                    .all(|p| p.chars().all(|c| c.is_ascii_hexdigit()))
        }
        "ipv4" => s.parse::<std::net::Ipv4Addr>().is_ok(),
        "ipv6" => s.parse::<std::net::Ipv6Addr>().is_ok(),
        "byte" => s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+' || c == '/' || c == '='),
        "int32" | "int64" | "" => true,
        _ => true,
    }
}

fn is_date_time(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() < 20 {
        return false;
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && (b[10] == b'T' || b[10] == b't')
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
}

/// Checks `v` against the schema `s` at `path`, appending one cause per failing field.
pub fn validate(v: &Value, s: &Value, path: &str, out: &mut Vec<Cause>) {
    if v.is_null() {
        return;
    }
    let int_or_string = flag(s, "x-kubernetes-int-or-string");
    if int_or_string {
        if !(v.is_i64() || v.is_u64() || v.is_string()) {
            out.push(Cause::new(
                "FieldValueTypeInvalid",
                path,
                format!(
                    "Invalid value: {}: {path} in body must be of type integer,string: {:?}",
                    show(v),
                    json_type(v)
                ),
            ));
            return;
        }
    } else if let Some(t) = types(s)
        && !type_ok(v, t)
    {
        out.push(Cause::new(
            "FieldValueTypeInvalid",
            path,
            format!(
                "Invalid value: {}: {path} in body must be of type {t}: {:?}",
                show(v),
                json_type(v)
            ),
        ));
        return;
    }
    if let Some(en) = s.get("enum").and_then(Value::as_array)
        && !en.contains(v)
    {
        let supported: Vec<String> = en.iter().map(show).collect();
        out.push(Cause::new(
            "FieldValueNotSupported",
            path,
            format!(
                "Unsupported value: {}: supported values: {}",
                show(v),
                supported.join(", ")
            ),
        ));
    }
    if let Some(n) = v.as_f64() {
        let excl_min = flag(s, "exclusiveMinimum");
        let excl_max = flag(s, "exclusiveMaximum");
        if let Some(min) = s.get("minimum").and_then(Value::as_f64) {
            let bad = if excl_min { n <= min } else { n < min };
            if bad {
                let rel = if excl_min {
                    "greater than"
                } else {
                    "greater than or equal to"
                };
                out.push(Cause::new(
                    "FieldValueInvalid",
                    path,
                    format!(
                        "Invalid value: {}: {path} in body should be {rel} {}",
                        show(v),
                        show(&s["minimum"])
                    ),
                ));
            }
        }
        if let Some(max) = s.get("maximum").and_then(Value::as_f64) {
            let bad = if excl_max { n >= max } else { n > max };
            if bad {
                let rel = if excl_max {
                    "less than"
                } else {
                    "less than or equal to"
                };
                out.push(Cause::new(
                    "FieldValueInvalid",
                    path,
                    format!(
                        "Invalid value: {}: {path} in body should be {rel} {}",
                        show(v),
                        show(&s["maximum"])
                    ),
                ));
            }
        }
    }
    if let Some(st) = v.as_str() {
        let len = st.chars().count() as u64;
        if let Some(min) = s.get("minLength").and_then(Value::as_u64)
            && len < min
        {
            out.push(Cause::new(
                "FieldValueInvalid",
                path,
                format!(
                    "Invalid value: {}: {path} in body should be at least {min} chars long",
                    show(v)
                ),
            ));
        }
        if let Some(max) = s.get("maxLength").and_then(Value::as_u64)
            && len > max
        {
            out.push(Cause::new(
                "FieldValueTooLong",
                path,
                format!("Too long: may not be more than {max} bytes"),
            ));
        }
        if let Some(p) = s.get("pattern").and_then(Value::as_str) {
            match regex::Regex::new(p) {
                Ok(re) if !re.is_match(st) => out.push(Cause::new(
                    "FieldValueInvalid",
                    path,
                    format!(
                        "Invalid value: {}: {path} in body should match '{p}'",
                        show(v)
                    ),
                )),
                _ => {}
            }
        }
        if let Some(f) = s.get("format").and_then(Value::as_str)
            && !format_ok(f, st)
        {
            out.push(Cause::new(
                "FieldValueInvalid",
                path,
                format!(
                    "Invalid value: {}: {path} in body must be of type {f}: {}",
                    show(v),
                    show(v)
                ),
            ));
        }
    }
    if let Some(a) = v.as_array() {
        if let Some(min) = s.get("minItems").and_then(Value::as_u64)
            && (a.len() as u64) < min
        {
            out.push(Cause::new(
                "FieldValueInvalid",
                path,
                format!(
                    "Invalid value: {}: {path} in body should have at least {min} items",
                    a.len()
                ),
            ));
        }
        if let Some(max) = s.get("maxItems").and_then(Value::as_u64)
            && (a.len() as u64) > max
        {
            out.push(Cause::new(
                "FieldValueTooMany",
                path,
                format!("Too many: {}: must have at most {max} items", a.len()),
            ));
        }
        if let Some(items) = s.get("items") {
            for (i, e) in a.iter().enumerate() {
                validate(e, items, &format!("{path}[{i}]"), out);
            }
        }
    }
    if let Some(m) = v.as_object() {
        if let Some(req) = s.get("required").and_then(Value::as_array) {
            for r in req.iter().filter_map(Value::as_str) {
                if m.get(r).is_none_or(Value::is_null) {
                    out.push(Cause::new(
                        "FieldValueRequired",
                        &join(path, r),
                        "Required value",
                    ));
                }
            }
        }
        if let Some(min) = s.get("minProperties").and_then(Value::as_u64)
            && (m.len() as u64) < min
        {
            out.push(Cause::new(
                "FieldValueInvalid",
                path,
                format!("{path} in body should have at least {min} properties"),
            ));
        }
        if let Some(max) = s.get("maxProperties").and_then(Value::as_u64)
            && (m.len() as u64) > max
        {
            out.push(Cause::new(
                "FieldValueTooMany",
                path,
                format!("Too many: {}: must have at most {max} items", m.len()),
            ));
        }
        let props = s.get("properties").and_then(Value::as_object);
        let addl = s.get("additionalProperties").filter(|a| a.is_object());
        for (k, c) in m {
            if path.is_empty() && k == "metadata" {
                continue;
            }
            if let Some(cs) = props.and_then(|p| p.get(k)).or(addl) {
                validate(c, cs, &join(path, k), out);
            }
        }
    }
    if let Some(all) = s.get("allOf").and_then(Value::as_array) {
        for sub in all {
            validate(v, sub, path, out);
        }
    }
}

/// Finds problems that make a CRD schema unusable (bad patterns), as messages.
pub fn check(s: &Value, path: &str, out: &mut Vec<String>) {
    if let Some(p) = s.get("pattern").and_then(Value::as_str)
        && let Err(e) = regex::Regex::new(p)
    {
        out.push(format!("{path}.pattern: Invalid value: {p:?}: {e}"));
    }
    if let Some(props) = s.get("properties").and_then(Value::as_object) {
        for (k, c) in props {
            check(c, &format!("{path}.properties[{k}]"), out);
        }
    }
    if let Some(items) = s.get("items") {
        check(items, &format!("{path}.items"), out);
    }
    if let Some(a) = s.get("additionalProperties").filter(|a| a.is_object()) {
        check(a, &format!("{path}.additionalProperties"), out);
    }
}

/// Returns the schema of the object's root as stored in a CRD version.
pub fn version_schema(version: &Value) -> Value {
    version
        .pointer("/schema/openAPIV3Schema")
        .cloned()
        .unwrap_or_else(|| {
            let mut m = Map::new();
            m.insert("type".into(), "object".into());
            m.insert("x-kubernetes-preserve-unknown-fields".into(), true.into());
            Value::Object(m)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {"spec": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "pattern": "^[a-z]+$"},
            "vcpu": {"type": "integer", "minimum": 1, "default": 1},
            "mode": {"type": "string", "enum": ["a", "b"]},
            "port": {"x-kubernetes-int-or-string": true},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
        }}}})
    }

    #[test]
    fn prune_default_validate() {
        let s = schema();
        let mut v = json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n"}, "spec": {"image": "abc", "junk": 1, "port": "http", "labels": {"a": "b"}, "extra": {"k": 1}, "mode": null}});
        prune(&mut v, &s, true);
        apply_defaults(&mut v, &s);
        assert_eq!(
            v["spec"],
            json!({"image": "abc", "port": "http", "labels": {"a": "b"}, "extra": {"k": 1}, "vcpu": 1})
        );
        let mut out = Vec::new();
        validate(&v, &s, "", &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn messages_name_the_field() {
        let s = schema();
        let v = json!({"spec": {"image": "ABC", "vcpu": 0, "mode": "c"}});
        let mut out = Vec::new();
        validate(&v, &s, "", &mut out);
        let msgs: Vec<String> = out
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        assert!(msgs.contains(&"spec.vcpu: Invalid value: 0: spec.vcpu in body should be greater than or equal to 1".to_string()), "{msgs:?}");
        assert!(
            msgs.contains(
                &"spec.mode: Unsupported value: \"c\": supported values: \"a\", \"b\"".to_string()
            ),
            "{msgs:?}"
        );
        assert!(
            msgs.iter()
                .any(|m| m.starts_with("spec.image: Invalid value: \"ABC\""))
        );
        let mut out = Vec::new();
        validate(&json!({"spec": {}}), &s, "", &mut out);
        assert_eq!(out[0].field, "spec.image");
    }
}
