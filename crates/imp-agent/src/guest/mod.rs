//! The host side of the guest: the initramfs that carries imp-guest, the kernel modules it
//! loads and each VM's config.
//!
//! [`kernel`] finds the modules a VM needs in a kernel's modules directory, dependencies first
//! (Debian's cloud kernel builds virtio, virtio_blk and vsock as modules and ships no
//! modules.dep). [`initramfs`] writes newc archives: a base per guest binary and module set,
//! built once and cached, and a tiny per-VM archive with `/.imp/config.json` that is appended
//! to it (the kernel unpacks concatenated archives in order).

pub mod initramfs;
pub mod kernel;
