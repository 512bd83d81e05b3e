//! The on-disk records of the VMs this machine runs, so that any process (`imp ps`, `imp exec`,
//! a restarted `imp agent`) can find them again: nothing a VM needs lives only in memory.
//!
//! Layout under a state directory (`/var/lib/imp/local` for `imp run` as root, else
//! `$XDG_STATE_HOME/imp` or `~/.local/state/imp`; `/var/lib/imp/agent` for `imp agent`):
//! `cache/` holds pulled blobs, base root filesystems and initramfs bases, shared by all VMs;
//! `vms/<id>/` holds one VM: `spec.json` (what to boot, [`super::spec::VmSpec`]), `vm.json`
//! (this module's [`VmRecord`], written by the VM's shim), its own disk, its initramfs, the VMM's
//! sockets, the serial log and the shim's log. A VM directory is removed by `--rm`, `imp rm` or
//! the agent's cleanup; nothing else deletes it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The record file's name inside a VM directory.
/// A VM's record in its directory.
pub const RECORD_FILE: &str = "vm.json";
const RECORD: &str = RECORD_FILE;

/// Failures of reading and writing VM records.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file or directory operation failed.
    #[error("{action} {}", path.display())]
    Io {
        /// What was being done ("reading", "creating" …).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A record or spec file is not valid JSON of the expected shape.
    #[error("parsing {}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// No VM directory or record of that name exists.
    #[error("no VM named {0:?} (see `imp ps -a`)")]
    NoSuchVm(String),
    /// A VM of that name already exists.
    #[error("a VM named {name:?} already exists ({}); pick another --name or run `imp rm {name}`", dir.display())]
    NameTaken {
        /// The name.
        name: String,
        /// Its directory.
        dir: PathBuf,
    },
    /// The name is not a DNS label.
    #[error(
        "VM name {0:?} is invalid: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
    )]
    InvalidName(String),
    /// Neither a flag, IMP_STATE_DIR nor HOME says where state lives.
    #[error("cannot choose a state directory: set IMP_STATE_DIR or HOME")]
    NoStateDir,
    /// No free generated name was found.
    #[error("could not find a free VM name under {}", .0.display())]
    NoFreeName(PathBuf),
    /// Every VMM uid is claimed.
    #[error("every VMM uid is claimed under {}", .0.display())]
    NoFreeUid(PathBuf),
    /// The uid a VM kept is claimed by another VM of the host.
    #[error(
        "VMM uid {uid} of VM {id} is claimed by another VM ({owner}); its VMM is not started as a uid another VMM has"
    )]
    UidTaken {
        /// The uid.
        uid: u32,
        /// The VM that kept it.
        id: String,
        /// The claim's owner (a VM directory).
        owner: String,
    },
}

/// This module's result type.
pub type Result<T, E = StateError> = std::result::Result<T, E>;

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StateError {
    let path = path.to_path_buf();
    move |source| StateError::Io {
        action,
        path,
        source,
    }
}

/// The first uid a confined VMM runs as (far above any login or container range).
pub const VMM_UID_BASE: u32 = 200_000_000;
/// How many VMM uids there are on one node.
pub const VMM_UIDS: u32 = 1_000_000;
/// The file in a VM's directory that keeps its VMM's uid.
const VMM_UID_FILE: &str = "vmm-uid";
/// The host-wide record of claimed VMM uids that `imp agent` and `imp run` (as root) share,
/// so two of imp's VMMs on one host never run as one uid, whichever state directory their VMs
/// live in.
pub const HOST_VMM_UID_DIR: &str = "/var/lib/imp/vmm-uids";
/// The variable that moves [`HOST_VMM_UID_DIR`] (for `imp run`; `imp agent` has a flag).
pub const VMM_UID_DIR_ENV: &str = "IMP_VMM_UID_DIR";

/// Where VMs and the image cache live.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
    /// Where VMM uids are claimed (`None`: `vmm-uids/` of the root, for this directory's VMs
    /// alone).
    vmm_uids: Option<PathBuf>,
    /// Where saves are announced (a shim's watchers, [`RecordFeed`]).
    feed: Option<RecordFeed>,
}

/// A shim's record as its typed API's watchers see it: every [`StateDir::save`] through a
/// directory given the feed ([`StateDir::announcing`]) replaces it and counts one change.
#[derive(Debug, Clone)]
pub struct RecordFeed(std::sync::Arc<tokio::sync::watch::Sender<(u64, VmRecord)>>);

impl RecordFeed {
    /// A feed whose first state is `record`, change 0.
    pub fn new(record: VmRecord) -> Self {
        Self(std::sync::Arc::new(tokio::sync::watch::Sender::new((
            0, record,
        ))))
    }

    /// A watcher, seeing the current state first.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<(u64, VmRecord)> {
        self.0.subscribe()
    }

    /// Announces `record` as the next change.
    pub fn announce(&self, record: &VmRecord) {
        self.0.send_modify(|(seq, r)| {
            *seq += 1;
            r.clone_from(record);
        });
    }
}

