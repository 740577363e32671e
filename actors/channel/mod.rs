//! The `Channel` actor: owns one negotiated channel of one pipe and runs its backend's
//! [`Driver`](crate::channel::driver::Driver) (see `src/channel/driver.rs`).
//!
//! The actor is the same for every backend: it takes the pipe's hand-offs ([`SendTensor`],
//! [`RecvTensor`], and with feature `cuda` [`SendCuda`], [`RecvCuda`]), polls the channel's own
//! completion queues and whatever futures, streams and timers the driver asked for, and calls
//! the driver for each. On [`StopChannel`] it stays alive until the driver says that every
//! buffer it held has gone back.
//!
//! `basic` tensors (and the small tensors that cma, mpt, ibv and efa send inline) travel on the
//! pipe's control connection: the pipe queues these itself and they never reach this actor.
//! The `efa` channel's data path is shared with the pipe, which posts its tensors itself.

use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use actix::fut::wrap_future;
use actix::prelude::*;
use tokio::sync::mpsc;

use super::connection::{Connection, Link, Shutdown};
use crate::channel::driver::{
    Core, Cx, Driver, Effects, LaneIo, LazyQueue, LocalFuture, LocalStream,
};
pub(crate) use crate::channel::driver::{RecvTensor, SendTensor};
use crate::transport::stream::{Done, InOp, Memory, OutOp};

#[cfg(feature = "cuda")]
pub(crate) use crate::channel::driver::{CudaDone, RecvCuda, SendCuda};

pub(crate) use crate::channel::kind::ChannelKind;

/// A queue of events, as a stream an actor polls.
pub(crate) struct Queue<T>(pub mpsc::UnboundedReceiver<T>);

impl<T> futures_core::Stream for Queue<T> {
    type Item = T;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

/// Stop once every buffer held has gone back to the pipe.
#[derive(Debug)]
pub(crate) struct StopChannel;

impl Message for StopChannel {
    type Result = ();
}

impl Message for SendTensor {
    type Result = ();
}

impl Message for RecvTensor {
    type Result = ();
}

#[cfg(feature = "cuda")]
impl Message for SendCuda {
    type Result = ();
}

#[cfg(feature = "cuda")]
impl Message for RecvCuda {
    type Result = ();
}

/// A lane as the driver submits to it: the connection actor and its loops' link.
struct ActorLane {
    conn: Addr<Connection>,
    link: Link,
}

impl LaneIo for ActorLane {
    fn write(&self, op: OutOp) {
        self.link.write(op, crate::channel::driver::lane_gone);
    }

    fn read(&self, op: InOp) {
        self.link.read(op, crate::channel::driver::lane_gone);
    }

    fn close_writes(&mut self) {
        // Dropping the only sender ends the write loop, which then shuts the stream down.
        let (closed, _) = mpsc::unbounded_channel();
        self.link.out = closed;
    }

    fn shutdown(&self) {
        self.conn.do_send(Shutdown::default());
    }
}

/// The lanes of a channel, for its [`Core`].
pub(crate) fn lanes(lanes: Vec<(Addr<Connection>, Link)>) -> Vec<Box<dyn LaneIo>> {
    lanes
        .into_iter()
        .map(|(conn, link)| Box::new(ActorLane { conn, link }) as Box<dyn LaneIo>)
        .collect()
}

/// An event of the driver's, as the actor's streams carry it.
struct Ev<E>(E);

/// A driver's stream, its items as events.
struct Events<S>(S);

impl<S: futures_core::Stream + Unpin> futures_core::Stream for Events<S> {
    type Item = Ev<S::Item>;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0).poll_next(cx).map(|o| o.map(Ev))
    }
}

/// One negotiated channel of one pipe, running driver `D`.
pub struct Channel<D: Driver> {
    core: Core,
    driver: D,
    /// What the pipe routes here (a guard against misrouted hand-offs).
    kind: ChannelKind,
    /// The driver's event queue for other threads.
    events: LazyQueue<D::Event>,
    watches: Vec<SpawnHandle>,
}

/// The actor's effects for its driver, during one call.
#[cfg_attr(
    not(all(feature = "cuda", feature = "ibv", feature = "efa")),
    allow(dead_code)
)]
struct Fx<'a, D: Driver> {
    ctx: &'a mut Context<Channel<D>>,
    events: &'a mut LazyQueue<D::Event>,
    watches: &'a mut Vec<SpawnHandle>,
}

