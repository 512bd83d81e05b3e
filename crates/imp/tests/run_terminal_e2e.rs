//! `imp run` in a real terminal: tmux runs a cold `imp run` of an image pushed to a local
//! registry, and the test reads the screen as a person would see it: one line per layer
//! redrawn in place while it downloads, verifies and extracts, then the root filesystem and the
//! disk, then the workload's output below them and nothing of the progress after it. The one
//! guest it boots also answers the exit-code checks: a command the guest cannot find (127) or
//! run (126), a command's own code, and a stop (143). Needs what `run_e2e` needs plus tmux:
//! skips on a developer machine without them, fails under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use imp_testenv::registry::{TestImage, TestLayer, TestRegistry, push, scratch_dir};

/// The line the workload prints once it runs.
const HELLO: &str = "hello from the guest";

/// Bytes gzip cannot shrink (xorshift), so each layer takes a while to move.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        out.extend_from_slice(&seed.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn image() -> TestImage {
    let mut base = TestLayer::new()
        .dir("bin", 0o755)
        .file("bin/busybox", std::fs::read("/bin/busybox").unwrap(), 0o755)
        .dir("etc", 0o755)
        .file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", 0o644)
        .dir("tmp", 0o1777);
    for applet in ["sh", "echo", "sleep"] {
        base = base.symlink(&format!("bin/{applet}"), "busybox");
    }
    TestImage::new()
        .layer(base)
        .layer(
            TestLayer::new()
                .dir("data", 0o755)
                .file("data/a", noise(8 << 20, 1), 0o644),
        )
        .layer(TestLayer::new().file("data/b", noise(4 << 20, 2), 0o644))
        .entrypoint(&["/bin/sh", "-c"])
        .env("PATH=/bin")
}

/// A tmux server of the test's own (its own socket), killed on drop.
struct Tmux {
    tmux: PathBuf,
    socket: String,
}

impl Tmux {
    fn start(tmux: PathBuf, script: &Path) -> Self {
        let t = Tmux {
            tmux,
            socket: format!("imp-e2e-{}", std::process::id()),
        };
        let ok = t
            .cmd()
            .args([
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-x",
                "120",
                "-y",
                "40",
            ])
            .arg(format!("sh {}", script.display()))
            .status()
            .unwrap();
        assert!(ok.success(), "starting tmux");
        t
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.tmux);
        c.args(["-L", &self.socket]);
        c
    }

    /// The visible screen, one string per row (trailing blanks trimmed).
    fn screen(&self) -> Vec<String> {
        let out = self.cmd().args(["capture-pane", "-p"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.trim_end().to_owned())
            .collect()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").status();
    }
}

struct Env {
    state: PathBuf,
}

