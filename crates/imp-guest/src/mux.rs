//! The guest end of [`imp_proto::mux`]: vsock-like listeners and connections carried over one
//! virtio-serial port (`imp.mux`), for VMMs whose vsock cannot be snapshotted (QEMU).
//!
//! One reader thread parses the port and updates the streams' shared state; every stream's
//! reads and writes wait on one condition variable. Writes to the port are whole frames under
//! a lock. While the host end is not connected the port reads end of file (the reader polls)
//! and writes block until it connects. A reset from the host (a new host mux, e.g. after a
//! snapshot was restored into a new QEMU) ends every stream: their reads and writes fail with
//! `ConnectionReset`, listeners keep listening and new streams work at once.

use crate::transport::{Connection, Listener};
use imp_proto::mux::{self, Frame, RecvWindow, SendCredit};
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// The name of the virtio-serial port the host serves the mux on.
pub const PORT_NAME: &str = "imp.mux";

/// Connections a listener queues before it refuses more.
const BACKLOG: usize = 16;

/// How long [`Mux::connect`] waits for the host's answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the reader waits before reading again while no host is connected.
const NO_HOST_POLL: Duration = Duration::from_millis(100);

/// The device of the virtio port named `name`, found through `sysfs` (e.g. `/sys/class`) and
/// `dev` (`/dev`); waits up to `wait` for the port to get its name from the host.
pub fn find_port(sysfs: &Path, dev: &Path, name: &str, wait: Duration) -> Option<PathBuf> {
    let dir = sysfs.join("virtio-ports");
    let deadline = Instant::now() + wait;
    loop {
        let entries = std::fs::read_dir(&dir).ok()?;
        let mut any = false;
        for e in entries.flatten() {
            any = true;
            let named = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
            if named.trim_end() == name {
                return Some(dev.join(e.file_name()));
            }
        }
        // No virtio port at all: not a VM with a mux (Firecracker).
        if !any || Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Where a stream is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// We sent an open and await the answer.
    Opening,
    /// Data flows.
    Open,
    /// The host refused our open.
    Refused,
}

#[derive(Debug)]
struct Stream {
    phase: Phase,
    rx: VecDeque<u8>,
    rx_eof: bool,
    recv: RecvWindow,
    send: SendCredit,
}

impl Stream {
    fn new(phase: Phase) -> Self {
        Stream {
            phase,
            rx: VecDeque::new(),
            rx_eof: false,
            recv: RecvWindow::default(),
            send: SendCredit::default(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Bumped by every reset, so a handle from before one never touches a reused id.
    epoch: u64,
    next_id: u32,
    streams: HashMap<u32, Stream>,
    /// Port → host streams accepted and not yet taken by the listener.
    listeners: HashMap<u32, VecDeque<u32>>,
}

/// The port's write side. The guest's own reset is the first frame it ever writes, whichever
/// thread writes first: a host that already holds streams from before this guest started must
/// forget them, and a reset of ours that went out after an answer or an accept would make the
/// host forget streams we have taken since (their clients would see them close unanswered).
#[derive(Debug)]
struct PortWriter {
    port: File,
    greeted: bool,
}

impl PortWriter {
    /// Writes our reset unless it went out already.
    fn greet(&mut self) -> io::Result<()> {
        if !self.greeted {
            self.port
                .write_all(&mux::encoded(&Frame::Reset { answer: false }))?;
            self.greeted = true;
        }
        Ok(())
    }

    /// Writes `frame`, after our reset.
    fn write(&mut self, frame: &Frame) -> io::Result<()> {
        self.greet()?;
        self.port.write_all(&mux::encoded(frame))
    }
}

#[derive(Debug)]
struct Shared {
    writer: Mutex<PortWriter>,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn writer(&self) -> MutexGuard<'_, PortWriter> {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn send(&self, frame: &Frame) -> io::Result<()> {
        self.writer().write(frame)
    }

    /// Sends a frame of a stream of `epoch` unless a reset has ended that epoch. The check and
    /// the write are one step under the writer's lock, which a reset also holds while it ends
    /// the epoch and answers ([`answer_in_order`]): no frame of an ended epoch follows the
    /// answer, where the host would take it for one of its new stream with the same id.
    fn send_in(&self, epoch: u64, frame: &Frame) -> io::Result<()> {
        let mut writer = self.writer();
        if self.lock().epoch != epoch {
            return Err(reset_error());
        }
        writer.write(frame)
    }

    /// Sends `frame`, logging a failure.
    fn send_or_log(&self, frame: &Frame) {
        log_failed_write(self.send(frame));
    }
}

/// The mux over one port; cheap to clone.
#[derive(Debug, Clone)]
pub struct Mux {
    shared: Arc<Shared>,
}

impl Mux {
    /// Opens the port at `path`, announces a reset and starts the reader thread.
    pub fn open(path: &Path) -> io::Result<Self> {
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let writer = reader.try_clone()?;
        let mux = Self::over(reader, writer)?;
        Ok(mux)
    }

    /// The mux over any pair of read and write handles of one byte stream (tests use a
    /// socket pair).
    pub fn over(reader: File, writer: File) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            writer: Mutex::new(PortWriter {
                port: writer,
                greeted: false,
            }),
            state: Mutex::new(State {
                next_id: 1,
                ..State::default()
            }),
            changed: Condvar::new(),
        });
        let for_reader = Arc::clone(&shared);
        thread::Builder::new()
            .name("mux".into())
            .spawn(move || read_loop(reader, &for_reader))?;
        // Tell a host that is already there to forget whatever it had (it answers). The write
        // blocks until a host connects, hence the thread; if the reader answers first, its
        // write sends the reset before the answer.
        let s = Arc::clone(&shared);
        thread::Builder::new()
            .name("mux-hello".into())
            .spawn(move || log_failed_write(s.writer().greet()))?;
        Ok(Mux { shared })
    }

    /// Listens for host streams to `port`.
    pub fn listen(&self, port: u32) -> MuxListener {
        self.shared.lock().listeners.entry(port).or_default();
        MuxListener {
            shared: Arc::clone(&self.shared),
            port,
        }
    }

    /// Opens a stream to host `port`; `ConnectionRefused` when the host has no listener there
    /// and `TimedOut` when no host answers.
    pub fn connect(&self, port: u32) -> io::Result<MuxStream> {
        let (id, epoch) = {
            let mut st = self.shared.lock();
            if st.streams.len() >= mux::MAX_STREAMS {
                return Err(io::Error::other("too many mux streams"));
            }
            let id = st.next_id;
            st.next_id = st.next_id.wrapping_add(2) | 1;
            st.streams.insert(id, Stream::new(Phase::Opening));
            (id, st.epoch)
        };
        let stream = MuxStream::new(Arc::clone(&self.shared), id, epoch);
        self.shared.send_in(epoch, &Frame::Open { id, port })?;
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let mut st = self.shared.lock();
        loop {
            match st.streams.get(&id).map(|s| s.phase) {
                _ if st.epoch != epoch => return Err(reset_error()),
                Some(Phase::Open) => return Ok(stream),
                Some(Phase::Refused) | None => {
                    st.streams.remove(&id);
                    return Err(io::ErrorKind::ConnectionRefused.into());
                }
                Some(Phase::Opening) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            st = wait(&self.shared, st, Some(left));
        }
    }
}

fn wait<'a>(
    shared: &'a Shared,
    guard: MutexGuard<'a, State>,
    timeout: Option<Duration>,
) -> MutexGuard<'a, State> {
    match timeout {
        Some(t) => {
            shared
                .changed
                .wait_timeout(guard, t)
                .unwrap_or_else(PoisonError::into_inner)
                .0
        }
        None => shared
            .changed
            .wait(guard)
            .unwrap_or_else(PoisonError::into_inner),
    }
}

