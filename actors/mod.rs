//! Who moves it: the actor runtime.
//!
//! [`Context`] dials and listens; [`Listener`] accepts; [`Pipe`] orders operations; `Connection`
//! owns a transport connection and `Channel` a negotiated channel (both internal). Everything
//! runs on the arbiter that started the context: an actix `System`, or a tokio `LocalSet` under
//! one.

mod channel;
mod connection;
mod context;
mod ext;
#[cfg(feature = "efa")]
pub mod fabric;
pub mod hardware;
mod inbox;
mod listener;
mod messages;
mod pipe;
mod pool;
#[cfg(feature = "ibv")]
pub(crate) mod queue_pair;

#[cfg(feature = "cuda")]
pub use context::IpcCacheStats;
pub use context::{Config, Context, ContextBuilder};
pub use ext::{Call, ContextExt, PipeExt};
pub use inbox::{inbox, Inbox};
pub use listener::Listener;
pub use messages::*;
pub use pipe::{Pipe, PipeWriter};
