//! Wake on traffic, the file descriptors: a [`Sleeper`] holds a suspended VM's persistent TAP
//! open in the VMM's place, answers ARP for the VM, holds the frames that arrive for it and
//! says when the first one came; [`Sleeper::hand_over`] gives the TAP back for the resume; and
//! [`inject`] delivers the held frames into the VM once a VMM holds the TAP again.
//!
//! Why the TAP must be held: a TAP that no process has open has no carrier and drops every
//! frame sent to it, and a neighbour with a cold cache never even sends the first IPv4 frame
//! unless someone answers its ARP request. The decisions are in [`super::wake`]; this module
//! only moves bytes. Everything is non-blocking on the tokio runtime (an [`AsyncFd`] on the
//! TAP and on the packet socket; opening the TAP runs on the blocking pool).
//!
//! Going to sleep: [`Sleeper::hold`] attaches by name once the VMM is gone; [`Sleeper::hold_fd`]
//! adopts a descriptor already attached (a `dup` of the one given to QEMU), so the TAP never
//! loses its carrier and the bridge never stops forwarding to it.
//!
//! Order of a resume that keeps every frame (see docs/suspend.md, "Wake on traffic"):
//! 1. [`Sleeper::woken`] resolves (or the user asked for `Running`).
//! 2. QEMU: [`Sleeper::hand_over`] with [`Release::KeepOpen`], then [`inject`] at once: the
//!    held frames queue in the TAP, in order, ahead of anything newer, and wait there. Start
//!    QEMU with the fd inherited (`-netdev tap,fd=N`); it reads them when the guest runs.
//!    Firecracker opens the TAP by name, which fails with EBUSY while anyone holds it:
//!    [`Release::Close`] just before the snapshot load, and [`inject`] once Firecracker has
//!    the TAP (frames arriving in between are lost; their senders retransmit).
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tokio::io::unix::AsyncFd;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::tap::index_of;
use super::wake::{Action, Counters, HoldBounds, Sleep, SleepingVm};

const TUN_PATH: &str = "/dev/net/tun";
/// Larger than any frame a TAP without offloads gives (MTU ≤ 65535).
const READ_BUFFER: usize = 65_536 + 64;
/// Frames read per wake-up of the reader before it checks for a hand-over again.
const BATCH: usize = 64;
/// Frames read at most while stopping (what is queued in the TAP at that moment).
const DRAIN_LIMIT: usize = 4096;

