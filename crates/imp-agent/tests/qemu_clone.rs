//! Clone safety inside the guest: one snapshot of a running guest (real imp-guest as PID 1
//! under `qemu -M microvm`, TCG here) restored twice, each clone then given its own identity
//! with [`guest_agent::reidentify`]. One boot; the clones run one after the other on the same
//! TAP (the 2-core CI machine runs one TCG guest at a time).
//!
//! What it shows, per clone:
//! - before the reidentification the two clones read the same 16 bytes from `/dev/urandom`
//!   (they share the source's generator state: the hazard), after it they read different
//!   ones: if the reseed did nothing, the clones, which ran the same requests from the same
//!   state, would read the same bytes again (checked by hand: a guest that skips both ioctls,
//!   and one that credits the bytes without `RNDRESEEDCRNG`, fail here). `entropy_avail` is
//!   no witness: on 6.1 it stays at 256 once anything credited 256 bits, and reads do not
//!   lower it. The source reseeds just before the snapshot so that the clones' generator is
//!   young enough not to reseed by itself (from interrupt timings that differ per clone)
//!   before the first read;
//! - its hostname, MAC, address, default route and /etc/hosts entry are the new ones, and it
//!   answers on its new address (a ping to the node, whose neighbour table then holds the new
//!   MAC: QEMU's virtio-net filter accepts frames for it);
//! - its clock, snapshotted in 2001, is now;
//! - the TCP connections it carried over from the source (guest → node, and one inside the
//!   guest on the source's address) are gone, and the node's end of the guest → node
//!   connection got no reset: the source's peers keep their connections to the source;
//! - `/proc/sys/kernel/random/boot_id` is the source's (reidentification does not change it).
//!
//! The test runs itself again inside a network namespace of its own (`unshare --net`) holding
//! the node's side: a TAP with the gateway address. Needs root, iproute2, unshare, /dev/net/tun
//! and the inputs of `qemu_driver.rs`; without them it skips on a developer machine and fails
//! under `CI=true`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure

use std::fs;
use std::io::Read;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use imp_agent::guest::initramfs::{BaseInitramfs, build_for_vm};
use imp_agent::guest::kernel::VM_MODULES;
use imp_agent::runtime::guest_agent;
use imp_agent::vmm::qemu::{Launcher, Qemu};
use imp_agent::vmm::{
    Confine, DriveConfig, GuestMemory, NetConfig, SnapshotFiles, VmConfig, Vmm, VsockConfig,
};
use imp_proto::config::{GuestConfig, ImageConfig, NetworkConfig, RootDisk};
use imp_proto::message::steps;
use imp_proto::{ExecEvent, ExecRequest, ExitStatus, Hello, Identity, StepStatus};

