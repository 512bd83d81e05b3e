//! The Firecracker driver: one `firecracker` process per VM, driven over its API socket.
//!
//! [`Firecracker`] implements [`Vmm`]. It starts `firecracker --api-sock SOCK` directly (inside
//! `ip netns exec NS` when the VM has a network namespace) or under the `jailer` (chroot,
//! uid/gid, cgroups, netns), sends the serial console (the process's stdout and stderr) to a
//! log file, and configures the VM with typed calls built in [`plan`] and sent by [`api`].
//! A snapshot is restored in a *new* process, as Firecracker requires.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use crate::{SnapshotFiles, StopOutcome, VmConfig, VmState, Vmm, vsock};

pub mod api;
pub mod plan;

/// Why a Firecracker VM operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The VM id cannot name files and jails.
    #[error("Invalid VM id {id:?}: use 1 to 64 ASCII letters, digits or '-'")]
    InvalidId {
        /// The rejected id.
        id: String,
    },
    /// A file or directory the VM needs could not be set up or cleaned.
    #[error("Failed to {what} {path}")]
    Files {
        /// What was being done.
        what: &'static str,
        /// To which path.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
    /// The firecracker (or jailer) process could not be started.
    #[error("Failed to start {binary}")]
    Spawn {
        /// The binary that was executed.
        binary: PathBuf,
        /// What exec said.
        #[source]
        source: std::io::Error,
    },
    /// The process died before it served its API.
    #[error("Firecracker for VM {id} exited ({status}) before serving its API; log tail: {tail}")]
    Exited {
        /// The VM.
        id: String,
        /// Its exit status.
        status: String,
        /// The last lines of its serial log (where Firecracker writes startup errors).
        tail: String,
    },
    /// The API socket did not appear in time.
    #[error("Firecracker API socket {socket} did not appear within {timeout:?}")]
    SocketTimeout {
        /// The socket waited for.
        socket: PathBuf,
        /// How long we waited.
        timeout: Duration,
    },
    /// An API call failed.
    #[error(transparent)]
    Api(#[from] api::Error),
    /// A vsock connection failed.
    #[error(transparent)]
    Vsock(#[from] vsock::Error),
    /// The operation does not apply in the VM's current state.
    #[error("Cannot {op} VM {id} while it is {state}")]
    InvalidState {
        /// What was asked.
        op: &'static str,
        /// The VM.
        id: String,
        /// Its state.
        state: VmState,
    },
    /// The guest's TAP is in another network namespace (or it has none): its link cannot
    /// be taken down or up from here (Firecracker has no call for it).
    #[error(
        "VM {id}: its network link cannot be taken down or up (no TAP in this network namespace)"
    )]
    NoLinkControl {
        /// The VM.
        id: String,
    },
    /// Its TAP could not be taken down or up.
    #[error("VM {id}: setting the link of its TAP {tap}: {reason}")]
    Link {
        /// The VM.
        id: String,
        /// The TAP.
        tap: String,
        /// Why.
        reason: String,
    },
    /// The VM was configured without vsock.
    #[error("VM {id} has no vsock device")]
    NoVsock {
        /// The VM.
        id: String,
    },
    /// Waiting for or killing the process failed.
    #[error("Failed to {what} the Firecracker process of VM {id}")]
    Process {
        /// What was being done.
        what: &'static str,
        /// The VM.
        id: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// Result of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Driver-wide settings for starting Firecracker processes.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The `firecracker` binary.
    pub firecracker: PathBuf,
    /// Run under the jailer when set.
    pub jailer: Option<JailerConfig>,
    /// How long to wait for the API socket after spawning.
    pub socket_timeout: Duration,
    /// How long one API call may take (snapshots of big guests take a while).
    pub api_timeout: Duration,
    /// Firecracker's own log level (`Error` … `Trace`).
    pub log_level: String,
}

impl Launcher {
    /// A launcher for `firecracker` without jailer, with timeouts that suit a node agent.
    pub fn new(firecracker: impl Into<PathBuf>) -> Self {
        Launcher {
            firecracker: firecracker.into(),
            jailer: None,
            socket_timeout: Duration::from_secs(5),
            api_timeout: Duration::from_secs(120),
            log_level: "Info".to_owned(),
        }
    }
}

/// How to run Firecracker under its jailer.
#[derive(Debug, Clone)]
pub struct JailerConfig {
    /// The `jailer` binary.
    pub binary: PathBuf,
    /// The jailer's `--chroot-base-dir`; the jail is `BASE/firecracker/ID/root`.
    pub chroot_base: PathBuf,
    /// User Firecracker runs as.
    pub uid: u32,
    /// Group Firecracker runs as.
    pub gid: u32,
    /// Cgroup version of the host (1 or 2).
    pub cgroup_version: u8,
    /// Cgroup settings such as `cpu.shares=512` (each `--cgroup`).
    pub cgroups: Vec<String>,
    /// Parent cgroup (the jailer's default is the exec file name).
    pub parent_cgroup: Option<String>,
}

/// Where one VM's files are, as the host and as Firecracker see them.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The VM's run directory on the host (serial log lives here, outside any jail).
    pub run_dir: PathBuf,
    /// The directory Firecracker's own files live in on the host: the run dir or the jail root.
    pub root: PathBuf,
    /// Whether Firecracker runs chrooted in `root`.
    pub jailed: bool,
}

