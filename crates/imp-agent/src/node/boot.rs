//! What to boot for an ImpVM: the runtime's [`VmSpec`] from the VM's resolved spec, its class
//! and the agent's settings. Pure, so every mapping is tested without a cluster.

use std::path::PathBuf;
use std::time::Duration;

use imp_api::class::ImpVMClassSpec;
use imp_api::shared::VmRuntime;
use imp_api::vm::ImpVMSpec;

use crate::runtime::cgroup::Limits;
use crate::runtime::spec::{BootFiles, CgroupSpec, VmSpec};
use crate::runtime::state::Owner;

use super::capabilities::{Capabilities, HostFiles};

/// Memory the VMM itself needs beyond the guest's, in MiB: QEMU's TCG translation cache and
/// device state, the shim. The cgroup limit is guest + this + a quarter.
pub const VMM_OVERHEAD_MIB: u64 = 384;

/// CPU the VMM's own threads get beyond the guest's vCPUs, in thousandths of a CPU: QEMU's main
/// loop (device emulation, the disk's I/O), its I/O workers and the shim. A quota of the vCPUs
/// alone throttles the vCPU threads whenever the others run; under TCG a guest stalled through
/// its timer calibration at boot comes up without a timer and asks for another boot
/// (`IMP_BOOT_RETRY`).
pub const VMM_CPU_HEADROOM_MILLIS: u32 = 500;

/// The most tasks in a VM's cgroup: QEMU's vCPU, main-loop and RCU threads and its pool of up
/// to 64 I/O workers, the shim's runtime and blocking threads, with room to spare. A VMM taken
/// over by its guest cannot fork the node out of pids.
pub const VM_PIDS_MAX: u32 = 512;

/// The cgroup of a VM at `path` with `vcpus` and `memory_mib`: memory for the guest and the
/// VMM ([`VMM_OVERHEAD_MIB`] + a quarter), CPU time for the vCPUs plus
/// [`VMM_CPU_HEADROOM_MILLIS`], [`VM_PIDS_MAX`] tasks, and CPU and disk weights in proportion
/// to the vCPUs (100, the default share, per vCPU). `imp agent` and `imp run` both use it.
pub fn vm_cgroup(path: String, vcpus: u8, memory_mib: u32) -> CgroupSpec {
    let memory_limit_bytes =
        (u64::from(memory_mib) + VMM_OVERHEAD_MIB + u64::from(memory_mib) / 4) << 20;
    let weight = 100 * u32::from(vcpus.max(1));
    CgroupSpec {
        path,
        memory_limit_bytes,
        limits: Limits {
            cpu_millis: Some(1000 * u32::from(vcpus.max(1)) + VMM_CPU_HEADROOM_MILLIS),
            cpu_weight: Some(weight),
            pids_max: Some(VM_PIDS_MAX),
            io_weight: Some(weight),
        },
    }
}

/// The agent settings a spec needs.
#[derive(Debug, Clone)]
pub struct BootSettings {
    /// Kernel, modules, guest init, Firecracker.
    pub files: HostFiles,
    /// Kernel arguments added to imp's own (`FC_KERNEL_ARGS`).
    pub extra_kernel_args: Option<String>,
    /// How long a guest may take until its agent answers.
    pub boot_timeout: Duration,
    /// Parent of every VM's cgroup below each hierarchy's root (e.g. `imp`).
    pub cgroup_parent: Option<String>,
    /// The image cache, shared by every VM of the node.
    pub cache_dir: PathBuf,
    /// The node-wide cap on what one image may unpack to, in bytes.
    pub image_max_bytes: Option<u64>,
    /// The image cache's byte budget (`--image-cache-max-bytes`; `None`: no budget).
    pub image_cache_max_bytes: Option<u64>,
}

/// Why a spec cannot be built; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

/// The runtime a VM of `class` runs on here.
pub fn runtime_for(class: &ImpVMClassSpec, caps: &Capabilities) -> VmRuntime {
    match class.runtime {
        Some(VmRuntime::Qemu) => VmRuntime::Qemu,
        Some(VmRuntime::Firecracker) => VmRuntime::Firecracker,
        None => caps.default_runtime,
    }
}

/// The runtime choices of a VM besides its resolved spec and class.
#[derive(Debug, Clone)]
pub struct Choices {
    /// The VMM.
    pub runtime: VmRuntime,
    /// The workload's environment ([`super::env::resolve`]).
    pub env: Vec<imp_proto::message::EnvVar>,
    /// The credentials file merged from the pull secrets.
    pub auth_file: Option<PathBuf>,
}

