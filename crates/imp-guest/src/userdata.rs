//! The VM's user data ([`UserData`], parsed and checked by the node agent), applied as root
//! once the root disk is in place and before the workload starts: `write_files` (parent
//! directories created), then `users` (`/etc/passwd`, `/etc/group`, `/etc/shadow` when the
//! image has one, the home directory, `~/.ssh/authorized_keys`), then `runcmd` in order; or
//! the script, written to [`USER_DATA_SCRIPT`] (mode 0700) and executed.
//!
//! The first step that fails stops the rest and the boot: the init starts no workload and
//! ends the VM with the [`Failure`] on the console ([`imp_proto::marker`]) for the host.
//!
//! Files and accounts are written below a root directory (`/` in a VM) and commands run
//! through a [`Host`], so everything but the commands themselves is tested in a temporary
//! directory without being PID 1 or root.

use crate::reaper::Reaper;
use crate::user::{self, Identity};
use crate::workload::{self, Environment, ProcessSpec};
use base64::Engine as _;
use imp_proto::ExitStatus;
use imp_proto::config::{
    CloudConfig, ContentEncoding, DEFAULT_PATH, RunCommand, USER_DATA_SCRIPT, UserAccount,
    UserData, WriteFile,
};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread;
use std::time::Duration;

/// How much of a failed command's output its [`Failure`] keeps (its end).
pub const OUTPUT_TAIL_BYTES: usize = 512;

/// The first uid (and gid) given to accounts and groups without one.
pub const FIRST_UID: u32 = 1000;

/// The shell of an account that names none.
pub const DEFAULT_SHELL: &str = "/bin/sh";

/// Why user data stopped the boot: the step, and what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The step, e.g. `runcmd[1] (echo hi)`.
    pub step: String,
    /// What went wrong, e.g. `exited with code 2; output: ...`.
    pub why: String,
    /// The exit code the VM ends with (never 0): the command's, or 1.
    pub code: i32,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.step, self.why)
    }
}

/// How user data ended short of success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// A step failed.
    Failed(Failure),
    /// The VM was asked to shut down while a command ran; it ended with this status.
    ShutDown(ExitStatus),
}

/// What a command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    /// How it ended.
    pub status: ExitStatus,
    /// The end of its output (stdout and stderr together).
    pub tail: Vec<u8>,
    /// A shutdown was asked for while it ran (it was passed on to the command).
    pub shutdown: bool,
}

/// The side effects user data needs besides writing files: ownership and commands.
pub trait Host {
    /// Changes the owner of `path` (a path on this machine, below the root).
    fn chown(&mut self, path: &Path, uid: u32, gid: u32) -> io::Result<()>;
    /// Runs `argv` as root from the root directory, its output to the console.
    fn run(&mut self, argv: &[String]) -> io::Result<Ran>;
}

/// Applies `data` below `root`, stopping at the first step that fails.
pub fn apply(data: &UserData, root: &Path, host: &mut dyn Host) -> Result<(), Stopped> {
    match data {
        UserData::Script(text) => {
            let step = format!("script {USER_DATA_SCRIPT}");
            log(&step);
            write_script(root, text).map_err(|why| failed(&step, why))?;
            run_step(&step, &[USER_DATA_SCRIPT.to_owned()], host)
        }
        UserData::CloudConfig(c) => apply_cloud_config(c, root, host),
    }
}

fn apply_cloud_config(c: &CloudConfig, root: &Path, host: &mut dyn Host) -> Result<(), Stopped> {
    for (i, f) in c.write_files.iter().enumerate() {
        let step = format!("write_files[{i}] ({})", f.path);
        log(&step);
        write_file(root, f, host).map_err(|why| failed(&step, why))?;
    }
    for (i, u) in c.users.iter().enumerate() {
        let step = format!("users[{i}] ({})", u.name);
        log(&step);
        add_user(root, u, host).map_err(|why| failed(&step, why))?;
    }
    for (i, cmd) in c.runcmd.iter().enumerate() {
        let step = format!("runcmd[{i}] ({})", shown(cmd));
        log(&step);
        run_step(&step, &cmd.argv(), host)?;
    }
    Ok(())
}

fn log(step: &str) {
    eprintln!("imp-guest: userData: {step}");
}

fn failed(step: &str, why: String) -> Stopped {
    Stopped::Failed(Failure {
        step: step.to_owned(),
        why,
        code: 1,
    })
}

