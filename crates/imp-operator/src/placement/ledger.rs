//! What every node holds, kept up to date one VM at a time.
//!
//! Every placement needs the usage of every node. Summing all VMs for each placement costs
//! O(VMs) under the scheduling lock, O(N²) for a burst of N; the ledger keeps the per-node sums
//! instead and changes them by one VM's share whenever the VM watch, or a `spec.nodeName` write
//! of this process, changes what that VM holds. Pure logic: the controller feeds it watch events
//! and its own writes.
//!
//! # What a VM holds
//! A VM counts on the node this process last wrote to its `spec.nodeName` until the watch shows
//! that node (the watch lags its own writes by a few milliseconds), else on the node the watch
//! shows. A write that failed takes its booking back. Terminal phases hold nothing; a suspended
//! VM holds memory only (see [`crate::placement::schedule`]).
//!
//! Its size, in this order:
//! 1. its booking (`status.booking`, [`imp_api::vm::Booking`]): the size it was placed with and
//!    that its node agent boots, whatever happens to its class afterwards (edited or deleted),
//!    across operator restarts too;
//! 2. the size recorded in annotation [`ANNOTATION_PLACED_RESOURCES`] with the placement (VMs
//!    placed by an operator that wrote no booking);
//! 3. its live ImpVMClass (its own `classRef`, else its template's): a VM pinned by a user
//!    before the operator has booked it;
//! 4. the last live size this process saw;
//! 5. zero.
//!
//! # Versions known to be stale
//! Per VM the ledger also remembers resourceVersions this process knows are outdated: those it
//! wrote over, and those a write was refused for (409). A reconcile handed such a version (the
//! watch has not yet caught up with this process's own write) can stop at once, since every
//! write it made would be refused; the watch event of the newer version reconciles it again.

use std::collections::{BTreeMap, HashMap, HashSet};

use imp_api::shared::{ANNOTATION_PLACED_RESOURCES, PlacedSize};
use imp_api::vm::{ImpVM, VmPhase};
use kube::ResourceExt;

use crate::placement::schedule::NodeUsage;

/// Known-stale resourceVersions kept per VM; older ones are forgotten first.
const STALE_VERSIONS: usize = 8;

/// Where a VM's live size comes from: its namespace, its class and its template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SizeRef {
    /// The VM's namespace (templates are namespaced).
    pub namespace: String,
    /// `spec.classRef.name`.
    pub class: Option<String>,
    /// `spec.templateRef.name`.
    pub template: Option<String>,
}

impl SizeRef {
    /// The references of `vm`.
    pub fn of(vm: &ImpVM) -> Self {
        Self {
            namespace: vm.namespace().unwrap_or_default(),
            class: vm.spec.class_ref.as_ref().map(|c| c.name.clone()),
            template: vm.spec.template_ref.as_ref().map(|t| t.name.clone()),
        }
    }
}

/// The `spec.nodeName` a write of this process set, until the watch shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Written {
    node: Option<String>,
    /// The write is still in flight (it may yet fail and be taken back).
    in_flight: bool,
}

/// What one booking replaced, to put back if its write fails.
#[derive(Debug)]
#[must_use = "a failed write must give its booking back"]
pub struct Booking {
    previous: Option<Written>,
}

/// What one VM adds to its node's usage.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Share {
    node: String,
    size: PlacedSize,
    suspended: bool,
}

/// One VM: what the watch last showed, what this process wrote, and what is counted for it.
#[derive(Clone, Debug, Default)]
struct Entry {
    /// `spec.nodeName` in the watch.
    node: Option<String>,
    /// `status.phase` in the watch.
    phase: VmPhase,
    refs: SizeRef,
    /// Size of its class in the cache now.
    live: Option<PlacedSize>,
    /// Size of its booking, else of its placed-resources annotation (or of the booking this
    /// process wrote and the watch does not show yet).
    placed: Option<PlacedSize>,
    last_live: Option<PlacedSize>,
    written: Option<Written>,
    stale: Vec<String>,
    /// The share now in [`Ledger::usage`], to take back exactly.
    counted: Option<Share>,
    /// The node a move in flight takes the VM to (`status.move` before its commit, or a
    /// move this process booked that the watch does not show yet): the VM holds it too.
    moving_to: Option<String>,
    /// [`Ledger::book_move`] set `moving_to` and the watch has not shown the move yet.
    move_booked: bool,
    /// The share on `moving_to` now in [`Ledger::usage`].
    counted_move: Option<Share>,
}

