//! [`PipeWriter`]: a write handle that writes a small message straight from the caller's task.
//!
//! A `Write` sent to the pipe costs the application a mailbox hop in (and a poll of the pipe's
//! task before the bytes leave) and a `WriteDone` hop out. A `PipeWriter` shares the pipe's
//! write ledger (the write ids, wire sequence numbers and connection tickets, the frame pool, and
//! the count of writes the pipe still holds) behind one lock. When nothing of the pipe's is
//! queued or in flight, a self-contained message (payloads and small host tensors that ride the
//! control stream, at most 16 KiB in all: what the reader's read loop reads with the frame) is
//! encoded and written into the parked write half in the caller's own call, and its `WriteDone`
//! is the call's return value. Anything else goes to the pipe as before, and the pipe completes
//! it; the ledger counts it from the moment the writer hands it over, so no later direct write
//! can overtake it.
//!
//! The lock makes the handle work from any thread: the pipe takes the same lock for its own
//! writes, so the two never interleave, and the write loop (on the pipe's thread) takes the
//! parking lock only for moments. A writer on another arbiter therefore writes into the socket
//! or ring from its own thread (docs/architecture.md, "Threading model").

use super::*;
use crate::transport::stream::{DIRECT_TENSOR_MAX, INLINE_PAYLOADS, IOV_BATCH};

/// Where a writer may write: parts of the control connection's submit handle that work from any
/// thread. Present while the pipe is open and not draining.
pub(super) struct Wire {
    pub(super) parking: Arc<Parking>,
    pub(super) out: mpsc::UnboundedSender<OutOp>,
    pub(super) reply: Reply,
}

/// The write state the pipe shares with its writers (see the module's documentation).
pub(super) struct Ledger {
    pub(super) next_id: u64,
    pub(super) next_seq: u64,
    pub(super) out_ticket: u64,
    /// Writes issued to the pipe (in its queue, on their way through its mailbox from a writer,
    /// or handed over in `handoff`) and not yet completed. A writer writes only when it is 0.
    pub(super) outstanding: u64,
    pub(super) wire: Option<Wire>,
    /// Frame buffers, recycled.
    pub(super) frames: Vec<Vec<u8>>,
    /// The ops of the message being written, kept for their allocation.
    pub(super) batch: Vec<OutOp>,
    /// Writes a writer wrote in part: the pipe takes them into its queue before anything else.
    pub(super) handoff: VecDeque<PendingWrite>,
    pub(super) sent_on_control: u64,
    pub(super) sent_by_channel: u64,
    /// Writes a writer wrote and completed itself.
    pub(super) written_by_caller: u64,
    /// The pipe is running code that may call a standing receive's handler
    /// ([`Pipe::writers_inside`]): a write a writer hands over meanwhile waits in `deferred`,
    /// which the pipe takes in before that code returns, instead of going through its mailbox.
    inside: bool,
    deferred: Vec<Handed>,
    /// Writes a writer handed over through the pipe's mailbox that the pipe has not taken yet:
    /// while any is on its way, later ones follow it there, to keep their order.
    in_mailbox: u64,
}

/// The pipe's write ledger and what a writer needs to encode a message as the pipe would.
pub(super) struct WriteShare {
    ledger: Mutex<Ledger>,
    origin: Origin,
    limits: Limits,
    cpu_channel: usize,
    cpu_kind: ChannelKind,
    routes: Routes,
    pub(super) metrics: Arc<PipeMetrics>,
    /// Whether the limits on counts and sizes are all at least what a message that otherwise
    /// [qualifies](WriteShare::qualifies) can have (`IOV_BATCH - 1` payloads, `IOV_BATCH / 2`
    /// tensors, none over [`INLINE_PAYLOADS`] bytes): only its metadata is then left to check.
    roomy: bool,
}

/// What became of a writer's attempt.
enum Direct {
    /// Written whole and completed here: its id and the message (the `WriteDone` is built
    /// where it is returned, not carried out in this).
    Done(u64, Message),
    /// Written in part: the pipe completes it through its completer (the write's id).
    Handed(u64),
    /// Not written: the message, for the pipe (the ledger counts it already).
    ToPipe(Message),
}

/// A `Write` a writer hands to the pipe, counted in the ledger already.
pub(super) struct Handed {
    message: Message,
    deadline: Option<Duration>,
    completer: Completer<WriteDone>,
}

impl actix::Message for Handed {
    type Result = ();
}

impl Handler<Handed> for Pipe {
    type Result = ();

    fn handle(&mut self, h: Handed, ctx: &mut Self::Context) {
        self.share.lock().in_mailbox -= 1;
        self.submit(
            PendingOp::Write(h.message, h.deadline, h.completer, true),
            ctx,
        );
    }
}

