//! The front ends' side of the shim contract ([`super::contract`]): starting, stopping,
//! signalling and cleaning up after a VM's shim, asking it to suspend ([`suspend`]) or to
//! snapshot its VM ([`snapshot`]), for both front ends.
//!
//! A shim is the `imp` binary itself, run as `imp shim --state-dir ROOT ID`: it reads
//! `vms/ID/spec.json` and supervises that VM ([`super::shim::run`]). It is started in a
//! process group of its own (a terminal's Ctrl-C reaches the front end, not the shim), with its
//! output in `shim.log`, and it is not tied to its starter: the front end may exit or be killed
//! and the VM runs on. A thread reaps it when it ends, so a long-lived front end collects no
//! zombies.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub mod client;
pub mod snapshot;
pub mod suspend;

use super::cgroup::VmCgroup;
use super::contract::{SPEC_FILE, STOP_SIGNAL, TAP_FD, initial_record, shim_log, write_stop};
use super::shim_api::{CONTROL_FD, SOCKET_FILE};
use super::spec::VmSpec;
use super::state::{self, StateDir, StateError, VmRecord};

/// Failures of starting or stopping a shim.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// The VM's files could not be written or read.
    #[error(transparent)]
    State(#[from] StateError),
    /// The shim process could not be started.
    #[error("starting the shim {} for VM {id}", exe.display())]
    Spawn {
        /// The binary.
        exe: PathBuf,
        /// The VM.
        id: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The shim could not be signalled.
    #[error("signalling the shim (pid {pid}) of VM {id}")]
    Signal {
        /// The VM.
        id: String,
        /// The shim's pid.
        pid: u32,
        /// The cause.
        #[source]
        source: nix::errno::Errno,
    },
    /// The shim did not end in time.
    #[error("the shim (pid {pid}) of VM {id} did not end within {waited:?}")]
    StopTimeout {
        /// The VM.
        id: String,
        /// The shim's pid.
        pid: u32,
        /// How long we waited.
        waited: Duration,
    },
    /// The VM's cgroup could not be cleaned up.
    #[error("cleaning up the cgroup of VM {id}")]
    Cgroup {
        /// The VM.
        id: String,
        /// The cause.
        #[source]
        source: super::cgroup::CgroupError,
    },
}

/// How to run a shim: the binary and the arguments before `--state-dir`.
#[derive(Debug, Clone)]
pub struct ShimCommand {
    /// The `imp` binary.
    pub exe: PathBuf,
    /// Arguments that select the shim (`["shim"]`).
    pub args: Vec<OsString>,
}

impl ShimCommand {
    /// This very binary, as `imp shim`.
    pub fn current_exe() -> std::io::Result<Self> {
        Ok(Self {
            exe: std::env::current_exe()?,
            args: vec!["shim".into()],
        })
    }
}

/// Writes `spec` into the (already created) directory of VM `id` and starts its shim.
/// Returns the shim's pid.
pub fn start(
    cmd: &ShimCommand,
    state: &StateDir,
    id: &str,
    spec: &VmSpec,
) -> Result<u32, ShimError> {
    let dir = state.vm_dir(id);
    state::write_json(&dir.join(SPEC_FILE), spec)?;
    let pid = spawn(cmd, state, id, None)?;
    // The record exists from now on, so a starter that looks again at once (a retried
    // reconcile) finds the VM started and never starts a second shim.
    // Only if the shim has not written its own (it may already have ended, e.g. failed).
    state.save_new(&initial_record(id, &dir, spec, pid))?;
    Ok(pid)
}

/// Starts the shim of VM `id`, whose directory holds its spec (and, to resume a suspended VM,
/// its record). `tap`, the VM's TAP already open (held while the VM slept), is inherited by
/// the shim as fd [`TAP_FD`] and handed on to the VMM. Returns the shim's pid.
pub fn spawn(
    cmd: &ShimCommand,
    state: &StateDir,
    id: &str,
    tap: Option<&std::os::fd::OwnedFd>,
) -> Result<u32, ShimError> {
    use std::os::unix::process::CommandExt;
    let dir = state.vm_dir(id);
    let log_path = shim_log(&dir);
    let io_err = |source| StateError::Io {
        action: "creating",
        path: log_path.clone(),
        source,
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io_err)?;
    let log2 = log.try_clone().map_err(io_err)?;
    let mut command = std::process::Command::new(&cmd.exe);
    command
        .args(&cmd.args)
        .arg("--state-dir")
        .arg(state.root())
        .arg("--vmm-uid-dir")
        .arg(state.vmm_uid_dir());
    // Above the numbers they are given as, so that one dup2 never closes the other's source.
    let tap = tap.map(above_inherited).transpose().map_err(io_err)?;
    // Held until the shim has its copy (the spawn), then closed here.
    let mut listener = None;
    if let Some(fd) = &tap {
        command.arg("--tap-fd").arg(TAP_FD.to_string());
        inherit_as(&mut command, fd, TAP_FD);
    }
    // Bound before the shim runs, so the starter (and anyone after it) can connect at once.
    // Without it the shim is driven by files and signals, as one of an earlier release is.
    let socket = dir.join(SOCKET_FILE);
    match bind_api(&socket).and_then(|l| above_inherited(&l.into())) {
        Ok(control) => {
            command.arg("--control-fd").arg(CONTROL_FD.to_string());
            inherit_as(&mut command, &control, CONTROL_FD);
            listener = Some(control);
        }
        Err(e) => {
            tracing::warn!(vm = %id, socket = %socket.display(), error = %e, "cannot bind the shim's API socket; the shim will be driven by files and signals")
        }
    }
    let mut child = command
        .arg(id)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0)
        .spawn()
        .map_err(|source| ShimError::Spawn {
            exe: cmd.exe.clone(),
            id: id.to_owned(),
            source,
        })?;
    let pid = child.id();
    // The shim holds the listening socket now; this process's copies go.
    drop((listener, tap));
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    tracing::debug!(vm = %id, pid, "shim started");
    Ok(pid)
}