/// File names inside [`Layout::root`].
pub mod files {
    /// The API socket.
    pub const API_SOCKET: &str = "firecracker.sock";
    /// The hybrid vsock socket.
    pub const VSOCK: &str = "vsock.sock";
    /// Firecracker's own log.
    pub const LOG: &str = "firecracker.log";
    /// The guest serial console (in the run dir, never in the jail).
    pub const SERIAL: &str = "serial.log";
    /// Kernel inside a jail.
    pub const KERNEL: &str = "kernel";
    /// Initrd inside a jail.
    pub const INITRD: &str = "initrd";
    /// Snapshot state inside a jail.
    pub const SNAPSHOT_STATE: &str = "snapshot.state";
    /// Snapshot memory inside a jail.
    pub const SNAPSHOT_MEM: &str = "snapshot.mem";
}

impl Layout {
    /// The layout `launcher` gives VM `config`.
    pub fn new(launcher: &Launcher, config: &VmConfig) -> Self {
        let run_dir = absolute(&config.run_dir);
        match &launcher.jailer {
            Some(j) => Layout {
                root: absolute(&j.chroot_base)
                    .join(exec_name(&launcher.firecracker))
                    .join(&config.id)
                    .join("root"),
                run_dir,
                jailed: true,
            },
            None => Layout {
                root: run_dir.clone(),
                run_dir,
                jailed: false,
            },
        }
    }

    /// Host path of `name` in the root.
    pub fn host(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Path of `name` in the root as Firecracker sees it.
    pub fn vmm(&self, name: &str) -> String {
        if self.jailed {
            format!("/{name}")
        } else {
            self.root.join(name).display().to_string()
        }
    }

    /// Path Firecracker is given for host file `host` that the VM uses under jail name `name`.
    pub fn vmm_file(&self, host: &Path, name: &str) -> String {
        if self.jailed {
            format!("/{name}")
        } else {
            absolute(host).display().to_string()
        }
    }

    /// The serial console log on the host.
    pub fn serial_log(&self) -> PathBuf {
        self.run_dir.join(files::SERIAL)
    }

    /// The jail's top directory (`BASE/firecracker/ID`), removed when the VM stops.
    fn jail_dir(&self) -> Option<&Path> {
        self.jailed.then(|| self.root.parent()).flatten()
    }
}

/// Jail file name of drive `id`.
pub fn drive_file(id: &str) -> String {
    format!("drive-{id}")
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_owned())
}

fn exec_name(binary: &Path) -> String {
    binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "firecracker".to_owned())
}

fn files_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_owned();
    move |source| Error::Files { what, path, source }
}

/// One VM running under Firecracker.
#[derive(Debug)]
pub struct Firecracker {
    id: String,
    layout: Layout,
    launcher: Launcher,
    vsock: bool,
    child: Child,
    client: api::Client,
    state: VmState,
    serial: PathBuf,
    /// Set once the process has been reaped and the files cleaned up.
    reaped: bool,
    /// The guest's TAP and the network namespace it is in (`None`: the caller's): the host
    /// end of its link ([`Vmm::set_link`]).
    tap: Option<(String, Option<String>)>,
}

