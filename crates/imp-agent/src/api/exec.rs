//! Exec: the caller's upgraded connection carries the host↔guest protocol to the guest agent.
//!
//! After `101 Switching Protocols` the caller speaks `imp-proto` as if it were on the VM's
//! vsock: its hello, then one [`Message::Exec`] and that exec's stream. [`relay`] reads the two
//! opening frames with imp-proto's framing (bounded by [`imp_proto::MAX_FRAME_LEN`]), refuses
//! anything but a hello followed by an exec (so an authorised `impvms/exec` cannot become a
//! `Shutdown` of the VM), forwards them, passes the guest's hello back, and then splices the two
//! streams until the guest ends the exec. Stdin, resizes, signals and the exit travel as the
//! protocol already defines them; the caller hanging up hangs up on the guest, which kills the
//! command.
//!
//! Each side's end of stream is passed on as a half-close of the other: the caller ending its
//! side shuts the guest's, the guest ending its side shuts the caller's. After the guest's
//! [`Message::Exit`] the exec is over and the caller's late bytes are read and dropped for at
//! most [`LINGER`]; a guest that ends its side before its exit still reads, so the caller's
//! bytes go on reaching it until the caller ends too (the session limits bound what a caller
//! that never does can hold).

use std::io;
use std::time::Duration;

use http::header::{CONNECTION, UPGRADE};
use http::{HeaderMap, StatusCode};
use imp_proto::frame::{FrameError, check_len, decode, encode};
use imp_proto::message::{ErrorKind, Message};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::EXEC_UPGRADE;
use imp_agent_api::lists_token;

/// Why an exec request cannot be upgraded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpgradeError {
    /// The request does not ask for an upgrade at all.
    #[error("Exec needs an upgrade: send Connection: Upgrade and Upgrade: {EXEC_UPGRADE}")]
    Missing,
    /// It asks for another protocol.
    #[error("Unsupported upgrade {0:?}: this agent speaks {EXEC_UPGRADE}")]
    Protocol(String),
}

