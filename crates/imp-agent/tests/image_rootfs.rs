//! Building ext4 bases from local OCI layouts and archives with real mkfs.ext4, refusing
//! escaping layers, composing extra layers, and cloning per-VM disks (checked with debugfs,
//! dumpe2fs and e2fsck from e2fsprogs; nothing is mounted).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use imp_agent::image::{ImageError, ImageSource, ImageStore, Limits, RegistryAuth, clone_disk};
use imp_testkube::registry::{TestImage, TestLayer, scratch_dir, write_archive};

fn tools() -> bool {
    ["mkfs.ext4", "debugfs", "dumpe2fs", "resize2fs", "e2fsck"]
        .iter()
        .all(|t| {
            imp_testkube::guard::require(
                imp_testkube::guard::which(t).is_some(),
                &format!("tool `{t}` on PATH"),
            )
        })
}

/// Runs `debugfs -R cmd img` (read-only unless `write`), returning stdout; stderr must not say
/// the file is missing.
fn debugfs(img: &Path, cmd: &str, write: bool) -> (String, String) {
    let mut c = Command::new("debugfs");
    if write {
        c.arg("-w");
    }
    let out = c.arg("-R").arg(cmd).arg(img).output().unwrap();
    assert!(out.status.success());
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn block_count(img: &Path) -> u64 {
    let out = Command::new("dumpe2fs")
        .arg("-h")
        .arg(img)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("Block count:"))
        .unwrap();
    line.split_whitespace().last().unwrap().parse().unwrap()
}

fn base_image() -> TestImage {
    TestImage::new()
        .layer(
            TestLayer::new()
                .dir("etc/", 0o755)
                .file("etc/hello", "hello from the image\n", 0o644)
                .file("etc/gone", "lower", 0o644)
                .dir("bin/", 0o755)
                .file("bin/tool", "#!/bin/sh\n", 0o4755)
                .symlink("bin/sh", "tool")
                .hardlink("bin/tool2", "bin/tool"),
        )
        .layer(
            TestLayer::new()
                .file("etc/.wh.gone", "", 0o644)
                .file("etc/upper", "upper\n", 0o600),
        )
        .entrypoint(&["/bin/tool"])
}

struct Fixture {
    dir: PathBuf,
    store: ImageStore,
}

impl Fixture {
    fn new() -> Self {
        let dir = scratch_dir("imp-rootfs-test").unwrap();
        let store = ImageStore::new(dir.join("cache"), Limits::default());
        Self { dir, store }
    }
    fn layout(&self, name: &str, img: &TestImage, tag: &str) -> PathBuf {
        let l = self.dir.join(name);
        img.write_layout(&l, tag).unwrap();
        l
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn layout_to_ext4_with_extra_layers_and_cache() {
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let layout = f.layout("base", &base_image(), "v1");
    let src: ImageSource = format!("oci:{}:v1", layout.display()).parse().unwrap();
    let img = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert_eq!(img.config.entrypoint, vec!["/bin/tool"]);
    let runner_layout = f.layout(
        "runner",
        &TestImage::new().layer(
            TestLayer::new()
                .file("opt/runner/run.sh", "runner\n", 0o755)
                .file("etc/hello", "overridden\n", 0o644),
        ),
        "r",
    );
    let runner = f
        .store
        .pull(
            &format!("oci:{}:r", runner_layout.display())
                .parse()
                .unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();

    let plain = f.store.rootfs(&img, &[]).await.unwrap();
    assert!(!plain.cached);
    assert_eq!(
        plain.size_bytes,
        std::fs::metadata(&plain.path).unwrap().len()
    );
    assert!(plain.path.starts_with(f.dir.join("cache/rootfs")));
    assert_eq!(
        debugfs(&plain.path, "cat /etc/hello", false).0,
        "hello from the image\n"
    );
    assert_eq!(debugfs(&plain.path, "cat /etc/upper", false).0, "upper\n");
    let (_, err) = debugfs(&plain.path, "stat /etc/gone", false);
    assert!(err.contains("File not found"), "whiteout applied: {err}");
    let (stat, _) = debugfs(&plain.path, "stat /bin/tool", false);
    assert!(
        stat.contains("Mode:  04755") && stat.contains("Links: 2"),
        "{stat}"
    );
    assert!(stat.contains("User:     0"), "{stat}");
    let (sh, _) = debugfs(&plain.path, "stat /bin/sh", false);
    assert!(
        sh.contains("Type: symlink") && sh.contains("Fast link dest: \"tool\""),
        "{sh}"
    );
    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&plain.path)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    let label = Command::new("dumpe2fs")
        .arg("-h")
        .arg(&plain.path)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&label.stdout).contains("imp-rootfs"));