impl Firecracker {
    /// The API client, for calls the [`Vmm`] trait does not cover.
    pub fn api(&self) -> &api::Client {
        &self.client
    }

    /// Where this VM's files are.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Asks Firecracker for the instance's id, state and version.
    pub async fn instance_info(&self) -> Result<api::InstanceInfo> {
        Ok(self.client.instance_info().await?)
    }

    /// Host path of the hybrid vsock socket (guest-initiated connections arrive next to it).
    pub fn vsock_path(&self) -> Option<PathBuf> {
        self.vsock.then(|| self.layout.host(files::VSOCK))
    }

    /// Spawns the process, waits for its API and sends `requests`.
    async fn start(
        launcher: &Launcher,
        config: &VmConfig,
        link: &[(PathBuf, String)],
        requests: Vec<api::Request>,
        state: VmState,
    ) -> Result<Self> {
        validate_id(&config.id)?;
        let layout = Layout::new(launcher, config);
        prepare(launcher, config, &layout, link)?;
        let child = spawn(launcher, config, &layout)?;
        let layout_serial = layout.serial_log();
        let client = api::Client::new(layout.host(files::API_SOCKET), launcher.api_timeout);
        let mut vm = Firecracker {
            id: config.id.clone(),
            layout,
            launcher: launcher.clone(),
            vsock: config.vsock.is_some(),
            child,
            client,
            state: VmState::Stopped,
            serial: layout_serial,
            reaped: false,
            tap: config
                .net
                .as_ref()
                .map(|n| (n.tap.clone(), config.netns.clone())),
        };
        vm.wait_for_api().await?;
        for req in &requests {
            vm.client.send(req).await?;
        }
        vm.state = state;
        tracing::info!(vm = %vm.id, pid = ?vm.child.id(), state = %vm.state, "firecracker vm started");
        Ok(vm)
    }

    async fn wait_for_api(&mut self) -> Result<()> {
        let socket = self.layout.host(files::API_SOCKET);
        let timeout = self.launcher.socket_timeout;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().map_err(|source| Error::Process {
                what: "check on",
                id: self.id.clone(),
                source,
            })? {
                return Err(Error::Exited {
                    id: self.id.clone(),
                    status: status.to_string(),
                    tail: log_tail(&self.layout.serial_log()),
                });
            }
            match crate::uds::connect(&socket).await {
                Ok(_) => return Ok(()),
                // Not a socket Firecracker made there: no wait makes it one.
                Err(e) if crate::uds::is_refused(&e) => {
                    return Err(Error::Api(api::Error::Connect { socket, source: e }));
                }
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                return Err(Error::SocketTimeout { socket, timeout });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn require(&self, op: &'static str, allowed: &[VmState]) -> Result<()> {
        if allowed.contains(&self.state) {
            Ok(())
        } else {
            Err(Error::InvalidState {
                op,
                id: self.id.clone(),
                state: self.state,
            })
        }
    }

    /// Removes sockets, the jail and the jailer's cgroups once the process is gone.
    fn cleanup(&self) {
        for name in [files::API_SOCKET, files::VSOCK] {
            remove_quietly(&self.layout.host(name));
        }
        if let Some(jail) = self.layout.jail_dir()
            && let Err(error) = std::fs::remove_dir_all(jail)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(vm = %self.id, jail = %jail.display(), %error, "failed to remove jail");
        }
        if let Some(j) = &self.launcher.jailer {
            for dir in jailer_cgroup_dirs(j, &exec_name(&self.launcher.firecracker), &self.id) {
                if let Err(error) = std::fs::remove_dir(&dir)
                    && error.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::debug!(vm = %self.id, cgroup = %dir.display(), %error, "cgroup not removed");
                }
            }
        }
    }
}

impl Drop for Firecracker {
    fn drop(&mut self) {
        if !self.reaped {
            // Also reached when boot or restore fails half way: no process or jail outlives it.
            // kill_on_drop would SIGKILL too; killing here first lets the cleanup follow.
            let _ = self.child.start_kill();
            let _ = self.child.try_wait();
            self.cleanup();
            tracing::debug!(vm = %self.id, state = %self.state, "firecracker handle dropped: killed");
        }
    }
}

