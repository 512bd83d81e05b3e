//! The node's packet filter and NAT for imp's networks: two nftables tables owned by imp
//! (`inet imp` and `bridge imp`), rendered whole from the plan and swapped in one `nft -f`
//! transaction, so a rule set is never half applied and nothing outside the tables is touched.
//!
//! What the rules say, per network on the node (bridge B, subnet S):
//! - **input** from B: only replies and ICMP reach the node; a guest cannot open connections
//!   to the node's services (the agent's API, metrics, anything bound to 0.0.0.0).
//! - **forward** (routed through the gateway): B to B is allowed (group rules first); B to
//!   another imp bridge is dropped (networks are isolated); B to the NAT egress interface is
//!   allowed when NAT is on, otherwise nothing leaves; toward B only replies are forwarded.
//! - **postrouting**: S masquerades out of the egress interface when NAT is on.
//! - **bridge forward** (switched inside B between its ports, the VMs' TAPs and the VXLAN
//!   device, so also between nodes): a group with `connectivity: subnet` exchanges IPv4 and
//!   ARP only with itself. (Ports are matched by name: `meta ibrname` is not available on
//!   every kernel.)

use std::fmt::Write;

use super::plan::NetPlan;

/// The tables' name (in the `inet` and `bridge` families).
pub const TABLE: &str = "imp";

/// The `nft -f` script that makes the tables match `networks` (removes them when empty).
pub fn script(networks: &[NetPlan]) -> String {
    let mut s = String::new();
    // Creating then deleting makes the delete valid whether or not the table exists; the
    // whole file is one transaction.
    for family in ["inet", "bridge"] {
        let _ = writeln!(s, "table {family} {TABLE}\ndelete table {family} {TABLE}");
    }
    if networks.is_empty() {
        return s;
    }
    s.push_str(&inet_table(networks));
    s.push_str(&bridge_table(networks));
    s
}

fn inet_table(networks: &[NetPlan]) -> String {
    let mut input = String::new();
    let mut forward = String::new();
    let mut nat = String::new();
    for n in networks {
        let b = &n.bridge;
        let _ = writeln!(
            input,
            "    iifname \"{b}\" ct state established,related accept"
        );
        let _ = writeln!(input, "    iifname \"{b}\" ip protocol icmp accept");
        let _ = writeln!(input, "    iifname \"{b}\" drop");
        for g in &n.isolated_groups {
            let s = n.subnet;
            let _ = writeln!(
                forward,
                "    iifname \"{b}\" oifname \"{b}\" ip saddr {g} ip daddr != {g} drop"
            );
            let _ = writeln!(
                forward,
                "    iifname \"{b}\" oifname \"{b}\" ip saddr {s} ip saddr != {g} ip daddr {g} drop"
            );
        }
        let _ = writeln!(forward, "    iifname \"{b}\" oifname \"{b}\" accept");
        let _ = writeln!(
            forward,
            "    oifname \"{b}\" ct state established,related accept"
        );
        let _ = writeln!(forward, "    oifname \"{b}\" drop");
        if let Some(egress) = &n.nat_egress {
            let _ = writeln!(
                forward,
                "    iifname \"{b}\" oifname \"{egress}\" ip saddr {} accept",
                n.subnet
            );
            let _ = writeln!(
                nat,
                "    ip saddr {s} ip daddr != {s} oifname \"{egress}\" masquerade",
                s = n.subnet
            );
        }
        let _ = writeln!(forward, "    iifname \"{b}\" drop");
    }
    format!(
        "table inet {TABLE} {{\n  chain input {{\n    type filter hook input priority filter; policy accept;\n{input}  }}\n  \
         chain forward {{\n    type filter hook forward priority filter; policy accept;\n{forward}  }}\n  \
         chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n{nat}  }}\n}}\n"
    )
}

fn bridge_table(networks: &[NetPlan]) -> String {
    let mut forward = String::new();
    for n in networks.iter().filter(|n| !n.isolated_groups.is_empty()) {
        // Frames enter a bridge through its ports: the VMs' TAPs and the VXLAN device.
        let ports: Vec<String> = n
            .taps
            .iter()
            .chain(n.vxlan.iter().map(|v| &v.name))
            .map(|p| format!("\"{p}\""))
            .collect();
        let p = format!("{{ {} }}", ports.join(", "));
        let s = n.subnet;
        for g in &n.isolated_groups {
            let _ = writeln!(forward, "    iifname {p} ip saddr {g} ip daddr != {g} drop");
            let _ = writeln!(
                forward,
                "    iifname {p} ip saddr {s} ip saddr != {g} ip daddr {g} drop"
            );
            let _ = writeln!(
                forward,
                "    iifname {p} arp saddr ip {g} arp daddr ip != {g} drop"
            );
            let _ = writeln!(
                forward,
                "    iifname {p} arp saddr ip {s} arp saddr ip != {g} arp daddr ip {g} drop"
            );
        }
    }
    format!(
        "table bridge {TABLE} {{\n  chain forward {{\n    type filter hook forward priority filter; policy accept;\n{forward}  }}\n}}\n"
    )
}

