//! Moving a VM's files to the node it moves to (cold migration, docs/migration.md "The
//! transfer"): the wire both agents speak, and the source agent's sender.
//!
//! The source agent calls the target agent's API over TLS pinned to the certificate the
//! target's Node publishes, presenting its own agent certificate (which the target checks
//! against the one the source's Node publishes) and the move's token in [`TOKEN_HEADER`]. Per
//! file: `GET` [`file_path`] answers how much of it the target holds durably ([`Held`]); `PUT`
//! [`file_path`]`?size=S` sends the data extents from there on as frames ([`frame_header`]:
//! offset and length, 8 bytes big-endian each, then the bytes), ascending, holes never sent.
//! Then `POST` [`done_path`] with every file's size and SHA-256 ([`Done`]): the target checks
//! them before it takes the files, and answers 422 naming the first that differs. A cut
//! transfer resumes where the target's `GET` says: [`send_files`] called again sends only the
//! rest.

use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http1::SendRequest;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::client::{ClientError, Target};
use crate::tls::ClientIdentity;

/// The header carrying the move's token (`status.move.token` of the VM).
pub const TOKEN_HEADER: &str = "imp-move-token";

/// The bytes of a frame's header: its offset and its length, each a big-endian `u64`.
pub const FRAME_HEADER_LEN: usize = 16;

/// The most data the sender puts in one frame (the receiver takes frames of any length within
/// the file): what it holds in memory per frame.
pub const FRAME_DATA: u64 = 1 << 20;

/// The longest file name a move carries.
pub const FILE_NAME_MAX: usize = 64;

/// The most bytes of an answer the sender reads (a small JSON or a `Status`).
const MAX_ANSWER: usize = 64 * 1024;

/// The path of file `file` of the move of VM `namespace/name`: `GET` how much the target holds,
/// `PUT` its data.
pub fn file_path(namespace: &str, name: &str, file: &str) -> String {
    format!("/v1/moves/{namespace}/{name}/files/{file}")
}

/// The path that ends the move of VM `namespace/name` (`POST` [`Done`]).
pub fn done_path(namespace: &str, name: &str) -> String {
    format!("/v1/moves/{namespace}/{name}/done")
}

/// Whether `name` may name a moved file: `[a-z0-9][a-z0-9._-]{0,63}`, so it is one path
/// component that is neither `.`, `..` nor hidden, on both ends.
pub fn is_file_name(name: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = name.as_bytes();
    bytes.len() <= FILE_NAME_MAX
        && bytes.first().copied().is_some_and(alnum)
        && bytes
            .iter()
            .all(|&b| alnum(b) || matches!(b, b'.' | b'_' | b'-'))
}

/// A frame's header: `offset` and `len`, big-endian.
pub fn frame_header(offset: u64, len: u64) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[..8].copy_from_slice(&offset.to_be_bytes());
    h[8..].copy_from_slice(&len.to_be_bytes());
    h
}

/// A frame header's offset and length.
pub fn parse_frame_header(h: &[u8; FRAME_HEADER_LEN]) -> (u64, u64) {
    let mut offset = [0u8; 8];
    let mut len = [0u8; 8];
    offset.copy_from_slice(&h[..8]);
    len.copy_from_slice(&h[8..]);
    (u64::from_be_bytes(offset), u64::from_be_bytes(len))
}

/// How much of a file the target holds: the answer to `GET` and `PUT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Held {
    /// The bytes `[0, received)` are on the target's disk, synced: the sender goes on from here.
    pub received: u64,
    /// The file's size as the target knows it from an earlier `PUT` (none: it has no such file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

impl Held {
    /// Whether the target holds all of a file of `size` bytes (nothing is left to send).
    pub fn complete(&self, size: u64) -> bool {
        self.size == Some(size) && self.received >= size
    }
}

/// The body of `POST` [`done_path`]: every file of the move, as the source has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// The files, in the order they were sent.
    pub files: Vec<DoneFile>,
}

/// One file of [`Done`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoneFile {
    /// Its name ([`is_file_name`]).
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its digest, lowercase hex ([`sha256_file`]: the SHA-256 of its non-zero blocks and
    /// their offsets, and its size).
    pub sha256: String,
}

