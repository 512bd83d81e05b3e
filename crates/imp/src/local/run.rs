//! `imp run IMAGE [-- CMD…]`: one microVM on this machine, a thin front end over the VM runtime
//! of `imp-agent` ([`imp_agent::runtime`]).
//!
//! It resolves the host files (kernel, modules, guest init, VMM binary), writes the VM's spec
//! into a new VM directory and starts the VM's shim, which pulls the image, builds the disk,
//! boots the VMM and records the end. In the foreground it then streams the workload's console
//! output, forwards Ctrl-C/SIGTERM to the shim as a graceful stop (the workload gets SIGTERM and
//! the stop grace), and exits with the workload's exit code from the record. `imp run -d`
//! returns once the guest agent answers and leaves the VM to its shim.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use imp_agent::runtime::console::{Filter, Follower, Line};
use imp_agent::runtime::control::{self, ShimCommand};
use imp_agent::runtime::spec::{BootFiles, VmSpec};
use imp_agent::runtime::state::{self, StateDir, VmRecord, VmStatus};
use imp_api::shared::VmRuntime;

use super::progress::{Mode, ShimProgress};
use crate::args::{Common, parse_duration, parse_env};

/// How long the workload gets to exit after Ctrl-C before the VM is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(10);

/// Which VMM runs the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RuntimeArg {
    /// QEMU `-M microvm` (TCG where KVM cannot boot Linux guests): works on any x86_64 Linux.
    Qemu,
    /// Firecracker (needs a KVM that boots Linux and an uncompressed vmlinux kernel).
    Firecracker,
}

impl From<RuntimeArg> for VmRuntime {
    fn from(r: RuntimeArg) -> Self {
        match r {
            RuntimeArg::Qemu => VmRuntime::Qemu,
            RuntimeArg::Firecracker => VmRuntime::Firecracker,
        }
    }
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
    #[arg(short = 'd', long, conflicts_with_all = ["interactive", "tty"])]
    pub detach: bool,
    /// Keep stdin open and connect it to the workload (without it, the workload's stdin is
    /// empty, as with `docker run`).
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Give the workload a terminal (with -i: an interactive shell session).
    #[arg(short = 't', long)]
    pub tty: bool,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    pub memory: u32,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    pub cpus: u8,
    /// The VM's own disk in GiB (a clone of the cached image, grown to this size; the image
    /// may not unpack to more).
    #[arg(long, default_value_t = 1)]
    pub disk: u32,
    /// The most bytes an image may unpack to, whatever the disk size.
    #[arg(long, env = "IMP_IMAGE_MAX_BYTES")]
    pub image_max_bytes: Option<u64>,
    /// Environment for the workload, NAME=value (repeatable; wins over the image's Env).
    #[arg(short = 'e', long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// The VMM (default: qemu; firecracker needs a KVM that boots Linux, and its jailer
    /// beside it).
    #[arg(long, value_enum, default_value_t = RuntimeArg::Qemu)]
    pub runtime: RuntimeArg,
    /// Start Firecracker even when no jailer is beside it: it then runs unconfined, as the
    /// user running imp (root: the whole host). Without it such a VM is refused.
    #[arg(long)]
    pub allow_unjailed_firecracker: bool,
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
    /// More guest kernel arguments, after imp's own (as `imp agent --kernel-args`).
    #[arg(long, value_name = "ARGS", env = "IMP_KERNEL_ARGS")]
    pub kernel_args: Option<String>,
    /// Show the whole serial console (kernel and init lines too), not just the workload's.
    #[arg(long)]
    pub raw_console: bool,
    /// How long the guest may take to boot until its agent answers.
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub boot_timeout: Duration,
    /// Show no progress while the image is pulled and unpacked and the disk is made (on a
    /// terminal it is redrawn in place, elsewhere it is a few log lines on stderr).
    #[arg(short = 'q', long)]
    pub quiet: bool,
    #[command(flatten)]
    common: Common,
}

/// The image cache of local VMs (what the shim uses with no `cache_dir` in the spec).
pub fn image_store(state: &StateDir) -> imp_image::ImageStore {
    imp_image::ImageStore::new(state.cache().join("images"), imp_image::Limits::default())
}