impl Entry {
    fn size(&self) -> PlacedSize {
        self.placed
            .or(self.live)
            .or(self.last_live)
            .unwrap_or_default()
    }

    fn share(&self) -> Option<Share> {
        let node = match &self.written {
            Some(w) => w.node.clone(),
            None => self.node.clone(),
        }?;
        if self.phase.is_terminal() {
            return None;
        }
        Some(Share {
            node,
            size: self.size(),
            suspended: self.phase == VmPhase::Suspended,
        })
    }

    /// What the VM holds on the node it moves to: its whole size (it runs there after the
    /// commit), while it holds its source too.
    fn move_share(&self) -> Option<Share> {
        let node = self.moving_to.clone()?;
        (!self.phase.is_terminal()).then(|| Share {
            node,
            size: self.size(),
            suspended: false,
        })
    }
}

/// Per-VM bookings and per-node usage; see the module documentation.
#[derive(Debug, Default)]
pub struct Ledger {
    vms: HashMap<String, Entry>,
    usage: BTreeMap<String, NodeUsage>,
    /// Keys seen since the watch began a relist, to drop the VMs that are gone at its end.
    relisting: Option<HashSet<String>>,
    /// A class or template changed: live sizes must be looked up again.
    resize: bool,
    /// The watch has listed every VM once: what the ledger holds is the cluster's.
    listed: bool,
}

impl Ledger {
    /// Usage per node; a node without an entry holds nothing.
    pub fn usage(&self) -> &BTreeMap<String, NodeUsage> {
        &self.usage
    }

    /// What `key` holds now: its node, its size, and whether it is suspended; `None` when it
    /// holds no node (unplaced, ended, unknown).
    pub fn held(&self, key: &str) -> Option<(&str, PlacedSize, bool)> {
        let s = self.vms.get(key)?.counted.as_ref()?;
        Some((s.node.as_str(), s.size, s.suspended))
    }

    /// The watch shows `vm` (added, changed, or listed); `live` is its class's size now.
    pub fn observe(&mut self, key: &str, vm: &ImpVM, live: Option<PlacedSize>) {
        if let Some(seen) = &mut self.relisting {
            seen.insert(key.to_owned());
        }
        let e = self.vms.entry(key.to_owned()).or_default();
        let rv = vm.metadata.resource_version.as_ref();
        if rv.is_none_or(|v| !e.stale.contains(v)) {
            // The watch has caught up with (or gone past) every version known to be stale.
            e.stale.clear();
        }
        e.node.clone_from(&vm.spec.node_name);
        e.phase = vm.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        e.refs = SizeRef::of(vm);
        e.live = live;
        if live.is_some() {
            e.last_live = live;
        }
        if e.written.as_ref().is_some_and(|w| w.node == e.node) {
            e.written = None;
        }
        let booked = vm
            .status
            .as_ref()
            .and_then(|s| s.booking.as_ref())
            .map(imp_api::vm::Booking::size);
        let placed = booked.or_else(|| {
            vm.annotations()
                .get(ANNOTATION_PLACED_RESOURCES)
                .and_then(|a| PlacedSize::from_annotation(a))
        });
        if placed.is_some() || e.written.is_none() {
            // A booking not shown yet keeps the size it placed with.
            e.placed = placed;
        }
        match vm.status.as_ref().and_then(|s| s.moving.as_ref()) {
            Some(m) => {
                e.move_booked = false;
                let before_commit = matches!(
                    m.phase,
                    imp_api::vm::MovePhase::Transferring | imp_api::vm::MovePhase::Sent
                );
                e.moving_to = before_commit.then(|| m.target.clone());
            }
            None if !e.move_booked => e.moving_to = None,
            None => {}
        }
        self.recount(key);
    }

    /// Books `key`'s whole size on `target`, where a move takes it, until the watch shows the
    /// move (which then keeps it booked until its commit) or [`Ledger::abort_move`].
    pub fn book_move(&mut self, key: &str, target: &str) {
        let Some(e) = self.vms.get_mut(key) else {
            return;
        };
        e.moving_to = Some(target.to_owned());
        e.move_booked = true;
        self.recount(key);
    }

