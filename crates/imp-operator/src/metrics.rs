//! Prometheus metrics and liveness/readiness for the operator, served on one ops address.
//!
//! [`Metrics`] owns a prometheus-client registry with the operator's metrics and plain methods
//! the controllers call; [`Health`] holds the liveness and readiness verdicts with a reason;
//! [`serve`] answers `/metrics` (OpenMetrics text), `/healthz` and `/readyz` (200, or 503 with
//! a one-line reason).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use imp_api::vm::VmPhase;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

use crate::names;

/// The media type of OpenMetrics text, as Prometheus asks for it.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every phase, so `imp_operator_vms` shows zeros instead of missing series.
const PHASES: [VmPhase; 11] = [
    VmPhase::Pending,
    VmPhase::Scheduled,
    VmPhase::Starting,
    VmPhase::Running,
    VmPhase::Terminating,
    VmPhase::Succeeded,
    VmPhase::Failed,
    VmPhase::RetryExhausted,
    VmPhase::Suspending,
    VmPhase::Suspended,
    VmPhase::Resuming,
];

/// Errors of the ops server.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The listening socket could not be bound.
    #[error("Binding the metrics and health server to {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The server stopped with an I/O error.
    #[error("Serving metrics and health on {addr}")]
    Serve {
        /// The address served.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Rendering the registry as text failed.
    #[error("Encoding the metrics registry as OpenMetrics text")]
    Encode(#[source] std::fmt::Error),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NetworkLabels {
    network: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConflictLabels {
    resource: String,
    write: String,
}

/// Which part of an object a refused write was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// The object itself (spec, metadata).
    Main,
    /// Its status subresource.
    Status,
}

impl Write {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Main => "main",
            Self::Status => "status",
        }
    }
}

/// The resources whose preconditioned writes are counted in `imp_operator_conflicts_total`.
pub const CONFLICT_RESOURCES: [&str; 2] = ["impvm", "impnetwork"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: String,
    reason: String,
}

