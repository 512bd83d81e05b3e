//! The imp host binary: one command per component (`imp operator`, `imp crds`, and the local
//! VM commands `imp run|exec|ps|stop|console`).

use std::io::Write;

use anyhow::Context;
use clap::{Parser, Subcommand};

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
    Operator(operator::Args),
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
        Command::Operator(args) => operator::main(args)?,
    }
    Ok(())
}
