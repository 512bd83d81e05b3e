//! `imp operator`: the controller-manager process.
//!
//! Connects with the ambient kubeconfig (`KUBECONFIG`, or in-cluster), serves `/metrics`,
//! `/healthz` and `/readyz`, optionally the admission webhook, and runs the ImpVM controller —
//! with `--leader-elect` only while it holds the Lease, exiting when leadership is lost (like
//! controller-runtime) so that a restart starts from a clean cache.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use imp_operator::controller::{self, Settings};
use imp_operator::leader::{LeaderElector, LeaseConfig};
use imp_operator::metrics::{self, Health, Metrics};
use tokio::sync::watch;

use crate::shutdown;

mod webhook;

/// Flags of `imp operator`.
#[derive(clap::Args)]
pub struct Args {
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    #[command(flatten)]
    webhook: webhook::WebhookArgs,
    /// Run controllers only while holding the coordination.k8s.io Lease.
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the Lease.
    #[arg(long, default_value = "imp-system")]
    lease_namespace: String,
    /// Name of the Lease.
    #[arg(long, default_value = "imp-operator")]
    lease_name: String,
    /// This replica's identity (defaults to $POD_NAME, else the hostname and PID).
    #[arg(long)]
    identity: Option<String>,
    /// Lease duration in seconds (fractions allowed).
    #[arg(long, default_value_t = 15.0)]
    lease_duration: f64,
    /// Renew deadline in seconds.
    #[arg(long, default_value_t = 10.0)]
    renew_deadline: f64,
    /// Retry period in seconds.
    #[arg(long, default_value_t = 2.0)]
    retry_period: f64,
    /// Seconds before a VM with no node is looked at again.
    #[arg(long, default_value_t = 30.0)]
    requeue_pending: f64,
    /// Seconds before a placed, not yet Running VM is looked at again.
    #[arg(long, default_value_t = 10.0)]
    requeue_active: f64,
    /// Seconds a deleted VM waits for its agent's cleanup before the finalizer is removed.
    #[arg(long, default_value_t = 120.0)]
    termination_timeout: f64,
    /// Seconds a deleted VM whose node object is gone waits before the finalizer is removed.
    #[arg(long, default_value_t = 10.0)]
    node_gone_grace: f64,
    /// Seconds a node may be NotReady before its VMs are moved (rescheduleOnNodeLoss) or failed.
    #[arg(long, default_value_t = 40.0)]
    node_loss_grace: f64,
    /// Seconds a VM may stay Starting before it fails.
    #[arg(long, default_value_t = 300.0)]
    start_timeout: f64,
    /// Seconds added to a node agent's fence deadline (its Lease's leaseDurationSeconds)
    /// before the VMs of its lost node are moved or failed.
    #[arg(long, default_value_t = 10.0)]
    fence_margin: f64,
    /// Keep suspended VMs' memory reserved instead of the Go project's overcommit.
    #[arg(long)]
    no_suspended_overcommit: bool,
    /// Reconciles at once.
    #[arg(long, default_value_t = 8)]
    concurrency: u16,
    /// Make no reservation Pods: Kubernetes then does not see what VMs hold on their nodes
    /// (kube-scheduler and the kubelet may hand it to Pods) and ResourceQuotas do not count
    /// VMs' vCPU and memory.
    #[arg(long)]
    no_reservation_pods: bool,
    /// The image of reservation Pods (a pause image the nodes can pull).
    #[arg(long, default_value = imp_operator::reservation::DEFAULT_IMAGE)]
    reservation_image: String,
    /// The PriorityClass of reservation Pods (one high enough that no Pod preempts them; the
    /// chart ships `imp-vm-reservation`). Empty: none.
    #[arg(long, default_value = "")]
    reservation_priority_class: String,
    /// Log as JSON lines instead of compact text.
    #[arg(long)]
    log_json: bool,
}

fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .with_context(|| format!("--{name} must be a non-negative number of seconds, got {v}"))
}