impl StateDir {
    /// A state directory at `root`, claiming VMM uids in `root` alone (see
    /// [`Self::with_vmm_uid_dir`]).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            vmm_uids: None,
            feed: None,
        }
    }

    /// The same directory, announcing every record it saves on `feed` (a shim's own).
    pub fn announcing(mut self, feed: RecordFeed) -> Self {
        self.feed = Some(feed);
        self
    }

    /// The same directory, claiming VMM uids in `dir`, a record shared with every other
    /// front end of the host ([`HOST_VMM_UID_DIR`]).
    pub fn with_vmm_uid_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.vmm_uids = Some(dir.into());
        self
    }

    /// Where this directory's VMs claim their VMM uids.
    pub fn vmm_uid_dir(&self) -> PathBuf {
        self.vmm_uids
            .clone()
            .unwrap_or_else(|| self.root.join("vmm-uids"))
    }

    /// Picks the local state directory from `--state-dir`, `IMP_STATE_DIR`, or the user's
    /// defaults.
    pub fn resolve(flag: Option<PathBuf>) -> Result<Self> {
        let root = match flag.or_else(|| std::env::var_os("IMP_STATE_DIR").map(PathBuf::from)) {
            Some(dir) => dir,
            None if nix::unistd::geteuid().is_root() => PathBuf::from("/var/lib/imp/local"),
            None => match std::env::var_os("XDG_STATE_HOME") {
                Some(state) => PathBuf::from(state).join("imp"),
                None => match std::env::var_os("HOME") {
                    Some(home) => PathBuf::from(home).join(".local/state/imp"),
                    None => return Err(StateError::NoStateDir),
                },
            },
        };
        // As root its VMMs run as uids of their own, which the host's other front ends (the
        // agent, other state directories) must not hand out too.
        let vmm_uids = std::env::var_os(VMM_UID_DIR_ENV)
            .map(PathBuf::from)
            .or_else(|| {
                nix::unistd::geteuid()
                    .is_root()
                    .then(|| HOST_VMM_UID_DIR.into())
            });
        Ok(Self {
            root,
            vmm_uids,
            feed: None,
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The image cache shared by every VM.
    pub fn cache(&self) -> PathBuf {
        self.root.join("cache")
    }

    /// The directory of VM `id`.
    pub fn vm_dir(&self, id: &str) -> PathBuf {
        self.root.join("vms").join(id)
    }

    /// Where VM `id`'s suspend snapshot is written (removed with the VM).
    pub fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.root.join("snapshots").join(id)
    }

    /// Creates the directory of a new VM, refusing an id that is taken. It is made 0700 (and
    /// `vms/` too, when this makes it): its spec and initramfs hold the VM's resolved
    /// environment, Secrets included.
    pub fn create_vm_dir(&self, id: &str) -> Result<PathBuf> {
        validate_name(id)?;
        let dir = self.vm_dir(id);
        let vms = self.root.join("vms");
        crate::host_fs::create_private_dir_all(&vms).map_err(io("creating", &vms))?;
        match crate::host_fs::private_dir_builder(false).create(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(StateError::NameTaken {
                name: id.to_owned(),
                dir,
            }),
            Err(e) => Err(io("creating", &dir)(e)),
        }
    }

    /// Reads the record of VM `id`.
    pub fn load(&self, id: &str) -> Result<VmRecord> {
        validate_name(id)?;
        let path = self.vm_dir(id).join(RECORD);
        match read_json(&path) {
            Err(StateError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Err(StateError::NoSuchVm(id.to_owned()))
            }
            other => other,
        }
    }

    /// Writes `record` atomically (temp file, fsync, rename) so readers never see half of it.
    /// Announced on its feed, if it has one, once written.
    pub fn save(&self, record: &VmRecord) -> Result<()> {
        write_json(&self.vm_dir(&record.name).join(RECORD), record)?;
        if let Some(feed) = &self.feed {
            feed.announce(record);
        }
        Ok(())
    }

    /// Writes `record` only if the VM has no record yet (the shim's own first write wins);
    /// returns whether it was written. A VM directory already removed is not an error.
    pub fn save_new(&self, record: &VmRecord) -> Result<bool> {
        let path = self.vm_dir(&record.name).join(RECORD);
        let tmp = path.with_file_name(format!(".{RECORD}.{}.new", std::process::id()));
        match write_json(&tmp, record) {
            Err(StateError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(false);
            }
            r => r?,
        }
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(true),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::NotFound
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(io("linking into place", &path)(e)),
        }
    }

    /// Every VM with a readable record, sorted by name; unreadable ones are reported apart.
    pub fn list(&self) -> Result<Listing> {
        let vms = self.root.join("vms");
        let entries = match std::fs::read_dir(&vms) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
            Err(e) => return Err(io("listing", &vms)(e)),
        };
        let (mut good, mut bad) = (Vec::new(), Vec::new());
        for entry in entries {
            let entry = entry.map_err(io("listing", &vms))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue; // a directory on its way out (see `remove`)
            }
            match self.load(&name) {
                Ok(r) => good.push(r),
                Err(e) => bad.push((entry.path(), e)),
            }
        }
        good.sort_by(|a, b| a.name.cmp(&b.name));
        Ok((good, bad))
    }

    /// The images the VM records here name (any status: a stopped VM may start again), each
    /// as its chain of manifest digests (the image's, then its extra layers'), which the image
    /// cache keeps whatever its budget ([`imp_image::ImageStore::evict`]). Unreadable records
    /// are skipped.
    pub fn image_chains(&self) -> Result<std::collections::BTreeSet<Vec<String>>> {
        let (records, _unreadable) = self.list()?;
        Ok(records
            .into_iter()
            .filter_map(VmRecord::image_chain)
            .collect())
    }

    /// [`Self::image_chains`] off the async runtime; `None` (logged) when the records cannot
    /// be listed, and then nothing may be evicted.
    pub async fn images_in_use(&self) -> Option<std::collections::BTreeSet<Vec<String>>> {
        let state = self.clone();
        match tokio::task::spawn_blocking(move || state.image_chains()).await {
            Ok(Ok(d)) => Some(d),
            Ok(Err(e)) => {
                tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "listing the VMs' images; the image cache is not evicted now");
                None
            }
            Err(e) => {
                tracing::warn!(error = %imp_api::chain::DisplayChain(&e), "listing the VMs' images panicked");
                None
            }
        }
    }

    /// The uid (and gid: the same number) VM `id`'s confined VMM runs as. The one it was given
    /// before, kept in its directory (a restored VMM finds its disk and sockets its own); else
    /// the lowest free one from [`VMM_UID_BASE`]. Claimed with an exclusive create in
    /// [`Self::vmm_uid_dir`], a record every front end of the host shares, the claim naming the
    /// VM's directory: so two VMs never share one, whichever state directory holds them. A
    /// claim is taken back only by its own state directory, when its VM directory is gone
    /// without a removal. A kept uid whose claim is missing (kept before the record was
    /// shared) is claimed again, and refused if another VM holds it meanwhile. Released by
    /// [`Self::remove`].
    pub fn vmm_uid(&self, id: &str) -> Result<u32> {
        validate_name(id)?;
        let mine = self.vm_dir(id).join(VMM_UID_FILE);
        let claims = self.vmm_uid_dir();
        std::fs::create_dir_all(&claims).map_err(io("creating", &claims))?;
        // One claimant at a time, host-wide: taking back a gone VM's claim is then no race.
        let lock_path = claims.join(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io("opening", &lock_path))?;
        let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, errno)| io("locking", &lock_path)(std::io::Error::from(errno)))?;
        if let Ok(text) = std::fs::read_to_string(&mine)
            && let Ok(uid) = text.trim().parse::<u32>()
        {
            if self.claim_uid(&claims, uid, id)? {
                return Ok(uid);
            }
            let claim = claims.join(uid.to_string());
            let owner = read_claim(&claim);
            // The VM's VMM ran as this uid before (it resumes with its disk and sockets its
            // own): a claim naming a VM of a state directory that is gone (a removed one,
            // whose claims nobody takes back) holds no VMM, and is taken over.
            if state_root_gone(&owner) {
                std::fs::write(&claim, self.claim_owner(id)).map_err(io("writing", &claim))?;
                return Ok(uid);
            }
            return Err(StateError::UidTaken {
                uid,
                id: id.to_owned(),
                owner,
            });
        }
        for uid in VMM_UID_BASE..VMM_UID_BASE + VMM_UIDS {
            if self.legacy_claimed(uid, &claims, id) || !self.claim_uid(&claims, uid, id)? {
                continue;
            }
            std::fs::write(&mine, uid.to_string()).map_err(io("writing", &mine))?;
            return Ok(uid);
        }
        Err(StateError::NoFreeUid(claims))
    }

    /// The claim of VM `id` in the claims directory: what a claim file holds.
    fn claim_owner(&self, id: &str) -> String {
        self.vm_dir(id).display().to_string()
    }

    /// Claims `uid` in `claims` for VM `id`: `true` when the claim is (now) VM `id`'s, `false`
    /// when another VM holds it. A claim of this state directory whose VM directory is gone
    /// is taken over; another directory's claims are never touched.
    fn claim_uid(&self, claims: &Path, uid: u32, id: &str) -> Result<bool> {
        let claim = claims.join(uid.to_string());
        let me = self.claim_owner(id);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&claim)
        {
            Ok(mut f) => {
                std::io::Write::write_all(&mut f, me.as_bytes()).map_err(io("writing", &claim))?;
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let owner = read_claim(&claim);
                if owner == me {
                    return Ok(true);
                }
                match self.own_gone_vm(&owner, claims) {
                    true => {
                        std::fs::write(&claim, &me).map_err(io("writing", &claim))?;
                        Ok(true)
                    }
                    false => Ok(false),
                }
            }
            Err(e) => Err(io("creating", &claim)(e)),
        }
    }

    /// Whether `owner`, a claim in `claims`, is a VM of this state directory whose directory
    /// is gone. An empty owner (a claim being written) is nobody's to take; in a state
    /// directory's own claims (no shared record) a bare id names its VM (claims of old).
    fn own_gone_vm(&self, owner: &str, claims: &Path) -> bool {
        let bare_ids = claims == self.root.join("vmm-uids");
        self.own_claim(owner, bare_ids)
            .is_some_and(|id| !self.vm_dir(&id).exists())
    }

    /// The id of this state directory's VM that claim `owner` names: its VM directory, or
    /// (`bare_ids`, in the directory's own `vmm-uids/`) its id, as claims of old held.
    fn own_claim(&self, owner: &str, bare_ids: bool) -> Option<String> {
        let vms = self.root.join("vms");
        let id = match Path::new(owner).strip_prefix(&vms) {
            Ok(rest) => rest.to_str()?.to_owned(),
            Err(_) if bare_ids => owner.to_owned(),
            Err(_) => return None,
        };
        validate_name(&id).is_ok().then_some(id)
    }

    /// Whether `uid` is held by a claim in this state directory's own `vmm-uids/` (where
    /// claims were made before the host shared one record) by a VM other than `id` that still
    /// exists, while the shared record is used.
    fn legacy_claimed(&self, uid: u32, claims: &Path, id: &str) -> bool {
        let legacy = self.root.join("vmm-uids");
        if claims == legacy {
            return false;
        }
        let owner = read_claim(&legacy.join(uid.to_string()));
        self.own_claim(&owner, true)
            .is_some_and(|o| o != id && self.vm_dir(&o).exists())
    }

    /// Deletes VM `id`'s directory (disk, logs, record); a missing one is not an error. The
    /// directory is first renamed out of the VMs' namespace, so a removal cut short leaves
    /// trash ([`Self::sweep_trash`]) rather than a VM without a record.
    pub fn remove(&self, id: &str) -> Result<()> {
        validate_name(id)?;
        let dir = self.vm_dir(id);
        let trash = self
            .root
            .join("vms")
            .join(format!(".trash-{id}-{}", std::process::id()));
        if let Ok(uid) = std::fs::read_to_string(dir.join(VMM_UID_FILE)) {
            let legacy = self.root.join("vmm-uids");
            for claims in [self.vmm_uid_dir(), legacy.clone()] {
                let claim = claims.join(uid.trim());
                let owner = read_claim(&claim);
                if self.own_claim(&owner, claims == legacy).as_deref() == Some(id) {
                    let _ = std::fs::remove_file(&claim);
                }
            }
        }
        let snapshot = self.snapshot_dir(id);
        match std::fs::remove_dir_all(&snapshot) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("removing", &snapshot)(e));
            }
            _ => {}
        }
        match std::fs::rename(&dir, &trash) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io("moving aside", &dir)(e)),
            Ok(()) => {}
        }
        std::fs::remove_dir_all(&trash).map_err(io("removing", &trash))
    }

    /// Removes what interrupted removals left (`vms/.trash-*`).
    pub fn sweep_trash(&self) {
        let vms = self.root.join("vms");
        for entry in std::fs::read_dir(&vms).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(".trash-") {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

/// Whether claim `owner` names a VM directory (`ROOT/vms/ID`) whose state directory `ROOT` no
/// longer exists as this process sees it: nobody is left to take the claim back.
fn state_root_gone(owner: &str) -> bool {
    let path = Path::new(owner);
    match (path.parent(), path.parent().and_then(Path::parent)) {
        (Some(vms), Some(root))
            if path.is_absolute() && vms.file_name() == Some("vms".as_ref()) =>
        {
            !root.exists()
        }
        _ => false,
    }
}

/// The owner a claim file names (empty when missing or unreadable).
fn read_claim(claim: &Path) -> String {
    std::fs::read_to_string(claim)
        .map(|o| o.trim().to_owned())
        .unwrap_or_default()
}

/// Reads a JSON file into `T`.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = std::fs::read(path).map_err(io("reading", path))?;
    serde_json::from_slice(&bytes).map_err(|source| StateError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes `value` as JSON to `path` atomically (temp file beside it, fsync, rename).
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Per-process temp names: a starter and its shim may write the same record at once.
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| StateError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt as _;
        // Owner-only from its creation: a VM's spec holds its resolved environment.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io("creating", &tmp))?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(io("writing", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io("renaming into place", path))
}

/// Readable records, and the directories whose record could not be read (with why).
pub type Listing = (Vec<VmRecord>, Vec<(PathBuf, StateError)>);

/// What a VM is doing, as its shim last wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmStatus {
    /// Image pull, disk and VMM start are under way.
    Starting,
    /// The guest agent answered.
    Running,
    /// The workload ended (or the VM was stopped).
    Exited,
    /// The VM could not be started or died; `error` says why.
    Failed,
    /// The shim is pausing the VM and writing its snapshot.
    Suspending,
    /// The VM's memory and devices are in a snapshot under `snapshots/<id>/`; no process of
    /// the VM runs ([`VmRecord::suspend`] says where and since when).
    Suspended,
    /// A new shim is restoring the VM from its snapshot.
    Resuming,
}

impl VmStatus {
    /// Whether the VM has ended for good.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Exited | Self::Failed)
    }

    /// Whether the status is only true while the shim lives (a dead shim means the VM is lost).
    pub fn needs_shim(self) -> bool {
        matches!(
            self,
            Self::Starting | Self::Running | Self::Suspending | Self::Resuming
        )
    }

    /// The lower-case name `imp ps` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Exited => "exited",
            Self::Failed => "failed",
            Self::Suspending => "suspending",
            Self::Suspended => "suspended",
            Self::Resuming => "resuming",
        }
    }
}

