//! `x-kubernetes-validations` CEL rules, compiled when a CRD is created and evaluated on every
//! write (through the `kube-cel` crate, which also carries the Kubernetes CEL library).

use serde_json::Value;

use crate::error::Cause;

/// Functions and macros the evaluator provides: the CEL standard set plus the Kubernetes
/// libraries this build enables. A rule calling anything else is rejected with its CRD.
const KNOWN_FUNCTIONS: &[&str] = &[
    // CEL standard library and macros.
    "contains",
    "size",
    "max",
    "min",
    "startsWith",
    "endsWith",
    "string",
    "bytes",
    "double",
    "int",
    "uint",
    "matches",
    "duration",
    "timestamp",
    "has",
    "all",
    "exists",
    "exists_one",
    "map",
    "filter",
    "dyn",
    "type",
    "getDate",
    "getDayOfMonth",
    "getDayOfWeek",
    "getDayOfYear",
    "getFullYear",
    "getHours",
    "getMilliseconds",
    "getMinutes",
    "getMonth",
    "getSeconds",
    "optional.none",
    "optional.of",
    "optional.ofNonZeroValue",
    "hasValue",
    "or",
    "orValue",
    "value",
    // Kubernetes libraries (strings, lists, sets, regex, format, quantity, math).
    "add",
    "asApproximateFloat",
    "asInteger",
    "charAt",
    "distinct",
    "find",
    "findAll",
    "first",
    "flatten",
    "format",
    "isInteger",
    "isQuantity",
    "isSorted",
    "join",
    "last",
    "lists.range",
    "lowerAscii",
    "math.abs",
    "math.bitAnd",
    "math.bitNot",
    "math.bitOr",
    "math.bitShiftLeft",
    "math.bitShiftRight",
    "math.bitXor",
    "math.ceil",
    "math.floor",
    "math.greatest",
    "math.isFinite",
    "math.isInf",
    "math.isNaN",
    "math.least",
    "math.round",
    "math.sign",
    "math.sqrt",
    "math.trunc",
    "quantity",
    "replace",
    "sets.contains",
    "sets.equivalent",
    "sets.intersects",
    "sign",
    "slice",
    "sort",
    "split",
    "strings.quote",
    "sub",
    "substring",
    "sum",
    "trim",
    "upperAscii",
    "compareTo",
    "indexOf",
    "isGreaterThan",
    "isLessThan",
    "lastIndexOf",
    "reverse",
];

/// The compiled rules of one CRD version's schema.
pub struct Rules {
    compiled: kube_cel::CompiledSchema,
    any: bool,
}

impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rules").field("any", &self.any).finish()
    }
}

fn walk_errors(s: &kube_cel::CompiledSchema, path: &str, out: &mut Vec<String>, any: &mut bool) {
    for v in &s.validations {
        *any = true;
        match v {
            Err(e) => out.push(format!("{path}: {e}")),
            Ok(r) => {
                for f in r.program.references().functions() {
                    let operator = f.starts_with('_') || f.starts_with('@') || f.starts_with('!');
                    if !operator && !KNOWN_FUNCTIONS.contains(&f) {
                        out.push(format!(
                            "{path}: rule {:?} calls {f:?}, which this server cannot evaluate",
                            r.rule.rule
                        ));
                    }
                }
            }
        }
    }
    for (k, c) in &s.properties {
        walk_errors(c, &format!("{path}.{k}"), out, any);
    }
    if let Some(i) = &s.items {
        walk_errors(i, &format!("{path}[*]"), out, any);
    }
    if let Some(a) = &s.additional_properties {
        walk_errors(a, &format!("{path}[*]"), out, any);
    }
    for c in s.all_of.iter().chain(&s.one_of).chain(&s.any_of) {
        walk_errors(c, path, out, any);
    }
}

/// Finds the value at a field path such as `spec.items[1].name`.
fn lookup<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let mut cur = obj;
    for seg in path.split('.').filter(|s| !s.is_empty()) {
        let (key, idx) = match seg.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (seg, None),
        };
        if !key.is_empty() {
            cur = cur.get(key)?;
        }
        if let Some(i) = idx {
            cur = cur.get(i)?;
        }
    }
    Some(cur)
}

