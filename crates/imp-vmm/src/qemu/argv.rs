//! QEMU's command line, built as data before anything is started.
//!
//! [`argv`] is a pure function of the launcher, the VM's config, the paths QEMU is given
//! ([`confine::Paths`]) and the number of the TAP descriptor it inherits: it opens, creates and
//! spawns nothing, so tests check the whole command line without QEMU (as
//! `firecracker::plan` does for Firecracker's API calls). The guest's kernel command line is
//! built in one place, [`kernel_append`].
//!
//! Values QEMU parses as `key=value,…` lists double their commas where a path or name may
//! hold one: the VM's name, the serial log, the guest-memory file and the drive files.
//!
//! QEMU is given no socket path: QMP and the guest channel are chardevs on descriptors it
//! inherits ([`Fds`]), each one end of a socket pair the driver made and holds the other end
//! of. The driver (root) never connects to a path QEMU could have replaced, and a confined
//! QEMU needs no directory to write sockets in.

use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::Path;

use super::{Accel, Launcher, MUX_PORT, SANDBOX, confine};
use crate::{GuestMemory, NetConfig, VmConfig};

/// The id of the guest's RAM: the one QEMU gives microvm's own RAM, so a stream written from
/// anonymous RAM (a suspend of an earlier release) loads into a VM whose RAM is a file.
const RAM_ID: &str = "microvm.ram";

/// The descriptors QEMU inherits under their own numbers and is told about on its command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fds {
    /// QEMU's end of the QMP socket pair.
    pub qmp: RawFd,
    /// QEMU's end of the guest channel's socket pair (VMs with vsock): its virtio-serial port.
    pub mux: Option<RawFd>,
    /// Its TAP, when it is handed one (then `-netdev` names the fd, not the TAP).
    pub tap: Option<RawFd>,
}

/// The whole command line, program first: `qemu-system-x86_64 …`, or `ip netns exec NS
/// qemu-system-x86_64 …` for a VM in a network namespace.
///
/// `fds` are the descriptors QEMU inherits (QMP, the guest channel, the TAP); `incoming`
/// adds `-incoming defer` for a restore, whose migration QMP starts once its capabilities
/// are set. A boot and a restore of the same VM get the same command line but for that.
pub fn argv(
    launcher: &Launcher,
    config: &VmConfig,
    paths: &confine::Paths,
    fds: &Fds,
    incoming: bool,
) -> Vec<OsString> {
    let mut a = Argv(program(launcher, config));
    machine(&mut a, launcher, config, paths);
    // No exec, no privilege changes, no scheduler or resource games, no obsolete calls:
    // QEMU's seccomp filter, installed before the guest runs.
    a.push(["-sandbox", SANDBOX]);
    console(&mut a, paths, fds.qmp);
    a.push(["-kernel"]);
    a.push_os(&paths.kernel_arg);
    if let Some(initrd) = &paths.initrd_arg {
        a.push(["-initrd"]);
        a.push_os(initrd);
    }
    let append = kernel_append(&config.kernel_args, launcher.accel, &launcher.tsc_arg());
    a.push(["-append", &append]);
    devices(&mut a, config, paths, fds);
    if incoming {
        // A snapshot is read from a descriptor: a confined QEMU cannot open it, and
        // `-sandbox spawn=deny` forbids the `exec:` migration URI.
        a.push(["-incoming", "defer"]);
    }
    a.0
}

/// The guest's kernel command line (`-append`): the config's arguments, plus `tsc` (the
/// launcher's `tsc_early_khz=…`) unless they set `tsc_early_khz=` themselves, plus
/// `tsc=reliable` under TCG unless they say `tsc=`; trimmed.
pub fn kernel_append(kernel_args: &str, accel: Accel, tsc: &str) -> String {
    let mut append = kernel_args.to_owned();
    // microvm has no PIT or HPET to calibrate the TSC against.
    if !append.contains("tsc_early_khz=") {
        append.push(' ');
        append.push_str(tsc);
    }
    if accel == Accel::Tcg && !append.contains("tsc=") {
        // Under TCG the guest's TSC is the host's; its timer interrupts are what run late
        // under load, so the clocksource watchdog would wrongly drop the TSC for jiffies.
        append.push_str(" tsc=reliable");
    }
    append.trim().to_owned()
}

