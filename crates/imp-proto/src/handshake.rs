//! The version handshake that opens every connection.

use crate::frame::{FrameError, read_frame, write_frame};
use crate::message::{ErrorKind, Hello, Message, Version};
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
    /// The peer rejected us and said why.
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
        /// The peer's software string.
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
        Some(Message::Error(e)) => return Err(HandshakeError::Rejected(e.message)),
        Some(other) => return Err(HandshakeError::NotHello(other.name())),
    };
    if !ours.version.is_compatible_with(&theirs.version) {
        let err = HandshakeError::Incompatible {
            ours: ours.version,
            theirs: theirs.version,
            software: theirs.software,
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
