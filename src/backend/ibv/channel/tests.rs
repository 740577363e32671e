//! The ibv channel's protocol on the simulated device, without actors: two channel states wired
//! together by hand, progressed explicitly.

use std::sync::Arc;

use super::core::{Caches, Finished, Rdma, Request, REQUEST_LEN};
use crate::backend::ibv::sim::{self, SimDevice};
use crate::backend::ibv::{Device, QpCaps, SendOp, SendWr, Status};
use crate::error::Origin;
use crate::transport::stream::Memory;

struct Pair {
    a: Rdma,
    b: Rdma,
    caches_a: Caches,
    caches_b: Caches,
}

fn pair(caps: QpCaps) -> Pair {
    let da: Arc<dyn Device> = Arc::new(SimDevice::open(0));
    let db: Arc<dyn Device> = Arc::new(SimDevice::open(1));
    let (ca, cb) = (Caches::new(&da, 0), Caches::new(&db, 0));
    let mut qa = da.create_qp(caps).unwrap();
    let mut qb = db.create_qp(caps).unwrap();
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    qa.connect(&eb).unwrap();
    qb.connect(&ea).unwrap();
    let origin = Origin::new("sim", "ibv");
    let mut a = Rdma::new(&*da, qa, ca.clone(), origin.clone()).unwrap();
    let mut b = Rdma::new(&*db, qb, cb.clone(), origin).unwrap();
    a.connected();
    b.connected();
    Pair {
        a,
        b,
        caches_a: ca,
        caches_b: cb,
    }
}

