//! One VM's life on this machine, shared by both front ends (`imp run` and `imp agent`):
//! image → disk → initramfs and guest config → VMM → guest agent ready → exit report →
//! on-disk record → stop and cleanup.
//!
//! Each VM is owned by its own supervisor process, the shim ([`shim`], started by
//! [`control::start`]), as containerd's shim v2 and Kata's shim own a sandbox: the front end writes
//! the VM's [`spec::VmSpec`] into the VM's directory and starts the shim, which moves itself into
//! the VM's own cgroup ([`cgroup`]), boots the VM and writes everything it learns into the VM's
//! record ([`state`]). Front ends find VMs again by reading records and talk to live shims with
//! signals, so a front end may exit, crash or restart and no VM notices; nothing it needs lives
//! only in its memory. The names of that contract (files, signals, the inherited descriptor)
//! are in [`contract`]; [`control`] is the front ends' side of it and [`shim`] the shim's, and
//! neither uses the other. The node agent's reconciler reaches all of it through [`Shims`], an
//! async handle that keeps blocking file work off the async runtime.

pub mod cgroup;
pub mod console;
pub mod contract;
pub mod control;
pub mod guest_agent;
pub mod moved;
pub mod progress;
pub mod shim;
pub mod shim_api;
pub mod shims;
pub mod spec;
pub mod state;

pub use shims::{PrivateFile, Shims, ShimsError};
