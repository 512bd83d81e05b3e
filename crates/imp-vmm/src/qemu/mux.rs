//! The host end of [`imp_proto::mux`]: serves a QEMU guest's channel, carried over one
//! virtio-serial port, as the same hybrid-vsock Unix sockets Firecracker gives.
//!
//! The task speaks over its end of the socket pair whose other end is QEMU's chardev (QEMU
//! inherited it: the mux connects to no path) and listens on `vsock.sock`: a host client sends
//! `CONNECT <port>\n` and gets `OK <id>\n` once the guest accepted the stream (it is closed
//! instead while nothing listens in the guest, so [`super::super::vsock::connect`] retries),
//! and a guest stream to host port P is connected to `vsock.sock_P`
//! ([`super::super::vsock::host_listener_path`]).
//!
//! The guest is untrusted. Nothing it sends makes the host buffer without bound: a frame is at
//! most [`mux::MAX_PAYLOAD`] bytes and its header is checked before its payload is read; a
//! stream holds at most [`mux::WINDOW`] bytes for its local reader (more than its credit closes
//! the stream); at most [`mux::MAX_STREAMS`] streams exist; the frames queued for the guest
//! are bounded too ([`MAX_QUEUED`]): a guest that stops reading its port while it floods the
//! host with requests gets its channel reset. Each stream's local socket is served by tasks of
//! its own, so a stalled stream holds up no other. Anything unparsable resets the channel (every
//! stream is closed) and the task searches for the guest's next reset.
//!
//! The session starts with a reset, so after a restore (a new QEMU, a new pair and a new
//! task) the guest forgets the streams that were open at snapshot time and both sides start
//! afresh. The pair lives as long as its QEMU: when QEMU closes its end (it exited), the
//! session and the task end, and nothing is connected again.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use imp_proto::mux::{self, Frame, RecvWindow};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;

use crate::vsock::host_listener_path;

/// Most bytes of frames waiting to be written to the guest before the channel is reset: every
/// stream's full window plus room for control frames.
pub const MAX_QUEUED: usize = mux::MAX_STREAMS * mux::WINDOW as usize + (1 << 20);

/// How long a host client may take to send its `CONNECT` line, and the guest to dial.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the guest may leave a host stream's open unanswered before the host gives up on
/// it (and tells the guest to forget it), so a guest that never answers cannot hold every
/// stream slot.
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the host repeats its reset while the guest has not answered.
const RESET_EVERY: Duration = Duration::from_secs(1);

/// Longest `CONNECT <port>` line accepted.
const MAX_CONNECT_LINE: usize = 32;

/// Bytes the mux holds for one VM, for tests and logs.
#[derive(Debug, Default)]
pub struct Stats {
    /// Bytes from the guest not yet written to local sockets.
    pub buffered: AtomicUsize,
    /// Bytes of frames not yet written to the guest.
    pub queued: AtomicUsize,
    /// Streams open or being opened.
    pub streams: AtomicUsize,
    /// Channel resets after the guest broke the protocol.
    pub violations: AtomicUsize,
}

/// The running mux of one VM; dropping it ends every stream.
#[derive(Debug)]
pub struct HostMux {
    task: JoinHandle<()>,
    stats: Arc<Stats>,
}

impl Drop for HostMux {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HostMux {
    /// Listens on `uds` (replacing a stale socket) and serves the guest behind `port`, the
    /// host's end of the socket pair whose other end is QEMU's chardev, until QEMU closes it.
    /// Call from within a tokio runtime.
    pub fn spawn(
        vm: String,
        port: std::os::unix::net::UnixStream,
        uds: PathBuf,
    ) -> io::Result<Self> {
        Self::spawn_with(vm, port, uds, OPEN_TIMEOUT)
    }

    /// [`HostMux::spawn`] with another [`OPEN_TIMEOUT`] (tests).
    fn spawn_with(
        vm: String,
        port: std::os::unix::net::UnixStream,
        uds: PathBuf,
        open_timeout: Duration,
    ) -> io::Result<Self> {
        port.set_nonblocking(true)?;
        let port = UnixStream::from_std(port)?;
        match std::fs::remove_file(&uds) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = UnixListener::bind(&uds)?;
        let stats = Arc::new(Stats::default());
        let s = Arc::clone(&stats);
        let task = tokio::spawn(async move {
            let why = Session::new(&vm, &uds, s, open_timeout)
                .run(port, &listener)
                .await;
            // Its QEMU is gone (or closed the channel): there is nothing to connect to again,
            // and no path is ever tried instead.
            tracing::debug!(vm, why, "mux session ended; the guest channel is closed");
        });
        Ok(HostMux { task, stats })
    }

