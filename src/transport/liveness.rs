//! Heartbeats: how a peer that stopped without closing is found out, on every transport.
//!
//! Each connection's writer sends a 5-byte [`Ping`](crate::wire::FrameKind::Ping) frame when it
//! has written nothing for [`Heartbeat::interval`], and each reader skips those frames. A reader
//! that waits for bytes (an operation is in progress) and gets none for [`Heartbeat::timeout`]
//! declares the peer lost, and every pending operation of the pipe fails with a timeout.
//!
//! Only time spent *waiting with an operation in progress* counts. A reader with nothing to do
//! (the application has not asked for the next message's data yet) does not count silence, so
//! a live peer whose application stops reading for a while is never declared dead: its writer
//! stays blocked on a full socket, but the peer's own writer keeps sending pings the other way.
//! That is what kernel mechanisms cannot tell apart: TCP keepalive only probes idle
//! connections, and `TCP_USER_TIMEOUT` also aborts a live peer that advertises a zero window.
//!
//! Heartbeats detect a killed process, a pulled cable and a frozen host alike, with data in
//! flight or not, within `timeout` of the last byte received. The price is one small frame per
//! `interval` on an idle connection, and a timer per connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::Sleep;

/// How often an idle writer says it is alive, and how long a waiting reader tolerates silence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// Idle time after which a writer sends a ping.
    pub interval: Duration,
    /// Silence after which a waiting reader declares the peer lost.
    pub timeout: Duration,
}

impl Default for Heartbeat {
    /// Pings every 2 s, a peer lost after 10 s of silence.
    fn default() -> Self {
        Heartbeat {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
        }
    }
}

impl Heartbeat {
    /// A heartbeat pinging every `interval`, with `interval` capped at a third of `timeout`
    /// (so that a ping delayed by the network does not look like silence) and at least 1 ms.
    pub fn new(interval: Duration, timeout: Duration) -> Heartbeat {
        let timeout = timeout.max(Duration::from_millis(3));
        Heartbeat {
            interval: interval.clamp(Duration::from_millis(1), timeout / 3),
            timeout,
        }
    }
}

/// A cheap clock for heartbeat stamps, which only need a few milliseconds of precision.
///
/// `CLOCK_MONOTONIC_COARSE` is the kernel's time as of its last tick: reading it takes a few
/// instructions, where a precise reading (`Instant::now()`) reads and scales the cycle counter.
/// It runs on the same base as `Instant` but lags by up to one tick (1 to 10 ms, depending on
/// the kernel), so [`Coarse::instant`] maps a stamp to an `Instant` no earlier than the moment
/// it was taken: a verdict of silence may come up to two ticks late, never early.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Coarse {
    /// An `Instant` taken right after `base_ns` was read.
    base: Instant,
    base_ns: u64,
    /// The coarse clock's resolution: how far a reading may lag the precise one.
    tick: Duration,
}

impl Coarse {
    /// The process-wide mapping.
    pub(crate) fn get() -> &'static Coarse {
        static COARSE: std::sync::OnceLock<Coarse> = std::sync::OnceLock::new();
        COARSE.get_or_init(|| {
            let base_ns = Coarse::now_ns();
            let base = Instant::now();
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `ts` is a valid, writable timespec for the call's duration.
            let tick = if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } == 0
            {
                Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
            } else {
                Duration::from_millis(10)
            };
            Coarse {
                base,
                base_ns,
                tick,
            }
        })
    }

    /// A reading of the coarse clock, in nanoseconds.
    pub(crate) fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the call's duration;
        // CLOCK_MONOTONIC_COARSE exists on every Linux since 2.6.32, and cannot fail then.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        (ts.tv_sec as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(ts.tv_nsec as u64)
    }

    /// The `Instant` of a reading `ns`, rounded up: never earlier than when it was read.
    pub(crate) fn instant(&self, ns: u64) -> Instant {
        self.base + Duration::from_nanos(ns.saturating_sub(self.base_ns)) + self.tick
    }
}

/// When a reader last made progress; shared between the reader and its watchdog.
#[derive(Debug)]
pub struct Pulse {
    clock: &'static Coarse,
    /// A [`Coarse`] reading.
    last_ns: AtomicU64,
}

impl Pulse {
    /// A pulse that beat just now.
    pub fn new() -> Arc<Pulse> {
        Arc::new(Pulse {
            clock: Coarse::get(),
            last_ns: AtomicU64::new(Coarse::now_ns()),
        })
    }

    /// Records progress now (to within a few milliseconds, see [`Pulse::last`]).
    pub fn beat(&self) {
        self.last_ns.store(Coarse::now_ns(), Ordering::Relaxed);
    }

    /// When progress was last recorded, rounded up to the coarse clock's tick (a few
    /// milliseconds): never earlier than the beat itself.
    pub fn last(&self) -> Instant {
        self.clock.instant(self.last_ns.load(Ordering::Relaxed))
    }
}

/// A reader that beats a [`Pulse`] whenever bytes arrive.
#[derive(Debug)]
pub struct Stamped<R> {
    inner: R,
    pulse: Arc<Pulse>,
}

impl<R> Stamped<R> {
    /// Wraps `inner`.
    pub fn new(inner: R, pulse: Arc<Pulse>) -> Self {
        Stamped { inner, pulse }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Stamped<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.pulse.beat();
        }
        r
    }
}

