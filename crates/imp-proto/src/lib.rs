//! The wire protocol between the imp node agent (host) and the imp guest agent (inside the VM).
//!
//! This crate is the message types, the length-prefixed framing over any byte stream (a stream
//! of the guest channel in a VM, a Unix socket in tests), the version handshake, a small
//! synchronous host-side client, the serial-console exit marker, the guest configuration file
//! the host puts in the VM's initramfs, and the frames of [`mux`], the stream multiplexer that
//! carries the guest channel over a virtio-serial port under QEMU (Firecracker gives a vsock).
//! It is not a transport: it opens no sockets, knows nothing of Kubernetes, HTTP or TLS, and
//! needs no async runtime, so the static guest binary stays small (a tokio codec for the same
//! frames is behind the `tokio` feature for the host).
//!
//! A connection starts with both sides sending [`Message::Hello`]; then the host sends one
//! request ([`Message::Exec`], [`Message::Health`], [`Message::Metrics`],
//! [`Message::Shutdown`], since 1.1 [`Message::SetClock`], since 1.2 [`Message::Reidentify`], since 1.3 [`Message::HttpGet`]).
//! A peer that speaks an older minor cannot parse a newer message, so the client checks the
//! guest's hello before sending one ([`Message::since`], [`ClientError::Unsupported`]).
//! Unary requests may be repeated on one connection; an exec takes the connection over until
//! its [`Message::Exit`]. The guest reports its workload's end on a connection of its own to
//! the host with [`Message::WorkloadExited`].

pub mod client;
#[cfg(feature = "tokio")]
pub mod codec;
pub mod config;
pub mod connect;
pub mod frame;
pub mod handshake;
pub mod http;
pub mod marker;
pub mod message;
pub mod mux;
pub mod report;

pub use client::{Client, ClientError, ExecEvent, ExecSession};
pub use config::GuestConfig;
pub use frame::{FrameError, MAX_FRAME_LEN, read_frame, write_frame};
pub use handshake::{HandshakeError, handshake};
pub use message::{
    Entropy, EnvVar, ErrorKind, ErrorReply, ExecRequest, ExitStatus, HealthReport, Hello,
    HttpGetRequest, HttpGetResult, Identity, Message, MetricsReport, ReidentifyReport, Step,
    StepStatus, Version, WindowSize, WorkloadState,
};

/// The protocol version this build speaks; peers with a different major are refused.
pub const PROTOCOL_VERSION: Version = Version { major: 1, minor: 3 };

/// The vsock port the guest agent listens on unless the config says otherwise.
pub const DEFAULT_API_PORT: u32 = 10000;

/// The vsock context id of the host, which the guest connects to for its exit report.
pub const HOST_CID: u32 = 2;
