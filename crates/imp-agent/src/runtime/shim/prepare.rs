//! What is built before the VMM runs: the image (with its extra layers) pulled into the node's
//! cache, the VM's own disk cloned from its ext4 base, the guest config written into the VM's
//! initramfs; and what the VMM is given, for a boot and for a restore alike: its config, the
//! uid it runs as and its launcher.

use std::path::{Path, PathBuf};
use std::time::Instant;

use imp_proto::config::{GuestConfig, RootDisk};

use super::super::contract::{DISK_FILE, INITRD_FILE, MEMORY_FILE};
use super::super::progress;
use super::super::spec::VmSpec;
use super::super::state::{Stage, StateDir, VmRecord};
use super::failure::{Failure, at, disk_failure_what, rootfs_failure_stage};
use super::{EXIT_REPORT_PORT, GUEST_CID, jailer, ms};
use crate::initramfs::{archive, modules};
use imp_api::shared::VmRuntime;
use imp_image::{ImageSource, ImageStore, ProgressEvent, PulledImage, RegistryAuth};
use imp_vmm::{DriveConfig, GuestMemory, NetConfig, VmConfig, VsockConfig};

/// Image → disk → initramfs: everything the VMM needs, as a [`VmConfig`].
pub(super) async fn prepare(
    state: &StateDir,
    dir: &Path,
    spec: &VmSpec,
    record: &mut VmRecord,
) -> Result<VmConfig, Failure> {
    let t = Instant::now();
    let (store, pulled, reporter) = pull(state, dir, spec).await?;
    let layers = pull_layers(&store, spec).await?;
    record.digest = Some(pulled.manifest_digest.clone());
    record.layer_digests = layers.iter().map(|l| l.manifest_digest.clone()).collect();
    record.timings.image_ms = ms(t.elapsed());

    let t = Instant::now();
    let image = (&pulled, layers.as_slice());
    let disk = root_disk(dir, spec, &store, image, &reporter, &record.name).await?;
    record.timings.disk_ms = ms(t.elapsed());
    if let Some(budget) = spec.image_cache_max_bytes {
        let ours = record.clone().image_chain().unwrap_or_default();
        evict_images(state, &store, budget, ours).await;
    }

    // The initramfs counts toward the boot step.
    let t = Instant::now();
    let (mut config, attach_argv) = guest_config(spec, pulled.config)?;
    if attach_argv.is_some() {
        record.attach_argv = attach_argv;
    }
    let initrd = vm_initramfs(state, dir, spec, &mut config).await?;
    record.timings.boot_ms = ms(t.elapsed());

    let confine = confinement(state, spec, &record.name).await?;
    give_initrd(&initrd, confine).await?;
    Ok(vm_config(spec, dir, &record.name, (initrd, disk), confine))
}

/// Pulls the spec's image into the node's image cache (with the spec's registry
/// credentials), reporting progress where the spec asks; returns the cache, the image and
/// the reporter for the steps after.
async fn pull(
    state: &StateDir,
    dir: &Path,
    spec: &VmSpec,
) -> Result<(ImageStore, PulledImage, imp_image::Reporter), Failure> {
    let source: ImageSource = spec
        .image
        .parse()
        .map_err(at(Stage::Image, format!("image {:?}", spec.image)))?;
    let auth = registry_auth(spec, &source).await?;
    let limits = imp_image::Limits::for_disk(u64::from(spec.disk_gib) << 30, spec.image_max_bytes);
    let reporter = progress_reporter(spec, dir);
    let store =
        ImageStore::new(spec.cache(state).join("images"), limits).with_reporter(reporter.clone());
    let pulled = store
        .pull(&source, &auth)
        .await
        .map_err(at(Stage::Image, format!("pulling {}", spec.image)))?;
    Ok((store, pulled, reporter))
}

/// Pulls the images of the spec's extra layers (`runnerLayer`, `ciliumLayer`) into `store`,
/// lowest first, each with the spec's credentials for its registry.
async fn pull_layers(store: &ImageStore, spec: &VmSpec) -> Result<Vec<PulledImage>, Failure> {
    let mut pulled = Vec::with_capacity(spec.layers.len());
    for layer in &spec.layers {
        let source: ImageSource = layer
            .parse()
            .map_err(at(Stage::Image, format!("layer image {layer:?}")))?;
        let auth = registry_auth(spec, &source).await?;
        let image = store
            .pull(&source, &auth)
            .await
            .map_err(at(Stage::Image, format!("pulling layer image {layer}")))?;
        pulled.push(image);
    }
    Ok(pulled)
}

