//! What a failed step of the VM's life says: the [`Failure`], its [`Stage`] and cause, and the
//! wording of the failures that say more than their step (a full disk, a layer that cannot be
//! applied, a launch from a snapshot another VMM version wrote).

use std::error::Error as StdError;
use std::path::Path;

use super::super::state::{Stage, VmRecord};
use super::Launch;

/// A failed step of the VM's life: which step and why.
#[derive(Debug, thiserror::Error)]
#[error("{what}")]
pub struct Failure {
    /// The step.
    pub stage: Stage,
    /// What was being done, naming the object.
    pub what: String,
    /// The cause.
    #[source]
    pub source: Option<Box<dyn StdError + Send + Sync>>,
}

impl Failure {
    pub(super) fn new(stage: Stage, what: impl Into<String>) -> Self {
        Self {
            stage,
            what: what.into(),
            source: None,
        }
    }

    /// The message with its whole cause chain on one line, as written into the record;
    /// control characters (from names in an image) are shown escaped, so printing it cannot
    /// drive the reader's terminal.
    pub fn chain(&self) -> String {
        imp_image::layers::escape_controls(&imp_api::chain::chain(self))
    }
}

/// Tags an error with the stage it happened in and what was being done.
pub(super) fn at<E: StdError + Send + Sync + 'static>(
    stage: Stage,
    what: impl Into<String>,
) -> impl FnOnce(E) -> Failure {
    let what = what.into();
    move |e| Failure {
        stage,
        what,
        source: Some(Box::new(e)),
    }
}

/// The stage a failure to build an image's root filesystem belongs to: a layer that cannot
/// be applied is the image's fault, anything else the disk's.
pub(super) fn rootfs_failure_stage(e: &imp_image::ImageError) -> Stage {
    match e {
        imp_image::ImageError::Layer(_) | imp_image::ImageError::UnsupportedMediaType { .. } => {
            Stage::Image
        }
        _ => Stage::Disk,
    }
}

/// `what` of a failed disk step, saying so when it failed because the filesystem of `dir` is
/// full ([`full_disk_what`]); the partial file is already gone (the image pipeline writes
/// under temporary names and removes them on failure).
pub(super) async fn disk_failure_what(
    what: String,
    dir: &Path,
    e: &imp_image::ImageError,
) -> String {
    if !e.is_storage_full() {
        return what;
    }
    let d = dir.to_path_buf();
    let report = tokio::task::spawn_blocking(move || crate::host_fs::usage(&d))
        .await
        .ok()
        .and_then(Result::ok);
    full_disk_what(&what, dir, report)
}

/// `what`, then that the node's disk is full: the filesystem of `dir`, with its free and total
/// bytes when known.
fn full_disk_what(what: &str, dir: &Path, report: Option<imp_api::shared::DiskReport>) -> String {
    match report {
        Some(r) => format!(
            "{what}: the node's disk is full ({} of {} bytes free on the filesystem of {})",
            r.free,
            r.total,
            dir.display()
        ),
        None => format!(
            "{what}: the node's disk is full (the filesystem of {})",
            dir.display()
        ),
    }
}

/// `what` of a VMM that failed to launch `how`: booting, or restoring from which snapshot,
/// with a note when the snapshot was written by a VMM of another version than `identity`.
pub(super) fn launch_failure_what(how: Launch<'_>, record: &VmRecord, identity: &str) -> String {
    match how {
        Launch::Boot => format!("booting {}", record.name),
        Launch::Clone(files, writer) => format!(
            "restoring {} from the snapshot {}{}",
            record.name,
            files.memory.parent().unwrap_or(Path::new("")).display(),
            skew(Some(writer), identity)
        ),
        Launch::Restore(files) => {
            let writer = record.suspend.as_ref().and_then(|s| s.vmm.as_deref());
            format!(
                "restoring {} from its snapshot {}{}",
                record.name,
                files.memory.display(),
                skew(writer, identity)
            )
        }
    }
}

/// ` (why)` when a snapshot written by `writer` failed to load in `loader`, a VMM of
/// another version; else nothing.
fn skew(writer: Option<&str>, loader: &str) -> String {
    imp_vmm::version::skew_note(writer, loader)
        .map(|n| format!(" ({n})"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::super::tests::spec_with;
    use super::*;
    use crate::runtime::contract;
    use crate::runtime::state::SuspendRecord;

    #[test]
    fn an_unusable_layer_is_the_images_fault_anything_else_the_disks() {
        let layer = imp_image::ImageError::UnsupportedMediaType {
            digest: "sha256:1".into(),
            media_type: "application/x-zip".into(),
        };
        assert_eq!(rootfs_failure_stage(&layer), Stage::Image);
        let tool = imp_image::ImageError::Tool {
            tool: "mkfs.ext4",
            path: "/c/x.ext4".into(),
            detail: "No space left on device".into(),
        };
        assert_eq!(rootfs_failure_stage(&tool), Stage::Disk);
    }

    #[test]
    fn a_failed_launch_names_the_vm_and_the_snapshot_with_a_version_skew_note() {
        let spec = spec_with(serde_json::json!({}));
        let mut record = contract::initial_record("vm1", Path::new("/s/vms/vm1"), &spec, 1);
        let files = contract::snapshot_files(Path::new("/snaps/s1"));
        assert_eq!(
            launch_failure_what(Launch::Boot, &record, "qemu 8.2.0"),
            "booting vm1"
        );
        assert_eq!(
            launch_failure_what(Launch::Clone(&files, "qemu 8.2.0"), &record, "qemu 8.2.0"),
            "restoring vm1 from the snapshot /snaps/s1"
        );
        let skewed =
            launch_failure_what(Launch::Clone(&files, "qemu 9.0.0"), &record, "qemu 8.2.0");
        assert!(
            skewed.starts_with(
                "restoring vm1 from the snapshot /snaps/s1 (the snapshot was written by qemu 9.0.0"
            ),
            "{skewed}"
        );
        record.suspend = Some(SuspendRecord {
            snapshot_dir: "/snaps/s1".into(),
            suspended_unix: 1,
            paused_unix_ms: None,
            bytes: 0,
            vmm: Some("qemu 9.0.0".into()),
        });
        let restore = launch_failure_what(Launch::Restore(&files), &record, "qemu 8.2.0");
        assert!(
            restore.starts_with("restoring vm1 from its snapshot /snaps/s1/memory (the snapshot was written by qemu 9.0.0"),
            "{restore}"
        );
    }

    #[test]
    fn a_full_disk_is_named_with_its_path_and_free_space() {
        let report = imp_api::shared::DiskReport {
            free: 4096,
            total: 1 << 20,
        };
        let what = full_disk_what(
            "giving the VM its own 2 GiB disk /s/vms/v/disk.ext4",
            Path::new("/s/vms/v"),
            Some(report),
        );
        assert_eq!(
            what,
            "giving the VM its own 2 GiB disk /s/vms/v/disk.ext4: the node's disk is full \
             (4096 of 1048576 bytes free on the filesystem of /s/vms/v)"
        );
        let failure = at(Stage::Disk, what)(imp_image::ImageError::Tool {
            tool: "resize2fs",
            path: "/s/vms/v/.disk.ext4.1.0.tmp".into(),
            detail: "No space left on device".into(),
        });
        assert!(
            failure.chain().contains("disk is full"),
            "{}",
            failure.chain()
        );
        assert!(
            full_disk_what("x", Path::new("/c"), None).ends_with("full (the filesystem of /c)")
        );
    }
}
