//! The paths of the aggregated API group `subresources.imp.dev/v1alpha1`, parsed, and its
//! discovery documents.
//!
//! | request (through the API server) | RBAC the API server checks |
//! |---|---|
//! | `POST …/namespaces/{ns}/impvms/{name}/exec` (upgrade `imp-exec/1`) | `create impvms/exec` |
//! | `GET …/namespaces/{ns}/impvms/{name}/console[?follow=true]` (upgrade `imp-console/1` when followed) | `get impvms/console` |
//! | `GET …/namespaces/{ns}/guestmetrics` | `list guestmetrics` |
//! | `GET …/namespaces/{ns}/impvms/{name}/inputs` (node agents only) | `get impvms/inputs` |
//! | `GET …/namespaces/{ns}/impvmsnapshots/{name}/inputs` (node agents only) | `get impvmsnapshots/inputs` |
//!
//! `…` is `/apis/subresources.imp.dev/v1alpha1`. `GET /apis`, `/apis/subresources.imp.dev` and
//! `…` answer discovery, as every aggregated API server does.

use http::{Method, StatusCode};
use serde_json::{Value, json};

/// The group the gateway serves.
pub const GROUP: &str = "subresources.imp.dev";
/// Its version.
pub const VERSION: &str = "v1alpha1";
/// The name of its APIService.
pub const API_SERVICE: &str = "v1alpha1.subresources.imp.dev";

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `GET /apis`: the group list.
    Groups,
    /// `GET /apis/subresources.imp.dev`: the group.
    Group,
    /// `GET /apis/subresources.imp.dev/v1alpha1`: the resources.
    Resources,
    /// An exec into `namespace/name`.
    Exec {
        /// The VM's namespace.
        namespace: String,
        /// The VM's name.
        name: String,
    },
    /// The console of `namespace/name`.
    Console {
        /// The VM's namespace.
        namespace: String,
        /// The VM's name.
        name: String,
        /// Whether to follow the log as it grows.
        follow: bool,
    },
    /// The guests' figures of a namespace's VMs.
    GuestMetrics {
        /// The namespace.
        namespace: String,
    },
    /// The Secrets and ConfigMaps VM `namespace/name` refers to, for its node's agent.
    VmInputs {
        /// The VM's namespace.
        namespace: String,
        /// The VM's name.
        name: String,
    },
    /// The pull secret of snapshot execution `namespace/name`, for the agent of a node that
    /// takes, holds or restores it.
    SnapshotInputs {
        /// The execution's namespace.
        namespace: String,
        /// The execution's name.
        name: String,
    },
}

/// Why a path is not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No such path.
    #[error("Not found: {0}")]
    NotFound(String),
    /// The path is served for another method.
    #[error("Method {method} is not allowed for {path}: use {allowed}")]
    Method {
        /// What was sent.
        method: Method,
        /// The path.
        path: String,
        /// What the path takes.
        allowed: Method,
    },
    /// A query parameter is malformed.
    #[error("Bad request: {0}")]
    Query(String),
}

