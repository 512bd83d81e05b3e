//! The container images `scripts/images` writes (docs/images.md), checked as a node would meet
//! them: skopeo reads each OCI archive by the reference the Helm chart names, umoci unpacks it
//! (checking every blob against its digest), and the binaries run from the unpacked root: the
//! operator's static `imp` with nothing beside it, and in the agent's Debian root, under
//! chroot, `imp`, QEMU, nft, the e2fsprogs tools and the guest init, with the guest kernel and
//! modules where the image's environment points the agent.
//!
//! Needs the archives (`.ci/run` builds them first), root (chroot, and umoci keeping owners),
//! skopeo, umoci and file: without them the tests skip on a developer machine and fail under
//! `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use imp_testenv::registry::scratch_dir;
use imp_testenv::{guard, workspace_root};
use serde_json::Value;

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The reference the chart's default values name for `name`.
fn reference(name: &str) -> String {
    format!("ghcr.io/imp-dev/{name}:{VERSION}")
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    imp_testenv::report::logged(&*cmd, out)
}

/// Runs `cmd`, asserts it succeeded, and returns stdout and stderr together.
fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?} failed: {}", out.status);
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether everything the checks need is here; skips (or fails under CI) when not.
fn ready(archive: &Path) -> bool {
    guard::require(
        archive.is_file(),
        &format!("{} (run scripts/images as root)", archive.display()),
    ) && guard::require(guard::is_root(), "root for umoci unpack and chroot")
        && ["skopeo", "umoci", "file"]
            .iter()
            .all(|t| guard::require(guard::which(t).is_some(), &format!("tool `{t}` on PATH")))
}

/// A scratch directory, removed when dropped (an unpacked agent root is ≈ 300 MB).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One image archive, read by skopeo and unpacked by umoci.
struct Unpacked {
    _dir: Scratch,
    rootfs: PathBuf,
    /// The image config's `config` object (Entrypoint, Cmd, User, Env…).
    config: Value,
    /// `skopeo inspect`'s summary.
    inspect: Value,
}

/// Reads `target/images/NAME.oci.tar` as skopeo and umoci do, by its reference.
fn unpack(archive: &Path, name: &str) -> Unpacked {
    let reference = reference(name);
    let scratch = Scratch(scratch_dir(&format!("imp-image-{name}")).unwrap());
    let dir = scratch.0.clone();
    let layout = dir.join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    ok(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(&layout));

    // One manifest, named for containerd (ctr import, kind load) and for podman and skopeo.
    let index: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "{index}");
    let annotations = &manifests[0]["annotations"];
    assert_eq!(annotations["org.opencontainers.image.ref.name"], reference);
    assert_eq!(annotations["io.containerd.image.name"], reference);

    let by_ref = format!("oci-archive:{}:{reference}", archive.display());
    let inspect: Value = serde_json::from_str(&ok(Command::new("skopeo")
        .args(["inspect", &by_ref])
        .stderr(std::process::Stdio::null())))
    .unwrap();
    assert_eq!(inspect["Architecture"], "amd64", "{inspect}");
    assert_eq!(inspect["Os"], "linux", "{inspect}");
    assert_eq!(inspect["Digest"], manifests[0]["digest"], "{inspect}");
    let full: Value = serde_json::from_str(&ok(Command::new("skopeo")
        .args(["inspect", "--config", &by_ref])
        .stderr(std::process::Stdio::null())))
    .unwrap();
    assert_eq!(
        full["config"]["Labels"]["org.opencontainers.image.version"],
        VERSION
    );

    let bundle = dir.join("bundle");
    ok(Command::new("umoci")
        .arg("unpack")
        .arg("--image")
        .arg(format!("{}:{reference}", layout.display()))
        .arg(&bundle));
    Unpacked {
        _dir: scratch,
        rootfs: bundle.join("rootfs"),
        config: full["config"].clone(),
        inspect,
    }
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

