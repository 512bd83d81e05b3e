//! The Firecracker driver against the real Firecracker v1.12.1 with a bare-metal guest.
//!
//! Binaries: `IMP_FIRECRACKER_BIN` / `IMP_JAILER_BIN`, else `target/firecracker/{firecracker,
//! jailer}` (fill it with `scripts/fetch-firecracker.sh target/firecracker`). The guest is
//! `tests/guest/baremetal.S`, assembled here with `as` and `ld`. The spec check reads
//! Firecracker's OpenAPI spec from `IMP_FIRECRACKER_SPEC`, else
//! `../shared/reference/firecracker-api/firecracker.yaml` beside the checkout. Tests that need root, KVM, the
//! tools or the binaries skip on a developer machine and fail under `CI=true`. Run with
//! `--nocapture` to see the measured snapshot and restore times.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use imp_testenv::{guard, workspace_root};
use imp_vmm::firecracker::{self, Firecracker, JailerConfig, Launcher, Layout, api, plan};
use imp_vmm::{
    DriveConfig, NetConfig, SnapshotFiles, StopOutcome, VmConfig, VmState, Vmm, VsockConfig,
};
use serde_yaml_ng::Value;

const GUEST_SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/guest/baremetal.S");
const DEFAULT_SPEC: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/reference/firecracker-api/firecracker.yaml"
);
const BANNER: &str = "IMP BAREMETAL GUEST";

static SEQ: AtomicUsize = AtomicUsize::new(0);

// ---------------------------------------------------------------- environment

fn binary(env: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    Some(target.join("firecracker").join(name)).filter(|p| p.is_file())
}

fn kvm_rw() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// A directory removed on drop (kept if `IMP_KEEP_TEST_DIRS` is set).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        // Short: Unix socket paths must stay under 108 bytes.
        let p = PathBuf::from(format!("/tmp/imp-fc-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("IMP_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Empty directories (cgroups the jailer created) removed on drop.
struct RmdirOnDrop(Vec<PathBuf>);

impl Drop for RmdirOnDrop {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// A network namespace with one persistent TAP in it, deleted on drop (which deletes the TAP).
struct Netns {
    name: String,
}

impl Netns {
    fn with_tap(tap: &str) -> Self {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let name = format!("imp-fc-{}-{n}", std::process::id());
        run("ip", &["netns", "add", &name]);
        let ns = Netns { name };
        // Firecracker opens the TAP by name through /dev/net/tun inside its namespace.
        run(
            "ip",
            &[
                "netns", "exec", &ns.name, "ip", "tuntap", "add", "dev", tap, "mode", "tap",
            ],
        );
        run(
            "ip",
            &["netns", "exec", &ns.name, "ip", "link", "set", tap, "up"],
        );
        ns
    }
}

impl Netns {
    /// Adds TAP `tap`, up, to the namespace.
    fn add_tap(&self, tap: &str) {
        let exec = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &self.name];
            all.extend_from_slice(args);
            run("ip", &all);
        };
        exec(&["ip", "tuntap", "add", "dev", tap, "mode", "tap"]);
        exec(&["ip", "link", "set", tap, "up"]);
    }

    /// Whether `tap` is administratively up.
    fn is_up(&self, tap: &str) -> bool {
        let out = Command::new("ip")
            .args(["-n", &self.name, "-o", "link", "show", tap])
            .output()
            .unwrap();
        let line = String::from_utf8_lossy(&out.stdout).into_owned();
        let flags = line.split('<').nth(1).and_then(|f| f.split('>').next());
        flags.unwrap_or_default().split(',').any(|f| f == "UP")
    }
}

/// The TAP names process `pid` holds open through /dev/net/tun (`iff:` in its fdinfo).
fn taps_of(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("iff:").map(|t| t.trim().to_owned()))
        })
        .collect()
}

/// The inodes of the files process `pid` maps (from /proc/PID/maps).
fn mapped_inodes(pid: u32) -> BTreeSet<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .filter(|i| *i != 0)
        .collect()
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Assembles and links the bare-metal guest into `dir`.
fn build_guest(dir: &Path) -> PathBuf {
    let obj = dir.join("guest.o");
    let elf = dir.join("guest.elf");
    run("as", &[GUEST_SRC, "-o", obj.to_str().unwrap()]);
    run(
        "ld",
        &[
            "-nostdlib",
            "-static",
            "-Ttext=0x200000",
            "-e",
            "_start",
            obj.to_str().unwrap(),
            "-o",
            elf.to_str().unwrap(),
        ],
    );
    elf
}

