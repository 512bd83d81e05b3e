//! Showing the image pipeline's progress ([`imp_image::progress`]) to the person who
//! ran `imp run` or `imp image pull`, on stderr (stdout is the workload's).
//!
//! On a terminal, one line per layer with its bytes, rate and state, redrawn in place
//! (`indicatif`), then a line for the root filesystem and one for the VM's disk; elsewhere
//! (a pipe, a file, CI logs) plain `imp: …` lines, a few per layer and no control characters;
//! with `-q` nothing. Nothing is shown either while everything comes from the cache (as
//! `docker run` of a local image says nothing): progress appears with the first byte that has
//! to move. [`Progress::finish`] leaves the last state on screen and nothing is drawn after it,
//! so the workload's output, which starts only then, never mixes with progress.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use imp_agent::runtime::progress::ProgressReader;
use imp_image::progress::{Event, LayerInfo};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a plain log says how far a long download has got.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Redrawn lines on a terminal.
    Terminal,
    /// Log lines.
    Plain,
    /// Nothing (`-q`).
    Quiet,
}

impl Mode {
    /// Quiet when asked, lines redrawn in place when stderr is a capable terminal, else log
    /// lines.
    pub fn detect(quiet: bool) -> Self {
        if quiet {
            Mode::Quiet
        } else if std::io::stderr().is_terminal()
            && std::env::var("TERM").map_or(true, |t| t != "dumb")
        {
            Mode::Terminal
        } else {
            Mode::Plain
        }
    }
}

/// What is known about one layer.
#[derive(Debug, Clone, Default)]
struct Layer {
    info: Option<LayerInfo>,
    /// When its fetch began (the event's time), for the rate of plain lines.
    fetch_started: Option<Duration>,
    /// When a plain line last said how far the fetch got.
    last_said: Option<Duration>,
    /// Its verification has begun.
    verified: bool,
    /// Its verification is over (the next layer's began, or extraction).
    verify_done: bool,
    /// What its fetch came to (`downloaded 3.0 MiB in 7.0s (…)`, `already cached`).
    fetched: Option<String>,
}

/// The progress of one image pull (and VM disk) as it is shown.
pub struct Progress {
    mode: Mode,
    /// The image comes from a registry (layers are downloaded) or a local layout (copied).
    remote: bool,
    layers: Vec<Layer>,
    out: Box<dyn Write + Send>,
    bars: Option<Bars>,
    build_started: Option<Duration>,
    clone_started: Option<Duration>,
    /// Something had to be fetched or unpacked: progress is shown from then on.
    live: bool,
    /// Plain lines said before the progress went live.
    pending: Vec<String>,
    finished: bool,
}

/// The terminal's lines.
struct Bars {
    multi: MultiProgress,
    layers: Vec<ProgressBar>,
    rootfs: Option<ProgressBar>,
    disk: Option<ProgressBar>,
}

impl Progress {
    /// Progress of an image from a registry (`remote`) or a local layout, shown as `mode`
    /// says, on stderr.
    pub fn new(mode: Mode, remote: bool) -> Self {
        Self::with_output(mode, remote, Box::new(std::io::stderr()))
    }

    /// Plain or quiet progress written to `out` (terminal progress always draws on stderr).
    pub fn with_output(mode: Mode, remote: bool, out: Box<dyn Write + Send>) -> Self {
        Self {
            mode,
            remote,
            layers: Vec::new(),
            out,
            bars: (mode == Mode::Terminal).then(|| Bars {
                multi: MultiProgress::with_draw_target(ProgressDrawTarget::hidden()),
                layers: Vec::new(),
                rootfs: None,
                disk: None,
            }),
            build_started: None,
            clone_started: None,
            live: false,
            pending: Vec::new(),
            finished: false,
        }
    }

    /// Shows `event`, which happened `at` after the pipeline began.
    pub fn event(&mut self, at: Duration, event: &Event) {
        if self.finished || self.mode == Mode::Quiet {
            return;
        }
        match event {
            Event::Resolved { digest, layers } => self.resolved(digest, layers),
            Event::Fetching { index, bytes } => self.fetching(at, *index, *bytes),
            Event::Fetched { index, bytes } => self.fetched(at, *index, *bytes),
            Event::Verifying { index, bytes } => self.verifying(*index, *bytes),
            Event::Extracting { index, bytes } => self.extracting(*index, *bytes),
            Event::Extracted { index } => self.extracted(*index),
            Event::Building => self.building(at),
            Event::Built { size_bytes, cached } => self.built(at, *size_bytes, *cached),
            Event::Cloning { size_bytes } => self.cloning(at, *size_bytes),
            Event::Cloned => self.cloned(at),
            _ => {}
        }
    }

