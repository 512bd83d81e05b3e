//! A small QMP (QEMU Machine Protocol) client: JSON lines on a Unix socket.
//!
//! After connecting, QEMU sends a greeting; the client answers with `qmp_capabilities` and can
//! then `execute` commands. Asynchronous events (`{"event": …}`) may arrive between a command
//! and its answer; they are logged and skipped.

use std::io::IoSlice;
use std::os::fd::{AsRawFd as _, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be used.
    #[error("QMP socket {socket}: {what}")]
    Io {
        /// The socket.
        socket: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// QEMU closed the connection.
    #[error("QMP socket {0}: QEMU closed the connection")]
    Closed(PathBuf),
    /// QEMU did not answer in time.
    #[error("QMP command {command} got no answer within {timeout:?}")]
    Timeout {
        /// The command.
        command: String,
        /// How long we waited.
        timeout: Duration,
    },
    /// QEMU sent something that is not QMP.
    #[error("QMP socket {socket}: unexpected message {message}")]
    Protocol {
        /// The socket.
        socket: PathBuf,
        /// What arrived.
        message: String,
    },
    /// QEMU refused the command.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
}

/// One command as QMP wants it: a JSON object on a line.
fn request(command: &str, arguments: Option<Value>) -> Vec<u8> {
    let mut request = json!({ "execute": command });
    if let Some(args) = arguments {
        request["arguments"] = args;
    }
    let mut bytes = request.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

/// A negotiated QMP connection.
#[derive(Debug)]
pub struct Qmp {
    socket: PathBuf,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    timeout: Duration,
}

impl Qmp {
    /// Speaks QMP on `stream`, the driver's end of a socket pair whose other end QEMU
    /// inherited (`-chardev socket,fd=N`): reads the greeting and enters command mode.
    /// `socket` names the connection in messages. There is no way to connect by path: a
    /// path in a directory the VMM can write could be pointed at another VM's socket.
    pub async fn over(
        stream: UnixStream,
        socket: &Path,
        timeout: Duration,
    ) -> Result<Self, QmpError> {
        let (r, w) = stream.into_split();
        let mut qmp = Qmp {
            socket: socket.to_path_buf(),
            reader: BufReader::new(r),
            writer: w,
            timeout,
        };
        let greeting = tokio::time::timeout(timeout, qmp.read_message())
            .await
            .map_err(|_| QmpError::Timeout {
                command: "greeting".into(),
                timeout,
            })??;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol {
                socket: qmp.socket.clone(),
                message: greeting.to_string(),
            });
        }
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .await
            .map_err(|source| QmpError::Io {
                socket: self.socket.clone(),
                what: "reading",
                source,
            })?;
        if n == 0 {
            return Err(QmpError::Closed(self.socket.clone()));
        }
        serde_json::from_str(&line).map_err(|_| QmpError::Protocol {
            socket: self.socket.clone(),
            message: line.trim().to_string(),
        })
    }

    /// Runs `command` with `arguments` and returns its `return` value.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let bytes = request(command, arguments);
        self.writer
            .write_all(&bytes)
            .await
            .map_err(|source| self.io("writing", source))?;
        self.answer(command).await
    }

    /// Runs `command` with `fd` attached (SCM_RIGHTS), as `getfd` and `add-fd` want: QEMU
    /// keeps its own copy of the descriptor. How a confined QEMU, which can open nothing of
    /// the host, is handed a file (a snapshot to write).
    pub async fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        let bytes = request(command, arguments);
        let stream: &UnixStream = self.writer.as_ref();
        let sent = loop {
            stream
                .writable()
                .await
                .map_err(|source| self.io("writing", source))?;
            let attempt = stream.try_io(tokio::io::Interest::WRITABLE, || {
                let fds = [fd.as_raw_fd()];
                let cmsg = [ControlMessage::ScmRights(&fds)];
                sendmsg::<()>(
                    stream.as_raw_fd(),
                    &[IoSlice::new(&bytes)],
                    &cmsg,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            });
            match attempt {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(source) => return Err(self.io("sending a descriptor", source)),
            }
        };
        // The descriptor went with the first byte; the rest of the line follows plainly.
        self.writer
            .write_all(&bytes[sent..])
            .await
            .map_err(|source| self.io("writing", source))?;
        self.answer(command).await
    }

    fn io(&self, what: &'static str, source: std::io::Error) -> QmpError {
        QmpError::Io {
            socket: self.socket.clone(),
            what,
            source,
        }
    }

    /// Reads until the answer to `command` (events before it are logged and skipped).
    async fn answer(&mut self, command: &str) -> Result<Value, QmpError> {
        let timeout = self.timeout;
        tokio::time::timeout(timeout, async {
            loop {
                let message = self.read_message().await?;
                if let Some(ret) = message.get("return") {
                    return Ok(ret.clone());
                }
                if let Some(err) = message.get("error") {
                    let s = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                    return Err(QmpError::Command {
                        command: command.to_string(),
                        class: s("class"),
                        desc: s("desc"),
                    });
                }
                if let Some(event) = message.get("event") {
                    tracing::debug!(socket = %self.socket.display(), %event, "qmp event");
                }
            }
        })
        .await
        .map_err(|_| QmpError::Timeout {
            command: command.to_string(),
            timeout,
        })?
    }

    /// `query-status`'s `status` (`running`, `paused`, `inmigrate`, `postmigrate`, …).
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let ret = self.execute("query-status", None).await?;
        Ok(ret
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string())
    }
}