/// Where the files go and who sends them: the target agent as its Node publishes it, the
/// source agent's own certificate, the VM and the move's token.
#[derive(Debug, Clone, Copy)]
pub struct MoveTo<'a> {
    /// The target agent (`imp.dev/agent-endpoint`, `imp.dev/agent-cert-sha256` of its Node).
    pub target: &'a Target,
    /// The source agent's certificate and key (its agent API certificate).
    pub identity: &'a ClientIdentity,
    /// The VM's namespace.
    pub namespace: &'a str,
    /// The VM's name.
    pub name: &'a str,
    /// The move's token (`status.move.token`).
    pub token: &'a str,
}

/// What [`send_files`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// The data bytes sent by this call (holes and what the target held before are not sent).
    pub bytes_sent: u64,
    /// Every file with its size and SHA-256, as the target checked them.
    pub files: Vec<DoneFile>,
}

/// Why sending a VM's files failed; each says what was done to which file at which agent.
#[derive(Debug, thiserror::Error)]
pub enum MoveSendError {
    /// A file name is not `[a-z0-9][a-z0-9._-]{0,63}`.
    #[error("Invalid file name {0:?}: expected [a-z0-9][a-z0-9._-]{{0,63}}")]
    FileName(String),
    /// Two files have one name.
    #[error("File name {0:?} is given twice")]
    Twice(String),
    /// The token cannot be sent in a header.
    #[error("The move token holds characters that cannot be sent in a header")]
    Token,
    /// The VM's namespace or name is not a Kubernetes name.
    #[error("Invalid VM {0:?}: its namespace and name must be lowercase RFC 1123 names")]
    Vm(String),
    /// The source file could not be read.
    #[error("Reading {file} from {path} failed")]
    Source {
        /// The file's name in the move.
        file: String,
        /// Where it is.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No connection to the target agent.
    #[error("Connecting to the target agent at {endpoint} failed")]
    Connect {
        /// The target's endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: ClientError,
    },
    /// Asking how much of a file the target holds failed.
    #[error("Asking the target agent at {endpoint} how much of {file} it holds failed")]
    Held {
        /// The target's endpoint.
        endpoint: String,
        /// The file.
        file: String,
        /// The cause.
        #[source]
        source: ClientError,
    },
    /// The connection broke while a file was sent: send again to resume.
    #[error(
        "Sending {file} to the target agent at {endpoint} was cut at offset {offset}; sending again resumes from what the target holds"
    )]
    Cut {
        /// The target's endpoint.
        endpoint: String,
        /// The file.
        file: String,
        /// The offset of the frame being sent when the connection broke.
        offset: u64,
        /// The cause.
        #[source]
        source: ClientError,
    },
    /// The target agent refused a request.
    #[error("The target agent at {endpoint} refused {what} ({status}): {message}")]
    Refused {
        /// The target's endpoint.
        endpoint: String,
        /// What was asked, naming the file.
        what: String,
        /// The status.
        status: StatusCode,
        /// The target's message.
        message: String,
    },
    /// The target's copy of a file differs from the source's (422): it was dropped there.
    #[error(
        "The target agent at {endpoint} holds {file} otherwise than the source: {message}; sending again sends it anew"
    )]
    Mismatch {
        /// The target's endpoint.
        endpoint: String,
        /// The file that differs.
        file: String,
        /// The target's message.
        message: String,
    },
    /// Ending the move failed on the way.
    #[error("Ending the move at the target agent at {endpoint} failed")]
    Done {
        /// The target's endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: ClientError,
    },
}

/// Sends `files` (each its name in the move and its path on this node) of VM
/// `to.namespace/to.name` to the target agent, then has it check every size and SHA-256.
///
/// Per file, only what the target does not hold yet is sent, and of that only the data
/// extents (`SEEK_DATA`/`SEEK_HOLE`), a frame of at most [`FRAME_DATA`] in memory at a time,
/// at most `bandwidth` bytes a second when given (0: no cap). A cut connection fails with
/// [`MoveSendError::Cut`]; calling again resumes. The digests are computed off the runtime,
/// while the files are sent. The files must not change meanwhile (the VM is paused).
pub async fn send_files(
    to: &MoveTo<'_>,
    files: &[(String, PathBuf)],
    bandwidth: Option<u64>,
) -> Result<Sent, MoveSendError> {
    check_names(files)?;
    let digests = Digests::start(files.to_vec());
    let mut conn = MoveConnection::open(to).await?;
    let mut pace = bandwidth.and_then(Pace::new);
    let mut bytes_sent = 0;
    for (name, path) in files {
        let held = conn.held(name).await?;
        bytes_sent += conn.send_file(name, path, held, pace.as_mut()).await?;
    }
    // The digests may take longer than the target keeps an idle connection (its server closes
    // one that sends no request for 30 s): the check goes over a connection of its own.
    drop(conn);
    let files = digests.finish().await?;
    MoveConnection::open(to).await?.done(&files).await?;
    Ok(Sent { bytes_sent, files })
}

