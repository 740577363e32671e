//! One ibv connection's state: the queue pair, its registered inbox and outbox rings, credits,
//! and the send-queue backlog. Plain logic, no I/O readiness: the halves call `Core::write`
//! and `Core::read`, the queue pair's driver task calls `Core::progress` when completions arrive.
//!
//! # Byte stream over RDMA writes with immediate
//!
//! Each side registers an *inbox* ring of `cap` bytes (plus [`SLACK`]) that the peer may write
//! into, and an *outbox* of the peer's inbox size, which it writes from. Outbox position `p` and
//! the peer's inbox position `p` are the same byte (both `p mod cap`), so a piece of the stream
//! is one RDMA write with immediate from one to the other, whose immediate is the piece's length.
//! The peer's receive completion says "`len` more bytes are in your inbox": in order, since RC
//! completes in order.
//!
//! - **Credits.** The writer may be at most `cap` bytes ahead of what the reader has consumed.
//!   The reader returns what it consumed the same way: a zero-length write with immediate whose
//!   value has [`CREDIT`] set. It does so once a quarter of the ring is consumed, or when it has
//!   read everything that arrived, so a writer never waits on credits that are not coming.
//! - **Sizes.** Pieces are split at the ring's end and are never more than the ring
//!   ([`crate::backend::ibv::MAX_OP_BYTES`] bounds the ring). A piece under 32 bytes
//!   ([`crate::backend::ibv::MIN_OP_BYTES`]) is sent as a 32-byte write whose immediate still says the
//!   true length: the extra bytes land past the writer's position (space the credit rule keeps
//!   free: a write always leaves [`SLACK`] bytes of credit unused) or in the slack past the ring's
//!   end, and are overwritten by the next piece.
//! - **Backlog.** A work request that finds the send queue full waits in a FIFO, posted as
//!   completions free slots, so order is kept and a full queue never fails an operation.
//! - **Close.** A write half that shuts down sends an immediate with [`CLOSE`] set after its
//!   last bytes: the peer reads to the end, then sees end of stream.

use std::io::IoSlice;
use std::task::Waker;

use crate::backend::ibv::sendq::{self, SendQueue, POLL_BATCH};
use crate::backend::ibv::{
    Completion, MemoryRegion, Opcode, QueuePair, RecvWr, SendOp, SendWr, Sge, Status, VerbsError,
    MIN_OP_BYTES,
};

/// Bytes past each ring's end: room for a short piece's padding.
pub const SLACK: usize = MIN_OP_BYTES as usize;
/// Immediate flag: credits (bytes consumed), not data.
pub const CREDIT: u32 = 1 << 31;
/// Immediate flag: the peer's write half closed.
pub const CLOSE: u32 = 1 << 30;
/// The largest ring: a piece's length must fit below the flags.
pub const MAX_CAPACITY: usize = 1 << 28;
/// The smallest ring.
pub const MIN_CAPACITY: usize = 4096;

/// `wr_id` flag of a credit or close request (data requests carry their end position).
const CONTROL_WR: u64 = 1 << 63;

/// A registered ring buffer (memory plus its registration).
pub(crate) struct Ring {
    // Field order: the registration is dropped before the memory it covers.
    pub(crate) mr: Box<dyn MemoryRegion>,
    pub(crate) mem: Box<[u8]>,
    pub(crate) cap: usize,
}

/// Where the peer's inbox is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteRing {
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) cap: usize,
}

/// Counters the queue pair's driver reports (the send queue's are in its
/// [`SendStats`](crate::backend::ibv::sendq::SendStats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpStats {
    /// Completions handled.
    pub completions: u64,
    /// Credit returns sent.
    pub credits_sent: u64,
}

/// The state of one connection.
pub(crate) struct Core {
    pub(crate) qp: Box<dyn QueuePair>,
    inbox: Ring,
    outbox: Ring,
    peer: RemoteRing,
    // Writer side: positions count bytes since the start, never wrapping.
    out_head: u64,
    out_done: u64,
    peer_consumed: u64,
    // Reader side.
    in_head: u64,
    in_tail: u64,
    to_ack: u64,
    // Send queue and its backlog.
    pub(crate) sq: SendQueue,
    // Lifecycle.
    pub(crate) failed: Option<String>,
    pub(crate) peer_closed: bool,
    pub(crate) peer_gone: bool,
    pub(crate) write_closed: bool,
    pub(crate) halves: u8,
    pub(crate) read_waker: Option<Waker>,
    pub(crate) write_waker: Option<Waker>,
    pub(crate) stats: QpStats,
    scratch: Vec<Completion>,
}