impl RouteError {
    /// The HTTP status of the refusal.
    pub fn status(&self) -> StatusCode {
        match self {
            RouteError::NotFound(_) => StatusCode::NOT_FOUND,
            RouteError::Method { .. } => StatusCode::METHOD_NOT_ALLOWED,
            RouteError::Query(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Parses one request's method, path and query.
pub fn parse(method: &Method, path: &str, query: Option<&str>) -> Result<Route, RouteError> {
    let not_found = || RouteError::NotFound(path.to_owned());
    let base = format!("/apis/{GROUP}/{VERSION}");
    let (route, allowed) = match path.trim_end_matches('/') {
        "/apis" => (Route::Groups, Method::GET),
        p if p == format!("/apis/{GROUP}") => (Route::Group, Method::GET),
        p if p == base => (Route::Resources, Method::GET),
        p => {
            // Exactly one `/` after the base and none doubled: the API server splits the path
            // the same way when it authorizes, so what runs is what it authorized.
            let rest = p
                .strip_prefix(&base)
                .and_then(|r| r.strip_prefix('/'))
                .ok_or_else(not_found)?;
            let parts: Vec<&str> = rest.split('/').collect();
            match parts.as_slice() {
                ["namespaces", ns, "impvms", name, "exec"] => (
                    Route::Exec {
                        namespace: namespace_part(ns, path)?,
                        name: name_part(name, path)?,
                    },
                    Method::POST,
                ),
                ["namespaces", ns, "impvms", name, "console"] => (
                    Route::Console {
                        namespace: namespace_part(ns, path)?,
                        name: name_part(name, path)?,
                        follow: follow(query)?,
                    },
                    Method::GET,
                ),
                ["namespaces", ns, "impvms", name, "inputs"] => (
                    Route::VmInputs {
                        namespace: namespace_part(ns, path)?,
                        name: name_part(name, path)?,
                    },
                    Method::GET,
                ),
                ["namespaces", ns, "impvmsnapshots", name, "inputs"] => (
                    Route::SnapshotInputs {
                        namespace: namespace_part(ns, path)?,
                        name: name_part(name, path)?,
                    },
                    Method::GET,
                ),
                ["namespaces", ns, "guestmetrics"] => (
                    Route::GuestMetrics {
                        namespace: namespace_part(ns, path)?,
                    },
                    Method::GET,
                ),
                _ => return Err(not_found()),
            }
        }
    };
    if *method != allowed {
        return Err(RouteError::Method {
            method: method.clone(),
            path: path.to_owned(),
            allowed,
        });
    }
    Ok(route)
}

/// A VM's name: a Kubernetes name (a DNS subdomain).
fn name_part(part: &str, path: &str) -> Result<String, RouteError> {
    imp_agent_api::is_kubernetes_name(part, 253, true)
        .then(|| part.to_owned())
        .ok_or_else(|| RouteError::NotFound(path.to_owned()))
}

/// A namespace: a DNS label.
fn namespace_part(part: &str, path: &str) -> Result<String, RouteError> {
    imp_agent_api::is_kubernetes_name(part, 63, false)
        .then(|| part.to_owned())
        .ok_or_else(|| RouteError::NotFound(path.to_owned()))
}

/// The `follow` query parameter: absent or `false` is false, `true` or `1` true.
fn follow(query: Option<&str>) -> Result<bool, RouteError> {
    let mut out = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        if key == "follow" {
            out = match value {
                "true" | "1" => true,
                "false" | "0" => false,
                v => {
                    return Err(RouteError::Query(format!(
                        "follow={v} is not true or false"
                    )));
                }
            };
        }
    }
    Ok(out)
}

/// The discovery document a discovery route answers with.
pub fn discovery(route: &Route) -> Option<Value> {
    let version = json!({"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION});
    let group = json!({
        "name": GROUP,
        "versions": [version.clone()],
        "preferredVersion": version,
    });
    match route {
        Route::Groups => Some(json!({
            "kind": "APIGroupList", "apiVersion": "v1", "groups": [group],
        })),
        Route::Group => {
            let mut g = group;
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            Some(g)
        }
        Route::Resources => Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": format!("{GROUP}/{VERSION}"),
            "resources": [
                {"name": "impvms/exec", "singularName": "", "namespaced": true,
                 "kind": "ImpVMExec", "verbs": ["create"]},
                {"name": "impvms/console", "singularName": "", "namespaced": true,
                 "kind": "ImpVMConsole", "verbs": ["get"]},
                {"name": "guestmetrics", "singularName": "guestmetrics", "namespaced": true,
                 "kind": "GuestReadingList", "verbs": ["list"]},
                {"name": "impvms/inputs", "singularName": "", "namespaced": true,
                 "kind": "Inputs", "verbs": ["get"]},
                {"name": "impvmsnapshots/inputs", "singularName": "", "namespaced": true,
                 "kind": "Inputs", "verbs": ["get"]},
            ],
        })),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const BASE: &str = "/apis/subresources.imp.dev/v1alpha1";

    #[test]
    fn the_subresources_name_their_vm_or_namespace() {
        let exec = parse(
            &Method::POST,
            &format!("{BASE}/namespaces/a/impvms/b/exec"),
            None,
        );
        assert_eq!(
            exec.unwrap(),
            Route::Exec {
                namespace: "a".into(),
                name: "b".into()
            }
        );
        let console = |q| {
            parse(
                &Method::GET,
                &format!("{BASE}/namespaces/a/impvms/b/console"),
                q,
            )
        };
        assert!(matches!(
            console(None).unwrap(),
            Route::Console { follow: false, .. }
        ));
        assert!(matches!(
            console(Some("follow=true")).unwrap(),
            Route::Console { follow: true, .. }
        ));
        assert_eq!(
            console(Some("follow=maybe")).unwrap_err().status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            parse(
                &Method::GET,
                &format!("{BASE}/namespaces/a/guestmetrics"),
                None
            )
            .unwrap(),
            Route::GuestMetrics {
                namespace: "a".into()
            }
        );
        let get = |p: &str| parse(&Method::GET, &format!("{BASE}/{p}"), None);
        assert_eq!(
            get("namespaces/a/impvms/b/inputs").unwrap(),
            Route::VmInputs {
                namespace: "a".into(),
                name: "b".into()
            }
        );
        assert_eq!(
            get("namespaces/a/impvmsnapshots/b/inputs").unwrap(),
            Route::SnapshotInputs {
                namespace: "a".into(),
                name: "b".into()
            }
        );
        // Read only; a name that is not one is not found.
        let post = parse(
            &Method::POST,
            &format!("{BASE}/namespaces/a/impvms/b/inputs"),
            None,
        );
        assert_eq!(post.unwrap_err().status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            get("namespaces/a/impvms/B_/inputs").unwrap_err().status(),
            StatusCode::NOT_FOUND
        );
    }

    #[test]
    fn wrong_methods_unknown_paths_and_bad_names_are_refused() {
        let e = parse(
            &Method::GET,
            &format!("{BASE}/namespaces/a/impvms/b/exec"),
            None,
        );
        assert_eq!(e.unwrap_err().status(), StatusCode::METHOD_NOT_ALLOWED);
        for p in [
            format!("{BASE}/namespaces/a/impvms/b"),
            format!("{BASE}/namespaces/A/impvms/b/exec"),
            format!("{BASE}/namespaces/a/impvms/../exec/x"),
            format!("{BASE}/namespaces/a/impvms/../exec"),
            format!("{BASE}/namespaces/a.b/impvms/c/exec"),
            format!("{BASE}//namespaces/a/impvms/b/exec"),
            format!("{BASE}/namespaces//a/impvms/b/exec"),
            format!("{BASE}namespaces/a/impvms/b/exec"),
            "/apis/other.dev/v1".to_owned(),
            "/api/v1".to_owned(),
        ] {
            let e = parse(&Method::POST, &p, None).unwrap_err();
            assert_eq!(e.status(), StatusCode::NOT_FOUND, "{p}");
        }
    }

    #[test]
    fn discovery_lists_the_group_and_its_resources() {
        let groups = parse(&Method::GET, "/apis", None).unwrap();
        assert_eq!(discovery(&groups).unwrap()["groups"][0]["name"], GROUP);
        let group = parse(&Method::GET, "/apis/subresources.imp.dev/", None).unwrap();
        assert_eq!(discovery(&group).unwrap()["kind"], "APIGroup");
        let list = discovery(&parse(&Method::GET, BASE, None).unwrap()).unwrap();
        let names: Vec<_> = list["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "impvms/exec",
                "impvms/console",
                "guestmetrics",
                "impvms/inputs",
                "impvmsnapshots/inputs"
            ]
        );
        assert!(
            discovery(&Route::GuestMetrics {
                namespace: "a".into()
            })
            .is_none()
        );
    }
}