/// The operator's metrics; cheap to update from any task (share it in an `Arc`).
pub struct Metrics {
    registry: Registry,
    vms: Family<PhaseLabels, Gauge>,
    /// Phases set by the last `set_phase_counts`, so phases that vanish drop back to 0.
    seen_phases: Mutex<BTreeSet<String>>,
    schedule_latency: Histogram,
    reconciles: Family<ControllerLabels, Counter>,
    reconcile_errors: Family<ErrorLabels, Counter>,
    conflicts: Family<ConflictLabels, Counter>,
    backlog: Family<ControllerLabels, Gauge>,
    queue_depth: Gauge,
    is_leader: Gauge,
    ipam_allocations: Family<NetworkLabels, Gauge>,
    ipam_free: Family<NetworkLabels, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry holding the operator's metrics, every phase gauge at 0, every conflict
    /// series of [`CONFLICT_RESOURCES`] at 0 and the ImpVM controller's backlog at 0. Families
    /// are registered area by area, in the order `/metrics` lists them.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let (vms, schedule_latency) = register_vms(&mut registry);
        let (reconciles, reconcile_errors) = register_reconciles(&mut registry);
        let conflicts = register_conflicts(&mut registry);
        let (backlog, queue_depth) = register_queues(&mut registry);
        let is_leader = Gauge::default();
        registry.register(
            "imp_operator_is_leader",
            "1 while this replica holds the leader lease, else 0",
            is_leader.clone(),
        );
        let (ipam_allocations, ipam_free) = register_ipam(&mut registry);
        Self {
            registry,
            vms,
            ipam_allocations,
            ipam_free,
            seen_phases: Mutex::new(BTreeSet::new()),
            schedule_latency,
            reconciles,
            reconcile_errors,
            conflicts,
            backlog,
            queue_depth,
            is_leader,
        }
    }

    /// Counts one write to `resource` (`impvm`, `impnetwork`) refused with 409 Conflict.
    pub fn conflict(&self, resource: &str, write: Write) {
        self.conflicts
            .get_or_create(&ConflictLabels {
                resource: resource.to_owned(),
                write: write.as_str().to_owned(),
            })
            .inc();
    }

    /// Sets how many objects of `controller` wait for a reconcile to start.
    pub fn set_backlog(&self, controller: &str, waiting: usize) {
        self.backlog
            .get_or_create(&ControllerLabels {
                controller: controller.to_owned(),
            })
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
    }

    /// Sets `imp_operator_ipam_allocations{network}` and `imp_operator_ipam_free_addresses`.
    pub fn set_ipam(&self, network: &str, allocated: u64, free: u64) {
        let labels = NetworkLabels {
            network: network.to_owned(),
        };
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.ipam_allocations
            .get_or_create(&labels)
            .set(clamp(allocated));
        self.ipam_free.get_or_create(&labels).set(clamp(free));
    }

    /// Sets `imp_operator_vms{phase}` from a full count; phases absent from `counts` become 0.
    pub fn set_phase_counts(&self, counts: &BTreeMap<String, i64>) {
        let mut seen = lock(&self.seen_phases);
        for phase in seen.iter() {
            if !counts.contains_key(phase) {
                self.vms
                    .get_or_create(&PhaseLabels {
                        phase: phase.clone(),
                    })
                    .set(0);
            }
        }
        for phase in PHASES {
            if !counts.contains_key(phase.as_str()) {
                self.vms
                    .get_or_create(&PhaseLabels {
                        phase: phase.as_str().to_string(),
                    })
                    .set(0);
            }
        }
        for (phase, n) in counts {
            self.vms
                .get_or_create(&PhaseLabels {
                    phase: phase.clone(),
                })
                .set(*n);
        }
        *seen = counts.keys().cloned().collect();
    }

    /// Records one ImpVM's time from creation to `Scheduled=True`.
    pub fn observe_schedule_latency(&self, latency: Duration) {
        self.schedule_latency.observe(latency.as_secs_f64());
    }

    /// Counts one reconcile of `controller` (successful or not).
    pub fn reconcile(&self, controller: &str) {
        self.reconciles
            .get_or_create(&ControllerLabels {
                controller: controller.to_string(),
            })
            .inc();
    }

    /// Counts one failed reconcile of `controller`; `reason` is a short stable label
    /// (an error's `metric_label()`), never a free-form message.
    pub fn reconcile_error(&self, controller: &str, reason: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                controller: controller.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Sets how many ImpVMs wait for a node (unplaced, not finished).
    pub fn set_queue_depth(&self, depth: i64) {
        self.queue_depth.set(depth);
    }

    /// Sets `imp_operator_is_leader` to 1 or 0.
    pub fn set_leader(&self, leading: bool) {
        self.is_leader.set(i64::from(leading));
    }

    /// Renders every metric as OpenMetrics text (ending in `# EOF`).
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .map_err(MetricsError::Encode)?;
        Ok(out)
    }
}

/// `imp_operator_vms` (every phase at 0) and `imp_operator_schedule_latency_seconds`.
fn register_vms(registry: &mut Registry) -> (Family<PhaseLabels, Gauge>, Histogram) {
    let vms = Family::<PhaseLabels, Gauge>::default();
    for phase in PHASES {
        let _ = vms.get_or_create(&PhaseLabels {
            phase: phase.as_str().to_string(),
        });
    }
    registry.register("imp_operator_vms", "ImpVMs by status.phase", vms.clone());
    // 10 ms … ~82 s, doubling.
    let schedule_latency = Histogram::new(exponential_buckets(0.01, 2.0, 14));
    registry.register_with_unit(
        "imp_operator_schedule_latency",
        "Time from an ImpVM's creation to its Scheduled condition",
        Unit::Seconds,
        schedule_latency.clone(),
    );
    (vms, schedule_latency)
}

/// `imp_operator_reconciles_total` and `imp_operator_reconcile_errors_total`, by controller.
fn register_reconciles(
    registry: &mut Registry,
) -> (
    Family<ControllerLabels, Counter>,
    Family<ErrorLabels, Counter>,
) {
    let reconciles = Family::<ControllerLabels, Counter>::default();
    registry.register(
        "imp_operator_reconciles",
        "Reconciles run, by controller",
        reconciles.clone(),
    );
    let reconcile_errors = Family::<ErrorLabels, Counter>::default();
    registry.register(
        "imp_operator_reconcile_errors",
        "Reconciles that ended in an error, by controller and reason",
        reconcile_errors.clone(),
    );
    (reconciles, reconcile_errors)
}

