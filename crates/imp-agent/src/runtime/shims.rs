//! The node agent's async handle on this machine's shims: every call the reconciler makes on a
//! VM's shim (list, observe, start, stop, fail, remove, suspend, resume, claim) as an `async fn` that
//! runs the blocking file and process work of [`super::control`] on tokio's blocking pool, so
//! no caller wraps `spawn_blocking` itself, and that keeps the VMM-specific choices (which
//! VMM reopens its TAP by name on a restore) behind [`super::spec::reopens_tap_by_name`].

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use super::control::suspend::{self, SuspendError};
use super::control::{self, ShimCommand, ShimError};
use super::spec::VmSpec;
use super::state::{StateDir, StateError, VmRecord};

/// Why a call on a shim failed.
#[derive(Debug, thiserror::Error)]
pub enum ShimsError {
    /// The VM's files could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// The shim could not be started, signalled or stopped.
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// A suspend or resume was refused or failed.
    #[error(transparent)]
    Suspend(#[from] SuspendError),
    /// A private file for the shim could not be written.
    #[error("writing {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A moved VM's files could not be made its own.
    #[error(transparent)]
    TakeIn(super::moved::TakeInError),
    /// The blocking work itself ended abnormally (it panicked or the runtime shut down).
    #[error("{what} of VM {id} did not finish")]
    Task {
        /// What was being done.
        what: &'static str,
        /// The VM.
        id: String,
        /// The cause.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// A file written, readable by its owner only, before a shim starts (the VM's registry
/// credentials).
#[derive(Debug, Clone)]
pub struct PrivateFile {
    /// Where, inside the VM's directory.
    pub path: PathBuf,
    /// What.
    pub content: Vec<u8>,
}

/// This machine's shims, as the reconciler reaches them.
#[derive(Debug, Clone)]
pub struct Shims {
    state: StateDir,
    cmd: ShimCommand,
}

impl Shims {
    /// Shims of VMs under `state`, started as `cmd`.
    pub fn new(state: StateDir, cmd: ShimCommand) -> Self {
        Self { state, cmd }
    }

    /// The state directory the VMs live in.
    pub fn state(&self) -> &StateDir {
        &self.state
    }

    /// Every VM's record and whether its shim lives.
    pub async fn list(&self) -> Result<Vec<(VmRecord, bool)>, ShimsError> {
        let state = self.state.clone();
        let listed = blocking("listing", "*", move || {
            state.list().map(|(records, _)| {
                records
                    .into_iter()
                    .map(|r| {
                        let alive = r.supervisor_alive();
                        (r, alive)
                    })
                    .collect()
            })
        })
        .await?;
        Ok(listed?)
    }

    /// VM `id`'s record and whether its shim lives; `None` without a record. A record that
    /// cannot be read is an error, never taken for a lost VM. Liveness is checked before the
    /// record is trusted: a shim seen dead is read again, since it writes the VM's end just
    /// before it exits.
    pub async fn observe(&self, id: &str) -> Result<Option<(VmRecord, bool)>, ShimsError> {
        let (state, owned) = (self.state.clone(), id.to_owned());
        let read = blocking("reading the record", id, move || {
            let load = || match state.load(&owned) {
                Ok(r) => Ok(Some(r)),
                Err(StateError::NoSuchVm(_)) => Ok(None),
                Err(e) => Err(e),
            };
            let Some(first) = load()? else {
                return Ok(None);
            };
            if first.supervisor_alive() {
                return Ok(Some((first, true)));
            }
            Ok(load()?.map(|r| (r, false)))
        })
        .await?;
        read.map_err(ShimsError::State)
    }

    /// The record of the ImpVM of uid `uid` and whether its shim lives: `vms/<uid>` when that
    /// VM owns it, else `vms/<handed>` when a claim handed that VM to it (a warm pool's
    /// claimant: `handed` is its member's uid). A record in `vms/<uid>` that a claim handed to
    /// another VM is not this VM's.
    pub async fn observe_owned(
        &self,
        uid: &str,
        handed: Option<&str>,
    ) -> Result<Option<(VmRecord, bool)>, ShimsError> {
        let owned_by = |r: &VmRecord| r.owner.as_ref().is_none_or(|o| o.uid == uid);
        for id in std::iter::once(uid).chain(handed.filter(|h| *h != uid)) {
            if let Some((r, alive)) = self.observe(id).await?
                && owned_by(&r)
            {
                return Ok(Some((r, alive)));
            }
        }
        Ok(None)
    }

    /// Writes VM `id`'s spec (a claim's: its new owner, hostname and network), atomically.
    pub async fn write_spec(&self, id: &str, spec: VmSpec) -> Result<(), ShimsError> {
        let path = self.state.vm_dir(id).join(super::spec::SPEC_FILE);
        blocking("writing the spec", id, move || {
            super::state::write_json(&path, &spec)
        })
        .await?
        .map_err(ShimsError::State)
    }

    /// Asks the shim of VM `id` to hand the running VM over as `req` says (a warm pool's
    /// claim), waiting up to `limit`; `Ok(None)` when its shim has no API to ask.
    pub async fn claim(
        &self,
        id: &str,
        req: super::shim_api::ClaimRequest,
        limit: Duration,
    ) -> Result<Option<super::shim_api::ClaimOutcome>, super::shim_api::WireError> {
        control::client::claim(&self.state.vm_dir(id), req, limit).await
    }

    /// Asks the shim of VM `id` to pause its running VM (a warm pool's member waiting for a
    /// claim), waiting up to `limit`; `false` when its shim has no API to ask.
    pub async fn pause(
        &self,
        id: &str,
        limit: Duration,
    ) -> Result<bool, super::shim_api::WireError> {
        control::client::pause(&self.state.vm_dir(id), limit).await
    }

    /// VM `id`'s spec, if it has a readable one.
    pub async fn spec(&self, id: &str) -> Option<VmSpec> {
        let (state, owned) = (self.state.clone(), id.to_owned());
        blocking("reading the spec", id, move || {
            control::read_spec(&state, &owned).ok()
        })
        .await
        .ok()
        .flatten()
    }

    /// Starts VM `id`'s shim on `spec`, after writing `private` into its new directory;
    /// returns the shim's pid. A directory left by a start cut short (no record, nothing
    /// running) is removed first; a start that fails leaves no directory.
    pub async fn start(
        &self,
        id: &str,
        spec: VmSpec,
        private: Option<PrivateFile>,
    ) -> Result<u32, ShimsError> {
        let (state, cmd, owned) = (self.state.clone(), self.cmd.clone(), id.to_owned());
        blocking("starting the shim", id, move || {
            state.remove(&owned)?;
            state.create_vm_dir(&owned)?;
            let launched = (|| {
                if let Some(f) = private {
                    write_private(&f).map_err(|source| ShimsError::Write {
                        path: f.path.clone(),
                        source,
                    })?;
                }
                Ok(control::start(&cmd, &state, &owned, &spec)?)
            })();
            if launched.is_err() {
                let _ = state.remove(&owned);
            }
            launched
        })
        .await?
    }

    /// Stops the VM of `record` gracefully within `grace`; a shim that does not end in time
    /// is killed, and the graceful stop's error returned for the caller to say.
    pub async fn stop(&self, record: &VmRecord, grace: Duration) -> Result<(), ShimsError> {
        match control::stop(&self.state, record, grace).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = control::signal(record, nix::sys::signal::Signal::SIGKILL);
                Err(e.into())
            }
        }
    }

    /// Stops the VM of `record` as failed for `why` (a probe's verdict).
    pub async fn fail(
        &self,
        record: &VmRecord,
        grace: Duration,
        why: &str,
    ) -> Result<(), ShimsError> {
        Ok(control::fail(&self.state, record, grace, why).await?)
    }

    /// Removes VM `id`'s cgroup (killing what is left in it) and directory; without a cgroup,
    /// the VMM and helpers `record` names are killed first, if they outlived their shim.
    pub async fn remove(&self, id: &str, record: Option<&VmRecord>) -> Result<(), ShimsError> {
        let cgroup = self.spec(id).await.and_then(|s| s.cgroup.map(|c| c.path));
        if cgroup.is_none()
            && let Some(r) = record
        {
            control::kill_orphans(&self.state, r);
        }
        Ok(control::remove(&self.state, id, cgroup.as_deref()).await?)
    }

    /// Removes what interrupted removals left in the state directory's trash.
    pub async fn sweep_trash(&self) {
        let state = self.state.clone();
        let _ = blocking("sweeping the trash", "*", move || state.sweep_trash()).await;
    }

    /// Asks the shim of `record` to suspend its VM; the request's token.
    pub async fn suspend(&self, record: VmRecord) -> Result<String, ShimsError> {
        suspend::request_suspend(&self.state, &record)
            .await
            .map_err(ShimsError::Suspend)
    }

    /// Makes the files a move sent here (`received`) VM `id`'s, suspended, to be resumed
    /// ([`super::moved::take_in`]).
    pub async fn take_in(
        &self,
        id: &str,
        spec: VmSpec,
        record: VmRecord,
        received: &std::path::Path,
    ) -> Result<(), ShimsError> {
        let (state, owned, received) = (self.state.clone(), id.to_owned(), received.to_path_buf());
        blocking("taking in a moved VM", id, move || {
            super::moved::take_in(&state, &owned, &spec, record, &received)
        })
        .await?
        .map_err(ShimsError::TakeIn)
    }

    /// Starts a shim that restores the suspended VM of `record`, handing it `tap` (held while
    /// the VM slept); the new shim's pid.
    pub async fn resume(&self, record: VmRecord, tap: Option<OwnedFd>) -> Result<u32, ShimsError> {
        let (state, cmd) = (self.state.clone(), self.cmd.clone());
        let id = record.name.clone();
        blocking("resuming", &id, move || {
            suspend::start_resume(&cmd, &state, &record, tap.as_ref())
        })
        .await?
        .map_err(ShimsError::Suspend)
    }
}

/// Runs `f` on the blocking pool; `what` and `id` name it if it ends abnormally.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    id: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ShimsError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|source| ShimsError::Task {
            what,
            id: id.to_owned(),
            source,
        })
}

