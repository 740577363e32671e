//! One pipe's `ibv` channel: its queue pair and the protocol that moves tensors through it.
//! Plain logic, no I/O readiness: the channel actor calls [`Rdma::send`] and [`Rdma::recv`] for
//! tensors, [`Rdma::progress`] when the completion queue signals, and hands the finished tensors
//! of [`Rdma::take_done`] back to the pipe.
//!
//! # Protocol
//!
//! Tensors move in the order the pipe hands them over, on both sides.
//!
//! 1. The receiver registers the buffer it was given (read-write for the peer, through the
//!    receive [`RegCache`]) and sends a 32-byte [`Request`] (message, tensor, address, rkey,
//!    length) with an RDMA send from a registered control slot.
//! 2. The sender matches the request with the oldest tensor it holds (same message and tensor,
//!    same length, else a protocol error), leases its own buffer's registration (local access)
//!    and RDMA-writes the bytes in `chunks` of at most 1 GiB and at least 32 bytes; the last
//!    write carries an immediate, the tensor's number on this channel.
//! 3. The receiver's receive completes with that immediate: the bytes have landed (RC delivers
//!    in order). Its registration is released (deregistered, under the default invalidation
//!    rule) *before* the buffer goes back to the user. The sender's buffer goes back once its
//!    writes have completed.
//!
//! The control slots and every receive are posted once and re-posted as they complete. A full
//! send queue backlogs ([`SendQueue`]). A failure (a completion in error, a verbs call failing,
//! the peer hanging up, the channel stopping) moves the queue pair to error, which flushes every
//! outstanding request; every tensor then comes back with the error, the received ones at once
//! (their registrations dropped first: the peer can no longer reach them), the sent ones once
//! the flush completions of their writes are in (the HCA may still read them until then).

use std::collections::VecDeque;
use std::sync::Arc;

#[cfg(feature = "cuda")]
pub use super::buf::GpuRegion;
pub use super::buf::RdmaBuf;
use crate::backend::ibv::regcache::{chunks_of, Lease, RegCache};
use crate::backend::ibv::sendq::{self, SendQueue, POLL_BATCH};
use crate::backend::ibv::{
    Access, Completion, Device, MemoryRegion, Opcode, QueuePair, RecvWr, SendOp, SendWr, Sge,
    Status, MIN_OP_BYTES,
};
use crate::error::{Error, Origin};
use crate::transport::stream::Memory;

/// Bytes in a request (and in each control slot): the verbs minimum, exactly.
pub const REQUEST_LEN: usize = MIN_OP_BYTES as usize;
/// Control slots for outgoing requests.
const SEND_SLOTS: u32 = 32;
/// Receives posted at most (requests from the peer and its immediates land there).
const MAX_RECV_SLOTS: u32 = 256;

/// `wr_id` tags.
const TAG_REQUEST: u64 = 1 << 62;
const TAG_WRITE: u64 = 2 << 62;
const TAG_MASK: u64 = 3 << 62;

/// What a receiver asks for: "write tensor `index` of message `seq`, `len` bytes, at `addr`".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The message's wire sequence number.
    pub seq: u64,
    /// The tensor's index in the message.
    pub index: u32,
    /// Where its buffer is.
    pub addr: u64,
    /// The buffer's remote key.
    pub rkey: u32,
    /// Its length.
    pub len: u64,
}

