//! The shim's typed API: requests, replies and the event stream on the socket a shim serves in
//! its VM's directory ([`SOCKET_FILE`]), as containerd's shims answer over ttrpc. Both sides
//! use these types and nothing else of each other; `shim::serve` answers, `control::client`
//! asks.
//!
//! One request per connection, one JSON object per line, each carrying the protocol's
//! [`VERSION`]; a shim refuses a version it does not speak, by name, and a caller that finds
//! no socket is talking to a shim of a release before this API (it speaks the files and
//! signals of [`super::contract`], which every shim still honours).
//!
//! | request | replies |
//! |---|---|
//! | [`Request::Watch`] | [`Reply::Event`] with the record as it is, then one per change, until the shim ends (the connection closes) |
//! | [`Request::Stop`] | [`Reply::Accepted`]; the connection stays open until the shim has written the end and exited |
//! | [`Request::Suspend`] | [`Reply::Accepted`] once the supervision loop has the request; the outcome is the record's (`suspending`, then `suspended`, or a `suspend_failure` naming the token), seen by a watch |
//! | [`Request::Snapshot`] | [`Reply::Snapshot`] once the running VM is snapshotted into the request's destination (or failed to be); the VM runs on |
//! | [`Request::Pause`] (version 3) | [`Reply::Accepted`] once the running VM's vCPUs are paused and the record says so (`paused`: a warm pool's member waiting for a claim, which resumes it), or [`Reply::Refused`] with the VM running on |
//! | [`Request::Claim`] (version 2) | [`Reply::Claimed`] once the running guest took the new owner's identity and the record names the new owner (the node's commit of a warm pool's claim), or [`Reply::Refused`] with the VM running on as it was |
//!
//! The socket is in the VM's directory, which only its owner (root, for the node agent) may
//! enter, and the shim answers only callers of its own uid or root (`SO_PEERCRED`).

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};

use super::contract::{SnapshotOutcome, SnapshotRequest};
use super::state::{Owner, VmRecord};

/// The protocol version this build speaks: 2 added [`Request::Claim`], 3 [`Request::Pause`];
/// version 1's requests are answered as before.
pub const VERSION: u32 = 3;

/// The oldest version this build still answers.
pub const OLDEST: u32 = 1;
/// The socket's name in the VM's directory.
pub const SOCKET_FILE: &str = "control.sock";
/// The descriptor under which a shim inherits its listening socket (`--control-fd`), bound by
/// its starter before the shim runs, so a caller can connect from the moment of the spawn.
pub const CONTROL_FD: i32 = 4;
/// The longest line either side reads; a longer one is refused.
pub const MAX_LINE: usize = 1 << 20;

/// What a caller asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// The VM's record now and at every change.
    Watch,
    /// Stop the VM: the workload gets `grace_ms`; with `fail_reason`, the end is a failure
    /// for that reason (a probe failed) rather than the workload's exit.
    Stop {
        /// The grace period, in milliseconds.
        grace_ms: u64,
        /// Why the VM is stopped as failed, if it is.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fail_reason: Option<String>,
    },
    /// Suspend the running VM (its snapshot under the state directory, then its VMM and shim
    /// end); `token` names the request in a failure the record keeps.
    Suspend {
        /// Names the request.
        token: String,
    },
    /// Snapshot the running VM into a new directory; it runs on.
    Snapshot(SnapshotRequest),
    /// Hand the running VM to another owner (a warm pool's claim): the guest takes `identity`
    /// (its link down meanwhile), then the record names `owner`. A paused VM is resumed first.
    Claim(Box<ClaimRequest>),
    /// Pause the running VM's vCPUs until a claim (a warm pool's member waiting: it costs no
    /// CPU meanwhile); the record says `paused`.
    Pause,
}

/// A claim of the running VM by another ImpVM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRequest {
    /// Who the VM belongs to from now on.
    pub owner: Owner,
    /// What the guest becomes: the new owner's hostname and MAC (its address stays).
    pub identity: imp_proto::message::Identity,
}

/// What a claim did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimOutcome {
    /// The record as saved with its new owner.
    pub record: VmRecord,
    /// The guest's identity step, in milliseconds (link down to link up).
    pub guest_ms: u64,
}

/// A request with the version its caller speaks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// The caller's [`VERSION`].
    pub v: u32,
    /// The request.
    #[serde(flatten)]
    pub request: Request,
}

/// What the shim answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    /// The request was taken.
    Accepted,
    /// The VM's record changed (or, first, is as it is).
    Event(Box<Event>),
    /// A snapshot's outcome.
    Snapshot(Box<SnapshotOutcome>),
    /// A claim's outcome: the VM is the new owner's.
    Claimed(Box<ClaimOutcome>),
    /// The request was refused, and why.
    Refused {
        /// Why, in words.
        error: String,
    },
}

/// One change of the VM as its shim knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Counts the changes this shim has made, from 1; a gap means a watcher missed an
    /// intermediate state (it always gets the latest).
    pub seq: u64,
    /// The record after the change.
    pub record: VmRecord,
}

