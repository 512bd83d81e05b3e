//! Resource types the server knows: the built-ins and every registered CRD version.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use crate::error::Target;

/// One column of `kubectl get` output, from a CRD's `additionalPrinterColumns` or a built-in.
#[derive(Debug, Clone)]
pub struct Column {
    /// Header, e.g. `Phase`.
    pub name: String,
    /// OpenAPI type: string, integer, number, boolean, date.
    pub type_: String,
    /// JSONPath into the object, e.g. `.status.phase`.
    pub json_path: String,
    /// Shown only with `-o wide` when above 0.
    pub priority: i64,
    /// Column description for the Table.
    pub description: String,
}

/// Everything the server needs to serve one group/version/resource.
#[derive(Debug, Clone)]
pub struct ResourceType {
    /// API group; "" for the core group.
    pub group: String,
    /// Version, e.g. `v1`.
    pub version: String,
    /// Plural name used in paths.
    pub plural: String,
    /// Singular name for discovery.
    pub singular: String,
    /// Kind of one object.
    pub kind: String,
    /// Whether objects live in a namespace.
    pub namespaced: bool,
    /// Short names for discovery (`kubectl get ns`).
    pub short_names: Vec<String>,
    /// Categories for discovery (`kubectl get all`).
    pub categories: Vec<String>,
    /// Whether a `/status` subresource splits status from the rest.
    pub status_subresource: bool,
    /// Review-style resources that are only created, answered and never stored.
    pub create_only: bool,
    /// Printer columns beyond Name (and Age).
    pub columns: Vec<Column>,
    /// Extra field-selector labels (JSONPaths without the leading dot).
    pub selectable_fields: Vec<String>,
    /// The structural schema of this version (CRDs only).
    pub schema: Option<Arc<Value>>,
    /// Whether this version is the CRD's storage version (or a built-in).
    pub storage: bool,
}

impl ResourceType {
    /// `apiVersion` of objects of this type.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Key under which objects of this type are stored, shared by all versions.
    pub fn store_key(&self) -> String {
        if crate::events::is_events_v1(&self.group, &self.plural) {
            // Both Event APIs share the core storage.
            return "/events".to_string();
        }
        format!("{}/{}", self.group, self.plural)
    }

    /// Whether this is `events.k8s.io` events, stored in the core shape.
    pub fn is_events_v1(&self) -> bool {
        crate::events::is_events_v1(&self.group, &self.plural)
    }

