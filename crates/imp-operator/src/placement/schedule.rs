//! Node choice for one ImpVM: eligibility, taints and tolerations, capacity, tie-break.
//!
//! Pure logic: the controller builds a [`NodeView`] per Node, takes the [`NodeUsage`] per node
//! that [`crate::placement::ledger`] keeps from every VM it knows of (its cache plus the placements it made
//! that the cache may not show yet), then calls [`pick`].
//!
//! # Eligibility, in the order reasons are reported
//! 1. the node carries label `imp/enabled=true`;
//! 2. it is Ready and not cordoned;
//! 3. every `spec.nodeSelector` label matches exactly;
//! 4. the class's `arch` (unless `multi`) equals the node's label `kubernetes.io/arch`, which
//!    kubelet sets; a node without the label is refused, its architecture being unknown;
//! 5. the class's `runtime` is among those the node's agent found able to run VMs there
//!    (annotation `imp.dev/runtimes`, see [`runtime_reason`]);
//! 6. every `NoSchedule`/`NoExecute` taint is tolerated (class ∪ template ∪ VM tolerations);
//!    `PreferNoSchedule` only ranks the node lower;
//! 7. capacity: `maxImpVMs` from its ClusterImpNodeProfile, then vCPU and memory, then disk:
//!    the free space its agent last reported in its state directory (annotation
//!    `imp.dev/disk`) holds the class's `diskGiB`, and the VM's memory too when it is to be
//!    suspended (`desiredState` Suspended or ScaleToZero) (a node that has not reported is not refused;
//!    the figure is the agent's last report, refreshed every 30 s, not a booking).
//!
//! # Capacity
//! An explicit `vcpuCapacity`/`memoryMiB` in the node's profile is the hard capacity (each one
//! that is set and non-zero wins over the derived value, so a profile with only vcpuCapacity still
//! fits VMs by memory). Otherwise capacity is `status.allocatable × fraction`, where the fraction
//! is the profile's `capacityFraction`, else ClusterImpConfig `cluster`'s `defaultFraction`, else
//! 0.9. Usage is the sum of each VM's **own** size (not the size of the VM being placed): the
//! size it was booked with when placed, else its live class (see [`crate::placement::ledger`]).
//!
//! Pods share the node: what the Pods bound to it request ([`NodeView::pods`], see
//! [`crate::placement::reservation`]) is taken from the node's total before VMs are fitted, the total being
//! its allocatable (or the profile's explicit capacity where that is larger: an admin who
//! declares more than allocatable overcommits on purpose). A VM fits when it fits both imp's
//! share and what the Pods left: `free = min(capacity − VMs, total − Pods − VMs)`.
//!
//! Suspended VMs, per the Go project's overcommit rule: their vCPUs are free, and their memory is
//! free too when [`Policy::overcommit_suspended`] is on (the Go behaviour and our default); when
//! it is off a suspended VM's memory stays reserved so it can always resume. Suspended VMs count
//! toward `maxImpVMs` either way (they hold a TAP and an IP on the node).
//!
//! # Spreading, deterministic
//! Among nodes that fit, the winner is the one with the most free memory left after placement
//! (spreading: it keeps the blast radius of a node loss small and leaves room for suspended VMs
//! to resume), nodes with an untolerated `PreferNoSchedule` taint last, then fewer VMs, then the
//! node name in byte order. The same inputs always give the same node.

use std::collections::BTreeMap;

use imp_api::cluster::ClusterImpNodeProfileSpec;
use imp_api::shared::{
    ANNOTATION_DISK, ANNOTATION_RUNTIMES, Arch, DiskReport, LABEL_NODE_ARCH, LABEL_NODE_ENABLED,
    VmRuntime,
};
use k8s_openapi::api::core::v1::{Node, Taint, Toleration};

use crate::placement::quantity::{parse_bytes, parse_cpu_milli};
use crate::placement::reservation::Load;

/// The capacity fraction used when neither the profile nor the cluster config sets one.
pub const DEFAULT_FRACTION: f64 = 0.9;

/// What the VM being placed needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// vCPUs of the VM's class.
    pub vcpu: i64,
    /// Memory of the VM's class in MiB.
    pub memory_mib: i64,
    /// Labels a node must carry.
    pub node_selector: BTreeMap<String, String>,
    /// Union of class, template and VM tolerations.
    pub tolerations: Vec<Toleration>,
    /// The one node that can take the VM, and why (its snapshot's files are there).
    pub only_node: Option<(String, String)>,
    /// The class's architecture (`multi`: any node).
    pub arch: Arch,
    /// The class's runtime (`None`: the agent's default, any node that runs one).
    pub runtime: Option<VmRuntime>,
    /// The class's disk in GiB (0: not checked).
    pub disk_gib: i64,
    /// Room for a memory snapshot in MiB, beside the disk: the VM's memory when it is to be
    /// suspended (`desiredState` Suspended or ScaleToZero), else 0.
    pub snapshot_mib: i64,
}

