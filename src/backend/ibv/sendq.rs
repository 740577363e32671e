//! The send-queue backlog (a request that finds the queue full is stashed aside) and the completion loop, shared
//! by the `ibv` transport and the `ibv` channel.
//!
//! A queue pair's send queue holds `max_send_wr` requests until their completions are polled.
//! A request that finds it full waits in a FIFO and is posted as completions free slots; once
//! anything waits, later requests queue behind it, so order is kept and a full queue never fails
//! an operation.

use std::collections::VecDeque;

use super::{Completion, QueuePair, SendWr, VerbsError};

/// Completions taken per `poll` call.
pub const POLL_BATCH: usize = 32;

/// An owner of a queue pair whose completions [`progress`] handles.
pub trait Progress {
    /// The queue pair and its send queue.
    fn queues(&mut self) -> (&mut dyn QueuePair, &mut SendQueue);
    /// A reusable buffer for polled completions (capacity [`POLL_BATCH`]).
    fn scratch(&mut self) -> &mut Vec<Completion>;
    /// Handles one completion.
    fn on_completion(&mut self, c: Completion);
    /// Whether the owner has failed: nothing more is posted then.
    fn has_failed(&self) -> bool;
    /// The verbs call `call` failed.
    fn verbs_failed(&mut self, call: &'static str, e: VerbsError);
}

/// Handles every completion waiting, oldest first, then posts what waits in the backlog while
/// the send queue has room.
pub fn progress(p: &mut impl Progress) {
    let mut scratch = std::mem::take(p.scratch());
    loop {
        scratch.clear();
        let (qp, _) = p.queues();
        match qp.poll(&mut scratch, POLL_BATCH) {
            Ok(n) => {
                for c in scratch.drain(..) {
                    p.on_completion(c);
                }
                if n < POLL_BATCH {
                    break;
                }
            }
            Err(e) => {
                p.verbs_failed("ibv_poll_cq", e);
                break;
            }
        }
    }
    *p.scratch() = scratch;
    if !p.has_failed() {
        let (qp, sq) = p.queues();
        if let Err(e) = sq.drain(qp) {
            p.verbs_failed("ibv_post_send", e);
        }
    }
}

/// Counters of one send queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Work requests posted to the send queue.
    pub posted: u64,
    /// Work requests that had to wait in the backlog first.
    pub backlogged: u64,
    /// The longest the backlog has been.
    pub backlog_max: usize,
}

/// The requests in flight on a send queue and those waiting for a slot.
#[derive(Debug, Default)]
pub struct SendQueue {
    inflight: u32,
    backlog: VecDeque<SendWr>,
    /// Its counters.
    pub stats: SendStats,
}

impl SendQueue {
    /// Posts `wr`, or queues it behind the backlog when the send queue is full. An error other
    /// than a full queue is the caller's to handle (the request is neither posted nor queued).
    pub fn submit(&mut self, qp: &mut dyn QueuePair, wr: SendWr) -> Result<(), VerbsError> {
        if self.backlog.is_empty() && self.inflight < qp.caps().max_send_wr {
            match qp.post_send(&wr) {
                Ok(()) => {
                    self.inflight += 1;
                    self.stats.posted += 1;
                    return Ok(());
                }
                Err(VerbsError::QueueFull(_)) => {}
                Err(e) => return Err(e),
            }
        }
        self.stats.backlogged += 1;
        self.backlog.push_back(wr);
        self.stats.backlog_max = self.stats.backlog_max.max(self.backlog.len());
        Ok(())
    }

    /// Posts waiting requests, oldest first, while the send queue has room.
    pub fn drain(&mut self, qp: &mut dyn QueuePair) -> Result<(), VerbsError> {
        while self.inflight < qp.caps().max_send_wr {
            let Some(wr) = self.backlog.front().copied() else {
                return Ok(());
            };
            match qp.post_send(&wr) {
                Ok(()) => {
                    self.backlog.pop_front();
                    self.inflight += 1;
                    self.stats.posted += 1;
                }
                Err(VerbsError::QueueFull(_)) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One send-queue completion was polled: its slot is free.
    pub fn completed(&mut self) {
        self.inflight = self.inflight.saturating_sub(1);
    }

    /// Whether nothing is in flight or waiting.
    pub fn idle(&self) -> bool {
        self.inflight == 0 && self.backlog.is_empty()
    }

    /// Takes every waiting request out (they will never be posted: the queue pair failed).
    pub fn abandon(&mut self) -> impl Iterator<Item = SendWr> + '_ {
        self.backlog.drain(..)
    }
}
