//! The `Channel` actor: owns one negotiated channel of one pipe and moves its tensors.
//!
//! - `basic` (and `cma`'s inline tensors): chunks over the pipe's control connection, at the
//!   tickets the pipe reserved, so they land exactly where the pipe ordered them. The pipe
//!   queues these on its connection itself and gets their completions directly: they never
//!   reach this actor, which for `basic` has nothing to do.
//! - `xth`: one copy through the process-wide table of [`crate::backend::xth`].
//! - `cma`: the receiver reads the sender's memory with `process_vm_readv` (on a blocking thread)
//!   and acknowledges on the channel's side connection; the sender hands the buffer back on the
//!   ack. If the read is refused at run time (EPERM, ENOSYS: ptrace rules, seccomp), the receiver
//!   asks for the bytes instead and the sender streams them over the side connection: the pipe
//!   lives on and the fallback is counted and logged.
//! - `mpt`: each tensor is split in stripes, one per lane connection, read in place.
//! - `efa` (feature `efa`): tagged sends and receives on the context's libfabric endpoint,
//!   straight from the sender's buffer into the receiver's; the lane serves the set-up and
//!   tells when the peer is gone. This actor sets up the channel's data path and fails it; the
//!   pipe posts the tensors and reads their ends on that path itself (`efa::Path`).
//!
//! For `xth`, `cma` and `mpt`, completions come back here first (the channel tracks what it
//! holds and must hand every buffer back even when stopped), then go on to the pipe; the `efa`
//! path holds its tensors the same way, for the pipe. A stopping channel stays alive until
//! every buffer it holds has gone back.

use crate::keymap::KeyMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::connection::{Connection, Link, Shutdown};
use crate::error::{Error, Origin};
use crate::transport::stream::{Carried, Done, InOp, Memory, OutOp, Region, Reply};
use crate::wire::{self, Ack, Frame, FrameKind};

/// A queue of events, as a stream an actor polls.
pub(crate) struct Queue<T>(pub mpsc::UnboundedReceiver<T>);

