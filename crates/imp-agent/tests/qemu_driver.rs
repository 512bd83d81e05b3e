//! The QEMU driver end to end: the real imp-guest as PID 1 under `qemu -M microvm` (TCG here),
//! booted through the [`Vmm`] trait from a cached base initramfs plus a per-VM config archive,
//! switching its root to an ext4 disk built here with `mkfs.ext4 -d`, and answering over its
//! guest channel (a mux over virtio-serial, served on the host as hybrid vsock) with the
//! imp-proto client. VMs with and without the guest agent are snapshotted and restored in a
//! new QEMU.
//!
//! Inputs as in `qemu_guest.rs` (`IMP_GUEST_KERNEL_DIR`, `IMP_GUEST_BIN`, `IMP_BUSYBOX`) plus
//! `mkfs.ext4`/`e2fsck`. Anything missing skips on a developer machine and fails under
//! `CI=true`. One TCG guest at a time.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use imp_agent::initramfs::archive::{BaseInitramfs, build_for_vm};
use imp_agent::initramfs::modules::VM_MODULES;
use imp_proto::config::{GuestConfig, ImageConfig, RootDisk};
use imp_proto::{Client, EnvVar, ExecEvent, ExecRequest, ExitStatus, Hello};
use imp_testenv::scratch::scratch_dir;
use imp_testenv::workspace_root;
use imp_vmm::qemu::{self, Launcher, Qemu, RamIn, SnapshotState};
use imp_vmm::{
    Confine, DriveConfig, GuestMemory, StopOutcome, VmConfig, VmState, Vmm, VsockConfig,
};

const AGENT_PORT: u32 = imp_proto::DEFAULT_API_PORT;

