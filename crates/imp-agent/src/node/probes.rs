//! The probes of this node's running VMs (`spec.probes`), as Kubernetes users know them:
//! a startup probe gates the others; a readiness probe decides the VM's `Ready` condition; a
//! liveness probe (or a startup probe) that fails `failureThreshold` times in a row gets the
//! VM stopped as failed, for its restart policy to restart it.
//!
//! An exec probe runs its command in the guest through the guest agent (exit 0 is success);
//! an HTTP probe has the guest GET its own `127.0.0.1:port/path` (200–399 is success), so no
//! probe is traffic on the VM's network and a ScaleToZero VM is not kept awake by it. Each
//! VM's probes run in one task of their own, each call bounded by [`CALL_TIMEOUT`], and only
//! while the VM runs: none while it sleeps, and they start over (from the initial delay) with
//! each attempt and after an agent restart, when the reconcile of the running VM starts them
//! again.
//!
//! `probes.httpCheck` (the VM's own, or the cluster's `defaultHttpCheck` the operator booked
//! it with) is a GET from the node to the VM's address, `port` and `path`, every
//! `intervalSeconds`: 2xx is healthy, and `failureThreshold` failures in a row turn `Ready`
//! False (`HealthCheckFailed`) until a check passes again. A ScaleToZero VM's check is made by
//! its guest to its own loopback instead, so that the check is no traffic on its TAP and does
//! not keep it awake.
//!
//! The verdicts live here; the reconciler writes them into the status (`Started`, `Ready`,
//! `Healthy`) and acts on a failed one, asked to by [`Probes`]'s `changed` callback.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use imp_api::shared::{HttpCheckSpec, Probe, ProbeSpec};
use imp_proto::{HttpGetRequest, HttpGetResult};

use crate::runtime::guest_agent;

/// How long one probe call may take (connecting to the guest agent included).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `startupProbe`.
    Startup,
    /// `readinessProbe`.
    Readiness,
    /// `livenessProbe`.
    Liveness,
    /// `httpCheck`.
    HttpCheck,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Startup => "startup",
            Kind::Readiness => "readiness",
            Kind::Liveness => "liveness",
            Kind::HttpCheck => "httpCheck",
        }
    }
}

/// A probe's verdict, as a condition shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Succeeding (after one success) or failing (after `failureThreshold` failures).
    pub ok: bool,
    /// What the last call saw.
    pub message: String,
}

/// What a VM's probes say now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdicts {
    /// The startup probe's, once it has one (none: no startup probe).
    pub started: Option<Verdict>,
    /// The readiness probe's, once it has one.
    pub ready: Option<Verdict>,
    /// The liveness probe's, once it has one.
    pub healthy: Option<Verdict>,
    /// The HTTP check's, once it has one.
    pub checked: Option<Verdict>,
    /// Whether a startup probe is still to succeed (readiness and liveness wait for it).
    pub starting: bool,
    /// A liveness or startup probe failed its threshold: why the VM must be stopped.
    pub failed: Option<String>,
}

/// One probe's run of results: a verdict after one success or `failureThreshold` failures
/// in a row (Kubernetes' `successThreshold` is 1 for liveness and startup, and the API has no
/// field for it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tracker {
    failures: u32,
    verdict: Option<bool>,
}

impl Tracker {
    /// Records one result; returns the verdict when it changes (or is first reached).
    pub fn observe(&mut self, ok: bool, failure_threshold: u32) -> Option<bool> {
        if ok {
            self.failures = 0;
        } else {
            self.failures = self.failures.saturating_add(1);
        }
        let verdict = match ok {
            true => Some(true),
            false if self.failures >= failure_threshold.max(1) => Some(false),
            false => self.verdict,
        };
        let changed = verdict != self.verdict;
        self.verdict = verdict;
        changed.then_some(ok)
    }
}

/// How a probe's numbers are read: non-positive values are Kubernetes' defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Before the first call.
    pub initial_delay: Duration,
    /// Between calls.
    pub period: Duration,
    /// Failures in a row that make the verdict a failure.
    pub failure_threshold: u32,
}

