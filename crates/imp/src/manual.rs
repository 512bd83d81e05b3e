//! `imp completion SHELL` and `imp man DIR`: shell completions and man pages generated from the
//! CLI's own definition, so they cannot say anything the CLI does not do. The man pages are
//! committed under `docs/man/`; a test regenerates them and fails when they differ.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use clap_complete::Shell;

/// `imp completion`.
#[derive(Args, Debug)]
#[command(
    after_help = "Load them in the running shell, e.g. `source <(imp completion bash)`, \
or install them: `imp completion bash > /etc/bash_completion.d/imp`, \
`imp completion zsh > \"${fpath[1]}/_imp\"`, \
`imp completion fish > ~/.config/fish/completions/imp.fish`."
)]
pub struct CompletionArgs {
    /// The shell to complete imp's commands and flags in.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// `imp man`.
#[derive(Args, Debug)]
pub struct ManArgs {
    /// Where to write the pages (`imp.1`, `imp-run.1`, …).
    pub dir: PathBuf,
}

/// Prints the completion script for `args.shell` of the CLI `cmd`.
pub fn completion(mut cmd: clap::Command, args: &CompletionArgs) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "imp", &mut script);
    crate::write_stdout(&script).context("writing the completion script to stdout")
}

/// Writes a man page for the CLI `cmd` and each of its visible subcommands into `args.dir`.
pub fn man(cmd: clap::Command, args: &ManArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    clap_mangen::generate_to(cmd, &args.dir)
        .with_context(|| format!("writing the man pages into {}", args.dir.display()))
}
