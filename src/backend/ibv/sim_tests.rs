//! One test per rule the simulated device enforces (see `sim.rs`).

use std::sync::Arc;

use super::sim::SimDevice;
use super::*;

/// Two connected queue pairs on two devices (two "contexts"), each with a registered buffer.
struct Pair {
    a: Box<dyn QueuePair>,
    b: Box<dyn QueuePair>,
    // Declared before the buffers: registrations are dropped first.
    mr_a: Box<dyn MemoryRegion>,
    mr_b: Box<dyn MemoryRegion>,
    _buf_a: Vec<u8>,
    buf_b: Vec<u8>,
}

fn pair_with(caps_a: QpCaps, caps_b: QpCaps, access_b: Access) -> Pair {
    let (da, db) = (SimDevice::open(0), SimDevice::open(1));
    let mut buf_a: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let mut buf_b = vec![0u8; 4096];
    // SAFETY: the buffers outlive the registrations (field order in `Pair`).
    let mr_a = unsafe { da.register(buf_a.as_mut_ptr(), buf_a.len(), Access::REMOTE_READ) }
        .expect("register");
    // SAFETY: as above.
    let mr_b = unsafe { db.register(buf_b.as_mut_ptr(), buf_b.len(), access_b) }.expect("register");
    let mut a = da.create_qp(caps_a).expect("qp");
    let mut b = db.create_qp(caps_b).expect("qp");
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).expect("connect");
    b.connect(&ea).expect("connect");
    Pair {
        a,
        b,
        mr_a,
        mr_b,
        _buf_a: buf_a,
        buf_b,
    }
}

fn pair() -> Pair {
    pair_with(QpCaps::default(), QpCaps::default(), Access::REMOTE_WRITE)
}

fn drain(qp: &mut Box<dyn QueuePair>) -> Vec<Completion> {
    let mut v = Vec::new();
    qp.poll(&mut v, 1024).expect("poll");
    v
}

impl Pair {
    fn write_imm(&self, wr_id: u64, off: u64, len: u64, imm: u32) -> SendWr {
        SendWr {
            wr_id,
            op: SendOp::WriteImm {
                remote_addr: self.mr_b.addr() + off,
                rkey: self.mr_b.rkey(),
                imm,
            },
            local: Sge {
                addr: self.mr_a.addr() + off,
                len,
                lkey: self.mr_a.lkey(),
            },
        }
    }
}

fn recv(wr_id: u64) -> RecvWr {
    RecvWr {
        wr_id,
        local: Sge {
            addr: 0,
            len: 0,
            lkey: 0,
        },
    }
}

#[test]
fn write_with_immediate_lands_and_completes_both_sides() {
    let mut p = pair();
    p.b.post_recv(&recv(70)).unwrap();
    p.a.post_send(&p.write_imm(1, 64, 100, 0xabc)).unwrap();
    assert_eq!(&p.buf_b[64..164], &p._buf_a[64..164]);
    assert_eq!(p.buf_b[63], 0);
    let a = drain(&mut p.a);
    assert_eq!(
        (a[0].wr_id, a[0].status, a[0].opcode),
        (1, Status::Success, Opcode::Write)
    );
    let b = drain(&mut p.b);
    assert_eq!(
        (b[0].wr_id, b[0].status, b[0].imm, b[0].byte_len),
        (70, Status::Success, Some(0xabc), 100)
    );
}

#[test]
fn send_queue_depth_is_enforced_until_completions_are_polled() {
    let caps = QpCaps {
        max_send_wr: 2,
        ..QpCaps::default()
    };
    let mut p = pair_with(caps, QpCaps::default(), Access::REMOTE_WRITE);
    let w = |id| SendWr {
        wr_id: id,
        op: SendOp::Write {
            remote_addr: p.mr_b.addr(),
            rkey: p.mr_b.rkey(),
        },
        local: p.mr_a.sge(p.mr_a.addr(), 64).unwrap(),
    };
    let (w1, w2, w3) = (w(1), w(2), w(3));
    p.a.post_send(&w1).unwrap();
    p.a.post_send(&w2).unwrap();
    assert_eq!(p.a.post_send(&w3), Err(VerbsError::QueueFull("send")));
    let mut one = Vec::new();
    assert_eq!(p.a.poll(&mut one, 1).unwrap(), 1);
    p.a.post_send(&w3).unwrap();
}

