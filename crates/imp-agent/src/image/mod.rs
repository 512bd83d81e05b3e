//! Container images on the node: turning OCI image layers into a microVM's root filesystem.
//!
//! [`layers`] applies already-decompressed layer tar streams onto a rootfs directory, treating
//! every layer as untrusted input.

pub mod layers;
