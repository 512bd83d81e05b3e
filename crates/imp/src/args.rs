//! The arguments of the commands that act on a local VM of `imp run` or, in cluster mode, on
//! an ImpVM (`imp exec|ps|console|logs|suspend|resume`, and `kubectl imp`): their flags and
//! help, the flags that select cluster mode, and the parsers and formats both modes share.
//! [`crate::local`] and [`crate::cluster`] both use them; neither owns them.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::Args;

/// How the commands' help tells local and cluster mode apart.
pub const MODE_HELP: &str = "Local or cluster: with -n/--namespace, --kubeconfig or --context, or \
when run as kubectl-imp (`kubectl imp ...`), VM is an ImpVM in the cluster, reached through the \
Kubernetes API server (imp's aggregated API, subresources.imp.dev) with the kubeconfig's \
credentials; otherwise VM is a local VM of `imp run`.";

/// Flags that point `imp exec` and `imp console` at a cluster instead of a local VM.
#[derive(Args, Debug, Clone, Default)]
pub struct ClusterArgs {
    /// The ImpVM's namespace; selects cluster mode (default: the kubeconfig context's).
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Kubeconfig file; selects cluster mode (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context; selects cluster mode (default: the current context).
    #[arg(long)]
    pub context: Option<String>,
}

/// How `imp ps` tells local and cluster mode apart, and what the cluster table shows.
pub const PS_HELP: &str = "Local or cluster: with -n/--namespace, -A/--all-namespaces, \
--kubeconfig or --context, or when run as kubectl-imp (`kubectl imp ps`), imp ps lists a \
cluster's ImpVMs (NAMESPACE with -A, NAME, PHASE, NODE, ADDRESS, AGE, IMAGE), read with your \
kubeconfig; otherwise the local VMs of `imp run` (-a: also those that have ended).";

/// Flags every local command shares.
#[derive(Args, Debug, Clone)]
pub struct Common {
    /// Where local VMs and the image cache live (default: /var/lib/imp/local as root, else
    /// ~/.local/state/imp; also IMP_STATE_DIR).
    #[arg(long, global = true)]
    pub state_dir: Option<PathBuf>,
}

/// `imp exec`.
#[derive(Args, Debug)]
#[command(after_help = MODE_HELP)]
pub struct ExecArgs {
    /// The VM: a local VM (see `imp ps`), or an ImpVM in cluster mode.
    pub vm: String,
    /// Allocate a terminal in the guest (for shells).
    #[arg(short = 't', long)]
    pub tty: bool,
    /// Forward stdin to the command.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Extra environment, NAME=value (repeatable).
    #[arg(short = 'e', long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Working directory in the guest.
    #[arg(short = 'w', long)]
    pub workdir: Option<String>,
    /// User in the guest (name, uid or uid:gid).
    #[arg(short = 'u', long)]
    pub user: Option<String>,
    /// How long to wait for the guest agent.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// `imp suspend` and `imp resume`.
#[derive(Args, Debug)]
#[command(after_help = MODE_HELP)]
pub struct SuspendArgs {
    /// The VM: a local VM of `imp run -d`, or an ImpVM in cluster mode.
    pub vm: String,
    /// How long to wait for the VM to be suspended (or running again).
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// `imp ps`.
#[derive(Args, Debug)]
#[command(after_help = PS_HELP)]
pub struct PsArgs {
    /// Also list local VMs that have ended (a cluster's ImpVMs are listed in every phase).
    #[arg(short, long)]
    pub all: bool,
    /// List the ImpVMs of every namespace; selects cluster mode.
    #[arg(short = 'A', long, conflicts_with = "namespace")]
    pub all_namespaces: bool,
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// `imp console`.
#[derive(Args, Debug)]
#[command(after_help = MODE_HELP)]
pub struct ConsoleArgs {
    /// The VM: a local VM, or an ImpVM in cluster mode.
    pub vm: String,
    /// Print what the console has so far and exit instead of following it.
    #[arg(long)]
    pub no_follow: bool,
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// `imp logs`: the serial console as `kubectl logs` shows a container's output (what it has so
/// far, or following it with `-f`).
#[derive(Args, Debug)]
#[command(after_help = MODE_HELP)]
pub struct LogsArgs {
    /// The VM: a local VM, or an ImpVM in cluster mode.
    pub vm: String,
    /// Keep printing what the console writes until the VM stops (or Ctrl-C).
    #[arg(short = 'f', long)]
    pub follow: bool,
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

impl From<LogsArgs> for ConsoleArgs {
    /// `logs` is `console` that follows only when asked.
    fn from(args: LogsArgs) -> Self {
        ConsoleArgs {
            vm: args.vm,
            no_follow: !args.follow,
            common: args.common,
            cluster: args.cluster,
        }
    }
}

/// Parses `10s`, `500ms`, `2m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30s, 500ms or 2m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?} is not a duration like 30s, 500ms or 2m")),
    }
}

/// Parses `NAME=value` pairs (`--env`).
pub fn parse_env(pairs: &[String]) -> anyhow::Result<Vec<imp_proto::message::EnvVar>> {
    pairs
        .iter()
        .map(|p| match p.split_once('=') {
            Some((name, value)) if !name.is_empty() && !name.contains('\0') => {
                Ok(imp_proto::message::EnvVar::new(name, value))
            }
            _ => bail!("--env {p:?} must be NAME=value"),
        })
        .collect()
}

/// An age as `ps` shows it: `42s`, `5m`, `3h`, `2d`.
pub(crate) fn age(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m", secs / 60),
        3600..86400 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_env_parse_or_name_the_flag() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5h").is_err());
        let env = parse_env(&["A=1".into(), "B=x=y".into(), "C=".into()]).unwrap();
        assert_eq!(env[1].value, "x=y");
        assert_eq!(env[2].value, "");
        let err = parse_env(&["=1".into()]).unwrap_err().to_string();
        assert!(err.contains("--env"), "{err}");
        assert!(parse_env(&["NOEQ".into()]).is_err());
    }
}
