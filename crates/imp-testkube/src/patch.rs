//! Patch formats: JSON merge patch, JSON patch, strategic merge patch, and the field sets
//! server-side apply tracks in `managedFields`.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::error::{ApiError, Result};

/// The patch formats the server accepts, by content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/merge-patch+json` (RFC 7386).
    Merge,
    /// `application/json-patch+json` (RFC 6902).
    Json,
    /// `application/strategic-merge-patch+json`.
    Strategic,
    /// `application/apply-patch+yaml` (server-side apply).
    Apply,
}

impl PatchKind {
    /// Maps a Content-Type header to a patch kind.
    pub fn from_content_type(ct: &str) -> Result<Self> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/merge-patch+json" => Ok(Self::Merge),
            "application/json-patch+json" => Ok(Self::Json),
            "application/strategic-merge-patch+json" => Ok(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Ok(Self::Apply),
            _ => Err(ApiError::unsupported_media_type(ct)),
        }
    }
}

/// Applies an RFC 7386 merge patch to `target`.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn unescape(tok: &str) -> String {
    tok.replace("~1", "/").replace("~0", "~")
}

fn pointer_parent<'a>(doc: &'a mut Value, path: &str) -> Result<(&'a mut Value, String)> {
    if path.is_empty() {
        return Err(ApiError::bad_request(
            "json patch: cannot operate on the root",
        ));
    }
    let (parent, last) = path
        .rsplit_once('/')
        .ok_or_else(|| ApiError::bad_request(format!("json patch: bad path {path:?}")))?;
    let p = doc
        .pointer_mut(parent)
        .ok_or_else(|| ApiError::bad_request(format!("json patch: missing path {parent:?}")))?;
    Ok((p, unescape(last)))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<()> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, key) = pointer_parent(doc, path)?;
    match parent {
        Value::Object(m) => {
            m.insert(key, value);
            Ok(())
        }
        Value::Array(a) => {
            let idx = if key == "-" {
                a.len()
            } else {
                key.parse::<usize>()
                    .map_err(|_| ApiError::bad_request(format!("json patch: bad index {key}")))?
            };
            if idx > a.len() {
                return Err(ApiError::bad_request(format!(
                    "json patch: index {idx} out of range"
                )));
            }
            a.insert(idx, value);
            Ok(())
        }
        _ => Err(ApiError::bad_request(format!(
            "json patch: parent of {path:?} is not a container"
        ))),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value> {
    let (parent, key) = pointer_parent(doc, path)?;
    let missing = || ApiError::bad_request(format!("json patch: missing path {path:?}"));
    match parent {
        Value::Object(m) => m.remove(&key).ok_or_else(missing),
        Value::Array(a) => {
            let idx = key.parse::<usize>().map_err(|_| missing())?;
            if idx >= a.len() {
                return Err(missing());
            }
            Ok(a.remove(idx))
        }
        _ => Err(missing()),
    }
}

/// Applies an RFC 6902 JSON patch (`add`, `remove`, `replace`, `move`, `copy`, `test`).
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<()> {
    let ops = ops
        .as_array()
        .ok_or_else(|| ApiError::bad_request("json patch must be an array of operations"))?;
    for op in ops {
        let kind = op.get("op").and_then(Value::as_str).unwrap_or("");
        let path = op.get("path").and_then(Value::as_str).unwrap_or("");
        let value = op.get("value").cloned().unwrap_or(Value::Null);
        let from = op.get("from").and_then(Value::as_str).unwrap_or("");
        match kind {
            "add" => add(target, path, value)?,
            "remove" => {
                remove(target, path)?;
            }
            "replace" => {
                let slot = target.pointer_mut(path).ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "the server rejected our request due to an error in our request: replace operation does not apply: doc is missing key: {path}"
                    ))
                })?;
                *slot = value;
            }
            "move" => {
                let v = remove(target, from)?;
                add(target, path, v)?;
            }
            "copy" => {
                let v = target
                    .pointer(from)
                    .cloned()
                    .ok_or_else(|| ApiError::bad_request(format!("json patch: missing {from}")))?;
                add(target, path, v)?;
            }
            "test" => {
                if target.pointer(path) != Some(&value) {
                    return Err(ApiError::invalid_test(path));
                }
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "json patch: unknown operation {other:?}"
                )));
            }
        }
    }
    Ok(())
}