    /// The resource as errors name it.
    pub fn target(&self) -> Target<'_> {
        Target {
            group: &self.group,
            plural: &self.plural,
            kind: &self.kind,
        }
    }

    /// Verbs for discovery.
    pub fn verbs(&self) -> Vec<&'static str> {
        if self.create_only {
            vec!["create"]
        } else {
            vec![
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch",
            ]
        }
    }

    /// Field-selector labels this type accepts beyond metadata.name/namespace.
    pub fn field_labels(&self) -> Vec<String> {
        let mut v: Vec<String> = match (self.group.as_str(), self.plural.as_str()) {
            ("", "pods") => [
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            ("", "events") | ("events.k8s.io", "events") => [
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "involvedObject.fieldPath",
                "regarding.kind",
                "regarding.namespace",
                "regarding.name",
                "regarding.uid",
                "reason",
                "reportingController",
                "reportingComponent",
                "source",
                "type",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            ("", "secrets") => vec!["type".into()],
            ("", "nodes") => vec!["spec.unschedulable".into()],
            ("", "namespaces") => vec!["status.phase".into()],
            _ => Vec::new(),
        };
        v.extend(self.selectable_fields.iter().cloned());
        v
    }
}

fn col(name: &str, type_: &str, json_path: &str, priority: i64) -> Column {
    Column {
        name: name.into(),
        type_: type_.into(),
        json_path: json_path.into(),
        priority,
        description: String::new(),
    }
}

#[allow(clippy::too_many_arguments)]
fn builtin(
    group: &str,
    version: &str,
    plural: &str,
    kind: &str,
    namespaced: bool,
    short: &[&str],
    status: bool,
    columns: Vec<Column>,
) -> ResourceType {
    ResourceType {
        group: group.into(),
        version: version.into(),
        plural: plural.into(),
        singular: kind.to_lowercase(),
        kind: kind.into(),
        namespaced,
        short_names: short.iter().map(|s| s.to_string()).collect(),
        categories: Vec::new(),
        status_subresource: status,
        create_only: false,
        columns,
        selectable_fields: Vec::new(),
        schema: None,
        storage: true,
    }
}

/// The built-in resources this server serves.
pub fn builtins() -> Vec<ResourceType> {
    let mut pods = builtin(
        "",
        "v1",
        "pods",
        "Pod",
        true,
        &["po"],
        true,
        vec![
            col("Status", "string", ".status.phase", 0),
            col("Node", "string", ".spec.nodeName", 1),
        ],
    );
    pods.categories = vec!["all".into()];
    let mut v = vec![
        builtin(
            "",
            "v1",
            "namespaces",
            "Namespace",
            false,
            &["ns"],
            true,
            vec![col("Status", "string", ".status.phase", 0)],
        ),
        builtin(
            "",
            "v1",
            "nodes",
            "Node",
            false,
            &["no"],
            true,
            vec![col(
                "Version",
                "string",
                ".status.nodeInfo.kubeletVersion",
                0,
            )],
        ),
        pods,
        builtin(
            "",
            "v1",
            "configmaps",
            "ConfigMap",
            true,
            &["cm"],
            false,
            vec![],
        ),
        builtin(
            "",
            "v1",
            "secrets",
            "Secret",
            true,
            &[],
            false,
            vec![col("Type", "string", ".type", 0)],
        ),
        builtin(
            "",
            "v1",
            "events",
            "Event",
            true,
            &["ev"],
            false,
            vec![
                col("Type", "string", ".type", 0),
                col("Reason", "string", ".reason", 0),
                col("Message", "string", ".message", 0),
            ],
        ),
        builtin(
            "",
            "v1",
            "serviceaccounts",
            "ServiceAccount",
            true,
            &["sa"],
            false,
            vec![],
        ),
        builtin(
            "events.k8s.io",
            "v1",
            "events",
            "Event",
            true,
            &["ev"],
            false,
            vec![
                col("Type", "string", ".type", 0),
                col("Reason", "string", ".reason", 0),
                col("Note", "string", ".note", 0),
            ],
        ),
        builtin(
            "coordination.k8s.io",
            "v1",
            "leases",
            "Lease",
            true,
            &[],
            false,
            vec![col("Holder", "string", ".spec.holderIdentity", 0)],
        ),
        builtin(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            false,
            &["crd", "crds"],
            true,
            vec![],
        ),
    ];
    for (group, plural, kind) in [
        ("authentication.k8s.io", "tokenreviews", "TokenReview"),
        (
            "authorization.k8s.io",
            "subjectaccessreviews",
            "SubjectAccessReview",
        ),
    ] {
        let mut r = builtin(group, "v1", plural, kind, false, &[], false, vec![]);
        r.create_only = true;
        v.push(r);
    }
    v
}

/// Every resource type currently served, by group, version and plural.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    types: BTreeMap<(String, String, String), Arc<ResourceType>>,
}

impl Registry {
    /// A registry holding the built-ins.
    pub fn with_builtins() -> Self {
        let mut r = Self::default();
        for t in builtins() {
            r.insert(t);
        }
        r
    }

    /// Adds or replaces a type.
    pub fn insert(&mut self, t: ResourceType) {
        self.types.insert(
            (t.group.clone(), t.version.clone(), t.plural.clone()),
            Arc::new(t),
        );
    }

    /// Removes every version of `group`/`plural`.
    pub fn remove(&mut self, group: &str, plural: &str) {
        self.types
            .retain(|(g, _, p), _| !(g == group && p == plural));
    }

    /// Finds a type by its path components.
    pub fn get(&self, group: &str, version: &str, plural: &str) -> Option<Arc<ResourceType>> {
        self.types
            .get(&(group.to_string(), version.to_string(), plural.to_string()))
            .cloned()
    }

    /// The storage version of `group`/`plural` (what ownerReference and GC look up).
    pub fn storage_of(&self, group: &str, plural: &str) -> Option<Arc<ResourceType>> {
        self.types
            .iter()
            .filter(|((g, _, p), _)| g == group && p == plural)
            .map(|(_, t)| t.clone())
            .max_by_key(|t| t.storage)
    }

    /// All served types.
    pub fn all(&self) -> impl Iterator<Item = &Arc<ResourceType>> {
        self.types.values()
    }
}
