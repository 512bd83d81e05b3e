//! The shim's side of its typed API ([`crate::runtime::shim_api`]): it accepts on the socket
//! its starter bound ([`crate::runtime::shim_api::CONTROL_FD`]) or, started by hand, binds it itself; answers only its
//! own uid or root; streams the record ([`RecordFeed`]) to watchers, turns a stop request
//! into the same stop a signal asks for, and hands suspend and snapshot requests to the
//! supervision loop (a snapshot's outcome is the answer; a suspend's is the record's).

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::runtime::contract::{SnapshotOutcome, SnapshotRequest, write_stop};
use crate::runtime::shim_api::{
    self, ClaimOutcome, ClaimRequest, Envelope, Event, Reply, Request, SOCKET_FILE, WireError,
};
use crate::runtime::state::RecordFeed;

/// The shim's listening socket: the inherited one (`fd`, normally [`CONTROL_FD`](crate::runtime::shim_api::CONTROL_FD)), else one
/// bound at the VM directory's [`SOCKET_FILE`]. Must run inside the async runtime.
pub fn listener(dir: &Path, fd: Option<i32>) -> std::io::Result<UnixListener> {
    let std_listener = match fd {
        Some(fd) => {
            let owned = take_fd(fd)?;
            std::os::unix::net::UnixListener::from(owned)
        }
        None => {
            let path = dir.join(SOCKET_FILE);
            let _ = std::fs::remove_file(&path);
            std::os::unix::net::UnixListener::bind(&path)?
        }
    };
    std_listener.set_nonblocking(true)?;
    UnixListener::from_std(std_listener)
}

/// Takes ownership of inherited descriptor `fd`, after checking it is open, and marks it
/// close-on-exec so the VMM does not inherit the shim's socket.
#[allow(unsafe_code)]
fn take_fd(fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl(2) on a number only reads the descriptor table.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; setting FD_CLOEXEC changes no memory.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor is open (checked above), was given to this process by its starter
    // for this purpose, and nothing else in the process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A snapshot asked on the API, and where its outcome goes.
pub type SnapshotAsked = (SnapshotRequest, oneshot::Sender<SnapshotOutcome>);

/// A claim asked on the API, and where its outcome (or why it was refused) goes.
pub type ClaimAsked = (ClaimRequest, oneshot::Sender<Result<ClaimOutcome, String>>);

/// A pause asked on the API, and where its outcome (or why it was refused) goes.
pub type PauseAsked = oneshot::Sender<Result<(), String>>;

/// What the API's handlers reach in the shim.
#[derive(Clone)]
pub struct Served {
    /// The VM's directory (where a stop request's grace and reason are written).
    pub dir: PathBuf,
    /// The record as it changes.
    pub feed: RecordFeed,
    /// Woken by a stop request, as a SIGTERM would.
    pub stop: Arc<Notify>,
    /// Where snapshot requests go (the supervision loop takes them while the VM runs).
    pub snapshots: mpsc::Sender<SnapshotAsked>,
    /// Where suspend requests (their tokens) go, as for snapshots.
    pub suspends: mpsc::Sender<String>,
    /// Where claims go, as for snapshots.
    pub claims: mpsc::Sender<ClaimAsked>,
    /// Where pauses go, as for snapshots.
    pub pauses: mpsc::Sender<PauseAsked>,
}

/// Accepts and answers callers until the shim ends.
pub async fn serve(listener: UnixListener, served: Served) {
    let me = nix::unistd::geteuid().as_raw();
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(dir = %served.dir.display(), error = %e, "accepting on the shim's socket failed");
                continue;
            }
        };
        let served = served.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, &served, me).await {
                tracing::debug!(dir = %served.dir.display(), error = %imp_api::chain::DisplayChain(&e), "a caller of the shim's API");
            }
        });
    }
}

/// Whether a caller of uid `peer` may use a shim running as `me`.
pub fn admitted(peer: u32, me: u32) -> bool {
    peer == 0 || peer == me
}

