//! Static network setup with plain ioctls (no netlink): bring interfaces up, give eth0 its
//! address and default route, announce it, write /etc/resolv.conf and /etc/hosts.
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
    unsafe {
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    ioctl(
        &fd,
        libc::SIOCSIFFLAGS,
        (&raw mut req).cast(),
        "Setting IFF_UP",
        interface,
    )
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
        let ip = address.map_or_else(|| "127.0.1.1".to_string(), |a| a.to_string());
        out.push_str(&format!("{ip}\t{h}\n"));
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
