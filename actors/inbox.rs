//! `Inbox`: receive actor messages in plain async code.
//!
//! Listeners hand out pipes, and fired operations complete, by sending a message to a
//! [`Recipient`]. Application actors implement the handler themselves; code that is not an actor
//! (a `main`, a test, a task) can make a recipient with [`inbox`] and await what arrives.

use actix::prelude::*;
use tokio::sync::mpsc;

/// A small actor that forwards every `M` it receives into a queue.
pub struct Inbox<M: Message<Result = ()> + Send + 'static> {
    tx: mpsc::UnboundedSender<M>,
}

/// Starts an [`Inbox`] on the current arbiter: messages sent to the recipient come out of the
/// receiver, in order.
pub fn inbox<M: Message<Result = ()> + Send + Unpin + 'static>(
) -> (Recipient<M>, mpsc::UnboundedReceiver<M>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Inbox { tx }.start().recipient(), rx)
}

impl<M: Message<Result = ()> + Send + Unpin + 'static> Actor for Inbox<M> {
    type Context = Context<Self>;
}

impl<M: Message<Result = ()> + Send + Unpin + 'static> Handler<M> for Inbox<M> {
    type Result = ();

    fn handle(&mut self, msg: M, ctx: &mut Self::Context) {
        if self.tx.send(msg).is_err() {
            // Nobody reads any more.
            ctx.stop();
        }
    }
}
