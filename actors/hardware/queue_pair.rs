//! The queue-pair actor: one per ibv connection. It owns the connection's driver, and through it
//! the queue pair, its completion queue and its registered inbox and outbox
//! (`src/backend/ibv/transport/`). It waits for completions on the queue's notification descriptor,
//! handles them (data and credits in, send slots freed, the send-queue backlog posted) and wakes
//! the connection's two halves, which the shared I/O loops drive as any other stream. It stops
//! once both halves are gone and their last writes have completed, or the peer hung up.
//!
//! One actor per connection rather than one per device: each pipe's queue pair then fails,
//! drains and stops on its own, and an actor never holds one pipe's completions behind
//! another's. A device-wide actor would save one wake-up per completion batch when many pipes
//! share a device; docs/architecture.md weighs it.

use actix::prelude::*;

use crate::backend::ibv::transport::halves::Drive;

/// The actor; it has no public messages: its halves are the connection.
pub(crate) struct QueuePairActor {
    drive: Option<Drive>,
}

impl Actor for QueuePairActor {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(drive) = self.drive.take() {
            ctx.spawn(drive.into_actor(self).map(|(), _, ctx| ctx.stop()));
        }
    }
}

/// Starts the actor for one connection, on the current arbiter.
pub(crate) fn start(drive: Drive) -> Addr<QueuePairActor> {
    QueuePairActor { drive: Some(drive) }.start()
}
