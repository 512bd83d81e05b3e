//! Pulling images from a real registry (Debian's docker-registry on loopback, images pushed with
//! skopeo): anonymous by tag and digest, basic auth, bearer tokens through a token proxy,
//! dockerconfigjson credentials, platform selection, corrupted blobs and the blob cache.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode};
use imp_image::{ImageSource, ImageStore, Limits, RegistryAuth, auth_from_docker_config};
use imp_testenv::registry::{TestImage, TestLayer, TestRegistry, push, scratch_dir, write_index};
use imp_testenv::report::chain;
use imp_testenv::require_tool;

/// True when every tool these tests run is present; skips locally, fails under CI.
fn tools() -> bool {
    ["docker-registry", "skopeo", "mkfs.ext4"].iter().all(|t| {
        imp_testenv::guard::require(
            imp_testenv::guard::which(t).is_some(),
            &format!("tool `{t}` on PATH"),
        )
    })
}

fn image() -> TestImage {
    TestImage::new()
        .layer(
            TestLayer::new()
                .dir("etc/", 0o755)
                .file("etc/hello", "hello\n", 0o644),
        )
        .layer(TestLayer::new().file("bin/tool", "#!/bin/sh\necho tool\n", 0o755))
        .entrypoint(&["/bin/tool"])
        .cmd(&["--serve"])
        .env("PATH=/bin")
        .working_dir("/srv")
        .user("1000:1000")
}

/// Writes `img` to a layout and pushes it as `repo:tag`; returns the manifest digest.
async fn publish(
    reg: &TestRegistry,
    img: &TestImage,
    repo: &str,
    tag: &str,
    creds: Option<(&str, &str)>,
) -> String {
    let layout = scratch_dir("imp-img-layout").unwrap();
    let w = img.write_layout(&layout, tag).unwrap();
    push(&layout, tag, &format!("{}/{repo}:{tag}", reg.host()), creds)
        .await
        .unwrap();
    std::fs::remove_dir_all(&layout).unwrap();
    w.digest
}

fn new_store() -> (ImageStore, std::path::PathBuf) {
    let dir = scratch_dir("imp-img-cache").unwrap();
    (ImageStore::new(dir.clone(), Limits::default()), dir)
}