impl Pipe {
    /// Runs `f` (code that may complete reads, and so call a standing receive's handler, which
    /// may write) with the writers inside: a write a `PipeWriter` hands over meanwhile is taken
    /// in when `f` returns, not a turn of the thread later through the mailbox. A handler that
    /// answers a message with tensors in place writes that way (on the VM, 2 µs from the
    /// handler to the post before: git history's docs/efa-measurements.md, "A handler's write without the
    /// mailbox").
    pub(super) fn writers_inside(
        &mut self,
        ctx: &mut actix::Context<Self>,
        f: impl FnOnce(&mut Self, &mut actix::Context<Self>),
    ) {
        let outer = std::mem::replace(&mut self.share.lock().inside, true);
        f(self, ctx);
        if outer {
            return;
        }
        let mut taken = std::mem::take(&mut self.deferred);
        loop {
            {
                let mut l = self.share.lock();
                if l.deferred.is_empty() {
                    l.inside = false;
                    break;
                }
                std::mem::swap(&mut l.deferred, &mut taken);
            }
            for h in taken.drain(..) {
                self.submit(
                    PendingOp::Write(h.message, h.deadline, h.completer, true),
                    ctx,
                );
            }
        }
        self.deferred = taken;
    }
}

/// The deadline of a write a writer wrote in part (it is in the ledger's `handoff`, or already in
/// the pipe's queue): the pipe watches it as it watches its own writes'.
pub(super) struct WatchWrite {
    id: u64,
    deadline: Duration,
}

impl actix::Message for WatchWrite {
    type Result = ();
}

impl Handler<WatchWrite> for Pipe {
    type Result = ();

    fn handle(&mut self, w: WatchWrite, ctx: &mut Self::Context) {
        self.watch_deadline(true, w.id, w.deadline, ctx);
    }
}

impl Handler<GetWriter> for Pipe {
    type Result = MessageResult<GetWriter>;

    fn handle(&mut self, _: GetWriter, ctx: &mut Self::Context) -> Self::Result {
        MessageResult(PipeWriter {
            share: self.share.clone(),
            pipe: ctx.address(),
        })
    }
}

