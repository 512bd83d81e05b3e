//! Capacity shared with Pods: what the Pods on a node request, and the reservation Pod that
//! makes each VM's share visible to Kubernetes.
//!
//! VMs run outside Pods, so neither kube-scheduler nor the kubelet knows about them. Two things
//! fix that, both pure here (the controller's `reserve` room applies them):
//! - **Pods count against VMs**: the scheduler subtracts the requests of the Pods bound to a
//!   node ([`node_loads`], with Kubernetes' own rule for init and sidecar containers and Pod
//!   overhead) before it places a VM there (see [`crate::placement::schedule`]).
//! - **VMs count against Pods**: every VM that holds cpu or memory on a node has one
//!   *reservation Pod* in its namespace ([`pod`]), bound to the node with `spec.nodeName` (no
//!   scheduler involved), requesting (and limited to) exactly the vCPU and memory the VM holds
//!   there, running only a pause container. kube-scheduler then places no Pod onto the VM's
//!   share, the kubelet admits none onto it, and a namespace's ResourceQuota (`requests.cpu`,
//!   `requests.memory`, `limits.*`, `pods`) counts its VMs as it counts its Pods. A suspended VM
//!   whose memory is overcommitted ([`crate::placement::schedule::Policy::overcommit_suspended`]) holds
//!   nothing and has no reservation; one whose memory stays reserved keeps a memory-only one.
//!
//! A reservation Pod carries label [`LABEL_RESERVATION`] and is controlled by its ImpVM (owner
//! reference, so it goes with the VM); [`plan`] compares what should exist with what does and
//! says what to create and delete. Reservation Pods are left out of the Pod load, since the
//! VM is already counted by the ledger.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    Capabilities, Container, Pod, PodSecurityContext, PodSpec, ResourceRequirements,
    SeccompProfile, SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::placement::quantity::{parse_bytes, parse_cpu_milli};

/// Label on every reservation Pod (value `"true"`).
pub const LABEL_RESERVATION: &str = "imp.dev/reservation";
/// Annotation on a reservation Pod naming the VM it stands for.
pub const ANNOTATION_RESERVATION_FOR: &str = "imp.dev/reservation-for";
/// The image a reservation Pod runs unless the operator is told otherwise.
pub const DEFAULT_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// Longest Pod name Kubernetes takes.
const MAX_NAME: usize = 253;

/// cpu and memory requested on one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// millicores.
    pub cpu_milli: i64,
    /// MiB (bytes rounded up).
    pub memory_mib: i64,
}

impl Load {
    fn add(self, o: Load) -> Load {
        Load {
            cpu_milli: self.cpu_milli + o.cpu_milli,
            memory_mib: self.memory_mib + o.memory_mib,
        }
    }

    fn max(self, o: Load) -> Load {
        Load {
            cpu_milli: self.cpu_milli.max(o.cpu_milli),
            memory_mib: self.memory_mib.max(o.memory_mib),
        }
    }
}

fn load_of(resources: Option<&BTreeMap<String, Quantity>>) -> Load {
    let get = |k: &str| resources.and_then(|r| r.get(k)).map(|q| q.0.as_str());
    Load {
        cpu_milli: get("cpu").and_then(parse_cpu_milli).unwrap_or(0),
        memory_mib: get("memory")
            .and_then(parse_bytes)
            .map_or(0, |b| b.div_ceil(1024 * 1024) as i64),
    }
}

fn requests_of(c: &Container) -> Load {
    load_of(c.resources.as_ref().and_then(|r| r.requests.as_ref()))
}

/// What `pod` requests, as kube-scheduler counts it: the larger of (its containers plus its
/// sidecars, i.e. init containers with `restartPolicy: Always`) and each ordinary init
/// container with the sidecars started before it; plus its `overhead`.
pub fn pod_requests(pod: &Pod) -> Load {
    let Some(spec) = &pod.spec else {
        return Load::default();
    };
    let mut sidecars = Load::default();
    let mut init_peak = Load::default();
    for c in spec.init_containers.iter().flatten() {
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars = sidecars.add(requests_of(c));
        } else {
            init_peak = init_peak.max(sidecars.add(requests_of(c)));
        }
    }
    let running = spec
        .containers
        .iter()
        .map(requests_of)
        .fold(sidecars, Load::add);
    running.max(init_peak).add(load_of(spec.overhead.as_ref()))
}

/// Whether `pod` is an imp reservation (its VM is counted by the ledger, not as a Pod).
pub fn is_reservation(pod: &Pod) -> bool {
    pod.metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get(LABEL_RESERVATION).is_some_and(|v| v == "true"))
        && owner_vm(pod).is_some()
}

