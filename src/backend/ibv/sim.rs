//! A simulated RDMA device and fabric, inside one process.
//!
//! No machine this project runs on has an RDMA device (nor soft-RoCE), so the `ibv` backends
//! are proven on this simulation; `docs/ibv.md` says what ran where. It is selected only
//! explicitly (`Ibv::simulated()`), never as a fallback, and its port's link layer is
//! [`LinkLayer::Simulated`] with a subnet prefix unique to this process, so its domain
//! descriptor never equals a real device's, nor another process's simulation.
//!
//! What it enforces, as hardware does:
//!
//! - **Queue depths.** A send occupies its send-queue slot from `post_send` until its
//!   completion is polled; posting beyond `max_send_wr` (or `max_recv_wr` receives) fails with
//!   [`VerbsError::QueueFull`], as `ibv_post_send` fails with `ENOMEM`.
//! - **Sizes.** An operation over [`MAX_OP_BYTES`], or of 1 to 31 bytes ([`MIN_OP_BYTES`]),
//!   completes with [`Status::LocalLength`]. Zero-length requests (an immediate alone) pass.
//! - **Keys and bounds.** The local memory must lie inside a registration of the queue pair's
//!   protection domain (else [`Status::LocalProtection`]); the remote memory inside one of the
//!   peer's, with remote write or read access (else [`Status::RemoteAccess`]).
//! - **Receiver not ready.** A send or write with immediate needs a receive posted at the peer.
//!   With `rnr_retry` [`RNR_RETRY_INFINITE`] the request, and every later one, waits until the
//!   peer posts one; otherwise it completes with [`Status::RnrRetryExceeded`].
//! - **Order.** Requests execute and complete in the order posted; a waiting request holds
//!   back every later one.
//! - **Errors.** A failed request moves its queue pair to the error state; so does
//!   [`QueuePair::set_error`]. Every outstanding request (waiting sends, posted receives) and
//!   every later one completes with [`Status::Flushed`], in order. A request to a peer queue pair
//!   that is gone or not connected completes with [`Status::RetryExceeded`].
//!
//! The wire is instant: a request that can run runs inside `post_send`, copying with one
//! `memcpy` under the fabric's lock. Notifications go through an eventfd per queue pair, rung
//! when a completion arrives while the queue is armed.
//!
//! Not simulated: completion-queue overrun, packet loss and retransmission timing, the MTU,
//! atomics, unsignaled requests. Two processes cannot share this fabric.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::*;
use crate::backend::shm::fd::EventFd;

/// A registration in the fabric's table.
#[derive(Clone)]
struct Mr {
    pd: u64,
    addr: u64,
    len: u64,
    access: Access,
    /// GPU memory: the device whose copies stand in for the NIC's peer-to-peer DMA.
    gpu: Option<Arc<dyn GpuMemory>>,
}

impl Mr {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// One queue pair's state inside the fabric.
struct Slot {
    pd: u64,
    /// The device's LID (its index + 1): which device's counter its bytes go to.
    lid: u16,
    caps: QpCaps,
    state: QpState,
    remote: Option<u32>,
    /// Posted sends that wait for a receive at the peer, oldest first.
    waiting: VecDeque<SendWr>,
    /// Send-queue slots in use (posted, completion not yet polled).
    sq_used: u32,
    rq: VecDeque<RecvWr>,
    cq: VecDeque<Completion>,
    armed: bool,
    bell: Arc<EventFd>,
}

impl Slot {
    fn complete(&mut self, c: Completion) {
        self.cq.push_back(c);
        if self.armed {
            self.armed = false;
            self.bell.ring();
        }
    }