/// A small drive: ext4 when mkfs.ext4 is there, else a raw zeroed file.
fn make_drive(dir: &Path) -> PathBuf {
    let p = dir.join("rootfs.ext4");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(8 << 20).unwrap();
    if guard::which("mkfs.ext4").is_some() {
        run("mkfs.ext4", &["-q", "-F", p.to_str().unwrap()]);
    }
    p
}

fn base_config(id: &str, dir: &Path, kernel: &Path) -> VmConfig {
    VmConfig {
        id: id.to_owned(),
        run_dir: dir.join(id),
        vcpus: 1,
        memory_mib: 128,
        kernel: kernel.to_owned(),
        initrd: None,
        kernel_args: "console=ttyS0".to_owned(),
        drives: vec![],
        net: None,
        vsock: None,
        netns: None,
        confine: None,
        memory: Default::default(),
    }
}

/// Everything the Firecracker tests need, or `None` after reporting what is missing.
struct Env {
    firecracker: PathBuf,
    jailer: Option<PathBuf>,
}

fn firecracker_env() -> Option<Env> {
    let fc = binary("IMP_FIRECRACKER_BIN", "firecracker");
    if !guard::require(
        fc.is_some(),
        "firecracker binary (IMP_FIRECRACKER_BIN or scripts/fetch-firecracker.sh target/firecracker)",
    ) {
        return None;
    }
    Some(Env {
        firecracker: fc?,
        jailer: binary("IMP_JAILER_BIN", "jailer"),
    })
}

/// Root, KVM, `as`, `ld`, the binaries — or skip/fail.
/// The jailer beside the Firecracker of `env`; `None` (and a failure under `CI=true`) without.
fn jailer(env: &Env) -> Option<PathBuf> {
    let found = env.jailer.clone();
    if found.is_none() {
        guard::require(
            false,
            "jailer binary (IMP_JAILER_BIN or target/firecracker/jailer)",
        );
    }
    found
}

/// The cgroup version of this host, as the jailer is told it: 2 on a unified hierarchy.
fn cgroup_version() -> u8 {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        2
    } else {
        1
    }
}

fn vm_env() -> Option<Env> {
    if !guard::require(guard::is_root(), "root (network namespaces, jailer)")
        || !guard::require(kvm_rw(), "/dev/kvm openable read-write")
        || !guard::require(guard::which("as").is_some(), "tool `as` on PATH (binutils)")
        || !guard::require(guard::which("ld").is_some(), "tool `ld` on PATH (binutils)")
        || !guard::require(guard::which("ip").is_some(), "tool `ip` on PATH (iproute2)")
    {
        return None;
    }
    firecracker_env()
}

// ---------------------------------------------------------------- serial log

