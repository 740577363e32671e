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

use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Sleep;

use super::liveness::{Alarm, Coarse, Heartbeat, Pulse, Stamped};
use super::{BoxRead, BoxWrite};
use crate::error::{Error, Origin};
use crate::message::{Descriptor, Payload};
use crate::wire::{self, ChunkHeader, Frame, FrameKind, Limits, WireDescriptor, LEN_PREFIX};

/// Takes a self-contained message straight from the read loop, so that the application's
/// `Receive` completes without a trip through the pipe's task (docs/architecture.md, read path).
pub trait Catch: Send + Sync {
    /// Offered every [`self_contained`] descriptor with the bytes read with it. Takes the message
    /// (its descriptor's parts and the bytes, as it needs) and says how; or leaves both as they
    /// were and returns [`Caught::No`], and the frame goes to the owner as usual.
    fn catch(&self, wd: &mut WireDescriptor, bytes: &mut Vec<u8>) -> Caught;
}

/// What a [`Catch`] did with a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caught {
    /// Left it: the frame goes to the owner.
    No,
    /// Took it; the owner is told ([`Done::Frame`] with `caught: true`).
    Told,
    /// Took it, and the owner catches up by itself: nothing is sent, and the loop reads the
    /// next frame at the next ticket by itself, without counting it against `more`.
    Silently,
    /// As `Silently`, and the message went to a function called in place (a standing
    /// receive's handler), which has run: no task was made ready by it, so a spinning loop
    /// has nobody to give way to.
    Called,
}

impl std::fmt::Debug for dyn Catch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Catch")
    }
}

/// A shared [`Catch`], as [`InOp::Frame`] carries it.
pub type Catcher = std::sync::Arc<dyn Catch>;

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

    /// Takes `ticket`'s turn for an item held outside, as `push` then `pop` of it would, when
    /// `ticket` is the next one and nothing is filed under it; says whether it did.
    pub fn take_turn(&mut self, ticket: u64) -> bool {
        if ticket != self.next || matches!(self.slots.front(), Some(Some(_))) {
            return false;
        }
        self.slots.pop_front();
        self.next += 1;
        true
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

    #[inline]
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

/// Slices per vectored write; larger payload lists go out in several calls.
pub(crate) const IOV_BATCH: usize = 16;

mod ops;
mod parking;
mod read;
#[cfg(test)]
mod tests;
mod write;

use ops::{send, Ticketed};
pub use ops::{Done, InOp, Memory, OutOp, Region};
pub use parking::Parking;
#[cfg(test)]
use read::{buffered_inline, read_op};
pub use read::{read_frame, read_frame_bytes, read_loop};
pub use write::write_loop;
