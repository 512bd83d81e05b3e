//! The object store: every resource's objects, one global resourceVersion, the retained event
//! history watches resume from, and the write rules (status split, generation, finalizers,
//! garbage collection, CRD registration).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use crate::cel::Rules;
use crate::error::{ApiError, Cause, Result};
use crate::meta::{self, Rng};
use crate::patch::{self, FieldPath, PatchKind};
use crate::resource::{Column, Registry, ResourceType};
use crate::schema;
use crate::selector::Selectors;

/// What happened to an object, as watch events name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// The object was created.
    Added,
    /// The object changed.
    Modified,
    /// The object is gone.
    Deleted,
}

impl EventType {
    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, kept in history and fanned out to watchers.
#[derive(Debug, Clone)]
pub struct Event {
    /// resourceVersion of the change.
    pub rv: u64,
    /// Store key (`group/plural`) of the object's resource.
    pub key: String,
    /// What happened.
    pub kind: EventType,
    /// The object after the change (before it, for deletes, with the delete's rv).
    pub object: Arc<Value>,
    /// The object before the change, so selector watches can turn it into ADDED/DELETED.
    pub old: Option<Arc<Value>>,
}

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The main endpoint.
    Main,
    /// The `/status` subresource.
    Status,
}

/// Options of a write request.
#[derive(Debug, Clone, Default)]
pub struct WriteOpts {
    /// `fieldManager` (or one derived from the User-Agent).
    pub field_manager: String,
    /// `force` for server-side apply.
    pub force: bool,
    /// `dryRun=All`: validate and answer, store nothing.
    pub dry_run: bool,
}

/// Options of a delete request (from the DeleteOptions body).
#[derive(Debug, Clone, Default)]
pub struct DeleteOpts {
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
    /// `propagationPolicy: Orphan` leaves dependents alone.
    pub orphan: bool,
    /// `dryRun=All`.
    pub dry_run: bool,
}

/// What a watch starts from.
#[derive(Debug)]
pub struct WatchStart {
    /// Events to send first (synthetic ADDED or replayed history), in order.
    pub backlog: Vec<Arc<Event>>,
    /// Live events after the backlog.
    pub live: broadcast::Receiver<Arc<Event>>,
    /// resourceVersion the backlog brings the watcher to.
    pub rv: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct Managed {
    manager: String,
    operation: String,
    subresource: String,
    api_version: String,
    time: String,
    fields: BTreeSet<FieldPath>,
}

struct State {
    rv: u64,
    registry: Registry,
    rules: HashMap<(String, String, String), Arc<Rules>>,
    objects: HashMap<String, BTreeMap<(String, String), Arc<Value>>>,
    history: VecDeque<Arc<Event>>,
    compacted: u64,
    validator: kube_cel::Validator,
    rng: Rng,
    /// uid → where the object lives, for garbage collection.
    uids: HashMap<String, (String, String, String)>,
    /// owner uid → dependents (store key, namespace, name).
    dependents: HashMap<String, BTreeSet<(String, String, String)>>,
}

/// The shared store behind the HTTP server.
pub struct Store {
    state: Mutex<State>,
    events: broadcast::Sender<Arc<Event>>,
    history_limit: usize,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("history_limit", &self.history_limit)
            .finish()
    }
}

fn md(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = Value::Object(Map::new());
    }
    let Value::Object(o) = obj else {
        unreachable!("the value was just made an object")
    };
    let m = o
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !m.is_object() {
        *m = Value::Object(Map::new());
    }
    let Value::Object(m) = m else {
        unreachable!("metadata was just made an object")
    };
    m
}

