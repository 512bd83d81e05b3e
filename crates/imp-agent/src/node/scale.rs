//! Scale-to-zero on the node: which running ScaleToZero VMs are idle (their TAP's counters,
//! read over netlink), and a [`Sleeper`] per suspended one that holds its TAP, answers ARP for
//! it, holds the frames sent to it and asks for a reconcile when the first one arrives.
//!
//! The decisions are pure ([`imp_net::idle::decide`], [`super::decide`]); this module keeps
//! what the agent remembers between reconciles of a VM (the last sample of its TAP, its
//! sleeper) and performs the side effects. Nothing here is needed after an agent restart: a
//! suspended VM's record says it sleeps, and its reconcile holds its TAP again; the idle clock
//! starts afresh (a restart never makes a VM idle early).
//!
//! Reconciles of one VM never overlap (the controller runs one at a time per object), and a
//! VM's slot here is only touched from its reconciles and its removal, so there is no
//! check-then-act race between two holders of one TAP.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tokio::task::JoinHandle;

use imp_net::idle::{self, Activity, TapSample};
use imp_net::link::Netlink;
use imp_net::plan::Mac;
use imp_net::sleeper::{Handover, Release, SleepError, Sleeper, close, inject};
use imp_net::wake::{HoldBounds, SleepingVm};

/// `spec.idleTimeout` when it is unset.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a hold waits for the VMM's TAP to be free (its close waits for an RCU grace
/// period) and then for the kernel to see the carrier, so that the bridge forwards to it.
const HOLD_WAIT: Duration = Duration::from_secs(3);

/// How often a running ScaleToZero VM's TAP is sampled: a fifth of its idle timeout, between
/// one and fifteen seconds, so it suspends at most a fifth late.
pub fn sample_every(idle_timeout: Duration) -> Duration {
    (idle_timeout / 5).clamp(Duration::from_secs(1), Duration::from_secs(15))
}

/// What the agent remembers of one VM's TAP between samples.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// The VMM that was running when it was taken: a new one (a resume) starts a fresh window.
    vmm_pid: Option<u32>,
    sample: TapSample,
    last_activity: SystemTime,
}

/// A sleeping VM's held TAP and the task that reports its wake.
struct Held {
    sleeper: Sleeper,
    watcher: JoinHandle<()>,
}

/// Idle tracking and sleepers of this node's ScaleToZero VMs, by VM uid.
pub struct ScaleToZero {
    netlink: Netlink,
    bounds: HoldBounds,
    seen: Mutex<HashMap<String, Seen>>,
    held: Mutex<HashMap<String, Held>>,
    /// VMs whose sleeper saw a wake and was taken for a resume that has not started yet.
    woken: Mutex<HashSet<String>>,
    /// Frames held for VMs whose VMM opens the TAP by name, until it runs.
    stashed: Mutex<HashMap<String, Stashed>>,
    /// Sleeping VMs an exec asked to wake, and when, until they run again (an exec waiting
    /// for the VM asks again meanwhile: its wake is under way, not refused).
    knocked: Mutex<HashMap<String, Instant>>,
    /// Whether each VM reconciled since the agent started is a ScaleToZero VM.
    policy: Mutex<HashMap<String, bool>>,
    /// Duplicates of suspending VMMs' descriptors on their TAPs ([`ScaleToZero::keep_tap`]),
    /// until a sleeper or a resume takes them.
    kept: Mutex<HashMap<String, OwnedFd>>,
}

/// What [`ScaleToZero::knock`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Knock {
    /// The VM sleeps and is now marked woken: its reconcile should be asked for.
    First,
    /// A wake was asked for already (by a frame or an exec) and the VM does not run yet.
    Again,
    /// The VM is not a ScaleToZero VM: nothing here wakes it.
    NotAsleep,
    /// The agent has not reconciled the VM since it started: ask again once it has.
    NotYet,
}

/// How a sleeper came to hold a sleeping VM's TAP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// On the descriptor kept from the suspending VMM ([`ScaleToZero::keep_tap`]).
    Kept,
    /// By the TAP's name, once the VMM was gone.
    ByName,
}

/// What woke a sleeping VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WokenBy {
    /// A frame for it.
    Traffic,
    /// An exec into it.
    Exec,
}

/// Frames waiting for a VMM to open TAP `.0` by name.
type Stashed = (String, Vec<Vec<u8>>);

