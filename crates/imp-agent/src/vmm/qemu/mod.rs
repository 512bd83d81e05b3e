//! The QEMU driver: `qemu-system-x86_64 -M microvm`, controlled over QMP, with vsock served by
//! a supervised `vhost-device-vsock`.
//!
//! It exists for hosts where Firecracker cannot boot Linux (no usable KVM: QEMU falls back to
//! TCG) and gives the VM the same shape as the Firecracker driver: virtio-mmio block devices
//! for the drives, a virtio-net device on a host TAP, and a vsock whose host side is a Unix
//! socket speaking Firecracker's `CONNECT <port>` protocol, so [`super::vsock`] serves both.
//!
//! Files in the VM's run directory: `qmp.sock` (control), `vsock.sock` (host side of the
//! guest's vsock; guest connections to host port P arrive on `vsock.sock_P`),
//! `vhost-vsock.sock` (between QEMU and vhost-device-vsock), `serial.log`, `qemu.log` and
//! `vhost-vsock.log`.
//!
//! vhost-device-vsock is started first and watched: if it dies while the VM runs, or its one
//! vring worker thread ends (the process then lives on, serving nothing), QEMU would run on
//! with a dead vsock, so the driver marks the VM's vsock as failed, logs it, and every later
//! vsock connection fails with [`Error::VsockBackendDied`] naming its log.
//!
//! Pausing a VM with vsock freezes the QEMU process (SIGSTOP) instead of QMP `stop`. A QMP
//! `stop` stops the vhost-user rings, and vhost-device-vsock 0.3.0's worker thread exits on the
//! first host-side event it sees while they are stopped (a connection attempt, or a connection
//! closing just before the pause): its `process_tx` fails on the stopped queue and the error
//! ends the thread, leaving the guest's vsock dead for good after `cont` while the daemon
//! process lives on. Freezing QEMU leaves the rings running, so the daemon queues what
//! arrives and the guest sees it on resume. The guest's clock jumps over the pause (TCG
//! follows the host clock), so it still tells the right time afterwards; such guests boot with
//! `nosoftlockup rcupdate.rcu_cpu_stall_suppress=1`, or a pause over 20 s would be reported as
//! a soft lockup. VMs without vsock are paused with QMP `stop`.
//!
//! Snapshots use QEMU's migration stream: `stop`, `migrate` to `exec:cat > FILE`, and restore
//! by a new QEMU started with `-incoming`. QEMU 7.2 refuses to migrate vhost-user-vsock, so a
//! VM with vsock answers [`Error::Unsupported`] (QEMU's own reason included). The whole stream (devices and memory) goes to
//! [`SnapshotFiles::memory`]; [`SnapshotFiles::state`] records the QEMU version it came from.
//! A restored VM's console is appended to `serial.log`, after the output from before the snapshot.

pub mod qmp;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use super::{SnapshotFiles, StopOutcome, VmConfig, VmState, Vmm, vsock};
use qmp::{Qmp, QmpError};

/// Used when the host's TSC rate cannot be read (the guest kernel cannot calibrate it under
/// microvm, which has no PIT or HPET).
const FALLBACK_TSC_KHZ: u64 = 2_000_000;

/// Kernel arguments for guests paused by freezing QEMU: a pause longer than 20 s is not a
/// soft lockup or an RCU stall.
const FROZEN_PAUSE_ARGS: &str = " nosoftlockup rcupdate.rcu_cpu_stall_suppress=1";

/// Longest a snapshot may take to save or load (a 256 MiB guest takes under a second).
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);