/// The shim API's listening socket at `path` (a stale one, of a shim that ended, replaced).
fn bind_api(path: &std::path::Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::net::UnixListener::bind(path)
}

/// A close-on-exec copy of `fd` numbered above every descriptor a shim inherits.
#[allow(unsafe_code)]
fn above_inherited(fd: &std::os::fd::OwnedFd) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsFd, FromRawFd};
    let lowest = TAP_FD.max(CONTROL_FD) + 1;
    let raw = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(lowest))?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) })
}

/// Makes `fd` the child's descriptor `target`, open across exec (Rust opens everything
/// close-on-exec; only the child's copy loses the flag).
#[allow(unsafe_code)]
fn inherit_as(command: &mut std::process::Command, fd: &std::os::fd::OwnedFd, target: i32) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let raw = fd.as_raw_fd();
    // SAFETY: the closure runs between fork and exec and only calls dup2(2) and fcntl(2),
    // which are async-signal-safe; `raw` stays open in the parent until spawn returns.
    unsafe {
        command.pre_exec(move || {
            if raw != target && libc::dup2(raw, target) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let flags = libc::fcntl(target, libc::F_GETFD);
            if flags < 0 || libc::fcntl(target, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Asks the shim of `record` to stop its VM (the workload gets `grace`), and waits until the
/// shim has written the end and exited. A dead shim is not an error.
pub async fn stop(state: &StateDir, record: &VmRecord, grace: Duration) -> Result<(), ShimError> {
    stop_as(state, record, grace, None).await
}

/// Stops the VM of `record` as [`stop`] does, its end recorded as a failure for `why` (a
/// probe that failed) rather than as the workload's exit.
pub async fn fail(
    state: &StateDir,
    record: &VmRecord,
    grace: Duration,
    why: &str,
) -> Result<(), ShimError> {
    stop_as(state, record, grace, Some(why)).await
}

/// Stops the VM of `record` through its shim's API, or, for a shim without one, by files and
/// a signal.
async fn stop_as(
    state: &StateDir,
    record: &VmRecord,
    grace: Duration,
    why: Option<&str>,
) -> Result<(), ShimError> {
    if !record.supervisor_alive() {
        return Ok(());
    }
    let dir = state.vm_dir(&record.name);
    let waited = grace + imp_vmm::POWER_OFF_MARGIN + Duration::from_secs(10);
    let timeout = || ShimError::StopTimeout {
        id: record.name.clone(),
        pid: record.supervisor_pid,
        waited,
    };
    match client::stop(&dir, grace, why).await {
        Ok(Some(stopping)) => {
            return match stopping.ended(waited).await {
                true => Ok(()),
                false => Err(timeout()),
            };
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(vm = %record.name, error = %imp_api::chain::DisplayChain(&e), "stopping through the shim's API failed; signalling it")
        }
    }
    // A shim of a release before its API: the grace (and reason) in files, then the signal.
    write_stop(&dir, grace_ms(grace), why).await?;
    signal(record, STOP_SIGNAL)?;
    let deadline = Instant::now() + waited;
    while record.supervisor_alive() {
        if Instant::now() > deadline {
            return Err(timeout());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// `grace` in whole milliseconds, as the stop's request and file carry it.
pub fn grace_ms(grace: Duration) -> u64 {
    u64::try_from(grace.as_millis()).unwrap_or(u64::MAX)
}

/// Sends `sig` to the shim of `record`.
pub fn signal(record: &VmRecord, sig: nix::sys::signal::Signal) -> Result<(), ShimError> {
    let err = |source| ShimError::Signal {
        id: record.name.clone(),
        pid: record.supervisor_pid,
        source,
    };
    let pid = i32::try_from(record.supervisor_pid).map_err(|_| err(nix::errno::Errno::ESRCH))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).map_err(err)
}

/// Kills a VMM whose shim died without stopping it (e.g. `kill -9`), and any helper processes
/// recorded for it, so nothing of the VM is left running unseen. A pid is only trusted if
/// its command line names the VM's directory. Returns what was killed, for the caller to say.
pub fn kill_orphans(state: &StateDir, record: &VmRecord) -> Vec<(u32, &'static str)> {
    let dir = state.vm_dir(&record.name);
    let vmm = record.vmm_pid.map(|pid| (pid, "VMM"));
    let helpers = record.helper_pids.iter().map(|&pid| (pid, "helper"));
    let mut killed = Vec::new();
    for (pid, what) in vmm.into_iter().chain(helpers) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        // A VMM names the VM's directory, or (a confined QEMU, which sees no host path) its
        // name: the pid may have been reused by an unrelated process.
        let ours = cmdline.contains(&*dir.to_string_lossy())
            || cmdline.contains(&format!("\0-name\0{}\0", record.name));
        if ours && let Ok(raw) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            );
            killed.push((pid, what));
        }
    }
    killed
}

/// Removes every trace of VM `id`: whatever still runs in its cgroup is killed, the cgroup
/// and the VM's directory are removed. For a VM whose shim has ended or was stopped.
pub async fn remove(state: &StateDir, id: &str, cgroup: Option<&str>) -> Result<(), ShimError> {
    if let Some(path) = cgroup {
        let (id2, path) = (id.to_owned(), path.to_owned());
        tokio::task::spawn_blocking(move || VmCgroup::at(&path).and_then(|cg| cg.destroy()))
            .await
            .map_err(|e| ShimError::Cgroup {
                id: id2.clone(),
                source: super::cgroup::CgroupError::Io {
                    action: "waiting for the cleanup of",
                    path: PathBuf::from(id2.clone()),
                    source: std::io::Error::other(e),
                },
            })?
            .map_err(|source| ShimError::Cgroup {
                id: id.to_owned(),
                source,
            })?;
    }
    let (dir, state, id) = (state.vm_dir(id), state.clone(), id.to_owned());
    off_runtime("waiting for the removal of", dir, move || state.remove(&id)).await?;
    Ok(())
}

/// Runs the file work `f` on the blocking pool; a task that did not finish is an I/O error of
/// `action` on `path`.
async fn off_runtime<T: Send + 'static>(
    action: &'static str,
    path: PathBuf,
    f: impl FnOnce() -> Result<T, StateError> + Send + 'static,
) -> Result<T, StateError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StateError::Io {
            action,
            path,
            source: std::io::Error::other(e),
        })?
}