impl Drop for Env {
    fn drop(&mut self) {
        // A failed assertion must not leave the VM's shim and QEMU running.
        let _ = Command::new(env!("CARGO_BIN_EXE_imp"))
            .args(["rm", "-f", "term-e2e"])
            .env("IMP_STATE_DIR", &self.state)
            .output();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn imp(env: &Env, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_imp"))
        .args(args)
        .env("IMP_STATE_DIR", &env.state)
        .output()
        .unwrap();
    imp_testenv::report::logged(args, out)
}

/// Polls the screen every 100 ms until `done` holds for it; returns every distinct screen.
fn watch(tmux: &Tmux, within: Duration, done: impl Fn(&[String]) -> bool) -> Vec<Vec<String>> {
    let start = Instant::now();
    let mut seen: Vec<Vec<String>> = Vec::new();
    loop {
        let screen = tmux.screen();
        if seen.last() != Some(&screen) {
            seen.push(screen.clone());
        }
        if done(&screen) {
            return seen;
        }
        assert!(
            start.elapsed() < within,
            "timed out after {within:?}; the screen:\n{}",
            screen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_run_in_a_terminal_shows_layer_progress_then_the_workload() {
    if common::guest_boot_ready().is_none() {
        return;
    }
    let Some(tmux) = imp_testenv::guard::which("tmux") else {
        imp_testenv::guard::require(false, "tmux (apt-get install tmux; scripts/setup)");
        return;
    };
    let registry = TestRegistry::start().await.unwrap();
    let layout = scratch_dir("imp-term-e2e-layout").unwrap();
    let written = image().write_layout(&layout, "1").unwrap();
    let reference = format!("{}/progress:1", registry.host());
    push(&layout, "1", &reference, None).await.unwrap();
    std::fs::remove_dir_all(&layout).unwrap();
    let env = Env {
        state: scratch_dir("imp-term-e2e-state").unwrap(),
    };
    let script = env.state.join("run.sh");
    std::fs::write(
        &script,
        format!(
            "export IMP_STATE_DIR='{}' IMP_KERNEL='{}' IMP_GUEST='{}'\n\
             '{}' run --name term-e2e '{reference}' -- 'echo {HELLO}; sleep 600'\n\
             echo IMP-EXIT=$?\nsleep 600\n",
            env.state.display(),
            common::kernel().display(),
            common::guest().display(),
            env!("CARGO_BIN_EXE_imp"),
        ),
    )
    .unwrap();
    let tmux = Tmux::start(tmux, &script);

    let shown = |screen: &[String], text: &str| screen.iter().any(|l| l.contains(text));
    let screens = watch(&tmux, Duration::from_secs(300), |s| shown(s, HELLO));
    if let Some(file) = std::env::var_os("IMP_TEST_SCREENS") {
        let all: Vec<String> = screens.iter().map(|s| s.join("\n")).collect();
        std::fs::write(file, all.join("\n-----\n")).unwrap();
    }
    let last = screens.last().unwrap().clone();
    eprintln!(
        "the screen once the workload ran:\n{}",
        last.join("\n").trim_end()
    );

    // While it worked, a layer's line had its state, bar and bytes (the rate follows once a
    // phase has run for a moment; the finished lines below say it).
    let moving = screens.iter().find(|screen| {
        screen.iter().any(|l| {
            ["downloading", "verifying", "extracting"]
                .iter()
                .any(|s| l.contains(s))
                && l.contains('[')
                && l.contains(" / ")
                && l.contains("iB")
        })
    });
    if let Some(screen) = moving {
        let top: Vec<&String> = screen.iter().take_while(|l| !l.is_empty()).collect();
        eprintln!(
            "a screen while it worked ({} screens seen):\n{}",
            screens.len(),
            top.iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    assert!(
        moving.is_some(),
        "no screen showed a layer in progress:\n{}",
        screens
            .iter()
            .map(|s| s.join("\n"))
            .collect::<Vec<_>>()
            .join("\n----\n")
    );
    // At the end: each layer on one line of its own (redrawn, never appended), done; then the
    // root filesystem and the disk; then the workload's output and nothing of the progress.
    let hello = last.iter().position(|l| l.contains(HELLO)).unwrap();
    for digest in &written.layer_digests {
        let short = &digest["sha256:".len().."sha256:".len() + 12];
        let rows: Vec<usize> = last
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains(short))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            rows.len(),
            1,
            "layer {short} on one line:\n{}",
            last.join("\n")
        );
        let line = &last[rows[0]];
        assert!(
            line.contains("downloaded")
                && line.contains("MiB/s")
                && line.ends_with("extracted")
                && rows[0] < hello,
            "{line}"
        );
    }
    let rootfs = last
        .iter()
        .position(|l| l.contains("root filesystem built"));
    let disk = last
        .iter()
        .position(|l| l.trim_start().starts_with("disk") && l.contains("ready"));
    assert!(
        rootfs.is_some_and(|r| disk.is_some_and(|d| r < d && d < hello)),
        "{}",
        last.join("\n")
    );
    for l in &last[hello..] {
        assert!(
            !["layer", "root filesystem", "downloading", "MiB"]
                .iter()
                .any(|p| l.contains(p)),
            "progress after the workload's output: {l}"
        );
    }

    // The same guest answers the exit codes: not found 127, not executable 126, its own code
    // (once its record says running: the workload may print before the agent is seen to answer).
    let started = Instant::now();
    while !String::from_utf8_lossy(&imp(&env, &["ps"]).stdout)
        .lines()
        .any(|l| l.starts_with("term-e2e") && l.contains("running"))
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never running"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = imp(&env, &["exec", "term-e2e", "--", "no-such-command"]);
    assert_eq!(out.status.code(), Some(127));
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
    let out = imp(&env, &["exec", "term-e2e", "--", "/etc/passwd"]);
    assert_eq!(out.status.code(), Some(126));
    let out = imp(&env, &["exec", "term-e2e", "--", "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7));
    // A stop ends the workload with SIGTERM: 143 in the terminal.
    assert!(
        imp(&env, &["stop", "--time", "5s", "term-e2e"])
            .status
            .success()
    );
    let screens = watch(&tmux, Duration::from_secs(60), |s| shown(s, "IMP-EXIT="));
    let end = screens.last().unwrap();
    assert!(shown(end, "IMP-EXIT=143"), "{}", end.join("\n"));
    assert!(imp(&env, &["rm", "term-e2e"]).status.success());
}