    let composed = f
        .store
        .rootfs(&img, std::slice::from_ref(&runner))
        .await
        .unwrap();
    assert!(!composed.cached);
    assert_ne!(composed.key, plain.key);
    assert_eq!(
        debugfs(&composed.path, "cat /opt/runner/run.sh", false).0,
        "runner\n"
    );
    assert_eq!(
        debugfs(&composed.path, "cat /etc/hello", false).0,
        "overridden\n"
    );
    assert!(
        f.store
            .rootfs(&img, std::slice::from_ref(&runner))
            .await
            .unwrap()
            .cached
    );
    assert!(f.store.rootfs(&img, &[]).await.unwrap().cached);
    assert_eq!(
        std::fs::read_dir(f.dir.join("cache/tmp")).unwrap().count(),
        0
    );
}

#[tokio::test]
async fn oci_archive_and_bad_layouts() {
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let layout = f.layout("base", &base_image(), "v1");
    let archive = f.dir.join("image.tar");
    write_archive(&layout, &archive).unwrap();
    let src: ImageSource = format!("oci-archive:{}:v1", archive.display())
        .parse()
        .unwrap();
    let img = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert_eq!(img.blobs_fetched, 3);
    let again = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert_eq!(again.blobs_fetched, 0);
    let base = f.store.rootfs(&img, &[]).await.unwrap();
    assert_eq!(
        debugfs(&base.path, "cat /etc/hello", false).0,
        "hello from the image\n"
    );
    assert_eq!(
        std::fs::read_dir(f.dir.join("cache/tmp")).unwrap().count(),
        0,
        "archive extraction removed"
    );

    // A plain directory path, one tag only.
    let dir_src: ImageSource = layout.display().to_string().parse().unwrap();
    assert_eq!(
        f.store
            .pull(&dir_src, &RegistryAuth::Anonymous)
            .await
            .unwrap()
            .manifest_digest,
        img.manifest_digest
    );

    let e = f
        .store
        .pull(
            &format!("oci:{}:nope", layout.display()).parse().unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("no manifest is tagged \"nope\"")
            && e.to_string().contains("index.json"),
        "{e}"
    );
    let e = f
        .store
        .pull(
            &format!("oci:{}", f.dir.join("missing").display())
                .parse()
                .unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("oci-layout"), "{e}");

    // A layout blob changed after the manifest was written: refused on import.
    let other = f.layout("tampered", &base_image(), "v1");
    let w = base_image().write_layout(&other, "v1").unwrap();
    let blob = other.join("blobs/sha256").join(&w.layer_digests[0][7..]);
    let mut b = std::fs::read(&blob).unwrap();
    b[20] ^= 1;
    std::fs::write(&blob, b).unwrap();
    let fresh = ImageStore::new(f.dir.join("cache2"), Limits::default());
    let e = fresh
        .pull(
            &format!("oci:{}:v1", other.display()).parse().unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap_err();
    assert!(matches!(e, ImageError::DigestMismatch { .. }), "{e}");
}

#[tokio::test]
async fn escaping_layers_are_refused() {
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let outside = f.dir.join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), "s").unwrap();
    let rel_outside = "../../../../../../../../..".to_string() + outside.to_str().unwrap();
    let cases = [
        ("dotdot", TestLayer::new().file("../../evil", "x", 0o644)),
        (
            "symlink-dir",
            TestLayer::new()
                .symlink("up", &rel_outside)
                .file("up/evil", "x", 0o644),
        ),
        (
            "hardlink",
            TestLayer::new().hardlink("h", "../../../outside/secret"),
        ),
        (
            "hardlink-via-symlink",
            TestLayer::new()
                .symlink("l", &rel_outside)
                .hardlink("h", "l/secret"),
        ),
    ];
    for (name, bad) in cases {
        let img = TestImage::new()
            .layer(TestLayer::new().file("ok", "ok", 0o644))
            .layer(bad);
        let layout = f.layout(name, &img, "v1");
        let pulled = f
            .store
            .pull(
                &format!("oci:{}:v1", layout.display()).parse().unwrap(),
                &RegistryAuth::Anonymous,
            )
            .await
            .unwrap();
        let e = f.store.rootfs(&pulled, &[]).await.unwrap_err();
        let src = std::error::Error::source(&e)
            .map(|s| s.to_string())
            .unwrap_or_default();
        assert!(matches!(e, ImageError::Layer(_)), "{name}: {e}");
        assert!(
            src.starts_with(&format!("layer 1 ({})", pulled.layers[1].digest)),
            "{name}: {src}"
        );
        let names: Vec<_> = std::fs::read_dir(&outside)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["secret"], "{name}: nothing written outside");
        assert_eq!(std::fs::metadata(outside.join("secret")).unwrap().len(), 1);
        assert!(
            !f.dir.join("evil").exists() && !f.dir.join("cache/evil").exists(),
            "{name}"
        );
        assert_eq!(
            std::fs::read_dir(f.dir.join("cache/tmp")).unwrap().count(),
            0,
            "{name}: unpack dir removed"
        );
    }

    // An absolute symlink to a directory is followed inside the rootfs, as the guest sees it.
    let abs = TestImage::new().layer(
        TestLayer::new()
            .dir("data/", 0o755)
            .symlink("link", "/data")
            .file("link/f", "inside\n", 0o644),
    );
    let layout = f.layout("abs", &abs, "v1");
    let pulled = f
        .store
        .pull(
            &format!("oci:{}:v1", layout.display()).parse().unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();
    let base = f.store.rootfs(&pulled, &[]).await.unwrap();
    assert_eq!(debugfs(&base.path, "cat /data/f", false).0, "inside\n");
    assert!(!Path::new("/data/f").exists() || std::fs::read("/data/f").unwrap() != b"inside\n");

    // Bounded unpacked size.
    let small = ImageStore::new(
        f.dir.join("small"),
        Limits {
            max_bytes: 1000,
            max_entries: 100,
        },
    );
    let big = TestImage::new().layer(TestLayer::new().file("big", vec![7u8; 4000], 0o644));
    let layout = f.layout("big", &big, "v1");
    let pulled = small
        .pull(
            &format!("oci:{}:v1", layout.display()).parse().unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();
    let e = small.rootfs(&pulled, &[]).await.unwrap_err();
    let src = std::error::Error::source(&e).unwrap().to_string();
    assert!(src.contains("exceed the limit of 1000 bytes"), "{src}");
}

#[tokio::test]
async fn clone_disk_is_private_and_sized() {
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let layout = f.layout("base", &base_image(), "v1");
    let pulled = f
        .store
        .pull(
            &format!("oci:{}:v1", layout.display()).parse().unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();
    let base = f.store.rootfs(&pulled, &[]).await.unwrap();
    let base_bytes = std::fs::read(&base.path).unwrap();

    let vm1 = f.dir.join("vm1.ext4");
    let size = 256u64 << 20;
    clone_disk(&base.path, &vm1, size).await.unwrap();
    assert_eq!(std::fs::metadata(&vm1).unwrap().len(), size);
    assert_eq!(block_count(&vm1) * 4096, size);
    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&vm1)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    assert_eq!(
        debugfs(&vm1, "cat /etc/hello", false).0,
        "hello from the image\n"
    );

    // Writing to the clone leaves the base and a second clone untouched.
    let vm2 = f.dir.join("vm2.ext4");
    clone_disk(&base.path, &vm2, size).await.unwrap();
    let local = f.dir.join("note");
    std::fs::write(&local, "vm1 only\n").unwrap();
    debugfs(&vm1, &format!("write {} /note", local.display()), true);
    assert_eq!(debugfs(&vm1, "cat /note", false).0, "vm1 only\n");
    assert!(
        debugfs(&base.path, "stat /note", false)
            .1
            .contains("File not found")
    );
    assert!(
        debugfs(&vm2, "stat /note", false)
            .1
            .contains("File not found")
    );
    assert_eq!(
        std::fs::read(&base.path).unwrap(),
        base_bytes,
        "base unchanged byte for byte"
    );

    // Same size as the base: a plain copy; smaller: refused, nothing left behind.
    let same = f.dir.join("same.ext4");
    clone_disk(&base.path, &same, base.size_bytes)
        .await
        .unwrap();
    assert_eq!(block_count(&same) * 4096, base.size_bytes);
    let small = f.dir.join("small.ext4");
    let e = clone_disk(&base.path, &small, base.size_bytes - 4096)
        .await
        .unwrap_err();
    assert!(matches!(e, ImageError::DiskTooSmall { .. }), "{e}");
    assert!(
        e.to_string().contains("small.ext4") && e.to_string().contains("smaller than the base"),
        "{e}"
    );
    assert!(!small.exists());
    let leftovers: Vec<_> = std::fs::read_dir(&f.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn zstd_layers_unpack() {
    if !tools() {
        return;
    }
    let _ = imp_testkube::require_tool!("zstd");
    let f = Fixture::new();
    let img = TestImage::new()
        .zstd()
        .layer(TestLayer::new().file("z/data", "zstd layer\n", 0o644));
    let layout = f.layout("zstd", &img, "v1");
    let pulled = f
        .store
        .pull(
            &format!("oci:{}:v1", layout.display()).parse().unwrap(),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();
    assert!(pulled.layers[0].media_type.ends_with("+zstd"));
    let base = f.store.rootfs(&pulled, &[]).await.unwrap();
    assert_eq!(debugfs(&base.path, "cat /z/data", false).0, "zstd layer\n");
}