async fn answer(stream: UnixStream, served: &Served, me: u32) -> Result<(), WireError> {
    let peer = stream.peer_cred().map_err(|source| WireError::Io {
        doing: "asking the caller's credentials on",
        source,
    })?;
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    if !admitted(peer.uid(), me) {
        tracing::warn!(dir = %served.dir.display(), uid = peer.uid(), pid = ?peer.pid(), "refused a caller of another uid on the shim's socket");
        let error = format!("uid {} may not use this shim", peer.uid());
        return shim_api::write(&mut w, &Reply::Refused { error }).await;
    }
    let Some(Envelope { v, request }) = shim_api::read::<_, Envelope>(&mut r).await? else {
        return Ok(());
    };
    if let Some(error) = shim_api::refuse_version(v) {
        return shim_api::write(&mut w, &Reply::Refused { error }).await;
    }
    match request {
        Request::Watch => watch(&mut w, &served.feed).await,
        Request::Stop {
            grace_ms,
            fail_reason,
        } => {
            // Unwritten, the stop is refused: a caller must not read the end of the connection
            // as the shim's end.
            if let Err(e) = write_stop(&served.dir, grace_ms, fail_reason.as_deref()).await {
                let error = imp_api::chain::chain(&e);
                return shim_api::write(&mut w, &Reply::Refused { error }).await;
            }
            served.stop.notify_one();
            shim_api::write(&mut w, &Reply::Accepted).await?;
            // Held open until the shim exits: the caller's read ends then.
            let mut byte = [0u8; 1];
            let _ = r.read(&mut byte).await;
            Ok(())
        }
        Request::Suspend { token } => {
            let reply = match served.suspends.send(token).await {
                Ok(()) => Reply::Accepted,
                Err(_) => Reply::Refused {
                    error: "the VM has ended; there is nothing to suspend".into(),
                },
            };
            shim_api::write(&mut w, &reply).await
        }
        Request::Snapshot(req) => {
            let token = req.token.clone();
            let (tx, rx) = oneshot::channel();
            // The shim ends before the VM is snapshotted: no answer, the caller reads the
            // connection's end.
            if served.snapshots.send((req, tx)).await.is_err() {
                return Ok(());
            }
            let reply = match rx.await {
                Ok(outcome) => Reply::Snapshot(Box::new(outcome)),
                Err(_) => Reply::Refused {
                    error: format!("the VM ended before snapshot {token} was taken"),
                },
            };
            shim_api::write(&mut w, &reply).await
        }
        Request::Claim(req) => {
            let (tx, rx) = oneshot::channel();
            if served.claims.send((*req, tx)).await.is_err() {
                return Ok(());
            }
            let reply = match rx.await {
                Ok(Ok(outcome)) => Reply::Claimed(Box::new(outcome)),
                Ok(Err(error)) => Reply::Refused { error },
                Err(_) => Reply::Refused {
                    error: "the VM ended before it was handed over".into(),
                },
            };
            shim_api::write(&mut w, &reply).await
        }
        Request::Pause => {
            let (tx, rx) = oneshot::channel();
            if served.pauses.send(tx).await.is_err() {
                return Ok(());
            }
            let reply = match rx.await {
                Ok(Ok(())) => Reply::Accepted,
                Ok(Err(error)) => Reply::Refused { error },
                Err(_) => Reply::Refused {
                    error: "the VM ended before it was paused".into(),
                },
            };
            shim_api::write(&mut w, &reply).await
        }
    }
}

