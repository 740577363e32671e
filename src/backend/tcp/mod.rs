//! The TCP transport: IPv4 and IPv6 (link-local with scope ids too), TCP_NODELAY, readiness
//! through tokio's epoll reactor.

use std::sync::Arc;
use std::time::Duration;

use std::net::{IpAddr, SocketAddr};

use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::error::Error;
use crate::transport::{Acceptor, BoxFuture, Stream, Transport, Url};

/// The TCP transport. Works between any two hosts that can reach each other, so its domain is
/// empty and its priority the lowest.
#[derive(Debug, Clone, Copy)]
pub struct Tcp {
    /// Liveness checking of every connection; `None` turns it off.
    pub keepalive: Option<Keepalive>,
}

impl Default for Tcp {
    fn default() -> Self {
        Tcp {
            keepalive: Some(Keepalive::default()),
        }
    }
}

/// How a silent peer is found out. The kernel probes an idle connection every `interval`; one
/// whose probes go unanswered for `timeout` fails with a timeout, so a peer that dies without
/// closing (host frozen, cable pulled) while the connection is idle is detected within about
/// `timeout` (whole seconds, at least 1 s each). A killed process is detected at once: its
/// kernel closes the connection.
///
/// While data of ours is unacknowledged the kernel retransmits instead of probing, and gives up
/// only after its retransmission limit (minutes). `unacked_timeout` shortens that
/// (`TCP_USER_TIMEOUT`), with a catch measured here: the kernel then also aborts a connection
/// whose receiver advertises a zero window for that long, i.e. a live peer whose application
/// does not read. It is off by default for that reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Idle time before the first probe, and time between probes.
    pub interval: Duration,
    /// Silence after which an idle connection is declared dead.
    pub timeout: Duration,
    /// If set, data unacknowledged (or a zero window) for this long aborts the connection.
    pub unacked_timeout: Option<Duration>,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            unacked_timeout: None,
        }
    }
}

fn setsockopt(fd: std::os::fd::RawFd, level: i32, name: i32, v: i32) -> std::io::Result<()> {
    // SAFETY: `fd` is an open socket owned by the caller; the option value is a valid c_int that
    // lives for the duration of the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Keepalive {
    /// Applies this policy to a connected socket.
    pub fn apply(&self, s: &TcpStream) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let fd = s.as_raw_fd();
        let interval = self.interval.as_secs().clamp(1, i32::MAX as u64) as i32;
        let timeout = self.timeout.as_secs().max(interval as u64) as i32;
        let probes = ((timeout - interval) / interval).max(1);
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
        setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, interval)?;
        setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval)?;
        setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, probes)?;
        let ms = self
            .unacked_timeout
            .map_or(0, |t| t.as_millis().clamp(1, i32::MAX as u128) as i32);
        setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms)
    }
}

impl Tcp {
    /// TCP with the given liveness policy (`None`: the kernel's defaults, which take hours).
    pub fn with_keepalive(keepalive: Option<Keepalive>) -> Self {
        Tcp { keepalive }
    }
}

/// Turns a connected socket into a [`Stream`] with the default keepalive.
pub fn into_stream(s: TcpStream) -> std::io::Result<Stream> {
    into_stream_with(s, Some(Keepalive::default()))
}