impl Request {
    /// The wire form: little-endian `seq`, `index`, `addr`, `rkey`, `len`.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.index.to_le_bytes());
        b[12..20].copy_from_slice(&self.addr.to_le_bytes());
        b[20..24].copy_from_slice(&self.rkey.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses the wire form.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Request {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        Request {
            seq: u64_at(0),
            index: u32_at(8),
            addr: u64_at(12),
            rkey: u32_at(20),
            len: u64_at(24),
        }
    }
}

/// A tensor the channel has finished with, for the pipe: sent (`sending`) or received.
#[derive(Debug)]
pub struct Finished {
    /// Whether we sent it.
    pub sending: bool,
    /// Its message.
    pub seq: u64,
    /// Its index.
    pub index: u32,
    /// The buffer, back (what was sent: owned or shared; what was received: owned).
    pub buffer: RdmaBuf,
    /// How it went.
    pub result: Result<(), Error>,
}

/// The registration caches of one device: local access for what we send, remote write for what
/// the peer writes into.
#[derive(Clone)]
pub struct Caches {
    /// For buffers we send from.
    pub send: Arc<RegCache>,
    /// For buffers the peer writes into.
    pub recv: Arc<RegCache>,
}

impl Caches {
    /// Caches of `device`, keeping `keep` bytes of idle registrations each (see the
    /// invalidation rule of [`crate::backend::ibv::regcache`]; 0 is the safe default).
    pub fn new(device: &Arc<dyn Device>, keep: u64) -> Caches {
        Caches {
            send: RegCache::new(device.clone(), Access::LOCAL, keep),
            recv: RegCache::new(device.clone(), Access::REMOTE_WRITE, keep),
        }
    }
}

struct Outgoing {
    seq: u64,
    index: u32,
    buffer: RdmaBuf,
}

struct Writing {
    n: u32,
    seq: u64,
    index: u32,
    buffer: RdmaBuf,
    /// Writes posted or backlogged and not yet completed.
    out: usize,
    _lease: Lease,
}

struct Reading {
    n: u32,
    seq: u64,
    index: u32,
    buffer: RdmaBuf,
    lease: Option<Lease>,
}

/// Control memory: receive slots, then send slots, [`REQUEST_LEN`] bytes each.
struct Slots {
    // Field order: the registration is dropped before the memory it covers.
    mr: Box<dyn MemoryRegion>,
    mem: Box<[u8]>,
}

impl Slots {
    fn sge(&self, slot: u32) -> Sge {
        let at = self.mr.addr() + u64::from(slot) * REQUEST_LEN as u64;
        self.mr
            .sge(at, REQUEST_LEN as u64)
            .expect("slots lie inside their registration")
    }

    fn bytes(&mut self, slot: u32) -> &mut [u8; REQUEST_LEN] {
        let at = slot as usize * REQUEST_LEN;
        (&mut self.mem[at..at + REQUEST_LEN])
            .try_into()
            .expect("one slot")
    }
}

/// Counters of one channel's queue pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Requests sent (tensors asked for).
    pub requests: u64,
    /// RDMA writes posted or backlogged (chunks).
    pub writes: u64,
    /// Completions handled.
    pub completions: u64,
}

/// One pipe's ibv channel state.
pub struct Rdma {
    /// The queue pair (connected by the channel's bootstrap).
    pub(crate) qp: Box<dyn QueuePair>,
    slots: Slots,
    connected: bool,
    /// The send queue and its backlog.
    pub sq: SendQueue,
    caches: Caches,
    free_slots: Vec<u32>,
    /// Requests waiting for a send slot (or for the connection).
    unsent: VecDeque<Request>,
    // Sending side.
    to_send: VecDeque<Outgoing>,
    requests: VecDeque<Request>,
    writing: VecDeque<Writing>,
    sent_n: u32,
    // Receiving side.
    reading: VecDeque<Reading>,
    recv_n: u32,
    failed: Option<Error>,
    done: Vec<Finished>,
    origin: Origin,
    scratch: Vec<Completion>,
    /// The most bytes per RDMA write (1 GiB; less in tests, to exercise chunking).
    max_op: u64,
    /// Its counters.
    pub stats: RdmaStats,
}

impl Rdma {
    /// A channel over `qp` (not yet connected): registers its control slots and posts a receive
    /// on every receive slot.
    pub fn new(
        device: &dyn Device,
        mut qp: Box<dyn QueuePair>,
        caches: Caches,
        origin: Origin,
    ) -> Result<Rdma, Error> {
        let recv = qp.caps().max_recv_wr.min(MAX_RECV_SLOTS);
        let mut mem = vec![0u8; (recv + SEND_SLOTS) as usize * REQUEST_LEN].into_boxed_slice();
        // SAFETY: `Slots` keeps `mem` (a boxed slice: it never moves) and drops the registration
        // first (field order).
        let mr = unsafe { device.register(mem.as_mut_ptr(), mem.len(), Access::LOCAL) }
            .map_err(|e| verbs_error("registering the control slots", e, &origin))?;
        let slots = Slots { mr, mem };
        for slot in 0..recv {
            qp.post_recv(&RecvWr {
                wr_id: u64::from(slot),
                local: slots.sge(slot),
            })
            .map_err(|e| verbs_error("ibv_post_recv", e, &origin))?;
        }
        Ok(Rdma {
            qp,
            free_slots: (recv..recv + SEND_SLOTS).rev().collect(),
            slots,
            connected: false,
            sq: SendQueue::default(),
            caches,
            unsent: VecDeque::new(),
            to_send: VecDeque::new(),
            requests: VecDeque::new(),
            writing: VecDeque::new(),
            sent_n: 0,
            reading: VecDeque::new(),
            recv_n: 0,
            failed: None,
            done: Vec::new(),
            origin,
            scratch: Vec::with_capacity(POLL_BATCH),
            max_op: crate::backend::ibv::MAX_OP_BYTES,
            stats: RdmaStats::default(),
        })
    }

