//! The operator process assembled: the ops server (`/metrics`, `/healthz`, `/readyz`), the
//! admission webhook, leader election and every controller (ImpVM, ImpNetwork,
//! ImpVMSnapshot), from one [`Config`]. `imp operator` only turns its flags into that config.
//!
//! With a Lease ([`Config::lease`]) the controllers run only while this replica holds it, and
//! losing it ends [`run`] with [`Error::LostLeadership`] at once (like controller-runtime), so
//! that the process exits and a restart starts from a clean cache. Non-leaders are ready: they
//! stand by.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;

use crate::chain::DisplayChain;
use crate::ipam::Ipam;
use crate::leader::{LeaderElector, LeaseConfig};
use crate::metrics::Metrics;
use crate::shutdown::raised;
use crate::webhook::serving::{self, Serving};
use crate::{migration, network, snapshot, vm, warmpool};
use imp_telemetry::Health;

/// Everything the operator process is started with.
#[derive(Clone, Debug)]
pub struct Config {
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    pub ops_addr: SocketAddr,
    /// The admission webhook; `None`: not served.
    pub webhook: Option<Serving>,
    /// The Lease the controllers run under; `None`: they run at once, without election.
    pub lease: Option<LeaseConfig>,
    /// The ImpVM controller's timings and switches.
    pub settings: vm::Settings,
}

/// Why the operator process ended other than by its stop flag.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kubeconfig and not in a cluster, or a kubeconfig that does not load.
    #[error("Loading the Kubernetes client config (KUBECONFIG or in-cluster)")]
    KubeConfig(#[source] kube::config::InferConfigError),
    /// The client could not be built from the config.
    #[error("Building the Kubernetes client")]
    Client(#[source] kube::Error),
    /// The elector stopped before this replica ever led.
    #[error("Leader election ended before leading")]
    Election(#[source] watch::error::RecvError),
    /// The ImpVM controller could not run.
    #[error("Running the ImpVM controller")]
    Controller(#[source] vm::ControllerError),
    /// This replica held the Lease and lost it; its controllers may still be mid-reconcile, so
    /// the process must exit rather than go on.
    #[error("Lost leadership")]
    LostLeadership,
}

/// Runs the operator until `stop` is raised; the webhook raises it too when it fails.
pub async fn run(config: Config, stop: watch::Sender<bool>) -> Result<(), Error> {
    let client = client().await?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new());
    health.set_live();
    let ops = tokio::spawn(imp_telemetry::serve(
        config.ops_addr,
        metrics.clone(),
        health.clone(),
        raised(stop.subscribe()),
    ));
    if let Some(webhook) = config.webhook {
        serving::spawn(webhook, client.clone(), health.clone(), stop.clone());
    }
    let parts = Parts {
        client,
        settings: config.settings,
        metrics,
        health,
        stop,
    };
    match config.lease {
        Some(lease) => {
            if lead(parts, lease).await? == Led::Never {
                return Ok(());
            }
        }
        None => {
            let shutdown = raised(parts.stop.subscribe());
            controllers(
                parts.client,
                parts.settings,
                Some(parts.metrics),
                Some(parts.health),
                shutdown,
            )
            .await
            .map_err(Error::Controller)?;
        }
    }
    let _ = ops.await;
    Ok(())
}

/// The ambient client (`KUBECONFIG`, or in-cluster), introducing itself as `imp-operator/<version>`.
async fn client() -> Result<kube::Client, Error> {
    let mut config = kube::Config::infer().await.map_err(Error::KubeConfig)?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("imp-operator/", env!("CARGO_PKG_VERSION"))),
    ));
    kube::Client::try_from(config).map_err(Error::Client)
}

/// What the controllers run with, once they may.
struct Parts {
    client: kube::Client,
    settings: vm::Settings,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    stop: watch::Sender<bool>,
}

/// Whether a replica under election ever led before it stopped.
#[derive(Debug, PartialEq, Eq)]
enum Led {
    Never,
    Once,
}

