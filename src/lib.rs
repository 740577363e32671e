//! actorpipe: a tensor-aware point-to-point communication runtime where every connection is an
//! actor.
//!
//! Two processes exchange [`Message`]s made of metadata, small CPU payloads and large tensors.
//! A [`Context`] dials ([`Connect`]) and listens ([`Listen`]); each connection is a [`Pipe`]
//! actor to which you send [`Write`], [`ReadDescriptor`], [`Read`] and [`Close`], and which
//! answers with [`WriteDone`], [`DescriptorReady`], [`ReadDone`] and [`Closed`], either to an
//! awaiting caller or to a recipient of your choice.
//!
//! The root and the [`prelude`] hold what an application uses. [`transport`] and [`channel`]
//! hold the backends a [`ContextBuilder`] takes ([`transport::Shm`], [`channel::Mpt`], ...) and
//! their traits; [`cuda`] (feature `cuda`) the GPU buffers a tensor can live in; [`efa`]
//! (feature `efa`) the libfabric endpoint's settings; [`metrics`] the Prometheus exporter.
//! docs/architecture.md shows how the crate is built.
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

pub mod channel;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod metrics;
/// Registered memory and one-sided reads and writes with notifications (docs/remote.md): the
/// owner registers a buffer with its context ([`remote::Register`], [`ContextExt::register`])
/// and hands the region's [`remote::RegionDescriptor`] to peers; a peer reads or writes spans
/// of it on a pipe to the owner ([`remote::RemoteRead`], [`remote::RemoteWrite`]).
pub mod remote {
    pub use crate::actors::remote::{
        Direction, FromRegion, IntoRegion, Register, Remote, RemoteDone, RemoteInfo, RemoteOp,
        RemoteRead, RemoteWrite, SubscribeNotifications,
    };
    pub use crate::remote_core::{Notification, Region, RegionDescriptor, Span};
}
#[path = "remote/mod.rs"]
pub(crate) mod remote_core;
pub mod transport;

#[path = "../actors/mod.rs"]
mod actors;

/// The `efa` backend's settings and counters (feature `efa`): [`efa::EndpointConfig`] for
/// [`ContextBuilder::efa_config`], and [`efa::FabricStats`], the counters ([`efa::Stats`]) of
/// the endpoint that every pipe of a context on one NIC shares, which a context gives per
/// domain ([`GetEfaStats`], [`ContextExt::efa_stats`]). The transport and the channel are
/// [`transport::Efa`] and [`channel::Efa`].
#[cfg(feature = "efa")]
pub mod efa {
    pub use crate::actors::hardware::efa::channel::STAND_IN_AFTER;
    #[cfg(feature = "faults")]
    pub use crate::actors::hardware::efa::FabricFaults;
    pub use crate::actors::hardware::efa::{EndpointConfig, FabricStats};
    pub use crate::backend::efa::engine::Stats;
}

/// The crate's internals, for its own tools and tests (see `src/internal/mod.rs`).
#[doc(hidden)]
pub mod internal;
// Inside the crate the internal modules are named from the root (`crate::backend`); some serve
// only features that may be off.
#[allow(unused_imports)]
pub(crate) use internal::{
    auth, backend, copy, error, fds, handshake, keymap, message, negotiate, topology, wire,
};

pub use actors::api::*;
/// Shared, read-only bytes, for [`Buffer::Shared`] (the `bytes` crate's type).
pub use bytes::Bytes;
pub use copy::{set_threads as set_copy_threads, threads as copy_threads};
pub use error::{Error, ErrorClass, Origin, Result};
pub use fds::{usage as fd_usage, Usage as FdUsage};
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
    pub use crate::actors::api::{
        inbox, Accepted, Call, ChannelInfo, Close, Closed, Connect, ContextBuilder, ContextExt,
        DescriptorReady, GetInfo, GetMetricsAddr, GetWriter, Inbox, LaneInfo, Listen, Listener,
        Listening, NotListening, Op, Pipe, PipeExt, PipeInfo, PipeWriter, ReadDescriptor, ReadDone,
        Receive, ReceiveAll, Recycle, Retry, StopListening, StopReceiving, Subscribe, WriteDone,
    };
    pub use crate::error::{Error, ErrorClass, Origin};
    pub use crate::message::{
        Allocation, Buffer, Descriptor, Device, Payload, PayloadDescriptor, Tensor,
        TensorDescriptor,
    };
    pub use crate::wire::Limits;
    pub use bytes::Bytes;
}
