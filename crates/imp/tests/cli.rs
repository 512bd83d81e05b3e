//! The `imp` binary as a person meets it, without booting anything: exit codes, one-line
//! failures (a backtrace only with `--debug` or `IMP_LOG=debug`, whatever `RUST_BACKTRACE`
//! says), plain progress through a pipe (and none with `-q`), shell completions, the committed
//! man pages matching the CLI, `imp version`, and `imp logs` choosing a local VM or an ImpVM.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use imp_testenv::registry::{TestImage, TestLayer, scratch_dir};
use imp_testenv::workspace_root;

fn imp(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imp"));
    cmd.args(args)
        .env_remove("IMP_LOG")
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG");
    cmd
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    imp_testenv::report::logged(&*cmd, out)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A kubeconfig whose user authenticates with a client certificate, which `imp exec -n` cannot
/// present to a node agent: it fails before any connection, on any machine.
fn certificate_kubeconfig(dir: &Path) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
         clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u, namespace: d}}]\n\
         users: [{name: u, user: {client-certificate-data: aGVsbG8=, client-key-data: aGVsbG8=}}]\n",
    )
    .unwrap();
    path
}

#[test]
fn help_and_version_succeed_and_a_usage_error_is_imps_failure() {
    let out = run(&mut imp(&["--help"]));
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("QEMU or Firecracker") && help.contains("Exit codes"),
        "{help}"
    );
    assert!(
        !help.contains("Firecracker microVMs"),
        "the old words: {help}"
    );
    let out = run(&mut imp(&["run", "--help"]));
    let help = String::from_utf8_lossy(&out.stdout);
    for code in ["125", "126", "127"] {
        assert!(
            help.contains(code),
            "imp run --help documents {code}: {help}"
        );
    }
    let out = run(&mut imp(&["--version"]));
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        concat!("imp ", env!("CARGO_PKG_VERSION"))
    );
    let out = run(&mut imp(&["run", "--no-such-flag", "img"]));
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("--no-such-flag"));
}