/// Every path under `root`, relative and sorted.
fn tree(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            out.push(path.strip_prefix(root).unwrap().display().to_string());
            if path.is_dir() && !path.is_symlink() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

fn assert_static(path: &Path) {
    let what = ok(Command::new("file").arg(path));
    assert!(
        what.contains("statically linked") || what.contains("static-pie linked"),
        "{what}"
    );
}

#[test]
fn operator_image_is_the_static_imp_alone_run_as_nonroot() {
    let archive = workspace_root().join("target/images/imp-operator.oci.tar");
    if !ready(&archive) {
        return;
    }
    let image = unpack(&archive, "imp-operator");
    assert_eq!(strings(&image.config["Entrypoint"]), ["/imp"]);
    assert_eq!(strings(&image.config["Cmd"]), ["operator"]);
    assert_eq!(image.config["User"], "65532:65532");
    assert_eq!(
        image.inspect["Layers"].as_array().map(Vec::len),
        Some(1),
        "{}",
        image.inspect
    );

    // No shell, no CA roots, no libraries: the binary and the names of its user.
    assert_eq!(
        tree(&image.rootfs),
        ["etc", "etc/group", "etc/passwd", "imp"]
    );
    let imp = image.rootfs.join("imp");
    assert_static(&imp);
    let passwd = std::fs::read_to_string(image.rootfs.join("etc/passwd")).unwrap();
    assert!(
        passwd
            .lines()
            .any(|l| l.starts_with("nonroot:x:65532:65532:")),
        "{passwd}"
    );
    let group = std::fs::read_to_string(image.rootfs.join("etc/group")).unwrap();
    assert!(group.lines().any(|l| l == "nonroot:x:65532:"), "{group}");

    // As the container runs it: inside its root (no loader, no libraries), as its user. It
    // reports the version the chart's tag names, and knows the subcommand the Cmd names.
    let as_nonroot = |args: &[&str]| {
        ok(Command::new("chroot")
            .arg("--userspec=65532:65532")
            .arg(&image.rootfs)
            .arg("/imp")
            .args(args))
    };
    assert_eq!(as_nonroot(&["--version"]).trim(), format!("imp {VERSION}"));
    as_nonroot(&["operator", "--help"]);
}

#[test]
fn agent_image_runs_imp_qemu_and_the_host_tools_from_its_root() {
    let archive = workspace_root().join("target/images/imp-agent.oci.tar");
    if !ready(&archive) {
        return;
    }
    let image = unpack(&archive, "imp-agent");
    assert_eq!(strings(&image.config["Entrypoint"]), ["/usr/local/bin/imp"]);
    assert_eq!(strings(&image.config["Cmd"]), ["agent"]);
    let env = strings(&image.config["Env"]);
    for want in [
        "IMP_KERNEL=/opt/imp/guest/vmlinux",
        "IMP_GUEST=/opt/imp/guest/imp-guest",
    ] {
        assert!(env.contains(&want), "{env:?}");
    }
    let root = &image.rootfs;
    // What a container runtime gives every container, and Rust's Command opens for stdin.
    ok(Command::new("mknod")
        .args(["-m", "666"])
        .arg(root.join("dev/null"))
        .args(["c", "1", "3"]));
    let chroot = |args: &[&str]| {
        let mut cmd = Command::new("chroot");
        cmd.arg(root)
            .arg("/usr/bin/env")
            .arg("-i")
            .args(&env)
            .args(args);
        ok(&mut cmd)
    };

    let version = chroot(&["/usr/local/bin/imp", "--version"]);
    assert_eq!(version.trim(), format!("imp {VERSION}"));
    chroot(&["/usr/local/bin/imp", "agent", "--help"]);
    // The QEMU on PATH maps a snapshot's memory image private (>= 8.2: warm pool members and
    // clones share its pages); the suite's 7.2 is kept to resume what it suspended.
    let qemu = imp_vmm::version::identity("qemu", &chroot(&["qemu-system-x86_64", "--version"]));
    assert!(
        imp_vmm::version::at_least(&qemu, imp_vmm::qemu::PRIVATE_READ_ONLY_RAM),
        "the agent image's QEMU is {qemu}"
    );
    let kept = env
        .iter()
        .find_map(|e| e.strip_prefix(&format!("{}=", imp_vmm::qemu::KEPT_ENV)))
        .unwrap_or_else(|| panic!("no {} in {env:?}", imp_vmm::qemu::KEPT_ENV));
    let kept = imp_vmm::version::identity("qemu", &chroot(&[kept, "--version"]));
    assert!(kept.starts_with("qemu 7.2."), "the kept QEMU is {kept}");
    assert!(chroot(&["nft", "--version"]).contains("nftables"));
    assert!(chroot(&["mkfs.ext4", "-V"]).contains("mke2fs"));
    assert!(chroot(&["debugfs", "-V"]).contains("debugfs"));
    assert!(chroot(&["ip", "-V"]).contains("iproute2"));
    assert!(root.join("usr/sbin/resize2fs").is_file());
    assert!(root.join("etc/ssl/certs/ca-certificates.crt").is_file());

    // What `imp version` finds through the image's environment: QEMU, the guest kernel and
    // the guest init, which answers its --version from inside the root too.
    let found = chroot(&[
        "/usr/local/bin/imp",
        "version",
        "--no-probe",
        "--state-dir",
        "/tmp/imp-version",
    ]);
    let field = |name: &str| -> String {
        found
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} line: {found}"))
            .trim()
            .to_owned()
    };
    assert!(field("qemu").contains(&qemu["qemu ".len()..]), "{found}");
    assert!(
        field("qemu kept").starts_with("/usr/bin/qemu-system-x86_64 (QEMU emulator version 7.2."),
        "{found}"
    );
    let kernel = field("kernel");
    assert!(
        kernel.starts_with("/opt/imp/guest/vmlinux (Linux "),
        "{found}"
    );
    assert!(
        field("guest init").starts_with("/opt/imp/guest/imp-guest (imp-guest"),
        "{found}"
    );
    assert_static(&root.join("opt/imp/guest/imp-guest"));
    assert_static(&root.join("usr/local/bin/imp"));

    // The modules beside the kernel give every module a VM loads, as the agent reads them.
    let modules = imp_agent::initramfs::modules::load_order(
        &root.join("opt/imp/guest/modules"),
        imp_agent::initramfs::modules::VM_MODULES,
    )
    .unwrap();
    assert!(!modules.is_empty());

    // What makes two debootstraps differ is gone.
    for leftover in [
        "etc/hostname",
        "etc/resolv.conf",
        "etc/machine-id",
        "var/cache/ldconfig/aux-cache",
        "var/log/dpkg.log",
        "etc/.pwd.lock",
    ] {
        assert!(!root.join(leftover).exists(), "{leftover} is in the image");
    }
    let lists = std::fs::read_dir(root.join("var/lib/apt/lists"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(lists, 0, "apt lists are in the image");
}
