//! The host side of a guest connection: handshake, unary requests and streamed exec.
//!
//! Synchronous and generic over any `Read + Write` stream, so the agent can wrap it around
//! whatever carries the bytes (the VM's hybrid-vsock Unix socket, opened with `CONNECT <port>`
//! by imp-vmm's `vsock::connect` and served by Firecracker or by the QEMU driver's mux, or a
//! plain Unix socket in tests).

use crate::frame::{FrameError, read_frame, write_data, write_frame};
use crate::handshake::{HandshakeError, handshake};
use crate::message::{
    Entropy, ErrorReply, ExecRequest, ExitStatus, HealthReport, Hello, HttpGetRequest,
    HttpGetResult, Identity, Message, MetricsReport, ReidentifyReport, Version, WindowSize,
};
use std::io::{Read, Write};
use std::time::Duration;

/// Why a request to the guest failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection could not be opened or the versions do not match.
    #[error("Handshake with the guest agent failed")]
    Handshake(#[from] HandshakeError),
    /// A frame could not be sent or received.
    #[error("Talking to the guest agent failed")]
    Frame(#[from] FrameError),
    /// The guest closed the connection before answering.
    #[error("Guest agent closed the connection while we waited for {0}")]
    Closed(&'static str),
    /// The guest answered with something else.
    #[error("Expected {expected} from the guest agent, got a {got} message")]
    Unexpected {
        /// What we waited for.
        expected: &'static str,
        /// What arrived.
        got: &'static str,
    },
    /// The guest reported an error (its message escaped when shown: the guest's words).
    #[error("Guest agent refused the request ({:?}): {}", .0.kind, crate::message::escape(&.0.message))]
    Remote(ErrorReply),
    /// The guest's protocol predates the request, so it could not parse it; nothing was sent.
    #[error(
        "The guest agent ({software}) speaks protocol {peer}, and {request} needs {needed} or \
         later: the VM runs an older imp-guest"
    )]
    Unsupported {
        /// The request.
        request: &'static str,
        /// The version that introduced it.
        needed: Version,
        /// The guest's version.
        peer: Version,
        /// The guest's software string, escaped ([`crate::message::escape`]).
        software: String,
    },
    /// The request was refused before it was sent: it cannot be right.
    #[error("Refusing to send {request}: {reason}")]
    Invalid {
        /// The request.
        request: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// The crate's client result.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A handshaken connection to the guest agent.
#[derive(Debug)]
pub struct Client<S> {
    stream: S,
    peer: Hello,
}

impl<S: Read + Write> Client<S> {
    /// Performs the version handshake on an open stream.
    pub fn handshake(mut stream: S, ours: &Hello) -> Result<Self> {
        let peer = handshake(&mut stream, ours)?;
        Ok(Self { stream, peer })
    }

    /// The guest's hello (its version and software).
    pub fn peer(&self) -> &Hello {
        &self.peer
    }

    /// Asks for the guest's uptime and workload state.
    pub fn health(&mut self) -> Result<HealthReport> {
        write_frame(&mut self.stream, &Message::Health)?;
        match self.answer("a health report")? {
            Message::HealthReport(h) => Ok(h),
            other => Err(unexpected("a health report", &other)),
        }
    }

    /// Asks for the guest's CPU, memory and disk figures (takes ~100 ms: two CPU samples).
    pub fn metrics(&mut self) -> Result<MetricsReport> {
        write_frame(&mut self.stream, &Message::Metrics)?;
        match self.answer("a metrics report")? {
            Message::MetricsReport(m) => Ok(m),
            other => Err(unexpected("a metrics report", &other)),
        }
    }

    /// Sets the guest's wall clock to `now` (after a restore its clock is as old as the
    /// snapshot).
    pub fn set_clock(&mut self, now: std::time::SystemTime) -> Result<()> {
        let request = Message::SetClock {
            unix_nanos: unix_nanos(now),
        };
        self.send(&request)?;
        match self.answer("the clock acknowledgement")? {
            Message::ClockSet => Ok(()),
            other => Err(unexpected("the clock acknowledgement", &other)),
        }
    }

    /// Makes a guest restored from a snapshot that other VMs share a machine of its own:
    /// reseeds its entropy pool with `entropy`, sets its clock to `now`, gives it `identity`
    /// and ends the TCP connections it carried over. Returns what the guest did, step by step;
    /// a step that failed is in the report, not an error.
    pub fn reidentify(
        &mut self,
        identity: &Identity,
        entropy: Entropy,
        now: std::time::SystemTime,
    ) -> Result<ReidentifyReport> {
        let invalid = |reason| ClientError::Invalid {
            request: "reidentify",
            reason,
        };
        identity.validate().map_err(invalid)?;
        entropy.validate().map_err(invalid)?;
        let request = Message::Reidentify {
            identity: identity.clone(),
            entropy,
            unix_nanos: unix_nanos(now),
        };
        self.send(&request)?;
        match self.answer("the reidentification report")? {
            Message::Reidentified(report) => Ok(report),
            other => Err(unexpected("the reidentification report", &other)),
        }
    }

    /// Has the guest GET `request.path` from its own `127.0.0.1:request.port` (a probe); the
    /// outcome, whatever the status, is the result; an error is a failure to ask.
    pub fn http_get(&mut self, request: &HttpGetRequest) -> Result<HttpGetResult> {
        request.validate().map_err(|reason| ClientError::Invalid {
            request: "http_get",
            reason,
        })?;
        self.send(&Message::HttpGet(request.clone()))?;
        match self.answer("the HTTP GET's result")? {
            Message::HttpGetResult(r) => Ok(r),
            other => Err(unexpected("the HTTP GET's result", &other)),
        }
    }

    /// Asks the guest to stop its workload (SIGTERM, then SIGKILL after `grace`) and power off.
    pub fn shutdown(&mut self, grace: Duration) -> Result<()> {
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        write_frame(&mut self.stream, &Message::Shutdown { grace_ms })?;
        match self.answer("the shutdown acknowledgement")? {
            Message::ShutdownAccepted => Ok(()),
            other => Err(unexpected("the shutdown acknowledgement", &other)),
        }
    }

    /// Starts a command; the connection then belongs to the exec until it exits.
    pub fn exec(mut self, request: &ExecRequest) -> Result<ExecSession<S>> {
        write_frame(&mut self.stream, &Message::Exec(request.clone()))?;
        match self.answer("the exec to start")? {
            Message::Started { pid } => Ok(ExecSession {
                stream: self.stream,
                pid,
            }),
            other => Err(unexpected("the exec to start", &other)),
        }
    }

    /// Gives the stream back.
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// Sends a request the guest's version can read; an older guest would fail to parse it
    /// and drop the connection, so it is told apart here instead.
    fn send(&mut self, request: &Message) -> Result<()> {
        let needed = request.since();
        if !self.peer.version.supports(needed) {
            return Err(ClientError::Unsupported {
                request: request.name(),
                needed,
                peer: self.peer.version,
                software: self.peer.software_escaped(),
            });
        }
        Ok(write_frame(&mut self.stream, request)?)
    }

    fn answer(&mut self, expected: &'static str) -> Result<Message> {
        match read_frame(&mut self.stream)? {
            None => Err(ClientError::Closed(expected)),
            Some(Message::Error(e)) => Err(ClientError::Remote(e)),
            Some(m) => Ok(m),
        }
    }
}

/// Nanoseconds since the Unix epoch (0 before it, saturated far after it).
fn unix_nanos(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn unexpected(expected: &'static str, got: &Message) -> ClientError {
    ClientError::Unexpected {
        expected,
        got: got.name(),
    }
}

/// What a running exec produced next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// Bytes on stdout (or the TTY).
    Stdout(Vec<u8>),
    /// Bytes on stderr.
    Stderr(Vec<u8>),
    /// The process ended; nothing follows.
    Exit(ExitStatus),
}

/// A running command: send it input and signals, read its output as it is produced.
#[derive(Debug)]
pub struct ExecSession<S> {
    stream: S,
    pid: u32,
}

impl<S: Read + Write> ExecSession<S> {
    /// The command's pid inside the guest.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends bytes to the command's stdin.
    pub fn write_stdin(&mut self, data: &[u8]) -> Result<()> {
        ExecInput::write_stdin_to(&mut self.stream, data)
    }

    /// Ends the command's stdin (EOF, or Ctrl-D on a TTY).
    pub fn close_stdin(&mut self) -> Result<()> {
        Ok(write_frame(&mut self.stream, &Message::StdinEof)?)
    }

    /// Tells the command's TTY its new size.
    pub fn resize(&mut self, size: WindowSize) -> Result<()> {
        Ok(write_frame(&mut self.stream, &Message::Resize(size))?)
    }

    /// Sends a signal (a Linux signal number) to the command.
    pub fn signal(&mut self, signal: i32) -> Result<()> {
        Ok(write_frame(&mut self.stream, &Message::Signal { signal })?)
    }

    /// Waits for the next output or the exit.
    pub fn next_event(&mut self) -> Result<ExecEvent> {
        ExecOutput::next_from(&mut self.stream)
    }

    /// Reads everything until the exit, writing stdout and stderr as they arrive.
    pub fn wait_with_output(
        &mut self,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExitStatus> {
        ExecOutput::drain_from(&mut self.stream, stdout, stderr)
    }

    /// Splits the session so input and output can be driven from two threads; `writer` must
    /// be a second handle on the same connection (e.g. `UnixStream::try_clone`).
    pub fn into_parts<W: Write>(self, writer: W) -> (ExecInput<W>, ExecOutput<S>) {
        (
            ExecInput { stream: writer },
            ExecOutput {
                stream: self.stream,
            },
        )
    }
}

/// The sending half of a split [`ExecSession`].
#[derive(Debug)]
pub struct ExecInput<W> {
    stream: W,
}

impl<W: Write> ExecInput<W> {
    fn write_stdin_to(stream: &mut W, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        Ok(write_data(stream, Message::Stdin, data)?)
    }

    /// Sends bytes to the command's stdin.
    pub fn write_stdin(&mut self, data: &[u8]) -> Result<()> {
        Self::write_stdin_to(&mut self.stream, data)
    }

    /// Ends the command's stdin.
    pub fn close_stdin(&mut self) -> Result<()> {
        Ok(write_frame(&mut self.stream, &Message::StdinEof)?)
    }

    /// Tells the command's TTY its new size.
    pub fn resize(&mut self, size: WindowSize) -> Result<()> {
        Ok(write_frame(&mut self.stream, &Message::Resize(size))?)
    }

    /// Sends a signal to the command.
    pub fn signal(&mut self, signal: i32) -> Result<()> {
        Ok(write_frame(&mut self.stream, &Message::Signal { signal })?)
    }
}

/// The receiving half of a split [`ExecSession`].
#[derive(Debug)]
pub struct ExecOutput<R> {
    stream: R,
}

impl<R: Read> ExecOutput<R> {
    fn next_from(stream: &mut R) -> Result<ExecEvent> {
        const WHAT: &str = "the exec's output or exit";
        match read_frame(stream)? {
            None => Err(ClientError::Closed(WHAT)),
            Some(Message::Stdout(d)) => Ok(ExecEvent::Stdout(d)),
            Some(Message::Stderr(d)) => Ok(ExecEvent::Stderr(d)),
            Some(Message::Exit { status }) => Ok(ExecEvent::Exit(status)),
            Some(Message::Error(e)) => Err(ClientError::Remote(e)),
            Some(other) => Err(unexpected(WHAT, &other)),
        }
    }

    fn drain_from(
        stream: &mut R,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExitStatus> {
        loop {
            let (out, data): (&mut dyn Write, Vec<u8>) = match Self::next_from(stream)? {
                ExecEvent::Stdout(d) => (&mut *stdout, d),
                ExecEvent::Stderr(d) => (&mut *stderr, d),
                ExecEvent::Exit(status) => return Ok(status),
            };
            out.write_all(&data)
                .and_then(|()| out.flush())
                .map_err(|source| FrameError::Io {
                    action: "copying output of",
                    source,
                })?;
        }
    }

    /// Waits for the next output or the exit.
    pub fn next_event(&mut self) -> Result<ExecEvent> {
        Self::next_from(&mut self.stream)
    }

    /// Reads everything until the exit, writing stdout and stderr as they arrive.
    pub fn wait_with_output(
        &mut self,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExitStatus> {
        Self::drain_from(&mut self.stream, stdout, stderr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{ErrorKind, WorkloadState};
    use std::os::unix::net::UnixStream;
    use std::thread;

    /// A scripted guest: handshake, then answer each request with the given replies.
    fn fake_guest(
        mut s: UnixStream,
        script: Vec<(&'static str, Vec<Message>)>,
    ) -> thread::JoinHandle<Vec<Message>> {
        thread::spawn(move || {
            handshake(&mut s, &Hello::new("fake-guest")).unwrap();
            let mut seen = Vec::new();
            for (expect, replies) in script {
                let got = read_frame(&mut s).unwrap().unwrap();
                assert_eq!(got.name(), expect);
                seen.push(got);
                for r in replies {
                    write_frame(&mut s, &r).unwrap();
                }
            }
            seen
        })
    }

    #[test]
    fn unary_requests_get_their_answers_on_one_connection() {
        let (host, guest) = UnixStream::pair().unwrap();
        let health = HealthReport {
            uptime_ms: 5,
            workload: WorkloadState::Starting,
        };
        let g = fake_guest(
            guest,
            vec![
                ("health", vec![Message::HealthReport(health.clone())]),
                (
                    "metrics",
                    vec![Message::MetricsReport(MetricsReport::default())],
                ),
                ("shutdown", vec![Message::ShutdownAccepted]),
            ],
        );
        let mut c = Client::handshake(host, &Hello::new("host")).unwrap();
        assert_eq!(c.peer().software, "fake-guest");
        assert_eq!(c.health().unwrap(), health);
        assert_eq!(c.metrics().unwrap(), MetricsReport::default());
        c.shutdown(Duration::from_millis(1500)).unwrap();
        let seen = g.join().unwrap();
        assert_eq!(seen[2], Message::Shutdown { grace_ms: 1500 });
    }

    #[test]
    fn exec_streams_output_and_forwards_input() {
        let (host, guest) = UnixStream::pair().unwrap();
        let g = fake_guest(
            guest,
            vec![
                ("exec", vec![Message::Started { pid: 9 }]),
                ("stdin", vec![Message::Stdout(b"echo".to_vec())]),
                ("stdin_eof", vec![Message::Stderr(b"e".to_vec())]),
                (
                    "signal",
                    vec![Message::Exit {
                        status: ExitStatus::Code(3),
                    }],
                ),
            ],
        );
        let c = Client::handshake(host, &Hello::new("host")).unwrap();
        let mut s = c
            .exec(&ExecRequest {
                argv: vec!["cat".into()],
                ..Default::default()
            })
            .unwrap();
        assert_eq!(s.pid(), 9);
        s.write_stdin(b"in").unwrap();
        assert_eq!(s.next_event().unwrap(), ExecEvent::Stdout(b"echo".to_vec()));
        s.close_stdin().unwrap();
        s.signal(15).unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(
            s.wait_with_output(&mut out, &mut err).unwrap(),
            ExitStatus::Code(3)
        );
        assert_eq!(err, b"e");
        let seen = g.join().unwrap();
        assert_eq!(seen[1], Message::Stdin(b"in".to_vec()));
        assert_eq!(seen[3], Message::Signal { signal: 15 });
    }

    #[test]
    fn a_refused_exec_surfaces_the_guest_message() {
        let (host, guest) = UnixStream::pair().unwrap();
        let g = fake_guest(
            guest,
            vec![(
                "exec",
                vec![Message::error(
                    ErrorKind::NotFound,
                    "command \"nope\" not found",
                )],
            )],
        );
        let c = Client::handshake(host, &Hello::new("host")).unwrap();
        let err = c.exec(&ExecRequest {
            argv: vec!["nope".into()],
            ..Default::default()
        });
        let err = err.unwrap_err();
        assert!(matches!(&err, ClientError::Remote(e) if e.kind == ErrorKind::NotFound));
        assert!(
            err.to_string().contains("command \"nope\" not found"),
            "{err}"
        );
        g.join().unwrap();
    }

    fn identity() -> Identity {
        Identity {
            hostname: Some("clone-2".into()),
            mac: Some("02:00:0a:00:00:07".into()),
            network: Some(crate::config::NetworkConfig {
                interface: "eth0".into(),
                address: std::net::Ipv4Addr::new(10, 0, 0, 7),
                prefix_len: 24,
                gateway: Some(std::net::Ipv4Addr::new(10, 0, 0, 1)),
                dns: vec![],
                search: vec![],
                mtu: None,
            }),
        }
    }

    #[test]
    fn reidentify_sends_identity_entropy_and_time_and_returns_the_report() {
        use crate::message::{Step, StepStatus};
        let (host, guest) = UnixStream::pair().unwrap();
        let report = ReidentifyReport {
            steps: vec![Step {
                name: "entropy".into(),
                status: StepStatus::Done,
                detail: "512 bits credited".into(),
            }],
        };
        let g = fake_guest(
            guest,
            vec![("reidentify", vec![Message::Reidentified(report.clone())])],
        );
        let mut c = Client::handshake(host, &Hello::new("host")).unwrap();
        let now = std::time::UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_000_007);
        let got = c
            .reidentify(&identity(), Entropy(vec![7; 64]), now)
            .unwrap();
        assert_eq!(got, report);
        let seen = g.join().unwrap();
        assert_eq!(
            seen[0],
            Message::Reidentify {
                identity: identity(),
                entropy: Entropy(vec![7; 64]),
                unix_nanos: 1_700_000_000_000_000_007,
            }
        );
    }

    /// A guest that says hello with `version`, then reports whether anything else arrived.
    fn old_guest(
        mut s: UnixStream,
        version: crate::message::Version,
    ) -> thread::JoinHandle<Option<Message>> {
        thread::spawn(move || {
            let hello = Hello {
                version,
                software: "imp-guest 0.0.9".into(),
            };
            handshake(&mut s, &hello).unwrap();
            read_frame(&mut s).unwrap()
        })
    }

    #[test]
    fn an_older_guest_is_not_sent_what_it_cannot_read_and_the_error_says_so() {
        use crate::message::Version;
        let (host, guest) = UnixStream::pair().unwrap();
        let g = old_guest(guest, Version { major: 1, minor: 1 });
        let mut c = Client::handshake(host, &Hello::new("host")).unwrap();
        let err = c
            .reidentify(
                &identity(),
                Entropy(vec![1; 64]),
                std::time::SystemTime::now(),
            )
            .unwrap_err();
        assert!(matches!(err, ClientError::Unsupported { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            "The guest agent (imp-guest 0.0.9) speaks protocol 1.1, and reidentify needs 1.2 or \
             later: the VM runs an older imp-guest"
        );
        // The clock (1.1) still works on a 1.1 guest; on a 1.0 guest it is refused alike.
        drop(c);
        assert_eq!(g.join().unwrap(), None, "nothing was sent");
        let (host, guest) = UnixStream::pair().unwrap();
        let g = old_guest(guest, Version { major: 1, minor: 0 });
        let mut c = Client::handshake(host, &Hello::new("host")).unwrap();
        let err = c.set_clock(std::time::SystemTime::now()).unwrap_err();
        assert!(err.to_string().contains("set_clock needs 1.1"), "{err}");
        drop(c);
        assert_eq!(g.join().unwrap(), None);
    }

    #[test]
    fn a_bad_identity_or_too_little_entropy_is_refused_before_sending() {
        let (host, guest) = UnixStream::pair().unwrap();
        let g = old_guest(guest, crate::PROTOCOL_VERSION);
        let mut c = Client::handshake(host, &Hello::new("host")).unwrap();
        let now = std::time::SystemTime::now();
        let err = c
            .reidentify(&identity(), Entropy(vec![1; 63]), now)
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Invalid { reason, .. } if reason.contains("63 bytes")),
            "{err}"
        );
        let mut bad = identity();
        bad.mac = Some("01:00:5e:00:00:01".into());
        let err = c.reidentify(&bad, Entropy(vec![1; 64]), now).unwrap_err();
        assert!(err.to_string().contains("multicast"), "{err}");
        drop(c);
        assert_eq!(g.join().unwrap(), None);
    }
}
