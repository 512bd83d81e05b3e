//! Manifest compatibility with the Go project, measured against its own generated CRDs
//! (`../shared/reference/go-crds/`, next to the checkout): for every kind and every version Go
//! serves, each field path of Go's openAPIV3Schema exists in ours with the same JSON type
//! (int-or-string included), enum values, default and preserve-unknown-fields, list type and map
//! values, no narrower bound (minimum, maximum, length, items, pattern), and nothing is required
//! here that is optional there. The status subresource is
//! compared too; printer columns are not (tests/crds.rs checks those).
//!
//! Two explicit lists keep the differences honest: the Go admission-webhook rules that refuse the
//! same objects anyway (so our schema may refuse them too), and the fields we add. A difference
//! in neither list fails the test, and so does a list entry that no longer matches anything.
//! Every difference is printed, not only the first. Without `../shared/reference` beside the
//! checkout the comparison skips (and fails under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Where the Go project's CRDs are: `shared/reference/go-crds` beside the checkout.
fn go_crd_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/reference/go-crds")
}

/// Go's CRDs by kind, as JSON.
fn go_crds() -> BTreeMap<String, Value> {
    let dir = go_crd_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "the Go project's CRDs are the yardstick of this test and must be at {}: {e}",
            dir.display()
        )
    });
    let mut out = BTreeMap::new();
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let crd: Value = serde_yaml_ng::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
        let kind = crd["spec"]["names"]["kind"].as_str().unwrap().to_owned();
        out.insert(kind, crd);
    }
    assert_eq!(out.len(), 10, "expected ten Go CRDs in {}", dir.display());
    out
}

/// Our CRDs by kind, as JSON.
fn our_crds() -> BTreeMap<String, Value> {
    imp_api::crd::all()
        .into_iter()
        .map(|crd| {
            (
                crd.spec.names.kind.clone(),
                serde_json::to_value(&crd).unwrap(),
            )
        })
        .collect()
}

/// Differences allowed because the Go project's admission webhook (internal/webhook/v1alpha1 at
/// the commit the reference CRDs come from) refuses the same objects anyway: (kind, path,
/// problem as printed, the Go rule). Empty today: an ImpVM or ImpVMTemplate without spec, which
/// that webhook refuses, is now accepted by our schema too, like every other specless kind.
const EXCEPTIONS: &[(&str, &str, &str, &str)] = &[];

/// Fields we serve that Go's CRDs do not have, as (kind, path).
const ADDED: &[(&str, &str)] = &[
    // The address → VM map; allocatedIPs keeps Go's list of addresses.
    ("ImpNetwork", ".status.allocations"),
    // What a network's guests may reach inside the ranges the agents deny them.
    ("ImpNetwork", ".spec.egress"),
    // Pull secrets for private images.
    ("ImpVM", ".spec.imagePullSecrets"),
    // The workload's exit code and the generation the status describes.
    ("ImpVM", ".status.exitCode"),
    ("ImpVM", ".status.observedGeneration"),
    // When the VM ended, and the VMM the node agent runs it with (written by the agent).
    ("ImpVM", ".status.finishedAt"),
    ("ImpVM", ".status.runtime"),
    // What the operator booked at placement (class and resolved spec); the agent boots it.
    ("ImpVM", ".status.booking"),
    // Take a running member of a warm pool (docs/warm-pools.md), and how it went.
    ("ImpVM", ".spec.warmPoolRef"),
    ("ImpVM", ".status.warmClaim"),
    // A warm pool's base, the generation its status describes, and its fill back-off.
    ("ImpWarmPool", ".status.baseSnapshot"),
    ("ImpWarmPool", ".status.claimedCount"),
    ("ImpWarmPool", ".status.observedGeneration"),
    ("ImpWarmPool", ".status.failedInARow"),
    ("ImpWarmPool", ".status.lastFailureAt"),
    // A move to another node in flight (docs/migration.md), and what a finished one took.
    ("ImpVM", ".status.move"),
    ("ImpVMMigration", ".status.sourceNode"),
    ("ImpVMMigration", ".status.mode"),
    ("ImpVMMigration", ".status.downtimeMs"),
    ("ImpVMMigration", ".status.totalMs"),
    ("ImpVMMigration", ".status.bytesMoved"),
    // firecracker or qemu per class.
    ("ImpVMClass", ".spec.runtime"),
    // Placement inherited from a template, unioned with class and VM.
    ("ImpVMTemplate", ".spec.nodeSelector"),
    ("ImpVMTemplate", ".spec.tolerations"),
];

