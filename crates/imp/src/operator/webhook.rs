//! `imp operator`'s admission webhook flags, turned into where it serves and where its
//! certificate comes from: files (cert-manager) or the operator itself (a Secret it keeps, see
//! docs/webhook.md). [`imp_operator::webhook::serving`] starts it.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use imp_operator::webhook::certs::{KeeperConfig, Names, Policy};
use imp_operator::webhook::serving::{Certificate, Serving};

/// The webhook flags of `imp operator`.
#[derive(clap::Args, Debug)]
#[command(group = clap::ArgGroup::new("webhook_tls").args(["webhook_cert", "webhook_secret"]))]
pub struct WebhookArgs {
    /// Address of the admission webhook (HTTPS); off unless set. Needs --webhook-cert and
    /// --webhook-key (a certificate from files, e.g. cert-manager's), or --webhook-secret (the
    /// operator makes and rotates its own).
    #[arg(long, requires = "webhook_tls")]
    webhook_addr: Option<SocketAddr>,
    /// PEM certificate chain of the webhook.
    #[arg(long, requires_all = ["webhook_key", "webhook_addr"])]
    webhook_cert: Option<PathBuf>,
    /// PEM private key of the webhook.
    #[arg(long, requires = "webhook_cert")]
    webhook_key: Option<PathBuf>,
    /// How often --webhook-cert and --webhook-key are read again, so a certificate renewed in
    /// them (cert-manager's mounted Secret) is served without a restart.
    #[arg(long, default_value = "1m", value_name = "DURATION", value_parser = parse_validity, requires = "webhook_cert")]
    webhook_cert_reload: Duration,
    /// Secret in --namespace where the operator keeps the webhook's CA and serving certificate,
    /// made and rotated by itself, publishing the CA as the caBundle of
    /// --webhook-configurations.
    #[arg(
        long,
        value_name = "NAME",
        requires = "webhook_addr",
        conflicts_with_all = ["webhook_cert", "webhook_key"]
    )]
    webhook_secret: Option<String>,
    /// The Service in front of the webhook: the serving certificate is for SVC, SVC.NS,
    /// SVC.NS.svc and SVC.NS.svc.cluster.local (NS: --namespace).
    #[arg(long, default_value = "imp-webhook", value_name = "SVC")]
    webhook_service: String,
    /// Another DNS name of the serving certificate (repeatable).
    #[arg(
        long = "webhook-dns-name",
        value_name = "NAME",
        requires = "webhook_secret"
    )]
    webhook_dns_names: Vec<String>,
    /// An IP address of the serving certificate (repeatable).
    #[arg(long = "webhook-ip", value_name = "IP", requires = "webhook_secret")]
    webhook_ips: Vec<IpAddr>,
    /// The webhook configurations whose caBundle the operator sets, comma-separated; each name
    /// is looked up as a ValidatingWebhookConfiguration and as a MutatingWebhookConfiguration.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "NAMES",
        default_value = "imp-validating-webhook,imp-mutating-webhook"
    )]
    webhook_configurations: Vec<String>,
    /// Validity of the serving certificate (1y, 90d, 12h, 6s, 1h30m, or seconds); it is
    /// renewed when two thirds have passed.
    #[arg(long, default_value = "1y", value_name = "DURATION", value_parser = parse_validity)]
    webhook_cert_validity: Duration,
    /// Validity of the webhook CA (at least three serving validities); rotated when two thirds
    /// have passed.
    #[arg(long, default_value = "10y", value_name = "DURATION", value_parser = parse_validity)]
    webhook_ca_validity: Duration,
    /// The APIServices served on the webhook's listener whose caBundle the operator sets with
    /// --webhook-secret, comma-separated (the gateway's; empty: none).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "NAMES",
        default_value = "v1alpha1.subresources.imp.dev"
    )]
    api_services: Vec<String>,
    /// Do not serve the gateway (the aggregated API `subresources.imp.dev` through which
    /// users exec into VMs, read consoles and guest figures) on the webhook's listener.
    #[arg(long)]
    no_gateway: bool,
    /// The operator's own namespace, which holds --webhook-secret and the ConfigMap in which
    /// the gateway publishes its client certificates (imp-gateway-client).
    #[arg(long, env = "POD_NAMESPACE", default_value = "imp-system")]
    namespace: String,
}

/// Parses a validity: a number of seconds, or numbers with units `s`, `m`, `h`, `d`, `w`, `y`
/// (365 days) in a row, like `1y`, `90d` or `1h30m`.
pub fn parse_validity(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a validity like 1y, 90d, 12h, 1h30m, 6s or 3600");
    if s.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = s.parse::<u64>() {
        return Ok(Duration::from_secs(n));
    }
    let mut total: u64 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (num, tail) = rest.split_at(digits);
        let n: u64 = num.parse().map_err(|_| bad())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let per: u64 = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86_400,
            "w" => 7 * 86_400,
            "y" => 365 * 86_400,
            _ => return Err(bad()),
        };
        total = n
            .checked_mul(per)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
        rest = tail;
    }
    Ok(Duration::from_secs(total))
}

