//! What the workload runs as: argv from ENTRYPOINT/CMD and overrides, the environment
//! (image `Env`, then the VM's, with a default PATH), the working directory and the user.
//! Exec'd commands start from the same environment, so bare names resolve as in the workload.

use crate::user::{self, Identity, UserError};
use imp_proto::EnvVar;
use imp_proto::config::{DEFAULT_PATH, GuestConfig};
use nix::sys::signal::SigSet;
use nix::unistd::{getegid, geteuid};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why the workload (or an exec) could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// Nothing to run.
    #[error("No command to run: the image has no ENTRYPOINT or CMD and none was given")]
    NoCommand,
    /// The user could not be resolved.
    #[error("Resolving the user to run as failed")]
    User(#[from] UserError),
    /// The program is not on PATH.
    #[error("Command {program:?} not found in PATH={path}")]
    NotFound {
        /// The bare name.
        program: String,
        /// The PATH searched.
        path: String,
    },
    /// An exec asked for nothing.
    #[error("Exec request has an empty argv")]
    EmptyArgv,
    /// The working directory does not exist.
    #[error("Working directory {0} does not exist")]
    NoWorkingDir(String),
    /// The program path does not exist.
    #[error("Command {0} does not exist")]
    Missing(String),
    /// The program is not an executable file.
    #[error("Command {0} is not an executable file")]
    NotExecutable(String),
}

/// An ordered environment where setting a name again replaces it in place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment(Vec<(String, String)>);

impl Environment {
    /// Sets a variable, replacing an earlier value.
    pub fn set(&mut self, name: &str, value: &str) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value.to_string(),
            None => self.0.push((name.to_string(), value.to_string())),
        }
    }

    /// Sets a variable only if it is not set yet.
    pub fn set_default(&mut self, name: &str, value: &str) {
        if self.get(name).is_none() {
            self.0.push((name.to_string(), value.to_string()));
        }
    }

    /// A variable's value.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Applies `EnvVar`s in order.
    pub fn apply(&mut self, vars: &[EnvVar]) {
        for v in vars {
            self.set(&v.name, &v.value);
        }
    }

    /// The variables in order.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

/// A fully prepared process: what to run, with what, where and as whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSpec {
    /// The program's resolved path.
    pub program: String,
    /// The arguments as given, `argv[0]` included.
    pub argv: Vec<String>,
    /// The complete environment.
    pub env: Environment,
    /// The working directory.
    pub cwd: String,
    /// The identity.
    pub identity: Identity,
}

/// The workload's argv ([`GuestConfig::argv`]), or why there is none.
pub fn argv(config: &GuestConfig) -> Result<Vec<String>, WorkloadError> {
    config.argv().ok_or(WorkloadError::NoCommand)
}

/// The workload's environment: image `Env`, then the VM's env, then defaults for what is
/// still unset (PATH, HOME, HOSTNAME).
pub fn environment(config: &GuestConfig, identity: &Identity) -> Environment {
    let mut env = Environment::default();
    for entry in &config.image.env {
        if let Some((name, value)) = entry.split_once('=') {
            env.set(name, value);
        }
    }
    env.apply(&config.env);
    env.set_default("PATH", DEFAULT_PATH);
    env.set_default("HOME", &identity.home);
    if let Some(h) = &config.hostname {
        env.set_default("HOSTNAME", h);
    }
    env
}

/// Prepares the workload from the config, resolving the user inside `root`.
pub fn prepare(config: &GuestConfig, root: &Path) -> Result<ProcessSpec, WorkloadError> {
    let identity = user::resolve_in(root, config.image.user.as_deref())?;
    let env = environment(config, &identity);
    let cwd = config
        .image
        .working_dir
        .clone()
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "/".into());
    let argv = argv(config)?;
    check_dir(root, &cwd)?;
    let program = find_program(
        &argv[0],
        env.get("PATH").unwrap_or(DEFAULT_PATH),
        root,
        &cwd,
    )?
    .display()
    .to_string();
    Ok(ProcessSpec {
        program,
        argv,
        env,
        cwd,
        identity,
    })
}

/// Checks that a working directory exists, for a clearer error than the spawn's ENOENT.
pub fn check_dir(root: &Path, cwd: &str) -> Result<(), WorkloadError> {
    if root.join(cwd.trim_start_matches('/')).is_dir() {
        Ok(())
    } else {
        Err(WorkloadError::NoWorkingDir(cwd.to_string()))
    }
}

