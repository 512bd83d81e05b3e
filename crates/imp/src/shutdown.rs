//! The long-running commands' stop flag: SIGTERM or Ctrl-C raise it, and so may the command
//! itself (the operator, when it loses its lease).

use tokio::sync::watch;

/// A stop flag raised by SIGTERM or Ctrl-C (logging `message` then), and its first receiver.
/// Needs a running tokio runtime.
pub fn on_signals(message: &'static str) -> (watch::Sender<bool>, watch::Receiver<bool>) {
    let (tx, rx) = watch::channel(false);
    let signal_tx = tx.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %imp_api::chain::DisplayChain(&e), "cannot listen for SIGTERM");
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("{message}");
        let _ = signal_tx.send(true);
    });
    (tx, rx)
}
