//! The node's interfaces, addresses, routes and VXLAN forwarding entries over rtnetlink.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use futures::stream::StreamExt;
use rtnetlink::packet_core::{
    NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{
    InfoData, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{Handle, LinkBridge, LinkUnspec, LinkVxlan, RouteMessageBuilder};

use super::plan::{FdbEntry, Mac, VxlanPlan};

/// A netlink request that failed, with what it was for.
#[derive(Debug, thiserror::Error)]
#[error("{doing} {what}")]
pub struct LinkError {
    doing: &'static str,
    what: String,
    #[source]
    source: rtnetlink::Error,
}

/// Result of this module.
pub type Result<T, E = LinkError> = std::result::Result<T, E>;

fn err(doing: &'static str, what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> LinkError {
    let what = what.into();
    move |source| LinkError {
        doing,
        what,
        source,
    }
}

/// One interface as the kernel reports it.
#[derive(Clone, Debug)]
pub struct Link {
    /// Index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// The bridge it is a port of.
    pub controller: Option<u32>,
    /// MTU.
    pub mtu: u32,
    /// Administratively up.
    pub up: bool,
    /// VXLAN settings, for a VXLAN device: (VNI, port, local).
    pub vxlan: Option<(u32, u16, Option<Ipv4Addr>)>,
    /// The interface's alias (`ip link set DEV alias`): on a VM's TAP, the VM it was made
    /// for (`namespace/name`), so a TAP of the same name asked for by another VM is refused.
    pub alias: Option<String>,
}

impl Link {
    fn from_message(m: &LinkMessage) -> Option<Link> {
        let mut link = Link {
            index: m.header.index,
            name: String::new(),
            controller: None,
            mtu: 0,
            up: m.header.flags.contains(LinkFlags::Up),
            vxlan: None,
            alias: None,
        };
        for a in &m.attributes {
            match a {
                LinkAttribute::IfName(n) => link.name = n.clone(),
                LinkAttribute::IfAlias(a) => link.alias = Some(a.clone()).filter(|a| !a.is_empty()),
                LinkAttribute::Controller(c) => link.controller = Some(*c),
                LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
                LinkAttribute::LinkInfo(infos) => link.vxlan = vxlan_info(infos),
                _ => {}
            }
        }
        (!link.name.is_empty()).then_some(link)
    }
}

/// An interface's counters and whether the kernel calls it operationally up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkState {
    /// Packets the interface received (for a TAP: what its reader, the VMM, wrote).
    pub rx_packets: u64,
    /// Packets it sent (for a TAP: what was delivered toward its reader).
    pub tx_packets: u64,
    /// Bytes it received (for a TAP: what the guest sent).
    pub rx_bytes: u64,
    /// Bytes it sent (for a TAP: what the guest was sent).
    pub tx_bytes: u64,
    /// Operationally up: for a TAP, someone holds it and the kernel's link watcher has seen
    /// the carrier, so a bridge forwards to it.
    pub oper_up: bool,
}

impl LinkState {
    fn from_message(m: &LinkMessage) -> LinkState {
        let mut state = LinkState::default();
        for a in &m.attributes {
            match a {
                LinkAttribute::Stats64(s) => {
                    state.rx_packets = s.rx_packets;
                    state.tx_packets = s.tx_packets;
                    state.rx_bytes = s.rx_bytes;
                    state.tx_bytes = s.tx_bytes;
                }
                LinkAttribute::OperState(o) => {
                    state.oper_up = *o == rtnetlink::packet_route::link::State::Up;
                }
                _ => {}
            }
        }
        state
    }
}

fn vxlan_info(infos: &[LinkInfo]) -> Option<(u32, u16, Option<Ipv4Addr>)> {
    infos.iter().find_map(|i| match i {
        LinkInfo::Data(InfoData::Vxlan(v)) => {
            let (mut id, mut port, mut local) = (0, 0, None);
            for x in v {
                match x {
                    InfoVxlan::Id(i) => id = *i,
                    InfoVxlan::Port(p) => port = *p,
                    InfoVxlan::Local(l) => local = Some(*l),
                    _ => {}
                }
            }
            Some((id, port, local))
        }
        _ => None,
    })
}

impl std::fmt::Debug for Netlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netlink").finish_non_exhaustive()
    }
}