impl Vmm for Firecracker {
    type Launcher = Launcher;
    type Stream = UnixStream;
    type Error = Error;

    async fn boot(launcher: &Launcher, config: &VmConfig) -> Result<Self> {
        let layout = Layout::new(launcher, config);
        let mut link = vec![(config.kernel.clone(), files::KERNEL.to_owned())];
        if let Some(initrd) = &config.initrd {
            link.push((initrd.clone(), files::INITRD.to_owned()));
        }
        link.extend(
            config
                .drives
                .iter()
                .map(|d| (d.path.clone(), drive_file(&d.id))),
        );
        let requests = plan::boot(launcher, config, &layout)?;
        Self::start(launcher, config, &link, requests, VmState::Running).await
    }

    async fn restore(
        launcher: &Launcher,
        config: &VmConfig,
        snapshot: &SnapshotFiles,
        resume: bool,
    ) -> Result<Self> {
        let layout = Layout::new(launcher, config);
        let mut link = vec![
            (snapshot.state.clone(), files::SNAPSHOT_STATE.to_owned()),
            (snapshot.memory.clone(), files::SNAPSHOT_MEM.to_owned()),
        ];
        link.extend(
            config
                .drives
                .iter()
                .map(|d| (d.path.clone(), drive_file(&d.id))),
        );
        let requests = plan::restore(launcher, config, &layout, snapshot, resume)?;
        let state = if resume {
            VmState::Running
        } else {
            VmState::Paused
        };
        let started = Instant::now();
        let vm = Self::start(launcher, config, &link, requests, state).await?;
        tracing::info!(
            vm = %vm.id,
            elapsed_ms = started.elapsed().as_millis() as u64,
            resume,
            "firecracker snapshot restored"
        );
        Ok(vm)
    }

    async fn pause(&mut self) -> Result<()> {
        self.require("pause", &[VmState::Running])?;
        self.client
            .send(&api::Request::patch_vm(api::VmStateRequest::Paused)?)
            .await?;
        self.state = VmState::Paused;
        Ok(())
    }

    async fn resume(&mut self) -> Result<()> {
        self.require("resume", &[VmState::Paused])?;
        self.client
            .send(&api::Request::patch_vm(api::VmStateRequest::Resumed)?)
            .await?;
        self.state = VmState::Running;
        Ok(())
    }

    /// Firecracker has no call for it: the host end of the link, its TAP, goes down or up
    /// instead. Down, the kernel drops what the guest sends and delivers it nothing; the guest
    /// keeps its carrier.
    async fn set_link(&mut self, up: bool) -> Result<()> {
        let Some((tap, netns)) = self.tap.clone() else {
            return Err(Error::NoLinkControl {
                id: self.id.clone(),
            });
        };
        let name = tap.clone();
        let set = tokio::task::spawn_blocking(move || set_tap_up(&name, netns.as_deref(), up))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        set.map_err(|reason| Error::Link {
            id: self.id.clone(),
            tap,
            reason,
        })
    }

