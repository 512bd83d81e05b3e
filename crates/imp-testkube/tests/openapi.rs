//! `/openapi/v2` and `/openapi/v3` over HTTP: built-ins from the start, a CRD's schema as soon as
//! it is created, protobuf when kubectl asks for it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

mod common;

use imp_testkube::TestKube;

const WIDGET: &str = "dev.imp.test.v1.Widget";

#[tokio::test]
async fn a_crd_created_at_run_time_shows_up_in_openapi() {
    let k = TestKube::start().await.unwrap();
    let (code, v2) = common::call(k.url(), "GET", "/openapi/v2", None).await;
    assert_eq!(code, 200, "{v2}");
    assert_eq!(v2["swagger"], "2.0");
    assert_eq!(
        v2["definitions"]["io.k8s.api.core.v1.ConfigMap"]["x-kubernetes-group-version-kind"],
        serde_json::json!([{"group": "", "version": "v1", "kind": "ConfigMap"}])
    );
    assert!(v2["definitions"].get(WIDGET).is_none(), "no CRD yet");
    let (_, v3) = common::call(k.url(), "GET", "/openapi/v3", None).await;
    assert!(
        v3["paths"]["api/v1"]["serverRelativeURL"].is_string(),
        "{v3}"
    );
    assert!(v3["paths"].get("apis/test.imp.dev/v1").is_none());
    let (code, _) = common::call(k.url(), "GET", "/openapi/v3/apis/test.imp.dev/v1", None).await;
    assert_eq!(code, 404);

    common::create_widget_crd(k.url()).await;

    let (_, v2) = common::call(k.url(), "GET", "/openapi/v2", None).await;
    let w = &v2["definitions"][WIDGET];
    assert_eq!(
        w["x-kubernetes-group-version-kind"],
        serde_json::json!([{"group": "test.imp.dev", "version": "v1", "kind": "Widget"}])
    );
    assert_eq!(
        w["properties"]["spec"]["required"],
        serde_json::json!(["image"])
    );
    assert_eq!(
        w["properties"]["metadata"]["$ref"],
        "#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    );
    assert!(
        v2["paths"]["/apis/test.imp.dev/v1/namespaces/{namespace}/widgets/{name}"]["patch"]
            .is_object()
    );

    let (_, v3) = common::call(k.url(), "GET", "/openapi/v3", None).await;
    let url = v3["paths"]["apis/test.imp.dev/v1"]["serverRelativeURL"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, doc) = common::call(k.url(), "GET", &url, None).await;
    assert_eq!(code, 200, "{doc}");
    assert_eq!(doc["openapi"], "3.0.0");
    let w = &doc["components"]["schemas"][WIDGET];
    assert_eq!(
        w["properties"]["spec"]["properties"]["note"]["nullable"],
        true
    );
    assert!(
        doc["components"]["schemas"]["io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"].is_object()
    );

    // kubectl asks for the gnostic protobuf; the answer's type must parse as a MIME type.
    let (code, head_and_body) = send_raw(
        k.url(),
        "/openapi/v2",
        "application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
    )
    .await;
    assert_eq!(code, 200);
    assert!(
        head_and_body
            .contains("content-type: application/com.github.proto-openapi.spec.v2.v1.0+protobuf"),
        "{}",
        &head_and_body[..300.min(head_and_body.len())]
    );
    assert!(head_and_body.contains(WIDGET));
    assert!(
        !head_and_body.contains("\"definitions\""),
        "protobuf, not JSON"
    );
}

/// GETs `path` with `accept` and returns the status and the lower-cased head plus the raw body.
async fn send_raw(base: &str, path: &str, accept: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, format!("{}\r\n\r\n{body}", head.to_ascii_lowercase()))
}
