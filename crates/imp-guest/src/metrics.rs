//! The guest's CPU, memory and disk figures, from `/proc/stat` (two samples), `/proc/meminfo`
//! and `statfs(/)`. Parsing is separate from reading so it is tested on fixed text.

use imp_proto::MetricsReport;
use std::path::Path;
use std::time::Duration;

/// Why metrics could not be collected.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A /proc file could not be read.
    #[error("Reading {path} failed")]
    Read {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A /proc file did not have the expected shape.
    #[error("Parsing {what} failed: {reason}")]
    Parse {
        /// The file or line.
        what: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// statfs failed.
    #[error("statfs of {0} failed")]
    Statfs(String, #[source] nix::Error),
}

/// The aggregate CPU counters of one `/proc/stat` sample, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuSample {
    /// All time (user..steal; guest time is already inside user).
    pub total: u64,
    /// Idle time.
    pub idle: u64,
    /// Time waiting for I/O.
    pub iowait: u64,
}

/// Parses the first `cpu ` line of `/proc/stat`.
pub fn parse_cpu(stat: &str) -> Result<CpuSample, MetricsError> {
    let bad = |reason: String| MetricsError::Parse {
        what: "/proc/stat cpu line",
        reason,
    };
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .ok_or_else(|| bad("no aggregate `cpu` line".into()))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| {
            f.parse::<u64>()
                .map_err(|e| bad(format!("field {f:?}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    if fields.len() < 5 {
        return Err(bad(format!("{} fields, need at least 5", fields.len())));
    }
    Ok(CpuSample {
        total: fields.iter().sum(),
        idle: fields[3],
        iowait: fields[4],
    })
}

/// CPU usage and iowait ratios between two samples (0 when no time passed).
pub fn cpu_ratios(before: CpuSample, after: CpuSample) -> (f64, f64) {
    let total = after.total.saturating_sub(before.total);
    if total == 0 {
        return (0.0, 0.0);
    }
    let idle = after.idle.saturating_sub(before.idle);
    let iowait = after.iowait.saturating_sub(before.iowait);
    let busy = total.saturating_sub(idle + iowait);
    (busy as f64 / total as f64, iowait as f64 / total as f64)
}

/// Parses `/proc/meminfo` into (used, total) bytes: used is MemTotal − MemAvailable.
pub fn parse_meminfo(meminfo: &str) -> Result<(u64, u64), MetricsError> {
    let field = |name: &str| -> Result<u64, MetricsError> {
        let line = meminfo
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or(MetricsError::Parse {
                what: "/proc/meminfo",
                reason: format!("no {name} line"),
            })?;
        let kib = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .map_err(|e| MetricsError::Parse {
                what: "/proc/meminfo",
                reason: format!("{name} {e}"),
            })?;
        Ok(kib * 1024)
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:")?;
    Ok((total.saturating_sub(available), total))
}

fn read(path: &Path) -> Result<String, MetricsError> {
    std::fs::read_to_string(path).map_err(|source| MetricsError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// Collects a report: `/proc` is `proc_dir`, the disk is the filesystem holding `disk_path`.
pub fn collect(
    proc_dir: &Path,
    disk_path: &Path,
    window: Duration,
) -> Result<MetricsReport, MetricsError> {
    let stat = proc_dir.join("stat");
    let before = parse_cpu(&read(&stat)?)?;
    std::thread::sleep(window);
    let after = parse_cpu(&read(&stat)?)?;
    let (cpu_usage_ratio, cpu_iowait_ratio) = cpu_ratios(before, after);
    let (memory_used_bytes, memory_total_bytes) = parse_meminfo(&read(&proc_dir.join("meminfo"))?)?;
    let fs = nix::sys::statfs::statfs(disk_path)
        .map_err(|e| MetricsError::Statfs(disk_path.display().to_string(), e))?;
    let block = fs.block_size() as u64;
    let disk_total_bytes = fs.blocks() * block;
    let disk_used_bytes = fs.blocks().saturating_sub(fs.blocks_free()) * block;
    Ok(MetricsReport {
        cpu_usage_ratio,
        cpu_iowait_ratio,
        memory_used_bytes,
        memory_total_bytes,
        disk_used_bytes,
        disk_total_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT1: &str =
        "cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 100 0 100 700 100 0 0 0 0 0\nintr 1\n";
    const STAT2: &str = "cpu  150 0 150 850 150 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";

    #[test]
    fn cpu_ratios_come_from_the_deltas() {
        let a = parse_cpu(STAT1).unwrap();
        assert_eq!(
            a,
            CpuSample {
                total: 1000,
                idle: 700,
                iowait: 100
            }
        );
        let b = parse_cpu(STAT2).unwrap();
        let (usage, iowait) = cpu_ratios(a, b);
        // Δtotal 300: busy 100 (user 50 + system 50), idle 150, iowait 50.
        assert!((usage - 100.0 / 300.0).abs() < 1e-9, "{usage}");
        assert!((iowait - 50.0 / 300.0).abs() < 1e-9, "{iowait}");
        assert_eq!(cpu_ratios(a, a), (0.0, 0.0));
    }

    #[test]
    fn malformed_stat_is_a_parse_error() {
        assert!(parse_cpu("intr 5\n").is_err());
        assert!(
            parse_cpu("cpu  1 2 x 4 5\n")
                .unwrap_err()
                .to_string()
                .contains("\"x\"")
        );
        assert!(parse_cpu("cpu  1 2 3\n").is_err());
    }

    #[test]
    fn meminfo_used_is_total_minus_available() {
        let text =
            "MemTotal:        2048 kB\nMemFree:          100 kB\nMemAvailable:     1024 kB\n";
        assert_eq!(parse_meminfo(text).unwrap(), (1024 * 1024, 2048 * 1024));
        let err = parse_meminfo("MemTotal: 5 kB\n").unwrap_err();
        assert!(err.to_string().contains("MemAvailable"), "{err}");
    }

    #[test]
    fn collect_reads_this_machine() {
        let m = collect(
            Path::new("/proc"),
            Path::new("/"),
            Duration::from_millis(20),
        )
        .unwrap();
        assert!(m.memory_total_bytes > 0 && m.memory_used_bytes <= m.memory_total_bytes);
        assert!(m.disk_total_bytes > 0 && m.disk_used_bytes <= m.disk_total_bytes);
        assert!((0.0..=1.0).contains(&m.cpu_usage_ratio));
    }
}
