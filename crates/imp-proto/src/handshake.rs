//! The version handshake that opens every connection.

use crate::frame::{FrameError, read_frame, write_frame};
use crate::message::{ErrorKind, Hello, Message, Version, escape};
use std::io::{Read, Write};

/// Why the handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The hello could not be sent or received.
    #[error("Handshake failed")]
    Frame(#[from] FrameError),
    /// The peer closed the connection before saying hello.
    #[error("Peer closed the connection before its hello")]
    Closed,
    /// The peer's first message was not a hello.
    #[error("Expected a hello from the peer, got a {0} message")]
    NotHello(&'static str),
    /// The peer rejected us and said why (escaped: the peer's words).
    #[error("Peer rejected the handshake: {0}")]
    Rejected(String),
    /// The peer speaks another major version.
    #[error(
        "Incompatible protocol: we speak {ours}, the peer ({software}) speaks {theirs}; \
         the major versions must match"
    )]
    Incompatible {
        /// Our version.
        ours: Version,
        /// The peer's version.
        theirs: Version,
        /// The peer's software string, escaped ([`crate::message::escape`]).
        software: String,
    },
}

/// Sends our hello, reads the peer's, and refuses an incompatible major version.
///
/// Both sides call this; on a mismatch the refusing side also tells the peer why (best effort).
pub fn handshake<S: Read + Write + ?Sized>(
    stream: &mut S,
    ours: &Hello,
) -> Result<Hello, HandshakeError> {
    write_frame(stream, &Message::Hello(ours.clone()))?;
    let theirs = match read_frame(stream)? {
        None => return Err(HandshakeError::Closed),
        Some(Message::Hello(h)) => h,
        Some(Message::Error(e)) => return Err(HandshakeError::Rejected(escape(&e.message))),
        Some(other) => return Err(HandshakeError::NotHello(other.name())),
    };
    if !ours.version.is_compatible_with(&theirs.version) {
        let err = HandshakeError::Incompatible {
            ours: ours.version,
            theirs: theirs.version,
            software: theirs.software_escaped(),
        };
        let _ = write_frame(
            stream,
            &Message::error(ErrorKind::Incompatible, err.to_string()),
        );
        return Err(err);
    }
    Ok(theirs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::thread;

    fn hello(major: u16, minor: u16, software: &str) -> Hello {
        Hello {
            version: Version { major, minor },
            software: software.into(),
        }
    }

    #[test]
    fn compatible_peers_learn_each_other() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = thread::spawn(move || handshake(&mut b, &hello(1, 3, "guest")).unwrap());
        let peer = handshake(&mut a, &hello(1, 0, "host")).unwrap();
        assert_eq!(peer, hello(1, 3, "guest"));
        assert_eq!(t.join().unwrap(), hello(1, 0, "host"));
    }

    #[test]
    fn a_major_mismatch_is_refused_on_both_sides_with_a_clear_error() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = thread::spawn(move || handshake(&mut b, &hello(2, 0, "imp-guest 9")));
        let err = handshake(&mut a, &hello(1, 0, "host")).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, HandshakeError::Incompatible { .. }), "{text}");
        assert!(
            text.contains("we speak 1.0") && text.contains("speaks 2.0"),
            "{text}"
        );
        assert!(text.contains("imp-guest 9"), "{text}");
        assert!(matches!(
            t.join().unwrap(),
            Err(HandshakeError::Incompatible { .. })
        ));
    }

    #[test]
    fn a_hostile_peers_software_string_is_escaped_and_bounded_in_the_error() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let evil = format!("guest\u{1b}[2J\n\u{202e}fake\r{}", "x".repeat(100_000));
        let t = thread::spawn(move || handshake(&mut b, &hello(2, 0, &evil)));
        let err = handshake(&mut a, &hello(1, 0, "host")).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("guest\\u{1b}[2J\\n\\u{202e}fake\\r"),
            "{}",
            &text[..200]
        );
        assert!(
            !text.chars().any(|c| c.is_control()),
            "a control character got through"
        );
        assert!(text.len() < 1000, "{} bytes", text.len());
        assert!(text.contains("more bytes)"), "the cut is said");
        let _ = t.join();
        // A refusal's message is the peer's words too.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        write_frame(
            &mut b,
            &Message::error(ErrorKind::Incompatible, "no\u{7}\u{1b}]0;owned\u{7}"),
        )
        .unwrap();
        let err = handshake(&mut a, &hello(1, 0, "host")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Peer rejected the handshake: no\\u{7}\\u{1b}]0;owned\\u{7}"
        );
    }

    #[test]
    fn a_peer_that_does_not_say_hello_is_refused() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        write_frame(&mut b, &Message::Health).unwrap();
        let err = handshake(&mut a, &hello(1, 0, "host")).unwrap_err();
        assert!(matches!(err, HandshakeError::NotHello("health")), "{err}");
    }

    #[test]
    fn a_peer_that_hangs_up_is_reported_as_closed() {
        let (mut a, b) = UnixStream::pair().unwrap();
        drop(b);
        let err = handshake(&mut a, &hello(1, 0, "host")).unwrap_err();
        // Writing to a closed socket may fail first (EPIPE); either is a clear failure.
        assert!(
            matches!(
                err,
                HandshakeError::Closed | HandshakeError::Frame(FrameError::Io { .. })
            ),
            "{err}"
        );
    }
}
