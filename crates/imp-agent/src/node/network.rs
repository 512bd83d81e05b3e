//! The agent's side of VM networking: before a VM's shim starts, its TAP is wired on its
//! ImpNetwork's bridge ([`attach`]); ImpNetwork changes (VTEP tables, NAT, groups) reach the
//! node through a watch ([`watch`]); VMs found on disk after a restart are adopted ([`adopt`]).
//! Guests never reach the API server: neither its Service address nor the endpoints behind it
//! ([`api_addresses`], read again at every resync).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use imp_api::network::ImpNetwork;
use imp_api::vm::{ImpVM, ImpVMSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
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
                let owner = r.owner.map(|o| format!("{}/{}", o.namespace, o.name));
                Some((r.name, spec.network?, owner))
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    for (uid, a, owner) in found {
        // A claim stopped between its spec and its TAP: the TAP is still the record owner's.
        if let Some(former) = owner.filter(|o| *o != a.vm)
            && let Err(why) = net.repair_tap(&a, &former).await
        {
            tracing::error!(uid, tap = %a.tap, former, why, "putting back a VM's TAP");
        }
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

/// The namespace and name of the EndpointSlice of Service `default/kubernetes`: the API
/// server's own endpoints (the API server's endpoint reconciler names it after the Service).
pub const API_ENDPOINTS: (&str, &str) = ("default", "kubernetes");

/// The API server's addresses no guest may reach: `service` (the address the agent reaches
/// it at, in a cluster Service `kubernetes`'s ClusterIP) and every IPv4 endpoint behind it in
/// `slice`, ready or not, sorted. Pure.
pub fn api_addresses(service: Option<Ipv4Addr>, slice: Option<&EndpointSlice>) -> Vec<Ipv4Addr> {
    let endpoints = slice
        .filter(|s| s.address_type == "IPv4")
        .into_iter()
        .flat_map(|s| s.endpoints.iter())
        .flat_map(|e| e.addresses.iter())
        .filter_map(|a| a.parse::<Ipv4Addr>().ok());
    let mut out: Vec<Ipv4Addr> = service.into_iter().chain(endpoints).collect();
    out.sort();
    out.dedup();
    out
}

/// The API server's addresses as now published ([`api_addresses`]); `None` when its
/// EndpointSlice cannot be read (what was known stays).
pub async fn read_api_addresses(
    client: &kube::Client,
    service: Option<Ipv4Addr>,
) -> Option<Vec<Ipv4Addr>> {
    let (namespace, name) = API_ENDPOINTS;
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(slice) => Some(api_addresses(service, slice.as_ref())),
        Err(e) => {
            tracing::warn!(error = %imp_api::chain::DisplayChain(&e),
                "reading the API server's endpoints (EndpointSlice default/kubernetes); guests are kept from the addresses known");
            None
        }
    }
}

/// Follows every ImpNetwork and re-syncs the node when one changes, and every [`RESYNC`]
/// (reading the API server's endpoints again then, `service` being its Service address);
/// moves the rules' drop counters into `metrics` every [`DROPS_EVERY`].
pub async fn watch(
    client: kube::Client,
    net: Arc<NodeNet>,
    metrics: Arc<Metrics>,
    service: Option<Ipv4Addr>,
) {
    let api: Api<ImpNetwork> = Api::all(client.clone());
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
            _ = tick.tick() => {
                if let Some(addresses) = read_api_addresses(&client, service).await
                    && net.set_api_servers(addresses.clone())
                {
                    tracing::info!(?addresses, "the API server's addresses changed; guests are kept from the new ones");
                }
            }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn slice(address_type: &str, addresses: &[&[&str]]) -> EndpointSlice {
        let endpoints: Vec<serde_json::Value> = addresses
            .iter()
            .map(|a| serde_json::json!({"addresses": a}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "kubernetes", "namespace": "default"},
            "addressType": address_type,
            "endpoints": endpoints,
        }))
        .unwrap()
    }

    #[test]
    fn guests_are_kept_from_the_api_servers_service_and_every_endpoint_behind_it() {
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        let s = slice("IPv4", &[&["203.0.113.30"], &["192.0.2.7", "203.0.113.30"]]);
        assert_eq!(
            api_addresses(Some(ip("10.96.0.1")), Some(&s)),
            [ip("10.96.0.1"), ip("192.0.2.7"), ip("203.0.113.30")]
        );
        // Without a slice (not readable, or a control plane that publishes none): the Service.
        assert_eq!(
            api_addresses(Some(ip("10.96.0.1")), None),
            [ip("10.96.0.1")]
        );
        // An agent that reaches the API server by name still keeps guests from its endpoints.
        assert_eq!(api_addresses(None, Some(&s)).len(), 2);
        // IPv6 slices hold nothing an IPv4 rule can take; a bad address is skipped.
        let v6 = slice("IPv6", &[&["2001:db8::1"]]);
        assert!(api_addresses(None, Some(&v6)).is_empty());
        let bad = slice("IPv4", &[&["not-an-ip", "198.51.100.1"]]);
        assert_eq!(api_addresses(None, Some(&bad)), [ip("198.51.100.1")]);
    }
}
