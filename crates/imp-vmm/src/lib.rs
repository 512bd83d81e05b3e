//! Virtual machine monitors: one trait, [`Vmm`], and a driver per VMM.
//!
//! The node agent drives every VM through [`Vmm`], so the reconciler does not care whether a VM
//! runs under Firecracker ([`firecracker`]) or QEMU ([`qemu`]). The shared config types
//! describe a VM in VMM-neutral terms; each driver maps them onto its own API. The host side of
//! hybrid vsock ([`vsock`]) is shared by both drivers: Firecracker speaks the `CONNECT <port>`
//! protocol itself, and the QEMU driver's guest-channel mux serves the same sockets.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

pub mod firecracker;
pub mod jail;
pub mod kvm;
pub mod qemu;
#[cfg(test)]
mod scratch;
pub mod uds;
pub mod version;
pub mod vsock;

/// What [`Vmm::stop`] waits beyond the grace period: the guest gives its workload the whole
/// grace, then needs a moment to sync its disk and power off.
pub const POWER_OFF_MARGIN: Duration = Duration::from_secs(3);

/// How the VM should look: what every driver needs to boot it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// Unique name on this node; names the VMM's files and, under a jailer, its jail.
    pub id: String,
    /// Directory that holds the VMM's sockets and logs (created if missing).
    pub run_dir: PathBuf,
    /// Number of virtual CPUs.
    pub vcpus: u8,
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// Guest kernel image (an uncompressed ELF `vmlinux` for Firecracker on x86_64).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub kernel_args: String,
    /// Block devices, in the order the guest should see them.
    pub drives: Vec<DriveConfig>,
    /// Optional network interface backed by a host TAP device.
    pub net: Option<NetConfig>,
    /// Optional virtio-vsock device.
    pub vsock: Option<VsockConfig>,
    /// Network namespace (a name under `/var/run/netns`) the VMM runs in, where its TAP lives.
    pub netns: Option<String>,
    /// Run the VMM confined, as this user (QEMU: a [`jail`] of its own with a seccomp
    /// sandbox; Firecracker ignores it: its launcher's jailer confines it); `None` runs it as
    /// the caller (the driver's own tests, the KVM probe).
    pub confine: Option<Confine>,
    /// Where the guest's RAM lives (QEMU; Firecracker keeps its own and maps a snapshot's
    /// memory file on restore by itself).
    pub memory: GuestMemory,
}

/// Where a guest's RAM lives, which decides what a snapshot must write and what a restore
/// must read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GuestMemory {
    /// The VMM's own anonymous memory: a snapshot streams all of it into its memory file and
    /// a restore reads it all back before the guest runs.
    #[default]
    Anonymous,
    /// A file on disk mapped shared: the guest's writes land in the file (the kernel writes
    /// them back like any dirty page cache), so a snapshot of a paused VM stores only its
    /// device state, the file being its memory, and a restore maps the file again and
    /// faults pages in as the guest touches them.
    Shared(PathBuf),
    /// A snapshot's memory image mapped private (copy-on-write): the file is opened
    /// read-only and never written, the guest's writes stay in its own pages, and every VM
    /// restored from one image shares the pages it has not written. QEMU ≥ 8.2 only
    /// ([`qemu::PRIVATE_READ_ONLY_RAM`]): 7.2 opens the file read-write even to map it private.
    Private(PathBuf),
}

impl GuestMemory {
    /// The file the RAM is mapped from, if any.
    pub fn file(&self) -> Option<&Path> {
        match self {
            GuestMemory::Anonymous => None,
            GuestMemory::Shared(p) | GuestMemory::Private(p) => Some(p),
        }
    }
}

/// The uid and gid a confined VMM runs as: never root, one per VM so that one VMM cannot
/// reach another's files or processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confine {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
}

/// One virtio block device backed by a host file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveConfig {
    /// Drive name, unique within the VM.
    pub id: String,
    /// Host file (raw image or filesystem) that backs the drive.
    pub path: PathBuf,
    /// Whether the guest may only read it.
    pub read_only: bool,
    /// Whether this is the guest's root device (at most one).
    pub root: bool,
}

/// One virtio network device backed by a host TAP device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Interface name, unique within the VM.
    pub id: String,
    /// Name of the TAP device on the host (inside [`VmConfig::netns`] if set); it must exist.
    pub tap: String,
    /// Guest MAC address as `aa:bb:cc:dd:ee:ff`; the VMM picks one when `None`.
    pub mac: Option<String>,
    /// The TAP already open (QEMU only; Firecracker opens `tap` by name): the VMM inherits
    /// this fd instead of opening `tap`,
    /// e.g. from whoever held the TAP while the VM slept (a held TAP cannot be opened again).
    pub tap_fd: Option<TapFd>,
}

