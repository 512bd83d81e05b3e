//! Snapshots pushed to and pulled from a real registry (Debian's docker-registry on loopback):
//! a sparse round trip with its figures (MB/s, peak RSS growth), bounded memory with small
//! chunks, basic auth and a wrong password, bearer tokens through a token proxy (including the
//! delete scope), deletion and a registry that refuses it, and foreign, newer or tampered
//! artifacts refused by name.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::{FileExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode};
use imp_agent::snapshot::oci::{self, Deleted, Error, PushOptions};
use imp_agent::snapshot::{DISK, INITRD, MANIFEST, MEMORY, Manifest, Source, VMM_NOTE, VMSTATE};
use imp_image::RegistryAuth;
use imp_image::manifest::{Digest, OCI_MANIFEST};
use imp_image::registry::{self, Session};
use imp_testenv::registry::{TestRegistry, scratch_dir};
use imp_testenv::report::chain;

const MIB: u64 = 1 << 20;

/// True when docker-registry is present; skips locally, fails under CI.
fn tools() -> bool {
    imp_testenv::guard::require(
        imp_testenv::guard::which("docker-registry").is_some(),
        "tool `docker-registry` on PATH",
    )
}

/// Deterministic bytes that do not compress.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn manifest() -> Manifest {
    Manifest {
        format: imp_agent::snapshot::FORMAT,
        vmm: "qemu 7.2.22".into(),
        machine: "microvm".into(),
        vcpus: 2,
        memory_mib: 96,
        source: Source {
            namespace: "default".into(),
            name: "web".into(),
            image: "docker.io/library/alpine:3".into(),
        },
        taken_unix: 1_750_000_000,
        pause_ms: 42,
    }
}

/// Creates `path` of `size` bytes (a hole) and writes each `(offset, bytes)`.
fn sparse_file(path: &Path, size: u64, writes: &[(u64, &[u8])]) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    for (off, b) in writes {
        f.write_all_at(b, *off).unwrap();
    }
    f.sync_all().unwrap();
}

/// A snapshot directory: 96 MiB of memory holding data in its first and last 32 MiB chunk and
/// only written zeros in the middle one; a 64 MiB disk with data in its first chunk only.
fn big_snapshot(dir: &Path) {
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&manifest()).unwrap()).unwrap();
    std::fs::write(dir.join(VMSTATE), noise(300_000, 1)).unwrap();
    let page = vec![0xA5u8; 4096];
    let random = noise(MIB as usize, 2);
    let zeros = vec![0u8; 2 * MIB as usize];
    let pattern: Vec<u8> = (0..100_000u32).map(|i| (i % 7) as u8 + 1).collect();
    sparse_file(
        &dir.join(MEMORY),
        96 * MIB,
        &[
            (0, &page),
            (5 * MIB, &random),
            (40 * MIB, &zeros),
            (70 * MIB + 123, &pattern),
            (96 * MIB - 10, b"last bytes"),
        ],
    );
    sparse_file(&dir.join(DISK), 64 * MIB, &[(MIB, &noise(65_536, 3))]);
    std::fs::write(dir.join(INITRD), INITRD_BYTES).unwrap();
    std::fs::write(dir.join(VMM_NOTE), NOTE_BYTES).unwrap();
}

/// The big snapshot's initramfs (compressible, as a cpio of a kernel's modules is not quite)
/// and QEMU's note.
const INITRD_BYTES: &[u8] = &[b'i'; 65_536];
const NOTE_BYTES: &[u8] = br#"{"ram":"file"}"#;

/// A small snapshot for the auth and refusal tests.
fn small_snapshot(dir: &Path) {
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&manifest()).unwrap()).unwrap();
    std::fs::write(dir.join(VMSTATE), noise(10_000, 4)).unwrap();
    sparse_file(&dir.join(MEMORY), 8 * MIB, &[(MIB, &noise(8192, 5))]);
    sparse_file(&dir.join(DISK), 4 * MIB, &[(0, b"ext4 superblock, say")]);
    std::fs::write(dir.join(INITRD), noise(4096, 7)).unwrap();
    std::fs::write(dir.join(VMM_NOTE), br#"{"ram":"file"}"#).unwrap();
}

