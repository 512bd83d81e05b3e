//! Leader election over a `coordination.k8s.io/v1` Lease, so only one operator replica writes.
//!
//! No leader-election crate supports kube 5, so this is a small loop of our own that follows
//! client-go's rules:
//!
//! - A candidate reads the Lease every `retry_period` (with up to 20 % jitter). It takes the
//!   Lease when nobody holds it, when it already holds it, or when the holder's claim has
//!   expired (`renewTime + leaseDurationSeconds < now`). Taking it from someone else (or from
//!   nobody) increments `leaseTransitions` and sets `acquireTime`.
//! - The leader renews every `retry_period` by *replacing* the Lease it last wrote, with that
//!   write's resourceVersion. Any other write in between makes the replace fail with 409, and the
//!   leader steps down at once: someone else has touched the lease and may believe it leads.
//! - A renewal that keeps failing for other reasons (API server unreachable, timeouts) steps
//!   down once `renew_deadline` has passed since the last good renewal. Because
//!   `renew_deadline < lease_duration`, the old leader stops before any other replica can take
//!   the Lease over.
//! - On shutdown the leader stops leading first, then releases the Lease (clears
//!   `holderIdentity`, shortens the duration to 1 s) so the next replica takes over within one
//!   `retry_period` instead of waiting for expiry.
//!
//! Expiry compares the holder's `renewTime` with this replica's wall clock, as the Lease API
//! intends: replicas are assumed to have clocks synchronised well within `lease_duration`.
//!
//! After losing leadership the elector keeps running as a candidate; the operator itself exits
//! when its [`LeaderElector::subscribe`] receiver turns from `true` to `false` (as
//! controller-runtime does), because controllers that were running may hold stale state.

use std::future::Future;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::chain::DisplayChain;
use crate::metrics::Metrics;

/// Field manager recorded on the Lease writes of the operator's elector.
pub const FIELD_MANAGER: &str = "imp-operator-leader";

/// Errors of the leader-election loop.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The timings cannot give a safe election (see [`LeaseConfig::validate`]).
    #[error("Invalid leader-election timings for lease {namespace}/{name}: {reason}")]
    Config {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Reading, creating or writing the Lease failed.
    #[error("{action} lease {namespace}/{name}")]
    Api {
        /// What was being done ("Reading", "Creating", "Renewing", "Releasing").
        action: &'static str,
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// The cause (boxed: kube's error is large and this travels through every attempt).
        #[source]
        source: Box<kube::Error>,
    },
    /// A Lease request did not answer in time.
    #[error("{action} lease {namespace}/{name} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        action: &'static str,
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// How long we waited.
        after: Duration,
    },
}

/// Which Lease to compete for, as whom, and how fast.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Namespace of the Lease object.
    pub namespace: String,
    /// Name of the Lease object.
    pub name: String,
    /// This replica's identity, written to `holderIdentity` (pod name is a good choice).
    pub identity: String,
    /// How long a claim is valid after its last renewal (rounded up to whole seconds).
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it stops leading.
    pub renew_deadline: Duration,
    /// Interval between acquire/renew attempts.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// A configuration with client-go's timings: 15 s lease, 10 s renew deadline, 2 s retry.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// Checks that the timings are safe: `0 < retry_period < renew_deadline < lease_duration`,
    /// and that names and identity are not empty.
    pub fn validate(&self) -> Result<(), LeaderError> {
        let fail = |reason: String| {
            Err(LeaderError::Config {
                namespace: self.namespace.clone(),
                name: self.name.clone(),
                reason,
            })
        };
        if self.namespace.is_empty() || self.name.is_empty() {
            return fail("the lease namespace and name must not be empty".into());
        }
        if self.identity.is_empty() {
            return fail("the identity must not be empty".into());
        }
        if self.retry_period.is_zero() {
            return fail("retry_period must be greater than zero".into());
        }
        if self.renew_deadline <= self.retry_period {
            return fail(format!(
                "renew_deadline ({:?}) must be longer than retry_period ({:?})",
                self.renew_deadline, self.retry_period
            ));
        }
        if Duration::from_secs(lease_seconds(self.lease_duration).unsigned_abs().into())
            <= self.renew_deadline
        {
            return fail(format!(
                "lease_duration ({:?}, rounded up to whole seconds) must be longer than renew_deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        Ok(())
    }
}

/// Whole seconds for `leaseDurationSeconds`: rounded up, at least 1.
fn lease_seconds(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
}

/// What a replica should do with the Lease it just read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The Lease does not exist: create it holding it ourselves.
    Create,
    /// Nobody validly holds it: take it over (a leader transition).
    Acquire {
        /// The previous holder, if any (its claim has expired or it released).
        previous: Option<String>,
    },
    /// We hold it: renew it.
    Renew,
    /// Someone else holds a valid claim: wait.
    Wait {
        /// The current holder.
        holder: String,
        /// When its claim expires unless it renews.
        expires: Timestamp,
    },
}

/// Decides, from the Lease as read (`None` = it does not exist) and the current time, whether
/// `identity` may take or renew it. `default_duration` applies when the Lease has no
/// `leaseDurationSeconds`.
pub fn decide(
    lease: Option<&Lease>,
    identity: &str,
    now: Timestamp,
    default_duration: Duration,
) -> Decision {
    let Some(lease) = lease else {
        return Decision::Create;
    };
    let spec = lease.spec.as_ref();
    let holder = spec
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty());
    let Some(holder) = holder else {
        return Decision::Acquire { previous: None };
    };
    if holder == identity {
        return Decision::Renew;
    }
    let last = spec.and_then(|s| s.renew_time.as_ref().or(s.acquire_time.as_ref()));
    let Some(MicroTime(last)) = last else {
        // A holder that never wrote a time has no valid claim.
        return Decision::Acquire {
            previous: Some(holder),
        };
    };
    let secs = spec
        .and_then(|s| s.lease_duration_seconds)
        .unwrap_or_else(|| lease_seconds(default_duration));
    let expires = last
        .checked_add(SignedDuration::from_secs(i64::from(secs)))
        .unwrap_or(Timestamp::MAX);
    if expires < now {
        Decision::Acquire {
            previous: Some(holder),
        }
    } else {
        Decision::Wait { holder, expires }
    }
}

