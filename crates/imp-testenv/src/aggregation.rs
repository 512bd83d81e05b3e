//! The gateway registered with the test control plane as the chart registers it
//! (`charts/imp/templates/gateway.yaml`): APIService `v1alpha1.subresources.imp.dev` naming
//! Service `<namespace>/imp-webhook`, whose serving certificate the operator makes and whose
//! `caBundle` it publishes. The test's operator runs as a process on this machine, so the
//! Service is an ExternalName one for `localhost` (the API server's aggregator dials
//! `localhost:<port>` and checks the certificate for `imp-webhook.<namespace>.svc`, as for a
//! ClusterIP Service); everything else is what a cluster has.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::{
    APIService, APIServiceSpec, ServiceReference,
};
use kube::Api;
use kube::api::{ObjectMeta, Patch, PatchParams};

use crate::controlplane::Error;

/// The APIService's name.
pub const API_SERVICE: &str = "v1alpha1.subresources.imp.dev";
/// The Service the APIService names (the operator's HTTPS listener).
pub const SERVICE: &str = "imp-webhook";

const MANAGER: &str = "imp-testenv";

/// Registers the gateway: the operator serves it on `localhost:port`, in `namespace`.
pub async fn register_gateway(
    client: &kube::Client,
    namespace: &str,
    port: u16,
) -> Result<(), Error> {
    let service = Service {
        metadata: ObjectMeta {
            name: Some(SERVICE.into()),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ExternalName".into()),
            external_name: Some("localhost".into()),
            ports: Some(vec![ServicePort {
                name: Some("webhook".into()),
                port: i32::from(port),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };
    let pp = PatchParams::apply(MANAGER).force();
    Api::<Service>::namespaced(client.clone(), namespace)
        .patch(SERVICE, &pp, &Patch::Apply(&service))
        .await
        .map_err(|source| Error::Kube {
            what: format!("applying Service {namespace}/{SERVICE}"),
            source,
        })?;
    let api_service = APIService {
        metadata: ObjectMeta {
            name: Some(API_SERVICE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(APIServiceSpec {
            group: Some("subresources.imp.dev".into()),
            version: Some("v1alpha1".into()),
            group_priority_minimum: 1000,
            version_priority: 15,
            service: Some(ServiceReference {
                name: Some(SERVICE.into()),
                namespace: Some(namespace.into()),
                port: Some(i32::from(port)),
            }),
            ..APIServiceSpec::default()
        }),
        ..APIService::default()
    };
    Api::<APIService>::all(client.clone())
        .patch(API_SERVICE, &pp, &Patch::Apply(&api_service))
        .await
        .map_err(|source| Error::Kube {
            what: format!("applying APIService {API_SERVICE}"),
            source,
        })?;
    Ok(())
}

/// Lets ServiceAccount `namespace/sa` read the API server's request-header settings
/// (kube-system's Role `extension-apiserver-authentication-reader`), as the chart's RoleBinding
/// `kube-system/imp-operator-auth-reader` does.
pub async fn bind_auth_reader(
    client: &kube::Client,
    namespace: &str,
    sa: &str,
) -> Result<(), Error> {
    let name = format!("imp-operator-auth-reader-{namespace}");
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some("kube-system".into()),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: "extension-apiserver-authentication-reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: sa.into(),
            namespace: Some(namespace.into()),
            ..Subject::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(client.clone(), "kube-system")
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&binding),
        )
        .await
        .map(drop)
        .map_err(|source| Error::Kube {
            what: format!("binding extension-apiserver-authentication-reader to {namespace}/{sa}"),
            source,
        })
}