    async fn snapshot(&mut self, snapshot: &SnapshotFiles) -> Result<()> {
        self.require("snapshot", &[VmState::Paused])?;
        for target in [&snapshot.state, &snapshot.memory] {
            if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(files_err("create snapshot directory", parent))?;
            }
        }
        let started = Instant::now();
        self.client
            .send(&plan::snapshot_create(&self.layout, snapshot)?)
            .await?;
        if self.layout.jailed {
            move_out(&self.layout.host(files::SNAPSHOT_STATE), &snapshot.state)?;
            move_out(&self.layout.host(files::SNAPSHOT_MEM), &snapshot.memory)?;
        }
        tracing::info!(
            vm = %self.id,
            elapsed_ms = started.elapsed().as_millis() as u64,
            state = %snapshot.state.display(),
            memory = %snapshot.memory.display(),
            "firecracker snapshot created"
        );
        Ok(())
    }

    async fn stop(mut self, grace: Duration) -> Result<StopOutcome> {
        let mut outcome = StopOutcome::Killed;
        if !grace.is_zero() && self.state == VmState::Running {
            match api::Request::put_action(api::ActionType::SendCtrlAltDel) {
                Ok(req) => {
                    if let Err(error) = self.client.send(&req).await {
                        tracing::debug!(vm = %self.id, %error, "Ctrl+Alt+Del not delivered");
                    }
                }
                Err(error) => tracing::debug!(vm = %self.id, %error, "Ctrl+Alt+Del not built"),
            }
            let wait = grace + super::POWER_OFF_MARGIN;
            if tokio::time::timeout(wait, self.child.wait()).await.is_ok() {
                outcome = StopOutcome::Graceful;
            }
        }
        if outcome == StopOutcome::Killed {
            self.child.start_kill().map_err(|source| Error::Process {
                what: "kill",
                id: self.id.clone(),
                source,
            })?;
        }
        let status = self.child.wait().await.map_err(|source| Error::Process {
            what: "wait for",
            id: self.id.clone(),
            source,
        })?;
        self.state = VmState::Stopped;
        self.reaped = true;
        self.cleanup();
        tracing::info!(vm = %self.id, ?outcome, %status, "firecracker vm stopped");
        Ok(outcome)
    }

    async fn connect_vsock(&self, port: u32, timeout: Duration) -> Result<UnixStream> {
        let uds = self.vsock_path().ok_or_else(|| Error::NoVsock {
            id: self.id.clone(),
        })?;
        Ok(vsock::connect(&uds, port, timeout).await?)
    }

    fn vsock_path(&self) -> Option<PathBuf> {
        Firecracker::vsock_path(self)
    }

    fn serial_log_path(&self) -> &Path {
        &self.serial
    }

    fn exited(&mut self) -> Result<bool> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                if self.state != VmState::Stopped {
                    tracing::info!(vm = %self.id, %status, "firecracker exited");
                }
                self.state = VmState::Stopped;
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(source) => Err(Error::Process {
                what: "check on",
                id: self.id.clone(),
                source,
            }),
        }
    }

    fn state(&self) -> VmState {
        self.state
    }

    fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

fn validate_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidId { id: id.to_owned() })
    }
}

/// Creates the run dir (and jail), removes stale sockets, creates the log files, links `link`.
fn prepare(
    launcher: &Launcher,
    config: &VmConfig,
    layout: &Layout,
    link: &[(PathBuf, String)],
) -> Result<()> {
    std::fs::create_dir_all(&layout.run_dir)
        .map_err(files_err("create run dir", &layout.run_dir))?;
    if let Some(jail) = layout.jail_dir() {
        // The jailer refuses a jail left over from an earlier run (its device nodes exist).
        match std::fs::remove_dir_all(jail) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(files_err("remove stale jail", jail)(e));
            }
            _ => {}
        }
        std::fs::create_dir_all(&layout.root).map_err(files_err("create jail", &layout.root))?;
    }
    for name in [files::API_SOCKET, files::VSOCK] {
        let path = layout.host(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(files_err("remove stale socket", &path)(e));
            }
            _ => {}
        }
    }
    let log = layout.host(files::LOG);
    std::fs::File::create(&log).map_err(files_err("create log", &log))?;
    if let Some(j) = &launcher.jailer {
        std::os::unix::fs::chown(&log, Some(j.uid), Some(j.gid))
            .map_err(files_err("chown log", &log))?;
        for (host, name) in link {
            let inside = layout.host(name);
            link_into_jail(host, &inside)?;
            std::os::unix::fs::chown(&inside, Some(j.uid), Some(j.gid))
                .map_err(files_err("chown jailed file", &inside))?;
        }
    }
    tracing::debug!(vm = %config.id, root = %layout.root.display(), jailed = layout.jailed, "vm files prepared");
    Ok(())
}

/// Hard-links `host` to `inside` (copying across file systems). The jail shares the inode, so
/// a chown of the jailed file changes the original's owner too.
fn link_into_jail(host: &Path, inside: &Path) -> Result<()> {
    if std::fs::hard_link(host, inside).is_err() {
        std::fs::copy(host, inside).map_err(files_err("copy into jail", host))?;
    }
    Ok(())
}

