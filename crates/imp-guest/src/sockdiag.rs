//! Ending the TCP connections of one address from outside the processes that hold them, through
//! the kernel's socket diagnostics (`NETLINK_SOCK_DIAG`): a dump of the TCP sockets, then
//! `SOCK_DESTROY` of each one whose local address it is. The kernel aborts each as `ss -K`
//! does: the process gets `ECONNABORTED`, and a reset is sent if a route allows.
//!
//! A clone restored from a shared snapshot holds copies of the source's connections; it
//! destroys them with its interface down, so no reset reaches the source's peers. Needs the
//! `tcp_diag` module (and `inet_diag`), a kernel built with `CONFIG_INET_DIAG_DESTROY`, and
//! `CAP_NET_ADMIN`. Without them the connections are counted from `/proc/net/tcp*` instead,
//! so the caller can say what was left.

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto,
    setsockopt, socket, sockopt,
};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
/// `struct inet_diag_req_v2`: family, protocol, extensions, padding, states, the socket id.
const REQ_LEN: usize = 8 + ID_LEN;
/// `struct inet_diag_sockid`: ports, addresses, interface, cookie.
const ID_LEN: usize = 48;
/// `struct inet_diag_msg` up to and including the socket id (the rest is not read).
const MSG_MIN_LEN: usize = 4 + ID_LEN;

/// TCP states (`1 << state`) whose sockets carry a connection: everything but LISTEN,
/// TIME_WAIT (it sends nothing of its own) and CLOSE. NEW_SYN_RECV is a half-open one.
pub const CONNECTED_STATES: u32 = (1 << 1) // ESTABLISHED
    | (1 << 2) // SYN_SENT
    | (1 << 3) // SYN_RECV
    | (1 << 4) // FIN_WAIT1
    | (1 << 5) // FIN_WAIT2
    | (1 << 8) // CLOSE_WAIT
    | (1 << 9) // LAST_ACK
    | (1 << 11) // CLOSING
    | (1 << 12); // NEW_SYN_RECV

/// How long the kernel may take to answer one request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Why connections could not be destroyed.
#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    /// Talking to the kernel failed.
    #[error("{action} failed")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The kernel has no TCP socket diagnostics.
    #[error("The kernel has no TCP socket diagnostics (the tcp_diag module is not loaded)")]
    Unavailable,
    /// The kernel can list sockets but not destroy them.
    #[error("The kernel cannot destroy sockets (built without CONFIG_INET_DIAG_DESTROY)")]
    NoDestroy,
    /// The kernel refused a request.
    #[error("The kernel refused {action}")]
    Refused {
        /// What was asked.
        action: &'static str,
        /// Its errno.
        #[source]
        source: io::Error,
    },
    /// Some sockets could not be destroyed.
    #[error("Destroyed {closed} TCP connections; {failed} could not be destroyed")]
    Partial {
        /// How many were destroyed.
        closed: usize,
        /// How many were not.
        failed: usize,
        /// The first failure's errno.
        #[source]
        source: io::Error,
    },
    /// The kernel's answer could not be read.
    #[error("Malformed sock_diag answer: {0}")]
    Malformed(String),
}

/// One socket as sock_diag names it: enough to find it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SockId {
    /// Local port.
    pub sport: u16,
    /// Remote port.
    pub dport: u16,
    /// Local address (the first 4 bytes for AF_INET).
    pub src: [u8; 16],
    /// Remote address.
    pub dst: [u8; 16],
    /// Bound interface index.
    pub interface: u32,
    /// The kernel's cookie, which a destroy must repeat.
    pub cookie: [u32; 2],
}

impl SockId {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.sport.to_be_bytes());
        out.extend_from_slice(&self.dport.to_be_bytes());
        out.extend_from_slice(&self.src);
        out.extend_from_slice(&self.dst);
        out.extend_from_slice(&self.interface.to_ne_bytes());
        out.extend_from_slice(&self.cookie[0].to_ne_bytes());
        out.extend_from_slice(&self.cookie[1].to_ne_bytes());
    }

    fn decode(b: &[u8]) -> Option<SockId> {
        let b = b.get(..ID_LEN)?;
        let u32_at = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut src = [0u8; 16];
        let mut dst = [0u8; 16];
        src.copy_from_slice(&b[4..20]);
        dst.copy_from_slice(&b[20..36]);
        Some(SockId {
            sport: u16::from_be_bytes([b[0], b[1]]),
            dport: u16::from_be_bytes([b[2], b[3]]),
            src,
            dst,
            interface: u32_at(36),
            cookie: [u32_at(40), u32_at(44)],
        })
    }
}

