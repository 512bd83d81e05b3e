//! Building ext4 bases from local OCI layouts and archives with real mkfs.ext4, refusing
//! escaping layers, composing extra layers, and cloning per-VM disks (checked with debugfs,
//! dumpe2fs and e2fsck from e2fsprogs; nothing is mounted).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use imp_image::{ImageError, ImageSource, ImageStore, Limits, RegistryAuth, clone_disk};
use imp_testenv::registry::{TestImage, TestLayer, scratch_dir, write_archive};

fn tools() -> bool {
    ["mkfs.ext4", "debugfs", "dumpe2fs", "resize2fs", "e2fsck"]
        .iter()
        .all(|t| {
            imp_testenv::guard::require(
                imp_testenv::guard::which(t).is_some(),
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

    // Using a cached base or pulling again marks them used (their mtime), and an eviction to
    // nothing keeps what a VM's record names (`img`) and what was just used.
    let day_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(86_400);
    let age = |p: &Path| {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(day_ago).unwrap();
    };
    let recent = |p: &Path| {
        let m = std::fs::metadata(p).unwrap().modified().unwrap();
        m.elapsed().unwrap_or_default() < std::time::Duration::from_secs(600)
    };
    let layer_digest = imp_image::manifest::Digest::parse(&img.layers[0].digest, "layer").unwrap();
    let layer = f.store.blobs().path(&layer_digest);
    let all_files = |dir: &str| -> Vec<PathBuf> {
        std::fs::read_dir(f.dir.join("cache").join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    };
    for p in all_files("rootfs")
        .into_iter()
        .chain(all_files("blobs/sha256"))
    {
        age(&p);
    }
    assert!(f.store.rootfs(&img, &[]).await.unwrap().cached);
    assert!(recent(&plain.path), "a cached base is touched when used");
    assert!(!recent(&composed.path));
    f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert!(recent(&layer), "a pull touches the blobs it needs");
    for p in all_files("rootfs")
        .into_iter()
        .chain(all_files("blobs/sha256"))
    {
        age(&p);
    }
    let evicted = f
        .store
        .evict(0, [vec![img.manifest_digest.clone()]].into())
        .await
        .unwrap();
    assert!(evicted.removed.entries >= 3, "{evicted:?}");
    assert!(
        plain.path.exists() && layer.exists(),
        "the VM's image stays"
    );
    assert!(!composed.path.exists(), "the unused base went");
    assert!(f.store.rootfs(&img, &[]).await.unwrap().cached);
    assert_eq!(
        std::fs::read_dir(f.dir.join("cache/tmp")).unwrap().count(),
        0,
        "nothing half-removed left"
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
    let _ = imp_testenv::require_tool!("zstd");
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

/// A hostile layer's tar, header by header: names, types, modes and device numbers as given.
fn raw_tar(entries: &[(tar::EntryType, &[u8], u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (kind, name, mode, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(*kind);
        h.set_mode(*mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(data.len() as u64);
        if let (tar::EntryType::Block, Some(gnu)) = (kind, h.as_gnu_mut()) {
            gnu.dev_major = *b"0000010\0"; // 8:0, a host disk
        }
        if let (tar::EntryType::Char, Some(gnu)) = (kind, h.as_gnu_mut()) {
            gnu.dev_major = *b"0000001\0"; // 1:3, /dev/null
            gnu.dev_minor = *b"0000003\0";
        }
        h.set_cksum();
        b.append(&h, data.as_slice()).unwrap();
    }
    b.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).unwrap();
    gz.finish().unwrap()
}

fn sha256(data: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{:x}", sha2::Sha256::digest(data))
}

/// Writes an OCI layout of gzip `blobs` whose config claims `diff_ids`, tagged `v1`, without
/// any of the checks a well-behaved image builder makes.
fn raw_layout(dir: &Path, blobs: &[Vec<u8>], diff_ids: &[String]) -> ImageSource {
    let put = |bytes: &[u8]| {
        let d = sha256(bytes);
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("blobs/sha256").join(&d[7..]), bytes).unwrap();
        d
    };
    let layers: Vec<_> = blobs
        .iter()
        .map(|b| {
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                               "digest": put(b), "size": b.len()})
        })
        .collect();
    let config = serde_json::json!({"architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/bin/id"]}, "rootfs": {"type": "layers", "diff_ids": diff_ids}})
    .to_string();
    let manifest = serde_json::json!({"schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": put(config.as_bytes()), "size": config.len()},
        "layers": layers})
    .to_string();
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": put(manifest.as_bytes()), "size": manifest.len(),
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]});
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    format!("oci:{}:v1", dir.display()).parse().unwrap()
}