/// Why a sleeping VM's TAP could not be held, read, handed over or injected into.
#[derive(Debug, thiserror::Error)]
pub enum SleepError {
    /// There is no interface of that name.
    #[error("TAP {tap} does not exist")]
    Missing {
        /// The TAP.
        tap: String,
    },
    /// `/dev/net/tun` could not be opened or attached to the TAP (EBUSY: a VMM still holds it).
    #[error("Attaching to TAP {tap}")]
    Attach {
        /// The TAP.
        tap: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A descriptor given to [`Sleeper::hold_fd`] is not attached to that TAP as expected.
    #[error("The descriptor given for TAP {tap} is {found}")]
    NotTheTap {
        /// The TAP.
        tap: String,
        /// What it is instead.
        found: String,
    },
    /// The interface is a TAP that would vanish when released: not one of the node's.
    #[error("TAP {tap} is not persistent")]
    NotPersistent {
        /// The TAP.
        tap: String,
    },
    /// Reading a frame failed (the TAP was deleted, …).
    #[error("Reading frames from TAP {tap}")]
    Read {
        /// The TAP.
        tap: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The reader task is gone (it failed, or the runtime is shutting down).
    #[error("The reader of TAP {tap} ended")]
    Ended {
        /// The TAP.
        tap: String,
    },
    /// The packet socket for [`inject`] could not be made.
    #[error("Opening a packet socket on {interface}")]
    Socket {
        /// The interface.
        interface: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A held frame could not be sent into the VM.
    #[error("Sending held frame {index} of {total} ({len} bytes) into {interface}")]
    Send {
        /// The interface.
        interface: String,
        /// Its place among the frames, from 0.
        index: usize,
        /// How many frames there were.
        total: usize,
        /// Its length.
        len: usize,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// The frame that woke a sleeping VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Woken {
    /// Its source address.
    pub source: Ipv4Addr,
    /// Its IP protocol number.
    pub protocol: u8,
    /// When it was read.
    pub at: Instant,
}

/// What to do with the TAP's file descriptor on hand-over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Return it open, for a VMM that inherits it (QEMU `-netdev tap,fd=N`). Frames that
    /// arrive meanwhile wait in the TAP's queue for whoever reads it next.
    KeepOpen,
    /// Close it, for a VMM that opens the TAP by name (Firecracker).
    Close,
}

/// What a [`Sleeper`] gives back.
#[derive(Debug)]
pub struct Handover {
    /// The held frames, oldest first: [`inject`] them.
    pub frames: Vec<Vec<u8>>,
    /// The TAP, attached (`IFF_TAP | IFF_NO_PI`, non-blocking, close-on-exec: clear that in
    /// the VMM's child), with [`Release::KeepOpen`].
    pub tap: Option<OwnedFd>,
    /// What happened to the frames read.
    pub counters: Counters,
    /// The wake, if one came.
    pub woken: Option<Woken>,
}

/// One sleeping VM's TAP, held open and read by a task of its own until [`Sleeper::hand_over`].
/// Dropping it stops the task, which closes the TAP (on the blocking pool).
pub struct Sleeper {
    tap: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<Parked, SleepError>>,
    woken: watch::Receiver<Option<Woken>>,
    counters: Arc<Mutex<Counters>>,
}

/// What the reader task returns when stopped.
struct Parked {
    tap: File,
    sleep: Sleep,
}

impl Sleeper {
    /// Attaches to the existing persistent TAP `tap` of the sleeping `vm` and starts reading
    /// it. Fails with [`SleepError::Attach`] (EBUSY) while a VMM still holds it.
    ///
    /// The TAP has no carrier between the VMM's exit and this attach, and the bridge forwards
    /// to it again only once the kernel's link watcher has seen the carrier come back
    /// (milliseconds here, but the kernel may defer that by up to a second when other links
    /// changed just before): frames in that window are lost and their senders retransmit.
    /// [`Sleeper::hold_fd`] avoids the window.
    pub async fn hold(
        tap: &str,
        vm: SleepingVm,
        bounds: HoldBounds,
    ) -> Result<Sleeper, SleepError> {
        let name = tap.to_owned();
        let file = tokio::task::spawn_blocking(move || attach(&name))
            .await
            .map_err(|_| SleepError::Ended {
                tap: tap.to_owned(),
            })??;
        Sleeper::start(tap, file, vm, bounds)
    }

    /// Like [`Sleeper::hold`], on a descriptor already attached to TAP `tap` (`IFF_TAP |
    /// IFF_NO_PI`, no virtio-net header): the fd kept from a hand-over, or a duplicate of the
    /// one given to a VMM that has exited. The TAP never loses its carrier, so the bridge
    /// never stops forwarding to it.
    pub async fn hold_fd(
        tap: &str,
        fd: OwnedFd,
        vm: SleepingVm,
        bounds: HoldBounds,
    ) -> Result<Sleeper, SleepError> {
        let file = adopt(tap, fd)?;
        Sleeper::start(tap, file, vm, bounds)
    }

    fn start(
        tap: &str,
        file: File,
        vm: SleepingVm,
        bounds: HoldBounds,
    ) -> Result<Sleeper, SleepError> {
        // SAFETY: the File owns its descriptor, which stays open and the same until the
        // AsyncFd is dropped or unwrapped.
        let fd = unsafe { AsyncFd::register(file) }.map_err(|e| SleepError::Attach {
            tap: tap.to_owned(),
            source: e.into(),
        })?;
        let (stop, stopped) = oneshot::channel();
        let (woke, woken) = watch::channel(None);
        let counters = Arc::new(Mutex::new(Counters::default()));
        let reader = Reader {
            tap: tap.to_owned(),
            fd,
            sleep: Sleep::new(vm, bounds),
            woke,
            counters: counters.clone(),
        };
        tracing::info!(tap, vm_ip = %vm.ip, vm_mac = %vm.mac, max_frames = bounds.max_frames, max_bytes = bounds.max_bytes, "holding a sleeping VM's TAP");
        Ok(Sleeper {
            tap: tap.to_owned(),
            stop: Some(stop),
            task: tokio::spawn(reader.run(stopped)),
            woken,
            counters,
        })
    }

    /// The TAP held.
    pub fn tap(&self) -> &str {
        &self.tap
    }

    /// Resolves with the first IPv4 frame for the VM (at once if it came already). Fails
    /// with [`SleepError::Ended`] if the reader stopped before one came ([`Sleeper::hand_over`]
    /// then says why).
    pub async fn woken(&self) -> Result<Woken, SleepError> {
        let mut rx = self.woken.clone();
        let ended = || SleepError::Ended {
            tap: self.tap.clone(),
        };
        let w = rx.wait_for(Option::is_some).await.map_err(|_| ended())?;
        (*w).ok_or_else(ended)
    }

    /// A receiver that turns `Some` when a frame wakes the VM, for a task that waits while
    /// the sleeper itself stays where it is kept.
    pub fn wake_signal(&self) -> watch::Receiver<Option<Woken>> {
        self.woken.clone()
    }

    /// The wake, if a frame woke the VM already.
    pub fn woken_now(&self) -> Option<Woken> {
        *self.woken.borrow()
    }

    /// The counters so far (updated after every batch of frames read).
    pub fn counters(&self) -> Counters {
        *self.counters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops reading (after taking in what is already queued in the TAP) and gives the TAP
    /// up: the held frames, the counters, and the fd with [`Release::KeepOpen`].
    pub async fn hand_over(mut self, release: Release) -> Result<Handover, SleepError> {
        if let Some(stop) = self.stop.take() {
            // The task may have ended on its own: its result says why.
            let _ = stop.send(());
        }
        let parked = (&mut self.task).await.map_err(|_| SleepError::Ended {
            tap: self.tap.clone(),
        })??;
        let woken = *self.woken.borrow();
        let (frames, counters, _) = parked.sleep.finish();
        let tap = match release {
            Release::KeepOpen => Some(OwnedFd::from(parked.tap)),
            Release::Close => {
                close(parked.tap).await;
                None
            }
        };
        tracing::info!(tap = %self.tap, held = frames.len(), arp_replies = counters.arp_replies, overflow = counters.overflow_frames, dropped = counters.dropped_total(), ?release, "handed a sleeping VM's TAP over");
        Ok(Handover {
            frames,
            tap,
            counters,
            woken,
        })
    }
}

/// Closes a TAP descriptor on the blocking pool: detaching from a TAP waits for an RCU grace
/// period (`synchronize_net`), milliseconds to tens of milliseconds.
pub async fn close(fd: impl Into<OwnedFd>) {
    let fd: OwnedFd = fd.into();
    let _ = tokio::task::spawn_blocking(move || drop(fd)).await;
}

/// The reader task's state.
struct Reader {
    tap: String,
    fd: AsyncFd<File>,
    sleep: Sleep,
    woke: watch::Sender<Option<Woken>>,
    counters: Arc<Mutex<Counters>>,
}

impl Reader {
    async fn run(mut self, mut stop: oneshot::Receiver<()>) -> Result<Parked, SleepError> {
        let mut buf = vec![0u8; READ_BUFFER];
        let outcome = match self.serve(&mut stop, &mut buf).await {
            Ok(true) => self.drain(&mut buf).map(|()| true),
            other => other,
        };
        match outcome {
            Ok(true) => Ok(Parked {
                tap: self.fd.into_inner(),
                sleep: self.sleep,
            }),
            Ok(false) => {
                close(self.fd.into_inner()).await;
                tracing::info!(tap = %self.tap, "stopped holding a sleeping VM's TAP");
                Err(SleepError::Ended { tap: self.tap })
            }
            Err(e) => {
                close(self.fd.into_inner()).await;
                tracing::warn!(tap = %self.tap, error = %super::chain(&e), "stopped holding a sleeping VM's TAP");
                Err(e)
            }
        }
    }

    /// Reads until a hand-over (true) or the [`Sleeper`]'s drop (false).
    async fn serve(
        &mut self,
        stop: &mut oneshot::Receiver<()>,
        buf: &mut [u8],
    ) -> Result<bool, SleepError> {
        loop {
            tokio::select! {
                biased;
                asked = &mut *stop => return Ok(asked.is_ok()),
                ready = self.fd.readable() => {
                    let mut guard = ready.map_err(|e| read_error(&self.tap, e))?;
                    let out = self.fd.get_ref();
                    let frames = read_batch(&mut guard, buf, BATCH, |f| {
                        on_frame(&self.tap, out, &mut self.sleep, &self.woke, f)
                    });
                    drop(guard);
                    self.publish();
                    frames.map_err(|e| read_error(&self.tap, e))?;
                }
            }
        }
    }

    /// Takes in what the TAP holds right now, without waiting for more.
    fn drain(&mut self, buf: &mut [u8]) -> Result<(), SleepError> {
        for _ in 0..DRAIN_LIMIT {
            match self.fd.get_ref().read(buf) {
                Ok(n) => on_frame(
                    &self.tap,
                    self.fd.get_ref(),
                    &mut self.sleep,
                    &self.woke,
                    &buf[..n],
                ),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(read_error(&self.tap, e)),
            }
        }
        self.publish();
        Ok(())
    }

    fn publish(&self) {
        *self.counters.lock().unwrap_or_else(PoisonError::into_inner) = self.sleep.counters();
    }
}

fn read_error(tap: &str, source: io::Error) -> SleepError {
    SleepError::Read {
        tap: tap.to_owned(),
        source,
    }
}

/// Reads up to `max` frames while the TAP has them, giving each to `each`.
fn read_batch(
    guard: &mut tokio::io::unix::AsyncFdReadyGuard<'_, File>,
    buf: &mut [u8],
    max: usize,
    mut each: impl FnMut(&[u8]),
) -> io::Result<()> {
    for _ in 0..max {
        match guard.try_io(|fd| fd.get_ref().read(buf)) {
            Ok(Ok(n)) => each(&buf[..n]),
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Err(e),
            // Readiness cleared: the reader waits for the next frame.
            Err(_would_block) => return Ok(()),
        }
    }
    Ok(())
}

/// Applies the decision about one frame: writes the ARP reply into the TAP (`out`), or
/// announces the wake.
fn on_frame(
    tap: &str,
    out: &File,
    sleep: &mut Sleep,
    woke: &watch::Sender<Option<Woken>>,
    frame: &[u8],
) {
    match sleep.on_frame(frame) {
        Action::None => {}
        Action::Reply(reply) => match (&*out).write(&reply) {
            Ok(n) if n == reply.len() => tracing::debug!(tap, "answered ARP for a sleeping VM"),
            Ok(n) => {
                sleep.reply_failed();
                tracing::warn!(
                    tap,
                    written = n,
                    "an ARP reply for a sleeping VM was cut short"
                );
            }
            Err(e) => {
                sleep.reply_failed();
                tracing::warn!(tap, error = %imp_api::chain::DisplayChain(&e), "writing an ARP reply for a sleeping VM");
            }
        },
        Action::Wake(w) => {
            let woken = Woken {
                source: w.source,
                protocol: w.protocol,
                at: Instant::now(),
            };
            woke.send_replace(Some(woken));
            tracing::info!(tap, source = %w.source, protocol = w.protocol, "a frame for a sleeping VM: waking it");
        }
    }
}

/// Checks that `tap` exists, opens `/dev/net/tun` non-blocking and attaches it to the TAP;
/// refuses a TAP that is not persistent. Blocking: runs on the blocking pool.
fn attach(tap: &str) -> Result<File, SleepError> {
    let attach_err = |source| SleepError::Attach {
        tap: tap.to_owned(),
        source,
    };
    let name = ifname(tap).map_err(attach_err)?;
    if index_of(tap).is_none() {
        return Err(SleepError::Missing {
            tap: tap.to_owned(),
        });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(TUN_PATH)
        .map_err(attach_err)?;
    // SAFETY: ifreq is a plain C struct (name array + union of plain fields); all-zero is a
    // valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    req.ifr_name = name;
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF takes a pointer to an ifreq that lives for the call; the fd is ours.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(attach_err(io::Error::last_os_error()));
    }
    // SAFETY: as above; TUNGETIFF fills the ifreq in.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF, &mut req) } < 0 {
        return Err(attach_err(io::Error::last_os_error()));
    }
    // SAFETY: TUNGETIFF wrote the flags member of the union.
    let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags });
    if flags & libc::IFF_PERSIST == 0 {
        // It vanished and TUNSETIFF made a new one, which goes away with `file`.
        return Err(SleepError::NotPersistent {
            tap: tap.to_owned(),
        });
    }
    Ok(file)
}

/// Checks that `fd` is attached to TAP `tap` with the flags this module reads frames with,
/// and makes it non-blocking.
fn adopt(tap: &str, fd: OwnedFd) -> Result<File, SleepError> {
    let attach_err = |source| SleepError::Attach {
        tap: tap.to_owned(),
        source,
    };
    let name = ifname(tap).map_err(attach_err)?;
    // SAFETY: ifreq is a plain C struct; all-zero is a valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    // SAFETY: TUNGETIFF fills in the ifreq, which lives for the call; the fd is ours.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNGETIFF, &mut req) } < 0 {
        let e = io::Error::last_os_error();
        return Err(SleepError::NotTheTap {
            tap: tap.to_owned(),
            found: format!("not a TAP ({e})"),
        });
    }
    // SAFETY: TUNGETIFF wrote the flags member of the union.
    let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags });
    let wanted = libc::IFF_TAP | libc::IFF_NO_PI;
    if req.ifr_name != name || flags & (wanted | libc::IFF_VNET_HDR) != wanted {
        let found: Vec<u8> = req
            .ifr_name
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        return Err(SleepError::NotTheTap {
            tap: tap.to_owned(),
            found: format!(
                "attached to {:?} with flags {flags:#x} (want {wanted:#x}, no IFF_VNET_HDR)",
                String::from_utf8_lossy(&found)
            ),
        });
    }
    // SAFETY: fcntl on a descriptor we own, with integer arguments.
    let status = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if status < 0
        || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, status | libc::O_NONBLOCK) } < 0
    {
        return Err(attach_err(io::Error::last_os_error()));
    }
    Ok(File::from(fd))
}