    /// To the error state: every waiting send and posted receive is flushed, in order.
    fn enter_error(&mut self) {
        self.state = QpState::Error;
        while let Some(wr) = self.waiting.pop_front() {
            self.complete(flushed(wr.wr_id, opcode_of(&wr.op)));
        }
        while let Some(wr) = self.rq.pop_front() {
            self.complete(flushed(wr.wr_id, Opcode::Recv));
        }
    }
}

fn flushed(wr_id: u64, opcode: Opcode) -> Completion {
    Completion {
        wr_id,
        status: Status::Flushed,
        opcode,
        byte_len: 0,
        imm: None,
    }
}

fn opcode_of(op: &SendOp) -> Opcode {
    match op {
        SendOp::Send => Opcode::Send,
        SendOp::Write { .. } | SendOp::WriteImm { .. } => Opcode::Write,
        SendOp::Read { .. } => Opcode::Read,
    }
}

#[derive(Default)]
struct Fabric {
    qps: HashMap<u32, Slot>,
    mrs: HashMap<u32, Mr>,
    next_qpn: u32,
    next_key: u32,
    next_pd: u64,
    /// Bytes moved by requests of each device's queue pairs, by LID.
    moved: HashMap<u16, u64>,
}

fn fabric() -> MutexGuard<'static, Fabric> {
    static FABRIC: OnceLock<Mutex<Fabric>> = OnceLock::new();
    FABRIC
        .get_or_init(|| {
            Mutex::new(Fabric {
                next_qpn: 0x100,
                next_key: 0x1000,
                next_pd: 1,
                ..Fabric::default()
            })
        })
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What running one send request came to.
enum Outcome {
    Done(Status),
    /// Receiver not ready, retrying for ever: wait for a receive at the peer.
    Wait,
}

impl Fabric {
    fn local_ok(&self, pd: u64, sge: &Sge) -> bool {
        sge.len == 0
            || self
                .mrs
                .get(&sge.lkey)
                .is_some_and(|mr| mr.pd == pd && mr.covers(sge.addr, sge.len))
    }

    fn remote_ok(&self, pd: u64, rkey: u32, addr: u64, len: u64, write: bool) -> bool {
        len == 0
            || self.mrs.get(&rkey).is_some_and(|mr| {
                mr.pd == pd
                    && mr.covers(addr, len)
                    && if write {
                        mr.access.remote_write
                    } else {
                        mr.access.remote_read
                    }
            })
    }

    /// The GPU behind registration `key`, if it covers GPU memory.
    fn gpu_of(&self, key: u32) -> Option<Arc<dyn GpuMemory>> {
        self.mrs.get(&key).and_then(|mr| mr.gpu.clone())
    }

    /// Runs `wr` from queue pair `qpn`: checks, copies, completes at the peer.
    fn run(&mut self, qpn: u32, wr: &SendWr) -> Outcome {
        let len = wr.local.len;
        if len > MAX_OP_BYTES || (len > 0 && len < MIN_OP_BYTES) {
            return Outcome::Done(Status::LocalLength);
        }
        let (pd, remote, rnr_retry, lid) = {
            let s = &self.qps[&qpn];
            (s.pd, s.remote, s.caps.rnr_retry, s.lid)
        };
        if !self.local_ok(pd, &wr.local) {
            return Outcome::Done(Status::LocalProtection);
        }
        let Some((peer, peer_pd)) = remote
            .and_then(|r| self.qps.get(&r).map(|p| (r, p)))
            .filter(|(_, p)| p.state == QpState::ReadyToSend && p.remote == Some(qpn))
            .map(|(r, p)| (r, p.pd))
        else {
            return Outcome::Done(Status::RetryExceeded);
        };
        // Where the bytes go (or come from, for a read) at the peer, once checked.
        let (remote_addr, imm, needs_recv) = match wr.op {
            SendOp::Send => (None, None, true),
            SendOp::Write { remote_addr, rkey } | SendOp::Read { remote_addr, rkey } => {
                let write = matches!(wr.op, SendOp::Write { .. });
                if !self.remote_ok(peer_pd, rkey, remote_addr, len, write) {
                    return Outcome::Done(Status::RemoteAccess);
                }
                (Some(remote_addr), None, false)
            }
            SendOp::WriteImm {
                remote_addr,
                rkey,
                imm,
            } => {
                if !self.remote_ok(peer_pd, rkey, remote_addr, len, true) {
                    return Outcome::Done(Status::RemoteAccess);
                }
                (Some(remote_addr), Some(imm), true)
            }
        };
        let peer_slot = self.qps.get_mut(&peer).expect("checked above");
        let recv = if needs_recv {
            match peer_slot.rq.pop_front() {
                Some(r) => Some(r),
                None if rnr_retry == RNR_RETRY_INFINITE => return Outcome::Wait,
                None => return Outcome::Done(Status::RnrRetryExceeded),
            }
        } else {
            None
        };
        let (src, dst) = match (wr.op, remote_addr, recv) {
            (SendOp::Read { .. }, Some(r), _) => (r, wr.local.addr),
            (_, Some(r), _) => (wr.local.addr, r),
            (_, None, Some(recv)) => {
                if len > recv.local.len {
                    // The responder's receive is too small: it fails there too.
                    peer_slot.complete(Completion {
                        wr_id: recv.wr_id,
                        status: Status::LocalLength,
                        opcode: Opcode::Recv,
                        byte_len: 0,
                        imm: None,
                    });
                    peer_slot.enter_error();
                    return Outcome::Done(Status::Other(9)); // IBV_WC_REM_INV_REQ_ERR
                }
                (wr.local.addr, recv.local.addr)
            }
            (_, None, None) => unreachable!("a send always takes a receive"),
        };
        let gpu = self.gpu_of(wr.local.lkey).or_else(|| match wr.op {
            SendOp::Write { rkey, .. }
            | SendOp::WriteImm { rkey, .. }
            | SendOp::Read { rkey, .. } => self.gpu_of(rkey),
            SendOp::Send => recv.and_then(|r| self.gpu_of(r.local.lkey)),
        });
        let peer_slot = self.qps.get_mut(&peer).expect("checked above");
        if let (Some(gpu), true) = (gpu, len > 0) {
            // SIMULATED GPUDirect RDMA: the NIC's DMA to or from GPU memory is the CUDA
            // driver's copy (unified addressing: either end may be host memory), done before
            // the completion, as the NIC's writes land before its completion.
            if let Err(e) = gpu.copy(dst, src, len) {
                tracing::warn!(error = %e, "simulated GPU DMA failed");
                if let Some(recv) = recv {
                    peer_slot.complete(flushed(recv.wr_id, Opcode::Recv));
                }
                return Outcome::Done(Status::Other(2)); // IBV_WC_LOC_QP_OP_ERR
            }
        } else if len > 0 {
            // SAFETY: both ranges were checked to lie inside live registrations (under the
            // fabric lock, so neither can be dropped meanwhile); `Device::register`'s contract
            // keeps registered memory allocated until its registration is dropped. `copy`
            // allows the two ranges to overlap (a loopback write into the same buffer).
            unsafe {
                std::ptr::copy(src as *const u8, dst as *mut u8, len as usize);
            }
        }
        // Host copies and (simulated) GPU DMA alike.
        *self.moved.entry(lid).or_default() += len;
        if let Some(recv) = recv {
            peer_slot.complete(Completion {
                wr_id: recv.wr_id,
                status: Status::Success,
                opcode: Opcode::Recv,
                byte_len: len as u32,
                imm,
            });
        }
        Outcome::Done(Status::Success)
    }