/// What a wake hands to the resume.
#[derive(Debug, Default)]
pub struct Wake {
    /// The TAP's fd, still attached, for a VMM that inherits it.
    pub tap: Option<std::os::fd::OwnedFd>,
    /// How many frames were held (delivered already, or stashed).
    pub frames: usize,
    /// When the first frame or the exec came (none for a resume asked by the user).
    pub at: Option<Instant>,
    /// What woke it (none for a resume asked by the user).
    pub by: Option<WokenBy>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The TAP of a sleeping VM and how its neighbours know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SleepingTap {
    /// The TAP device.
    pub tap: String,
    /// The guest's address.
    pub ip: Ipv4Addr,
    /// The guest's MAC, as written in its attachment.
    pub mac: String,
}

impl ScaleToZero {
    /// Tracks idleness and holds TAPs with `netlink` (the node's network namespace).
    pub fn new(netlink: Netlink) -> ScaleToZero {
        ScaleToZero {
            netlink,
            bounds: HoldBounds::default(),
            seen: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            woken: Mutex::new(HashSet::new()),
            stashed: Mutex::new(HashMap::new()),
            knocked: Mutex::new(HashMap::new()),
            policy: Mutex::new(HashMap::new()),
            kept: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps a duplicate of VMM `vmm_pid`'s descriptor on VM `uid`'s TAP as its suspend
    /// begins. The TAP then never loses its carrier, and what arrives while the VMM pauses,
    /// snapshots and exits waits in the TAP's queue for the sleeper, which adopts the
    /// duplicate: a wake that races the suspend is answered like any other, instead of going
    /// with the VMM and waiting for its sender's retransmission. Best effort: without it the
    /// sleeper attaches by name.
    pub async fn keep_tap(&self, uid: &str, vmm_pid: u32, tap: &str) {
        let name = tap.to_owned();
        let taken =
            tokio::task::spawn_blocking(move || imp_net::tap::duplicate_from(vmm_pid, &name)).await;
        match taken {
            Ok(Ok(Some(fd))) => {
                tracing::debug!(uid, tap, vmm_pid, "kept the VMM's TAP for the suspend");
                let old = lock(&self.kept).insert(uid.to_owned(), fd);
                if let Some(old) = old {
                    close(old).await;
                }
            }
            Ok(Ok(None)) => {
                tracing::debug!(uid, tap, vmm_pid, "the VMM holds no descriptor on its TAP");
            }
            Ok(Err(e)) => {
                tracing::warn!(uid, tap, vmm_pid, error = %imp_api::chain::DisplayChain(&e), "cannot keep the VMM's TAP across the suspend; frames sent meanwhile will be retransmitted");
            }
            Err(_) => {}
        }
    }

    /// Lets go of what [`ScaleToZero::keep_tap`] kept for VM `uid` (its suspend failed, or it
    /// is gone); closed before this returns.
    pub async fn drop_kept(&self, uid: &str) {
        let kept = lock(&self.kept).remove(uid);
        if let Some(fd) = kept {
            close(fd).await;
        }
    }

    /// Samples running VM `uid`'s TAP and says whether it has been idle for `idle_timeout`.
    /// A TAP that cannot be read counts as active (a VM is never suspended on a guess), and so
    /// does a VM `in_use` otherwise (an exec session is open).
    pub async fn activity(
        &self,
        uid: &str,
        tap: &str,
        vmm_pid: Option<u32>,
        idle_timeout: Duration,
        in_use: bool,
    ) -> Activity {
        let now = SystemTime::now();
        let current = match self.netlink.link_state(tap).await {
            Ok(Some(s)) => TapSample {
                rx_packets: s.rx_packets,
                tx_packets: s.tx_packets,
            },
            Ok(None) => return Activity::Active { since: now },
            Err(e) => {
                tracing::warn!(uid, tap, error = %imp_api::chain::chain(&e), "reading a TAP's counters");
                return Activity::Active { since: now };
            }
        };
        let mut seen = lock(&self.seen);
        let before = seen.get(uid).filter(|s| s.vmm_pid == vmm_pid).copied();
        let last_activity = match before {
            Some(s) if !in_use => s.last_activity,
            _ => now,
        };
        let activity = idle::decide(
            before.map(|s| s.sample),
            current,
            last_activity,
            now,
            idle_timeout,
        );
        let (Activity::Active { since } | Activity::Idle { since }) = activity;
        seen.insert(
            uid.to_owned(),
            Seen {
                vmm_pid,
                sample: current,
                last_activity: since,
            },
        );
        activity
    }

    /// Whether a frame arrived for sleeping VM `uid` (its sleeper saw it, or saw it before it
    /// was taken for a resume that has not started), or an exec knocked.
    pub fn woken(&self, uid: &str) -> bool {
        lock(&self.knocked).contains_key(uid) || self.woken_by_traffic(uid)
    }

    fn woken_by_traffic(&self, uid: &str) -> bool {
        lock(&self.woken).contains(uid)
            || lock(&self.held)
                .get(uid)
                .is_some_and(|h| h.sleeper.woken_now().is_some())
    }

    /// Wakes suspended VM `uid` as a frame would, for an exec: its next reconcile resumes it.
    /// A ScaleToZero VM is woken even before its sleeper holds it (its suspend just ended,
    /// or the agent just started).
    pub fn knock(&self, uid: &str) -> Knock {
        match lock(&self.policy).get(uid) {
            None => return Knock::NotYet,
            Some(false) => return Knock::NotAsleep,
            Some(true) => {}
        }
        if self.woken_by_traffic(uid) {
            return Knock::Again;
        }
        let mut knocked = lock(&self.knocked);
        if knocked.contains_key(uid) {
            return Knock::Again;
        }
        knocked.insert(uid.to_owned(), Instant::now());
        Knock::First
    }

    /// Notes whether VM `uid` is a ScaleToZero VM, as its reconcile sees it.
    pub fn observe(&self, uid: &str, scale_to_zero: bool) {
        lock(&self.policy).insert(uid.to_owned(), scale_to_zero);
    }

    /// Whether VM `uid`'s TAP is held.
    pub fn holds(&self, uid: &str) -> bool {
        lock(&self.held).contains_key(uid)
    }

    /// Holds sleeping VM `uid`'s TAP (nothing if it is held already: `None`) and runs
    /// `on_wake` when the first frame for it arrives. Returns once the bridge forwards to the
    /// TAP, so a VM reported Suspended can be woken.
    pub async fn hold(
        &self,
        uid: &str,
        tap: &SleepingTap,
        on_wake: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<Option<Attached>, SleepError> {
        if self.holds(uid) {
            return Ok(None);
        }
        let vm = SleepingVm {
            ip: tap.ip,
            mac: Mac::parse(&tap.mac).ok_or_else(|| SleepError::NotTheTap {
                tap: tap.tap.clone(),
                found: format!("a VM MAC {:?} that does not parse", tap.mac),
            })?,
        };
        let (sleeper, attached) = self.attach(uid, &tap.tap, vm).await?;
        let mut signal = sleeper.wake_signal();
        let watcher = tokio::spawn(async move {
            if signal.wait_for(Option::is_some).await.is_ok() {
                on_wake.await;
            }
        });
        self.wait_forwarding(&tap.tap).await;
        lock(&self.held).insert(uid.to_owned(), Held { sleeper, watcher });
        lock(&self.seen).remove(uid);
        Ok(Some(attached))
    }

    /// Attaches to the TAP: on the descriptor kept from the VMM if there is one, else by name,
    /// waiting while the VMM that just ended still holds it (EBUSY).
    async fn attach(
        &self,
        uid: &str,
        tap: &str,
        vm: SleepingVm,
    ) -> Result<(Sleeper, Attached), SleepError> {
        let kept = lock(&self.kept).remove(uid);
        if let Some(fd) = kept {
            match Sleeper::hold_fd(tap, fd, vm, self.bounds).await {
                Ok(sleeper) => return Ok((sleeper, Attached::Kept)),
                Err(e) => {
                    tracing::warn!(uid, tap, error = %imp_api::chain::chain(&e), "the TAP kept from the VMM cannot be held; attaching by name");
                }
            }
        }
        let deadline = Instant::now() + HOLD_WAIT;
        loop {
            match Sleeper::hold(tap, vm, self.bounds).await {
                Err(SleepError::Attach { source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => return other.map(|sleeper| (sleeper, Attached::ByName)),
            }
        }
    }

    /// Waits (bounded) until the kernel calls the TAP up: from then on the bridge forwards to
    /// it. The link watcher may take up to a second after the attach.
    async fn wait_forwarding(&self, tap: &str) {
        let started = Instant::now();
        while started.elapsed() < HOLD_WAIT {
            if let Ok(Some(s)) = self.netlink.link_state(tap).await
                && s.oper_up
            {
                tracing::debug!(
                    tap,
                    waited_ms = started.elapsed().as_millis() as u64,
                    "a held TAP forwards"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::warn!(
            tap,
            "a held TAP is still not up after {HOLD_WAIT:?}; its first frames may be lost"
        );
    }

    /// Takes sleeping VM `uid`'s TAP: its name, the held frames, and with
    /// [`Release::KeepOpen`] the TAP's fd, still attached (see [`Sleeper::hand_over`]).
    /// `None` when nothing holds it.
    async fn hand_over(&self, uid: &str, release: Release) -> Option<(String, Handover)> {
        let held = lock(&self.held).remove(uid)?;
        held.watcher.abort();
        if held.sleeper.woken_now().is_some() {
            lock(&self.woken).insert(uid.to_owned());
        }
        let tap = held.sleeper.tap().to_owned();
        match held.sleeper.hand_over(release).await {
            Ok(h) => Some((tap, h)),
            Err(e) => {
                tracing::warn!(uid, error = %imp_api::chain::chain(&e), "handing a sleeping VM's TAP over");
                None
            }
        }
    }

    /// Takes sleeping VM `uid`'s TAP for its resume and delivers what was held for it. A VMM
    /// that inherits the TAP (QEMU) gets the fd, with the held frames already queued in it;
    /// one that opens it `by_name` (Firecracker) needs it closed, and gets the frames once it
    /// runs ([`ScaleToZero::inject_stashed`]).
    pub async fn wake_handover(&self, uid: &str, by_name: bool) -> Wake {
        let release = if by_name {
            Release::Close
        } else {
            Release::KeepOpen
        };
        let knocked = lock(&self.knocked).get(uid).copied();
        let Some((tap, h)) = self.hand_over(uid, release).await else {
            // Woken before a sleeper held the TAP: what was kept from the VMM, with whatever
            // queued in it meanwhile, goes to a VMM that inherits it.
            let tap = if by_name {
                self.drop_kept(uid).await;
                None
            } else {
                lock(&self.kept).remove(uid)
            };
            return Wake {
                tap,
                at: knocked,
                by: knocked.map(|_| WokenBy::Exec),
                ..Wake::default()
            };
        };
        let (at, by) = match (h.woken.map(|w| w.at), knocked) {
            (Some(at), _) => (Some(at), Some(WokenBy::Traffic)),
            (None, Some(at)) => (Some(at), Some(WokenBy::Exec)),
            (None, None) => (None, None),
        };
        let wake = Wake {
            tap: h.tap,
            frames: h.frames.len(),
            at,
            by,
        };
        if h.frames.is_empty() {
            return wake;
        }
        if by_name {
            lock(&self.stashed).insert(uid.to_owned(), (tap, h.frames));
        } else if let Err(e) = inject(&tap, &h.frames).await {
            tracing::warn!(uid, tap, error = %imp_api::chain::chain(&e), "delivering the frames held for a waking VM");
        }
        wake
    }

    /// Delivers the frames kept for VM `uid` until its VMM had the TAP again.
    pub async fn inject_stashed(&self, uid: &str) {
        let Some((tap, frames)) = lock(&self.stashed).remove(uid) else {
            return;
        };
        if let Err(e) = inject(&tap, &frames).await {
            tracing::warn!(uid, tap, error = %imp_api::chain::chain(&e), "delivering the frames held for a woken VM");
        }
    }

    /// The resume of VM `uid` started (or it runs, or is gone): its wake is consumed.
    pub fn resumed(&self, uid: &str) {
        lock(&self.woken).remove(uid);
    }

    /// VM `uid` runs again: an exec's wake is over.
    pub fn running(&self, uid: &str) {
        lock(&self.knocked).remove(uid);
    }

    /// Stops holding VM `uid`'s TAP (its fd closed before this returns) and forgets it.
    pub async fn release(&self, uid: &str) {
        let _ = self.hand_over(uid, Release::Close).await;
        lock(&self.woken).remove(uid);
        lock(&self.knocked).remove(uid);
        lock(&self.policy).remove(uid);
        lock(&self.stashed).remove(uid);
        lock(&self.seen).remove(uid);
        self.drop_kept(uid).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tap_is_sampled_a_fifth_of_the_timeout_apart_within_bounds() {
        assert_eq!(
            sample_every(Duration::from_secs(10)),
            Duration::from_secs(2)
        );
        assert_eq!(sample_every(Duration::from_secs(3)), Duration::from_secs(1));
        assert_eq!(sample_every(DEFAULT_IDLE_TIMEOUT), Duration::from_secs(15));
    }

    #[tokio::test]
    async fn an_exec_knocks_only_on_scale_to_zero_vms_once_per_wake() {
        let scale = ScaleToZero::new(Netlink::connect().unwrap());
        assert_eq!(scale.knock("a"), Knock::NotYet, "not reconciled yet");
        scale.observe("a", false);
        assert_eq!(scale.knock("a"), Knock::NotAsleep, "suspended by its user");
        assert!(!scale.woken("a"));
        // Knocked before its sleeper holds it (its suspend just ended): still woken.
        scale.observe("a", true);
        assert_eq!(scale.knock("a"), Knock::First);
        assert_eq!(scale.knock("a"), Knock::Again);
        assert!(scale.woken("a"));
        let wake = scale.wake_handover("a", false).await;
        assert_eq!(wake.by, Some(WokenBy::Exec));
        assert!(wake.at.is_some() && wake.tap.is_none() && wake.frames == 0);
        // The resume started: not woken any more, but an exec still waits for it.
        scale.resumed("a");
        assert_eq!(scale.knock("a"), Knock::Again);
        scale.running("a");
        assert!(!scale.woken("a"));
        assert_eq!(scale.knock("a"), Knock::First, "the next sleep's wake");
        scale.release("a").await;
        assert!(!scale.woken("a"));
        assert_eq!(scale.knock("a"), Knock::NotYet);
    }
}
