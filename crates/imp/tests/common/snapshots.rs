//! What the ImpVMSnapshot end-to-end tests share: a parent, its terminated execution, an
//! execution's Ready condition, and `imp exec` into a VM.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use imp_api::snapshot::{ImpVMSnapshot, ImpVMSnapshotStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

/// Runs `imp exec` of `sh -c script` in VM `ns/vm` as `kubeconfig`'s user, which must
/// succeed; its stdout.
pub async fn exec_in(kubeconfig: &Path, ns: &str, vm: &str, script: &str) -> String {
    let (k, s, ns, vm) = (
        kubeconfig.to_path_buf(),
        script.to_owned(),
        ns.to_owned(),
        vm.to_owned(),
    );
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_imp"))
            .args(["exec", "-n", &ns, &vm, "--", "sh", "-c", &s])
            .env("KUBECONFIG", &k)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "exec {script:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh directory for node-local snapshots, as an agent's `--snapshot-root` must be: owned
/// by root (the test's user) and writable by no one else (0755, whatever the umask).
pub fn snapshot_root(prefix: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = imp_testenv::registry::scratch_dir(prefix).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Creates parent ImpVMSnapshot `ns/name` of VM `vm` (in `ns`) stored as `storage`.
pub async fn parent(c: &Client, ns: &str, name: &str, vm: &str, storage: serde_json::Value) {
    let snaps: Api<ImpVMSnapshot> = Api::namespaced(c.clone(), ns);
    let obj: ImpVMSnapshot = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMSnapshot",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"sourceVMName": vm, "sourceVMNamespace": ns, "storage": storage}
    }))
    .unwrap();
    snaps.create(&PostParams::default(), &obj).await.unwrap();
}

/// The execution of parent `ns/name` once it has terminated.
pub async fn terminated_execution(c: &Client, ns: &str, name: &str) -> ImpVMSnapshot {
    let snaps: Api<ImpVMSnapshot> = Api::namespaced(c.clone(), ns);
    let selector = format!("{}={name}", imp_api::shared::LABEL_SNAPSHOT_PARENT);
    super::wait_for(
        &format!("the execution of {name} terminated"),
        Duration::from_secs(180),
        || {
            let (snaps, selector) = (snaps.clone(), selector.clone());
            async move {
                let list = snaps
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .unwrap();
                list.items
                    .into_iter()
                    .find(|e| e.status.as_ref().is_some_and(|s| s.terminated_at.is_some()))
            }
        },
    )
    .await
}

/// An execution's `Ready` condition.
pub fn ready_of(status: &ImpVMSnapshotStatus) -> Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .cloned()
        .unwrap_or_else(|| panic!("no Ready condition: {status:?}"))
}

/// Sets (or, with `None`, removes) ImpWarmPool `ns/pool`'s `imp.dev/member-state`, which the
/// members it makes from then on carry (`running`: they wait running, not paused).
pub async fn member_state(c: &Client, ns: &str, pool: &str, state: Option<&str>) {
    kube::Api::<imp_api::ImpWarmPool>::namespaced(c.clone(), ns)
        .patch(
            pool,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                &serde_json::json!({"metadata": {"annotations": {"imp.dev/member-state": state}}}),
            ),
        )
        .await
        .expect("setting a pool's member state");
}