/// Turns a connected socket into a [`Stream`], applying `keepalive`.
pub fn into_stream_with(s: TcpStream, keepalive: Option<Keepalive>) -> std::io::Result<Stream> {
    s.set_nodelay(true)?;
    if let Some(k) = keepalive {
        k.apply(&s)?;
    }
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

/// Moves a TCP connection's readiness to the runtime `rt` (another thread's), so that the
/// thread that runs its loops also hears from epoll about it, instead of through the thread
/// whose runtime dialed or accepted it. The socket is duplicated, the copy registered with
/// `rt`, and the original (with its registration) dropped: the connection itself, its options
/// and the bytes in flight are untouched, and the read half keeps its buffer and what is in it.
/// Halves that are not the two halves of one TCP socket (shm, in-memory pipes in tests) come
/// back as they are, as does a socket whose copy cannot be made or registered (its readiness
/// then keeps crossing threads, which costs time but nothing else).
pub(crate) fn rehome(
    mut read: tokio::io::BufReader<crate::transport::BoxRead>,
    write: crate::transport::BoxWrite,
    rt: &tokio::runtime::Handle,
) -> (
    tokio::io::BufReader<crate::transport::BoxRead>,
    crate::transport::BoxWrite,
) {
    use std::any::Any;
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
    let tcp = (&**read.get_ref() as &dyn Any).is::<OwnedReadHalf>()
        && (&*write as &dyn Any).is::<OwnedWriteHalf>();
    if !tcp {
        return (read, write);
    }
    // The buffer (and what it holds) stays; only the reader under it changes.
    let r = std::mem::replace(read.get_mut(), Box::new(tokio::io::empty()));
    let (r, w): (Box<dyn Any>, Box<dyn Any>) = (r, write);
    let (Ok(r), Ok(w)) = (
        r.downcast::<OwnedReadHalf>(),
        w.downcast::<OwnedWriteHalf>(),
    ) else {
        unreachable!("checked above")
    };
    let (r, w) = match (*r).reunite(*w) {
        Ok(s) => match moved(&s, rt) {
            Ok(moved) => {
                drop(s);
                moved.into_split()
            }
            Err(_) => s.into_split(),
        },
        Err(tokio::net::tcp::ReuniteError(r, w)) => (r, w),
    };
    *read.get_mut() = Box::new(r);
    (read, Box::new(w))
}

/// A second descriptor of `s`'s socket, registered with `rt`'s reactor.
fn moved(s: &TcpStream, rt: &tokio::runtime::Handle) -> std::io::Result<TcpStream> {
    use std::os::fd::AsFd;
    // The copy shares the socket and its non-blocking flag (tokio set it on the socket).
    let copy = std::net::TcpStream::from(s.as_fd().try_clone_to_owned()?);
    let _in_rt = rt.enter();
    TcpStream::from_std(copy)
}

/// Connects to every resolved address in turn until one answers.
pub async fn connect(
    url: &Url,
    timeout: Duration,
    keepalive: Option<Keepalive>,
) -> Result<Stream, Error> {
    connect_from(url, timeout, keepalive, None).await
}

/// Opens a socket to `to`, bound to `source` first if given.
async fn dial(to: SocketAddr, source: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let Some(source) = source else {
        return TcpStream::connect(to).await;
    };
    if source.is_ipv4() != to.is_ipv4() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            format!("source address {source} is not of the same family as {to}"),
        ));
    }
    let socket = if to.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.bind(SocketAddr::new(source, 0)).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot bind source address {source}: {e}"),
        )
    })?;
    socket.connect(to).await
}