/// One guest at a time: two TCG guests on the 2-core CI machine make each boot slow and its
/// timing unpredictable.
static ONE_VM_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    let checks = [
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
        (
            imp_testenv::guard::which("mkfs.ext4").is_some()
                && imp_testenv::guard::which("e2fsck").is_some(),
            "mkfs.ext4 and e2fsck (apt-get install -y e2fsprogs)".to_string(),
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

/// An ext4 image with busybox, an `app` user, `/srv` and a file only the disk has.
fn make_disk(dir: &Path, busybox: &Path) -> PathBuf {
    let tree = dir.join("tree");
    for d in [
        "bin", "etc", "srv", "proc", "sys", "dev", "run", "tmp", "root",
    ] {
        fs::create_dir_all(tree.join(d)).unwrap();
    }
    fs::set_permissions(tree.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::copy(busybox, tree.join("bin/busybox")).unwrap();
    for tool in [
        "sh", "cat", "echo", "id", "pwd", "sleep", "true", "false", "kill",
    ] {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(tool)).unwrap();
    }
    fs::write(
        tree.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/srv:/bin/sh\n",
    )
    .unwrap();
    fs::write(tree.join("etc/group"), "root:x:0:\napp:x:1000:\n").unwrap();
    fs::write(tree.join("disk-only.txt"), "only-on-the-disk\n").unwrap();
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

/// The guest's config: `script` as the image's command, chrooted in the disk.
fn guest_config(id: &str, script: &str) -> GuestConfig {
    GuestConfig {
        hostname: Some(id.to_string()),
        image: ImageConfig {
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec![script.into()],
            env: vec!["FROM_IMAGE=image".into()],
            working_dir: Some("/srv".into()),
            user: Some("app".into()),
        },
        env: vec![EnvVar::new("MODE", "driver-test")],
        root: Some(RootDisk::ext4("/dev/vda")),
        ..GuestConfig::default()
    }
}

/// Builds the VM's initramfs (base cached under target/) and its config.
async fn vm_config(inputs: &Inputs, dir: &Path, id: &str, cid: u32, script: &str) -> VmConfig {
    let cache = workspace_root().join("target/imp-initramfs-cache");
    fs::create_dir_all(&cache).unwrap();
    let base = BaseInitramfs::cached(&cache, &inputs.guest, &inputs.modules, VM_MODULES)
        .await
        .unwrap();
    let guest = guest_config(id, script);
    let initrd = dir.join("initrd.cpio");
    build_for_vm(&base, &guest, &initrd).await.unwrap();
    VmConfig {
        id: id.to_string(),
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
        net: None,
        vsock: Some(VsockConfig { guest_cid: cid }),
        netns: None,
        // As the product runs it: a uid of its own in a jail (one per test VM, by its cid).
        confine: Some(Confine {
            uid: 3_900_000 + cid,
            gid: 3_900_000 + cid,
        }),
        // As the product runs it: the RAM mapped from a file beside the VM.
        memory: GuestMemory::Shared(dir.join("memory.ram")),
    }
}

/// A handshaken client on the guest agent.
async fn client(vm: &Qemu) -> Client<std::os::unix::net::UnixStream> {
    let stream = vm
        .connect_vsock(AGENT_PORT, Duration::from_secs(90))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", serial(vm)));
    let stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    tokio::task::spawn_blocking(move || Client::handshake(stream, &Hello::new("qemu-driver-test")))
        .await
        .unwrap()
        .unwrap()
}

/// Runs `argv` in the guest; returns the stdout chunks as they streamed and the exit status.
async fn exec(vm: &Qemu, argv: &[&str]) -> (Vec<String>, ExitStatus) {
    let request = ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..ExecRequest::default()
    };
    exec_request(vm, request).await
}

/// Runs `request` in the guest, as [`exec`] does.
async fn exec_request(vm: &Qemu, request: ExecRequest) -> (Vec<String>, ExitStatus) {
    let c = client(vm).await;
    tokio::task::spawn_blocking(move || {
        let mut session = c.exec(&request).unwrap();
        let mut chunks = Vec::new();
        loop {
            match session.next_event().unwrap() {
                ExecEvent::Stdout(b) => chunks.push(String::from_utf8_lossy(&b).into_owned()),
                ExecEvent::Stderr(b) => eprintln!("exec stderr: {}", String::from_utf8_lossy(&b)),
                ExecEvent::Exit(status) => return (chunks, status),
            }
        }
    })
    .await
    .unwrap()
}

async fn stdout_of(vm: &Qemu, argv: &[&str]) -> String {
    let (chunks, status) = exec(vm, argv).await;
    assert_eq!(status, ExitStatus::Code(0), "{argv:?}: {chunks:?}");
    chunks.concat()
}

fn serial(vm: &Qemu) -> String {
    String::from_utf8_lossy(&fs::read(vm.serial_log_path()).unwrap_or_default()).into_owned()
}

async fn counter(vm: &Qemu) -> u64 {
    let wait_then_read = "while [ ! -s /tmp/count ]; do sleep 0.05; done; cat /tmp/count";
    stdout_of(vm, &["sh", "-c", wait_then_read])
        .await
        .trim()
        .parse()
        .unwrap()
}

/// The VMM runs as the product runs it: its own uid, no capability, `no_new_privs`, seccomp
/// (QEMU's `-sandbox`), a root holding only `/usr`, its devices and its VM's files, and it
/// cannot open a host file by path, whatever a QMP client (or an escaped guest) asks.
async fn assert_confined(vm: &mut Qemu, cid: u32, disk: &Path) {
    let pid = vm.pid().unwrap();
    let status = imp_testenv::procfs::Status::of(pid);
    let uid = (3_900_000 + cid).to_string();
    eprintln!("QEMU {}", status.summary());
    assert!(
        status.field("Uid").split_whitespace().all(|u| u == uid),
        "{status:?}"
    );
    assert!(
        status.field("Gid").split_whitespace().all(|g| g == uid),
        "{status:?}"
    );
    assert_eq!(status.field("Groups"), "");
    assert_eq!(status.field("CapEff"), "0000000000000000");
    assert_eq!(status.field("CapPrm"), "0000000000000000");
    assert_eq!(status.field("CapBnd"), "0000000000000000");
    assert_eq!(status.field("NoNewPrivs"), "1");
    assert_eq!(status.field("Seccomp"), "2");
    let mut root: Vec<String> = fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    root.sort();
    eprintln!("QEMU {pid} sees / as {root:?}");
    assert_eq!(
        root,
        [
            "bin", "boot", "dev", "drives", "lib", "lib64", "log", "mem", "tmp", "usr"
        ]
    );
    // Host files by path: /etc/shadow, and its own VM directory's disk by its host path.
    let pid_cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        String::from_utf8_lossy(&pid_cmdline).contains("file=/drives/root"),
        "the drive is named by its path inside the jail"
    );
    for path in ["/etc/shadow".to_owned(), disk.display().to_string()] {
        let refused = vm
            .qmp(
                "blockdev-add",
                Some(serde_json::json!({"driver": "file", "node-name": "steal",
                                         "filename": path, "read-only": true})),
            )
            .await
            .unwrap_err();
        let refused = imp_testenv::report::chain(&refused);
        eprintln!("QMP blockdev-add {path}: {refused}");
        assert!(refused.contains("No such file"), "{path}: {refused}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_vm_boots_from_its_disk_and_serves_exec_health_metrics_pause_and_graceful_stop() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let dir = scratch_dir("imp-qemu-driver-main").unwrap();
    let script = "trap 'echo workload-terminated; exit 0' TERM; \
                  cat /disk-only.txt > /tmp/seen; \
                  echo \"$MODE $FROM_IMAGE $(pwd) $(id -u):$(id -g) $HOME\" > /tmp/env; \
                  i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done";
    let config = vm_config(&inputs, &dir, "qemu-main", 3, script).await;
    let started = Instant::now();
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    assert_eq!(vm.state(), VmState::Running);

    let mut c = client(&vm).await;
    let ready = started.elapsed();
    let health = tokio::task::spawn_blocking(move || c.health().unwrap())
        .await
        .unwrap();
    eprintln!("guest agent answered health {ready:?} after QEMU start: {health:?}");
    assert_confined(&mut vm, 3, &config.drives[0].path).await;

    let (chunks, status) = exec(&vm, &["sh", "-c", "echo hello; sleep 0.3; echo world"]).await;
    assert_eq!(status, ExitStatus::Code(0));
    assert_eq!(chunks.concat(), "hello\nworld\n");
    assert!(chunks.len() >= 2, "output was not streamed: {chunks:?}");
    let (_, status) = exec(&vm, &["sh", "-c", "exit 7"]).await;
    assert_eq!(status, ExitStatus::Code(7));

    // The workload ran chrooted in the disk, as the image's user, in its WorkingDir.
    assert_eq!(
        stdout_of(&vm, &["cat", "/tmp/seen"]).await,
        "only-on-the-disk\n"
    );
    assert_eq!(
        stdout_of(&vm, &["cat", "/tmp/env"]).await,
        "driver-test image /srv 1000:1000 /srv\n"
    );
    assert_eq!(stdout_of(&vm, &["id", "-u"]).await, "1000\n");
    assert_eq!(stdout_of(&vm, &["pwd"]).await, "/srv\n");
    assert_eq!(
        stdout_of(&vm, &["cat", "/disk-only.txt"]).await,
        "only-on-the-disk\n"
    );

    let mut c = client(&vm).await;
    let metrics = tokio::task::spawn_blocking(move || c.metrics().unwrap())
        .await
        .unwrap();
    assert!(metrics.memory_total_bytes > 100 << 20, "{metrics:?}");
    assert!(metrics.disk_total_bytes > 10 << 20, "{metrics:?}");

    // Pause/resume: the counter advances while running, hardly at all across a pause.
    let a = counter(&vm).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let b = counter(&vm).await;
    vm.pause().await.unwrap();
    assert_eq!(vm.state(), VmState::Paused);
    tokio::time::sleep(Duration::from_secs(2)).await;
    vm.resume().await.unwrap();
    let d = counter(&vm).await;
    eprintln!("counter: {a} -> {b} over 2 s running, {b} -> {d} across a 2 s pause");
    assert!(b > a, "the counter did not advance while running");
    assert!(
        d - b < (b - a).div_ceil(2) + 2,
        "the counter advanced while paused: running {a}->{b}, paused {b}->{d}"
    );

    // Graceful stop through the guest agent; the disk is clean afterwards.
    let outcome = vm.stop(Duration::from_secs(60)).await.unwrap();
    let log = fs::read_to_string(config.run_dir.join("serial.log")).unwrap();
    assert_eq!(outcome, StopOutcome::Graceful, "{log}");
    assert!(log.contains("workload-terminated"), "{log}");
    assert!(log.contains("IMP_EXIT 0"), "{log}");
    assert!(log.contains(imp_proto::marker::SUCCESS_LINE), "{log}");
    assert!(!log.contains("Kernel panic"), "{log}");
    assert!(
        !log.contains("Marking clocksource 'tsc' as unstable"),
        "the guest dropped its TSC clocksource: {log}"
    );
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&config.drives[0].path)
        .output()
        .unwrap();
    assert!(fsck.status.success(), "disk not clean after stop: {fsck:?}");
    let _ = fs::remove_dir_all(&dir);
}

/// Where a QEMU confined by an earlier release made its sockets, and the driver connected to
/// them by path: `vmm/` in the run directory, which that QEMU's uid owned.
const OLD_SOCKETS: [&str; 2] = ["vmm/qmp.sock", "vmm/mux.sock"];

/// Sockets the test listens on where a compromised QEMU would point the driver.
fn plant(run_dir: &Path) -> Vec<(PathBuf, std::os::unix::net::UnixListener)> {
    fs::create_dir_all(run_dir.join("vmm")).unwrap();
    OLD_SOCKETS
        .iter()
        .map(|name| {
            let path = run_dir.join(name);
            let _ = fs::remove_file(&path);
            let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
            listener.set_nonblocking(true).unwrap();
            (path, listener)
        })
        .collect()
}

/// Shuts down, as QEMU itself could, every Unix socket process `pid` holds (its QMP and guest
/// channel connections among them), through duplicates taken with pidfd_getfd(2): the
/// driver's ends see their peer go, which is what made the driver connect again.
#[allow(unsafe_code)]
fn shut_sockets_of(pid: u32) -> usize {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a descriptor the kernel just returned to us alone.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let mut shut = 0;
    for entry in fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let entry = entry.unwrap();
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("socket:") {
            continue;
        }
        let n: i32 = entry.file_name().to_str().unwrap().parse().unwrap();
        // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that process and flags,
        // and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), n, 0) };
        if fd < 0 {
            continue;
        }
        // SAFETY: as above, a new descriptor that is ours alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: shutdown(2) on a descriptor we own; an error (a listener) is ignored.
        if unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) } == 0 {
            shut += 1;
        }
    }
    shut
}