/// A command as its step names it: the shell text or the argv, at most 60 characters.
fn shown(cmd: &RunCommand) -> String {
    let text = match cmd {
        RunCommand::Shell(s) => s.clone(),
        RunCommand::Argv(a) => a.join(" "),
    };
    let mut short: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(60)
        .collect();
    if text.chars().count() > 60 {
        short.push('…');
    }
    short
}

fn run_step(step: &str, argv: &[String], host: &mut dyn Host) -> Result<(), Stopped> {
    let ran = host
        .run(argv)
        .map_err(|e| failed(step, format!("could not start: {e}")))?;
    if ran.shutdown {
        return Err(Stopped::ShutDown(ran.status));
    }
    let code = ran.status.code();
    if code == 0 {
        return Ok(());
    }
    let how = match ran.status {
        ExitStatus::Code(c) => format!("exited with code {c}"),
        ExitStatus::Signal(s) => format!("was killed by signal {s}"),
    };
    let text = String::from_utf8_lossy(&ran.tail);
    let output = match text.trim() {
        "" => "no output".to_owned(),
        t => format!("output: {t}"),
    };
    Err(Stopped::Failed(Failure {
        step: step.to_owned(),
        why: format!("{how}; {output}"),
        code,
    }))
}

/// `path` (absolute, in the guest) below `root`.
fn inside(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

fn read_or_empty(path: &Path) -> Result<String, String> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(format!("reading {}: {e}", path.display())),
    }
}

/// Writes one `write_files` entry: parents created, content, owner, then mode (a chown
/// clears set-id bits, so the mode comes last).
pub fn write_file(root: &Path, f: &WriteFile, host: &mut dyn Host) -> Result<(), String> {
    let bytes = match f.encoding {
        ContentEncoding::Text => f.content.as_bytes().to_vec(),
        ContentEncoding::Base64 => {
            let compact: String = f
                .content
                .chars()
                .filter(|c| !c.is_ascii_whitespace())
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(compact)
                .map_err(|e| format!("content is not valid base64: {e}"))?
        }
    };
    let path = inside(root, &f.path);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    }
    fs::write(&path, &bytes).map_err(|e| format!("writing {}: {e}", path.display()))?;
    if let Some(owner) = &f.owner {
        let passwd = read_or_empty(&root.join("etc/passwd"))?;
        let group = read_or_empty(&root.join("etc/group"))?;
        let id =
            user::resolve(owner, &passwd, &group).map_err(|e| format!("owner {owner:?}: {e}"))?;
        host.chown(&path, id.uid, id.gid)
            .map_err(|e| format!("giving {} to {owner}: {e}", path.display()))?;
    }
    fs::set_permissions(&path, fs::Permissions::from_mode(f.permissions))
        .map_err(|e| format!("setting the mode of {}: {e}", path.display()))
}

/// Writes the script to [`USER_DATA_SCRIPT`] below `root` (mode 0700, replacing one left by
/// an earlier boot); its path on this machine.
pub fn write_script(root: &Path, text: &str) -> Result<PathBuf, String> {
    let path = inside(root, USER_DATA_SCRIPT);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    }
    let _ = fs::remove_file(&path);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o700)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("setting the mode of {}: {e}", path.display()))?;
    Ok(path)
}

/// The fields of an `/etc/passwd` or `/etc/group` line.
fn fields(line: &str) -> Vec<&str> {
    line.split(':').collect()
}

/// The ids in field `at` of an account file's lines.
fn ids(file: &str, at: usize) -> BTreeSet<u32> {
    file.lines()
        .filter_map(|l| fields(l).get(at).and_then(|v| v.parse().ok()))
        .collect()
}

/// The first id from [`FIRST_UID`] not in `taken` (65534 is `nobody`'s everywhere).
fn free_id(taken: &BTreeSet<u32>) -> Result<u32, String> {
    (FIRST_UID..65534)
        .find(|id| !taken.contains(id))
        .ok_or_else(|| "no free id from 1000".to_owned())
}

/// The gid of group `name` in `/etc/group` text.
fn gid_of(group: &str, name: &str) -> Option<u32> {
    group.lines().find_map(|l| {
        let f = fields(l);
        (f.len() >= 3 && f[0] == name)
            .then(|| f[2].parse().ok())
            .flatten()
    })
}