/// Runs the operator until it is told to stop.
pub fn main(args: Args) -> anyhow::Result<()> {
    crate::logging::init(args.log_json);
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut config = kube::Config::infer()
        .await
        .context("loading the Kubernetes client config (KUBECONFIG or in-cluster)")?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("imp-operator/", env!("CARGO_PKG_VERSION"))),
    ));
    let client = kube::Client::try_from(config).context("building the Kubernetes client")?;
    let identity = args.identity.clone().unwrap_or_else(|| {
        std::env::var("POD_NAME").unwrap_or_else(|_| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        })
    });
    let settings = Settings {
        requeue_pending: secs("requeue-pending", args.requeue_pending)?,
        requeue_active: secs("requeue-active", args.requeue_active)?,
        termination_timeout: secs("termination-timeout", args.termination_timeout)?,
        node_gone_grace: secs("node-gone-grace", args.node_gone_grace)?,
        node_loss_grace: secs("node-loss-grace", args.node_loss_grace)?,
        start_timeout: secs("start-timeout", args.start_timeout)?,
        fence_margin: secs("fence-margin", args.fence_margin)?,
        overcommit_suspended: !args.no_suspended_overcommit,
        concurrency: args.concurrency,
        instance: Some(identity.clone()),
        reservations: (!args.no_reservation_pods).then(|| imp_operator::reservation::PodSettings {
            image: args.reservation_image.clone(),
            priority_class: Some(args.reservation_priority_class.clone()).filter(|p| !p.is_empty()),
        }),
        ..Settings::default()
    };

    let (stop_tx, stop_rx) = shutdown::on_signals("shutting down");
    let stopped = shutdown::stopped;

    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new());
    health.set_live();
    let ops = tokio::spawn(metrics::serve(
        args.metrics_addr,
        metrics.clone(),
        health.clone(),
        stopped(stop_rx.clone()),
    ));

    webhook::spawn(
        &args.webhook,
        !args.no_reservation_pods,
        client.clone(),
        health.clone(),
        stop_tx.clone(),
        stop_rx.clone(),
    )?;

    if args.leader_elect {
        let lease = LeaseConfig {
            lease_duration: secs("lease-duration", args.lease_duration)?,
            renew_deadline: secs("renew-deadline", args.renew_deadline)?,
            retry_period: secs("retry-period", args.retry_period)?,
            ..LeaseConfig::new(
                args.lease_namespace.clone(),
                args.lease_name.clone(),
                identity.clone(),
            )
        };
        let elector = LeaderElector::new(client.clone(), lease);
        let mut leading = elector.subscribe();
        // The lease is released only after the controllers have stopped, so the next leader
        // never writes while this one still finishes a reconcile.
        let (release_tx, release_rx) = watch::channel(false);
        let election = tokio::spawn(elector.run(stopped(release_rx)));
        // Non-leaders are ready too: they stand by.
        health.set_ready();
        metrics.set_leader(false);
        tokio::select! {
            r = leading.wait_for(|l| *l) => { r.context("leader election ended before leading")?; }
            _ = stopped(stop_rx.clone()) => {
                let _ = release_tx.send(true);
                let _ = election.await;
                return Ok(());
            }
        }
        tracing::info!(identity = %identity, "leading; starting controllers");
        metrics.set_leader(true);
        let ctl = tokio::spawn(controller::run(
            client.clone(),
            settings,
            Some(metrics.clone()),
            None,
            stopped(stop_rx.clone()),
        ));
        tokio::select! {
            _ = leading.wait_for(|l| !*l) => {
                tracing::error!(identity = %identity, "lost leadership; exiting");
                metrics.set_leader(false);
                std::process::exit(1);
            }
            _ = stopped(stop_rx.clone()) => {}
        }
        let _ = ctl.await;
        let _ = release_tx.send(true);
        match election.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "releasing the lease failed"),
            Err(e) => tracing::warn!(error = %e, "leader election task failed"),
            Ok(Ok(())) => {}
        }
    } else {
        controller::run(
            client,
            settings,
            Some(metrics.clone()),
            Some(health.clone()),
            stopped(stop_rx.clone()),
        )
        .await
        .context("running the ImpVM controller")?;
    }
    let _ = ops.await;
    Ok(())
}
