//! The `Channel` actor: owns one negotiated channel of one pipe and moves its tensors.
//!
//! The pipe hands it each tensor with the connection tickets reserved for it, so the channel's
//! traffic on the shared connection lands exactly where the pipe ordered it. Completions go
//! straight to the pipe's queue. The basic channel is implemented here; channels with their own
//! data path join as further kinds.

use actix::{Actor, ActorContext, Context, Handler, Message};

use super::connection::Link;
use crate::error::{Error, Origin};
use crate::transport::stream::{InOp, OutOp, Reply};

/// Which channel backend this actor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChannelKind {
    /// Tensor bytes in chunks over the pipe's connection.
    Basic { chunk_size: usize },
}

/// One negotiated channel of one pipe.
pub struct Channel {
    kind: ChannelKind,
    link: Link,
    reply: Reply,
    origin: Origin,
}

/// Send one tensor.
#[derive(Debug)]
pub(crate) struct SendTensor {
    pub ticket: u64,
    pub seq: u64,
    pub index: u32,
    pub buffer: Vec<u8>,
}

impl Message for SendTensor {
    type Result = ();
}

/// Receive one tensor into `buffer`.
#[derive(Debug)]
pub(crate) struct RecvTensor {
    pub ticket: u64,
    pub seq: u64,
    pub index: u32,
    pub buffer: Vec<u8>,
}

impl Message for RecvTensor {
    type Result = ();
}

/// Stop once everything already in the mailbox is handed on.
#[derive(Debug)]
pub(crate) struct StopChannel;

impl Message for StopChannel {
    type Result = ();
}

impl Channel {
    pub(crate) fn new(kind: ChannelKind, link: Link, reply: Reply, origin: Origin) -> Self {
        Channel {
            kind,
            link,
            reply,
            origin,
        }
    }

    fn gone(&self) -> impl FnOnce() -> Error + '_ {
        || Error::Closed {
            reason: "connection already stopped".into(),
            origin: self.origin.clone(),
        }
    }
}

impl Actor for Channel {
    type Context = Context<Self>;
}

impl Handler<SendTensor> for Channel {
    type Result = ();

    fn handle(&mut self, m: SendTensor, _: &mut Self::Context) {
        match self.kind {
            ChannelKind::Basic { chunk_size } => self.link.write(
                OutOp::Tensor {
                    ticket: m.ticket,
                    seq: m.seq,
                    index: m.index,
                    buffer: m.buffer,
                    chunk_size,
                    reply: self.reply.clone(),
                },
                self.gone(),
            ),
        }
    }
}

impl Handler<RecvTensor> for Channel {
    type Result = ();

    fn handle(&mut self, m: RecvTensor, _: &mut Self::Context) {
        match self.kind {
            ChannelKind::Basic { .. } => self.link.read(
                InOp::Tensor {
                    ticket: m.ticket,
                    seq: m.seq,
                    index: m.index,
                    buffer: m.buffer,
                    reply: self.reply.clone(),
                },
                self.gone(),
            ),
        }
    }
}

impl Handler<StopChannel> for Channel {
    type Result = ();

    fn handle(&mut self, _: StopChannel, ctx: &mut Self::Context) {
        ctx.stop();
    }
}
