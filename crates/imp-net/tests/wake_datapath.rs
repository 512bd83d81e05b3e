//! Wake on traffic, the datapath, with no guest: in a network namespace of its own (a "node")
//! the test makes a bridge with a gateway address, a persistent TAP on it held by a
//! [`Sleeper`] for a sleeping "VM", and a client namespace joined to the bridge by a veth with
//! an empty neighbour cache. It proves that:
//! - a client's TCP connect gets an ARP answer with the VM's MAC, wakes the sleeper with the
//!   SYN held; after the hand-over the test plays the VMM on the still-open TAP fd, and
//!   [`inject`] delivers that exact SYN to it; the TAP's kernel counters agree;
//! - ARP and IPv4 for other addresses, and IPv4 for the VM's MAC but another address, do not
//!   wake it; a flood of datagrams for the VM is held up to the bound and the rest counted;
//! - a packet from the node itself (the bridge's gateway address) wakes it too;
//! - a frame sent while the VMM suspends waits in the TAP when a duplicate of the VMM's
//!   descriptor was kept, and wakes the sleeper that adopts it (and is lost without one).
//!
//! Each test runs itself again inside a fresh namespace (`nsenter --net`, plus a private mount
//! namespace with sysfs mounted again so that `/sys/class/net` shows that namespace), then
//! removes it. Needs root, iproute2, nsenter, unshare and bash: without them it skips on a
//! developer machine and fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_testenv::command::sh;
use std::fs::File;
use std::io::Read;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::process::Command;
use std::time::{Duration, Instant};

use imp_net::plan::Mac;
use imp_net::sleeper::{Release, Sleeper, inject};
use imp_net::tap;
use imp_net::wake::{DropReason, HoldBounds, SleepingVm};

const MARK: &str = "IMP_WAKE_TEST_INSIDE";
/// The outer test process's id, which names the namespaces.
const ID: &str = "IMP_WAKE_TEST_ID";
const BRIDGE: &str = "wkbr";
const TAP: &str = "wktap";
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 9);
const VM: SleepingVm = SleepingVm {
    ip: Ipv4Addr::new(10, 77, 0, 5),
    mac: Mac([0x02, 0, 0, 0x77, 0, 5]),
};
const WAIT: Duration = Duration::from_secs(10);

/// True inside the test's own namespace (run the test); false outside, after the copy of the
/// test inside has run (or when the machine cannot run it).
fn inside(test: &str, tag: &str) -> bool {
    if std::env::var(MARK).is_ok_and(|m| m == tag) {
        return true;
    }
    let root = imp_testenv::guard::is_root();
    let tools = ["ip", "nsenter", "unshare", "bash"]
        .iter()
        .all(|t| imp_testenv::guard::which(t).is_some());
    let tun = std::path::Path::new("/dev/net/tun").exists();
    if !imp_testenv::guard::require(root, "root for network namespaces")
        || !imp_testenv::guard::require(tools, "ip, nsenter, unshare and bash")
        || !imp_testenv::guard::require(tun, "/dev/net/tun")
    {
        return false;
    }
    let node = node_ns(tag);
    sh(&["ip", "netns", "add", &node]);
    let mut child = Command::new("nsenter");
    child
        .arg(format!("--net=/var/run/netns/{node}"))
        .args(["unshare", "--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t sysfs sysfs /sys && exec "$0" "$@""#)
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(MARK, tag)
        .env(ID, id().to_string());
    // Fails unless the child ran exactly this one test and it passed (a renamed test would
    // match nothing there and exit 0); the namespaces go first either way.
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        imp_testenv::rerun::one_test(child, test)
    }));
    let _ = Command::new("ip")
        .args(["netns", "del", &client_ns(tag)])
        .output();
    let _ = Command::new("ip").args(["netns", "del", &node]).output();
    if let Err(panic) = ran {
        std::panic::resume_unwind(panic);
    }
    false
}

fn id() -> u32 {
    std::env::var(ID)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(std::process::id)
}

fn node_ns(tag: &str) -> String {
    format!("wk{}{tag}", id())
}

