//! A stream multiplexer over one byte stream: many vsock-like connections on one virtio-serial
//! port. It is the guest channel under QEMU, which cannot migrate its vsock device (so a VM with
//! one could not be snapshotted) but migrates a virtio-serial port with the rest of the VM.
//!
//! A frame is a kind byte, a big-endian `u32` stream id, a big-endian `u32` payload length and
//! the payload. Streams opened by the host have even ids, streams opened by the guest odd ones,
//! so the two sides never pick the same id. A stream starts with [`Frame::Open`] (the port the
//! opener wants) and is answered [`Frame::Accept`] or [`Frame::Refuse`]; then both sides send
//! [`Frame::Data`] within the credit the other side granted ([`WINDOW`] bytes at first, more
//! with [`Frame::Credit`] as the receiver consumes), so one stalled stream never holds up the
//! others and no receiver buffers more than [`WINDOW`] bytes per stream. [`Frame::Eof`] ends
//! one direction, [`Frame::Close`] forgets the stream on both sides.
//!
//! [`Frame::Reset`] starts (or restarts) the channel and carries a fixed byte pattern
//! ([`SYNC`]): a side that just connected, or that read something it cannot parse, discards
//! bytes until it finds that pattern ([`find_sync`]), since after a snapshot is restored the
//! byte stream may resume in the middle of a frame. A reset forgets every stream on both
//! sides: the side that sends a reset (not an answer) has forgotten its streams, the side that
//! receives one forgets its streams and answers; an answer changes nothing but ends the search.
//! A side that starts with a reset of its own writes it before any other frame, answers
//! included: arriving after an accept, it would end the stream the sender had just taken.
//! Between frames, [`PAD`] bytes mean nothing; a side sends [`FLUSH_LEN`] of them before the
//! first reset of a connection, so that a peer holding part of a frame (a guest restored from a
//! snapshot taken mid-frame) completes it and then finds the reset.
//!
//! Everything here is pure: encoding, decoding with strict bounds, and the credit arithmetic.
//! The host (tokio) and the guest (threads) drive it each in their own way.

use std::fmt;

/// The largest payload of one frame; a header announcing more is a protocol error.
pub const MAX_PAYLOAD: usize = 32 * 1024;

/// Bytes of a frame header: kind, stream id, payload length.
pub const HEADER_LEN: usize = 9;

/// The most streams (open or being opened) one side keeps at once; more are refused.
pub const MAX_STREAMS: usize = 64;

/// The credit each side starts with per stream and direction: the most bytes a receiver ever
/// buffers for one stream.
pub const WINDOW: u32 = 128 * 1024;

/// A receiver grants credit back once it has consumed this much (fewer, larger credit frames).
pub const CREDIT_BATCH: u32 = WINDOW / 4;

/// The encoded [`Frame::Reset`] without its last byte (the answer flag): a pattern that is
/// unlikely inside data, searched for when resynchronising.
pub const SYNC: [u8; 8] = [KIND_RESET, b'I', b'M', b'P', b'M', b'U', b'X', 1];

/// Bytes of an encoded [`Frame::Reset`]: [`SYNC`] and the answer flag.
pub const RESET_LEN: usize = SYNC.len() + 1;

/// A byte between frames that means nothing: receivers skip it ([`padding`]).
pub const PAD: u8 = 0;

/// How many [`PAD`] bytes a side sends before its first reset on a connection: enough to
/// complete any frame the peer may hold a part of. A guest restored from a snapshot may have
/// been paused in the middle of one of the old host's frames and would otherwise take the new
/// host's reset for the rest of that frame's payload; with this it finishes that frame, skips
/// the rest and reads the reset (an older guest takes the padding for garbage and searches
/// for the reset, which it finds as well).
pub const FLUSH_LEN: usize = HEADER_LEN + MAX_PAYLOAD;

/// How many [`PAD`] bytes `buf` starts with.
pub fn padding(buf: &[u8]) -> usize {
    buf.iter().take_while(|&&b| b == PAD).count()
}

const KIND_RESET: u8 = 0xff;
const KIND_OPEN: u8 = 1;
const KIND_ACCEPT: u8 = 2;
const KIND_REFUSE: u8 = 3;
const KIND_DATA: u8 = 4;
const KIND_EOF: u8 = 5;
const KIND_CLOSE: u8 = 6;
const KIND_CREDIT: u8 = 7;

