//! An error with its causes on one line (`what failed: why: deeper why`), for log fields,
//! status messages and answers that cross the wire: the one way imp's host-side crates print
//! an error (the guest init, which links no imp-api, has its own).

/// `e` and every source below it, joined by `: `.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

/// `e` and every source below it as a `Display` (`error = %DisplayChain(&e)` in a log field),
/// printed as [`chain`] prints it without building a string first.
pub struct DisplayChain<'a>(pub &'a dyn std::error::Error);

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_cause_is_named_in_order() {
        let outer = Wrap(std::io::Error::other("disk full"));
        assert_eq!(super::chain(&outer), "writing: disk full");
        assert_eq!(
            super::DisplayChain(&outer).to_string(),
            "writing: disk full"
        );
    }

    #[derive(Debug)]
    struct Wrap(std::io::Error);
    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("writing")
        }
    }
    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
}
