//! The guest's life: prepare the system (as PID 1), start the API and the workload, forward
//! signals, and when the workload ends print the marker, report the exit to the host and end
//! the VM. In dev mode (`--no-pid1`) the same sequence runs without touching the system.

use crate::cmdline::{self, KernelParams};
use crate::console::Console;
use crate::exec::ExecDefaults;
use crate::mux::{self, Mux};
use crate::net;
use crate::reaper::{Reaper, Reaping};
use crate::server::{self, Context};
use crate::system;
use crate::transport::{self, VsockListener, VsockStream};
use crate::user;
use crate::userdata::{self, Stopped};
use crate::workload;
use imp_proto::config::{CONFIG_PATH, GuestConfig, PowerAction};
use imp_proto::marker::user_data_failure_marker;
use imp_proto::report::send_exit_report;
use imp_proto::{ExitStatus, HOST_CID, Hello, WorkloadState};
use nix::sys::signal::{SigSet, Signal, kill};
use nix::unistd::Pid;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// How long the guest keeps trying to deliver its exit report.
const REPORT_DEADLINE: Duration = Duration::from_secs(10);
/// How long the root disk's device node may take to appear after its driver loads.
const ROOT_DEVICE_WAIT: Duration = Duration::from_secs(10);

/// How the guest runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// PID 1 in a VM (mounts, modules, network, power off) or a plain process (dev, tests).
    pub pid1: bool,
    /// The config file; default from the kernel command line or `/.imp/config.json`.
    pub config: Option<PathBuf>,
    /// Serve the API on this Unix socket instead of vsock.
    pub listen_unix: Option<PathBuf>,
    /// Send the exit report to this Unix socket instead of vsock.
    pub report_unix: Option<PathBuf>,
    /// The root whose /etc/passwd, programs and disk are used (`/` in a VM).
    pub root: PathBuf,
}

/// Why the guest could not start its workload at all.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The config file could not be read.
    #[error("Reading the guest config {path} failed")]
    ReadConfig {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is invalid.
    #[error("The guest config {path} is invalid")]
    Config {
        /// The file.
        path: String,
        /// What is wrong.
        #[source]
        source: imp_proto::config::ConfigError,
    },
}

/// What the init's main loop waits for.
/// How long the workload gets after Ctrl-Alt-Del before it is killed.
const CTRL_ALT_DEL_GRACE: Duration = Duration::from_secs(10);

enum Event {
    Exited(ExitStatus),
    Shutdown(Duration),
    Signal(Signal),
    KillNow,
}

fn log(message: &str) {
    eprintln!("imp-guest: {message}");
}

fn log_error(what: &str, err: &dyn std::error::Error) {
    let mut text = format!("{what}: {err}");
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    log(&text);
}

/// Reads and validates the config file.
pub fn load_config(path: &Path) -> Result<GuestConfig, InitError> {
    let bytes = std::fs::read(path).map_err(|source| InitError::ReadConfig {
        path: path.display().to_string(),
        source,
    })?;
    GuestConfig::from_json(&bytes).map_err(|source| InitError::Config {
        path: path.display().to_string(),
        source,
    })
}

/// Runs the guest; returns the workload's shell-style exit code (only in dev mode: as PID 1
/// it ends the VM instead of returning).
pub fn run(opts: &Options) -> i32 {
    let started = Instant::now();
    let signals = block_signals();
    let (mut console, params) = if opts.pid1 {
        prepare_pid1()
    } else {
        (Console::Stdout, KernelParams::default())
    };
    let config_path = config_path(opts, params.config);
    let config = match load_config(&config_path) {
        Ok(c) => c,
        Err(e) => {
            log_error("cannot start the workload", &e);
            return finish(
                opts,
                &mut console,
                &GuestConfig::default(),
                ExitStatus::Code(127),
                started,
            );
        }
    };
    if opts.pid1
        && let Err(e) = setup_system(&config)
    {
        log_error("cannot start the workload", &e);
        return finish(opts, &mut console, &config, ExitStatus::Code(127), started);
    }

    let reaper = match Reaper::start(Reaping::All) {
        Ok(r) => r,
        Err(e) => {
            log_error("starting the reaper failed", &e);
            return finish(opts, &mut console, &config, ExitStatus::Code(127), started);
        }
    };
    let (events, event_rx) = mpsc::channel::<Event>();
    let (shutdown_tx, shutdown_rx) = mpsc::channel::<Duration>();
    forward(shutdown_rx, events.clone(), Event::Shutdown);
    spawn_signal_thread(signals, events.clone());

    let ctx = Arc::new(Context {
        hello: Hello::new(concat!("imp-guest ", env!("CARGO_PKG_VERSION"))),
        started,
        workload: Mutex::new(WorkloadState::Starting),
        exec_defaults: exec_defaults(opts, &config),
        reaper: reaper.clone(),
        proc_dir: PathBuf::from("/proc"),
        disk_path: opts.root.clone(),
        shutdown: Mutex::new(shutdown_tx),
        owns_system: opts.pid1,
    });
    if config.agent.enabled || opts.listen_unix.is_some() {
        start_api(opts, &config, Arc::clone(&ctx));
    }

    let status = match run_user_data(opts, &config, &ctx, &reaper, &event_rx, &mut console) {
        Ok(()) if config.attach => hold(&ctx, &event_rx),
        Ok(()) => run_workload(opts, &config, &ctx, &reaper, &events, &event_rx),
        Err(status) => status,
    };
    ctx.set_workload(WorkloadState::Exited { status });
    finish(opts, &mut console, &config, status, started)
}

/// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread and returns that set. Signals are
/// taken synchronously by one thread; blocking them before any thread exists makes every
/// thread inherit the mask (children get a clean mask from std's spawn).
fn block_signals() -> SigSet {
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(s);
    }
    if let Err(e) = signals.thread_block() {
        log_error("blocking signals failed", &e);
    }
    signals
}

/// The PID 1 steps before the config is read: pseudo filesystems, /dev/console, a check for
/// a timer, Ctrl-Alt-Del routed to us, and the modules named on the kernel command line.
/// Returns the console device and the parsed kernel command line. Failures are logged, never
/// fatal (a missing timer asks for another boot).
fn prepare_pid1() -> (Console, KernelParams) {
    for e in system::mount_pseudo_filesystems() {
        log_error("mount", &e);
    }
    if let Err(e) = system::attach_console() {
        log_error("attaching /dev/console failed", &e);
    }
    // Before anything that sleeps: without a timer the workload would hang in its first
    // sleep and this init in its shutdown. Another boot calibrates afresh.
    if system::has_clock_event() == Some(false) {
        system::ask_for_another_boot(
            "the kernel has no clock event device (no timer interrupts: it disabled its \
             APIC timer at boot)",
        );
    }
    // Ctrl-Alt-Del becomes SIGINT to us (a graceful shutdown) instead of an immediate
    // kernel restart that would skip the workload's exit and the disk's sync.
    if let Err(e) = nix::sys::reboot::set_cad_enabled(false) {
        log_error("routing Ctrl-Alt-Del to the init failed", &e);
    }
    let console = Console::open_device();
    let params = cmdline::parse(&std::fs::read_to_string("/proc/cmdline").unwrap_or_default());
    for m in &params.modules {
        if let Err(e) = system::load_module(m) {
            log_error("module", &e);
        }
    }
    (console, params)
}

/// The config file to read: the `--config` option, else the kernel command line's, else
/// [`CONFIG_PATH`].
fn config_path(opts: &Options, from_cmdline: Option<PathBuf>) -> PathBuf {
    opts.config
        .clone()
        .or(from_cmdline)
        .unwrap_or_else(|| PathBuf::from(CONFIG_PATH))
}

/// What an exec session inherits from the workload: its environment, working directory
/// (`/` when the image names none) and user, and the root it runs in.
fn exec_defaults(opts: &Options, config: &GuestConfig) -> ExecDefaults {
    let identity = user::resolve_in(&opts.root, config.image.user.as_deref())
        .unwrap_or_else(|_| user::Identity::root());
    ExecDefaults {
        env: workload::environment(config, &identity),
        cwd: config
            .image
            .working_dir
            .clone()
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| "/".into()),
        user: config.image.user.clone(),
        root: opts.root.clone(),
    }
}

