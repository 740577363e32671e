//! A timer finer than tokio's: a `timerfd` watched by the runtime's reactor.
//!
//! tokio's timers tick in whole milliseconds, so a poll armed 25 µs ahead fired a millisecond
//! later. The polling mode's first sleeps past the spin window are shorter than that
//! ([`super::EndpointConfig::min_sleep`]): a message that lands a little after the window has
//! closed (a 1 MiB tensor's round trip on the `shm` provider waits a few hundred
//! microseconds between its messages) is read then, not up to `max_sleep` later. The kernel
//! fires a `timerfd` within its timer slack (50 µs by default for a normal thread).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

/// A one-shot timer on a `timerfd` (see the module docs).
pub(super) struct FineTimer {
    fd: AsyncFd<OwnedFd>,
    /// The deadline it is armed for.
    at: Option<Instant>,
}

impl FineTimer {
    /// A disarmed timer, registered with the current runtime.
    pub(super) fn new() -> io::Result<FineTimer> {
        // SAFETY: plain system call with valid flags; the result is checked below.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` was just returned by the kernel and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(FineTimer {
            fd: crate::backend::shm::fd::watch(fd)?,
            at: None,
        })
    }

    /// Arms the timer for `at` (a deadline already past fires at once), unless it is armed for
    /// it already. Re-arming discards an expiry not read yet.
    pub(super) fn reset(&mut self, at: Instant) -> io::Result<()> {
        if self.at == Some(at) {
            return Ok(());
        }
        // A zero `it_value` would disarm it: one nanosecond is "now".
        let d = at
            .saturating_duration_since(Instant::now())
            .max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: d.as_secs() as libc::time_t,
                tv_nsec: d.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: a timerfd we own; `spec` is a valid itimerspec and the old value is not asked
        // for (null).
        let r =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            self.at = None;
            return Err(io::Error::last_os_error());
        }
        self.at = Some(at);
        Ok(())
    }

    /// Whether the armed deadline has passed (its expiry read); registers `task` if not.
    pub(super) fn poll_expired(&mut self, task: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = match self.fd.poll_read_ready(task) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            let mut count = [0u8; 8];
            // SAFETY: reads 8 bytes (a timerfd's expiry count) into a buffer of 8 bytes.
            let n = unsafe {
                libc::read(
                    guard.get_inner().as_raw_fd(),
                    count.as_mut_ptr().cast(),
                    count.len(),
                )
            };
            if n == 8 {
                self.at = None;
                return Poll::Ready(Ok(()));
            }
            let e = io::Error::last_os_error();
            if n >= 0 || e.kind() == io::ErrorKind::WouldBlock {
                // Readiness left from an expiry a re-arm discarded: wait for the next one.
                guard.clear_ready();
                continue;
            }
            return Poll::Ready(Err(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits for `t` to fire, failing (not hanging) if it has not within 5 s.
    async fn expiry(t: &mut FineTimer) {
        let wait = std::future::poll_fn(|cx| t.poll_expired(cx));
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("the timer fired")
            .expect("the timerfd read");
    }

    /// How precise it is is a matter for the benchmarks (git history's docs/efa-measurements.md, "Between
    /// 64 B and 64 MiB"); this checks that it fires, never early, and that re-arming replaces
    /// the deadline, however loaded the machine.
    #[tokio::test(flavor = "current_thread")]
    async fn fires_after_its_deadline_and_re_arming_moves_it() {
        let mut t = FineTimer::new().unwrap();
        // Re-armed from an hour away to near: only the near deadline counts.
        t.reset(Instant::now() + Duration::from_secs(3600)).unwrap();
        let start = Instant::now();
        t.reset(start + Duration::from_micros(100)).unwrap();
        expiry(&mut t).await;
        let took = start.elapsed();
        assert!(took >= Duration::from_micros(100), "fired early: {took:?}");
        // Re-armed for a deadline already past (the expiry read, the fd not readable): at once.
        t.reset(Instant::now() - Duration::from_millis(1)).unwrap();
        expiry(&mut t).await;
        // Re-armed from near to far before it fires: the near expiry is gone.
        t.reset(Instant::now() + Duration::from_micros(50)).unwrap();
        t.reset(Instant::now() + Duration::from_secs(3600)).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            t.poll_expired(&mut cx).is_pending(),
            "a replaced deadline fired"
        );
    }
}