    /// What the mux holds now.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}

/// What the per-stream and helper tasks tell the session.
enum Event {
    /// A host client asked for guest `port`.
    Connect { port: u32, stream: UnixStream },
    /// The local connection for guest stream `id` was made, or not.
    Dialed {
        id: u32,
        serial: u64,
        result: io::Result<UnixStream>,
    },
    /// The local reader consumed `n` bytes of stream `id`.
    Consumed { id: u32, serial: u64, n: usize },
    /// Stream `id`'s local socket reached end of file.
    LocalEof { id: u32, serial: u64 },
    /// Stream `id`'s local socket failed or closed for writing.
    LocalGone { id: u32, serial: u64 },
}

/// Aborts its tasks when dropped.
#[derive(Debug, Default)]
struct Tasks(Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// A stream's two tasks: the writer to the local socket may be left to drain, the reader is
/// always ended with the stream.
#[derive(Debug)]
struct Pumps {
    writer: Option<JoinHandle<()>>,
    _reader: Tasks,
}

impl Drop for Pumps {
    fn drop(&mut self) {
        if let Some(w) = &self.writer {
            w.abort();
        }
    }
}

enum Phase {
    /// A host client's stream, waiting for the guest's accept since the instant.
    Opening(UnixStream, tokio::time::Instant),
    /// A guest stream, waiting for the local connection.
    Dialing,
    /// Data flows.
    Open {
        /// `None` once the guest sent end of file.
        to_local: Option<mpsc::UnboundedSender<Vec<u8>>>,
        credit: Arc<Semaphore>,
        pumps: Pumps,
    },
}

struct Stream {
    serial: u64,
    phase: Phase,
    recv: RecvWindow,
    /// Bytes from the guest not yet written to the local socket.
    held: usize,
}

/// One connection to the chardev.
struct Session<'a> {
    vm: &'a str,
    uds: &'a Path,
    stats: Arc<Stats>,
    streams: HashMap<u32, Stream>,
    next_id: u32,
    next_serial: u64,
    hunting: bool,
    open_timeout: Duration,
    out: mpsc::UnboundedSender<Vec<u8>>,
    out_rx: Option<mpsc::UnboundedReceiver<Vec<u8>>>,
    events: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.clear();
    }
}

impl<'a> Session<'a> {
    fn new(vm: &'a str, uds: &'a Path, stats: Arc<Stats>, open_timeout: Duration) -> Self {
        let (out, out_rx) = mpsc::unbounded_channel();
        let (events, events_rx) = mpsc::unbounded_channel();
        Session {
            vm,
            uds,
            stats,
            streams: HashMap::new(),
            next_id: 2,
            next_serial: 0,
            hunting: true,
            open_timeout,
            out,
            out_rx: Some(out_rx),
            events,
            events_rx,
        }
    }

    /// Serves until the chardev closes (QEMU exited) or the writer fails; says why.
    async fn run(mut self, port: UnixStream, listener: &UnixListener) -> String {
        let (mut rd, wr) = port.into_split();
        let Some(out_rx) = self.out_rx.take() else {
            return "session reused".into();
        };
        let _writer = Tasks(vec![tokio::spawn(write_port(
            wr,
            out_rx,
            Arc::clone(&self.stats),
        ))]);
        // A restored guest may hold part of the old host's last frame: the padding completes
        // it, so the guest reads our reset as one.
        self.send_bytes(vec![mux::PAD; mux::FLUSH_LEN]);
        self.send(&Frame::Reset { answer: false });
        let mut buf: Vec<u8> = Vec::with_capacity(mux::HEADER_LEN + mux::MAX_PAYLOAD);
        let mut chunk = vec![0u8; 64 * 1024];
        // The first repeat a period from now: one at once would reach a guest right behind
        // the first and end the streams it opened after answering that one.
        let mut resend =
            tokio::time::interval_at(tokio::time::Instant::now() + RESET_EVERY, RESET_EVERY);
        loop {
            tokio::select! {
                read = rd.read(&mut chunk) => match read {
                    Ok(0) => return "the guest port closed".into(),
                    Err(e) => return format!("reading the guest port: {e}"),
                    Ok(n) => {
                        buf.extend_from_slice(&chunk[..n]);
                        self.parse(&mut buf);
                    }
                },
                accepted = listener.accept() => {
                    if let Ok((stream, _)) = accepted {
                        tokio::spawn(read_connect(stream, self.events.clone()));
                    }
                }
                Some(event) = self.events_rx.recv() => self.on_event(event),
                _ = resend.tick() => {
                    if self.hunting {
                        self.send(&Frame::Reset { answer: false });
                    }
                    self.expire_opens();
                }
            }
            if self.stats.queued.load(Ordering::Relaxed) > MAX_QUEUED {
                self.violation("the guest does not read what it asks for");
                buf.clear();
            }
        }
    }