/// Item 5 of issue 38: the driver (root, in the shim) connects only to the sockets it created.
/// A compromised QEMU replaces the socket paths the driver knew it by (here: sockets the test
/// listens on, where an earlier release's QEMU made its QMP and guest-channel sockets) and then
/// closes its end of every socket it holds, as it would to make the driver connect again.
/// Nothing connects to the test's sockets; the driver reports QMP and the guest channel gone
/// instead, and stops the VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qemu_that_replaces_its_socket_paths_leads_the_driver_nowhere() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let dir = scratch_dir("imp-qemu-driver-sockets").unwrap();
    let config = vm_config(&inputs, &dir, "qemu-sockets", 9, "sleep 3600").await;
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    let mut c = client(&vm).await;
    tokio::task::spawn_blocking(move || c.health().unwrap())
        .await
        .unwrap();
    let pid = vm.pid().unwrap();
    let cmdline = String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/cmdline")).unwrap())
        .replace('\0', " ");
    let planted = plant(&config.run_dir);
    let shut = shut_sockets_of(pid);
    eprintln!("shut {shut} sockets of QEMU {pid}");
    assert!(shut >= 1, "QEMU held no socket to shut");
    // An earlier release reconnected its guest channel every 100 ms.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (path, listener) in &planted {
        match listener.accept() {
            Ok(_) => panic!("the driver connected to {}", path.display()),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}"),
        }
    }
    let qmp = vm.qmp("query-status", None).await;
    eprintln!("QMP after QEMU closed it: {qmp:?}");
    assert!(qmp.is_err(), "QMP still answered: {qmp:?}");
    let vsock = vm.connect_vsock(AGENT_PORT, Duration::from_secs(2)).await;
    assert!(vsock.is_err(), "the guest channel still answered");
    for (path, listener) in &planted {
        assert!(
            listener.accept().is_err(),
            "the driver connected to {}",
            path.display()
        );
    }
    // QEMU was given no socket path to make its sockets at.
    assert!(
        !cmdline.contains("unix:") && !cmdline.contains(".sock"),
        "{cmdline}"
    );
    vm.stop(Duration::ZERO).await.unwrap();
    let _ = fs::remove_dir_all(&dir);
}

