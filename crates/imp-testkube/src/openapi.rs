//! OpenAPI documents for kubectl: `/openapi/v2` (JSON or gnostic protobuf) and `/openapi/v3`
//! with one document per group version, as the real API server publishes them.
//!
//! kubectl needs them to validate manifests on the client (`kubectl apply|create|replace` without
//! `--validate=false`) and for `kubectl explain`. They are built from what the server serves:
//! the built-in kinds take their schemas from k8s-openapi's `schemars` implementations (so the
//! definition names are the real ones, `io.k8s.api.core.v1.ConfigMap`), and every served CRD
//! version contributes its structural schema under the real server's name for it
//! (`dev.imp.v1alpha1.ImpVM` for `imp.dev/v1alpha1` `ImpVM`), so a CRD created at run time shows up
//! in the next request. Each kind's definition carries `x-kubernetes-group-version-kind`, which is
//! how kubectl finds it.
//!
//! The v2 definitions are made safe for kubectl's parser as the real server does for CRDs
//! (`nullable` and `x-kubernetes-preserve-unknown-fields` drop the properties they would check,
//! an array without items loses its type). No operation advertises the `fieldValidation`
//! parameter, so kubectl validates on the client, with its usual messages.

pub mod proto;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use k8s_openapi::api::authentication::v1::TokenReview;
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Node, Pod, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event as EventsV1Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use schemars::{JsonSchema, SchemaGenerator, generate::SchemaSettings};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::resource::{Registry, ResourceType};

/// The extension through which kubectl maps a group/version/kind to its definition.
pub const GVK_EXTENSION: &str = "x-kubernetes-group-version-kind";
/// Content type of the protobuf `/openapi/v2` answer. kubectl asks for
/// `…spec.v2@v1.0+protobuf`, but `@` is not a MIME token character and client-go's
/// `mime.ParseMediaType` of the answer would fail, so the real server answers with this dotted
/// form (kube-openapi's `subTypeProtobuf`).
pub const V2_PROTOBUF: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";
/// Where v2 definitions live; v3 documents use `#/components/schemas/`.
const V2_REF: &str = "#/definitions/";
const V3_REF: &str = "#/components/schemas/";
/// The definition every kind's `metadata` refers to.
const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";
const API_VERSION_DOC: &str = "APIVersion defines the versioned schema of this representation of an object. Servers should convert recognized schemas to the latest internal value, and may reject unrecognized values.";
const KIND_DOC: &str = "Kind is a string value representing the REST resource this object represents. Servers may infer this from the endpoint the client submits requests to. In CamelCase.";
const METADATA_DOC: &str = "Standard object's metadata.";

/// Built-in definitions (k8s-openapi's schemas) and the definition name of each built-in kind.
struct Builtins {
    definitions: Map<String, Value>,
    safe: Map<String, Value>,
    kinds: BTreeMap<(String, String), String>,
}

fn add<T: JsonSchema>(
    generator: &mut SchemaGenerator,
    kinds: &mut BTreeMap<(String, String), String>,
    group: &str,
    kind: &str,
) {
    generator.subschema_for::<T>();
    kinds.insert((group.into(), kind.into()), T::schema_name().into_owned());
}

