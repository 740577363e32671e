//! The standing receive ([`ReceiveAll`]): one recipient gets every message, without a
//! `Receive` per message.
//!
//! Two sides deliver to it, in order. The connection's read loop delivers each self-contained
//! message whose sequence number is the stand's `seq` ([`catch::Stand`]), moves `seq` on and
//! reads the next frame by itself, without telling the pipe ([`Caught::Silently`]). Any other
//! message reaches the pipe as a frame; the pipe reads it as a `Receive` would
//! ([`Pipe::stand_turn`] queues one per message it holds) and completes it to the same
//! recipient. Such a message is never caught, so `seq` stays at it, and no later message can
//! be caught until the pipe, holding nothing any more, moves `seq` past what it read. The slot's
//! lock orders the two sides' sends to the recipient.
//!
//! The pipe's per-message bookkeeping for what the read loop delivered (the expected sequence
//! number, the connection tickets, the count in [`PipeInfo::received_by_read_loop`]) is caught
//! up lazily: from the stand's `seq` and the ticket of the next frame that reaches the pipe,
//! and from the stand's count when asked.
//!
//! [`Caught::Silently`]: crate::transport::stream::Caught::Silently

use super::*;

/// The pipe's side of a standing receive.
pub(super) struct Standing {
    to: Sink<ReadDone>,
    /// Buffers to read the next messages into ([`Recycle`]), the last given first.
    spares: Vec<Allocation>,
}

impl Pipe {
    /// Takes the id of the next read, from the stand's count while one stands.
    fn take_read_id(&mut self) -> u64 {
        if self.stand.is_some() {
            if let Some(id) = self.catcher.with_stand(|s| {
                s.next_id += 1;
                s.next_id - 1
            }) {
                return id;
            }
        }
        self.next_read_id += 1;
        self.next_read_id - 1
    }