impl WriteShare {
    pub(super) fn new(
        origin: Origin,
        limits: Limits,
        cpu_channel: usize,
        cpu_kind: ChannelKind,
        routes: Routes,
        metrics: Arc<PipeMetrics>,
        wire: Wire,
    ) -> WriteShare {
        WriteShare {
            ledger: Mutex::new(Ledger {
                next_id: 0,
                next_seq: 0,
                out_ticket: 0,
                outstanding: 0,
                wire: Some(wire),
                frames: Vec::new(),
                batch: Vec::new(),
                handoff: VecDeque::new(),
                sent_on_control: 0,
                sent_by_channel: 0,
                written_by_caller: 0,
                inside: false,
                deferred: Vec::new(),
                in_mailbox: 0,
            }),
            origin,
            roomy: limits.max_payloads as usize >= IOV_BATCH
                && limits.max_tensors as usize >= IOV_BATCH / 2
                && limits.max_payload_size >= INLINE_PAYLOADS
                && limits.max_tensor_size >= INLINE_PAYLOADS,
            limits,
            cpu_channel,
            cpu_kind,
            routes,
            metrics,
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        // Nothing panics while holding it; a poisoned ledger is still consistent.
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a writer may write `m` itself: payloads and tensors that all fit one vectored
    /// write, at most [`INLINE_PAYLOADS`] bytes in all (what the peer's read loop reads with the
    /// frame), each tensor host memory routed to the CPU channel and carried on the control
    /// stream in one chunk, and within the limits (a write over them goes to the pipe, which
    /// refuses it in order). If it may, its bytes ([`Message::total_bytes`]).
    fn qualifies(&self, m: &Message) -> Option<u64> {
        let tensors = m.tensors.len();
        if tensors > IOV_BATCH / 2 || 1 + m.payloads.len() + 2 * tensors > IOV_BATCH {
            return None;
        }
        let mut total = 0u64;
        let mut metadata = m.metadata.len();
        for p in &m.payloads {
            total += p.data.len() as u64;
            metadata += p.metadata.len();
        }
        let mut channel_data = 0;
        if tensors > 0 {
            let chunk = DIRECT_TENSOR_MAX.min(self.cpu_kind.control_chunk()) as u64;
            for t in &m.tensors {
                let len = t.buffer.len();
                if t.buffer.as_cpu().is_none()
                    || !(1..=chunk).contains(&len)
                    || !self.cpu_kind.sends_on_control(len)
                    || self.routes.for_tensor(t.device(), t.target_device) != Some(self.cpu_channel)
                {
                    return None;
                }
                total += len;
                metadata += t.metadata.len();
            }
            channel_data =
                tensors * channel_data_len(&self.routes, self.cpu_kind, self.cpu_channel);
        }
        if total > INLINE_PAYLOADS {
            return None;
        }
        let within = if self.roomy {
            // `check_limits`' last check, the only one that can fail here.
            (metadata + channel_data) as u64 <= self.limits.max_metadata_size
        } else {
            check_limits(&self.limits, &self.origin, m, channel_data).is_ok()
        };
        within.then_some(total)
    }

    /// Writes `message` at once if it qualifies and nothing of the pipe's is queued or in
    /// flight; see [`Direct`].
    fn try_direct(
        &self,
        mut message: Message,
        completer: impl FnOnce() -> Completer<WriteDone>,
    ) -> Direct {
        let qualifies = self.qualifies(&message);
        let mut guard = self.lock();
        let l = &mut *guard;
        let (wire, bytes) = match (&l.wire, l.outstanding, qualifies) {
            (Some(wire), 0, Some(bytes)) => (wire, bytes),
            _ => {
                l.outstanding += 1;
                return Direct::ToPipe(message);
            }
        };
        let seq = l.next_seq;
        let mut frame = l.frames.pop().unwrap_or_default();
        frame.clear();
        let cpu = self.cpu_channel as u8;
        // Every tensor is carried on the control stream: no channel data (as the pipe encodes
        // a basic or inline cma tensor).
        encode_frame(&mut frame, FrameKind::Descriptor, |b| {
            wire::encode_descriptor(b, seq, &message, |_, _| cpu)
        });
        if (frame.len() - wire::LEN_PREFIX) as u64 > self.limits.max_frame_size as u64 {
            l.frames.push(frame);
            l.outstanding += 1;
            return Direct::ToPipe(message);
        }
        let ticket = l.out_ticket;
        if message.tensors.is_empty() {
            return self.direct_message(guard, message, frame, seq, ticket, bytes, completer);
        }
        let ops = 1 + message.tensors.len();
        let since = self.metrics.start();
        // Its ops are built only if the loop must write part of them.
        let Some(whole) =
            wire.parking
                .try_write_parts(ticket, seq, &frame, &message.payloads, &message.tensors)
        else {
            // Nothing went out: the pipe writes it (through its write loop).
            return_frame(&mut l.frames, frame);
            l.outstanding += 1;
            return Direct::ToPipe(message);
        };
        // Its bytes are on the stream: it takes its id, sequence number and tickets.
        let id = l.next_id;
        l.next_id += 1;
        l.next_seq += 1;
        l.out_ticket += ops as u64;
        l.sent_on_control += (ops - 1) as u64;
        self.metrics.issued(OpKind::Write);
        if whole == ops {
            return_frame(&mut l.frames, frame);
            l.written_by_caller += 1;
            drop(guard);
            self.metrics.finished(OpKind::Write, since, Ok(bytes));
            return Direct::Done(id, message);
        }
        // Written in part: the write loop writes the rest, and the pipe completes the write
        // (it takes it from `handoff` before it handles any completion of the loop's).
        let mut batch = start_batch(
            &mut l.batch,
            ticket,
            frame,
            &mut message,
            wire.reply.clone(),
        );
        let chunk_size = self.cpu_kind.control_chunk();
        for (i, t) in message.tensors.iter_mut().enumerate() {
            batch.push(OutOp::Tensor {
                ticket: ticket + 1 + i as u64,
                seq,
                index: i as u32,
                memory: Memory::from(mem::take(&mut t.buffer)),
                offset: 0,
                chunk_size,
                reply: wire.reply.clone(),
            });
        }
        for (i, op) in batch.drain(..).enumerate() {
            if i < whole {
                give_back(op, &mut message, &mut l.frames);
            } else {
                self.to_loop(wire, op);
            }
        }
        l.batch = batch;
        l.handoff.push_back(PendingWrite {
            id,
            seq,
            ticket,
            since,
            message,
            payloads_out: whole == 0,
            tensors_out: ops - whole.max(1),
            error: None,
            stand_ins: Vec::new(),
            completer: completer(),
        });
        l.outstanding += 1;
        Direct::Handed(id)
    }
}

impl WriteShare {
    /// Hands the rest of a write the writer began to the connection's write loop; if the loop
    /// has stopped, the op fails at once.
    fn to_loop(&self, wire: &Wire, op: OutOp) {
        if let Err(mpsc::error::SendError(op)) = wire.out.send(op) {
            op.fail(Error::Closed {
                reason: "connection already stopped".into(),
                origin: self.origin.clone(),
            });
        }
    }

    /// [`WriteShare::try_direct`]'s end for a message without tensors, its frame encoded: the
    /// same, with [`Parking::try_write_message`] in place of a batch of ops (no op is built, and
    /// no reply handle cloned, unless the loop has to write the rest of it).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn direct_message(
        &self,
        mut guard: std::sync::MutexGuard<'_, Ledger>,
        mut message: Message,
        frame: Vec<u8>,
        seq: u64,
        ticket: u64,
        bytes: u64,
        completer: impl FnOnce() -> Completer<WriteDone>,
    ) -> Direct {
        let l = &mut *guard;
        let Some(wire) = &l.wire else {
            // Checked by the caller: not reached.
            return_frame(&mut l.frames, frame);
            l.outstanding += 1;
            return Direct::ToPipe(message);
        };
        let since = self.metrics.start();
        let Some(whole) = wire
            .parking
            .try_write_message(ticket, &frame, &message.payloads)
        else {
            // Nothing went out: the pipe writes it (through its write loop).
            return_frame(&mut l.frames, frame);
            l.outstanding += 1;
            return Direct::ToPipe(message);
        };
        // Its bytes are on the stream: it takes its id, sequence number and ticket.
        let id = l.next_id;
        l.next_id += 1;
        l.next_seq += 1;
        l.out_ticket += 1;
        self.metrics.issued(OpKind::Write);
        if whole {
            return_frame(&mut l.frames, frame);
            l.written_by_caller += 1;
            drop(guard);
            self.metrics.finished(OpKind::Write, since, Ok(bytes));
            return Direct::Done(id, message);
        }
        // Written in part: the write loop writes the rest, and the pipe completes the write.
        let op = OutOp::Message {
            ticket,
            frame,
            payloads: mem::take(&mut message.payloads),
            reply: wire.reply.clone(),
        };
        self.to_loop(wire, op);
        l.handoff.push_back(PendingWrite {
            id,
            seq,
            ticket,
            since,
            message,
            payloads_out: true,
            tensors_out: 0,
            error: None,
            stand_ins: Vec::new(),
            completer: completer(),
        });
        l.outstanding += 1;
        Direct::Handed(id)
    }
}

/// A frame buffer back into the pool, which keeps at most 4.
fn return_frame(frames: &mut Vec<Vec<u8>>, frame: Vec<u8>) {
    if frames.len() < 4 {
        frames.push(frame);
    }
}

/// The reused `batch`, taken, holding the message's op: its frame and payloads.
pub(super) fn start_batch(
    batch: &mut Vec<OutOp>,
    ticket: u64,
    frame: Vec<u8>,
    message: &mut Message,
    reply: Reply,
) -> Vec<OutOp> {
    let mut batch = mem::take(batch);
    batch.clear();
    batch.push(OutOp::Message {
        ticket,
        frame,
        payloads: mem::take(&mut message.payloads),
        reply,
    });
    batch
}

/// A written op's buffers back into its message (and its frame into the pool): what
/// `Done::Wrote` / `Done::WroteTensor` would do, without building one and finding the write.
pub(super) fn give_back(op: OutOp, message: &mut Message, frames: &mut Vec<Vec<u8>>) {
    match op {
        OutOp::Message {
            frame, payloads, ..
        } => {
            return_frame(frames, frame);
            message.payloads = payloads;
        }
        OutOp::Tensor { index, memory, .. } => {
            message.tensors[index as usize].buffer = memory.into_buffer();
        }
    }
}

/// Bytes of channel data a tensor routed to channel `ch` takes in a descriptor (the receiver
/// counts them as metadata).
pub(super) fn channel_data_len(routes: &Routes, cpu_kind: ChannelKind, ch: usize) -> usize {
    let kind = routes.kind(ch).unwrap_or(cpu_kind);
    match kind {
        ChannelKind::Xth { .. } => 8,
        ChannelKind::Cma { .. } => crate::backend::cma::REMOTE_BUFFER_LEN,
        k if k.gives_length() => 8,
        #[cfg(feature = "cuda")]
        ChannelKind::CudaIpc { .. } => crate::backend::cuda_ipc::IPC_TENSOR_LEN,
        k if k.carries_cuda() => 8,
        _ => 0,
    }
}

/// The first of this side's [`Limits`] that `m` is over, with `channel_data` bytes of its
/// tensors' channel data counted as metadata.
pub(super) fn check_limits(
    l: &Limits,
    origin: &Origin,
    m: &Message,
    channel_data: usize,
) -> Result<(), Error> {
    // The first limit that is over, in this order; the error is only built for it.
    let over = |limit, value: u64, max: u64| (value > max).then_some((limit, value, max));
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
                + channel_data) as u64,
            l.max_metadata_size,
        )
    });
    match first {
        Some((limit, value, max)) => Err(Error::LimitExceeded {
            limit,
            value,
            max,
            origin: origin.clone(),
        }),
        None => Ok(()),
    }
}

