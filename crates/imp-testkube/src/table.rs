//! `meta.k8s.io/v1` Table responses, which `kubectl get` asks for, from printer columns.

use serde_json::{Value, json};

use crate::meta;
use crate::resource::ResourceType;

/// Whether an Accept header asks for a Table.
pub fn wants_table(accept: &str) -> bool {
    accept
        .split(',')
        .next()
        .is_some_and(|first| first.contains("as=Table"))
}

/// Evaluates the JSONPath subset printer columns use: `.a.b`, `[0]`, `[*]`, `[?(@.k=="v")]`.
pub fn json_path(obj: &Value, path: &str) -> Vec<Value> {
    let path = path.trim();
    let path = path
        .strip_prefix('{')
        .and_then(|p| p.strip_suffix('}'))
        .unwrap_or(path);
    let mut cur = vec![obj.clone()];
    let mut rest = path.trim_start_matches('$');
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            let key = &r[..end];
            cur = cur.iter().filter_map(|v| v.get(key).cloned()).collect();
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let Some(end) = r.find(']') else { break };
            let sel = &r[..end];
            rest = &r[end + 1..];
            let items: Vec<Value> = cur
                .iter()
                .filter_map(|v| v.as_array().cloned())
                .flatten()
                .collect();
            if sel == "*" {
                cur = items;
            } else if let Ok(i) = sel.parse::<usize>() {
                cur = cur.iter().filter_map(|v| v.get(i).cloned()).collect();
            } else if let Some(f) = sel.strip_prefix("?(@.").and_then(|f| f.strip_suffix(')')) {
                let (k, want) = f.split_once("==").unwrap_or((f, ""));
                let want = want.trim().trim_matches(['"', '\'']);
                cur = items
                    .into_iter()
                    .filter(|e| e.get(k.trim()).and_then(Value::as_str) == Some(want))
                    .collect();
            } else {
                cur.clear();
            }
        } else {
            break;
        }
    }
    cur
}

fn cell(v: Option<&Value>, type_: &str, now: i64) -> Value {
    match v {
        None | Some(Value::Null) => Value::Null,
        Some(Value::String(s)) if type_ == "date" => match meta::parse_rfc3339(s) {
            Some(t) => json!(meta::human_age(now - t)),
            None => json!(s),
        },
        Some(Value::Array(_)) | Some(Value::Object(_)) if type_ == "string" => {
            json!(v.map(Value::to_string).unwrap_or_default())
        }
        Some(other) => other.clone(),
    }
}

/// Builds the Table for `items`, with Name, the type's columns, and Age.
pub fn table(rt: &ResourceType, items: &[Value], rv: u64, cont: Option<&str>) -> Value {
    let now = meta::now_secs();
    let mut defs = vec![json!({"name": "Name", "type": "string", "format": "name",
        "description": "Name must be unique within a namespace.", "priority": 0})];
    for c in &rt.columns {
        defs.push(json!({"name": c.name, "type": c.type_, "format": "",
            "description": c.description, "priority": c.priority}));
    }
    let has_age = rt
        .columns
        .iter()
        .any(|c| c.json_path.trim() == ".metadata.creationTimestamp");
    if !has_age {
        defs.push(json!({"name": "Age", "type": "string", "format": "",
            "description": "CreationTimestamp is a timestamp representing the server time when this object was created.",
            "priority": 0}));
    }
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let mut cells = vec![json!(meta::name(o))];
            for c in &rt.columns {
                let found = json_path(o, &c.json_path);
                cells.push(cell(found.first(), &c.type_, now));
            }
            if !has_age {
                let age = o
                    .pointer("/metadata/creationTimestamp")
                    .and_then(Value::as_str)
                    .and_then(meta::parse_rfc3339)
                    .map(|t| meta::human_age(now - t))
                    .unwrap_or_else(|| "<unknown>".into());
                cells.push(json!(age));
            }
            json!({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}})
        })
        .collect();
    let mut md = json!({"resourceVersion": rv.to_string()});
    if let Some(c) = cont {
        md["continue"] = json!(c);
    }
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": md,
        "columnDefinitions": defs, "rows": rows})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_path_subset() {
        let o = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "False"}]}});
        assert_eq!(json_path(&o, ".status.phase"), vec![json!("Running")]);
        assert_eq!(
            json_path(&o, ".status.conditions[?(@.type==\"Ready\")].status"),
            vec![json!("True")]
        );
        assert_eq!(
            json_path(&o, ".status.conditions[1].type"),
            vec![json!("X")]
        );
        assert!(json_path(&o, ".spec.x").is_empty());
    }
}
