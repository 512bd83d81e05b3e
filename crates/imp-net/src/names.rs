//! Interface names on the node, derived stably from the objects they serve so that a restarted
//! agent finds its own devices again: `impbr-` (bridge) and `impvx-` (VXLAN) from the
//! network's `namespace/name`, `imptap-` from the VM's. Every name fits `IFNAMSIZ` (15 bytes).

use sha2::{Digest, Sha256};

/// Prefix of a network's bridge.
pub const BRIDGE_PREFIX: &str = "impbr-";
/// Prefix of a network's VXLAN device.
pub const VXLAN_PREFIX: &str = "impvx-";
/// Prefix of a VM's TAP device.
pub const TAP_PREFIX: &str = "imptap-";

fn short_hash(namespace: &str, name: &str) -> String {
    let d = Sha256::digest(format!("{namespace}/{name}").as_bytes());
    d[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// The bridge of network `namespace/name`.
pub fn bridge(namespace: &str, name: &str) -> String {
    format!("{BRIDGE_PREFIX}{}", short_hash(namespace, name))
}

/// The VXLAN device of network `namespace/name`.
pub fn vxlan(namespace: &str, name: &str) -> String {
    format!("{VXLAN_PREFIX}{}", short_hash(namespace, name))
}

/// The TAP device of VM `namespace/name`.
pub fn tap(namespace: &str, name: &str) -> String {
    format!("{TAP_PREFIX}{}", short_hash(namespace, name))
}

/// Whether imp made (and may remove) the interface called `name`.
pub fn is_imp(name: &str) -> bool {
    [BRIDGE_PREFIX, VXLAN_PREFIX, TAP_PREFIX]
        .iter()
        .any(|p| name.starts_with(p) && name.len() == p.len() + 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_ifnamsiz_and_are_stable() {
        for n in [
            bridge("a-very-long-namespace-name", "net"),
            vxlan("ns", "net"),
            tap(
                "ns",
                "a-vm-with-a-name-of-sixty-three-characters-xxxxxxxxxxxxxxxxxxxx",
            ),
        ] {
            assert!(n.len() <= 15, "{n}");
            assert!(is_imp(&n), "{n}");
        }
        assert_eq!(bridge("ns", "net"), bridge("ns", "net"));
        assert_ne!(bridge("ns", "net"), bridge("ns", "net2"));
        assert_eq!(bridge("ns", "net")[6..], vxlan("ns", "net")[6..]);
        assert!(!is_imp("eth0") && !is_imp("impbr-x") && !is_imp("docker0"));
    }
}
