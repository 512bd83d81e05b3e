//! This node's VMs as the agent API sees them: each one's guest endpoint, refreshed from the
//! records every poll (the API never touches the disk), the wake an exec gives a VM that
//! scale-to-zero put to sleep, what keeps a VM in use besides its network, and the guests'
//! latest figures ([`super::guest_metrics`] asks for them; `imp top` reads them).
//!
//! An exec session keeps its VM awake: a ScaleToZero VM with a session open is never idle,
//! and a suspend never cuts one. Both sides take the same lock: an exec begins only if no
//! suspend is under way, and an idle suspend begins only if no exec is open (a suspend the
//! user asked for begins anyway). Once a suspend has begun, a new exec waits for it to end
//! and then wakes the VM.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use imp_api::vm::ImpVM;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use super::decide::{self, ExecWake};
use super::scale::{Knock, ScaleToZero};
use crate::api::top::GuestReading;
use crate::api::{GuestEndpoint, VmLookup, Waking};
use crate::runtime::state::{VmRecord, VmStatus};

/// `(namespace, name)` of an ImpVM.
type Key = (String, String);

fn key(namespace: &str, name: &str) -> Key {
    (namespace.to_owned(), name.to_owned())
}

/// This node's VMs for the agent API.
#[derive(Default)]
pub struct NodeVms {
    map: RwLock<HashMap<Key, Found>>,
    uses: Mutex<Uses>,
    /// Set once the controller runs, on a node that wires networks.
    waker: OnceLock<Waker>,
    /// The latest figures of the guests that answered, for the agent API.
    readings: RwLock<HashMap<Key, GuestReading>>,
}

impl std::fmt::Debug for NodeVms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeVms").finish_non_exhaustive()
    }
}

/// One VM as its record says.
#[derive(Debug, Clone)]
struct Found {
    endpoint: GuestEndpoint,
    uid: String,
    status: VmStatus,
}

/// Wakes a sleeping VM as its first frame would: marks it knocked and asks for its reconcile.
struct Waker {
    scale: Arc<ScaleToZero>,
    reconcile: mpsc::Sender<ObjectRef<ImpVM>>,
}

/// What uses a VM besides its network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// This many exec sessions are open.
    Execs(usize),
    /// A suspend has begun: no exec may start until the VM's record says how it went.
    Suspending,
}

/// The uses of this node's VMs: the pure bookkeeping under [`NodeVms`]'s lock.
#[derive(Debug, Default)]
struct Uses(HashMap<Key, Use>);

impl Uses {
    fn exec_begin(&mut self, k: Key) -> bool {
        match self.0.entry(k).or_insert(Use::Execs(0)) {
            Use::Suspending => false,
            Use::Execs(n) => {
                *n += 1;
                true
            }
        }
    }

    fn exec_end(&mut self, k: &Key) {
        if let Some(Use::Execs(n)) = self.0.get_mut(k) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.0.remove(k);
            }
        }
    }

    fn busy(&self, k: &Key) -> bool {
        matches!(self.0.get(k), Some(Use::Execs(n)) if *n > 0)
    }

    fn suspending(&self, k: &Key) -> bool {
        self.0.get(k) == Some(&Use::Suspending)
    }

    fn suspend_begin(&mut self, k: Key, forced: bool) -> bool {
        if self.busy(&k) && !forced {
            return false;
        }
        self.0.insert(k, Use::Suspending);
        true
    }

    fn suspend_over(&mut self, k: &Key) {
        if self.suspending(k) {
            self.0.remove(k);
        }
    }
}

impl NodeVms {
    /// Replaces what the API knows with `records` (and whether each one's shim lives).
    pub(super) fn refresh(&self, records: &[(VmRecord, bool)]) {
        // Oldest first, so that when a recreated VM's record sits beside its predecessor's
        // (still being torn down), the newest one is kept.
        let mut sorted: Vec<&(VmRecord, bool)> = records.iter().collect();
        sorted.sort_by_key(|(r, _)| r.created_unix);
        let map: HashMap<Key, Found> = sorted
            .into_iter()
            .filter_map(|(r, alive)| entry(r, *alive))
            .collect();
        // A suspend is over once the shim has taken it up (or the VM is gone).
        lock(&self.uses).0.retain(|k, u| {
            *u != Use::Suspending || map.get(k).is_some_and(|f| f.status == VmStatus::Running)
        });
        *self.map.write().unwrap_or_else(PoisonError::into_inner) = map;
    }

