//! A VM whose VMM starts from a snapshot instead of a boot: a suspended VM resumed from its
//! own ([`resume`]), or a new VM restored from an ImpVMSnapshot's files ([`restore_new`]),
//! which takes its own identity once its guest answers ([`take_identity`](super::supervise::take_identity)). Either is then
//! supervised as after a boot.

use std::path::Path;
use std::time::Instant;

use super::super::contract::{self, DISK_FILE, INITRD_FILE, MEMORY_FILE, STOPPED_EXIT_CODE};
use super::super::spec::VmSpec;
use super::super::state::{Stage, StateDir, VmRecord};
use super::failure::{Failure, at};
use super::prepare::{
    confinement, firecracker_launcher, give_initrd, qemu_launcher, vm_config, vm_files,
};
use super::signals::StopSignals;
use super::supervise::{Run, drive, identify};
use super::{Ended, Launch, ms, snapshot, suspend};
use imp_api::shared::VmRuntime;
use imp_vmm::GuestMemory;

/// Restores a suspended VM from its snapshot in a new VMM and supervises it as after a boot.
/// A missing or unusable snapshot fails the VM with [`Stage::Resume`] and the reason.
pub(super) async fn resume(
    state: &StateDir,
    dir: &Path,
    spec: &VmSpec,
    record: &mut VmRecord,
    stop: &mut StopSignals,
    tap: Option<std::os::fd::OwnedFd>,
) -> Ended {
    let snapshot_dir = record
        .suspend
        .as_ref()
        .map(|s| s.snapshot_dir.clone())
        .unwrap_or_else(|| state.snapshot_dir(&record.name));
    let files = contract::snapshot_files(&snapshot_dir);
    let present = tokio::task::spawn_blocking({
        let files = files.clone();
        move || suspend::snapshot_present(&files)
    })
    .await
    .unwrap_or_else(|_| Err(snapshot_dir.clone()));
    if let Err(missing) = present {
        return Ended::Failed(Failure::new(
            Stage::Resume,
            format!(
                "cannot resume {}: its snapshot file {} is missing",
                record.name,
                missing.display()
            ),
        ));
    }
    let confine = match confinement(state, spec, &record.name).await {
        Ok(c) => c,
        Err(f) => return Ended::Failed(f),
    };
    let mut config = vm_config(
        spec,
        dir,
        &record.name,
        (dir.join(INITRD_FILE), dir.join(DISK_FILE)),
        confine,
    );
    if let (Some(net), Some(fd), VmRuntime::Qemu) = (config.net.as_mut(), tap, spec.runtime) {
        net.tap_fd = Some(imp_vmm::TapFd(std::sync::Arc::new(fd)));
    }
    let writer = record.suspend.as_ref().and_then(|s| s.vmm.clone());
    if let Some(why) = imp_vmm::version::refuse_kind(writer.as_deref(), spec.runtime.as_str()) {
        return Ended::Failed(Failure::new(
            Stage::Resume,
            format!("cannot resume {}: {why}", record.name),
        ));
    }
    let run = |vmm_binary| Run {
        state,
        dir,
        spec,
        launch: Launch::Restore(&files),
        vmm_binary,
    };
    match spec.runtime {
        VmRuntime::Qemu => {
            let mut launcher = match qemu_launcher(state, spec, &config.kernel, Stage::Resume).await
            {
                Ok(l) => l,
                Err(f) => return Ended::Failed(f),
            };
            read_with_writer(&mut launcher, writer.as_deref(), &record.name).await;
            let run = run(&launcher.qemu);
            drive::<imp_vmm::qemu::Qemu>(&launcher, config, &run, record, stop).await
        }
        VmRuntime::Firecracker => {
            let Some(fc) = &spec.boot.firecracker else {
                return Ended::Failed(Failure::new(Stage::Config, "no Firecracker binary given"));
            };
            let launcher = firecracker_launcher(fc, state, spec, config.confine);
            let run = run(fc);
            drive::<imp_vmm::firecracker::Firecracker>(&launcher, config, &run, record, stop).await
        }
    }
}

