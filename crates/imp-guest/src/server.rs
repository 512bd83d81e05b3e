//! The guest agent's API: accept connections, handshake, answer health, metrics, shutdown,
//! clock setting and reidentification ([`crate::identity`]), hand execs to [`crate::exec`].
//! One thread per connection.

use crate::exec::{self, ExecDefaults};
use crate::identity;
use crate::metrics;
use crate::reaper::Reaper;
use crate::transport::{Connection, Listener};
#[cfg(test)]
use imp_proto::ErrorReply;
use imp_proto::frame::{FrameError, read_frame, write_frame};
use imp_proto::handshake::HandshakeError;
use imp_proto::{
    Entropy, ErrorKind, HealthReport, Hello, Identity, Message, WorkloadState, handshake,
};
use std::io;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// How long a connection may sit idle before the guest drops it (the host polls far more often).
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// What every connection handler shares.
#[derive(Debug)]
pub struct Context {
    /// Our hello.
    pub hello: Hello,
    /// When the guest agent started, for uptime.
    pub started: Instant,
    /// The workload's state, updated by the init.
    pub workload: Mutex<WorkloadState>,
    /// What execs inherit.
    pub exec_defaults: ExecDefaults,
    /// Spawns and waits for exec'd commands.
    pub reaper: Reaper,
    /// Where `/proc` is (metrics).
    pub proc_dir: PathBuf,
    /// A path on the disk whose usage metrics reports.
    pub disk_path: PathBuf,
    /// Tells the init to shut down with this grace period.
    pub shutdown: Mutex<Sender<Duration>>,
    /// Whether requests may change the system ([`Message::SetClock`],
    /// [`Message::Reidentify`]): only as PID 1 in a VM, never in dev mode, where the clock,
    /// hostname, network and entropy pool are the host's.
    pub owns_system: bool,
}

impl Context {
    /// Records a new workload state.
    pub fn set_workload(&self, state: WorkloadState) {
        *self.workload.lock().unwrap_or_else(PoisonError::into_inner) = state;
    }

