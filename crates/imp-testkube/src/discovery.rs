//! Discovery documents: `/version`, `/api`, `/api/v1`, `/apis`, `/apis/GROUP[/VERSION]`.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::resource::Registry;

/// The Kubernetes version this server imitates, as `/version` and the OpenAPI documents say it.
pub const GIT_VERSION: &str = "v1.34.0-imp-testkube";

/// `/version`: the Kubernetes version this server imitates.
pub fn version() -> Value {
    json!({
        "major": "1", "minor": "34", "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc",
        "platform": "linux/amd64"
    })
}

/// `/api`: the core group's versions.
pub fn core_versions(addr: &str) -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr}]})
}

fn groups(reg: &Registry) -> BTreeMap<String, Vec<(String, bool)>> {
    let mut out: BTreeMap<String, Vec<(String, bool)>> = BTreeMap::new();
    for t in reg.all().filter(|t| !t.group.is_empty()) {
        let vs = out.entry(t.group.clone()).or_default();
        if let Some(v) = vs.iter_mut().find(|(v, _)| *v == t.version) {
            v.1 |= t.storage;
        } else {
            vs.push((t.version.clone(), t.storage));
        }
    }
    out
}

fn group_doc(name: &str, versions: &[(String, bool)]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|(v, _)| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .collect();
    let preferred = versions
        .iter()
        .find(|(_, s)| *s)
        .or(versions.first())
        .map(|(v, _)| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .unwrap_or(Value::Null);
    json!({"name": name, "versions": vs, "preferredVersion": preferred})
}

/// `/apis`: every non-core group, with CRD groups as they are registered.
pub fn group_list(reg: &Registry) -> Value {
    let gs: Vec<Value> = groups(reg).iter().map(|(g, vs)| group_doc(g, vs)).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": gs})
}

/// `/apis/GROUP`: one group, or None when it is not served.
pub fn group(reg: &Registry, name: &str) -> Option<Value> {
    let gs = groups(reg);
    let vs = gs.get(name)?;
    let mut d = group_doc(name, vs);
    d["kind"] = json!("APIGroup");
    d["apiVersion"] = json!("v1");
    Some(d)
}

/// `/api/v1` or `/apis/GROUP/VERSION`: the resources of one group version, or None.
pub fn resource_list(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for t in reg
        .all()
        .filter(|t| t.group == group && t.version == version)
    {
        let mut r = json!({
            "name": t.plural, "singularName": t.singular, "namespaced": t.namespaced,
            "kind": t.kind, "verbs": t.verbs(),
        });
        if !t.short_names.is_empty() {
            r["shortNames"] = json!(t.short_names);
        }
        if !t.categories.is_empty() {
            r["categories"] = json!(t.categories);
        }
        resources.push(r);
        if t.status_subresource {
            resources.push(
                json!({"name": format!("{}/status", t.plural), "singularName": "",
                "namespaced": t.namespaced, "kind": t.kind, "verbs": ["get", "patch", "update"]}),
            );
        }
    }
    if resources.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
    )
}
