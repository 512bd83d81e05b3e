//! Waiting for children. As PID 1 the guest must reap every zombie (orphans are re-parented
//! to it), yet the workload's and each exec's exit status must still reach whoever started
//! them: one thread calls `waitpid(-1)` and hands each status to the waiter registered for
//! that pid. Registration happens under the same lock as the spawn, so no status can arrive
//! for a pid nobody is waiting on yet.

use imp_proto::ExitStatus;
use nix::errno::Errno;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use std::collections::HashMap;
use std::io;
use std::process::Child;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

/// How children are waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaping {
    /// Reap every child of the process (PID 1, or the guest binary in dev mode).
    All,
    /// Wait only for the children spawned here (inside a test harness with other children).
    Own,
}

#[derive(Default)]
struct Shared {
    waiters: Mutex<HashMap<i32, Sender<ExitStatus>>>,
    spawned: Condvar,
}

/// Spawns children and delivers their exit statuses.
#[derive(Clone)]
pub struct Reaper {
    mode: Reaping,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

fn status_of(ws: WaitStatus) -> Option<(i32, ExitStatus)> {
    match ws {
        WaitStatus::Exited(pid, code) => Some((pid.as_raw(), ExitStatus::Code(code))),
        WaitStatus::Signaled(pid, sig, _) => Some((pid.as_raw(), ExitStatus::Signal(sig as i32))),
        _ => None,
    }
}

impl Reaper {
    /// Starts reaping; with [`Reaping::All`] a background thread reaps for the whole process.
    pub fn start(mode: Reaping) -> io::Result<Self> {
        let reaper = Self {
            mode,
            shared: Arc::new(Shared::default()),
        };
        if mode == Reaping::All {
            let shared = Arc::clone(&reaper.shared);
            thread::Builder::new()
                .name("reaper".into())
                .spawn(move || reap_all(&shared))?;
        }
        Ok(reaper)
    }

    /// Runs `spawn` and registers the child before any status for it can be handed out.
    pub fn spawn(
        &self,
        spawn: impl FnOnce() -> io::Result<Child>,
    ) -> io::Result<(Child, Receiver<ExitStatus>)> {
        let (tx, rx) = mpsc::channel();
        let mut waiters = self
            .shared
            .waiters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let child = spawn()?;
        let pid = child.id() as i32;
        match self.mode {
            Reaping::All => {
                waiters.insert(pid, tx);
                self.shared.spawned.notify_all();
            }
            Reaping::Own => {
                thread::Builder::new()
                    .name(format!("wait-{pid}"))
                    .spawn(move || {
                        loop {
                            match waitpid(Pid::from_raw(pid), None) {
                                Err(Errno::EINTR) => continue,
                                Ok(ws) => match status_of(ws) {
                                    Some((_, status)) => {
                                        let _ = tx.send(status);
                                        return;
                                    }
                                    None => continue,
                                },
                                Err(_) => return,
                            }
                        }
                    })?;
            }
        }
        Ok((child, rx))
    }
}

fn reap_all(shared: &Shared) {
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(ws) => {
                if let Some((pid, status)) = status_of(ws) {
                    let waiter = shared
                        .waiters
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&pid);
                    if let Some(tx) = waiter {
                        let _ = tx.send(status);
                    }
                }
            }
            Err(Errno::EINTR) => {}
            Err(_) => {
                // ECHILD: no children now. Sleep until one is spawned, or a while, since
                // orphans re-parented to PID 1 arrive without a spawn.
                let waiters = shared
                    .waiters
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let _ = shared
                    .spawned
                    .wait_timeout(waiters, Duration::from_millis(500));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn own_children_deliver_codes_and_signals() {
        let reaper = Reaper::start(Reaping::Own).unwrap();
        let (_c, rx) = reaper
            .spawn(|| Command::new("sh").args(["-c", "exit 3"]).spawn())
            .unwrap();
        assert_eq!(rx.recv().unwrap(), ExitStatus::Code(3));
        let (_c, rx) = reaper
            .spawn(|| Command::new("sh").args(["-c", "kill -9 $$"]).spawn())
            .unwrap();
        assert_eq!(rx.recv().unwrap(), ExitStatus::Signal(9));
    }

    #[test]
    fn a_failed_spawn_is_an_error_not_a_hang() {
        let reaper = Reaper::start(Reaping::Own).unwrap();
        assert!(
            reaper
                .spawn(|| Command::new("/nonexistent/program").spawn())
                .is_err()
        );
    }
}
