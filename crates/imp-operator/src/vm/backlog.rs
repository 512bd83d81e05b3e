//! The reconcile backlog: objects a watch asked a controller to reconcile whose reconcile has
//! not started yet, for the `imp_operator_reconcile_backlog` gauge.
//!
//! kube-runtime's `Controller` keeps its queue to itself, so the operator counts what it can
//! see: every trigger imp's watches hand the controller (an object's own change, or a change of
//! an object it depends on, mapped to it) marks the object waiting, and the start of its
//! reconcile clears the mark. Triggers for one object merge, as they do in the controller's own
//! queue; a trigger that arrives while the object's reconcile runs marks it again (the
//! controller runs it once more afterwards). Timed requeues are not counted: nothing shows when
//! they come due. An object deleted before its reconcile never starts one, so marks of objects
//! no longer in the cache are dropped ([`Backlog::retain`]).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::metrics::Metrics;

/// The objects (`namespace/name`) waiting for their reconcile to start.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Backlog {
    waiting: BTreeSet<String>,
}

impl Backlog {
    /// A watch asked for a reconcile of `key`.
    pub fn triggered(&mut self, key: &str) {
        self.waiting.insert(key.to_owned());
    }

    /// The reconcile of `key` has started.
    pub fn started(&mut self, key: &str) {
        self.waiting.remove(key);
    }

    /// Keeps only the objects for which `exists` holds (the others will never be reconciled).
    pub fn retain(&mut self, exists: impl Fn(&str) -> bool) {
        self.waiting.retain(|k| exists(k));
    }

    /// How many objects wait.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// A [`Backlog`] shared by a controller's watches and reconciles, mirrored into its gauge.
#[derive(Debug)]
pub struct Tracker {
    controller: &'static str,
    backlog: Mutex<Backlog>,
    metrics: Option<Arc<Metrics>>,
}

impl Tracker {
    /// The backlog of `controller`, published to `metrics` when given.
    pub fn new(controller: &'static str, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            controller,
            backlog: Mutex::new(Backlog::default()),
            metrics,
        }
    }

    fn update(&self, f: impl FnOnce(&mut Backlog)) {
        let mut b = self.lock();
        f(&mut b);
        if let Some(m) = &self.metrics {
            m.set_backlog(self.controller, b.len());
        }
    }

    fn lock(&self) -> MutexGuard<'_, Backlog> {
        self.backlog
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// See [`Backlog::triggered`].
    pub fn triggered(&self, key: &str) {
        self.update(|b| b.triggered(key));
    }

    /// See [`Backlog::started`].
    pub fn started(&self, key: &str) {
        self.update(|b| b.started(key));
    }

    /// See [`Backlog::retain`].
    pub fn retain(&self, exists: impl Fn(&str) -> bool) {
        self.update(|b| b.retain(exists));
    }

    /// How many objects wait now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn triggers_merge_per_object_until_its_reconcile_starts() {
        let mut b = Backlog::default();
        assert!(b.is_empty());
        b.triggered("ns/a");
        b.triggered("ns/a");
        b.triggered("ns/b");
        assert_eq!(b.len(), 2, "one mark per object");
        b.started("ns/a");
        assert_eq!(b.len(), 1);
        // A change while a's reconcile runs: it waits again.
        b.triggered("ns/a");
        assert_eq!(b.len(), 2);
        b.started("ns/a");
        b.started("ns/b");
        assert!(b.is_empty());
        b.started("ns/never-triggered");
        assert!(b.is_empty());
    }

    #[test]
    fn objects_gone_from_the_cache_stop_waiting() {
        let mut b = Backlog::default();
        b.triggered("ns/kept");
        b.triggered("ns/deleted");
        b.retain(|k| k == "ns/kept");
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn the_tracker_publishes_its_length() {
        let m = Arc::new(Metrics::new());
        let t = Tracker::new("impvm", Some(m.clone()));
        let gauge = |m: &Metrics| {
            m.encode()
                .unwrap()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("imp_operator_reconcile_backlog{controller=\"impvm\"} ")
                })
                .map(str::to_owned)
        };
        t.triggered("ns/a");
        t.triggered("ns/b");
        assert_eq!(gauge(&m).as_deref(), Some("2"));
        t.started("ns/a");
        t.retain(|_| false);
        assert!(t.is_empty());
        assert_eq!(gauge(&m).as_deref(), Some("0"));
    }
}