/// An interface name as the kernel's `IFNAMSIZ` array.
fn ifname(name: &str) -> io::Result<[libc::c_char; libc::IFNAMSIZ]> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} is empty, has a NUL or is longer than 15 bytes"),
        ));
    }
    let mut out = [0 as libc::c_char; libc::IFNAMSIZ];
    for (dst, src) in out.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(out)
}

/// An `AF_PACKET` socket bound to one interface: what it sends is transmitted on that
/// interface (on a TAP: into the VM); with a protocol, it also receives that EtherType.
/// Closing one waits for an RCU grace period: a drop hands the close to the blocking pool.
pub struct PacketSocket {
    fd: Option<AsyncFd<OwnedFd>>,
}

impl Drop for PacketSocket {
    fn drop(&mut self) {
        if let Some(fd) = self.fd.take() {
            let fd = fd.into_inner();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn_blocking(move || drop(fd));
            }
        }
    }
}

impl PacketSocket {
    /// Binds to `interface`; `ethertype` 0 receives nothing, `ETH_P_ALL` (3) everything.
    pub fn bind(interface: &str, ethertype: u16) -> io::Result<PacketSocket> {
        let index = index_of(interface)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no interface of that name"))?;
        let protocol = ethertype.to_be();
        // SAFETY: socket(2) with constant arguments; the result is checked.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                i32::from(protocol),
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_ll is a plain C struct; all-zero is a valid value for it.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as libc::c_ushort;
        addr.sll_protocol = protocol;
        addr.sll_ifindex = i32::try_from(index).map_err(io::Error::other)?;
        // SAFETY: `addr` is a valid sockaddr_ll and the length is its size.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast::<libc::sockaddr>(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if bound < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd owns its descriptor, which stays open and the same until the
        // AsyncFd is dropped.
        let fd = unsafe { AsyncFd::register(fd) }?;
        Ok(PacketSocket { fd: Some(fd) })
    }