/// The step of a VM's start a failure happened in; the agent maps it to a condition reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Reading the spec, finding binaries and the kernel.
    Config,
    /// Pulling the image.
    Image,
    /// Building the root filesystem or the VM's own disk.
    Disk,
    /// Building the guest initramfs.
    Initramfs,
    /// Starting the VMM.
    Boot,
    /// Waiting for the guest agent.
    GuestReady,
    /// While the VM ran (the VMM died, the shim was lost).
    Run,
    /// Restoring the VM from its suspend snapshot (missing, corrupt, or the guest did not
    /// answer after the restore).
    Resume,
    /// A liveness or startup probe failed its threshold and the node agent stopped the VM.
    Probe,
}

/// How long each step of a start took, in milliseconds (0: not reached or not measured).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    /// Image pull (or cache lookup).
    pub image_ms: u64,
    /// Base root filesystem and the VM's disk clone.
    pub disk_ms: u64,
    /// Initramfs and VMM start, until the VMM runs.
    pub boot_ms: u64,
    /// From the VMM's start until the guest agent answered.
    pub ready_ms: u64,
    /// The last suspend: pause, snapshot and VMM stop.
    #[serde(default)]
    pub suspend_ms: u64,
    /// The last resume: restore in a new VMM until the guest agent answered.
    #[serde(default)]
    pub resume_ms: u64,
}