/// The tick numbers of complete `tick N` lines.
fn ticks(log: &Path) -> Vec<u64> {
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
    let complete = match text.rfind('\n') {
        Some(i) => &text[..i],
        None => "",
    };
    complete
        .lines()
        .filter_map(|l| l.strip_prefix("tick "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

fn last_tick(log: &Path) -> Option<u64> {
    ticks(log).last().copied()
}

/// Waits until the guest has printed a tick of at least `min`.
async fn wait_tick(log: &Path, min: u64, timeout: Duration) -> u64 {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(t) = last_tick(log).filter(|t| *t >= min) {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "guest did not print tick {min} within {timeout:?}; serial log:\n{}",
            String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn count(log: &Path, needle: &str) -> usize {
    String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default())
        .matches(needle)
        .count()
}

/// Every complete tick line continues the one before: no restart, no gap.
fn assert_consecutive(log: &Path) {
    let t = ticks(log);
    for w in t.windows(2) {
        assert_eq!(w[1], w[0] + 1, "ticks not consecutive: {t:?}");
    }
    assert_eq!(t.first(), Some(&0), "ticks do not start at 0: {t:?}");
    // Only the guest writes to the serial log (Firecracker's own lines go to its log file).
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap()).into_owned();
    for line in text.lines() {
        assert!(
            line == BANNER || line == "IMP GUEST RESET" || line.starts_with("tick "),
            "foreign line in the serial log: {line:?}"
        );
    }
    assert_eq!(count(log, BANNER), 1, "guest booted more than once");
}

fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// Live (not zombie) processes whose command line mentions `path`.
fn processes_mentioning(path: &Path) -> usize {
    let needle = path.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(&needle) && process_alive(*pid)
        })
        .count()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------- lifecycle tests

/// Pause, snapshot, kill and restore in a new process with drive, TAP-in-netns and vsock: the
/// guest's counter continues where it stopped; a graceful stop makes the guest reset.
#[tokio::test]
async fn boot_pause_snapshot_restore_continues_counter() {
    let Some(env) = vm_env() else { return };
    let dir = TempDir::new("life");
    let kernel = build_guest(&dir.0);
    let drive = make_drive(&dir.0);
    let netns = Netns::with_tap("imp-tap0");
    let launcher = Launcher::new(&env.firecracker);
    let mut config = base_config("life", &dir.0, &kernel);
    config.drives = vec![DriveConfig {
        id: "rootfs".into(),
        path: drive,
        read_only: false,
        root: true,
    }];
    config.net = Some(NetConfig {
        id: "eth0".into(),
        tap: "imp-tap0".into(),
        mac: Some("06:00:ac:10:00:02".into()),
        tap_fd: None,
    });
    config.vsock = Some(VsockConfig { guest_cid: 3 });
    config.netns = Some(netns.name.clone());

    let mut vm = Firecracker::boot(&launcher, &config).await.unwrap();
    let log = vm.serial_log_path().to_owned();
    let info = vm.instance_info().await.unwrap();
    assert_eq!(info.id, "life");
    assert_eq!(info.state, "Running");
    assert!(info.vmm_version.starts_with("1.12"), "{info:?}");
    wait_tick(&log, 3, Duration::from_secs(20)).await;

    // The vsock device is there; the bare-metal guest never listens, so connect must give up
    // at its deadline, not hang.
    let uds = vm.vsock_path().unwrap();
    assert!(uds.exists(), "vsock socket {} missing", uds.display());
    let started = Instant::now();
    let err = vm
        .connect_vsock(52, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(err, firecracker::Error::Vsock(_)),
        "unexpected vsock error: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "vsock deadline overrun"
    );

    // Pause: the counter stops.
    vm.pause().await.unwrap();
    assert_eq!(vm.state(), VmState::Paused);
    assert_eq!(vm.instance_info().await.unwrap().state, "Paused");
    let paused_at = last_tick(&log).unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        last_tick(&log),
        Some(paused_at),
        "counter advanced while paused"
    );

    // Full snapshot, then kill the process.
    let snap = SnapshotFiles {
        state: dir.0.join("snap/vm.state"),
        memory: dir.0.join("snap/vm.mem"),
    };
    let started = Instant::now();
    vm.snapshot(&snap).await.unwrap();
    let create = started.elapsed();
    assert_eq!(
        std::fs::metadata(&snap.memory).unwrap().len(),
        128 << 20,
        "memory file is not the guest's 128 MiB"
    );
    assert!(std::fs::metadata(&snap.state).unwrap().len() > 0);
    let pid = vm.pid().unwrap();
    assert_eq!(vm.stop(Duration::ZERO).await.unwrap(), StopOutcome::Killed);
    assert!(
        !process_alive(pid),
        "firecracker {pid} still alive after stop"
    );
    assert_eq!(last_tick(&log), Some(paused_at));

    // Restore in a new process (same TAP name in the same netns) and resume.
    let started = Instant::now();
    let mut vm = Firecracker::restore(&launcher, &config, &snap, true)
        .await
        .unwrap();
    let restore = started.elapsed();
    assert_ne!(vm.pid(), Some(pid));
    assert_eq!(vm.instance_info().await.unwrap().state, "Running");
    let t = wait_tick(&log, paused_at + 1, Duration::from_secs(20)).await;
    let first_tick = started.elapsed();
    assert!(t > paused_at);
    assert_consecutive(&log);

    // Pause/resume still work on the restored VM.
    vm.pause().await.unwrap();
    vm.resume().await.unwrap();
    wait_tick(&log, t + 2, Duration::from_secs(20)).await;
    assert_consecutive(&log);

    // Graceful stop: Ctrl+Alt+Del reaches the guest, which resets; Firecracker exits.
    assert_eq!(
        vm.stop(Duration::from_secs(10)).await.unwrap(),
        StopOutcome::Graceful
    );
    assert_eq!(count(&log, "IMP GUEST RESET"), 1);
    assert!(!uds.exists(), "vsock socket left behind");

    println!(
        "MEASURED bare-metal guest, 128 MiB: snapshot create {:.1} ms, restore (spawn + load + \
         resume) {:.1} ms, restore to first new serial tick {:.1} ms",
        create.as_secs_f64() * 1e3,
        restore.as_secs_f64() * 1e3,
        first_tick.as_secs_f64() * 1e3
    );
}

/// The jailer path: chroot, uid/gid, cgroup v1, netns; snapshot and restore inside jails.
#[tokio::test]
async fn jailer_boot_snapshot_restore() {
    let Some(env) = vm_env() else { return };
    let Some(jailer) = jailer(&env) else { return };
    let dir = TempDir::new("jail");
    let kernel = build_guest(&dir.0);
    let drive = make_drive(&dir.0);
    let netns = Netns::with_tap("imp-tap1");
    let cgroup_version = cgroup_version();
    let mut launcher = Launcher::new(&env.firecracker);
    launcher.jailer = Some(JailerConfig {
        binary: jailer,
        chroot_base: dir.0.join("j"),
        uid: 40123,
        gid: 40123,
        cgroup_version,
        cgroups: vec!["pids.max=64".into()],
        parent_cgroup: Some("imp-test".into()),
    });
    let _cgroups = RmdirOnDrop(vec![
        PathBuf::from("/sys/fs/cgroup/pids/imp-test/clone1"),
        PathBuf::from("/sys/fs/cgroup/pids/imp-test/clone2"),
        PathBuf::from("/sys/fs/cgroup/imp-test/clone1"),
        PathBuf::from("/sys/fs/cgroup/imp-test/clone2"),
        PathBuf::from("/sys/fs/cgroup/pids/imp-test/jailed"),
        PathBuf::from("/sys/fs/cgroup/pids/imp-test"),
        PathBuf::from("/sys/fs/cgroup/imp-test/jailed"),
        PathBuf::from("/sys/fs/cgroup/imp-test"),
    ]);
    let mut config = base_config("jailed", &dir.0, &kernel);
    config.drives = vec![DriveConfig {
        id: "rootfs".into(),
        path: drive,
        read_only: false,
        root: true,
    }];
    config.net = Some(NetConfig {
        id: "eth0".into(),
        tap: "imp-tap1".into(),
        mac: None,
        tap_fd: None,
    });
    config.vsock = Some(VsockConfig { guest_cid: 3 });
    config.netns = Some(netns.name.clone());

    let mut vm = Firecracker::boot(&launcher, &config).await.unwrap();
    let log = vm.serial_log_path().to_owned();
    let pid = vm.pid().unwrap();
    let root = vm.layout().root.clone();
    wait_tick(&log, 2, Duration::from_secs(20)).await;

    // Really jailed: chroot, uid, cgroup, netns.
    // The jailer pivots into the jail in its own mount namespace: its `/` is the jail root.
    let its_root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(
        its_root.join(firecracker::files::KERNEL).is_file(),
        "kernel not at the jail's /"
    );
    assert!(
        !its_root.join("usr").exists(),
        "process sees the host's / (not jailed)"
    );
    assert!(
        root.join(firecracker::files::API_SOCKET).exists(),
        "API socket not in the jail"
    );
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.contains("40123")),
        "not running as uid 40123:\n{status}"
    );
    // Unprivileged and filtered: no capability, no_new_privs, Firecracker's seccomp filters.
    let confined = imp_testenv::procfs::Status::of(pid);
    eprintln!("jailed Firecracker {}", confined.summary());
    assert_eq!(confined.field("CapEff"), "0000000000000000");
    assert_eq!(confined.field("NoNewPrivs"), "1");
    assert_eq!(confined.field("Seccomp"), "2");
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        cgroups.contains("imp-test/jailed"),
        "not in its cgroup:\n{cgroups}"
    );
    let netns_of = |p: &str| std::fs::read_link(p).unwrap();
    assert_eq!(
        netns_of(&format!("/proc/{pid}/ns/net")),
        {
            let ns = std::fs::metadata(format!("/var/run/netns/{}", netns.name)).unwrap();
            use std::os::unix::fs::MetadataExt;
            PathBuf::from(format!("net:[{}]", ns.ino()))
        },
        "not in the VM's network namespace"
    );
    assert!(vm.vsock_path().unwrap().exists());

    vm.pause().await.unwrap();
    let paused_at = last_tick(&log).unwrap();
    let snap = SnapshotFiles {
        state: dir.0.join("snap/vm.state"),
        memory: dir.0.join("snap/vm.mem"),
    };
    let started = Instant::now();
    vm.snapshot(&snap).await.unwrap();
    let create = started.elapsed();
    assert!(
        snap.state.is_file() && snap.memory.is_file(),
        "snapshot not moved out of the jail"
    );
    assert_eq!(vm.stop(Duration::ZERO).await.unwrap(), StopOutcome::Killed);
    assert!(!root.exists(), "jail not removed after stop");

    let started = Instant::now();
    let vm = Firecracker::restore(&launcher, &config, &snap, true)
        .await
        .unwrap();
    let restore = started.elapsed();
    wait_tick(&log, paused_at + 2, Duration::from_secs(20)).await;
    assert_consecutive(&log);
    assert_eq!(
        vm.stop(Duration::from_secs(10)).await.unwrap(),
        StopOutcome::Graceful
    );
    assert!(!root.exists(), "jail not removed after stop");

    // The snapshot restored into two new VMs at once (as the agent restores a VM from an
    // ImpVMSnapshot): each its own jail and uid, its own TAP (`network_overrides`), its own
    // disk, both mapping the one memory image (hard-linked into each jail), each kept off its
    // network (its TAP down) until let on. The agent opens the snapshot's files to the
    // clones' uids as here.
    for f in [&snap.state, &snap.memory] {
        std::fs::set_permissions(
            f,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o644),
        )
        .unwrap();
    }
    let mut clones = Vec::new();
    for (i, tap) in [(1u32, "imp-tap2"), (2, "imp-tap3")] {
        netns.add_tap(tap);
        let mut l = launcher.clone();
        let j = l.jailer.as_mut().unwrap();
        (j.uid, j.gid) = (40123 + i, 40123 + i);
        let mut c = config.clone();
        c.id = format!("clone{i}");
        c.drives[0].path = dir.0.join(format!("clone{i}.ext4"));
        std::fs::copy(&config.drives[0].path, &c.drives[0].path).unwrap();
        c.net.as_mut().unwrap().tap = tap.into();
        let mut vm = Firecracker::restore(&l, &c, &snap, false).await.unwrap();
        vm.set_link(false).await.unwrap();
        assert!(!netns.is_up(tap), "{tap} still up");
        vm.resume().await.unwrap();
        clones.push((vm, tap));
    }
    use std::os::unix::fs::MetadataExt as _;
    let image = std::fs::metadata(&snap.memory).unwrap().ino();
    for (vm, tap) in &mut clones {
        wait_tick(vm.serial_log_path(), paused_at + 2, Duration::from_secs(20)).await;
        let pid = vm.pid().unwrap();
        assert_eq!(taps_of(pid), [tap.to_string()], "clone on {tap}");
        assert!(
            mapped_inodes(pid).contains(&image),
            "the clone on {tap} does not map the snapshot's memory image"
        );
        vm.set_link(true).await.unwrap();
        assert!(netns.is_up(tap), "{tap} not back up");
    }
    for (vm, _) in clones {
        vm.stop(Duration::ZERO).await.unwrap();
    }
    let cgroup = if cgroup_version == 2 {
        PathBuf::from("/sys/fs/cgroup/imp-test/jailed")
    } else {
        PathBuf::from("/sys/fs/cgroup/pids/imp-test/jailed")
    };
    assert!(!cgroup.exists(), "cgroup {} left behind", cgroup.display());
    println!(
        "MEASURED jailed bare-metal guest, 128 MiB: snapshot create {:.1} ms, restore {:.1} ms",
        create.as_secs_f64() * 1e3,
        restore.as_secs_f64() * 1e3
    );
}