/// A TCP socket in a dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSocket {
    /// `AF_INET` or `AF_INET6`.
    pub family: u8,
    /// Its TCP state.
    pub state: u8,
    /// Its id.
    pub id: SockId,
}

impl TcpSocket {
    /// Whether its local address is `local`, directly or as `::ffff:a.b.c.d` on an IPv6
    /// socket (a server listening on `[::]` that accepted an IPv4 client).
    pub fn is_on(&self, local: Ipv4Addr) -> bool {
        match i32::from(self.family) {
            libc::AF_INET => self.id.src[..4] == local.octets(),
            libc::AF_INET6 => self.id.src == local.to_ipv6_mapped().octets(),
            _ => false,
        }
    }
}

/// A netlink request carrying an `inet_diag_req_v2` for TCP.
pub fn request(kind: u16, flags: u16, seq: u32, family: u8, states: u32, id: &SockId) -> Vec<u8> {
    let len = NLMSG_HDRLEN + REQ_LEN;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.push(family);
    out.push(libc::IPPROTO_TCP as u8);
    out.push(0); // no extensions
    out.push(0);
    out.extend_from_slice(&states.to_ne_bytes());
    id.encode(&mut out);
    out
}

/// One message of the kernel's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A socket of a dump.
    Socket(TcpSocket),
    /// The end of a dump, with its error (0 or a negative errno).
    Done(i32),
    /// An acknowledgement (0) or a negative errno.
    Error(i32),
    /// Something else, ignored.
    Other(u16),
}

/// Splits a datagram from the kernel into its messages, each with its sequence number.
pub fn parse(buf: &[u8]) -> Result<Vec<(u32, Reply)>, DiagError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let header = buf
            .get(at..at + NLMSG_HDRLEN)
            .ok_or_else(|| DiagError::Malformed(format!("a header cut at byte {at}")))?;
        let len = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let kind = u16::from_ne_bytes([header[4], header[5]]);
        let seq = u32::from_ne_bytes([header[8], header[9], header[10], header[11]]);
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            return Err(DiagError::Malformed(format!(
                "a message of {len} bytes at byte {at} of {}",
                buf.len()
            )));
        }
        let body = &buf[at + NLMSG_HDRLEN..at + len];
        let int = |b: &[u8]| {
            b.get(..4)
                .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        };
        let reply = match kind {
            NLMSG_DONE => Reply::Done(int(body).unwrap_or(0)),
            NLMSG_ERROR => Reply::Error(
                int(body).ok_or_else(|| DiagError::Malformed("an empty error".into()))?,
            ),
            SOCK_DIAG_BY_FAMILY => {
                let id = (body.len() >= MSG_MIN_LEN)
                    .then(|| SockId::decode(&body[4..]))
                    .flatten()
                    .ok_or_else(|| {
                        DiagError::Malformed(format!("a socket of {} bytes", body.len()))
                    })?;
                Reply::Socket(TcpSocket {
                    family: body[0],
                    state: body[1],
                    id,
                })
            }
            other => Reply::Other(other),
        };
        out.push((seq, reply));
        at += len.next_multiple_of(4);
    }
    Ok(out)
}

/// What [`close_tcp`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Closed {
    /// Connections destroyed.
    pub closed: usize,
    /// Connections that ended by themselves between the dump and their destroy.
    pub gone: usize,
}