/// Writes `f` readable by its owner only, failing if it exists, and syncs it.
fn write_private(f: &PrivateFile) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&f.path)?;
    file.write_all(&f.content)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn scratch(tag: &str) -> (PathBuf, Shims) {
        let root = std::env::temp_dir().join(format!("imp-shims-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let state = StateDir::new(root.clone());
        let cmd = ShimCommand {
            exe: PathBuf::from("/nonexistent/imp"),
            args: Vec::new(),
        };
        (root, Shims::new(state, cmd))
    }

    #[tokio::test]
    async fn a_vm_without_a_record_is_none_and_a_failed_start_leaves_no_directory() {
        let (root, shims) = scratch("start");
        assert!(shims.observe("vm1").await.unwrap().is_none());
        assert!(shims.spec("vm1").await.is_none());
        let spec: VmSpec = serde_json::from_value(serde_json::json!({
            "image": "i", "hostname": "h", "vcpus": 1, "memory_mib": 128, "disk_gib": 1,
            "runtime": "qemu", "boot_timeout_ms": 1000,
            "boot": {"kernel": "/k", "modules": "/m", "guest": "/g"}
        }))
        .unwrap();
        let secret = PrivateFile {
            path: shims.state().vm_dir("vm1").join("auth.json"),
            content: b"{}".to_vec(),
        };
        let err = shims.start("vm1", spec, Some(secret)).await.unwrap_err();
        assert!(
            matches!(err, ShimsError::Shim(ShimError::Spawn { .. })),
            "{err}"
        );
        assert!(
            !shims.state().vm_dir("vm1").exists(),
            "a failed start left its directory (and the credentials in it)"
        );
        assert!(shims.list().await.unwrap().is_empty());
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn a_claimed_record_is_its_new_owners_and_no_longer_its_directorys() {
        let (root, shims) = scratch("owned");
        let owner = |name: &str, uid: &str| crate::runtime::state::Owner {
            namespace: "ci".into(),
            name: name.into(),
            uid: uid.into(),
            attempt: 0,
            revision: 0,
        };
        let mut record =
            crate::runtime::state::sample_record(super::super::state::VmStatus::Running);
        record.name = "member-uid".into();
        record.owner = Some(owner("py-x7k2p", "member-uid"));
        shims.state().create_vm_dir("member-uid").unwrap();
        shims.state().save(&record).unwrap();
        let mine = |r: Option<(VmRecord, bool)>| r.map(|(r, _)| r.name);
        assert_eq!(
            mine(shims.observe_owned("member-uid", None).await.unwrap()).as_deref(),
            Some("member-uid")
        );
        assert!(
            shims
                .observe_owned("job-uid", Some("member-uid"))
                .await
                .unwrap()
                .is_none()
        );
        // Handed over: the claimant finds it (given its member's uid), the member no longer does.
        record.owner = Some(owner("job", "job-uid"));
        shims.state().save(&record).unwrap();
        assert!(
            shims
                .observe_owned("member-uid", None)
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            shims
                .observe_owned("job-uid", None)
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(
            mine(
                shims
                    .observe_owned("job-uid", Some("member-uid"))
                    .await
                    .unwrap()
            )
            .as_deref(),
            Some("member-uid")
        );
        let _ = std::fs::remove_dir_all(root);
    }
}
