//! README.md's status table against the tree: every test file or test function a row names in
//! backticks exists (issue 45: "a test fails when the README's status table names a test file or
//! function that does not exist").
//!
//! What counts as a name: a backticked `name.rs` or `dir/name.rs` (a file of that name, or whose
//! path ends so), a `name_e2e` (the end-to-end test file `crates/*/tests/name_e2e.rs`), and a
//! `module::function` or `file.rs::function` (a file whose stem is `module`, or the file, defines
//! `fn function`). Other backticked text (commands, fields, metrics) is not checked here.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};

/// A name the status table gives, and the README line it is on.
#[derive(Debug, PartialEq)]
enum Named {
    /// A Rust file: a bare file name or the tail of its path.
    File(String),
    /// An end-to-end test file by its stem (`snapshot_e2e`).
    E2e(String),
    /// A function in a module (a file stem) or a file: (`module` or `file.rs`, `function`).
    Function(String, String),
}

/// The backticked texts of the status table's rows (the table whose header is `| Part | State |`),
/// each with its 1-based line number.
fn table_names(readme: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_table = false;
    for (i, line) in readme.lines().enumerate() {
        if line.starts_with("| Part | State |") {
            in_table = true;
            continue;
        }
        if in_table && !line.starts_with('|') {
            break;
        }
        if in_table {
            out.extend(
                line.split('`')
                    .skip(1)
                    .step_by(2)
                    .map(|t| (i + 1, t.to_owned())),
            );
        }
    }
    out
}

/// Whether `s` is a Rust identifier made of lower-case letters, digits and underscores.
fn ident(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// What a backticked text names, if it names a test file or function.
fn classify(text: &str) -> Option<Named> {
    if let Some((module, function)) = text.rsplit_once("::") {
        let module = module.rsplit("::").next().unwrap_or(module);
        let file_ok = module
            .strip_suffix(".rs")
            .is_some_and(|m| m.split('/').all(|p| ident(p) || p.contains('-')));
        return (ident(function) && (ident(module) || file_ok))
            .then(|| Named::Function(module.to_owned(), function.to_owned()));
    }
    if let Some(stem) = text.strip_suffix(".rs") {
        let ok = stem.split('/').all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
        });
        return ok.then(|| Named::File(text.to_owned()));
    }
    (ident(text) && text.ends_with("_e2e")).then(|| Named::E2e(text.to_owned()))
}

/// Every `.rs` file of the tree that holds code (`crates/`, `fuzz/`, `xtask/`), relative to `root`.
fn rust_files(root: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for top in ["crates", "fuzz", "xtask", "tests"] {
        walk(&root.join(top), &mut out);
    }
    out.into_iter()
        .filter_map(|p| p.strip_prefix(root).ok().map(Path::to_path_buf))
        .collect()
}

/// Whether `source` defines a function `name`.
fn defines(source: &str, name: &str) -> bool {
    [format!("fn {name}("), format!("fn {name}<")]
        .iter()
        .any(|d| source.contains(d.as_str()))
}

