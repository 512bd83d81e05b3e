//! Receiving the files of a VM that moves to this node, from the agent of the node it moves
//! from (cold migration, docs/migration.md "The transfer"): the target's side of
//! [`imp_agent_api::moves`], whose sender is [`imp_agent_api::moves::send_files`].
//!
//! Who may send: each request names the VM and carries the move's token
//! ([`TOKEN_HEADER`]) over a connection whose client certificate is the source agent's own.
//! [`MoveAuthority`], which the agent's runtime implements by reading the VM, decides whether
//! both are the move's. The gateway's certificate opens no move, and a move's certificate none
//! of the gateway's endpoints ([`super::auth`] decides those alone).
//!
//! Layout under the directory [`Moves`] is given (the agent's `STATE/moves/`):
//! `incoming/{uid}/{file}` while the files arrive, each with `.{file}.progress` beside it
//! (JSON `{"size", "received"}`; a moved file's name never starts with a dot), then
//! `received/{uid}/` once `done` found every size and SHA-256 right (the directory renamed
//! whole, the progress files removed).
//!
//! Invariants:
//! - `received` = N in a progress file means bytes `[0, N)` of the file are on disk: the data
//!   is synced before the progress is replaced (atomically, every [`SYNC_EVERY`] bytes and at
//!   the end of each `PUT`, a cut one included); frames written past N but not recorded are
//!   sent again by the resumed transfer.
//! - Holes stay holes: a file is created with its size (`set_len`) and only frames are
//!   written; a file whose progress is dropped (its digest differed, or it comes with another
//!   size) is truncated before it is written anew.
//! - One request per VM at a time: a lock per uid, held by the task that writes (not by the
//!   connection, so a dropped connection never leaves frames written and not recorded), and
//!   a resumed transfer's `GET` waits for the cut one's last whole frames to be recorded.
//! - Blocking file work runs off the async runtime.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::unix::fs::{DirBuilderExt as _, FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use imp_agent_api::moves::{
    Done, FRAME_HEADER_LEN, Held, TOKEN_HEADER, is_file_name, parse_frame_header, sha256_file,
};
use serde::{Deserialize, Serialize};
use tokio::sync::OwnedMutexGuard;

use super::reply::{Body, status};
use super::route::{MoveAction, MoveRoute};

/// How many bytes of frames are received between two syncs of a file and its progress.
pub const SYNC_EVERY: u64 = 64 << 20;

/// How many bytes of frame data are gathered before they are written.
const WRITE_CHUNK: usize = 1 << 20;

/// The most bytes of a `done` body read.
const MAX_DONE: usize = 1 << 20;

/// What a move's admission is awaited as.
pub type Admission<'a> =
    Pin<Box<dyn Future<Output = Result<IncomingMove, MoveRefusal>> + Send + 'a>>;

/// Whether a move of VM `namespace/name` into this node may be received from the caller; the
/// agent's runtime implements it, the API asks it before every request of a move.
///
/// The runtime's reads the VM from the API server and admits when its `status.move` names
/// this node as the target and holds `token` (compared in constant time), and
/// `peer_cert_sha256` is the certificate the source node publishes (the Node named by the
/// VM's `spec.nodeName` before the commit, its annotation `imp.dev/agent-cert-sha256`): only
/// that node's agent, holding that certificate's key, with the token the operator wrote,
/// sends the files. [`MoveRefusal::UnknownVm`] for a VM that does not exist;
/// [`MoveRefusal::Forbidden`], saying which check failed, for one that does not move here or
/// a token or certificate that is not the move's; [`MoveRefusal::Unavailable`] when the API
/// cannot be read (the sender tries again).
pub trait MoveAuthority: Send + Sync + 'static {
    /// Admits the caller with certificate `peer_cert_sha256` and `token` to send the files of
    /// VM `namespace/name`, or says why not.
    fn admit<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        token: &'a str,
        peer_cert_sha256: &'a [u8; 32],
    ) -> Admission<'a>;
}

/// A move [`MoveAuthority`] admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingMove {
    /// The VM's uid: its files arrive under `incoming/{uid}/`.
    pub uid: String,
    /// The node the VM moves from (for logs).
    pub source_node: String,
}

/// Why [`MoveAuthority`] refuses a move's request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveRefusal {
    /// No such VM (404).
    #[error("ImpVM {0} does not exist")]
    UnknownVm(String),
    /// The VM does not move here, or the token or the certificate is not the move's (403).
    #[error("Forbidden: {0}")]
    Forbidden(String),
    /// The VM cannot be read now (503).
    #[error("The move cannot be checked now: {0}")]
    Unavailable(String),
}

