//! The node's filesystem as every floor of the agent uses it: owner-only directories (for what
//! holds a VM's Secrets) and the free space of the filesystem holding a path. The lowest room
//! of the crate: it uses no other module of it.

use std::path::Path;

use imp_api::shared::DiskReport;

/// A directory builder that makes owner-only (0700) directories, created so rather than
/// changed after (no moment in which another user may open them).
pub fn private_dir_builder(recursive: bool) -> std::fs::DirBuilder {
    use std::os::unix::fs::DirBuilderExt as _;
    let mut b = std::fs::DirBuilder::new();
    b.recursive(recursive).mode(0o700);
    b
}

/// Creates `path` and any missing parent as owner-only (0700) directories; those that exist
/// are left as they are. For what holds a VM's Secrets: its directory, its snapshots.
pub fn create_private_dir_all(path: &Path) -> std::io::Result<()> {
    private_dir_builder(true).create(path)
}

/// Reads the free (for unprivileged writers) and total bytes of the filesystem holding `path`.
/// Blocking: call it through `spawn_blocking`.
pub fn usage(path: &Path) -> std::io::Result<DiskReport> {
    let st = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    let frsize = st.fragment_size();
    Ok(DiskReport {
        free: st.blocks_available().saturating_mul(frsize),
        total: st.blocks().saturating_mul(frsize),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn private_directories_are_owner_only_with_their_parents() {
        let base = std::env::temp_dir().join(format!("imp-host-fs-{}", std::process::id()));
        let deep = base.join("a/b");
        create_private_dir_all(&deep).unwrap();
        for d in [&base.join("a"), &deep] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        std::fs::remove_dir_all(&base).unwrap();
    }
}