/// One Node as the scheduler sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// Node labels.
    pub labels: BTreeMap<String, String>,
    /// Node taints.
    pub taints: Vec<Taint>,
    /// Condition Ready is True.
    pub ready: bool,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
    /// `status.allocatable.cpu` in millicores.
    pub allocatable_cpu_milli: i64,
    /// `status.allocatable.memory` in MiB.
    pub allocatable_memory_mib: i64,
    /// The node's ClusterImpNodeProfile, if one exists.
    pub profile: Option<ClusterImpNodeProfileSpec>,
    /// The runtimes its agent published (annotation `imp.dev/runtimes`); `None` when no agent
    /// has said.
    pub runtimes: Option<Vec<VmRuntime>>,
    /// What the Pods bound to it request (reservation Pods of VMs left out).
    pub pods: Load,
    /// Free bytes in its agent's state directory, as the agent last reported them
    /// (annotation `imp.dev/disk`); `None` when it has not, or not readably.
    pub disk_free: Option<u64>,
}

impl NodeView {
    /// Builds the view of a Node object and its profile (if any).
    pub fn from_node(node: &Node, profile: Option<ClusterImpNodeProfileSpec>) -> Self {
        let name = node.metadata.name.clone().unwrap_or_default();
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let runtimes = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_RUNTIMES))
            .map(|v| VmRuntime::parse_list(v));
        let disk_free = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_DISK))
            .and_then(|v| DiskReport::parse(v).ok())
            .map(|d| d.free);
        let spec = node.spec.as_ref();
        let taints = spec.and_then(|s| s.taints.clone()).unwrap_or_default();
        let unschedulable = spec.and_then(|s| s.unschedulable).unwrap_or(false);
        let status = node.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let alloc = status.and_then(|s| s.allocatable.as_ref());
        let allocatable_cpu_milli = alloc
            .and_then(|a| a.get("cpu"))
            .and_then(|q| parse_cpu_milli(&q.0))
            .unwrap_or(0);
        let allocatable_memory_mib = alloc
            .and_then(|a| a.get("memory"))
            .and_then(|q| parse_bytes(&q.0))
            .map_or(0, |b| (b / (1024 * 1024)) as i64);
        Self {
            name,
            labels,
            taints,
            ready,
            unschedulable,
            allocatable_cpu_milli,
            allocatable_memory_mib,
            profile,
            runtimes,
            pods: Load::default(),
            disk_free,
        }
    }
}

/// What the VMs already on a node use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeUsage {
    /// vCPUs of VMs that are not suspended.
    pub vcpu: i64,
    /// Memory (MiB) of VMs that are not suspended.
    pub memory_mib: i64,
    /// Memory (MiB) of suspended VMs.
    pub suspended_memory_mib: i64,
    /// VMs holding the node, suspended ones included.
    pub vms: i64,
}

impl NodeUsage {
    /// Adds one VM of the given size.
    pub fn add(&mut self, vcpu: i64, memory_mib: i64, suspended: bool) {
        self.vms += 1;
        if suspended {
            self.suspended_memory_mib += memory_mib;
        } else {
            self.vcpu += vcpu;
            self.memory_mib += memory_mib;
        }
    }

    /// Takes back one VM added with the same arguments.
    pub fn remove(&mut self, vcpu: i64, memory_mib: i64, suspended: bool) {
        self.vms -= 1;
        if suspended {
            self.suspended_memory_mib -= memory_mib;
        } else {
            self.vcpu -= vcpu;
            self.memory_mib -= memory_mib;
        }
    }
}

/// Cluster-wide scheduling settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// ClusterImpConfig `cluster` `capacity.defaultFraction`, parsed.
    pub default_fraction: Option<f64>,
    /// Count suspended VMs' memory as free (the Go project's overcommit rule).
    pub overcommit_suspended: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            default_fraction: None,
            overcommit_suspended: true,
        }
    }
}

/// The capacity the scheduler grants imp on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// vCPUs.
    pub vcpu_milli: i64,
    /// Memory in MiB.
    pub memory_mib: i64,
}

/// Parses a fraction string ("0.9"); `None` when it is not a number in [0, 1].
pub fn parse_fraction(s: &str) -> Option<f64> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|f| (0.0..=1.0).contains(f))
}

/// The capacity of `node`: explicit profile values win, else allocatable × fraction.
pub fn capacity(node: &NodeView, policy: &Policy) -> Capacity {
    let profile = node.profile.as_ref();
    let fraction = profile
        .and_then(|p| p.capacity_fraction.as_deref())
        .and_then(parse_fraction)
        .or(policy.default_fraction)
        .unwrap_or(DEFAULT_FRACTION);
    let mut cap = Capacity {
        vcpu_milli: (node.allocatable_cpu_milli as f64 * fraction).floor() as i64,
        memory_mib: (node.allocatable_memory_mib as f64 * fraction).floor() as i64,
    };
    if let Some(v) = profile.and_then(|p| p.vcpu_capacity).filter(|v| *v > 0) {
        cap.vcpu_milli = i64::from(v) * 1000;
    }
    if let Some(m) = profile.and_then(|p| p.memory_mib).filter(|m| *m > 0) {
        cap.memory_mib = m;
    }
    cap
}

