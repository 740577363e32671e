//! The same echo and round trip as [`crate::bench`], written as actors that fire operations
//! with `notify` and handle the completion messages (`--api fired`), as an application actor
//! does. Comparing the two shows what awaiting costs (a oneshot, a boxed future and a spawned
//! task per operation). Both actors make their recipients once and fire with `notify_shared`.
//! With a [`PipeWriter`] (`--api writer`) they write through it: a small message is written
//! from the handler itself and its `WriteDone` is the call's return value. With a standing
//! receive (`--api standing`) they ask for no message: every one comes to their `ReadDone`
//! handler by itself.

use std::sync::Arc;

use actix::prelude::*;
use actorpipe::{
    Allocation, Close, Closed, DescriptorReady, Op, Pipe, PipeWriter, Read, ReadDescriptor,
    ReadDone, Receive, ReceiveAll, Recycle, StopReceiving, Subscribe, Write, WriteDone,
};
use tokio::sync::oneshot;

use crate::bench::Buffers;
use crate::failure::Failure;
use crate::measure::{Counts, Samples};
use crate::report::Progress;
use crate::tally::{watch, Next, Tally};

/// How the actors read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// `ReadDescriptor`, then `Read`.
    TwoStep,
    /// One `Receive` per message.
    Receive,
    /// One standing receive (`ReceiveAll`) for the whole run.
    Standing,
}

/// Buffers of a message larger than this go back to a standing receive ([`Recycle`]): the
/// messages the pipe reads itself are those over 16 KiB.
pub const RECYCLE_ABOVE: u64 = 16 << 10;

fn bytes(a: &Allocation) -> u64 {
    let payloads: usize = a.payloads.iter().map(Vec::len).sum();
    payloads as u64 + a.tensors.iter().map(|t| t.len()).sum::<u64>()
}

/// An actor's recipients for the completions of fired operations, made once.
struct Recipients {
    wrote: Arc<Recipient<WriteDone>>,
    described: Arc<Recipient<DescriptorReady>>,
    read: Arc<Recipient<ReadDone>>,
}

impl Recipients {
    /// Asks `pipe` for the next message: with `Receive` (into `spare`'s buffers), or with
    /// `ReadDescriptor`, whose handler then sends the `Read`; a standing receive asks nothing.
    fn read_next(&self, pipe: &Addr<Pipe>, reading: Reading, spare: Option<Allocation>) {
        match reading {
            Reading::Receive => {
                let op = Receive {
                    spare,
                    ..Receive::default()
                };
                pipe.do_send(op.notify_shared(&self.read));
            }
            Reading::TwoStep => pipe.do_send(ReadDescriptor.notify_shared(&self.described)),
            // The standing receive asks nothing; it gets large buffers back to read the next
            // large message into (small ones arrive in the bytes read with their frame).
            Reading::Standing => {
                if let Some(spare) = spare.filter(|a| bytes(a) > RECYCLE_ABOVE) {
                    pipe.do_send(Recycle(spare));
                }
            }
        }
    }

    /// Writes `message` through `writer` if there is one (the completion, if it finished at
    /// once), else by sending `Write` to `pipe`.
    fn write(
        &self,
        pipe: &Addr<Pipe>,
        writer: Option<&PipeWriter>,
        message: actorpipe::Message,
    ) -> Option<WriteDone> {
        match writer {
            Some(w) => w.write(Write::new(message), &self.wrote),
            None => {
                pipe.do_send(Write::new(message).notify_shared(&self.wrote));
                None
            }
        }
    }

    fn of<A>(me: &Addr<A>) -> Recipients
    where
        A: Actor<Context = Context<A>>
            + Handler<WriteDone>
            + Handler<DescriptorReady>
            + Handler<ReadDone>,
    {
        Recipients {
            wrote: Arc::new(me.clone().recipient()),
            described: Arc::new(me.clone().recipient()),
            read: Arc::new(me.clone().recipient()),
        }
    }
}

/// Echoes one pipe: read a descriptor, read the message, write it back, repeat.
pub struct Echo {
    pipe: Addr<Pipe>,
    writer: Option<PipeWriter>,
    spare: Option<Allocation>,
    to: Option<Recipients>,
    reading: Reading,
}