fn assert_same_files(a: &Path, b: &Path) {
    for name in [MANIFEST, VMSTATE, MEMORY, DISK, INITRD, VMM_NOTE] {
        let (fa, fb) = (
            std::fs::File::open(a.join(name)).unwrap(),
            std::fs::File::open(b.join(name)).unwrap(),
        );
        let len = fa.metadata().unwrap().len();
        assert_eq!(len, fb.metadata().unwrap().len(), "size of {name}");
        let (mut ba, mut bb) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
        let mut off = 0;
        while off < len {
            let n = (len - off).min(MIB) as usize;
            fa.read_exact_at(&mut ba[..n], off).unwrap();
            fb.read_exact_at(&mut bb[..n], off).unwrap();
            assert!(ba[..n] == bb[..n], "{name} differs in the MiB at {off}");
            off += n as u64;
        }
    }
}

/// Bytes the file system allocated for `path`.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// This process's peak RSS (`VmHWM`) in KiB.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Resets the peak RSS to the current RSS (`clear_refs` 5); false if the kernel refuses.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn mb_per_s(bytes: u64, since: Instant) -> f64 {
    bytes as f64 / 1e6 / since.elapsed().as_secs_f64()
}

struct Dirs(Vec<PathBuf>);
impl Drop for Dirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[tokio::test]
async fn round_trip_keeps_bytes_and_holes_and_reuses_chunks() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let (src, dst, again) = (
        scratch_dir("imp-snap-src").unwrap(),
        scratch_dir("imp-snap-dst").unwrap(),
        scratch_dir("imp-snap-again").unwrap(),
    );
    let _cleanup = Dirs(vec![src.clone(), dst.clone(), again.clone()]);
    big_snapshot(&src);
    let small_files = (INITRD_BYTES.len() + NOTE_BYTES.len()) as u64;
    let logical = 300_000 + 96 * MIB + 64 * MIB + small_files;
    let reference = format!("{}/snaps/web:exec-1", reg.host());

    let reset = reset_peak_rss();
    let before = peak_rss_kib();
    let t = Instant::now();
    let pushed = oci::push(&src, &reference, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    let push_rate = mb_per_s(logical, t);
    let push_peak = peak_rss_kib().saturating_sub(before);
    assert_eq!(
        pushed.chunks, 6,
        "vmstate, memory 0 and 64 MiB, disk 0, initramfs, note: {pushed:?}"
    );
    assert_eq!(
        pushed.holes, 2,
        "the zeroed and the unallocated chunk: {pushed:?}"
    );
    assert_eq!(pushed.chunks_reused, 0);
    assert_eq!(
        pushed.bytes_data,
        300_000 + 2 * 32 * MIB + 32 * MIB + small_files
    );
    assert!(
        pushed.bytes_uploaded < 2 * MIB + 300_000,
        "mostly-zero chunks compress: {pushed:?}"
    );
    assert!(pushed.reference.ends_with(&pushed.digest));

    reset_peak_rss();
    let before = peak_rss_kib();
    let t = Instant::now();
    let pulled = oci::pull(&reference, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    let pull_rate = mb_per_s(logical, t);
    let pull_peak = peak_rss_kib().saturating_sub(before);
    assert_eq!(pulled.digest, pushed.digest);
    assert_eq!(pulled.manifest, manifest());
    assert_same_files(&src, &dst);
    let (mem, disk) = (allocated(&dst.join(MEMORY)), allocated(&dst.join(DISK)));
    assert!(
        mem < 2 * MIB,
        "pulled memory allocates {mem} bytes of 96 MiB"
    );
    assert!(
        disk < 256 << 10,
        "pulled disk allocates {disk} bytes of 64 MiB"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    println!(
        "snapshot registry: {:.1} MiB logical ({:.1} MiB data, {:.2} MiB uploaded): push {push_rate:.0} MB/s, pull {pull_rate:.0} MB/s (logical bytes; debug build)",
        logical as f64 / MIB as f64,
        pushed.bytes_data as f64 / MIB as f64,
        pushed.bytes_uploaded as f64 / MIB as f64,
    );
    println!(
        "snapshot registry: peak RSS growth push {:.1} MiB, pull {:.1} MiB (32 MiB chunks, 2 in flight{})",
        push_peak as f64 / 1024.0,
        pull_peak as f64 / 1024.0,
        if reset { "" } else { "; VmHWM not reset" }
    );

    // The same directory again under another tag: every blob is there, only the manifest goes.
    let second = oci::push(
        &src,
        &format!("{}/snaps/web:exec-2", reg.host()),
        &RegistryAuth::Anonymous,
    )
    .await
    .unwrap();
    assert_eq!(second.chunks_reused, 6);
    assert!(second.bytes_uploaded < 4096, "{second:?}");
    assert_eq!(
        second.digest, pushed.digest,
        "the manifest is deterministic"
    );

    // By digest, into a directory that already holds a snapshot: replaced whole.
    big_snapshot(&again);
    std::fs::write(again.join(MEMORY), b"old").unwrap();
    let by_digest = format!("{}/snaps/web@{}", reg.host(), pushed.digest);
    oci::pull(&by_digest, &again, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    assert_same_files(&src, &again);
}

/// Set to a registry host, [`rss_child`] measures a push and pull in its own fresh process.
const RSS_CHILD: &str = "IMP_SNAPSHOT_RSS_CHILD_REGISTRY";
/// The size of [`rss_child`]'s memory file, in MiB.
const DENSE_MIB: u64 = 256;

#[tokio::test]
async fn small_chunks_keep_memory_bounded() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    // Peak RSS is per process and the allocator keeps freed memory resident, so the push and
    // pull are measured in a child process running only `rss_child`.
    let out = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "rss_child", "--nocapture", "--test-threads=1"])
        .env(RSS_CHILD, reg.host())
        // glibc gives each thread that allocates its own arena, each keeping what it freed:
        // how many the blocking pool's threads touch varies with the machine's load, and once
        // (of some twenty runs) pushed the peak past the bound. Two arenas measure our buffers.
        .env("MALLOC_ARENA_MAX", "2")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.find("snapshot registry: ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("child printed no figures: {stdout}"));
    println!("{line}");
    let kib = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.trim_end_matches(',').parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    // Two chunks in flight, each with its data and compressed form, plus the client and the
    // allocator's per-thread arenas: a fixed few tens of MiB (measured: about 28 MiB for 64 and
    // for 256 MiB files), not the file's size.
    let bound = DENSE_MIB * 1024 / 4;
    assert!(kib("push_kib=") < bound, "{line}");
    assert!(kib("total_kib=") < bound, "{line}");
}

/// Not a test on its own: run by [`small_chunks_keep_memory_bounded`] in a child process.
#[tokio::test]
async fn rss_child() {
    let Ok(host) = std::env::var(RSS_CHILD) else {
        return;
    };
    let (src, dst) = (
        scratch_dir("imp-snap-bounded-src").unwrap(),
        scratch_dir("imp-snap-bounded-dst").unwrap(),
    );
    let _cleanup = Dirs(vec![src.clone(), dst.clone()]);
    small_snapshot(&src);
    // Memory with data in every 4 KiB page (compressible, so the test stays quick).
    let size = DENSE_MIB * MIB;
    let f = std::fs::File::create(src.join(MEMORY)).unwrap();
    let mut page = vec![0u8; 4096];
    for p in 0..size / 4096 {
        page[..8].copy_from_slice(&p.to_le_bytes());
        page[4000] = 1;
        f.write_all_at(&page, p * 4096).unwrap();
    }
    drop(f);
    let reference = format!("{host}/bounded:1");
    let options = PushOptions {
        chunk_bytes: 4 * MIB,
        in_flight: 2,
    };
    let before = peak_rss_kib();
    let t = Instant::now();
    let pushed = oci::push_with(&src, &reference, &RegistryAuth::Anonymous, options)
        .await
        .unwrap();
    let push_rate = mb_per_s(size, t);
    let push_kib = peak_rss_kib().saturating_sub(before);
    assert_eq!(pushed.holes, 0, "{pushed:?}");
    let t = Instant::now();
    oci::pull(&reference, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    let pull_rate = mb_per_s(size, t);
    let total_kib = peak_rss_kib().saturating_sub(before);
    assert_same_files(&src, &dst);
    println!(
        "snapshot registry: {DENSE_MIB} MiB of dense memory in 4 MiB chunks, 2 in flight: push {push_rate:.0} MB/s, pull {pull_rate:.0} MB/s; peak RSS growth push_kib={push_kib}, total_kib={total_kib} (push and pull)"
    );
}

#[tokio::test]
async fn basic_auth_wrong_password_names_registry_and_401() {
    if !tools() {
        return;
    }
    let _ = imp_testenv::require_tool!("htpasswd");
    let reg = TestRegistry::start_with_basic_auth("alice", "s3cret")
        .await
        .unwrap();
    let (src, dst) = (
        scratch_dir("imp-snap-auth-src").unwrap(),
        scratch_dir("imp-snap-auth-dst").unwrap(),
    );
    let _cleanup = Dirs(vec![src.clone(), dst.clone()]);
    small_snapshot(&src);
    let reference = format!("{}/private/vm:exec-1", reg.host());
    let wrong = RegistryAuth::Basic {
        username: "alice".into(),
        password: "nope".into(),
    };
    for auth in [&wrong, &RegistryAuth::Anonymous] {
        let e = oci::push(&src, &reference, auth).await.unwrap_err();
        let msg = chain(&e);
        assert!(
            matches!(e, Error::Registry(registry::Error::Unauthorized { .. })),
            "{msg}"
        );
        assert!(msg.contains(&format!("Registry {}", reg.host())), "{msg}");
        assert!(msg.contains("401"), "{msg}");
        println!("refused: {msg}");
    }

    // Credentials as a pullSecretRef's .dockerconfigjson.
    let secret = format!(
        r#"{{"auths":{{"{}":{{"auth":"YWxpY2U6czNjcmV0"}}}}}}"#, // alice:s3cret
        reg.host()
    );
    let auth = oci::auth_for(&reference, Some(secret.as_bytes())).unwrap();
    let pushed = oci::push(&src, &reference, &auth).await.unwrap();
    let e = oci::pull(&reference, &dst, &wrong).await.unwrap_err();
    let msg = chain(&e);
    assert!(
        msg.contains(&reg.host()) && msg.contains("401"),
        "pull with a wrong password: {msg}"
    );
    assert!(!dst.join(MANIFEST).exists());
    let pulled = oci::pull(&reference, &dst, &auth).await.unwrap();
    assert_eq!(pulled.digest, pushed.digest);
    assert_same_files(&src, &dst);

    // Deleting answers the basic challenge too.
    let e = oci::delete(&reference, &wrong).await.unwrap_err();
    assert!(chain(&e).contains("401"), "{}", chain(&e));
    assert_eq!(
        oci::delete(&reference, &auth).await.unwrap(),
        Deleted::Manifest {
            digest: pushed.digest
        }
    );
}

#[tokio::test]
async fn delete_then_pull_is_not_found_and_a_refusing_registry_says_so() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let (src, dst) = (
        scratch_dir("imp-snap-del-src").unwrap(),
        scratch_dir("imp-snap-del-dst").unwrap(),
    );
    let _cleanup = Dirs(vec![src.clone(), dst.clone()]);
    small_snapshot(&src);
    let reference = format!("{}/snaps/vm:exec-old", reg.host());
    let pushed = oci::push(&src, &reference, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    assert_eq!(
        oci::delete(&reference, &RegistryAuth::Anonymous)
            .await
            .unwrap(),
        Deleted::Manifest {
            digest: pushed.digest.clone()
        }
    );
    let e = oci::pull(&reference, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{}", chain(&e));
    let msg = e.to_string();
    assert!(
        msg.contains(&reference) && msg.contains("not found"),
        "{msg}"
    );
    println!("refused: {msg}");
    let by_digest = format!("{}/snaps/vm@{}", reg.host(), pushed.digest);
    let e = oci::pull(&by_digest, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{}", chain(&e));
    assert_eq!(
        oci::delete(&reference, &RegistryAuth::Anonymous)
            .await
            .unwrap(),
        Deleted::Absent,
        "pruning twice is fine"
    );

    let strict = TestRegistry::start_with_delete_disabled().await.unwrap();
    let reference = format!("{}/snaps/vm:exec-1", strict.host());
    oci::push(&src, &reference, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    let e = oci::delete(&reference, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    let msg = chain(&e);
    assert!(
        matches!(
            e,
            Error::Registry(registry::Error::DeleteUnsupported { .. })
        ),
        "{msg}"
    );
    assert!(
        msg.contains(&strict.host())
            && msg.contains("does not allow deleting")
            && msg.contains("405"),
        "{msg}"
    );
    println!("refused: {msg}");
    // Still there.
    oci::pull(&reference, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap();
}

/// A session with `repository:tag` of the test registry, without credentials.
fn session(reg: &TestRegistry, repo: &str, tag: &str) -> Session {
    let r = format!("{}/{repo}:{tag}", reg.host()).parse().unwrap();
    Session::new(r, &RegistryAuth::Anonymous)
}

/// Pushes manifest `doc` (JSON) as `tag` of `repo` with the plain registry client, bypassing
/// the snapshot checks.
async fn push_raw_manifest(reg: &TestRegistry, repo: &str, tag: &str, doc: &serde_json::Value) {
    session(reg, repo, tag)
        .push_manifest(serde_json::to_vec(doc).unwrap(), OCI_MANIFEST)
        .await
        .unwrap();
}

async fn push_raw_blob(reg: &TestRegistry, repo: &str, data: &[u8]) -> String {
    let digest = Digest::of(data);
    session(reg, repo, "x")
        .push_blob(data.to_vec().into(), &digest, "a raw blob")
        .await
        .unwrap();
    digest.to_string()
}

#[tokio::test]
async fn foreign_newer_and_tampered_artifacts_are_refused() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let (src, dst) = (
        scratch_dir("imp-snap-bad-src").unwrap(),
        scratch_dir("imp-snap-bad-dst").unwrap(),
    );
    let _cleanup = Dirs(vec![src.clone(), dst.clone()]);
    small_snapshot(&src);
    let good = format!("{}/snaps/vm:good", reg.host());
    oci::push(&src, &good, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    let (raw, _) = session(&reg, "snaps/vm", "good").manifest().await.unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&raw).unwrap();

    // Another tool's artifact: refused by pull and by delete, naming what was found.
    let mut alien = doc.clone();
    alien["artifactType"] = "application/vnd.example.thing.v1".into();
    push_raw_manifest(&reg, "snaps/vm", "alien", &alien).await;
    let alien_ref = format!("{}/snaps/vm:alien", reg.host());
    let e = oci::pull(&alien_ref, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::NotASnapshot { .. }), "{msg}");
    assert!(
        msg.contains(&alien_ref) && msg.contains("application/vnd.example.thing.v1"),
        "{msg}"
    );
    println!("refused: {msg}");
    let e = oci::delete(&alien_ref, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotASnapshot { .. }), "{}", chain(&e));

    // A layer of a media type this agent does not know.
    let mut odd = doc.clone();
    odd["layers"][0]["mediaType"] = "application/vnd.imp.snapshot.chunk.v1+lz4".into();
    push_raw_manifest(&reg, "snaps/vm", "odd", &odd).await;
    let e = oci::pull(
        &format!("{}/snaps/vm:odd", reg.host()),
        &dst,
        &RegistryAuth::Anonymous,
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{}", chain(&e));
    assert!(e.to_string().contains("+lz4"), "{e}");

    // A newer agent's snapshot format.
    let config = br#"{"format":2,"vmm":"qemu 11.0"}"#;
    let config_digest = push_raw_blob(&reg, "snaps/vm", config).await;
    let mut newer = doc.clone();
    newer["config"]["digest"] = config_digest.into();
    newer["config"]["size"] = config.len().into();
    push_raw_manifest(&reg, "snaps/vm", "newer", &newer).await;
    let e = oci::pull(
        &format!("{}/snaps/vm:newer", reg.host()),
        &dst,
        &RegistryAuth::Anonymous,
    )
    .await
    .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Unsupported { .. }), "{msg}");
    assert!(msg.contains("snapshot format 2"), "{msg}");
    println!("refused: {msg}");

    // A manifest claiming an absurd file size.
    let mut huge = doc.clone();
    huge["annotations"]["dev.imp.snapshot.size.memory"] = (1u64 << 60).to_string().into();
    push_raw_manifest(&reg, "snaps/vm", "huge", &huge).await;
    let e = oci::pull(
        &format!("{}/snaps/vm:huge", reg.host()),
        &dst,
        &RegistryAuth::Anonymous,
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Invalid { .. }), "{}", chain(&e));
    println!("refused: {e}");
    assert!(!dst.join(MANIFEST).exists());

    // A chunk changed in the registry's storage after the push: caught by its digest, and the
    // half-written directory is cleaned up.
    let memory_layer = doc["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["annotations"]["dev.imp.snapshot.file"] == MEMORY)
        .unwrap();
    let blob = reg.blob_file(memory_layer["digest"].as_str().unwrap());
    let mut bytes = std::fs::read(&blob).unwrap();
    let last = bytes.len() - 20;
    bytes[last] ^= 0xff;
    std::fs::write(&blob, &bytes).unwrap();
    let e = oci::pull(&good, &dst, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    let msg = chain(&e);
    assert!(
        msg.to_lowercase().contains("digest") && msg.contains("memory@"),
        "{msg}"
    );
    println!("refused: {msg}");
    let left: Vec<_> = std::fs::read_dir(&dst).unwrap().collect();
    assert!(left.is_empty(), "a failed pull leaves nothing: {left:?}");
}

/// A loopback token server and reverse proxy in front of a registry: every registry request
/// needs `Bearer <TOKEN>`, which `/token` issues to bob:hunter2, recording the scope asked for.
struct TokenProxy {
    host: String,
    scopes: Arc<Mutex<Vec<String>>>,
    _task: tokio::task::JoinHandle<()>,
}

const TOKEN: &str = "snap-tok-1";

async fn start_token_proxy(upstream: std::net::SocketAddr) -> TokenProxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let scopes = Arc::new(Mutex::new(Vec::new()));
    let seen = scopes.clone();
    let challenge = format!(r#"Bearer realm="http://{addr}/token",service="imp-test""#);
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (challenge, seen) = (challenge.clone(), seen.clone());
        async move {
            let auth = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            if req.uri().path() == "/token" {
                let scope = req
                    .uri()
                    .query()
                    .unwrap_or_default()
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("scope="))
                    .unwrap_or_default()
                    .replace("%3A", ":")
                    .replace("%2F", "/")
                    .replace("%2C", ",");
                seen.lock().unwrap().push(scope);
                // bob:hunter2
                return if auth == "Basic Ym9iOmh1bnRlcjI=" {
                    Response::new(Body::from(format!(r#"{{"token":"{TOKEN}"}}"#)))
                } else {
                    Response::builder()
                        .status(StatusCode::UNAUTHORIZED)
                        .body(Body::from("who are you"))
                        .unwrap()
                };
            }
            if auth != format!("Bearer {TOKEN}") {
                return Response::builder()
                    .status(StatusCode::UNAUTHORIZED)
                    .header(
                        "www-authenticate",
                        HeaderValue::from_str(&challenge).unwrap(),
                    )
                    .body(Body::from(
                        r#"{"errors":[{"code":"UNAUTHORIZED","message":"token needed"}]}"#,
                    ))
                    .unwrap();
            }
            relay(upstream, req).await
        }
    });
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    TokenProxy {
        host: addr.to_string(),
        scopes,
        _task: task,
    }
}

/// Sends `req` on to the registry at `upstream` (keeping its Host, so the registry's upload
/// locations point back at the proxy) and streams the answer back.
async fn relay(upstream: std::net::SocketAddr, req: Request<Body>) -> Response<Body> {
    let tcp = tokio::net::TcpStream::connect(upstream).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let (mut head, body) = req.into_parts();
    head.headers.remove("authorization");
    head.uri = head
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .unwrap();
    let resp = send
        .send_request(Request::from_parts(head, body))
        .await
        .unwrap();
    let (head, body) = resp.into_parts();
    Response::from_parts(head, Body::new(body))
}

#[tokio::test]
async fn bearer_tokens_for_push_pull_and_delete() {
    if !tools() {
        return;
    }
    let reg = TestRegistry::start().await.unwrap();
    let proxy = start_token_proxy(reg.addr()).await;
    let (src, dst) = (
        scratch_dir("imp-snap-tok-src").unwrap(),
        scratch_dir("imp-snap-tok-dst").unwrap(),
    );
    let _cleanup = Dirs(vec![src.clone(), dst.clone()]);
    small_snapshot(&src);
    let reference = format!("{}/tok/snap:exec-1", proxy.host);

    let e = oci::push(&src, &reference, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    let msg = chain(&e);
    assert!(
        msg.contains(&format!("Registry {}", proxy.host)) && msg.contains("401"),
        "{msg}"
    );

    let bob = RegistryAuth::Basic {
        username: "bob".into(),
        password: "hunter2".into(),
    };
    let pushed = oci::push(&src, &reference, &bob).await.unwrap();
    let pulled = oci::pull(&reference, &dst, &bob).await.unwrap();
    assert_eq!(pulled.digest, pushed.digest);
    assert_same_files(&src, &dst);

    // A pre-issued token (a dockerconfigjson `registrytoken`) pulls without the token dance.
    let token = RegistryAuth::Bearer {
        token: TOKEN.into(),
    };
    std::fs::remove_dir_all(&dst).unwrap();
    oci::pull(&reference, &dst, &token).await.unwrap();

    assert_eq!(
        oci::delete(&reference, &bob).await.unwrap(),
        Deleted::Manifest {
            digest: pushed.digest
        }
    );
    let scopes = proxy.scopes.lock().unwrap().clone();
    assert!(
        scopes.iter().any(|s| s == "repository:tok/snap:delete"),
        "delete asked for the delete scope: {scopes:?}"
    );
    assert!(
        scopes.iter().any(|s| s.contains("push")),
        "push asked for the push scope: {scopes:?}"
    );
    let e = oci::pull(&reference, &dst, &bob).await.unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{}", chain(&e));
}
