//! Local VMs, no cluster: `imp run IMAGE` boots one microVM on this machine, and
//! `imp exec|ps|stop|rm|console|logs` act on the VMs it started.
//!
//! Every VM is owned by its shim, the per-VM supervisor of `imp-agent`'s runtime
//! ([`imp_agent::runtime`]): `imp run` starts it and follows the console (or, with `-d`, returns
//! once the guest agent answers); the other commands find a VM through the record its shim
//! writes and talk to the shim with signals.

pub mod exec;
pub mod image;
pub mod progress;
pub mod run;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;

use imp_agent::runtime::console;
use imp_agent::runtime::shim;
use imp_agent::runtime::state::{self, StateDir, VmStatus};
use imp_agent::runtime::suspend;
pub use run::RunArgs;

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
#[command(after_help = crate::cluster::MODE_HELP)]
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
    common: Common,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// `imp stop`.
#[derive(Args, Debug)]
pub struct StopArgs {
    /// The local VMs to stop.
    #[arg(required = true)]
    pub vms: Vec<String>,
    /// How long the workload gets to exit after SIGTERM before the VM is killed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub time: Duration,
    #[command(flatten)]
    common: Common,
}

/// `imp rm`.
#[derive(Args, Debug)]
pub struct RmArgs {
    /// The local VMs to remove (their disk, logs and record).
    #[arg(required = true)]
    pub vms: Vec<String>,
    /// Stop running VMs first instead of refusing.
    #[arg(short, long)]
    pub force: bool,
    #[command(flatten)]
    common: Common,
}

