//! The serial-console lines that tell the host how the workload ended when vsock cannot.

use crate::message::ExitStatus;

/// The prefix of the exit line: `IMP_EXIT <code>`.
pub const EXIT_PREFIX: &str = "IMP_EXIT ";

/// The line printed after `IMP_EXIT 0`.
pub const SUCCESS_LINE: &str = "IMP_SUCCESS";

/// The prefix of the line a guest prints when its kernel came up unable to run it and a new
/// boot may fare better: `IMP_BOOT_RETRY <why>` (see [`boot_retry_marker`]).
pub const BOOT_RETRY_PREFIX: &str = "IMP_BOOT_RETRY ";

/// How much of a guest's reason for a boot retry the host keeps.
pub const BOOT_RETRY_REASON_MAX: usize = 200;

/// The prefix of the line a guest prints when its user data failed and the workload was not
/// started: `IMP_USERDATA_FAILED <step and why>` (see [`user_data_failure_marker`]), printed
/// just before the exit marker.
pub const USER_DATA_FAILED_PREFIX: &str = "IMP_USERDATA_FAILED ";

/// How much of a guest's account of a user-data failure the host keeps.
pub const USER_DATA_REASON_MAX: usize = 1024;

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

/// The line a guest prints before it powers off to ask for another boot, on one line.
pub fn boot_retry_marker(reason: &str) -> String {
    let reason: String = reason.chars().filter(|c| !c.is_control()).collect();
    format!("{BOOT_RETRY_PREFIX}{reason}\n")
}

/// The reason of the last boot-retry line in console output, for the host: bounded and with
/// control characters dropped (the console is the guest's, so its words are untrusted). The
/// marker may follow a kernel log prefix (`[    1.234] `) on its line.
pub fn find_boot_retry(console: &str) -> Option<String> {
    console.lines().rev().find_map(|line| {
        let (_, reason) = line.split_once(BOOT_RETRY_PREFIX)?;
        Some(
            reason
                .trim_end_matches('\r')
                .chars()
                .filter(|c| !c.is_control())
                .take(BOOT_RETRY_REASON_MAX)
                .collect(),
        )
    })
}

/// The line a guest prints when a user-data step failed, on one line (line breaks become
/// ` | `, other control characters are dropped).
pub fn user_data_failure_marker(reason: &str) -> String {
    let reason = one_line(reason, usize::MAX);
    format!("\n{USER_DATA_FAILED_PREFIX}{reason}\n")
}

/// The account of the last user-data failure in console output whose exit marker follows
/// it, for the host: bounded to [`USER_DATA_REASON_MAX`] characters, control characters
/// dropped. The console is the guest's: this is the guest's word, as the exit code is.
pub fn find_user_data_failure(console: &str) -> Option<String> {
    let mut lines = console.lines().rev().map(|l| l.trim_end_matches('\r'));
    // The exit marker's lines (and the kernel's power-off lines) come after it.
    lines.find(|l| l.starts_with(EXIT_PREFIX))?;
    let reason = lines
        .find(|l| !l.trim().is_empty())?
        .strip_prefix(USER_DATA_FAILED_PREFIX)?;
    Some(one_line(reason, USER_DATA_REASON_MAX))
}

fn one_line(text: &str, max: usize) -> String {
    text.trim_end()
        .replace("\r\n", "\n")
        .replace('\n', " | ")
        .chars()
        .filter(|c| !c.is_control())
        .take(max)
        .collect()
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

    #[test]
    fn a_user_data_failure_is_found_right_before_the_exit_marker() {
        let line = user_data_failure_marker(
            "runcmd[1] exited with code 2; output:\nno such\x1b[2J file\n",
        );
        assert_eq!(
            line,
            "\nIMP_USERDATA_FAILED runcmd[1] exited with code 2; output: | no such[2J file\n"
        );
        let log = format!(
            "boot\r\n{line}{}[ 1.2] reboot: Power down\r\n",
            exit_marker(ExitStatus::Code(2))
        );
        assert_eq!(
            find_user_data_failure(&log).as_deref(),
            Some("runcmd[1] exited with code 2; output: | no such[2J file")
        );
        // A marker the workload printed long before its own exit is not the guest's account.
        let log = format!("{line}later output\n{}", exit_marker(ExitStatus::Code(1)));
        assert_eq!(find_user_data_failure(&log), None);
        assert_eq!(
            find_user_data_failure(&line),
            None,
            "no exit marker after it"
        );
        let long = user_data_failure_marker(&"x".repeat(5000));
        let log = format!("{long}{}", exit_marker(ExitStatus::Code(1)));
        assert_eq!(
            find_user_data_failure(&log).map(|r| r.len()),
            Some(USER_DATA_REASON_MAX)
        );
    }

    #[test]
    fn a_boot_retry_is_found_behind_a_kernel_prefix_bounded_and_cleaned() {
        let line = boot_retry_marker("no timer\u{1b}[2J");
        assert_eq!(line, "IMP_BOOT_RETRY no timer[2J\n");
        let log = format!("early boot\r\n[    1.234567] {line}[    1.3] reboot: Power down\r\n");
        assert_eq!(find_boot_retry(&log).as_deref(), Some("no timer[2J"));
        assert_eq!(find_boot_retry("IMP_EXIT 3\nIMP_BOOT_RETRYX\n"), None);
        let long = format!("{BOOT_RETRY_PREFIX}{}\u{7}\n", "x".repeat(5000));
        assert_eq!(
            find_boot_retry(&long).map(|r| r.len()),
            Some(BOOT_RETRY_REASON_MAX)
        );
        assert_eq!(find_exit_code(&log), None, "a retry is no exit");
    }
}
