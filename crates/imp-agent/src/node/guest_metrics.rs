//! Guest metrics: every `every` the agent asks each running VM's guest agent for its CPU,
//! memory and disk figures ([`imp_proto::MetricsReport`]), exports them as per-VM gauges
//! (`imp_vm_guest_*{impvm,namespace,node}`, [`super::metrics`]) and keeps them for the agent
//! API (`imp top`, [`crate::api::top`]).
//!
//! Bounded: at most one request per VM is in flight (a VM whose guest has not answered yet is
//! skipped until it has, or its timeout ended it), each within `timeout` in all, and at most
//! [`AT_ONCE`] VMs are asked at the same moment. Only VMs that run now are asked: a sleeping
//! (Suspended) ScaleToZero VM, one whose suspend has begun, one starting, resuming or ended is
//! never contacted, so polling never wakes a VM and never holds off a suspend. Nor does it keep
//! a VM awake: scale-to-zero counts the frames the guest sends on its TAP
//! ([`imp_net::idle`]) and the open exec sessions ([`super::vms`]), and the request travels
//! on the guest channel (Firecracker's vsock, QEMU's virtio-serial port), which is neither.
//!
//! No stale series: a VM's figures go when it stops running here (stopped, suspended, failed,
//! deleted or moved), and when its guest fails to answer. The decisions (whom to ask now,
//! which figures to forget, whether an answer still counts, what a report shows) are pure
//! functions; [`run`] applies them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use imp_proto::MetricsReport;
use tokio::sync::{Semaphore, mpsc};

use super::metrics::{GuestGauges, GuestLabels, Metrics};
use super::vms::{Guest, NodeVms};
use crate::api::top::{GuestReading, NetworkBytes};
use crate::runtime::guest_agent;
use imp_net::link::{LinkState, Netlink};

/// How often the guests are asked when the agent is not told otherwise.
pub const DEFAULT_EVERY: Duration = Duration::from_secs(15);

/// How long one guest may take to answer when the agent is not told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// How many guests are asked at the same moment, at most (each request holds a blocking
/// thread while it runs).
pub const AT_ONCE: usize = 8;

/// How the poller runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// This node's name (the `node` label).
    pub node: String,
    /// How often each running VM's guest is asked; zero turns polling off.
    pub every: Duration,
    /// How long one guest may take to answer, connection included.
    pub timeout: Duration,
    /// The node's netlink connection, to read VMs' TAP counters (`None`: no networking).
    pub links: Option<Netlink>,
}

/// `(namespace, name)` of an ImpVM.
type Key = (String, String);

impl Guest {
    fn key(&self) -> Key {
        (self.namespace.clone(), self.name.clone())
    }
}

/// The VMs to ask now: those running, unless a request to them is still in flight.
pub fn due<'a>(guests: &'a [Guest], in_flight: &HashSet<Key>) -> Vec<&'a Guest> {
    guests
        .iter()
        .filter(|g| g.running && !in_flight.contains(&g.key()))
        .collect()
}

/// The VMs whose figures are shown and must go: no longer on this node, or not running.
pub fn stale(shown: &HashMap<Key, String>, guests: &[Guest]) -> Vec<Key> {
    let mut gone: Vec<Key> = shown
        .iter()
        .filter(|(k, uid)| {
            !guests
                .iter()
                .any(|g| g.running && g.key() == **k && g.uid == **uid)
        })
        .map(|(k, _)| k.clone())
        .collect();
    gone.sort();
    gone
}

/// Whether an answer from VM `uid` under `key` still counts: the VM runs, and is the same VM
/// (not one deleted and recreated under the same name while the request was in flight).
pub fn wanted(guests: &[Guest], key: &Key, uid: &str) -> bool {
    guests
        .iter()
        .any(|g| g.running && g.key() == *key && g.uid == uid)
}

/// What a guest's report shows: ratios in 0..=1 (a guest is untrusted: anything else, NaN
/// included, is clamped), byte counts as they are (at most `i64::MAX`).
pub fn gauges(r: &MetricsReport) -> GuestGauges {
    let ratio = |x: f64| if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) };
    let bytes = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
    GuestGauges {
        cpu_usage_ratio: ratio(r.cpu_usage_ratio),
        cpu_iowait_ratio: ratio(r.cpu_iowait_ratio),
        memory_used_bytes: bytes(r.memory_used_bytes),
        memory_total_bytes: bytes(r.memory_total_bytes),
        disk_used_bytes: bytes(r.disk_used_bytes),
        disk_total_bytes: bytes(r.disk_total_bytes),
    }
}