    /// Leaves what is shown as it is; nothing is drawn after this.
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        if let Some(bars) = &self.bars {
            for bar in bars.layers.iter().chain(&bars.rootfs).chain(&bars.disk) {
                if !bar.is_finished() {
                    bar.abandon();
                }
            }
        }
        let _ = self.out.flush();
    }

    fn say(&mut self, line: std::fmt::Arguments<'_>) {
        if self.live {
            let _ = writeln!(self.out, "imp: {line}");
        } else {
            self.pending.push(format!("imp: {line}"));
        }
    }

    /// Work that takes time has begun: show what was held back, and everything from now on.
    fn go_live(&mut self) {
        if self.live {
            return;
        }
        self.live = true;
        for line in std::mem::take(&mut self.pending) {
            let _ = writeln!(self.out, "{line}");
        }
        if let Some(bars) = &self.bars {
            bars.multi.set_draw_target(ProgressDrawTarget::stderr());
            // Lines that have not changed since they were added are drawn now too.
            for bar in &bars.layers {
                bar.tick();
            }
        }
    }

    /// Layers before `upto` have been read whole: their lines say so (the last byte count of
    /// a verification may be an early one, as counts are throttled).
    fn verified_before(&mut self, upto: usize) {
        for index in 0..upto.min(self.layers.len()) {
            if self.layers[index].verify_done || !self.layers[index].verified {
                continue;
            }
            self.layers[index].verify_done = true;
            let text = match &self.layers[index].fetched {
                Some(fetched) => format!("{fetched}, verified"),
                None => "verified".to_owned(),
            };
            if let Some(bar) = self.bar(index) {
                bar.set_style(state_style());
                bar.set_message(text);
            }
        }
    }

    /// `layer 1/3 0123456789ab` for plain lines.
    fn name(&self, index: usize) -> String {
        let short = self
            .layers
            .get(index)
            .and_then(|l| l.info.as_ref())
            .map(|i| short_digest(&i.digest))
            .unwrap_or_default();
        format!(
            "layer {}/{} {short}",
            index + 1,
            self.layers.len().max(index + 1)
        )
    }

    fn layer(&mut self, index: usize) -> &mut Layer {
        if self.layers.len() <= index {
            self.layers.resize(index + 1, Layer::default());
        }
        &mut self.layers[index]
    }

    fn bar(&mut self, index: usize) -> Option<&ProgressBar> {
        let bars = self.bars.as_mut()?;
        while bars.layers.len() <= index {
            let bar = bars.multi.add(ProgressBar::new(0));
            bar.set_style(state_style());
            bar.set_prefix(format!("layer {}", bars.layers.len() + 1));
            bar.set_message("waiting");
            bars.layers.push(bar);
        }
        bars.layers.get(index)
    }

    fn resolved(&mut self, digest: &str, layers: &[LayerInfo]) {
        self.layers = layers
            .iter()
            .map(|l| Layer {
                info: Some(l.clone()),
                ..Layer::default()
            })
            .collect();
        if self.mode == Mode::Plain {
            let total: u64 = layers.iter().map(|l| l.size).sum();
            self.say(format_args!(
                "image {}: {} layer{}, {}",
                short_digest(digest),
                layers.len(),
                if layers.len() == 1 { "" } else { "s" },
                bytes(total)
            ));
        }
        for (i, l) in layers.iter().enumerate() {
            if let Some(bar) = self.bar(i) {
                bar.set_prefix(short_digest(&l.digest));
                bar.set_length(l.size);
            }
        }
    }

    fn fetching(&mut self, at: Duration, index: usize, done: u64) {
        self.go_live();
        let size = self.size(index);
        let layer = self.layer(index);
        let first = layer.fetch_started.is_none();
        let started = *layer.fetch_started.get_or_insert(at);
        let due = layer
            .last_said
            .is_none_or(|t| at.saturating_sub(t) >= PLAIN_EVERY);
        if self.mode == Mode::Plain {
            if first {
                self.layer(index).last_said = Some(at);
                let name = self.name(index);
                let verb = self.verb(true);
                self.say(format_args!("{name}: {verb} {}", bytes(size)));
            } else if due {
                self.layer(index).last_said = Some(at);
                let name = self.name(index);
                self.say(format_args!(
                    "{name}: {} of {} ({})",
                    bytes(done),
                    bytes(size),
                    rate(done, at.saturating_sub(started))
                ));
            }
        }
        let verb = self.verb(true);
        if let Some(bar) = self.bar(index) {
            if first {
                bar.set_style(bytes_style());
                bar.set_length(size);
                bar.reset_elapsed();
                bar.set_message(verb);
            }
            bar.set_position(done);
        }
    }

    fn fetched(&mut self, at: Duration, index: usize, fetched: u64) {
        let started = self.layer(index).fetch_started;
        let took = started.map_or(Duration::ZERO, |s| at.saturating_sub(s));
        let text = if fetched == 0 {
            "already cached".to_owned()
        } else {
            format!(
                "{} {} in {} ({})",
                self.verb(false),
                bytes(fetched),
                span(took),
                rate(fetched, took)
            )
        };
        self.layer(index).fetched = Some(text.clone());
        if self.mode == Mode::Plain {
            let name = self.name(index);
            self.say(format_args!("{name}: {text}"));
        }
        if let Some(bar) = self.bar(index) {
            bar.set_style(state_style());
            bar.set_message(text);
        }
    }

    fn verifying(&mut self, index: usize, done: u64) {
        self.go_live();
        let size = self.size(index);
        self.verified_before(index);
        let layer = self.layer(index);
        let first = !layer.verified;
        layer.verified = true;
        if first && index == 0 && self.mode == Mode::Plain {
            let n = self.layers.len();
            self.say(format_args!(
                "verifying {n} layer{} before unpacking",
                if n == 1 { "" } else { "s" }
            ));
        }
        if let Some(bar) = self.bar(index) {
            if first {
                bar.set_style(bytes_style());
                bar.set_length(size);
                bar.reset_elapsed();
                bar.set_message("verifying");
            }
            bar.set_position(done);
        }
    }

    fn extracting(&mut self, index: usize, done: u64) {
        self.go_live();
        self.verified_before(self.layers.len());
        let size = self.size(index);
        if let Some(bar) = self.bar(index) {
            if bar.message() != "extracting" {
                bar.set_style(bytes_style());
                bar.set_length(size);
                bar.reset_elapsed();
                bar.set_message("extracting");
            }
            bar.set_position(done);
        }
    }

    fn extracted(&mut self, index: usize) {
        if self.mode == Mode::Plain {
            let name = self.name(index);
            self.say(format_args!("{name}: extracted"));
        }
        let text = match self.layer(index).fetched.clone() {
            Some(fetched) => format!("{fetched}, extracted"),
            None => "extracted".to_owned(),
        };
        if let Some(bar) = self.bar(index) {
            bar.set_style(state_style());
            bar.finish_with_message(text);
        }
    }

    fn building(&mut self, at: Duration) {
        self.go_live();
        self.build_started = Some(at);
        if self.mode == Mode::Plain {
            self.say(format_args!("building the root filesystem (ext4)"));
        }
        if let Some(bars) = self.bars.as_mut() {
            let bar = bars.multi.add(ProgressBar::new_spinner());
            bar.set_style(spinner_style());
            bar.set_prefix("root filesystem");
            bar.set_message("building (ext4)");
            bar.enable_steady_tick(Duration::from_millis(120));
            bars.rootfs = Some(bar);
        }
    }

    fn built(&mut self, at: Duration, size: u64, cached: bool) {
        let took = self
            .build_started
            .map_or(Duration::ZERO, |s| at.saturating_sub(s));
        let text = if cached {
            format!("cached ({})", bytes(size))
        } else {
            format!("built {} in {}", bytes(size), span(took))
        };
        if self.mode == Mode::Plain {
            self.say(format_args!("root filesystem {text}"));
        }
        if let Some(bars) = self.bars.as_mut() {
            // A cached base was never unpacked: each layer's last word stands.
            for bar in &bars.layers {
                if !bar.is_finished() {
                    bar.finish();
                }
            }
            let bar = bars
                .rootfs
                .get_or_insert_with(|| bars.multi.add(ProgressBar::new_spinner()));
            bar.set_style(state_style());
            bar.set_prefix("root filesystem");
            bar.finish_with_message(text);
        }
    }

    fn cloning(&mut self, at: Duration, size: u64) {
        self.clone_started = Some(at);
        if let Some(bars) = self.bars.as_mut() {
            let bar = bars.multi.add(ProgressBar::new_spinner());
            bar.set_style(spinner_style());
            bar.set_prefix("disk");
            bar.set_message(format!("making the VM's own {} disk", bytes(size)));
            bar.enable_steady_tick(Duration::from_millis(120));
            bars.disk = Some(bar);
        }
    }

    fn cloned(&mut self, at: Duration) {
        let took = self
            .clone_started
            .map_or(Duration::ZERO, |s| at.saturating_sub(s));
        if self.mode == Mode::Plain {
            self.say(format_args!("the VM's disk is ready ({})", span(took)));
        }
        if let Some(bar) = self.bars.as_ref().and_then(|b| b.disk.as_ref()) {
            bar.set_style(state_style());
            bar.finish_with_message(format!("ready in {}", span(took)));
        }
    }

    /// What fetching a layer is called: downloading from a registry, copying from a layout.
    fn verb(&self, ongoing: bool) -> &'static str {
        match (self.remote, ongoing) {
            (true, true) => "downloading",
            (true, false) => "downloaded",
            (false, true) => "copying",
            (false, false) => "copied",
        }
    }

    fn size(&self, index: usize) -> u64 {
        self.layers
            .get(index)
            .and_then(|l| l.info.as_ref())
            .map_or(0, |i| i.size)
    }
}

