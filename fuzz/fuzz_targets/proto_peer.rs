//! A hostile peer on the guest channel, in both directions: the host's protocol client (health,
//! metrics, shutdown, exec with its output stream, the exit report, the vsock `CONNECT` line)
//! talking to a fuzzed guest, and the guest's side of the handshake and of its exit report
//! talking to a fuzzed host. Whatever the peer sends, each side ends with an answer or an
//! error (never a panic), and copies out no more output than the peer sent.
#![no_main]

use imp_proto::client::Client;
use imp_proto::message::{ExecRequest, ExitStatus, Hello};
use imp_proto::{handshake, read_frame, report};
use libfuzzer_sys::fuzz_target;
use std::io::{self, Cursor, Read, Write};
use std::time::Duration;

/// The VMM's answer line to `CONNECT`, read byte by byte as imp-vmm reads it (what follows
/// the newline stays in the stream); `None` when the peer ends first or the line is too long.
fn reply_line(peer: &mut impl Read) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() <= imp_proto::connect::MAX_REPLY {
        if peer.read(&mut byte).ok()? == 0 {
            return None;
        }
        if byte[0] == b'\n' {
            return Some(line);
        }
        line.push(byte[0]);
    }
    None
}

/// The peer: its bytes come from the fuzzer, what we send it is counted and dropped.
struct Peer<'a> {
    input: Cursor<&'a [u8]>,
    sent: usize,
}

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sent += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A sink that counts what the exec's output copied to it.
#[derive(Default)]
struct Counted(usize);

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Formats an error and its whole chain, as the agent's logs do.
fn report_chain(e: &dyn std::error::Error) {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&s.to_string());
        source = s.source();
    }
    assert!(!text.is_empty());
}

fuzz_target!(|data: &[u8]| {
    let Some((&role, wire)) = data.split_first() else {
        return;
    };
    let mut peer = Peer {
        input: Cursor::new(wire),
        sent: 0,
    };
    let hello = Hello::new("fuzz");
    match role % 6 {
        // Host: the unary requests the agent makes.
        0 => match Client::handshake(&mut peer, &hello) {
            Ok(mut c) => {
                let results = [
                    c.health().map(drop),
                    c.metrics().map(drop),
                    c.shutdown(Duration::from_secs(1)),
                ];
                for r in results.iter().filter_map(|r| r.as_ref().err()) {
                    report_chain(r);
                }
            }
            Err(e) => report_chain(&e),
        },
        // Host: an exec and its output stream, copied out until the exit.
        1 => {
            let (mut out, mut err) = (Counted::default(), Counted::default());
            let request = ExecRequest {
                argv: vec!["sh".into()],
                ..ExecRequest::default()
            };
            let r = Client::handshake(&mut peer, &hello)
                .and_then(|c| c.exec(&request))
                .and_then(|mut s| s.wait_with_output(&mut out, &mut err));
            if let Err(e) = &r {
                report_chain(e);
            }
            assert!(
                out.0 + err.0 <= wire.len(),
                "more output than the guest sent"
            );
        }
        // Host: the guest's exit report.
        2 => {
            if let Err(e) = report::receive_exit_report(&mut peer, &hello) {
                report_chain(&e);
            }
        }
        // Host: the VMM's answer to `CONNECT`, then the guest's hello on the same stream.
        3 => {
            let _ = peer.write_all(imp_proto::connect::request(10_000).as_bytes());
            if let Some(line) = reply_line(&mut peer) {
                if imp_proto::connect::reply(&line).is_ok() {
                    if let Err(e) = Client::handshake(&mut peer, &hello) {
                        report_chain(&e);
                    }
                }
            }
        }
        // Guest: the handshake, then requests until the host hangs up or sends garbage.
        4 => match handshake(&mut peer, &hello) {
            Ok(_) => {
                while let Ok(Some(m)) = read_frame(&mut peer) {
                    let _ = m.name();
                }
            }
            Err(e) => report_chain(&e),
        },
        // Guest: its exit report, acknowledged (or not) by the host.
        _ => {
            if let Err(e) = report::send_exit_report(&mut peer, &hello, ExitStatus::Code(1)) {
                report_chain(&e);
            }
        }
    }
    // Each request and reply is one small frame; only a refused hello quotes the peer's own
    // software string back: nothing the peer says makes us send more than it sent.
    assert!(
        peer.sent <= 4096 + wire.len(),
        "sent {} bytes to the peer",
        peer.sent
    );
});