/// Where a suspended VM's snapshot is and when it was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuspendRecord {
    /// The snapshot's directory (`snapshots/<id>/` of the state directory).
    pub snapshot_dir: PathBuf,
    /// When the snapshot was complete, seconds since the Unix epoch.
    pub suspended_unix: u64,
    /// When the VM's vCPUs were paused for it, milliseconds since the Unix epoch (a move's
    /// downtime starts there); absent in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_unix_ms: Option<u64>,
    /// The snapshot's size on disk in bytes.
    pub bytes: u64,
    /// The VMM that wrote it, `kind version` ([`imp_vmm::version`]); absent in records
    /// written before it was kept.
    #[serde(default)]
    pub vmm: Option<String>,
}

/// The outcome of the last suspend request that failed: the VM was resumed and runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuspendFailure {
    /// The request's token (written by the front end into the request file).
    pub request: String,
    /// When it failed, seconds since the Unix epoch.
    pub failed_unix: u64,
    /// Why, with its causes.
    pub error: String,
}

/// Which cluster object a VM belongs to (none for `imp run` VMs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The ImpVM's namespace.
    pub namespace: String,
    /// The ImpVM's name.
    pub name: String,
    /// The ImpVM's uid (also the VM's id on the node).
    pub uid: String,
    /// The restart attempt (`status.restartCount`) this VM was started for.
    #[serde(default)]
    pub attempt: i32,
    /// The booking revision (`status.booking.revision`: changes of the VM's spec rolled in by
    /// the operator) this VM was started with.
    #[serde(default)]
    pub revision: i64,
}