#[test]
fn receive_queue_depth_is_enforced() {
    let caps = QpCaps {
        max_recv_wr: 3,
        ..QpCaps::default()
    };
    let mut p = pair_with(QpCaps::default(), caps, Access::REMOTE_WRITE);
    for i in 0..3 {
        p.b.post_recv(&recv(i)).unwrap();
    }
    assert_eq!(
        p.b.post_recv(&recv(9)),
        Err(VerbsError::QueueFull("receive"))
    );
}

#[test]
fn sizes_over_one_gib_or_under_32_bytes_fail_with_length_errors() {
    for len in [1, 31, MAX_OP_BYTES + 1] {
        let mut p = pair();
        p.b.post_recv(&recv(0)).unwrap();
        // Checked before the memory: an oversized request needs no oversized buffer.
        p.a.post_send(&p.write_imm(5, 0, len, 0)).unwrap();
        let c = drain(&mut p.a);
        assert_eq!(c[0].status, Status::LocalLength, "len {len}");
        assert_eq!(p.a.state(), QpState::Error);
    }
    // 32 bytes and an immediate alone are fine.
    for len in [32, 0] {
        let mut p = pair();
        p.b.post_recv(&recv(0)).unwrap();
        p.a.post_send(&p.write_imm(5, 0, len, 0)).unwrap();
        assert_eq!(drain(&mut p.a)[0].status, Status::Success, "len {len}");
    }
}

#[test]
fn remote_keys_and_bounds_are_checked() {
    let mut p = pair();
    let mut bad = p.write_imm(1, 0, 64, 0);
    if let SendOp::WriteImm { rkey, .. } = &mut bad.op {
        *rkey ^= 0x5555;
    }
    p.b.post_recv(&recv(0)).unwrap();
    p.a.post_send(&bad).unwrap();
    assert_eq!(drain(&mut p.a)[0].status, Status::RemoteAccess);

    let mut p = pair();
    p.b.post_recv(&recv(0)).unwrap();
    let past_end = p.write_imm(1, 4096 - 32, 64, 0);
    // The local side is checked first: make it valid.
    let past_end = SendWr {
        local: p.mr_a.sge(p.mr_a.addr(), 64).unwrap(),
        ..past_end
    };
    p.a.post_send(&past_end).unwrap();
    assert_eq!(drain(&mut p.a)[0].status, Status::RemoteAccess);
    assert!(p.buf_b.iter().all(|&b| b == 0), "nothing was written");
}

#[test]
fn remote_write_needs_remote_write_access() {
    let mut p = pair_with(QpCaps::default(), QpCaps::default(), Access::LOCAL);
    p.b.post_recv(&recv(0)).unwrap();
    p.a.post_send(&p.write_imm(1, 0, 64, 0)).unwrap();
    assert_eq!(drain(&mut p.a)[0].status, Status::RemoteAccess);
}

#[test]
fn local_memory_must_be_registered() {
    let mut p = pair();
    p.b.post_recv(&recv(0)).unwrap();
    let mut wr = p.write_imm(1, 0, 64, 0);
    wr.local.lkey = 0xdead;
    p.a.post_send(&wr).unwrap();
    assert_eq!(drain(&mut p.a)[0].status, Status::LocalProtection);
}

#[test]
fn receiver_not_ready_fails_without_retries_and_waits_with_them() {
    let no_retry = QpCaps {
        rnr_retry: 0,
        ..QpCaps::default()
    };
    let mut p = pair_with(no_retry, QpCaps::default(), Access::REMOTE_WRITE);
    p.a.post_send(&p.write_imm(1, 0, 64, 0)).unwrap();
    assert_eq!(drain(&mut p.a)[0].status, Status::RnrRetryExceeded);

    // Retrying for ever: the write and the one behind it wait, in order, for receives.
    let mut p = pair();
    p.a.post_send(&p.write_imm(1, 0, 64, 11)).unwrap();
    p.a.post_send(&p.write_imm(2, 64, 64, 22)).unwrap();
    assert!(drain(&mut p.a).is_empty());
    assert!(p.buf_b.iter().all(|&b| b == 0));
    p.b.post_recv(&recv(100)).unwrap();
    let a = drain(&mut p.a);
    assert_eq!(a.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1]);
    p.b.post_recv(&recv(101)).unwrap();
    assert_eq!(drain(&mut p.a)[0].wr_id, 2);
    let b = drain(&mut p.b);
    assert_eq!(
        b.iter().map(|c| (c.wr_id, c.imm)).collect::<Vec<_>>(),
        [(100, Some(11)), (101, Some(22))]
    );
}