    /// Applies every complete frame in `buf`, searching for a reset first while hunting.
    fn parse(&mut self, buf: &mut Vec<u8>) {
        loop {
            if self.hunting {
                match mux::find_sync(buf) {
                    Some(at) => drop(buf.drain(..at)),
                    None => {
                        buf.clear();
                        return;
                    }
                }
            }
            match mux::decode(buf) {
                Ok(Some((frame, used))) => {
                    buf.drain(..used);
                    self.on_frame(frame);
                }
                Ok(None) => return,
                Err(e) => {
                    self.violation(&e.to_string());
                    buf.drain(..1);
                }
            }
        }
    }

    /// The guest broke the protocol: forget every stream and start over with a reset.
    fn violation(&mut self, why: &str) {
        self.stats.violations.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            vm = self.vm,
            why,
            "guest broke the mux protocol; resetting its channel"
        );
        self.clear();
        self.hunting = true;
        self.send(&Frame::Reset { answer: false });
    }

    fn clear(&mut self) {
        self.streams.clear();
        self.stats.streams.store(0, Ordering::Relaxed);
        self.stats.buffered.store(0, Ordering::Relaxed);
    }

    fn send(&self, frame: &Frame) {
        self.send_bytes(mux::encoded(frame));
    }

    fn send_bytes(&self, bytes: Vec<u8>) {
        self.stats.queued.fetch_add(bytes.len(), Ordering::Relaxed);
        let _ = self.out.send(bytes);
    }

    fn remove(&mut self, id: u32) {
        if let Some(s) = self.streams.remove(&id) {
            self.stats.buffered.fetch_sub(s.held, Ordering::Relaxed);
        }
        self.stats
            .streams
            .store(self.streams.len(), Ordering::Relaxed);
    }

    fn insert(&mut self, id: u32, phase: Phase) -> u64 {
        self.next_serial += 1;
        self.streams.insert(
            id,
            Stream {
                serial: self.next_serial,
                phase,
                recv: RecvWindow::default(),
                held: 0,
            },
        );
        self.stats
            .streams
            .store(self.streams.len(), Ordering::Relaxed);
        self.next_serial
    }

    fn on_frame(&mut self, frame: Frame) {
        match frame {
            Frame::Reset { answer } => {
                self.hunting = false;
                if !answer {
                    self.clear();
                    self.send(&Frame::Reset { answer: true });
                }
            }
            Frame::Open { id, port } => self.on_open(id, port),
            Frame::Accept { id } => self.on_accept(id),
            Frame::Refuse { id } => {
                if matches!(self.phase(id), Some(Phase::Opening(..))) {
                    self.remove(id); // the client sees its connection close and retries
                }
            }
            Frame::Data { id, data } => self.on_data(id, data),
            Frame::Eof { id } => {
                if let Some(Phase::Open { to_local, .. }) = self.phase_mut(id) {
                    // The writer drains what it has, then shuts the socket for writing.
                    *to_local = None;
                }
            }
            Frame::Close { id } => {
                // What the guest sent before its close still reaches the local socket.
                if let Some(Phase::Open { pumps, .. }) = self.phase_mut(id) {
                    drop(pumps.writer.take());
                }
                self.remove(id);
            }
            Frame::Credit { id, bytes } => {
                if let Some(Phase::Open { credit, .. }) = self.phase(id) {
                    // Never more than a few windows: a guest granting absurd credit gets nothing.
                    let room =
                        (4 * mux::WINDOW as usize).saturating_sub(credit.available_permits());
                    credit.add_permits((bytes as usize).min(room));
                }
            }
        }
    }

