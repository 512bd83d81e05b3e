//! Talking to a local VM's guest agent: `imp exec` and the health check `imp run` waits on.
//!
//! The guest client in `imp-proto` works on a blocking Unix stream; the stream is opened with
//! the one `CONNECT <port>` client of the VMM drivers ([`imp_vmm::vsock::connect`]), run to
//! completion on this thread.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use imp_proto::message::{EnvVar, ExecRequest, ExitStatus, Hello, WindowSize};
use imp_proto::{Client, ExecEvent};

/// A handshaken guest-agent connection plus a second handle on the same socket (for writing
/// stdin from another thread and for changing socket options).
pub struct Connection {
    /// The protocol client.
    pub client: Client<UnixStream>,
    /// Another handle on the client's socket.
    pub handle: UnixStream,
}

/// Opens a handshaken client to guest `port` through `vsock`, retrying until `timeout`.
pub fn connect(vsock: &Path, port: u32, timeout: Duration) -> anyhow::Result<Connection> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(20);
    // One runtime for every attempt (an abandoned CONNECT's linger task lives on it meanwhile).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .context("starting the connect's runtime")?;
    loop {
        let attempt = open(&rt, vsock, port, deadline).and_then(|s| {
            // The timeout guards the handshake only; execs may be silent for long.
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let handle = s.try_clone()?;
            let ours = Hello::new(concat!("imp/", env!("CARGO_PKG_VERSION")));
            let client = Client::handshake(s, &ours)?;
            handle.set_read_timeout(None)?;
            Ok(Connection { client, handle })
        });
        match attempt {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= deadline => {
                return Err(e.context(format!(
                    "the guest agent on vsock port {port} via {} did not answer within {timeout:?}",
                    vsock.display()
                )));
            }
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(250));
            }
        }
    }
}

/// Opens guest `port` through `vsock` as a blocking stream, trying for at most a second (or
/// until `deadline`); the caller retries. Signals are held meanwhile (see [`HeldSignals`]), so
/// a Ctrl-C waits at most that second.
fn open(
    rt: &tokio::runtime::Runtime,
    vsock: &Path,
    port: u32,
    deadline: Instant,
) -> anyhow::Result<UnixStream> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .min(Duration::from_secs(1));
    let held = HeldSignals::hold();
    let stream = rt.block_on(imp_vmm::vsock::connect(
        vsock,
        port,
        left.max(Duration::from_millis(100)),
    ));
    drop(held);
    let stream = stream?.into_std().context("taking the guest stream")?;
    stream
        .set_nonblocking(false)
        .context("making the guest stream blocking")?;
    Ok(stream)
}

/// Holds SIGINT, SIGTERM and SIGHUP for as long as a `CONNECT` is unanswered, then lets them
/// through: dying in that window closes the socket before the guest's answer, and the guest
/// then meets a stream that vanished mid-handshake, so a Ctrl-C waits for the answer and then
/// ends the stream cleanly. `imp exec` is single-threaded here, so the calling thread's mask
/// is the process's.
struct HeldSignals(nix::sys::signal::SigSet);

impl HeldSignals {
    fn hold() -> Self {
        use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
        let mut set = SigSet::empty();
        for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
            set.add(s);
        }
        let mut old = SigSet::empty();
        // Cannot fail with a valid `how`; if it did, we would merely not hold them.
        let _ = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), Some(&mut old));
        HeldSignals(old)
    }
}

impl Drop for HeldSignals {
    fn drop(&mut self) {
        use nix::sys::signal::{SigmaskHow, pthread_sigmask};
        let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&self.0), None);
    }
}

/// How `imp exec` should run a command.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// The command and its arguments.
    pub argv: Vec<String>,
    /// Extra environment.
    pub env: Vec<EnvVar>,
    /// Working directory in the guest.
    pub cwd: Option<String>,
    /// User in the guest.
    pub user: Option<String>,
    /// Allocate a terminal in the guest and put ours in raw mode.
    pub tty: bool,
    /// Forward our stdin.
    pub stdin: bool,
}