impl ApiError {
    fn invalid_test(path: &str) -> Self {
        ApiError {
            code: 422,
            reason: "Invalid",
            message: format!("json patch test operation failed at {path}"),
            details: Value::Null,
        }
    }
}

/// Merge keys of the built-in list fields this server knows, by field name.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "env"
        | "volumes"
        | "imagePullSecrets" => "name",
        "ports" => "containerPort",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "conditions" => "type",
        "ownerReferences" => "uid",
        "addresses" => "type",
        "taints" => "key",
        _ => return None,
    })
}

fn strategic_list(target: &mut Vec<Value>, patch: &[Value], key: &str) {
    for p in patch {
        let Some(pk) = p.get(key).cloned() else {
            target.push(strip_directives(p));
            continue;
        };
        let directive = p.get("$patch").and_then(Value::as_str);
        let pos = target.iter().position(|t| t.get(key) == Some(&pk));
        match (directive, pos) {
            (Some("delete"), Some(i)) => {
                target.remove(i);
            }
            (Some("delete"), None) => {}
            (_, Some(i)) => strategic_patch_in(&mut target[i], p),
            (_, None) => target.push(strip_directives(p)),
        }
    }
}

fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, v)| !k.starts_with('$') && !v.is_null())
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(strip_directives).collect()),
        other => other.clone(),
    }
}