/// A report as it is kept and served: the ratios as the gauges show them.
fn sanitized(r: &MetricsReport) -> MetricsReport {
    let g = gauges(r);
    MetricsReport {
        cpu_usage_ratio: g.cpu_usage_ratio,
        cpu_iowait_ratio: g.cpu_iowait_ratio,
        ..*r
    }
}

/// What one request came back with.
struct Answer {
    key: Key,
    uid: String,
    result: Result<MetricsReport, guest_agent::GuestAgentError>,
    network: Option<NetworkBytes>,
}

/// What the poller remembers between ticks.
#[derive(Default)]
struct Book {
    /// VMs whose figures are shown, with the uid they came from.
    shown: HashMap<Key, String>,
    /// VMs with a request in flight.
    in_flight: HashSet<Key>,
    /// VMs whose last request failed (warned about once, until one succeeds).
    failing: HashSet<Key>,
}

/// Polls this node's running guests until `shutdown`; with `every` zero, does nothing.
pub async fn run(
    vms: Arc<NodeVms>,
    metrics: Arc<Metrics>,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()>,
) {
    if settings.every.is_zero() {
        tracing::info!(node = %settings.node, "guest metrics are not polled (interval 0)");
        return;
    }
    tracing::info!(node = %settings.node, every = ?settings.every, timeout = ?settings.timeout, "polling guest metrics");
    let (tx, mut rx) = mpsc::channel::<Answer>(64);
    let limit = Arc::new(Semaphore::new(AT_ONCE));
    let mut book = Book::default();
    let mut tick = tokio::time::interval(settings.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => {
                for g in book.tick(&vms, &metrics, &settings.node) {
                    let how = (settings.timeout, settings.links.clone());
                    tokio::spawn(ask(g, how, limit.clone(), tx.clone()));
                }
            }
            Some(answer) = rx.recv() => book.take(answer, &vms, &metrics, &settings.node),
        }
    }
}

impl Book {
    /// Forgets the figures of VMs that no longer run here and returns the VMs to ask now,
    /// marked in flight.
    fn tick(&mut self, vms: &NodeVms, metrics: &Metrics, node: &str) -> Vec<Guest> {
        let guests = vms.guests();
        for key in stale(&self.shown, &guests) {
            forget(vms, metrics, node, &key);
            self.shown.remove(&key);
        }
        self.failing
            .retain(|k| guests.iter().any(|g| g.running && g.key() == *k));
        let ask: Vec<Guest> = due(&guests, &self.in_flight).into_iter().cloned().collect();
        self.in_flight.extend(ask.iter().map(Guest::key));
        ask
    }

    /// Shows what a guest answered, or drops its figures when it failed; an answer from a VM
    /// that stopped running meanwhile is ignored (the next tick forgets what it showed).
    fn take(&mut self, answer: Answer, vms: &NodeVms, metrics: &Metrics, node: &str) {
        self.in_flight.remove(&answer.key);
        if !wanted(&vms.guests(), &answer.key, &answer.uid) {
            return;
        }
        let (namespace, name) = &answer.key;
        match answer.result {
            Ok(report) => {
                let report = sanitized(&report);
                let shown = labels(node, &answer.key);
                metrics.set_guest(&shown, &gauges(&report));
                metrics.set_guest_network(&shown, answer.network);
                let sampled_unix = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                let reading = GuestReading {
                    name: name.clone(),
                    uid: answer.uid.clone(),
                    sampled_unix,
                    report,
                    network: answer.network,
                };
                vms.set_reading(namespace, name, Some(reading));
                if self.failing.remove(&answer.key) {
                    tracing::info!(vm = %name, namespace = %namespace, node, "the guest reports its metrics again");
                }
                self.shown.insert(answer.key, answer.uid);
            }
            Err(e) => {
                let error = imp_api::chain::chain(&e);
                if self.failing.insert(answer.key.clone()) {
                    tracing::warn!(vm = %name, namespace = %namespace, node, error = %error,
                        "the guest did not report its metrics; its figures are dropped until it does");
                } else {
                    tracing::debug!(vm = %name, namespace = %namespace, error = %error,
                        "the guest still does not report its metrics");
                }
                if self.shown.remove(&answer.key).is_some() {
                    forget(vms, metrics, node, &answer.key);
                }
            }
        }
    }
}

fn labels(node: &str, (namespace, name): &Key) -> GuestLabels {
    GuestLabels {
        impvm: name.clone(),
        namespace: namespace.clone(),
        node: node.to_owned(),
    }
}

fn forget(vms: &NodeVms, metrics: &Metrics, node: &str, key: &Key) {
    metrics.forget_guest(&labels(node, key));
    vms.set_reading(&key.0, &key.1, None);
}