/// Finding 1 and 8 of issue 14: device nodes and setuid files of a layer exist in the ext4
/// image only; the cache is private; a FIFO with NUL-filled device fields is accepted.
#[tokio::test]
async fn special_files_exist_only_in_the_image_and_the_cache_is_private() {
    use std::os::unix::fs::PermissionsExt;
    use tar::EntryType::{Block, Char, Fifo, Regular};
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let tar = raw_tar(&[
        (Regular, b"bin/id", 0o4755, b"#!/bin/sh\n".to_vec()),
        (Regular, b"bin/wall", 0o2755, b"w".to_vec()),
        (Block, b"dev/sda", 0o666, vec![]),
        (Char, b"dev/null", 0o666, vec![]),
        (Fifo, b"run/initctl", 0o600, vec![]),
    ]);
    let src = raw_layout(&f.dir.join("special"), &[gzip(&tar)], &[sha256(&tar)]);
    let pulled = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let base = f.store.rootfs(&pulled, &[]).await.unwrap();
    let stat = |p: &str| debugfs(&base.path, &format!("stat {p}"), false).0;
    let id = stat("/bin/id");
    assert!(
        id.contains("Type: regular") && id.contains("Mode:  04755"),
        "{id}"
    );
    assert!(stat("/bin/wall").contains("Mode:  02755"));
    let sda = stat("/dev/sda");
    assert!(
        sda.contains("Type: block special") && sda.contains("Mode:  0666"),
        "{sda}"
    );
    assert!(
        sda.contains("major: 8") || sda.contains("Device major/minor number: 08:00"),
        "{sda}"
    );
    let null = stat("/dev/null");
    assert!(null.contains("Type: character special"), "{null}");
    assert!(stat("/run/initctl").contains("Type: FIFO"));
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&base.path)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    for dir in ["cache", "cache/tmp"] {
        let mode = std::fs::metadata(f.dir.join(dir))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "{dir}");
    }
}

/// Finding 2: the unpack limit follows the VM's disk, refused from the header before any data
/// is written; zeros are kept as holes, so a big zero file costs little in the cache.
#[tokio::test]
async fn unpack_limit_follows_the_disk_and_zeros_stay_sparse() {
    use std::os::unix::fs::MetadataExt;
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let zeros = raw_tar(&[(
        tar::EntryType::Regular,
        b"zeros",
        0o644,
        vec![0u8; 256 << 20],
    )]);
    let src = raw_layout(&f.dir.join("zeros"), &[gzip(&zeros)], &[sha256(&zeros)]);
    let small = ImageStore::new(f.dir.join("small"), Limits::for_disk(128 << 20, None));
    let pulled = small.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let e = small.rootfs(&pulled, &[]).await.unwrap_err();
    let src_err = std::error::Error::source(&e).unwrap().to_string();
    assert!(
        src_err.contains("entry \"zeros\"")
            && src_err.contains(&format!("limit of {} bytes", 128 << 20)),
        "{src_err}"
    );
    assert_eq!(
        std::fs::read_dir(f.dir.join("small/tmp")).unwrap().count(),
        0
    );
    let capped = ImageStore::new(
        f.dir.join("capped"),
        Limits::for_disk(1 << 30, Some(1 << 20)),
    );
    let pulled = capped.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    assert!(
        capped.rootfs(&pulled, &[]).await.is_err(),
        "the node cap wins"
    );

    let pulled = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let base = f.store.rootfs(&pulled, &[]).await.unwrap();
    let allocated = std::fs::metadata(&base.path).unwrap().blocks() * 512;
    assert!(
        allocated < 64 << 20,
        "the base holds {allocated} bytes for a 256 MiB zero file"
    );
    assert!(
        debugfs(&base.path, "stat /zeros", false)
            .0
            .contains("Size: 268435456")
    );
}

/// Finding 2: a layer of more entries than allowed is refused from its headers, before the
/// first file is created.
#[tokio::test]
async fn too_many_entries_refused_before_any_file_is_written() {
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let names: Vec<String> = (0..5000).map(|i| format!("f/{i}")).collect();
    let entries: Vec<_> = names
        .iter()
        .map(|n| (tar::EntryType::Regular, n.as_bytes(), 0o644, vec![]))
        .collect();
    let tar = raw_tar(&entries);
    let src = raw_layout(&f.dir.join("many"), &[gzip(&tar)], &[sha256(&tar)]);
    let store = ImageStore::new(
        f.dir.join("few"),
        Limits {
            max_bytes: 1 << 30,
            max_entries: 1000,
        },
    );
    let pulled = store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let e = store.rootfs(&pulled, &[]).await.unwrap_err();
    let msg = std::error::Error::source(&e).unwrap().to_string();
    assert!(
        msg.contains("entry \"f/1000\"") && msg.contains("limit of 1000 entries"),
        "{msg}"
    );
    assert_eq!(std::fs::read_dir(f.dir.join("few/tmp")).unwrap().count(), 0);
}

