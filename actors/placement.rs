//! Where a connection loop runs on its thread, and what a handler called from the runtime's
//! queue may do.
//!
//! A context's arbiter thread has two queues (see [`crate::transport::turns`]): its tokio runtime's own,
//! and the arbiter's `LocalSet`, where actix runs every actor. A read loop that hands each
//! message to a handler in place (a standing receive's, `ReceiveAll::calling`) is woken faster
//! from the runtime's queue: the reactor's wake-up goes straight into that queue, while a task of
//! the `LocalSet` is woken through the `LocalSet`'s shared queue and the wake-up of the runtime's
//! main future (git history's docs/performance-limits.md, "Where the runtime queue's gain comes from"). A
//! loop that hands messages to actors is faster on the `LocalSet`, where they run. So a loop
//! *roams* ([`spawn_roaming`]): it runs where its [`Wanted`] says, and moves at its next poll
//! after that changes (the pipe moves its read loop to the runtime's queue while a handler
//! stands, and back when the stand ends).
//!
//! Off the `LocalSet`, tokio's `spawn_local` (behind `actix::spawn` and `Actor::start`) panics.
//! A handler called from the runtime's queue therefore runs inside this thread's *spare*
//! `LocalSet` ([`in_spare_local`]): a `LocalSet` of our own, polled by one task of the
//! arbiter's `LocalSet` ([`prepare_spare_local`]), so that whatever a handler spawns or starts
//! runs on this thread, as it would from the arbiter's `LocalSet`.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::task::LocalSet;

use crate::transport::turns;

thread_local! {
    /// This thread's spare `LocalSet`, while the task that polls it lives.
    static SPARE: RefCell<Option<Rc<LocalSet>>> = const { RefCell::new(None) };
}

/// Makes sure this thread has a spare `LocalSet` for handlers called from the runtime's queue
/// ([`in_spare_local`]). Call it from a task or actor of the arbiter's `LocalSet`: it spawns
/// the task that polls the spare one there (`spawn_local`, which panics outside every
/// `LocalSet`; on a loop of the runtime's queue it does nothing).
pub fn prepare_spare_local() {
    if SPARE.with(|s| s.borrow().is_some()) {
        return;
    }
    // A loop of the runtime's queue is outside every `LocalSet`: `spawn_local` would panic.
    if turns::is_on_runtime_queue() {
        return;
    }
    let local = Rc::new(LocalSet::new());
    let polled = local.clone();
    drop(tokio::task::spawn_local(async move {
        // Forgets the spare `LocalSet` when this task is dropped (its arbiter stopped), so that
        // a later system on this thread makes its own.
        struct Forget;
        impl Drop for Forget {
            fn drop(&mut self) {
                // The thread-local may be gone already at the thread's exit.
                let _ = SPARE.try_with(|s| s.borrow_mut().take());
            }
        }
        let _forget = Forget;
        // Polls the spare `LocalSet`'s tasks whenever one is woken or spawned (`enter` makes a
        // spawn wake this task), for as long as the arbiter runs.
        polled.run_until(std::future::pending::<()>()).await
    }));
    SPARE.with(|s| *s.borrow_mut() = Some(local));
}

/// Runs `f`; on a loop of the runtime's queue ([`turns::is_on_runtime_queue`]), inside this
/// thread's spare `LocalSet` (if [`prepare_spare_local`] made one), so that `actix::spawn`,
/// `Actor::start` and `tokio::task::spawn_local` work in `f` and what they start runs on this
/// thread. On the arbiter's `LocalSet` `f` runs as it is.
pub fn in_spare_local<R>(f: impl FnOnce() -> R) -> R {
    if !turns::is_on_runtime_queue() {
        return f();
    }
    let spare = SPARE.with(|s| s.borrow().clone());
    let _entered = spare.as_ref().map(|l| l.enter());
    f()
}

/// Where a roaming loop should run: `true` for the runtime's own queue, `false` for the
/// arbiter's `LocalSet`. Shared by the loop and whoever decides.
#[derive(Debug, Default)]
pub struct Wanted(AtomicBool);

impl Wanted {
    /// Asks the loop to run on the runtime's queue (`true`) or on the `LocalSet`: it moves at its
    /// next poll.
    pub fn set(&self, on_runtime: bool) {
        self.0.store(on_runtime, Ordering::Relaxed);
    }