/// Logs a failed write to the port (the reader notices a dead port on its own).
fn log_failed_write(written: io::Result<()>) {
    if let Err(e) = written {
        eprintln!("imp-guest: writing to the mux port failed: {e}");
    }
}

fn reset_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        "the host reset the mux (restored snapshot or new host)",
    )
}

/// Reads the port forever, applying frames; resynchronises on garbage.
fn read_loop(mut port: File, shared: &Shared) {
    let mut buf: Vec<u8> = Vec::with_capacity(mux::HEADER_LEN + mux::MAX_PAYLOAD);
    let mut chunk = vec![0u8; 64 * 1024];
    let mut hunting = true;
    loop {
        let n = match port.read(&mut chunk) {
            Ok(0) => {
                // No host on the other end yet (or any more): what it left unfinished is
                // dropped, and the next one resets when it connects.
                buf.clear();
                hunting = true;
                thread::sleep(NO_HOST_POLL);
                continue;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("imp-guest: reading the mux port failed: {e}");
                thread::sleep(NO_HOST_POLL);
                continue;
            }
        };
        buf.extend_from_slice(&chunk[..n]);
        loop {
            if hunting {
                match mux::find_sync(&buf) {
                    Some(at) => drop(buf.drain(..at)),
                    None => {
                        buf.clear();
                        break;
                    }
                }
            } else {
                buf.drain(..mux::padding(&buf));
            }
            match mux::decode(&buf) {
                Ok(Some((frame, used))) => {
                    buf.drain(..used);
                    hunting = false;
                    apply(shared, frame);
                }
                Ok(None) => break,
                Err(e) => {
                    eprintln!("imp-guest: mux resynchronising after a bad frame: {e}");
                    buf.drain(..1);
                    hunting = true;
                }
            }
        }
    }
}