/// A handle that writes to its pipe from the caller's own task; get one with [`GetWriter`].
///
/// [`PipeWriter::write`] writes a small self-contained message (payloads, and host tensors that
/// travel on the control stream in one chunk: every `basic` one, `cma`'s inline ones; at most
/// 16 KiB in all) into the connection at once when nothing of the pipe's is queued or in flight,
/// and returns its [`WriteDone`]: no mailbox hop in, none out, and the bytes leave before the
/// call returns. Any other write (a larger one, one behind others, one the stream cannot take
/// now, one over the limits, on a closing or failed pipe) goes to the pipe as a [`Write`] does,
/// and its `WriteDone` goes to the recipient. Order is kept either way: the pipe counts every
/// write handed to it from the moment the writer hands it over, and a writer writes only when
/// that count is 0, so no write overtakes one issued before it through the writer, or one the
/// pipe has already taken in.
///
/// A [`Write`] sent to the pipe's address is issued when the pipe handles it: one still in the
/// pipe's mailbox can be overtaken by a later direct write. Send every write whose order
/// matters through the writer (it takes a [`Write`], deadline included).
///
/// The handle is `Send + Sync` and cheap to clone (an `Arc` and an address). It works from any
/// thread: the pipe's write state is behind a lock that the pipe takes for its own writes too,
/// so a writer on another arbiter writes into the stream from its own thread. Like an address,
/// a writer keeps its pipe alive (the orphan check counts it).
#[derive(Clone)]
pub struct PipeWriter {
    share: Arc<WriteShare>,
    pipe: Addr<Pipe>,
}

