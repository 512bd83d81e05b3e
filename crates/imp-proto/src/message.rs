//! The messages exchanged on a guest connection, in both directions.

pub use crate::config::EnvVar;
use crate::config::{GuestConfig, NetworkConfig};
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

    /// Whether a peer speaking this version understands what was added in `needed`: the same
    /// major and at least its minor.
    pub fn supports(&self, needed: Version) -> bool {
        self.major == needed.major && self.minor >= needed.minor
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

/// The fewest bytes of host randomness a [`Message::Reidentify`] carries (512 bits).
pub const MIN_ENTROPY_BYTES: usize = 64;

/// The most bytes of randomness a [`Message::Reidentify`] may carry.
pub const MAX_ENTROPY_BYTES: usize = 4096;

/// Bytes from the host's random number generator for the guest's entropy pool. Shown by
/// length only: the bytes seed the guest's generator and must not reach a log.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Entropy(pub Vec<u8>);

impl fmt::Debug for Entropy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Entropy(<{} bytes>)", self.0.len())
    }
}

impl Entropy {
    /// Checks the length against [`MIN_ENTROPY_BYTES`] and [`MAX_ENTROPY_BYTES`].
    pub fn validate(&self) -> Result<(), String> {
        let n = self.0.len();
        if (MIN_ENTROPY_BYTES..=MAX_ENTROPY_BYTES).contains(&n) {
            Ok(())
        } else {
            Err(format!(
                "{n} bytes of entropy; between {MIN_ENTROPY_BYTES} and {MAX_ENTROPY_BYTES} are needed"
            ))
        }
    }
}

/// What a guest restored from a snapshot that other VMs share becomes: the names and
/// addresses the host gave this VM. Anything left out keeps its current value.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Identity {
    /// The new hostname.
    pub hostname: Option<String>,
    /// The new MAC (`aa:bb:cc:dd:ee:ff`) of the network's interface; only with `network`,
    /// because changing it takes the interface down, which drops its routes.
    pub mac: Option<String>,
    /// The new static network of its interface. Without it the interface, its addresses and
    /// its TCP connections are left alone.
    pub network: Option<NetworkConfig>,
}

impl Identity {
    /// Checks what parsing alone cannot: the hostname and network by the guest config's rules
    /// (and no whitespace or control character in a name written to /etc files), the MAC's
    /// form (unicast, not all zeros).
    pub fn validate(&self) -> Result<(), String> {
        let as_config = GuestConfig {
            hostname: self.hostname.clone(),
            network: self.network.clone(),
            ..GuestConfig::default()
        };
        as_config.validate().map_err(|e| e.to_string())?;
        let unprintable = |s: &str| s.chars().any(|c| c.is_whitespace() || c.is_control());
        if let Some(h) = &self.hostname
            && unprintable(h)
        {
            return Err(format!(
                "hostname {h:?} holds whitespace or a control character"
            ));
        }
        if let Some(n) = &self.network
            && let Some(s) = n.search.iter().find(|s| s.is_empty() || unprintable(s))
        {
            return Err(format!(
                "search domain {s:?} is empty or holds whitespace or a control character"
            ));
        }
        if let Some(mac) = &self.mac {
            let bytes =
                parse_mac(mac).ok_or_else(|| format!("MAC {mac:?} is not aa:bb:cc:dd:ee:ff"))?;
            if bytes[0] & 1 != 0 || bytes == [0; 6] {
                return Err(format!("MAC {mac} is multicast or all zeros"));
            }
            if self.network.is_none() {
                return Err(
                    "a new MAC needs the network too: the interface goes down to change it, \
                     which drops its routes"
                        .to_string(),
                );
            }
        }
        Ok(())
    }
}

/// The six bytes of a MAC written `aa:bb:cc:dd:ee:ff` (either case); `None` if it is not one.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut out {
        let part = parts.next()?;
        if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

