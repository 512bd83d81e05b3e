//! A VM's own cgroup, in every hierarchy this machine mounts, so that the VM lives outside the
//! cgroups of whoever started it.
//!
//! A container runtime restarts the agent by killing every process in the agent's cgroup, and
//! the kernel's OOM killer picks victims by cgroup: a VMM left in the agent's cgroup dies with
//! it (the Go project's agent lost every VM that way). The shim therefore moves itself into
//! `<hierarchy>/<path>` in each v1 hierarchy (on cgroup v1, as here, membership is per
//! hierarchy: leaving one behind is enough to be killed through it) and in the unified v2 tree,
//! before it starts the VMM, which inherits the cgroup. The memory controller limits the VM to
//! its class's memory plus the VMM's overhead; [`Limits`] bound its CPU time, its tasks and its
//! share of the disks, so one busy VM cannot starve its neighbours (the values are chosen in
//! `node::boot`). Cleanup kills whatever is left in the cgroup, so a VMM orphaned by a killed
//! shim is found without trusting recorded pids.
//!
//! The files, v1 and v2 (each limit goes to the first file of its list that the hierarchy has;
//! a limit no hierarchy has a file for is logged as not applied):
//!
//! | limit | v1 | v2 |
//! |---|---|---|
//! | memory | `memory.limit_in_bytes` | `memory.max` |
//! | CPU time | `cpu.cfs_period_us` + `cpu.cfs_quota_us` | `cpu.max` (`QUOTA PERIOD`) |
//! | CPU weight | `cpu.shares` (weight × 1024 / 100) | `cpu.weight` |
//! | tasks | `pids.max` | `pids.max` |
//! | disk weight | `blkio.weight` (CFQ: weight × 5), else `blkio.bfq.weight` | `io.weight` (`default W`), else `io.bfq.weight` |
//!
//! Weights use v2's scale (1–10000, 100 being the default's share). On v2 each level from the
//! hierarchy's root down enables the `cpu`, `io`, `memory` and `pids` controllers it is offered
//! for its children. Disk weights need a scheduler with weights (BFQ, or v2's io.cost): with
//! `none` or `mq-deadline` there is no such file and the weight is not applied.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Failures of cgroup operations.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A cgroup file operation failed.
    #[error("{action} {}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The cgroup file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The path would leave the hierarchy.
    #[error("cgroup path {0:?} must be relative, without '..'")]
    BadPath(String),
    /// No cgroup hierarchy is mounted with its root visible (e.g. a container without its
    /// own cgroup namespace sees only its subtree): the VM could not leave our cgroup.
    #[error(
        "no cgroup hierarchy is mounted at its root here (see /proc/self/mountinfo); the agent needs the host's /sys/fs/cgroup"
    )]
    NoHierarchy,
    /// Processes were still in the cgroup after being killed.
    #[error("processes {pids:?} in cgroup {path} survived SIGKILL")]
    Survivors {
        /// The cgroup path.
        path: String,
        /// What is left.
        pids: Vec<u32>,
    },
}

type Result<T, E = CgroupError> = std::result::Result<T, E>;

/// What a VM's cgroup may use besides memory; `None` leaves the kernel's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU time per [`CPU_PERIOD_US`], in thousandths of a CPU (1500: one and a half CPUs).
    #[serde(default)]
    pub cpu_millis: Option<u32>,
    /// Share of contended CPU against the sibling cgroups (v2 scale: 1-10000, default 100).
    #[serde(default)]
    pub cpu_weight: Option<u32>,
    /// The most tasks (processes and threads) in the cgroup.
    #[serde(default)]
    pub pids_max: Option<u32>,
    /// Share of contended disk time against the sibling cgroups (v2 scale: 1-10000, default 100).
    #[serde(default)]
    pub io_weight: Option<u32>,
}

/// The CFS period the CPU quota is measured over, in microseconds (the kernel's default).
pub const CPU_PERIOD_US: u64 = 100_000;

/// The controllers a v2 level enables for its children (each only if it is offered).
const V2_CONTROLLERS: [&str; 4] = ["cpu", "io", "memory", "pids"];

