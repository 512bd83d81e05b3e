//! `kubectl imp`: the cluster commands as a kubectl plugin.
//!
//! kubectl runs any executable named `kubectl-NAME` on its `PATH` for `kubectl NAME …`, with
//! the words after `NAME` as its arguments and nothing of its own: no `--kubeconfig`,
//! `--context` or `-n`, which it refuses before a plugin's name. A user writes them after
//! `kubectl imp`, before or after the command, and imp reads `KUBECONFIG` as kubectl does.
//! Linking the `imp` binary as `kubectl-imp` is the whole install. Run under that name, imp
//! parses its command line with this module's [`Cli`]: the same arguments as
//! `imp exec|console|logs|ps|top|suspend|resume` (every one of them in cluster mode), help that
//! says `kubectl imp`, and no local command: those act on this machine's VMs of `imp run`, not
//! on the cluster, so `kubectl imp run` is refused with a message saying to run `imp run`
//! instead of being hidden or, worse, quietly booting a VM on the user's laptop.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::args::{ConsoleArgs, ExecArgs, LogsArgs, PsArgs, SuspendArgs};

/// The file name under which kubectl finds imp as its `imp` plugin.
pub const NAME: &str = "kubectl-imp";

/// What `kubectl imp --help` opens with.
const ABOUT: &str = "imp's cluster commands as a kubectl plugin: run commands in ImpVMs, read \
their serial console, list them and show their guests' figures, suspend and resume them";

/// What `kubectl imp --help` ends with: where the flags go, and what is not here.
const AFTER_HELP: &str = "kubectl passes none of its own flags to a plugin: write -n/--namespace, \
--kubeconfig and --context after `kubectl imp` (`kubectl imp -n team ps`). Without them the \
kubeconfig is KUBECONFIG's, else ~/.kube/config, and the namespace its context's. exec, \
console, logs and top go through the API server, which checks whether you may create \
impvms/exec, get impvms/console or list guestmetrics of subresources.imp.dev (logs reads the \
console); no credential of yours reaches a node. Local VMs (imp run, stop, rm, image, …) are not the cluster's: use `imp` for them.";

/// What each command's help ends with.
const COMMAND_HELP: &str = "VM is an ImpVM in the namespace of -n (default: the kubeconfig \
context's), read with your kubeconfig (--kubeconfig, else KUBECONFIG, else ~/.kube/config).";

/// `kubectl imp …`.
#[derive(Parser)]
#[command(
    name = NAME,
    bin_name = "kubectl imp",
    version,
    about = ABOUT,
    after_help = AFTER_HELP,
)]
pub struct Cli {
    /// On failure print every cause and a backtrace (also IMP_LOG=debug).
    #[arg(long, global = true)]
    pub debug: bool,
    #[command(subcommand)]
    command: Command,
}

/// The commands of `kubectl imp`: imp's cluster commands.
#[derive(Subcommand)]
enum Command {
    /// Run a command in an ImpVM, through its node's agent.
    #[command(after_help = COMMAND_HELP)]
    Exec(ExecArgs),
    /// Show an ImpVM's serial console, following it (unless --no-follow).
    #[command(after_help = COMMAND_HELP)]
    Console(ConsoleArgs),
    /// Print an ImpVM's serial console as `kubectl logs` prints a container's output (-f:
    /// follow it).
    ///
    /// The serial console holds what the guest kernel and the workload wrote to it, from the
    /// VM's boot; with -f the command keeps printing until the VM stops (or Ctrl-C).
    #[command(after_help = COMMAND_HELP)]
    Logs(LogsArgs),
    /// List ImpVMs: those of a namespace (-n), or of every namespace (-A).
    #[command(
        after_help = "Columns: NAMESPACE (with -A), NAME, PHASE, NODE, ADDRESS, AGE, \
IMAGE. Listing needs only `list impvms`, with any kubeconfig authentication."
    )]
    Ps(PsArgs),
    /// Show the CPU, memory and disk use of a namespace's ImpVMs, as their guests report it.
    Top(crate::cluster::top::TopArgs),
    /// Suspend an ImpVM to a snapshot on its node (sets spec.desiredState: Suspended) and wait
    /// until it is.
    #[command(after_help = COMMAND_HELP)]
    Suspend(SuspendArgs),
    /// Resume a suspended ImpVM (sets spec.desiredState: Running) and wait until it runs.
    #[command(after_help = COMMAND_HELP)]
    Resume(SuspendArgs),
}

impl From<Command> for crate::Command {
    fn from(command: Command) -> Self {
        match command {
            Command::Exec(a) => crate::Command::Exec(a),
            Command::Console(a) => crate::Command::Console(a),
            Command::Logs(a) => crate::Command::Logs(a),
            Command::Ps(a) => crate::Command::Ps(a),
            Command::Top(a) => crate::Command::Top(a),
            Command::Suspend(a) => crate::Command::Suspend(a),
            Command::Resume(a) => crate::Command::Resume(a),
        }
    }
}

