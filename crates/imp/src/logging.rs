//! The log of the long-running components (`imp operator`, `imp agent`): one line per event on
//! stderr, which is what `kubectl logs` shows. Colours only on a terminal: escape codes in a
//! container's log break `grep` and log shippers.

use std::io::IsTerminal;

/// Starts logging at `RUST_LOG`'s filter (else `info`), as JSON lines when `json`.
pub fn init(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        fmt.json().init();
    } else {
        fmt.compact().init();
    }
}
