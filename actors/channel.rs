//! The `Channel` actor: owns one negotiated channel of one pipe and moves its tensors.
//!
//! - `basic` (and `cma`'s inline tensors): chunks over the pipe's control connection, at the
//!   tickets the pipe reserved, so they land exactly where the pipe ordered them. The pipe
//!   queues these on its connection itself and gets their completions directly: they never
//!   reach this actor, which for `basic` has nothing to do.
//! - `xth`: one copy through the process-wide table of [`crate::channel::xth`].
//! - `cma`: the receiver reads the sender's memory with `process_vm_readv` (on a blocking thread)
//!   and acknowledges on the channel's side connection; the sender hands the buffer back on the
//!   ack. If the read is refused at run time (EPERM, ENOSYS: ptrace rules, seccomp), the receiver
//!   asks for the bytes instead and the sender streams them over the side connection: the pipe
//!   lives on and the fallback is counted and logged.
//! - `mpt`: each tensor is split in stripes, one per lane connection, read in place.
//!
//! For the last three, completions come back here first (the channel tracks what it holds and
//! must hand every buffer back even when stopped), then go on to the pipe. A stopping channel
//! stays alive until every buffer it holds has gone back.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::connection::{Connection, Link, Shutdown};
use crate::channel::cma::{self, CmaError, RemoteBuffer};
use crate::channel::{mpt, xth};
use crate::error::{Error, Origin};
use crate::transport::stream::{Carried, Done, InOp, Memory, OutOp, Region, Reply};
use crate::wire::{self, Ack, Frame, FrameKind};

/// Which channel backend this actor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChannelKind {
    /// Tensor bytes in chunks over the pipe's connection.
    Basic { chunk_size: usize },
    /// In-process copy.
    Xth { pipe: u64 },
    /// `process_vm_readv`, with a side connection for acks and fallback bytes. Tensors of
    /// 1..=`inline_max` bytes travel like basic ones instead, on the pipe's connection: below
    /// that size the copy through the transport costs less than a cross-memory read and its
    /// acknowledgement.
    Cma {
        threads: usize,
        chunk_size: usize,
        inline_max: u64,
    },
    /// Stripes over several lane connections.
    Mpt { chunk_size: usize },
}

impl ChannelKind {
    /// Whether a tensor of `len` bytes that we send travels on the pipe's control connection
    /// (and so takes a ticket there).
    pub fn sends_on_control(&self, len: u64) -> bool {
        match *self {
            ChannelKind::Basic { .. } => true,
            ChannelKind::Cma { inline_max, .. } => len > 0 && len <= inline_max,
            _ => false,
        }
    }

    /// Which tensors we receive travel on the pipe's control connection, after their
    /// descriptor. The sender decides ([`Self::sends_on_control`]); an inline cma tensor is the
    /// one whose channel data is empty (a [`RemoteBuffer`] never is).
    pub fn carried(&self) -> Carried {
        match self {
            ChannelKind::Basic { .. } => Carried::All,
            ChannelKind::Cma { .. } => Carried::NoData,
            ChannelKind::Xth { .. } | ChannelKind::Mpt { .. } => Carried::Nothing,
        }
    }

    /// The chunk size of tensors on the pipe's connection.
    pub(crate) fn control_chunk(&self) -> usize {
        match *self {
            ChannelKind::Basic { chunk_size }
            | ChannelKind::Cma { chunk_size, .. }
            | ChannelKind::Mpt { chunk_size } => chunk_size,
            ChannelKind::Xth { .. } => usize::MAX,
        }
    }
}

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
    buffer: Vec<u8>,
    /// Operations still out (stripes for mpt).
    out: usize,
    error: Option<Error>,
    sending: bool,
    /// A sent cma tensor waiting for the receiver's acknowledgement.
    awaiting_ack: bool,
}

/// A held tensor: direction (`true` when sending), message, tensor. Both directions of a pipe
/// number their messages from 0, so the direction is part of the key.
type HeldKey = (bool, u64, u32);

