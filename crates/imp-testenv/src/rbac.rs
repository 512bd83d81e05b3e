//! imp's own RBAC on a test control plane: the ClusterRoles and Roles the product ships
//! (`charts/imp/files/rbac/*.yaml`, the one place they are written), a ServiceAccount per
//! component bound to its roles (a ClusterRole cluster-wide, a Role in the install namespace),
//! and kubeconfigs with those ServiceAccounts' tokens, so the operator and the agents run in the
//! tests with exactly the permissions they get in a cluster and a missing rule fails a test.
//! The agent's admission policy (`charts/imp/files/policy/agent.yaml`: its writes only for its
//! own node) and the operator's (`charts/imp/files/policy/operator.yaml`: its Pods only
//! reservation Pods of [`RESERVATION_IMAGE`]) are applied with them, and an agent gets the
//! token of a stand-in Pod bound to its node ([`agent_kubeconfig_for`]), as the DaemonSet's
//! Pod has in a cluster.

use std::path::PathBuf;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, Role, RoleBinding, RoleRef, Subject,
};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde::Deserialize as _;

use crate::controlplane::{ControlPlane, Error};

/// The operator's ClusterRole and its Role in the install namespace, as the chart ships them.
pub const OPERATOR_ROLE: &str = include_str!("../../../charts/imp/files/rbac/operator.yaml");
/// The agent's ClusterRole, as the chart ships it.
pub const AGENT_ROLE: &str = include_str!("../../../charts/imp/files/rbac/agent.yaml");

/// The agent's ValidatingAdmissionPolicy and its binding, as the chart ships them (with
/// [`POLICY_NAMESPACE`] where the install namespace goes).
pub const AGENT_POLICY: &str = include_str!("../../../charts/imp/files/policy/agent.yaml");

/// What [`AGENT_POLICY`] holds in place of the install namespace (the chart replaces it too).
pub const POLICY_NAMESPACE: &str = "${RELEASE_NAMESPACE}";

/// The operator's ValidatingAdmissionPolicy (its Pods only reservation Pods) and its binding,
/// as the chart ships them (with [`POLICY_NAMESPACE`] and [`POLICY_RESERVATION_IMAGE`]).
pub const OPERATOR_POLICY: &str = include_str!("../../../charts/imp/files/policy/operator.yaml");

/// What [`OPERATOR_POLICY`] holds in place of the reservation image (the chart puts
/// `operator.reservations.image` there).
pub const POLICY_RESERVATION_IMAGE: &str = "${RESERVATION_IMAGE}";

/// The reservation image the harness admits for the operator: `imp operator`'s default
/// (`imp_operator::placement::reservation::DEFAULT_IMAGE`), which the tests run it with.
pub const RESERVATION_IMAGE: &str = "registry.k8s.io/pause:3.10";

/// The agent's ServiceAccount, in the install namespace.
pub const AGENT_SA: &str = "imp-agent";

/// How long a node-bound agent token is valid (longer than any test).
const AGENT_TOKEN_SECONDS: i64 = 24 * 3600;

/// The roles for people (imp-view, imp-edit, imp-admin, imp-cli), as the chart ships them.
pub const USER_ROLES: &str = include_str!("../../../charts/imp/files/rbac/users.yaml");

/// The field manager of what the harness applies.
const MANAGER: &str = "imp-testenv";

/// Kubeconfigs of imp's components, each with its own ServiceAccount's token.
#[derive(Debug, Clone)]
pub struct Identities {
    /// `imp-operator` in the install namespace.
    pub operator: PathBuf,
    /// `imp-agent` in the install namespace.
    pub agent: PathBuf,
}

/// The roles of one of the chart's RBAC files.
#[derive(Debug, Clone, Default)]
pub struct Roles {
    /// Its ClusterRoles.
    pub cluster: Vec<ClusterRole>,
    /// Its Roles, without a namespace: the installer puts them in the install namespace.
    pub namespaced: Vec<Role>,
}

/// Parses a file of the chart's RBAC: ClusterRole and Role documents, nothing else.
pub fn roles(yaml: &str) -> Result<Roles, serde_yaml_ng::Error> {
    let mut out = Roles::default();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value = serde_yaml_ng::Value::deserialize(doc)?;
        if value.is_null() {
            continue;
        }
        match value.get("kind").and_then(serde_yaml_ng::Value::as_str) {
            Some("ClusterRole") => out.cluster.push(serde_yaml_ng::from_value(value)?),
            Some("Role") => out.namespaced.push(serde_yaml_ng::from_value(value)?),
            other => {
                return Err(serde::de::Error::custom(format!(
                    "a document of kind {other:?}: only ClusterRole and Role belong there"
                )));
            }
        }
    }
    Ok(out)
}