/// Runs `script` with `sh -c` as root in the guest; returns its stdout.
async fn as_root(vm: &Qemu, script: &str) -> String {
    let request = ExecRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        user: Some("root".into()),
        ..ExecRequest::default()
    };
    let (chunks, status) = exec_request(vm, request).await;
    assert_eq!(status, ExitStatus::Code(0), "{script}: {chunks:?}");
    chunks.concat()
}

/// Reads the background counter in the guest's tmpfs.
async fn tmpfs_counter(vm: &Qemu) -> u64 {
    as_root(vm, "cat /run/count").await.trim().parse().unwrap()
}

/// Accepts one exit report on the host's side of guest port `port`.
fn exit_reports(vm: &Qemu, port: u32) -> tokio::task::JoinHandle<ExitStatus> {
    let path = imp_vmm::vsock::host_listener_path(&vm.vsock_path().unwrap(), port);
    let _ = fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    tokio::task::spawn_blocking(move || {
        let (mut s, _) = listener.accept().unwrap();
        imp_proto::report::receive_exit_report(&mut s, &Hello::new("qemu-driver-test")).unwrap()
    })
}

/// A VM with the guest agent (its channel is a mux over virtio-serial, which QEMU migrates) is
/// paused, snapshotted and killed, then restored in a new QEMU process: exec works again, a
/// counter started by exec went on from where it was, a file in tmpfs is still there and a
/// guest-to-host connection (the workload's exit report) arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_vm_with_the_guest_agent_snapshots_and_restores_in_a_new_process() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let dir = scratch_dir("imp-qemu-driver-agent-snapshot").unwrap();
    // The workload ends with code 3 when told to (USR1), after the restore.
    let script = "echo $$ > /tmp/workload.pid; trap 'exit 3' USR1; \
                  while true; do sleep 0.1; done";
    let mut config = vm_config(&inputs, &dir, "qemu-agent-snap", 9, script).await;
    let report_port = 1024;
    set_exit_report_port(&mut config, &dir, script, report_port).await;
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    let mut c = client(&vm).await;
    let _ = tokio::task::spawn_blocking(move || c.health().unwrap()).await;

    // The mux's round trip: a health request on an open connection.
    let mut c = client(&vm).await;
    let rtt = tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        for _ in 0..20 {
            c.health().unwrap();
        }
        t.elapsed() / 20
    })
    .await
    .unwrap();
    eprintln!("guest agent round trip over the mux (health): {rtt:?}");

    as_root(
        &vm,
        "echo kept > /run/marker; \
         busybox setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /run/count; \
         sleep 0.1; done' </dev/null >/dev/null 2>&1 &",
    )
    .await;
    while as_root(&vm, "cat /run/count 2>/dev/null || true")
        .await
        .trim()
        .is_empty()
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = tmpfs_counter(&vm).await;
    vm.pause().await.unwrap();
    let files = imp_vmm::SnapshotFiles {
        state: dir.join("snap.state"),
        memory: dir.join("snap.mem"),
    };
    let t = Instant::now();
    vm.snapshot(&files).await.unwrap();
    let snapshot_took = t.elapsed();
    let size = fs::metadata(&files.memory).unwrap().len();
    // The RAM is the shared file: the stream holds only the devices.
    let state = SnapshotState::parse(&fs::read_to_string(&files.state).unwrap());
    assert_eq!(state.ram, RamIn::File, "{state:?}");
    assert!(
        size < 8 << 20,
        "a {size}-byte stream for device state alone"
    );
    let pid = vm.pid().unwrap();
    // Killed, not shut down: the snapshot is all that is left.
    vm.stop(Duration::ZERO).await.unwrap();
    assert!(!Path::new(&format!("/proc/{pid}")).exists());

    let t = Instant::now();
    let vm = Qemu::restore(&inputs.launcher, &config, &files, true)
        .await
        .unwrap();
    assert_ne!(vm.pid(), Some(pid), "the restore reused the old process");
    let mut c = client(&vm).await;
    let health = tokio::task::spawn_blocking(move || c.health().unwrap())
        .await
        .unwrap();
    let restore_took = t.elapsed();
    eprintln!(
        "snapshot {snapshot_took:?}, {} MiB for {} MiB of guest memory; restore (spawn -> guest \
         agent answering) {restore_took:?}; {health:?}",
        size >> 20,
        config.memory_mib
    );
    assert_eq!(as_root(&vm, "cat /run/marker").await, "kept\n");
    let after = tmpfs_counter(&vm).await;
    assert!(
        after >= before && after < before + 100,
        "the counter did not go on from {before}: {after}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let later = tmpfs_counter(&vm).await;
    assert!(
        later > after,
        "the counter stopped after the restore: {after} -> {later}"
    );
    eprintln!("counter {before} at the snapshot, {after} after the restore, {later} 1 s later");

    // The clock call the suspend work makes after a restore: set far ahead, then back.
    let vsock = vm.vsock_path().unwrap();
    let ahead = std::time::UNIX_EPOCH + Duration::from_secs(1_900_000_000);
    imp_agent::runtime::guest_agent::set_clock(&vsock, AGENT_PORT, ahead, Duration::from_secs(30))
        .await
        .unwrap();
    let guest_now: u64 = as_root(&vm, "busybox date +%s")
        .await
        .trim()
        .parse()
        .unwrap();
    assert!(
        (1_900_000_000..1_900_000_060).contains(&guest_now),
        "the guest's clock was not set: {guest_now}"
    );
    let now = std::time::SystemTime::now();
    imp_agent::runtime::guest_agent::set_clock(&vsock, AGENT_PORT, now, Duration::from_secs(30))
        .await
        .unwrap();

    // A guest-to-host stream: the workload's exit report.
    let report = exit_reports(&vm, report_port);
    as_root(&vm, "kill -USR1 $(cat /tmp/workload.pid)").await;
    let status = tokio::time::timeout(Duration::from_secs(60), report)
        .await
        .expect("no exit report within 60 s")
        .unwrap();
    assert_eq!(status, ExitStatus::Code(3));
    let _ = vm.stop(Duration::from_secs(5)).await;
    let _ = fs::remove_dir_all(&dir);
}