/// `imp_operator_conflicts_total`, every resource of [`CONFLICT_RESOURCES`] and write at 0.
fn register_conflicts(registry: &mut Registry) -> Family<ConflictLabels, Counter> {
    let conflicts = Family::<ConflictLabels, Counter>::default();
    for resource in CONFLICT_RESOURCES {
        for write in [Write::Main, Write::Status] {
            let _ = conflicts.get_or_create(&ConflictLabels {
                resource: resource.to_owned(),
                write: write.as_str().to_owned(),
            });
        }
    }
    registry.register(
        "imp_operator_conflicts",
        "Writes the API server refused with 409 Conflict because the object changed since \
         the operator read it (every write carries the resourceVersion it was decided on), \
         by resource and by write (main: the object; status: its status subresource). Each \
         is read again and decided again; a steady rise is a conflict loop between writers",
        conflicts.clone(),
    );
    conflicts
}

/// The two queues: `imp_operator_reconcile_backlog` (the ImpVM controller's at 0) and
/// `imp_operator_queue_depth`.
fn register_queues(registry: &mut Registry) -> (Family<ControllerLabels, Gauge>, Gauge) {
    let backlog = Family::<ControllerLabels, Gauge>::default();
    let _ = backlog.get_or_create(&ControllerLabels {
        controller: names::VM_CONTROLLER.to_owned(),
    });
    registry.register(
        "imp_operator_reconcile_backlog",
        "Objects a watch event asked the controller to reconcile (their own change, or a \
         change of a Node, class, template, network or config that affects them) whose \
         reconcile has not started yet. kube-runtime keeps its queue private, so this counts \
         the triggers imp hands it, merged per object as the queue merges them; timed \
         requeues are not counted. 0 when idle; sustained growth means reconciles cannot \
         keep up",
        backlog.clone(),
    );
    let queue_depth = Gauge::default();
    registry.register(
        "imp_operator_queue_depth",
        "ImpVMs waiting for a node: unplaced and not finished (the reconcile backlog is \
         imp_operator_reconcile_backlog)",
        queue_depth.clone(),
    );
    (backlog, queue_depth)
}

/// `imp_operator_ipam_allocations` and `imp_operator_ipam_free_addresses`, by network.
fn register_ipam(
    registry: &mut Registry,
) -> (Family<NetworkLabels, Gauge>, Family<NetworkLabels, Gauge>) {
    let ipam_allocations = Family::<NetworkLabels, Gauge>::default();
    registry.register(
        "imp_operator_ipam_allocations",
        "Addresses allocated on an ImpNetwork (namespace/name)",
        ipam_allocations.clone(),
    );
    let ipam_free = Family::<NetworkLabels, Gauge>::default();
    registry.register(
        "imp_operator_ipam_free_addresses",
        "Addresses an ImpNetwork (namespace/name) can still hand out to ungrouped VMs",
        ipam_free.clone(),
    );
    (ipam_allocations, ipam_free)
}

/// Liveness and readiness verdicts, each `Ok` or a one-line reason it is not.
#[derive(Debug)]
pub struct Health {
    live: Mutex<Option<String>>,
    ready: Mutex<Option<String>>,
    /// Parts that hold readiness back on their own (the webhook until it serves), by name.
    held: Mutex<std::collections::BTreeMap<&'static str, String>>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// Live, and not ready yet ("starting").
    pub fn new() -> Self {
        Self {
            live: Mutex::new(None),
            ready: Mutex::new(Some("starting".to_string())),
            held: Mutex::new(std::collections::BTreeMap::new()),
        }
    }

    /// Marks the process live (`/healthz` answers 200).
    pub fn set_live(&self) {
        *lock(&self.live) = None;
    }

    /// Marks the process not live (`/healthz` answers 503 with `reason`): it should be restarted.
    pub fn set_not_live(&self, reason: impl Into<String>) {
        *lock(&self.live) = Some(one_line(reason.into()));
    }

    /// Marks the process ready (`/readyz` answers 200): caches synced, leadership known.
    pub fn set_ready(&self) {
        *lock(&self.ready) = None;
    }

