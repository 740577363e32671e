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
use std::pin::Pin;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch};
use tokio::time::Sleep;

use super::liveness::{silence, Heartbeat, Pulse, Stamped};
use super::{BoxRead, BoxWrite};
use crate::error::{Error, Origin};
use crate::message::{Descriptor, Payload};
use crate::wire::{self, ChunkHeader, Frame, FrameKind, Limits, LEN_PREFIX};

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

/// Whether a message takes nothing from its stream after its descriptor frame but its inline
/// payloads: no tensors, small payloads. The next thing on the stream is then the next frame.
pub fn self_contained(d: &Descriptor) -> bool {
    d.tensors.is_empty() && inline_payloads(d).is_some()
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
        /// the other. Empty otherwise.
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

/// Writes every slice completely, in one system call when the stream allows.
async fn write_all_vectored<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
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

async fn write_op(w: &mut BoxWrite, op: &OutOp, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    match op {
        OutOp::Message {
            frame, payloads, ..
        } => {
            let mut iov = [IoSlice::new(&[]); IOV_BATCH];
            iov[0] = IoSlice::new(frame);
            let mut n = 1;
            for p in payloads {
                if n == IOV_BATCH {
                    write_all_vectored(w, &mut iov[..n]).await?;
                    n = 0;
                }
                iov[n] = IoSlice::new(&p.data);
                n += 1;
            }
            write_all_vectored(w, &mut iov[..n]).await
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
                let h = ChunkHeader {
                    seq: *seq,
                    tensor: *index,
                    offset: base + offset,
                    length: len,
                };
                wire::encode_frame(scratch, FrameKind::Chunk, |b| wire::encode_chunk(b, &h));
                let body = &buffer[offset as usize..(offset + len) as usize];
                write_all_vectored(w, &mut [IoSlice::new(scratch), IoSlice::new(body)]).await?;
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

/// Waits for the next operation in ticket order, sending pings while none comes.
async fn next_write(
    seq: &mut Sequencer<OutOp>,
    rx: &mut mpsc::UnboundedReceiver<OutOp>,
    stop: &mut Halt,
    halted: &mut bool,
    beat: Option<(&Heartbeat, Pin<&mut Sleep>, &mut Instant)>,
    w: &mut BoxWrite,
    origin: &Origin,
) -> Idle {
    let Some((hb, mut alarm, last_write)) = beat else {
        return Idle::Op(next_op(seq, rx, stop, halted).await);
    };
    loop {
        tokio::select! {
            biased;
            op = next_op(seq, rx, stop, halted) => return Idle::Op(op),
            () = alarm.as_mut() => {}
        }
        if Instant::now() >= *last_write + hb.interval {
            let sent = tokio::select! {
                biased;
                _ = &mut *stop => Err(cancelled(origin)),
                r = w.write_all(&wire::PING_FRAME) => r.map_err(|e| io_error("writing", e, origin)),
            };
            if sent.is_err() {
                return Idle::Ping(sent);
            }
            *last_write = Instant::now();
        }
        alarm.as_mut().reset((*last_write + hb.interval).into());
    }
}

/// Runs a connection's write side until every sender is gone. With a `heartbeat`, an idle
/// writer sends a ping after each `interval` without writing.
pub async fn write_loop(
    mut w: BoxWrite,
    mut rx: mpsc::UnboundedReceiver<OutOp>,
    stop: Stop,
    origin: Origin,
    heartbeat: Option<Heartbeat>,
) {
    let mut seq = Sequencer::default();
    let mut scratch = Vec::with_capacity(64);
    let mut halted = false;
    let mut halt = Halt::new(stop.clone());
    let mut alarm = std::pin::pin!(tokio::time::sleep(
        heartbeat.map_or(Duration::ZERO, |h| h.interval)
    ));
    let mut last_write = Instant::now();
    let failure = loop {
        let beat = heartbeat
            .as_ref()
            .map(|h| (h, alarm.as_mut(), &mut last_write));
        let next = next_write(
            &mut seq,
            &mut rx,
            &mut halt,
            &mut halted,
            beat,
            &mut w,
            &origin,
        );
        let op = match next.await {
            Idle::Op(op) => op,
            Idle::Ping(r) => break r.err().unwrap_or_else(|| cancelled(&origin)),
        };
        let Some(op) = op else {
            if !halted {
                // Every sender is gone: nothing more to write.
                let _ = w.shutdown().await;
                return;
            }
            // Stopped at a frame boundary: say goodbye if there is something to say.
            let farewell = stop.borrow().clone().unwrap_or_default();
            if !farewell.frame.is_empty() {
                let bye = async {
                    w.write_all(&farewell.frame).await?;
                    w.shutdown().await
                };
                let _ = tokio::time::timeout(farewell.patience, bye).await;
            }
            break cancelled(&origin);
        };
        let result = tokio::select! {
            biased;
            _ = &mut halt => {
                op.complete(Err(cancelled(&origin)));
                break cancelled(&origin);
            }
            r = write_op(&mut w, &op, &mut scratch) => r,
        };
        last_write = Instant::now();
        match result {
            Ok(()) => op.complete(Ok(())),
            Err(e) => {
                let e = io_error("writing", e, &origin);
                op.complete(Err(e.clone()));
                break e;
            }
        }
    };
    drop(w);
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
        InOp::Frame { .. } => {
            let frame = read_frame(r, buf, limits, origin).await?;
            let mut payloads = Vec::new();
            if let Frame::Descriptor(wd) = &frame {
                if let Some(n @ 1..) = inline_payloads(&wd.descriptor) {
                    payloads.resize(n, 0);
                    r.read_exact(&mut payloads)
                        .await
                        .map_err(|e| io_error("reading a payload", e, origin))?;
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
                },
            ) => {
                let go_on = more > 0
                    && matches!(&frame, Frame::Descriptor(wd) if self_contained(&wd.descriptor));
                let next = go_on.then(|| InOp::Frame {
                    ticket: ticket + 1,
                    reply: reply.clone(),
                    more: more - 1,
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
