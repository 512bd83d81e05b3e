//! CRD generation: every kind's CustomResourceDefinition, as objects or one YAML stream.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::CustomResourceExt;

use crate::{
    ClusterImpConfig, ClusterImpNodeProfile, ImpNetwork, ImpVM, ImpVMClass, ImpVMMigration,
    ImpVMRunnerPool, ImpVMSnapshot, ImpVMTemplate, ImpWarmPool,
};

/// Why the CRDs could not be rendered.
#[derive(Debug, thiserror::Error)]
#[error("rendering CRD {name} as YAML")]
pub struct RenderError {
    name: String,
    #[source]
    source: serde_yaml_ng::Error,
}

/// The annotation that makes `helm uninstall` (and an upgrade that drops a CRD) leave the
/// CRD, and with it every object of its kind, in place: the chart ships the CRDs as templates
/// so that `helm upgrade` updates them (Helm never touches its `crds/` directory after the first
/// install), and a template is otherwise deleted with its release.
pub const HELM_KEEP: (&str, &str) = ("helm.sh/resource-policy", "keep");

/// All ten CRDs, in a stable order, each annotated [`HELM_KEEP`].
pub fn all() -> Vec<CustomResourceDefinition> {
    let mut crds = vec![
        ImpVM::crd(),
        ImpVMClass::crd(),
        ImpVMTemplate::crd(),
        ImpNetwork::crd(),
        ImpVMSnapshot::crd(),
        ImpVMMigration::crd(),
        ImpWarmPool::crd(),
        ImpVMRunnerPool::crd(),
        ClusterImpConfig::crd(),
        ClusterImpNodeProfile::crd(),
    ];
    for crd in &mut crds {
        crd.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(HELM_KEEP.0.to_owned(), HELM_KEEP.1.to_owned());
        for v in &mut crd.spec.versions {
            if let Some(root) = v
                .schema
                .as_mut()
                .and_then(|s| s.open_api_v3_schema.as_mut())
            {
                go_shaped_root(root);
            }
        }
    }
    crds
}

/// Gives the root schema the shape of the Go project's: `apiVersion`, `kind` and `metadata`
/// declared (kube-derive leaves them implicit), and `spec` optional, since every spec type
/// deserialises an absent spec as its default.
fn go_shaped_root(root: &mut JSONSchemaProps) {
    let string = |description: &str| JSONSchemaProps {
        description: Some(description.to_owned()),
        type_: Some("string".to_owned()),
        ..Default::default()
    };
    let props = root.properties.get_or_insert_with(Default::default);
    props.insert(
        "apiVersion".to_owned(),
        string("APIVersion defines the versioned schema of this representation of an object."),
    );
    props.insert(
        "kind".to_owned(),
        string("Kind is a string value representing the REST resource this object represents."),
    );
    props.insert(
        "metadata".to_owned(),
        JSONSchemaProps {
            type_: Some("object".to_owned()),
            ..Default::default()
        },
    );
    if let Some(required) = root.required.as_mut() {
        required.retain(|r| r != "spec");
    }
    if root.required.as_ref().is_some_and(Vec::is_empty) {
        root.required = None;
    }
}

/// All CRDs as one multi-document YAML stream, as `imp crds` prints it.
pub fn yaml_stream() -> Result<String, RenderError> {
    let mut out = String::new();
    for crd in all() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let doc = serde_yaml_ng::to_string(&crd).map_err(|source| RenderError { name, source })?;
        out.push_str("---\n");
        out.push_str(&doc);
    }
    Ok(out)
}