/// Sends the record now and at every change until the shim ends or the watcher leaves.
async fn watch<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    feed: &RecordFeed,
) -> Result<(), WireError> {
    let mut rx = feed.subscribe();
    loop {
        let (seq, record) = rx.borrow_and_update().clone();
        shim_api::write(w, &Reply::Event(Box::new(Event { seq, record }))).await?;
        if rx.changed().await.is_err() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::runtime::contract::{FAIL_REASON_FILE, STOP_GRACE_FILE};
    use crate::runtime::control::client;
    use crate::runtime::state::{VmRecord, VmStatus};
    use std::time::Duration;

    #[test]
    fn only_root_and_the_shims_own_uid_are_admitted() {
        assert!(admitted(0, 0));
        assert!(admitted(0, 1000));
        assert!(admitted(1000, 1000));
        assert!(!admitted(1001, 1000));
        assert!(!admitted(65534, 0));
    }

    fn record(status: VmStatus) -> VmRecord {
        crate::runtime::state::sample_record(status)
    }

    /// A shim's API served from a fresh directory (bound by the shim itself, no inherited fd).
    fn served(name: &str) -> (PathBuf, Served) {
        let (dir, served, _) = served_and_snapshots(name);
        (dir, served)
    }

    /// As [`served`], with the receiving end of its snapshot requests (the supervision loop's).
    fn served_with_loop(name: &str) -> (PathBuf, mpsc::Receiver<SnapshotAsked>) {
        let (dir, _, rx) = served_and_snapshots(name);
        (dir, rx)
    }

    fn served_and_snapshots(name: &str) -> (PathBuf, Served, mpsc::Receiver<SnapshotAsked>) {
        let dir = std::env::temp_dir().join(format!("imp-serve-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (snapshots, rx) = mpsc::channel(1);
        let served = Served {
            dir: dir.clone(),
            feed: RecordFeed::new(record(VmStatus::Starting)),
            stop: Arc::default(),
            snapshots,
            suspends: mpsc::channel(1).0,
            claims: mpsc::channel(1).0,
            pauses: mpsc::channel(1).0,
        };
        let l = listener(&dir, None).unwrap();
        tokio::spawn(serve(l, served.clone()));
        (dir, served, rx)
    }

    #[tokio::test]
    async fn a_watcher_sees_the_record_then_each_change_as_it_is_saved() {
        let (dir, served) = served("watch");
        let mut watch = client::watch(&dir).await.unwrap().unwrap();
        let first = watch.next().await.unwrap().unwrap();
        assert_eq!((first.seq, first.record.status), (0, VmStatus::Starting));
        served.feed.announce(&record(VmStatus::Running));
        let next = watch.next().await.unwrap().unwrap();
        assert_eq!((next.seq, next.record.status), (1, VmStatus::Running));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            client::watch(&dir).await.unwrap().is_none(),
            "a VM without a socket (a shim of an earlier release) is not reported as absent"
        );
    }

    #[tokio::test]
    async fn a_stop_request_wakes_the_stop_with_its_grace_and_reason_and_waits_for_the_end() {
        let (dir, served) = served("stop");
        let asked = served.stop.clone();
        let stopping = client::stop(&dir, Duration::from_millis(1500), Some("probe failed"))
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), asked.notified())
            .await
            .expect("the stop request did not reach the shim's stop");
        let read = |f| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read(STOP_GRACE_FILE), "1500");
        assert_eq!(read(FAIL_REASON_FILE), "probe failed");
        assert!(
            !stopping.ended(Duration::from_millis(100)).await,
            "the stop answered as ended while the shim still runs"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_snapshot_request_reaches_the_supervision_loop_and_its_outcome_the_caller() {
        let (dir, mut rx) = served_with_loop("snapshot");
        // The supervision loop, played: it answers the request it was handed.
        tokio::spawn(async move {
            let (req, answer) = rx.recv().await.unwrap();
            let _ = answer.send(SnapshotOutcome {
                token: req.token.clone(),
                result: Err(format!("no VM to snapshot into {}", req.dest.display())),
                bytes: 7,
            });
        });
        let req = SnapshotRequest {
            token: "t1".into(),
            dest: "/snapshots/x".into(),
            source: crate::snapshot::Source {
                namespace: "ns".into(),
                name: "vm".into(),
                image: String::new(),
            },
        };
        let outcome = client::snapshot(&dir, req, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(outcome.token, "t1");
        assert_eq!(outcome.bytes, 7);
        assert_eq!(
            outcome.result,
            Err("no VM to snapshot into /snapshots/x".to_owned())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_suspend_request_hands_its_token_to_the_supervision_loop() {
        let (dir, mut served) = served("suspend");
        let (tx, mut rx) = mpsc::channel(1);
        served.suspends = tx;
        std::fs::remove_file(dir.join(SOCKET_FILE)).unwrap();
        tokio::spawn(serve(listener(&dir, None).unwrap(), served));
        assert!(client::suspend(&dir, "tok-1").await.unwrap());
        assert_eq!(rx.recv().await.as_deref(), Some("tok-1"));
        // The loop is gone (the VM ended): the request is refused, saying so.
        drop(rx);
        let refused = client::suspend(&dir, "tok-2").await.unwrap_err();
        assert!(refused.to_string().contains("ended"), "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn another_version_is_refused() {
        let (dir, _served) = served("version");
        let stream = UnixStream::connect(dir.join(SOCKET_FILE)).await.unwrap();
        let (r, mut w) = stream.into_split();
        let request = serde_json::json!({"v": 99, "op": "watch"});
        shim_api::write(&mut w, &request).await.unwrap();
        let reply = shim_api::read::<_, Reply>(&mut BufReader::new(r))
            .await
            .unwrap();
        assert!(
            matches!(&reply, Some(Reply::Refused { error }) if error.contains("version 99")),
            "{reply:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A process of another uid (65534, forked from this test as root) is refused on the
    /// socket even where the filesystem lets it connect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_of_another_uid_is_refused() {
        if !imp_testenv::guard::require(
            imp_testenv::guard::is_root(),
            "root, to call as another uid",
        ) {
            return;
        }
        let (dir, _served) = served("peer");
        let socket = dir.join(SOCKET_FILE);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
        let code = tokio::task::spawn_blocking(move || call_as_nobody(&socket))
            .await
            .unwrap();
        assert_eq!(
            code, 0,
            "the other uid's call was not refused (1: answered, 2: no uid change, 3: no connection)"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Forks a child that becomes uid 65534 and asks to watch on `socket`: exits 0 when it is
    /// refused, 1 when answered otherwise, 2 or 3 when it could not ask. Returns the exit code.
    #[allow(unsafe_code)]
    fn call_as_nobody(socket: &Path) -> i32 {
        use std::os::unix::ffi::OsStrExt;
        // Everything the child uses is made before the fork: it only makes system calls.
        // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(socket.as_os_str().as_bytes()) {
            *d = *s as libc::c_char;
        }
        let request = b"{\"v\":1,\"op\":\"watch\"}\n";
        let needle = b"refused";
        // SAFETY: the child runs only async-signal-safe calls (setgid, setuid, socket,
        // connect, write, read, _exit) on memory made before the fork.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    libc::_exit(2);
                }
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if fd < 0 || libc::connect(fd, (&raw const addr).cast(), len) != 0 {
                    libc::_exit(3);
                }
                // The shim may refuse before it reads the request: a failed write is not the end.
                let _ = libc::write(fd, request.as_ptr().cast(), request.len());
                let mut buf = [0u8; 512];
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                let got = usize::try_from(n).unwrap_or(0);
                let refused = buf[..got].windows(needle.len()).any(|w| w == needle);
                libc::_exit(if refused { 0 } else { 1 });
            }
            let mut status = 0;
            libc::waitpid(pid, &raw mut status, 0);
            if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                -1
            }
        }
    }
}
