//! The guest's report that its workload ended, on a connection the guest opens to the host.

use crate::frame::{FrameError, read_frame, write_frame};
use crate::handshake::{HandshakeError, handshake};
use crate::message::{ExitStatus, Hello, Message};
use std::io::{Read, Write};

/// Why an exit report could not be delivered or received.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The handshake failed.
    #[error("Exit report handshake failed")]
    Handshake(#[from] HandshakeError),
    /// A frame could not be sent or received.
    #[error("Exit report transfer failed")]
    Frame(#[from] FrameError),
    /// The peer closed the connection early.
    #[error("Peer closed the exit report connection before the {0}")]
    Closed(&'static str),
    /// The peer sent something else.
    #[error("Expected {expected} on the exit report connection, got a {got} message")]
    Unexpected {
        /// What we waited for.
        expected: &'static str,
        /// What arrived.
        got: &'static str,
    },
}

/// Guest side: handshake, send the status, wait for the host's acknowledgement.
pub fn send_exit_report<S: Read + Write>(
    stream: &mut S,
    ours: &Hello,
    status: ExitStatus,
) -> Result<(), ReportError> {
    handshake(stream, ours)?;
    write_frame(stream, &Message::WorkloadExited { status })?;
    match read_frame(stream)? {
        Some(Message::Ack) => Ok(()),
        None => Err(ReportError::Closed("acknowledgement")),
        Some(other) => Err(ReportError::Unexpected {
            expected: "an ack",
            got: other.name(),
        }),
    }
}

/// Host side: handshake, read the status, acknowledge it.
pub fn receive_exit_report<S: Read + Write>(
    stream: &mut S,
    ours: &Hello,
) -> Result<ExitStatus, ReportError> {
    handshake(stream, ours)?;
    match read_frame(stream)? {
        Some(Message::WorkloadExited { status }) => {
            write_frame(stream, &Message::Ack)?;
            Ok(status)
        }
        None => Err(ReportError::Closed("report")),
        Some(other) => Err(ReportError::Unexpected {
            expected: "a workload_exited report",
            got: other.name(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::thread;

    #[test]
    fn an_exit_report_is_delivered_and_acknowledged() {
        let (mut guest, mut host) = UnixStream::pair().unwrap();
        let t = thread::spawn(move || receive_exit_report(&mut host, &Hello::new("host")));
        send_exit_report(&mut guest, &Hello::new("guest"), ExitStatus::Code(3)).unwrap();
        assert_eq!(t.join().unwrap().unwrap(), ExitStatus::Code(3));
    }

    #[test]
    fn a_host_that_hangs_up_without_ack_is_an_error() {
        let (mut guest, mut host) = UnixStream::pair().unwrap();
        let t = thread::spawn(move || {
            handshake(&mut host, &Hello::new("host")).unwrap();
            let _ = read_frame(&mut host).unwrap();
        });
        let err = send_exit_report(&mut guest, &Hello::new("guest"), ExitStatus::Code(0));
        t.join().unwrap();
        assert!(
            matches!(err, Err(ReportError::Closed("acknowledgement"))),
            "{err:?}"
        );
    }
}
