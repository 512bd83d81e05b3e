//! The shim: one process per VM that owns its VMM from image to exit.
//!
//! Steps, each failure tagged with its [`Stage`]: move into the VM's cgroup, pull the image
//! into the shared cache, build (or reuse) its ext4 base, give the VM its own disk clone, write
//! the guest config into a per-VM initramfs on top of the cached guest initramfs, boot the VMM,
//! wait until the guest agent answers (status `running`), then wait for the VM to end and record
//! the workload's exit code from the guest's exit report over vsock or, failing that, the
//! `IMP_EXIT` marker at the end of the console. SIGTERM or SIGINT, at any step (the handlers
//! are the first thing installed), ask for a stop: before the VMM runs the start is abandoned,
//! after it the guest is asked once to shut down (the driver's graceful stop, with the grace
//! the front end wrote into `stop-grace-ms`), then the VMM is killed.
//!
//! The shim writes everything it learns into the VM's record; front ends and the node agent
//! read the record and never hold the VMM themselves, so they may come and go.

pub mod jailer;
pub mod serve;
pub mod snapshot;
pub mod suspend;

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use imp_proto::config::{GuestConfig, RootDisk};
use imp_proto::message::ExitStatus;
use tokio::signal::unix::{Signal, SignalKind, signal};

use super::cgroup::VmCgroup;
use super::console;
use super::contract::{
    self, DISK_FILE, FAIL_REASON_FILE, INITRD_FILE, MEMORY_FILE, STOP_GRACE_FILE, STOPPED_EXIT_CODE,
};
use super::guest_agent;
use super::progress;
use super::spec::{SPEC_FILE, VmSpec};
use super::state::{self, Stage, StateDir, SuspendFailure, SuspendRecord, VmRecord, VmStatus};
use crate::initramfs::{archive, modules};
use imp_api::shared::VmRuntime;
use imp_image::{ImageSource, ImageStore, ProgressEvent, PulledImage, RegistryAuth};
use imp_vmm::{
    DriveConfig, GuestMemory, NetConfig, SnapshotFiles, StopOutcome, VmConfig, Vmm, VsockConfig,
};

/// The guest port the workload's exit report is sent to (CID 2).
pub const EXIT_REPORT_PORT: u32 = 10001;
/// The guest's vsock context id; each VM has its own vsock device, so one value serves all.
pub const GUEST_CID: u32 = 3;
/// How much of the console's end is read for the exit marker and the failure tail.
const CONSOLE_TAIL_BYTES: u64 = 64 * 1024;
/// Console lines kept in the record of a failed VM.
const FAILURE_TAIL_LINES: usize = 20;

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
    fn new(stage: Stage, what: impl Into<String>) -> Self {
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
fn at<E: StdError + Send + Sync + 'static>(
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

/// SIGTERM and SIGINT (stop), and SIGUSR1 (suspend, see [`suspend`]), installed before
/// anything else so no request is lost, and a stop asked on the shim's API ([`serve`]).
struct StopSignals {
    term: Signal,
    int: Signal,
    usr1: Signal,
    asked: std::sync::Arc<tokio::sync::Notify>,
    /// Snapshots asked on the API, answered by the supervision loop.
    snapshots: tokio::sync::mpsc::Receiver<serve::SnapshotAsked>,
    snapshots_tx: tokio::sync::mpsc::Sender<serve::SnapshotAsked>,
    /// Suspends asked on the API (their tokens), taken by the supervision loop.
    suspends: tokio::sync::mpsc::Receiver<String>,
    suspends_tx: tokio::sync::mpsc::Sender<String>,
}

impl StopSignals {
    fn install() -> std::io::Result<Self> {
        let (snapshots_tx, snapshots) = tokio::sync::mpsc::channel(4);
        let (suspends_tx, suspends) = tokio::sync::mpsc::channel(4);
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            usr1: signal(SignalKind::user_defined1())?,
            asked: Default::default(),
            snapshots,
            snapshots_tx,
            suspends,
            suspends_tx,
        })
    }

    async fn requested(&mut self) {
        either(&mut self.term, &mut self.int, &self.asked).await;
    }
}

/// Waits for SIGTERM, SIGINT or a stop asked on the API.
async fn either(term: &mut Signal, int: &mut Signal, asked: &tokio::sync::Notify) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        () = asked.notified() => {}
    }
}

/// How the VM's run ended, before it is written into the record.
enum Ended {
    /// The workload's exit code (or [`STOPPED_EXIT_CODE`]).
    Exited(i32),
    /// A step failed.
    Failed(Failure),
    /// The VM was suspended to its snapshot and its VMM stopped.
    Suspended(SuspendRecord),
    /// The guest came up unable to run, said why and powered off: a new boot may fare better.
    BootAgain(String),
}

/// How many times a VM is booted when its guest asks for another boot.
const BOOT_ATTEMPTS: u32 = 3;

/// After boot `attempt` (from 1) ended with the guest asking for another one (`why`): `Ok` to
/// boot again, or the failure once [`BOOT_ATTEMPTS`] boots have been tried.
fn boot_again(attempt: u32, why: &str) -> Result<(), Failure> {
    if attempt < BOOT_ATTEMPTS {
        return Ok(());
    }
    Err(Failure::new(
        Stage::Boot,
        format!("the guest could not run in {attempt} boots: {why}"),
    ))
}

/// How the VMM comes to life: a fresh boot, or a restore of the VM's suspend snapshot.
#[derive(Clone, Copy)]
enum Launch<'a> {
    Boot,
    Restore(&'a SnapshotFiles),
    /// A new VM restored from an ImpVMSnapshot's files (`VmSpec::from_snapshot`), which it
    /// only reads, written by the VMM named (`kind version`): once up it takes this VM's
    /// identity.
    Clone(&'a SnapshotFiles, &'a str),
}