#[tokio::test]
async fn pull_by_tag_then_digest_uses_the_cache() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let digest = publish(&reg, &image(), "app", "v1", None).await;
    let (store, dir) = new_store();
    let src: ImageSource = format!("{}/app:v1", reg.host()).parse().unwrap();
    let first = store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    // skopeo keeps the OCI manifest as is, so the registry serves the digest we wrote.
    assert_eq!(first.manifest_digest, digest);
    assert_eq!(first.layers.len(), 2);
    assert_eq!(first.blobs_fetched, 3, "config + 2 layers");
    assert_eq!(first.config.entrypoint, vec!["/bin/tool"]);
    assert_eq!(first.config.cmd, vec!["--serve"]);
    assert_eq!(first.config.env, vec!["PATH=/bin"]);
    assert_eq!(first.config.working_dir.as_deref(), Some("/srv"));
    assert_eq!(first.config.user.as_deref(), Some("1000:1000"));
    for l in &first.layers {
        let p = dir.join("blobs/sha256").join(&l.digest[7..]);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), l.size);
    }

    let by_digest: ImageSource = format!("{}/app@{digest}", reg.host()).parse().unwrap();
    let second = store
        .pull(&by_digest, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    assert_eq!(second.manifest_digest, digest);
    assert_eq!(second.blobs_fetched, 0, "every blob was cached");

    // A pull by digest that is fully cached needs no registry at all (node restart, outage).
    let host = reg.host();
    drop(reg);
    let offline = store
        .pull(&by_digest, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    assert_eq!(offline.manifest_digest, digest);
    assert_eq!(offline.blobs_fetched, 0);
    let reg = TestRegistry::start().await.unwrap();
    let digest = publish(&reg, &image(), "app", "v1", None).await;
    let by_digest: ImageSource = format!("{}/app@{digest}", reg.host()).parse().unwrap();
    assert_ne!(host, reg.host());

    let base = store.rootfs(&first, &[]).await.unwrap();
    assert!(!base.cached);
    let again = store.rootfs(&second, &[]).await.unwrap();
    assert!(again.cached);
    assert_eq!(again.path, base.path);
    assert_eq!(
        std::fs::read_dir(dir.join("tmp")).unwrap().count(),
        0,
        "unpack dir removed"
    );

    // A fresh cache pulling by digest works too.
    let (other, odir) = new_store();
    let p = other
        .pull(&by_digest, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    assert_eq!(p.blobs_fetched, 3);
    let missing: ImageSource = format!("{}/app:nope", reg.host()).parse().unwrap();
    let e = other
        .pull(&missing, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    assert!(e.to_string().contains(&reg.host()), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(odir).unwrap();
}

#[tokio::test]
async fn basic_auth_and_dockerconfigjson() {
    if !tools() {
        return;
    }
    let _ = require_tool!("htpasswd");
    let reg = TestRegistry::start_with_basic_auth("alice", "s3cret")
        .await
        .unwrap();
    publish(&reg, &image(), "private", "v1", Some(("alice", "s3cret"))).await;
    let src: ImageSource = format!("{}/private:v1", reg.host()).parse().unwrap();

    let (s, dir) = new_store();
    let e = s.pull(&src, &RegistryAuth::Anonymous).await.unwrap_err();
    assert!(e.to_string().contains(&reg.host()), "{e}");
    let wrong = RegistryAuth::Basic {
        username: "alice".into(),
        password: "nope".into(),
    };
    let e = s.pull(&src, &wrong).await.unwrap_err();
    let msg = chain(&e);
    assert!(msg.contains(&format!("Registry {}", reg.host())), "{msg}");
    assert!(msg.contains("Not authorized"), "{msg}");

    let secret = format!(
        r#"{{"auths":{{"other.example":{{"auth":"eDp5"}},"{}":{{"auth":"{}"}}}}}}"#,
        reg.host(),
        "YWxpY2U6czNjcmV0" // alice:s3cret
    );
    let auth = auth_from_docker_config(secret.as_bytes(), &reg.host()).unwrap();
    assert_eq!(
        auth,
        RegistryAuth::Basic {
            username: "alice".into(),
            password: "s3cret".into()
        }
    );
    let pulled = s.pull(&src, &auth).await.unwrap();
    assert_eq!(pulled.blobs_fetched, 3);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A loopback token server and reverse proxy in front of the registry: 401 with a Bearer
/// challenge unless the request carries the token, which `/token` issues for basic creds.
struct TokenProxy {
    host: String,
    blob_gets: Arc<AtomicUsize>,
    _task: tokio::task::JoinHandle<()>,
}

const TOKEN: &str = "tok-7f3a";

async fn start_proxy(upstream: std::net::SocketAddr) -> TokenProxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let blob_gets = Arc::new(AtomicUsize::new(0));
    let counter = blob_gets.clone();
    let realm = format!("Bearer realm=\"http://{addr}/token\",service=\"test\"");
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (realm, counter) = (realm.clone(), counter.clone());
        async move {
            let auth = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            if req.uri().path() == "/token" {
                // bob:hunter2
                if auth == "Basic Ym9iOmh1bnRlcjI=" {
                    return Response::new(Body::from(format!(
                        r#"{{"token":"{TOKEN}","expires_in":300}}"#
                    )));
                }
                return Response::builder()
                    .status(StatusCode::UNAUTHORIZED)
                    .body(Body::from("bad credentials"))
                    .unwrap();
            }
            if auth != format!("Bearer {TOKEN}") {
                return Response::builder()
                    .status(StatusCode::UNAUTHORIZED)
                    .header("www-authenticate", HeaderValue::from_str(&realm).unwrap())
                    .body(Body::from(
                        r#"{"errors":[{"code":"UNAUTHORIZED","message":"token required"}]}"#,
                    ))
                    .unwrap();
            }
            if req.method() == "GET" && req.uri().path().contains("/blobs/") {
                counter.fetch_add(1, Ordering::SeqCst);
            }
            forward(upstream, req).await
        }
    });
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    TokenProxy {
        host: addr.to_string(),
        blob_gets,
        _task: task,
    }
}

async fn forward(upstream: std::net::SocketAddr, req: Request<Body>) -> Response<Body> {
    let stream = tokio::net::TcpStream::connect(upstream).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let (mut parts, body) = req.into_parts();
    parts.headers.remove("authorization");
    parts.headers.insert(
        "host",
        HeaderValue::from_str(&upstream.to_string()).unwrap(),
    );
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    parts.uri = path.parse().unwrap();
    let resp = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, Body::new(body))
}

#[tokio::test]
async fn bearer_token_flow_and_no_blob_downloads_when_cached() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let digest = publish(&reg, &image(), "tok/app", "v1", None).await;
    let proxy = start_proxy(reg.addr()).await;
    let src: ImageSource = format!("{}/tok/app:v1", proxy.host).parse().unwrap();
    let (s, dir) = new_store();

    let e = s.pull(&src, &RegistryAuth::Anonymous).await.unwrap_err();
    assert!(e.to_string().contains(&proxy.host), "{e}");
    let bad = RegistryAuth::Basic {
        username: "bob".into(),
        password: "wrong".into(),
    };
    assert!(s.pull(&src, &bad).await.is_err());
    assert_eq!(proxy.blob_gets.load(Ordering::SeqCst), 0);

    let good = RegistryAuth::Basic {
        username: "bob".into(),
        password: "hunter2".into(),
    };
    let p = s.pull(&src, &good).await.unwrap();
    assert_eq!(p.manifest_digest, digest);
    assert_eq!(proxy.blob_gets.load(Ordering::SeqCst), 3);

    // A pre-issued token, as a dockerconfigjson `registrytoken`, works without the token dance.
    let secret = format!(
        r#"{{"auths":{{"http://{}":{{"registrytoken":"{TOKEN}"}}}}}}"#,
        proxy.host
    );
    let auth = auth_from_docker_config(secret.as_bytes(), &proxy.host).unwrap();
    assert_eq!(
        auth,
        RegistryAuth::Bearer {
            token: TOKEN.into()
        }
    );
    let again = s.pull(&src, &auth).await.unwrap();
    assert_eq!(again.blobs_fetched, 0);
    assert_eq!(
        proxy.blob_gets.load(Ordering::SeqCst),
        3,
        "second pull downloaded no blob"
    );
    let base = s.rootfs(&again, &[]).await.unwrap();
    assert!(!base.cached);
    assert!(s.rootfs(&p, &[]).await.unwrap().cached);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn index_selects_the_platform() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let layout = scratch_dir("imp-img-index").unwrap();
    let arm = TestImage::new()
        .architecture("arm64")
        .layer(TestLayer::new().file("arch", "arm64", 0o644));
    let amd = TestImage::new()
        .architecture("amd64")
        .layer(TestLayer::new().file("arch", "amd64", 0o644));
    let (_, written) = write_index(&layout, "multi", &[&arm, &amd]).unwrap();
    let out = tokio::process::Command::new("skopeo")
        .args(["copy", "--quiet", "--all", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:multi", layout.display()))
        .arg(format!("docker://{}/multi:v1", reg.host()))
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (s, dir) = new_store();
    let s = s.with_platform(imp_image::Platform::linux("amd64"));
    let src: ImageSource = format!("{}/multi:v1", reg.host()).parse().unwrap();
    let p = s.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert_eq!(p.manifest_digest, written[1].digest);
    assert_eq!(p.layers[0].digest, written[1].layer_digests[0]);
    let arm_store = ImageStore::new(dir.join("arm"), Limits::default())
        .with_platform(imp_image::Platform::linux("arm64"));
    assert_eq!(
        arm_store
            .pull(&src, &RegistryAuth::Anonymous)
            .await
            .unwrap()
            .manifest_digest,
        written[0].digest
    );
    let none = ImageStore::new(dir.join("s390x"), Limits::default())
        .with_platform(imp_image::Platform::linux("s390x"));
    let e = none.pull(&src, &RegistryAuth::Anonymous).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("no manifest for platform linux/s390x"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(layout).unwrap();
}

#[tokio::test]
async fn corrupted_blobs_are_rejected() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let layout = scratch_dir("imp-img-corrupt").unwrap();
    let w = image().write_layout(&layout, "v1").unwrap();
    push(&layout, "v1", &format!("{}/c:v1", reg.host()), None)
        .await
        .unwrap();

    // Served wrong: flip one byte of the registry's stored layer (same size).
    let stored = reg.blob_file(&w.layer_digests[1]);
    let mut bytes = std::fs::read(&stored).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&stored, &bytes).unwrap();
    let (s, dir) = new_store();
    let src: ImageSource = format!("{}/c:v1", reg.host()).parse().unwrap();
    let e = s.pull(&src, &RegistryAuth::Anonymous).await.unwrap_err();
    let chain = chain(&e);
    assert!(chain.starts_with("Downloading layer 1 of"), "{chain}");
    assert!(chain.contains("Invalid digest"), "{chain}");
    assert!(
        !dir.join("blobs/sha256")
            .join(&w.layer_digests[1][7..])
            .exists(),
        "bad blob not cached"
    );

    // Tampered in our cache after a good pull: the rootfs build hashes it and refuses.
    std::fs::write(&stored, {
        bytes[last] ^= 0xff;
        &bytes
    })
    .unwrap();
    let p = s.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let cached = dir.join("blobs/sha256").join(&w.layer_digests[0][7..]);
    let mut c = std::fs::read(&cached).unwrap();
    c[10] ^= 0x01;
    std::fs::write(&cached, &c).unwrap();
    let e = s.rootfs(&p, &[]).await.unwrap_err();
    assert!(
        e.to_string().starts_with("Digest mismatch for layer 0"),
        "{e}"
    );
    assert!(
        !dir.join("rootfs").read_dir().unwrap().any(|e| e
            .unwrap()
            .path()
            .extension()
            .is_some_and(|x| x == "ext4"))
    );
    assert!(!cached.exists(), "corrupt cached blob dropped");
    let p = s.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert_eq!(p.blobs_fetched, 1, "only the dropped blob is fetched again");
    assert!(!s.rootfs(&p, &[]).await.unwrap().cached);
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(layout).unwrap();
}