/// Rebuilds `config`'s initramfs with the exit report going to host port `port`.
async fn set_exit_report_port(config: &mut VmConfig, dir: &Path, script: &str, port: u32) {
    let cache = workspace_root().join("target/imp-initramfs-cache");
    let inputs = inputs().unwrap();
    let base = BaseInitramfs::cached(&cache, &inputs.guest, &inputs.modules, VM_MODULES)
        .await
        .unwrap();
    let mut guest = guest_config(&config.id, script);
    guest.agent.exit_report_port = Some(port);
    let initrd = dir.join("initrd.cpio");
    build_for_vm(&base, &guest, &initrd).await.unwrap();
    config.initrd = Some(initrd);
}

/// Ctrl-Alt-Del (Firecracker's graceful stop, SendCtrlAltDel) reaches the init as SIGINT
/// instead of restarting the kernel at once: the workload gets SIGTERM, its trap runs, the VM
/// powers off by itself and the disk is clean. Sent here as root inside the guest (`kill -INT
/// 1` is what the kernel does on Ctrl-Alt-Del once it is routed to the init).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_vm_shuts_down_gracefully_on_ctrl_alt_del() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let dir = scratch_dir("imp-qemu-driver-cad").unwrap();
    let script = "trap 'echo workload-terminated; exit 0' TERM; while true; do sleep 0.1; done";
    let config = vm_config(&inputs, &dir, "qemu-cad", 7, script).await;
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    let as_root = |argv: &[&str]| ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        user: Some("root".into()),
        ..ExecRequest::default()
    };
    let (out, _) = exec_request(&vm, as_root(&["cat", "/proc/sys/kernel/ctrl-alt-del"])).await;
    assert_eq!(
        out.concat(),
        "0\n",
        "Ctrl-Alt-Del is not routed to the init"
    );
    let c = client(&vm).await;
    let cad = as_root(&["kill", "-INT", "1"]);
    tokio::task::spawn_blocking(move || {
        let mut session = c.exec(&cad).unwrap();
        // The VM may go down before the exit arrives.
        while let Ok(e) = session.next_event() {
            if matches!(e, ExecEvent::Exit(_)) {
                break;
            }
        }
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !vm.exited().unwrap() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = serial(&vm);
    assert!(
        vm.exited().unwrap(),
        "the VM did not power off after Ctrl-Alt-Del:\n{log}"
    );
    assert!(log.contains("imp-guest: Ctrl-Alt-Del: SIGTERM"), "{log}");
    assert!(log.contains("workload-terminated"), "{log}");
    assert!(log.contains("IMP_EXIT 0"), "{log}");
    assert!(!log.contains("Kernel panic"), "{log}");
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&config.drives[0].path)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "disk not clean after Ctrl-Alt-Del: {fsck:?}"
    );
    let _ = vm.stop(Duration::ZERO).await;
    let _ = fs::remove_dir_all(&dir);
}

