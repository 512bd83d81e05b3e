//! Label and field selectors, parsed from query strings and matched against objects.

use serde_json::Value;

use crate::error::{ApiError, Result};

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Eq(String),
    Ne(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    NotExists,
}

/// A parsed `labelSelector`: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector {
    reqs: Vec<(String, Op)>,
}

fn split_top(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c);
            }
            ')' => {
                depth -= 1;
                cur.push(c);
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out.into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

fn set_values(rest: &str, whole: &str) -> Result<Vec<String>> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "unable to parse requirement: found '{whole}', expected: '('"
            ))
        })?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    /// Parses the Kubernetes label selector syntax (`=`, `==`, `!=`, `in`, `notin`, `key`, `!key`).
    pub fn parse(s: &str) -> Result<Self> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            if let Some(k) = part.strip_prefix('!') {
                reqs.push((k.trim().to_string(), Op::NotExists));
            } else if let Some((k, v)) = part.split_once("!=") {
                reqs.push((k.trim().to_string(), Op::Ne(v.trim().to_string())));
            } else if let Some((k, v)) = part.split_once("==") {
                reqs.push((k.trim().to_string(), Op::Eq(v.trim().to_string())));
            } else if let Some((k, v)) = part.split_once('=') {
                reqs.push((k.trim().to_string(), Op::Eq(v.trim().to_string())));
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                reqs.push((k.trim().to_string(), Op::NotIn(set_values(rest, &part)?)));
            } else if let Some((k, rest)) = part.split_once(" in ") {
                reqs.push((k.trim().to_string(), Op::In(set_values(rest, &part)?)));
            } else if part.contains(' ') || part.contains('(') {
                return Err(ApiError::bad_request(format!(
                    "unable to parse requirement: {part}"
                )));
            } else {
                reqs.push((part.clone(), Op::Exists));
            }
        }
        for (k, _) in &reqs {
            if k.is_empty() {
                return Err(ApiError::bad_request(format!(
                    "unable to parse requirement: empty key in {s:?}"
                )));
            }
        }
        Ok(Self { reqs })
    }

    /// Whether `obj`'s labels satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        self.reqs.iter().all(|(k, op)| {
            let v = labels.and_then(|l| l.get(k)).and_then(Value::as_str);
            match op {
                Op::Eq(x) => v == Some(x.as_str()),
                Op::Ne(x) => v != Some(x.as_str()),
                Op::In(xs) => v.is_some_and(|v| xs.iter().any(|x| x == v)),
                Op::NotIn(xs) => !v.is_some_and(|v| xs.iter().any(|x| x == v)),
                Op::Exists => v.is_some(),
                Op::NotExists => v.is_none(),
            }
        })
    }
}

/// A parsed `fieldSelector`: `=`, `==` and `!=` on a known field label.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldSelector {
    reqs: Vec<(String, bool, String)>,
}

/// Reads a dotted field path (`spec.nodeName`) as the string a field selector compares.
pub fn field_value(obj: &Value, path: &str) -> String {
    let mut cur = obj;
    for seg in path.trim_start_matches('.').split('.') {
        match cur.get(seg) {
            Some(v) => cur = v,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        other => other.to_string(),
    }
}

impl FieldSelector {
    /// Parses a field selector, rejecting labels the resource does not support.
    pub fn parse(s: &str, allowed: &[String]) -> Result<Self> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            let (k, eq, v) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                )));
            };
            let k = k.trim().to_string();
            let known = k == "metadata.name"
                || k == "metadata.namespace"
                || allowed.iter().any(|a| a.trim_start_matches('.') == k);
            if !known {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {k}"
                )));
            }
            reqs.push((k, eq, v.trim().to_string()));
        }
        Ok(Self { reqs })
    }

    /// Adds `metadata.name=NAME`.
    pub fn and_name(mut self, name: &str) -> Self {
        self.reqs
            .push(("metadata.name".to_string(), true, name.to_string()));
        self
    }

    /// Renames the field labels, for resources stored in another shape.
    pub fn renamed(mut self, f: impl Fn(&str) -> String) -> Self {
        for r in &mut self.reqs {
            r.0 = f(&r.0);
        }
        self
    }

    /// Whether `obj` satisfies every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        self.reqs
            .iter()
            .all(|(k, eq, v)| (field_value(obj, k) == *v) == *eq)
    }
}

/// Both selectors of a list or watch request.
#[derive(Debug, Clone, Default)]
pub struct Selectors {
    /// The label selector.
    pub labels: LabelSelector,
    /// The field selector.
    pub fields: FieldSelector,
}

impl Selectors {
    /// Whether `obj` passes both selectors.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj() -> Value {
        json!({"metadata": {"name": "a", "labels": {"app": "web", "tier": "front"}}, "spec": {"nodeName": "n1"}})
    }

    #[test]
    fn label_operators() {
        let o = obj();
        for (s, want) in [
            ("app=web", true),
            ("app==web", true),
            ("app!=web", false),
            ("app in (web, db)", true),
            ("app notin (web)", false),
            ("tier", true),
            ("!tier", false),
            ("!missing", true),
            ("app=web,tier in (back)", false),
            ("", true),
        ] {
            assert_eq!(LabelSelector::parse(s).unwrap().matches(&o), want, "{s}");
        }
    }

    #[test]
    fn field_selectors() {
        let o = obj();
        let allowed = vec!["spec.nodeName".to_string()];
        assert!(
            FieldSelector::parse("spec.nodeName=n1", &allowed)
                .unwrap()
                .matches(&o)
        );
        assert!(
            !FieldSelector::parse("spec.nodeName!=n1", &allowed)
                .unwrap()
                .matches(&o)
        );
        assert!(
            FieldSelector::parse("metadata.name==a", &allowed)
                .unwrap()
                .matches(&o)
        );
        assert!(FieldSelector::parse("spec.other=x", &allowed).is_err());
    }
}
