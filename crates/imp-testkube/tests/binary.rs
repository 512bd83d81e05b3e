//! The `imp-testkube serve` binary prints its address, writes a kubeconfig and serves.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

mod common;

use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::test]
async fn serve_prints_address_and_writes_kubeconfig() {
    let dir = std::env::temp_dir().join(format!("imp-testkube-bin-{}", std::process::id()));
    let kc = dir.join("kubeconfig");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_imp-testkube"))
        .args(["serve", "--port", "0", "--kubeconfig"])
        .arg(&kc)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = lines.next_line().await.unwrap().unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let text = tokio::fs::read_to_string(&kc).await.unwrap();
    assert!(text.contains(&format!("server: {url}")), "{text}");
    let (code, v) = common::call(&url, "GET", "/api/v1/namespaces/default", None).await;
    assert_eq!(code, 200);
    assert_eq!(v["status"]["phase"], "Active");
    child.kill().await.unwrap();
    let _ = tokio::fs::remove_dir_all(&dir).await;
}
