//! Idle detection for scale-to-zero, from the kernel's counters of the VM's TAP.
//!
//! **What counts as activity: the TAP's `rx_packets`, the frames the guest sent.** Seen from
//! the node, a TAP's `rx` is what the VMM wrote into it (the guest's transmissions) and its
//! `tx` is what the node delivered toward the guest. `tx_packets` is not a sign of use: the
//! bridge floods every broadcast (ARP requests for the other VMs, DHCP, …) and unknown unicast
//! into every port, so on a network with many VMs it never stands still and no VM would ever
//! be idle. What reaches a guest and matters makes it answer (a TCP ACK, a reply, an ICMP
//! error, an ARP reply for its own address), and a guest working on its own sends, so its
//! transmissions are the signal. The one kind of use missed is one-way traffic into a guest
//! that never answers (a UDP sink): such a VM suspends after `idleTimeout` and the next
//! datagram wakes it, with nothing lost (the frames are held, see [`super::wake`]).
//!
//! A counter that went down means the TAP is a new device (the VM restarted, or the agent
//! recreated it): the sample starts a fresh window, as does the first sample after the agent
//! (re)started or after a resume, because nobody knows what happened before it. While a VM
//! sleeps its TAP's `rx` grows with the ARP replies the sleeper writes: idle detection runs
//! only on running VMs and takes a fresh first sample after each resume.
//!
//! Times are wall-clock ([`SystemTime`]), because `lastActivityTime` is written to the VM's
//! status and read back by a restarted agent. A clock that went backwards never makes a VM
//! idle early: the elapsed time is taken as zero.

use std::time::{Duration, SystemTime};

/// One reading of a TAP's packet counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TapSample {
    /// Frames the guest sent (the TAP received them from the VMM).
    pub rx_packets: u64,
    /// Frames delivered toward the guest.
    pub tx_packets: u64,
}

/// Whether a VM is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    /// In use; the last activity was at `since` (write it as `lastActivityTime`).
    Active {
        /// The last activity.
        since: SystemTime,
    },
    /// Nothing happened for at least `idleTimeout` since `since`: suspend it.
    Idle {
        /// The last activity.
        since: SystemTime,
    },
}

/// Decides whether a VM is idle from the previous sample of its TAP (`None` after a start, a
/// resume or an agent restart), the current one, the last activity seen and the time now.
pub fn decide(
    previous: Option<TapSample>,
    current: TapSample,
    last_activity: SystemTime,
    now: SystemTime,
    idle_timeout: Duration,
) -> Activity {
    let Some(previous) = previous else {
        return Activity::Active { since: now };
    };
    if current.rx_packets != previous.rx_packets {
        // Grown: the guest sent. Shrunk: a new TAP, a fresh window.
        return Activity::Active { since: now };
    }
    let elapsed = now.duration_since(last_activity).unwrap_or(Duration::ZERO);
    if elapsed >= idle_timeout {
        Activity::Idle {
            since: last_activity,
        }
    } else {
        Activity::Active {
            since: last_activity,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(300);

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    fn sample(rx: u64, tx: u64) -> TapSample {
        TapSample {
            rx_packets: rx,
            tx_packets: tx,
        }
    }

    #[test]
    fn first_sample_opens_a_fresh_window() {
        // Even when the last activity on record is long past (an agent restart).
        assert_eq!(
            decide(None, sample(5, 5), at(0), at(10_000), TIMEOUT),
            Activity::Active { since: at(10_000) }
        );
    }

    #[test]
    fn guest_sending_is_activity() {
        assert_eq!(
            decide(Some(sample(5, 5)), sample(6, 5), at(0), at(400), TIMEOUT),
            Activity::Active { since: at(400) }
        );
    }

    #[test]
    fn frames_toward_the_guest_alone_are_not_activity() {
        // Broadcasts flooded into the port move tx only.
        assert_eq!(
            decide(Some(sample(5, 5)), sample(5, 900), at(0), at(300), TIMEOUT),
            Activity::Idle { since: at(0) }
        );
    }

    #[test]
    fn quiet_until_the_timeout_then_idle() {
        let s = Some(sample(5, 5));
        assert_eq!(
            decide(s, sample(5, 5), at(0), at(299), TIMEOUT),
            Activity::Active { since: at(0) }
        );
        assert_eq!(
            decide(s, sample(5, 5), at(0), at(300), TIMEOUT),
            Activity::Idle { since: at(0) }
        );
    }

    #[test]
    fn a_counter_reset_is_a_new_tap_and_a_fresh_window() {
        assert_eq!(
            decide(
                Some(sample(500, 500)),
                sample(3, 2),
                at(0),
                at(1000),
                TIMEOUT
            ),
            Activity::Active { since: at(1000) }
        );
    }

    #[test]
    fn a_clock_that_went_back_never_makes_a_vm_idle() {
        assert_eq!(
            decide(Some(sample(5, 5)), sample(5, 5), at(1000), at(10), TIMEOUT),
            Activity::Active { since: at(1000) }
        );
    }
}
