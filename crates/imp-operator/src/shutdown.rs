//! The operator's stop flag: the binary raises it on SIGTERM or Ctrl-C, and the operator itself
//! when its admission webhook fails; every server and controller stops when it is raised.

use tokio::sync::watch;

/// Completes once `flag` is raised (or its sender is gone).
pub async fn raised(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|s| *s).await;
}