/// Whether the binary runs as the kubectl plugin: invoked as `kubectl-imp` (argv[0] is the path
/// kubectl found it under).
pub fn invoked(argv0: Option<&OsStr>) -> bool {
    argv0
        .and_then(|a| Path::new(a).file_name())
        .is_some_and(|name| name == NAME)
}

/// The plugin's command line: the cluster commands, with the flags that mean nothing in the
/// cluster (`--state-dir`, `ps -a`) hidden, every VM argument an ImpVM, and no word of a
/// "cluster mode" that is the only mode here.
fn command() -> clap::Command {
    let mut cmd = Cli::command();
    for name in ["exec", "console", "logs", "ps", "suspend", "resume"] {
        cmd = cmd.mut_subcommand(name, |sub| {
            let mut sub = sub.mut_arg("state_dir", |a| a.hide(true));
            for flag in ["namespace", "kubeconfig", "context"] {
                sub = sub.mut_arg(flag, without_mode);
            }
            if name == "ps" {
                sub.mut_arg("all", |a| a.hide(true))
                    .mut_arg("all_namespaces", without_mode)
            } else {
                let sub = sub.mut_arg("vm", |a| a.help("The ImpVM's name"));
                // A changed argument goes last and positionals are numbered in order: put
                // exec's command back after the VM.
                if name == "exec" {
                    sub.mut_arg("command", |a| a)
                } else {
                    sub
                }
            }
        });
    }
    cmd.mut_subcommand("top", |mut sub| {
        for flag in ["namespace", "kubeconfig", "context"] {
            sub = sub.mut_arg(flag, without_mode);
        }
        sub
    })
}

/// `arg` with its help's "; selects cluster mode" left out.
fn without_mode(arg: clap::Arg) -> clap::Arg {
    let help = arg
        .get_help()
        .map(|h| h.to_string().replace("; selects cluster mode", ""));
    match help {
        Some(help) => arg.help(help),
        None => arg,
    }
}

/// Parses `kubectl imp`'s arguments into imp's `--debug` and command.
pub fn parse(
    args: impl IntoIterator<Item = OsString>,
) -> Result<(bool, crate::Command), clap::Error> {
    let mut cmd = command();
    let args = cluster_flags_after_command(args.into_iter().collect());
    let matches = match cmd.try_get_matches_from_mut(args) {
        Ok(m) => m,
        Err(e) => return Err(local_command_refused(&e, &crate::Cli::command()).unwrap_or(e)),
    };
    let cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))?;
    Ok((cli.debug, cli.command.into()))
}

/// The cluster flags, which imp's commands take after their name.
const CLUSTER_FLAGS: [&str; 4] = ["-n", "--namespace", "--kubeconfig", "--context"];

/// `args` (argv\[0\] first) with the cluster flags written before the command moved after it:
/// kubectl refuses flags before a plugin's name, so its users write `kubectl imp -n team ps`.
/// Anything else before the command (`--debug`, `--help`) stays where it is; without a command
/// the arguments are left as they are, for clap to explain.
fn cluster_flags_after_command(args: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut moved = Vec::new();
    let mut rest = args.iter();
    out.extend(rest.next().cloned());
    while let Some(arg) = rest.next() {
        let text = arg.to_string_lossy();
        let is = |flag: &str| {
            text == flag || (flag.starts_with("--") && text.starts_with(&format!("{flag}=")))
        };
        if CLUSTER_FLAGS.iter().any(|f| is(f)) {
            moved.push(arg.clone());
            if !text.contains('=')
                && let Some(value) = rest.next()
            {
                moved.push(value.clone());
            }
        } else if text.starts_with("-n") && text.len() > 2 {
            moved.push(arg.clone()); // -nteam
        } else if text.starts_with('-') {
            out.push(arg.clone());
        } else {
            out.push(arg.clone());
            out.append(&mut moved);
            out.extend(rest.cloned());
            return out;
        }
    }
    args
}

