//! A test that runs itself again in a child process (in a namespace of its own, say) by name.
//!
//! libtest asked for a name that matches nothing runs no test and exits 0, so a child's exit
//! status alone would let a renamed test pass without running; [`one_test`] also reads the
//! child's summary line and fails unless exactly one test ran and passed.

use std::process::{Command, Stdio};

/// Runs `cmd` (the test binary, or a wrapper such as `unshare` around it, asked for test `name`
/// with `--exact`) and panics unless it exits 0 having run exactly one test, which passed.
///
/// The child's stderr goes to ours as it comes; its stdout (where libtest writes) is read, then
/// printed, then checked.
pub fn one_test(mut cmd: Command, name: &str) {
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("starting the child run of {name}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    assert!(
        out.status.success(),
        "{name} failed in its child run ({})",
        out.status
    );
    if let Err(e) = exactly_one_passed(&stdout) {
        panic!("the child run of {name}: {e} (was the test renamed?)");
    }
}

/// Checks libtest's summary (`test result: ok. 1 passed; 0 failed; 0 ignored; …`) in `stdout`:
/// exactly one test passed and none failed or was ignored.
pub fn exactly_one_passed(stdout: &str) -> Result<(), String> {
    let summary = stdout
        .lines()
        .rev()
        .find_map(|l| l.trim_start().strip_prefix("test result: "))
        .ok_or_else(|| "printed no `test result:` line".to_string())?;
    let count = |what: &str| -> Option<u64> {
        summary.split(';').find_map(|part| {
            let part = part.trim().trim_start_matches("ok.").trim();
            let part = part.trim_start_matches("FAILED.").trim();
            part.strip_suffix(what)
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
    };
    match (count("passed"), count("failed"), count("ignored")) {
        (Some(1), Some(0), Some(0)) if summary.starts_with("ok.") => Ok(()),
        (Some(passed), Some(failed), Some(ignored)) => Err(format!(
            "{passed} passed, {failed} failed, {ignored} ignored where exactly one test should \
             have run and passed: `{summary}`"
        )),
        _ => Err(format!("cannot read the summary `{summary}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_passed_test_is_accepted() {
        let out = "\nrunning 1 test\nsome output\ntest x ... ok\n\n\
                   test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 3 filtered out; \
                   finished in 9.87s\n\n";
        assert_eq!(exactly_one_passed(out), Ok(()));
    }

    #[test]
    fn a_name_that_matches_nothing_is_refused() {
        let out = "\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; \
                   0 measured; 4 filtered out; finished in 0.00s\n\n";
        let e = exactly_one_passed(out).unwrap_err();
        assert!(e.contains("0 passed"), "{e}");
    }

    #[test]
    fn two_tests_an_ignored_one_or_no_summary_are_refused() {
        let two = "test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out";
        assert!(exactly_one_passed(two).is_err());
        let ignored = "test result: ok. 0 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out";
        assert!(exactly_one_passed(ignored).is_err());
        let failed = "test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured";
        assert!(exactly_one_passed(failed).is_err());
        assert!(exactly_one_passed("running 1 test\n").is_err());
    }
}
