//! `imp operator`: the controller-manager process.
//!
//! Turns its flags into an [`imp_operator::process::Config`] and runs it
//! ([`imp_operator::process::run`]): it connects with the ambient kubeconfig (`KUBECONFIG`, or
//! in-cluster), serves `/metrics`, `/healthz` and `/readyz`, optionally the admission webhook,
//! and runs every controller — with `--leader-elect` only while it holds the Lease, exiting
//! with status 1 when leadership is lost (like controller-runtime) so that a restart starts
//! from a clean cache.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use imp_operator::leader::LeaseConfig;
use imp_operator::placement::fencing::Trust;
use imp_operator::placement::reservation::PodSettings;
use imp_operator::process::{self, Config};
use imp_operator::vm::Settings;

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
    /// The node agents' namespace: only their Leases there (`imp-agent-<node>`, held by
    /// `<node>`) count as their renewals; a Lease anywhere else is ignored. The gateway hands
    /// VMs' Secrets and ConfigMaps to ServiceAccount `imp-agent` of this namespace only.
    #[arg(long, env = "POD_NAMESPACE", default_value = "imp-system")]
    agent_namespace: String,
    /// The agents' `--fence-after`, as they run with it: the operator never waits less than
    /// this (plus --fence-margin) for a lost node's agent, whatever its Lease says, and
    /// ignores a Lease whose leaseDurationSeconds is 0 or above 10 minutes and this.
    #[arg(long, default_value = "30s", value_parser = crate::args::parse_duration)]
    agent_fence_after: Duration,
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
    #[arg(long, default_value = imp_operator::placement::reservation::DEFAULT_IMAGE)]
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

/// Runs the operator until it is told to stop; exits with status 1 when it loses leadership.
pub fn main(args: Args) -> anyhow::Result<()> {
    crate::logging::init(args.log_json);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = config(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let ran = runtime.block_on(async {
        let (stop, _stopping) = shutdown::on_signals("shutting down");
        process::run(config, stop).await
    });
    match ran {
        // At once, without waiting for the controllers or the runtime's tasks.
        Err(process::Error::LostLeadership) => std::process::exit(1),
        r => Ok(r?),
    }
}

/// The identity of this replica: `--identity`, else `$POD_NAME`, else the hostname and PID.
fn identity(args: &Args) -> String {
    args.identity.clone().unwrap_or_else(|| {
        std::env::var("POD_NAME").unwrap_or_else(|_| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        })
    })
}

/// The operator's config from its flags.
fn config(args: &Args) -> anyhow::Result<Config> {
    let identity = identity(args);
    let reservations = (!args.no_reservation_pods).then(|| PodSettings {
        image: args.reservation_image.clone(),
        priority_class: Some(args.reservation_priority_class.clone()).filter(|p| !p.is_empty()),
    });
    let settings = Settings {
        requeue_pending: secs("requeue-pending", args.requeue_pending)?,
        requeue_active: secs("requeue-active", args.requeue_active)?,
        termination_timeout: secs("termination-timeout", args.termination_timeout)?,
        node_gone_grace: secs("node-gone-grace", args.node_gone_grace)?,
        node_loss_grace: secs("node-loss-grace", args.node_loss_grace)?,
        start_timeout: secs("start-timeout", args.start_timeout)?,
        fence_margin: secs("fence-margin", args.fence_margin)?,
        agent_leases: Trust {
            namespace: args.agent_namespace.clone(),
            fence_after: args.agent_fence_after,
        },
        overcommit_suspended: !args.no_suspended_overcommit,
        concurrency: args.concurrency,
        instance: Some(identity.clone()),
        reservations,
        ..Settings::default()
    };
    let lease = match args.leader_elect {
        false => None,
        true => Some(LeaseConfig {
            lease_duration: secs("lease-duration", args.lease_duration)?,
            renew_deadline: secs("renew-deadline", args.renew_deadline)?,
            retry_period: secs("retry-period", args.retry_period)?,
            ..LeaseConfig::new(
                args.lease_namespace.clone(),
                args.lease_name.clone(),
                identity,
            )
        }),
    };
    Ok(Config {
        ops_addr: args.metrics_addr,
        webhook: webhook::serving(
            &args.webhook,
            !args.no_reservation_pods,
            &args.agent_namespace,
        )?,
        lease,
        settings,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::Parser;
    use imp_operator::webhook::serving::Certificate;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn config_of(argv: &[&str]) -> anyhow::Result<Config> {
        let cli = Cli::try_parse_from(std::iter::once("imp").chain(argv.iter().copied()))?;
        config(&cli.args)
    }

    #[test]
    fn the_flags_become_the_operators_config() {
        let c = config_of(&[
            "--metrics-addr",
            "127.0.0.1:9090",
            "--leader-elect",
            "--identity",
            "replica-1",
            "--lease-duration",
            "20",
            "--node-loss-grace",
            "1.5",
            "--no-reservation-pods",
            "--webhook-addr",
            "127.0.0.1:9443",
            "--webhook-secret",
            "imp-webhook-tls",
            "--agent-namespace",
            "imp",
            "--agent-fence-after",
            "45s",
        ])
        .unwrap();
        assert_eq!(
            c.settings.agent_leases,
            Trust {
                namespace: "imp".into(),
                fence_after: Duration::from_secs(45),
            }
        );
        assert_eq!(c.ops_addr, "127.0.0.1:9090".parse().unwrap());
        let lease = c.lease.unwrap();
        assert_eq!(
            (lease.namespace.as_str(), lease.name.as_str()),
            ("imp-system", "imp-operator")
        );
        assert_eq!(lease.identity, "replica-1");
        assert_eq!(lease.lease_duration, Duration::from_secs(20));
        assert_eq!(c.settings.instance.as_deref(), Some("replica-1"));
        assert_eq!(c.settings.node_loss_grace, Duration::from_millis(1500));
        assert_eq!(c.settings.reservations, None);
        let webhook = c.webhook.unwrap();
        assert!(
            !webhook.quota_preview,
            "no reservation Pods: no quota preview"
        );
        assert!(
            matches!(&webhook.certificate, Certificate::Kept(k) if k.secret == "imp-webhook-tls"),
            "{:?}",
            webhook.certificate
        );
    }

    #[test]
    fn without_flags_the_operator_runs_unelected_with_reservations_and_no_webhook() {
        let c = config_of(&[]).unwrap();
        assert!(c.lease.is_none());
        assert!(c.webhook.is_none());
        assert_eq!(c.ops_addr, "0.0.0.0:8080".parse().unwrap());
        let pods = c.settings.reservations.unwrap();
        assert_eq!(
            pods.image,
            imp_operator::placement::reservation::DEFAULT_IMAGE
        );
        // The test harness admits the operator's reservation Pods of this image only.
        assert_eq!(pods.image, imp_testenv::rbac::RESERVATION_IMAGE);
        assert_eq!(c.settings.agent_leases, Trust::default());
        assert_eq!(pods.priority_class, None);
        assert_eq!(c.settings.requeue_pending, Duration::from_secs(30));
        assert!(c.settings.overcommit_suspended);
    }

    #[test]
    fn a_negative_number_of_seconds_is_refused_with_its_flag_named() {
        let e = config_of(&["--requeue-active=-1"]).unwrap_err().to_string();
        assert!(e.contains("--requeue-active"), "{e}");
        // Lease timings are read only under election.
        assert!(config_of(&["--retry-period=-1"]).is_ok());
        let e = config_of(&["--leader-elect", "--retry-period=-1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--retry-period"), "{e}");
    }
}