/// One limit as files: written to the first of `files` the cgroup has, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Setting {
    /// What is limited, for the log.
    what: &'static str,
    /// Candidate files with the value each takes, first present wins; several writes when
    /// one limit needs more than one file (`cpu.cfs_period_us` then `cpu.cfs_quota_us`).
    files: Vec<Vec<(&'static str, String)>>,
}

/// The files and values that put `memory_limit_bytes` and `limits` on a cgroup of a v1
/// hierarchy with `controllers`, or of the v2 tree when `controllers` is empty.
fn settings(controllers: &[String], memory_limit_bytes: u64, limits: &Limits) -> Vec<Setting> {
    let v2 = controllers.is_empty();
    let has = |c: &str| v2 || controllers.iter().any(|x| x == c);
    let one = |file: &'static str, value: String| vec![vec![(file, value)]];
    let mut out = Vec::new();
    if has("memory") {
        let file = if v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        out.push(Setting {
            what: "memory",
            files: one(file, memory_limit_bytes.to_string()),
        });
    }
    if has("cpu") {
        if let Some(millis) = limits.cpu_millis {
            let quota = (u64::from(millis) * CPU_PERIOD_US / 1000).max(1000);
            let files = if v2 {
                one("cpu.max", format!("{quota} {CPU_PERIOD_US}"))
            } else {
                vec![vec![
                    ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
                    ("cpu.cfs_quota_us", quota.to_string()),
                ]]
            };
            out.push(Setting {
                what: "CPU time",
                files,
            });
        }
        if let Some(w) = limits.cpu_weight {
            let files = if v2 {
                one("cpu.weight", w.clamp(1, 10_000).to_string())
            } else {
                let shares = (u64::from(w) * 1024 / 100).clamp(2, 262_144);
                one("cpu.shares", shares.to_string())
            };
            out.push(Setting {
                what: "CPU weight",
                files,
            });
        }
    }
    if has("pids")
        && let Some(max) = limits.pids_max
    {
        out.push(Setting {
            what: "tasks",
            files: one("pids.max", max.to_string()),
        });
    }
    if (v2 || has("blkio"))
        && let Some(w) = limits.io_weight
    {
        let bfq = w.clamp(1, 1000).to_string();
        let files = if v2 {
            vec![
                vec![("io.weight", format!("default {}", w.clamp(1, 10_000)))],
                vec![("io.bfq.weight", bfq)],
            ]
        } else {
            vec![
                vec![(
                    "blkio.weight",
                    (w.min(1000) * 5).clamp(10, 1000).to_string(),
                )],
                vec![("blkio.bfq.weight", bfq)],
            ]
        };
        out.push(Setting {
            what: "disk weight",
            files,
        });
    }
    out
}

/// One mounted cgroup hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// Where it is mounted.
    pub mount: PathBuf,
    /// Its v1 controllers (`memory`, `name=systemd` …); empty for the v2 unified tree.
    pub controllers: Vec<String>,
}

impl Hierarchy {
    fn is_v2(&self) -> bool {
        self.controllers.is_empty()
    }

    fn has(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }
}

/// Super options of a v1 cgroup mount that are not controllers.
const MOUNT_OPTIONS: &[&str] = &[
    "rw",
    "ro",
    "xattr",
    "noprefix",
    "clone_children",
    "cpuset_v2_mode",
    "favordynmods",
];

/// The cgroup hierarchies in a `/proc/self/mountinfo` text: v1 `cgroup` mounts with their
/// controllers, and `cgroup2` mounts. Only each hierarchy's root mount is kept.
pub fn parse_mountinfo(text: &str) -> Vec<Hierarchy> {
    let mut out: Vec<Hierarchy> = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = left.split(' ').collect();
        let (Some(root), Some(mount)) = (fields.get(3), fields.get(4)) else {
            continue;
        };
        let mut rf = right.split(' ');
        let (fstype, _source, options) = (rf.next(), rf.next(), rf.next().unwrap_or(""));
        if *root != "/" {
            continue;
        }
        let controllers = match fstype {
            Some("cgroup") => options
                .split(',')
                .filter(|o| !MOUNT_OPTIONS.contains(o))
                .filter(|o| !o.contains('=') || o.starts_with("name="))
                .map(str::to_owned)
                .collect(),
            Some("cgroup2") => Vec::new(),
            _ => continue,
        };
        let mount = PathBuf::from(mount.replace("\\040", " "));
        if out.iter().any(|h| h.controllers == controllers) {
            continue;
        }
        out.push(Hierarchy { mount, controllers });
    }
    out
}

