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
pub mod hardware;
mod inbox;
mod listener;
mod messages;
mod pipe;
pub(crate) mod placement;
mod pool;
pub(crate) mod remote;

/// What the crate root re-exports: the actors an application talks to and their messages.
pub mod api {
    #[cfg(feature = "cuda")]
    pub use super::context::IpcCacheStats;
    pub use super::context::{Context, ContextBuilder};
    #[cfg(feature = "efa")]
    pub use super::context::{EfaEndpointStats, GetEfaStats};
    pub use super::ext::{Call, ContextExt, PipeExt};
    pub use super::inbox::{inbox, Inbox};
    pub use super::listener::Listener;
    pub use super::messages::*;
    pub use super::pipe::{Pipe, PipeWriter};
}
pub(crate) use api::*;

impl From<actix::MailboxError> for crate::Error {
    /// The actor an awaited request went to stopped before answering (it never does while
    /// anyone holds its address; a mailbox timeout is reported as a [`crate::Error::Timeout`]).
    fn from(e: actix::MailboxError) -> Self {
        match e {
            actix::MailboxError::Timeout => crate::Error::Timeout {
                what: "waiting for the actor to answer",
                after: std::time::Duration::ZERO,
                origin: crate::Origin::default(),
            },
            actix::MailboxError::Closed => crate::Error::Closed {
                reason: "the actor stopped before answering".into(),
                origin: crate::Origin::default(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stopped_actor_is_a_closed_error() {
        let gone = crate::Error::from(actix::MailboxError::Closed);
        assert_eq!(gone.kind(), crate::ErrorClass::Closed);
    }
}
