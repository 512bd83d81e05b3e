//! `imp run IMAGE [-- CMD…]`: one microVM on this machine, supervised by this process.
//!
//! Steps, each with an error that names what it was doing: pull the image into the shared
//! cache, build (or reuse) its ext4 base, give this VM its own disk clone of `--disk` GiB, write
//! the guest config into a per-VM initramfs on top of the cached guest initramfs (imp-guest as
//! `/init` plus the kernel modules it loads), boot the VMM, wait until the guest agent answers
//! (status `running`), stream the workload's console output, and exit with the workload's exit
//! code, taken from the guest's exit report over vsock or, failing that, the `IMP_EXIT` marker
//! on the console. SIGINT/SIGTERM ask the guest to shut down (the workload gets SIGTERM and the
//! stop grace), then the VMM is killed.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use imp_agent::guest;
use imp_agent::image::{self, ImageSource, ImageStore, RegistryAuth};
use imp_agent::vmm::{self, DriveConfig, StopOutcome, VmConfig, Vmm, VsockConfig};
use imp_proto::config::{GuestConfig, RootDisk};
use imp_proto::message::{ExitStatus, Hello};

use super::console::{Filter, Follower, Line};
use super::state::{self, StateDir, VmRecord, VmStatus};
use super::{Common, parse_duration, parse_env};

/// Set in a detached supervisor's environment: the VM name whose directory its parent made.
const SUPERVISE_ENV: &str = "IMP_SUPERVISE_VM";
/// The guest port the workload's exit report is sent to (CID 2).
const EXIT_REPORT_PORT: u32 = 10001;
/// The guest's vsock context id; each VM has its own vsock device, so one value serves all.
const GUEST_CID: u32 = 3;

/// Which VMM runs the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    /// QEMU `-M microvm` (TCG where KVM cannot boot Linux guests): works on any x86_64 Linux.
    Qemu,
    /// Firecracker (needs a KVM that boots Linux and an uncompressed vmlinux kernel).
    Firecracker,
}

/// `imp run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The image: a registry reference (`registry/repo:tag`, `…@sha256:…`), `oci:DIR[:TAG]`,
    /// `oci-archive:FILE[:TAG]` or a local OCI layout directory.
    pub image: String,
    /// Replaces the image's CMD (the ENTRYPOINT is kept unless --entrypoint is given).
    #[arg(last = true)]
    pub command: Vec<String>,
    /// Replaces the image's ENTRYPOINT.
    #[arg(long)]
    pub entrypoint: Option<String>,
    /// The VM's name (default: imp-XXXXXX).
    #[arg(long)]
    pub name: Option<String>,
    /// Delete the VM's disk, logs and record when it ends.
    #[arg(long)]
    pub rm: bool,
    /// Keep the VM running in the background and print its name once the guest agent answers.
    #[arg(short = 'd', long)]
    pub detach: bool,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    pub memory: u32,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u8,
    /// The VM's own disk in GiB (a clone of the cached image, grown to this size).
    #[arg(long, default_value_t = 1)]
    pub disk: u32,
    /// Environment for the workload, NAME=value (repeatable; wins over the image's Env).
    #[arg(short = 'e', long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// The VMM (default: qemu; firecracker needs a KVM that boots Linux).
    #[arg(long, value_enum, default_value_t = Runtime::Qemu)]
    pub runtime: Runtime,
    /// Guest kernel, an ELF vmlinux or a bzImage (default: IMP_KERNEL, or
    /// target/guest-kernel/vmlinux beside the binary).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// The kernel's modules directory (default: `modules` beside the kernel).
    #[arg(long)]
    pub modules: Option<PathBuf>,
    /// The static guest init (default: IMP_GUEST, or target/imp-guest/imp-guest).
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// A `.dockerconfigjson`-style file with registry credentials.
    #[arg(long)]
    pub auth_file: Option<PathBuf>,
    /// Show the whole serial console (kernel and init lines too), not just the workload's.
    #[arg(long)]
    pub raw_console: bool,
    /// How long the guest may take to boot until its agent answers.
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub boot_timeout: Duration,
    #[command(flatten)]
    common: Common,
}