/// The size and SHA-256 of each of `files`, read off the runtime.
pub async fn digests(files: &[(String, PathBuf)]) -> Result<Vec<DoneFile>, MoveSendError> {
    check_names(files)?;
    Digests::start(files.to_vec()).finish().await
}

fn check_names(files: &[(String, PathBuf)]) -> Result<(), MoveSendError> {
    let mut seen = std::collections::HashSet::new();
    for (name, _) in files {
        if !is_file_name(name) {
            return Err(MoveSendError::FileName(name.clone()));
        }
        if !seen.insert(name.as_str()) {
            return Err(MoveSendError::Twice(name.clone()));
        }
    }
    Ok(())
}

/// Paces what is sent to at most a rate, from the first byte on.
#[derive(Debug)]
pub struct Pace {
    per_second: u64,
    start: Option<tokio::time::Instant>,
    taken: u64,
}

impl Pace {
    /// A pace of `bytes_per_second` (none for 0: no cap).
    pub fn new(bytes_per_second: u64) -> Option<Self> {
        (bytes_per_second > 0).then_some(Self {
            per_second: bytes_per_second,
            start: None,
            taken: 0,
        })
    }

    /// Waits until `n` more bytes keep within the rate.
    async fn take(&mut self, n: u64) {
        let start = *self.start.get_or_insert_with(tokio::time::Instant::now);
        self.taken += n;
        let due = start + Duration::from_secs_f64(self.taken as f64 / self.per_second as f64);
        tokio::time::sleep_until(due).await;
    }
}

/// The body of a request to the target: empty, a JSON, or the frames of a `PUT`.
type MoveBody = UnsyncBoxBody<Bytes, io::Error>;

/// One connection to the target agent, over which a move's requests go one after another.
pub struct MoveConnection {
    sender: SendRequest<MoveBody>,
    endpoint: String,
    namespace: String,
    name: String,
    token: HeaderValue,
}

