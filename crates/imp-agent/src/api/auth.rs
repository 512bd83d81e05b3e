//! Who may call the agent: imp's gateway, and nobody else.
//!
//! Users never reach a node. The Kubernetes API server authenticates them and authorizes
//! `create impvms/exec`, `get impvms/console` or `list guestmetrics` of `subresources.imp.dev`,
//! then proxies the request to the operator's gateway, which calls this agent over mutual TLS
//! with its client certificate and names the user in headers
//! ([`imp_agent_api::USER_HEADER`], [`imp_agent_api::GROUP_HEADER`]). The gateway's
//! certificates are pinned by SHA-256: the operator publishes them in a ConfigMap of its
//! namespace, the agent reads it ([`follow_pins`]) and refuses every other caller
//! ([`decide`]), a bearer token included, with 401 and a message saying where to go instead.
//! The user named by the gateway is trusted for logs and per-caller session limits only: the
//! authorization has been made by the API server.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use http::{HeaderMap, StatusCode};
use imp_agent_api::tls::{certificates_from_pem, digest, hex};
use imp_agent_api::{GROUP_HEADER, USER_HEADER};
use k8s_openapi::api::core::v1::ConfigMap;

/// How often the ConfigMap of the gateway's certificates is read again.
pub const PINS_REFRESH: Duration = Duration::from_secs(10);

/// The subresource of an ImpVM a request acts on (or, for [`Subresource::GuestMetrics`], the
/// namespace's ImpVMs it reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Subresource {
    /// `impvms/exec`: run a command.
    Exec,
    /// `impvms/console`: read the serial console.
    Console,
    /// The guests' figures of a namespace's VMs.
    GuestMetrics,
}

impl Subresource {
    /// Its name in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Subresource::Exec => "exec",
            Subresource::Console => "console",
            Subresource::GuestMetrics => "guest-metrics",
        }
    }
}

/// The user the gateway names.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct User {
    /// Username.
    pub username: String,
    /// Groups.
    pub groups: Vec<String>,
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    /// A bearer token was presented: user credentials are never accepted on a node.
    #[error(
        "Unauthorized: the node agent accepts no user credentials; exec, console and top go through the Kubernetes API server (imp exec -n NS VM, kubectl imp exec VM)"
    )]
    UserToken,
    /// The caller presented no certificate, or not the gateway's.
    #[error(
        "Unauthorized: only imp's gateway may call the node agent (a client certificate published in {configmap}); {presented}"
    )]
    NotGateway {
        /// Where the gateway's certificates are published.
        configmap: String,
        /// What the caller presented.
        presented: String,
    },
    /// The gateway's certificates are not known (yet): nobody is let in.
    #[error("The node agent does not know imp's gateway certificates yet: {0}")]
    Unknown(String),
    /// The gateway named no user.
    #[error("Bad request: the gateway named no user ({USER_HEADER})")]
    NoUser,
}

impl Denial {
    /// The HTTP status that answers this refusal.
    pub fn status(&self) -> StatusCode {
        match self {
            Denial::UserToken | Denial::NotGateway { .. } => StatusCode::UNAUTHORIZED,
            Denial::Unknown(_) => StatusCode::SERVICE_UNAVAILABLE,
            Denial::NoUser => StatusCode::BAD_REQUEST,
        }
    }
}

/// What the agent knows of the gateway's certificates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pins {
    /// Not read yet, or unreadable: why.
    Unknown(String),
    /// The SHA-256 of each of the gateway's certificates.
    Known(Vec<[u8; 32]>),
}

/// Whether a request comes from the gateway, and for whom: `peer` is the SHA-256 of the
/// connection's client certificate, `source` where the pins come from (for the message).
pub fn decide(
    pins: &Pins,
    source: &str,
    peer: Option<&[u8; 32]>,
    headers: &HeaderMap,
) -> Result<User, Denial> {
    if headers.contains_key(http::header::AUTHORIZATION) {
        return Err(Denial::UserToken);
    }
    let known = match pins {
        Pins::Unknown(why) => return Err(Denial::Unknown(why.clone())),
        Pins::Known(known) => known,
    };
    match peer {
        Some(p) if known.contains(p) => {}
        Some(p) => {
            return Err(Denial::NotGateway {
                configmap: source.to_owned(),
                presented: format!("the client certificate has SHA-256 {}", hex(p)),
            });
        }
        None => {
            return Err(Denial::NotGateway {
                configmap: source.to_owned(),
                presented: "no client certificate was presented".into(),
            });
        }
    }
    let username = headers
        .get(USER_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|u| !u.is_empty())
        .ok_or(Denial::NoUser)?;
    let groups = headers
        .get_all(GROUP_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_owned)
        .collect();
    Ok(User {
        username: username.to_owned(),
        groups,
    })
}