/// Modules, root disk, hostname, network; only a root disk that cannot be used is fatal.
fn setup_system(config: &GuestConfig) -> Result<(), system::SystemError> {
    for m in &config.modules {
        if let Err(e) = system::load_module(m) {
            log_error("module", &e);
        }
    }
    if let Some(root) = &config.root {
        system::switch_root(
            &root.device,
            &root.fstype,
            root.options.as_deref(),
            ROOT_DEVICE_WAIT,
        )?;
    }
    if let Some(h) = &config.hostname
        && let Err(e) = system::set_hostname(h)
    {
        log_error("hostname", &e);
    }
    if let Err(e) = net::bring_up("lo") {
        log_error("loopback", &e);
    }
    if let Some(n) = &config.network {
        if let Err(e) = net::configure(n) {
            log_error("network", &e);
        }
        if !n.dns.is_empty()
            && let Err(e) = system::write_file(Path::new("/etc/resolv.conf"), &net::resolv_conf(n))
        {
            log_error("resolv.conf", &e);
        }
    }
    if config.hostname.is_some() || config.network.is_some() {
        let hosts = net::hosts(
            config.hostname.as_deref(),
            config.network.as_ref().map(|n| n.address),
        );
        if let Err(e) = system::write_file(Path::new("/etc/hosts"), &hosts) {
            log_error("hosts", &e);
        }
    }
    Ok(())
}

/// How long the guest waits for the host to name its virtio ports.
const MUX_PORT_WAIT: Duration = Duration::from_secs(2);

/// The mux over the `imp.mux` virtio-serial port when the VMM gives one (QEMU: its vsock
/// cannot be snapshotted), found and opened once; `None` means AF_VSOCK (Firecracker).
fn host_mux(opts: &Options) -> Option<&'static Mux> {
    static MUX: OnceLock<Option<Mux>> = OnceLock::new();
    MUX.get_or_init(|| {
        if !opts.pid1 {
            return None;
        }
        let path = mux::find_port(
            Path::new("/sys/class"),
            Path::new("/dev"),
            mux::PORT_NAME,
            MUX_PORT_WAIT,
        )?;
        match Mux::open(&path) {
            Ok(m) => Some(m),
            Err(e) => {
                log_error("opening the mux port failed; using vsock", &e);
                None
            }
        }
    })
    .as_ref()
}

fn start_api(opts: &Options, config: &GuestConfig, ctx: Arc<Context>) {
    let started = match &opts.listen_unix {
        Some(path) => transport::bind_unix(path).map(|l| {
            thread::Builder::new()
                .name("api".into())
                .spawn(move || server::serve(l, ctx))
        }),
        None => match host_mux(opts) {
            Some(m) => {
                let l = m.listen(config.agent.port);
                Ok(thread::Builder::new()
                    .name("api".into())
                    .spawn(move || server::serve(l, ctx)))
            }
            None => VsockListener::bind(config.agent.port).map(|l| {
                thread::Builder::new()
                    .name("api".into())
                    .spawn(move || server::serve(l, ctx))
            }),
        },
    };
    match started {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => log_error("starting the API thread failed", &e),
        Err(e) => log_error("listening for the guest API failed", &e),
    }
}