/// Every cgroup hierarchy mounted here.
pub fn hierarchies() -> Result<Vec<Hierarchy>> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Io {
        action: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// The parent of the cgroups of `imp run`'s VMs (the agent's is its `--cgroup-parent`).
pub const LOCAL_PARENT: &str = "imp-local";

/// The cgroup of local VM `name` of the state directory at `state_root`:
/// `imp-local/<hash of the state directory>-<name>`, so two state directories never share one;
/// `None` where this process cannot make cgroups (not root, or no hierarchy at its root
/// visible), and the VM then runs in its starter's cgroup, unlimited, as before.
///
/// A shim removes its VM's cgroup when it ends; one that was killed cannot, so the empty
/// cgroups of this state directory's VMs that are gone are removed here (an `rmdir`, which
/// the kernel refuses for a cgroup that still has processes: nothing is killed).
pub fn local_path(state_root: &Path, name: &str) -> Option<String> {
    let writable =
        |h: &Hierarchy| nix::unistd::access(&h.mount, nix::unistd::AccessFlags::W_OK).is_ok();
    let hs = hierarchies().ok().filter(|hs| !hs.is_empty())?;
    if !nix::unistd::geteuid().is_root() || !hs.iter().all(writable) {
        return None;
    }
    let prefix = local_prefix(state_root);
    for h in &hs {
        sweep_local(
            &h.mount.join(LOCAL_PARENT),
            &prefix,
            &state_root.join("vms"),
        );
    }
    let path = format!("{LOCAL_PARENT}/{prefix}{name}");
    check_path(&path).ok().map(|()| path)
}

/// `<hash of the state directory>-`: what the names of its VMs' cgroups start with.
fn local_prefix(state_root: &Path) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(state_root.as_os_str().as_encoded_bytes());
    let hash: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("{hash}-")
}

/// Removes the cgroups in `parent` named `<prefix><vm>` whose VM has no directory in `vms`.
fn sweep_local(parent: &Path, prefix: &str, vms: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(vm) = file_name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        if !vm.is_empty() && !vms.join(vm).exists() && entry.path().is_dir() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// One VM's cgroup across every hierarchy.
#[derive(Debug, Clone)]
pub struct VmCgroup {
    path: String,
    dirs: Vec<(Hierarchy, PathBuf)>,
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io {
        action,
        path,
        source,
    }
}

fn check_path(path: &str) -> Result<()> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        return Err(CgroupError::BadPath(path.to_owned()));
    }
    Ok(())
}

impl VmCgroup {
    /// The cgroup at `path` (relative to each hierarchy's root), without creating it.
    pub fn at(path: &str) -> Result<Self> {
        check_path(path)?;
        let dirs = hierarchies()?
            .into_iter()
            .map(|h| {
                let dir = h.mount.join(path);
                (h, dir)
            })
            .collect();
        Ok(Self {
            path: path.to_owned(),
            dirs,
        })
    }

    /// Creates the cgroup in every hierarchy and limits its memory to `memory_limit_bytes`.
    pub fn create(path: &str, memory_limit_bytes: u64) -> Result<Self> {
        Self::create_limited(path, memory_limit_bytes, &Limits::default())
    }

    /// Creates the cgroup in every hierarchy, limits its memory to `memory_limit_bytes` and
    /// applies `limits`.
    pub fn create_limited(path: &str, memory_limit_bytes: u64, limits: &Limits) -> Result<Self> {
        Self::create_in(hierarchies()?, path, memory_limit_bytes, limits)
    }