/// The KVM probe boots the kernel for real: it decides within its deadline (on PVM hosts like
/// the CI machines: `Rejected`, `Hangs` or `NoDevice`, so TCG), and the cached answer is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvm_probe_decides_by_booting_and_caches_the_answer() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let cache = scratch_dir("imp-qemu-driver-kvm").unwrap();
    let deadline = Duration::from_secs(8);
    let t = Instant::now();
    let probe = imp_vmm::kvm::probe_boot(&inputs.launcher.qemu, &inputs.kernel, deadline).await;
    eprintln!("kvm probe: {probe:?} after {:?}", t.elapsed());
    assert!(
        !matches!(probe, imp_vmm::kvm::Probe::Failed(_)),
        "{probe:?}"
    );
    assert!(t.elapsed() < deadline + Duration::from_secs(5));
    let first =
        imp_vmm::kvm::probe_boot_cached(&inputs.launcher.qemu, &inputs.kernel, deadline, &cache)
            .await;
    assert_eq!(first, probe.kvm_boots());
    let t = Instant::now();
    let again =
        imp_vmm::kvm::probe_boot_cached(&inputs.launcher.qemu, &inputs.kernel, deadline, &cache)
            .await;
    assert_eq!(again, first);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the cached answer was not used"
    );
    let _ = fs::remove_dir_all(&cache);
}

