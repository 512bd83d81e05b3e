//! Where a node-local ImpVMSnapshot execution's files may go, and how the agent (root) reaches
//! them without being led elsewhere.
//!
//! A tenant names `spec.storage.nodeLocal.path`; the agent creates, writes and removes under
//! it as root. So:
//! - **Allowed roots** ([`Roots`]): the path must be one of the directories the cluster admin
//!   allowed, exactly: the API's default [`DEFAULT_ROOT`], [`STATE_AREA`] of the agent's state
//!   directory, and each `--snapshot-root`. An execution's directory is
//!   `<root>/<namespace>/<parent>/<execution>` ([`Place`]), each of the three a Kubernetes
//!   name, so one namespace's directories are never another's. Anything else is a [`Refusal`]
//!   naming the field and the allowed roots, decided before anything is created
//!   ([`place`]).
//! - **No symlink escape**: below its root, a place is reached one directory at a time with
//!   `O_NOFOLLOW | O_DIRECTORY` opens (missing ones made with `mkdirat`), and each directory on
//!   the way, the root included, must be owned by the agent's user and writable by no one else
//!   ([`create_fresh`], [`open`], [`remove`]). A symlink planted on the way is refused (a
//!   write or a delete never goes through it), and no one but root can plant one between the
//!   check and the shim's writes.
//! - **Removal uses the record**: what was used is recorded in `status.snapshotPath` when the
//!   execution is claimed; a delete and a restore take that record, checked again here
//!   ([`recorded`]) as this namespace's and this execution's place under an allowed root,
//!   never a path recomputed from the (changeable) spec.

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;

/// The API's default `storage.nodeLocal.path`, always allowed.
pub const DEFAULT_ROOT: &str = "/var/lib/imp/snapshots";
/// The agent's own snapshot area, under its state directory, always allowed.
pub const STATE_AREA: &str = "snapshot-files";

/// The directories this node's agent puts node-local snapshots in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots(Vec<PathBuf>);

/// Why a configured snapshot root cannot be one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RootError {
    /// Not an absolute path of plain names.
    #[error("snapshot root {0:?} is not an absolute path of plain names (no '.', '..' or NUL)")]
    NotPlain(String),
    /// It holds, or is inside, another root or the state directory.
    #[error(
        "snapshot root {root} overlaps {other}: one namespace's directories could be another's"
    )]
    Overlaps {
        /// The root.
        root: PathBuf,
        /// What it overlaps.
        other: PathBuf,
    },
}

impl Roots {
    /// [`DEFAULT_ROOT`] (unless it holds or is inside `state_dir`), [`STATE_AREA`] of
    /// `state_dir`, and `extra` (the `--snapshot-root`s). Refuses a root that is not plain, or
    /// that holds or is inside another root or the state directory (other than [`STATE_AREA`]
    /// itself).
    pub fn new(state_dir: &Path, extra: &[PathBuf]) -> Result<Self, RootError> {
        let plain = |p: &Path| {
            let s = p.to_string_lossy();
            normalize(&s).ok_or_else(|| RootError::NotPlain(s.into_owned()))
        };
        let state = plain(state_dir)?;
        let default = PathBuf::from(DEFAULT_ROOT);
        // A state directory that holds the default root (or is in it) keeps only its own area:
        // VM directories must never be a namespace's.
        let mut roots = match default.starts_with(&state) || state.starts_with(&default) {
            true => vec![state.join(STATE_AREA)],
            false => vec![default, state.join(STATE_AREA)],
        };
        for e in extra {
            let r = plain(e)?;
            if r.starts_with(&state) || state.starts_with(&r) {
                return Err(RootError::Overlaps {
                    root: r,
                    other: state,
                });
            }
            if !roots.contains(&r) {
                roots.push(r);
            }
        }
        for (i, a) in roots.iter().enumerate() {
            for b in &roots[i + 1..] {
                if a.starts_with(b) || b.starts_with(a) {
                    return Err(RootError::Overlaps {
                        root: b.clone(),
                        other: a.clone(),
                    });
                }
            }
        }
        Ok(Self(roots))
    }