/// One multiplexer frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Forget every stream; `answer` is set on the reply to a reset that was not one.
    Reset {
        /// Whether this reset answers the peer's.
        answer: bool,
    },
    /// Open stream `id` to `port` on the other side.
    Open {
        /// The new stream (even from the host, odd from the guest).
        id: u32,
        /// The port the opener wants.
        port: u32,
    },
    /// Stream `id` is open: data may flow.
    Accept {
        /// The stream.
        id: u32,
    },
    /// Stream `id` could not be opened (nothing listens, or too many streams).
    Refuse {
        /// The stream.
        id: u32,
    },
    /// Bytes on stream `id`, within the sender's credit.
    Data {
        /// The stream.
        id: u32,
        /// At most [`MAX_PAYLOAD`] bytes.
        data: Vec<u8>,
    },
    /// The sender will send no more data on `id` (the receiver reads end of file).
    Eof {
        /// The stream.
        id: u32,
    },
    /// Stream `id` is gone on the sender's side; the receiver forgets it too.
    Close {
        /// The stream.
        id: u32,
    },
    /// The receiver consumed `bytes` more of stream `id`: the sender may send that much more.
    Credit {
        /// The stream.
        id: u32,
        /// How many more bytes may be sent.
        bytes: u32,
    },
}

impl Frame {
    /// The stream the frame is about (`None` for a reset).
    pub fn stream(&self) -> Option<u32> {
        match *self {
            Frame::Reset { .. } => None,
            Frame::Open { id, .. }
            | Frame::Accept { id }
            | Frame::Refuse { id }
            | Frame::Data { id, .. }
            | Frame::Eof { id }
            | Frame::Close { id }
            | Frame::Credit { id, .. } => Some(id),
        }
    }
}

/// Why bytes from the peer are not a frame; the receiver resets the channel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MuxError {
    /// The header announces a payload larger than [`MAX_PAYLOAD`].
    #[error("Mux frame for stream {id} announces {len} bytes, more than the {MAX_PAYLOAD} allowed")]
    TooLarge {
        /// The stream.
        id: u32,
        /// The announced length.
        len: u32,
    },
    /// The kind byte is not one this version knows.
    #[error("Unknown mux frame kind {0}")]
    UnknownKind(u8),
    /// A frame of a fixed size came with another size.
    #[error("Mux {kind} frame has a {len}-byte payload, expected {expected}")]
    BadLength {
        /// The frame kind.
        kind: &'static str,
        /// The announced length.
        len: u32,
        /// The length this kind has.
        expected: u32,
    },
    /// A reset frame without the sync pattern.
    #[error("Mux reset frame without its sync pattern")]
    BadSync,
}

/// Appends the encoding of `frame` to `out`. Data longer than [`MAX_PAYLOAD`] is the caller's
/// bug: senders split data into chunks of at most that size.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let mut header = |kind: u8, id: u32, len: usize| {
        out.push(kind);
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    };
    match frame {
        Frame::Reset { answer } => {
            out.extend_from_slice(&SYNC);
            out.push(u8::from(*answer));
        }
        Frame::Open { id, port } => {
            header(KIND_OPEN, *id, 4);
            out.extend_from_slice(&port.to_be_bytes());
        }
        Frame::Accept { id } => header(KIND_ACCEPT, *id, 0),
        Frame::Refuse { id } => header(KIND_REFUSE, *id, 0),
        Frame::Data { id, data } => {
            header(KIND_DATA, *id, data.len());
            out.extend_from_slice(data);
        }
        Frame::Eof { id } => header(KIND_EOF, *id, 0),
        Frame::Close { id } => header(KIND_CLOSE, *id, 0),
        Frame::Credit { id, bytes } => {
            header(KIND_CREDIT, *id, 4);
            out.extend_from_slice(&bytes.to_be_bytes());
        }
    }
}

/// The encoding of one frame.
pub fn encoded(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out);
    out
}

/// Decodes the frame at the start of `buf`: `Ok(None)` while more bytes are needed (never more
/// than [`HEADER_LEN`] + [`MAX_PAYLOAD`] in all), else the frame and how many bytes it used.
/// A header is checked as soon as it is complete, so an oversized frame is refused before its
/// payload is buffered.
pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, MuxError> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    if kind == KIND_RESET {
        let Some(reset) = buf.get(..RESET_LEN) else {
            return match SYNC.starts_with(buf) {
                true => Ok(None),
                false => Err(MuxError::BadSync),
            };
        };
        if reset[..SYNC.len()] != SYNC || reset[SYNC.len()] > 1 {
            return Err(MuxError::BadSync);
        }
        let answer = reset[SYNC.len()] == 1;
        return Ok(Some((Frame::Reset { answer }, RESET_LEN)));
    }
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let id = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    let len = u32::from_be_bytes([header[5], header[6], header[7], header[8]]);
    check_header(kind, id, len)?;
    let total = HEADER_LEN + len as usize;
    let Some(payload) = buf.get(HEADER_LEN..total) else {
        return Ok(None);
    };
    let word = || u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
    let frame = match kind {
        KIND_OPEN => Frame::Open { id, port: word() },
        KIND_ACCEPT => Frame::Accept { id },
        KIND_REFUSE => Frame::Refuse { id },
        KIND_DATA => Frame::Data {
            id,
            data: payload.to_vec(),
        },
        KIND_EOF => Frame::Eof { id },
        KIND_CLOSE => Frame::Close { id },
        KIND_CREDIT => Frame::Credit { id, bytes: word() },
        other => return Err(MuxError::UnknownKind(other)),
    };
    Ok(Some((frame, total)))
}

