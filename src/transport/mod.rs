//! Transports: byte movers for control frames and small payloads.
//!
//! A transport turns a URL into a connected byte stream (a [`Stream`]: a read half and a write
//! half), and a listening URL into an [`Acceptor`] of such streams. Everything above it (framing,
//! ordering, the handshake) is shared: the crate's stream loops are the read and write loops that every
//! stream transport runs, so a transport only has to provide bytes. Readiness comes from tokio
//! (epoll on sockets, eventfd through `AsyncFd` for shared memory); no transport runs a busy
//! thread unless asked to.

pub(crate) mod liveness;
pub(crate) mod stream;
pub(crate) mod turns;
mod url;

pub use url::{Host, Url};

#[cfg(feature = "efa")]
pub use crate::actors::hardware::efa::transport::Efa;
#[cfg(feature = "ibv")]
pub use crate::backend::ibv::transport::Ibv;
pub use crate::backend::shm::Shm;
pub use crate::backend::tcp::{Keepalive, Tcp};

use std::future::Future;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::error::Error;

/// The scheme of a URL (`tcp` in `tcp://127.0.0.1:5`).
pub fn scheme(url: &str) -> Result<&str, Error> {
    match url.split_once("://") {
        Some((s, _)) if !s.is_empty() => Ok(s),
        _ => Err(Error::invalid(format!(
            "bad URL {url:?}: expected scheme://address"
        ))),
    }
}

/// The read half of a connection.
pub type BoxRead = Box<dyn ReadHalf>;
/// The write half of a connection.
pub type BoxWrite = Box<dyn WriteHalf>;

/// What a [`BoxRead`] holds: any `AsyncRead` that is `Send`, `Unpin` and `'static` (a blanket
/// impl covers them all). `Any` lets a transport recognise its own halves again, as
/// `tcp::rehome` does to move a socket's readiness to another thread.
pub trait ReadHalf: AsyncRead + Send + Unpin + std::any::Any {}
impl<T: AsyncRead + Send + Unpin + std::any::Any> ReadHalf for T {}

/// What a [`BoxWrite`] holds: any `AsyncWrite` that is `Send`, `Unpin` and `'static`.
pub trait WriteHalf: AsyncWrite + Send + Unpin + std::any::Any {}
impl<T: AsyncWrite + Send + Unpin + std::any::Any> WriteHalf for T {}
/// A boxed future, as transports return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// A connected byte stream, split in halves so reading and writing proceed independently.
pub struct Stream {
    /// Bytes from the peer.
    pub read: BoxRead,
    /// Bytes to the peer.
    pub write: BoxWrite,
    /// The peer's address as a URL.
    pub peer: String,
    /// The local address as a URL.
    pub local: String,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("peer", &self.peer)
            .field("local", &self.local)
            .finish()
    }
}

/// A bound listening endpoint that yields connected streams.
pub trait Acceptor {
    /// The URLs this endpoint is reachable at (ports resolved).
    fn urls(&self) -> Vec<String>;
    /// Waits for the next incoming connection.
    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<Stream>>;
}

/// A transport backend: how to reach a peer and how to be reached. Its `Debug` output shows its
/// settings (a [`ContextBuilder`](crate::ContextBuilder)'s `Debug` lists every backend so).
pub trait Transport: std::fmt::Debug + Send + Sync + 'static {
    /// The backend's name in brochures and URLs (`tcp`).
    fn name(&self) -> &'static str;
    /// Default priority in negotiation; higher wins.
    fn priority(&self) -> i32;
    /// The domain descriptor: both peers must advertise the same string to use it.
    fn domain(&self) -> String;
    /// Whether it can run here; `Err` says why not.
    fn viable(&self) -> Result<(), String> {
        Ok(())
    }
    /// The most file descriptors one connection of this transport holds on the listening side
    /// while it is set up (a listener reserves them before admitting a pipe).
    fn descriptors(&self) -> usize {
        1
    }
    /// Connects to `url` (the scheme is this transport's; each transport parses its own URLs).
    fn connect<'a>(
        &'a self,
        url: &'a str,
        timeout: std::time::Duration,
    ) -> BoxFuture<'a, Result<Stream, Error>>;
    /// Connects to `url` from the local address `source` (a given NIC). Transports without
    /// addresses of that kind refuse.
    fn connect_from<'a>(
        &'a self,
        url: &'a str,
        timeout: std::time::Duration,
        source: std::net::IpAddr,
    ) -> BoxFuture<'a, Result<Stream, Error>> {
        let _ = timeout;
        Box::pin(async move {
            Err(Error::Unavailable {
                backend: self.name().into(),
                reason: format!("cannot connect to {url} from {source}: no local addresses here"),
            })
        })
    }
    /// Binds a listening endpoint at `url`.
    fn listen<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Box<dyn Acceptor>, Error>>;

    /// The URL to listen on when a listener enables this transport by itself (a pipe whose
    /// control stream moves here after a TCP bootstrap); `None` if it cannot be auto-enabled.
    fn auto_listen_url(&self) -> Option<String> {
        None
    }

    /// The backend itself, for code that adjusts a transport of a known type (the context
    /// builder's [`keepalive`](crate::ContextBuilder::keepalive) on [`Tcp`]). `None` by default.
    ///
    /// [`Tcp`]: crate::backend::tcp::Tcp
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}