    /// Takes in one VM's record as its reconcile reads it, before that reconcile publishes
    /// anything from it: an exec that follows a `Running` status must find the VM running
    /// here, not wait for the next full [`Self::refresh`].
    pub(super) fn observe(&self, record: &VmRecord, alive: bool) {
        if let Some((k, found)) = entry(record, alive) {
            self.map
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(k, found);
        }
    }

    fn get(&self, namespace: &str, name: &str) -> Option<Found> {
        self.map
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key(namespace, name))
            .cloned()
    }

    /// Lets exec wake the sleepers of `scale` through the controller's `reconcile` queue.
    pub(super) fn arm(&self, scale: Arc<ScaleToZero>, reconcile: mpsc::Sender<ObjectRef<ImpVM>>) {
        let _ = self.waker.set(Waker { scale, reconcile });
    }

    /// Whether an exec session into the VM is open.
    pub(super) fn busy(&self, namespace: &str, name: &str) -> bool {
        lock(&self.uses).busy(&key(namespace, name))
    }

    /// Begins a suspend of the VM, unless an exec is open and the suspend is not `forced` (a
    /// suspend for idleness waits for the exec to end; one the user asked for does not).
    pub(super) fn suspend_begin(&self, namespace: &str, name: &str, forced: bool) -> bool {
        lock(&self.uses).suspend_begin(key(namespace, name), forced)
    }

    /// The suspend begun did not happen (it could not be asked for, or it failed): execs may
    /// start again.
    pub(super) fn suspend_over(&self, namespace: &str, name: &str) {
        lock(&self.uses).suspend_over(&key(namespace, name));
    }

    /// Every VM of this node with its guest endpoint; `running` only for a VM whose shim lives,
    /// whose record says Running and whose suspend has not begun (the guest answers now).
    pub(super) fn guests(&self) -> Vec<Guest> {
        let uses = lock(&self.uses);
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        map.iter()
            .filter(|(_, f)| f.endpoint.guest_agent)
            .map(|((namespace, name), f)| Guest {
                namespace: namespace.clone(),
                name: name.clone(),
                uid: f.uid.clone(),
                vsock: f.endpoint.vsock.clone(),
                agent_port: f.endpoint.agent_port,
                running: f.endpoint.running && !uses.suspending(&key(namespace, name)),
            })
            .collect()
    }

    /// Keeps `reading` as the latest figures of VM `namespace/name` (`None`: it has none).
    pub(super) fn set_reading(&self, namespace: &str, name: &str, reading: Option<GuestReading>) {
        let mut readings = self
            .readings
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        match reading {
            Some(r) => readings.insert(key(namespace, name), r),
            None => readings.remove(&key(namespace, name)),
        };
    }
}

