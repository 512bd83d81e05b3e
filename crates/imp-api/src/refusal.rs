//! What the API server refused, told apart: a 403 is a missing RBAC rule (the server's message
//! names the user, verb, resource and namespace), a 409 a write based on an outdated version.
//! The operator and the agent say the first loudly (a log line and a Warning Event with the
//! server's own words) and retry the second at once.

use kube::core::Status;

/// The Event reason both components use when the API server refuses them for RBAC.
pub const FORBIDDEN_REASON: &str = "Forbidden";

/// The server's message when `e` is a 403 (RBAC refused the request), e.g. `impvms.imp.dev "a"
/// is forbidden: User "system:serviceaccount:imp-system:imp-operator" cannot patch resource
/// "impvms/status" in API group "imp.dev" in the namespace "default"`.
/// (`s` is what `kube::Error::Api` carries.)
pub fn forbidden(s: &Status) -> Option<&str> {
    (s.code == 403).then_some(s.message.as_str())
}

/// The server's message when `s` is a ResourceQuota's refusal (a 403 whose message says
/// "exceeded quota: <name>, requested: …", from the quota admission or from the webhook's
/// preview of a VM's reservation, which quotes it).
pub fn quota(s: &Status) -> Option<&str> {
    (s.code == 403 && s.message.contains("exceeded quota")).then_some(s.message.as_str())
}

/// Whether `s` is a 409: the object changed since the version the write was based on.
pub fn conflict(s: &Status) -> bool {
    s.code == 409
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, message: &str) -> Status {
        Status::failure(message, "Forbidden").with_code(code)
    }

    #[test]
    fn a_403_gives_the_servers_words_and_nothing_else_does() {
        let msg =
            r#"impvms.imp.dev "a" is forbidden: User "u" cannot patch resource "impvms/status""#;
        assert_eq!(forbidden(&api(403, msg)), Some(msg));
        assert_eq!(forbidden(&api(409, "conflict")), None);
        assert_eq!(forbidden(&api(404, "not found")), None);
        assert!(conflict(&api(409, "conflict")));
        let quota_msg =
            r#"pods "imp-vm-a" is forbidden: exceeded quota: q, requested: memory=256Mi"#;
        assert_eq!(quota(&api(403, quota_msg)), Some(quota_msg));
        assert_eq!(quota(&api(403, msg)), None);
        assert_eq!(quota(&api(422, quota_msg)), None);
        assert!(!conflict(&api(403, msg)));
    }
}