/// Runs a command in the guest, streaming its output to ours; returns how it ended.
pub fn exec(conn: Connection, opts: &ExecOptions) -> anyhow::Result<ExitStatus> {
    if opts.argv.is_empty() {
        bail!("no command given: use `imp exec VM -- COMMAND [ARGS…]`");
    }
    let window = if opts.tty { terminal_size() } else { None };
    let request = ExecRequest {
        argv: opts.argv.clone(),
        env: opts.env.clone(),
        cwd: opts.cwd.clone(),
        user: opts.user.clone(),
        tty: opts.tty,
        window,
        stdin: opts.stdin,
    };
    let Connection { client, handle } = conn;
    let session = client
        .exec(&request)
        .with_context(|| format!("starting {:?} in the guest", opts.argv))?;
    let _raw = if opts.tty { RawTerminal::enter() } else { None };
    if !opts.stdin {
        let mut session = session;
        let status = session
            .wait_with_output(&mut std::io::stdout(), &mut std::io::stderr())
            .context("reading the command's output")?;
        return Ok(status);
    }
    let (mut input, mut output) = session.into_parts(handle);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = input.close_stdin();
                    return;
                }
                Ok(n) => {
                    if input.write_stdin(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    });
    loop {
        match output
            .next_event()
            .context("reading the command's output")?
        {
            ExecEvent::Stdout(d) => write_flush(&mut std::io::stdout(), &d)?,
            ExecEvent::Stderr(d) => write_flush(&mut std::io::stderr(), &d)?,
            ExecEvent::Exit(status) => return Ok(status),
        }
    }
}

fn write_flush(out: &mut dyn Write, data: &[u8]) -> anyhow::Result<()> {
    out.write_all(data)
        .and_then(|()| out.flush())
        .context("writing the command's output")
}

/// Our terminal's size, if stdout is a terminal.
#[allow(unsafe_code)]
fn terminal_size() -> Option<WindowSize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the valid, exclusively borrowed `ws`; fd 1
    // is ours for the whole call and a non-terminal just makes the ioctl fail.
    let rc = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_row > 0).then_some(WindowSize {
        rows: ws.ws_row,
        cols: ws.ws_col,
    })
}

/// Puts our terminal in raw mode for a TTY exec and restores it on drop.
struct RawTerminal {
    saved: nix::sys::termios::Termios,
}

impl RawTerminal {
    fn enter() -> Option<Self> {
        use nix::sys::termios::{SetArg, cfmakeraw, tcgetattr, tcsetattr};
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin).ok()?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(&stdin, SetArg::TCSANOW, &raw).ok()?;
        Some(Self { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        use nix::sys::termios::{SetArg, tcsetattr};
        let _ = tcsetattr(std::io::stdin(), SetArg::TCSANOW, &self.saved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::{SigHandler, SigSet, Signal, raise, signal};
    use std::sync::atomic::{AtomicBool, Ordering};

    static HUP_SEEN: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_hup(_: nix::libc::c_int) {
        HUP_SEEN.store(true, Ordering::SeqCst);
    }

    #[test]
    #[allow(unsafe_code)]
    fn held_signals_wait_until_the_connect_is_answered() {
        // SAFETY: the handler only stores to an atomic.
        let previous = unsafe { signal(Signal::SIGHUP, SigHandler::Handler(on_hup)) }.unwrap();
        let held = HeldSignals::hold();
        raise(Signal::SIGHUP).unwrap(); // to this thread, which holds it
        assert!(!HUP_SEEN.load(Ordering::SeqCst), "delivered while held");
        assert!(SigSet::thread_get_mask().unwrap().contains(Signal::SIGINT));
        drop(held);
        assert!(
            HUP_SEEN.load(Ordering::SeqCst),
            "not delivered once let through"
        );
        assert!(!SigSet::thread_get_mask().unwrap().contains(Signal::SIGINT));
        // SAFETY: restores what was there.
        unsafe { signal(Signal::SIGHUP, previous) }.unwrap();
    }
}