/// A command line being built.
struct Argv(Vec<OsString>);

impl Argv {
    fn push<const N: usize>(&mut self, args: [&str; N]) {
        self.0.extend(args.map(OsString::from));
    }

    /// A path as it is (not through `display`): `-kernel` and `-initrd` take the bytes.
    fn push_os(&mut self, path: &Path) {
        self.0.push(path.as_os_str().to_owned());
    }
}

/// QEMU itself, run in the VM's network namespace when it has one.
fn program(launcher: &Launcher, config: &VmConfig) -> Vec<OsString> {
    let mut out = Vec::new();
    if let Some(ns) = &config.netns {
        out.extend(["ip", "netns", "exec", ns].map(OsString::from));
    }
    out.push(launcher.qemu.as_os_str().to_owned());
    out
}

/// The VM's name, accelerator, machine, RAM and CPUs.
fn machine(a: &mut Argv, launcher: &Launcher, config: &VmConfig, paths: &confine::Paths) {
    let (machine, ram) = memory_args(
        config.memory_mib,
        &config.memory,
        paths.memory_arg.as_deref(),
    );
    // The VM's name tells its QEMU apart in `ps` (a confined one names no host path).
    a.push(["-name", &escape(&config.id)]);
    let accel = match launcher.accel {
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg",
    };
    a.push(["-accel", accel, "-M", &machine]);
    a.push(["-m", &format!("{}M", config.memory_mib)]);
    a.push(["-smp", &config.vcpus.to_string()]);
    if let Some(ram) = ram {
        a.push(["-object", &ram]);
    }
    if launcher.accel == Accel::Kvm {
        a.push(["-cpu", "host"]);
    }
}

/// No display, monitor, reboot or sound; the serial console to its log; QMP on the inherited
/// descriptor `qmp` (a connected socket: `server=off`, and no `reconnect`, which would need a
/// path).
fn console(a: &mut Argv, paths: &confine::Paths, qmp: RawFd) {
    // `append=on`: `-serial file:` truncates the log, so a restore would lose the console
    // from before the snapshot (a boot empties the log itself).
    // No sound: without an audio backend QEMU ≥ 8 probes the host's (PulseAudio's
    // module among them) at every start.
    a.push(["-nographic", "-no-reboot", "-monitor", "none"]);
    a.push(["-audiodev", "none,id=noaudio"]);
    let serial = format!(
        "file,id=serial,path={},append=on",
        escape(&paths.serial_arg.display().to_string())
    );
    a.push(["-chardev", &serial, "-serial", "chardev:serial"]);
    let qmp = format!("socket,id=qmp,fd={qmp},server=off");
    a.push(["-chardev", &qmp, "-mon", "chardev=qmp,mode=control"]);
}

/// The drives, the network device and the guest channel's virtio-serial port, whose chardev
/// is the inherited descriptor `fds.mux`.
fn devices(a: &mut Argv, config: &VmConfig, paths: &confine::Paths, fds: &Fds) {
    for (d, path) in config.drives.iter().zip(&paths.drive_args) {
        let file = escape(&path.display().to_string());
        let mut drive = format!("id={},file={file},format=raw,if=none", d.id);
        if d.read_only {
            drive.push_str(",readonly=on");
        }
        let device = format!("virtio-blk-device,drive={}", d.id);
        a.push(["-drive", &drive, "-device", &device]);
    }
    if let Some(n) = &config.net {
        let mut dev = format!("virtio-net-device,netdev={}", n.id);
        if let Some(mac) = &n.mac {
            dev.push_str(&format!(",mac={mac}"));
        }
        a.push(["-netdev", &netdev_arg(n, fds.tap), "-device", &dev]);
    }
    if let Some(mux) = fds.mux.filter(|_| config.vsock.is_some()) {
        let chardev = format!("socket,id=mux,fd={mux},server=off");
        let port = format!("virtserialport,chardev=mux,name={MUX_PORT}");
        a.push(["-device", "virtio-serial-device", "-chardev", &chardev]);
        a.push(["-device", &port]);
    }
}

