//! Pseudo-terminals for TTY execs: open a pair, make the slave the child's controlling
//! terminal, resize it.
#![allow(unsafe_code)]

use imp_proto::WindowSize;
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::pty::{Winsize, openpty};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// An open pseudo-terminal pair.
#[derive(Debug)]
pub struct Pty {
    /// The side the guest agent reads output from and writes input to.
    pub master: OwnedFd,
    /// The side the child gets as stdin, stdout and stderr.
    pub slave: OwnedFd,
}

fn winsize(size: WindowSize) -> Winsize {
    Winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// Opens a pair with the given size; both ends are close-on-exec so only the child's stdio
/// copies survive into it.
pub fn open(size: Option<WindowSize>) -> io::Result<Pty> {
    let ws = size.map(winsize);
    let pair = openpty(ws.as_ref(), None)?;
    for fd in [&pair.master, &pair.slave] {
        fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
    }
    Ok(Pty {
        master: pair.master,
        slave: pair.slave,
    })
}

/// Wires the slave to the command's stdio and makes it the controlling terminal of a new
/// session, so job control and Ctrl-C work as in a terminal.
pub fn attach(command: &mut Command, slave: &OwnedFd) -> io::Result<()> {
    command
        .stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave.try_clone()?));
    // SAFETY: the closure runs in the forked child before exec and calls only setsid(2) and
    // ioctl(2), which are async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Tells the terminal its new size (the kernel sends SIGWINCH to its foreground group).
pub fn resize(master: &OwnedFd, size: WindowSize) -> io::Result<()> {
    let ws = winsize(size);
    // SAFETY: TIOCSWINSZ reads one `struct winsize` from the pointer, which points at a live,
    // properly initialised Winsize for the duration of the call.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws as *const Winsize) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pty_opens_and_resizes() {
        let pty = open(Some(WindowSize { rows: 24, cols: 80 })).unwrap();
        resize(
            &pty.master,
            WindowSize {
                rows: 50,
                cols: 132,
            },
        )
        .unwrap();
        let mut ws = winsize(WindowSize { rows: 0, cols: 0 });
        // SAFETY: TIOCGWINSZ writes one winsize into the live local.
        let rc = unsafe {
            libc::ioctl(
                pty.slave.as_raw_fd(),
                libc::TIOCGWINSZ,
                &mut ws as *mut Winsize,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!((ws.ws_row, ws.ws_col), (50, 132));
    }
}