/// A sock_diag netlink socket.
struct Diag {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl Diag {
    fn open() -> Result<Self, DiagError> {
        let io = |action| {
            move |e: nix::Error| DiagError::Io {
                action,
                source: e.into(),
            }
        };
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .map_err(io("Opening a sock_diag netlink socket"))?;
        setsockopt(
            &fd,
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(ANSWER_TIMEOUT.as_secs() as i64, 0),
        )
        .map_err(io("Setting the netlink socket's timeout"))?;
        Ok(Diag {
            fd,
            seq: 0,
            buf: vec![0; 64 * 1024],
        })
    }

    fn send(
        &mut self,
        kind: u16,
        flags: u16,
        family: u8,
        states: u32,
        id: &SockId,
    ) -> Result<u32, DiagError> {
        self.seq += 1;
        let msg = request(kind, flags, self.seq, family, states, id);
        sendto(
            self.fd.as_raw_fd(),
            &msg,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .map_err(|e| DiagError::Io {
            action: "Sending a sock_diag request",
            source: e.into(),
        })?;
        Ok(self.seq)
    }

    /// The next datagram's messages that answer `seq`.
    fn receive(&mut self, seq: u32) -> Result<Vec<Reply>, DiagError> {
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut self.buf, MsgFlags::empty()).map_err(|e| {
                DiagError::Io {
                    action: "Waiting for the kernel's sock_diag answer",
                    source: e.into(),
                }
            })?;
            let replies: Vec<Reply> = parse(&self.buf[..n])?
                .into_iter()
                .filter(|(s, _)| *s == seq)
                .map(|(_, r)| r)
                .collect();
            if !replies.is_empty() {
                return Ok(replies);
            }
        }
    }

    /// Every TCP socket of `family` in a connected state.
    fn dump(&mut self, family: u8) -> Result<Vec<TcpSocket>, DiagError> {
        let seq = self.send(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            CONNECTED_STATES,
            &SockId::default(),
        )?;
        let mut sockets = Vec::new();
        loop {
            for reply in self.receive(seq)? {
                match reply {
                    Reply::Socket(s) => sockets.push(s),
                    Reply::Done(0) => return Ok(sockets),
                    Reply::Done(e) | Reply::Error(e) if -e == libc::ENOENT => {
                        return Err(DiagError::Unavailable);
                    }
                    Reply::Done(e) | Reply::Error(e) => {
                        return Err(DiagError::Refused {
                            action: "the dump of TCP sockets",
                            source: io::Error::from_raw_os_error(-e),
                        });
                    }
                    Reply::Other(_) => {}
                }
            }
        }
    }

    /// Destroys one socket; `Ok(false)` when it was already gone.
    fn destroy(&mut self, socket: &TcpSocket) -> Result<bool, io::Error> {
        let seq = self
            .send(
                SOCK_DESTROY,
                NLM_F_REQUEST | NLM_F_ACK,
                socket.family,
                u32::MAX,
                &socket.id,
            )
            .map_err(|e| io::Error::other(e.to_string()))?;
        loop {
            let replies = self
                .receive(seq)
                .map_err(|e| io::Error::other(e.to_string()))?;
            for reply in replies {
                match reply {
                    Reply::Error(0) => return Ok(true),
                    Reply::Error(e) if -e == libc::ENOENT => return Ok(false),
                    Reply::Error(e) => return Err(io::Error::from_raw_os_error(-e)),
                    _ => {}
                }
            }
        }
    }
}

/// Destroys every connected TCP socket (IPv4, and IPv6 with a v4-mapped address) whose local
/// address is `local`.
pub fn close_tcp(local: Ipv4Addr) -> Result<Closed, DiagError> {
    let mut diag = Diag::open()?;
    let mut sockets: Vec<TcpSocket> = diag.dump(libc::AF_INET as u8)?;
    match diag.dump(libc::AF_INET6 as u8) {
        Ok(v6) => sockets.extend(v6),
        // A kernel without IPv6 has no v4-mapped sockets either.
        Err(DiagError::Unavailable) => {}
        Err(e) => return Err(e),
    }
    let mut done = Closed::default();
    let mut failed = Vec::new();
    for socket in sockets.iter().filter(|s| s.is_on(local)) {
        match diag.destroy(socket) {
            Ok(true) => done.closed += 1,
            Ok(false) => done.gone += 1,
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                return Err(DiagError::NoDestroy);
            }
            Err(e) => failed.push(e),
        }
    }
    match failed.len() {
        0 => Ok(done),
        n => Err(DiagError::Partial {
            closed: done.closed,
            failed: n,
            source: failed.swap_remove(0),
        }),
    }
}