/// `-M` and `-object` for a guest of `mib` MiB whose RAM is `memory`, the file named `path`
/// as QEMU sees it (a confined QEMU sees it under another name).
pub(super) fn memory_args(
    mib: u32,
    memory: &GuestMemory,
    path: Option<&Path>,
) -> (String, Option<String>) {
    let share = match memory {
        GuestMemory::Anonymous => return ("microvm".into(), None),
        GuestMemory::Shared(_) => "on",
        // Opened read-only, yet writable RAM (`rom=off`): the guest's writes are its own.
        GuestMemory::Private(_) => "off,readonly=on,rom=off",
    };
    let path = path.or(memory.file()).unwrap_or(Path::new(""));
    (
        format!("microvm,memory-backend={RAM_ID}"),
        Some(format!(
            "memory-backend-file,id={RAM_ID},size={mib}M,mem-path={},share={share}",
            escape(&path.display().to_string())
        )),
    )
}

/// QEMU's `-netdev` for `net`: the inherited fd `tap_fd` when QEMU is given one, else the
/// TAP by name.
///
/// Never with a virtio-net header (`vnet_hdr=off`): the virtio-net device's features follow
/// its backend's, and a snapshot restores only into a device with the same features. A VM
/// woken from its snapshot gets the fd its sleeper held (see `net::sleeper`), opened without
/// `IFF_VNET_HDR`, so the boot must not have one either.
fn netdev_arg(net: &NetConfig, tap_fd: Option<RawFd>) -> String {
    match tap_fd {
        // QEMU refuses `vnet_hdr=` with `fd=`; it reads the fd's own flags instead.
        Some(fd) => format!("tap,id={},fd={fd}", net.id),
        None => format!(
            "tap,id={},ifname={},script=no,downscript=no,vnet_hdr=off",
            net.id, net.tap
        ),
    }
}

