//! Wake-on-traffic figures, in network namespaces of its own (a node with a bridge and the
//! sleeping VM's TAP, a client joined to the bridge by veth): the time from a client's first
//! frame to the wake (cold neighbour cache: ARP request, reply, then the datagram; and warm),
//! the ARP reply latency seen by the client, the time to inject 64 held frames, and how long
//! the bridge takes to forward to a TAP again after a holder attaches by name.
//!
//! Needs root, iproute2, nsenter and unshare; skips without them on a developer machine and
//! fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(unsafe_code)] // setns(2) for the client thread

use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use imp_net::plan::Mac;
use imp_net::sleeper::{PacketSocket, Release, Sleeper, inject};
use imp_net::tap;
use imp_net::wake::{HoldBounds, SleepingVm, frames};

const MARK: &str = "IMP_BENCH_WAKE_INSIDE";
const BRIDGE: &str = "wkbr";
const TAP: &str = "wktap";
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 9);
const CLIENT_MAC: Mac = Mac([0x02, 0, 0, 0x77, 0, 9]);
const VM: SleepingVm = SleepingVm {
    ip: Ipv4Addr::new(10, 77, 0, 5),
    mac: Mac([0x02, 0, 0, 0x77, 0, 5]),
};
const ROUNDS: usize = 30;

