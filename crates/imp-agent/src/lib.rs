//! The imp node agent as a library: everything that happens to a VM on one node, used by the
//! `imp agent` process and by `imp run`.
//!
//! Floors, each using only those below it: [`node`], the agent's reconciler (the ImpVMs placed on
//! this node, booted from their booking, with status, Events, metrics and scale-to-zero); then
//! [`runtime`], one VM's life from image to exit under its own supervisor process (the shim),
//! shared by `imp run` and `imp agent`, and [`api`], the authenticated HTTPS API through which
//! people exec in a VM and read its console; then [`snapshot`], a VM's snapshots on the node
//! and in registries, and [`initramfs`], what a guest boots with: the initramfs carrying
//! imp-guest and the kernel modules it loads; at the bottom
//! [`host_fs`], owner-only directories and a filesystem's free space. Below them are
//! crates of their own: `imp-net` (the node's bridges, TAPs, VXLAN overlay and nftables rules,
//! and the sleeping VM's TAP), `imp-vmm` (the `Vmm` trait with its QEMU and Firecracker drivers
//! and the guest channel they share) and `imp-image` (OCI images into a verified blob cache,
//! cached ext4 bases and every VM's own disk).
//!
//! It is not the binary (that is the `imp` crate), not the operator (it never places or resolves
//! a VM), and not the in-guest agent (`imp-guest`); it holds no Kubernetes types of its own
//! beyond those of `imp-api`.

pub mod api;
pub mod host_fs;
pub mod initramfs;
pub mod node;
pub mod runtime;
pub mod snapshot;
