//! The VMM from its launch to its end: [`drive`] launches it, takes it into the record and
//! watches it ([`supervise_loop`]: the guest agent's first answer, exit reports, stop, snapshot,
//! suspend and claim requests, the VMM's own exit), then says how the VM ended; [`boot`] does that
//! again for a guest that asks for another boot.

use std::path::Path;
use std::time::{Duration, Instant};

use imp_proto::message::ExitStatus;

use super::super::contract::{self, STOPPED_EXIT_CODE};
use super::super::guest_agent;
use super::super::spec::VmSpec;
use super::super::state::{
    self, Stage, StateDir, SuspendFailure, SuspendRecord, VmRecord, VmStatus,
};
use super::failure::{Failure, at, launch_failure_what};
use super::prepare::vm_files;
use super::signals::{StopSignals, either, stop_grace};
use super::{EXIT_REPORT_PORT, Ended, Launch, ms, read_console_tail, snapshot, suspend};
use imp_api::shared::VmRuntime;
use imp_vmm::{GuestMemory, StopOutcome, VmConfig, Vmm};

/// What [`drive`] needs besides the VMM: where the VM lives, its spec and how to launch it.
pub(super) struct Run<'a> {
    pub(super) state: &'a StateDir,
    pub(super) dir: &'a Path,
    pub(super) spec: &'a VmSpec,
    pub(super) launch: Launch<'a>,
    /// The VMM's binary, whose `kind version` ([`imp_vmm::version`]) the record and the snapshot
    /// keep.
    pub(super) vmm_binary: &'a Path,
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

/// Boots the VM and supervises it until it ends or is suspended; a guest that asks for another
/// boot (its kernel came up unable to run it) gets one, up to [`BOOT_ATTEMPTS`] in all.
pub(super) async fn boot<V: Vmm>(
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
pub(super) async fn drive<V: Vmm>(
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
            // A paused member runs again to shut down within its grace.
            if record.paused && vm.resume().await.is_ok() {
                record.paused = false;
            }
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

/// The identity of the VMM `binary` of `runtime` (it runs `binary --version`, off the runtime).
pub(super) async fn identify(runtime: VmRuntime, binary: &Path) -> String {
    let binary = binary.to_path_buf();
    let kind = runtime.as_str();
    tokio::task::spawn_blocking(move || imp_vmm::version::of_binary(kind, &binary))
        .await
        .unwrap_or_else(|_| imp_vmm::version::identity(kind, ""))
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
                repause(vm, record).await;
            }
            Some((req, answer)) = stop.snapshots.recv() => {
                let _ = answer.send(take_snapshot(vm, run, record, &req).await);
                repause(vm, record).await;
            }
            Some((req, answer)) = stop.claims.recv() => {
                let networked = run.spec.network.is_some();
                let _ = answer.send(
                    super::claim::hand_over(vm, run.state, networked, record, req).await,
                );
            }
            Some(answer) = stop.pauses.recv() => {
                let _ = answer.send(super::claim::pause(vm, run.state, record).await);
            }
            Some(token) = stop.suspends.recv() => {
                if let Some(s) = suspend_now(vm, run, record, token).await {
                    break LoopEnd::Suspended(s);
                }
                repause(vm, record).await;
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

/// A snapshot or a failed suspend resumes the VM when it is done; a warm pool's member that
/// waited paused (its record says so) is paused again.
/// If that fails, it runs, and its record (saved at its next change) says so.
async fn repause<V: Vmm>(vm: &mut V, record: &mut VmRecord) {
    if record.paused
        && let Err(e) = vm.pause().await
    {
        record.paused = false;
        tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "pausing the member again after a snapshot failed: it runs");
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

/// A VM restored from another's snapshot still has that VM's clock, hostname, entropy,
/// MAC, address and TCP connections: it takes its own (the guest reseeds its generator, sets
/// its clock and names, readdresses its interface and drops the source's connections). A
/// clone that cannot is failed: it would run as a second copy of its source. Its network
/// link, down since the restore, comes up only then.
pub(super) async fn take_identity<V: Vmm>(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_that_asks_for_another_boot_gets_two_more_then_fails_saying_why() {
        assert!(boot_again(1, "no timer").is_ok());
        assert!(boot_again(BOOT_ATTEMPTS - 1, "no timer").is_ok());
        let f = boot_again(BOOT_ATTEMPTS, "no timer").unwrap_err();
        assert_eq!(f.stage, Stage::Boot);
        assert_eq!(f.chain(), "the guest could not run in 3 boots: no timer");
    }
}
