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
//!
//! The parts: `signals.rs` holds the stop, suspend and snapshot requests, installed first;
//! `prepare.rs` builds what the VMM is given before it runs (the image, the VM's disk and
//! initramfs, the VMM's config, confinement and launcher); `supervise.rs` launches the VMM and
//! watches it until it ends, answering snapshot and suspend requests on the way; `restore.rs`
//! starts the VMM from a snapshot instead (a suspended VM resumed, or a new VM restored from
//! another's snapshot, which then takes its own identity); `failure.rs` says which step failed
//! and why. Beside them are the shim's API ([`serve`]), its side of a snapshot ([`snapshot`])
//! and of a suspend ([`suspend`]), and Firecracker's jailer ([`jailer`]). This file runs the
//! steps in order and writes how the VM ended into its record.

mod claim;
mod failure;
pub mod jailer;
mod prepare;
mod restore;
pub mod serve;
mod signals;
pub mod snapshot;
mod supervise;
pub mod suspend;

pub use failure::Failure;

use std::path::Path;
use std::time::Duration;

use super::cgroup::VmCgroup;
use super::console;
use super::contract::{self, FAIL_REASON_FILE, STOPPED_EXIT_CODE};
use super::spec::{SPEC_FILE, VmSpec};
use super::state::{self, Stage, StateDir, SuspendRecord, VmRecord, VmStatus};
use imp_api::shared::VmRuntime;
use imp_vmm::SnapshotFiles;

use failure::at;
use prepare::{firecracker_launcher, prepare, qemu_launcher};
use restore::{restore_new, resume};
use signals::StopSignals;
use supervise::{Run, boot};

/// The guest port the workload's exit report is sent to (CID 2).
pub const EXIT_REPORT_PORT: u32 = 10001;
/// The guest's vsock context id; each VM has its own vsock device, so one value serves all.
pub const GUEST_CID: u32 = 3;
/// How much of the console's end is read for the exit marker and the failure tail.
const CONSOLE_TAIL_BYTES: u64 = 64 * 1024;
/// Console lines kept in the record of a failed VM.
const FAILURE_TAIL_LINES: usize = 20;

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
        Ok(()) => boot_fresh(&state, &dir, &spec, &mut record, &mut stop).await,
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
                claims: stop.claims_tx.clone(),
                pauses: stop.pauses_tx.clone(),
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

/// A VM from its image: prepares its disk and initramfs, boots it and supervises it to its end.
async fn boot_fresh(
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

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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
    use imp_proto::message::ExitStatus;
    use prepare::confinement;

    /// A spec of image `image` with only what serde requires, plus `extra` fields.
    pub(super) fn spec_with(extra: serde_json::Value) -> VmSpec {
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
