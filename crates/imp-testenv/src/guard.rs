//! Skip-or-fail guard for tests that need something from the machine.

/// True when running under CI (`CI=true`), where a missing requirement is a failure.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Decides what a test does when `what` is unavailable: panics under CI, else prints a skip line.
///
/// Returns `true` when the requirement is met and the test should go on.
pub fn require(available: bool, what: &str) -> bool {
    if available {
        return true;
    }
    if in_ci() {
        panic!("requirement not met under CI=true: {what}");
    }
    eprintln!("SKIP (not CI): {what}");
    false
}

/// True when the process runs as root (uid 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// Finds an executable named `name` on `PATH`.
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Returns from the enclosing test unless `$cond` holds: skips locally, panics under `CI=true`.
///
/// `require!(imp_testenv::guard::is_root(), "root for network namespaces");`
#[macro_export]
macro_rules! require {
    ($cond:expr, $what:expr) => {
        if !$crate::guard::require($cond, $what) {
            return;
        }
    };
}

/// Returns the path of tool `$name` from `PATH`, or leaves the test as [`require!`] does.
#[macro_export]
macro_rules! require_tool {
    ($name:expr) => {
        match $crate::guard::which($name) {
            Some(p) => p,
            None => {
                $crate::guard::require(false, &format!("tool `{}` on PATH", $name));
                return;
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_requirement_passes() {
        assert!(require(true, "always"));
    }

    #[test]
    fn which_finds_sh_and_not_nonsense() {
        assert!(which("sh").is_some());
        assert!(which("definitely-not-a-tool-imp").is_none());
    }
}
