//! The read and write loops every stream transport shares.
//!
//! A connection is driven by two loops, one per direction. Each takes operations from a queue,
//! executes them strictly in *ticket* order (tickets are handed out by the pipe, so a channel's
//! operations and the pipe's own interleave exactly as the pipe decided, whichever mailbox they
//! came through) and reports each completion, with the caller's buffers, to the reply queue named
//! in the operation.
//!
//! Bytes land directly in the caller's buffers: payloads and tensor pieces are read with
//! `read_exact` into the user's memory (the 8 KiB read buffer only serves frames and small payloads; tokio
//! bypasses it for large reads), and written with vectored writes straight from the user's
//! memory. Encoding and frame buffers are reused, so steady state allocates nothing here.
//!
//! When stopped, a loop interrupts the operation in progress and completes it and every later
//! one with an error, handing all buffers back; the writer sends a farewell frame first if the
//! stream is at a frame boundary.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::mem;
use std::pin::Pin;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch};
use tokio::time::Sleep;

use super::liveness::{silence, Coarse, Heartbeat, Pulse, Stamped};
use super::{BoxRead, BoxWrite};
use crate::error::{Error, Origin};
use crate::message::{Descriptor, Payload};
use crate::wire::{self, ChunkHeader, Frame, FrameKind, Limits, WireDescriptor, LEN_PREFIX};

/// Where a loop sends completions.
pub type Reply = mpsc::UnboundedSender<Done>;

/// Capacity of the buffered reader in front of each connection. It is allocated (and touched)
/// for every connection, idle or not, so it is kept small: frames and small payloads go through
/// it, and a read of at least this size into an empty buffer bypasses it.
pub const READ_BUFFER: usize = 8 << 10;

/// A frame buffer grown past 4 × this by a large frame is shrunk back to it.
const FRAME_BUFFER: usize = 64 << 10;

/// Payloads of a message totalling at most this many bytes are read together with its
/// descriptor frame (see [`inline_payloads`]).
pub const INLINE_PAYLOADS: u64 = 16 << 10;

/// The largest tensor the owner of a connection writes itself when the write loop is idle
/// ([`Parking::try_write_batch`]), in one chunk; larger ones go through the loop.
pub const DIRECT_TENSOR_MAX: usize = INLINE_PAYLOADS as usize;

/// The total size of a message's payloads, if small enough to be read with its descriptor: the
/// read loop then reads them right after the frame and hands them over in [`Done::Frame`], which
/// saves the receiver a round through the loop's queue per message.
pub fn inline_payloads(d: &Descriptor) -> Option<usize> {
    let total = d
        .payloads
        .iter()
        .try_fold(0u64, |sum, p| sum.checked_add(p.length))?;
    (total <= INLINE_PAYLOADS).then_some(total as usize)
}

/// Which of a message's tensors follow its descriptor on the same stream, as chunk frames,
/// judged from each tensor's channel data. The pipe knows from its channel; the read loop is told
/// with each [`InOp::Frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// None (xth, mpt, cma's reads, and a channel's own connections).
    Nothing,
    /// All of them (basic).
    All,
    /// Those whose channel data is empty (cma's inline tensors).
    NoData,
}

impl Carried {
    /// Whether a tensor with this channel data follows on the stream.
    pub fn carries(self, data: &[u8]) -> bool {
        match self {
            Carried::Nothing => false,
            Carried::All => true,
            Carried::NoData => data.is_empty(),
        }
    }
}

/// The bytes of a message that follow its descriptor on the stream and are read with it: its
/// payloads, when [inline](inline_payloads), and then the tensors the stream carries, when the
/// whole lot totals at most [`INLINE_PAYLOADS`] (otherwise the tensors are read by their own
/// operations). `None` when the payloads are not inline.
pub fn inline_len(wd: &WireDescriptor, carried: Carried) -> Option<Inline> {
    let payloads = inline_payloads(&wd.descriptor)?;
    let mut total = payloads as u64;
    for (t, (_, data)) in wd.descriptor.tensors.iter().zip(&wd.routes) {
        if carried.carries(data) {
            total = total.saturating_add(t.length);
        }
    }
    Some(Inline {
        payloads,
        total: (total <= INLINE_PAYLOADS).then_some(total as usize),
    })
}

/// What [`inline_len`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inline {
    /// The payloads' bytes.
    pub payloads: usize,
    /// The payloads' and the carried tensors' bytes, if the tensors are read with the frame too.
    pub total: Option<usize>,
}

impl Inline {
    /// Whether everything of the message on the stream is read with its frame.
    pub fn whole(&self) -> bool {
        self.total.is_some()
    }
}

/// Whether a message takes nothing from its stream after its descriptor frame but what is read
/// with it ([`inline_len`]). The next thing on the stream is then the next frame.
pub fn self_contained(wd: &WireDescriptor, carried: Carried) -> bool {
    inline_len(wd, carried).is_some_and(|i| i.whole())
}

/// Appends the frame that heads one chunk of tensor `index` of message `seq`: `length` bytes
/// at `offset`, which follow it on the stream. The write loop and the owner's direct writes
/// ([`Parking::try_write_batch`]) both write chunks with it.
fn encode_chunk_header(out: &mut Vec<u8>, seq: u64, index: u32, offset: u64, length: u64) {
    let h = ChunkHeader {
        seq,
        tensor: index,
        offset,
        length,
    };
    wire::encode_frame(out, FrameKind::Chunk, |b| wire::encode_chunk(b, &h));
}

/// Memory a tensor operation reads from or writes into.
#[derive(Debug)]
pub enum Memory {
    /// A buffer the operation owns and hands back.
    Owned(Vec<u8>),
    /// Part of a buffer owned elsewhere (a stripe of a tensor split across lanes).
    Region(Region),
}

/// A raw, exclusively borrowed piece of memory; see [`Region::new`].
#[derive(Debug)]
pub struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Region is an exclusive borrow of its bytes (the creator promised so in
// `Region::new`); moving it to another thread moves that borrow, as `&mut [u8]` may be moved.
unsafe impl Send for Region {}

impl Region {
    /// A region over `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The bytes must stay allocated, and must not be accessed by anyone else, until the
    /// operation holding the region has completed (its `Done` has been received).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Region {
        Region { ptr, len }
    }
}

