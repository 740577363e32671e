//! The public messages of the actor API and their completions.
//!
//! Every pipe operation can be awaited (`pipe.send(Write::new(m)).await` resolves when the write
//! is complete) or fired with a recipient that receives the completion
//! (`pipe.do_send(Write::new(m).notify(me.recipient()))`). Completions of one kind (writes;
//! descriptor reads and reads) arrive in the order the operations were issued, errors included.
//! An actor that fires many operations can make each recipient once and fire with
//! [`Op::notify_shared`], which costs no allocation per operation.

use std::sync::Arc;

use actix::{Addr, Message as ActixMessage, Recipient};

use super::{Listener, Pipe};
use crate::error::Error;
use crate::message::{Allocation, Descriptor, Message};

/// An operation on a pipe: it completes with [`Op::Done`].
pub trait Op: ActixMessage<Result = <Self as Op>::Done> + Send + Sized + 'static {
    /// The completion message.
    type Done: ActixMessage<Result = ()> + Send + 'static;

    /// Fires this operation: `to` receives the completion instead of the caller awaiting it.
    fn notify(self, to: Recipient<Self::Done>) -> Notify<Self> {
        Notify { op: self, to }
    }

    /// Fires this operation to a recipient shared by many operations: `to` receives the
    /// completion. Cloning the `Arc` allocates nothing, where each `Recipient` (a
    /// `ctx.address().recipient()`, or a clone of one) allocates three times. Make it once, as
    /// `Arc::new(ctx.address().recipient())`, and keep it.
    fn notify_shared(self, to: &Arc<Recipient<Self::Done>>) -> NotifyShared<Self> {
        NotifyShared {
            op: self,
            to: to.clone(),
        }
    }

    /// The completion used if the pipe actor vanished before answering (it never does while
    /// anyone holds its address; this keeps an await from panicking if it did).
    #[doc(hidden)]
    fn lost(id: u64) -> Self::Done;
}

/// An operation whose completion goes to a recipient; see [`Op::notify`].
#[derive(Debug)]
pub struct Notify<M: Op> {
    /// The operation.
    pub op: M,
    /// Who gets the completion.
    pub to: Recipient<M::Done>,
}

impl<M: Op> ActixMessage for Notify<M> {
    type Result = ();
}

/// An operation whose completion goes to a shared recipient; see [`Op::notify_shared`].
#[derive(Debug)]
pub struct NotifyShared<M: Op> {
    /// The operation.
    pub op: M,
    /// Who gets the completion.
    pub to: Arc<Recipient<M::Done>>,
}

impl<M: Op> ActixMessage for NotifyShared<M> {
    type Result = ();
}

pub(crate) fn vanished() -> Error {
    Error::Closed {
        reason: "the pipe actor stopped before completing the operation".into(),
        origin: Default::default(),
    }
}

/// Start listening on every URL (`tcp://127.0.0.1:0` picks a port). The listener sends
/// [`Accepted`] to `subscriber` for each pipe a peer opens.
#[derive(Debug)]
pub struct Listen {
    /// Where to listen.
    pub urls: Vec<String>,
    /// Who gets the accepted pipes.
    pub subscriber: Recipient<Accepted>,
    /// Backends every pipe of this listener must use; see [`Listen::require`].
    pub require: Vec<String>,
}

impl Listen {
    /// Listen on `urls`, handing pipes to `subscriber`.
    pub fn new<S: Into<String>>(
        urls: impl IntoIterator<Item = S>,
        subscriber: Recipient<Accepted>,
    ) -> Self {
        Listen {
            urls: urls.into_iter().map(Into::into).collect(),
            subscriber,
            require: Vec::new(),
        }
    }

    /// Accept only pipes that use these backends (by name): if a transport is named, the
    /// control stream must move to one of the transports named; if a channel is named, tensors
    /// must travel by one of the channels named. The listener offers nothing else in
    /// negotiation, so a peer that cannot use them fails to connect with
    /// [`Error::Unavailable`] and the reason. Without it, the connecting side's priorities
    /// choose among everything both sides enabled.
    pub fn require(mut self, backends: &[&str]) -> Self {
        self.require = backends.iter().map(|b| b.to_string()).collect();
        self
    }
}