    /// Where the loop should run now.
    pub fn on_runtime(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One stay of a roaming loop on one queue (see [`spawn_roaming`]).
struct Stay {
    task: Option<Task>,
    wanted: Arc<Wanted>,
    on_runtime: bool,
}

impl Future for Stay {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if this.wanted.on_runtime() != this.on_runtime {
            // Moves: the next stay polls the loop at once on the other queue, and that poll
            // registers the new task's waker wherever the loop waits (a future must wake the
            // waker of its latest poll), so nothing is left waking this finished task.
            if let Some(task) = this.task.take() {
                spawn_stay(Stay {
                    task: Some(task),
                    wanted: this.wanted.clone(),
                    on_runtime: !this.on_runtime,
                });
            }
            return Poll::Ready(());
        }
        let Some(task) = this.task.as_mut() else {
            return Poll::Ready(());
        };
        if this.on_runtime {
            turns::polling_on_runtime_queue(|| task.as_mut().poll(cx))
        } else {
            task.as_mut().poll(cx)
        }
    }
}

fn spawn_stay(stay: Stay) {
    if stay.on_runtime {
        // The arbiter's runtime is a current-thread runtime: the task stays on this thread.
        drop(tokio::spawn(stay));
    } else {
        // Queued to this thread's arbiter, whose `LocalSet` runs it (this works from either
        // queue). A stopped arbiter drops it: the loop's queue closes, and every op submitted
        // to it fails at once, as for a loop on a stopped I/O thread.
        let _ = actix::Arbiter::current().spawn(stay);
    }
}

/// Runs `task` on the current arbiter's thread, on the queue `wanted` names, moving it between
/// the two whenever `wanted` changes (at its next poll). A move costs a spawn (an allocation);
/// a loop that stays costs one atomic load a poll.
pub fn spawn_roaming(wanted: Arc<Wanted>, task: impl Future<Output = ()> + Send + 'static) {
    let on_runtime = wanted.on_runtime();
    spawn_stay(Stay {
        task: Some(Box::pin(task)),
        wanted,
        on_runtime,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` inside an actix system (a runtime with its `LocalSet`).
    fn in_system<F: Future<Output = ()> + 'static>(f: impl FnOnce() -> F) {
        actix::System::new().block_on(async move { f().await });
    }

    #[test]
    fn a_roaming_loop_moves_when_asked_and_keeps_being_woken() {
        in_system(|| async {
            let wanted = Arc::new(Wanted::default());
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
            let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<(u32, bool)>();
            // The loop reports, for each item, whether it ran on the runtime's queue.
            spawn_roaming(wanted.clone(), async move {
                while let Some(n) = rx.recv().await {
                    let _ = seen_tx.send((n, turns::is_on_runtime_queue()));
                }
            });
            for (n, on_runtime) in [(0, false), (1, true), (2, true), (3, false), (4, true)] {
                wanted.set(on_runtime);
                // The loop sleeps in `recv` with the waker of its last stay: the item must
                // wake it, and it must then run where it was asked to.
                tx.send(n).unwrap();
                let next = tokio::time::timeout(std::time::Duration::from_secs(10), seen.recv());
                let (got, ran_on_runtime) = next
                    .await
                    .unwrap_or_else(|_| panic!("item {n} was not seen: the moved loop sleeps"))
                    .unwrap();
                assert_eq!(got, n);
                assert_eq!(ran_on_runtime, on_runtime, "item {n}");
            }
            drop(tx);
            // The loop ends once its queue closes, wherever it is.
            assert!(seen.recv().await.is_none());
        });
    }

    #[test]
    fn a_handler_on_the_runtime_queue_spawns_into_the_spare_local_set() {
        in_system(|| async {
            prepare_spare_local();
            let (tx, rx) = tokio::sync::oneshot::channel::<bool>();
            let done = tokio::spawn(turns::on_runtime_queue(async move {
                in_spare_local(|| {
                    // What a handler would do: panics outside a `LocalSet`.
                    actix::spawn(async move {
                        let _ = tx.send(turns::is_on_runtime_queue());
                    });
                });
            }));
            done.await.unwrap();
            // The spawned task ran, on this thread, off the runtime's queue.
            assert!(!rx.await.unwrap());
        });
    }

    #[test]
    fn without_a_spare_local_set_a_handler_runs_as_it_is() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            // No `LocalSet` here and nothing prepared: the call still runs.
            let inside = tokio::spawn(turns::on_runtime_queue(async { in_spare_local(|| 7) }))
                .await
                .unwrap();
            assert_eq!(inside, 7);
        });
    }
}