impl MoveRefusal {
    /// The HTTP status that answers this refusal.
    pub fn status(&self) -> StatusCode {
        match self {
            MoveRefusal::UnknownVm(_) => StatusCode::NOT_FOUND,
            MoveRefusal::Forbidden(_) => StatusCode::FORBIDDEN,
            MoveRefusal::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The moves' directory: where the files of VMs moving to this node arrive and wait, by uid,
/// for the runtime to take them.
#[derive(Debug)]
pub struct Moves {
    root: PathBuf,
    /// One lock per uid being received (see the module's invariants).
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Moves {
    /// The moves under `root` (created when the first file arrives).
    pub fn new(root: impl Into<PathBuf>) -> Arc<Self> {
        Arc::new(Self {
            root: root.into(),
            locks: Mutex::default(),
        })
    }

    /// The directory given.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the files of VM `uid` are while they arrive (they may not be there).
    pub fn incoming(&self, uid: &str) -> PathBuf {
        self.root.join("incoming").join(uid)
    }

    fn completed(&self, uid: &str) -> PathBuf {
        self.root.join("received").join(uid)
    }

    /// The directory of VM `uid`'s files once they all arrived and were checked, if they did.
    pub fn received(&self, uid: &str) -> Option<PathBuf> {
        let dir = self.completed(uid);
        (is_file_name(uid) && dir.is_dir()).then_some(dir)
    }

    /// Removes what VM `uid` left here, incoming and received (after a waiting request of its
    /// move is done).
    pub async fn forget(&self, uid: &str) -> io::Result<()> {
        if !is_file_name(uid) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{uid:?} is not a VM uid"),
            ));
        }
        let guard = self.lock(uid).await;
        let dirs = [self.incoming(uid), self.completed(uid)];
        blocking(move || {
            let _guard = guard;
            for dir in dirs {
                match std::fs::remove_dir_all(&dir) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            Ok(())
        })
        .await?;
        if let Ok(mut locks) = self.locks.lock() {
            locks.remove(uid);
        }
        Ok(())
    }

    /// The uids whose files, incoming or received, nothing was written to for `age` (a move
    /// abandoned, or aborted after its files arrived: the sweep [`Moves::forget`]s those no
    /// VM of this node took).
    pub async fn older_than(&self, age: Duration) -> io::Result<Vec<String>> {
        let dirs = [self.root.join("incoming"), self.root.join("received")];
        blocking(move || {
            let now = SystemTime::now();
            let mut old = Vec::new();
            for dir in dirs {
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                };
                for entry in entries {
                    let entry = entry?;
                    let Ok(uid) = entry.file_name().into_string() else {
                        continue;
                    };
                    let newest = newest_change(&entry.path())?;
                    if now.duration_since(newest).unwrap_or_default() >= age {
                        old.push(uid);
                    }
                }
            }
            old.sort();
            old.dedup();
            Ok(old)
        })
        .await
    }

    async fn lock(&self, uid: &str) -> OwnedMutexGuard<()> {
        let lock = match self.locks.lock() {
            Ok(mut locks) => locks.entry(uid.to_owned()).or_default().clone(),
            // A panic while the map was held: a lock of its own still orders nothing, but the
            // request goes on rather than failing forever.
            Err(poisoned) => poisoned
                .into_inner()
                .entry(uid.to_owned())
                .or_default()
                .clone(),
        };
        lock.lock_owned().await
    }
}

/// The latest modification of `dir` and of what it holds.
fn newest_change(dir: &Path) -> io::Result<SystemTime> {
    let mut newest = std::fs::metadata(dir)?.modified()?;
    for entry in std::fs::read_dir(dir)? {
        let modified = entry?.metadata()?.modified()?;
        newest = newest.max(modified);
    }
    Ok(newest)
}

/// The moves' side of the API: who may send ([`MoveAuthority`]) and where files go
/// ([`Moves`]). Given to [`super::AgentApi::with_moves`].
#[derive(Clone)]
pub struct MoveReceiver {
    authority: Arc<dyn MoveAuthority>,
    moves: Arc<Moves>,
}

impl std::fmt::Debug for MoveReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoveReceiver")
            .field("moves", &self.moves)
            .finish_non_exhaustive()
    }
}

impl MoveReceiver {
    /// Moves admitted by `authority`, received into `moves`.
    pub fn new(authority: Arc<dyn MoveAuthority>, moves: Arc<Moves>) -> Self {
        Self { authority, moves }
    }

    /// Where the files arrive.
    pub fn moves(&self) -> &Arc<Moves> {
        &self.moves
    }

