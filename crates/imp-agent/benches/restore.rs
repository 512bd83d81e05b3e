//! Restore latency of the QEMU driver against guest memory size: a guest that wrote a quarter of
//! its RAM (tmpfs) is snapshotted and restored in a new QEMU process, its RAM either
//! - mapped from a file (`GuestMemory::Shared`, what imp runs): the snapshot is the device state,
//!   the restore maps the file and faults pages in as the guest touches them; or
//! - anonymous, as before (`GuestMemory::Anonymous`): the snapshot streams every page and the
//!   restore reads them all back before the guest runs;
//!
//! and for each: pause + snapshot time, bytes written, and restore → guest agent answering, with
//! the page cache dropped first (a sleeping VM's memory is on disk, not in RAM). The floor is a
//! QEMU that only loads the device state (the mapped restore up to "loaded", before the guest
//! runs a single instruction).
//!
//! `cargo bench -p imp-agent --bench restore` (256 MiB, 1 GiB, 2 GiB; `IMP_BENCH_MEMORY=256,1024`
//! chooses); under `cargo test` 256 MiB only. Needs what `tests/qemu_driver.rs` needs; what is missing
//! skips the bench on a developer machine and fails it under `CI=true` (`imp_testenv::guard`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark panics on failure

use imp_testenv::figures::figure;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use imp_agent::initramfs::archive::{BaseInitramfs, build_for_vm};
use imp_agent::initramfs::modules::VM_MODULES;
use imp_proto::config::{GuestConfig, ImageConfig, RootDisk};
use imp_proto::{Client, Hello};
use imp_vmm::qemu::{Launcher, Qemu};
use imp_vmm::{DriveConfig, GuestMemory, SnapshotFiles, VmConfig, Vmm, VsockConfig};

