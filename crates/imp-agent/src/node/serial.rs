//! The serial consoles of this node's VMs in the agent's own log, so that
//! `kubectl logs ds/imp-agent` shows what a one-shot VM printed, its `IMP_SUCCESS` marker
//! included, after the VM and its files are gone.
//!
//! The console is the guest's, and its bytes are hostile input to a node's log. Each line is
//! escaped with [`imp_proto::message::escape`] (control characters, terminal escapes and
//! bidirectional overrides written as escapes; at most 512 characters) and logged as the last
//! field of one log line. Each VM has a [`LineBudget`]: a token bucket of lines per second with
//! a burst; the lines it drops are counted in a log line of their own, at most once a second.
//! The exit marker's lines (`IMP_EXIT <code>`, `IMP_SUCCESS`) pass a spent bucket, a few per VM
//! so a guest cannot flood with them, so a chatty workload's result still reaches the log.
//!
//! Who logs: the agent, not the shim (the shim's own output goes to a file in the VM's
//! directory, which is what keeps VMs alive across an agent restart). The record poller of
//! [`super::reconciler`] calls [`Consoles::pump`] on each tick, and removing a VM's files calls
//! [`Consoles::finish`] first, so the console's last lines are read before it is deleted. The
//! consoles found by the first pump (an agent restarted while its VMs ran) are followed from
//! their current end: the agent before it logged the rest.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use imp_api::shared::VmLifecycle;
use imp_proto::marker::{EXIT_PREFIX, SUCCESS_LINE};

use crate::runtime::console::{self, Follower};
use crate::runtime::state::{Owner, VmRecord};

/// Marker lines per VM that pass a spent budget.
pub const MARKER_ALLOWANCE: u32 = 4;

/// How often at most a VM's dropped lines are reported.
pub const DROP_REPORT_EVERY: Duration = Duration::from_secs(1);

/// Most bytes [`Consoles::finish`] reads of an ended VM's console; beyond that only its last
/// [`FINISH_TAIL`] bytes are read (the lines a budget would pass, and the marker, are there).
pub const FINISH_READ_MAX: u64 = 4 << 20;

/// What is read of an ended VM's console that is too far ahead of its follower.
pub const FINISH_TAIL: u64 = 64 << 10;

/// Which VMs' consoles reach the agent's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One-shot (ephemeral) VMs only: their consoles end, services' consoles never do.
    Ephemeral,
    /// Every VM.
    All,
    /// None.
    Off,
}

impl Mode {
    /// Whether the console of a VM of `lifecycle` is relayed.
    pub fn relays(self, lifecycle: VmLifecycle) -> bool {
        match self {
            Self::Ephemeral => lifecycle == VmLifecycle::Ephemeral,
            Self::All => true,
            Self::Off => false,
        }
    }
}

/// How VMs' consoles reach the agent's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Which VMs.
    pub mode: Mode,
    /// Lines per second one VM may log, on average.
    pub lines_per_sec: u32,
    /// Lines one VM may log at once (a boot's worth).
    pub burst: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            mode: Mode::Ephemeral,
            lines_per_sec: 20,
            burst: 200,
        }
    }
}

/// One VM's line budget: a token bucket (`lines_per_sec`, up to `burst` saved), plus a small
/// allowance for marker lines once it is spent, and the count of lines it dropped.
#[derive(Debug, Clone)]
pub struct LineBudget {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
    markers: u32,
    dropped: u64,
    reported: Option<Instant>,
}

impl LineBudget {
    /// A full bucket at `now`.
    pub fn new(lines_per_sec: u32, burst: u32, now: Instant) -> Self {
        Self {
            rate: f64::from(lines_per_sec),
            burst: f64::from(burst),
            tokens: f64::from(burst),
            last: now,
            markers: MARKER_ALLOWANCE,
            dropped: 0,
            reported: None,
        }
    }

    /// Whether a line may be logged at `now` (a `marker` line may use the allowance); a line
    /// refused is counted as dropped.
    pub fn admit(&mut self, marker: bool, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.last = self.last.max(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return true;
        }
        if marker && self.markers > 0 {
            self.markers -= 1;
            return true;
        }
        self.dropped += 1;
        false
    }