impl ActixMessage for Listen {
    type Result = Result<Listening, Error>;
}

/// A running listener and the URLs it is reachable at (ports resolved).
///
/// The listener runs while someone holds its address: keep `listener` (or this value) for as
/// long as you want to accept pipes. Once every address is dropped it stops within about two
/// seconds and frees its ports; pipes it accepted keep running.
#[derive(Debug, Clone)]
pub struct Listening {
    /// The listener actor; send it [`StopListening`] to stop accepting.
    pub listener: Addr<Listener>,
    /// Where peers can connect.
    pub urls: Vec<String>,
    /// The same endpoints, each with its transport.
    pub endpoints: Vec<ListenEndpoint>,
    /// The transports a pipe could move to after bootstrapping (`shm`, `efa`, `ibv`: those a
    /// listener opens an endpoint for by itself) whose listening failed, with why. Pipes to
    /// this listener are not offered them, so negotiation picks another transport: this says
    /// why a pipe that could have used the fabric is on `tcp`.
    pub not_listening: Vec<NotListening>,
}

/// A transport a listener could not listen on, in [`Listening::not_listening`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotListening {
    /// The transport (`shm`, `efa`, `ibv`).
    pub transport: String,
    /// The URL it tried.
    pub url: String,
    /// Why it failed.
    pub reason: String,
}

/// One endpoint a listener is reachable at, in [`Listening::endpoints`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenEndpoint {
    /// Its transport (`tcp`, `shm`).
    pub transport: String,
    /// Its URL, port or name resolved.
    pub url: String,
}

/// Ask a context where its metrics are served: the address bound, why binding failed, or
/// [`Error::Unavailable`] if it was not asked to serve them (see [`ContextBuilder::metrics`]).
///
/// [`ContextBuilder::metrics`]: super::ContextBuilder::metrics
#[derive(Debug, Clone, Copy)]
pub struct GetMetricsAddr;

impl ActixMessage for GetMetricsAddr {
    type Result = Result<std::net::SocketAddr, Error>;
}

/// Stops a listener; pipes it already accepted keep running.
#[derive(Debug, Clone, Copy)]
pub struct StopListening;

impl ActixMessage for StopListening {
    type Result = ();
}

/// A peer opened a pipe to a listener.
#[derive(Debug)]
pub struct Accepted {
    /// The new pipe.
    pub pipe: Addr<Pipe>,
    /// The peer's address.
    pub peer: String,
}

impl ActixMessage for Accepted {
    type Result = ();
}

/// Open a pipe to a listener at `url`. Resolves `Ok` once the listener has accepted the whole
/// pipe: the handshake is done, every extra connection has joined, and the listener has
/// confirmed it. A listener that cannot take the pipe now fails it fast with
/// [`Error::Refused`] and its reason: a transient error, like a listener not up yet
/// ([`Error::Connect`]) or a timeout, which [`Connect::retry`] retries.
#[derive(Debug, Clone)]
pub struct Connect {
    /// The listener's URL.
    pub url: String,
    /// How to retry a transient failure; `None`: fail at the first.
    pub retry: Option<Retry>,
}

impl Connect {
    /// Connect to `url`, once.
    pub fn new(url: impl Into<String>) -> Self {
        Connect {
            url: url.into(),
            retry: None,
        }
    }

    /// Retries a failure whose class is transient ([`crate::ErrorClass::is_transient`]:
    /// refused, timeout, connect, peer closed) as `policy` says; any other error, and the last
    /// attempt's, is the result.
    pub fn retry(mut self, policy: Retry) -> Self {
        self.retry = Some(policy);
        self
    }
}

impl From<&str> for Connect {
    fn from(url: &str) -> Self {
        Connect::new(url)
    }
}

impl From<String> for Connect {
    fn from(url: String) -> Self {
        Connect::new(url)
    }
}

impl From<&String> for Connect {
    fn from(url: &String) -> Self {
        Connect::new(url.as_str())
    }
}

/// How [`Connect::retry`] retries: up to `attempts` dials in all, waiting `backoff` after the
/// first failure and twice as long after each next one, at most `max_backoff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// Dials in all, the first included (at least 1).
    pub attempts: u32,
    /// The wait after the first failure.
    pub backoff: std::time::Duration,
    /// The longest wait.
    pub max_backoff: std::time::Duration,
}