/// The shim's main: supervises VM `id` of `state` from its `spec.json` until it ends.
/// Returns once the record holds the end; the shim process then exits 0. `tap` is the VM's
/// TAP, already open, when the agent held it while the VM slept (a resume hands it to QEMU).
/// `control_fd` is the listening socket of the shim's API its starter bound
/// ([`super::shim_api::CONTROL_FD`]); without one the shim binds it itself.
pub async fn run(
    state: StateDir,
    id: String,
    tap: Option<std::os::fd::OwnedFd>,
    control_fd: Option<i32>,
) -> Result<(), state::StateError> {
    let dir = state.vm_dir(&id);
    // Signals first: a Ctrl-C during the image pull or the boot must not leave a VMM behind.
    let mut stop = StopSignals::install().map_err(|source| state::StateError::Io {
        action: "installing signal handlers for",
        path: dir.clone(),
        source,
    })?;
    let spec: VmSpec = state::read_json(&dir.join(SPEC_FILE))?;
    let adopted = suspend::adopted_for_resume(&state, &id).await;
    if adopted.is_none() && tap.is_some() {
        tracing::warn!(vm = %id, "given a TAP fd but not resuming; closing it");
    }
    let resuming = adopted.is_some();
    let mut record = match adopted {
        Some(mut r) => {
            r.status = VmStatus::Resuming;
            r.supervisor_pid = std::process::id();
            r.supervisor_started = state::process_start_time(r.supervisor_pid);
            r
        }
        None => contract::initial_record(&id, &dir, &spec, std::process::id()),
    };
    let feed = state::RecordFeed::new(record.clone());
    let state = state.announcing(feed.clone());
    serve_api(&dir, control_fd, feed, &stop);
    state.save(&record)?;
    tracing::info!(vm = %id, image = %spec.image, resuming, "shim started");
    let ended = match refuse_unjailed(&spec, &id).and_then(|()| join_cgroup(&spec)) {
        Ok(()) if resuming => resume(&state, &dir, &spec, &mut record, &mut stop, tap).await,
        Ok(()) if spec.from_snapshot.is_some() => {
            restore_new(&state, &dir, &spec, &mut record, &mut stop).await
        }
        Ok(()) => supervise(&state, &dir, &spec, &mut record, &mut stop).await,
        Err(f) => Ended::Failed(f),
    };
    let ended = failed_on_request(&dir, ended).await;
    finish(&mut record, ended).await;
    leave_cgroup(&spec).await;
    if spec.remove_on_exit && record.status.is_final() {
        state.remove(&id)
    } else {
        state.save(&record)
    }
}

/// Answers the shim's API ([`serve`]) from now until the shim ends. Without its socket the
/// VM runs on, driven by files and signals as a shim of an earlier release is.
fn serve_api(dir: &Path, control_fd: Option<i32>, feed: state::RecordFeed, stop: &StopSignals) {
    match serve::listener(dir, control_fd) {
        Ok(listener) => {
            let served = serve::Served {
                dir: dir.to_path_buf(),
                feed,
                stop: stop.asked.clone(),
                snapshots: stop.snapshots_tx.clone(),
                suspends: stop.suspends_tx.clone(),
            };
            tokio::spawn(serve::serve(listener, served));
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "the shim's API socket is unavailable; only files and signals reach this shim")
        }
    }
}

/// `ended`, or a failure when the agent stopped the VM as failed ([`FAIL_REASON_FILE`]).
async fn failed_on_request(dir: &Path, ended: Ended) -> Ended {
    if !matches!(ended, Ended::Exited(_)) {
        return ended;
    }
    match tokio::fs::read_to_string(dir.join(FAIL_REASON_FILE)).await {
        Ok(why) if !why.trim().is_empty() => Ended::Failed(Failure::new(Stage::Probe, why.trim())),
        _ => ended,
    }
}

/// Refuses a Firecracker VM whose Firecracker has no jailer beside it unless the spec's
/// front end was told to allow that ([`jailer::decide`]), before anything is pulled or
/// started; an allowed unconfined start is logged as a warning each time.
fn refuse_unjailed(spec: &VmSpec, id: &str) -> Result<(), Failure> {
    let Some(fc) = spec.boot.firecracker.as_deref() else {
        return Ok(());
    };
    if spec.runtime != VmRuntime::Firecracker {
        return Ok(());
    }
    match jailer::for_binary(fc, spec.boot.allow_unjailed_firecracker) {
        Ok(jailer::FirecrackerJail::Jailer(_)) => Ok(()),
        Ok(jailer::FirecrackerJail::Unjailed) => {
            tracing::warn!(
                vm = %id,
                firecracker = %fc.display(),
                opt_out = jailer::ALLOW_UNJAILED_FLAG,
                "starting Firecracker WITHOUT its jailer: the VMM runs unconfined, as root; a guest that escapes into it owns the node"
            );
            Ok(())
        }
        Err(why) => Err(Failure::new(Stage::Config, why)),
    }
}

/// Moves the shim (and so the VMM it starts) into the VM's own cgroup.
fn join_cgroup(spec: &VmSpec) -> Result<(), Failure> {
    let Some(cg) = &spec.cgroup else {
        return Ok(());
    };
    VmCgroup::create_limited(&cg.path, cg.memory_limit_bytes, &cg.limits)
        .and_then(|c| c.add(std::process::id()))
        .map_err(at(Stage::Config, format!("joining cgroup {}", cg.path)))
}