/// Builds the Lease to write for a `Create`, `Acquire` or `Renew` decision: `Renew` keeps
/// `acquireTime` and `leaseTransitions`; `Acquire` sets `acquireTime` and increments
/// `leaseTransitions`. The resourceVersion of `current` is kept, so the write is conditional.
pub fn claim(
    current: Option<&Lease>,
    config: &LeaseConfig,
    renewing: bool,
    now: Timestamp,
) -> Lease {
    let mut lease = current.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(config.name.clone()),
            namespace: Some(config.namespace.clone()),
            ..ObjectMeta::default()
        },
        spec: None,
    });
    let old = lease.spec.take().unwrap_or_default();
    let transitions = old.lease_transitions.unwrap_or(0);
    let is_new = current.is_none();
    lease.spec = Some(LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(lease_seconds(config.lease_duration)),
        acquire_time: if renewing {
            old.acquire_time.clone().or(Some(MicroTime(now)))
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(if renewing || is_new {
            transitions
        } else {
            transitions.saturating_add(1)
        }),
        ..old
    });
    lease
}

/// Builds the Lease that gives up our claim: no holder, a 1 s duration, renewed now, so any
/// candidate takes it at its next attempt. The resourceVersion of `current` is kept.
pub fn release(current: &Lease, now: Timestamp) -> Lease {
    let mut lease = current.clone();
    let mut spec = lease.spec.take().unwrap_or_default();
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(now));
    lease.spec = Some(spec);
    lease
}

/// What one acquire-or-renew attempt found.
enum Attempt {
    /// We hold the Lease now.
    Leading,
    /// Someone else holds it.
    Held { holder: String, expires: Timestamp },
    /// Our conditional write lost a race (409): someone else wrote the Lease.
    Conflict,
}

/// Competes for the Lease and publishes whether this replica leads.
pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
    tx: watch::Sender<bool>,
    /// The Lease as we last wrote it while leading (renewals replace exactly this version).
    ours: Option<Lease>,
    /// Gauge `imp_operator_is_leader` to keep in step with the flag, if any.
    metrics: Option<Arc<Metrics>>,
}

