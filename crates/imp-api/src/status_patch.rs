//! The JSON merge patch that turns one status into another, field by top-level field: what
//! changed, and `null` for what went. Every controller writes its status this way, so a write
//! carries only its own changes (and, with a resourceVersion, fails on a concurrent one).

use serde::Serialize;
use serde_json::Value;

/// The merge patch from `old` to `new` (top-level fields only), or `None` when they are equal.
pub fn diff<T: Serialize>(old: &T, new: &T) -> Option<Value> {
    let old = serde_json::to_value(old).unwrap_or(Value::Null);
    let new = serde_json::to_value(new).unwrap_or(Value::Null);
    let mut out = serde_json::Map::new();
    if let (Value::Object(o), Value::Object(n)) = (&old, &new) {
        for (k, v) in n {
            if o.get(k) != Some(v) {
                out.insert(k.clone(), v.clone());
            }
        }
        for k in o.keys().filter(|k| !n.contains_key(*k)) {
            out.insert(k.clone(), Value::Null);
        }
    }
    (!out.is_empty()).then_some(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn only_changed_fields_and_nulls_for_removed_ones() {
        let old = json!({"phase": "Running", "ip": "10.0.0.2", "node": "a"});
        let new = json!({"phase": "Failed", "node": "a"});
        assert_eq!(
            super::diff(&old, &new),
            Some(json!({"phase": "Failed", "ip": null}))
        );
        assert_eq!(super::diff(&new, &new), None);
    }
}
