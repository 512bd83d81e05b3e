//! IPv4 subnets: the address arithmetic that networks, groups, IPAM and the node's bridges
//! share.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// An IPv4 network: a network address and a prefix length, with no host bits set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

/// Why a CIDR string is not one; the message quotes the input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// Not of the form `a.b.c.d/p` with `p` at most 32.
    #[error("must be an IPv4 CIDR such as 10.44.0.0/24, got {0:?}")]
    Malformed(String),
    /// The address has bits set below the prefix.
    #[error("{input} has host bits set; the network address is {network}")]
    HostBits {
        /// What was given.
        input: String,
        /// What was meant.
        network: Ipv4Cidr,
    },
}

impl Ipv4Cidr {
    /// Link-local IPv4, 169.254.0.0/16 (where clouds serve instance metadata).
    pub const LINK_LOCAL: Ipv4Cidr = Ipv4Cidr {
        network: Ipv4Addr::new(169, 254, 0, 0),
        prefix: 16,
    };

    /// The network holding `addr` at `prefix` (host bits cleared); `None` if `prefix > 32`.
    pub fn containing(addr: Ipv4Addr, prefix: u8) -> Option<Self> {
        (prefix <= 32).then(|| Self {
            network: Ipv4Addr::from(u32::from(addr) & mask(prefix)),
            prefix,
        })
    }

    /// The network address.
    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The last address (all host bits set).
    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) | !mask(self.prefix))
    }

    /// How many addresses the network spans, network and broadcast included.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    /// Whether `addr` lies inside.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & mask(self.prefix) == u32::from(self.network)
    }

    /// Whether `other` lies wholly inside.
    pub fn covers(&self, other: &Ipv4Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.network)
    }

    /// Whether the two share any address.
    pub fn overlaps(&self, other: &Ipv4Cidr) -> bool {
        self.covers(other) || other.covers(self)
    }

    /// The `n`-th address from the network address (0 is the network itself), if inside.
    pub fn nth(&self, n: u64) -> Option<Ipv4Addr> {
        (n < self.size()).then(|| Ipv4Addr::from(u32::from(self.network) + n as u32))
    }

    /// The usual gateway: the first address after the network address.
    pub fn first_host(&self) -> Option<Ipv4Addr> {
        (self.prefix <= 30).then(|| Ipv4Addr::from(u32::from(self.network) + 1))
    }

    /// Whether `addr` is the network or broadcast address (never given to a host).
    pub fn is_reserved(&self, addr: Ipv4Addr) -> bool {
        self.prefix <= 30 && (addr == self.network || addr == self.broadcast())
    }
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    }
}

impl FromStr for Ipv4Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, CidrError> {
        let bad = || CidrError::Malformed(s.to_owned());
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        let cidr = Self::containing(addr, prefix).ok_or_else(bad)?;
        if cidr.network != addr {
            return Err(CidrError::HostBits {
                input: s.to_owned(),
                network: cidr,
            });
        }
        Ok(cidr)
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Ipv4Cidr {
        s.parse().unwrap()
    }

    #[test]
    fn parses_and_prints() {
        assert_eq!(c("10.44.0.0/24").to_string(), "10.44.0.0/24");
        assert_eq!(c("0.0.0.0/0").size(), 1 << 32);
        assert!(matches!(
            "10.0.0.1/24".parse::<Ipv4Cidr>(),
            Err(CidrError::HostBits { network, .. }) if network == c("10.0.0.0/24")
        ));
        for bad in ["10.0.0.0", "10.0.0.0/33", "10.0.0/8", "x/8", "10.0.0.0/-1"] {
            assert!(
                matches!(bad.parse::<Ipv4Cidr>(), Err(CidrError::Malformed(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn arithmetic() {
        let n = c("10.1.2.0/29");
        assert_eq!(n.broadcast(), Ipv4Addr::new(10, 1, 2, 7));
        assert_eq!(n.size(), 8);
        assert_eq!(n.first_host(), Some(Ipv4Addr::new(10, 1, 2, 1)));
        assert_eq!(n.nth(7), Some(Ipv4Addr::new(10, 1, 2, 7)));
        assert_eq!(n.nth(8), None);
        assert!(n.is_reserved(Ipv4Addr::new(10, 1, 2, 0)));
        assert!(n.is_reserved(Ipv4Addr::new(10, 1, 2, 7)));
        assert!(!n.is_reserved(Ipv4Addr::new(10, 1, 2, 3)));
        assert!(n.contains(Ipv4Addr::new(10, 1, 2, 5)));
        assert!(!n.contains(Ipv4Addr::new(10, 1, 2, 8)));
        assert_eq!(c("10.0.0.0/31").first_host(), None);
    }

    #[test]
    fn overlap_is_symmetric() {
        let big = c("10.0.0.0/16");
        let small = c("10.0.5.0/24");
        let other = c("10.1.0.0/16");
        assert!(big.covers(&small) && !small.covers(&big));
        assert!(big.overlaps(&small) && small.overlaps(&big));
        assert!(!big.overlaps(&other) && !other.overlaps(&big));
    }
}
