//! Named fault points: where a crash test (and the soak) makes a long-running process die at an
//! exact step, as `kill -9` would, to prove that what it leaves half done is finished right by
//! the next one. A point is a name (`claim.member-marked`); the process dies at the points
//! named in the environment variable [`ENV`] (comma-separated), read once. Unset, as it is in
//! every deployment, a point is one branch on a cached empty list.

use std::sync::OnceLock;

use nix::sys::signal::{Signal, raise};

/// The environment variable naming the points to die at.
pub const ENV: &str = "IMP_FAULT_AT";

/// The points named in [`ENV`].
fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| parse(&std::env::var(ENV).unwrap_or_default()))
}

/// The point names in `value` (comma-separated, blanks ignored).
fn parse(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Fault point `name`: when [`ENV`] names it, the process kills itself with SIGKILL here (no
/// destructor, flush or graceful shutdown runs, as with `kill -9`), after one log line.
pub fn point(name: &str) {
    if armed().iter().any(|p| p == name) {
        tracing::error!(
            point = name,
            "fault point reached: dying by SIGKILL as {ENV} asks"
        );
        // Nothing left to do if the signal could not be raised: abort is as abrupt.
        let _ = raise(Signal::SIGKILL);
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn the_points_are_the_comma_separated_names() {
        assert_eq!(
            parse(" claim.a,claim.b ,, "),
            ["claim.a".to_owned(), "claim.b".to_owned()]
        );
        assert!(parse("").is_empty());
    }
}