/// Two VMs at once: both run, each with its own process, files and counter.
#[tokio::test]
async fn two_vms_at_once() {
    let Some(env) = vm_env() else { return };
    let dir = TempDir::new("two");
    let kernel = build_guest(&dir.0);
    let launcher = Launcher::new(&env.firecracker);
    let mut a_cfg = base_config("vm-a", &dir.0, &kernel);
    a_cfg.vsock = Some(VsockConfig { guest_cid: 3 });
    let mut b_cfg = base_config("vm-b", &dir.0, &kernel);
    b_cfg.vsock = Some(VsockConfig { guest_cid: 3 });
    b_cfg.memory_mib = 64;
    let (a, b) = tokio::join!(
        Firecracker::boot(&launcher, &a_cfg),
        Firecracker::boot(&launcher, &b_cfg)
    );
    let (mut a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.pid(), b.pid());
    assert_ne!(a.serial_log_path(), b.serial_log_path());
    wait_tick(a.serial_log_path(), 3, Duration::from_secs(20)).await;
    wait_tick(b.serial_log_path(), 3, Duration::from_secs(20)).await;
    assert_eq!(a.instance_info().await.unwrap().id, "vm-a");
    assert_eq!(b.instance_info().await.unwrap().id, "vm-b");

    // Pausing one leaves the other running.
    a.pause().await.unwrap();
    let a_at = last_tick(a.serial_log_path()).unwrap();
    let b_at = last_tick(b.serial_log_path()).unwrap();
    wait_tick(b.serial_log_path(), b_at + 3, Duration::from_secs(20)).await;
    assert_eq!(last_tick(a.serial_log_path()), Some(a_at));
    println!(
        "MEASURED two bare-metal VMs: RSS {} KiB and {} KiB",
        rss_kib(a.pid().unwrap()),
        rss_kib(b.pid().unwrap())
    );
    assert_eq!(a.stop(Duration::ZERO).await.unwrap(), StopOutcome::Killed);
    assert_eq!(
        b.stop(Duration::from_secs(10)).await.unwrap(),
        StopOutcome::Graceful
    );
}