impl<T> futures_core::Stream for Queue<T> {
    type Item = T;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

/// A lane: a connection of the channel's own.
struct Lane {
    conn: Addr<Connection>,
    link: Link,
    out_ticket: u64,
    in_ticket: u64,
}

/// A tensor the channel holds while it moves.
struct Held {
    buffer: Memory,
    /// Operations still out (stripes for mpt).
    out: usize,
    error: Option<Error>,
    /// A sent cma tensor waiting for the receiver's acknowledgement.
    awaiting_ack: bool,
}

/// A held tensor: direction (`true` when sending), message, tensor. Both directions of a pipe
/// number their messages from 0, so the direction is part of the key.
type HeldKey = (bool, u64, u32);

impl Held {
    /// A tensor with `out` operations over it.
    fn new(buffer: Memory, out: usize) -> Held {
        Held {
            buffer,
            out,
            error: None,
            awaiting_ack: false,
        }
    }
}

/// A whole tensor's completion for the pipe: sent (`key.0`) or received, with `result`.
fn tensor_done(key: HeldKey, memory: Memory, result: Result<(), Error>) -> Done {
    let (sending, seq, index) = key;
    if sending {
        Done::WroteTensor {
            seq,
            index,
            memory,
            result,
        }
    } else {
        Done::Tensor {
            seq,
            index,
            memory,
            result,
        }
    }
}

/// The tensor held at `key`, taken out as the pipe's completion, once nothing of it is out any
/// more.
fn released(held: &mut KeyMap<HeldKey, Held>, key: HeldKey) -> Option<Done> {
    if held.get(&key).is_none_or(|h| h.out != 0) {
        return None;
    }
    let h = held.remove(&key).expect("present");
    Some(tensor_done(key, h.buffer, h.error.map_or(Ok(()), Err)))
}

/// One operation over the tensor held at `key` ended with `result` (the first error stays).
fn piece_ended(held: &mut KeyMap<HeldKey, Held>, key: HeldKey, result: Result<(), Error>) {
    if let Some(h) = held.get_mut(&key) {
        h.out -= 1;
        if let Err(e) = result {
            h.error.get_or_insert(e);
        }
    }
}

/// Checks a received tensor's channel data against its buffer's length: the channels that move
/// tensors in place (`mpt`, `ibv`, `efa`) send the tensor's length, u64 LE.
fn check_length(data: &[u8], len: usize, channel: &str, origin: &Origin) -> Result<(), Error> {
    if data == (len as u64).to_le_bytes() {
        return Ok(());
    }
    Err(Error::protocol(
        format!("{channel} channel data {data:?} does not give the tensor's length {len}"),
        origin,
    ))
}

/// One negotiated channel of one pipe.
pub struct Channel {
    kind: ChannelKind,
    lanes: Vec<Lane>,
    reply: Reply,
    /// The channel's own completion queue (cma's side connections, mpt's lanes, xth's table).
    /// Made on first use: a tokio queue allocates its first block of 32 slots up front, and
    /// most pipes never need it (cma sends small tensors inline on the pipe's connection).
    own: Option<Reply>,
    /// The receiving end of `own`, until a handler hands it to the actor's context.
    own_rx: Option<mpsc::UnboundedReceiver<Done>>,
    origin: Origin,
    held: KeyMap<HeldKey, Held>,
    /// Parked xth tensors, with their direction (`true` when sending).
    xth_keys: Vec<(bool, crate::backend::xth::Key)>,
    ack_armed: bool,
    /// Where CUDA completions go: the pipe's CUDA queue.
    #[cfg(feature = "cuda")]
    cuda_reply: Option<CudaReply>,
    /// The channel's own CUDA completion queue (the rendezvous's callbacks), made on first use.
    #[cfg(feature = "cuda")]
    cuda_own: Option<CudaReply>,
    #[cfg(feature = "cuda")]
    cuda_rx: Option<mpsc::UnboundedReceiver<CudaDone>>,
    /// Parked CUDA tensors, with their direction (`true` when sending).
    #[cfg(feature = "cuda")]
    cuda_keys: Vec<(bool, crate::backend::cuda_xth::Key)>,
    /// The `cuda_ipc` channel's state.
    #[cfg(feature = "cuda")]
    ipc: Option<cuda_ipc::IpcSide>,
    /// The `cuda_basic` channel's state, made on first use.
    #[cfg(feature = "cuda")]
    cuda_basic: Option<cuda_basic::BasicSide>,
    /// cma reads running on blocking threads.
    reading: usize,
    stopping: bool,
    fallbacks: Arc<AtomicU64>,
    /// The ibv channel's queue pair (the `ibv` and `cuda_gdr` channels).
    #[cfg(feature = "ibv")]
    ibv: Option<ibv::IbvSide>,
    /// The `cuda_gdr` channel's CUDA state around that queue pair.
    #[cfg(all(feature = "cuda", feature = "ibv"))]
    gdr: Option<cuda_gdr::GdrSide>,
    /// The `efa` channel's state.
    #[cfg(feature = "efa")]
    fabric: Option<efa::EfaSide>,
}

/// Send one tensor.
#[derive(Debug)]
pub(crate) struct SendTensor {
    pub seq: u64,
    pub index: u32,
    /// The sender's bytes, owned or shared (never a region).
    pub buffer: Memory,
}

impl Message for SendTensor {
    type Result = ();
}

/// Receive one tensor into `buffer`; `data` is the channel's bytes from the descriptor.
#[derive(Debug)]
pub(crate) struct RecvTensor {
    pub seq: u64,
    pub index: u32,
    pub buffer: Vec<u8>,
    pub data: Vec<u8>,
}

impl Message for RecvTensor {
    type Result = ();
}

/// Stop once every buffer held has gone back to the pipe.
#[derive(Debug)]
pub(crate) struct StopChannel;

impl Message for StopChannel {
    type Result = ();
}

impl Channel {
    pub(crate) fn new(
        kind: ChannelKind,
        lanes: Vec<(Addr<Connection>, Link)>,
        reply: Reply,
        origin: Origin,
        fallbacks: Arc<AtomicU64>,
    ) -> Self {
        Channel {
            kind,
            lanes: lanes
                .into_iter()
                .map(|(conn, link)| Lane {
                    conn,
                    link,
                    out_ticket: 0,
                    in_ticket: 0,
                })
                .collect(),
            reply,
            own: None,
            own_rx: None,
            origin,
            held: KeyMap::default(),
            xth_keys: Vec::new(),
            ack_armed: false,
            #[cfg(feature = "cuda")]
            cuda_reply: None,
            #[cfg(feature = "cuda")]
            cuda_own: None,
            #[cfg(feature = "cuda")]
            cuda_rx: None,
            #[cfg(feature = "cuda")]
            cuda_keys: Vec::new(),
            #[cfg(feature = "cuda")]
            ipc: None,
            #[cfg(feature = "cuda")]
            cuda_basic: None,
            reading: 0,
            stopping: false,
            fallbacks,
            #[cfg(feature = "ibv")]
            ibv: None,
            #[cfg(all(feature = "cuda", feature = "ibv"))]
            gdr: None,
            #[cfg(feature = "efa")]
            fabric: None,
        }
    }