/// Applies one frame from the host; replies go out after the state lock is released.
fn apply(shared: &Shared, frame: Frame) {
    if matches!(frame, Frame::Open { .. } | Frame::Reset { answer: false }) {
        return answer_in_order(shared, frame);
    }
    let reply = {
        let mut st = shared.lock();
        let reply = update(&mut st, frame);
        shared.changed.notify_all();
        reply
    };
    if let Some(reply) = reply {
        shared.send_or_log(&reply);
    }
}

/// Applies a host's Open or reset and answers it under the writer's lock, so that nothing
/// another thread writes comes between the change and its answer: the server of an accepted
/// stream may speak at once (the guest agent sends its hello), and the host drops data for a
/// stream it still sees opening, so no byte of the stream may go out before its Accept; and
/// every frame of the streams a reset ends goes out before its answer or not at all
/// ([`Shared::send_in`]).
fn answer_in_order(shared: &Shared, frame: Frame) {
    let mut writer = shared.writer();
    let reply = update(&mut shared.lock(), frame);
    if let Some(reply) = reply {
        log_failed_write(writer.write(&reply));
    }
    drop(writer);
    shared.changed.notify_all();
}

/// The state change a frame makes, and the answer it needs.
fn update(st: &mut State, frame: Frame) -> Option<Frame> {
    match frame {
        // An answer to our own reset changes nothing: we had nothing open when we sent it,
        // and whatever we opened since reached the host after its reset.
        Frame::Reset { answer: true } => None,
        Frame::Reset { answer: false } => {
            st.epoch += 1;
            st.streams.clear();
            for queue in st.listeners.values_mut() {
                queue.clear();
            }
            Some(Frame::Reset { answer: true })
        }
        Frame::Open { id, port } => {
            let free = st.streams.len() < mux::MAX_STREAMS && !st.streams.contains_key(&id);
            let queue = st
                .listeners
                .get_mut(&port)
                .filter(|q| q.len() < BACKLOG && free && mux::opened_by_host(id));
            match queue {
                Some(q) => {
                    q.push_back(id);
                    st.streams.insert(id, Stream::new(Phase::Open));
                    Some(Frame::Accept { id })
                }
                None => Some(Frame::Refuse { id }),
            }
        }
        Frame::Accept { id } => {
            if let Some(s) = st
                .streams
                .get_mut(&id)
                .filter(|s| s.phase == Phase::Opening)
            {
                s.phase = Phase::Open;
            }
            None
        }
        Frame::Refuse { id } => {
            if let Some(s) = st
                .streams
                .get_mut(&id)
                .filter(|s| s.phase == Phase::Opening)
            {
                s.phase = Phase::Refused;
            }
            None
        }
        Frame::Data { id, data } => {
            let s = st.streams.get_mut(&id)?;
            if s.recv.receive(data.len()).is_err() || s.rx_eof {
                st.streams.remove(&id);
                return Some(Frame::Close { id });
            }
            s.rx.extend(data);
            None
        }
        Frame::Eof { id } => {
            if let Some(s) = st.streams.get_mut(&id) {
                s.rx_eof = true;
            }
            None
        }
        Frame::Close { id } => {
            st.streams.remove(&id);
            None
        }
        Frame::Credit { id, bytes } => {
            if let Some(s) = st.streams.get_mut(&id) {
                s.send.grant(bytes);
            }
            None
        }
    }
}

