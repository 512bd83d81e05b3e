//! Test-only: a fresh directory of its own per test (for sockets), removed with its guard.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

/// A directory `imp-<module>-<tag>-<pid>` under the temporary directory, made empty, removed
/// when dropped; `module` keeps two modules' tests of one name apart.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(module: &str, tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("imp-{module}-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