    fn health(&self) -> HealthReport {
        HealthReport {
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            workload: self
                .workload
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

/// Accepts connections forever, one handler thread each.
pub fn serve<L: Listener>(listener: L, ctx: Arc<Context>) {
    loop {
        match listener.accept() {
            Ok(conn) => {
                let ctx = Arc::clone(&ctx);
                if let Err(e) = thread::Builder::new()
                    .name("conn".into())
                    .spawn(move || handle(conn, &ctx))
                {
                    eprintln!("imp-guest: starting a connection thread failed: {e}");
                }
            }
            Err(e) => {
                eprintln!("imp-guest: accepting a connection failed: {e}");
                thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Serves one connection: handshake, then requests until it closes or becomes an exec.
pub fn handle<C: Connection>(mut conn: C, ctx: &Context) {
    match handshake(&mut conn, &ctx.hello) {
        Ok(_) => {}
        // A host that hung up before saying anything (an abandoned connection attempt) is
        // not worth a console line.
        Err(e) if hung_up_early(&e) => return,
        Err(e) => {
            eprintln!("imp-guest: refused a connection: {e}");
            return;
        }
    }
    let _ = conn.set_read_timeout(Some(IDLE_TIMEOUT));
    loop {
        let request = match read_frame(&mut conn) {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                eprintln!("imp-guest: reading a request failed: {e}");
                let _ = write_frame(
                    &mut conn,
                    &Message::error(ErrorKind::BadRequest, e.to_string()),
                );
                return;
            }
        };
        let reply = match request {
            Message::Health => Message::HealthReport(ctx.health()),
            Message::Metrics => {
                match metrics::collect(&ctx.proc_dir, &ctx.disk_path, Duration::from_millis(100)) {
                    Ok(m) => Message::MetricsReport(m),
                    Err(e) => Message::error(
                        ErrorKind::Internal,
                        format!("Collecting metrics failed: {e}"),
                    ),
                }
            }
            Message::Shutdown { grace_ms } => {
                let sent = ctx
                    .shutdown
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .send(Duration::from_millis(grace_ms));
                match sent {
                    Ok(()) => Message::ShutdownAccepted,
                    Err(_) => {
                        Message::error(ErrorKind::Internal, "The guest is already shutting down")
                    }
                }
            }
            Message::SetClock { unix_nanos } => set_clock(ctx.owns_system, unix_nanos),
            Message::Reidentify {
                identity,
                entropy,
                unix_nanos,
            } => reidentify(ctx.owns_system, &identity, &entropy, unix_nanos),
            Message::HttpGet(request) => Message::HttpGetResult(crate::probe::http_get(&request)),
            Message::Exec(request) => {
                let _ = conn.set_read_timeout(None);
                if let Err(e) = exec::run(conn, &request, &ctx.exec_defaults, &ctx.reaper) {
                    eprintln!("imp-guest: exec of {:?} failed: {e}", request.argv);
                }
                return;
            }
            other => Message::error(
                ErrorKind::BadRequest,
                format!(
                    "A {} message is not a request (expected exec, health, metrics, shutdown, \
                     set_clock, reidentify or http_get)",
                    other.name()
                ),
            ),
        };
        if write_frame(&mut conn, &reply).is_err() {
            return;
        }
    }
}

/// Sets the wall clock, if this guest may, and says how it went.
fn set_clock(allowed: bool, unix_nanos: u64) -> Message {
    if !allowed {
        return Message::error(
            ErrorKind::PermissionDenied,
            "Setting the clock is refused outside a VM (imp-guest runs with --no-pid1)",
        );
    }
    match crate::system::set_clock(unix_nanos) {
        Ok(()) => Message::ClockSet,
        Err(e) => Message::error(ErrorKind::Internal, identity::chain(&e)),
    }
}

/// Takes a clone's own identity, if this guest may, and reports each step.
fn reidentify(allowed: bool, id: &Identity, entropy: &Entropy, unix_nanos: u64) -> Message {
    if !allowed {
        return Message::error(
            ErrorKind::PermissionDenied,
            "Reidentifying is refused outside a VM (imp-guest runs with --no-pid1): the \
             hostname, network and entropy pool are the host's",
        );
    }
    if let Err(reason) = id.validate().and_then(|()| entropy.validate()) {
        return Message::error(
            ErrorKind::BadRequest,
            format!("Refusing to reidentify: {reason}"),
        );
    }
    let report = identity::reidentify(&mut identity::Live, id, &entropy.0, unix_nanos);
    eprintln!("imp-guest: reidentified: {report}");
    Message::Reidentified(report)
}

/// Whether the handshake failed only because the peer closed the connection before its hello.
fn hung_up_early(e: &HandshakeError) -> bool {
    match e {
        HandshakeError::Closed => true,
        HandshakeError::Frame(FrameError::Io { source, .. }) => matches!(
            source.kind(),
            io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::NotConnected
                | io::ErrorKind::UnexpectedEof
        ),
        HandshakeError::Frame(FrameError::Truncated { got: 0, .. }) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_and_the_identity_change_only_inside_a_vm() {
        // Outside a VM nothing is touched, whatever was asked for.
        let refused = |m: Message| {
            matches!(
                m,
                Message::Error(ErrorReply {
                    kind: ErrorKind::PermissionDenied,
                    ..
                })
            )
        };
        assert!(refused(set_clock(false, 0)));
        let id = Identity {
            hostname: Some("clone".into()),
            ..Identity::default()
        };
        assert!(refused(reidentify(false, &id, &Entropy(vec![1; 64]), 0)));
    }

    #[test]
    fn a_bad_reidentify_is_refused_before_anything_changes() {
        // As if inside a VM: the checks come first, so nothing is applied here.
        let bad = |id: &Identity, entropy: Vec<u8>, want: &str| match reidentify(
            true,
            id,
            &Entropy(entropy),
            0,
        ) {
            Message::Error(e) => {
                assert_eq!(e.kind, ErrorKind::BadRequest);
                assert!(e.message.contains(want), "{want}: {}", e.message);
            }
            other => panic!("{want}: {other:?}"),
        };
        bad(&Identity::default(), vec![0; 8], "8 bytes of entropy");
        let id = Identity {
            hostname: Some("two words".into()),
            ..Identity::default()
        };
        bad(&id, vec![0; 64], "hostname");
    }

    #[test]
    fn only_a_peer_that_hung_up_before_its_hello_is_quiet() {
        let io = |kind| {
            HandshakeError::Frame(FrameError::Io {
                action: "writing",
                source: io::Error::from(kind),
            })
        };
        assert!(hung_up_early(&HandshakeError::Closed));
        assert!(hung_up_early(&io(io::ErrorKind::BrokenPipe)));
        assert!(hung_up_early(&io(io::ErrorKind::ConnectionReset)));
        assert!(!hung_up_early(&io(io::ErrorKind::PermissionDenied)));
        assert!(!hung_up_early(&HandshakeError::NotHello("exec")));
        assert!(!hung_up_early(&HandshakeError::Rejected("no".into())));
    }
}
