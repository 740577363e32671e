//! The two halves of an established shm connection, as tokio `AsyncRead` / `AsyncWrite`.
//!
//! Each half owns one end of one ring, the doorbell it waits on (through `AsyncFd`), the
//! doorbell it rings for the peer, and its own duplicate of the bootstrap socket, watched for the
//! peer hanging up. Waiting never involves a thread: a half with nothing to do sets its ring's
//! waiting flag and returns `Pending`; it is woken by the peer's doorbell or by the socket
//! closing. With `spin` set it first polls the ring for that long, for latency.
//!
//! A spin never holds the thread for long: the half runs on its context's single arbiter
//! thread, next to the tasks that produce the very answer it waits for. So the first poll of a
//! wait checks the ring once, then wakes its own task and returns `Pending`: the executor runs
//! every other ready task and polls the half again. Later polls keep looking for up to
//! [`INLINE_BURST`] (1 µs) before they give way the same way. Only once the spin budget is spent
//! without bytes (or space) does the half park on its doorbell.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use atomic_waker::AtomicWaker;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::fd::{self, EventFd};
use super::ring::{Consumer, Producer};

/// Watches the bootstrap socket: the peer closing it (or dying) is how we learn it is gone.
///
/// The socket's readiness is watched with a waker of our own ([`Watch`]), registered once:
/// it stays registered until the socket becomes readable (the peer hung up), which raises a
/// flag and wakes the half's task. So a half asks "gone?" with one atomic load, and a half
/// about to park registers its task's waker in an `AtomicWaker`, instead of polling the
/// socket's readiness through tokio each time (its lock and waker slot: about 300 instructions,
/// and a write half asked on every write; callgrind, docs/performance.md). A task that polls
/// the half with a no-op waker (a `PipeWriter`) no longer takes the write loop's place in the
/// socket's waker slot either.
pub(crate) struct Hangup {
    sock: AsyncFd<OwnedFd>,
    gone: bool,
    watch: Arc<Watch>,
    /// The socket's readiness holds `watch`'s waker: nothing to look at until it fires.
    armed: bool,
}

/// The waker registered with the socket's readiness: raises `fired`, then wakes the half's
/// task.
#[derive(Default)]
struct Watch {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Watch {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Hangup {
    pub(crate) fn new(sock: OwnedFd) -> io::Result<Hangup> {
        Ok(Hangup {
            sock: fd::watch(sock)?,
            gone: false,
            watch: Arc::default(),
            armed: false,
        })
    }

    /// Whether the peer is gone, registering no task: a half that then parks must call
    /// [`Hangup::poll`] first.
    #[inline(always)]
    fn check(&mut self) -> bool {
        if self.gone || (self.armed && !self.watch.fired.load(Ordering::Acquire)) {
            return self.gone;
        }
        self.look()
    }

    /// [`Hangup::check`] on its first call, or once the socket became readable: looks at the
    /// socket, and arms the watch again (a wake-up from now on raises the flag anew). Out of
    /// line, so that the usual check (one flag) costs no call.
    #[inline(never)]
    fn look(&mut self) -> bool {
        self.watch.fired.store(false, Ordering::Release);
        let waker = Waker::from(self.watch.clone());
        let mut cx = Context::from_waker(&waker);
        while !self.gone {
            let mut guard = match self.sock.poll_read_ready(&mut cx) {
                Poll::Pending => {
                    self.armed = true;
                    return false;
                }
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

    /// Whether the peer is gone; when not, the task is woken once it is.
    fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.gone {
            self.watch.task.register(cx.waker());
        }
        self.check()
    }
}

/// Waits on a doorbell: `Ready` once it has rung, `Pending` with a waker set.
///
/// The eventfd is not read: its registration is edge-triggered (mio's), and every `write` to an
/// eventfd wakes its waiters, so each ring is a new event whatever the counter holds. Clearing
/// tokio's readiness is enough, and saves a `read` per wake-up. The counter only grows by one
/// per ring (rings happen only when this side parked), far from its 2^64 - 2 limit.
fn poll_bell(bell: &AsyncFd<EventFd>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    let mut guard = ready!(bell.poll_read_ready(cx))?;
    guard.clear_ready();
    Poll::Ready(Ok(()))
}

/// How often a spinning half offers its CPU to other threads (`sched_yield`). Without it, a peer
/// woken onto this CPU (the scheduler puts a woken thread next to its waker) would wait for the
/// whole spin to end.
pub(crate) const OS_YIELD_EVERY: Duration = Duration::from_micros(5);

/// How long a spinning half keeps looking within one poll, once the executor has had a turn
/// since the wait began (see [`Spin::poll`]): what a task that becomes ready meanwhile may wait
/// for, at most.
pub(crate) const INLINE_BURST: Duration = Duration::from_micros(1);

/// A spin budget spread over several polls of one task.
#[derive(Debug, Default)]
pub(crate) struct Spin {
    /// When the current spin began; `None` between waits.
    since: Option<Instant>,
    /// When this spin last called `sched_yield`.
    os_yield: Option<Instant>,
}

/// What one poll's spin found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Spun {
    /// `ready` said yes: look again.
    Ready,
    /// Not yet, and budget is left: the task has been woken, return `Pending`.
    Yield,
    /// The budget is spent: park.
    Spent,
}

impl Spin {
    /// Checks `ready` once. When it is not, and budget is left, wakes the task and says to
    /// return `Pending`: the executor runs whatever else is ready (the tasks that produce the
    /// answer we wait for, often) and polls the half again. So the spin costs the other tasks
    /// one poll each time round, never a stretch of the thread.
    ///
    /// The first poll of a wait gives way at once: the task that wrote the message we answer,
    /// or that handles the one we just read, is usually ready then. On later polls the
    /// executor has had its turn, so the half keeps looking for up to [`INLINE_BURST`] before
    /// it gives way again: bytes that land meanwhile are read tens of nanoseconds after, not a
    /// trip through the executor (a few hundred nanoseconds) after.
    pub(crate) fn poll(
        &mut self,
        budget: Duration,
        cx: &mut Context<'_>,
        mut ready: impl FnMut() -> io::Result<bool>,
    ) -> io::Result<Spun> {
        if ready()? {
            return Ok(Spun::Ready);
        }
        let mut now = Instant::now();
        if self.since.is_some() {
            let end = now + INLINE_BURST;
            'burst: loop {
                for _ in 0..8 {
                    std::hint::spin_loop();
                    if ready()? {
                        return Ok(Spun::Ready);
                    }
                }
                now = Instant::now();
                if now >= end {
                    break 'burst;
                }
            }
        }
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) >= budget {
            // Park now; a wake-up that finds nothing (rare) starts a fresh spin.
            self.since = None;
            self.os_yield = None;
            return Ok(Spun::Spent);
        }
        let last = *self.os_yield.get_or_insert(now);
        if now.duration_since(last) >= OS_YIELD_EVERY {
            self.os_yield = Some(now);
            std::thread::yield_now();
            // From a loop on the runtime's own queue, a plain wake-up would keep the thread's
            // actors waiting for up to 61 more polls (`turns`).
            crate::transport::turns::let_actors_run(cx);
            return Ok(Spun::Yield);
        }
        std::hint::spin_loop();
        cx.waker().wake_by_ref();
        Ok(Spun::Yield)
    }