    /// Answers one request of a move; `peer` is the SHA-256 of the connection's client
    /// certificate, `idle` how long a `PUT` may go without a byte.
    pub(super) async fn serve<B>(
        &self,
        route: MoveRoute,
        req: Request<B>,
        peer: Option<&[u8; 32]>,
        idle: Duration,
    ) -> Response<Body>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (ns, name) = (&route.namespace, &route.name);
        let admitted = match self.admit(&route, req.headers(), peer).await {
            Ok(m) => m,
            Err((code, message)) => {
                tracing::warn!(vm = %name, namespace = %ns, reason = %message,
                    "move request refused");
                return status(code, &message);
            }
        };
        let uid = admitted.uid;
        match route.action {
            MoveAction::Held { file } => {
                let guard = self.moves.lock(&uid).await;
                let moves = self.moves.clone();
                let held = blocking(move || {
                    let _guard = guard;
                    held(&moves, &uid, &file)
                })
                .await;
                match held {
                    Ok(held) => json(&held),
                    Err(e) => internal(ns, name, "reading what this node holds", &e),
                }
            }
            MoveAction::Put { file, size } => {
                let guard = self.moves.lock(&uid).await;
                let moves = self.moves.clone();
                let body = req.into_body();
                let log = (ns.clone(), name.clone(), file.clone());
                // The writing task holds the lock and records what arrived even if this
                // request's future is dropped with its connection.
                let task = tokio::spawn(async move {
                    let _guard = guard;
                    receive(&moves, &uid, &file, size, body, idle).await
                });
                let (ns, name, file) = log;
                match task.await {
                    Ok(Ok(held)) => {
                        tracing::info!(vm = %name, namespace = %ns, file = %file,
                            received = held.received, size, source = %admitted.source_node,
                            "move: file received");
                        json(&held)
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(vm = %name, namespace = %ns, file = %file,
                            error = %imp_api::chain::DisplayChain(&e), "move: file not fully received");
                        status(e.status(), &imp_api::chain::chain(&e))
                    }
                    Err(e) => internal(&ns, &name, "receiving a file", &io::Error::other(e)),
                }
            }
            MoveAction::Done => {
                let body = match http_body_util::Limited::new(req.into_body(), MAX_DONE)
                    .collect()
                    .await
                {
                    Ok(b) => b.to_bytes(),
                    Err(e) => {
                        let msg = format!("The body of done could not be read: {e}");
                        return status(StatusCode::BAD_REQUEST, &msg);
                    }
                };
                let done: Done = match serde_json::from_slice(&body) {
                    Ok(d) => d,
                    Err(e) => {
                        let msg = format!("The body of done is not {{\"files\": [...]}}: {e}");
                        return status(StatusCode::BAD_REQUEST, &msg);
                    }
                };
                if done.files.is_empty() {
                    return status(StatusCode::BAD_REQUEST, "done names no file");
                }
                if let Some(bad) = done.files.iter().find(|f| !is_file_name(&f.name)) {
                    let e = super::route::RouteError::InvalidFileName(bad.name.clone());
                    return status(e.status(), &e.to_string());
                }
                let guard = self.moves.lock(&uid).await;
                let moves = self.moves.clone();
                let finished = tokio::task::spawn_blocking(move || {
                    let _guard = guard;
                    finish(&moves, &uid, &done)
                })
                .await;
                match finished {
                    Ok(Ok(())) => {
                        tracing::info!(vm = %name, namespace = %ns,
                            source = %admitted.source_node, "move: every file received and checked");
                        json(&serde_json::json!({"complete": true}))
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(vm = %name, namespace = %ns,
                            error = %imp_api::chain::DisplayChain(&e), "move: done refused");
                        done_refused(&e)
                    }
                    Err(e) => internal(ns, name, "checking the files", &e),
                }
            }
        }
    }

    /// The caller's move, or the status and message refusing it: 401 without a token or a
    /// certificate (or with a bearer token), then what [`MoveAuthority`] says.
    async fn admit(
        &self,
        route: &MoveRoute,
        headers: &HeaderMap,
        peer: Option<&[u8; 32]>,
    ) -> Result<IncomingMove, (StatusCode, String)> {
        let unauthorized = |why: &str| (StatusCode::UNAUTHORIZED, format!("Unauthorized: {why}"));
        if headers.contains_key(AUTHORIZATION) {
            return Err(unauthorized(
                "a move is sent with its token and the source agent's certificate, never a bearer token",
            ));
        }
        let Some(token) = headers
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|t| !t.is_empty())
        else {
            return Err(unauthorized(&format!(
                "a move's request carries the move's token in header {TOKEN_HEADER}"
            )));
        };
        let Some(peer) = peer else {
            return Err(unauthorized(
                "a move is sent by the source node's agent with its certificate; the caller presented none",
            ));
        };
        let admitted = self
            .authority
            .admit(&route.namespace, &route.name, token, peer)
            .await
            .map_err(|r| (r.status(), r.to_string()))?;
        if !is_file_name(&admitted.uid) {
            return Err((
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "ImpVM {}/{} has uid {:?}, which cannot name a directory",
                    route.namespace, route.name, admitted.uid
                ),
            ));
        }
        Ok(admitted)
    }
}

