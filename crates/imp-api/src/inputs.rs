//! A VM's inputs from other objects: the Secrets and ConfigMaps its environment, user data and
//! image pull secrets name, and the pull secret of a registry snapshot. A node reads them only
//! for the VMs placed on it, as the Kubernetes Node authorizer lets a kubelet read only what
//! the Pods bound to it refer to: the agent holds no right to read any Secret or ConfigMap; it
//! asks the operator's gateway for `…/namespaces/{ns}/impvms/{name}/inputs` (or
//! `impvmsnapshots/{name}/inputs`) through the API server with its own token, the API server
//! names the node the token is bound to (`authentication.kubernetes.io/node-name`) to the
//! gateway, and the gateway answers only when the object is on that node ([`vm_readable_by`],
//! [`snapshot_readable_by`]), with only what the object names ([`of_vm`], [`of_snapshot`]).
//!
//! Here: the wire format ([`Inputs`]), the paths, which names an object refers to, and who may
//! read them. Pure.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::ByteString;
use serde::{Deserialize, Serialize};

use crate::snapshot::ImpVMSnapshot;
use crate::vm::{ImpVM, ImpVMSpec};

/// The aggregated API group the gateway serves the inputs in.
pub const GROUP: &str = "subresources.imp.dev";
/// Its version.
pub const VERSION: &str = "v1alpha1";
/// The user's extra key under which the API server names the node a ServiceAccount token is
/// bound to (through the Pod it is bound to).
pub const NODE_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// The node agents' ServiceAccount (in the agents' namespace), as the chart names it.
pub const AGENT_SERVICE_ACCOUNT: &str = "imp-agent";

/// The user name of the node agents' ServiceAccount in `namespace`: the only caller the
/// gateway hands inputs to.
pub fn agents_user(namespace: &str) -> String {
    format!("system:serviceaccount:{namespace}:{AGENT_SERVICE_ACCOUNT}")
}

/// The path (through the API server) of VM `namespace/name`'s inputs.
pub fn vm_path(namespace: &str, name: &str) -> String {
    format!("/apis/{GROUP}/{VERSION}/namespaces/{namespace}/impvms/{name}/inputs")
}

/// The path (through the API server) of snapshot execution `namespace/name`'s inputs.
pub fn snapshot_path(namespace: &str, name: &str) -> String {
    format!("/apis/{GROUP}/{VERSION}/namespaces/{namespace}/impvmsnapshots/{name}/inputs")
}

/// What the gateway answers: the data of every Secret and ConfigMap the object names, by name,
/// in the object's namespace. An object that does not exist is absent from its map (the node
/// says so, naming the field that refers to it, as it did when it read them itself).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inputs {
    /// Secret name → key → value (base64 in JSON, as Kubernetes writes a Secret's data).
    #[serde(default)]
    pub secrets: BTreeMap<String, BTreeMap<String, ByteString>>,
    /// ConfigMap name → its data.
    #[serde(default)]
    pub config_maps: BTreeMap<String, ConfigMapData>,
}

/// A ConfigMap's text data, and the keys it holds in `binaryData` (their values are not
/// handed out: nothing on the node reads them, and an error names them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapData {
    /// Key → value.
    #[serde(default)]
    pub data: BTreeMap<String, String>,
    /// The keys of `binaryData`.
    #[serde(default)]
    pub binary_keys: Vec<String>,
}

/// The names of the Secrets and ConfigMaps an object refers to, in its namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct References {
    /// Secret names.
    pub secrets: BTreeSet<String>,
    /// ConfigMap names.
    pub config_maps: BTreeSet<String>,
}

impl References {
    /// Whether the object refers to nothing (a node then has nothing to ask for).
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty() && self.config_maps.is_empty()
    }
}

/// What a VM's spec refers to: `env[].valueFrom` and `envFrom` Secrets and ConfigMaps,
/// `userData.configMapRef`, `imagePullSecrets`.
pub fn of_vm(spec: &ImpVMSpec) -> References {
    let mut r = References::default();
    for f in &spec.env_from {
        if let Some(s) = &f.secret_ref {
            r.secrets.insert(s.name.clone());
        }
        if let Some(c) = &f.config_map_ref {
            r.config_maps.insert(c.name.clone());
        }
    }
    for from in spec.env.iter().filter_map(|e| e.value_from.as_ref()) {
        if let Some(s) = &from.secret_key_ref {
            r.secrets.insert(s.name.clone());
        }
        if let Some(c) = &from.config_map_key_ref {
            r.config_maps.insert(c.name.clone());
        }
    }
    if let Some(c) = spec
        .user_data
        .as_ref()
        .and_then(|u| u.config_map_ref.as_ref())
    {
        r.config_maps.insert(c.name.clone());
    }
    for s in &spec.image_pull_secrets {
        r.secrets.insert(s.name.clone());
    }
    r
}

