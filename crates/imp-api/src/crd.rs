//! CRD generation: every kind's CustomResourceDefinition, as objects or one YAML stream.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
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

/// All ten CRDs, in a stable order.
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
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
    ]
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