/// Longest single vsock connection attempt inside [`Vmm::connect_vsock`]'s overall timeout.
const CONNECT_SLICE: Duration = Duration::from_secs(5);

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
    /// A socket did not appear in time.
    #[error("{socket} did not appear within {timeout:?}")]
    SocketTimeout {
        /// The socket.
        socket: PathBuf,
        /// How long we waited.
        timeout: Duration,
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
    /// vhost-device-vsock died while the VM ran.
    #[error("The vsock backend of VM {id} died; see {log}")]
    VsockBackendDied {
        /// The VM.
        id: String,
        /// vhost-device-vsock's log.
        log: PathBuf,
    },
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
    /// Freezing or thawing the QEMU process failed.
    #[error("Failed to {what} the QEMU process {pid} of VM {id}")]
    Signal {
        /// What was being done.
        what: &'static str,
        /// The VM.
        id: String,
        /// QEMU's process id.
        pid: u32,
        /// The underlying error.
        #[source]
        source: nix::Error,
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
    /// `vhost-device-vsock`, needed for VMs with vsock.
    pub vhost_vsock: Option<PathBuf>,
    /// KVM or TCG.
    pub accel: Accel,
    /// The host's TSC rate for the guest's `tsc_early_khz`.
    pub tsc_khz: u64,
    /// How long QEMU may take to open its QMP socket.
    pub socket_timeout: Duration,
    /// How long one QMP command may take.
    pub qmp_timeout: Duration,
    /// The guest agent's vsock port: [`Vmm::stop`] asks imp-guest to shut down through it;
    /// without it (or when it does not answer) the driver sends ACPI `system_powerdown`.
    pub agent_port: Option<u32>,
}

impl Launcher {
    /// Finds QEMU and vhost-device-vsock on PATH (or `~/.cargo/bin`), using TCG; call
    /// [`Launcher::probe_accel`] to switch to KVM where it really boots Linux.
    pub fn detect() -> Result<Self> {
        let qemu = find("qemu-system-x86_64").ok_or(Error::Missing {
            binary: "qemu-system-x86_64",
            hint: "apt-get install -y qemu-system-x86",
        })?;
        Ok(Launcher {
            qemu,
            vhost_vsock: find("vhost-device-vsock"),
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
    pub const QMP: &str = "qmp.sock";
    pub const VSOCK: &str = "vsock.sock";
    pub const VHOST: &str = "vhost-vsock.sock";
    pub const SERIAL: &str = "serial.log";
    pub const QEMU_LOG: &str = "qemu.log";
    pub const VHOST_LOG: &str = "vhost-vsock.log";
}

/// One VM running under QEMU.
#[derive(Debug)]
pub struct Qemu {
    id: String,
    run_dir: PathBuf,
    child: Child,
    /// The task that owns vhost-device-vsock and flags its death; aborting it kills the daemon.
    vhost: Option<tokio::task::JoinHandle<()>>,
    vhost_pid: Option<u32>,
    vhost_dead: Arc<AtomicBool>,
    qmp: Qmp,
    state: VmState,
    /// Paused by SIGSTOP (VMs with vsock): QMP does not answer until SIGCONT.
    frozen: bool,
    serial: PathBuf,
    launcher_agent_port: Option<u32>,
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
    async fn start(
        launcher: &Launcher,
        config: &VmConfig,
        incoming: Option<&Path>,
    ) -> Result<Self> {
        let run_dir = std::path::absolute(&config.run_dir).unwrap_or(config.run_dir.clone());
        std::fs::create_dir_all(&run_dir).map_err(files_err("create", &run_dir))?;
        for f in [files::QMP, files::VSOCK, files::VHOST] {
            let _ = std::fs::remove_file(run_dir.join(f));
        }
        let serial = run_dir.join(files::SERIAL);
        if incoming.is_none() {
            std::fs::write(&serial, b"").map_err(files_err("create", &serial))?;
        }
        let vhost_dead = Arc::new(AtomicBool::new(false));
        let (vhost, vhost_pid) = match &config.vsock {
            None => (None, None),
            Some(v) => {
                let child = Self::start_vhost(launcher, config, &run_dir, v.guest_cid).await?;
                let pid = child.id();
                let task = supervise_vhost(
                    child,
                    config.id.clone(),
                    run_dir.join(files::VHOST_LOG),
                    Arc::clone(&vhost_dead),
                );
                (Some(task), pid)
            }
        };

        let mut cmd = match &config.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&launcher.qemu);
                c
            }
            None => Command::new(&launcher.qemu),
        };
        let mem = config.memory_mib;
        let machine = if config.vsock.is_some() {
            "microvm,memory-backend=mem"
        } else {
            "microvm"
        };
        cmd.arg("-accel")
            .arg(match launcher.accel {
                Accel::Kvm => "kvm",
                Accel::Tcg => "tcg",
            })
            .args(["-M", machine])
            .args(["-m", &format!("{mem}M")])
            .args(["-smp", &config.vcpus.to_string()]);
        if launcher.accel == Accel::Kvm {
            cmd.args(["-cpu", "host"]);
        }
        if config.vsock.is_some() {
            cmd.arg("-object")
                .arg(format!("memory-backend-memfd,id=mem,size={mem}M,share=on"));
        }
        // `append=on`: `-serial file:` truncates the log, so a restore would lose the console
        // from before the snapshot (a boot has emptied it above).
        cmd.args(["-nographic", "-no-reboot", "-monitor", "none"])
            .arg("-chardev")
            .arg(format!(
                "file,id=serial,path={},append=on",
                serial.display().to_string().replace(',', ",,")
            ))
            .args(["-serial", "chardev:serial"])
            .arg("-qmp")
            .arg(format!(
                "unix:{},server=on,wait=off",
                run_dir.join(files::QMP).display()
            ))
            .arg("-kernel")
            .arg(&config.kernel);
        if let Some(initrd) = &config.initrd {
            cmd.arg("-initrd").arg(initrd);
        }
        let mut append = config.kernel_args.clone();
        if !append.contains("tsc_early_khz=") {
            append.push(' ');
            append.push_str(&launcher.tsc_arg());
        }
        if launcher.accel == Accel::Tcg && !append.contains("tsc=") {
            // Under TCG the guest's TSC is the host's; its timer interrupts are what run late
            // under load, so the clocksource watchdog would wrongly drop the TSC for jiffies.
            append.push_str(" tsc=reliable");
        }
        if config.vsock.is_some() {
            // Such VMs are paused by freezing QEMU (module doc): the guest's clock then jumps
            // over the pause, which its lockup and RCU stall detectors would report as hangs.
            append.push_str(FROZEN_PAUSE_ARGS);
        }
        cmd.arg("-append").arg(append.trim());
        for d in &config.drives {
            let mut drive = format!("id={},file={},format=raw,if=none", d.id, d.path.display());
            if d.read_only {
                drive.push_str(",readonly=on");
            }
            cmd.arg("-drive")
                .arg(drive)
                .arg("-device")
                .arg(format!("virtio-blk-device,drive={}", d.id));
        }
        if let Some(n) = &config.net {
            cmd.arg("-netdev").arg(format!(
                "tap,id={},ifname={},script=no,downscript=no",
                n.id, n.tap
            ));
            let mut dev = format!("virtio-net-device,netdev={}", n.id);
            if let Some(mac) = &n.mac {
                dev.push_str(&format!(",mac={mac}"));
            }
            cmd.arg("-device").arg(dev);
        }
        if config.vsock.is_some() {
            cmd.arg("-chardev")
                .arg(format!(
                    "socket,id=vsock,path={}",
                    run_dir.join(files::VHOST).display()
                ))
                .args(["-device", "vhost-user-vsock-device,chardev=vsock"]);
        }
        if let Some(file) = incoming {
            cmd.arg("-incoming")
                .arg(format!("exec:cat {}", shell_quote(file)));
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
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            binary: launcher.qemu.clone(),
            source,
        })?;

        let qmp_path = run_dir.join(files::QMP);
        let deadline = Instant::now() + launcher.socket_timeout;
        let qmp = loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Error::Exited {
                    what: "QEMU",
                    id: config.id.clone(),
                    status: status.to_string(),
                    log: tail(&log_path),
                });
            }
            if qmp_path.exists() {
                match Qmp::connect(&qmp_path, launcher.qmp_timeout).await {
                    Ok(q) => break q,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(Error::Qmp {
                            id: config.id.clone(),
                            source: e,
                        });
                    }
                    Err(_) => {}
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::SocketTimeout {
                    socket: qmp_path,
                    timeout: launcher.socket_timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let state = if incoming.is_some() {
            VmState::Paused
        } else {
            VmState::Running
        };
        tracing::info!(vm = %config.id, pid = ?child.id(), accel = ?launcher.accel, "qemu vm started");
        Ok(Qemu {
            id: config.id.clone(),
            run_dir,
            child,
            vhost,
            vhost_pid,
            vhost_dead,
            qmp,
            state,
            frozen: false,
            serial,
            launcher_agent_port: launcher.agent_port,
        })
    }

    async fn start_vhost(
        launcher: &Launcher,
        config: &VmConfig,
        run_dir: &Path,
        cid: u32,
    ) -> Result<Child> {
        let binary = launcher.vhost_vsock.clone().ok_or(Error::Missing {
            binary: "vhost-device-vsock",
            hint: "cargo install --locked vhost-device-vsock@0.3.0",
        })?;
        let socket = run_dir.join(files::VHOST);
        let log_path = run_dir.join(files::VHOST_LOG);
        let log = std::fs::File::create(&log_path).map_err(files_err("create", &log_path))?;
        let log2 = log.try_clone().map_err(files_err("reopen", &log_path))?;
        let mut child = Command::new(&binary)
            .arg("--vm")
            .arg(format!(
                "guest-cid={cid},socket={},uds-path={}",
                socket.display(),
                run_dir.join(files::VSOCK).display()
            ))
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Spawn {
                binary: binary.clone(),
                source,
            })?;
        let deadline = Instant::now() + launcher.socket_timeout;
        while !socket.exists() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Error::Exited {
                    what: "vhost-device-vsock",
                    id: config.id.clone(),
                    status: status.to_string(),
                    log: tail(&log_path),
                });
            }
            if Instant::now() >= deadline {
                return Err(Error::SocketTimeout {
                    socket,
                    timeout: launcher.socket_timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(child)
    }

    /// The process id of this VM's vhost-device-vsock, while it runs.
    pub fn vsock_backend_pid(&self) -> Option<u32> {
        self.vhost_pid.filter(|_| !self.vsock_backend_died())
    }

    /// Whether vhost-device-vsock died while the VM ran (its vsock no longer works).
    pub fn vsock_backend_died(&self) -> bool {
        self.vhost_dead.load(Ordering::SeqCst)
    }

    /// Stops the supervisor, which kills vhost-device-vsock.
    fn kill_vhost(&mut self) {
        if let Some(task) = self.vhost.take() {
            task.abort();
        }
    }

    /// Asks imp-guest to end its workload and power off, over the guest agent's vsock port.
    async fn ask_agent(&self, port: u32, grace: Duration) -> std::result::Result<(), String> {
        let stream = self
            .connect_vsock(port, Duration::from_secs(2).min(grace))
            .await
            .map_err(|e| e.to_string())?;
        // The guest is untrusted: 5 s for the whole exchange, however it trickles its bytes.
        let stream = crate::vmm::vsock::DeadlineStream::new(stream, Duration::from_secs(5))
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

    /// Sends `signal` to QEMU (only QEMU: it leads its own process group).
    fn signal(&self, what: &'static str, signal: nix::sys::signal::Signal) -> Result<()> {
        let err = |source| Error::Signal {
            what,
            id: self.id.clone(),
            pid: self.child.id().unwrap_or(0),
            source,
        };
        let pid = self.child.id().ok_or_else(|| err(nix::Error::ESRCH))?;
        let pid = i32::try_from(pid).map_err(|_| err(nix::Error::EINVAL))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).map_err(err)
    }

    /// Stops QEMU with SIGSTOP and waits until the kernel reports it stopped, so no vCPU runs
    /// once pause returns.
    async fn freeze(&mut self) -> Result<()> {
        self.signal("freeze", nix::sys::signal::Signal::SIGSTOP)?;
        self.frozen = true;
        let stat = PathBuf::from(format!("/proc/{}/stat", self.child.id().unwrap_or(0)));
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // The state is the field after the parenthesised command name.
            let state = std::fs::read_to_string(&stat)
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, rest)| rest.trim_start().to_owned())
                })
                .and_then(|rest| rest.chars().next());
            match state {
                Some('T' | 't') => return Ok(()),
                None => return Ok(()), // gone: exited() will say so
                Some(_) if Instant::now() >= deadline => {
                    // Not paused after all: leave it running, as the error says.
                    let _ = self.signal("thaw", nix::sys::signal::Signal::SIGCONT);
                    self.frozen = false;
                    return Err(Error::Signal {
                        what: "freeze (still not stopped after 5 s)",
                        id: self.id.clone(),
                        pid: self.child.id().unwrap_or(0),
                        source: nix::Error::ETIMEDOUT,
                    });
                }
                Some(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
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

    async fn qmp(
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

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// Owns vhost-device-vsock for the VM's life: if it exits, or its vring worker thread ends
/// (the process then lives on with a dead vsock), flags the VM's vsock as dead and says so in
/// the log. QEMU itself runs on with a dead vsock and would not tell anyone.
fn supervise_vhost(
    mut child: Child,
    id: String,
    log: PathBuf,
    dead: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let pid = child.id();
        let mut tick = tokio::time::interval(WORKER_CHECK);
        let why = loop {
            tokio::select! {
                status = child.wait() => break format!("it exited ({status:?})"),
                _ = tick.tick() => {
                    if pid.and_then(vhost_worker_alive) == Some(false) {
                        break format!("its {VHOST_WORKER} thread ended");
                    }
                }
            }
        };
        dead.store(true, Ordering::SeqCst);
        tracing::error!(vm = %id, why, log = %tail(&log),
            "vhost-device-vsock failed: the VM's vsock no longer works");
        // Keep a daemon whose worker died running until the VM stops (kill_on_drop), so its
        // state can still be inspected; it can serve nothing more.
        let _ = child.wait().await;
    })
}

/// The thread of vhost-device-vsock (vhost-user-backend) that moves every vsock packet.
const VHOST_WORKER: &str = "vring_worker";

/// How often the supervisor checks that [`VHOST_WORKER`] still runs.
const WORKER_CHECK: Duration = Duration::from_millis(250);

/// Whether process `pid` still has its [`VHOST_WORKER`] thread; `None` when its threads
/// cannot be read (it is gone).
fn vhost_worker_alive(pid: u32) -> Option<bool> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut any = false;
    for task in tasks.flatten() {
        any = true;
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == VHOST_WORKER {
            return Some(true);
        }
    }
    any.then_some(false)
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        self.kill_vhost();
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
        let mut vm = Self::start(launcher, config, Some(&snapshot.memory)).await?;
        // The incoming migration runs as soon as QEMU starts; wait until it has landed.
        let deadline = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            let status = match vm.qmp.status().await {
                Ok(s) => s,
                // A snapshot QEMU cannot load ends the process: say why, from its log.
                Err(source) => {
                    let log = vm.run_dir.join(files::QEMU_LOG);
                    // QMP closes as QEMU exits; give the exit a moment to be reaped.
                    let exited =
                        tokio::time::timeout(Duration::from_secs(2), vm.child.wait()).await;
                    return Err(match exited {
                        Ok(Ok(status)) => Error::Exited {
                            what: "QEMU loading a snapshot",
                            id: vm.id.clone(),
                            status: status.to_string(),
                            log: tail(&log),
                        },
                        _ => Error::Qmp {
                            id: vm.id.clone(),
                            source,
                        },
                    });
                }
            };
            if status == "inmigrate" && Instant::now() >= deadline {
                return Err(Error::Migration {
                    id: vm.id.clone(),
                    status: format!("still loading after {MIGRATION_TIMEOUT:?}"),
                });
            }
            match status.as_str() {
                "inmigrate" => tokio::time::sleep(Duration::from_millis(20)).await,
                "paused" | "postmigrate" | "prelaunch" => break,
                "running" => break,
                other => {
                    return Err(Error::Migration {
                        id: vm.id.clone(),
                        status: other.to_string(),
                    });
                }
            }
        }
        vm.state = VmState::Paused;
        if resume {
            vm.resume().await?;
        }
        tracing::info!(vm = %vm.id, elapsed_ms = started.elapsed().as_millis() as u64, resume, "qemu snapshot restored");
        Ok(vm)
    }

    async fn pause(&mut self) -> Result<()> {
        self.require("pause", &[VmState::Running])?;
        if self.vhost.is_some() {
            // See the module doc: QMP `stop` would leave vhost-device-vsock's worker to die.
            self.freeze().await?;
        } else {
            self.qmp("stop", None).await?;
        }
        self.state = VmState::Paused;
        Ok(())
    }

    async fn resume(&mut self) -> Result<()> {
        self.require("resume", &[VmState::Paused])?;
        if self.frozen {
            self.signal("thaw", nix::sys::signal::Signal::SIGCONT)?;
            self.frozen = false;
        } else {
            self.qmp("cont", None).await?;
        }
        self.state = VmState::Running;
        Ok(())
    }

    async fn snapshot(&mut self, files: &SnapshotFiles) -> Result<()> {
        // QEMU 7.2 marks vhost-user-vsock unmigratable ("State blocked by non-migratable
        // device"). Refuse before touching the VM: a refused `migrate` after `stop` once left
        // the guest's vsock dead after `cont` in CI.
        if self.vhost.is_some() {
            return Err(Error::Unsupported {
                id: self.id.clone(),
                reason: "QEMU cannot snapshot a VM with vsock: its vhost-user-vsock device is \
                         non-migratable (QEMU 7.2); use the Firecracker driver for snapshots"
                    .into(),
            });
        }
        self.require("snapshot", &[VmState::Paused])?;
        let _ = std::fs::remove_file(&files.memory);
        let uri = format!("exec:cat > {}", shell_quote(&files.memory));
        let migrate = self
            .qmp
            .execute("migrate", Some(serde_json::json!({ "uri": uri })))
            .await;
        match migrate {
            Ok(_) => {}
            // QEMU 7.2 marks vhost-user-vsock unmigratable: a VM with vsock cannot be saved.
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
        let version = self.qmp("query-version", None).await?;
        std::fs::write(&files.state, version.to_string())
            .map_err(files_err("write", &files.state))?;
        Ok(())
    }

    async fn stop(mut self, grace: Duration) -> Result<StopOutcome> {
        // The guest gets `grace` for its workload, then a moment to sync and power off.
        let deadline = Instant::now() + grace + super::POWER_OFF_MARGIN;
        let mut outcome = StopOutcome::Killed;
        if !grace.is_zero() && self.state == VmState::Running {
            let asked = match self.launcher_agent_port {
                Some(port) if self.vhost.is_some() && !self.vsock_backend_died() => {
                    self.ask_agent(port, grace).await
                }
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
        if outcome == StopOutcome::Killed && !self.frozen {
            let _ = self.qmp.execute("quit", None).await;
            let _ = tokio::time::timeout(Duration::from_secs(2), self.child.wait()).await;
        }
        let _ = self.child.kill().await;
        self.kill_vhost();
        self.state = VmState::Stopped;
        tracing::info!(vm = %self.id, ?outcome, "qemu vm stopped");
        Ok(outcome)
    }

    async fn connect_vsock(&self, port: u32, timeout: Duration) -> Result<UnixStream> {
        if self.vhost.is_none() {
            return Err(Error::NoVsock(self.id.clone()));
        }
        if self.vsock_backend_died() {
            return Err(Error::VsockBackendDied {
                id: self.id.clone(),
                log: self.run_dir.join(files::VHOST_LOG),
            });
        }
        // Attempt in slices, so the backend's death is noticed while the guest is slow to
        // answer; an abandoned attempt stays open in the background until it is answered.
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match vsock::connect(&self.vsock_uds(), port, remaining.min(CONNECT_SLICE)).await {
                Ok(stream) => return Ok(stream),
                Err(vsock::Error::Timeout { .. }) if remaining > CONNECT_SLICE => {
                    if self.vsock_backend_died() {
                        return Err(Error::VsockBackendDied {
                            id: self.id.clone(),
                            log: self.run_dir.join(files::VHOST_LOG),
                        });
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn vsock_path(&self) -> Option<PathBuf> {
        self.vhost.is_some().then(|| self.vsock_uds())
    }

    fn serial_log_path(&self) -> &Path {
        &self.serial
    }

    fn exited(&mut self) -> Result<bool> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                if self.state != VmState::Stopped {
                    tracing::info!(vm = %self.id, %status, serial = %self.serial.display(), "qemu exited");
                    self.kill_vhost();
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

    fn helper_pids(&self) -> Vec<u32> {
        // Even with its worker dead the daemon process lives on: it still needs ending.
        self.vhost_pid.into_iter().collect()
    }
}
