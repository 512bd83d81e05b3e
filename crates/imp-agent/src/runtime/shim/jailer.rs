//! Whether Firecracker may be started, and how it is confined.
//!
//! Firecracker confines itself only under its `jailer` (a uid of the VM's own, a chroot, its own
//! namespaces): started bare by a root shim it runs as root with the host's whole filesystem
//! in view, and a guest that escapes into it owns the node. So a Firecracker without a jailer
//! beside it is refused ([`decide`]) unless the cluster admin opted out by name
//! ([`ALLOW_UNJAILED_FLAG`]); an opted-out start is logged as a warning every time. The agent's
//! capability probe, `imp run` and the shim all ask the same question, so the refusal holds
//! whichever front end wrote the VM's spec.

use std::path::{Path, PathBuf};

/// The flag of `imp agent` and `imp run` that lets Firecracker run without its jailer.
pub const ALLOW_UNJAILED_FLAG: &str = "--allow-unjailed-firecracker";
/// The chart value that sets [`ALLOW_UNJAILED_FLAG`] on every agent.
pub const ALLOW_UNJAILED_CHART_VALUE: &str = "agent.firecracker.allowUnjailed";

/// How a Firecracker VMM runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirecrackerJail {
    /// Under this jailer binary.
    Jailer(PathBuf),
    /// Unconfined, as its starter's user (root on a node): only where the admin opted out.
    Unjailed,
}

/// The `jailer` that ships beside `firecracker` in Firecracker's release bundles, if there.
pub fn jailer_beside(firecracker: &Path) -> Option<PathBuf> {
    Some(firecracker.with_file_name("jailer")).filter(|j| j.is_file())
}

/// Why Firecracker `fc` is not started without a jailer: the message names what is missing
/// and how to opt out.
pub fn unjailed_refusal(fc: &Path) -> String {
    format!(
        "refusing to start Firecracker {} without its jailer: there is no jailer at {}, and \
         without it Firecracker runs as root with no uid, chroot or namespaces of its own; put \
         Firecracker's jailer beside it, or accept an unconfined VMM with \
         {ALLOW_UNJAILED_FLAG} (imp agent; chart value {ALLOW_UNJAILED_CHART_VALUE}=true; imp \
         run)",
        fc.display(),
        fc.with_file_name("jailer").display()
    )
}

/// How Firecracker `fc` runs given the `jailer` found beside it: under the jailer; else
/// unconfined only when `allow_unjailed`, else refused with [`unjailed_refusal`].
pub fn decide(
    fc: &Path,
    jailer: Option<PathBuf>,
    allow_unjailed: bool,
) -> Result<FirecrackerJail, String> {
    match jailer {
        Some(j) => Ok(FirecrackerJail::Jailer(j)),
        None if allow_unjailed => Ok(FirecrackerJail::Unjailed),
        None => Err(unjailed_refusal(fc)),
    }
}

/// [`decide`] for the Firecracker installed at `fc` (looks for the jailer beside it).
pub fn for_binary(fc: &Path, allow_unjailed: bool) -> Result<FirecrackerJail, String> {
    decide(fc, jailer_beside(fc), allow_unjailed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_without_a_jailer_is_refused_unless_opted_out_by_name() {
        let fc = Path::new("/opt/fc/firecracker");
        let refused = decide(fc, None, false).unwrap_err();
        for needle in [
            "/opt/fc/firecracker",
            "/opt/fc/jailer",
            ALLOW_UNJAILED_FLAG,
            ALLOW_UNJAILED_CHART_VALUE,
            "runs as root",
        ] {
            assert!(refused.contains(needle), "{needle} missing: {refused}");
        }
        assert_eq!(decide(fc, None, true), Ok(FirecrackerJail::Unjailed));
        let jailer = PathBuf::from("/opt/fc/jailer");
        assert_eq!(
            decide(fc, Some(jailer.clone()), false),
            Ok(FirecrackerJail::Jailer(jailer.clone()))
        );
        // The opt-out never drops a jailer that is there.
        assert_eq!(
            decide(fc, Some(jailer.clone()), true),
            Ok(FirecrackerJail::Jailer(jailer))
        );
    }

    #[test]
    fn the_jailer_is_found_only_beside_the_binary() {
        let dir = std::env::temp_dir().join(format!("imp-jailer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fc = dir.join("firecracker");
        std::fs::write(&fc, b"").unwrap();
        assert!(for_binary(&fc, false).is_err());
        std::fs::write(dir.join("jailer"), b"").unwrap();
        assert_eq!(
            for_binary(&fc, false),
            Ok(FirecrackerJail::Jailer(dir.join("jailer")))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