async fn registry_auth(spec: &VmSpec, source: &ImageSource) -> Result<RegistryAuth, Failure> {
    let Some(path) = &spec.auth_file else {
        return Ok(RegistryAuth::Anonymous);
    };
    let ImageSource::Registry(r) = source else {
        return Ok(RegistryAuth::Anonymous);
    };
    let json = tokio::fs::read(path)
        .await
        .map_err(at(Stage::Image, format!("reading {}", path.display())))?;
    imp_image::auth_from_docker_config(&json, r.resolve_registry()).map_err(at(
        Stage::Image,
        format!("credentials in {}", path.display()),
    ))
}

/// Where the image pipeline reports: the VM's progress file when the spec asks for one,
/// else nowhere.
fn progress_reporter(spec: &VmSpec, dir: &Path) -> imp_image::Reporter {
    if !spec.progress {
        return imp_image::Reporter::default();
    }
    let path = dir.join(progress::PROGRESS_FILE);
    match progress::ProgressFile::create(&path) {
        Ok(f) => imp_image::Reporter::new(std::sync::Arc::new(f)),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %imp_api::chain::DisplayChain(&e), "cannot write the progress file; not reporting progress");
            imp_image::Reporter::default()
        }
    }
}

/// Gives VM `name` its own root disk in `dir` ([`DISK_FILE`], `spec.disk_gib` GiB), cloned
/// from the cached ext4 base of the image with its extra layers' images on top (built first
/// when not cached).
async fn root_disk(
    dir: &Path,
    spec: &VmSpec,
    store: &ImageStore,
    (pulled, layers): (&PulledImage, &[PulledImage]),
    reporter: &imp_image::Reporter,
    name: &str,
) -> Result<PathBuf, Failure> {
    let base = match store.rootfs(pulled, layers).await {
        Ok(base) => base,
        Err(e) => {
            let what = format!("building the root filesystem of {}", spec.image);
            let what = disk_failure_what(what, store.root(), &e).await;
            return Err(at(rootfs_failure_stage(&e), what)(e));
        }
    };
    let disk = dir.join(DISK_FILE);
    let size_bytes = u64::from(spec.disk_gib) << 30;
    reporter.emit(ProgressEvent::Cloning { size_bytes });
    if let Err(e) = imp_image::clone_disk(&base.path, &disk, size_bytes).await {
        let what = format!(
            "giving the VM its own {} GiB disk {}",
            spec.disk_gib,
            disk.display()
        );
        let what = disk_failure_what(what, dir, &e).await;
        return Err(at(Stage::Disk, what)(e));
    }
    reporter.emit(ProgressEvent::Cloned);
    tracing::info!(vm = %name, digest = %pulled.manifest_digest, cached = base.cached, "root disk ready");
    Ok(disk)
}

/// Brings the image cache within `budget` after a pull, keeping the images of the node's VM
/// records and `ours` (this VM's, whose record may not say so on disk yet). A failure is
/// logged: the VM starts all the same, and the agent tries again periodically.
async fn evict_images(state: &StateDir, store: &ImageStore, budget: u64, ours: Vec<String>) {
    let Some(mut in_use) = state.images_in_use().await else {
        return;
    };
    in_use.insert(ours);
    if let Err(e) = store.evict(budget, in_use).await {
        tracing::warn!(cache = %store.root().display(), error = %imp_api::chain::DisplayChain(&e), "evicting from the image cache");
    }
}

/// The guest config of the spec's VM running `image` from the root disk, and the workload's
/// argv when the spec asks to attach to it (the host then runs it as an exec session); an
/// attached VM with nothing to run is a [`Stage::Config`] failure.
fn guest_config(
    spec: &VmSpec,
    image: imp_proto::config::ImageConfig,
) -> Result<(GuestConfig, Option<Vec<String>>), Failure> {
    let mut config = GuestConfig {
        hostname: Some(spec.hostname.clone()),
        image,
        env: spec.env.clone(),
        network: spec.network.as_ref().map(|n| n.config.clone()),
        ..GuestConfig::default()
    };
    if let Some(entrypoint) = &spec.entrypoint {
        config.command = Some(vec![entrypoint.clone()]);
        config.args = Some(spec.command.clone());
    } else if !spec.command.is_empty() {
        config.args = Some(spec.command.clone());
    }
    config.agent.exit_report_port = Some(EXIT_REPORT_PORT);
    config.agent.enabled = spec.guest_agent;
    config.root = Some(RootDisk::ext4("/dev/vda"));
    config.user_data = spec.user_data.clone();
    if !spec.attach {
        return Ok((config, None));
    }
    config.attach = true;
    let argv = config.argv().ok_or_else(|| {
        Failure::new(
            Stage::Config,
            format!(
                "image {} has no ENTRYPOINT or CMD and no command was given",
                spec.image
            ),
        )
    })?;
    Ok((config, Some(argv)))
}

