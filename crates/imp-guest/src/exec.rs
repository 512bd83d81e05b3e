//! One exec: a command started for the host and streamed over the connection that asked for
//! it. The output thread forwards stdout/stderr (or the TTY) as it is produced and ends with
//! the exit status; the input thread forwards stdin, resizes and signals. The host hanging up
//! kills the command, so no exec outlives its caller.

use crate::pty;
use crate::reaper::Reaper;
use crate::transport::Connection;
use crate::user;
use crate::workload::{self, Environment, ProcessSpec, WorkloadError};
use imp_proto::config::DEFAULT_PATH;
use imp_proto::frame::{DATA_CHUNK, FrameError, read_frame, write_frame};
use imp_proto::{ErrorKind, ExecRequest, ExitStatus, Message, WindowSize};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::thread;
use std::time::{Duration, Instant};

/// How long output may still drain after the command exited (a background child may hold
/// the pipe or TTY open forever).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// Why an exec session ended abnormally (the host has been told when it could be).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// Talking to the host failed.
    #[error("Exec session I/O with the host failed")]
    Frame(#[from] FrameError),
    /// A local resource (pipe, pty, thread, poll) failed.
    #[error("Exec session failed while {action}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// What an exec inherits from the workload unless the request says otherwise.
#[derive(Debug, Clone)]
pub struct ExecDefaults {
    /// The workload's environment (so PATH is the workload's).
    pub env: Environment,
    /// The workload's working directory.
    pub cwd: String,
    /// The workload's user spec.
    pub user: Option<String>,
    /// The guest's root, where /etc/passwd and programs are looked up.
    pub root: PathBuf,
}

/// Prepares an exec from a request over the workload's defaults.
pub fn prepare(
    request: &ExecRequest,
    defaults: &ExecDefaults,
) -> Result<ProcessSpec, WorkloadError> {
    let first = request.argv.first().ok_or(WorkloadError::EmptyArgv)?;
    let identity = user::resolve_in(
        &defaults.root,
        request.user.as_deref().or(defaults.user.as_deref()),
    )?;
    let mut env = defaults.env.clone();
    env.apply(&request.env);
    if request.tty {
        env.set_default("TERM", "xterm");
    }
    let cwd = request.cwd.clone().unwrap_or_else(|| defaults.cwd.clone());
    workload::check_dir(&defaults.root, &cwd)?;
    let path = env.get("PATH").unwrap_or(DEFAULT_PATH).to_string();
    let program = workload::find_program(first, &path, &defaults.root, &cwd)?;
    Ok(ProcessSpec {
        program: program.display().to_string(),
        argv: request.argv.clone(),
        env,
        cwd,
        identity,
    })
}

/// The protocol error kind for a preparation failure.
pub fn error_kind(e: &WorkloadError) -> ErrorKind {
    match e {
        WorkloadError::NoCommand | WorkloadError::EmptyArgv => ErrorKind::BadRequest,
        WorkloadError::NotExecutable(_) => ErrorKind::PermissionDenied,
        WorkloadError::User(_)
        | WorkloadError::NotFound { .. }
        | WorkloadError::Missing(_)
        | WorkloadError::NoWorkingDir(_) => ErrorKind::NotFound,
    }
}

fn spawn_error_kind(e: &io::Error) -> ErrorKind {
    match e.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
        _ => ErrorKind::SpawnFailed,
    }
}

/// Where the input thread sends stdin.
enum Input {
    Pipe(Option<ChildStdin>),
    Pty {
        writer: Option<File>,
        master: OwnedFd,
    },
}

impl Input {
    fn write(&mut self, data: &[u8]) {
        let ok = match self {
            Input::Pipe(Some(w)) => w.write_all(data).is_ok(),
            Input::Pty {
                writer: Some(w), ..
            } => w.write_all(data).is_ok(),
            _ => true,
        };
        if !ok {
            // The command closed its stdin; drop further input.
            self.close_quietly();
        }
    }

    fn close(&mut self) {
        match self {
            Input::Pipe(w) => *w = None,
            // A TTY has no EOF of its own: send the EOF character (Ctrl-D).
            Input::Pty { writer, .. } => {
                if let Some(w) = writer {
                    let _ = w.write_all(&[0x04]);
                }
            }
        }
    }

    fn close_quietly(&mut self) {
        match self {
            Input::Pipe(w) => *w = None,
            Input::Pty { writer, .. } => *writer = None,
        }
    }

