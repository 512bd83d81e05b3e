//! The `/openapi/v2` document as the gnostic `openapi.v2.Document` protobuf, which is what
//! kubectl asks for (`Accept: application/com.github.proto-openapi.spec.v2@v1.0+protobuf`) and
//! unmarshals.
//!
//! This is a tiny hand-written protobuf encoder rather than prost messages: the server only ever
//! writes, the subset of `OpenAPIv2.proto` it needs (Document, Info, Paths, PathItem, Operation,
//! Responses, Definitions, Schema and their named pairs) walks a JSON document it already has,
//! and it costs no dependency. Field numbers are those of gnostic's `openapiv2/OpenAPIv2.proto`.
//! Values that OpenAPI leaves free (`default`, `enum`, `example`, vendor extensions) travel as
//! gnostic's `Any` with their YAML text, as the real server writes them.

use serde_json::{Map, Value};

/// Why a document could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// A free value (default, enum, example, extension) could not be written as YAML.
    #[error("Writing {field} as YAML")]
    Yaml {
        /// The field, e.g. `x-kubernetes-group-version-kind`.
        field: String,
        /// The cause.
        #[source]
        source: serde_yaml_ng::Error,
    },
}

type Result<T, E = ProtoError> = std::result::Result<T, E>;

/// Protobuf wire types used here.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;

/// A protobuf message being written.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u64, wire: u64) {
        self.varint((field << 3) | wire);
    }

    fn bytes(&mut self, field: u64, b: &[u8]) {
        self.key(field, LEN);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    /// A string field; proto3 leaves an empty one out.
    fn string(&mut self, field: u64, s: &str) {
        if !s.is_empty() {
            self.bytes(field, s.as_bytes());
        }
    }

    /// An embedded message, written even when empty (its presence means something).
    fn message(&mut self, field: u64, m: Msg) {
        self.bytes(field, &m.0);
    }

    fn boolean(&mut self, field: u64, b: bool) {
        if b {
            self.key(field, VARINT);
            self.varint(1);
        }
    }

    fn int64(&mut self, field: u64, i: i64) {
        if i != 0 {
            self.key(field, VARINT);
            self.varint(i as u64);
        }
    }

    fn double(&mut self, field: u64, f: f64) {
        if f != 0.0 {
            self.key(field, FIXED64);
            self.0.extend_from_slice(&f.to_le_bytes());
        }
    }

    fn strings(&mut self, field: u64, v: Option<&Value>) {
        for s in v.and_then(Value::as_array).into_iter().flatten() {
            if let Some(s) = s.as_str() {
                self.bytes(field, s.as_bytes());
            }
        }
    }
}

/// gnostic `Any { string yaml = 2; }` holding `v` as YAML text.
fn any(name: &str, v: &Value) -> Result<Msg> {
    let yaml = serde_yaml_ng::to_string(v).map_err(|source| ProtoError::Yaml {
        field: name.to_string(),
        source,
    })?;
    let mut m = Msg::default();
    m.string(2, &yaml);
    Ok(m)
}

/// `repeated NamedAny vendor_extension = FIELD` from the `x-` keys of `o`.
fn vendor_extensions(m: &mut Msg, field: u64, o: &Map<String, Value>) -> Result<()> {
    for (k, v) in o.iter().filter(|(k, _)| k.starts_with("x-")) {
        let mut named = Msg::default();
        named.string(1, k);
        named.message(2, any(k, v)?);
        m.message(field, named);
    }
    Ok(())
}

fn str_of<'a>(o: &'a Map<String, Value>, k: &str) -> &'a str {
    o.get(k).and_then(Value::as_str).unwrap_or("")
}