/// How many connected TCP sockets on `local` a `/proc/net/tcp` (or, with `v6`, a
/// `/proc/net/tcp6`) lists: the count when they cannot be destroyed.
pub fn count_in_proc(table: &str, local: Ipv4Addr, v6: bool) -> usize {
    // The table writes each 32-bit word of an address as the hex of its value in host order.
    let word = |octets: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(octets));
    let want = if v6 {
        let mapped = local.to_ipv6_mapped().octets();
        mapped
            .chunks(4)
            .map(|c| word([c[0], c[1], c[2], c[3]]))
            .collect::<String>()
    } else {
        word(local.octets())
    };
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let mut fields = line.split_whitespace().skip(1);
            let address = fields.next().and_then(|a| a.split(':').next());
            let state = fields.nth(1).and_then(|s| u8::from_str_radix(s, 16).ok());
            address.is_some_and(|a| a.eq_ignore_ascii_case(&want))
                && state.is_some_and(|s| s < 32 && CONNECTED_STATES & (1 << s) != 0)
        })
        .count()
}

/// [`count_in_proc`] over the guest's `/proc/net/tcp` and `/proc/net/tcp6`.
pub fn count_open(local: Ipv4Addr) -> io::Result<usize> {
    let v4 = std::fs::read_to_string("/proc/net/tcp")?;
    let v6 = std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    Ok(count_in_proc(&v4, local, false) + count_in_proc(&v6, local, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> SockId {
        let mut src = [0u8; 16];
        src[..4].copy_from_slice(&[10, 0, 0, 5]);
        let mut dst = [0u8; 16];
        dst[..4].copy_from_slice(&[10, 0, 0, 1]);
        SockId {
            sport: 22,
            dport: 40000,
            src,
            dst,
            interface: 0,
            cookie: [0x1234, 0x5678],
        }
    }

    #[test]
    fn a_destroy_request_has_the_kernels_layout() {
        let msg = request(
            SOCK_DESTROY,
            NLM_F_REQUEST | NLM_F_ACK,
            7,
            2,
            u32::MAX,
            &id(),
        );
        assert_eq!(msg.len(), 16 + 56);
        assert_eq!(msg[..4], 72u32.to_ne_bytes());
        assert_eq!(msg[4..6], 21u16.to_ne_bytes());
        assert_eq!(msg[6..8], 5u16.to_ne_bytes());
        assert_eq!(msg[8..12], 7u32.to_ne_bytes());
        assert_eq!(msg[16..20], [2, 6, 0, 0], "AF_INET, IPPROTO_TCP");
        assert_eq!(msg[20..24], u32::MAX.to_ne_bytes());
        assert_eq!(msg[24..28], [0, 22, 0x9c, 0x40], "ports in network order");
        assert_eq!(msg[28..32], [10, 0, 0, 5]);
        assert_eq!(msg[44..48], [10, 0, 0, 1]);
        assert_eq!(msg[64..68], 0x1234u32.to_ne_bytes(), "cookie");
        assert_eq!(SockId::decode(&msg[24..]), Some(id()));
    }

    /// A kernel answer: `(type, seq, body)` messages, each padded to 4 bytes.
    fn answer(messages: &[(u16, u32, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (kind, seq, body) in messages {
            let len = 16 + body.len();
            out.extend_from_slice(&(len as u32).to_ne_bytes());
            out.extend_from_slice(&kind.to_ne_bytes());
            out.extend_from_slice(&2u16.to_ne_bytes());
            out.extend_from_slice(&seq.to_ne_bytes());
            out.extend_from_slice(&0u32.to_ne_bytes());
            out.extend_from_slice(body);
            out.resize(out.len().next_multiple_of(4), 0);
        }
        out
    }

    fn socket_body(family: u8, state: u8, id: &SockId) -> Vec<u8> {
        let mut body = vec![family, state, 0, 0];
        id.encode(&mut body);
        body.extend_from_slice(&[0; 20]); // expires, queues, uid, inode
        body
    }

    #[test]
    fn a_dump_answer_is_split_into_sockets_and_its_end() {
        let buf = answer(&[
            (20, 3, socket_body(2, 1, &id())),
            (20, 3, socket_body(10, 8, &SockId::default())),
            (3, 3, 0i32.to_ne_bytes().to_vec()),
            (2, 4, (-libc::ENOENT).to_ne_bytes().to_vec()),
            (99, 4, vec![1, 2, 3]),
        ]);
        let got = parse(&buf).unwrap();
        assert_eq!(got.len(), 5);
        assert_eq!(
            got[0],
            (
                3,
                Reply::Socket(TcpSocket {
                    family: 2,
                    state: 1,
                    id: id()
                })
            )
        );
        assert!(matches!(
            got[1].1,
            Reply::Socket(TcpSocket {
                family: 10,
                state: 8,
                ..
            })
        ));
        assert_eq!(got[2], (3, Reply::Done(0)));
        assert_eq!(got[3], (4, Reply::Error(-libc::ENOENT)));
        assert_eq!(got[4], (4, Reply::Other(99)));
    }

    #[test]
    fn garbage_from_the_kernel_is_an_error_not_a_panic() {
        let good = answer(&[(20, 1, socket_body(2, 1, &id()))]);
        for cut in 1..good.len() {
            let _ = parse(&good[..cut]);
        }
        assert!(parse(&good[..10]).is_err());
        assert!(
            parse(&answer(&[(20, 1, vec![2, 1, 0, 0])])).is_err(),
            "short socket"
        );
        let mut lying = good.clone();
        lying[..4].copy_from_slice(&4000u32.to_ne_bytes());
        assert!(parse(&lying).is_err());
        lying[..4].copy_from_slice(&3u32.to_ne_bytes());
        assert!(parse(&lying).is_err());
        assert_eq!(parse(&[]).unwrap(), []);
    }

    #[test]
    fn sockets_are_matched_by_their_local_address_in_either_family() {
        let local = Ipv4Addr::new(10, 0, 0, 5);
        let v4 = TcpSocket {
            family: 2,
            state: 1,
            id: id(),
        };
        assert!(v4.is_on(local));
        assert!(
            !v4.is_on(Ipv4Addr::new(10, 0, 0, 1)),
            "the remote end is not ours"
        );
        let mut mapped = v4;
        mapped.family = 10;
        mapped.id.src = local.to_ipv6_mapped().octets();
        assert!(mapped.is_on(local));
        mapped.id.src = [0; 16];
        mapped.id.src[..4].copy_from_slice(&local.octets());
        assert!(
            !mapped.is_on(local),
            "an IPv6 address starting 0a00:0005 is not it"
        );
    }

    #[test]
    fn the_proc_tables_count_connected_sockets_of_the_address() {
        // 10.0.0.5 is 0500000A in a little-endian /proc/net/tcp.
        let here = format!("{:08X}", u32::from_ne_bytes([10, 0, 0, 5]));
        let tcp = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: {here}:0016 0100000A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 1\n\
             1: {here}:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2\n\
             2: {here}:0017 0100000A:9C41 06 00000000:00000000 00:00000000 00000000     0        0 0\n\
             3: 0100007F:0050 0100007F:C000 01 00000000:00000000 00:00000000 00000000     0        0 3\n\
             4: {here}:0018 0100000A:9C42 08 00000000:00000000 00:00000000 00000000     0        0 4\n"
        );
        let local = Ipv4Addr::new(10, 0, 0, 5);
        assert_eq!(
            count_in_proc(&tcp, local, false),
            2,
            "established and close-wait"
        );
        let mapped: String = local
            .to_ipv6_mapped()
            .octets()
            .chunks(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        let tcp6 = format!(
            "  sl  local_address                         remote_address                        st\n\
             0: {mapped}:0016 00000000000000000000000000000000:0000 01 0\n"
        );
        assert_eq!(count_in_proc(&tcp6, local, true), 1);
        assert_eq!(count_in_proc(&tcp6, local, false), 0);
    }
}