/// Failures of reading or writing a message.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed.
    #[error("{doing} the shim's socket")]
    Io {
        /// What was being done.
        doing: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line was not a message of this protocol.
    #[error("a message on the shim's socket is not valid: {0}")]
    Malformed(String),
    /// The shim refused the request.
    #[error("the shim refused the request: {0}")]
    Refused(String),
    /// The shim answered something this request does not expect.
    #[error("the shim answered {0} to {1}")]
    Unexpected(String, &'static str),
    /// A line was longer than [`MAX_LINE`].
    #[error("a message on the shim's socket is longer than {MAX_LINE} bytes")]
    TooLong,
}

/// Writes `msg` as one line.
pub async fn write<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), WireError> {
    let mut line = serde_json::to_vec(msg).map_err(|e| WireError::Malformed(e.to_string()))?;
    line.push(b'\n');
    w.write_all(&line).await.map_err(|source| WireError::Io {
        doing: "writing to",
        source,
    })?;
    w.flush().await.map_err(|source| WireError::Io {
        doing: "writing to",
        source,
    })
}

/// Reads one line as a `T`; `None` when the other side closed before one began.
pub async fn read<R: AsyncBufRead + Unpin, T: serde::de::DeserializeOwned>(
    r: &mut R,
) -> Result<Option<T>, WireError> {
    let mut line = Vec::new();
    loop {
        let buf = r.fill_buf().await.map_err(|source| WireError::Io {
            doing: "reading from",
            source,
        })?;
        if buf.is_empty() {
            return match line.is_empty() {
                true => Ok(None),
                false => Err(WireError::Malformed(
                    "the line ends without a newline".into(),
                )),
            };
        }
        let (taken, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..taken]);
        r.consume(taken);
        if line.len() > MAX_LINE + 1 {
            return Err(WireError::TooLong);
        }
        if done {
            return serde_json::from_slice(&line)
                .map(Some)
                .map_err(|e| WireError::Malformed(e.to_string()));
        }
    }
}

/// Whether a request of version `v` is one this shim answers, and if not, what it says.
pub fn refuse_version(v: u32) -> Option<String> {
    (!(OLDEST..=VERSION).contains(&v)).then(|| {
        format!(
            "this shim speaks versions {OLDEST} to {VERSION} of its API; the request is version {v}"
        )
    })
}

/// The version a caller sends `request` with: the oldest that has it, so that a shim of an
/// earlier release still answers what it knows, and refuses by version what it does not.
pub fn version_of(request: &Request) -> u32 {
    match request {
        Request::Claim(_) => 2,
        Request::Pause => 3,
        _ => OLDEST,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn requests_have_a_stable_wire_form() {
        let stop = Envelope {
            v: VERSION,
            request: Request::Stop {
                grace_ms: 1500,
                fail_reason: None,
            },
        };
        assert_eq!(
            serde_json::to_string(&Envelope {
                v: version_of(&stop.request),
                ..stop
            })
            .unwrap(),
            r#"{"v":1,"op":"stop","grace_ms":1500}"#
        );
        let watch: Envelope = serde_json::from_str(r#"{"v":1,"op":"watch"}"#).unwrap();
        assert_eq!(watch.request, Request::Watch);
        assert!(serde_json::from_str::<Envelope>(r#"{"v":1,"op":"reboot"}"#).is_err());
    }

    #[test]
    fn another_version_is_refused_by_name() {
        assert_eq!(refuse_version(VERSION), None);
        assert_eq!(refuse_version(OLDEST), None);
        let said = refuse_version(VERSION + 1).unwrap();
        assert!(
            said.contains("versions 1 to 3") && said.contains("version 4"),
            "{said}"
        );
        // A claim goes out as version 2: a shim of version 1 refuses it by version.
        let claim = Request::Claim(Box::new(ClaimRequest {
            owner: Owner {
                namespace: "ci".into(),
                name: "job".into(),
                uid: "u".into(),
                attempt: 0,
                revision: 0,
            },
            identity: imp_proto::message::Identity {
                hostname: Some("job".into()),
                mac: None,
                network: None,
            },
        }));
        assert_eq!(version_of(&claim), 2);
        assert_eq!(version_of(&Request::Pause), 3);
        assert_eq!(version_of(&Request::Watch), 1);
        // The pause's wire form.
        let pause: Envelope = serde_json::from_str(r#"{"v":3,"op":"pause"}"#).unwrap();
        assert_eq!(pause.request, Request::Pause);
    }

    #[tokio::test]
    async fn lines_are_read_whole_and_a_long_one_is_refused() {
        let mut two: &[u8] =
            b"{\"reply\":\"accepted\"}\n{\"reply\":\"refused\",\"error\":\"no\"}\n";
        let mut r = tokio::io::BufReader::with_capacity(4, &mut two);
        assert_eq!(
            read::<_, Reply>(&mut r).await.unwrap(),
            Some(Reply::Accepted)
        );
        assert_eq!(
            read::<_, Reply>(&mut r).await.unwrap(),
            Some(Reply::Refused { error: "no".into() })
        );
        assert_eq!(read::<_, Reply>(&mut r).await.unwrap(), None);
        let long = vec![b'x'; MAX_LINE + 10];
        let mut r = tokio::io::BufReader::new(&long[..]);
        assert!(matches!(
            read::<_, Reply>(&mut r).await,
            Err(WireError::TooLong)
        ));
        let mut cut: &[u8] = b"{\"reply\":";
        let mut r = tokio::io::BufReader::new(&mut cut);
        assert!(matches!(
            read::<_, Reply>(&mut r).await,
            Err(WireError::Malformed(_))
        ));
    }
}
