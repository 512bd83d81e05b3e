//! The image pipeline's progress for one VM, passed from its shim to the front end that
//! started it: the shim appends every [`Event`] as a JSON line to `progress.jsonl` in the VM's
//! directory (when the spec asks, as `imp run` does), stamped with the milliseconds since it
//! began, and the front end follows the file as it follows the console.
//!
//! A file, not a socket: the front end may come later or go away, and the shim never waits for
//! it. Writes are whole lines (one `write` of an append-only file); a reader that meets a line
//! still being written keeps it until its end arrives.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use imp_image::progress::{Event, Observer};

/// The progress file's name inside a VM directory.
pub const PROGRESS_FILE: &str = "progress.jsonl";

/// The most bytes a reader takes from the file in one poll.
const POLL_BYTES: usize = 1 << 20;

/// One line of the progress file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// Milliseconds since the shim began reporting.
    pub ms: u64,
    /// What happened.
    #[serde(flatten)]
    pub event: Event,
}

/// The shim's side: an [`Observer`] appending to the progress file. Failing writes are
/// dropped: progress is for people, never a reason to fail a VM.
pub struct ProgressFile {
    file: Mutex<File>,
    started: Instant,
}

impl ProgressFile {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> io::Result<Self> {
        let file = File::options()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)?;
        Ok(Self {
            file: Mutex::new(file),
            started: Instant::now(),
        })
    }
}

impl Observer for ProgressFile {
    fn event(&self, event: Event) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let Ok(mut text) = serde_json::to_vec(&Line { ms, event }) else {
            return;
        };
        text.push(b'\n');
        if let Ok(mut f) = self.file.lock() {
            let _ = f.write_all(&text);
        }
    }
}

/// The front end's side: reads the lines added since the last poll.
#[derive(Debug)]
pub struct ProgressReader {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl ProgressReader {
    /// Follows `path` from its start (it may not exist yet).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The complete lines written since the last call; lines that do not parse (from a newer
    /// shim) are skipped. A missing file has no lines yet.
    pub fn poll(&mut self) -> Vec<Line> {
        let mut chunk = Vec::new();
        if let Ok(mut f) = File::open(&self.path)
            && f.seek(SeekFrom::Start(self.offset)).is_ok()
        {
            let _ = f.take(POLL_BYTES as u64).read_to_end(&mut chunk);
        }
        self.offset += chunk.len() as u64;
        self.partial.extend_from_slice(&chunk);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(end + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        complete
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .filter_map(|l| serde_json::from_slice(l).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn lines_written_by_the_shim_are_read_once_and_whole() {
        let dir = std::env::temp_dir().join(format!("imp-progress-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(PROGRESS_FILE);
        let mut reader = ProgressReader::new(&path);
        assert!(reader.poll().is_empty(), "no file yet");
        let writer = ProgressFile::create(&path).unwrap();
        writer.event(Event::Fetched { index: 0, bytes: 3 });
        writer.event(Event::Building);
        let got: Vec<Event> = reader.poll().into_iter().map(|l| l.event).collect();
        assert_eq!(
            got,
            [Event::Fetched { index: 0, bytes: 3 }, Event::Building]
        );
        assert!(reader.poll().is_empty(), "nothing new");
        // Half a line waits for its end; a line from a newer shim is skipped.
        let mut f = File::options().append(true).open(&path).unwrap();
        f.write_all(b"{\"ms\":5,\"event\":\"clo").unwrap();
        assert!(reader.poll().is_empty());
        f.write_all(b"ned\"}\n{\"ms\":6,\"event\":\"from_the_future\"}\n")
            .unwrap();
        let got = reader.poll();
        assert_eq!(
            got,
            [Line {
                ms: 5,
                event: Event::Cloned
            }]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
