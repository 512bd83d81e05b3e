//! Bearer-token authentication and the answers of TokenReview and SubjectAccessReview.

use std::collections::HashMap;

use serde_json::{Value, json};

/// A user a token authenticates as.
#[derive(Debug, Clone, PartialEq)]
pub struct User {
    /// Username, e.g. `system:serviceaccount:imp-system:imp-operator`.
    pub name: String,
    /// Groups, e.g. `system:masters`.
    pub groups: Vec<String>,
}

/// One allow rule: a user (or group) may use these verbs on these resources.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Username or group the rule applies to (`*` for everyone).
    pub subject: String,
    /// Verbs (`*` for all).
    pub verbs: Vec<String>,
    /// API groups (`*` for all, "" for core).
    pub groups: Vec<String>,
    /// Resources, optionally with a subresource (`impvms/status`); `*` for all.
    pub resources: Vec<String>,
}

/// Tokens and authorization rules; the default allows everything without a token.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// token → user. Empty: no authentication required.
    pub tokens: HashMap<String, User>,
    /// Rules SubjectAccessReview answers from. Users in `system:masters` may do anything.
    pub rules: Vec<Rule>,
    /// Also enforce the rules on every API request (403 Forbidden), like RBAC would.
    pub enforce: bool,
}

/// The outcome of authenticating a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Identity {
    /// No authentication configured.
    Anonymous,
    /// A known token.
    User(User),
    /// Authentication is configured and the token is missing or unknown.
    Rejected,
}

fn any(list: &[String], want: &str) -> bool {
    list.iter().any(|x| x == "*" || x == want)
}

impl Auth {
    /// Authenticates an `Authorization` header value.
    pub fn authenticate(&self, header: Option<&str>) -> Identity {
        if self.tokens.is_empty() {
            return Identity::Anonymous;
        }
        let token = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim);
        match token.and_then(|t| self.tokens.get(t)) {
            Some(u) => Identity::User(u.clone()),
            None => Identity::Rejected,
        }
    }

    /// Whether `user` (with `groups`) may do `verb` on `group`/`resource`.
    pub fn allowed(
        &self,
        user: &str,
        groups: &[String],
        verb: &str,
        group: &str,
        resource: &str,
    ) -> bool {
        if groups.iter().any(|g| g == "system:masters") {
            return true;
        }
        self.rules.iter().any(|r| {
            (r.subject == "*" || r.subject == user || groups.contains(&r.subject))
                && any(&r.verbs, verb)
                && any(&r.groups, group)
                && any(&r.resources, resource)
        })
    }

    /// Fills in the status of a TokenReview.
    pub fn token_review(&self, mut review: Value) -> Value {
        let token = review
            .pointer("/spec/token")
            .and_then(Value::as_str)
            .unwrap_or("");
        review["status"] = match self.tokens.get(token) {
            Some(u) => {
                json!({"authenticated": true, "user": {"username": u.name, "groups": u.groups}})
            }
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        };
        review
    }

    /// Fills in the status of a SubjectAccessReview.
    pub fn access_review(&self, mut review: Value) -> Value {
        let spec = &review["spec"];
        let user = spec["user"].as_str().unwrap_or("").to_string();
        let groups: Vec<String> = spec["groups"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        let ra = &spec["resourceAttributes"];
        let verb = ra["verb"].as_str().unwrap_or("");
        let group = ra["group"].as_str().unwrap_or("");
        let mut resource = ra["resource"].as_str().unwrap_or("").to_string();
        if let Some(sub) = ra["subresource"].as_str().filter(|s| !s.is_empty()) {
            resource = format!("{resource}/{sub}");
        }
        let ok = self.allowed(&user, &groups, verb, group, &resource);
        review["status"] = if ok {
            json!({"allowed": true, "reason": "allowed by imp-testkube rule"})
        } else {
            json!({"allowed": false, "reason": "no imp-testkube rule allows this"})
        };
        review
    }
}