/// Checks a header's kind and length before its payload is awaited.
fn check_header(kind: u8, id: u32, len: u32) -> Result<(), MuxError> {
    let fixed = |name: &'static str, expected: u32| {
        if len == expected {
            Ok(())
        } else {
            Err(MuxError::BadLength {
                kind: name,
                len,
                expected,
            })
        }
    };
    match kind {
        KIND_OPEN => fixed("open", 4),
        KIND_CREDIT => fixed("credit", 4),
        KIND_ACCEPT => fixed("accept", 0),
        KIND_REFUSE => fixed("refuse", 0),
        KIND_EOF => fixed("eof", 0),
        KIND_CLOSE => fixed("close", 0),
        KIND_DATA if len as usize > MAX_PAYLOAD => Err(MuxError::TooLarge { id, len }),
        KIND_DATA => Ok(()),
        other => Err(MuxError::UnknownKind(other)),
    }
}

/// Where in `buf` the next reset frame may start: the offset of a full [`SYNC`], or of a tail
/// of `buf` that could be the start of one (keep it and read more), or `None` when no byte of
/// `buf` can begin a reset (discard it all).
pub fn find_sync(buf: &[u8]) -> Option<usize> {
    (0..buf.len()).find(|&i| {
        let rest = &buf[i..];
        let n = rest.len().min(SYNC.len());
        rest[..n] == SYNC[..n]
    })
}

/// Whether `id` is one the host opens (even) rather than the guest (odd).
pub fn opened_by_host(id: u32) -> bool {
    id.is_multiple_of(2)
}

/// The sending side's credit for one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendCredit(u32);

impl Default for SendCredit {
    fn default() -> Self {
        SendCredit(WINDOW)
    }
}

impl SendCredit {
    /// Bytes that may be sent now.
    pub fn available(&self) -> u32 {
        self.0
    }

    /// Adds the peer's grant (saturating: a peer granting absurd credit only harms itself).
    pub fn grant(&mut self, bytes: u32) {
        self.0 = self.0.saturating_add(bytes);
    }

    /// Takes up to `want` bytes (and at most [`MAX_PAYLOAD`]) of the credit: what may be sent.
    pub fn take(&mut self, want: usize) -> usize {
        let n = want.min(MAX_PAYLOAD).min(self.0 as usize);
        self.0 -= n as u32;
        n
    }
}

/// The receiving side's accounting for one stream: what the peer may still send, and what
/// was consumed but not yet granted back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWindow {
    allowed: u32,
    consumed: u32,
}

impl Default for RecvWindow {
    fn default() -> Self {
        RecvWindow {
            allowed: WINDOW,
            consumed: 0,
        }
    }
}

/// The peer sent more than its credit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreditExceeded {
    /// Bytes that arrived.
    pub got: usize,
    /// Bytes the peer was allowed.
    pub allowed: u32,
}

impl fmt::Display for CreditExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the peer sent {} bytes with {} bytes of credit",
            self.got, self.allowed
        )
    }
}

impl RecvWindow {
    /// Accounts for `n` bytes that arrived; an error when they exceed the peer's credit (the
    /// receiver then closes the stream rather than buffer them).
    pub fn receive(&mut self, n: usize) -> Result<(), CreditExceeded> {
        match u32::try_from(n) {
            Ok(k) if k <= self.allowed => {
                self.allowed -= k;
                Ok(())
            }
            _ => Err(CreditExceeded {
                got: n,
                allowed: self.allowed,
            }),
        }
    }

    /// Accounts for `n` bytes the local reader consumed; the credit to grant back now, if
    /// enough has built up (see [`CREDIT_BATCH`]).
    pub fn consume(&mut self, n: usize) -> Option<u32> {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.consumed = self.consumed.saturating_add(n);
        if self.consumed < CREDIT_BATCH {
            return None;
        }
        // Never grant more than the window: the peer can never have more than WINDOW in flight.
        let grant = self.consumed.min(WINDOW - self.allowed);
        self.consumed = 0;
        self.allowed += grant;
        (grant > 0).then_some(grant)
    }

