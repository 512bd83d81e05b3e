//! The host side of hybrid vsock: reaching a guest's vsock port through a Unix socket.
//!
//! Firecracker exposes a guest's vsock as one Unix socket on the host, and the QEMU driver's
//! guest-channel mux ([`super::qemu::mux`]) serves the same socket. To reach guest port P, the
//! host connects to it, sends `CONNECT P\n` and reads `OK <host-port>\n`; from then on the Unix
//! stream is the vsock stream. While nothing listens on P in the guest the VMM closes the
//! connection instead, so [`connect`] retries until a deadline. Guest-initiated connections to
//! the host (CID 2) port P arrive on the Unix socket at [`host_listener_path`], which the host
//! must listen on.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

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
    /// The path holds something other than a socket its directory's owner made there (a
    /// symlink a compromised VMM planted, say): nothing was connected to.
    #[error("Not connecting to the vsock socket {uds}: {reason}")]
    Refused {
        /// The VMM's vsock Unix socket.
        uds: PathBuf,
        /// What [`crate::uds`] found.
        reason: String,
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
///
/// An attempt whose `CONNECT` is still unanswered at the deadline is not closed: it is left to
/// finish in the background (see [`linger`]) and closed once the VMM answers, so a guest's late
/// accept meets a host side that is still there and then an ordinary close, never a stream that
/// vanished mid-handshake. A lingering attempt costs a task and a socket.
pub async fn connect(uds: &Path, port: u32, timeout: Duration) -> Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let last = match attempt(uds, port, deadline).await {
            Ok(stream) => {
                tracing::debug!(uds = %uds.display(), port, attempts, "vsock connected");
                return Ok(stream);
            }
            Err(Attempt::Fatal(reply)) => {
                return Err(Error::Protocol {
                    uds: uds.to_owned(),
                    port,
                    reply,
                });
            }
            Err(Attempt::Refused(reason)) => {
                tracing::warn!(uds = %uds.display(), port, reason, "vsock socket refused");
                return Err(Error::Refused {
                    uds: uds.to_owned(),
                    reason,
                });
            }
            Err(Attempt::Retry(why)) => why,
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

/// How long an abandoned `CONNECT` is kept open waiting for the VMM's answer.
const LINGER: Duration = Duration::from_secs(600);

/// Outcome of one failed attempt.
enum Attempt {
    /// Worth another try (socket missing, refused, closed before `OK`, no answer yet).
    Retry(String),
    /// The VMM spoke something we do not understand.
    Fatal(String),
    /// The socket is not one the VMM (or root) made in its directory ([`crate::uds`]).
    Refused(String),
}

/// One connect + handshake, answered by `deadline` or handed to [`linger`].
async fn attempt(
    uds: &Path,
    port: u32,
    deadline: Instant,
) -> std::result::Result<UnixStream, Attempt> {
    let io_err = |what: &str, e: io::Error| Attempt::Retry(format!("{what}: {e}"));
    let late = || Attempt::Retry("attempt still waiting at the deadline".to_owned());
    let deadline = tokio::time::Instant::from_std(deadline);
    // Only a socket its directory's owner made there: never a symlink a VMM planted.
    let mut stream = tokio::time::timeout_at(deadline, crate::uds::connect(uds))
        .await
        .map_err(|_| late())?
        .map_err(|e| {
            if crate::uds::is_refused(&e) {
                Attempt::Refused(e.to_string())
            } else {
                io_err("connect", e)
            }
        })?;
    // Nothing is pending in the VMM until the whole line is sent: a timeout here may close.
    tokio::time::timeout_at(
        deadline,
        stream.write_all(imp_proto::connect::request(port).as_bytes()),
    )
    .await
    .map_err(|_| late())?
    .map_err(|e| io_err("send CONNECT", e))?;
    match tokio::time::timeout_at(deadline, read_reply(&mut stream)).await {
        Ok(Ok(())) => Ok(stream),
        Ok(Err(e)) => Err(e),
        Err(_) => {
            linger(stream, uds, port);
            Err(late())
        }
    }
}

/// Keeps an unanswered `CONNECT` open until the VMM answers it (then closes it cleanly), for
/// at most [`LINGER`], so the guest's late answer is taken and its stream ended in order.
fn linger(mut stream: UnixStream, uds: &Path, port: u32) {
    let uds = uds.to_owned();
    tokio::spawn(async move {
        let answered = tokio::time::timeout(LINGER, read_reply(&mut stream)).await;
        tracing::debug!(uds = %uds.display(), port, answered = answered.is_ok(),
            "abandoned vsock attempt closed");
    });
}

/// Reads the VMM's `OK <port>` line, byte by byte: whatever follows the newline already
/// belongs to the guest's stream.
async fn read_reply(stream: &mut UnixStream) -> std::result::Result<(), Attempt> {
    let mut line = Vec::with_capacity(16);
    loop {
        let mut byte = [0u8; 1];
        let n = stream
            .read(&mut byte)
            .await
            .map_err(|e| Attempt::Retry(format!("read reply: {e}")))?;
        if n == 0 {
            return Err(Attempt::Retry(
                "closed before OK (guest not listening)".to_owned(),
            ));
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > imp_proto::connect::MAX_REPLY {
            return Err(Attempt::Fatal(String::from_utf8_lossy(&line).into_owned()));
        }
    }
    imp_proto::connect::reply(&line)
        .map(drop)
        .map_err(Attempt::Fatal)
}

/// A guest connection for imp-proto's blocking client whose every read and write ends by one
/// deadline: the guest is untrusted, and a per-read timeout alone lets a guest that sends a
/// byte now and then (a slow loris) hold the exchange, and the thread running it, forever.
#[derive(Debug)]
pub struct DeadlineStream {
    stream: std::os::unix::net::UnixStream,
    deadline: Instant,
    budget: Duration,
}

impl DeadlineStream {
    /// Makes `stream` blocking, with `budget` for everything that is read and written on it.
    pub fn new(stream: UnixStream, budget: Duration) -> io::Result<Self> {
        let stream = stream.into_std()?;
        stream.set_nonblocking(false)?;
        Ok(Self {
            stream,
            deadline: Instant::now() + budget,
            budget,
        })
    }

    /// The time left, as a socket timeout; an error once the deadline has passed.
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out());
        }
        Ok(left)
    }

    fn timed_out(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the guest did not finish the exchange within {} ms",
                self.budget.as_millis()
            ),
        )
    }

    /// A socket timeout reads as `WouldBlock`: say what it means.
    fn check<T>(&self, r: io::Result<T>) -> io::Result<T> {
        match r {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(self.timed_out())
            }
            other => other,
        }
    }
}