#[test]
fn completions_come_in_posting_order() {
    let mut p = pair();
    for i in 0..50 {
        p.b.post_recv(&recv(1000 + i)).unwrap();
    }
    for i in 0..50 {
        p.a.post_send(&p.write_imm(i, i * 64, 64, i as u32))
            .unwrap();
    }
    let a: Vec<u64> = drain(&mut p.a).iter().map(|c| c.wr_id).collect();
    assert_eq!(a, (0..50).collect::<Vec<_>>());
    let b: Vec<Option<u32>> = drain(&mut p.b).iter().map(|c| c.imm).collect();
    assert_eq!(b, (0..50).map(Some).collect::<Vec<_>>());
}

#[test]
fn error_flushes_every_outstanding_request_in_order() {
    let mut p = pair();
    // Three writes wait for receives (RNR, retrying); two receives are posted on `a`.
    for i in 0..3 {
        p.a.post_send(&p.write_imm(i, 0, 64, 0)).unwrap();
    }
    p.a.post_recv(&recv(10)).unwrap();
    p.a.post_recv(&recv(11)).unwrap();
    p.a.set_error();
    assert_eq!(p.a.state(), QpState::Error);
    let c = drain(&mut p.a);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (0, Status::Flushed),
            (1, Status::Flushed),
            (2, Status::Flushed),
            (10, Status::Flushed),
            (11, Status::Flushed)
        ]
    );
    // Later requests are flushed too.
    p.a.post_send(&p.write_imm(7, 0, 64, 0)).unwrap();
    assert_eq!(drain(&mut p.a)[0].status, Status::Flushed);
}

#[test]
fn a_failed_request_errors_the_queue_pair_and_flushes_those_behind_it() {
    let mut p = pair();
    p.a.post_send(&p.write_imm(1, 0, 64, 0)).unwrap(); // waits: no receive
    p.a.post_send(&p.write_imm(2, 0, 16, 0)).unwrap(); // too short, queued behind
    p.a.post_send(&p.write_imm(3, 0, 64, 0)).unwrap();
    p.b.post_recv(&recv(0)).unwrap();
    let c = drain(&mut p.a);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [
            (1, Status::Success),
            (2, Status::LocalLength),
            (3, Status::Flushed)
        ]
    );
}

#[test]
fn a_vanished_peer_is_a_retry_error() {
    let mut p = pair();
    p.a.post_send(&p.write_imm(1, 0, 64, 0)).unwrap(); // waits for a receive
    let b = std::mem::replace(
        &mut p.b,
        SimDevice::open(2).create_qp(QpCaps::default()).unwrap(),
    );
    drop(b);
    let c = drain(&mut p.a);
    assert_eq!(c[0].status, Status::RetryExceeded);
}

#[test]
fn reads_copy_from_the_peer() {
    let mut p = pair();
    // b reads a's buffer (registered for remote read) into its own.
    let wr = SendWr {
        wr_id: 4,
        op: SendOp::Read {
            remote_addr: p.mr_a.addr() + 128,
            rkey: p.mr_a.rkey(),
        },
        local: p.mr_b.sge(p.mr_b.addr(), 256).unwrap(),
    };
    p.b.post_send(&wr).unwrap();
    assert_eq!(drain(&mut p.b)[0].status, Status::Success);
    assert_eq!(&p.buf_b[..256], &p._buf_a[128..384]);
}

#[test]
fn armed_queue_rings_its_descriptor_once() {
    let mut p = pair();
    p.b.arm().unwrap();
    p.b.post_recv(&recv(0)).unwrap();
    p.a.post_send(&p.write_imm(1, 0, 64, 0)).unwrap();
    let mut pfd = libc::pollfd {
        fd: p.b.notify_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 1);
    p.b.ack_notifications().unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "acknowledged");
}

