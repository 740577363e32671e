//! The two halves of an established shm connection, as tokio `AsyncRead` / `AsyncWrite`.
//!
//! Each half owns one end of one ring, the doorbell it waits on (through `AsyncFd`), the
//! doorbell it rings for the peer, and its own duplicate of the bootstrap socket, watched for the
//! peer hanging up. Waiting never involves a thread: a half with nothing to do sets its ring's
//! waiting flag and returns `Pending`; it is woken by the peer's doorbell or by the socket
//! closing. With `spin` set it first polls the ring for that long, for latency.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::fd::{self, EventFd};
use super::ring::{Consumer, Producer};

/// Watches the bootstrap socket: the peer closing it (or dying) is how we learn it is gone.
pub(crate) struct Hangup {
    sock: AsyncFd<OwnedFd>,
    gone: bool,
}

impl Hangup {
    pub(crate) fn new(sock: OwnedFd) -> io::Result<Hangup> {
        Ok(Hangup {
            sock: fd::watch(sock)?,
            gone: false,
        })
    }

    /// Whether the peer is gone; when not, the task is woken once it is.
    fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        while !self.gone {
            let mut guard = match self.sock.poll_read_ready(cx) {
                Poll::Pending => return false,
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(_)) => {
                    self.gone = true;
                    break;
                }
            };
            match guard.try_io(|s| fd::peer_gone(s.as_raw_fd())) {
                Ok(Ok(gone)) => self.gone = gone,
                Ok(Err(_)) => self.gone = true,
                Err(_would_block) => {}
            }
        }
        true
    }
}

/// Waits on a doorbell: `Ready` once it has rung (and is reset), `Pending` with a waker set.
fn poll_bell(bell: &AsyncFd<EventFd>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    let mut guard = ready!(bell.poll_read_ready(cx))?;
    match bell.get_ref().drain() {
        // The counter is now zero, so any later ring is a new edge: safe to forget readiness.
        Ok(()) => guard.clear_ready(),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
        Err(e) => return Poll::Ready(Err(e)),
    }
    Poll::Ready(Ok(()))
}

/// Polls `ready` until it says yes or `spin` has passed.
fn spin_until(spin: Duration, mut ready: impl FnMut() -> io::Result<bool>) -> io::Result<bool> {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if ready()? {
                return Ok(true);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin {
            return Ok(false);
        }
    }
}

fn broken(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, format!("shm peer {why}"))
}

/// Bytes from the peer.
pub(crate) struct ShmRead {
    pub(crate) ring: Consumer,
    /// Rung by the peer when it publishes while we wait.
    pub(crate) data: AsyncFd<EventFd>,
    /// Rung by us when we free space while the peer waits.
    pub(crate) space: EventFd,
    pub(crate) hangup: Hangup,
    pub(crate) spin: Option<Duration>,
    /// Test hook: drop without telling the peer, as a crashed process would.
    pub(crate) silent: bool,
}

impl AsyncRead for ShmRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let mut spun = false;
        loop {
            // SAFETY: the ring only writes initialized bytes into the unfilled part, and we
            // report exactly how many.
            let n = this.ring.read_uninit(unsafe { buf.unfilled_mut() })?;
            if n > 0 {
                // SAFETY: `read_uninit` initialized the first `n` unfilled bytes.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                if this.ring.take_writer_waiting() {
                    this.space.ring();
                }
                return Poll::Ready(Ok(()));
            }
            if this.ring.writer_closed() {
                // The close is published after the last byte, so this re-check is final.
                if this.ring.available()? > 0 {
                    continue;
                }
                return Poll::Ready(Ok(()));
            }
            if let (Some(spin), false) = (this.spin, spun) {
                spun = true;
                let ring = &mut this.ring;
                if spin_until(spin, || Ok(ring.available()? > 0 || ring.writer_closed()))? {
                    continue;
                }
            }
            if this.hangup.poll(cx) {
                // Whatever the peer published before it went away is still ours to read.
                if this.ring.available()? > 0 {
                    continue;
                }
                return Poll::Ready(Ok(()));
            }
            if this.ring.prepare_park()? {
                continue;
            }
            ready!(poll_bell(&this.data, cx))?;
        }
    }
}

impl Drop for ShmRead {
    fn drop(&mut self) {
        if !self.silent {
            self.ring.close();
            self.space.ring();
        }
    }
}

/// Bytes to the peer.
pub(crate) struct ShmWrite {
    pub(crate) ring: Producer,
    /// Rung by the peer when it frees space while we wait.
    pub(crate) space: AsyncFd<EventFd>,
    /// Rung by us when we publish while the peer waits.
    pub(crate) data: EventFd,
    pub(crate) hangup: Hangup,
    pub(crate) spin: Option<Duration>,
    pub(crate) shut: bool,
    /// Test hook: drop without telling the peer, as a crashed process would.
    pub(crate) silent: bool,
}

impl ShmWrite {
    fn close(&mut self) {
        if !self.shut {
            self.shut = true;
            self.ring.close();
            self.data.ring();
        }
    }
}

impl AsyncWrite for ShmWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.shut {
            return Poll::Ready(Err(broken("stream: written after shutdown")));
        }
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        let mut spun = false;
        loop {
            if this.hangup.poll(cx) {
                return Poll::Ready(Err(broken("hung up")));
            }
            if this.ring.reader_closed() {
                return Poll::Ready(Err(broken("closed its read half")));
            }
            let n = this.ring.write(bufs)?;
            if n > 0 {
                if this.ring.take_reader_waiting() {
                    this.data.ring();
                }
                return Poll::Ready(Ok(n));
            }
            if let (Some(spin), false) = (this.spin, spun) {
                spun = true;
                let ring = &mut this.ring;
                if spin_until(spin, || Ok(ring.space()? > 0 || ring.reader_closed()))? {
                    continue;
                }
            }
            if this.ring.prepare_park()? {
                continue;
            }
            ready!(poll_bell(&this.space, cx))?;
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Bytes are visible to the peer as soon as `write` returns.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().close();
        Poll::Ready(Ok(()))
    }
}

impl Drop for ShmWrite {
    fn drop(&mut self) {
        if !self.silent {
            self.close();
        }
    }
}