/// The pins a ConfigMap publishes: the SHA-256 of every certificate in its values (one per
/// operator replica, each under a key of its own).
pub fn pins_of(cm: Option<&ConfigMap>, source: &str) -> Pins {
    let Some(cm) = cm else {
        return Pins::Unknown(format!("ConfigMap {source} does not exist"));
    };
    let pins: Vec<[u8; 32]> = cm
        .data
        .iter()
        .flat_map(|d| d.values())
        .flat_map(|pem| certificates_from_pem(pem))
        .map(|c| digest(c.as_ref()))
        .collect();
    if pins.is_empty() {
        Pins::Unknown(format!("ConfigMap {source} holds no certificate"))
    } else {
        Pins::Known(pins)
    }
}

/// The gateway's pins as last read, and where they come from.
#[derive(Debug)]
pub struct Gateway {
    source: String,
    pins: RwLock<Pins>,
    /// The ConfigMap's API and name, when the pins are read from the cluster.
    reader: Option<(kube::Api<ConfigMap>, String)>,
    /// When the ConfigMap was last read (reads on demand are at most one per second).
    last_read: tokio::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Gateway {
    /// Pins read from ConfigMap `source` (`namespace/name`) through `client`: unknown until
    /// the first read ([`follow_pins`], or a request that finds them unknown).
    pub fn reading(client: kube::Client, source: &str) -> Arc<Self> {
        let reader = source.split_once('/').map(|(namespace, name)| {
            (
                kube::Api::<ConfigMap>::namespaced(client, namespace),
                name.to_owned(),
            )
        });
        let why = match reader {
            Some(_) => format!("ConfigMap {source} not read yet"),
            None => format!("--gateway-configmap {source:?} is not NAMESPACE/NAME"),
        };
        Arc::new(Self {
            source: source.to_owned(),
            pins: RwLock::new(Pins::Unknown(why)),
            reader,
            last_read: tokio::sync::Mutex::new(None),
        })
    }

    /// Pins known from the start and never read (tests).
    pub fn fixed(source: &str, pins: Vec<[u8; 32]>) -> Arc<Self> {
        Arc::new(Self {
            source: source.to_owned(),
            pins: RwLock::new(Pins::Known(pins)),
            reader: None,
            last_read: tokio::sync::Mutex::new(None),
        })
    }

    /// Where the pins come from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the certificate with SHA-256 `digest` is pinned now.
    pub fn knows(&self, digest: &[u8; 32]) -> bool {
        matches!(self.current(), Pins::Known(p) if p.contains(digest))
    }

    /// Replaces the pins.
    pub fn set(&self, pins: Pins) {
        if let Ok(mut p) = self.pins.write() {
            *p = pins;
        }
    }

    fn current(&self) -> Pins {
        self.pins
            .read()
            .map(|p| p.clone())
            .unwrap_or_else(|_| Pins::Unknown("the pins' lock is poisoned".into()))
    }

    /// The pins as of a read of the ConfigMap that started after this call: a read already
    /// begun after it answers it too, else one is made, at most one a second (a caller waits
    /// out the rest of the second rather than being refused on stale pins). What was read is
    /// kept; an unreadable ConfigMap keeps the pins known before (a restarting API server does
    /// not lock the gateway out). `None` when the pins are fixed or the read failed.
    pub async fn read(&self) -> Option<Pins> {
        let (api, name) = self.reader.as_ref()?;
        let asked = tokio::time::Instant::now();
        let mut last = self.last_read.lock().await;
        if last.is_some_and(|started| started >= asked) {
            return Some(self.current());
        }
        if let Some(started) = *last {
            tokio::time::sleep_until(started + ON_DEMAND_GAP).await;
        }
        *last = Some(tokio::time::Instant::now());
        match api.get_opt(name).await {
            Ok(cm) => {
                let pins = pins_of(cm.as_ref(), &self.source);
                self.set(pins.clone());
                Some(pins)
            }
            Err(e) => {
                tracing::warn!(configmap = %self.source,
                    error = %imp_api::chain::DisplayChain(&e), "reading the gateway's certificates failed");
                None
            }
        }
    }

    /// [`decide`] with the pins as they are now; when they are unknown, or the caller's
    /// certificate is not among them (the operator may have made a new one), the ConfigMap
    /// is read again first.
    pub async fn authorize(
        &self,
        peer: Option<&[u8; 32]>,
        headers: &HeaderMap,
    ) -> Result<User, Denial> {
        match decide(&self.current(), &self.source, peer, headers) {
            Err(Denial::Unknown(_)) | Err(Denial::NotGateway { .. })
                if peer.is_some() && self.read().await.is_some() =>
            {
                decide(&self.current(), &self.source, peer, headers)
            }
            decided => decided,
        }
    }
}

/// The shortest time between two reads of the ConfigMap.
const ON_DEMAND_GAP: Duration = Duration::from_secs(1);

/// Reads the ConfigMap of the gateway's certificates every [`PINS_REFRESH`] (every second
/// while none is known) until `stop`, logging each change.
pub async fn follow_pins(gateway: Arc<Gateway>, stop: impl std::future::Future<Output = ()>) {
    let mut stop = std::pin::pin!(stop);
    let mut last: Option<Pins> = None;
    loop {
        if let Some(pins) = gateway.read().await
            && last.as_ref() != Some(&pins)
        {
            match &pins {
                Pins::Known(p) => tracing::info!(configmap = %gateway.source,
                    certificates = p.len(), "gateway certificates read"),
                Pins::Unknown(why) => tracing::warn!(configmap = %gateway.source,
                    reason = %why, "no gateway certificates: exec, console and top refused"),
            }
            last = Some(pins);
        }
        let every = match gateway.current() {
            Pins::Known(_) => PINS_REFRESH,
            Pins::Unknown(_) => ON_DEMAND_GAP,
        };
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = &mut stop => return,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn only_a_pinned_certificate_with_a_user_gets_through() {
        let pins = Pins::Known(vec![[1; 32], [2; 32]]);
        let h = headers(&[
            (USER_HEADER, "alice"),
            (GROUP_HEADER, "dev"),
            (GROUP_HEADER, "system:authenticated"),
        ]);
        let user = decide(&pins, "imp-system/gw", Some(&[2; 32]), &h).unwrap();
        assert_eq!(user.username, "alice");
        assert_eq!(user.groups, ["dev", "system:authenticated"]);

        let e = decide(&pins, "imp-system/gw", Some(&[3; 32]), &h).unwrap_err();
        assert_eq!(e.status(), StatusCode::UNAUTHORIZED);
        assert!(e.to_string().contains("imp-system/gw"), "{e}");
        assert!(e.to_string().contains(&"03".repeat(32)), "{e}");
        let e = decide(&pins, "imp-system/gw", None, &h).unwrap_err();
        assert!(e.to_string().contains("no client certificate"), "{e}");

        let nobody = decide(&pins, "s", Some(&[1; 32]), &HeaderMap::new()).unwrap_err();
        assert_eq!(nobody, Denial::NoUser);
        assert_eq!(nobody.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn a_bearer_token_is_refused_even_from_the_gateway() {
        let pins = Pins::Known(vec![[1; 32]]);
        let h = headers(&[("authorization", "Bearer abc"), (USER_HEADER, "alice")]);
        for peer in [None, Some(&[1; 32])] {
            let e = decide(&pins, "s", peer, &h).unwrap_err();
            assert_eq!(e, Denial::UserToken);
            assert!(e.to_string().contains("no user credentials"), "{e}");
        }
    }

    #[test]
    fn nobody_is_let_in_while_the_pins_are_unknown() {
        let pins = Pins::Unknown("ConfigMap s not read yet".into());
        let h = headers(&[(USER_HEADER, "alice")]);
        let e = decide(&pins, "s", Some(&[1; 32]), &h).unwrap_err();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(e.to_string().contains("not read yet"), "{e}");
    }

    #[test]
    fn a_configmap_gives_the_digests_of_its_certificates() {
        let cert = rcgen::generate_simple_self_signed(vec!["gw".to_owned()]).unwrap();
        let pem = super::super::tls::pem("CERTIFICATE", cert.cert.der());
        let cm = |data: Option<&str>| ConfigMap {
            data: data.map(|d| [("01700000000-op-1.crt".to_owned(), d.to_owned())].into()),
            ..Default::default()
        };
        assert_eq!(
            pins_of(Some(&cm(Some(&pem))), "s"),
            Pins::Known(vec![digest(cert.cert.der())])
        );
        assert!(matches!(pins_of(None, "ns/gw"), Pins::Unknown(w) if w.contains("ns/gw")));
        assert!(matches!(
            pins_of(Some(&cm(Some("junk"))), "s"),
            Pins::Unknown(_)
        ));
        assert!(matches!(pins_of(Some(&cm(None)), "s"), Pins::Unknown(_)));
    }

    #[tokio::test]
    async fn fixed_pins_are_never_read_again() {
        let g = Gateway::fixed("s", vec![[9; 32]]);
        let h = headers(&[(USER_HEADER, "bob")]);
        let user = g.authorize(Some(&[9; 32]), &h).await.unwrap();
        assert_eq!(user.username, "bob");
        g.set(Pins::Unknown("gone".into()));
        assert!(g.authorize(Some(&[9; 32]), &h).await.is_err());
        assert_eq!(g.read().await, None, "nothing to read from");
    }
}
