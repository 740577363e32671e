//! The channel driver: what one channel backend does for one pipe, without the actor around it.
//!
//! The pipe hands each tensor that does not travel on its own connection to the channel's
//! actor (`actors/channel/`), which is generic: it owns a [`Core`] (the channel's lanes, the
//! pipe's completion queues, the tensors it holds) and one [`Driver`], the backend's data path,
//! which lives in the backend's folder (`src/backend/<name>/driver.rs`, or beside the backend's
//! hardware actor when it talks to one). The actor calls the driver for each hand-off, each
//! completion on the channel's own queues and each event the driver asked for, and stops once
//! the driver says that everything it held has gone back.
//!
//! A driver reaches the actor only through [`Effects`]: futures and streams whose items come
//! back as its own [`Driver::Event`], a timer, and a sender for callbacks on other threads (a
//! CUDA watcher). It never sees the actor system.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::error::{Error, Origin};
use crate::keymap::KeyMap;
use crate::transport::stream::{Carried, Done, InOp, Memory, OutOp, Reply};
use crate::wire::{self, Ack, Frame, FrameKind};

/// Send one tensor.
#[derive(Debug)]
pub(crate) struct SendTensor {
    pub seq: u64,
    pub index: u32,
    /// The sender's bytes, owned or shared (never a region).
    pub buffer: Memory,
}

/// Receive one tensor into `buffer`; `data` is the channel's bytes from the descriptor.
#[derive(Debug)]
pub(crate) struct RecvTensor {
    pub seq: u64,
    pub index: u32,
    pub buffer: Vec<u8>,
    pub data: Vec<u8>,
}

/// A connection of the channel's own, as a driver submits to it.
pub(crate) trait LaneIo {
    /// Submits a write; if the connection's loops are gone, it completes with an error at once.
    fn write(&self, op: OutOp);
    /// Submits a read, as [`Self::write`].
    fn read(&self, op: InOp);
    /// Ends the write side once the writes queued so far are out: the peer reads end-of-stream.
    fn close_writes(&mut self);
    /// Stops the connection: what is in progress is interrupted and every queued op fails.
    fn shutdown(&self);
}

/// A lane and the tickets of its next operations.
pub(crate) struct Lane {
    io: Box<dyn LaneIo>,
    out_ticket: u64,
    in_ticket: u64,
}

impl Lane {
    /// Submits the write `op` makes of the next write ticket.
    fn write(&mut self, op: impl FnOnce(u64) -> OutOp) {
        let ticket = self.out_ticket;
        self.out_ticket += 1;
        self.io.write(op(ticket));
    }

    /// Submits the read `op` makes of the next read ticket.
    fn read(&mut self, op: impl FnOnce(u64) -> InOp) {
        let ticket = self.in_ticket;
        self.in_ticket += 1;
        self.io.read(op(ticket));
    }
}

/// A tensor the channel holds while it moves.
pub(crate) struct Held {
    pub buffer: Memory,
    /// Operations still out (stripes for mpt).
    pub out: usize,
    pub error: Option<Error>,
    /// A sent cma tensor waiting for the receiver's acknowledgement.
    pub awaiting_ack: bool,
    /// `buffer` is a copy standing in for the tensor's own, which a provider still holds.
    pub stand_in: bool,
}

impl Held {
    /// A tensor with `out` operations over it.
    pub fn new(buffer: Memory, out: usize) -> Held {
        Held {
            buffer,
            out,
            error: None,
            awaiting_ack: false,
            stand_in: false,
        }
    }
}

/// A held tensor: direction (`true` when sending), message, tensor. Both directions of a pipe
/// number their messages from 0, so the direction is part of the key.
pub(crate) type HeldKey = (bool, u64, u32);

/// A whole tensor's completion for the pipe: sent (`key.0`) or received, with `result`.
pub(crate) fn tensor_done(key: HeldKey, memory: Memory, result: Result<(), Error>) -> Done {
    tensor_back(key, memory, result, false)
}