impl<D: Driver> Effects<D::Event> for Fx<'_, D> {
    fn spawn(&mut self, f: LocalFuture<D::Event>) {
        self.ctx
            .spawn(wrap_future::<_, Channel<D>>(f).map(|e, act, ctx| act.event(e, ctx)));
    }

    fn watch(&mut self, s: LocalStream<D::Event>) {
        let h = self.ctx.add_stream(Events(s));
        self.watches.push(h);
    }

    fn cancel_watches(&mut self) {
        for h in self.watches.drain(..) {
            self.ctx.cancel_future(h);
        }
    }

    fn later(&mut self, after: Duration, e: D::Event) {
        self.ctx.run_later(after, move |act, ctx| act.event(e, ctx));
    }

    fn sender(&mut self) -> mpsc::UnboundedSender<D::Event> {
        self.events.sender()
    }
}

/// Calls the driver with the channel's core and the actor's effects, then polls the queues the
/// call made and stops the actor if it is stopping and drained.
macro_rules! drive {
    ($act:expr, $ctx:expr, |$d:ident, $cx:ident| $body:expr) => {{
        let act = $act;
        let ctx = $ctx;
        {
            let mut fx = Fx::<D> {
                ctx: &mut *ctx,
                events: &mut act.events,
                watches: &mut act.watches,
            };
            let $cx = &mut Cx {
                core: &mut act.core,
                fx: &mut fx,
            };
            let $d = &mut act.driver;
            $body;
        }
        act.settle(ctx);
    }};
}

impl<D: Driver> Channel<D> {
    /// A channel running `driver` over `core`; the pipe routes `kind`'s tensors to it.
    pub(crate) fn new(core: Core, driver: D, kind: ChannelKind) -> Self {
        Channel {
            core,
            driver,
            kind,
            events: LazyQueue::default(),
            watches: Vec::new(),
        }
    }

    /// Starts the actor; the pipe holds the returned handle.
    pub(crate) fn launch(self) -> ChannelAddr {
        let addr = self.start();
        ChannelAddr {
            send: addr.clone().recipient(),
            recv: addr.clone().recipient(),
            stop: addr.clone().recipient(),
            #[cfg(feature = "cuda")]
            send_cuda: addr.clone().recipient(),
            #[cfg(feature = "cuda")]
            recv_cuda: addr.recipient(),
        }
    }

    fn event(&mut self, e: D::Event, ctx: &mut Context<Self>) {
        drive!(self, ctx, |d, cx| d.on_event(e, cx));
    }

    /// After every call: polls the queues it made, and stops once stopping and drained.
    fn settle(&mut self, ctx: &mut Context<Self>) {
        if let Some(rx) = self.core.take_own_rx() {
            ctx.add_stream(Queue(rx));
        }
        #[cfg(feature = "cuda")]
        if let Some(rx) = self.core.take_cuda_rx() {
            ctx.add_stream(Queue(rx));
        }
        if let Some(rx) = self.events.take_rx() {
            ctx.add_stream(Events(Queue(rx)));
        }
        if !self.core.stopping {
            return;
        }
        let mut fx = Fx::<D> {
            ctx: &mut *ctx,
            events: &mut self.events,
            watches: &mut self.watches,
        };
        let cx = &mut Cx {
            core: &mut self.core,
            fx: &mut fx,
        };
        if self.driver.drained(cx) {
            ctx.stop();
        }
    }
}

impl<D: Driver> Actor for Channel<D> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        drive!(self, ctx, |d, cx| d.start(cx));
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.core.shutdown_lanes();
        self.driver.forget(&mut self.core);
        // A channel torn down with buffers still out (the system shutting down) must not free
        // memory the I/O loops may still touch.
        for (_, h) in self.core.held.drain() {
            std::mem::forget(h.buffer);
        }
    }
}