/// Why a node cannot take the VM; the text is grouped and counted in the message.
fn reject_reason(
    node: &NodeView,
    usage: &NodeUsage,
    req: &Request,
    policy: &Policy,
) -> Option<String> {
    if let Some((only, why)) = &req.only_node
        && &node.name != only
    {
        return Some(format!("are not node {only} ({why})"));
    }
    if node.labels.get(LABEL_NODE_ENABLED).map(String::as_str) != Some("true") {
        return Some(format!("lack label {LABEL_NODE_ENABLED}=true"));
    }
    if !node.ready {
        return Some("are not Ready".to_owned());
    }
    if node.unschedulable {
        return Some("are cordoned".to_owned());
    }
    for (k, v) in &req.node_selector {
        if node.labels.get(k) != Some(v) {
            return Some(format!("do not match nodeSelector {k}={v}"));
        }
    }
    if let Some(why) = arch_reason(node, req.arch).or_else(|| runtime_reason(node, req.runtime)) {
        return Some(why);
    }
    for taint in &node.taints {
        let hard = matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute");
        if hard && !tolerated(taint, &req.tolerations) {
            let value = taint
                .value
                .as_deref()
                .map(|v| format!("={v}"))
                .unwrap_or_default();
            return Some(format!(
                "have untolerated taint {}{value}:{}",
                taint.key, taint.effect
            ));
        }
    }
    if let Some(max) = node.profile.as_ref().and_then(|p| p.max_imp_vms)
        && usage.vms >= i64::from(max)
    {
        return Some(format!("are at maxImpVMs {max}"));
    }
    let cap = capacity(node, policy);
    let pods = pods_note(node);
    let free_cpu = free_cpu_milli(node, &cap, usage);
    if free_cpu < req.vcpu * 1000 {
        return Some(format!(
            "have {} vCPU free of {} needed{pods}",
            fmt_milli(free_cpu.max(0)),
            req.vcpu
        ));
    }
    let free_mem = free_memory(node, &cap, usage, policy);
    if free_mem < req.memory_mib {
        return Some(format!(
            "have {}MiB free of {}MiB needed{pods}",
            free_mem.max(0),
            req.memory_mib
        ));
    }
    disk_reason(node, req)
}

/// Why `node`'s disk cannot hold the VM's: its agent reported less free space in its state
/// directory than the class's disk (a node that has not reported is not refused).
fn disk_reason(node: &NodeView, req: &Request) -> Option<String> {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    let free = node.disk_free?;
    let disk = u64::try_from(req.disk_gib).unwrap_or(0).saturating_mul(GIB);
    let snapshot = u64::try_from(req.snapshot_mib)
        .unwrap_or(0)
        .saturating_mul(MIB);
    let need = disk.saturating_add(snapshot);
    let what = if snapshot > 0 {
        " (disk and memory snapshot)"
    } else {
        ""
    };
    (free < need).then(|| {
        format!(
            "have {:.1}GiB disk free of {:.1}GiB needed{what} ({ANNOTATION_DISK})",
            free as f64 / GIB as f64,
            need as f64 / GIB as f64,
        )
    })
}

/// ", Pods request …" when Pods on the node request anything, for rejection reasons.
fn pods_note(node: &NodeView) -> String {
    if node.pods == Load::default() {
        return String::new();
    }
    format!(
        " (Pods request {} CPU, {}MiB)",
        fmt_milli(node.pods.cpu_milli),
        node.pods.memory_mib
    )
}

/// The millicores left for VMs: imp's share minus its VMs, and no more than the Pods left.
fn free_cpu_milli(node: &NodeView, cap: &Capacity, usage: &NodeUsage) -> i64 {
    let vms = usage.vcpu * 1000;
    let total = node.allocatable_cpu_milli.max(cap.vcpu_milli);
    (cap.vcpu_milli - vms).min(total - node.pods.cpu_milli - vms)
}

/// Why `node` cannot run a class of architecture `arch`: it has another one, or does not say
/// which it has (no `kubernetes.io/arch` label). `multi` fits every node.
pub fn arch_reason(node: &NodeView, arch: Arch) -> Option<String> {
    let want = arch.node_label()?;
    match node.labels.get(LABEL_NODE_ARCH).map(String::as_str) {
        Some(have) if have == want => None,
        Some(have) => Some(format!("are {have} not {want}")),
        None => Some(format!(
            "lack label {LABEL_NODE_ARCH} (architecture unknown, {want} needed)"
        )),
    }
}

/// Why `node` cannot run a class asking for `runtime`, from the runtimes its agent published.
///
/// A class naming a runtime needs a node that lists it; a node whose agent has published
/// nothing yet is refused for it (its runtimes are unknown). A class naming none runs on the
/// agent's default runtime: it fits a node listing at least one, and a node that has published
/// nothing (as before agents published runtimes), but not a node whose agent found none.
pub fn runtime_reason(node: &NodeView, runtime: Option<VmRuntime>) -> Option<String> {
    let listed = node.runtimes.as_deref();
    match (runtime, listed) {
        (Some(r), None) => Some(format!(
            "lack annotation {ANNOTATION_RUNTIMES} (runtimes unknown, {} needed)",
            r.as_str()
        )),
        (Some(r), Some(rs)) if !rs.contains(&r) => Some(format!(
            "run no {} ({ANNOTATION_RUNTIMES}={})",
            r.as_str(),
            VmRuntime::list_annotation(rs)
        )),
        (None, Some([])) => Some(format!("run no VMM ({ANNOTATION_RUNTIMES} is empty)")),
        _ => None,
    }
}

