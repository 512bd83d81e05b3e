//! Wake on traffic, the decisions: what to do with each Ethernet frame read from a sleeping
//! VM's TAP. An ARP request for the VM's address is answered with the VM's MAC (so a sender
//! with a cold neighbour cache can reach it); an IPv4 frame for the VM (unicast to its MAC,
//! to its address, any protocol) is held and wakes the VM; everything else is dropped and
//! counted. Held frames live in a [`HoldQueue`] bounded in frames and bytes.
//!
//! Pure: no I/O, no clock. [`super::sleeper`] reads the TAP and applies these decisions.
//! Every input is untrusted (any neighbour on the bridge can send anything), so parsing never
//! indexes past what it checked, and is fuzzed (`fuzz/fuzz_targets/wake_frames.rs`).

use std::collections::VecDeque;
use std::net::Ipv4Addr;

use super::plan::Mac;

/// Bytes of an Ethernet header (destination, source, EtherType); no FCS on a TAP.
pub const ETH_HEADER_LEN: usize = 14;
/// Bytes of an ARP packet for IPv4 over Ethernet.
const ARP_LEN: usize = 28;
/// Bytes of the ARP reply frame this module writes (Ethernet header + ARP, unpadded: the
/// kernel pads short frames where a wire needs it).
pub const ARP_REPLY_LEN: usize = ETH_HEADER_LEN + ARP_LEN;
/// Bytes of an IPv4 header without options.
const IPV4_MIN_HEADER: usize = 20;

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
/// 802.1Q, 802.1ad and the old QinQ tag: imp's bridges carry untagged frames only.
const ETHERTYPES_VLAN: [u16; 3] = [0x8100, 0x88a8, 0x9100];
const ARP_HTYPE_ETHERNET: u16 = 1;
const ARP_OP_REQUEST: u16 = 1;
const ARP_OP_REPLY: u16 = 2;
const BROADCAST: Mac = Mac([0xff; 6]);

/// The sleeping VM as its neighbours know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SleepingVm {
    /// The guest's IPv4 address.
    pub ip: Ipv4Addr,
    /// The guest interface's MAC.
    pub mac: Mac,
}

/// What to do with one frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write this ARP reply back into the TAP (it reaches the bridge as if the VM sent it).
    Reply {
        /// The whole reply frame.
        frame: [u8; ARP_REPLY_LEN],
        /// Who asked.
        requester: Ipv4Addr,
    },
    /// An IPv4 packet for the VM: keep the frame and wake the VM.
    Hold(Wake),
    /// Not for the VM, or not understood.
    Drop(DropReason),
}

/// The IPv4 packet that woke (or would wake) the VM, for logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wake {
    /// The packet's source address.
    pub source: Ipv4Addr,
    /// The IP protocol number (6 TCP, 17 UDP, 1 ICMP …).
    pub protocol: u8,
}

/// Why a frame was dropped; each reason has its own counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, strum::VariantArray)]
pub enum DropReason {
    /// Shorter than an Ethernet header.
    Short,
    /// VLAN-tagged (imp's bridges are untagged).
    Vlan,
    /// Neither IPv4 nor ARP (IPv6, LLDP, 802.3 lengths …).
    OtherEtherType,
    /// ARP that is not a well-formed IPv4-over-Ethernet request.
    ArpMalformed,
    /// An ARP reply or other operation: nothing to answer.
    ArpNotRequest,
    /// An ARP request for another address, or unicast to another MAC.
    ArpNotForVm,
    /// IPv4 with a broken header.
    Ipv4Malformed,
    /// IPv4 for another address, or not unicast to the VM's MAC (broadcast, multicast,
    /// unknown unicast the bridge flooded).
    Ipv4NotForVm,
}

impl DropReason {
    /// Every reason, in counter order.
    pub const ALL: &'static [Self] = <Self as strum::VariantArray>::VARIANTS;

