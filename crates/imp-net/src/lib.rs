//! The node's side of imp networking: one bridge per ImpNetwork holding the gateway address,
//! one TAP per VM on it, a VXLAN device per network toward the other nodes with an entry for
//! every remote VM and a flood entry for every remote node, and imp's nftables tables (NAT and
//! isolation). Everything is derived from the VMs attached on this node ([`NetAttachment`], kept
//! in each VM's spec on disk, so a restarted agent adopts them) and the ImpNetworks' specs and
//! status; [`NodeNet::sync`] applies the [`plan::plan`] idempotently and removes what no VM
//! needs any more.
//!
//! For suspended VMs: [`sleeper`] holds a sleeping VM's TAP, answers ARP for it and holds the
//! frames that wake it (decisions in [`wake`]); [`idle`] tells an idle VM from its TAP's
//! counters. See docs/suspend.md, "Wake on traffic".

pub mod idle;
pub mod link;
pub mod names;
pub mod nft;
pub mod plan;
pub mod resolv;
pub mod sleeper;
pub mod tap;
pub mod view;
pub mod wake;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use imp_api::chain::chain;
use link::{Link, Netlink};
use plan::{NetPlan, NodeView, Plan};
use serde::{Deserialize, Serialize};

/// A VM's place on an ImpNetwork: the TAP the VMM opens, on the network's bridge, and the
/// address setup the guest applies to its `eth0`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetAttachment {
    /// The network's `namespace/name`.
    pub network: String,
    /// The network's bridge on the node.
    pub bridge: String,
    /// The VM's TAP device.
    pub tap: String,
    /// The guest interface's MAC.
    pub mac: String,
    /// The VM, `namespace/name` (empty in specs written before it was recorded): the label
    /// of its port's drop counters.
    #[serde(default)]
    pub vm: String,
    /// The guest's address, prefix, gateway, DNS and MTU.
    pub config: imp_proto::config::NetworkConfig,
}

impl NetAttachment {
    /// Checks the names the attachment gives the node (its TAP, its bridge, its MAC): an
    /// attachment is read back from a VM's spec on disk, and only names imp derives go into
    /// netlink requests, nftables rules and the VMM's command line.
    pub fn check(&self) -> Result<(), BadAttachment> {
        let name = |field: &'static str, value: &str| {
            names::check_own(value).map_err(|source| BadAttachment::Name {
                vm: self.vm.clone(),
                network: self.network.clone(),
                field,
                value: value.to_owned(),
                source,
            })
        };
        name("TAP", &self.tap)?;
        name("bridge", &self.bridge)?;
        if plan::Mac::parse(&self.mac).is_none() {
            return Err(BadAttachment::Mac {
                vm: self.vm.clone(),
                network: self.network.clone(),
                mac: self.mac.clone(),
            });
        }
        Ok(())
    }
}

/// Why a VM's attachment cannot be wired: it names something imp would not have made.
#[derive(Debug, thiserror::Error)]
pub enum BadAttachment {
    /// An interface name that is not imp's.
    #[error("VM {vm} on ImpNetwork {network}: {field} {value:?}")]
    Name {
        /// The VM, `namespace/name`.
        vm: String,
        /// The network, `namespace/name`.
        network: String,
        /// Which name.
        field: &'static str,
        /// The name.
        value: String,
        /// What is wrong with it.
        #[source]
        source: names::BadName,
    },
    /// A MAC that does not parse.
    #[error("VM {vm} on ImpNetwork {network}: MAC {mac:?} is not of the form aa:bb:cc:dd:ee:ff")]
    Mac {
        /// The VM, `namespace/name`.
        vm: String,
        /// The network, `namespace/name`.
        network: String,
        /// The MAC.
        mac: String,
    },
}

/// Node-wide networking settings.
#[derive(Clone, Debug)]
pub struct NetSettings {
    /// The node's underlay address (VXLAN endpoint); no overlay without it.
    pub vtep: Option<Ipv4Addr>,
    /// VXLAN UDP port, the same on every node.
    pub vxlan_port: u16,
    /// The `nft` program.
    pub nft: String,
    /// Ranges no guest may reach unless its network allows them (`--egress-deny`: the
    /// cluster's pod and service ranges).
    pub egress_deny: Vec<imp_api::ipv4::Ipv4Cidr>,
    /// The API server's addresses, which no guest may reach: the one the agent reaches it at
    /// (in a cluster, Service `kubernetes`'s ClusterIP) and the endpoints behind it, as far
    /// as known at start ([`NodeNet::set_api_servers`] changes them).
    pub api_servers: Vec<Ipv4Addr>,
}