/// The outcome of a cma read on a blocking thread.
struct CmaRead {
    seq: u64,
    index: u32,
    dst: Vec<u8>,
    result: Result<(), CmaError>,
}

impl Message for CmaRead {
    type Result = ();
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
    held: HashMap<HeldKey, Held>,
    /// Parked xth tensors, with their direction (`true` when sending).
    xth_keys: Vec<(bool, xth::Key)>,
    ack_armed: bool,
    /// cma reads running on blocking threads.
    reading: usize,
    stopping: bool,
    fallbacks: Arc<AtomicU64>,
}

/// Send one tensor.
#[derive(Debug)]
pub(crate) struct SendTensor {
    pub seq: u64,
    pub index: u32,
    pub buffer: Vec<u8>,
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
            held: HashMap::new(),
            xth_keys: Vec::new(),
            ack_armed: false,
            reading: 0,
            stopping: false,
            fallbacks,
        }
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
    }

    fn to_pipe(&self, d: Done) {
        let _ = self.reply.send(d);
    }

    /// The error for a tensor the pipe should have moved on its own connection.
    fn misrouted(&self) -> Error {
        Error::protocol(
            "internal: a tensor for the control connection reached the channel actor",
            &self.origin,
        )
    }

    /// Hands a held tensor back to the pipe once nothing of it is out any more.
    fn release(&mut self, key: HeldKey) {
        if self.held.get(&key).is_some_and(|h| h.out == 0) {
            let h = self.held.remove(&key).expect("present");
            let result = h.error.map_or(Ok(()), Err);
            let memory = Memory::Owned(h.buffer);
            self.to_pipe(if h.sending {
                Done::WroteTensor {
                    seq: key.1,
                    index: key.2,
                    memory,
                    result,
                }
            } else {
                Done::Tensor {
                    seq: key.1,
                    index: key.2,
                    memory,
                    result,
                }
            });
        }
    }

    fn maybe_stop(&mut self, ctx: &mut Context<Self>) {
        if !self.stopping {
            return;
        }
        if self.reading == 0 {
            self.close_acks();
        }
        if self.held.is_empty() && self.xth_keys.is_empty() && self.reading == 0 {
            ctx.stop();
        }
    }

    /// A stopping cma channel whose reads are over half-closes its acknowledgement connection:
    /// the acks already queued still go out, then the peer reads end-of-stream and knows it may
    /// hand back the buffers it was keeping for us. Our read side stays open for its acks.
    fn close_acks(&mut self) {
        if !matches!(self.kind, ChannelKind::Cma { .. }) {
            return;
        }
        if let Some(l) = self.lanes.get_mut(CMA_ACKS) {
            // Dropping the only sender ends the write loop, which then shuts the stream down.
            let (closed, _) = mpsc::unbounded_channel();
            l.link.out = closed;
        }
    }

    fn shutdown_lanes(&mut self) {
        for l in &self.lanes {
            l.conn.do_send(Shutdown::default());
        }
    }

    // ----- mpt ----------------------------------------------------------------------------

    fn stripe(&mut self, seq: u64, index: u32, mut buffer: Vec<u8>, sending: bool, chunk: usize) {
        let len = buffer.len() as u64;
        let lanes = self.lanes.len() as u32;
        let base = buffer.as_mut_ptr();
        let mut out = 0;
        for (lane, offset, n) in mpt::stripes(len, lanes) {
            // SAFETY: the stripes are disjoint ranges inside `buffer`, whose heap memory stays
            // in `self.held` untouched until every stripe's operation has completed (`release`
            // waits for `out == 0`, and a stopping channel waits for `held` to empty).
            let region = unsafe { Region::new(base.add(offset as usize), n as usize) };
            let reply = self.own();
            let l = &mut self.lanes[lane as usize];
            let origin = &self.origin;
            let gone = || Error::Closed {
                reason: "lane already stopped".into(),
                origin: origin.clone(),
            };
            if sending {
                let ticket = l.out_ticket;
                l.out_ticket += 1;
                l.link.write(
                    OutOp::Tensor {
                        ticket,
                        seq,
                        index,
                        memory: Memory::Region(region),
                        offset,
                        chunk_size: chunk,
                        reply,
                    },
                    gone,
                );
            } else {
                let ticket = l.in_ticket;
                l.in_ticket += 1;
                l.link.read(
                    InOp::Tensor {
                        ticket,
                        seq,
                        index,
                        memory: Memory::Region(region),
                        offset,
                        reply,
                    },
                    gone,
                );
            }
            out += 1;
        }
        let key = (sending, seq, index);
        self.held.insert(
            key,
            Held {
                buffer,
                out,
                error: None,
                sending,
                awaiting_ack: false,
            },
        );
        self.release(key);
    }

    // ----- cma ----------------------------------------------------------------------------

    fn arm_ack(&mut self) {
        if self.ack_armed || self.lanes.is_empty() {
            return;
        }
        self.ack_armed = true;
        let reply = self.own();
        let l = &mut self.lanes[CMA_ACKS];
        let ticket = l.in_ticket;
        l.in_ticket += 1;
        l.link.read(
            InOp::Frame {
                ticket,
                reply,
                more: 0,
                carried: Carried::Nothing,
            },
            lane_gone,
        );
    }

    fn send_ack(&mut self, ack: Ack) {
        if self.lanes.get(CMA_ACKS).is_none() {
            return;
        }
        let reply = self.own();
        let l = &mut self.lanes[CMA_ACKS];
        let mut frame = Vec::with_capacity(24);
        wire::encode_frame(&mut frame, FrameKind::Ack, |b| wire::encode_ack(b, &ack));
        let ticket = l.out_ticket;
        l.out_ticket += 1;
        l.link.write(
            OutOp::Message {
                ticket,
                frame,
                payloads: Vec::new(),
                reply,
            },
            lane_gone,
        );
    }

    fn on_ack(&mut self, ack: Ack, chunk_size: usize) {
        let key = (true, ack.seq, ack.tensor);
        let Some(h) = self.held.get_mut(&key).filter(|h| h.awaiting_ack) else {
            return self.fail_held(Error::protocol(
                format!(
                    "cma acknowledgement for message {} tensor {}, which is not waiting for one",
                    ack.seq, ack.tensor
                ),
                &self.origin,
            ));
        };
        h.awaiting_ack = false;
        if ack.ok {
            h.out -= 1;
            self.release(key);
            return;
        }
        // The receiver cannot read our memory: stream the bytes over the data connection.
        let n = h.buffer.len();
        let ptr = h.buffer.as_mut_ptr();
        // SAFETY: the buffer stays in `self.held`, untouched, until this operation completes
        // (its `Done` decrements `out`, which is still 1 for the ack we were waiting for).
        let region = unsafe { Region::new(ptr, n) };
        let reply = self.own();
        let l = &mut self.lanes[CMA_DATA];
        let ticket = l.out_ticket;
        l.out_ticket += 1;
        l.link.write(
            OutOp::Tensor {
                ticket,
                seq: ack.seq,
                index: ack.tensor,
                memory: Memory::Region(region),
                offset: 0,
                chunk_size,
                reply,
            },
            lane_gone,
        );
    }

    fn on_cma_read(&mut self, r: CmaRead, ctx: &mut Context<Self>) {
        self.reading -= 1;
        let key = (false, r.seq, r.index);
        match r.result {
            Ok(()) => {
                self.send_ack(Ack {
                    seq: r.seq,
                    tensor: r.index,
                    ok: true,
                });
                self.to_pipe(Done::Tensor {
                    seq: r.seq,
                    index: r.index,
                    memory: Memory::Owned(r.dst),
                    result: Ok(()),
                });
            }
            Err(CmaError::NotPermitted { .. }) if self.lanes.len() > CMA_DATA => {
                crate::metrics::fallback("cma");
                let n = self.fallbacks.fetch_add(1, Ordering::Relaxed);
                if n == 0 {
                    tracing::warn!(pipe = ?self.origin.pipe, "cma read refused by the kernel; falling back to the side connection");
                }
                self.send_ack(Ack {
                    seq: r.seq,
                    tensor: r.index,
                    ok: false,
                });
                let mut dst = r.dst;
                let n = dst.len();
                let ptr = dst.as_mut_ptr();
                self.held.insert(
                    key,
                    Held {
                        buffer: dst,
                        out: 1,
                        error: None,
                        sending: false,
                        awaiting_ack: false,
                    },
                );
                // SAFETY: as in `stripe`: `dst` stays in `self.held` until this read completes.
                let region = unsafe { Region::new(ptr, n) };
                let reply = self.own();
                let l = &mut self.lanes[CMA_DATA];
                let ticket = l.in_ticket;
                l.in_ticket += 1;
                l.link.read(
                    InOp::Tensor {
                        ticket,
                        seq: r.seq,
                        index: r.index,
                        memory: Memory::Region(region),
                        offset: 0,
                        reply,
                    },
                    lane_gone,
                );
            }
            Err(e) => self.to_pipe(Done::Tensor {
                seq: r.seq,
                index: r.index,
                memory: Memory::Owned(r.dst),
                result: Err(e.into_error(&self.origin)),
            }),
        }
        self.maybe_stop(ctx);
    }

    fn on_own(&mut self, d: Done, ctx: &mut Context<Self>) {
        match d {
            // xth completions pass through to keep the list of parked keys current.
            Done::WroteTensor {
                seq,
                index,
                memory: Memory::Owned(b),
                result,
            } => {
                self.xth_keys
                    .retain(|(out, k)| !(*out && (k.seq, k.index) == (seq, index)));
                self.to_pipe(Done::WroteTensor {
                    seq,
                    index,
                    memory: Memory::Owned(b),
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
        if let Some(h) = self.held.get_mut(&key) {
            h.out -= 1;
            if let Err(e) = result {
                h.error.get_or_insert(e);
            }
        }
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
        self.poll_own(ctx);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.shutdown_lanes();
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
        if self.kind.sends_on_control(m.buffer.len() as u64) {
            // The pipe queues these on its connection itself; one here is a bug: fail it
            // rather than lose the buffer or the order.
            return self.to_pipe(Done::WroteTensor {
                seq: m.seq,
                index: m.index,
                memory: Memory::Owned(m.buffer),
                result: Err(self.misrouted()),
            });
        }
        match self.kind {
            ChannelKind::Basic { .. } => unreachable!("basic sends everything on control"),
            ChannelKind::Xth { pipe } => {
                let key = xth::Key {
                    sender: pipe,
                    seq: m.seq,
                    index: m.index,
                };
                self.xth_keys.push((true, key));
                let reply = self.own();
                xth::send(key, m.buffer, reply);
            }
            ChannelKind::Cma { .. } => {
                let key = (true, m.seq, m.index);
                let empty = m.buffer.is_empty();
                self.held.insert(
                    key,
                    Held {
                        buffer: m.buffer,
                        out: usize::from(!empty),
                        error: None,
                        sending: true,
                        awaiting_ack: !empty,
                    },
                );
                if empty {
                    self.release(key);
                } else {
                    self.arm_ack();
                }
            }
            ChannelKind::Mpt { chunk_size } => {
                self.stripe(m.seq, m.index, m.buffer, true, chunk_size)
            }
        }
        self.poll_own(ctx);
    }
}

impl Handler<RecvTensor> for Channel {
    type Result = ();

    fn handle(&mut self, m: RecvTensor, ctx: &mut Self::Context) {
        if self.kind.carried().carries(&m.data) {
            // As for `SendTensor`: the pipe reads these itself.
            return self.to_pipe(Done::Tensor {
                seq: m.seq,
                index: m.index,
                memory: Memory::Owned(m.buffer),
                result: Err(self.misrouted()),
            });
        }
        match self.kind {
            ChannelKind::Basic { .. } => unreachable!("basic receives everything on control"),
            ChannelKind::Xth { .. } => {
                let sender = match <[u8; 8]>::try_from(m.data.as_slice()) {
                    Ok(b) => u64::from_le_bytes(b),
                    Err(_) => {
                        return self.to_pipe(Done::Tensor {
                            seq: m.seq,
                            index: m.index,
                            memory: Memory::Owned(m.buffer),
                            result: Err(Error::protocol(
                                "xth channel data is not a pipe id",
                                &self.origin,
                            )),
                        })
                    }
                };
                let key = xth::Key {
                    sender,
                    seq: m.seq,
                    index: m.index,
                };
                self.xth_keys.push((false, key));
                let reply = self.own();
                xth::recv(key, m.buffer, reply, &self.origin);
            }
            ChannelKind::Cma { threads, .. } => {
                let remote = match RemoteBuffer::decode(&m.data) {
                    Some(r) if r.len == m.buffer.len() as u64 => r,
                    _ => {
                        return self.to_pipe(Done::Tensor {
                            seq: m.seq,
                            index: m.index,
                            memory: Memory::Owned(m.buffer),
                            result: Err(Error::protocol(
                                "cma channel data does not describe this tensor",
                                &self.origin,
                            )),
                        })
                    }
                };
                let (seq, index, mut dst) = (m.seq, m.index, m.buffer);
                if dst.is_empty() {
                    // Nothing to read, and the sender expects no acknowledgement for it.
                    return self.to_pipe(Done::Tensor {
                        seq,
                        index,
                        memory: Memory::Owned(dst),
                        result: Ok(()),
                    });
                }
                let me = ctx.address();
                self.reading += 1;
                actix::spawn(async move {
                    let read = tokio::task::spawn_blocking(move || {
                        let result = cma::read_remote(&remote, &mut dst, threads);
                        (dst, result)
                    })
                    .await;
                    // The blocking task cannot panic short of a bug in the read loop; if it
                    // did, its buffer is lost and the pipe reports the tensor as failed.
                    let (dst, result) = read.unwrap_or_else(|e| {
                        (
                            Vec::new(),
                            Err(CmaError::Other {
                                pid: remote.pid,
                                source: std::io::Error::other(e.to_string()),
                            }),
                        )
                    });
                    me.do_send(CmaRead {
                        seq,
                        index,
                        dst,
                        result,
                    });
                });
            }
            ChannelKind::Mpt { chunk_size } => {
                self.stripe(m.seq, m.index, m.buffer, false, chunk_size)
            }
        }
        self.poll_own(ctx);
    }
}

impl Handler<CmaRead> for Channel {
    type Result = ();

    fn handle(&mut self, r: CmaRead, ctx: &mut Self::Context) {
        self.on_cma_read(r, ctx);
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
            xth::withdraw(*k, &e);
        }
        if let ChannelKind::Cma { .. } = self.kind {
            // A peer may be reading our buffers right now: they go back to the user only once
            // it acknowledges or hangs up its side connection (it does when its reads are
            // over), or after a grace period if it is frozen.
            ctx.run_later(CMA_GRACE, |act, _| act.shutdown_lanes());
        } else {
            self.shutdown_lanes();
            self.fail_held(e);
        }
        self.maybe_stop(ctx);
        self.poll_own(ctx);
    }
}

/// The error for an operation submitted to a lane whose loops are gone.
fn lane_gone() -> Error {
    Error::Closed {
        reason: "the channel's connection already stopped".into(),
        origin: Origin::default(),
    }
}

/// The cma lane carrying acknowledgements (each side's, for the other's sends).
const CMA_ACKS: usize = 0;
/// The cma lane carrying fallback bytes (each side's, for the other's refused reads).
const CMA_DATA: usize = 1;

/// How long a stopping cma sender waits for its peer to finish reading its buffers.
const CMA_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