/// What a `PUT` left, as recorded beside its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Progress {
    size: u64,
    received: u64,
}

fn progress_path(dir: &Path, file: &str) -> PathBuf {
    dir.join(format!(".{file}.progress"))
}

fn read_progress(path: &Path) -> Option<Progress> {
    let text = std::fs::read(path).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Replaces the progress at `path` atomically and durably.
fn write_progress(path: &Path, progress: Progress) -> io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("progress.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&serde_json::to_vec(&progress).map_err(io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// How much of `file` of VM `uid` this node holds: all of it once the move is complete.
fn held(moves: &Moves, uid: &str, file: &str) -> io::Result<Held> {
    let done = moves.completed(uid);
    if done.is_dir() {
        return match std::fs::metadata(done.join(file)) {
            Ok(m) => Ok(Held {
                received: m.len(),
                size: Some(m.len()),
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Held::default()),
            Err(e) => Err(e),
        };
    }
    let dir = moves.incoming(uid);
    Ok(match read_progress(&progress_path(&dir, file)) {
        Some(p) if dir.join(file).exists() => Held {
            received: p.received.min(p.size),
            size: Some(p.size),
        },
        _ => Held::default(),
    })
}

/// Why a `PUT` did not end with every frame recorded.
#[derive(Debug, thiserror::Error)]
enum PutError {
    /// The move is complete: nothing more is taken.
    #[error(
        "The move is complete (its files were received and checked); {file} is not taken again"
    )]
    Complete { file: String },
    /// A frame starts below what is held.
    #[error(
        "A frame of {file} at offset {offset} starts below what this node holds ({received}); frames start at or after it"
    )]
    Overlap {
        file: String,
        offset: u64,
        received: u64,
    },
    /// A frame reaches past the file's end.
    #[error(
        "A frame of {file} at offset {offset} of {len} bytes reaches past its size ({size}); this node holds up to {received}"
    )]
    Beyond {
        file: String,
        offset: u64,
        len: u64,
        size: u64,
        received: u64,
    },
    /// The body ended inside a frame.
    #[error(
        "The body of {file} ended inside a frame ({got} of {len} bytes at offset {offset}); this node holds up to {received}"
    )]
    Truncated {
        file: String,
        offset: u64,
        len: u64,
        got: u64,
        received: u64,
    },
    /// The body broke off (the connection).
    #[error("The body of {file} broke off; this node holds up to {received}")]
    Broken {
        file: String,
        received: u64,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Nothing arrived for too long.
    #[error("No byte of {file} arrived for {idle:?}; this node holds up to {received}")]
    Idle {
        file: String,
        idle: Duration,
        received: u64,
    },
    /// The file or its progress could not be written.
    #[error("Writing {file} failed")]
    Io {
        file: String,
        #[source]
        source: io::Error,
    },
}

impl PutError {
    fn status(&self) -> StatusCode {
        match self {
            PutError::Complete { .. } | PutError::Overlap { .. } => StatusCode::CONFLICT,
            PutError::Beyond { .. } | PutError::Truncated { .. } | PutError::Broken { .. } => {
                StatusCode::BAD_REQUEST
            }
            PutError::Idle { .. } => StatusCode::REQUEST_TIMEOUT,
            PutError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// A file being received: where, how big, and how much of it is held and recorded.
struct Incoming {
    name: String,
    file: Arc<std::fs::File>,
    progress: PathBuf,
    size: u64,
    /// The end of the last whole frame written.
    received: u64,
    /// What the progress file says.
    recorded: Option<u64>,
    /// Frame bytes written since the last sync.
    unsynced: u64,
}

impl Incoming {
    /// Opens `file` in `dir` (a move's incoming directory; `done` its completed one) for a
    /// `PUT` of a file of `size` bytes: as it was if its progress knows it with that size,
    /// else anew (truncated, then `size` long, all hole).
    fn open(dir: &Path, done: &Path, file: &str, size: u64) -> Result<Self, PutError> {
        let io = |source| PutError::Io {
            file: file.to_owned(),
            source,
        };
        if done.is_dir() {
            return Err(PutError::Complete {
                file: file.to_owned(),
            });
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io)?;
        let data = dir.join(file);
        let progress = progress_path(dir, file);
        let kept = read_progress(&progress).filter(|p| p.size == size);
        let existing = match kept {
            Some(p) => match std::fs::OpenOptions::new().write(true).open(&data) {
                Ok(f) => Some((f, p.received.min(size))),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => return Err(io(e)),
            },
            None => None,
        };
        let (f, received, recorded) = match existing {
            Some((f, received)) => {
                if f.metadata().map_err(io)?.len() != size {
                    f.set_len(size).map_err(io)?;
                }
                (f, received, Some(received))
            }
            None => {
                match std::fs::remove_file(&progress) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io(e)),
                    _ => {}
                }
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&data)
                    .map_err(io)?;
                f.set_len(size).map_err(io)?;
                (f, 0, None)
            }
        };
        Ok(Self {
            name: file.to_owned(),
            file: Arc::new(f),
            progress,
            size,
            received,
            recorded,
            unsynced: 0,
        })
    }

