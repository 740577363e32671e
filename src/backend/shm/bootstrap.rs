//! Setting up a shm connection over its Unix socket.
//!
//! The connecting side creates both rings and all four doorbells and sends them in one message:
//!
//! ```text
//! connector -> listener   "APSHMv1\0" + capacity (u64 LE), with 6 descriptors (SCM_RIGHTS):
//!                         [ring c->l, its data bell, its space bell,
//!                          ring l->c, its data bell, its space bell]
//! listener  -> connector  "APSHMok1"
//!           or            "APSHMno1" + reason length (u16 LE) + reason (UTF-8): refused
//! ```
//!
//! The listener refuses with a reason when it cannot take the descriptors because it is itself
//! at its descriptor limit (`MSG_CTRUNC` with `RLIMIT_NOFILE` reached): the connecting side then
//! fails with [`Error::Refused`](crate::Error::Refused) ("listener out of file descriptors")
//! instead of seeing the socket close.
//!
//! Both sides check the other's uid (`SO_PEERCRED`) before anything else. After the exchange the
//! socket carries nothing; it stays open for the life of the connection so that each side sees
//! the other hang up (or die) as end of stream on it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::UnixStream;

use super::fd::{self, EventFd, Mapping};
use super::halves::{Hangup, ShmRead, ShmWrite, Spin};
use super::ring::{self, Consumer, Producer, HEADER};

const HELLO: [u8; 8] = *b"APSHMv1\0";
const ACK: [u8; 8] = *b"APSHMok1";
const REFUSAL: [u8; 8] = *b"APSHMno1";
/// What a refused connector is told when the listener is at its descriptor limit.
pub(crate) const OUT_OF_DESCRIPTORS: &str = "listener out of file descriptors";
/// Longest reason read from a refusal.
const MAX_REASON: usize = 1024;

/// The listener's refusal, as the inner error of the connecting side's `io::Error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal(pub(crate) String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the shm listener refused the connection: {}", self.0)
    }
}

impl std::error::Error for Refusal {}
/// Descriptors in a hello: memfd, data bell and space bell, for each direction.
const HELLO_FDS: usize = 6;

/// Refuses a peer running as another user: it could read and write our memory.
pub(crate) fn check_peer(sock: &UnixStream) -> io::Result<()> {
    let cred = sock.peer_cred()?;
    let ours = fd::uid();
    if cred.uid() != ours {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the peer (pid {:?}) runs as uid {}, we run as uid {ours}: \
                 shm only connects processes of the same user",
                cred.pid(),
                cred.uid()
            ),
        ));
    }
    Ok(())
}

async fn send_all(
    sock: &UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<()> {
    let raw = sock.as_raw_fd();
    let mut sent = 0;
    while sent < bytes.len() {
        let attach = if sent == 0 { fds } else { &[] };
        sent += sock
            .async_io(Interest::WRITABLE, || {
                fd::send_with_fds(raw, &bytes[sent..], attach)
            })
            .await?;
    }
    Ok(())
}

async fn recv_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    let raw = sock.as_raw_fd();
    let mut got = 0;
    while got < buf.len() {
        let n = sock
            .async_io(Interest::READABLE, || {
                fd::recv_with_fds(raw, &mut buf[got..], fds)
            })
            .await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the socket during the shm bootstrap \
                 (it refused us, or it is not an actorpipe shm endpoint)",
            ));
        }
        got += n;
    }
    Ok(())
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("shm bootstrap: {what}"))
}

/// Turns the socket and the ring ends into the two halves.
#[allow(clippy::too_many_arguments)]
fn assemble(
    sock: UnixStream,
    rx: Consumer,
    rx_data: EventFd,
    rx_space: EventFd,
    tx: Producer,
    tx_data: EventFd,
    tx_space: EventFd,
    spin: Option<Duration>,
) -> io::Result<(ShmRead, ShmWrite)> {
    let sock: OwnedFd = sock.into_std()?.into();
    let read = ShmRead {
        ring: rx,
        data: fd::watch(rx_data)?,
        space: rx_space,
        hangup: Hangup::new(sock.try_clone()?)?,
        spin,
        spun: Spin::default(),
        silent: false,
    };
    let write = ShmWrite {
        ring: tx,
        space: fd::watch(tx_space)?,
        data: tx_data,
        hangup: Hangup::new(sock)?,
        spin,
        spun: Spin::default(),
        shut: false,
        silent: false,
    };
    Ok((read, write))
}

/// A fresh ring in a new sealed memfd: the descriptor to send and both ends.
fn new_ring(capacity: usize) -> io::Result<(OwnedFd, Producer, Consumer)> {
    let memfd = fd::memfd(HEADER + capacity)?;
    let map = Mapping::new(&memfd, HEADER + capacity)?;
    let (p, c) = ring::create(Arc::new(map))?;
    Ok((memfd, p, c))
}

