//! The node agent's API for people: a command in a VM (`exec`) and its serial console, over
//! HTTPS, for callers whose Kubernetes bearer token the API server vouches for.
//!
//! It works as the kubelet's own API does for `pods/exec`: every request carries
//! `Authorization: Bearer <token>`, the agent asks the API server who that is (TokenReview) and
//! whether they may `create` the `impvms/exec` or `impvms/console` subresource of that VM
//! (SubjectAccessReview), and refuses with 401 or 403 before anything runs. The certificate is
//! self-signed (or given by files); the agent publishes its SHA-256 on its Node (annotation
//! `imp.dev/agent-cert-sha256`, next to `imp.dev/agent-endpoint`), and clients pin it, so the
//! API server vouches for the agent as it vouches for the caller.
//!
//! Rooms: [`route`] parses request paths, [`auth`] decides who may do what, [`tls`] holds the
//! certificate and the clients' pinning verifier, [`exec`] relays an exec between the caller and
//! the guest agent, [`console`] streams the serial log, [`sessions`] bounds how many of both are
//! open per VM and per caller, [`top`] answers `imp top` with the guests' latest figures,
//! [`server`] accepts connections and ties them together, and
//! [`client`] is the caller's side that the CLI uses. How VMs are found is
//! not this module's business: the agent's runtime implements [`VmLookup`].

pub mod auth;
pub mod client;
pub mod console;
pub mod exec;
pub mod route;
pub mod server;
pub mod sessions;
pub mod tls;
pub mod top;

pub use auth::{Authorizer, KubeReviewer, Reviewer};
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

/// The value of the `Upgrade` header that turns an exec request into the guest protocol.
pub const EXEC_UPGRADE: &str = "imp-exec/1";
