//! The messages exchanged on a guest connection, in both directions.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A protocol version; only the major decides compatibility.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    /// Bumped on any change an older peer cannot understand.
    pub major: u16,
    /// Bumped on additions an older peer can safely ignore.
    pub minor: u16,
}

impl Version {
    /// Whether a peer speaking `other` can talk to us.
    pub fn is_compatible_with(&self, other: &Version) -> bool {
        self.major == other.major
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The most characters of a peer's text that [`escape`] passes on.
pub const ESCAPED_MAX_CHARS: usize = 512;

/// A peer's text as it may be logged or shown: control and other unprintable characters
/// escaped (`\u{1b}`, `\n`, bidirectional overrides), quotes kept, at most
/// [`ESCAPED_MAX_CHARS`] characters and then a note of how much was cut. The guest is untrusted:
/// its hello's software string and its error messages pass through this before they reach a
/// log line or a terminal.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(ESCAPED_MAX_CHARS) + 8);
    let mut chars = text.char_indices();
    for (_, c) in chars.by_ref().take(ESCAPED_MAX_CHARS) {
        match c {
            '"' | '\'' => out.push(c),
            _ => out.extend(c.escape_debug()),
        }
    }
    if let Some((cut, _)) = chars.next() {
        out.push_str(&format!("… ({} more bytes)", text.len() - cut));
    }
    out
}

/// The first message on every connection, sent by both sides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The protocol version the sender speaks.
    pub version: Version,
    /// Who is speaking (e.g. `imp-guest 0.1.0`), for logs and error messages.
    #[serde(default)]
    pub software: String,
}

impl Hello {
    /// A hello for this build's [`crate::PROTOCOL_VERSION`].
    pub fn new(software: impl Into<String>) -> Self {
        Self {
            version: crate::PROTOCOL_VERSION,
            software: software.into(),
        }
    }

    /// The software string as it may be logged ([`escape`]d): the peer chose it.
    pub fn software_escaped(&self) -> String {
        escape(&self.software)
    }
}

/// One environment variable, kept in order so later entries override earlier ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvVar {
    /// The variable's name (no `=`).
    pub name: String,
    /// The variable's value.
    #[serde(default)]
    pub value: String,
}

impl EnvVar {
    /// Builds a variable from a name and a value.
    pub fn new(name: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value: value.into(),
        }
    }
}

/// A terminal size, for TTY execs and resizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSize {
    /// Rows of characters.
    pub rows: u16,
    /// Columns of characters.
    pub cols: u16,
}

/// A command to run inside the guest, streamed over the connection that asked for it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    /// The program and its arguments; a bare name is looked up in the resulting PATH.
    pub argv: Vec<String>,
    /// Variables added on top of the workload's environment (so PATH is the workload's).
    #[serde(default)]
    pub env: Vec<EnvVar>,
    /// The working directory; unset means the workload's.
    #[serde(default)]
    pub cwd: Option<String>,
    /// The user (`uid[:gid]` or `name[:group]`); unset means the workload's.
    #[serde(default)]
    pub user: Option<String>,
    /// Run on a pseudo-terminal (stdout and stderr merged, [`Message::Resize`] honoured).
    #[serde(default)]
    pub tty: bool,
    /// The initial terminal size when `tty` is set.
    #[serde(default)]
    pub window: Option<WindowSize>,
    /// Whether the host will send stdin; if not, the command reads `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal number.
    Signal(i32),
}

impl ExitStatus {
    /// The shell-style code: the exit code, or 128 + the signal number.
    pub fn code(&self) -> i32 {
        match *self {
            ExitStatus::Code(c) => c,
            ExitStatus::Signal(s) => 128 + s,
        }
    }

    /// Whether the process exited with code 0.
    pub fn success(&self) -> bool {
        *self == ExitStatus::Code(0)
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Code(c) => write!(f, "exit code {c}"),
            ExitStatus::Signal(s) => write!(f, "killed by signal {s}"),
        }
    }
}

