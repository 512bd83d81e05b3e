//! The runtime's few calls to a VM's guest agent: the health check that makes a VM Running and
//! the exit report the guest sends when its workload ends.
//!
//! The connection goes through the VMM's vsock socket with [`crate::vmm::vsock::connect`]
//! (async, never abandoning an unanswered `CONNECT`); the synchronous protocol client of
//! `imp-proto` then runs on a blocking thread, off the async runtime.

use std::path::{Path, PathBuf};
use std::time::Duration;

use imp_proto::message::{ExitStatus, HealthReport, Hello};
use tokio::sync::mpsc;

use crate::vmm;

/// Failures talking to the guest agent.
#[derive(Debug, thiserror::Error)]
pub enum GuestAgentError {
    /// The vsock connection could not be made.
    #[error("connecting to the guest agent")]
    Connect(#[source] vmm::vsock::Error),
    /// The connection could not be handed to a blocking client.
    #[error("preparing the guest agent connection")]
    Socket(#[source] std::io::Error),
    /// The protocol exchange failed.
    #[error("asking the guest agent for its health")]
    Protocol(#[source] imp_proto::ClientError),
    /// The blocking task died.
    #[error("the guest agent task failed")]
    Task(#[source] tokio::task::JoinError),
    /// Listening for the exit report failed.
    #[error("listening for the exit report on {}", path.display())]
    Listen {
        /// The host socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// How the host names itself in handshakes.
pub fn hello() -> Hello {
    Hello::new(concat!("imp/", env!("CARGO_PKG_VERSION")))
}

/// Waits until the guest agent on `port` answers a health request, for at most `timeout`.
pub async fn wait_healthy(
    vsock: &Path,
    port: u32,
    timeout: Duration,
) -> Result<HealthReport, GuestAgentError> {
    let stream = vmm::vsock::connect(vsock, port, timeout)
        .await
        .map_err(GuestAgentError::Connect)?;
    let std_stream = stream.into_std().map_err(GuestAgentError::Socket)?;
    std_stream
        .set_nonblocking(false)
        .and_then(|()| std_stream.set_read_timeout(Some(Duration::from_secs(30))))
        .map_err(GuestAgentError::Socket)?;
    tokio::task::spawn_blocking(move || {
        let mut client = imp_proto::Client::handshake(std_stream, &hello())?;
        client.health()
    })
    .await
    .map_err(GuestAgentError::Task)?
    .map_err(GuestAgentError::Protocol)
}

/// Listens where the guest's exit reports arrive (`<vsock>_<port>`) and hands each on.
pub fn listen_for_exit_reports(
    vsock: &Path,
    port: u32,
) -> Result<mpsc::Receiver<ExitStatus>, GuestAgentError> {
    let path = vmm::vsock::host_listener_path(vsock, port);
    let _ = std::fs::remove_file(&path);
    let listener =
        tokio::net::UnixListener::bind(&path).map_err(|source| GuestAgentError::Listen {
            path: path.clone(),
            source,
        })?;
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(mut std_stream) = stream.into_std() else {
                    return;
                };
                let read = tokio::task::spawn_blocking(move || {
                    std_stream.set_nonblocking(false)?;
                    std_stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                    imp_proto::report::receive_exit_report(&mut std_stream, &hello())
                        .map_err(std::io::Error::other)
                })
                .await;
                match read {
                    Ok(Ok(status)) => {
                        let _ = tx.send(status).await;
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "unreadable exit report"),
                    Err(e) => tracing::warn!(error = %e, "exit report task failed"),
                }
            });
        }
    });
    Ok(rx)
}
