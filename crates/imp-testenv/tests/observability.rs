//! The chart's Grafana dashboard (`charts/imp/files/grafana/imp.json`) and Prometheus alerts
//! (`charts/imp/files/alerts/imp.rules.yaml`), checked against the code and by Prometheus's
//! own tool:
//!
//! - `promtool check rules` accepts the alerts, and `promtool test rules` passes their unit
//!   tests (`imp.rules.test.yaml`), which hold, for every alert, a case where it fires and one
//!   where it does not;
//! - every dashboard query is valid PromQL (promtool checks it as a recording rule, Grafana's
//!   variables replaced by values);
//! - every `imp_…` series the dashboard and the alerts read is one the operator or the agent
//!   exports: the families are read from the registrations in their `metrics.rs` and named as
//!   prometheus-client exposes them (unit suffix; `_total` for counters; `_bucket`, `_sum`,
//!   `_count` for histograms);
//! - every alert has a `for:`, a severity and a summary and description, and a section in
//!   docs/observability.md.
//!
//! Without promtool on `PATH` the promtool tests skip on a developer machine and fail under
//! `CI=true` (`scripts/setup` installs Debian's `prometheus` package, which carries it).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

/// The checkout's root.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// The files holding every metric registration of the operator and of the agent.
const METRICS_SOURCES: [&str; 2] = [
    "crates/imp-operator/src/metrics.rs",
    "crates/imp-agent/src/node/metrics.rs",
];

fn path(rel: &str) -> PathBuf {
    Path::new(ROOT).join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(path(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// The alert rule file, parsed.
fn rules() -> Value {
    let rel = "charts/imp/files/alerts/imp.rules.yaml";
    serde_yaml_ng::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The dashboard, parsed.
fn dashboard() -> Value {
    let rel = "charts/imp/files/grafana/imp.json";
    serde_json::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every rule of every group of the rule file.
fn all_rules(rules: &Value) -> Vec<&Value> {
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect()
}

// ---- The metrics the code exports ----

/// A metric family's type, which decides the names of its samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A family the code registers: its name as exposed (unit suffix included) and its type.
#[derive(Debug, PartialEq, Eq)]
struct Family {
    name: String,
    kind: Kind,
}

impl Family {
    /// The names of its samples, as prometheus-client writes them.
    fn series(&self) -> Vec<String> {
        let n = &self.name;
        match self.kind {
            Kind::Counter => vec![format!("{n}_total")],
            Kind::Gauge => vec![n.clone()],
            Kind::Histogram => ["bucket", "sum", "count"]
                .iter()
                .map(|s| format!("{n}_{s}"))
                .collect(),
        }
    }
}

/// A token of Rust source: enough to follow `registry.register…(…)` calls.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Str(String),
    Punct(char),
}

/// The tokens of `src` (comments dropped, string literals kept whole, lifetimes as `'`).
fn tokens(src: &str) -> Vec<Tok> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' {
            let mut s = String::new();
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                s.push(chars[i]);
                i += 1;
            }
            i += 1;
            out.push(Tok::Str(s));
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3; // A char literal such as '-'.
        } else if c == '\'' && chars.get(i + 1) == Some(&'\\') {
            i += 2; // An escaped char literal such as '\n'.
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(chars[start..i].iter().collect()));
        } else {
            out.push(Tok::Punct(c));
            i += 1;
        }
    }
    out
}

fn is_ident(t: &Tok, name: &str) -> bool {
    matches!(t, Tok::Ident(s) if s == name)
}

