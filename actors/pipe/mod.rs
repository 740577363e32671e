//! The `Pipe` actor: the ordering state machine of one pipe.
//!
//! Writes: each `Write` becomes a descriptor frame plus payload bytes (one vectored write on the
//! connection) and one operation per tensor on its channel. The pipe reserves connection tickets
//! for all of them at once, so the bytes of message n always precede those of message n + 1
//! whichever mailbox each part went through. The ids, sequence numbers and tickets live in a
//! write ledger shared with the pipe's [`PipeWriter`]s, which write a small message themselves
//! when nothing of the pipe's is pending ([`writer`]).
//!
//! Reads: the pipe keeps reading descriptors ahead of the user (the *prefetch*), so a
//! `ReadDescriptor` is answered as soon as the frame is in, and a peer that closes or goes away
//! is noticed even when nothing is pending. Prefetching goes on while the control stream holds
//! only frames (messages whose payloads and tensors travel elsewhere), up to
//! [`MAX_PREFETCH`] descriptors; it pauses at a descriptor whose bytes follow in-band, until the
//! user's `Read` for it has handed its buffers to the connection.
//!
//! Completions are delivered strictly in issue order per kind (writes; descriptor reads and
//! reads). On any failure the pipe records the first error, stops its connection (which hands
//! every buffer back), completes every pending operation with that error, in order, and then sends
//! `Closed` to its subscribers.

use std::collections::VecDeque;
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::dev::{MessageResponse, OneshotSender};
use actix::prelude::*;
use tokio::sync::mpsc;

use super::channel::{
    Channel, ChannelAddr, ChannelKind, Queue, RecvTensor, SendTensor, StopChannel,
};
use super::connection::{Connection, Link, Queue as ConnQueue, Queues, Shutdown};
use super::context::Config;
use super::messages::*;
use crate::actors::placement::Wanted;
use crate::backend::cma::RemoteBuffer;
use crate::error::{Error, Origin};
use crate::handshake::Halves;
use crate::message::{Allocation, Buffer, Descriptor, Message, Payload, Tensor};
use crate::metrics::{OpKind, PipeMetrics};
use crate::negotiate::{Choice, DevicePair};
use crate::transport::stream::{
    inline_len, unexpected, Done, Farewell, InOp, Inline, Memory, OutOp, Parking, Reply,
};
use crate::wire::{self, encode_frame, Frame, FrameKind, Limits, WireDescriptor};

static NEXT_PIPE_ID: AtomicU64 = AtomicU64::new(1);

/// How often a pipe checks whether anyone still holds its address.
const ORPHAN_CHECK: Duration = Duration::from_secs(2);

struct PendingWrite {
    id: u64,
    /// Sequence number on the wire; only writes that reach the wire get one.
    seq: u64,
    ticket: u64,
    since: Option<Instant>,
    message: Message,
    payloads_out: bool,
    tensors_out: usize,
    error: Option<Box<Error>>,
    /// Tensors whose buffers came back as stand-ins ([`WriteDone::stand_ins`]).
    stand_ins: Vec<usize>,
    completer: Completer<WriteDone>,
}

enum ReadState {
    /// Not started: waiting for its descriptor.
    Waiting(Allocation),
    /// A [`Receive`] not started: waiting for the next descriptor, to fit these spare buffers
    /// (or new ones) to it.
    Receiving(Option<Allocation>),
    /// Buffers handed to the connection and channels.
    Running {
        seq: u64,
        payload_ticket: Option<u64>,
        payloads_out: bool,
        tensors_out: usize,
        error: Option<Box<Error>>,
        /// Tensors whose buffers came back as stand-ins ([`ReadDone::stand_ins`]).
        stand_ins: Vec<usize>,
        /// The events of the CUDA tensors' copies, one per device (and stream).
        #[cfg(feature = "cuda")]
        cuda: crate::cuda::CudaCompletion,
    },
    /// Done (or refused before starting).
    Finished(Result<(), Box<Error>>),
}

enum PendingRead {
    Descriptor {
        id: u64,
        since: Option<Instant>,
        completer: Completer<DescriptorReady>,
        result: Option<Result<Descriptor, Error>>,
    },
    Read {
        id: u64,
        since: Option<Instant>,
        completer: Completer<ReadDone>,
        message: Message,
        state: ReadState,
        /// CUDA tensors complete once landed ([`Read::data_complete`]).
        data_complete: bool,
    },
    /// A `Receive` parked for the read loop ([`catch`]); once the loop has completed it, when
    /// it was issued and the bytes it read (for the metrics).
    Caught {
        id: u64,
        delivered: Option<(Option<Instant>, u64)>,
    },
}