/// Debian's cloud kernel, as `scripts/extract-vmlinux.sh` unpacks it from the bzImage, is an
/// ELF that Firecracker loads and starts. A Linux guest cannot run under this machine's PVM
/// KVM (FACTS.md), so this checks the load and start, not the boot; the bzImage itself is what
/// Firecracker refuses on x86_64.
#[tokio::test]
async fn firecracker_loads_the_extracted_debian_vmlinux() {
    let kdir = std::env::var_os("IMP_GUEST_KERNEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/guest-kernel"));
    let vmlinux = kdir.join("vmlinux");
    if !guard::require(
        vmlinux.is_file(),
        "target/guest-kernel/vmlinux (scripts/fetch-guest-kernel.sh)",
    ) {
        return;
    }
    let Some(env) = vm_env() else { return };
    let dir = TempDir::new("linux");
    let launcher = Launcher::new(&env.firecracker);
    let vm = Firecracker::boot(&launcher, &base_config("linux", &dir.0, &vmlinux))
        .await
        .unwrap();
    assert_eq!(vm.instance_info().await.unwrap().state, "Running");
    assert_eq!(vm.stop(Duration::ZERO).await.unwrap(), StopOutcome::Killed);

    let bzimage = kdir.join("vmlinuz");
    let refused = Firecracker::boot(&launcher, &base_config("bz", &dir.0, &bzimage)).await;
    assert!(
        refused.is_err(),
        "Firecracker should refuse a bzImage on x86_64"
    );
}

