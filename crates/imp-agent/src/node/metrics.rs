//! The agent's Prometheus metrics. The ops server that renders them on `/metrics`, beside
//! `/healthz` and `/readyz`, is imp-telemetry, shared with the operator.

use std::collections::BTreeMap;

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard};

use imp_api::vm::VmPhase;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::runtime::state::Timings;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    step: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TriggerLabels {
    trigger: String,
}

/// The labels of a VM port's drops.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortDropLabels {
    namespace: String,
    impvm: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DescriptorLabels {
    descriptor: String,
}

/// The labels of `imp_vm_state`: a VM and its phase, as the Go agent named them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    impvm: String,
    namespace: String,
    node: String,
    state: String,
}

/// The labels of a VM's guest figures, as the Go agent named them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GuestLabels {
    /// The ImpVM's name.
    pub impvm: String,
    /// The ImpVM's namespace.
    pub namespace: String,
    /// The node the VM runs on (this one).
    pub node: String,
}

/// One reading of a VM's guest, as the gauges show it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GuestGauges {
    /// Share of CPU time busy, 0..=1.
    pub cpu_usage_ratio: f64,
    /// Share of CPU time waiting for I/O, 0..=1.
    pub cpu_iowait_ratio: f64,
    /// Memory in use (MemTotal − MemAvailable), bytes.
    pub memory_used_bytes: i64,
    /// The guest's memory, bytes.
    pub memory_total_bytes: i64,
    /// Bytes in use on the guest's root filesystem.
    pub disk_used_bytes: i64,
    /// Size of the guest's root filesystem, bytes.
    pub disk_total_bytes: i64,
}

/// The per-VM gauges of the guests' figures (`imp_vm_guest_*`).
struct GuestFamilies {
    cpu_usage: Family<GuestLabels, Gauge<f64, AtomicU64>>,
    cpu_iowait: Family<GuestLabels, Gauge<f64, AtomicU64>>,
    memory_used: Family<GuestLabels, Gauge>,
    memory_total: Family<GuestLabels, Gauge>,
    disk_used: Family<GuestLabels, Gauge>,
    disk_total: Family<GuestLabels, Gauge>,
    network_receive: Family<GuestLabels, Gauge>,
    network_transmit: Family<GuestLabels, Gauge>,
}

impl GuestFamilies {
    fn register(registry: &mut Registry) -> Self {
        let families = Self {
            cpu_usage: Family::default(),
            cpu_iowait: Family::default(),
            memory_used: Family::default(),
            memory_total: Family::default(),
            disk_used: Family::default(),
            disk_total: Family::default(),
            network_receive: Family::default(),
            network_transmit: Family::default(),
        };
        registry.register(
            "imp_vm_guest_cpu_usage_ratio",
            "Share of the guest's CPU time busy (not idle, not waiting for I/O), as its agent last reported",
            families.cpu_usage.clone(),
        );
        registry.register(
            "imp_vm_guest_cpu_iowait_ratio",
            "Share of the guest's CPU time waiting for I/O, as its agent last reported",
            families.cpu_iowait.clone(),
        );
        for (name, help, family) in [
            (
                "imp_vm_guest_memory_used",
                "The guest's memory in use (MemTotal - MemAvailable)",
                &families.memory_used,
            ),
            (
                "imp_vm_guest_memory_total",
                "The guest's memory (MemTotal)",
                &families.memory_total,
            ),
            (
                "imp_vm_guest_disk_used",
                "Bytes in use on the guest's root filesystem",
                &families.disk_used,
            ),
            (
                "imp_vm_guest_disk_total",
                "Size of the guest's root filesystem",
                &families.disk_total,
            ),
            (
                "imp_vm_guest_network_receive",
                "Bytes the guest's network interface received since its TAP was made (the node's TAP counters; VMs on an ImpNetwork only)",
                &families.network_receive,
            ),
            (
                "imp_vm_guest_network_transmit",
                "Bytes the guest's network interface sent since its TAP was made (the node's TAP counters; VMs on an ImpNetwork only)",
                &families.network_transmit,
            ),
        ] {
            registry.register_with_unit(name, help, Unit::Bytes, family.clone());
        }
        families
    }
}