/// A VM's progress as its shim writes it ([`imp_agent::runtime::progress`]), followed while
/// `imp run` waits for the VM.
pub struct ShimProgress {
    reader: ProgressReader,
    shown: Progress,
}

impl ShimProgress {
    /// Follows the progress file of the VM directory `vm_dir`, shown as `mode` says, for an
    /// image from a registry (`remote`) or a local layout.
    pub fn new(vm_dir: &Path, mode: Mode, remote: bool) -> Self {
        Self {
            reader: ProgressReader::new(vm_dir.join(imp_agent::runtime::progress::PROGRESS_FILE)),
            shown: Progress::new(mode, remote),
        }
    }

    /// Shows what the shim has reported since the last call.
    pub fn poll(&mut self) {
        if self.shown.finished || self.shown.mode == Mode::Quiet {
            return;
        }
        for line in self.reader.poll() {
            self.shown
                .event(Duration::from_millis(line.ms), &line.event);
        }
    }

    /// Shows the last of it and stops showing (the VMM runs, or the VM has ended).
    pub fn finish(&mut self) {
        self.poll();
        self.shown.finish();
    }
}

/// `sha256:0123456789abcdef…` → `0123456789ab`, as docker shows layers.
fn short_digest(digest: &str) -> String {
    let hex = digest.split_once(':').map_or(digest, |(_, h)| h);
    hex.chars().take(12).collect()
}

