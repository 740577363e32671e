//! The endpoint actor's driver: one future for the actor's whole life that wakes it for every
//! kind of progress it arms, so that arming one allocates nothing.
//!
//! What [`FabricEndpoint::schedule`] arms is a state of the actor ([`Driver`], with a deadline
//! for the timed ones); [`Drive`] acts on it each time the actor's task runs:
//!
//! - `Waiting`: the CQ's wait fd, through tokio's readiness ([`AsyncFd::poll_read_ready`]);
//! - `Polling` with a deadline: a [`FineTimer`] (a `timerfd`), reset to each new deadline: its
//!   first sleeps are shorter than tokio's millisecond tick;
//! - `Deferred`: one tokio timer, reset to each new deadline;
//! - `Polling` without one: a yield (the wake-up goes through tokio's deferred list, as
//!   `yield_now`'s does, so the runtime looks at its I/O first);
//! - kicks from the posters and the spin task's word that its spin is over ([`KickSignal`]).
//!
//! Each of those used to be a future of its own, spawned in the actor's context when armed
//! (boxed: one allocation a message and side without spin on `tcp;ofi_rxm`, where every
//! message ends with the actor asleep on the fd) and cancelled when something else was armed.
//!
//! Why one future sees every arming in time: `schedule` runs either in a message handler
//! (actix polls a context's futures after its mailbox, in the same turn) or here, in this
//! future's own loop, which looks at the state again after each pass.
//!
//! [`AsyncFd::poll_read_ready`]: tokio::io::unix::AsyncFd::poll_read_ready

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;

use actix::prelude::*;
use tokio::time::{Instant, Sleep};

use super::poster::{lock, KickSignal};
use super::timer::FineTimer;
use super::{Driver, FabricEndpoint};

/// The actor's driver (see the module docs). Spawned once, when the actor starts; it ends
/// when the endpoint closes.
pub(super) struct Drive {
    signal: Arc<KickSignal>,
    /// Its waker is in the signal (a poster that takes it raises a flag first).
    armed: bool,
    /// The one tokio timer of `Deferred` (and of `Polling` where no `timerfd` could be made),
    /// and the deadline it is set to.
    timer: Pin<Box<Sleep>>,
    timer_at: Option<Instant>,
    /// `Polling`'s timer, made the first time a poll is armed (endpoints with a wait fd seldom
    /// need one); `Err` once making it failed (tokio's timer serves then).
    fine: Option<Result<FineTimer, ()>>,
    /// A yield (`Polling` without a deadline) has handed its wake-up to tokio: the next poll
    /// is its end.
    yielded: bool,
}

impl Drive {
    pub(super) fn new(signal: Arc<KickSignal>) -> Drive {
        Drive {
            signal,
            armed: false,
            // Far off until a deadline is armed; it is reset, never rebuilt.
            timer: Box::pin(tokio::time::sleep_until(
                Instant::now() + std::time::Duration::from_secs(86_400 * 365),
            )),
            timer_at: None,
            fine: None,
            yielded: false,
        }
    }

    /// Whether `Polling`'s deadline `at` has passed, on the fine timer (made on first use);
    /// `None` once that timer is unusable (it could not be made, or failed): tokio's serves then.
    fn fine_due(&mut self, at: Instant, task: &mut std::task::Context<'_>) -> Option<bool> {
        let t = self.fine.get_or_insert_with(|| {
            FineTimer::new().map_err(|e| {
                tracing::warn!("no timerfd for the endpoint's polls ({e}): millisecond polls")
            })
        });
        let t = t.as_mut().ok()?;
        let r = t.reset(at).and_then(|()| match t.poll_expired(task) {
            Poll::Ready(r) => r.map(|()| true),
            Poll::Pending => Ok(false),
        });
        r.map_err(|e| {
            tracing::warn!("the endpoint's timerfd failed ({e}): millisecond polls");
            self.fine = Some(Err(()));
        })
        .ok()
    }

    /// Whether the progress armed in `act.driver` is due now; registers for it if not.
    fn due(&mut self, act: &mut FabricEndpoint, task: &mut std::task::Context<'_>) -> bool {
        if act.driver != Driver::Polling || act.deadline.is_some() {
            self.yielded = false;
        }
        match act.driver {
            Driver::Idle | Driver::Spinning => false,
            Driver::Waiting => {
                let Some(afd) = act.wait.as_ref() else {
                    return true;
                };
                match afd.poll_read_ready(task) {
                    Poll::Ready(Ok(mut guard)) => {
                        guard.clear_ready();
                        true
                    }
                    Poll::Ready(Err(e)) => {
                        // Only when the runtime's I/O driver is gone: poll from now on.
                        tracing::warn!("the CQ's wait fd failed ({e}): polling instead");
                        act.wait = None;
                        true
                    }
                    Poll::Pending => false,
                }
            }
            Driver::Polling | Driver::Deferred => {
                let Some(at) = act.deadline else {
                    // A yield: due at the poll after the one that handed tokio the wake-up.
                    if std::mem::replace(&mut self.yielded, true) {
                        self.yielded = false;
                        return true;
                    }
                    crate::transport::turns::wake_after_io(task);
                    return false;
                };
                if act.driver == Driver::Polling {
                    if let Some(due) = self.fine_due(at, task) {
                        return due;
                    }
                }
                if self.timer_at != Some(at) {
                    self.timer.as_mut().reset(at);
                    self.timer_at = Some(at);
                }
                self.timer.as_mut().poll(task).is_ready()
            }
        }
    }
}

impl ActorFuture<FabricEndpoint> for Drive {
    type Output = ();

    fn poll(
        mut self: Pin<&mut Self>,
        act: &mut FabricEndpoint,
        ctx: &mut Context<FabricEndpoint>,
        task: &mut std::task::Context<'_>,
    ) -> Poll<()> {
        let this = &mut *self;
        loop {
            let raised = !this.armed
                || this.signal.raised.load(Ordering::Acquire)
                || this.signal.spin_over.load(Ordering::Acquire);
            if raised {
                if this.signal.spin_over.swap(false, Ordering::AcqRel) {
                    // Its waker went with the word (or goes soon: then one spurious wake-up).
                    this.armed = false;
                    act.spin_over(ctx);
                    continue;
                }
                if this.signal.raised.swap(false, Ordering::AcqRel) {
                    this.armed = false;
                    {
                        let mut c = lock(&act.core);
                        if c.closed {
                            return Poll::Ready(());
                        }
                        // Posts from now on kick again; the pass below covers the ones before.
                        c.kicked = false;
                    }
                    act.kicked(ctx);
                    continue;
                }
                if !this.armed {
                    let mut w = this.signal.waker.lock().unwrap_or_else(|p| p.into_inner());
                    *w = Some(task.waker().clone());
                    drop(w);
                    this.armed = true;
                    // A flag raised before the waker was in place finds no waker: look again.
                    continue;
                }
            }
            if !this.due(act, task) {
                return Poll::Pending;
            }
            act.driver = Driver::Idle;
            act.deadline = None;
            act.tick(ctx);
        }
    }
}