/// Boots a new VM from the snapshot directory `spec.from_snapshot`: its disk and initramfs
/// copied into the VM's directory (sparse), its memory image mapped private where the VMM can
/// ([`CloneVmm::maps_image`]: every clone of the snapshot then shares the pages none has
/// written) or else copied too, its device state restored by a new VMM; once the guest
/// answers it takes this VM's identity ([`take_identity`](super::supervise::take_identity)).
pub(super) async fn restore_new(
    state: &StateDir,
    dir: &Path,
    spec: &VmSpec,
    record: &mut VmRecord,
    stop: &mut StopSignals,
) -> Ended {
    let Some(snap) = spec.from_snapshot.clone() else {
        return Ended::Failed(Failure::new(Stage::Config, "no snapshot to restore"));
    };
    let t = Instant::now();
    let confine = match confinement(state, spec, &record.name).await {
        Ok(c) => c,
        Err(f) => return Ended::Failed(f),
    };
    let mut vmm = match clone_vmm(state, spec, confine).await {
        Ok(v) => v,
        Err(f) => return Ended::Failed(f),
    };
    if let CloneVmm::Qemu(launcher) = &mut vmm {
        let writer = written_by(&snap).await;
        read_with_writer(launcher, writer.as_deref(), &record.name).await;
    }
    let loader = identify(spec.runtime, vmm.binary()).await;
    let seeded = tokio::select! {
        r = seed(spec, dir, &snap, vmm.maps_image(&loader)) => r,
        () = stop.requested() => return Ended::Exited(STOPPED_EXIT_CODE),
    };
    let (manifest, ram) = match seeded {
        Ok(s) => s,
        Err(why) => {
            return Ended::Failed(Failure::new(
                Stage::Disk,
                format!("restoring {} from {}: {why}", record.name, snap.display()),
            ));
        }
    };
    if let Err(f) = give_initrd(&dir.join(INITRD_FILE), confine).await {
        return Ended::Failed(f);
    }
    tracing::info!(vm = %record.name, snapshot = %snap.display(), writer = %manifest.vmm, %loader, memory = ?ram, "restoring a new VM from a snapshot");
    record.timings.boot_ms = ms(t.elapsed());
    let mut config = vm_config(
        spec,
        dir,
        &record.name,
        (dir.join(INITRD_FILE), dir.join(DISK_FILE)),
        confine,
    );
    // QEMU's RAM becomes the image; Firecracker loads its memory file from the snapshot
    // (linked into its jail) either way.
    if let (crate::snapshot::SeededRam::Mapped(image), CloneVmm::Qemu(_)) = (&ram, &vmm) {
        config.memory = GuestMemory::Private(image.clone());
    }
    let mut files = snapshot::vmm_files(&snap, &config.memory);
    if let (crate::snapshot::SeededRam::Copied, CloneVmm::Firecracker(_)) = (&ram, &vmm) {
        files.memory = dir.join(MEMORY_FILE);
    }
    if let Err(e) = state.save(record) {
        return Ended::Failed(at(Stage::Config, "saving the VM record")(e));
    }
    let run = Run {
        state,
        dir,
        spec,
        launch: Launch::Clone(&files, &manifest.vmm),
        vmm_binary: vmm.binary(),
    };
    match &vmm {
        CloneVmm::Qemu(l) => drive::<imp_vmm::qemu::Qemu>(l, config, &run, record, stop).await,
        CloneVmm::Firecracker(l) => {
            drive::<imp_vmm::firecracker::Firecracker>(l, config, &run, record, stop).await
        }
    }
}

