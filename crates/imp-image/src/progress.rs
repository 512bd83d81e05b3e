//! What the image pipeline tells a front end while it works: layers fetched (bytes so far),
//! verified and extracted, the ext4 base built, the VM's disk cloned.
//!
//! The pipeline reports to an [`Observer`] through a [`Reporter`]; the node agent keeps the
//! default, which ignores everything, and `imp run` / `imp image pull` render the events as
//! per-layer progress. Reporting never changes what the pipeline does: an observer only sees.
//! Byte counts are cumulative and throttled ([`BYTES_EVERY`]), so an observer may write each
//! event somewhere (the shim appends them to a file the CLI follows) without slowing a pull.

use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Byte counts of one layer are reported at most this often (and once more when it is done).
pub const BYTES_EVERY: Duration = Duration::from_millis(100);

/// One layer of the image being pulled, as the manifest describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInfo {
    /// `sha256:…` of the compressed blob.
    pub digest: String,
    /// The blob's size in bytes.
    pub size: u64,
}

/// One step of bringing an image onto this machine and giving a VM its disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Event {
    /// The manifest and config are read: the image (by manifest digest) has these layers,
    /// lowest first; the blobs come next.
    Resolved {
        /// The manifest's digest.
        digest: String,
        /// Its layers.
        layers: Vec<LayerInfo>,
    },
    /// Layer `index`'s blob is being fetched (or copied from a local layout): `bytes` so far.
    Fetching {
        /// The layer, from 0.
        index: usize,
        /// Bytes in the cache so far.
        bytes: u64,
    },
    /// Layer `index`'s blob is in the cache: `bytes` were fetched now, 0 when it was already
    /// there.
    Fetched {
        /// The layer, from 0.
        index: usize,
        /// Bytes fetched by this pull.
        bytes: u64,
    },
    /// Layer `index` is read whole before anything is written (digest, trailer, diff_id,
    /// entry counts): `bytes` of its blob so far.
    Verifying {
        /// The layer, from 0.
        index: usize,
        /// Bytes of the blob read so far.
        bytes: u64,
    },
    /// Layer `index`'s files are being written: `bytes` of its blob read so far.
    Extracting {
        /// The layer, from 0.
        index: usize,
        /// Bytes of the blob read so far.
        bytes: u64,
    },
    /// Layer `index` is extracted.
    Extracted {
        /// The layer, from 0.
        index: usize,
    },
    /// The extracted tree is being written into the ext4 base.
    Building,
    /// The ext4 base is in the cache (`cached`: it was already, nothing was unpacked).
    Built {
        /// The base's size in bytes.
        size_bytes: u64,
        /// True when it was already cached.
        cached: bool,
    },
    /// The VM's own disk of `size_bytes` is being made from the base.
    Cloning {
        /// The disk's size in bytes.
        size_bytes: u64,
    },
    /// The VM's disk is ready.
    Cloned,
}

/// Receives the pipeline's [`Event`]s. Called from async tasks and blocking threads alike, so
/// it must be quick and must not block on the pipeline.
pub trait Observer: Send + Sync {
    /// One event, in the order the pipeline went through it.
    fn event(&self, event: Event);
}

/// The observer that ignores everything (the node agent's).
#[derive(Debug, Clone, Copy, Default)]
pub struct Ignore;

impl Observer for Ignore {
    fn event(&self, _: Event) {}
}

/// How the pipeline reports: a cheap handle on an [`Observer`].
#[derive(Clone)]
pub struct Reporter(Arc<dyn Observer>);

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reporter")
    }
}

impl Default for Reporter {
    fn default() -> Self {
        Self(Arc::new(Ignore))
    }
}

impl Reporter {
    /// Reports to `observer`.
    pub fn new(observer: Arc<dyn Observer>) -> Self {
        Self(observer)
    }

    /// Reports `event`.
    pub fn emit(&self, event: Event) {
        self.0.event(event);
    }

    /// A meter of layer `index`'s bytes, reported as `make(index, bytes)`.
    pub(crate) fn meter(&self, index: usize, make: fn(usize, u64) -> Event) -> Meter {
        Meter {
            reporter: self.clone(),
            index,
            make,
            bytes: 0,
            last: None,
        }
    }
}

/// Counts one layer's bytes and reports them at most every [`BYTES_EVERY`].
pub(crate) struct Meter {
    reporter: Reporter,
    index: usize,
    make: fn(usize, u64) -> Event,
    bytes: u64,
    last: Option<Instant>,
}

impl Meter {
    /// Adds `n` bytes; reports the total if the last report is old enough (or there was none).
    pub(crate) fn add(&mut self, n: usize) {
        self.bytes += n as u64;
        let now = Instant::now();
        if self
            .last
            .is_none_or(|t| now.duration_since(t) >= BYTES_EVERY)
        {
            self.last = Some(now);
            self.reporter.emit((self.make)(self.index, self.bytes));
        }
    }
}

/// A reader that counts what passes through it into a [`Meter`].
pub(crate) struct Metered<R> {
    inner: R,
    meter: Meter,
}

impl<R> Metered<R> {
    pub(crate) fn new(inner: R, meter: Meter) -> Self {
        Self { inner, meter }
    }
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n > 0 {
            self.meter.add(n);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Record(Mutex<Vec<Event>>);

    impl Observer for Record {
        fn event(&self, event: Event) {
            self.0.lock().unwrap().push(event);
        }
    }

    #[test]
    fn bytes_are_reported_at_once_then_throttled() {
        let record = Arc::new(Record::default());
        let reporter = Reporter::new(record.clone());
        let mut r = Metered::new(
            &[7u8; 10_000][..],
            reporter.meter(2, |index, bytes| Event::Fetching { index, bytes }),
        );
        let mut buf = [0u8; 100];
        while r.read(&mut buf).unwrap() > 0 {}
        assert_eq!(r.meter.bytes, 10_000);
        let seen = record.0.lock().unwrap().clone();
        // The first chunk is reported at once; the other 99 within BYTES_EVERY are not.
        assert_eq!(
            seen,
            [Event::Fetching {
                index: 2,
                bytes: 100
            }]
        );
    }

    #[test]
    fn events_are_json_lines_with_their_name() {
        let e = Event::Fetched { index: 1, bytes: 5 };
        let text = serde_json::to_string(&e).unwrap();
        assert_eq!(text, r#"{"event":"fetched","index":1,"bytes":5}"#);
        assert_eq!(serde_json::from_str::<Event>(&text).unwrap(), e);
        let built: Event = serde_json::from_str(r#"{"event":"building"}"#).unwrap();
        assert_eq!(built, Event::Building);
    }
}
