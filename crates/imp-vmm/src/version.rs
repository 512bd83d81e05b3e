//! Which VMM, at which version, runs a VM and wrote its snapshot (`qemu 7.2.19`,
//! `firecracker 1.12.1`). A snapshot loads only in a VMM that can read what the writer wrote:
//! QEMU reads migration streams of older releases of the same machine type, Firecracker reads
//! snapshots of the versions its release notes list. The suspend record keeps the writer, so a
//! restore that fails after an upgrade says which VMM wrote the snapshot and which one refused
//! it, and a snapshot of one kind is never handed to the other.

use std::path::{Path, PathBuf};

/// `kind version` from what `binary --version` printed (`kind` is `qemu` or `firecracker`);
/// the version is the first word that starts with a digit (a leading `v` dropped), else
/// `unknown`.
pub fn identity(kind: &str, version_output: &str) -> String {
    let first = version_output.lines().next().unwrap_or_default();
    let version = first
        .split_whitespace()
        .map(|w| w.strip_prefix('v').unwrap_or(w))
        .find(|w| w.starts_with(|c: char| c.is_ascii_digit()))
        .unwrap_or("unknown");
    format!("{kind} {version}")
}

/// Whether `identity` (`kind version`) names a release of at least `major.minor`; an
/// unknown version is not.
pub fn at_least(identity: &str, (major, minor): (u32, u32)) -> bool {
    let version = identity.split_whitespace().nth(1).unwrap_or_default();
    let mut parts = version.split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .ok()
    });
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(ma), Some(mi)) => (ma, mi) >= (major, minor),
        (Some(ma), None) => ma > major,
        _ => false,
    }
}

/// The identity of `binary` (blocking: it runs `binary --version`).
pub fn of_binary(kind: &str, binary: &Path) -> String {
    let out = std::process::Command::new(binary).arg("--version").output();
    match out {
        Ok(o) => identity(kind, &String::from_utf8_lossy(&o.stdout)),
        Err(_) => identity(kind, ""),
    }
}

/// Why a snapshot written by `writer` cannot go to a VMM of kind `kind`, if it cannot.
/// Records from before the writer was kept (`None`) pass.
pub fn refuse_kind(writer: Option<&str>, kind: &str) -> Option<String> {
    let writer = writer?;
    let written_by = writer.split_whitespace().next().unwrap_or_default();
    (written_by != kind).then(|| {
        format!("its snapshot was written by {writer} and the VM now runs under {kind}: a snapshot loads only in the VMM kind that wrote it")
    })
}

/// What a failed restore adds to its error when the snapshot's writer is not the VMM that
/// tried to load it.
pub fn skew_note(writer: Option<&str>, loader: &str) -> Option<String> {
    let writer = writer?;
    if writer == loader {
        return None;
    }
    let why = match (numbers(writer), numbers(loader)) {
        (Some(w), Some(l)) if l < w => "an older VMM cannot read a newer one's snapshot",
        _ => "a newer VMM may not read an older snapshot",
    };
    Some(format!(
        "the snapshot was written by {writer} and this node runs {loader}; {why} (docs/upgrade.md: version skew)"
    ))
}

/// Whether identities `a` and `b` name the same kind and the same `major.minor` release
/// (patch releases of one QEMU read each other's streams; a machine type such as `microvm`
/// is not versioned, so another minor may not).
pub fn same_release(a: &str, b: &str) -> bool {
    let kind = |i: &str| i.split_whitespace().next().map(str::to_owned);
    let release = |i: &str| numbers(i).filter(|n| n.len() >= 2).map(|n| (n[0], n[1]));
    kind(a) == kind(b) && release(a).is_some() && release(a) == release(b)
}

/// Which of the `kept` VMMs (identity, binary) should load a snapshot written by `writer`
/// when the node's own VMM is `loader`: none when `loader` is of the writer's release (it
/// reads it), else the kept binary that is the writer itself, else one of its release.
/// An agent image keeps the previous QEMU beside the new one so that a VM suspended before
/// an upgrade resumes with the memory it had (docs/upgrade.md).
pub fn reader<'a>(writer: &str, loader: &str, kept: &'a [(String, PathBuf)]) -> Option<&'a Path> {
    if same_release(writer, loader) {
        return None;
    }
    kept.iter()
        .find(|(identity, _)| identity == writer)
        .or_else(|| {
            kept.iter()
                .find(|(identity, _)| same_release(identity, writer))
        })
        .map(|(_, binary)| binary.as_path())
}

