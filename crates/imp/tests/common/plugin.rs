//! `kubectl imp` as a user installs it: the `imp` binary linked as `kubectl-imp` in a directory
//! of its own, and the real kubectl (the test control plane's release) with that directory as
//! its whole `PATH`, so kubectl finds the plugin the way it finds any.

use std::path::PathBuf;
use std::process::Command;

/// A directory holding `kubectl-imp` → the `imp` binary under test.
pub struct Plugin {
    dir: PathBuf,
    kubectl: PathBuf,
}

impl Plugin {
    /// Links the plugin into a fresh directory named after `tag`; `None` when kubectl is not
    /// built (skip; under `CI=true` the guard fails the test instead).
    pub fn install(tag: &str) -> Option<Plugin> {
        let kubectl = imp_testenv::controlplane::kubectl();
        if !imp_testenv::guard::require(kubectl.is_ok(), "kubectl (scripts/kube/build)") {
            return None;
        }
        let dir =
            std::env::temp_dir().join(format!("imp-kubectl-plugin-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the plugin directory");
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_imp"), dir.join("kubectl-imp"))
            .expect("linking imp as kubectl-imp");
        Some(Plugin {
            dir,
            kubectl: kubectl.ok()?,
        })
    }

    /// Where the plugin is linked.
    pub fn path(&self) -> PathBuf {
        self.dir.join("kubectl-imp")
    }

    /// `kubectl ARGS…` with only the plugin's directory on `PATH`, no `KUBECONFIG` (a test sets
    /// one when it means to) and imp's logging at its default.
    pub fn kubectl(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.args(args)
            .env("PATH", &self.dir)
            .env_remove("KUBECONFIG")
            .env_remove("IMP_LOG")
            .env_remove("RUST_LOG");
        cmd
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
