//! Which endpoint a request is for: a pure parse of method, path and query.
//!
//! `POST /v1/namespaces/{ns}/impvms/{name}/exec`,
//! `GET /v1/namespaces/{ns}/impvms/{name}/console?follow=true|false` and
//! `GET /v1/namespaces/{ns}/guest-metrics` (of no one VM: its name is empty), the gateway's;
//! `GET|PUT /v1/moves/{ns}/{name}/files/{file}` (`PUT` with `?size=`) and
//! `POST /v1/moves/{ns}/{name}/done`, a source agent's ([`super::moves`]). Namespace and name
//! must be Kubernetes names (lowercase RFC 1123) and a moved file's name one plain component
//! (`[a-z0-9][a-z0-9._-]{0,63}`), so nothing that reaches a lookup, a file or a log line can be
//! a path trick.

use http::{Method, StatusCode};

use super::auth::Subresource;

/// One request the API serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The VM's namespace.
    pub namespace: String,
    /// The VM's name (empty for a request about the namespace's VMs).
    pub name: String,
    /// What is asked of it.
    pub action: Action,
}

/// What a request asks of a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run a command (the connection is upgraded to the guest protocol).
    Exec,
    /// Stream the serial console log.
    Console {
        /// Keep streaming what is appended while the VM runs.
        follow: bool,
    },
    /// The latest guest figures of the namespace's VMs on this node ([`super::top`]).
    GuestMetrics,
}

impl Route {
    /// The subresource authorization is asked for.
    pub fn subresource(&self) -> Subresource {
        match self.action {
            Action::Exec => Subresource::Exec,
            Action::Console { .. } => Subresource::Console,
            Action::GuestMetrics => Subresource::GuestMetrics,
        }
    }
}

/// One request of a move of a VM into this node ([`super::moves`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveRoute {
    /// The VM's namespace.
    pub namespace: String,
    /// The VM's name.
    pub name: String,
    /// What is asked.
    pub action: MoveAction,
}

/// What a move's request asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoveAction {
    /// How much of `file` this node holds (`GET .../files/{file}`).
    Held {
        /// The file's name.
        file: String,
    },
    /// Frames of `file`, whose size is `size` (`PUT .../files/{file}?size=`).
    Put {
        /// The file's name.
        file: String,
        /// The file's size in bytes.
        size: u64,
    },
    /// Check every file and take them (`POST .../done`).
    Done,
}

/// A request to either caller's endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The gateway's: exec, console, guest metrics.
    Vm(Route),
    /// A source agent's: a move's files.
    Move(MoveRoute),
}

/// Where the moves' endpoints are.
const MOVES_PREFIX: &str = "/v1/moves/";

/// Parses a request's method, path and query, of either caller.
pub fn parse_request(
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> Result<Request, RouteError> {
    if path.starts_with(MOVES_PREFIX) {
        parse_move(method, path, query).map(Request::Move)
    } else {
        parse(method, path, query).map(Request::Vm)
    }
}

/// Parses a move's request: `/v1/moves/{ns}/{name}/files/{file}` or `/v1/moves/{ns}/{name}/done`.
/// Everything after `files/` is the file's name, so a traversal (`files/../x`) is refused as
/// an invalid name rather than not found.
pub fn parse_move(
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> Result<MoveRoute, RouteError> {
    let no_route = || RouteError::NoRoute(path.to_owned());
    let rest = path.strip_prefix(MOVES_PREFIX).ok_or_else(no_route)?;
    let mut parts = rest.splitn(4, '/');
    let (Some(ns), Some(name), Some(endpoint)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(no_route());
    };
    let file = parts.next();
    let wrong = |allowed| RouteError::Method {
        path: path.to_owned(),
        method: method.to_string(),
        allowed,
    };
    let action = match (endpoint, file) {
        ("files", Some(file)) => {
            if *method != Method::GET && *method != Method::PUT {
                return Err(wrong("GET or PUT"));
            }
            if !imp_agent_api::moves::is_file_name(file) {
                return Err(RouteError::InvalidFileName(file.to_owned()));
            }
            let file = file.to_owned();
            if *method == Method::GET {
                MoveAction::Held { file }
            } else {
                MoveAction::Put {
                    file,
                    size: size(query)?,
                }
            }
        }
        ("done", None) if *method == Method::POST => MoveAction::Done,
        ("done", None) => return Err(wrong("POST")),
        _ => return Err(no_route()),
    };
    check_name("namespace", ns, 63, false)?;
    check_name("name", name, 253, true)?;
    Ok(MoveRoute {
        namespace: ns.to_owned(),
        name: name.to_owned(),
        action,
    })
}

/// `size=<bytes>`, required.
fn size(query: Option<&str>) -> Result<u64, RouteError> {
    let value = query
        .unwrap_or("")
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find_map(|(key, value)| (key == "size").then_some(value))
        .ok_or(RouteError::MissingQuery { param: "size" })?;
    value.parse().map_err(|_| RouteError::Query {
        param: "size",
        value: value.to_owned(),
        expected: "a number of bytes",
    })
}

/// Why a request matches no endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No endpoint has this path.
    #[error("No endpoint at {0}")]
    NoRoute(String),
    /// The endpoint exists but not for this method.
    #[error("{path} takes {allowed}, not {method}")]
    Method {
        /// The path asked for.
        path: String,
        /// The method used.
        method: String,
        /// The method the endpoint takes.
        allowed: &'static str,
    },
    /// A namespace or name is not a Kubernetes name.
    #[error("Invalid {what} {value:?}: not a lowercase RFC 1123 name")]
    InvalidName {
        /// "namespace" or "name".
        what: &'static str,
        /// The value given.
        value: String,
    },
    /// A query parameter has a value we do not understand.
    #[error("Invalid query parameter {param}={value:?}: expected {expected}")]
    Query {
        /// The parameter.
        param: &'static str,
        /// The value given.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
    /// A query parameter the endpoint needs is missing.
    #[error("The query parameter {param} is missing")]
    MissingQuery {
        /// The parameter.
        param: &'static str,
    },
    /// A moved file's name is not one plain component.
    #[error(
        "Invalid file name {0:?}: expected [a-z0-9][a-z0-9._-]{{0,63}} (one path component, not hidden)"
    )]
    InvalidFileName(String),
}