impl PendingRead {
    fn finished(&self) -> bool {
        match self {
            PendingRead::Descriptor { result, .. } => result.is_some(),
            PendingRead::Caught { delivered, .. } => delivered.is_some(),
            PendingRead::Read { state, .. } => match state {
                ReadState::Waiting(_) | ReadState::Receiving(_) => false,
                ReadState::Running {
                    payloads_out,
                    tensors_out,
                    ..
                } => !payloads_out && *tensors_out == 0,
                ReadState::Finished(_) => true,
            },
        }
    }
}

/// Most descriptors read ahead of the user.
pub const MAX_PREFETCH: usize = 16;

/// Descriptors read ahead of the user.
#[derive(Default)]
struct Prefetch {
    ready: VecDeque<Incoming>,
    in_flight: bool,
    /// Frames the read loop may still read by itself after the one in flight (see
    /// `InOp::Frame::more`).
    more: u32,
    /// The last ready descriptor has bytes in-band: nothing more can be read before its `Read`.
    blocked: bool,
}

/// One pipe: ordered messages to and from one peer.
pub struct Pipe {
    id: u64,
    origin: Origin,
    /// Remote-memory operations' numbering (`actors/remote.rs`).
    pub(super) remote_ops: super::remote::PipeRemote,
    info: PipeInfo,
    limits: Limits,
    /// Index of the channel for CPU->CPU tensors, and its kind.
    cpu_channel: usize,
    cpu_kind: ChannelKind,
    /// Which channel each device pair's tensors go through.
    routes: Routes,
    /// Each tensor's channel, for the message being written (reused).
    route_buf: Vec<u8>,
    /// Completions of CUDA-routed tensors, until `started` polls them.
    #[cfg(feature = "cuda")]
    cuda_completions: Option<mpsc::UnboundedReceiver<super::channel::CudaDone>>,
    /// The context's CUDA IPC handle caches, if a channel of this pipe is `cuda_ipc`, and what
    /// was exported for the message being written, per tensor (reused).
    #[cfg(feature = "cuda")]
    ipc: Option<Arc<crate::actors::hardware::cuda_ipc::IpcCaches>>,
    #[cfg(feature = "cuda")]
    ipc_out: Vec<Option<crate::backend::cuda_ipc::Outgoing>>,
    conn: Option<(Addr<Connection>, Link)>,
    channels: Vec<ChannelAddr>,
    fallbacks: Arc<AtomicU64>,
    metrics: Arc<PipeMetrics>,
    span: tracing::Span,
    reply: Option<Reply>,
    completions: Option<mpsc::UnboundedReceiver<Done>>,
    error: Option<Error>,
    closed_sent: bool,
    subscribers: Vec<Recipient<Closed>>,
    closers: Vec<Completer<Closed>>,
    /// A graceful close is under way, with this reason.
    draining: Option<String>,
    /// A read (or write) completed with the pipe's error: later ones complete with it too.
    reads_failed: bool,
    writes_failed: bool,

    writes: VecDeque<PendingWrite>,
    /// The write ids, sequence numbers and tickets, the frame pool and the count of writes
    /// pending here, shared with the pipe's [`PipeWriter`]s ([`writer`]).
    share: Arc<writer::WriteShare>,

    reads: VecDeque<PendingRead>,
    read_cursor: usize,
    next_read_id: u64,
    in_ticket: u64,
    expect_seq: u64,
    prefetch: Prefetch,
    current: Option<Incoming>,
    /// Where a `Receive` waits for the read loop to complete it ([`catch`]).
    catcher: Arc<catch::Catcher>,
    /// One past the last message the read loop delivered itself.
    caught_through: u64,
    /// The standing receive, while one stands ([`stand`]).
    stand: Option<stand::Standing>,
    /// `stand_turn` is running (it starts reads, which call it again).
    stand_turning: bool,
    /// Where the control connection's read loop should run, where it roams: on the runtime's
    /// queue while a handler stands, on the `LocalSet` otherwise
    /// ([`ContextBuilder::read_loop_follows_handler`](crate::ContextBuilder::read_loop_follows_handler)).
    read_roams: Option<Arc<Wanted>>,
    /// A spare list swapped with the ledger's `deferred` writes while the pipe submits them
    /// ([`Pipe::writers_inside`]), so that neither list is allocated again per handler; empty
    /// between handlers.
    deferred: Vec<writer::Handed>,
    /// The efa channel's data path and its index among the channels: the pipe hands it
    /// tensors and reads its ends itself, with no hand-over to the channel actor.
    #[cfg(feature = "efa")]
    efa: Option<(usize, super::channel::SharedPath)>,
    /// What the path hands back from an end, kept empty between ends.
    #[cfg(feature = "efa")]
    efa_batch: Vec<Done>,
    /// A message's tensors for the efa path while it is written, kept empty between messages.
    #[cfg(feature = "efa")]
    efa_out: Vec<(u32, Memory)>,
}