impl Timing {
    /// The timing of `p`.
    pub fn of(p: &Probe) -> Self {
        Timing::from_numbers(
            Duration::from_secs(u64::try_from(p.initial_delay_seconds).unwrap_or(0)),
            p.period_seconds,
            p.failure_threshold,
        )
    }

    /// The timing of HTTP check `c` (no initial delay: it starts with the VM's readiness).
    pub fn of_check(c: &HttpCheckSpec) -> Self {
        Timing::from_numbers(Duration::ZERO, c.interval_seconds, c.failure_threshold)
    }

    fn from_numbers(initial_delay: Duration, period_seconds: i32, failure_threshold: i32) -> Self {
        Timing {
            initial_delay,
            period: Duration::from_secs(
                u64::try_from(period_seconds)
                    .ok()
                    .filter(|s| *s > 0)
                    .unwrap_or(10),
            ),
            failure_threshold: u32::try_from(failure_threshold)
                .ok()
                .filter(|t| *t > 0)
                .unwrap_or(3),
        }
    }
}

/// Where a VM's probes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The VMM's vsock socket on the host.
    pub vsock: PathBuf,
    /// The guest agent's port.
    pub port: u32,
    /// The VM's address on its network, if it has one (the HTTP check's destination).
    pub address: Option<Ipv4Addr>,
    /// Whether the HTTP check is made by the guest to its own loopback (a ScaleToZero VM:
    /// a check from the node would be traffic that keeps it awake).
    pub check_in_guest: bool,
}

/// One call of probe `p` against `target`: whether it succeeded and what it saw.
pub async fn call(p: &Probe, target: &Target) -> (bool, String) {
    if let Some(exec) = &p.exec {
        return match guest_agent::exec_probe(
            &target.vsock,
            target.port,
            exec.command.clone(),
            CALL_TIMEOUT,
        )
        .await
        {
            Ok((status, output)) => {
                let ok = status == imp_proto::ExitStatus::Code(0);
                let shown = if output.is_empty() {
                    String::new()
                } else {
                    format!(": {output}")
                };
                (ok, format!("{:?} {status}{shown}", exec.command))
            }
            Err(e) => (
                false,
                format!("{:?}: {}", exec.command, imp_api::chain::chain(&e)),
            ),
        };
    }
    let Some(http) = &p.http else {
        return (false, "the probe has neither exec nor http".into());
    };
    let Ok(port) = u16::try_from(http.port) else {
        return (false, format!("port {} is out of range", http.port));
    };
    let shown = format!("GET 127.0.0.1:{port}{}", http.path);
    match get_in_guest(target, port, &http.path).await {
        Ok(r) => (r.ok(), format!("{shown}: {}", r.detail)),
        Err(e) => (false, format!("{shown}: {e}")),
    }
}

/// Has the guest GET its own `127.0.0.1:port` + `path` through its guest agent, within
/// [`CALL_TIMEOUT`] in all (the GET itself gets half a second less, so its answer comes back
/// in time); the error is the cause chain.
async fn get_in_guest(target: &Target, port: u16, path: &str) -> Result<HttpGetResult, String> {
    let request = HttpGetRequest {
        port,
        path: path.to_owned(),
        timeout_ms: u64::try_from(CALL_TIMEOUT.as_millis()).unwrap_or(5000) - 500,
    };
    guest_agent::http_get(&target.vsock, target.port, request, CALL_TIMEOUT)
        .await
        .map_err(|e| imp_api::chain::chain(&e))
}

/// GETs `path` from `addr` on the node, off the runtime, within [`CALL_TIMEOUT`].
async fn get_from_node(addr: SocketAddr, path: &str) -> Result<HttpGetResult, String> {
    let request = HttpGetRequest {
        port: addr.port(),
        path: path.to_owned(),
        timeout_ms: 0,
    };
    request.validate()?;
    tokio::task::spawn_blocking(move || imp_proto::http::get(addr, &request.path, CALL_TIMEOUT))
        .await
        .map_err(|e| format!("the check's thread ended: {e}"))
}