/// Writes the VM's initramfs into `dir` ([`INITRD_FILE`]): `config` on top of the cached
/// guest initramfs (built first when not cached), whose kernel modules `config` then lists.
async fn vm_initramfs(
    state: &StateDir,
    dir: &Path,
    spec: &VmSpec,
    config: &mut GuestConfig,
) -> Result<PathBuf, Failure> {
    let base_initrd = archive::BaseInitramfs::cached(
        &spec.cache(state).join("initramfs"),
        &spec.boot.guest,
        &spec.boot.modules,
        modules::VM_MODULES,
    )
    .await
    .map_err(at(Stage::Initramfs, "building the guest initramfs"))?;
    config.modules = base_initrd.module_paths().to_vec();
    let initrd = dir.join(INITRD_FILE);
    archive::build_for_vm(&base_initrd, config, &initrd)
        .await
        .map_err(at(Stage::Initramfs, "writing the VM's initramfs"))?;
    Ok(initrd)
}

/// Who VM `name`'s VMM runs as: the VM's own uid (see [`StateDir::vmm_uid`]); QEMU in a
/// jail of the driver's, Firecracker under its jailer ([`firecracker_launcher`]).
pub(super) async fn confinement(
    state: &StateDir,
    spec: &VmSpec,
    name: &str,
) -> Result<Option<imp_vmm::Confine>, Failure> {
    if spec.runtime == VmRuntime::Firecracker {
        let Some(fc) = spec.boot.firecracker.as_deref() else {
            return Err(Failure::new(Stage::Config, "no Firecracker binary given"));
        };
        match jailer::for_binary(fc, spec.boot.allow_unjailed_firecracker) {
            Ok(jailer::FirecrackerJail::Jailer(_)) => {}
            Ok(jailer::FirecrackerJail::Unjailed) => return Ok(None),
            Err(why) => return Err(Failure::new(Stage::Config, why)),
        }
    }
    let (state, id) = (state.clone(), name.to_owned());
    let uid = tokio::task::spawn_blocking(move || state.vmm_uid(&id))
        .await
        .map_err(|e| Failure::new(Stage::Config, format!("claiming a VMM uid: {e}")))?
        .map_err(at(Stage::Config, "claiming a VMM uid"))?;
    Ok(Some(imp_vmm::Confine { uid, gid: uid }))
}

/// Gives a confined VMM its initramfs: the file is owner-only (0600, it holds the VM's
/// environment) and the VMM reads it as its own uid; unconfined, it stays root's.
pub(super) async fn give_initrd(
    initrd: &Path,
    confine: Option<imp_vmm::Confine>,
) -> Result<(), Failure> {
    let Some(c) = confine else {
        return Ok(());
    };
    let path = initrd.to_path_buf();
    tokio::task::spawn_blocking(move || std::os::unix::fs::chown(&path, Some(c.uid), Some(c.gid)))
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r)
        .map_err(at(
            Stage::Initramfs,
            format!("giving {} to the VM's VMM uid {}", initrd.display(), c.uid),
        ))
}

/// The VMM's view of VM `name`: the same for its boot and for every restore of its snapshot
/// (a restore needs the drives, TAP and vsock where the snapshot expects them).
pub(super) fn vm_config(
    spec: &VmSpec,
    dir: &Path,
    name: &str,
    (initrd, disk): (PathBuf, PathBuf),
    confine: Option<imp_vmm::Confine>,
) -> VmConfig {
    let mut kernel_args = format!(
        "console=ttyS0 quiet loglevel=1 panic=-1 reboot=t tsc_early_khz={}",
        imp_vmm::qemu::host_tsc_khz()
    );
    if let Some(extra) = &spec.boot.extra_kernel_args {
        kernel_args.push(' ');
        kernel_args.push_str(extra);
    }
    VmConfig {
        id: name.to_owned(),
        run_dir: dir.to_path_buf(),
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        kernel: spec.boot.kernel.clone(),
        initrd: Some(initrd),
        kernel_args,
        drives: vec![DriveConfig {
            id: "root".into(),
            path: disk,
            read_only: false,
            root: true,
        }],
        net: spec.network.as_ref().map(|n| NetConfig {
            id: "eth0".into(),
            tap: n.tap.clone(),
            mac: Some(n.mac.clone()),
            tap_fd: None,
        }),
        vsock: Some(VsockConfig {
            guest_cid: GUEST_CID,
        }),
        netns: None,
        confine,
        // QEMU's RAM is mapped from a file beside the VM: a suspend then writes only the
        // device state, and a wake maps the file instead of reading it.
        memory: vm_files(spec, dir).memory,
    }
}

