//! The actorpipe side of a measurement, through the public API only: an echo server and a
//! round-trip client. Here both are plain async code that awaits each pipe operation
//! (`--api awaited`); [`crate::fired`] has the same two as actors (`--api fired`).
//!
//! One round trip: the client fires `Write`, awaits `ReadDescriptor` and `Read` of the echo, and
//! takes its buffers back from `WriteDone`. The server reads each message into buffers it
//! recycles and writes it straight back. After the first round trip of a size nothing is
//! allocated for payload or tensor bytes on either side.

use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::{
    inbox, Accepted, Allocation, Close, Connect, ContextBuilder, GetInfo, GetWriter, Listen,
    Listening, Message, Pipe, PipeInfo, Read, ReadDescriptor, Write,
};

use crate::failure::Failure;
use crate::measure::{Counts, Samples};
use crate::plan::Shape;
use crate::report::Progress;

/// How long one round trip may take before the run gives up.
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(60);

/// How the benchmark drives pipes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Api {
    /// Plain async code awaiting each operation (`pipe.send(op).await`).
    Awaited,
    /// Actors firing operations with `notify` and handling completion messages, reading with
    /// `ReadDescriptor` then `Read`.
    Fired,
    /// As `fired`, reading with `Receive` (descriptor and read in one operation).
    Receive,
    /// As `receive`, writing through a `PipeWriter`, which writes a small message from the
    /// actor's own handler when nothing else of the pipe's is pending (`receive` sends `Write`
    /// to the pipe: the path before `PipeWriter`, for A/B).
    Writer,
    /// As `writer`, reading with one standing receive (`ReceiveAll`) instead of a `Receive`
    /// per message: the connection's read loop hands each small message to the actor itself.
    Standing,
    /// As `standing`, with a handler called in place (`ReceiveAll::calling`) instead of an
    /// actor: each side writes its next message from inside the handler, on the read loop,
    /// with no mailbox hop.
    Handler,
}

impl Api {
    /// The flag value.
    pub fn name(&self) -> &'static str {
        match self {
            Api::Awaited => "awaited",
            Api::Fired => "fired",
            Api::Receive => "receive",
            Api::Writer => "writer",
            Api::Standing => "standing",
            Api::Handler => "handler",
        }
    }

    /// Whether writes go through a `PipeWriter`.
    pub fn writes_directly(&self) -> bool {
        matches!(self, Api::Writer | Api::Standing | Api::Handler)
    }

    /// How the actors read.
    pub fn reading(&self) -> crate::fired::Reading {
        match self {
            Api::Standing | Api::Handler => crate::fired::Reading::Standing,
            Api::Receive | Api::Writer => crate::fired::Reading::Receive,
            Api::Fired | Api::Awaited => crate::fired::Reading::TwoStep,
        }
    }
}

/// Starts a context from `builder` listening at `url`; every pipe it accepts is echoed. Keep
/// the returned value: the listener runs while it is held.
pub async fn listen(builder: ContextBuilder, url: &str, api: Api) -> Result<Listening, Failure> {
    let ctx = builder.start();
    let (to, mut accepted) = inbox::<Accepted>();
    let listening = ctx.send(Listen::new([url], to)).await??;
    actix::spawn(async move {
        while let Some(a) = accepted.recv().await {
            match api {
                Api::Awaited => {
                    actix::spawn(echo(a.pipe));
                }
                Api::Handler => match a.pipe.send(GetWriter).await {
                    Ok(writer) => {
                        actix::spawn(crate::handler::echo(a.pipe, writer));
                    }
                    Err(e) => eprintln!("echo server: no PipeWriter: {e}"),
                },
                Api::Fired | Api::Receive | Api::Writer | Api::Standing => {
                    let writer = match api.writes_directly() {
                        true => a.pipe.send(GetWriter).await.ok(),
                        false => None,
                    };
                    actix::Actor::start(crate::fired::Echo::new(a.pipe, api.reading(), writer));
                }
            }
        }
    });
    Ok(listening)
}

/// Sends every message back until the pipe closes.
async fn echo(pipe: Addr<Pipe>) {
    let mut spare: Option<Allocation> = None;
    loop {
        let Ok(ready) = pipe.send(ReadDescriptor).await else {
            return;
        };
        // An error means the pipe closed: the client is done.
        let Ok(descriptor) = ready.descriptor else {
            return;
        };
        let allocation = match spare.take() {
            Some(a) if a.check(&descriptor).is_ok() => a,
            _ => match Allocation::for_descriptor(&descriptor) {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("echo server: cannot allocate: {e}");
                    pipe.do_send(Close::because("echo server cannot allocate"));
                    return;
                }
            },
        };
        let Ok(read) = pipe.send(Read::new(allocation)).await else {
            return;
        };
        if read.result.is_err() {
            return;
        }
        let Ok(written) = pipe.send(Write::new(read.message)).await else {
            return;
        };
        if written.result.is_err() {
            return;
        }
        spare = Some(Allocation::from(written.message));
    }
}

/// The client side: a pipe to an echo server.
pub struct Client {
    pipe: Addr<Pipe>,
    /// What the pipe negotiated.
    pub info: PipeInfo,
    shape: Shape,
    api: Api,
    /// Kept between the rounds of one size.
    buffers: Option<Buffers>,
}