#[test]
fn posting_before_connecting_is_refused() {
    let d = SimDevice::open(0);
    let mut qp = d.create_qp(QpCaps::default()).unwrap();
    let wr = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        local: Sge {
            addr: 0,
            len: 0,
            lkey: 0,
        },
    };
    assert!(matches!(qp.post_send(&wr), Err(VerbsError::Invalid(_))));
}

#[test]
fn hardware_listing_says_why_there_is_none() {
    // No machine this suite runs on has an RDMA device: the listing must say so, not panic.
    match hw::devices() {
        Err(VerbsError::NoDevice(why)) => assert!(!why.is_empty()),
        Ok(devs) => assert!(!devs.is_empty()),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// A stand-in GPU for the SIMULATED GPUDirect path without a GPU: its "device memory" is host
/// memory, its copies are counted (and can be made to fail).
struct FakeGpu {
    copies: std::sync::atomic::AtomicU64,
    fail: bool,
}

impl GpuMemory for FakeGpu {
    fn ordinal(&self) -> u32 {
        0
    }
    fn dmabuf(&self, _: u64, _: u64) -> Result<std::os::fd::OwnedFd, String> {
        Err("no dma-buf in the simulation".into())
    }
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<(), String> {
        if self.fail {
            return Err("injected copy failure".into());
        }
        self.copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the fabric checked both ranges against live registrations of host memory.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        Ok(())
    }
}

#[test]
fn simulated_gpu_registrations_move_bytes_with_the_gpus_copies_and_keep_the_rules() {
    use std::sync::atomic::Ordering::Relaxed;
    for fail in [false, true] {
        let gpu = Arc::new(FakeGpu {
            copies: Default::default(),
            fail,
        });
        // Devices of this test alone: their byte counters are the process's.
        let (da, db) = (SimDevice::open(60), SimDevice::open(61));
        let mut src: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let mut dev_mem = vec![0u8; 4096];
        // SAFETY: both buffers outlive their registrations (dropped at the end of the loop body,
        // before the buffers, in reverse declaration order).
        let mr_src = unsafe { da.register(src.as_mut_ptr(), 4096, Access::LOCAL) }.unwrap();
        // SAFETY: as above.
        let mr = unsafe {
            db.register_gpu(
                gpu.clone(),
                dev_mem.as_mut_ptr() as u64,
                4096,
                Access::REMOTE_WRITE,
            )
        }
        .unwrap();
        let mut a = da.create_qp(QpCaps::default()).unwrap();
        let mut b = db.create_qp(QpCaps::default()).unwrap();
        let (ea, eb) = (a.endpoint(), b.endpoint());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        b.post_recv(&recv(1)).unwrap();
        let write = |off: u64, len: u64| SendWr {
            wr_id: 7,
            op: SendOp::WriteImm {
                remote_addr: mr.addr() + off,
                rkey: mr.rkey(),
                imm: 3,
            },
            local: mr_src.sge(mr_src.addr(), len).unwrap(),
        };
        let moved = super::sim::bytes_moved(60);
        a.post_send(&write(0, 4096)).unwrap();
        let c = drain(&mut a);
        if fail {
            assert_eq!(
                c[0].status,
                Status::Other(2),
                "a failed DMA fails the request"
            );
            continue;
        }
        assert_eq!(c[0].status, Status::Success);
        assert_eq!(dev_mem, src, "landed through the GPU's copy");
        assert_eq!(gpu.copies.load(Relaxed), 1);
        assert_eq!(
            super::sim::bytes_moved(60) - moved,
            4096,
            "the GPU's DMA counts as bytes the device moved (striping tests read it)"
        );
        assert_eq!(drain(&mut b)[0].imm, Some(3));
        // Bounds are the registration's, as for host memory.
        b.post_recv(&recv(2)).unwrap();
        a.post_send(&write(64, 4096)).unwrap();
        assert_eq!(drain(&mut a)[0].status, Status::RemoteAccess);
        assert_eq!(gpu.copies.load(Relaxed), 1, "nothing copied");
    }
}
