//! The host↔guest framing, as either side decodes what its peer sent: the synchronous
//! `read_frame` (the guest agent, and the host's protocol client) and the tokio codec (the
//! host's async side) must agree on every byte stream, frame by frame, however the stream is
//! cut into reads, and everything they accept must encode back to the same message.
#![no_main]

use bytes::BytesMut;
use imp_proto::codec::FrameCodec;
use imp_proto::frame::{self, FrameError};
use imp_proto::{MAX_FRAME_LEN, read_frame};
use libfuzzer_sys::fuzz_target;
use std::io::Cursor;
use tokio_util::codec::Decoder;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the size of the pieces the codec is fed, so partial frames are met.
    let Some((&step, wire)) = data.split_first() else {
        return;
    };
    let step = usize::from(step % 64) + 1;

    let mut sync = Vec::new();
    let mut reader = Cursor::new(wire);
    let sync_end = loop {
        match read_frame(&mut reader) {
            Ok(Some(m)) => sync.push(m),
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };

    let mut codec = FrameCodec;
    let mut buf = BytesMut::new();
    let mut decoded = Vec::new();
    let mut codec_err = None;
    'feed: for piece in wire.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(m)) => decoded.push(m),
                Ok(None) => break,
                Err(e) => {
                    codec_err = Some(e);
                    break 'feed;
                }
            }
        }
        // Bounded memory: the codec never holds more than one frame plus one read.
        assert!(buf.len() <= 4 + MAX_FRAME_LEN as usize + step);
    }
    if codec_err.is_none() {
        loop {
            match codec.decode_eof(&mut buf) {
                Ok(Some(m)) => decoded.push(m),
                Ok(None) => break,
                Err(e) => {
                    codec_err = Some(e);
                    break;
                }
            }
        }
    }

    assert_eq!(sync, decoded, "read_frame and FrameCodec disagree");
    assert_eq!(
        sync_end.as_ref().map(kind),
        codec_err.as_ref().map(kind),
        "read_frame ended with {sync_end:?}, the codec with {codec_err:?}"
    );

    for m in &sync {
        // Re-encoding may grow a frame at the very limit (`1` becomes `1.0`): that is refused,
        // never truncated.
        match frame::encode(m) {
            Ok(bytes) => {
                let again = read_frame(&mut Cursor::new(bytes))
                    .expect("an encoded frame decodes")
                    .expect("an encoded frame is not the end of the stream");
                assert_eq!(&again, m, "a message changed on its way through encode");
            }
            Err(FrameError::TooLarge { .. }) => {}
            Err(e) => panic!("re-encoding {} failed: {e}", m.name()),
        }
        // Names and errors never carry the payload: formatting them is cheap and cannot panic.
        let _ = m.name();
    }
});

/// The class of a frame error, for comparing the two decoders.
fn kind(e: &FrameError) -> &'static str {
    match e {
        FrameError::Io { .. } => "io",
        FrameError::Truncated { .. } => "truncated",
        FrameError::TooLarge { .. } => "too large",
        FrameError::Empty => "empty",
        FrameError::UnknownKind(_) => "unknown kind",
        FrameError::Json(_) => "json",
    }
}
