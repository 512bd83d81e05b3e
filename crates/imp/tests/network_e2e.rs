//! End-to-end networking: two "nodes", each a network namespace joined to the others by veth
//! through a hub namespace, each running a real `imp agent`; the real `imp operator` and
//! a real kube-apiserver (listening on an address inside the test's underlay) in between; real Linux
//! guests under QEMU/TCG. An "outside" namespace stands for the world beyond node a's default
//! route. All traffic stays inside namespaces the test made (and one veth into the hub).
//!
//! Proves: two VMs on one node and two on two nodes (over VXLAN, with cold neighbour caches)
//! ping each other and carry TCP data; NAT reaches the outside and the reply comes back;
//! two networks are isolated, a `connectivity: subnet` group reaches only itself; a guest
//! cannot reach the agent's API on its gateway; a VM's `httpCheck`, made by its node's agent
//! to its address, turns `Ready` False when its server stops and back when it returns, with
//! Events; an agent killed with SIGKILL and restarted
//! keeps connectivity and addresses; a subnet overlapping the node's own network is refused
//! naming both, with no interface made; deleting every VM leaves no interface, forwarding
//! entry, route or nftables table.
//!
//! Needs root, iproute2, nftables and what a guest boot needs (`scripts/setup`): without them
//! it skips on a developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::nodes::{AGENT_API_PORT, Agent, Topology, ready, text};
use common::{phase, wait_vm};

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use imp_api::vm::{ImpVM, VmPhase};
use imp_testenv::registry::{TestImage, scratch_dir};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tokio::process::Command;

const NS: &str = "default";
/// An address in the outside world, beyond node a's default route (TEST-NET-2).
const WORLD: &str = "198.51.100.80";
/// net2's name server (never contacted: only written into its guests' resolv.conf).
const NET2_DNS: &str = "192.0.2.53";

/// Busybox with the network tools; the workload is `$SCRIPT`.
fn image() -> TestImage {
    common::busybox_image(
        &[
            "sh", "echo", "cat", "sleep", "hostname", "ping", "nc", "ip", "grep", "true", "httpd",
            "mkdir", "killall", "arping", "printf",
        ],
        "eval \"$SCRIPT\"",
    )
}

/// Every VM serves TCP on 9000: it answers with its name and keeps what it was sent.
const SERVER: &str =
    "while true; do echo \"pong from $(hostname)\" | nc -l -p 9000 >> /tmp/received; done";

/// a2 also serves HTTP on 8080, which its `httpCheck` GETs.
const WEB: &str = "mkdir -p /www && echo ok > /www/index.html && httpd -p 8080 -h /www";

/// a2's HTTP check: every second, unhealthy after two failures in a row.
fn http_check() -> serde_json::Value {
    json!({"httpCheck": {"enabled": true, "port": 8080, "path": "/index.html",
                         "intervalSeconds": 1, "failureThreshold": 2}})
}

/// Whether `v`'s Ready condition has `status` and `reason`.
fn ready_is(v: &ImpVM, status: &str, reason: &str) -> bool {
    v.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == status && c.reason == reason)
    })
}

fn ip_of(v: &ImpVM) -> String {
    v.status.as_ref().and_then(|s| s.ip.clone()).unwrap()
}

/// `imp exec` into a VM through its agent's API, as the cluster admin (every script here ends
/// within seconds: two minutes means a hang).
async fn exec(kubeconfig: &Path, vm: &str, script: &str) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp"));
    cmd.args(["exec", "-n", NS, vm, "--", "sh", "-c", script])
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null());
    common::output_within(
        cmd,
        Duration::from_secs(120),
        &format!("imp exec {vm} -- {script}"),
    )
    .await
}

/// The guest got what its network says: hostname, address/prefix, default route through the
/// gateway, MTU (underlay minus VXLAN's 50), the MAC derived from its identity, and the
/// network's `dns` in /etc/resolv.conf.
async fn assert_guest_config(kubeconfig: &Path, vm: &str, vm_ip: &str) {
    let out = text(
        &exec(
            kubeconfig,
            vm,
            "hostname; cat /sys/class/net/eth0/mtu /sys/class/net/eth0/address; \
             ip -4 addr show eth0; ip route; cat /etc/resolv.conf",
        )
        .await,
    );
    let gateway = vm_ip
        .rsplit_once('.')
        .map(|(p, _)| format!("{p}.1"))
        .unwrap();
    let mac = imp_api::network::vm_mac(NS, vm);
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(vm), "hostname: {out}");
    assert_eq!(lines.next(), Some("1450"), "MTU: {out}");
    assert_eq!(lines.next(), Some(mac.as_str()), "MAC: {out}");
    for want in [
        format!("inet {vm_ip}/24"),
        format!("default via {gateway}"),
        format!("nameserver {NET2_DNS}"),
    ] {
        assert!(out.contains(&want), "{vm} lacks {want:?}: {out}");
    }
}