/// Firecracker's rejections surface with the endpoint and its fault_message; the failed
/// process does not outlive the error.
#[tokio::test]
async fn api_errors_name_endpoint_and_fault_message() {
    let Some(env) = firecracker_env() else { return };
    let dir = TempDir::new("err");
    let launcher = Launcher::new(&env.firecracker);
    let config = base_config("err", &dir.0, &dir.0.join("no-such-kernel"));
    let err = Firecracker::boot(&launcher, &config).await.unwrap_err();
    let msg = err.to_string();
    match &err {
        firecracker::Error::Api(api::Error::Rejected {
            path,
            status,
            fault_message,
            ..
        }) => {
            assert_eq!(path, "/boot-source");
            assert_eq!(*status, 400);
            assert!(!fault_message.is_empty());
        }
        other => panic!("expected a rejected /boot-source, got {other}"),
    }
    assert!(msg.contains("PUT /boot-source"), "{msg}");
    // The half-configured process was killed with the handle.
    let deadline = Instant::now() + Duration::from_secs(5);
    while processes_mentioning(&dir.0) > 0 {
        assert!(
            Instant::now() < deadline,
            "firecracker outlived the failed boot"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!config.run_dir.join(firecracker::files::API_SOCKET).exists());

    // A bad id is refused before any process starts.
    let bad = base_config("no/slash", &dir.0, &dir.0.join("k"));
    assert!(matches!(
        Firecracker::boot(&launcher, &bad).await,
        Err(firecracker::Error::InvalidId { .. })
    ));
}

// ---------------------------------------------------------------- spec conformance

fn spec() -> Option<Value> {
    let path = std::env::var("IMP_FIRECRACKER_SPEC").unwrap_or_else(|_| DEFAULT_SPEC.into());
    if !guard::require(
        Path::new(&path).is_file(),
        "Firecracker OpenAPI spec (IMP_FIRECRACKER_SPEC or ../shared/reference beside the checkout)",
    ) {
        return None;
    }
    Some(serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap())
}

fn definition<'a>(spec: &'a Value, name: &str) -> &'a Value {
    let d = &spec["definitions"][name];
    assert!(!d.is_null(), "definition {name} not in the spec");
    d
}

fn ref_name(schema: &Value) -> Option<&str> {
    schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/definitions/"))
}