    /// The allowed directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.0
    }

    /// The allowed directories as a message shows them.
    pub fn shown(&self) -> String {
        self.0
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// An execution's directory: `root/namespace/parent/name`, each below `root` a Kubernetes
/// name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The allowed root it is under.
    pub root: PathBuf,
    /// The execution's namespace.
    pub namespace: String,
    /// Its parent's name.
    pub parent: String,
    /// Its own name.
    pub name: String,
}

impl Place {
    /// The directory.
    pub fn dir(&self) -> PathBuf {
        self.root
            .join(&self.namespace)
            .join(&self.parent)
            .join(&self.name)
    }
}

/// Why an execution's files may not go (or be looked for) where it says.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    /// The path is not one of the allowed roots.
    #[error(
        "spec.storage.nodeLocal.path {path:?} is not a snapshot directory of this node (allowed: {allowed}; the cluster admin adds more with the agent's --snapshot-root)"
    )]
    NotAllowed {
        /// The path asked for.
        path: String,
        /// The allowed roots.
        allowed: String,
    },
    /// A name that forms the directory is not a Kubernetes name.
    #[error(
        "the {what} {value:?} is not a Kubernetes name, so it cannot name a snapshot directory"
    )]
    Name {
        /// Which name.
        what: &'static str,
        /// Its value.
        value: String,
    },
    /// The recorded directory is not this execution's place under an allowed root.
    #[error(
        "status.snapshotPath {path:?} is not this execution's directory under an allowed root ({allowed}): {why}"
    )]
    Recorded {
        /// The recorded path.
        path: String,
        /// The allowed roots.
        allowed: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// `path` as an absolute path of plain names (repeated and trailing slashes dropped), or
/// `None` if it is relative or holds `.`, `..` or NUL.
fn normalize(path: &str) -> Option<PathBuf> {
    if !path.starts_with('/') || path.contains('\0') {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in path.split('/').filter(|c| !c.is_empty()) {
        if c == "." || c == ".." {
            return None;
        }
        out.push(c);
    }
    Some(out)
}

/// A DNS-1123 label (a namespace's name).
fn is_dns_label(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !v.starts_with('-')
        && !v.ends_with('-')
}

/// A DNS-1123 subdomain (an object's name): never `.` or `..`, never holding `/`.
fn is_dns_subdomain(v: &str) -> bool {
    !v.is_empty() && v.len() <= 253 && v.split('.').all(is_dns_label)
}

fn names(namespace: &str, parent: &str, name: &str) -> Result<(), Refusal> {
    let bad = |what, value: &str| Refusal::Name {
        what,
        value: value.to_owned(),
    };
    if !is_dns_label(namespace) {
        return Err(bad("namespace", namespace));
    }
    if !is_dns_subdomain(parent) {
        return Err(bad("parent (label imp.dev/snapshot-parent)", parent));
    }
    if !is_dns_subdomain(name) {
        return Err(bad("execution name", name));
    }
    Ok(())
}

/// Where execution `namespace/name` of parent `parent` goes when its spec asks for `path`
/// (`storage.nodeLocal.path`), or why it may not. Pure: nothing is looked at on the host.
pub fn place(
    path: &str,
    namespace: &str,
    parent: &str,
    name: &str,
    roots: &Roots,
) -> Result<Place, Refusal> {
    let root = normalize(path)
        .filter(|p| roots.0.contains(p))
        .ok_or_else(|| Refusal::NotAllowed {
            path: path.to_owned(),
            allowed: roots.shown(),
        })?;
    names(namespace, parent, name)?;
    Ok(Place {
        root,
        namespace: namespace.to_owned(),
        parent: parent.to_owned(),
        name: name.to_owned(),
    })
}

/// The place recorded as `path` (`status.snapshotPath`) for execution `namespace/name`, if it
/// is that execution's directory under an allowed root. Pure.
pub fn recorded(path: &str, namespace: &str, name: &str, roots: &Roots) -> Result<Place, Refusal> {
    let refuse = |why| Refusal::Recorded {
        path: path.to_owned(),
        allowed: roots.shown(),
        why,
    };
    let full = normalize(path).ok_or_else(|| refuse("not an absolute path of plain names"))?;
    let (root, rest) = roots
        .0
        .iter()
        .find_map(|r| Some((r, full.strip_prefix(r).ok()?)))
        .ok_or_else(|| refuse("under no allowed root"))?;
    let parts: Vec<&str> = rest.iter().filter_map(|c| c.to_str()).collect();
    let [ns, parent, exec] = parts.as_slice() else {
        return Err(refuse("not <root>/<namespace>/<parent>/<execution>"));
    };
    if (*ns, *exec) != (namespace, name) {
        return Err(refuse("it names another namespace or execution"));
    }
    names(ns, parent, exec).map_err(|_| refuse("a name in it is not a Kubernetes name"))?;
    Ok(Place {
        root: root.clone(),
        namespace: namespace.to_owned(),
        parent: (*parent).to_owned(),
        name: name.to_owned(),
    })
}

/// Why a place could not be reached on the host.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// A symlink, or not a directory, on the way.
    #[error(
        "{0} is a symbolic link or not a directory: snapshot directories are reached without following links"
    )]
    NotDirectory(PathBuf),
    /// A directory on the way that someone else could change.
    #[error(
        "{path} may be changed by others than the agent's user (owner uid {uid}, mode {mode:o}): snapshot directories are reached only through directories no one else may write"
    )]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        uid: u32,
        /// Its mode.
        mode: u32,
    },
    /// Anything else.
    #[error("{action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// To what.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(Errno) -> TreeError {
    let path = path.to_path_buf();
    move |e| TreeError::Io {
        action,
        path,
        source: std::io::Error::from(e),
    }
}

