//! The HTTP surface: path routing, query options, content negotiation and Status errors.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::auth::{Auth, Identity};
use crate::discovery;
use crate::error::{ApiError, Result};
use crate::openapi;
use crate::patch::PatchKind;
use crate::resource::ResourceType;
use crate::selector::{FieldSelector, LabelSelector, Selectors};
use crate::store::{DeleteOpts, Part, Store, WriteOpts};
use crate::table;
use crate::watch::{self, WatchParams};

/// Largest request body accepted.
const MAX_BODY: usize = 16 * 1024 * 1024;

/// Shared state of the HTTP handlers.
#[derive(Debug)]
pub struct Server {
    /// The object store.
    pub store: Arc<Store>,
    /// Tokens and rules.
    pub auth: Auth,
    /// How often watches with bookmarks get one.
    pub bookmark_every: Duration,
    /// `host:port` the server listens on, for `/api`.
    pub addr: String,
}

/// Builds the axum router serving everything through one handler.
pub fn router(server: Arc<Server>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(server)
}

fn json_response(code: StatusCode, v: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_vec(v).unwrap_or_default(),
    )
        .into_response()
}

fn error_response(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(code, &e.to_status())
}

async fn handle(State(s): State<Arc<Server>>, req: Request) -> Response {
    match route(&s, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

/// What a request path names.
#[derive(Debug)]
struct Target {
    rt: Arc<ResourceType>,
    namespace: Option<String>,
    name: Option<String>,
    part: Part,
}

fn parse_body(headers: &HeaderMap, bytes: &[u8]) -> Result<Value> {
    if bytes.is_empty() {
        return Ok(Value::Null);
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    if ct.contains("protobuf") {
        return Err(ApiError::unsupported_media_type(ct));
    }
    if ct.contains("yaml") {
        serde_yaml_ng::from_slice::<Value>(bytes)
            .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))
    } else {
        serde_json::from_slice::<Value>(bytes).or_else(|je| {
            serde_yaml_ng::from_slice::<Value>(bytes)
                .map_err(|_| ApiError::bad_request(format!("error decoding JSON: {je}")))
        })
    }
}

fn truthy(q: &HashMap<String, String>, k: &str) -> bool {
    q.get(k).is_some_and(|v| v == "true" || v == "1")
}

fn default_manager(headers: &HeaderMap) -> String {
    headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .and_then(|ua| ua.split('/').next())
        .filter(|s| !s.is_empty())
        .unwrap_or("unknown")
        .to_string()
}

async fn route(s: &Arc<Server>, req: Request) -> Result<Response> {
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let query: HashMap<String, String> = Query::<HashMap<String, String>>::try_from_uri(req.uri())
        .map(|q| q.0)
        .unwrap_or_default();
    let headers = req.headers().clone();
    if std::env::var_os("IMP_TESTKUBE_LOG").is_some() {
        let h = |n: header::HeaderName| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        eprintln!(
            "imp-testkube: {method} {} ct={:?} accept={:?}",
            req.uri(),
            h(header::CONTENT_TYPE),
            h(header::ACCEPT)
        );
    }
    if matches!(path.as_str(), "/healthz" | "/livez" | "/readyz") {
        return Ok((StatusCode::OK, "ok").into_response());
    }
    let auth_header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let identity = s.auth.authenticate(auth_header);
    if identity == Identity::Rejected {
        return Err(ApiError::unauthorized());
    }
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
    let segs: Vec<&str> = path.split('/').filter(|x| !x.is_empty()).collect();
    let reg = || s.store.registry();
    let (group, version, rest): (&str, &str, &[&str]) = match segs.as_slice() {
        ["version"] => return Ok(json_response(StatusCode::OK, &discovery::version())),
        ["openapi", ..] => return openapi_response(&reg(), &method, &headers, &segs[1..]),
        ["api"] => {
            return Ok(json_response(
                StatusCode::OK,
                &discovery::core_versions(&s.addr),
            ));
        }
        ["apis"] => {
            return Ok(json_response(
                StatusCode::OK,
                &discovery::group_list(&reg()),
            ));
        }
        ["apis", g] => {
            return discovery::group(&reg(), g)
                .map(|d| json_response(StatusCode::OK, &d))
                .ok_or_else(|| ApiError::no_route(&path));
        }
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(ApiError::no_route(&path)),
    };
    if rest.is_empty() {
        return discovery::resource_list(&reg(), group, version)
            .map(|d| json_response(StatusCode::OK, &d))
            .ok_or_else(|| ApiError::no_route(&path));
    }
    let store = &s.store;
    let lookup = |plural: &str| store.resource(group, version, plural);
    let (namespace, plural, tail): (Option<String>, &str, &[&str]) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if !matches!(*plural, "status" | "finalize")
                && lookup(plural).is_some_and(|t| t.namespaced) =>
        {
            (Some((*ns).to_string()), plural, tail)
        }
        [plural, tail @ ..] => (None, plural, tail),
        [] => return Err(ApiError::no_route(&path)),
    };
    let rt = lookup(plural).ok_or_else(|| ApiError::no_route(&path))?;
    let (name, part) = match tail {
        [] => (None, Part::Main),
        [n] => (Some((*n).to_string()), Part::Main),
        [n, "status"] if rt.status_subresource => (Some((*n).to_string()), Part::Status),
        _ => return Err(ApiError::no_route(&path)),
    };
    if !rt.namespaced && namespace.is_some() {
        return Err(ApiError::no_route(&path));
    }
    let all_namespaces_ok = method == Method::GET || (method == Method::DELETE && name.is_none());
    if rt.namespaced && namespace.is_none() && (name.is_some() || !all_namespaces_ok) {
        return Err(ApiError::no_route(&path));
    }
    let t = Target {
        rt,
        namespace,
        name,
        part,
    };
    if let Identity::User(user) = &identity
        && s.auth.enforce
    {
        authorize(s, user, &method, &query, &t)?;
    }
    let body = parse_body(&headers, &bytes)?;
    serve(s, &method, &headers, &query, t, body)
}