    /// The wait is over (bytes moved): the next wait gets a fresh budget.
    pub(crate) fn reset(&mut self) {
        self.since = None;
        self.os_yield = None;
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
    pub(crate) spun: Spin,
    /// Test hook: drop without telling the peer, as a crashed process would.
    pub(crate) silent: bool,
}

/// Whether `r` is the read half of an shm connection in spin mode ([`super::Shm::with_spin`]):
/// a connection's read loop then gives its thread's other tasks a turn after each message it
/// hands over (`transport::stream::read_loop`).
pub(crate) fn spins(r: &dyn crate::transport::ReadHalf) -> bool {
    // `ReadHalf: Any`, so this is the concrete type's id, through the trait object's vtable.
    if std::any::Any::type_id(r) != std::any::TypeId::of::<ShmRead>() {
        return false;
    }
    // SAFETY: the type id says the trait object's data is a `ShmRead`, so its data pointer
    // points to one, alive and shared for as long as `r` is borrowed.
    let read = unsafe { &*(r as *const dyn crate::transport::ReadHalf as *const ShmRead) };
    read.spin.is_some()
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
        loop {
            let space = &this.space;
            // SAFETY: the ring only writes initialized bytes into the unfilled part, and we
            // report exactly how many.
            let unfilled = unsafe { buf.unfilled_mut() };
            let n = this.ring.read_waking(unfilled, || space.ring())?;
            if n > 0 {
                this.spun.reset();
                // SAFETY: `read_waking` initialized the first `n` unfilled bytes.
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
            if let Some(spin) = this.spin {
                let ring = &mut this.ring;
                match this.spun.poll(spin, cx, || {
                    Ok(ring.available()? > 0 || ring.writer_closed())
                })? {
                    Spun::Ready => continue,
                    Spun::Yield => return Poll::Pending,
                    Spun::Spent => {}
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
    pub(crate) spun: Spin,
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
        loop {
            if this.hangup.check() {
                return Poll::Ready(Err(broken("hung up")));
            }
            if this.ring.reader_closed() {
                return Poll::Ready(Err(broken("closed its read half")));
            }
            let data = &this.data;
            let n = this.ring.write_waking(bufs, || data.ring())?;
            if n > 0 {
                this.spun.reset();
                if this.ring.take_reader_waiting() {
                    this.data.ring();
                }
                return Poll::Ready(Ok(n));
            }
            if let Some(spin) = this.spin {
                let ring = &mut this.ring;
                match this
                    .spun
                    .poll(spin, cx, || Ok(ring.space()? > 0 || ring.reader_closed()))?
                {
                    Spun::Ready => continue,
                    Spun::Yield => return Poll::Pending,
                    Spun::Spent => {}
                }
            }
            // About to park: be woken if the peer goes meanwhile.
            if this.hangup.poll(cx) {
                continue;
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