/// A connection to the kernel's routing netlink of the current network namespace.
#[derive(Clone)]
pub struct Netlink {
    handle: Handle,
}

impl Netlink {
    /// Opens the socket and drives it on the runtime.
    pub fn connect() -> std::io::Result<Netlink> {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        Ok(Netlink { handle })
    }

    /// Every interface, by name.
    pub async fn links(&self) -> Result<BTreeMap<String, Link>> {
        let msgs: Vec<LinkMessage> = self
            .handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(err("listing", "the node's interfaces"))?;
        Ok(msgs
            .iter()
            .filter_map(Link::from_message)
            .map(|l| (l.name.clone(), l))
            .collect())
    }

    async fn index(&self, name: &str) -> Result<Option<u32>> {
        Ok(self.links().await?.get(name).map(|l| l.index))
    }

    /// Creates bridge `name` if missing; gives it `mtu` and brings it up. Returns its index.
    pub async fn ensure_bridge(&self, name: &str, mtu: u32) -> Result<u32> {
        if self.index(name).await?.is_none() {
            self.handle
                .link()
                .add(LinkBridge::new(name).mtu(mtu).build())
                .execute()
                .await
                .map_err(err("creating bridge", name))?;
        }
        let index = self.index(name).await?.ok_or_else(|| LinkError {
            doing: "finding the bridge just created",
            what: name.to_owned(),
            source: rtnetlink::Error::RequestFailed,
        })?;
        self.set(index, name, None, mtu, None).await?;
        Ok(index)
    }

    /// Makes `addr/prefix` the only IPv4 address of interface `index`.
    pub async fn ensure_address(
        &self,
        index: u32,
        name: &str,
        addr: Ipv4Addr,
        prefix: u8,
    ) -> Result<()> {
        let mut present = false;
        for (a, p, msg) in self.addresses_of(index).await? {
            if a == addr && p == prefix {
                present = true;
            } else {
                self.handle
                    .address()
                    .del(msg)
                    .execute()
                    .await
                    .map_err(err("removing a stale address from", name))?;
            }
        }
        if !present {
            self.handle
                .address()
                .add(index, IpAddr::V4(addr), prefix)
                .execute()
                .await
                .map_err(err("adding the gateway address to", name))?;
        }
        Ok(())
    }

