//! The imp host binary: microVMs under QEMU or Firecracker, on this machine or in a cluster.
//!
//! One command per component: `imp operator` and `imp agent` (the cluster's controller and node
//! agent), `imp crds`; the local VM commands
//! `imp run|exec|ps|stop|rm|console|logs|suspend|resume` and `imp image`; the same
//! `exec|console|logs|ps|suspend|resume` (and `top`) against a cluster's ImpVMs with
//! `-n`/`--kubeconfig`/`--context`, or as the kubectl plugin `kubectl imp`
//! ([`cluster::plugin`]); and `imp version`, `imp completion`. How it ends (exit codes,
//! one-line failures) is [`exit`].

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

mod agent;
mod args;
mod cluster;
mod exit;
mod local;
mod logging;
mod manual;
mod operator;
mod shutdown;
mod version;

/// What `imp --help` opens with.
const ABOUT: &str = "MicroVMs from OCI images, under QEMU or Firecracker: on this machine \
(imp run) or as Kubernetes resources (imp operator + imp agent)";

#[derive(Parser)]
#[command(name = "imp", version, about = ABOUT, after_help = exit::HELP)]
struct Cli {
    /// On failure print every cause and a backtrace; log at debug level (also IMP_LOG=debug).
    #[arg(long, global = true)]
    debug: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot IMAGE as a microVM on this machine (no cluster) and run its workload.
    #[command(after_help = exit::HELP)]
    Run(Box<local::RunArgs>),
    /// Run a command in a VM: a local one, or an ImpVM with -n/--kubeconfig/--context.
    #[command(after_help = exit::HELP)]
    Exec(args::ExecArgs),
    /// List VMs: the local ones, or a cluster's ImpVMs with -n/-A/--kubeconfig/--context.
    Ps(args::PsArgs),
    /// Show the CPU, memory and disk use of a cluster's ImpVMs (-n), as their guests report it.
    Top(cluster::top::TopArgs),
    /// Stop local VMs (SIGTERM to the workload, then power off).
    Stop(local::StopArgs),
    /// Remove local VMs that have ended (their disk, logs and record).
    Rm(local::RmArgs),
    /// Show a VM's serial console: a local one, or an ImpVM with -n/--kubeconfig/--context.
    Console(args::ConsoleArgs),
    /// Print a VM's serial console (-f: follow it): a local one, or an ImpVM with
    /// -n/--kubeconfig/--context.
    Logs(args::LogsArgs),
    /// Suspend a VM to a snapshot on its node (its memory is freed): a local one, or an ImpVM
    /// with -n/--kubeconfig/--context (sets spec.desiredState).
    Suspend(args::SuspendArgs),
    /// Resume a suspended VM from its snapshot: a local one, or an ImpVM with
    /// -n/--kubeconfig/--context (sets spec.desiredState).
    Resume(args::SuspendArgs),
    /// Manage the local image cache.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Show imp's version and commit, and what this machine runs VMs with (QEMU, Firecracker,
    /// guest kernel and init, KVM).
    Version(version::VersionArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completion(manual::CompletionArgs),
    /// Print every imp.dev CustomResourceDefinition as one YAML stream (for kubectl apply -f -).
    Crds,
    /// Run the operator (controller-manager): scheduling, lifecycle, webhook, metrics.
    Operator(Box<operator::Args>),
    /// Run the node agent: boots the ImpVMs placed on this node and reports their status.
    Agent(Box<agent::Args>),
    /// Write the man pages into a directory (docs/man/ holds them, checked against the CLI).
    #[command(hide = true)]
    Man(manual::ManArgs),
    /// The per-VM supervisor that `imp run` and `imp agent` start (not for direct use).
    #[command(hide = true)]
    Shim(ShimArgs),
}

/// `imp image …`.
#[derive(Subcommand)]
enum ImageCommand {
    /// Pull an image into the local cache and build its root filesystem, showing progress.
    Pull(local::image::PullArgs),
    /// Remove stale unpack directories and the cached root filesystems (`--all`: blobs too).
    Prune(local::image::PruneArgs),
}

/// `imp shim`: supervises one VM whose spec its starter wrote into the VM's directory.
#[derive(clap::Args)]
struct ShimArgs {
    /// The state directory holding `vms/ID/`.
    #[arg(long)]
    state_dir: std::path::PathBuf,
    /// Where VMM uids are claimed (the record its starter uses; default: `vmm-uids/` of the
    /// state directory).
    #[arg(long)]
    vmm_uid_dir: Option<std::path::PathBuf>,
    /// The VM's TAP, already open under this descriptor number (the agent held it while the
    /// VM slept); the VMM of a resume inherits it.
    #[arg(long)]
    tap_fd: Option<i32>,
    /// The shim API's listening socket, already bound under this descriptor number by the
    /// starter (without it the shim binds `control.sock` in the VM's directory itself).
    #[arg(long)]
    control_fd: Option<i32>,
    /// The VM's id.
    id: String,
}

fn main() -> ExitCode {
    let parsed = if cluster::plugin::invoked(std::env::args_os().next().as_deref()) {
        cluster::plugin::parse(std::env::args_os())
    } else {
        Cli::try_parse().map(|cli| (cli.debug, cli.command))
    };
    let (debug, command) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            // --help and --version print to stdout and succeed; a usage error is imp's failure.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(exit::IMP_FAILED)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let debug = debug || exit::debug_from_env(std::env::var("IMP_LOG").ok().as_deref());
    if debug {
        backtraces_on();
    }
    match run(command, debug) {
        Ok(code) => ExitCode::from(code),
        Err(e) => ExitCode::from(exit::report(&e, debug)),
    }
}

/// Lets errors capture where they happened, for `--debug` (whatever RUST_BACKTRACE says).
#[allow(unsafe_code)]
fn backtraces_on() {
    // SAFETY: called first thing in main, before any thread exists that could read the
    // environment at the same time.
    unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "1") };
}