impl UpgradeError {
    /// The HTTP status that answers this error.
    pub fn status(&self) -> StatusCode {
        match self {
            UpgradeError::Missing => StatusCode::UPGRADE_REQUIRED,
            UpgradeError::Protocol(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Checks that a request asks to upgrade to [`EXEC_UPGRADE`].
pub fn check_upgrade(headers: &HeaderMap) -> Result<(), UpgradeError> {
    let connection_upgrade = headers
        .get_all(CONNECTION)
        .iter()
        .any(|v| v.to_str().is_ok_and(|s| lists_token(s, "upgrade")));
    let Some(upgrade) = headers.get(UPGRADE) else {
        return Err(UpgradeError::Missing);
    };
    if !connection_upgrade {
        return Err(UpgradeError::Missing);
    }
    let upgrade = upgrade.to_str().unwrap_or("");
    if lists_token(upgrade, EXEC_UPGRADE) {
        Ok(())
    } else {
        Err(UpgradeError::Protocol(upgrade.to_owned()))
    }
}

/// Why a relayed exec ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Reading or writing either side failed.
    #[error("Relaying the exec failed")]
    Io(#[from] io::Error),
    /// A frame was malformed or too large.
    #[error("Invalid frame from the caller or the guest")]
    Frame(#[from] FrameError),
    /// One side closed before the exec began.
    #[error("The {side} closed the connection before {what}")]
    Closed {
        /// "caller" or "guest".
        side: &'static str,
        /// What was awaited.
        what: &'static str,
    },
    /// The caller's first message was not a hello.
    #[error("Expected a hello from the caller, got a {0} message")]
    NotHello(&'static str),
    /// The caller's request after the hello was not an exec.
    #[error("Only exec is allowed on this endpoint, got a {0} message")]
    NotExec(&'static str),
    /// The caller sent no hello and exec in time.
    #[error("The caller sent no hello and exec within {0:?}")]
    Timeout(Duration),
}

/// Relays one exec between `caller` (the upgraded connection) and `guest` (the guest agent's
/// vsock stream): the opening must arrive within `opening`; then until the guest ends it.
pub async fn relay<C, G>(mut caller: C, mut guest: G, opening: Duration) -> Result<(), RelayError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    G: AsyncRead + AsyncWrite + Unpin,
{
    let opened = tokio::time::timeout(opening, open(&mut caller, &mut guest))
        .await
        .unwrap_or(Err(RelayError::Timeout(opening)));
    if let Err(e) = opened {
        if matches!(
            e,
            RelayError::NotHello(_) | RelayError::NotExec(_) | RelayError::Timeout(_)
        ) {
            // Tell the caller why, in its own protocol (best effort: it may be gone).
            if let Ok(frame) = encode(&Message::error(ErrorKind::BadRequest, e.to_string())) {
                let _ = caller.write_all(&frame).await;
                let _ = caller.shutdown().await;
            }
        }
        return Err(e);
    }
    splice(caller, guest).await
}

/// Passes the caller's hello, the guest's hello and the caller's exec, checking the caller's.
async fn open<C, G>(caller: &mut C, guest: &mut G) -> Result<(), RelayError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    G: AsyncRead + AsyncWrite + Unpin,
{
    let (raw, hello) = read_frame(caller).await?.ok_or(RelayError::Closed {
        side: "caller",
        what: "its hello",
    })?;
    if !matches!(hello, Message::Hello(_)) {
        return Err(RelayError::NotHello(hello.name()));
    }
    guest.write_all(&raw).await?;
    // The guest's hello, or its refusal of ours: the caller decides what to make of it.
    let (raw, _) = read_frame(guest).await?.ok_or(RelayError::Closed {
        side: "guest",
        what: "its hello",
    })?;
    caller.write_all(&raw).await?;
    caller.flush().await?;
    let (raw, request) = read_frame(caller).await?.ok_or(RelayError::Closed {
        side: "caller",
        what: "its exec request",
    })?;
    if !matches!(request, Message::Exec(_)) {
        return Err(RelayError::NotExec(request.name()));
    }
    guest.write_all(&raw).await?;
    guest.flush().await?;
    Ok(())
}

/// How long a caller may go on sending once the guest has ended the exec. What it sends then is
/// read and dropped: closing a TCP connection with unread bytes makes the kernel reset it and
/// discard what it had not sent yet, which can be the end of the output and the exit that a
/// caller whose stdin ended late (a quick `exec -t`) is still waiting for.
const LINGER: Duration = Duration::from_secs(5);

/// Copies both ways; done when both sides have ended, or [`LINGER`] after the guest's end
/// once it has sent its exit. Each side's end is passed on as a half-close of the other's.
async fn splice<C, G>(caller: C, guest: G) -> Result<(), RelayError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    G: AsyncRead + AsyncWrite + Unpin,
{
    let (mut caller_rx, mut caller_tx) = tokio::io::split(caller);
    let (mut guest_rx, mut guest_tx) = tokio::io::split(guest);
    let down = async {
        let mut watch = ExitWatch::default();
        let copied = copy_watching(&mut guest_rx, &mut caller_tx, &mut watch).await;
        let _ = caller_tx.shutdown().await;
        copied.map(|()| watch.exited)
    };
    let up = caller_to_guest(&mut caller_rx, &mut guest_tx);
    tokio::pin!(down, up);
    tokio::select! {
        copied = &mut down => {
            if matches!(copied, Ok(false)) {
                // The guest ended its side before its exit: a half-close. It still reads, so
                // the caller's side goes on until the caller ends it.
                tracing::debug!("the guest half-closed the exec; relaying the caller's side until it ends");
                if let Err(e) = (&mut up).await {
                    tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "reading the caller ended with an error");
                }
                return Ok(());
            }
            // The exec is over; the caller's last bytes may still be on their way.
            if tokio::time::timeout(LINGER, &mut up).await.is_err() {
                tracing::debug!("the caller kept its exec connection open after the exit");
            }
            copied?;
        }
        copied = &mut up => {
            if let Err(e) = copied {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "reading the caller ended with an error");
            }
            // What the guest sent is still on its way to the caller: drain it to its end.
            down.await?;
        }
    }
    Ok(())
}

/// Copies the guest's bytes to the caller until the guest's side ends, watching for its exit.
async fn copy_watching<R, W>(guest: &mut R, caller: &mut W, watch: &mut ExitWatch) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = guest.read(&mut buf).await?;
        if n == 0 {
            return caller.flush().await;
        }
        watch.feed(&buf[..n]);
        caller.write_all(&buf[..n]).await?;
    }
}

/// Follows the frames of the guest's side as they go by, keeping none, to tell whether the
/// exec's [`Message::Exit`] has passed: only a control frame's first bytes are looked at
/// (`{"type":"exit"` as imp-proto's JSON puts the tag first), so a guest cannot make the relay
/// hold more than a few bytes. What a guest that lies gets is only its own session's end.
#[derive(Debug, Default)]
struct ExitWatch {
    /// Bytes of the current frame's length prefix read so far.
    header: Vec<u8>,
    /// Body bytes of the current frame still to come.
    left: usize,
    /// The first bytes of the current frame's body, up to [`EXIT_HEAD`]'s length + 1.
    head: Vec<u8>,
    /// Whether an exit frame has gone by.
    exited: bool,
}

/// How an exit frame's body starts: the control kind (0), then the JSON's tag.
const EXIT_HEAD: &[u8] = b"\0{\"type\":\"exit\"";

impl ExitWatch {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left == 0 {
                let take = (4 - self.header.len()).min(bytes.len());
                self.header.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                if let Ok(len) = <[u8; 4]>::try_from(self.header.as_slice()) {
                    self.left = u32::from_be_bytes(len) as usize;
                    self.header.clear();
                    self.head.clear();
                }
                continue;
            }
            let take = self.left.min(bytes.len());
            let want = (EXIT_HEAD.len() + 1).saturating_sub(self.head.len());
            self.head.extend_from_slice(&bytes[..take.min(want)]);
            if self.head.len() == EXIT_HEAD.len() + 1
                && self.head.starts_with(EXIT_HEAD)
                && matches!(self.head.last(), Some(b',' | b'}'))
            {
                self.exited = true;
            }
            self.left -= take;
            bytes = &bytes[take..];
        }
    }
}

/// Copies what the caller sends to the guest until the caller ends, then shuts the guest's
/// write side. Once the guest takes no more (it sent the exit and closed), the caller's bytes
/// are read and dropped, so the caller is never left with unread bytes at our close.
async fn caller_to_guest<R, W>(caller: &mut R, guest: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 32 * 1024];
    let mut guest_takes = true;
    let ended = loop {
        let n = match caller.read(&mut buf).await {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            // Gone without a clean end (a TLS peer that did not say close_notify): a hang-up.
            Err(e) => break Err(e),
        };
        if guest_takes {
            let sent = async {
                guest.write_all(&buf[..n]).await?;
                guest.flush().await
            };
            if let Err(e) = sent.await {
                tracing::debug!(error = %imp_api::chain::DisplayChain(&e), "the guest takes no more of the caller's bytes");
                guest_takes = false;
            }
        }
    };
    // However the caller went, the guest must see the hang-up (it kills the command).
    if guest_takes {
        let _ = guest.shutdown().await;
    }
    ended
}