    fn resize(&self, size: WindowSize) {
        if let Input::Pty { master, .. } = self
            && let Err(e) = pty::resize(master, size)
        {
            eprintln!("imp-guest: resizing an exec's terminal failed: {e}");
        }
    }
}

/// Runs one exec on `conn` until the command exits and the host has its status.
pub fn run<C: Connection>(
    mut conn: C,
    request: &ExecRequest,
    defaults: &ExecDefaults,
    reaper: &Reaper,
) -> Result<(), ExecError> {
    let spec = match prepare(request, defaults) {
        Ok(s) => s,
        Err(e) => {
            write_frame(&mut conn, &Message::error(error_kind(&e), e.to_string()))?;
            return Ok(());
        }
    };
    let mut command = workload::command(&spec);
    let pty = if request.tty {
        Some(pty::open(request.window).map_err(io_err("opening a pseudo-terminal"))?)
    } else {
        None
    };
    match &pty {
        Some(p) => pty::attach(&mut command, &p.slave).map_err(io_err("attaching the terminal"))?,
        None => pipe_stdio(&mut command, request.stdin),
    }
    let spawned = reaper.spawn(|| command.spawn());
    // Close our copies of the terminal's slave side, or its master never sees EOF.
    drop(command);
    let master = pty.map(|p| p.master);
    let (mut child, exit) = match spawned {
        Ok(c) => c,
        Err(e) => {
            let message = format!("Starting {} failed: {e}", spec.program);
            write_frame(&mut conn, &Message::error(spawn_error_kind(&e), message))?;
            return Ok(());
        }
    };
    let pid = child.id();
    write_frame(&mut conn, &Message::Started { pid })?;
    let (input, outputs) = match master {
        Some(master) => pty_streams(master)?,
        None => pipe_streams(&mut child),
    };
    stream(conn, input, outputs, &exit, pid)
}

/// Maps an I/O error to [`ExecError::Io`] saying what was being done.
fn io_err(action: &'static str) -> impl FnOnce(io::Error) -> ExecError {
    move |source| ExecError::Io { action, source }
}

/// Without a terminal: stdout and stderr are pipes, stdin a pipe only when the host sends
/// input (else empty).
fn pipe_stdio(command: &mut Command, stdin: bool) {
    command
        .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
}

/// With a terminal: input goes to the master, and everything read from it is stdout.
fn pty_streams(master: OwnedFd) -> Result<(Input, Vec<(File, Wrap)>), ExecError> {
    let reader = File::from(
        master
            .try_clone()
            .map_err(io_err("duplicating the terminal"))?,
    );
    let writer = File::from(
        master
            .try_clone()
            .map_err(io_err("duplicating the terminal"))?,
    );
    Ok((
        Input::Pty {
            writer: Some(writer),
            master,
        },
        vec![(reader, Message::Stdout as Wrap)],
    ))
}

/// Without a terminal: the child's stdin pipe, and its stdout and stderr pipes.
fn pipe_streams(child: &mut Child) -> (Input, Vec<(File, Wrap)>) {
    let mut outputs: Vec<(File, Wrap)> = Vec::new();
    if let Some(out) = child.stdout.take() {
        outputs.push((File::from(OwnedFd::from(out)), Message::Stdout));
    }
    if let Some(err) = child.stderr.take() {
        outputs.push((File::from(OwnedFd::from(err)), Message::Stderr));
    }
    (Input::Pipe(child.stdin.take()), outputs)
}

/// Streams a started command: an input thread forwards what the host sends while this one
/// forwards the output, then sends the exit status (or an internal error) and hangs up.
fn stream<C: Connection>(
    mut conn: C,
    input: Input,
    outputs: Vec<(File, Wrap)>,
    exit: &Receiver<ExitStatus>,
    pid: u32,
) -> Result<(), ExecError> {
    let finished = Arc::new(AtomicBool::new(false));
    let reader = conn
        .try_clone()
        .map_err(io_err("duplicating the connection"))?;
    let input_thread = {
        let finished = Arc::clone(&finished);
        thread::Builder::new()
            .name(format!("exec-in-{pid}"))
            .spawn(move || pump_input(reader, input, pid, &finished))
            .map_err(io_err("starting the input thread"))?
    };
    let result = pump_output(&mut conn, outputs, exit, pid);
    finished.store(true, Ordering::SeqCst);
    let sent = match result {
        Ok(status) => write_frame(&mut conn, &Message::Exit { status }).map_err(ExecError::from),
        Err(e) => {
            let _ = write_frame(
                &mut conn,
                &Message::error(ErrorKind::Internal, format!("{e}")),
            );
            Err(e)
        }
    };
    let _ = conn.shutdown();
    let _ = input_thread.join();
    sent
}

