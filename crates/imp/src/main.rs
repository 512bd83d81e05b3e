//! The imp host binary: one command per component (`imp operator`, `imp agent`, `imp crds`, the
//! local VM commands `imp run|exec|ps|stop|console`, and `imp exec|console` against a cluster,
//! also as the kubectl plugin `kubectl-imp`).

use std::io::Write;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod agent;
mod cluster;
mod local;
mod operator;
mod shutdown;

#[derive(Parser)]
#[command(
    name = "imp",
    version,
    about = "Firecracker microVMs as Kubernetes resources"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every imp.dev CustomResourceDefinition as one YAML stream (for kubectl apply -f -).
    Crds,
    /// Run the operator (controller-manager): scheduling, lifecycle, webhook, metrics.
    Operator(Box<operator::Args>),
    /// Run the node agent: boots the ImpVMs placed on this node and reports their status.
    Agent(Box<agent::Args>),
    /// Boot IMAGE as a microVM on this machine (no cluster) and run its workload.
    Run(Box<local::RunArgs>),
    /// Run a command in a VM: a local one, or an ImpVM with -n/--kubeconfig/--context.
    Exec(local::ExecArgs),
    /// List local VMs.
    Ps(local::PsArgs),
    /// Stop local VMs (SIGTERM to the workload, then power off).
    Stop(local::StopArgs),
    /// Remove local VMs that have ended (their disk, logs and record).
    Rm(local::RmArgs),
    /// Suspend a VM to a snapshot on its node (its memory is freed): a local one, or an ImpVM
    /// with -n/--kubeconfig/--context (sets spec.desiredState).
    Suspend(local::SuspendArgs),
    /// Resume a suspended VM from its snapshot: a local one, or an ImpVM with
    /// -n/--kubeconfig/--context (sets spec.desiredState).
    Resume(local::SuspendArgs),
    /// Manage the local image cache.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Show a VM's serial console: a local one, or an ImpVM with -n/--kubeconfig/--context.
    Console(local::ConsoleArgs),
    /// The per-VM supervisor that `imp run` and `imp agent` start (not for direct use).
    #[command(hide = true)]
    Shim(ShimArgs),
}

/// `imp image …`.
#[derive(Subcommand)]
enum ImageCommand {
    /// Remove stale unpack directories and the cached root filesystems (`--all`: blobs too).
    Prune(local::ImagePruneArgs),
}

/// `imp shim`: supervises one VM whose spec its starter wrote into the VM's directory.
#[derive(clap::Args)]
struct ShimArgs {
    /// The state directory holding `vms/ID/`.
    #[arg(long)]
    state_dir: std::path::PathBuf,
    /// The VM's TAP, already open under this descriptor number (the agent held it while the
    /// VM slept); the VMM of a resume inherits it.
    #[arg(long)]
    tap_fd: Option<i32>,
    /// The VM's id.
    id: String,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => {
            let yaml = imp_api::crd::yaml_stream().context("generating CRDs")?;
            write_stdout(yaml.as_bytes()).context("writing CRDs to stdout")?;
        }
        Command::Operator(args) => operator::main(*args)?,
        Command::Agent(args) => agent::main(*args)?,
        Command::Run(args) => {
            local_logs();
            std::process::exit(local::run::main(*args)?)
        }
        Command::Exec(args) if cluster::wanted(&args.cluster) => {
            std::process::exit(cluster::exec(args)?)
        }
        Command::Exec(args) => std::process::exit(local::exec(args)?),
        Command::Ps(args) => local::ps(args)?,
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
        Command::Image(ImageCommand::Prune(args)) => local::image_prune(args)?,
        Command::Console(args) if cluster::wanted(&args.cluster) => cluster::console(args)?,
        Command::Console(args) => local::console(args)?,
        Command::Shim(args) => shim(args)?,
    }
    Ok(())
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
    let state = imp_agent::runtime::state::StateDir::new(args.state_dir);
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
        .block_on(imp_agent::runtime::supervisor::run(
            state,
            args.id.clone(),
            tap,
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

/// Local commands log warnings to stderr (more with RUST_LOG), keeping stdout for the workload.
fn local_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