impl Memory {
    fn as_slice(&self) -> &[u8] {
        match self {
            Memory::Owned(v) => v,
            // SAFETY: `Region::new`'s contract: the bytes are alive and ours alone.
            Memory::Region(r) => unsafe { std::slice::from_raw_parts(r.ptr, r.len) },
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Memory::Owned(v) => v,
            // SAFETY: `Region::new`'s contract: the bytes are alive and ours alone.
            Memory::Region(r) => unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) },
        }
    }

    /// The owned buffer, if this is one.
    pub fn into_vec(self) -> Option<Vec<u8>> {
        match self {
            Memory::Owned(v) => Some(v),
            Memory::Region(_) => None,
        }
    }
}

/// A write, in ticket order.
#[derive(Debug)]
pub enum OutOp {
    /// A pre-encoded frame followed by raw payload bytes.
    Message {
        /// Position in the write order.
        ticket: u64,
        /// The encoded frame (with its length prefix), handed back for reuse.
        frame: Vec<u8>,
        /// Payloads whose `data` follows the frame, handed back.
        payloads: Vec<Payload>,
        /// Where the completion goes.
        reply: Reply,
    },
    /// A tensor (or a stripe of one), as chunk frames each followed by a piece of the memory.
    Tensor {
        /// Position in the write order.
        ticket: u64,
        /// Message sequence number.
        seq: u64,
        /// Tensor index in the message.
        index: u32,
        /// The bytes, handed back.
        memory: Memory,
        /// Where `memory` starts within the tensor.
        offset: u64,
        /// Largest piece per chunk frame.
        chunk_size: usize,
        /// Where the completion goes.
        reply: Reply,
    },
}

/// A read, in ticket order.
#[derive(Debug)]
pub enum InOp {
    /// The next frame, whatever its kind and size (within limits).
    Frame {
        /// Position in the read order.
        ticket: u64,
        /// Where the completion goes.
        reply: Reply,
        /// After a [`self_contained`] descriptor, the loop goes on to read the next frame by
        /// itself, as `Frame { ticket: ticket + 1, reply, more: more - 1 }`, while `more > 0`:
        /// the owner, seeing the same descriptors, counts those tickets as used. This saves a
        /// round through the queue (and a wake of the loop) per small message.
        more: u32,
        /// Which tensors of a descriptor follow it on this stream (see [`inline_len`]).
        carried: Carried,
    },
    /// Raw bytes exactly filling each buffer, in order.
    Payloads {
        /// Position in the read order.
        ticket: u64,
        /// The receiver's buffers, handed back filled.
        buffers: Vec<Vec<u8>>,
        /// Where the completion goes.
        reply: Reply,
    },
    /// A tensor (or a stripe of one) sent as chunk frames by [`OutOp::Tensor`].
    Tensor {
        /// Position in the read order.
        ticket: u64,
        /// Expected message sequence number.
        seq: u64,
        /// Expected tensor index.
        index: u32,
        /// The receiver's memory, handed back filled.
        memory: Memory,
        /// Where `memory` starts within the tensor.
        offset: u64,
        /// Where the completion goes.
        reply: Reply,
    },
}

/// A completed operation, with its buffers.
#[derive(Debug)]
pub enum Done {
    /// [`OutOp::Message`] finished.
    Wrote {
        /// Its ticket.
        ticket: u64,
        /// The frame buffer, for reuse.
        frame: Vec<u8>,
        /// The payloads.
        payloads: Vec<Payload>,
        /// Outcome.
        result: Result<(), Error>,
    },
    /// [`OutOp::Tensor`] finished.
    WroteTensor {
        /// Message sequence number.
        seq: u64,
        /// Tensor index.
        index: u32,
        /// The memory.
        memory: Memory,
        /// Outcome.
        result: Result<(), Error>,
    },
    /// [`InOp::Frame`] finished.
    Frame {
        /// Its ticket.
        ticket: u64,
        /// The frame, or why none came.
        result: Result<Frame, Error>,
        /// For a descriptor whose payloads are [inline](inline_payloads): their bytes, one after
        /// the other, then those of the carried tensors if they were read too
        /// ([`inline_len`]). Empty otherwise.
        payloads: Vec<u8>,
    },
    /// [`InOp::Payloads`] finished.
    Payloads {
        /// Its ticket.
        ticket: u64,
        /// The buffers.
        buffers: Vec<Vec<u8>>,
        /// Outcome.
        result: Result<(), Error>,
    },
    /// [`InOp::Tensor`] finished.
    Tensor {
        /// Message sequence number.
        seq: u64,
        /// Tensor index.
        index: u32,
        /// The memory.
        memory: Memory,
        /// Outcome.
        result: Result<(), Error>,
    },
}

trait Ticketed {
    fn ticket(&self) -> u64;
    fn complete(self, result: Result<(), Error>);
}

fn send(reply: &Reply, d: Done) {
    // The owner may be gone already (pipe dropped); then nobody wants the answer.
    let _ = reply.send(d);
}

impl Ticketed for OutOp {
    fn ticket(&self) -> u64 {
        match self {
            OutOp::Message { ticket, .. } | OutOp::Tensor { ticket, .. } => *ticket,
        }
    }

    fn complete(self, result: Result<(), Error>) {
        match self {
            OutOp::Message {
                ticket,
                frame,
                payloads,
                reply,
            } => send(
                &reply,
                Done::Wrote {
                    ticket,
                    frame,
                    payloads,
                    result,
                },
            ),
            OutOp::Tensor {
                seq,
                index,
                memory,
                reply,
                ..
            } => send(
                &reply,
                Done::WroteTensor {
                    seq,
                    index,
                    memory,
                    result,
                },
            ),
        }
    }
}

impl OutOp {
    /// Completes the write with an error, handing its buffers back.
    pub fn fail(self, e: Error) {
        self.complete(Err(e));
    }
}

impl InOp {
    /// Completes the read with an error, handing its buffers back.
    pub fn fail(self, e: Error) {
        match self {
            InOp::Frame { ticket, reply, .. } => send(
                &reply,
                Done::Frame {
                    ticket,
                    result: Err(e),
                    payloads: Vec::new(),
                },
            ),
            op => op.complete(Err(e)),
        }
    }
}

impl Ticketed for InOp {
    fn ticket(&self) -> u64 {
        match self {
            InOp::Frame { ticket, .. }
            | InOp::Payloads { ticket, .. }
            | InOp::Tensor { ticket, .. } => *ticket,
        }
    }