    /// Gives an `efa` channel its endpoint (before it starts), and returns the data path the
    /// pipe shares with it ([`efa::Path`]: the pipe hands it tensors and reads its ends).
    #[cfg(feature = "efa")]
    pub(crate) fn with_fabric(
        mut self,
        port: crate::backend::efa::channel::ChannelPort,
    ) -> (Self, efa::SharedPath) {
        let (path, grants) = efa::Path::new(port, self.reply.clone(), self.origin.clone());
        self.fabric = Some(efa::EfaSide::new(path.clone(), grants));
        (self, path)
    }

    /// Sends the completions of CUDA-routed tensors to `reply` (the pipe's CUDA queue).
    #[cfg(feature = "cuda")]
    pub(crate) fn with_cuda(mut self, reply: CudaReply) -> Self {
        self.cuda_reply = Some(reply);
        self
    }

    /// The ibv channel's queue pair, bootstrapped over `lanes` once the actor starts.
    #[cfg(feature = "ibv")]
    pub(crate) fn with_ibv(
        mut self,
        backend: &crate::backend::ibv::channel::IbvChannel,
        lanes: Vec<crate::handshake::Halves>,
    ) -> Self {
        self.ibv = Some(ibv::IbvSide::new(backend, lanes, &self.origin));
        self
    }

    /// Makes an ibv queue pair (see [`Self::with_ibv`]) carry CUDA tensors: `cuda_gdr`.
    #[cfg(all(feature = "cuda", feature = "ibv"))]
    pub(crate) fn with_gdr(mut self) -> Self {
        self.gdr = Some(cuda_gdr::GdrSide::new());
        if let Some(side) = self.ibv.as_mut() {
            side.place_gpus();
        }
        self
    }

    /// A sender into the channel's own completion queue, made on first use. The handler that
    /// makes it hands the receiving end to the actor's context before returning
    /// ([`Self::poll_own`]).
    fn own(&mut self) -> Reply {
        let rx = &mut self.own_rx;
        self.own
            .get_or_insert_with(|| {
                let (tx, r) = mpsc::unbounded_channel();
                *rx = Some(r);
                tx
            })
            .clone()
    }

    /// Starts polling the own completion queue if the handler that just ran made it. Every
    /// handler that can call [`Self::own`] ends with this.
    fn poll_own(&mut self, ctx: &mut Context<Self>) {
        if let Some(rx) = self.own_rx.take() {
            ctx.add_stream(Queue(rx));
        }
        #[cfg(feature = "cuda")]
        if let Some(rx) = self.cuda_rx.take() {
            ctx.add_stream(Queue(rx));
        }
    }

