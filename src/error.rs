//! One error type for the whole runtime.
//!
//! Each variant is a failure class a caller acts on differently: reconnect after
//! [`Error::PeerClosed`], fix the peer after [`Error::Protocol`], raise a limit after
//! [`Error::LimitExceeded`], pick another backend after [`Error::Unavailable`], retry after
//! [`Error::Timeout`] or [`Error::Connect`]. Every variant carries an [`Origin`] saying which pipe,
//! which peer and which backend it happened on.
//!
//! `Error` is `Clone` because one failure completes every pending operation of a pipe: each of
//! them receives the same error.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Where an error happened: the pipe, the peer and the backend involved.
///
/// Any field may be empty when it is not known yet (an error while connecting has no pipe).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    /// Process-local pipe id, if a pipe exists.
    pub pipe: Option<u64>,
    /// The peer's address, as a URL (`tcp://127.0.0.1:5000`).
    pub peer: String,
    /// Backend in use (`tcp`, `tcp/basic`, …).
    pub backend: String,
}

impl Origin {
    /// An origin for a peer reached over a backend, before any pipe exists.
    pub fn new(peer: impl Into<String>, backend: impl Into<String>) -> Self {
        Origin {
            pipe: None,
            peer: peer.into(),
            backend: backend.into(),
        }
    }

    /// The same origin, attached to a pipe.
    pub fn with_pipe(mut self, pipe: u64) -> Self {
        self.pipe = Some(pipe);
        self
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut sep = |f: &mut fmt::Formatter<'_>| {
            let s = if first { "" } else { ", " };
            first = false;
            f.write_str(s)
        };
        f.write_str("[")?;
        if let Some(p) = self.pipe {
            sep(f)?;
            write!(f, "pipe {p}")?;
        }
        if !self.peer.is_empty() {
            sep(f)?;
            write!(f, "peer {}", self.peer)?;
        }
        if !self.backend.is_empty() {
            sep(f)?;
            write!(f, "backend {}", self.backend)?;
        }
        f.write_str("]")
    }
}

