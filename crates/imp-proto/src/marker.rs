//! The serial-console lines that tell the host how the workload ended when vsock cannot.

use crate::message::ExitStatus;

/// The prefix of the exit line: `IMP_EXIT <code>`.
pub const EXIT_PREFIX: &str = "IMP_EXIT ";

/// The line printed after `IMP_EXIT 0`.
pub const SUCCESS_LINE: &str = "IMP_SUCCESS";

/// The text the guest prints on its console when the workload ends.
///
/// It starts with a newline so the marker begins a line even after output without one.
pub fn exit_marker(status: ExitStatus) -> String {
    let code = status.code();
    if code == 0 {
        format!("\n{EXIT_PREFIX}0\n{SUCCESS_LINE}\n")
    } else {
        format!("\n{EXIT_PREFIX}{code}\n")
    }
}

/// Finds the exit code in console output (the last marker wins), for the host.
pub fn find_exit_code(console: &str) -> Option<i32> {
    console
        .lines()
        .rev()
        .find_map(|line| line.trim_end_matches('\r').strip_prefix(EXIT_PREFIX))
        .and_then(|code| code.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_prints_both_lines() {
        assert_eq!(
            exit_marker(ExitStatus::Code(0)),
            "\nIMP_EXIT 0\nIMP_SUCCESS\n"
        );
    }

    #[test]
    fn failure_and_signals_print_only_the_code() {
        assert_eq!(exit_marker(ExitStatus::Code(3)), "\nIMP_EXIT 3\n");
        assert_eq!(exit_marker(ExitStatus::Signal(15)), "\nIMP_EXIT 143\n");
    }

    #[test]
    fn the_host_finds_the_code_in_console_noise() {
        let log = format!(
            "boot\r\nsome output{}[  1.2] reboot: Power down\r\n",
            exit_marker(ExitStatus::Code(7))
        );
        assert_eq!(find_exit_code(&log), Some(7));
        assert_eq!(find_exit_code("IMP_EXIT 0\r\nIMP_SUCCESS\r\n"), Some(0));
        assert_eq!(find_exit_code("no marker here\nIMP_EXITED 3\n"), None);
    }
}