/// Takes TAP `tap` (in network namespace `netns`, else the caller's) up or down, from a
/// thread of its own that enters the namespace (blocking).
fn set_tap_up(tap: &str, netns: Option<&str>, up: bool) -> std::result::Result<(), String> {
    let (tap, netns) = (tap.to_owned(), netns.map(str::to_owned));
    let thread = std::thread::spawn(move || -> std::result::Result<(), String> {
        if let Some(ns) = netns {
            let path = format!("/var/run/netns/{ns}");
            let file = std::fs::File::open(&path).map_err(|e| format!("opening {path}: {e}"))?;
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("entering {path}: {e}"))?;
        }
        let index = imp_net::tap::index_of(&tap).ok_or_else(|| "no such interface".to_owned())?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let netlink = imp_net::link::Netlink::connect().map_err(|e| e.to_string())?;
            netlink
                .set_up(index, &tap, up)
                .await
                .map_err(|e| imp_api::chain::chain(&e))
        })
    });
    thread
        .join()
        .unwrap_or_else(|_| Err("the thread setting the link panicked".into()))
}

/// Moves a snapshot file out of the jail to where the caller wants it. The jail is the VMM's to
/// write: anything but a regular file where Firecracker should have written its snapshot (a
/// symlink to a host file, say) is refused, or the snapshot would carry what it names. A moved
/// file is checked where it landed, out of the VMM's reach; a copied one is read through a
/// descriptor opened without following a symlink.
fn move_out(from: &Path, to: &Path) -> Result<()> {
    let not_regular = || Error::Files {
        what: "take out of the jail the snapshot file",
        path: from.to_path_buf(),
        source: std::io::Error::other("it is not a regular file (a symlink the VMM made?)"),
    };
    if std::fs::rename(from, to).is_ok() {
        let meta = std::fs::symlink_metadata(to).map_err(files_err("inspect snapshot", to))?;
        if !meta.file_type().is_file() {
            remove_quietly(to);
            return Err(not_regular());
        }
        return Ok(());
    }
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut src = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(from)
        .map_err(files_err("open jailed snapshot", from))?;
    let meta = src
        .metadata()
        .map_err(files_err("inspect jailed snapshot", from))?;
    if !meta.file_type().is_file() {
        return Err(not_regular());
    }
    let mut dst = std::fs::File::create(to).map_err(files_err("create snapshot", to))?;
    std::io::copy(&mut src, &mut dst).map_err(files_err("copy snapshot out of jail", from))?;
    std::fs::remove_file(from).map_err(files_err("remove jailed snapshot", from))?;
    Ok(())
}

fn remove_quietly(path: &Path) {
    if let Err(error) = std::fs::remove_file(path)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::debug!(path = %path.display(), %error, "file not removed");
    }
}

/// The cgroup directories the jailer creates for VM `id`.
fn jailer_cgroup_dirs(j: &JailerConfig, exec: &str, id: &str) -> Vec<PathBuf> {
    let parent = j.parent_cgroup.clone().unwrap_or_else(|| exec.to_owned());
    let base = Path::new("/sys/fs/cgroup");
    if j.cgroup_version == 2 {
        return vec![base.join(&parent).join(id)];
    }
    let mut controllers: Vec<&str> = j
        .cgroups
        .iter()
        .filter_map(|c| c.split_once('.').map(|(ctl, _)| ctl))
        .collect();
    controllers.dedup();
    controllers
        .into_iter()
        .map(|c| base.join(c).join(&parent).join(id))
        .collect()
}