/// `/etc/group` text with `user` a member of `name` (created with a free gid when missing).
pub fn with_member(group: &str, name: &str, user: &str) -> Result<String, String> {
    let mut out = String::with_capacity(group.len() + 64);
    let mut found = false;
    for line in group.lines() {
        let f = fields(line);
        if f.len() >= 3 && f[0] == name {
            found = true;
            let listed = f.get(3).copied().unwrap_or_default();
            let mut members: Vec<&str> = listed.split(',').filter(|m| !m.is_empty()).collect();
            if !members.contains(&user) {
                members.push(user);
            }
            out.push_str(&format!("{}:{}:{}:{}", f[0], f[1], f[2], members.join(",")));
            for extra in f.iter().skip(4) {
                out.push(':');
                out.push_str(extra);
            }
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    if !found {
        let gid = free_id(&ids(group, 2))?;
        out.push_str(&format!("{name}:x:{gid}:{user}\n"));
    }
    Ok(out)
}

/// Adds one `users` entry below `root`: an account that exists already keeps its ids and
/// home (only groups and keys are added); a new one gets a uid (given, or the first free from
/// 1000), a primary group of its name (gid = uid when free), `/etc/passwd` and, when the image
/// has one, a locked `/etc/shadow` line, and a home directory (0755) it owns.
pub fn add_user(root: &Path, u: &UserAccount, host: &mut dyn Host) -> Result<(), String> {
    let passwd_path = root.join("etc/passwd");
    let group_path = root.join("etc/group");
    let mut passwd = read_or_empty(&passwd_path)?;
    let mut group = read_or_empty(&group_path)?;
    let account = account(u, &mut passwd, &mut group)?;
    for g in &u.groups {
        group = with_member(&group, g, &u.name)?;
    }
    write_account_file(&group_path, &group)?;
    if account.created {
        write_account_file(&passwd_path, &passwd)?;
        add_locked_shadow_line(root, &u.name)?;
    }
    let home_dir = inside(root, &account.home);
    let ids = (account.uid, account.gid);
    if account.created && !home_dir.exists() {
        make_owned_dir(&home_dir, 0o755, ids, host)?;
    }
    if !u.ssh_authorized_keys.is_empty() {
        authorize_keys(&home_dir, u, ids, host)?;
    }
    Ok(())
}

/// The account a `users` entry ends up as.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Account {
    uid: u32,
    gid: u32,
    home: String,
    /// New: its passwd line (and maybe its group's) was added to the texts.
    created: bool,
}

/// The account for `u` in the `/etc/passwd` and `/etc/group` texts: the existing one (its
/// uid must match the one asked for), or a new one whose lines are appended to the texts.
fn account(u: &UserAccount, passwd: &mut String, group: &mut String) -> Result<Account, String> {
    let existing = passwd.lines().find_map(|l| {
        let f = fields(l);
        (f.len() >= 7 && f[0] == u.name).then(|| {
            (
                f[2].parse::<u32>().ok(),
                f[3].parse::<u32>().ok(),
                f[5].to_owned(),
            )
        })
    });
    match existing {
        Some((Some(uid), Some(gid), home)) => {
            if u.uid.is_some_and(|want| want != uid) {
                return Err(format!(
                    "user {} exists already with uid {uid}, not {}",
                    u.name,
                    u.uid.unwrap_or_default()
                ));
            }
            Ok(Account {
                uid,
                gid,
                home,
                created: false,
            })
        }
        Some(_) => Err(format!("the /etc/passwd line of {} is malformed", u.name)),
        None => new_account(u, passwd, group),
    }
}

/// A new account for `u`: the uid asked for (an error when taken) or the first free one, the
/// group of its name (created, with gid = uid when free), and its passwd line appended.
fn new_account(
    u: &UserAccount,
    passwd: &mut String,
    group: &mut String,
) -> Result<Account, String> {
    let taken = ids(passwd, 2);
    let uid = match u.uid {
        Some(uid) if taken.contains(&uid) => {
            let owner = passwd
                .lines()
                .map(fields)
                .find(|f| f.get(2).and_then(|v| v.parse().ok()) == Some(uid))
                .map(|f| f[0].to_owned())
                .unwrap_or_default();
            return Err(format!("uid {uid} is taken by {owner}"));
        }
        Some(uid) => uid,
        None => free_id(&taken)?,
    };
    let gid = match gid_of(group, &u.name) {
        Some(gid) => gid,
        None => {
            let taken = ids(group, 2);
            let gid = if taken.contains(&uid) {
                free_id(&taken)?
            } else {
                uid
            };
            push_line(group, &format!("{}:x:{gid}:", u.name));
            gid
        }
    };
    let home = u
        .homedir
        .clone()
        .unwrap_or_else(|| format!("/home/{}", u.name));
    let shell = u.shell.as_deref().unwrap_or(DEFAULT_SHELL);
    push_line(passwd, &format!("{}:x:{uid}:{gid}::{home}:{shell}", u.name));
    Ok(Account {
        uid,
        gid,
        home,
        created: true,
    })
}

/// Appends a locked `/etc/shadow` line for `name` when the image has that file.
fn add_locked_shadow_line(root: &Path, name: &str) -> Result<(), String> {
    let shadow_path = root.join("etc/shadow");
    if shadow_path.is_file() {
        let mut shadow = read_or_empty(&shadow_path)?;
        push_line(&mut shadow, &format!("{name}:!::0:99999:7:::"));
        write_account_file(&shadow_path, &shadow)?;
    }
    Ok(())
}

/// Adds the user's keys missing from `~/.ssh/authorized_keys` (the directory 0700 and the
/// file 0600, both the user's).
fn authorize_keys(
    home_dir: &Path,
    u: &UserAccount,
    (uid, gid): (u32, u32),
    host: &mut dyn Host,
) -> Result<(), String> {
    let ssh = home_dir.join(".ssh");
    if !ssh.exists() {
        make_owned_dir(&ssh, 0o700, (uid, gid), host)?;
    }
    let keys = ssh.join("authorized_keys");
    let mut text = read_or_empty(&keys)?;
    for k in &u.ssh_authorized_keys {
        if !text.lines().any(|l| l.trim() == k.trim()) {
            push_line(&mut text, k.trim());
        }
    }
    fs::write(&keys, text).map_err(|e| format!("writing {}: {e}", keys.display()))?;
    host.chown(&keys, uid, gid)
        .map_err(|e| format!("giving {} to {}: {e}", keys.display(), u.name))?;
    fs::set_permissions(&keys, fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("setting the mode of {}: {e}", keys.display()))
}

/// Appends `line` to account-file text, on a line of its own.
fn push_line(text: &mut String, line: &str) {
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
}

/// Rewrites an account file in place (its mode and owner kept; `/etc` created if missing).
fn write_account_file(path: &Path, text: &str) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    }
    fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn make_owned_dir(
    dir: &Path,
    mode: u32,
    (uid, gid): (u32, u32),
    host: &mut dyn Host,
) -> Result<(), String> {
    fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    host.chown(dir, uid, gid)
        .map_err(|e| format!("giving {} to uid {uid}: {e}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(mode))
        .map_err(|e| format!("setting the mode of {}: {e}", dir.display()))
}

/// The guest itself as the [`Host`]: real ownership changes, and commands spawned through
/// the [`Reaper`] with their output copied to the console (our stdout) while its end is kept
/// for a [`Failure`]. Signals the init receives while a command runs are passed on to it.
pub struct Guest<'a> {
    /// Spawns and waits for the commands.
    pub reaper: &'a Reaper,
    /// The root directory: the commands' working directory and where programs are found
    /// (`/` in a VM; in dev mode programs run by their paths in the guest, as the workload).
    pub root: PathBuf,
    /// The commands' environment (the workload's, as root).
    pub env: Environment,
    /// Signals for the running command, polled while it runs (a shutdown request as
    /// SIGTERM); SIGTERM and SIGINT mean the VM is to shut down.
    pub signals: &'a mut dyn FnMut() -> Option<Signal>,
}

/// How often a running command's exit and the init's signals are looked at when it is quiet.
const POLL_EVERY: Duration = Duration::from_millis(100);

impl Host for Guest<'_> {
    fn chown(&mut self, path: &Path, uid: u32, gid: u32) -> io::Result<()> {
        nix::unistd::chown(
            path,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
        )
        .map_err(io::Error::from)
    }

    fn run(&mut self, argv: &[String]) -> io::Result<Ran> {
        let first = argv
            .first()
            .ok_or_else(|| io::Error::other("an empty command"))?;
        let cwd = "/";
        let program = workload::find_program(
            first,
            self.env.get("PATH").unwrap_or(DEFAULT_PATH),
            &self.root,
            cwd,
        )
        .map_err(io::Error::other)?;
        let spec = ProcessSpec {
            program: program.display().to_string(),
            argv: argv.to_vec(),
            env: self.env.clone(),
            cwd: self.root.display().to_string(),
            // Root in a VM; in dev mode whoever runs the init.
            identity: Identity {
                uid: nix::unistd::geteuid().as_raw(),
                gid: nix::unistd::getegid().as_raw(),
                home: "/root".into(),
            },
        };
        let (mut output, writer) = io::pipe()?;
        let mut command = workload::command(&spec);
        command
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer);
        let (child, exit) = self.reaper.spawn(|| command.spawn())?;
        // Our copies of the pipe's write end go with the command.
        drop(command);
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(0));
        let mut tail = Vec::new();
        let mut shutdown = false;
        let mut open = true;
        let status = loop {
            while let Some(sig) = (self.signals)() {
                shutdown |= matches!(sig, Signal::SIGTERM | Signal::SIGINT);
                if pid.as_raw() > 0 {
                    let _ = kill(pid, sig);
                }
            }
            if !open {
                match exit.recv_timeout(POLL_EVERY) {
                    Ok(status) => break status,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(io::Error::other("the reaper dropped the command's status"));
                    }
                }
            }
            open = copy_ready(&mut output, POLL_EVERY, &mut tail)?;
            if let Some(status) = exited(&exit)? {
                break status;
            }
        };
        // What it wrote before it ended is in the pipe: read it all (no wait).
        while open && readable(&output, Duration::ZERO) {
            open = copy_ready(&mut output, Duration::ZERO, &mut tail)?;
        }
        if open {
            // Something it started in the background still holds the pipe: its output goes
            // on to the console until it closes it.
            relay(output);
        }
        Ok(Ran {
            status,
            tail,
            shutdown,
        })
    }
}

