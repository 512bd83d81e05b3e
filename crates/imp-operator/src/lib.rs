//! The imp operator: decides where every ImpVM runs and keeps its status honest.
//!
//! [`resolve`] merges class ← template ← VM, [`schedule`] picks a node from the per-node usage
//! [`ledger`] keeps, [`lifecycle`] decides restarts, backoff and expiry, [`ipam`] gives every VM
//! on an ImpNetwork its address, [`controller`] runs those against the API server, [`network`]
//! keeps ImpNetwork status (group CIDRs, VTEP table, Ready), [`leader`] makes sure only one replica writes, [`metrics`]
//! serves `/metrics`, `/healthz` and `/readyz`, and [`webhook`] validates and defaults ImpVMs at
//! admission.

pub mod controller;
pub mod ipam;
pub mod leader;
pub mod ledger;
pub mod lifecycle;
pub mod metrics;
pub mod network;
/// Resolution of class ← template ← VM (shared with the node agent, so it lives in imp-api).
pub use imp_api::resolve;
pub mod schedule;
pub mod webhook;