    /// Splits writes at `bytes` instead of 1 GiB (clamped to 64 B ..= 1 GiB; see
    /// [`chunks_of`]).
    pub fn set_chunk_limit(&mut self, bytes: u64) {
        self.max_op = bytes;
    }

    /// The queue pair is connected: requests may go out.
    pub fn connected(&mut self) {
        self.connected = true;
        self.send_requests();
    }

    /// Whether the channel holds no tensor.
    pub fn is_idle(&self) -> bool {
        self.to_send.is_empty() && self.writing.is_empty() && self.reading.is_empty()
    }

    /// Where errors say they come from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The first failure, if any.
    pub fn failure(&self) -> Option<&Error> {
        self.failed.as_ref()
    }

    /// Tensors finished since the last call, in the order they finished.
    pub fn take_done(&mut self) -> std::vec::Drain<'_, Finished> {
        self.done.drain(..)
    }

    /// Sends a tensor of at least 32 bytes (owned or shared bytes, or GPU memory) once the peer
    /// asks for it.
    pub fn send(&mut self, seq: u64, index: u32, buffer: impl Into<RdmaBuf>) {
        let buffer = buffer.into();
        if let Some(e) = &self.failed {
            let result = Err(e.clone());
            return self.finish(true, seq, index, buffer, result);
        }
        self.to_send.push_back(Outgoing { seq, index, buffer });
        self.match_requests();
    }

    /// Receives a tensor of at least 32 bytes into `buffer` (owned host bytes, a region of a buffer
    /// held elsewhere (a stripe), or GPU memory):
    /// registers it and asks the peer.
    pub fn recv(&mut self, seq: u64, index: u32, buffer: impl Into<RdmaBuf>) {
        let mut buffer = buffer.into();
        if let Some(e) = &self.failed {
            let result = Err(e.clone());
            return self.finish(false, seq, index, buffer, result);
        }
        if matches!(buffer, RdmaBuf::Host(Memory::Shared(_))) {
            let e = Error::protocol("receiving into shared, read-only bytes", &self.origin);
            return self.finish(false, seq, index, buffer, Err(e));
        }
        if (buffer.len() as u64) < MIN_OP_BYTES {
            let e = Error::protocol(
                format!(
                    "an ibv channel tensor of {} bytes (under the 32-byte minimum travels inline)",
                    buffer.len()
                ),
                &self.origin,
            );
            self.finish(false, seq, index, buffer, Err(e.clone()));
            return self.fail(e);
        }
        // SAFETY: the buffer stays in `reading` (an owned heap block or device memory never
        // moves; a region's bytes stay with their holder until this one comes back) until the
        // lease is dropped, which happens before the buffer is handed back.
        let lease = match unsafe { buffer.lease(&self.caches.recv) } {
            Ok(l) => l,
            Err(e) => {
                let e = verbs_error("registering a receive buffer", e, &self.origin);
                self.finish(false, seq, index, buffer, Err(e.clone()));
                return self.fail(e);
            }
        };
        self.unsent.push_back(Request {
            seq,
            index,
            addr: buffer.addr(),
            rkey: lease.mr.rkey(),
            len: buffer.len() as u64,
        });
        self.reading.push_back(Reading {
            n: self.recv_n,
            seq,
            index,
            buffer,
            lease: Some(lease),
        });
        self.recv_n = self.recv_n.wrapping_add(1);
        self.send_requests();
    }

    fn send_requests(&mut self) {
        while self.connected && self.failed.is_none() && !self.unsent.is_empty() {
            let Some(slot) = self.free_slots.pop() else {
                return;
            };
            let r = self.unsent.pop_front().expect("not empty");
            *self.slots.bytes(slot) = r.encode();
            self.stats.requests += 1;
            let wr = SendWr {
                wr_id: TAG_REQUEST | u64::from(slot),
                op: SendOp::Send,
                local: self.slots.sge(slot),
            };
            self.submit(wr);
        }
    }

    fn submit(&mut self, wr: SendWr) {
        if let Err(e) = self.sq.submit(&mut *self.qp, wr) {
            self.retire(wr.wr_id);
            let e = verbs_error("ibv_post_send", e, &self.origin);
            self.fail(e);
        }
    }

    /// Pairs the peer's requests with our tensors, oldest first, and writes them.
    fn match_requests(&mut self) {
        while self.failed.is_none() && !self.to_send.is_empty() && !self.requests.is_empty() {
            let r = self.requests.pop_front().expect("not empty");
            let mut t = self.to_send.pop_front().expect("not empty");
            if (r.seq, r.index, r.len) != (t.seq, t.index, t.buffer.len() as u64) {
                let e = Error::protocol(
                    format!(
                        "the peer asked for tensor {} of message {} ({} bytes); the next one \
                         here is tensor {} of message {} ({} bytes)",
                        r.index,
                        r.seq,
                        r.len,
                        t.index,
                        t.seq,
                        t.buffer.len()
                    ),
                    &self.origin,
                );
                self.to_send.push_front(t);
                return self.fail(e);
            }
            // SAFETY: the buffer stays in `writing` (its heap block never moves, and shared
            // bytes stay alive while referenced) until its writes have completed and the lease
            // is dropped with the entry. Nothing is written through the registration (the
            // HCA only reads the source of a write).
            let lease = match unsafe { t.buffer.lease(&self.caches.send) } {
                Ok(l) => l,
                Err(e) => {
                    self.to_send.push_front(t);
                    let e = verbs_error("registering a send buffer", e, &self.origin);
                    return self.fail(e);
                }
            };
            let n = self.sent_n;
            self.sent_n = self.sent_n.wrapping_add(1);
            let plan = chunks_of(r.len, self.max_op);
            let base = t.buffer.addr();
            let local = |off: u64, len: u64| lease.mr.sge(base + off, len).expect("inside");
            let wrs: Vec<SendWr> = plan
                .iter()
                .enumerate()
                .map(|(i, &(off, len))| SendWr {
                    wr_id: TAG_WRITE | u64::from(n),
                    op: if i + 1 == plan.len() {
                        SendOp::WriteImm {
                            remote_addr: r.addr + off,
                            rkey: r.rkey,
                            imm: n,
                        }
                    } else {
                        SendOp::Write {
                            remote_addr: r.addr + off,
                            rkey: r.rkey,
                        }
                    },
                    local: local(off, len),
                })
                .collect();
            self.writing.push_back(Writing {
                n,
                seq: t.seq,
                index: t.index,
                buffer: t.buffer,
                out: wrs.len(),
                _lease: lease,
            });
            for wr in wrs {
                self.stats.writes += 1;
                if self.failed.is_some() {
                    self.retire(wr.wr_id);
                } else {
                    self.submit(wr);
                }
            }
        }
    }

    /// Accounts for a send request that completed, or that will never be posted.
    fn retire(&mut self, wr_id: u64) {
        match wr_id & TAG_MASK {
            TAG_REQUEST => self.free_slots.push((wr_id & !TAG_MASK) as u32),
            TAG_WRITE => self.write_done((wr_id & !TAG_MASK) as u32),
            _ => {}
        }
    }

    fn write_done(&mut self, n: u32) {
        if let Some(w) = self.writing.iter_mut().find(|w| w.n == n && w.out > 0) {
            w.out -= 1;
        }
        while self.writing.front().is_some_and(|w| w.out == 0) {
            let w = self.writing.pop_front().expect("present");
            let result = self.failed.clone().map_or(Ok(()), Err);
            let Writing {
                seq, index, buffer, ..
            } = w;
            self.finish(true, seq, index, buffer, result);
        }
    }

    fn finish(
        &mut self,
        sending: bool,
        seq: u64,
        index: u32,
        buffer: RdmaBuf,
        result: Result<(), Error>,
    ) {
        self.done.push(Finished {
            sending,
            seq,
            index,
            buffer,
            result,
        });
    }

    /// Records the first failure and moves the queue pair to error, which flushes everything
    /// outstanding. Received tensors come back at once, their registrations dropped first;
    /// sent ones as their writes' flush completions come in (call [`Self::progress`]).
    pub fn fail(&mut self, e: Error) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some(e.clone());
        self.qp.set_error();
        let waiting: Vec<u64> = self.sq.abandon().map(|wr| wr.wr_id).collect();
        for wr_id in waiting {
            self.retire(wr_id);
        }
        self.unsent.clear();
        for t in std::mem::take(&mut self.to_send) {
            self.finish(true, t.seq, t.index, t.buffer, Err(e.clone()));
        }
        for mut r in std::mem::take(&mut self.reading) {
            // The queue pair is in error (the peer can no longer write here) and the
            // registration goes before the buffer does.
            drop(r.lease.take());
            self.finish(false, r.seq, r.index, r.buffer, Err(e.clone()));
        }
    }

    /// Handles every completion waiting, then posts what the send queue has room for.
    pub fn progress(&mut self) {
        sendq::progress(self);
    }
}