/// Builds the spec of the VM `owner` whose resolved spec is `vm`.
pub fn vm_spec(
    owner: Owner,
    vm: &ImpVMSpec,
    class: &ImpVMClassSpec,
    choices: Choices,
    settings: &BootSettings,
) -> Result<VmSpec, SpecError> {
    let Choices {
        runtime,
        env,
        auth_file,
    } = choices;
    let image = vm
        .inherited
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .ok_or_else(|| SpecError("spec.image is empty (and no template gives one)".into()))?;
    let vcpus = u8::try_from(class.vcpu)
        .ok()
        .filter(|&v| v >= 1)
        .ok_or_else(|| SpecError(format!("class vcpu {} is out of range 1-255", class.vcpu)))?;
    let min = imp_api::class::MIN_MEMORY_MIB;
    let memory_mib = u32::try_from(class.memory_mib)
        .ok()
        .filter(|&m| i64::from(m) >= i64::from(min))
        .ok_or_else(|| {
            SpecError(format!(
                "class memoryMiB {} is below {min}",
                class.memory_mib
            ))
        })?;
    let disk_gib = u32::try_from(class.disk_gib)
        .ok()
        .filter(|&d| d >= 1)
        .ok_or_else(|| SpecError(format!("class diskGiB {} is below 1", class.disk_gib)))?;
    let guest_agent = vm
        .inherited
        .guest_agent
        .as_ref()
        .or(class.guest_agent.as_ref())
        .is_none_or(imp_api::shared::GuestAgentConfig::is_enabled);
    if !guest_agent {
        agentless(vm, class)?;
    }
    let cgroup = settings
        .cgroup_parent
        .as_ref()
        .map(|parent| vm_cgroup(format!("{parent}/{}", owner.uid), vcpus, memory_mib));
    Ok(VmSpec {
        image,
        layers: layers(vm),
        auth_file,
        entrypoint: None,
        command: Vec::new(),
        env,
        hostname: owner.name.clone(),
        vcpus,
        memory_mib,
        disk_gib,
        runtime,
        boot: BootFiles {
            kernel: settings.files.kernel.clone(),
            modules: settings.files.modules.clone(),
            guest: settings.files.guest.clone(),
            firecracker: (runtime == VmRuntime::Firecracker)
                .then(|| settings.files.firecracker.clone()),
            extra_kernel_args: settings.extra_kernel_args.clone(),
            allow_unjailed_firecracker: runtime == VmRuntime::Firecracker
                && settings.files.allow_unjailed_firecracker,
        },
        boot_timeout_ms: u64::try_from(settings.boot_timeout.as_millis()).unwrap_or(u64::MAX),
        remove_on_exit: false,
        attach: false,
        cgroup,
        cache_dir: Some(settings.cache_dir.clone()),
        image_max_bytes: settings.image_max_bytes,
        image_cache_max_bytes: settings.image_cache_max_bytes,
        owner: Some(owner),
        network: None,
        progress: false,
        guest_agent,
        from_snapshot: None,
        user_data: None,
    })
}

/// The images whose layers go over the VM's image, lowest first: its runner layer, then its
/// Cilium layer.
fn layers(vm: &ImpVMSpec) -> Vec<String> {
    [&vm.inherited.runner_layer, &vm.inherited.cilium_layer]
        .into_iter()
        .flatten()
        .filter(|l| !l.is_empty())
        .cloned()
        .collect()
}

