//! Resolving an image's `User` (`uid[:gid]` or `name[:group]`) from the rootfs's own
//! `/etc/passwd` and `/etc/group`: glibc's `getpwnam` does not work in a static binary, and
//! the files to read are the image's, not the host's.

use std::io;
use std::path::Path;

/// Why a user spec could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// The named user is not in /etc/passwd.
    #[error("User {0:?} is not in /etc/passwd")]
    UnknownUser(String),
    /// The named group is not in /etc/group.
    #[error("Group {0:?} is not in /etc/group")]
    UnknownGroup(String),
    /// The spec is empty or has too many parts.
    #[error("User spec {0:?} is not uid[:gid] or name[:group]")]
    BadSpec(String),
    /// The account files could not be read.
    #[error("Reading {path} to resolve user {spec:?} failed")]
    Read {
        /// The file.
        path: String,
        /// The spec being resolved.
        spec: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Who a process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The user id.
    pub uid: u32,
    /// The primary group id.
    pub gid: u32,
    /// The home directory from /etc/passwd, for `HOME`.
    pub home: String,
}

impl Identity {
    /// Root, the identity of an image without `User`.
    pub fn root() -> Self {
        Self {
            uid: 0,
            gid: 0,
            home: "/root".to_string(),
        }
    }
}

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

fn passwd_entries(passwd: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    passwd
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 6 {
                return None;
            }
            Some(PasswdEntry {
                name: f[0],
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5],
            })
        })
}

fn group_gid(group: &str, name: &str) -> Option<u32> {
    group
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            (f.len() >= 3 && f[0] == name)
                .then(|| f[2].parse().ok())
                .flatten()
        })
}

/// Resolves a spec against the contents of /etc/passwd and /etc/group, like runc does: a
/// numeric uid need not exist (its gid is then 0 and its home `/`), a name must.
pub fn resolve(spec: &str, passwd: &str, group: &str) -> Result<Identity, UserError> {
    let spec = spec.trim();
    let mut parts = spec.split(':');
    let (user, grp) = match (parts.next(), parts.next(), parts.next()) {
        (Some(u), g, None) if !u.is_empty() => (u, g),
        _ => return Err(UserError::BadSpec(spec.to_string())),
    };
    let mut id = if let Ok(uid) = user.parse::<u32>() {
        match passwd_entries(passwd).find(|e| e.uid == uid) {
            Some(e) => Identity {
                uid,
                gid: e.gid,
                home: e.home.to_string(),
            },
            None => Identity {
                uid,
                gid: 0,
                home: "/".to_string(),
            },
        }
    } else {
        let e = passwd_entries(passwd)
            .find(|e| e.name == user)
            .ok_or_else(|| UserError::UnknownUser(user.to_string()))?;
        Identity {
            uid: e.uid,
            gid: e.gid,
            home: e.home.to_string(),
        }
    };
    match grp {
        None => {}
        Some("") => return Err(UserError::BadSpec(spec.to_string())),
        Some(g) => {
            id.gid = match g.parse::<u32>() {
                Ok(gid) => gid,
                Err(_) => {
                    group_gid(group, g).ok_or_else(|| UserError::UnknownGroup(g.to_string()))?
                }
            }
        }
    }
    if id.home.is_empty() {
        id.home = "/".to_string();
    }
    Ok(id)
}

/// Resolves a spec against `<root>/etc/passwd` and `<root>/etc/group` (missing files are empty).
pub fn resolve_in(root: &Path, spec: Option<&str>) -> Result<Identity, UserError> {
    let Some(spec) = spec.filter(|s| !s.trim().is_empty()) else {
        return Ok(Identity::root());
    };
    let read = |name: &str| {
        let path = root.join(name);
        match std::fs::read_to_string(&path) {
            Ok(s) => Ok(s),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
            Err(source) => Err(UserError::Read {
                path: path.display().to_string(),
                spec: spec.to_string(),
                source,
            }),
        }
    };
    resolve(spec, &read("etc/passwd")?, &read("etc/group")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                          # comment\n\
                          app:x:1000:1001:App:/home/app:/bin/sh\n\
                          nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n\
                          broken line\n";
    const GROUP: &str = "root:x:0:\napp:x:1001:\nstaff:x:50:app\n";

    #[test]
    fn a_name_takes_uid_gid_and_home_from_passwd() {
        let id = resolve("app", PASSWD, GROUP).unwrap();
        assert_eq!(
            id,
            Identity {
                uid: 1000,
                gid: 1001,
                home: "/home/app".into()
            }
        );
    }

    #[test]
    fn a_numeric_uid_uses_its_passwd_entry_if_any() {
        assert_eq!(resolve("1000", PASSWD, GROUP).unwrap().gid, 1001);
        let unknown = resolve("4242", PASSWD, GROUP).unwrap();
        assert_eq!(
            unknown,
            Identity {
                uid: 4242,
                gid: 0,
                home: "/".into()
            }
        );
    }

    #[test]
    fn a_group_overrides_the_primary_gid_by_number_or_name() {
        assert_eq!(resolve("app:50", PASSWD, GROUP).unwrap().gid, 50);
        assert_eq!(resolve("1000:staff", PASSWD, GROUP).unwrap().gid, 50);
        assert_eq!(resolve("4242:4343", "", "").unwrap().gid, 4343);
    }

    #[test]
    fn unknown_names_and_bad_specs_are_clear_errors() {
        let err = resolve("ghost", PASSWD, GROUP).unwrap_err();
        assert_eq!(err.to_string(), "User \"ghost\" is not in /etc/passwd");
        let err = resolve("app:ghosts", PASSWD, GROUP).unwrap_err();
        assert_eq!(err.to_string(), "Group \"ghosts\" is not in /etc/group");
        for bad in ["", ":1", "a:b:c", "app:"] {
            assert!(
                matches!(resolve(bad, PASSWD, GROUP), Err(UserError::BadSpec(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn no_spec_is_root_and_missing_files_are_empty() {
        let dir = std::env::temp_dir().join(format!("imp-user-test-{}", std::process::id()));
        assert_eq!(resolve_in(&dir, None).unwrap(), Identity::root());
        assert_eq!(resolve_in(&dir, Some("7")).unwrap().uid, 7);
        assert!(matches!(
            resolve_in(&dir, Some("app")),
            Err(UserError::UnknownUser(_))
        ));
    }
}