    /// A short stable name, for logs and metric labels.
    pub fn label(self) -> &'static str {
        match self {
            DropReason::Short => "short",
            DropReason::Vlan => "vlan",
            DropReason::OtherEtherType => "other_ethertype",
            DropReason::ArpMalformed => "arp_malformed",
            DropReason::ArpNotRequest => "arp_not_request",
            DropReason::ArpNotForVm => "arp_not_for_vm",
            DropReason::Ipv4Malformed => "ipv4_malformed",
            DropReason::Ipv4NotForVm => "ipv4_not_for_vm",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

fn mac_at(b: &[u8], at: usize) -> Option<Mac> {
    b.get(at..at + 6)?.try_into().ok().map(Mac)
}

fn ipv4_at(b: &[u8], at: usize) -> Option<Ipv4Addr> {
    let o: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(Ipv4Addr::from(o))
}

fn is_multicast(mac: Mac) -> bool {
    mac.0[0] & 1 == 1
}

/// Decides what to do with `frame`, read from the TAP of the sleeping `vm`.
pub fn classify(vm: &SleepingVm, frame: &[u8]) -> Verdict {
    let (Some(dst), Some(ethertype)) = (mac_at(frame, 0), be16(frame, 12)) else {
        return Verdict::Drop(DropReason::Short);
    };
    let payload = frame.get(ETH_HEADER_LEN..).unwrap_or_default();
    match ethertype {
        ETHERTYPE_ARP => arp(vm, dst, payload),
        ETHERTYPE_IPV4 => ipv4(vm, dst, payload),
        t if ETHERTYPES_VLAN.contains(&t) => Verdict::Drop(DropReason::Vlan),
        _ => Verdict::Drop(DropReason::OtherEtherType),
    }
}

fn arp(vm: &SleepingVm, dst: Mac, arp: &[u8]) -> Verdict {
    let header = (be16(arp, 0), be16(arp, 2), arp.get(4), arp.get(5));
    let (Some(ARP_HTYPE_ETHERNET), Some(ETHERTYPE_IPV4), Some(6), Some(4)) = header else {
        return Verdict::Drop(DropReason::ArpMalformed);
    };
    let (Some(op), Some(sha), Some(spa), Some(tpa)) = (
        be16(arp, 6),
        mac_at(arp, 8),
        ipv4_at(arp, 14),
        ipv4_at(arp, 24),
    ) else {
        return Verdict::Drop(DropReason::ArpMalformed);
    };
    if op != ARP_OP_REQUEST {
        return Verdict::Drop(DropReason::ArpNotRequest);
    }
    // A reply goes to the sender's hardware address: it must be one host's.
    if is_multicast(sha) || sha == Mac([0; 6]) {
        return Verdict::Drop(DropReason::ArpMalformed);
    }
    // Requests are broadcast, or unicast to the cached MAC when a neighbour re-checks it.
    if tpa != vm.ip || (dst != BROADCAST && dst != vm.mac) {
        return Verdict::Drop(DropReason::ArpNotForVm);
    }
    Verdict::Reply {
        frame: arp_reply(vm, sha, spa),
        requester: spa,
    }
}

/// The ARP reply `vm` would send to the host at `to_mac`/`to_ip` (an address probe, with
/// sender 0.0.0.0, is answered the same way, to the prober's MAC).
pub fn arp_reply(vm: &SleepingVm, to_mac: Mac, to_ip: Ipv4Addr) -> [u8; ARP_REPLY_LEN] {
    let mut f = [0u8; ARP_REPLY_LEN];
    f[0..6].copy_from_slice(&to_mac.0);
    f[6..12].copy_from_slice(&vm.mac.0);
    f[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
    f[14..16].copy_from_slice(&ARP_HTYPE_ETHERNET.to_be_bytes());
    f[16..18].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&ARP_OP_REPLY.to_be_bytes());
    f[22..28].copy_from_slice(&vm.mac.0);
    f[28..32].copy_from_slice(&vm.ip.octets());
    f[32..38].copy_from_slice(&to_mac.0);
    f[38..42].copy_from_slice(&to_ip.octets());
    f
}

fn ipv4(vm: &SleepingVm, dst: Mac, ip: &[u8]) -> Verdict {
    let Some(&version_ihl) = ip.first() else {
        return Verdict::Drop(DropReason::Ipv4Malformed);
    };
    let header_len = usize::from(version_ihl & 0x0f) * 4;
    let total = be16(ip, 2).map(usize::from);
    let well_formed = version_ihl >> 4 == 4
        && header_len >= IPV4_MIN_HEADER
        && header_len <= ip.len()
        // The frame may carry padding after the packet, never less than the packet.
        && total.is_some_and(|t| t >= header_len && t <= ip.len());
    let (true, Some(protocol), Some(source), Some(destination)) =
        (well_formed, ip.get(9), ipv4_at(ip, 12), ipv4_at(ip, 16))
    else {
        return Verdict::Drop(DropReason::Ipv4Malformed);
    };
    if dst != vm.mac || destination != vm.ip {
        return Verdict::Drop(DropReason::Ipv4NotForVm);
    }
    Verdict::Hold(Wake {
        source,
        protocol: *protocol,
    })
}

/// Bounds of the frames held for a sleeping VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldBounds {
    /// At most this many frames.
    pub max_frames: usize,
    /// At most this many bytes of frames.
    pub max_bytes: usize,
}

impl Default for HoldBounds {
    /// 256 frames and 512 KiB: a burst of new connections and their retransmissions during
    /// the second or so a resume takes, without letting one VM's sender pin much memory.
    fn default() -> Self {
        HoldBounds {
            max_frames: 256,
            max_bytes: 512 * 1024,
        }
    }
}

/// Frames held for a sleeping VM, oldest first. When full, the newest frame is dropped: the
/// oldest are the first of each conversation (a TCP SYN) and the sender retransmits the rest.
#[derive(Clone, Debug)]
pub struct HoldQueue {
    bounds: HoldBounds,
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl HoldQueue {
    /// An empty queue.
    pub fn new(bounds: HoldBounds) -> HoldQueue {
        HoldQueue {
            bounds,
            frames: VecDeque::new(),
            bytes: 0,
        }
    }

    /// Keeps a copy of `frame` if it fits; says whether it did.
    pub fn push(&mut self, frame: &[u8]) -> bool {
        let fits = self.frames.len() < self.bounds.max_frames
            && self
                .bytes
                .checked_add(frame.len())
                .is_some_and(|b| b <= self.bounds.max_bytes);
        if fits {
            self.bytes += frame.len();
            self.frames.push_back(frame.to_vec());
        }
        fits
    }

    /// Frames held.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The held frames, oldest first.
    pub fn into_frames(self) -> Vec<Vec<u8>> {
        self.frames.into()
    }
}

/// What happened to the frames read from a sleeping VM's TAP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Frames read.
    pub frames: u64,
    /// ARP replies decided on.
    pub arp_replies: u64,
    /// ARP replies that could not be written back into the TAP.
    pub reply_errors: u64,
    /// IPv4 frames for the VM that were held.
    pub held: u64,
    /// IPv4 frames for the VM dropped because the hold queue was full.
    pub overflow_frames: u64,
    /// Their bytes.
    pub overflow_bytes: u64,
    dropped: [u64; DropReason::ALL.len()],
}

impl Counters {
    /// Frames dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }

    /// Frames dropped for any reason (the hold queue's overflow not included).
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().sum()
    }
}

/// What the TAP's reader must do after a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// Write this ARP reply into the TAP.
    Reply([u8; ARP_REPLY_LEN]),
    /// The first IPv4 frame for the VM arrived (it is held, unless the queue had no room):
    /// start the resume.
    Wake(Wake),
}

/// Everything a sleeping VM's TAP reader knows: the VM, the held frames, the counters and
/// the wake, once it came. Feed it every frame with [`Sleep::on_frame`].
#[derive(Clone, Debug)]
pub struct Sleep {
    vm: SleepingVm,
    queue: HoldQueue,
    counters: Counters,
    woke: Option<Wake>,
}

impl Sleep {
    /// Nothing read yet.
    pub fn new(vm: SleepingVm, bounds: HoldBounds) -> Sleep {
        Sleep {
            vm,
            queue: HoldQueue::new(bounds),
            counters: Counters::default(),
            woke: None,
        }
    }

    /// Takes one frame into account and says what to do about it.
    pub fn on_frame(&mut self, frame: &[u8]) -> Action {
        self.counters.frames += 1;
        match classify(&self.vm, frame) {
            Verdict::Reply { frame, .. } => {
                self.counters.arp_replies += 1;
                Action::Reply(frame)
            }
            Verdict::Hold(wake) => {
                if self.queue.push(frame) {
                    self.counters.held += 1;
                } else {
                    self.counters.overflow_frames += 1;
                    self.counters.overflow_bytes += frame.len() as u64;
                }
                match self.woke {
                    Some(_) => Action::None,
                    None => {
                        self.woke = Some(wake);
                        Action::Wake(wake)
                    }
                }
            }
            Verdict::Drop(reason) => {
                self.counters.dropped[reason.index()] += 1;
                Action::None
            }
        }
    }