    /// Drops host streams whose open the guest left unanswered for [`OPEN_TIMEOUT`].
    fn expire_opens(&mut self) {
        let timeout = self.open_timeout;
        let stale: Vec<u32> = self
            .streams
            .iter()
            .filter(
                |(_, s)| matches!(&s.phase, Phase::Opening(_, since) if since.elapsed() > timeout),
            )
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            tracing::debug!(
                vm = self.vm,
                id,
                "the guest never answered an open; dropping it"
            );
            self.remove(id);
            self.send(&Frame::Close { id });
        }
    }

    fn phase(&self, id: u32) -> Option<&Phase> {
        self.streams.get(&id).map(|s| &s.phase)
    }

    fn phase_mut(&mut self, id: u32) -> Option<&mut Phase> {
        self.streams.get_mut(&id).map(|s| &mut s.phase)
    }

    fn on_open(&mut self, id: u32, port: u32) {
        if mux::opened_by_host(id)
            || self.streams.contains_key(&id)
            || self.streams.len() >= mux::MAX_STREAMS
        {
            self.send(&Frame::Refuse { id });
            return;
        }
        let serial = self.insert(id, Phase::Dialing);
        let path = host_listener_path(self.uds, port);
        let events = self.events.clone();
        tokio::spawn(async move {
            let result =
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, crate::uds::connect(&path)).await {
                    Ok(r) => r,
                    Err(_) => Err(io::ErrorKind::TimedOut.into()),
                };
            let _ = events.send(Event::Dialed { id, serial, result });
        });
    }

    fn on_accept(&mut self, id: u32) {
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        if !matches!(stream.phase, Phase::Opening(..)) {
            return;
        }
        let serial = stream.serial;
        let Phase::Opening(local, _) = std::mem::replace(&mut stream.phase, Phase::Dialing) else {
            return;
        };
        let ok = format!("OK {id}\n").into_bytes();
        let phase = self.pumps(id, serial, local, Some(ok));
        if let Some(s) = self.streams.get_mut(&id) {
            s.phase = phase;
        }
    }

    fn on_data(&mut self, id: u32, data: Vec<u8>) {
        let n = data.len();
        let Some(stream) = self.streams.get_mut(&id) else {
            return; // closed here already; the guest will see our close
        };
        let delivered = match &stream.phase {
            Phase::Open {
                to_local: Some(to_local),
                ..
            } if stream.recv.receive(n).is_ok() => to_local.send(data).is_ok(),
            _ => false,
        };
        if delivered {
            stream.held += n;
            self.stats.buffered.fetch_add(n, Ordering::Relaxed);
        } else {
            tracing::debug!(
                vm = self.vm,
                id,
                n,
                "guest data beyond credit or after eof; closing the stream"
            );
            self.remove(id);
            self.send(&Frame::Close { id });
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Connect { port, stream } => {
                if self.hunting || self.streams.len() >= mux::MAX_STREAMS {
                    return; // dropped: the client retries, as with a guest not listening
                }
                let id = self.next_id;
                self.next_id = self.next_id.wrapping_add(2) & !1;
                if self.streams.contains_key(&id) {
                    return;
                }
                self.insert(id, Phase::Opening(stream, tokio::time::Instant::now()));
                self.send(&Frame::Open { id, port });
            }
            Event::Dialed { id, serial, result } => {
                if self.serial(id) != Some(serial) {
                    return;
                }
                match result {
                    Ok(local) => {
                        let phase = self.pumps(id, serial, local, None);
                        if let Some(s) = self.streams.get_mut(&id) {
                            s.phase = phase;
                        }
                        self.send(&Frame::Accept { id });
                    }
                    Err(_) => {
                        self.remove(id);
                        self.send(&Frame::Refuse { id });
                    }
                }
            }
            Event::Consumed { id, serial, n } => {
                if self.serial(id) != Some(serial) {
                    return;
                }
                let Some(s) = self.streams.get_mut(&id) else {
                    return;
                };
                s.held = s.held.saturating_sub(n);
                self.stats.buffered.fetch_sub(n, Ordering::Relaxed);
                let credit = s.recv.consume(n);
                if let Some(bytes) = credit {
                    self.send(&Frame::Credit { id, bytes });
                }
            }
            Event::LocalEof { id, serial } => {
                if self.serial(id) == Some(serial) {
                    self.send(&Frame::Eof { id });
                }
            }
            Event::LocalGone { id, serial } => {
                if self.serial(id) == Some(serial) {
                    self.remove(id);
                    self.send(&Frame::Close { id });
                }
            }
        }
    }

    fn serial(&self, id: u32) -> Option<u64> {
        self.streams.get(&id).map(|s| s.serial)
    }

    /// Starts the two tasks that move stream `id`'s bytes, first writing `greeting` to the
    /// local socket (the `OK` line of a host client).
    fn pumps(&self, id: u32, serial: u64, local: UnixStream, greeting: Option<Vec<u8>>) -> Phase {
        let (rd, wr) = local.into_split();
        let (to_local, from_guest) = mpsc::unbounded_channel();
        let credit = Arc::new(Semaphore::new(mux::WINDOW as usize));
        let writer = tokio::spawn(to_local_socket(
            wr,
            from_guest,
            greeting,
            self.events.clone(),
            id,
            serial,
        ));
        let reader = Tasks(vec![tokio::spawn(from_local_socket(
            rd,
            Arc::clone(&credit),
            self.out.clone(),
            Arc::clone(&self.stats),
            self.events.clone(),
            id,
            serial,
        ))]);
        Phase::Open {
            to_local: Some(to_local),
            credit,
            pumps: Pumps {
                writer: Some(writer),
                _reader: reader,
            },
        }
    }
}

