//! The registry client's own operations against a real registry (Debian's docker-registry on
//! loopback): chunked and monolithic uploads, a blob mounted from another repository, bounded
//! and verified blob reads, a manifest pushed, fetched and deleted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_image::RegistryAuth;
use imp_image::manifest::{Digest, OCI_MANIFEST};
use imp_image::registry::{Error, Placed, Session, Upload};
use imp_testenv::registry::TestRegistry;
use imp_testenv::report::chain;

const MIB: usize = 1 << 20;
const OCTETS: &str = "application/octet-stream";

/// True when docker-registry is present; skips locally, fails under CI.
fn tools() -> bool {
    imp_testenv::guard::require(
        imp_testenv::guard::which("docker-registry").is_some(),
        "tool `docker-registry` on PATH",
    )
}

/// `len` bytes that differ from those of another `seed`.
fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn session(reg: &TestRegistry, repo: &str, upload: Upload) -> Session {
    let r = format!("{}/{repo}:one", reg.host()).parse().unwrap();
    Session::with_upload(r, &RegistryAuth::Anonymous, upload)
}

#[tokio::test]
async fn chunked_upload_mount_and_bounded_reads() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    // Three PATCHes of at most 4 MiB.
    let big = bytes(9 * MIB + 5, 1);
    let big_digest = Digest::of(&big);
    let a = session(&reg, "a", Upload::Chunked);
    assert_eq!(
        a.push_blob(big.clone().into(), &big_digest, "the big blob")
            .await
            .unwrap(),
        Placed::Uploaded
    );
    assert_eq!(
        a.push_blob(big.clone().into(), &big_digest, "the big blob")
            .await
            .unwrap(),
        Placed::Present
    );
    let size = big.len() as u64;
    let read = a.blob(OCTETS, &big_digest, size, "the big blob").await;
    assert!(read.unwrap() == big, "the chunks arrived in order");

    // Another repository mounts what `a` has and uploads what it has not.
    let b = session(&reg, "b", Upload::Monolithic).mount_from(["a".to_owned()]);
    assert_eq!(
        b.push_blob(big.clone().into(), &big_digest, "the big blob")
            .await
            .unwrap(),
        Placed::Mounted
    );
    let small = bytes(1000, 2);
    let small_digest = Digest::of(&small);
    assert_eq!(
        b.push_blob(small.clone().into(), &small_digest, "a small blob")
            .await
            .unwrap(),
        Placed::Uploaded
    );
    assert!(
        b.blob(OCTETS, &big_digest, size, "the big blob")
            .await
            .unwrap()
            == big
    );

    // A descriptor that undersells the blob stops the read; one that oversells it fails.
    let e = b
        .blob(OCTETS, &small_digest, 999, "a small blob")
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::TooLarge { limit: 999, .. }),
        "{}",
        chain(&e)
    );
    let e = b
        .blob(OCTETS, &small_digest, 1001, "a small blob")
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::DigestMismatch { .. }) && e.to_string().contains("1000 bytes"),
        "{}",
        chain(&e)
    );
}

#[tokio::test]
async fn manifest_push_fetch_and_delete() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let s = session(&reg, "m", Upload::Monolithic);
    let config = br#"{"what":"a test artifact"}"#;
    let config_digest = Digest::of(config);
    s.push_blob(config.to_vec().into(), &config_digest, "the config")
        .await
        .unwrap();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.example.test.v1",
        "config": {
            "mediaType": "application/vnd.example.test.config.v1+json",
            "digest": config_digest.to_string(),
            "size": config.len(),
        },
        "layers": [],
    }))
    .unwrap();
    let digest = s
        .push_manifest(manifest.clone(), OCI_MANIFEST)
        .await
        .unwrap();
    assert_eq!(digest, Digest::of(&manifest));
    assert_eq!(
        s.manifest().await.unwrap(),
        (manifest.clone(), digest.clone())
    );
    assert_eq!(s.manifest_by_digest(&digest).await.unwrap(), manifest);

    assert!(s.delete(&digest).await.unwrap());
    assert!(!s.delete(&digest).await.unwrap(), "already gone");
    let e = s.manifest().await.unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{}", chain(&e));
    assert!(e.to_string().contains(&reg.host()), "{e}");
}