/// [`tensor_done`], saying whether `memory` is a copy standing in for the tensor's own.
pub(crate) fn tensor_back(
    key: HeldKey,
    memory: Memory,
    result: Result<(), Error>,
    stand_in: bool,
) -> Done {
    let (sending, seq, index) = key;
    if sending {
        Done::WroteTensor {
            seq,
            index,
            memory,
            result,
            stand_in,
        }
    } else {
        Done::Tensor {
            seq,
            index,
            memory,
            result,
            stand_in,
        }
    }
}

/// The tensor held at `key`, taken out as the pipe's completion, once nothing of it is out any
/// more.
pub(crate) fn released(held: &mut KeyMap<HeldKey, Held>, key: HeldKey) -> Option<Done> {
    if held.get(&key).is_none_or(|h| h.out != 0) {
        return None;
    }
    let h = held.remove(&key).expect("present");
    Some(tensor_back(
        key,
        h.buffer,
        h.error.map_or(Ok(()), Err),
        h.stand_in,
    ))
}

/// One operation over the tensor held at `key` ended with `result` (the first error stays).
pub(crate) fn piece_ended(
    held: &mut KeyMap<HeldKey, Held>,
    key: HeldKey,
    result: Result<(), Error>,
) {
    if let Some(h) = held.get_mut(&key) {
        h.out -= 1;
        if let Err(e) = result {
            h.error.get_or_insert(e);
        }
    }
}

/// Checks a received tensor's channel data against its buffer's length: the channels that move
/// tensors in place (`mpt`, `ibv`, `efa`) send the tensor's length, u64 LE.
pub(crate) fn check_length(
    data: &[u8],
    len: usize,
    channel: &str,
    origin: &Origin,
) -> Result<(), Error> {
    if data == (len as u64).to_le_bytes() {
        return Ok(());
    }
    Err(Error::protocol(
        format!("{channel} channel data {data:?} does not give the tensor's length {len}"),
        origin,
    ))
}

/// The error for an operation submitted to a lane whose loops are gone.
pub(crate) fn lane_gone() -> Error {
    Error::Closed {
        reason: "the channel's connection already stopped".into(),
        origin: Origin::default(),
    }
}

/// The lane carrying a channel's acknowledgements (cma, cuda_ipc: each side's, for the other's
/// sends).
pub(crate) const ACKS: usize = 0;

/// A queue made on first use: a tokio queue allocates its first block of 32 slots up front, and
/// most channels never need some of theirs. Whoever polls the receiving end takes it once it
/// exists ([`Self::take_rx`]).
pub(crate) struct LazyQueue<T> {
    tx: Option<mpsc::UnboundedSender<T>>,
    rx: Option<mpsc::UnboundedReceiver<T>>,
}

impl<T> Default for LazyQueue<T> {
    fn default() -> Self {
        LazyQueue { tx: None, rx: None }
    }
}

impl<T> LazyQueue<T> {
    /// A sender into the queue, which this call makes if it is the first.
    pub fn sender(&mut self) -> mpsc::UnboundedSender<T> {
        let rx = &mut self.rx;
        self.tx
            .get_or_insert_with(|| {
                let (tx, r) = mpsc::unbounded_channel();
                *rx = Some(r);
                tx
            })
            .clone()
    }

    /// The receiving end, once, after [`Self::sender`] made the queue.
    pub fn take_rx(&mut self) -> Option<mpsc::UnboundedReceiver<T>> {
        self.rx.take()
    }
}

/// What every channel of a pipe has, whatever its backend: its lanes, the pipe's completion
/// queues, its own completion queue, and the tensors it holds.
pub(crate) struct Core {
    pub lanes: Vec<Lane>,
    reply: Reply,
    /// The channel's own completion queue (lanes, xth's table). Most pipes never need it (cma
    /// sends small tensors inline on the pipe's connection).
    own: LazyQueue<Done>,
    pub origin: Origin,
    pub held: KeyMap<HeldKey, Held>,
    /// Whether a read of an acknowledgement is posted on [`ACKS`].
    pub ack_armed: bool,
    /// Whether the channel is stopping (it stops once its driver is drained).
    pub stopping: bool,
    /// The pipe's count of fallbacks (cma's refused reads).
    pub fallbacks: Arc<AtomicU64>,
    /// Where CUDA completions go: the pipe's CUDA queue.
    #[cfg(feature = "cuda")]
    cuda_reply: Option<cuda::CudaReply>,
    /// The channel's own CUDA completion queue (the rendezvous's callbacks).
    #[cfg(feature = "cuda")]
    cuda_own: LazyQueue<cuda::CudaDone>,
}

