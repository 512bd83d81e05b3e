//! What a guest boots with, made on the host: the initramfs that carries imp-guest (the
//! `imp-guest` crate, PID 1 inside every VM), the kernel modules it loads and each VM's config.
//!
//! [`modules`] finds the modules a VM needs in a kernel's modules directory, dependencies first
//! (Debian's cloud kernel builds virtio, virtio_blk and vsock as modules and ships no
//! modules.dep). [`archive`] writes newc archives: a base per guest binary and module set,
//! built once and cached, and a tiny per-VM archive with `/.imp/config.json` that is appended
//! to it (the kernel unpacks concatenated archives in order).

pub mod archive;
pub mod modules;