impl sendq::Progress for Rdma {
    fn queues(&mut self) -> (&mut dyn QueuePair, &mut SendQueue) {
        (&mut *self.qp, &mut self.sq)
    }

    fn scratch(&mut self) -> &mut Vec<Completion> {
        &mut self.scratch
    }

    fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    fn verbs_failed(&mut self, call: &'static str, e: crate::backend::ibv::VerbsError) {
        let e = verbs_error(call, e, &self.origin);
        self.fail(e);
    }

    fn on_completion(&mut self, c: Completion) {
        self.stats.completions += 1;
        if c.status != Status::Success {
            let what = match c.opcode {
                Opcode::Recv => "receive",
                Opcode::Send => "request send",
                _ => "RDMA write",
            };
            let e = if c.status == Status::RetryExceeded {
                // Nobody answers at the other end: the peer's queue pair is gone.
                Error::PeerClosed {
                    reason: format!("ibv channel {what}: {}", c.status),
                    graceful: false,
                    origin: self.origin.clone(),
                }
            } else {
                Error::io(
                    "ibv channel",
                    std::io::Error::other(format!("{what} failed: {}", c.status)),
                    &self.origin,
                )
            };
            self.fail(e);
        }
        if c.opcode != Opcode::Recv {
            // After `fail`: a write retired now finishes with the error.
            self.sq.completed();
            self.retire(c.wr_id);
            self.send_requests();
            return;
        }
        if self.failed.is_some() {
            return;
        }
        let slot = c.wr_id as u32;
        match c.imm {
            None if c.byte_len as usize != REQUEST_LEN => {
                let e = Error::protocol(
                    format!("an ibv channel request of {} bytes", c.byte_len),
                    &self.origin,
                );
                return self.fail(e);
            }
            None => {
                let r = Request::decode(self.slots.bytes(slot));
                self.requests.push_back(r);
                self.match_requests();
            }
            Some(n) => match self.reading.front() {
                Some(r) if r.n == n => {
                    let mut r = self.reading.pop_front().expect("present");
                    drop(r.lease.take()); // deregistered before the user sees the buffer
                    self.finish(false, r.seq, r.index, r.buffer, Ok(()));
                }
                _ => {
                    let e = Error::protocol(
                        format!("the peer announced tensor {n}, which was not asked for next"),
                        &self.origin,
                    );
                    return self.fail(e);
                }
            },
        }
        if self.failed.is_none() {
            let wr = RecvWr {
                wr_id: u64::from(slot),
                local: self.slots.sge(slot),
            };
            if let Err(e) = self.qp.post_recv(&wr) {
                let e = verbs_error("ibv_post_recv", e, &self.origin);
                self.fail(e);
            }
        }
    }
}

/// A verbs call's error as the channel's I/O error.
pub(crate) fn verbs_error(
    op: &'static str,
    e: crate::backend::ibv::VerbsError,
    origin: &Origin,
) -> Error {
    Error::io(op, std::io::Error::other(e), origin)
}
