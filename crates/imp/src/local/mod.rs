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

use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;

use imp_agent::runtime::console;
use imp_agent::runtime::control;
use imp_agent::runtime::control::suspend;
use imp_agent::runtime::state::{self, StateDir, VmStatus};
pub use run::RunArgs;

use crate::args::{
    Common, ConsoleArgs, ExecArgs, PsArgs, SuspendArgs, age, parse_duration, parse_env,
};

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
        record.exit_code = Some(imp_agent::runtime::contract::STOPPED_EXIT_CODE);
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
        .block_on(control::stop(state, &record, grace))?;
    Ok(())
}

/// Kills a VMM whose shim died without stopping it, and says so.
fn kill_orphaned_vmm(state: &StateDir, record: &state::VmRecord) {
    for (pid, what) in control::kill_orphans(state, record) {
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
    let done = block_on(async {
        let token = suspend::request_suspend(&state, &record).await?;
        suspend::wait_suspended(&state, &args.vm, &token, args.timeout).await
    })??;
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
    let cmd = control::ShimCommand::current_exe().context("finding the imp binary for the shim")?;
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
