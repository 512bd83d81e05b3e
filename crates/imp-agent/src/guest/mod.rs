//! The host side of the guest: the initramfs that carries imp-guest and the kernel modules it loads.