/// What asked for a suspend or a resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// `spec.desiredState` (the user).
    Requested,
    /// Scale-to-zero: the VM was idle, or traffic woke it.
    ScaleToZero,
    /// An exec woke a VM that scale-to-zero put to sleep.
    Exec,
}

impl Trigger {
    fn label(self) -> TriggerLabels {
        let trigger = match self {
            Trigger::Requested => "requested",
            Trigger::ScaleToZero => "scale_to_zero",
            Trigger::Exec => "exec",
        };
        TriggerLabels {
            trigger: trigger.to_owned(),
        }
    }
}

/// The VMs' phases and start times (`imp_agent_vms`, `imp_vm_state`,
/// `imp_agent_start_duration`).
struct VmFamilies {
    by_phase: Family<PhaseLabels, Gauge>,
    states: Family<StateLabels, Gauge>,
    start_steps: Family<StepLabels, Histogram>,
}

impl VmFamilies {
    fn register(registry: &mut Registry) -> Self {
        let families = Self {
            by_phase: Family::default(),
            states: Family::default(),
            start_steps: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.05, 2.0, 14))
            }),
        };
        registry.register(
            "imp_agent_vms",
            "ImpVMs on this node by phase",
            families.by_phase.clone(),
        );
        registry.register(
            "imp_vm_state",
            "1 for each ImpVM on this node, labelled with its phase (the Go agent's name)",
            families.states.clone(),
        );
        registry.register_with_unit(
            "imp_agent_start_duration",
            "Time of each step of a VM's start (image, disk, boot, guest_ready) and in all",
            Unit::Seconds,
            families.start_steps.clone(),
        );
        families
    }
}

/// The agent API's open sessions (`imp_agent_exec_sessions`, `imp_agent_console_streams`).
struct ApiGauges {
    exec_sessions: Gauge,
    console_streams: Gauge,
}

impl ApiGauges {
    fn register(registry: &mut Registry) -> Self {
        let gauges = Self {
            exec_sessions: Gauge::default(),
            console_streams: Gauge::default(),
        };
        registry.register(
            "imp_agent_exec_sessions",
            "Exec sessions the agent API relays now",
            gauges.exec_sessions.clone(),
        );
        registry.register(
            "imp_agent_console_streams",
            "Console streams the agent API serves now",
            gauges.console_streams.clone(),
        );
        gauges
    }
}

/// What happened to the node's VMs: failures, suspends and resumes, and how sleeping VMs'
/// TAPs were held.
struct EventFamilies {
    failures: Family<ReasonLabels, Counter>,
    suspends: Family<TriggerLabels, Counter>,
    resumes: Family<TriggerLabels, Counter>,
    sleeper_holds: Family<DescriptorLabels, Counter>,
    suspend_time: Histogram,
    resume_time: Histogram,
}

impl EventFamilies {
    fn register(registry: &mut Registry) -> Self {
        let families = Self {
            failures: Family::default(),
            suspends: Family::default(),
            resumes: Family::default(),
            sleeper_holds: Family::default(),
            suspend_time: Histogram::new(exponential_buckets(0.05, 2.0, 10)),
            resume_time: Histogram::new(exponential_buckets(0.05, 2.0, 10)),
        };
        registry.register(
            "imp_agent_vm_failures",
            "VMs that failed on this node, by reason",
            families.failures.clone(),
        );
        registry.register(
            "imp_agent_suspends",
            "Suspends the agent asked for: requested (desiredState) or scale_to_zero (idle)",
            families.suspends.clone(),
        );
        registry.register(
            "imp_agent_resumes",
            "Resumes the agent started: requested (desiredState), scale_to_zero (woken by traffic) or exec (woken by an exec)",
            families.resumes.clone(),
        );
        registry.register(
            "imp_agent_sleeper_holds",
            "Sleeping VMs' TAPs held: on the descriptor kept from the suspending VMM (kept: no frame lost) or attached by name (by_name: after an agent restart, or when keeping failed)",
            families.sleeper_holds.clone(),
        );
        registry.register_with_unit(
            "imp_agent_suspend_duration",
            "Pause, snapshot and VMM stop of a suspend, on the node",
            Unit::Seconds,
            families.suspend_time.clone(),
        );
        registry.register_with_unit(
            "imp_agent_resume_duration",
            "Restore of a snapshot until the guest agent answers, on the node",
            Unit::Seconds,
            families.resume_time.clone(),
        );
        families
    }
}

