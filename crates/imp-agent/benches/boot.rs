//! Boot latency of the QEMU driver: from `Qemu::boot` to the guest agent answering health over
//! vsock, over a few TCG boots of the real imp-guest (switching to a small busybox ext4 disk), plus the
//! time to build the base initramfs cold (no cache) and cached, and a VM's archive from it.
//! Boots alternate between the compressed bzImage (`vmlinuz`) and the extracted ELF `vmlinux`
//! (QEMU enters it through its PVH note, skipping decompression), and the ratio is printed.
//!
//! `cargo bench -p imp-agent --bench boot`; `IMP_BOOT_BENCH_RUNS` sets the boots per kernel (5).
//! Needs what `tests/qemu_driver.rs` needs; what is missing skips the bench on a developer machine
//! and fails it under `CI=true` (`imp_testenv::guard`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark panics on failure

use imp_testenv::figures::figure;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use imp_agent::initramfs::archive::{BaseInitramfs, build_for_vm};
use imp_agent::initramfs::modules::VM_MODULES;
use imp_proto::config::{GuestConfig, ImageConfig, RootDisk};
use imp_proto::{Client, Hello};
use imp_vmm::qemu::{Launcher, Qemu};
use imp_vmm::{DriveConfig, StopOutcome, VmConfig, Vmm, VsockConfig};

/// A 16 MiB ext4 with a static busybox as /bin/sleep.
fn make_disk(dir: &Path) -> PathBuf {
    let tree = dir.join("tree");
    std::fs::create_dir_all(tree.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", tree.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", tree.join("bin/sleep")).unwrap();
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

fn summary(name: &str, mut v: Vec<Duration>) {
    v.sort();
    figure(&format!("{name}, p50"), ms(v[v.len() / 2]), "ms", "");
    println!(
        "{name}: n={} p50={:.1} ms min={:.1} ms max={:.1} ms",
        v.len(),
        ms(v[v.len() / 2]),
        ms(v[0]),
        ms(v[v.len() - 1])
    );
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
            imp_testenv::guard::require(false, &format!("boot bench: qemu ({e})"));
            return;
        }
    };
    if !imp_testenv::guard::require(
        kdir.join("vmlinuz").is_file() && guest.is_file() && Path::new("/bin/busybox").is_file(),
        "boot bench: target/guest-kernel/vmlinuz (scripts/fetch-guest-kernel.sh), \
         target/imp-guest/imp-guest (scripts/build-guest.sh) and /bin/busybox (busybox-static)",
    ) {
        return;
    }
    let runs: usize = std::env::var("IMP_BOOT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let dir: PathBuf = std::env::temp_dir().join(format!("imp-boot-bench-{}", std::process::id()));
    let cache = dir.join("cache");

    let t = Instant::now();
    let base = BaseInitramfs::cached(&cache, &guest, &kdir.join("modules"), VM_MODULES)
        .await
        .unwrap();
    let cold = t.elapsed();
    assert!(!base.was_cached());
    let mut warm = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let again = BaseInitramfs::cached(&cache, &guest, &kdir.join("modules"), VM_MODULES)
            .await
            .unwrap();
        warm.push(t.elapsed());
        assert!(again.was_cached());
    }
    let size = std::fs::metadata(base.path()).unwrap().len();
    println!(
        "base initramfs: {size} bytes, cold build {:.1} ms",
        ms(cold)
    );
    summary("base initramfs cached lookup (reads metadata only)", warm);

    // The workload (busybox sleep) must outlive the measurement, so it runs from a small ext4
    // disk built once here and copied per boot; the boot includes the guest's switch to it.
    let disk = make_disk(&dir);
    let config = GuestConfig {
        image: ImageConfig {
            cmd: vec!["/bin/sleep".into(), "1000".into()],
            ..ImageConfig::default()
        },
        root: Some(RootDisk::ext4("/dev/vda")),
        ..GuestConfig::default()
    };
    let mut kernels = vec![("bzImage vmlinuz", kdir.join("vmlinuz"))];
    if kdir.join("vmlinux").is_file() {
        kernels.push(("ELF vmlinux (PVH)", kdir.join("vmlinux")));
    }
    let mut per_vm = Vec::new();
    let mut ready: Vec<Vec<Duration>> = vec![Vec::new(); kernels.len()];
    for i in 0..runs * kernels.len() {
        let which = i % kernels.len();
        let vm_dir = dir.join(format!("vm{i}"));
        std::fs::create_dir_all(&vm_dir).unwrap();
        let initrd = vm_dir.join("initrd.cpio");
        let t = Instant::now();
        build_for_vm(&base, &config, &initrd).await.unwrap();
        per_vm.push(t.elapsed());
        let vm_config = VmConfig {
            id: format!("bench{i}"),
            run_dir: vm_dir.join("run"),
            vcpus: 1,
            memory_mib: 256,
            kernel: kernels[which].1.clone(),
            initrd: Some(initrd),
            kernel_args: "console=ttyS0 panic=-1 reboot=t".into(),
            drives: vec![DriveConfig {
                id: "root".into(),
                path: {
                    let copy = vm_dir.join("disk.ext4");
                    std::fs::copy(&disk, &copy).unwrap();
                    copy
                },
                read_only: false,
                root: true,
            }],
            net: None,
            vsock: Some(VsockConfig {
                guest_cid: 3 + i as u32,
            }),
            netns: None,
            confine: None,
            memory: Default::default(),
        };
        let t = Instant::now();
        let vm = Qemu::boot(&launcher, &vm_config).await.unwrap();
        let stream = vm
            .connect_vsock(imp_proto::DEFAULT_API_PORT, Duration::from_secs(120))
            .await
            .unwrap()
            .into_std()
            .unwrap();
        stream.set_nonblocking(false).unwrap();
        tokio::task::spawn_blocking(move || {
            let mut c = Client::handshake(stream, &Hello::new("boot-bench")).unwrap();
            c.health().unwrap();
        })
        .await
        .unwrap();
        ready[which].push(t.elapsed());
        let outcome = vm.stop(Duration::from_secs(30)).await.unwrap();
        if outcome != StopOutcome::Graceful {
            println!("boot {i}: stop ended {outcome:?}");
        }
    }
    summary("per-VM initramfs (copy base + config archive)", per_vm);
    let p50 = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v[v.len() / 2]
    };
    let medians: Vec<Duration> = ready.iter().map(|v| p50(v)).collect();
    for ((name, _), times) in kernels.iter().zip(ready) {
        summary(
            &format!("QEMU/TCG start to guest agent health answered, {name}"),
            times,
        );
    }
    if let [bz, elf] = medians[..] {
        println!(
            "vmlinux / vmlinuz boot time (p50): {:.2} (interleaved boots)",
            elf.as_secs_f64() / bz.as_secs_f64()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
