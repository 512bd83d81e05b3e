//! The frames any neighbour on a bridge can send to a sleeping VM's TAP, as the wake decisions
//! see them. Input: two bytes of hold bounds (frames, then KiB), then frames, each prefixed by
//! its length (u16, little-endian). Whatever the bytes: no panic; an ARP reply is well formed,
//! from the VM and to the asker; only an IPv4 frame for the VM's MAC and address is held; the
//! hold queue keeps its bounds; every frame is counted exactly once; the VM wakes once, on the
//! first frame held or refused for lack of room.
#![no_main]

use std::net::Ipv4Addr;

use imp_net::plan::Mac;
use imp_net::wake::{
    ARP_REPLY_LEN, Action, HoldBounds, Sleep, SleepingVm, Verdict, classify,
};
use libfuzzer_sys::fuzz_target;

const VM: SleepingVm = SleepingVm {
    ip: Ipv4Addr::new(10, 0, 0, 5),
    mac: Mac([0x02, 0, 0, 0, 0, 5]),
};

fuzz_target!(|data: &[u8]| {
    let Some((&[frames, kib], mut rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let bounds = HoldBounds {
        max_frames: usize::from(frames),
        max_bytes: usize::from(kib) * 1024,
    };
    let mut sleep = Sleep::new(VM, bounds);
    let mut read = 0u64;
    let mut first_wake = None;
    while let Some((len, tail)) = rest.split_first_chunk::<2>() {
        let len = usize::from(u16::from_le_bytes(*len)).min(tail.len());
        let (frame, tail) = tail.split_at(len);
        rest = tail;
        read += 1;
        check_verdict(frame, classify(&VM, frame));
        match sleep.on_frame(frame) {
            Action::Wake(w) => {
                assert!(first_wake.is_none(), "woke twice");
                first_wake = Some(w);
            }
            Action::Reply(reply) => assert_eq!(reply.len(), ARP_REPLY_LEN),
            Action::None => {}
        }
        let q = sleep.queue();
        assert!(q.len() <= bounds.max_frames && q.bytes() <= bounds.max_bytes);
    }
    let c = sleep.counters();
    assert_eq!(c.frames, read);
    assert_eq!(
        c.arp_replies + c.held + c.overflow_frames + c.dropped_total(),
        read,
        "every frame counted once: {c:?}"
    );
    assert_eq!(c.held, sleep.queue().len() as u64);
    assert_eq!(first_wake.is_some(), c.held + c.overflow_frames > 0);
    assert_eq!(sleep.woke(), first_wake);
});

fn check_verdict(frame: &[u8], verdict: Verdict) {
    match verdict {
        Verdict::Reply {
            frame: reply,
            requester,
        } => {
            // Asked of the VM's address, answered from the VM to the asker's hardware address.
            assert_eq!(&frame[12..14], &[0x08, 0x06]);
            assert_eq!(&frame[38..42], &VM.ip.octets());
            assert_eq!(&reply[0..6], &frame[22..28], "to the asker");
            assert_eq!(&reply[6..12], &VM.mac.0);
            assert_eq!(&reply[22..28], &VM.mac.0);
            assert_eq!(&reply[28..32], &VM.ip.octets());
            assert_eq!(&reply[38..42], &requester.octets());
            assert_eq!(reply[0] & 1, 0, "never to a group address");
            // What the VM sends is a reply, which the VM itself would never answer.
            assert!(matches!(classify(&VM, &reply), Verdict::Drop(_)));
        }
        Verdict::Hold(wake) => {
            assert_eq!(&frame[0..6], &VM.mac.0);
            assert_eq!(&frame[12..14], &[0x08, 0x00]);
            assert_eq!(&frame[30..34], &VM.ip.octets());
            assert_eq!(&frame[26..30], &wake.source.octets());
        }
        Verdict::Drop(reason) => assert!(!reason.label().is_empty()),
    }
}