/// Asks one guest, once a slot of [`AT_ONCE`] is free, and hands the answer back.
async fn ask(
    g: Guest,
    (timeout, links): (Duration, Option<Netlink>),
    limit: Arc<Semaphore>,
    tx: mpsc::Sender<Answer>,
) {
    let key = g.key();
    let result = match limit.acquire_owned().await {
        Ok(_permit) => guest_agent::metrics(&g.vsock, g.agent_port, timeout).await,
        // The semaphore is never closed; should it be, nothing is asked any more.
        Err(_) => return,
    };
    let network = tap_traffic(links.as_ref(), &g.namespace, &g.name).await;
    let _ = tx
        .send(Answer {
            key,
            uid: g.uid,
            result,
            network,
        })
        .await;
}

/// What the guest behind a TAP received and sent, from the TAP's counters: the node's `tx`
/// is what the guest received, its `rx` what the guest sent.
pub fn network_bytes(tap: &LinkState) -> NetworkBytes {
    NetworkBytes {
        receive: tap.tx_bytes,
        transmit: tap.rx_bytes,
    }
}

/// The traffic of the guest of VM `namespace/name`, from its TAP; `None` without networking
/// on the node, or when the VM has no TAP.
async fn tap_traffic(links: Option<&Netlink>, namespace: &str, name: &str) -> Option<NetworkBytes> {
    let tap = imp_net::names::tap(namespace, name);
    match links?.link_state(&tap).await {
        Ok(state) => state.as_ref().map(network_bytes),
        Err(e) => {
            tracing::debug!(vm = %name, namespace, tap, error = %imp_api::chain::chain(&e), "reading a TAP's counters");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guest(name: &str, uid: &str, running: bool) -> Guest {
        Guest {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
            vsock: std::path::PathBuf::from("/v"),
            agent_port: 10000,
            running,
        }
    }

    fn key(name: &str) -> Key {
        ("ns".into(), name.into())
    }

    #[test]
    fn only_running_vms_without_a_request_in_flight_are_asked() {
        let guests = [
            guest("web", "u1", true),
            guest("asleep", "u2", false),
            guest("busy", "u3", true),
        ];
        let in_flight = HashSet::from([key("busy")]);
        let names: Vec<&str> = due(&guests, &in_flight)
            .iter()
            .map(|g| g.name.as_str())
            .collect();
        assert_eq!(names, ["web"]);
        assert!(due(&[], &HashSet::new()).is_empty());
    }

    #[test]
    fn figures_of_vms_gone_stopped_or_recreated_are_forgotten() {
        let shown = HashMap::from([
            (key("web"), "u1".to_owned()),
            (key("gone"), "u2".to_owned()),
            (key("asleep"), "u3".to_owned()),
            (key("again"), "old".to_owned()),
        ]);
        let guests = [
            guest("web", "u1", true),
            guest("asleep", "u3", false),
            guest("again", "new", true),
        ];
        assert_eq!(
            stale(&shown, &guests),
            [key("again"), key("asleep"), key("gone")]
        );
        assert!(stale(&HashMap::new(), &guests).is_empty());
    }

    #[test]
    fn an_answer_counts_only_for_the_same_vm_still_running() {
        let guests = [guest("web", "u1", true), guest("asleep", "u2", false)];
        assert!(wanted(&guests, &key("web"), "u1"));
        assert!(!wanted(&guests, &key("web"), "u0"), "recreated meanwhile");
        assert!(
            !wanted(&guests, &key("asleep"), "u2"),
            "suspended meanwhile"
        );
        assert!(!wanted(&guests, &key("gone"), "u9"), "left the node");
    }

    /// A guest behind a fake VMM vsock socket that answers every metrics request with a
    /// memory figure that grows by 1 MiB per answer; counts the connections.
    fn fake_guest(vsock: &std::path::Path) -> Arc<std::sync::atomic::AtomicU64> {
        use imp_proto::message::{Hello, Message};
        use std::io::{BufRead, Write};
        use std::sync::atomic::Ordering;
        let listener = std::os::unix::net::UnixListener::bind(vsock).unwrap();
        let asked = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let count = asked.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                let mut reader = std::io::BufReader::new(stream);
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                assert!(line.starts_with("CONNECT 10000"), "{line:?}");
                let mut s = reader.into_inner();
                s.write_all(b"OK 1\n").unwrap();
                imp_proto::handshake(&mut s, &Hello::new("fake guest")).unwrap();
                while let Ok(Some(m)) = imp_proto::read_frame(&mut s) {
                    assert_eq!(m, Message::Metrics);
                    let report = MetricsReport {
                        cpu_usage_ratio: 0.5,
                        memory_used_bytes: n << 20,
                        memory_total_bytes: 256 << 20,
                        ..MetricsReport::default()
                    };
                    imp_proto::write_frame(&mut s, &Message::MetricsReport(report)).unwrap();
                }
            }
        });
        asked
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting until {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_running_guest_is_polled_into_gauges_and_a_suspended_one_is_left_alone() {
        use crate::api::VmLookup;
        use crate::runtime::state::VmStatus;
        use std::sync::atomic::Ordering;
        let dir = std::env::temp_dir().join(format!("imp-guest-metrics-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let vsock = dir.join("v.sock");
        let asked = fake_guest(&vsock);
        let mut record = crate::node::decide::tests::record(VmStatus::Running, 0);
        record.vsock = vsock.clone();
        let vms = Arc::new(NodeVms::default());
        vms.refresh(&[(record.clone(), true)]);
        let metrics = Arc::new(Metrics::new());
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let poller = tokio::spawn(run(
            vms.clone(),
            metrics.clone(),
            Settings {
                node: "n1".into(),
                every: Duration::from_millis(50),
                timeout: Duration::from_secs(2),
                links: None,
            },
            async move {
                let _ = stop_rx.await;
            },
        ));
        let series = "imp_vm_guest_memory_used_bytes{impvm=\"vm\",namespace=\"ns\",node=\"n1\"}";
        until("the guest's memory is shown", || {
            metrics.encode().contains(series)
        })
        .await;
        until("the figures are refreshed", || {
            asked.load(Ordering::SeqCst) >= 3
        })
        .await;
        let readings = vms.guest_readings("ns");
        assert_eq!(readings.len(), 1, "{readings:?}");
        assert_eq!(
            (readings[0].name.as_str(), readings[0].uid.as_str()),
            ("vm", "uid-1")
        );
        assert_eq!(readings[0].report.cpu_usage_ratio, 0.5);
        assert!(vms.guest_readings("other").is_empty());

        // Suspended (scale-to-zero put it to sleep): its figures go and nobody knocks.
        record.status = VmStatus::Suspended;
        vms.refresh(&[(record.clone(), false)]);
        until("the sleeper's figures are gone", || {
            !metrics.encode().contains(series)
        })
        .await;
        assert!(vms.guest_readings("ns").is_empty());
        let before = asked.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            asked.load(Ordering::SeqCst) <= before + 1,
            "a sleeping VM's guest was asked"
        );

        // Running again, then gone from the node: back, then gone for good.
        record.status = VmStatus::Running;
        vms.refresh(&[(record.clone(), true)]);
        until("the figures are back", || metrics.encode().contains(series)).await;
        vms.refresh(&[]);
        until("the figures of a VM that left are gone", || {
            !metrics.encode().contains("impvm=\"vm\"")
        })
        .await;
        assert!(vms.guest_readings("ns").is_empty());
        let _ = stop_tx.send(());
        poller.await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_report_becomes_gauges_with_hostile_values_clamped() {
        let r = MetricsReport {
            cpu_usage_ratio: 0.5,
            cpu_iowait_ratio: 0.125,
            memory_used_bytes: 64 << 20,
            memory_total_bytes: 256 << 20,
            disk_used_bytes: 10,
            disk_total_bytes: 20,
        };
        assert_eq!(
            gauges(&r),
            GuestGauges {
                cpu_usage_ratio: 0.5,
                cpu_iowait_ratio: 0.125,
                memory_used_bytes: 64 << 20,
                memory_total_bytes: 256 << 20,
                disk_used_bytes: 10,
                disk_total_bytes: 20,
            }
        );
        let hostile = MetricsReport {
            cpu_usage_ratio: f64::NAN,
            cpu_iowait_ratio: 7.0,
            memory_used_bytes: u64::MAX,
            ..r
        };
        let g = gauges(&hostile);
        assert_eq!(g.cpu_usage_ratio, 0.0);
        assert_eq!(g.cpu_iowait_ratio, 1.0);
        assert_eq!(g.memory_used_bytes, i64::MAX);
        assert_eq!(
            gauges(&MetricsReport {
                cpu_usage_ratio: -1.0,
                ..r
            })
            .cpu_usage_ratio,
            0.0
        );
        let kept = sanitized(&hostile);
        assert_eq!((kept.cpu_usage_ratio, kept.cpu_iowait_ratio), (0.0, 1.0));
        assert_eq!(
            kept.memory_used_bytes,
            u64::MAX,
            "the report keeps its bytes"
        );
    }

    #[test]
    fn a_taps_counters_are_the_guests_traffic_the_other_way_round() {
        let tap = LinkState {
            rx_bytes: 1200,
            tx_bytes: 34000,
            ..LinkState::default()
        };
        assert_eq!(
            network_bytes(&tap),
            NetworkBytes {
                receive: 34000,
                transmit: 1200
            }
        );
    }
}