/// The spec of VM `id`, if it has one.
pub fn read_spec(state: &StateDir, id: &str) -> Result<VmSpec, StateError> {
    state::read_json(&state.vm_dir(id).join(SPEC_FILE))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_resume_shim_inherits_the_tap_as_fd_3_and_nothing_else_does() {
        let root = std::env::temp_dir().join(format!("imp-shim-fd-{}", std::process::id()));
        let state = StateDir::new(&root);
        state.create_vm_dir("vm1").unwrap();
        // A stand-in shim: `sh -c SCRIPT --state-dir ROOT [--tap-fd 3] ID` says what its fd 3 is.
        let cmd = ShimCommand {
            exe: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "readlink /proc/$$/fd/3 > \"$1/fd3\" || echo none > \"$1/fd3\"".into(),
            ],
        };
        let seen = |root: &std::path::Path| {
            let path = root.join("fd3");
            for _ in 0..200 {
                if let Ok(s) = std::fs::read_to_string(&path)
                    && !s.is_empty()
                {
                    let _ = std::fs::remove_file(&path);
                    return s.trim().to_owned();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("the stand-in shim wrote nothing");
        };
        let tap: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        spawn(&cmd, &state, "vm1", Some(&tap)).unwrap();
        assert_eq!(seen(&root), "/dev/null");
        spawn(&cmd, &state, "vm1", None).unwrap();
        assert_ne!(
            seen(&root),
            "/dev/null",
            "fd 3 leaked into a shim not given it"
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