    /// The lines dropped since the last report, when there are some and a report is due: at
    /// most once per [`DROP_REPORT_EVERY`], or now if `last` (the console has ended).
    pub fn dropped_report(&mut self, now: Instant, last: bool) -> Option<u64> {
        if self.dropped == 0 {
            return None;
        }
        let recent = self
            .reported
            .is_some_and(|t| now.saturating_duration_since(t) < DROP_REPORT_EVERY);
        if recent && !last {
            return None;
        }
        self.reported = Some(now);
        Some(std::mem::take(&mut self.dropped))
    }
}

/// Whether a console line (without its line end) is one of the exit marker's lines.
pub fn is_marker(line: &str) -> bool {
    line == SUCCESS_LINE
        || line
            .strip_prefix(EXIT_PREFIX)
            .is_some_and(|code| code.trim().parse::<i32>().is_ok())
}

/// What the relay has to say about one VM's console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Said {
    /// One console line, escaped.
    Line(String),
    /// Lines the VM's budget dropped since the last report.
    Dropped(u64),
    /// Bytes of an ended VM's console that were not read (more than [`FINISH_READ_MAX`]).
    Skipped(u64),
}

/// One thing to log, for the VM `namespace/vm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Out {
    /// The ImpVM's namespace.
    pub namespace: String,
    /// The ImpVM's name.
    pub vm: String,
    /// What to log.
    pub said: Said,
}

/// Which boot of a VM a console belongs to: its restart attempt and its record's creation (a
/// resume keeps both, and appends to the same console).
type Boot = (i32, u64);

fn boot_of(r: &VmRecord, owner: &Owner) -> Boot {
    (owner.attempt, r.created_unix)
}

/// One followed console.
#[derive(Debug)]
struct Tail {
    namespace: String,
    vm: String,
    path: PathBuf,
    boot: Boot,
    follower: Follower,
    budget: LineBudget,
    /// Whether its VM's console is relayed (known once the ImpVM has been seen).
    relayed: bool,
    /// Read to its end by [`Consoles::finish`]: its files are going.
    done: bool,
}

impl Tail {
    fn new(r: &VmRecord, owner: &Owner, from_end: bool, policy: Policy, now: Instant) -> Self {
        let path = &r.serial_log;
        let follower = if from_end {
            Follower::from_end(path).unwrap_or_else(|_| Follower::new(path))
        } else {
            Follower::new(path)
        };
        Self {
            namespace: owner.namespace.clone(),
            vm: owner.name.clone(),
            path: path.clone(),
            boot: boot_of(r, owner),
            follower,
            budget: LineBudget::new(policy.lines_per_sec, policy.burst, now),
            relayed: false,
            done: false,
        }
    }

    fn out(&self, said: Said) -> Out {
        Out {
            namespace: self.namespace.clone(),
            vm: self.vm.clone(),
            said,
        }
    }

    /// The lines the budget passes, escaped; blank lines are left out.
    fn relay<'a>(
        &mut self,
        lines: impl IntoIterator<Item = &'a str>,
        now: Instant,
        out: &mut Vec<Out>,
    ) {
        for line in lines {
            let line = line.trim_end_matches(['\n', '\r']);
            if line.trim().is_empty() {
                continue;
            }
            if self.budget.admit(is_marker(line), now) {
                out.push(self.out(Said::Line(imp_proto::message::escape(line))));
            }
        }
    }

    fn report_drops(&mut self, now: Instant, last: bool, out: &mut Vec<Out>) {
        if let Some(n) = self.budget.dropped_report(now, last) {
            out.push(self.out(Said::Dropped(n)));
        }
    }

    /// Reads the console to its end (or its last [`FINISH_TAIL`] bytes when far behind).
    fn drain(&mut self, now: Instant, out: &mut Vec<Out>) {
        let len = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        let behind = len.saturating_sub(self.follower.offset());
        if behind > FINISH_READ_MAX {
            out.push(self.out(Said::Skipped(behind - FINISH_TAIL)));
            let text = console::tail(&self.path, FINISH_TAIL).unwrap_or_default();
            self.relay(text.split_inclusive('\n'), now, out);
        } else {
            // At most FINISH_READ_MAX bytes were left; the bound holds even if a VMM that
            // should be gone still writes.
            let start = self.follower.offset();
            while let Ok(lines) = self.follower.poll() {
                self.relay(lines.iter().map(String::as_str), now, out);
                let read = self.follower.offset().saturating_sub(start);
                if !self.follower.behind() || read > FINISH_READ_MAX {
                    break;
                }
            }
            if let Some(rest) = self.follower.rest() {
                self.relay([rest.as_str()], now, out);
            }
        }
        self.report_drops(now, true, out);
    }
}