    /// Reads the next frame on lane `lane`; its end comes on the own queue.
    fn lane_read_frame(&mut self, lane: usize) {
        let reply = self.own();
        let l = &mut self.lanes[lane];
        let ticket = l.in_ticket;
        l.in_ticket += 1;
        l.link.read(
            InOp::Frame {
                ticket,
                reply,
                more: 0,
                carried: Carried::Nothing,
                catch: None,
            },
            lane_gone,
        );
    }

    /// Queues a piece of a tensor on lane `lane`: written from `memory` as chunk frames of up to
    /// `chunk_size` bytes (`sending`), or read into it; `offset` is where it starts in the
    /// tensor. Its end comes on the own queue.
    #[allow(clippy::too_many_arguments)]
    fn lane_tensor(
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
        let origin = &self.origin;
        let l = &mut self.lanes[lane];
        let gone = || Error::Closed {
            reason: "lane already stopped".into(),
            origin: origin.clone(),
        };
        if sending {
            let ticket = l.out_ticket;
            l.out_ticket += 1;
            let op = OutOp::Tensor {
                ticket,
                seq,
                index,
                memory,
                offset,
                chunk_size,
                reply,
            };
            l.link.write(op, gone);
        } else {
            let ticket = l.in_ticket;
            l.in_ticket += 1;
            let op = InOp::Tensor {
                ticket,
                seq,
                index,
                memory,
                offset,
                reply,
            };
            l.link.read(op, gone);
        }
    }

    /// Writes an acknowledgement frame, followed by `payloads`' bytes, on lane `lane`.
    fn lane_write_ack(&mut self, lane: usize, ack: Ack, payloads: Vec<crate::message::Payload>) {
        let reply = self.own();
        let l = &mut self.lanes[lane];
        let mut frame = Vec::with_capacity(24);
        wire::encode_frame(&mut frame, FrameKind::Ack, |b| wire::encode_ack(b, &ack));
        let ticket = l.out_ticket;
        l.out_ticket += 1;
        l.link.write(
            OutOp::Message {
                ticket,
                frame,
                payloads,
                reply,
            },
            lane_gone,
        );
    }

    /// Checks a received tensor's channel data against its buffer: the channels that move
    /// tensors in place (`mpt`, `ibv`, `efa`) send the tensor's length, u64 LE.
    fn check_length(&self, m: &RecvTensor, channel: &str) -> Result<(), Error> {
        check_length(&m.data, m.buffer.len(), channel, &self.origin)
    }

    /// Hands a whole tensor back to the pipe: sent (`sending`) or received, with `r`.
    fn hand_back(&self, sending: bool, seq: u64, index: u32, memory: Memory, r: Result<(), Error>) {
        self.to_pipe(tensor_done((sending, seq, index), memory, r));
    }

    /// Holds a tensor's buffer while `out` operations over it run, then hands it back (now, if
    /// there are none).
    fn hold(&mut self, key: HeldKey, buffer: Memory, out: usize) {
        self.held.insert(key, Held::new(buffer, out));
        self.release(key);
    }

    fn to_pipe(&self, d: Done) {
        let _ = self.reply.send(d);
    }

    /// The error for a tensor the pipe should have moved on its own connection.
    fn misrouted(&self) -> Error {
        Error::protocol(
            "internal: a tensor the pipe moves itself reached the channel actor",
            &self.origin,
        )
    }

    /// Whether the pipe moves this channel's in-place tensors itself (the `efa` channel's data
    /// path, [`efa::Path`]), so that none is handed to this actor.
    fn pipe_moves_tensors(&self) -> bool {
        #[cfg(feature = "efa")]
        return self.fabric.is_some();
        #[cfg(not(feature = "efa"))]
        false
    }