fn client_ns(tag: &str) -> String {
    format!("wk{}{tag}c", id())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn no_ipv6() {
    // Per namespace: keeps router solicitations and MLD reports off the bridge.
    for f in ["all", "default"] {
        std::fs::write(format!("/proc/sys/net/ipv6/conf/{f}/disable_ipv6"), "1").unwrap();
    }
}

/// The node: a bridge with the gateway address and the VM's persistent TAP on it.
fn node() {
    sh(&["ip", "link", "set", "lo", "up"]);
    no_ipv6();
    sh(&["ip", "link", "add", BRIDGE, "type", "bridge"]);
    sh(&["ip", "addr", "add", &format!("{GATEWAY}/24"), "dev", BRIDGE]);
    sh(&["ip", "link", "set", BRIDGE, "up"]);
    tap::create_persistent(TAP).unwrap();
    sh(&["ip", "link", "set", TAP, "master", BRIDGE, "up"]);
}

/// A client namespace on the bridge (veth), its neighbour cache empty; removed on drop.
struct Client(String);

impl Client {
    fn new(tag: &str) -> Client {
        let ns = client_ns(tag);
        sh(&["ip", "netns", "add", &ns]);
        let c = Client(ns);
        c.run(&["sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"]);
        sh(&[
            "ip", "link", "add", "wkv", "type", "veth", "peer", "name", "eth0", "netns", &c.0,
        ]);
        sh(&["ip", "link", "set", "wkv", "master", BRIDGE, "up"]);
        sh(&["ip", "-n", &c.0, "link", "set", "lo", "up"]);
        sh(&[
            "ip",
            "-n",
            &c.0,
            "addr",
            "add",
            &format!("{CLIENT}/24"),
            "dev",
            "eth0",
        ]);
        sh(&["ip", "-n", &c.0, "link", "set", "eth0", "up"]);
        assert_eq!(
            sh(&["ip", "-n", &c.0, "neigh", "show"]).trim(),
            "",
            "the client's neighbour cache starts empty"
        );
        c
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/var/run/netns/{}", self.0)).args(args);
        c
    }

    fn run(&self, args: &[&str]) -> String {
        let out = self.command(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?} in {}: {}",
            self.0,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs a bash script in the client namespace, in the background.
    fn spawn(&self, script: &str) -> tokio::process::Child {
        tokio::process::Command::from(self.command(&["bash", "-c", script]))
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    }

    fn neighbour(&self, ip: Ipv4Addr) -> String {
        sh(&["ip", "-n", &self.0, "neigh", "show", &ip.to_string()])
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// Whether `frame` is a TCP SYN from the client to the VM's port `port`.
fn is_syn(frame: &[u8], port: u16) -> bool {
    let ip = &frame[14..];
    let tcp = &ip[usize::from(ip[0] & 0x0f) * 4..];
    frame[12..14] == [0x08, 0x00]
        && ip[9] == 6
        && ip[12..16] == CLIENT.octets()
        && ip[16..20] == VM.ip.octets()
        && u16::from_be_bytes([tcp[2], tcp[3]]) == port
        && tcp[13] & 0x12 == 0x02
}

/// Plays the VMM: reads the TAP until `want` comes out of it, or the deadline.
async fn vmm_reads(tap: OwnedFd, want: Vec<u8>) -> (bool, usize) {
    let file = File::from(tap);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; 65_600];
        let end = Instant::now() + WAIT;
        let mut seen = 0;
        while Instant::now() < end {
            match (&file).read(&mut buf) {
                Ok(n) if buf[..n] == want[..] => return (true, seen + 1),
                Ok(_) => seen += 1,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => panic!("reading the TAP as its VMM: {e}"),
            }
        }
        (false, seen)
    })
    .await
    .unwrap()
}

/// Waits until the bridge forwards to the TAP again: after a holder attaches, the port comes
/// back only when the kernel's link watcher has seen the carrier (up to about a second).
async fn forwarding() {
    let state = format!("/sys/class/net/{TAP}/brport/state");
    until("the TAP's bridge port to forward", || {
        std::fs::read_to_string(&state).is_ok_and(|s| s.trim() == "3")
    })
    .await;
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_cold_client_gets_arp_wakes_the_vm_and_its_syn_is_delivered() {
    if !inside(
        "a_cold_client_gets_arp_wakes_the_vm_and_its_syn_is_delivered",
        "cold",
    ) {
        return;
    }
    node();
    let client = Client::new("cold");
    runtime().block_on(async {
        let sleeper = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
        forwarding().await;
        let rx_before = counters_of(TAP).await.rx_packets;
        let started = Instant::now();
        let mut connect = client.spawn(&format!("exec 3<>/dev/tcp/{}/8080", VM.ip));
        let woken = tokio::time::timeout(WAIT, sleeper.woken())
            .await
            .expect("no wake within 10 s")
            .unwrap();
        eprintln!("woke {:?} after the connect started", started.elapsed());
        // Stop the client before its SYN retransmission (1 s) so only the first SYN is held.
        connect.kill().await.unwrap();
        assert_eq!((woken.source, woken.protocol), (CLIENT, 6));

        let neighbour = client.neighbour(VM.ip);
        assert!(
            neighbour.contains(&format!("lladdr {}", VM.mac)),
            "the client learnt the VM's MAC from the sleeper's ARP reply: {neighbour:?}"
        );
        let counters = sleeper.counters();
        assert!(counters.arp_replies >= 1, "{counters:?}");
        assert_eq!(counters.reply_errors, 0, "{counters:?}");
        assert_eq!(counters.held, 1, "{counters:?}");
        assert_eq!(counters.overflow_frames, 0, "{counters:?}");

        let handover = sleeper.hand_over(Release::KeepOpen).await.unwrap();
        assert_eq!(handover.frames.len(), 1);
        assert!(
            is_syn(&handover.frames[0], 8080),
            "{:02x?}",
            handover.frames[0]
        );
        assert_eq!(handover.woken, Some(woken));
        // The ARP replies went into the TAP: the kernel counts them as received on it.
        let sample = counters_of(TAP).await;
        assert!(
            sample.rx_packets >= rx_before + counters.arp_replies,
            "{sample:?} after {} replies",
            counters.arp_replies
        );

        let fd = handover.tap.expect("the TAP fd, kept open");
        let t = Instant::now();
        inject(TAP, &handover.frames).await.unwrap();
        eprintln!("injected the held SYN in {:?}", t.elapsed());
        let syn = handover.frames[0].clone();
        let (found, seen) = vmm_reads(fd, syn).await;
        assert!(
            found,
            "the held SYN never came out of the TAP ({seen} other frames)"
        );
        let after = counters_of(TAP).await;
        assert!(
            after.tx_packets > sample.tx_packets,
            "delivery toward the VM counted: {sample:?} then {after:?}"
        );
    });
    drop(client);
    sh(&["ip", "link", "del", TAP]);
}

#[test]
fn other_traffic_does_not_wake_the_vm_and_a_flood_is_held_to_the_bound() {
    if !inside(
        "other_traffic_does_not_wake_the_vm_and_a_flood_is_held_to_the_bound",
        "other",
    ) {
        return;
    }
    node();
    let client = Client::new("other");
    // 100 bytes of UDP payload: 142-byte frames; room for 10 of them.
    let frame = 14 + 20 + 8 + 100;
    let bounds = HoldBounds {
        max_frames: 1000,
        max_bytes: 10 * frame,
    };
    runtime().block_on(async {
        let sleeper = Sleeper::hold(TAP, VM, bounds).await.unwrap();
        forwarding().await;
        // .6 has no owner (its ARP goes unanswered); .7 is a static entry for an unknown MAC
        // (the bridge floods the frame to every port); .8 is mapped to the VM's MAC.
        client.run(&[
            "ip",
            "neigh",
            "add",
            "10.77.0.7",
            "lladdr",
            "02:00:00:77:00:07",
            "dev",
            "eth0",
        ]);
        client.run(&[
            "ip",
            "neigh",
            "add",
            "10.77.0.8",
            "lladdr",
            &VM.mac.to_string(),
            "dev",
            "eth0",
        ]);
        let mut others = client
            .spawn("for ip in 10.77.0.6 10.77.0.7 10.77.0.8; do echo x > /dev/udp/$ip/9; done");
        until("the other frames to be read", || {
            let c = sleeper.counters();
            c.dropped(DropReason::ArpNotForVm) >= 1 && c.dropped(DropReason::Ipv4NotForVm) >= 2
        })
        .await;
        assert!(others.wait().await.unwrap().success());
        assert!(
            tokio::time::timeout(Duration::from_millis(300), sleeper.woken())
                .await
                .is_err(),
            "traffic for others woke the VM: {:?}",
            sleeper.counters()
        );
        assert_eq!(sleeper.counters().held, 0);
        assert_eq!(sleeper.counters().arp_replies, 0);

        // One datagram resolves the VM's address and wakes it; then 199 more.
        let payload = "p=$(printf 'x%.0s' $(seq 100))";
        let send = format!("printf %s \"$p\" > /dev/udp/{}/9", VM.ip);
        let first = client.spawn(&format!("{payload}; {send}"));
        let woken = tokio::time::timeout(WAIT, sleeper.woken())
            .await
            .expect("a datagram for the VM woke it")
            .unwrap();
        assert_eq!((woken.source, woken.protocol), (CLIENT, 17));
        assert!(first.wait_with_output().await.unwrap().status.success());
        let flood = client.spawn(&format!("{payload}; for i in $(seq 199); do {send}; done"));
        assert!(flood.wait_with_output().await.unwrap().status.success());
        until("the flood to be read", || {
            let c = sleeper.counters();
            c.held + c.overflow_frames >= 200
        })
        .await;
        let handover = sleeper.hand_over(Release::Close).await.unwrap();
        let c = handover.counters;
        assert!(handover.tap.is_none());
        assert_eq!(handover.frames.len(), 10, "{c:?}");
        assert!(handover.frames.iter().all(|f| f.len() == frame));
        assert_eq!((c.held, c.overflow_frames), (10, 190), "{c:?}");
        assert_eq!(c.overflow_bytes, 190 * frame as u64);
        assert!(c.arp_replies >= 1, "{c:?}");
        assert_eq!(handover.woken.map(|w| w.at), Some(woken.at), "woke once");
    });
    drop(client);
    sh(&["ip", "link", "del", TAP]);
}

#[test]
fn a_packet_from_the_node_itself_wakes_the_vm() {
    if !inside("a_packet_from_the_node_itself_wakes_the_vm", "self") {
        return;
    }
    node();
    runtime().block_on(async {
        let sleeper = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
        forwarding().await;
        let socket = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
        socket.send_to(b"hello", (VM.ip, 9)).await.unwrap();
        let woken = tokio::time::timeout(WAIT, sleeper.woken())
            .await
            .expect("no wake within 10 s")
            .unwrap();
        assert_eq!((woken.source, woken.protocol), (GATEWAY, 17));
        let neighbour = sh(&["ip", "neigh", "show", &VM.ip.to_string(), "dev", BRIDGE]);
        assert!(
            neighbour.contains(&format!("lladdr {}", VM.mac)),
            "{neighbour:?}"
        );
        // A second holder is refused while the sleeper has the TAP (single queue).
        let busy = Sleeper::hold(TAP, VM, HoldBounds::default()).await;
        assert!(busy.is_err(), "a second holder attached");
        let handover = sleeper.hand_over(Release::KeepOpen).await.unwrap();
        assert_eq!(handover.frames.len(), 1);
        assert!(handover.frames[0].ends_with(b"hello"));

        // Held again on the same descriptor: the carrier never dropped, so the next packet
        // (the node's neighbour entry is warm now) wakes it with no wait for the bridge.
        let fd = handover.tap.unwrap();
        let again = Sleeper::hold_fd(TAP, fd, VM, HoldBounds::default())
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(format!("/sys/class/net/{TAP}/brport/state"))
                .unwrap()
                .trim(),
            "3",
            "the port kept forwarding"
        );
        socket.send_to(b"again", (VM.ip, 9)).await.unwrap();
        let woken = tokio::time::timeout(Duration::from_secs(2), again.woken())
            .await
            .expect("no wake within 2 s on the adopted descriptor")
            .unwrap();
        assert_eq!(woken.source, GATEWAY);
        let handover = again.hand_over(Release::Close).await.unwrap();
        assert!(handover.frames[0].ends_with(b"again"));

        // Released: it can be held by name again; a descriptor that is not a TAP is refused.
        let by_name = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
        drop(by_name);
        let not_tap = std::os::fd::OwnedFd::from(File::open("/dev/null").unwrap());
        let e = Sleeper::hold_fd(TAP, not_tap, VM, HoldBounds::default())
            .await
            .err()
            .expect("/dev/null taken for a TAP");
        assert!(e.to_string().contains("not a TAP"), "{e}");
    });
    sh(&["ip", "link", "del", TAP]);
    // A TAP that is not there is named in the error.
    let missing = runtime().block_on(Sleeper::hold(TAP, VM, HoldBounds::default()));
    let e = missing.err().expect("holding a TAP that does not exist");
    assert!(e.to_string().contains(TAP), "{e}");
}

/// Plays a VMM that suspends: a process holding an attached descriptor on the TAP (as its fd
/// number in this process, inherited) that never reads it, as a paused QEMU does not.
fn vmm_holding(fd: OwnedFd) -> std::process::Child {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    use std::os::fd::AsRawFd;
    fcntl(&fd, FcntlArg::F_SETFD(FdFlag::empty())).unwrap();
    let child = Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("starting the VMM's stand-in");
    // Only the "VMM" holds the TAP now.
    assert!(fd.as_raw_fd() > 2);
    drop(fd);
    child
}

/// Ends the stand-in VMM and waits until it is gone.
fn vmm_exits(mut vmm: std::process::Child) {
    vmm.kill().unwrap();
    vmm.wait().unwrap();
}

/// A frame sent while the VMM pauses, snapshots and exits: with a duplicate of the VMM's
/// descriptor kept as the suspend begins (what the agent does), the frame waits in the TAP
/// and wakes the sleeper that adopts the duplicate, and the bridge port never stops
/// forwarding; without one, the VMM's exit takes the frame with it.
#[test]
fn a_frame_sent_while_the_vmm_suspends_waits_in_the_kept_tap_and_wakes_the_vm() {
    if !inside(
        "a_frame_sent_while_the_vmm_suspends_waits_in_the_kept_tap_and_wakes_the_vm",
        "kept",
    ) {
        return;
    }
    node();
    let client = Client::new("kept");
    // Nobody answers ARP while the VMM is paused: this client has the VM's MAC already.
    client.run(&[
        "ip",
        "neigh",
        "replace",
        &VM.ip.to_string(),
        "lladdr",
        &VM.mac.to_string(),
        "dev",
        "eth0",
    ]);
    let send =
        |text: &str| client.run(&["bash", "-c", &format!("echo {text} > /dev/udp/{}/9", VM.ip)]);
    let state = format!("/sys/class/net/{TAP}/brport/state");
    runtime().block_on(async {
        let attached = || async {
            let sleeper = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
            forwarding().await;
            let handover = sleeper.hand_over(Release::KeepOpen).await.unwrap();
            handover.tap.unwrap()
        };

        // Kept: the agent's duplicate, taken from the running VMM.
        let vmm = vmm_holding(attached().await);
        let kept = tap::duplicate_from(vmm.id(), TAP)
            .unwrap()
            .expect("the VMM's descriptor on the TAP");
        send("during-the-suspend");
        vmm_exits(vmm);
        assert_eq!(
            std::fs::read_to_string(&state).unwrap().trim(),
            "3",
            "the port kept forwarding after the VMM's exit"
        );
        let sleeper = Sleeper::hold_fd(TAP, kept, VM, HoldBounds::default())
            .await
            .unwrap();
        let woken = tokio::time::timeout(Duration::from_secs(2), sleeper.woken())
            .await
            .expect("the frame sent during the suspend did not wake the VM")
            .unwrap();
        assert_eq!((woken.source, woken.protocol), (CLIENT, 17));
        let handover = sleeper.hand_over(Release::Close).await.unwrap();
        assert_eq!(handover.frames.len(), 1);
        assert!(handover.frames[0].ends_with(b"during-the-suspend\n"));

        // Not kept: the frame goes with the VMM; the sleeper that attaches by name sees nothing.
        let vmm = vmm_holding(attached().await);
        send("lost-with-the-vmm");
        vmm_exits(vmm);
        let sleeper = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
        let woken = tokio::time::timeout(Duration::from_millis(500), sleeper.woken()).await;
        assert!(
            woken.is_err(),
            "a frame survived the VMM without a kept descriptor"
        );
        drop(sleeper);
    });
    drop(client);
    sh(&["ip", "link", "del", TAP]);
}

/// The TAP's counters, read over netlink as the agent reads them.
async fn counters_of(tap: &str) -> imp_net::link::LinkState {
    imp_net::link::Netlink::connect()
        .unwrap()
        .link_state(tap)
        .await
        .unwrap()
        .expect("the TAP exists")
}
