//! Length-prefixed frames: how [`Message`]s travel over a byte stream.
//!
//! A frame is a big-endian `u32` length, then that many bytes: one kind byte and the payload.
//! Kind 0 is a control message as JSON; kinds 1, 2 and 3 are raw stdin, stdout and stderr
//! bytes, so streamed output costs five bytes of overhead and no encoding.

use crate::message::Message;
use std::io::{self, Read, Write};

/// The largest frame length (kind byte + payload) either side accepts.
pub const MAX_FRAME_LEN: u32 = 1 << 20;

/// The largest data payload a sender puts in one frame; bigger writes are split.
pub const DATA_CHUNK: usize = 32 * 1024;

const KIND_CONTROL: u8 = 0;
const KIND_STDIN: u8 = 1;
const KIND_STDOUT: u8 = 2;
const KIND_STDERR: u8 = 3;

/// Why a frame could not be read, written, encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed.
    #[error("I/O error while {action} a frame")]
    Io {
        /// "reading" or "writing".
        action: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The stream ended inside a frame.
    #[error("Connection closed inside a frame: got {got} of {expected} bytes of its {part}")]
    Truncated {
        /// "length" or "body".
        part: &'static str,
        /// Bytes the frame needed.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// The frame announced more bytes than allowed.
    #[error("Frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The announced (or, when sending, the encoded) length.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The frame had no kind byte.
    #[error("Empty frame (length 0) received")]
    Empty,
    /// The kind byte is not one this version knows.
    #[error("Unknown frame kind {0}")]
    UnknownKind(u8),
    /// The control payload is not a message this version knows.
    #[error("Invalid control message")]
    Json(#[source] serde_json::Error),
}

impl From<io::Error> for FrameError {
    fn from(source: io::Error) -> Self {
        FrameError::Io {
            action: "transferring",
            source,
        }
    }
}

/// Encodes a message into a complete frame (length prefix included).
pub fn encode(message: &Message) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; 4];
    match message {
        Message::Stdin(data) => encode_data(&mut out, KIND_STDIN, data),
        Message::Stdout(data) => encode_data(&mut out, KIND_STDOUT, data),
        Message::Stderr(data) => encode_data(&mut out, KIND_STDERR, data),
        control => {
            out.push(KIND_CONTROL);
            serde_json::to_writer(&mut out, control).map_err(FrameError::Json)?;
        }
    }
    let len = out.len() - 4;
    if len as u64 > u64::from(MAX_FRAME_LEN) {
        return Err(FrameError::TooLarge {
            len: len as u64,
            max: MAX_FRAME_LEN,
        });
    }
    // len <= MAX_FRAME_LEN, so it fits in a u32.
    out[..4].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(out)
}

fn encode_data(out: &mut Vec<u8>, kind: u8, data: &[u8]) {
    out.reserve(1 + data.len());
    out.push(kind);
    out.extend_from_slice(data);
}

/// Decodes a frame body (kind byte + payload, without the length prefix).
pub fn decode(body: &[u8]) -> Result<Message, FrameError> {
    let (&kind, payload) = body.split_first().ok_or(FrameError::Empty)?;
    match kind {
        KIND_CONTROL => serde_json::from_slice(payload).map_err(FrameError::Json),
        KIND_STDIN => Ok(Message::Stdin(payload.to_vec())),
        KIND_STDOUT => Ok(Message::Stdout(payload.to_vec())),
        KIND_STDERR => Ok(Message::Stderr(payload.to_vec())),
        other => Err(FrameError::UnknownKind(other)),
    }
}

/// Checks a frame's announced length against the limit.
pub fn check_len(len: u32) -> Result<usize, FrameError> {
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            max: MAX_FRAME_LEN,
        });
    }
    Ok(len as usize)
}

/// Writes one message as a frame and flushes, so it leaves now.
pub fn write_frame<W: Write + ?Sized>(writer: &mut W, message: &Message) -> Result<(), FrameError> {
    let frame = encode(message)?;
    writer
        .write_all(&frame)
        .and_then(|()| writer.flush())
        .map_err(|source| FrameError::Io {
            action: "writing",
            source,
        })
}

/// Writes data as as many frames of at most [`DATA_CHUNK`] bytes as needed.
pub fn write_data<W: Write + ?Sized>(
    writer: &mut W,
    wrap: fn(Vec<u8>) -> Message,
    data: &[u8],
) -> Result<(), FrameError> {
    for chunk in data.chunks(DATA_CHUNK) {
        write_frame(writer, &wrap(chunk.to_vec()))?;
    }
    Ok(())
}

