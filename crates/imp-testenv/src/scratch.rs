//! Scratch directories for tests: fresh, unique per process and per call, under the system temp
//! directory, and left for their owner to remove.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a scratch directory could not be made.
#[derive(Debug, thiserror::Error)]
#[error("Creating scratch directory {path:?}")]
pub struct ScratchError {
    /// The directory that could not be created.
    pub path: PathBuf,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

/// Counts the directories made by this process, so two calls with one prefix never collide.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// The path of the `n`th scratch directory with `prefix` for process `pid`:
/// `<temp dir>/<prefix>-<pid>-<n>`.
fn path_for(prefix: &str, pid: u32, n: u64) -> PathBuf {
    std::env::temp_dir().join(format!("{prefix}-{pid}-{n}"))
}

/// A fresh, empty directory `<temp dir>/<prefix>-<pid>-<n>`, where `n` counts this process's
/// calls: whatever an earlier process with the same pid left there is removed first. Nothing
/// removes it afterwards; whoever owns it does.
pub fn scratch_dir(prefix: &str) -> Result<PathBuf, ScratchError> {
    let dir = path_for(
        prefix,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|source| ScratchError {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_names_prefix_pid_and_count() {
        assert_eq!(
            path_for("imp-x", 42, 7),
            std::env::temp_dir().join("imp-x-42-7")
        );
    }

    #[test]
    fn each_call_gets_a_fresh_empty_directory() -> Result<(), Box<dyn std::error::Error>> {
        let a = scratch_dir("imp-testenv-scratch")?;
        let b = scratch_dir("imp-testenv-scratch")?;
        assert_ne!(a, b);
        std::fs::write(a.join("left"), b"x")?;
        assert!(a.is_dir() && b.is_dir());
        assert_eq!(std::fs::read_dir(&b)?.count(), 0);
        std::fs::remove_dir_all(&a)?;
        std::fs::remove_dir_all(&b)?;
        Ok(())
    }

    #[test]
    fn names_the_directory_it_could_not_create() {
        let err = scratch_dir("no-such-parent/\0bad").expect_err("a NUL byte is not a valid path");
        assert!(
            err.path.to_string_lossy().contains("no-such-parent"),
            "{err}"
        );
    }
}
