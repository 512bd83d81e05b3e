//! The reconciler follows each live shim over its typed API
//! ([`crate::runtime::control::client::watch`]): every change of a VM's record (started, guest
//! ready, exited, suspended, resumed) asks for that VM's reconcile the moment the shim saves
//! it, so no timed poll stands between a VM's change and its status. A shim is followed from
//! its start or resume, and again after an agent restart when the record poller finds it
//! alive. A shim of a release before the API has no socket: its changes reach the reconciler
//! through the poller, as before.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use imp_api::vm::ImpVM;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use super::Context;
use crate::runtime::control::client;

/// The shims followed, by VM id: the pid of the shim each follower watches.
#[derive(Debug, Default)]
pub(super) struct Followed(Mutex<HashMap<String, u32>>);

impl Followed {
    /// Marks the shim `pid` of VM `id` followed; false when it already was.
    fn claim(&self, id: &str, pid: u32) -> bool {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Asked at every poll for every live shim: no allocation when nothing changes.
        if map.get(id) == Some(&pid) {
            return false;
        }
        map.insert(id.to_owned(), pid);
        true
    }

    /// Forgets the VMs not in `ids`.
    pub(super) fn retain(&self, ids: &[&str]) {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.retain(|id, _| ids.contains(&id.as_str()));
    }
}

impl Context {
    /// Follows the shim `pid` of VM `id` (the ImpVM `vm`), unless it already is.
    pub(super) fn follow(&self, id: &str, pid: u32, vm: ObjectRef<ImpVM>) {
        let Some(tx) = self.reconcile_tx.get().cloned() else {
            return;
        };
        if !self.followed.claim(id, pid) {
            return;
        }
        let dir = self.shims.state().vm_dir(id);
        let (id, node) = (id.to_owned(), self.settings.node.clone());
        tokio::spawn(async move {
            if let Err(e) = relay(&dir, &tx, &vm).await {
                tracing::warn!(vm = %vm, uid = %id, node, error = %imp_api::chain::DisplayChain(&e), "following the shim's events failed; its record is polled instead");
            }
        });
    }
}

/// Asks for the reconcile of the record's owner (first `vm`) at every change its shim
/// announces, and once more when the shim ends. A VM without the API's socket returns at once.
async fn relay(
    dir: &Path,
    tx: &mpsc::Sender<ObjectRef<ImpVM>>,
    vm: &ObjectRef<ImpVM>,
) -> Result<(), crate::runtime::shim_api::WireError> {
    let Some(mut watch) = client::watch(dir).await? else {
        return Ok(());
    };
    let mut vm = vm.clone();
    loop {
        let event = watch.next().await;
        if let Ok(Some(e)) = &event {
            // The record's owner: a warm pool's claim hands the VM to another ImpVM.
            if let Some(o) = &e.record.owner {
                vm = ObjectRef::new(&o.name).within(&o.namespace);
            }
            tracing::debug!(vm = %vm, seq = e.seq, status = ?e.record.status, "shim event");
        }
        if tx.send(vm.clone()).await.is_err() {
            return Ok(());
        }
        match event {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shim_is_followed_once_and_its_successor_again() {
        let f = Followed::default();
        assert!(f.claim("vm1", 10));
        assert!(!f.claim("vm1", 10), "the same shim followed twice");
        assert!(f.claim("vm1", 11), "a resumed VM's new shim not followed");
        f.retain(&[]);
        assert!(f.claim("vm1", 11), "a forgotten VM not followed again");
    }
}