    /// Runs the waiting sends of `qpn`, in order, until one has to wait again.
    fn progress(&mut self, qpn: u32) {
        loop {
            let Some(slot) = self.qps.get(&qpn) else {
                return;
            };
            let Some(wr) = slot.waiting.front().copied() else {
                return;
            };
            if slot.state == QpState::Error {
                return;
            }
            match self.run(qpn, &wr) {
                Outcome::Wait => return,
                Outcome::Done(status) => {
                    let slot = self.qps.get_mut(&qpn).expect("present");
                    slot.waiting.pop_front();
                    slot.complete(Completion {
                        wr_id: wr.wr_id,
                        status,
                        opcode: opcode_of(&wr.op),
                        byte_len: 0,
                        imm: None,
                    });
                    if status != Status::Success {
                        slot.enter_error();
                        return;
                    }
                }
            }
        }
    }

    /// Queue pairs whose peer is `qpn` (at most one, for RC).
    fn peers_of(&self, qpn: u32) -> Vec<u32> {
        self.qps
            .iter()
            .filter(|(_, s)| s.remote == Some(qpn))
            .map(|(q, _)| *q)
            .collect()
    }
}

/// A process-unique token in every simulated GID, so two processes' simulations never meet.
fn process_token() -> u32 {
    static TOKEN: OnceLock<u32> = OnceLock::new();
    *TOKEN.get_or_init(|| random_psn() ^ std::process::id().rotate_left(8))
}

/// The simulated devices: `count` single-port HCAs `sim0 ..`, all on one fabric.
pub fn devices(count: usize) -> Vec<DeviceInfo> {
    (0..count)
        .map(|i| {
            let mut gid = [0u8; 16];
            gid[..2].copy_from_slice(&[0xfe, 0x80]);
            gid[4..8].copy_from_slice(&process_token().to_be_bytes());
            gid[8..16].copy_from_slice(&(i as u64 + 1).to_be_bytes());
            DeviceInfo {
                name: format!("sim{i}"),
                guid: i as u64 + 1,
                pci: None,
                ports: vec![PortInfo {
                    port: 1,
                    link_layer: LinkLayer::Simulated,
                    active: true,
                    lid: i as u16 + 1,
                    gid,
                    gid_index: 0,
                    mtu: 4096,
                }],
            }
        })
        .collect()
}

/// One opened simulated device, with its own protection domain.
#[derive(Debug)]
pub struct SimDevice {
    info: DeviceInfo,
    pd: u64,
}

impl SimDevice {
    /// Opens simulated device `index` (any index works: the fabric has no fixed size).
    pub fn open(index: usize) -> SimDevice {
        let info = devices(index + 1).pop().expect("one device");
        let mut f = fabric();
        let pd = f.next_pd;
        f.next_pd += 1;
        SimDevice { info, pd }
    }
}

impl Device for SimDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn port(&self) -> &PortInfo {
        &self.info.ports[0]
    }

    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>, VerbsError> {
        self.add_mr(addr as u64, len, access, None)
    }

