//! The webhook's own certificates, without cert-manager: a CA and a serving certificate the
//! operator makes, keeps in a Secret of its namespace, rotates, and publishes as the `caBundle`
//! of its webhook configurations.
//!
//! [`material`] is what the Secret holds, parsed, and the rcgen code that makes new
//! certificates; [`decide`] is the pure choice of the next step from one read of the Secret and
//! of the configurations; [`Keeper`] (in `apply`) reads, writes, publishes and swaps the
//! certificate the listener serves ([`super::tls::LiveCert`]).
//!
//! # The Secret
//! Type `kubernetes.io/tls`, keys `tls.crt` (the serving certificate), `tls.key` (its PKCS#8
//! key), `ca.crt` (the CAs to trust, PEM, the one that signs first) and `ca.key` (the signing
//! CA's key). The published `caBundle` is every CA of `ca.crt` that has not expired.
//!
//! # Rotation
//! A certificate is renewed once two thirds of its life have passed ([`material::Cert::renew_at`]).
//! The serving certificate lives [`Policy::serving_validity`] (never past its CA), the CA
//! [`Policy::ca_validity`], which is at least three serving lifetimes. A CA rotation takes three
//! passes, so that the API server trusts whatever any replica serves at every moment:
//! 1. a new CA goes in front of `ca.crt`; the old one stays and signs, one last time, a fresh
//!    serving certificate (so the wait below never runs into its expiry); both CAs are
//!    published;
//! 2. once every configuration's `caBundle` holds the new CA (read back, on a later pass) and
//!    the new CA is [`Policy::settle`] old (the API server has seen the bundle), a serving
//!    certificate signed by it replaces the old one;
//! 3. once that certificate has been in the Secret for [`Policy::settle`] (every replica has
//!    re-read the Secret by then), the old CA is dropped from `ca.crt` and from the `caBundle`.
//!
//! # Replicas
//! Every replica serves the webhook, so every replica runs a [`Keeper`]; they agree through the
//! Secret: each write is a create, or an update carrying the resourceVersion it was computed
//! from. The replica whose write is refused (409) re-reads the Secret and uses what the winner
//! wrote, so two replicas starting together never make two CAs. A `caBundle` is patched only
//! after re-reading the Secret unchanged, with a JSON patch that tests the configuration's
//! resourceVersion, so a replica with a stale read never takes a new CA out of it.

pub mod decide;
pub mod material;

mod apply;

use std::net::IpAddr;
use std::time::Duration;

pub use self::apply::{FIRST_RETRY, Keeper, KeeperConfig, KeeperError, Pass};

/// The shortest serving lifetime: a third of it must leave every replica time to re-read.
pub const MIN_SERVING_VALIDITY: Duration = Duration::from_secs(3);

/// How many serving lifetimes a CA lives at least.
pub const CA_LIFETIMES: u32 = 3;

/// The names the serving certificate is for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    /// DNS names, the first one also the subject's common name.
    pub dns: Vec<String>,
    /// IP addresses (tests register the webhook by `https://127.0.0.1:PORT`).
    pub ips: Vec<IpAddr>,
}

impl Names {
    /// The four names of Service `service` in `namespace` (what the API server checks when a
    /// configuration names the Service), then `extra_dns` and `ips`.
    pub fn for_service(
        service: &str,
        namespace: &str,
        extra_dns: &[String],
        ips: &[IpAddr],
    ) -> Self {
        let mut dns = vec![
            service.to_owned(),
            format!("{service}.{namespace}"),
            format!("{service}.{namespace}.svc"),
            format!("{service}.{namespace}.svc.cluster.local"),
        ];
        for name in extra_dns {
            if !dns.contains(name) {
                dns.push(name.clone());
            }
        }
        let mut unique = Vec::new();
        for ip in ips {
            if !unique.contains(ip) {
                unique.push(*ip);
            }
        }
        Names { dns, ips: unique }
    }
}

/// What the certificates are for and how long they live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    names: Names,
    serving_validity: Duration,
    ca_validity: Duration,
}

/// Why a [`Policy`] cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// No name to put in the serving certificate.
    #[error("The webhook serving certificate needs at least one DNS name or IP address")]
    NoNames,
    /// The serving lifetime is too short for replicas to re-read the Secret before it ends.
    #[error("The webhook serving certificate validity must be at least {min:?}, got {got:?}")]
    ServingTooShort {
        /// The shortest allowed.
        min: Duration,
        /// What was asked.
        got: Duration,
    },
    /// The CA would not outlive the serving certificates it signs.
    #[error(
        "The webhook CA validity ({ca:?}) must be at least {CA_LIFETIMES} times the serving certificate's ({serving:?})"
    )]
    CaTooShort {
        /// The CA lifetime asked.
        ca: Duration,
        /// The serving lifetime asked.
        serving: Duration,
    },
}

