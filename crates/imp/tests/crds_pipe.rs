//! `imp crds | head -1`: a reader that closes the pipe early ends the output quietly, with exit
//! code 0 and nothing on stderr.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

#[test]
fn crds_into_a_pipe_closed_after_one_line_exits_zero_quietly() {
    // The stream must be larger than a pipe's buffer (64 KiB on Linux), or the writer could
    // finish before the reader closes and the test would prove nothing.
    let full = imp_api::crd::yaml_stream().unwrap();
    assert!(
        full.len() > 64 * 1024,
        "CRD stream is only {} bytes",
        full.len()
    );

    let mut child = Command::new(env!("CARGO_BIN_EXE_imp"))
        .arg("crds")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader (and with it the pipe's read end) is dropped here, like `head -1` exiting.
    assert_eq!(first, "---\n");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "imp crds exited with {status}; stderr: {stderr}"
    );
    assert_eq!(stderr, "", "imp crds wrote to stderr");
}