impl Retry {
    /// `attempts` dials in all, 50 ms after the first failure, doubling up to 2 s.
    pub fn attempts(attempts: u32) -> Retry {
        Retry {
            attempts: attempts.max(1),
            backoff: std::time::Duration::from_millis(50),
            max_backoff: std::time::Duration::from_secs(2),
        }
    }

    /// Waits `first` after the first failure, doubling up to `max`.
    pub fn backoff(mut self, first: std::time::Duration, max: std::time::Duration) -> Retry {
        self.backoff = first;
        self.max_backoff = max.max(first);
        self
    }
}

impl Default for Retry {
    /// Ten dials, 50 ms after the first failure, doubling up to 2 s.
    fn default() -> Retry {
        Retry::attempts(10)
    }
}

impl ActixMessage for Connect {
    type Result = Result<Addr<Pipe>, Error>;
}

/// Send a message. The buffers come back in [`WriteDone`], on success and on failure.
#[derive(Debug)]
pub struct Write {
    /// What to send.
    pub message: Message,
    /// If set, the operation must complete within this time of being issued, or the pipe
    /// closes with [`Error::Timeout`] (a stream cannot drop one operation and go on, so a
    /// missed deadline ends the pipe; every pending operation completes with that error).
    pub deadline: Option<std::time::Duration>,
}

impl From<Message> for Write {
    fn from(message: Message) -> Self {
        Write::new(message)
    }
}

impl Write {
    /// Send `message`.
    pub fn new(message: Message) -> Self {
        Write {
            message,
            deadline: None,
        }
    }

    /// Sets a deadline (see [`Write::deadline`]).
    pub fn within(mut self, d: std::time::Duration) -> Self {
        self.deadline = Some(d);
        self
    }
}

/// A write finished.
#[derive(Debug)]
pub struct WriteDone {
    /// Per-pipe write number, from 0.
    pub id: u64,
    /// `Ok` once every byte is handed to the transport.
    pub result: Result<(), Error>,
    /// The message, with all its buffers, for reuse.
    pub message: Message,
    /// The tensors of `message` (their indices, in the order they came back) whose buffer is a
    /// copy standing in for the one you handed in, which a provider still holds. Only a failed
    /// write on the `efa` channel has any: when the provider has not let go of a tensor's
    /// buffer within `actorpipe::efa::STAND_IN_AFTER` (200 ms) of the failure: a tensor whose
    /// send to a peer that died was still in flight, which libfabric 1.17's providers keep
    /// until the endpoint closes. The original is freed once the provider lets go of it or the
    /// endpoint closes. Empty (and not allocated) otherwise.
    pub stand_ins: Vec<usize>,
}

impl ActixMessage for Write {
    type Result = WriteDone;
}

impl ActixMessage for WriteDone {
    type Result = ();
}

impl Op for Write {
    type Done = WriteDone;
    fn lost(id: u64) -> WriteDone {
        WriteDone {
            id,
            result: Err(vanished()),
            message: Message::default(),
            stand_ins: Vec::new(),
        }
    }
}

/// Wait for the next incoming message's descriptor.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadDescriptor;

/// The next message's descriptor (or why there is none).
#[derive(Debug)]
pub struct DescriptorReady {
    /// Per-pipe read number, from 0 (shared with [`Read`]).
    pub id: u64,
    /// What to allocate for.
    pub descriptor: Result<Descriptor, Error>,
}

impl ActixMessage for ReadDescriptor {
    type Result = DescriptorReady;
}

impl ActixMessage for DescriptorReady {
    type Result = ();
}

impl Op for ReadDescriptor {
    type Done = DescriptorReady;
    fn lost(id: u64) -> DescriptorReady {
        DescriptorReady {
            id,
            descriptor: Err(vanished()),
        }
    }
}

