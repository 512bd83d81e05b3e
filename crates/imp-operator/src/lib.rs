//! The imp operator: decides where every ImpVM runs and keeps its status honest.
//!
//! Each controller has a room named after its kind: [`vm`] resolves class ← template ← VM
//! ([`resolve`]), decides restarts, backoff and expiry (`vm::lifecycle`), places and books each
//! VM (`status.booking`: the class and resolved spec its node agent boots) and runs it against
//! the API server; [`network`] keeps ImpNetwork status (group CIDRs, VTEP table, Ready);
//! [`snapshot`] runs ImpVMSnapshot schedules (executions on a cron, retention, base election);
//! [`warmpool`] keeps each ImpWarmPool's members, VMs restored from its snapshot's base, running;
//! [`migration`] moves a VM to another node through its status and one commit write.
//! What every controller that places a VM shares (the VM controller today; pools and migration
//! next) sits in [`placement`]: the scheduler's pick, the per-node ledger, reservation Pods
//! and node fencing; [`ipam`] gives every VM on an ImpNetwork its address. [`gateway`] is imp's
//! aggregated API (exec, console, guest figures, a node's inputs), [`webhook`] validates and
//! defaults at admission with a certificate it can make, rotate and publish itself
//! ([`webhook::certs`]), [`leader`] makes sure only one replica writes, [`metrics`] holds the
//! operator's figures, and [`process`] assembles them all into the operator process from one
//! config.
//!
//! It is not the node agent: it never touches a node, boots nothing and reads no VM's local
//! state; everything it decides is written to the API, and what it keeps in memory (caches, the
//! ledger) is rebuilt from the API after a restart. It is not the binary either (`imp operator`
//! in the `imp` crate turns its flags into a [`process::Config`] and calls [`process::run`]), nor
//! what takes a snapshot (the node agent executes them), and the runner pool kind has no
//! controller yet ([`unsupported`] says so).

/// The field manager of the controllers' writes (VMs, networks, snapshots); the webhook's
/// certificates, the leader Lease and the unsupported kinds' notes write under their own.
pub const FIELD_MANAGER: &str = "imp-operator";

pub mod api_call;
mod chain;
pub mod gateway;
pub mod ipam;
pub mod leader;
pub mod metrics;
pub mod migration;
pub mod names;
pub mod network;
pub mod placement;
pub mod process;
/// Resolution of class ← template ← VM (in imp-api, beside the types it merges; the node agent
/// does not resolve: it boots the booking the operator wrote from it).
pub use imp_api::resolve;
pub mod shutdown;
pub mod snapshot;
pub mod unsupported;
pub mod vm;
pub mod warmpool;
pub mod webhook;