    async fn addresses_of(
        &self,
        index: u32,
    ) -> Result<
        Vec<(
            Ipv4Addr,
            u8,
            rtnetlink::packet_route::address::AddressMessage,
        )>,
    > {
        let msgs: Vec<_> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(err("listing addresses of interface", index.to_string()))?;
        Ok(msgs
            .into_iter()
            .filter(|m| m.header.index == index)
            .filter_map(|m| {
                let a = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(IpAddr::V4(v4)) => Some(*v4),
                    _ => None,
                })?;
                Some((a, m.header.prefix_len, m))
            })
            .collect())
    }

    /// Every IPv4 address on the node: `(interface, address, prefix)`.
    pub async fn addresses(
        &self,
        links: &BTreeMap<String, Link>,
    ) -> Result<Vec<(String, Ipv4Addr, u8)>> {
        let names: BTreeMap<u32, &str> =
            links.values().map(|l| (l.index, l.name.as_str())).collect();
        let msgs: Vec<_> = self
            .handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(err("listing", "the node's addresses"))?;
        Ok(msgs
            .iter()
            .filter_map(|m| {
                let a = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(IpAddr::V4(v4)) => Some(*v4),
                    _ => None,
                })?;
                let name = names.get(&m.header.index)?;
                Some(((*name).to_owned(), a, m.header.prefix_len))
            })
            .collect())
    }

    /// The interface index of the main table's IPv4 default route, if any.
    pub async fn default_route_interface(&self) -> Result<Option<u32>> {
        let msgs: Vec<RouteMessage> = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_collect()
            .await
            .map_err(err("listing", "the node's routes"))?;
        Ok(msgs
            .iter()
            .filter(|m| {
                m.header.destination_prefix_length == 0
                    && m.header.address_family == AddressFamily::Inet
                    && table(m) == u32::from(RouteHeader::RT_TABLE_MAIN)
            })
            .find_map(|m| {
                m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                })
            }))
    }

    /// Creates or corrects VXLAN device `plan` as a port of bridge `bridge`.
    pub async fn ensure_vxlan(&self, plan: &VxlanPlan, bridge: u32, mtu: u32) -> Result<()> {
        let links = self.links().await?;
        let wanted = (plan.vni, plan.port, Some(plan.local));
        if let Some(l) = links.get(&plan.name)
            && l.vxlan != Some(wanted)
        {
            self.delete(l.index, &plan.name).await?;
        }
        let index = match self.index(&plan.name).await? {
            Some(i) => i,
            None => {
                let msg = LinkVxlan::new(&plan.name, plan.vni)
                    .port(plan.port)
                    .local(plan.local)
                    .learning(false)
                    .mtu(mtu)
                    .build();
                self.handle
                    .link()
                    .add(msg)
                    .execute()
                    .await
                    .map_err(err("creating VXLAN device", &plan.name))?;
                self.index(&plan.name).await?.ok_or_else(|| LinkError {
                    doing: "finding the VXLAN device just created",
                    what: plan.name.clone(),
                    source: rtnetlink::Error::RequestFailed,
                })?
            }
        };
        self.set(index, &plan.name, Some(bridge), mtu, None).await
    }

    /// Makes interface `index` a port of `controller` (if given) with `mtu`, and up; gives it
    /// `alias` if one is given.
    pub async fn set(
        &self,
        index: u32,
        name: &str,
        controller: Option<u32>,
        mtu: u32,
        alias: Option<&str>,
    ) -> Result<()> {
        let mut msg = LinkUnspec::new_with_index(index).mtu(mtu).up();
        if let Some(c) = controller {
            msg = msg.controller(c);
        }
        if let Some(a) = alias {
            msg = msg.alias(a);
        }
        self.handle
            .link()
            .set(msg.build())
            .execute()
            .await
            .map_err(err("configuring interface", name))
    }

    /// Takes interface `index` (`name`) administratively up or down.
    pub async fn set_up(&self, index: u32, name: &str, up: bool) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index);
        let msg = if up { msg.up() } else { msg.down() };
        self.handle
            .link()
            .set(msg.build())
            .execute()
            .await
            .map_err(err("setting the link state of", name))
    }

    /// Renames interface `index` from `from` to `to`: taken down first (the kernel renames no
    /// interface that is up); whoever wires it brings it up again.
    pub async fn rename(&self, index: u32, from: &str, to: &str) -> Result<()> {
        self.set_up(index, from, false).await?;
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).name(to).build())
            .execute()
            .await
            .map_err(err("renaming interface", from))
    }

    /// Interface `name`'s packet counters and operational state; `None` when it does not
    /// exist. Read over netlink, so it is right in any network namespace (sysfs shows the one
    /// it was mounted in).
    pub async fn link_state(&self, name: &str) -> Result<Option<LinkState>> {
        let mut msgs = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        let msg = match msgs.try_next().await {
            Ok(m) => m,
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => None,
            Err(e) => return Err(err("reading the state of interface", name)(e)),
        };
        Ok(msg.map(|m| LinkState::from_message(&m)))
    }

    /// Deletes interface `index`.
    pub async fn delete(&self, index: u32, name: &str) -> Result<()> {
        self.handle
            .link()
            .del(index)
            .execute()
            .await
            .map_err(err("deleting interface", name))
    }

    /// The VXLAN device's forwarding entries that have a destination (the kernel's own
    /// `self permanent` entry, with none, is left out and never touched).
    pub async fn fdb(&self, vxlan: u32) -> Result<BTreeSet<FdbEntry>> {
        let mut req = self.handle.neighbours().get();
        req.message_mut().header.family = AddressFamily::Bridge;
        let msgs: Vec<NeighbourMessage> = req
            .execute()
            .try_collect()
            .await
            .map_err(err("listing the forwarding entries of", vxlan.to_string()))?;
        Ok(msgs
            .iter()
            .filter(|m| m.header.ifindex == vxlan)
            .filter_map(fdb_entry)
            .collect())
    }

    /// Adds one forwarding entry (appended: the flood entry has one per remote node).
    pub async fn fdb_add(&self, vxlan: u32, e: FdbEntry) -> Result<()> {
        let mut req =
            NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(fdb_message(vxlan, e)));
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_APPEND;
        self.send(req).await.map_err(err(
            "adding forwarding entry",
            format!("{} dst {}", e.mac, e.dst),
        ))
    }

    /// Deletes one forwarding entry.
    pub async fn fdb_del(&self, vxlan: u32, e: FdbEntry) -> Result<()> {
        self.handle
            .neighbours()
            .del(fdb_message(vxlan, e))
            .execute()
            .await
            .map_err(err(
                "deleting forwarding entry",
                format!("{} dst {}", e.mac, e.dst),
            ))
    }

    async fn send(&self, req: NetlinkMessage<RouteNetlinkMessage>) -> Result<(), rtnetlink::Error> {
        let mut handle = self.handle.clone();
        let mut responses = handle.request(req)?;
        while let Some(m) = responses.next().await {
            if let NetlinkPayload::Error(e) = m.payload {
                return Err(rtnetlink::Error::NetlinkError(e));
            }
        }
        Ok(())
    }
}