/// A descriptor read ahead, with its payloads' bytes (and its small tensors') if they were read
/// with it (see [`inline_len`]).
struct Incoming {
    wd: WireDescriptor,
    payloads: Vec<u8>,
    /// What of it the read loop read with the frame (`payloads` holds those bytes).
    inline: Option<Inline>,
}

impl Actor for Pipe {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(rx) = self.completions.take() {
            ctx.add_stream(Queue(rx));
        }
        #[cfg(feature = "cuda")]
        if let Some(rx) = self.cuda_completions.take() {
            ctx.add_stream(Queue(rx));
        }
        #[cfg(feature = "efa")]
        if let Some((_, path)) = &self.efa {
            ctx.add_stream(super::channel::PathEnds(path.clone()));
        }
        self.arm_prefetch();
        // The orphan check is a task of its own: an interval on the pipe's context would be
        // polled each time the pipe wakes, that is at every operation and completion.
        let pipe = ctx.address().downgrade();
        actix::spawn(async move {
            loop {
                tokio::time::sleep(ORPHAN_CHECK).await;
                match pipe.upgrade() {
                    Some(addr) if addr.connected() => addr.do_send(OrphanCheck),
                    _ => return,
                }
            }
        });
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        #[cfg(feature = "cuda")]
        self.close_ipc();
        if !self.closed_sent {
            // Torn down without closing (its system stopped): it is not open any more either.
            self.metrics.closed(&Error::Closed {
                reason: "the actor system stopped".into(),
                origin: self.origin.clone(),
            });
        }
        tracing::debug!(parent: &self.span, "pipe actor stopped");
    }
}

/// Sent by the pipe's orphan-check task every [`ORPHAN_CHECK`].
struct OrphanCheck;

impl actix::Message for OrphanCheck {
    type Result = ();
}

impl Handler<OrphanCheck> for Pipe {
    type Result = ();

    fn handle(&mut self, _: OrphanCheck, ctx: &mut Self::Context) {
        // The task's own address is gone by now: this counts the application's.
        if ctx.connected() {
            return;
        }
        self.fail(Error::Closed {
            reason: "every address of the pipe was dropped".into(),
            origin: self.origin.clone(),
        });
        if self.closed_sent {
            ctx.stop();
        }
    }
}

