//! The on-disk record of the local VMs `imp run` started, so `imp ps|exec|stop|console` in
//! another shell can find them.
//!
//! Layout under the state directory (`/var/lib/imp/local` as root, else
//! `$XDG_STATE_HOME/imp` or `~/.local/state/imp`; `IMP_STATE_DIR` overrides both):
//! `cache/` holds pulled blobs and base root filesystems, shared by all VMs;
//! `vms/<name>/` holds one VM: `vm.json` (this module's [`VmRecord`]), its own disk, its
//! initramfs, the VMM's sockets and the serial log. A VM directory is removed by `--rm` or
//! `imp rm`; nothing else deletes it.

use std::path::PathBuf;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// The record file's name inside a VM directory.
const RECORD: &str = "vm.json";

/// Where local VMs and the image cache live.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// Picks the state directory from `--state-dir`, `IMP_STATE_DIR`, or the user's defaults.
    pub fn resolve(flag: Option<PathBuf>) -> anyhow::Result<Self> {
        let root = match flag.or_else(|| std::env::var_os("IMP_STATE_DIR").map(PathBuf::from)) {
            Some(dir) => dir,
            None if nix::unistd::geteuid().is_root() => PathBuf::from("/var/lib/imp/local"),
            None => match std::env::var_os("XDG_STATE_HOME") {
                Some(state) => PathBuf::from(state).join("imp"),
                None => match std::env::var_os("HOME") {
                    Some(home) => PathBuf::from(home).join(".local/state/imp"),
                    None => bail!("cannot choose a state directory: set IMP_STATE_DIR or HOME"),
                },
            },
        };
        Ok(Self { root })
    }

    /// The image cache shared by every local VM.
    pub fn cache(&self) -> PathBuf {
        self.root.join("cache")
    }

    /// The directory of VM `name`.
    pub fn vm_dir(&self, name: &str) -> PathBuf {
        self.root.join("vms").join(name)
    }

    /// Creates the directory of a new VM, refusing a name that is taken.
    pub fn create_vm_dir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.vm_dir(name);
        std::fs::create_dir_all(self.root.join("vms"))
            .with_context(|| format!("creating {}", self.root.join("vms").display()))?;
        match std::fs::create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => bail!(
                "a local VM named {name:?} already exists ({}); pick another --name or run `imp rm {name}`",
                dir.display()
            ),
            Err(e) => Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }

    /// Reads the record of VM `name`, with an error that says how to list VMs.
    pub fn load(&self, name: &str) -> anyhow::Result<VmRecord> {
        validate_name(name)?;
        let path = self.vm_dir(name).join(RECORD);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("no local VM named {name:?} (see `imp ps`)")
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
    }

    /// Writes `record` atomically (temp file, fsync, rename) so readers never see half of it.
    pub fn save(&self, record: &VmRecord) -> anyhow::Result<()> {
        let dir = self.vm_dir(&record.name);
        let path = dir.join(RECORD);
        let tmp = dir.join(format!(".{RECORD}.tmp"));
        let bytes = serde_json::to_vec_pretty(record).context("encoding the VM record")?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            f.write_all(&bytes)
                .and_then(|()| f.sync_all())
                .with_context(|| format!("writing {}", tmp.display()))?;
        }
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }

    /// Every VM with a readable record, sorted by name; unreadable ones are reported apart.
    pub fn list(&self) -> anyhow::Result<Listing> {
        let vms = self.root.join("vms");
        let entries = match std::fs::read_dir(&vms) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", vms.display())),
        };
        let (mut good, mut bad) = (Vec::new(), Vec::new());
        for entry in entries {
            let entry = entry.with_context(|| format!("listing {}", vms.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            match self.load(&name) {
                Ok(r) => good.push(r),
                Err(e) => bad.push((entry.path(), e)),
            }
        }
        good.sort_by(|a, b| a.name.cmp(&b.name));
        Ok((good, bad))
    }

    /// Deletes VM `name`'s directory (disk, logs, record).
    pub fn remove(&self, name: &str) -> anyhow::Result<()> {
        validate_name(name)?;
        let dir = self.vm_dir(name);
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))
    }
}