    /// [`VmCgroup::create_limited`] in the given hierarchies.
    fn create_in(
        hierarchies: Vec<Hierarchy>,
        path: &str,
        memory_limit_bytes: u64,
        limits: &Limits,
    ) -> Result<Self> {
        check_path(path)?;
        let dirs: Vec<(Hierarchy, PathBuf)> = hierarchies
            .into_iter()
            .map(|h| {
                let dir = h.mount.join(path);
                (h, dir)
            })
            .collect();
        if dirs.is_empty() {
            return Err(CgroupError::NoHierarchy);
        }
        let mut wanted: Vec<&'static str> = Vec::new();
        let mut applied: Vec<&'static str> = Vec::new();
        for (h, dir) in &dirs {
            create_dirs(h, dir)?;
            for setting in settings(&h.controllers, memory_limit_bytes, limits) {
                wanted.push(setting.what);
                let present = setting
                    .files
                    .iter()
                    .find(|writes| writes.iter().all(|(f, _)| dir.join(f).exists()));
                if let Some(writes) = present {
                    for (file, value) in writes {
                        write(&dir.join(file), value)?;
                    }
                    applied.push(setting.what);
                }
            }
        }
        wanted.retain(|w| !applied.contains(w));
        wanted.sort_unstable();
        wanted.dedup();
        if !wanted.is_empty() {
            tracing::warn!(cgroup = path, limits = ?wanted,
                "no cgroup hierarchy here has a file for these limits; they are not applied");
        }
        Ok(Self {
            path: path.to_owned(),
            dirs,
        })
    }

    /// The cgroup's path below each hierarchy's root.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Moves process `pid` into the cgroup in every hierarchy.
    pub fn add(&self, pid: u32) -> Result<()> {
        for (_, dir) in &self.dirs {
            write(&dir.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// The processes in the cgroup, in any hierarchy.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .dirs
            .iter()
            .filter_map(|(_, dir)| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
            .flat_map(|text| {
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Whether the cgroup exists in any hierarchy.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|(_, d)| d.is_dir())
    }

    /// SIGKILLs every process in the cgroup until none is left (or `deadline` passes).
    pub fn kill_all(&self, deadline: Duration) -> Result<()> {
        let until = Instant::now() + deadline;
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(CgroupError::Survivors {
                    path: self.path.clone(),
                    pids,
                });
            }
            for pid in pids {
                if let Ok(raw) = i32::try_from(pid) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(raw),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Moves process `pid` (the shim itself, at its end) back to each hierarchy's root, then
    /// kills whatever is left in the cgroup and removes it: a VM whose shim ended leaves no
    /// cgroup behind, whoever started it.
    pub fn leave_and_destroy(&self, pid: u32) -> Result<()> {
        for (h, dir) in &self.dirs {
            if dir.is_dir() {
                write(&h.mount.join("cgroup.procs"), &pid.to_string())?;
            }
        }
        self.destroy()
    }

    /// Kills what is left and removes the cgroup from every hierarchy.
    pub fn destroy(&self) -> Result<()> {
        self.kill_all(Duration::from_secs(5))?;
        for (_, dir) in &self.dirs {
            // A just-killed process may still be leaving the cgroup: retry rmdir briefly.
            let mut tries = 0;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(_) if tries < 50 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io("removing", dir)(e)),
                }
            }
        }
        Ok(())
    }
}

/// Creates `dir` and its missing parents; in a cpuset hierarchy each new level gets its
/// parent's cpus and mems, without which no process may join it.
fn create_dirs(h: &Hierarchy, dir: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut cur = dir;
    while !cur.exists() && cur != h.mount {
        missing.push(cur.to_path_buf());
        match cur.parent() {
            Some(p) => cur = p,
            None => break,
        }
    }
    for d in missing.into_iter().rev() {
        match std::fs::create_dir(&d) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(io("creating cgroup", &d)(e));
            }
            _ => {}
        }
        if h.has("cpuset")
            && let Some(parent) = d.parent()
        {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let value = std::fs::read_to_string(parent.join(file))
                    .map_err(io("reading", &parent.join(file)))?;
                write(&d.join(file), value.trim())?;
            }
        }
    }
    if h.is_v2() {
        enable_controllers(&h.mount, dir);
    }
    Ok(())
}

