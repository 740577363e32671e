//! The write side of the pipe: limits, routing, the descriptor frame and the batch written at
//! once, and completing writes in order.

use super::*;

impl Pipe {
    pub(super) fn route(&self, t: &Tensor) -> Result<usize, Error> {
        let source = match t.device() {
            crate::message::Device::Cpu => DeviceKind::Cpu,
            crate::message::Device::Cuda(_) => DeviceKind::Cuda,
        };
        if source == DeviceKind::Cpu {
            return Ok(self.cpu_channel);
        }
        Err(Error::Unavailable {
            backend: "channel".into(),
            reason: format!("no channel negotiated for {} tensors", t.device()),
        })
    }

    /// Bytes of channel data per tensor in a descriptor (the receiver counts them as metadata).
    pub(super) fn channel_data_len(&self) -> usize {
        match self.cpu_kind {
            ChannelKind::Xth { .. } => 8,
            ChannelKind::Cma { .. } => crate::channel::cma::REMOTE_BUFFER_LEN,
            _ => 0,
        }
    }

    pub(super) fn check_limits(&self, m: &Message) -> Result<(), Error> {
        // The first limit that is over, in this order; the error is only built for it.
        let over = |limit, value: u64, max: u64| (value > max).then_some((limit, value, max));
        let l = &self.limits;
        let first = over(
            "payload count",
            m.payloads.len() as u64,
            l.max_payloads as u64,
        )
        .or_else(|| over("tensor count", m.tensors.len() as u64, l.max_tensors as u64))
        .or_else(|| {
            m.payloads
                .iter()
                .find_map(|p| over("payload size", p.data.len() as u64, l.max_payload_size))
        })
        .or_else(|| {
            m.tensors
                .iter()
                .find_map(|t| over("tensor size", t.buffer.len(), l.max_tensor_size))
        })
        .or_else(|| {
            over(
                "metadata size",
                (m.metadata.len()
                    + m.payloads.iter().map(|p| p.metadata.len()).sum::<usize>()
                    + m.tensors.iter().map(|t| t.metadata.len()).sum::<usize>()
                    + m.tensors.len() * self.channel_data_len()) as u64,
                l.max_metadata_size,
            )
        });
        match first {
            Some((limit, value, max)) => Err(Error::LimitExceeded {
                limit,
                value,
                max,
                origin: self.origin.clone(),
            }),
            None => Ok(()),
        }
    }

    // ----- writes -------------------------------------------------------------------------