/// The node's own state: its state directory's filesystem and the agent's Lease and fencing.
struct NodeGauges {
    state_dir_free: Gauge,
    state_dir_total: Gauge,
    lease_silence: Gauge<f64, AtomicU64>,
    fenced: Gauge,
}

impl NodeGauges {
    fn register(registry: &mut Registry) -> Self {
        let gauges = Self {
            state_dir_free: Gauge::default(),
            state_dir_total: Gauge::default(),
            lease_silence: Gauge::default(),
            fenced: Gauge::default(),
        };
        registry.register_with_unit(
            "imp_node_state_dir_free",
            "Bytes free for the agent on the filesystem of its state directory (VM disks, snapshots, image cache)",
            Unit::Bytes,
            gauges.state_dir_free.clone(),
        );
        registry.register_with_unit(
            "imp_node_state_dir_total",
            "Size of the filesystem of the agent's state directory",
            Unit::Bytes,
            gauges.state_dir_total.clone(),
        );
        registry.register_with_unit(
            "imp_agent_lease_silence",
            "Time since the agent's Lease was last renewed (its VMs are fenced past --fence-after)",
            Unit::Seconds,
            gauges.lease_silence.clone(),
        );
        registry.register(
            "imp_agent_fenced",
            "1 while the agent has fenced its node's VMs (it could not renew its Lease), else 0",
            gauges.fenced.clone(),
        );
        gauges
    }
}

/// Packets imp's network rules dropped: at VM ports, foreign VXLAN, denied guest egress.
struct NetworkCounters {
    port_drops: Family<PortDropLabels, Counter>,
    vxlan_foreign: Counter,
    egress_denied: Counter,
}

impl NetworkCounters {
    fn register(registry: &mut Registry) -> Self {
        let counters = Self {
            port_drops: Family::default(),
            vxlan_foreign: Counter::default(),
            egress_denied: Counter::default(),
        };
        registry.register(
            "imp_vm_port_dropped_packets",
            "Frames a VM's port dropped: not its MAC or address (mac, arp, ip), a DHCP server's answer (dhcp_server), neither IPv4 nor ARP (not_ipv4)",
            counters.port_drops.clone(),
        );
        registry.register(
            "imp_node_vxlan_foreign_dropped_packets",
            "VXLAN packets for a network on this node dropped because their sender holds none of its VMs",
            counters.vxlan_foreign.clone(),
        );
        registry.register(
            "imp_node_guest_egress_denied_packets",
            "Guests' packets dropped on this node because their destination is denied (link-local, the node's networks, --egress-deny) and their network does not allow it",
            counters.egress_denied.clone(),
        );
        counters
    }
}

/// The agent's metrics.
pub struct Metrics {
    registry: Registry,
    /// Each VM's labels and phase, by uid.
    phases: Mutex<BTreeMap<String, (GuestLabels, VmPhase)>>,
    vms: VmFamilies,
    api: ApiGauges,
    events: EventFamilies,
    guests: GuestFamilies,
    node: NodeGauges,
    network: NetworkCounters,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Metrics {
    /// A registry with every agent metric, area by area; the order of registration is the
    /// order of the `/metrics` text.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let vms = VmFamilies::register(&mut registry);
        let api = ApiGauges::register(&mut registry);
        let events = EventFamilies::register(&mut registry);
        let guests = GuestFamilies::register(&mut registry);
        let node = NodeGauges::register(&mut registry);
        let network = NetworkCounters::register(&mut registry);
        Self {
            registry,
            phases: Mutex::new(BTreeMap::new()),
            vms,
            api,
            events,
            guests,
            node,
            network,
        }
    }