/// Every failure actorpipe reports.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer closed the pipe or the connection went away. Pending operations cannot finish;
    /// open a new pipe to continue.
    #[error("peer closed the pipe{}: {reason} {origin}", if *graceful { " gracefully" } else { "" })]
    PeerClosed {
        /// What was observed (a close frame and its reason, end of stream, reset).
        reason: String,
        /// The peer closed gracefully: every write it issued before closing was delivered.
        /// `false` for an abort, a crash or a lost connection.
        graceful: bool,
        /// Where.
        origin: Origin,
    },
    /// This side closed the pipe (a `Close` request); operations issued before or after it end
    /// with this error.
    #[error("pipe closed locally: {reason} {origin}")]
    Closed {
        /// Why it was closed.
        reason: String,
        /// Where.
        origin: Origin,
    },
    /// The peer sent something this protocol does not allow: bytes that do not decode, a frame
    /// out of place, a sequence number that does not match. The pipe is closed; the peer is
    /// buggy or not an actorpipe peer.
    #[error("protocol violation: {detail} {origin}")]
    Protocol {
        /// What was wrong.
        detail: String,
        /// Where.
        origin: Origin,
    },
    /// The peer speaks another protocol version. Upgrade one side.
    #[error("protocol version mismatch: we speak v{ours}, the peer speaks v{theirs} {origin}")]
    Version {
        /// Our version.
        ours: u32,
        /// The peer's version.
        theirs: u32,
        /// Where.
        origin: Origin,
    },
    /// The peer could not prove it knows the shared secret (or we could not: one side has a
    /// secret and the other none). Configure the same secret on both contexts.
    #[error("authentication failed: {reason} {origin}")]
    Unauthenticated {
        /// What went wrong.
        reason: String,
        /// Where.
        origin: Origin,
    },
    /// A size or count went over a configured limit; nothing was allocated for it. Raise the
    /// limit in the context builder if the peer is legitimate.
    #[error("limit exceeded: {limit} is {value}, the maximum is {max} {origin}")]
    LimitExceeded {
        /// Which limit (`frame size`, `tensor count`, …).
        limit: &'static str,
        /// The value announced or requested.
        value: u64,
        /// The configured maximum.
        max: u64,
        /// Where.
        origin: Origin,
    },
    /// A backend cannot run here, or the two peers share no backend for something they need.
    #[error("backend {backend} unavailable: {reason}")]
    Unavailable {
        /// The backend's name.
        backend: String,
        /// Why.
        reason: String,
    },
    /// A device (a GPU) or its driver refused an operation: an allocation that does not fit, a
    /// copy the driver failed, a handle from the peer that does not open. The message names the
    /// driver call and its error code.
    #[error("device error: {detail} {origin}")]
    Device {
        /// The call and what the driver said.
        detail: String,
        /// Where.
        origin: Origin,
    },
    /// Something did not happen in time.
    #[error("timed out after {after:?} while {what} {origin}")]
    Timeout {
        /// What was being waited for.
        what: &'static str,
        /// The configured duration.
        after: Duration,
        /// Where.
        origin: Origin,
    },
    /// Opening a connection failed (refused, unreachable, bad address). Nothing was created;
    /// retrying later may work.
    #[error("cannot connect to {url}: {source}")]
    Connect {
        /// The URL that was dialed.
        url: String,
        /// The operating system's answer.
        source: Arc<std::io::Error>,
    },
    /// The listener is alive but turned the pipe away for now: too many pipes were being set up
    /// at once, it is out of file descriptors, or the pipe's connections did not all join in
    /// time. Nothing was created; retry later (with backoff), or raise the listener's limits
    /// (`ContextBuilder::max_pending_pipes`, `RLIMIT_NOFILE`; see docs/operations.md).
    #[error("the listener refused the pipe for now: {reason} {origin}")]
    Refused {
        /// The listener's reason ("too many pending handshakes", "listener out of file
        /// descriptors", …).
        reason: String,
        /// Where.
        origin: Origin,
    },
    /// Binding a listening endpoint failed (address in use, not local, no permission).
    #[error("cannot listen on {url}: {source}")]
    Listen {
        /// The URL to listen on.
        url: String,
        /// The operating system's answer.
        source: Arc<std::io::Error>,
    },
    /// An I/O error on an established connection.
    #[error("I/O error while {op}: {source} {origin}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The operating system's answer.
        source: Arc<std::io::Error>,
        /// Where.
        origin: Origin,
    },
    /// The caller asked for something that does not fit: a URL that does not parse, a `Read`
    /// whose buffers do not match the descriptor, a `Read` without a descriptor. The pipe stays
    /// usable.
    #[error("invalid argument: {detail}")]
    InvalidArgument {
        /// What was wrong.
        detail: String,
    },
}

impl Error {
    /// A protocol violation.
    pub fn protocol(detail: impl Into<String>, origin: &Origin) -> Self {
        Error::Protocol {
            detail: detail.into(),
            origin: origin.clone(),
        }
    }

    /// An I/O error while doing `op`.
    pub fn io(op: &'static str, source: std::io::Error, origin: &Origin) -> Self {
        Error::Io {
            op,
            source: Arc::new(source),
            origin: origin.clone(),
        }
    }

    /// An invalid argument.
    pub fn invalid(detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            detail: detail.into(),
        }
    }

    /// This error's class, to match on without strings.
    pub fn kind(&self) -> ErrorClass {
        match self {
            Error::PeerClosed { .. } => ErrorClass::PeerClosed,
            Error::Closed { .. } => ErrorClass::Closed,
            Error::Protocol { .. } => ErrorClass::Protocol,
            Error::Version { .. } => ErrorClass::Version,
            Error::Unauthenticated { .. } => ErrorClass::Auth,
            Error::LimitExceeded { .. } => ErrorClass::Limit,
            Error::Unavailable { .. } => ErrorClass::Unavailable,
            Error::Device { .. } => ErrorClass::Device,
            Error::Timeout { .. } => ErrorClass::Timeout,
            Error::Connect { .. } => ErrorClass::Connect,
            Error::Refused { .. } => ErrorClass::Refused,
            Error::Listen { .. } => ErrorClass::Listen,
            Error::Io { .. } => ErrorClass::Io,
            Error::InvalidArgument { .. } => ErrorClass::InvalidArgument,
        }
    }

    /// The short name of this error's class, stable for logs and metrics labels
    /// (`self.kind().as_str()`).
    pub fn class(&self) -> &'static str {
        self.kind().as_str()
    }

    /// Attach a pipe id to the error's origin, where it has one.
    pub(crate) fn at_pipe(mut self, pipe: u64) -> Self {
        match &mut self {
            Error::PeerClosed { origin, .. }
            | Error::Closed { origin, .. }
            | Error::Protocol { origin, .. }
            | Error::Version { origin, .. }
            | Error::Unauthenticated { origin, .. }
            | Error::LimitExceeded { origin, .. }
            | Error::Timeout { origin, .. }
            | Error::Refused { origin, .. }
            | Error::Device { origin, .. }
            | Error::Io { origin, .. } => origin.pipe = Some(pipe),
            _ => {}
        }
        self
    }
}