/// One HTTP check `c` of the VM at `target`: whether it passed (2xx) and what it saw.
pub async fn check(c: &HttpCheckSpec, target: &Target) -> (bool, String) {
    let Some(port) = c
        .port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
    else {
        return (false, "httpCheck has no port to check".into());
    };
    let passed = |r: &HttpGetResult| r.status.is_some_and(|s| (200..300).contains(&s));
    let (shown, got) = if target.check_in_guest {
        let shown = format!("GET 127.0.0.1:{port}{} (in the guest)", c.path);
        (shown, get_in_guest(target, port, &c.path).await)
    } else {
        let Some(ip) = target.address else {
            return (
                false,
                "the VM has no address to check (it is on no network)".into(),
            );
        };
        let addr = SocketAddr::from((ip, port));
        (
            format!("GET {addr}{}", c.path),
            get_from_node(addr, &c.path).await,
        )
    };
    match got {
        Ok(r) => (passed(&r), format!("{shown}: {}", r.detail)),
        Err(e) => (false, format!("{shown}: {e}")),
    }
}

/// What changing verdicts tell: called with the VM's uid.
pub type Changed = Arc<dyn Fn(&str) + Send + Sync>;

/// The probe tasks of this node's VMs.
#[derive(Default)]
pub struct Probes {
    vms: Mutex<HashMap<String, Running>>,
}

