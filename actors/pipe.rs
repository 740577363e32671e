//! The `Pipe` actor: the ordering state machine of one pipe.
//!
//! Writes: each `Write` becomes a descriptor frame plus payload bytes (one vectored write on the
//! connection) and one operation per tensor on its channel. The pipe reserves connection tickets
//! for all of them at once, so the bytes of message n always precede those of message n + 1
//! whichever mailbox each part went through.
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

use super::channel::{Channel, ChannelKind, Queue, RecvTensor, SendTensor, StopChannel};
use super::connection::{Connection, Link, Shutdown};
use super::context::Config;
use super::messages::*;
use crate::channel::cma::RemoteBuffer;
use crate::error::{Error, Origin};
use crate::handshake::Halves;
use crate::message::{Allocation, Buffer, Descriptor, Message, Payload, Tensor};
use crate::metrics::{OpKind, PipeMetrics};
use crate::negotiate::{Choice, DeviceKind, DevicePair};
use crate::transport::stream::{
    inline_len, unexpected, Done, Farewell, InOp, Inline, Memory, OutOp, Reply,
};
use crate::wire::{self, encode_frame, Frame, FrameKind, Limits, WireDescriptor};

static NEXT_PIPE_ID: AtomicU64 = AtomicU64::new(1);

/// How often a pipe checks whether anyone still holds its address.
const ORPHAN_CHECK: Duration = Duration::from_secs(2);

/// Where a completion goes: back to an awaiting caller, or to a recipient.
pub(crate) enum Completer<T: actix::Message<Result = ()> + Send> {
    Reply(Waiter<T>),
    Notify(Recipient<T>),
    Shared(Arc<Recipient<T>>),
}

impl<T: actix::Message<Result = ()> + Send + 'static> Completer<T> {
    fn complete(self, v: T) {
        match self {
            Completer::Reply(w) => w.complete(v),
            Completer::Notify(r) => r.do_send(v),
            Completer::Shared(r) => r.do_send(v),
        }
    }
}

/// The answer of an awaited operation, met halfway: actix hands over the caller's reply sender
/// right after the handler returns ([`Deferred`]), and the pipe completes straight into it
/// ([`Waiter`]). Whichever comes second delivers. Awaiting thus costs no spawned task, boxed
/// future or second channel per operation.
enum Slot<T> {
    /// Neither the reply sender nor the answer has arrived.
    Empty,
    Tx(OneshotSender<T>),
    Value(T),
    /// Delivered, or nobody waits for it.
    Done,
}

/// The handler's side of an awaited operation; see [`Slot`].
pub struct Deferred<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

/// The pipe's side of an awaited operation; see [`Slot`]. Dropped without completing (the
/// actor torn down), it answers with the operation's `lost` completion.
pub(crate) struct Waiter<T> {
    slot: Arc<Mutex<Slot<T>>>,
    id: u64,
    lost: fn(u64) -> T,
}

fn deferred<T>(id: u64, lost: fn(u64) -> T) -> (Deferred<T>, Waiter<T>) {
    let slot = Arc::new(Mutex::new(Slot::Empty));
    (Deferred { slot: slot.clone() }, Waiter { slot, id, lost })
}

fn lock<T>(slot: &Mutex<Slot<T>>) -> std::sync::MutexGuard<'_, Slot<T>> {
    // Nothing panics while holding it; a poisoned slot is still consistent.
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> Waiter<T> {
    fn complete(self, v: T) {
        self.put(v);
    }

    fn put(&self, v: T) {
        let mut slot = lock(&self.slot);
        match mem::replace(&mut *slot, Slot::Done) {
            Slot::Empty => *slot = Slot::Value(v),
            Slot::Tx(tx) => {
                drop(slot);
                let _ = tx.send(v);
            }
            Slot::Value(_) | Slot::Done => {}
        }
    }
}

impl<T> Drop for Waiter<T> {
    fn drop(&mut self) {
        let pending = matches!(*lock(&self.slot), Slot::Empty | Slot::Tx(_));
        if pending {
            self.put((self.lost)(self.id));
        }
    }
}

impl<M> MessageResponse<Pipe, M> for Deferred<M::Result>
where
    M: actix::Message,
{
    fn handle(self, _: &mut actix::Context<Pipe>, tx: Option<OneshotSender<M::Result>>) {
        self.hand_over(tx);
    }
}

impl<T> Deferred<T> {
    /// Takes actix's reply sender (none for a `do_send`).
    fn hand_over(self, tx: Option<OneshotSender<T>>) {
        let mut slot = lock(&self.slot);
        match mem::replace(&mut *slot, Slot::Done) {
            Slot::Value(v) => {
                drop(slot);
                if let Some(tx) = tx {
                    let _ = tx.send(v);
                }
            }
            Slot::Empty => {
                if let Some(tx) = tx {
                    *slot = Slot::Tx(tx);
                }
            }
            Slot::Tx(_) | Slot::Done => {}
        }
    }
}

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
    },
}

