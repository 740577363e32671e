//! The ibv connection core on the simulated device, without actors: two cores wired together
//! by hand, progressed explicitly.

use super::conn::{Core, RemoteRing, SLACK};
use super::ring;
use crate::backend::ibv::sim::SimDevice;
use crate::backend::ibv::{Access, Device, QpCaps, QpState};

struct Link {
    a: Core,
    b: Core,
}

fn link(cap: usize, caps: QpCaps) -> Link {
    let (da, db) = (SimDevice::open(0), SimDevice::open(1));
    let mut qa = da.create_qp(caps).unwrap();
    let mut qb = db.create_qp(caps).unwrap();
    let (ia, ib) = (
        ring(&da, cap, Access::REMOTE_WRITE).unwrap(),
        ring(&db, cap, Access::REMOTE_WRITE).unwrap(),
    );
    let (oa, ob) = (
        ring(&da, cap, Access::LOCAL).unwrap(),
        ring(&db, cap, Access::LOCAL).unwrap(),
    );
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    qa.connect(&eb).unwrap();
    qb.connect(&ea).unwrap();
    let ra = RemoteRing {
        addr: ia.mr.addr(),
        rkey: ia.mr.rkey(),
        cap,
    };
    let rb = RemoteRing {
        addr: ib.mr.addr(),
        rkey: ib.mr.rkey(),
        cap,
    };
    Link {
        a: Core::new(qa, ia, oa, rb).unwrap(),
        b: Core::new(qb, ib, ob, ra).unwrap(),
    }
}

impl Link {
    fn pump(&mut self) {
        for _ in 0..4 {
            self.a.progress();
            self.b.progress();
        }
    }

    /// Sends `data` from a to b through the rings, reading as it goes; returns what b read.
    fn transfer(&mut self, data: &[u8], read_chunk: usize) -> Vec<u8> {
        let mut got = Vec::new();
        let mut sent = 0;
        let mut buf = vec![0u8; read_chunk];
        let mut idle = 0;
        while got.len() < data.len() {
            let n = if sent < data.len() {
                self.a.write(&data[sent..])
            } else {
                0
            };
            sent += n;
            self.pump();
            let r = self.b.read(&mut buf);
            got.extend_from_slice(&buf[..r]);
            self.pump();
            idle = if n == 0 && r == 0 { idle + 1 } else { 0 };
            assert!(idle < 100, "stalled at {} of {}", got.len(), data.len());
        }
        got
    }
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[test]
fn a_stream_larger_than_the_ring_arrives_whole_and_in_order() {
    let mut l = link(4096, QpCaps::default());
    let data = pattern(1 << 20);
    assert_eq!(l.transfer(&data, 1000), data);
    assert!(l.b.stats.credits_sent > 0, "credits flowed back");
}

#[test]
fn pieces_under_32_bytes_are_padded_and_still_exact() {
    let mut l = link(4096, QpCaps::default());
    // Many 5-byte writes, each its own RDMA write (padded to 32 bytes), across ring wraps.
    let mut expect = Vec::new();
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    for i in 0..3000u32 {
        let msg = [i as u8, (i >> 8) as u8, 0xaa, 0xbb, 0xcc];
        assert_eq!(l.a.write(&msg), 5);
        expect.extend_from_slice(&msg);
        l.pump();
        loop {
            let n = l.b.read(&mut buf);
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        l.pump();
    }
    assert_eq!(got, expect);
}

#[test]
fn a_full_send_queue_backlogs_and_keeps_order() {
    let caps = QpCaps {
        max_send_wr: 1,
        ..QpCaps::default()
    };
    let mut l = link(1 << 16, caps);
    // Write several pieces without letting a's completions be polled: the first takes the
    // only slot, the rest wait in the backlog, in order.
    let data = pattern(60_000);
    let mut sent = 0;
    for chunk in data.chunks(6000) {
        sent += l.a.write(chunk);
    }
    assert_eq!(sent, data.len());
    assert!(l.a.sq.stats.backlogged >= 9, "{:?}", l.a.sq.stats);
    assert!(l.a.sq.stats.backlog_max >= 9);
    let mut got = Vec::new();
    let mut buf = vec![0u8; 8192];
    while got.len() < data.len() {
        l.pump();
        let n = l.b.read(&mut buf);
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got, data);
}

#[test]
fn the_writer_stops_at_the_credit_limit() {
    let mut l = link(4096, QpCaps::default());
    let data = pattern(10_000);
    let first = l.a.write(&data);
    assert_eq!(
        first,
        4096 - SLACK,
        "a ring's worth, less the padding reserve"
    );
    l.pump();
    assert_eq!(l.a.write(&data[first..]), 0, "no credit until b reads");
    let mut buf = vec![0u8; 4096];
    assert_eq!(l.b.read(&mut buf), first);
    l.pump();
    assert!(l.a.write(&data[first..]) > 0, "credits came back");
}

#[test]
fn a_queue_pair_error_mid_transfer_fails_both_sides() {
    let caps = QpCaps {
        max_send_wr: 1,
        ..QpCaps::default()
    };
    let mut l = link(1 << 16, caps);
    for chunk in pattern(30_000).chunks(3000) {
        l.a.write(chunk);
    }
    l.a.qp.set_error();
    l.pump();
    assert!(l.a.failed.is_some());
    assert_eq!(l.a.qp.state(), QpState::Error);
    // Nothing more is accepted.
    assert_eq!(l.a.write(b"more bytes than thirty two, surely"), 0);
}

#[test]
fn close_mark_arrives_after_the_last_bytes() {
    let mut l = link(4096, QpCaps::default());
    assert_eq!(l.a.write(b"farewell frame bytes"), 20);
    l.a.close_write();
    l.pump();
    assert!(l.b.peer_closed);
    let mut buf = [0u8; 64];
    assert_eq!(
        l.b.read(&mut buf),
        20,
        "the bytes before the mark are still there"
    );
    assert!(l.a.flushed());
}