    /// Completes a buffer-carrying read (frames complete through [`InOp::fail`] or directly).
    fn complete(self, result: Result<(), Error>) {
        match self {
            InOp::Frame { ticket, reply, .. } => send(
                &reply,
                Done::Frame {
                    ticket,
                    result: result
                        .and_then(|_| Err(Error::invalid("frame read completed without a frame"))),
                    payloads: Vec::new(),
                },
            ),
            InOp::Payloads {
                ticket,
                buffers,
                reply,
            } => send(
                &reply,
                Done::Payloads {
                    ticket,
                    buffers,
                    result,
                },
            ),
            InOp::Tensor {
                seq,
                index,
                memory,
                reply,
                ..
            } => send(
                &reply,
                Done::Tensor {
                    seq,
                    index,
                    memory,
                    result,
                },
            ),
        }
    }
}

/// Puts operations that arrive out of order back into ticket order.
///
/// Gaps are short (a channel's operations arrive through another mailbox a moment after the
/// pipe's), so a ring of slots indexed from the next expected ticket serves, with no allocation
/// once it has grown to the usual spread.
#[derive(Debug)]
pub struct Sequencer<T> {
    next: u64,
    slots: VecDeque<Option<T>>,
}

impl<T> Default for Sequencer<T> {
    fn default() -> Self {
        Sequencer {
            next: 0,
            slots: VecDeque::new(),
        }
    }
}

impl<T> Sequencer<T> {
    /// Files `item` under `ticket`; a ticket already used or already passed is refused.
    pub fn push(&mut self, ticket: u64, item: T) -> Result<(), T> {
        let Some(pos) = ticket.checked_sub(self.next) else {
            return Err(item);
        };
        let pos = pos as usize;
        if self.slots.len() <= pos {
            self.slots.resize_with(pos + 1, || None);
        }
        if self.slots[pos].is_some() {
            return Err(item);
        }
        self.slots[pos] = Some(item);
        Ok(())
    }

    /// The item holding the next ticket, if it has arrived.
    pub fn pop(&mut self) -> Option<T> {
        match self.slots.front_mut() {
            Some(slot @ Some(_)) => {
                let item = slot.take();
                self.slots.pop_front();
                self.next += 1;
                item
            }
            _ => None,
        }
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    /// Moves the next expected ticket up to `next` (tickets below it were used elsewhere); only
    /// while nothing is held.
    pub fn skip_to(&mut self, next: u64) {
        if self.is_empty() {
            self.slots.clear();
            self.next = self.next.max(next);
        }
    }

    /// Everything held, in any order (used to fail them all).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.slots.drain(..).flatten()
    }
}

/// The stop signal both loops watch: `None` while running, `Some(farewell)` once stopped.
pub type Stop = watch::Receiver<Option<Farewell>>;

/// What the writer says when stopped at a frame boundary.
#[derive(Debug, Clone, Default)]
pub struct Farewell {
    /// An encoded frame to send (empty for none).
    pub frame: Vec<u8>,
    /// How long to wait for it to go out (a graceful close waits for the peer to drain what
    /// was written before it; an abort barely waits).
    pub patience: std::time::Duration,
}

/// A connection's write half, parked here while its write loop is idle, so that the owner can
/// write a message itself ([`Parking::try_write_batch`]) instead of queueing it and waking the loop:
/// a small message then goes out in the owner's own poll.
#[derive(Default)]
pub struct Parking(std::sync::Mutex<Parked>);

#[derive(Default)]
struct Parked {
    /// The write half, while the loop waits for work with nothing held.
    w: Option<BoxWrite>,
    /// The loop's next ticket, advanced by each message written here.
    next: u64,
    /// The last write made here, a [`Coarse`] reading (the loop's heartbeat counts it).
    last_write: Option<u64>,
    /// A message written here only in part (ticket, bytes written): the loop writes the rest.
    torn: Option<(u64, usize)>,
    /// The connection is stopping: write nothing more here.
    halted: bool,
    /// A chunk header being written here.
    header: Vec<u8>,
}

impl std::fmt::Debug for Parking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parking").finish_non_exhaustive()
    }
}

impl Parking {
    fn lock(&self) -> std::sync::MutexGuard<'_, Parked> {
        // Nothing panics while holding it; a poisoned lock still holds consistent state.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on, nothing is written here: everything goes through the loop, which stops.
    pub fn halt(&self) {
        self.lock().halted = true;
    }

    /// Writes ops of consecutive tickets (a message and its small tensors) at once, with one
    /// non-blocking vectored write, if the write loop is idle and the first op is the next in
    /// ticket order. It takes the longest run from the front that qualifies (an
    /// [`OutOp::Message`], an [`OutOp::Tensor`] of at most [`DIRECT_TENSOR_MAX`] bytes in one
    /// chunk) and fits one system call, and returns how many ops of it were written whole. The
    /// caller completes those and submits the rest to the loop as usual; if the write stopped
    /// inside an op, the loop writes the rest of that one first (and nothing goes in between).
    pub fn try_write_batch(&self, ops: &[OutOp]) -> usize {
        /// Up to this many chunk headers in one write.
        const HEADERS: usize = IOV_BATCH / 2;
        // Only the loop, on this same thread, ever holds the lock, and never across a poll.
        let Ok(mut p) = self.0.try_lock() else {
            return 0;
        };
        let p = &mut *p;
        if p.halted || p.torn.is_some() || p.w.is_none() {
            return 0;
        }
        // The run: each op next in ticket order, qualified, and with room for its slices.
        let mut slices = 0;
        let mut run = 0;
        let mut headers = [(0usize, 0usize); HEADERS];
        let mut nh = 0;
        p.header.clear();
        for (i, op) in ops.iter().enumerate() {
            if op.ticket() != p.next + i as u64 {
                break;
            }
            match op {
                OutOp::Message { payloads, .. } if slices + 1 + payloads.len() <= IOV_BATCH => {
                    slices += 1 + payloads.len();
                }
                OutOp::Tensor {
                    seq,
                    index,
                    memory,
                    offset: 0,
                    chunk_size,
                    ..
                } if slices + 2 <= IOV_BATCH
                    && nh < HEADERS
                    && (1..=DIRECT_TENSOR_MAX.min(*chunk_size))
                        .contains(&memory.as_slice().len()) =>
                {
                    // The same bytes as the loop's `write_op` would write: one chunk.
                    let at = p.header.len();
                    let len = memory.as_slice().len() as u64;
                    encode_chunk_header(&mut p.header, *seq, *index, 0, len);
                    headers[nh] = (at, p.header.len());
                    nh += 1;
                    slices += 2;
                }
                _ => break,
            }
            run += 1;
        }
        if run == 0 {
            return 0;
        }
        let mut iov = [IoSlice::new(&[]); IOV_BATCH];
        let mut lens = [0usize; IOV_BATCH];
        let mut n = 0;
        let mut h = 0;
        for (i, op) in ops[..run].iter().enumerate() {
            let first = n;
            match op {
                OutOp::Message {
                    frame, payloads, ..
                } => {
                    iov[n] = IoSlice::new(frame);
                    n += 1;
                    for pl in payloads {
                        iov[n] = IoSlice::new(&pl.data);
                        n += 1;
                    }
                }
                OutOp::Tensor { memory, .. } => {
                    let (a, b) = headers[h];
                    h += 1;
                    iov[n] = IoSlice::new(&p.header[a..b]);
                    iov[n + 1] = IoSlice::new(memory.as_slice());
                    n += 2;
                }
            }
            lens[i] = iov[first..n].iter().map(|b| b.len()).sum();
        }
        let w = p.w.as_mut().expect("checked above");
        // A waker that does nothing: if the stream is not ready, the loop takes the ops over
        // and polls with its own.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut k = match Pin::new(&mut **w).poll_write_vectored(&mut cx, &iov[..n]) {
            std::task::Poll::Ready(Ok(k)) if k > 0 => k,
            // Not ready, or an error the loop will meet again and report.
            _ => return 0,
        };
        p.last_write = Some(Coarse::now_ns());
        let mut whole = 0;
        for (i, &len) in lens[..run].iter().enumerate() {
            if k >= len {
                k -= len;
                whole += 1;
            } else {
                if k > 0 {
                    p.torn = Some((ops[i].ticket(), k));
                }
                break;
            }
        }
        p.next += whole as u64;
        whole
    }
}