    /// Bytes received and not yet consumed or granted back (what the receiver may be holding).
    pub fn outstanding(&self) -> u32 {
        WINDOW - self.allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_frame() -> Vec<Frame> {
        vec![
            Frame::Reset { answer: false },
            Frame::Reset { answer: true },
            Frame::Open { id: 2, port: 10000 },
            Frame::Accept { id: 2 },
            Frame::Refuse { id: 3 },
            Frame::Data {
                id: 2,
                data: b"hello".to_vec(),
            },
            Frame::Data {
                id: 5,
                data: vec![7; MAX_PAYLOAD],
            },
            Frame::Eof { id: 2 },
            Frame::Close { id: 2 },
            Frame::Credit {
                id: 2,
                bytes: CREDIT_BATCH,
            },
        ]
    }

    #[test]
    fn every_frame_round_trips_whole_and_byte_by_byte() {
        let mut wire = Vec::new();
        for f in every_frame() {
            encode(&f, &mut wire);
        }
        let mut got = Vec::new();
        let mut at = 0;
        while let Some((f, used)) = decode(&wire[at..]).unwrap() {
            got.push(f);
            at += used;
        }
        assert_eq!(got, every_frame());
        assert_eq!(at, wire.len());
        // Every strict prefix of a frame asks for more bytes.
        for f in every_frame() {
            let bytes = encoded(&f);
            for cut in 0..bytes.len() {
                assert_eq!(decode(&bytes[..cut]).unwrap(), None, "{f:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn an_oversized_frame_is_refused_from_its_header_alone() {
        let mut header = vec![KIND_DATA];
        header.extend_from_slice(&9u32.to_be_bytes());
        header.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            decode(&header),
            Err(MuxError::TooLarge {
                id: 9,
                len: u32::MAX
            })
        );
    }

    #[test]
    fn malformed_frames_are_errors_not_panics() {
        assert_eq!(
            decode(&[42, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(MuxError::UnknownKind(42))
        );
        assert!(matches!(
            decode(&[KIND_OPEN, 0, 0, 0, 2, 0, 0, 0, 9]),
            Err(MuxError::BadLength { .. })
        ));
        assert!(matches!(
            decode(&[KIND_CLOSE, 0, 0, 0, 2, 0, 0, 1, 0]),
            Err(MuxError::BadLength { .. })
        ));
        assert_eq!(decode(&[KIND_RESET, b'X']), Err(MuxError::BadSync));
        let mut bad_flag = SYNC.to_vec();
        bad_flag.push(7);
        assert_eq!(decode(&bad_flag), Err(MuxError::BadSync));
    }

    #[test]
    fn sync_is_found_after_garbage_and_across_reads() {
        let mut wire = b"garbage from before the snapshot".to_vec();
        let start = wire.len();
        encode(&Frame::Reset { answer: true }, &mut wire);
        assert_eq!(find_sync(&wire), Some(start));
        // Only the start of the pattern has arrived: keep it.
        assert_eq!(find_sync(&wire[..start + 3]), Some(start));
        assert_eq!(find_sync(b"nothing here"), None);
        assert_eq!(find_sync(&[]), None);
        let (frame, used) = decode(&wire[start..]).unwrap().unwrap();
        assert_eq!(frame, Frame::Reset { answer: true });
        assert_eq!(used, RESET_LEN);
    }

    #[test]
    fn send_credit_limits_what_may_be_sent() {
        let mut c = SendCredit::default();
        assert_eq!(c.take(1 << 20), MAX_PAYLOAD);
        let mut sent = MAX_PAYLOAD;
        while c.available() > 0 {
            sent += c.take(1 << 20);
        }
        assert_eq!(sent, WINDOW as usize);
        assert_eq!(c.take(10), 0);
        c.grant(5);
        assert_eq!(c.take(10), 5);
        c.grant(u32::MAX);
        c.grant(u32::MAX);
        assert_eq!(c.available(), u32::MAX);
    }

    #[test]
    fn the_receiver_refuses_data_beyond_credit_and_grants_in_batches() {
        let mut w = RecvWindow::default();
        w.receive(WINDOW as usize).unwrap();
        assert_eq!(w.receive(1), Err(CreditExceeded { got: 1, allowed: 0 }));
        assert_eq!(w.outstanding(), WINDOW);
        assert_eq!(w.consume(CREDIT_BATCH as usize - 1), None);
        assert_eq!(w.consume(1), Some(CREDIT_BATCH));
        w.receive(CREDIT_BATCH as usize).unwrap();
        assert!(w.receive(1).is_err());
        // Consuming more than was received never grants beyond the window.
        let mut w = RecvWindow::default();
        assert_eq!(w.consume(WINDOW as usize * 4), None);
        assert!(w.receive(WINDOW as usize + 1).is_err());
    }
}
