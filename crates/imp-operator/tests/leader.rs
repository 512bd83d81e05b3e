//! Leader election against a real kube-apiserver (imp-testenv): one leader among two electors,
//! takeover after a kill, fast hand-over on graceful shutdown, stepping down when the lease is
//! stolen or the API server disappears.
//!
//! The electors run as the operator's ServiceAccount with the ClusterRole the chart ships, so a
//! Lease call the role does not allow fails here. Each test competes for the Lease in a
//! namespace of its own on the binary's shared control plane (the Lease keeps the name the
//! role's `resourceNames` allows); the test that kills the API server starts its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use imp_operator::leader::{LeaderElector, LeaseConfig};
use imp_operator::metrics::Metrics;
use imp_testenv::{ControlPlane, Options, rbac};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const LEASE: &str = "imp-operator";
const LEASE_DURATION: Duration = Duration::from_secs(2);
const RENEW_DEADLINE: Duration = Duration::from_millis(1500);
const RETRY: Duration = Duration::from_millis(250);
/// Room for request latency and scheduling on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(700);

fn config(ns: &str, identity: &str) -> LeaseConfig {
    LeaseConfig {
        lease_duration: LEASE_DURATION,
        renew_deadline: RENEW_DEADLINE,
        retry_period: RETRY,
        ..LeaseConfig::new(ns, LEASE, identity)
    }
}

/// One test's cluster: a control plane, the namespace of its Lease, the operator's identity
/// there, and an admin client that observes (and, as a third party, steals) the Lease.
struct Kube<'a> {
    cp: &'a ControlPlane,
    ns: String,
    operator: PathBuf,
    admin: kube::Client,
}

impl<'a> Kube<'a> {
    /// A namespace of its own on `cp`, with imp's RBAC installed for it.
    async fn on(cp: &'a ControlPlane) -> Result<Self> {
        let admin = cp.admin().await?;
        let ns = cp.namespace(&admin, "leader").await?;
        let ids = rbac::install(cp, &ns).await?;
        Ok(Self {
            cp,
            ns,
            operator: ids.operator,
            admin,
        })
    }

    /// A client as the operator's ServiceAccount, as an operator replica runs.
    async fn operator(&self) -> Result<kube::Client> {
        Ok(self.cp.client_from(&self.operator).await?)
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.admin.clone(), &self.ns)
    }
}

/// The test's cluster on the shared control plane; leaves the test when it should skip.
macro_rules! kube {
    () => {{
        let Some(cp) = ControlPlane::shared() else {
            return Ok(());
        };
        Kube::on(cp).await?
    }};
}

/// A running elector: its leadership flag, a way to stop it gracefully, and its task.
struct Replica {
    identity: String,
    leading: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    metrics: Arc<Metrics>,
    task: JoinHandle<Result<(), imp_operator::leader::LeaderError>>,
}

impl Replica {
    async fn start(kube: &Kube<'_>, identity: &str) -> Result<Self> {
        let client = kube.operator().await?;
        let metrics = Arc::new(Metrics::new());
        let elector =
            LeaderElector::new(client, config(&kube.ns, identity)).with_metrics(metrics.clone());
        let leading = elector.subscribe();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(elector.run(async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            identity: identity.to_string(),
            leading,
            stop: Some(stop),
            metrics,
            task,
        })
    }

    fn is_leading(&self) -> bool {
        *self.leading.borrow()
    }

    /// The `imp_operator_is_leader` sample this replica's registry renders.
    fn leader_gauge(&self) -> String {
        let text = self.metrics.encode().unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("imp_operator_is_leader "))
            .unwrap_or("missing")
            .to_string()
    }

    /// Waits until the leadership flag equals `want`; returns how long that took.
    async fn wait_leading(&mut self, want: bool, within: Duration) -> Result<Duration> {
        let start = Instant::now();
        tokio::time::timeout(within, self.leading.wait_for(|l| *l == want))
            .await
            .with_context(|| {
                format!(
                    "{} did not become leading={want} within {within:?}",
                    self.identity
                )
            })?
            .context("elector dropped its flag")?;
        Ok(start.elapsed())
    }

    async fn shutdown(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await??;
        Ok(())
    }
}

async fn lease(kube: &Kube<'_>) -> Result<Lease> {
    Ok(kube.leases().get(LEASE).await?)
}