/// The uid of the ImpVM that controls `pod`, if one does.
fn owner_vm(pod: &Pod) -> Option<&str> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find_map(|o| {
            (o.kind == "ImpVM"
                && o.api_version.starts_with("imp.dev/")
                && o.controller == Some(true))
            .then_some(o.uid.as_str())
        })
}

/// Whether `pod` holds resources on its node: bound, and not finished.
fn holds_node(pod: &Pod) -> Option<&str> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    pod.spec.as_ref()?.node_name.as_deref()
}

/// The requests of the Pods bound to each node, reservation Pods and finished Pods left out.
pub fn node_loads<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> BTreeMap<String, Load> {
    let mut out: BTreeMap<String, Load> = BTreeMap::new();
    for pod in pods {
        if is_reservation(pod) {
            continue;
        }
        if let Some(node) = holds_node(pod) {
            let l = out.entry(node.to_owned()).or_default();
            *l = l.add(pod_requests(pod));
        }
    }
    out
}

/// The name of the reservation Pod of VM `vm`: `imp-vm-<vm>`, shortened with a hash of the
/// whole name when that would be too long for a Pod.
pub fn pod_name(vm: &str) -> String {
    let name = format!("imp-vm-{vm}");
    if name.len() <= MAX_NAME {
        return name;
    }
    // FNV-1a: short, stable, no dependency; only needs to tell long names apart.
    let hash = vm.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let keep = MAX_NAME - "imp-vm-".len() - 17;
    let mut cut = keep;
    while !vm.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "imp-vm-{}-{hash:016x}",
        vm[..cut].trim_end_matches(['-', '.'])
    )
}

/// One VM's share of one node, as its reservation Pod states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The VM's namespace (and the Pod's).
    pub namespace: String,
    /// The VM's name.
    pub vm: String,
    /// The VM's uid (the Pod's owner).
    pub vm_uid: String,
    /// The node.
    pub node: String,
    /// What the VM holds there.
    pub load: Load,
}

impl Reservation {
    /// The share of a VM that holds `vcpu` and `memory_mib` on `node` (suspended: memory only
    /// when it stays reserved); `None` when it holds nothing.
    pub fn of(
        namespace: &str,
        vm: &str,
        vm_uid: &str,
        node: &str,
        (vcpu, memory_mib): (i64, i64),
        suspended: bool,
        overcommit_suspended: bool,
    ) -> Option<Self> {
        let load = match (suspended, overcommit_suspended) {
            (false, _) => Load {
                cpu_milli: vcpu * 1000,
                memory_mib,
            },
            (true, false) => Load {
                cpu_milli: 0,
                memory_mib,
            },
            (true, true) => return None,
        };
        (load != Load::default()).then(|| Self {
            namespace: namespace.to_owned(),
            vm: vm.to_owned(),
            vm_uid: vm_uid.to_owned(),
            node: node.to_owned(),
            load,
        })
    }
}

/// How reservation Pods are made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSettings {
    /// The image of its one container (a pause image).
    pub image: String,
    /// Its PriorityClass (the chart ships one high enough that no Pod preempts it).
    pub priority_class: Option<String>,
}

impl Default for PodSettings {
    fn default() -> Self {
        Self {
            image: DEFAULT_IMAGE.to_owned(),
            priority_class: None,
        }
    }
}

fn quantities(load: Load) -> BTreeMap<String, Quantity> {
    let mut q = BTreeMap::new();
    if load.cpu_milli > 0 {
        q.insert("cpu".to_owned(), Quantity(format!("{}m", load.cpu_milli)));
    }
    if load.memory_mib > 0 {
        q.insert(
            "memory".to_owned(),
            Quantity(format!("{}Mi", load.memory_mib)),
        );
    }
    q
}