/// Stands by until this replica holds `lease`, then runs the controllers until `stop`; the
/// Lease is released only after they have stopped, so the next leader never writes while this
/// one still finishes a reconcile.
async fn lead(parts: Parts, lease: LeaseConfig) -> Result<Led, Error> {
    let Parts {
        client,
        settings,
        metrics,
        health,
        stop,
    } = parts;
    let identity = lease.identity.clone();
    let elector = LeaderElector::new(client.clone(), lease);
    let mut leading = elector.subscribe();
    let (release_tx, release_rx) = watch::channel(false);
    let election = tokio::spawn(elector.run(raised(release_rx)));
    health.set_ready();
    metrics.set_leader(false);
    tokio::select! {
        r = leading.wait_for(|l| *l) => { r.map_err(Error::Election)?; }
        () = raised(stop.subscribe()) => {
            let _ = release_tx.send(true);
            let _ = election.await;
            return Ok(Led::Never);
        }
    }
    tracing::info!(identity = %identity, "leading; starting controllers");
    metrics.set_leader(true);
    let running = tokio::spawn(controllers(
        client,
        settings,
        Some(metrics.clone()),
        None,
        raised(stop.subscribe()),
    ));
    tokio::select! {
        _ = leading.wait_for(|l| !*l) => {
            tracing::error!(identity = %identity, "lost leadership; exiting");
            metrics.set_leader(false);
            return Err(Error::LostLeadership);
        }
        () = raised(stop.subscribe()) => {}
    }
    let _ = running.await;
    let _ = release_tx.send(true);
    match election.await {
        Ok(Err(e)) => tracing::warn!(error = %DisplayChain(&e), "releasing the lease failed"),
        Err(e) => {
            tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "leader election task failed")
        }
        Ok(Ok(())) => {}
    }
    Ok(Led::Once)
}

/// Runs every controller (ImpVM, ImpNetwork, ImpVMSnapshot, ImpWarmPool, ImpVMMigration) until
/// `shutdown` completes.
/// `health` is made ready once the ImpVM controller's caches have filled (`None` under
/// election: a standby is ready already).
pub async fn controllers(
    client: kube::Client,
    settings: vm::Settings,
    metrics: Option<Arc<Metrics>>,
    health: Option<Arc<Health>>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), vm::ControllerError> {
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    // One allocator for the VM and network controllers: its per-network locks serialize their
    // writes.
    let ipam = Arc::new(Ipam::new(client.clone(), metrics.clone()));
    let networks = tokio::spawn(network::run(
        client.clone(),
        ipam.clone(),
        metrics.clone(),
        settings.instance.clone(),
        shutdown.clone(),
    ));
    let snapshots = tokio::spawn(snapshot::run(
        client.clone(),
        metrics.clone(),
        settings.instance.clone(),
        shutdown.clone(),
    ));
    let pools = tokio::spawn(warmpool::run(
        client.clone(),
        metrics.clone(),
        settings.instance.clone(),
        shutdown.clone(),
    ));
    let unsupported = tokio::spawn(crate::unsupported::run(
        client.clone(),
        settings.instance.clone(),
        shutdown.clone(),
    ));
    // Migrations book their targets through the VM controller's scheduler and ledger.
    let migrations = |ctx| {
        let moves = migration::run(client.clone(), ctx, shutdown.clone());
        Some(tokio::spawn(moves))
    };
    let vms = vm::run(
        client.clone(),
        settings,
        ipam,
        metrics,
        health,
        shutdown.clone(),
        migrations,
    )
    .await;
    if let Err(e) = unsupported.await {
        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "the watch of kinds with no controller failed");
    }
    if let Err(e) = networks.await {
        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "network controller task failed");
    }
    if let Err(e) = snapshots.await {
        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "snapshot controller task failed");
    }
    if let Err(e) = pools.await {
        tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "warm pool controller task failed");
    }
    vms
}