/// One VM, as written by its shim (the supervisor process that owns the VMM).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// The VM's id on this machine (a DNS label: the local name, or the ImpVM's uid).
    pub name: String,
    /// The image as the user gave it.
    pub image: String,
    /// The image's manifest digest, once pulled.
    pub digest: Option<String>,
    /// The manifest digests of the images whose layers go over it (`VmSpec::layers`), lowest
    /// first, once pulled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_digests: Vec<String>,
    /// `qemu` or `firecracker`.
    pub runtime: String,
    /// The shim's pid: `imp stop` signals it, `imp ps` checks it is alive.
    pub supervisor_pid: u32,
    /// The shim's start time (clock ticks since boot, `/proc/PID/stat` field 22), so that a pid
    /// reused by another process after the shim died (or after a reboot) is not taken for it.
    #[serde(default)]
    pub supervisor_started: Option<u64>,
    /// The VMM process's pid, once started.
    pub vmm_pid: Option<u32>,
    /// Other processes of the VM, killed with an orphaned VMM (none with today's drivers: the
    /// QEMU guest channel is served inside the shim).
    #[serde(default)]
    pub helper_pids: Vec<u32>,
    /// The host Unix socket that reaches the guest's vsock (`CONNECT <port>`).
    pub vsock: PathBuf,
    /// The guest agent's vsock port.
    pub agent_port: u32,
    /// The serial console log.
    pub serial_log: PathBuf,
    /// Seconds since the Unix epoch when the VM was created.
    pub created_unix: u64,
    /// When the guest agent first answered.
    #[serde(default)]
    pub running_unix: Option<u64>,
    /// When the VM ended.
    #[serde(default)]
    pub finished_unix: Option<u64>,
    /// What it is doing.
    pub status: VmStatus,
    /// The workload's exit code, once it ended.
    pub exit_code: Option<i32>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The step it failed in.
    #[serde(default)]
    pub error_stage: Option<Stage>,
    /// The last lines of the serial console when it failed (for the failure Event).
    #[serde(default)]
    pub console_tail: Option<String>,
    /// The VMM running the VM, `kind version` ([`imp_vmm::version`]), once launched.
    #[serde(default)]
    pub vmm: Option<String>,
    /// Whether the VM's directory is deleted when it ends.
    pub remove_on_exit: bool,
    /// Whether its guest serves the guest agent (exec, health, figures); records written
    /// before it existed are of VMs that did.
    #[serde(default = "yes")]
    pub guest_agent: bool,
    /// For an attached VM (`imp run -i/-t`): the workload's argv, which the front end runs.
    #[serde(default)]
    pub attach_argv: Option<Vec<String>>,
    /// How long the start's steps took.
    #[serde(default)]
    pub timings: Timings,
    /// The ImpVM this VM belongs to, for VMs of `imp agent`.
    #[serde(default)]
    pub owner: Option<Owner>,
    /// While suspended: the snapshot's place and time.
    #[serde(default)]
    pub suspend: Option<SuspendRecord>,
    /// The last suspend that failed (the VM kept running).
    #[serde(default)]
    pub suspend_failure: Option<SuspendFailure>,
    /// The running VM's vCPUs are paused: a warm pool's member waiting for a claim, which
    /// resumes them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