impl LeaderElector {
    /// An elector for `config.namespace/config.name`; it does nothing until [`Self::run`].
    pub fn new(client: kube::Client, config: LeaseConfig) -> Self {
        let (tx, _) = watch::channel(false);
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
            tx,
            ours: None,
            metrics: None,
        }
    }

    /// Keeps `imp_operator_is_leader` in `metrics` equal to this elector's flag.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        metrics.set_leader(false);
        self.metrics = Some(metrics);
        self
    }

    /// Publishes the flag (and the gauge); returns the previous flag.
    fn set_leading(&self, leading: bool) -> bool {
        if let Some(m) = &self.metrics {
            m.set_leader(leading);
        }
        self.tx.send_replace(leading)
    }

    /// A receiver that is `true` while this replica leads.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// This replica's identity.
    pub fn identity(&self) -> &str {
        &self.config.identity
    }

    /// Acquires and renews the Lease until `shutdown` completes, then releases it if held.
    ///
    /// Returns an error only for invalid timings or a failed release; transient API errors
    /// during the loop are logged and retried.
    pub async fn run(
        mut self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), LeaderError> {
        self.config.validate()?;
        tracing::info!(
            lease = %format!("{}/{}", self.config.namespace, self.config.name),
            identity = %self.config.identity,
            lease_duration = ?self.config.lease_duration,
            renew_deadline = ?self.config.renew_deadline,
            retry_period = ?self.config.retry_period,
            "starting leader election"
        );
        tokio::pin!(shutdown);
        let mut last_renewal: Option<Instant> = None;
        loop {
            let leading = *self.tx.borrow();
            let budget = match (leading, last_renewal) {
                (true, Some(at)) => (at + self.config.renew_deadline)
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
                _ => self.config.renew_deadline,
            };
            let attempt = tokio::select! {
                () = &mut shutdown => break,
                r = tokio::time::timeout(budget, self.attempt()) => r.unwrap_or_else(|_| {
                    Err(self.timeout_error(if leading { "Renewing" } else { "Acquiring" }, budget))
                }),
            };
            match attempt {
                Ok(Attempt::Leading) => {
                    last_renewal = Some(Instant::now());
                    if !leading {
                        let transitions = self
                            .ours
                            .as_ref()
                            .and_then(|l| l.spec.as_ref())
                            .and_then(|s| s.lease_transitions)
                            .unwrap_or(0);
                        tracing::info!(
                            identity = %self.config.identity,
                            lease = %self.config.name,
                            transitions,
                            "became leader"
                        );
                        self.set_leading(true);
                    } else {
                        tracing::debug!(identity = %self.config.identity, "renewed lease");
                    }
                }
                Ok(Attempt::Held { holder, expires }) => {
                    self.ours = None;
                    if leading {
                        self.step_down(&format!("lease is held by {holder}"));
                    } else {
                        tracing::debug!(%holder, %expires, "lease held by another replica");
                    }
                }
                Ok(Attempt::Conflict) => {
                    self.ours = None;
                    if leading {
                        self.step_down("another writer changed the lease (409 on renewal)");
                    } else {
                        tracing::debug!("lost a race to acquire the lease");
                    }
                }
                Err(error) => {
                    self.ours = None;
                    let overdue =
                        last_renewal.is_none_or(|at| at.elapsed() >= self.config.renew_deadline);
                    if leading && overdue {
                        tracing::warn!(error = %DisplayChain(&error), "lease renewal failed");
                        self.step_down("no successful renewal within renew_deadline");
                    } else {
                        tracing::warn!(error = %DisplayChain(&error), leading, "lease attempt failed; retrying");
                    }
                }
            }
            let wait = if *self.tx.borrow() {
                self.config.retry_period
            } else {
                jittered(self.config.retry_period)
            };
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        self.shut_down().await
    }

    /// Stops leading (first) and releases the Lease if we still hold it.
    async fn shut_down(&mut self) -> Result<(), LeaderError> {
        let was_leading = self.set_leading(false);
        if was_leading {
            tracing::info!(identity = %self.config.identity, "stopping: no longer leading");
        }
        let budget = self.config.renew_deadline;
        match tokio::time::timeout(budget, self.release_if_held()).await {
            Ok(r) => r,
            Err(_) => Err(self.timeout_error("Releasing", budget)),
        }
    }

    async fn release_if_held(&mut self) -> Result<(), LeaderError> {
        let current = match self.ours.take() {
            Some(l) => Some(l),
            None => self
                .api
                .get_opt(&self.config.name)
                .await
                .map_err(|e| self.api_error("Reading", e))?,
        };
        let Some(current) = current else {
            return Ok(());
        };
        let holder = current
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref());
        if holder != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        let released = release(&current, Timestamp::now());
        match self
            .api
            .replace(&self.config.name, &post_params(), &released)
            .await
        {
            Ok(_) => {
                tracing::info!(identity = %self.config.identity, lease = %self.config.name, "released lease");
                Ok(())
            }
            // Someone else wrote the Lease since our last renewal: it is not ours to release.
            Err(kube::Error::Api(s)) if s.is_conflict() => Ok(()),
            Err(e) => Err(self.api_error("Releasing", e)),
        }
    }

    /// One acquire-or-renew round trip.
    async fn attempt(&mut self) -> Result<Attempt, LeaderError> {
        let now = Timestamp::now();
        // While leading, renew exactly the version we wrote: any other write gives a 409.
        if let Some(ours) = self.ours.take() {
            let renewed = claim(Some(&ours), &self.config, true, now);
            return self.write(renewed, false, "Renewing").await;
        }
        let current = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.api_error("Reading", e))?;
        match decide(
            current.as_ref(),
            &self.config.identity,
            now,
            self.config.lease_duration,
        ) {
            Decision::Create => {
                let lease = claim(None, &self.config, false, now);
                self.write(lease, true, "Creating").await
            }
            Decision::Acquire { previous } => {
                tracing::debug!(previous = ?previous, "lease is free; acquiring");
                let lease = claim(current.as_ref(), &self.config, false, now);
                self.write(lease, false, "Acquiring").await
            }
            Decision::Renew => {
                let lease = claim(current.as_ref(), &self.config, true, now);
                self.write(lease, false, "Renewing").await
            }
            Decision::Wait { holder, expires } => Ok(Attempt::Held { holder, expires }),
        }
    }

    async fn write(
        &mut self,
        lease: Lease,
        create: bool,
        action: &'static str,
    ) -> Result<Attempt, LeaderError> {
        let result = if create {
            self.api.create(&post_params(), &lease).await
        } else {
            self.api
                .replace(&self.config.name, &post_params(), &lease)
                .await
        };
        match result {
            Ok(written) => {
                self.ours = Some(written);
                Ok(Attempt::Leading)
            }
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => {
                Ok(Attempt::Conflict)
            }
            Err(e) => Err(self.api_error(action, e)),
        }
    }

    fn step_down(&self, reason: &str) {
        tracing::warn!(identity = %self.config.identity, lease = %self.config.name, reason, "lost leadership");
        self.set_leading(false);
    }

    fn api_error(&self, action: &'static str, source: kube::Error) -> LeaderError {
        LeaderError::Api {
            action,
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source: Box::new(source),
        }
    }

    fn timeout_error(&self, action: &'static str, after: Duration) -> LeaderError {
        LeaderError::Timeout {
            action,
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            after,
        }
    }
}