/// `imp suspend` and `imp resume`.
#[derive(Args, Debug)]
#[command(after_help = crate::cluster::MODE_HELP)]
pub struct SuspendArgs {
    /// The VM: a local VM of `imp run -d`, or an ImpVM in cluster mode.
    pub vm: String,
    /// How long to wait for the VM to be suspended (or running again).
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub timeout: Duration,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// `imp ps`.
#[derive(Args, Debug)]
#[command(after_help = crate::cluster::ps::HELP)]
pub struct PsArgs {
    /// Also list local VMs that have ended (a cluster's ImpVMs are listed in every phase).
    #[arg(short, long)]
    pub all: bool,
    /// List the ImpVMs of every namespace; selects cluster mode.
    #[arg(short = 'A', long, conflicts_with = "namespace")]
    pub all_namespaces: bool,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// `imp console`.
#[derive(Args, Debug)]
#[command(after_help = crate::cluster::MODE_HELP)]
pub struct ConsoleArgs {
    /// The VM: a local VM, or an ImpVM in cluster mode.
    pub vm: String,
    /// Print what the console has so far and exit instead of following it.
    #[arg(long)]
    pub no_follow: bool,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// `imp logs`: the serial console as `kubectl logs` shows a container's output (what it has so
/// far, or following it with `-f`).
#[derive(Args, Debug)]
#[command(after_help = crate::cluster::MODE_HELP)]
pub struct LogsArgs {
    /// The VM: a local VM, or an ImpVM in cluster mode.
    pub vm: String,
    /// Keep printing what the console writes until the VM stops (or Ctrl-C).
    #[arg(short = 'f', long)]
    pub follow: bool,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
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

/// `imp exec VM -- CMD…`: returns the command's shell-style exit code.
pub fn exec(args: ExecArgs) -> anyhow::Result<i32> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let record = state.load(&args.vm)?;
    if record.effective_status() != VmStatus::Running {
        bail!(
            "VM {:?} is not running (status {:?}); see `imp ps -a`",
            args.vm,
            record.effective_status()
        );
    }
    let conn = exec::connect(&record.vsock, record.agent_port, args.timeout)?;
    let opts = exec::ExecOptions {
        argv: args.command,
        env: parse_env(&args.env)?,
        cwd: args.workdir,
        user: args.user,
        tty: args.tty,
        stdin: args.interactive || args.tty,
    };
    let status = exec::exec(conn, &opts)?;
    Ok(status.code())
}

/// `imp ps`: one line per local VM.
pub fn ps(args: PsArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let (records, broken) = state.list()?;
    println!(
        "{:<20} {:<9} {:<5} {:<12} {:>8}  IMAGE",
        "NAME", "STATUS", "EXIT", "RUNTIME", "AGE"
    );
    let now = state::now_unix();
    for r in records {
        let status = r.effective_status();
        if !args.all && status.is_final() {
            continue;
        }
        let exit = r.exit_code.map(|c| c.to_string()).unwrap_or_default();
        println!(
            "{:<20} {:<9} {:<5} {:<12} {:>8}  {}",
            r.name,
            status.as_str(),
            exit,
            r.runtime,
            age(now.saturating_sub(r.created_unix)),
            r.image
        );
    }
    for (path, err) in broken {
        eprintln!("imp: skipping {}: {err:#}", path.display());
    }
    Ok(())
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

/// `imp stop VM…`: asks each supervisor to shut its VM down and waits for it.
pub fn stop(args: StopArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let mut failed = 0;
    for name in &args.vms {
        match stop_one(&state, name, args.time) {
            Ok(()) => println!("{name}"),
            Err(e) => {
                eprintln!("imp: stopping {name}: {e:#}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} VMs could not be stopped", args.vms.len());
    }
    Ok(())
}

fn stop_one(state: &StateDir, name: &str, grace: Duration) -> anyhow::Result<()> {
    let mut record = state.load(name)?;
    if record.status == VmStatus::Suspended && !record.supervisor_alive() {
        // Nothing runs: stopping a suspended VM discards its snapshot.
        std::fs::remove_dir_all(state.snapshot_dir(name))
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
            .with_context(|| format!("removing the snapshot of {name}"))?;
        record.status = VmStatus::Exited;
        record.exit_code = Some(imp_agent::runtime::supervisor::STOPPED_EXIT_CODE);
        record.finished_unix = Some(state::now_unix());
        record.suspend = None;
        state.save(&record)?;
        return Ok(());
    }
    if !record.supervisor_alive() {
        kill_orphaned_vmm(state, &record);
        return Ok(());
    }
    // The shim turns SIGTERM into a graceful guest shutdown with the grace written beside its
    // record, then kills the VMM if the guest does not power off.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(shim::stop(state, &record, grace))?;
    Ok(())
}

/// Kills a VMM whose shim died without stopping it, and says so.
fn kill_orphaned_vmm(state: &StateDir, record: &state::VmRecord) {
    for (pid, what) in shim::kill_orphans(state, record) {
        eprintln!(
            "imp: {}: its supervisor had died; killed the orphaned {what} (pid {pid})",
            record.name
        );
    }
}

/// `imp rm VM…`: deletes ended VMs (or, with `--force`, stops them first).
pub fn rm(args: RmArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let mut failed = 0;
    for name in &args.vms {
        let result = state
            .load(name)
            .map_err(anyhow::Error::from)
            .and_then(|record| {
                if record.supervisor_alive() {
                    if !args.force {
                        bail!("it is still running: `imp stop {name}` first, or use --force");
                    }
                    stop_one(&state, name, Duration::from_secs(5))?;
                } else {
                    kill_orphaned_vmm(&state, &record);
                }
                Ok(state.remove(name)?)
            });
        match result {
            Ok(()) => println!("{name}"),
            Err(e) => {
                eprintln!("imp: removing {name}: {e:#}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} VMs could not be removed", args.vms.len());
    }
    Ok(())
}

fn block_on<F: std::future::Future>(f: F) -> anyhow::Result<F::Output> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(f))
}

/// `imp suspend VM`: the VM's shim pauses it, writes its snapshot and stops its VMM; prints
/// the name once the record says suspended.
pub fn suspend(args: SuspendArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let record = state.load(&args.vm)?;
    let started = std::time::Instant::now();
    let token = suspend::request_suspend(&state, &record)?;
    let done = block_on(suspend::wait_suspended(
        &state,
        &args.vm,
        &token,
        args.timeout,
    ))??;
    let bytes = done.suspend.as_ref().map_or(0, |s| s.bytes);
    eprintln!(
        "imp: {} suspended in {:.2}s (snapshot {:.0} MiB)",
        args.vm,
        started.elapsed().as_secs_f64(),
        bytes as f64 / f64::from(1u32 << 20)
    );
    println!("{}", args.vm);
    Ok(())
}

/// `imp resume VM`: a new shim restores the VM from its snapshot; prints the name once the
/// guest agent answers again.
pub fn resume(args: SuspendArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let record = state.load(&args.vm)?;
    let started = std::time::Instant::now();
    let cmd = shim::ShimCommand::current_exe().context("finding the imp binary for the shim")?;
    suspend::start_resume(&cmd, &state, &record, None)?;
    block_on(suspend::wait_resumed(&state, &args.vm, args.timeout))??;
    eprintln!(
        "imp: {} resumed in {:.2}s",
        args.vm,
        started.elapsed().as_secs_f64()
    );
    println!("{}", args.vm);
    Ok(())
}

/// `imp console VM`: the VM's serial console, followed until the VM ends or Ctrl-C.
pub fn console(args: ConsoleArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let record = state.load(&args.vm)?;
    let mut follower = console::Follower::new(&record.serial_log);
    let mut out = std::io::stdout().lock();
    loop {
        let alive = record.supervisor_alive();
        let lines = follower
            .poll()
            .with_context(|| format!("reading {}", record.serial_log.display()))?;
        for line in lines {
            use std::io::Write;
            out.write_all(line.as_bytes())
                .context("writing to stdout")?;
        }
        if follower.behind() {
            continue;
        }
        if args.no_follow || !alive {
            if let Some(rest) = follower.rest() {
                use std::io::Write;
                out.write_all(rest.as_bytes())
                    .context("writing to stdout")?;
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
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