/// Why the node's network could not be read or changed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A netlink request failed.
    #[error(transparent)]
    Link(#[from] link::LinkError),
    /// The netlink socket could not be opened.
    #[error("Opening a netlink socket")]
    Socket(#[source] std::io::Error),
    /// The rules could not be written: a name in the plan cannot go into them.
    #[error(transparent)]
    Script(#[from] nft::ScriptError),
    /// `nft` did not load the rules: the tables loaded before stay as they were, without the
    /// ports of VMs attached since.
    #[error(transparent)]
    Rules(#[from] nft::NftError),
    /// A VM's port is not in the rules loaded (its anti-spoofing and isolation are not in
    /// place).
    #[error("TAP {tap} of VM {vm} is not in the nftables rules loaded on this node")]
    PortNotGuarded {
        /// The TAP.
        tap: String,
        /// The VM, `namespace/name`.
        vm: String,
    },
}

/// What imp's rules dropped since it was last taken ([`NodeNet::take_drops`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Drops {
    /// Frames a VM's port dropped, by VM (`namespace/name`, else its TAP) and reason.
    pub ports: BTreeMap<(String, nft::PortDrop), u64>,
    /// VXLAN packets from senders that hold no VM of their network.
    pub vxlan_foreign: u64,
    /// Guests' packets to destinations they may not reach.
    pub egress_denied: u64,
}

impl Drops {
    /// Adds counters read from the tables, `(name, packets)`; `vms` names each TAP's VM.
    pub fn add(&mut self, counters: &[(String, u64)], vms: &BTreeMap<String, String>) {
        for (name, packets) in counters.iter().filter(|(_, p)| *p > 0) {
            if name == nft::VXLAN_FOREIGN {
                self.vxlan_foreign += packets;
            } else if name == nft::EGRESS_DENIED {
                self.egress_denied += packets;
            } else if let Some((tap, why)) = nft::PortDrop::parse_counter(name) {
                let vm = vms
                    .get(tap)
                    .filter(|v| !v.is_empty())
                    .map_or(tap, String::as_str);
                *self.ports.entry((vm.to_owned(), why)).or_default() += packets;
            }
        }
    }
}

/// The node's networks, applied from the VMs attached here.
pub struct NodeNet {
    netlink: Netlink,
    settings: NetSettings,
    /// The API server's addresses as last told (the settings' at start).
    api_servers: Mutex<Vec<Ipv4Addr>>,
    attachments: Mutex<BTreeMap<String, NetAttachment>>,
    networks: Mutex<BTreeMap<String, plan::NetworkView>>,
    /// Serialises syncs; holds the last nftables script loaded.
    applied: tokio::sync::Mutex<Option<String>>,
    /// While imp's tables exist: each port's VM, by TAP, as the loaded rules have them.
    loaded_ports: Mutex<Option<BTreeMap<String, String>>>,
    /// Drops read from tables about to be replaced, not yet taken.
    drops: Mutex<Drops>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl NodeNet {
    /// Connects to the kernel (the agent's network namespace: the node's, under hostNetwork).
    pub fn new(settings: NetSettings) -> Result<NodeNet, NetError> {
        Ok(NodeNet {
            netlink: Netlink::connect().map_err(NetError::Socket)?,
            api_servers: Mutex::new(settings.api_servers.clone()),
            settings,
            attachments: Mutex::new(BTreeMap::new()),
            networks: Mutex::new(BTreeMap::new()),
            applied: tokio::sync::Mutex::new(None),
            loaded_ports: Mutex::new(None),
            drops: Mutex::new(Drops::default()),
        })
    }

    /// Replaces the API server's addresses guests may not reach (its Service address and the
    /// endpoints behind it, which change when control-plane nodes do); whether they changed.
    /// The next [`NodeNet::sync`] loads them.
    pub fn set_api_servers(&self, mut addresses: Vec<Ipv4Addr>) -> bool {
        addresses.sort();
        addresses.dedup();
        let mut current = lock(&self.api_servers);
        if *current == addresses {
            return false;
        }
        *current = addresses;
        true
    }

    /// The netlink connection (the node's network namespace).
    pub fn netlink(&self) -> Netlink {
        self.netlink.clone()
    }

    /// Takes over the attachment of a VM found on disk (no sync); refused, naming both VMs,
    /// when another VM adopted before it has the same TAP ([`tap_clash`]).
    pub fn adopt(&self, uid: &str, a: NetAttachment) -> Result<(), String> {
        claim(&mut lock(&self.attachments), uid, a)
    }

    /// Refuses VM `a.vm`'s TAP when the node's TAP of that name was made for another VM (its
    /// alias names that VM: one whose attachment this agent no longer holds, or another
    /// agent's); then takes it in the agent's records unless another VM's attachment there has
    /// it ([`tap_clash`]).
    async fn claim_tap(&self, uid: &str, a: NetAttachment) -> Result<(), String> {
        let links = {
            let _one = self.applied.lock().await;
            self.read_links().await?
        };
        if let Some(owner) = links
            .get(&a.tap)
            .and_then(|l| alias_clash(l.alias.as_deref(), &a.vm))
        {
            return Err(format!(
                "TAP {} of VM {} exists on this node for VM {owner} (the two names hash to one \
                 TAP name); it is not taken over: this VM cannot be wired here while that TAP exists",
                a.tap, a.vm
            ));
        }
        claim(&mut lock(&self.attachments), uid, a)
    }

    /// Replaces what the ImpNetworks say (no sync).
    pub fn set_networks(&self, views: BTreeMap<String, plan::NetworkView>) {
        *lock(&self.networks) = views;
    }

    /// Adds or replaces what one ImpNetwork says (no sync).
    pub fn upsert_network(&self, view: plan::NetworkView) {
        lock(&self.networks).insert(view.key.clone(), view);
    }

    /// Wires VM `uid`'s network, its port's rules (anti-spoofing, isolation) loaded; on
    /// refusal the attachment is dropped again and the reason, naming the network and what it
    /// conflicts with, or what `nft` said, is returned. A VM must not start without `Ok`.
    pub async fn attach(&self, uid: &str, a: NetAttachment) -> Result<(), String> {
        a.check().map_err(|e| chain(&e))?;
        let (network, tap, vm) = (a.network.clone(), a.tap.clone(), a.vm.clone());
        self.claim_tap(uid, a).await?;
        match self.wired(&network, &tap, &vm).await {
            Ok(()) => Ok(()),
            Err(why) => {
                lock(&self.attachments).remove(uid);
                if let Err(e) = self.sync().await {
                    tracing::warn!(uid, error = %chain(&e), "removing a refused network");
                }
                Err(why)
            }
        }
    }

    /// Syncs, then whether VM `vm`'s port `tap` on `network` is wired: the reason the plan
    /// refused or closed the network, or that the rules loaded do not hold the port.
    async fn wired(&self, network: &str, tap: &str, vm: &str) -> Result<(), String> {
        let wiring =
            |e: &dyn std::error::Error| format!("wiring ImpNetwork {network}: {}", chain(e));
        match self.sync().await {
            Ok(plan) => match plan.refused.get(network).or(plan.closed.get(network)) {
                Some(why) => Err(why.clone()),
                None => self.guarded(tap, vm).map_err(|e| wiring(&e)),
            },
            Err(e) => Err(wiring(&e)),
        }
    }

    /// The node's interfaces, or why they could not be read (the caller holds `applied`:
    /// one netlink dump at a time, see `guest_mtu`).
    async fn read_links(&self) -> Result<BTreeMap<String, Link>, String> {
        self.netlink
            .links()
            .await
            .map_err(|e| format!("reading the node's interfaces: {}", chain(&e)))
    }

    /// Renames TAP `from` (interface `index`) to `to` for VM `vm`, saying `why` in the log.
    async fn rename_tap(&self, index: u32, from: &str, to: &str, why: &str) -> Result<(), String> {
        self.netlink
            .rename(index, from, to)
            .await
            .map_err(|e| format!("renaming TAP {from} to {to}: {}", chain(&e)))?;
        tracing::info!(from, to, why, "TAP renamed");
        Ok(())
    }

    /// Rebinds VM `uid`'s running attachment to `a` (a warm pool's claim: the claimant's TAP
    /// name, MAC and VM, the same network and address): the TAP its VMM holds is renamed (down,
    /// renamed, then wired: alias, bridge and up) and the port's rules are loaded for the new
    /// name and MAC. Done again after it succeeded, nothing changes. The reason, as for
    /// [`Self::attach`], when it cannot be.
    pub async fn rebind(&self, uid: &str, a: NetAttachment) -> Result<(), String> {
        a.check().map_err(|e| chain(&e))?;
        let old = lock(&self.attachments).get(uid).cloned();
        {
            let _one = self.applied.lock().await;
            let links = self.read_links().await?;
            let from = old.as_ref().map(|o| o.tap.as_str()).filter(|t| *t != a.tap);
            match (from.and_then(|t| links.get(t)), links.get(&a.tap)) {
                (Some(l), None) => {
                    let why = format!("handed to VM {}", a.vm);
                    self.rename_tap(l.index, from.unwrap_or_default(), &a.tap, &why)
                        .await?;
                }
                (None, Some(_)) => {}
                (Some(_), Some(_)) => {
                    return Err(format!(
                        "TAP {} exists already beside {}: VM {} cannot take it over",
                        a.tap,
                        from.unwrap_or_default(),
                        a.vm
                    ));
                }
                (None, None) => {
                    return Err(format!(
                        "VM {uid} has no TAP on this node to hand to {}",
                        a.vm
                    ));
                }
            }
        }
        let (network, tap, vm) = (a.network.clone(), a.tap.clone(), a.vm.clone());
        lock(&self.attachments).insert(uid.to_owned(), a);
        self.wired(&network, &tap, &vm).await
    }

    /// Puts back the TAP of a VM found on disk whose spec names TAP `a.tap` while the node still
    /// has the one it was made with for VM `former` (its alias): a warm pool's claim rewrites
    /// the spec before it renames the TAP, and an agent stopped between the two would otherwise
    /// make an empty TAP of the new name and remove the one the VMM holds at its first sync.
    /// Whether it renamed one.
    pub async fn repair_tap(&self, a: &NetAttachment, former: &str) -> Result<bool, String> {
        a.check().map_err(|e| chain(&e))?;
        let _one = self.applied.lock().await;
        let links = self.read_links().await?;
        if links.contains_key(&a.tap) {
            return Ok(false);
        }
        let held = links.iter().find(|(name, l)| {
            names::is_imp(name) && *name != &a.tap && l.alias.as_deref() == Some(former)
        });
        let Some((from, l)) = held else {
            return Ok(false);
        };
        let why = format!("an unfinished claim's spec names it for VM {}", a.vm);
        self.rename_tap(l.index, from, &a.tap, &why).await?;
        Ok(true)
    }

    /// Whether the rules loaded hold `tap`'s port for `vm`.
    fn guarded(&self, tap: &str, vm: &str) -> Result<(), NetError> {
        let loaded = lock(&self.loaded_ports);
        match loaded.as_ref().and_then(|ports| ports.get(tap)) {
            Some(v) if v == vm => Ok(()),
            _ => Err(NetError::PortNotGuarded {
                tap: tap.to_owned(),
                vm: vm.to_owned(),
            }),
        }
    }

    /// Unwires VM `uid` (its TAP, and the network's devices and rules if it was the last).
    pub async fn detach(&self, uid: &str) {
        if lock(&self.attachments).remove(uid).is_some()
            && let Err(e) = self.sync().await
        {
            tracing::warn!(uid, error = %chain(&e), "unwiring a VM's network");
        }
    }

    /// The node as the plan sees it.
    pub async fn node_view(&self, links: &BTreeMap<String, Link>) -> Result<NodeView, NetError> {
        let addresses: Vec<_> = self
            .netlink
            .addresses(links)
            .await?
            .into_iter()
            .filter(|(i, a, _)| !names::is_imp(i) && !a.is_loopback())
            .collect();
        let default = self.netlink.default_route_interface().await?;
        let underlay = self
            .settings
            .vtep
            .and_then(|v| addresses.iter().find(|(_, a, _)| *a == v))
            .and_then(|(i, _, _)| links.get(i))
            .map_or(1500, |l| l.mtu);
        Ok(NodeView {
            vtep: self.settings.vtep,
            vxlan_port: self.settings.vxlan_port,
            underlay_mtu: underlay,
            addresses,
            default_interface: default
                .and_then(|i| links.values().find(|l| l.index == i))
                .map(|l| l.name.clone()),
            api_servers: lock(&self.api_servers).clone(),
            egress_deny: self.settings.egress_deny.clone(),
        })
    }

    /// The MTU guests on this node get.
    pub async fn guest_mtu(&self) -> Result<u32, NetError> {
        // One netlink dump at a time: the kernel answers a second one on the socket with EBUSY.
        let _one = self.applied.lock().await;
        let links = self.netlink.links().await?;
        Ok(self.node_view(&links).await?.mtu())
    }

    /// Makes the node match the plan: devices, addresses, ports, forwarding entries, rules;
    /// removes imp's devices nobody needs. Networks that cannot be wired are in
    /// [`Plan::refused`]; one network's failure does not stop the others. Rules that do not
    /// load are an error (after the rest is done): the ports they should have guarded are not.
    pub async fn sync(&self) -> Result<Plan, NetError> {
        let mut applied = self.applied.lock().await;
        let links = self.netlink.links().await?;
        let node = self.node_view(&links).await?;
        let attachments: Vec<_> = lock(&self.attachments).values().cloned().collect();
        let networks = lock(&self.networks).clone();
        let mut plan = plan::plan(&attachments, &networks, &node);
        let mut wired = Vec::new();
        for n in std::mem::take(&mut plan.networks) {
            match self.wire(&n).await {
                Ok(()) => wired.push(n),
                Err(e) => {
                    tracing::warn!(network = %n.key, error = %chain(&e), "wiring a network");
                    plan.refused.insert(
                        n.key.clone(),
                        format!("wiring ImpNetwork {}: {}", n.key, chain(&e)),
                    );
                }
            }
        }
        plan.networks = wired;
        let rules = self.rules(&plan.networks, &mut applied).await;
        let links = self.netlink.links().await?;
        for stale in plan::stale_links(&plan, links.keys().map(String::as_str)) {
            if let Some(l) = links.get(&stale)
                && let Err(e) = self.netlink.delete(l.index, &stale).await
            {
                tracing::warn!(interface = %stale, error = %chain(&e), "removing an interface no VM needs");
            } else {
                tracing::info!(interface = %stale, "removed an interface no VM needs");
            }
        }
        for (network, why) in &plan.refused {
            tracing::warn!(%network, why, "network not wired on this node");
        }
        for note in &plan.notes {
            tracing::warn!(note, "network wired with less than asked");
        }
        if let Err(e) = rules {
            tracing::error!(error = %chain(&e), "loading imp's nftables rules: VMs attached since the last load do not start");
            return Err(e);
        }
        Ok(plan)
    }

    async fn wire(&self, n: &NetPlan) -> Result<(), NetError> {
        let bridge = self.netlink.ensure_bridge(&n.bridge, n.mtu).await?;
        self.netlink
            .ensure_address(bridge, &n.bridge, n.gateway, n.subnet.prefix())
            .await?;
        let links = self.netlink.links().await?;
        for t in n.ports.keys() {
            if !links.contains_key(t) {
                let name = t.clone();
                tokio::task::spawn_blocking(move || tap::create_persistent(&name))
                    .await
                    .map_err(std::io::Error::other)
                    .and_then(|r| r)
                    .map_err(NetError::Socket)?;
                tracing::info!(network = %n.key, tap = %t, "created TAP");
            }
        }
        let links = self.netlink.links().await?;
        for (t, port) in &n.ports {
            // The TAP says which VM it is for ([`alias_clash`]).
            let alias = Some(port.vm.as_str()).filter(|vm| !vm.is_empty());
            if let Some(l) = links.get(t)
                && (l.controller != Some(bridge)
                    || !l.up
                    || l.mtu != n.mtu
                    || (alias.is_some() && l.alias.as_deref() != alias))
            {
                self.netlink
                    .set(l.index, t, Some(bridge), n.mtu, alias)
                    .await?;
            }
        }
        if let Some(vx) = &n.vxlan {
            self.netlink.ensure_vxlan(vx, bridge, n.mtu).await?;
            self.sync_fdb(n, &vx.name).await?;
        }
        if let Some(egress) = &n.nat_egress {
            for iface in [n.bridge.as_str(), egress.as_str()] {
                if let Err(e) = forwarding_on(iface).await {
                    tracing::warn!(network = %n.key, interface = iface, error = %imp_api::chain::DisplayChain(&e), "turning on IPv4 forwarding");
                }
            }
        }
        Ok(())
    }

    /// Brings the VXLAN device's entries to the plan; one bad entry is logged and skipped.
    async fn sync_fdb(&self, n: &NetPlan, vxlan: &str) -> Result<(), NetError> {
        let Some(index) = self.netlink.links().await?.get(vxlan).map(|l| l.index) else {
            return Ok(());
        };
        let observed = self.netlink.fdb(index).await?;
        let (del, add) = plan::fdb_changes(&observed, &n.fdb);
        for e in del {
            if let Err(err) = self.netlink.fdb_del(index, e).await {
                tracing::warn!(network = %n.key, mac = %e.mac, dst = %e.dst, error = %chain(&err), "removing a forwarding entry");
            }
        }
        for e in add {
            if let Err(err) = self.netlink.fdb_add(index, e).await {
                tracing::warn!(network = %n.key, mac = %e.mac, dst = %e.dst, error = %chain(&err), "adding a forwarding entry");
            }
        }
        Ok(())
    }

    /// Loads the rules when they changed (or were never loaded).
    async fn rules(
        &self,
        networks: &[NetPlan],
        applied: &mut Option<String>,
    ) -> Result<(), NetError> {
        let script = nft::script(networks)?;
        if applied.as_deref() == Some(script.as_str()) {
            return Ok(());
        }
        // Replacing the tables zeroes their counters: keep what they hold first.
        self.harvest().await;
        match nft::apply(&self.settings.nft, &script).await {
            Ok(()) => {
                *applied = Some(script);
                *lock(&self.loaded_ports) = (!networks.is_empty()).then(|| {
                    networks
                        .iter()
                        .flat_map(|n| &n.ports)
                        .map(|(tap, p)| (tap.clone(), p.vm.clone()))
                        .collect()
                });
            }
            // No nft and nothing to load: there can be no imp tables to remove either.
            Err(nft::NftError::Spawn { .. }) if networks.is_empty() => *applied = Some(script),
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }
}

impl NodeNet {
    /// What the rules dropped since the last call (read and zeroed in the tables).
    pub async fn take_drops(&self) -> Drops {
        let _one = self.applied.lock().await;
        self.harvest().await;
        std::mem::take(&mut *lock(&self.drops))
    }

    /// Reads and zeroes the loaded tables' counters into [`NodeNet::drops`] (callers hold
    /// `applied`, so the tables do not change meanwhile).
    async fn harvest(&self) {
        let Some(vms) = lock(&self.loaded_ports).clone() else {
            return;
        };
        for family in ["bridge", "inet"] {
            match nft::reset_counters(&self.settings.nft, family).await {
                Ok(counters) => lock(&self.drops).add(&counters, &vms),
                Err(e) => {
                    tracing::warn!(family, error = %chain(&e), "reading imp's drop counters");
                }
            }
        }
    }
}

/// Why VM `uid` may not have the TAP its attachment `a` names, if another VM's attachment in
/// `attachments` has it: a TAP's name is a 32-bit hash of its VM's `namespace/name`
/// ([`names::tap`]), so two VMs can meet on one, and the second would move the first one's
/// port (its bridge, its rules) to itself. The same VM under another uid (deleted and made
/// again before its old attachment went) is no clash.
pub fn tap_clash(
    attachments: &BTreeMap<String, NetAttachment>,
    uid: &str,
    a: &NetAttachment,
) -> Option<String> {
    let (other, b) = attachments
        .iter()
        .find(|(other, b)| other.as_str() != uid && b.tap == a.tap)?;
    if !a.vm.is_empty() && a.vm == b.vm {
        return None;
    }
    let named = |vm: &str, uid: &str| {
        if vm.is_empty() {
            format!("uid {uid}")
        } else {
            format!("{vm} (uid {uid})")
        }
    };
    Some(format!(
        "TAP {} of VM {} is VM {}'s on this node (the two names hash to one TAP name); it is \
         not taken over: this VM cannot be wired here while that VM is",
        a.tap,
        named(&a.vm, uid),
        named(&b.vm, other)
    ))
}

/// Puts VM `uid`'s attachment `a` into `attachments` unless [`tap_clash`] refuses it.
fn claim(
    attachments: &mut BTreeMap<String, NetAttachment>,
    uid: &str,
    a: NetAttachment,
) -> Result<(), String> {
    if let Some(why) = tap_clash(attachments, uid, &a) {
        return Err(why);
    }
    attachments.insert(uid.to_owned(), a);
    Ok(())
}

/// The VM a TAP was made for, from its `alias`, when that is not `vm`: the TAP is another
/// VM's. A TAP without an alias (made before imp set one) or an attachment without a VM (a spec
/// written before it was recorded) is no clash.
pub fn alias_clash(alias: Option<&str>, vm: &str) -> Option<String> {
    let alias = alias.filter(|a| !a.is_empty())?;
    (!vm.is_empty() && alias != vm).then(|| alias.to_owned())
}

/// Turns on IPv4 forwarding on one interface (not node-wide); a name that is not an interface
/// name (`..`, one holding `/`) is refused before it becomes a path.
async fn forwarding_on(iface: &str) -> std::io::Result<()> {
    names::check_interface(iface).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("interface {iface:?} {e}"),
        )
    })?;
    let path = format!("/proc/sys/net/ipv4/conf/{iface}/forwarding");
    tokio::fs::write(path, b"1").await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment(vm: &str, tap: &str) -> NetAttachment {
        NetAttachment {
            network: "ns/net".into(),
            bridge: names::bridge("ns", "net"),
            tap: tap.into(),
            mac: "02:00:00:00:00:01".into(),
            vm: vm.into(),
            config: imp_proto::config::NetworkConfig {
                interface: "eth0".into(),
                address: Ipv4Addr::new(10, 0, 0, 2),
                prefix_len: 24,
                gateway: None,
                dns: Vec::new(),
                search: Vec::new(),
                mtu: None,
            },
        }
    }

    /// Two VMs whose names hash to one TAP name (forced here: the name is given): the second
    /// is refused, naming both, and the first keeps its port.
    #[test]
    fn a_second_vm_on_a_taken_tap_name_is_refused_and_the_first_keeps_it() {
        let mut all = BTreeMap::new();
        claim(
            &mut all,
            "uid-a",
            attachment("team-a/db", "imptap-0badf00d"),
        )
        .unwrap();
        let why = claim(
            &mut all,
            "uid-b",
            attachment("team-b/web", "imptap-0badf00d"),
        )
        .unwrap_err();
        for needle in [
            "imptap-0badf00d",
            "team-a/db",
            "team-b/web",
            "uid-a",
            "not taken over",
        ] {
            assert!(why.contains(needle), "{needle}: {why}");
        }
        assert_eq!(all.len(), 1);
        assert_eq!(all["uid-a"].vm, "team-a/db");
        // The same VM again (a restart, or made again under a new uid) is no clash.
        claim(
            &mut all,
            "uid-a",
            attachment("team-a/db", "imptap-0badf00d"),
        )
        .unwrap();
        assert_eq!(
            tap_clash(&all, "uid-a2", &attachment("team-a/db", "imptap-0badf00d")),
            None
        );
        // Another TAP name is none of its business.
        claim(
            &mut all,
            "uid-b",
            attachment("team-b/web", "imptap-12345678"),
        )
        .unwrap();
        // A recorded attachment without a VM (an old spec) still holds its TAP.
        let mut old = BTreeMap::new();
        claim(&mut old, "uid-o", attachment("", "imptap-0badf00d")).unwrap();
        assert!(tap_clash(&old, "uid-b", &attachment("team-b/web", "imptap-0badf00d")).is_some());
    }

    #[test]
    fn a_tap_whose_alias_names_another_vm_is_that_vms() {
        assert_eq!(
            alias_clash(Some("team-a/db"), "team-b/web"),
            Some("team-a/db".to_owned())
        );
        assert_eq!(alias_clash(Some("team-a/db"), "team-a/db"), None);
        assert_eq!(alias_clash(None, "team-b/web"), None, "made before aliases");
        assert_eq!(alias_clash(Some(""), "team-b/web"), None);
        assert_eq!(alias_clash(Some("team-a/db"), ""), None, "an old spec");
    }
}