    /// SIMULATED GPUDirect RDMA: the registration records the GPU, whose driver copies then
    /// move the bytes (keys, bounds and access are checked exactly as for host memory).
    unsafe fn register_gpu(
        &self,
        gpu: Arc<dyn GpuMemory>,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<Box<dyn MemoryRegion>, VerbsError> {
        self.add_mr(addr, len, access, Some(gpu))
    }

    fn create_qp(&self, caps: QpCaps) -> Result<Box<dyn QueuePair>, VerbsError> {
        self.new_qp(caps)
    }
}

impl SimDevice {
    fn add_mr(
        &self,
        addr: u64,
        len: usize,
        access: Access,
        gpu: Option<Arc<dyn GpuMemory>>,
    ) -> Result<Box<dyn MemoryRegion>, VerbsError> {
        if addr == 0 && len > 0 {
            return Err(VerbsError::Invalid("registering a null address".into()));
        }
        let mut f = fabric();
        let key = f.next_key;
        f.next_key = f.next_key.wrapping_add(1).max(0x1000);
        f.mrs.insert(
            key,
            Mr {
                pd: self.pd,
                addr,
                len: len as u64,
                access,
                gpu,
            },
        );
        Ok(Box::new(SimMr {
            key,
            addr,
            len: len as u64,
        }))
    }

    fn new_qp(&self, caps: QpCaps) -> Result<Box<dyn QueuePair>, VerbsError> {
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
            return Err(VerbsError::Invalid(
                "queue depths must be at least 1".into(),
            ));
        }
        let bell = Arc::new(EventFd::new().map_err(|e| VerbsError::Library {
            call: "eventfd",
            detail: e.to_string(),
        })?);
        let mut f = fabric();
        let qpn = f.next_qpn;
        f.next_qpn = (f.next_qpn + 1) & 0x00ff_ffff;
        f.qps.insert(
            qpn,
            Slot {
                pd: self.pd,
                lid: self.port().lid,
                caps,
                state: QpState::Init,
                remote: None,
                waiting: VecDeque::new(),
                sq_used: 0,
                rq: VecDeque::new(),
                cq: VecDeque::new(),
                armed: false,
                bell: bell.clone(),
            },
        );
        Ok(Box::new(SimQp {
            qpn,
            caps,
            bell,
            endpoint: Endpoint {
                qpn,
                lid: self.port().lid,
                gid: self.port().gid,
                psn: random_psn(),
            },
        }))
    }
}

/// A simulated registration; dropping it removes its key from the fabric.
#[derive(Debug)]
struct SimMr {
    key: u32,
    addr: u64,
    len: u64,
}

impl MemoryRegion for SimMr {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for SimMr {
    fn drop(&mut self) {
        fabric().mrs.remove(&self.key);
    }
}

/// A simulated queue pair; dropping it destroys it, and its peer's requests then fail with
/// [`Status::RetryExceeded`].
#[derive(Debug)]
struct SimQp {
    qpn: u32,
    caps: QpCaps,
    bell: Arc<EventFd>,
    endpoint: Endpoint,
}

impl SimQp {
    fn with<T>(&self, f: impl FnOnce(&mut Fabric, u32) -> T) -> T {
        f(&mut fabric(), self.qpn)
    }
}

impl QueuePair for SimQp {
    fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn state(&self) -> QpState {
        self.with(|f, q| f.qps[&q].state)
    }

    fn connect(&mut self, remote: &Endpoint) -> Result<(), VerbsError> {
        self.with(|f, q| {
            let s = f.qps.get_mut(&q).expect("live");
            if s.state != QpState::Init {
                return Err(VerbsError::Invalid(format!(
                    "connect from state {:?}",
                    s.state
                )));
            }
            s.remote = Some(remote.qpn);
            s.state = QpState::ReadyToSend;
            Ok(())
        })
    }

    fn set_error(&mut self) {
        self.with(|f, q| f.qps.get_mut(&q).expect("live").enter_error());
    }