impl Core {
    /// A channel's core over `lanes`, completing to `reply` (and CUDA tensors to `cuda`).
    pub(crate) fn new(
        lanes: Vec<Box<dyn LaneIo>>,
        reply: Reply,
        origin: Origin,
        fallbacks: Arc<AtomicU64>,
        #[cfg(feature = "cuda")] cuda: Option<cuda::CudaReply>,
    ) -> Core {
        Core {
            lanes: lanes
                .into_iter()
                .map(|io| Lane {
                    io,
                    out_ticket: 0,
                    in_ticket: 0,
                })
                .collect(),
            reply,
            own: LazyQueue::default(),
            origin,
            held: KeyMap::default(),
            ack_armed: false,
            stopping: false,
            fallbacks,
            #[cfg(feature = "cuda")]
            cuda_reply: cuda,
            #[cfg(feature = "cuda")]
            cuda_own: LazyQueue::default(),
        }
    }

    /// A sender into the channel's own completion queue, made on first use (the actor polls it
    /// after the call that made it: [`Self::take_own_rx`]).
    pub fn own(&mut self) -> Reply {
        self.own.sender()
    }

    /// The own queue's receiving end, once, after [`Self::own`] made it.
    pub(crate) fn take_own_rx(&mut self) -> Option<mpsc::UnboundedReceiver<Done>> {
        self.own.take_rx()
    }

    /// Reads the next frame on lane `lane`; its end comes on the own queue.
    pub fn lane_read_frame(&mut self, lane: usize) {
        let reply = self.own();
        self.lanes[lane].read(|ticket| InOp::Frame {
            ticket,
            reply,
            more: 0,
            carried: Carried::Nothing,
            catch: None,
        });
    }

    /// Queues a piece of a tensor on lane `lane`: written from `memory` as chunk frames of up to
    /// `chunk_size` bytes (`sending`), or read into it; `offset` is where it starts in the
    /// tensor. Its end comes on the own queue.
    #[allow(clippy::too_many_arguments)]
    pub fn lane_tensor(
        &mut self,
        lane: usize,
        sending: bool,
        seq: u64,
        index: u32,
        memory: Memory,
        offset: u64,
        chunk_size: usize,
    ) {
        let reply = self.own();
        let l = &mut self.lanes[lane];
        if sending {
            l.write(|ticket| OutOp::Tensor {
                ticket,
                seq,
                index,
                memory,
                offset,
                chunk_size,
                reply,
            });
        } else {
            l.read(|ticket| InOp::Tensor {
                ticket,
                seq,
                index,
                memory,
                offset,
                reply,
            });
        }
    }

    /// Writes an acknowledgement frame, followed by `payloads`' bytes, on lane `lane`.
    pub fn lane_write_ack(
        &mut self,
        lane: usize,
        ack: Ack,
        payloads: Vec<crate::message::Payload>,
    ) {
        let reply = self.own();
        let mut frame = Vec::with_capacity(24);
        wire::encode_frame(&mut frame, FrameKind::Ack, |b| wire::encode_ack(b, &ack));
        self.lanes[lane].write(|ticket| OutOp::Message {
            ticket,
            frame,
            payloads,
            reply,
        });
    }

    /// Stops every lane.
    pub fn shutdown_lanes(&self) {
        for l in &self.lanes {
            l.io.shutdown();
        }
    }

    /// Ends the write side of lane `lane` (see [`LaneIo::close_writes`]).
    pub fn close_lane_writes(&mut self, lane: usize) {
        if let Some(l) = self.lanes.get_mut(lane) {
            l.io.close_writes();
        }
    }

