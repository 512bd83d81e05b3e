//! One VM's life on this machine, shared by both front ends (`imp run` and `imp agent`):
//! image → disk → initramfs and guest config → VMM → guest agent ready → exit report →
//! on-disk record → stop and cleanup.
//!
//! Each VM is owned by its own supervisor process, the shim ([`supervisor`], started by
//! [`shim::start`]), as containerd's shim v2 and Kata's shim own a sandbox: the front end writes
//! the VM's [`spec::VmSpec`] into the VM's directory and starts the shim, which moves itself into
//! the VM's own cgroup ([`cgroup`]), boots the VM and writes everything it learns into the VM's
//! record ([`state`]). Front ends find VMs again by reading records and talk to live shims with
//! signals, so a front end may exit, crash or restart and no VM notices; nothing it needs lives
//! only in its memory.

pub mod cgroup;
pub mod console;
pub mod guest_agent;
pub mod progress;
pub mod shim;
pub mod spec;
pub mod state;
pub mod supervisor;
pub mod suspend;
pub mod take;
