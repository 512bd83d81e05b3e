//! imp's nftables rules on a real kernel, with the real `nft`: in a network namespace of its
//! own (a "node"), [`NodeNet`] attaches a VM's port the way the agent does before a VM starts.
//! It proves that:
//! - when `nft` refuses the rules, the attach is refused with nft's own message and leaves no
//!   TAP behind (the agent then reports `NetworkSetupFailed` and starts no VMM);
//! - an ImpNetwork whose `spec.nat.egressInterface` holds nftables syntax (`x";accept;#`)
//!   is refused naming the field, and nothing of it reaches the tables;
//! - with the real `nft` and a sound network, the attach succeeds with the port's chain loaded.
//!
//! Each test runs itself again inside a fresh namespace (`nsenter --net`), then removes it.
//! Needs root, iproute2, nsenter, nftables and `/dev/net/tun`: without them it skips on a
//! developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_testenv::command::sh;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::Command;

use imp_net::plan::NetworkView;
use imp_net::{NetAttachment, NetSettings, NodeNet, names};
use imp_proto::config::NetworkConfig;

const MARK: &str = "IMP_NFT_TEST_INSIDE";

/// True inside the test's own namespace (run the test); false outside, after the copy of the
/// test inside has run (or when the machine cannot run it).
fn inside(test: &str, tag: &str) -> bool {
    if std::env::var(MARK).is_ok_and(|m| m == tag) {
        return true;
    }
    let root = imp_testenv::guard::is_root();
    let tools = ["ip", "nsenter", "nft", "sh"]
        .iter()
        .all(|t| imp_testenv::guard::which(t).is_some());
    let tun = std::path::Path::new("/dev/net/tun").exists();
    if !imp_testenv::guard::require(root, "root for network namespaces")
        || !imp_testenv::guard::require(tools, "ip, nsenter, nft (nftables) and sh")
        || !imp_testenv::guard::require(tun, "/dev/net/tun")
    {
        return false;
    }
    let ns = format!("nft{}{tag}", std::process::id());
    sh(&["ip", "netns", "add", &ns]);
    let mut child = Command::new("nsenter");
    child
        .arg(format!("--net=/var/run/netns/{ns}"))
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(MARK, tag);
    // Fails unless the child ran exactly this one test and it passed (a renamed test would
    // match nothing there and exit 0); the namespace goes first either way.
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        imp_testenv::rerun::one_test(child, test)
    }));
    let _ = Command::new("ip").args(["netns", "del", &ns]).output();
    if let Err(e) = ran {
        std::panic::resume_unwind(e);
    }
    false
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn node(nft: &str) -> NodeNet {
    sh(&["ip", "link", "set", "lo", "up"]);
    NodeNet::new(NetSettings {
        vtep: None,
        vxlan_port: 4789,
        nft: nft.to_owned(),
        egress_deny: vec![],
        api_servers: Vec::new(),
    })
    .unwrap()
}

/// ImpNetwork `ns/net` on 10.78.0.0/24, with NAT out of `egress` if given.
fn network(egress: Option<&str>) -> NetworkView {
    let subnet: imp_api::ipv4::Ipv4Cidr = "10.78.0.0/24".parse().unwrap();
    NetworkView {
        key: "ns/net".into(),
        subnet,
        gateway: subnet.first_host().unwrap(),
        nat: egress.map(|e| Some(e.to_owned())),
        isolated_groups: vec![],
        egress_allow: vec![],
        vni: 78,
        vteps: vec![],
    }
}

/// VM `ns/vm` on `ns/net`, as the agent makes its attachment.
fn vm() -> NetAttachment {
    NetAttachment {
        network: "ns/net".into(),
        bridge: names::bridge("ns", "net"),
        tap: names::tap("ns", "vm"),
        mac: imp_api::network::vm_mac("ns", "vm"),
        vm: "ns/vm".into(),
        config: NetworkConfig {
            interface: "eth0".into(),
            address: Ipv4Addr::new(10, 78, 0, 5),
            prefix_len: 24,
            gateway: Some(Ipv4Addr::new(10, 78, 0, 1)),
            dns: vec![],
            search: vec![],
            mtu: Some(1500),
        },
    }
}

/// imp's interfaces in this namespace.
fn imp_links() -> Vec<String> {
    sh(&["ip", "-o", "link", "show"])
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| names::is_imp(n))
        .collect()
}

