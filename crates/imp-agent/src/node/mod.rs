//! The node agent: what `imp agent` runs on every node.
//!
//! [`capabilities`] probes what the node can run; [`reconciler`] watches the ImpVMs placed on
//! this node and applies [`decide`]'s decisions through the VM runtime
//! ([`crate::runtime`]: one shim per VM, outside the agent's process tree and cgroups);
//! [`boot`] maps an ImpVM and its class to the runtime's spec, with the workload's environment
//! from [`env`], its user data from [`userdata`] (the Secrets and ConfigMaps both read
//! handed out by the operator's gateway, [`inputs`]) and its network wired by [`network`];
//! [`metrics`] serves `/metrics` (to the node itself and to tokens [`metrics_auth`] admits),
//! `/healthz` and `/readyz`, with the guests' figures
//! [`guest_metrics`] polls. [`scale`] runs scale-to-zero on the node, and [`vms`] is what the
//! agent API knows of the node's VMs.
//! [`serial`] relays VMs' serial consoles to the agent's log, escaped and rate-limited.
//! [`advertise`] says what the node can run (its runtimes, its CPU model) to the scheduler, and
//! [`disk`] how much room its state directory has left. [`fence`] renews the agent's Lease and
//! stops the node's VMs when it cannot.

pub mod advertise;
pub mod agent;
pub mod boot;
pub mod capabilities;
pub mod decide;
pub mod disk;
pub mod env;
pub mod fence;
pub mod guest_metrics;
pub mod inputs;
pub mod metrics;
pub mod metrics_auth;
pub mod move_authority;
pub mod network;
pub mod probes;
pub mod reconciler;
pub mod scale;
pub mod serial;
pub mod snapshots;
pub mod trace;
pub mod userdata;
pub mod vms;
