//! Local VMs, no cluster: `imp run IMAGE` boots one microVM on this machine, and
//! `imp exec|ps|stop|rm|console` act on the VMs it started.
//!
//! The process that runs `imp run` is the VM's supervisor: it owns the VMM process, follows the
//! serial console, receives the workload's exit report and writes the VM's record
//! ([`state`]). `imp run -d` starts the same supervisor detached in its own process group and
//! returns once the guest agent answers. The other commands find a VM through its record.

mod console;
pub(crate) mod exec;
pub mod run;
mod state;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;

pub use run::RunArgs;
use state::{StateDir, VmStatus};

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

/// `imp ps`.
#[derive(Args, Debug)]
pub struct PsArgs {
    /// Also list VMs that have ended.
    #[arg(short, long)]
    pub all: bool,
    #[command(flatten)]
    common: Common,
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
        if !args.all && !matches!(status, VmStatus::Starting | VmStatus::Running) {
            continue;
        }
        let exit = r.exit_code.map(|c| c.to_string()).unwrap_or_default();
        println!(
            "{:<20} {:<9} {:<5} {:<12} {:>8}  {}",
            r.name,
            format!("{status:?}").to_lowercase(),
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

fn age(secs: u64) -> String {
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
    let record = state.load(name)?;
    if !record.supervisor_alive() {
        kill_orphaned_vmm(state, &record);
        return Ok(());
    }
    // The supervisor turns SIGTERM into a graceful guest shutdown with a grace period it reads
    // from the record's sibling file, then kills the VMM if the guest does not power off.
    let grace_file = state.vm_dir(name).join("stop-grace-ms");
    std::fs::write(&grace_file, grace.as_millis().to_string())
        .with_context(|| format!("writing {}", grace_file.display()))?;
    let pid = i32::try_from(record.supervisor_pid).context("supervisor pid out of range")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .with_context(|| format!("signalling the supervisor (pid {pid})"))?;
    let deadline = std::time::Instant::now() + grace + Duration::from_secs(15);
    while record.supervisor_alive() {
        if std::time::Instant::now() > deadline {
            bail!("the supervisor (pid {pid}) did not finish within {grace:?} + 15s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Kills a VMM whose supervisor died without stopping it (e.g. `kill -9`), and its helper
/// processes (vhost-device-vsock), so nothing of the VM is left running unseen. A pid is only
/// trusted if its command line names the VM's directory.
fn kill_orphaned_vmm(state: &StateDir, record: &state::VmRecord) {
    let dir = state.vm_dir(&record.name);
    let vmm = record.vmm_pid.map(|pid| (pid, "VMM"));
    let helpers = record.helper_pids.iter().map(|&pid| (pid, "helper"));
    for (pid, what) in vmm.into_iter().chain(helpers) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let ours = String::from_utf8_lossy(&cmdline).contains(&*dir.to_string_lossy());
        if ours && let Ok(raw) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(raw),
                nix::sys::signal::Signal::SIGKILL,
            );
            eprintln!(
                "imp: {}: its supervisor had died; killed the orphaned {what} (pid {pid})",
                record.name
            );
        }
    }
}

/// `imp rm VM…`: deletes ended VMs (or, with `--force`, stops them first).
pub fn rm(args: RmArgs) -> anyhow::Result<()> {
    let state = StateDir::resolve(args.common.state_dir)?;
    let mut failed = 0;
    for name in &args.vms {
        let result = state.load(name).and_then(|record| {
            if record.supervisor_alive() {
                if !args.force {
                    bail!("it is still running: `imp stop {name}` first, or use --force");
                }
                stop_one(&state, name, Duration::from_secs(5))?;
            } else {
                kill_orphaned_vmm(&state, &record);
            }
            state.remove(name)
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