/// The write loop's hold on its write half: in hand while working, parked while idle.
struct Pen<'a> {
    w: Option<BoxWrite>,
    parking: &'a Parking,
    /// Taken over from the parking: a message partly written by the owner.
    torn: Option<(u64, usize)>,
    /// The last write, a [`Coarse`] reading: a ping only needs to be about on time.
    last_write: u64,
}

impl Pen<'_> {
    /// Parks the write half while the loop waits with nothing held.
    fn park(&mut self, next: u64) {
        if self.torn.is_some() {
            return;
        }
        if let Some(w) = self.w.take() {
            let mut p = self.parking.lock();
            p.w = Some(w);
            p.next = next;
        }
    }

    /// Takes the write half back, with what was written meanwhile.
    fn unpark(&mut self, seq: &mut Sequencer<OutOp>) {
        if self.w.is_some() {
            return;
        }
        let mut p = self.parking.lock();
        self.w = p.w.take();
        seq.skip_to(p.next);
        self.torn = p.torn.take();
        if let Some(t) = p.last_write.take() {
            self.last_write = self.last_write.max(t);
        }
    }

    fn get(&mut self) -> &mut BoxWrite {
        self.w
            .as_mut()
            .expect("the write loop holds its write half")
    }
}

async fn stopped(stop: &mut Stop) {
    // An error means the sender is gone, which also means stop.
    let _ = stop.wait_for(|s| s.is_some()).await;
}

/// The stop signal as one future armed for the life of a loop: a fresh `watch` wait in every
/// `select!` would register and drop a waiter per operation. Once ready it stays ready.
struct Halt {
    wait: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    /// Whether `wait` has registered this task's waker (it stays registered until woken).
    armed: bool,
    /// A receiver that never marks the value seen: a cheap check of whether `wait` can be ready,
    /// where polling `wait` takes the notifier's lock each time.
    probe: Stop,
}

impl Halt {
    fn new(mut stop: Stop) -> Halt {
        Halt {
            probe: stop.clone(),
            wait: Some(Box::pin(async move { stopped(&mut stop).await })),
            armed: false,
        }
    }
}

impl std::future::Future for Halt {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        // A loop polls this from one task only, so the waker `wait` registered stays the right
        // one; nothing sent (and the sender still there) means nothing to see.
        if self.armed && matches!(self.probe.has_changed(), Ok(false)) {
            return std::task::Poll::Pending;
        }
        if let Some(wait) = &mut self.wait {
            if wait.as_mut().poll(cx).is_pending() {
                self.armed = true;
                return std::task::Poll::Pending;
            }
            self.wait = None;
        }
        std::task::Poll::Ready(())
    }
}

fn cancelled(origin: &Origin) -> Error {
    Error::Closed {
        reason: "connection stopped".into(),
        origin: origin.clone(),
    }
}

/// Waits for the next operation in ticket order. Returns `None` when the queue is closed and
/// nothing is left, or when stopped (then `*halted` is set).
async fn next_op<T: Ticketed>(
    seq: &mut Sequencer<T>,
    rx: &mut mpsc::UnboundedReceiver<T>,
    stop: &mut Halt,
    halted: &mut bool,
) -> Option<T> {
    loop {
        if let Some(op) = seq.pop() {
            return Some(op);
        }
        tokio::select! {
            biased;
            _ = &mut *stop => {
                *halted = true;
                return None;
            }
            op = rx.recv() => {
                let op = op?;
                if let Err(op) = seq.push(op.ticket(), op) {
                    // A duplicate ticket is a bug in the caller; fail the op, keep the loop.
                    op.complete(Err(Error::invalid("duplicate or stale connection ticket")));
                }
            }
        }
    }
}

/// After a failure or a stop: fail everything held and everything that still arrives.
async fn fail_all<T: Ticketed>(
    seq: &mut Sequencer<T>,
    rx: &mut mpsc::UnboundedReceiver<T>,
    e: Error,
    fail: impl Fn(T, Error),
) {
    for op in seq.drain() {
        fail(op, e.clone());
    }
    while let Some(op) = rx.recv().await {
        fail(op, e.clone());
    }
}

/// Writes every slice completely (after the first `skip` bytes), in one system call when the
/// stream allows.
async fn write_all_vectored<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
    skip: usize,
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, skip);
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Slices per vectored write; larger payload lists go out in several calls.
const IOV_BATCH: usize = 16;