    /// The write of a move booked with [`Ledger::book_move`] failed: the target is free again.
    pub fn abort_move(&mut self, key: &str) {
        let Some(e) = self.vms.get_mut(key) else {
            return;
        };
        if e.move_booked {
            e.move_booked = false;
            e.moving_to = None;
            self.recount(key);
        }
    }

    /// The watch says `key` was deleted.
    pub fn forget(&mut self, key: &str) {
        if let Some(e) = self.vms.remove(key) {
            self.take(e.counted.as_ref());
            self.take(e.counted_move.as_ref());
        }
    }

    /// The watch starts listing everything again.
    pub fn relist_started(&mut self) {
        self.relisting = Some(HashSet::new());
    }

    /// Whether the watch has listed every VM at least once. Before, an absent VM may be one
    /// not listed yet: nothing is to be concluded from what the ledger lacks (a reservation
    /// Pod without its VM's share is not to be deleted).
    pub fn listed(&self) -> bool {
        self.listed
    }

    /// The relist is complete: VMs it did not show are gone.
    pub fn relist_done(&mut self) {
        let Some(seen) = self.relisting.take() else {
            return;
        };
        self.listed = true;
        let gone: Vec<String> = self
            .vms
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for k in gone {
            self.forget(&k);
        }
    }

    /// A class or template changed: look live sizes up again before the next placement.
    pub fn classes_changed(&mut self) {
        self.resize = true;
    }

    /// Looks every VM's live size up again if a class or template changed since the last call.
    pub fn refresh_sizes(&mut self, live: impl Fn(&SizeRef) -> Option<PlacedSize>) {
        if !std::mem::take(&mut self.resize) {
            return;
        }
        let keys: Vec<String> = self.vms.keys().cloned().collect();
        for k in keys {
            if let Some(e) = self.vms.get_mut(&k) {
                e.live = live(&e.refs);
                if e.live.is_some() {
                    e.last_live = e.live;
                }
            }
            self.recount(&k);
        }
    }

    /// Books `node` (or no node) for `key` before its `spec.nodeName` write is sent; `placed` is
    /// the size that write records, if it records one.
    pub fn book(&mut self, key: &str, node: Option<&str>, placed: Option<PlacedSize>) -> Booking {
        let e = self.vms.entry(key.to_owned()).or_default();
        let previous = e.written.replace(Written {
            node: node.map(str::to_owned),
            in_flight: true,
        });
        if placed.is_some() {
            e.placed = placed;
        }
        self.recount(key);
        Booking { previous }
    }

    /// The write of a booking succeeded: it holds until the watch shows it.
    pub fn confirm(&mut self, key: &str) {
        if let Some(w) = self.vms.get_mut(key).and_then(|e| e.written.as_mut()) {
            w.in_flight = false;
        }
    }

    /// The write of a booking failed: what it replaced holds again.
    pub fn abort(&mut self, key: &str, booking: Booking) {
        let Some(e) = self.vms.get_mut(key) else {
            return;
        };
        if e.written.as_ref().is_some_and(|w| w.in_flight) {
            e.written = booking.previous;
            self.recount(key);
        }
    }

    /// `resource_version` of `key` is outdated: this process wrote over it, or a write based on
    /// it was refused with 409.
    pub fn outdated(&mut self, key: &str, resource_version: Option<&str>) {
        let (Some(e), Some(rv)) = (self.vms.get_mut(key), resource_version) else {
            return;
        };
        if !e.stale.iter().any(|s| s == rv) {
            if e.stale.len() >= STALE_VERSIONS {
                e.stale.remove(0);
            }
            e.stale.push(rv.to_owned());
        }
    }

    /// Whether `resource_version` of `key` is known to be outdated.
    pub fn is_stale(&self, key: &str, resource_version: Option<&str>) -> bool {
        let (Some(e), Some(rv)) = (self.vms.get(key), resource_version) else {
            return false;
        };
        e.stale.iter().any(|s| s == rv)
    }

    /// Puts the VM's share where it belongs now.
    fn recount(&mut self, key: &str) {
        let Some(e) = self.vms.get_mut(key) else {
            return;
        };
        let share = e.share();
        let move_share = e.move_share();
        let old = (share != e.counted).then(|| std::mem::replace(&mut e.counted, share.clone()));
        let old_move = (move_share != e.counted_move)
            .then(|| std::mem::replace(&mut e.counted_move, move_share.clone()));
        for (old, new) in [(old, share), (old_move, move_share)] {
            let Some(old) = old else { continue };
            self.take(old.as_ref());
            if let Some(s) = &new {
                self.usage.entry(s.node.clone()).or_default().add(
                    s.size.vcpu,
                    s.size.memory_mib,
                    s.suspended,
                );
            }
        }
    }