/// A value inside QEMU's `key=value,…` syntax, where a comma is written `,,`.
fn escape(value: &str) -> String {
    value.replace(',', ",,")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::qemu::files;
    use crate::{Confine, DriveConfig, VsockConfig};
    use std::path::PathBuf;
    use std::time::Duration;

    fn launcher(accel: Accel) -> Launcher {
        Launcher {
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            accel,
            tsc_khz: 2_500_000,
            socket_timeout: Duration::from_secs(10),
            qmp_timeout: Duration::from_secs(30),
            agent_port: Some(1024),
        }
    }

    fn config() -> VmConfig {
        VmConfig {
            id: "vm-1".into(),
            run_dir: "/run/imp/vm-1".into(),
            vcpus: 2,
            memory_mib: 512,
            kernel: "/k/vmlinux".into(),
            initrd: Some("/run/imp/vm-1/initramfs.cpio".into()),
            kernel_args: "console=ttyS0 panic=-1".into(),
            drives: vec![
                DriveConfig {
                    id: "root".into(),
                    path: "/run/imp/vm-1/disk.ext4".into(),
                    read_only: false,
                    root: true,
                },
                DriveConfig {
                    id: "data".into(),
                    path: "/images/data.ext4".into(),
                    read_only: true,
                    root: false,
                },
            ],
            net: Some(NetConfig {
                id: "eth0".into(),
                tap: "imp-tap0".into(),
                mac: Some("02:00:00:00:00:01".into()),
                tap_fd: None,
            }),
            vsock: Some(VsockConfig { guest_cid: 3 }),
            netns: None,
            confine: None,
            memory: GuestMemory::Anonymous,
        }
    }

    fn paths(config: &VmConfig, kvm: bool) -> confine::Paths {
        let run_dir = config.run_dir.clone();
        confine::paths(config, &run_dir, &run_dir.join(files::SERIAL), kvm)
    }

    /// The descriptors the driver would hand `config`'s QEMU (QMP on 20, the guest channel on
    /// 21), with the TAP's `tap`.
    /// The argv of `config` under TCG, unconfined, with no TAP descriptor; `incoming` for a
    /// restore.
    fn tcg_argv(config: &VmConfig, incoming: bool) -> Vec<OsString> {
        argv(
            &launcher(Accel::Tcg),
            config,
            &paths(config, false),
            &fds(config, None),
            incoming,
        )
    }

    fn fds(config: &VmConfig, tap: Option<RawFd>) -> Fds {
        Fds {
            qmp: 20,
            mux: config.vsock.as_ref().map(|_| 21),
            tap,
        }
    }

    fn strings(argv: &[OsString]) -> Vec<&str> {
        argv.iter().map(|a| a.to_str().unwrap()).collect()
    }

    /// The value after the first `flag`.
    fn value<'a>(argv: &'a [OsString], flag: &str) -> &'a str {
        let i = argv.iter().position(|a| a == flag).unwrap();
        argv[i + 1].to_str().unwrap()
    }

    #[test]
    fn a_confined_kvm_vm_with_a_tap_fd_and_vsock_gets_exactly_its_command_line() {
        let mut c = config();
        c.confine = Some(Confine { uid: 7, gid: 8 });
        let p = paths(&c, true);
        let argv = argv(&launcher(Accel::Kvm), &c, &p, &fds(&c, Some(9)), false);
        let expected = [
            "/usr/bin/qemu-system-x86_64",
            "-name",
            "vm-1",
            "-accel",
            "kvm",
            "-M",
            "microvm",
            "-m",
            "512M",
            "-smp",
            "2",
            "-cpu",
            "host",
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            "-nographic",
            "-no-reboot",
            "-monitor",
            "none",
            "-audiodev",
            "none,id=noaudio",
            "-chardev",
            "file,id=serial,path=/log/serial.log,append=on",
            "-serial",
            "chardev:serial",
            "-chardev",
            "socket,id=qmp,fd=20,server=off",
            "-mon",
            "chardev=qmp,mode=control",
            "-kernel",
            "/boot/kernel",
            "-initrd",
            "/boot/initrd",
            "-append",
            "console=ttyS0 panic=-1 tsc_early_khz=2500000",
            "-drive",
            "id=root,file=/drives/root,format=raw,if=none",
            "-device",
            "virtio-blk-device,drive=root",
            "-drive",
            "id=data,file=/drives/data,format=raw,if=none,readonly=on",
            "-device",
            "virtio-blk-device,drive=data",
            "-netdev",
            "tap,id=eth0,fd=9",
            "-device",
            "virtio-net-device,netdev=eth0,mac=02:00:00:00:00:01",
            "-device",
            "virtio-serial-device",
            "-chardev",
            "socket,id=mux,fd=21,server=off",
            "-device",
            "virtserialport,chardev=mux,name=imp.mux",
        ];
        assert_eq!(strings(&argv), expected);
    }

    /// Every socket QEMU talks to the host over is a descriptor it inherits: it is given no
    /// socket path to listen on (which the driver, as root, would then connect to), confined
    /// or not, booted or restored, and a restore's command line is the boot's plus
    /// `-incoming defer`.
    #[test]
    fn qemu_is_given_its_sockets_as_descriptors_never_as_paths() {
        for confine in [None, Some(Confine { uid: 7, gid: 8 })] {
            let mut c = config();
            c.confine = confine;
            let p = paths(&c, false);
            let l = launcher(Accel::Tcg);
            let boot = argv(&l, &c, &p, &fds(&c, Some(9)), false);
            let sockets: Vec<&str> = boot
                .windows(2)
                .filter(|w| w[0] == "-chardev" || w[0] == "-qmp" || w[0] == "-mon")
                .map(|w| w[1].to_str().unwrap())
                .filter(|v| !v.starts_with("file,id=serial,"))
                .collect();
            assert_eq!(
                sockets,
                [
                    "socket,id=qmp,fd=20,server=off",
                    "chardev=qmp,mode=control",
                    "socket,id=mux,fd=21,server=off",
                ]
            );
            assert!(
                !strings(&boot)
                    .iter()
                    .any(|a| a.contains("unix:") || a.contains(".sock")),
                "{boot:?}"
            );
            let restore = argv(&l, &c, &p, &fds(&c, Some(9)), true);
            assert_eq!(restore[..boot.len()], boot[..]);
            assert_eq!(strings(&restore[boot.len()..]), ["-incoming", "defer"]);
        }
    }

    #[test]
    fn an_unconfined_tcg_vm_names_its_host_files_and_its_tap_by_name() {
        let mut c = config();
        c.vsock = None;
        c.drives.truncate(1);
        c.net.as_mut().unwrap().mac = None;
        let argv = tcg_argv(&c, false);
        let s = strings(&argv);
        assert_eq!(value(&argv, "-accel"), "tcg");
        assert!(!s.contains(&"-cpu"), "no host CPU under TCG");
        assert_eq!(value(&argv, "-kernel"), "/k/vmlinux");
        assert_eq!(value(&argv, "-initrd"), "/run/imp/vm-1/initramfs.cpio");
        assert_eq!(
            value(&argv, "-drive"),
            "id=root,file=/run/imp/vm-1/disk.ext4,format=raw,if=none"
        );
        assert_eq!(
            value(&argv, "-netdev"),
            "tap,id=eth0,ifname=imp-tap0,script=no,downscript=no,vnet_hdr=off"
        );
        assert!(s.contains(&"virtio-net-device,netdev=eth0"));
        assert!(
            !s.contains(&"virtio-serial-device"),
            "no channel without vsock"
        );
        assert!(!s.contains(&"-incoming"));
    }

    #[test]
    fn a_vm_in_a_network_namespace_runs_qemu_through_ip_netns_exec() {
        let mut c = config();
        c.netns = Some("imp-ns".into());
        let argv = tcg_argv(&c, false);
        assert_eq!(
            strings(&argv[..5]),
            [
                "ip",
                "netns",
                "exec",
                "imp-ns",
                "/usr/bin/qemu-system-x86_64"
            ]
        );
    }

    #[test]
    fn a_restore_waits_for_its_migration_at_the_end_of_the_line() {
        let c = config();
        let argv = tcg_argv(&c, true);
        assert_eq!(strings(&argv[argv.len() - 2..]), ["-incoming", "defer"]);
        assert_eq!(argv.iter().filter(|a| *a == "-incoming").count(), 1);
    }

    #[test]
    fn commas_in_names_and_paths_are_doubled() {
        let mut c = config();
        c.id = "a,b".into();
        c.run_dir = "/run/x,y".into();
        c.memory = GuestMemory::Shared("/run/x,y/memory.ram".into());
        c.drives[0].path = "/run/x,y/disk.ext4".into();
        let argv = tcg_argv(&c, false);
        assert_eq!(value(&argv, "-name"), "a,,b");
        assert_eq!(
            value(&argv, "-drive"),
            "id=root,file=/run/x,,y/disk.ext4,format=raw,if=none"
        );
        assert_eq!(
            value(&argv, "-chardev"),
            "file,id=serial,path=/run/x,,y/serial.log,append=on"
        );
        assert_eq!(value(&argv, "-M"), "microvm,memory-backend=microvm.ram");
        assert_eq!(
            value(&argv, "-object"),
            "memory-backend-file,id=microvm.ram,size=512M,mem-path=/run/x,,y/memory.ram,share=on"
        );
    }

    #[test]
    fn tcg_adds_tsc_reliable_once_and_never_over_the_callers_tsc() {
        let tsc = "tsc_early_khz=2000";
        assert_eq!(
            kernel_append("console=ttyS0", Accel::Tcg, tsc),
            "console=ttyS0 tsc_early_khz=2000 tsc=reliable"
        );
        assert_eq!(
            kernel_append("console=ttyS0", Accel::Kvm, tsc),
            "console=ttyS0 tsc_early_khz=2000"
        );
        assert_eq!(
            kernel_append("tsc=unstable", Accel::Tcg, tsc),
            "tsc=unstable tsc_early_khz=2000"
        );
        assert_eq!(
            kernel_append("tsc_early_khz=1 tsc=reliable", Accel::Tcg, tsc),
            "tsc_early_khz=1 tsc=reliable"
        );
        assert_eq!(kernel_append("", Accel::Kvm, tsc), "tsc_early_khz=2000");
        let c = config();
        let argv = tcg_argv(&c, false);
        let append = value(&argv, "-append");
        assert_eq!(append.matches("tsc=reliable").count(), 1);
        assert_eq!(append.matches("tsc_early_khz=").count(), 1);
    }

    #[test]
    fn read_only_drives_say_so_and_writable_ones_do_not() {
        let c = config();
        let argv = tcg_argv(&c, false);
        let drives: Vec<&str> = argv
            .windows(2)
            .filter(|w| w[0] == "-drive")
            .map(|w| w[1].to_str().unwrap())
            .collect();
        assert_eq!(
            drives,
            [
                "id=root,file=/run/imp/vm-1/disk.ext4,format=raw,if=none",
                "id=data,file=/images/data.ext4,format=raw,if=none,readonly=on",
            ]
        );
    }

    #[test]
    fn a_kernel_path_that_is_not_utf8_reaches_qemu_byte_for_byte() {
        use std::os::unix::ffi::OsStrExt as _;
        let mut c = config();
        c.kernel = PathBuf::from(std::ffi::OsStr::from_bytes(b"/k/\xffvmlinux"));
        let argv = tcg_argv(&c, false);
        let i = argv.iter().position(|a| a == "-kernel").unwrap();
        assert_eq!(argv[i + 1].as_bytes(), b"/k/\xffvmlinux");
    }

    #[test]
    fn a_tap_is_opened_by_name_or_inherited_by_fd() {
        let net = NetConfig {
            id: "n0".into(),
            tap: "imp-tap0".into(),
            mac: None,
            tap_fd: None,
        };
        assert_eq!(
            netdev_arg(&net, None),
            "tap,id=n0,ifname=imp-tap0,script=no,downscript=no,vnet_hdr=off"
        );
        assert_eq!(netdev_arg(&net, Some(12)), "tap,id=n0,fd=12");
    }

    #[test]
    fn guest_ram_is_a_file_mapped_shared_or_private_under_qemus_own_id() {
        let (m, obj) = memory_args(256, &GuestMemory::Anonymous, None);
        assert_eq!((m.as_str(), obj), ("microvm", None));
        let shared = GuestMemory::Shared("/v/memory.ram".into());
        let (m, obj) = memory_args(2048, &shared, Some(Path::new("/mem/ram")));
        assert_eq!(m, "microvm,memory-backend=microvm.ram");
        assert_eq!(
            obj.unwrap(),
            "memory-backend-file,id=microvm.ram,size=2048M,mem-path=/mem/ram,share=on"
        );
        let private = GuestMemory::Private("/s/a,b/memory".into());
        let (_, obj) = memory_args(256, &private, None);
        assert!(
            obj.unwrap()
                .ends_with("mem-path=/s/a,,b/memory,share=off,readonly=on,rom=off")
        );
    }
}
