//! Node networking figures, in a network namespace of its own: time to wire one VM's network
//! (TAP, bridge, VXLAN, forwarding entries, rules), time to sync 1,000 forwarding entries
//! (first, unchanged, and after 100 VMs moved), and time to unwire everything.
//!
//! Needs root, iproute2 and nftables; skips without them on a developer machine and fails under
//! `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use imp_api::network::{ImpNetwork, ImpNetworkSpec};
use imp_net::plan::{Mac, NetworkView};
use imp_net::view;
use imp_net::{NetSettings, NodeNet};

const MARK: &str = "IMP_BENCH_NET_INSIDE";

fn main() {
    let root = imp_testenv::guard::is_root();
    let tools = imp_testenv::guard::which("ip").is_some()
        && imp_testenv::guard::which("nft").is_some()
        && imp_testenv::guard::which("nsenter").is_some();
    if !imp_testenv::guard::require(root, "root")
        || !imp_testenv::guard::require(tools, "ip, nft and nsenter")
    {
        return;
    }
    if std::env::var_os(MARK).is_none() {
        outside();
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(inside());
    }
}

/// Makes a namespace and runs this benchmark again inside it.
fn outside() {
    let ns = format!("impbench-{}", std::process::id());
    let ok = std::process::Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .unwrap()
        .success();
    assert!(ok, "ip netns add {ns}");
    let status = std::process::Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{ns}"))
        .arg(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .env(MARK, "1")
        .status();
    let _ = std::process::Command::new("ip")
        .args(["netns", "del", &ns])
        .status();
    assert!(status.unwrap().success(), "the benchmark failed in {ns}");
}

fn sh(args: &[&str]) {
    let ok = std::process::Command::new(args[0])
        .args(&args[1..])
        .status()
        .unwrap()
        .success();
    assert!(ok, "{args:?}");
}

fn network() -> ImpNetwork {
    let mut n = ImpNetwork::new(
        "bench",
        ImpNetworkSpec {
            subnet: "10.98.0.0/16".into(),
            ..Default::default()
        },
    );
    n.metadata.namespace = Some("default".into());
    n
}

/// The network's view with `remote` VMs spread over 10 other nodes (node offset `shift`).
fn view_with(remote: u32, shift: u32) -> NetworkView {
    let mut v = view::network_view(&network()).unwrap();
    v.vteps = (0..remote)
        .map(|i| {
            let b = i.to_be_bytes();
            let mac = Mac([0x02, 0xbe, b[0], b[1], b[2], b[3]]);
            let node = Ipv4Addr::new(10, 99, 0, 10 + u8::try_from((i + shift) % 10).unwrap());
            (mac, node)
        })
        .collect();
    v
}

/// Forwarding entries with a remote destination, as `bridge fdb` lists them.
fn remote_entries() -> usize {
    let out = std::process::Command::new("bridge")
        .args(["fdb", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(" dst "))
        .count()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn inside() {
    sh(&["ip", "link", "set", "lo", "up"]);
    // The underlay: a veth pair (no dummy driver on every kernel).
    sh(&[
        "ip", "link", "add", "ul0", "type", "veth", "peer", "name", "ul1",
    ]);
    sh(&["ip", "link", "set", "ul1", "up"]);
    sh(&["ip", "addr", "add", "10.99.0.1/24", "dev", "ul0"]);
    sh(&["ip", "link", "set", "ul0", "up"]);
    let net = NodeNet::new(NetSettings {
        vtep: Some(Ipv4Addr::new(10, 99, 0, 1)),
        vxlan_port: 4789,
        nft: "nft".into(),
        egress_deny: Vec::new(),
        api_servers: Vec::new(),
    })
    .unwrap();
    net.set_networks(BTreeMap::from([(
        "default/bench".to_owned(),
        view_with(1, 0),
    )]));

    let vms = 20;
    let mut wire = Vec::new();
    for i in 0..vms {
        let name = format!("vm-{i}");
        let a = view::attachment(
            "default",
            &name,
            &network(),
            &format!("10.98.1.{}", i + 2),
            1450,
            &[],
        )
        .unwrap();
        let t = Instant::now();
        net.attach(&name, a).await.unwrap();
        wire.push(t.elapsed());
    }
    let first = wire[0];
    let rest: Duration = wire[1..].iter().sum::<Duration>() / (vms - 1);
    imp_testenv::figures::figure("net: wiring the first VM", ms(first), "ms", "");
    imp_testenv::figures::figure("net: wiring each further VM", ms(rest), "ms", "mean");
    println!(
        "net: wiring the first VM (bridge, VXLAN, TAP, entries, rules): {:.1} ms; each further VM: {:.1} ms (mean of {})",
        ms(first),
        ms(rest),
        vms - 1
    );

    net.set_networks(BTreeMap::from([(
        "default/bench".to_owned(),
        view_with(1000, 0),
    )]));
    let t = Instant::now();
    net.sync().await.unwrap();
    let add = t.elapsed();
    let entries = remote_entries();
    assert_eq!(
        entries,
        1000 + 10,
        "entries for 1,000 VMs and a flood entry per node"
    );
    let t = Instant::now();
    net.sync().await.unwrap();
    let same = t.elapsed();
    // 100 VMs move to another node: their entries change destination.
    let mut moved = view_with(1000, 0);
    for (i, v) in moved.vteps.iter_mut().take(100).enumerate() {
        v.1 = Ipv4Addr::new(10, 99, 0, 30 + u8::try_from(i % 5).unwrap());
    }
    net.set_networks(BTreeMap::from([("default/bench".to_owned(), moved)]));
    let t = Instant::now();
    net.sync().await.unwrap();
    let moved = t.elapsed();
    println!(
        "net: FDB sync of 1,000 remote VMs on 10 nodes: {:.0} ms to add, {:.1} ms when unchanged, {:.0} ms after 100 moved (ratio unchanged/add {:.3})",
        ms(add),
        ms(same),
        ms(moved),
        same.as_secs_f64() / add.as_secs_f64()
    );

    let t = Instant::now();
    for i in 0..vms {
        net.detach(&format!("vm-{i}")).await;
    }
    println!(
        "net: unwiring {vms} VMs and the network (last one removes bridge, VXLAN, rules): {:.0} ms",
        ms(t.elapsed())
    );
}