impl std::fmt::Debug for PipeWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipeWriter").finish_non_exhaustive()
    }
}

impl PipeWriter {
    /// Writes `op.message`: at once if it can (see [`PipeWriter`]), returning its completion;
    /// otherwise through the pipe, which sends the completion to `to` (and `None` is
    /// returned). A deadline only applies to a write that goes through the pipe: one written
    /// here has completed.
    ///
    /// Completions are issued in order: a write that returns its `WriteDone` here had nothing
    /// before it pending. A `WriteDone` the pipe sent for an earlier write may still be in your
    /// mailbox, though; its `id` is lower.
    #[must_use = "a returned WriteDone holds the message's buffers"]
    pub fn write(&self, op: Write, to: &Arc<Recipient<WriteDone>>) -> Option<WriteDone> {
        let Write { message, deadline } = op;
        let message = match self
            .share
            .try_direct(message, || Completer::Shared(to.clone()))
        {
            Direct::Done(id, message) => {
                return Some(WriteDone {
                    id,
                    result: Ok(()),
                    message,
                    stand_ins: Vec::new(),
                })
            }
            Direct::Handed(id) => {
                if let Some(deadline) = deadline {
                    // The rest of it is on the connection: only its deadline goes to the pipe.
                    self.pipe.do_send(WatchWrite { id, deadline });
                }
                return None;
            }
            Direct::ToPipe(message) => message,
        };
        let handed = Handed {
            message,
            deadline,
            completer: Completer::Shared(to.clone()),
        };
        {
            let mut l = self.share.lock();
            if l.inside && l.in_mailbox == 0 {
                // The pipe takes it in before the code that called us returns.
                l.deferred.push(handed);
                return None;
            }
            l.in_mailbox += 1;
        }
        // `do_send` ignores the mailbox's capacity; it only fails once the actor is gone.
        match self.pipe.try_send(handed) {
            Ok(()) => None,
            Err(SendError::Full(handed)) => {
                self.pipe.do_send(handed);
                None
            }
            Err(SendError::Closed(handed)) => {
                self.share.lock().in_mailbox -= 1;
                Some(WriteDone {
                    id: u64::MAX,
                    result: Err(Error::Closed {
                        reason: "the pipe's actor has stopped".into(),
                        origin: self.share.origin.clone(),
                    }),
                    message: handed.message,
                    stand_ins: Vec::new(),
                })
            }
        }
    }

    /// The pipe this writer writes to.
    pub fn pipe(&self) -> &Addr<Pipe> {
        &self.pipe
    }
}