/// Runs `imp run`; returns the exit code the process should end with.
pub fn main(args: RunArgs) -> anyhow::Result<i32> {
    let state = StateDir::resolve(args.common.state_dir.clone())?;
    let adopted = std::env::var(SUPERVISE_ENV).ok();
    let name = match (&adopted, &args.name) {
        (Some(n), _) => n.clone(),
        (None, Some(n)) => {
            state::validate_name(n)?;
            n.clone()
        }
        (None, None) => state::generate_name(&state)?,
    };
    if args.detach && adopted.is_none() {
        return detach(&state, &name, &args);
    }
    if adopted.is_none() {
        state.create_vm_dir(&name)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(supervise(state, name, args, adopted.is_some()))
}

/// Starts this same command again as a detached supervisor and waits for its VM to run.
fn detach(state: &StateDir, name: &str, args: &RunArgs) -> anyhow::Result<i32> {
    use std::os::unix::process::CommandExt;
    let dir = state.create_vm_dir(name)?;
    let log_path = dir.join("supervisor.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let log2 = log
        .try_clone()
        .context("duplicating the supervisor log handle")?;
    let exe = std::env::current_exe().context("finding the imp binary")?;
    let mut child = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(SUPERVISE_ENV, name)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0)
        .spawn()
        .context("starting the detached supervisor")?;
    let deadline = Instant::now() + args.boot_timeout + Duration::from_secs(600);
    loop {
        if let Some(status) = child.try_wait().context("checking the supervisor")? {
            let why = state
                .load(name)
                .ok()
                .and_then(|r| r.error)
                .unwrap_or_else(|| format!("it exited with {status}; see {}", log_path.display()));
            bail!("VM {name} did not start: {why}");
        }
        if let Ok(record) = state.load(name) {
            match record.status {
                VmStatus::Running => {
                    println!("{name}");
                    return Ok(0);
                }
                VmStatus::Exited => {
                    println!("{name}");
                    eprintln!(
                        "imp: {name} already ended (exit code {})",
                        record.exit_code.unwrap_or(-1)
                    );
                    return Ok(0);
                }
                VmStatus::Failed => bail!(
                    "VM {name} did not start: {}",
                    record.error.unwrap_or_default()
                ),
                VmStatus::Starting => {}
            }
        }
        if Instant::now() > deadline {
            bail!(
                "VM {name} is still starting after {:?}; see {}",
                deadline.duration_since(Instant::now()),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Files of one VM inside its directory.
struct VmFiles {
    dir: PathBuf,
}

impl VmFiles {
    fn disk(&self) -> PathBuf {
        self.dir.join("disk.ext4")
    }
    fn initramfs(&self) -> PathBuf {
        self.dir.join("initramfs.cpio")
    }
    fn stop_grace(&self) -> PathBuf {
        self.dir.join("stop-grace-ms")
    }
}

async fn supervise(
    state: StateDir,
    name: String,
    args: RunArgs,
    detached: bool,
) -> anyhow::Result<i32> {
    let files = VmFiles {
        dir: state.vm_dir(&name),
    };
    let mut record = VmRecord {
        name: name.clone(),
        image: args.image.clone(),
        digest: None,
        runtime: format!("{:?}", args.runtime).to_lowercase(),
        supervisor_pid: std::process::id(),
        vmm_pid: None,
        helper_pids: Vec::new(),
        vsock: files.dir.join("vsock.sock"),
        agent_port: imp_proto::DEFAULT_API_PORT,
        serial_log: files.dir.join("serial.log"),
        created_unix: state::now_unix(),
        status: VmStatus::Starting,
        exit_code: None,
        error: None,
        remove_on_exit: args.rm,
    };
    state.save(&record)?;
    let result = run_vm(&state, &files, &args, &mut record, detached).await;
    match &result {
        Ok(code) => {
            record.status = VmStatus::Exited;
            record.exit_code = Some(*code);
        }
        Err(e) => {
            record.status = VmStatus::Failed;
            record.error = Some(format!("{e:#}"));
        }
    }
    if args.rm {
        state.remove(&name)?;
    } else {
        state.save(&record)?;
    }
    result
}

async fn run_vm(
    state: &StateDir,
    files: &VmFiles,
    args: &RunArgs,
    record: &mut VmRecord,
    detached: bool,
) -> anyhow::Result<i32> {
    let started = Instant::now();
    // Both runtimes boot the uncompressed ELF vmlinux: Firecracker on x86_64 needs it, and
    // QEMU enters it through its PVH note, skipping the decompression a bzImage costs under
    // TCG (boot bench: 0.90x the bzImage's time to agent health).
    let kernel = locate(
        "guest kernel",
        args.kernel.clone(),
        "IMP_KERNEL",
        "guest-kernel/vmlinux",
    )?;
    let modules = args.modules.clone().unwrap_or_else(|| {
        kernel
            .parent()
            .map(|d| d.join("modules"))
            .unwrap_or_default()
    });
    let guest_bin = locate(
        "guest init",
        args.guest.clone(),
        "IMP_GUEST",
        "imp-guest/imp-guest",
    )?;

    // The image and this VM's own disk.
    let source: ImageSource = args
        .image
        .parse()
        .with_context(|| format!("image {:?}", args.image))?;
    let auth = match &args.auth_file {
        None => RegistryAuth::Anonymous,
        Some(path) => {
            let json =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let registry = match &source {
                ImageSource::Registry(r) => r.resolve_registry().to_string(),
                _ => bail!("--auth-file is for registry images, not {}", args.image),
            };
            image::auth_from_docker_config(&json, &registry)
                .with_context(|| format!("credentials in {}", path.display()))?
        }
    };
    let store = ImageStore::new(state.cache().join("images"), image::Limits::default());
    let pulled = store
        .pull(&source, &auth)
        .await
        .with_context(|| format!("pulling {}", args.image))?;
    record.digest = Some(pulled.manifest_digest.clone());
    let base = store
        .rootfs(&pulled, &[])
        .await
        .with_context(|| format!("building the root filesystem of {}", args.image))?;
    tracing::info!(vm = %record.name, image = %args.image, digest = %pulled.manifest_digest, cached = base.cached, "root filesystem ready");
    let disk_bytes = u64::from(args.disk) << 30;
    image::clone_disk(&base.path, &files.disk(), disk_bytes)
        .await
        .with_context(|| format!("giving {} its own {} GiB disk", record.name, args.disk))?;

    // What the guest runs.
    let mut config = GuestConfig {
        hostname: Some(record.name.clone()),
        image: pulled.config.clone(),
        env: parse_env(&args.env)?,
        ..GuestConfig::default()
    };
    if let Some(entrypoint) = &args.entrypoint {
        config.command = Some(vec![entrypoint.clone()]);
        config.args = Some(args.command.clone());
    } else if !args.command.is_empty() {
        config.args = Some(args.command.clone());
    }
    config.agent.exit_report_port = Some(EXIT_REPORT_PORT);
    config.root = Some(RootDisk::ext4("/dev/vda"));
    let base_initrd = guest::initramfs::BaseInitramfs::cached(
        &state.cache().join("initramfs"),
        &guest_bin,
        &modules,
        guest::kernel::VM_MODULES,
    )
    .await
    .context("building the guest initramfs")?;
    config.modules = base_initrd.module_paths().to_vec();
    guest::initramfs::build_for_vm(&base_initrd, &config, &files.initramfs())
        .await
        .context("writing the VM's initramfs")?;

    let vm_config = VmConfig {
        id: record.name.clone(),
        run_dir: files.dir.clone(),
        vcpus: args.cpus,
        memory_mib: args.memory,
        kernel,
        initrd: Some(files.initramfs()),
        kernel_args: format!(
            "console=ttyS0 quiet loglevel=1 panic=-1 reboot=t tsc_early_khz={}",
            vmm::qemu::host_tsc_khz()
        ),
        drives: vec![DriveConfig {
            id: "root".into(),
            path: files.disk(),
            read_only: false,
            root: true,
        }],
        net: None,
        vsock: Some(VsockConfig {
            guest_cid: GUEST_CID,
        }),
        netns: None,
    };
    match args.runtime {
        Runtime::Qemu => {
            let launcher = vmm::qemu::Launcher::detect()
                .context("finding QEMU")?
                .probe_accel(&vm_config.kernel, &state.cache())
                .await;
            drive::<vmm::qemu::Qemu>(
                &launcher, &vm_config, record, state, files, args, detached, started,
            )
            .await
        }
        Runtime::Firecracker => {
            let fc = locate(
                "firecracker",
                None,
                "IMP_FIRECRACKER",
                "firecracker/firecracker",
            )?;
            let launcher = vmm::firecracker::Launcher::new(fc);
            drive::<vmm::firecracker::Firecracker>(
                &launcher, &vm_config, record, state, files, args, detached, started,
            )
            .await
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn drive<V: Vmm>(
    launcher: &V::Launcher,
    config: &VmConfig,
    record: &mut VmRecord,
    state: &StateDir,
    files: &VmFiles,
    args: &RunArgs,
    detached: bool,
    started: Instant,
) -> anyhow::Result<i32> {
    let mut vm = V::boot(launcher, config)
        .await
        .with_context(|| format!("booting {}", record.name))?;
    record.vmm_pid = vm.pid();
    record.helper_pids = vm.helper_pids();
    record.serial_log = vm.serial_log_path().to_path_buf();
    record.vsock = vm
        .vsock_path()
        .context("the VMM gave the VM no vsock socket")?;
    state.save(record)?;
    let exit_reports = listen_for_exit_report(&record.vsock)?;

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("installing the SIGINT handler")?;
    let mut follower = Follower::new(&record.serial_log);
    let filter = Filter {
        raw: args.raw_console,
    };
    let mut console_text = String::new();
    let mut agent = Some(spawn_health_wait(record, args.boot_timeout));
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut reported: Option<ExitStatus> = None;
    let mut stop_requested = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sigterm.recv() => stop_requested = true,
            _ = sigint.recv() => stop_requested = true,
        }
        for line in follower.poll().context("reading the serial console")? {
            show(&filter, &line, detached);
            console_text.push_str(&line);
        }
        if !detached {
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
        if let Some(handle) = &agent
            && handle.is_finished()
        {
            let handle = agent.take().context("agent wait vanished")?;
            match handle.await.context("waiting for the guest agent")? {
                Ok(()) => {
                    record.status = VmStatus::Running;
                    state.save(record)?;
                    tracing::info!(vm = %record.name, boot_ms = started.elapsed().as_millis() as u64, "guest agent answered");
                }
                Err(e) if reported.is_none() && !vm.exited().unwrap_or(true) => {
                    let _ = vm.stop(Duration::ZERO).await;
                    return Err(e.context(format!(
                        "the guest did not come up; console: {}",
                        record.serial_log.display()
                    )));
                }
                Err(_) => {}
            }
        }
        if let Ok(status) = exit_reports.try_recv() {
            reported = Some(status);
        }
        if stop_requested {
            let grace = std::fs::read_to_string(files.stop_grace())
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .map(Duration::from_millis)
                .unwrap_or(Duration::from_secs(10));
            ask_guest_to_shut_down(record, grace).await;
            let outcome = vm
                .stop(grace + Duration::from_secs(5))
                .await
                .with_context(|| format!("stopping {}", record.name))?;
            if outcome == StopOutcome::Killed {
                eprintln!(
                    "imp: {} did not power off within the grace period; killed",
                    record.name
                );
            }
            break;
        }
        if vm.exited().context("checking the VMM")? {
            break;
        }
    }
    for line in follower.poll().unwrap_or_default() {
        show(&filter, &line, detached);
        console_text.push_str(&line);
    }
    if let Some(rest) = follower.rest() {
        console_text.push_str(&rest);
    }
    if reported.is_none() {
        reported = exit_reports.recv_timeout(Duration::from_millis(200)).ok();
    }
    let code = match reported {
        Some(status) => status.code(),
        None => match imp_proto::marker::find_exit_code(&console_text) {
            Some(code) => code,
            None if stop_requested => 128 + 15,
            None => bail!(
                "the VM ended without reporting its workload's exit; console: {}",
                record.serial_log.display()
            ),
        },
    };
    Ok(code)
}

/// Prints a console line where it belongs (nothing when detached: the log has it all).
fn show(filter: &Filter, line: &str, detached: bool) {
    if detached {
        return;
    }
    match filter.classify(line) {
        Line::Workload => print!("{line}"),
        Line::Guest => eprint!("imp: guest: {}", line.trim_start_matches("imp-guest: ")),
        Line::Hidden => {}
    }
}

/// Waits (on a blocking thread) until the guest agent answers a health request.
fn spawn_health_wait(
    record: &VmRecord,
    timeout: Duration,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    let (vsock, port) = (record.vsock.clone(), record.agent_port);
    tokio::task::spawn_blocking(move || {
        let mut conn = super::exec::connect(&vsock, port, timeout)?;
        conn.client
            .health()
            .context("asking the guest agent for its health")?;
        Ok(())
    })
}

/// Asks the guest agent to stop the workload and power off; failures only mean a harder stop.
async fn ask_guest_to_shut_down(record: &VmRecord, grace: Duration) {
    let (vsock, port, name) = (record.vsock.clone(), record.agent_port, record.name.clone());
    let result = tokio::task::spawn_blocking(move || {
        let mut conn = super::exec::connect(&vsock, port, Duration::from_secs(2))?;
        conn.client
            .shutdown(grace)
            .context("asking the guest to shut down")
    })
    .await;
    match result {
        Ok(Ok(())) => tracing::info!(vm = %name, ?grace, "guest shutting down"),
        Ok(Err(e)) => {
            tracing::warn!(vm = %name, error = %format!("{e:#}"), "graceful shutdown not delivered")
        }
        Err(e) => tracing::warn!(vm = %name, error = %e, "graceful shutdown task failed"),
    }
}

/// Listens where the guest's exit report arrives (`<vsock>_<port>`) and hands each report on.
fn listen_for_exit_report(vsock: &Path) -> anyhow::Result<mpsc::Receiver<ExitStatus>> {
    let path = vmm::vsock::host_listener_path(vsock, EXIT_REPORT_PORT);
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path)
        .with_context(|| format!("listening on {}", path.display()))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let ours = Hello::new(concat!("imp/", env!("CARGO_PKG_VERSION")));
            match imp_proto::report::receive_exit_report(&mut stream, &ours) {
                Ok(status) => {
                    if tx.send(status).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "unreadable exit report"),
            }
        }
    });
    Ok(rx)
}

/// Finds a file from a flag, an environment variable, or the build tree beside the binary.
fn locate(
    what: &str,
    flag: Option<PathBuf>,
    env: &str,
    in_target: &str,
) -> anyhow::Result<PathBuf> {
    let given = flag.or_else(|| std::env::var_os(env).map(PathBuf::from));
    if let Some(path) = given {
        if path.is_file() {
            return Ok(path);
        }
        bail!("{what} {} does not exist or is not a file", path.display());
    }
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // target/debug/imp (or target/debug/deps/… in tests) → target/<in_target>
        for dir in exe.ancestors().skip(1).take(3) {
            candidates.push(dir.join(in_target));
        }
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    bail!(
        "no {what} found (tried {}); set {env} or run scripts/setup",
        tried.join(", ")
    )
}
