//! Where a pipe's completions go: an awaiting caller (through a deferred answer) or a recipient.

use super::*;

/// Where a completion goes: back to an awaiting caller, or to a recipient.
pub(crate) enum Completer<T: actix::Message<Result = ()> + Send> {
    Reply(Waiter<T>),
    Notify(Recipient<T>),
    Shared(Arc<Recipient<T>>),
}

impl<T: actix::Message<Result = ()> + Send + 'static> Completer<T> {
    pub(super) fn complete(self, v: T) {
        match self {
            Completer::Reply(w) => w.complete(v),
            Completer::Notify(r) => r.do_send(v),
            Completer::Shared(r) => r.do_send(v),
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