/// What the guest's workload is doing, as reported by health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum WorkloadState {
    /// The guest has not started the workload yet.
    Starting,
    /// The workload runs with this pid.
    Running {
        /// Its process id inside the guest.
        pid: u32,
    },
    /// The workload ended.
    Exited {
        /// How it ended.
        status: ExitStatus,
    },
    /// The workload could not be started.
    Failed {
        /// Why it could not be started.
        message: String,
    },
}

/// The guest's answer to [`Message::Health`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthReport {
    /// Milliseconds since the guest agent started.
    pub uptime_ms: u64,
    /// The workload's state.
    pub workload: WorkloadState,
}

/// The guest's answer to [`Message::Metrics`], the figures the agent exports per VM.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct MetricsReport {
    /// Share of CPU time not idle over the sample window (0..=1).
    pub cpu_usage_ratio: f64,
    /// Share of CPU time waiting for I/O over the sample window (0..=1).
    pub cpu_iowait_ratio: f64,
    /// MemTotal − MemAvailable.
    pub memory_used_bytes: u64,
    /// MemTotal.
    pub memory_total_bytes: u64,
    /// Bytes in use on the root filesystem.
    pub disk_used_bytes: u64,
    /// Size of the root filesystem.
    pub disk_total_bytes: u64,
}

/// The class of a failure the peer reports, so the host can map it without parsing text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request was malformed or out of place.
    BadRequest,
    /// The program, directory or user does not exist.
    NotFound,
    /// The program exists but may not be executed.
    PermissionDenied,
    /// Starting the program failed for another reason.
    SpawnFailed,
    /// The peer speaks an incompatible protocol version.
    Incompatible,
    /// Something failed inside the peer.
    Internal,
}

/// An error the peer reports instead of an answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Its class.
    pub kind: ErrorKind,
    /// What was being done and to what.
    pub message: String,
}

/// Every message of the protocol; the data variants travel as raw bytes, the rest as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// Both sides, first: the protocol version spoken.
    Hello(Hello),
    /// Host → guest: run a command on this connection.
    Exec(ExecRequest),
    /// Host → guest: ask for a [`Message::HealthReport`].
    Health,
    /// Host → guest: ask for a [`Message::MetricsReport`].
    Metrics,
    /// Host → guest: SIGTERM the workload, wait up to `grace_ms`, SIGKILL it, power off.
    Shutdown {
        /// How long the workload gets to exit after SIGTERM.
        grace_ms: u64,
    },
    /// Host → guest: set the guest's wall clock (stale after a snapshot is restored).
    SetClock {
        /// Nanoseconds since the Unix epoch.
        unix_nanos: u64,
    },
    /// Host → guest: bytes for the exec's stdin.
    #[serde(skip)]
    Stdin(Vec<u8>),
    /// Host → guest: the exec's stdin is finished (EOF; Ctrl-D on a TTY).
    StdinEof,
    /// Host → guest: the exec's terminal changed size.
    Resize(WindowSize),
    /// Host → guest: send this signal number to the exec'd process.
    Signal {
        /// The Linux signal number.
        signal: i32,
    },
    /// Guest → host: the exec'd process started.
    Started {
        /// Its process id inside the guest.
        pid: u32,
    },
    /// Guest → host: bytes the exec wrote to stdout (or to its TTY).
    #[serde(skip)]
    Stdout(Vec<u8>),
    /// Guest → host: bytes the exec wrote to stderr.
    #[serde(skip)]
    Stderr(Vec<u8>),
    /// Guest → host: the exec'd process ended; the last message of an exec.
    Exit {
        /// How it ended.
        status: ExitStatus,
    },
    /// Guest → host: the answer to [`Message::Health`].
    HealthReport(HealthReport),
    /// Guest → host: the answer to [`Message::Metrics`].
    MetricsReport(MetricsReport),
    /// Guest → host: the shutdown was accepted and has begun.
    ShutdownAccepted,
    /// Guest → host: the clock was set.
    ClockSet,
    /// Guest → host, on the guest's own connection: the workload ended.
    WorkloadExited {
        /// How it ended.
        status: ExitStatus,
    },
    /// Host → guest: the exit report was received.
    Ack,
    /// Either side: the request failed.
    Error(ErrorReply),
}