/// Writes `op`, less its first `skip` bytes (written already; only ever within its first batch
/// of slices).
async fn write_op(
    w: &mut BoxWrite,
    op: &OutOp,
    scratch: &mut Vec<u8>,
    mut skip: usize,
) -> std::io::Result<()> {
    match op {
        OutOp::Message {
            frame, payloads, ..
        } => {
            let mut iov = [IoSlice::new(&[]); IOV_BATCH];
            iov[0] = IoSlice::new(frame);
            let mut n = 1;
            for p in payloads {
                if n == IOV_BATCH {
                    write_all_vectored(w, &mut iov[..n], mem::take(&mut skip)).await?;
                    n = 0;
                }
                iov[n] = IoSlice::new(&p.data);
                n += 1;
            }
            write_all_vectored(w, &mut iov[..n], skip).await
        }
        OutOp::Tensor {
            seq,
            index,
            memory,
            offset: base,
            chunk_size,
            ..
        } => {
            let buffer = memory.as_slice();
            for (offset, len) in
                crate::channel::basic::chunks(buffer.len() as u64, *chunk_size as u64)
            {
                scratch.clear();
                encode_chunk_header(scratch, *seq, *index, base + offset, len);
                let body = &buffer[offset as usize..(offset + len) as usize];
                // A first chunk the owner wrote in part ([`Parking::try_write_batch`]): the rest.
                let skip = mem::take(&mut skip);
                write_all_vectored(w, &mut [IoSlice::new(scratch), IoSlice::new(body)], skip)
                    .await?;
            }
            Ok(())
        }
    }
}

/// What an idle writer does: nothing, or a ping after each `interval` of silence.
enum Idle {
    /// The write loop waits for the next operation.
    Op(Option<OutOp>),
    /// The heartbeat is due; the failure if it could not be sent.
    Ping(Result<(), Error>),
}

/// Waits for the next write in ticket order, its write half parked meanwhile while nothing is
/// held. Returns `None` when the queue is closed and nothing is left, or when stopped (then
/// `*halted` is set). The write half is back in hand when it returns.
async fn next_out(
    seq: &mut Sequencer<OutOp>,
    rx: &mut mpsc::UnboundedReceiver<OutOp>,
    stop: &mut Halt,
    halted: &mut bool,
    pen: &mut Pen<'_>,
) -> Option<OutOp> {
    loop {
        if let Some(op) = seq.pop() {
            return Some(op);
        }
        if seq.is_empty() {
            pen.park(seq.next);
        }
        let got = tokio::select! {
            biased;
            _ = &mut *stop => None,
            op = rx.recv() => Some(op),
        };
        pen.unpark(seq);
        let Some(op) = got else {
            *halted = true;
            return None;
        };
        let op = op?;
        if let Err(op) = seq.push(op.ticket(), op) {
            // A duplicate ticket is a bug in the caller; fail the op, keep the loop.
            op.complete(Err(Error::invalid("duplicate or stale connection ticket")));
        }
    }
}

/// Waits for the next operation in ticket order, sending pings while none comes.
async fn next_write(
    seq: &mut Sequencer<OutOp>,
    rx: &mut mpsc::UnboundedReceiver<OutOp>,
    stop: &mut Halt,
    halted: &mut bool,
    beat: Option<(&Heartbeat, Pin<&mut Sleep>)>,
    pen: &mut Pen<'_>,
    origin: &Origin,
) -> Idle {
    let Some((hb, mut alarm)) = beat else {
        return Idle::Op(next_out(seq, rx, stop, halted, pen).await);
    };
    loop {
        tokio::select! {
            biased;
            op = next_out(seq, rx, stop, halted, pen) => return Idle::Op(op),
            () = alarm.as_mut() => {}
        }
        // Interrupted while parked: take the write half back (and what was written meanwhile).
        pen.unpark(seq);
        let clock = Coarse::get();
        if Instant::now() >= clock.instant(pen.last_write) + hb.interval && pen.torn.is_none() {
            let w = pen.w.as_mut().expect("the write loop holds its write half");
            let sent = tokio::select! {
                biased;
                _ = &mut *stop => Err(cancelled(origin)),
                r = w.write_all(&wire::PING_FRAME) => r.map_err(|e| io_error("writing", e, origin)),
            };
            if sent.is_err() {
                return Idle::Ping(sent);
            }
            pen.last_write = Coarse::now_ns();
        }
        alarm
            .as_mut()
            .reset((clock.instant(pen.last_write) + hb.interval).into());
    }
}

/// Runs a connection's write side until every sender is gone. With a `heartbeat`, an idle
/// writer sends a ping after each `interval` without writing. While it waits for work with
/// nothing held, its write half is parked in `parking`, where the owner may write a message
/// itself ([`Parking::try_write_batch`]).
pub async fn write_loop(
    w: BoxWrite,
    mut rx: mpsc::UnboundedReceiver<OutOp>,
    stop: Stop,
    origin: Origin,
    heartbeat: Option<Heartbeat>,
    parking: std::sync::Arc<Parking>,
) {
    let mut seq = Sequencer::default();
    let mut scratch = Vec::with_capacity(64);
    let mut halted = false;
    let mut halt = Halt::new(stop.clone());
    let mut alarm = std::pin::pin!(tokio::time::sleep(
        heartbeat.map_or(Duration::ZERO, |h| h.interval)
    ));
    let mut pen = Pen {
        w: Some(w),
        parking: &parking,
        torn: None,
        last_write: Coarse::now_ns(),
    };
    let failure = loop {
        let beat = heartbeat.as_ref().map(|h| (h, alarm.as_mut()));
        let next = next_write(
            &mut seq,
            &mut rx,
            &mut halt,
            &mut halted,
            beat,
            &mut pen,
            &origin,
        );
        let op = match next.await {
            Idle::Op(op) => op,
            Idle::Ping(r) => break r.err().unwrap_or_else(|| cancelled(&origin)),
        };
        let Some(op) = op else {
            if !halted {
                // Every sender is gone: nothing more to write.
                let _ = pen.get().shutdown().await;
                parking.halt();
                return;
            }
            // Stopped at a frame boundary (unless the owner wrote part of a message the loop
            // has not finished): say goodbye if there is something to say.
            let farewell = stop.borrow().clone().unwrap_or_default();
            if !farewell.frame.is_empty() && pen.torn.is_none() {
                let w = pen.get();
                let bye = async {
                    w.write_all(&farewell.frame).await?;
                    w.shutdown().await
                };
                let _ = tokio::time::timeout(farewell.patience, bye).await;
            }
            break cancelled(&origin);
        };
        // The rest of a message the owner wrote in part.
        let skip = match pen.torn {
            Some((ticket, k)) if ticket == op.ticket() => {
                pen.torn = None;
                k
            }
            _ => 0,
        };
        let result = tokio::select! {
            biased;
            _ = &mut halt => {
                op.complete(Err(cancelled(&origin)));
                break cancelled(&origin);
            }
            r = write_op(pen.w.as_mut().expect("in hand"), &op, &mut scratch, skip) => r,
        };
        pen.last_write = Coarse::now_ns();
        match result {
            Ok(()) => op.complete(Ok(())),
            Err(e) => {
                let e = io_error("writing", e, &origin);
                op.complete(Err(e.clone()));
                break e;
            }
        }
    };
    parking.halt();
    drop(pen);
    fail_all(&mut seq, &mut rx, failure, |op, e| op.complete(Err(e))).await;
}

