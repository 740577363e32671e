//! Where a pipe's completions go: an awaiting caller (through a deferred answer), a recipient,
//! or a function called in place (a standing receive's handler).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// Where a completion goes: back to an awaiting caller, to a recipient, or to a function.
pub(crate) enum Completer<T: actix::Message<Result = ()> + Send> {
    Reply(Waiter<T>),
    Notify(Recipient<T>),
    Shared(Arc<Recipient<T>>),
    Call(Arc<Calls<T>>),
}

impl<T: actix::Message<Result = ()> + Send + 'static> Completer<T> {
    pub(super) fn complete(self, v: T) {
        match self {
            Completer::Reply(w) => w.complete(v),
            Completer::Notify(r) => r.do_send(v),
            Completer::Shared(r) => r.do_send(v),
            Completer::Call(c) => c.call(v),
        }
    }
}

/// A function that completions are handed to where they happen (the connection's read loop,
/// or the pipe's own handler), with no mailbox in between: a standing receive's handler
/// ([`ReceiveAll::calling`]). The lock serializes calls from the read loop and from the pipe
/// (which the standing receive's sequence numbers already order); a call that panics breaks
/// the function for good, and the pipe fails at its next look, as for a recipient that stopped.
pub(crate) struct Calls<T> {
    f: Mutex<Box<dyn FnMut(T) + Send>>,
    broken: AtomicBool,
}

impl<T> Calls<T> {
    pub(crate) fn new(f: Box<dyn FnMut(T) + Send>) -> Calls<T> {
        Calls {
            f: Mutex::new(f),
            broken: AtomicBool::new(false),
        }
    }

    /// Calls the function with `v`, unless an earlier call panicked.
    pub(super) fn call(&self, v: T) {
        if !self.alive() {
            return;
        }
        let mut f = self.f.lock().unwrap_or_else(|e| e.into_inner());
        // A panic must not unwind through the read loop or the pipe: it ends the function's
        // use instead (the pipe then fails with `Closed`).
        // From a loop on the runtime's queue, inside the thread's spare `LocalSet`, where
        // `actix::spawn` works as on the arbiter's.
        let call = || crate::actors::placement::in_spare_local(|| (*f)(v));
        if catch_unwind(AssertUnwindSafe(call)).is_err() {
            self.broken.store(true, Ordering::Relaxed);
            tracing::error!("the standing receive's handler panicked: the pipe fails");
        }
    }

    /// Whether no call has panicked.
    pub(super) fn alive(&self) -> bool {
        !self.broken.load(Ordering::Relaxed)
    }
}

/// Where every message of a standing receive goes: a recipient, or a handler called in place.
pub(super) enum Sink<T: actix::Message<Result = ()> + Send> {
    Actor(Arc<Recipient<T>>),
    Call(Arc<Calls<T>>),
}

impl<T: actix::Message<Result = ()> + Send + 'static> Sink<T> {
    /// A completer that hands a completion to the same place.
    pub(super) fn completer(&self) -> Completer<T> {
        match self {
            Sink::Actor(r) => Completer::Shared(r.clone()),
            Sink::Call(c) => Completer::Call(c.clone()),
        }
    }

    /// Whether anyone still takes completions (the recipient's actor runs; the handler has not
    /// panicked).
    pub(super) fn connected(&self) -> bool {
        match self {
            Sink::Actor(r) => r.connected(),
            Sink::Call(c) => c.alive(),
        }
    }

    /// Hands `v` over: a `do_send`, or a call.
    #[inline]
    pub(super) fn send(&self, v: T) {
        match self {
            Sink::Actor(r) => r.do_send(v),
            Sink::Call(c) => c.call(v),
        }
    }
}

impl<T: actix::Message<Result = ()> + Send> Clone for Sink<T> {
    fn clone(&self) -> Self {
        match self {
            Sink::Actor(r) => Sink::Actor(r.clone()),
            Sink::Call(c) => Sink::Call(c.clone()),
        }
    }
}

/// The answer of an awaited operation, met halfway: actix hands over the caller's reply sender
/// right after the handler returns ([`Deferred`]), and the pipe completes straight into it
/// ([`Waiter`]). Whichever comes second delivers. Awaiting thus costs no spawned task, boxed
/// future or second channel per operation.
enum Slot<T> {
    /// Neither the reply sender nor the answer has arrived.
    Empty,
    Tx(OneshotSender<T>),
    Value(T),
    /// Delivered, or nobody waits for it.
    Done,
}

/// The handler's side of an awaited operation; see [`Slot`].
pub struct Deferred<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

/// The pipe's side of an awaited operation; see [`Slot`]. Dropped without completing (the
/// actor torn down), it answers with the operation's `lost` completion.
pub(crate) struct Waiter<T> {
    slot: Arc<Mutex<Slot<T>>>,
    id: u64,
    lost: fn(u64) -> T,
}

pub(super) fn deferred<T>(id: u64, lost: fn(u64) -> T) -> (Deferred<T>, Waiter<T>) {
    let slot = Arc::new(Mutex::new(Slot::Empty));
    (Deferred { slot: slot.clone() }, Waiter { slot, id, lost })
}

fn lock<T>(slot: &Mutex<Slot<T>>) -> std::sync::MutexGuard<'_, Slot<T>> {
    // Nothing panics while holding it; a poisoned slot is still consistent.
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> Waiter<T> {
    pub(super) fn complete(self, v: T) {
        self.put(v);
    }

    pub(super) fn put(&self, v: T) {
        let mut slot = lock(&self.slot);
        match mem::replace(&mut *slot, Slot::Done) {
            Slot::Empty => *slot = Slot::Value(v),
            Slot::Tx(tx) => {
                drop(slot);
                let _ = tx.send(v);
            }
            Slot::Value(_) | Slot::Done => {}
        }
    }
}

impl<T> Drop for Waiter<T> {
    fn drop(&mut self) {
        let pending = matches!(*lock(&self.slot), Slot::Empty | Slot::Tx(_));
        if pending {
            self.put((self.lost)(self.id));
        }
    }
}

impl<M> MessageResponse<Pipe, M> for Deferred<M::Result>
where
    M: actix::Message,
{
    fn handle(self, _: &mut actix::Context<Pipe>, tx: Option<OneshotSender<M::Result>>) {
        self.hand_over(tx);
    }
}

impl<T> Deferred<T> {
    /// Takes actix's reply sender (none for a `do_send`).
    pub(super) fn hand_over(self, tx: Option<OneshotSender<T>>) {
        let mut slot = lock(&self.slot);
        match mem::replace(&mut *slot, Slot::Done) {
            Slot::Value(v) => {
                drop(slot);
                if let Some(tx) = tx {
                    let _ = tx.send(v);
                }
            }
            Slot::Empty => {
                if let Some(tx) = tx {
                    *slot = Slot::Tx(tx);
                }
            }
            Slot::Tx(_) | Slot::Done => {}
        }
    }
}
