//! Awaited calls in one step: `pipe.write(m).await?` instead of
//! `pipe.send(Write::new(m)).await.unwrap().result?`.
//!
//! `Addr::send` resolves to `Result<Done, MailboxError>`, and the completion inside carries its
//! own `Result`. These traits flatten the two into one [`Result`], mapping the mailbox error into
//! [`Error`](crate::Error) (the actor stopped before answering: [`Error::Closed`](crate::Error::Closed)). They are in the
//! [`prelude`](crate::prelude).
//!
//! What they give up: a failed write's buffers. [`PipeExt::write`] returns the message on
//! success only; when you need a failed write's buffers back, send [`Write`] and read
//! [`WriteDone::message`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use actix::dev::{Request, ToEnvelope};
use actix::{Actor, Addr, Handler, Message as ActixMessage};

use super::messages::{
    Accepted, Close, Closed, Connect, GetInfo, GetMetricsAddr, GetWriter, Listen, Listening,
    PipeInfo, Read, ReadDescriptor, ReadDone, Receive, ReceiveAll, StopReceiving, Write, WriteDone,
};
use super::{Context, Pipe, PipeWriter};
use crate::error::Result;
use crate::message::{Allocation, Descriptor, Message};

/// The future of a one-step call: the actor's answer to `M`, mapped into one [`Result`] (a
/// mailbox error becomes an [`Error`](crate::Error)). It owns its request, so it can be spawned
/// or turned into an actor future (`into_actor`).
#[must_use = "the request is sent when the future is first polled, and cancelled if it is dropped"]
pub struct Call<A, M, U>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: ActixMessage + Send + 'static,
    M::Result: Send,
{
    request: Request<A, M>,
    map: fn(M::Result) -> Result<U>,
}

impl<A, M, U> std::fmt::Debug for Call<A, M, U>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: ActixMessage + Send + 'static,
    M::Result: Send,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call").finish_non_exhaustive()
    }
}

impl<A, M, U> Future for Call<A, M, U>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: ActixMessage + Send + 'static,
    M::Result: Send,
{
    type Output = Result<U>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<U>> {
        // SAFETY: `request` is structurally pinned: it is never moved out of `self`, and `Call`
        // has no `Drop` impl and is `Unpin` only when the request is.
        let this = unsafe { self.get_unchecked_mut() };
        // SAFETY: as above; `this` stays pinned for as long as `request` is used.
        let request = unsafe { Pin::new_unchecked(&mut this.request) };
        request.poll(cx).map(|answer| (this.map)(answer?))
    }
}

fn call<A, M, U>(to: &Addr<A>, message: M, map: fn(M::Result) -> Result<U>) -> Call<A, M, U>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: ActixMessage + Send + 'static,
    M::Result: Send,
{
    Call {
        request: to.send(message),
        map,
    }
}

fn read_result(done: ReadDone) -> Result<Message> {
    done.result.map(|()| done.message)
}

/// One-step awaited operations on a pipe.
pub trait PipeExt {
    /// Writes a message (a [`Message`], or a [`Write`] with a deadline); `Ok` carries the
    /// completion (its id and the buffers, for reuse). On failure the error is the result and
    /// the buffers are dropped: [`PipeExt::write_done`] gives them back either way.
    fn write(&self, write: impl Into<Write>) -> Call<Pipe, Write, WriteDone>;
    /// Writes a message and answers its [`WriteDone`] whatever the result, so the buffers
    /// come back on failure too (`done.result` says how it went).
    fn write_done(&self, write: impl Into<Write>) -> Call<Pipe, Write, WriteDone>;
    /// Waits for the next message's descriptor.
    fn read_descriptor(&self) -> Call<Pipe, ReadDescriptor, Descriptor>;
    /// Reads the message whose descriptor was delivered last into `allocation`.
    fn read(&self, allocation: Allocation) -> Call<Pipe, Read, Message>;
    /// Receives the next message whole, into buffers the pipe allocates.
    fn receive(&self) -> Call<Pipe, Receive, Message>;
    /// Receives the next message into `spare`'s buffers, fitted to it.
    fn receive_reusing(&self, spare: Allocation) -> Call<Pipe, Receive, Message>;
    /// Delivers every message from now on to `to` (the standing receive, [`ReceiveAll`]).
    fn receive_all(&self, to: actix::Recipient<ReadDone>) -> Call<Pipe, ReceiveAll, ()>;
    /// Starts a standing receive that calls `handler` with every message, in place
    /// ([`ReceiveAll::calling`]).
    fn receive_all_calling(
        &self,
        handler: impl FnMut(ReadDone) + Send + 'static,
    ) -> Call<Pipe, ReceiveAll, ()>;
    /// Ends the standing receive ([`StopReceiving`]); `Ok` carries the id one past its last
    /// `ReadDone`.
    fn stop_receiving(&self) -> Call<Pipe, StopReceiving, u64>;
    /// What the pipe is and what it negotiated.
    fn info(&self) -> Call<Pipe, GetInfo, PipeInfo>;
    /// A [`PipeWriter`]: writes small messages from the caller's task (see [`GetWriter`]).
    fn writer(&self) -> Call<Pipe, GetWriter, PipeWriter>;
    /// Reads spans of a remote region ([`RemoteRead`](super::remote::RemoteRead)); `Ok`
    /// carries the completion, with the filled buffer.
    fn remote_read(
        &self,
        read: super::remote::RemoteRead,
    ) -> Call<Pipe, super::remote::RemoteRead, super::remote::RemoteDone>;
    /// Writes spans into a remote region ([`RemoteWrite`](super::remote::RemoteWrite)).
    fn remote_write(
        &self,
        write: super::remote::RemoteWrite,
    ) -> Call<Pipe, super::remote::RemoteWrite, super::remote::RemoteDone>;
    /// Closes the pipe (see [`Close`]); resolves once every pending operation has completed,
    /// with the error they completed with.
    fn close(&self, how: Close) -> Call<Pipe, Close, Closed>;
}