/// Listens for host streams to one port.
#[derive(Debug)]
pub struct MuxListener {
    shared: Arc<Shared>,
    port: u32,
}

impl Listener for MuxListener {
    type Conn = MuxStream;

    fn accept(&self) -> io::Result<MuxStream> {
        let mut st = self.shared.lock();
        loop {
            let epoch = st.epoch;
            let next = st.listeners.get_mut(&self.port).and_then(|q| q.pop_front());
            if let Some(id) = next {
                drop(st);
                return Ok(MuxStream::new(Arc::clone(&self.shared), id, epoch));
            }
            st = wait(&self.shared, st, None);
        }
    }
}

/// What every clone of one stream shares; the last one gone closes the stream.
#[derive(Debug)]
struct Handle {
    shared: Arc<Shared>,
    id: u32,
    epoch: u64,
    read_timeout: Mutex<Option<Duration>>,
}

impl Handle {
    /// Forgets the stream and tells the host, unless it is already gone.
    fn close(&self) {
        // The writer's lock first, as in `Shared::send_in`: the check, the removal and the
        // close go out together, or a reset comes first and there is nothing to close.
        let mut writer = self.shared.writer();
        let known = {
            let mut st = self.shared.lock();
            let known = st.epoch == self.epoch && st.streams.remove(&self.id).is_some();
            self.shared.changed.notify_all();
            known
        };
        if known {
            log_failed_write(writer.write(&Frame::Close { id: self.id }));
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.close();
    }
}

/// One stream over the mux: a [`Connection`] like a vsock stream.
#[derive(Debug)]
pub struct MuxStream(Arc<Handle>);

impl MuxStream {
    fn new(shared: Arc<Shared>, id: u32, epoch: u64) -> Self {
        MuxStream(Arc::new(Handle {
            shared,
            id,
            epoch,
            read_timeout: Mutex::new(None),
        }))
    }
}

impl Read for MuxStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let h = &self.0;
        let timeout = *h
            .read_timeout
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = h.shared.lock();
        loop {
            if st.epoch != h.epoch {
                return Err(reset_error());
            }
            let Some(s) = st.streams.get_mut(&h.id) else {
                return Ok(0); // closed by the host: end of file
            };
            if !s.rx.is_empty() {
                let n = buf.len().min(s.rx.len());
                for (dst, src) in buf.iter_mut().zip(s.rx.drain(..n)) {
                    *dst = src;
                }
                let credit = s.recv.consume(n);
                drop(st);
                if let Some(bytes) = credit {
                    h.shared
                        .send_in(h.epoch, &Frame::Credit { id: h.id, bytes })?;
                }
                return Ok(n);
            }
            if s.rx_eof || buf.is_empty() {
                return Ok(0);
            }
            let left = match deadline {
                Some(d) => match d.saturating_duration_since(Instant::now()) {
                    left if left.is_zero() => return Err(io::ErrorKind::WouldBlock.into()),
                    left => Some(left),
                },
                None => None,
            };
            st = wait(&h.shared, st, left);
        }
    }
}