    fn begin_stand(&mut self, to: Deliver) -> Result<(), Error> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        // A `Receive` the read loop completed may not be settled yet.
        if matches!(self.reads.front(), Some(PendingRead::Caught { .. })) {
            self.advance_reads();
        }
        if self.stand.is_some() {
            return Err(Error::invalid(
                "ReceiveAll while a standing receive stands: send StopReceiving first",
            ));
        }
        if !self.reads.is_empty() || self.current.is_some() {
            return Err(Error::invalid(
                "ReceiveAll with reads pending (or a delivered descriptor unread): let them complete first",
            ));
        }
        // Messages read ahead go first: the read loop may deliver none before the pipe has
        // delivered them, so its first is the first of those, which it never sees again.
        let seq = match self.prefetch.ready.front() {
            Some(first) => first.wd.seq,
            None => self.expect_seq.max(self.caught_through),
        };
        let to = match to {
            Deliver::To(r) => Sink::Actor(Arc::new(r)),
            Deliver::Calling(f) => {
                // A read loop on the runtime's queue (following it, or `loops_on_runtime`)
                // calls it there: spawns made in it go to the thread's spare `LocalSet`
                // (`transport::placement`), polled from this one. Made once per thread.
                crate::actors::placement::prepare_spare_local();
                if let Some(wanted) = &self.read_roams {
                    wanted.set(true);
                }
                Sink::Call(Arc::new(Calls::new(f)))
            }
        };
        self.catcher.stand(catch::Stand {
            to: to.clone(),
            seq,
            next_id: self.next_read_id,
            delivered: 0,
        });
        self.stand = Some(Standing {
            to,
            spares: Vec::new(),
        });
        // Messages read ahead already go first.
        self.stand_turn();
        Ok(())
    }

    /// Ends the stand: the read loop delivers nothing more, and the pipe takes its
    /// bookkeeping back. Returns where it delivered, if one stood.
    pub(super) fn end_stand(&mut self) -> Option<Sink<ReadDone>> {
        let standing = self.stand.take()?;
        // Back to the `LocalSet`, where the actors it may now hand messages to run.
        if let Some(wanted) = &self.read_roams {
            wanted.set(false);
        }
        if let Some(s) = self.catcher.unstand() {
            self.expect_seq = self.expect_seq.max(s.seq);
            self.caught_through = self.caught_through.max(s.seq);
            self.next_read_id = s.next_id;
            self.info.received_by_read_loop += s.delivered;
        }
        Some(standing.to)
    }

    /// Ends the stand because the pipe failed: after the messages the pipe was still reading
    /// (which complete with the error, unless all their bytes were in), the recipient gets one
    /// `ReadDone` with the error, its last.
    pub(super) fn end_stand_failed(&mut self) {
        let Some(to) = self.end_stand() else { return };
        let id = self.take_read_id();
        self.metrics.issued(OpKind::Read);
        self.reads.push_back(PendingRead::Read {
            id,
            since: self.metrics.start(),
            completer: to.completer(),
            message: Message::default(),
            state: ReadState::Receiving(None),
            data_complete: false,
        });
    }

    /// While a stand stands, after the pipe's reads moved: queues a read, to the recipient,
    /// for each message the pipe holds (at most [`MAX_PREFETCH`] at once), and once it holds
    /// none lets the read loop deliver the next message itself.
    pub(super) fn stand_turn(&mut self) {
        let Some(standing) = &self.stand else { return };
        if self.stand_turning || self.error.is_some() {
            return;
        }
        if !standing.to.connected() {
            let reason = match &standing.to {
                Sink::Actor(_) => "the recipient of the standing receive (ReceiveAll) stopped",
                Sink::Call(_) => "the handler of the standing receive (ReceiveAll) panicked",
            };
            self.fail(Error::Closed {
                reason: reason.into(),
                origin: self.origin.clone(),
            });
            return;
        }
        let to = standing.to.clone();
        self.stand_turning = true;
        loop {
            let room = MAX_PREFETCH.saturating_sub(self.reads.len());
            let n = self.prefetch.ready.len().min(room);
            if n == 0 || self.error.is_some() || self.current.is_some() {
                break;
            }
            for _ in 0..n {
                let id = self.take_read_id();
                self.metrics.issued(OpKind::Read);
                let spare = self.stand.as_mut().and_then(|s| s.spares.pop());
                self.reads.push_back(PendingRead::Read {
                    id,
                    since: self.metrics.start(),
                    completer: to.completer(),
                    message: Message::default(),
                    state: ReadState::Receiving(spare),
                    data_complete: false,
                });
            }
            self.advance_reads();
        }
        self.stand_turning = false;
        let idle = self.error.is_none()
            && self.reads.is_empty()
            && self.prefetch.ready.is_empty()
            && self.current.is_none();
        if idle {
            // Every message the pipe saw is delivered: the next one may be the read loop's.
            let seq = self.expect_seq;
            self.catcher.with_stand(|s| s.seq = s.seq.max(seq));
        }
    }

    /// Before the pipe checks a frame the read loop did not take: the messages the loop
    /// delivered since the pipe last looked come before it.
    pub(super) fn stand_catch_up(&mut self) {
        if self.stand.is_some() {
            if let Some(seq) = self.catcher.with_stand(|s| s.seq) {
                self.expect_seq = self.expect_seq.max(seq);
            }
        }
    }

    /// `received_by_read_loop`, with what the standing receive's read loop delivered so far.
    pub(super) fn received_by_read_loop(&self) -> u64 {
        let standing = match &self.stand {
            Some(_) => self.catcher.with_stand(|s| s.delivered).unwrap_or(0),
            None => 0,
        };
        self.info.received_by_read_loop + standing
    }

    /// Completes a read operation sent while a stand stands, with `InvalidArgument`.
    pub(super) fn refuse_while_standing(&mut self, op: PendingOp) {
        let e = Error::invalid(
            "Read, ReadDescriptor and Receive are refused while a standing receive (ReceiveAll) stands: send StopReceiving first",
        );
        match op {
            PendingOp::ReadDescriptor(c) => {
                let id = self.take_read_id();
                c.complete(DescriptorReady {
                    id,
                    descriptor: Err(e),
                });
            }
            PendingOp::Read(state, _, _, c) => {
                let id = self.take_read_id();
                let message = match state {
                    ReadState::Waiting(a) | ReadState::Receiving(Some(a)) => hand_back(a),
                    _ => Message::default(),
                };
                c.complete(ReadDone {
                    id,
                    result: Err(e),
                    message,
                    stand_ins: Vec::new(),
                    #[cfg(feature = "cuda")]
                    cuda: Default::default(),
                });
            }
            PendingOp::Write(..) | PendingOp::Close(..) => unreachable!("only reads are refused"),
        }
    }
}

impl Handler<ReceiveAll> for Pipe {
    type Result = Result<(), Error>;

    fn handle(&mut self, ReceiveAll { to }: ReceiveAll, _: &mut Self::Context) -> Self::Result {
        let span = self.span.clone();
        let _entered = span.enter();
        self.begin_stand(to)
    }
}

impl Handler<Recycle> for Pipe {
    type Result = ();

    fn handle(&mut self, Recycle(spare): Recycle, _: &mut Self::Context) {
        if let Some(s) = &mut self.stand {
            if s.spares.len() < MAX_PREFETCH {
                s.spares.push(spare);
            }
        }
    }
}

impl Handler<StopReceiving> for Pipe {
    type Result = Result<u64, Error>;

    fn handle(&mut self, _: StopReceiving, _: &mut Self::Context) -> Self::Result {
        match self.end_stand() {
            Some(_) => Ok(self.next_read_id),
            None => Err(Error::invalid("StopReceiving with no standing receive")),
        }
    }
}