/// The arguments of the call whose `(` is at `open`, split at top-level commas, and the index
/// of its `)`.
fn call_args(toks: &[Tok], open: usize) -> (Vec<&[Tok]>, usize) {
    let (mut depth, mut start, mut args) = (0usize, open + 1, Vec::new());
    for (i, t) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    if start < i {
                        args.push(&toks[start..i]);
                    }
                    return (args, i);
                }
            }
            Tok::Punct(',') if depth == 1 => {
                args.push(&toks[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    panic!("unclosed call at token {open}")
}

/// The last identifier of an argument: `x.clone()` → `x`, `&families.memory_used` →
/// `memory_used`.
fn last_ident(arg: &[Tok]) -> String {
    let before_clone = arg
        .windows(2)
        .rposition(|w| matches!(&w[0], Tok::Punct('.')) && is_ident(&w[1], "clone"));
    let end = before_clone.unwrap_or(arg.len());
    arg[..end]
        .iter()
        .rev()
        .find_map(|t| match t {
            Tok::Ident(s) => Some(s.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no identifier in argument {arg:?}"))
}

/// The type of the metric bound to `ident` (a `let` or a struct field): the first of
/// `Counter`, `Gauge`, `Histogram` in one of its declarations.
fn kind_of(toks: &[Tok], ident: &str, file: &str) -> Kind {
    let declarations = toks
        .windows(2)
        .enumerate()
        .filter(|(_, w)| is_ident(&w[0], ident) && matches!(w[1], Tok::Punct(':' | '=')));
    for (at, _) in declarations {
        if toks.get(at + 2) == Some(&Tok::Punct(':')) {
            continue; // `ident::path`, not a declaration.
        }
        let mut angle = 0i32;
        for t in &toks[at + 2..] {
            match t {
                Tok::Ident(s) if s == "Counter" => return Kind::Counter,
                Tok::Ident(s) if s == "Gauge" => return Kind::Gauge,
                Tok::Ident(s) if s == "Histogram" => return Kind::Histogram,
                Tok::Punct('<') => angle += 1,
                Tok::Punct('>') => angle -= 1,
                Tok::Punct(';') => break,
                Tok::Punct(',') if angle <= 0 => break,
                _ => {}
            }
        }
    }
    panic!("{file}: no Counter, Gauge or Histogram declaration for `{ident}`")
}

/// The suffix a `register_with_unit` unit argument adds.
fn unit_suffix(arg: &[Tok], file: &str) -> &'static str {
    match arg.last() {
        Some(Tok::Ident(u)) if u == "Seconds" => "_seconds",
        Some(Tok::Ident(u)) if u == "Bytes" => "_bytes",
        other => panic!("{file}: a unit this test does not know: {other:?}"),
    }
}

/// The (name, metric identifier) pairs of the `for (name, help, metric) in [(…), …]` loop that
/// ends just before token `at`, whose body registers `name_var` with `metric_var`.
fn loop_pairs(toks: &[Tok], at: usize, name_var: &str, metric_var: &str) -> Vec<(String, String)> {
    let for_at = toks[..at]
        .iter()
        .rposition(|t| is_ident(t, "for"))
        .unwrap_or_else(|| panic!("`{name_var}` is registered outside a for loop"));
    let (pattern, close) = call_args(toks, for_at + 1);
    let position = |var: &str| {
        pattern
            .iter()
            .position(|p| p.len() == 1 && is_ident(&p[0], var))
            .unwrap_or_else(|| panic!("`{var}` is not bound by the loop"))
    };
    let (name_at, metric_at) = (position(name_var), position(metric_var));
    assert!(is_ident(&toks[close + 1], "in"), "for (…) in [ … ]");
    let (tuples, _) = call_args(toks, close + 2);
    tuples
        .iter()
        .map(|tuple| {
            let (fields, _) = call_args(tuple, 0);
            let Tok::Str(name) = &fields[name_at][0] else {
                panic!(
                    "the loop's names are string literals: {:?}",
                    fields[name_at]
                );
            };
            (name.clone(), last_ident(fields[metric_at]))
        })
        .collect()
}

/// Every family registered in `file` (its code before `#[cfg(test)]`), named as exposed.
fn registered(file: &str) -> Vec<Family> {
    let src = read(file);
    let code = src.split("#[cfg(test)]").next().unwrap_or_default();
    let toks = tokens(code);
    let mut families = Vec::new();
    for at in 0..toks.len() {
        let with_unit = is_ident(&toks[at], "register_with_unit");
        if !(with_unit || is_ident(&toks[at], "register"))
            || toks.get(at + 1) != Some(&Tok::Punct('('))
            || at < 2
            || !is_ident(&toks[at - 2], "registry")
        {
            continue;
        }
        let (args, _) = call_args(&toks, at + 1);
        let suffix = if with_unit {
            unit_suffix(args[2], file)
        } else {
            ""
        };
        let metric = last_ident(args.last().unwrap());
        let pairs = match args[0] {
            [Tok::Str(name)] => vec![(name.clone(), metric)],
            [Tok::Ident(var)] => loop_pairs(&toks, at, var, &metric),
            other => panic!("{file}: a metric name this test cannot read: {other:?}"),
        };
        for (name, metric) in pairs {
            families.push(Family {
                name: format!("{name}{suffix}"),
                kind: kind_of(&toks, &metric, file),
            });
        }
    }
    families
}

/// Every sample name the operator and the agent export.
fn exported() -> BTreeSet<String> {
    METRICS_SOURCES
        .iter()
        .flat_map(|f| registered(f))
        .flat_map(|f| f.series())
        .collect()
}

#[test]
fn the_registrations_are_read_with_their_types_and_units() {
    let operator = registered(METRICS_SOURCES[0]);
    let agent = registered(METRICS_SOURCES[1]);
    eprintln!("operator: {operator:?}\nagent: {agent:?}");
    for (families, name, kind) in [
        (&operator, "imp_operator_vms", Kind::Gauge),
        (
            &operator,
            "imp_operator_schedule_latency_seconds",
            Kind::Histogram,
        ),
        (&operator, "imp_operator_conflicts", Kind::Counter),
        (&operator, "imp_operator_is_leader", Kind::Gauge),
        (&agent, "imp_agent_start_duration_seconds", Kind::Histogram),
        (&agent, "imp_agent_vm_failures", Kind::Counter),
        // Registered directly, as an f64 gauge.
        (&agent, "imp_vm_guest_cpu_usage_ratio", Kind::Gauge),
        // Registered in a loop over (name, help, family) tuples.
        (&agent, "imp_vm_guest_memory_used_bytes", Kind::Gauge),
        (&agent, "imp_vm_guest_disk_total_bytes", Kind::Gauge),
    ] {
        let want = Family {
            name: name.to_owned(),
            kind,
        };
        assert!(families.contains(&want), "{want:?} not in {families:?}");
    }
    let all = exported();
    assert!(all.contains("imp_operator_conflicts_total"));
    assert!(all.contains("imp_agent_resume_duration_seconds_bucket"));
    assert!(
        !all.contains("imp_operator_conflicts"),
        "a counter's samples end in _total"
    );
}

// ---- What the dashboard and the alerts read ----

/// The metric names in PromQL `expr` (string literals skipped: label values are not names).
fn names_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut in_string = false;
    let mut word = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            in_string = !in_string;
            word.clear();
        } else if !in_string && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
        } else {
            if !word.is_empty() && !word.starts_with(|d: char| d.is_ascii_digit()) {
                names.insert(std::mem::take(&mut word));
            }
            word.clear();
        }
    }
    names
}