impl Pair {
    /// Progresses both sides until nothing changes; returns what each finished.
    fn pump(&mut self) -> (Vec<Finished>, Vec<Finished>) {
        let (mut fa, mut fb) = (Vec::new(), Vec::new());
        for _ in 0..64 {
            self.a.progress();
            self.b.progress();
            fa.extend(self.a.take_done());
            fb.extend(self.b.take_done());
        }
        (fa, fb)
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn requests_round_trip() {
    let r = Request {
        seq: 1 << 40,
        index: 7,
        addr: 0x7f00_dead_0000,
        rkey: 0xabcd,
        len: (1 << 30) + 5,
    };
    assert_eq!(Request::decode(&r.encode()), r);
    assert_eq!(r.encode().len(), REQUEST_LEN);
}

#[test]
fn tensors_land_in_the_receivers_buffer_and_their_registrations_go_first() {
    let mut p = pair(QpCaps::default());
    let sizes = [32usize, 33, 4096, 1 << 20, (1 << 20) + 7];
    for (i, &n) in sizes.iter().enumerate() {
        p.b.recv(i as u64, 0, Memory::Owned(vec![0u8; n]));
        // While the read is pending its buffer is registered for the peer.
        assert!(!p.caches_b.recv.is_empty());
        p.a.send(i as u64, 0, Memory::Owned(pattern(n, i as u8)));
    }
    let (fa, fb) = p.pump();
    assert_eq!(fa.len(), sizes.len());
    assert_eq!(fb.len(), sizes.len());
    for (i, (a, b)) in fa.iter().zip(&fb).enumerate() {
        assert!(a.sending && !b.sending);
        assert_eq!((a.seq, b.seq), (i as u64, i as u64));
        a.result.as_ref().unwrap();
        b.result.as_ref().unwrap();
        assert_eq!(
            b.buffer.as_slice(),
            pattern(sizes[i], i as u8),
            "tensor {i}"
        );
        assert_eq!(
            a.buffer.as_slice(),
            pattern(sizes[i], i as u8),
            "sent buffer back intact"
        );
    }
    // Default invalidation rule: nothing stays registered once the buffers are back.
    assert!(p.caches_b.recv.is_empty());
    assert_eq!(p.caches_b.recv.registrations(), sizes.len() as u64);
    assert!(p.a.is_idle() && p.b.is_idle());
}

#[test]
fn a_returned_buffer_is_out_of_the_peers_reach() {
    let mut p = pair(QpCaps::default());
    let mut buffer = vec![0u8; 64];
    // The key the receiver's request will carry: the cache hands the same entry to the read.
    // SAFETY: `buffer` outlives the lease, dropped below before the buffer moves on.
    let lease = unsafe { p.caches_b.recv.lease(buffer.as_mut_ptr(), 64) }.unwrap();
    let (addr, rkey) = (buffer.as_ptr() as u64, lease.mr.rkey());
    p.b.recv(0, 0, Memory::Owned(buffer));
    drop(lease);
    p.a.send(0, 0, Memory::Owned(pattern(64, 1)));
    let (_, fb) = p.pump();
    assert_eq!(fb[0].buffer.as_slice(), pattern(64, 1));
    assert_eq!(
        fb[0].buffer.as_slice().as_ptr() as u64,
        addr,
        "the same buffer, back"
    );
    // Writing there again with that key is refused: the registration went before the buffer.
    let mut src = pattern(64, 2);
    // SAFETY: `src` outlives the lease and the write, which completes before the test ends.
    let local = unsafe { p.caches_a.send.lease(src.as_mut_ptr(), 64) }.unwrap();
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Write {
            remote_addr: addr,
            rkey,
        },
        local: local.mr.sge(src.as_ptr() as u64, 64).unwrap(),
    };
    p.a.qp.post_send(&wr).unwrap();
    let mut out = Vec::new();
    p.a.qp.poll(&mut out, 8).unwrap();
    assert_eq!(out[0].status, Status::RemoteAccess);
    assert_eq!(fb[0].buffer.as_slice(), pattern(64, 1), "untouched");
}

#[test]
fn a_send_queue_of_depth_one_backlogs_and_keeps_order() {
    let mut p = pair(QpCaps {
        max_send_wr: 1,
        max_recv_wr: 4,
        ..QpCaps::default()
    });
    for i in 0..20u64 {
        p.b.recv(i, 0, Memory::Owned(vec![0u8; 100 + i as usize]));
    }
    for i in 0..20u64 {
        p.a.send(i, 0, Memory::Owned(pattern(100 + i as usize, i as u8)));
    }
    let (fa, fb) = p.pump();
    assert_eq!(fb.len(), 20);
    for (i, f) in fb.iter().enumerate() {
        assert_eq!(f.seq, i as u64, "in order");
        f.result.as_ref().unwrap();
        assert_eq!(f.buffer.as_slice(), pattern(100 + i, i as u8));
    }
    assert!(fa.iter().all(|f| f.result.is_ok()));
    assert!(p.b.sq.stats.backlogged > 0, "{:?}", p.b.sq.stats);
}

#[test]
fn an_errored_queue_pair_fails_every_tensor_and_frees_every_registration() {
    let mut p = pair(QpCaps::default());
    p.b.recv(0, 0, Memory::Owned(vec![0u8; 64]));
    p.a.send(0, 0, Memory::Owned(pattern(64, 0)));
    let (fa, fb) = p.pump();
    assert!(fa[0].result.is_ok() && fb[0].result.is_ok());
    // Three reads asked for, two sends queued: then a's queue pair breaks.
    for i in 1..4 {
        p.b.recv(i, 0, Memory::Owned(vec![0u8; 4096]));
    }
    assert!(sim::inject_error(p.a.qp.endpoint().qpn));
    for i in 1..3 {
        p.a.send(i, 0, Memory::Owned(pattern(4096, 0)));
    }
    let (fa, fb) = p.pump();
    assert_eq!(fa.len(), 2, "every sent tensor back");
    // b's requests had all landed: nothing of b's is outstanding, so only the lane's hang-up
    // (a's channel actor stopping) tells it, as on hardware.
    assert!(fb.is_empty());
    p.b.fail(crate::error::Error::io(
        "ibv channel",
        std::io::Error::other("the peer hung up"),
        &Origin::default(),
    ));
    let (_, fb) = p.pump();
    assert_eq!(fb.len(), 3, "every received tensor back");
    for f in fa.iter().chain(&fb) {
        let e = f.result.as_ref().unwrap_err();
        assert!(matches!(e.class(), "io"), "{e}");
    }
    assert!(p.caches_b.recv.is_empty(), "registrations dropped");
    assert!(p.a.is_idle() && p.b.is_idle());
    // Later tensors fail at once.
    p.a.send(9, 0, Memory::Owned(pattern(64, 0)));
    assert!(p.a.take_done().next().unwrap().result.is_err());
}

#[test]
fn a_request_for_the_wrong_tensor_is_a_protocol_error() {
    let mut p = pair(QpCaps::default());
    p.b.recv(5, 1, Memory::Owned(vec![0u8; 64]));
    p.a.send(5, 0, Memory::Owned(pattern(64, 0)));
    let (fa, fb) = p.pump();
    let e = fa[0].result.as_ref().unwrap_err();
    assert_eq!(e.class(), "protocol", "{e}");
    // The receiver sees its queue pair's peer fail (a's queue pair is in error).
    assert_eq!(fb.len(), 0, "b waits: only the lane's hang-up tells it");
    p.b.fail(crate::error::Error::PeerClosed {
        reason: "gone".into(),
        graceful: false,
        origin: Origin::default(),
    });
    assert_eq!(p.b.take_done().count(), 1);
}

#[test]
fn tensors_under_the_minimum_are_refused() {
    let mut p = pair(QpCaps::default());
    p.b.recv(0, 0, Memory::Owned(vec![0u8; 31]));
    let f: Vec<_> = p.b.take_done().collect();
    assert_eq!(f[0].result.as_ref().unwrap_err().class(), "protocol");
}

#[test]
fn further_devices_pair_in_order_where_they_reach_each_other() {
    use crate::backend::ibv::transport::bootstrap::Hello;
    use crate::backend::ibv::{Endpoint, LinkLayer};
    let hello = |link_layer, token: u8| Hello {
        link_layer,
        port: 1,
        endpoint: Endpoint {
            qpn: 1,
            lid: 1,
            gid: [token; 16],
            psn: 0,
        },
        inbox_addr: 0,
        inbox_rkey: 0,
        inbox_cap: 0,
    };
    let ours = [
        hello(LinkLayer::Simulated, 1),
        hello(LinkLayer::Ethernet, 1),
        hello(LinkLayer::Simulated, 2),
        hello(LinkLayer::Simulated, 1),
    ];
    let theirs = [
        hello(LinkLayer::Simulated, 1),
        hello(LinkLayer::InfiniBand, 1),
        hello(LinkLayer::Simulated, 1),
    ];
    // 0: same fabric; 1: link layers differ; 2: another process's simulation; 3: no partner.
    assert_eq!(super::pair_further(&ours, &theirs), vec![0]);
    assert_eq!(super::pair_further(&theirs, &ours), vec![0]);
    assert!(super::pair_further(&[], &theirs).is_empty());
}