/// Reads one frame; `Ok(None)` when the peer closed the stream cleanly between frames.
pub fn read_frame<R: Read + ?Sized>(reader: &mut R) -> Result<Option<Message>, FrameError> {
    let mut len = [0u8; 4];
    let got = read_full(reader, &mut len)?;
    if got == 0 {
        return Ok(None);
    }
    if got < len.len() {
        return Err(FrameError::Truncated {
            part: "length",
            expected: 4,
            got,
        });
    }
    let len = check_len(u32::from_be_bytes(len))?;
    let mut body = vec![0u8; len];
    let got = read_full(reader, &mut body)?;
    if got < len {
        return Err(FrameError::Truncated {
            part: "body",
            expected: len,
            got,
        });
    }
    decode(&body).map(Some)
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read + ?Sized>(reader: &mut R, buf: &mut [u8]) -> Result<usize, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(FrameError::Io {
                    action: "reading",
                    source,
                });
            }
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::*;
    use std::io::Cursor;

    fn all_messages() -> Vec<Message> {
        vec![
            Message::Hello(Hello::new("test")),
            Message::Exec(ExecRequest {
                argv: vec!["sh".into(), "-c".into(), "echo 'hi'".into()],
                env: vec![EnvVar::new("A", "b=c")],
                cwd: Some("/tmp".into()),
                user: Some("1000:1000".into()),
                tty: true,
                window: Some(WindowSize { rows: 24, cols: 80 }),
                stdin: true,
            }),
            Message::Health,
            Message::Metrics,
            Message::Shutdown { grace_ms: 10_000 },
            Message::Stdin(b"input\n".to_vec()),
            Message::Stdin(Vec::new()),
            Message::StdinEof,
            Message::Resize(WindowSize {
                rows: 50,
                cols: 132,
            }),
            Message::Signal { signal: 15 },
            Message::Started { pid: 42 },
            Message::Stdout(vec![0, 1, 2, 255, b'\n']),
            Message::Stderr(b"oops".to_vec()),
            Message::Exit {
                status: ExitStatus::Code(3),
            },
            Message::Exit {
                status: ExitStatus::Signal(9),
            },
            Message::HealthReport(HealthReport {
                uptime_ms: 1234,
                workload: WorkloadState::Running { pid: 7 },
            }),
            Message::HealthReport(HealthReport {
                uptime_ms: 1,
                workload: WorkloadState::Exited {
                    status: ExitStatus::Code(0),
                },
            }),
            Message::MetricsReport(MetricsReport {
                cpu_usage_ratio: 0.25,
                cpu_iowait_ratio: 0.5,
                memory_used_bytes: 1 << 20,
                memory_total_bytes: 1 << 28,
                disk_used_bytes: 5,
                disk_total_bytes: 10,
            }),
            Message::ShutdownAccepted,
            Message::SetClock { unix_nanos: 7 },
            Message::ClockSet,
            Message::Reidentify {
                identity: Identity {
                    hostname: Some("clone".into()),
                    mac: Some("02:00:00:00:00:01".into()),
                    network: Some(crate::config::NetworkConfig {
                        interface: "eth0".into(),
                        address: std::net::Ipv4Addr::new(10, 0, 0, 9),
                        prefix_len: 24,
                        gateway: None,
                        dns: vec![],
                        search: vec![],
                        mtu: Some(1400),
                    }),
                },
                entropy: Entropy((0..=255).collect()),
                unix_nanos: u64::MAX,
            },
            Message::Reidentified(ReidentifyReport {
                steps: vec![Step {
                    name: "crng".into(),
                    status: StepStatus::Skipped,
                    detail: "not supported".into(),
                }],
            }),
            Message::WorkloadExited {
                status: ExitStatus::Code(1),
            },
            Message::Ack,
            Message::error(ErrorKind::NotFound, "command \"nope\" not found"),
        ]
    }

    #[test]
    fn every_message_round_trips_through_a_stream() {
        let messages = all_messages();
        let mut wire = Vec::new();
        for m in &messages {
            write_frame(&mut wire, m).unwrap();
        }
        let mut reader = Cursor::new(wire);
        for m in &messages {
            assert_eq!(read_frame(&mut reader).unwrap().as_ref(), Some(m));
        }
        assert!(
            read_frame(&mut reader).unwrap().is_none(),
            "clean EOF after the last frame"
        );
    }

    #[test]
    fn data_frames_are_raw_bytes_with_a_five_byte_header() {
        let frame = encode(&Message::Stdout(b"abc".to_vec())).unwrap();
        assert_eq!(frame, [0, 0, 0, 4, KIND_STDOUT, b'a', b'b', b'c']);
    }

    #[test]
    fn a_stream_cut_inside_the_length_is_truncated() {
        let err = read_frame(&mut Cursor::new(vec![0u8, 0])).unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::Truncated {
                    part: "length",
                    expected: 4,
                    got: 2
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_stream_cut_inside_the_body_is_truncated() {
        let mut frame = encode(&Message::Health).unwrap();
        let full = frame.len() - 4;
        frame.truncate(frame.len() - 3);
        let err = read_frame(&mut Cursor::new(frame)).unwrap_err();
        match err {
            FrameError::Truncated {
                part: "body",
                expected,
                got,
            } => {
                assert_eq!(expected, full);
                assert_eq!(got, full - 3);
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn an_oversize_announced_length_is_rejected_before_allocating() {
        let mut wire = (MAX_FRAME_LEN + 1).to_be_bytes().to_vec();
        wire.push(KIND_STDOUT);
        let err = read_frame(&mut Cursor::new(wire)).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
    }

    #[test]
    fn an_oversize_message_is_refused_when_sending() {
        let big = vec![b'x'; MAX_FRAME_LEN as usize];
        let err = write_frame(&mut Vec::new(), &Message::Stdout(big)).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn a_frame_of_exactly_the_limit_is_accepted() {
        let data = vec![b'x'; MAX_FRAME_LEN as usize - 1];
        let mut wire = Vec::new();
        write_frame(&mut wire, &Message::Stderr(data.clone())).unwrap();
        assert_eq!(
            read_frame(&mut Cursor::new(wire)).unwrap(),
            Some(Message::Stderr(data))
        );
    }

    #[test]
    fn large_writes_are_split_into_chunks() {
        let data = vec![7u8; DATA_CHUNK * 2 + 10];
        let mut wire = Vec::new();
        write_data(&mut wire, Message::Stdin, &data).unwrap();
        let mut reader = Cursor::new(wire);
        let mut got = Vec::new();
        let mut frames = 0;
        while let Some(Message::Stdin(chunk)) = read_frame(&mut reader).unwrap() {
            assert!(chunk.len() <= DATA_CHUNK);
            got.extend(chunk);
            frames += 1;
        }
        assert_eq!(frames, 3);
        assert_eq!(got, data);
    }

    #[test]
    fn empty_and_unknown_frames_are_errors() {
        let err = read_frame(&mut Cursor::new(vec![0u8, 0, 0, 0])).unwrap_err();
        assert!(matches!(err, FrameError::Empty), "{err}");
        let err = read_frame(&mut Cursor::new(vec![0u8, 0, 0, 1, 9])).unwrap_err();
        assert!(matches!(err, FrameError::UnknownKind(9)), "{err}");
    }

    #[test]
    fn garbage_json_and_unknown_types_are_invalid_control_messages() {
        for payload in [
            &b"{not json"[..],
            br#"{"type":"frobnicate"}"#,
            br#"{"type":"stdout"}"#,
        ] {
            let mut body = vec![KIND_CONTROL];
            body.extend_from_slice(payload);
            let err = decode(&body).unwrap_err();
            assert!(matches!(err, FrameError::Json(_)), "{err}");
        }
    }

    /// A peer whose stream never ends, counting what is taken from it.
    struct Endless {
        header: Vec<u8>,
        taken: usize,
    }

    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(64 * 1024);
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = self.header.get(self.taken + i).copied().unwrap_or(0);
            }
            self.taken += n;
            Ok(n)
        }
    }

    #[test]
    fn a_4_gib_header_on_an_endless_stream_costs_four_bytes() {
        let mut peer = Endless {
            header: u32::MAX.to_be_bytes().to_vec(),
            taken: 0,
        };
        let err = read_frame(&mut peer).unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { len, max } if len == u64::from(u32::MAX) && max == MAX_FRAME_LEN),
            "{err}"
        );
        assert_eq!(
            peer.taken, 4,
            "the body was read before the length was checked"
        );
    }

    #[test]
    fn endless_frames_are_read_one_bounded_frame_at_a_time() {
        // Kind 2 (stdout) of the largest size, then more of the same, for ever.
        let mut header = MAX_FRAME_LEN.to_be_bytes().to_vec();
        header.push(KIND_STDOUT);
        let mut peer = Endless { header, taken: 0 };
        let Some(Message::Stdout(data)) = read_frame(&mut peer).unwrap() else {
            panic!("expected stdout");
        };
        assert_eq!(data.len(), MAX_FRAME_LEN as usize - 1);
        assert_eq!(peer.taken, 4 + MAX_FRAME_LEN as usize);
    }
}