/// Every string under a key `expr` anywhere in `v` (the dashboard's panels), with where it is.
fn panel_queries(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                let here = format!("{at}.{k}");
                match child {
                    Value::String(s) if k == "expr" => out.push((here, s.clone())),
                    _ => panel_queries(child, &here, out),
                }
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                panel_queries(child, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Where each expression is, and the expression: the alerts' and the dashboard's.
fn every_query() -> Vec<(String, String)> {
    let rules = rules();
    let mut out: Vec<(String, String)> = all_rules(&rules)
        .into_iter()
        .map(|r| {
            let name = r["alert"].as_str().or(r["record"].as_str()).unwrap();
            (
                format!("imp.rules.yaml {name}"),
                r["expr"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let dashboard = dashboard();
    panel_queries(&dashboard["panels"], "imp.json panels", &mut out);
    // Query variables (label_values(…)); the datasource and the textbox variables hold none.
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        if v["type"] == "query" {
            let q = v["query"]["query"]
                .as_str()
                .or(v["query"].as_str())
                .unwrap();
            out.push((format!("imp.json variable {}", v["name"]), q.to_owned()));
        }
    }
    out
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_read_is_one_the_code_exports() {
    let exported = exported();
    let queries = every_query();
    let (mut used, mut wrong) = (BTreeSet::new(), Vec::new());
    for (at, expr) in &queries {
        let names: BTreeSet<String> = names_in(expr)
            .into_iter()
            .filter(|n| n.starts_with("imp_"))
            .collect();
        // A query reads imp's metrics, or Prometheus's `up` of imp's targets.
        let reads_up = expr.contains("up{");
        assert!(
            !names.is_empty() || reads_up,
            "{at} reads no metric of imp's: {expr}"
        );
        for n in names {
            if !exported.contains(&n) {
                wrong.push(format!("{at}: {n}"));
            }
            used.insert(n);
        }
    }
    assert!(
        wrong.is_empty(),
        "series the code does not export (it exports {exported:?}):\n{}",
        wrong.join("\n")
    );
    eprintln!(
        "{} queries read {} of the {} exported series: {used:?}",
        queries.len(),
        used.len(),
        exported.len()
    );
    // The dashboard covers what the brief asks of it.
    for needed in [
        "imp_operator_vms",
        "imp_agent_vms",
        "imp_agent_start_duration_seconds_bucket",
        "imp_vm_guest_cpu_usage_ratio",
        "imp_vm_guest_memory_used_bytes",
        "imp_vm_guest_disk_used_bytes",
        "imp_agent_resume_duration_seconds_bucket",
        "imp_agent_suspend_duration_seconds_bucket",
        "imp_operator_reconcile_backlog",
        "imp_operator_conflicts_total",
    ] {
        assert!(used.contains(needed), "nothing reads {needed}");
    }
}

#[test]
fn names_are_read_from_promql_without_label_values_or_numbers() {
    let expr =
        r#"histogram_quantile(0.95, sum by (le) (rate(imp_a_bucket{job=~"imp_x.*"}[5m]))) / imp_b"#;
    let names: Vec<String> = names_in(expr)
        .into_iter()
        .filter(|n| n.starts_with("imp_"))
        .collect();
    assert_eq!(names, ["imp_a_bucket", "imp_b"]);
}

#[test]
fn every_alert_says_how_long_how_bad_and_what_and_is_documented() {
    let rules = rules();
    let docs = read("docs/observability.md");
    let alerts: Vec<&Value> = all_rules(&rules)
        .into_iter()
        .filter(|r| r["alert"].is_string())
        .collect();
    assert!(alerts.len() >= 5, "{alerts:?}");
    for a in alerts {
        let name = a["alert"].as_str().unwrap();
        assert!(a["for"].is_string(), "{name} has no for:");
        let severity = a["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("warning" | "critical")),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description"] {
            let text = a["annotations"][key].as_str().unwrap_or_default();
            assert!(!text.is_empty(), "{name} has no {key}");
        }
        assert!(
            docs.contains(&format!("### {name}")),
            "docs/observability.md has no section `### {name}`"
        );
    }
}

// ---- promtool ----

/// Runs promtool with `args` in `dir`; its output, or a panic with what it said.
fn promtool(bin: &Path, dir: &Path, args: &[&str]) -> String {
    let out: Output = Command::new(bin)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool {args:?}: {}\n{said}",
        out.status
    );
    said
}

#[test]
fn promtool_accepts_the_alerts_and_their_unit_tests_pass() {
    let bin = imp_testenv::require_tool!("promtool");
    let dir = path("charts/imp/files/alerts");
    let checked = promtool(&bin, &dir, &["check", "rules", "imp.rules.yaml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&bin, &dir, &["test", "rules", "imp.rules.test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    eprintln!("{}{}", checked.trim(), tested.trim());
}

#[test]
fn every_alert_has_a_unit_test_where_it_fires_and_one_where_it_does_not() {
    let rel = "charts/imp/files/alerts/imp.rules.test.yaml";
    let tests: Value = serde_yaml_ng::from_str(&read(rel)).unwrap();
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .collect();
    let rules = rules();
    for a in all_rules(&rules) {
        let Some(name) = a["alert"].as_str() else {
            continue;
        };
        let fired = |fires: bool| {
            cases.iter().any(|c| {
                c["alertname"] == name
                    && c["exp_alerts"]
                        .as_array()
                        .is_some_and(|e| e.is_empty() != fires)
            })
        };
        assert!(fired(true), "{rel}: no case where {name} fires");
        assert!(fired(false), "{rel}: no case where {name} stays quiet");
    }
}

/// `expr` with Grafana's variables replaced by values Prometheus takes: `$__rate_interval` by
/// a duration, every other `$variable` (all inside `=~"…"`) by `.*`.
fn without_variables(expr: &str) -> String {
    let expr = expr.replace("$__rate_interval", "5m");
    let mut out = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        while chars
            .next_if(|d| d.is_ascii_alphanumeric() || *d == '_')
            .is_some()
        {}
        out.push_str(".*");
    }
    out
}

#[test]
fn every_dashboard_panel_query_is_valid_promql() {
    let bin = imp_testenv::require_tool!("promtool");
    let mut queries = Vec::new();
    panel_queries(&dashboard()["panels"], "panels", &mut queries);
    assert!(queries.len() >= 10, "{queries:?}");
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (at, expr))| {
            assert!(
                at.ends_with(".expr"),
                "a panel query that is not an expr: {at}"
            );
            json!({"record": format!("dashboard:query_{i}"), "expr": without_variables(expr)})
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("imp-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("dashboard.rules.json");
    let groups = json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(&file, serde_json::to_string_pretty(&groups).unwrap()).unwrap();
    let out = Command::new(&bin)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    let numbered: Vec<String> = queries
        .iter()
        .enumerate()
        .map(|(i, (at, expr))| format!("dashboard:query_{i} is {at}: {expr}"))
        .collect();
    assert!(
        out.status.success(),
        "promtool refused a dashboard query:\n{said}\n{}",
        numbered.join("\n")
    );
    eprintln!("{} dashboard queries: {}", queries.len(), said.trim());
}

#[test]
fn grafana_variables_become_values_prometheus_takes() {
    assert_eq!(
        without_variables(r#"rate(x{job=~"$agent_job", a=~"$impvm"}[$__rate_interval])"#),
        r#"rate(x{job=~".*", a=~".*"}[5m])"#
    );
}
