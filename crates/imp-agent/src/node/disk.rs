//! The node's disk as the scheduler and Prometheus see it: the free and total bytes of the
//! filesystem holding the agent's state directory (VM records and disks, snapshots, the image
//! cache, serial logs), which the kubelet's DiskPressure does not watch.
//!
//! [`keep_disk_report`] reads it every [`REFRESH`] and publishes it as the Node annotation
//! [`ANNOTATION_DISK`] — only when [`worth_patching`] says it moved enough, so a busy disk does
//! not turn into a stream of Node patches — and as the `imp_node_state_dir_*_bytes` gauges
//! (every reading). [`keep_image_cache`] keeps the image cache within its byte budget, and
//! [`keep_serial_logs`] caps each VM's serial log.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use imp_api::shared::{ANNOTATION_DISK, DiskReport};
use kube::api::{Api, Patch, PatchParams};

use super::metrics::Metrics;
use crate::runtime::state::StateDir;
use imp_image::ImageStore;

/// How often the state directory's filesystem is read.
pub const REFRESH: Duration = Duration::from_secs(30);
/// A change of free bytes at least this large is always published.
pub const PATCH_BYTES: u64 = 256 << 20;
/// A change of free bytes above this share of the total (percent) is published too.
pub const PATCH_PERCENT: u64 = 1;

/// Whether `now` differs enough from what was last published (`None`: nothing yet) to patch
/// the Node: always the first time or when the total changed, else when free moved by more
/// than [`PATCH_PERCENT`] of the total or by more than [`PATCH_BYTES`], whichever is smaller.
pub fn worth_patching(published: Option<&DiskReport>, now: &DiskReport) -> bool {
    let Some(last) = published else {
        return true;
    };
    if last.total != now.total {
        return true;
    }
    let threshold = (now.total / 100 * PATCH_PERCENT).min(PATCH_BYTES);
    last.free.abs_diff(now.free) > threshold
}

/// The merge patch that sets [`ANNOTATION_DISK`] to `report`.
pub fn annotation_patch(report: &DiskReport) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_DISK: report.render()}}})
}

/// Reads `state_dir`'s filesystem every [`REFRESH`]: sets the gauges each time and patches
/// Node `node`'s [`ANNOTATION_DISK`] (as field manager `manager`) when [`worth_patching`]
/// says so. A failed read or patch is logged and tried again at the next tick. Runs until
/// aborted.
pub async fn keep_disk_report(
    client: kube::Client,
    node: String,
    state_dir: PathBuf,
    metrics: Arc<Metrics>,
    manager: &'static str,
) {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
    let mut published: Option<DiskReport> = None;
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let dir = state_dir.clone();
        let report = match tokio::task::spawn_blocking(move || crate::host_fs::usage(&dir)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(state = %state_dir.display(), error = %imp_api::chain::DisplayChain(&e), "reading the state directory's free space");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "the free-space reader panicked");
                continue;
            }
        };
        metrics.set_state_dir(&report);
        if !worth_patching(published.as_ref(), &report) {
            continue;
        }
        let patch = annotation_patch(&report);
        match nodes
            .patch(&node, &PatchParams::apply(manager), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::debug!(
                    node,
                    free = report.free,
                    total = report.total,
                    "published the state directory's free space"
                );
                published = Some(report);
            }
            Err(e) => {
                tracing::warn!(node, error = %imp_api::chain::DisplayChain(&e), "publishing the state directory's free space on the Node")
            }
        }
    }
}

/// How often the agent brings the image cache within its budget (besides each VM's shim doing
/// so after its pull).
pub const EVICT_EVERY: Duration = Duration::from_secs(5 * 60);

/// Brings `images` within `budget` bytes at start and every [`EVICT_EVERY`], keeping the
/// images `state`'s VM records name ([`ImageStore::evict`]). Failures are logged and tried
/// again at the next tick. Runs until aborted.
pub async fn keep_image_cache(images: ImageStore, state: StateDir, budget: u64) {
    let mut tick = tokio::time::interval(EVICT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(in_use) = state.images_in_use().await else {
            continue;
        };
        if let Err(e) = images.evict(budget, in_use).await {
            tracing::warn!(cache = %images.root().display(), error = %imp_api::chain::DisplayChain(&e), "evicting from the image cache");
        }
    }
}

/// How often the VMs' serial logs are checked against their cap.
pub const SERIAL_EVERY: Duration = Duration::from_secs(10);

/// Caps the serial log of every VM recorded in `state` at `max` bytes
/// ([`crate::runtime::console::rotate`]: one previous generation kept as `serial.log.1`),
/// every [`SERIAL_EVERY`]: a guest that floods its console between two checks overshoots by
/// what it wrote meanwhile. Failures are logged per VM. Runs until aborted.
pub async fn keep_serial_logs(state: StateDir, max: u64) {
    let mut tick = tokio::time::interval(SERIAL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let state = state.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || rotate_serial_logs(&state, max)).await {
            tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "rotating the serial logs panicked");
        }
    }
}