/// The files of VM `spec` in `dir` that a snapshot copies.
pub(super) struct VmFiles {
    pub(super) memory: GuestMemory,
    pub(super) disk: PathBuf,
    pub(super) initrd: PathBuf,
}

pub(super) fn vm_files(spec: &VmSpec, dir: &Path) -> VmFiles {
    VmFiles {
        memory: match spec.runtime {
            VmRuntime::Qemu => GuestMemory::Shared(dir.join(MEMORY_FILE)),
            VmRuntime::Firecracker => GuestMemory::Anonymous,
        },
        disk: dir.join(DISK_FILE),
        initrd: dir.join(INITRD_FILE),
    }
}

/// QEMU, with the accelerator a real boot of `kernel` found to work (cached).
pub(super) async fn qemu_launcher(
    state: &StateDir,
    spec: &VmSpec,
    kernel: &Path,
    stage: Stage,
) -> Result<imp_vmm::qemu::Launcher, Failure> {
    match imp_vmm::qemu::Launcher::detect() {
        Ok(l) => Ok(l.probe_accel(kernel, &spec.cache(state)).await),
        Err(e) => Err(at(stage, "finding QEMU")(e)),
    }
}

/// Firecracker's launcher: under its jailer (the VM's own uid, a chroot of its own, its
/// namespaces and seccomp filters) when `confine` says who it runs as; the jailer creates no
/// cgroup of its own (none is named), so Firecracker stays in the VM's cgroup with its shim.
pub(super) fn firecracker_launcher(
    fc: &Path,
    state: &StateDir,
    spec: &VmSpec,
    confine: Option<imp_vmm::Confine>,
) -> imp_vmm::firecracker::Launcher {
    let mut launcher = imp_vmm::firecracker::Launcher::new(fc.to_path_buf());
    if let (Some(binary), Some(c)) = (jailer::jailer_beside(fc), confine) {
        let cgroup_version = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            2
        } else {
            1
        };
        launcher.jailer = Some(imp_vmm::firecracker::JailerConfig {
            binary,
            chroot_base: state.root().join("jail"),
            uid: c.uid,
            gid: c.gid,
            cgroup_version,
            cgroups: Vec::new(),
            parent_cgroup: spec.cgroup.as_ref().map(|c| c.path.clone()),
        });
    }
    launcher
}

#[cfg(test)]
mod tests {
    use super::super::tests::spec_with;
    use super::*;

    fn image(entrypoint: &[&str], cmd: &[&str]) -> imp_proto::config::ImageConfig {
        imp_proto::config::ImageConfig {
            entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_guest_config_runs_the_specs_command_over_the_image_from_the_root_disk() {
        let spec = spec_with(serde_json::json!({"entrypoint": "/bin/app", "command": ["-v"]}));
        let (config, attach) = guest_config(&spec, image(&["/init"], &["x"])).unwrap();
        assert_eq!(attach, None);
        assert!(!config.attach);
        assert_eq!(config.command, Some(vec!["/bin/app".to_owned()]));
        assert_eq!(config.args, Some(vec!["-v".to_owned()]));
        assert_eq!(config.hostname.as_deref(), Some("web"));
        assert_eq!(config.agent.exit_report_port, Some(EXIT_REPORT_PORT));
        assert_eq!(config.root, Some(RootDisk::ext4("/dev/vda")));

        let spec = spec_with(serde_json::json!({"command": ["sleep", "1"]}));
        let (config, _) = guest_config(&spec, image(&["/init"], &["x"])).unwrap();
        assert_eq!(config.command, None, "the image's ENTRYPOINT stays");
        assert_eq!(config.args, Some(vec!["sleep".to_owned(), "1".to_owned()]));
        let (config, _) =
            guest_config(&spec_with(serde_json::json!({})), image(&[], &["x"])).unwrap();
        assert_eq!((config.command, config.args), (None, None));
    }

    #[test]
    fn an_attached_vm_gets_its_workloads_argv_or_fails_when_there_is_none() {
        let spec = spec_with(serde_json::json!({"attach": true}));
        let (config, argv) = guest_config(&spec, image(&["/bin/sh"], &["-l"])).unwrap();
        assert!(config.attach);
        assert_eq!(argv, Some(vec!["/bin/sh".to_owned(), "-l".to_owned()]));
        let f = guest_config(&spec, image(&[], &[])).unwrap_err();
        assert_eq!(f.stage, Stage::Config);
        assert_eq!(
            f.chain(),
            "image example.com/app:1 has no ENTRYPOINT or CMD and no command was given"
        );
    }
}