/// A network without `dns` gives its guests the node's own (non-loopback) name servers.
async fn assert_node_nameservers(kubeconfig: &Path, vm: &str) {
    let node: Vec<String> = std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("nameserver"))
        .map(|a| a.trim().to_string())
        .filter(|a| {
            a.parse::<std::net::IpAddr>()
                .is_ok_and(|a| !a.is_loopback())
        })
        .collect();
    let guest = text(&exec(kubeconfig, vm, "cat /etc/resolv.conf").await);
    let got: Vec<String> = guest
        .lines()
        .filter_map(|l| l.strip_prefix("nameserver"))
        .map(|a| a.trim().to_string())
        .collect();
    assert_eq!(got, node, "{vm}'s resolv.conf: {guest}");
}

/// The operator's view: group members hold addresses in their group's CIDR, the others
/// outside it, and net1's VTEP table maps each of its VMs to its node's underlay address.
async fn assert_allocations(
    c: &Client,
    ips: &std::collections::BTreeMap<&str, String>,
    topo: &Topology,
) {
    let nets: Api<imp_api::network::ImpNetwork> = Api::namespaced(c.clone(), NS);
    let status = nets.get("net1").await.unwrap().status.unwrap();
    let iso: imp_api::ipv4::Ipv4Cidr = status
        .group_cidrs
        .iter()
        .find(|g| g.name == "iso")
        .map(|g| g.cidr.parse().unwrap())
        .unwrap();
    for (vm, in_group) in [
        ("g1", true),
        ("g2", true),
        ("a1", false),
        ("a2", false),
        ("b1", false),
    ] {
        let addr: Ipv4Addr = ips[vm].parse().unwrap();
        assert_eq!(
            iso.contains(addr),
            in_group,
            "{vm} {addr} against group {iso}"
        );
    }
    let mut table: Vec<(String, String)> = status
        .vtep_table
        .iter()
        .map(|e| (e.vm_ip.clone(), e.node_ip.clone()))
        .collect();
    table.sort();
    let mut want: Vec<(String, String)> = [("a1", 1), ("a2", 1), ("g1", 1), ("b1", 2), ("g2", 2)]
        .iter()
        .map(|(vm, host)| (ips[vm].clone(), topo.underlay(*host).to_string()))
        .collect();
    want.sort();
    assert_eq!(table, want, "net1's VTEP table");
}

/// Asserts `from` reaches `to_ip` by ping and over TCP (its answer names `to`, and `to` kept
/// what `from` sent).
async fn assert_talks(kubeconfig: &Path, from: &str, to: &str, to_ip: &str) {
    let ping = exec(kubeconfig, from, &format!("ping -c 2 -W 5 {to_ip}")).await;
    assert!(
        ping.status.success(),
        "{from} cannot ping {to} ({to_ip}): {}",
        text(&ping)
    );
    let msg = format!("hello {to} from {from}");
    let tcp = exec(
        kubeconfig,
        from,
        &format!("echo '{msg}' | nc -w 5 {to_ip} 9000"),
    )
    .await;
    assert!(
        text(&tcp).contains(&format!("pong from {to}")),
        "{from} → {to} over TCP: {}",
        text(&tcp)
    );
    let got = exec(kubeconfig, to, "cat /tmp/received").await;
    assert!(
        text(&got).contains(&msg),
        "{to} did not keep {msg:?}: {}",
        text(&got)
    );
}

/// Asserts `from` cannot reach `to_ip` at all (ping and TCP both fail).
async fn assert_cut_off(kubeconfig: &Path, from: &str, to_ip: &str, why: &str) {
    let ping = exec(kubeconfig, from, &format!("ping -c 1 -W 2 {to_ip}")).await;
    assert!(
        !ping.status.success(),
        "{why}: {from} pinged {to_ip}: {}",
        text(&ping)
    );
    let tcp = exec(kubeconfig, from, &format!("echo x | nc -w 2 {to_ip} 9000")).await;
    assert!(
        !text(&tcp).contains("pong"),
        "{why}: {from} reached {to_ip}:9000"
    );
}

/// a2's `httpCheck` (from node a's agent to a2's address): Ready while its server answers,
/// `HealthCheckFailed` with a Warning Event naming the GET once it stops, and Ready again with
/// a `HealthCheckRecovered` Event when it is back.
async fn assert_http_check(c: &Client, kubeconfig: &Path, vms: &Api<ImpVM>, a2_ip: &str) {
    wait_vm(vms, "a2", "Ready (its HTTP check passing)", 60, |v| {
        ready_is(v, "True", "Running")
    })
    .await;
    let stop = exec(kubeconfig, "a2", "killall httpd").await;
    assert!(stop.status.success(), "{}", text(&stop));
    let failing = wait_vm(vms, "a2", "HealthCheckFailed", 60, |v| {
        ready_is(v, "False", "HealthCheckFailed")
    })
    .await;
    let cond = failing.status.as_ref().unwrap().conditions.iter();
    let message = cond
        .filter(|c| c.type_ == "Ready")
        .map(|c| c.message.clone())
        .collect::<String>();
    assert!(
        message.contains(&format!("GET {a2_ip}:8080/index.html")) && message.contains("2 times"),
        "{message}"
    );
    let events = common::events_with(c, NS, "a2", &["HealthCheckFailed"]).await;
    assert!(events.iter().any(|e| e.type_.as_deref() == Some("Warning")));
    let start = exec(kubeconfig, "a2", WEB).await;
    assert!(start.status.success(), "{}", text(&start));
    wait_vm(vms, "a2", "Ready again", 60, |v| {
        ready_is(v, "True", "Running")
    })
    .await;
    common::events_with(c, NS, "a2", &["HealthCheckRecovered"]).await;
}