/// Why the rules could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// `nft` could not be started (not installed?).
    #[error("Running {program} to load imp's nftables rules (is the nftables package installed?)")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `nft` refused the rules.
    #[error("nft refused imp's rules: {stderr}")]
    Refused {
        /// What nft said.
        stderr: String,
    },
}

/// Loads `script` with `nft -f -` (one transaction).
pub async fn apply(program: &str, script: &str) -> Result<(), NftError> {
    use tokio::io::AsyncWriteExt;
    let spawn_err = |source| NftError::Spawn {
        program: program.to_owned(),
        source,
    };
    let mut child = tokio::process::Command::new(program)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_err)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(spawn_err)?;
    }
    let out = child.wait_with_output().await.map_err(spawn_err)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NftError::Refused {
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn net(bridge: &str, subnet: &str, nat: Option<&str>, groups: &[&str]) -> NetPlan {
        let subnet: imp_api::ipv4::Ipv4Cidr = subnet.parse().unwrap();
        NetPlan {
            key: format!("ns/{bridge}"),
            bridge: bridge.into(),
            gateway: subnet.first_host().unwrap(),
            subnet,
            mtu: 1450,
            vxlan: None,
            taps: BTreeSet::new(),
            fdb: BTreeSet::new(),
            nat_egress: nat.map(str::to_owned),
            isolated_groups: groups.iter().map(|g| g.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn no_network_removes_both_tables_and_nothing_else() {
        let s = script(&[]);
        assert_eq!(
            s,
            "table inet imp\ndelete table inet imp\ntable bridge imp\ndelete table bridge imp\n"
        );
    }

    #[test]
    fn networks_are_isolated_and_nat_is_per_network() {
        let s = script(&[
            net("impbr-a", "10.1.0.0/24", Some("eth0"), &[]),
            net("impbr-b", "10.2.0.0/24", None, &[]),
        ]);
        assert!(
            s.contains("ip saddr 10.1.0.0/24 ip daddr != 10.1.0.0/24 oifname \"eth0\" masquerade"),
            "{s}"
        );
        assert!(
            !s.contains("ip saddr 10.2.0.0/24 ip daddr != 10.2.0.0/24"),
            "{s}"
        );
        assert!(s.contains("iifname \"impbr-a\" oifname \"eth0\" ip saddr 10.1.0.0/24 accept"));
        // Each bridge ends in a drop, so nothing routes from one network to the other.
        let forward = &s[s.find("chain forward").unwrap()..s.find("chain postrouting").unwrap()];
        let a_accept = forward
            .find("iifname \"impbr-a\" oifname \"eth0\"")
            .unwrap();
        let a_drop = forward.find("    iifname \"impbr-a\" drop\n").unwrap();
        assert!(a_accept < a_drop);
        assert!(s.contains("    iifname \"impbr-b\" drop\n"));
        assert!(s.contains("oifname \"impbr-b\" ct state established,related accept"));
        assert!(s.contains("type nat hook postrouting priority srcnat"));
    }

    #[test]
    fn an_isolated_group_is_fenced_at_the_bridge_and_at_the_gateway() {
        let mut n = net("impbr-a", "10.1.0.0/24", None, &["10.1.0.16/28"]);
        n.taps = ["imptap-1".to_owned(), "imptap-2".to_owned()].into();
        let s = script(&[n]);
        let ports = "iifname { \"imptap-1\", \"imptap-2\" }";
        let g = "10.1.0.16/28";
        assert!(
            s.contains(&format!("{ports} ip saddr {g} ip daddr != {g} drop")),
            "{s}"
        );
        assert!(s.contains(&format!(
            "{ports} arp saddr ip {g} arp daddr ip != {g} drop"
        )));
        let group_drop = s
            .find("iifname \"impbr-a\" oifname \"impbr-a\" ip saddr 10.1.0.16/28")
            .unwrap();
        let same_accept = s
            .find("iifname \"impbr-a\" oifname \"impbr-a\" accept")
            .unwrap();
        assert!(
            group_drop < same_accept,
            "group rules come before the same-network accept"
        );
    }
}