/// The first ClusterRole of one of the chart's RBAC files.
pub fn cluster_role(yaml: &str) -> Result<ClusterRole, serde_yaml_ng::Error> {
    roles(yaml)?
        .cluster
        .into_iter()
        .next()
        .ok_or_else(|| serde::de::Error::custom("no ClusterRole document"))
}

/// Applies `role` (server-side apply: the same content again changes nothing).
pub async fn apply_role(client: &kube::Client, role: &ClusterRole) -> Result<(), Error> {
    let name = role.metadata.name.clone().unwrap_or_default();
    let api: Api<ClusterRole> = Api::all(client.clone());
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(role),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::Kube {
        what: format!("applying ClusterRole {name}"),
        source,
    })
}

/// Binds ClusterRole `role` to ServiceAccount `namespace/sa` (a binding named as the role).
pub async fn bind(
    client: &kube::Client,
    role: &str,
    namespace: &str,
    sa: &str,
) -> Result<(), Error> {
    let name = role.to_owned();
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: sa.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        }]),
    };
    let api: Api<ClusterRoleBinding> = Api::all(client.clone());
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&binding),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::Kube {
        what: format!("binding ClusterRole {role} to {namespace}/{sa}"),
        source,
    })
}

/// Installs imp's roles, makes ServiceAccounts `imp-operator` and `imp-agent` in `namespace`,
/// binds them (each ClusterRole, renamed `<name>-<namespace>`, with a ClusterRoleBinding; each
/// Role in `namespace` with a RoleBinding of its name), and returns kubeconfigs with their
/// tokens.
pub async fn install(cp: &ControlPlane, namespace: &str) -> Result<Identities, Error> {
    install_roles(cp, namespace, OPERATOR_ROLE, AGENT_ROLE).await
}

/// As [`install`], with the roles given as YAML (a test that drops a rule passes its own).
pub async fn install_roles(
    cp: &ControlPlane,
    namespace: &str,
    operator_yaml: &str,
    agent_yaml: &str,
) -> Result<Identities, Error> {
    let client = cp.admin().await?;
    cp.ensure_namespace(&client, namespace).await?;
    let mut out = Vec::new();
    for (yaml, sa) in [(operator_yaml, "imp-operator"), (agent_yaml, "imp-agent")] {
        let parsed = roles(yaml).map_err(|e| Error::Io {
            op: "parsing the roles of",
            path: PathBuf::from(sa),
            source: std::io::Error::other(e),
        })?;
        for mut role in parsed.cluster {
            // One role per install namespace, so tests that bind different rules do not meet.
            let role_name = format!(
                "{}-{namespace}",
                role.metadata.name.clone().unwrap_or_default()
            );
            role.metadata.name = Some(role_name.clone());
            apply_role(&client, &role).await?;
            bind(&client, &role_name, namespace, sa).await?;
        }
        for role in parsed.namespaced {
            apply_namespaced_role(&client, namespace, role, sa).await?;
        }
        out.push(cp.service_account_kubeconfig(namespace, sa).await?);
    }
    apply_agent_policy(&client, namespace).await?;
    apply_operator_policy(&client, namespace, RESERVATION_IMAGE).await?;
    crate::aggregation::bind_auth_reader(&client, namespace, "imp-operator").await?;
    let agent = out.pop().unwrap_or_default();
    let operator = out.pop().unwrap_or_default();
    Ok(Identities { operator, agent })
}

/// Applies `role` in `namespace` and binds it there to ServiceAccount `namespace/sa` with a
/// RoleBinding of the role's name (as the chart does in the release namespace).
pub async fn apply_namespaced_role(
    client: &kube::Client,
    namespace: &str,
    mut role: Role,
    sa: &str,
) -> Result<(), Error> {
    let name = role.metadata.name.clone().unwrap_or_default();
    role.metadata.namespace = Some(namespace.to_owned());
    let kube_err = |what: String| move |source| Error::Kube { what, source };
    Api::<Role>::namespaced(client.clone(), namespace)
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&role),
        )
        .await
        .map_err(kube_err(format!("applying Role {namespace}/{name}")))?;
    let binding = RoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.to_owned()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: sa.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&binding),
        )
        .await
        .map_err(kube_err(format!(
            "binding Role {namespace}/{name} to {namespace}/{sa}"
        )))?;
    Ok(())
}