fn holder(lease: &Lease) -> Option<String> {
    lease.spec.as_ref()?.holder_identity.clone()
}

fn transitions(lease: &Lease) -> i32 {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_transitions)
        .unwrap_or(0)
}

/// Starts two replicas and waits until one leads; returns (leader, follower).
async fn two_replicas(kube: &Kube<'_>) -> Result<(Replica, Replica)> {
    let a = Replica::start(kube, "replica-a").await?;
    let b = Replica::start(kube, "replica-b").await?;
    let deadline = Instant::now() + LEASE_DURATION + SLACK;
    while Instant::now() < deadline {
        match (a.is_leading(), b.is_leading()) {
            (true, false) => return Ok((a, b)),
            (false, true) => return Ok((b, a)),
            (true, true) => bail!("both replicas lead"),
            (false, false) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    bail!(
        "no replica became leader within {:?}",
        LEASE_DURATION + SLACK
    )
}

#[tokio::test]
async fn two_electors_exactly_one_leads() -> Result<()> {
    let kube = kube!();
    let (leader, follower) = two_replicas(&kube).await?;
    // Watch both flags for several lease periods: never both, never neither.
    let until = Instant::now() + LEASE_DURATION * 2;
    let mut samples = 0;
    while Instant::now() < until {
        assert!(leader.is_leading(), "{} stopped leading", leader.identity);
        assert!(!follower.is_leading(), "{} leads too", follower.identity);
        samples += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(leader.leader_gauge(), "1");
    assert_eq!(follower.leader_gauge(), "0");
    let l = lease(&kube).await?;
    assert_eq!(holder(&l).as_deref(), Some(leader.identity.as_str()));
    let spec = l.spec.as_ref().unwrap();
    assert_eq!(spec.lease_duration_seconds, Some(2));
    assert_eq!(transitions(&l), 0, "creating the lease is not a transition");
    let renewed = spec.renew_time.as_ref().unwrap().0;
    let acquired = spec.acquire_time.as_ref().unwrap().0;
    assert!(
        renewed > acquired,
        "the leader renews: {renewed} > {acquired}"
    );
    println!(
        "{samples} samples over {:?}: exactly one leader",
        LEASE_DURATION * 2
    );
    leader.shutdown().await?;
    follower.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn killed_leader_is_replaced_within_lease_duration_plus_retry() -> Result<()> {
    let kube = kube!();
    let (leader, mut follower) = two_replicas(&kube).await?;
    let before = lease(&kube).await?;
    // Like kill -9: the task vanishes without releasing the lease.
    leader.task.abort();
    let took = follower
        .wait_leading(true, LEASE_DURATION + RETRY * 2 + SLACK)
        .await?;
    println!(
        "takeover after kill: {:.3} s (lease {:?} + retry {:?})",
        took.as_secs_f64(),
        LEASE_DURATION,
        RETRY
    );
    assert!(
        took <= LEASE_DURATION + RETRY.mul_f64(1.2) + SLACK,
        "takeover took {took:?}"
    );
    // The old claim was honoured: no takeover before it could have expired.
    assert!(
        took >= LEASE_DURATION - RETRY - Duration::from_millis(100),
        "took over too early: {took:?}"
    );
    let after = lease(&kube).await?;
    assert_eq!(holder(&after).as_deref(), Some(follower.identity.as_str()));
    assert_eq!(transitions(&after), transitions(&before) + 1);
    follower.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn graceful_shutdown_releases_so_the_other_leads_within_retry_period() -> Result<()> {
    let kube = kube!();
    let (leader, mut follower) = two_replicas(&kube).await?;
    let old_flag = leader.leading.clone();
    let old_metrics = leader.metrics.clone();
    let start = Instant::now();
    let name = leader.identity.clone();
    leader.shutdown().await?;
    assert!(
        !*old_flag.borrow(),
        "{name} still claims to lead after shutdown"
    );
    assert!(
        old_metrics
            .encode()?
            .contains("\nimp_operator_is_leader 0\n")
    );
    let released = lease(&kube).await?;
    assert!(
        holder(&released).is_none() || holder(&released) == Some(follower.identity.clone()),
        "lease not released: {:?}",
        released.spec
    );
    follower.wait_leading(true, RETRY * 2 + SLACK).await?;
    let took = start.elapsed();
    println!(
        "hand-over after graceful shutdown: {:.3} s",
        took.as_secs_f64()
    );
    assert!(
        took <= RETRY.mul_f64(1.2) + SLACK,
        "hand-over took {took:?}"
    );
    let after = lease(&kube).await?;
    assert_eq!(holder(&after).as_deref(), Some(follower.identity.as_str()));
    assert_eq!(transitions(&after), 1);
    follower.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn stolen_lease_makes_the_leader_step_down() -> Result<()> {
    let kube = kube!();
    let mut replica = Replica::start(&kube, "replica-a").await?;
    replica.wait_leading(true, LEASE_DURATION + SLACK).await?;
    // A third party writes itself in as holder with a fresh claim.
    let api = kube.leases();
    let mut stolen = api.get(LEASE).await?;
    let spec = stolen.spec.as_mut().unwrap();
    spec.holder_identity = Some("thief".into());
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    spec.acquire_time = Some(MicroTime(Timestamp::now()));
    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    api.replace(LEASE, &PostParams::default(), &stolen).await?;
    let took = replica.wait_leading(false, RETRY * 2 + SLACK).await?;
    println!(
        "stepped down {:.3} s after the lease was stolen",
        took.as_secs_f64()
    );
    // While the thief's claim is valid the replica must stay a follower.
    tokio::time::sleep(LEASE_DURATION / 2).await;
    assert!(!replica.is_leading(), "re-acquired a valid foreign claim");
    assert_eq!(holder(&lease(&kube).await?).as_deref(), Some("thief"));
    // The thief never renews: once its claim expires, the replica takes the lease back.
    replica
        .wait_leading(true, LEASE_DURATION + RETRY * 2 + SLACK)
        .await?;
    let back = lease(&kube).await?;
    assert_eq!(holder(&back).as_deref(), Some("replica-a"));
    assert_eq!(transitions(&back), 2);
    replica.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn leader_steps_down_when_renewals_fail_past_the_deadline() -> Result<()> {
    // A control plane of its own, since this test kills it (no controller-manager needed).
    if !imp_testenv::controlplane::available(imp_testenv::Release::Newest) {
        return Ok(());
    }
    let cp = ControlPlane::start(Options {
        controller_manager: false,
        ..Options::default()
    })
    .await?;
    let kube = Kube::on(&cp).await?;
    let lease_name = format!("{}/{LEASE}", kube.ns);
    let mut replica = Replica::start(&kube, "replica-a").await?;
    replica.wait_leading(true, LEASE_DURATION + SLACK).await?;
    // The API server goes away: every renewal now fails.
    drop(kube);
    drop(cp);
    let took = replica
        .wait_leading(false, RENEW_DEADLINE + RETRY * 2 + SLACK)
        .await?;
    println!(
        "stepped down {:.3} s after the API server vanished (renew deadline {:?})",
        took.as_secs_f64(),
        RENEW_DEADLINE
    );
    assert!(
        took >= RENEW_DEADLINE - RETRY - Duration::from_millis(100),
        "gave up before the renew deadline: {took:?}"
    );
    // It stops leading before its claim can expire for anyone else.
    assert!(
        took < LEASE_DURATION,
        "still leading at lease expiry: {took:?}"
    );
    // Shutting down with no API server reports the failed release instead of hanging.
    let stop = replica.stop.take().unwrap();
    let _ = stop.send(());
    let result = tokio::time::timeout(RENEW_DEADLINE + SLACK, replica.task).await??;
    // The elector's last write was accepted before the server vanished, so it still holds
    // the lease and must try (and fail) to release it.
    let err = result.expect_err("release cannot succeed without an API server");
    assert!(err.to_string().contains(&lease_name), "{err}");
    Ok(())
}

#[tokio::test]
async fn invalid_timings_are_refused_before_touching_the_lease() -> Result<()> {
    let kube = kube!();
    let mut cfg = config(&kube.ns, "replica-a");
    cfg.renew_deadline = Duration::from_secs(5);
    let elector = LeaderElector::new(kube.operator().await?, cfg);
    let err = elector
        .run(std::future::pending())
        .await
        .expect_err("renew_deadline longer than the lease must be refused");
    assert!(err.to_string().contains("renew_deadline"), "{err}");
    assert!(kube.leases().get_opt(LEASE).await?.is_none());
    Ok(())
}