/// What a snapshot execution refers to: `storage.ociRegistry.pullSecretRef`.
pub fn of_snapshot(exec: &ImpVMSnapshot) -> References {
    let mut r = References::default();
    let secret = exec
        .spec
        .storage
        .oci_registry
        .as_ref()
        .and_then(|o| o.pull_secret_ref.as_ref());
    if let Some(s) = secret.filter(|s| !s.name.is_empty()) {
        r.secrets.insert(s.name.clone());
    }
    r
}

/// The spec a VM's node runs it with: the booked one (the operator's record when it placed
/// the VM), else its own.
pub fn running_spec(vm: &ImpVM) -> &ImpVMSpec {
    vm.status
        .as_ref()
        .and_then(|s| s.booking.as_ref())
        .map_or(&vm.spec, |b| &b.spec)
}

/// The node a VM is on: where its status says it runs, else where it is placed.
pub fn node_of(vm: &ImpVM) -> Option<&str> {
    vm.status
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .or(vm.spec.node_name.as_deref())
}

/// Whether `node` may read VM `vm`'s inputs: only the node it is on, and only once the
/// operator booked it there. The refusal names the VM's node.
pub fn vm_readable_by(vm: &ImpVM, node: &str) -> Result<(), String> {
    let booked = vm.status.as_ref().is_some_and(|s| s.booking.is_some());
    match node_of(vm) {
        _ if node.is_empty() => Err("the caller's token is bound to no node".to_owned()),
        Some(n) if n == node && booked => Ok(()),
        Some(n) if n == node => Err(format!("the VM is not booked on node {node} yet")),
        Some(n) => Err(format!("the VM is on node {n}, not {node}")),
        None => Err("the VM is on no node".to_owned()),
    }
}