/// Reads one whole frame without reading past it: its raw bytes (to forward unchanged) and
/// the decoded message; `None` on a clean end of stream before the frame.
async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Option<(Vec<u8>, Message)>, RelayError> {
    let mut len = [0u8; 4];
    if reader.read(&mut len[..1]).await? == 0 {
        return Ok(None);
    }
    reader
        .read_exact(&mut len[1..])
        .await
        .map_err(|e| truncated(e, "length", 4))?;
    let body_len = check_len(u32::from_be_bytes(len))?;
    let mut raw = vec![0u8; 4 + body_len];
    raw[..4].copy_from_slice(&len);
    reader
        .read_exact(&mut raw[4..])
        .await
        .map_err(|e| truncated(e, "body", body_len))?;
    let message = decode(&raw[4..])?;
    Ok(Some((raw, message)))
}

fn truncated(e: io::Error, part: &'static str, expected: usize) -> RelayError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        RelayError::Frame(FrameError::Truncated {
            part,
            expected,
            got: 0,
        })
    } else {
        RelayError::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use imp_proto::message::{ExecRequest, ExitStatus, Hello};
    use imp_proto::{MAX_FRAME_LEN, read_frame as read_sync};
    use tokio::io::{DuplexStream, duplex};

    #[test]
    fn only_an_upgrade_to_imp_exec_is_accepted() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert_eq!(
            check_upgrade(&headers(&[
                ("connection", "Upgrade"),
                ("upgrade", "imp-exec/1")
            ])),
            Ok(())
        );
        assert_eq!(
            check_upgrade(&headers(&[
                ("connection", "keep-alive, upgrade"),
                ("upgrade", "IMP-EXEC/1")
            ])),
            Ok(())
        );
        let missing = check_upgrade(&headers(&[])).unwrap_err();
        assert_eq!(missing, UpgradeError::Missing);
        assert_eq!(missing.status(), StatusCode::UPGRADE_REQUIRED);
        assert_eq!(
            check_upgrade(&headers(&[("upgrade", "imp-exec/1")])),
            Err(UpgradeError::Missing),
            "Upgrade without Connection: upgrade"
        );
        let other = check_upgrade(&headers(&[
            ("connection", "upgrade"),
            ("upgrade", "websocket"),
        ]))
        .unwrap_err();
        assert_eq!(other, UpgradeError::Protocol("websocket".into()));
        assert_eq!(other.status(), StatusCode::BAD_REQUEST);
    }

    fn frame(m: &Message) -> Vec<u8> {
        encode(m).unwrap()
    }

    /// Runs `relay` between an in-memory caller and guest; returns both far ends.
    fn start(
        opening: Duration,
    ) -> (
        DuplexStream,
        DuplexStream,
        tokio::task::JoinHandle<Result<(), RelayError>>,
    ) {
        let (caller_far, caller_near) = duplex(1 << 21);
        let (guest_near, guest_far) = duplex(1 << 21);
        let task = tokio::spawn(relay(caller_near, guest_near, opening));
        (caller_far, guest_far, task)
    }

    async fn read_all(mut s: DuplexStream) -> Vec<Message> {
        let mut bytes = Vec::new();
        s.read_to_end(&mut bytes).await.unwrap();
        let mut cursor = std::io::Cursor::new(bytes);
        let mut out = Vec::new();
        while let Some(m) = read_sync(&mut cursor).unwrap() {
            out.push(m);
        }
        out
    }

    #[tokio::test]
    async fn hello_and_exec_pass_then_the_streams_are_spliced_until_the_guest_ends() {
        let (mut caller, mut guest, task) = start(Duration::from_secs(5));
        let exec = Message::Exec(ExecRequest {
            argv: vec!["cat".into()],
            stdin: true,
            ..Default::default()
        });
        caller
            .write_all(&frame(&Message::Hello(Hello::new("cli"))))
            .await
            .unwrap();
        guest
            .write_all(&frame(&Message::Hello(Hello::new("guest"))))
            .await
            .unwrap();
        // The exec and the first stdin arrive in one write: nothing after the exec may be lost.
        let mut burst = frame(&exec);
        burst.extend(frame(&Message::Stdin(b"hi".to_vec())));
        caller.write_all(&burst).await.unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        let want = frame(&Message::Hello(Hello::new("cli"))).len() + burst.len();
        while got.len() < want {
            let n = guest.read(&mut buf).await.unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        let mut cursor = std::io::Cursor::new(got);
        assert!(matches!(
            read_sync(&mut cursor).unwrap(),
            Some(Message::Hello(_))
        ));
        assert_eq!(read_sync(&mut cursor).unwrap(), Some(exec));
        assert_eq!(
            read_sync(&mut cursor).unwrap(),
            Some(Message::Stdin(b"hi".to_vec()))
        );
        guest
            .write_all(&frame(&Message::Stdout(b"hi".to_vec())))
            .await
            .unwrap();
        guest
            .write_all(&frame(&Message::Exit {
                status: ExitStatus::Code(3),
            }))
            .await
            .unwrap();
        drop(guest);
        let seen = read_all(caller).await;
        assert!(matches!(seen[0], Message::Hello(ref h) if h.software == "guest"));
        assert_eq!(seen[1], Message::Stdout(b"hi".to_vec()));
        assert_eq!(
            seen[2],
            Message::Exit {
                status: ExitStatus::Code(3)
            }
        );
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn anything_but_exec_after_the_hello_is_refused_and_never_reaches_the_guest() {
        let (mut caller, mut guest, task) = start(Duration::from_secs(5));
        caller
            .write_all(&frame(&Message::Hello(Hello::new("cli"))))
            .await
            .unwrap();
        guest
            .write_all(&frame(&Message::Hello(Hello::new("guest"))))
            .await
            .unwrap();
        caller
            .write_all(&frame(&Message::Shutdown { grace_ms: 0 }))
            .await
            .unwrap();
        let err = task.await.unwrap().unwrap_err();
        assert!(matches!(err, RelayError::NotExec("shutdown")), "{err}");
        let seen = read_all(caller).await;
        assert!(matches!(seen[0], Message::Hello(_)));
        match &seen[1] {
            Message::Error(e) => assert!(e.message.contains("Only exec"), "{}", e.message),
            other => panic!("expected an error, got {other:?}"),
        }
        // The guest got the hello and nothing else.
        let to_guest = read_all(guest).await;
        assert_eq!(to_guest.len(), 1, "{to_guest:?}");
        assert!(matches!(to_guest[0], Message::Hello(_)));
    }

    /// A guest stream whose writes fail, as a socket the guest has closed.
    struct ClosedForWrites;

    impl tokio::io::AsyncWrite for ClosedForWrites {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn what_the_guest_sent_reaches_the_caller_even_when_the_callers_last_write_fails() {
        let (mut caller, caller_near) = duplex(1 << 16);
        let (mut guest_far, guest_rx) = duplex(1 << 16);
        let guest = tokio::io::join(guest_rx, ClosedForWrites);
        let task = tokio::spawn(splice(caller_near, guest));
        // The caller's stdin EOF goes out first and fails at the closed guest...
        caller
            .write_all(&encode(&Message::StdinEof).unwrap())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // ...while the guest's exit is still on its way.
        let exit = encode(&Message::Exit {
            status: ExitStatus::Code(0),
        })
        .unwrap();
        guest_far.write_all(&exit).await.unwrap();
        drop(guest_far);
        let mut got = Vec::new();
        caller.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, exit, "the exit was lost");
        drop(caller);
        task.await.unwrap().unwrap();
    }

    /// A caller whose stdin ends after the guest ended the exec (`imp exec -t` of a quick
    /// command): the relay reads its late bytes instead of closing on them, which would reset
    /// the connection and could destroy the output and exit still on their way; it closes once
    /// the caller has hung up.
    #[tokio::test]
    async fn a_caller_still_sending_after_the_exit_is_read_until_it_hangs_up_not_reset() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut caller = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (near, _) = listener.accept().await.unwrap();
        let (mut guest_far, guest_near) = duplex(1 << 16);
        let task = tokio::spawn(splice(near, guest_near));
        let mut output = frame(&Message::Stdout(b"tty\r\n".to_vec()));
        output.extend(frame(&Message::Exit {
            status: ExitStatus::Code(0),
        }));
        guest_far.write_all(&output).await.unwrap();
        drop(guest_far);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // The guest has ended; the caller's stdin EOF comes only now, and then another frame
        // once a reset (if the relay had closed on the first) would have come back.
        caller.write_all(&frame(&Message::StdinEof)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        caller
            .write_all(&frame(&Message::Resize(imp_proto::WindowSize {
                rows: 1,
                cols: 1,
            })))
            .await
            .expect("the relay closed on the caller's late bytes: the connection was reset");
        assert!(!task.is_finished(), "the relay closed before the caller");
        let mut got = Vec::new();
        caller.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, output, "the output or the exit was lost");
        drop(caller);
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("the relay did not end once the caller hung up")
            .unwrap()
            .unwrap();
    }

    #[test]
    fn the_exit_is_seen_go_by_in_any_split_and_nothing_else_counts() {
        let stream = |ms: &[Message]| ms.iter().flat_map(frame).collect::<Vec<u8>>();
        let exit = Message::Exit {
            status: ExitStatus::Signal(9),
        };
        let lookalikes = [
            Message::Started { pid: 1 },
            Message::Stdout(frame(&exit)),
            Message::Stdout(br#"{"type":"exit","status":{"code":0}}"#.to_vec()),
            Message::Stderr(vec![0; 70_000]),
            Message::WorkloadExited {
                status: ExitStatus::Code(0),
            },
            Message::error(ErrorKind::Internal, r#"{"type":"exit"}"#),
        ];
        let before = stream(&lookalikes);
        let mut all = before.clone();
        all.extend(frame(&exit));
        for chunk in [1, 2, 3, 5, 4096, all.len()] {
            let mut w = ExitWatch::default();
            for piece in before.chunks(chunk) {
                w.feed(piece);
            }
            assert!(
                !w.exited,
                "no exit among the lookalikes (chunks of {chunk})"
            );
            let mut w = ExitWatch::default();
            for piece in all.chunks(chunk) {
                w.feed(piece);
            }
            assert!(w.exited, "the exit went by in chunks of {chunk}");
            assert!(w.head.len() <= EXIT_HEAD.len() + 1, "it holds a few bytes");
        }
    }

    /// The guest ends its side before its exit: the caller sees the end of the stream, and
    /// what it sends still reaches the guest until it ends its side too, which ends the relay.
    #[tokio::test]
    async fn a_guest_half_close_is_passed_on_and_the_callers_side_stays_open() {
        let (mut caller, caller_near) = duplex(1 << 16);
        let (guest_near, guest_far) = duplex(1 << 16);
        let task = tokio::spawn(splice(caller_near, guest_near));
        let (mut guest_rx, mut guest_tx) = tokio::io::split(guest_far);
        let out = frame(&Message::Stdout(b"bye".to_vec()));
        guest_tx.write_all(&out).await.unwrap();
        guest_tx.shutdown().await.unwrap();
        let mut got = vec![0u8; out.len()];
        caller.read_exact(&mut got).await.unwrap();
        assert_eq!(got, out);
        assert_eq!(
            caller.read(&mut [0u8; 8]).await.unwrap(),
            0,
            "the end reached the caller"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let late = frame(&Message::Stdin(b"late".to_vec()));
        caller.write_all(&late).await.unwrap();
        let mut heard = vec![0u8; late.len()];
        guest_rx.read_exact(&mut heard).await.unwrap();
        assert_eq!(heard, late);
        assert!(
            !task.is_finished(),
            "the relay ended with one side still open"
        );
        caller.shutdown().await.unwrap();
        assert_eq!(
            guest_rx.read(&mut [0u8; 8]).await.unwrap(),
            0,
            "the guest saw the end"
        );
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("the relay did not end once both sides had")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_caller_that_skips_the_hello_is_refused() {
        let (mut caller, guest, task) = start(Duration::from_secs(5));
        caller
            .write_all(&frame(&Message::Exec(ExecRequest::default())))
            .await
            .unwrap();
        let err = task.await.unwrap().unwrap_err();
        assert!(matches!(err, RelayError::NotHello("exec")), "{err}");
        assert!(
            read_all(guest).await.is_empty(),
            "nothing reached the guest"
        );
    }

    #[tokio::test]
    async fn an_oversize_frame_is_refused_before_it_is_read() {
        let (mut caller, guest, task) = start(Duration::from_secs(5));
        caller
            .write_all(&(MAX_FRAME_LEN + 1).to_be_bytes())
            .await
            .unwrap();
        let err = task.await.unwrap().unwrap_err();
        assert!(
            matches!(err, RelayError::Frame(FrameError::TooLarge { .. })),
            "{err}"
        );
        assert!(read_all(guest).await.is_empty());
    }

    #[tokio::test]
    async fn a_silent_caller_is_dropped_after_the_opening_timeout() {
        let (caller, _guest, task) = start(Duration::from_millis(100));
        let err = task.await.unwrap().unwrap_err();
        assert!(matches!(err, RelayError::Timeout(_)), "{err}");
        let seen = read_all(caller).await;
        assert!(matches!(&seen[0], Message::Error(e) if e.kind == ErrorKind::BadRequest));
    }

    #[tokio::test]
    async fn the_caller_hanging_up_hangs_up_on_the_guest() {
        let (mut caller, mut guest, task) = start(Duration::from_secs(5));
        caller
            .write_all(&frame(&Message::Hello(Hello::new("cli"))))
            .await
            .unwrap();
        guest
            .write_all(&frame(&Message::Hello(Hello::new("guest"))))
            .await
            .unwrap();
        // As a real caller does: the guest's hello first, then the exec.
        let hello_len = frame(&Message::Hello(Hello::new("guest"))).len();
        let mut hello = vec![0u8; hello_len];
        caller.read_exact(&mut hello).await.unwrap();
        caller
            .write_all(&frame(&Message::Exec(ExecRequest::default())))
            .await
            .unwrap();
        drop(caller);
        // The guest sees end of stream after the exec, then ends its side.
        let mut got = Vec::new();
        guest.read_to_end(&mut got).await.unwrap();
        let mut cursor = std::io::Cursor::new(got);
        assert!(matches!(
            read_sync(&mut cursor).unwrap(),
            Some(Message::Hello(_))
        ));
        assert!(matches!(
            read_sync(&mut cursor).unwrap(),
            Some(Message::Exec(_))
        ));
        drop(guest);
        let _ = task.await.unwrap();
    }

    /// A guest that streams output without end while the caller reads nothing: the relay holds
    /// no more than its copy buffer (the guest is held back), and when the caller hangs up the
    /// relay ends with an error instead of running on.
    #[tokio::test]
    async fn endless_guest_output_is_held_back_not_buffered_and_ends_with_the_caller() {
        let (mut caller, caller_near) = duplex(64 * 1024);
        let (guest_near, mut guest) = duplex(64 * 1024);
        let task = tokio::spawn(relay(caller_near, guest_near, Duration::from_secs(5)));
        caller
            .write_all(&frame(&Message::Hello(Hello::new("cli"))))
            .await
            .unwrap();
        guest
            .write_all(&frame(&Message::Hello(Hello::new("guest"))))
            .await
            .unwrap();
        caller
            .write_all(&frame(&Message::Exec(ExecRequest::default())))
            .await
            .unwrap();
        let chunk = frame(&Message::Stdout(vec![b'y'; 32 * 1024]));
        let flood = tokio::spawn(async move {
            let mut sent = 0usize;
            while sent < 256 << 20 {
                if guest.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            (sent, guest)
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !flood.is_finished(),
            "256 MiB went somewhere while nobody read"
        );
        drop(caller);
        let ended = tokio::time::timeout(Duration::from_secs(5), task).await;
        let err = ended.expect("the relay outlived its caller").unwrap();
        assert!(err.is_err(), "{err:?}");
        flood.abort();
    }
}