/// The MiB left for VMs: imp's share minus what its VMs reserve, and no more than the Pods
/// left.
fn free_memory(node: &NodeView, cap: &Capacity, usage: &NodeUsage, policy: &Policy) -> i64 {
    let reserved = if policy.overcommit_suspended {
        usage.memory_mib
    } else {
        usage.memory_mib + usage.suspended_memory_mib
    };
    let total = node.allocatable_memory_mib.max(cap.memory_mib);
    (cap.memory_mib - reserved).min(total - node.pods.memory_mib - reserved)
}

fn fmt_milli(m: i64) -> String {
    if m % 1000 == 0 {
        (m / 1000).to_string()
    } else {
        format!("{:.1}", m as f64 / 1000.0)
    }
}

/// Whether one of `tolerations` tolerates `taint` (Kubernetes matching rules).
pub fn tolerated(taint: &Taint, tolerations: &[Toleration]) -> bool {
    tolerations.iter().any(|t| {
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        if !effect_ok {
            return false;
        }
        let key = t.key.as_deref().unwrap_or("");
        match t.operator.as_deref().unwrap_or("Equal") {
            "Exists" => key.is_empty() || key == taint.key,
            _ => {
                key == taint.key
                    && t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
            }
        }
    })
}

/// No node can take the VM; `message` says why, per reason with a node count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoNode {
    /// e.g. "3 nodes: 2 lack label imp/enabled=true, 1 has 512MiB free of 1024MiB needed".
    pub message: String,
}

/// Chooses the node for `req`, or says why every node was rejected.
///
/// `usage` has an entry for every node that holds VMs; a missing entry means empty.
pub fn pick(
    req: &Request,
    nodes: &[NodeView],
    usage: &BTreeMap<String, NodeUsage>,
    policy: &Policy,
) -> Result<String, NoNode> {
    let empty = NodeUsage::default();
    let mut rejections: BTreeMap<String, usize> = BTreeMap::new();
    let mut best: Option<(bool, i64, i64, &str)> = None;
    for node in nodes {
        let u = usage.get(&node.name).unwrap_or(&empty);
        if let Some(reason) = reject_reason(node, u, req, policy) {
            *rejections.entry(reason).or_default() += 1;
            continue;
        }
        let preferred_against = node
            .taints
            .iter()
            .any(|t| t.effect == "PreferNoSchedule" && !tolerated(t, &req.tolerations));
        let left = free_memory(node, &capacity(node, policy), u, policy) - req.memory_mib;
        // Sort key: (prefer-no-schedule last, most memory left, fewest VMs, name).
        let key = (preferred_against, -left, u.vms, node.name.as_str());
        if best.is_none_or(|b| key < b) {
            best = Some(key);
        }
    }
    if let Some((_, _, _, name)) = best {
        return Ok(name.to_owned());
    }
    if nodes.is_empty() {
        return Err(NoNode {
            message: "0 nodes: the cluster has no Nodes".to_owned(),
        });
    }
    let parts: Vec<String> = rejections
        .iter()
        .map(|(reason, n)| format!("{n} {}", singular(reason, *n)))
        .collect();
    let total = nodes.len();
    Err(NoNode {
        message: format!(
            "{total} node{}: {}",
            if total == 1 { "" } else { "s" },
            parts.join(", ")
        ),
    })
}

