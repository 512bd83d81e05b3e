//! The real guest init (`imp-guest`) as PID 1 in a real Linux VM: QEMU `-M microvm` under TCG
//! with Debian's cloud kernel and an initramfs (newc cpio, written with imp-agent's `Cpio`) holding `/init` =
//! imp-guest, `/.imp/config.json` and a static busybox as the workload.
//!
//! Inputs: `IMP_GUEST_KERNEL_DIR` (default `target/guest-kernel`, filled by
//! `scripts/fetch-guest-kernel.sh`) with `vmlinuz`; `IMP_GUEST_BIN` (default
//! `target/imp-guest/imp-guest`, built by `scripts/build-guest.sh`); `IMP_BUSYBOX` (default
//! `/bin/busybox`, package busybox-static); `qemu-system-x86_64` on PATH (package
//! qemu-system-x86). Anything missing skips on a developer machine and fails under `CI=true`.
//! Run with `--nocapture` to see the boot timings, and `IMP_QEMU_SHOW_SERIAL=1` for the whole
//! serial log.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use imp_agent::initramfs::archive::Cpio;
use imp_proto::config::{AgentConfig, GuestConfig, PowerAction};
use imp_proto::marker::{EXIT_PREFIX, SUCCESS_LINE, find_exit_code};
use imp_testenv::scratch::scratch_dir;
use imp_testenv::workspace_root;

/// How long one boot may take, kernel start to QEMU's exit.
const BOOT_DEADLINE: Duration = Duration::from_secs(90);

fn env_path(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

/// The initramfs: the guest init as `/init`, its config, and busybox as the workload's shell.
fn initramfs(guest: &Path, busybox: &Path, config: &GuestConfig) -> Vec<u8> {
    let mut c = Cpio::new();
    for d in ["dev", "proc", "sys", "run", "tmp", "bin", "etc", ".imp"] {
        c.dir(d).unwrap();
    }
    c.char_dev("dev/console", 0o600, 5, 1).unwrap();
    c.char_dev("dev/null", 0o666, 1, 3).unwrap();
    c.file("init", 0o755, &fs::read(guest).unwrap()).unwrap();
    c.file(".imp/config.json", 0o644, &config.to_json().unwrap())
        .unwrap();
    c.file("bin/busybox", 0o755, &fs::read(busybox).unwrap())
        .unwrap();
    c.symlink("bin/sh", "busybox").unwrap();
    c.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
    )
    .unwrap();
    c.file("etc/group", 0o644, b"root:x:0:\nnogroup:x:65534:\n")
        .unwrap();
    c.finish().unwrap()
}

/// A QEMU process, killed when dropped.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a boot produced.
struct Boot {
    serial: String,
    /// QEMU's exit status, if it ended by itself before the deadline.
    exited: Option<std::process::ExitStatus>,
    /// From QEMU's start to the first `IMP_EXIT` on the serial console.
    to_marker: Option<Duration>,
    /// From QEMU's start to its exit.
    total: Duration,
    qemu_stderr: String,
}

/// The guest's requirements, or `None` when the test should skip (it already said why).
struct Inputs {
    qemu: PathBuf,
    kernel: PathBuf,
    guest: PathBuf,
    busybox: PathBuf,
}

fn inputs() -> Option<Inputs> {
    let root = workspace_root();
    let qemu = imp_testenv::guard::which("qemu-system-x86_64");
    let kernel = env_path("IMP_GUEST_KERNEL_DIR", root.join("target/guest-kernel")).join("vmlinuz");
    let guest = env_path("IMP_GUEST_BIN", root.join("target/imp-guest/imp-guest"));
    let busybox = env_path("IMP_BUSYBOX", PathBuf::from("/bin/busybox"));
    let checks = [
        (
            qemu.is_some(),
            "tool `qemu-system-x86_64` on PATH (apt-get install -y qemu-system-x86)".to_string(),
        ),
        (
            kernel.is_file(),
            format!(
                "guest kernel {} (scripts/fetch-guest-kernel.sh)",
                kernel.display()
            ),
        ),
        (
            guest.is_file(),
            format!("static guest {} (scripts/build-guest.sh)", guest.display()),
        ),
        (
            busybox.is_file(),
            format!(
                "static busybox {} (apt-get install -y busybox-static)",
                busybox.display()
            ),
        ),
    ];
    for (ok, what) in checks {
        if !imp_testenv::guard::require(ok, &what) {
            return None;
        }
    }
    Some(Inputs {
        qemu: qemu?,
        kernel,
        guest,
        busybox,
    })
}