    /// Syncs the file and records `received`, if it changed (or was never recorded).
    async fn record(&mut self) -> Result<(), PutError> {
        if self.recorded == Some(self.received) {
            return Ok(());
        }
        let file = self.file.clone();
        let path = self.progress.clone();
        let progress = Progress {
            size: self.size,
            received: self.received,
        };
        blocking(move || {
            file.sync_data()?;
            write_progress(&path, progress)
        })
        .await
        .map_err(|source| PutError::Io {
            file: self.name.clone(),
            source,
        })?;
        self.recorded = Some(self.received);
        self.unsynced = 0;
        Ok(())
    }

    /// Writes `data` at `offset`.
    async fn write(&self, data: Bytes, offset: u64) -> Result<(), PutError> {
        let file = self.file.clone();
        blocking(move || file.write_all_at(&data, offset))
            .await
            .map_err(|source| PutError::Io {
                file: self.name.clone(),
                source,
            })
    }
}

/// Where the frame parser is inside the body.
enum Reading {
    /// In a frame's header: the bytes so far.
    Header([u8; FRAME_HEADER_LEN], usize),
    /// In a frame's data: the frame, and how much of it has been gathered.
    Data { offset: u64, len: u64, got: u64 },
}

/// Receives a `PUT`'s frames into `file` of VM `uid` (`size` bytes), recording whole frames as
/// they are synced; whatever ends the body, what arrived whole is recorded before this ends.
async fn receive<B>(
    moves: &Moves,
    uid: &str,
    file: &str,
    size: u64,
    body: B,
    idle: Duration,
) -> Result<Held, PutError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let opened = {
        let (dir, done, file) = (moves.incoming(uid), moves.completed(uid), file.to_owned());
        tokio::task::spawn_blocking(move || Incoming::open(&dir, &done, &file, size)).await
    };
    let mut incoming = match opened {
        Ok(opened) => opened?,
        Err(e) => {
            return Err(PutError::Io {
                file: file.to_owned(),
                source: io::Error::other(e),
            });
        }
    };
    let mut body = Box::pin(body);
    let mut reading = Reading::Header([0; FRAME_HEADER_LEN], 0);
    let mut pending = BytesMut::new();
    let ended = loop {
        let next = match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => {
                break Err(PutError::Idle {
                    file: file.to_owned(),
                    idle,
                    received: incoming.received,
                });
            }
            Ok(None) => break Ok(()),
            Ok(Some(Err(e))) => {
                break Err(PutError::Broken {
                    file: file.to_owned(),
                    received: incoming.received,
                    source: e.into(),
                });
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = next.into_data() else {
            continue;
        };
        if let Err(e) = feed(&mut incoming, &mut reading, &mut pending, data).await {
            break Err(e);
        }
    };
    let ended = match (ended, &reading) {
        (Ok(()), Reading::Data { offset, len, got }) => Err(PutError::Truncated {
            file: file.to_owned(),
            offset: *offset,
            len: *len,
            got: *got,
            received: incoming.received,
        }),
        (Ok(()), Reading::Header(_, n)) if *n > 0 => Err(PutError::Truncated {
            file: file.to_owned(),
            offset: incoming.received,
            len: FRAME_HEADER_LEN as u64,
            got: *n as u64,
            received: incoming.received,
        }),
        (ended, _) => ended,
    };
    // Whatever ended the body, the whole frames are recorded.
    incoming.record().await?;
    ended.map(|()| Held {
        received: incoming.received,
        size: Some(size),
    })
}