/// Points `launcher` at a kept QEMU of the release that wrote the snapshot (`writer`) when
/// the node's own QEMU is of another release and the node keeps one
/// ([`imp_vmm::qemu::KEPT_ENV`]): a VM suspended before an upgrade of the node's QEMU
/// resumes with its memory, in the QEMU that can read it, and runs on in it until it boots
/// again. Without one the node's own QEMU tries, and a failure names both.
async fn read_with_writer(launcher: &mut imp_vmm::qemu::Launcher, writer: Option<&str>, vm: &str) {
    let Some(writer) = writer else { return };
    let kept = imp_vmm::qemu::kept_binaries();
    if kept.is_empty() {
        return;
    }
    let loader = identify(VmRuntime::Qemu, &launcher.qemu).await;
    if imp_vmm::version::same_release(writer, &loader) {
        return;
    }
    let mut known = Vec::with_capacity(kept.len());
    for binary in kept {
        known.push((identify(VmRuntime::Qemu, &binary).await, binary));
    }
    if let Some(binary) = imp_vmm::version::reader(writer, &loader, &known) {
        tracing::info!(%vm, %writer, node_qemu = %loader, kept = %binary.display(), "loading the snapshot with the kept QEMU of its writer's release");
        launcher.qemu = binary.to_path_buf();
    }
}

/// The VMM that wrote snapshot directory `snap`, from its manifest (none if unreadable: the
/// seed that follows reads it again and says why).
async fn written_by(snap: &Path) -> Option<String> {
    let path = snap.join(crate::snapshot::MANIFEST);
    let text = tokio::fs::read(&path).await.ok()?;
    serde_json::from_slice::<crate::snapshot::Manifest>(&text)
        .ok()
        .map(|m| m.vmm)
}

/// The VMM that restores a new VM from a snapshot.
enum CloneVmm {
    Qemu(imp_vmm::qemu::Launcher),
    Firecracker(imp_vmm::firecracker::Launcher),
}

impl CloneVmm {
    fn binary(&self) -> &Path {
        match self {
            CloneVmm::Qemu(l) => &l.qemu,
            CloneVmm::Firecracker(l) => &l.firecracker,
        }
    }

    /// Whether it maps the snapshot's memory image itself rather than a copy: Firecracker
    /// always maps its memory file private; QEMU from 8.2 ([`imp_vmm::qemu::PRIVATE_READ_ONLY_RAM`]).
    fn maps_image(&self, identity: &str) -> bool {
        match self {
            CloneVmm::Qemu(_) => {
                imp_vmm::version::at_least(identity, imp_vmm::qemu::PRIVATE_READ_ONLY_RAM)
            }
            CloneVmm::Firecracker(_) => true,
        }
    }
}

/// The VMM for a new VM restored from a snapshot. Firecracker only under its jailer: the
/// snapshot names its source's vsock socket, which only a chroot of the VM's own makes this
/// VM's.
async fn clone_vmm(
    state: &StateDir,
    spec: &VmSpec,
    confine: Option<imp_vmm::Confine>,
) -> Result<CloneVmm, Failure> {
    match spec.runtime {
        VmRuntime::Qemu => qemu_launcher(state, spec, &spec.boot.kernel, Stage::Boot)
            .await
            .map(CloneVmm::Qemu),
        VmRuntime::Firecracker => {
            let Some(fc) = &spec.boot.firecracker else {
                return Err(Failure::new(Stage::Config, "no Firecracker binary given"));
            };
            let launcher = firecracker_launcher(fc, state, spec, confine);
            if launcher.jailer.is_none() {
                return Err(Failure::new(
                    Stage::Config,
                    "restoring a new VM from a snapshot under Firecracker needs its jailer (the snapshot names its source's vsock socket)",
                ));
            }
            Ok(CloneVmm::Firecracker(launcher))
        }
    }
}

/// [`crate::snapshot::seed`] for VM `spec` in `dir` from snapshot `snap`, off the runtime.
async fn seed(
    spec: &VmSpec,
    dir: &Path,
    snap: &Path,
    map: bool,
) -> Result<(crate::snapshot::Manifest, crate::snapshot::SeededRam), String> {
    let (snap, dir, spec) = (snap.to_path_buf(), dir.to_path_buf(), spec.clone());
    tokio::task::spawn_blocking(move || {
        let want = crate::snapshot::Shape {
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            vmm: spec.runtime.as_str(),
        };
        let files = vm_files(&spec, &dir);
        let memory = dir.join(MEMORY_FILE);
        crate::snapshot::seed(&snap, want, (&files.disk, &files.initrd, &memory), map)
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()))
}
