//! Time-based lifecycle decisions: restart backoff and exhaustion, expiry, stuck starts, and the
//! jittered backoff of conflict retries. Pure functions of the status and "now".
//!
//! Restart policy (persistent VMs in phase `Failed`: their resolved spec's restartPolicy, else
//! [`default_restart_policy`]; ephemeral VMs never restart): attempt `n` (0-based: `restartCount` so far) waits `initialDelay × 2ⁿ`, capped at `maxDelay`,
//! minus up to 10 % jitter (so two VMs failing together do not retry in lockstep; the delay never
//! exceeds maxDelay). `maxRetries` 0 means 5. Once `restartCount ≥ maxRetries`, `onExhaustion`
//! decides: `fail` stays Failed, `manual-reset` moves to `RetryExhausted` until the
//! `imp/reset-retries: "true"` annotation, `cool-down` stamps `exhaustedAt` and, after
//! `coolDownPeriod`, zeroes the counters and schedules the VM again.
//!
//! Expiry (`expireAfter`, 0 meaning never): a VM is deleted `expireAfter` after it first ran
//! (`runningAt`), or after it ended (`finishedAt`) when it never ran, whatever its phase then:
//! still running, or finished like a Job past its TTL.

use std::time::Duration;

use imp_api::duration::GoDuration;
use imp_api::shared::{BackoffPolicy, OnExhaustion, RestartMode, RestartPolicy, VmLifecycle};
use imp_api::vm::ImpVMSpec;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// Share of a restart delay that jitter may take off.
pub const RESTART_JITTER: f64 = 0.1;

/// `maxRetries` when the policy says 0.
pub const DEFAULT_MAX_RETRIES: i32 = 5;

/// The restart policy of a persistent VM whose spec, template and class set none: restart in
/// place after 10s, doubling up to 5m between attempts, at most 5 attempts, then stay Failed.
/// The `restartPolicy` field descriptions in imp-api say the same (a test checks).
pub fn default_restart_policy() -> RestartPolicy {
    RestartPolicy {
        mode: RestartMode::InPlace,
        backoff: Some(BackoffPolicy {
            max_retries: DEFAULT_MAX_RETRIES,
            initial_delay: GoDuration::from_static("10s"),
            max_delay: GoDuration::from_static("5m"),
        }),
        on_exhaustion: OnExhaustion::Fail,
        cool_down_period: GoDuration::from_static("1h"),
    }
}

/// The restart policy a VM with this resolved spec follows: its own, else
/// [`default_restart_policy`]; `None` for an ephemeral VM, which ends instead.
pub fn restart_policy(spec: &ImpVMSpec) -> Option<RestartPolicy> {
    if spec.lifecycle != VmLifecycle::Persistent {
        return None;
    }
    Some(
        spec.inherited
            .restart_policy
            .clone()
            .unwrap_or_else(default_restart_policy),
    )
}

/// A random number in [0, 1) for jitter, without a PRNG dependency.
pub fn jitter_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

fn parse_or(d: &imp_api::duration::GoDuration, fallback: Duration) -> Duration {
    d.parse().unwrap_or(fallback)
}

/// The delay before restart attempt `attempt` (0-based), with `jitter` in [0, 1).
pub fn backoff_delay(policy: &BackoffPolicy, attempt: i32, jitter: f64) -> Duration {
    let initial = parse_or(&policy.initial_delay, Duration::from_secs(10));
    let max = parse_or(&policy.max_delay, Duration::from_secs(300)).max(initial);
    let exp = attempt.clamp(0, 30) as u32;
    let base = initial.saturating_mul(1u32 << exp.min(31)).min(max);
    base.mul_f64(1.0 - RESTART_JITTER * jitter.clamp(0.0, 1.0))
}

/// The attempt limit of a policy (0 → the default of 5).
pub fn max_retries(policy: &BackoffPolicy) -> i32 {
    if policy.max_retries <= 0 {
        DEFAULT_MAX_RETRIES
    } else {
        policy.max_retries
    }
}