impl PendingRead {
    fn finished(&self) -> bool {
        match self {
            PendingRead::Descriptor { result, .. } => result.is_some(),
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
    info: PipeInfo,
    limits: Limits,
    /// Index of the channel for CPU->CPU tensors, and its kind.
    cpu_channel: usize,
    cpu_kind: ChannelKind,
    conn: Option<(Addr<Connection>, Link)>,
    channels: Vec<Addr<Channel>>,
    fallbacks: Arc<AtomicU64>,
    metrics: PipeMetrics,
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
    next_write_id: u64,
    next_wire_seq: u64,
    out_ticket: u64,
    frames: Vec<Vec<u8>>,
    /// The ops of the message being written, kept for its allocation.
    batch: Vec<OutOp>,

    reads: VecDeque<PendingRead>,
    read_cursor: usize,
    next_read_id: u64,
    in_ticket: u64,
    expect_seq: u64,
    prefetch: Prefetch,
    current: Option<Incoming>,
}

/// A descriptor read ahead, with its payloads' bytes (and its small tensors') if they were read
/// with it (see [`inline_len`]).
struct Incoming {
    wd: WireDescriptor,
    payloads: Vec<u8>,
    /// What of it the read loop read with the frame (`payloads` holds those bytes).
    inline: Option<Inline>,
}

/// Everything a pipe is built from: its control connection, what was negotiated, and each
/// channel's own connections.
pub(crate) struct PipeParts {
    /// The peer's address on the bootstrap connection (the one users know it by).
    pub peer: String,
    pub control: Halves,
    pub choice: Choice,
    pub lanes: Vec<Vec<Halves>>,
}

/// Builds the actors of a pipe and starts them.
pub(crate) fn spawn_pipe(parts: PipeParts, config: &Arc<Config>) -> Addr<Pipe> {
    let PipeParts {
        peer,
        control,
        choice,
        lanes,
    } = parts;
    let id = NEXT_PIPE_ID.fetch_add(1, Ordering::Relaxed);
    let backend = format!(
        "{}/{}",
        choice.transport,
        choice
            .channels
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join("+")
    );
    let origin = Origin::new(peer.clone(), backend).with_pipe(id);
    let info = PipeInfo {
        id,
        peer,
        local: control.local.clone(),
        transport: choice.transport.clone(),
        channels: choice
            .channels
            .iter()
            .map(|c| format!("{} ({})", c.name, c.devices))
            .collect(),
        closed: false,
        fallbacks: 0,
        connections: choice
            .channels
            .iter()
            .zip(&lanes)
            .flat_map(|(c, lanes)| {
                lanes.iter().enumerate().map(|(i, h)| LaneInfo {
                    channel: c.name.clone(),
                    lane: i as u32,
                    local: h.local.clone(),
                    peer: h.peer.clone(),
                })
            })
            .collect(),
    };
    let (conn, link) = Connection::start(
        control.read,
        control.write,
        config.limits,
        origin.clone(),
        config.heartbeat,
    );
    let (reply, completions) = mpsc::unbounded_channel();
    let fallbacks = Arc::new(AtomicU64::new(0));
    let chunk_size = config.chunk_size;
    let mut kinds = Vec::new();
    let channels = choice
        .channels
        .iter()
        .zip(lanes)
        .map(|(c, lanes)| {
            let kind = match c.name.as_str() {
                "xth" => ChannelKind::Xth { pipe: id },
                "cma" => ChannelKind::Cma {
                    threads: config.cma_threads,
                    chunk_size,
                    inline_max: config
                        .cma_inline_max
                        .unwrap_or_else(|| crate::channel::cma::inline_max(&choice.transport)),
                },
                "mpt" => ChannelKind::Mpt { chunk_size },
                // Negotiation only offers what this build has; everything else is basic.
                _ => ChannelKind::Basic { chunk_size },
            };
            kinds.push(kind);
            let lanes = lanes
                .into_iter()
                .map(|h| {
                    Connection::start_lane(
                        h.read,
                        h.write,
                        config.limits,
                        origin.clone(),
                        config.heartbeat,
                    )
                })
                .collect();
            Channel::new(
                kind,
                lanes,
                reply.clone(),
                origin.clone(),
                fallbacks.clone(),
            )
            .start()
        })
        .collect();
    let cpu_channel = choice.channel_for(DevicePair::CPU).unwrap_or(0);
    let cpu_kind = kinds
        .get(cpu_channel)
        .copied()
        .unwrap_or(ChannelKind::Basic { chunk_size });
    let span = tracing::info_span!("pipe", id, peer = %info.peer, backend = %origin.backend);
    span.in_scope(|| tracing::debug!("pipe open"));
    let cpu_name = choice
        .channels
        .get(cpu_channel)
        .map_or("none", |c| c.name.as_str());
    let metrics = PipeMetrics::open(&choice.transport, cpu_name);
    Pipe {
        metrics,
        span,
        id,
        origin,
        info,
        limits: config.limits,
        cpu_channel,
        cpu_kind,
        conn: Some((conn, link)),
        channels,
        fallbacks,
        reply: Some(reply),
        completions: Some(completions),
        error: None,
        closed_sent: false,
        subscribers: Vec::new(),
        closers: Vec::new(),
        draining: None,
        reads_failed: false,
        writes_failed: false,
        writes: VecDeque::new(),
        next_write_id: 0,
        next_wire_seq: 0,
        out_ticket: 0,
        frames: Vec::new(),
        batch: Vec::new(),
        reads: VecDeque::new(),
        read_cursor: 0,
        next_read_id: 0,
        in_ticket: 0,
        expect_seq: 0,
        prefetch: Prefetch::default(),
        current: None,
    }
    .start()
}

impl Actor for Pipe {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(rx) = self.completions.take() {
            ctx.add_stream(Queue(rx));
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

impl StreamHandler<Done> for Pipe {
    fn handle(&mut self, done: Done, _: &mut Self::Context) {
        let span = self.span.clone();
        let _entered = span.enter();
        self.on_done(done);
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

    fn route(&self, t: &Tensor) -> Result<usize, Error> {
        let source = match t.device() {
            crate::message::Device::Cpu => DeviceKind::Cpu,
            crate::message::Device::Cuda(_) => DeviceKind::Cuda,
        };
        if source == DeviceKind::Cpu {
            return Ok(self.cpu_channel);
        }
        Err(Error::Unavailable {
            backend: "channel".into(),
            reason: format!("no channel negotiated for {} tensors", t.device()),
        })
    }

    /// Bytes of channel data per tensor in a descriptor (the receiver counts them as metadata).
    fn channel_data_len(&self) -> usize {
        match self.cpu_kind {
            ChannelKind::Xth { .. } => 8,
            ChannelKind::Cma { .. } => crate::channel::cma::REMOTE_BUFFER_LEN,
            _ => 0,
        }
    }

    fn check_limits(&self, m: &Message) -> Result<(), Error> {
        // The first limit that is over, in this order; the error is only built for it.
        let over = |limit, value: u64, max: u64| (value > max).then_some((limit, value, max));
        let l = &self.limits;
        let first = over(
            "payload count",
            m.payloads.len() as u64,
            l.max_payloads as u64,
        )
        .or_else(|| over("tensor count", m.tensors.len() as u64, l.max_tensors as u64))
        .or_else(|| {
            m.payloads
                .iter()
                .find_map(|p| over("payload size", p.data.len() as u64, l.max_payload_size))
        })
        .or_else(|| {
            m.tensors
                .iter()
                .find_map(|t| over("tensor size", t.buffer.len(), l.max_tensor_size))
        })
        .or_else(|| {
            over(
                "metadata size",
                (m.metadata.len()
                    + m.payloads.iter().map(|p| p.metadata.len()).sum::<usize>()
                    + m.tensors.iter().map(|t| t.metadata.len()).sum::<usize>()
                    + m.tensors.len() * self.channel_data_len()) as u64,
                l.max_metadata_size,
            )
        });
        match first {
            Some((limit, value, max)) => Err(Error::LimitExceeded {
                limit,
                value,
                max,
                origin: self.origin.clone(),
            }),
            None => Ok(()),
        }
    }

    // ----- writes -------------------------------------------------------------------------

    fn submit_write(&mut self, mut message: Message, completer: Completer<WriteDone>) {
        let id = self.next_write_id;
        self.next_write_id += 1;
        let mut w = PendingWrite {
            id,
            seq: u64::MAX,
            ticket: u64::MAX,
            since: self.metrics.start(),
            message: Message::default(),
            payloads_out: false,
            tensors_out: 0,
            error: None,
            completer,
        };
        let refusal = match (&self.error, &self.draining) {
            (Some(e), _) => Some(e.clone()),
            (None, Some(reason)) => Some(Error::Closed {
                reason: format!("closing gracefully ({reason}): no new writes"),
                origin: self.origin.clone(),
            }),
            (None, None) => self
                .check_limits(&message)
                .and_then(|_| {
                    message
                        .tensors
                        .iter()
                        .try_for_each(|t| self.route(t).map(drop))
                })
                .err(),
        };
        let Some(link) = self
            .conn
            .as_ref()
            .map(|c| &c.1)
            .filter(|_| refusal.is_none())
        else {
            w.error = refusal.map(Box::new);
            w.message = message;
            self.writes.push_back(w);
            self.pump_writes();
            return;
        };
        let seq = self.next_wire_seq;
        let mut frame = self.frames.pop().unwrap_or_default();
        frame.clear();
        let cpu = self.cpu_channel as u8;
        let (kind, id_bytes) = (self.cpu_kind, self.id.to_le_bytes());
        encode_frame(&mut frame, FrameKind::Descriptor, |b| {
            wire::encode_descriptor(b, seq, &message, |i, data| {
                match kind {
                    ChannelKind::Xth { .. } => data.set(&id_bytes),
                    ChannelKind::Cma { .. } => {
                        if let Some(buf) = message.tensors[i].buffer.as_cpu() {
                            if !kind.sends_on_control(buf.len() as u64) {
                                data.set(&RemoteBuffer::local(buf).encode())
                            }
                        }
                    }
                    _ => {}
                }
                cpu
            })
        });
        let body = (frame.len() - wire::LEN_PREFIX) as u64;
        if body > self.limits.max_frame_size as u64 {
            w.error = Some(Box::new(Error::LimitExceeded {
                limit: "frame size",
                value: body,
                max: self.limits.max_frame_size as u64,
                origin: self.origin.clone(),
            }));
            w.message = message;
            self.frames.push(frame);
            self.writes.push_back(w);
            self.pump_writes();
            return;
        }
        self.next_wire_seq += 1;
        let ticket = self.out_ticket;
        let on_control = message
            .tensors
            .iter()
            .filter(|t| kind.sends_on_control(t.buffer.len()))
            .count() as u64;
        self.out_ticket += 1 + on_control;
        let reply = self
            .reply
            .clone()
            .expect("reply queue lives while the connection does");
        // The message, then each tensor that travels on the control connection (basic, inline
        // cma), at consecutive tickets: written at once, in one vectored write, if the write
        // loop is idle (the usual case for a small message), and completed below with no trip
        // through the loop and the completion queue; whatever is not is queued on the
        // connection. Never through the channel actor.
        let mut batch = mem::take(&mut self.batch);
        batch.clear();
        batch.push(OutOp::Message {
            ticket,
            frame,
            payloads: mem::take(&mut message.payloads),
            reply,
        });
        let mut next = ticket + 1;
        let mut tensors_out = 0;
        for (i, t) in message.tensors.iter_mut().enumerate() {
            let Buffer::Cpu(buffer) = mem::take(&mut t.buffer);
            if kind.sends_on_control(buffer.len() as u64) {
                batch.push(OutOp::Tensor {
                    ticket: next,
                    seq,
                    index: i as u32,
                    memory: Memory::Owned(buffer),
                    offset: 0,
                    chunk_size: kind.control_chunk(),
                    reply: self.reply.clone().expect("checked above"),
                });
                next += 1;
            } else {
                self.channels[self.cpu_channel].do_send(SendTensor {
                    seq,
                    index: i as u32,
                    buffer,
                });
                tensors_out += 1;
            }
        }
        let queued = batch.len();
        let written = link.write_batch(&mut batch, self.link_gone());
        // Tensors still out: those on other channels, and those queued on the connection.
        tensors_out += queued - written.max(1);
        w.payloads_out = written == 0;
        for op in batch.drain(..) {
            // What `Done::Wrote` / `Done::WroteTensor` would do, without building one and
            // finding the write again.
            match op {
                OutOp::Message {
                    frame, payloads, ..
                } => {
                    if self.frames.len() < 4 {
                        self.frames.push(frame);
                    }
                    message.payloads = payloads;
                }
                OutOp::Tensor { index, memory, .. } => {
                    message.tensors[index as usize].buffer =
                        Buffer::Cpu(memory.into_vec().unwrap_or_default());
                }
            }
        }
        self.batch = batch;
        w.seq = seq;
        w.ticket = ticket;
        w.tensors_out = tensors_out;
        w.message = message;
        let done = !w.payloads_out && w.tensors_out == 0;
        self.writes.push_back(w);
        if done {
            self.pump_writes();
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

    fn pump_writes(&mut self) {
        while self
            .writes
            .front()
            .is_some_and(|w| !w.payloads_out && w.tensors_out == 0)
        {
            let w = self.writes.pop_front().expect("front exists");
            let result = self.after_failure(w.error.map_or(Ok(()), |e| Err(*e)), false);
            let bytes = result.as_ref().map(|_| w.message.total_bytes());
            self.metrics.finished(OpKind::Write, w.since, bytes);
            tracing::trace!(parent: &self.span, id = w.id, ok = result.is_ok(), "write done");
            w.completer.complete(WriteDone {
                id: w.id,
                result,
                message: w.message,
            });
        }
        if self.writes.is_empty() && self.error.is_none() {
            if let Some(reason) = self.draining.clone() {
                self.fail(Error::Closed {
                    reason,
                    origin: self.origin.clone(),
                });
            }
        }
        self.maybe_closed();
    }

    // ----- reads --------------------------------------------------------------------------

    fn arm_prefetch(&mut self) {
        let p = &self.prefetch;
        if self.error.is_some() || p.in_flight || p.blocked || p.ready.len() >= MAX_PREFETCH {
            return;
        }
        let (Some((_, link)), Some(reply)) = (&self.conn, &self.reply) else {
            return;
        };
        // Whatever the loop reads by itself still fits in the queue.
        let more = (MAX_PREFETCH - 1 - p.ready.len()) as u32;
        let ticket = self.in_ticket;
        self.in_ticket += 1;
        self.prefetch.in_flight = true;
        self.prefetch.more = more;
        link.read(
            InOp::Frame {
                ticket,
                reply: reply.clone(),
                more,
                carried: self.cpu_kind.carried(),
            },
            self.link_gone(),
        );
    }

    fn check_descriptor(&self, wd: &WireDescriptor) -> Result<(), Error> {
        if wd.seq != self.expect_seq {
            return Err(Error::protocol(
                format!(
                    "descriptor for message {} arrived where message {} was expected",
                    wd.seq, self.expect_seq
                ),
                &self.origin,
            ));
        }
        for (i, ((ch, _), t)) in wd.routes.iter().zip(&wd.descriptor.tensors).enumerate() {
            let ok =
                *ch as usize == self.cpu_channel && t.source_device == crate::message::Device::Cpu;
            if !ok {
                return Err(Error::protocol(
                    format!(
                        "tensor {i} of message {} names channel {ch} for a {} tensor; that is not what was negotiated",
                        wd.seq, t.source_device
                    ),
                    &self.origin,
                ));
            }
        }
        Ok(())
    }

    /// Starts every read that can start, in order, then completes what is finished.
    fn advance_reads(&mut self) {
        // The queue is set aside while its entries start, rather than each entry being moved
        // out and back (a pending read is over 250 bytes); `try_start` never looks at it.
        let mut reads = mem::take(&mut self.reads);
        while let Some(op) = reads.get_mut(self.read_cursor) {
            if !self.try_start(op) {
                break;
            }
            self.read_cursor += 1;
        }
        debug_assert!(self.reads.is_empty(), "try_start queued a read");
        self.reads = reads;
        self.pump_reads();
    }

    fn try_start(&mut self, op: &mut PendingRead) -> bool {
        match op {
            PendingRead::Descriptor { result, .. } => {
                if let Some(e) = &self.error {
                    *result = Some(Err(e.clone()));
                    return true;
                }
                if self.current.is_some() {
                    // The previous message has not been read yet.
                    return false;
                }
                match self.prefetch.ready.pop_front() {
                    Some(incoming) => {
                        *result = Some(Ok(incoming.wd.descriptor.clone()));
                        self.current = Some(incoming);
                        self.arm_prefetch();
                        true
                    }
                    None => false,
                }
            }
            PendingRead::Read { message, state, .. }
                if matches!(state, ReadState::Receiving(_)) =>
            {
                let refusal = match (&self.error, &self.current) {
                    (Some(e), _) => Some(e.clone()),
                    (None, Some(_)) => Some(Error::invalid(
                        "Receive issued while a delivered descriptor is unread: send its Read first",
                    )),
                    (None, None) if self.prefetch.ready.is_empty() => return false,
                    (None, None) => None,
                };
                let ReadState::Receiving(spare) = mem::replace(state, ReadState::Finished(Ok(())))
                else {
                    unreachable!("matched above")
                };
                if let Some(e) = refusal {
                    *message = spare.map(hand_back).unwrap_or_default();
                    *state = ReadState::Finished(Err(Box::new(e)));
                    return true;
                }
                let d = &self
                    .prefetch
                    .ready
                    .front()
                    .expect("checked above")
                    .wd
                    .descriptor;
                match spare.map_or_else(|| Allocation::for_descriptor(d), |a| a.refit(d)) {
                    Ok(alloc) => {
                        let incoming = self.prefetch.ready.pop_front().expect("checked above");
                        (*message, *state) = self.start_read(incoming, alloc);
                    }
                    // Sizes that fit no address space: the message stays first in line.
                    Err(e) => *state = ReadState::Finished(Err(Box::new(e))),
                }
                true
            }
            PendingRead::Read { message, state, .. } => {
                let ReadState::Waiting(alloc) = mem::replace(state, ReadState::Finished(Ok(())))
                else {
                    return true;
                };
                let refusal = match (&self.error, &self.current) {
                    (Some(e), _) => Some(e.clone()),
                    (None, None) => Some(Error::invalid(
                        "Read issued with no descriptor to read: send ReadDescriptor first",
                    )),
                    (None, Some(incoming)) => alloc.check(&incoming.wd.descriptor).err(),
                };
                if let Some(e) = refusal {
                    *message = hand_back(alloc);
                    *state = ReadState::Finished(Err(Box::new(e)));
                } else {
                    let incoming = self.current.take().expect("checked above");
                    (*message, *state) = self.start_read(incoming, alloc);
                }
                true
            }
        }
    }

    fn start_read(&mut self, incoming: Incoming, alloc: Allocation) -> (Message, ReadState) {
        let carried = self.cpu_kind.carried();
        let Incoming {
            wd:
                WireDescriptor {
                    seq,
                    descriptor,
                    routes,
                },
            payloads: bytes,
            inline: read_with_frame,
        } = incoming;
        let inline = read_with_frame.map(|_| bytes);
        // Past the payloads, the carried tensors' bytes if they came with the frame too;
        // otherwise some of this message is still on the stream.
        let mut tensor_bytes = read_with_frame.filter(Inline::whole).map(|i| i.payloads);
        let in_band = tensor_bytes.is_none();
        let mut message = Message {
            metadata: descriptor.metadata,
            payloads: descriptor
                .payloads
                .into_iter()
                .map(|p| Payload {
                    data: Vec::new(),
                    metadata: p.metadata,
                })
                .collect(),
            tensors: descriptor
                .tensors
                .into_iter()
                .map(|t| Tensor {
                    buffer: Buffer::default(),
                    metadata: t.metadata,
                    target_device: t.target_device,
                })
                .collect(),
        };
        let (Some((_, link)), Some(reply)) = (&self.conn, &self.reply) else {
            unreachable!("reads start only while the pipe is open");
        };
        let mut ticket = self.in_ticket;
        let payload_ticket = (!alloc.payloads.is_empty() && inline.is_none()).then_some(ticket);
        if let Some(bytes) = &inline {
            // Read with the descriptor: copy them into the caller's buffers (the sizes match,
            // `Allocation::check` saw to that).
            let mut at = 0;
            for (p, mut b) in message.payloads.iter_mut().zip(alloc.payloads) {
                let n = b.len();
                b.copy_from_slice(&bytes[at..at + n]);
                at += n;
                p.data = b;
            }
        } else if payload_ticket.is_some() {
            link.read(
                InOp::Payloads {
                    ticket,
                    buffers: alloc.payloads,
                    reply: reply.clone(),
                },
                self.link_gone(),
            );
            ticket += 1;
        }
        let mut tensors_out = 0;
        for (i, (buffer, (ch, data))) in alloc.tensors.into_iter().zip(routes).enumerate() {
            let Buffer::Cpu(mut buffer) = buffer;
            let on_control = carried.carries(&data);
            if let (true, Some(at), Some(bytes)) = (on_control, tensor_bytes.as_mut(), &inline) {
                // Read with the descriptor, like inline payloads.
                let n = buffer.len();
                buffer.copy_from_slice(&bytes[*at..*at + n]);
                *at += n;
                message.tensors[i].buffer = Buffer::Cpu(buffer);
                continue;
            }
            tensors_out += 1;
            if on_control {
                // As for writes: read at its ticket on the control connection, directly.
                link.read(
                    InOp::Tensor {
                        ticket,
                        seq,
                        index: i as u32,
                        memory: Memory::Owned(buffer),
                        offset: 0,
                        reply: reply.clone(),
                    },
                    self.link_gone(),
                );
                ticket += 1;
            } else {
                self.channels[ch as usize].do_send(RecvTensor {
                    seq,
                    index: i as u32,
                    buffer,
                    data,
                });
            }
        }
        self.in_ticket = ticket;
        if in_band {
            // This was the descriptor holding the prefetch back.
            self.prefetch.blocked = false;
        }
        self.arm_prefetch();
        (
            message,
            ReadState::Running {
                seq,
                payload_ticket,
                payloads_out: payload_ticket.is_some(),
                tensors_out,
                error: None,
            },
        )
    }

    fn pump_reads(&mut self) {
        while self.reads.front().is_some_and(PendingRead::finished) {
            let op = self.reads.pop_front().expect("front exists");
            self.read_cursor -= 1;
            match op {
                PendingRead::Descriptor {
                    id,
                    since,
                    completer,
                    result,
                } => {
                    let descriptor = self.after_failure(result.expect("finished"), true);
                    let m = descriptor.as_ref().map(|_| 0);
                    self.metrics.finished(OpKind::ReadDescriptor, since, m);
                    completer.complete(DescriptorReady { id, descriptor })
                }
                PendingRead::Read {
                    id,
                    since,
                    completer,
                    message,
                    state,
                } => {
                    let result = match state {
                        ReadState::Finished(r) => r.map_err(|e| *e),
                        ReadState::Running { error, .. } => error.map_or(Ok(()), |e| Err(*e)),
                        ReadState::Waiting(_) | ReadState::Receiving(_) => {
                            unreachable!("not finished")
                        }
                    };
                    let result = self.after_failure(result, true);
                    let bytes = result.as_ref().map(|_| message.total_bytes());
                    self.metrics.finished(OpKind::Read, since, bytes);
                    tracing::trace!(parent: &self.span, id, ok = result.is_ok(), "read done");
                    completer.complete(ReadDone {
                        id,
                        result,
                        message,
                    });
                }
            }
        }
        self.maybe_closed();
    }

    fn running_read(&mut self, seq: u64) -> Option<(&mut Message, &mut ReadState)> {
        self.reads.iter_mut().find_map(|op| match op {
            PendingRead::Read { message, state, .. } => match state {
                ReadState::Running { seq: s, .. } if *s == seq => Some((message, state)),
                _ => None,
            },
            _ => None,
        })
    }

    // ----- completions from the connection and channels ------------------------------------

    /// Records an operation's failure: the pipe fails with it (if it had not already), and the
    /// operation reports the pipe's first error, the root cause.
    fn op_failed(&mut self, e: Error) -> Error {
        self.fail(e);
        self.error.clone().expect("fail sets the error")
    }

    fn on_done(&mut self, done: Done) {
        match done {
            Done::Wrote {
                ticket,
                frame,
                payloads,
                result,
            } => {
                if self.frames.len() < 4 {
                    self.frames.push(frame);
                }
                let err = result.err().map(|e| self.op_failed(e));
                if let Some(w) = self.writes.iter_mut().find(|w| w.ticket == ticket) {
                    w.message.payloads = payloads;
                    w.payloads_out = false;
                    if err.is_some() {
                        w.error = err.map(Box::new);
                    }
                }
                self.pump_writes();
            }
            Done::WroteTensor {
                seq,
                index,
                memory,
                result,
            } => {
                let buffer = memory.into_vec().unwrap_or_default();
                let err = result.err().map(|e| self.op_failed(e));
                if let Some(w) = self.writes.iter_mut().find(|w| w.seq == seq) {
                    if let Some(t) = w.message.tensors.get_mut(index as usize) {
                        t.buffer = Buffer::Cpu(buffer);
                    }
                    w.tensors_out -= 1;
                    if err.is_some() {
                        w.error = err.map(Box::new);
                    }
                }
                self.pump_writes();
            }
            Done::Frame {
                result, payloads, ..
            } => {
                let outcome = result.and_then(|f| match f {
                    Frame::Descriptor(wd) => self.check_descriptor(&wd).map(|_| wd),
                    f => Err(unexpected(f, "a message descriptor", &self.origin)),
                });
                match outcome {
                    Ok(wd) => {
                        self.expect_seq += 1;
                        let inline = inline_len(&wd, self.cpu_kind.carried());
                        // Nothing of it is left on the stream (see `stream::self_contained`).
                        let whole = inline.is_some_and(|i| i.whole());
                        if self.prefetch.more > 0 && whole {
                            // The read loop went on to the next frame by itself, at the next
                            // ticket.
                            self.prefetch.more -= 1;
                            self.in_ticket += 1;
                        } else {
                            self.prefetch.in_flight = false;
                        }
                        // More of this message is on the stream: nothing can be read ahead
                        // before its `Read` has queued those reads.
                        self.prefetch.blocked = !whole;
                        self.prefetch.ready.push_back(Incoming {
                            wd,
                            payloads,
                            inline,
                        });
                        debug_assert!(self.prefetch.ready.len() <= MAX_PREFETCH);
                        self.advance_reads();
                        self.arm_prefetch();
                    }
                    Err(e) => {
                        self.prefetch.in_flight = false;
                        self.fail(e);
                    }
                }
            }
            Done::Payloads {
                ticket,
                buffers,
                result,
            } => {
                let err = result.err().map(|e| self.op_failed(e));
                let hit = self.reads.iter_mut().find_map(|op| match op {
                    PendingRead::Read {
                        message,
                        state:
                            ReadState::Running {
                                payload_ticket,
                                payloads_out,
                                error,
                                ..
                            },
                        ..
                    } if *payload_ticket == Some(ticket) => Some((message, payloads_out, error)),
                    _ => None,
                });
                if let Some((message, out, error)) = hit {
                    for (p, b) in message.payloads.iter_mut().zip(buffers) {
                        p.data = b;
                    }
                    *out = false;
                    if err.is_some() {
                        *error = err.map(Box::new);
                    }
                }
                self.pump_reads();
            }
            Done::Tensor {
                seq,
                index,
                memory,
                result,
            } => {
                let buffer = memory.into_vec().unwrap_or_default();
                let err = result.err().map(|e| self.op_failed(e));
                if let Some((
                    message,
                    ReadState::Running {
                        tensors_out, error, ..
                    },
                )) = self.running_read(seq)
                {
                    if let Some(t) = message.tensors.get_mut(index as usize) {
                        t.buffer = Buffer::Cpu(buffer);
                    }
                    *tensors_out -= 1;
                    if err.is_some() {
                        *error = err.map(Box::new);
                    }
                }
                self.pump_reads();
            }
        }
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

    fn maybe_closed(&mut self) {
        if self.closed_sent
            || self.error.is_none()
            || !self.writes.is_empty()
            || !self.reads.is_empty()
        {
            return;
        }
        self.closed_sent = true;
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
        match op {
            PendingOp::Write(m, deadline, c) => {
                if let Some(d) = deadline {
                    self.watch_deadline(true, self.next_write_id, d, ctx);
                }
                self.metrics.issued(OpKind::Write);
                self.submit_write(m, c)
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
            PendingOp::Read(state, deadline, completer) => {
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
                });
                self.advance_reads();
            }
            PendingOp::Close(reason, true, completer) if self.error.is_none() => {
                // Drain: refuse new writes, close once the ones already issued are done.
                self.closers.push(completer);
                self.draining.get_or_insert(reason);
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
    Write(Message, Option<Duration>, Completer<WriteDone>),
    ReadDescriptor(Completer<DescriptorReady>),
    /// A `Read` (waiting) or a `Receive` (receiving).
    Read(ReadState, Option<Duration>, Completer<ReadDone>),
    Close(String, bool, Completer<Closed>),
}

trait IntoPending: Op {
    fn into_pending(self, c: Completer<Self::Done>) -> PendingOp;
}

impl IntoPending for Write {
    fn into_pending(self, c: Completer<WriteDone>) -> PendingOp {
        PendingOp::Write(self.message, self.deadline, c)
    }
}

impl IntoPending for ReadDescriptor {
    fn into_pending(self, c: Completer<DescriptorReady>) -> PendingOp {
        PendingOp::ReadDescriptor(c)
    }
}

impl IntoPending for Read {
    fn into_pending(self, c: Completer<ReadDone>) -> PendingOp {
        PendingOp::Read(ReadState::Waiting(self.allocation), self.deadline, c)
    }
}

impl IntoPending for Receive {
    fn into_pending(self, c: Completer<ReadDone>) -> PendingOp {
        PendingOp::Read(ReadState::Receiving(self.spare), self.deadline, c)
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
                let (answer, waiter) = deferred(self.$counter, <$op as Op>::lost);
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
        MessageResult(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(id: u64) -> u64 {
        1000 + id
    }

    #[test]
    fn awaited_answers_meet_whichever_side_comes_first() {
        // Completed before actix hands the sender over (an op answered inside its handler).
        let (answer, waiter) = deferred(1, lost);
        waiter.complete(7);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        answer.hand_over(Some(tx));
        assert_eq!(rx.try_recv(), Ok(7));

        // Sender first, completion later.
        let (answer, waiter) = deferred(2, lost);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        answer.hand_over(Some(tx));
        assert!(rx.try_recv().is_err());
        waiter.complete(8);
        assert_eq!(rx.try_recv(), Ok(8));

        // Nobody waits (`do_send`): the completion is dropped quietly.
        let (answer, waiter) = deferred(3, lost);
        answer.hand_over(None);
        waiter.complete(9);

        // The pipe drops the operation unanswered, before or after the hand-over.
        let (answer, waiter) = deferred(4, lost);
        drop(waiter);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        answer.hand_over(Some(tx));
        assert_eq!(rx.try_recv(), Ok(1004));
        let (answer, waiter) = deferred(5, lost);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        answer.hand_over(Some(tx));
        drop(waiter);
        assert_eq!(rx.try_recv(), Ok(1005));
    }
}