    /// Records VM `uid`'s phase (`None`: the VM left the node): `imp_agent_vms` counts the
    /// VMs per phase, `imp_vm_state` shows each VM's with a 1 (no series of a VM that left).
    pub fn set_phase(&self, uid: &str, vm: Option<(&GuestLabels, VmPhase)>) {
        let mut phases = lock(&self.phases);
        match vm {
            Some((labels, p)) => {
                phases.insert(uid.to_owned(), (labels.clone(), p));
            }
            None => {
                if let Some((gone, _)) = phases.remove(uid) {
                    self.forget_port_drops(&gone);
                }
            }
        }
        let mut counts: BTreeMap<&'static str, i64> = BTreeMap::new();
        self.vms.states.clear();
        for (labels, p) in phases.values() {
            *counts.entry(p.as_str()).or_default() += 1;
            self.vms
                .states
                .get_or_create(&StateLabels {
                    impvm: labels.impvm.clone(),
                    namespace: labels.namespace.clone(),
                    node: labels.node.clone(),
                    state: p.as_str().to_owned(),
                })
                .set(1);
        }
        self.vms.by_phase.clear();
        for (phase, n) in counts {
            self.vms
                .by_phase
                .get_or_create(&PhaseLabels {
                    phase: phase.to_owned(),
                })
                .set(n);
        }
    }

    /// Records how long a VM's start took, step by step.
    pub fn observe_start(&self, t: &Timings) {
        let steps = [
            ("image", t.image_ms),
            ("disk", t.disk_ms),
            ("boot", t.boot_ms),
            ("guest_ready", t.ready_ms),
            ("total", t.image_ms + t.disk_ms + t.boot_ms + t.ready_ms),
        ];
        for (step, ms) in steps {
            self.vms
                .start_steps
                .get_or_create(&StepLabels {
                    step: step.to_owned(),
                })
                .observe(ms as f64 / 1000.0);
        }
    }

    /// Records the agent API's open exec sessions and console streams.
    pub fn set_api_sessions(&self, exec: usize, console: usize) {
        self.api
            .exec_sessions
            .set(i64::try_from(exec).unwrap_or(i64::MAX));
        self.api
            .console_streams
            .set(i64::try_from(console).unwrap_or(i64::MAX));
    }

    /// Records the state directory filesystem's free and total bytes.
    pub fn set_state_dir(&self, report: &imp_api::shared::DiskReport) {
        self.node
            .state_dir_free
            .set(i64::try_from(report.free).unwrap_or(i64::MAX));
        self.node
            .state_dir_total
            .set(i64::try_from(report.total).unwrap_or(i64::MAX));
    }

    /// Records how long the agent's Lease has gone unrenewed, and whether the node is fenced.
    pub fn set_fencing(&self, silent: std::time::Duration, fenced: bool) {
        self.node.lease_silence.set(silent.as_secs_f64());
        self.node.fenced.set(i64::from(fenced));
    }

    /// Removes the drop counts of a VM that left the node.
    fn forget_port_drops(&self, vm: &GuestLabels) {
        for &why in imp_net::nft::PortDrop::ALL {
            self.network.port_drops.remove(&PortDropLabels {
                namespace: vm.namespace.clone(),
                impvm: vm.impvm.clone(),
                reason: why.label().to_owned(),
            });
        }
    }

    /// Adds what imp's rules dropped since the last call.
    pub fn add_drops(&self, d: &imp_net::Drops) {
        for ((vm, why), n) in &d.ports {
            let (namespace, impvm) = vm.split_once('/').unwrap_or(("", vm));
            self.network
                .port_drops
                .get_or_create(&PortDropLabels {
                    namespace: namespace.to_owned(),
                    impvm: impvm.to_owned(),
                    reason: why.label().to_owned(),
                })
                .inc_by(*n);
        }
        self.network.vxlan_foreign.inc_by(d.vxlan_foreign);
        self.network.egress_denied.inc_by(d.egress_denied);
    }

