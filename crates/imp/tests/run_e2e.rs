//! End-to-end tests of `imp run`: the real `imp` binary pulls an image the test pushed to a
//! real registry (Debian's docker-registry on 127.0.0.1), builds its root disk, boots it as a
//! real Linux guest under QEMU (TCG here) with the real imp-guest, and reports what the
//! workload did. These need root, QEMU, docker-registry, skopeo, e2fsprogs,
//! a static busybox, Debian's cloud kernel and the built guest (`scripts/setup`): without them
//! they skip on a developer machine and fail under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use imp_testenv::registry::{TestImage, TestLayer};

/// One guest at a time: two TCG guests on the 2-core CI machine make each boot slow and its
/// timing unpredictable.
static ONE_VM_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A busybox image whose config exercises ENTRYPOINT, CMD, Env and WorkingDir.
fn busybox_image() -> TestImage {
    let mut layer = TestLayer::new()
        .dir("bin", 0o755)
        .file("bin/busybox", std::fs::read("/bin/busybox").unwrap(), 0o755)
        .dir("etc", 0o755)
        .file(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
            0o644,
        )
        .file("etc/group", "root:x:0:\nnogroup:x:65534:\n", 0o644)
        .dir("tmp", 0o1777)
        .dir("root", 0o700)
        .dir("srv", 0o755)
        .dir("srv/app", 0o755)
        .file("srv/app/motd", "only on the image's disk\n", 0o644);
    for applet in [
        "sh", "echo", "cat", "pwd", "sleep", "id", "ls", "mount", "uname",
    ] {
        layer = layer.symlink(&format!("bin/{applet}"), "busybox");
    }
    TestImage::new()
        .layer(layer)
        .entrypoint(&["/bin/sh", "-c"])
        .cmd(&["echo \"$GREETING from $(pwd)\"; cat motd; exit 3"])
        .env("PATH=/bin")
        .env("GREETING=hello")
        .working_dir("/srv/app")
}

type Env = common::LocalEnv;

async fn env_with(name: &str, image: TestImage) -> Env {
    common::LocalEnv::new("run-e2e", name, image).await
}

/// The real `imp` binary, pointed at this test's state dir, kernel and guest.
fn imp_command(env: &Env) -> Command {
    env.command(&[])
}