/// On v2, lets each level from `mount` down to `dir`'s parent hand the limits' controllers to
/// its children: a controller is usable in a cgroup only if every ancestor enabled it. Only
/// the controllers a level is offered (its `cgroup.controllers`) are asked for, in one write;
/// a refusal (a level with processes of its own) leaves them off and the limits unapplied.
fn enable_controllers(mount: &Path, dir: &Path) {
    let Ok(below) = dir.strip_prefix(mount) else {
        return;
    };
    let mut level = mount.to_path_buf();
    let mut parts: Vec<_> = below.components().collect();
    parts.pop();
    for part in std::iter::once(None).chain(parts.into_iter().map(Some)) {
        if let Some(p) = part {
            level.push(p);
        }
        let offered = std::fs::read_to_string(level.join("cgroup.controllers")).unwrap_or_default();
        let enabled =
            std::fs::read_to_string(level.join("cgroup.subtree_control")).unwrap_or_default();
        let wanted: Vec<String> = V2_CONTROLLERS
            .iter()
            .filter(|c| offered.split_whitespace().any(|o| o == **c))
            .filter(|c| !enabled.split_whitespace().any(|e| e == **c))
            .map(|c| format!("+{c}"))
            .collect();
        if !wanted.is_empty()
            && let Err(e) = std::fs::write(level.join("cgroup.subtree_control"), wanted.join(" "))
        {
            tracing::debug!(cgroup = %level.display(), error = %imp_api::chain::DisplayChain(&e), "enabling controllers for the VMs' cgroups");
        }
    }
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(io("writing", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
99 31 0:32 /sub /mnt/memory-again rw,relatime - cgroup cgroup rw,memory
100 31 0:40 / /proc rw - proc proc rw";

    #[test]
    fn mountinfo_gives_each_hierarchy_once_with_its_controllers() {
        let h = parse_mountinfo(MOUNTINFO);
        let got: Vec<(&str, Vec<&str>)> = h
            .iter()
            .map(|h| {
                (
                    h.mount.to_str().unwrap(),
                    h.controllers.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("/sys/fs/cgroup/cpu,cpuacct", vec!["cpu", "cpuacct"]),
                ("/sys/fs/cgroup/memory", vec!["memory"]),
                ("/sys/fs/cgroup/systemd", vec!["name=systemd"]),
                ("/sys/fs/cgroup/unified", vec![]),
            ]
        );
    }

    fn limits() -> Limits {
        Limits {
            cpu_millis: Some(1500),
            cpu_weight: Some(100),
            pids_max: Some(1024),
            io_weight: Some(200),
        }
    }

    /// A scratch directory standing for cgroup mounts; removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("imp-cgroup-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        /// `files` (empty, as the kernel shows them) in `dir` below the scratch root.
        fn files(&self, dir: &str, files: &[&str]) -> PathBuf {
            let d = self.0.join(dir);
            std::fs::create_dir_all(&d).unwrap();
            for f in files {
                std::fs::write(d.join(f), "").unwrap();
            }
            d
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn read(path: PathBuf) -> String {
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn v2_files_and_values() {
        let got = settings(&[], 3 << 30, &limits());
        let files: Vec<Vec<Vec<(&str, String)>>> = got.into_iter().map(|s| s.files).collect();
        let s = |v: &str| v.to_owned();
        assert_eq!(
            files,
            vec![
                vec![vec![("memory.max", s("3221225472"))]],
                vec![vec![("cpu.max", s("150000 100000"))]],
                vec![vec![("cpu.weight", s("100"))]],
                vec![vec![("pids.max", s("1024"))]],
                vec![
                    vec![("io.weight", s("default 200"))],
                    vec![("io.bfq.weight", s("200"))]
                ],
            ]
        );
    }

    #[test]
    fn v1_files_and_values_go_to_the_hierarchy_with_the_controller() {
        let c = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let cpu = settings(&c(&["cpu", "cpuacct"]), 1 << 30, &limits());
        assert_eq!(
            cpu.iter().map(|s| s.files.clone()).collect::<Vec<_>>(),
            vec![
                vec![vec![
                    ("cpu.cfs_period_us", "100000".to_owned()),
                    ("cpu.cfs_quota_us", "150000".to_owned())
                ]],
                vec![vec![("cpu.shares", "1024".to_owned())]],
            ]
        );
        let blkio = settings(&c(&["blkio"]), 1 << 30, &limits());
        assert_eq!(
            blkio[0].files,
            vec![
                vec![("blkio.weight", "1000".to_owned())],
                vec![("blkio.bfq.weight", "200".to_owned())]
            ]
        );
        assert_eq!(
            settings(&c(&["memory"]), 1 << 30, &limits())[0].files,
            vec![vec![("memory.limit_in_bytes", "1073741824".to_owned())]]
        );
        assert_eq!(
            settings(&c(&["pids"]), 1 << 30, &limits())[0].files,
            vec![vec![("pids.max", "1024".to_owned())]]
        );
        assert!(settings(&c(&["name=systemd"]), 1 << 30, &limits()).is_empty());
        assert!(settings(&c(&["freezer"]), 1 << 30, &limits()).is_empty());
        // No limits asked: memory only.
        assert_eq!(settings(&[], 1, &Limits::default()).len(), 1);
        // A tiny quota is raised to the kernel's 1 ms minimum; weights are clamped.
        let tiny = Limits {
            cpu_millis: Some(1),
            cpu_weight: Some(0),
            io_weight: Some(50_000),
            pids_max: None,
        };
        let got = settings(&[], 1, &tiny);
        assert_eq!(
            got[1].files,
            vec![vec![("cpu.max", "1000 100000".to_owned())]]
        );
        assert_eq!(got[2].files, vec![vec![("cpu.weight", "1".to_owned())]]);
        assert_eq!(
            got[3].files[0],
            vec![("io.weight", "default 10000".to_owned())]
        );
        let huge = Limits {
            io_weight: Some(u32::MAX),
            cpu_weight: Some(u32::MAX),
            ..Limits::default()
        };
        assert_eq!(
            settings(&c(&["blkio"]), 1, &huge)[0].files[0],
            vec![("blkio.weight", "1000".to_owned())]
        );
        assert_eq!(
            settings(&c(&["cpu"]), 1, &huge)[0].files[0],
            vec![("cpu.shares", "262144".to_owned())]
        );
    }

    /// A v2 hierarchy in a temp dir: the VM's cgroup gets every limit in the files the kernel
    /// shows, and each level above enables the controllers it is offered.
    #[test]
    fn a_v2_cgroup_gets_its_limits_and_its_ancestors_enable_the_controllers() {
        let root = Scratch::new("v2");
        let mount = root.files("", &[]);
        std::fs::write(
            mount.join("cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids rdma misc\n",
        )
        .unwrap();
        std::fs::write(mount.join("cgroup.subtree_control"), "memory\n").unwrap();
        // What the kernel shows once the parent's controllers are enabled.
        let parent = root.files("imp", &["cgroup.subtree_control"]);
        std::fs::write(parent.join("cgroup.controllers"), "cpu io memory pids\n").unwrap();
        let vm = root.files(
            "imp/vm-1",
            &[
                "cgroup.procs",
                "memory.max",
                "cpu.max",
                "cpu.weight",
                "pids.max",
                "io.weight",
            ],
        );
        let h = Hierarchy {
            mount: mount.clone(),
            controllers: Vec::new(),
        };
        let cg = VmCgroup::create_in(vec![h.clone()], "imp/vm-1", 640 << 20, &limits()).unwrap();
        assert_eq!(cg.path(), "imp/vm-1");
        assert_eq!(read(vm.join("memory.max")), "671088640");
        assert_eq!(read(vm.join("cpu.max")), "150000 100000");
        assert_eq!(read(vm.join("cpu.weight")), "100");
        assert_eq!(read(vm.join("pids.max")), "1024");
        assert_eq!(read(vm.join("io.weight")), "default 200");
        assert_eq!(
            read(mount.join("cgroup.subtree_control")),
            "+cpu +io +pids",
            "memory was on already; cpuset, hugetlb … are not asked for"
        );
        assert_eq!(
            read(parent.join("cgroup.subtree_control")),
            "+cpu +io +memory +pids"
        );

        // A kernel whose disk scheduler is BFQ: io.bfq.weight instead; a missing file is no
        // error (the limit is logged as not applied).
        let vm2 = root.files("imp/vm-2", &["memory.max", "io.bfq.weight"]);
        VmCgroup::create_in(vec![h], "imp/vm-2", 1 << 30, &limits()).unwrap();
        assert_eq!(read(vm2.join("io.bfq.weight")), "200");
        assert_eq!(read(vm2.join("memory.max")), "1073741824");
        assert!(!vm2.join("cpu.max").exists(), "no file is made up");
    }

    /// v1 hierarchies in a temp dir: each limit lands in its controller's hierarchy, and a
    /// blkio hierarchy without weight files (no CFQ or BFQ) is no error.
    #[test]
    fn v1_cgroups_get_their_limits_in_each_controllers_hierarchy() {
        let root = Scratch::new("v1");
        let mk = |name: &str, controllers: &[&str], files: &[&str]| {
            let mount = root.files(name, &[]);
            root.files(&format!("{name}/imp/vm"), files);
            Hierarchy {
                mount,
                controllers: controllers.iter().map(|c| c.to_string()).collect(),
            }
        };
        let hs = vec![
            mk(
                "cpu,cpuacct",
                &["cpu", "cpuacct"],
                &["cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares"],
            ),
            mk("memory", &["memory"], &["memory.limit_in_bytes"]),
            mk("pids", &["pids"], &["pids.max"]),
            mk("blkio", &["blkio"], &["blkio.throttle.read_bps_device"]),
            mk("systemd", &["name=systemd"], &[]),
        ];
        VmCgroup::create_in(hs, "imp/vm", 1 << 30, &limits()).unwrap();
        let at = |h: &str, f: &str| read(root.0.join(h).join("imp/vm").join(f));
        assert_eq!(at("cpu,cpuacct", "cpu.cfs_period_us"), "100000");
        assert_eq!(at("cpu,cpuacct", "cpu.cfs_quota_us"), "150000");
        assert_eq!(at("cpu,cpuacct", "cpu.shares"), "1024");
        assert_eq!(at("memory", "memory.limit_in_bytes"), "1073741824");
        assert_eq!(at("pids", "pids.max"), "1024");
        assert!(!root.0.join("blkio/imp/vm/blkio.weight").exists());
        assert!(
            !root
                .0
                .join("systemd/imp/vm/cgroup.subtree_control")
                .exists()
        );
    }

    /// Empty cgroups of this state directory's VMs that are gone are removed; those of VMs
    /// that exist, of other state directories, and any that is not empty stay.
    #[test]
    fn the_cgroups_of_gone_local_vms_are_swept() {
        let root = Scratch::new("sweep");
        let state = root.files("state", &[]);
        root.files("state/vms/alive", &[]);
        let prefix = local_prefix(&state);
        assert_eq!(prefix.len(), 9);
        assert_ne!(prefix, local_prefix(&root.0.join("other-state")));
        let parent = root.files("cpu/imp-local", &[]);
        root.files(&format!("cpu/imp-local/{prefix}alive"), &[]);
        root.files(&format!("cpu/imp-local/{prefix}gone"), &[]);
        // A directory that is not empty stands for a cgroup with processes (rmdir refuses it).
        root.files(&format!("cpu/imp-local/{prefix}busy"), &["cgroup.procs"]);
        root.files("cpu/imp-local/0000000-gone", &[]);
        sweep_local(&parent, &prefix, &state.join("vms"));
        let mut left: Vec<String> = std::fs::read_dir(&parent)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![
            "0000000-gone".to_owned(),
            format!("{prefix}alive"),
            format!("{prefix}busy"),
        ];
        want.sort();
        assert_eq!(left, want);
    }

    #[test]
    fn paths_must_stay_inside_the_hierarchy() {
        for bad in ["", "/imp/x", "imp/../x", "imp//x", "./x"] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        assert!(check_path("imp/0f3c-uid").is_ok());
    }
}