/// Boots the guest with `config` and waits for QEMU to end (or the deadline).
fn boot(inputs: &Inputs, name: &str, config: &GuestConfig) -> Boot {
    let dir = scratch_dir(&format!("imp-qemu-guest-{name}")).unwrap();
    let initrd = dir.join("initrd.cpio");
    fs::write(&initrd, initramfs(&inputs.guest, &inputs.busybox, config)).unwrap();
    let serial = dir.join("serial.log");
    let stderr = dir.join("qemu.stderr");
    let append = format!(
        "console=ttyS0 tsc_early_khz={} panic=-1 reboot=t",
        imp_vmm::qemu::host_tsc_khz()
    );
    let started = Instant::now();
    let child = Command::new(&inputs.qemu)
        .args(["-accel", "tcg", "-M", "microvm", "-m", "256", "-smp", "1"])
        .args(["-nographic", "-no-reboot", "-monitor", "none"])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .arg("-kernel")
        .arg(&inputs.kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", &append])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let mut qemu = Qemu(child);
    let deadline = started + BOOT_DEADLINE;
    let mut to_marker = None;
    let exited = loop {
        if let Some(status) = qemu.0.try_wait().unwrap() {
            break Some(status);
        }
        if to_marker.is_none() && fs::read_to_string(&serial).is_ok_and(|s| s.contains(EXIT_PREFIX))
        {
            to_marker = Some(started.elapsed());
        }
        if Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let total = started.elapsed();
    drop(qemu);
    let serial_text = String::from_utf8_lossy(&fs::read(&serial).unwrap_or_default()).into_owned();
    if to_marker.is_none() && serial_text.contains(EXIT_PREFIX) {
        to_marker = Some(total);
    }
    let qemu_stderr = fs::read_to_string(&stderr).unwrap_or_default();
    if exited.is_some() {
        let _ = fs::remove_dir_all(&dir);
    } else {
        eprintln!("keeping {} for inspection", dir.display());
    }
    Boot {
        serial: serial_text,
        exited,
        to_marker,
        total,
        qemu_stderr,
    }
}

/// The kernel's own timestamp of the serial line holding `needle`, e.g. `[    1.234567]`.
fn kernel_time_of(serial: &str, needle: &str) -> Option<f64> {
    serial.lines().find(|l| l.contains(needle)).and_then(|l| {
        let l = l.trim_start();
        let inner = l.strip_prefix('[')?.split(']').next()?;
        inner.trim().parse().ok()
    })
}

fn workload_config(script: &str) -> GuestConfig {
    GuestConfig {
        hostname: Some("imp-qemu-test".into()),
        command: Some(vec!["/bin/sh".into(), "-c".into(), script.into()]),
        // No vsock device in this VM: no API and no exit report, only the serial marker.
        agent: AgentConfig {
            enabled: false,
            ..AgentConfig::default()
        },
        on_exit: PowerAction::PowerOff,
        ..GuestConfig::default()
    }
}

fn check_common(name: &str, boot: &Boot) {
    let excerpt = || {
        let lines: Vec<&str> = boot.serial.lines().collect();
        let from = lines.len().saturating_sub(60);
        format!(
            "--- serial (last {} lines) ---\n{}\n--- qemu stderr ---\n{}",
            lines.len() - from,
            lines[from..].join("\n"),
            boot.qemu_stderr
        )
    };
    let last_kernel = boot
        .serial
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('['))
        .and_then(|l| kernel_time_of(l, "]"));
    eprintln!(
        "{name}: IMP_EXIT after {:?} (wall, from QEMU start), QEMU exited after {:?}; kernel \
         clock: init ran the workload by {:?} s, last kernel line at {:?} s",
        boot.to_marker,
        boot.total,
        kernel_time_of(&boot.serial, "Run /init as init process"),
        last_kernel,
    );
    if std::env::var_os("IMP_QEMU_SHOW_SERIAL").is_some() {
        eprintln!("--- {name}: serial ---\n{}\n--- end ---", boot.serial);
    }
    assert!(
        !boot.serial.contains("Kernel panic"),
        "{name}: the kernel panicked\n{}",
        excerpt()
    );
    assert!(
        boot.serial.contains("hello-from-guest"),
        "{name}: the workload's output is missing\n{}",
        excerpt()
    );
    let status = boot.exited.unwrap_or_else(|| {
        panic!(
            "{name}: QEMU did not exit by itself within {BOOT_DEADLINE:?}\n{}",
            excerpt()
        )
    });
    assert!(
        status.success(),
        "{name}: QEMU exited with {status}\n{}",
        excerpt()
    );
}

#[test]
fn qemu_guest_init_reports_the_workload_exit_code_and_powers_off() {
    let Some(inputs) = inputs() else { return };
    let boot = boot(
        &inputs,
        "exit3",
        &workload_config("echo hello-from-guest; exit 3"),
    );
    check_common("exit 3", &boot);
    assert!(
        boot.serial.contains("IMP_EXIT 3"),
        "no `IMP_EXIT 3` marker:\n{}",
        boot.serial
    );
    assert_eq!(find_exit_code(&boot.serial), Some(3));
    assert!(!boot.serial.contains(SUCCESS_LINE), "{}", boot.serial);
}

#[test]
fn qemu_guest_init_prints_imp_success_for_exit_zero() {
    let Some(inputs) = inputs() else { return };
    let boot = boot(
        &inputs,
        "exit0",
        &workload_config("echo hello-from-guest; exit 0"),
    );
    check_common("exit 0", &boot);
    assert_eq!(find_exit_code(&boot.serial), Some(0), "{}", boot.serial);
    assert!(
        boot.serial.contains(SUCCESS_LINE),
        "no `{SUCCESS_LINE}` line:\n{}",
        boot.serial
    );
}