/// At the shim's end (its VMM is gone): out of the VM's cgroup, which is then removed with
/// anything still in it, so no front end has to remember it.
async fn leave_cgroup(spec: &VmSpec) {
    let Some(path) = spec.cgroup.as_ref().map(|c| c.path.clone()) else {
        return;
    };
    let left = tokio::task::spawn_blocking(move || {
        VmCgroup::at(&path).and_then(|c| c.leave_and_destroy(std::process::id()))
    })
    .await;
    if let Ok(Err(e)) = left {
        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "removing the VM's cgroup");
    }
}

/// Writes how the VM ended into its record, with the console's tail for failures.
async fn finish(record: &mut VmRecord, ended: Ended) {
    record.finished_unix = Some(state::now_unix());
    match ended {
        Ended::Exited(code) => {
            record.status = VmStatus::Exited;
            record.exit_code = Some(code);
            if code != 0 {
                let tail = keep_console_tail(record).await;
                // The guest's account of a failed user-data step: it started no workload.
                record.error = imp_proto::marker::find_user_data_failure(&tail)
                    .map(|why| format!("userData failed, the workload was not started: {why}"));
            }
        }
        Ended::Failed(f) => {
            tracing::warn!(vm = %record.name, stage = ?f.stage, error = %f.chain(), "VM failed");
            record.status = VmStatus::Failed;
            record.error = Some(f.chain());
            record.error_stage = Some(f.stage);
            keep_console_tail(record).await;
        }
        Ended::BootAgain(why) => {
            // `boot` turns every BootAgain into a boot or a failure; kept as a failure here.
            record.status = VmStatus::Failed;
            record.error = Some(why);
            record.error_stage = Some(Stage::Boot);
            keep_console_tail(record).await;
        }
        Ended::Suspended(s) => {
            record.finished_unix = None;
            record.status = VmStatus::Suspended;
            record.vmm_pid = None;
            record.helper_pids.clear();
            record.suspend = Some(s);
        }
    }
}

/// Keeps the console's last lines in the record of a VM that failed, for its failure Event;
/// the console's tail as read.
async fn keep_console_tail(record: &mut VmRecord) -> String {
    let tail = read_console_tail(&record.serial_log).await;
    if !tail.trim().is_empty() {
        record.console_tail = Some(console::last_lines(&tail, FAILURE_TAIL_LINES));
    }
    tail
}

async fn read_console_tail(path: &Path) -> String {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || console::tail(&path, CONSOLE_TAIL_BYTES))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default()
}