const AGENT_PORT: u32 = imp_proto::DEFAULT_API_PORT;
const MARK: &str = "IMP_CLONE_TEST_INSIDE";
const TAP: &str = "impclone0";
const CID: u32 = 21;
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
const SOURCE: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 5);
const SOURCE_MAC: &str = "02:00:0a:d5:00:05";
/// The port on the node the source's guest → node connection goes to.
const NODE_PORT: u16 = 7001;
/// The port inside the guest its own connection goes to.
const GUEST_PORT: u16 = 7000;
/// The time the source's clock is set to before the snapshot (2001-09-09).
const OLD_CLOCK: u64 = 1_000_000_000;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn env_path(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

struct Inputs {
    launcher: Launcher,
    kernel: PathBuf,
    modules: PathBuf,
    guest: PathBuf,
    busybox: PathBuf,
}

fn inputs() -> Option<Inputs> {
    let root = workspace_root();
    let kdir = env_path("IMP_GUEST_KERNEL_DIR", root.join("target/guest-kernel"));
    let guest = env_path("IMP_GUEST_BIN", root.join("target/imp-guest/imp-guest"));
    let busybox = env_path("IMP_BUSYBOX", PathBuf::from("/bin/busybox"));
    let launcher = Launcher::detect();
    let tools = ["ip", "unshare", "mkfs.ext4"]
        .iter()
        .all(|t| imp_testenv::guard::which(t).is_some());
    let checks = [
        (
            imp_testenv::guard::is_root(),
            "root (a network namespace, a TAP)".to_string(),
        ),
        (
            Path::new("/dev/net/tun").exists(),
            "/dev/net/tun".to_string(),
        ),
        (
            tools,
            "ip, unshare and mkfs.ext4 (apt-get install -y iproute2 util-linux e2fsprogs)"
                .to_string(),
        ),
        (
            launcher.is_ok(),
            format!(
                "qemu-system-x86_64 ({:?})",
                launcher.as_ref().err().map(|e| e.to_string())
            ),
        ),
        (
            kdir.join("vmlinuz").is_file() && kdir.join("modules").is_dir(),
            format!(
                "guest kernel in {} (scripts/fetch-guest-kernel.sh)",
                kdir.display()
            ),
        ),
        (
            guest.is_file(),
            format!("static guest {} (scripts/build-guest.sh)", guest.display()),
        ),
        (
            busybox.is_file(),
            "static busybox (apt-get install -y busybox-static)".to_string(),
        ),
    ];
    for (ok, what) in checks {
        if !imp_testenv::guard::require(ok, &what) {
            return None;
        }
    }
    Some(Inputs {
        launcher: launcher.ok()?,
        kernel: kdir.join("vmlinuz"),
        modules: kdir.join("modules"),
        guest,
        busybox,
    })
}

fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An ext4 root disk with busybox and the applets the test runs.
fn make_disk(dir: &Path, busybox: &Path) -> PathBuf {
    let tree = dir.join("tree");
    for d in ["bin", "etc", "proc", "sys", "dev", "run", "tmp", "root"] {
        fs::create_dir_all(tree.join(d)).unwrap();
    }
    fs::set_permissions(tree.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::copy(busybox, tree.join("bin/busybox")).unwrap();
    for tool in [
        "sh", "cat", "sleep", "nc", "ip", "ping", "hexdump", "grep", "date", "setsid",
    ] {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(tool)).unwrap();
    }
    fs::write(tree.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    fs::write(tree.join("etc/group"), "root:x:0:\n").unwrap();
    let disk = dir.join("disk.ext4");
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(&tree)
        .arg(&disk)
        .arg("32M")
        .output()
        .unwrap();
    assert!(out.status.success(), "mkfs.ext4: {out:?}");
    disk
}

/// The source VM: an idle workload, eth0 on the TAP as 10.213.0.5, the RAM its own (a
/// snapshot streams it), run confined as the product runs it.
async fn vm_config(inputs: &Inputs, dir: &Path) -> VmConfig {
    let cache = workspace_root().join("target/imp-initramfs-cache");
    fs::create_dir_all(&cache).unwrap();
    let base = BaseInitramfs::cached(&cache, &inputs.guest, &inputs.modules, VM_MODULES)
        .await
        .unwrap();
    let guest = GuestConfig {
        hostname: Some("source".into()),
        network: Some(NetworkConfig {
            interface: "eth0".into(),
            address: SOURCE,
            prefix_len: 24,
            gateway: Some(GATEWAY),
            dns: vec![GATEWAY.into()],
            search: vec![],
            mtu: None,
        }),
        image: ImageConfig {
            entrypoint: vec!["/bin/sleep".into(), "1000000".into()],
            ..ImageConfig::default()
        },
        root: Some(RootDisk::ext4("/dev/vda")),
        ..GuestConfig::default()
    };
    let initrd = dir.join("initrd.cpio");
    build_for_vm(&base, &guest, &initrd).await.unwrap();
    VmConfig {
        id: "qemu-clone".into(),
        run_dir: dir.join("run"),
        vcpus: 1,
        memory_mib: 256,
        kernel: inputs.kernel.clone(),
        initrd: Some(initrd),
        kernel_args: "console=ttyS0 panic=-1 reboot=t".into(),
        drives: vec![DriveConfig {
            id: "root".into(),
            path: make_disk(dir, &inputs.busybox),
            read_only: false,
            root: true,
        }],
        net: Some(NetConfig {
            id: "net0".into(),
            tap: TAP.into(),
            mac: Some(SOURCE_MAC.into()),
            tap_fd: None,
        }),
        vsock: Some(VsockConfig { guest_cid: CID }),
        netns: None,
        confine: Some(Confine {
            uid: 3_900_000 + CID,
            gid: 3_900_000 + CID,
        }),
        memory: GuestMemory::Anonymous,
    }
}

fn serial(vm: &Qemu) -> String {
    String::from_utf8_lossy(&fs::read(vm.serial_log_path()).unwrap_or_default()).into_owned()
}

/// A handshaken client on the guest agent.
async fn client(vm: &Qemu) -> imp_proto::Client<std::os::unix::net::UnixStream> {
    let stream = vm
        .connect_vsock(AGENT_PORT, Duration::from_secs(90))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", serial(vm)));
    let stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    tokio::task::spawn_blocking(move || {
        imp_proto::Client::handshake(stream, &Hello::new("qemu-clone-test"))
    })
    .await
    .unwrap()
    .unwrap()
}

/// Runs `script` with `sh -c` as root in the guest; returns its exit status and stdout.
async fn run(vm: &Qemu, script: &str) -> (ExitStatus, String) {
    let request = ExecRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        user: Some("root".into()),
        ..ExecRequest::default()
    };
    let c = client(vm).await;
    tokio::task::spawn_blocking(move || {
        let mut session = c.exec(&request).unwrap();
        let mut out = String::new();
        loop {
            match session.next_event().unwrap() {
                ExecEvent::Stdout(b) => out.push_str(&String::from_utf8_lossy(&b)),
                ExecEvent::Stderr(b) => eprintln!("guest stderr: {}", String::from_utf8_lossy(&b)),
                ExecEvent::Exit(status) => return (status, out),
            }
        }
    })
    .await
    .unwrap()
}

/// Runs `script` and wants it to succeed; returns its stdout.
async fn as_root(vm: &Qemu, script: &str) -> String {
    let (status, out) = run(vm, script).await;
    assert_eq!(
        status,
        ExitStatus::Code(0),
        "{script}: {out}\n{}",
        serial(vm)
    );
    out
}

/// 16 bytes of the guest's /dev/urandom, in hex: one exec, the same in every clone.
async fn urandom(vm: &Qemu) -> String {
    as_root(vm, "hexdump -n 16 -e '16/1 \"%02x\"' /dev/urandom")
        .await
        .trim()
        .to_string()
}

/// The hex /proc/net/tcp writes for an IPv4 address (each word in host order); in
/// /proc/net/tcp6 a v4-mapped one is this after `0000000000000000FFFF0000`.
fn proc_hex(a: Ipv4Addr) -> String {
    format!("{:08X}", u32::from_ne_bytes(a.octets()))
}

/// How many ESTABLISHED sockets on `local` (IPv4, or v4-mapped IPv6 like the one a listener
/// on `[::]` accepts) the guest's /proc/net/tcp and tcp6 list.
async fn established_on(vm: &Qemu, local: Ipv4Addr) -> usize {
    let tables = as_root(vm, "cat /proc/net/tcp /proc/net/tcp6").await;
    let v4 = format!("{}:", proc_hex(local));
    let v6 = format!("0000000000000000FFFF0000{}:", proc_hex(local));
    tables
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && (f[1].starts_with(&v4) || f[1].starts_with(&v6)) && f[3] == "01"
        })
        .count()
}

