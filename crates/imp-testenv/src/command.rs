//! Host commands a test runs for their effect (`ip`, `nft`, …).

use std::process::Command;

/// Runs `args[0]` with the rest of `args`, panicking with its stderr unless it succeeds;
/// returns its stdout.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