/// Checks that directory `fd` (at `path`) is ours and writable by no one else.
fn check_owned(fd: &OwnedFd, path: &Path) -> Result<(), TreeError> {
    let st = nix::sys::stat::fstat(fd).map_err(io_err("reading", path))?;
    let mode = st.st_mode & 0o7777;
    if st.st_uid != nix::unistd::geteuid().as_raw() || mode & 0o022 != 0 {
        return Err(TreeError::Unsafe {
            path: path.to_path_buf(),
            uid: st.st_uid,
            mode,
        });
    }
    Ok(())
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Opens directory `name` in `dir` (at `path`) without following a link; `None` if absent.
fn open_in(dir: &OwnedFd, name: &str, path: &Path) -> Result<Option<OwnedFd>, TreeError> {
    match nix::fcntl::openat(dir, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => {
            check_owned(&fd, path)?;
            Ok(Some(fd))
        }
        Err(Errno::ENOENT) => Ok(None),
        Err(Errno::ELOOP | Errno::ENOTDIR) => Err(TreeError::NotDirectory(path.to_path_buf())),
        Err(e) => Err(io_err("opening", path)(e)),
    }
}

/// Opens (with `create`, makes) directory `name` in `dir` (at `path`), mode 0700.
fn enter(
    dir: &OwnedFd,
    name: &str,
    path: &Path,
    create: bool,
) -> Result<Option<OwnedFd>, TreeError> {
    if let Some(fd) = open_in(dir, name, path)? {
        return Ok(Some(fd));
    }
    if !create {
        return Ok(None);
    }
    match nix::sys::stat::mkdirat(dir, name, Mode::S_IRWXU) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(io_err("creating", path)(e)),
    }
    open_in(dir, name, path)
}