/// Checks `value` against `schema`: types, enums, required and no unknown properties.
fn check(spec: &Value, schema: &Value, value: &serde_json::Value, at: &str) {
    if let Some(name) = ref_name(schema) {
        return check(
            spec,
            definition(spec, name),
            value,
            &format!("{at}<{name}>"),
        );
    }
    let ty = schema.get("type").and_then(Value::as_str);
    match (ty, value) {
        (Some("object") | None, serde_json::Value::Object(map)) => {
            let props = schema.get("properties").and_then(Value::as_mapping);
            let required: Vec<&str> = schema
                .get("required")
                .and_then(Value::as_sequence)
                .map(|s| s.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            for r in &required {
                assert!(map.contains_key(*r), "{at}: required property {r} missing");
            }
            for (k, v) in map {
                let sub = props
                    .and_then(|p| p.get(Value::String(k.clone())))
                    .unwrap_or_else(|| panic!("{at}: property {k} is not in the spec"));
                check(spec, sub, v, &format!("{at}.{k}"));
            }
        }
        (Some("string"), serde_json::Value::String(s)) => {
            if let Some(e) = schema.get("enum").and_then(Value::as_sequence) {
                let allowed: Vec<String> = e
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => s.clone(),
                        other => serde_yaml_ng::to_string(other).unwrap().trim().to_owned(),
                    })
                    .collect();
                assert!(allowed.contains(s), "{at}: {s:?} not one of {allowed:?}");
            }
        }
        (Some("integer"), serde_json::Value::Number(n)) => {
            assert!(n.is_u64() || n.is_i64(), "{at}: {n} is not an integer")
        }
        (Some("boolean"), serde_json::Value::Bool(_)) => {}
        (Some("array"), serde_json::Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                check(spec, &schema["items"], item, &format!("{at}[{i}]"));
            }
        }
        (ty, v) => panic!("{at}: {v} does not match spec type {ty:?}"),
    }
}

/// Checks one request: its path and method are in the spec, and its body follows the body
/// parameter's definition.
fn check_request(spec: &Value, req: &api::Request, seen: &mut BTreeSet<String>) {
    let op = &spec["paths"][req.template][req.method.spec_name()];
    assert!(
        !op.is_null(),
        "{} {} not in the spec",
        req.method,
        req.template
    );
    let body_param = op
        .get("parameters")
        .and_then(Value::as_sequence)
        .and_then(|ps| ps.iter().find(|p| p["in"].as_str() == Some("body")));
    match (&req.body, body_param) {
        (Some(body), Some(param)) => {
            let schema = &param["schema"];
            assert_eq!(
                ref_name(schema),
                req.definition,
                "{} {}: body definition differs from the spec",
                req.method,
                req.path
            );
            check(spec, schema, body, &format!("{} {}", req.method, req.path));
            seen.insert(req.definition.unwrap_or_default().to_owned());
        }
        (None, None) => {}
        (b, p) => panic!(
            "{} {}: body {:?} but spec body parameter {:?}",
            req.method,
            req.path,
            b.is_some(),
            p.is_some()
        ),
    }
    if let Some(param) = body_param.filter(|p| p["required"].as_bool() == Some(true)) {
        assert!(
            req.body.is_some(),
            "{}: body required by {param:?}",
            req.path
        );
    }
}

/// The checker itself catches what it is there to catch.
#[test]
fn spec_checker_rejects_unknown_missing_and_bad_enum() {
    let Some(spec) = spec() else { return };
    let drive = definition(&spec, "Drive");
    let fails = |v: serde_json::Value| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            check(&spec, drive, &v, "t")
        }))
        .is_err()
    };
    assert!(!fails(
        serde_json::json!({"drive_id": "a", "is_root_device": true})
    ));
    assert!(
        fails(serde_json::json!({"drive_id": "a"})),
        "missing required"
    );
    assert!(fails(
        serde_json::json!({"drive_id": "a", "is_root_device": true, "bogus": 1})
    ));
    assert!(fails(
        serde_json::json!({"drive_id": "a", "is_root_device": true, "io_engine": "Fast"})
    ));
    assert!(fails(
        serde_json::json!({"drive_id": 1, "is_root_device": true})
    ));
}