/// How one step of a [`Message::Reidentify`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// It was done.
    Done,
    /// It was not asked for, or could not apply; the detail says why.
    Skipped,
    /// It was tried and failed; the detail is the error.
    Failed,
}

/// One step of a [`Message::Reidentify`] and how it went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// Which step (one of [`steps`]; a newer guest may report others).
    pub name: String,
    /// How it went.
    pub status: StepStatus,
    /// What was done, why it was skipped, or the error.
    #[serde(default)]
    pub detail: String,
}

/// The names of the steps a [`Message::Reidentify`] runs, in the order the guest runs them.
pub mod steps {
    /// Host bytes mixed into the entropy pool and credited (`RNDADDENTROPY`).
    pub const ENTROPY: &str = "entropy";
    /// The kernel's CRNG reseeded from the pool at once (`RNDRESEEDCRNG`).
    pub const CRNG: &str = "crng";
    /// The wall clock set.
    pub const CLOCK: &str = "clock";
    /// The interface taken down, so nothing leaves it with the source's addresses.
    pub const LINK_DOWN: &str = "link_down";
    /// The TCP connections carried over from the source on its address destroyed.
    pub const CONNECTIONS: &str = "connections";
    /// The interface's new MAC.
    pub const MAC: &str = "mac";
    /// The source's addresses removed from the interface (its routes went with the link).
    pub const ADDRESSES: &str = "addresses";
    /// The new address, netmask and default route set and the interface brought up.
    pub const NETWORK: &str = "network";
    /// The kernel hostname set.
    pub const HOSTNAME: &str = "hostname";
    /// /etc/hosts' own entry rewritten.
    pub const HOSTS: &str = "hosts";
    /// /etc/resolv.conf rewritten.
    pub const RESOLV_CONF: &str = "resolv_conf";
}

/// An HTTP GET the guest makes to its own loopback for a probe ([`Message::HttpGet`]): the
/// workload's port as the workload sees it, with no traffic on the VM's network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpGetRequest {
    /// The TCP port on 127.0.0.1.
    pub port: u16,
    /// The request path (`/healthz`); must start with `/` and hold no whitespace or control
    /// characters.
    pub path: String,
    /// How long the connection, the request and the status line may take, in milliseconds.
    pub timeout_ms: u64,
}

impl HttpGetRequest {
    /// Why the request cannot be sent as is, if it cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.port == 0 {
            return Err("port 0".into());
        }
        if !self.path.starts_with('/') {
            return Err(format!(
                "path {:?} does not start with /",
                escape(&self.path)
            ));
        }
        if self.path.len() > 2048
            || self
                .path
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "path {:?} is too long or holds whitespace or control characters",
                escape(&self.path)
            ));
        }
        Ok(())
    }
}

/// The outcome of a [`Message::HttpGet`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpGetResult {
    /// The response's status code, when a status line came back.
    pub status: Option<u16>,
    /// Why there is none (connection refused, timed out, not HTTP), or a note on it.
    pub detail: String,
}

impl HttpGetResult {
    /// Whether it counts as a probe success: a status from 200 to 399, as Kubernetes counts.
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| (200..400).contains(&s))
    }
}

/// The guest's answer to [`Message::Reidentify`]: every step in the order it ran.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReidentifyReport {
    /// The steps.
    pub steps: Vec<Step>,
}

impl ReidentifyReport {
    /// The step of this name, if the guest reported it.
    pub fn step(&self, name: &str) -> Option<&Step> {
        self.steps.iter().find(|s| s.name == name)
    }

    /// The steps that failed.
    pub fn failed(&self) -> impl Iterator<Item = &Step> {
        self.steps.iter().filter(|s| s.status == StepStatus::Failed)
    }

    /// Whether no step failed.
    pub fn is_complete(&self) -> bool {
        self.failed().next().is_none()
    }
}