    fn fd(&self) -> io::Result<&AsyncFd<OwnedFd>> {
        self.fd
            .as_ref()
            .ok_or_else(|| io::Error::other("the packet socket is closed"))
    }

    /// Transmits one whole Ethernet frame.
    pub async fn send(&self, frame: &[u8]) -> io::Result<()> {
        loop {
            let mut guard = self.fd()?.writable().await?;
            let sent = guard.try_io(|fd| {
                // SAFETY: `frame` is valid for reads of its length for the call.
                let n =
                    unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            });
            if let Ok(result) = sent {
                return result;
            }
        }
    }

    /// Receives one frame into `buf`; returns its length (cut to `buf`).
    pub async fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd()?.readable().await?;
            let got = guard.try_io(|fd| {
                // SAFETY: `buf` is valid for writes of its length for the call.
                let n =
                    unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                usize::try_from(n).map_err(|_| io::Error::last_os_error())
            });
            if let Ok(result) = got {
                return result;
            }
        }
    }
}

/// Delivers `frames`, in order, INTO the VM behind TAP `tap` (an `AF_PACKET` send on the TAP
/// is what its reader, the VMM, reads). A VMM, or the handed-over fd, must hold the TAP: one
/// that nobody holds has no carrier and drops them.
pub async fn inject(tap: &str, frames: &[Vec<u8>]) -> Result<(), SleepError> {
    if frames.is_empty() {
        return Ok(());
    }
    let socket = PacketSocket::bind(tap, 0).map_err(|source| SleepError::Socket {
        interface: tap.to_owned(),
        source,
    })?;
    for (index, frame) in frames.iter().enumerate() {
        socket
            .send(frame)
            .await
            .map_err(|source| SleepError::Send {
                interface: tap.to_owned(),
                index,
                total: frames.len(),
                len: frame.len(),
                source,
            })?;
    }
    tracing::debug!(tap, frames = frames.len(), "injected held frames into a VM");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_must_fit_the_kernel() {
        assert!(ifname("imptap-0123abcd").is_ok());
        for bad in ["", "a-name-of-16-byte", "nul\0inside"] {
            let e = ifname(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_descriptor_that_is_not_a_tap_is_refused_by_name() {
        let fd = OwnedFd::from(File::open("/dev/null").unwrap());
        let e = adopt("imptap-x", fd).unwrap_err();
        assert!(matches!(e, SleepError::NotTheTap { .. }), "{e:?}");
        assert!(e.to_string().contains("imptap-x"), "{e}");
    }

    #[tokio::test]
    async fn injecting_nothing_needs_no_socket_and_a_missing_interface_is_named() {
        inject("no-such-if0", &[]).await.unwrap();
        let e = inject("no-such-if0", &[vec![0; 60]]).await.unwrap_err();
        assert!(e.to_string().contains("no-such-if0"), "{e}");
        let e = Sleeper::hold("no-such-if0", test_vm(), HoldBounds::default())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, SleepError::Missing { .. }), "{e:?}");
    }

    fn test_vm() -> SleepingVm {
        SleepingVm {
            ip: Ipv4Addr::new(10, 0, 0, 5),
            mac: super::super::plan::Mac([2, 0, 0, 0, 0, 5]),
        }
    }
}
