//! An error with its causes on one log line (`error = %DisplayChain(&e)`): `Display` of a
//! `thiserror` error says only what was being done, its sources say why.

/// Prints an error and each of its sources, `: `-separated.
pub(crate) struct DisplayChain<'a>(pub(crate) &'a dyn std::error::Error);

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
