//! Completions from the pipe's connection and channels: each finished piece of an operation
//! finds its write or read, and the operations complete in order.

use super::*;

impl Pipe {
    pub(super) fn on_done(&mut self, done: Done) {
        match done {
            Done::Wrote {
                ticket,
                frame,
                payloads,
                result,
            } => {
                {
                    // A write a writer wrote in part may be this one: take it in first.
                    let mut l = self.share.lock();
                    if l.frames.len() < 4 {
                        l.frames.push(frame);
                    }
                    self.writes.extend(l.handoff.drain(..));
                }
                let err = result.err().map(|e| self.op_failed(e));
                if let Some(w) = self.writes.iter_mut().find(|w| w.ticket == ticket) {
                    w.message.payloads = payloads;
                    w.payloads_out = false;
                    if err.is_some() {
                        w.error = err.map(Box::new);
                    }
                }
                self.pump_writes();
            }
            Done::WroteTensor {
                seq,
                index,
                memory,
                result,
                stand_in,
            } => {
                self.tensor_written(seq, index, memory.into_buffer(), result, stand_in);
            }
            Done::Frame {
                ticket,
                result,
                payloads,
                caught,
            } => {
                // Frames a standing receive's read loop delivered used the tickets before it.
                self.in_ticket = self.in_ticket.max(ticket + 1);
                if !caught {
                    self.stand_catch_up();
                }
                let outcome = result.and_then(|f| match f {
                    Frame::Descriptor(mut wd) => self.check_descriptor(&mut wd).map(|_| wd),
                    f => Err(unexpected(f, "a message descriptor", &self.origin)),
                });
                match outcome {
                    Ok(wd) => {
                        self.expect_seq += 1;
                        let inline = inline_len(&wd, self.cpu_kind.carried());
                        // Nothing of it is left on the stream (see `stream::self_contained`).
                        let whole = inline.is_some_and(|i| i.whole());
                        if self.prefetch.more > 0 && whole {
                            // The read loop went on to the next frame by itself, at the next
                            // ticket.
                            self.prefetch.more -= 1;
                            self.in_ticket += 1;
                        } else {
                            self.prefetch.in_flight = false;
                        }
                        // More of this message is on the stream: nothing can be read ahead
                        // before its `Read` has queued those reads.
                        self.prefetch.blocked = !whole;
                        if !caught {
                            self.prefetch.ready.push_back(Incoming {
                                wd,
                                payloads,
                                inline,
                            });
                        }
                        debug_assert!(self.prefetch.ready.len() <= MAX_PREFETCH);
                        self.advance_reads();
                        self.arm_prefetch();
                    }
                    Err(e) => {
                        self.prefetch.in_flight = false;
                        self.fail(e);
                    }
                }
            }
            Done::Payloads {
                ticket,
                buffers,
                result,
            } => {
                let err = result.err().map(|e| self.op_failed(e));
                let hit = self.reads.iter_mut().find_map(|op| match op {
                    PendingRead::Read {
                        message,
                        state:
                            ReadState::Running {
                                payload_ticket,
                                payloads_out,
                                error,
                                ..
                            },
                        ..
                    } if *payload_ticket == Some(ticket) => Some((message, payloads_out, error)),
                    _ => None,
                });
                if let Some((message, out, error)) = hit {
                    for (p, b) in message.payloads.iter_mut().zip(buffers) {
                        p.data = b;
                    }
                    *out = false;
                    if err.is_some() {
                        *error = err.map(Box::new);
                    }
                }
                self.pump_reads();
            }
            Done::Tensor {
                seq,
                index,
                memory,
                result,
                stand_in,
            } => {
                let buffer = Buffer::Cpu(memory.into_vec().unwrap_or_default());
                self.tensor_read(seq, index, buffer, result, stand_in);
                self.pump_reads();
            }
        }
    }

    /// A sent tensor's buffer is back, from whichever channel moved it.
    pub(super) fn tensor_written(
        &mut self,
        seq: u64,
        index: u32,
        buffer: Buffer,
        result: Result<(), Error>,
        stand_in: bool,
    ) {
        self.adopt();
        let err = result.err().map(|e| self.op_failed(e));
        if let Some(w) = self.writes.iter_mut().find(|w| w.seq == seq) {
            if let Some(t) = w.message.tensors.get_mut(index as usize) {
                t.buffer = buffer;
                if stand_in {
                    w.stand_ins.push(index as usize);
                }
            }
            w.tensors_out -= 1;
            if err.is_some() {
                w.error = err.map(Box::new);
            }
        }
        self.pump_writes();
    }

    /// A received tensor is in (or failed), from whichever channel moved it; returns its read's
    /// state, for what a channel adds (a CUDA event). The caller pumps the reads.
    pub(super) fn tensor_read(
        &mut self,
        seq: u64,
        index: u32,
        buffer: Buffer,
        result: Result<(), Error>,
        stand_in: bool,
    ) -> Option<&mut ReadState> {
        let err = result.err().map(|e| self.op_failed(e));
        let (message, state) = self.running_read(seq)?;
        let present = message
            .tensors
            .get_mut(index as usize)
            .map(|t| t.buffer = buffer);
        if let ReadState::Running {
            tensors_out,
            error,
            stand_ins,
            ..
        } = state
        {
            if stand_in && present.is_some() {
                stand_ins.push(index as usize);
            }
            *tensors_out -= 1;
            if err.is_some() {
                *error = err.map(Box::new);
            }
        }
        Some(state)
    }
}