/// Bytes in binary units, one decimal: `512 B`, `3.4 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A short time as people read it: `19ms`, `7.0s`.
fn span(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// `bytes` over `took` as a rate; instant transfers have none to speak of.
fn rate(n: u64, took: Duration) -> String {
    let secs = took.as_secs_f64();
    if secs < 0.001 {
        return "at once".into();
    }
    format!("{}/s", bytes((n as f64 / secs) as u64))
}

fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "  {prefix:15} {msg:11} [{bar:24.cyan/blue}] {bytes:>10} / {total_bytes:<10} {rate:>12}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .with_key("rate", average_rate)
    .progress_chars("=> ")
}

/// The phase's average rate so far; none in its first moments, where one early count would
/// read as gigabytes a second.
fn average_rate(state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write) {
    let took = state.elapsed();
    if took >= Duration::from_millis(200) {
        let _ = write!(w, "{}", rate(state.pos(), took));
    }
}

fn state_style() -> ProgressStyle {
    ProgressStyle::with_template("  {prefix:15} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("  {prefix:15} {spinner} {msg} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A `Write` whose bytes the test can read afterwards.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn cold_pull() -> Vec<(u64, Event)> {
        let layers = vec![
            LayerInfo {
                digest: format!("sha256:{}", "ab".repeat(32)),
                size: 3 << 20,
            },
            LayerInfo {
                digest: format!("sha256:{}", "cd".repeat(32)),
                size: 100,
            },
        ];
        vec![
            (
                0,
                Event::Resolved {
                    digest: format!("sha256:{}", "ef".repeat(32)),
                    layers,
                },
            ),
            (
                10,
                Event::Fetching {
                    index: 0,
                    bytes: 1 << 20,
                },
            ),
            (
                2000,
                Event::Fetching {
                    index: 0,
                    bytes: 2 << 20,
                },
            ),
            (
                7000,
                Event::Fetching {
                    index: 0,
                    bytes: 3 << 20,
                },
            ),
            (
                7010,
                Event::Fetched {
                    index: 0,
                    bytes: 3 << 20,
                },
            ),
            (7020, Event::Fetched { index: 1, bytes: 0 }),
            (7030, Event::Verifying { index: 0, bytes: 1 }),
            (7040, Event::Verifying { index: 1, bytes: 1 }),
            (7050, Event::Extracting { index: 0, bytes: 1 }),
            (7060, Event::Extracted { index: 0 }),
            (7070, Event::Extracted { index: 1 }),
            (7100, Event::Building),
            (
                8600,
                Event::Built {
                    size_bytes: 64 << 20,
                    cached: false,
                },
            ),
            (
                8700,
                Event::Cloning {
                    size_bytes: 1 << 30,
                },
            ),
            (8800, Event::Cloned),
        ]
    }

    fn shown(mode: Mode, events: &[(u64, Event)]) -> String {
        let out = Shared::default();
        let mut p = Progress::with_output(mode, true, Box::new(out.clone()));
        for (ms, e) in events {
            p.event(Duration::from_millis(*ms), e);
        }
        p.finish();
        p.event(Duration::ZERO, &Event::Building);
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn plain_progress_is_a_few_log_lines_per_layer() {
        let text = shown(Mode::Plain, &cold_pull());
        assert_eq!(
            text,
            "imp: image efefefefefef: 2 layers, 3.0 MiB\n\
             imp: layer 1/2 abababababab: downloading 3.0 MiB\n\
             imp: layer 1/2 abababababab: 3.0 MiB of 3.0 MiB (439.5 KiB/s)\n\
             imp: layer 1/2 abababababab: downloaded 3.0 MiB in 7.0s (438.9 KiB/s)\n\
             imp: layer 2/2 cdcdcdcdcdcd: already cached\n\
             imp: verifying 2 layers before unpacking\n\
             imp: layer 1/2 abababababab: extracted\n\
             imp: layer 2/2 cdcdcdcdcdcd: extracted\n\
             imp: building the root filesystem (ext4)\n\
             imp: root filesystem built 64.0 MiB in 1.5s\n\
             imp: the VM's disk is ready (100ms)\n"
        );
        assert!(
            !text.contains('\u{1b}'),
            "no control sequences in plain output"
        );
    }

    #[test]
    fn quiet_progress_says_nothing() {
        assert_eq!(shown(Mode::Quiet, &cold_pull()), "");
    }

    #[test]
    fn nothing_is_said_while_everything_comes_from_the_cache() {
        let layers = vec![LayerInfo {
            digest: format!("sha256:{}", "ab".repeat(32)),
            size: 100,
        }];
        let cached = [
            (
                0,
                Event::Resolved {
                    digest: format!("sha256:{}", "ef".repeat(32)),
                    layers,
                },
            ),
            (1, Event::Fetched { index: 0, bytes: 0 }),
            (
                2,
                Event::Built {
                    size_bytes: 64 << 20,
                    cached: true,
                },
            ),
            (
                3,
                Event::Cloning {
                    size_bytes: 1 << 30,
                },
            ),
            (90, Event::Cloned),
        ];
        assert_eq!(shown(Mode::Plain, &cached), "");
    }

    #[test]
    fn sizes_are_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(short_digest("sha256:0123456789abcdef"), "0123456789ab");
        assert_eq!(rate(1 << 20, Duration::from_secs(2)), "512.0 KiB/s");
        assert_eq!(rate(5, Duration::ZERO), "at once");
        assert_eq!(span(Duration::from_millis(19)), "19ms");
        assert_eq!(span(Duration::from_millis(7040)), "7.0s");
    }
}
