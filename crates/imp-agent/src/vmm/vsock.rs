//! The host side of hybrid vsock: reaching a guest's vsock port through a Unix socket.
//!
//! Firecracker and vhost-device-vsock both expose a guest's vsock as one Unix socket on the
//! host. To reach guest port P, the host connects to it, sends `CONNECT P\n` and reads
//! `OK <host-port>\n`; from then on the Unix stream is the vsock stream. While nothing listens
//! on P in the guest the VMM closes the connection instead, so [`connect`] retries until a
//! deadline. Guest-initiated connections to the host (CID 2) port P arrive on the Unix socket
//! at [`host_listener_path`], which the host must listen on.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Longest reply line we accept (`OK 4294967295\n` is 14 bytes).
const MAX_REPLY: usize = 32;
/// First pause between attempts; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause between attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// Why a vsock connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The guest did not accept in time; `last` says what the last attempt saw.
    #[error("Guest vsock port {port} via {uds} did not accept within {timeout:?} (last: {last})")]
    Timeout {
        /// The VMM's vsock Unix socket.
        uds: PathBuf,
        /// The guest port.
        port: u32,
        /// How long we tried.
        timeout: Duration,
        /// What the last attempt saw.
        last: String,
    },
    /// The VMM answered something other than `OK <port>`.
    #[error("Unexpected reply {reply:?} to CONNECT {port} on {uds}")]
    Protocol {
        /// The VMM's vsock Unix socket.
        uds: PathBuf,
        /// The guest port.
        port: u32,
        /// The reply line as received.
        reply: String,
    },
}

/// Result of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The Unix socket on which the host must listen to accept guest connections to host port `port`.
pub fn host_listener_path(uds: &Path, port: u32) -> PathBuf {
    let mut name = uds.as_os_str().to_owned();
    name.push(format!("_{port}"));
    PathBuf::from(name)
}

/// Connects to guest vsock `port` through the VMM's vsock Unix socket `uds`, retrying while the
/// guest does not listen, for at most `timeout`.
pub async fn connect(uds: &Path, port: u32, timeout: Duration) -> Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let last = match tokio::time::timeout(remaining, attempt(uds, port)).await {
            Ok(Ok(stream)) => {
                tracing::debug!(uds = %uds.display(), port, attempts, "vsock connected");
                return Ok(stream);
            }
            Ok(Err(Attempt::Fatal(reply))) => {
                return Err(Error::Protocol {
                    uds: uds.to_owned(),
                    port,
                    reply,
                });
            }
            Ok(Err(Attempt::Retry(why))) => why,
            Err(_) => "attempt still waiting at the deadline".to_owned(),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                uds: uds.to_owned(),
                port,
                timeout,
                last,
            });
        }
        tracing::trace!(uds = %uds.display(), port, attempts, last, "vsock not ready, retrying");
        tokio::time::sleep(backoff.min(deadline - now)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Outcome of one failed attempt.
enum Attempt {
    /// Worth another try (socket missing, refused, closed before `OK`).
    Retry(String),
    /// The VMM spoke something we do not understand.
    Fatal(String),
}

/// One connect + handshake.
async fn attempt(uds: &Path, port: u32) -> std::result::Result<UnixStream, Attempt> {
    let io_err = |what: &str, e: io::Error| Attempt::Retry(format!("{what}: {e}"));
    let mut stream = UnixStream::connect(uds)
        .await
        .map_err(|e| io_err("connect", e))?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(|e| io_err("send CONNECT", e))?;
    // Read byte by byte: whatever follows the newline already belongs to the guest's stream.
    let mut line = Vec::with_capacity(16);
    loop {
        let mut byte = [0u8; 1];
        let n = stream
            .read(&mut byte)
            .await
            .map_err(|e| io_err("read reply", e))?;
        if n == 0 {
            return Err(Attempt::Retry(
                "closed before OK (guest not listening)".to_owned(),
            ));
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > MAX_REPLY {
            return Err(Attempt::Fatal(String::from_utf8_lossy(&line).into_owned()));
        }
    }
    let reply = String::from_utf8_lossy(&line).into_owned();
    match reply.strip_prefix("OK ") {
        Some(n) if n.trim().parse::<u32>().is_ok() => Ok(stream),
        _ => Err(Attempt::Fatal(reply)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::net::UnixListener;

    /// A fake VMM socket: refuses (closes) the first `refusals` connections, then says OK and
    /// echoes one line.
    async fn fake_vmm(listener: UnixListener, refusals: usize, reply: &'static str) {
        for i in 0.. {
            let (stream, _) = listener.accept().await.unwrap();
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            reader.read_line(&mut line).await.unwrap();
            assert_eq!(line, "CONNECT 52\n");
            if i < refusals {
                continue; // dropped: closed before OK
            }
            let mut stream = reader.into_inner();
            stream.write_all(reply.as_bytes()).await.unwrap();
            let mut buf = [0u8; 5];
            if stream.read_exact(&mut buf).await.is_ok() {
                stream.write_all(&buf).await.unwrap();
            }
            return;
        }
    }

    /// A fresh socket path in a directory of its own; the directory goes with the guard.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("imp-vsock-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[tokio::test]
    async fn retries_until_ok_then_streams() {
        let dir = Scratch::new("ok");
        let uds = dir.0.join("v.sock");
        let listener = UnixListener::bind(&uds).unwrap();
        // "OK 1073741824\nhello" arrives in one write: the tail must stay in the stream.
        let server = tokio::spawn(fake_vmm(listener, 3, "OK 1073741824\n"));
        let mut s = connect(&uds, 52, Duration::from_secs(5)).await.unwrap();
        s.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn gives_up_at_the_deadline() {
        let uds = PathBuf::from("/nonexistent/imp/v.sock");
        let started = Instant::now();
        let err = connect(&uds, 52, Duration::from_millis(150))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { port: 52, .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn rejects_garbage_reply() {
        let dir = Scratch::new("bad");
        let uds = dir.0.join("v.sock");
        let listener = UnixListener::bind(&uds).unwrap();
        let server = tokio::spawn(fake_vmm(listener, 0, "NOPE\n"));
        let err = connect(&uds, 52, Duration::from_secs(5)).await.unwrap_err();
        assert!(
            matches!(err, Error::Protocol { ref reply, .. } if reply == "NOPE"),
            "{err}"
        );
        server.abort();
    }

    #[test]
    fn listener_path_appends_port() {
        assert_eq!(
            host_listener_path(Path::new("/run/vm/v.sock"), 1024),
            PathBuf::from("/run/vm/v.sock_1024")
        );
    }
}