impl Message {
    /// A short name for the variant, for "expected X, got Y" errors (never the payload).
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Exec(_) => "exec",
            Message::Health => "health",
            Message::Metrics => "metrics",
            Message::Shutdown { .. } => "shutdown",
            Message::SetClock { .. } => "set_clock",
            Message::Stdin(_) => "stdin",
            Message::StdinEof => "stdin_eof",
            Message::Resize(_) => "resize",
            Message::Signal { .. } => "signal",
            Message::Started { .. } => "started",
            Message::Stdout(_) => "stdout",
            Message::Stderr(_) => "stderr",
            Message::Exit { .. } => "exit",
            Message::HealthReport(_) => "health_report",
            Message::MetricsReport(_) => "metrics_report",
            Message::ShutdownAccepted => "shutdown_accepted",
            Message::ClockSet => "clock_set",
            Message::WorkloadExited { .. } => "workload_exited",
            Message::Ack => "ack",
            Message::Error(_) => "error",
        }
    }

    /// An error message of the given kind.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        Message::Error(ErrorReply {
            kind,
            message: message.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untrusted_text_is_escaped_and_bounded() {
        assert_eq!(escape("imp-guest 0.1.0"), "imp-guest 0.1.0");
        assert_eq!(escape("say \"hi\" it's"), "say \"hi\" it's", "quotes stay");
        assert_eq!(
            escape("a\u{1b}[31mred\r\n\t\u{0}\u{7f}\u{202e}\\"),
            "a\\u{1b}[31mred\\r\\n\\t\\0\\u{7f}\\u{202e}\\\\"
        );
        assert_eq!(escape("grüße ✓"), "grüße ✓", "printable non-ASCII stays");
        let long = "é".repeat(ESCAPED_MAX_CHARS + 10);
        let got = escape(&long);
        assert!(got.starts_with(&"é".repeat(ESCAPED_MAX_CHARS)));
        assert!(got.ends_with("… (20 more bytes)"), "{got}");
        assert_eq!(
            escape(&"x".repeat(ESCAPED_MAX_CHARS)),
            "x".repeat(ESCAPED_MAX_CHARS)
        );
        // Escaping a whole frame's worth of control bytes stays bounded.
        assert!(escape(&"\u{1b}".repeat(1 << 20)).len() < 8 * ESCAPED_MAX_CHARS);
        let hello = Hello::new("evil\u{1b}]0;title\u{7}");
        assert_eq!(hello.software_escaped(), "evil\\u{1b}]0;title\\u{7}");
    }

    #[test]
    fn exit_status_codes_follow_the_shell() {
        assert_eq!(ExitStatus::Code(3).code(), 3);
        assert_eq!(ExitStatus::Signal(9).code(), 137);
        assert!(ExitStatus::Code(0).success());
        assert!(!ExitStatus::Signal(0).success());
    }

    #[test]
    fn versions_are_compatible_by_major_only() {
        let v = Version { major: 1, minor: 0 };
        assert!(v.is_compatible_with(&Version { major: 1, minor: 7 }));
        assert!(!v.is_compatible_with(&Version { major: 2, minor: 0 }));
    }

    #[test]
    fn control_messages_have_a_readable_json_shape() {
        let json = serde_json::to_string(&Message::Exit {
            status: ExitStatus::Code(3),
        })
        .unwrap();
        assert_eq!(json, r#"{"type":"exit","status":{"code":3}}"#);
        let json = serde_json::to_string(&Message::Shutdown { grace_ms: 5 }).unwrap();
        assert_eq!(json, r#"{"type":"shutdown","grace_ms":5}"#);
        let json = serde_json::to_string(&Message::SetClock { unix_nanos: 7 }).unwrap();
        assert_eq!(json, r#"{"type":"set_clock","unix_nanos":7}"#);
    }
}