/// An open TAP file descriptor handed to the VMM process.
#[derive(Debug, Clone)]
pub struct TapFd(pub std::sync::Arc<std::os::fd::OwnedFd>);

impl PartialEq for TapFd {
    fn eq(&self, other: &Self) -> bool {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd() == other.0.as_raw_fd()
    }
}

impl Eq for TapFd {}

/// The virtio-vsock device of a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's context id (3 or more).
    pub guest_cid: u32,
}

/// Where a full snapshot lives on the host: the device state and the guest memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFiles {
    /// The VMM's serialized device and vCPU state.
    pub state: PathBuf,
    /// The guest memory image.
    pub memory: PathBuf,
}

/// What the VM is doing, as far as the driver knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// The guest's vCPUs run.
    Running,
    /// The guest's vCPUs are stopped; memory and devices are kept.
    Paused,
    /// The VMM process has exited.
    Stopped,
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Stopped => "stopped",
        })
    }
}

/// How a VM ended, reported by [`Vmm::stop`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopOutcome {
    /// The VMM exited on its own within the grace period (the guest shut down).
    Graceful,
    /// The grace period ran out (or was zero) and the VMM process was killed.
    Killed,
}

/// One running (or paused) VM under some VMM; the node agent's only way to touch a VM.
///
/// A driver is constructed with [`Vmm::boot`] or [`Vmm::restore`]; dropping it kills the VMM
/// process, so a panic or an early return never leaks a VM. Methods return `Send` futures so
/// the agent can run them on a multi-threaded runtime.
pub trait Vmm: Sized + Send {
    /// Driver-wide settings: binaries, jailer, timeouts.
    type Launcher: Send + Sync;
    /// A byte stream to a port of the guest's vsock.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The driver's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Starts a VMM process and boots `config`'s kernel in it.
    fn boot(
        launcher: &Self::Launcher,
        config: &VmConfig,
    ) -> impl Future<Output = Result<Self, Self::Error>> + Send;

    /// Starts a new VMM process and loads `snapshot` into it, resuming the guest if `resume`.
    ///
    /// `config` is the config the VM was booted with: drives, TAP and vsock must be present
    /// again where the snapshot expects them.
    fn restore(
        launcher: &Self::Launcher,
        config: &VmConfig,
        snapshot: &SnapshotFiles,
        resume: bool,
    ) -> impl Future<Output = Result<Self, Self::Error>> + Send;

    /// Stops the guest's vCPUs.
    fn pause(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Lets a paused guest's vCPUs run again.
    fn resume(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Connects (`up`) or disconnects the guest's network interface from its backend, as
    /// pulling a cable would: the guest sees its carrier go, and nothing it sends leaves
    /// (a restored clone is kept off the network until it has its own identity).
    fn set_link(&mut self, up: bool) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Writes a full snapshot (state and memory) of a paused VM to `files`.
    fn snapshot(
        &mut self,
        files: &SnapshotFiles,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Asks the guest to shut down, giving its workload `grace`; waits that long plus
    /// [`POWER_OFF_MARGIN`], then kills the VMM process. A zero grace kills at once.
    fn stop(self, grace: Duration)
    -> impl Future<Output = Result<StopOutcome, Self::Error>> + Send;

    /// Opens a stream to guest vsock `port`, retrying until the guest listens or `timeout` ends.
    fn connect_vsock(
        &self,
        port: u32,
        timeout: Duration,
    ) -> impl Future<Output = Result<Self::Stream, Self::Error>> + Send;

    /// The host Unix socket of the guest's vsock (`CONNECT <port>`), if the VM has one;
    /// guest connections to host port P arrive on [`vsock::host_listener_path`] of it.
    fn vsock_path(&self) -> Option<PathBuf>;

    /// The file that receives the guest's serial console.
    fn serial_log_path(&self) -> &Path;

    /// Whether the VMM process has exited (the guest powered off or crashed); reaps it.
    ///
    /// Polled by supervisors that must notice a VM ending on its own.
    fn exited(&mut self) -> Result<bool, Self::Error>;

    /// What the driver believes the VM is doing.
    fn state(&self) -> VmState;

    /// The host process id of the VMM, while it runs.
    fn pid(&self) -> Option<u32>;

    /// Processes besides the VMM that serve this VM, so whoever cleans up after a dead
    /// supervisor can end them too (none today).
    fn helper_pids(&self) -> Vec<u32> {
        Vec::new()
    }
}