fn post_params() -> PostParams {
    PostParams {
        dry_run: false,
        field_manager: Some(FIELD_MANAGER.to_string()),
    }
}

/// `base` stretched by a random 0–20 %, so candidates do not poll in lock-step.
fn jittered(base: Duration) -> Duration {
    let random =
        std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now());
    let fraction = (random % 1000) as f64 / 1000.0 * 0.2;
    base.mul_f64(1.0 + fraction)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn lease(holder: Option<&str>, renewed: Option<i64>, duration: Option<i32>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("imp-operator".into()),
                namespace: Some("imp-system".into()),
                resource_version: Some("42".into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                renew_time: renewed.map(|s| MicroTime(at(s))),
                acquire_time: renewed.map(|s| MicroTime(at(s - 100))),
                lease_duration_seconds: duration,
                lease_transitions: Some(3),
                ..LeaseSpec::default()
            }),
        }
    }

    fn config() -> LeaseConfig {
        LeaseConfig::new("imp-system", "imp-operator", "me")
    }

    const D: Duration = Duration::from_secs(15);

    #[test]
    fn missing_lease_is_created() {
        assert_eq!(decide(None, "me", at(0), D), Decision::Create);
    }

    #[test]
    fn own_lease_is_renewed_even_when_expired() {
        let l = lease(Some("me"), Some(-1000), Some(15));
        assert_eq!(decide(Some(&l), "me", at(0), D), Decision::Renew);
    }

    #[test]
    fn valid_foreign_claim_waits_until_expiry() {
        let l = lease(Some("other"), Some(-5), Some(15));
        assert_eq!(
            decide(Some(&l), "me", at(0), D),
            Decision::Wait {
                holder: "other".into(),
                expires: at(10)
            }
        );
        // Exactly at expiry the claim still holds; one second later it does not.
        assert!(matches!(
            decide(Some(&l), "me", at(10), D),
            Decision::Wait { .. }
        ));
        assert_eq!(
            decide(Some(&l), "me", at(11), D),
            Decision::Acquire {
                previous: Some("other".into())
            }
        );
    }

    #[test]
    fn expiry_uses_the_lease_duration_not_ours() {
        let l = lease(Some("other"), Some(-5), Some(2));
        assert!(matches!(
            decide(Some(&l), "me", at(0), D),
            Decision::Acquire { .. }
        ));
        // Without a duration on the lease, ours applies.
        let l = lease(Some("other"), Some(-5), None);
        assert!(matches!(
            decide(Some(&l), "me", at(0), D),
            Decision::Wait { .. }
        ));
    }

    #[test]
    fn released_or_timeless_lease_is_acquired() {
        for holder in [None, Some("")] {
            let l = lease(holder, Some(0), Some(15));
            assert_eq!(
                decide(Some(&l), "me", at(0), D),
                Decision::Acquire { previous: None }
            );
        }
        let l = lease(Some("other"), None, Some(15));
        assert_eq!(
            decide(Some(&l), "me", at(0), D),
            Decision::Acquire {
                previous: Some("other".into())
            }
        );
        let l = Lease {
            spec: None,
            ..lease(None, None, None)
        };
        assert_eq!(
            decide(Some(&l), "me", at(0), D),
            Decision::Acquire { previous: None }
        );
    }

    #[test]
    fn acquiring_counts_a_transition_and_keeps_the_version() {
        let old = lease(Some("other"), Some(-100), Some(15));
        let new = claim(Some(&old), &config(), false, at(0));
        let spec = new.spec.as_ref().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_transitions, Some(4));
        assert_eq!(spec.acquire_time, Some(MicroTime(at(0))));
        assert_eq!(spec.renew_time, Some(MicroTime(at(0))));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(new.metadata.resource_version.as_deref(), Some("42"));
    }

    #[test]
    fn renewing_keeps_acquire_time_and_transitions() {
        let old = lease(Some("me"), Some(-2), Some(15));
        let new = claim(Some(&old), &config(), true, at(0));
        let spec = new.spec.as_ref().unwrap();
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(spec.acquire_time, Some(MicroTime(at(-102))));
        assert_eq!(spec.renew_time, Some(MicroTime(at(0))));
    }

    #[test]
    fn creating_starts_at_zero_transitions() {
        let new = claim(None, &config(), false, at(0));
        assert_eq!(new.metadata.name.as_deref(), Some("imp-operator"));
        assert_eq!(new.metadata.namespace.as_deref(), Some("imp-system"));
        let spec = new.spec.unwrap();
        assert_eq!(spec.lease_transitions, Some(0));
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
    }

    #[test]
    fn release_frees_the_lease_for_the_next_candidate() {
        let old = lease(Some("me"), Some(-1), Some(15));
        let freed = release(&old, at(0));
        assert_eq!(freed.metadata.resource_version.as_deref(), Some("42"));
        let spec = freed.spec.as_ref().unwrap();
        assert_eq!(spec.holder_identity, None);
        assert_eq!(spec.lease_duration_seconds, Some(1));
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(
            decide(Some(&freed), "next", at(0), D),
            Decision::Acquire { previous: None }
        );
    }

    #[test]
    fn micro_time_is_written_with_microseconds() {
        let l = claim(
            None,
            &config(),
            false,
            Timestamp::from_microsecond(1_800_000_000_123_456).unwrap(),
        );
        let json = serde_json::to_value(&l).unwrap();
        assert_eq!(json["spec"]["renewTime"], "2027-01-15T08:00:00.123456Z");
    }

    #[test]
    fn lease_seconds_round_up() {
        assert_eq!(lease_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(lease_seconds(Duration::from_secs(15)), 15);
        assert_eq!(lease_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn unsafe_timings_are_rejected_naming_the_lease() {
        assert!(config().validate().is_ok());
        let mut c = config();
        c.renew_deadline = Duration::from_secs(20);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("imp-system/imp-operator"), "{err}");
        assert!(err.contains("lease_duration"), "{err}");
        let mut c = config();
        c.retry_period = Duration::from_secs(10);
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("retry_period")
        );
        let mut c = config();
        c.identity.clear();
        assert!(c.validate().unwrap_err().to_string().contains("identity"));
    }

    #[test]
    fn jitter_stays_within_twenty_percent() {
        for _ in 0..100 {
            let d = jittered(Duration::from_secs(1));
            assert!(
                d >= Duration::from_secs(1) && d <= Duration::from_millis(1200),
                "{d:?}"
            );
        }
    }
}