fn table(m: &RouteMessage) -> u32 {
    m.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(m.header.table))
}

/// The entry a forwarding-table message of a VXLAN device states, if it names a MAC and an
/// IPv4 destination. The parser cannot tell the family of a bridge message's destination, so
/// it hands it over as raw bytes (`Other`): four of them are the IPv4 address.
fn fdb_entry(m: &NeighbourMessage) -> Option<FdbEntry> {
    let mut mac = None;
    let mut dst = None;
    for a in &m.attributes {
        match a {
            NeighbourAttribute::LinkLayerAddress(l) => mac = <[u8; 6]>::try_from(l.as_slice()).ok(),
            NeighbourAttribute::Destination(NeighbourAddress::Inet(d)) => dst = Some(*d),
            NeighbourAttribute::Destination(NeighbourAddress::Other(raw)) => {
                dst = <[u8; 4]>::try_from(raw.as_slice()).ok().map(Ipv4Addr::from);
            }
            _ => {}
        }
    }
    Some(FdbEntry {
        mac: Mac(mac?),
        dst: dst?,
    })
}

fn fdb_message(vxlan: u32, e: FdbEntry) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = AddressFamily::Bridge;
    m.header.ifindex = vxlan;
    m.header.state = NeighbourState::Permanent;
    m.header.flags = NeighbourFlags::Own;
    m.attributes
        .push(NeighbourAttribute::LinkLayerAddress(e.mac.0.to_vec()));
    m.attributes
        .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
            e.dst,
        )));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarding_entries_are_read_as_the_kernel_dumps_them_and_as_written() {
        let mac = Mac([2, 1, 2, 3, 4, 5]);
        let dst = Ipv4Addr::new(10, 9, 9, 2);
        // A dump of a VXLAN device's table: the destination comes back as raw bytes.
        let mut dumped = NeighbourMessage::default();
        dumped.header.family = AddressFamily::Bridge;
        dumped.attributes = vec![
            NeighbourAttribute::LinkLayerAddress(mac.0.to_vec()),
            NeighbourAttribute::Destination(NeighbourAddress::Other(vec![10, 9, 9, 2])),
        ];
        assert_eq!(fdb_entry(&dumped), Some(FdbEntry { mac, dst }));
        // What this module writes reads back the same.
        let e = FdbEntry { mac, dst };
        assert_eq!(fdb_entry(&fdb_message(7, e)), Some(e));
        // No destination (the kernel's own entry) or an IPv6 one: not ours.
        dumped.attributes.truncate(1);
        assert_eq!(fdb_entry(&dumped), None);
        dumped
            .attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Other(
                vec![0; 16],
            )));
        assert_eq!(fdb_entry(&dumped), None);
    }
}