/// A paused VM's guest channel survives what a host does around a pause: a connection closing
/// just before it, connection attempts during it (which must not be answered: the guest is
/// stopped), and the same again several times, one pause longer than the guest kernel's
/// soft-lockup threshold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_vm_keeps_its_vsock_across_pauses_with_host_traffic() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let dir = scratch_dir("imp-qemu-driver-pauses").unwrap();
    let script = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done";
    let config = vm_config(&inputs, &dir, "qemu-pauses", 5, script).await;
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    for round in 0..4 {
        // The last pause outlasts the guest kernel's 20 s soft-lockup threshold.
        let pause = Duration::from_millis(if round == 3 { 24_000 } else { 500 });
        // The exec's connection closes right before the pause.
        assert_eq!(stdout_of(&vm, &["echo", "before"]).await, "before\n");
        vm.pause().await.unwrap();
        let t = Instant::now();
        let attempt = vm
            .connect_vsock(AGENT_PORT, Duration::from_millis(300))
            .await;
        assert!(
            attempt.is_err(),
            "round {round}: a paused guest answered a vsock connection"
        );
        if let Some(rest) = pause.checked_sub(t.elapsed()) {
            tokio::time::sleep(rest).await;
        }
        vm.resume().await.unwrap();
        let t = Instant::now();
        let mut c = client(&vm).await;
        let health = tokio::task::spawn_blocking(move || c.health().unwrap())
            .await
            .unwrap();
        eprintln!(
            "round {round}: paused {pause:?}; health {:?} after resume: {health:?}",
            t.elapsed()
        );
    }
    assert_eq!(stdout_of(&vm, &["echo", "after"]).await, "after\n");
    let outcome = vm.stop(Duration::from_secs(30)).await.unwrap();
    let log = fs::read_to_string(config.run_dir.join("serial.log")).unwrap();
    assert_eq!(outcome, StopOutcome::Graceful, "{log}");
    for bad in [
        "Kernel panic",
        "soft lockup",
        "rcu_sched detected stall",
        "Call Trace",
    ] {
        assert!(
            !log.contains(bad),
            "the guest logged {bad:?} around its pauses:\n{log}"
        );
    }
    let _ = fs::remove_dir_all(&dir);
}

/// The complete `tick N` lines of a serial log, in order.
fn ticks(log: &str) -> Vec<u64> {
    let complete = log.rfind('\n').map_or("", |i| &log[..i]);
    without_kernel_records(complete)
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("tick "))
        .filter_map(|n| n.parse().ok())
        .collect()
}

