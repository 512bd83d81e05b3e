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
//!   before the first read, once it has been up long enough that the kernel's early-boot
//!   reseed interval (half the uptime) leaves the clones time to read;
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

use imp_testenv::command::sh;
use std::fs;
use std::io::Read;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use imp_agent::initramfs::archive::{BaseInitramfs, build_for_vm};
use imp_agent::initramfs::modules::VM_MODULES;
use imp_agent::runtime::guest_agent;
use imp_proto::config::{GuestConfig, ImageConfig, NetworkConfig, RootDisk};
use imp_proto::message::steps;
use imp_proto::{ExecEvent, ExecRequest, ExitStatus, Hello, Identity, StepStatus};
use imp_testenv::workspace_root;
use imp_vmm::qemu::{Launcher, Qemu};
use imp_vmm::{
    Confine, DriveConfig, GuestMemory, NetConfig, SnapshotFiles, VmConfig, Vmm, VsockConfig,
};

/// The source's uptime before its reseed and snapshot: see where it is waited for.
const MIN_SOURCE_UPTIME_SECS: f64 = 40.0;
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

/// An ext4 root disk with busybox and the applets the test runs.
fn make_disk(dir: &Path, busybox: &Path) -> PathBuf {
    let tree = dir.join("tree");
    for d in ["bin", "etc", "proc", "sys", "dev", "run", "tmp", "root"] {
        fs::create_dir_all(tree.join(d)).unwrap();
    }
    fs::set_permissions(tree.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::copy(busybox, tree.join("bin/busybox")).unwrap();
    for tool in [
        "sh", "cat", "sleep", "nc", "ip", "ping", "hexdump", "grep", "date", "setsid", "mkdir",
        "mount", "head", "md5sum",
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
    imp_net::tap::create_persistent(TAP).unwrap();
    sh(&["ip", "addr", "add", &format!("{GATEWAY}/24"), "dev", TAP]);
    sh(&["ip", "link", "set", TAP, "up"]);
}

/// One guest at a time on the 2-core machine: each test holds this while its namespace runs.
static ONE_GUEST_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs test `name` again in a network namespace of its own (where `MARK` is set), or, there,
/// `body` on a runtime; `ready` says whether its inputs are here (else it skips). The child must
/// report exactly one test passed ([`imp_testenv::rerun::one_test`]).
fn in_own_namespace<F: std::future::Future<Output = ()>>(name: &str, ready: bool, body: F) {
    if std::env::var_os(MARK).is_none() {
        if !ready {
            return;
        }
        let _one = ONE_GUEST_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut child = Command::new("unshare");
        child
            .arg("--net")
            .arg(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(MARK, "1");
        // Fails unless the child ran exactly this one test and it passed: a renamed test would
        // otherwise match nothing there and exit 0.
        imp_testenv::rerun::one_test(child, name);
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body);
}

#[test]
fn qemu_clones_of_one_snapshot_each_take_their_own_identity() {
    let ready = std::env::var_os(MARK).is_some() || inputs().is_some();
    in_own_namespace(
        "qemu_clones_of_one_snapshot_each_take_their_own_identity",
        ready,
        inside(),
    );
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
    // In its first two minutes a 6.x kernel reseeds its generator whenever the last reseed is
    // older than half its uptime (at least 1 s): a source snapshotted 3 s after boot lets its
    // clones reseed by themselves within 1.5 s, before they read, and the control below cannot
    // tell. The clones' clock runs on from the snapshot in host time (TCG's TSC), and the
    // second clone is restored only after the whole of the first one's checks: at 16 s of
    // uptime (an 8 s interval) a loaded CI machine once let the second clone's generator age
    // past it before its first read. Past 40 s of uptime the interval is 20 s.
    wait_for("the source up 40 s", Duration::from_secs(90), || {
        let vm = &vm;
        async move {
            let up = as_root(vm, "cut -d' ' -f1 /proc/uptime").await;
            up.trim()
                .parse::<f64>()
                .is_ok_and(|s| s >= MIN_SOURCE_UPTIME_SECS)
        }
    })
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
    // Checked after the snapshot, so that nothing slow runs in the guest between its reseed and
    // the snapshot (its generator must stay young for the clones): the snapshot holds what
    // the source held when paused, so its connections survived the reseed if they are here.
    vm.resume().await.unwrap();
    assert_eq!(established_on(&vm, SOURCE).await, 3);
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

// ---- Four clones at once, on one network, sharing the snapshot's pages ----

/// The bridge the four clones' TAPs join in the test's namespace (the node's side).
const BRIDGE: &str = "impclbr0";
/// How many clones run at once.
const CLONES: u8 = 4;
/// MiB of random data the source holds in a tmpfs, which every clone then reads.
const BLOB_MIB: u32 = 48;

/// A QEMU that maps a read-only file private (≥ 8.2): `IMP_TEST_QEMU_10`, else the one
/// `scripts/fetch-qemu-10.sh` unpacks; none skips (fails under `CI=true`).
fn qemu_10() -> Option<PathBuf> {
    let path = env_path(
        "IMP_TEST_QEMU_10",
        PathBuf::from("/usr/local/lib/imp-test/qemu-10/usr/bin/qemu-system-x86_64"),
    );
    imp_testenv::guard::require(
        path.is_file(),
        &format!(
            "QEMU ≥ 8.2 at {} (scripts/fetch-qemu-10.sh, as root)",
            path.display()
        ),
    )
    .then_some(path)
}

/// The RAM mapping of QEMU `pid` (the file-backed mapping of the guest's size), from
/// /proc/PID/smaps: (Rss, Pss, Shared_Clean + Shared_Dirty, Private_Clean + Private_Dirty),
/// in KiB; and the whole process's Pss (smaps_rollup).
fn ram_use(pid: u32, memory_mib: u32) -> ([u64; 4], u64) {
    let smaps = fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let field = |block: &[&str], name: &str| -> u64 {
        block
            .iter()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    let lines: Vec<&str> = smaps.lines().collect();
    let mut ram = None;
    let mut i = 0;
    while i < lines.len() {
        let header: Vec<&str> = lines[i].split_whitespace().collect();
        let end = lines[i + 1..]
            .iter()
            .position(|l| {
                // A mapping's header starts with its range; its fields with `Name:`.
                l.split_whitespace()
                    .next()
                    .is_some_and(|w| w.contains('-') && !w.ends_with(':'))
            })
            .map_or(lines.len(), |p| i + 1 + p);
        let block = &lines[i + 1..end];
        let file_backed = header.get(4).is_some_and(|inode| *inode != "0");
        if file_backed && field(block, "Size:") == u64::from(memory_mib) << 10 {
            ram = Some([
                field(block, "Rss:"),
                field(block, "Pss:"),
                field(block, "Shared_Clean:") + field(block, "Shared_Dirty:"),
                field(block, "Private_Clean:") + field(block, "Private_Dirty:"),
            ]);
        }
        i = end;
    }
    let rollup = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let rollup: Vec<&str> = rollup.lines().collect();
    let ram = ram.unwrap_or_else(|| panic!("no {memory_mib} MiB file mapping in QEMU {pid}"));
    (ram, field(&rollup, "Pss:"))
}

/// Reads the whole blob (every page of it: busybox's `cat` to /dev/null would only splice)
/// and prints its digest.
const READ_BLOB: &str = "md5sum /mnt/d/blob";

/// How the clones get their RAM from the snapshot's memory image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ram {
    /// The image itself, read-only, mapped private by each (what the agent does under QEMU ≥ 8.2).
    Mapped,
    /// A copy each, mapped shared (what it does under 7.2).
    Copied,
}

/// What one round of clones measured.
struct Round {
    /// Per clone: its RAM mapping's [Rss, Pss, shared, private] KiB.
    ram: Vec<[u64; 4]>,
    /// Per clone: the whole QEMU's Pss, KiB.
    process_pss: Vec<u64>,
    /// Per clone: 16 random bytes read after its reidentification.
    random: Vec<String>,
}

/// Restores `CLONES` clones of the snapshot in `snap` at once, each on its own TAP of the
/// bridge with its own identity; checks that each answers on its address (from the node and
/// from another clone) and reads the source's data; measures their memory; stops them.
async fn clone_round(
    inputs: &Inputs,
    source: &VmConfig,
    snap: &Path,
    ram: Ram,
    source_data: &str,
) -> Round {
    let files =
        imp_agent::runtime::shim::snapshot::vmm_files(snap, &GuestMemory::Shared(PathBuf::new()));
    let mut vms = Vec::new();
    for n in 1..=CLONES {
        let dir = snap.parent().unwrap().join(format!("{ram:?}-{n}"));
        fs::create_dir_all(&dir).unwrap();
        let disk = dir.join("disk.ext4");
        fs::copy(&source.drives[0].path, &disk).unwrap();
        let memory = match ram {
            Ram::Mapped => GuestMemory::Private(snap.join("memory")),
            Ram::Copied => {
                let own = dir.join("memory.ram");
                imp_agent::snapshot::sparse::copy(&snap.join("memory"), &own).unwrap();
                GuestMemory::Shared(own)
            }
        };
        let config = VmConfig {
            id: format!("clone-{ram:?}-{n}"),
            run_dir: dir.join("run"),
            drives: vec![DriveConfig {
                path: disk,
                ..source.drives[0].clone()
            }],
            net: Some(NetConfig {
                id: "net0".into(),
                tap: format!("impcl{n}"),
                mac: Some(SOURCE_MAC.into()),
                tap_fd: None,
            }),
            vsock: Some(VsockConfig {
                guest_cid: CID + u32::from(n),
            }),
            confine: Some(Confine {
                uid: 3_900_000 + CID + u32::from(n),
                gid: 3_900_000 + CID + u32::from(n),
            }),
            memory,
            ..source.clone()
        };
        let mut vm = Qemu::restore(&inputs.launcher, &config, &files, false)
            .await
            .unwrap_or_else(|e| panic!("restoring clone {n} ({ram:?}): {e}"));
        vm.set_link(false).await.unwrap();
        vm.resume().await.unwrap();
        let identity = Identity {
            hostname: Some(format!("clone-{n}")),
            mac: Some(format!("02:00:0a:d5:00:{:02x}", 20 + n)),
            network: Some(NetworkConfig {
                interface: "eth0".into(),
                address: clone_address(n),
                prefix_len: 24,
                gateway: Some(GATEWAY),
                dns: vec![],
                search: vec![],
                mtu: None,
            }),
        };
        let report = guest_agent::reidentify(
            &vm.vsock_path().unwrap(),
            AGENT_PORT,
            &identity,
            Duration::from_secs(60),
        )
        .await
        .unwrap_or_else(|e| panic!("{}\n{}", imp_testenv::report::chain(&e), serial(&vm)));
        assert!(report.is_complete(), "clone {n}: {report}");
        vm.set_link(true).await.unwrap();
        vms.push(vm);
    }
    // All four run at once: each answers on its own address, to the node and to a sibling,
    // holds the source's data (read through, so its pages are mapped) and its own randomness.
    let mut round = Round {
        ram: Vec::new(),
        process_pss: Vec::new(),
        random: Vec::new(),
    };
    for (i, vm) in vms.iter().enumerate() {
        let n = u8::try_from(i).unwrap() + 1;
        let busybox = inputs.busybox.to_str().unwrap();
        sh(&[
            busybox,
            "ping",
            "-c",
            "1",
            "-W",
            "10",
            &clone_address(n).to_string(),
        ]);
        let sibling = clone_address(n % CLONES + 1);
        as_root(vm, &format!("ping -c 1 -W 10 {sibling}")).await;
        let data = as_root(vm, READ_BLOB).await;
        assert_eq!(data, source_data, "clone {n} lacks the source's data");
        round.random.push(urandom(vm).await);
    }
    for vm in &vms {
        let (ram_kib, pss) = ram_use(vm.pid().unwrap(), source.memory_mib);
        round.ram.push(ram_kib);
        round.process_pss.push(pss);
    }
    for vm in vms {
        vm.stop(Duration::ZERO).await.unwrap();
    }
    round
}

fn clone_address(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 20 + n)
}

#[test]
fn four_clones_at_once_share_their_snapshots_pages_and_each_answer_on_their_own_address() {
    let inside_ns = std::env::var_os(MARK).is_some();
    let ready = inside_ns || (inputs().is_some() && qemu_10().is_some());
    in_own_namespace(
        "four_clones_at_once_share_their_snapshots_pages_and_each_answer_on_their_own_address",
        ready,
        clones_at_once(),
    );
}

async fn clones_at_once() {
    let mut inputs = inputs().unwrap();
    inputs.launcher.qemu = qemu_10().unwrap();
    sh(&["ip", "link", "set", "lo", "up"]);
    sh(&["ip", "link", "add", BRIDGE, "type", "bridge"]);
    sh(&["ip", "addr", "add", &format!("{GATEWAY}/24"), "dev", BRIDGE]);
    sh(&["ip", "link", "set", BRIDGE, "up"]);
    for tap in (0..=CLONES).map(|n| format!("impcl{n}")) {
        imp_net::tap::create_persistent(&tap).unwrap();
        sh(&["ip", "link", "set", &tap, "master", BRIDGE, "up"]);
    }
    let dir = std::env::temp_dir().join(format!("imp-qemu-clones-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let mut source = vm_config(&inputs, &dir).await;
    let ram_file = dir.join("source.ram");
    source.memory = GuestMemory::Shared(ram_file.clone());
    source.net.as_mut().unwrap().tap = "impcl0".into();

    let mut vm = Qemu::boot(&inputs.launcher, &source).await.unwrap();
    as_root(
        &vm,
        &format!(
            "mkdir -p /mnt/d && mount -t tmpfs -o size=64m t /mnt/d && \
             head -c {} /dev/urandom > /mnt/d/blob",
            BLOB_MIB << 20
        ),
    )
    .await;
    let source_data = as_root(&vm, READ_BLOB).await;
    assert!(
        source_data.starts_with(char::is_alphanumeric),
        "{source_data}"
    );
    // The snapshot as the agent takes one of a VM whose RAM is its file: device state in the
    // stream, the RAM file copied sparse, the directory root's, the image readable (a
    // confined clone's jail binds it read-only).
    let snap = dir.join("snapshot");
    fs::create_dir_all(&snap).unwrap();
    vm.pause().await.unwrap();
    vm.snapshot(&imp_agent::runtime::shim::snapshot::vmm_files(
        &snap,
        &source.memory,
    ))
    .await
    .unwrap();
    imp_agent::snapshot::sparse::copy(&ram_file, &snap.join("memory")).unwrap();
    vm.stop(Duration::ZERO).await.unwrap();
    fs::set_permissions(&snap, fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(snap.join("memory"), fs::Permissions::from_mode(0o644)).unwrap();
    let image_sum = || sh(&["sha256sum", snap.join("memory").to_str().unwrap()]);
    let image_before = image_sum();

    let mapped = clone_round(&inputs, &source, &snap, Ram::Mapped, &source_data).await;
    assert_eq!(
        image_sum(),
        image_before,
        "a clone wrote the snapshot's image"
    );
    let copied = clone_round(&inputs, &source, &snap, Ram::Copied, &source_data).await;

    for round in [&mapped, &copied] {
        let mut distinct = round.random.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            round.random.len(),
            "clones read the same random bytes: {:?}",
            round.random
        );
    }
    let total = |r: &Round, k: usize| r.ram.iter().map(|m| m[k]).sum::<u64>() >> 10;
    let process = |r: &Round| r.process_pss.iter().sum::<u64>() >> 10;
    for (name, r) in [
        ("mapped private (one image)", &mapped),
        ("copied (own file each)", &copied),
    ] {
        eprintln!(
            "FIGURES {CLONES} clones of a 256 MiB guest ({BLOB_MIB} MiB of data read by each), {name}: \
             guest RAM Rss {} MiB, Pss {} MiB (shared {} MiB, private {} MiB); QEMU processes' Pss {} MiB",
            total(r, 0),
            total(r, 1),
            total(r, 2),
            total(r, 3),
            process(r)
        );
    }
    eprintln!(
        "FIGURES {CLONES} clones' guest RAM, mapped / copied: {:.2} (Pss), whole QEMUs {:.2}",
        total(&mapped, 1) as f64 / total(&copied, 1).max(1) as f64,
        process(&mapped) as f64 / process(&copied).max(1) as f64
    );
    // Each clone read the source's data: with one image mapped private those pages are one
    // copy shared by all, with a file each they are CLONES copies.
    for m in &mapped.ram {
        assert!(
            m[2] >= u64::from(BLOB_MIB) << 10,
            "a mapped clone shares too little: {m:?}"
        );
    }
    assert!(
        total(&mapped, 1) * 2 < total(&copied, 1),
        "clones mapping one image use {} MiB of RAM, clones with copies {} MiB",
        total(&mapped, 1),
        total(&copied, 1)
    );
    let _ = fs::remove_dir_all(&dir);
}