/// Maps an I/O error: a reset or broken pipe means the peer went away.
pub fn io_error(op: &'static str, e: std::io::Error, origin: &Origin) -> Error {
    use std::io::ErrorKind::*;
    match e.kind() {
        // A dead link (keepalive or retransmission limits) is the peer lost, too.
        UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted | TimedOut
        | HostUnreachable | NetworkUnreachable => Error::PeerClosed {
            reason: format!("connection lost while {op} ({e})"),
            graceful: false,
            origin: origin.clone(),
        },
        _ => Error::io(op, e, origin),
    }
}

/// Reads one frame's bytes (after the prefix) into `buf`. End of stream before the first byte
/// is a clean close by the peer.
pub async fn read_frame_bytes<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<(), Error> {
    let mut prefix = [0u8; LEN_PREFIX];
    let mut got = 0;
    while got < LEN_PREFIX {
        let n = r
            .read(&mut prefix[got..])
            .await
            .map_err(|e| io_error("reading a frame", e, origin))?;
        if n == 0 {
            let reason = if got == 0 {
                "the peer closed the connection".to_string()
            } else {
                "connection lost in the middle of a frame".to_string()
            };
            return Err(Error::PeerClosed {
                reason,
                graceful: false,
                origin: origin.clone(),
            });
        }
        got += n;
    }
    let len =
        wire::check_frame_len(u32::from_le_bytes(prefix), limits).map_err(|e| e.at(origin))?;
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf)
        .await
        .map_err(|e| io_error("reading a frame", e, origin))?;
    Ok(())
}

/// Reads and decodes one frame, skipping heartbeats.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<Frame, Error> {
    let frame = loop {
        read_frame_bytes(r, buf, limits, origin).await?;
        match wire::decode_frame(buf, limits) {
            Ok(Frame::Ping) => continue,
            f => break f.map_err(|e| e.at(origin)),
        }
    };
    if buf.capacity() > 4 * FRAME_BUFFER {
        // One large frame should not pin its buffer for the life of the pipe.
        buf.clear();
        buf.shrink_to(FRAME_BUFFER);
    }
    frame
}

/// A close frame in place of data ends the pipe as a peer close; anything else is a violation.
pub fn unexpected(frame: Frame, wanted: &str, origin: &Origin) -> Error {
    match frame {
        Frame::Close(f) => Error::PeerClosed {
            reason: format!("it said {:?}", f.reason),
            graceful: f.graceful,
            origin: origin.clone(),
        },
        Frame::Reject(reason) => Error::Unavailable {
            backend: origin.backend.clone(),
            reason: format!("the peer refused the pipe: {reason}"),
        },
        f => Error::protocol(
            format!("expected {wanted}, got a {:?} frame", f.kind()),
            origin,
        ),
    }
}