/// The connecting side, on a freshly connected socket.
pub(crate) async fn connect(
    sock: UnixStream,
    capacity: usize,
    spin: Option<Duration>,
) -> io::Result<(ShmRead, ShmWrite)> {
    check_peer(&sock)?;
    let (tx_mem, tx, _) = new_ring(capacity)?;
    let (rx_mem, _, rx) = new_ring(capacity)?;
    let bells = [
        EventFd::new()?,
        EventFd::new()?,
        EventFd::new()?,
        EventFd::new()?,
    ];
    let mut hello = [0u8; 16];
    hello[..8].copy_from_slice(&HELLO);
    hello[8..].copy_from_slice(&(capacity as u64).to_le_bytes());
    let fds = [
        tx_mem.as_fd(),
        bells[0].fd(),
        bells[1].fd(),
        rx_mem.as_fd(),
        bells[2].fd(),
        bells[3].fd(),
    ];
    send_all(&sock, &hello, &fds).await?;
    drop((tx_mem, rx_mem));
    let mut ack = [0u8; 8];
    let mut extra = Vec::new();
    recv_exact(&sock, &mut ack, &mut extra).await?;
    if ack == REFUSAL && extra.is_empty() {
        let mut len = [0u8; 2];
        recv_exact(&sock, &mut len, &mut extra).await?;
        let mut reason = vec![0u8; usize::from(u16::from_le_bytes(len)).min(MAX_REASON)];
        recv_exact(&sock, &mut reason, &mut extra).await?;
        let reason = String::from_utf8_lossy(&reason).into_owned();
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            Refusal(reason),
        ));
    }
    if ack != ACK || !extra.is_empty() {
        return Err(bad(
            "the listener answered with something other than an ack".into(),
        ));
    }
    let [tx_data, tx_space, rx_data, rx_space] = bells;
    assemble(sock, rx, rx_data, rx_space, tx, tx_data, tx_space, spin)
}

/// Maps one ring the connector created.
fn adopt_ring(memfd: &OwnedFd, capacity: usize) -> io::Result<(Producer, Consumer)> {
    let len = fd::sealed_len(memfd)?;
    if len != HEADER + capacity {
        return Err(bad(format!(
            "ring memory of {len} bytes, expected {}",
            HEADER + capacity
        )));
    }
    ring::attach(Arc::new(Mapping::new(memfd, len)?))
}

/// The listening side, on a freshly accepted socket.
pub(crate) async fn accept(
    sock: UnixStream,
    spin: Option<Duration>,
) -> io::Result<(ShmRead, ShmWrite)> {
    check_peer(&sock)?;
    let mut hello = [0u8; 16];
    let mut fds = Vec::new();
    if let Err(e) = recv_exact(&sock, &mut hello, &mut fds).await {
        if crate::fds::is_exhaustion(&e) {
            refuse(&sock, OUT_OF_DESCRIPTORS).await;
        }
        return Err(e);
    }
    if hello[..8] != HELLO {
        return Err(bad("the peer is not an actorpipe shm v1 client".into()));
    }
    if fds.len() != HELLO_FDS {
        return Err(bad(format!(
            "{} descriptors in the hello, expected {HELLO_FDS}",
            fds.len()
        )));
    }
    let announced = u64::from_le_bytes(hello[8..].try_into().unwrap_or_default());
    let capacity = usize::try_from(announced).unwrap_or(0);
    if !ring::valid_capacity(capacity) {
        return Err(bad(format!("ring capacity {announced} is not allowed")));
    }
    let mut it = fds.into_iter();
    let mut next = || it.next().ok_or_else(|| bad("descriptor missing".into()));
    let (_, rx) = adopt_ring(&next()?, capacity)?;
    let rx_data = EventFd::from_fd(next()?)?;
    let rx_space = EventFd::from_fd(next()?)?;
    let (tx, _) = adopt_ring(&next()?, capacity)?;
    let tx_data = EventFd::from_fd(next()?)?;
    let tx_space = EventFd::from_fd(next()?)?;
    send_all(&sock, &ACK, &[]).await?;
    assemble(sock, rx, rx_data, rx_space, tx, tx_data, tx_space, spin)
}

/// Tells the connecting side why it is turned away (best effort: it may be gone already).
async fn refuse(sock: &UnixStream, reason: &str) {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON)];
    let mut msg = Vec::with_capacity(10 + reason.len());
    msg.extend_from_slice(&REFUSAL);
    msg.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    msg.extend_from_slice(reason);
    let _ = tokio::time::timeout(Duration::from_secs(1), send_all(sock, &msg, &[])).await;
}
