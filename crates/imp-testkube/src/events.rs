//! The two Event APIs share storage, as on a real server: `events.k8s.io/v1` objects are kept
//! in the core `v1` shape, so an Event a controller records through `events.k8s.io` shows up in
//! `kubectl describe` (which reads core events) and the other way round.

use serde_json::{Map, Value};

/// (events.k8s.io/v1 field, core/v1 field) pairs that differ only in name.
const RENAMES: &[(&str, &str)] = &[
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

/// Whether a resource is `events.k8s.io/v1` events.
pub fn is_events_v1(group: &str, plural: &str) -> bool {
    group == "events.k8s.io" && plural == "events"
}

fn rename(obj: &mut Value, from_to: impl Iterator<Item = (&'static str, &'static str)>) {
    let Value::Object(m) = obj else { return };
    let mut moved = Map::new();
    for (from, to) in from_to {
        if let Some(v) = m.remove(from) {
            moved.insert(to.to_string(), v);
        }
    }
    m.extend(moved);
}

/// Converts an `events.k8s.io/v1` Event body to the stored core shape.
pub fn to_core(mut obj: Value) -> Value {
    rename(&mut obj, RENAMES.iter().copied());
    obj
}

/// Converts a stored core Event to the `events.k8s.io/v1` shape.
pub fn from_core(mut obj: Value) -> Value {
    rename(&mut obj, RENAMES.iter().map(|(a, b)| (*b, *a)));
    obj
}

/// [`from_core`] when `yes`, else the object unchanged.
pub fn from_core_if(yes: bool, obj: Value) -> Value {
    if yes { from_core(obj) } else { obj }
}

/// Maps an `events.k8s.io` field-selector label to the stored field.
pub fn core_field_label(label: &str) -> String {
    for (new, old) in RENAMES {
        if label == *new {
            return (*old).to_string();
        }
        if let Some(rest) = label.strip_prefix(&format!("{new}.")) {
            return format!("{old}.{rest}");
        }
    }
    label.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trip() {
        let e = json!({"regarding": {"name": "x"}, "note": "hi", "reason": "R"});
        let core = to_core(e.clone());
        assert_eq!(core["involvedObject"]["name"], "x");
        assert_eq!(core["message"], "hi");
        assert_eq!(from_core(core), e);
        assert_eq!(core_field_label("regarding.name"), "involvedObject.name");
    }
}