/// Waits until `check` holds, for at most `timeout`.
async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the node's end of a connection is still open and quiet: no data, no FIN, no reset.
fn untouched(stream: &mut TcpStream) -> Result<(), String> {
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut b = [0u8; 16];
    match stream.read(&mut b) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Ok(())
        }
        Ok(0) => Err("it was closed (FIN)".into()),
        Ok(n) => Err(format!("{n} bytes arrived")),
        Err(e) => Err(format!("it failed: {e}")),
    }
}

/// What one clone showed.
struct Clone {
    before: String,
    after: String,
    boot_id: String,
}

/// Restores the snapshot as a clone, reads the generator, reidentifies it, checks it.
async fn clone(
    inputs: &Inputs,
    config: &VmConfig,
    files: &SnapshotFiles,
    n: u8,
    node_end: &mut TcpStream,
) -> Clone {
    let name = format!("clone-{n}");
    let address = Ipv4Addr::new(10, 213, 0, 10 + n);
    let mac = format!("02:00:0a:d5:00:{:02x}", 10 + n);
    let t = Instant::now();
    // As the supervisor restores a clone: its link down until it has its own identity.
    let mut vm = Qemu::restore(&inputs.launcher, config, files, false)
        .await
        .unwrap();
    vm.set_link(false).await.unwrap();
    // Frames the TAP received from the guest (/proc/net/dev is this namespace's; sysfs is not).
    let frames = || {
        let dev = std::fs::read_to_string("/proc/net/dev").unwrap();
        let line = dev
            .lines()
            .find_map(|l| l.trim_start().strip_prefix(&format!("{TAP}:")))
            .unwrap_or_else(|| panic!("{TAP} not in /proc/net/dev:\n{dev}"))
            .to_owned();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let frames_before = frames();
    vm.resume().await.unwrap();
    // Nothing before this read differs between the clones.
    let before = urandom(&vm).await;
    let restored = t.elapsed();
    let avail = "cat /proc/sys/kernel/random/entropy_avail";
    let avail_before = as_root(&vm, avail).await;

    let identity = Identity {
        hostname: Some(name.clone()),
        mac: Some(mac.clone()),
        network: Some(NetworkConfig {
            interface: "eth0".into(),
            address,
            prefix_len: 24,
            gateway: Some(GATEWAY),
            dns: vec![GATEWAY.into()],
            search: vec!["clones.test".into()],
            mtu: None,
        }),
    };
    let t = Instant::now();
    let report = guest_agent::reidentify(
        &vm.vsock_path().unwrap(),
        AGENT_PORT,
        &identity,
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("{}\n{}", imp_testenv::report::chain(&e), serial(&vm)));
    let took = t.elapsed();
    // Nothing left the guest while it was still its source (the TAP received no frame).
    assert_eq!(
        frames(),
        frames_before,
        "{name} sent frames before its identity was its own"
    );
    vm.set_link(true).await.unwrap();
    let after = urandom(&vm).await;
    let avail_after = as_root(&vm, avail).await;
    eprintln!(
        "{name}: restored and read in {restored:?}; reidentified in {took:?}: {report}\n\
         {name}: urandom before {before}, after {after}; entropy_avail before {}, after {}",
        avail_before.trim(),
        avail_after.trim()
    );
    assert!(report.is_complete(), "{name}: {report}");
    for step in [
        steps::ENTROPY,
        steps::CRNG,
        steps::CLOCK,
        steps::LINK_DOWN,
        steps::CONNECTIONS,
        steps::MAC,
        steps::ADDRESSES,
        steps::NETWORK,
        steps::HOSTNAME,
        steps::HOSTS,
        steps::RESOLV_CONF,
    ] {
        assert_eq!(
            report.step(step).map(|s| s.status),
            Some(StepStatus::Done),
            "{name}: {step}: {report}"
        );
    }
    let connections = &report.step(steps::CONNECTIONS).unwrap().detail;
    assert!(
        connections.starts_with(&format!("3 TCP connections on {SOURCE} ")),
        "{name}: {connections}"
    );

    // The new identity, as the guest sees it.
    assert_eq!(
        as_root(&vm, "cat /proc/sys/kernel/hostname").await.trim(),
        name
    );
    assert_eq!(
        as_root(&vm, "cat /sys/class/net/eth0/address").await.trim(),
        mac
    );
    let addresses = as_root(&vm, "ip -4 -o addr show dev eth0").await;
    assert!(
        addresses.contains(&format!("inet {address}/24"))
            && !addresses.contains(&SOURCE.to_string()),
        "{name}: {addresses}"
    );
    // No IPv6 address derived from the source's MAC either (the kernel removes them when the
    // link goes down).
    let v6 = as_root(&vm, "ip -6 -o addr show dev eth0").await;
    eprintln!("{name}: IPv6 on eth0: {}", v6.trim());
    assert!(!v6.contains("a:d5ff:fe00:5/"), "{name}: {v6}");
    let routes = as_root(&vm, "ip route show").await;
    assert!(
        routes.contains(&format!("default via {GATEWAY} dev eth0"))
            && routes.contains(&format!("src {address}"))
            && !routes.contains(&SOURCE.to_string()),
        "{name}: {routes}"
    );
    let hosts = as_root(&vm, "cat /etc/hosts").await;
    assert!(
        hosts.contains(&format!("{address}\t{name}\n")) && !hosts.contains("source"),
        "{hosts}"
    );
    assert!(
        as_root(&vm, "cat /etc/resolv.conf")
            .await
            .contains("nameserver 10.213.0.1")
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let guest_now: u64 = as_root(&vm, "date +%s").await.trim().parse().unwrap();
    assert!(
        guest_now.abs_diff(now) < 30,
        "{name}: the clock is {guest_now}, the node's {now}"
    );

    // The source's connections are gone, in the guest and without a word to the node.
    assert_eq!(established_on(&vm, SOURCE).await, 0, "{name}");
    let left = as_root(&vm, "cat /proc/net/tcp /proc/net/tcp6").await;
    assert!(
        !left.contains(&format!("{}:", proc_hex(SOURCE))),
        "{name}: sockets on the source's address remain:\n{left}"
    );
    let node_end_state = tokio::task::block_in_place(|| untouched(node_end));
    assert_eq!(
        node_end_state,
        Ok(()),
        "{name}: the node's end of the source's connection was disturbed"
    );

    // It answers on its new address, with its new MAC.
    as_root(&vm, &format!("ping -c 1 -W 10 {GATEWAY}")).await;
    let neighbour = sh(&["ip", "neigh", "show", &address.to_string(), "dev", TAP]);
    assert!(
        neighbour.contains(&mac),
        "{name}: the node sees {neighbour:?}"
    );

    let boot_id = as_root(&vm, "cat /proc/sys/kernel/random/boot_id").await;
    let log = serial(&vm);
    assert!(
        !log.contains("Kernel panic") && !log.contains("Call Trace"),
        "{log}"
    );
    vm.stop(Duration::ZERO).await.unwrap();
    Clone {
        before,
        after,
        boot_id,
    }
}

/// The node's side: the TAP with the gateway address, in the test's own namespace.
fn node() {
    sh(&["ip", "link", "set", "lo", "up"]);
    imp_agent::net::tap::create_persistent(TAP).unwrap();
    sh(&["ip", "addr", "add", &format!("{GATEWAY}/24"), "dev", TAP]);
    sh(&["ip", "link", "set", TAP, "up"]);
}

#[test]
fn qemu_clones_of_one_snapshot_each_take_their_own_identity() {
    if std::env::var_os(MARK).is_none() {
        if inputs().is_none() {
            return;
        }
        let status = Command::new("unshare")
            .arg("--net")
            .arg(std::env::current_exe().unwrap())
            .args([
                "qemu_clones_of_one_snapshot_each_take_their_own_identity",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MARK, "1")
            .status()
            .unwrap();
        assert!(status.success(), "the test failed in its network namespace");
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(inside());
}

async fn inside() {
    let inputs = inputs().unwrap();
    node();
    let dir = std::env::temp_dir().join(format!("imp-qemu-clone-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let config = vm_config(&inputs, &dir).await;
    let listener = TcpListener::bind((GATEWAY, NODE_PORT)).unwrap();
    listener.set_nonblocking(true).unwrap();

    let t = Instant::now();
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    let mut c = client(&vm).await;
    tokio::task::spawn_blocking(move || c.health().unwrap())
        .await
        .unwrap();
    eprintln!(
        "source: guest agent answered {:?} after QEMU start",
        t.elapsed()
    );

    // The source's connections: one to the node, one inside the guest on its own address.
    as_root(
        &vm,
        &format!(
            "setsid sh -c 'sleep 1000000 | nc -l -p {GUEST_PORT}' </dev/null >/dev/null 2>&1 & \
             setsid sh -c 'sleep 1000000 | nc {GATEWAY} {NODE_PORT}' </dev/null >/dev/null 2>&1 &"
        ),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut node_end = loop {
        match listener.accept() {
            Ok((s, peer)) => {
                assert_eq!(peer.ip(), SOURCE);
                break s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    Instant::now() < deadline,
                    "the guest never connected to the node"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    node_end.set_nonblocking(false).unwrap();
    as_root(
        &vm,
        &format!(
            "setsid sh -c 'sleep 1000000 | nc {SOURCE} {GUEST_PORT}' </dev/null >/dev/null 2>&1 &"
        ),
    )
    .await;
    wait_for(
        "3 connections on the source's address",
        Duration::from_secs(30),
        || {
            let vm = &vm;
            async move { established_on(vm, SOURCE).await == 3 }
        },
    )
    .await;
    let source_boot_id = as_root(&vm, "cat /proc/sys/kernel/random/boot_id").await;
    let entropy_avail = as_root(
        &vm,
        "cat /proc/sys/kernel/random/entropy_avail; cat /proc/uptime",
    )
    .await;
    eprintln!("source: entropy_avail and uptime: {entropy_avail:?}");

    // Without a network, a reidentification leaves the network and its connections alone;
    // it reseeds, which also makes the generator's last reseed recent, so the clones below
    // do not reseed on their own (from their differing interrupt timings) before they read.
    let report = guest_agent::reidentify(
        &vm.vsock_path().unwrap(),
        AGENT_PORT,
        &Identity::default(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    eprintln!("source: entropy only: {report}");
    assert!(report.is_complete(), "{report}");
    assert_eq!(
        report.step(steps::NETWORK).map(|s| s.status),
        Some(StepStatus::Skipped)
    );
    assert_eq!(established_on(&vm, SOURCE).await, 3);
    // The clones wake in 2001 unless they are told the time.
    guest_agent::set_clock(
        &vm.vsock_path().unwrap(),
        AGENT_PORT,
        std::time::UNIX_EPOCH + Duration::from_secs(OLD_CLOCK),
        Duration::from_secs(30),
    )
    .await
    .unwrap();

    vm.pause().await.unwrap();
    let files = SnapshotFiles {
        state: dir.join("snap.state"),
        memory: dir.join("snap.mem"),
    };
    vm.snapshot(&files).await.unwrap();
    vm.stop(Duration::ZERO).await.unwrap();

    let a = clone(&inputs, &config, &files, 1, &mut node_end).await;
    let b = clone(&inputs, &config, &files, 2, &mut node_end).await;

    assert_eq!(
        a.before, b.before,
        "the control failed: two clones of one snapshot read different random bytes before \
         their reidentification, so this test cannot tell whether it reseeds: their generator \
         reseeded by itself, which it does when its last reseed is old (the source's reseed \
         just before the snapshot did nothing, or the clones took too long to read)"
    );
    assert_ne!(
        a.after, b.after,
        "after the reseed the clones still read the same random bytes"
    );
    assert_eq!(a.boot_id, source_boot_id);
    assert_eq!(b.boot_id, source_boot_id);
    let _ = fs::remove_dir_all(&dir);
}
