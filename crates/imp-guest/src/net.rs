//! Static network setup with plain ioctls (no netlink): bring interfaces up, give eth0 its
//! address and default route, announce it, write /etc/resolv.conf and /etc/hosts; and, for a
//! clone taking its own identity, take the interface down, change its MAC and remove its
//! addresses.
#![allow(unsafe_code)]

use imp_proto::config::NetworkConfig;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};

/// Why a network step failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// An ioctl on an interface failed.
    #[error("{action} on interface {interface} failed")]
    Ioctl {
        /// What was being done.
        action: &'static str,
        /// The interface.
        interface: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The interface name does not fit in `IFNAMSIZ`.
    #[error("Interface name {0:?} is empty or longer than 15 bytes")]
    BadName(String),
}

fn control_socket() -> io::Result<OwnedFd> {
    Ok(socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

fn ifreq(name: &str) -> Result<libc::ifreq, NetError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ {
        return Err(NetError::BadName(name.to_string()));
    }
    // SAFETY: ifreq is a plain C struct (name array + union of plain fields); all-zero is a
    // valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and sockaddr is the
    // generic view the kernel expects in these ioctls.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ioctl(
    fd: &OwnedFd,
    request: libc::Ioctl,
    arg: *mut libc::c_void,
    action: &'static str,
    interface: &str,
) -> Result<(), NetError> {
    // SAFETY: every caller passes a request code with the matching argument type (an ifreq
    // or an rtentry) that lives for the duration of the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) };
    if rc < 0 {
        Err(NetError::Ioctl {
            action,
            interface: interface.to_string(),
            source: io::Error::last_os_error(),
        })
    } else {
        Ok(())
    }
}

fn io_err(action: &'static str, interface: &str) -> impl FnOnce(io::Error) -> NetError + use<> {
    let interface = interface.to_string();
    move |source| NetError::Ioctl {
        action,
        interface,
        source,
    }
}

/// Sets IFF_UP on an interface (loopback gets 127.0.0.1 from the kernel when it comes up).
pub fn bring_up(interface: &str) -> Result<(), NetError> {
    set_up(interface, true)
}

/// Clears IFF_UP on an interface: nothing is sent through it any more, and the kernel drops
/// its routes and neighbour entries (its addresses stay).
pub fn bring_down(interface: &str) -> Result<(), NetError> {
    set_up(interface, false)
}

fn set_up(interface: &str, up: bool) -> Result<(), NetError> {
    let fd = control_socket().map_err(io_err("Opening a control socket", interface))?;
    let mut req = ifreq(interface)?;
    ioctl(
        &fd,
        libc::SIOCGIFFLAGS,
        (&raw mut req).cast(),
        "Reading flags",
        interface,
    )?;
    let bits = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe {
        if up {
            req.ifr_ifru.ifru_flags |= bits;
        } else {
            req.ifr_ifru.ifru_flags &= !bits;
        }
    }
    let action = if up {
        "Setting IFF_UP"
    } else {
        "Clearing IFF_UP"
    };
    ioctl(
        &fd,
        libc::SIOCSIFFLAGS,
        (&raw mut req).cast(),
        action,
        interface,
    )
}

/// Gives an interface a new Ethernet address. Most drivers want the interface down; virtio-net
/// passes the address to the device (QEMU filters received frames by it) and refuses when the
/// device has no control queue for it (Firecracker's).
pub fn set_mac(interface: &str, mac: [u8; 6]) -> Result<(), NetError> {
    let fd = control_socket().map_err(io_err("Opening a control socket", interface))?;
    let mut req = ifreq(interface)?;
    // SAFETY: writing plain fields of the union member this request reads (a sockaddr).
    unsafe {
        req.ifr_ifru.ifru_hwaddr.sa_family = libc::ARPHRD_ETHER;
        for (dst, src) in req.ifr_ifru.ifru_hwaddr.sa_data.iter_mut().zip(mac) {
            *dst = src as libc::c_char;
        }
    }
    ioctl(
        &fd,
        libc::SIOCSIFHWADDR,
        (&raw mut req).cast(),
        "Setting the MAC",
        interface,
    )
}

/// The interface's first IPv4 address, `None` when it has none.
pub fn address_of(interface: &str) -> Result<Option<Ipv4Addr>, NetError> {
    let fd = control_socket().map_err(io_err("Opening a control socket", interface))?;
    let mut req = ifreq(interface)?;
    match ioctl(
        &fd,
        libc::SIOCGIFADDR,
        (&raw mut req).cast(),
        "Reading the address",
        interface,
    ) {
        Ok(()) => {}
        Err(NetError::Ioctl { source, .. })
            if source.raw_os_error() == Some(libc::EADDRNOTAVAIL) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e),
    }
    // SAFETY: SIOCGIFADDR filled the addr member with an AF_INET sockaddr_in.
    let sin =
        unsafe { std::mem::transmute::<libc::sockaddr, libc::sockaddr_in>(req.ifr_ifru.ifru_addr) };
    Ok(Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
}

/// The most addresses [`remove_addresses`] removes from one interface.
const MAX_ADDRESSES: usize = 256;

/// Removes every IPv4 address of the interface (those labelled with its name, as the kernel
/// and `ip addr add` label them); returns them. The prefix routes go with them.
pub fn remove_addresses(interface: &str) -> Result<Vec<Ipv4Addr>, NetError> {
    let fd = control_socket().map_err(io_err("Opening a control socket", interface))?;
    let mut removed = Vec::new();
    while let Some(address) = address_of(interface)? {
        if removed.len() >= MAX_ADDRESSES {
            break;
        }
        // Setting 0.0.0.0 deletes the first address of this label (what `ifconfig eth0
        // 0.0.0.0` does).
        let mut req = ifreq(interface)?;
        req.ifr_ifru.ifru_addr = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        ioctl(
            &fd,
            libc::SIOCSIFADDR,
            (&raw mut req).cast(),
            "Removing an address",
            interface,
        )?;
        removed.push(address);
    }
    Ok(removed)
}

/// Whether an interface is up (for tests and diagnostics).
pub fn is_up(interface: &str) -> Result<bool, NetError> {
    let fd = control_socket().map_err(io_err("Opening a control socket", interface))?;
    let mut req = ifreq(interface)?;
    ioctl(
        &fd,
        libc::SIOCGIFFLAGS,
        (&raw mut req).cast(),
        "Reading flags",
        interface,
    )?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    Ok(flags & libc::IFF_UP as libc::c_short != 0)
}

/// The netmask of a prefix length.
pub fn netmask(prefix_len: u8) -> Ipv4Addr {
    let bits = u32::from(prefix_len.min(32));
    Ipv4Addr::from(if bits == 0 {
        0
    } else {
        u32::MAX << (32 - bits)
    })
}

/// Makes the kernel send a gratuitous ARP for the interface's address when it comes up
/// (`arp_notify`). Addresses are handed out again once their VM is gone, and a new VM has a
/// new MAC: without the announcement every neighbour that still has the old MAC for the
/// address (the node, VMs that talked to the old VM) sends into the void for seconds, until
/// its own entry times out and it asks again. Best effort: a kernel without the knob still
/// works, only slower to be found.
fn announce_on_up(interface: &str) {
    let knob = format!("/proc/sys/net/ipv4/conf/{interface}/arp_notify");
    if let Err(e) = std::fs::write(&knob, "1") {
        eprintln!("imp-guest: {knob}: {e}; the address is not announced");
    }
}

/// Gives the interface its address, netmask and MTU, announces the address as it brings the
/// interface up, adds the default route.
pub fn configure(net: &NetworkConfig) -> Result<(), NetError> {
    let name = net.interface.as_str();
    let fd = control_socket().map_err(io_err("Opening a control socket", name))?;

    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(net.address);
    ioctl(
        &fd,
        libc::SIOCSIFADDR,
        (&raw mut req).cast(),
        "Setting the address",
        name,
    )?;

    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(netmask(net.prefix_len));
    ioctl(
        &fd,
        libc::SIOCSIFNETMASK,
        (&raw mut req).cast(),
        "Setting the netmask",
        name,
    )?;

    if let Some(mtu) = net.mtu {
        let mut req = ifreq(name)?;
        req.ifr_ifru.ifru_mtu = i32::try_from(mtu).unwrap_or(i32::MAX);
        ioctl(
            &fd,
            libc::SIOCSIFMTU,
            (&raw mut req).cast(),
            "Setting the MTU",
            name,
        )?;
    }
    announce_on_up(name);
    bring_up(name)?;

    if let Some(gateway) = net.gateway {
        // SAFETY: rtentry is a plain C struct; all-zero (null device, no metric) is valid.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr_in(gateway);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        match ioctl(
            &fd,
            libc::SIOCADDRT,
            (&raw mut rt).cast(),
            "Adding the default route",
            name,
        ) {
            Err(NetError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {}
            other => other?,
        }
    }
    Ok(())
}

/// The /etc/resolv.conf for a network config (empty when it names no servers).
pub fn resolv_conf(net: &NetworkConfig) -> String {
    let mut out = String::new();
    if !net.search.is_empty() {
        out.push_str(&format!("search {}\n", net.search.join(" ")));
    }
    for server in &net.dns {
        out.push_str(&format!("nameserver {server}\n"));
    }
    out
}

/// The /etc/hosts for a hostname and address.
pub fn hosts(hostname: Option<&str>, address: Option<Ipv4Addr>) -> String {
    let mut out = String::from("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    if let Some(h) = hostname {
        out.push_str(&own_entry(h, address));
    }
    out
}

/// The machine's own line in /etc/hosts: its address (127.0.1.1 without one) and name.
fn own_entry(hostname: &str, address: Option<Ipv4Addr>) -> String {
    let ip = address.map_or_else(|| "127.0.1.1".to_string(), |a| a.to_string());
    format!("{ip}\t{hostname}\n")
}

/// /etc/hosts with the machine's own entry changed from (`old_name`, `old_address`) to
/// (`new_name`, `new_address`), as [`hosts`] writes it: the lines that gave the old address
/// (127.0.1.1 without one) the old name are replaced by one new line where the first of them
/// was, or the new line is appended; every other line is kept.
pub fn hosts_with_own_entry(
    current: &str,
    old_name: Option<&str>,
    old_address: Option<Ipv4Addr>,
    new_name: &str,
    new_address: Option<Ipv4Addr>,
) -> String {
    let old_ip = old_address.map_or_else(|| "127.0.1.1".to_string(), |a| a.to_string());
    let is_own = |line: &str| {
        let mut fields = line.split_whitespace();
        fields.next() == Some(old_ip.as_str()) && old_name.is_some_and(|n| fields.any(|f| f == n))
    };
    let new_line = own_entry(new_name, new_address);
    let mut out = String::with_capacity(current.len() + new_line.len());
    let mut replaced = false;
    for line in current.lines() {
        if is_own(line) {
            if !replaced {
                out.push_str(&new_line);
                replaced = true;
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !replaced {
        out.push_str(&new_line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net() -> NetworkConfig {
        NetworkConfig {
            interface: "eth0".into(),
            address: Ipv4Addr::new(10, 0, 0, 5),
            prefix_len: 24,
            gateway: Some(Ipv4Addr::new(10, 0, 0, 1)),
            dns: vec!["10.0.0.1".parse().unwrap(), "2001:db8::1".parse().unwrap()],
            search: vec!["ns.svc.local".into(), "svc.local".into()],
            mtu: None,
        }
    }

    #[test]
    fn netmasks_follow_the_prefix() {
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(netmask(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(netmask(17), Ipv4Addr::new(255, 255, 128, 0));
    }

    #[test]
    fn resolv_conf_lists_search_then_servers() {
        assert_eq!(
            resolv_conf(&net()),
            "search ns.svc.local svc.local\nnameserver 10.0.0.1\nnameserver 2001:db8::1\n"
        );
    }

    #[test]
    fn hosts_names_the_vm() {
        let h = hosts(Some("vm1"), Some(Ipv4Addr::new(10, 0, 0, 5)));
        assert!(h.starts_with("127.0.0.1\tlocalhost\n"));
        assert!(h.ends_with("10.0.0.5\tvm1\n"), "{h}");
    }

    #[test]
    fn a_clone_rewrites_only_its_own_hosts_entry() {
        let old = Some(Ipv4Addr::new(10, 0, 0, 5));
        let new = Some(Ipv4Addr::new(10, 0, 0, 7));
        let booted = hosts(Some("vm1"), old);
        let with_extra = format!("{booted}10.9.9.9\tdb db.local\n# note\n");
        assert_eq!(
            hosts_with_own_entry(&with_extra, Some("vm1"), old, "clone1", new),
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n\
             10.0.0.7\tclone1\n10.9.9.9\tdb db.local\n# note\n"
        );
        // What the boot would have written for the new identity.
        assert_eq!(
            hosts_with_own_entry(&booted, Some("vm1"), old, "clone1", new),
            hosts(Some("clone1"), new)
        );
        // No address before: the 127.0.1.1 line is the own one; a missing line is appended.
        assert_eq!(
            hosts_with_own_entry(&hosts(Some("vm1"), None), Some("vm1"), None, "c", None),
            hosts(Some("c"), None)
        );
        assert_eq!(
            hosts_with_own_entry("127.0.0.1 localhost", Some("vm1"), old, "c", new),
            "127.0.0.1 localhost\n10.0.0.7\tc\n"
        );
        // Another machine's line with the same name is not ours.
        assert_eq!(
            hosts_with_own_entry("10.1.1.1 vm1\n", Some("vm1"), old, "c", new),
            "10.1.1.1 vm1\n10.0.0.7\tc\n"
        );
    }

    #[test]
    fn the_loopback_address_is_read() {
        // lo always has 127.0.0.1 once up; reading needs no privilege.
        if is_up("lo").unwrap_or(false) {
            assert_eq!(address_of("lo").unwrap(), Some(Ipv4Addr::LOCALHOST));
        }
        assert!(matches!(
            address_of("impnone0"),
            Err(NetError::Ioctl { .. })
        ));
    }

    #[test]
    fn bad_interface_names_are_refused() {
        assert!(matches!(ifreq(""), Err(NetError::BadName(_))));
        assert!(matches!(
            ifreq("a-very-long-interface"),
            Err(NetError::BadName(_))
        ));
    }

    #[test]
    fn loopback_is_readable() {
        // Reading flags needs no privilege; lo exists in every network namespace.
        is_up("lo").unwrap();
        assert!(matches!(is_up("impnone0"), Err(NetError::Ioctl { .. })));
    }
}