/// Receive the message whose descriptor was delivered last, into these buffers.
#[derive(Debug)]
pub struct Read {
    /// One buffer per payload and per tensor, each exactly the announced size.
    pub allocation: Allocation,
    /// If set, the operation must complete within this time of being issued, or the pipe
    /// closes with [`Error::Timeout`] (a stream cannot drop one operation and go on, so a
    /// missed deadline ends the pipe; every pending operation completes with that error).
    pub deadline: Option<std::time::Duration>,
    /// Complete only once the data of every CUDA tensor has landed (the copies have run), as
    /// reads into host memory do; by default a read of CUDA tensors completes once the copies
    /// are enqueued, and `ReadDone::cuda` orders later work after them (docs/cuda.md). No
    /// effect on host tensors.
    pub data_complete: bool,
}

impl Read {
    /// Read into `allocation`.
    pub fn new(allocation: Allocation) -> Self {
        Read {
            allocation,
            deadline: None,
            data_complete: false,
        }
    }

    /// Completes only once CUDA tensors' data has landed (see [`Read::data_complete`]).
    pub fn data_complete(mut self) -> Self {
        self.data_complete = true;
        self
    }

    /// Sets a deadline (see [`Read::deadline`]).
    pub fn within(mut self, d: std::time::Duration) -> Self {
        self.deadline = Some(d);
        self
    }
}

/// A read finished: the buffers come back filled, as a message.
#[derive(Debug)]
pub struct ReadDone {
    /// Per-pipe read number (shared with [`ReadDescriptor`]).
    pub id: u64,
    /// `Ok` once every byte has landed.
    pub result: Result<(), Error>,
    /// The message: the descriptor's metadata and the buffers handed in.
    pub message: Message,
    /// The tensors of `message` whose buffer is a zeroed copy standing in for the one handed
    /// in, which a provider still holds: as [`WriteDone::stand_ins`], for a failed read.
    pub stand_ins: Vec<usize>,
    /// For a message with CUDA tensors: one event per device the read touched (empty for
    /// host-only messages and for reads with [`Read::data_complete`]). Wait on it
    /// ([`CudaCompletion::wait_on`](crate::cuda::CudaCompletion::wait_on) on the stream that
    /// uses the data, or the blocking `wait`) before touching the CUDA buffers.
    #[cfg(feature = "cuda")]
    pub cuda: crate::cuda::CudaCompletion,
}

impl ActixMessage for Read {
    type Result = ReadDone;
}

impl ActixMessage for ReadDone {
    type Result = ();
}

impl Op for Read {
    type Done = ReadDone;
    fn lost(id: u64) -> ReadDone {
        ReadDone {
            id,
            result: Err(vanished()),
            message: Message::default(),
            stand_ins: Vec::new(),
            #[cfg(feature = "cuda")]
            cuda: Default::default(),
        }
    }
}

/// Receive the next message whole, into buffers the pipe allocates: [`ReadDescriptor`] and
/// [`Read`] in one operation, with one completion ([`ReadDone`], whose message carries the
/// metadata). Use it when whatever arrives goes to plain host memory; use `ReadDescriptor` and
/// `Read` when you choose the memory from the descriptor (a tensor on a device, a buffer of your
/// own).
///
/// With [`Receive::reusing`], the pipe fits the spare buffers to the message
/// ([`Allocation::refit`]): in steady state, with the `message` of the last `ReadDone` handed
/// back, nothing is allocated. `Receive` saves the application two messages per read (the
/// descriptor's delivery and the `Read`), which is most of what a small message costs.
///
/// A `Receive` issued while a delivered descriptor has not been read yet (a `ReadDescriptor`
/// without its `Read`) completes with [`Error::InvalidArgument`](crate::Error): send the `Read`
/// first.
#[derive(Debug, Default)]
pub struct Receive {
    /// Buffers to reuse, fitted to the message.
    pub spare: Option<Allocation>,
    /// As [`Read::deadline`].
    pub deadline: Option<std::time::Duration>,
    /// As [`Read::data_complete`].
    pub data_complete: bool,
}

impl Receive {
    /// Receive into newly allocated buffers.
    pub fn new() -> Self {
        Receive::default()
    }

    /// Receive into `spare`'s buffers, fitted to the message.
    pub fn reusing(spare: Allocation) -> Self {
        Receive {
            spare: Some(spare),
            deadline: None,
            data_complete: false,
        }
    }