fn forward<T: Send + 'static>(rx: mpsc::Receiver<T>, events: Sender<Event>, wrap: fn(T) -> Event) {
    let spawned = thread::Builder::new()
        .name("forward".into())
        .spawn(move || {
            while let Ok(v) = rx.recv() {
                if events.send(wrap(v)).is_err() {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        log_error("starting a forwarding thread failed", &e);
    }
}

fn spawn_signal_thread(signals: SigSet, events: Sender<Event>) {
    let spawned = thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            while let Ok(sig) = signals.wait() {
                if events.send(Event::Signal(sig)).is_err() {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        log_error("starting the signal thread failed", &e);
    }
}

/// Applies the VM's user data ([`userdata`]) as root before the workload starts. A failed
/// step is printed on the console for the host ([`user_data_failure_marker`], just before the
/// exit marker) and ends the VM with the step's exit status, the workload never started; a
/// shutdown asked for meanwhile is passed on to the running command and ends the VM too.
fn run_user_data(
    opts: &Options,
    config: &GuestConfig,
    ctx: &Context,
    reaper: &Reaper,
    event_rx: &mpsc::Receiver<Event>,
    console: &mut Console,
) -> Result<(), ExitStatus> {
    let Some(data) = &config.user_data else {
        return Ok(());
    };
    let started = Instant::now();
    // Nothing but signals and shutdown requests can arrive before the workload runs.
    let mut signals = || loop {
        match event_rx.try_recv() {
            Ok(Event::Shutdown(_)) => return Some(Signal::SIGTERM),
            Ok(Event::Signal(sig)) => return Some(sig),
            Ok(_) => {}
            Err(_) => return None,
        }
    };
    let mut guest = userdata::Guest {
        reaper,
        root: opts.root.clone(),
        env: workload::environment(config, &user::Identity::root()),
        signals: &mut signals,
    };
    match userdata::apply(data, &opts.root, &mut guest) {
        Ok(()) => {
            log(&format!("userData applied in {:?}", started.elapsed()));
            Ok(())
        }
        Err(Stopped::ShutDown(status)) => {
            log("shutdown requested while userData ran: the workload is not started");
            Err(status)
        }
        Err(Stopped::Failed(failure)) => {
            let message = format!("userData {failure}");
            log(&format!("{message}; the workload is not started"));
            ctx.set_workload(WorkloadState::Failed {
                message: message.clone(),
            });
            if let Err(e) = console.write_text(&user_data_failure_marker(&failure.to_string())) {
                log_error("printing the userData failure failed", &e);
            }
            Err(ExitStatus::Code(failure.code))
        }
    }
}

/// Starts the workload and waits for it, applying signals and shutdown requests.
fn run_workload(
    opts: &Options,
    config: &GuestConfig,
    ctx: &Context,
    reaper: &Reaper,
    events: &Sender<Event>,
    event_rx: &mpsc::Receiver<Event>,
) -> ExitStatus {
    match start_workload(opts, config, ctx, reaper) {
        Ok((pid, exit)) => {
            forward(exit, events.clone(), Event::Exited);
            supervise_workload(opts.pid1, pid, events, event_rx)
        }
        Err(status) => status,
    }
}

/// Starts the workload with an empty stdin and the console as stdout and stderr, and marks it
/// running; returns its pid and where its exit arrives. When it cannot start, it is marked
/// failed and the error is the shell's status for that (126 not executable, 127 not found).
fn start_workload(
    opts: &Options,
    config: &GuestConfig,
    ctx: &Context,
    reaper: &Reaper,
) -> Result<(u32, mpsc::Receiver<ExitStatus>), ExitStatus> {
    let spec = match workload::prepare(config, &opts.root) {
        Ok(s) => s,
        Err(e) => {
            log_error("cannot start the workload", &e);
            ctx.set_workload(WorkloadState::Failed {
                message: e.to_string(),
            });
            let code = if matches!(e, workload::WorkloadError::NotExecutable(_)) {
                126
            } else {
                127
            };
            return Err(ExitStatus::Code(code));
        }
    };
    let mut command = workload::command(&spec);
    // Like `docker run` without -i: the workload's stdin is empty, never the console, where
    // a shell would wait forever for input nobody can type.
    command
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    let (child, exit) = match reaper.spawn(|| command.spawn()) {
        Ok(c) => c,
        Err(e) => {
            let message = format!("Starting the workload {} failed: {e}", spec.program);
            log(&message);
            ctx.set_workload(WorkloadState::Failed { message });
            return Err(ExitStatus::Code(
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    126
                } else {
                    127
                },
            ));
        }
    };
    let pid = child.id();
    ctx.set_workload(WorkloadState::Running { pid });
    Ok((pid, exit))
}

/// Waits for the running workload `pid` to exit, passing signals on to it; a shutdown
/// request (or, as PID 1, Ctrl-Alt-Del) sends SIGTERM and SIGKILL after the grace period.
fn supervise_workload(
    pid1: bool,
    pid: u32,
    events: &Sender<Event>,
    event_rx: &mpsc::Receiver<Event>,
) -> ExitStatus {
    let target = AtomicI32::new(i32::try_from(pid).unwrap_or(0));
    let send = |sig: Signal| {
        let pid = target.load(Ordering::SeqCst);
        if pid > 0 {
            let _ = kill(Pid::from_raw(pid), sig);
        }
    };
    let shut_down = |grace: Duration| {
        send(Signal::SIGTERM);
        let events = events.clone();
        let _ = thread::Builder::new().name("grace".into()).spawn(move || {
            thread::sleep(grace);
            let _ = events.send(Event::KillNow);
        });
    };
    loop {
        match event_rx.recv() {
            Ok(Event::Exited(status)) => {
                target.store(0, Ordering::SeqCst);
                return status;
            }
            // As PID 1 with Ctrl-Alt-Del routed to us (Firecracker's SendCtrlAltDel, see
            // `run`), SIGINT asks the VM to shut down, as systemd reads it.
            Ok(Event::Signal(Signal::SIGINT)) if pid1 => {
                let grace = CTRL_ALT_DEL_GRACE;
                log(&format!(
                    "Ctrl-Alt-Del: SIGTERM to the workload, SIGKILL after {grace:?}"
                ));
                shut_down(grace);
            }
            Ok(Event::Signal(sig)) => send(sig),
            Ok(Event::Shutdown(grace)) => {
                log(&format!(
                    "shutdown requested: SIGTERM to the workload, SIGKILL after {grace:?}"
                ));
                shut_down(grace);
            }
            Ok(Event::KillNow) => send(Signal::SIGKILL),
            // Every sender lives in this function's callers; unreachable in practice.
            Err(_) => return ExitStatus::Code(255),
        }
    }
}

/// Attached mode: the host runs the workload as an exec session; the VM runs until it is
/// asked to shut down (or, as PID 1, until Ctrl-Alt-Del).
fn hold(ctx: &Context, event_rx: &mpsc::Receiver<Event>) -> ExitStatus {
    log("workload attached: the host runs it as an exec session");
    ctx.set_workload(WorkloadState::Running { pid: 0 });
    loop {
        match event_rx.recv() {
            Ok(Event::Shutdown(_)) | Ok(Event::Signal(Signal::SIGINT | Signal::SIGTERM)) => {
                return ExitStatus::Code(0);
            }
            Ok(_) => {}
            Err(_) => return ExitStatus::Code(255),
        }
    }
}

/// Prints the marker, reports the exit, and ends the VM (or returns the code in dev mode).
fn finish(
    opts: &Options,
    console: &mut Console,
    config: &GuestConfig,
    status: ExitStatus,
    started: Instant,
) -> i32 {
    if let Err(e) = console.exit_marker(status) {
        log_error("printing the exit marker failed", &e);
    }
    let hello = Hello::new(concat!("imp-guest ", env!("CARGO_PKG_VERSION")));
    match (&opts.report_unix, config.agent.exit_report_port) {
        (Some(path), _) => report(|| UnixStream::connect(path), &hello, status),
        (None, Some(port)) => match host_mux(opts) {
            Some(m) => report(|| m.connect(port), &hello, status),
            None => report(|| VsockStream::connect(HOST_CID, port), &hello, status),
        },
        (None, None) => {}
    }
    if !opts.pid1 {
        return status.code();
    }
    log(&format!(
        "workload ended ({status}) after {:?}; ending the VM",
        started.elapsed()
    ));
    system::kill_all(Duration::from_millis(500));
    system::end_vm(config.on_exit == PowerAction::PowerOff)
}

/// Ends the VM after the init itself panicked as PID 1: marker, then power off.
pub fn panic_exit(code: i32) -> ! {
    log("the init panicked; ending the VM");
    let _ = Console::open_device().exit_marker(ExitStatus::Code(code));
    system::end_vm(true)
}

/// Delivers the exit report, retrying the connection for a while; gives up with a log line.
fn report<S, F>(connect: F, hello: &Hello, status: ExitStatus)
where
    S: Read + Write + crate::transport::Connection,
    F: Fn() -> std::io::Result<S>,
{
    let deadline = Instant::now() + REPORT_DEADLINE;
    let mut delay = Duration::from_millis(50);
    loop {
        let attempt = connect().map_err(|e| e.to_string()).and_then(|mut s| {
            let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
            send_exit_report(&mut s, hello, status).map_err(|e| {
                let mut text = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    text.push_str(&format!(": {s}"));
                    src = s.source();
                }
                text
            })
        });
        match attempt {
            Ok(()) => return,
            Err(e) if Instant::now() + delay >= deadline => {
                log(&format!(
                    "giving up on the exit report after {REPORT_DEADLINE:?}: {e}"
                ));
                return;
            }
            Err(_) => {
                thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(config: Option<&str>) -> Options {
        Options {
            pid1: false,
            config: config.map(PathBuf::from),
            listen_unix: None,
            report_unix: None,
            root: PathBuf::from("/"),
        }
    }

    #[test]
    fn the_config_option_beats_the_kernel_command_line_which_beats_the_default() {
        let cmdline = Some(PathBuf::from("/from/cmdline.json"));
        assert_eq!(
            config_path(&options(Some("/from/option.json")), cmdline.clone()),
            PathBuf::from("/from/option.json")
        );
        assert_eq!(
            config_path(&options(None), cmdline),
            PathBuf::from("/from/cmdline.json")
        );
        assert_eq!(
            config_path(&options(None), None),
            PathBuf::from(CONFIG_PATH)
        );
    }
}