/// The webhook the operator serves, if `--webhook-addr` is set; `quota_preview`: refuse at
/// admission a VM a ResourceQuota would refuse (reservation Pods are made).
/// `agents`: the node agents' namespace (their ServiceAccount's, to whom the gateway hands
/// their VMs' Secrets and ConfigMaps).
pub fn serving(
    args: &WebhookArgs,
    quota_preview: bool,
    agents: &str,
) -> anyhow::Result<Option<Serving>> {
    let Some(addr) = args.webhook_addr else {
        return Ok(None);
    };
    let certificate = match (&args.webhook_secret, &args.webhook_cert, &args.webhook_key) {
        (Some(secret), _, _) => Certificate::Kept(keeper_config(args, secret)?),
        (None, Some(cert), Some(key)) => Certificate::Files {
            cert: cert.clone(),
            key: key.clone(),
            reload: args.webhook_cert_reload,
        },
        _ => anyhow::bail!(
            "--webhook-addr needs --webhook-cert and --webhook-key, or --webhook-secret"
        ),
    };
    Ok(Some(Serving {
        addr,
        certificate,
        quota_preview,
        gateway: (!args.no_gateway).then(|| args.namespace.clone()),
        agents: imp_api::inputs::agents_user(agents),
    }))
}

fn keeper_config(args: &WebhookArgs, secret: &str) -> anyhow::Result<KeeperConfig> {
    let names = Names::for_service(
        &args.webhook_service,
        &args.namespace,
        &args.webhook_dns_names,
        &args.webhook_ips,
    );
    let policy = Policy::new(names, args.webhook_cert_validity, args.webhook_ca_validity)
        .context("checking --webhook-cert-validity and --webhook-ca-validity")?;
    Ok(KeeperConfig {
        namespace: args.namespace.clone(),
        secret: secret.to_owned(),
        configurations: args
            .webhook_configurations
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect(),
        api_services: args
            .api_services
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect(),
        policy,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: WebhookArgs,
    }

    fn parse(argv: &[&str]) -> Result<WebhookArgs, String> {
        Cli::try_parse_from(std::iter::once("imp").chain(argv.iter().copied()))
            .map(|c| c.args)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_operators_flags_hold_together() {
        #[derive(clap::Parser)]
        struct Operator {
            #[command(flatten)]
            args: crate::operator::Args,
        }
        <Operator as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn validities_parse_in_units_or_seconds() {
        assert_eq!(parse_validity("6"), Ok(Duration::from_secs(6)));
        assert_eq!(parse_validity("6s"), Ok(Duration::from_secs(6)));
        assert_eq!(parse_validity("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_validity("1y"), Ok(Duration::from_secs(365 * 86_400)));
        assert_eq!(parse_validity("2w1d"), Ok(Duration::from_secs(15 * 86_400)));
        for bad in ["", "y", "1x", "1.5h", "h1", "99999999999999999999y"] {
            assert!(parse_validity(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_self_managed_mode_has_its_defaults() {
        let a = parse(&[
            "--webhook-addr",
            "0.0.0.0:9443",
            "--webhook-secret",
            "imp-webhook-tls",
        ])
        .unwrap();
        assert_eq!(a.webhook_service, "imp-webhook");
        assert_eq!(
            a.webhook_configurations,
            ["imp-validating-webhook", "imp-mutating-webhook"]
        );
        assert_eq!(a.webhook_cert_validity, Duration::from_secs(365 * 86_400));
        assert_eq!(a.webhook_ca_validity, Duration::from_secs(3650 * 86_400));
        let c = keeper_config(&a, "imp-webhook-tls").unwrap();
        assert_eq!(c.secret, "imp-webhook-tls");
        assert!(
            c.policy
                .names()
                .dns
                .contains(&format!("imp-webhook.{}.svc", a.namespace)),
            "{:?}",
            c.policy.names()
        );
    }

    #[test]
    fn the_two_modes_exclude_each_other() {
        let e = parse(&[
            "--webhook-addr",
            "127.0.0.1:9443",
            "--webhook-secret",
            "s",
            "--webhook-cert",
            "c",
            "--webhook-key",
            "k",
        ])
        .unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        let e = parse(&["--webhook-addr", "127.0.0.1:9443"]).unwrap_err();
        assert!(
            e.contains("--webhook-cert") && e.contains("--webhook-secret"),
            "{e}"
        );
        let e = parse(&["--webhook-secret", "s"]).unwrap_err();
        assert!(e.contains("--webhook-addr"), "{e}");
        let e = parse(&["--webhook-addr", "127.0.0.1:9443", "--webhook-cert", "c"]).unwrap_err();
        assert!(e.contains("--webhook-key"), "{e}");
        let e = parse(&["--webhook-ip", "127.0.0.1"]).unwrap_err();
        assert!(e.contains("--webhook-secret"), "{e}");
        assert!(
            parse(&[
                "--webhook-addr",
                "127.0.0.1:9443",
                "--webhook-cert",
                "c",
                "--webhook-key",
                "k"
            ])
            .is_ok()
        );
        assert!(parse(&[]).is_ok());
    }

    #[test]
    fn lifetimes_that_cannot_rotate_are_refused_with_the_flags_named() {
        let a = parse(&[
            "--webhook-addr",
            "127.0.0.1:9443",
            "--webhook-secret",
            "s",
            "--webhook-cert-validity",
            "1y",
            "--webhook-ca-validity",
            "2y",
        ])
        .unwrap();
        let e = format!("{:#}", keeper_config(&a, "s").unwrap_err());
        assert!(
            e.contains("--webhook-ca-validity") && e.contains("at least 3 times"),
            "{e}"
        );
    }
}