fn copy_in(ring: &mut Ring, pos: u64, src: &[u8]) {
    let at = (pos % ring.cap as u64) as usize;
    let first = src.len().min(ring.cap - at);
    ring.mem[at..at + first].copy_from_slice(&src[..first]);
    ring.mem[..src.len() - first].copy_from_slice(&src[first..]);
}

fn copy_out(ring: &Ring, pos: u64, dst: &mut [u8]) {
    let at = (pos % ring.cap as u64) as usize;
    let first = dst.len().min(ring.cap - at);
    dst[..first].copy_from_slice(&ring.mem[at..at + first]);
    let rest = dst.len() - first;
    dst[first..].copy_from_slice(&ring.mem[..rest]);
}

impl Core {
    /// A connected queue pair with its rings; posts the receive queue full.
    pub(crate) fn new(
        qp: Box<dyn QueuePair>,
        inbox: Ring,
        outbox: Ring,
        peer: RemoteRing,
    ) -> Result<Core, VerbsError> {
        let mut core = Core {
            qp,
            inbox,
            outbox,
            peer,
            out_head: 0,
            out_done: 0,
            peer_consumed: 0,
            in_head: 0,
            in_tail: 0,
            to_ack: 0,
            sq: SendQueue::default(),
            failed: None,
            peer_closed: false,
            peer_gone: false,
            write_closed: false,
            halves: 2,
            read_waker: None,
            write_waker: None,
            stats: QpStats::default(),
            scratch: Vec::with_capacity(POLL_BATCH),
        };
        for _ in 0..core.qp.caps().max_recv_wr {
            core.post_recv()?;
        }
        Ok(core)
    }

    fn post_recv(&mut self) -> Result<(), VerbsError> {
        self.qp.post_recv(&RecvWr {
            wr_id: 0,
            local: Sge {
                addr: 0,
                len: 0,
                lkey: 0,
            },
        })
    }

    /// Posts `wr`, or queues it behind the backlog when the send queue is full.
    fn submit(&mut self, wr: SendWr) {
        if let Err(e) = self.sq.submit(&mut *self.qp, wr) {
            self.fail(format!("ibv_post_send: {e}"));
        }
    }

    /// Writes one piece of the stream (`len` bytes at outbox position `pos`) to the peer.
    fn post_piece(&mut self, pos: u64, len: u64) {
        let at = pos % self.outbox.cap as u64;
        // A short piece goes out as MIN_OP_BYTES: the extra bytes are slack (see module docs).
        let wire = len.max(MIN_OP_BYTES);
        let local = self
            .outbox
            .mr
            .sge(self.outbox.mr.addr() + at, wire)
            .expect("pieces stay inside the outbox and its slack");
        self.submit(SendWr {
            wr_id: pos + len,
            op: SendOp::WriteImm {
                remote_addr: self.peer.addr + at,
                rkey: self.peer.rkey,
                imm: len as u32,
            },
            local,
        });
    }

    /// Sends a zero-length write with immediate `imm` (credits or close).
    fn post_control(&mut self, imm: u32) {
        self.submit(SendWr {
            wr_id: CONTROL_WR,
            op: SendOp::WriteImm {
                remote_addr: self.peer.addr,
                rkey: self.peer.rkey,
                imm,
            },
            local: Sge {
                addr: 0,
                len: 0,
                lkey: 0,
            },
        });
    }

    /// Takes up to `buf.len()` bytes into the stream; 0 means "no room now" (wait for
    /// [`progress`](Self::progress) to wake the writer).
    #[cfg(test)]
    pub(crate) fn write(&mut self, buf: &[u8]) -> usize {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    /// Takes as many bytes of `bufs`, in order, as the outbox and the credits allow, and sends
    /// them as one piece (two if they wrap): one RDMA write however many slices.
    pub(crate) fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> usize {
        if self.failed.is_some() || self.write_closed {
            return 0;
        }
        let cap = self.peer.cap as u64;
        let outbox_free = cap - (self.out_head - self.out_done);
        let credit = (cap - (self.out_head - self.peer_consumed)).saturating_sub(SLACK as u64);
        let room = outbox_free.min(credit) as usize;
        let pos = self.out_head;
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(room - n);
            copy_in(&mut self.outbox, pos + n as u64, &b[..take]);
            n += take;
            if n == room {
                break;
            }
        }
        if n == 0 {
            return 0;
        }
        let at = pos % cap;
        let first = (n as u64).min(cap - at);
        self.post_piece(pos, first);
        if first < n as u64 {
            self.post_piece(pos + first, n as u64 - first);
        }
        self.out_head += n as u64;
        n
    }