/// Whether `node` may read snapshot execution `exec`'s inputs: the node of its source VM
/// (which takes and pushes it), the node that holds its files (which deletes them), and the
/// node of a VM of its namespace restoring from it (`spec.snapshotRef`, which pulls it).
/// `vms` are the VMs of the execution's namespace.
pub fn snapshot_readable_by(exec: &ImpVMSnapshot, vms: &[ImpVM], node: &str) -> Result<(), String> {
    if node.is_empty() {
        return Err("the caller's token is bound to no node".to_owned());
    }
    let namespace = exec.metadata.namespace.as_deref().unwrap_or_default();
    let name = exec.metadata.name.as_deref().unwrap_or_default();
    let in_namespace = |vm: &&ImpVM| vm.metadata.namespace.as_deref() == Some(namespace);
    let on_node = |vm: &&ImpVM| node_of(vm) == Some(node);
    // Its source is a VM of its own namespace (`sourceVMNamespace` empty or the same).
    let own =
        exec.spec.source_vm_namespace.is_empty() || exec.spec.source_vm_namespace == namespace;
    let source = own
        && vms
            .iter()
            .filter(in_namespace)
            .filter(on_node)
            .any(|vm| vm.metadata.name.as_deref() == Some(exec.spec.source_vm_name.as_str()));
    let holder = exec
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(crate::shared::ANNOTATION_SNAPSHOT_NODE))
        .is_some_and(|n| n == node);
    let restorer = vms
        .iter()
        .filter(in_namespace)
        .filter(on_node)
        .any(|vm| running_spec(vm).snapshot_ref.as_deref() == Some(name));
    if source || holder || restorer {
        Ok(())
    } else {
        Err(format!(
            "no VM of node {node} takes, holds or restores from snapshot {namespace}/{name}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(v: serde_json::Value) -> ImpVM {
        serde_json::from_value(v).unwrap()
    }

    fn exec(v: serde_json::Value) -> ImpVMSnapshot {
        serde_json::from_value(v).unwrap()
    }

    fn booked(name: &str, node: &str, spec: serde_json::Value) -> ImpVM {
        vm(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": "team"},
            "spec": {},
            "status": {"nodeName": node, "booking": {"class": {"vcpu": 1, "memoryMiB": 128, "diskGiB": 1}, "spec": spec}}
        }))
    }

    #[test]
    fn a_vm_refers_to_its_env_user_data_and_pull_secrets() {
        let spec: ImpVMSpec = serde_json::from_value(json!({
            "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s1", "key": "k"}}},
                    {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c1", "key": "k"}}},
                    {"name": "C", "value": "plain"}],
            "envFrom": [{"secretRef": {"name": "s2"}}, {"configMapRef": {"name": "c2"}}],
            "userData": {"configMapRef": {"name": "init"}},
            "imagePullSecrets": [{"name": "pull"}]
        }))
        .unwrap();
        let r = of_vm(&spec);
        assert_eq!(
            r.secrets.iter().map(String::as_str).collect::<Vec<_>>(),
            ["pull", "s1", "s2"]
        );
        assert_eq!(
            r.config_maps.iter().map(String::as_str).collect::<Vec<_>>(),
            ["c1", "c2", "init"]
        );
        assert!(of_vm(&ImpVMSpec::default()).is_empty());
    }

    #[test]
    fn only_the_node_a_booked_vm_is_on_reads_its_inputs() {
        let v = booked("web", "node-a", json!({}));
        assert_eq!(vm_readable_by(&v, "node-a"), Ok(()));
        assert_eq!(
            vm_readable_by(&v, "node-b").unwrap_err(),
            "the VM is on node node-a, not node-b"
        );
        assert!(
            vm_readable_by(&v, "")
                .unwrap_err()
                .contains("bound to no node")
        );
        // Pinned by its user but not booked yet: not even its node.
        let pinned = vm(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "p", "namespace": "team"}, "spec": {"nodeName": "node-a"}
        }));
        assert!(
            vm_readable_by(&pinned, "node-a")
                .unwrap_err()
                .contains("not booked")
        );
        let nowhere = vm(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "n", "namespace": "team"}, "spec": {}
        }));
        assert!(vm_readable_by(&nowhere, "node-a").is_err());
    }

    #[test]
    fn a_snapshots_pull_secret_goes_to_its_taker_holder_and_restorers_only() {
        let e = exec(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
            "metadata": {"name": "snap-1", "namespace": "team",
                         "annotations": {"imp.dev/snapshot-node": "node-h"}},
            "spec": {"sourceVMName": "src", "sourceVMNamespace": "team",
                     "storage": {"type": "oci-registry", "ociRegistry":
                        {"repository": "r.example/x", "pullSecretRef": {"name": "reg"}}}}
        }));
        assert_eq!(
            of_snapshot(&e).secrets.into_iter().collect::<Vec<_>>(),
            ["reg"]
        );
        let vms = [
            booked("src", "node-s", json!({})),
            booked("clone", "node-r", json!({"snapshotRef": "snap-1"})),
            booked("other", "node-o", json!({"snapshotRef": "snap-2"})),
        ];
        for node in ["node-s", "node-h", "node-r"] {
            assert_eq!(snapshot_readable_by(&e, &vms, node), Ok(()), "{node}");
        }
        let refused = snapshot_readable_by(&e, &vms, "node-o").unwrap_err();
        assert!(
            refused.contains("node node-o") && refused.contains("team/snap-1"),
            "{refused}"
        );
        assert!(snapshot_readable_by(&e, &vms, "").is_err());
        // An empty sourceVMNamespace is the execution's own.
        let mut unnamed = e.clone();
        unnamed.spec.source_vm_namespace = String::new();
        assert_eq!(snapshot_readable_by(&unnamed, &vms, "node-s"), Ok(()));
        // Another namespace's VM of that name is not its source, nor is a VM elsewhere.
        let mut foreign = e.clone();
        foreign.spec.source_vm_namespace = "other".into();
        foreign.metadata.annotations = None;
        assert!(snapshot_readable_by(&foreign, &vms, "node-s").is_err());
        // A VM of the same name in another namespace is not its source.
        let mut elsewhere = booked("src", "node-x", json!({}));
        elsewhere.metadata.namespace = Some("other".into());
        assert!(snapshot_readable_by(&e, &[elsewhere], "node-x").is_err());
    }
}