/// The documents of [`AGENT_POLICY`] for an install in `namespace`: the namespace put in, and
/// (as the harness does with ClusterRoles) each name suffixed `-<namespace>`, so installs in
/// several namespaces of one control plane each have their own.
pub fn agent_policy(namespace: &str) -> Result<Vec<serde_json::Value>, serde_yaml_ng::Error> {
    policy_documents(
        &AGENT_POLICY.replace(POLICY_NAMESPACE, namespace),
        namespace,
    )
}

/// The documents of [`OPERATOR_POLICY`] for an install in `namespace` whose operator makes
/// reservation Pods of `image`, named as [`agent_policy`]'s are.
pub fn operator_policy(
    namespace: &str,
    image: &str,
) -> Result<Vec<serde_json::Value>, serde_yaml_ng::Error> {
    let text = OPERATOR_POLICY
        .replace(POLICY_NAMESPACE, namespace)
        .replace(POLICY_RESERVATION_IMAGE, image);
    policy_documents(&text, namespace)
}

/// The policy and binding documents of `text`, each name suffixed `-<namespace>`.
fn policy_documents(
    text: &str,
    namespace: &str,
) -> Result<Vec<serde_json::Value>, serde_yaml_ng::Error> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let mut value = serde_json::Value::deserialize(doc)?;
        if value.is_null() {
            continue;
        }
        let suffixed = |v: &serde_json::Value| format!("{}-{namespace}", v.as_str().unwrap_or(""));
        match value["kind"].as_str() {
            Some("ValidatingAdmissionPolicy") => {}
            Some("ValidatingAdmissionPolicyBinding") => {
                value["spec"]["policyName"] = suffixed(&value["spec"]["policyName"]).into();
            }
            other => {
                return Err(serde::de::Error::custom(format!(
                    "a document of kind {other:?}: only the policy and its binding belong there"
                )));
            }
        }
        value["metadata"]["name"] = suffixed(&value["metadata"]["name"]).into();
        out.push(value);
    }
    Ok(out)
}

/// Applies [`agent_policy`] for `namespace` (server-side apply). The API server enforces it
/// once its policy informer has seen it, a moment later.
pub async fn apply_agent_policy(client: &kube::Client, namespace: &str) -> Result<(), Error> {
    let docs = agent_policy(namespace).map_err(|e| Error::Io {
        op: "parsing the policy of",
        path: PathBuf::from("charts/imp/files/policy/agent.yaml"),
        source: std::io::Error::other(e),
    })?;
    apply_policy(client, docs).await
}

/// Applies [`operator_policy`] for `namespace` and `image` (server-side apply), enforced a
/// moment later as [`apply_agent_policy`]'s.
pub async fn apply_operator_policy(
    client: &kube::Client,
    namespace: &str,
    image: &str,
) -> Result<(), Error> {
    let docs = operator_policy(namespace, image).map_err(|e| Error::Io {
        op: "parsing the policy of",
        path: PathBuf::from("charts/imp/files/policy/operator.yaml"),
        source: std::io::Error::other(e),
    })?;
    apply_policy(client, docs).await
}

/// Applies policy and binding documents (server-side apply).
async fn apply_policy(client: &kube::Client, docs: Vec<serde_json::Value>) -> Result<(), Error> {
    for doc in docs {
        let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", &kind);
        let plural = match kind.as_str() {
            "ValidatingAdmissionPolicy" => "validatingadmissionpolicies",
            _ => "validatingadmissionpolicybindings",
        };
        let api: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &ApiResource::from_gvk_with_plural(&gvk, plural),
        );
        api.patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&doc),
        )
        .await
        .map_err(|source| Error::Kube {
            what: format!("applying {kind} {name}"),
            source,
        })?;
    }
    Ok(())
}

/// The name of the stand-in Pod whose token an agent of `node` runs with.
pub fn agent_pod_name(node: &str) -> String {
    format!("{AGENT_SA}-{node}")
}