/// One difference: the kind and version it is in, the field path and what differs.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Diff {
    kind: String,
    path: String,
    problem: String,
}

impl std::fmt::Display for Diff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.kind, self.path, self.problem)
    }
}

/// Walks Go's and our schema side by side, collecting differences and our additions.
struct Walk<'a> {
    kind: &'a str,
    diffs: Vec<Diff>,
    added: Vec<String>,
}

impl Walk<'_> {
    fn diff(&mut self, path: &str, problem: impl Into<String>) {
        self.diffs.push(Diff {
            kind: self.kind.to_owned(),
            path: path.to_owned(),
            problem: problem.into(),
        });
    }

    fn node(&mut self, path: &str, go: &Value, ours: &Value) {
        let (gt, ot) = (json_type(go), json_type(ours));
        if gt != ot {
            self.diff(path, format!("type {ot} here, {gt} in Go"));
        }
        if flag(go, "x-kubernetes-preserve-unknown-fields")
            && !flag(ours, "x-kubernetes-preserve-unknown-fields")
        {
            self.diff(path, "x-kubernetes-preserve-unknown-fields lost");
        }
        if flag(go, "x-kubernetes-embedded-resource")
            && !flag(ours, "x-kubernetes-embedded-resource")
        {
            self.diff(path, "x-kubernetes-embedded-resource lost");
        }
        let (ge, oe) = (enum_values(go), enum_values(ours));
        if ge != oe {
            self.diff(
                path,
                format!("enum {} here, {} in Go", show_enum(&oe), show_enum(&ge)),
            );
        }
        if go.get("default") != ours.get("default") {
            self.diff(
                path,
                format!(
                    "default {} here, {} in Go",
                    show(ours.get("default")),
                    show(go.get("default"))
                ),
            );
        }
        self.bounds(path, go, ours);
        let (gl, ol) = (list_type(go), list_type(ours));
        if gl != ol && ol != "atomic" {
            self.diff(
                path,
                format!("x-kubernetes-list-type {ol} here, {gl} in Go"),
            );
        }
        if gl == "map"
            && ol == "map"
            && go.get("x-kubernetes-list-map-keys") != ours.get("x-kubernetes-list-map-keys")
        {
            self.diff(path, "different x-kubernetes-list-map-keys");
        }

        let go_required = names(go.get("required"));
        let our_required = names(ours.get("required"));
        for r in our_required.difference(&go_required) {
            self.diff(&join(path, r), "required here, optional in Go");
        }

        let empty = serde_json::Map::new();
        let go_props = go
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let our_props = ours
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        for (name, g) in go_props {
            let p = join(path, name);
            match our_props.get(name) {
                Some(o) => self.node(&p, g, o),
                None => self.diff(&p, "missing here"),
            }
        }
        for name in our_props.keys().filter(|n| !go_props.contains_key(*n)) {
            self.added.push(join(path, name));
        }
        if let Some(g) = go.get("items") {
            match ours.get("items") {
                Some(o) => self.node(&format!("{path}[]"), g, o),
                None => self.diff(path, "list items have no schema here"),
            }
        }
        match (
            go.get("additionalProperties"),
            ours.get("additionalProperties"),
        ) {
            (Some(g), Some(o)) if g.is_object() && o.is_object() => {
                self.node(&format!("{path}{{}}"), g, o)
            }
            (Some(g), o)
                if g != &Value::Bool(false) && o.is_none_or(|o| o == &Value::Bool(false)) =>
            {
                self.diff(path, "map values refused here")
            }
            _ => {}
        }
    }
}