/// The allowed ranges of `--cpus`, `--memory` and `--disk`: those of an ImpVMClass (vCPU and
/// disk at least 1, memory at least 128 MiB), with memory at most `host_mib` (the host's).
fn check_resources(cpus: u8, memory_mib: u32, disk_gib: u32, host_mib: u64) -> anyhow::Result<()> {
    if cpus < 1 {
        bail!("--cpus must be between 1 and {}, got {cpus}", u8::MAX);
    }
    if memory_mib < 128 || u64::from(memory_mib) > host_mib {
        bail!(
            "--memory must be between 128 and {host_mib} MiB (this host's memory), got {memory_mib}"
        );
    }
    if disk_gib < 1 || i32::try_from(disk_gib).is_err() {
        bail!(
            "--disk must be between 1 and {} GiB, got {disk_gib}",
            i32::MAX
        );
    }
    Ok(())
}

/// The host's memory in MiB, from /proc/meminfo (`MemTotal`).
fn host_memory_mib() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib / 1024)
        .context("reading MemTotal from /proc/meminfo")
}

/// Runs `imp run`; returns the exit code the process should end with.
pub fn main(args: RunArgs) -> anyhow::Result<i32> {
    check_resources(args.cpus, args.memory, args.disk, host_memory_mib()?)?;
    let state = StateDir::resolve(args.common.state_dir.clone())?;
    let name = match &args.name {
        Some(n) => {
            state::validate_name(n)?;
            n.clone()
        }
        None => state::generate_name(&state)?,
    };
    let mode = Mode::detect(args.quiet);
    let mut spec = spec_for(&args, &name)?;
    spec.progress = mode != Mode::Quiet;
    spec.cgroup = imp_agent::runtime::cgroup::local_path(state.root(), &name)
        .map(|path| imp_agent::node::boot::vm_cgroup(path, spec.vcpus, spec.memory_mib));
    state.create_vm_dir(&name)?;
    let cmd = ShimCommand::current_exe().context("finding the imp binary")?;
    if let Err(e) = control::start(&cmd, &state, &name, &spec) {
        let _ = state.remove(&name);
        return Err(e).context("starting the VM");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // What unpacks killed half-way left behind (not those of other running `imp run`s).
    if let Err(e) = runtime.block_on(image_store(&state).remove_stale()) {
        tracing::warn!(error = %format!("{e:#}"), "removing stale image temporaries");
    }
    let remote = is_registry_reference(&args.image);
    let mut progress = ShimProgress::new(&state.vm_dir(&name), mode, remote);
    if args.detach {
        return runtime.block_on(wait_running(
            &state,
            &name,
            args.boot_timeout,
            &mut progress,
        ));
    }
    let result = if spec.attach {
        runtime.block_on(attached(&state, &name, &args, &mut progress))
    } else {
        let filter = Filter {
            raw: args.raw_console,
        };
        runtime.block_on(follow(&state, &name, filter, &mut progress))
    };
    if args.rm {
        runtime
            .block_on(control::remove(&state, &name, None))
            .with_context(|| format!("removing VM {name}"))?;
    }
    result
}

/// The VM's spec from the flags; every host file is resolved here, not in the shim.
fn spec_for(args: &RunArgs, name: &str) -> anyhow::Result<VmSpec> {
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
    let guest = locate(
        "guest init",
        args.guest.clone(),
        "IMP_GUEST",
        "imp-guest/imp-guest",
    )?;
    let firecracker = match args.runtime {
        RuntimeArg::Firecracker => {
            let fc = locate(
                "firecracker",
                None,
                "IMP_FIRECRACKER",
                "firecracker/firecracker",
            )?;
            // Refused here already, before a VM directory exists; the shim asks again.
            imp_agent::runtime::shim::jailer::for_binary(&fc, args.allow_unjailed_firecracker)
                .map_err(anyhow::Error::msg)?;
            Some(fc)
        }
        RuntimeArg::Qemu => None,
    };
    if args.auth_file.is_some() && !is_registry_reference(&args.image) {
        bail!("--auth-file is for registry images, not {}", args.image);
    }
    let auth_file = match &args.auth_file {
        Some(p) => {
            Some(std::fs::canonicalize(p).with_context(|| format!("reading {}", p.display()))?)
        }
        None => None,
    };
    Ok(VmSpec {
        image: absolute_image(&args.image)?,
        layers: Vec::new(),
        auth_file,
        entrypoint: args.entrypoint.clone(),
        command: args.command.clone(),
        env: parse_env(&args.env)?,
        hostname: name.to_owned(),
        vcpus: args.cpus,
        memory_mib: args.memory,
        disk_gib: args.disk,
        runtime: args.runtime.into(),
        boot: BootFiles {
            kernel,
            modules,
            guest,
            firecracker,
            extra_kernel_args: args.kernel_args.clone().filter(|a| !a.trim().is_empty()),
            allow_unjailed_firecracker: args.allow_unjailed_firecracker,
        },
        boot_timeout_ms: u64::try_from(args.boot_timeout.as_millis()).unwrap_or(u64::MAX),
        // In the foreground this process removes the VM once it has read how it ended.
        remove_on_exit: args.rm && args.detach,
        attach: args.interactive || args.tty,
        cgroup: None,
        cache_dir: None,
        image_max_bytes: args.image_max_bytes,
        image_cache_max_bytes: None,
        owner: None,
        network: None,
        progress: false,
        guest_agent: true,
        from_snapshot: None,
        user_data: None,
    })
}

fn is_registry_reference(image: &str) -> bool {
    matches!(
        image.parse::<imp_image::ImageSource>(),
        Ok(imp_image::ImageSource::Registry(_))
    )
}

/// The shim runs in the VM's directory's world, not ours: `oci:DIR` and `oci-archive:FILE`
/// paths are made absolute so they mean the same there.
pub(crate) fn absolute_image(image: &str) -> anyhow::Result<String> {
    for prefix in ["oci:", "oci-archive:"] {
        if let Some(rest) = image.strip_prefix(prefix)
            && !rest.starts_with('/')
        {
            let cwd = std::env::current_dir().context("reading the current directory")?;
            return Ok(format!("{prefix}{}", cwd.join(rest).display()));
        }
    }
    if !image.contains(':') && std::path::Path::new(image).is_dir() {
        let cwd = std::env::current_dir().context("reading the current directory")?;
        return Ok(cwd.join(image).display().to_string());
    }
    Ok(image.to_owned())
}

/// `imp run -d`: waits until the guest agent answers, then prints the VM's name.
async fn wait_running(
    state: &StateDir,
    name: &str,
    boot_timeout: Duration,
    progress: &mut ShimProgress,
) -> anyhow::Result<i32> {
    let record = until_running(state, name, boot_timeout, progress).await?;
    println!("{name}");
    if record.status == VmStatus::Exited {
        eprintln!(
            "imp: {name} already ended (exit code {})",
            record.exit_code.unwrap_or(-1)
        );
    }
    Ok(0)
}

/// Waits until VM `name` runs (or has already ended), showing its progress; fails if it could
/// not start.
async fn until_running(
    state: &StateDir,
    name: &str,
    boot_timeout: Duration,
    progress: &mut ShimProgress,
) -> anyhow::Result<VmRecord> {
    let waited = boot_timeout + Duration::from_secs(600);
    let deadline = Instant::now() + waited;
    let shim_log = imp_agent::runtime::contract::shim_log(&state.vm_dir(name));
    // The shim's events wake the wait the moment its record changes; the pause between reads
    // only paces the progress lines (and a shim without the API).
    let mut watch = control::client::watch(&state.vm_dir(name))
        .await
        .ok()
        .flatten();
    loop {
        progress.poll();
        if let Some(r) = load(state, name).await {
            let status = r.effective_status();
            if r.vmm_pid.is_some() || status.is_final() || status == VmStatus::Running {
                progress.finish();
            }
            match status {
                VmStatus::Running | VmStatus::Exited | VmStatus::Suspended => return Ok(r),
                VmStatus::Failed => bail!(
                    "VM {name} did not start: {}",
                    r.error
                        .clone()
                        .unwrap_or_else(|| format!("its shim died; see {}", shim_log.display()))
                ),
                VmStatus::Starting | VmStatus::Suspending | VmStatus::Resuming => {}
            }
        }
        if Instant::now() > deadline {
            bail!(
                "VM {name} is still starting after {waited:?}; see {}",
                shim_log.display()
            );
        }
        let pause = tokio::time::sleep(Duration::from_millis(100));
        match &mut watch {
            Some(w) => tokio::select! {
                e = w.next() => if !matches!(e, Ok(Some(_))) { watch = None },
                () = pause => {}
            },
            None => pause.await,
        }
    }
}

/// `imp run -i/-t`: runs the workload as an exec session with our terminal attached, then
/// stops the VM; returns the workload's exit code. Ctrl-C (without -t, where it is a key the
/// workload reads) stops the VM.
async fn attached(
    state: &StateDir,
    name: &str,
    args: &RunArgs,
    progress: &mut ShimProgress,
) -> anyhow::Result<i32> {
    let mut stop = StopSignals::install()?;
    let session = async {
        let record = tokio::select! {
            r = until_running(state, name, args.boot_timeout, progress) => r?,
            () = stop.requested() => return Ok(130),
        };
        let argv = record
            .attach_argv
            .clone()
            .context("the VM's record holds no workload to attach to")?;
        let opts = super::exec::ExecOptions {
            argv,
            env: Vec::new(),
            cwd: None,
            user: None,
            tty: args.tty,
            stdin: args.interactive,
        };
        let (vsock, port) = (record.vsock.clone(), record.agent_port);
        let exec = tokio::task::spawn_blocking(move || {
            let conn = super::exec::connect(&vsock, port, Duration::from_secs(30))?;
            super::exec::exec(conn, &opts)
        });
        tokio::select! {
            r = exec => Ok(r.context("the terminal session task failed")??.code()),
            () = stop.requested() => Ok(130),
        }
    }
    .await;
    // Whatever happened, the VM goes with the session.
    if let Some(record) = load(state, name).await {
        control::stop(state, &record, Duration::from_secs(2))
            .await
            .with_context(|| format!("stopping {name}"))?;
    }
    session
}

async fn load(state: &StateDir, name: &str) -> Option<VmRecord> {
    let (state, name) = (state.clone(), name.to_owned());
    tokio::task::spawn_blocking(move || state.load(&name).ok())
        .await
        .ok()
        .flatten()
}

/// The foreground: prints the workload's console lines until the shim has recorded the end,
/// and turns Ctrl-C and SIGTERM into a graceful stop.
async fn follow(
    state: &StateDir,
    name: &str,
    filter: Filter,
    progress: &mut ShimProgress,
) -> anyhow::Result<i32> {
    let mut stop = StopSignals::install()?;
    // The console is followed from the path the shim records once the VMM runs.
    let mut follower: Option<Follower> = None;
    let mut stopping: Option<tokio::task::JoinHandle<()>> = None;
    let mut seen = false;
    let mut stdout_closed = false;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        let interrupted = tokio::select! {
            _ = tick.tick() => false,
            () = stop.requested() => true,
        };
        let Some(mut record) = load(state, name).await else {
            if seen {
                bail!("VM {name}'s record disappeared (was it removed with `imp rm -f`?)");
            }
            continue;
        };
        seen = true;
        if interrupted && stopping.is_none() {
            let (state, r) = (state.clone(), record.clone());
            stopping = Some(tokio::spawn(async move {
                if let Err(e) = control::stop(&state, &r, INTERRUPT_GRACE).await {
                    eprintln!("imp: stopping {}: {e:#}", r.name);
                }
            }));
        }
        let ended = !record.supervisor_alive();
        if record.vmm_pid.is_some() || record.status.is_final() || ended {
            // Progress ends before the workload's first line.
            progress.finish();
        } else {
            progress.poll();
        }
        if follower.is_none() && (record.vmm_pid.is_some() || record.status.is_final()) {
            follower = Some(Follower::new(&record.serial_log));
        }
        if ended {
            // The shim writes the end just before it exits: read the record once more.
            record = load(state, name).await.unwrap_or(record);
        }
        if let Some(f) = follower.take() {
            let (f, closed) = print_console(f, filter, ended).await;
            follower = Some(f);
            if closed && !stdout_closed {
                // Nobody reads on (`imp run … | head -1`): stop quietly, like Ctrl-C.
                stdout_closed = true;
                if stopping.is_none() {
                    let (state, r) = (state.clone(), record.clone());
                    stopping = Some(tokio::spawn(async move {
                        if let Err(e) = control::stop(&state, &r, INTERRUPT_GRACE).await {
                            eprintln!("imp: stopping {}: {e:#}", r.name);
                        }
                    }));
                }
            }
        }
        if ended {
            return outcome(state, &record);
        }
    }
}

