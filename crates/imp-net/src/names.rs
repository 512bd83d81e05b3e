//! Interface names on the node, derived stably from the objects they serve so that a restarted
//! agent finds its own devices again: `impbr-` (bridge) and `impvx-` (VXLAN) from the
//! network's `namespace/name`, `imptap-` from the VM's. Every name fits `IFNAMSIZ` (15 bytes).
//!
//! Names the node did not make itself (an ImpNetwork's `spec.nat.egressInterface`, the default
//! route's interface, a name read back from a VM's spec on disk) go through [`check_interface`]
//! (or [`check_own`]) before they are written into an nftables script, a `/proc/sys` path or a
//! netlink request: the kernel allows `"`, `;`, `*` and `\` in interface names, and each of
//! them means something to `nft` (`x";accept;#` ends the quoted name and adds a rule; `i*`
//! matches every interface whose name starts with `i`).

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

/// Why a name cannot be used as an interface name on the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadName {
    /// Empty.
    #[error("is empty")]
    Empty,
    /// Longer than the kernel's `IFNAMSIZ` allows.
    #[error("is {0} bytes long, more than the 15 an interface name may have")]
    TooLong(usize),
    /// `.` or `..`: a directory, not a name, in `/proc/sys/net/ipv4/conf/`.
    #[error("is . or ..")]
    Dots,
    /// A character that is not a letter, a digit, `-`, `_` or `.`.
    #[error("holds {0:?}; an interface name holds only ASCII letters, digits, '-', '_' and '.'")]
    Character(char),
    /// Not one of the names imp derives (`impbr-`, `impvx-`, `imptap-` and 8 hex digits).
    #[error("is not a name imp makes (impbr-, impvx- or imptap- and 8 lowercase hex digits)")]
    NotOwn,
}

/// Checks a name imp writes into nftables rules, `/proc/sys` paths and netlink requests: 1 to
/// 15 bytes of ASCII letters, digits, `-`, `_` and `.`, and not `.` or `..`. Stricter than the
/// kernel (which refuses only `/`, `:` and white space), because `nft` reads `"` as the end
/// of the name, `*` as a wildcard and `\` as an escape; every interface name Linux tools
/// make (`eth0`, `ens3`, `enp0s31f6`, `bond0.100`, `br-1a2b`, `cali12ab`) passes.
pub fn check_interface(name: &str) -> Result<(), BadName> {
    if name.is_empty() {
        return Err(BadName::Empty);
    }
    if name.len() >= IFNAMSIZ {
        return Err(BadName::TooLong(name.len()));
    }
    if name == "." || name == ".." {
        return Err(BadName::Dots);
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        Some(c) => Err(BadName::Character(c)),
        None => Ok(()),
    }
}

/// Checks that `name` is one imp derives ([`bridge`], [`vxlan`], [`tap`]): a name read back
/// from a VM's spec on disk is used only if it is.
pub fn check_own(name: &str) -> Result<(), BadName> {
    check_interface(name)?;
    let own = [BRIDGE_PREFIX, VXLAN_PREFIX, TAP_PREFIX].iter().any(|p| {
        name.strip_prefix(p).is_some_and(|h| {
            h.len() == 8
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    });
    if own { Ok(()) } else { Err(BadName::NotOwn) }
}

/// The kernel's limit on an interface name, with its terminating NUL.
const IFNAMSIZ: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_and_admission_agree_on_every_interface_name() {
        let mut names: Vec<String> = (0u8..128).map(|b| format!("a{}", b as char)).collect();
        names.extend(
            [
                "",
                ".",
                "..",
                "eth0",
                "é",
                "abcdefghijklmno",
                "abcdefghijklmnop",
                "x\";accept;#",
            ]
            .map(String::from),
        );
        for n in &names {
            assert_eq!(
                check_interface(n).is_ok(),
                imp_api::validation::interface_name(n).is_ok(),
                "{n:?}"
            );
        }
    }

    #[test]
    fn interface_names_hold_nothing_nft_or_a_path_would_read() {
        for ok in [
            "eth0",
            "ens3",
            "enp0s31f6",
            "bond0.100",
            "br-1a2b3c4d5e6f",
            "cali12ab",
            "wg_0",
            "a",
        ] {
            assert_eq!(check_interface(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", BadName::Empty),
            ("x\";accept;#", BadName::Character('"')),
            ("i*", BadName::Character('*')),
            ("eth\\*", BadName::Character('\\')),
            ("a b", BadName::Character(' ')),
            ("a;b", BadName::Character(';')),
            ("a/../../x", BadName::Character('/')),
            ("eth0:1", BadName::Character(':')),
            ("ethé", BadName::Character('é')),
            ("a\nb", BadName::Character('\n')),
            ("a{b}", BadName::Character('{')),
            ("..", BadName::Dots),
            (".", BadName::Dots),
            ("sixteen-bytes-xx", BadName::TooLong(16)),
        ] {
            assert_eq!(check_interface(bad), Err(why), "{bad:?}");
        }
        assert_eq!(check_interface("fifteen-bytes-x"), Ok(()));
    }

    #[test]
    fn own_names_are_only_those_imp_derives() {
        for n in [bridge("ns", "n"), vxlan("ns", "n"), tap("ns", "vm")] {
            assert_eq!(check_own(&n), Ok(()), "{n}");
        }
        for bad in [
            "eth0",
            "impbr-a",
            "imptap-0000000G",
            "imptap-0000000A",
            "impbr-\"1234567",
        ] {
            assert!(check_own(bad).is_err(), "{bad}");
        }
    }

    /// Every string of the characters that matter to nft, paths and the kernel either passes
    /// and holds none of them, or is refused.
    #[test]
    fn no_accepted_name_holds_a_character_nft_reads() {
        let alphabet: Vec<char> = "a0-_.\"';#*\\/: {}\n\t$@!é".chars().collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 18) as usize;
            let name: String = (0..len)
                .map(|i| alphabet[((seed >> (i * 3)) as usize + i) % alphabet.len()])
                .collect();
            if check_interface(&name).is_ok() {
                assert!(
                    (1..=15).contains(&name.len())
                        && name != "."
                        && name != ".."
                        && name
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
                    "{name:?} passed"
                );
            }
        }
    }

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
