//! What to boot: the spec a front end (`imp run`, `imp agent`) writes into a VM's directory
//! and the VM's shim reads. Everything is resolved before it is written (absolute paths of the
//! kernel, modules, guest init and VMM binaries), so the shim decides nothing about the host.

use std::path::PathBuf;
use std::time::Duration;

use imp_proto::message::EnvVar;
use serde::{Deserialize, Serialize};

use imp_api::shared::VmRuntime;

use super::state::Owner;

/// The spec file's name inside a VM directory.
pub const SPEC_FILE: &str = "spec.json";

/// Whether `runtime` opens the VM's TAP by its name when it restores a snapshot (Firecracker:
/// the TAP must then be closed by everyone else) rather than inheriting an open descriptor from
/// its shim (QEMU: the descriptor held while the VM slept is handed over, with the frames that
/// woke it already queued in it).
pub fn reopens_tap_by_name(runtime: VmRuntime) -> bool {
    match runtime {
        VmRuntime::Qemu => false,
        VmRuntime::Firecracker => true,
    }
}

/// Host files the VM boots with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootFiles {
    /// Guest kernel (ELF vmlinux, or a bzImage for QEMU).
    pub kernel: PathBuf,
    /// The kernel's modules directory.
    pub modules: PathBuf,
    /// The static guest init (`imp-guest`).
    pub guest: PathBuf,
    /// The Firecracker binary, for [`VmRuntime::Firecracker`].
    #[serde(default)]
    pub firecracker: Option<PathBuf>,
    /// Kernel arguments added to imp's own.
    #[serde(default)]
    pub extra_kernel_args: Option<String>,
    /// Firecracker may run without its jailer (unconfined, as root): the front end's
    /// `--allow-unjailed-firecracker`; without it such a VM is refused
    /// ([`super::shim::jailer`]). Specs written before it existed: no.
    #[serde(default)]
    pub allow_unjailed_firecracker: bool,
}

/// The cgroup a VM's processes run in (outside the front end's own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupSpec {
    /// Path below each hierarchy's root, e.g. `imp/<uid>`.
    pub path: String,
    /// Memory limit for the VMM and its helpers, in bytes.
    pub memory_limit_bytes: u64,
    /// CPU, task and disk limits (none in specs written before they existed).
    #[serde(default)]
    pub limits: super::cgroup::Limits,
}

/// One VM to boot, as its shim reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSpec {
    /// The image reference (`registry/repo:tag`, `oci:DIR[:TAG]`, `oci-archive:FILE`).
    pub image: String,
    /// Images whose layers go over `image`'s, lowest first (an ImpVM's `runnerLayer`, then its
    /// `ciliumLayer`), pulled and unpacked as the image's own; the root filesystem of each
    /// combination is cached on its own.
    #[serde(default)]
    pub layers: Vec<String>,
    /// A `.dockerconfigjson`-style file with registry credentials.
    #[serde(default)]
    pub auth_file: Option<PathBuf>,
    /// Replaces the image's ENTRYPOINT.
    #[serde(default)]
    pub entrypoint: Option<String>,
    /// Replaces the image's CMD (empty: keep it).
    #[serde(default)]
    pub command: Vec<String>,
    /// The workload's environment (wins over the image's Env).
    #[serde(default)]
    pub env: Vec<EnvVar>,
    /// Guest hostname.
    pub hostname: String,
    /// Virtual CPUs.
    pub vcpus: u8,
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// The VM's own disk in GiB.
    pub disk_gib: u32,
    /// The VMM.
    pub runtime: VmRuntime,
    /// Kernel, modules, guest init, VMM binary.
    pub boot: BootFiles,
    /// How long the guest may take until its agent answers, in milliseconds.
    pub boot_timeout_ms: u64,
    /// Delete the VM's directory when it ends.
    #[serde(default)]
    pub remove_on_exit: bool,
    /// The guest starts no workload: the front end runs it as an exec session with the user's
    /// terminal attached (`imp run -i/-t`), from the record's `attach_argv`.
    #[serde(default)]
    pub attach: bool,
    /// The cgroup of the VM's processes, if any.
    #[serde(default)]
    pub cgroup: Option<CgroupSpec>,
    /// The image and initramfs cache (default: `cache/` of the state directory).
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// The node-wide cap on the bytes an image may unpack to (the VM's disk size caps it too).
    #[serde(default)]
    pub image_max_bytes: Option<u64>,
    /// The image cache's byte budget: after its disk is made, the shim evicts the least
    /// recently used images the node's VMs do not use down to it (`None`: no budget).
    #[serde(default)]
    pub image_cache_max_bytes: Option<u64>,
    /// The ImpVM this VM belongs to (for `imp agent`).
    #[serde(default)]
    pub owner: Option<Owner>,
    /// The VM's network interface, wired by the agent before the shim starts.
    #[serde(default)]
    pub network: Option<NetAttachment>,
    /// Report the image pipeline's progress into the VM's directory for the front end to show
    /// ([`super::progress`]; `imp run` asks for it, the agent does not).
    #[serde(default)]
    pub progress: bool,
    /// Whether the guest serves the guest agent: without it the VM runs once its VMM does, and
    /// exec, health and figures are not asked of it. Specs written before it existed: yes.
    #[serde(default = "super::state::yes")]
    pub guest_agent: bool,
    /// Boot from this snapshot directory (`crate::snapshot`) instead of the image: its disk,
    /// memory and device state, restored under this VM's identity.
    #[serde(default)]
    pub from_snapshot: Option<PathBuf>,
    /// The VM's user data, parsed by the front end (`crate::node::userdata`); the guest
    /// applies it before the workload starts. None in specs written before it existed.
    #[serde(default)]
    pub user_data: Option<imp_proto::config::UserData>,
}

pub use imp_net::NetAttachment;

impl VmSpec {
    /// The cache directory of this VM's images and initramfs.
    pub fn cache(&self, state: &super::state::StateDir) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(|| state.cache())
    }

    /// The boot timeout as a duration.
    pub fn boot_timeout(&self) -> Duration {
        Duration::from_millis(self.boot_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips_through_json() {
        let spec = VmSpec {
            image: "127.0.0.1:5000/app:1".into(),
            layers: vec!["127.0.0.1:5000/runner:1".into()],
            auth_file: None,
            entrypoint: None,
            command: vec!["sh".into()],
            env: vec![EnvVar::new("A", "1")],
            hostname: "web".into(),
            vcpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            runtime: VmRuntime::Qemu,
            boot: BootFiles {
                kernel: "/k".into(),
                modules: "/m".into(),
                guest: "/g".into(),
                firecracker: None,
                extra_kernel_args: None,
                allow_unjailed_firecracker: false,
            },
            boot_timeout_ms: 1000,
            remove_on_exit: false,
            attach: false,
            cgroup: Some(CgroupSpec {
                path: "imp/x".into(),
                memory_limit_bytes: 1 << 30,
                limits: Default::default(),
            }),
            cache_dir: None,
            image_max_bytes: None,
            image_cache_max_bytes: None,
            owner: None,
            network: None,
            progress: true,
            guest_agent: true,
            from_snapshot: None,
            user_data: Some(imp_proto::config::UserData::Script("#!/bin/sh\n".into())),
        };
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains("\"runtime\":\"qemu\""), "{json}");
        assert_eq!(serde_json::from_str::<VmSpec>(&json).unwrap(), spec);
        assert_eq!(spec.boot_timeout(), Duration::from_secs(1));
    }
}
