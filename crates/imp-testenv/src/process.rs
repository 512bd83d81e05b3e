//! The control plane's child processes: started from one thread that lives as long as the test
//! process, each with `PR_SET_PDEATHSIG(SIGKILL)`, so etcd and kube-apiserver die with the test
//! binary however it ends (a panic, the watchdog's `exit`, a SIGKILL), even when the control
//! plane is a `static` that is never dropped. The kernel sends the signal when the *thread*
//! that forked the child ends, hence the one long-lived spawner thread. Output goes to a log
//! file, never to the test's own stdout (a leaked pipe would hold `cargo test`'s reader open).
#![allow(unsafe_code)] // pre_exec is how a child asks to die with its parent

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

/// A request to the spawner thread: the command and where to send the child back.
type Request = (Command, mpsc::Sender<std::io::Result<Child>>);

/// The spawner thread's inbox.
static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();

fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("imp-testenv-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| eprintln!("imp-testenv: cannot start the spawner thread: {e}"));
        Mutex::new(tx)
    })
}

/// A running child with its log file; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Proc {
    /// What it is ("etcd", "kube-apiserver" …), for messages.
    pub name: &'static str,
    child: Child,
    log: PathBuf,
}

/// Starts `cmd` as `name`, its stdout and stderr appended to `log`.
pub fn start(name: &'static str, mut cmd: Command, log: &Path) -> std::io::Result<Proc> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2) and
    // getppid(2), which are async-signal-safe; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() == 1 {
                // The test process is already gone.
                return Err(std::io::Error::other("the test process has exited"));
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .map_err(|_| std::io::Error::other("the spawner's lock is poisoned"))?
        .send((cmd, tx))
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    let child = rx
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))??;
    Ok(Proc {
        name,
        child,
        log: log.to_path_buf(),
    })
}

impl Proc {
    /// Its exit status if it has ended.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `lines` lines of file `path` ("" when it cannot be read).
pub fn tail(path: &Path, lines: usize) -> String {
    let all = std::fs::read(path).unwrap_or_default();
    let all = String::from_utf8_lossy(&all);
    let v: Vec<&str> = all.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}