impl<D: Driver> StreamHandler<Done> for Channel<D> {
    fn handle(&mut self, d: Done, ctx: &mut Self::Context) {
        drive!(self, ctx, |dr, cx| dr.on_done(d, cx));
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

#[cfg(feature = "cuda")]
impl<D: Driver> StreamHandler<CudaDone> for Channel<D> {
    fn handle(&mut self, d: CudaDone, ctx: &mut Self::Context) {
        drive!(self, ctx, |dr, cx| dr.on_cuda(d, cx));
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

impl<D: Driver> StreamHandler<Ev<D::Event>> for Channel<D> {
    fn handle(&mut self, Ev(e): Ev<D::Event>, ctx: &mut Self::Context) {
        self.event(e, ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

impl<D: Driver> Handler<SendTensor> for Channel<D> {
    type Result = ();

    fn handle(&mut self, m: SendTensor, ctx: &mut Self::Context) {
        if self.kind.sends_on_control(m.buffer.len() as u64) || self.kind.carries_cuda() {
            // The pipe queues these on its connection itself, and hands CUDA channels their
            // tensors as `SendCuda`; one here is a bug: fail it rather than lose the buffer or
            // the order.
            let e = self.core.misrouted();
            return self.core.hand_back(true, m.seq, m.index, m.buffer, Err(e));
        }
        drive!(self, ctx, |d, cx| d.send(m, cx));
    }
}

impl<D: Driver> Handler<RecvTensor> for Channel<D> {
    type Result = ();

    fn handle(&mut self, m: RecvTensor, ctx: &mut Self::Context) {
        if self.kind.carried().carries(&m.data) || self.kind.carries_cuda() {
            // As for `SendTensor`: the pipe reads these itself, or hands them over as
            // `RecvCuda`.
            let e = self.core.misrouted();
            let buffer = Memory::Owned(m.buffer);
            return self.core.hand_back(false, m.seq, m.index, buffer, Err(e));
        }
        drive!(self, ctx, |d, cx| d.recv(m, cx));
    }
}

#[cfg(feature = "cuda")]
impl<D: Driver> Handler<SendCuda> for Channel<D> {
    type Result = ();

    fn handle(&mut self, m: SendCuda, ctx: &mut Self::Context) {
        drive!(self, ctx, |d, cx| d.send_cuda(m, cx));
    }
}

#[cfg(feature = "cuda")]
impl<D: Driver> Handler<RecvCuda> for Channel<D> {
    type Result = ();

    fn handle(&mut self, m: RecvCuda, ctx: &mut Self::Context) {
        drive!(self, ctx, |d, cx| d.recv_cuda(m, cx));
    }
}

impl<D: Driver> Handler<StopChannel> for Channel<D> {
    type Result = ();

    fn handle(&mut self, _: StopChannel, ctx: &mut Self::Context) {
        self.core.stopping = true;
        let e = self.core.stopping_error();
        drive!(self, ctx, |d, cx| d.stop(e, cx));
    }
}

/// The pipe's handle on one of its channel actors, whatever its driver.
pub(crate) struct ChannelAddr {
    send: Recipient<SendTensor>,
    recv: Recipient<RecvTensor>,
    stop: Recipient<StopChannel>,
    #[cfg(feature = "cuda")]
    send_cuda: Recipient<SendCuda>,
    #[cfg(feature = "cuda")]
    recv_cuda: Recipient<RecvCuda>,
}

/// A hand-off the pipe makes to a channel.
pub(crate) trait ChannelMessage {
    fn deliver(self, to: &ChannelAddr);
}

impl ChannelAddr {
    /// Hands `m` to the channel (dropped, as a mailbox send is, if the actor is gone).
    pub(crate) fn do_send<M: ChannelMessage>(&self, m: M) {
        m.deliver(self);
    }
}

impl ChannelMessage for SendTensor {
    fn deliver(self, to: &ChannelAddr) {
        to.send.do_send(self);
    }
}

impl ChannelMessage for RecvTensor {
    fn deliver(self, to: &ChannelAddr) {
        to.recv.do_send(self);
    }
}

impl ChannelMessage for StopChannel {
    fn deliver(self, to: &ChannelAddr) {
        to.stop.do_send(self);
    }
}

#[cfg(feature = "cuda")]
impl ChannelMessage for SendCuda {
    fn deliver(self, to: &ChannelAddr) {
        to.send_cuda.do_send(self);
    }
}

#[cfg(feature = "cuda")]
impl ChannelMessage for RecvCuda {
    fn deliver(self, to: &ChannelAddr) {
        to.recv_cuda.do_send(self);
    }
}

#[cfg(feature = "efa")]
pub(crate) use crate::actors::hardware::efa::channel::path::{LinkEnd, PathEnds, SharedPath};
