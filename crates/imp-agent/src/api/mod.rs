//! The node agent's API for exec, the serial console and the guests' figures, over HTTPS,
//! served to imp's gateway, the operator's aggregated API that the Kubernetes API server
//! proxies users' requests to (`subresources.imp.dev`); and the receiving end of a VM moving
//! to this node, served to the agent of the node it moves from ([`moves`]).
//!
//! No user credential reaches the node. The API server authenticates and authorizes each user
//! as it does for `pods/exec`; the gateway calls this API over mutual TLS, pinned both ways: it
//! accepts only the certificate whose SHA-256 this agent publishes on its Node (annotation
//! `imp.dev/agent-cert-sha256`, next to `imp.dev/agent-endpoint`), and this agent accepts only
//! the client certificates the operator publishes in a ConfigMap ([`auth`]). A bearer token
//! presented here is refused.
//!
//! Rooms: [`route`] parses request paths, [`auth`] decides whether the caller is the gateway,
//! [`tls`] holds the certificate, [`exec`] relays an exec between the caller and the guest
//! agent, [`console`] streams the serial log, [`sessions`] bounds how many of both are open per
//! VM and per user, [`moves`] receives a moving VM's files, [`server`] accepts connections and
//! ties them together, and answers `imp top` with the guests' latest figures. The callers' side
//! (paths, headers, pins, the figures' JSON, the moves' wire and sender) is the crate
//! `imp-agent-api`. How VMs are found is not this module's business: the agent's runtime
//! implements [`VmLookup`], and [`moves::MoveAuthority`] for who may send a move.

pub mod auth;
pub mod console;
pub mod exec;
pub mod moves;
mod reply;
pub mod route;
pub mod server;
pub mod sessions;
pub mod tls;

pub use auth::Gateway;
pub use imp_agent_api::top;
pub use imp_agent_api::{EXEC_UPGRADE, top::GuestReading};
pub use moves::{IncomingMove, MoveAuthority, MoveReceiver, MoveRefusal, Moves};
pub use server::{AgentApi, ApiConfig};
pub use tls::Identity;

/// What the agent API needs to reach one VM's guest agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestEndpoint {
    /// Host Unix socket of the guest's vsock (Firecracker's `CONNECT <port>` protocol).
    pub vsock: std::path::PathBuf,
    /// The guest agent's vsock port.
    pub agent_port: u32,
    /// The serial console log file (appended to while the VM runs).
    pub serial_log: std::path::PathBuf,
    /// Whether the VM runs now (exec is refused with 409 otherwise; console still works).
    pub running: bool,
    /// Whether its guest serves the guest agent (exec is refused with 409 otherwise).
    pub guest_agent: bool,
}

/// Whether a VM that does not run now will run soon without its user asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waking {
    /// It will: scale-to-zero put it to sleep and a wake was asked for now (exec wakes it as
    /// its first packet would), or a suspend or resume is under way.
    Soon,
    /// It will not: it is stopped, failed, starting, or suspended by its user.
    No,
}

/// How the API finds a VM of this node; the agent's runtime implements it.
pub trait VmLookup: Send + Sync + 'static {
    /// The VM `namespace/name` if it is on this node.
    fn find(&self, namespace: &str, name: &str) -> Option<GuestEndpoint>;

    /// Asks VM `namespace/name`, which does not run, to wake if scale-to-zero put it to sleep
    /// (asking again is harmless). Lookups without scale-to-zero wake nothing.
    fn wake(&self, _namespace: &str, _name: &str) -> Waking {
        Waking::No
    }

    /// An exec into running VM `namespace/name` begins: until [`VmLookup::exec_end`] the VM
    /// counts as in use and is not suspended for being idle. False when a suspend has begun
    /// (the exec then waits for it and wakes the VM).
    fn exec_begin(&self, _namespace: &str, _name: &str) -> bool {
        true
    }

    /// An exec that [`VmLookup::exec_begin`] let begin has ended.
    fn exec_end(&self, _namespace: &str, _name: &str) {}

    /// The latest figures of the guests of `namespace`'s VMs on this node, by name (none
    /// where nothing polls the guests).
    fn guest_readings(&self, _namespace: &str) -> Vec<top::GuestReading> {
        Vec::new()
    }
}