/// For a command `kubectl imp` does not have but `imp` does (`run`, `stop`, `image`, …), the
/// error that says so and how to run it; `None` for other errors (a typo keeps clap's "did you
/// mean").
fn local_command_refused(err: &clap::Error, imp: &clap::Command) -> Option<clap::Error> {
    if err.kind() != ErrorKind::InvalidSubcommand {
        return None;
    }
    let Some(ContextValue::String(name)) = err.get(ContextKind::InvalidSubcommand) else {
        return None;
    };
    let known = imp
        .get_subcommands()
        .any(|s| !s.is_hide_set() && s.get_name() == name);
    known.then(|| {
        clap::Error::raw(
            ErrorKind::InvalidSubcommand,
            format!(
                "there is no `kubectl imp {name}`: `imp {name}` works on this machine, not on \
                 the cluster, so run it as `imp {name}` (kubectl imp has exec, console, logs, \
                 ps, top, suspend and resume)\n"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse_words(words: &[&str]) -> Result<(bool, crate::Command), clap::Error> {
        parse(words.iter().map(OsString::from))
    }

    #[test]
    fn the_plugin_is_told_by_its_file_name() {
        assert!(invoked(Some(OsStr::new("/usr/local/bin/kubectl-imp"))));
        assert!(invoked(Some(OsStr::new("kubectl-imp"))));
        assert!(!invoked(Some(OsStr::new("/usr/bin/imp"))));
        assert!(!invoked(Some(OsStr::new("kubectl-impx"))));
        assert!(!invoked(Some(OsStr::new("/opt/kubectl-imp/imp"))));
        assert!(!invoked(None));
    }

    #[test]
    fn the_plugins_command_line_is_well_formed_and_says_kubectl_imp() {
        let mut cmd = command();
        cmd.clone().debug_assert();
        cmd.build();
        let help = cmd.render_help().to_string();
        assert!(
            help.contains("Usage: kubectl imp [OPTIONS] <COMMAND>"),
            "{help}"
        );
        for name in ["exec", "console", "logs", "ps", "top", "suspend", "resume"] {
            assert!(help.contains(&format!("  {name} ")), "{name}: {help}");
        }
        for local in ["run", "stop", "rm", "image", "operator", "agent", "crds"] {
            assert!(!help.contains(&format!("  {local} ")), "{local}: {help}");
        }
        let mut logs = cmd.find_subcommand_mut("logs").unwrap().clone();
        let help = logs.render_help().to_string();
        assert!(
            help.contains("Usage: kubectl imp logs [OPTIONS] <VM>"),
            "{help}"
        );
        assert!(
            !help.contains("--state-dir") && !help.contains("cluster mode"),
            "{help}"
        );
    }

    #[test]
    fn the_cluster_commands_parse_into_imps() {
        let (debug, command) =
            parse_words(&["kubectl-imp", "exec", "web", "-n", "team", "--", "ls", "-l"]).unwrap();
        assert!(!debug);
        let crate::Command::Exec(args) = command else {
            panic!("not an exec")
        };
        assert_eq!(args.vm, "web");
        assert_eq!(args.command, ["ls", "-l"]);
        assert_eq!(args.cluster.namespace.as_deref(), Some("team"));
        let (debug, command) =
            parse_words(&["kubectl-imp", "--debug", "logs", "-f", "web"]).unwrap();
        assert!(debug);
        let crate::Command::Logs(args) = command else {
            panic!("not logs")
        };
        assert!(args.follow);
        let (_, command) = parse_words(&["kubectl-imp", "ps", "-A"]).unwrap();
        assert!(matches!(command, crate::Command::Ps(a) if a.all_namespaces));
    }

    #[test]
    fn cluster_flags_before_the_command_are_moved_after_it() {
        let words = |w: &[&str]| -> Vec<OsString> { w.iter().map(OsString::from).collect() };
        let moved = |w: &[&str]| cluster_flags_after_command(words(w));
        assert_eq!(
            moved(&["k", "-n", "team", "--debug", "ps", "-A"]),
            words(&["k", "--debug", "ps", "-n", "team", "-A"])
        );
        assert_eq!(
            moved(&[
                "k",
                "--kubeconfig=/k",
                "-nteam",
                "--context",
                "c",
                "logs",
                "web"
            ]),
            words(&[
                "k",
                "logs",
                "--kubeconfig=/k",
                "-nteam",
                "--context",
                "c",
                "web"
            ])
        );
        // Already after the command, or no command at all: as written.
        let after = ["k", "exec", "web", "-n", "team", "--", "ls", "-n"];
        assert_eq!(moved(&after), words(&after));
        assert_eq!(moved(&["k", "-n", "team"]), words(&["k", "-n", "team"]));
        assert_eq!(moved(&["k"]), words(&["k"]));
        let (_, command) = parse_words(&["kubectl-imp", "-n", "team", "suspend", "web"]).unwrap();
        let crate::Command::Suspend(args) = command else {
            panic!("not a suspend")
        };
        assert_eq!(args.cluster.namespace.as_deref(), Some("team"));
    }

    #[test]
    fn a_local_command_is_refused_with_the_way_to_run_it_and_a_typo_keeps_clap_s_hint() {
        let err = parse_words(&["kubectl-imp", "run", "busybox"])
            .err()
            .unwrap();
        assert_eq!(err.kind(), ErrorKind::InvalidSubcommand);
        let text = err.to_string();
        assert!(
            text.contains("there is no `kubectl imp run`") && text.contains("run it as `imp run`"),
            "{text}"
        );
        let err = parse_words(&["kubectl-imp", "exce", "web"]).err().unwrap();
        let text = err.to_string();
        assert!(
            text.contains("exec") && !text.contains("there is no"),
            "{text}"
        );
        // Hidden commands are not advertised, not even as refused.
        let err = parse_words(&["kubectl-imp", "shim", "x"]).err().unwrap();
        assert!(!err.to_string().contains("imp shim"), "{err}");
    }
}