impl Walk<'_> {
    /// Reports each bound that makes ours refuse a value Go's accepts: a higher minimum, a
    /// lower maximum, or a pattern Go's does not have.
    fn bounds(&mut self, path: &str, go: &Value, ours: &Value) {
        let num = |s: &Value, k: &str| s.get(k).and_then(Value::as_f64);
        for key in ["minimum", "minLength", "minItems", "minProperties"] {
            if let Some(o) = num(ours, key)
                && num(go, key).is_none_or(|g| o > g)
            {
                self.diff(path, format!("{key} {o} here, {} in Go", show(go.get(key))));
            }
        }
        for key in ["maximum", "maxLength", "maxItems", "maxProperties"] {
            if let Some(o) = num(ours, key)
                && num(go, key).is_none_or(|g| o < g)
            {
                self.diff(path, format!("{key} {o} here, {} in Go", show(go.get(key))));
            }
        }
        for key in ["exclusiveMinimum", "exclusiveMaximum"] {
            if flag(ours, key) && !flag(go, key) {
                self.diff(path, format!("{key} here, not in Go"));
            }
        }
        if let Some(o) = ours.get("pattern")
            && go.get("pattern") != Some(o)
        {
            self.diff(
                path,
                format!("pattern {o} here, {} in Go", show(go.get("pattern"))),
            );
        }
    }
}

fn json_type(s: &Value) -> String {
    if flag(s, "x-kubernetes-int-or-string") {
        return "int-or-string".to_owned();
    }
    s.get("type")
        .and_then(Value::as_str)
        .unwrap_or("untyped")
        .to_owned()
}

fn flag(s: &Value, key: &str) -> bool {
    s.get(key).and_then(Value::as_bool).unwrap_or(false)
}

fn list_type(s: &Value) -> &str {
    s.get("x-kubernetes-list-type")
        .and_then(Value::as_str)
        .unwrap_or("atomic")
}

fn enum_values(s: &Value) -> Option<BTreeSet<String>> {
    s.get("enum")
        .and_then(Value::as_array)
        .map(|v| v.iter().map(Value::to_string).collect())
}

fn show_enum(e: &Option<BTreeSet<String>>) -> String {
    match e {
        Some(e) => format!("[{}]", e.iter().cloned().collect::<Vec<_>>().join(", ")),
        None => "none".to_owned(),
    }
}

fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "none".to_owned(), Value::to_string)
}

fn names(v: Option<&Value>) -> BTreeSet<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn join(path: &str, name: &str) -> String {
    format!("{path}.{name}")
}

/// Compares one kind: served versions, status subresource, and both schemas field by field.
fn compare_kind(kind: &str, go: &Value, ours: &Value) -> (Vec<Diff>, Vec<String>) {
    let mut walk = Walk {
        kind,
        diffs: Vec::new(),
        added: Vec::new(),
    };
    if go["spec"]["scope"] != ours["spec"]["scope"] {
        walk.diff("", "different scope");
    }
    let empty = Vec::new();
    let our_versions = ours["spec"]["versions"].as_array().unwrap_or(&empty);
    for gv in go["spec"]["versions"].as_array().unwrap_or(&empty) {
        if !flag(gv, "served") {
            continue;
        }
        let name = gv["name"].as_str().unwrap_or_default();
        let Some(ov) = our_versions
            .iter()
            .find(|v| v["name"] == gv["name"] && flag(v, "served"))
        else {
            walk.diff("", format!("version {name} not served here"));
            continue;
        };
        if gv["subresources"].get("status").is_some() && ov["subresources"].get("status").is_none()
        {
            walk.diff("", format!("{name}: no status subresource here"));
        }
        if gv["subresources"].get("scale").is_some() && ov["subresources"].get("scale").is_none() {
            walk.diff("", format!("{name}: no scale subresource here"));
        }
        let root = if our_versions.len() == 1 {
            String::new()
        } else {
            format!("{name}:")
        };
        walk.node(
            &root,
            &gv["schema"]["openAPIV3Schema"],
            &ov["schema"]["openAPIV3Schema"],
        );
    }
    (walk.diffs, walk.added)
}

