//! The serial console: where the exit marker goes so the host can read it from the VMM's log.

use imp_proto::ExitStatus;
use imp_proto::marker::exit_marker;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};

/// The console the guest writes its marker and messages to.
#[derive(Debug)]
pub enum Console {
    /// A console device (PID 1 mode).
    Device(File),
    /// Our stdout (dev mode and tests).
    Stdout,
}

impl Console {
    /// Opens /dev/console, falling back to /dev/ttyS0, then stdout.
    pub fn open_device() -> Self {
        for path in ["/dev/console", "/dev/ttyS0"] {
            if let Ok(f) = OpenOptions::new().write(true).open(path) {
                return Console::Device(f);
            }
        }
        Console::Stdout
    }

    /// Prints the `IMP_EXIT <code>` (and `IMP_SUCCESS`) marker.
    pub fn exit_marker(&mut self, status: ExitStatus) -> io::Result<()> {
        self.write_text(&exit_marker(status))
    }

    /// Writes text and flushes it.
    pub fn write_text(&mut self, text: &str) -> io::Result<()> {
        match self {
            Console::Device(f) => f.write_all(text.as_bytes()).and_then(|()| f.flush()),
            Console::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(text.as_bytes()).and_then(|()| out.flush())
            }
        }
    }
}