struct Running {
    /// The attempt, probes and target it runs for; another means a new task.
    key: (i32, ProbeSpec, Target),
    verdicts: Arc<Mutex<Verdicts>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Probes {
    /// Makes VM `uid`'s attempt `attempt` run `spec` against `target` (a task already doing
    /// so is kept); returns its verdicts now. `changed` is called when they change.
    pub fn ensure(
        &self,
        uid: &str,
        attempt: i32,
        spec: &ProbeSpec,
        target: Target,
        changed: Changed,
    ) -> Verdicts {
        let mut vms = self.vms.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (attempt, spec.clone(), target.clone());
        if let Some(r) = vms.get(uid).filter(|r| r.key == key) {
            return lock(&r.verdicts).clone();
        }
        let verdicts = Arc::new(Mutex::new(Verdicts {
            starting: spec.startup_probe.is_some(),
            ..Verdicts::default()
        }));
        let task = tokio::spawn(run(
            spec.clone(),
            target,
            verdicts.clone(),
            uid.to_owned(),
            changed,
        ));
        tracing::info!(vm = %uid, attempt, "probes started");
        let now = lock(&verdicts).clone();
        vms.insert(
            uid.to_owned(),
            Running {
                key,
                verdicts,
                task,
            },
        );
        now
    }

    /// Stops VM `uid`'s probes (it stopped, sleeps or left); its verdicts go with them.
    pub fn stop(&self, uid: &str) {
        let removed = self
            .vms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
        if removed.is_some() {
            tracing::info!(vm = %uid, "probes stopped");
        }
    }

    /// VM `uid`'s verdicts, while its probes run.
    pub fn verdicts(&self, uid: &str) -> Option<Verdicts> {
        let vms = self.vms.lock().unwrap_or_else(PoisonError::into_inner);
        vms.get(uid).map(|r| lock(&r.verdicts).clone())
    }
}

fn lock(v: &Mutex<Verdicts>) -> std::sync::MutexGuard<'_, Verdicts> {
    v.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Applies an edit to a VM's verdicts and says they changed.
type Publish<'a> = dyn Fn(&dyn Fn(&mut Verdicts)) + Sync + 'a;

/// A VM's probes: the startup probe until it succeeds (or fails: then nothing more), then
/// readiness and liveness side by side, each on its own period.
async fn run(
    spec: ProbeSpec,
    target: Target,
    verdicts: Arc<Mutex<Verdicts>>,
    uid: String,
    changed: Changed,
) {
    let publish = |edit: &dyn Fn(&mut Verdicts)| {
        edit(&mut lock(&verdicts));
        changed(&uid);
    };
    if let Some(p) = &spec.startup_probe
        && !until_verdict(Kind::Startup, p, &target, &uid, &publish).await
    {
        return;
    }
    let readiness = async {
        if let Some(p) = &spec.readiness_probe {
            forever(Kind::Readiness, p, &target, &uid, &publish).await;
        }
    };
    let liveness = async {
        if let Some(p) = &spec.liveness_probe {
            forever(Kind::Liveness, p, &target, &uid, &publish).await;
        }
    };
    let checking = async {
        if let Some(c) = spec.http_check.as_ref().filter(|c| c.enabled) {
            checks(c, &target, &uid, &publish).await;
        }
    };
    tokio::join!(readiness, liveness, checking);
}

/// Runs HTTP check `c` until the task is stopped, publishing each change of its verdict.
async fn checks(c: &HttpCheckSpec, target: &Target, uid: &str, publish: &Publish<'_>) {
    let timing = Timing::of_check(c);
    let mut tracker = Tracker::default();
    loop {
        let (ok, message) = check(c, target).await;
        if let Some(verdict) = tracker.observe(ok, timing.failure_threshold) {
            tracing::info!(vm = %uid, probe = Kind::HttpCheck.name(), ok = verdict, message, "HTTP check verdict changed");
            let message = match verdict {
                true => message,
                false => failed(Kind::HttpCheck, timing, &message),
            };
            publish(&|v| {
                v.checked = Some(Verdict {
                    ok: verdict,
                    message: message.clone(),
                });
            });
        }
        tokio::time::sleep(timing.period).await;
    }
}

/// Runs the startup probe until it succeeds (true) or fails its threshold (false).
async fn until_verdict(
    kind: Kind,
    p: &Probe,
    target: &Target,
    uid: &str,
    publish: &Publish<'_>,
) -> bool {
    let timing = Timing::of(p);
    tokio::time::sleep(timing.initial_delay).await;
    let mut tracker = Tracker::default();
    loop {
        let (ok, message) = call(p, target).await;
        match tracker.observe(ok, timing.failure_threshold) {
            Some(true) => {
                tracing::info!(vm = %uid, probe = kind.name(), message, "probe succeeded");
                publish(&|v| {
                    v.started = Some(Verdict {
                        ok: true,
                        message: message.clone(),
                    });
                    v.starting = false;
                });
                return true;
            }
            Some(false) => {
                let why = failed(kind, timing, &message);
                tracing::warn!(vm = %uid, probe = kind.name(), why, "probe failed");
                publish(&|v| {
                    v.started = Some(Verdict {
                        ok: false,
                        message: message.clone(),
                    });
                    v.failed = Some(why.clone());
                });
                return false;
            }
            None => {}
        }
        tokio::time::sleep(timing.period).await;
    }
}

/// Runs a readiness or liveness probe until the task is stopped, publishing each change.
async fn forever(kind: Kind, p: &Probe, target: &Target, uid: &str, publish: &Publish<'_>) {
    let timing = Timing::of(p);
    tokio::time::sleep(timing.initial_delay).await;
    let mut tracker = Tracker::default();
    loop {
        let (ok, message) = call(p, target).await;
        if let Some(verdict) = tracker.observe(ok, timing.failure_threshold) {
            tracing::info!(vm = %uid, probe = kind.name(), ok = verdict, message, "probe verdict changed");
            let why = (!verdict).then(|| failed(kind, timing, &message));
            publish(&|v| {
                let now = Some(Verdict {
                    ok: verdict,
                    message: message.clone(),
                });
                match kind {
                    Kind::Readiness => v.ready = now,
                    _ => v.healthy = now,
                }
                if kind == Kind::Liveness && why.is_some() {
                    v.failed.clone_from(&why);
                }
            });
        }
        tokio::time::sleep(timing.period).await;
    }
}

/// The reason a VM is stopped (or, for the HTTP check, not Ready) for a failed probe.
fn failed(kind: Kind, timing: Timing, message: &str) -> String {
    let noun = if kind == Kind::HttpCheck {
        ""
    } else {
        " probe"
    };
    format!(
        "the {}{noun} failed {} times in a row (every {} s): {message}",
        kind.name(),
        timing.failure_threshold,
        timing.period.as_secs()
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn one_success_passes_and_threshold_failures_in_a_row_fail() {
        let mut t = Tracker::default();
        assert_eq!(t.observe(false, 3), None);
        assert_eq!(t.observe(false, 3), None);
        assert_eq!(t.observe(false, 3), Some(false), "third failure in a row");
        assert_eq!(t.observe(false, 3), None, "no change, no news");
        assert_eq!(t.observe(true, 3), Some(true));
        assert_eq!(t.observe(true, 3), None);
        assert_eq!(t.observe(false, 3), None, "one failure keeps it passing");
        assert_eq!(t.observe(true, 3), None, "the run of failures starts over");
        assert_eq!(t.observe(false, 3), None);
        assert_eq!(t.observe(false, 3), None);
        assert_eq!(t.observe(false, 3), Some(false));
        let mut first = Tracker::default();
        assert_eq!(
            first.observe(true, 3),
            Some(true),
            "a first success is a verdict"
        );
        let mut zero = Tracker::default();
        assert_eq!(
            zero.observe(false, 0),
            Some(false),
            "a threshold below 1 is 1"
        );
    }

    #[test]
    fn timings_take_kubernetes_defaults_for_unset_numbers() {
        let p: Probe = serde_json::from_value(serde_json::json!({
            "exec": {"command": ["true"]}
        }))
        .unwrap();
        let t = Timing::of(&p);
        assert_eq!(t.initial_delay, Duration::ZERO);
        assert_eq!(t.period, Duration::from_secs(10));
        assert_eq!(t.failure_threshold, 3);
        let p: Probe = serde_json::from_value(serde_json::json!({
            "http": {"path": "/", "port": 80},
            "initialDelaySeconds": 4, "periodSeconds": 0, "failureThreshold": -1
        }))
        .unwrap();
        let t = Timing::of(&p);
        assert_eq!(
            (t.initial_delay, t.period, t.failure_threshold),
            (Duration::from_secs(4), Duration::from_secs(10), 3)
        );
    }

    #[test]
    fn a_failed_probe_names_itself_its_threshold_and_what_it_saw() {
        let t = Timing {
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(2),
            failure_threshold: 3,
        };
        let why = failed(Kind::Liveness, t, "GET 127.0.0.1:8080/healthz: HTTP 500");
        assert_eq!(
            why,
            "the liveness probe failed 3 times in a row (every 2 s): GET 127.0.0.1:8080/healthz: HTTP 500"
        );
    }

    /// A server on loopback answering each connection with the next of `answers`.
    /// Serves `answers` one connection each, then closes the listener: joining the
    /// handle means nobody listens on the port any more.
    fn serve(answers: &'static [&'static [u8]]) -> (u16, std::thread::JoinHandle<()>) {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            for answer in answers {
                let (mut c, _) = l.accept().unwrap();
                let _ = c.read(&mut [0u8; 512]).unwrap();
                c.write_all(answer).unwrap();
            }
        });
        (port, server)
    }

    fn http_check(port: Option<i32>) -> HttpCheckSpec {
        serde_json::from_value(serde_json::json!({"enabled": true, "port": port})).unwrap()
    }

    fn node_side(address: Option<Ipv4Addr>) -> Target {
        Target {
            vsock: PathBuf::from("/nonexistent"),
            port: 1024,
            address,
            check_in_guest: false,
        }
    }

    #[tokio::test]
    async fn an_http_check_gets_the_vms_address_from_the_node_and_only_2xx_passes() {
        let (port, server) = serve(&[b"HTTP/1.1 200 OK\r\n\r\n", b"HTTP/1.1 302 Found\r\n\r\n"]);
        let target = node_side(Some(Ipv4Addr::LOCALHOST));
        let c = http_check(Some(i32::from(port)));
        let (ok, seen) = check(&c, &target).await;
        assert!(ok, "{seen}");
        assert!(
            seen.starts_with(&format!("GET 127.0.0.1:{port}/healthz: HTTP 200")),
            "{seen}"
        );
        let (ok, seen) = check(&c, &target).await;
        assert!(!ok, "a redirect is no health: {seen}");
        // The check may have read its answer before the server let go of the listener:
        // wait for that, or the next connection lands in its backlog and is reset.
        server.join().unwrap();
        let (ok, seen) = check(&c, &target).await;
        assert!(!ok && seen.contains("connecting"), "{seen}");
    }

    #[tokio::test]
    async fn an_http_check_without_an_address_or_port_fails_saying_so() {
        let (ok, seen) = check(&http_check(Some(80)), &node_side(None)).await;
        assert!(!ok && seen.contains("no address"), "{seen}");
        let (ok, seen) = check(&http_check(None), &node_side(Some(Ipv4Addr::LOCALHOST))).await;
        assert!(!ok && seen.contains("no port"), "{seen}");
    }
}