#[test]
fn every_go_field_exists_here_with_the_same_shape() {
    imp_testenv::require!(
        go_crd_dir().is_dir(),
        "../shared/reference/go-crds beside the checkout (the Go project's CRDs)"
    );
    let go = go_crds();
    let ours = our_crds();
    let mut problems: Vec<String> = Vec::new();
    let mut used_exceptions = BTreeSet::new();
    let mut added_seen = BTreeSet::new();
    for (kind, go_crd) in &go {
        let Some(our_crd) = ours.get(kind) else {
            problems.push(format!("{kind}: no such CRD here"));
            continue;
        };
        let (diffs, added) = compare_kind(kind, go_crd, our_crd);
        for d in diffs {
            match EXCEPTIONS.iter().position(|(kind, path, problem, _)| {
                *kind == d.kind && *path == d.path && *problem == d.problem
            }) {
                Some(i) => {
                    used_exceptions.insert(i);
                }
                None => problems.push(d.to_string()),
            }
        }
        for path in added {
            if ADDED.contains(&(kind.as_str(), path.as_str())) {
                added_seen.insert((kind.clone(), path));
            } else {
                problems.push(format!(
                    "{kind} {path}: not in Go's schema and not listed in ADDED"
                ));
            }
        }
    }
    for (i, (kind, path, problem, go_rule)) in EXCEPTIONS.iter().enumerate() {
        if !used_exceptions.contains(&i) {
            problems.push(format!(
                "stale EXCEPTIONS entry {kind} {path}: {problem} ({go_rule}) no longer differs"
            ));
        }
    }
    for (kind, path) in ADDED {
        if !added_seen.contains(&((*kind).to_owned(), (*path).to_owned())) {
            problems.push(format!(
                "stale ADDED entry {kind} {path}: not an addition any more"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} differences from the Go project's CRDs in {}:\n{}",
        problems.len(),
        go_crd_dir().display(),
        problems.join("\n")
    );
}

#[test]
fn the_comparison_reports_each_kind_of_difference_at_once() {
    let crd = |subresources: Value, schema: Value| {
        serde_json::json!({"spec": {"scope": "Namespaced", "versions": [{
            "name": "v1alpha1", "served": true, "subresources": subresources,
            "schema": {"openAPIV3Schema": schema}
        }]}})
    };
    let go = crd(
        serde_json::json!({"status": {}}),
        serde_json::json!({"type": "object", "properties": {
            "a": {"type": "string"},
            "b": {"x-kubernetes-int-or-string": true},
            "c": {"type": "string", "enum": ["x", "y"]},
            "d": {"type": "integer", "default": 3},
            "e": {"type": "object", "properties": {"n": {"type": "string"}}},
            "f": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
            "g": {"type": "integer", "minimum": 0},
            "h": {"type": "string"},
            "gone": {"type": "string"}
        }}),
    );
    let ours = crd(
        serde_json::json!({}),
        serde_json::json!({"type": "object", "properties": {
            "a": {"type": "object"},
            "b": {"type": "string"},
            "c": {"type": "string", "enum": ["x"]},
            "d": {"type": "integer", "default": 4},
            "e": {"type": "object", "required": ["n"], "properties": {"n": {"type": "string"}}},
            "f": {"type": "object"},
            "g": {"type": "integer", "minimum": 1},
            "h": {"type": "string", "pattern": "^a$"},
            "new": {"type": "string"}
        }}),
    );
    let (diffs, added) = compare_kind("K", &go, &ours);
    let got: Vec<String> = diffs.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [
            "K : v1alpha1: no status subresource here",
            "K .a: type object here, string in Go",
            "K .b: type string here, int-or-string in Go",
            "K .c: enum [\"x\"] here, [\"x\", \"y\"] in Go",
            "K .d: default 4 here, 3 in Go",
            "K .e.n: required here, optional in Go",
            "K .f: x-kubernetes-preserve-unknown-fields lost",
            "K .g: minimum 1 here, 0 in Go",
            "K .gone: missing here",
            "K .h: pattern \"^a$\" here, none in Go",
        ]
    );
    assert_eq!(added, [".new"]);
}