impl VmRecord {
    /// Its image's chain of manifest digests: the image's, then its extra layers' (`None`
    /// before the image was pulled).
    pub fn image_chain(self) -> Option<Vec<String>> {
        let digest = self.digest?;
        Some(std::iter::once(digest).chain(self.layer_digests).collect())
    }

    /// Whether the shim still runs, so the record's status can be trusted.
    pub fn supervisor_alive(&self) -> bool {
        pid_alive(self.supervisor_pid)
            && self
                .supervisor_started
                .is_none_or(|t| process_start_time(self.supervisor_pid) == Some(t))
    }

    /// The status to show: a live status whose shim died reads as `Failed`.
    pub fn effective_status(&self) -> VmStatus {
        match self.status {
            s if s.needs_shim() && !self.supervisor_alive() => VmStatus::Failed,
            s => s,
        }
    }
}

/// Whether a process with this pid exists (signal 0 probes without sending anything).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    let exists = match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::EPERM) => true,
        Err(_) => false,
    };
    // A zombie (dead, not yet reaped: a killed detached supervisor whose new parent does not
    // reap) still answers signal 0.
    exists && !is_zombie(pid)
}

/// When process `pid` started, in clock ticks since boot (`/proc/PID/stat` field 22): with
/// the pid, it names one process for the machine's uptime.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether /proc says `pid` is a zombie (state `Z` after the command name).
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Refuses names that would not be a DNS label, as an ImpVM name must be.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(StateError::InvalidName(name.to_owned()))
    }
}

/// A fresh name like `imp-3fa9c1`, unique among the VMs under `state`.
pub fn generate_name(state: &StateDir) -> Result<String> {
    let mut bytes = [0u8; 3];
    for _ in 0..16 {
        getrandom(&mut bytes)?;
        let name = format!("imp-{:02x}{:02x}{:02x}", bytes[0], bytes[1], bytes[2]);
        if !state.vm_dir(&name).exists() {
            return Ok(name);
        }
    }
    Err(StateError::NoFreeName(state.root.clone()))
}

fn getrandom(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    let path = Path::new("/dev/urandom");
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(buf))
        .map_err(io("reading", path))
}

/// Nanoseconds since the Unix epoch (for tokens that must differ between calls).
pub fn now_unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `true`, the serde default of switches that were on before they existed.
pub(crate) fn yes() -> bool {
    true
}

