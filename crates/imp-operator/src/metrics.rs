//! Prometheus metrics of the operator: [`Metrics`] owns a prometheus-client registry with the
//! operator's metrics and plain methods the controllers call. The ops server that renders it
//! on `/metrics`, beside `/healthz` and `/readyz`, is imp-telemetry, shared with the node agent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use imp_api::vm::VmPhase;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::names;

/// Errors of the ops server.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
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
struct PoolLabels {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

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
    agent_leases_ignored: Family<ReasonLabels, Counter>,
    pool_ready: Family<PoolLabels, Gauge>,
    pool_size: Family<PoolLabels, Gauge>,
    /// The pools `set_pool` gave series, so `keep_pools` can drop the deleted ones'.
    pools_shown: Mutex<BTreeSet<String>>,
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
        let agent_leases_ignored = register_agent_leases(&mut registry);
        let (pool_ready, pool_size) = register_pools(&mut registry);
        Self {
            pool_ready,
            pool_size,
            pools_shown: Mutex::new(BTreeSet::new()),
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
            agent_leases_ignored,
        }
    }

    /// Counts one sight of a Lease labelled as an agent's that the operator ignored
    /// (`reason`: an [`crate::placement::fencing::Ignored`] label).
    pub fn agent_lease_ignored(&self, reason: &str) {
        self.agent_leases_ignored
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
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

    /// Sets `imp_operator_warmpool_ready{pool}` and `imp_operator_warmpool_size{pool}` of
    /// pool `pool` (namespace/name).
    pub fn set_pool(&self, pool: &str, ready: i32, size: i32) {
        let labels = PoolLabels {
            pool: pool.to_owned(),
        };
        self.pool_ready.get_or_create(&labels).set(ready.into());
        self.pool_size.get_or_create(&labels).set(size.into());
        self.pools_shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(pool.to_owned());
    }

    /// Drops the series of every pool not in `pools` (namespace/name): pools deleted since.
    pub fn keep_pools(&self, pools: &BTreeSet<String>) {
        let mut shown = self
            .pools_shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for pool in shown.iter().filter(|p| !pools.contains(*p)) {
            let labels = PoolLabels { pool: pool.clone() };
            self.pool_ready.remove(&labels);
            self.pool_size.remove(&labels);
        }
        shown.retain(|p| pools.contains(p));
    }

    /// Sets `imp_operator_vms{phase}` from a full count; phases absent from `counts` become 0.
    pub fn set_phase_counts(&self, counts: &BTreeMap<String, i64>) {
        let mut seen = self
            .seen_phases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for phase in seen.iter() {
            if !counts.contains_key(phase) {
                self.vms
                    .get_or_create(&PhaseLabels {
                        phase: phase.clone(),
                    })
                    .set(0);
            }
        }
        for &phase in VmPhase::ALL {
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
    for &phase in VmPhase::ALL {
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

/// `imp_operator_warmpool_ready` and `imp_operator_warmpool_size`, by pool.
fn register_pools(
    registry: &mut Registry,
) -> (Family<PoolLabels, Gauge>, Family<PoolLabels, Gauge>) {
    let ready = Family::<PoolLabels, Gauge>::default();
    registry.register(
        "imp_operator_warmpool_ready",
        "Members of an ImpWarmPool (namespace/name) running and Ready: its status.readyCount",
        ready.clone(),
    );
    let size = Family::<PoolLabels, Gauge>::default();
    registry.register(
        "imp_operator_warmpool_size",
        "Members an ImpWarmPool (namespace/name) keeps: its spec.size",
        size.clone(),
    );
    (ready, size)
}

/// `imp_operator_agent_leases_ignored_total`, every reason at 0.
fn register_agent_leases(registry: &mut Registry) -> Family<ReasonLabels, Counter> {
    let ignored = Family::<ReasonLabels, Counter>::default();
    for &why in crate::placement::fencing::Ignored::ALL {
        let _ = ignored.get_or_create(&ReasonLabels {
            reason: why.as_str().to_owned(),
        });
    }
    registry.register(
        "imp_operator_agent_leases_ignored",
        "Sights of a Lease labelled imp.dev/agent-lease=true that the operator ignored, by \
         reason (namespace: not the agents' namespace; holder: its holderIdentity is not the \
         node its name is for; duration: leaseDurationSeconds missing or out of range). An \
         ignored Lease renews nothing and moves no VM; a rise means something other than a \
         node's agent writes agent Leases",
        ignored.clone(),
    );
    ignored
}

impl imp_telemetry::Exposition for Metrics {
    fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
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
            "# TYPE imp_operator_agent_leases_ignored counter",
            "imp_operator_agent_leases_ignored_total{reason=\"holder\"} 0",
            "# TYPE imp_operator_conflicts counter",
            "# TYPE imp_operator_reconcile_backlog gauge",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        // Labelled counters appear with their first sample (prometheus-client omits empty
        // families).
        assert!(!text.contains("imp_operator_reconciles"), "{text}");
        for &phase in VmPhase::ALL {
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
    fn a_pools_series_follow_it_and_go_with_it() {
        let m = Metrics::new();
        m.set_pool("ci/py", 1, 2);
        m.set_pool("ci/go", 2, 2);
        m.set_pool("ci/py", 2, 2);
        let text = m.encode().unwrap();
        let at = |k: &str| sample(&text, k);
        assert_eq!(at("imp_operator_warmpool_ready{pool=\"ci/py\"}"), Some(2.0));
        assert_eq!(at("imp_operator_warmpool_size{pool=\"ci/py\"}"), Some(2.0));
        assert_eq!(at("imp_operator_warmpool_ready{pool=\"ci/go\"}"), Some(2.0));
        // ci/py deleted: its series go, ci/go's stay.
        m.keep_pools(&BTreeSet::from(["ci/go".to_owned()]));
        let text = m.encode().unwrap();
        assert!(!text.contains("pool=\"ci/py\""), "{text}");
        assert_eq!(
            sample(&text, "imp_operator_warmpool_size{pool=\"ci/go\"}"),
            Some(2.0)
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
}
