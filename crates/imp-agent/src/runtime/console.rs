//! Following a VM's serial console log: what `imp run` prints while the workload runs, what
//! `imp console` shows, and the tail a failure Event carries.
//!
//! The guest's workload writes to the serial console, which the VMM appends to a log file. The
//! follower reads the file as it grows and hands complete lines on; [`Filter`] drops what is not
//! the workload's (kernel printk lines, the guest init's own `imp-guest:` lines and the exit
//! marker) unless the user asked for the raw console.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use imp_proto::marker::{EXIT_PREFIX, SUCCESS_LINE};

/// Most bytes one [`Follower::poll`] reads: the guest writes the log, and a guest that writes
/// gigabytes between two polls must not have them all held in memory at once.
pub const MAX_POLL_BYTES: u64 = 1 << 20;

/// Longest line handed on whole; a longer run without a newline (a guest may never print
/// one) is handed on in pieces of this size, so the pending line cannot grow without bound.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Reads a log file from an offset as it grows (from its start again when it is emptied).
#[derive(Debug)]
pub struct Follower {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    behind: bool,
}

impl Follower {
    /// Starts at the beginning of `path` (which may not exist yet).
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            offset: 0,
            partial: Vec::new(),
            behind: false,
        }
    }

    /// Starts after what `path` already holds (at the start of its last, unfinished line), for
    /// a log whose earlier lines were handed on by someone else (an agent before a restart). A
    /// missing file is followed from its start.
    pub fn from_end(path: &Path) -> std::io::Result<Self> {
        let mut f = Self::new(path);
        let mut file = match std::fs::File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(f),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        let window = len.min(MAX_LINE_BYTES as u64);
        file.seek(SeekFrom::Start(len - window))?;
        let mut buf = Vec::new();
        file.take(window).read_to_end(&mut buf)?;
        f.offset = match buf.iter().rposition(|&b| b == b'\n') {
            Some(pos) => len - window + pos as u64 + 1,
            // No line end within a line's length: what is there is handed on in pieces anyway.
            None => len,
        };
        Ok(f)
    }

    /// How many bytes of the file have been read.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Returns the complete lines (with their newline) written since the last call, reading
    /// at most [`MAX_POLL_BYTES`]; a line longer than [`MAX_LINE_BYTES`] comes in pieces
    /// (only the last one ends in a newline).
    pub fn poll(&mut self) -> std::io::Result<Vec<String>> {
        let mut file = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        // A log shorter than what was read of it has been started afresh (a VM booted again
        // after its guest asked for it empties its console): follow it from its start.
        if file.metadata()?.len() < self.offset {
            self.offset = 0;
            self.partial.clear();
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        let n = file.take(MAX_POLL_BYTES).read_to_end(&mut buf)?;
        self.offset += n as u64;
        self.behind = n as u64 == MAX_POLL_BYTES;
        let mut lines = Vec::new();
        let mut rest = &buf[..];
        while !rest.is_empty() {
            let room = MAX_LINE_BYTES - self.partial.len();
            let (piece, done) = match rest.iter().take(room).position(|&b| b == b'\n') {
                Some(pos) => (&rest[..=pos], true),
                None if rest.len() >= room => (&rest[..room], true),
                None => (rest, false),
            };
            self.partial.extend_from_slice(piece);
            rest = &rest[piece.len()..];
            if done {
                lines.push(String::from_utf8_lossy(&self.partial).into_owned());
                self.partial.clear();
            }
        }
        Ok(lines)
    }

    /// Whether the last [`Follower::poll`] stopped at its read limit before the end of the
    /// file: poll again before taking [`Follower::rest`] as the final line.
    pub fn behind(&self) -> bool {
        self.behind
    }

    /// Whatever is left after the last newline (used once the VM has ended).
    pub fn rest(&mut self) -> Option<String> {
        if self.partial.is_empty() {
            return None;
        }
        let s = String::from_utf8_lossy(&self.partial).into_owned();
        self.partial.clear();
        Some(s)
    }
}

/// The last `max` bytes of the log at `path`, starting at a line boundary (for failure Events
/// and for the exit marker, without keeping the whole console in memory). A missing file
/// reads as empty.
pub fn tail(path: &Path, max: u64) -> std::io::Result<String> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    let start = len.saturating_sub(max);
    file.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::new();
    file.take(max).read_to_end(&mut buf)?;
    if start > 0
        && let Some(pos) = buf.iter().position(|&b| b == b'\n')
    {
        buf.drain(..=pos);
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Most bytes a VM's serial log holds before [`rotate`] moves it aside (the agent's default).
pub const SERIAL_LOG_MAX_BYTES: u64 = 8 << 20;

