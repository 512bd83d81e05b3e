//! The imp host binary: one command per component (`imp operator`, `imp crds`, the local
//! VM commands `imp run|exec|ps|stop|console`, and `imp exec|console` against a cluster, also
//! as the kubectl plugin `kubectl-imp`).

use std::io::Write;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod cluster;
mod local;
mod operator;

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
    /// Show a VM's serial console: a local one, or an ImpVM with -n/--kubeconfig/--context.
    Console(local::ConsoleArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => {
            let yaml = imp_api::crd::yaml_stream().context("generating CRDs")?;
            std::io::stdout()
                .lock()
                .write_all(yaml.as_bytes())
                .context("writing CRDs to stdout")?;
        }
        Command::Operator(args) => operator::main(*args)?,
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
        Command::Console(args) if cluster::wanted(&args.cluster) => cluster::console(args)?,
        Command::Console(args) => local::console(args)?,
    }
    Ok(())
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
