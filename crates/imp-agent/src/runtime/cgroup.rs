//! A VM's own cgroup, in every hierarchy this machine mounts, so that the VM lives outside the
//! cgroups of whoever started it.
//!
//! A container runtime restarts the agent by killing every process in the agent's cgroup, and
//! the kernel's OOM killer picks victims by cgroup: a VMM left in the agent's cgroup dies with
//! it (the Go project's agent lost every VM that way). The shim therefore moves itself into
//! `<hierarchy>/<path>` in each v1 hierarchy (on cgroup v1, as here, membership is per
//! hierarchy: leaving one behind is enough to be killed through it) and in the unified v2 tree,
//! before it starts the VMM, which inherits the cgroup. The memory controller limits the VM to
//! its class's memory plus the VMM's overhead. Cleanup kills whatever is left in the cgroup, so a
//! VMM orphaned by a killed shim is found without trusting recorded pids.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
        let cg = Self::at(path)?;
        if cg.dirs.is_empty() {
            return Err(CgroupError::NoHierarchy);
        }
        for (h, dir) in &cg.dirs {
            create_dirs(h, dir)?;
            if h.has("memory") {
                write(
                    &dir.join("memory.limit_in_bytes"),
                    &memory_limit_bytes.to_string(),
                )?;
            } else if h.is_v2() && dir.join("memory.max").exists() {
                write(&dir.join("memory.max"), &memory_limit_bytes.to_string())?;
            }
        }
        Ok(cg)
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
        if h.is_v2()
            && let Some(parent) = d.parent()
        {
            // Let the new level use memory and pids limits; refused controllers stay off.
            for c in ["+memory", "+pids"] {
                let _ = std::fs::write(parent.join("cgroup.subtree_control"), c);
            }
        }
    }
    Ok(())
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

    #[test]
    fn paths_must_stay_inside_the_hierarchy() {
        for bad in ["", "/imp/x", "imp/../x", "imp//x", "./x"] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        assert!(check_path("imp/0f3c-uid").is_ok());
    }
}