/// Why `named` is not in the tree (`files`, relative to `root`), or `None` when it is.
fn missing(root: &Path, files: &[PathBuf], named: &Named) -> Option<String> {
    let ends_with = |tail: &str| {
        files
            .iter()
            .filter(|f| {
                let f = f.to_string_lossy();
                f == tail || f.ends_with(&format!("/{tail}"))
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    match named {
        Named::File(tail) => ends_with(tail)
            .is_empty()
            .then(|| format!("no file {tail}")),
        Named::E2e(stem) => {
            let found = files.iter().any(|f| {
                f.file_name().is_some_and(|n| *n == *format!("{stem}.rs"))
                    && f.parent().is_some_and(|d| d.ends_with("tests"))
            });
            (!found).then(|| format!("no end-to-end test file {stem}.rs under crates/*/tests"))
        }
        Named::Function(module, function) => {
            let candidates = if module.ends_with(".rs") {
                ends_with(module)
            } else {
                files
                    .iter()
                    .filter(|f| {
                        f.file_stem().is_some_and(|s| *s == **module)
                            || (f.file_name().is_some_and(|n| n == "mod.rs")
                                && f.parent()
                                    .and_then(Path::file_name)
                                    .is_some_and(|d| *d == **module))
                    })
                    .cloned()
                    .collect()
            };
            if candidates.is_empty() {
                return Some(format!("no file for module {module}"));
            }
            let defined = candidates.iter().any(|f| {
                std::fs::read_to_string(root.join(f)).is_ok_and(|s| defines(&s, function))
            });
            (!defined).then(|| format!("no fn {function} in {module}"))
        }
    }
}

#[test]
fn the_status_table_names_only_tests_that_exist() {
    let root = imp_testenv::workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let files = rust_files(&root);
    let names = table_names(&readme);
    assert!(
        !names.is_empty(),
        "README.md has no `| Part | State |` table"
    );
    let mut checked = 0;
    let mut problems = Vec::new();
    for (line, text) in &names {
        let Some(named) = classify(text) else {
            continue;
        };
        checked += 1;
        if let Some(why) = missing(&root, &files, &named) {
            problems.push(format!("README.md:{line}: `{text}`: {why}"));
        }
    }
    assert!(
        problems.is_empty(),
        "README.md's status table names tests that do not exist ({}):\n{}",
        problems.len(),
        problems.join("\n")
    );
    println!("README.md status table: {checked} test names checked");
    assert!(
        checked >= 10,
        "only {checked} test names found in the table"
    );
}

#[test]
fn names_are_told_apart_from_other_backticked_text() {
    assert_eq!(
        classify("snapshot_e2e.rs"),
        Some(Named::File("snapshot_e2e.rs".into()))
    );
    assert_eq!(
        classify("crates/imp/tests/cli.rs"),
        Some(Named::File("crates/imp/tests/cli.rs".into()))
    );
    assert_eq!(classify("pods_e2e"), Some(Named::E2e("pods_e2e".into())));
    assert_eq!(
        classify("cli::completions_offer_imps_commands_and_flags"),
        Some(Named::Function(
            "cli".into(),
            "completions_offer_imps_commands_and_flags".into()
        ))
    );
    assert_eq!(
        classify("crates/imp/tests/cli.rs::f"),
        Some(Named::Function(
            "crates/imp/tests/cli.rs".into(),
            "f".into()
        ))
    );
    for other in [
        "imp exec -- true",
        "spec.egress.allow",
        "imp_vm_guest_*{impvm,namespace,node}",
        "/metrics",
        "charts/imp",
        "network_overrides",
    ] {
        assert_eq!(classify(other), None, "{other}");
    }
    let readme = "# x\n| Part | State |\n|---|---|\n| a `b_e2e` | `c.rs` |\n\nafter `d_e2e`\n";
    assert_eq!(
        table_names(readme),
        [(4, "b_e2e".to_owned()), (4, "c.rs".to_owned())]
    );
}

#[test]
fn a_name_that_is_not_in_the_tree_is_caught() {
    let root = imp_testenv::workspace_root();
    let files = rust_files(&root);
    for gone in [
        Named::File("no_such_e2e.rs".into()),
        Named::E2e("no_such_e2e".into()),
        Named::Function("cli".into(), "no_such_test".into()),
        Named::Function("no_such_module".into(), "f".into()),
    ] {
        assert!(missing(&root, &files, &gone).is_some(), "{gone:?}");
    }
    for here in [
        Named::File("cli.rs".into()),
        Named::File("crates/imp/tests/cli.rs".into()),
        Named::E2e("snapshot_e2e".into()),
        Named::Function(
            "cli".into(),
            "completions_offer_imps_commands_and_flags".into(),
        ),
        Named::Function("readme.rs".into(), "defines".into()),
    ] {
        assert_eq!(missing(&root, &files, &here), None, "{here:?}");
    }
}