impl RouteError {
    /// The HTTP status that answers this error.
    pub fn status(&self) -> StatusCode {
        match self {
            RouteError::NoRoute(_) => StatusCode::NOT_FOUND,
            RouteError::Method { .. } => StatusCode::METHOD_NOT_ALLOWED,
            RouteError::InvalidName { .. }
            | RouteError::Query { .. }
            | RouteError::MissingQuery { .. }
            | RouteError::InvalidFileName(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Parses a request's method, path and query into a [`Route`].
pub fn parse(method: &Method, path: &str, query: Option<&str>) -> Result<Route, RouteError> {
    let segments: Vec<&str> = path.split('/').collect();
    if let ["", "v1", "namespaces", ns, endpoint] = segments.as_slice()
        && *endpoint == super::top::ENDPOINT
    {
        if *method != Method::GET {
            return Err(RouteError::Method {
                path: path.to_owned(),
                method: method.to_string(),
                allowed: "GET",
            });
        }
        check_name("namespace", ns, 63, false)?;
        return Ok(Route {
            namespace: (*ns).to_owned(),
            name: String::new(),
            action: Action::GuestMetrics,
        });
    }
    let ["", "v1", "namespaces", ns, "impvms", name, endpoint] = segments.as_slice() else {
        return Err(RouteError::NoRoute(path.to_owned()));
    };
    let (action, allowed) = match *endpoint {
        "exec" => (Action::Exec, Method::POST),
        "console" => (
            Action::Console {
                follow: follow(query)?,
            },
            Method::GET,
        ),
        _ => return Err(RouteError::NoRoute(path.to_owned())),
    };
    if *method != allowed {
        return Err(RouteError::Method {
            path: path.to_owned(),
            method: method.to_string(),
            allowed: if allowed == Method::POST {
                "POST"
            } else {
                "GET"
            },
        });
    }
    check_name("namespace", ns, 63, false)?;
    check_name("name", name, 253, true)?;
    Ok(Route {
        namespace: (*ns).to_owned(),
        name: (*name).to_owned(),
        action,
    })
}

/// `follow=true|false` (also `1|0`); absent means false, as for `kubectl logs`.
fn follow(query: Option<&str>) -> Result<bool, RouteError> {
    let mut follow = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        if key != "follow" {
            continue;
        }
        follow = match value {
            "true" | "1" => true,
            "false" | "0" => false,
            other => {
                return Err(RouteError::Query {
                    param: "follow",
                    value: other.to_owned(),
                    expected: "true or false",
                });
            }
        };
    }
    Ok(follow)
}

/// A lowercase RFC 1123 name: alphanumerics, '-' (and '.' where `dots`: a subdomain rather
/// than a label), starting and ending alphanumeric.
fn check_name(what: &'static str, value: &str, max: usize, dots: bool) -> Result<(), RouteError> {
    if imp_agent_api::is_kubernetes_name(value, max, dots) {
        Ok(())
    } else {
        Err(RouteError::InvalidName {
            what,
            value: value.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_and_console_paths_name_the_vm() {
        let r = parse(
            &Method::POST,
            "/v1/namespaces/team-a/impvms/web.1/exec",
            None,
        )
        .unwrap();
        assert_eq!(r.namespace, "team-a");
        assert_eq!(r.name, "web.1");
        assert_eq!(r.action, Action::Exec);
        assert_eq!(r.subresource(), Subresource::Exec);
        let r = parse(
            &Method::GET,
            "/v1/namespaces/default/impvms/vm/console",
            Some("follow=true"),
        )
        .unwrap();
        assert_eq!(r.action, Action::Console { follow: true });
        assert_eq!(r.subresource(), Subresource::Console);
    }

    #[test]
    fn guest_metrics_is_a_get_on_a_namespace() {
        let r = parse(&Method::GET, "/v1/namespaces/team-a/guest-metrics", None).unwrap();
        assert_eq!(r.namespace, "team-a");
        assert_eq!(r.name, "");
        assert_eq!(r.action, Action::GuestMetrics);
        assert_eq!(r.subresource(), Subresource::GuestMetrics);
        let err = parse(&Method::POST, "/v1/namespaces/d/guest-metrics", None).unwrap_err();
        assert_eq!(err.status(), StatusCode::METHOD_NOT_ALLOWED);
        let err = parse(&Method::GET, "/v1/namespaces/D/guest-metrics", None).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        for path in [
            "/v1/namespaces/d/metrics",
            "/v1/namespaces/d/guest-metrics/x",
            "/v1/namespaces/guest-metrics",
        ] {
            let err = parse(&Method::GET, path, None).unwrap_err();
            assert_eq!(err.status(), StatusCode::NOT_FOUND, "{path}");
        }
    }

    #[test]
    fn follow_defaults_to_false_and_rejects_nonsense() {
        let console = |q| parse(&Method::GET, "/v1/namespaces/d/impvms/v/console", q);
        assert_eq!(
            console(None).unwrap().action,
            Action::Console { follow: false }
        );
        assert_eq!(
            console(Some("x=1&follow=1")).unwrap().action,
            Action::Console { follow: true }
        );
        assert_eq!(
            console(Some("follow=false")).unwrap().action,
            Action::Console { follow: false }
        );
        let err = console(Some("follow=yes")).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert!(err.to_string().contains("follow=\"yes\""), "{err}");
    }

    #[test]
    fn unknown_paths_are_404_and_wrong_methods_405() {
        for path in [
            "/",
            "/v1/namespaces/d/impvms/v",
            "/v1/namespaces/d/impvms/v/attach",
            "/v1/namespaces/d/pods/v/exec",
            "/v1/namespaces/d/impvms/v/exec/extra",
            "/v2/namespaces/d/impvms/v/exec",
        ] {
            let err = parse(&Method::POST, path, None).unwrap_err();
            assert_eq!(err, RouteError::NoRoute(path.to_owned()));
            assert_eq!(err.status(), StatusCode::NOT_FOUND);
        }
        let err = parse(&Method::GET, "/v1/namespaces/d/impvms/v/exec", None).unwrap_err();
        assert_eq!(err.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert!(err.to_string().contains("takes POST, not GET"), "{err}");
        let err = parse(&Method::POST, "/v1/namespaces/d/impvms/v/console", None).unwrap_err();
        assert!(err.to_string().contains("takes GET, not POST"), "{err}");
    }

    #[test]
    fn names_that_are_not_kubernetes_names_are_refused() {
        for (ns, name, bad) in [
            ("..", "v", "namespace"),
            ("d", "..", "name"),
            ("D", "v", "namespace"),
            ("d", "v%2F..", "name"),
            ("d", "-v", "name"),
            ("d", "v-", "name"),
            ("", "v", "namespace"),
            ("a.b", "v", "namespace"), // a namespace is a label: no dots
        ] {
            let path = format!("/v1/namespaces/{ns}/impvms/{name}/exec");
            let err = parse(&Method::POST, &path, None).unwrap_err();
            assert!(
                matches!(&err, RouteError::InvalidName { what, .. } if *what == bad),
                "{path}: {err:?}"
            );
            assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        }
        let long = "a".repeat(64);
        let path = format!("/v1/namespaces/{long}/impvms/v/exec");
        assert!(parse(&Method::POST, &path, None).is_err());
        let path = format!("/v1/namespaces/d/impvms/{long}/exec");
        assert!(parse(&Method::POST, &path, None).is_ok());
    }
    #[test]
    fn move_paths_name_the_vm_and_the_file() {
        let r = parse_request(&Method::GET, "/v1/moves/team-a/web.1/files/disk.img", None).unwrap();
        assert_eq!(
            r,
            Request::Move(MoveRoute {
                namespace: "team-a".into(),
                name: "web.1".into(),
                action: MoveAction::Held {
                    file: "disk.img".into()
                },
            })
        );
        let r = parse_move(
            &Method::PUT,
            "/v1/moves/d/v/files/memory",
            Some("x=1&size=1073741824"),
        )
        .unwrap();
        assert_eq!(
            r.action,
            MoveAction::Put {
                file: "memory".into(),
                size: 1 << 30
            }
        );
        let r = parse_move(&Method::POST, "/v1/moves/d/v/done", None).unwrap();
        assert_eq!((r.namespace.as_str(), r.action), ("d", MoveAction::Done));
        // The gateway's paths still parse as they did.
        let r = parse_request(&Method::POST, "/v1/namespaces/d/impvms/v/exec", None).unwrap();
        assert!(
            matches!(
                r,
                Request::Vm(Route {
                    action: Action::Exec,
                    ..
                })
            ),
            "{r:?}"
        );
    }

    #[test]
    fn a_moved_file_name_is_one_plain_component() {
        for file in [
            "..",
            ".",
            "../x",
            "../../etc/passwd",
            "a/b",
            ".hidden",
            "%2e%2e",
            "..%2Fx",
            "Disk.img",
            "",
            "-x",
        ] {
            let path = format!("/v1/moves/d/v/files/{file}");
            for method in [Method::GET, Method::PUT] {
                let err = parse_move(&method, &path, Some("size=1")).unwrap_err();
                assert_eq!(err, RouteError::InvalidFileName(file.to_owned()), "{path}");
                assert_eq!(err.status(), StatusCode::BAD_REQUEST);
                assert!(err.to_string().contains(&format!("{file:?}")), "{err}");
            }
        }
        let long = "a".repeat(65);
        let path = format!("/v1/moves/d/v/files/{long}");
        assert!(parse_move(&Method::GET, &path, None).is_err());
        let path = format!("/v1/moves/d/v/files/{}", &long[1..]);
        assert!(parse_move(&Method::GET, &path, None).is_ok());
    }

    #[test]
    fn move_paths_refuse_bad_vm_names_methods_and_sizes() {
        for (path, what) in [
            ("/v1/moves/../v/files/a", "namespace"),
            ("/v1/moves/d/../files/a", "name"),
            ("/v1/moves/D/v/done", "namespace"),
            ("/v1/moves/a.b/v/done", "namespace"),
        ] {
            let method = if path.ends_with("done") {
                Method::POST
            } else {
                Method::GET
            };
            let err = parse_move(&method, path, None).unwrap_err();
            assert!(
                matches!(&err, RouteError::InvalidName { what: w, .. } if *w == what),
                "{path}: {err:?}"
            );
        }
        let err = parse_move(&Method::POST, "/v1/moves/d/v/files/a", None).unwrap_err();
        assert_eq!(err.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert!(
            err.to_string().contains("takes GET or PUT, not POST"),
            "{err}"
        );
        let err = parse_move(&Method::DELETE, "/v1/moves/d/v/files/a", None).unwrap_err();
        assert_eq!(err.status(), StatusCode::METHOD_NOT_ALLOWED);
        let err = parse_move(&Method::GET, "/v1/moves/d/v/done", None).unwrap_err();
        assert!(err.to_string().contains("takes POST, not GET"), "{err}");
        let err = parse_move(&Method::PUT, "/v1/moves/d/v/files/a", None).unwrap_err();
        assert_eq!(err, RouteError::MissingQuery { param: "size" });
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        for bad in ["size=", "size=-1", "size=1k", "size=18446744073709551616"] {
            let err = parse_move(&Method::PUT, "/v1/moves/d/v/files/a", Some(bad)).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad}");
            assert!(err.to_string().contains("a number of bytes"), "{err}");
        }
        for path in [
            "/v1/moves/",
            "/v1/moves/d",
            "/v1/moves/d/v",
            "/v1/moves/d/v/files",
            "/v1/moves/d/v/done/x",
            "/v1/moves/d/v/exec",
        ] {
            let err = parse_request(&Method::POST, path, None).unwrap_err();
            assert_eq!(err, RouteError::NoRoute(path.to_owned()), "{path}");
        }
    }
}