    /// Checks a received tensor's channel data against its buffer (see [`check_length`]).
    pub fn check_length(&self, m: &RecvTensor, channel: &str) -> Result<(), Error> {
        check_length(&m.data, m.buffer.len(), channel, &self.origin)
    }

    /// A completion for the pipe.
    pub fn to_pipe(&self, d: Done) {
        let _ = self.reply.send(d);
    }

    /// Hands a whole tensor back to the pipe: sent (`sending`) or received, with `r`.
    pub fn hand_back(
        &self,
        sending: bool,
        seq: u64,
        index: u32,
        memory: Memory,
        r: Result<(), Error>,
    ) {
        self.to_pipe(tensor_done((sending, seq, index), memory, r));
    }

    /// The error for a tensor this channel does not move (a bug in the pipe's routing).
    pub fn misrouted(&self) -> Error {
        Error::protocol(
            "internal: a tensor reached a channel that does not move it",
            &self.origin,
        )
    }

    /// Holds a tensor's buffer while `out` operations over it run, then hands it back (now, if
    /// there are none).
    pub fn hold(&mut self, key: HeldKey, buffer: Memory, out: usize) {
        self.held.insert(key, Held::new(buffer, out));
        self.release(key);
    }

    /// Hands a held tensor back to the pipe once nothing of it is out any more.
    pub fn release(&mut self, key: HeldKey) {
        if let Some(d) = released(&mut self.held, key) {
            self.to_pipe(d);
        }
    }

    /// One operation over the tensor held at `key` ended with `result` (the first error stays);
    /// the tensor goes back with its last.
    pub fn piece_done(&mut self, key: HeldKey, result: Result<(), Error>) {
        piece_ended(&mut self.held, key, result);
        self.release(key);
    }

    /// Counts a lane's completion of a piece of a held tensor (a stripe, a fallback transfer)
    /// against it; any other completion comes back.
    pub fn count_piece(&mut self, d: Done) -> Option<Done> {
        match d {
            Done::WroteTensor {
                seq, index, result, ..
            } => self.piece_done((true, seq, index), result),
            Done::Tensor {
                seq, index, result, ..
            } => self.piece_done((false, seq, index), result),
            other => return Some(other),
        }
        None
    }

    /// The acknowledgement a frame read on [`ACKS`] brought (the read is no longer posted), or
    /// why none came; `channel` names it in the error.
    pub fn ack_of(&mut self, result: Result<Frame, Error>, channel: &str) -> Result<Ack, Error> {
        self.ack_armed = false;
        match result? {
            Frame::Ack(a) => Ok(a),
            f => Err(crate::transport::stream::unexpected(
                f,
                &format!("a {channel} acknowledgement"),
                &self.origin,
            )),
        }
    }

    /// Reads `buffers`' bytes on lane `lane`; the end comes on the own queue.
    #[cfg_attr(not(feature = "efa"), allow(dead_code))]
    pub fn lane_read_payloads(&mut self, lane: usize, buffers: Vec<Vec<u8>>) {
        let reply = self.own();
        self.lanes[lane].read(|ticket| InOp::Payloads {
            ticket,
            buffers,
            reply,
        });
    }

    /// The acknowledgement connection failed: sent tensors waiting for an ack fail (nothing
    /// else is touched: stripes and fallback transfers complete through their own operations).
    pub fn fail_held(&mut self, e: Error) {
        let waiting: Vec<_> = self
            .held
            .iter()
            .filter(|(_, h)| h.awaiting_ack)
            .map(|(k, _)| *k)
            .collect();
        for k in waiting {
            if let Some(h) = self.held.get_mut(&k) {
                h.awaiting_ack = false;
                h.out -= 1;
                h.error.get_or_insert(e.clone());
            }
            self.release(k);
        }
    }

    /// Posts a read of the next acknowledgement on [`ACKS`], unless one is posted.
    pub fn arm_ack(&mut self) {
        if self.ack_armed || self.lanes.is_empty() {
            return;
        }
        self.ack_armed = true;
        self.lane_read_frame(ACKS);
    }

