//! A CRD generated the way imp generates its own (kube-derive + schemars): registered through
//! the typed CRD API, then used through a typed `Api`, with schema and CEL validation.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use imp_testkube::TestKube;

/// How fast a gadget goes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub enum Mode {
    /// Fast.
    #[default]
    Fast,
    /// Slow.
    Slow,
}

/// Spec of the test Gadget.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug)]
#[kube(
    group = "test.imp.dev",
    version = "v1alpha1",
    kind = "Gadget",
    namespaced,
    status = "GadgetStatus",
    shortname = "gd",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#
)]
#[x_kube(validation = Rule::new("!has(self.maxVcpu) || self.vcpu <= self.maxVcpu").message("vcpu must not exceed maxVcpu"))]
#[serde(rename_all = "camelCase")]
pub struct GadgetSpec {
    /// Virtual CPUs.
    #[schemars(range(min = 1, max = 64))]
    pub vcpu: u32,
    /// Upper bound for vcpu. (Without `skip_serializing_if`, kube sends `null`, which a
    /// nullable field keeps and `has()` then sees, exactly as on a real API server.)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_vcpu: Option<u32>,
    /// Image reference.
    #[schemars(length(min = 1))]
    pub image: String,
    /// Mode.
    #[serde(default)]
    pub mode: Mode,
    /// Port by number or name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<IntOrString>,
    /// Labels for the guest.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Set once.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("owner is immutable"))]
    pub owner: Option<String>,
}

/// Status of the test Gadget.
#[derive(Serialize, Deserialize, Clone, Debug, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GadgetStatus {
    /// Phase.
    pub phase: Option<String>,
    /// Last generation seen.
    pub observed_generation: Option<i64>,
}

fn gadget(name: &str, spec: serde_json::Value) -> Gadget {
    serde_json::from_value(json!({"apiVersion": "test.imp.dev/v1alpha1", "kind": "Gadget", "metadata": {"name": name}, "spec": spec})).unwrap()
}

#[tokio::test]
async fn derived_crd_round_trip() {
    let k = TestKube::start().await.unwrap();
    let c = k.client().await.unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(c.clone());
    let crd = crds
        .create(&PostParams::default(), &Gadget::crd())
        .await
        .unwrap();
    assert!(
        crd.status
            .unwrap()
            .conditions
            .unwrap()
            .iter()
            .any(|c| c.type_ == "Established")
    );

    let api: Api<Gadget> = Api::default_namespaced(c.clone());
    let g = api
        .create(
            &PostParams::default(),
            &gadget("g1", json!({"vcpu": 2, "image": "busybox", "port": "http"})),
        )
        .await
        .unwrap();
    assert_eq!(g.spec.mode, Mode::Fast);
    assert_eq!(g.spec.port, Some(IntOrString::String("http".into())));

    // Invalid objects go through the dynamic API: the typed one cannot even hold some of them.
    let ar = kube::api::ApiResource::erase::<Gadget>(&());
    let dynamic: Api<kube::api::DynamicObject> = Api::namespaced_with(c.clone(), "default", &ar);
    let invalid = |spec: serde_json::Value| {
        let api = dynamic.clone();
        let obj: kube::api::DynamicObject = serde_json::from_value(json!({"apiVersion": "test.imp.dev/v1alpha1", "kind": "Gadget", "metadata": {"name": "bad"}, "spec": spec})).unwrap();
        async move {
            match api.create(&PostParams::default(), &obj).await {
                Err(kube::Error::Api(s)) => {
                    assert_eq!(s.code, 422, "{s:?}");
                    s.message
                }
                other => panic!("expected 422, got {other:?}"),
            }
        }
    };
    assert_eq!(
        invalid(json!({"vcpu": 0, "image": "x"})).await,
        "Gadget.test.imp.dev \"bad\" is invalid: spec.vcpu: Invalid value: 0: spec.vcpu in body should be greater than or equal to 1"
    );
    assert!(
        invalid(json!({"vcpu": 4, "maxVcpu": 2, "image": "x"}))
            .await
            .contains("spec: Invalid value: \"object\": vcpu must not exceed maxVcpu")
    );
    assert!(
        invalid(json!({"vcpu": 1, "image": "x", "mode": "Turbo"}))
            .await
            .contains("spec.mode: Unsupported value: \"Turbo\"")
    );
    assert!(
        invalid(json!({"vcpu": 1, "image": ""}))
            .await
            .contains("spec.image")
    );

    // Status through the subresource, generation on spec changes.
    let st = api
        .patch_status("g1", &PatchParams::apply("imp-test").force(), &Patch::Apply(json!({
            "apiVersion": "test.imp.dev/v1alpha1", "kind": "Gadget", "status": {"phase": "Running", "observedGeneration": 1}})))
        .await
        .unwrap();
    assert_eq!(st.status.unwrap().phase.as_deref(), Some("Running"));
    let g = api
        .patch(
            "g1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"vcpu": 3}})),
        )
        .await
        .unwrap();
    assert_eq!(g.metadata.generation, Some(2));
    assert_eq!(g.status.unwrap().phase.as_deref(), Some("Running"));
    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);

    // Transition rule on an optional field.
    api.patch(
        "g1",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"owner": "me"}})),
    )
    .await
    .unwrap();
    let err = api
        .patch(
            "g1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"owner": "you"}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(s) if s.code == 422 && s.message.contains("owner is immutable"))
    );
}