/// The previous generation of the log at `path`: `<path>.1`.
pub fn previous(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Caps the serial log at `path` at `max` bytes, keeping one previous generation: when it holds
/// more, its content is copied to `<path>.1` (written under a temporary name and renamed over
/// the previous one, so `.1` is always whole) and the log is truncated in place. The VMM keeps
/// writing through its own descriptor, opened with `O_APPEND` (QEMU's `append=on` chardev,
/// Firecracker's stdout), so its next byte lands at the start of the emptied file; followers
/// see a log shorter than what they read and start over ([`Follower::poll`]). Bytes the guest
/// writes between the end of the copy and the truncation are lost. Returns the bytes moved
/// aside, or `None` when the log is within `max` or missing. Blocking.
pub fn rotate(path: &Path, max: u64) -> std::io::Result<Option<u64>> {
    let len = match std::fs::metadata(path) {
        Ok(md) => md.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if len <= max {
        return Ok(None);
    }
    let previous = previous(path);
    let mut tmp = previous.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let copied = (|| {
        let mut src = std::fs::File::open(path)?;
        let mut dst = std::fs::File::create(&tmp)?;
        let n = std::io::copy(&mut src, &mut dst)?;
        std::fs::rename(&tmp, &previous)?;
        Ok::<_, std::io::Error>(n)
    })();
    let moved = match copied {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(0)?;
    Ok(Some(moved))
}

/// The last `n` lines of `text`.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Where a console line belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line {
    /// The workload's output: to stdout.
    Workload,
    /// A message of the guest init that the user needs (e.g. why the workload could not
    /// start): to stderr.
    Guest,
    /// Kernel log, exit marker and routine init lines: not shown.
    Hidden,
}

/// Decides which console lines are the workload's output.
#[derive(Debug, Clone, Copy)]
pub struct Filter {
    /// Show every line as the console printed it.
    pub raw: bool,
}

impl Filter {
    /// Where `line` goes.
    pub fn classify(&self, line: &str) -> Line {
        if self.raw {
            return Line::Workload;
        }
        let l = line.trim_end_matches(['\n', '\r']);
        if is_printk(l) || l.starts_with(EXIT_PREFIX) || l == SUCCESS_LINE {
            Line::Hidden
        } else if let Some(msg) = l.strip_prefix("imp-guest: ") {
            if msg.starts_with("workload ended") {
                Line::Hidden
            } else {
                Line::Guest
            }
        } else {
            Line::Workload
        }
    }
}

/// A kernel log line: `[    1.234567] message`.
fn is_printk(line: &str) -> bool {
    let Some(rest) = line.strip_prefix('[') else {
        return false;
    };
    let Some((stamp, _)) = rest.split_once(']') else {
        return false;
    };
    let stamp = stamp.trim_start();
    !stamp.is_empty()
        && stamp.contains('.')
        && stamp.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_serial_log_past_its_cap_moves_to_dot_1_and_the_vmm_writes_on_at_its_start() {
        use std::io::Write as _;
        let dir = std::env::temp_dir().join(format!("imp-serial-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("serial.log");
        assert_eq!(
            rotate(&log, 10).unwrap(),
            None,
            "a missing log is left alone"
        );
        // The VMM's descriptor, as QEMU's `append=on` and Firecracker's stdout open it.
        let mut vmm = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        vmm.write_all(b"boot line\n").unwrap();
        assert_eq!(rotate(&log, 10).unwrap(), None, "within the cap");
        assert_eq!(std::fs::read(&log).unwrap(), b"boot line\n");
        vmm.write_all(b"second\n").unwrap();
        assert_eq!(rotate(&log, 10).unwrap(), Some(17));
        assert_eq!(
            std::fs::read(previous(&log)).unwrap(),
            b"boot line\nsecond\n"
        );
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        vmm.write_all(b"after\n").unwrap();
        assert_eq!(
            std::fs::read(&log).unwrap(),
            b"after\n",
            "the VMM's next write lands at the start, no hole before it"
        );
        // A second rotation replaces the previous generation: one is kept.
        vmm.write_all(b"more than ten\n").unwrap();
        assert_eq!(rotate(&log, 10).unwrap(), Some(20));
        assert_eq!(
            std::fs::read(previous(&log)).unwrap(),
            b"after\nmore than ten\n"
        );
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "no temporary left: {names:?}");
        // A follower that read the big log starts over on the emptied one.
        let mut f = Follower::new(&log);
        vmm.write_all(b"x\n".repeat(8).as_slice()).unwrap();
        assert_eq!(f.poll().unwrap().len(), 8);
        rotate(&log, 10).unwrap();
        vmm.write_all(b"fresh\n").unwrap();
        assert_eq!(f.poll().unwrap(), vec!["fresh\n".to_owned()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn filter_sorts_workload_guest_and_hidden_lines() {
        let f = Filter { raw: false };
        assert_eq!(
            f.classify("[    0.123456] Linux version 6.1\n"),
            Line::Hidden
        );
        assert_eq!(
            f.classify("[12345.000001] virtio_blk virtio0: [vda]\n"),
            Line::Hidden
        );
        assert_eq!(f.classify("IMP_EXIT 3\n"), Line::Hidden);
        assert_eq!(f.classify("IMP_SUCCESS\r\n"), Line::Hidden);
        assert_eq!(
            f.classify("imp-guest: workload ended (exit code 0) after 1s; ending the VM\n"),
            Line::Hidden
        );
        assert_eq!(
            f.classify("imp-guest: cannot start the workload: x not found\n"),
            Line::Guest
        );
        assert_eq!(f.classify("hello\n"), Line::Workload);
        assert_eq!(f.classify("[INFO] a workload log line\n"), Line::Workload);
        assert_eq!(f.classify("\n"), Line::Workload);
        assert_eq!(
            Filter { raw: true }.classify("IMP_EXIT 3\n"),
            Line::Workload
        );
    }

    #[test]
    fn follower_returns_only_complete_lines_as_the_file_grows() {
        let path = std::env::temp_dir().join(format!("imp-follow-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut f = Follower::new(&path);
        assert!(f.poll().unwrap().is_empty());
        std::fs::write(&path, "one\ntw").unwrap();
        assert_eq!(f.poll().unwrap(), ["one\n"]);
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        file.write_all(b"o\nthree").unwrap();
        assert_eq!(f.poll().unwrap(), ["two\n"]);
        assert_eq!(f.rest().as_deref(), Some("three"));
        assert_eq!(f.rest(), None);
        // The tail starts at a line boundary and holds at most the asked bytes.
        assert_eq!(tail(&path, 9).unwrap(), "three");
        assert_eq!(tail(&path, 1000).unwrap(), "one\ntwo\nthree");
        assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tail(&path, 10).unwrap(), "");
    }

    #[test]
    fn a_follower_from_the_end_hands_on_only_what_comes_next() {
        let path = std::env::temp_dir().join(format!("imp-follow-end-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            Follower::from_end(&path).unwrap().offset(),
            0,
            "missing file"
        );
        std::fs::write(&path, "old one\nold two\nhalf").unwrap();
        let mut f = Follower::from_end(&path).unwrap();
        assert_eq!(f.offset(), 16);
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        file.write_all(b" done\nnew\n").unwrap();
        assert_eq!(
            f.poll().unwrap(),
            ["half done\n", "new\n"],
            "the unfinished line is handed on whole"
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_console_emptied_by_a_new_boot_is_followed_from_its_start() {
        let path =
            std::env::temp_dir().join(format!("imp-follow-reboot-{}.log", std::process::id()));
        std::fs::write(
            &path,
            "[    1.2] IMP_BOOT_RETRY no timer\n[    1.3] reboot: Power down\npart",
        )
        .unwrap();
        let mut f = Follower::new(&path);
        assert_eq!(f.poll().unwrap().len(), 2);
        // The next boot empties the log and writes less than was read before.
        std::fs::write(&path, "").unwrap();
        assert!(f.poll().unwrap().is_empty());
        std::fs::write(&path, "hello\n").unwrap();
        assert_eq!(
            f.poll().unwrap(),
            ["hello\n"],
            "the old boot's partial line is dropped"
        );
        std::fs::remove_file(&path).unwrap();
    }

    /// A guest that prints megabytes without a newline: the follower hands them on in
    /// bounded pieces, reads a bounded amount per poll, and loses no byte.
    #[test]
    fn a_guest_that_never_ends_its_line_cannot_grow_the_follower_without_bound() {
        let path = std::env::temp_dir().join(format!("imp-follow-long-{}.log", std::process::id()));
        let total = 3 * MAX_POLL_BYTES as usize + 5;
        let mut log = vec![b'x'; total];
        log.extend_from_slice(b"\nend\n");
        std::fs::write(&path, &log).unwrap();
        let mut f = Follower::new(&path);
        let mut got = Vec::new();
        let mut polls = 0;
        loop {
            let lines = f.poll().unwrap();
            polls += 1;
            for l in &lines {
                assert!(l.len() <= MAX_LINE_BYTES, "a line of {} bytes", l.len());
            }
            assert!(f.partial.len() < MAX_LINE_BYTES);
            got.extend(lines.concat().into_bytes());
            if !f.behind() {
                break;
            }
        }
        assert_eq!(polls, 4, "each poll reads at most {MAX_POLL_BYTES} bytes");
        assert_eq!(f.rest(), None);
        assert_eq!(got, log);
        std::fs::remove_file(&path).unwrap();
    }
}
