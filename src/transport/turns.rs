//! Giving the thread's other tasks their turn, from a connection loop that spins or that has
//! just handed a message to an actor.
//!
//! A context's arbiter thread runs two schedulers, one inside the other: its tokio
//! current-thread runtime, and the `LocalSet` on which actix runs every actor. The `LocalSet` is
//! one future of that runtime, polled only between the runtime's own tasks. A connection loop
//! normally lives on the `LocalSet` too, and a loop that wakes itself (a spin, or a look-again
//! after handing a message on) goes to the back of the same queue as the actors: they run before
//! it is polled again. A loop on the runtime's queue (`ContextBuilder::loops_on_runtime`) that
//! wakes itself the same way is polled again straight away, up to 61 times (the runtime's event
//! interval) before the `LocalSet` gets its next turn: in spin mode an actor waited about 60
//! busy polls of 1 µs for each message (git history's docs/performance-limits.md, "The loops on the runtime's
//! queue").
//!
//! [`on_runtime_queue`] marks such a loop while it is polled, and [`let_actors_run`] gives way
//! the way that reaches the `LocalSet` from there: it hands the waker to the runtime's deferred
//! list (as `tokio::task::yield_now` does), which the runtime wakes only after it has polled its
//! I/O driver and, if an actor is ready, the `LocalSet`. That costs a non-blocking `epoll_wait`,
//! so it is used where an actor is known to wait (the message just handed to one) and at most
//! every few microseconds of a spin, never on every turn.

use std::cell::Cell;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll};

thread_local! {
    /// Set while a loop spawned on the runtime's own queue is polled.
    static ON_RUNTIME_QUEUE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `task` as a loop on the runtime's own queue: while it is polled, [`let_actors_run`]
/// defers its wake-up so that the `LocalSet` gets a turn first.
pub async fn on_runtime_queue<F: Future>(task: F) -> F::Output {
    let mut task = pin!(task);
    std::future::poll_fn(|cx| polling_on_runtime_queue(|| task.as_mut().poll(cx))).await
}

/// Runs `poll` (one poll of a loop on the runtime's own queue) marked as [`on_runtime_queue`]
/// marks it.
pub(crate) fn polling_on_runtime_queue<R>(poll: impl FnOnce() -> R) -> R {
    let outer = ON_RUNTIME_QUEUE.replace(true);
    // Restored even if the task panics, so the flag never leaks to the next task polled.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON_RUNTIME_QUEUE.set(self.0);
        }
    }
    let _restore = Restore(outer);
    poll()
}

/// Whether the task being polled is a loop on the runtime's own queue ([`on_runtime_queue`]).
pub fn is_on_runtime_queue() -> bool {
    ON_RUNTIME_QUEUE.get()
}

/// Wakes the current task so that it is polled again once the thread's actors have had a turn:
/// at once on the `LocalSet` (the task goes behind them in the same queue); deferred until the
/// runtime has polled its driver and the `LocalSet` from a loop on the runtime's queue. The
/// caller returns `Pending`.
pub fn let_actors_run(cx: &mut Context<'_>) {
    if is_on_runtime_queue() {
        wake_after_io(cx);
    } else {
        cx.waker().wake_by_ref();
    }
}

/// Wakes the current task the way `yield_now` does: its waker goes to the runtime's deferred
/// list, woken once the runtime has polled its I/O driver (and, from the runtime's queue, the
/// `LocalSet`). The caller returns `Pending`; no future is kept.
pub fn wake_after_io(cx: &mut Context<'_>) {
    // The first poll of `yield_now` hands the waker to the deferred list and returns
    // `Pending`; dropping it afterwards leaves the waker there.
    let deferred = pin!(tokio::task::yield_now()).poll(cx);
    debug_assert!(deferred.is_pending());
    if deferred.is_ready() {
        cx.waker().wake_by_ref();
    }
}

/// Completes on its second poll, having given the thread's actors a turn in between
/// ([`let_actors_run`]).
pub async fn actors_turn() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if std::mem::replace(&mut yielded, true) {
            return Poll::Ready(());
        }
        let_actors_run(cx);
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    /// How many times a loop on the runtime's queue, which gives way with `give_way` after each
    /// poll, has been polled when a task of the `LocalSet` that it woke on its first poll runs.
    fn polls_until_local_task_runs(give_way: fn(&mut Context<'_>)) -> usize {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let polls = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let (counted, stopping) = (polls.clone(), stop.clone());
            let local_task = tokio::task::spawn_local(async move {
                let _ = rx.await;
                stopping.store(true, Ordering::Relaxed);
                counted.load(Ordering::Relaxed)
            });
            // Let the local task reach its await.
            tokio::task::yield_now().await;
            let mut tx = Some(tx);
            tokio::spawn(on_runtime_queue(std::future::poll_fn(move |cx| {
                if stop.load(Ordering::Relaxed) || polls.fetch_add(1, Ordering::Relaxed) > 1000 {
                    return Poll::Ready(());
                }
                if let Some(tx) = tx.take() {
                    let _ = tx.send(());
                }
                give_way(cx);
                Poll::Pending
            })));
            local_task.await.unwrap()
        })
    }

    #[test]
    fn a_spinning_loop_on_the_runtime_queue_lets_a_woken_actor_run_next() {
        let polls = polls_until_local_task_runs(let_actors_run);
        assert_eq!(
            polls, 1,
            "the local task ran only after {polls} polls of the loop"
        );
    }

    #[test]
    fn a_plain_self_wake_on_the_runtime_queue_starves_the_local_set() {
        // What `let_actors_run` avoids, and the control for the test above: a tokio whose
        // runtime gave the `LocalSet` a turn after every task would show here first.
        let polls = polls_until_local_task_runs(|cx| cx.waker().wake_by_ref());
        assert!(polls > 10, "the local task ran after {polls} polls");
    }

    #[test]
    fn the_mark_is_set_only_inside_the_loop() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            assert!(!is_on_runtime_queue());
            let inside = tokio::spawn(on_runtime_queue(async { is_on_runtime_queue() }))
                .await
                .unwrap();
            assert!(inside);
            assert!(!is_on_runtime_queue());
        });
    }
}