    /// Completes only once CUDA tensors' data has landed (see [`Read::data_complete`]).
    pub fn data_complete(mut self) -> Self {
        self.data_complete = true;
        self
    }

    /// Sets a deadline (see [`Read::deadline`]).
    pub fn within(mut self, d: std::time::Duration) -> Self {
        self.deadline = Some(d);
        self
    }
}

impl ActixMessage for Receive {
    type Result = ReadDone;
}

impl Op for Receive {
    type Done = ReadDone;
    fn lost(id: u64) -> ReadDone {
        Read::lost(id)
    }
}

/// The *standing receive*: deliver every message from now on to `to`, as a [`ReadDone`], without
/// a [`Receive`] per message. While it stands, the connection's read loop hands each
/// self-contained message (payloads and small host tensors read whole with their frame, at most
/// 16 KiB) straight to `to`, with no turn of the pipe's task; any other message (larger, or with
/// tensors on a channel of their own) the pipe reads as a `Receive` would, into buffers it
/// allocates, and delivers to `to` too. Messages arrive strictly in order: the read loop
/// delivers nothing while the pipe still holds an earlier message.
///
/// - **Answer**: `Ok(())` once standing; [`Error::InvalidArgument`] if a standing receive
///   already stands or reads are pending (a `ReadDescriptor` without its `Read`, a `Receive`);
///   the pipe's error if it has failed. Messages already read ahead go to `to` first.
/// - **Conflicts**: `Read`, `ReadDescriptor` and `Receive` sent while it stands complete at once
///   with [`Error::InvalidArgument`].
/// - **Ending**: [`StopReceiving`] ends it. If the pipe fails or is closed, every message the
///   pipe was still reading completes with the error, in order; if it held none, `to` gets one
///   `ReadDone` with the error; after that, nothing. No deadlines apply while it stands.
/// - **A recipient that is gone** (its actor stopped) fails the pipe with [`Error::Closed`] when
///   the next message arrives: nobody would read it.
/// - **Back-pressure**: each delivery is a `do_send`, which does not wait for room in `to`'s
///   mailbox: a recipient slower than the peer lets its mailbox grow. The pipe itself reads at
///   most 16 messages (the prefetch bound) at once on the recipient's behalf.
///
/// **A handler instead of a recipient** ([`ReceiveAll::calling`]): the function is called with
/// each `ReadDone` where the message is complete, with no mailbox hop: by the connection's read
/// loop for a self-contained message, by the pipe's handler for the others, on the context's
/// arbiter, in order, one call at a time. That is the shortest path from the connection to the
/// application (docs/architecture.md, "Read path"): a handler that answers through a
/// [`PipeWriter`](crate::PipeWriter) writes the answer before any other task runs. It runs in
/// the middle of the pipe's work, so it must be short and must not block: no waiting on the
/// pipe or on anything that waits on it (hand longer work to an actor or a queue). The same
/// rules apply as with a recipient; a handler that panics counts as a recipient that is gone
/// (the message it was given is lost, the pipe fails with [`Error::Closed`] when the next one
/// arrives), and the panic goes no further than the call (with Rust's default `panic =
/// "unwind"`; a program built to abort on panic aborts).
///
/// **Where a handler runs.** On a `tcp` or `shm` pipe the read loop moves to the arbiter's
/// runtime queue while a handler stands, and back to the arbiter's `LocalSet` when the stand ends
/// ([`ContextBuilder::read_loop_follows_handler`](crate::ContextBuilder::read_loop_follows_handler)):
/// one layer of scheduling fewer for each message. Its calls from there run inside a spare
/// `LocalSet` of the same thread, so `actix::spawn`, `Actor::start` and tokio's `spawn_local`
/// work in a handler wherever it is called from, and what they start runs on that thread, as
/// `actix::Arbiter::current().spawn(..)` and messages to actors do.
///
/// An echo that answers each message from the read loop:
///
/// ```no_run
/// use std::sync::Arc;
/// use actorpipe::prelude::*;
///
/// # async fn echo(pipe: actix::Addr<actorpipe::Pipe>) -> actorpipe::Result<()> {
/// let writer = pipe.writer().await?;
/// // Where a write goes that cannot complete at once (a large message): nobody reads it here.
/// let (late, _) = actorpipe::inbox::<actorpipe::WriteDone>();
/// let late = Arc::new(late);
/// pipe.receive_all_calling(move |done: actorpipe::ReadDone| {
///     if done.result.is_ok() {
///         // Written now, from the read loop; a small write's `WriteDone` comes back at once.
///         let _ = writer.write(actorpipe::Write::new(done.message), &late);
///     }
/// })
/// .await?;
/// # Ok(())
/// # }
/// ```
pub struct ReceiveAll {
    pub(crate) to: Deliver,
}