/// Every body the driver can send, plain and jailed, follows firecracker.yaml.
#[test]
fn request_bodies_follow_the_spec() {
    let Some(spec) = spec() else { return };
    let mut config = base_config("spec", Path::new("/run/imp"), Path::new("/k/vmlinux"));
    config.initrd = Some("/k/initrd".into());
    config.drives = vec![
        DriveConfig {
            id: "rootfs".into(),
            path: "/img/root.ext4".into(),
            read_only: false,
            root: true,
        },
        DriveConfig {
            id: "data".into(),
            path: "/img/data.raw".into(),
            read_only: true,
            root: false,
        },
    ];
    config.net = Some(NetConfig {
        id: "eth0".into(),
        tap: "tap0".into(),
        mac: Some("06:00:00:00:00:01".into()),
        tap_fd: None,
    });
    config.vsock = Some(VsockConfig { guest_cid: 7 });
    let snap = SnapshotFiles {
        state: "/snap/s".into(),
        memory: "/snap/m".into(),
    };
    let plain = Launcher::new("/bin/firecracker");
    let mut jailed = plain.clone();
    jailed.jailer = Some(JailerConfig {
        binary: "/bin/jailer".into(),
        chroot_base: "/srv/jail".into(),
        uid: 1,
        gid: 1,
        cgroup_version: 1,
        cgroups: vec![],
        parent_cgroup: None,
    });
    let mut seen = BTreeSet::new();
    for launcher in [&plain, &jailed] {
        let layout = Layout::new(launcher, &config);
        let mut reqs = plan::boot(launcher, &config, &layout).unwrap();
        reqs.extend(plan::restore(launcher, &config, &layout, &snap, true).unwrap());
        reqs.extend(plan::restore(launcher, &config, &layout, &snap, false).unwrap());
        reqs.push(plan::snapshot_create(&layout, &snap).unwrap());
        reqs.push(api::Request::patch_vm(api::VmStateRequest::Paused).unwrap());
        reqs.push(api::Request::patch_vm(api::VmStateRequest::Resumed).unwrap());
        reqs.push(api::Request::put_action(api::ActionType::SendCtrlAltDel).unwrap());
        reqs.push(api::Request::get_instance_info());
        reqs.push(
            api::Request::put_logger(&api::Logger {
                log_path: layout.vmm(firecracker::files::LOG),
                level: Some(launcher.log_level.clone()),
                show_level: Some(true),
                show_log_origin: Some(false),
            })
            .unwrap(),
        );
        for req in &reqs {
            check_request(&spec, req, &mut seen);
        }
    }
    let expected: BTreeSet<String> = [
        "BootSource",
        "Drive",
        "InstanceActionInfo",
        "Logger",
        "MachineConfiguration",
        "NetworkInterface",
        "SnapshotCreateParams",
        "SnapshotLoadParams",
        "Vm",
        "Vsock",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(seen, expected);
}

/// Issue 38, item 5: a jailed Firecracker's API socket and hybrid vsock socket are in its jail
/// root, which its uid may write. A compromised Firecracker replaces both with symlinks to
/// sockets the test listens on (another VM's, a root-only one): the driver's next API call and
/// a vsock connect are refused by name, and nothing connects to the test's sockets.
#[tokio::test]
async fn a_jailed_firecracker_that_replaces_its_sockets_leads_root_nowhere() {
    let Some(env) = vm_env() else { return };
    let Some(jailer) = jailer(&env) else { return };
    let dir = TempDir::new("swap");
    let kernel = build_guest(&dir.0);
    let cgroup_version = cgroup_version();
    let mut launcher = Launcher::new(&env.firecracker);
    launcher.jailer = Some(JailerConfig {
        binary: jailer,
        chroot_base: dir.0.join("j"),
        uid: 40124,
        gid: 40124,
        cgroup_version,
        cgroups: vec![],
        parent_cgroup: None,
    });
    let mut config = base_config("swapped", &dir.0, &kernel);
    config.vsock = Some(VsockConfig { guest_cid: 3 });
    let mut vm = Firecracker::boot(&launcher, &config).await.unwrap();
    wait_tick(vm.serial_log_path(), 1, Duration::from_secs(20)).await;
    let root = vm.layout().root.clone();
    // What the check trusts: the jail root is the VMM's (its sockets are), its parent root's,
    // so the VMM cannot replace the jail root itself.
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(std::fs::metadata(&root).unwrap().uid(), 40124);
    assert_eq!(std::fs::metadata(root.parent().unwrap()).unwrap().uid(), 0);
    let elsewhere = dir.0.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let mut planted = Vec::new();
    for name in [firecracker::files::API_SOCKET, firecracker::files::VSOCK] {
        let target = elsewhere.join(name);
        let listener = std::os::unix::net::UnixListener::bind(&target).unwrap();
        listener.set_nonblocking(true).unwrap();
        let path = root.join(name);
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        planted.push((target, listener));
    }
    let paused = vm.pause().await;
    let refused = imp_testenv::report::chain(&paused.unwrap_err());
    eprintln!("pause through a replaced API socket: {refused}");
    assert!(refused.contains("a symlink"), "{refused}");
    let vsock = vm
        .connect_vsock(52, Duration::from_secs(2))
        .await
        .unwrap_err();
    let vsock = imp_testenv::report::chain(&vsock);
    assert!(
        vsock.contains("Not connecting to the vsock socket"),
        "{vsock}"
    );
    for (target, listener) in &planted {
        assert!(
            listener.accept().is_err(),
            "root connected to {} through the VMM's symlink",
            target.display()
        );
    }
    vm.stop(Duration::ZERO).await.unwrap();
}