impl Policy {
    /// A policy, refusing lifetimes that could not rotate safely.
    pub fn new(
        names: Names,
        serving_validity: Duration,
        ca_validity: Duration,
    ) -> Result<Self, PolicyError> {
        if names.dns.is_empty() && names.ips.is_empty() {
            return Err(PolicyError::NoNames);
        }
        if serving_validity < MIN_SERVING_VALIDITY {
            return Err(PolicyError::ServingTooShort {
                min: MIN_SERVING_VALIDITY,
                got: serving_validity,
            });
        }
        if ca_validity < serving_validity.saturating_mul(CA_LIFETIMES) {
            return Err(PolicyError::CaTooShort {
                ca: ca_validity,
                serving: serving_validity,
            });
        }
        Ok(Policy {
            names,
            serving_validity,
            ca_validity,
        })
    }

    /// The names the serving certificate must hold.
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// How long a new serving certificate lives.
    pub fn serving_validity(&self) -> Duration {
        self.serving_validity
    }

    /// How long a new CA lives.
    pub fn ca_validity(&self) -> Duration {
        self.ca_validity
    }

    /// How often each replica re-reads the Secret and the configurations: a thirtieth of the
    /// serving lifetime, between 250 ms and 1 min (a third of the lifetime is left after
    /// renewal, for the other replicas to re-read).
    pub fn refresh(&self) -> Duration {
        (self.serving_validity / 30).clamp(Duration::from_millis(250), Duration::from_secs(60))
    }

    /// How long after a write every replica has re-read the Secret and the API server has seen
    /// a published `caBundle`: two refreshes, and a second for X.509's whole-second times.
    pub fn settle(&self) -> Duration {
        self.refresh() * 2 + Duration::from_secs(1)
    }
}

/// Whole seconds, rounded up, as X.509 times are compared in.
fn secs(d: Duration) -> i64 {
    let up = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    i64::try_from(up).unwrap_or(i64::MAX)
}

/// A Unix time as RFC 3339, for logs.
pub fn rfc3339(unix: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(unix)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| format!("@{unix}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_service_gets_its_four_names_then_the_extra_ones_once() {
        let n = Names::for_service(
            "imp-webhook",
            "imp-system",
            &["imp-webhook".into(), "hook.example".into()],
            &["127.0.0.1".parse().unwrap(), "127.0.0.1".parse().unwrap()],
        );
        assert_eq!(
            n.dns,
            [
                "imp-webhook",
                "imp-webhook.imp-system",
                "imp-webhook.imp-system.svc",
                "imp-webhook.imp-system.svc.cluster.local",
                "hook.example"
            ]
        );
        assert_eq!(n.ips, ["127.0.0.1".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn lifetimes_that_cannot_rotate_safely_are_refused() {
        let names = Names::for_service("s", "ns", &[], &[]);
        let year = Duration::from_secs(365 * 86400);
        assert!(Policy::new(names.clone(), year, year * 10).is_ok());
        assert_eq!(
            Policy::new(names.clone(), Duration::from_secs(2), year),
            Err(PolicyError::ServingTooShort {
                min: MIN_SERVING_VALIDITY,
                got: Duration::from_secs(2)
            })
        );
        assert!(matches!(
            Policy::new(names, year, year * 2),
            Err(PolicyError::CaTooShort { .. })
        ));
        assert_eq!(
            Policy::new(Names::default(), year, year * 10),
            Err(PolicyError::NoNames)
        );
    }

    #[test]
    fn refresh_follows_the_lifetime_within_bounds() {
        let names = Names::for_service("s", "ns", &[], &[]);
        let p = |s: u64| {
            Policy::new(
                names.clone(),
                Duration::from_secs(s),
                Duration::from_secs(s * 3),
            )
            .unwrap()
        };
        assert_eq!(p(6).refresh(), Duration::from_millis(250));
        assert_eq!(p(600).refresh(), Duration::from_secs(20));
        assert_eq!(p(365 * 86400).refresh(), Duration::from_secs(60));
        assert_eq!(p(6).settle(), Duration::from_millis(1500));
        assert_eq!(secs(p(6).settle()), 2, "rounded up");
    }
}