    /// Counts a failed VM.
    pub fn failure(&self, reason: &str) {
        self.events
            .failures
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Counts a suspend the agent asked for.
    pub fn suspend_asked(&self, trigger: Trigger) {
        self.events.suspends.get_or_create(&trigger.label()).inc();
    }

    /// Counts a resume the agent started.
    pub fn resume_started(&self, trigger: Trigger) {
        self.events.resumes.get_or_create(&trigger.label()).inc();
    }

    /// Counts a sleeping VM's TAP held, on the descriptor kept from its VMM or by name.
    pub fn sleeper_held(&self, kept: bool) {
        let descriptor = if kept { "kept" } else { "by_name" };
        self.events
            .sleeper_holds
            .get_or_create(&DescriptorLabels {
                descriptor: descriptor.to_owned(),
            })
            .inc();
    }

    /// Records how long a suspend took on the node.
    pub fn observe_suspend(&self, ms: u64) {
        self.events.suspend_time.observe(ms as f64 / 1000.0);
    }

    /// Records how long a resume took until the guest agent answered.
    pub fn observe_resume(&self, ms: u64) {
        self.events.resume_time.observe(ms as f64 / 1000.0);
    }

    /// Shows a VM's latest guest figures.
    pub fn set_guest(&self, labels: &GuestLabels, g: &GuestGauges) {
        let f = &self.guests;
        f.cpu_usage.get_or_create(labels).set(g.cpu_usage_ratio);
        f.cpu_iowait.get_or_create(labels).set(g.cpu_iowait_ratio);
        f.memory_used.get_or_create(labels).set(g.memory_used_bytes);
        f.memory_total
            .get_or_create(labels)
            .set(g.memory_total_bytes);
        f.disk_used.get_or_create(labels).set(g.disk_used_bytes);
        f.disk_total.get_or_create(labels).set(g.disk_total_bytes);
    }

    /// Shows a VM's network traffic (`None`: it has no TAP, so no series).
    pub fn set_guest_network(
        &self,
        labels: &GuestLabels,
        n: Option<crate::api::top::NetworkBytes>,
    ) {
        let f = &self.guests;
        match n {
            Some(n) => {
                let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                f.network_receive
                    .get_or_create(labels)
                    .set(gauge(n.receive));
                f.network_transmit
                    .get_or_create(labels)
                    .set(gauge(n.transmit));
            }
            None => {
                f.network_receive.remove(labels);
                f.network_transmit.remove(labels);
            }
        }
    }

    /// Removes a VM's guest figures (it stopped, sleeps, left the node or does not answer).
    pub fn forget_guest(&self, labels: &GuestLabels) {
        let f = &self.guests;
        f.network_receive.remove(labels);
        f.network_transmit.remove(labels);
        f.cpu_usage.remove(labels);
        f.cpu_iowait.remove(labels);
        f.memory_used.remove(labels);
        f.memory_total.remove(labels);
        f.disk_used.remove(labels);
        f.disk_total.remove(labels);
    }

    /// The registry as OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl imp_telemetry::Exposition for Metrics {
    fn render(&self) -> Result<String, std::fmt::Error> {
        Ok(self.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_drops_count_per_vm_and_reason_and_go_with_the_vm() {
        use imp_net::nft::PortDrop;
        let m = Metrics::new();
        let evil = GuestLabels {
            impvm: "evil".into(),
            namespace: "ns".into(),
            node: "n1".into(),
        };
        m.set_phase("u1", Some((&evil, VmPhase::Running)));
        let mut d = imp_net::Drops::default();
        d.ports.insert(("ns/evil".into(), PortDrop::Arp), 3);
        d.vxlan_foreign = 2;
        d.egress_denied = 5;
        m.add_drops(&d);
        m.add_drops(&d);
        let text = m.encode();
        for line in [
            "imp_vm_port_dropped_packets_total{namespace=\"ns\",impvm=\"evil\",reason=\"arp\"} 6",
            "imp_node_vxlan_foreign_dropped_packets_total 4",
            "imp_node_guest_egress_denied_packets_total 10",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        m.set_phase("u1", None);
        assert!(
            !m.encode().contains("impvm=\"evil\",reason"),
            "{}",
            m.encode()
        );
    }

    #[test]
    fn phases_are_counted_per_vm_and_steps_observed() {
        let m = Metrics::new();
        let vm = |name: &str| GuestLabels {
            impvm: name.into(),
            namespace: "ns".into(),
            node: "n1".into(),
        };
        m.set_phase("a", Some((&vm("a"), VmPhase::Running)));
        m.set_phase("b", Some((&vm("b"), VmPhase::Running)));
        m.set_phase("c", Some((&vm("c"), VmPhase::Starting)));
        m.set_phase("c", Some((&vm("c"), VmPhase::Running)));
        m.set_phase("b", None);
        m.observe_start(&Timings {
            image_ms: 100,
            disk_ms: 200,
            boot_ms: 300,
            ready_ms: 400,
            ..Timings::default()
        });
        m.failure("ImagePullFailed");
        m.suspend_asked(Trigger::ScaleToZero);
        m.resume_started(Trigger::ScaleToZero);
        m.resume_started(Trigger::Requested);
        m.resume_started(Trigger::Exec);
        m.sleeper_held(true);
        m.sleeper_held(true);
        m.sleeper_held(false);
        m.observe_resume(250);
        m.set_state_dir(&imp_api::shared::DiskReport {
            free: 5 << 30,
            total: 20 << 30,
        });
        m.set_fencing(std::time::Duration::from_millis(31_500), true);
        let text = m.encode();
        for want in [
            "imp_node_state_dir_free_bytes 5368709120",
            "imp_node_state_dir_total_bytes 21474836480",
            "imp_agent_fenced 1",
            "imp_agent_lease_silence_seconds 31.5",
            "imp_agent_suspends_total{trigger=\"scale_to_zero\"} 1",
            "imp_agent_resumes_total{trigger=\"requested\"} 1",
            "imp_agent_resumes_total{trigger=\"exec\"} 1",
            "imp_agent_sleeper_holds_total{descriptor=\"kept\"} 2",
            "imp_agent_sleeper_holds_total{descriptor=\"by_name\"} 1",
            "imp_agent_resume_duration_seconds_sum 0.25",
        ] {
            assert!(text.contains(want), "{want} in {text}");
        }
        assert!(
            text.contains("imp_agent_vms{phase=\"Running\"} 2"),
            "{text}"
        );
        assert!(!text.contains("phase=\"Starting\""), "{text}");
        assert!(
            text.contains(
                "imp_vm_state{impvm=\"c\",namespace=\"ns\",node=\"n1\",state=\"Running\"} 1"
            ),
            "{text}"
        );
        assert!(
            !text.contains("state=\"Starting\""),
            "a VM's old phase stays: {text}"
        );
        assert!(
            !text.contains("impvm=\"b\""),
            "a VM that left stays: {text}"
        );
        assert!(
            text.contains("imp_agent_start_duration_seconds_sum{step=\"total\"} 1.0"),
            "{text}"
        );
        assert!(
            text.contains("imp_agent_vm_failures_total{reason=\"ImagePullFailed\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn guest_figures_are_labelled_per_vm_and_go_with_the_vm() {
        let m = Metrics::new();
        let labels = |vm: &str| GuestLabels {
            impvm: vm.to_owned(),
            namespace: "team".to_owned(),
            node: "n1".to_owned(),
        };
        let g = GuestGauges {
            cpu_usage_ratio: 0.25,
            cpu_iowait_ratio: 0.5,
            memory_used_bytes: 64 << 20,
            memory_total_bytes: 256 << 20,
            disk_used_bytes: 1000,
            disk_total_bytes: 4000,
        };
        m.set_guest(&labels("a"), &g);
        m.set_guest(&labels("b"), &g);
        let text = m.encode();
        let vm_a = "{impvm=\"a\",namespace=\"team\",node=\"n1\"}";
        for want in [
            format!("imp_vm_guest_cpu_usage_ratio{vm_a} 0.25"),
            format!("imp_vm_guest_cpu_iowait_ratio{vm_a} 0.5"),
            format!("imp_vm_guest_memory_used_bytes{vm_a} 67108864"),
            format!("imp_vm_guest_memory_total_bytes{vm_a} 268435456"),
            format!("imp_vm_guest_disk_used_bytes{vm_a} 1000"),
            format!("imp_vm_guest_disk_total_bytes{vm_a} 4000"),
        ] {
            assert!(text.contains(&want), "{want} in {text}");
        }
        m.forget_guest(&labels("a"));
        let text = m.encode();
        assert!(!text.contains("impvm=\"a\""), "{text}");
        assert_eq!(text.matches("impvm=\"b\"").count(), 6, "{text}");
    }
}
