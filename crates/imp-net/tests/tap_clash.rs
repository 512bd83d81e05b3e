//! A TAP name two VMs share, on a real kernel: in a network namespace of its own the test makes
//! the TAP one VM's (its alias names the VM, as the agent sets it), then asks [`NodeNet`] to
//! wire another VM whose attachment names the same TAP (a forced hash collision). The second
//! VM is refused, naming both, and the TAP stays as it was: not moved, not renamed.
//!
//! The test runs itself again under `unshare --net`. Needs root, `ip` and `unshare`: without
//! them it skips on a developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_testenv::command::sh;
use std::net::Ipv4Addr;
use std::process::Command;

use imp_net::{NetAttachment, NetSettings, NodeNet, names, tap};

const MARK: &str = "IMP_TAP_CLASH_INSIDE";
const TAP: &str = "imptap-0badf00d";

/// True inside the test's own namespace; false outside, after the copy inside has run (or when
/// the machine cannot run it).
fn inside(test: &str) -> bool {
    if std::env::var(MARK).is_ok() {
        return true;
    }
    let root = imp_testenv::guard::is_root();
    let tools = ["ip", "unshare"]
        .iter()
        .all(|t| imp_testenv::guard::which(t).is_some());
    let tun = std::path::Path::new("/dev/net/tun").exists();
    if !imp_testenv::guard::require(root, "root for a network namespace")
        || !imp_testenv::guard::require(tools, "ip and unshare")
        || !imp_testenv::guard::require(tun, "/dev/net/tun")
    {
        return false;
    }
    let mut child = Command::new("unshare");
    child
        .arg("--net")
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(MARK, "1");
    // Fails unless the child ran exactly this one test and it passed (a renamed test would
    // match nothing there and exit 0).
    imp_testenv::rerun::one_test(child, test);
    false
}

fn attachment(vm: &str) -> NetAttachment {
    NetAttachment {
        network: "team-b/net".into(),
        bridge: names::bridge("team-b", "net"),
        tap: TAP.into(),
        mac: "02:00:00:00:00:02".into(),
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

#[test]
fn a_tap_made_for_another_vm_is_not_taken_over() {
    if !inside("a_tap_made_for_another_vm_is_not_taken_over") {
        return;
    }
    sh(&["ip", "link", "set", "lo", "up"]);
    sh(&["ip", "link", "add", "victimbr", "type", "bridge"]);
    tap::create_persistent(TAP).unwrap();
    sh(&["ip", "link", "set", TAP, "master", "victimbr", "up"]);
    sh(&["ip", "link", "set", TAP, "alias", "team-a/db"]);
    let before = sh(&["ip", "-o", "link", "show", TAP]);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let net = NodeNet::new(NetSettings {
            vtep: None,
            vxlan_port: 4789,
            nft: "/nonexistent/nft".into(),
            egress_deny: Vec::new(),
            api_servers: Vec::new(),
        })
        .unwrap();
        let links = net.netlink().links().await.unwrap();
        assert_eq!(links[TAP].alias.as_deref(), Some("team-a/db"));
        let why = net
            .attach("uid-b", attachment("team-b/web"))
            .await
            .unwrap_err();
        for needle in [TAP, "team-a/db", "team-b/web", "not taken over"] {
            assert!(why.contains(needle), "{needle}: {why}");
        }
    });
    assert_eq!(
        sh(&["ip", "-o", "link", "show", TAP]),
        before,
        "the TAP was changed"
    );
}