fn imp(env: &Env, args: &[&str]) -> Output {
    env.imp(args)
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The cached base root filesystems (ext4 files) under the state dir's cache, with their
/// inodes: a rebuilt base is a new file renamed over the old one. (Not their mtimes: a use
/// touches the base, for the cache's least-recently-used eviction.)
fn cached_bases(state: &Path) -> Vec<(PathBuf, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut found = Vec::new();
    let mut stack = vec![state.join("cache")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "ext4") {
                found.push((path, meta.ino()));
            }
        }
    }
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imp_run_prints_the_workload_output_and_returns_its_exit_code() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let env = env_with("busybox", busybox_image()).await;

    // The image's own ENTRYPOINT + CMD, Env and WorkingDir; the workload exits 3.
    let out = imp(&env, &["run", "--rm", &env.image]);
    assert_eq!(out.status.code(), Some(3), "exit code of the workload");
    let text = stdout(&out);
    assert!(text.contains("hello from /srv/app"), "{text}");
    assert!(text.contains("only on the image's disk"), "{text}");
    assert!(
        !text.contains("IMP_EXIT"),
        "the marker is not workload output: {text}"
    );
    let first = cached_bases(&env.state);
    assert_eq!(first.len(), 1, "one cached base: {first:?}");

    // `-- CMD` replaces CMD and keeps ENTRYPOINT; --env wins over the image's Env; exit 0. The
    // second run of the same image reuses the cached base untouched.
    let out = imp(
        &env,
        &[
            "run",
            "--rm",
            "--env",
            "GREETING=bonjour",
            "--memory",
            "192",
            &env.image,
            "--",
            "echo \"$GREETING\"; id -u; echo disk $(cat /srv/app/motd | wc -c)",
        ],
    );
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    assert!(text.contains("bonjour"), "{text}");
    assert!(
        text.lines().any(|l| l.trim() == "0"),
        "runs as root: {text}"
    );
    assert_eq!(
        cached_bases(&env.state),
        first,
        "the cached base was rebuilt"
    );
    // A kernel that comes up without a timer (here forced by `noapictimer`; on a busy host its
    // APIC timer calibration can fail by itself) cannot run anything that sleeps: the guest
    // says so, the VM is booted again, and after three boots it fails saying why instead of
    // running with every sleep hung.
    let out = imp(
        &env,
        &[
            "run",
            "--rm",
            "--kernel-args",
            "noapictimer",
            &env.image,
            "--",
            "echo never",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("could not run in 3 boots") && err.contains("no clock event device"),
        "{err}"
    );
    assert!(!stdout(&out).contains("never"), "the workload ran: {err}");
    // --rm removed every VM; nothing is left but the cache.
    let vms = env.state.join("vms");
    let left: Vec<_> = std::fs::read_dir(&vms).unwrap().flatten().collect();
    assert!(left.is_empty(), "VM directories left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imp_run_detached_then_exec_ps_stop_and_rm() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let env = env_with("busybox", busybox_image()).await;
    let out = imp(
        &env,
        &[
            "run",
            "-d",
            "--name",
            "e2e-sleeper",
            &env.image,
            "--",
            "sleep 600",
        ],
    );
    assert!(out.status.success());
    assert_eq!(stdout(&out).trim(), "e2e-sleeper");

    let ps = stdout(&imp(&env, &["ps"]));
    assert!(
        ps.lines()
            .any(|l| l.starts_with("e2e-sleeper") && l.contains("running")),
        "{ps}"
    );
    // `imp run` confines its VMM as the agent does.
    let qemu = common::qemu_of(&env.state, "e2e-sleeper");
    assert_eq!(qemu.len(), 1, "{qemu:?}");
    common::assert_vmm_confined(qemu[0]);

    // exec streams output and returns the command's exit code while the workload runs.
    let out = imp(
        &env,
        &[
            "exec",
            "e2e-sleeper",
            "--",
            "sh",
            "-c",
            "echo $((6*7)); cat /srv/app/motd",
        ],
    );
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    assert!(text.contains("42"), "{text}");
    assert!(
        text.contains("only on the image's disk"),
        "exec runs in the VM's disk: {text}"
    );
    let out = imp(&env, &["exec", "e2e-sleeper", "--", "sh", "-c", "exit 5"]);
    assert_eq!(out.status.code(), Some(5));
    let out = imp(&env, &["exec", "e2e-sleeper", "--", "no-such-command"]);
    assert_ne!(out.status.code(), Some(0));

    // Another name is refused while this one exists.
    let out = imp(&env, &["run", "-d", "--name", "e2e-sleeper", &env.image]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists"));
    let out = imp(&env, &["rm", "e2e-sleeper"]);
    assert!(!out.status.success(), "rm refuses a running VM");

    let out = imp(&env, &["stop", "--time", "5s", "e2e-sleeper"]);
    assert!(out.status.success());
    let ps = stdout(&imp(&env, &["ps", "-a"]));
    let line = ps
        .lines()
        .find(|l| l.starts_with("e2e-sleeper"))
        .unwrap_or_else(|| panic!("{ps}"));
    assert!(line.contains("exited"), "{line}");
    let console = stdout(&imp(&env, &["console", "--no-follow", "e2e-sleeper"]));
    assert!(
        console.contains("IMP_EXIT"),
        "the raw console has the marker: {console}"
    );
    assert!(!console.contains("Kernel panic"), "{console}");
    let out = imp(&env, &["exec", "e2e-sleeper", "--", "true"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not running"));

    assert!(imp(&env, &["rm", "e2e-sleeper"]).status.success());
    assert!(!stdout(&imp(&env, &["ps", "-a"])).contains("e2e-sleeper"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imp_run_refuses_an_image_whose_layer_escapes_the_rootfs() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let outside = std::env::temp_dir().join(format!("imp-e2e-escaped-{}", std::process::id()));
    let _ = std::fs::remove_file(&outside);
    // `../../…` climbs out of the rootfs toward the cache's parent directories.
    let name = outside.file_name().unwrap().to_str().unwrap().to_string();
    let escape = TestLayer::new().dir("etc", 0o755).file(
        &format!("etc/../../../../../../../../..{}", outside.display()),
        "escaped",
        0o644,
    );
    let image = busybox_image().layer(escape);
    let env = env_with("escape", image).await;
    let out = imp(&env, &["run", "--rm", &env.image]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("layer"), "the error names the layer: {err}");
    assert!(err.contains(&name), "the error names the entry: {err}");
    assert!(!outside.exists(), "a file was written outside the rootfs");
    assert!(
        cached_bases(&env.state).is_empty(),
        "a refused image left a base in the cache"
    );
    assert!(
        !err.chars().any(|c| c.is_control() && c != '\n'),
        "raw control characters reached the terminal: {err:?}"
    );
    let vms: Vec<_> = std::fs::read_dir(env.state.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(vms.is_empty(), "a failed `imp run --rm` left {vms:?}");
}

/// `imp run … | head -1`: once the reader has gone, imp stops the VM quietly (no panic, no
/// waiting for the workload's end) and `--rm` removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_stops_the_vm_quietly() {
    use std::io::{BufRead, BufReader};
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let env = env_with("busybox", busybox_image()).await;
    let mut child = imp_command(&env)
        .args(["run", "--rm", &env.image, "--"])
        .arg("i=0; while true; do echo line $i; i=$((i+1)); sleep 0.2; done")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("line"), "{first:?}");
    // The reader goes away, as `head -1` does.
    let closed = Instant::now();
    let deadline = closed + std::time::Duration::from_secs(90);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("imp run went on for 90 s after its stdout was closed");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    eprintln!(
        "ended {status:?} {:.1}s after the close: {err}",
        closed.elapsed().as_secs_f64()
    );
    assert_ne!(status.code(), Some(101), "panicked: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let vms: Vec<_> = std::fs::read_dir(env.state.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(vms.is_empty(), "--rm left {vms:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_whose_supervisor_was_killed_is_reported_and_its_vmm_reaped_by_stop() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let env = env_with("busybox", busybox_image()).await;
    let out = imp(
        &env,
        &[
            "run",
            "-d",
            "--name",
            "e2e-orphan",
            &env.image,
            "--",
            "sleep 600",
        ],
    );
    assert!(out.status.success());
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.state.join("vms/e2e-orphan/vm.json")).unwrap())
            .unwrap();
    let supervisor = record["supervisor_pid"].as_i64().unwrap();
    let vmm = record["vmm_pid"].as_i64().unwrap();
    // QEMU's guest channel is served by the supervisor itself (a mux over virtio-serial): no
    // helper process to orphan.
    assert_eq!(
        record["helper_pids"].as_array().map(Vec::len),
        Some(0),
        "a QEMU VM has no helper process: {record}"
    );
    let alive = |pid: i64| {
        Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z ")
    };
    assert!(
        Command::new("kill")
            .args(["-KILL", &supervisor.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while alive(supervisor) && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        alive(vmm),
        "the VMM died with its supervisor; this test needs it orphaned"
    );
    let ps = stdout(&imp(&env, &["ps", "-a"]));
    let line = ps
        .lines()
        .find(|l| l.starts_with("e2e-orphan"))
        .unwrap_or_else(|| panic!("{ps}"));
    assert!(
        line.contains("failed"),
        "a dead supervisor reads as failed: {line}"
    );
    let out = imp(&env, &["stop", "e2e-orphan"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("orphaned VMM"));
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while alive(vmm) && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!alive(vmm), "the orphaned VMM is still running");
    // The killed shim could not remove its VM's cgroup: empty now, it goes with the next
    // `imp run` of this state dir, or here.
    let cgroup = serde_json::from_slice::<serde_json::Value>(
        &std::fs::read(env.state.join("vms/e2e-orphan/spec.json")).unwrap(),
    )
    .unwrap()["cgroup"]["path"]
        .as_str()
        .map(str::to_owned);
    assert!(imp(&env, &["rm", "e2e-orphan"]).status.success());
    if let Some(path) = cgroup {
        let cg = imp_agent::runtime::cgroup::VmCgroup::at(&path).unwrap();
        // A zombie (the killed VMM, until init reaps it) runs nothing; a live process would.
        let left: Vec<String> = cg
            .pids()
            .into_iter()
            .filter(|&p| alive(i64::from(p)))
            .map(|p| {
                let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                format!(
                    "{p} {}",
                    String::from_utf8_lossy(&cmdline).replace('\0', " ")
                )
            })
            .collect();
        assert!(left.is_empty(), "processes left in {path}: {left:?}");
        cg.destroy().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_the_workload_gracefully() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let env = env_with("busybox", busybox_image()).await;
    // Like a shell: imp gets its own process group, and Ctrl-C signals that whole group.
    let mut child = imp_command(&env)
        .args(["run", "--rm", &env.image, "--"])
        .arg("trap 'echo got-term; exit 0' TERM; echo started; while true; do sleep 1; done")
        .stdout(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let pgid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + std::time::Duration::from_secs(120);
    while !seen.iter().any(|l: &String| l == "started") {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = child.kill();
                panic!("the workload never started: {seen:?}");
            }
        }
    }
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(pgid).unwrap()),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("imp run did not end within 60 s of Ctrl-C: {seen:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    seen.extend(rx.try_iter());
    assert!(
        seen.iter().any(|l| l == "got-term"),
        "the workload got no SIGTERM: {seen:?}"
    );
    assert_eq!(status.code(), Some(0), "{seen:?}");
}

/// Like `docker run`: without -i the workload's stdin is empty (a `cat` ends at once instead of
/// waiting forever on the console), and with -i our stdin reaches it, its output comes back and
/// its exit code is ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_is_empty_without_dash_i_and_attached_with_it() {
    let _one = ONE_VM_AT_A_TIME.lock().await;
    if common::guest_boot_ready().is_none() {
        return;
    }
    let env = env_with("stdin", busybox_image()).await;
    let started = Instant::now();
    let out = imp(
        &env,
        &["run", "--rm", &env.image, "--", "cat; echo cat-ended"],
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("cat-ended"), "{}", stdout(&out));
    assert!(started.elapsed() < std::time::Duration::from_secs(120));

    use std::io::Write;
    let mut child = imp_command(&env)
        .args(["run", "--rm", "-i", &env.image, "--"])
        .arg("read line; echo \"got $line from $(pwd)\"; exit 4")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let text = stdout(&out);
    eprintln!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(4),
        "the attached workload's exit code"
    );
    assert!(text.contains("got hello from /srv/app"), "{text}");
    assert!(
        std::fs::read_dir(env.state.join("vms"))
            .unwrap()
            .next()
            .is_none(),
        "--rm left a VM directory"
    );
}