/// The numbers of the version in `identity` (`qemu 7.2.22` → [7, 2, 22]), if it has one.
fn numbers(identity: &str) -> Option<Vec<u32>> {
    let version = identity.split_whitespace().nth(1)?;
    version
        .split('.')
        .map(|p| p.parse::<u32>().ok())
        .collect::<Option<Vec<u32>>>()
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_read_from_what_the_binaries_print() {
        assert_eq!(
            identity(
                "qemu",
                "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)\nCopyright (c) 2003-2022"
            ),
            "qemu 7.2.19"
        );
        assert_eq!(
            identity("firecracker", "Firecracker v1.12.1\n\n"),
            "firecracker 1.12.1"
        );
        assert_eq!(identity("qemu", ""), "qemu unknown");
    }

    #[test]
    fn versions_compare_by_major_then_minor() {
        assert!(at_least("qemu 10.0.2", (8, 2)));
        assert!(at_least("qemu 8.2.0", (8, 2)));
        assert!(at_least("qemu 9.1", (8, 2)));
        assert!(!at_least("qemu 8.1.5", (8, 2)));
        assert!(!at_least("qemu 7.2.22", (8, 2)));
        assert!(!at_least("qemu unknown", (8, 2)));
        assert!(!at_least("qemu", (8, 2)));
        assert!(at_least("qemu 9", (8, 2)));
        assert!(!at_least("qemu 8", (8, 2)));
    }

    #[test]
    fn a_snapshot_goes_only_to_its_kind_and_a_skew_is_named() {
        assert_eq!(refuse_kind(None, "qemu"), None);
        assert_eq!(refuse_kind(Some("qemu 7.2.19"), "qemu"), None);
        let refused = refuse_kind(Some("firecracker 1.12.1"), "qemu").unwrap();
        assert!(refused.contains("firecracker 1.12.1") && refused.contains("under qemu"));
        assert_eq!(skew_note(Some("qemu 7.2.19"), "qemu 7.2.19"), None);
        assert_eq!(skew_note(None, "qemu 8.2.2"), None);
        let note = skew_note(Some("qemu 7.2.19"), "qemu 8.2.2").unwrap();
        assert!(note.contains("written by qemu 7.2.19") && note.contains("runs qemu 8.2.2"));
        assert!(note.contains("a newer VMM may not read an older"), "{note}");
        let back = skew_note(Some("qemu 10.0.2"), "qemu 7.2.22").unwrap();
        assert!(back.contains("an older VMM cannot read a newer"), "{back}");
        let unknown = skew_note(Some("qemu unknown"), "qemu 7.2.22").unwrap();
        assert!(unknown.contains("may not read"), "{unknown}");
    }
    #[test]
    fn a_snapshot_goes_to_a_kept_vmm_of_its_writers_release() {
        assert!(same_release("qemu 7.2.19", "qemu 7.2.22"));
        assert!(!same_release("qemu 7.2.22", "qemu 10.0.2"));
        assert!(!same_release("qemu 7.2.22", "firecracker 7.2.22"));
        assert!(!same_release("qemu unknown", "qemu unknown"));
        assert!(!same_release("qemu 7", "qemu 7"));
        let kept = vec![
            ("qemu 7.2.19".to_owned(), PathBuf::from("/old/a")),
            ("qemu 7.2.22".to_owned(), PathBuf::from("/old/b")),
            ("qemu 9.2.0".to_owned(), PathBuf::from("/old/c")),
        ];
        // The node's own QEMU reads its release's snapshots: nothing kept is needed.
        assert_eq!(reader("qemu 10.0.1", "qemu 10.0.2", &kept), None);
        // The writer itself first, else one of its release.
        assert_eq!(
            reader("qemu 7.2.22", "qemu 10.0.2", &kept),
            Some(Path::new("/old/b"))
        );
        assert_eq!(
            reader("qemu 7.2.20", "qemu 10.0.2", &kept),
            Some(Path::new("/old/a"))
        );
        // No kept VMM of the writer's release: the node's own tries (and names the skew).
        assert_eq!(reader("qemu 8.2.2", "qemu 10.0.2", &kept), None);
        assert_eq!(reader("firecracker 7.2.22", "qemu 10.0.2", &kept), None);
        assert_eq!(reader("qemu 7.2.22", "qemu 10.0.2", &[]), None);
    }
}
