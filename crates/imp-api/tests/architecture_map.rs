//! docs/architecture.md is the newcomer's map: every file or folder it names must exist, so a
//! move or rename that forgets the map fails here. A path in backticks is looked up where the
//! page says short paths live: at the repository root, under `crates/`, in a crate's `src/`
//! (short paths name a file in the crate the sentence is about), or under `docs/`.

#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Backticked words that name a file (by its extension) or a folder (ending in `/`), leaving
/// out paths with a placeholder: in capitals on a node (`snapshots/UID/`), or `<kind>`.
fn named_paths(text: &str) -> Vec<String> {
    const FILES: [&str; 6] = [".rs", ".md", ".yaml", ".toml", ".sh", ".py"];
    let placeholder = |w: &str| {
        w.split('/').any(|s| {
            (s.len() > 1 && s.chars().all(|c| c.is_ascii_uppercase())) || s.starts_with('<')
        })
    };
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| !w.contains(' ') && !w.is_empty() && !placeholder(w))
        .filter(|w| w.ends_with('/') || FILES.iter().any(|e| w.ends_with(e)))
        .map(str::to_owned)
        .collect()
}

/// Every folder a short path may start from: the root, `crates/`, `docs/`, each crate and its
/// `tests/`, and every folder of a crate's `src/` (a file named after its folder's mention: `forward.rs` in
/// "the gateway (`gateway/`) … `forward.rs`").
fn bases(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_path_buf(), root.join("crates"), root.join("docs")];
    let crates = std::fs::read_dir(root.join("crates")).expect("reading crates/");
    for c in crates.flatten() {
        out.push(c.path());
        out.push(c.path().join("tests"));
        let mut dirs = vec![c.path().join("src")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    dirs.push(e.path());
                }
            }
            out.push(d);
        }
    }
    out
}

fn exists_somewhere(bases: &[PathBuf], path: &str) -> bool {
    bases.iter().any(|b| b.join(path).exists())
}

#[test]
fn every_path_the_architecture_page_names_exists() {
    let root = repo();
    let page = root.join("docs/architecture.md");
    let text = std::fs::read_to_string(&page).expect("reading docs/architecture.md");
    let named = named_paths(&text);
    assert!(
        named.len() > 100,
        "only {} paths found: {named:?}",
        named.len()
    );
    let bases = bases(&root);
    let missing: Vec<&String> = named
        .iter()
        .filter(|p| !exists_somewhere(&bases, p))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md names paths that do not exist: {missing:?}"
    );
}

#[test]
fn a_path_that_does_not_exist_is_found_missing() {
    let root = repo();
    let named = named_paths("see `runtime/shim/gone.rs` and `a sentence.rs` and `node/`");
    assert_eq!(named, ["runtime/shim/gone.rs", "node/"]);
    let bases = bases(&root);
    assert!(!exists_somewhere(&bases, &named[0]));
    assert!(exists_somewhere(&bases, &named[1]));
}
