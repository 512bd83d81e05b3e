//! The QEMU driver: `qemu-system-x86_64 -M microvm`, controlled over QMP, with the guest
//! channel carried over a virtio-serial port.
//!
//! It exists for hosts where Firecracker cannot boot Linux (no usable KVM: QEMU falls back to
//! TCG) and gives the VM the same shape as the Firecracker driver: virtio-mmio block devices
//! for the drives, a virtio-net device on a host TAP (by name, or an already-open fd handed
//! over by whoever held it), and a guest channel whose host side is a Unix socket speaking
//! Firecracker's `CONNECT <port>` protocol, so [`super::vsock`] serves both.
//!
//! The guest channel is not a virtio-vsock device: QEMU cannot migrate one, so a VM with it
//! could not be snapshotted. When the VM's config asks for vsock, the guest gets a
//! virtio-serial port named [`MUX_PORT`] on a chardev socket instead, and [`mux::HostMux`]
//! multiplexes vsock-like streams over it ([`imp_proto::mux`]); imp-guest speaks the other end
//! when it finds that port. To the host it looks like Firecracker's vsock: `vsock.sock` for
//! host→guest streams, `vsock.sock_P` for guest streams to host port P.
//!
//! Files in the VM's run directory: `vsock.sock` (host side of the guest channel; guest
//! connections to host port P arrive on `vsock.sock_P`), `serial.log` and `qemu.log`.
//!
//! QEMU makes no socket and the driver connects to none by path: QMP and the guest channel's
//! virtio-serial port are chardevs on descriptors QEMU inherits, each one end of a socket
//! pair the driver made ([`argv::Fds`]). A compromised QEMU therefore has no path it could
//! point at another VM's socket (or at any root-only socket of the host) for the driver, which
//! runs as root in the shim, to follow: the driver talks only to the sockets it created. The
//! pairs live as long as their QEMU; a restore is a new QEMU with new pairs, the same command
//! line and a new [`mux::HostMux`].
//!
//! Pause and resume are QMP `stop` and `cont`. Snapshots use QEMU's migration stream: `stop`,
//! then `migrate` to a descriptor of the snapshot file handed over QMP (`getfd`), and restore
//! by a new QEMU started with the same command line plus `-incoming defer`, then QMP's
//! `migrate-incoming` from `fd:N`, N the snapshot file it inherits: QEMU opens no snapshot
//! path itself. The command line is built by [`argv::argv`], a pure function of the VM's
//! config and the paths QEMU is given.
//!
//! With [`VmConfig::confine`] QEMU runs confined ([`confine`], [`super::jail`]): a uid of its
//! own, no capabilities, `no_new_privs`, a root holding only `/usr` and its VM's files, no
//! network but its TAP's descriptor, and its `-sandbox` seccomp filter ([`SANDBOX`]). The whole stream (devices and memory) goes to [`SnapshotFiles::memory`];
//! [`SnapshotFiles::state`] records the QEMU version it came from. A restored VM's host mux
//! connects to the new QEMU's chardev and resets the channel: streams that were open when the
//! snapshot was taken are closed on both sides (their readers see end of file or a reset),
//! and new ones work at once. The guest's clock is stale after a restore:
//! imp-agent's `runtime::guest_agent` can set it. A restored VM's console is appended to
//! `serial.log`, after the output from before the snapshot.

pub mod argv;
pub mod confine;
pub mod mux;
pub mod qmp;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt as _;

use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use super::{GuestMemory, SnapshotFiles, StopOutcome, VmConfig, VmState, Vmm, vsock};
use qmp::{Qmp, QmpError};

/// Used when the host's TSC rate cannot be read (the guest kernel cannot calibrate it under
/// microvm, which has no PIT or HPET).
const FALLBACK_TSC_KHZ: u64 = 2_000_000;

/// The name of the virtio-serial port that carries the guest channel (imp-guest looks for it).
pub const MUX_PORT: &str = "imp.mux";

/// QEMU's `-sandbox`: its seccomp filter, with every optional class of system calls denied.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The name QEMU's monitor keeps a snapshot's descriptor under until `migrate` takes it.
const SNAPSHOT_FD: &str = "imp-snapshot";

/// Longest a snapshot may take to save or load (a 256 MiB guest takes under a second).
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);