/// Connects to `url`, leaving from the local address `source` if given (a given NIC).
pub async fn connect_from(
    url: &Url,
    timeout: Duration,
    keepalive: Option<Keepalive>,
    source: Option<IpAddr>,
) -> Result<Stream, Error> {
    let text = url.to_string();
    let connect_err = |e: std::io::Error| Error::Connect {
        url: text.clone(),
        source: Arc::new(e),
    };
    let addrs = url.socket_addrs().await?;
    let attempt = async {
        let mut last = None;
        for a in addrs {
            match dial(a, source).await {
                Ok(s) => return into_stream_with(s, keepalive).map_err(connect_err),
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
    keepalive: Option<Keepalive>,
}

impl TcpAcceptor {
    /// Binds `url` (port 0 picks a free port).
    pub async fn bind(url: &Url, keepalive: Option<Keepalive>) -> Result<TcpAcceptor, Error> {
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
                    return Ok(TcpAcceptor {
                        listener,
                        url,
                        keepalive,
                    });
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

#[cfg(any(feature = "efa", feature = "ibv"))]
/// A transport that bootstraps over TCP (ibv, efa): turns an accepted TCP connection into a
/// stream of its own (queue pairs or fabric addresses exchanged over it).
pub(crate) trait Bootstrap {
    /// Sets up the transport's stream over `tcp`, accepted from `peer`.
    fn set_up(&self, tcp: Stream, peer: String) -> BoxFuture<'_, Result<Stream, Error>>;
}

#[cfg(any(feature = "efa", feature = "ibv"))]
/// The listener of a transport that bootstraps over TCP: accepts TCP connections and sets each
/// up with [`Bootstrap::set_up`] under `timeout`. A peer whose set-up fails or stalls is logged
/// and skipped, so one bad peer never stops the listener (it is one connection at a time: a
/// stalled peer delays the next for at most `timeout`).
pub(crate) struct BootstrapAcceptor<B> {
    /// The bound TCP listener.
    pub tcp: TcpAcceptor,
    /// The transport's URL scheme (`ibv`), which replaces `tcp` in the URLs it reports.
    pub scheme: &'static str,
    /// How long one peer's set-up may take.
    pub timeout: Duration,
    /// The transport.
    pub transport: B,
}

#[cfg(any(feature = "efa", feature = "ibv"))]
impl<B: Bootstrap> Acceptor for BootstrapAcceptor<B> {
    fn urls(&self) -> Vec<String> {
        let scheme = format!("{}://", self.scheme);
        self.tcp
            .urls()
            .into_iter()
            .map(|u| u.replacen("tcp://", &scheme, 1))
            .collect()
    }

    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<Stream>> {
        Box::pin(async move {
            loop {
                let s = self.tcp.accept().await?;
                let peer = s.peer.clone();
                let set_up = self.transport.set_up(s, peer.clone());
                match tokio::time::timeout(self.timeout, set_up).await {
                    Ok(Ok(s)) => return Ok(s),
                    Ok(Err(e)) => {
                        tracing::info!(scheme = self.scheme, %peer, error = %e, "bootstrap refused")
                    }
                    Err(_) => tracing::info!(
                        scheme = self.scheme,
                        %peer,
                        "bootstrap not done within {:?}",
                        self.timeout
                    ),
                }
            }
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
            into_stream_with(s, self.keepalive)
        })
    }
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
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
        Box::pin(async move { connect(&Url::parse(url)?, timeout, self.keepalive).await })
    }

    fn connect_from<'a>(
        &'a self,
        url: &'a str,
        timeout: Duration,
        source: IpAddr,
    ) -> BoxFuture<'a, Result<Stream, Error>> {
        Box::pin(async move {
            connect_from(&Url::parse(url)?, timeout, self.keepalive, Some(source)).await
        })
    }

    fn listen<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Box<dyn Acceptor>, Error>> {
        Box::pin(async move {
            let a = TcpAcceptor::bind(&Url::parse(url)?, self.keepalive).await?;
            Ok(Box::new(a) as Box<dyn Acceptor>)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Write as _};

    use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

    use super::*;
    use crate::transport::{BoxRead, BoxWrite};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn rehomed_halves_keep_their_bytes_and_work_once_the_old_runtime_is_gone() {
        let (old, new) = (runtime(), runtime());
        // A connection registered with `old`, whose read half has read ahead.
        let (read, write, mut peer) = old.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let ours = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
            let (mut peer, _) = l.accept().await.unwrap();
            peer.write_all(b"hello world").await.unwrap();
            let (r, w) = ours.into_split();
            let mut read = BufReader::with_capacity(64, Box::new(r) as BoxRead);
            let mut hello = [0; 5];
            read.read_exact(&mut hello).await.unwrap();
            assert_eq!(&hello, b"hello");
            let peer = peer.into_std().unwrap();
            peer.set_nonblocking(false).unwrap();
            (read, Box::new(w) as BoxWrite, peer)
        });
        let (mut read, mut write) = rehome(read, write, new.handle());
        // Halves still registered with `old` would fail from here on.
        drop(old);
        new.block_on(async {
            let mut rest = [0; 6];
            read.read_exact(&mut rest).await.unwrap();
            assert_eq!(&rest, b" world", "bytes read ahead come first, in order");
            write.write_all(b"ping").await.unwrap();
            let mut got = [0; 4];
            peer.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"ping");
            peer.write_all(b"pong").unwrap();
            read.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"pong");
        });
    }

    #[test]
    fn halves_of_other_kinds_come_back_as_they_are() {
        let rt = runtime();
        rt.block_on(async {
            let (a, mut b) = tokio::io::duplex(64);
            let (r, w) = tokio::io::split(a);
            let (mut read, mut write) = rehome(
                BufReader::new(Box::new(r) as BoxRead),
                Box::new(w) as BoxWrite,
                &tokio::runtime::Handle::current(),
            );
            let untouched = (&**read.get_ref() as &dyn std::any::Any)
                .is::<tokio::io::ReadHalf<tokio::io::DuplexStream>>();
            assert!(untouched, "not a TCP half: left as it was");
            write.write_all(b"x").await.unwrap();
            let mut one = [0; 1];
            b.read_exact(&mut one).await.unwrap();
            b.write_all(b"y").await.unwrap();
            read.read_exact(&mut one).await.unwrap();
            assert_eq!(&one, b"y");
        });
    }
}
