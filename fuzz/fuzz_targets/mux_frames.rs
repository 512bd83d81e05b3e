//! The guest-channel multiplexer's codec, as the host reads what a (hostile) guest wrote: the
//! byte stream cut into reads of any size, searched for a reset while out of sync, decoded
//! frame by frame. The buffer never holds more than one frame plus one read, every frame it
//! accepts encodes back to the same bytes, and the credit accounting of a receiver fed those
//! frames never lets a stream hold more than its window.
#![no_main]

use imp_proto::mux::{self, Frame, RecvWindow, SendCredit};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

fuzz_target!(|data: &[u8]| {
    let Some((&step, wire)) = data.split_first() else {
        return;
    };
    let step = usize::from(step % 64) + 1;
    let mut buf: Vec<u8> = Vec::new();
    let mut hunting = true;
    let mut windows: HashMap<u32, RecvWindow> = HashMap::new();
    let mut credits: HashMap<u32, SendCredit> = HashMap::new();
    for piece in wire.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            if hunting {
                match mux::find_sync(&buf) {
                    Some(at) => drop(buf.drain(..at)),
                    None => {
                        buf.clear();
                        break;
                    }
                }
            }
            match mux::decode(&buf) {
                Ok(Some((frame, used))) => {
                    assert!(used <= buf.len());
                    assert_eq!(mux::encoded(&frame), buf[..used], "{frame:?} re-encoded differently");
                    buf.drain(..used);
                    hunting = false;
                    apply(&frame, &mut windows, &mut credits);
                }
                Ok(None) => break,
                Err(_) => {
                    buf.drain(..1);
                    hunting = true;
                }
            }
        }
        assert!(buf.len() <= mux::HEADER_LEN + mux::MAX_PAYLOAD + step);
    }
});

/// A receiver's accounting: data within the window is consumed at once (credit granted back),
/// data beyond it closes the stream; what is outstanding never exceeds the window.
fn apply(
    frame: &Frame,
    windows: &mut HashMap<u32, RecvWindow>,
    credits: &mut HashMap<u32, SendCredit>,
) {
    match frame {
        Frame::Reset { .. } => {
            windows.clear();
            credits.clear();
        }
        Frame::Open { id, .. } if windows.len() < mux::MAX_STREAMS => {
            windows.entry(*id).or_default();
            credits.entry(*id).or_default();
        }
        Frame::Data { id, data } => {
            assert!(data.len() <= mux::MAX_PAYLOAD);
            if let Some(w) = windows.get_mut(id) {
                match w.receive(data.len()) {
                    Ok(()) => {
                        let _ = w.consume(data.len());
                    }
                    Err(_) => {
                        windows.remove(id);
                    }
                }
            }
            if let Some(w) = windows.get(id) {
                assert!(w.outstanding() <= mux::WINDOW);
            }
        }
        Frame::Credit { id, bytes } => {
            if let Some(c) = credits.get_mut(id) {
                c.grant(*bytes);
                let n = c.take(usize::MAX);
                assert!(n <= mux::MAX_PAYLOAD);
            }
        }
        Frame::Close { id } => {
            windows.remove(id);
            credits.remove(id);
        }
        _ => {}
    }
}