/// One pass of [`keep_serial_logs`]; returns how many logs were rotated. Blocking.
pub fn rotate_serial_logs(state: &StateDir, max: u64) -> usize {
    let records = match state.list() {
        Ok((records, _)) => records,
        Err(e) => {
            tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "listing the VMs to rotate their serial logs");
            return 0;
        }
    };
    let mut rotated = 0;
    for r in records {
        match crate::runtime::console::rotate(&r.serial_log, max) {
            Ok(Some(bytes)) => {
                rotated += 1;
                tracing::info!(vm = r.name, log = %r.serial_log.display(), bytes, max, "rotated the serial log (the previous one is kept as .1)");
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(vm = r.name, log = %r.serial_log.display(), error = %imp_api::chain::DisplayChain(&e), "rotating the serial log")
            }
        }
    }
    rotated
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const GIB: u64 = 1 << 30;

    fn r(free: u64, total: u64) -> DiskReport {
        DiskReport { free, total }
    }

    #[test]
    fn the_first_reading_and_a_new_total_are_always_published() {
        assert!(worth_patching(None, &r(GIB, 10 * GIB)));
        assert!(worth_patching(Some(&r(GIB, 10 * GIB)), &r(GIB, 11 * GIB)));
    }

    #[test]
    fn small_moves_of_free_space_are_not_published() {
        // 10 GiB disk: 1 % (~102 MiB) is below 256 MiB, so it is the threshold.
        let disk = 10 * GIB;
        let last = r(5 * GIB, disk);
        assert!(!worth_patching(Some(&last), &r(5 * GIB, disk)));
        assert!(!worth_patching(
            Some(&last),
            &r(5 * GIB + (100 << 20), disk)
        ));
        assert!(!worth_patching(
            Some(&last),
            &r(5 * GIB - (100 << 20), disk)
        ));
        assert!(worth_patching(Some(&last), &r(5 * GIB + (110 << 20), disk)));
        assert!(worth_patching(Some(&last), &r(5 * GIB - (110 << 20), disk)));
        // 1 TiB disk: 1 % is ~10 GiB, so 256 MiB is the threshold.
        let big = 1024 * GIB;
        let last = r(500 * GIB, big);
        assert!(!worth_patching(
            Some(&last),
            &r(500 * GIB - (200 << 20), big)
        ));
        assert!(worth_patching(
            Some(&last),
            &r(500 * GIB - (300 << 20), big)
        ));
    }

    #[test]
    fn the_patch_sets_only_the_disk_annotation() {
        assert_eq!(
            annotation_patch(&r(3, 10)),
            serde_json::json!({"metadata": {"annotations": {"imp.dev/disk": "free=3,total=10"}}})
        );
    }

    #[test]
    fn every_recorded_vms_serial_log_is_capped() {
        let root = std::env::temp_dir().join(format!("imp-disk-serial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let state = StateDir::new(&root);
        for (name, bytes) in [("big", 100), ("small", 5)] {
            let dir = state.create_vm_dir(name).unwrap();
            let record: crate::runtime::state::VmRecord =
                serde_json::from_value(serde_json::json!({
                    "name": name, "image": "busybox", "runtime": "qemu", "supervisor_pid": 1,
                    "vmm_pid": null, "vsock": "/v", "agent_port": 10000,
                    "serial_log": dir.join("serial.log"), "created_unix": 0,
                    "status": "running", "exit_code": null, "error": null,
                    "remove_on_exit": false,
                }))
                .unwrap();
            state.save(&record).unwrap();
            std::fs::write(dir.join("serial.log"), vec![b'x'; bytes]).unwrap();
        }
        assert_eq!(rotate_serial_logs(&state, 50), 1);
        let big = state.vm_dir("big");
        assert_eq!(std::fs::metadata(big.join("serial.log")).unwrap().len(), 0);
        assert_eq!(
            std::fs::metadata(big.join("serial.log.1")).unwrap().len(),
            100
        );
        let small = state.vm_dir("small");
        assert_eq!(
            std::fs::metadata(small.join("serial.log")).unwrap().len(),
            5
        );
        assert!(!small.join("serial.log.1").exists());
        assert_eq!(
            rotate_serial_logs(&state, 50),
            0,
            "nothing over the cap now"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_real_directory_reads_as_a_plausible_filesystem() {
        let dir = std::env::temp_dir();
        let report = crate::host_fs::usage(&dir).unwrap();
        assert!(report.total > 0, "{report:?}");
        assert!(report.free <= report.total, "{report:?}");
        assert_eq!(DiskReport::parse(&report.render()).unwrap(), report);
        let missing =
            crate::host_fs::usage(&dir.join(format!("imp-disk-missing-{}", std::process::id())))
                .unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }
}