    fn take(&mut self, share: Option<&Share>) {
        let Some(s) = share else { return };
        if let Some(u) = self.usage.get_mut(&s.node) {
            u.remove(s.size.vcpu, s.size.memory_mib, s.suspended);
            if u.vms <= 0 {
                self.usage.remove(&s.node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::placement::schedule::{self, NodeView, Policy, Request};
    use imp_api::shared::LABEL_NODE_ENABLED;
    use imp_api::vm::ImpVMStatus;

    const SMALL: PlacedSize = PlacedSize {
        vcpu: 1,
        memory_mib: 256,
    };

    fn vm(rv: &str, node: Option<&str>, phase: VmPhase, placed: Option<PlacedSize>) -> ImpVM {
        let mut v: ImpVM = serde_json::from_value(serde_json::json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "a", "namespace": "ns", "resourceVersion": rv},
            "spec": {"classRef": {"name": "small"}, "image": "x"}
        }))
        .unwrap();
        v.spec.node_name = node.map(str::to_owned);
        v.status = Some(ImpVMStatus {
            phase: Some(phase),
            ..Default::default()
        });
        if let Some(p) = placed {
            v.metadata.annotations = Some(BTreeMap::from([(
                ANNOTATION_PLACED_RESOURCES.to_owned(),
                p.to_annotation(),
            )]));
        }
        v
    }

    fn on(ledger: &Ledger, node: &str) -> NodeUsage {
        ledger.usage().get(node).copied().unwrap_or_default()
    }

    fn used(vcpu: i64, memory_mib: i64, vms: i64) -> NodeUsage {
        NodeUsage {
            vcpu,
            memory_mib,
            suspended_memory_mib: 0,
            vms,
        }
    }

    #[test]
    fn a_booking_counts_before_the_watch_shows_it_and_once_after() {
        let mut l = Ledger::default();
        l.observe("ns/a", &vm("1", None, VmPhase::Pending, None), Some(SMALL));
        assert!(l.usage().is_empty());
        let _b = l.book("ns/a", Some("n1"), Some(SMALL));
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        l.confirm("ns/a");
        // The cache still shows the old version: the booking holds.
        l.observe("ns/a", &vm("1", None, VmPhase::Pending, None), Some(SMALL));
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        // The watch shows the write: counted once, from the cache now.
        l.observe(
            "ns/a",
            &vm("2", Some("n1"), VmPhase::Pending, Some(SMALL)),
            Some(SMALL),
        );
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        l.forget("ns/a");
        assert!(l.usage().is_empty());
    }

    #[test]
    fn a_booking_counts_the_size_it_places_with() {
        // The class is not in this process's cache (yet): the placement's own size counts.
        let mut l = Ledger::default();
        l.observe("ns/a", &vm("1", None, VmPhase::Pending, None), None);
        let _b = l.book("ns/a", Some("n1"), Some(SMALL));
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        // Still while the watch shows versions without the placement.
        l.observe("ns/a", &vm("2", None, VmPhase::Pending, None), None);
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
    }

    #[test]
    fn a_failed_write_gives_its_booking_back() {
        let mut l = Ledger::default();
        l.observe("ns/a", &vm("1", None, VmPhase::Pending, None), Some(SMALL));
        let first = l.book("ns/a", Some("n1"), Some(SMALL));
        l.confirm("ns/a");
        drop(first);
        // A second placement from a stale read fails: the first booking holds again.
        let second = l.book("ns/a", Some("n2"), Some(SMALL));
        assert_eq!(on(&l, "n2"), used(1, 256, 1));
        assert!(l.usage().get("n1").is_none());
        l.abort("ns/a", second);
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        assert!(l.usage().get("n2").is_none());
    }

    #[test]
    fn the_booked_size_wins_then_the_live_class_then_the_last_seen() {
        let big = PlacedSize {
            vcpu: 4,
            memory_mib: 4096,
        };
        let mut l = Ledger::default();
        // The size it was placed with wins over its class resized since.
        let placed = vm("1", Some("n1"), VmPhase::Running, Some(SMALL));
        l.observe("ns/a", &placed, Some(big));
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        // The class is deleted: still the placed size.
        l.classes_changed();
        l.refresh_sizes(|_| None);
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        // Without a booking (pinned by a user), the live class, then the last one seen.
        l.observe(
            "ns/a",
            &vm("2", Some("n1"), VmPhase::Running, None),
            Some(big),
        );
        assert_eq!(on(&l, "n1"), used(4, 4096, 1));
        l.observe("ns/a", &vm("3", Some("n1"), VmPhase::Running, None), None);
        assert_eq!(on(&l, "n1"), used(4, 4096, 1));
        // A fresh process that never saw the class and has no booking counts zero vCPU.
        let mut fresh = Ledger::default();
        fresh.observe("ns/a", &vm("3", Some("n1"), VmPhase::Running, None), None);
        assert_eq!(on(&fresh, "n1"), used(0, 0, 1));
    }

    #[test]
    fn the_status_booking_wins_over_the_annotation_a_user_may_edit() {
        let mut v = vm("1", Some("n1"), VmPhase::Running, Some(SMALL));
        v.status.as_mut().unwrap().booking = Some(imp_api::vm::Booking {
            class: imp_api::class::ImpVMClassSpec {
                vcpu: 2,
                memory_mib: 1024,
                disk_gib: 1,
                ..Default::default()
            },
            spec: v.spec.clone(),
            revision: 0,
        });
        let mut l = Ledger::default();
        l.observe("ns/a", &v, None);
        assert_eq!(on(&l, "n1"), used(2, 1024, 1));
    }

    #[test]
    fn sizes_are_looked_up_again_only_after_a_class_change() {
        let mut l = Ledger::default();
        l.observe(
            "ns/a",
            &vm("1", Some("n1"), VmPhase::Running, None),
            Some(SMALL),
        );
        let looked = std::cell::Cell::new(0);
        let lookup = |r: &SizeRef| {
            looked.set(looked.get() + 1);
            assert_eq!(r.class.as_deref(), Some("small"));
            Some(PlacedSize {
                vcpu: 2,
                memory_mib: 512,
            })
        };
        l.refresh_sizes(lookup);
        assert_eq!(looked.get(), 0);
        l.classes_changed();
        l.refresh_sizes(lookup);
        l.refresh_sizes(lookup);
        assert_eq!(looked.get(), 1);
        assert_eq!(on(&l, "n1"), used(2, 512, 1));
    }

    #[test]
    fn terminal_vms_hold_nothing_and_suspended_ones_only_memory() {
        let mut l = Ledger::default();
        l.observe(
            "ns/a",
            &vm("1", Some("n1"), VmPhase::Suspended, None),
            Some(SMALL),
        );
        assert_eq!(
            on(&l, "n1"),
            NodeUsage {
                vcpu: 0,
                memory_mib: 0,
                suspended_memory_mib: 256,
                vms: 1
            }
        );
        l.observe(
            "ns/a",
            &vm("2", Some("n1"), VmPhase::Succeeded, None),
            Some(SMALL),
        );
        assert!(l.usage().is_empty());
    }

    #[test]
    fn a_move_holds_both_nodes_until_its_commit_then_only_the_target() {
        let mut l = Ledger::default();
        let running = vm("1", Some("n1"), VmPhase::Running, Some(SMALL));
        l.observe("ns/a", &running, Some(SMALL));
        // Booked before the move's write: the target is held at once ...
        l.book_move("ns/a", "n2");
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
        assert_eq!(on(&l, "n2"), used(1, 256, 1));
        // ... also while the watch still shows the VM without its move.
        l.observe("ns/a", &running, Some(SMALL));
        assert_eq!(on(&l, "n2"), used(1, 256, 1));
        let moving = |rv: &str, node: &str, phase: imp_api::vm::MovePhase| {
            let mut v = vm(rv, Some(node), VmPhase::Suspended, Some(SMALL));
            v.status.as_mut().unwrap().moving = Some(imp_api::vm::VmMove {
                source: "n1".into(),
                target: "n2".into(),
                phase,
                ..Default::default()
            });
            v
        };
        // Suspended on its source for the move: memory there, the whole size on the target.
        l.observe(
            "ns/a",
            &moving("2", "n1", imp_api::vm::MovePhase::Sent),
            Some(SMALL),
        );
        assert_eq!(on(&l, "n1").suspended_memory_mib, 256);
        assert_eq!(on(&l, "n2"), used(1, 256, 1));
        // Committed: the source is free, the target counted once.
        l.observe(
            "ns/a",
            &moving("3", "n2", imp_api::vm::MovePhase::Committed),
            Some(SMALL),
        );
        assert!(!l.usage().contains_key("n1"));
        assert_eq!(on(&l, "n2").vms, 1);
        // A move whose write failed gives the target back.
        let mut l = Ledger::default();
        l.observe("ns/a", &running, Some(SMALL));
        l.book_move("ns/a", "n2");
        l.abort_move("ns/a");
        assert!(!l.usage().contains_key("n2"));
        // A move cleared by an abort frees the target too.
        l.observe(
            "ns/a",
            &moving("2", "n1", imp_api::vm::MovePhase::Transferring),
            Some(SMALL),
        );
        assert_eq!(on(&l, "n2"), used(1, 256, 1));
        l.observe("ns/a", &running, Some(SMALL));
        assert!(!l.usage().contains_key("n2"));
    }

    #[test]
    fn a_relist_drops_the_vms_it_no_longer_shows() {
        let mut l = Ledger::default();
        assert!(!l.listed());
        l.observe(
            "ns/a",
            &vm("1", Some("n1"), VmPhase::Running, None),
            Some(SMALL),
        );
        l.observe(
            "ns/b",
            &vm("1", Some("n1"), VmPhase::Running, None),
            Some(SMALL),
        );
        l.relist_started();
        l.observe(
            "ns/b",
            &vm("5", Some("n1"), VmPhase::Running, None),
            Some(SMALL),
        );
        // Until the relist is done, what it has not shown yet still counts.
        assert_eq!(on(&l, "n1"), used(2, 512, 2));
        assert!(!l.listed(), "listed before the first relist was done");
        l.relist_done();
        assert!(l.listed());
        assert_eq!(on(&l, "n1"), used(1, 256, 1));
    }

    #[test]
    fn versions_written_over_are_stale_until_the_watch_moves_past_them() {
        let mut l = Ledger::default();
        l.observe("ns/a", &vm("1", None, VmPhase::Pending, None), Some(SMALL));
        assert!(!l.is_stale("ns/a", Some("1")));
        l.outdated("ns/a", Some("1"));
        l.outdated("ns/a", Some("2"));
        assert!(l.is_stale("ns/a", Some("1")) && l.is_stale("ns/a", Some("2")));
        // The watch shows version 2, which is still stale: nothing is forgotten.
        l.observe("ns/a", &vm("2", None, VmPhase::Pending, None), Some(SMALL));
        assert!(l.is_stale("ns/a", Some("1")));
        // Version 3 is not: the watch has caught up.
        l.observe("ns/a", &vm("3", None, VmPhase::Pending, None), Some(SMALL));
        assert!(!l.is_stale("ns/a", Some("1")) && !l.is_stale("ns/a", Some("2")));
        assert!(!l.is_stale("ns/unknown", Some("1")));
    }

    #[test]
    fn two_vms_booked_at_once_never_share_the_last_slot() {
        // 2 vCPU × 0.9 = 1.8: one 1-vCPU VM fits.
        let node = NodeView {
            name: "n1".into(),
            labels: BTreeMap::from([(LABEL_NODE_ENABLED.to_owned(), "true".to_owned())]),
            ready: true,
            allocatable_cpu_milli: 2000,
            allocatable_memory_mib: 4096,
            ..Default::default()
        };
        let req = Request {
            only_node: None,
            vcpu: 1,
            memory_mib: 256,
            ..Default::default()
        };
        let policy = Policy::default();
        let mut l = Ledger::default();
        for k in ["ns/a", "ns/b"] {
            l.observe(k, &vm("1", None, VmPhase::Pending, None), Some(SMALL));
        }
        // Neither write has reached the cache yet.
        let a = schedule::pick(&req, std::slice::from_ref(&node), l.usage(), &policy);
        assert_eq!(a, Ok("n1".to_owned()));
        let _booked = l.book("ns/a", Some("n1"), Some(SMALL));
        let b = schedule::pick(&req, std::slice::from_ref(&node), l.usage(), &policy);
        assert!(b.is_err(), "{b:?}");
    }
}