/// The reservation Pod of `r`: bound to its node, requesting and limited to the VM's share
/// (so quotas on limits count it too), tolerating every taint (the VM's own eviction is imp's
/// decision), and passing the `restricted` Pod Security Standard so any namespace admits it.
pub fn pod(r: &Reservation, settings: &PodSettings) -> Pod {
    let resources = quantities(r.load);
    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&r.vm)),
            namespace: Some(r.namespace.clone()),
            labels: Some(BTreeMap::from([
                (LABEL_RESERVATION.to_owned(), "true".to_owned()),
                (
                    "app.kubernetes.io/managed-by".to_owned(),
                    "imp-operator".to_owned(),
                ),
            ])),
            annotations: Some(BTreeMap::from([(
                ANNOTATION_RESERVATION_FOR.to_owned(),
                r.vm.clone(),
            )])),
            owner_references: Some(vec![OwnerReference {
                api_version: "imp.dev/v1alpha1".to_owned(),
                kind: "ImpVM".to_owned(),
                name: r.vm.clone(),
                uid: r.vm_uid.clone(),
                controller: Some(true),
                block_owner_deletion: Some(false),
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(r.node.clone()),
            priority_class_name: settings.priority_class.clone(),
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".to_owned()),
                ..Toleration::default()
            }]),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(0),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(65535),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: "reservation".to_owned(),
                image: Some(settings.image.clone()),
                resources: Some(ResourceRequirements {
                    requests: Some(resources.clone()),
                    limits: Some(resources),
                    ..ResourceRequirements::default()
                }),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    read_only_root_filesystem: Some(true),
                    capabilities: Some(Capabilities {
                        drop: Some(vec!["ALL".to_owned()]),
                        ..Capabilities::default()
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// A reservation Pod that exists, as [`plan`] compares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Existing {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// The uid of its ImpVM.
    pub vm_uid: String,
    /// Its node.
    pub node: Option<String>,
    /// What its container requests.
    pub load: Load,
    /// Its phase is `Failed` (a kubelet refused it, e.g. `OutOfmemory`).
    pub failed: bool,
    /// It is being deleted already.
    pub deleting: bool,
}

impl Existing {
    /// The reservation `pod` is, or `None` when it is not one.
    pub fn of(pod: &Pod) -> Option<Self> {
        let vm_uid = owner_vm(pod)?.to_owned();
        is_reservation(pod).then(|| Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            vm_uid,
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            load: pod
                .spec
                .as_ref()
                .map(|s| {
                    s.containers
                        .iter()
                        .map(requests_of)
                        .fold(Load::default(), Load::add)
                })
                .unwrap_or_default(),
            failed: pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed"),
            deleting: pod.metadata.deletion_timestamp.is_some(),
        })
    }

    /// Whether this Pod states share `r` (its node and size; whose it is, the caller knows).
    fn fits(&self, r: &Reservation) -> bool {
        self.node.as_deref() == Some(r.node.as_str()) && self.load == r.load && !self.failed
    }
}

/// The merge patch that hands reservation Pod `pod` to VM `to` (a warm pool's claimant taking
/// its member's reservation): its one controlling owner and `imp.dev/reservation-for`, under
/// the Pod's resourceVersion. Nothing else of the Pod changes (the operator's admission policy
/// admits no other Pod update).
pub fn handed_to(pod: &Pod, to: &imp_api::vm::ImpVM) -> serde_json::Value {
    use kube::Resource as _;
    let owner = to.controller_owner_ref(&());
    serde_json::json!({
        "metadata": {
            "resourceVersion": pod.metadata.resource_version,
            "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
            "annotations": {ANNOTATION_RESERVATION_FOR: to.metadata.name},
        }
    })
}

/// One change [`plan`] asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Create the reservation Pod of this share.
    Create(Reservation),
    /// Delete this Pod (namespace, name): its VM holds nothing, or something else now.
    Delete(String, String),
}