/// Writes queued frames to the guest's port.
async fn write_port(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    stats: Arc<Stats>,
) {
    while let Some(bytes) = rx.recv().await {
        let n = bytes.len();
        let written = wr.write_all(&bytes).await;
        stats.queued.fetch_sub(n, Ordering::Relaxed);
        if written.is_err() {
            return;
        }
    }
}

/// Reads a host client's `CONNECT <port>` line and hands the stream to the session.
async fn read_connect(mut stream: UnixStream, events: mpsc::UnboundedSender<Event>) {
    let line = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let mut line = Vec::with_capacity(16);
        loop {
            let mut byte = [0u8; 1];
            if stream.read(&mut byte).await.ok()? == 0 || line.len() > MAX_CONNECT_LINE {
                return None;
            }
            if byte[0] == b'\n' {
                return String::from_utf8(line).ok();
            }
            line.push(byte[0]);
        }
    })
    .await;
    if let Some(port) = line.ok().flatten().as_deref().and_then(parse_connect) {
        let _ = events.send(Event::Connect { port, stream });
    }
}

/// The port of a `CONNECT <port>` line.
fn parse_connect(line: &str) -> Option<u32> {
    line.strip_prefix("CONNECT ")?.trim().parse().ok()
}

/// Copies the guest's bytes for stream `id` to its local socket, reporting what was consumed.
async fn to_local_socket(
    mut wr: OwnedWriteHalf,
    mut from_guest: mpsc::UnboundedReceiver<Vec<u8>>,
    greeting: Option<Vec<u8>>,
    events: mpsc::UnboundedSender<Event>,
    id: u32,
    serial: u64,
) {
    if let Some(g) = greeting
        && wr.write_all(&g).await.is_err()
    {
        let _ = events.send(Event::LocalGone { id, serial });
        return;
    }
    while let Some(data) = from_guest.recv().await {
        if wr.write_all(&data).await.is_err() {
            let _ = events.send(Event::LocalGone { id, serial });
            return;
        }
        let _ = events.send(Event::Consumed {
            id,
            serial,
            n: data.len(),
        });
    }
    // The guest sent end of file: pass it on.
    let _ = wr.shutdown().await;
}