    fn post_send(&mut self, wr: &SendWr) -> Result<(), VerbsError> {
        self.with(|f, q| {
            let s = f.qps.get_mut(&q).expect("live");
            match s.state {
                QpState::Init => {
                    return Err(VerbsError::Invalid(
                        "post_send on a queue pair that is not connected".into(),
                    ))
                }
                _ if s.sq_used >= s.caps.max_send_wr => return Err(VerbsError::QueueFull("send")),
                QpState::Error => {
                    s.sq_used += 1;
                    s.complete(flushed(wr.wr_id, opcode_of(&wr.op)));
                    return Ok(());
                }
                QpState::ReadyToSend => {}
            }
            s.sq_used += 1;
            s.waiting.push_back(*wr);
            if s.waiting.len() == 1 {
                f.progress(q);
            }
            Ok(())
        })
    }

    fn post_recv(&mut self, wr: &RecvWr) -> Result<(), VerbsError> {
        self.with(|f, q| {
            let pd = f.qps[&q].pd;
            let local_ok = f.local_ok(pd, &wr.local);
            let s = f.qps.get_mut(&q).expect("live");
            if s.rq.len() >= s.caps.max_recv_wr as usize {
                return Err(VerbsError::QueueFull("receive"));
            }
            if !local_ok {
                return Err(VerbsError::Invalid(
                    "receive buffer outside any registration of this protection domain".into(),
                ));
            }
            if s.state == QpState::Error {
                s.complete(flushed(wr.wr_id, Opcode::Recv));
                return Ok(());
            }
            s.rq.push_back(*wr);
            // A peer waiting for a receive (RNR) may go on now.
            for peer in f.peers_of(q) {
                f.progress(peer);
            }
            Ok(())
        })
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        self.with(|f, q| {
            let s = f.qps.get_mut(&q).expect("live");
            let n = max.min(s.cq.len());
            for c in s.cq.drain(..n) {
                if c.opcode != Opcode::Recv {
                    s.sq_used -= 1;
                }
                out.push(c);
            }
            Ok(n)
        })
    }

    fn arm(&mut self) -> Result<(), VerbsError> {
        self.with(|f, q| {
            let s = f.qps.get_mut(&q).expect("live");
            if s.cq.is_empty() {
                s.armed = true;
            } else {
                // A completion is already there: hardware would not signal it, but a caller
                // that arms after an empty poll races with it; ring so it polls again.
                s.bell.ring();
            }
            Ok(())
        })
    }

    fn notify_fd(&self) -> RawFd {
        self.bell.as_raw_fd()
    }

    fn ack_notifications(&mut self) -> Result<(), VerbsError> {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a valid buffer from a non-blocking eventfd we
        // own; EAGAIN (nothing pending) is fine.
        let _ = unsafe { libc::read(self.bell.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        Ok(())
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        let mut f = fabric();
        f.qps.remove(&self.qpn);
        // Peers waiting on us now fail: nobody will answer.
        for peer in f.peers_of(self.qpn) {
            f.progress(peer);
        }
    }
}

/// Bytes moved so far (sends, writes, reads) by requests posted on queue pairs of simulated
/// device `sim<index>`, in this process: a per-device counter for tests of striping.
pub fn bytes_moved(index: usize) -> u64 {
    let lid = index as u16 + 1;
    fabric().moved.get(&lid).copied().unwrap_or(0)
}

/// The queue pairs alive on simulated device `sim<index>` (numbers), for tests that inject
/// faults on one device.
pub fn queue_pairs_of(index: usize) -> Vec<u32> {
    let lid = index as u16 + 1;
    let mut v: Vec<u32> = fabric()
        .qps
        .iter()
        .filter(|(_, s)| s.lid == lid)
        .map(|(q, _)| *q)
        .collect();
    v.sort_unstable();
    v
}

/// The queue pairs alive on the simulated fabric (numbers), for tests that inject faults.
pub fn queue_pairs() -> Vec<u32> {
    let mut v: Vec<u32> = fabric().qps.keys().copied().collect();
    v.sort_unstable();
    v
}

/// Fault injection: moves queue pair `qpn` to the error state, as a fatal device or link error
/// would. Every outstanding request on it completes with [`Status::Flushed`], in order; its
/// owner sees the failure at its next poll. Returns whether it existed.
pub fn inject_error(qpn: u32) -> bool {
    let mut f = fabric();
    match f.qps.get_mut(&qpn) {
        Some(s) => {
            s.enter_error();
            // `complete` rang the owner if it was armed and anything was flushed; with nothing
            // to flush, ring anyway so the owner looks at the state now.
            if s.cq.is_empty() {
                s.bell.ring();
            }
            true
        }
        None => false,
    }
}
