//! actorpipe: a tensor-aware point-to-point communication runtime where every connection is an
//! actor.
//!
//! Two processes exchange [`Message`]s made of metadata, small CPU payloads and large tensors.
//! A [`Context`] dials ([`Connect`]) and listens ([`Listen`]); each connection is a [`Pipe`]
//! actor to which you send [`Write`], [`ReadDescriptor`], [`Read`] and [`Close`], and which
//! answers with [`WriteDone`], [`DescriptorReady`], [`ReadDone`] and [`Closed`], either to an
//! awaiting caller or to a recipient of your choice.
//!
//! The crate is layered: `message`, `wire`, `negotiate`, `handshake`, `transport` and `channel`
//! are plain data and raw I/O, usable and testable without actors; [`actors`] drives them.
//!
//! ```no_run
//! use actorpipe::prelude::*;
//!
//! #[actix::main]
//! async fn main() -> actorpipe::Result<()> {
//!     let ctx = actorpipe::Context::builder().start();
//!     let pipe = ctx.connect("tcp://127.0.0.1:5000").await?;
//!     let msg = actorpipe::Message::new().with_tensor(Tensor::cpu(vec![1u8; 1 << 20]));
//!     let done = pipe.write(msg).await?; // the buffers come back in done.message
//!     let reply = pipe.receive().await?;
//!     println!("{} bytes back; wrote message {}", reply.total_bytes(), done.id);
//!     Ok(())
//! }
//! ```
//!
//! [`prelude`] holds the names an application needs without the ones that clash with
//! `actix::prelude` and `std::io::prelude`.
#![warn(missing_docs)]

pub mod auth;
pub mod backend;
pub mod channel;
pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod fds;
pub mod handshake;
pub mod keymap;
pub mod message;
pub mod metrics;
pub mod negotiate;
pub mod topology;
pub mod transport;
pub mod wire;

#[path = "../actors/mod.rs"]
pub mod actors;

pub use actors::*;
/// Shared, read-only bytes, for [`Buffer::Shared`] (the `bytes` crate's type).
pub use bytes::Bytes;
pub use error::{Error, ErrorClass, Origin, Result};
pub use message::{
    Allocation, Buffer, Descriptor, Device, Message, Payload, PayloadDescriptor, Tensor,
    TensorDescriptor,
};
pub use wire::Limits;

/// The names an application needs, safe to glob-import next to `actix::prelude::*` and
/// `std::io::prelude::*`: everything at the crate root except `Context`, `Message`, `Read`,
/// `Write` and `Result`, whose names clash with actix's, std's or `std::io`'s. Name those as
/// `actorpipe::Context`, `actorpipe::Message`, `actorpipe::Read`, `actorpipe::Write`. With the
/// one-step calls of [`PipeExt`] and [`ContextExt`] (`pipe.write(m).await?`), most programs
/// need none of them but the first two.
pub mod prelude {
    pub use crate::actors::{
        inbox, Accepted, Call, ChannelInfo, Close, Closed, Connect, ContextBuilder, ContextExt,
        DescriptorReady, Endpoint, GetInfo, GetMetricsAddr, GetWriter, Inbox, LaneInfo, Listen,
        Listener, Listening, NotListening, Op, Pipe, PipeExt, PipeInfo, PipeWriter, ReadDescriptor,
        ReadDone, Receive, ReceiveAll, Recycle, Retry, StopListening, StopReceiving, Subscribe,
        WriteDone,
    };
    pub use crate::error::{Error, ErrorClass, Origin};
    pub use crate::message::{
        Allocation, Buffer, Descriptor, Device, Payload, PayloadDescriptor, Tensor,
        TensorDescriptor,
    };
    pub use crate::wire::Limits;
    pub use bytes::Bytes;
}
