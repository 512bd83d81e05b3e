//! The byte streams the guest agent speaks over: AF_VSOCK in a VM, Unix sockets in tests.
#![allow(unsafe_code)]

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, VsockAddr, accept4, bind, connect, listen, socket,
};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// The vsock CID meaning "any local CID" when binding.
const VMADDR_CID_ANY: u32 = u32::MAX;

/// A connected stream the server can split between a reading and a writing thread.
pub trait Connection: Read + Write + Send + Sized + 'static {
    /// A second handle on the same connection.
    fn try_clone(&self) -> io::Result<Self>;
    /// Ends both directions, waking a thread blocked reading it.
    fn shutdown(&self) -> io::Result<()>;
    /// Bounds how long a read may block.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl Connection for UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        UnixStream::try_clone(self)
    }
    fn shutdown(&self) -> io::Result<()> {
        UnixStream::shutdown(self, Shutdown::Both)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
}

/// Something that hands out connections.
pub trait Listener: Send + 'static {
    /// The connections it yields.
    type Conn: Connection;
    /// Waits for the next connection.
    fn accept(&self) -> io::Result<Self::Conn>;
}

impl Listener for UnixListener {
    type Conn = UnixStream;
    fn accept(&self) -> io::Result<UnixStream> {
        UnixListener::accept(self).map(|(s, _)| s)
    }
}

/// A connected AF_VSOCK stream socket.
///
/// It is carried in a `UnixStream` because every method used here (read, write, shutdown,
/// dup, SO_RCVTIMEO) is a family-agnostic socket syscall; addresses are never asked for.
#[derive(Debug)]
pub struct VsockStream(UnixStream);

impl VsockStream {
    /// Connects to `cid:port` (the host is CID 2).
    pub fn connect(cid: u32, port: u32) -> io::Result<Self> {
        let fd = socket(
            AddressFamily::Vsock,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        connect(fd.as_raw_fd(), &VsockAddr::new(cid, port))?;
        Ok(Self(UnixStream::from(fd)))
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Connection for VsockStream {
    fn try_clone(&self) -> io::Result<Self> {
        self.0.try_clone().map(Self)
    }
    fn shutdown(&self) -> io::Result<()> {
        self.0.shutdown(Shutdown::Both)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.0.set_read_timeout(timeout)
    }
}

/// A listening AF_VSOCK socket.
#[derive(Debug)]
pub struct VsockListener(OwnedFd);

impl VsockListener {
    /// Listens on `port` for connections from the host.
    pub fn bind(port: u32) -> io::Result<Self> {
        let fd = socket(
            AddressFamily::Vsock,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        bind(fd.as_raw_fd(), &VsockAddr::new(VMADDR_CID_ANY, port))?;
        listen(&fd, Backlog::new(16)?)?;
        Ok(Self(fd))
    }
}

impl Listener for VsockListener {
    type Conn = VsockStream;
    fn accept(&self) -> io::Result<VsockStream> {
        let raw = accept4(self.0.as_raw_fd(), SockFlag::SOCK_CLOEXEC)?;
        // SAFETY: accept(2) just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(VsockStream(UnixStream::from(fd)))
    }
}

/// Binds a Unix listener, replacing a stale socket file (dev mode and tests).
pub fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    UnixListener::bind(path)
}
