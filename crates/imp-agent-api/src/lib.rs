//! The node agent's API as its callers see it: the operator's gateway, and the agent of a node a
//! VM moves from.
//!
//! No user credential reaches a node. `imp exec`, `imp console`, `imp top` and `kubectl imp`
//! ask the Kubernetes API server for the `impvms/exec`, `impvms/console` and `guestmetrics`
//! resources of the aggregated API group `subresources.imp.dev`; the API server authenticates
//! and authorizes the user and proxies the request to the operator's gateway, which calls the
//! node's agent over mutual TLS, pinned both ways ([`tls`]), naming the user in
//! [`USER_HEADER`] and [`GROUP_HEADER`] for the agent's logs and per-caller limits. The agent
//! serves nobody else: a caller without the gateway's certificate, a bearer token included, is
//! refused (docs/security.md).
//!
//! The other caller is another node's agent, sending the files of a VM that moves to the
//! agent's node (cold migration, docs/migration.md): it presents its own agent certificate and
//! the move's token, and reaches only the moves' endpoints ([`moves`]); the gateway's
//! endpoints stay the gateway's.
//!
//! Rooms: [`tls`] the pins and the client identities, [`client`] the gateway's calls, [`top`]
//! the guests' figures as JSON, [`moves`] the transfer's wire and its sender, [`sparse`] where
//! a file holds data.

pub mod client;
pub mod moves;
pub mod sparse;
pub mod tls;
pub mod top;

use http::header::{CONNECTION, UPGRADE};
use http::{HeaderMap, StatusCode};

/// The value of the `Upgrade` header that turns an exec request into the guest protocol.
pub const EXEC_UPGRADE: &str = "imp-exec/1";

/// The value of the `Upgrade` header that turns a followed console request, through the API
/// server, into a raw byte stream (a plain streamed answer would be cut by the API server's
/// request timeout; an upgraded connection is not).
pub const CONSOLE_UPGRADE: &str = "imp-console/1";

/// The header in which the gateway names the user the API server authenticated.
pub const USER_HEADER: &str = "imp-remote-user";

/// The header (repeated) in which the gateway names the user's groups.
pub const GROUP_HEADER: &str = "imp-remote-group";

/// The agent's path of an exec into VM `namespace/name`.
pub fn exec_path(namespace: &str, name: &str) -> String {
    format!("/v1/namespaces/{namespace}/impvms/{name}/exec")
}

/// The agent's path of VM `namespace/name`'s console.
pub fn console_path(namespace: &str, name: &str, follow: bool) -> String {
    format!("/v1/namespaces/{namespace}/impvms/{name}/console?follow={follow}")
}

/// A refusal as the body of a Kubernetes `Status`, which kubectl, kube clients and the CLI
/// print the message of: what the agent answers the gateway, and the gateway the API server.
pub fn status_body(code: StatusCode, message: &str) -> serde_json::Value {
    let reason = match code {
        StatusCode::UNAUTHORIZED => "Unauthorized",
        StatusCode::FORBIDDEN => "Forbidden",
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::CONFLICT => "Conflict",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        StatusCode::GATEWAY_TIMEOUT => "Timeout",
        StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
        StatusCode::BAD_REQUEST | StatusCode::UPGRADE_REQUIRED => "BadRequest",
        StatusCode::UNPROCESSABLE_ENTITY => "Invalid",
        _ => "InternalError",
    };
    serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    })
}

/// Whether a comma-separated header value (`Connection`, `Upgrade`) holds `token`, in any
/// case.
pub fn lists_token(value: &str, token: &str) -> bool {
    value
        .split(',')
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Whether a request asks to upgrade to `protocol`: `Connection` lists `upgrade` and `Upgrade`
/// lists the protocol, in any of their values.
pub fn asks_upgrade(headers: &HeaderMap, protocol: &str) -> bool {
    let has = |name, want: &str| {
        headers
            .get_all(name)
            .iter()
            .any(|v| v.to_str().is_ok_and(|s| lists_token(s, want)))
    };
    has(CONNECTION, "upgrade") && has(UPGRADE, protocol)
}

/// Whether `value` is a Kubernetes name: lowercase letters, digits and `-` (and `.` when
/// `dots`), at most `max` bytes, starting and ending alphanumeric. Namespaces are labels (63,
/// no dots), ImpVM names subdomains (253, dots). The gateway and the agent both check the
/// names of a path with it, so what one lets through the other reads the same way.
pub fn is_kubernetes_name(value: &str, max: usize, dots: bool) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= max
        && bytes.first().copied().is_some_and(alnum)
        && bytes.last().copied().is_some_and(alnum)
        && bytes
            .iter()
            .all(|&b| alnum(b) || b == b'-' || (dots && b == b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_names_its_reason_and_code() {
        let s = status_body(StatusCode::FORBIDDEN, "no");
        assert_eq!(
            (s["reason"].as_str(), s["code"].as_u64()),
            (Some("Forbidden"), Some(403))
        );
        assert_eq!(s["message"], "no");
        assert_eq!(
            status_body(StatusCode::UPGRADE_REQUIRED, "")["reason"],
            "BadRequest"
        );
        assert_eq!(
            status_body(StatusCode::BAD_GATEWAY, "")["reason"],
            "InternalError"
        );
    }

    #[test]
    fn an_upgrade_is_recognised_in_lists_and_any_case() {
        let mut h = HeaderMap::new();
        assert!(!asks_upgrade(&h, EXEC_UPGRADE));
        h.insert(
            CONNECTION,
            http::HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert(UPGRADE, http::HeaderValue::from_static("IMP-EXEC/1"));
        assert!(asks_upgrade(&h, EXEC_UPGRADE));
        assert!(!asks_upgrade(&h, CONSOLE_UPGRADE));
        assert!(lists_token("a, b ,c", "B") && !lists_token("ab", "b"));
    }

    #[test]
    fn kubernetes_names_are_lowercase_alphanumeric_inside_and_at_both_ends() {
        assert!(is_kubernetes_name("web-1.a", 253, true));
        assert!(
            !is_kubernetes_name("web-1.a", 63, false),
            "no dots in a label"
        );
        for bad in ["", "-a", "a-", ".a", "..", "A", "a/b", "a_b"] {
            assert!(!is_kubernetes_name(bad, 253, true), "{bad:?}");
        }
        assert!(!is_kubernetes_name(&"a".repeat(64), 63, false));
    }

    #[test]
    fn paths_name_the_vm() {
        assert_eq!(exec_path("a", "b"), "/v1/namespaces/a/impvms/b/exec");
        assert_eq!(
            console_path("a", "b", true),
            "/v1/namespaces/a/impvms/b/console?follow=true"
        );
    }
}
