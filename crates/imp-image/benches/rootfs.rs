//! Rootfs pipeline timings: building the ext4 base for an image cold (import + unpack + mkfs)
//! versus cached for the same digest, and cloning a per-VM disk from the base.
//!
//! Run: `cargo bench -p imp-image --bench rootfs` (or `cargo test -p imp-image --bench rootfs`
//! for a debug build). Prints figures; asserts nothing about time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use imp_testenv::figures::figure;
use std::time::{Duration, Instant};

use imp_image::{ImageSource, ImageStore, Limits, RegistryAuth, clone_disk};
use imp_testenv::registry::{TestImage, TestLayer, scratch_dir};

/// Files and bytes of the synthetic image.
const FILES: usize = 400;
const FILE_BYTES: usize = 64 << 10;
const ROUNDS: usize = 3;

/// Deterministic incompressible-ish bytes (xorshift), so gzip does real work.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    for tool in ["mkfs.ext4", "resize2fs"] {
        // Skips on a developer machine, fails under CI=true.
        if !imp_testenv::guard::require(
            imp_testenv::guard::which(tool).is_some(),
            &format!("rootfs bench: `{tool}` on PATH (e2fsprogs)"),
        ) {
            return;
        }
    }
    let dir = scratch_dir("imp-rootfs-bench").unwrap();
    let mut lower = TestLayer::new().dir("data/", 0o755);
    for i in 0..FILES / 2 {
        lower = lower.file(&format!("data/a{i}"), noise(i as u64, FILE_BYTES), 0o644);
    }
    let mut upper = TestLayer::new();
    for i in 0..FILES / 2 {
        upper = upper.file(
            &format!("data/b{i}"),
            noise(1_000 + i as u64, FILE_BYTES),
            0o644,
        );
    }
    if let Some(busybox) = imp_testenv::guard::which("busybox") {
        upper = upper.file("bin/busybox", std::fs::read(busybox).unwrap(), 0o755);
    }
    let layout = dir.join("layout");
    TestImage::new()
        .layer(lower)
        .layer(upper)
        .write_layout(&layout, "v1")
        .unwrap();
    let src: ImageSource = format!("oci:{}:v1", layout.display()).parse().unwrap();

    let (mut cold, mut cached, mut clones) = (Vec::new(), Vec::new(), Vec::new());
    let mut base_size = 0;
    let mut method = None;
    for round in 0..ROUNDS {
        let store = ImageStore::new(dir.join(format!("cache{round}")), Limits::default());
        let t = Instant::now();
        let img = store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
        let base = store.rootfs(&img, &[]).await.unwrap();
        cold.push(t.elapsed());
        assert!(!base.cached);
        base_size = base.size_bytes;

        let t = Instant::now();
        let img = store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
        let again = store.rootfs(&img, &[]).await.unwrap();
        cached.push(t.elapsed());
        assert!(again.cached && img.blobs_fetched == 0);

        let t = Instant::now();
        let m = clone_disk(&base.path, &dir.join(format!("vm{round}.ext4")), 1 << 30)
            .await
            .unwrap();
        clones.push(t.elapsed());
        method = Some(m);
    }
    let (c, h, k) = (median(cold), median(cached), median(clones));
    println!(
        "rootfs bench: image of {FILES} x {} KiB files in 2 gzip layers, base ext4 {:.1} MiB, median of {ROUNDS}",
        FILE_BYTES >> 10,
        base_size as f64 / f64::from(1 << 20)
    );
    println!(
        "  cold   (import blobs + unpack + mkfs.ext4): {:9.2} ms",
        ms(c)
    );
    println!(
        "  cached (same digest, no blob copied):       {:9.2} ms",
        ms(h)
    );
    println!(
        "  ratio cold/cached:                           {:9.1}x",
        c.as_secs_f64() / h.as_secs_f64().max(1e-9)
    );
    println!("  clone_disk to 1 GiB ({method:?}):      {:9.2} ms", ms(k));
    figure(
        "rootfs: cold (import + unpack + mkfs.ext4)",
        ms(c),
        "ms",
        "",
    );
    figure("rootfs: cached (same digest)", ms(h), "ms", "");
    figure(
        &format!("rootfs: clone_disk to 1 GiB ({method:?})"),
        ms(k),
        "ms",
        "",
    );
    let _ = std::fs::remove_dir_all(&dir);
}