fn rv_of(obj: &Value) -> &str {
    obj.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn finalizers(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Value::Object(m) = &mut o {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

fn without_volatile(obj: &Value) -> Value {
    let mut o = obj.clone();
    let m = md(&mut o);
    m.remove("resourceVersion");
    o
}

fn read_managed(obj: &Value) -> Vec<Managed> {
    obj.pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| Managed {
                    manager: e["manager"].as_str().unwrap_or("").into(),
                    operation: e["operation"].as_str().unwrap_or("Update").into(),
                    subresource: e["subresource"].as_str().unwrap_or("").into(),
                    api_version: e["apiVersion"].as_str().unwrap_or("").into(),
                    time: e["time"].as_str().unwrap_or("").into(),
                    fields: patch::from_fields_v1(&e["fieldsV1"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn write_managed(obj: &mut Value, entries: &[Managed]) {
    let list: Vec<Value> = entries
        .iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut v = json!({
                "manager": e.manager,
                "operation": e.operation,
                "apiVersion": e.api_version,
                "time": e.time,
                "fieldsType": "FieldsV1",
                "fieldsV1": patch::to_fields_v1(&e.fields),
            });
            if !e.subresource.is_empty() {
                v["subresource"] = json!(e.subresource);
            }
            v
        })
        .collect();
    let m = md(obj);
    if list.is_empty() {
        m.remove("managedFields");
    } else {
        m.insert("managedFields".into(), Value::Array(list));
    }
}

fn in_part(p: &[String], part: Part, split: bool) -> bool {
    let is_status = p.first().is_some_and(|s| s == "status");
    match part {
        Part::Status => is_status,
        Part::Main => !(split && is_status),
    }
}

fn sub_name(part: Part) -> &'static str {
    match part {
        Part::Main => "",
        Part::Status => "status",
    }
}

/// Records an Update-operation write by `manager`: it takes the fields it changed.
fn track_update(
    entries: &mut Vec<Managed>,
    old: &Value,
    new: &Value,
    manager: &str,
    part: Part,
    split: bool,
    api_version: &str,
) {
    let changed: BTreeSet<FieldPath> = patch::changed_fields(old, new)
        .into_iter()
        .filter(|p| in_part(p, part, split))
        .collect();
    if changed.is_empty() {
        return;
    }
    for e in entries.iter_mut() {
        if e.manager != manager || e.operation != "Update" {
            e.fields
                .retain(|q| !changed.iter().any(|p| patch::overlaps(p, q)));
        }
    }
    let now_fields: BTreeSet<FieldPath> = patch::leaf_fields(new)
        .into_iter()
        .filter(|p| changed.iter().any(|c| patch::overlaps(c, p)))
        .collect();
    let sub = sub_name(part);
    match entries
        .iter_mut()
        .find(|e| e.manager == manager && e.operation == "Update" && e.subresource == sub)
    {
        Some(e) => {
            e.fields
                .retain(|q| !changed.iter().any(|p| patch::overlaps(p, q)));
            e.fields.extend(now_fields);
            e.time = meta::rfc3339(meta::now_secs());
        }
        None => entries.push(Managed {
            manager: manager.into(),
            operation: "Update".into(),
            subresource: sub.into(),
            api_version: api_version.into(),
            time: meta::rfc3339(meta::now_secs()),
            fields: now_fields,
        }),
    }
    entries.retain(|e| !e.fields.is_empty());
}

/// Merges an apply configuration into `target`: maps merge, everything else replaces.
fn apply_merge(target: &mut Value, config: &Value) {
    match (target, config) {
        (Value::Object(t), Value::Object(c)) => {
            for (k, v) in c {
                match t.get_mut(k) {
                    Some(existing) if existing.is_object() && v.is_object() => {
                        apply_merge(existing, v)
                    }
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (t, c) => *t = c.clone(),
    }
}

/// Server-side apply of `config` by `manager` onto `current`, with conflict detection.
fn server_side_apply(
    rt: &ResourceType,
    current: &Value,
    config: &Value,
    opts: &WriteOpts,
    part: Part,
) -> Result<Value> {
    let split = rt.status_subresource;
    let manager = opts.field_manager.as_str();
    let sub = sub_name(part);
    let cfg_fields: BTreeSet<FieldPath> = patch::leaf_fields(config)
        .into_iter()
        .filter(|p| in_part(p, part, split))
        .collect();
    let mut entries = read_managed(current);
    let mut conflicts = Vec::new();
    for e in &entries {
        if e.manager == manager {
            continue;
        }
        for q in &e.fields {
            for p in &cfg_fields {
                if patch::overlaps(p, q)
                    && patch::get_path(current, p) != patch::get_path(config, p)
                {
                    let shown = if q.len() > p.len() { q } else { p };
                    conflicts.push((e.manager.clone(), patch::display_path(shown)));
                }
            }
        }
    }
    conflicts.sort();
    conflicts.dedup();
    if !conflicts.is_empty() && !opts.force {
        return Err(ApiError::apply_conflict(
            rt.target(),
            meta::name(current),
            &conflicts,
        ));
    }
    if opts.force {
        for e in entries.iter_mut().filter(|e| e.manager != manager) {
            e.fields.retain(|q| {
                !cfg_fields.iter().any(|p| {
                    patch::overlaps(p, q)
                        && patch::get_path(current, p) != patch::get_path(config, p)
                })
            });
        }
    }
    let prev: BTreeSet<FieldPath> = entries
        .iter()
        .find(|e| e.manager == manager && e.operation == "Apply" && e.subresource == sub)
        .map(|e| e.fields.clone())
        .unwrap_or_default();
    let mut new = current.clone();
    for r in prev.difference(&cfg_fields) {
        let owned_elsewhere = entries.iter().any(|e| {
            !(e.manager == manager && e.operation == "Apply")
                && e.fields.iter().any(|q| patch::overlaps(q, r))
        }) || cfg_fields.iter().any(|p| patch::overlaps(p, r));
        if !owned_elsewhere {
            patch::remove_path(&mut new, r);
        }
    }
    let mut cfg = config.clone();
    if let Value::Object(m) = &mut cfg {
        if part == Part::Status {
            m.retain(|k, _| k == "status");
        } else if split {
            m.remove("status");
        }
        if let Some(Value::Object(cm)) = m.get_mut("metadata") {
            cm.retain(|k, _| {
                matches!(
                    k.as_str(),
                    "labels" | "annotations" | "finalizers" | "ownerReferences"
                )
            });
        }
    }
    apply_merge(&mut new, &cfg);
    let now = meta::rfc3339(meta::now_secs());
    match entries
        .iter_mut()
        .find(|e| e.manager == manager && e.operation == "Apply" && e.subresource == sub)
    {
        Some(e) => {
            if e.fields != cfg_fields {
                e.fields = cfg_fields;
                e.time = now;
            }
        }
        None => entries.push(Managed {
            manager: manager.into(),
            operation: "Apply".into(),
            subresource: sub.into(),
            api_version: rt.api_version(),
            time: now,
            fields: cfg_fields,
        }),
    }
    entries.retain(|e| !e.fields.is_empty());
    write_managed(&mut new, &entries);
    Ok(new)
}

fn b64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// A stored object as the requested resource and version present it.
pub fn present(rt: &ResourceType, obj: &Value) -> Value {
    let mut o = if rt.is_events_v1() {
        crate::events::from_core(obj.clone())
    } else {
        obj.clone()
    };
    o["apiVersion"] = json!(rt.api_version());
    o["kind"] = json!(rt.kind);
    o
}

/// A request body in the shape it is stored in.
fn to_storage(rt: &ResourceType, obj: Value) -> Value {
    if rt.is_events_v1() {
        crate::events::to_core(obj)
    } else {
        obj
    }
}

fn is_crd(rt: &ResourceType) -> bool {
    rt.group == "apiextensions.k8s.io" && rt.plural == "customresourcedefinitions"
}

fn is_namespace(rt: &ResourceType) -> bool {
    rt.group.is_empty() && rt.plural == "namespaces"
}

/// Builds the resource types a CRD serves, with their compiled rules.
fn crd_types(crd: &Value) -> std::result::Result<Vec<(ResourceType, Arc<Rules>)>, Vec<Cause>> {
    let spec = &crd["spec"];
    let s = |p: &str| {
        spec.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let group = s("/group");
    let plural = s("/names/plural");
    let kind = s("/names/kind");
    let mut causes = Vec::new();
    if group.is_empty() {
        causes.push(Cause::new(
            "FieldValueRequired",
            "spec.group",
            "Required value",
        ));
    }
    if plural.is_empty() {
        causes.push(Cause::new(
            "FieldValueRequired",
            "spec.names.plural",
            "Required value",
        ));
    }
    if kind.is_empty() {
        causes.push(Cause::new(
            "FieldValueRequired",
            "spec.names.kind",
            "Required value",
        ));
    }
    let want = format!("{plural}.{group}");
    if meta::name(crd) != want {
        causes.push(Cause::new(
            "FieldValueInvalid",
            "metadata.name",
            format!(
                "Invalid value: {:?}: must be spec.names.plural+\".\"+spec.group",
                meta::name(crd)
            ),
        ));
    }
    let scope = s("/scope");
    if scope != "Namespaced" && scope != "Cluster" {
        causes.push(Cause::new(
            "FieldValueNotSupported",
            "spec.scope",
            format!("Unsupported value: {scope:?}: supported values: \"Cluster\", \"Namespaced\""),
        ));
    }
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    if versions.is_empty() {
        causes.push(Cause::new(
            "FieldValueRequired",
            "spec.versions",
            "Required value",
        ));
    }
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for (i, v) in versions.iter().enumerate() {
        if !v["served"].as_bool().unwrap_or(false) {
            continue;
        }
        let vname = v["name"].as_str().unwrap_or("").to_string();
        let root = schema::version_schema(v);
        let mut problems = Vec::new();
        schema::check(
            &root,
            &format!("spec.versions[{i}].schema.openAPIV3Schema"),
            &mut problems,
        );
        for p in problems {
            causes.push(Cause::new(
                "FieldValueInvalid",
                &format!("spec.versions[{i}].schema.openAPIV3Schema"),
                p,
            ));
        }
        let rules = match Rules::compile(&root) {
            Ok(r) => Arc::new(r),
            Err(errs) => {
                for e in errs {
                    causes.push(Cause::new(
                        "FieldValueInvalid",
                        &format!("spec.versions[{i}].schema.openAPIV3Schema"),
                        format!("Invalid value: \"object\": compilation failed: {e}"),
                    ));
                }
                continue;
            }
        };
        let columns = v["additionalPrinterColumns"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| Column {
                        name: c["name"].as_str().unwrap_or("").into(),
                        type_: c["type"].as_str().unwrap_or("string").into(),
                        json_path: c["jsonPath"].as_str().unwrap_or("").into(),
                        priority: c["priority"].as_i64().unwrap_or(0),
                        description: c["description"].as_str().unwrap_or("").into(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let selectable = v["selectableFields"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|f| f["jsonPath"].as_str())
                    .map(|p| p.trim_start_matches('.').to_string())
                    .collect()
            })
            .unwrap_or_default();
        out.push((
            ResourceType {
                group: group.clone(),
                version: vname,
                plural: plural.clone(),
                singular: spec
                    .pointer("/names/singular")
                    .and_then(Value::as_str)
                    .map(String::from)
                    .unwrap_or_else(|| kind.to_lowercase()),
                kind: kind.clone(),
                namespaced: scope == "Namespaced",
                short_names: strs(&spec["names"]["shortNames"]),
                categories: strs(&spec["names"]["categories"]),
                status_subresource: v.pointer("/subresources/status").is_some(),
                create_only: false,
                columns,
                selectable_fields: selectable,
                schema: Some(Arc::new(root)),
                storage: v["storage"].as_bool().unwrap_or(false),
            },
            rules,
        ));
    }
    if causes.is_empty() {
        Ok(out)
    } else {
        Err(causes)
    }
}

impl State {
    fn bucket(&mut self, key: &str) -> &mut BTreeMap<(String, String), Arc<Value>> {
        self.objects.entry(key.to_string()).or_default()
    }

    fn owner_uids(obj: &Value) -> Vec<String> {
        obj.pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|r| r["uid"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn unindex(&mut self, key: &str, obj: &Value) {
        let place = (
            key.to_string(),
            meta::namespace(obj).to_string(),
            meta::name(obj).to_string(),
        );
        self.uids.remove(meta::uid(obj));
        for o in Self::owner_uids(obj) {
            if let Some(d) = self.dependents.get_mut(&o) {
                d.remove(&place);
                if d.is_empty() {
                    self.dependents.remove(&o);
                }
            }
        }
    }

    /// Stores an object, keeping the uid and owner indexes current.
    fn put(&mut self, key: &str, obj: Arc<Value>) {
        let k = (
            meta::namespace(&obj).to_string(),
            meta::name(&obj).to_string(),
        );
        if let Some(old) = self.bucket(key).insert(k.clone(), obj.clone()) {
            self.unindex(key, &old);
        }
        let place = (key.to_string(), k.0, k.1);
        self.uids.insert(meta::uid(&obj).to_string(), place.clone());
        for o in Self::owner_uids(&obj) {
            self.dependents.entry(o).or_default().insert(place.clone());
        }
    }

    /// Takes an object out of the store and the indexes.
    fn take(&mut self, key: &str, ns: &str, name: &str) -> Option<Arc<Value>> {
        let old = self
            .bucket(key)
            .remove(&(ns.to_string(), name.to_string()))?;
        self.unindex(key, &old);
        Some(old)
    }

    fn get(&self, rt: &ResourceType, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects
            .get(&rt.store_key())
            .and_then(|b| b.get(&(ns.to_string(), name.to_string())))
            .cloned()
    }

    fn emit(&mut self, tx: &broadcast::Sender<Arc<Event>>, limit: usize, ev: Event) {
        let ev = Arc::new(ev);
        self.history.push_back(ev.clone());
        while self.history.len() > limit {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        let _ = tx.send(ev);
    }

    /// Prunes, defaults and validates a custom object against its CRD version's schema.
    fn admit_custom(&self, rt: &ResourceType, obj: &mut Value, old: Option<&Value>) -> Result<()> {
        let Some(root) = &rt.schema else {
            return Ok(());
        };
        schema::prune(obj, root, true);
        schema::apply_defaults(obj, root);
        let mut causes = Vec::new();
        if let Err(msg) = meta::check_subdomain(meta::name(obj)).map_or(Ok(()), Err) {
            causes.push(Cause::new(
                "FieldValueInvalid",
                "metadata.name",
                format!("Invalid value: {:?}: {msg}", meta::name(obj)),
            ));
        }
        schema::validate(obj, root, "", &mut causes);
        if causes.is_empty()
            && let Some(rules) =
                self.rules
                    .get(&(rt.group.clone(), rt.version.clone(), rt.plural.clone()))
        {
            causes.extend(rules.evaluate(&self.validator, obj, old));
        }
        if causes.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(rt.target(), meta::name(obj), &causes))
        }
    }

    /// Type-specific rules for built-ins on create and update.
    fn admit_builtin(&mut self, rt: &ResourceType, obj: &mut Value, create: bool) -> Result<()> {
        match (rt.group.as_str(), rt.plural.as_str()) {
            ("", "secrets") => {
                if let Some(Value::Object(sd)) = obj.get("stringData").cloned() {
                    for (k, v) in sd {
                        let enc = b64(v.as_str().unwrap_or("").as_bytes());
                        obj["data"][k] = json!(enc);
                    }
                    if let Value::Object(m) = obj {
                        m.remove("stringData");
                    }
                }
                if obj.get("type").is_none() {
                    obj["type"] = json!("Opaque");
                }
            }
            ("", "namespaces") => {
                if obj.pointer("/status/phase").is_none() {
                    obj["status"] = json!({"phase": "Active"});
                }
                let name = meta::name(obj).to_string();
                let labels = md(obj).entry("labels").or_insert_with(|| json!({}));
                if labels.is_object() {
                    labels["kubernetes.io/metadata.name"] = json!(name);
                }
            }
            ("", "pods") if create && obj.pointer("/status/phase").is_none() => {
                obj["status"]["phase"] = json!("Pending");
            }
            ("apiextensions.k8s.io", "customresourcedefinitions") => {
                let types = crd_types(obj)
                    .map_err(|c| ApiError::invalid(rt.target(), meta::name(obj), &c))?;
                let storage: Vec<String> = types
                    .iter()
                    .filter(|(t, _)| t.storage)
                    .map(|(t, _)| t.version.clone())
                    .collect();
                let established = obj
                    .pointer("/status/conditions")
                    .and_then(Value::as_array)
                    .is_some_and(|c| c.iter().any(|c| c["type"] == "Established"));
                if established {
                    obj["status"]["acceptedNames"] = obj["spec"]["names"].clone();
                    obj["status"]["storedVersions"] = json!(storage);
                    return Ok(());
                }
                let now = meta::rfc3339(meta::now_secs());
                obj["status"] = json!({
                    "acceptedNames": obj["spec"]["names"].clone(),
                    "storedVersions": storage,
                    "conditions": [
                        {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found", "lastTransitionTime": now},
                        {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted", "lastTransitionTime": now},
                    ],
                });
            }
            _ => {}
        }
        Ok(())
    }

    fn register_crd(&mut self, crd: &Value) {
        if let Ok(types) = crd_types(crd) {
            if let Some((t, _)) = types.first() {
                let (g, p) = (t.group.clone(), t.plural.clone());
                self.registry.remove(&g, &p);
                self.rules.retain(|(rg, _, rp), _| !(rg == &g && rp == &p));
            }
            for (t, r) in types {
                self.rules
                    .insert((t.group.clone(), t.version.clone(), t.plural.clone()), r);
                self.registry.insert(t);
            }
        }
    }
}

impl Store {
    /// Stamps the next resourceVersion on `obj`, stores it under `key` and tells the watchers.
    fn record(
        &self,
        st: &mut State,
        key: String,
        mut obj: Value,
        kind: EventType,
        old: Option<Arc<Value>>,
    ) -> Arc<Value> {
        st.rv += 1;
        let rv = st.rv;
        md(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        let obj = Arc::new(obj);
        st.put(&key, obj.clone());
        st.emit(
            &self.events,
            self.history_limit,
            Event {
                rv,
                key,
                kind,
                object: obj.clone(),
                old,
            },
        );
        obj
    }

    /// An empty store with the built-in resources and default namespaces.
    pub fn new(history_limit: usize) -> Self {
        let (events, _) = broadcast::channel(65_536);
        let store = Self {
            state: Mutex::new(State {
                rv: 0,
                registry: Registry::with_builtins(),
                rules: HashMap::new(),
                objects: HashMap::new(),
                history: VecDeque::new(),
                compacted: 0,
                validator: kube_cel::Validator::new(),
                rng: Rng::new(),
                uids: HashMap::new(),
                dependents: HashMap::new(),
            }),
            events,
            history_limit: history_limit.max(1),
        };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            if let Some(rt) = store.resource("", "v1", "namespaces") {
                let _ = store.create(
                    &rt,
                    "",
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
                    &WriteOpts::default(),
                );
            }
        }
        store
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks up a served resource type.
    pub fn resource(&self, group: &str, version: &str, plural: &str) -> Option<Arc<ResourceType>> {
        self.lock().registry.get(group, version, plural)
    }

    /// A snapshot of every served resource type (for discovery).
    pub fn registry(&self) -> Registry {
        self.lock().registry.clone()
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    fn out(rt: &ResourceType, obj: &Value) -> Value {
        present(rt, obj)
    }

    /// Creates an object (POST).
    pub fn create(
        &self,
        rt: &ResourceType,
        ns: &str,
        obj: Value,
        opts: &WriteOpts,
    ) -> Result<Value> {
        self.create_with(rt, ns, obj, opts, None)
    }

    /// Creates an object; `managed` carries the ownership of an apply that creates it.
    fn create_with(
        &self,
        rt: &ResourceType,
        ns: &str,
        obj: Value,
        opts: &WriteOpts,
        managed: Option<Vec<Managed>>,
    ) -> Result<Value> {
        let mut obj = to_storage(rt, obj);
        if !obj.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        let mut st = self.lock();
        if let Some(k) = obj.get("kind").and_then(Value::as_str)
            && k != rt.kind
        {
            return Err(ApiError::bad_request(format!(
                "the kind in the body ({k}) does not match the resource ({})",
                rt.kind
            )));
        }
        obj["apiVersion"] = json!(rt.api_version());
        obj["kind"] = json!(rt.kind);
        let rng_suffix = st.rng.suffix();
        let m = md(&mut obj);
        if m.get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .is_empty()
        {
            match m.get("generateName").and_then(Value::as_str) {
                Some(g) if !g.is_empty() => {
                    let n = format!("{g}{rng_suffix}");
                    m.insert("name".into(), json!(n));
                }
                _ => {
                    return Err(ApiError::invalid(
                        rt.target(),
                        "",
                        &[Cause::new(
                            "FieldValueRequired",
                            "metadata.name",
                            "Required value: name or generateName is required",
                        )],
                    ));
                }
            }
        }
        if rt.namespaced {
            let body_ns = m.get("namespace").and_then(Value::as_str).unwrap_or("");
            if !body_ns.is_empty() && body_ns != ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            m.insert("namespace".into(), json!(ns));
        } else {
            m.remove("namespace");
        }
        if m.get("resourceVersion")
            .and_then(Value::as_str)
            .is_some_and(|r| !r.is_empty())
        {
            return Err(ApiError::bad_request(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        for k in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
            "managedFields",
            "selfLink",
        ] {
            m.remove(k);
        }
        let name = meta::name(&obj).to_string();
        let bad = if is_namespace(rt) {
            meta::check_label(&name)
        } else {
            meta::check_subdomain(&name)
        };
        if let Some(msg) = bad {
            return Err(ApiError::invalid(
                rt.target(),
                &name,
                &[Cause::new(
                    "FieldValueInvalid",
                    "metadata.name",
                    format!("Invalid value: {name:?}: {msg}"),
                )],
            ));
        }
        if rt.namespaced {
            let Some(nsrt) = st.registry.get("", "v1", "namespaces") else {
                return Err(ApiError::internal("namespaces are not registered"));
            };
            match st.get(&nsrt, "", ns) {
                None => return Err(ApiError::not_found(nsrt.target(), ns)),
                Some(n) if n.pointer("/metadata/deletionTimestamp").is_some() => {
                    return Err(ApiError {
                        code: 403,
                        reason: "Forbidden",
                        message: format!(
                            "{} \"{name}\" is forbidden: unable to create new content in namespace {ns} because it is being terminated",
                            rt.plural
                        ),
                        details: json!({"name": name, "group": rt.group, "kind": rt.plural}),
                    });
                }
                _ => {}
            }
        }
        if st.get(rt, ns, &name).is_some() {
            return Err(ApiError::already_exists(rt.target(), &name));
        }
        if rt.status_subresource
            && rt.schema.is_some()
            && let Value::Object(o) = &mut obj
        {
            o.remove("status");
        }
        st.admit_custom(rt, &mut obj, None)?;
        st.admit_builtin(rt, &mut obj, true)?;
        let uid = st.rng.uid();
        let now = meta::rfc3339(meta::now_secs());
        let m = md(&mut obj);
        m.insert("uid".into(), json!(uid));
        m.insert("creationTimestamp".into(), json!(now));
        m.insert("generation".into(), json!(1));
        let manager = if opts.field_manager.is_empty() {
            "unknown"
        } else {
            opts.field_manager.as_str()
        };
        let entries = match managed {
            Some(m) => m,
            None => {
                let mut entries = Vec::new();
                track_update(
                    &mut entries,
                    &json!({}),
                    &obj,
                    manager,
                    Part::Main,
                    false,
                    &rt.api_version(),
                );
                entries
            }
        };
        write_managed(&mut obj, &entries);
        if opts.dry_run {
            return Ok(Self::out(rt, &obj));
        }
        let obj = self.record(&mut st, rt.store_key(), obj, EventType::Added, None);
        if is_crd(rt) {
            st.register_crd(&obj);
        }
        Ok(Self::out(rt, &obj))
    }

    /// Reads one object.
    pub fn get(&self, rt: &ResourceType, ns: &str, name: &str) -> Result<Value> {
        let st = self.lock();
        st.get(rt, ns, name)
            .map(|o| Self::out(rt, &o))
            .ok_or_else(|| ApiError::not_found(rt.target(), name))
    }

    /// Lists objects (all namespaces when `ns` is None), with paging by `limit`/`continue`.
    pub fn list(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        sel: &Selectors,
        limit: Option<usize>,
        cont: Option<&str>,
    ) -> Result<(Vec<Value>, u64, Option<String>)> {
        let st = self.lock();
        let (list_rv, after) = match cont {
            Some(c) if !c.is_empty() => {
                let mut parts = c.splitn(3, '|');
                let rv = parts.next().and_then(|r| r.parse::<u64>().ok());
                let ns = parts.next().unwrap_or("").to_string();
                let name = parts.next().unwrap_or("").to_string();
                match rv {
                    Some(rv) => (rv, Some((ns, name))),
                    None => return Err(ApiError::bad_request("invalid continue token")),
                }
            }
            _ => (st.rv, None),
        };
        if after.is_some() && list_rv < st.compacted {
            return Err(ApiError::gone(
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
            ));
        }
        let mut items = Vec::new();
        let mut next = None;
        if let Some(bucket) = st.objects.get(&rt.store_key()) {
            let lower = match &after {
                Some(k) => std::ops::Bound::Excluded(k.clone()),
                None => std::ops::Bound::Unbounded,
            };
            let iter = bucket.range::<(String, String), _>((lower, std::ops::Bound::Unbounded));
            for ((ons, oname), o) in iter {
                if let Some(ns) = ns
                    && ons != ns
                {
                    continue;
                }
                if !sel.matches(o) {
                    continue;
                }
                if let Some(l) = limit
                    && l > 0
                    && items.len() == l
                {
                    let (ns0, n0) = items
                        .last()
                        .map(|v: &Value| {
                            (meta::namespace(v).to_string(), meta::name(v).to_string())
                        })
                        .unwrap_or_default();
                    let _ = (ons, oname);
                    next = Some(format!("{list_rv}|{ns0}|{n0}"));
                    break;
                }
                items.push(Self::out(rt, o));
            }
        }
        Ok((items, list_rv, next))
    }

    /// Replaces an object (PUT) or its status (PUT /status).
    pub fn update(
        &self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        obj: Value,
        part: Part,
        opts: &WriteOpts,
    ) -> Result<Value> {
        if !obj.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        let body_name = meta::name(&obj);
        if !body_name.is_empty() && body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        let mut st = self.lock();
        let old = st
            .get(rt, ns, name)
            .ok_or_else(|| ApiError::not_found(rt.target(), name))?;
        let want = rv_of(&obj);
        if !want.is_empty() && want != rv_of(&old) {
            return Err(ApiError::conflict(
                rt.target(),
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        let new = self.prepare(rt, &old, to_storage(rt, obj), part);
        let manager = self.manager(opts);
        self.commit(&mut st, rt, &old, new, part, Some(&manager), opts)
    }

    fn manager(&self, opts: &WriteOpts) -> String {
        if opts.field_manager.is_empty() {
            "unknown".into()
        } else {
            opts.field_manager.clone()
        }
    }

    /// Patches an object or its status; an apply patch creates a missing object.
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        kind: PatchKind,
        body: &Value,
        part: Part,
        opts: &WriteOpts,
    ) -> Result<Value> {
        let current = self.lock().get(rt, ns, name);
        let Some(old) = current else {
            if kind == PatchKind::Apply && part == Part::Main {
                if opts.field_manager.is_empty() {
                    return Err(ApiError::bad_request(
                        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                    ));
                }
                let base = json!({"metadata": {"name": name}});
                let applied = server_side_apply(rt, &base, body, opts, part)?;
                let entries = read_managed(&applied);
                return self.create_with(rt, ns, applied, opts, Some(entries));
            }
            return Err(ApiError::not_found(rt.target(), name));
        };
        let mut st = self.lock();
        // Re-read under the lock so the patch applies to the latest version.
        let old = st.get(rt, ns, name).unwrap_or(old);
        let mut target = if rt.is_events_v1() {
            crate::events::from_core((*old).clone())
        } else {
            (*old).clone()
        };
        let manager = self.manager(opts);
        let (new, track) = match kind {
            PatchKind::Merge => {
                patch::merge_patch(&mut target, body);
                (target, true)
            }
            PatchKind::Strategic => {
                patch::strategic_patch(&mut target, body);
                (target, true)
            }
            PatchKind::Json => {
                patch::json_patch(&mut target, body)?;
                (target, true)
            }
            PatchKind::Apply => {
                if opts.field_manager.is_empty() {
                    return Err(ApiError::bad_request(
                        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                    ));
                }
                if let Some(k) = body.get("kind").and_then(Value::as_str)
                    && k != rt.kind
                {
                    return Err(ApiError::bad_request(format!(
                        "the kind in the body ({k}) does not match the resource ({})",
                        rt.kind
                    )));
                }
                let config = to_storage(rt, body.clone());
                let applied = server_side_apply(rt, &old, &config, opts, part)?;
                (
                    crate::events::from_core_if(rt.is_events_v1(), applied),
                    false,
                )
            }
        };
        let new = to_storage(rt, new);
        let want = rv_of(&new).to_string();
        if !want.is_empty() && want != rv_of(&old) {
            return Err(ApiError::conflict(
                rt.target(),
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        let new = self.prepare(rt, &old, new, part);
        let manager = track.then_some(manager);
        self.commit(&mut st, rt, &old, new, part, manager.as_deref(), opts)
    }

    /// Builds the object a write to `part` stores: the status split, and server-owned metadata.
    fn prepare(&self, rt: &ResourceType, old: &Value, mut new: Value, part: Part) -> Value {
        if rt.status_subresource {
            match part {
                Part::Main => match old.get("status") {
                    Some(s) => new["status"] = s.clone(),
                    None => {
                        if let Value::Object(m) = &mut new {
                            m.remove("status");
                        }
                    }
                },
                Part::Status => {
                    let status = new.get("status").cloned();
                    let managed = new.pointer("/metadata/managedFields").cloned();
                    new = old.clone();
                    match status {
                        Some(s) => new["status"] = s,
                        None => {
                            if let Value::Object(m) = &mut new {
                                m.remove("status");
                            }
                        }
                    }
                    if let Some(mf) = managed {
                        md(&mut new).insert("managedFields".into(), mf);
                    }
                }
            }
        }
        new["apiVersion"] = old["apiVersion"].clone();
        new["kind"] = old["kind"].clone();
        let keep = [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
        ];
        let old_md = old.get("metadata").cloned().unwrap_or_else(|| json!({}));
        let m = md(&mut new);
        for k in keep {
            match old_md.get(k) {
                Some(v) => {
                    m.insert(k.into(), v.clone());
                }
                None => {
                    m.remove(k);
                }
            }
        }
        new
    }

    /// Validates and stores an updated object, or removes it when deletion is complete.
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &self,
        st: &mut State,
        rt: &ResourceType,
        old: &Arc<Value>,
        mut new: Value,
        part: Part,
        manager: Option<&str>,
        opts: &WriteOpts,
    ) -> Result<Value> {
        let name = meta::name(old).to_string();
        let ns = meta::namespace(old).to_string();
        st.admit_custom(rt, &mut new, Some(old))?;
        st.admit_builtin(rt, &mut new, false)?;
        if old.pointer("/metadata/deletionTimestamp").is_some() {
            let had = finalizers(old);
            if let Some(f) = finalizers(&new).iter().find(|f| !had.contains(f)) {
                return Err(ApiError::invalid(
                    rt.target(),
                    &name,
                    &[Cause::new(
                        "FieldValueForbidden",
                        "metadata.finalizers",
                        format!(
                            "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{{{f:?}}}"
                        ),
                    )],
                ));
            }
        }
        if spec_part(old) != spec_part(&new) {
            let g = old
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            md(&mut new).insert("generation".into(), json!(g + 1));
        }
        let mut entries = read_managed(old);
        if let Some(mgr) = manager {
            track_update(
                &mut entries,
                old,
                &new,
                mgr,
                part,
                rt.status_subresource,
                &rt.api_version(),
            );
            write_managed(&mut new, &entries);
        }
        let deleting = new.pointer("/metadata/deletionTimestamp").is_some();
        if deleting && finalizers(&new).is_empty() {
            if opts.dry_run {
                return Ok(Self::out(rt, &new));
            }
            let gone = self.remove(st, rt, &ns, &name, Some(new));
            return Ok(Self::out(rt, &gone));
        }
        if without_volatile(&new) == without_volatile(old) {
            return Ok(Self::out(rt, old));
        }
        if opts.dry_run {
            return Ok(Self::out(rt, &new));
        }
        let new = self.record(
            st,
            rt.store_key(),
            new,
            EventType::Modified,
            Some(old.clone()),
        );
        if is_crd(rt) {
            st.register_crd(&new);
        }
        Ok(Self::out(rt, &new))
    }

    /// Removes an object for good, then collects what depended on it.
    fn remove(
        &self,
        st: &mut State,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        last: Option<Value>,
    ) -> Value {
        self.remove_with(st, rt, ns, name, last, false)
    }

    /// Removes an object; `orphan` strips its dependents' references instead of deleting them.
    fn remove_with(
        &self,
        st: &mut State,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        last: Option<Value>,
        orphan: bool,
    ) -> Value {
        let key = rt.store_key();
        let Some(old) = st.take(&key, ns, name) else {
            return last.unwrap_or(Value::Null);
        };
        st.rv += 1;
        let rv = st.rv;
        let mut gone = last.unwrap_or_else(|| (*old).clone());
        md(&mut gone).insert("resourceVersion".into(), json!(rv.to_string()));
        let gone_arc = Arc::new(gone.clone());
        st.emit(
            &self.events,
            self.history_limit,
            Event {
                rv,
                key: key.clone(),
                kind: EventType::Deleted,
                object: gone_arc,
                old: Some(old.clone()),
            },
        );
        if is_crd(rt) {
            let g = gone["spec"]["group"].as_str().unwrap_or("").to_string();
            let p = gone["spec"]["names"]["plural"]
                .as_str()
                .unwrap_or("")
                .to_string();
            if let Some(crt) = st.registry.storage_of(&g, &p) {
                let keys: Vec<(String, String)> = st
                    .objects
                    .get(&crt.store_key())
                    .map(|b| b.keys().cloned().collect())
                    .unwrap_or_default();
                for (ons, oname) in keys {
                    self.remove(st, &crt, &ons, &oname, None);
                }
            }
            st.registry.remove(&g, &p);
            st.rules.retain(|(rg, _, rp), _| !(rg == &g && rp == &p));
        }
        if orphan {
            self.orphan_dependents(st, meta::uid(&gone));
        } else {
            self.collect_garbage(st, meta::uid(&gone).to_string());
        }
        if !ns.is_empty() {
            self.finish_namespace(st, ns);
        }
        gone
    }

    /// Deletes dependents whose every owner is gone (background propagation).
    fn collect_garbage(&self, st: &mut State, owner_uid: String) {
        if owner_uid.is_empty() {
            return;
        }
        let places: Vec<(String, String, String)> = st
            .dependents
            .get(&owner_uid)
            .map(|d| d.iter().cloned().collect())
            .unwrap_or_default();
        let mut dependents = Vec::new();
        for (key, ns, name) in places {
            if let Some(o) = st
                .objects
                .get(&key)
                .and_then(|b| b.get(&(ns.clone(), name.clone())))
            {
                dependents.push((key, ns, name, State::owner_uids(o)));
            }
        }
        for (key, ns, name, owners) in dependents {
            if owners
                .iter()
                .any(|u| u != &owner_uid && st.uids.contains_key(u))
            {
                continue;
            }
            let Some((g, p)) = key.split_once('/') else {
                continue;
            };
            if let Some(drt) = st.registry.storage_of(g, p) {
                let _ = self.delete_locked(st, &drt, &ns, &name, &DeleteOpts::default());
            }
        }
    }

    /// Drops references to `owner_uid` from its dependents (`propagationPolicy: Orphan`).
    fn orphan_dependents(&self, st: &mut State, owner_uid: &str) {
        let hits: Vec<(String, Arc<Value>)> = st
            .dependents
            .get(owner_uid)
            .map(|d| d.iter().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(k, ns, name)| {
                let o = st.objects.get(&k)?.get(&(ns, name))?.clone();
                Some((k, o))
            })
            .collect();
        for (key, old) in hits {
            let mut new = (*old).clone();
            if let Some(Value::Array(refs)) = new.pointer_mut("/metadata/ownerReferences") {
                refs.retain(|r| r["uid"].as_str() != Some(owner_uid));
            }
            self.record(st, key, new, EventType::Modified, Some(old));
        }
    }

    /// Removes a terminating namespace once nothing is left in it.
    fn finish_namespace(&self, st: &mut State, ns: &str) {
        let Some(nsrt) = st.registry.get("", "v1", "namespaces") else {
            return;
        };
        let Some(n) = st.get(&nsrt, "", ns) else {
            return;
        };
        if n.pointer("/metadata/deletionTimestamp").is_none() || !finalizers(&n).is_empty() {
            return;
        }
        let empty = st
            .objects
            .iter()
            .filter(|(k, _)| k.as_str() != nsrt.store_key())
            .all(|(_, b)| b.keys().all(|(ons, _)| ons != ns));
        if empty {
            self.remove(st, &nsrt, "", ns, None);
        }
    }

    /// Deletes an object: marks it when finalizers remain, removes it otherwise.
    pub fn delete(
        &self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        opts: &DeleteOpts,
    ) -> Result<Value> {
        let mut st = self.lock();
        self.delete_locked(&mut st, rt, ns, name, opts)
    }

    fn delete_locked(
        &self,
        st: &mut State,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        opts: &DeleteOpts,
    ) -> Result<Value> {
        let old = st
            .get(rt, ns, name)
            .ok_or_else(|| ApiError::not_found(rt.target(), name))?;
        if let Some(u) = &opts.uid
            && u != meta::uid(&old)
        {
            return Err(ApiError::conflict(
                rt.target(),
                name,
                &format!(
                    "Precondition failed: UID in precondition: {u}, UID in object meta: {}",
                    meta::uid(&old)
                ),
            ));
        }
        if let Some(r) = &opts.resource_version
            && r != rv_of(&old)
        {
            return Err(ApiError::conflict(
                rt.target(),
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {r}, ResourceVersion in object meta: {}",
                    rv_of(&old)
                ),
            ));
        }
        if opts.dry_run {
            return Ok(Self::out(rt, &old));
        }
        let ns_kind = is_namespace(rt);
        if finalizers(&old).is_empty() && !ns_kind {
            let gone = self.remove_with(st, rt, ns, name, None, opts.orphan);
            return Ok(Self::out(rt, &gone));
        }
        if old.pointer("/metadata/deletionTimestamp").is_some() {
            return Ok(Self::out(rt, &old));
        }
        let mut new = (*old).clone();
        let m = md(&mut new);
        m.insert(
            "deletionTimestamp".into(),
            json!(meta::rfc3339(meta::now_secs())),
        );
        m.insert("deletionGracePeriodSeconds".into(), json!(0));
        if ns_kind {
            new["status"]["phase"] = json!("Terminating");
        }
        let new = self.record(
            st,
            rt.store_key(),
            new,
            EventType::Modified,
            Some(old.clone()),
        );
        if ns_kind {
            let victims: Vec<(Arc<ResourceType>, String)> = {
                let mut v = Vec::new();
                for (key, bucket) in &st.objects {
                    let Some((g, p)) = key.split_once('/') else {
                        continue;
                    };
                    let Some(t) = st.registry.storage_of(g, p) else {
                        continue;
                    };
                    if !t.namespaced {
                        continue;
                    }
                    for (ons, oname) in bucket.keys() {
                        if ons == name {
                            v.push((t.clone(), oname.clone()));
                        }
                    }
                }
                v
            };
            for (t, oname) in victims {
                let _ = self.delete_locked(st, &t, name, &oname, &DeleteOpts::default());
            }
            self.finish_namespace(st, name);
            if st.get(rt, "", name).is_none() {
                let mut gone = (*new).clone();
                md(&mut gone).insert("resourceVersion".into(), json!(st.rv.to_string()));
                return Ok(Self::out(rt, &gone));
            }
        }
        Ok(Self::out(rt, &new))
    }

    /// Deletes every object that matches the selectors (DELETE on a collection).
    pub fn delete_collection(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        sel: &Selectors,
        opts: &DeleteOpts,
    ) -> Result<Vec<Value>> {
        let (items, _, _) = self.list(rt, ns, sel, None, None)?;
        let mut st = self.lock();
        let mut out = Vec::new();
        for o in items {
            if let Ok(v) =
                self.delete_locked(&mut st, rt, meta::namespace(&o), meta::name(&o), opts)
            {
                out.push(v);
            }
        }
        Ok(out)
    }

    /// Starts a watch: the backlog to send and the live feed, or 410 when `rv` is too old.
    pub fn watch(&self, rt: &ResourceType, rv: Option<u64>, initial: bool) -> Result<WatchStart> {
        let st = self.lock();
        let live = self.events.subscribe();
        let key = rt.store_key();
        let synthetic = |st: &State| -> Vec<Arc<Event>> {
            st.objects
                .get(&key)
                .map(|b| {
                    b.values()
                        .map(|o| {
                            Arc::new(Event {
                                rv: rv_of(o).parse().unwrap_or(0),
                                key: key.clone(),
                                kind: EventType::Added,
                                object: o.clone(),
                                old: None,
                            })
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        let backlog = match rv {
            None | Some(0) => synthetic(&st),
            Some(_) if initial => synthetic(&st),
            Some(r) => {
                if r < st.compacted {
                    return Err(ApiError::gone(format!(
                        "too old resource version: {r} ({})",
                        st.compacted + 1
                    )));
                }
                st.history
                    .iter()
                    .filter(|e| e.rv > r && e.key == key)
                    .cloned()
                    .collect()
            }
        };
        Ok(WatchStart {
            backlog,
            live,
            rv: st.rv,
        })
    }

    /// Whether any object has this uid, for tests that check garbage collection.
    pub fn exists_uid(&self, uid: &str) -> bool {
        self.lock().uids.contains_key(uid)
    }
}
