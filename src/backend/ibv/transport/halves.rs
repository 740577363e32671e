//! The two halves of an ibv connection (tokio `AsyncRead` / `AsyncWrite` over the shared
//! [`Core`]) and the driver future that runs as a task of its own.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::conn::Core;
use crate::transport::{BoxRead, BoxWrite};

/// How long a connection whose halves are both gone waits for its last writes (the farewell
/// frame, the close mark) to complete before the queue pair is destroyed.
pub const LINGER: Duration = Duration::from_secs(2);

/// The state both halves and the driver share. Everything runs on one arbiter thread, so the
/// lock is never contended; it exists because the halves must be `Send`.
pub(crate) struct Shared {
    pub(crate) core: Mutex<Core>,
    pub(crate) driver: Mutex<Option<Waker>>,
}

impl Shared {
    pub(crate) fn new(core: Core) -> Arc<Shared> {
        Arc::new(Shared {
            core: Mutex::new(core),
            driver: Mutex::new(None),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_driver(&self) {
        if let Some(w) = self.driver.lock().unwrap_or_else(|p| p.into_inner()).take() {
            w.wake();
        }
    }
}

fn failed(why: &str) -> io::Error {
    io::Error::other(format!("ibv queue pair failed: {why}"))
}

fn gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "ibv peer hung up its bootstrap connection",
    )
}

/// Bytes from the peer.
pub(crate) struct IbvRead(pub(crate) Arc<Shared>);
/// Bytes to the peer.
pub(crate) struct IbvWrite(pub(crate) Arc<Shared>);

impl AsyncRead for IbvRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut core = self.0.lock();
        let n = core.read(buf.initialize_unfilled());
        if n > 0 {
            buf.advance(n);
            return Poll::Ready(Ok(()));
        }
        if buf.remaining() == 0 || core.peer_closed {
            return Poll::Ready(Ok(())); // end of stream once drained
        }
        if let Some(why) = &core.failed {
            return Poll::Ready(Err(failed(why)));
        }
        core.read_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl AsyncWrite for IbvWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut core = self.0.lock();
        if let Some(why) = &core.failed {
            return Poll::Ready(Err(failed(why)));
        }
        if core.peer_gone {
            return Poll::Ready(Err(gone()));
        }
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        let n = core.write_vectored(bufs);
        if n > 0 {
            return Poll::Ready(Ok(n));
        }
        core.write_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Every byte taken is posted (or backlogged, then posted in order): RDMA delivers it.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut core = self.0.lock();
        core.close_write();
        if core.flushed() || core.failed.is_some() || core.peer_gone {
            return Poll::Ready(Ok(()));
        }
        core.write_waker = Some(cx.waker().clone());
        drop(core);
        self.0.wake_driver();
        Poll::Pending
    }
}

impl Drop for IbvRead {
    fn drop(&mut self) {
        self.0.lock().halves -= 1;
        self.0.wake_driver();
    }
}

impl Drop for IbvWrite {
    fn drop(&mut self) {
        let mut core = self.0.lock();
        core.close_write();
        core.halves -= 1;
        drop(core);
        self.0.wake_driver();
    }
}

/// The queue pair's notification descriptor, borrowed for the reactor (the queue pair owns it
/// and outlives the `AsyncFd`: both live in [`Drive`], which drops the `AsyncFd` first).
struct NotifyFd(RawFd);

impl AsRawFd for NotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// The queue pair's progress engine: waits for completions (the notification descriptor) and
/// for the peer hanging up the bootstrap connection. It ends once both halves are gone and
/// their last writes are done (or [`LINGER`] has passed), once the queue pair has failed, or
/// once the peer hung up; ending closes the bootstrap socket, which tells the peer.
pub(crate) struct Drive {
    notify: AsyncFd<NotifyFd>,
    hangup: BoxRead,
    /// Kept open: dropping it would tell the peer we hung up.
    _bootstrap: BoxWrite,
    linger: Option<Pin<Box<tokio::time::Sleep>>>,
    // Declared last: dropped after the `AsyncFd` that watches its queue pair's descriptor.
    pub(crate) shared: Arc<Shared>,
}

impl Drive {
    pub(crate) fn new(
        shared: Arc<Shared>,
        hangup: BoxRead,
        bootstrap: BoxWrite,
    ) -> io::Result<Drive> {
        let fd = {
            let mut core = shared.lock();
            core.qp.arm().map_err(io::Error::other)?;
            core.qp.notify_fd()
        };
        Ok(Drive {
            // SAFETY: the descriptor belongs to the queue pair inside `shared`, which this
            // `Drive` keeps alive and drops after the `AsyncFd` (field order), so it stays open
            // and the same for the registration's whole life.
            notify: unsafe {
                AsyncFd::register_with_interest(NotifyFd(fd), tokio::io::Interest::READABLE)
            }?,
            hangup,
            _bootstrap: bootstrap,
            linger: None,
            shared,
        })
    }

    /// Handles completions, then re-arms and handles what raced with the arming.
    fn progress(&self) {
        let mut core = self.shared.lock();
        let _ = core.qp.ack_notifications();
        core.progress();
        if let Err(e) = core.qp.arm() {
            core.fail(format!("ibv_req_notify_cq: {e}"));
        }
        core.progress();
    }
}

impl Future for Drive {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        *self.shared.driver.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        while let Poll::Ready(ready) = self.notify.poll_read_ready(cx) {
            match ready {
                Ok(mut guard) => guard.clear_ready(),
                Err(e) => {
                    self.shared.lock().fail(format!("completion channel: {e}"));
                    break;
                }
            }
            self.progress();
        }
        // Completions may have come in through the halves' own posts (the simulated device
        // completes inside `post_send`) without a notification yet: take them too.
        self.progress();
        let mut byte = [0u8; 1];
        let mut rb = ReadBuf::new(&mut byte);
        let this = &mut *self;
        if let Poll::Ready(r) = Pin::new(&mut this.hangup).poll_read(cx, &mut rb) {
            this.progress(); // whatever landed before the hang-up counts
            let mut core = this.shared.lock();
            match r {
                Ok(()) if rb.filled().is_empty() => {}
                Ok(()) => core.fail("unexpected bytes on the bootstrap connection".into()),
                Err(e) => core.fail(format!("bootstrap connection: {e}")),
            }
            core.peer_gone = true;
            core.peer_closed = true;
            core.wake();
            drop(core);
            // The peer is gone: nothing more will complete.
            return Poll::Ready(());
        }
        let core = self.shared.lock();
        if core.failed.is_some() {
            // The queue pair is in error and will carry nothing more. Ending here closes the
            // bootstrap socket, which is how the peer learns it at once, even while idle.
            return Poll::Ready(());
        }
        if core.halves == 0 {
            if core.flushed() || core.failed.is_some() {
                return Poll::Ready(());
            }
            drop(core);
            let linger = self
                .linger
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(LINGER)));
            if linger.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}