/// Why a QEMU VM could not be started or driven.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A binary the driver needs is missing.
    #[error("{binary} not found: {hint}")]
    Missing {
        /// The binary.
        binary: &'static str,
        /// How to get it.
        hint: &'static str,
    },
    /// A file or directory of the VM could not be set up.
    #[error("Failed to {what} {path}")]
    Files {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A process could not be started.
    #[error("Failed to start {binary}")]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A process ended before it was ready.
    #[error("{what} for VM {id} exited ({status}) before it was ready; its log: {log}")]
    Exited {
        /// Which process.
        what: &'static str,
        /// The VM.
        id: String,
        /// Its exit status.
        status: String,
        /// The tail of its log.
        log: String,
    },
    /// QEMU did not greet on its QMP socket pair in time.
    #[error("QEMU for VM {id} did not greet on QMP within {timeout:?}; its log: {log}")]
    QmpTimeout {
        /// The VM.
        id: String,
        /// How long we waited.
        timeout: Duration,
        /// The tail of its log.
        log: String,
    },
    /// A QMP exchange failed.
    #[error("Controlling VM {id} over QMP")]
    Qmp {
        /// The VM.
        id: String,
        /// What QMP said.
        #[source]
        source: QmpError,
    },
    /// A vsock connection failed.
    #[error(transparent)]
    Vsock(#[from] vsock::Error),
    /// The VM has no vsock device.
    #[error("VM {0} has no vsock device")]
    NoVsock(String),
    /// The operation does not apply now.
    #[error("Cannot {op} VM {id} while it is {state}")]
    InvalidState {
        /// What was asked.
        op: &'static str,
        /// The VM.
        id: String,
        /// Its state.
        state: VmState,
    },
    /// The config asks for something this driver cannot do.
    #[error("VM {id}: {reason}")]
    Unsupported {
        /// The VM.
        id: String,
        /// What and why.
        reason: String,
    },
    /// A migration (snapshot or restore) did not complete.
    #[error("Migration of VM {id} ended as {status}")]
    Migration {
        /// The VM.
        id: String,
        /// QEMU's migration status or error.
        status: String,
    },
}

/// The driver's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How QEMU executes guest code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation (only where a real boot probe succeeded).
    Kvm,
    /// Software emulation: slow but works everywhere.
    Tcg,
}

/// Driver-wide settings.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// KVM or TCG.
    pub accel: Accel,
    /// The host's TSC rate for the guest's `tsc_early_khz`.
    pub tsc_khz: u64,
    /// How long QEMU may take to greet on QMP after it is spawned.
    pub socket_timeout: Duration,
    /// How long one QMP command may take.
    pub qmp_timeout: Duration,
    /// The guest agent's vsock port: [`Vmm::stop`] asks imp-guest to shut down through it;
    /// without it (or when it does not answer) the driver sends ACPI `system_powerdown`.
    pub agent_port: Option<u32>,
}

impl Launcher {
    /// Finds QEMU on PATH (or `~/.cargo/bin`), using TCG; call
    /// [`Launcher::probe_accel`] to switch to KVM where it really boots Linux.
    pub fn detect() -> Result<Self> {
        let qemu = find("qemu-system-x86_64").ok_or(Error::Missing {
            binary: "qemu-system-x86_64",
            hint: "apt-get install -y qemu-system-x86",
        })?;
        Ok(Launcher {
            qemu,
            accel: match std::env::var("IMP_QEMU_ACCEL").as_deref() {
                Ok("kvm") => Accel::Kvm,
                _ => Accel::Tcg,
            },
            tsc_khz: host_tsc_khz(),
            socket_timeout: Duration::from_secs(10),
            qmp_timeout: Duration::from_secs(30),
            agent_port: Some(imp_proto::DEFAULT_API_PORT),
        })
    }

    /// Uses KVM if `kernel` really boots under it here (cached in `cache_dir`), unless
    /// `IMP_QEMU_ACCEL` chose already.
    pub async fn probe_accel(mut self, kernel: &Path, cache_dir: &Path) -> Self {
        if std::env::var_os("IMP_QEMU_ACCEL").is_none() {
            let kvm = super::kvm::probe_boot_cached(
                &self.qemu,
                kernel,
                Duration::from_secs(10),
                cache_dir,
            )
            .await;
            self.accel = if kvm { Accel::Kvm } else { Accel::Tcg };
        }
        self
    }

    /// The kernel argument that lets a microvm guest skip TSC calibration.
    pub fn tsc_arg(&self) -> String {
        format!("tsc_early_khz={}", self.tsc_khz)
    }
}

/// The environment variable naming, `:`-separated, the QEMU binaries a node keeps beside its
/// own to load the snapshots their releases wrote (the agent image keeps the previous QEMU).
pub const KEPT_ENV: &str = "IMP_QEMU_KEPT";

