//! The runtime's few calls to a VM's guest agent: the health check that makes a VM Running,
//! setting the guest's clock after a restore, giving a clone restored from a shared snapshot
//! its own identity, asking for its CPU, memory and disk figures, and the exit report the
//! guest sends when its workload ends.
//!
//! The connection goes through the VMM's vsock socket with [`imp_vmm::vsock::connect`]
//! (async, never abandoning an unanswered `CONNECT`); the synchronous protocol client of
//! `imp-proto` then runs on a blocking thread, off the async runtime.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use imp_proto::message::{
    Entropy, ExitStatus, HealthReport, Hello, Identity, MIN_ENTROPY_BYTES, MetricsReport,
    ReidentifyReport,
};
use tokio::sync::{Semaphore, mpsc};

/// Failures talking to the guest agent.
#[derive(Debug, thiserror::Error)]
pub enum GuestAgentError {
    /// The vsock connection could not be made.
    #[error("connecting to the guest agent")]
    Connect(#[source] imp_vmm::vsock::Error),
    /// The connection could not be handed to a blocking client.
    #[error("preparing the guest agent connection")]
    Socket(#[source] std::io::Error),
    /// The protocol exchange failed.
    #[error("asking the guest agent for its health")]
    Protocol(#[source] imp_proto::ClientError),
    /// The guest did not report its figures.
    #[error("asking the guest agent for its metrics")]
    Metrics(#[source] imp_proto::ClientError),
    /// The guest did not set its clock.
    #[error("setting the guest's clock")]
    SetClock(#[source] imp_proto::ClientError),
    /// The guest did not take its new identity (an older guest says so: `Unsupported`).
    #[error("giving the guest its own identity")]
    Reidentify(#[source] imp_proto::ClientError),
    /// A probe could not be run in the guest (connecting, or the exchange).
    #[error("running a probe in the guest")]
    Probe(#[source] imp_proto::ClientError),
    /// The host's randomness for the guest could not be read.
    #[error("reading {MIN_ENTROPY_BYTES} bytes of randomness for the guest from /dev/urandom")]
    Entropy(#[source] std::io::Error),
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

/// Waits until the guest agent on `port` answers a health request, for at most `timeout` in
/// all: connecting, the handshake and the answer (a guest that trickles bytes cannot stretch it).
pub async fn wait_healthy(
    vsock: &Path,
    port: u32,
    timeout: Duration,
) -> Result<HealthReport, GuestAgentError> {
    exchange(vsock, port, timeout, |client| client.health())
        .await?
        .map_err(GuestAgentError::Protocol)
}

/// Asks the guest agent on `port` for its CPU, memory and disk figures, for at most `timeout`
/// in all (the guest samples its CPU counters over a tenth of a second before it answers).
pub async fn metrics(
    vsock: &Path,
    port: u32,
    timeout: Duration,
) -> Result<MetricsReport, GuestAgentError> {
    exchange(vsock, port, timeout, |client| client.metrics())
        .await?
        .map_err(GuestAgentError::Metrics)
}

/// Sets the guest's wall clock to `now` through the guest agent on `port`, for at most
/// `timeout` in all. A restored guest's clock is as old as its snapshot: call this after
/// resuming it.
pub async fn set_clock(
    vsock: &Path,
    port: u32,
    now: std::time::SystemTime,
    timeout: Duration,
) -> Result<(), GuestAgentError> {
    exchange(vsock, port, timeout, move |client| client.set_clock(now))
        .await?
        .map_err(GuestAgentError::SetClock)
}

/// Makes a guest restored from a snapshot that other VMs share a machine of its own, through
/// the guest agent on `port`, for at most `timeout` in all: [`MIN_ENTROPY_BYTES`] fresh bytes
/// of the host's randomness for its entropy pool (the CRNG reseeded at once), its clock set to
/// now, `identity`'s hostname, MAC and network, and the TCP connections it carried over from
/// the source destroyed. Call it after resuming each clone, before its network is joined to
/// the others' (until then it sends as the source).
///
/// The report says what each step did; a step that failed is there, not an error: the caller
/// decides (a failed `entropy` step means the clone's random numbers may repeat its source's).
/// A guest too old for the request fails with `Reidentify(ClientError::Unsupported)` and
/// nothing sent.
pub async fn reidentify(
    vsock: &Path,
    port: u32,
    identity: &Identity,
    timeout: Duration,
) -> Result<ReidentifyReport, GuestAgentError> {
    let started = tokio::time::Instant::now();
    let entropy = tokio::task::spawn_blocking(host_entropy)
        .await
        .map_err(GuestAgentError::Task)?
        .map_err(GuestAgentError::Entropy)?;
    let identity = identity.clone();
    let left = timeout.saturating_sub(started.elapsed());
    exchange(vsock, port, left, move |client| {
        // The time is read as late as possible: the guest sets its clock to it.
        client.reidentify(&identity, entropy, std::time::SystemTime::now())
    })
    .await?
    .map_err(GuestAgentError::Reidentify)
}

/// Has the guest GET `request` from its own loopback (an HTTP probe) through the guest agent
/// on `port`, for at most `timeout` in all.
pub async fn http_get(
    vsock: &Path,
    port: u32,
    request: imp_proto::HttpGetRequest,
    timeout: Duration,
) -> Result<imp_proto::HttpGetResult, GuestAgentError> {
    exchange(vsock, port, timeout, move |client| {
        client.http_get(&request)
    })
    .await?
    .map_err(GuestAgentError::Probe)
}

/// The most of an exec probe's output kept (its last bytes), for the Event that names it.
pub const PROBE_OUTPUT_MAX: usize = 512;

/// Runs `argv` in the guest (as its workload's user) through the guest agent on `port` and
/// waits for it to exit, for at most `timeout` in all; returns how it ended and the last
/// [`PROBE_OUTPUT_MAX`] bytes of its stdout and stderr together.
pub async fn exec_probe(
    vsock: &Path,
    port: u32,
    argv: Vec<String>,
    timeout: Duration,
) -> Result<(imp_proto::ExitStatus, String), GuestAgentError> {
    let request = imp_proto::ExecRequest {
        argv,
        ..imp_proto::ExecRequest::default()
    };
    let started = tokio::time::Instant::now();
    let stream = imp_vmm::vsock::connect(vsock, port, timeout)
        .await
        .map_err(GuestAgentError::Connect)?;
    let left = timeout.saturating_sub(started.elapsed());
    let stream =
        imp_vmm::vsock::DeadlineStream::new(stream, left).map_err(GuestAgentError::Socket)?;
    tokio::task::spawn_blocking(move || {
        let client = imp_proto::Client::handshake(stream, &hello())?;
        let mut session = client.exec(&request)?;
        let mut output: Vec<u8> = Vec::new();
        loop {
            match session.next_event()? {
                imp_proto::ExecEvent::Stdout(b) | imp_proto::ExecEvent::Stderr(b) => {
                    output.extend_from_slice(&b);
                    let over = output.len().saturating_sub(PROBE_OUTPUT_MAX);
                    output.drain(..over);
                }
                imp_proto::ExecEvent::Exit(status) => {
                    let text = String::from_utf8_lossy(&output);
                    return Ok((status, imp_proto::message::escape(text.trim())));
                }
            }
        }
    })
    .await
    .map_err(GuestAgentError::Task)?
    .map_err(GuestAgentError::Probe)
}

/// [`MIN_ENTROPY_BYTES`] from the host's generator (`/dev/urandom` never blocks once the
/// kernel's generator is seeded, which a host running VMs long is).
fn host_entropy() -> std::io::Result<Entropy> {
    use std::io::Read;
    let mut bytes = vec![0u8; MIN_ENTROPY_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(Entropy(bytes))
}

/// Connects to the guest agent on `port`, shakes hands and runs `ask` on a blocking thread,
/// all within `timeout` (a guest that trickles bytes cannot stretch it). The outer error is
/// the connection's; the inner one the exchange's, for the caller to name.
async fn exchange<T: Send + 'static>(
    vsock: &Path,
    port: u32,
    timeout: Duration,
    ask: impl FnOnce(
        &mut imp_proto::Client<imp_vmm::vsock::DeadlineStream>,
    ) -> imp_proto::client::Result<T>
    + Send
    + 'static,
) -> Result<imp_proto::client::Result<T>, GuestAgentError> {
    let started = tokio::time::Instant::now();
    let stream = imp_vmm::vsock::connect(vsock, port, timeout)
        .await
        .map_err(GuestAgentError::Connect)?;
    let left = timeout.saturating_sub(started.elapsed());
    let stream =
        imp_vmm::vsock::DeadlineStream::new(stream, left).map_err(GuestAgentError::Socket)?;
    tokio::task::spawn_blocking(move || {
        let mut client = imp_proto::Client::handshake(stream, &hello())?;
        // The guest names its own software: escaped, bounded, never logged raw.
        let peer = client.peer();
        tracing::debug!(guest = %peer.software_escaped(), protocol = %peer.version, "guest agent said hello");
        ask(&mut client)
    })
    .await
    .map_err(GuestAgentError::Task)
}

/// How long one exit report connection may take from accept to acknowledgement.
pub const EXIT_REPORT_DEADLINE: Duration = Duration::from_secs(10);

/// How many exit report connections are read at once; more wait in the listen backlog, so a
/// guest that opens connections and says nothing ties up this many threads, not one each.
pub const EXIT_REPORT_READERS: usize = 2;

/// Listens where the guest's exit reports arrive (`<vsock>_<port>`) and hands each on.
///
/// The guest is untrusted: each connection gets [`EXIT_REPORT_DEADLINE`] in all, at most
/// [`EXIT_REPORT_READERS`] are read at once, and reports nobody collects are dropped rather
/// than queued.
pub fn listen_for_exit_reports(
    vsock: &Path,
    port: u32,
) -> Result<mpsc::Receiver<ExitStatus>, GuestAgentError> {
    listen_with(vsock, port, EXIT_REPORT_DEADLINE, EXIT_REPORT_READERS)
}

fn listen_with(
    vsock: &Path,
    port: u32,
    deadline: Duration,
    readers: usize,
) -> Result<mpsc::Receiver<ExitStatus>, GuestAgentError> {
    let path = imp_vmm::vsock::host_listener_path(vsock, port);
    let _ = std::fs::remove_file(&path);
    let listener =
        tokio::net::UnixListener::bind(&path).map_err(|source| GuestAgentError::Listen {
            path: path.clone(),
            source,
        })?;
    let (tx, rx) = mpsc::channel(4);
    let readers = Arc::new(Semaphore::new(readers));
    tokio::spawn(async move {
        loop {
            // A reader slot first, then the next connection: the rest wait in the backlog.
            let Ok(permit) = Arc::clone(&readers).acquire_owned().await else {
                return;
            };
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let read = match imp_vmm::vsock::DeadlineStream::new(stream, deadline) {
                    Ok(mut stream) => tokio::task::spawn_blocking(move || {
                        imp_proto::report::receive_exit_report(&mut stream, &hello())
                    })
                    .await
                    .map_err(|e| e.to_string()),
                    Err(e) => Err(format!("preparing the connection: {e}")),
                };
                match read {
                    Ok(Ok(status)) => {
                        if tx.try_send(status).is_err() {
                            tracing::warn!(%status, "exit report dropped: earlier ones are still unread");
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "unreadable exit report")
                    }
                    Err(e) => tracing::warn!(error = %e, "exit report task failed"),
                }
            });
        }
    });
    Ok(rx)
}

/// A hostile guest behind a fake VMM vsock socket: what it sends must end in a reported error
/// within the deadline, with no allocation beyond the frame limit and no thread held.
#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use imp_proto::frame::{FrameError, encode};
    use imp_proto::message::Message;
    use std::time::Instant;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    use tokio::net::{UnixListener, UnixStream};

    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("imp-hostile-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
        fn vsock(&self) -> PathBuf {
            self.0.join("v.sock")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A fake VMM: answers one `CONNECT` with `OK`, then hands the stream to the hostile guest.
    fn fake_guest<F, Fut>(vsock: &Path, guest: F) -> tokio::task::JoinHandle<()>
    where
        F: FnOnce(UnixStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = UnixListener::bind(vsock).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            reader.read_line(&mut line).await.unwrap();
            assert!(line.starts_with("CONNECT "), "{line:?}");
            let mut stream = reader.into_inner();
            stream.write_all(b"OK 1073741824\n").await.unwrap();
            guest(stream).await;
        })
    }

    fn chain(e: &dyn std::error::Error) -> String {
        imp_api::chain::DisplayChain(e).to_string()
    }

    fn guest_hello() -> Vec<u8> {
        encode(&Message::Hello(Hello::new("hostile-guest"))).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_loris_guest_cannot_stretch_the_health_check_past_its_timeout() {
        let dir = Scratch::new("loris");
        // A byte every 50 ms: each read is quick, the whole hello would take seconds.
        let guest = fake_guest(&dir.vsock(), |mut s| async move {
            for b in guest_hello() {
                if s.write_all(&[b]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let t = Instant::now();
        let err = wait_healthy(&dir.vsock(), 52, Duration::from_millis(800))
            .await
            .unwrap_err();
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "took {:?}",
            t.elapsed()
        );
        let text = chain(&err);
        assert!(
            text.contains("did not finish the exchange within"),
            "{text}"
        );
        guest.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frame_announcing_4_gib_is_refused_before_its_body_is_read() {
        let dir = Scratch::new("huge");
        let (sent_tx, sent_rx) = tokio::sync::oneshot::channel();
        let guest = fake_guest(&dir.vsock(), |mut s| async move {
            s.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
            // Then an endless body: the host must not read (or allocate for) it.
            let chunk = vec![0u8; 64 * 1024];
            let mut sent = 0usize;
            while let Ok(Ok(())) =
                tokio::time::timeout(Duration::from_millis(300), s.write_all(&chunk)).await
            {
                sent += chunk.len();
                if sent >= 64 << 20 {
                    break;
                }
            }
            let _ = sent_tx.send(sent);
        });
        let err = wait_healthy(&dir.vsock(), 52, Duration::from_secs(5))
            .await
            .unwrap_err();
        let GuestAgentError::Protocol(imp_proto::ClientError::Handshake(
            imp_proto::HandshakeError::Frame(FrameError::TooLarge { len, .. }),
        )) = &err
        else {
            panic!("expected a too-large frame, got {}", chain(&err));
        };
        assert_eq!(*len, u64::from(u32::MAX));
        assert!(chain(&err).contains("exceeds the limit"), "{}", chain(&err));
        // The guest could push only what the socket buffers hold, never the announced 4 GiB.
        let sent = sent_rx.await.unwrap();
        assert!(sent < 16 << 20, "the host read {sent} bytes of the body");
        guest.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_and_malformed_messages_are_reported_errors() {
        let cases: [(&str, Vec<u8>, &str); 4] = [
            (
                "http",
                b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
                "exceeds the limit",
            ),
            ("empty", vec![0, 0, 0, 0], "Empty frame"),
            ("kind", vec![0, 0, 0, 2, 9, 9], "Unknown frame kind 9"),
            (
                "json",
                [&[0u8, 0, 0, 5, 0][..], b"{\"ty"].concat(),
                "Invalid control message",
            ),
        ];
        for (tag, garbage, want) in cases {
            let dir = Scratch::new(tag);
            let guest = fake_guest(&dir.vsock(), move |mut s| async move {
                let _ = s.write_all(&garbage).await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            });
            let err = wait_healthy(&dir.vsock(), 52, Duration::from_secs(5))
                .await
                .unwrap_err();
            let text = chain(&err);
            assert!(text.contains(want), "{tag}: {text}");
            assert!(
                text.starts_with("asking the guest agent for its health"),
                "{text}"
            );
            guest.abort();
        }
        // A guest that answers health with something else, or too large a message.
        let dir = Scratch::new("wrong");
        let guest = fake_guest(&dir.vsock(), |mut s| async move {
            s.write_all(&guest_hello()).await.unwrap();
            s.write_all(&encode(&Message::Ack).unwrap()).await.unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        });
        let err = wait_healthy(&dir.vsock(), 52, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(chain(&err).contains("got a ack message"), "{}", chain(&err));
        guest.abort();
    }

    /// A guest behind a fake VMM that says hello with `version` and answers one request with
    /// `answer` (none: reads until the host hangs up); returns what it received.
    fn scripted_guest(
        vsock: &Path,
        version: imp_proto::message::Version,
        answer: Option<Message>,
    ) -> tokio::task::JoinHandle<Vec<Message>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let guest = fake_guest(vsock, move |s| async move {
            let s = s.into_std().unwrap();
            s.set_nonblocking(false).unwrap();
            let seen = tokio::task::spawn_blocking(move || {
                let mut s = s;
                let hello = Hello {
                    version,
                    software: "imp-guest test".into(),
                };
                imp_proto::handshake(&mut s, &hello).unwrap();
                let mut seen = Vec::new();
                while let Ok(Some(m)) = imp_proto::read_frame(&mut s) {
                    seen.push(m);
                    if let Some(a) = &answer {
                        imp_proto::write_frame(&mut s, a).unwrap();
                    }
                }
                seen
            })
            .await
            .unwrap();
            let _ = tx.send(seen);
        });
        tokio::spawn(async move {
            let seen = rx.await.unwrap();
            guest.abort();
            seen
        })
    }

    fn identity() -> Identity {
        Identity {
            hostname: Some("clone-1".into()),
            mac: None,
            network: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reidentify_sends_fresh_entropy_and_the_time_and_returns_the_guests_report() {
        use imp_proto::message::{Step, StepStatus};
        let report = ReidentifyReport {
            steps: vec![Step {
                name: "entropy".into(),
                status: StepStatus::Done,
                detail: "512 bits credited".into(),
            }],
        };
        let mut sent = Vec::new();
        for round in 0..2 {
            let dir = Scratch::new(&format!("reid{round}"));
            let guest = scripted_guest(
                &dir.vsock(),
                imp_proto::PROTOCOL_VERSION,
                Some(Message::Reidentified(report.clone())),
            );
            let before = std::time::SystemTime::now();
            let got = reidentify(&dir.vsock(), 52, &identity(), Duration::from_secs(10))
                .await
                .unwrap();
            assert_eq!(got, report);
            let seen = guest.await.unwrap();
            let [
                Message::Reidentify {
                    identity: id,
                    entropy,
                    unix_nanos,
                },
            ] = &seen[..]
            else {
                panic!("{seen:?}");
            };
            assert_eq!(*id, identity());
            assert_eq!(entropy.0.len(), MIN_ENTROPY_BYTES);
            let since = before.duration_since(std::time::UNIX_EPOCH).unwrap();
            assert!(
                u128::from(*unix_nanos) >= since.as_nanos(),
                "the clock is now"
            );
            sent.push(entropy.clone());
        }
        assert_ne!(sent[0], sent[1], "every clone gets bytes of its own");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_older_guest_is_reported_as_too_old_and_sent_nothing() {
        let dir = Scratch::new("reid-old");
        let old = imp_proto::message::Version { major: 1, minor: 1 };
        let guest = scripted_guest(&dir.vsock(), old, None);
        let err = reidentify(&dir.vsock(), 52, &identity(), Duration::from_secs(10))
            .await
            .unwrap_err();
        let text = chain(&err);
        assert!(
            matches!(
                &err,
                GuestAgentError::Reidentify(imp_proto::ClientError::Unsupported { .. })
            ),
            "{text}"
        );
        assert_eq!(
            text,
            "giving the guest its own identity: The guest agent (imp-guest test) speaks \
             protocol 1.1, and reidentify needs 1.2 or later: the VM runs an older imp-guest"
        );
        assert!(guest.await.unwrap().is_empty(), "nothing was sent");
    }

    /// Whether the host has started reading this connection (it sends its hello first);
    /// does not wait, so all connections are judged at the same moment.
    fn greeted(s: &UnixStream) -> bool {
        let mut b = [0u8; 1];
        matches!(s.try_read(&mut b), Ok(1))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_exit_report_connections_hold_a_bounded_number_of_readers_then_are_dropped() {
        let dir = Scratch::new("flood");
        let vsock = dir.vsock();
        let mut rx = listen_with(&vsock, 77, Duration::from_millis(400), 2).unwrap();
        let path = imp_vmm::vsock::host_listener_path(&vsock, 77);
        let mut silent = Vec::new();
        for _ in 0..20 {
            silent.push(UnixStream::connect(&path).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut read_at_once = 0;
        for s in &silent {
            if greeted(s) {
                read_at_once += 1;
            }
        }
        assert!(
            read_at_once <= 2,
            "{read_at_once} silent connections read at once"
        );
        // The silent ones are dropped at their deadline, two at a time; then a real report
        // still gets through.
        drop(silent);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let report = tokio::task::spawn_blocking(move || {
            let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            imp_proto::report::send_exit_report(&mut s, &Hello::new("guest"), ExitStatus::Code(4))
        });
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        assert_eq!(got.unwrap(), Some(ExitStatus::Code(4)));
        report.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_loris_exit_report_is_dropped_at_its_deadline_and_the_next_one_counts() {
        let dir = Scratch::new("report-loris");
        let vsock = dir.vsock();
        let mut rx = listen_with(&vsock, 78, Duration::from_millis(300), 1).unwrap();
        let path = imp_vmm::vsock::host_listener_path(&vsock, 78);
        let mut loris = UnixStream::connect(&path).await.unwrap();
        let t = Instant::now();
        let mut cut = false;
        for b in guest_hello() {
            if loris.write_all(&[b]).await.is_err() {
                cut = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        assert!(cut, "the slow report was never cut off");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "cut off after {:?}",
            t.elapsed()
        );
        // Garbage next: an error in the log, and the listener goes on.
        let mut junk = UnixStream::connect(&path).await.unwrap();
        junk.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let path2 = path.clone();
        let report = tokio::task::spawn_blocking(move || {
            let mut s = std::os::unix::net::UnixStream::connect(path2).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            imp_proto::report::send_exit_report(&mut s, &Hello::new("guest"), ExitStatus::Signal(9))
        });
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        assert_eq!(got.unwrap(), Some(ExitStatus::Signal(9)));
        report.await.unwrap().unwrap();
    }
}