/// A 16 MiB ext4 with a static busybox as /bin/{sh,yes,head,sleep}.
fn make_disk(dir: &Path) -> PathBuf {
    let tree = dir.join("tree");
    std::fs::create_dir_all(tree.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", tree.join("bin/busybox")).unwrap();
    for applet in ["sh", "yes", "head", "sleep"] {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(applet)).unwrap();
    }
    let disk = dir.join("disk.ext4");
    let ok = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&disk)
        .arg("16M")
        .status()
        .unwrap()
        .success();
    assert!(ok, "mkfs.ext4 failed");
    disk
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Drops `file` from the page cache (after writing it back).
fn drop_cache(file: &Path) {
    let f = std::fs::File::open(file).unwrap();
    f.sync_all().unwrap();
    nix::fcntl::posix_fadvise(
        &f,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
}

async fn health(vm: &Qemu) {
    let stream = vm
        .connect_vsock(imp_proto::DEFAULT_API_PORT, Duration::from_secs(120))
        .await
        .unwrap()
        .into_std()
        .unwrap();
    stream.set_nonblocking(false).unwrap();
    tokio::task::spawn_blocking(move || {
        let mut c = Client::handshake(stream, &Hello::new("restore-bench")).unwrap();
        c.health().unwrap();
    })
    .await
    .unwrap();
}

async fn wait_serial(vm: &Qemu, marker: &str) {
    let t = Instant::now();
    while !std::fs::read_to_string(vm.serial_log_path())
        .unwrap_or_default()
        .contains(marker)
    {
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "no {marker:?} on the console"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct Figures {
    snapshot: Duration,
    written: u64,
    floor: Option<Duration>,
    answered: Duration,
}

/// Boots a VM of `mib` whose RAM is `memory`, lets it fill a quarter of it, snapshots it,
/// kills it, drops the snapshot from the page cache and restores it.
async fn measure(launcher: &Launcher, config: &VmConfig, dir: &Path) -> Figures {
    let mut vm = Qemu::boot(launcher, config).await.unwrap();
    wait_serial(&vm, "imp-bench-filled").await;
    health(&vm).await;
    let files = SnapshotFiles {
        state: dir.join("snap.state"),
        memory: dir.join("snap.stream"),
    };
    let t = Instant::now();
    vm.pause().await.unwrap();
    vm.snapshot(&files).await.unwrap();
    let snapshot = t.elapsed();
    vm.stop(Duration::ZERO).await.unwrap();
    let mut written = std::fs::metadata(&files.memory).unwrap().len();
    drop_cache(&files.memory);
    if let Some(ram) = config.memory.file() {
        drop_cache(ram);
        written += imp_agent::snapshot::sparse::data_bytes(ram).unwrap();
    }
    let t = Instant::now();
    let (floor, vm) = if config.memory.file().is_some() {
        let mut vm = Qemu::restore(launcher, config, &files, false)
            .await
            .unwrap();
        let floor = t.elapsed();
        vm.resume().await.unwrap();
        (Some(floor), vm)
    } else {
        (
            None,
            Qemu::restore(launcher, config, &files, true).await.unwrap(),
        )
    };
    health(&vm).await;
    let answered = t.elapsed();
    vm.stop(Duration::ZERO).await.unwrap();
    let _ = std::fs::remove_file(&files.memory);
    let _ = std::fs::remove_file(&files.state);
    Figures {
        snapshot,
        written,
        floor,
        answered,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let kdir = root.join("target/guest-kernel");
    let guest = root.join("target/imp-guest/imp-guest");
    // Skips on a developer machine, fails under CI=true, like every test that needs the machine.
    let launcher = match Launcher::detect() {
        Ok(l) => l,
        Err(e) => {
            imp_testenv::guard::require(false, &format!("restore bench: qemu ({e})"));
            return;
        }
    };
    if !imp_testenv::guard::require(
        kdir.join("vmlinux").is_file() && guest.is_file() && Path::new("/bin/busybox").is_file(),
        "restore bench: target/guest-kernel/vmlinux (scripts/fetch-guest-kernel.sh), \
         target/imp-guest/imp-guest (scripts/build-guest.sh) and /bin/busybox (busybox-static)",
    ) {
        return;
    }
    let benching = std::env::args().any(|a| a == "--bench");
    let sizes: Vec<u32> = std::env::var("IMP_BENCH_MEMORY")
        .ok()
        .map(|v| v.split(',').filter_map(|m| m.trim().parse().ok()).collect())
        .unwrap_or_else(|| {
            if benching {
                vec![256, 1024, 2048]
            } else {
                vec![256]
            }
        });
    let dir = std::env::temp_dir().join(format!("imp-restore-bench-{}", std::process::id()));
    let base = BaseInitramfs::cached(
        &dir.join("cache"),
        &guest,
        &kdir.join("modules"),
        VM_MODULES,
    )
    .await
    .unwrap();
    let disk = make_disk(&dir);
    println!("QEMU restore → guest agent answering, page cache dropped, a quarter of RAM written:");
    let mut mapped_ms = Vec::new();
    for (i, &mib) in sizes.iter().enumerate() {
        let fill = (u64::from(mib) << 20) / 4;
        let guest_config = GuestConfig {
            image: ImageConfig {
                cmd: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    format!(
                        "yes imp-restore-bench | head -c {fill} > /run/fill; \
                         echo imp-bench-filled; sleep 100000"
                    ),
                ],
                ..ImageConfig::default()
            },
            root: Some(RootDisk::ext4("/dev/vda")),
            ..GuestConfig::default()
        };
        for (j, memory) in ["mapped file", "anonymous (streamed)"].iter().enumerate() {
            let vm_dir = dir.join(format!("vm{i}-{j}"));
            std::fs::create_dir_all(&vm_dir).unwrap();
            let initrd = vm_dir.join("initrd.cpio");
            build_for_vm(&base, &guest_config, &initrd).await.unwrap();
            let copy = vm_dir.join("disk.ext4");
            std::fs::copy(&disk, &copy).unwrap();
            let config = VmConfig {
                id: format!("restore-bench-{i}-{j}"),
                run_dir: vm_dir.join("run"),
                vcpus: 1,
                memory_mib: mib,
                kernel: kdir.join("vmlinux"),
                initrd: Some(initrd),
                kernel_args: "console=ttyS0 panic=-1 reboot=t".into(),
                drives: vec![DriveConfig {
                    id: "root".into(),
                    path: copy,
                    read_only: false,
                    root: true,
                }],
                net: None,
                vsock: Some(VsockConfig {
                    guest_cid: 3 + (i * 2 + j) as u32,
                }),
                netns: None,
                confine: None,
                memory: if j == 0 {
                    GuestMemory::Shared(vm_dir.join("memory.ram"))
                } else {
                    GuestMemory::Anonymous
                },
            };
            let f = measure(&launcher, &config, &vm_dir).await;
            let floor = f
                .floor
                .map(|d| format!(" (floor: device state loaded {:.0} ms)", ms(d)))
                .unwrap_or_default();
            println!(
                "  {mib:>5} MiB, {memory:<21}: pause + snapshot {:>6.0} ms, {:>5} MiB written; \
                 restore → answering {:>6.0} ms{floor}",
                ms(f.snapshot),
                f.written >> 20,
                ms(f.answered),
            );
            let against = f
                .floor
                .map(|d| format!("floor: device state loaded {:.0} ms", ms(d)))
                .unwrap_or_default();
            figure(
                &format!("QEMU restore -> answering, {mib} MiB, {memory}"),
                ms(f.answered),
                "ms",
                &against,
            );
            if j == 0 {
                mapped_ms.push((mib, ms(f.answered)));
            }
            let _ = std::fs::remove_dir_all(&vm_dir);
        }
    }
    if let Some(&(base_mib, base_ms)) = mapped_ms.first() {
        for &(mib, t) in &mapped_ms[1..] {
            println!(
                "mapped restore of {mib} MiB / {base_mib} MiB: {:.2} (aim: at most 1.5)",
                t / base_ms
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