/// The kept QEMU binaries [`KEPT_ENV`] names that exist.
pub fn kept_binaries() -> Vec<PathBuf> {
    std::env::var_os(KEPT_ENV)
        .map(|v| std::env::split_paths(&v).filter(|p| p.is_file()).collect())
        .unwrap_or_default()
}

/// A binary on PATH or in `~/.cargo/bin`.
fn find(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// The host's TSC rate in kHz from `/proc/cpuinfo` (`cpu MHz`).
pub fn host_tsc_khz() -> u64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .filter(|mhz| *mhz > 100.0)
        .map(|mhz| (mhz * 1000.0) as u64)
        .unwrap_or(FALLBACK_TSC_KHZ)
}

/// File names in the run directory.
mod files {
    pub const VSOCK: &str = "vsock.sock";
    pub const SERIAL: &str = "serial.log";
    pub const QEMU_LOG: &str = "qemu.log";
}

/// One VM running under QEMU.
#[derive(Debug)]
pub struct Qemu {
    id: String,
    run_dir: PathBuf,
    child: Child,
    /// Serves the guest channel (VMs with vsock); dropping it ends every stream.
    mux: Option<mux::HostMux>,
    qmp: Qmp,
    state: VmState,
    serial: PathBuf,
    launcher_agent_port: Option<u32>,
    /// Where its RAM lives: a snapshot of a VM whose RAM is a shared file leaves the RAM out.
    memory: GuestMemory,
    /// Its network backend's id, if it has one ([`Vmm::set_link`]).
    net: Option<String>,
}

/// The first QEMU release that maps a read-only file as private, writable guest RAM
/// (`memory-backend-file,readonly=on,rom=off`), which clones of one snapshot need to share its
/// pages ([`GuestMemory::Private`]).
pub const PRIVATE_READ_ONLY_RAM: (u32, u32) = (8, 2);

/// Whether a snapshot's migration stream carries the guest's RAM, as its state file says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RamIn {
    /// The stream holds every page (anonymous or private RAM, and every earlier release).
    Stream,
    /// The stream leaves the RAM out (QEMU's `x-ignore-shared`): the VM's shared memory file
    /// is its memory, and a restore maps it.
    File,
}

/// What a QEMU snapshot's state file holds: the version that wrote it and where its RAM is.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotState {
    /// QMP `query-version` of the QEMU that wrote it.
    pub qemu: serde_json::Value,
    /// Where the RAM is.
    pub ram: RamIn,
}

impl SnapshotState {
    /// Reads a state file; one of an earlier release (only the version) streamed its RAM.
    pub fn parse(text: &str) -> Self {
        serde_json::from_str(text).unwrap_or_else(|_| SnapshotState {
            qemu: serde_json::from_str(text).unwrap_or_default(),
            ram: RamIn::Stream,
        })
    }
}

/// A restore's input: the migration stream and whether it carries the RAM.
struct Incoming<'a> {
    stream: &'a Path,
    ram: RamIn,
}

fn files_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Files { what, path, source }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(5);
    format!("{} ({})", path.display(), lines[start..].join(" | "))
}