/// SIGINT, SIGTERM and SIGHUP (a closed terminal): each asks the front end to stop the VM.
struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let handler = |kind| signal(kind).context("installing a signal handler");
        Ok(Self {
            int: handler(SignalKind::interrupt())?,
            term: handler(SignalKind::terminate())?,
            hup: handler(SignalKind::hangup())?,
        })
    }

    async fn requested(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
            _ = self.hup.recv() => {}
        }
    }
}

/// Prints what the console has gained; `last` also prints an unterminated final line.
/// Returns the follower and whether stdout was closed by its reader (nothing more is printed
/// to it then).
async fn print_console(mut f: Follower, filter: Filter, last: bool) -> (Follower, bool) {
    let polled = tokio::task::spawn_blocking(move || {
        let mut lines = f.poll().unwrap_or_default();
        // The final pass reads to the end, a bounded poll at a time.
        while last && f.behind() {
            lines.extend(f.poll().unwrap_or_default());
        }
        if last && let Some(rest) = f.rest() {
            lines.push(rest);
        }
        (f, lines)
    })
    .await;
    let Ok((f, lines)) = polled else {
        return (Follower::new(&PathBuf::new()), false);
    };
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let mut closed = false;
    for line in &lines {
        match filter.classify(line) {
            Line::Workload if !closed => {
                closed = is_closed(out.write_all(line.as_bytes()));
            }
            Line::Guest => {
                let text = line.trim_start_matches("imp-guest: ");
                let _ = write!(std::io::stderr(), "imp: guest: {text}");
            }
            Line::Workload | Line::Hidden => {}
        }
    }
    closed |= is_closed(out.flush());
    (f, closed)
}