impl Echo {
    /// An echo of `pipe`, not started; it writes through `writer` if given.
    pub fn new(pipe: Addr<Pipe>, reading: Reading, writer: Option<PipeWriter>) -> Echo {
        Echo {
            pipe,
            writer,
            spare: None,
            to: None,
            reading,
        }
    }

    fn to(&self) -> &Recipients {
        self.to.as_ref().expect("made when started")
    }

    /// Asks for the next message.
    fn next(&mut self) {
        let spare = self.spare.take();
        self.to().read_next(&self.pipe, self.reading, spare);
    }
}

impl Actor for Echo {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let me = ctx.address();
        self.pipe.do_send(Subscribe(me.clone().recipient()));
        self.to = Some(Recipients::of(&me));
        if self.reading == Reading::Standing {
            let stand = self.pipe.send(ReceiveAll::to(me.recipient()));
            actix::spawn(async move {
                if let Ok(Err(e)) = stand.await {
                    eprintln!("echo server: no standing receive: {e}");
                }
            });
        }
        self.next();
    }
}

impl Handler<DescriptorReady> for Echo {
    type Result = ();

    fn handle(&mut self, d: DescriptorReady, _: &mut Self::Context) {
        // An error means the pipe closed; `Closed` follows.
        let Ok(descriptor) = d.descriptor else { return };
        let allocation = match self.spare.take() {
            Some(a) if a.check(&descriptor).is_ok() => a,
            _ => match Allocation::for_descriptor(&descriptor) {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("echo server: cannot allocate: {e}");
                    self.pipe
                        .do_send(Close::because("echo server cannot allocate"));
                    return;
                }
            },
        };
        self.pipe
            .do_send(Read::new(allocation).notify_shared(&self.to().read));
    }
}

impl Handler<ReadDone> for Echo {
    type Result = ();

    fn handle(&mut self, r: ReadDone, _: &mut Self::Context) {
        if r.result.is_err() {
            return;
        }
        let done = self.to().write(&self.pipe, self.writer.as_ref(), r.message);
        if let Some(w) = done {
            self.wrote(w);
        }
        self.next();
    }
}

impl Echo {
    fn wrote(&mut self, w: WriteDone) {
        if w.result.is_ok() {
            match self.reading {
                // Back to the stand now: it asks for nothing, so `next` would not hand it on.
                // A small message's buffers are not worth a mailbox hop: it reads small ones
                // with their frame, into buffers of its own.
                Reading::Standing if w.message.total_bytes() <= RECYCLE_ABOVE => {}
                Reading::Standing => self.to().read_next(
                    &self.pipe,
                    Reading::Standing,
                    Some(Allocation::from(w.message)),
                ),
                _ => self.spare = Some(Allocation::from(w.message)),
            }
        }
    }
}

impl Handler<WriteDone> for Echo {
    type Result = ();

    fn handle(&mut self, w: WriteDone, _: &mut Self::Context) {
        self.wrote(w);
    }
}

impl Handler<Closed> for Echo {
    type Result = ();