    /// Hands a held tensor back to the pipe once nothing of it is out any more.
    fn release(&mut self, key: HeldKey) {
        if let Some(d) = released(&mut self.held, key) {
            self.to_pipe(d);
        }
    }

    fn maybe_stop(&mut self, ctx: &mut Context<Self>) {
        if !self.stopping {
            return;
        }
        if self.reading == 0 {
            self.close_acks();
        }
        #[cfg(feature = "cuda")]
        if !self.cuda_keys.is_empty()
            || self.ipc.as_ref().is_some_and(|s| s.busy())
            || self.cuda_basic.as_ref().is_some_and(|s| s.busy())
        {
            return;
        }
        #[cfg(feature = "ibv")]
        if !self.ibv_idle() {
            return;
        }
        #[cfg(all(feature = "cuda", feature = "ibv"))]
        if self.gdr.as_ref().is_some_and(|g| !g.idle()) {
            return;
        }
        #[cfg(feature = "efa")]
        if self.fabric.as_ref().is_some_and(|f| f.busy()) {
            return;
        }
        if self.held.is_empty() && self.xth_keys.is_empty() && self.reading == 0 {
            ctx.stop();
        }
    }

    fn shutdown_lanes(&mut self) {
        for l in &self.lanes {
            l.conn.do_send(Shutdown::default());
        }
    }

    fn on_own(&mut self, d: Done, ctx: &mut Context<Self>) {
        #[cfg(feature = "cuda")]
        match self.kind {
            ChannelKind::CudaIpc { .. } => {
                self.ipc_lane(d);
                return self.maybe_stop(ctx);
            }
            ChannelKind::CudaBasic => {
                self.basic_lane(d, ctx);
                return self.maybe_stop(ctx);
            }
            _ => {}
        }
        #[cfg(feature = "efa")]
        if matches!(self.kind, ChannelKind::Efa { .. }) {
            self.efa_lane(d, ctx);
            return self.maybe_stop(ctx);
        }
        match d {
            // xth completions (whole buffers, owned or shared; pieces of held buffers come as
            // regions) pass through to keep the list of parked keys current.
            Done::WroteTensor {
                seq,
                index,
                memory: memory @ (Memory::Owned(_) | Memory::Shared(_)),
                result,
            } => {
                self.xth_keys
                    .retain(|(out, k)| !(*out && (k.seq, k.index) == (seq, index)));
                self.to_pipe(Done::WroteTensor {
                    seq,
                    index,
                    memory,
                    result,
                });
            }
            Done::Tensor {
                seq,
                index,
                memory: Memory::Owned(b),
                result,
            } => {
                self.xth_keys
                    .retain(|(out, k)| *out || (k.seq, k.index) != (seq, index));
                self.to_pipe(Done::Tensor {
                    seq,
                    index,
                    memory: Memory::Owned(b),
                    result,
                });
            }
            // Stripes and fallback transfers of held buffers.
            Done::WroteTensor {
                seq, index, result, ..
            } => self.piece_done((true, seq, index), result),
            Done::Tensor {
                seq, index, result, ..
            } => self.piece_done((false, seq, index), result),
            Done::Frame { result, .. } => {
                self.ack_armed = false;
                let chunk_size = match self.kind {
                    ChannelKind::Cma { chunk_size, .. } => chunk_size,
                    _ => 1 << 20,
                };
                match result {
                    Ok(Frame::Ack(a)) => self.on_ack(a, chunk_size),
                    Ok(f) => self.fail_held(crate::transport::stream::unexpected(
                        f,
                        "a cma acknowledgement",
                        &self.origin,
                    )),
                    Err(e) => self.fail_held(e),
                }
                if self.held.values().any(|h| h.awaiting_ack) {
                    self.arm_ack();
                }
            }
            Done::Wrote { result, .. } => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "channel acknowledgement not sent");
                }
            }
            Done::Payloads { .. } => {}
        }
        self.maybe_stop(ctx);
    }

    fn piece_done(&mut self, key: HeldKey, result: Result<(), Error>) {
        piece_ended(&mut self.held, key, result);
        self.release(key);
    }

    /// The acknowledgement connection failed: sent cma tensors waiting for an ack fail (nothing
    /// else is touched: stripes and fallback transfers complete through their own operations).
    fn fail_held(&mut self, e: Error) {
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
}

