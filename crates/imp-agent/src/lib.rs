//! The imp node agent as a library: everything the `imp agent` process does on one node.
//!
//! Today it holds [`vmm`], the [`vmm::Vmm`] trait and the Firecracker driver that boots, pauses,
//! snapshots, restores and stops microVMs and connects to their guest vsock ports, and
//! [`image`], which pulls OCI images (registry, layout, archive) into a verified blob
//! cache, builds cached ext4 bases and gives every VM its own disk, and [`runtime`], one VM's
//! life from image to exit under its own supervisor process (the shim), shared by `imp run`
//! and `imp agent`, [`node`], the node agent's reconciler, and [`api`], the authenticated
//! HTTPS API through which people exec in a VM and read its console, and [`net`], the node's
//! bridges, TAPs, VXLAN overlay and nftables rules for ImpNetworks. It is not the binary
//! (that is the `imp` crate), not the operator, and not the in-guest agent (`imp-guest`); it
//! holds no Kubernetes types of its own beyond those of `imp-api`.

pub mod api;
pub mod guest;
pub mod image;
pub mod net;
pub mod node;
pub mod runtime;
pub mod vmm;