fn builtins() -> &'static Builtins {
    static BUILTINS: OnceLock<Builtins> = OnceLock::new();
    BUILTINS.get_or_init(|| {
        let mut settings = SchemaSettings::draft07();
        settings.transforms.clear();
        let mut generator = settings.into_generator();
        let mut kinds = BTreeMap::new();
        let k = &mut kinds;
        let g = &mut generator;
        add::<Namespace>(g, k, "", "Namespace");
        add::<Node>(g, k, "", "Node");
        add::<Pod>(g, k, "", "Pod");
        add::<ConfigMap>(g, k, "", "ConfigMap");
        add::<Secret>(g, k, "", "Secret");
        add::<Event>(g, k, "", "Event");
        add::<ServiceAccount>(g, k, "", "ServiceAccount");
        add::<EventsV1Event>(g, k, "events.k8s.io", "Event");
        add::<Lease>(g, k, "coordination.k8s.io", "Lease");
        add::<CustomResourceDefinition>(g, k, "apiextensions.k8s.io", "CustomResourceDefinition");
        add::<TokenReview>(g, k, "authentication.k8s.io", "TokenReview");
        add::<SubjectAccessReview>(g, k, "authorization.k8s.io", "SubjectAccessReview");
        let mut definitions = generator.take_definitions(false);
        for name in kinds.values() {
            if let Some(Value::Array(required)) = definitions
                .get_mut(name)
                .and_then(|d| d.get_mut("required"))
            {
                // k8s-openapi requires metadata because it is not an Option; the API does not.
                required.retain(|r| r != "metadata");
            }
        }
        // apiextensions' JSON holds any value (a default of 1, an enum of strings), not an object.
        if let Some(Value::Object(json)) =
            definitions.get_mut("io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.JSON")
        {
            json.remove("type");
        }
        let mut safe = definitions.clone();
        safe.values_mut().for_each(kubectl_safe);
        Builtins {
            definitions,
            safe,
            kinds,
        }
    })
}

/// The definition name the real server gives a kind: `io.k8s.api.core.v1.Pod` for built-ins,
/// the reversed group, version and kind for custom resources (`dev.imp.v1alpha1.ImpVM`).
pub fn definition_name(group: &str, version: &str, kind: &str) -> String {
    if let Some(name) = builtins().kinds.get(&(group.to_string(), kind.to_string())) {
        return name.clone();
    }
    let mut parts: Vec<&str> = group.split('.').filter(|p| !p.is_empty()).collect();
    parts.reverse();
    parts.push(version);
    parts.push(kind);
    parts.join(".")
}

fn gvk(rt: &ResourceType) -> Value {
    json!({"group": rt.group, "version": rt.version, "kind": rt.kind})
}

/// Makes a schema parseable by kubectl's OpenAPI v2 reader, as the real server's CRD publisher
/// does: no `allOf`/`anyOf`/`oneOf`/`not`, a nullable value untyped, properties under
/// `x-kubernetes-preserve-unknown-fields` dropped, an array without items untyped.
pub fn kubectl_safe(schema: &mut Value) {
    let Value::Object(s) = schema else {
        return;
    };
    for k in ["allOf", "anyOf", "oneOf", "not"] {
        s.remove(k);
    }
    if s.remove("nullable").and_then(|v| v.as_bool()) == Some(true) {
        s.remove("type");
        s.remove("items");
        s.remove("properties");
    }
    if s.get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true)
    {
        s.remove("properties");
    }
    let typ = s.get("type").cloned();
    match typ.as_ref().and_then(Value::as_str) {
        Some("array") => {
            if let Some(Value::Array(tuple)) = s.get("items") {
                // A tuple cannot be said in OpenAPI v2; the first schema stands for all.
                let first = tuple.first().cloned();
                match first {
                    Some(f) => {
                        s.insert("items".into(), f);
                    }
                    None => {
                        s.remove("items");
                    }
                }
            }
            if !s.get("items").is_some_and(Value::is_object) {
                s.remove("type");
                s.remove("items");
            }
        }
        Some("object" | "string" | "integer" | "number" | "boolean") | None => {}
        Some(_) => {
            s.remove("type");
        }
    }
    if typ.as_ref().is_some_and(|t| !t.is_string()) {
        s.remove("type");
    }
    if let Some(Value::Object(props)) = s.get_mut("properties") {
        props.values_mut().for_each(kubectl_safe);
    }
    if let Some(items) = s.get_mut("items") {
        kubectl_safe(items);
    }
    match s.get_mut("additionalProperties") {
        Some(Value::Object(_)) => {
            if let Some(ap) = s.get_mut("additionalProperties") {
                kubectl_safe(ap);
            }
        }
        Some(Value::Bool(_)) => {
            s.remove("additionalProperties");
        }
        _ => {}
    }
}

