//! What a test reads of a process in `/proc`: the fields of its `status` (uid, capabilities,
//! `NoNewPrivs`, `Seccomp`), to prove how a VMM runs, and which processes name something.

/// Pids of processes whose command line contains `needle` (a VM's directory, a socket).
/// Fails when `/proc` cannot be read, so that "none" always means none.
pub fn processes_naming(needle: &str) -> std::io::Result<Vec<u32>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            out.push(pid);
        }
    }
    Ok(out)
}

/// A process's `/proc/PID/status`.
#[derive(Debug, Clone)]
pub struct Status {
    pid: u32,
    text: String,
}

impl Status {
    /// Reads `/proc/PID/status` (empty when the process is gone).
    pub fn of(pid: u32) -> Self {
        Status {
            pid,
            text: std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default(),
        }
    }

    /// Field `name` (e.g. `CapEff`), trimmed; "" when absent.
    pub fn field(&self, name: &str) -> String {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
            .unwrap_or_default()
    }

    /// The real, effective, saved and filesystem uids.
    pub fn uids(&self) -> Vec<u32> {
        self.field("Uid")
            .split_whitespace()
            .filter_map(|u| u.parse().ok())
            .collect()
    }

    /// One line for a test's log: the fields that say how confined it is.
    pub fn summary(&self) -> String {
        format!(
            "pid {}: Uid {} CapEff {} CapBnd {} NoNewPrivs {} Seccomp {}",
            self.pid,
            self.field("Uid"),
            self.field("CapEff"),
            self.field("CapBnd"),
            self.field("NoNewPrivs"),
            self.field("Seccomp")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_a_status_with_its_uid() {
        let s = Status::of(std::process::id());
        assert_eq!(s.uids().len(), 4);
        assert!(!s.field("Seccomp").is_empty());
        assert_eq!(s.field("NoSuchField"), "");
    }
}
