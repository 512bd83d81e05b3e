//! `imp-testkube serve`: the test API server as a process, for tests that start binaries.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use imp_testkube::{Auth, Config, TestKube, User};

#[derive(Parser)]
#[command(about = "Kubernetes API server subset for tests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve until killed, printing the address on stdout.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// Port; 0 picks a free one.
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Where to write a kubeconfig for the server.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Events kept for watch resume; older resourceVersions get 410 Gone.
        #[arg(long, default_value_t = 10_000)]
        history: usize,
        /// Seconds between watch bookmarks.
        #[arg(long, default_value_t = 5)]
        bookmark_seconds: u64,
        /// Require bearer tokens: TOKEN=USER[:GROUP,GROUP...] (repeatable). The first goes in the kubeconfig.
        #[arg(long)]
        token: Vec<String>,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let Cmd::Serve {
        host,
        port,
        kubeconfig,
        history,
        bookmark_seconds,
        token,
    } = Cli::parse().cmd;
    let mut auth = Auth::default();
    let mut first = None;
    for t in &token {
        let (tok, who) = t
            .split_once('=')
            .context("--token wants TOKEN=USER[:GROUPS]")?;
        let (user, groups) = who.split_once(':').unwrap_or((who, ""));
        auth.tokens.insert(
            tok.to_string(),
            User {
                name: user.to_string(),
                groups: groups
                    .split(',')
                    .filter(|g| !g.is_empty())
                    .map(String::from)
                    .collect(),
            },
        );
        first.get_or_insert_with(|| tok.to_string());
    }
    let kube = TestKube::start_with(Config {
        host,
        port,
        history,
        bookmark_interval: std::time::Duration::from_secs(bookmark_seconds.max(1)),
        auth,
        kubeconfig_token: first,
        kubeconfig,
    })
    .await?;
    let mut out = std::io::stdout();
    writeln!(out, "{}", kube.url())?;
    writeln!(out, "kubeconfig: {}", kube.kubeconfig().display())?;
    out.flush()?;
    std::future::pending::<()>().await;
    Ok(())
}
