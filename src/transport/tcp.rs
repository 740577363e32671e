//! The TCP transport: IPv4 and IPv6 (link-local with scope ids too), TCP_NODELAY, readiness
//! through tokio's epoll reactor.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use super::{Acceptor, BoxFuture, Stream, Transport, Url};
use crate::error::Error;

/// The TCP transport. Works between any two hosts that can reach each other, so its domain is
/// empty and its priority the lowest.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tcp;

/// Turns a connected socket into a [`Stream`].
pub fn into_stream(s: TcpStream) -> std::io::Result<Stream> {
    s.set_nodelay(true)?;
    let peer = Url::from_socket("tcp", s.peer_addr()?).to_string();
    let local = Url::from_socket("tcp", s.local_addr()?).to_string();
    let (r, w) = s.into_split();
    Ok(Stream {
        read: Box::new(r),
        write: Box::new(w),
        peer,
        local,
    })
}

/// Connects to every resolved address in turn until one answers.
pub async fn connect(url: &Url, timeout: Duration) -> Result<Stream, Error> {
    let text = url.to_string();
    let connect_err = |e: std::io::Error| Error::Connect {
        url: text.clone(),
        source: Arc::new(e),
    };
    let addrs = url.socket_addrs().await?;
    let attempt = async {
        let mut last = None;
        for a in addrs {
            match TcpStream::connect(a).await {
                Ok(s) => return into_stream(s).map_err(connect_err),
                Err(e) => last = Some(e),
            }
        }
        Err(connect_err(last.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no address")
        })))
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            what: "connecting",
            after: timeout,
            origin: crate::error::Origin::new(text.clone(), "tcp"),
        }),
    }
}

/// A bound TCP listening socket.
pub struct TcpAcceptor {
    listener: TcpListener,
    url: String,
}

impl TcpAcceptor {
    /// Binds `url` (port 0 picks a free port).
    pub async fn bind(url: &Url) -> Result<TcpAcceptor, Error> {
        let addrs = url.socket_addrs().await?;
        let mut last = None;
        for a in addrs {
            match TcpListener::bind(a).await {
                Ok(listener) => {
                    let url = Url::from_socket(
                        "tcp",
                        listener.local_addr().map_err(|e| {
                            Error::io("reading the bound address", e, &Default::default())
                        })?,
                    )
                    .to_string();
                    return Ok(TcpAcceptor { listener, url });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(Error::Listen {
            url: url.to_string(),
            source: Arc::new(last.unwrap_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "no address")
            })),
        })
    }
}

impl Acceptor for TcpAcceptor {
    fn urls(&self) -> Vec<String> {
        vec![self.url.clone()]
    }

    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<Stream>> {
        Box::pin(async move {
            let (s, _) = self.listener.accept().await?;
            into_stream(s)
        })
    }
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn priority(&self) -> i32 {
        0
    }

    fn domain(&self) -> String {
        String::new()
    }

    fn connect<'a>(
        &'a self,
        url: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Stream, Error>> {
        Box::pin(async move { connect(&Url::parse(url)?, timeout).await })
    }

    fn listen<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Box<dyn Acceptor>, Error>> {
        Box::pin(async move {
            Ok(Box::new(TcpAcceptor::bind(&Url::parse(url)?).await?) as Box<dyn Acceptor>)
        })
    }
}