#[test]
fn a_failure_is_one_line_and_a_backtrace_only_when_asked() {
    let dir = scratch_dir("imp-cli-errors").unwrap();
    let kubeconfig = certificate_kubeconfig(&dir);
    let exec = |extra: &[&str], env: &[(&str, &str)]| {
        let mut cmd = imp(extra);
        cmd.args(["exec", "--kubeconfig"])
            .arg(&kubeconfig)
            .args(["-n", "d", "vm", "--", "true"])
            .env("RUST_BACKTRACE", "1");
        for (k, v) in env {
            cmd.env(k, v);
        }
        run(&mut cmd)
    };
    // RUST_BACKTRACE=1 is common in a Rust user's shell and in CI: still one line.
    let out = exec(&[], &[]);
    assert_eq!(out.status.code(), Some(125));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("imp: building the Kubernetes client") && err.contains("private key"),
        "{err}"
    );
    assert!(!err.contains("backtrace"), "{err}");
    // Asked for: the causes and where it failed.
    for out in [exec(&["--debug"], &[]), exec(&[], &[("IMP_LOG", "debug")])] {
        assert_eq!(out.status.code(), Some(125));
        let err = stderr(&out);
        assert!(err.contains("Stack backtrace:"), "{err}");
        assert!(err.contains("imp::cluster::connect"), "{err}");
    }
    // A missing kubeconfig: what failed and why, in one line.
    let out = run(imp(&["ps", "-A", "--kubeconfig"]).arg(dir.join("missing")));
    assert_eq!(out.status.code(), Some(125));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("imp: reading the kubeconfig") && err.contains("No such file"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn logs_reads_a_local_vm_unless_a_cluster_flag_or_the_plugin_name_asks_for_an_impvm() {
    let dir = scratch_dir("imp-cli-logs").unwrap();
    // No cluster flag: a local VM, looked up in the state directory.
    let out = run(imp(&["logs", "web", "--state-dir"]).arg(dir.join("state")));
    assert_eq!(out.status.code(), Some(125));
    assert_eq!(stderr(&out), "imp: no VM named \"web\" (see `imp ps -a`)\n");
    // A cluster flag: an ImpVM, read with the kubeconfig (here one that cannot be read).
    let out = run(imp(&["logs", "web", "-n", "team", "--kubeconfig"]).arg(dir.join("missing")));
    assert_eq!(out.status.code(), Some(125));
    assert!(
        stderr(&out).starts_with("imp: reading the kubeconfig"),
        "{}",
        stderr(&out)
    );
    // Invoked as kubectl-imp: an ImpVM without any flag (KUBECONFIG names the missing file).
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_imp"), dir.join("kubectl-imp")).unwrap();
    let mut plugin = Command::new(dir.join("kubectl-imp"));
    plugin
        .args(["logs", "web"])
        .env("KUBECONFIG", dir.join("missing"));
    let out = run(&mut plugin);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        stderr(&out).starts_with("imp: reading the kubeconfig"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A two-layer image in an OCI layout under `dir`; its reference.
fn layout_image(dir: &Path) -> String {
    let image = TestImage::new()
        .layer(
            TestLayer::new()
                .dir("etc", 0o755)
                .file("etc/data", vec![7u8; 200_000], 0o644),
        )
        .layer(TestLayer::new().file("etc/hello", "hello\n", 0o644));
    image.write_layout(&dir.join("layout"), "v1").unwrap();
    format!("oci:{}:v1", dir.join("layout").display())
}

#[test]
fn image_pull_through_a_pipe_logs_plain_progress_and_nothing_with_q() {
    if !imp_testenv::guard::require(
        imp_testenv::guard::which("mkfs.ext4").is_some(),
        "tool `mkfs.ext4` on PATH (e2fsprogs)",
    ) {
        return;
    }
    let dir = scratch_dir("imp-cli-pull").unwrap();
    let image = layout_image(&dir);
    let state = dir.join("state");
    let out = run(imp(&["image", "pull", &image, "--state-dir"]).arg(&state));
    assert_eq!(out.status.code(), Some(0));
    let digest = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        digest.starts_with("sha256:"),
        "stdout is the digest: {digest}"
    );
    let err = stderr(&out);
    assert!(
        !err.chars().any(|c| c.is_control() && c != '\n'),
        "control characters in a pipe: {err:?}"
    );
    let lines: Vec<&str> = err.lines().collect();
    assert!(lines.iter().all(|l| l.starts_with("imp: ")), "{err}");
    assert!(lines[0].contains("2 layers"), "{err}");
    for n in 1..=2 {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("layer {n}/2")) && l.contains("copied")),
            "{err}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("layer {n}/2")) && l.ends_with("extracted")),
            "{err}"
        );
    }
    assert!(
        lines.iter().any(|l| l.contains("root filesystem built")),
        "{err}"
    );
    // Again, quietly: everything is cached, and nothing is said.
    let out = run(imp(&["image", "pull", "-q", &image, "--state-dir"]).arg(&state));
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stderr(&out), "");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), digest);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn imp_run_whose_image_fails_shows_its_progress_then_why_with_code_125() {
    // The shim fails the image before it needs a kernel, a guest or root: stand-ins will do.
    let dir = scratch_dir("imp-cli-run-fails").unwrap();
    let image = layout_image(&dir);
    for f in ["vmlinux", "imp-guest"] {
        std::fs::write(dir.join(f), "not used").unwrap();
    }
    let out = run(imp(&[
        "run",
        "--rm",
        "--image-max-bytes",
        "1000",
        &image,
        "--state-dir",
    ])
    .arg(dir.join("state"))
    .env("IMP_KERNEL", dir.join("vmlinux"))
    .env("IMP_GUEST", dir.join("imp-guest"))
    .env("RUST_BACKTRACE", "1"));
    assert_eq!(out.status.code(), Some(125));
    assert_eq!(out.stdout, b"", "nothing on stdout");
    let err = stderr(&out);
    assert!(
        !err.chars().any(|c| c.is_control() && c != '\n'),
        "control characters in a pipe: {err:?}"
    );
    let lines: Vec<&str> = err.lines().collect();
    // The shim's progress, as plain lines, up to where it failed…
    assert!(
        lines[0].starts_with("imp: image ") && lines[0].contains("2 layers"),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("layer 1/2") && l.contains("copied")),
        "{err}"
    );
    assert!(
        lines.iter().any(|l| l.contains("verifying 2 layers")),
        "{err}"
    );
    assert!(!lines.iter().any(|l| l.contains("extracted")), "{err}");
    // …then one line saying what failed and why.
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("imp: building the root filesystem of oci:")
            && last.ends_with("layers exceed the limit of 1000 bytes"),
        "{err}"
    );
    assert!(!err.contains("backtrace"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn completions_offer_imps_commands_and_flags() {
    let script = |shell: &str| {
        let out = run(&mut imp(&["completion", shell]));
        assert_eq!(out.status.code(), Some(0), "{shell}");
        String::from_utf8(out.stdout).unwrap()
    };
    // bash: load the script and ask it, as the shell does on Tab.
    let bash = imp_testenv::guard::which("bash").unwrap();
    let complete = |words: &str, cword: usize| {
        let out = Command::new(&bash)
            .arg("-c")
            .arg(format!(
                "source /dev/stdin; COMP_WORDS=({words}); COMP_CWORD={cword}; \
                 _imp imp \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; \
                 echo \"${{COMPREPLY[@]}}\""
            ))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child
                    .stdin
                    .take()
                    .unwrap()
                    .write_all(script("bash").as_bytes())?;
                child.wait_with_output()
            })
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let got = complete("imp r", 1);
    assert_eq!(
        got.split_whitespace().collect::<Vec<_>>(),
        ["run", "rm", "resume"],
        "{got}"
    );
    let got = complete("imp ps --all", 2);
    assert!(got.contains("--all-namespaces"), "{got}");
    let got = complete("imp run --r", 2);
    for flag in ["--rm", "--runtime", "--raw-console"] {
        assert!(got.split_whitespace().any(|w| w == flag), "{flag}: {got}");
    }
    // zsh and fish: their scripts name the commands (each shell parses its own: the tests below).
    let zsh = script("zsh");
    assert!(zsh.starts_with("#compdef imp"), "{zsh}");
    let fish = script("fish");
    assert!(fish.contains("complete -c imp"), "{fish}");
    for (text, needle) in [(&zsh, "'version:"), (&fish, "-a \"version\"")] {
        assert!(text.contains(needle), "{needle}");
    }
}

/// Asks `shell` (found on PATH as `sh`) to parse `imp completion SHELL` without running it.
fn completion_parses(shell: &str, sh: &Path, check: &[&str]) {
    let out = run(&mut imp(&["completion", shell]));
    assert_eq!(out.status.code(), Some(0), "{shell}");
    let file = std::env::temp_dir().join(format!("imp-completion-{}.{shell}", std::process::id()));
    std::fs::write(&file, &out.stdout).unwrap();
    let parsed = Command::new(sh).args(check).arg(&file).output().unwrap();
    std::fs::remove_file(&file).unwrap();
    assert!(
        parsed.status.success(),
        "{shell} cannot parse its completion script: {}",
        String::from_utf8_lossy(&parsed.stderr)
    );
}

// Skips without the shell on a developer machine, fails under CI=true (scripts/setup installs it).
#[test]
fn zsh_parses_its_completion_script() {
    let zsh = imp_testenv::require_tool!("zsh");
    completion_parses("zsh", &zsh, &["-n"]);
}

#[test]
fn fish_parses_its_completion_script() {
    let fish = imp_testenv::require_tool!("fish");
    completion_parses("fish", &fish, &["--no-execute"]);
}

#[test]
fn committed_man_pages_match_the_cli() {
    let committed = workspace_root().join("docs/man");
    let dir = scratch_dir("imp-man").unwrap();
    let out = run(imp(&["man"]).arg(&dir));
    assert_eq!(out.status.code(), Some(0));
    let pages = |d: &Path| -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read_to_string(e.path()).unwrap_or_default(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let generated = pages(&dir);
    if std::env::var_os("IMP_UPDATE_MAN").is_some() {
        let _ = std::fs::remove_dir_all(&committed);
        std::fs::create_dir_all(&committed).unwrap();
        for (name, text) in &generated {
            std::fs::write(committed.join(name), text).unwrap();
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let names: Vec<&str> = generated.iter().map(|(n, _)| n.as_str()).collect();
    for page in [
        "imp.1",
        "imp-run.1",
        "imp-ps.1",
        "imp-version.1",
        "imp-image-pull.1",
    ] {
        assert!(names.contains(&page), "{page} in {names:?}");
    }
    assert!(
        !names
            .iter()
            .any(|n| n.contains("shim") || n.contains("-man")),
        "hidden commands get no page: {names:?}"
    );
    assert!(
        pages(&committed) == generated,
        "docs/man/ is stale: run `cargo run -p imp -- man docs/man` (or IMP_UPDATE_MAN=1 \
         cargo test -p imp --test cli committed_man_pages) and commit it"
    );
}

#[test]
fn version_names_the_commit_and_what_this_machine_runs_vms_with() {
    let dir = scratch_dir("imp-cli-version").unwrap();
    std::fs::write(
        dir.join("vmlinux"),
        b"\0\0Linux version 6.1.0-test (someone@somewhere) #1\0",
    )
    .unwrap();
    let out = run(imp(&["version", "--no-probe", "--state-dir"])
        .arg(dir.join("state"))
        .env("IMP_KERNEL", dir.join("vmlinux"))
        .env("IMP_GUEST", dir.join("missing-guest"))
        .env_remove("IMP_QEMU_ACCEL"));
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |name: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} line: {text}"))
            .trim()
            .to_owned()
    };
    let imp_line = field("imp");
    assert!(
        imp_line.starts_with(concat!(env!("CARGO_PKG_VERSION"), " (commit ")),
        "{imp_line}"
    );
    if let Ok(head) = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(workspace_root())
        .output()
        && head.status.success()
    {
        // The binary was built from this checkout (its HEAD may have moved since only if a
        // commit landed during the test run).
        let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
        assert!(imp_line.contains(&head), "{imp_line} vs HEAD {head}");
    }
    assert!(
        field("kernel").ends_with("(Linux 6.1.0-test)"),
        "{}",
        field("kernel")
    );
    assert!(field("guest init").contains("missing-guest"), "{text}");
    let qemu = field("qemu");
    match imp_testenv::guard::which("qemu-system-x86_64") {
        Some(_) => assert!(qemu.contains("QEMU emulator version"), "{qemu}"),
        None => assert!(qemu.starts_with("not found"), "{qemu}"),
    }
    assert!(!field("firecracker").is_empty());
    let kvm = field("kvm");
    assert!(
        kvm.starts_with("no:") || kvm.starts_with("unknown:") || kvm.starts_with("yes:"),
        "{kvm}"
    );
    assert_eq!(field("state"), dir.join("state").display().to_string());
    // IMP_QEMU_ACCEL decides without a probe, and says so.
    let out = run(imp(&["version", "--state-dir"])
        .arg(dir.join("state"))
        .env("IMP_QEMU_ACCEL", "tcg"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("IMP_QEMU_ACCEL=tcg chooses"));
    std::fs::remove_dir_all(&dir).unwrap();
}