/// Takes the body's next bytes: frame headers are checked, data gathered and written, and each
/// whole frame counted as received (synced and recorded every [`SYNC_EVERY`] bytes).
async fn feed(
    incoming: &mut Incoming,
    reading: &mut Reading,
    pending: &mut BytesMut,
    mut data: Bytes,
) -> Result<(), PutError> {
    while !data.is_empty() {
        match reading {
            Reading::Header(header, n) => {
                let take = (FRAME_HEADER_LEN - *n).min(data.len());
                header[*n..*n + take].copy_from_slice(&data.split_to(take));
                *n += take;
                if *n < FRAME_HEADER_LEN {
                    continue;
                }
                let (offset, len) = parse_frame_header(header);
                if offset < incoming.received {
                    return Err(PutError::Overlap {
                        file: incoming.name.clone(),
                        offset,
                        received: incoming.received,
                    });
                }
                if offset
                    .checked_add(len)
                    .is_none_or(|end| end > incoming.size)
                {
                    return Err(PutError::Beyond {
                        file: incoming.name.clone(),
                        offset,
                        len,
                        size: incoming.size,
                        received: incoming.received,
                    });
                }
                *reading = Reading::Data {
                    offset,
                    len,
                    got: 0,
                };
            }
            Reading::Data { offset, len, got } => {
                let left = *len - *got;
                let take = usize::try_from(left).unwrap_or(usize::MAX).min(data.len());
                pending.extend_from_slice(&data.split_to(take));
                *got += take as u64;
                let whole = *got == *len;
                if !pending.is_empty() && (pending.len() >= WRITE_CHUNK || whole) {
                    let at = *offset + *got - pending.len() as u64;
                    incoming.write(pending.split().freeze(), at).await?;
                }
                if whole {
                    incoming.received = *offset + *len;
                    incoming.unsynced += *len;
                    *reading = Reading::Header([0; FRAME_HEADER_LEN], 0);
                    if incoming.unsynced >= SYNC_EVERY {
                        incoming.record().await?;
                    }
                }
            }
        }
    }
    // A zero-length frame is whole as soon as its header is.
    if let Reading::Data { offset, len: 0, .. } = *reading {
        incoming.received = offset;
        *reading = Reading::Header([0; FRAME_HEADER_LEN], 0);
    }
    Ok(())
}

/// Why `done` refused the files.
#[derive(Debug, thiserror::Error)]
enum DoneError {
    /// A file never arrived.
    #[error("{file} was never received")]
    Missing { file: String },
    /// A file has another size.
    #[error(
        "{file} has {got} bytes here, the source {want}; it is dropped here and must be sent again"
    )]
    Size { file: String, want: u64, got: u64 },
    /// A file has another digest.
    #[error(
        "{file} has SHA-256 {got} here, the source {want}; it is dropped here and must be sent again"
    )]
    Digest {
        file: String,
        want: String,
        got: String,
    },
    /// Reading or renaming failed.
    #[error("Checking or keeping {what} failed")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// Checks every file of `done` against what VM `uid` holds here, then takes them