fn main() {
    let root = imp_testenv::guard::is_root();
    let tools = ["ip", "nsenter", "unshare"]
        .iter()
        .all(|t| imp_testenv::guard::which(t).is_some());
    if !imp_testenv::guard::require(root, "root")
        || !imp_testenv::guard::require(tools, "ip, nsenter and unshare")
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

fn node_ns() -> String {
    format!("wkbench{}", std::env::var(MARK).unwrap_or_default())
}

fn client_ns() -> String {
    format!("{}c", node_ns())
}

/// Makes the node's namespace and runs this benchmark again inside it, with sysfs mounted
/// again so that `/sys/class/net` shows that namespace.
fn outside() {
    let id = std::process::id().to_string();
    let ns = format!("wkbench{id}");
    sh(&["ip", "netns", "add", &ns]);
    let status = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{ns}"))
        .args(["unshare", "--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t sysfs sysfs /sys && exec "$0" "$@""#)
        .arg(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .env(MARK, &id)
        .status();
    let _ = Command::new("ip")
        .args(["netns", "del", &format!("{ns}c")])
        .output();
    let _ = Command::new("ip").args(["netns", "del", &ns]).output();
    assert!(status.unwrap().success(), "the benchmark failed in {ns}");
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn setup() {
    sh(&["ip", "link", "set", "lo", "up"]);
    // No IPv6 chatter (router solicitations, MLD) on the bridge.
    let no_ipv6 = "for f in all default; do echo 1 > /proc/sys/net/ipv6/conf/$f/disable_ipv6; done";
    sh(&["sh", "-c", no_ipv6]);
    sh(&["ip", "link", "add", BRIDGE, "type", "bridge"]);
    sh(&["ip", "addr", "add", "10.77.0.1/24", "dev", BRIDGE]);
    sh(&["ip", "link", "set", BRIDGE, "up"]);
    tap::create_persistent(TAP).unwrap();
    sh(&["ip", "link", "set", TAP, "master", BRIDGE, "up"]);
    let c = client_ns();
    sh(&["ip", "netns", "add", &c]);
    let netns = format!("--net=/var/run/netns/{c}");
    sh(&["nsenter", &netns, "sh", "-c", no_ipv6]);
    sh(&[
        "ip",
        "link",
        "add",
        "wkv",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "address",
        &CLIENT_MAC.to_string(),
        "netns",
        &c,
    ]);
    sh(&["ip", "link", "set", "wkv", "master", BRIDGE, "up"]);
    sh(&["ip", "-n", &c, "addr", "add", "10.77.0.9/24", "dev", "eth0"]);
    sh(&["ip", "-n", &c, "link", "set", "eth0", "up"]);
}

fn port_state() -> String {
    std::fs::read_to_string(format!("/sys/class/net/{TAP}/brport/state"))
        .unwrap()
        .trim()
        .to_owned()
}

async fn until(mut done: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < end, "timed out");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Runs `f` on a thread inside the client's namespace.
fn in_client<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/var/run/netns/{}", client_ns());
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap();
        // SAFETY: setns(2) on a descriptor we hold, for this thread only.
        let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(
            r,
            0,
            "setns into {path}: {}",
            std::io::Error::last_os_error()
        );
        f()
    })
}

/// Sends one datagram from the client to the VM; returns when the send started.
fn client_datagram() -> std::thread::JoinHandle<Instant> {
    in_client(|| {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        let t0 = Instant::now();
        s.send_to(b"wake up", (VM.ip, 9)).unwrap();
        t0
    })
}

/// `v`'s median, p90 and max, said; the median is also a figure named `what`.
fn stats(what: &str, mut v: Vec<Duration>) -> String {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    imp_testenv::figures::figure(what, ms(v[v.len() / 2]), "ms", "median");
    format!(
        "median {:.3} ms, p90 {:.3} ms, max {:.3} ms (n={})",
        ms(v[v.len() / 2]),
        ms(v[v.len() * 9 / 10]),
        ms(v[v.len() - 1]),
        v.len()
    )
}

async fn inside() {
    setup();

    // A suspend without a kept descriptor: the VMM (played by a first holder) closes the
    // TAP and the sleeper attaches by name at once, while a client sends a datagram every
    // millisecond: how long until one reaches the sleeper.
    let c = client_ns();
    let vm_mac = VM.mac.to_string();
    sh(&[
        "ip",
        "-n",
        &c,
        "neigh",
        "replace",
        "10.77.0.5",
        "lladdr",
        &vm_mac,
        "dev",
        "eth0",
    ]);
    let mut gap = Vec::new();
    for _ in 0..5 {
        let vmm = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
        until(|| port_state() == "3").await;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sender = {
            let stop = stop.clone();
            in_client(move || {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = s.send_to(b"tick", (VM.ip, 9));
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        until(|| vmm.counters().held > 0).await;
        vmm.hand_over(Release::Close).await.unwrap();
        let t = Instant::now();
        let s = Sleeper::hold(TAP, VM, HoldBounds::default()).await.unwrap();
        let woken = s.woken().await.unwrap();
        gap.push(woken.at.duration_since(t));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        tokio::task::spawn_blocking(move || sender.join().unwrap())
            .await
            .unwrap();
        s.hand_over(Release::Close).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    sh(&["ip", "-n", &c, "neigh", "flush", "all"]);
    println!(
        "wake: VMM closes the TAP, sleeper attaches by name: first frame through after {}",
        stats("wake: TAP handover, first frame through", gap)
    );

    let mut fd = Sleeper::hold(TAP, VM, HoldBounds::default())
        .await
        .unwrap()
        .hand_over(Release::KeepOpen)
        .await
        .unwrap()
        .tap
        .unwrap();
    until(|| port_state() == "3").await;

    // First frame to wake, cold (client's neighbour cache flushed) and warm.
    for cold in [true, false] {
        let mut v = Vec::new();
        for _ in 0..ROUNDS {
            if cold {
                sh(&["ip", "-n", &client_ns(), "neigh", "flush", "all"]);
            }
            let s = Sleeper::hold_fd(TAP, fd, VM, HoldBounds::default())
                .await
                .unwrap();
            let client = client_datagram();
            let woken = s.woken().await.unwrap();
            let t0 = client.join().unwrap();
            v.push(woken.at.duration_since(t0));
            fd = s.hand_over(Release::KeepOpen).await.unwrap().tap.unwrap();
        }
        let what = if cold {
            "cold neighbour cache (ARP request, reply, datagram)"
        } else {
            "warm neighbour cache (the datagram alone)"
        };
        println!(
            "wake: client's first frame to the wake, {what}: {}",
            stats(
                &format!("wake: client's first frame to the wake, {what}"),
                v
            )
        );
    }

    // ARP reply latency as the client sees it, on a packet socket on its interface.
    let s = Sleeper::hold_fd(TAP, fd, VM, HoldBounds::default())
        .await
        .unwrap();
    let arp = in_client(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let sock = PacketSocket::bind("eth0", 0x0806).unwrap();
            let request = frames::arp_request(CLIENT_MAC, CLIENT, VM.ip);
            let mut buf = vec![0u8; 2048];
            let mut v = Vec::new();
            for _ in 0..ROUNDS {
                let t0 = Instant::now();
                sock.send(&request).await.unwrap();
                loop {
                    let n = sock.recv(&mut buf).await.unwrap();
                    // Our own request comes back as outgoing: wait for the reply.
                    if n >= 42 && buf[21] == 2 && buf[28..32] == VM.ip.octets() {
                        break;
                    }
                }
                v.push(t0.elapsed());
            }
            v
        })
    });
    let arp = tokio::task::spawn_blocking(move || arp.join().unwrap())
        .await
        .unwrap();
    println!(
        "wake: ARP reply for a sleeping VM, request sent to reply read by the client: {}",
        stats("wake: ARP reply for a sleeping VM", arp)
    );
    let fd = s.hand_over(Release::KeepOpen).await.unwrap().tap.unwrap();

    // Inject 64 held frames (SYN-sized and full-sized) into the TAP held open.
    let file = std::fs::File::from(fd);
    for size in [60, 1514] {
        let held: Vec<Vec<u8>> = (0..64)
            .map(|_| {
                frames::ipv4(
                    (VM.mac, CLIENT_MAC),
                    (CLIENT, VM.ip),
                    17,
                    &vec![0u8; size - 34],
                )
            })
            .collect();
        let mut v = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            inject(TAP, &held).await.unwrap();
            v.push(t.elapsed());
            drain(&file, &held[0], held.len());
        }
        println!(
            "wake: inject 64 held frames of {} bytes: {}",
            held[0].len(),
            stats(
                &format!("wake: inject 64 held frames of {} bytes", held[0].len()),
                v
            )
        );
    }
}

/// Reads frames out of the TAP, as the VMM would, until `n` were `want`.
fn drain(mut file: &std::fs::File, want: &[u8], n: usize) {
    use std::io::Read;
    let mut buf = vec![0u8; 65_600];
    let mut got = 0;
    let end = Instant::now() + Duration::from_secs(5);
    while got < n {
        match file.read(&mut buf) {
            Ok(len) => got += usize::from(buf[..len] == *want),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    Instant::now() < end,
                    "only {got} of {n} injected frames came out"
                );
                std::thread::sleep(Duration::from_micros(100));
            }
            Err(e) => panic!("reading the TAP: {e}"),
        }
    }
}