/// What to change so that exactly the `wanted` reservations exist, a Pod matched to its VM by
/// its owner's uid (not its name: a warm pool's claim hands its member's Pod to the claimant,
/// name and all). A Pod that differs from its share (another node, another size, refused by
/// its kubelet) is deleted first; its replacement is created once it is gone (Pod specs cannot
/// change in place).
///
/// `claimed` maps each warm pool member taken by a claim to its claimant (uids): the member's
/// Pod is the claimant's, whether or not the hand-over has reached the Pod yet (or this
/// process's cache of it), so neither gets a second one; and while the claimant holds no share
/// yet, the Pod is left alone.
pub fn plan(
    wanted: &[Reservation],
    existing: &[Existing],
    claimed: &BTreeMap<String, String>,
) -> Vec<Op> {
    let mut ops = Vec::new();
    let by_uid: BTreeMap<&str, &Reservation> =
        wanted.iter().map(|r| (r.vm_uid.as_str(), r)).collect();
    let mut present: BTreeSet<&str> = BTreeSet::new();
    let mut kept: BTreeSet<&str> = BTreeSet::new();
    for e in existing {
        let holder = claimed.get(&e.vm_uid).unwrap_or(&e.vm_uid).as_str();
        present.insert(holder);
        if e.deleting {
            continue;
        }
        let share = by_uid.get(holder);
        let in_claim = claimed.contains_key(&e.vm_uid) || claimed.values().any(|c| c == holder);
        if in_claim && share.is_none() {
            continue;
        }
        let fits = share.is_some_and(|r| e.fits(r));
        // One Pod per VM: a second that fits too is deleted.
        if fits && kept.insert(holder) {
            continue;
        }
        ops.push(Op::Delete(e.namespace.clone(), e.name.clone()));
    }
    for (uid, r) in &by_uid {
        if !present.contains(uid) && !claimed.contains_key(*uid) {
            ops.push(Op::Create((*r).clone()));
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn pod_json(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn share(vm: &str, node: &str, cpu: i64, mem: i64) -> Reservation {
        Reservation::of(
            "ns",
            vm,
            &format!("uid-{vm}"),
            node,
            (cpu, mem),
            false,
            true,
        )
        .unwrap()
    }

    #[test]
    fn a_pods_requests_follow_kubernetes_rule_for_init_containers_sidecars_and_overhead() {
        let p = pod_json(json!({
            "metadata": {"name": "p"},
            "spec": {
                "nodeName": "n1",
                "overhead": {"cpu": "100m", "memory": "64Mi"},
                "initContainers": [
                    {"name": "side", "restartPolicy": "Always",
                     "resources": {"requests": {"cpu": "200m", "memory": "100Mi"}}},
                    {"name": "big-init", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}
                ],
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}},
                    {"name": "b", "resources": {"requests": {"cpu": "0.5", "memory": "268435456"}}},
                    {"name": "none"}
                ]
            }
        }));
        // Running: 200m + 500m + 500m = 1200m; init peak: 200m + 2000m = 2200m. Memory:
        // running 100 + 256 + 256 = 612Mi; init 100 + 1024 = 1124Mi. Plus overhead.
        assert_eq!(
            pod_requests(&p),
            Load {
                cpu_milli: 2300,
                memory_mib: 1188
            }
        );
    }

    #[test]
    fn node_loads_count_bound_live_pods_but_not_reservations_or_finished_ones() {
        let req = |name: &str, node: Option<&str>, phase: &str| {
            pod_json(json!({
                "metadata": {"name": name},
                "spec": {"nodeName": node, "containers": [
                    {"name": "c", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]},
                "status": {"phase": phase}
            }))
        };
        let reservation = pod(&share("vm", "n1", 2, 2048), &PodSettings::default());
        let pods = [
            req("a", Some("n1"), "Running"),
            req("b", Some("n1"), "Pending"),
            req("c", Some("n2"), "Running"),
            req("done", Some("n1"), "Succeeded"),
            req("failed", Some("n1"), "Failed"),
            req("unbound", None, "Pending"),
            reservation,
        ];
        let loads = node_loads(&pods);
        assert_eq!(
            loads,
            BTreeMap::from([
                (
                    "n1".to_owned(),
                    Load {
                        cpu_milli: 2000,
                        memory_mib: 2048
                    }
                ),
                (
                    "n2".to_owned(),
                    Load {
                        cpu_milli: 1000,
                        memory_mib: 1024
                    }
                ),
            ])
        );
    }

    #[test]
    fn a_label_alone_does_not_make_a_pod_a_reservation() {
        let p = pod_json(json!({
            "metadata": {"name": "sneaky", "labels": {LABEL_RESERVATION: "true"}},
            "spec": {"nodeName": "n1", "containers": [
                {"name": "c", "resources": {"requests": {"memory": "1Gi"}}}]}
        }));
        assert!(!is_reservation(&p));
        assert_eq!(node_loads([&p])["n1"].memory_mib, 1024);
        assert!(Existing::of(&p).is_none());
    }

    #[test]
    fn a_reservation_pod_is_bound_requests_its_share_and_is_owned_by_its_vm() {
        let r = share("web", "n1", 2, 1536);
        let settings = PodSettings {
            image: "pause:test".into(),
            priority_class: Some("imp-vm-reservation".into()),
        };
        let p = pod(&r, &settings);
        assert_eq!(p.metadata.name.as_deref(), Some("imp-vm-web"));
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert_eq!(
            spec.priority_class_name.as_deref(),
            Some("imp-vm-reservation")
        );
        assert_eq!(
            pod_requests(&p),
            Load {
                cpu_milli: 2000,
                memory_mib: 1536
            }
        );
        let res = spec.containers[0].resources.as_ref().unwrap();
        assert_eq!(res.limits, res.requests);
        let e = Existing::of(&p).unwrap();
        assert_eq!(e.vm_uid, "uid-web");
        assert!(e.fits(&r));
        assert!(plan(&[r], &[e], &BTreeMap::new()).is_empty());
    }

    #[test]
    fn a_suspended_vm_reserves_memory_only_and_nothing_when_overcommitted() {
        let s = |susp, over| Reservation::of("ns", "v", "u", "n", (2, 512), susp, over);
        assert_eq!(s(false, true).unwrap().load.cpu_milli, 2000);
        let kept = s(true, false).unwrap();
        assert_eq!(
            kept.load,
            Load {
                cpu_milli: 0,
                memory_mib: 512
            }
        );
        assert!(!quantities(kept.load).contains_key("cpu"));
        assert_eq!(s(true, true), None);
    }

    #[test]
    fn the_plan_creates_missing_deletes_unwanted_and_replaces_changed_reservations() {
        let settings = PodSettings::default();
        let existing_of = |r: &Reservation| Existing::of(&pod(r, &settings)).unwrap();
        let kept = share("kept", "n1", 1, 256);
        let moved = share("moved", "n2", 1, 256);
        let resized = share("resized", "n1", 2, 512);
        let new = share("new", "n1", 1, 256);
        let existing = vec![
            existing_of(&kept),
            existing_of(&share("moved", "n1", 1, 256)),
            existing_of(&share("resized", "n1", 1, 256)),
            existing_of(&share("gone", "n1", 1, 256)),
            Existing {
                failed: true,
                ..existing_of(&share("refused", "n1", 1, 256))
            },
            Existing {
                deleting: true,
                ..existing_of(&share("leaving", "n1", 1, 256))
            },
        ];
        let wanted = vec![
            kept,
            moved,
            resized,
            new.clone(),
            share("refused", "n1", 1, 256),
            share("leaving", "n2", 1, 256),
        ];
        let ops = plan(&wanted, &existing, &BTreeMap::new());
        let del = |n: &str| Op::Delete("ns".into(), format!("imp-vm-{n}"));
        assert_eq!(
            ops,
            vec![
                del("moved"),
                del("resized"),
                del("gone"),
                del("refused"),
                Op::Create(new)
            ],
            "a changed Pod is deleted now and created again once it is gone"
        );
    }

    #[test]
    fn a_claim_moves_the_members_pod_to_its_claimant_and_nothing_is_made_twice() {
        let settings = PodSettings::default();
        let member = share("py-x7k2p", "n1", 1, 256);
        let claimant = Reservation {
            vm: "job".into(),
            vm_uid: "uid-job".into(),
            ..member.clone()
        };
        let members_pod = Existing::of(&pod(&member, &settings)).unwrap();
        let claimed = BTreeMap::from([("uid-py-x7k2p".to_owned(), "uid-job".to_owned())]);
        // Claimed, the claimant not booked yet: the member's Pod is neither deleted nor made
        // again.
        assert_eq!(
            plan(
                std::slice::from_ref(&member),
                std::slice::from_ref(&members_pod),
                &claimed
            ),
            []
        );
        // The claimant booked, its Pod not handed over yet (or not seen so by the cache): it
        // is the claimant's already, and nobody gets a second.
        let both = [member.clone(), claimant.clone()];
        assert_eq!(
            plan(&both, std::slice::from_ref(&members_pod), &claimed),
            []
        );
        // Handed over: the Pod named after the member is the claimant's; left alone before
        // the claimant is bound to the node too.
        let moved = Existing {
            vm_uid: "uid-job".into(),
            ..members_pod.clone()
        };
        assert_eq!(
            plan(
                std::slice::from_ref(&member),
                std::slice::from_ref(&moved),
                &claimed
            ),
            []
        );
        assert_eq!(plan(&both, std::slice::from_ref(&moved), &claimed), []);
        // The member gone: still the one Pod.
        assert_eq!(
            plan(
                std::slice::from_ref(&claimant),
                std::slice::from_ref(&moved),
                &BTreeMap::new()
            ),
            []
        );
        // Two Pods for one VM: the second goes.
        let stray = Existing {
            name: "imp-vm-job".into(),
            ..moved.clone()
        };
        assert_eq!(
            plan(&[claimant], &[moved, stray], &BTreeMap::new()),
            [Op::Delete("ns".into(), "imp-vm-job".into())]
        );
    }

    #[test]
    fn long_vm_names_give_distinct_valid_pod_names() {
        let a = "a".repeat(253);
        let b = format!("{}b", "a".repeat(252));
        let (na, nb) = (pod_name(&a), pod_name(&b));
        assert!(na.len() <= MAX_NAME && nb.len() <= MAX_NAME);
        assert_ne!(na, nb);
        assert_eq!(pod_name("web"), "imp-vm-web");
    }
}