/// What the API knows of the VM of record `r` (its shim alive or not), under its ImpVM's key.
fn entry(r: &VmRecord, alive: bool) -> Option<(Key, Found)> {
    let o = r.owner.as_ref()?;
    let endpoint = GuestEndpoint {
        vsock: r.vsock.clone(),
        agent_port: r.agent_port,
        serial_log: r.serial_log.clone(),
        // A paused warm pool member is not asked anything: its guest cannot answer.
        running: alive && r.status == VmStatus::Running && !r.paused,
        guest_agent: r.guest_agent,
    };
    let found = Found {
        endpoint,
        uid: r.name.clone(),
        status: r.status,
    };
    Some((key(&o.namespace, &o.name), found))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl VmLookup for NodeVms {
    fn find(&self, namespace: &str, name: &str) -> Option<GuestEndpoint> {
        self.get(namespace, name).map(|f| f.endpoint)
    }

    fn exec_begin(&self, namespace: &str, name: &str) -> bool {
        lock(&self.uses).exec_begin(key(namespace, name))
    }

    fn exec_end(&self, namespace: &str, name: &str) {
        lock(&self.uses).exec_end(&key(namespace, name));
    }

    fn guest_readings(&self, namespace: &str) -> Vec<GuestReading> {
        let readings = self.readings.read().unwrap_or_else(PoisonError::into_inner);
        let mut found: Vec<GuestReading> = readings
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .map(|(_, r)| r.clone())
            .collect();
        found.sort_by(|a, b| a.name.cmp(&b.name));
        found
    }

    fn wake(&self, namespace: &str, name: &str) -> Waking {
        if lock(&self.uses).suspending(&key(namespace, name)) {
            return Waking::Soon;
        }
        let Some(found) = self.get(namespace, name) else {
            return Waking::No;
        };
        if found.endpoint.running {
            // It runs: the exec met a suspend that has ended since (it failed); go round again.
            return Waking::Soon;
        }
        let Some(waker) = self.waker.get() else {
            return Waking::No;
        };
        // The records are read every poll: a suspend or resume under way ends in a state
        // this is asked again about (a sleeper, or a running VM).
        match decide::exec_wake(found.status) {
            ExecWake::Wait => return Waking::Soon,
            ExecWake::Refuse => return Waking::No,
            ExecWake::Knock => {}
        }
        match waker.scale.knock(&found.uid) {
            Knock::First => {
                let tx = waker.reconcile.clone();
                let obj = ObjectRef::new(name).within(namespace);
                tokio::spawn(async move {
                    let _ = tx.send(obj).await;
                });
                Waking::Soon
            }
            Knock::Again | Knock::NotYet => Waking::Soon,
            Knock::NotAsleep => Waking::No,
        }
    }
}

/// One VM of this node as the poller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guest {
    /// The ImpVM's namespace.
    pub namespace: String,
    /// The ImpVM's name.
    pub name: String,
    /// The VM's uid (its record's name).
    pub uid: String,
    /// The host socket of its guest channel.
    pub vsock: std::path::PathBuf,
    /// The guest agent's port.
    pub agent_port: u32,
    /// Whether its guest runs now and may be asked (not sleeping, suspending or ended).
    pub running: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_exec_holds_off_an_idle_suspend_and_a_suspend_holds_off_new_execs() {
        let mut u = Uses::default();
        let vm = key("ns", "vm");
        assert!(u.exec_begin(vm.clone()));
        assert!(u.exec_begin(vm.clone()));
        assert!(u.busy(&vm));
        assert!(!u.suspend_begin(vm.clone(), false), "an exec is open");
        u.exec_end(&vm);
        assert!(u.busy(&vm), "one exec is still open");
        u.exec_end(&vm);
        assert!(!u.busy(&vm));
        assert!(u.0.is_empty(), "nothing is kept for an idle VM");
        assert!(u.suspend_begin(vm.clone(), false));
        assert!(u.suspending(&vm));
        assert!(!u.exec_begin(vm.clone()), "a suspend has begun");
        u.exec_end(&vm);
        assert!(u.suspending(&vm), "an exec that never began ends nothing");
        u.suspend_over(&vm);
        assert!(u.exec_begin(vm.clone()));
        // The user's suspend goes ahead despite the exec, and an exec's end leaves it be.
        assert!(u.suspend_begin(vm.clone(), true));
        u.exec_end(&vm);
        assert!(u.suspending(&vm));
        u.suspend_over(&vm);
        assert!(!u.suspending(&vm) && !u.busy(&vm));
    }

    #[test]
    fn a_record_a_reconcile_read_is_what_exec_finds_before_the_next_refresh() {
        let vms = NodeVms::default();
        let mut r = crate::node::decide::tests::record(VmStatus::Starting, 0);
        vms.refresh(&[(r.clone(), true)]);
        assert!(!vms.find("ns", "vm").unwrap().running);
        r.status = VmStatus::Running;
        vms.observe(&r, true);
        assert!(vms.find("ns", "vm").unwrap().running);
        vms.observe(&r, false);
        assert!(
            !vms.find("ns", "vm").unwrap().running,
            "a dead shim runs nothing"
        );
    }
}