    /// Marks the process not ready (`/readyz` answers 503 with `reason`).
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        *lock(&self.ready) = Some(one_line(reason.into()));
    }

    /// `Ok` when live, else the reason.
    pub fn liveness(&self) -> Result<(), String> {
        lock(&self.live).clone().map_or(Ok(()), Err)
    }

    /// Holds readiness back while `part` is not there (`reason` says why), whatever
    /// [`Health::set_ready`] says: a replica whose webhook does not serve yet must get no
    /// admission traffic.
    pub fn hold(&self, part: &'static str, reason: impl Into<String>) {
        lock(&self.held).insert(part, one_line(reason.into()));
    }

    /// `part` no longer holds readiness back.
    pub fn release(&self, part: &'static str) {
        lock(&self.held).remove(part);
    }

    /// `Ok` when ready and nothing holds readiness back, else the reason.
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(why) = lock(&self.ready).clone() {
            return Err(why);
        }
        lock(&self.held)
            .iter()
            .next()
            .map_or(Ok(()), |(part, why)| Err(format!("{part}: {why}")))
    }
}

fn one_line(s: String) -> String {
    s.lines().map(str::trim).collect::<Vec<_>>().join(" ")
}

/// A poisoned lock only means a panic elsewhere while holding it; the data is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Clone)]
struct Ops {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// The ops routes (`/metrics`, `/healthz`, `/readyz`), for embedding in another server.
pub fn router(metrics: Arc<Metrics>, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Ops { metrics, health })
}

async fn metrics_handler(State(ops): State<Ops>) -> Response {
    match ops.metrics.encode() {
        Ok(body) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics failed");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
        }
    }
}

fn verdict(v: Result<(), String>, what: &str) -> Response {
    match v {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not {what}: {reason}\n"),
        )
            .into_response(),
    }
}

async fn healthz(State(ops): State<Ops>) -> Response {
    verdict(ops.health.liveness(), "live")
}

async fn readyz(State(ops): State<Ops>) -> Response {
    verdict(ops.health.readiness(), "ready")
}

/// Binds `addr` and serves the ops routes until `shutdown` completes.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MetricsError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    serve_listener(listener, metrics, health, shutdown).await
}

