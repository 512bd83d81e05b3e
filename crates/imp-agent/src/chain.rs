//! An error with its causes on one line (`what failed: why: deeper why`), for log fields,
//! status messages and answers that cross the wire.

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

#[cfg(test)]
mod tests {
    #[test]
    fn every_cause_is_named_in_order() {
        let outer = Wrap(std::io::Error::other("disk full"));
        assert_eq!(super::chain(&outer), "writing: disk full");
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