/// `/openapi/v2` (protobuf when asked for, else JSON), `/openapi/v3` and its group versions.
fn openapi_response(
    reg: &crate::resource::Registry,
    method: &Method,
    headers: &HeaderMap,
    segs: &[&str],
) -> Result<Response> {
    if *method != Method::GET {
        return Err(ApiError::method_not_allowed());
    }
    let not_found = || ApiError::no_route(&format!("/openapi/{}", segs.join("/")));
    match segs {
        ["v2"] => {
            let doc = openapi::v2(reg);
            let accept = headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if !accept.contains("protobuf") {
                return Ok(json_response(StatusCode::OK, &doc));
            }
            let body = openapi::proto::document(&doc)
                .map_err(|e| ApiError::internal(format!("encoding /openapi/v2: {e}")))?;
            Ok((
                StatusCode::OK,
                [(header::CONTENT_TYPE, openapi::V2_PROTOBUF)],
                body,
            )
                .into_response())
        }
        ["v3"] => Ok(json_response(StatusCode::OK, &openapi::v3_root(reg))),
        ["v3", "api", v] => openapi::v3_group_version(reg, "", v)
            .map(|d| json_response(StatusCode::OK, &d))
            .ok_or_else(not_found),
        ["v3", "apis", g, v] => openapi::v3_group_version(reg, g, v)
            .map(|d| json_response(StatusCode::OK, &d))
            .ok_or_else(not_found),
        _ => Err(not_found()),
    }
}

/// Rejects a request the user's rules do not allow, with the real server's 403 message.
fn authorize(
    s: &Server,
    user: &crate::auth::User,
    method: &Method,
    q: &HashMap<String, String>,
    t: &Target,
) -> Result<()> {
    let verb = match (method.clone(), &t.name) {
        (Method::GET, None) if truthy(q, "watch") => "watch",
        (Method::GET, None) => "list",
        (Method::GET, Some(_)) => "get",
        (Method::POST, _) => "create",
        (Method::PUT, _) => "update",
        (Method::PATCH, _) => "patch",
        (Method::DELETE, None) => "deletecollection",
        (Method::DELETE, Some(_)) => "delete",
        _ => "unknown",
    };
    let resource = match t.part {
        Part::Main => t.rt.plural.clone(),
        Part::Status => format!("{}/status", t.rt.plural),
    };
    if s.auth
        .allowed(&user.name, &user.groups, verb, &t.rt.group, &resource)
    {
        return Ok(());
    }
    let what = match &t.name {
        Some(n) => format!("{} \"{n}\"", t.rt.plural),
        None => t.rt.plural.clone(),
    };
    let scope = match &t.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    Err(ApiError {
        code: 403,
        reason: "Forbidden",
        message: format!(
            "{what} is forbidden: User \"{}\" cannot {verb} resource \"{resource}\" in API group \"{}\" {scope}",
            user.name, t.rt.group
        ),
        details: json!({"name": t.name.clone().unwrap_or_default(), "group": t.rt.group, "kind": t.rt.plural}),
    })
}

fn selectors(rt: &ResourceType, q: &HashMap<String, String>) -> Result<Selectors> {
    let mut fields = FieldSelector::parse(
        q.get("fieldSelector").map(String::as_str).unwrap_or(""),
        &rt.field_labels(),
    )?;
    if rt.is_events_v1() {
        fields = fields.renamed(crate::events::core_field_label);
    }
    Ok(Selectors {
        labels: LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))?,
        fields,
    })
}

fn list_doc(rt: &ResourceType, items: Vec<Value>, rv: u64, cont: Option<String>) -> Value {
    let mut md = json!({"resourceVersion": rv.to_string()});
    if let Some(c) = cont {
        md["continue"] = json!(c);
    }
    json!({"kind": format!("{}List", rt.kind), "apiVersion": rt.api_version(), "metadata": md, "items": items})
}