/// A custom resource version's definition: its schema with `apiVersion`, `kind` and a
/// `metadata` that refers to ObjectMeta, as the real server publishes it. `v2` makes it safe
/// for kubectl's v2 reader; `ref_prefix` is where definitions live in the document.
pub fn crd_definition(rt: &ResourceType, v2: bool, ref_prefix: &str) -> Value {
    let mut s =
        rt.schema.as_deref().cloned().unwrap_or_else(
            || json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
        );
    if v2 {
        kubectl_safe(&mut s);
    }
    let Value::Object(obj) = &mut s else {
        return s;
    };
    let preserves = obj
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true);
    if !preserves {
        let meta_ref = format!("{ref_prefix}{OBJECT_META}");
        let metadata = if v2 {
            json!({"$ref": meta_ref, "description": METADATA_DOC})
        } else {
            json!({"allOf": [{"$ref": meta_ref}], "description": METADATA_DOC})
        };
        let props = obj
            .entry("properties")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(props) = props {
            props.insert(
                "apiVersion".into(),
                json!({"type": "string", "description": API_VERSION_DOC}),
            );
            props.insert(
                "kind".into(),
                json!({"type": "string", "description": KIND_DOC}),
            );
            props.insert("metadata".into(), metadata);
        }
        obj.insert("type".into(), json!("object"));
    }
    obj.insert(GVK_EXTENSION.into(), json!([gvk(rt)]));
    s
}

/// Every definition for what `reg` serves, in v2 form (refs under `#/definitions/`).
pub fn definitions(reg: &Registry) -> Map<String, Value> {
    let b = builtins();
    let mut defs = b.safe.clone();
    // The group/version/kinds each built-in definition stands for (core and events.k8s.io
    // Events are two definitions; a kind can be served in several versions).
    let mut gvks: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for rt in reg.all() {
        let name = definition_name(&rt.group, &rt.version, &rt.kind);
        if rt.schema.is_some() {
            defs.insert(name, crd_definition(rt, true, V2_REF));
        } else if defs.contains_key(&name) {
            gvks.entry(name).or_default().push(gvk(rt));
        }
    }
    for (name, list) in gvks {
        if let Some(Value::Object(d)) = defs.get_mut(&name) {
            d.insert(GVK_EXTENSION.into(), Value::Array(list));
        }
    }
    defs
}

/// The URL path of a type's collection, with `{namespace}` for namespaced ones.
fn collection_path(rt: &ResourceType) -> String {
    let base = if rt.group.is_empty() {
        format!("/api/{}", rt.version)
    } else {
        format!("/apis/{}/{}", rt.group, rt.version)
    };
    if rt.namespaced {
        format!("{base}/namespaces/{{namespace}}/{}", rt.plural)
    } else {
        format!("{base}/{}", rt.plural)
    }
}

/// One operation: an id, the kind's gvk and a 200 answer of the kind (v2 or v3 shape).
fn operation(rt: &ResourceType, verb: &str, action: &str, def_ref: &str, v3: bool) -> Value {
    let schema = json!({"$ref": def_ref});
    let ok = if v3 {
        json!({"description": "OK", "content": {"application/json": {"schema": schema}}})
    } else {
        json!({"description": "OK", "schema": schema})
    };
    let tag = if rt.group.is_empty() {
        format!("core_{}", rt.version)
    } else {
        format!("{}_{}", rt.group, rt.version)
    };
    json!({
        "description": format!("{verb} {}", rt.kind),
        "operationId": format!("{verb}{}{}", rt.plural, rt.version),
        "tags": [tag],
        "responses": {"200": ok},
        "x-kubernetes-action": action,
        GVK_EXTENSION: gvk(rt),
    })
}