impl PipeExt for Addr<Pipe> {
    fn write(&self, write: impl Into<Write>) -> Call<Pipe, Write, WriteDone> {
        call(self, write.into(), |done| match &done.result {
            Ok(()) => Ok(done),
            Err(e) => Err(e.clone()),
        })
    }

    fn write_done(&self, write: impl Into<Write>) -> Call<Pipe, Write, WriteDone> {
        call(self, write.into(), Ok)
    }

    fn read_descriptor(&self) -> Call<Pipe, ReadDescriptor, Descriptor> {
        call(self, ReadDescriptor, |d| d.descriptor)
    }

    fn read(&self, allocation: Allocation) -> Call<Pipe, Read, Message> {
        call(self, Read::new(allocation), read_result)
    }

    fn receive(&self) -> Call<Pipe, Receive, Message> {
        call(self, Receive::new(), read_result)
    }

    fn receive_reusing(&self, spare: Allocation) -> Call<Pipe, Receive, Message> {
        call(self, Receive::reusing(spare), read_result)
    }

    fn receive_all(&self, to: actix::Recipient<ReadDone>) -> Call<Pipe, ReceiveAll, ()> {
        call(self, ReceiveAll::to(to), |r| r)
    }

    fn receive_all_calling(
        &self,
        handler: impl FnMut(ReadDone) + Send + 'static,
    ) -> Call<Pipe, ReceiveAll, ()> {
        call(self, ReceiveAll::calling(handler), |r| r)
    }

    fn stop_receiving(&self) -> Call<Pipe, StopReceiving, u64> {
        call(self, StopReceiving, |r| r)
    }

    fn info(&self) -> Call<Pipe, GetInfo, PipeInfo> {
        call(self, GetInfo, Ok)
    }

    fn writer(&self) -> Call<Pipe, GetWriter, PipeWriter> {
        call(self, GetWriter, Ok)
    }

    fn remote_read(
        &self,
        read: super::remote::RemoteRead,
    ) -> Call<Pipe, super::remote::RemoteRead, super::remote::RemoteDone> {
        call(self, read, |d| d.result.clone().map(|_| d))
    }

    fn remote_write(
        &self,
        write: super::remote::RemoteWrite,
    ) -> Call<Pipe, super::remote::RemoteWrite, super::remote::RemoteDone> {
        call(self, write, |d| d.result.clone().map(|_| d))
    }

    fn close(&self, how: Close) -> Call<Pipe, Close, Closed> {
        call(self, how, Ok)
    }
}

/// One-step awaited requests to a context.
pub trait ContextExt {
    /// Opens a pipe to a listener: a URL, or a [`Connect`] with a retry policy (see
    /// [`Connect::retry`]).
    fn connect(&self, connect: impl Into<Connect>) -> Call<Context, Connect, Addr<Pipe>>;
    /// Listens on `urls`, handing accepted pipes to `subscriber` (see [`Listen`]).
    fn listen<S: Into<String>>(
        &self,
        urls: impl IntoIterator<Item = S>,
        subscriber: actix::Recipient<Accepted>,
    ) -> Call<Context, Listen, Listening>;
    /// Listens as `listen` says, with its requirements ([`Listen::require`]).
    fn listen_with(&self, listen: Listen) -> Call<Context, Listen, Listening>;
    /// Where the context serves metrics (see [`GetMetricsAddr`]).
    fn metrics_addr(&self) -> Call<Context, GetMetricsAddr, std::net::SocketAddr>;
    /// The counters of the context's `efa` endpoints, one per domain (see
    /// [`GetEfaStats`](super::GetEfaStats); feature `efa`).
    #[cfg(feature = "efa")]
    fn efa_stats(&self) -> Call<Context, super::GetEfaStats, Vec<super::EfaEndpointStats>>;
    /// Registers `buffer` for remote reads and writes (see [`Register`](super::remote::Register)).
    fn register(
        &self,
        buffer: impl Into<crate::message::Buffer>,
    ) -> Call<Context, super::remote::Register, crate::remote::Region>;
}

impl ContextExt for Addr<Context> {
    fn connect(&self, connect: impl Into<Connect>) -> Call<Context, Connect, Addr<Pipe>> {
        call(self, connect.into(), |r| r)
    }

    fn listen<S: Into<String>>(
        &self,
        urls: impl IntoIterator<Item = S>,
        subscriber: actix::Recipient<Accepted>,
    ) -> Call<Context, Listen, Listening> {
        call(self, Listen::new(urls, subscriber), |r| r)
    }

    fn listen_with(&self, listen: Listen) -> Call<Context, Listen, Listening> {
        call(self, listen, |r| r)
    }

    fn metrics_addr(&self) -> Call<Context, GetMetricsAddr, std::net::SocketAddr> {
        call(self, GetMetricsAddr, |r| r)
    }

    #[cfg(feature = "efa")]
    fn efa_stats(&self) -> Call<Context, super::GetEfaStats, Vec<super::EfaEndpointStats>> {
        call(self, super::GetEfaStats, |r| r)
    }

    fn register(
        &self,
        buffer: impl Into<crate::message::Buffer>,
    ) -> Call<Context, super::remote::Register, crate::remote::Region> {
        call(self, super::remote::Register::new(buffer), |r| r)
    }
}