impl Qemu {
    /// Starts QEMU for `config`: prepares its run directory, makes the socket pairs of QMP and
    /// the guest channel, spawns it with the command line [`argv::argv`] builds, waits for its
    /// QMP greeting, starts a restore's incoming migration and serves the guest channel. A
    /// restore's VM is left paused, loading its snapshot.
    async fn start(
        launcher: &Launcher,
        config: &VmConfig,
        incoming: Option<Incoming<'_>>,
    ) -> Result<Self> {
        let run_dir = std::path::absolute(&config.run_dir).unwrap_or(config.run_dir.clone());
        let (paths, serial) = prepare_run_dir(launcher, config, &run_dir, incoming.is_some())?;
        if paths.jail.is_some() && config.netns.is_some() {
            return Err(Error::Unsupported {
                id: config.id.clone(),
                reason: "a confined QEMU cannot be started in another network namespace".into(),
            });
        }
        let tap = tap_fd(config, &paths)?;
        // A snapshot is read from a descriptor QEMU inherits (see `argv`).
        let snapshot = match &incoming {
            Some(i) => Some(open_stream(i.stream)?),
            None => None,
        };
        // QMP and the guest channel: socket pairs, QEMU's ends inherited (see `argv`).
        let qmp_pair = socket_pair(&run_dir, "make the QMP socket pair of")?;
        let mux_pair = match config.vsock {
            Some(_) => Some(socket_pair(
                &run_dir,
                "make the guest channel's socket pair of",
            )?),
            None => None,
        };
        let argv = argv::argv(
            launcher,
            config,
            &paths,
            &argv::Fds {
                qmp: qmp_pair.1.as_raw_fd(),
                mux: mux_pair.as_ref().map(|p| p.1.as_raw_fd()),
                tap: tap.as_ref().map(|t| t.0.as_raw_fd()),
            },
            snapshot.is_some(),
        );
        let fds = Inherited {
            snapshot: snapshot.as_ref(),
            tap: tap.as_ref(),
            qmp: &qmp_pair.1,
            mux: mux_pair.as_ref().map(|p| &p.1),
        };
        let mut cmd = command(&argv, &run_dir, paths.jail.as_ref(), fds)?;
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            binary: launcher.qemu.clone(),
            source,
        })?;
        drop(tap);
        let snapshot_fd = snapshot.as_ref().map(|fd| fd.as_raw_fd());
        drop(snapshot);
        // Only QEMU holds its ends now: when it exits, ours read end of file.
        let (qmp_ours, _) = qmp_pair;
        let mux_ours = mux_pair.map(|(ours, _)| ours);
        let mut qmp = wait_for_qmp(launcher, &config.id, &mut child, qmp_ours, &run_dir).await?;
        if let (Some(i), Some(fd)) = (&incoming, snapshot_fd) {
            start_incoming(&mut qmp, i.ram, fd)
                .await
                .map_err(|source| Error::Qmp {
                    id: config.id.clone(),
                    source,
                })?;
        }
        let state = if incoming.is_some() {
            VmState::Paused
        } else {
            VmState::Running
        };
        let mux = start_mux(config, mux_ours, &run_dir)?;
        tracing::info!(vm = %config.id, pid = ?child.id(), accel = ?launcher.accel, "qemu vm started");
        Ok(Qemu {
            id: config.id.clone(),
            run_dir,
            child,
            mux,
            qmp,
            state,
            serial,
            launcher_agent_port: launcher.agent_port,
            memory: config.memory.clone(),
            net: config.net.as_ref().map(|n| n.id.clone()),
        })
    }

    /// Asks imp-guest to end its workload and power off, over the guest agent's vsock port.
    async fn ask_agent(&self, port: u32, grace: Duration) -> std::result::Result<(), String> {
        let stream = self
            .connect_vsock(port, Duration::from_secs(2).min(grace))
            .await
            .map_err(|e| e.to_string())?;
        // The guest is untrusted: 5 s for the whole exchange, however it trickles its bytes.
        let stream = crate::vsock::DeadlineStream::new(stream, Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
        tokio::task::spawn_blocking(move || {
            let hello = imp_proto::Hello::new(concat!("imp-agent ", env!("CARGO_PKG_VERSION")));
            let mut client =
                imp_proto::Client::handshake(stream, &hello).map_err(|e| e.to_string())?;
            client.shutdown(grace).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?
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

    /// Runs a QMP command on this VM's QEMU (diagnostics and tests: what the VMM will do
    /// when asked).
    pub async fn qmp(
        &mut self,
        command: &str,
        args: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        self.qmp
            .execute(command, args)
            .await
            .map_err(|source| Error::Qmp {
                id: self.id.clone(),
                source,
            })
    }

    /// The host Unix socket of the guest's vsock.
    pub fn vsock_uds(&self) -> PathBuf {
        self.run_dir.join(files::VSOCK)
    }

    /// Waits until a restore's incoming migration (running since QEMU started) has landed;
    /// a QEMU that exits while loading is reported with the tail of its log.
    async fn wait_incoming(&mut self) -> Result<()> {
        let deadline = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            let status = match self.qmp.status().await {
                Ok(s) => s,
                // A snapshot QEMU cannot load ends the process: say why, from its log.
                Err(source) => {
                    let log = self.run_dir.join(files::QEMU_LOG);
                    // QMP closes as QEMU exits; give the exit a moment to be reaped.
                    let exited =
                        tokio::time::timeout(Duration::from_secs(2), self.child.wait()).await;
                    return Err(match exited {
                        Ok(Ok(status)) => Error::Exited {
                            what: "QEMU loading a snapshot",
                            id: self.id.clone(),
                            status: status.to_string(),
                            log: tail(&log),
                        },
                        _ => Error::Qmp {
                            id: self.id.clone(),
                            source,
                        },
                    });
                }
            };
            if status == "inmigrate" && Instant::now() >= deadline {
                return Err(Error::Migration {
                    id: self.id.clone(),
                    status: format!("still loading after {MIGRATION_TIMEOUT:?}"),
                });
            }
            match status.as_str() {
                "inmigrate" => tokio::time::sleep(Duration::from_millis(20)).await,
                "paused" | "postmigrate" | "prelaunch" | "running" => return Ok(()),
                other => {
                    return Err(Error::Migration {
                        id: self.id.clone(),
                        status: other.to_string(),
                    });
                }
            }
        }
    }

    /// Waits for a running migration to finish.
    async fn wait_migration(&mut self) -> Result<()> {
        let deadline = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            let info = self.qmp("query-migrate", None).await?;
            let status = info
                .get("status")
                .and_then(|s| s.as_str())
                .unwrap_or("none")
                .to_string();
            match status.as_str() {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    let why = info
                        .get("error-desc")
                        .and_then(|s| s.as_str())
                        .unwrap_or("")
                        .to_string();
                    return Err(Error::Migration {
                        id: self.id.clone(),
                        status: format!("{status}: {why}"),
                    });
                }
                _ if Instant::now() >= deadline => {
                    return Err(Error::Migration {
                        id: self.id.clone(),
                        status: format!(
                            "still {status} after {MIGRATION_TIMEOUT:?}; see {}",
                            self.run_dir.join(files::QEMU_LOG).display()
                        ),
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }
}

/// Makes the run directory ready for a new QEMU and says where QEMU finds its files: creates
/// it, empties the serial log (a restore appends to the one it has), reserves a shared
/// memory file, prepares a confined QEMU's files ([`confine::prepare`]) and removes the
/// guest channel's socket of an earlier run. Returns the paths and the serial log's host path.
fn prepare_run_dir(
    launcher: &Launcher,
    config: &VmConfig,
    run_dir: &Path,
    restore: bool,
) -> Result<(confine::Paths, PathBuf)> {
    std::fs::create_dir_all(run_dir).map_err(files_err("create", run_dir))?;
    let serial = run_dir.join(files::SERIAL);
    if !restore || !serial.exists() {
        std::fs::write(&serial, b"").map_err(files_err("create", &serial))?;
    }
    if let GuestMemory::Shared(file) = &config.memory {
        reserve_memory_file(file, config.memory_mib).map_err(files_err("reserve", file))?;
    }
    let paths = confine::paths(config, run_dir, &serial, launcher.accel == Accel::Kvm);
    confine::prepare(config, &paths, &serial).map_err(files_err("prepare", run_dir))?;
    let _ = std::fs::remove_file(run_dir.join(files::VSOCK));
    Ok((paths, serial))
}

/// The TAP descriptor QEMU inherits, if any: the config's, or, for a confined QEMU (which can
/// open no TAP by name: its network namespace is empty), the config's TAP opened here.
fn tap_fd(config: &VmConfig, paths: &confine::Paths) -> Result<Option<super::TapFd>> {
    let Some(net) = &config.net else {
        return Ok(None);
    };
    if net.tap_fd.is_some() || paths.jail.is_none() {
        return Ok(net.tap_fd.clone());
    }
    let fd = imp_net::tap::open_persistent(&net.tap).map_err(|source| Error::Files {
        what: "open the TAP",
        path: PathBuf::from(&net.tap),
        source,
    })?;
    Ok(Some(super::TapFd(std::sync::Arc::new(fd))))
}

/// Opens a snapshot's migration stream for QEMU to inherit: a confined QEMU cannot open it,
/// and `-sandbox spawn=deny` forbids the `exec:` migration URI.
fn open_stream(stream: &Path) -> Result<std::os::fd::OwnedFd> {
    let f = std::fs::File::open(stream).map_err(files_err("open", stream))?;
    Ok(f.into())
}

/// The descriptors QEMU inherits under their own numbers.
struct Inherited<'a> {
    snapshot: Option<&'a std::os::fd::OwnedFd>,
    tap: Option<&'a super::TapFd>,
    /// QEMU's end of the QMP pair.
    qmp: &'a std::os::unix::net::UnixStream,
    /// QEMU's end of the guest channel's pair.
    mux: Option<&'a std::os::unix::net::UnixStream>,
}

/// A connected socket pair (ours, QEMU's), `what` saying for what in an error, both ends close-on-exec: QEMU's is
/// inherited by QEMU alone ([`inherit_fd`]), by number, and nothing else can reach either.
fn socket_pair(
    run_dir: &Path,
    what: &'static str,
) -> Result<(
    std::os::unix::net::UnixStream,
    std::os::unix::net::UnixStream,
)> {
    std::os::unix::net::UnixStream::pair().map_err(|source| Error::Files {
        what,
        path: run_dir.to_path_buf(),
        source,
    })
}

/// QEMU's process, not yet spawned: `argv` (program first), confined by `jail` if any, with
/// `fds` inherited, stdin empty and stdout and stderr to `qemu.log` in `run_dir`.
fn command(
    argv: &[std::ffi::OsString],
    run_dir: &Path,
    jail: Option<&super::jail::Jail>,
    fds: Inherited<'_>,
) -> Result<Command> {
    let Some((program, args)) = argv.split_first() else {
        return Err(Error::Spawn {
            binary: PathBuf::new(),
            source: std::io::Error::other("empty command line"),
        });
    };
    let mut cmd = Command::new(program);
    cmd.args(args);
    if let Some(fd) = fds.snapshot {
        inherit_fd(&mut cmd, fd);
    }
    if let Some(jail) = jail {
        jail.apply_to(&mut cmd).map_err(|e| Error::Files {
            what: "describe the jail of",
            path: run_dir.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
    }
    let log_path = run_dir.join(files::QEMU_LOG);
    let log = std::fs::File::create(&log_path).map_err(files_err("create", &log_path))?;
    let log2 = log.try_clone().map_err(files_err("reopen", &log_path))?;
    // Its own process group: a Ctrl-C meant for the supervisor (or the agent) must not
    // kill the VM before it is shut down gracefully.
    cmd.stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0)
        .kill_on_drop(true);
    if let Some(fd) = fds.tap {
        inherit_fd(&mut cmd, fd.0.as_ref());
    }
    inherit_fd(&mut cmd, fds.qmp);
    if let Some(fd) = fds.mux {
        inherit_fd(&mut cmd, fd);
    }
    Ok(cmd)
}

/// Speaks QMP over `ours`, the driver's end of QEMU's QMP pair, once QEMU greets, within the
/// launcher's socket timeout; fails at once, with the tail of its log in `run_dir`, if QEMU
/// exits first (its end closes with it).
async fn wait_for_qmp(
    launcher: &Launcher,
    id: &str,
    child: &mut Child,
    ours: std::os::unix::net::UnixStream,
    run_dir: &Path,
) -> Result<Qmp> {
    let log_path = run_dir.join(files::QEMU_LOG);
    let label = run_dir.join("qmp (socket pair)");
    let qmp_err = |source| Error::Qmp {
        id: id.to_owned(),
        source,
    };
    let stream = ours
        .set_nonblocking(true)
        .and_then(|()| UnixStream::from_std(ours))
        .map_err(|source| {
            qmp_err(QmpError::Io {
                socket: label.clone(),
                what: "registering",
                source,
            })
        })?;
    let greeted = tokio::time::timeout(
        launcher.socket_timeout,
        Qmp::over(stream, &label, launcher.qmp_timeout),
    )
    .await;
    match greeted {
        Ok(Ok(qmp)) => Ok(qmp),
        Ok(Err(source)) => {
            // QMP closes as QEMU exits; give the exit a moment to be reaped.
            if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(2), child.wait()).await
            {
                return Err(Error::Exited {
                    what: "QEMU",
                    id: id.to_owned(),
                    status: status.to_string(),
                    log: tail(&log_path),
                });
            }
            Err(qmp_err(source))
        }
        Err(_) => Err(Error::QmpTimeout {
            id: id.to_owned(),
            timeout: launcher.socket_timeout,
            log: tail(&log_path),
        }),
    }
}

/// Starts a restore's deferred migration from the stream QEMU inherited as `fd`, once the
/// migration's capabilities match the stream's (`ram`).
async fn start_incoming(qmp: &mut Qmp, ram: RamIn, fd: RawFd) -> Result<(), QmpError> {
    set_ignore_shared(qmp, ram == RamIn::File).await?;
    // QEMU inherited the descriptor under the same number.
    let uri = format!("fd:{fd}");
    qmp.execute("migrate-incoming", Some(serde_json::json!({ "uri": uri })))
        .await
        .map(|_| ())
}

/// Serves the guest channel of a VM with vsock: `ours`, the driver's end of the pair whose
/// other end is QEMU's virtio-serial chardev, on the host side `vsock.sock`
/// ([`mux::HostMux`]).
fn start_mux(
    config: &VmConfig,
    ours: Option<std::os::unix::net::UnixStream>,
    run_dir: &Path,
) -> Result<Option<mux::HostMux>> {
    let (Some(_), Some(port)) = (&config.vsock, ours) else {
        return Ok(None);
    };
    let vsock = run_dir.join(files::VSOCK);
    mux::HostMux::spawn(config.id.clone(), port, vsock.clone())
        .map(Some)
        .map_err(files_err("listen on", &vsock))
}

/// Makes `file` hold a guest of `mib` MiB: created if missing, its blocks reserved
/// (`fallocate`, unwritten extents: nothing is written and reads see zeros), its data kept.
/// A guest writing to a file that cannot grow would die of SIGBUS on a full disk; reserved,
/// it cannot, and a lack of space is this error before the guest runs.
fn reserve_memory_file(file: &Path, mib: u32) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(file)?;
    let len = i64::from(mib) << 20;
    nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, len)
        .map_err(std::io::Error::from)
}

/// Sets QEMU's `x-ignore-shared` migration capability: on, a stream leaves out RAM that is a
/// shared file (and a restore expects it so).
async fn set_ignore_shared(qmp: &mut Qmp, on: bool) -> std::result::Result<(), QmpError> {
    let caps = serde_json::json!({
        "capabilities": [{ "capability": "x-ignore-shared", "state": on }]
    });
    qmp.execute("migrate-set-capabilities", Some(caps))
        .await
        .map(|_| ())
}

/// Lets QEMU inherit `fd` (a TAP, a snapshot) under the same number (Rust opens everything close-on-exec).
/// Clearing the flag in the child, not the parent, keeps the TAP out of every other process
/// spawned meanwhile.
#[allow(unsafe_code)]
fn inherit_fd(cmd: &mut Command, fd: &impl AsRawFd) {
    let raw = fd.as_raw_fd();
    // SAFETY: the closure runs between fork and exec and only calls fcntl(2), which is
    // async-signal-safe; `raw` stays open in the parent until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(raw, libc::F_GETFD);
            if flags < 0 || libc::fcntl(raw, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl Vmm for Qemu {
    type Launcher = Launcher;
    type Stream = UnixStream;
    type Error = Error;

    async fn boot(launcher: &Launcher, config: &VmConfig) -> Result<Self> {
        if config.drives.iter().filter(|d| d.root).count() > 1 {
            return Err(Error::Unsupported {
                id: config.id.clone(),
                reason: "more than one root drive".into(),
            });
        }
        Self::start(launcher, config, None).await
    }

    async fn restore(
        launcher: &Launcher,
        config: &VmConfig,
        snapshot: &SnapshotFiles,
        resume: bool,
    ) -> Result<Self> {
        let started = Instant::now();
        let state =
            std::fs::read_to_string(&snapshot.state).map_err(files_err("read", &snapshot.state))?;
        let ram = SnapshotState::parse(&state).ram;
        if ram == RamIn::File
            && !matches!(
                config.memory,
                GuestMemory::Shared(_) | GuestMemory::Private(_)
            )
        {
            return Err(Error::Unsupported {
                id: config.id.clone(),
                reason: format!(
                    "its snapshot {} leaves the RAM in a memory file, and the VM was given none",
                    snapshot.state.display()
                ),
            });
        }
        let incoming = Incoming {
            stream: &snapshot.memory,
            ram,
        };
        let mut vm = Self::start(launcher, config, Some(incoming)).await?;
        vm.wait_incoming().await?;
        vm.state = VmState::Paused;
        if resume {
            vm.resume().await?;
        }
        tracing::info!(vm = %vm.id, elapsed_ms = started.elapsed().as_millis() as u64, resume, "qemu snapshot restored");
        Ok(vm)
    }

    async fn pause(&mut self) -> Result<()> {
        self.require("pause", &[VmState::Running])?;
        self.qmp("stop", None).await?;
        self.state = VmState::Paused;
        Ok(())
    }

    async fn resume(&mut self) -> Result<()> {
        self.require("resume", &[VmState::Paused])?;
        self.qmp("cont", None).await?;
        self.state = VmState::Running;
        Ok(())
    }

    async fn set_link(&mut self, up: bool) -> Result<()> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let args = serde_json::json!({ "name": net, "up": up });
        self.qmp("set_link", Some(args)).await.map(|_| ())
    }

    async fn snapshot(&mut self, files: &SnapshotFiles) -> Result<()> {
        self.require("snapshot", &[VmState::Paused])?;
        // The stream goes to a descriptor QEMU is handed: it can open no host file, and may
        // not exec a helper.
        let _ = std::fs::remove_file(&files.memory);
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&files.memory)
            .map_err(files_err("create", &files.memory))?;
        self.qmp
            .execute_with_fd(
                "getfd",
                Some(serde_json::json!({ "fdname": SNAPSHOT_FD })),
                out.as_fd(),
            )
            .await
            .map_err(|source| Error::Qmp {
                id: self.id.clone(),
                source,
            })?;
        drop(out);
        // RAM that is a shared file is the file: the stream leaves it out.
        let ram = match self.memory {
            GuestMemory::Shared(_) => RamIn::File,
            GuestMemory::Anonymous | GuestMemory::Private(_) => RamIn::Stream,
        };
        set_ignore_shared(&mut self.qmp, ram == RamIn::File)
            .await
            .map_err(|source| Error::Qmp {
                id: self.id.clone(),
                source,
            })?;
        let uri = format!("fd:{SNAPSHOT_FD}");
        let migrate = self
            .qmp
            .execute("migrate", Some(serde_json::json!({ "uri": uri })))
            .await;
        match migrate {
            Ok(_) => {}
            // A device QEMU cannot migrate (none of ours) makes the VM unsaveable.
            Err(QmpError::Command { desc, .. }) if desc.contains("non-migratable") => {
                return Err(Error::Unsupported {
                    id: self.id.clone(),
                    reason: format!("QEMU cannot snapshot this VM: {desc}"),
                });
            }
            Err(source) => {
                return Err(Error::Qmp {
                    id: self.id.clone(),
                    source,
                });
            }
        }
        self.wait_migration().await?;
        let qemu = self.qmp("query-version", None).await?;
        let state = serde_json::to_string(&SnapshotState { qemu, ram }).unwrap_or_default();
        std::fs::write(&files.state, state).map_err(files_err("write", &files.state))?;
        Ok(())
    }

    async fn stop(mut self, grace: Duration) -> Result<StopOutcome> {
        // The guest gets `grace` for its workload, then a moment to sync and power off.
        let deadline = Instant::now() + grace + super::POWER_OFF_MARGIN;
        let mut outcome = StopOutcome::Killed;
        if !grace.is_zero() && self.state == VmState::Running {
            let asked = match self.launcher_agent_port {
                Some(port) if self.mux.is_some() => self.ask_agent(port, grace).await,
                _ => Err("no guest agent port or vsock".to_string()),
            };
            if let Err(why) = asked {
                tracing::debug!(vm = %self.id, why, "guest agent shutdown not delivered; ACPI powerdown");
                let _ = self.qmp.execute("system_powerdown", None).await;
            }
        }
        while !grace.is_zero() && self.state != VmState::Paused {
            if let Ok(Some(_)) = self.child.try_wait() {
                outcome = StopOutcome::Graceful;
                break;
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if outcome == StopOutcome::Killed {
            let _ = self.qmp.execute("quit", None).await;
            let _ = tokio::time::timeout(Duration::from_secs(2), self.child.wait()).await;
        }
        let _ = self.child.kill().await;
        self.mux = None;
        self.state = VmState::Stopped;
        tracing::info!(vm = %self.id, ?outcome, "qemu vm stopped");
        Ok(outcome)
    }

    async fn connect_vsock(&self, port: u32, timeout: Duration) -> Result<UnixStream> {
        if self.mux.is_none() {
            return Err(Error::NoVsock(self.id.clone()));
        }
        Ok(vsock::connect(&self.vsock_uds(), port, timeout).await?)
    }

    fn vsock_path(&self) -> Option<PathBuf> {
        self.mux.is_some().then(|| self.vsock_uds())
    }

    fn serial_log_path(&self) -> &Path {
        &self.serial
    }

    fn exited(&mut self) -> Result<bool> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                if self.state != VmState::Stopped {
                    tracing::info!(vm = %self.id, %status, serial = %self.serial.display(), "qemu exited");
                    self.mux = None;
                }
                self.state = VmState::Stopped;
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(source) => Err(Error::Files {
                what: "check on the QEMU process of",
                path: self.run_dir.clone(),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::TapFd;

    /// The fd really reaches QEMU's process under its number, though Rust opens it
    /// close-on-exec.
    #[tokio::test]
    async fn an_inherited_fd_is_open_in_the_child() {
        let fd: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let tap = TapFd(std::sync::Arc::new(fd));
        let raw = tap.0.as_raw_fd();
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!("test -e /proc/self/fd/{raw}"));
        inherit_fd(&mut cmd, tap.0.as_ref());
        assert!(cmd.status().await.unwrap().success());
        let mut plain = Command::new("sh");
        plain.arg("-c").arg(format!("test -e /proc/self/fd/{raw}"));
        assert!(!plain.status().await.unwrap().success());
    }

    #[test]
    fn a_state_file_of_an_earlier_release_means_the_ram_is_in_the_stream() {
        let old = r#"{"qemu":{"major":7,"minor":2,"micro":22},"package":"Debian"}"#;
        assert_eq!(SnapshotState::parse(old).ram, RamIn::Stream);
        let new = r#"{"qemu":{"qemu":{"major":7}},"ram":"file"}"#;
        assert_eq!(SnapshotState::parse(new).ram, RamIn::File);
    }
}
