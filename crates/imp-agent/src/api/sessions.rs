//! How many exec and console sessions may be open at once, per VM and per caller: one user (or
//! one runaway script) cannot hold every relay of the node, nor every stream of one VM.
//!
//! A session is counted from the moment its request is authorized and its VM found until its
//! relay or stream ends (an exec that waits for a sleeping VM to wake counts while it waits).
//! Over either limit the request is answered 429 with a message naming the limit and its flag.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The default most sessions open at once into one VM.
pub const DEFAULT_PER_VM: usize = 16;

/// The default most sessions one caller has open at once on this node.
pub const DEFAULT_PER_CALLER: usize = 8;

/// The limits; zero means no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Sessions into one VM (`--api-max-sessions-per-vm`).
    pub per_vm: usize,
    /// Sessions of one caller, on all the node's VMs (`--api-max-sessions-per-caller`).
    pub per_caller: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            per_vm: DEFAULT_PER_VM,
            per_caller: DEFAULT_PER_CALLER,
        }
    }
}

/// Why a session may not open now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The VM has as many sessions as it may.
    #[error(
        "ImpVM {vm} already has {limit} exec and console sessions open, the most this agent \
         allows per VM (--api-max-sessions-per-vm); try again once one has ended"
    )]
    Vm {
        /// The VM, `namespace/name`.
        vm: String,
        /// The limit.
        limit: usize,
    },
    /// The caller has as many sessions as it may.
    #[error(
        "User {user:?} already has {limit} exec and console sessions open on this node, the \
         most this agent allows per caller (--api-max-sessions-per-caller); try again once one \
         has ended"
    )]
    Caller {
        /// The authenticated user name.
        user: String,
        /// The limit.
        limit: usize,
    },
}

#[derive(Debug, Default)]
struct Open {
    vms: HashMap<String, usize>,
    callers: HashMap<String, usize>,
}

/// The open sessions, counted per VM and per caller.
#[derive(Debug)]
pub struct Sessions {
    limits: SessionLimits,
    open: Mutex<Open>,
}

impl Sessions {
    /// No session open yet.
    pub fn new(limits: SessionLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            open: Mutex::default(),
        })
    }

    /// Opens a session of `caller` into `vm` (`namespace/name`), or says which limit it is
    /// over; it stays counted until the returned [`Session`] is dropped.
    pub fn open(self: &Arc<Self>, vm: &str, caller: &str) -> Result<Session, Refusal> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let on_vm = open.vms.get(vm).copied().unwrap_or(0);
        let of_caller = open.callers.get(caller).copied().unwrap_or(0);
        let full = |n: usize, limit: usize| limit > 0 && n >= limit;
        if full(on_vm, self.limits.per_vm) {
            return Err(Refusal::Vm {
                vm: vm.to_owned(),
                limit: self.limits.per_vm,
            });
        }
        if full(of_caller, self.limits.per_caller) {
            return Err(Refusal::Caller {
                user: caller.to_owned(),
                limit: self.limits.per_caller,
            });
        }
        *open.vms.entry(vm.to_owned()).or_default() += 1;
        *open.callers.entry(caller.to_owned()).or_default() += 1;
        Ok(Session {
            sessions: self.clone(),
            vm: vm.to_owned(),
            caller: caller.to_owned(),
        })
    }

    /// Sessions open now into `vm` and of `caller`.
    pub fn counts(&self, vm: &str, caller: &str) -> (usize, usize) {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        (
            open.vms.get(vm).copied().unwrap_or(0),
            open.callers.get(caller).copied().unwrap_or(0),
        )
    }

    fn close(&self, vm: &str, caller: &str) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let Open { vms, callers } = &mut *open;
        for (map, key) in [(vms, vm), (callers, caller)] {
            if let Some(n) = map.get_mut(key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(key);
                }
            }
        }
    }
}

/// One open session; dropping it closes it.
#[derive(Debug)]
pub struct Session {
    sessions: Arc<Sessions>,
    vm: String,
    caller: String,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.sessions.close(&self.vm, &self.caller);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn each_limit_refuses_the_session_over_it_and_a_closed_one_frees_its_place() {
        let s = Sessions::new(SessionLimits {
            per_vm: 2,
            per_caller: 3,
        });
        let a1 = s.open("ns/a", "alice").unwrap();
        let a2 = s.open("ns/a", "bob").unwrap();
        assert_eq!(
            s.open("ns/a", "carol").unwrap_err(),
            Refusal::Vm {
                vm: "ns/a".into(),
                limit: 2
            }
        );
        let b1 = s.open("ns/b", "alice").unwrap();
        let c1 = s.open("ns/c", "alice").unwrap();
        let e = s.open("ns/d", "alice").unwrap_err();
        assert_eq!(
            e,
            Refusal::Caller {
                user: "alice".into(),
                limit: 3
            }
        );
        assert!(
            e.to_string().contains("--api-max-sessions-per-caller"),
            "{e}"
        );
        assert_eq!(s.counts("ns/a", "alice"), (2, 3));
        // The refusals counted nothing.
        assert_eq!(s.counts("ns/d", "carol"), (0, 0));
        drop(a1);
        assert_eq!(s.counts("ns/a", "alice"), (1, 2));
        let a3 = s.open("ns/a", "alice").unwrap();
        drop((a2, a3, b1, c1));
        assert_eq!(s.counts("ns/a", "alice"), (0, 0));
        assert!(s.open.lock().unwrap().vms.is_empty(), "no entry is kept");
        assert!(s.open.lock().unwrap().callers.is_empty());
    }

    #[test]
    fn a_limit_of_zero_is_no_limit() {
        let s = Sessions::new(SessionLimits {
            per_vm: 0,
            per_caller: 0,
        });
        let many: Vec<_> = (0..100).map(|_| s.open("ns/a", "alice").unwrap()).collect();
        assert_eq!(s.counts("ns/a", "alice"), (100, 100));
        drop(many);
        assert_eq!(s.counts("ns/a", "alice"), (0, 0));
    }

    #[test]
    fn the_vm_limit_is_checked_first_and_names_the_vm_and_flag() {
        let s = Sessions::new(SessionLimits {
            per_vm: 1,
            per_caller: 1,
        });
        let _held = s.open("ns/a", "alice").unwrap();
        let e = s.open("ns/a", "alice").unwrap_err();
        assert!(matches!(e, Refusal::Vm { .. }));
        let msg = e.to_string();
        assert!(
            msg.contains("ImpVM ns/a") && msg.contains("--api-max-sessions-per-vm"),
            "{msg}"
        );
    }
}