/// Finding 4: a gzip trailer whose CRC and length are zeroed, and a config whose diff_ids do
/// not match the layers, are refused, naming the layer.
#[tokio::test]
async fn bad_gzip_trailer_and_wrong_diff_ids_are_refused() {
    if !tools() {
        return;
    }
    let f = Fixture::new();
    let ok = raw_tar(&[(tar::EntryType::Regular, b"ok", 0o644, b"ok".to_vec())]);
    let other = raw_tar(&[(tar::EntryType::Regular, b"other", 0o644, b"x".to_vec())]);
    let mut zeroed = gzip(&other);
    let n = zeroed.len();
    zeroed[n - 8..].fill(0);
    let src = raw_layout(
        &f.dir.join("trailer"),
        &[gzip(&ok), zeroed.clone()],
        &[sha256(&ok), sha256(&other)],
    );
    let pulled = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let e = f.store.rootfs(&pulled, &[]).await.unwrap_err();
    assert!(matches!(e, ImageError::Decompress { index: 1, .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with(&format!("Layer 1 ({})", sha256(&zeroed))),
        "{e}"
    );

    let src = raw_layout(
        &f.dir.join("diffids"),
        &[gzip(&ok), gzip(&other)],
        &[sha256(&ok), sha256(&ok)],
    );
    let pulled = f.store.pull(&src, &RegistryAuth::Anonymous).await.unwrap();
    let e = f.store.rootfs(&pulled, &[]).await.unwrap_err();
    assert!(
        matches!(e, ImageError::DiffIdMismatch { index: 1, .. }),
        "{e}"
    );
    assert!(e.to_string().contains(&sha256(&other)), "{e}");

    let src = raw_layout(&f.dir.join("count"), &[gzip(&ok)], &[]);
    let e = f
        .store
        .pull(&src, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("rootfs.diff_ids names 0 layers"),
        "{e}"
    );
    assert!(cached(&f.dir.join("cache")).is_empty());
}

fn cached(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache.join("rootfs"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "ext4"))
        .collect()
}

/// Finding 3: temporaries of a dead process (an unpack killed half-way) are removed; those of
/// a live one are kept; prune also drops the cached bases.
#[tokio::test]
async fn stale_temporaries_removed_and_prune_drops_bases() {
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
    f.store.rootfs(&pulled, &[]).await.unwrap();
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let tmp = f.dir.join("cache/tmp");
    let stale = tmp.join(format!(".unpack-abc.{dead_pid}.0.tmp"));
    std::fs::create_dir_all(stale.join("usr/bin")).unwrap();
    std::fs::write(stale.join("usr/bin/big"), vec![1u8; 1 << 20]).unwrap();
    let live = tmp.join(format!(".unpack-def.{}.0.tmp", std::process::id()));
    std::fs::create_dir_all(&live).unwrap();
    let pruned = f.store.remove_stale().await.unwrap();
    assert_eq!(pruned.entries, 1);
    assert!(pruned.bytes >= 1 << 20, "{pruned:?}");
    assert!(!stale.exists() && live.exists());
    assert_eq!(cached(&f.dir.join("cache")).len(), 1);
    let pruned = f.store.prune(false).await.unwrap();
    assert_eq!(pruned.entries, 1, "the base");
    assert!(cached(&f.dir.join("cache")).is_empty());
    assert!(
        f.store.rootfs(&pulled, &[]).await.is_ok(),
        "rebuilt from the blobs"
    );
}

/// A 1 MiB tmpfs mounted for one test, unmounted (and its directory removed) when dropped.
struct TinyFs(PathBuf);

impl TinyFs {
    fn mount(dir: PathBuf) -> TinyFs {
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        TinyFs(dir)
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A VM disk that does not fit on a full filesystem fails as "storage full", naming the file,
/// and leaves nothing behind; the disk report reads that filesystem's real size.
#[tokio::test]
async fn a_disk_on_a_full_filesystem_fails_as_such_and_leaves_no_partial_file() {
    if !imp_testenv::guard::require(
        imp_testenv::guard::is_root(),
        "root (mounting a 1 MiB tmpfs)",
    ) {
        return;
    }
    let f = Fixture::new();
    let base = f.dir.join("base.ext4");
    // 4 MiB of data (no holes): a copy needs 4 MiB, the filesystem has 1.
    std::fs::write(&base, vec![0x5a_u8; 4 << 20]).unwrap();
    let tiny = TinyFs::mount(f.dir.join("full"));
    let report = imp_agent::host_fs::usage(&tiny.0).unwrap();
    assert_eq!(report.total, 1 << 20, "{report:?}");
    let dest = tiny.0.join("disk.ext4");
    let err = clone_disk(&base, &dest, 4 << 20).await.unwrap_err();
    assert!(err.is_storage_full(), "{err:?}");
    assert!(
        err.to_string().contains(&tiny.0.display().to_string()),
        "the error names the file: {err}"
    );
    let left: Vec<_> = std::fs::read_dir(&tiny.0).unwrap().collect();
    assert!(left.is_empty(), "no partial disk left: {left:?}");
    assert!(!dest.exists());
    let after = imp_agent::host_fs::usage(&tiny.0).unwrap();
    assert_eq!(after.free, after.total, "the space is given back");
}