    /// Writes an acknowledgement on [`ACKS`].
    pub fn send_ack(&mut self, ack: Ack) {
        if self.lanes.get(ACKS).is_none() {
            return;
        }
        self.lane_write_ack(ACKS, ack, Vec::new());
    }

    /// The error for a stopping channel's pending operations.
    pub fn stopping_error(&self) -> Error {
        Error::Closed {
            reason: "channel stopping".into(),
            origin: self.origin.clone(),
        }
    }
}

/// A future or stream a driver hands to its actor; its output comes back as an event.
pub(crate) type LocalFuture<E> = Pin<Box<dyn Future<Output = E>>>;
/// See [`LocalFuture`].
// Some effects serve only the backends of some features.
#[cfg_attr(
    not(all(feature = "cuda", feature = "ibv", feature = "efa")),
    allow(dead_code)
)]
pub(crate) type LocalStream<E> = Pin<Box<dyn futures_core::Stream<Item = E>>>;

// Some effects serve only the backends of some features.
#[cfg_attr(
    not(all(feature = "cuda", feature = "ibv", feature = "efa")),
    allow(dead_code)
)]
/// What a driver may ask of the actor that runs it. Every item comes back through
/// [`Driver::on_event`], on the actor's thread.
pub(crate) trait Effects<E> {
    /// Runs `f` on the actor's thread; its output is an event. Dropped if the actor stops.
    fn spawn(&mut self, f: LocalFuture<E>);
    /// Polls `s` on the actor's thread; each item is an event. Ends with the actor, or with
    /// [`Self::cancel_watches`].
    fn watch(&mut self, s: LocalStream<E>);
    /// Drops every stream [`Self::watch`] polls.
    fn cancel_watches(&mut self);
    /// `e` comes back after `after`.
    fn later(&mut self, after: Duration, e: E);
    /// A sender of events from any thread (a CUDA watcher callback).
    fn sender(&mut self) -> mpsc::UnboundedSender<E>;
}

/// What a driver's calls get: the channel's core and the actor's effects.
pub(crate) struct Cx<'a, E> {
    pub core: &'a mut Core,
    pub fx: &'a mut dyn Effects<E>,
}

/// One channel backend's data path, driven by the generic channel actor. Every method may be
/// called only on the actor's thread. A method that cannot serve a hand-off fails it (the
/// tensor goes back to the pipe with the error): no buffer is ever dropped.
pub(crate) trait Driver: Sized + Unpin + 'static {
    /// What comes back from [`Effects`].
    type Event: 'static;

    /// The actor has started.
    fn start(&mut self, cx: &mut Cx<'_, Self::Event>) {
        let _ = cx;
    }

    /// A CPU tensor to send.
    fn send(&mut self, m: SendTensor, cx: &mut Cx<'_, Self::Event>) {
        let e = cx.core.misrouted();
        cx.core.hand_back(true, m.seq, m.index, m.buffer, Err(e));
    }

    /// A CPU tensor to receive.
    fn recv(&mut self, m: RecvTensor, cx: &mut Cx<'_, Self::Event>) {
        let e = cx.core.misrouted();
        cx.core
            .hand_back(false, m.seq, m.index, Memory::Owned(m.buffer), Err(e));
    }

    /// A CUDA-routed tensor to send.
    #[cfg(feature = "cuda")]
    fn send_cuda(&mut self, m: cuda::SendCuda, cx: &mut Cx<'_, Self::Event>) {
        let e = cx.core.not_cuda();
        cx.core
            .cuda_to_pipe(cuda::CudaDone::wrote(m.seq, m.index, m.buffer, Err(e)));
    }

    /// A CUDA-routed tensor to receive.
    #[cfg(feature = "cuda")]
    fn recv_cuda(&mut self, m: cuda::RecvCuda, cx: &mut Cx<'_, Self::Event>) {
        let e = cx.core.not_cuda();
        cx.core
            .cuda_to_pipe(cuda::CudaDone::landed(m.seq, m.index, m.buffer, Err(e)));
    }

    /// A completion on the channel's own queue (its lanes' operations, xth's table).
    fn on_done(&mut self, d: Done, cx: &mut Cx<'_, Self::Event>) {
        let _ = cx;
        tracing::error!(?d, "a completion on a channel that posts none");
    }

    /// A completion on the channel's own CUDA queue: on to the pipe.
    #[cfg(feature = "cuda")]
    fn on_cuda(&mut self, d: cuda::CudaDone, cx: &mut Cx<'_, Self::Event>) {
        cx.core.cuda_to_pipe(d);
    }

    /// An event the driver asked for.
    fn on_event(&mut self, e: Self::Event, cx: &mut Cx<'_, Self::Event>) {
        let _ = (e, cx);
    }

    /// The pipe is closing: fail or finish what is out ([`Core::stopping`] is set).
    fn stop(&mut self, e: Error, cx: &mut Cx<'_, Self::Event>) {
        cx.core.shutdown_lanes();
        cx.core.fail_held(e);
    }

    /// Whether everything the channel held has gone back (asked while stopping, after every
    /// call): the actor then stops.
    fn drained(&mut self, cx: &mut Cx<'_, Self::Event>) -> bool {
        cx.core.held.is_empty()
    }

    /// The actor is going away with operations possibly still out (the system stopping): keep
    /// (leak) whatever memory the hardware may still touch.
    fn forget(&mut self, core: &mut Core) {
        let _ = core;
    }
}