impl std::fmt::Debug for MoveConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoveConnection")
            .field("endpoint", &self.endpoint)
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl MoveConnection {
    /// Connects to the target agent, pinned to its certificate, presenting `to.identity`.
    pub async fn open(to: &MoveTo<'_>) -> Result<Self, MoveSendError> {
        if !crate::is_kubernetes_name(to.namespace, 63, false)
            || !crate::is_kubernetes_name(to.name, 253, true)
        {
            return Err(MoveSendError::Vm(format!("{}/{}", to.namespace, to.name)));
        }
        let mut token = HeaderValue::from_str(to.token).map_err(|_| MoveSendError::Token)?;
        token.set_sensitive(true);
        let endpoint = to.target.endpoint.clone();
        let sender = crate::client::connect(to.target, to.identity)
            .await
            .map_err(|source| MoveSendError::Connect {
                endpoint: endpoint.clone(),
                source,
            })?;
        Ok(Self {
            sender,
            endpoint,
            namespace: to.namespace.to_owned(),
            name: to.name.to_owned(),
            token,
        })
    }

    /// A request to `uri` (made of checked names) with the Host and token headers.
    fn request(
        &self,
        method: Method,
        uri: &str,
        body: MoveBody,
    ) -> Result<Request<MoveBody>, MoveSendError> {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(HOST, self.endpoint.as_str())
            .header(TOKEN_HEADER, self.token.clone())
            .body(body)
            .map_err(|_| MoveSendError::Vm(format!("{}/{}", self.namespace, self.name)))
    }

    /// How much of `file` the target holds.
    pub async fn held(&mut self, file: &str) -> Result<Held, MoveSendError> {
        if !is_file_name(file) {
            return Err(MoveSendError::FileName(file.to_owned()));
        }
        let endpoint = self.endpoint.clone();
        let failed = |source| MoveSendError::Held {
            endpoint: endpoint.clone(),
            file: file.to_owned(),
            source,
        };
        let uri = file_path(&self.namespace, &self.name, file);
        let req = self.request(Method::GET, &uri, empty())?;
        let (status, body) = self.exchange(req).await.map_err(failed)?;
        if status != StatusCode::OK {
            return Err(self.refused(format!("asking how much of {file} it holds"), status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| failed(ClientError::Answer(Box::new(e))))
    }

    /// Sends what the target does not hold of `file` (at `path`), given what it holds
    /// (`held`, from [`MoveConnection::held`]): the data extents from `held.received` on (from
    /// 0 when the target knows the file with another size). Returns the data bytes sent.
    pub async fn send_file(
        &mut self,
        file: &str,
        path: &Path,
        held: Held,
        pace: Option<&mut Pace>,
    ) -> Result<u64, MoveSendError> {
        if !is_file_name(file) {
            return Err(MoveSendError::FileName(file.to_owned()));
        }
        let source = {
            let path = path.to_owned();
            let (file, path_) = (file.to_owned(), path.clone());
            tokio::task::spawn_blocking(move || {
                let f = std::fs::File::open(&path)?;
                let size = f.metadata()?.len();
                let ranges = crate::sparse::data_ranges(&f)?;
                Ok::<_, io::Error>((Arc::new(f), size, ranges))
            })
            .await
            .unwrap_or_else(|e| Err(io::Error::other(e)))
            .map_err(|source| MoveSendError::Source {
                file,
                path: path_,
                source,
            })?
        };
        let (source, size, ranges) = source;
        if held.complete(size) {
            return Ok(0);
        }
        let from = if held.size == Some(size) {
            held.received.min(size)
        } else {
            0
        };
        // The data extents from `from` on, the first clipped there.
        let extents: Vec<(u64, u64)> = ranges
            .into_iter()
            .filter(|&(_, end)| end > from)
            .map(|(start, end)| (start.max(from), end))
            .collect();
        let cut = |offset, source| MoveSendError::Cut {
            endpoint: self.endpoint.clone(),
            file: file.to_owned(),
            offset,
            source,
        };
        self.sender
            .ready()
            .await
            .map_err(|e| cut(from, ClientError::Http(e)))?;
        let (tx, rx) = mpsc::channel(2);
        let uri = format!(
            "{}?size={size}",
            file_path(&self.namespace, &self.name, file)
        );
        let mut req = self.request(Method::PUT, &uri, Frames(rx).boxed_unsync())?;
        req.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        let response = self.sender.send_request(req);
        let (response, produced) = tokio::join!(response, produce(source, extents, from, tx, pace));
        if let Some(source) = produced.read {
            return Err(MoveSendError::Source {
                file: file.to_owned(),
                path: path.to_owned(),
                source,
            });
        }
        let resp = response.map_err(|e| cut(produced.at, ClientError::Http(e)))?;
        let (status, body) = answer(resp).await.map_err(|e| cut(produced.at, e))?;
        if status != StatusCode::OK {
            return Err(self.refused(format!("receiving {file}"), status, &body));
        }
        Ok(produced.sent)
    }

    /// Ends the move: the target checks each file's size and SHA-256 and takes the files.
    pub async fn done(&mut self, files: &[DoneFile]) -> Result<(), MoveSendError> {
        let endpoint = self.endpoint.clone();
        let failed = |source| MoveSendError::Done {
            endpoint: endpoint.clone(),
            source,
        };
        let json = serde_json::to_vec(&Done {
            files: files.to_vec(),
        })
        .map_err(|e| failed(ClientError::Answer(Box::new(e))))?;
        let body = Full::new(Bytes::from(json))
            .map_err(|never| match never {})
            .boxed_unsync();
        let mut req = self.request(Method::POST, &done_path(&self.namespace, &self.name), body)?;
        req.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let (status, body) = self.exchange(req).await.map_err(failed)?;
        match status {
            StatusCode::OK => Ok(()),
            StatusCode::UNPROCESSABLE_ENTITY => {
                let (message, file) = status_message(&body);
                Err(MoveSendError::Mismatch {
                    endpoint: self.endpoint.clone(),
                    file: file.unwrap_or_else(|| "a file".to_owned()),
                    message,
                })
            }
            _ => Err(self.refused("the end of the move".to_owned(), status, &body)),
        }
    }

    fn refused(&self, what: String, status: StatusCode, body: &[u8]) -> MoveSendError {
        MoveSendError::Refused {
            endpoint: self.endpoint.clone(),
            what,
            status,
            message: status_message(body).0,
        }
    }
}

fn empty() -> MoveBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An answer's status and body (read whole, bounded, so the connection can carry the next
/// request).
impl MoveConnection {
    /// Sends `req` once the connection can take it, and reads its answer.
    async fn exchange(
        &mut self,
        req: Request<UnsyncBoxBody<Bytes, io::Error>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        self.sender.ready().await.map_err(ClientError::Http)?;
        let resp = self
            .sender
            .send_request(req)
            .await
            .map_err(ClientError::Http)?;
        answer(resp).await
    }
}

async fn answer(resp: Response<Incoming>) -> Result<(StatusCode, Bytes), ClientError> {
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(ClientError::Answer)?
        .to_bytes();
    Ok((status, body))
}

/// A `Status` body's message (or the body as text) and the name in its details (the file a
/// 422 is about).
fn status_message(body: &[u8]) -> (String, Option<String>) {
    let json = serde_json::from_slice::<serde_json::Value>(body).ok();
    let message = json
        .as_ref()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned());
    let name = json.and_then(|v| v["details"]["name"].as_str().map(str::to_owned));
    (message, name)
}

/// What [`produce`] did.
struct Produced {
    /// Data bytes handed to the connection.
    sent: u64,
    /// The offset of the frame last being sent.
    at: u64,
    /// Reading the source failed.
    read: Option<io::Error>,
}

/// Reads the data of `extents` of `file` frame by frame, off the runtime, and hands each frame
/// to the request's body, paced; stops when the connection is gone.
async fn produce(
    file: Arc<std::fs::File>,
    extents: Vec<(u64, u64)>,
    from: u64,
    tx: mpsc::Sender<io::Result<Bytes>>,
    mut pace: Option<&mut Pace>,
) -> Produced {
    let mut out = Produced {
        sent: 0,
        at: from,
        read: None,
    };
    for (start, end) in extents {
        let mut at = start;
        while at < end {
            out.at = at;
            let len = (end - at).min(FRAME_DATA);
            let f = file.clone();
            let frame = tokio::task::spawn_blocking(move || read_frame(&f, at, len))
                .await
                .unwrap_or_else(|e| Err(io::Error::other(e)));
            let frame = match frame {
                Ok(frame) => frame,
                Err(e) => {
                    // Break the request off, so the target keeps only whole frames.
                    let _ = tx
                        .send(Err(io::Error::new(e.kind(), "the source failed")))
                        .await;
                    out.read = Some(e);
                    return out;
                }
            };
            if let Some(p) = pace.as_deref_mut() {
                p.take(frame.len() as u64).await;
            }
            if tx.send(Ok(frame)).await.is_err() {
                // The connection is gone: the request says why.
                return out;
            }
            out.sent += len;
            at += len;
        }
        out.at = end;
    }
    out
}

/// A frame of `len` bytes of `file` at `offset`, its header first.
fn read_frame(file: &std::fs::File, offset: u64, len: u64) -> io::Result<Bytes> {
    let n = usize::try_from(len).map_err(io::Error::other)?;
    let mut buf = vec![0u8; FRAME_HEADER_LEN + n];
    buf[..FRAME_HEADER_LEN].copy_from_slice(&frame_header(offset, len));
    file.read_exact_at(&mut buf[FRAME_HEADER_LEN..], offset)?;
    Ok(Bytes::from(buf))
}

/// A `PUT`'s body: the frames [`produce`] hands over, then its end (or an error that breaks
/// the request off).
struct Frames(mpsc::Receiver<io::Result<Bytes>>);

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

/// The files' digests, computed off the runtime while they are sent; abandoned (the reading
/// stops) when dropped unfinished.
struct Digests {
    stop: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<Result<Vec<DoneFile>, MoveSendError>>>,
    /// The first file (to name in the unlikely failure of the task itself).
    first: Option<(String, PathBuf)>,
}

impl Digests {
    fn start(files: Vec<(String, PathBuf)>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let first = files.first().cloned();
        let task = tokio::task::spawn_blocking(move || {
            files
                .into_iter()
                .map(|(name, path)| match digest(&path, &stopped) {
                    Ok((size, sha256)) => Ok(DoneFile { name, size, sha256 }),
                    Err(source) => Err(MoveSendError::Source {
                        file: name,
                        path,
                        source,
                    }),
                })
                .collect()
        });
        Self {
            stop,
            task: Some(task),
            first,
        }
    }

    async fn finish(mut self) -> Result<Vec<DoneFile>, MoveSendError> {
        let Some(task) = self.task.take() else {
            return Ok(Vec::new());
        };
        let first = self.first.take().unwrap_or_default();
        task.await.unwrap_or_else(|e| {
            Err(MoveSendError::Source {
                file: first.0,
                path: first.1,
                source: io::Error::other(e),
            })
        })
    }
}

impl Drop for Digests {
    fn drop(&mut self) {
        if self.task.is_some() {
            self.stop.store(true, Ordering::Relaxed);
        }
    }
}

/// The size and digest (lowercase hex) of the file at `path`, what both ends compare: the
/// SHA-256 of its non-zero [`DIGEST_BLOCK`]-byte blocks, each after its offset (8 bytes
/// big-endian), then of its size. Holes are not read and zero blocks not hashed, so the cost
/// follows the file's data, not its size (a mostly empty disk image is cheap), and the digest
/// does not depend on how either filesystem allocates the file: a block of zeros and a hole
/// read alike, as they do to the VM. Any other difference changes it. Blocking: run it off
/// the runtime.
pub fn sha256_file(path: &Path) -> io::Result<(u64, String)> {
    digest(path, &AtomicBool::new(false))
}

/// The block a file's digest is made of ([`sha256_file`]).
pub const DIGEST_BLOCK: u64 = 4096;

/// [`sha256_file`], stopping early when `stop` is set.
fn digest(path: &Path, stop: &AtomicBool) -> io::Result<(u64, String)> {
    let f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; FRAME_DATA as usize];
    // The next block not hashed yet: two ranges may share a block of their ends.
    let mut next_block = 0u64;
    for (start, end) in crate::sparse::data_ranges(&f)? {
        let mut at = (start / DIGEST_BLOCK).max(next_block) * DIGEST_BLOCK;
        while at < end {
            if stop.load(Ordering::Relaxed) {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "abandoned"));
            }
            let want = (end
                .next_multiple_of(DIGEST_BLOCK)
                .min(size.next_multiple_of(DIGEST_BLOCK))
                - at)
                .min(FRAME_DATA) as usize;
            let n = read_at_most(&f, &mut buf[..want], at)?;
            if n == 0 {
                break;
            }
            for (i, block) in buf[..n].chunks(DIGEST_BLOCK as usize).enumerate() {
                if block.iter().any(|b| *b != 0) {
                    hasher.update((at + i as u64 * DIGEST_BLOCK).to_be_bytes());
                    hasher.update(block);
                }
            }
            at += n as u64;
            next_block = at.div_ceil(DIGEST_BLOCK);
        }
    }
    hasher.update(size.to_be_bytes());
    Ok((size, crate::tls::hex(&hasher.finalize())))
}

