//! Spin mode's driver (see the module docs of [`super`]): one long-lived task that reads the
//! endpoint's CQ on every turn of its thread while a spin lasts, and sleeps in between.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use super::poster::KickSignal;
use super::progress::Progress;

/// Spin mode's driver: a task of the actor's thread for the actor's whole life. While a spin
/// lasts ([`Progress::spin`] is set) it wakes itself at once after each turn, reading the CQ
/// each time, until spin mode is no longer due; then it tells the actor
/// ([`KickSignal::end_spin`]), which arms the wait fd or a poll as usual, and sleeps until the
/// actor starts the next spin ([`Progress::start_spin`] wakes it). The actor ends a spin early
/// by clearing [`Progress::spin`]: the task sees it at its next turn. It ends when the actor
/// stops ([`Progress::closed`]).
///
/// A task of its own, not a future of the actor's context: actix polls every future of an
/// actor (its mailbox, its timers, its kicks) whenever the actor's task runs, so each turn as
/// an actor future cost the whole actor's poll (about 2,900 instructions a turn on `shm`;
/// docs/efa.md, "Progress"), and a message that landed just after a CQ read waited that long
/// for the next. One task for the actor's life, not one per spin: a ping-pong in spin mode
/// starts a spin per message, and each spawn was an allocation (the task), and each end
/// another (the message to the actor).
pub(super) struct Spinner {
    progress: Rc<RefCell<Progress>>,
    signal: Arc<KickSignal>,
    /// The spin under way here (the number it had in [`Progress::spin`] when it began).
    id: Option<u64>,
    /// When this spin last offered the CPU to other threads.
    os_yield: Instant,
    /// Turns so far: the clock is read on every `CLOCK_EVERY`-th only.
    turns: u32,
}

/// How often a spin offers its CPU to other threads (`sched_yield`). Without it a peer woken
/// onto this CPU waits for the whole spin to end (on the 2-core VM, a `tcp;ofi_rxm` round trip
/// then took twice the spin window). The shm transport's 5 µs was worse here under load: the
/// `shm` rows of `bench efa` fell, one run in three, to 18 µs instead of 2.2 µs (both sides
/// trading the CPU by `sched_yield`); 20 µs and 100 µs showed neither (docs/efa.md).
const OS_YIELD_EVERY: Duration = Duration::from_micros(20);

/// How many turns a spin takes between reads of the clock (for its window and its
/// `sched_yield`s): a clock read costs as much as the rest of a turn in a VM.
const CLOCK_EVERY: u32 = 8;

impl Spinner {
    pub(super) fn new(progress: Rc<RefCell<Progress>>, signal: Arc<KickSignal>) -> Spinner {
        Spinner {
            progress,
            signal,
            id: None,
            os_yield: Instant::now(),
            turns: 0,
        }
    }
}

impl Future for Spinner {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, task: &mut std::task::Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let mut p = this.progress.borrow_mut();
        if p.closed {
            return Poll::Ready(());
        }
        if p.spin.is_none() || p.spin != this.id {
            // No spin, or one that ended early (the actor armed something else) and perhaps a
            // newer one since.
            this.id = p.spin;
            if this.id.is_none() {
                p.spinner = Some(task.waker().clone());
                return Poll::Pending;
            }
            this.os_yield = Instant::now();
            this.turns = 0;
        }
        // Every turn reads the CQ, unless a stream reader has since its last turn
        // (`Progress::turn`). Skipping it for 8 turns after a pass that handed out ends (so
        // that the tasks those ends woke ran first) cost 64 B round trips once the stream
        // posted straight into the engine: on 16 cores `tcp;ofi_rxm` `actor spin` 1.69x ->
        // 1.46x raw, on the 2-core VM `shm` `transport spin` 2.45 -> 2.00 us (docs/efa.md).
        p.turn();
        this.turns = this.turns.wrapping_add(1);
        let now = (this.turns % CLOCK_EVERY == 0).then(Instant::now);
        let due = match now {
            Some(now) => p.spin_due_at(now),
            None => p.busy(),
        };
        if due {
            drop(p);
            // The peer may have been woken onto this CPU (the scheduler puts a woken thread
            // next to its waker): offer it the CPU now and then, as the shm transport's spin
            // does, or it would wait for the whole spin to end.
            if let Some(now) = now.filter(|n| n.duration_since(this.os_yield) >= OS_YIELD_EVERY) {
                this.os_yield = now;
                std::thread::yield_now();
            }
            // Straight back into the run queue, behind the tasks already in it: no park of the
            // runtime (an `epoll_wait`) between turns, as `yield_now` would do.
            task.waker().wake_by_ref();
            return Poll::Pending;
        }
        p.spin = None;
        this.id = None;
        p.spinner = Some(task.waker().clone());
        drop(p);
        self.signal.end_spin();
        Poll::Pending
    }
}