/// What a VM without its guest agent cannot have, wherever it was inherited from: in-guest
/// probes, and a snapshot to clone (a clone takes its own identity through the agent).
fn agentless(vm: &ImpVMSpec, class: &ImpVMClassSpec) -> Result<(), SpecError> {
    let probes = vm.inherited.probes.as_ref().or(class.probes.as_ref());
    if probes.is_some_and(imp_api::shared::ProbeSpec::in_guest) {
        return Err(SpecError(format!(
            "spec.probes: {}",
            imp_api::validation::PROBES_NEED_AGENT
        )));
    }
    if vm.snapshot_ref.is_some() {
        return Err(SpecError(format!(
            "spec.snapshotRef: {}",
            imp_api::validation::CLONE_NEEDS_AGENT
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::inherited::Inherited;

    fn settings() -> BootSettings {
        BootSettings {
            files: HostFiles {
                kernel: "/k/vmlinux".into(),
                modules: "/k/modules".into(),
                guest: "/g".into(),
                firecracker: "/fc".into(),
                allow_unjailed_firecracker: false,
            },
            extra_kernel_args: Some("quiet".into()),
            boot_timeout: Duration::from_secs(60),
            cgroup_parent: Some("imp".into()),
            cache_dir: "/cache".into(),
            image_max_bytes: None,
            image_cache_max_bytes: Some(20 << 30),
        }
    }

    fn class() -> ImpVMClassSpec {
        ImpVMClassSpec {
            vcpu: 2,
            memory_mib: 512,
            disk_gib: 3,
            ..Default::default()
        }
    }

    fn owner() -> Owner {
        Owner {
            namespace: "ns".into(),
            name: "web".into(),
            uid: "0a-uid".into(),
            attempt: 2,
            revision: 0,
        }
    }

    fn choices(runtime: VmRuntime) -> Choices {
        Choices {
            runtime,
            env: vec![imp_proto::message::EnvVar::new("A", "1")],
            auth_file: None,
        }
    }

    #[test]
    fn the_class_sizes_the_vm_and_its_cgroup() {
        let vm = ImpVMSpec {
            inherited: Inherited {
                image: Some("127.0.0.1:5000/app:1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let s = vm_spec(
            owner(),
            &vm,
            &class(),
            choices(VmRuntime::Qemu),
            &settings(),
        )
        .unwrap();
        assert_eq!((s.vcpus, s.memory_mib, s.disk_gib), (2, 512, 3));
        assert_eq!(s.hostname, "web");
        assert_eq!(s.env, vec![imp_proto::message::EnvVar::new("A", "1")]);
        let cg = s.cgroup.unwrap();
        assert_eq!(cg.path, "imp/0a-uid");
        assert_eq!(cg.memory_limit_bytes, (512 + 384 + 128) << 20);
        assert_eq!(
            cg.limits,
            Limits {
                cpu_millis: Some(2500),
                cpu_weight: Some(200),
                pids_max: Some(VM_PIDS_MAX),
                io_weight: Some(200),
            }
        );
        assert_eq!(s.boot.firecracker, None);
        assert_eq!(s.owner.unwrap().attempt, 2);
        let fc = vm_spec(
            owner(),
            &vm,
            &class(),
            choices(VmRuntime::Firecracker),
            &settings(),
        );
        assert_eq!(fc.unwrap().boot.firecracker, Some("/fc".into()));
    }

    #[test]
    fn the_runner_and_cilium_layers_go_over_the_image_in_that_order() {
        let vm = ImpVMSpec {
            inherited: Inherited {
                image: Some("app:1".into()),
                runner_layer: Some("runner:1".into()),
                cilium_layer: Some("cilium:1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let s = vm_spec(
            owner(),
            &vm,
            &class(),
            choices(VmRuntime::Qemu),
            &settings(),
        )
        .unwrap();
        assert_eq!(s.layers, ["runner:1", "cilium:1"]);
        let only_cilium = ImpVMSpec {
            inherited: Inherited {
                runner_layer: Some(String::new()),
                ..vm.inherited
            },
            ..vm
        };
        let s = vm_spec(
            owner(),
            &only_cilium,
            &class(),
            choices(VmRuntime::Qemu),
            &settings(),
        );
        assert_eq!(s.unwrap().layers, ["cilium:1"]);
    }

    #[test]
    fn a_vms_cgroup_limits_follow_its_size_with_headroom_for_the_vmm() {
        let one = vm_cgroup("imp/a".into(), 1, 256);
        assert_eq!(one.path, "imp/a");
        assert_eq!(one.memory_limit_bytes, (256 + 384 + 64) << 20);
        // One vCPU and half a CPU more for QEMU's main loop and the shim.
        assert_eq!(one.limits.cpu_millis, Some(1500));
        assert_eq!(one.limits.cpu_weight, Some(100));
        assert_eq!(one.limits.io_weight, Some(100));
        assert_eq!(one.limits.pids_max, Some(512));
        let big = vm_cgroup("imp/b".into(), 255, 1 << 20);
        assert_eq!(big.limits.cpu_millis, Some(255_500));
        assert_eq!(big.limits.cpu_weight, Some(25_500), "clamped when written");
        assert_eq!(big.memory_limit_bytes, ((1 << 20) + 384 + (1 << 18)) << 20);
    }

    #[test]
    fn what_cannot_be_booted_is_refused_naming_the_field() {
        let no_image = ImpVMSpec::default();
        let e = vm_spec(
            owner(),
            &no_image,
            &class(),
            choices(VmRuntime::Qemu),
            &settings(),
        );
        assert!(e.unwrap_err().0.contains("spec.image"));
        let tiny = ImpVMClassSpec {
            memory_mib: 64,
            ..class()
        };
        let vm = ImpVMSpec {
            inherited: Inherited {
                image: Some("x".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = vm_spec(owner(), &vm, &tiny, choices(VmRuntime::Qemu), &settings()).unwrap_err();
        assert!(e.0.contains("memoryMiB 64"), "{e}");
    }
}