/// An `nft` that refuses every script (as nft does one it cannot load) and passes anything
/// else to the real one.
fn refusing_nft() -> String {
    let dir = imp_testenv::registry::scratch_dir("imp-nft-refusing").unwrap();
    let path = dir.join("nft");
    std::fs::write(
        &path,
        "#!/bin/sh\nif [ \"$1\" = -f ]; then cat >/dev/null; \
         echo 'Error: Could not process rule: refused by the test' >&2; exit 1; fi\nexec nft \"$@\"\n",
    )
    .unwrap();
    let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(&path, mode).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn a_refused_rule_load_attaches_no_vm_and_leaves_no_tap() {
    if !inside(
        "a_refused_rule_load_attaches_no_vm_and_leaves_no_tap",
        "refused",
    ) {
        return;
    }
    runtime().block_on(async {
        let net = node(&refusing_nft());
        net.upsert_network(network(None));
        let why = net.attach("uid-1", vm()).await.unwrap_err();
        assert!(
            why.starts_with("wiring ImpNetwork ns/net: nft refused imp's rules: ")
                && why.contains("refused by the test"),
            "{why}"
        );
        assert_eq!(imp_links(), Vec::<String>::new(), "no TAP or bridge left");
        assert_eq!(sh(&["nft", "list", "ruleset"]), "", "no tables loaded");

        // The same VM with an nft that loads: attached, its port's chain in the tables.
        let net = node("nft");
        net.set_networks(BTreeMap::from([("ns/net".into(), network(None))]));
        net.attach("uid-1", vm()).await.unwrap();
        let tap = names::tap("ns", "vm");
        let table = sh(&["nft", "list", "table", "bridge", "imp"]);
        assert!(table.contains(&format!("chain port-{tap}")), "{table}");
        assert!(imp_links().contains(&tap));
        net.detach("uid-1").await;
        assert_eq!(imp_links(), Vec::<String>::new());
    });
}

#[test]
fn an_egress_interface_holding_nft_syntax_is_refused_and_loads_nothing() {
    if !inside(
        "an_egress_interface_holding_nft_syntax_is_refused_and_loads_nothing",
        "hostile",
    ) {
        return;
    }
    runtime().block_on(async {
        let net = node("nft");
        for hostile in ["x\";accept;#", "i*"] {
            net.upsert_network(network(Some(hostile)));
            let why = net.attach("uid-1", vm()).await.unwrap_err();
            assert!(
                why.starts_with(&format!(
                    "ImpNetwork ns/net: spec.nat.egressInterface {hostile:?} is not a valid interface name"
                )),
                "{why}"
            );
            let rules = sh(&["nft", "list", "ruleset"]);
            assert!(
                !rules.contains("oifname \"x\"") && !rules.contains("\"i*\""),
                "{rules}"
            );
            // No rule is a bare verdict: each one matches something first.
            for line in rules.lines().map(str::trim) {
                assert!(!["accept", "masquerade"].contains(&line), "{rules}");
            }
            assert_eq!(imp_links(), Vec::<String>::new(), "{hostile}: nothing left");
        }
    });
}

/// VM `ns/job`'s attachment in place of [`vm`]'s: a warm pool's claimant taking its member's
/// running VM keeps the address and takes its own TAP name and MAC.
fn claimant() -> NetAttachment {
    NetAttachment {
        tap: names::tap("ns", "job"),
        mac: imp_api::network::vm_mac("ns", "job"),
        vm: "ns/job".into(),
        ..vm()
    }
}

#[test]
fn a_running_vms_port_is_handed_to_its_claimant() {
    if !inside("a_running_vms_port_is_handed_to_its_claimant", "rebind") {
        return;
    }
    runtime().block_on(async {
        let net = node("nft");
        net.set_networks(BTreeMap::from([("ns/net".into(), network(None))]));
        net.attach("uid-m", vm()).await.unwrap();
        let (old, new) = (names::tap("ns", "vm"), names::tap("ns", "job"));
        let index = net.netlink().links().await.unwrap()[&old].index;

        // The TAP the VMM holds is renamed (the same interface), its alias, bridge and state
        // rewired, and its port's chain loaded for the new name and MAC only.
        net.rebind("uid-m", claimant()).await.unwrap();
        let links = net.netlink().links().await.unwrap();
        let tap = &links[&new];
        assert_eq!(tap.index, index, "not the same interface");
        assert!(!links.contains_key(&old));
        assert_eq!(tap.alias.as_deref(), Some("ns/job"));
        assert!(tap.up);
        assert_eq!(
            tap.controller,
            links.get(&names::bridge("ns", "net")).map(|b| b.index)
        );
        let table = sh(&["nft", "list", "table", "bridge", "imp"]);
        let mac = imp_api::network::vm_mac("ns", "job");
        assert!(
            table.contains(&format!("chain port-{new}")) && table.contains(&mac),
            "{table}"
        );
        assert!(!table.contains(&format!("port-{old}")), "{table}");
        assert!(
            !table.contains(&imp_api::network::vm_mac("ns", "vm")),
            "{table}"
        );
        // Asked again (an agent that restarted mid-claim): nothing changes.
        net.rebind("uid-m", claimant()).await.unwrap();
        assert_eq!(net.netlink().links().await.unwrap()[&new].index, index);
        net.detach("uid-m").await;
        assert_eq!(imp_links(), Vec::<String>::new());

        // An agent stopped after the claim rewrote the spec but before it renamed the TAP:
        // at its start the TAP is put back under the spec's name, nothing else touched.
        let net = node("nft");
        net.set_networks(BTreeMap::from([("ns/net".into(), network(None))]));
        net.attach("uid-m", vm()).await.unwrap();
        let index = net.netlink().links().await.unwrap()[&old].index;
        let fresh = node("nft");
        assert!(fresh.repair_tap(&claimant(), "ns/vm").await.unwrap());
        let links = fresh.netlink().links().await.unwrap();
        assert_eq!(links[&new].index, index);
        assert!(!links.contains_key(&old));
        assert!(!fresh.repair_tap(&claimant(), "ns/vm").await.unwrap());
        // No TAP of another VM is taken for it.
        let other = NetAttachment {
            tap: names::tap("ns", "other"),
            vm: "ns/other".into(),
            ..vm()
        };
        assert!(!fresh.repair_tap(&other, "ns/nobody").await.unwrap());
        assert!(
            !fresh
                .netlink()
                .links()
                .await
                .unwrap()
                .contains_key(&other.tap)
        );
    });
}