impl Write for MuxStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let h = &self.0;
        if buf.is_empty() {
            return Ok(0);
        }
        let mut st = h.shared.lock();
        loop {
            if st.epoch != h.epoch {
                return Err(reset_error());
            }
            let Some(s) = st.streams.get_mut(&h.id) else {
                return Err(io::ErrorKind::BrokenPipe.into());
            };
            let n = s.send.take(buf.len());
            if n > 0 {
                drop(st);
                h.shared.send_in(
                    h.epoch,
                    &Frame::Data {
                        id: h.id,
                        data: buf[..n].to_vec(),
                    },
                )?;
                return Ok(n);
            }
            st = wait(&h.shared, st, None);
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Connection for MuxStream {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(MuxStream(Arc::clone(&self.0)))
    }

    fn shutdown(&self) -> io::Result<()> {
        self.0.close();
        Ok(())
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        *self
            .0
            .read_timeout
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = timeout;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::net::UnixStream;

    /// A guest mux over a socket pair whose host end has already sent `sent`, and that end.
    fn started_after(sent: &[Frame]) -> (Mux, UnixStream) {
        let (guest, mut host) = UnixStream::pair().unwrap();
        for frame in sent {
            send(&mut host, frame);
        }
        let reader = File::from(std::os::fd::OwnedFd::from(guest));
        let writer = reader.try_clone().unwrap();
        (Mux::over(reader, writer).unwrap(), host)
    }

    /// A guest mux over a socket pair, and the host's end of it, past the first reset.
    fn pair() -> (Mux, UnixStream) {
        let (mux, mut host) = started_after(&[]);
        let mut hello = [0u8; mux::RESET_LEN];
        host.read_exact(&mut hello).unwrap();
        assert_eq!(
            mux::decode(&hello).unwrap().unwrap().0,
            Frame::Reset { answer: false }
        );
        (mux, host)
    }

    fn send(host: &mut UnixStream, f: &Frame) {
        host.write_all(&mux::encoded(f)).unwrap();
    }

    fn recv(host: &mut UnixStream) -> Frame {
        let mut buf = Vec::new();
        loop {
            if let Some((f, _)) = mux::decode(&buf).unwrap() {
                return f;
            }
            let mut b = [0u8; 1];
            host.read_exact(&mut b).unwrap();
            buf.push(b[0]);
        }
    }

    /// A host already connected when the guest's mux starts (a guest booting under a waiting
    /// host mux) gets the guest's reset before anything else, even when the reader answers the
    /// host's reset at once: a reset of the guest's arriving after its accept would make the
    /// host drop a stream the guest agent already took.
    #[test]
    fn the_guests_reset_goes_out_before_its_first_answer() {
        for round in 0..200 {
            let (_mux, mut host) = started_after(&[Frame::Reset { answer: false }]);
            assert_eq!(
                recv(&mut host),
                Frame::Reset { answer: false },
                "round {round}"
            );
            assert_eq!(
                recv(&mut host),
                Frame::Reset { answer: true },
                "round {round}"
            );
        }
    }

    /// A guest restored from a snapshot holding part of the old host's frame: the new host's
    /// padding completes that frame and is skipped, and its reset is answered; a listener's
    /// stream of the old host ends, and the new host's streams are accepted.
    #[test]
    fn a_new_hosts_padding_and_reset_reach_a_guest_paused_mid_frame() {
        let (mux, mut host) = pair();
        let listener = mux.listen(10000);
        send(&mut host, &Frame::Reset { answer: true });
        send(&mut host, &Frame::Open { id: 2, port: 10000 });
        assert_eq!(recv(&mut host), Frame::Accept { id: 2 });
        let mut old = listener.accept().unwrap();
        let mut frame = mux::encoded(&Frame::Data {
            id: 2,
            data: vec![b'x'; 100],
        });
        frame.truncate(mux::HEADER_LEN + 10);
        host.write_all(&frame).unwrap();
        host.write_all(&[mux::PAD; mux::FLUSH_LEN]).unwrap();
        send(&mut host, &Frame::Reset { answer: false });
        assert_eq!(recv(&mut host), Frame::Reset { answer: true });
        let mut buf = vec![0u8; 200];
        let err = loop {
            match old.read(&mut buf) {
                Ok(n) => assert!(n > 0, "the old stream ended without a reset"),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
        send(&mut host, &Frame::Open { id: 2, port: 10000 });
        assert_eq!(recv(&mut host), Frame::Accept { id: 2 });
    }

    #[test]
    fn a_server_that_speaks_at_once_never_overtakes_the_accept() {
        let (mux, mut host) = pair();
        let listener = mux.listen(10000);
        let server = thread::spawn(move || {
            for _ in 0..300 {
                let mut conn = listener.accept().unwrap();
                conn.write_all(b"hello").unwrap();
            }
        });
        send(&mut host, &Frame::Reset { answer: false });
        assert_eq!(recv(&mut host), Frame::Reset { answer: true });
        for n in 0..300u32 {
            let id = 2 * (n + 1);
            send(&mut host, &Frame::Open { id, port: 10000 });
            assert_eq!(recv(&mut host), Frame::Accept { id }, "stream {id}");
            assert_eq!(
                recv(&mut host),
                Frame::Data {
                    id,
                    data: b"hello".to_vec()
                }
            );
            assert_eq!(recv(&mut host), Frame::Close { id });
        }
        server.join().unwrap();
    }

    #[test]
    fn host_streams_are_accepted_served_and_reset() {
        let (mux, mut host) = pair();
        let listener = mux.listen(10000);
        // Garbage before the host's reset (a restored byte stream) is skipped.
        host.write_all(b"\x04\x00\x00").unwrap();
        send(&mut host, &Frame::Reset { answer: false });
        assert_eq!(recv(&mut host), Frame::Reset { answer: true });
        send(&mut host, &Frame::Open { id: 2, port: 10000 });
        assert_eq!(recv(&mut host), Frame::Accept { id: 2 });
        send(&mut host, &Frame::Open { id: 4, port: 7 });
        assert_eq!(recv(&mut host), Frame::Refuse { id: 4 });
        let mut conn = listener.accept().unwrap();
        send(
            &mut host,
            &Frame::Data {
                id: 2,
                data: b"ping".to_vec(),
            },
        );
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        conn.write_all(b"pong").unwrap();
        assert_eq!(
            recv(&mut host),
            Frame::Data {
                id: 2,
                data: b"pong".to_vec()
            }
        );
        // A reset ends the stream; the listener takes new streams.
        send(&mut host, &Frame::Reset { answer: false });
        assert_eq!(recv(&mut host), Frame::Reset { answer: true });
        let err = conn.read(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
        send(&mut host, &Frame::Open { id: 2, port: 10000 });
        assert_eq!(recv(&mut host), Frame::Accept { id: 2 });
        let _again = listener.accept().unwrap();
        drop(conn); // the old handle must not close the new stream 2
        send(
            &mut host,
            &Frame::Data {
                id: 2,
                data: b"x".to_vec(),
            },
        );
    }

    #[test]
    fn guest_streams_wait_for_credit_and_close_on_drop() {
        let (mux, mut host) = pair();
        send(&mut host, &Frame::Reset { answer: true });
        let m = mux.clone();
        let opener = thread::spawn(move || m.connect(1024));
        assert_eq!(recv(&mut host), Frame::Open { id: 1, port: 1024 });
        send(&mut host, &Frame::Accept { id: 1 });
        let mut conn = opener.join().unwrap().unwrap();
        // The whole window goes out, then the writer waits for credit.
        let writer = thread::spawn(move || {
            conn.write_all(&vec![1u8; mux::WINDOW as usize + 10])
                .unwrap();
            conn
        });
        let mut got = 0;
        while got < mux::WINDOW as usize {
            match recv(&mut host) {
                Frame::Data { data, .. } => got += data.len(),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, mux::WINDOW as usize);
        send(&mut host, &Frame::Credit { id: 1, bytes: 10 });
        assert_eq!(
            recv(&mut host),
            Frame::Data {
                id: 1,
                data: vec![1; 10]
            }
        );
        drop(writer.join().unwrap());
        assert_eq!(recv(&mut host), Frame::Close { id: 1 });
        // A refused open is ConnectionRefused.
        let m = mux.clone();
        let opener = thread::spawn(move || m.connect(9));
        assert_eq!(recv(&mut host), Frame::Open { id: 3, port: 9 });
        send(&mut host, &Frame::Refuse { id: 3 });
        let err = opener.join().unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    }
}