/// The buffers of one size, reused from round trip to round trip.
pub struct Buffers {
    /// Bytes of the size being measured.
    pub size: u64,
    /// What to send next (back from the last `WriteDone`).
    pub message: Message,
    /// What to read the next echo into (back from the last `ReadDone`).
    pub spare: Option<Allocation>,
}

impl Client {
    /// Connects a context from `builder` to `url`.
    pub async fn connect(
        builder: ContextBuilder,
        url: &str,
        shape: Shape,
        api: Api,
    ) -> Result<Client, Failure> {
        let ctx = builder.start();
        let pipe = ctx
            .send(Connect::new(url))
            .await?
            .map_err(|e| Failure::from(e).context(&format!("connecting to {url}")))?;
        let info = pipe.send(GetInfo).await?;
        Ok(Client {
            pipe,
            info,
            shape,
            api,
            buffers: None,
        })
    }

    /// The negotiated channel of CPU tensors (`basic` if the pipe names none).
    pub fn channel(&self) -> &str {
        self.info
            .channels
            .iter()
            .find(|c| c.devices == actorpipe::internal::negotiate::DevicePair::CPU)
            .or(self.info.channels.first())
            .map_or("basic", |c| c.name.as_str())
    }

    /// One round trip: write `message`, read its echo into `spare` (or new buffers). Returns
    /// what was sent and what came back.
    async fn round_trip(
        &self,
        message: Message,
        spare: Option<Allocation>,
    ) -> Result<(Message, Message), Failure> {
        let write = self.pipe.send(Write::new(message));
        let descriptor = self.pipe.send(ReadDescriptor).await?.descriptor?;
        let allocation = match spare {
            Some(a) if a.check(&descriptor).is_ok() => a,
            _ => Allocation::for_descriptor(&descriptor)?,
        };
        let read = self.pipe.send(Read::new(allocation)).await?;
        read.result?;
        let written = write.await?;
        written.result?;
        Ok((written.message, read.message))
    }

    /// Round trips of `size` bytes; the last echo is checked against what was sent. The
    /// buffers stay for the next call with the same size.
    pub async fn measure(
        &mut self,
        size: u64,
        counts: Counts,
        progress: &Progress,
    ) -> Result<Samples, Failure> {
        let buffers = match self.buffers.take() {
            Some(b) if b.size == size => b,
            _ => Buffers {
                size,
                message: self.shape.message(size),
                spare: None,
            },
        };
        let (samples, buffers) = match self.api {
            Api::Fired | Api::Receive | Api::Writer | Api::Standing => {
                let pipe = self.pipe.clone();
                let writer = match self.api.writes_directly() {
                    true => Some(pipe.send(GetWriter).await?),
                    false => None,
                };
                let reading = self.api.reading();
                crate::fired::Pinger::measure(pipe, writer, buffers, counts, progress, reading)
                    .await?
            }
            Api::Handler => {
                let writer = self.pipe.send(GetWriter).await?;
                crate::handler::measure(self.pipe.clone(), writer, buffers, counts, progress)
                    .await?
            }
            Api::Awaited => self.measure_awaited(buffers, counts, progress).await?,
        };
        self.buffers = Some(buffers);
        Ok(samples)
    }

    async fn measure_awaited(
        &self,
        buffers: Buffers,
        counts: Counts,
        progress: &Progress,
    ) -> Result<(Samples, Buffers), Failure> {
        let Buffers {
            size,
            mut message,
            mut spare,
        } = buffers;
        let mut samples = Samples::with_capacity(counts.iters as usize);
        for i in 0..counts.total() {
            let start = Instant::now();
            let trip = tokio::time::timeout(ROUND_TRIP_LIMIT, self.round_trip(message, spare));
            let (sent, back) = match trip.await {
                Ok(r) => r?,
                Err(_) => {
                    return Err(Failure::Failed(format!(
                        "no echo of {size} bytes within {ROUND_TRIP_LIMIT:?}"
                    )))
                }
            };
            let took = start.elapsed();
            if i >= counts.warmup {
                samples.push(took);
            }
            progress.inc();
            if i + 1 == counts.total() && !same_bytes(&sent, &back) {
                return Err(Failure::Failed(format!(
                    "the echo of {size} bytes differs from what was sent"
                )));
            }
            message = sent;
            spare = Some(Allocation::from(back));
        }
        let buffers = Buffers {
            size,
            message,
            spare,
        };
        Ok((samples, buffers))
    }

    /// Closes the pipe and waits until it has.
    pub async fn close(self) {
        let _ = self.pipe.send(Close::because("benchmark done")).await;
    }
}

/// Whether two messages hold the same payload and tensor bytes.
pub(crate) fn same_bytes(a: &Message, b: &Message) -> bool {
    a.payloads.len() == b.payloads.len()
        && a.tensors.len() == b.tensors.len()
        && a.payloads
            .iter()
            .zip(&b.payloads)
            .all(|(x, y)| x.data == y.data)
        && a.tensors
            .iter()
            .zip(&b.tensors)
            .all(|(x, y)| x.buffer == y.buffer)
}