/// The `basic` channel's driver: the pipe moves every basic tensor on its own connection, so
/// its channel actor has nothing to do.
#[derive(Debug, Default)]
pub(crate) struct Idle;

impl Driver for Idle {
    type Event = ();
}

#[cfg(all(feature = "cuda", feature = "ibv"))]
pub(crate) use cuda::CudaReply;
#[cfg(feature = "cuda")]
pub(crate) use cuda::{post, post_when_done, CudaDone, RecvCuda, SendCuda};

/// The CUDA channels' hand-offs and completions (feature `cuda`).
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use std::sync::{Arc, Mutex};

    use tokio::sync::mpsc;

    use super::Core;
    use crate::cuda::{CudaStream, Event};
    use crate::error::Error;
    use crate::message::Buffer;

    /// The completion of one CUDA-routed tensor, for the pipe.
    #[derive(Debug)]
    pub(crate) enum CudaDone {
        /// A sent tensor's buffer is free again (or the send failed).
        Wrote {
            seq: u64,
            index: u32,
            buffer: Buffer,
            result: Result<(), Error>,
        },
        /// A received tensor's copy is enqueued (with the event recorded after it and the
        /// stream it runs on) or has landed (no event), or the receive failed.
        Read {
            seq: u64,
            index: u32,
            buffer: Buffer,
            event: Option<(Event, Arc<CudaStream>)>,
            result: Result<(), Error>,
        },
    }

    /// Where CUDA completions go.
    pub(crate) type CudaReply = mpsc::UnboundedSender<CudaDone>;

    /// Send one CUDA-routed tensor (its buffer may be host memory: the cpu->cuda pair).
    #[derive(Debug)]
    pub(crate) struct SendCuda {
        pub seq: u64,
        pub index: u32,
        pub buffer: Buffer,
        /// For `cuda_ipc`: what the pipe exported for the descriptor (`None` for an empty
        /// tensor).
        pub ipc: Option<crate::backend::cuda_ipc::Outgoing>,
    }

    /// Receive one CUDA-routed tensor into `buffer`; `data` is the channel's bytes from the
    /// descriptor.
    #[derive(Debug)]
    pub(crate) struct RecvCuda {
        pub seq: u64,
        pub index: u32,
        pub buffer: Buffer,
        pub data: Vec<u8>,
        /// Complete only once the data has landed.
        pub data_complete: bool,
    }

    /// Posts a completion from wherever it happens (the device's watcher thread included). A
    /// watcher callback must not call the CUDA API, and dropping a buffer can (`cuMemFree`):
    /// if nobody takes the completion any more, it is dropped on a thread of its own.
    pub(crate) fn post(tx: &CudaReply, d: CudaDone) {
        if let Err(mpsc::error::SendError(d)) = tx.send(d) {
            std::thread::spawn(move || drop(d));
        }
    }

    /// Posts `d` once the work queued on `stream` so far has run (a watcher callback queued
    /// after it); if the function cannot be queued, posts `d` at once with that error instead.
    pub(crate) fn post_when_done(stream: &CudaStream, tx: &CudaReply, d: CudaDone) {
        let slot = Arc::new(Mutex::new(Some(d)));
        let (in_fn, later) = (slot.clone(), tx.clone());
        let queued = crate::cuda::on_stream_done(stream, move || {
            if let Some(d) = in_fn.lock().unwrap_or_else(|p| p.into_inner()).take() {
                post(&later, d)
            }
        });
        if let Err(e) = queued {
            if let Some(d) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                post(tx, d.failed(e))
            }
        }
    }

    impl CudaDone {
        /// A sent tensor's completion.
        pub(crate) fn wrote(
            seq: u64,
            index: u32,
            buffer: Buffer,
            result: Result<(), Error>,
        ) -> Self {
            CudaDone::Wrote {
                seq,
                index,
                buffer,
                result,
            }
        }

        /// A received tensor's completion, with the event its copies were recorded in (if any).
        pub(crate) fn read(
            seq: u64,
            index: u32,
            buffer: Buffer,
            event: Option<(Event, Arc<CudaStream>)>,
            result: Result<(), Error>,
        ) -> Self {
            CudaDone::Read {
                seq,
                index,
                buffer,
                event,
                result,
            }
        }

        /// A received tensor's completion with nothing to wait on (landed, or failed).
        pub(crate) fn landed(
            seq: u64,
            index: u32,
            buffer: Buffer,
            result: Result<(), Error>,
        ) -> Self {
            CudaDone::Read {
                seq,
                index,
                buffer,
                event: None,
                result,
            }
        }

        /// The same completion, failed with `e` (no event to wait on).
        pub(crate) fn failed(self, e: Error) -> Self {
            match self {
                CudaDone::Wrote {
                    seq, index, buffer, ..
                } => CudaDone::wrote(seq, index, buffer, Err(e)),
                CudaDone::Read {
                    seq, index, buffer, ..
                } => CudaDone::landed(seq, index, buffer, Err(e)),
            }
        }

        /// (sending, seq, index).
        pub(crate) fn key(&self) -> (bool, u64, u32) {
            match self {
                CudaDone::Wrote { seq, index, .. } => (true, *seq, *index),
                CudaDone::Read { seq, index, .. } => (false, *seq, *index),
            }
        }
    }

    impl Core {
        /// A sender into the channel's own CUDA completion queue, made on first use (the actor
        /// polls it after the call that made it: [`Self::take_cuda_rx`]).
        pub fn own_cuda(&mut self) -> CudaReply {
            self.cuda_own.sender()
        }

        /// The own CUDA queue's receiving end, once, after [`Self::own_cuda`] made it.
        pub(crate) fn take_cuda_rx(&mut self) -> Option<mpsc::UnboundedReceiver<CudaDone>> {
            self.cuda_own.take_rx()
        }

        /// The pipe's CUDA completion queue.
        pub fn cuda_reply(&self) -> Option<&CudaReply> {
            self.cuda_reply.as_ref()
        }

        /// A CUDA completion for the pipe.
        pub fn cuda_to_pipe(&self, d: CudaDone) {
            match &self.cuda_reply {
                Some(tx) => post(tx, d),
                None => tracing::error!("a CUDA completion with no pipe queue to go to"),
            }
        }

        /// The error for a CUDA-routed tensor that reached a channel of another kind.
        pub fn not_cuda(&self) -> Error {
            Error::protocol(
                "internal: a CUDA-routed tensor reached a channel that does not carry CUDA tensors",
                &self.origin,
            )
        }
    }
}
