//! Where the admission webhook serves and where its certificate comes from: files another tool
//! renews (cert-manager's mounted Secret), or a Secret the operator makes, rotates and publishes
//! the CA of itself (docs/webhook.md); [`spawn`] starts it either way.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::certs::{Keeper, KeeperConfig};
use super::tls::{self, LiveCert};
use crate::chain::DisplayChain;
use crate::gateway::Gateway;
use crate::shutdown::raised;
use imp_telemetry::Health;

/// The part of readiness the self-managed webhook holds back until it serves.
const HEALTH_PART: &str = "webhook";

/// Where the webhook's serving certificate comes from.
#[derive(Clone, Debug)]
pub enum Certificate {
    /// PEM files, read again every `reload` so a renewed certificate is served without a
    /// restart.
    Files {
        /// The certificate chain.
        cert: PathBuf,
        /// The private key.
        key: PathBuf,
        /// How often both are read again.
        reload: Duration,
    },
    /// A Secret the operator keeps ([`Keeper`]).
    Kept(KeeperConfig),
}

/// The admission webhook of the operator process.
#[derive(Clone, Debug)]
pub struct Serving {
    /// Address of the HTTPS listener.
    pub addr: SocketAddr,
    /// Where its certificate comes from.
    pub certificate: Certificate,
    /// Refuse at admission a VM a ResourceQuota would refuse (reservation Pods are made).
    pub quota_preview: bool,
    /// Serve the gateway ([`crate::gateway`]) on the same listener, its client certificate
    /// kept in this namespace; `None`: off.
    pub gateway: Option<String>,
    /// The user name of the node agents' ServiceAccount, to whom the gateway hands their
    /// VMs' Secrets and ConfigMaps (`system:serviceaccount:<namespace>:imp-agent`).
    pub agents: String,
}

/// Starts the webhook on tasks of its own; a failure to get a certificate or to bind raises
/// `stop`. The self-managed mode holds the operator's readiness until it serves, so the
/// Service sends this replica no admission request before.
pub fn spawn(
    serving: Serving,
    client: kube::Client,
    health: Arc<Health>,
    stop: watch::Sender<bool>,
) {
    match serving.certificate.clone() {
        Certificate::Kept(config) => {
            health.hold(
                HEALTH_PART,
                format!(
                    "no serving certificate from Secret {}/{} yet",
                    config.namespace, config.secret
                ),
            );
            let keeper = Keeper::new(client.clone(), config);
            tokio::spawn(self_managed(serving, keeper, client, health, stop));
        }
        Certificate::Files { cert, key, reload } => {
            let files = Files { cert, key, reload };
            tokio::spawn(from_files(serving, files, client, stop));
        }
    }
}

/// Gets a certificate from the Secret (making one if needed), then serves with it while the
/// keeper rotates it.
async fn self_managed(
    serving: Serving,
    keeper: Keeper,
    client: kube::Client,
    health: Arc<Health>,
    stop: watch::Sender<bool>,
) {
    let Some(live) = keeper.start(raised(stop.subscribe())).await else {
        return;
    };
    match bound(&serving, live.clone(), client, &stop).await {
        Ok(hook) => {
            health.release(HEALTH_PART);
            tokio::spawn(keeper.run(live, raised(stop.subscribe())));
            hook.run(raised(stop.subscribe())).await;
        }
        Err(e) => failed(&e, &stop),
    }
}

/// The files mode's certificate and how often it is read again.
struct Files {
    cert: PathBuf,
    key: PathBuf,
    reload: Duration,
}

async fn from_files(
    serving: Serving,
    files: Files,
    client: kube::Client,
    stop: watch::Sender<bool>,
) {
    let started = async {
        let key = tls::load_files(&files.cert, &files.key).await?;
        let live = Arc::new(LiveCert::new(key));
        bound(&serving, live.clone(), client, &stop)
            .await
            .map(|hook| (hook, live))
    };
    match started.await {
        Ok((hook, live)) => {
            tokio::spawn(tls::follow_files(
                files.cert,
                files.key,
                live,
                files.reload,
                raised(stop.subscribe()),
            ));
            hook.run(raised(stop.subscribe())).await;
        }
        Err(e) => failed(&e, &stop),
    }
}

/// The listener bound, with the quota preview and, if on, the gateway.
async fn bound(
    serving: &Serving,
    live: Arc<LiveCert>,
    client: kube::Client,
    stop: &watch::Sender<bool>,
) -> Result<super::Webhook, super::WebhookError> {
    let hook = super::bind_live(serving.addr, live, client.clone())
        .await?
        .with_quota_preview(serving.quota_preview);
    let Some(namespace) = &serving.gateway else {
        return Ok(hook);
    };
    let api_services = match &serving.certificate {
        Certificate::Kept(k) => k.api_services.clone(),
        Certificate::Files { .. } => vec![crate::gateway::route::API_SERVICE.to_owned()],
    };
    let gateway = Gateway::new(client, namespace, &serving.agents, &api_services);
    gateway.spawn(raised(stop.subscribe()));
    hook.with_gateway(gateway)
}

fn failed(error: &super::WebhookError, stop: &watch::Sender<bool>) {
    tracing::error!(error = %DisplayChain(error), "admission webhook failed");
    let _ = stop.send(true);
}