/// One line per step, the guest's words [`escape`]d: it is shown and logged on the host.
impl fmt::Display for ReidentifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.steps.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            let status = match s.status {
                StepStatus::Done => "done",
                StepStatus::Skipped => "skipped",
                StepStatus::Failed => "FAILED",
            };
            write!(f, "{}: {status}", escape(&s.name))?;
            if !s.detail.is_empty() {
                write!(f, " ({})", escape(&s.detail))?;
            }
        }
        Ok(())
    }
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
    /// Host → guest (since 1.2): become a new machine after a restore from a snapshot that
    /// other VMs share: mix `entropy` into the entropy pool and reseed the CRNG, set the clock,
    /// take `identity`, destroy the TCP connections carried over on the source's address.
    Reidentify {
        /// The VM's own names and addresses.
        identity: Identity,
        /// Fresh randomness from the host, at least [`MIN_ENTROPY_BYTES`].
        entropy: Entropy,
        /// The wall clock, in nanoseconds since the Unix epoch.
        unix_nanos: u64,
    },
    /// Host → guest (since 1.3): an HTTP GET to the guest's own loopback, for a probe.
    HttpGet(HttpGetRequest),
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
    /// Guest → host: what [`Message::Reidentify`] did, step by step.
    Reidentified(ReidentifyReport),
    /// Guest → host: the outcome of [`Message::HttpGet`].
    HttpGetResult(HttpGetResult),
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
            Message::Reidentify { .. } => "reidentify",
            Message::HttpGet(_) => "http_get",
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
            Message::Reidentified(_) => "reidentified",
            Message::HttpGetResult(_) => "http_get_result",
            Message::WorkloadExited { .. } => "workload_exited",
            Message::Ack => "ack",
            Message::Error(_) => "error",
        }
    }

    /// The protocol version that introduced this message: a peer speaking an older minor
    /// cannot read it (it fails to parse it and drops the connection).
    pub fn since(&self) -> Version {
        let minor = match self {
            Message::SetClock { .. } | Message::ClockSet => 1,
            Message::Reidentify { .. } | Message::Reidentified(_) => 2,
            Message::HttpGet(_) | Message::HttpGetResult(_) => 3,
            _ => 0,
        };
        Version {
            major: crate::PROTOCOL_VERSION.major,
            minor,
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

    fn network(address: [u8; 4]) -> NetworkConfig {
        NetworkConfig {
            interface: "eth0".into(),
            address: address.into(),
            prefix_len: 24,
            gateway: Some([10, 0, 0, 1].into()),
            dns: vec!["10.0.0.1".parse().unwrap()],
            search: vec!["svc.local".into()],
            mtu: None,
        }
    }

    #[test]
    fn macs_parse_only_in_their_usual_form() {
        assert_eq!(parse_mac("02:00:0A:ff:00:07"), Some([2, 0, 10, 255, 0, 7]));
        for bad in [
            "",
            "02:00:0a:ff:00",
            "02:00:0a:ff:00:07:08",
            "02-00-0a-ff-00-07",
            "2:00:0a:ff:00:07",
            "02:00:0a:ff:00:0g",
            "+2:00:0a:ff:00:07",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn identities_are_checked_before_they_are_applied() {
        let good = Identity {
            hostname: Some("clone-1".into()),
            mac: Some("02:00:0a:00:00:07".into()),
            network: Some(network([10, 0, 0, 7])),
        };
        good.validate().unwrap();
        Identity::default().validate().unwrap();
        type Spoil = fn(&mut Identity);
        let cases: [(Spoil, &str); 7] = [
            (|i| i.hostname = Some("a\nb".into()), "whitespace"),
            (|i| i.hostname = Some(String::new()), "`hostname`"),
            (|i| i.mac = Some("03:00:0a:00:00:07".into()), "multicast"),
            (|i| i.mac = Some("00:00:00:00:00:00".into()), "all zeros"),
            (|i| i.mac = Some("nope".into()), "is not aa:bb"),
            (|i| i.network = None, "needs the network"),
            (
                |i| {
                    if let Some(n) = &mut i.network {
                        n.search = vec!["a\nnameserver 6.6.6.6".into()];
                    }
                },
                "search domain",
            ),
        ];
        for (spoil, want) in cases {
            let mut bad = good.clone();
            spoil(&mut bad);
            let err = bad.validate().unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn entropy_is_bounded_and_never_shown() {
        assert!(Entropy(vec![0; MIN_ENTROPY_BYTES]).validate().is_ok());
        assert!(Entropy(vec![0; MAX_ENTROPY_BYTES]).validate().is_ok());
        assert!(Entropy(vec![0; MIN_ENTROPY_BYTES - 1]).validate().is_err());
        assert!(Entropy(vec![0; MAX_ENTROPY_BYTES + 1]).validate().is_err());
        let m = Message::Reidentify {
            identity: Identity::default(),
            entropy: Entropy(vec![0xab; 64]),
            unix_nanos: 5,
        };
        let shown = format!("{m:?}");
        assert!(shown.contains("Entropy(<64 bytes>)"), "{shown}");
        assert!(!shown.contains("171"), "the bytes leak: {shown}");
    }

    #[test]
    fn new_messages_say_which_version_brought_them() {
        let v = |minor| Version { major: 1, minor };
        assert_eq!(Message::Health.since(), v(0));
        assert_eq!(Message::SetClock { unix_nanos: 1 }.since(), v(1));
        assert_eq!(
            Message::Reidentified(ReidentifyReport::default()).since(),
            v(2)
        );
        assert!(v(2).supports(v(1)) && v(2).supports(v(2)));
        assert!(!v(1).supports(v(2)));
        assert!(!Version { major: 2, minor: 5 }.supports(v(1)));
        assert!(
            crate::PROTOCOL_VERSION.supports(
                Message::Reidentify {
                    identity: Identity::default(),
                    entropy: Entropy::default(),
                    unix_nanos: 0
                }
                .since()
            )
        );
    }

    #[test]
    fn a_report_tells_its_failures_and_shows_the_guests_words_escaped() {
        let step = |name: &str, status, detail: &str| Step {
            name: name.into(),
            status,
            detail: detail.into(),
        };
        let report = ReidentifyReport {
            steps: vec![
                step(steps::ENTROPY, StepStatus::Done, "512 bits credited"),
                step(steps::MAC, StepStatus::Failed, "refused\u{1b}[2J"),
                step(steps::HOSTNAME, StepStatus::Skipped, ""),
            ],
        };
        assert!(!report.is_complete());
        assert_eq!(
            report.failed().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["mac"]
        );
        assert_eq!(
            report.step("entropy").map(|s| s.status),
            Some(StepStatus::Done)
        );
        assert_eq!(
            report.to_string(),
            "entropy: done (512 bits credited); mac: FAILED (refused\\u{1b}[2J); hostname: skipped"
        );
    }

    #[test]
    fn a_reidentify_request_reads_as_json() {
        let m = Message::Reidentify {
            identity: Identity {
                hostname: Some("c1".into()),
                mac: None,
                network: None,
            },
            entropy: Entropy(vec![1, 2]),
            unix_nanos: 9,
        };
        let json = serde_json::to_string(&m).unwrap();
        assert_eq!(
            json,
            r#"{"type":"reidentify","identity":{"hostname":"c1","mac":null,"network":null},"entropy":[1,2],"unix_nanos":9}"#
        );
        assert_eq!(serde_json::from_str::<Message>(&json).unwrap(), m);
        // A newer guest's unknown step names still parse.
        let report: Message = serde_json::from_str(
            r#"{"type":"reidentified","steps":[{"name":"machine_id","status":"done"}]}"#,
        )
        .unwrap();
        assert!(matches!(report, Message::Reidentified(r) if r.steps[0].detail.is_empty()));
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
