//! What a test prints about what it saw: an error with its causes, a process's output.

/// `e` and its causes, one after the other (`what: why: cause`).
pub fn chain(e: &dyn std::error::Error) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// Prints `what` ran, how it ended and its output, to the test's log; returns `out`.
pub fn logged(what: impl std::fmt::Debug, out: std::process::Output) -> std::process::Output {
    eprintln!(
        "{what:?}: {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reading x")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_chain_names_every_cause() {
        let e = Outer(std::io::Error::other("disk gone"));
        assert_eq!(chain(&e), "reading x: disk gone");
    }
}