/// Node `node`'s agent's metrics (it listens on the node's loopback).
fn agent_metrics(topo: &Topology, node: &str) -> String {
    let get =
        "exec 3<>/dev/tcp/127.0.0.1/9090; printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3";
    text(&topo.exec(node, &["timeout", "5", "bash", "-c", get]))
}

/// The value of `series` (name and labels, as the agent writes them) in node `node`'s
/// agent's metrics; 0 while it has none.
fn agent_value(topo: &Topology, node: &str, series: &str) -> u64 {
    let prefix = format!("{series} ");
    agent_metrics(topo, node)
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Node `node`'s agent shows `vm`'s network traffic (from its TAP's counters, polled with
/// the guest's figures) once the guest has sent and received.
async fn assert_network_figures(topo: &Topology, node: &str, vm: &str) {
    let gauge = |dir: &str| -> u64 {
        let series = format!(
            "imp_vm_guest_network_{dir}_bytes{{impvm=\"{vm}\",namespace=\"{NS}\",node=\"node-{node}\"}}"
        );
        agent_value(topo, node, &series)
    };
    common::wait_for(
        &format!("{vm}'s network figures"),
        Duration::from_secs(60),
        || {
            let (rx, tx) = (gauge("receive"), gauge("transmit"));
            async move { (rx > 0 && tx > 0).then_some(()) }
        },
    )
    .await;
}

/// What node `node`'s agent counted as dropped at `vm`'s port for `reason`.
fn port_drops(topo: &Topology, node: &str, vm: &str, reason: &str) -> u64 {
    let series = format!(
        "imp_vm_port_dropped_packets_total{{namespace=\"{NS}\",impvm=\"{vm}\",reason=\"{reason}\"}}"
    );
    agent_value(topo, node, &series)
}

/// Waits until node `node`'s agent has counted drops at `vm`'s port for `reason`.
async fn wait_drops(topo: &Topology, node: &str, vm: &str, reason: &str) {
    common::wait_for(
        &format!("{vm}'s port to drop {reason} frames"),
        Duration::from_secs(60),
        || {
            let n = port_drops(topo, node, vm, reason);
            async move { (n > 0).then_some(()) }
        },
    )
    .await;
}

/// Traffic for `victim` (at `ip`) from a VM on another node and from the node itself reaches
/// the victim, and none of it reaches `hostile`: both serve a page on 8081 (the victim's
/// "real", the hostile guest's "fake"), and every GET of the victim's address gets "real".
async fn assert_reaches_victim(kubeconfig: &Path, topo: &Topology, ip: &str, round: &str) {
    let get = format!(
        "exec 3<>/dev/tcp/{ip}/8081; printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' >&3; timeout 5 cat <&3"
    );
    for i in 0..3 {
        let guest = text(
            &exec(
                kubeconfig,
                "b1",
                &format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {ip} 8081"),
            )
            .await,
        );
        assert!(
            guest.contains("real"),
            "{round} {i}: b1 → {ip}:8081 got: {guest}"
        );
        let node = text(&topo.exec("a", &["timeout", "10", "bash", "-c", &get]));
        assert!(
            node.contains("real"),
            "{round} {i}: node a → {ip}:8081 got: {node}"
        );
    }
}

/// A hostile guest (`hostile`, on node a) claims `victim`'s address and the gateway's, by ARP
/// and in IPv4 sources, first with its own MAC and then with the victim's: its port drops
/// every such frame (counted per reason), the victim's traffic from another node and from
/// the node keeps reaching the victim, and the victim still reaches its gateway.
async fn assert_no_impersonation(
    kubeconfig: &Path,
    topo: &Topology,
    (victim, ip): (&str, &str),
    hostile: &str,
    (gateway, elsewhere): (&str, (&str, &str)),
) {
    // The spoofed IPv4 must not wait for ARP (the forged ARP is dropped): the peer's MAC is
    // written into the hostile guest's neighbour table.
    let (elsewhere, elsewhere_mac) = elsewhere;
    let claims = format!(
        "ip addr add {ip}/32 dev eth0; ip addr add {gateway}/32 dev eth0; \
         ip neigh replace {elsewhere} lladdr {elsewhere_mac} nud permanent dev eth0; \
         (while true; do arping -U -c 1 -I eth0 -s {ip} {ip}; arping -U -c 1 -I eth0 -s {gateway} {gateway}; \
         ping -c 1 -W 1 -I {ip} {elsewhere}; sleep 1; done) >/dev/null 2>&1 &"
    );
    let page =
        |what: &str| format!("mkdir -p /w && echo {what} > /w/index.html && httpd -p 8081 -h /w");
    let out = exec(kubeconfig, victim, &page("real")).await;
    assert!(out.status.success(), "{}", text(&out));
    let out = exec(kubeconfig, hostile, &format!("{}; {claims}", page("fake"))).await;
    assert!(out.status.success(), "{}", text(&out));
    wait_drops(topo, "a", hostile, "arp").await;
    wait_drops(topo, "a", hostile, "ip").await;
    assert_reaches_victim(kubeconfig, topo, ip, "own-mac").await;
    // Now with the victim's MAC: the bridge must not learn it on the hostile port.
    let victim_mac = imp_api::network::vm_mac(NS, victim);
    let out = exec(
        kubeconfig,
        hostile,
        &format!("ip link set eth0 address {victim_mac} && cat /sys/class/net/eth0/address"),
    )
    .await;
    assert!(text(&out).contains(&victim_mac), "{}", text(&out));
    wait_drops(topo, "a", hostile, "mac").await;
    assert_reaches_victim(kubeconfig, topo, ip, "victim-mac").await;
    let ping = exec(kubeconfig, victim, &format!("ping -c 2 -W 5 {gateway}")).await;
    assert!(
        ping.status.success(),
        "{victim} → its gateway: {}",
        text(&ping)
    );
    // …through the node's bridge, not through the guest that claims the gateway.
    let neigh = text(&exec(kubeconfig, victim, &format!("ip neigh show {gateway}")).await);
    let hostile_mac = imp_api::network::vm_mac(NS, hostile);
    assert!(
        neigh.contains("lladdr") && !neigh.contains(&hostile_mac) && !neigh.contains(&victim_mac),
        "{victim}'s entry for its gateway: {neigh}"
    );
    // (not_ipv4 is left out: a guest's kernel sends IPv6 router solicitations by itself.)
    for reason in ["mac", "arp", "ip", "dhcp_server"] {
        assert_eq!(
            port_drops(topo, "a", victim, reason),
            0,
            "{victim} {reason}"
        );
    }
}

/// One VXLAN packet for net1 from `from`'s underlay address to node a, carrying a broadcast
/// ARP frame from `mac` (a bridge learns the source of every frame it lets in).
fn forged_vxlan(topo: &Topology, from: Option<&str>, mac: [u8; 6]) {
    let mut packet = vec![0x08, 0, 0, 0];
    packet.extend_from_slice(&imp_api::network::vni(NS, "net1").to_be_bytes()[1..]);
    packet.push(0);
    packet.extend_from_slice(&[0xff; 6]);
    packet.extend_from_slice(&mac);
    packet.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    packet.extend_from_slice(&mac);
    packet.extend_from_slice(&[0; 18]);
    let to = format!("{}", topo.underlay(1));
    match from {
        None => {
            let s = std::net::UdpSocket::bind((topo.underlay(254), 0)).unwrap();
            s.send_to(&packet, (to.as_str(), 4789)).unwrap();
        }
        Some(node) => {
            let hex: String = packet.iter().map(|b| format!("{b:02x}")).collect();
            let py = format!(
                "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(bytes.fromhex('{hex}'), ('{to}', 4789))\n"
            );
            let out = topo.exec(node, &["python3", "-c", &py]);
            assert!(out.status.success(), "{}", text(&out));
        }
    }
}

/// Node a takes net1's VXLAN only from node b (which holds net1's VMs): a frame forged from
/// another underlay address (the host's) never reaches its bridge, one sent from node b's
/// address does, and the drop is counted.
async fn assert_vxlan_only_from_vteps(topo: &Topology) {
    let learned = |mac: &str| text(&topo.exec("a", &["bridge", "fdb", "show"])).contains(mac);
    let foreign = || agent_value(topo, "a", "imp_node_vxlan_foreign_dropped_packets_total");
    let before = foreign();
    forged_vxlan(topo, None, [0x02, 0xde, 0xad, 0, 0, 0x01]);
    common::wait_for(
        "the foreign VXLAN packet counted",
        Duration::from_secs(30),
        || {
            let n = foreign();
            async move { (n > before).then_some(()) }
        },
    )
    .await;
    // Counted, so it has been seen and dropped: its source was never learned.
    assert!(
        !learned("02:de:ad:00:00:01"),
        "a forged VXLAN frame reached node a's bridge"
    );
    // The same frame from node b's address is let in (the check above can see a frame).
    forged_vxlan(topo, Some("b"), [0x02, 0xde, 0xad, 0, 0, 0x02]);
    common::wait_for(
        "node a to learn the frame node b sent",
        Duration::from_secs(10),
        || {
            let seen = learned("02:de:ad:00:00:02");
            async move { seen.then_some(()) }
        },
    )
    .await;
}

/// Whether `from` (a guest) opens a TCP connection to `to` (`host:port`) within 5 s.
async fn guest_connects(kubeconfig: &Path, from: &str, to: &str) -> bool {
    let (host, port) = to.rsplit_once(':').unwrap();
    let out = exec(
        kubeconfig,
        from,
        &format!("echo x | nc -w 5 {host} {port} && echo CONNECTED"),
    )
    .await;
    text(&out).contains("CONNECTED")
}

/// Whether namespace `node` opens a TCP connection to `to` (`host:port`).
fn node_connects(topo: &Topology, node: &str, to: &str) -> bool {
    let (host, port) = to.rsplit_once(':').unwrap();
    let probe = format!("exec 3<>/dev/tcp/{host}/{port}");
    topo.exec(node, &["timeout", "3", "bash", "-c", &probe])
        .status
        .success()
}

/// A token of ServiceAccount `default/name` (made if absent), from the TokenRequest API.
async fn token_of(c: &Client, name: &str) -> String {
    let sas: Api<ServiceAccount> = Api::namespaced(c.clone(), "default");
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    if let Err(e) = sas.create(&PostParams::default(), &sa).await {
        assert!(matches!(&e, kube::Error::Api(s) if s.code == 409), "{e}");
    }
    sas.create_token_request(name, &PostParams::default(), &TokenRequest::default())
        .await
        .unwrap()
        .status
        .unwrap()
        .token
}

/// What node b gets from node a's agent's /metrics across the underlay, with `token` if any:
/// the status line and the body.
fn scrape_from_b(topo: &Topology, token: Option<&str>) -> String {
    let header = token.map_or(String::new(), |t| {
        format!("Authorization: Bearer {t}\\r\\n")
    });
    let get = format!(
        "exec 3<>/dev/tcp/{}/9090; printf 'GET /metrics HTTP/1.0\\r\\n{header}\\r\\n' >&3; cat <&3",
        topo.underlay(1)
    );
    text(&topo.exec("b", &["timeout", "5", "bash", "-c", &get]))
}

/// Issue 38, item 9: an agent's /metrics (VM names, namespaces, guests' figures) answers a
/// caller on another machine only with a token the API server authenticates and allows
/// `get /metrics` (ClusterRole imp-metrics-reader, as the chart binds a Prometheus); the node
/// itself reads it without one (agent_value), and the health routes answer anyone.
async fn assert_metrics_guarded(kube: &common::Cluster, topo: &Topology) {
    let c = &kube.client;
    imp_testenv::rbac::install_user_roles(c).await.unwrap();
    imp_testenv::rbac::bind(c, "imp-metrics-reader", "default", "prom")
        .await
        .unwrap();
    let (prom, stranger) = (token_of(c, "prom").await, token_of(c, "stranger").await);
    let anonymous = scrape_from_b(topo, None);
    assert!(anonymous.starts_with("HTTP/1.0 401"), "{anonymous}");
    assert!(!anonymous.contains("imp_vm"), "{anonymous}");
    let refused = scrape_from_b(topo, Some(&stranger));
    assert!(refused.starts_with("HTTP/1.0 403"), "{refused}");
    assert!(
        refused.contains("system:serviceaccount:default:stranger may not get /metrics")
            && refused.contains("imp-metrics-reader"),
        "{refused}"
    );
    let forged = scrape_from_b(topo, Some("not-a-token"));
    assert!(forged.starts_with("HTTP/1.0 401"), "{forged}");
    let served = scrape_from_b(topo, Some(&prom));
    assert!(served.starts_with("HTTP/1.0 200"), "{served}");
    assert!(
        served.contains("imp_node_guest_egress_denied_packets_total"),
        "{served}"
    );
    let probe = format!(
        "exec 3<>/dev/tcp/{}/9090; printf 'GET /readyz HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3",
        topo.underlay(1)
    );
    let ready = text(&topo.exec("b", &["timeout", "5", "bash", "-c", &probe]));
    assert!(ready.starts_with("HTTP/1.0 200"), "{ready}");
}

/// The API server's endpoint the test publishes in EndpointSlice `default/kubernetes`: in the
/// outside world, past NAT.
const API_ENDPOINT_BEYOND_NAT: &str = "198.51.100.30:80";

/// Guests' egress: with NAT they reach the outside and what their network allows, never the
/// metadata address, a range the agents deny, another node, the API server or the endpoints
/// behind it; the nodes
/// themselves reach all of it (so each refusal is the rules', not a missing route or server).
async fn assert_egress_policy(kubeconfig: &Path, topo: &Topology, api: &str) {
    // One server in the outside world, on the metadata address, a denied range and an
    // address net1 allows; node a's default route leads there.
    for a in [
        "169.254.169.254/32",
        "203.0.113.10/32",
        "203.0.113.20/32",
        "198.51.100.30/32",
    ] {
        topo.exec("out", &["ip", "addr", "add", a, "dev", "eth0"]);
    }
    let server = "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0',80))\ns.listen()\nwhile True:\n c,a=s.accept()\n c.sendall(b'out\\n')\n c.close()\n";
    let _server = Command::new("ip")
        .args(["netns", "exec", &topo.ns("out"), "python3", "-c", server])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    common::wait_for("the metadata stand-in", Duration::from_secs(30), || {
        let up = node_connects(topo, "a", "169.254.169.254:80");
        async move { up.then_some(()) }
    })
    .await;
    for (to, allowed) in [
        ("203.0.113.20:80", true),
        ("169.254.169.254:80", false),
        ("203.0.113.10:80", false),
        // The API server's endpoint behind its Service (EndpointSlice default/kubernetes).
        (API_ENDPOINT_BEYOND_NAT, false),
    ] {
        assert!(node_connects(topo, "a", to), "node a → {to}");
        assert_eq!(
            guest_connects(kubeconfig, "a1", to).await,
            allowed,
            "a1 → {to}"
        );
    }
    // net2 masquerades out of node b's underlay: the node's neighbours are in reach of its
    // routes, and only the rules keep b2 from node a's agent and from the API server.
    let agent_a = format!("{}:{AGENT_API_PORT}", topo.underlay(1));
    for to in [agent_a.as_str(), api] {
        assert!(node_connects(topo, "b", to), "node b → {to}");
        assert!(
            !guest_connects(kubeconfig, "b2", to).await,
            "b2 reached {to}"
        );
    }
    for node in ["a", "b"] {
        common::wait_for(
            &format!("node {node} to count denied egress"),
            Duration::from_secs(30),
            || {
                let n = agent_value(topo, node, "imp_node_guest_egress_denied_packets_total");
                async move { (n > 0).then_some(()) }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vms_talk_within_their_network_across_nodes_and_out_through_nat_and_nowhere_else() {
    let _run = common::test_run("network_e2e", Duration::from_secs(600));
    if ready().is_none() {
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let topo = Topology::create();
    let kube = common::nodes::cluster(&topo).await;
    let c = kube.client.clone();
    // `imp exec -n` as a person would run it: a token user allowed to exec in the namespace.
    let (kubeconfig, _) = common::exec_users(&kube, NS).await;
    common::small_class(&c, 128).await;
    let (net1, net2, clash) = (topo.subnet(214), topo.subnet(215), topo.subnet(213));
    for (name, spec) in [
        (
            "net1",
            json!({"subnet": net1, "nat": {"enabled": true},
            "egress": {"allow": ["203.0.113.20/32"]},
            "groups": [{"name": "iso", "connectivity": "subnet", "expectedSize": 6}]}),
        ),
        // NAT out of node b's underlay turns forwarding on for net2's bridge there, so only
        // the rules keep net2 from net1 on node b.
        (
            "net2",
            json!({"subnet": net2, "nat": {"enabled": true, "egressInterface": "eth0"},
                   "dns": [NET2_DNS]}),
        ),
        ("clash", json!({"subnet": clash})),
    ] {
        common::create_imp(
            &c,
            "ImpNetwork",
            "impnetworks",
            json!({
                "apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
                "metadata": {"name": name, "namespace": NS}, "spec": spec
            }),
        )
        .await;
    }
    let layout = scratch_dir("imp-net-e2e-layout").unwrap();
    image().write_layout(&layout, "1").unwrap();
    let image = format!("oci:{}:1", layout.display());
    let cache = scratch_dir("imp-net-e2e-cache").unwrap();

    let _operator = common::start_operator(&kube);
    // The API server's endpoints as a managed control plane publishes them: an address beyond
    // NAT, not on any node network nor in --egress-deny (this control plane runs no endpoint
    // reconciler, so the slice is the test's). Guests must not reach it any more than the
    // Service address.
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [API_ENDPOINT_BEYOND_NAT.split(':').next().unwrap()]}],
        "ports": [{"name": "https", "port": 80, "protocol": "TCP"}],
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(c.clone(), "default")
        .create(&PostParams::default(), &slice)
        .await
        .unwrap();
    let mut a = Agent::new(&topo, "a", topo.underlay(1));
    let mut b = Agent::new(&topo, "b", topo.underlay(2));
    // The cluster's ranges, as an admin would give them (here: one the outside serves).
    for agent in [&mut a, &mut b] {
        agent.extra_args = vec!["--egress-deny".into(), "203.0.113.0/24".into()];
    }
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    b.start(&kube.agent_kubeconfig_for(&b.node).await, &cache);

    let vms: Api<ImpVM> = Api::namespaced(c.clone(), NS);
    let vm = |node: &str, network: &str, group: Option<&str>| {
        let mut spec = json!({"classRef": {"name": "small"}, "image": image, "nodeName": node,
            "lifecycle": "persistent", "networkRef": {"name": network},
            "env": [{"name": "SCRIPT", "value": SERVER}]});
        if let Some(g) = group {
            spec["networkGroup"] = json!(g);
        }
        spec
    };
    let mut plan = [
        ("a1", vm("node-a", "net1", None)),
        ("a2", vm("node-a", "net1", None)),
        ("g1", vm("node-a", "net1", Some("iso"))),
        ("b1", vm("node-b", "net1", None)),
        ("b2", vm("node-b", "net2", None)),
        ("g2", vm("node-b", "net1", Some("iso"))),
    ];
    plan[1].1["env"] = json!([{"name": "SCRIPT", "value": format!("{WEB}; {SERVER}")}]);
    plan[1].1["probes"] = http_check();
    for (name, spec) in &plan {
        let obj: ImpVM = serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": name, "namespace": NS}, "spec": spec
        }))
        .unwrap();
        vms.create(&PostParams::default(), &obj).await.unwrap();
    }
    let mut ips = std::collections::BTreeMap::new();
    for (name, _) in &plan {
        let v = wait_vm(&vms, name, "Running", 240, |v| {
            phase(v) == Some(VmPhase::Running)
        })
        .await;
        ips.insert(*name, ip_of(&v));
    }
    let ip = |n: &str| ips[n].clone();
    assert_guest_config(&kubeconfig, "b2", &ip("b2")).await;
    assert_node_nameservers(&kubeconfig, "a1").await;
    assert_allocations(&c, &ips, &topo).await;

    // Same node, then across nodes over VXLAN: the guests' neighbour caches are cold.
    assert_talks(&kubeconfig, "a2", "a1", &ip("a1")).await;
    assert_talks(&kubeconfig, "b1", "a1", &ip("a1")).await;
    assert_talks(&kubeconfig, "a1", "b1", &ip("b1")).await;
    // The group reaches itself across nodes and nothing else of its network.
    assert_talks(&kubeconfig, "g1", "g2", &ip("g2")).await;
    assert_cut_off(&kubeconfig, "g1", &ip("a1"), "isolated group, same node").await;
    assert_cut_off(&kubeconfig, "g2", &ip("b1"), "isolated group, same node b").await;
    assert_cut_off(&kubeconfig, "a1", &ip("g2"), "into the isolated group").await;
    // Networks are isolated from each other, on one node and across nodes.
    assert_cut_off(&kubeconfig, "b2", &ip("b1"), "other network, same node").await;
    assert_cut_off(&kubeconfig, "b2", &ip("a1"), "other network, other node").await;
    assert_cut_off(&kubeconfig, "b1", &ip("b2"), "other network, same node").await;

    // NAT: a1 reaches a server outside, beyond node a's default route (its own link's
    // neighbours are denied to guests, as every network of the node is); the outside has no
    // route to the VM's subnet, so the reply comes back only through masquerading, and the
    // server sees node a's address.
    topo.exec(
        "out",
        &["ip", "addr", "add", &format!("{WORLD}/32"), "dev", "eth0"],
    );
    let server = format!(
        "import socket\ns=socket.socket()\ns.bind(('{WORLD}',8080))\ns.listen()\nwhile True:\n c,a=s.accept()\n c.sendall(('you are %s\\n'%a[0]).encode())\n c.close()\n",
    );
    let _outside = Command::new("ip")
        .args(["netns", "exec", &topo.ns("out"), "python3", "-c", &server])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Wait until it listens (python can take a second to start on a loaded machine).
    let listening = format!("exec 3<>/dev/tcp/{WORLD}/8080");
    common::wait_for("the outside server", Duration::from_secs(30), || {
        let up = topo
            .exec("out", &["timeout", "2", "bash", "-c", &listening])
            .status
            .success();
        async move { up.then_some(()) }
    })
    .await;
    let nat = exec(
        &kubeconfig,
        "a1",
        &format!("nc -w 5 {WORLD} 8080 </dev/null"),
    )
    .await;
    assert!(
        text(&nat).contains(&format!("you are {}", topo.outside(1))),
        "NAT: {}",
        text(&nat)
    );

    let api = kube.cp.url().trim_start_matches("https://").to_owned();
    assert_egress_policy(&kubeconfig, &topo, &api).await;
    assert_metrics_guarded(&kube, &topo).await;

    // The guest cannot reach the agent's API on its node through its gateway.
    let gateway = ips["a1"]
        .rsplit_once('.')
        .map(|(p, _)| format!("{p}.1"))
        .unwrap();
    let api = exec(
        &kubeconfig,
        "a1",
        &format!("echo x | nc -w 2 {gateway} {AGENT_API_PORT} && echo CONNECTED"),
    )
    .await;
    assert!(
        !text(&api).contains("CONNECTED"),
        "a guest reached the agent API: {}",
        text(&api)
    );
    // The API does listen there: the node itself connects.
    let probe = format!("exec 3<>/dev/tcp/{gateway}/{AGENT_API_PORT}");
    let from_node = topo.exec("a", &["timeout", "3", "bash", "-c", &probe]);
    assert!(
        from_node.status.success(),
        "the node cannot reach its agent API: {}",
        text(&from_node)
    );

    assert_http_check(&c, &kubeconfig, &vms, &ip("a2")).await;

    // A subnet that overlaps the node's own network is refused, naming both; nothing is made.
    let before = topo.imp_links("a");
    vms.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "bad", "namespace": NS}, "spec": vm("node-a", "clash", None)
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let bad = wait_vm(&vms, "bad", "NetworkSetupFailed", 240, |v| {
        v.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.reason == "NetworkSetupFailed")
        })
    })
    .await;
    let msg = bad
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.reason == "NetworkSetupFailed")
        .unwrap()
        .message;
    assert!(
        msg.contains(&clash) && msg.contains(&format!("{}/24 on eth0", topo.underlay(1))),
        "{msg}"
    );
    assert_eq!(
        topo.imp_links("a"),
        before,
        "an interface was made for the refused network"
    );
    vms.delete("bad", &DeleteParams::default()).await.unwrap();

    // The agent of node a dies by SIGKILL and comes back: nothing moves, everything talks.
    let taps_before = topo.imp_links("a");
    a.kill().await;
    a.start(&kube.agent_kubeconfig_for(&a.node).await, &cache);
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (name, _) in &plan {
        let v = vms.get(name).await.unwrap();
        assert_eq!(ip_of(&v), ips[name], "{name}'s address changed");
        assert_eq!(phase(&v), Some(VmPhase::Running), "{name}");
    }
    assert_eq!(topo.imp_links("a"), taps_before);
    assert_talks(&kubeconfig, "b1", "a2", &ip("a2")).await;
    assert_talks(&kubeconfig, "a2", "b1", &ip("b1")).await;

    // A VM that takes over a freed address is found at once. a2 goes; a3 gets its address
    // (the lowest free one) with a MAC of its own, and announces it as its interface comes
    // up. b1, which has just talked to a2 and still holds a2's MAC for the address, learns
    // a3's from the announcement instead of sending into the void until its entry expires.
    vms.delete("a2", &DeleteParams::default()).await.unwrap();
    common::wait_vm_gone(&vms, "a2", 90).await;
    let a3: ImpVM = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
        "metadata": {"name": "a3", "namespace": NS}, "spec": vm("node-a", "net1", None)
    }))
    .unwrap();
    vms.create(&PostParams::default(), &a3).await.unwrap();
    let a3 = wait_vm(&vms, "a3", "Running", 240, |v| {
        phase(v) == Some(VmPhase::Running)
    })
    .await;
    assert_eq!(ip_of(&a3), ip("a2"), "a3 takes the address a2 freed");
    let neigh = text(&exec(&kubeconfig, "b1", &format!("ip neigh show {}", ip("a2"))).await);
    let (old_mac, new_mac) = (
        imp_api::network::vm_mac(NS, "a2"),
        imp_api::network::vm_mac(NS, "a3"),
    );
    assert!(
        neigh.contains(&new_mac) && !neigh.contains(&old_mac),
        "b1's entry for the reused address names a3's MAC {new_mac} (a2's was {old_mac}): {neigh}"
    );
    assert_talks(&kubeconfig, "b1", "a3", &ip("a2")).await;

    assert_network_figures(&topo, "a", "a1").await;

    // a1 turns hostile and claims a3's address and the gateway's.
    assert_no_impersonation(
        &kubeconfig,
        &topo,
        ("a3", &ip("a2")),
        "a1",
        (&gateway, (&ip("b1"), &imp_api::network::vm_mac(NS, "b1"))),
    )
    .await;
    assert_vxlan_only_from_vteps(&topo).await;

    // Everything goes: no interface, forwarding entry, route or table is left behind.
    for name in ["a1", "a3", "g1", "b1", "b2", "g2"] {
        vms.delete(name, &DeleteParams::default()).await.unwrap();
    }
    common::wait_for("every VM gone", Duration::from_secs(90), || {
        let vms = vms.clone();
        async move {
            vms.list(&Default::default())
                .await
                .unwrap()
                .items
                .is_empty()
                .then_some(())
        }
    })
    .await;
    for node in ["a", "b"] {
        common::wait_for(
            &format!("node {node} clean"),
            Duration::from_secs(30),
            || {
                let left = topo.imp_links(node);
                async move { left.is_empty().then_some(()) }
            },
        )
        .await;
        let tables = text(&topo.exec(node, &["nft", "list", "tables"]));
        assert!(!tables.contains("imp"), "node {node} keeps {tables}");
        let routes = text(&topo.exec(node, &["ip", "route"]));
        assert!(
            !routes.contains(&format!("10.214.{}", topo.octet)),
            "node {node}: {routes}"
        );
        assert!(
            !routes.contains(&format!("10.215.{}", topo.octet)),
            "node {node}: {routes}"
        );
        let fdb = text(&topo.exec(node, &["bridge", "fdb", "show"]));
        assert!(!fdb.contains("impvx"), "node {node}: {fdb}");
    }
    let _ = std::fs::remove_dir_all(&layout);
    let _ = std::fs::remove_dir_all(&cache);
}