/// Readable records, and the directories whose record could not be read (with why).
pub type Listing = (Vec<VmRecord>, Vec<(PathBuf, anyhow::Error)>);

/// What a local VM is doing, as its supervisor last wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmStatus {
    /// Image pull, disk and VMM start are under way.
    Starting,
    /// The guest agent answered.
    Running,
    /// The workload ended (or the VM was stopped).
    Exited,
    /// The VM could not be started; `error` says why.
    Failed,
}

/// One local VM, as written by its supervisor (the `imp run` process that owns the VMM).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// The VM's name (a DNS label).
    pub name: String,
    /// The image as the user gave it.
    pub image: String,
    /// The image's manifest digest, once pulled.
    pub digest: Option<String>,
    /// `qemu` or `firecracker`.
    pub runtime: String,
    /// The supervisor's pid: `imp stop` signals it, `imp ps` checks it is alive.
    pub supervisor_pid: u32,
    /// The VMM process's pid, once started.
    pub vmm_pid: Option<u32>,
    /// Other processes of the VM (QEMU's vhost-device-vsock), killed with an orphaned VMM.
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
    /// What it is doing.
    pub status: VmStatus,
    /// The workload's exit code, once it ended.
    pub exit_code: Option<i32>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Whether the VM's directory is deleted when it ends.
    pub remove_on_exit: bool,
}

impl VmRecord {
    /// Whether the supervisor still runs, so the record's status can be trusted.
    pub fn supervisor_alive(&self) -> bool {
        pid_alive(self.supervisor_pid)
    }

    /// The status to show: a live status whose supervisor died reads as `Failed`.
    pub fn effective_status(&self) -> VmStatus {
        match self.status {
            VmStatus::Starting | VmStatus::Running if !self.supervisor_alive() => VmStatus::Failed,
            s => s,
        }
    }
}

/// Whether a process with this pid exists (signal 0 probes without sending anything).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    let exists = match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::EPERM) => true,
        Err(_) => false,
    };
    // A zombie (dead, not yet reaped: a killed detached supervisor whose new parent does not
    // reap) still answers signal 0.
    exists && !is_zombie(pid)
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
pub fn validate_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !ok {
        bail!(
            "VM name {name:?} is invalid: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        );
    }
    Ok(())
}

/// A fresh name like `imp-3fa9c1`, unique among the VMs under `state`.
pub fn generate_name(state: &StateDir) -> anyhow::Result<String> {
    let mut bytes = [0u8; 3];
    for _ in 0..16 {
        getrandom(&mut bytes)?;
        let name = format!("imp-{:02x}{:02x}{:02x}", bytes[0], bytes[1], bytes[2]);
        if !state.vm_dir(&name).exists() {
            return Ok(name);
        }
    }
    bail!(
        "could not find a free VM name under {}",
        state.root.display()
    )
}

fn getrandom(buf: &mut [u8]) -> anyhow::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .context("reading /dev/urandom")
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let record = VmRecord {
                name: name.into(),
                image: "oci:/x:latest".into(),
                digest: None,
                runtime: "qemu".into(),
                supervisor_pid: std::process::id(),
                vmm_pid: None,
                helper_pids: Vec::new(),
                vsock: "/v".into(),
                agent_port: 1024,
                serial_log: "/s".into(),
                created_unix: now_unix(),
                status: VmStatus::Running,
                exit_code: None,
                error: None,
                remove_on_exit: false,
            };
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
        assert!(good[0].supervisor_alive());
        assert_eq!(good[0].effective_status(), VmStatus::Running);
        let missing = state.load("nope").unwrap_err().to_string();
        assert!(missing.contains("imp ps"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
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
