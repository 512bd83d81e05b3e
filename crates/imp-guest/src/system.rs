//! What only PID 1 does to the guest system: mount the pseudo filesystems, check the kernel
//! has a timer, load kernel modules, set the hostname, attach the console, and end the VM
//! cleanly.

use nix::errno::Errno;
use nix::kmod::{ModuleInitFlags, finit_module};
use nix::mount::{MsFlags, mount};
use nix::sys::reboot::{RebootMode, reboot};
use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, dup2_stderr, dup2_stdin, dup2_stdout, sethostname, sync};
use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;
use std::thread;
use std::time::Duration;

/// `MODULE_INIT_COMPRESSED_FILE`: let the kernel decompress a `.ko.xz`/`.ko.zst`.
const MODULE_INIT_COMPRESSED_FILE: u32 = 4;

/// Why a system step failed.
#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    /// A mount failed.
    #[error("Mounting {fstype} on {target} failed")]
    Mount {
        /// The filesystem type.
        fstype: &'static str,
        /// The mount point.
        target: &'static str,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// A module could not be loaded.
    #[error("Loading kernel module {path} failed")]
    Module {
        /// The module's path.
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The hostname could not be set.
    #[error("Setting the hostname to {0:?} failed")]
    Hostname(String, #[source] Errno),
    /// The wall clock could not be set.
    #[error("Setting the clock to {0} ns since the epoch failed")]
    Clock(u64, #[source] Errno),
    /// The root disk could not be made `/`.
    #[error("Switching the root to {device} ({step}) failed")]
    SwitchRoot {
        /// The root device.
        device: String,
        /// The step that failed.
        step: &'static str,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// A file could not be written.
    #[error("Writing {path} failed")]
    Write {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// One pseudo filesystem PID 1 mounts.
struct MountSpec {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: MsFlags,
    data: Option<&'static str>,
}

fn mounts() -> [MountSpec; 7] {
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    [
        MountSpec {
            source: "proc",
            target: "/proc",
            fstype: "proc",
            flags: nosuid_nodev | MsFlags::MS_NOEXEC,
            data: None,
        },
        MountSpec {
            source: "sysfs",
            target: "/sys",
            fstype: "sysfs",
            flags: nosuid_nodev | MsFlags::MS_NOEXEC,
            data: None,
        },
        MountSpec {
            source: "devtmpfs",
            target: "/dev",
            fstype: "devtmpfs",
            flags: MsFlags::MS_NOSUID,
            data: Some("mode=0755"),
        },
        MountSpec {
            source: "devpts",
            target: "/dev/pts",
            fstype: "devpts",
            flags: MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            data: Some("gid=5,mode=0620,ptmxmode=0666"),
        },
        MountSpec {
            source: "tmpfs",
            target: "/dev/shm",
            fstype: "tmpfs",
            flags: nosuid_nodev,
            data: Some("mode=1777"),
        },
        MountSpec {
            source: "tmpfs",
            target: "/run",
            fstype: "tmpfs",
            flags: nosuid_nodev,
            data: Some("mode=0755"),
        },
        MountSpec {
            source: "tmpfs",
            target: "/tmp",
            fstype: "tmpfs",
            flags: nosuid_nodev,
            data: Some("mode=1777"),
        },
    ]
}

/// Mounts proc, sys, dev, dev/pts, dev/shm, run and tmp; already-mounted ones (EBUSY) are fine.
/// Every failure is returned, none stops the others.
pub fn mount_pseudo_filesystems() -> Vec<SystemError> {
    let mut errors = Vec::new();
    for m in mounts() {
        let _ = std::fs::create_dir_all(m.target);
        match mount(Some(m.source), m.target, Some(m.fstype), m.flags, m.data) {
            Ok(()) | Err(Errno::EBUSY) => {}
            Err(source) => errors.push(SystemError::Mount {
                fstype: m.fstype,
                target: m.target,
                source,
            }),
        }
    }
    errors
}

/// Where the root disk is mounted before it becomes `/`.
const NEW_ROOT: &str = "/.imp-root";

/// Makes the image's disk the guest's `/`, as `switch_root` does for an initramfs.
///
/// Waits up to `wait` for the device node (virtio_blk probes asynchronously after its module
/// loads), mounts it, moves the pseudo filesystems onto it, then moves it over `/` and chroots
/// there. From then on everything PID 1 starts (the workload, every exec) runs on the disk and
/// finds the image's programs and /etc/passwd under `/`. Mount points the image lacks (proc,
/// sys, dev, run, tmp) are created on the disk. The initramfs stays in memory underneath; it
/// holds only this binary, the modules and the config.
pub fn switch_root(
    device: &str,
    fstype: &str,
    options: Option<&str>,
    wait: Duration,
) -> Result<(), SystemError> {
    let fail = |step: &'static str| {
        let device = device.to_string();
        move |source: Errno| SystemError::SwitchRoot {
            device,
            step,
            source,
        }
    };
    let deadline = std::time::Instant::now() + wait;
    while !Path::new(device).exists() {
        if std::time::Instant::now() >= deadline {
            return Err(fail("waiting for the device")(Errno::ENODEV));
        }
        thread::sleep(Duration::from_millis(10));
    }
    let _ = std::fs::create_dir_all(NEW_ROOT);
    mount(
        Some(device),
        NEW_ROOT,
        Some(fstype),
        MsFlags::empty(),
        options,
    )
    .map_err(fail("mount"))?;
    for target in ["/proc", "/sys", "/dev", "/run", "/tmp"] {
        let dest = format!("{NEW_ROOT}{target}");
        let _ = std::fs::create_dir_all(&dest);
        mount(
            Some(target),
            dest.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(fail("moving a pseudo filesystem"))?;
    }
    nix::unistd::chdir(NEW_ROOT).map_err(fail("chdir"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(fail("moving it over /"))?;
    nix::unistd::chroot(".").map_err(fail("chroot"))?;
    nix::unistd::chdir("/").map_err(fail("chdir /"))?;
    Ok(())
}

/// Makes /dev/console our stdin, stdout and stderr (the kernel may have started us without
/// them if the rootfs had no /dev/console), so the workload inherits the console too.
pub fn attach_console() -> io::Result<()> {
    let console = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")?;
    dup2_stdin(&console)?;
    dup2_stdout(&console)?;
    dup2_stderr(&console)?;
    Ok(())
}

/// Loads one kernel module file; one already loaded is fine.
pub fn load_module(path: &str) -> Result<(), SystemError> {
    let fail = |source: io::Error| SystemError::Module {
        path: path.to_string(),
        source,
    };
    let file = File::open(path).map_err(fail)?;
    let flags = if path.ends_with(".xz") || path.ends_with(".zst") || path.ends_with(".gz") {
        ModuleInitFlags::from_bits_retain(MODULE_INIT_COMPRESSED_FILE)
    } else {
        ModuleInitFlags::empty()
    };
    match finit_module(&file, c"", flags) {
        Ok(()) | Err(Errno::EEXIST) => Ok(()),
        Err(e) => Err(fail(e.into())),
    }
}

/// Sets the kernel hostname.
pub fn set_hostname(name: &str) -> Result<(), SystemError> {
    sethostname(name).map_err(|e| SystemError::Hostname(name.to_string(), e))
}

/// The kernel hostname, if it can be read.
pub fn hostname() -> Option<String> {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
}

/// Sets the wall clock (`CLOCK_REALTIME`) to a time in nanoseconds since the Unix epoch.
pub fn set_clock(unix_nanos: u64) -> Result<(), SystemError> {
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, timespec(unix_nanos))
        .map_err(|e| SystemError::Clock(unix_nanos, e))
}

/// The `timespec` of a time in nanoseconds since the Unix epoch.
fn timespec(unix_nanos: u64) -> nix::sys::time::TimeSpec {
    let secs = i64::try_from(unix_nanos / 1_000_000_000).unwrap_or(i64::MAX);
    let nanos = i64::try_from(unix_nanos % 1_000_000_000).unwrap_or(0);
    nix::sys::time::TimeSpec::new(secs, nanos)
}

/// Writes a file through a temporary and a rename, replacing a symlink rather than following it.
pub fn write_file(path: &Path, contents: &str) -> Result<(), SystemError> {
    let fail = |source| SystemError::Write {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    let tmp = path.with_extension("imp-tmp");
    std::fs::write(&tmp, contents).map_err(fail)?;
    std::fs::rename(&tmp, path).map_err(fail)
}

/// Whether the kernel has a clock event device, the source of every timer interrupt, read from
/// `/proc/timer_list` (`None` when it cannot be read). Without one nothing that sleeps ever
/// wakes (`sleep 1`, a poll with a timeout, the scheduler's tick): a kernel on a busy
/// emulated machine can disable its only one at boot (Linux's "APIC frequency too slow,
/// disabling apic timer", when the host stalls the vCPU during the APIC timer's calibration).
pub fn has_clock_event() -> Option<bool> {
    std::fs::read_to_string("/proc/timer_list")
        .ok()
        .map(|t| timer_list_names_a_clock_event(&t))
}

/// Whether a `/proc/timer_list` names a clock event device: a `Clock Event Device:` line that
/// is not `<NULL>` (the broadcast device's is `<NULL>` on most machines).
pub fn timer_list_names_a_clock_event(timer_list: &str) -> bool {
    timer_list
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Clock Event Device:"))
        .any(|device| {
            let device = device.trim();
            !device.is_empty() && device != "<NULL>"
        })
}

/// Asks the host for another boot and ends the VM: prints [`imp_proto::marker::BOOT_RETRY_PREFIX`]
/// and `reason` through the kernel log at emergency level (printed on the serial console
/// synchronously, whatever the console's log level, and without a timer), then powers off
/// without waiting for anything.
pub fn ask_for_another_boot(reason: &str) -> ! {
    let line = imp_proto::marker::boot_retry_marker(reason);
    let logged = OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .and_then(|mut k| io::Write::write_all(&mut k, format!("<0>{line}").as_bytes()));
    if logged.is_err() {
        eprint!("{line}");
    }
    end_vm(true)
}

/// Ends every remaining process: SIGTERM, a moment to exit, then SIGKILL.
pub fn kill_all(grace: Duration) {
    let all = Pid::from_raw(-1);
    let _ = kill(all, Signal::SIGTERM);
    thread::sleep(grace);
    let _ = kill(all, Signal::SIGKILL);
}

/// Flushes filesystems, remounts / read-only and powers off or reboots; never returns.
pub fn end_vm(power_off: bool) -> ! {
    sync();
    let _ = mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    );
    sync();
    let mode = if power_off {
        RebootMode::RB_POWER_OFF
    } else {
        RebootMode::RB_AUTOBOOT
    };
    let err = match reboot(mode) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    eprintln!("imp-guest: reboot({mode:?}) failed: {err}; halting");
    let _ = reboot(RebootMode::RB_HALT_SYSTEM);
    // PID 1 must not exit (the kernel would panic); sleep forever instead.
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-CPU part of a `/proc/timer_list` (Linux 6.1), with `device` as its tick device.
    fn timer_list(device: &str) -> String {
        format!(
            "Timer List Version: v0.9\nHRTIMER_MAX_CLOCK_BASES: 8\nnow at 445904108098 nsecs\n\n\
             Tick Device: mode:     0\nBroadcast device\nClock Event Device: <NULL>\n\
             tick_broadcast_mask: 0\n\nTick Device: mode:     0\nPer CPU device: 0\n\
             Clock Event Device: {device}\n max_delta_ns:   137438953451\n"
        )
    }

    #[test]
    fn clock_times_become_timespecs() {
        use nix::sys::time::TimeValLike;
        let t = timespec(1_700_000_000_123_456_789);
        assert_eq!(t.tv_sec(), 1_700_000_000);
        assert_eq!(t.tv_nsec(), 123_456_789);
        assert_eq!(
            timespec(u64::MAX).num_seconds(),
            (u64::MAX / 1_000_000_000) as i64
        );
    }

    #[test]
    fn a_kernel_without_a_clock_event_device_is_told_apart() {
        assert!(timer_list_names_a_clock_event(&timer_list("lapic")));
        assert!(timer_list_names_a_clock_event(&timer_list(
            "lapic-deadline"
        )));
        assert!(!timer_list_names_a_clock_event(&timer_list("<NULL>")));
        assert!(!timer_list_names_a_clock_event(""));
    }
}