/// The type name CEL rule failures print in place of the value, as the real server does.
fn type_name(v: Option<&Value>) -> &'static str {
    match v {
        Some(Value::String(_)) => "string",
        Some(Value::Number(n)) if n.is_f64() => "number",
        Some(Value::Number(_)) => "integer",
        Some(Value::Bool(_)) => "boolean",
        Some(Value::Array(_)) => "array",
        Some(Value::Null) => "null",
        _ => "object",
    }
}

impl Rules {
    /// Compiles every rule in `schema`; any rule that cannot be compiled or evaluated is an error.
    pub fn compile(schema: &Value) -> Result<Self, Vec<String>> {
        let compiled = kube_cel::compile_schema(schema);
        let mut errors = Vec::new();
        let mut any = false;
        walk_errors(&compiled, "openAPIV3Schema", &mut errors, &mut any);
        if errors.is_empty() {
            Ok(Self { compiled, any })
        } else {
            Err(errors)
        }
    }

    /// Evaluates the rules on `obj` (and `old` for transition rules), as field causes.
    pub fn evaluate(
        &self,
        validator: &kube_cel::Validator,
        obj: &Value,
        old: Option<&Value>,
    ) -> Vec<Cause> {
        if !self.any {
            return Vec::new();
        }
        match validator.validate_compiled(&self.compiled, obj, old) {
            Ok(()) => Vec::new(),
            Err(errs) => errs
                .into_vec()
                .into_iter()
                .map(|e| {
                    let field = e.field_path.trim_start_matches('.').to_string();
                    let shown = format!("{:?}", type_name(lookup(obj, &field)));
                    let reason = e
                        .reason
                        .clone()
                        .unwrap_or_else(|| "FieldValueInvalid".into());
                    let message = match e.kind {
                        kube_cel::ErrorKind::ValidationFailure => {
                            format!("Invalid value: {shown}: {}", e.message)
                        }
                        // Runtime errors ("no such overload") are reported as invalid values
                        // too, as the real server does, never skipped.
                        _ => format!(
                            "Invalid value: {shown}: {}",
                            e.message.trim_start_matches("rule evaluation error: ")
                        ),
                    };
                    Cause::new(&reason, &field, message)
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema(rule: &str) -> Value {
        json!({"type": "object", "properties": {"spec": {"type": "object",
            "x-kubernetes-validations": [{"rule": rule, "message": "bad spec"}],
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "d": {"type": "string"}}}}})
    }

    #[test]
    fn rule_pass_and_fail() {
        let v = kube_cel::Validator::new();
        let r = Rules::compile(&schema("self.a <= self.b")).unwrap();
        assert!(
            r.evaluate(&v, &json!({"spec": {"a": 1, "b": 2}}), None)
                .is_empty()
        );
        let c = r.evaluate(&v, &json!({"spec": {"a": 3, "b": 2}}), None);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].field, "spec");
        assert_eq!(c[0].message, "Invalid value: \"object\": bad spec");
    }

    #[test]
    fn duration_has_and_transition() {
        let v = kube_cel::Validator::new();
        let r =
            Rules::compile(&schema("!has(self.d) || duration(self.d) > duration('1s')")).unwrap();
        assert!(
            r.evaluate(&v, &json!({"spec": {"d": "5m"}}), None)
                .is_empty()
        );
        assert_eq!(r.evaluate(&v, &json!({"spec": {"d": "0s"}}), None).len(), 1);
        let t = Rules::compile(&schema("self.a >= oldSelf.a")).unwrap();
        assert!(t.evaluate(&v, &json!({"spec": {"a": 1}}), None).is_empty());
        assert_eq!(
            t.evaluate(
                &v,
                &json!({"spec": {"a": 1}}),
                Some(&json!({"spec": {"a": 2}}))
            )
            .len(),
            1
        );
    }

    #[test]
    fn bad_rules_are_rejected() {
        assert!(Rules::compile(&schema("self.a <=")).is_err());
        assert!(Rules::compile(&schema("self.a.frobnicate()")).is_err());
    }
}