impl io::Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let r = self.stream.read(buf);
        self.check(r)
    }
}

impl io::Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let r = self.stream.write(buf);
        self.check(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
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

    use crate::scratch::Scratch;

    #[tokio::test]
    async fn retries_until_ok_then_streams() {
        let dir = Scratch::new("vsock", "ok");
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

    /// An answer that comes after the caller gave up still finds the host side open, and the
    /// abandoned stream is closed after it.
    #[tokio::test]
    async fn a_late_answer_finds_the_abandoned_attempt_open() {
        let dir = Scratch::new("vsock", "late");
        let uds = dir.0.join("v.sock");
        let listener = UnixListener::bind(&uds).unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            reader.read_line(&mut line).await.unwrap();
            assert_eq!(line, "CONNECT 52\n");
            tokio::time::sleep(Duration::from_millis(400)).await;
            let mut stream = reader.into_inner();
            let answered = stream.write_all(b"OK 7\n").await;
            let mut rest = Vec::new();
            let closed =
                tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
            (answered.map_err(|e| e.kind()), closed.is_ok())
        });
        let err = connect(&uds, 52, Duration::from_millis(150))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let (answered, closed) = server.await.unwrap();
        assert_eq!(
            answered,
            Ok(()),
            "the abandoned attempt was closed before the answer"
        );
        assert!(
            closed,
            "the abandoned attempt was never closed after its answer"
        );
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
        let dir = Scratch::new("vsock", "bad");
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

    /// A VMM that replaced its vsock socket with a symlink to another VM's socket (which would
    /// answer) gets no connection made to that socket: the caller (root) is refused at once,
    /// by name, not retried until its deadline.
    #[tokio::test]
    async fn a_symlink_in_place_of_the_vmms_socket_is_refused_at_once() {
        let dir = Scratch::new("vsock", "symlink");
        let other = dir.0.join("other-vm.sock");
        let listener = UnixListener::bind(&other).unwrap();
        let uds = dir.0.join("v.sock");
        std::os::unix::fs::symlink(&other, &uds).unwrap();
        let started = Instant::now();
        let err = connect(&uds, 52, Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(err, Error::Refused { .. }), "{err}");
        assert!(err.to_string().contains("a symlink"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(1));
        let accepted = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        assert!(accepted.is_err(), "the other VM's socket was connected to");
    }

    #[test]
    fn listener_path_appends_port() {
        assert_eq!(
            host_listener_path(Path::new("/run/vm/v.sock"), 1024),
            PathBuf::from("/run/vm/v.sock_1024")
        );
    }
}
