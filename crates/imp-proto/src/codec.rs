//! A tokio-util codec for the same frames, so an async host can use `Framed`.

use crate::frame::{FrameError, check_len, decode, encode};
use crate::message::Message;
use bytes::{Buf, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

/// Encodes and decodes [`Message`] frames exactly like [`crate::read_frame`] and
/// [`crate::write_frame`].
#[derive(Debug, Default, Clone, Copy)]
pub struct FrameCodec;

impl Decoder for FrameCodec {
    type Item = Message;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Message>, FrameError> {
        let Some(len) = src.get(..4) else {
            return Ok(None);
        };
        let len = check_len(u32::from_be_bytes([len[0], len[1], len[2], len[3]]))?;
        if src.len() < 4 + len {
            src.reserve(4 + len - src.len());
            return Ok(None);
        }
        src.advance(4);
        let body = src.split_to(len);
        decode(&body).map(Some)
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Message>, FrameError> {
        match self.decode(src)? {
            Some(m) => Ok(Some(m)),
            None if src.is_empty() => Ok(None),
            None => {
                let expected = src.get(..4).map_or(4, |l| {
                    4 + u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize
                });
                let part = if src.len() < 4 { "length" } else { "body" };
                Err(FrameError::Truncated {
                    part,
                    expected,
                    got: src.len(),
                })
            }
        }
    }
}

impl Encoder<&Message> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, item: &Message, dst: &mut BytesMut) -> Result<(), FrameError> {
        dst.extend_from_slice(&encode(item)?);
        Ok(())
    }
}

impl Encoder<Message> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, item: Message, dst: &mut BytesMut) -> Result<(), FrameError> {
        <Self as Encoder<&Message>>::encode(self, &item, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::MAX_FRAME_LEN;
    use crate::message::ExitStatus;

    #[test]
    fn the_codec_reads_what_write_frame_wrote_byte_by_byte() {
        let mut wire = Vec::new();
        crate::write_frame(&mut wire, &Message::Stdout(b"hi".to_vec())).unwrap();
        crate::write_frame(
            &mut wire,
            &Message::Exit {
                status: ExitStatus::Code(0),
            },
        )
        .unwrap();
        let mut codec = FrameCodec;
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in wire {
            buf.extend_from_slice(&[b]);
            if let Some(m) = codec.decode(&mut buf).unwrap() {
                got.push(m);
            }
        }
        assert_eq!(
            got,
            vec![
                Message::Stdout(b"hi".to_vec()),
                Message::Exit {
                    status: ExitStatus::Code(0)
                }
            ]
        );
    }

    #[test]
    fn the_codec_rejects_oversize_and_truncated_frames() {
        let mut codec = FrameCodec;
        let mut buf = BytesMut::from(&(MAX_FRAME_LEN + 1).to_be_bytes()[..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::TooLarge { .. })
        ));
        let mut buf = BytesMut::from(&[0u8, 0, 0, 5, 2][..]);
        assert!(matches!(
            codec.decode_eof(&mut buf),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn an_oversize_header_reserves_nothing() {
        let mut codec = FrameCodec;
        let mut buf = BytesMut::from(&u32::MAX.to_be_bytes()[..]);
        let before = buf.capacity();
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::TooLarge { .. })
        ));
        assert_eq!(buf.capacity(), before);
        // A frame at the limit reserves its own size and no more.
        let mut buf = BytesMut::from(&MAX_FRAME_LEN.to_be_bytes()[..]);
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert!(buf.capacity() <= 4 + MAX_FRAME_LEN as usize * 2);
    }
}
