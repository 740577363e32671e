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

/// When a reader last made progress; shared between the reader and its watchdog.
#[derive(Debug)]
pub struct Pulse {
    base: Instant,
    last_us: AtomicU64,
}

impl Pulse {
    /// A pulse that beat just now.
    pub fn new() -> Arc<Pulse> {
        Arc::new(Pulse {
            base: Instant::now(),
            last_us: AtomicU64::new(0),
        })
    }

    /// Records progress now.
    pub fn beat(&self) {
        let us = self.base.elapsed().as_micros() as u64;
        self.last_us.store(us, Ordering::Relaxed);
    }

    /// When progress was last recorded.
    pub fn last(&self) -> Instant {
        self.base + Duration::from_micros(self.last_us.load(Ordering::Relaxed))
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
/// fires, so an operation that completes in time costs no timer work.
pub async fn silence(mut alarm: Pin<&mut Sleep>, pulse: &Pulse, timeout: Duration) {
    loop {
        alarm.as_mut().await;
        let due = pulse.last() + timeout;
        if Instant::now() < due {
            alarm.as_mut().reset(due.into());
            continue;
        }
        // Overdue. If this thread was busy, bytes may be waiting that the reactor has not
        // reported yet: let it run once, and let the reader have them, before judging.
        tokio::task::yield_now().await;
        let due = pulse.last() + timeout;
        if Instant::now() < due {
            alarm.as_mut().reset(due.into());
            continue;
        }
        return;
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

    #[tokio::test]
    async fn stamped_reader_beats_on_bytes_only() {
        let (mut a, b) = tokio::io::duplex(64);
        let pulse = Pulse::new();
        let first = pulse.last();
        let mut r = Stamped::new(b, pulse.clone());
        std::thread::sleep(Duration::from_millis(5));
        a.write_all(b"hi").await.unwrap();
        let mut got = [0u8; 2];
        r.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hi");
        let second = pulse.last();
        assert!(second > first);
        std::thread::sleep(Duration::from_millis(5));
        drop(a);
        assert_eq!(r.read(&mut got).await.unwrap(), 0);
        assert_eq!(pulse.last(), second, "end of stream is not a sign of life");
    }
}