async fn supervise(
    state: &StateDir,
    dir: &Path,
    spec: &VmSpec,
    record: &mut VmRecord,
    stop: &mut StopSignals,
) -> Ended {
    let prepared = tokio::select! {
        r = prepare(state, dir, spec, record) => r,
        () = stop.requested() => return Ended::Exited(STOPPED_EXIT_CODE),
    };
    let config = match prepared {
        Ok(c) => c,
        Err(f) => return Ended::Failed(f),
    };
    if let Err(e) = state.save(record) {
        return Ended::Failed(at(Stage::Config, "saving the VM record")(e));
    }
    match spec.runtime {
        VmRuntime::Qemu => {
            let launcher = match qemu_launcher(state, spec, &config.kernel, Stage::Boot).await {
                Ok(l) => l,
                Err(f) => return Ended::Failed(f),
            };
            let run = Run {
                state,
                dir,
                spec,
                launch: Launch::Boot,
                vmm_binary: &launcher.qemu,
            };
            boot::<imp_vmm::qemu::Qemu>(&launcher, config, &run, record, stop).await
        }
        VmRuntime::Firecracker => {
            let Some(fc) = &spec.boot.firecracker else {
                return Ended::Failed(Failure::new(Stage::Config, "no Firecracker binary given"));
            };
            let launcher = firecracker_launcher(fc, state, spec, config.confine);
            let run = Run {
                state,
                dir,
                spec,
                launch: Launch::Boot,
                vmm_binary: fc,
            };
            boot::<imp_vmm::firecracker::Firecracker>(&launcher, config, &run, record, stop).await
        }
    }
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

/// Boots a new VM from the snapshot directory `spec.from_snapshot`: its disk and initramfs
/// copied into the VM's directory (sparse), its memory image mapped private where the VMM can
/// ([`CloneVmm::maps_image`]: every clone of the snapshot then shares the pages none has
/// written) or else copied too, its device state restored by a new VMM; once the guest
/// answers it takes this VM's identity ([`take_identity`]).
async fn restore_new(
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
    let vmm = match clone_vmm(state, spec, confine).await {
        Ok(v) => v,
        Err(f) => return Ended::Failed(f),
    };
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

/// QEMU, with the accelerator a real boot of `kernel` found to work (cached).
async fn qemu_launcher(
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

/// A VM restored from another's snapshot still has that VM's clock, hostname, entropy,
/// MAC, address and TCP connections: it takes its own (the guest reseeds its generator, sets
/// its clock and names, readdresses its interface and drops the source's connections). A
/// clone that cannot is failed: it would run as a second copy of its source. Its network
/// link, down since the restore, comes up only then.
async fn take_identity<V: Vmm>(
    vm: &mut V,
    run: &Run<'_>,
    record: &VmRecord,
) -> Result<(), Failure> {
    let identity = imp_proto::message::Identity {
        hostname: Some(run.spec.hostname.clone()),
        mac: run.spec.network.as_ref().map(|n| n.mac.clone()),
        network: run.spec.network.as_ref().map(|n| n.config.clone()),
    };
    let report = guest_agent::reidentify(
        &record.vsock,
        record.agent_port,
        &identity,
        Duration::from_secs(30),
    )
    .await
    .map_err(at(
        Stage::GuestReady,
        "giving the restored guest its own identity",
    ))?;
    if !report.is_complete() {
        return Err(Failure::new(
            Stage::GuestReady,
            format!("the restored guest could not take its own identity: {report}"),
        ));
    }
    if run.spec.network.is_some() {
        vm.set_link(true).await.map_err(at(
            Stage::GuestReady,
            "connecting the restored guest's network",
        ))?;
    }
    tracing::info!(vm = %record.name, hostname = %run.spec.hostname, report = %report.to_string().replace('\n', "; "), "restored guest took its identity");
    Ok(())
}

/// Restores a suspended VM from its snapshot in a new VMM and supervises it as after a boot.
/// A missing or unusable snapshot fails the VM with [`Stage::Resume`] and the reason.
async fn resume(
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
            let launcher = match qemu_launcher(state, spec, &config.kernel, Stage::Resume).await {
                Ok(l) => l,
                Err(f) => return Ended::Failed(f),
            };
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

/// Firecracker's launcher: under its jailer (the VM's own uid, a chroot of its own, its
/// namespaces and seccomp filters) when `confine` says who it runs as; the jailer creates no
/// cgroup of its own (none is named), so Firecracker stays in the VM's cgroup with its shim.
fn firecracker_launcher(
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

/// `what` of a failed disk step, saying so when it failed because the filesystem of `dir` is
/// full ([`full_disk_what`]); the partial file is already gone (the image pipeline writes
/// under temporary names and removes them on failure).
async fn disk_failure_what(what: String, dir: &Path, e: &imp_image::ImageError) -> String {
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

/// Image → disk → initramfs: everything the VMM needs, as a [`VmConfig`].
async fn prepare(
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

/// Gives a confined VMM its initramfs: the file is owner-only (0600, it holds the VM's
/// environment) and the VMM reads it as its own uid; unconfined, it stays root's.
async fn give_initrd(initrd: &Path, confine: Option<imp_vmm::Confine>) -> Result<(), Failure> {
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

/// The stage a failure to build an image's root filesystem belongs to: a layer that cannot
/// be applied is the image's fault, anything else the disk's.
fn rootfs_failure_stage(e: &imp_image::ImageError) -> Stage {
    match e {
        imp_image::ImageError::Layer(_) | imp_image::ImageError::UnsupportedMediaType { .. } => {
            Stage::Image
        }
        _ => Stage::Disk,
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

/// The VMM's view of VM `name`: the same for its boot and for every restore of its snapshot
/// (a restore needs the drives, TAP and vsock where the snapshot expects them).
fn vm_config(
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

/// Who VM `name`'s VMM runs as: the VM's own uid (see [`StateDir::vmm_uid`]); QEMU in a
/// jail of the driver's, Firecracker under its jailer ([`firecracker_launcher`]).
async fn confinement(
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

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What [`drive`] needs besides the VMM: where the VM lives, its spec and how to launch it.
struct Run<'a> {
    state: &'a StateDir,
    dir: &'a Path,
    spec: &'a VmSpec,
    launch: Launch<'a>,
    /// The VMM's binary, whose `kind version` ([`imp_vmm::version`]) the record and the snapshot
    /// keep.
    vmm_binary: &'a Path,
}

/// ` (why)` when a snapshot written by `writer` failed to load in `loader`, a VMM of
/// another version; else nothing.
fn skew(writer: Option<&str>, loader: &str) -> String {
    imp_vmm::version::skew_note(writer, loader)
        .map(|n| format!(" ({n})"))
        .unwrap_or_default()
}

/// The identity of the VMM `binary` of `runtime` (it runs `binary --version`, off the runtime).
async fn identify(runtime: VmRuntime, binary: &Path) -> String {
    let binary = binary.to_path_buf();
    let kind = runtime.as_str();
    tokio::task::spawn_blocking(move || imp_vmm::version::of_binary(kind, &binary))
        .await
        .unwrap_or_else(|_| imp_vmm::version::identity(kind, ""))
}

impl Run<'_> {
    /// The stage a failure to launch or to reach the guest belongs to.
    fn stage(&self, boot: Stage) -> Stage {
        match self.launch {
            Launch::Boot => boot,
            Launch::Restore(_) => Stage::Resume,
            Launch::Clone(..) => boot,
        }
    }
}

/// Starts the VMM: boots the kernel, or restores the snapshot and resumes the guest.
async fn launch<V: Vmm>(
    launcher: &V::Launcher,
    config: &VmConfig,
    how: Launch<'_>,
) -> Result<V, V::Error> {
    match how {
        Launch::Boot => V::boot(launcher, config).await,
        Launch::Restore(files) => V::restore(launcher, config, files, true).await,
        // Off the network until it has its own identity (see `take_identity`).
        Launch::Clone(files, _) => {
            let mut vm = V::restore(launcher, config, files, false).await?;
            if config.net.is_some() {
                vm.set_link(false).await?;
            }
            vm.resume().await?;
            Ok(vm)
        }
    }
}

/// How the supervision loop ended.
enum LoopEnd {
    /// A stop was requested.
    StopRequested,
    /// The VMM exited on its own.
    Exited,
    /// The VM is paused and snapshotted; its VMM must still be stopped.
    Suspended(SuspendRecord),
    /// Something failed.
    Failed(Failure),
}

/// Boots the VM and supervises it until it ends or is suspended; a guest that asks for another
/// boot (its kernel came up unable to run it) gets one, up to [`BOOT_ATTEMPTS`] in all.
async fn boot<V: Vmm>(
    launcher: &V::Launcher,
    config: VmConfig,
    run: &Run<'_>,
    record: &mut VmRecord,
    stop: &mut StopSignals,
) -> Ended {
    let mut attempt = 1;
    loop {
        let why = match drive::<V>(launcher, config.clone(), run, record, stop).await {
            Ended::BootAgain(why) => why,
            other => return other,
        };
        if let Err(f) = boot_again(attempt, &why) {
            return Ended::Failed(f);
        }
        tracing::warn!(vm = %record.name, attempt, why, "the guest asked for another boot; booting it again");
        attempt += 1;
    }
}

/// Boots (or restores) the VMM and supervises it until it ends or is suspended.
async fn drive<V: Vmm>(
    launcher: &V::Launcher,
    config: VmConfig,
    run: &Run<'_>,
    record: &mut VmRecord,
    stop: &mut StopSignals,
) -> Ended {
    let t = Instant::now();
    // A stop during the boot drops the boot future, and with it the VMM's process handle,
    // which kills the VMM: nothing is left running.
    // The VMM's version is asked beside the launch, not before it: a resume is a wake's path.
    let launched = async {
        tokio::join!(
            launch::<V>(launcher, &config, run.launch),
            identify(run.spec.runtime, run.vmm_binary)
        )
    };
    let (booted, identity) = tokio::select! {
        r = launched => r,
        () = stop.requested() => return Ended::Exited(STOPPED_EXIT_CODE),
    };
    // The VMM has what it needs; an inherited TAP fd in the config is closed here, so once
    // the VMM ends nobody holds the TAP and the agent can hold it for the sleeping VM.
    let memory = config.memory.clone();
    drop(config);
    let mut vm = match booted {
        Ok(vm) => vm,
        Err(e) => {
            let what = launch_failure_what(run.launch, record, &identity);
            return Ended::Failed(at(run.stage(Stage::Boot), what)(e));
        }
    };
    if matches!(run.launch, Launch::Boot | Launch::Clone(..)) {
        record.timings.boot_ms += ms(t.elapsed());
    }
    let mut reports = match adopt(&vm, run, record, &identity) {
        Ok(reports) => reports,
        Err(f) => {
            let _ = vm.stop(Duration::ZERO).await;
            return Ended::Failed(f);
        }
    };
    let mut reported: Option<ExitStatus> = None;
    let end = supervise_loop(&mut vm, run, record, stop, &mut reports, &mut reported, t).await;
    let stopped = match end {
        LoopEnd::StopRequested => {
            stop_on_request(vm, run.dir, &record.name).await;
            true
        }
        LoopEnd::Exited => false,
        LoopEnd::Failed(f) => {
            let _ = vm.stop(Duration::ZERO).await;
            return Ended::Failed(f);
        }
        LoopEnd::Suspended(mut s) => {
            s.vmm = Some(identity);
            put_to_sleep(vm, memory, &mut s, record).await;
            return Ended::Suspended(s);
        }
    };
    if reported.is_none() {
        reported = tokio::time::timeout(Duration::from_millis(300), reports.recv())
            .await
            .ok()
            .flatten();
    }
    let booting = matches!(run.launch, Launch::Boot) && record.status != VmStatus::Running;
    ended_by(record, reported, stopped, booting).await
}

/// `what` of a VMM that failed to launch `how`: booting, or restoring from which snapshot,
/// with a note when the snapshot was written by a VMM of another version than `identity`.
fn launch_failure_what(how: Launch<'_>, record: &VmRecord, identity: &str) -> String {
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

/// Takes the launched VMM into the record (its pids, version, console and vsock), saves the
/// record and listens for the guest's exit reports.
fn adopt<V: Vmm>(
    vm: &V,
    run: &Run<'_>,
    record: &mut VmRecord,
    identity: &str,
) -> Result<tokio::sync::mpsc::Receiver<ExitStatus>, Failure> {
    record.vmm_pid = vm.pid();
    record.vmm = Some(identity.to_owned());
    record.helper_pids = vm.helper_pids();
    record.serial_log = vm.serial_log_path().to_path_buf();
    record.vsock = vm
        .vsock_path()
        .ok_or_else(|| Failure::new(Stage::Boot, "the VMM gave the VM no vsock socket"))?;
    run.state
        .save(record)
        .map_err(at(Stage::Boot, "saving the VM record"))?;
    guest_agent::listen_for_exit_reports(&record.vsock, EXIT_REPORT_PORT)
        .map_err(at(Stage::Boot, "receiving exit reports"))
}

/// Stops the VM as asked: its guest is asked to power off within the grace the front end
/// wrote ([`stop_grace`]), then its VMM is killed; the outcome is logged.
async fn stop_on_request<V: Vmm>(vm: V, dir: &Path, name: &str) {
    let grace = stop_grace(dir).await;
    match vm.stop(grace).await {
        Ok(StopOutcome::Killed) => {
            tracing::warn!(vm = %name, ?grace, "did not power off within the grace period; killed")
        }
        Ok(StopOutcome::Graceful) => tracing::info!(vm = %name, "stopped"),
        Err(e) => {
            tracing::warn!(vm = %name, error = %imp_api::chain::DisplayChain(&e), "stopping the VMM failed")
        }
    }
}

/// Ends a suspended VM's VMM and writes back its RAM file (`memory`, when shared), adding
/// the bytes stored to `s` and the time taken to the record's suspend time.
async fn put_to_sleep<V: Vmm>(
    vm: V,
    memory: GuestMemory,
    s: &mut SuspendRecord,
    record: &mut VmRecord,
) {
    // The snapshot holds the VM: its VMM goes, and its memory with it.
    let t = Instant::now();
    if let Err(e) = vm.stop(Duration::ZERO).await {
        tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "stopping the suspended VMM failed");
    }
    if let GuestMemory::Shared(file) = memory {
        // The RAM file's pages are still in the page cache, many dirty: written back
        // and dropped here, the sleeping VM holds no memory.
        let f = file.clone();
        match tokio::task::spawn_blocking(move || suspend::release_memory_file(&f)).await {
            Ok(Ok(stored)) => s.bytes += stored,
            Ok(Err(e)) => {
                tracing::warn!(vm = %record.name, file = %file.display(), error = %imp_api::chain::DisplayChain(&e), "writing back the suspended VM's memory failed; it stays in the page cache")
            }
            Err(e) => {
                tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "writing back the suspended VM's memory")
            }
        }
    }
    record.timings.suspend_ms += ms(t.elapsed());
    tracing::info!(vm = %record.name, phase = "Suspended", suspend_ms = record.timings.suspend_ms, bytes = s.bytes, "VM suspended");
}

/// How a VM whose VMM ended (or was stopped) ended, from its exit report or console marker;
/// a guest that never came up (`booting`) may have asked for another boot.
async fn ended_by(
    record: &VmRecord,
    mut reported: Option<ExitStatus>,
    stopped: bool,
    booting: bool,
) -> Ended {
    if let Some(status) = reported.take() {
        return Ended::Exited(status.code());
    }
    let tail = read_console_tail(&record.serial_log).await;
    if booting
        && !stopped
        && let Some(why) = imp_proto::marker::find_boot_retry(&tail)
    {
        return Ended::BootAgain(why);
    }
    match imp_proto::marker::find_exit_code(&tail) {
        Some(code) => Ended::Exited(code),
        // Stopped on request before the workload reported (also while the guest booted).
        None if stopped => Ended::Exited(STOPPED_EXIT_CODE),
        None => Ended::Failed(Failure::new(
            Stage::Run,
            format!(
                "the VM ended without reporting its workload's exit; console: {}",
                record.serial_log.display()
            ),
        )),
    }
}

/// Watches the running VM: its guest agent's first answer (Running), exit reports, stop and
/// suspend requests, and the VMM's own exit.
async fn supervise_loop<V: Vmm>(
    vm: &mut V,
    run: &Run<'_>,
    record: &mut VmRecord,
    stop: &mut StopSignals,
    reports: &mut tokio::sync::mpsc::Receiver<ExitStatus>,
    reported: &mut Option<ExitStatus>,
    launched: Instant,
) -> LoopEnd {
    let ready_started = Instant::now();
    let vsock = record.vsock.clone();
    let health = guest_agent::wait_healthy(&vsock, record.agent_port, run.spec.boot_timeout());
    tokio::pin!(health);
    // Without its guest agent the VM runs once its VMM does: nothing inside can say more.
    let mut healthy = !run.spec.guest_agent;
    if healthy {
        if matches!(run.launch, Launch::Clone(..)) {
            return LoopEnd::Failed(Failure::new(
                Stage::GuestReady,
                "a clone takes its own identity through the guest agent, which this VM runs without",
            ));
        }
        became_ready(run, record, ready_started, launched).await;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = either(&mut stop.term, &mut stop.int, &stop.asked) => break LoopEnd::StopRequested,
            _ = stop.usr1.recv() => {
                handle_snapshot(vm, run, record).await;
                if let Some(s) = handle_suspend(vm, run, record).await {
                    break LoopEnd::Suspended(s);
                }
            }
            Some((req, answer)) = stop.snapshots.recv() => {
                let _ = answer.send(take_snapshot(vm, run, record, &req).await);
            }
            Some(token) = stop.suspends.recv() => {
                if let Some(s) = suspend_now(vm, run, record, token).await {
                    break LoopEnd::Suspended(s);
                }
            }
            Some(status) = reports.recv() => *reported = Some(status),
            r = &mut health, if !healthy => {
                healthy = true;
                match r {
                    Ok(_) => {
                        if matches!(run.launch, Launch::Clone(..))
                            && let Err(f) = take_identity(vm, run, record).await
                        {
                            break LoopEnd::Failed(f);
                        }
                        became_ready(run, record, ready_started, launched).await;
                    }
                    Err(e) if reported.is_none() && !vm.exited().unwrap_or(true) => {
                        // Said with the time it took: a handshake that failed at once is
                        // not a guest that never booted.
                        break LoopEnd::Failed(at(run.stage(Stage::GuestReady), format!(
                            "the guest did not come up ({} ms of the {:?} allowed); console: {}",
                            ready_started.elapsed().as_millis(),
                            run.spec.boot_timeout(),
                            record.serial_log.display()
                        ))(e));
                    }
                    Err(_) => {}
                }
            }
        }
        match vm.exited() {
            Ok(false) => {}
            Ok(true) => break LoopEnd::Exited,
            Err(e) => return LoopEnd::Failed(at(Stage::Run, "checking the VMM")(e)),
        }
    }
}

/// The guest agent answered: the VM runs (again, after a restore: then its clock is set and
/// the used snapshot removed).
async fn became_ready(
    run: &Run<'_>,
    record: &mut VmRecord,
    ready_started: Instant,
    launched: Instant,
) {
    record.status = VmStatus::Running;
    match run.launch {
        Launch::Clone(..) => {
            record.running_unix = Some(state::now_unix());
            record.timings.ready_ms = ms(ready_started.elapsed());
            tracing::info!(vm = %record.name, ready_ms = record.timings.ready_ms, boot_ms = record.timings.boot_ms, "restored from a snapshot; guest agent answered");
        }
        Launch::Boot => {
            record.running_unix = Some(state::now_unix());
            record.timings.ready_ms = ms(ready_started.elapsed());
            if run.spec.guest_agent {
                tracing::info!(vm = %record.name, ready_ms = record.timings.ready_ms, "guest agent answered");
            } else {
                tracing::info!(vm = %record.name, "the VMM runs; the VM has no guest agent to wait for");
            }
        }
        Launch::Restore(files) => {
            // The guest's clock stopped at the snapshot: set it to now (through its agent;
            // a guest without one keeps its clock until it resyncs by itself).
            let clock = match run.spec.guest_agent {
                true => {
                    guest_agent::set_clock(
                        &record.vsock,
                        record.agent_port,
                        std::time::SystemTime::now(),
                        Duration::from_secs(10),
                    )
                    .await
                }
                false => Ok(()),
            };
            if let Err(e) = clock {
                tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "setting the resumed guest's clock failed");
            }
            record.timings.resume_ms = ms(launched.elapsed());
            let snapshot = files.memory.parent().map(Path::to_path_buf);
            record.suspend = None;
            if let Some(dir) = snapshot {
                let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
            }
            tracing::info!(vm = %record.name, phase = "Running", resume_ms = record.timings.resume_ms, "VM resumed");
        }
    }
    if let Err(e) = run.state.save(record) {
        tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "saving the VM record");
    }
}

/// A snapshot request file arrived (a front end without the API): snapshot the running VM
/// into its destination and answer in the outcome file; the VM runs on.
async fn handle_snapshot<V: Vmm>(vm: &mut V, run: &Run<'_>, record: &VmRecord) {
    let Some(req) = snapshot::take_request(run.dir) else {
        return;
    };
    let outcome = take_snapshot(vm, run, record, &req).await;
    let path = run.dir.join(contract::SNAPSHOT_OUTCOME_FILE);
    if let Err(e) = state::write_json(&path, &outcome) {
        tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "writing the snapshot outcome");
    }
}

/// Snapshots the running VM as `req` asks and says how it went; the VM runs on.
async fn take_snapshot<V: Vmm>(
    vm: &mut V,
    run: &Run<'_>,
    record: &VmRecord,
    req: &contract::SnapshotRequest,
) -> contract::SnapshotOutcome {
    let outcome = if record.status == VmStatus::Running {
        let config = vm_files(run.spec, run.dir);
        let machine = match run.spec.runtime {
            VmRuntime::Qemu => "microvm",
            VmRuntime::Firecracker => "firecracker",
        };
        let src = snapshot::Sources {
            vmm: record.vmm.as_deref().unwrap_or("unknown"),
            machine,
            vcpus: run.spec.vcpus,
            memory_mib: run.spec.memory_mib,
            memory: &config.memory,
            disk: &config.disk,
            initrd: &config.initrd,
        };
        snapshot::take(vm, &src, req).await
    } else {
        contract::SnapshotOutcome {
            token: req.token.clone(),
            result: Err(format!("the VM is {}, not running", record.status.as_str())),
            bytes: 0,
        }
    };
    match &outcome.result {
        Ok(m) => {
            tracing::info!(vm = %record.name, dest = %req.dest.display(), pause_ms = m.pause_ms, bytes = outcome.bytes, "snapshot taken")
        }
        Err(e) => {
            tracing::warn!(vm = %record.name, dest = %req.dest.display(), error = %e, "snapshot failed; the VM runs on")
        }
    }
    outcome
}

/// The files of VM `spec` in `dir` that a snapshot copies.
struct VmFiles {
    memory: GuestMemory,
    disk: PathBuf,
    initrd: PathBuf,
}

fn vm_files(spec: &VmSpec, dir: &Path) -> VmFiles {
    VmFiles {
        memory: match spec.runtime {
            VmRuntime::Qemu => GuestMemory::Shared(dir.join(MEMORY_FILE)),
            VmRuntime::Firecracker => GuestMemory::Anonymous,
        },
        disk: dir.join(DISK_FILE),
        initrd: dir.join(INITRD_FILE),
    }
}

/// A suspend request arrived: snapshot the VM if it runs. `None` when there was nothing to do
/// or the suspend failed (the VM runs on and the record says why).
async fn handle_suspend<V: Vmm>(
    vm: &mut V,
    run: &Run<'_>,
    record: &mut VmRecord,
) -> Option<SuspendRecord> {
    let token = suspend::take_request(run.dir)?;
    suspend_now(vm, run, record, token).await
}

/// Suspends the running VM for the request `token`: its snapshot written, the VM paused for
/// its VMM to end; or, when that fails, the failure in the record and the VM running on.
async fn suspend_now<V: Vmm>(
    vm: &mut V,
    run: &Run<'_>,
    record: &mut VmRecord,
    token: String,
) -> Option<SuspendRecord> {
    let fail = |record: &mut VmRecord, error: String| {
        tracing::warn!(vm = %record.name, error, "suspend failed; the VM keeps running");
        record.suspend_failure = Some(SuspendFailure {
            request: token.clone(),
            failed_unix: state::now_unix(),
            error,
        });
        if let Err(e) = run.state.save(record) {
            tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "saving the VM record");
        }
    };
    if record.status != VmStatus::Running {
        fail(
            record,
            format!("the VM is {}, not running", record.status.as_str()),
        );
        return None;
    }
    let t = Instant::now();
    record.status = VmStatus::Suspending;
    if let Err(e) = run.state.save(record) {
        tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "saving the VM record");
    }
    let dir = run.state.snapshot_dir(&record.name);
    // RAM mapped from a file is not in the stream; the file has its room already.
    let streamed_mib = match run.spec.runtime {
        VmRuntime::Qemu => 0,
        VmRuntime::Firecracker => run.spec.memory_mib,
    };
    match suspend::suspend_vm(vm, &dir, streamed_mib).await {
        Ok(s) => {
            record.timings.suspend_ms = ms(t.elapsed());
            tracing::info!(vm = %record.name, snapshot_ms = record.timings.suspend_ms, bytes = s.bytes, "snapshot written");
            Some(s)
        }
        Err(e) => {
            record.status = VmStatus::Running;
            let error = imp_api::chain::chain(&e);
            fail(record, imp_image::layers::escape_controls(&error));
            None
        }
    }
}

async fn stop_grace(dir: &Path) -> Duration {
    tokio::fs::read_to_string(dir.join(STOP_GRACE_FILE))
        .await
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(10))
}

/// In the shim: takes ownership of the TAP fd its starter passed (`--tap-fd`), after checking
/// it is open, and makes it close-on-exec so only the VMM it is handed to inherits it.
#[allow(unsafe_code)]
pub fn inherited_tap(fd: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    if fd < 3 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("--tap-fd {fd}: descriptors 0-2 are the standard streams"),
        ));
    }
    // SAFETY: fcntl on any integer is safe; it fails with EBADF for a closed descriptor.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            e.kind(),
            format!("--tap-fd {fd} is not an open descriptor: {e}"),
        ));
    }
    // SAFETY: the descriptor is open (checked above) and nothing else in this process owns
    // it: it was inherited for this very purpose and is taken once, at start.
    unsafe {
        libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        Ok(std::os::fd::OwnedFd::from_raw_fd(fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec of image `image` with only what serde requires, plus `extra` fields.
    fn spec_with(extra: serde_json::Value) -> VmSpec {
        let mut json = serde_json::json!({
            "image": "example.com/app:1",
            "hostname": "web",
            "vcpus": 1,
            "memory_mib": 256,
            "disk_gib": 1,
            "runtime": "qemu",
            "boot": {"kernel": "/k", "modules": "/m", "guest": "/g"},
            "boot_timeout_ms": 1000,
        });
        if let (Some(json), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
            json.extend(extra.clone());
        }
        serde_json::from_value(json).unwrap()
    }

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

    /// A Firecracker with no jailer beside it is refused before anything is pulled, as a
    /// config failure (the agent's `RuntimeStartFailed`) naming the opt-out; with the opt-out
    /// it starts unconfined.
    #[tokio::test]
    async fn firecracker_without_its_jailer_is_refused_unless_the_spec_allows_it() {
        let dir = std::env::temp_dir().join(format!("imp-unjailed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fc = dir.join("firecracker");
        std::fs::write(&fc, b"").unwrap();
        let state = StateDir::new(dir.join("state"));
        let boot = |allow: bool| {
            serde_json::json!({"runtime": "firecracker", "boot": {
                "kernel": "/k", "modules": "/m", "guest": "/g",
                "firecracker": fc, "allow_unjailed_firecracker": allow,
            }})
        };
        let refused = spec_with(boot(false));
        let f = confinement(&state, &refused, "vm1").await.unwrap_err();
        assert_eq!(f.stage, Stage::Config);
        assert!(
            f.chain().contains(jailer::ALLOW_UNJAILED_FLAG),
            "{}",
            f.chain()
        );
        assert_eq!(
            crate::node::decide::reason_for(Some(f.stage)),
            imp_api::conditions::ConditionReason::RuntimeStartFailed
        );
        let f = refuse_unjailed(&refused, "vm1").unwrap_err();
        assert!(f.chain().contains("without its jailer"), "{}", f.chain());
        // A spec written before the field existed is refused too.
        let old = spec_with(serde_json::json!({"runtime": "firecracker", "boot": {
            "kernel": "/k", "modules": "/m", "guest": "/g", "firecracker": fc,
        }}));
        assert!(refuse_unjailed(&old, "vm1").is_err());
        let allowed = spec_with(boot(true));
        assert!(refuse_unjailed(&allowed, "vm1").is_ok());
        assert!(
            confinement(&state, &allowed, "vm1")
                .await
                .unwrap()
                .is_none()
        );
        // QEMU is not Firecracker's business.
        assert!(refuse_unjailed(&spec_with(serde_json::json!({})), "vm1").is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

    #[test]
    fn a_guest_that_asks_for_another_boot_gets_two_more_then_fails_saying_why() {
        assert!(boot_again(1, "no timer").is_ok());
        assert!(boot_again(BOOT_ATTEMPTS - 1, "no timer").is_ok());
        let f = boot_again(BOOT_ATTEMPTS, "no timer").unwrap_err();
        assert_eq!(f.stage, Stage::Boot);
        assert_eq!(f.chain(), "the guest could not run in 3 boots: no timer");
    }

    #[tokio::test]
    async fn a_user_data_failure_on_the_console_becomes_the_message() {
        use imp_proto::marker::{exit_marker, user_data_failure_marker};
        let dir = std::env::temp_dir().join(format!("imp-supervisor-ud-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut r = crate::node::decide::tests::record(VmStatus::Running, 0);
        r.serial_log = dir.join("serial.log");
        let why = "runcmd[0] (false): exited with code 1; no output";
        let console = format!(
            "boot\n{}{}",
            user_data_failure_marker(why),
            exit_marker(ExitStatus::Code(1))
        );
        std::fs::write(&r.serial_log, console).unwrap();
        finish(&mut r, Ended::Exited(1)).await;
        assert_eq!((r.status, r.exit_code), (VmStatus::Exited, Some(1)));
        assert_eq!(
            r.error.as_deref(),
            Some(format!("userData failed, the workload was not started: {why}").as_str())
        );
        // A workload's own failure has no such account.
        let own = format!("oops{}", exit_marker(ExitStatus::Code(1)));
        std::fs::write(&r.serial_log, own).unwrap();
        finish(&mut r, Ended::Exited(1)).await;
        assert_eq!(r.error, None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_inherited_tap_must_be_an_open_descriptor_past_the_standard_streams() {
        let e = inherited_tap(2).unwrap_err();
        assert!(e.to_string().contains("--tap-fd 2"), "{e}");
        let e = inherited_tap(987_654).unwrap_err();
        assert!(e.to_string().contains("not an open descriptor"), "{e}");
    }
}