/// An end of the efa channel's data path: the tensor it ends goes back through `on_done`, as if
/// the channel actor had sent it.
#[cfg(feature = "efa")]
impl StreamHandler<super::channel::LinkEnd> for Pipe {
    fn handle(&mut self, end: super::channel::LinkEnd, ctx: &mut Self::Context) {
        let Some((_, path)) = &self.efa else { return };
        let mut batch = std::mem::take(&mut self.efa_batch);
        path.borrow_mut().finished(end, &mut batch);
        let span = self.span.clone();
        let _entered = span.enter();
        self.writers_inside(ctx, |pipe, _| {
            for done in batch.drain(..) {
                pipe.on_done(done);
            }
        });
        self.efa_batch = batch;
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

impl Pipe {
    /// The efa channel's data path, if channel `ch` is the efa channel.
    #[cfg(feature = "efa")]
    fn efa_path(&self, ch: usize) -> Option<&super::channel::SharedPath> {
        self.efa.as_ref().filter(|(i, _)| *i == ch).map(|(_, p)| p)
    }
}

impl StreamHandler<Done> for Pipe {
    fn handle(&mut self, done: Done, ctx: &mut Self::Context) {
        let span = self.span.clone();
        let _entered = span.enter();
        self.writers_inside(ctx, |pipe, _| pipe.on_done(done));
    }

    fn finished(&mut self, _: &mut Self::Context) {
        // Every completion sender is gone; the pipe lives on to answer with its error.
    }
}

impl Pipe {
    fn link_gone(&self) -> impl Fn() -> Error + '_ {
        || Error::Closed {
            reason: "connection already stopped".into(),
            origin: self.origin.clone(),
        }
    }

    /// Once an operation of a kind has completed with the pipe's error, every later one of that
    /// kind does too, even if its bytes happened to get through on another path (a channel of
    /// its own): the application sees one clean cut, never a success after a failure.
    fn after_failure<T>(&mut self, r: Result<T, Error>, read: bool) -> Result<T, Error> {
        let failed = if read {
            &mut self.reads_failed
        } else {
            &mut self.writes_failed
        };
        match (&r, &self.error) {
            (Ok(_), Some(e)) if *failed => Err(e.clone()),
            (Err(_), Some(_)) => {
                *failed = true;
                r
            }
            _ => r,
        }
    }

    /// Records an operation's failure: the pipe fails with it (if it had not already), and the
    /// operation reports the pipe's first error, the root cause.
    fn op_failed(&mut self, e: Error) -> Error {
        self.fail(e);
        self.error.clone().expect("fail sets the error")
    }

    // ----- closing ------------------------------------------------------------------------

    fn fail(&mut self, e: Error) {
        if self.error.is_some() {
            return;
        }
        let e = e.at_pipe(self.id);
        match &e {
            // A peer that closes, or our own Close, is not an error worth a warning.
            Error::PeerClosed { .. } | Error::Closed { .. } => {
                tracing::debug!(parent: &self.span, error = %e, "pipe closing")
            }
            _ => tracing::warn!(parent: &self.span, error = %e, "pipe failed"),
        }
        let farewell = match &e {
            Error::PeerClosed { .. } => Vec::new(),
            Error::Closed { reason, .. } => close_frame(reason, self.draining.is_some()),
            other => close_frame(&other.to_string(), false),
        };
        self.error = Some(e);
        self.info.closed = true;
        // No more remote operations: those on the lane already complete there.
        self.remote_ops.lane = None;
        self.end_stand_failed();
        // Writers write nothing more themselves: what they issue comes here, and fails.
        self.close_wire();
        if let Some((conn, _link)) = self.conn.take() {
            // A graceful close waits for the peer to take what was written before it.
            let patience = if self.draining.is_some() {
                Duration::from_secs(30)
            } else {
                Duration::from_millis(200)
            };
            conn.do_send(Shutdown {
                farewell: Farewell {
                    frame: farewell,
                    patience,
                },
            });
        }
        for ch in self.channels.drain(..) {
            ch.do_send(StopChannel);
        }
        // Our own sender goes; the completion stream ends once every buffer is back.
        self.reply = None;
        self.prefetch.ready.clear();
        self.advance_reads();
        self.pump_writes();
    }

    /// Every CUDA IPC handle cached for this pipe goes (`ClosePeer` to each device's cache
    /// actor; a mapping is unmapped after a context synchronize, so copies queued from it run
    /// first). Sent when the pipe is closed and again when its actor stops: the second finds
    /// nothing.
    #[cfg(feature = "cuda")]
    fn close_ipc(&self) {
        if let Some(ipc) = &self.ipc {
            ipc.close_peer(self.id);
        }
    }

    fn maybe_closed(&mut self) {
        if self.closed_sent
            || self.error.is_none()
            || !self.writes.is_empty()
            || !self.reads.is_empty()
        {
            return;
        }
        self.closed_sent = true;
        #[cfg(feature = "cuda")]
        self.close_ipc();
        let error = self.error.clone().expect("checked");
        self.metrics.closed(&error);
        for s in self.subscribers.drain(..) {
            s.do_send(Closed {
                error: error.clone(),
            });
        }
        for c in self.closers.drain(..) {
            c.complete(Closed {
                error: error.clone(),
            });
        }
    }

    /// Closes the pipe with a timeout if operation `id` is still pending after `d`.
    fn watch_deadline(&self, write: bool, id: u64, d: Duration, ctx: &mut actix::Context<Self>) {
        ctx.run_later(d, move |act, _| {
            let pending = if write {
                // A write a writer wrote in part may still wait in the ledger's handoff.
                act.adopt();
                act.writes.iter().any(|w| w.id == id)
            } else {
                act.reads
                    .iter()
                    .any(|r| matches!(r, PendingRead::Read { id: i, .. } if *i == id))
            };
            if pending {
                act.fail(Error::Timeout {
                    what: if write {
                        "waiting for a write to complete"
                    } else {
                        "waiting for a read to complete"
                    },
                    after: d,
                    origin: act.origin.clone(),
                });
            }
        });
    }

    fn submit(&mut self, op: PendingOp, ctx: &mut actix::Context<Self>) {
        let span = self.span.clone();
        let _entered = span.enter();
        if self.stand.is_some() && matches!(op, PendingOp::ReadDescriptor(_) | PendingOp::Read(..))
        {
            self.refuse_while_standing(op);
            return;
        }
        match op {
            PendingOp::Write(m, deadline, c, counted) => {
                self.metrics.issued(OpKind::Write);
                let id = self.submit_write(m, c, counted);
                if let Some(d) = deadline {
                    self.watch_deadline(true, id, d, ctx);
                }
            }
            PendingOp::ReadDescriptor(completer) => {
                let id = self.next_read_id;
                self.next_read_id += 1;
                self.metrics.issued(OpKind::ReadDescriptor);
                self.reads.push_back(PendingRead::Descriptor {
                    id,
                    since: self.metrics.start(),
                    completer,
                    result: None,
                });
                self.advance_reads();
            }
            PendingOp::Read(ReadState::Receiving(spare), None, data_complete, completer) => {
                let id = self.next_read_id;
                self.next_read_id += 1;
                self.metrics.issued(OpKind::Read);
                let parked = catch::Parked {
                    id,
                    seq: 0,
                    since: self.metrics.start(),
                    spare,
                    data_complete,
                    completer,
                };
                if let Err(p) = self.try_park(parked) {
                    self.reads.push_back(PendingRead::Read {
                        id,
                        since: p.since,
                        completer: p.completer,
                        message: Message::default(),
                        state: ReadState::Receiving(p.spare),
                        data_complete,
                    });
                    self.advance_reads();
                }
            }
            PendingOp::Read(state, deadline, data_complete, completer) => {
                let id = self.next_read_id;
                if let Some(d) = deadline {
                    self.watch_deadline(false, id, d, ctx);
                }
                self.next_read_id += 1;
                self.metrics.issued(OpKind::Read);
                self.reads.push_back(PendingRead::Read {
                    id,
                    since: self.metrics.start(),
                    completer,
                    message: Message::default(),
                    state,
                    data_complete,
                });
                self.advance_reads();
            }
            PendingOp::Close(reason, true, completer) if self.error.is_none() => {
                // Drain: refuse new writes, close once the ones already issued are done.
                self.closers.push(completer);
                self.draining.get_or_insert(reason);
                self.close_wire();
                self.pump_writes();
            }
            PendingOp::Close(reason, _, completer) => {
                if let (true, Some(e)) = (self.closed_sent, &self.error) {
                    completer.complete(Closed { error: e.clone() });
                    return;
                }
                self.closers.push(completer);
                self.fail(Error::Closed {
                    reason,
                    origin: self.origin.clone(),
                });
                self.maybe_closed();
            }
        }
    }
}

fn close_frame(reason: &str, graceful: bool) -> Vec<u8> {
    let mut b = Vec::new();
    let bye = wire::Farewell {
        reason: reason.into(),
        graceful,
    };
    wire::encode_serde(&mut b, FrameKind::Close, &bye);
    b
}

/// The buffers of a refused read, handed back as a message.
fn hand_back(alloc: Allocation) -> Message {
    Message {
        metadata: Vec::new(),
        payloads: alloc.payloads.into_iter().map(Payload::new).collect(),
        tensors: alloc
            .tensors
            .into_iter()
            .map(|buffer| Tensor {
                buffer,
                ..Tensor::default()
            })
            .collect(),
    }
}

/// An operation with its completer, whichever way it arrived.
enum PendingOp {
    /// A write; `true` if the ledger counts it already (a writer handed it over).
    Write(Message, Option<Duration>, Completer<WriteDone>, bool),
    ReadDescriptor(Completer<DescriptorReady>),
    /// A `Read` (waiting) or a `Receive` (receiving).
    Read(ReadState, Option<Duration>, bool, Completer<ReadDone>),
    Close(String, bool, Completer<Closed>),
}

trait IntoPending: Op {
    fn into_pending(self, c: Completer<Self::Done>) -> PendingOp;
}

impl IntoPending for Write {
    fn into_pending(self, c: Completer<WriteDone>) -> PendingOp {
        PendingOp::Write(self.message, self.deadline, c, false)
    }
}

impl IntoPending for ReadDescriptor {
    fn into_pending(self, c: Completer<DescriptorReady>) -> PendingOp {
        PendingOp::ReadDescriptor(c)
    }
}

impl IntoPending for Read {
    fn into_pending(self, c: Completer<ReadDone>) -> PendingOp {
        PendingOp::Read(
            ReadState::Waiting(self.allocation),
            self.deadline,
            self.data_complete,
            c,
        )
    }
}

impl IntoPending for Receive {
    fn into_pending(self, c: Completer<ReadDone>) -> PendingOp {
        PendingOp::Read(
            ReadState::Receiving(self.spare),
            self.deadline,
            self.data_complete,
            c,
        )
    }
}

impl IntoPending for Close {
    fn into_pending(self, c: Completer<Closed>) -> PendingOp {
        PendingOp::Close(self.reason, self.graceful, c)
    }
}

/// Awaited and fired forms of every operation share one path.
macro_rules! pipe_op {
    ($op:ty, $counter:ident) => {
        impl Handler<$op> for Pipe {
            type Result = Deferred<<$op as Op>::Done>;

            fn handle(&mut self, op: $op, ctx: &mut Self::Context) -> Self::Result {
                let (answer, waiter) = deferred(self.$counter(), <$op as Op>::lost);
                self.submit(op.into_pending(Completer::Reply(waiter)), ctx);
                answer
            }
        }

        impl Handler<Notify<$op>> for Pipe {
            type Result = ();

            fn handle(&mut self, n: Notify<$op>, ctx: &mut Self::Context) {
                self.submit(n.op.into_pending(Completer::Notify(n.to)), ctx);
            }
        }

        impl Handler<NotifyShared<$op>> for Pipe {
            type Result = ();

            fn handle(&mut self, n: NotifyShared<$op>, ctx: &mut Self::Context) {
                self.submit(n.op.into_pending(Completer::Shared(n.to)), ctx);
            }
        }
    };
}

pipe_op!(Write, next_write_id);
pipe_op!(ReadDescriptor, next_read_id);
pipe_op!(Read, next_read_id);
pipe_op!(Receive, next_read_id);
pipe_op!(Close, next_read_id);

impl Pipe {
    /// What the pipe's errors name it by.
    pub(super) fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The peer's address.
    pub(super) fn peer(&self) -> &str {
        &self.info.peer
    }