fn f64_of(o: &Map<String, Value>, k: &str) -> f64 {
    o.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

fn i64_of(o: &Map<String, Value>, k: &str) -> i64 {
    o.get(k).and_then(Value::as_i64).unwrap_or(0)
}

fn bool_of(o: &Map<String, Value>, k: &str) -> bool {
    o.get(k).and_then(Value::as_bool).unwrap_or(false)
}

/// gnostic `Schema` from a JSON schema object.
pub fn schema(s: &Value) -> Result<Vec<u8>> {
    Ok(schema_msg(s)?.0)
}

fn schema_msg(s: &Value) -> Result<Msg> {
    let mut m = Msg::default();
    let Some(o) = s.as_object() else {
        return Ok(m);
    };
    m.string(1, str_of(o, "$ref"));
    m.string(2, str_of(o, "format"));
    m.string(3, str_of(o, "title"));
    m.string(4, str_of(o, "description"));
    if let Some(d) = o.get("default") {
        m.message(5, any("default", d)?);
    }
    m.double(6, f64_of(o, "multipleOf"));
    m.double(7, f64_of(o, "maximum"));
    m.boolean(8, bool_of(o, "exclusiveMaximum"));
    m.double(9, f64_of(o, "minimum"));
    m.boolean(10, bool_of(o, "exclusiveMinimum"));
    m.int64(11, i64_of(o, "maxLength"));
    m.int64(12, i64_of(o, "minLength"));
    m.string(13, str_of(o, "pattern"));
    m.int64(14, i64_of(o, "maxItems"));
    m.int64(15, i64_of(o, "minItems"));
    m.boolean(16, bool_of(o, "uniqueItems"));
    m.int64(17, i64_of(o, "maxProperties"));
    m.int64(18, i64_of(o, "minProperties"));
    m.strings(19, o.get("required"));
    for e in o
        .get("enum")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        m.message(20, any("enum", e)?);
    }
    match o.get("additionalProperties") {
        Some(Value::Bool(b)) => {
            let mut ap = Msg::default();
            ap.key(2, VARINT);
            ap.varint(u64::from(*b));
            m.message(21, ap);
        }
        Some(ap @ Value::Object(_)) => {
            let mut item = Msg::default();
            item.message(1, schema_msg(ap)?);
            m.message(21, item);
        }
        _ => {}
    }
    match o.get("type") {
        Some(Value::String(t)) => {
            let mut ti = Msg::default();
            ti.string(1, t);
            m.message(22, ti);
        }
        Some(ts @ Value::Array(_)) => {
            let mut ti = Msg::default();
            ti.strings(1, Some(ts));
            m.message(22, ti);
        }
        _ => {}
    }
    match o.get("items") {
        Some(i @ Value::Object(_)) => {
            let mut items = Msg::default();
            items.message(1, schema_msg(i)?);
            m.message(23, items);
        }
        Some(Value::Array(a)) => {
            let mut items = Msg::default();
            for i in a {
                items.message(1, schema_msg(i)?);
            }
            m.message(23, items);
        }
        _ => {}
    }
    for a in o
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        m.message(24, schema_msg(a)?);
    }
    if let Some(Value::Object(props)) = o.get("properties") {
        let mut p = Msg::default();
        for (name, s) in props {
            p.message(1, named(name, schema_msg(s)?));
        }
        m.message(25, p);
    }
    m.string(26, str_of(o, "discriminator"));
    m.boolean(27, bool_of(o, "readOnly"));
    if let Some(e) = o.get("example") {
        m.message(30, any("example", e)?);
    }
    vendor_extensions(&mut m, 31, o)?;
    Ok(m)
}

/// A gnostic `Named…` pair: `string name = 1; … value = 2;`.
fn named(name: &str, value: Msg) -> Msg {
    let mut n = Msg::default();
    n.string(1, name);
    n.message(2, value);
    n
}

/// gnostic `Operation`: tags, description, operationId, consumes/produces, responses, extensions.
fn operation(op: &Value) -> Result<Msg> {
    let mut m = Msg::default();
    let Some(o) = op.as_object() else {
        return Ok(m);
    };
    m.strings(1, o.get("tags"));
    m.string(2, str_of(o, "summary"));
    m.string(3, str_of(o, "description"));
    m.string(5, str_of(o, "operationId"));
    m.strings(6, o.get("produces"));
    m.strings(7, o.get("consumes"));
    if let Some(Value::Object(rs)) = o.get("responses") {
        let mut responses = Msg::default();
        for (code, r) in rs {
            let mut resp = Msg::default();
            resp.string(1, r["description"].as_str().unwrap_or(""));
            if let Some(s) = r.get("schema") {
                let mut item = Msg::default();
                item.message(1, schema_msg(s)?);
                resp.message(2, item);
            }
            let mut value = Msg::default();
            value.message(1, resp);
            responses.message(1, named(code, value));
        }
        m.message(9, responses);
    }
    vendor_extensions(&mut m, 13, o)?;
    Ok(m)
}