/// A record of the fewest fields, in `status`, for tests of the code that reads records.
#[cfg(test)]
pub(crate) fn sample_record(status: VmStatus) -> VmRecord {
    let json = serde_json::json!({
        "name": "v", "image": "i", "digest": null, "runtime": "qemu",
        "supervisor_pid": 1, "vmm_pid": null, "vsock": "/v", "agent_port": 1,
        "serial_log": "/s", "created_unix": 0, "status": status, "exit_code": null,
        "error": null, "remove_on_exit": false,
    });
    serde_json::from_value(json).unwrap_or_else(|e| panic!("the sample record: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_vm_gets_a_vmm_uid_of_its_own_keeps_it_and_frees_it_on_removal() {
        let root = std::env::temp_dir().join(format!("imp-uid-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let state = StateDir::new(&root);
        state.create_vm_dir("a").unwrap();
        state.create_vm_dir("b").unwrap();
        let a = state.vmm_uid("a").unwrap();
        let b = state.vmm_uid("b").unwrap();
        assert_eq!(a, VMM_UID_BASE);
        assert_eq!(b, VMM_UID_BASE + 1);
        assert_eq!(
            state.vmm_uid("a").unwrap(),
            a,
            "kept across boots and restores"
        );
        state.remove("a").unwrap();
        state.create_vm_dir("c").unwrap();
        assert_eq!(state.vmm_uid("c").unwrap(), a, "freed by the removal");
        // A claim whose VM vanished without a removal is taken back.
        std::fs::remove_dir_all(state.vm_dir("b")).unwrap();
        state.create_vm_dir("d").unwrap();
        assert_eq!(state.vmm_uid("d").unwrap(), b);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// `imp run` and `imp agent` on one host (two state directories) claim from one record:
    /// they never hand out the same uid, neither takes back the other's claims, and a VM
    /// whose kept uid another VM claimed meanwhile is refused.
    #[test]
    fn two_state_directories_of_one_host_never_share_a_vmm_uid() {
        let base = std::env::temp_dir().join(format!("imp-uid-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let host = base.join("vmm-uids");
        let agent = StateDir::new(base.join("agent")).with_vmm_uid_dir(&host);
        let local = StateDir::new(base.join("local")).with_vmm_uid_dir(&host);
        agent.create_vm_dir("a").unwrap();
        local.create_vm_dir("a").unwrap();
        let ua = agent.vmm_uid("a").unwrap();
        let ul = local.vmm_uid("a").unwrap();
        assert_ne!(ua, ul, "one uid for two VMMs");
        assert_eq!(local.vmm_uid("a").unwrap(), ul, "kept");
        // The agent's VM is gone without a removal: `imp run` does not take its claim back
        // (it may not see the agent's directory), the agent does.
        std::fs::remove_dir_all(agent.vm_dir("a")).unwrap();
        local.create_vm_dir("b").unwrap();
        let ub = local.vmm_uid("b").unwrap();
        assert!(ub != ua && ub != ul, "{ub}");
        agent.create_vm_dir("c").unwrap();
        assert_eq!(agent.vmm_uid("c").unwrap(), ua, "its own claim, taken back");
        // A uid kept from before the shared record, claimed meanwhile by another VM.
        agent.create_vm_dir("old").unwrap();
        std::fs::write(agent.vm_dir("old").join(VMM_UID_FILE), ul.to_string()).unwrap();
        let e = agent.vmm_uid("old").unwrap_err();
        assert!(
            matches!(e, StateError::UidTaken { uid, .. } if uid == ul),
            "{e}"
        );
        // Released by the removal, for anyone.
        local.remove("a").unwrap();
        assert_eq!(agent.vmm_uid("old").unwrap(), ul);
        let _ = std::fs::remove_dir_all(&base);
    }

    /// A VM that resumes with the uid it kept takes over a claim left by a VM of a state
    /// directory that is gone (removed without releasing its claims), but not one of a state
    /// directory that still exists.
    #[test]
    fn a_kept_uid_is_taken_over_only_from_a_state_directory_that_is_gone() {
        let base = std::env::temp_dir().join(format!("imp-uid-gone-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let host = base.join("vmm-uids");
        let gone = StateDir::new(base.join("gone")).with_vmm_uid_dir(&host);
        let agent = StateDir::new(base.join("agent")).with_vmm_uid_dir(&host);
        gone.create_vm_dir("x").unwrap();
        let taken = gone.vmm_uid("x").unwrap();
        agent.create_vm_dir("kept").unwrap();
        std::fs::write(agent.vm_dir("kept").join(VMM_UID_FILE), taken.to_string()).unwrap();
        assert!(matches!(
            agent.vmm_uid("kept").unwrap_err(),
            StateError::UidTaken { .. }
        ));
        std::fs::remove_dir_all(base.join("gone")).unwrap();
        assert_eq!(agent.vmm_uid("kept").unwrap(), taken);
        assert_eq!(
            read_claim(&host.join(taken.to_string())),
            agent.vm_dir("kept").display().to_string()
        );
        assert!(!state_root_gone(""));
        assert!(!state_root_gone("relative/vms/x"));
        assert!(!state_root_gone("/nonexistent/not-vms/x"));
        let _ = std::fs::remove_dir_all(&base);
    }

    /// An agent upgraded to the shared record still sees the claims it made in its own
    /// directory before.
    #[test]
    fn claims_made_before_the_shared_record_still_hold() {
        let base = std::env::temp_dir().join(format!("imp-uid-legacy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let before = StateDir::new(base.join("agent"));
        before.create_vm_dir("a").unwrap();
        let kept = before.vmm_uid("a").unwrap();
        let after = StateDir::new(base.join("agent")).with_vmm_uid_dir(base.join("host"));
        after.create_vm_dir("b").unwrap();
        assert_ne!(after.vmm_uid("b").unwrap(), kept);
        assert_eq!(after.vmm_uid("a").unwrap(), kept, "claimed again, shared");
        after.remove("a").unwrap();
        assert!(!base.join("agent/vmm-uids").join(kept.to_string()).exists());
        assert!(!base.join("host").join(kept.to_string()).exists());
        let _ = std::fs::remove_dir_all(&base);
    }

    /// A VM's Secrets at rest: its directory is 0700 and its spec (the resolved environment)
    /// and record 0600 from the moment they exist, whatever the umask (its initramfs: see
    /// `guest::initramfs`'s tests).
    #[tokio::test]
    async fn a_vms_spec_and_initramfs_are_owner_only_in_an_owner_only_directory() {
        use std::os::unix::fs::PermissionsExt as _;
        let root = std::env::temp_dir().join(format!("imp-modes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let state = StateDir::new(&root);
        // The most permissive umask a front end could run with.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let dir = state.create_vm_dir("vm1").unwrap();
        let spec = serde_json::json!({"env": [{"name": "PASSWORD", "value": "hunter2"}]});
        write_json(&dir.join(super::super::spec::SPEC_FILE), &spec).unwrap();
        state.save(&state_record("vm1")).unwrap();
        let snap = state.snapshot_dir("vm1");
        crate::host_fs::create_private_dir_all(&snap).unwrap();
        nix::sys::stat::umask(old);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700, "the VM's directory");
        assert_eq!(mode(&root.join("vms")), 0o700, "vms/, made with it");
        assert_eq!(mode(&dir.join("spec.json")), 0o600);
        assert_eq!(mode(&dir.join(RECORD)), 0o600);
        assert_eq!(mode(&snap), 0o700, "the VM's suspend snapshot");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn names_must_be_dns_labels() {
        for good in ["a", "web-1", "imp-3fa9c1"] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "a-", "Web", "a_b", "../x", &"x".repeat(64)] {
            let err = validate_name(bad).unwrap_err().to_string();
            assert!(err.contains("is invalid"), "{bad}: {err}");
        }
    }

    #[test]
    fn records_round_trip_and_list_sorted() {
        let dir = std::env::temp_dir().join(format!("imp-state-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let state = StateDir::resolve(Some(dir.clone())).unwrap();
        for name in ["b", "a"] {
            state.create_vm_dir(name).unwrap();
            let mut record = state_record(name);
            record.supervisor_pid = std::process::id();
            record.supervisor_started = process_start_time(std::process::id());
            record.created_unix = now_unix();
            record.digest = (name == "a").then(|| "sha256:aa".to_owned());
            state.save(&record).unwrap();
            assert_eq!(state.load(name).unwrap(), record);
        }
        let err = state.create_vm_dir("a").unwrap_err().to_string();
        assert!(err.contains("already exists"), "{err}");
        std::fs::create_dir_all(state.vm_dir("zz")).unwrap();
        std::fs::write(state.vm_dir("zz").join(RECORD), b"{not json").unwrap();
        let (good, bad) = state.list().unwrap();
        assert_eq!(
            good.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(bad.len(), 1);
        assert_eq!(
            state.image_chains().unwrap(),
            std::collections::BTreeSet::from([vec!["sha256:aa".to_owned()]]),
            "only records naming a digest count; the unreadable one is skipped"
        );
        assert!(good[0].supervisor_alive());
        assert_eq!(good[0].effective_status(), VmStatus::Running);
        let missing = state.load("nope").unwrap_err().to_string();
        assert!(missing.contains("imp ps"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_live_pid_with_another_start_time_is_not_the_supervisor() {
        let me = std::process::id();
        let started = process_start_time(me);
        assert!(started.is_some());
        let mut r = state_record("x");
        r.supervisor_pid = me;
        r.supervisor_started = started;
        assert!(r.supervisor_alive());
        r.supervisor_started = started.map(|t| t + 1);
        assert!(!r.supervisor_alive(), "a reused pid passed for the shim");
        assert_eq!(r.effective_status(), VmStatus::Failed);
    }

    #[test]
    fn the_first_record_is_written_once_and_removal_leaves_no_vm_behind() {
        let dir = std::env::temp_dir().join(format!("imp-state-new-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let state = StateDir::new(&dir);
        state.create_vm_dir("v").unwrap();
        let mut r = state_record("v");
        assert!(state.save_new(&r).unwrap());
        r.status = VmStatus::Failed;
        assert!(
            !state.save_new(&r).unwrap(),
            "a second first record was written"
        );
        assert_eq!(state.load("v").unwrap().status, VmStatus::Running);
        state.remove("v").unwrap();
        assert!(!state.save_new(&r).unwrap(), "a removed VM got a record");
        std::fs::create_dir_all(dir.join("vms/.trash-old-1/sub")).unwrap();
        assert!(
            state.list().unwrap().1.is_empty(),
            "trash listed as a broken VM"
        );
        state.sweep_trash();
        assert!(std::fs::read_dir(dir.join("vms")).unwrap().next().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn state_record(name: &str) -> VmRecord {
        VmRecord {
            name: name.into(),
            image: "i".into(),
            digest: None,
            layer_digests: Vec::new(),
            runtime: "qemu".into(),
            supervisor_pid: 1,
            supervisor_started: None,
            vmm_pid: None,
            helper_pids: Vec::new(),
            vsock: "/v".into(),
            agent_port: 1,
            serial_log: "/s".into(),
            created_unix: 0,
            running_unix: None,
            finished_unix: None,
            status: VmStatus::Running,
            exit_code: None,
            error: None,
            error_stage: None,
            console_tail: None,
            vmm: None,
            remove_on_exit: false,
            guest_agent: true,
            attach_argv: None,
            timings: Timings::default(),
            owner: None,
            suspend: None,
            paused: false,
            suspend_failure: None,
        }
    }

    #[test]
    fn a_record_of_an_earlier_release_is_read_with_its_later_fields_defaulted() {
        // A suspended VM's record as the release before `vmm` (and other defaulted fields)
        // wrote it: the upgraded agent reads it and resumes the VM.
        let earlier = r#"{"name":"v","image":"i","digest":null,"runtime":"qemu",
            "supervisor_pid":1,"vmm_pid":null,"vsock":"/v","agent_port":1,"serial_log":"/s",
            "created_unix":0,"status":"suspended","exit_code":null,"error":null,
            "remove_on_exit":false,
            "suspend":{"snapshot_dir":"/snap","suspended_unix":5,"bytes":9}}"#;
        let r: VmRecord = serde_json::from_str(earlier).unwrap();
        assert_eq!(r.status, VmStatus::Suspended);
        assert_eq!(r.vmm, None);
        let s = r.suspend.unwrap();
        assert_eq!((s.bytes, s.vmm), (9, None));
    }

    #[test]
    fn a_dead_supervisor_reads_as_failed() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!pid_alive(pid));
        // Dead but not reaped: a zombie is not alive either.
        let mut zombie = std::process::Command::new("true").spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!pid_alive(zombie.id()));
        zombie.wait().unwrap();
    }
}