    /// The error the pipe failed with, if it has.
    pub(super) fn failure(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    /// Whether a channel of that name was negotiated.
    pub(super) fn has_channel(&self, name: &str) -> bool {
        self.info.channels.iter().any(|c| c.name == name)
    }

    /// The id the next write will get (for the `lost` completion of an awaited one).
    fn next_write_id(&self) -> u64 {
        self.share.lock().next_id
    }

    fn next_read_id(&self) -> u64 {
        self.next_read_id
    }
}

impl Handler<Subscribe> for Pipe {
    type Result = ();

    fn handle(&mut self, Subscribe(r): Subscribe, _: &mut Self::Context) {
        match (&self.error, self.closed_sent) {
            (Some(e), true) => r.do_send(Closed { error: e.clone() }),
            _ => self.subscribers.push(r),
        }
    }
}

impl Handler<GetInfo> for Pipe {
    type Result = MessageResult<GetInfo>;

    fn handle(&mut self, _: GetInfo, _: &mut Self::Context) -> Self::Result {
        let mut info = self.info.clone();
        info.fallbacks = self.fallbacks.load(Ordering::Relaxed);
        info.received_by_read_loop = self.received_by_read_loop();
        let l = self.share.lock();
        info.tensors_on_control = l.sent_on_control;
        info.tensors_by_channel = l.sent_by_channel;
        info.written_by_caller = l.written_by_caller;
        drop(l);
        info.remote = if info.closed {
            None
        } else {
            self.remote_info()
        };
        MessageResult(info)
    }
}

mod catch;
mod completion;
#[cfg(feature = "cuda")]
mod cuda;
mod done;
mod read;
mod routes;
mod spawn;
mod stand;
#[cfg(test)]
mod tests;
mod write;
mod writer;

use completion::deferred;
pub(crate) use completion::Completer;
pub use completion::Deferred;
use completion::{Calls, Sink};
use routes::Routes;
pub(crate) use spawn::{spawn_pipe, PipeParts};
pub use writer::PipeWriter;