/// gnostic `PathItem`: its operations by method.
fn path_item(item: &Value) -> Result<Msg> {
    let mut m = Msg::default();
    for (field, method) in [
        (2, "get"),
        (3, "put"),
        (4, "post"),
        (5, "delete"),
        (6, "options"),
        (7, "head"),
        (8, "patch"),
    ] {
        if let Some(op) = item.get(method) {
            m.message(field, operation(op)?);
        }
    }
    if let Some(o) = item.as_object() {
        vendor_extensions(&mut m, 10, o)?;
    }
    Ok(m)
}

/// Encodes a Swagger 2.0 JSON document (swagger, info, paths, definitions) as gnostic's
/// `openapi.v2.Document`.
pub fn document(doc: &Value) -> Result<Vec<u8>> {
    let mut m = Msg::default();
    m.string(1, doc["swagger"].as_str().unwrap_or("2.0"));
    if let Some(info) = doc.get("info") {
        let mut i = Msg::default();
        i.string(1, info["title"].as_str().unwrap_or(""));
        i.string(2, info["version"].as_str().unwrap_or(""));
        m.message(2, i);
    }
    if let Some(Value::Object(paths)) = doc.get("paths") {
        let mut p = Msg::default();
        for (path, item) in paths {
            p.message(2, named(path, path_item(item)?));
        }
        m.message(8, p);
    }
    if let Some(Value::Object(defs)) = doc.get("definitions") {
        let mut d = Msg::default();
        for (name, s) in defs {
            d.message(1, named(name, schema_msg(s)?));
        }
        m.message(9, d);
    }
    Ok(m.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn varints_and_keys_follow_the_wire_format() {
        let mut m = Msg::default();
        m.varint(300);
        assert_eq!(m.0, [0xac, 0x02]);
        let mut m = Msg::default();
        m.int64(11, -1);
        assert_eq!(
            m.0.len(),
            11,
            "a negative int64 takes ten bytes after its key"
        );
        assert_eq!(m.0[0], 11 << 3);
    }

    #[test]
    fn a_schema_encodes_with_gnostic_field_numbers() {
        let s = json!({"type": "string", "description": "d", "minLength": 1});
        assert_eq!(
            schema(&s).unwrap_or_default(),
            vec![
                0x22, 1, b'd', // description = 4
                0x60, 1, // min_length = 12
                0xb2, 0x01, 8, 0x0a, 6, b's', b't', b'r', b'i', b'n', b'g', // type = 22
            ]
        );
    }

    #[test]
    fn nested_properties_items_and_extensions() {
        let s = json!({"properties": {"a": {"items": {}}}, "x-k": [1]});
        let b = schema(&s).unwrap_or_default();
        // properties = 25 { additional_properties = 1 { name = 1 "a", value = 2 { items = 23 { schema = 1 {} } } } }
        let props = [
            0xca, 0x01, 12, 0x0a, 10, 0x0a, 1, b'a', 0x12, 5, 0xba, 0x01, 2, 0x0a, 0,
        ];
        assert_eq!(&b[..props.len()], &props);
        // vendor_extension = 31 { name = 1 "x-k", value = 2 { yaml = 2 "- 1\n" } }
        let ext = [
            0xfa, 0x01, 13, 0x0a, 3, b'x', b'-', b'k', 0x12, 6, 0x12, 4, b'-', b' ', b'1', b'\n',
        ];
        assert_eq!(&b[props.len()..], &ext);
    }

    #[test]
    fn a_document_holds_info_paths_and_definitions() {
        let doc = json!({"swagger": "2.0", "info": {"title": "K", "version": "1"},
            "paths": {"/p": {"get": {"operationId": "g"}}},
            "definitions": {"D": {"type": "object"}}});
        let b = document(&doc).unwrap_or_default();
        let mut want = vec![0x0a, 3, b'2', b'.', b'0']; // swagger = 1
        want.extend([0x12, 6, 0x0a, 1, b'K', 0x12, 1, b'1']); // info = 2 { title, version }
        // paths = 8 { path = 2 { name "/p", value { get = 2 { operation_id = 5 "g" } } } }
        want.extend([
            0x42, 13, 0x12, 11, 0x0a, 2, b'/', b'p', 0x12, 5, 0x12, 3, 0x2a, 1, b'g',
        ]);
        // definitions = 9 { additional_properties = 1 { name "D", value { type = 22 { "object" } } } }
        want.extend([
            0x4a, 18, 0x0a, 16, 0x0a, 1, b'D', 0x12, 11, 0xb2, 0x01, 8, 0x0a, 6,
        ]);
        want.extend(b"object");
        assert_eq!(b, want);
    }
}