/// Where a Failed VM's restart policy stands.
#[derive(Clone, Debug, PartialEq)]
pub enum RestartDecision {
    /// Wait until `nextRetryAfter` (first time: set it to `until`).
    Wait {
        /// When the next attempt may run.
        until: Timestamp,
        /// Whether `until` is new and must be written to status.
        record: bool,
    },
    /// Restart now: attempt number (1-based) out of `max`, in place or by rescheduling.
    Restart {
        /// Restart on the same node or schedule again.
        mode: RestartMode,
        /// This attempt, 1-based (the new restartCount).
        attempt: i32,
        /// The limit.
        max: i32,
    },
    /// Attempts are used up and the VM stays Failed.
    StayFailed,
    /// Attempts are used up: phase RetryExhausted until the reset annotation.
    AwaitManualReset,
    /// Attempts are used up: wait for the cool-down to end at `until`.
    CoolingDown {
        /// End of the cool-down.
        until: Timestamp,
    },
    /// The cool-down is over: zero the counters and schedule again.
    CoolDownOver,
}

/// Restart-policy state read from a VM's status.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RestartState {
    /// `status.restartCount`.
    pub restart_count: i32,
    /// `status.nextRetryAfter`.
    pub next_retry_after: Option<Timestamp>,
    /// `status.exhaustedAt`.
    pub exhausted_at: Option<Timestamp>,
}

/// Decides what the restart policy does for a Failed VM at `now`.
pub fn decide_restart(
    policy: &RestartPolicy,
    state: &RestartState,
    now: Timestamp,
    jitter: f64,
) -> RestartDecision {
    let backoff = policy.backoff.clone().unwrap_or_default();
    let max = max_retries(&backoff);
    if state.restart_count >= max {
        return match policy.on_exhaustion {
            OnExhaustion::Fail => RestartDecision::StayFailed,
            OnExhaustion::ManualReset => RestartDecision::AwaitManualReset,
            OnExhaustion::CoolDown => {
                let cool = parse_or(&policy.cool_down_period, Duration::from_secs(3600));
                let start = state.exhausted_at.unwrap_or(now);
                let until = add(start, cool);
                if now >= until {
                    RestartDecision::CoolDownOver
                } else {
                    RestartDecision::CoolingDown { until }
                }
            }
        };
    }
    match state.next_retry_after {
        Some(until) if now < until => RestartDecision::Wait {
            until,
            record: false,
        },
        Some(_) => RestartDecision::Restart {
            mode: policy.mode,
            attempt: state.restart_count + 1,
            max,
        },
        None => {
            let delay = backoff_delay(&backoff, state.restart_count, jitter);
            if delay.is_zero() {
                RestartDecision::Restart {
                    mode: policy.mode,
                    attempt: state.restart_count + 1,
                    max,
                }
            } else {
                RestartDecision::Wait {
                    until: add(now, delay),
                    record: true,
                }
            }
        }
    }
}

/// `t + d`, saturating.
pub fn add(t: Timestamp, d: Duration) -> Timestamp {
    let sd = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    t.checked_add(sd).unwrap_or(Timestamp::MAX)
}

/// When a VM expires: `runningAt + expireAfter`, or `finishedAt + expireAfter` for a VM that
/// ended without ever running; `None` for no or a zero expireAfter, or neither time.
pub fn expires_at(
    expire_after: Option<Duration>,
    running_at: Option<Timestamp>,
    finished_at: Option<Timestamp>,
) -> Option<Timestamp> {
    let d = expire_after.filter(|d| !d.is_zero())?;
    Some(add(running_at.or(finished_at)?, d))
}

/// Whether a VM that began starting at `started_at` has been stuck past `timeout`.
pub fn start_timed_out(started_at: Option<Timestamp>, now: Timestamp, timeout: Duration) -> bool {
    started_at.is_some_and(|s| now >= add(s, timeout))
}