/// Paths for the types `reg` serves that `keep` selects. Operations carry the kind's gvk but no
/// `fieldValidation` parameter: this server does not do server-side field validation.
fn paths(reg: &Registry, keep: impl Fn(&ResourceType) -> bool, v3: bool) -> Map<String, Value> {
    let prefix = if v3 { V3_REF } else { V2_REF };
    let mut out = Map::new();
    for rt in reg.all().filter(|t| keep(t)) {
        let def_ref = format!(
            "{prefix}{}",
            definition_name(&rt.group, &rt.version, &rt.kind)
        );
        let op = |verb: &str, action: &str| operation(rt, verb, action, &def_ref, v3);
        let collection = collection_path(rt);
        if rt.create_only {
            out.insert(collection, json!({"post": op("create", "post")}));
            continue;
        }
        out.insert(
            collection.clone(),
            json!({"get": op("list", "list"), "post": op("create", "post")}),
        );
        out.insert(
            format!("{collection}/{{name}}"),
            json!({"get": op("read", "get"), "put": op("replace", "put"),
                "patch": op("patch", "patch"), "delete": op("delete", "delete")}),
        );
    }
    out
}

/// `/openapi/v2`: the Swagger 2.0 document of everything `reg` serves.
pub fn v2(reg: &Registry) -> Value {
    json!({
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": crate::discovery::GIT_VERSION},
        "paths": paths(reg, |_| true, false),
        "definitions": definitions(reg),
    })
}

/// The group versions `reg` serves, as `/openapi/v3` names them (`api/v1`, `apis/GROUP/VERSION`).
fn group_versions(reg: &Registry) -> BTreeSet<(String, String)> {
    reg.all()
        .map(|t| (t.group.clone(), t.version.clone()))
        .collect()
}

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// Rewrites every `$ref` from `from` to `to`, collecting the definitions referred to.
fn rewrite_refs(v: &mut Value, from: &str, to: &str, seen: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get_mut("$ref")
                && let Some(name) = r.strip_prefix(from)
            {
                seen.push(name.to_string());
                *r = format!("{to}{name}");
            }
            m.values_mut().for_each(|x| rewrite_refs(x, from, to, seen));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rewrite_refs(x, from, to, seen)),
        _ => {}
    }
}

/// `/openapi/v3/apis/GROUP/VERSION` (or `api/v1`): an OpenAPI 3.0 document with the paths of
/// that group version and the schemas they need, or None when it is not served.
pub fn v3_group_version(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    let types: Vec<_> = reg
        .all()
        .filter(|t| t.group == group && t.version == version)
        .collect();
    if types.is_empty() {
        return None;
    }
    let b = builtins();
    let mut schemas = Map::new();
    let mut pending = Vec::new();
    for rt in &types {
        let name = definition_name(&rt.group, &rt.version, &rt.kind);
        let d = if rt.schema.is_some() {
            let mut d = crd_definition(rt, false, V3_REF);
            rewrite_refs(&mut d, V3_REF, V3_REF, &mut pending);
            d
        } else if let Some(d) = b.definitions.get(&name) {
            let mut d = d.clone();
            rewrite_refs(&mut d, V2_REF, V3_REF, &mut pending);
            if let Value::Object(o) = &mut d {
                o.insert(GVK_EXTENSION.into(), json!([gvk(rt)]));
            }
            d
        } else {
            continue;
        };
        schemas.insert(name, d);
    }
    while let Some(name) = pending.pop() {
        if schemas.contains_key(&name) {
            continue;
        }
        if let Some(d) = b.definitions.get(&name) {
            let mut d = d.clone();
            rewrite_refs(&mut d, V2_REF, V3_REF, &mut pending);
            schemas.insert(name, d);
        }
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": crate::discovery::GIT_VERSION},
        "paths": paths(reg, |t| t.group == group && t.version == version, true),
        "components": {"schemas": schemas},
    }))
}