/// Copies stream `id`'s local bytes to the guest within the guest's credit.
async fn from_local_socket(
    mut rd: OwnedReadHalf,
    credit: Arc<Semaphore>,
    out: mpsc::UnboundedSender<Vec<u8>>,
    stats: Arc<Stats>,
    events: mpsc::UnboundedSender<Event>,
    id: u32,
    serial: u64,
) {
    let mut buf = vec![0u8; mux::MAX_PAYLOAD];
    loop {
        // Wait until the guest granted at least one byte.
        match credit.acquire().await {
            Ok(p) => drop(p),
            Err(_) => return,
        }
        let room = credit.available_permits().min(mux::MAX_PAYLOAD);
        let n = match rd.read(&mut buf[..room]).await {
            Ok(0) | Err(_) => {
                let _ = events.send(Event::LocalEof { id, serial });
                return;
            }
            Ok(n) => n,
        };
        match credit.try_acquire_many(n as u32) {
            Ok(p) => p.forget(),
            Err(_) => return,
        }
        let frame = mux::encoded(&Frame::Data {
            id,
            data: buf[..n].to_vec(),
        });
        stats.queued.fetch_add(frame.len(), Ordering::Relaxed);
        if out.send(frame).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::vsock;
    use std::time::Instant;

    use crate::scratch::Scratch;

    /// A fake guest on the chardev: reads and writes raw frames.
    struct Guest {
        port: UnixStream,
        buf: Vec<u8>,
    }

    impl Guest {
        async fn send(&mut self, f: &Frame) {
            self.port.write_all(&mux::encoded(f)).await.unwrap();
        }

        async fn recv(&mut self) -> Frame {
            loop {
                let pads = mux::padding(&self.buf);
                self.buf.drain(..pads);
                if let Some(at) = mux::find_sync(&self.buf).filter(|_| self.buf[0] == 0xff) {
                    self.buf.drain(..at);
                }
                if let Some((f, used)) = mux::decode(&self.buf).unwrap() {
                    self.buf.drain(..used);
                    return f;
                }
                let mut chunk = [0u8; 4096];
                let n = tokio::time::timeout(Duration::from_secs(5), self.port.read(&mut chunk))
                    .await
                    .expect("the host sent nothing for 5 s")
                    .unwrap();
                assert!(n > 0, "the host closed the port");
                self.buf.extend_from_slice(&chunk[..n]);
            }
        }

        /// The next frame that is not a credit or a repeated reset.
        async fn recv_main(&mut self) -> Frame {
            loop {
                match self.recv().await {
                    Frame::Credit { .. } | Frame::Reset { answer: false } => {}
                    f => return f,
                }
            }
        }
    }

    /// A host mux whose chardev the test serves as the guest, past the handshake.
    async fn setup(dir: &Path) -> (HostMux, Guest, PathBuf) {
        let (host, mut guest, uds) = connected(dir, Vec::new()).await;
        assert_eq!(guest.recv().await, Frame::Reset { answer: false });
        guest.send(&Frame::Reset { answer: true }).await;
        (host, guest, uds)
    }

    /// A host mux whose chardev the test serves as a guest that holds `held` from before
    /// (bytes of an earlier host), as the mux connects.
    async fn connected(dir: &Path, held: Vec<u8>) -> (HostMux, Guest, PathBuf) {
        let uds = dir.join("vsock.sock");
        let (ours, qemu) = std::os::unix::net::UnixStream::pair().unwrap();
        let host = HostMux::spawn("test".into(), ours, uds.clone()).unwrap();
        (
            host,
            Guest {
                port: guest_end(qemu),
                buf: held,
            },
            uds,
        )
    }

    /// QEMU's end of the pair, as the fake guest uses it.
    fn guest_end(qemu: std::os::unix::net::UnixStream) -> UnixStream {
        qemu.set_nonblocking(true).unwrap();
        UnixStream::from_std(qemu).unwrap()
    }

    /// A host client's stream to guest port 10000, accepted by the fake guest as `id`.
    async fn open(guest: &mut Guest, uds: &Path) -> (UnixStream, u32) {
        let connect = tokio::spawn({
            let uds = uds.to_path_buf();
            async move { vsock::connect(&uds, 10000, Duration::from_secs(5)).await }
        });
        let id = match guest.recv_main().await {
            Frame::Open { id, port: 10000 } => id,
            other => panic!("expected an open, got {other:?}"),
        };
        guest.send(&Frame::Accept { id }).await;
        (connect.await.unwrap().unwrap(), id)
    }

    /// A guest restored from a snapshot taken while it held part of the old host's frame (here
    /// the header of a full-size data frame and a few bytes of it) reads the new host's reset as
    /// a reset: the padding in front of it completes that frame, so the reset is not taken for
    /// the rest of its payload (the host would hunt, and refuse every client, for minutes).
    #[tokio::test]
    async fn a_guest_restored_mid_frame_finds_the_new_hosts_reset() {
        let dir = Scratch::new("mux", "midframe");
        let mut held = mux::encoded(&Frame::Data {
            id: 2,
            data: vec![b'x'; mux::MAX_PAYLOAD],
        });
        held.truncate(mux::HEADER_LEN + 5);
        let (_host, mut guest, _) = connected(&dir.0, held).await;
        // Without the padding the host's resets (9 bytes a second) would fill the held frame
        // only after an hour.
        let first_two = tokio::time::timeout(Duration::from_secs(30), async {
            (guest.recv().await, guest.recv().await)
        })
        .await
        .expect("the guest was still in the held frame after 30 s");
        assert_eq!(
            first_two,
            (
                Frame::Data {
                    id: 2,
                    data: [vec![b'x'; 5], vec![0; mux::MAX_PAYLOAD - 5]].concat()
                },
                Frame::Reset { answer: false }
            ),
            "the padding completes the held frame, then the reset follows"
        );
    }

    #[tokio::test]
    async fn host_and_guest_streams_carry_bytes_both_ways() {
        let dir = Scratch::new("mux", "both");
        let (_host, mut guest, uds) = setup(&dir.0).await;
        let (mut client, id) = open(&mut guest, &uds).await;
        client.write_all(b"ping").await.unwrap();
        assert_eq!(
            guest.recv_main().await,
            Frame::Data {
                id,
                data: b"ping".to_vec()
            }
        );
        guest
            .send(&Frame::Data {
                id,
                data: b"pong".to_vec(),
            })
            .await;
        let mut got = [0u8; 4];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        // A guest stream to host port 1024 reaches vsock.sock_1024.
        let listener = UnixListener::bind(host_listener_path(&uds, 1024)).unwrap();
        guest.send(&Frame::Open { id: 1, port: 1024 }).await;
        let (mut served, _) = listener.accept().await.unwrap();
        assert_eq!(guest.recv_main().await, Frame::Accept { id: 1 });
        guest
            .send(&Frame::Data {
                id: 1,
                data: b"exit".to_vec(),
            })
            .await;
        served.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"exit");
        // Nothing on port 9: refused.
        guest.send(&Frame::Open { id: 3, port: 9 }).await;
        assert_eq!(guest.recv_main().await, Frame::Refuse { id: 3 });
        // Data right before the guest's close still reaches the client, then end of file.
        let big = vec![b'z'; mux::MAX_PAYLOAD];
        guest
            .send(&Frame::Data {
                id,
                data: big.clone(),
            })
            .await;
        guest
            .send(&Frame::Data {
                id,
                data: b"last".to_vec(),
            })
            .await;
        guest.send(&Frame::Close { id }).await;
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest.len(), big.len() + 4);
        assert!(rest.ends_with(b"last"));
        // A client's close reaches the guest as end of file.
        let (client, id) = open(&mut guest, &uds).await;
        drop(client);
        assert_eq!(guest.recv_main().await, Frame::Eof { id });
    }

    /// A hostile guest: oversized frames, unknown streams, data beyond its credit and a
    /// never-ending stream nobody reads. The host's buffers stay within their bounds and
    /// another stream keeps flowing.
    #[tokio::test]
    async fn a_hostile_guest_neither_grows_the_host_nor_blocks_other_streams() {
        let dir = Scratch::new("mux", "hostile");
        let (host, mut guest, uds) = setup(&dir.0).await;
        // Unknown stream ids are ignored.
        for id in [1000, 1001, u32::MAX] {
            guest
                .send(&Frame::Data {
                    id,
                    data: vec![0; 100],
                })
                .await;
            guest
                .send(&Frame::Credit {
                    id,
                    bytes: u32::MAX,
                })
                .await;
            guest.send(&Frame::Accept { id }).await;
        }
        // A stream whose local client never reads, flooded with no regard for credit: once
        // the client's socket buffer is full and the window spent, the stream is closed.
        let (_stalled, stalled_id) = open(&mut guest, &uds).await;
        let chunk = vec![b'x'; mux::MAX_PAYLOAD];
        for _ in 0..64 {
            guest
                .send(&Frame::Data {
                    id: stalled_id,
                    data: chunk.clone(),
                })
                .await;
            let buffered = host.stats().buffered.load(Ordering::Relaxed);
            assert!(
                buffered <= mux::WINDOW as usize,
                "{buffered} bytes buffered"
            );
        }
        assert_eq!(guest.recv_main().await, Frame::Close { id: stalled_id });
        // Another stream still flows both ways, with a round trip timed.
        let (mut client, id) = open(&mut guest, &uds).await;
        let started = Instant::now();
        for _ in 0..100 {
            client.write_all(b"x").await.unwrap();
            let Frame::Data { data, .. } = guest.recv_main().await else {
                panic!("expected data")
            };
            guest.send(&Frame::Data { id, data }).await;
            let mut b = [0u8; 1];
            client.read_exact(&mut b).await.unwrap();
        }
        eprintln!(
            "mux round trip (host client -> fake guest -> host client): {:?}",
            started.elapsed() / 100
        );
        let buffered = host.stats().buffered.load(Ordering::Relaxed);
        assert!(
            buffered <= mux::WINDOW as usize,
            "{buffered} bytes buffered"
        );
        // An oversized frame resets the channel: no stream survives, nothing is buffered,
        // and the host searches for the guest's reset.
        let mut huge = vec![4u8];
        huge.extend_from_slice(&id.to_be_bytes());
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        guest.port.write_all(&huge).await.unwrap();
        guest.port.write_all(&vec![0u8; 1 << 20]).await.unwrap();
        while guest.recv().await != (Frame::Reset { answer: false }) {}
        let mut b = [0u8; 1];
        assert_eq!(
            client.read(&mut b).await.unwrap(),
            0,
            "the stream survived a reset"
        );
        assert_eq!(host.stats().streams.load(Ordering::Relaxed), 0);
        assert_eq!(host.stats().buffered.load(Ordering::Relaxed), 0);
        assert!(host.stats().violations.load(Ordering::Relaxed) >= 1);
        // After the guest's reset the channel works again.
        guest.send(&Frame::Reset { answer: true }).await;
        let (mut client, id) = open(&mut guest, &uds).await;
        guest
            .send(&Frame::Data {
                id,
                data: b"ok".to_vec(),
            })
            .await;
        let mut got = [0u8; 2];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ok");
        // Too many streams to a host listener that never reads: the excess is refused.
        let _listener = UnixListener::bind(host_listener_path(&uds, 4242)).unwrap();
        let extra = 10;
        for i in 0..(mux::MAX_STREAMS as u32 + extra) {
            guest
                .send(&Frame::Open {
                    id: 2 * i + 101,
                    port: 4242,
                })
                .await;
        }
        let mut refused = 0;
        while refused < extra {
            if let Frame::Refuse { .. } = guest.recv_main().await {
                refused += 1;
            }
        }
        assert!(host.stats().streams.load(Ordering::Relaxed) <= mux::MAX_STREAMS);
    }

    /// A guest that never answers an open loses it: the host closes the client's connection
    /// and tells the guest to forget the stream.
    #[tokio::test]
    async fn an_unanswered_open_expires() {
        let dir = Scratch::new("mux", "expire");
        let uds = dir.0.join("vsock.sock");
        let (ours, qemu) = std::os::unix::net::UnixStream::pair().unwrap();
        let _host =
            HostMux::spawn_with("test".into(), ours, uds.clone(), Duration::from_millis(200))
                .unwrap();
        let mut guest = Guest {
            port: guest_end(qemu),
            buf: Vec::new(),
        };
        assert_eq!(guest.recv().await, Frame::Reset { answer: false });
        guest.send(&Frame::Reset { answer: true }).await;
        let mut client = loop {
            let mut c = UnixStream::connect(&uds).await.unwrap();
            c.write_all(b"CONNECT 10000\n").await.unwrap();
            // Dropped while the host still searches for our reset: try again.
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(300), c.read(&mut b)).await {
                Ok(Ok(0)) => continue,
                Ok(other) => panic!("unexpected {other:?}"),
                Err(_) => break c,
            }
        };
        let id = match guest.recv_main().await {
            Frame::Open { id, .. } => id,
            other => panic!("expected an open, got {other:?}"),
        };
        assert_eq!(guest.recv_main().await, Frame::Close { id });
        let mut b = [0u8; 1];
        assert_eq!(client.read(&mut b).await.unwrap(), 0);
    }

    #[test]
    fn connect_lines_are_parsed_strictly() {
        assert_eq!(parse_connect("CONNECT 10000"), Some(10000));
        assert_eq!(parse_connect("CONNECT x"), None);
        assert_eq!(parse_connect("OPEN 1"), None);
    }
}