/// The directory holding `place`'s own (`root/namespace/parent`), made when `create`;
/// `None` when absent. The root itself is the admin's and may be reached through links; it
/// must be ours and writable by no one else.
fn parent_of(place: &Place, create: bool) -> Result<Option<OwnedFd>, TreeError> {
    let root = &place.root;
    if create {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(root)
            .map_err(|source| TreeError::Io {
                action: "creating",
                path: root.clone(),
                source,
            })?;
    }
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let fd = match nix::fcntl::open(root.as_path(), flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(io_err("opening", root)(e)),
    };
    check_owned(&fd, root)?;
    let ns_path = root.join(&place.namespace);
    let Some(ns) = enter(&fd, &place.namespace, &ns_path, create)? else {
        return Ok(None);
    };
    enter(&ns, &place.parent, &ns_path.join(&place.parent), create)
}

/// Removes entry `name` of directory `dir` (at `path`), and everything under it, following
/// no link: std's `remove_dir_all` opens every level with `O_NOFOLLOW` and unlinks a link
/// instead of following it; it is given `dir` by its descriptor (`/proc/self/fd/N`), so the
/// levels above are the ones checked. Absent: nothing to do.
fn remove_in(dir: &OwnedFd, name: &str, path: &Path) -> Result<(), TreeError> {
    let st = match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(io_err("reading", path)(e)),
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return match nix::unistd::unlinkat(dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(io_err("removing", path)(e)),
        };
    }
    let via = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    match std::fs::remove_dir_all(&via) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TreeError::Io {
            action: "removing",
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Makes `place`'s directory afresh (what an interrupted attempt left there removed), mode
/// 0700, with the directories above it. Blocking.
pub fn create_fresh(place: &Place) -> Result<PathBuf, TreeError> {
    let dir = place.dir();
    let Some(parent) = parent_of(place, true)? else {
        return Err(TreeError::Io {
            action: "creating",
            path: dir,
            source: std::io::ErrorKind::NotFound.into(),
        });
    };
    remove_in(&parent, &place.name, &dir)?;
    enter(&parent, &place.name, &dir, true)?;
    Ok(dir)
}

/// Checks that `place`'s directory exists and is reached without links through directories
/// only the agent's user may change. Blocking.
pub fn open(place: &Place) -> Result<PathBuf, TreeError> {
    let dir = place.dir();
    let missing = || TreeError::Io {
        action: "opening",
        path: dir.clone(),
        source: std::io::ErrorKind::NotFound.into(),
    };
    let parent = parent_of(place, false)?.ok_or_else(missing)?;
    open_in(&parent, &place.name, &dir)?.ok_or_else(missing)?;
    Ok(dir)
}

/// Removes `place`'s directory and what it holds, following no link; absent is done.
/// Blocking.
pub fn remove(place: &Place) -> Result<(), TreeError> {
    match parent_of(place, false)? {
        Some(parent) => remove_in(&parent, &place.name, &place.dir()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn roots() -> Roots {
        Roots::new(
            Path::new("/var/lib/imp/agent"),
            &[PathBuf::from("/data/snaps/")],
        )
        .unwrap()
    }

    #[test]
    fn the_allowed_roots_are_the_defaults_and_the_flags_and_never_overlap() {
        let r = roots();
        assert_eq!(
            r.dirs(),
            [
                PathBuf::from(DEFAULT_ROOT),
                PathBuf::from("/var/lib/imp/agent/snapshot-files"),
                PathBuf::from("/data/snaps")
            ]
        );
        let state = Path::new("/var/lib/imp/agent");
        for bad in [
            "/var/lib/imp",
            "/var/lib/imp/agent/vms",
            "/",
            "/var/lib/imp/snapshots/x",
        ] {
            let e = Roots::new(state, &[PathBuf::from(bad)]).unwrap_err();
            assert!(matches!(e, RootError::Overlaps { .. }), "{bad}: {e}");
        }
        let inside = Roots::new(Path::new("/var/lib/imp"), &[]).unwrap();
        assert_eq!(
            inside.dirs(),
            [PathBuf::from("/var/lib/imp/snapshot-files")]
        );
        for bad in ["data", "/data/../etc", "/data/./x"] {
            let e = Roots::new(state, &[PathBuf::from(bad)]).unwrap_err();
            assert_eq!(e, RootError::NotPlain(bad.into()));
        }
    }

    #[test]
    fn only_an_allowed_root_takes_snapshots() {
        let r = roots();
        let p = place("/var/lib/imp/snapshots", "ns", "nightly", "nightly-1", &r).unwrap();
        assert_eq!(
            p.dir(),
            PathBuf::from("/var/lib/imp/snapshots/ns/nightly/nightly-1")
        );
        let p = place("/data//snaps/", "ns", "p", "e", &r).unwrap();
        assert_eq!(p.dir(), PathBuf::from("/data/snaps/ns/p/e"));
        for bad in [
            "/etc",
            "/",
            "/var/lib/imp/snapshots/../../../etc",
            "/var/lib/imp/snapshots/..",
            "/var/lib/imp/snapshots/ns",
            "/var/lib/imp",
            "/var/lib/imp/agent",
            "/var/lib/imp/agent/vms",
            "var/lib/imp/snapshots",
            "/data/snaps/./",
            "",
        ] {
            let e = place(bad, "ns", "p", "e", &r).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("spec.storage.nodeLocal.path")
                    && msg.contains(
                        "/var/lib/imp/snapshots, /var/lib/imp/agent/snapshot-files, /data/snaps"
                    ),
                "{bad}: {msg}"
            );
        }
    }

    #[test]
    fn the_names_under_a_root_are_kubernetes_names() {
        let r = roots();
        let root = DEFAULT_ROOT;
        for (ns, parent, name, what) in [
            ("..", "p", "e", "namespace"),
            ("a/b", "p", "e", "namespace"),
            ("", "p", "e", "namespace"),
            ("ns", "..", "e", "parent"),
            ("ns", ".", "e", "parent"),
            ("ns", "", "e", "parent"),
            ("ns", "../../etc", "e", "parent"),
            ("ns", "p", "..", "execution"),
            ("ns", "p", "x/../../y", "execution"),
            ("ns", "p", "E", "execution"),
        ] {
            let e = place(root, ns, parent, name, &r).unwrap_err();
            assert!(
                matches!(&e, Refusal::Name { what: w, .. } if w.starts_with(what)),
                "{ns}/{parent}/{name}: {e}"
            );
        }
        assert!(place(root, "ns", "a.b", "a.b-1", &r).is_ok());
    }

    #[test]
    fn a_recorded_directory_is_this_executions_under_an_allowed_root() {
        let r = roots();
        let p = recorded("/data/snaps/ns/p/e", "ns", "e", &r).unwrap();
        assert_eq!(
            (p.root.as_path(), p.parent.as_str()),
            (Path::new("/data/snaps"), "p")
        );
        for bad in [
            "/etc/ns/p/e",
            "/data/snaps/other/p/e",
            "/data/snaps/ns/p/other",
            "/data/snaps/ns/e",
            "/data/snaps/ns/p/x/e",
            "/data/snaps/ns/../ns/p/e",
            "/data/snaps/ns/P/e",
            "data/snaps/ns/p/e",
        ] {
            let e = recorded(bad, "ns", "e", &r).unwrap_err();
            assert!(e.to_string().contains("status.snapshotPath"), "{bad}: {e}");
        }
    }

    /// A scratch root with a directory `outside` beside it that no write or delete may reach.
    fn scratch() -> (PathBuf, PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt as _;
        let base = std::env::temp_dir().join(format!(
            "imp-place-{}-{}",
            std::process::id(),
            crate::runtime::state::now_unix_nanos()
        ));
        let root = base.join("root");
        let outside = base.join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(outside.join("keep")).unwrap();
        std::fs::write(outside.join("keep/file"), b"x").unwrap();
        for d in [&base, &root] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        (base, root, outside)
    }

    fn at(root: &Path, ns: &str, parent: &str, name: &str) -> Place {
        Place {
            root: root.to_path_buf(),
            namespace: ns.into(),
            parent: parent.into(),
            name: name.into(),
        }
    }

    #[test]
    fn a_place_is_made_removed_and_made_afresh_without_links() {
        let (base, root, _) = scratch();
        let p = at(&root, "ns", "p", "e");
        assert!(open(&p).is_err(), "absent");
        remove(&p).unwrap();
        let dir = create_fresh(&p).unwrap();
        assert_eq!(dir, root.join("ns/p/e"));
        std::fs::write(dir.join("memory"), b"old").unwrap();
        std::fs::create_dir(dir.join("sub")).unwrap();
        create_fresh(&p).unwrap();
        assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "afresh");
        assert_eq!(open(&p).unwrap(), dir);
        remove(&p).unwrap();
        assert!(!dir.exists() && root.join("ns/p").is_dir());
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_planted_symlink_leads_no_write_or_delete_outside() {
        let (base, root, outside) = scratch();
        // A link for the namespace, for the parent, and for the execution itself.
        std::os::unix::fs::symlink(&outside, root.join("evil")).unwrap();
        std::fs::create_dir_all(root.join("ns")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("ns/linked")).unwrap();
        std::fs::create_dir_all(root.join("ns/p")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep"), root.join("ns/p/keep")).unwrap();

        for p in [
            at(&root, "evil", "keep", "e"),
            at(&root, "ns", "linked", "keep"),
        ] {
            let e = create_fresh(&p).unwrap_err();
            assert!(matches!(e, TreeError::NotDirectory(_)), "{e}");
            let e = remove(&p).unwrap_err();
            assert!(matches!(e, TreeError::NotDirectory(_)), "{e}");
            assert!(open(&p).is_err());
        }
        // The execution's own name is a link: removing it removes the link, not its target;
        // making it afresh replaces the link with a directory.
        let p = at(&root, "ns", "p", "keep");
        assert!(matches!(open(&p), Err(TreeError::NotDirectory(_))));
        remove(&p).unwrap();
        assert!(root.join("ns/p/keep").symlink_metadata().is_err());
        std::os::unix::fs::symlink(outside.join("keep"), root.join("ns/p/keep")).unwrap();
        create_fresh(&p).unwrap();
        assert!(root.join("ns/p/keep").symlink_metadata().unwrap().is_dir());

        // A link inside an execution's directory is removed, not followed.
        std::os::unix::fs::symlink(&outside, root.join("ns/p/keep/memory")).unwrap();
        remove(&p).unwrap();
        assert!(!root.join("ns/p/keep").exists());

        assert_eq!(std::fs::read(outside.join("keep/file")).unwrap(), b"x");
        assert!(std::fs::read_dir(&outside).unwrap().count() == 1);
        assert!(!outside.join("e").exists() && !outside.join("keep/e").exists());
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_directory_others_may_write_is_not_gone_through() {
        use std::os::unix::fs::PermissionsExt as _;
        let (base, root, _) = scratch();
        std::fs::create_dir_all(root.join("ns")).unwrap();
        std::fs::set_permissions(root.join("ns"), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = create_fresh(&at(&root, "ns", "p", "e")).unwrap_err();
        assert!(matches!(e, TreeError::Unsafe { mode: 0o777, .. }), "{e}");
        assert!(!root.join("ns/p").exists());
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = create_fresh(&at(&root, "other", "p", "e")).unwrap_err();
        assert!(matches!(e, TreeError::Unsafe { .. }), "{e}");
        assert!(!root.join("other").exists());
        std::fs::remove_dir_all(base).unwrap();
    }
}
