//! Can this host run Linux guests under KVM? Decided by trying, not by `stat`.
//!
//! `/dev/kvm` may open and `KVM_CREATE_VM` may succeed while a stock guest kernel still cannot
//! boot: on hosts whose KVM is PVM (pagetable-based virtualisation) the kernel hangs early. So
//! the probe opens `/dev/kvm` read-write and then boots the guest kernel for real under QEMU +
//! KVM with no root filesystem: a working KVM reaches the kernel's "VFS: Unable to mount root"
//! panic within seconds and QEMU exits (`panic=-1` with `-no-reboot`); a KVM that cannot boot
//! Linux is still silent at the deadline. The answer is cached per kernel in a small file.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Whether `/dev/kvm` opens read-write (needed, not sufficient).
pub fn device_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// KVM booted the kernel to its first panic in this long.
    Boots(Duration),
    /// `/dev/kvm` cannot be opened read-write.
    NoDevice,
    /// The kernel printed nothing that shows it ran, within the deadline.
    Hangs(Duration),
    /// QEMU with KVM died before the kernel ran (e.g. PVM rejects `-cpu host`'s MSRs);
    /// holds the last line QEMU printed.
    Rejected(String),
    /// QEMU could not be run at all.
    Failed(String),
}

impl Probe {
    /// Whether guests should use KVM.
    pub fn kvm_boots(&self) -> bool {
        matches!(self, Probe::Boots(_))
    }
}

/// Boots `kernel` under `qemu -accel kvm` and waits up to `deadline` for proof that it ran.
pub async fn probe_boot(qemu: &Path, kernel: &Path, deadline: Duration) -> Probe {
    if !device_usable() {
        return Probe::NoDevice;
    }
    // A private directory (mkdtemp: unpredictable name, mode 0700): a predictable path in a
    // shared /tmp written as root could be planted by another user.
    let template = std::env::temp_dir().join("imp-kvm-probe-XXXXXX");
    let dir = match nix::unistd::mkdtemp(&template) {
        Ok(d) => d,
        Err(e) => return Probe::Failed(format!("creating a private directory for the probe: {e}")),
    };
    let serial = dir.join("serial.log");
    let started = Instant::now();
    let child = tokio::process::Command::new(qemu)
        .args(probe_args(kernel, &serial))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(match std::fs::File::create(dir.join("stderr")) {
            Ok(f) => std::process::Stdio::from(f),
            Err(_) => std::process::Stdio::null(),
        })
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return Probe::Failed(format!("starting {}: {e}", qemu.display())),
    };
    let result = loop {
        let text = std::fs::read_to_string(&serial).unwrap_or_default();
        if text.contains("Kernel panic") || text.contains("Unable to mount root") {
            break Probe::Boots(started.elapsed());
        }
        if let Ok(Some(status)) = child.try_wait() {
            break if text.contains("Linux version") {
                Probe::Boots(started.elapsed())
            } else {
                let stderr = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
                Probe::Rejected(format!(
                    "QEMU with KVM exited ({status}) before the kernel ran: {}",
                    stderr
                        .lines()
                        .rev()
                        .find(|l| !l.trim().is_empty())
                        .unwrap_or("")
                ))
            };
        }
        if started.elapsed() >= deadline {
            break Probe::Hangs(deadline);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = child.kill().await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The probe's QEMU arguments (after the program): `kernel` alone on one vCPU under KVM with
/// `-cpu host`, its console to `serial`. Not a VM's command line (that is
/// [`crate::qemu::argv::argv`]): no drives, no network, and a fixed kernel command line that
/// only has to show the kernel ran (`panic=-1 reboot=t`: it exits once it finds no root).
fn probe_args(kernel: &Path, serial: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-accel",
        "kvm",
        "-M",
        "microvm",
        "-m",
        "128",
        "-smp",
        "1",
        "-cpu",
        "host",
        "-nographic",
        "-no-reboot",
        "-monitor",
        "none",
        "-serial",
    ]
    .map(OsString::from)
    .into();
    args.push(format!("file:{}", serial.display()).into());
    args.push("-kernel".into());
    args.push(kernel.as_os_str().to_owned());
    args.extend(["-append", "console=ttyS0 panic=-1 reboot=t"].map(OsString::from));
    args
}

/// The cache key of `kernel` (path, size and mtime) and the file the verdict is kept in.
fn cache_entry(kernel: &Path, cache_dir: &Path) -> (String, PathBuf) {
    let key = std::fs::metadata(kernel)
        .ok()
        .map(|m| {
            use std::os::unix::fs::MetadataExt;
            format!("{}:{}:{}", kernel.display(), m.len(), m.mtime())
        })
        .unwrap_or_default();
    (key, cache_dir.join("kvm-probe"))
}

/// The verdict [`probe_boot_cached`] remembered for `kernel` in `cache_dir`, if any: whether
/// KVM boots it.
pub fn cached_verdict(kernel: &Path, cache_dir: &Path) -> Option<bool> {
    let (key, file) = cache_entry(kernel, cache_dir);
    let text = std::fs::read_to_string(&file).ok()?;
    let (k, v) = text.trim().rsplit_once('=')?;
    (k == key).then_some(v == "kvm")
}

/// [`probe_boot`], remembered in `cache_dir` per kernel file (path, size and mtime).
pub async fn probe_boot_cached(
    qemu: &Path,
    kernel: &Path,
    deadline: Duration,
    cache_dir: &Path,
) -> bool {
    if let Some(kvm) = cached_verdict(kernel, cache_dir) {
        return kvm;
    }
    let (key, file) = cache_entry(kernel, cache_dir);
    let probe = probe_boot(qemu, kernel, deadline).await;
    tracing::info!(?probe, kernel = %kernel.display(), "kvm boot probe");
    let _ = std::fs::create_dir_all(cache_dir);
    let verdict = if probe.kvm_boots() { "kvm" } else { "tcg" };
    let _ = std::fs::write(&file, format!("{key}={verdict}\n"));
    probe.kvm_boots()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_boots_the_kernel_alone_under_kvm_with_the_host_cpu() {
        let args = probe_args(Path::new("/k/vmlinux"), Path::new("/tmp/p/serial.log"));
        let expected = [
            "-accel",
            "kvm",
            "-M",
            "microvm",
            "-m",
            "128",
            "-smp",
            "1",
            "-cpu",
            "host",
            "-nographic",
            "-no-reboot",
            "-monitor",
            "none",
            "-serial",
            "file:/tmp/p/serial.log",
            "-kernel",
            "/k/vmlinux",
            "-append",
            "console=ttyS0 panic=-1 reboot=t",
        ];
        assert_eq!(args, expected.map(OsString::from));
    }
}