/// Starts `firecracker` (or the jailer) with stdout and stderr on the serial log.
fn spawn(launcher: &Launcher, config: &VmConfig, layout: &Layout) -> Result<Child> {
    let serial = layout.serial_log();
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&serial)
        .map_err(files_err("open serial log", &serial))?;
    let err = out
        .try_clone()
        .map_err(files_err("open serial log", &serial))?;
    let api_sock = layout.vmm(files::API_SOCKET);
    // Logger on the command line, not PUT /logger: that way Firecracker's startup lines go to
    // its log file and never into the serial log, and a restored process logs the same way.
    let fc_args = [
        "--api-sock".to_owned(),
        api_sock,
        "--log-path".to_owned(),
        layout.vmm(files::LOG),
        "--level".to_owned(),
        launcher.log_level.clone(),
        "--show-level".to_owned(),
    ];
    let (binary, mut cmd) = match (&launcher.jailer, &config.netns) {
        (Some(j), netns) => {
            let mut cmd = Command::new(&j.binary);
            cmd.arg("--id")
                .arg(&config.id)
                .arg("--exec-file")
                .arg(&launcher.firecracker)
                .arg("--uid")
                .arg(j.uid.to_string())
                .arg("--gid")
                .arg(j.gid.to_string())
                .arg("--chroot-base-dir")
                .arg(absolute(&j.chroot_base))
                .arg("--cgroup-version")
                .arg(j.cgroup_version.to_string());
            for c in &j.cgroups {
                cmd.arg("--cgroup").arg(c);
            }
            if let Some(p) = &j.parent_cgroup {
                cmd.arg("--parent-cgroup").arg(p);
            }
            if let Some(ns) = netns {
                cmd.arg("--netns").arg(format!("/var/run/netns/{ns}"));
            }
            cmd.arg("--").args(&fc_args);
            (j.binary.clone(), cmd)
        }
        (None, Some(ns)) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]).arg(&launcher.firecracker);
            cmd.args(&fc_args).arg("--id").arg(&config.id);
            (PathBuf::from("ip"), cmd)
        }
        (None, None) => {
            let mut cmd = Command::new(&launcher.firecracker);
            cmd.args(&fc_args).arg("--id").arg(&config.id);
            (launcher.firecracker.clone(), cmd)
        }
    };
    cmd.current_dir(&layout.run_dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|source| Error::Spawn {
        binary: binary.clone(),
        source,
    })?;
    tracing::debug!(vm = %config.id, binary = %binary.display(), pid = ?child.id(), "firecracker spawned");
    Ok(child)
}

/// The last few lines of a log, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot file the VMM replaced with a symlink to a host file is not taken out of the
    /// jail: the snapshot would carry the host file.
    #[test]
    fn a_symlink_in_place_of_a_snapshot_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("imp-fc-moveout-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("jail")).unwrap();
        std::fs::create_dir_all(dir.join("out")).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, "host only").unwrap();
        let jailed = dir.join("jail/snapshot.mem");
        std::os::unix::fs::symlink(&secret, &jailed).unwrap();
        let out = dir.join("out/memory");
        let e = move_out(&jailed, &out).unwrap_err();
        assert!(e.to_string().contains("snapshot file"), "{e}");
        assert!(
            std::fs::symlink_metadata(&out).is_err(),
            "the symlink reached the snapshot"
        );
        let _ = std::fs::remove_file(&jailed);
        std::fs::write(&jailed, "pages").unwrap();
        move_out(&jailed, &out).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "pages");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ids_are_checked() {
        assert!(validate_id("vm-1").is_ok());
        assert!(validate_id("").is_err());
        assert!(validate_id("a/b").is_err());
        assert!(validate_id(&"x".repeat(65)).is_err());
    }

    #[test]
    fn jailed_paths_are_chroot_relative() {
        let mut launcher = Launcher::new("/opt/fc/firecracker");
        launcher.jailer = Some(JailerConfig {
            binary: "/opt/fc/jailer".into(),
            chroot_base: "/srv/jail".into(),
            uid: 123,
            gid: 100,
            cgroup_version: 1,
            cgroups: vec!["cpu.shares=10".into(), "cpu.cfs_quota_us=1".into()],
            parent_cgroup: None,
        });
        let config = crate::VmConfig {
            id: "vm-1".into(),
            run_dir: "/run/imp/vm-1".into(),
            vcpus: 1,
            memory_mib: 128,
            kernel: "/k".into(),
            initrd: None,
            kernel_args: String::new(),
            drives: vec![],
            net: None,
            vsock: None,
            netns: None,
            confine: None,
            memory: Default::default(),
        };
        let layout = Layout::new(&launcher, &config);
        assert_eq!(
            layout.root,
            PathBuf::from("/srv/jail/firecracker/vm-1/root")
        );
        assert_eq!(layout.vmm(files::API_SOCKET), "/firecracker.sock");
        assert_eq!(
            layout.serial_log(),
            PathBuf::from("/run/imp/vm-1/serial.log")
        );
        let dirs = jailer_cgroup_dirs(launcher.jailer.as_ref().unwrap(), "firecracker", "vm-1");
        assert_eq!(
            dirs,
            vec![PathBuf::from("/sys/fs/cgroup/cpu/firecracker/vm-1")]
        );
    }
}