/// Runs the command; returns the exit code (a workload's, for `run` and `exec`).
fn run(command: Command, debug: bool) -> anyhow::Result<u8> {
    match command {
        Command::Crds => {
            let yaml = imp_api::crd::yaml_stream().context("generating CRDs")?;
            write_stdout(yaml.as_bytes()).context("writing CRDs to stdout")?;
        }
        Command::Operator(args) => operator::main(*args)?,
        Command::Agent(args) => agent::main(*args)?,
        Command::Run(args) => {
            local_logs(debug);
            return local::run::main(*args).map(exit_code);
        }
        Command::Exec(args) if cluster::wanted(&args.cluster) => {
            return cluster::exec(args).map(exit_code);
        }
        Command::Exec(args) => return local::exec(args).map(exit_code),
        Command::Ps(args) if cluster::ps::wanted(&args) => cluster::ps::ps(args)?,
        Command::Ps(args) => local::ps(args)?,
        Command::Top(args) => cluster::top::top(args)?,
        Command::Stop(args) => local::stop(args)?,
        Command::Rm(args) => local::rm(args)?,
        Command::Suspend(args) if cluster::wanted(&args.cluster) => {
            cluster::set_desired_state(args, imp_api::shared::VmDesiredState::Suspended)?
        }
        Command::Suspend(args) => local::suspend(args)?,
        Command::Resume(args) if cluster::wanted(&args.cluster) => {
            cluster::set_desired_state(args, imp_api::shared::VmDesiredState::Running)?
        }
        Command::Resume(args) => local::resume(args)?,
        Command::Image(ImageCommand::Pull(args)) => {
            local_logs(debug);
            local::image::pull(args)?
        }
        Command::Image(ImageCommand::Prune(args)) => local::image::prune(args)?,
        Command::Console(args) if cluster::wanted(&args.cluster) => cluster::console(args)?,
        Command::Console(args) => local::console(args)?,
        Command::Logs(args) if cluster::wanted(&args.cluster) => cluster::console(args.into())?,
        Command::Logs(args) => local::console(args.into())?,
        Command::Version(args) => version::main(args)?,
        Command::Completion(args) => manual::completion(Cli::command(), &args)?,
        Command::Man(args) => manual::man(Cli::command(), &args)?,
        Command::Shim(args) => shim(args)?,
    }
    Ok(0)
}

/// A workload's exit code as the process's: 0–255 as they are (a code outside that range,
/// which no Linux process can have, is imp's failure).
fn exit_code(code: i32) -> u8 {
    u8::try_from(code).unwrap_or(exit::IMP_FAILED)
}

/// Runs a VM's shim until the VM has ended and its record says how.
fn shim(args: ShimArgs) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let mut state = imp_agent::runtime::state::StateDir::new(args.state_dir);
    if let Some(dir) = args.vmm_uid_dir {
        state = state.with_vmm_uid_dir(dir);
    }
    let tap = args
        .tap_fd
        .map(imp_agent::runtime::shim::inherited_tap)
        .transpose()
        .context("taking the inherited TAP")?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(imp_agent::runtime::shim::run(
            state,
            args.id.clone(),
            tap,
            args.control_fd,
        ))
        .with_context(|| format!("supervising VM {}", args.id))
}

/// Writes `bytes` to stdout; a reader that closed the pipe early (`imp crds | head -1`) ends
/// the output quietly, as with other command-line tools, instead of failing.
fn write_stdout(bytes: &[u8]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}

/// Local commands log warnings to stderr (more with IMP_LOG or RUST_LOG, or all debug lines
/// with `--debug`), keeping stdout for the workload.
fn local_logs(debug: bool) {
    let filter = if debug {
        tracing_subscriber::EnvFilter::new("debug")
    } else {
        tracing_subscriber::EnvFilter::try_from_env("IMP_LOG")
            .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