/// Where a standing receive delivers.
pub(crate) enum Deliver {
    To(Recipient<ReadDone>),
    Calling(Box<dyn FnMut(ReadDone) + Send>),
}

impl std::fmt::Debug for ReceiveAll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.to {
            Deliver::To(r) => f.debug_struct("ReceiveAll").field("to", r).finish(),
            Deliver::Calling(_) => f
                .debug_struct("ReceiveAll")
                .field("calling", &"FnMut(ReadDone)")
                .finish(),
        }
    }
}

impl ReceiveAll {
    /// Deliver every message to `to`.
    pub fn to(to: Recipient<ReadDone>) -> Self {
        ReceiveAll {
            to: Deliver::To(to),
        }
    }

    /// Call `handler` with every message, in place (see above): no mailbox hop.
    pub fn calling(handler: impl FnMut(ReadDone) + Send + 'static) -> Self {
        ReceiveAll {
            to: Deliver::Calling(Box::new(handler)),
        }
    }
}

impl ActixMessage for ReceiveAll {
    type Result = Result<(), Error>;
}

/// Hands the standing receive ([`ReceiveAll`]) buffers to reuse, typically those of a message
/// it delivered, back from its echo's `WriteDone`. The pipe fits the next message it reads for
/// the stand into them (as [`Receive::reusing`] does: resized in place, allocated only where
/// missing or too small) instead of allocating: what keeps large messages from costing a fresh
/// allocation and its page faults each. Only messages the pipe reads use them (payloads over
/// 16 KiB in all, tensors that do not ride with the frame); the read loop's deliveries are the
/// bytes it read with the frame. The pipe keeps at most 16 sets, the last given used first;
/// more, or any without a stand, are dropped.
#[derive(Debug, Default)]
pub struct Recycle(pub Allocation);

impl ActixMessage for Recycle {
    type Result = ();
}

/// Ends the standing receive ([`ReceiveAll`]). The read loop delivers nothing more; messages
/// the pipe had begun to read still go to the recipient. Answers the id one past the last
/// `ReadDone` the stand sends (every one of them has a smaller id), or
/// [`Error::InvalidArgument`] if none stands. Later messages wait for the next `Receive`,
/// `ReadDescriptor` or `ReceiveAll`.
#[derive(Debug, Clone, Copy, Default)]
pub struct StopReceiving;

impl ActixMessage for StopReceiving {
    type Result = Result<u64, Error>;
}

/// Close the pipe now: pending operations complete with [`Error::Closed`], the peer is told, and
/// subscribers get [`Closed`]. Resolves once every pending operation has completed.
#[derive(Debug, Clone, Default)]
pub struct Close {
    /// Told to the peer and put in the error.
    pub reason: String,
    /// Drain first: see [`Close::graceful`].
    pub graceful: bool,
}

impl Close {
    /// Abort: close now. Pending operations complete with [`Error::Closed`]; the peer sees
    /// [`Error::PeerClosed`] with `graceful: false`.
    pub fn because(reason: impl Into<String>) -> Self {
        Close {
            reason: reason.into(),
            graceful: false,
        }
    }

    /// Drain, then close: writes issued before the close complete normally (writes issued after
    /// it are refused), then the pipe closes, pending reads complete with [`Error::Closed`],
    /// and the peer sees [`Error::PeerClosed`] with `graceful: true` once it has read
    /// everything. Resolves when the pipe is closed.
    pub fn graceful(reason: impl Into<String>) -> Self {
        Close {
            reason: reason.into(),
            graceful: true,
        }
    }
}

/// A pipe is closed; `error` is what every pending operation completed with.
#[derive(Debug, Clone)]
pub struct Closed {
    /// Why.
    pub error: Error,
}