    /// Moves up to `buf.len()` bytes out of the inbox; 0 means nothing has arrived.
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> usize {
        let avail = self.in_head - self.in_tail;
        let n = (buf.len() as u64).min(avail) as usize;
        if n == 0 {
            return 0;
        }
        copy_out(&self.inbox, self.in_tail, &mut buf[..n]);
        self.in_tail += n as u64;
        self.to_ack += n as u64;
        if self.failed.is_none()
            && (self.to_ack >= self.inbox.cap as u64 / 4 || self.in_tail == self.in_head)
        {
            let credit = self.to_ack as u32;
            self.to_ack = 0;
            self.stats.credits_sent += 1;
            self.post_control(CREDIT | credit);
        }
        n
    }

    /// Whether every byte written has been placed in the peer's inbox (and nothing waits).
    pub(crate) fn flushed(&self) -> bool {
        self.sq.idle()
    }

    /// The write half is done: send the close mark after the last bytes.
    pub(crate) fn close_write(&mut self) {
        if !self.write_closed {
            self.write_closed = true;
            if self.failed.is_none() {
                self.post_control(CLOSE);
            }
        }
    }

    /// Records the first failure, moves the queue pair to error (flushing what is outstanding)
    /// and wakes both halves.
    pub(crate) fn fail(&mut self, why: String) {
        if self.failed.is_none() {
            self.failed = Some(why);
            self.qp.set_error();
        }
        self.wake();
    }

    pub(crate) fn wake(&mut self) {
        if let Some(w) = self.read_waker.take() {
            w.wake();
        }
        if let Some(w) = self.write_waker.take() {
            w.wake();
        }
    }

    /// Handles every completion waiting: data and credits in, send slots freed, backlog
    /// posted. Wakes the halves that can go on.
    pub(crate) fn progress(&mut self) {
        sendq::progress(self);
    }
}

impl sendq::Progress for Core {
    fn queues(&mut self) -> (&mut dyn QueuePair, &mut SendQueue) {
        (&mut *self.qp, &mut self.sq)
    }

    fn scratch(&mut self) -> &mut Vec<Completion> {
        &mut self.scratch
    }

    fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    fn verbs_failed(&mut self, call: &'static str, e: VerbsError) {
        self.fail(format!("{call}: {e}"));
    }

    fn on_completion(&mut self, c: Completion) {
        self.stats.completions += 1;
        if c.opcode != Opcode::Recv {
            self.sq.completed();
        }
        if c.status != Status::Success {
            if self.failed.is_none() {
                let what = if c.opcode == Opcode::Recv {
                    "receive"
                } else {
                    "RDMA write"
                };
                self.fail(format!("{what} failed: {}", c.status));
            }
            return;
        }
        match (c.opcode, c.imm) {
            (Opcode::Recv, Some(imm)) => {
                if imm & CREDIT != 0 {
                    self.peer_consumed += u64::from(imm & !CREDIT);
                    if self.peer_consumed > self.out_head {
                        return self.fail("the peer returned more credits than sent".into());
                    }
                    wake(&mut self.write_waker);
                } else if imm & CLOSE != 0 {
                    self.peer_closed = true;
                    wake(&mut self.read_waker);
                } else {
                    self.in_head += u64::from(imm);
                    if self.in_head - self.in_tail > self.inbox.cap as u64 {
                        return self.fail("the peer wrote past its credits".into());
                    }
                    wake(&mut self.read_waker);
                }
                if let Err(e) = self.post_recv() {
                    self.fail(format!("ibv_post_recv: {e}"));
                }
            }
            (Opcode::Recv, None) => self.fail("unexpected send from the peer".into()),
            _ => {
                if c.wr_id & CONTROL_WR == 0 {
                    self.out_done = self.out_done.max(c.wr_id);
                    wake(&mut self.write_waker);
                }
                if self.write_closed && self.flushed() {
                    wake(&mut self.write_waker);
                }
            }
        }
    }
}

fn wake(w: &mut Option<Waker>) {
    if let Some(w) = w.take() {
        w.wake();
    }
}