#[allow(clippy::too_many_arguments)]
async fn read_tensor(
    r: &mut BufReader<BoxRead>,
    seq: u64,
    index: u32,
    buffer: &mut [u8],
    base: u64,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<(), Error> {
    let total = buffer.len() as u64;
    let mut done = 0u64;
    while done < total {
        let h = match read_frame(r, buf, limits, origin).await? {
            Frame::Chunk(h) => h,
            f => return Err(unexpected(f, "a tensor chunk", origin)),
        };
        if h.seq != seq
            || h.tensor != index
            || h.offset != base + done
            || h.length == 0
            || h.length > total - done
        {
            return Err(Error::protocol(
                format!(
                    "chunk for message {} tensor {} at offset {} of {} bytes does not fit: expected message {seq} tensor {index} at offset {}, {} bytes left",
                    h.seq, h.tensor, h.offset, h.length, base + done, total - done
                ),
                origin,
            ));
        }
        let piece = &mut buffer[done as usize..(done + h.length) as usize];
        r.read_exact(piece)
            .await
            .map_err(|e| io_error("reading a tensor", e, origin))?;
        done += h.length;
    }
    Ok(())
}

async fn read_op(
    r: &mut BufReader<BoxRead>,
    op: &mut InOp,
    buf: &mut Vec<u8>,
    limits: &Limits,
    origin: &Origin,
) -> Result<Option<(Frame, Vec<u8>)>, Error> {
    match op {
        InOp::Frame { carried, .. } => {
            let frame = read_frame(r, buf, limits, origin).await?;
            let mut payloads = Vec::new();
            if let Frame::Descriptor(wd) = &frame {
                if let Some(inline) = inline_len(wd, *carried) {
                    payloads.resize(inline.total.unwrap_or(inline.payloads), 0);
                    let (mine, mut rest) = payloads.split_at_mut(inline.payloads);
                    r.read_exact(mine)
                        .await
                        .map_err(|e| io_error("reading a payload", e, origin))?;
                    if inline.whole() {
                        let tensors = wd.descriptor.tensors.iter().zip(&wd.routes);
                        for (i, (t, (_, data))) in tensors.enumerate() {
                            if !carried.carries(data) {
                                continue;
                            }
                            let (tensor, after) = rest.split_at_mut(t.length as usize);
                            read_tensor(r, wd.seq, i as u32, tensor, 0, buf, limits, origin)
                                .await?;
                            rest = after;
                        }
                    }
                }
            }
            Ok(Some((frame, payloads)))
        }
        InOp::Payloads { buffers, .. } => {
            for b in buffers.iter_mut() {
                r.read_exact(b)
                    .await
                    .map_err(|e| io_error("reading a payload", e, origin))?;
            }
            Ok(None)
        }
        InOp::Tensor {
            seq,
            index,
            memory,
            offset,
            ..
        } => {
            let buffer = memory.as_mut_slice();
            read_tensor(r, *seq, *index, buffer, *offset, buf, limits, origin).await?;
            Ok(None)
        }
    }
}

/// Runs a connection's read side until every sender is gone. With a `heartbeat`, a read that
/// waits `timeout` without receiving a byte fails with [`Error::Timeout`].
pub async fn read_loop(
    mut r: BufReader<BoxRead>,
    mut rx: mpsc::UnboundedReceiver<InOp>,
    stop: Stop,
    limits: Limits,
    origin: Origin,
    heartbeat: Option<Heartbeat>,
) {
    let mut seq = Sequencer::default();
    let mut buf = Vec::with_capacity(256);
    let mut halted = false;
    let mut halt = Halt::new(stop);
    let pulse = Pulse::new();
    if heartbeat.is_some() {
        // Count every byte the stream delivers from now on as a sign of life (bytes already
        // buffered by the handshake are not, but they were received just now anyway).
        let inner = std::mem::replace(r.get_mut(), Box::new(tokio::io::empty()));
        *r.get_mut() = Box::new(Stamped::new(inner, pulse.clone()));
    }
    let timeout = heartbeat.map_or(Duration::MAX, |h| h.timeout);
    let mut alarm = std::pin::pin!(tokio::time::sleep(
        timeout.min(Duration::from_secs(1 << 30))
    ));
    let failure = loop {
        let Some(mut op) = next_op(&mut seq, &mut rx, &mut halt, &mut halted).await else {
            if !halted {
                return;
            }
            break cancelled(&origin);
        };
        // Silence counts from the start of a wait, not from the last message.
        pulse.beat();
        let result = tokio::select! {
            biased;
            _ = &mut halt => {
                op.fail(cancelled(&origin));
                break cancelled(&origin);
            }
            r = read_op(&mut r, &mut op, &mut buf, &limits, &origin) => r,
            () = silence(alarm.as_mut(), &pulse, timeout), if heartbeat.is_some() => {
                Err(Error::Timeout {
                    what: "waiting for the peer (no heartbeat or data)",
                    after: timeout,
                    origin: origin.clone(),
                })
            }
        };
        match (result, op) {
            (
                Ok(Some((frame, payloads))),
                InOp::Frame {
                    ticket,
                    reply,
                    more,
                    carried,
                },
            ) => {
                let go_on = more > 0
                    && matches!(&frame, Frame::Descriptor(wd) if self_contained(wd, carried));
                let next = go_on.then(|| InOp::Frame {
                    ticket: ticket + 1,
                    reply: reply.clone(),
                    more: more - 1,
                    carried,
                });
                send(
                    &reply,
                    Done::Frame {
                        ticket,
                        result: Ok(frame),
                        payloads,
                    },
                );
                if let Some(Err(op)) = next.map(|op| seq.push(ticket + 1, op)) {
                    // The owner sent that ticket itself: a bug on its side.
                    op.fail(Error::invalid("duplicate or stale connection ticket"));
                }
            }
            (Ok(_), op) => op.complete(Ok(())),
            (Err(e), op) => {
                op.fail(e.clone());
                break e;
            }
        }
    };
    drop(r);
    fail_all(&mut seq, &mut rx, failure, |op, e| op.fail(e)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn wire(payloads: &[u64], tensors: &[(u64, &[u8])]) -> WireDescriptor {
        let mut m = crate::message::Message::new();
        for &n in payloads {
            m = m.with_payload(Payload::new(vec![0; n as usize]));
        }
        for &(n, _) in tensors {
            m = m.with_tensor(crate::message::Tensor::cpu(vec![0; n as usize]));
        }
        WireDescriptor {
            seq: 0,
            descriptor: m.descriptor(),
            routes: tensors.iter().map(|&(_, d)| (0, d.to_vec())).collect(),
        }
    }

    #[test]
    fn what_is_read_with_the_frame() {
        let k16 = INLINE_PAYLOADS;
        let inline = |payloads, total| Some(Inline { payloads, total });
        // Payloads alone, at and over the limit.
        let wd = wire(&[k16], &[]);
        assert_eq!(inline_len(&wd, Carried::All), inline(16384, Some(16384)));
        assert!(self_contained(&wd, Carried::All));
        assert_eq!(inline_len(&wire(&[k16 + 1], &[]), Carried::All), None);
        // Carried tensors join them while everything fits in 16 KiB.
        let wd = wire(&[100], &[(5000, b""), (0, b""), (3000, b"")]);
        assert_eq!(inline_len(&wd, Carried::All), inline(100, Some(8100)));
        assert!(self_contained(&wd, Carried::All));
        let wd = wire(&[1], &[(k16 - 1, b""), (1, b"")]);
        assert_eq!(inline_len(&wd, Carried::All), inline(1, None));
        assert!(!self_contained(&wd, Carried::All));
        // cma: only tensors without channel data are on the stream; xth and mpt: none.
        let wd = wire(&[10], &[(1 << 20, b"remote"), (64, b"")]);
        assert_eq!(inline_len(&wd, Carried::NoData), inline(10, Some(74)));
        assert_eq!(inline_len(&wd, Carried::Nothing), inline(10, Some(10)));
        assert_eq!(inline_len(&wd, Carried::All), inline(10, None));
    }

    /// A write loop over an in-memory stream that takes `room` bytes at a time, started on the
    /// current `LocalSet` and idle: its queue, its stop signal, its parking, the loop's task
    /// and the stream's other end.
    struct Writer {
        tx: mpsc::UnboundedSender<OutOp>,
        stop: watch::Sender<Option<Farewell>>,
        parking: Arc<Parking>,
        task: tokio::task::JoinHandle<()>,
        r: tokio::io::DuplexStream,
    }

    async fn writer(room: usize) -> Writer {
        let (w, r) = tokio::io::duplex(room);
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop, stopped) = watch::channel(None);
        let parking = Arc::new(Parking::default());
        let task = tokio::task::spawn_local(write_loop(
            Box::new(w),
            rx,
            stopped,
            Origin::new("test", "test"),
            None,
            parking.clone(),
        ));
        tokio::task::yield_now().await;
        Writer {
            tx,
            stop,
            parking,
            task,
            r,
        }
    }

    /// One op through [`Parking::try_write_batch`]: `Ok` if written whole.
    fn try_write(parking: &Parking, op: OutOp) -> Result<OutOp, OutOp> {
        match parking.try_write_batch(std::slice::from_ref(&op)) {
            1 => Ok(op),
            _ => Err(op),
        }
    }

    fn message(ticket: u64, bytes: &[u8], reply: &Reply) -> OutOp {
        OutOp::Message {
            ticket,
            frame: bytes[..2].to_vec(),
            payloads: vec![Payload::new(bytes[2..].to_vec())],
            reply: reply.clone(),
        }
    }

    fn tensor(ticket: u64, index: u32, len: usize, reply: &Reply) -> OutOp {
        OutOp::Tensor {
            ticket,
            seq: 7,
            index,
            memory: Memory::Owned(vec![index as u8 + 1; len]),
            offset: 0,
            chunk_size: 1 << 20,
            reply: reply.clone(),
        }
    }

    /// A message and its small tensors go out in one write while the loop is idle. One that
    /// tears inside a tensor: the whole ops written stay with the owner, the loop writes the
    /// rest of the torn one first, then the others; the stream carries exactly what the loop
    /// alone would have written.
    #[tokio::test]
    async fn owner_writes_a_message_and_its_tensors_in_one_go() {
        tokio::task::LocalSet::new()
            .run_until(owner_writes_batches())
            .await;
    }

    async fn owner_writes_batches() {
        // What the loop writes for these ops: the frame and payloads, then each tensor as one
        // chunk frame (header, body).
        fn reference(ops: Vec<OutOp>) -> Vec<u8> {
            let mut out = Vec::new();
            for op in ops {
                match op {
                    OutOp::Message {
                        frame, payloads, ..
                    } => {
                        out.extend_from_slice(&frame);
                        for p in payloads {
                            out.extend_from_slice(&p.data);
                        }
                    }
                    OutOp::Tensor {
                        seq, index, memory, ..
                    } => {
                        let body = memory.as_slice();
                        let h = ChunkHeader {
                            seq,
                            tensor: index,
                            offset: 0,
                            length: body.len() as u64,
                        };
                        wire::encode_frame(&mut out, FrameKind::Chunk, |b| {
                            wire::encode_chunk(b, &h)
                        });
                        out.extend_from_slice(body);
                    }
                }
            }
            out
        }
        let (reply, mut done) = mpsc::unbounded_channel();
        let ops = || {
            vec![
                message(0, b"hd-payload", &reply),
                tensor(1, 0, 100, &reply),
                tensor(2, 1, 50, &reply),
            ]
        };
        let want = reference(ops());
        // The stream takes 40 bytes at once: the message and part of the first tensor.
        let mut w = writer(40).await;
        let batch = ops();
        let whole = w.parking.try_write_batch(&batch);
        assert_eq!(whole, 1, "the message went whole, the first tensor in part");
        for op in batch.into_iter().skip(whole) {
            w.tx.send(op).unwrap();
        }
        let mut got = vec![0u8; want.len()];
        w.r.read_exact(&mut got).await.unwrap();
        assert_eq!(got, want);
        for ticket in [1, 2] {
            let d = done.recv().await.unwrap();
            assert!(
                matches!(d, Done::WroteTensor { result: Ok(()), .. }),
                "ticket {ticket}: {d:?}"
            );
        }
        // With room: all three in one write, nothing for the loop.
        let mut w = writer(4096).await;
        assert_eq!(w.parking.try_write_batch(&ops()), 3);
        let mut got = vec![0u8; want.len()];
        w.r.read_exact(&mut got).await.unwrap();
        assert_eq!(got, want);
    }

    /// The owner writes while the loop is idle: whole, in part (the loop finishes it, and no
    /// farewell cuts into it), or not at all (the loop is busy, or the ticket is not next).
    #[tokio::test]
    async fn owner_writes_while_the_loop_is_idle() {
        // The loops run on one thread, as on an arbiter (an `OutOp` is not `Sync`).
        tokio::task::LocalSet::new()
            .run_until(owner_writes_while_idle())
            .await;
    }

    async fn owner_writes_while_idle() {
        let Writer {
            tx,
            stop: stop_tx,
            parking,
            task: lp,
            mut r,
        } = writer(8).await;
        let (reply, mut done) = mpsc::unbounded_channel();
        // Not next in ticket order: refused.
        assert!(try_write(&parking, message(1, b"zzzz", &reply)).is_err());
        // Ticket 0 fits the stream's 8 bytes: written here.
        assert!(try_write(&parking, message(0, b"abcdef", &reply)).is_ok());
        // Ticket 1 does not fit: 2 bytes go now, the loop writes the rest.
        let op =
            try_write(&parking, message(1, b"0123456789", &reply)).expect_err("only part fits");
        // While torn, nothing more is written here.
        assert!(try_write(&parking, message(2, b"xy", &reply)).is_err());
        tx.send(op).unwrap();
        let mut got = vec![0u8; 16];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"abcdef0123456789");
        assert!(matches!(
            done.recv().await,
            Some(Done::Wrote {
                ticket: 1,
                result: Ok(()),
                ..
            })
        ));
        // Idle again: ticket 2 goes out here, ticket 3 through the loop.
        tokio::task::yield_now().await;
        assert!(try_write(&parking, message(2, b"ghij", &reply)).is_ok());
        tx.send(message(3, b"klmn", &reply)).unwrap();
        let mut got = vec![0u8; 8];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ghijklmn");
        assert!(matches!(
            done.recv().await,
            Some(Done::Wrote {
                ticket: 3,
                result: Ok(()),
                ..
            })
        ));
        // Stopped: nothing more is written here, and the farewell goes out.
        tokio::task::yield_now().await;
        parking.halt();
        assert!(try_write(&parking, message(4, b"nope", &reply)).is_err());
        stop_tx
            .send(Some(Farewell {
                frame: b"bye".to_vec(),
                patience: Duration::from_secs(1),
            }))
            .unwrap();
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"bye");
        drop(tx);
        lp.await.unwrap();
    }

    #[test]
    fn sequencer_restores_ticket_order() {
        let mut s = Sequencer::default();
        s.push(2, "c").unwrap();
        s.push(1, "b").unwrap();
        assert_eq!(s.pop(), None);
        s.push(0, "a").unwrap();
        assert_eq!(s.pop(), Some("a"));
        assert_eq!(s.pop(), Some("b"));
        assert_eq!(s.pop(), Some("c"));
        assert_eq!(s.pop(), None);
        assert_eq!(s.push(1, "stale"), Err("stale"));
        s.push(3, "d").unwrap();
        assert_eq!(s.push(3, "dup"), Err("dup"));
        s.push(5, "f").unwrap();
        let mut left: Vec<_> = s.drain().collect();
        left.sort();
        assert_eq!(left, vec!["d", "f"]);
    }
}