impl ActixMessage for Close {
    type Result = Closed;
}

impl ActixMessage for Closed {
    type Result = ();
}

impl Op for Close {
    type Done = Closed;
    fn lost(_: u64) -> Closed {
        Closed { error: vanished() }
    }
}

/// Receive [`Closed`] when the pipe closes, for whatever reason. A subscriber that joins after
/// the close gets it at once.
#[derive(Debug)]
pub struct Subscribe(pub Recipient<Closed>);

impl ActixMessage for Subscribe {
    type Result = ();
}

/// Ask a pipe what it is and what it negotiated.
#[derive(Debug, Clone, Copy)]
pub struct GetInfo;

/// Ask a pipe for a [`PipeWriter`](crate::PipeWriter): a handle that writes small messages
/// from the caller's own task, without a trip through the pipe's mailbox when nothing else of
/// the pipe's is pending (docs/architecture.md, "Write path", step 6).
#[derive(Debug, Clone, Copy)]
pub struct GetWriter;

impl ActixMessage for GetWriter {
    type Result = crate::actors::pipe::PipeWriter;
}

/// What a pipe is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipeInfo {
    /// Process-local id.
    pub id: u64,
    /// The peer's address.
    pub peer: String,
    /// Our address.
    pub local: String,
    /// The transport of the control stream.
    pub transport: String,
    /// The channel per device pair: the one place a pipe's channels are given
    /// ([`PipeInfo::channel_list`] prints them). Error origins and the `pipe` log span name the
    /// same backend as `shm/cma`; metrics label it `transport="shm"`, `channel="cma"`.
    pub channels: Vec<ChannelInfo>,
    /// Tensors this side sent through the control connection (the `basic` channel's, and the
    /// ones `cma`, `mpt`, `ibv` and `efa` send inline because they are small).
    pub tensors_on_control: u64,
    /// Tensors this side handed to the channel itself (`xth`, `cma`, `mpt`, ...).
    pub tensors_by_channel: u64,
    /// `Receive`s the connection's read loop completed itself, without a turn of the pipe's
    /// task: those for messages read whole with their frame (payloads and small host tensors
    /// on the control stream, at most 16 KiB in all) that were waiting when their message
    /// arrived (docs/architecture.md, "Read path", step 5), and the messages it delivered to
    /// a standing receive ([`ReceiveAll`], step 6).
    pub received_by_read_loop: u64,
    /// Writes a [`PipeWriter`](crate::PipeWriter) wrote into the connection and completed
    /// itself, without a turn of the pipe's task (docs/architecture.md, "Write path", step 6).
    pub written_by_caller: u64,
    /// Whether the pipe is closed.
    pub closed: bool,
    /// Tensors that had to fall back from their channel's fast path (cma reads refused by the
    /// kernel at run time, streamed over the channel's connection instead).
    pub fallbacks: u64,
    /// The channels' own connections (mpt lanes, the cma side connection), with their
    /// addresses: which NIC each lane took.
    pub connections: Vec<LaneInfo>,
    /// Where this side's one-sided operations on host memory go (`crate::remote`), or `None`
    /// when the pipe has no path for them.
    pub remote: Option<crate::remote::RemoteInfo>,
}

impl PipeInfo {
    /// The negotiated channels as one line: `cma (cpu->cpu), cuda_ipc (cuda->cuda)`.
    pub fn channel_list(&self) -> String {
        self.channels
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A negotiated channel, in [`PipeInfo::channels`]. It prints as `cma (cpu->cpu)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelInfo {
    /// The channel's name (`cma`), as in metrics labels.
    pub name: String,
    /// The source and target memory it moves between.
    pub devices: crate::negotiate::DevicePair,
}

impl std::fmt::Display for ChannelInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.devices)
    }
}

/// One connection of a channel, in [`PipeInfo::connections`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneInfo {
    /// The channel it belongs to (`mpt`).
    pub channel: String,
    /// Its index among the channel's connections.
    pub lane: u32,
    /// Our end's address.
    pub local: String,
    /// The peer's end's address.
    pub peer: String,
}

impl ActixMessage for GetInfo {
    type Result = PipeInfo;
}