type Wrap = fn(Vec<u8>) -> Message;

fn kill_quietly(pid: u32, signal: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

fn pump_input<C: Connection>(mut conn: C, mut input: Input, pid: u32, finished: &AtomicBool) {
    loop {
        match read_frame(&mut conn) {
            Ok(Some(Message::Stdin(data))) => input.write(&data),
            Ok(Some(Message::StdinEof)) => input.close(),
            Ok(Some(Message::Resize(size))) => input.resize(size),
            Ok(Some(Message::Signal { signal })) => match Signal::try_from(signal) {
                Ok(s) if !finished.load(Ordering::SeqCst) => kill_quietly(pid, s),
                Ok(_) => {}
                Err(_) => eprintln!("imp-guest: ignoring unknown signal {signal} for exec {pid}"),
            },
            Ok(Some(other)) => {
                eprintln!(
                    "imp-guest: ignoring a {} message during exec {pid}",
                    other.name()
                );
            }
            Ok(None) | Err(_) => {
                if !finished.load(Ordering::SeqCst) {
                    // The host hung up: nobody will read the output or the status.
                    kill_quietly(pid, Signal::SIGKILL);
                }
                return;
            }
        }
    }
}

/// Forwards output until both streams end (or shortly after the exit); returns the status.
fn pump_output<W: Write>(
    conn: &mut W,
    mut outputs: Vec<(File, Wrap)>,
    exit: &Receiver<ExitStatus>,
    pid: u32,
) -> Result<ExitStatus, ExecError> {
    let mut status = None;
    let mut deadline: Option<Instant> = None;
    let mut host_gone = false;
    let mut buf = vec![0u8; DATA_CHUNK];
    while !outputs.is_empty() {
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd> = outputs
                .iter()
                .map(|(f, _)| PollFd::new(f.as_fd(), PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::from(50u8)) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => {
                    return Err(ExecError::Io {
                        action: "polling output",
                        source: e.into(),
                    });
                }
            }
            fds.iter()
                .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };
        let mut ended = Vec::new();
        for (i, (file, wrap)) in outputs.iter_mut().enumerate() {
            if !ready[i] {
                continue;
            }
            match file.read(&mut buf) {
                Ok(0) => ended.push(i),
                Ok(n) => {
                    if !host_gone && write_frame(conn, &wrap(buf[..n].to_vec())).is_err() {
                        host_gone = true;
                        kill_quietly(pid, Signal::SIGKILL);
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                    ) => {}
                // EIO: the terminal's last slave closed — its EOF.
                Err(_) => ended.push(i),
            }
        }
        for i in ended.into_iter().rev() {
            outputs.remove(i);
        }
        if status.is_none()
            && let Ok(s) = exit.try_recv()
        {
            status = Some(s);
            deadline = Some(Instant::now() + DRAIN_AFTER_EXIT);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
    }
    match status {
        Some(s) => Ok(s),
        None => exit.recv().map_err(|_| ExecError::Io {
            action: "waiting for the command",
            source: io::Error::other("the reaper dropped the command's status"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reaper::Reaping;
    use imp_proto::EnvVar;
    use std::os::unix::net::UnixStream;

    fn defaults() -> ExecDefaults {
        let mut env = Environment::default();
        env.set("PATH", DEFAULT_PATH);
        env.set("FROM_WORKLOAD", "yes");
        ExecDefaults {
            env,
            cwd: "/".into(),
            user: None,
            root: PathBuf::from("/"),
        }
    }

    fn exec(argv: &[&str]) -> ExecRequest {
        ExecRequest {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Runs the session on one end of a socket pair, returns (messages, session result).
    fn session(
        request: ExecRequest,
        host_script: impl FnOnce(&mut UnixStream) + Send + 'static,
    ) -> Vec<Message> {
        let (guest, mut host) = UnixStream::pair().unwrap();
        let reaper = Reaper::start(Reaping::Own).unwrap();
        let t = thread::spawn(move || run(guest, &request, &defaults(), &reaper));
        host_script(&mut host);
        let mut got = Vec::new();
        while let Some(m) = read_frame(&mut host).unwrap() {
            got.push(m);
        }
        t.join().unwrap().unwrap();
        got
    }

    fn stdout_of(messages: &[Message]) -> String {
        messages
            .iter()
            .filter_map(|m| {
                if let Message::Stdout(d) = m {
                    Some(String::from_utf8_lossy(d).into_owned())
                } else {
                    None
                }
            })
            .collect()
    }

    #[test]
    fn output_then_exit_code_over_any_stream() {
        let got = session(
            exec(&["sh", "-c", "echo out; echo err >&2; exit 3"]),
            |_| {},
        );
        assert!(matches!(got[0], Message::Started { .. }));
        assert_eq!(
            got.last(),
            Some(&Message::Exit {
                status: ExitStatus::Code(3)
            })
        );
        assert_eq!(stdout_of(&got), "out\n");
        assert!(got.contains(&Message::Stderr(b"err\n".to_vec())));
    }

    #[test]
    fn the_workload_environment_and_request_env_are_applied() {
        let mut req = exec(&["sh", "-c", "echo $FROM_WORKLOAD $EXTRA"]);
        req.env = vec![EnvVar::new("EXTRA", "more")];
        let got = session(req, |_| {});
        assert_eq!(stdout_of(&got), "yes more\n");
    }

    #[test]
    fn stdin_is_forwarded_and_closed() {
        let mut req = exec(&["cat"]);
        req.stdin = true;
        let got = session(req, |host| {
            write_frame(host, &Message::Stdin(b"piped\n".to_vec())).unwrap();
            write_frame(host, &Message::StdinEof).unwrap();
        });
        assert_eq!(stdout_of(&got), "piped\n");
        assert_eq!(
            got.last(),
            Some(&Message::Exit {
                status: ExitStatus::Code(0)
            })
        );
    }

    #[test]
    fn a_signal_reaches_the_command() {
        let got = session(exec(&["sleep", "30"]), |host| {
            let Message::Started { .. } = read_frame(host).unwrap().unwrap() else {
                panic!()
            };
            write_frame(host, &Message::Signal { signal: 15 }).unwrap();
        });
        assert_eq!(
            got.last(),
            Some(&Message::Exit {
                status: ExitStatus::Signal(15)
            })
        );
    }

    #[test]
    fn an_unknown_command_is_an_error_frame_naming_it() {
        let got = session(exec(&["no-such-command-imp"]), |_| {});
        match &got[..] {
            [Message::Error(e)] => {
                assert_eq!(e.kind, ErrorKind::NotFound);
                assert!(
                    e.message
                        .contains("\"no-such-command-imp\" not found in PATH="),
                    "{}",
                    e.message
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        let got = session(ExecRequest::default(), |_| {});
        assert!(matches!(&got[..], [Message::Error(e)] if e.kind == ErrorKind::BadRequest));
    }

    #[test]
    fn a_tty_exec_sees_a_terminal() {
        let mut req = exec(&["sh", "-c", "test -t 0 && test -t 1 && echo tty; stty size"]);
        req.tty = true;
        req.window = Some(WindowSize { rows: 33, cols: 77 });
        let got = session(req, |_| {});
        let out = stdout_of(&got);
        assert!(out.contains("tty") && out.contains("33 77"), "{out:?}");
        assert_eq!(
            got.last(),
            Some(&Message::Exit {
                status: ExitStatus::Code(0)
            })
        );
    }

    #[test]
    fn a_background_child_holding_stdout_does_not_hold_the_exit() {
        let start = Instant::now();
        let got = session(exec(&["sh", "-c", "sleep 5 & echo started"]), |_| {});
        assert_eq!(
            got.last(),
            Some(&Message::Exit {
                status: ExitStatus::Code(0)
            })
        );
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn the_host_hanging_up_kills_the_command() {
        let (guest, mut host) = UnixStream::pair().unwrap();
        let reaper = Reaper::start(Reaping::Own).unwrap();
        let t = thread::spawn(move || run(guest, &exec(&["sleep", "30"]), &defaults(), &reaper));
        let Message::Started { .. } = read_frame(&mut host).unwrap().unwrap() else {
            panic!()
        };
        let start = Instant::now();
        drop(host);
        let _ = t.join().unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