impl Actor for Channel {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        #[cfg(feature = "efa")]
        if matches!(self.kind, ChannelKind::Efa { .. }) {
            self.efa_start(ctx);
        }
        self.poll_own(ctx);
        #[cfg(feature = "ibv")]
        self.ibv_start(ctx);
        #[cfg(all(feature = "cuda", feature = "ibv"))]
        self.gdr_start(ctx);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.shutdown_lanes();
        #[cfg(feature = "ibv")]
        self.ibv_forget();
        // A channel torn down with buffers still out (the system shutting down) must not free
        // memory the I/O loops may still touch.
        for (_, h) in self.held.drain() {
            std::mem::forget(h.buffer);
        }
    }
}

impl StreamHandler<Done> for Channel {
    fn handle(&mut self, d: Done, ctx: &mut Self::Context) {
        self.on_own(d, ctx);
        self.poll_own(ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

impl Handler<SendTensor> for Channel {
    type Result = ();

    fn handle(&mut self, m: SendTensor, ctx: &mut Self::Context) {
        if self.kind.sends_on_control(m.buffer.len() as u64)
            || self.kind.carries_cuda()
            || self.pipe_moves_tensors()
        {
            // The pipe queues these on its connection itself (or posts them on the efa path),
            // and hands CUDA channels their tensors as `SendCuda`; one here is a bug: fail it
            // rather than lose the buffer or the order.
            return self.to_pipe(Done::WroteTensor {
                seq: m.seq,
                index: m.index,
                memory: m.buffer,
                result: Err(self.misrouted()),
            });
        }
        match self.kind {
            ChannelKind::Basic { .. } => unreachable!("basic sends everything on control"),
            ChannelKind::Xth { pipe } => self.send_xth(pipe, m),
            ChannelKind::Cma { .. } => self.send_cma(m),
            ChannelKind::Mpt { chunk_size, .. } => {
                self.stripe(m.seq, m.index, m.buffer, true, chunk_size)
            }
            #[cfg(feature = "cuda")]
            ChannelKind::CudaXth { .. } | ChannelKind::CudaIpc { .. } | ChannelKind::CudaBasic => {
                unreachable!("refused above")
            }
            #[cfg(all(feature = "cuda", feature = "ibv"))]
            ChannelKind::CudaGdr => unreachable!("refused above"),
            #[cfg(feature = "ibv")]
            ChannelKind::Ibv { .. } => {
                self.send_ibv(m);
                return self.ibv_flush(ctx);
            }
            #[cfg(feature = "efa")]
            ChannelKind::Efa { .. } => unreachable!("refused above"),
        }
        self.poll_own(ctx);
    }
}

impl Handler<RecvTensor> for Channel {
    type Result = ();

    fn handle(&mut self, m: RecvTensor, ctx: &mut Self::Context) {
        if self.kind.carried().carries(&m.data)
            || self.kind.carries_cuda()
            || self.pipe_moves_tensors()
        {
            // As for `SendTensor`: the pipe reads these itself (or posts them on the efa path),
            // or hands them over as `RecvCuda`.
            return self.to_pipe(Done::Tensor {
                seq: m.seq,
                index: m.index,
                memory: Memory::Owned(m.buffer),
                result: Err(self.misrouted()),
            });
        }
        match self.kind {
            ChannelKind::Basic { .. } => unreachable!("basic receives everything on control"),
            ChannelKind::Xth { .. } => self.recv_xth(m),
            ChannelKind::Cma { threads, .. } => self.recv_cma(m, threads, ctx),
            ChannelKind::Mpt { chunk_size, .. } => self.recv_stripes(m, chunk_size),
            #[cfg(feature = "cuda")]
            ChannelKind::CudaXth { .. } | ChannelKind::CudaIpc { .. } | ChannelKind::CudaBasic => {
                unreachable!("refused above")
            }
            #[cfg(all(feature = "cuda", feature = "ibv"))]
            ChannelKind::CudaGdr => unreachable!("refused above"),
            #[cfg(feature = "ibv")]
            ChannelKind::Ibv { .. } => {
                self.recv_ibv(m);
                return self.ibv_flush(ctx);
            }
            #[cfg(feature = "efa")]
            ChannelKind::Efa { .. } => unreachable!("refused above"),
        }
        self.poll_own(ctx);
    }
}

impl Handler<StopChannel> for Channel {
    type Result = ();

    fn handle(&mut self, _: StopChannel, ctx: &mut Self::Context) {
        self.stopping = true;
        let e = Error::Closed {
            reason: "channel stopping".into(),
            origin: self.origin.clone(),
        };
        for (_, k) in &self.xth_keys {
            // Every key gets exactly one completion through our queue: from the withdrawal,
            // or from the other side if it got there first. Either way `on_own` removes the key.
            crate::backend::xth::withdraw(*k, &e);
        }
        #[cfg(feature = "cuda")]
        self.withdraw_cuda(&e);
        #[cfg(feature = "cuda")]
        if let ChannelKind::CudaBasic = self.kind {
            self.basic_stop(e.clone(), ctx);
        }
        #[cfg(feature = "efa")]
        if matches!(self.kind, ChannelKind::Efa { .. }) {
            self.efa_stop(ctx);
            self.poll_own(ctx);
            return;
        }
        if self.acked_by_peer() {
            // A peer may be reading our buffers right now: they go back to the user only once
            // it acknowledges or hangs up its side connection (it does when its reads are
            // over), or after a grace period if it is frozen.
            ctx.run_later(CMA_GRACE, |act, _| act.shutdown_lanes());
        } else {
            self.shutdown_lanes();
            #[cfg(feature = "ibv")]
            self.stop_ibv(e.clone());
            self.fail_held(e);
        }
        #[cfg(feature = "ibv")]
        self.ibv_flush(ctx);
        self.maybe_stop(ctx);
        self.poll_own(ctx);
    }
}

/// The error for an operation submitted to a lane whose loops are gone.
impl Channel {
    /// Whether the peer acknowledges our tensors on a side connection (cma, cuda_ipc): a
    /// stopping channel then waits for its acks or its hang-up before handing buffers back.
    fn acked_by_peer(&self) -> bool {
        match self.kind {
            ChannelKind::Cma { .. } => true,
            #[cfg(feature = "cuda")]
            ChannelKind::CudaIpc { .. } => true,
            _ => false,
        }
    }
}

fn lane_gone() -> Error {
    Error::Closed {
        reason: "the channel's connection already stopped".into(),
        origin: Origin::default(),
    }
}

mod cma;
mod kind;
pub(crate) use kind::ChannelKind;
#[cfg(feature = "cuda")]
mod cuda_basic;
#[cfg(all(feature = "cuda", feature = "ibv"))]
mod cuda_gdr;
#[cfg(feature = "cuda")]
mod cuda_ipc;
#[cfg(feature = "cuda")]
mod cuda_xth;
#[cfg(feature = "efa")]
mod efa;
#[cfg(feature = "efa")]
pub(crate) use efa::{LinkEnd, PathEnds, SharedPath};
#[cfg(feature = "ibv")]
mod ibv;
mod mpt;
mod xth;

#[cfg(feature = "cuda")]
pub(crate) use cuda_xth::{CudaDone, CudaReply, RecvCuda, SendCuda};

use cma::CMA_GRACE;
