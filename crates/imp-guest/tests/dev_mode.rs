//! The real guest binary in dev mode (`--no-pid1`): API on a Unix socket, exit report to a
//! Unix socket, marker on stdout; driven by imp-proto's host-side client.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on setup failure

use imp_proto::client::{Client, ClientError, ExecEvent};
use imp_proto::config::{DEFAULT_PATH, GuestConfig, ImageConfig};
use imp_proto::report::receive_exit_report;
use imp_proto::{ErrorKind, ExecRequest, ExitStatus, Hello, WindowSize, WorkloadState};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

struct Guest {
    dir: PathBuf,
    child: Option<Child>,
    reports: mpsc::Receiver<ExitStatus>,
}

fn strings(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

fn config(cmd: &[&str]) -> GuestConfig {
    GuestConfig {
        image: ImageConfig {
            cmd: strings(cmd),
            ..Default::default()
        },
        ..Default::default()
    }
}

impl Guest {
    fn start(name: &str, config: &GuestConfig) -> Guest {
        let dir = std::env::temp_dir().join(format!("imp-guest-it-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config.to_json().unwrap()).unwrap();
        let report = UnixListener::bind(dir.join("report.sock")).unwrap();
        let (tx, reports) = mpsc::channel();
        thread::spawn(move || {
            let (mut s, _) = report.accept().unwrap();
            let status = receive_exit_report(&mut s, &Hello::new("test-host")).unwrap();
            tx.send(status).unwrap();
        });
        let child = Command::new(env!("CARGO_BIN_EXE_imp-guest"))
            .arg("--no-pid1")
            .arg("--config")
            .arg(dir.join("config.json"))
            .arg("--listen-unix")
            .arg(dir.join("api.sock"))
            .arg("--report-unix")
            .arg(dir.join("report.sock"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Guest {
            dir,
            child: Some(child),
            reports,
        }
    }

    fn connect(&self) -> Client<UnixStream> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match UnixStream::connect(self.dir.join("api.sock")) {
                Ok(s) => return Client::handshake(s, &Hello::new("test-host")).unwrap(),
                Err(e) if Instant::now() > deadline => panic!("guest API never came up: {e}"),
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits for the guest to end; returns its output and the exit it reported.
    fn wait(mut self) -> (Output, ExitStatus) {
        let out = self.child.take().unwrap().wait_with_output().unwrap();
        let status = self
            .reports
            .recv_timeout(Duration::from_secs(5))
            .expect("an exit report");
        (out, status)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(client: Client<UnixStream>, request: ExecRequest) -> (Vec<u8>, Vec<u8>, ExitStatus) {
    let mut s = client.exec(&request).unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = s.wait_with_output(&mut out, &mut err).unwrap();
    (out, err, status)
}

fn exec(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: strings(argv),
        ..Default::default()
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn streamed_output_arrives_before_the_command_finishes() {
    let guest = Guest::start("stream", &config(&["sleep", "30"]));
    let mut s = guest
        .connect()
        .exec(&exec(&["sh", "-c", "echo a; sleep 1; echo b"]))
        .unwrap();
    let start = Instant::now();
    let mut first_at = None;
    let mut out = Vec::new();
    let status = loop {
        match s.next_event().unwrap() {
            ExecEvent::Stdout(d) => {
                first_at.get_or_insert(start.elapsed());
                out.extend(d);
            }
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(status) => break status,
        }
    };
    let total = start.elapsed();
    let first = first_at.unwrap();
    assert_eq!(String::from_utf8_lossy(&out), "a\nb\n");
    assert_eq!(status, ExitStatus::Code(0));
    assert!(
        first < Duration::from_millis(600),
        "'a' arrived after {first:?}"
    );
    assert!(total >= Duration::from_millis(950), "exit after {total:?}");
    assert!(
        total - first >= Duration::from_millis(700),
        "'a' at {first:?}, exit at {total:?}"
    );
}

#[test]
fn exec_reports_exit_codes_and_separates_stderr() {
    let guest = Guest::start("codes", &config(&["sleep", "30"]));
    let (out, _, status) = run(guest.connect(), exec(&["true"]));
    assert!(out.is_empty());
    assert_eq!(status, ExitStatus::Code(0));
    let (out, err, status) = run(
        guest.connect(),
        exec(&["sh", "-c", "echo o; echo e >&2; exit 3"]),
    );
    assert_eq!(
        (out.as_slice(), err.as_slice(), status),
        (&b"o\n"[..], &b"e\n"[..], ExitStatus::Code(3))
    );
}

#[test]
fn exec_pipes_stdin() {
    let guest = Guest::start("stdin", &config(&["sleep", "30"]));
    let mut req = exec(&["sh", "-c", "tr a-z A-Z; echo done"]);
    req.stdin = true;
    let mut s = guest.connect().exec(&req).unwrap();
    s.write_stdin(b"hello ").unwrap();
    s.write_stdin(b"world\n").unwrap();
    s.close_stdin().unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    assert_eq!(
        s.wait_with_output(&mut out, &mut err).unwrap(),
        ExitStatus::Code(0)
    );
    assert_eq!(String::from_utf8_lossy(&out), "HELLO WORLD\ndone\n");
}

#[test]
fn exec_on_a_tty_gets_a_terminal_and_resizes() {
    let guest = Guest::start("tty", &config(&["sleep", "30"]));
    let mut req = exec(&[
        "sh",
        "-c",
        "stty size; read line; stty size; echo got:$line",
    ]);
    req.tty = true;
    req.window = Some(WindowSize { rows: 20, cols: 60 });
    let mut s = guest.connect().exec(&req).unwrap();
    let mut out = Vec::new();
    while !String::from_utf8_lossy(&out).contains("20 60") {
        match s.next_event().unwrap() {
            ExecEvent::Stdout(d) => out.extend(d),
            other => panic!(
                "unexpected {other:?} after {:?}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    s.resize(WindowSize {
        rows: 40,
        cols: 100,
    })
    .unwrap();
    s.write_stdin(b"xyz\n").unwrap();
    let (mut rest, mut err) = (Vec::new(), Vec::new());
    assert_eq!(
        s.wait_with_output(&mut rest, &mut err).unwrap(),
        ExitStatus::Code(0)
    );
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("40 100") && rest.contains("got:xyz"),
        "{rest:?}"
    );
    assert!(err.is_empty(), "a TTY merges stderr into stdout");
}

#[test]
fn a_bad_command_is_a_clear_error() {
    let guest = Guest::start("bad", &config(&["sleep", "30"]));
    let err = guest
        .connect()
        .exec(&exec(&["definitely-not-a-command"]))
        .unwrap_err();
    match &err {
        ClientError::Remote(e) => {
            assert_eq!(e.kind, ErrorKind::NotFound);
            assert!(
                e.message
                    .contains("\"definitely-not-a-command\" not found in PATH="),
                "{}",
                e.message
            );
        }
        other => panic!("unexpected {other}"),
    }
    let mut req = exec(&["true"]);
    req.cwd = Some("/no/such/dir".into());
    let err = guest.connect().exec(&req).unwrap_err();
    assert!(
        err.to_string()
            .contains("Working directory /no/such/dir does not exist"),
        "{err}"
    );
}

#[test]
fn exec_runs_as_the_requested_user() {
    let guest = Guest::start("user", &config(&["sleep", "30"]));
    let mut req = exec(&["sh", "-c", "echo $(id -u):$(id -g)"]);
    req.user = Some("4321:4322".into());
    if nix::unistd::geteuid().is_root() {
        let (out, _, status) = run(guest.connect(), req);
        assert_eq!(status, ExitStatus::Code(0));
        assert_eq!(String::from_utf8_lossy(&out), "4321:4322\n");
    } else {
        // Without privilege the switch must fail clearly, not run as the wrong user.
        let err = guest.connect().exec(&req).unwrap_err();
        assert!(
            matches!(&err, ClientError::Remote(e) if e.kind == ErrorKind::PermissionDenied),
            "{err}"
        );
    }
}

#[test]
fn health_and_metrics_answer_on_one_connection() {
    let guest = Guest::start("health", &config(&["sleep", "30"]));
    let mut c = guest.connect();
    // The agent answers from the start; the workload is Starting until its process runs
    // (on a loaded machine that is a few milliseconds after the socket opens).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let h = loop {
        let h = c.health().unwrap();
        match h.workload {
            WorkloadState::Running { .. } => break h,
            WorkloadState::Starting if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            _ => panic!("the workload did not come to run: {h:?}"),
        }
    };
    let m = c.metrics().unwrap();
    assert!(m.memory_total_bytes > 0 && m.disk_total_bytes > 0, "{m:?}");
    assert!((0.0..=1.0).contains(&m.cpu_usage_ratio));
    let later = c.health().unwrap();
    assert!(later.uptime_ms >= h.uptime_ms);
}

#[test]
fn shutdown_terms_the_workload_then_reports_and_marks_its_exit() {
    let guest = Guest::start(
        "shutdown",
        &config(&[
            "sh",
            "-c",
            "trap 'echo bye; exit 7' TERM; while :; do sleep 0.1; done",
        ]),
    );
    let mut c = guest.connect();
    // Let the shell install its trap.
    thread::sleep(Duration::from_millis(300));
    c.shutdown(Duration::from_secs(5)).unwrap();
    let (out, reported) = guest.wait();
    assert_eq!(reported, ExitStatus::Code(7));
    assert_eq!(out.status.code(), Some(7));
    let text = stdout(&out);
    assert!(
        text.contains("bye") && text.contains("\nIMP_EXIT 7\n"),
        "{text:?}"
    );
    assert!(!text.contains("IMP_SUCCESS"));
}

#[test]
fn shutdown_kills_a_workload_that_ignores_sigterm_after_the_grace() {
    let guest = Guest::start(
        "grace",
        &config(&["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"]),
    );
    let mut c = guest.connect();
    thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    c.shutdown(Duration::from_millis(500)).unwrap();
    let (out, reported) = guest.wait();
    assert_eq!(reported, ExitStatus::Signal(9));
    assert!(start.elapsed() >= Duration::from_millis(450));
    assert!(stdout(&out).contains("\nIMP_EXIT 137\n"));
}

#[test]
fn a_successful_workload_prints_imp_success_and_reports_zero() {
    let mut c = config(&["sh", "-c", "echo \"$PATH|$(pwd)|$FOO|$BAR\""]);
    c.image.env = strings(&["FOO=from-image", "BAR=image"]);
    c.image.working_dir = Some("/tmp".into());
    c.env = vec![imp_proto::EnvVar::new("BAR", "from-vm")];
    let (out, reported) = Guest::start("success", &c).wait();
    assert_eq!(reported, ExitStatus::Code(0));
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("{DEFAULT_PATH}|/tmp|from-image|from-vm\n")),
        "{text:?}"
    );
    assert!(text.ends_with("\nIMP_EXIT 0\nIMP_SUCCESS\n"), "{text:?}");
}

#[test]
fn a_failing_workload_reports_its_code() {
    let (out, reported) = Guest::start("fail", &config(&["sh", "-c", "exit 3"])).wait();
    assert_eq!(reported, ExitStatus::Code(3));
    assert_eq!(out.status.code(), Some(3));
    assert!(stdout(&out).ends_with("\nIMP_EXIT 3\n"));
}

#[test]
fn sigterm_to_the_guest_is_forwarded_to_the_workload() {
    let guest = Guest::start("sigterm", &config(&["sleep", "30"]));
    let _ = guest.connect(); // up and running
    let pid = nix::unistd::Pid::from_raw(guest.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let (out, reported) = guest.wait();
    assert_eq!(reported, ExitStatus::Signal(15));
    assert!(stdout(&out).contains("\nIMP_EXIT 143\n"));
}

#[test]
fn a_workload_that_cannot_start_reports_127_with_a_reason() {
    let (out, reported) = Guest::start("nocmd", &config(&["no-such-workload"])).wait();
    assert_eq!(reported, ExitStatus::Code(127));
    assert!(stdout(&out).contains("\nIMP_EXIT 127\n"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"no-such-workload\" not found in PATH="),
        "{err}"
    );
}

#[test]
fn zombies_of_orphaned_grandchildren_are_reaped() {
    // The workload leaves a background child behind (it becomes our child only as PID 1, so
    // here we check the guest's own children: an exec that backgrounds a process).
    let guest = Guest::start("zombies", &config(&["sleep", "30"]));
    let (_, _, status) = run(guest.connect(), exec(&["sh", "-c", "sleep 0.2 & exit 0"]));
    assert_eq!(status, ExitStatus::Code(0));
    thread::sleep(Duration::from_millis(300));
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        guest.pid(),
        guest.pid()
    ))
    .unwrap_or_default();
    for pid in children.split_whitespace() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(!stat.contains(") Z "), "zombie child {pid}: {stat}");
    }
}

#[test]
fn without_no_pid1_it_refuses_to_run_as_a_plain_process() {
    let out = Command::new(env!("CARGO_BIN_EXE_imp-guest"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pass --no-pid1"));
}

#[test]
fn a_missing_config_is_reported_as_127() {
    let dir = std::env::temp_dir().join(format!("imp-guest-it-{}-noconfig", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_imp-guest"))
        .args(["--no-pid1", "--config"])
        .arg(dir.join("missing.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    assert!(String::from_utf8_lossy(&out.stdout).contains("IMP_EXIT 127"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json"));
}

#[test]
fn a_dev_mode_guest_refuses_to_change_the_hosts_identity_and_keeps_serving() {
    let guest = Guest::start("reidentify", &config(&["sleep", "30"]));
    let mut c = guest.connect();
    assert_eq!(c.peer().version, imp_proto::PROTOCOL_VERSION);
    let identity = imp_proto::Identity {
        hostname: Some("not-this-host".into()),
        ..imp_proto::Identity::default()
    };
    let err = c
        .reidentify(
            &identity,
            imp_proto::Entropy(vec![0; 64]),
            std::time::SystemTime::now(),
        )
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Remote(e) if e.kind == ErrorKind::PermissionDenied
            && e.message.contains("outside a VM")),
        "{err}"
    );
    // The connection goes on.
    assert!(c.health().is_ok());
}

#[test]
fn user_data_runs_before_the_workload() {
    use imp_proto::config::{CloudConfig, RunCommand, UserData, WriteFile};
    let scratch = std::env::temp_dir().join(format!("imp-guest-ud-ok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (file, seen) = (scratch.join("conf/greeting"), scratch.join("seen"));
    let mut c = config(&[
        "sh",
        "-c",
        &format!("echo workload saw: $(cat {})", seen.display()),
    ]);
    c.user_data = Some(UserData::CloudConfig(CloudConfig {
        write_files: vec![WriteFile {
            path: file.display().to_string(),
            content: "hello\n".into(),
            encoding: Default::default(),
            permissions: 0o600,
            owner: None,
        }],
        runcmd: vec![
            RunCommand::Argv(strings(&["sh", "-c", "echo from userData"])),
            RunCommand::Shell(format!("cp {} {}", file.display(), seen.display())),
        ],
        ..Default::default()
    }));
    let (out, status) = Guest::start("ud-ok", &c).wait();
    let _ = std::fs::remove_dir_all(&scratch);
    let stdout = stdout(&out);
    assert_eq!(status, ExitStatus::Code(0), "{stdout}");
    let at = |s: &str| {
        stdout
            .find(s)
            .unwrap_or_else(|| panic!("{s:?} in {stdout}"))
    };
    assert!(at("from userData") < at("workload saw: hello"), "{stdout}");
}

#[test]
fn a_failing_user_data_step_ends_the_vm_without_the_workload() {
    use imp_proto::config::{CloudConfig, RunCommand, UserData};
    let mut c = config(&["sh", "-c", "echo workload ran"]);
    c.user_data = Some(UserData::CloudConfig(CloudConfig {
        runcmd: vec![
            RunCommand::Shell("echo first".into()),
            RunCommand::Shell("echo broken >&2; exit 3".into()),
            RunCommand::Shell("echo never".into()),
        ],
        ..Default::default()
    }));
    let (out, status) = Guest::start("ud-fail", &c).wait();
    let stdout = stdout(&out);
    assert_eq!(status, ExitStatus::Code(3), "{stdout}");
    assert!(!stdout.contains("workload ran"), "{stdout}");
    assert!(!stdout.contains("never"), "{stdout}");
    assert_eq!(
        imp_proto::marker::find_user_data_failure(&stdout).as_deref(),
        Some("runcmd[1] (echo broken >&2; exit 3): exited with code 3; output: broken"),
        "{stdout}"
    );
}