fn exited(exit: &Receiver<ExitStatus>) -> io::Result<Option<ExitStatus>> {
    match exit.try_recv() {
        Ok(s) => Ok(Some(s)),
        Err(std::sync::mpsc::TryRecvError::Empty) => Ok(None),
        Err(std::sync::mpsc::TryRecvError::Disconnected) => {
            Err(io::Error::other("the reaper dropped the command's status"))
        }
    }
}

fn readable(pipe: &io::PipeReader, wait: Duration) -> bool {
    let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX);
    matches!(poll(&mut fds, timeout), Ok(n) if n > 0)
}

/// Waits up to `wait` for output and copies what there is to the console, keeping the last
/// [`OUTPUT_TAIL_BYTES`] in `tail`; false once the pipe has ended.
fn copy_ready(pipe: &mut io::PipeReader, wait: Duration, tail: &mut Vec<u8>) -> io::Result<bool> {
    if !readable(pipe, wait) {
        return Ok(true);
    }
    let mut buf = [0u8; 4096];
    match pipe.read(&mut buf) {
        Ok(0) => Ok(false),
        Ok(n) => {
            let mut out = io::stdout().lock();
            let _ = out.write_all(&buf[..n]).and_then(|()| out.flush());
            tail.extend_from_slice(&buf[..n]);
            let excess = tail.len().saturating_sub(OUTPUT_TAIL_BYTES);
            tail.drain(..excess);
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
        Err(e) => Err(e),
    }
}

fn relay(mut pipe: io::PipeReader) {
    let spawned = thread::Builder::new()
        .name("userdata-output".into())
        .spawn(move || {
            let _ = io::copy(&mut pipe, &mut io::stdout());
        });
    if let Err(e) = spawned {
        eprintln!("imp-guest: userData: relaying background output failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_proto::config::CloudConfig;
    use std::os::unix::fs::MetadataExt;

    /// Records ownership changes and answers commands from a script.
    #[derive(Default)]
    struct Fake {
        chowns: Vec<(PathBuf, u32, u32)>,
        ran: Vec<Vec<String>>,
        outcomes: Vec<Ran>,
    }

    impl Host for Fake {
        fn chown(&mut self, path: &Path, uid: u32, gid: u32) -> io::Result<()> {
            self.chowns.push((path.to_path_buf(), uid, gid));
            Ok(())
        }

        fn run(&mut self, argv: &[String]) -> io::Result<Ran> {
            self.ran.push(argv.to_vec());
            Ok(if self.outcomes.is_empty() {
                Ran {
                    status: ExitStatus::Code(0),
                    tail: Vec::new(),
                    shutdown: false,
                }
            } else {
                self.outcomes.remove(0)
            })
        }
    }

    struct Root(PathBuf);

    impl Root {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "imp-userdata-{tag}-{}-{:?}",
                std::process::id(),
                thread::current().id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("etc")).unwrap();
            fs::write(
                dir.join("etc/passwd"),
                "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
            )
            .unwrap();
            fs::write(
                dir.join("etc/group"),
                "root:x:0:\napp:x:1000\nwheel:x:10:root\n",
            )
            .unwrap();
            Root(dir)
        }

        fn read(&self, path: &str) -> String {
            fs::read_to_string(inside(&self.0, path)).unwrap()
        }

        fn mode(&self, path: &str) -> u32 {
            fs::metadata(inside(&self.0, path)).unwrap().mode() & 0o7777
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn file(path: &str, content: &str) -> WriteFile {
        WriteFile {
            path: path.into(),
            content: content.into(),
            encoding: ContentEncoding::Text,
            permissions: 0o644,
            owner: None,
        }
    }

    #[test]
    fn files_are_written_with_their_parents_mode_and_owner() {
        let root = Root::new("files");
        let mut host = Fake::default();
        let mut conf = file("/etc/app/conf.d/app.conf", "mode=prod\n");
        conf.permissions = 0o600;
        conf.owner = Some("app:wheel".into());
        let mut tool = file("/usr/local/bin/tool", "IyEvYmluL3NoCmVjaG8g\naGkK\n");
        tool.encoding = ContentEncoding::Base64;
        tool.permissions = 0o755;
        let data = UserData::CloudConfig(CloudConfig {
            write_files: vec![conf, tool, file("/etc/motd", "")],
            ..Default::default()
        });
        apply(&data, &root.0, &mut host).unwrap();
        assert_eq!(root.read("/etc/app/conf.d/app.conf"), "mode=prod\n");
        assert_eq!(root.mode("/etc/app/conf.d/app.conf"), 0o600);
        assert_eq!(root.read("/usr/local/bin/tool"), "#!/bin/sh\necho hi\n");
        assert_eq!(root.mode("/usr/local/bin/tool"), 0o755);
        assert_eq!(root.read("/etc/motd"), "");
        assert_eq!(
            host.chowns,
            [(inside(&root.0, "/etc/app/conf.d/app.conf"), 1000, 10)]
        );
        assert!(host.ran.is_empty());
    }

    #[test]
    fn an_unknown_owner_stops_at_its_step() {
        let root = Root::new("owner");
        let mut host = Fake::default();
        let mut f = file("/etc/x", "x");
        f.owner = Some("ghost:ghost".into());
        let data = UserData::CloudConfig(CloudConfig {
            write_files: vec![f],
            runcmd: vec![RunCommand::Shell("echo never".into())],
            ..Default::default()
        });
        let Err(Stopped::Failed(failure)) = apply(&data, &root.0, &mut host) else {
            panic!("expected a failure")
        };
        assert_eq!(failure.step, "write_files[0] (/etc/x)");
        assert!(
            failure.why.contains("User \"ghost\" is not in /etc/passwd"),
            "{failure}"
        );
        assert_eq!(failure.code, 1);
        assert!(host.ran.is_empty(), "nothing runs after a failed step");
    }

    #[test]
    fn users_are_added_with_group_home_and_keys() {
        let root = Root::new("users");
        fs::write(inside(&root.0, "/etc/shadow"), "root:*::0:::::\n").unwrap();
        let mut host = Fake::default();
        let data = UserData::CloudConfig(CloudConfig {
            users: vec![
                UserAccount {
                    name: "alice".into(),
                    groups: vec!["wheel".into(), "docker".into()],
                    ssh_authorized_keys: vec!["ssh-ed25519 AAAA alice@x".into()],
                    ..Default::default()
                },
                UserAccount {
                    name: "bob".into(),
                    uid: Some(2000),
                    shell: Some("/bin/ash".into()),
                    homedir: Some("/srv/bob".into()),
                    ..Default::default()
                },
                // An existing account keeps its ids; it only gains groups and keys.
                UserAccount {
                    name: "app".into(),
                    groups: vec!["wheel".into()],
                    ssh_authorized_keys: vec!["ssh-rsa BBBB app@x".into()],
                    ..Default::default()
                },
            ],
            ..Default::default()
        });
        apply(&data, &root.0, &mut host).unwrap();
        assert_eq!(
            root.read("/etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\n\
             app:x:1000:1000::/home/app:/bin/sh\n\
             alice:x:1001:1001::/home/alice:/bin/sh\n\
             bob:x:2000:2000::/srv/bob:/bin/ash\n"
        );
        assert_eq!(
            root.read("/etc/group"),
            "root:x:0:\n\
             app:x:1000\n\
             wheel:x:10:root,alice,app\n\
             alice:x:1001:\n\
             docker:x:1002:alice\n\
             bob:x:2000:\n"
        );
        assert_eq!(
            root.read("/etc/shadow"),
            "root:*::0:::::\nalice:!::0:99999:7:::\nbob:!::0:99999:7:::\n"
        );
        assert_eq!(
            root.read("/home/alice/.ssh/authorized_keys"),
            "ssh-ed25519 AAAA alice@x\n"
        );
        assert_eq!(root.mode("/home/alice"), 0o755);
        assert_eq!(root.mode("/home/alice/.ssh"), 0o700);
        assert_eq!(root.mode("/home/alice/.ssh/authorized_keys"), 0o600);
        assert!(inside(&root.0, "/srv/bob").is_dir());
        assert_eq!(
            root.read("/home/app/.ssh/authorized_keys"),
            "ssh-rsa BBBB app@x\n"
        );
        let owned = |p: &str| {
            host.chowns
                .iter()
                .find(|(path, ..)| path == &inside(&root.0, p))
                .map(|(_, u, g)| (*u, *g))
        };
        assert_eq!(owned("/home/alice"), Some((1001, 1001)));
        assert_eq!(owned("/home/alice/.ssh"), Some((1001, 1001)));
        assert_eq!(
            owned("/home/alice/.ssh/authorized_keys"),
            Some((1001, 1001))
        );
        assert_eq!(owned("/srv/bob"), Some((2000, 2000)));
        assert_eq!(owned("/home/app/.ssh/authorized_keys"), Some((1000, 1000)));
        assert_eq!(
            owned("/home/app"),
            None,
            "an existing account's home is left alone"
        );

        // Applied again (a restart with the same disk): nothing is added twice.
        let mut again = Fake::default();
        let UserData::CloudConfig(c) = &data else {
            unreachable!()
        };
        let data = UserData::CloudConfig(CloudConfig {
            users: c.users[..1].to_vec(),
            ..Default::default()
        });
        apply(&data, &root.0, &mut again).unwrap();
        let passwd = root.read("/etc/passwd");
        assert_eq!(
            passwd.lines().filter(|l| l.starts_with("alice:")).count(),
            1
        );
        assert_eq!(root.read("/etc/group").matches("alice").count(), 3);
        assert_eq!(
            root.read("/home/alice/.ssh/authorized_keys"),
            "ssh-ed25519 AAAA alice@x\n"
        );
    }

    #[test]
    fn a_new_account_takes_the_next_free_gid_when_its_uid_is_a_group_id() {
        let mut passwd = "root:x:0:0:root:/root:/bin/sh\n".to_owned();
        let mut group = "root:x:0:\nstaff:x:1000:\n".to_owned();
        let u = UserAccount {
            name: "carol".into(),
            ..Default::default()
        };
        let account = account(&u, &mut passwd, &mut group).unwrap();
        assert_eq!(
            account,
            Account {
                uid: 1000,
                gid: 1001,
                home: "/home/carol".into(),
                created: true,
            }
        );
        assert_eq!(
            passwd,
            "root:x:0:0:root:/root:/bin/sh\ncarol:x:1000:1001::/home/carol:/bin/sh\n"
        );
        assert_eq!(group, "root:x:0:\nstaff:x:1000:\ncarol:x:1001:\n");
    }

    #[test]
    fn an_existing_account_keeps_its_ids_and_leaves_the_texts_alone() {
        let before = "app:x:1000:1000::/srv/app:/bin/sh\n";
        let (mut passwd, mut group) = (before.to_owned(), String::new());
        let u = UserAccount {
            name: "app".into(),
            uid: Some(1000),
            ..Default::default()
        };
        let account = account(&u, &mut passwd, &mut group).unwrap();
        assert_eq!(
            (account.uid, account.gid, account.created),
            (1000, 1000, false)
        );
        assert_eq!(account.home, "/srv/app");
        assert_eq!((passwd.as_str(), group.as_str()), (before, ""));

        let other_uid = UserAccount {
            uid: Some(1001),
            ..u.clone()
        };
        let err = super::account(&other_uid, &mut passwd, &mut group).unwrap_err();
        assert_eq!(err, "user app exists already with uid 1000, not 1001");

        let mut malformed = "app:x:oops:1000::/srv/app:/bin/sh\n".to_owned();
        let err = super::account(&u, &mut malformed, &mut group).unwrap_err();
        assert_eq!(err, "the /etc/passwd line of app is malformed");
    }

    #[test]
    fn a_taken_uid_is_refused() {
        let root = Root::new("uid");
        let data = UserData::CloudConfig(CloudConfig {
            users: vec![UserAccount {
                name: "eve".into(),
                uid: Some(1000),
                ..Default::default()
            }],
            ..Default::default()
        });
        let Err(Stopped::Failed(f)) = apply(&data, &root.0, &mut Fake::default()) else {
            panic!("expected a failure")
        };
        assert_eq!(f.to_string(), "users[0] (eve): uid 1000 is taken by app");
    }

    #[test]
    fn commands_run_in_order_and_the_first_failure_stops_the_boot() {
        let root = Root::new("runcmd");
        let mut host = Fake {
            outcomes: vec![
                Ran {
                    status: ExitStatus::Code(0),
                    tail: b"ok\n".to_vec(),
                    shutdown: false,
                },
                Ran {
                    status: ExitStatus::Code(3),
                    tail: b"cp: can't stat '/nope'\n".to_vec(),
                    shutdown: false,
                },
            ],
            ..Default::default()
        };
        let data = UserData::CloudConfig(CloudConfig {
            runcmd: vec![
                RunCommand::Shell("echo ok".into()),
                RunCommand::Argv(vec!["cp".into(), "/nope".into(), "/x".into()]),
                RunCommand::Shell("echo never".into()),
            ],
            ..Default::default()
        });
        let Err(Stopped::Failed(f)) = apply(&data, &root.0, &mut host) else {
            panic!("expected a failure")
        };
        assert_eq!(
            host.ran,
            [
                vec!["/bin/sh".to_owned(), "-c".into(), "echo ok".into()],
                vec!["cp".to_owned(), "/nope".into(), "/x".into()],
            ]
        );
        assert_eq!(
            f,
            Failure {
                step: "runcmd[1] (cp /nope /x)".into(),
                why: "exited with code 3; output: cp: can't stat '/nope'".into(),
                code: 3,
            }
        );
    }

    #[test]
    fn a_script_is_written_0700_and_run_and_a_shutdown_is_no_failure() {
        let root = Root::new("script");
        let mut host = Fake {
            outcomes: vec![Ran {
                status: ExitStatus::Signal(15),
                tail: Vec::new(),
                shutdown: true,
            }],
            ..Default::default()
        };
        let data = UserData::Script("#!/bin/sh\necho hi\n".into());
        assert_eq!(
            apply(&data, &root.0, &mut host),
            Err(Stopped::ShutDown(ExitStatus::Signal(15)))
        );
        assert_eq!(root.read(USER_DATA_SCRIPT), "#!/bin/sh\necho hi\n");
        assert_eq!(root.mode(USER_DATA_SCRIPT), 0o700);
        assert_eq!(host.ran, [vec![USER_DATA_SCRIPT.to_owned()]]);
    }

    #[test]
    fn commands_really_run_with_their_output_on_the_console_and_its_tail_kept() {
        let reaper = Reaper::start(crate::reaper::Reaping::Own).unwrap();
        let mut env = Environment::default();
        env.set("PATH", DEFAULT_PATH);
        let mut no_signals = || None;
        let mut guest = Guest {
            reaper: &reaper,
            root: PathBuf::from("/"),
            env,
            signals: &mut no_signals,
        };
        let ran = guest
            .run(&RunCommand::Shell("echo out; echo err >&2; exit 4".into()).argv())
            .unwrap();
        assert_eq!(ran.status, ExitStatus::Code(4));
        assert_eq!(String::from_utf8_lossy(&ran.tail), "out\nerr\n");
        // A background process holding the output open does not hold up the step.
        let ran = guest
            .run(&RunCommand::Shell("sleep 5 & echo started".into()).argv())
            .unwrap();
        assert_eq!(ran.status, ExitStatus::Code(0));
        assert_eq!(String::from_utf8_lossy(&ran.tail), "started\n");
        let long = guest
            .run(&RunCommand::Shell("head -c 5000 /dev/zero | tr '\\0' x; exit 1".into()).argv())
            .unwrap();
        assert_eq!(long.tail.len(), OUTPUT_TAIL_BYTES);
        let err = guest.run(&["no-such-program".to_owned()]).unwrap_err();
        assert!(err.to_string().contains("not found in PATH"), "{err}");
    }
}
