//! The imp guest binary: `imp-guest` as PID 1 in a VM, or `imp-guest --no-pid1 ...` for
//! development and tests.

use imp_guest::init::{self, Options};
use std::path::PathBuf;

const USAGE: &str = "usage: imp-guest [--no-pid1] [--config PATH] [--listen-unix PATH] \
                     [--report-unix PATH] [--root PATH]\n\
                     As PID 1 it prepares the VM, runs the workload from /.imp/config.json and \
                     powers off.\n\
                     --no-pid1 runs the same sequence as a plain process: no mounts, modules, \
                     network or power off.";

fn parse(args: &[String]) -> Result<Options, String> {
    let mut opts = Options {
        pid1: std::process::id() == 1,
        config: None,
        listen_unix: None,
        report_unix: None,
        root: PathBuf::from("/"),
    };
    let mut no_pid1 = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .map(PathBuf::from)
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--no-pid1" => no_pid1 = true,
            "--config" => opts.config = Some(value("--config")?),
            "--listen-unix" => opts.listen_unix = Some(value("--listen-unix")?),
            "--report-unix" => opts.report_unix = Some(value("--report-unix")?),
            "--root" => opts.root = value("--root")?,
            "--help" | "-h" => return Err(USAGE.to_string()),
            "--version" => return Err(concat!("imp-guest ", env!("CARGO_PKG_VERSION")).to_string()),
            // The kernel passes unknown command-line words to init as arguments: ignore them.
            other if opts.pid1 && !other.starts_with("--") => {}
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if no_pid1 {
        opts.pid1 = false;
    } else if !opts.pid1 {
        return Err(format!(
            "imp-guest is not PID 1; pass --no-pid1 to run it as a plain process\n{USAGE}"
        ));
    }
    Ok(opts)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args) {
        Ok(opts) if opts.pid1 => {
            // PID 1 must never exit (the kernel would panic): a panic still ends the VM cleanly.
            let code = std::panic::catch_unwind(|| init::run(&opts)).unwrap_or(255);
            init::panic_exit(code)
        }
        Ok(opts) => std::process::exit(init::run(&opts)),
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    }
}