    /// Counts an ARP reply that could not be written.
    pub fn reply_failed(&mut self) {
        self.counters.reply_errors += 1;
    }

    /// The VM.
    pub fn vm(&self) -> &SleepingVm {
        &self.vm
    }

    /// The counters so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The held frames.
    pub fn queue(&self) -> &HoldQueue {
        &self.queue
    }

    /// The first IPv4 frame for the VM, once one came.
    pub fn woke(&self) -> Option<Wake> {
        self.woke
    }

    /// The held frames (oldest first), the counters and the wake.
    pub fn finish(self) -> (Vec<Vec<u8>>, Counters, Option<Wake>) {
        (self.queue.into_frames(), self.counters, self.woke)
    }
}

/// Hand-built frames, for this module's tests, the sleeper's and the fuzz seeds.
pub mod frames {
    use super::*;

    /// An Ethernet header.
    pub fn ethernet(dst: Mac, src: Mac, ethertype: u16) -> Vec<u8> {
        let mut f = Vec::with_capacity(64);
        f.extend_from_slice(&dst.0);
        f.extend_from_slice(&src.0);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f
    }

    /// A broadcast ARP request from `sha`/`spa` for `tpa`.
    pub fn arp_request(sha: Mac, spa: Ipv4Addr, tpa: Ipv4Addr) -> Vec<u8> {
        let mut f = ethernet(BROADCAST, sha, ETHERTYPE_ARP);
        f.extend_from_slice(&ARP_HTYPE_ETHERNET.to_be_bytes());
        f.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        f.extend_from_slice(&[6, 4]);
        f.extend_from_slice(&ARP_OP_REQUEST.to_be_bytes());
        f.extend_from_slice(&sha.0);
        f.extend_from_slice(&spa.octets());
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&tpa.octets());
        f
    }

    /// An IPv4 frame from `src` to `dst` (addresses and MACs) with `payload` and protocol
    /// `protocol`; the header checksum is right.
    pub fn ipv4(
        (dst_mac, src_mac): (Mac, Mac),
        (src, dst): (Ipv4Addr, Ipv4Addr),
        protocol: u8,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut f = ethernet(dst_mac, src_mac, ETHERTYPE_IPV4);
        let total = u16::try_from(IPV4_MIN_HEADER + payload.len()).unwrap_or(u16::MAX);
        let mut h = [0u8; IPV4_MIN_HEADER];
        h[0] = 0x45;
        h[2..4].copy_from_slice(&total.to_be_bytes());
        h[8] = 64;
        h[9] = protocol;
        h[12..16].copy_from_slice(&src.octets());
        h[16..20].copy_from_slice(&dst.octets());
        let sum = h
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
            .sum::<u32>();
        let folded = (sum & 0xffff) + (sum >> 16);
        let checksum = !u16::try_from((folded & 0xffff) + (folded >> 16)).unwrap_or(0);
        h[10..12].copy_from_slice(&checksum.to_be_bytes());
        f.extend_from_slice(&h);
        f.extend_from_slice(payload);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::frames::{arp_request, ethernet, ipv4};
    use super::*;

    const VM: SleepingVm = SleepingVm {
        ip: Ipv4Addr::new(10, 0, 0, 5),
        mac: Mac([0x02, 0, 0, 0, 0, 5]),
    };
    const PEER_MAC: Mac = Mac([0x02, 0, 0, 0, 0, 9]);
    const PEER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 9);

    fn to_vm(protocol: u8, payload: &[u8]) -> Vec<u8> {
        ipv4((VM.mac, PEER_MAC), (PEER, VM.ip), protocol, payload)
    }

    #[test]
    fn arp_request_for_the_vm_gets_the_exact_reply() {
        let v = classify(&VM, &arp_request(PEER_MAC, PEER, VM.ip));
        let expected: [u8; ARP_REPLY_LEN] = [
            2, 0, 0, 0, 0, 9, // to the requester
            2, 0, 0, 0, 0, 5, // from the VM
            0x08, 0x06, // ARP
            0, 1, 0x08, 0x00, 6, 4, 0, 2, // Ethernet/IPv4, reply
            2, 0, 0, 0, 0, 5, 10, 0, 0, 5, // sender: the VM
            2, 0, 0, 0, 0, 9, 10, 0, 0, 9, // target: the requester
        ];
        assert_eq!(
            v,
            Verdict::Reply {
                frame: expected,
                requester: PEER
            }
        );
    }

    #[test]
    fn unicast_arp_refresh_and_probe_are_answered() {
        let mut refresh = arp_request(PEER_MAC, PEER, VM.ip);
        refresh[0..6].copy_from_slice(&VM.mac.0);
        assert!(matches!(classify(&VM, &refresh), Verdict::Reply { .. }));
        // An address probe (sender 0.0.0.0) learns the address is taken.
        let probe = arp_request(PEER_MAC, Ipv4Addr::UNSPECIFIED, VM.ip);
        let Verdict::Reply { frame, requester } = classify(&VM, &probe) else {
            panic!("probe not answered");
        };
        assert_eq!(requester, Ipv4Addr::UNSPECIFIED);
        assert_eq!(&frame[0..6], &PEER_MAC.0);
        assert_eq!(&frame[38..42], &[0, 0, 0, 0]);
    }

    #[test]
    fn arp_not_for_the_vm_is_dropped() {
        let other = arp_request(PEER_MAC, PEER, Ipv4Addr::new(10, 0, 0, 6));
        assert_eq!(
            classify(&VM, &other),
            Verdict::Drop(DropReason::ArpNotForVm)
        );
        let mut elsewhere = arp_request(PEER_MAC, PEER, VM.ip);
        elsewhere[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 7]);
        assert_eq!(
            classify(&VM, &elsewhere),
            Verdict::Drop(DropReason::ArpNotForVm)
        );
        let mut reply = arp_request(PEER_MAC, PEER, VM.ip);
        reply[21] = 2;
        assert_eq!(
            classify(&VM, &reply),
            Verdict::Drop(DropReason::ArpNotRequest)
        );
    }

    #[test]
    fn malformed_arp_is_dropped() {
        let good = arp_request(PEER_MAC, PEER, VM.ip);
        for (at, value) in [(15, 6), (17, 0xdd), (18, 8), (19, 16)] {
            let mut bad = good.clone();
            bad[at] = value;
            assert_eq!(
                classify(&VM, &bad),
                Verdict::Drop(DropReason::ArpMalformed),
                "byte {at}"
            );
        }
        let multicast_sender = arp_request(Mac([1, 0, 0x5e, 0, 0, 1]), PEER, VM.ip);
        assert_eq!(
            classify(&VM, &multicast_sender),
            Verdict::Drop(DropReason::ArpMalformed)
        );
        for cut in ETH_HEADER_LEN..good.len() {
            assert_eq!(
                classify(&VM, &good[..cut]),
                Verdict::Drop(DropReason::ArpMalformed),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn any_ipv4_protocol_for_the_vm_is_held() {
        for protocol in [1, 6, 17, 47, 255] {
            assert_eq!(
                classify(&VM, &to_vm(protocol, b"data")),
                Verdict::Hold(Wake {
                    source: PEER,
                    protocol
                })
            );
        }
        // Padding after the packet (a short frame padded to 60 bytes) is fine.
        let mut padded = to_vm(6, &[]);
        padded.resize(60, 0);
        assert!(matches!(classify(&VM, &padded), Verdict::Hold(_)));
    }

    #[test]
    fn ipv4_for_others_is_dropped() {
        let other_ip = ipv4(
            (VM.mac, PEER_MAC),
            (PEER, Ipv4Addr::new(10, 0, 0, 6)),
            6,
            b"",
        );
        let other_mac = ipv4((PEER_MAC, PEER_MAC), (PEER, VM.ip), 6, b"");
        let broadcast = ipv4((BROADCAST, PEER_MAC), (PEER, VM.ip), 17, b"");
        for f in [other_ip, other_mac, broadcast] {
            assert_eq!(classify(&VM, &f), Verdict::Drop(DropReason::Ipv4NotForVm));
        }
    }

    #[test]
    fn broken_ipv4_is_dropped() {
        let good = to_vm(6, b"0123456789");
        let mut cases = Vec::new();
        for (at, value) in [(14, 0x65), (14, 0x44), (14, 0x4f), (17, 0xff), (17, 10)] {
            let mut bad = good.clone();
            bad[at] = value;
            cases.push(bad);
        }
        cases.push(good[..ETH_HEADER_LEN + 19].to_vec());
        cases.push(good[..ETH_HEADER_LEN].to_vec());
        for bad in cases {
            assert_eq!(
                classify(&VM, &bad),
                Verdict::Drop(DropReason::Ipv4Malformed),
                "{bad:02x?}"
            );
        }
    }

    #[test]
    fn short_vlan_and_other_frames_are_dropped() {
        for cut in 0..ETH_HEADER_LEN {
            let f = to_vm(6, b"");
            assert_eq!(classify(&VM, &f[..cut]), Verdict::Drop(DropReason::Short));
        }
        let mut tagged = ethernet(VM.mac, PEER_MAC, 0x8100);
        tagged.extend_from_slice(&[0, 5, 0x08, 0x00]);
        tagged.extend_from_slice(&to_vm(6, b"")[ETH_HEADER_LEN..]);
        assert_eq!(classify(&VM, &tagged), Verdict::Drop(DropReason::Vlan));
        let ipv6 = ethernet(VM.mac, PEER_MAC, 0x86dd);
        assert_eq!(
            classify(&VM, &ipv6),
            Verdict::Drop(DropReason::OtherEtherType)
        );
    }

    #[test]
    fn hold_queue_drops_the_newest_at_either_bound() {
        let mut q = HoldQueue::new(HoldBounds {
            max_frames: 3,
            max_bytes: 100,
        });
        assert!(q.push(&[1; 40]));
        assert!(q.push(&[2; 40]));
        assert!(!q.push(&[3; 21]), "bytes bound");
        assert!(q.push(&[4; 20]));
        assert!(!q.push(&[5; 1]), "frames bound");
        assert_eq!((q.len(), q.bytes()), (3, 100));
        let firsts: Vec<u8> = q.into_frames().iter().map(|f| f[0]).collect();
        assert_eq!(firsts, [1, 2, 4]);
    }

    #[test]
    fn sleep_wakes_once_replies_and_counts() {
        let mut s = Sleep::new(
            VM,
            HoldBounds {
                max_frames: 2,
                max_bytes: 10_000,
            },
        );
        assert!(matches!(
            s.on_frame(&arp_request(PEER_MAC, PEER, VM.ip)),
            Action::Reply(_)
        ));
        assert_eq!(s.on_frame(&[0; 3]), Action::None);
        assert_eq!(s.woke(), None);
        let syn = to_vm(6, b"syn");
        assert_eq!(
            s.on_frame(&syn),
            Action::Wake(Wake {
                source: PEER,
                protocol: 6
            })
        );
        assert_eq!(s.on_frame(&to_vm(17, b"x")), Action::None);
        assert_eq!(s.on_frame(&to_vm(17, b"overflow")), Action::None);
        s.reply_failed();
        let c = s.counters();
        assert_eq!(
            (c.frames, c.arp_replies, c.reply_errors, c.held),
            (5, 1, 1, 2)
        );
        assert_eq!((c.overflow_frames, c.overflow_bytes), (1, 14 + 20 + 8));
        assert_eq!(c.dropped(DropReason::Short), 1);
        assert_eq!(c.dropped_total(), 1);
        let (held, _, woke) = s.finish();
        assert_eq!(held[0], syn);
        assert_eq!(woke.map(|w| w.source), Some(PEER));
    }

    #[test]
    fn labels_are_distinct() {
        let labels: std::collections::BTreeSet<_> =
            DropReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), DropReason::ALL.len());
        for (i, r) in DropReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