/// The class of an [`Error`]: what a caller acts on, as a `Copy` value to match on
/// ([`Error::kind`]). [`as_str`](Self::as_str) is the stable name used in logs and metrics
/// labels ([`Error::class`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// [`Error::PeerClosed`] (`peer_closed`).
    PeerClosed,
    /// [`Error::Closed`] (`closed`).
    Closed,
    /// [`Error::Protocol`] (`protocol`).
    Protocol,
    /// [`Error::Version`] (`version`).
    Version,
    /// [`Error::Unauthenticated`] (`auth`).
    Auth,
    /// [`Error::LimitExceeded`] (`limit`).
    Limit,
    /// [`Error::Unavailable`] (`unavailable`).
    Unavailable,
    /// [`Error::Device`] (`device`).
    Device,
    /// [`Error::Timeout`] (`timeout`).
    Timeout,
    /// [`Error::Connect`] (`connect`).
    Connect,
    /// [`Error::Refused`] (`refused`).
    Refused,
    /// [`Error::Listen`] (`listen`).
    Listen,
    /// [`Error::Io`] (`io`).
    Io,
    /// [`Error::InvalidArgument`] (`invalid_argument`).
    InvalidArgument,
}

impl ErrorClass {
    /// The stable short name (`peer_closed`, `timeout`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::PeerClosed => "peer_closed",
            ErrorClass::Closed => "closed",
            ErrorClass::Protocol => "protocol",
            ErrorClass::Version => "version",
            ErrorClass::Auth => "auth",
            ErrorClass::Limit => "limit",
            ErrorClass::Unavailable => "unavailable",
            ErrorClass::Device => "device",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Connect => "connect",
            ErrorClass::Refused => "refused",
            ErrorClass::Listen => "listen",
            ErrorClass::Io => "io",
            ErrorClass::InvalidArgument => "invalid_argument",
        }
    }

    /// Whether retrying the same request later may succeed (the peer or listener was busy,
    /// slow or unreachable: `refused`, `timeout`, `connect`, `peer_closed`).
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorClass::Refused
                | ErrorClass::Timeout
                | ErrorClass::Connect
                | ErrorClass::PeerClosed
        )
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `Result` with actorpipe's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_display_names_what_is_known() {
        let o = Origin::new("tcp://127.0.0.1:1", "tcp").with_pipe(7);
        assert_eq!(
            o.to_string(),
            "[pipe 7, peer tcp://127.0.0.1:1, backend tcp]"
        );
        assert_eq!(Origin::default().to_string(), "[]");
    }

    #[test]
    fn error_messages_carry_context() {
        let e = Error::LimitExceeded {
            limit: "tensor count",
            value: 10,
            max: 5,
            origin: Origin::new("tcp://h:1", "tcp"),
        }
        .at_pipe(3);
        let s = e.to_string();
        assert!(s.contains("tensor count is 10"), "{s}");
        assert!(s.contains("pipe 3"), "{s}");
        assert_eq!(e.class(), "limit");
        assert_eq!(e.kind(), ErrorClass::Limit);
    }

    #[test]
    fn every_class_has_its_name() {
        let refused = Error::Refused {
            reason: "too many pending handshakes".into(),
            origin: Origin::default(),
        };
        assert_eq!(refused.kind(), ErrorClass::Refused);
        assert_eq!(refused.class(), "refused");
        assert!(refused.kind().is_transient());
        assert!(!ErrorClass::Protocol.is_transient());
        assert_eq!(ErrorClass::InvalidArgument.to_string(), "invalid_argument");
    }
}