/// Turns "have …"/"are …"/"lack …"/"do not …" into the singular for a count of one.
fn singular(reason: &str, n: usize) -> String {
    if n != 1 {
        return reason.to_owned();
    }
    for (plural, one) in [
        ("have ", "has "),
        ("are ", "is "),
        ("lack ", "lacks "),
        ("do not ", "does not "),
        ("run ", "runs "),
    ] {
        if let Some(rest) = reason.strip_prefix(plural) {
            return format!("{one}{rest}");
        }
    }
    reason.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cpu: i64, mem: i64) -> NodeView {
        NodeView {
            name: name.into(),
            labels: BTreeMap::from([(LABEL_NODE_ENABLED.to_owned(), "true".to_owned())]),
            ready: true,
            allocatable_cpu_milli: cpu * 1000,
            allocatable_memory_mib: mem,
            ..Default::default()
        }
    }

    fn req(vcpu: i64, mem: i64) -> Request {
        Request {
            only_node: None,
            vcpu,
            memory_mib: mem,
            ..Default::default()
        }
    }

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(str::to_owned),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn tol(key: Option<&str>, op: &str, value: Option<&str>, effect: Option<&str>) -> Toleration {
        Toleration {
            key: key.map(str::to_owned),
            operator: Some(op.to_owned()),
            value: value.map(str::to_owned),
            effect: effect.map(str::to_owned),
            toleration_seconds: None,
        }
    }

    fn no_usage() -> BTreeMap<String, NodeUsage> {
        BTreeMap::new()
    }

    #[test]
    fn message_counts_each_rejection_reason() {
        let mut a = node("a", 8, 10_000);
        a.labels.clear();
        let mut b = node("b", 8, 10_000);
        b.labels.insert(LABEL_NODE_ENABLED.into(), "false".into());
        // c: 1000 MiB allocatable × 0.9 = 900, 388 used → 512 free
        let c = node("c", 8, 1000);
        let usage = BTreeMap::from([(
            "c".to_owned(),
            NodeUsage {
                vcpu: 1,
                memory_mib: 388,
                suspended_memory_mib: 0,
                vms: 1,
            },
        )]);
        let err = pick(&req(1, 1024), &[a, b, c], &usage, &Policy::default()).unwrap_err();
        assert_eq!(
            err.message,
            "3 nodes: 1 has 512MiB free of 1024MiB needed, 2 lack label imp/enabled=true"
        );
    }

    #[test]
    fn pods_bound_to_a_node_take_their_requests_from_what_vms_may_use() {
        let policy = Policy::default();
        // 8 CPU, 10000 MiB allocatable: imp's share is 7.2 CPU / 9000 MiB.
        let mut busy = node("busy", 8, 10_000);
        busy.pods = Load {
            cpu_milli: 1500,
            memory_mib: 6000,
        };
        let vms = BTreeMap::from([(
            "busy".to_owned(),
            NodeUsage {
                vcpu: 2,
                memory_mib: 2000,
                suspended_memory_mib: 0,
                vms: 1,
            },
        )]);
        // 10000 − 6000 (Pods) − 2000 (VMs) = 2000 MiB, though imp's share alone has 7000.
        let err = pick(&req(1, 2048), std::slice::from_ref(&busy), &vms, &policy).unwrap_err();
        assert_eq!(
            err.message,
            "1 node: 1 has 2000MiB free of 2048MiB needed (Pods request 1.5 CPU, 6000MiB)"
        );
        assert_eq!(
            pick(&req(1, 2000), std::slice::from_ref(&busy), &vms, &policy),
            Ok("busy".to_owned())
        );
        // 8 − 1.5 − 2 = 4.5 CPU left for VMs.
        let err = pick(&req(5, 512), std::slice::from_ref(&busy), &vms, &policy).unwrap_err();
        assert!(
            err.message.contains("has 4.5 vCPU free of 5"),
            "{}",
            err.message
        );
        // Pods that leave imp's share untouched change nothing.
        let mut light = node("light", 8, 10_000);
        light.pods = Load {
            cpu_milli: 100,
            memory_mib: 500,
        };
        assert_eq!(
            pick(&req(7, 9000), &[light], &no_usage(), &policy),
            Ok("light".to_owned())
        );
        // The emptier node wins the spread once the Pods are counted.
        let mut a = node("a", 8, 10_000);
        a.pods.memory_mib = 4000;
        let b = node("b", 8, 8000);
        assert_eq!(
            pick(&req(1, 512), &[a, b], &no_usage(), &policy),
            Ok("b".to_owned())
        );
    }

    #[test]
    fn a_node_whose_agent_reports_too_little_disk_is_refused() {
        let mut full = node("full", 8, 8192);
        full.disk_free = Some(3 << 29); // 1.5 GiB
        let unknown = node("unknown", 8, 4096);
        let mut r = req(1, 512);
        r.disk_gib = 2;
        let policy = Policy::default();
        // The node with more memory wins the spread, unless its disk cannot hold the VM.
        assert_eq!(
            pick(&r, &[full.clone(), unknown], &no_usage(), &policy),
            Ok("unknown".to_owned())
        );
        let err = pick(&r, std::slice::from_ref(&full), &no_usage(), &policy).unwrap_err();
        assert_eq!(
            err.message,
            "1 node: 1 has 1.5GiB disk free of 2.0GiB needed (imp.dev/disk)"
        );
        // A VM to be suspended needs room for its memory too.
        let mut sleeper = req(1, 1024);
        sleeper.disk_gib = 1;
        sleeper.snapshot_mib = 1024;
        let err = pick(&sleeper, std::slice::from_ref(&full), &no_usage(), &policy).unwrap_err();
        assert!(
            err.message
                .contains("1.5GiB disk free of 2.0GiB needed (disk and memory snapshot)"),
            "{}",
            err.message
        );
        r.disk_gib = 1;
        assert_eq!(
            pick(&r, &[full], &no_usage(), &policy),
            Ok("full".to_owned())
        );
        let mut n = Node::default();
        n.metadata.annotations = Some(BTreeMap::from([(
            ANNOTATION_DISK.to_owned(),
            "free=1073741824,total=4294967296".to_owned(),
        )]));
        assert_eq!(NodeView::from_node(&n, None).disk_free, Some(1 << 30));
        n.metadata.annotations = Some(BTreeMap::from([(
            ANNOTATION_DISK.to_owned(),
            "lots".to_owned(),
        )]));
        assert_eq!(
            NodeView::from_node(&n, None).disk_free,
            None,
            "garbage is no report"
        );
    }

    #[test]
    fn an_explicit_capacity_above_allocatable_is_still_shared_with_pods() {
        let mut n = node("n", 4, 4096);
        n.profile = Some(ClusterImpNodeProfileSpec {
            memory_mib: Some(8192),
            ..Default::default()
        });
        n.pods.memory_mib = 3000;
        let err = pick(
            &req(1, 6000),
            std::slice::from_ref(&n),
            &no_usage(),
            &Policy::default(),
        )
        .unwrap_err();
        assert!(err.message.contains("has 5192MiB free"), "{}", err.message);
    }

    #[test]
    fn every_rejection_reason_is_named() {
        let policy = Policy::default();
        let mut not_ready = node("n1", 8, 8192);
        not_ready.ready = false;
        let mut cordoned = node("n2", 8, 8192);
        cordoned.unschedulable = true;
        let mut tainted = node("n3", 8, 8192);
        tainted.taints = vec![taint("gpu", Some("yes"), "NoSchedule")];
        let mut capped = node("n4", 8, 8192);
        capped.profile = Some(ClusterImpNodeProfileSpec {
            max_imp_vms: Some(0),
            ..Default::default()
        });
        let small_cpu = node("n5", 1, 8192);
        let mut r = req(2, 256);
        r.node_selector.insert("zone".into(), "a".into());
        let mut wrong_zone = node("n6", 8, 8192);
        wrong_zone.labels.insert("zone".into(), "b".into());
        let ok_zone = |mut n: NodeView| {
            n.labels.insert("zone".into(), "a".into());
            n
        };
        let nodes = vec![
            ok_zone(not_ready),
            ok_zone(cordoned),
            ok_zone(tainted),
            ok_zone(capped),
            ok_zone(small_cpu),
            wrong_zone,
        ];
        let m = pick(&r, &nodes, &no_usage(), &policy).unwrap_err().message;
        assert!(m.starts_with("6 nodes: "), "{m}");
        for part in [
            "1 is not Ready",
            "1 is cordoned",
            "1 has untolerated taint gpu=yes:NoSchedule",
            "1 is at maxImpVMs 0",
            "1 has 0.9 vCPU free of 2 needed",
            "1 does not match nodeSelector zone=a",
        ] {
            assert!(m.contains(part), "{part:?} missing from {m}");
        }
        assert_eq!(
            pick(&r, &[], &no_usage(), &policy).unwrap_err().message,
            "0 nodes: the cluster has no Nodes"
        );
    }

    #[test]
    fn a_vm_bound_to_one_node_goes_there_or_nowhere() {
        let policy = Policy::default();
        let mut r = req(1, 256);
        r.only_node = Some(("n2".into(), "its snapshot's files are there".into()));
        let nodes = vec![node("n1", 8, 8192), node("n2", 8, 8192)];
        assert_eq!(pick(&r, &nodes, &no_usage(), &policy).unwrap(), "n2");
        let m = pick(&r, &nodes[..1], &no_usage(), &policy)
            .unwrap_err()
            .message;
        assert!(
            m.contains("is not node n2 (its snapshot's files are there)"),
            "{m}"
        );
    }

    #[test]
    fn taint_and_toleration_matching() {
        let t = taint("dedicated", Some("imp"), "NoSchedule");
        assert!(!tolerated(&t, &[]));
        assert!(tolerated(
            &t,
            &[tol(
                Some("dedicated"),
                "Equal",
                Some("imp"),
                Some("NoSchedule")
            )]
        ));
        assert!(!tolerated(
            &t,
            &[tol(
                Some("dedicated"),
                "Equal",
                Some("other"),
                Some("NoSchedule")
            )]
        ));
        assert!(tolerated(
            &t,
            &[tol(Some("dedicated"), "Exists", None, None)]
        ));
        assert!(
            tolerated(&t, &[tol(None, "Exists", None, None)]),
            "empty key + Exists matches all"
        );
        assert!(
            !tolerated(
                &t,
                &[tol(Some("dedicated"), "Exists", None, Some("NoExecute"))]
            ),
            "effect must match when set"
        );
        assert!(tolerated(
            &t,
            &[tol(Some("dedicated"), "Equal", Some("imp"), Some(""))]
        ));

        // NoExecute blocks too; PreferNoSchedule only ranks lower.
        let mut a = node("a", 8, 8192);
        a.taints = vec![taint("x", None, "NoExecute")];
        let mut b = node("b", 8, 8192);
        b.taints = vec![taint("y", None, "PreferNoSchedule")];
        let c = node("c", 8, 4096);
        let policy = Policy::default();
        assert_eq!(
            pick(
                &req(1, 256),
                &[a.clone(), b.clone(), c],
                &no_usage(),
                &policy
            ),
            Ok("c".into())
        );
        assert_eq!(
            pick(&req(1, 256), &[a.clone(), b.clone()], &no_usage(), &policy),
            Ok("b".into())
        );
        let mut tolerant = req(1, 256);
        tolerant.tolerations = vec![tol(Some("x"), "Exists", None, Some("NoExecute"))];
        // a and b have equal room; b is ranked lower for its PreferNoSchedule taint.
        assert_eq!(
            pick(&tolerant, &[a, b], &no_usage(), &policy),
            Ok("a".into())
        );
    }

    #[test]
    fn fraction_precedence_profile_over_cluster_over_default() {
        let mut n = node("a", 10, 10_000);
        let mut policy = Policy::default();
        assert_eq!(capacity(&n, &policy).memory_mib, 9000);
        assert_eq!(capacity(&n, &policy).vcpu_milli, 9000);
        policy.default_fraction = Some(0.5);
        assert_eq!(capacity(&n, &policy).memory_mib, 5000);
        n.profile = Some(ClusterImpNodeProfileSpec {
            capacity_fraction: Some("0.25".into()),
            ..Default::default()
        });
        assert_eq!(capacity(&n, &policy).memory_mib, 2500);
        // an unparseable profile fraction falls back to the cluster's
        n.profile = Some(ClusterImpNodeProfileSpec {
            capacity_fraction: Some("lots".into()),
            ..Default::default()
        });
        assert_eq!(capacity(&n, &policy).memory_mib, 5000);
        // explicit values win over any fraction, each on its own
        n.profile = Some(ClusterImpNodeProfileSpec {
            capacity_fraction: Some("0.25".into()),
            vcpu_capacity: Some(3),
            memory_mib: None,
            ..Default::default()
        });
        assert_eq!(
            capacity(&n, &policy),
            Capacity {
                vcpu_milli: 3000,
                memory_mib: 2500
            }
        );
        n.profile = Some(ClusterImpNodeProfileSpec {
            vcpu_capacity: Some(3),
            memory_mib: Some(777),
            ..Default::default()
        });
        assert_eq!(capacity(&n, &policy).memory_mib, 777);
        assert_eq!(parse_fraction("1.5"), None);
        assert_eq!(parse_fraction("0.9"), Some(0.9));
    }

    #[test]
    fn max_imp_vms_counts_suspended_vms() {
        let mut n = node("a", 64, 65536);
        n.profile = Some(ClusterImpNodeProfileSpec {
            max_imp_vms: Some(2),
            ..Default::default()
        });
        let mut u = NodeUsage::default();
        u.add(1, 256, false);
        let usage = BTreeMap::from([("a".to_owned(), u)]);
        assert!(
            pick(
                &req(1, 256),
                std::slice::from_ref(&n),
                &usage,
                &Policy::default()
            )
            .is_ok()
        );
        u.add(1, 256, true);
        let usage = BTreeMap::from([("a".to_owned(), u)]);
        let m = pick(&req(1, 256), &[n], &usage, &Policy::default())
            .unwrap_err()
            .message;
        assert_eq!(m, "1 node: 1 is at maxImpVMs 2");
    }

    #[test]
    fn suspended_memory_is_free_only_with_overcommit() {
        // 2048 × 0.9 = 1843 MiB capacity; a suspended 1024 MiB VM
        let n = node("a", 8, 2048);
        let mut u = NodeUsage::default();
        u.add(4, 1024, true);
        assert_eq!(u.vcpu, 0, "suspended vCPUs are free");
        let usage = BTreeMap::from([("a".to_owned(), u)]);
        let over = Policy {
            overcommit_suspended: true,
            ..Default::default()
        };
        assert_eq!(
            pick(&req(1, 1024), std::slice::from_ref(&n), &usage, &over),
            Ok("a".into())
        );
        let strict = Policy {
            overcommit_suspended: false,
            ..Default::default()
        };
        assert_eq!(
            pick(&req(1, 1024), &[n], &usage, &strict)
                .unwrap_err()
                .message,
            "1 node: 1 has 819MiB free of 1024MiB needed"
        );
    }

    #[test]
    fn usage_is_per_vm_size_not_the_new_vms_size() {
        // 4 vCPU × 0.9 = 3.6; one 2-vCPU VM there leaves 1.6: a 1-vCPU VM fits, a 2-vCPU one not.
        let n = node("a", 4, 65536);
        let mut u = NodeUsage::default();
        u.add(2, 512, false);
        let usage = BTreeMap::from([("a".to_owned(), u)]);
        assert!(
            pick(
                &req(1, 128),
                std::slice::from_ref(&n),
                &usage,
                &Policy::default()
            )
            .is_ok()
        );
        assert_eq!(
            pick(&req(2, 128), &[n], &usage, &Policy::default())
                .unwrap_err()
                .message,
            "1 node: 1 has 1.6 vCPU free of 2 needed"
        );
    }

    #[test]
    fn spreading_with_deterministic_tie_break() {
        let nodes = [node("c", 8, 8192), node("b", 8, 8192), node("a", 8, 8192)];
        let policy = Policy::default();
        assert_eq!(
            pick(&req(1, 256), &nodes, &no_usage(), &policy),
            Ok("a".into())
        );
        let mut u = NodeUsage::default();
        u.add(1, 256, false);
        let usage = BTreeMap::from([("a".to_owned(), u)]);
        assert_eq!(pick(&req(1, 256), &nodes, &usage, &policy), Ok("b".into()));
        // equal free memory, fewer VMs wins over the name
        let mut one_big = NodeUsage::default();
        one_big.add(1, 512, false);
        let mut two_small = NodeUsage::default();
        two_small.add(1, 256, false);
        two_small.add(1, 256, false);
        let usage = BTreeMap::from([
            ("a".to_owned(), two_small),
            ("b".to_owned(), one_big),
            ("c".to_owned(), two_small),
        ]);
        assert_eq!(pick(&req(1, 256), &nodes, &usage, &policy), Ok("b".into()));
        // same answer whatever order the nodes come in
        let mut rev = nodes.to_vec();
        rev.reverse();
        assert_eq!(pick(&req(1, 256), &rev, &usage, &policy), Ok("b".into()));
    }

    fn with_arch(mut n: NodeView, arch: &str) -> NodeView {
        n.labels.insert(LABEL_NODE_ARCH.into(), arch.into());
        n
    }

    fn running(mut n: NodeView, runtimes: &[VmRuntime]) -> NodeView {
        n.runtimes = Some(runtimes.to_vec());
        n
    }

    #[test]
    fn a_class_arch_needs_a_node_of_that_arch() {
        let policy = Policy::default();
        let mut r = req(1, 256);
        r.arch = Arch::Amd64;
        let arm = with_arch(node("a-arm", 8, 8192), "arm64");
        let unknown = node("b-unknown", 8, 8192);
        let amd = with_arch(node("c-amd", 8, 1024), "amd64");
        let nodes = [arm.clone(), unknown.clone(), amd];
        assert_eq!(pick(&r, &nodes, &no_usage(), &policy), Ok("c-amd".into()));
        let m = pick(&r, &nodes[..2], &no_usage(), &policy)
            .unwrap_err()
            .message;
        assert_eq!(
            m,
            "2 nodes: 1 is arm64 not amd64, \
             1 lacks label kubernetes.io/arch (architecture unknown, amd64 needed)"
        );
        r.arch = Arch::Arm64;
        assert_eq!(pick(&r, &nodes, &no_usage(), &policy), Ok("a-arm".into()));
        // multi fits any node, one that does not say its arch included
        r.arch = Arch::Multi;
        assert_eq!(
            pick(&r, std::slice::from_ref(&unknown), &no_usage(), &policy),
            Ok("b-unknown".into())
        );
    }

    #[test]
    fn a_class_runtime_needs_a_node_whose_agent_runs_it() {
        use VmRuntime::{Firecracker, Qemu};
        let policy = Policy::default();
        let mut r = req(1, 256);
        r.runtime = Some(Firecracker);
        let q1 = running(node("q1", 8, 8192), &[Qemu]);
        let q2 = running(node("q2", 8, 8192), &[Qemu]);
        let silent = node("silent", 8, 8192);
        let fc = running(node("z-fc", 8, 1024), &[Firecracker, Qemu]);
        let m = pick(
            &r,
            &[q1.clone(), q2.clone(), silent.clone()],
            &no_usage(),
            &policy,
        )
        .unwrap_err()
        .message;
        assert_eq!(
            m,
            "3 nodes: 1 lacks annotation imp.dev/runtimes (runtimes unknown, firecracker needed), \
             2 run no firecracker (imp.dev/runtimes=qemu)"
        );
        let all = [q1.clone(), q2, silent.clone(), fc];
        assert_eq!(pick(&r, &all, &no_usage(), &policy), Ok("z-fc".into()));
        r.runtime = Some(Qemu);
        assert_eq!(pick(&r, &all, &no_usage(), &policy), Ok("q1".into()));

        // No runtime: the agent's default; any node that runs one, or has not said.
        r.runtime = None;
        let none = running(node("a-none", 8, 65536), &[]);
        assert_eq!(
            pick(&r, &[none.clone(), q1], &no_usage(), &policy),
            Ok("q1".into())
        );
        assert_eq!(
            pick(&r, &[none.clone(), silent], &no_usage(), &policy),
            Ok("silent".into())
        );
        assert_eq!(
            pick(&r, &[none], &no_usage(), &policy).unwrap_err().message,
            "1 node: 1 runs no VMM (imp.dev/runtimes is empty)"
        );
    }

    #[test]
    fn arch_and_runtime_mismatches_are_counted_together() {
        let mut r = req(1, 256);
        r.arch = Arch::Amd64;
        r.runtime = Some(VmRuntime::Firecracker);
        let nodes = [
            running(with_arch(node("a", 8, 8192), "amd64"), &[VmRuntime::Qemu]),
            running(with_arch(node("b", 8, 8192), "amd64"), &[VmRuntime::Qemu]),
            running(
                with_arch(node("c", 8, 8192), "arm64"),
                &[VmRuntime::Firecracker],
            ),
        ];
        let m = pick(&r, &nodes, &no_usage(), &Policy::default())
            .unwrap_err()
            .message;
        assert_eq!(
            m,
            "3 nodes: 1 is arm64 not amd64, 2 run no firecracker (imp.dev/runtimes=qemu)"
        );
    }

    #[test]
    fn node_view_reads_the_node_object() {
        let n: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "w1", "labels": {"imp/enabled": "true"},
                         "annotations": {"imp.dev/runtimes": "qemu"}},
            "spec": {"unschedulable": true, "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {
                "allocatable": {"cpu": "3500m", "memory": "4Gi"},
                "conditions": [{"type": "Ready", "status": "True"}]
            }
        }))
        .unwrap();
        let v = NodeView::from_node(&n, None);
        assert_eq!(v.name, "w1");
        assert!(v.ready && v.unschedulable);
        assert_eq!(v.allocatable_cpu_milli, 3500);
        assert_eq!(v.allocatable_memory_mib, 4096);
        assert_eq!(v.taints.len(), 1);
        assert_eq!(v.runtimes, Some(vec![VmRuntime::Qemu]));
        let bare: Node =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "w2"}})).unwrap();
        assert_eq!(NodeView::from_node(&bare, None).runtimes, None);
    }
}