fn serve(
    s: &Arc<Server>,
    method: &Method,
    headers: &HeaderMap,
    q: &HashMap<String, String>,
    t: Target,
    body: Value,
) -> Result<Response> {
    let store = &s.store;
    let rt = &t.rt;
    let ns = t.namespace.clone().unwrap_or_default();
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let as_table = table::wants_table(accept);
    let wopts = WriteOpts {
        field_manager: q
            .get("fieldManager")
            .cloned()
            .unwrap_or_else(|| default_manager(headers)),
        force: truthy(q, "force"),
        dry_run: q.get("dryRun").is_some_and(|v| v == "All"),
    };
    if rt.create_only {
        if *method != Method::POST || t.name.is_some() {
            return Err(ApiError::method_not_allowed());
        }
        let mut review = body;
        review["apiVersion"] = json!(rt.api_version());
        review["kind"] = json!(rt.kind);
        let answered = if rt.kind == "TokenReview" {
            s.auth.token_review(review)
        } else {
            s.auth.access_review(review)
        };
        return Ok(json_response(StatusCode::CREATED, &answered));
    }
    match (method.clone(), &t.name) {
        (Method::GET, name) if name.is_none() || truthy(q, "watch") => {
            let mut sel = selectors(rt, q)?;
            if let Some(n) = name {
                // A watch on one object's path is a watch with a metadata.name selector.
                sel.fields = sel.fields.and_name(n);
            }
            if truthy(q, "watch") {
                let rv = match q.get("resourceVersion").map(String::as_str) {
                    None | Some("") => None,
                    Some(r) => Some(r.parse::<u64>().map_err(|_| {
                        ApiError::bad_request(format!("invalid resourceVersion {r:?}"))
                    })?),
                };
                let p = WatchParams {
                    rv,
                    bookmarks: truthy(q, "allowWatchBookmarks"),
                    initial: truthy(q, "sendInitialEvents"),
                    timeout: q
                        .get("timeoutSeconds")
                        .and_then(|v| v.parse::<u64>().ok())
                        .map(Duration::from_secs),
                    namespace: t.namespace.clone(),
                    selectors: sel,
                    table: as_table,
                };
                let body = watch::open(store, rt.clone(), p, s.bookmark_every);
                return Ok(Response::builder()
                    .status(StatusCode::OK)
                    .header(header::CONTENT_TYPE, "application/json")
                    .header(header::TRANSFER_ENCODING, "chunked")
                    .body(body)
                    .unwrap_or_else(|_| Response::new(Body::empty())));
            }
            let limit = q.get("limit").and_then(|v| v.parse::<usize>().ok());
            let (items, rv, cont) = store.list(
                rt,
                t.namespace.as_deref(),
                &sel,
                limit,
                q.get("continue").map(String::as_str),
            )?;
            if as_table {
                return Ok(json_response(
                    StatusCode::OK,
                    &table::table(rt, &items, rv, cont.as_deref()),
                ));
            }
            Ok(json_response(
                StatusCode::OK,
                &list_doc(rt, items, rv, cont),
            ))
        }
        (Method::GET, Some(name)) => {
            let o = store.get(rt, &ns, name)?;
            if as_table {
                let rv = store.resource_version();
                return Ok(json_response(
                    StatusCode::OK,
                    &table::table(rt, &[o], rv, None),
                ));
            }
            Ok(json_response(StatusCode::OK, &o))
        }
        (Method::POST, None) => {
            if t.part == Part::Status {
                return Err(ApiError::method_not_allowed());
            }
            let o = store.create(rt, &ns, body, &wopts)?;
            Ok(json_response(StatusCode::CREATED, &o))
        }
        (Method::PUT, Some(name)) => {
            let o = store.update(rt, &ns, name, body, t.part, &wopts)?;
            Ok(json_response(StatusCode::OK, &o))
        }
        (Method::PATCH, Some(name)) => {
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let kind = PatchKind::from_content_type(ct)?;
            let mut wopts = wopts;
            if kind == PatchKind::Apply && !q.contains_key("fieldManager") {
                wopts.field_manager.clear();
            }
            let o = store.patch(rt, &ns, name, kind, &body, t.part, &wopts)?;
            Ok(json_response(StatusCode::OK, &o))
        }
        (Method::DELETE, name) => {
            let dopts = DeleteOpts {
                uid: body
                    .pointer("/preconditions/uid")
                    .and_then(Value::as_str)
                    .map(String::from),
                resource_version: body
                    .pointer("/preconditions/resourceVersion")
                    .and_then(Value::as_str)
                    .map(String::from),
                orphan: body["propagationPolicy"].as_str() == Some("Orphan")
                    || body["orphanDependents"].as_bool() == Some(true),
                dry_run: wopts.dry_run
                    || body["dryRun"]
                        .as_array()
                        .is_some_and(|a| a.iter().any(|v| v == "All")),
            };
            match name {
                Some(name) => {
                    let o = store.delete(rt, &ns, name, &dopts)?;
                    Ok(json_response(StatusCode::OK, &o))
                }
                None => {
                    let sel = selectors(rt, q)?;
                    let items =
                        store.delete_collection(rt, t.namespace.as_deref(), &sel, &dopts)?;
                    let rv = store.resource_version();
                    Ok(json_response(
                        StatusCode::OK,
                        &list_doc(rt, items, rv, None),
                    ))
                }
            }
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}
