//! Records the commit the binary is built from for `imp version` (`IMP_GIT_COMMIT`; `unknown`
//! outside a git checkout), rerunning when the checkout's HEAD moves.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=IMP_GIT_COMMIT={commit}");
    // HEAD names the branch; the branch's ref (loose or packed) names the commit.
    let git_dir = git(&["rev-parse", "--absolute-git-dir"]).map(PathBuf::from);
    let common = git(&["rev-parse", "--git-common-dir"]).map(|d| {
        let d = PathBuf::from(d);
        if d.is_absolute() {
            d
        } else {
            Path::new(env!("CARGO_MANIFEST_DIR")).join(d)
        }
    });
    let branch = git(&["rev-parse", "--symbolic-full-name", "HEAD"]);
    let mut watched: Vec<PathBuf> = Vec::new();
    if let Some(dir) = &git_dir {
        watched.push(dir.join("HEAD"));
    }
    if let Some(dir) = &common {
        watched.push(dir.join("packed-refs"));
        if let Some(branch) = &branch {
            watched.push(dir.join(branch));
        }
    }
    // A path that does not exist would make cargo rerun this every build.
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    println!("cargo:rerun-if-changed=build.rs");
}
