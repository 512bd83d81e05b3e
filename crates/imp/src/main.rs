//! The imp host binary: one command per component. Today it prints the CRDs; the operator,
//! the agent and local VMs arrive with their issues.

use std::io::Write;

use anyhow::Context;
use clap::{Parser, Subcommand};

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
    }
    Ok(())
}
