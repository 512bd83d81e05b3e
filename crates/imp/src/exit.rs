//! How `imp` ends: its exit codes, and a failure told in one line.
//!
//! Commands that run a workload (`imp run`, `imp exec`) exit with the workload's own code, so
//! imp's failures use the codes a shell and docker reserve: [`IMP_FAILED`] when imp itself
//! failed (flags, image, disk, boot, cluster), [`CANNOT_RUN`] and [`NOT_FOUND`] when the
//! command could not be started in the guest. Every other command exits 0 or
//! [`IMP_FAILED`].
//!
//! A failure is printed as one line, `imp: what failed: why: the cause…` (control characters
//! escaped), whatever `RUST_BACKTRACE` says; `--debug` or `IMP_LOG=debug` print the causes one
//! per line and the backtrace of where it failed.

use std::io::Write;

use imp_proto::client::ClientError;
use imp_proto::message::ErrorKind;

/// imp itself failed (as docker's 125): bad flags, the image, the disk, the VMM, the cluster.
pub const IMP_FAILED: u8 = 125;
/// The command was found in the guest but could not be run (not executable).
pub const CANNOT_RUN: u8 = 126;
/// The command (or its user or working directory) was not found in the guest.
pub const NOT_FOUND: u8 = 127;

/// The exit codes, for `--help` and the man pages.
pub const HELP: &str = "Exit codes: imp run and imp exec exit with the workload's own code \
(128+N when a signal N ended it; 143 when imp stop or Ctrl-C stopped the VM first). \
imp's own codes: 125 when imp itself failed (bad flags, the image, the disk, the VMM, the \
cluster; the message says what and why), 126 when the command exists in the guest but cannot \
be run, 127 when the command is not found in the guest. Other commands exit 0 or 125.";

/// Whether `IMP_LOG` asks for debugging output (`debug` or `trace`, alone or as a directive's
/// level).
pub fn debug_from_env(imp_log: Option<&str>) -> bool {
    imp_log.is_some_and(|v| {
        v.split(',')
            .filter_map(|d| d.rsplit('=').next())
            .any(|level| matches!(level.trim(), "debug" | "trace"))
    })
}

/// The exit code for a failure: a command the guest could not find or run keeps the shell's
/// code; everything else is imp's.
pub fn code_of(err: &anyhow::Error) -> u8 {
    let remote = err
        .chain()
        .find_map(|e| match e.downcast_ref::<ClientError>() {
            Some(ClientError::Remote(reply)) => Some(reply.kind),
            _ => None,
        });
    match remote {
        Some(ErrorKind::NotFound) => NOT_FOUND,
        Some(ErrorKind::PermissionDenied) => CANNOT_RUN,
        _ => IMP_FAILED,
    }
}

/// The one line a failure is told in: each cause after the last, joined by `: `, a cause that
/// only repeats the one before it left out, control characters escaped. An API server's
/// refusal is told by its Status alone (kube's error around it repeats it with a dump).
pub fn one_line(err: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        if matches!(
            cause.downcast_ref::<kube::Error>(),
            Some(kube::Error::Api(_))
        ) {
            continue;
        }
        let text = cause.to_string();
        let text = text.trim();
        if text.is_empty() || parts.last().is_some_and(|p| p.ends_with(text)) {
            continue;
        }
        parts.push(text.to_owned());
    }
    imp_image::layers::escape_controls(&parts.join(": "))
}

/// Prints `err` to stderr (one line, or with `debug` every cause and the backtrace) and
/// returns the exit code.
pub fn report(err: &anyhow::Error, debug: bool) -> u8 {
    let mut stderr = std::io::stderr().lock();
    let _ = if debug {
        writeln!(stderr, "imp: {err:?}")
    } else {
        writeln!(stderr, "imp: {}", one_line(err))
    };
    code_of(err)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anyhow::Context;
    use imp_proto::message::ErrorReply;

    #[test]
    fn a_failure_is_one_line_with_its_causes() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let err = Err::<(), _>(io)
            .context("reading /etc/x")
            .context("loading the kubeconfig\u{1b}[2J")
            .unwrap_err();
        assert_eq!(
            one_line(&err),
            "loading the kubeconfig\\u{1b}[2J: reading /etc/x: No such file or directory"
        );
        assert_eq!(code_of(&err), IMP_FAILED);
    }

    #[test]
    fn a_cause_that_repeats_the_message_is_said_once() {
        let err = anyhow::anyhow!("connection refused")
            .context("connecting: connection refused")
            .context("reading ImpVM d/v");
        assert_eq!(
            one_line(&err),
            "reading ImpVM d/v: connecting: connection refused"
        );
    }

    #[test]
    fn an_api_servers_refusal_is_told_by_its_status() {
        let status: kube::core::Status = serde_json::from_value(serde_json::json!({
            "status": "Failure", "code": 403, "reason": "Forbidden",
            "message": "impvms.imp.dev is forbidden: User \"alice\" cannot list resource \"impvms\"",
        }))
        .unwrap();
        let err = anyhow::Error::new(kube::Error::Api(Box::new(status)))
            .context("listing the ImpVMs of every namespace");
        assert_eq!(
            one_line(&err),
            "listing the ImpVMs of every namespace: impvms.imp.dev is forbidden: User \"alice\" \
             cannot list resource \"impvms\": Forbidden"
        );
    }

    #[test]
    fn a_command_the_guest_cannot_find_or_run_keeps_the_shells_code() {
        let remote = |kind| {
            anyhow::Error::new(ClientError::Remote(ErrorReply {
                kind,
                message: "nope".into(),
            }))
            .context("starting [\"nosuch\"] in the guest")
        };
        assert_eq!(code_of(&remote(ErrorKind::NotFound)), NOT_FOUND);
        assert_eq!(code_of(&remote(ErrorKind::PermissionDenied)), CANNOT_RUN);
        assert_eq!(code_of(&remote(ErrorKind::Internal)), IMP_FAILED);
    }

    #[test]
    fn imp_log_asks_for_debugging_by_level() {
        assert!(debug_from_env(Some("debug")));
        assert!(debug_from_env(Some("imp=trace")));
        assert!(debug_from_env(Some("warn,imp_agent=debug")));
        assert!(!debug_from_env(Some("info")));
        assert!(!debug_from_env(Some("")));
        assert!(!debug_from_env(None));
    }
}