    fn handle(&mut self, _: Closed, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// Measures round trips of one size, then stops and hands the samples over.
pub struct Pinger {
    pipe: Addr<Pipe>,
    writer: Option<PipeWriter>,
    size: u64,
    counts: Counts,
    tally: Tally,
    /// The message to send next (back from the last `WriteDone`).
    message: Option<actorpipe::Message>,
    spare: Option<Allocation>,
    sent: Option<actorpipe::Message>,
    back: Option<actorpipe::Message>,
    finish: Option<oneshot::Sender<Result<(Samples, Buffers), Failure>>>,
    to: Option<Recipients>,
    reading: Reading,
}

impl Pinger {
    /// Starts a pinger on the current arbiter and waits for its samples.
    pub async fn measure(
        pipe: Addr<Pipe>,
        writer: Option<PipeWriter>,
        buffers: Buffers,
        counts: Counts,
        progress: &Progress,
        reading: Reading,
    ) -> Result<(Samples, Buffers), Failure> {
        let size = buffers.size;
        let (tx, rx) = oneshot::channel();
        let (tally, trips) = Tally::new(size, counts, progress);
        Pinger {
            pipe,
            writer,
            size,
            counts,
            tally,
            message: Some(buffers.message),
            spare: buffers.spare,
            sent: None,
            back: None,
            finish: Some(tx),
            to: None,
            reading,
        }
        .start();
        watch(rx, &trips, size).await
    }

    fn fire(&mut self, ctx: &mut Context<Self>) {
        let to = self
            .to
            .get_or_insert_with(|| Recipients::of(&ctx.address()));
        let message = self.message.take().expect("a message to send");
        self.tally.start();
        let done = to.write(&self.pipe, self.writer.as_ref(), message);
        to.read_next(&self.pipe, self.reading, self.spare.take());
        if let Some(w) = done {
            self.wrote(w, ctx);
        }
    }

    fn wrote(&mut self, w: WriteDone, ctx: &mut Context<Self>) {
        match w.result {
            Ok(()) => {
                self.sent = Some(w.message);
                self.maybe_next(ctx);
            }
            Err(e) => self.fail(e.into(), ctx),
        }
    }

    fn fail(&mut self, e: Failure, ctx: &mut Context<Self>) {
        self.stop_standing();
        if let Some(f) = self.finish.take() {
            let _ = f.send(Err(e));
        }
        ctx.stop();
    }

    /// Once both the write and the read of a round trip are back: record, go on or finish.
    fn maybe_next(&mut self, ctx: &mut Context<Self>) {
        let Some(next) = self.tally.ended(&mut self.sent, &mut self.back) else {
            return;
        };
        let (sent, back) = match next {
            Next::Again { sent, back } => (sent, back),
            Next::Done(result) => {
                self.stop_standing();
                if let Some(f) = self.finish.take() {
                    let _ = f.send(result);
                }
                ctx.stop();
                return;
            }
        };
        self.message = Some(sent);
        self.spare = Some(Allocation::from(back));
        self.fire(ctx);
    }
}

impl Pinger {
    /// Ends the standing receive, before the actor (its recipient) stops: the next size's
    /// pinger stands anew on the same pipe.
    fn stop_standing(&mut self) {
        if self.reading == Reading::Standing {
            self.pipe.do_send(StopReceiving);
        }
    }
}

impl Actor for Pinger {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if self.counts.total() == 0 {
            if let Some(f) = self.finish.take() {
                let buffers = Buffers {
                    size: self.size,
                    message: self.message.take().unwrap_or_default(),
                    spare: self.spare.take(),
                };
                let _ = f.send(Ok((Samples::new(), buffers)));
            }
            ctx.stop();
            return;
        }
        if self.reading == Reading::Standing {
            let stand = self.pipe.send(ReceiveAll::to(ctx.address().recipient()));
            ctx.wait(stand.into_actor(self).map(|r, act, ctx| match r {
                Ok(Ok(())) => act.fire(ctx),
                Ok(Err(e)) => act.fail(e.into(), ctx),
                Err(e) => act.fail(Failure::Failed(e.to_string()), ctx),
            }));
            return;
        }
        self.fire(ctx);
    }
}

impl Handler<WriteDone> for Pinger {
    type Result = ();

    fn handle(&mut self, w: WriteDone, ctx: &mut Self::Context) {
        self.wrote(w, ctx);
    }
}

impl Handler<DescriptorReady> for Pinger {
    type Result = ();

    fn handle(&mut self, d: DescriptorReady, ctx: &mut Self::Context) {
        let descriptor = match d.descriptor {
            Ok(d) => d,
            Err(e) => return self.fail(e.into(), ctx),
        };
        let allocation = match self.spare.take() {
            Some(a) if a.check(&descriptor).is_ok() => a,
            _ => match Allocation::for_descriptor(&descriptor) {
                Ok(a) => a,
                Err(e) => return self.fail(e.into(), ctx),
            },
        };
        let to = self.to.as_ref().expect("made by the first fire");
        self.pipe
            .do_send(Read::new(allocation).notify_shared(&to.read));
    }
}

impl Handler<ReadDone> for Pinger {
    type Result = ();

    fn handle(&mut self, r: ReadDone, ctx: &mut Self::Context) {
        match r.result {
            Ok(()) => {
                self.back = Some(r.message);
                self.maybe_next(ctx);
            }
            Err(e) => self.fail(e.into(), ctx),
        }
    }
}