/// (`incoming/{uid}` renamed to `received/{uid}`); a file that differs has its progress
/// dropped, so it is sent anew. Once complete, the same check answers again (a sender whose
/// answer was lost asks again).
fn finish(moves: &Moves, uid: &str, done: &Done) -> Result<(), DoneError> {
    let incoming = moves.incoming(uid);
    let completed = moves.completed(uid);
    let (dir, fresh) = if incoming.is_dir() {
        (incoming.clone(), true)
    } else if completed.is_dir() {
        (completed.clone(), false)
    } else {
        return Err(DoneError::Missing {
            file: done
                .files
                .first()
                .map(|f| f.name.clone())
                .unwrap_or_default(),
        });
    };
    for f in &done.files {
        let path = dir.join(&f.name);
        let differs = |e: DoneError| {
            if fresh {
                let _ = std::fs::remove_file(progress_path(&dir, &f.name));
            }
            e
        };
        let (got_size, got_sha) = match sha256_file(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(DoneError::Missing {
                    file: f.name.clone(),
                });
            }
            Err(source) => {
                return Err(DoneError::Io {
                    what: f.name.clone(),
                    source,
                });
            }
        };
        if got_size != f.size {
            return Err(differs(DoneError::Size {
                file: f.name.clone(),
                want: f.size,
                got: got_size,
            }));
        }
        if !got_sha.eq_ignore_ascii_case(&f.sha256) {
            return Err(differs(DoneError::Digest {
                file: f.name.clone(),
                want: f.sha256.clone(),
                got: got_sha,
            }));
        }
    }
    if !fresh {
        return Ok(());
    }
    let io = |what: &str| {
        let what = what.to_owned();
        move |source| DoneError::Io { what, source }
    };
    let parent = moves.root.join("received");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&parent)
        .map_err(io("the received directory"))?;
    std::fs::rename(&incoming, &completed).map_err(io("the received files"))?;
    sync_dir(&parent).map_err(io("the received directory"))?;
    if let Some(from) = incoming.parent() {
        sync_dir(from).map_err(io("the incoming directory"))?;
    }
    // The progress files are of no use any more.
    for entry in std::fs::read_dir(&completed).map_err(io("the received files"))? {
        let entry = entry.map_err(io("the received files"))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// 422 naming the file that differs (in the message, and in `details.name` for the sender),
/// or 500.
fn done_refused(e: &DoneError) -> Response<Body> {
    let (code, file) = match e {
        DoneError::Missing { file }
        | DoneError::Size { file, .. }
        | DoneError::Digest { file, .. } => (StatusCode::UNPROCESSABLE_ENTITY, Some(file)),
        DoneError::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, None),
    };
    let mut body = imp_agent_api::status_body(code, &imp_api::chain::chain(e));
    if let Some(file) = file {
        body["details"] = serde_json::json!({"name": file, "kind": "file"});
    }
    let mut resp = Response::new(full(body.to_string().into_bytes()));
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn internal(namespace: &str, name: &str, what: &str, e: &dyn std::fmt::Display) -> Response<Body> {
    tracing::warn!(vm = %name, namespace = %namespace, error = %e, "move: {what} failed");
    status(
        StatusCode::INTERNAL_SERVER_ERROR,
        &format!("Moving ImpVM {namespace}/{name}: {what} failed: {e}"),
    )
}

fn json<T: Serialize>(value: &T) -> Response<Body> {
    let Ok(body) = serde_json::to_vec(value) else {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The answer could not be encoded",
        );
    };
    let mut resp = Response::new(full(body));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn full(bytes: Vec<u8>) -> Body {
    Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Runs `f` off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(io::Error::other(e)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use imp_agent_api::moves::{DoneFile, frame_header};

    fn scratch(name: &str) -> Arc<Moves> {
        let d = std::env::temp_dir().join(format!("imp-moves-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Moves::new(d)
    }

    /// How a test body ends.
    #[derive(Clone, Copy)]
    enum End {
        /// After all its frames.
        Whole,
        /// After this many bytes, as if the sender stopped there.
        Short(usize),
        /// After this many bytes, with an error (the connection broke).
        Broken(usize),
    }

    /// A body made of a list of chunks.
    type TestBody =
        StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, io::Error>>>>;

    /// `frames` (offset, bytes) encoded, in chunks of `chunk` bytes, ending as `end` says.
    fn body(frames: &[(u64, &[u8])], chunk: usize, end: End) -> TestBody {
        let mut wire = Vec::new();
        for (offset, data) in frames {
            wire.extend_from_slice(&frame_header(*offset, data.len() as u64));
            wire.extend_from_slice(data);
        }
        let mut items: Vec<Result<Frame<Bytes>, io::Error>> = Vec::new();
        let len = match end {
            End::Whole => wire.len(),
            End::Short(n) | End::Broken(n) => n,
        };
        for piece in wire[..len].chunks(chunk) {
            items.push(Ok(Frame::data(Bytes::copy_from_slice(piece))));
        }
        if let End::Broken(_) = end {
            items.push(Err(io::Error::new(io::ErrorKind::ConnectionReset, "cut")));
        }
        StreamBody::new(futures::stream::iter(items))
    }

    async fn put<B>(moves: &Moves, size: u64, body: B) -> Result<Held, PutError>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        receive(moves, "uid-1", "disk", size, body, Duration::from_secs(5)).await
    }

    fn held_now(moves: &Moves) -> Held {
        held(moves, "uid-1", "disk").unwrap()
    }

    #[tokio::test]
    async fn frames_in_any_split_land_at_their_offsets_and_holes_stay_holes() {
        let moves = scratch("split");
        let a = vec![1u8; 5000];
        let b = vec![2u8; 3000];
        for chunk in [1, 7, 16, 4096, 1 << 20] {
            let _ = std::fs::remove_dir_all(moves.root());
            let got = put(
                &moves,
                1 << 20,
                body(&[(0, &a), (500_000, &b)], chunk, End::Whole),
            )
            .await
            .unwrap();
            assert_eq!(
                got,
                Held {
                    received: 503_000,
                    size: Some(1 << 20)
                }
            );
            assert_eq!(held_now(&moves), got, "recorded as answered");
            let data = std::fs::read(moves.incoming("uid-1").join("disk")).unwrap();
            assert_eq!(data.len(), 1 << 20);
            assert!(data[..5000].iter().all(|&x| x == 1));
            assert!(data[5000..500_000].iter().all(|&x| x == 0));
            assert!(data[500_000..503_000].iter().all(|&x| x == 2));
            assert!(data[503_000..].iter().all(|&x| x == 0));
        }
        let _ = std::fs::remove_dir_all(moves.root());
    }

    #[tokio::test]
    async fn a_cut_or_truncated_body_keeps_its_whole_frames_and_a_resumed_one_goes_on() {
        let moves = scratch("cut");
        let a = vec![1u8; 1000];
        let b = vec![2u8; 1000];
        // Cut inside the second frame's data: the first stays received.
        let e = put(
            &moves,
            10_000,
            body(&[(0, &a), (4000, &b)], 100, End::Broken(1016 + 16 + 10)),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, PutError::Broken { received: 1000, .. }), "{e}");
        assert_eq!(held_now(&moves).received, 1000);
        // Truncated (the body just ends) inside a header.
        let e = put(&moves, 10_000, body(&[(4000, &b)], 5, End::Short(10)))
            .await
            .unwrap_err();
        assert!(
            matches!(e, PutError::Truncated { received: 1000, .. }),
            "{e}"
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        // Below what is held: refused, nothing lost.
        let e = put(&moves, 10_000, body(&[(500, &b)], 64, End::Whole))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                PutError::Overlap {
                    offset: 500,
                    received: 1000,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(e.status(), StatusCode::CONFLICT);
        // Past the end: refused.
        let e = put(&moves, 10_000, body(&[(9500, &b)], 64, End::Whole))
            .await
            .unwrap_err();
        assert!(matches!(e, PutError::Beyond { size: 10_000, .. }), "{e}");
        assert!(e.to_string().contains("past its size (10000)"), "{e}");
        // Resumed: the rest arrives, the first frame is still there.
        let got = put(&moves, 10_000, body(&[(4000, &b)], 64, End::Whole))
            .await
            .unwrap();
        assert_eq!(got.received, 5000);
        let data = std::fs::read(moves.incoming("uid-1").join("disk")).unwrap();
        assert!(data[..1000].iter().all(|&x| x == 1) && data[4000..5000].iter().all(|&x| x == 2));
        // Another size: the file starts anew, all hole.
        let got = put(&moves, 20_000, body(&[], 64, End::Whole))
            .await
            .unwrap();
        assert_eq!(
            got,
            Held {
                received: 0,
                size: Some(20_000)
            }
        );
        let data = std::fs::read(moves.incoming("uid-1").join("disk")).unwrap();
        assert_eq!(data, vec![0u8; 20_000]);
        let _ = std::fs::remove_dir_all(moves.root());
    }

    #[tokio::test]
    async fn done_checks_every_file_drops_a_wrong_one_and_completes_once() {
        let moves = scratch("done");
        let a = vec![7u8; 4096];
        put(&moves, 8192, body(&[(0, &a)], 512, End::Whole))
            .await
            .unwrap();
        let path = moves.incoming("uid-1").join("disk");
        let (size, sha256) = sha256_file(&path).unwrap();
        let good = Done {
            files: vec![DoneFile {
                name: "disk".into(),
                size,
                sha256: sha256.clone(),
            }],
        };
        let mut wrong = good.clone();
        wrong.files[0].sha256 = "00".repeat(32);
        let e = finish(&moves, "uid-1", &wrong).unwrap_err();
        assert!(
            matches!(&e, DoneError::Digest { file, .. } if file == "disk"),
            "{e}"
        );
        assert_eq!(held_now(&moves), Held::default(), "its progress is dropped");
        put(&moves, 8192, body(&[(0, &a)], 512, End::Whole))
            .await
            .unwrap();
        let mut missing = good.clone();
        missing.files.push(DoneFile {
            name: "memory".into(),
            size: 1,
            sha256: sha256.clone(),
        });
        let e = finish(&moves, "uid-1", &missing).unwrap_err();
        assert!(
            matches!(&e, DoneError::Missing { file } if file == "memory"),
            "{e}"
        );
        assert!(moves.received("uid-1").is_none());
        finish(&moves, "uid-1", &good).unwrap();
        let dir = moves.received("uid-1").unwrap();
        assert_eq!(std::fs::read(dir.join("disk")).unwrap()[..4096], a[..]);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["disk"], "no progress file is left");
        assert!(!moves.incoming("uid-1").exists());
        // Asked again (the answer was lost): the same check, the same answer.
        finish(&moves, "uid-1", &good).unwrap();
        assert_eq!(
            held_now(&moves),
            Held {
                received: 8192,
                size: Some(8192)
            }
        );
        let e = put(&moves, 8192, body(&[], 64, End::Whole))
            .await
            .unwrap_err();
        assert!(matches!(e, PutError::Complete { .. }), "{e}");
        moves.forget("uid-1").await.unwrap();
        assert!(moves.received("uid-1").is_none());
        assert!(moves.forget("../x").await.is_err());
    }

    #[tokio::test]
    async fn moves_left_alone_are_found_by_age() {
        let moves = scratch("age");
        assert!(moves.older_than(Duration::ZERO).await.unwrap().is_empty());
        put(&moves, 10, body(&[], 64, End::Whole)).await.unwrap();
        assert_eq!(moves.older_than(Duration::ZERO).await.unwrap(), ["uid-1"]);
        assert!(
            moves
                .older_than(Duration::from_secs(3600))
                .await
                .unwrap()
                .is_empty()
        );
        moves.forget("uid-1").await.unwrap();
        assert!(moves.older_than(Duration::ZERO).await.unwrap().is_empty());
        let _ = std::fs::remove_dir_all(moves.root());
    }
}