/// The serial console with the kernel's own records taken out. The kernel writes a record
/// (`[    5.123456] text` and its newline) to the console at once, in between whatever bytes of
/// the workload's output the UART had not sent yet, so a record can land inside a `tick N` line
/// (`tic[    5.12] …\nk 7`); without the records the workload's lines are whole again.
fn without_kernel_records(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut rest = log;
    while let Some(at) = rest.find('[') {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        match kernel_record_len(after) {
            Some(len) => rest = &after[len..],
            None => {
                out.push('[');
                rest = &after[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The length of the kernel record `text` starts with (`[`, spaces, seconds`.`micros`]`, the
/// message and its newline), if it starts with one.
fn kernel_record_len(text: &str) -> Option<usize> {
    let close = text.find(']')?;
    let stamp = text[1..close].trim_start();
    let (secs, micros) = stamp.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(secs) || !digits(micros) {
        return None;
    }
    let end = text[close..]
        .find('\n')
        .map_or(text.len(), |i| close + i + 1);
    Some(end)
}

/// A kernel record written into the middle of a tick line (as CI's serial log once had it)
/// leaves the ticks whole; a bracket of the workload's own is kept.
#[test]
fn kernel_records_inside_tick_lines_are_taken_out() {
    let log = "[    0.000000] Linux version 6.1\ntick 1\ntic[    2.345678] random: crng init done\nk 2\n\
               tick [3]\ntick 3\n[   10.5] late\ntick 4\n";
    assert_eq!(ticks(log), vec![1, 2, 3, 4]);
    assert!(without_kernel_records(log).contains("tick [3]"));
}

/// Waits until the serial log holds a complete tick of at least `min`; returns the log.
async fn wait_tick(log: &Path, min: u64, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = String::from_utf8_lossy(&fs::read(log).unwrap_or_default()).into_owned();
        if ticks(&text).last().is_some_and(|t| *t >= min) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "the guest did not print tick {min} within {timeout:?}; serial log:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Snapshot and restore of a VM without a guest channel (its serial console only): a guest
/// printing a counter on its console is paused, saved through QEMU's migration stream and
/// killed; a new QEMU restores it and its counter goes on from where it stopped, instead of
/// starting again at 1 as a fresh boot would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_vm_without_vsock_snapshots_and_restores_in_a_new_process() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    let Some(inputs) = inputs() else { return };
    let dir = scratch_dir("imp-qemu-driver-snapshot").unwrap();
    let script = "i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done";
    let mut config = vm_config(&inputs, &dir, "qemu-snapshot", 7, script).await;
    config.vsock = None;
    // Anonymous RAM, as every release before mapped memory ran it: the stream holds it all.
    config.memory = GuestMemory::Anonymous;
    let log = config.run_dir.join("serial.log");
    let mut vm = Qemu::boot(&inputs.launcher, &config).await.unwrap();
    assert!(vm.vsock_path().is_none());
    wait_tick(&log, 3, Duration::from_secs(60)).await;

    vm.pause().await.unwrap();
    assert_eq!(vm.state(), VmState::Paused);
    let files = imp_vmm::SnapshotFiles {
        state: dir.join("snap.state"),
        memory: dir.join("snap.mem"),
    };
    let t = Instant::now();
    vm.snapshot(&files).await.unwrap();
    let snapshot_took = t.elapsed();
    let stream = fs::metadata(&files.memory).unwrap().len();
    let state = fs::read_to_string(&files.state).unwrap();
    assert!(
        state.contains("qemu"),
        "no QEMU version in the state: {state}"
    );
    assert_eq!(SnapshotState::parse(&state).ram, RamIn::Stream, "{state}");
    assert!(
        stream > 16 << 20,
        "the RAM is not in the {stream}-byte stream"
    );
    let pid = vm.pid().unwrap();
    vm.stop(Duration::from_secs(2)).await.unwrap();
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "QEMU {pid} still runs after stop"
    );
    let saved = fs::read_to_string(&log).unwrap();
    let last = *ticks(&saved).last().unwrap();
    eprintln!(
        "snapshot took {snapshot_took:?} ({} MiB stream), paused at tick {last}",
        stream >> 20
    );

    // Restored into RAM mapped from a file, as an upgraded agent wakes a VM an earlier
    // release suspended: the stream's pages land in the file.
    let ram = dir.join("memory.ram");
    config.memory = GuestMemory::Shared(ram.clone());
    let t = Instant::now();
    let mut vm = Qemu::restore(&inputs.launcher, &config, &files, true)
        .await
        .unwrap();
    let restore_took = t.elapsed();
    assert_eq!(vm.state(), VmState::Running);
    assert_ne!(vm.pid(), Some(pid));
    let text = wait_tick(&log, last + 3, Duration::from_secs(20)).await;
    let to_ticks = t.elapsed();
    eprintln!(
        "restore took {restore_took:?} (spawn, load, resume); tick {} {to_ticks:?} after it began",
        last + 3
    );
    assert!(!vm.exited().unwrap(), "the restored QEMU exited");
    assert!(
        text.starts_with(&saved),
        "the restore did not keep the serial log from before the snapshot:\n{text}"
    );
    // One boot, and a counter that went on from `last`: 1, 2, …, last, last + 1, … without a
    // gap or a restart.
    let all = ticks(&text);
    assert_eq!(all.first(), Some(&1), "{text}");
    assert!(
        all.windows(2).all(|w| w[1] == w[0] + 1),
        "the ticks do not go on from {last}: {all:?}"
    );
    assert_eq!(text.matches("Linux version").count(), 1, "{text}");
    assert!(!text.contains("Kernel panic"), "{text}");

    // Without vsock the guest agent cannot be asked; stop ends the VM (ACPI, else killed).
    let pid = vm.pid().unwrap();
    let outcome = vm.stop(Duration::from_secs(2)).await.unwrap();
    eprintln!("restored VM stopped: {outcome:?}");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "QEMU {pid} still runs after stop"
    );

    // A damaged snapshot is refused with QEMU's own reason, not a bare QMP error.
    fs::write(&files.memory, b"not a migration stream").unwrap();
    let err = Qemu::restore(&inputs.launcher, &config, &files, true)
        .await
        .unwrap_err();
    eprintln!("damaged snapshot: {err}");
    assert!(
        matches!(err, qemu::Error::Exited { .. }) && err.to_string().contains("qemu.log"),
        "{err}"
    );
    let _ = fs::remove_dir_all(&dir);
}