/// Reads into `buf` from `offset` until it is full or the file ends; the bytes read.
fn read_at_most(f: &std::fs::File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_digest_reads_data_only_and_tells_zeros_from_nothing_else() {
        let dir = std::env::temp_dir().join(format!("imp-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, parts: &[(u64, &[u8])], len: u64| {
            let path = dir.join(name);
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(len).unwrap();
            for (at, bytes) in parts {
                f.write_all_at(bytes, *at).unwrap();
            }
            path
        };
        let data = vec![7u8; 10_000];
        let zeros = vec![0u8; 8192];
        let len = 64 << 20;
        // The same content: data at 1 MiB; a written block of zeros at 8 MiB, or a hole.
        let a = write("a", &[(1 << 20, &data), (8 << 20, &zeros)], len);
        let b = write("b", &[(1 << 20, &data)], len);
        let (size, da) = sha256_file(&a).unwrap();
        assert_eq!(size, len);
        assert_eq!(
            sha256_file(&b).unwrap().1,
            da,
            "zeros and a hole read alike"
        );
        // A byte changed, data moved, or the size changed: another digest.
        let mut changed = data.clone();
        changed[9_999] = 8;
        let c = write("c", &[(1 << 20, &changed)], len);
        assert_ne!(sha256_file(&c).unwrap().1, da);
        let d = write("d", &[((1 << 20) + 4096, &data)], len);
        assert_ne!(sha256_file(&d).unwrap().1, da);
        let e = write("e", &[(1 << 20, &data)], len + 4096);
        assert_ne!(sha256_file(&e).unwrap().1, da);
        // A file whose data ends inside a block, and one of no data at all.
        let odd = write("odd", &[(0, &data[..10])], 10);
        assert_eq!(sha256_file(&odd).unwrap().0, 10);
        let empty = write("empty", &[], 4096);
        assert_ne!(sha256_file(&empty).unwrap().1, sha256_file(&odd).unwrap().1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_names_are_one_plain_lowercase_component() {
        for good in [
            "disk.img",
            "memory",
            "state.json",
            "a",
            "0_b-c.d",
            &"a".repeat(64),
        ] {
            assert!(is_file_name(good), "{good:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            ".hidden",
            "-a",
            "_a",
            "Disk",
            "a b",
            "a%2fb",
            &"a".repeat(65),
        ] {
            assert!(!is_file_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_frame_header_is_offset_then_length_big_endian() {
        let h = frame_header(0x0102, 0x0304);
        assert_eq!(h[..8], [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(h[8..], [0, 0, 0, 0, 0, 0, 3, 4]);
        assert_eq!(parse_frame_header(&h), (0x0102, 0x0304));
        assert_eq!(
            parse_frame_header(&frame_header(u64::MAX, 1)),
            (u64::MAX, 1)
        );
    }

    #[test]
    fn paths_and_answers_read_as_the_receiver_writes_them() {
        assert_eq!(
            file_path("ns", "vm", "disk.img"),
            "/v1/moves/ns/vm/files/disk.img"
        );
        assert_eq!(done_path("ns", "vm"), "/v1/moves/ns/vm/done");
        let held: Held = serde_json::from_str(r#"{"received": 5}"#).unwrap();
        assert_eq!(
            held,
            Held {
                received: 5,
                size: None
            }
        );
        assert!(!held.complete(5), "a size it does not know is not held");
        assert!(
            Held {
                received: 5,
                size: Some(5)
            }
            .complete(5)
        );
        let (message, name) = status_message(
            br#"{"kind":"Status","message":"disk.img differs","details":{"name":"disk.img"}}"#,
        );
        assert_eq!(
            (message.as_str(), name.as_deref()),
            ("disk.img differs", Some("disk.img"))
        );
        assert_eq!(status_message(b" plain \n"), ("plain".to_owned(), None));
    }

    #[test]
    fn names_are_checked_before_anything_is_read() {
        let files = [("../x".to_owned(), PathBuf::from("/nonexistent"))];
        assert!(matches!(check_names(&files), Err(MoveSendError::FileName(n)) if n == "../x"));
        let twice = [
            ("a".to_owned(), PathBuf::from("/1")),
            ("a".to_owned(), PathBuf::from("/2")),
        ];
        assert!(matches!(check_names(&twice), Err(MoveSendError::Twice(n)) if n == "a"));
        assert!(Pace::new(0).is_none(), "0 means no cap");
    }

    #[tokio::test]
    async fn a_vm_or_token_that_cannot_be_sent_is_refused_before_connecting() {
        let target = Target {
            endpoint: "127.0.0.1:1".into(),
            fingerprint: "00".repeat(32),
        };
        let identity = ClientIdentity::from_der(Vec::new(), Vec::new());
        let to = |namespace, name, token| MoveTo {
            target: &target,
            identity: &identity,
            namespace,
            name,
            token,
        };
        for (ns, name) in [("NS", "vm"), ("ns", "a/b"), ("ns", "")] {
            let e = MoveConnection::open(&to(ns, name, "t")).await.unwrap_err();
            assert!(matches!(e, MoveSendError::Vm(_)), "{e}");
        }
        let e = MoveConnection::open(&to("ns", "vm", "a\nb"))
            .await
            .unwrap_err();
        assert!(matches!(e, MoveSendError::Token), "{e}");
    }
}
