//! The agent's side of VM networking: before a VM's shim starts, its TAP is wired on its
//! ImpNetwork's bridge ([`attach`]); ImpNetwork changes (VTEP tables, NAT, groups) reach the
//! node through a watch ([`watch`]); VMs found on disk after a restart are adopted ([`adopt`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use imp_api::network::ImpNetwork;
use imp_api::vm::{ImpVM, ImpVMSpec};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::node::metrics::Metrics;
use crate::runtime::control;
use crate::runtime::state::StateDir;
use imp_net::{NetAttachment, NodeNet, resolv, view};

/// How often the node's network is brought back to the plan even without a change.
pub const RESYNC: Duration = Duration::from_secs(30);

/// How often the rules' drop counters reach the agent's metrics.
pub const DROPS_EVERY: Duration = Duration::from_secs(5);

/// Why a VM's network is not wired.
#[derive(Debug)]
pub enum NotWired {
    /// Not yet: the operator has not written the VM's address. Try again soon.
    Waiting(String),
    /// It cannot be: the message names the network and the cause.
    Refused(String),
}

/// Wires the network of `vm` (if it has one) and returns the attachment its spec records.
pub async fn attach(
    client: &kube::Client,
    net: &NodeNet,
    vm: &ImpVM,
    uid: &str,
    spec: &ImpVMSpec,
) -> Result<Option<NetAttachment>, NotWired> {
    let Some(r) = &spec.network_ref else {
        return Ok(None);
    };
    let ns = vm.namespace().unwrap_or_default();
    let api: Api<ImpNetwork> = Api::namespaced(client.clone(), &ns);
    let network = match api.get_opt(&r.name).await {
        Ok(Some(n)) => n,
        Ok(None) => {
            return Err(NotWired::Refused(format!(
                "ImpNetwork {ns}/{} (spec.networkRef) does not exist",
                r.name
            )));
        }
        Err(e) => {
            return Err(NotWired::Waiting(format!(
                "reading ImpNetwork {ns}/{}: {e}",
                r.name
            )));
        }
    };
    let Some(ip) = vm.status.as_ref().and_then(|s| s.ip.clone()) else {
        return Err(NotWired::Waiting(format!(
            "the operator has not given the VM an address on ImpNetwork {ns}/{} yet",
            r.name
        )));
    };
    let mtu = net.guest_mtu().await.map_err(|e| {
        NotWired::Waiting(format!(
            "reading the node's interfaces: {}",
            imp_api::chain::chain(&e)
        ))
    })?;
    let dns = resolv::node_nameservers().await;
    let attachment = view::attachment(&ns, &vm.name_any(), &network, &ip, mtu, &dns)
        .map_err(NotWired::Refused)?;
    if let Ok(v) = view::network_view(&network) {
        net.upsert_network(v);
    }
    net.attach(uid, attachment.clone())
        .await
        .map_err(NotWired::Refused)?;
    tracing::info!(vm = %format!("{ns}/{}", vm.name_any()), network = %attachment.network, ip = %ip, tap = %attachment.tap, "network wired");
    Ok(Some(attachment))
}

/// Adopts the attachments of every VM on disk, so the first sync keeps their devices.
pub async fn adopt(net: &NodeNet, state: &StateDir) {
    let st = state.clone();
    let found = tokio::task::spawn_blocking(move || {
        let Ok((records, _)) = st.list() else {
            return Vec::new();
        };
        records
            .into_iter()
            .filter_map(|r| {
                let spec = control::read_spec(&st, &r.name).ok()?;
                Some((r.name, spec.network?))
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    for (uid, a) in found {
        let (network, tap) = (a.network.clone(), a.tap.clone());
        match net.adopt(&uid, a) {
            Ok(()) => {
                tracing::info!(uid, %network, %tap, "adopted a VM's network");
            }
            Err(why) => {
                tracing::error!(uid, %network, %tap, why, "not adopting a VM's network");
            }
        }
    }
}

/// Follows every ImpNetwork and re-syncs the node when one changes, and every [`RESYNC`];
/// moves the rules' drop counters into `metrics` every [`DROPS_EVERY`].
pub async fn watch(client: kube::Client, net: Arc<NodeNet>, metrics: Arc<Metrics>) {
    let api: Api<ImpNetwork> = Api::all(client);
    let (store, writer) = reflector::store();
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects()
        .boxed();
    let mut tick = tokio::time::interval(RESYNC);
    let mut drops = tokio::time::interval(DROPS_EVERY);
    loop {
        tokio::select! {
            _ = drops.tick() => {
                metrics.add_drops(&net.take_drops().await);
                continue;
            }
            e = events.next() => match e {
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "watching ImpNetworks");
                    continue;
                }
                None => return,
            },
            _ = tick.tick() => {}
        }
        // Let a burst of changes settle into one sync.
        tokio::time::sleep(Duration::from_millis(100)).await;
        while let Some(Some(_)) = events.next().now_or_never() {}
        net.set_networks(views(&store));
        if let Err(e) = net.sync().await {
            tracing::warn!(error = %imp_api::chain::chain(&e), "syncing the node's networks");
        }
    }
}

fn views(store: &Store<ImpNetwork>) -> BTreeMap<String, imp_net::plan::NetworkView> {
    store
        .state()
        .iter()
        .filter_map(|n| match view::network_view(n) {
            Ok(v) => Some((v.key.clone(), v)),
            Err(why) => {
                tracing::debug!(why, "ImpNetwork not usable");
                None
            }
        })
        .collect()
}