fn strategic_patch_in(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if p.get("$patch").and_then(Value::as_str) == Some("replace") {
        *target = strip_directives(patch);
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { return };
    for (k, v) in p {
        if k.starts_with('$') {
            if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/")
                && let (Some(Value::Array(list)), Some(del)) = (t.get_mut(field), v.as_array())
            {
                list.retain(|x| !del.contains(x));
            }
            continue;
        }
        if v.is_null() {
            t.remove(k);
            continue;
        }
        match (merge_key(k), v, t.get_mut(k)) {
            (Some(key), Value::Array(pa), Some(Value::Array(ta)))
                if pa.iter().all(|e| e.is_object()) =>
            {
                strategic_list(ta, pa, key);
            }
            (_, Value::Array(_), _) => {
                t.insert(k.clone(), strip_directives(v));
            }
            (_, Value::Object(_), Some(existing)) if existing.is_object() => {
                strategic_patch_in(existing, v)
            }
            _ => {
                t.insert(k.clone(), strip_directives(v));
            }
        }
    }
}

/// Applies a strategic merge patch: a merge patch whose known keyed lists merge by key.
pub fn strategic_patch(target: &mut Value, patch: &Value) {
    strategic_patch_in(target, patch)
}

/// A field path as server-side apply tracks it: map keys from the root, lists atomic.
pub type FieldPath = Vec<String>;

fn leaves_into(v: &Value, prefix: &mut FieldPath, out: &mut BTreeSet<FieldPath>) {
    match v {
        // An empty map owns nothing of its own: only leaves can conflict.
        Value::Object(m) => {
            for (k, child) in m {
                prefix.push(k.clone());
                leaves_into(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {
            out.insert(prefix.clone());
        }
    }
}

/// The leaf fields `obj` sets, skipping identity metadata the server owns.
pub fn leaf_fields(obj: &Value) -> BTreeSet<FieldPath> {
    let mut out = BTreeSet::new();
    let Some(m) = obj.as_object() else {
        return out;
    };
    for (k, v) in m {
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "metadata" => {
                for mk in ["labels", "annotations", "finalizers", "ownerReferences"] {
                    if let Some(mv) = v.get(mk) {
                        let mut prefix = vec!["metadata".to_string(), mk.to_string()];
                        if mk == "labels" || mk == "annotations" {
                            leaves_into(mv, &mut prefix, &mut out);
                        } else {
                            out.insert(prefix);
                        }
                    }
                }
            }
            _ => {
                let mut prefix = vec![k.clone()];
                leaves_into(v, &mut prefix, &mut out);
            }
        }
    }
    out
}

/// The leaf fields whose values differ between `old` and `new`.
pub fn changed_fields(old: &Value, new: &Value) -> BTreeSet<FieldPath> {
    let a = leaf_fields(old);
    let b = leaf_fields(new);
    a.union(&b)
        .filter(|p| get_path(old, p) != get_path(new, p))
        .cloned()
        .collect()
}

/// Reads the value at a field path.
pub fn get_path<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut cur = v;
    for seg in path {
        cur = cur.get(seg)?;
    }
    Some(cur)
}

/// Removes the value at a field path, dropping maps the removal leaves empty.
pub fn remove_path(v: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    fn go(v: &mut Value, parents: &[String], last: &str) {
        match parents.split_first() {
            None => {
                if let Value::Object(m) = v {
                    m.remove(last);
                }
            }
            Some((first, rest)) => {
                if let Some(child) = v.get_mut(first) {
                    go(child, rest, last);
                    if child.as_object().is_some_and(|m| m.is_empty())
                        && let Value::Object(m) = v
                    {
                        m.remove(first);
                    }
                }
            }
        }
    }
    go(v, parents, last)
}

/// Whether one path is a prefix of the other (so the two fields overlap).
pub fn overlaps(a: &[String], b: &[String]) -> bool {
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

/// Renders a field set as `FieldsV1` (`{"f:spec": {"f:replicas": {}}}`).
pub fn to_fields_v1(set: &BTreeSet<FieldPath>) -> Value {
    let mut root = Value::Object(Map::new());
    for path in set {
        let mut cur = &mut root;
        for seg in path {
            let Value::Object(m) = cur else { break };
            cur = m
                .entry(format!("f:{seg}"))
                .or_insert_with(|| Value::Object(Map::new()));
        }
    }
    root
}

/// Reads a `FieldsV1` value back into a field set (leaves are empty maps).
pub fn from_fields_v1(v: &Value) -> BTreeSet<FieldPath> {
    fn go(v: &Value, prefix: &mut FieldPath, out: &mut BTreeSet<FieldPath>) {
        let Some(m) = v.as_object() else { return };
        let children: Vec<_> = m.iter().filter(|(k, _)| k.starts_with("f:")).collect();
        if children.is_empty() {
            if !prefix.is_empty() {
                out.insert(prefix.clone());
            }
            return;
        }
        for (k, child) in children {
            prefix.push(k[2..].to_string());
            go(child, prefix, out);
            prefix.pop();
        }
    }
    let mut out = BTreeSet::new();
    go(v, &mut Vec::new(), &mut out);
    out
}

/// Renders a field path the way apply conflicts print it (`.spec.replicas`).
pub fn display_path(p: &[String]) -> String {
    p.iter().map(|s| format!(".{s}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
    }

    #[test]
    fn json_patch_ops() {
        let mut t = json!({"a": [1, 2], "b": {"c": 1}});
        json_patch(
            &mut t,
            &json!([
                {"op": "add", "path": "/a/-", "value": 3},
                {"op": "replace", "path": "/b/c", "value": 2},
                {"op": "test", "path": "/b/c", "value": 2},
                {"op": "remove", "path": "/a/0"},
                {"op": "copy", "from": "/b", "path": "/d"}
            ]),
        )
        .unwrap();
        assert_eq!(t, json!({"a": [2, 3], "b": {"c": 2}, "d": {"c": 2}}));
        assert!(json_patch(&mut t, &json!([{"op": "test", "path": "/b/c", "value": 9}])).is_err());
    }

    #[test]
    fn strategic_merges_containers_by_name() {
        let mut t = json!({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}});
        strategic_patch(
            &mut t,
            &json!({"spec": {"containers": [{"name": "b", "image": "z"}, {"name": "a", "$patch": "delete"}]}}),
        );
        assert_eq!(
            t,
            json!({"spec": {"containers": [{"name": "b", "image": "z"}]}})
        );
    }

    #[test]
    fn fields_v1_round_trip() {
        let o = json!({"apiVersion": "v1", "metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {"r": 1, "l": [1], "m": {"k": "v"}}});
        let set = leaf_fields(&o);
        assert_eq!(from_fields_v1(&to_fields_v1(&set)), set);
        assert!(set.contains(&vec!["metadata".to_string(), "labels".into(), "a".into()]));
    }
}
