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
//! use actorpipe::*;
//!
//! #[actix::main]
//! async fn main() -> Result<()> {
//!     let ctx = Context::builder().start();
//!     let pipe = ctx.send(Connect::new("tcp://127.0.0.1:5000")).await.unwrap()?;
//!     let msg = Message::new().with_tensor(Tensor::cpu(vec![1u8; 1 << 20]));
//!     let done = pipe.send(Write::new(msg)).await.unwrap();
//!     done.result?;
//!     Ok(())
//! }
//! ```
#![warn(missing_docs)]

pub mod auth;
pub mod backends;
pub mod channel;
pub mod copy;
pub mod error;
pub mod handshake;
pub mod message;
pub mod metrics;
pub mod negotiate;
pub mod topology;
pub mod transport;
pub mod verbs;
pub mod wire;

#[path = "../actors/mod.rs"]
pub mod actors;

pub use actors::*;
pub use error::{Error, Origin, Result};
pub use message::{
    Allocation, Buffer, Descriptor, Device, Message, Payload, PayloadDescriptor, Tensor,
    TensorDescriptor,
};
pub use wire::Limits;