/// Serves the ops routes on an already bound listener (tests bind 127.0.0.1:0 and read the port).
pub async fn serve_listener(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MetricsError> {
    let addr = listener.local_addr().map_err(|source| MetricsError::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    axum::serve(listener, router(metrics, health))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| MetricsError::Serve { addr, source })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// The value of the sample line that starts with `prefix ` (name plus labels).
    fn sample(text: &str, prefix: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix)?.strip_prefix(' '))
            .map(|v| v.trim().parse().unwrap())
    }

    #[test]
    fn fresh_registry_renders_every_metric_family() {
        let text = Metrics::new().encode().unwrap();
        for line in [
            "# TYPE imp_operator_vms gauge",
            "# TYPE imp_operator_schedule_latency_seconds histogram",
            "# UNIT imp_operator_schedule_latency_seconds seconds",
            "# TYPE imp_operator_queue_depth gauge",
            "# TYPE imp_operator_is_leader gauge",
            "# TYPE imp_operator_conflicts counter",
            "# TYPE imp_operator_reconcile_backlog gauge",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        // Labelled counters appear with their first sample (prometheus-client omits empty
        // families).
        assert!(!text.contains("imp_operator_reconciles"), "{text}");
        for phase in PHASES {
            let key = format!("imp_operator_vms{{phase=\"{}\"}}", phase.as_str());
            assert_eq!(sample(&text, &key), Some(0.0), "{key}");
        }
        // The conflict and backlog series exist from the start, so a rate() has a base.
        for resource in CONFLICT_RESOURCES {
            for write in ["main", "status"] {
                let key = format!(
                    "imp_operator_conflicts_total{{resource=\"{resource}\",write=\"{write}\"}}"
                );
                assert_eq!(sample(&text, &key), Some(0.0), "{key}");
            }
        }
        assert_eq!(
            sample(
                &text,
                "imp_operator_reconcile_backlog{controller=\"impvm\"}"
            ),
            Some(0.0)
        );
    }

    #[test]
    fn conflicts_count_by_resource_and_write_and_the_backlog_is_set() {
        let m = Metrics::new();
        m.conflict("impvm", Write::Status);
        m.conflict("impvm", Write::Status);
        m.conflict("impnetwork", Write::Main);
        m.set_backlog("impvm", 5);
        let text = m.encode().unwrap();
        let at = |k: &str| sample(&text, k);
        assert_eq!(
            at("imp_operator_conflicts_total{resource=\"impvm\",write=\"status\"}"),
            Some(2.0)
        );
        assert_eq!(
            at("imp_operator_conflicts_total{resource=\"impvm\",write=\"main\"}"),
            Some(0.0)
        );
        assert_eq!(
            at("imp_operator_conflicts_total{resource=\"impnetwork\",write=\"main\"}"),
            Some(1.0)
        );
        assert_eq!(
            at("imp_operator_reconcile_backlog{controller=\"impvm\"}"),
            Some(5.0)
        );
    }

    #[test]
    fn phase_counts_replace_the_previous_ones() {
        let m = Metrics::new();
        let counts: BTreeMap<String, i64> = [("Running".to_string(), 7), ("Pending".into(), 2)]
            .into_iter()
            .collect();
        m.set_phase_counts(&counts);
        let text = m.encode().unwrap();
        assert_eq!(
            sample(&text, "imp_operator_vms{phase=\"Running\"}"),
            Some(7.0)
        );
        assert_eq!(
            sample(&text, "imp_operator_vms{phase=\"Pending\"}"),
            Some(2.0)
        );
        let counts: BTreeMap<String, i64> = [("Running".to_string(), 9)].into_iter().collect();
        m.set_phase_counts(&counts);
        let text = m.encode().unwrap();
        assert_eq!(
            sample(&text, "imp_operator_vms{phase=\"Running\"}"),
            Some(9.0)
        );
        assert_eq!(
            sample(&text, "imp_operator_vms{phase=\"Pending\"}"),
            Some(0.0)
        );
    }

    #[test]
    fn counters_histogram_and_gauges_render_their_values() {
        let m = Metrics::new();
        m.reconcile("impvm");
        m.reconcile("impvm");
        m.reconcile_error("impvm", "conflict");
        m.observe_schedule_latency(Duration::from_millis(30));
        m.observe_schedule_latency(Duration::from_secs(3));
        m.set_queue_depth(12);
        m.set_leader(true);
        let text = m.encode().unwrap();
        assert!(
            text.contains("# TYPE imp_operator_reconciles counter"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE imp_operator_reconcile_errors counter"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "imp_operator_reconciles_total{controller=\"impvm\"}"),
            Some(2.0)
        );
        assert_eq!(
            sample(
                &text,
                "imp_operator_reconcile_errors_total{controller=\"impvm\",reason=\"conflict\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, "imp_operator_schedule_latency_seconds_count"),
            Some(2.0)
        );
        let sum = sample(&text, "imp_operator_schedule_latency_seconds_sum").unwrap();
        assert!((sum - 3.03).abs() < 1e-9, "{sum}");
        // 30 ms lands above the 20 ms bucket and within the 40 ms one.
        assert_eq!(
            sample(
                &text,
                "imp_operator_schedule_latency_seconds_bucket{le=\"0.02\"}"
            ),
            Some(0.0)
        );
        assert_eq!(
            sample(
                &text,
                "imp_operator_schedule_latency_seconds_bucket{le=\"0.04\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &text,
                "imp_operator_schedule_latency_seconds_bucket{le=\"+Inf\"}"
            ),
            Some(2.0)
        );
        assert_eq!(sample(&text, "imp_operator_queue_depth"), Some(12.0));
        assert_eq!(sample(&text, "imp_operator_is_leader"), Some(1.0));
        m.set_leader(false);
        assert_eq!(
            sample(&m.encode().unwrap(), "imp_operator_is_leader"),
            Some(0.0)
        );
    }

    #[test]
    fn a_held_part_keeps_a_ready_process_unready_until_released() {
        let h = Health::new();
        h.hold("webhook", "no serving\n certificate yet");
        h.set_ready();
        assert_eq!(
            h.readiness(),
            Err("webhook: no serving certificate yet".into())
        );
        h.release("webhook");
        assert_eq!(h.readiness(), Ok(()));
    }

    #[test]
    fn health_starts_live_but_not_ready_and_keeps_one_line_reasons() {
        let h = Health::new();
        assert_eq!(h.liveness(), Ok(()));
        assert_eq!(h.readiness(), Err("starting".into()));
        h.set_ready();
        assert_eq!(h.readiness(), Ok(()));
        h.set_not_ready("caches\n  not synced");
        assert_eq!(h.readiness(), Err("caches not synced".into()));
        h.set_not_live("watch task died");
        assert_eq!(h.liveness(), Err("watch task died".into()));
        h.set_live();
        assert_eq!(h.liveness(), Ok(()));
    }
}
