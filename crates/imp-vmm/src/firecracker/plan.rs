//! The API calls that boot, snapshot and restore a VM, built as data before anything is sent.
//!
//! Keeping the sequence pure lets tests check every body the driver sends against
//! Firecracker's OpenAPI spec without a running Firecracker.

use crate::firecracker::api::{self, Request};
use crate::firecracker::{Launcher, Layout, drive_file, files};
use crate::{SnapshotFiles, VmConfig};

/// Calls that configure and start a fresh VM, in order.
pub fn boot(_launcher: &Launcher, config: &VmConfig, layout: &Layout) -> api::Result<Vec<Request>> {
    let mut out = vec![
        Request::put_machine_config(&api::MachineConfiguration {
            vcpu_count: config.vcpus,
            mem_size_mib: config.memory_mib,
        })?,
        Request::put_boot_source(&api::BootSource {
            kernel_image_path: layout.vmm_file(&config.kernel, files::KERNEL),
            boot_args: Some(boot_args(config)),
            initrd_path: config
                .initrd
                .as_deref()
                .map(|p| layout.vmm_file(p, files::INITRD)),
        })?,
    ];
    for d in &config.drives {
        out.push(Request::put_drive(&api::Drive {
            drive_id: d.id.clone(),
            path_on_host: layout.vmm_file(&d.path, &drive_file(&d.id)),
            is_root_device: d.root,
            is_read_only: d.read_only,
        })?);
    }
    if let Some(net) = &config.net {
        out.push(Request::put_network_interface(&api::NetworkInterface {
            iface_id: net.id.clone(),
            host_dev_name: net.tap.clone(),
            guest_mac: net.mac.clone(),
        })?);
    }
    if let Some(v) = &config.vsock {
        out.push(Request::put_vsock(&api::Vsock {
            guest_cid: v.guest_cid,
            uds_path: layout.vmm(files::VSOCK),
        })?);
    }
    out.push(Request::put_action(api::ActionType::InstanceStart)?);
    Ok(out)
}

/// The guest kernel's command line: the config's arguments, unchanged. The one place this
/// driver builds it; unlike QEMU's (`qemu::argv::kernel_append`) it adds nothing: the caller
/// passes whatever the guest needs (imp-agent adds `tsc_early_khz=` itself).
pub fn boot_args(config: &VmConfig) -> String {
    config.kernel_args.clone()
}

/// Calls that load `snapshot` into a fresh process, in order.
pub fn restore(
    _launcher: &Launcher,
    config: &VmConfig,
    layout: &Layout,
    snapshot: &SnapshotFiles,
    resume: bool,
) -> api::Result<Vec<Request>> {
    Ok(vec![Request::put_snapshot_load(
        &api::SnapshotLoadParams {
            snapshot_path: layout.vmm_file(&snapshot.state, files::SNAPSHOT_STATE),
            mem_backend: api::MemoryBackend {
                backend_type: api::MemoryBackendType::File,
                backend_path: layout.vmm_file(&snapshot.memory, files::SNAPSHOT_MEM),
            },
            resume_vm: resume,
            // The snapshot names its source's TAP; this VM has its own (the same one for a
            // resume of the same VM).
            network_overrides: config
                .net
                .iter()
                .map(|n| api::NetworkOverride {
                    iface_id: n.id.clone(),
                    host_dev_name: n.tap.clone(),
                })
                .collect(),
        },
    )?])
}

/// The call that writes a full snapshot (inside the jail when jailed; the driver moves it out).
pub fn snapshot_create(layout: &Layout, snapshot: &SnapshotFiles) -> api::Result<Request> {
    Request::put_snapshot_create(&api::SnapshotCreateParams {
        snapshot_type: api::SnapshotType::Full,
        snapshot_path: layout.vmm_file(&snapshot.state, files::SNAPSHOT_STATE),
        mem_file_path: layout.vmm_file(&snapshot.memory, files::SNAPSHOT_MEM),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Firecracker's guest gets exactly the caller's kernel arguments: nothing appended (no
    /// `tsc=`, unlike QEMU's), nothing trimmed.
    #[test]
    fn the_boot_source_carries_the_callers_kernel_arguments_verbatim() {
        let launcher = Launcher::new("/opt/fc/firecracker");
        let config = VmConfig {
            id: "vm-1".into(),
            run_dir: "/run/imp/vm-1".into(),
            vcpus: 1,
            memory_mib: 128,
            kernel: "/k/vmlinux".into(),
            initrd: None,
            kernel_args: "console=ttyS0 tsc_early_khz=2000 ".into(),
            drives: vec![],
            net: None,
            vsock: None,
            netns: None,
            confine: None,
            memory: Default::default(),
        };
        assert_eq!(boot_args(&config), "console=ttyS0 tsc_early_khz=2000 ");
        let calls = boot(&launcher, &config, &Layout::new(&launcher, &config)).unwrap();
        let source = calls
            .iter()
            .find(|r| r.definition == Some("BootSource"))
            .unwrap();
        assert_eq!(
            source.body.as_ref().unwrap()["boot_args"],
            "console=ttyS0 tsc_early_khz=2000 "
        );
    }
}