/// The consoles of this node's VMs, followed into the agent's log.
#[derive(Debug)]
pub struct Consoles {
    policy: Policy,
    tails: Mutex<HashMap<String, Tail>>,
    primed: AtomicBool,
}

impl Consoles {
    /// Follows consoles as `policy` says.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            tails: Mutex::new(HashMap::new()),
            primed: AtomicBool::new(false),
        }
    }

    fn tails(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tail>> {
        self.tails
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Follows the consoles of `records` (the node's VMs now) and returns what they printed
    /// since the last pump, within each VM's budget. `lifecycle` says what each VM is (`None`:
    /// its ImpVM is not known yet; its console is read once it is).
    pub fn pump(
        &self,
        records: &[VmRecord],
        lifecycle: impl Fn(&Owner) -> Option<VmLifecycle>,
        now: Instant,
    ) -> Vec<Out> {
        let mut out = Vec::new();
        if self.policy.mode == Mode::Off {
            return out;
        }
        let first = !self.primed.swap(true, Ordering::SeqCst);
        let mut tails = self.tails();
        tails.retain(|uid, _| records.iter().any(|r| &r.name == uid));
        for r in records {
            let Some(owner) = &r.owner else { continue };
            let tail = tails
                .entry(r.name.clone())
                .or_insert_with(|| Tail::new(r, owner, first, self.policy, now));
            if tail.path != r.serial_log || tail.boot != boot_of(r, owner) {
                // The VM was booted afresh (a restart in place, a cold boot): a new console.
                *tail = Tail::new(r, owner, false, self.policy, now);
            }
            if tail.done {
                continue;
            }
            let Some(lc) = lifecycle(owner) else { continue };
            tail.relayed = self.policy.mode.relays(lc);
            if !tail.relayed {
                continue;
            }
            if let Ok(lines) = tail.follower.poll() {
                tail.relay(lines.iter().map(String::as_str), now, &mut out);
            }
            tail.report_drops(now, false, &mut out);
        }
        out
    }

    /// Reads what is left of VM `uid`'s console (its VM has ended or is being removed) and
    /// stops following it (until its VM boots afresh).
    pub fn finish(&self, uid: &str, now: Instant) -> Vec<Out> {
        let mut out = Vec::new();
        let mut tails = self.tails();
        let Some(tail) = tails.get_mut(uid).filter(|t| !t.done) else {
            return out;
        };
        if tail.relayed {
            tail.drain(now, &mut out);
        }
        tail.done = true;
        out
    }
}

/// Writes `outs` to the agent's log, each with the VM's name, namespace and `node`.
pub fn log(outs: &[Out], node: &str) {
    for o in outs {
        let (vm, namespace) = (&o.vm, &o.namespace);
        match &o.said {
            Said::Line(line) => {
                tracing::info!(vm = %vm, namespace = %namespace, node = %node, line = %line, "serial console")
            }
            Said::Dropped(lines) => tracing::warn!(
                vm = %vm,
                namespace = %namespace,
                node = %node,
                dropped = lines,
                "serial console lines dropped: over the VM's rate limit (--serial-log-rate, --serial-log-burst)"
            ),
            Said::Skipped(bytes) => tracing::warn!(
                vm = %vm,
                namespace = %namespace,
                node = %node,
                skipped_bytes = bytes,
                "serial console too long to relay at the VM's end; relaying its last lines"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::path::Path;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn the_budget_passes_a_burst_then_its_rate_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut b = LineBudget::new(10, 3, t0);
        let passed = (0..5).filter(|_| b.admit(false, t0)).count();
        assert_eq!(passed, 3, "the burst");
        assert_eq!(b.dropped_report(t0, false), Some(2));
        assert_eq!(b.dropped_report(t0, false), None, "nothing new");
        // 10 lines/s: one more line after 100 ms, and it never saves more than the burst.
        assert!(!b.admit(false, at(t0, 50)));
        assert!(b.admit(false, at(t0, 100)));
        let passed = (0..10).filter(|_| b.admit(false, at(t0, 60_000))).count();
        assert_eq!(passed, 3);
        // Drops are reported at most once a second, unless the console has ended.
        assert_eq!(b.dropped_report(at(t0, 60_000), false), Some(8));
        assert!(!b.admit(false, at(t0, 60_000)));
        assert_eq!(b.dropped_report(at(t0, 60_500), false), None);
        assert_eq!(b.dropped_report(at(t0, 60_500), true), Some(1));
        let passed = (0..4).filter(|_| b.admit(false, at(t0, 60_550))).count();
        assert_eq!(passed, 3, "refilled to the burst");
        assert_eq!(b.dropped_report(at(t0, 61_000), false), None);
        assert_eq!(b.dropped_report(at(t0, 61_600), false), Some(1));
        // A clock that goes backwards takes nothing.
        let mut b = LineBudget::new(10, 1, at(t0, 1000));
        assert!(b.admit(false, t0));
        assert!(!b.admit(false, t0));
    }

    #[test]
    fn marker_lines_pass_a_spent_budget_a_few_times_only() {
        let t0 = Instant::now();
        let mut b = LineBudget::new(1, 1, t0);
        assert!(b.admit(false, t0));
        assert!(!b.admit(false, t0));
        let markers = (0..10).filter(|_| b.admit(true, t0)).count();
        assert_eq!(markers, MARKER_ALLOWANCE as usize);
        assert!(is_marker("IMP_SUCCESS"));
        assert!(is_marker("IMP_EXIT 0"));
        assert!(is_marker("IMP_EXIT 143"));
        assert!(!is_marker("IMP_EXIT soon"));
        assert!(!is_marker("echo IMP_SUCCESS"));
        assert!(!is_marker("IMP_SUCCESSFUL"));
    }

    #[test]
    fn modes_choose_the_vms() {
        use VmLifecycle::{Ephemeral, Persistent};
        assert!(Mode::Ephemeral.relays(Ephemeral));
        assert!(!Mode::Ephemeral.relays(Persistent));
        assert!(Mode::All.relays(Persistent));
        assert!(!Mode::Off.relays(Ephemeral));
    }

    fn record(dir: &Path, uid: &str, name: &str) -> VmRecord {
        let mut r: VmRecord = serde_json::from_value(serde_json::json!({
            "name": uid, "image": "busybox", "runtime": "qemu", "supervisor_pid": 1,
            "vmm_pid": null, "vsock": "/v", "agent_port": 10000,
            "serial_log": dir.join(format!("{uid}.log")), "created_unix": 0,
            "status": "running", "exit_code": null, "error": null, "remove_on_exit": false,
        }))
        .unwrap();
        r.owner = Some(Owner {
            namespace: "default".into(),
            name: name.into(),
            uid: uid.into(),
            attempt: 0,
            revision: 0,
        });
        r
    }

    fn append(path: &Path, text: &[u8]) {
        use std::io::Write;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap()
            .write_all(text)
            .unwrap();
    }

    fn lines(outs: &[Out]) -> Vec<String> {
        outs.iter()
            .filter_map(|o| match &o.said {
                Said::Line(l) => Some(format!("{}: {l}", o.vm)),
                _ => None,
            })
            .collect()
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("imp-serial-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A one-shot VM's console, written as a guest would: its lines reach the log escaped,
    /// the marker is read at the VM's end (after the last pump), and a service's console
    /// stays out.
    #[test]
    fn a_one_shot_console_is_relayed_escaped_to_its_marker() {
        let dir = scratch("oneshot");
        let job = record(&dir, "u-job", "job");
        let svc = record(&dir, "u-svc", "svc");
        let life = |o: &Owner| {
            Some(if o.name == "job" {
                VmLifecycle::Ephemeral
            } else {
                VmLifecycle::Persistent
            })
        };
        let consoles = Consoles::new(Policy::default());
        let t0 = Instant::now();
        // The first pump finds no console yet: later ones are followed from their start.
        assert!(consoles.pump(&[], life, t0).is_empty());
        append(&job.serial_log, b"hello \x1b[31mred\x1b[0m\r\n\n");
        append(&svc.serial_log, b"a service line\n");
        let outs = consoles.pump(&[job.clone(), svc.clone()], life, t0);
        assert_eq!(lines(&outs), ["job: hello \\u{1b}[31mred\\u{1b}[0m"]);
        assert!(outs.iter().all(|o| o.namespace == "default"));
        append(
            &job.serial_log,
            b"done\n\nIMP_EXIT 0\nIMP_SUCCESS\n[    2.5] Kernel panic - not syncing",
        );
        let outs = consoles.finish("u-job", t0);
        assert_eq!(
            lines(&outs),
            [
                "job: done",
                "job: IMP_EXIT 0",
                "job: IMP_SUCCESS",
                "job: [    2.5] Kernel panic - not syncing"
            ]
        );
        assert!(consoles.finish("u-job", t0).is_empty(), "followed once");
        assert!(consoles.finish("u-svc", t0).is_empty(), "not relayed");
        // A pump that listed the VM before its files went reads nothing again.
        assert!(
            consoles
                .pump(std::slice::from_ref(&job), life, t0)
                .is_empty()
        );
        // Restarted in place (the next attempt): a new console, followed from its start.
        let mut again = job.clone();
        again.owner.as_mut().unwrap().attempt = 1;
        std::fs::write(&again.serial_log, "second run\n").unwrap();
        assert_eq!(
            lines(&consoles.pump(&[again], life, t0)),
            ["job: second run"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A guest that floods: the log gets its burst, a count of the rest, and still the marker.
    #[test]
    fn a_flooding_console_is_limited_and_its_marker_still_logged() {
        let dir = scratch("flood");
        let job = record(&dir, "u-flood", "flood");
        let policy = Policy {
            mode: Mode::All,
            lines_per_sec: 5,
            burst: 10,
        };
        let consoles = Consoles::new(policy);
        let t0 = Instant::now();
        consoles.pump(&[], |_| None, t0);
        let flood: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        append(&job.serial_log, flood.as_bytes());
        let outs = consoles.pump(
            std::slice::from_ref(&job),
            |_| Some(VmLifecycle::Ephemeral),
            t0,
        );
        assert_eq!(lines(&outs).len(), 10);
        assert_eq!(outs.last().unwrap().said, Said::Dropped(990));
        append(&job.serial_log, b"IMP_EXIT 0\nIMP_SUCCESS\n");
        let outs = consoles.finish("u-flood", at(t0, 100));
        assert_eq!(lines(&outs), ["flood: IMP_EXIT 0", "flood: IMP_SUCCESS"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A console far ahead of its follower at the VM's end: only its tail is read.
    #[test]
    fn an_ended_console_far_ahead_is_read_from_its_tail() {
        let dir = scratch("far");
        let job = record(&dir, "u-far", "far");
        let consoles = Consoles::new(Policy::default());
        let t0 = Instant::now();
        consoles.pump(&[], |_| None, t0);
        consoles.pump(
            std::slice::from_ref(&job),
            |_| Some(VmLifecycle::Ephemeral),
            t0,
        );
        let mut big = vec![b'x'; (FINISH_READ_MAX + FINISH_TAIL) as usize];
        big.extend_from_slice(b"\nlast words\nIMP_SUCCESS\n");
        append(&job.serial_log, &big);
        let outs = consoles.finish("u-far", t0);
        assert!(
            matches!(outs[0].said, Said::Skipped(n) if n > FINISH_READ_MAX),
            "{:?}",
            outs[0]
        );
        let got = lines(&outs);
        assert_eq!(
            got[got.len() - 2..],
            ["far: last words", "far: IMP_SUCCESS"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An agent restarted while a VM ran logs only what its console prints from then on.
    #[test]
    fn consoles_found_by_the_first_pump_are_followed_from_their_end() {
        let dir = scratch("restart");
        let job = record(&dir, "u-old", "old");
        append(&job.serial_log, b"logged by the agent before\nhal");
        let consoles = Consoles::new(Policy::default());
        let life = |_: &Owner| Some(VmLifecycle::Ephemeral);
        let t0 = Instant::now();
        assert!(
            consoles
                .pump(std::slice::from_ref(&job), life, t0)
                .is_empty()
        );
        append(&job.serial_log, b"f\nnew\n");
        let outs = consoles.pump(std::slice::from_ref(&job), life, t0);
        assert_eq!(lines(&outs), ["old: half", "old: new"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
