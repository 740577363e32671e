//! Who moves it: the actor runtime.
//!
//! [`Context`] dials and listens; [`Listener`] accepts; [`Pipe`] orders operations; `Connection`
//! owns a transport connection and `Channel` a negotiated channel (both internal). Everything
//! runs on the arbiter that started the context: an actix `System`, or a tokio `LocalSet` under
//! one.

mod channel;
mod connection;
mod context;
mod inbox;
mod listener;
mod messages;
mod pipe;
mod pool;

pub use context::{Config, Context, ContextBuilder};
pub use inbox::{inbox, Inbox};
pub use listener::Listener;
pub use messages::*;
pub use pipe::Pipe;
