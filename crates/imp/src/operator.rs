//! `imp operator`: the controller-manager process.

/// Flags of `imp operator`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs the operator until it is told to stop.
pub fn main(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("imp operator is being written")
}