/// The `Command` that starts a prepared process (stdio is left to the caller).
pub fn command(spec: &ProcessSpec) -> Command {
    let mut c = Command::new(&spec.program);
    if let Some(arg0) = spec.argv.first() {
        c.arg0(arg0);
    }
    c.args(spec.argv.iter().skip(1))
        .env_clear()
        .current_dir(&spec.cwd);
    for (name, value) in spec.env.vars() {
        c.env(name, value);
    }
    // Switching identity needs privilege; skip it when we already are that identity (tests).
    if spec.identity.uid != geteuid().as_raw() || spec.identity.gid != getegid().as_raw() {
        c.uid(spec.identity.uid).gid(spec.identity.gid);
    }
    clear_signal_mask(&mut c);
    c
}

/// The init blocks SIGTERM/SIGINT/SIGHUP to take them in one thread, and std's spawn keeps a
/// blocked mask across exec: unblock everything in the child so it can be signalled.
#[allow(unsafe_code)]
fn clear_signal_mask(c: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and only calls
    // pthread_sigmask(2) on a stack-local empty set, which is async-signal-safe.
    unsafe {
        c.pre_exec(|| {
            SigSet::empty()
                .thread_set_mask()
                .map_err(std::io::Error::from)
        });
    }
}

/// Finds a program like `execvp` would with the given PATH, but reports why it failed.
///
/// Paths are interpreted inside `root` (the guest's `/`, or a test directory) but returned as
/// the guest sees them.
pub fn find_program(
    program: &str,
    path: &str,
    root: &Path,
    cwd: &str,
) -> Result<PathBuf, WorkloadError> {
    let inside = |p: &Path| -> PathBuf {
        let rel = p.strip_prefix("/").unwrap_or(p);
        root.join(rel)
    };
    let check = |guest_path: PathBuf| -> Result<PathBuf, WorkloadError> {
        let host = inside(&guest_path);
        match std::fs::metadata(&host) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok(guest_path),
            Ok(_) => Err(WorkloadError::NotExecutable(
                guest_path.display().to_string(),
            )),
            Err(_) => Err(WorkloadError::Missing(guest_path.display().to_string())),
        }
    };
    if program.contains('/') {
        let p = Path::new(program);
        return check(if p.is_absolute() {
            p.to_path_buf()
        } else {
            Path::new(cwd).join(p)
        });
    }
    let mut not_executable = None;
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        match check(Path::new(dir).join(program)) {
            Ok(found) => return Ok(found),
            Err(e @ WorkloadError::NotExecutable(_)) => not_executable = not_executable.or(Some(e)),
            Err(_) => {}
        }
    }
    Err(not_executable.unwrap_or_else(|| WorkloadError::NotFound {
        program: program.to_string(),
        path: path.to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_proto::config::ImageConfig;
    use std::fs;

    fn config(entrypoint: &[&str], cmd: &[&str]) -> GuestConfig {
        GuestConfig {
            image: ImageConfig {
                entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn strings(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn argv_is_entrypoint_then_cmd() {
        assert_eq!(
            argv(&config(&["/bin/app"], &["--serve"])).unwrap(),
            strings(&["/bin/app", "--serve"])
        );
        assert_eq!(argv(&config(&[], &["sh"])).unwrap(), strings(&["sh"]));
    }

    #[test]
    fn overrides_follow_pod_command_and_args() {
        let mut c = config(&["/bin/app"], &["--serve"]);
        c.args = Some(strings(&["--once"]));
        assert_eq!(argv(&c).unwrap(), strings(&["/bin/app", "--once"]));
        c.command = Some(strings(&["/bin/other"]));
        assert_eq!(argv(&c).unwrap(), strings(&["/bin/other", "--once"]));
        c.args = None;
        assert_eq!(
            argv(&c).unwrap(),
            strings(&["/bin/other"]),
            "command drops the image CMD"
        );
    }

    #[test]
    fn no_command_at_all_is_an_error() {
        assert!(matches!(
            argv(&config(&[], &[])),
            Err(WorkloadError::NoCommand)
        ));
    }

    #[test]
    fn path_defaults_unless_the_image_or_vm_sets_it() {
        let id = Identity::root();
        let env = environment(&config(&["x"], &[]), &id);
        assert_eq!(env.get("PATH"), Some(DEFAULT_PATH));
        assert_eq!(env.get("HOME"), Some("/root"));

        let mut c = config(&["x"], &[]);
        c.image.env = strings(&["PATH=/app/bin", "A=1", "B=x=y"]);
        let env = environment(&c, &id);
        assert_eq!(env.get("PATH"), Some("/app/bin"));
        assert_eq!(env.get("B"), Some("x=y"));

        c.env = vec![
            EnvVar::new("A", "2"),
            EnvVar::new("PATH", "/vm"),
            EnvVar::new("HOME", "/h"),
        ];
        c.hostname = Some("vm1".into());
        let env = environment(&c, &id);
        let vars: Vec<_> = env.vars().collect();
        assert_eq!(
            vars,
            vec![
                ("PATH", "/vm"),
                ("A", "2"),
                ("B", "x=y"),
                ("HOME", "/h"),
                ("HOSTNAME", "vm1")
            ],
            "VM env overrides the image in place; defaults fill the rest"
        );
    }

    fn fake_root() -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "imp-workload-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&root);
        for d in ["usr/bin", "bin", "app", "etc"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        for (f, mode) in [
            ("usr/bin/tool", 0o755),
            ("bin/data", 0o644),
            ("app/run", 0o700),
        ] {
            fs::write(root.join(f), "#!/bin/sh\n").unwrap();
            fs::set_permissions(root.join(f), fs::Permissions::from_mode(mode)).unwrap();
        }
        fs::write(
            root.join("etc/passwd"),
            "app:x:1000:1000::/home/app:/bin/sh\n",
        )
        .unwrap();
        root
    }

    #[test]
    fn programs_are_found_on_the_workload_path_with_clear_failures() {
        let root = fake_root();
        let path = "/usr/local/bin:/usr/bin:/bin";
        assert_eq!(
            find_program("tool", path, &root, "/").unwrap(),
            PathBuf::from("/usr/bin/tool")
        );
        assert_eq!(
            find_program("./run", path, &root, "/app").unwrap(),
            PathBuf::from("/app/run")
        );
        let err = find_program("nope", path, &root, "/").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("Command \"nope\" not found in PATH={path}")
        );
        let err = find_program("data", path, &root, "/").unwrap_err();
        assert_eq!(
            err.to_string(),
            "Command /bin/data is not an executable file"
        );
        let err = find_program("/bin/missing", path, &root, "/").unwrap_err();
        assert_eq!(err.to_string(), "Command /bin/missing does not exist");
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn children_start_with_no_blocked_signals() {
        let mut blocked = SigSet::empty();
        blocked.add(nix::sys::signal::Signal::SIGUSR2);
        // Block in a scratch thread only, so other tests are unaffected.
        let out = std::thread::spawn(move || {
            blocked.thread_block().unwrap();
            let spec = ProcessSpec {
                program: "/bin/grep".into(),
                argv: strings(&["grep", "SigBlk", "/proc/self/status"]),
                env: Environment::default(),
                cwd: "/".into(),
                identity: Identity {
                    uid: geteuid().as_raw(),
                    gid: getegid().as_raw(),
                    home: "/".into(),
                },
            };
            command(&spec).output().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "SigBlk:\t0000000000000000"
        );
    }

    #[test]
    fn a_missing_working_dir_is_named() {
        let root = fake_root();
        let mut c = config(&["tool"], &[]);
        c.image.working_dir = Some("/nowhere".into());
        let err = prepare(&c, &root).unwrap_err();
        assert_eq!(err.to_string(), "Working directory /nowhere does not exist");
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn prepare_puts_it_all_together() {
        let root = fake_root();
        let mut c = config(&["tool"], &["arg"]);
        c.image.user = Some("app".into());
        c.image.working_dir = Some("/app".into());
        let spec = prepare(&c, &root).unwrap();
        assert_eq!(spec.program, "/usr/bin/tool");
        assert_eq!(spec.argv, strings(&["tool", "arg"]));
        assert_eq!(spec.cwd, "/app");
        assert_eq!((spec.identity.uid, spec.identity.gid), (1000, 1000));
        assert_eq!(spec.env.get("HOME"), Some("/home/app"));
        fs::remove_dir_all(root).unwrap();
    }
}