    pub(super) fn submit_write(&mut self, mut message: Message, completer: Completer<WriteDone>) {
        let id = self.next_write_id;
        self.next_write_id += 1;
        let mut w = PendingWrite {
            id,
            seq: u64::MAX,
            ticket: u64::MAX,
            since: self.metrics.start(),
            message: Message::default(),
            payloads_out: false,
            tensors_out: 0,
            error: None,
            completer,
        };
        let refusal = match (&self.error, &self.draining) {
            (Some(e), _) => Some(e.clone()),
            (None, Some(reason)) => Some(Error::Closed {
                reason: format!("closing gracefully ({reason}): no new writes"),
                origin: self.origin.clone(),
            }),
            (None, None) => self
                .check_limits(&message)
                .and_then(|_| {
                    message
                        .tensors
                        .iter()
                        .try_for_each(|t| self.route(t).map(drop))
                })
                .err(),
        };
        let Some(link) = self
            .conn
            .as_ref()
            .map(|c| &c.1)
            .filter(|_| refusal.is_none())
        else {
            w.error = refusal.map(Box::new);
            w.message = message;
            self.writes.push_back(w);
            self.pump_writes();
            return;
        };
        let seq = self.next_wire_seq;
        let mut frame = self.frames.pop().unwrap_or_default();
        frame.clear();
        let cpu = self.cpu_channel as u8;
        let (kind, id_bytes) = (self.cpu_kind, self.id.to_le_bytes());
        encode_frame(&mut frame, FrameKind::Descriptor, |b| {
            wire::encode_descriptor(b, seq, &message, |i, data| {
                match kind {
                    ChannelKind::Xth { .. } => data.set(&id_bytes),
                    ChannelKind::Cma { .. } => {
                        if let Some(buf) = message.tensors[i].buffer.as_cpu() {
                            if !kind.sends_on_control(buf.len() as u64) {
                                data.set(&RemoteBuffer::local(buf).encode())
                            }
                        }
                    }
                    _ => {}
                }
                cpu
            })
        });
        let body = (frame.len() - wire::LEN_PREFIX) as u64;
        if body > self.limits.max_frame_size as u64 {
            w.error = Some(Box::new(Error::LimitExceeded {
                limit: "frame size",
                value: body,
                max: self.limits.max_frame_size as u64,
                origin: self.origin.clone(),
            }));
            w.message = message;
            self.frames.push(frame);
            self.writes.push_back(w);
            self.pump_writes();
            return;
        }
        self.next_wire_seq += 1;
        let ticket = self.out_ticket;
        let on_control = message
            .tensors
            .iter()
            .filter(|t| kind.sends_on_control(t.buffer.len()))
            .count() as u64;
        self.out_ticket += 1 + on_control;
        self.sent_on_control += on_control;
        self.sent_by_channel += message.tensors.len() as u64 - on_control;
        let reply = self
            .reply
            .clone()
            .expect("reply queue lives while the connection does");
        // The message, then each tensor that travels on the control connection (basic, inline
        // cma), at consecutive tickets: written at once, in one vectored write, if the write
        // loop is idle (the usual case for a small message), and completed below with no trip
        // through the loop and the completion queue; whatever is not is queued on the
        // connection. Never through the channel actor.
        let mut batch = mem::take(&mut self.batch);
        batch.clear();
        batch.push(OutOp::Message {
            ticket,
            frame,
            payloads: mem::take(&mut message.payloads),
            reply,
        });
        let mut next = ticket + 1;
        let mut tensors_out = 0;
        for (i, t) in message.tensors.iter_mut().enumerate() {
            let buffer = Memory::from(mem::take(&mut t.buffer));
            if kind.sends_on_control(buffer.len() as u64) {
                batch.push(OutOp::Tensor {
                    ticket: next,
                    seq,
                    index: i as u32,
                    memory: buffer,
                    offset: 0,
                    chunk_size: kind.control_chunk(),
                    reply: self.reply.clone().expect("checked above"),
                });
                next += 1;
            } else {
                self.channels[self.cpu_channel].do_send(SendTensor {
                    seq,
                    index: i as u32,
                    buffer,
                });
                tensors_out += 1;
            }
        }
        let queued = batch.len();
        let written = link.write_batch(&mut batch, self.link_gone());
        // Tensors still out: those on other channels, and those queued on the connection.
        tensors_out += queued - written.max(1);
        w.payloads_out = written == 0;
        for op in batch.drain(..) {
            // What `Done::Wrote` / `Done::WroteTensor` would do, without building one and
            // finding the write again.
            match op {
                OutOp::Message {
                    frame, payloads, ..
                } => {
                    if self.frames.len() < 4 {
                        self.frames.push(frame);
                    }
                    message.payloads = payloads;
                }
                OutOp::Tensor { index, memory, .. } => {
                    message.tensors[index as usize].buffer = memory.into_buffer();
                }
            }
        }
        self.batch = batch;
        w.seq = seq;
        w.ticket = ticket;
        w.tensors_out = tensors_out;
        w.message = message;
        let done = !w.payloads_out && w.tensors_out == 0;
        self.writes.push_back(w);
        if done {
            self.pump_writes();
        }
    }

    pub(super) fn pump_writes(&mut self) {
        while self
            .writes
            .front()
            .is_some_and(|w| !w.payloads_out && w.tensors_out == 0)
        {
            let w = self.writes.pop_front().expect("front exists");
            let result = self.after_failure(w.error.map_or(Ok(()), |e| Err(*e)), false);
            let bytes = result.as_ref().map(|_| w.message.total_bytes());
            self.metrics.finished(OpKind::Write, w.since, bytes);
            tracing::trace!(parent: &self.span, id = w.id, ok = result.is_ok(), "write done");
            w.completer.complete(WriteDone {
                id: w.id,
                result,
                message: w.message,
            });
        }
        if self.writes.is_empty() && self.error.is_none() {
            if let Some(reason) = self.draining.clone() {
                self.fail(Error::Closed {
                    reason,
                    origin: self.origin.clone(),
                });
            }
        }
        self.maybe_closed();
    }

    // ----- reads --------------------------------------------------------------------------
}