/// Delay before conflict retry `attempt` (0-based): 50 ms × 2ⁿ up to 1 s, scaled by 0.5–1.0.
pub fn conflict_backoff(attempt: u32, jitter: f64) -> Duration {
    let base = Duration::from_millis(50)
        .saturating_mul(1 << attempt.min(5))
        .min(Duration::from_secs(1));
    base.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn backoff(initial: &'static str, max: &'static str, retries: i32) -> BackoffPolicy {
        BackoffPolicy {
            max_retries: retries,
            initial_delay: GoDuration::from_static(initial),
            max_delay: GoDuration::from_static(max),
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let b = backoff("10s", "60s", 5);
        assert_eq!(backoff_delay(&b, 0, 0.0), Duration::from_secs(10));
        assert_eq!(backoff_delay(&b, 1, 0.0), Duration::from_secs(20));
        assert_eq!(backoff_delay(&b, 2, 0.0), Duration::from_secs(40));
        assert_eq!(backoff_delay(&b, 3, 0.0), Duration::from_secs(60));
        assert_eq!(backoff_delay(&b, 30, 0.0), Duration::from_secs(60));
        assert_eq!(backoff_delay(&b, i32::MAX, 0.0), Duration::from_secs(60));
    }

    #[test]
    fn jitter_stays_within_ten_percent_below() {
        let b = backoff("10s", "5m", 5);
        for j in [0.0, 0.3, 0.999, 1.0, 7.0, -1.0] {
            let d = backoff_delay(&b, 1, j);
            assert!(
                d <= Duration::from_secs(20) && d >= Duration::from_secs(18),
                "{d:?}"
            );
        }
        for _ in 0..100 {
            let u = jitter_unit();
            assert!((0.0..1.0).contains(&u));
            let c = conflict_backoff(2, u);
            assert!(c >= Duration::from_millis(100) && c <= Duration::from_millis(200));
        }
        assert_eq!(conflict_backoff(10, 1.0), Duration::from_secs(1));
    }

    #[test]
    fn defaults_apply_for_zero_retries() {
        assert_eq!(max_retries(&backoff("1s", "1s", 0)), 5);
        assert_eq!(max_retries(&backoff("1s", "1s", 2)), 2);
    }

    fn policy(on: OnExhaustion, mode: RestartMode) -> RestartPolicy {
        RestartPolicy {
            mode,
            backoff: Some(backoff("10s", "1m", 2)),
            on_exhaustion: on,
            cool_down_period: GoDuration::from_static("1h"),
        }
    }

    #[test]
    fn restart_waits_then_restarts() {
        let p = policy(OnExhaustion::Fail, RestartMode::Reschedule);
        let fresh = RestartState::default();
        assert_eq!(
            decide_restart(&p, &fresh, ts(100), 0.0),
            RestartDecision::Wait {
                until: ts(110),
                record: true
            }
        );
        let waiting = RestartState {
            next_retry_after: Some(ts(110)),
            ..fresh
        };
        assert_eq!(
            decide_restart(&p, &waiting, ts(105), 0.0),
            RestartDecision::Wait {
                until: ts(110),
                record: false
            }
        );
        assert_eq!(
            decide_restart(&p, &waiting, ts(110), 0.0),
            RestartDecision::Restart {
                mode: RestartMode::Reschedule,
                attempt: 1,
                max: 2
            }
        );
        let second = RestartState {
            restart_count: 1,
            ..fresh
        };
        assert_eq!(
            decide_restart(&p, &second, ts(100), 0.0),
            RestartDecision::Wait {
                until: ts(120),
                record: true
            }
        );
    }

    #[test]
    fn exhaustion_actions() {
        let done = RestartState {
            restart_count: 2,
            ..Default::default()
        };
        assert_eq!(
            decide_restart(
                &policy(OnExhaustion::Fail, RestartMode::InPlace),
                &done,
                ts(0),
                0.0
            ),
            RestartDecision::StayFailed
        );
        assert_eq!(
            decide_restart(
                &policy(OnExhaustion::ManualReset, RestartMode::InPlace),
                &done,
                ts(0),
                0.0
            ),
            RestartDecision::AwaitManualReset
        );
        let cool = policy(OnExhaustion::CoolDown, RestartMode::InPlace);
        assert_eq!(
            decide_restart(&cool, &done, ts(50), 0.0),
            RestartDecision::CoolingDown { until: ts(3650) }
        );
        let stamped = RestartState {
            exhausted_at: Some(ts(50)),
            ..done
        };
        assert_eq!(
            decide_restart(&cool, &stamped, ts(3649), 0.0),
            RestartDecision::CoolingDown { until: ts(3650) }
        );
        assert_eq!(
            decide_restart(&cool, &stamped, ts(3650), 0.0),
            RestartDecision::CoolDownOver
        );
    }

    #[test]
    fn expiry_counts_from_first_running_else_from_the_end() {
        let min = Some(Duration::from_secs(60));
        assert_eq!(expires_at(None, Some(ts(10)), None), None);
        assert_eq!(expires_at(Some(Duration::ZERO), Some(ts(10)), None), None);
        assert_eq!(expires_at(min, None, None), None);
        assert_eq!(expires_at(min, Some(ts(10)), None), Some(ts(70)));
        // Ran, then ended: still from the first run.
        assert_eq!(expires_at(min, Some(ts(10)), Some(ts(500))), Some(ts(70)));
        // Ended without ever running.
        assert_eq!(expires_at(min, None, Some(ts(500))), Some(ts(560)));
        assert_eq!(expires_at(None, None, Some(ts(500))), None);
    }

    #[test]
    fn persistent_vms_restart_by_default_and_ephemeral_ones_never() {
        let mut spec = ImpVMSpec {
            lifecycle: VmLifecycle::Persistent,
            ..ImpVMSpec::default()
        };
        let p = restart_policy(&spec).unwrap();
        assert_eq!(p, default_restart_policy());
        assert_eq!(p.mode, RestartMode::InPlace);
        assert_eq!(p.on_exhaustion, OnExhaustion::Fail);
        let b = p.backoff.clone().unwrap();
        assert_eq!(max_retries(&b), 5);
        let delays: Vec<u64> = (0..6)
            .map(|n| backoff_delay(&b, n, 0.0).as_secs())
            .collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 300]);
        // Five attempts, then Failed for good.
        let used_up = RestartState {
            restart_count: 5,
            ..Default::default()
        };
        assert_eq!(
            decide_restart(&p, &used_up, ts(0), 0.0),
            RestartDecision::StayFailed
        );
        // A policy of its own wins.
        let own = policy(OnExhaustion::ManualReset, RestartMode::Reschedule);
        spec.inherited.restart_policy = Some(own.clone());
        assert_eq!(restart_policy(&spec), Some(own));
        // Ephemeral VMs end, with or without a policy.
        spec.lifecycle = VmLifecycle::Ephemeral;
        assert_eq!(restart_policy(&spec), None);
        spec.inherited.restart_policy = None;
        assert_eq!(restart_policy(&spec), None);
    }

    /// What `kubectl explain impvm.spec.restartPolicy` (and the template's and class's) says is
    /// the default.
    #[test]
    fn the_crd_describes_the_default_restart_policy() {
        let kinds = ["ImpVM", "ImpVMTemplate", "ImpVMClass"];
        let crds: Vec<_> = imp_api::crd::all()
            .into_iter()
            .filter(|c| kinds.contains(&c.spec.names.kind.as_str()))
            .collect();
        assert_eq!(crds.len(), kinds.len());
        for crd in crds {
            let kind = crd.spec.names.kind.clone();
            let crd = serde_json::to_value(crd).unwrap();
            let desc = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
                ["spec"]["properties"]["restartPolicy"]["description"]
                .as_str()
                .unwrap_or_default()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            for needle in [
                "in place",
                "after 10s",
                "up to 5m",
                "at most 5 attempts",
                "then stays Failed",
            ] {
                assert!(desc.contains(needle), "{kind}: no {needle:?} in {desc:?}");
            }
        }
    }

    #[test]
    fn stuck_start() {
        let t = Duration::from_secs(300);
        assert!(!start_timed_out(None, ts(1000), t));
        assert!(!start_timed_out(Some(ts(800)), ts(1099), t));
        assert!(start_timed_out(Some(ts(800)), ts(1100), t));
    }
}
