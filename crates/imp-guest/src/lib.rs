//! The imp guest agent: the static binary that runs as PID 1 inside every imp microVM.
//!
//! It prepares the guest (pseudo filesystems, a check that the kernel has a timer, kernel
//! modules, the switch from the initramfs to the VM's disk, hostname, loopback and a static
//! eth0, resolv.conf), applies the VM's user data ([`userdata`]), runs the image's
//! ENTRYPOINT/CMD with the image's Env, WorkingDir and User plus the VM's env and a default
//! PATH, reaps zombies, forwards SIGTERM/SIGINT, and
//! when the workload ends prints `IMP_EXIT <code>` on the console, reports the code to the
//! host over the guest channel and powers the VM off. Meanwhile it serves exec (streamed, with
//! stdin and TTY), health, metrics, clock setting, graceful shutdown and, for a clone restored
//! from a shared snapshot, a new identity ([`identity`]: entropy, clock, hostname, MAC,
//! address, the source's TCP connections destroyed) over that channel using [`imp_proto`]. The channel is AF_VSOCK under Firecracker ([`transport`]) and, under QEMU, a
//! stream multiplexer over the `imp.mux` virtio-serial port ([`mux`]), which QEMU can snapshot
//! where it cannot migrate its vsock.
//!
//! It is not a container runtime (no namespaces, cgroups or seccomp: the VM is the boundary),
//! not a service manager (one workload), and it uses no async runtime: threads and blocking
//! syscalls keep the static binary small. Everything but the PID 1 system steps also runs
//! as a plain process (`--no-pid1`, Unix sockets instead of vsock) so it is tested without a VM.

pub mod cmdline;
pub mod console;
pub mod entropy;
pub mod exec;
pub mod identity;
pub mod init;
pub mod metrics;
pub mod mux;
pub mod net;
pub mod probe;
pub mod pty;
pub mod reaper;
pub mod server;
pub mod sockdiag;
pub mod system;
pub mod transport;
pub mod user;
pub mod userdata;
pub mod workload;