/// Resolves once `pulse` has not beaten for `timeout`.
///
/// `alarm` is a timer owned by the caller for the life of the loop: it is only reset when it
/// fires, so an operation that completes in time costs no timer work. A loop that waits for
/// silence once per operation keeps an `Alarm` instead, which also saves the timer's polls.
pub async fn silence(alarm: Pin<&mut Sleep>, pulse: &Pulse, timeout: Duration) {
    Alarm::new(alarm).silence(pulse, timeout).await
}

/// A loop's silence timer, owned by the loop for its life and polled only when it may have
/// fired.
///
/// Once a poll has reached the timer (and said `Pending`), the timer holds the polling task's
/// waker until it fires or is reset: polling it again before then would only say `Pending`
/// again, and register the same waker again. A loop polls its alarm from one task only, so
/// that waker stays the right one.
#[derive(Debug)]
pub(crate) struct Alarm<'a> {
    sleep: Pin<&'a mut Sleep>,
    /// A poll reached the timer and it had not fired; it has not been reset since.
    armed: bool,
}

impl<'a> Alarm<'a> {
    /// An alarm on `sleep`.
    pub(crate) fn new(sleep: Pin<&'a mut Sleep>) -> Self {
        Alarm {
            sleep,
            armed: false,
        }
    }

    fn poll_fired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.armed && !self.sleep.is_elapsed() {
            return Poll::Pending;
        }
        // Out of the task's budget: a poll refused for want of it would reach no timer.
        let mut sleep = tokio::task::coop::unconstrained(self.sleep.as_mut());
        let fired = Pin::new(&mut sleep).poll(cx);
        self.armed = fired.is_pending();
        fired
    }

    fn reset(&mut self, deadline: Instant) {
        self.sleep.as_mut().reset(deadline.into());
        self.armed = false;
    }

    /// Resolves once `pulse` has not beaten for `timeout` (see [`silence`]).
    pub(crate) async fn silence(&mut self, pulse: &Pulse, timeout: Duration) {
        let mut overdue = false;
        loop {
            std::future::poll_fn(|cx| self.poll_fired(cx)).await;
            let due = pulse.last() + timeout;
            if Instant::now() < due {
                self.reset(due);
                overdue = false;
                continue;
            }
            if overdue {
                return;
            }
            // Overdue. If this thread was busy, bytes may be waiting that the reactor has not
            // reported yet: let it run once, and let the reader have them, before judging
            // again (the alarm has fired, so the next wait returns at once).
            overdue = true;
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn interval_is_capped_by_the_timeout() {
        let h = Heartbeat::new(Duration::from_secs(5), Duration::from_secs(3));
        assert_eq!(h.interval, Duration::from_secs(1));
        assert_eq!(h.timeout, Duration::from_secs(3));
        let h = Heartbeat::new(Duration::ZERO, Duration::from_secs(3));
        assert_eq!(h.interval, Duration::from_millis(1));
        let d = Heartbeat::default();
        assert!(d.interval * 3 <= d.timeout);
    }

    #[tokio::test]
    async fn silence_comes_a_timeout_after_the_last_beat() {
        let pulse = Pulse::new();
        let timeout = Duration::from_millis(200);
        let start = Instant::now();
        let mut alarm = std::pin::pin!(tokio::time::sleep(Duration::ZERO));
        // A beat at 100 ms moves the verdict from 200 ms to 300 ms.
        let beats = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            pulse.beat();
        };
        let ((), ()) = tokio::join!(silence(alarm.as_mut(), &pulse, timeout), beats);
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
        assert!(waited < Duration::from_secs(10), "{waited:?}");
    }

    /// The read loop's way: a fresh wait on the same alarm per operation, most ending in time
    /// (the alarm polled once, then only when it fires), past the alarm's first deadline (it
    /// fires, and is reset, in the middle of one); then silence, judged a timeout after the
    /// last beat.
    #[tokio::test]
    async fn an_alarm_kept_across_waits_still_fires() {
        let pulse = Pulse::new();
        let timeout = Duration::from_millis(100);
        let sleep = std::pin::pin!(tokio::time::sleep(timeout));
        let mut alarm = Alarm::new(sleep);
        let start = Instant::now();
        while start.elapsed() < 3 * timeout {
            pulse.beat();
            let beat = Instant::now();
            tokio::select! {
                biased;
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
                () = alarm.silence(&pulse, timeout) => {
                    // A verdict is wrong only if it came sooner than a timeout after the last
                    // beat; on a loaded machine this thread can be held off the CPU that long.
                    let gap = beat.elapsed();
                    assert!(gap >= timeout, "silence {gap:?} after a beat, timeout {timeout:?}");
                }
            }
        }
        let start = Instant::now();
        pulse.beat();
        let judged = tokio::time::timeout(Duration::from_secs(10), alarm.silence(&pulse, timeout));
        judged.await.expect("no verdict of silence");
        let waited = start.elapsed();
        assert!(waited >= timeout, "{waited:?}");
    }

    #[tokio::test]
    async fn stamped_reader_beats_on_bytes_only() {
        let (mut a, b) = tokio::io::duplex(64);
        let pulse = Pulse::new();
        let first = pulse.last();
        let mut r = Stamped::new(b, pulse.clone());
        // Longer than the coarse clock's tick.
        std::thread::sleep(Duration::from_millis(25));
        a.write_all(b"hi").await.unwrap();
        let mut got = [0u8; 2];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hi");
        let second = pulse.last();
        assert!(second > first);
        std::thread::sleep(Duration::from_millis(25));
        drop(a);
        assert_eq!(r.read(&mut got).await.unwrap(), 0);
        assert_eq!(pulse.last(), second, "end of stream is not a sign of life");
    }
}