/// `/openapi/v3`: where each group version's document is, with a hash of it so a client's
/// cache notices a change (a CRD's new schema).
pub fn v3_root(reg: &Registry) -> Value {
    let mut paths = Map::new();
    for (g, v) in group_versions(reg) {
        let doc = v3_group_version(reg, &g, &v).unwrap_or(Value::Null);
        let hash = Sha256::digest(doc.to_string().as_bytes());
        let hex: String = hash.iter().take(32).map(|b| format!("{b:02X}")).collect();
        let path = gv_path(&g, &v);
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={hex}")}),
        );
    }
    json!({"paths": paths})
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn widget(schema: Value) -> ResourceType {
        let mut r = crate::resource::builtins()
            .into_iter()
            .find(|t| t.kind == "ConfigMap")
            .unwrap_or_else(|| unreachable!());
        r.group = "test.imp.dev".into();
        r.version = "v1".into();
        r.plural = "widgets".into();
        r.kind = "Widget".into();
        r.schema = Some(Arc::new(schema));
        r
    }

    #[test]
    fn custom_resources_are_named_by_reversed_group() {
        assert_eq!(
            definition_name("imp.dev", "v1alpha1", "ImpVM"),
            "dev.imp.v1alpha1.ImpVM"
        );
        assert_eq!(
            definition_name("", "v1", "ConfigMap"),
            "io.k8s.api.core.v1.ConfigMap"
        );
        assert_eq!(
            definition_name("events.k8s.io", "v1", "Event"),
            "io.k8s.api.events.v1.Event"
        );
    }

    #[test]
    fn kubectl_safe_drops_what_kubectl_cannot_read() {
        let mut s = json!({"type": "object", "properties": {
            "keep": {"type": "object", "x-kubernetes-preserve-unknown-fields": true,
                "properties": {"a": {"type": "string"}}},
            "n": {"type": "string", "nullable": true},
            "arr": {"type": "array"},
            "multi": {"type": ["string", "null"]},
            "one": {"oneOf": [{"type": "string"}], "type": "string"},
            "map": {"type": "object", "additionalProperties": {"type": "array"}},
            "open": {"type": "object", "additionalProperties": true},
        }});
        kubectl_safe(&mut s);
        assert_eq!(
            s,
            json!({"type": "object", "properties": {
                "keep": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                "n": {},
                "arr": {},
                "multi": {},
                "one": {"type": "string"},
                "map": {"type": "object", "additionalProperties": {}},
                "open": {"type": "object"},
            }})
        );
    }

    #[test]
    fn crd_definition_adds_type_meta_and_gvk() {
        let rt = widget(json!({"type": "object", "properties": {"spec": {"type": "object"}}}));
        let d = crd_definition(&rt, true, V2_REF);
        assert_eq!(
            d["properties"]["metadata"]["$ref"],
            "#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
        );
        assert_eq!(d["properties"]["kind"]["type"], "string");
        assert_eq!(
            d[GVK_EXTENSION],
            json!([{"group": "test.imp.dev", "version": "v1", "kind": "Widget"}])
        );
        let open = widget(json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}));
        assert!(
            crd_definition(&open, true, V2_REF)
                .get("properties")
                .is_none(),
            "a schemaless CRD accepts any field"
        );
    }

    #[test]
    fn v2_has_builtins_and_served_crds_with_gvk() {
        let mut reg = Registry::with_builtins();
        let doc = v2(&reg);
        let defs = &doc["definitions"];
        assert_eq!(
            defs["io.k8s.api.core.v1.ConfigMap"][GVK_EXTENSION],
            json!([{"group": "", "version": "v1", "kind": "ConfigMap"}])
        );
        assert!(
            defs["io.k8s.api.core.v1.ConfigMap"]["required"].is_null()
                || !defs["io.k8s.api.core.v1.ConfigMap"]["required"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|x| x == "metadata"))
        );
        assert!(defs[OBJECT_META]["properties"]["labels"].is_object());
        assert!(defs.get("dev.imp.test.v1.Widget").is_none());
        assert!(
            doc["paths"]["/api/v1/namespaces/{namespace}/configmaps/{name}"]["patch"].is_object()
        );
        reg.insert(widget(json!({"type": "object"})));
        let doc = v2(&reg);
        assert!(doc["definitions"]["dev.imp.test.v1.Widget"].is_object());
        assert!(doc["paths"]["/apis/test.imp.dev/v1/namespaces/{namespace}/widgets"].is_object());
    }

    /// kubectl's v2 reader refuses the whole document when one schema is an array without
    /// items, has several types or an unknown primitive type.
    fn assert_kubectl_parseable(s: &Value, at: &str) {
        let Some(o) = s.as_object() else {
            return;
        };
        match o.get("type") {
            None => {}
            Some(Value::String(t)) => {
                assert!(
                    ["object", "array", "string", "integer", "number", "boolean"]
                        .contains(&t.as_str()),
                    "{at}: type {t}"
                );
                if t == "array" {
                    assert!(o.get("items").is_some_and(Value::is_object), "{at}: items");
                }
            }
            Some(t) => panic!("{at}: type {t}"),
        }
        for (k, v) in o
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            assert_kubectl_parseable(v, &format!("{at}.{k}"));
        }
        if let Some(i) = o.get("items") {
            assert_kubectl_parseable(i, &format!("{at}[]"));
        }
        if let Some(a) = o.get("additionalProperties") {
            assert!(a.is_object(), "{at}: additionalProperties {a}");
            assert_kubectl_parseable(a, &format!("{at}{{}}"));
        }
    }

    #[test]
    fn every_v2_definition_is_parseable_and_every_ref_resolves() {
        let doc = v2(&Registry::with_builtins());
        let defs = doc["definitions"]
            .as_object()
            .unwrap_or_else(|| unreachable!());
        for (name, d) in defs {
            assert_kubectl_parseable(d, name);
        }
        let mut refs = Vec::new();
        let mut copy = doc.clone();
        rewrite_refs(&mut copy, V2_REF, V2_REF, &mut refs);
        for r in refs {
            assert!(defs.contains_key(&r), "dangling $ref {r}");
        }
    }

    #[test]
    fn the_v2_document_encodes_as_protobuf_with_its_gvks_as_yaml() {
        let b = proto::document(&v2(&Registry::with_builtins())).unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8_lossy(&b);
        assert!(text.contains("io.k8s.api.core.v1.ConfigMap"));
        assert!(
            text.contains("- group: ''\n  kind: ConfigMap\n  version: v1\n"),
            "kubectl reads the gvk extension as YAML"
        );
        assert!(text.contains(GVK_EXTENSION));
    }

    #[test]
    fn v3_documents_are_per_group_version_and_self_contained() {
        let mut reg = Registry::with_builtins();
        reg.insert(widget(json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {"note": {"type": "string", "nullable": true}}}}})));
        let root = v3_root(&reg);
        let url = root["paths"]["apis/test.imp.dev/v1"]["serverRelativeURL"]
            .as_str()
            .unwrap_or_default();
        assert!(
            url.starts_with("/openapi/v3/apis/test.imp.dev/v1?hash="),
            "{url}"
        );
        assert!(root["paths"]["api/v1"].is_object());
        let doc = v3_group_version(&reg, "test.imp.dev", "v1").unwrap_or_default();
        let schemas = &doc["components"]["schemas"];
        let w = &schemas["dev.imp.test.v1.Widget"];
        assert_eq!(
            w["properties"]["spec"]["properties"]["note"]["nullable"], true,
            "v3 keeps nullable"
        );
        assert_eq!(
            w["properties"]["metadata"]["allOf"][0]["$ref"],
            "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
        );
        assert!(
            schemas[OBJECT_META].is_object(),
            "referred schemas come along"
        );
        assert!(schemas.get("io.k8s.api.core.v1.Pod").is_none());
        let core = v3_group_version(&reg, "", "v1").unwrap_or_default();
        assert!(core["components"]["schemas"]["io.k8s.api.core.v1.PodSpec"].is_object());
        assert!(v3_group_version(&reg, "nope.dev", "v1").is_none());
    }
}