/// The stand-in of the agent DaemonSet's Pod on `node`: bound to the node by `spec.nodeName`,
/// running as ServiceAccount `imp-agent`, never run (no kubelet runs here), mounting no token.
fn agent_pod(node: &str) -> Pod {
    Pod {
        metadata: kube::api::ObjectMeta {
            name: Some(agent_pod_name(node)),
            labels: Some([("app.kubernetes.io/component".to_owned(), "agent".to_owned())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_owned()),
            service_account_name: Some(AGENT_SA.to_owned()),
            automount_service_account_token: Some(false),
            containers: vec![Container {
                name: "agent".into(),
                image: Some("registry.invalid/imp-agent".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// A kubeconfig for the agent of `node` installed in `namespace` (after [`install`]), whose
/// token is bound to Pod `imp-agent-<node>` there (created unless it exists; its
/// `spec.nodeName` is `node`), valid for a day: the API server then names the node in the
/// user's extra `authentication.kubernetes.io/node-name`, which [`AGENT_POLICY`] checks.
/// The Node need not exist. Deleting the Pod revokes the token.
pub async fn agent_kubeconfig_for(
    cp: &ControlPlane,
    namespace: &str,
    node: &str,
) -> Result<PathBuf, Error> {
    let client = cp.admin().await?;
    let kerr = |what: String| move |source| Error::Kube { what, source };
    let name = agent_pod_name(node);
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = match pods.create(&PostParams::default(), &agent_pod(node)).await {
        Err(kube::Error::Api(s)) if s.code == 409 => pods
            .get(&name)
            .await
            .map_err(kerr(format!("reading Pod {namespace}/{name}")))?,
        other => other.map_err(kerr(format!("creating Pod {namespace}/{name}")))?,
    };
    let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if bound_to != Some(node) {
        return Err(Error::Io {
            op: "binding a token to",
            path: PathBuf::from(format!("{namespace}/{name}")),
            source: std::io::Error::other(format!(
                "the Pod's spec.nodeName is {bound_to:?}, not {node}"
            )),
        });
    }
    let mut req = TokenRequest::default();
    req.spec.expiration_seconds = Some(AGENT_TOKEN_SECONDS);
    req.spec.bound_object_ref = Some(BoundObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(name.clone()),
        uid: pod.metadata.uid.clone(),
    });
    let token = Api::<ServiceAccount>::namespaced(client, namespace)
        .create_token_request(AGENT_SA, &PostParams::default(), &req)
        .await
        .map_err(kerr(format!(
            "a token for ServiceAccount {namespace}/{AGENT_SA} bound to Pod {name}"
        )))?
        .status
        .map(|s| s.token)
        .unwrap_or_default();
    cp.token_kubeconfig(&format!("{namespace}-{name}"), &token, namespace)
}

/// Applies the roles for people ([`USER_ROLES`]).
pub async fn install_user_roles(client: &kube::Client) -> Result<(), Error> {
    for doc in serde_yaml_ng::Deserializer::from_str(USER_ROLES) {
        let role: ClusterRole = serde::Deserialize::deserialize(doc).map_err(|e| Error::Io {
            op: "parsing a ClusterRole of",
            path: PathBuf::from("charts/imp/files/rbac/users.yaml"),
            source: std::io::Error::other(e),
        })?;
        apply_role(client, &role).await?;
    }
    Ok(())
}

/// A person for the tests: ServiceAccount `namespace/name` (a token user, as `kubectl` and
/// `imp exec -n` send), given each ClusterRole of `roles` in `namespace` with a RoleBinding and
/// `imp-cli` cluster-wide; returns its kubeconfig.
pub async fn user(
    cp: &ControlPlane,
    namespace: &str,
    name: &str,
    roles: &[&str],
) -> Result<PathBuf, Error> {
    let client = cp.admin().await?;
    install_user_roles(&client).await?;
    let kubeconfig = cp.service_account_kubeconfig(namespace, name).await?;
    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: name.into(),
        namespace: Some(namespace.into()),
        ..Default::default()
    };
    let role_ref = |role: &str| RoleRef {
        api_group: "rbac.authorization.k8s.io".into(),
        kind: "ClusterRole".into(),
        name: role.into(),
    };
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    for role in roles {
        let b = RoleBinding {
            metadata: kube::api::ObjectMeta {
                name: Some(format!("{name}-{role}")),
                ..Default::default()
            },
            role_ref: role_ref(role),
            subjects: Some(vec![subject.clone()]),
        };
        bindings
            .patch(
                &format!("{name}-{role}"),
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&b),
            )
            .await
            .map_err(|source| Error::Kube {
                what: format!("binding {role} to {namespace}/{name}"),
                source,
            })?;
    }
    let cli = format!("imp-cli-{namespace}-{name}");
    let b = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(cli.clone()),
            ..Default::default()
        },
        role_ref: role_ref("imp-cli"),
        subjects: Some(vec![subject]),
    };
    Api::<ClusterRoleBinding>::all(client)
        .patch(
            &cli,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&b),
        )
        .await
        .map_err(|source| Error::Kube {
            what: format!("binding imp-cli to {namespace}/{name}"),
            source,
        })?;
    Ok(kubeconfig)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_agent_policy_is_bound_to_the_install_namespace_and_named_after_it() {
        assert!(AGENT_POLICY.contains(POLICY_NAMESPACE));
        let docs = agent_policy("ns1").unwrap();
        let kinds: Vec<_> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding"
            ]
        );
        assert_eq!(docs[0]["metadata"]["name"], "imp-agent-own-node-ns1");
        assert_eq!(docs[1]["metadata"]["name"], "imp-agent-own-node-ns1");
        assert_eq!(docs[1]["spec"]["policyName"], "imp-agent-own-node-ns1");
        let text = serde_json::to_string(&docs).unwrap();
        assert!(!text.contains(POLICY_NAMESPACE), "{text}");
        assert!(text.contains("system:serviceaccount:ns1:imp-agent"));
        assert_eq!(agent_pod_name("n1"), "imp-agent-n1");
        let pod = agent_pod("n1");
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert_eq!(spec.service_account_name.as_deref(), Some(AGENT_SA));
    }

    #[test]
    fn the_operator_policy_is_bound_to_the_install_namespace_and_the_reservation_image() {
        assert!(OPERATOR_POLICY.contains(POLICY_NAMESPACE));
        assert!(OPERATOR_POLICY.contains(POLICY_RESERVATION_IMAGE));
        let docs = operator_policy("ns1", "example.test/pause:1").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(
            docs[0]["metadata"]["name"],
            "imp-operator-reservation-pods-ns1"
        );
        assert_eq!(
            docs[1]["spec"]["policyName"],
            "imp-operator-reservation-pods-ns1"
        );
        let text = serde_json::to_string(&docs).unwrap();
        assert!(!text.contains("${"), "{text}");
        assert!(text.contains("system:serviceaccount:ns1:imp-operator"));
        assert!(text.contains("'example.test/pause:1'"));
    }

    #[test]
    fn the_charts_roles_parse_and_grant_something() {
        for (yaml, name) in [(OPERATOR_ROLE, "imp-operator"), (AGENT_ROLE, "imp-agent")] {
            let r = cluster_role(yaml).unwrap();
            assert_eq!(r.metadata.name.as_deref(), Some(name));
            assert!(!r.rules.unwrap_or_default().is_empty(), "{name} has rules");
        }
        // The operator's writes of Secrets are a Role of the install namespace; cluster-wide it
        // may only get them (for the agents of their VMs' nodes: gateway/inputs.rs).
        let operator = roles(OPERATOR_ROLE).unwrap();
        assert_eq!(operator.namespaced.len(), 1);
        let role = &operator.namespaced[0];
        assert_eq!(role.metadata.name.as_deref(), Some("imp-operator"));
        assert_eq!(role.metadata.namespace, None, "the installer sets it");
        let grants_secrets = |rules: &[k8s_openapi::api::rbac::v1::PolicyRule]| {
            rules
                .iter()
                .any(|r| r.resources.iter().flatten().any(|x| x == "secrets"))
        };
        assert!(grants_secrets(role.rules.as_deref().unwrap_or_default()));
        let cluster = operator.cluster[0].rules.as_deref().unwrap_or_default();
        assert!(grants_secrets(cluster));
        for rule in cluster
            .iter()
            .filter(|r| r.resources.iter().flatten().any(|x| x == "secrets"))
        {
            assert_eq!(
                rule.verbs,
                ["get"],
                "cluster-wide the operator only reads Secrets"
            );
        }
        // The agent reads no Secret at all.
        let agent = roles(AGENT_ROLE).unwrap();
        for r in &agent.cluster {
            assert!(!grants_secrets(r.rules.as_deref().unwrap_or_default()));
        }
        for r in &agent.namespaced {
            assert!(!grants_secrets(r.rules.as_deref().unwrap_or_default()));
        }
        assert!(roles("kind: Pod\n").is_err());
        let users: Vec<ClusterRole> = serde_yaml_ng::Deserializer::from_str(USER_ROLES)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect();
        let names: Vec<_> = users
            .iter()
            .filter_map(|r| r.metadata.name.clone())
            .collect();
        assert_eq!(
            names,
            [
                "imp-view",
                "imp-edit",
                "imp-admin",
                "imp-cli",
                "imp-metrics-reader"
            ]
        );
    }
}