/// True when a write failed because the reader closed the pipe.
fn is_closed(r: std::io::Result<()>) -> bool {
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// The process's exit code from the VM's final record.
fn outcome(state: &StateDir, record: &VmRecord) -> anyhow::Result<i32> {
    match record.status {
        VmStatus::Exited => Ok(record.exit_code.unwrap_or(0)),
        VmStatus::Failed => bail!("{}", record.error.clone().unwrap_or_default()),
        VmStatus::Suspended => {
            eprintln!(
                "imp: {} was suspended; `imp resume {}` restores it",
                record.name, record.name
            );
            Ok(0)
        }
        VmStatus::Starting | VmStatus::Running | VmStatus::Suspending | VmStatus::Resuming => {
            bail!(
                "the VM's shim died before recording the end; see {}",
                imp_agent::runtime::contract::shim_log(&state.vm_dir(&record.name)).display()
            )
        }
    }
}

/// Finds a file from a flag, an environment variable, or the build tree beside the binary.
pub(crate) fn locate(
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn resources_are_checked_against_the_class_ranges() {
        assert!(check_resources(1, 128, 1, 4096).is_ok());
        let err = |c, m, d| check_resources(c, m, d, 4096).unwrap_err().to_string();
        assert_eq!(err(0, 256, 1), "--cpus must be between 1 and 255, got 0");
        assert!(err(1, 0, 1).starts_with("--memory must be between 128 and 4096 MiB"));
        assert!(err(1, 1 << 30, 1).contains("got 1073741824"));
        assert!(err(1, 256, 0).starts_with("--disk must be between 1 and"));
    }
}
