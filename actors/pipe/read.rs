//! The read side of the pipe: the descriptor prefetch, starting reads into the user's buffers,
//! and completing reads in order.

use super::*;

impl Pipe {
    pub(super) fn arm_prefetch(&mut self) {
        let p = &self.prefetch;
        if self.error.is_some() || p.in_flight || p.blocked || p.ready.len() >= MAX_PREFETCH {
            return;
        }
        let (Some((_, link)), Some(reply)) = (&self.conn, &self.reply) else {
            return;
        };
        // Whatever the loop reads by itself still fits in the queue.
        let more = (MAX_PREFETCH - 1 - p.ready.len()) as u32;
        let ticket = self.in_ticket;
        self.in_ticket += 1;
        self.prefetch.in_flight = true;
        self.prefetch.more = more;
        link.read(
            InOp::Frame {
                ticket,
                reply: reply.clone(),
                more,
                carried: self.cpu_kind.carried(),
                catch: Some(self.catcher.clone()),
            },
            self.link_gone(),
        );
    }

    /// Checks an incoming descriptor, and sets each tensor's target device to what its route
    /// lands it in ([`Routes::check`](super::routes::Routes::check)).
    pub(super) fn check_descriptor(&self, wd: &mut WireDescriptor) -> Result<(), Error> {
        if wd.seq != self.expect_seq {
            return Err(Error::protocol(
                format!(
                    "descriptor for message {} arrived where message {} was expected",
                    wd.seq, self.expect_seq
                ),
                &self.origin,
            ));
        }
        let basic = matches!(self.cpu_kind, ChannelKind::Basic { .. });
        for (i, ((ch, data), t)) in wd.routes.iter().zip(&mut wd.descriptor.tensors).enumerate() {
            let checked = self
                .routes
                .check(*ch as usize, t.source_device, t.target_device)
                .and_then(|target| match *ch as usize == self.cpu_channel {
                    // Basic tensors follow on the stream, which the read loop tells by their
                    // empty channel data.
                    true if basic && !data.is_empty() => {
                        Err("a basic tensor with channel data".to_string())
                    }
                    _ => Ok(target),
                });
            match checked {
                Ok(target) => t.target_device = target,
                Err(why) => {
                    return Err(Error::protocol(
                        format!(
                            "tensor {i} of message {} names channel {ch} for a {} tensor ({why}); that is not what was negotiated",
                            wd.seq, t.source_device
                        ),
                        &self.origin,
                    ))
                }
            }
        }
        Ok(())
    }

    /// Starts every read that can start, in order, then completes what is finished.
    pub(super) fn advance_reads(&mut self) {
        // The queue is set aside while its entries start, rather than each entry being moved
        // out and back (a pending read is over 250 bytes); `try_start` never looks at it.
        let mut reads = mem::take(&mut self.reads);
        while let Some(op) = reads.get_mut(self.read_cursor) {
            if !self.try_start(op) {
                break;
            }
            self.read_cursor += 1;
        }
        debug_assert!(self.reads.is_empty(), "try_start queued a read");
        self.reads = reads;
        self.pump_reads();
    }

    pub(super) fn try_start(&mut self, op: &mut PendingRead) -> bool {
        match op {
            PendingRead::Caught { .. } => self.try_start_caught(op),
            PendingRead::Descriptor { result, .. } => {
                if let Some(e) = &self.error {
                    *result = Some(Err(e.clone()));
                    return true;
                }
                if self.current.is_some() {
                    // The previous message has not been read yet.
                    return false;
                }
                match self.prefetch.ready.pop_front() {
                    Some(incoming) => {
                        *result = Some(Ok(incoming.wd.descriptor.clone()));
                        self.current = Some(incoming);
                        self.arm_prefetch();
                        true
                    }
                    None => false,
                }
            }
            PendingRead::Read {
                message,
                state,
                data_complete,
                ..
            } if matches!(state, ReadState::Receiving(_)) => {
                let refusal = match (&self.error, &self.current) {
                    (Some(e), _) => Some(e.clone()),
                    (None, Some(_)) => Some(Error::invalid(
                        "Receive issued while a delivered descriptor is unread: send its Read first",
                    )),
                    (None, None) if self.prefetch.ready.is_empty() => return false,
                    (None, None) => None,
                };
                let ReadState::Receiving(spare) = mem::replace(state, ReadState::Finished(Ok(())))
                else {
                    unreachable!("matched above")
                };
                if let Some(e) = refusal {
                    *message = spare.map(hand_back).unwrap_or_default();
                    *state = ReadState::Finished(Err(Box::new(e)));
                    return true;
                }
                let d = &self
                    .prefetch
                    .ready
                    .front()
                    .expect("checked above")
                    .wd
                    .descriptor;
                match spare.map_or_else(|| Allocation::for_descriptor(d), |a| a.refit(d)) {
                    Ok(alloc) => {
                        let incoming = self.prefetch.ready.pop_front().expect("checked above");
                        (*message, *state) = self.start_read(incoming, alloc, *data_complete);
                    }
                    // Sizes that fit no address space: the message stays first in line.
                    Err(e) => *state = ReadState::Finished(Err(Box::new(e))),
                }
                true
            }
            PendingRead::Read {
                message,
                state,
                data_complete,
                ..
            } => {
                let ReadState::Waiting(alloc) = mem::replace(state, ReadState::Finished(Ok(())))
                else {
                    return true;
                };
                let refusal = match (&self.error, &self.current) {
                    (Some(e), _) => Some(e.clone()),
                    (None, None) => Some(Error::invalid(
                        "Read issued with no descriptor to read: send ReadDescriptor first",
                    )),
                    (None, Some(incoming)) => alloc.check(&incoming.wd.descriptor).err(),
                };
                if let Some(e) = refusal {
                    *message = hand_back(alloc);
                    *state = ReadState::Finished(Err(Box::new(e)));
                } else {
                    let incoming = self.current.take().expect("checked above");
                    (*message, *state) = self.start_read(incoming, alloc, *data_complete);
                }
                true
            }
        }
    }

    pub(super) fn start_read(
        &mut self,
        incoming: Incoming,
        alloc: Allocation,
        data_complete: bool,
    ) -> (Message, ReadState) {
        let carried = self.cpu_kind.carried();
        let Incoming {
            wd:
                WireDescriptor {
                    seq,
                    descriptor,
                    routes,
                },
            payloads: bytes,
            inline: read_with_frame,
        } = incoming;
        let inline = read_with_frame.map(|_| bytes);
        // Past the payloads, the carried tensors' bytes if they came with the frame too;
        // otherwise some of this message is still on the stream.
        let mut tensor_bytes = read_with_frame.filter(Inline::whole).map(|i| i.payloads);
        let in_band = tensor_bytes.is_none();
        let mut message = Message {
            metadata: descriptor.metadata,
            payloads: descriptor
                .payloads
                .into_iter()
                .map(|p| Payload {
                    data: Vec::new(),
                    metadata: p.metadata,
                })
                .collect(),
            tensors: descriptor
                .tensors
                .into_iter()
                .map(|t| Tensor {
                    buffer: Buffer::default(),
                    metadata: t.metadata,
                    target_device: t.target_device,
                })
                .collect(),
        };
        let (Some((_, link)), Some(reply)) = (&self.conn, &self.reply) else {
            unreachable!("reads start only while the pipe is open");
        };
        let mut ticket = self.in_ticket;
        let payload_ticket = (!alloc.payloads.is_empty() && inline.is_none()).then_some(ticket);
        if let Some(bytes) = &inline {
            // Read with the descriptor: copy them into the caller's buffers (the sizes match,
            // `Allocation::check` saw to that).
            let mut at = 0;
            for (p, mut b) in message.payloads.iter_mut().zip(alloc.payloads) {
                let n = b.len();
                b.copy_from_slice(&bytes[at..at + n]);
                at += n;
                p.data = b;
            }
        } else if payload_ticket.is_some() {
            link.read(
                InOp::Payloads {
                    ticket,
                    buffers: alloc.payloads,
                    reply: reply.clone(),
                },
                self.link_gone(),
            );
            ticket += 1;
        }
        let mut tensors_out = 0;
        for (i, (buffer, (ch, data))) in alloc.tensors.into_iter().zip(routes).enumerate() {
            if ch as usize != self.cpu_channel {
                // A CUDA channel; the buffer is on the kind of device its route lands in
                // (`Allocation::check`, or the pipe allocated it from the descriptor).
                self.recv_cuda(ch as usize, seq, i as u32, buffer, data, data_complete);
                tensors_out += 1;
                continue;
            }
            // Host memory: `Allocation::check` refused shared (read-only) buffers before.
            let mut buffer = buffer.into_cpu().unwrap_or_default();
            let on_control = carried.carries(&data);
            if let (true, Some(at), Some(bytes)) = (on_control, tensor_bytes.as_mut(), &inline) {
                // Read with the descriptor, like inline payloads.
                let n = buffer.len();
                buffer.copy_from_slice(&bytes[*at..*at + n]);
                *at += n;
                message.tensors[i].buffer = Buffer::Cpu(buffer);
                continue;
            }
            tensors_out += 1;
            if on_control {
                // As for writes: read at its ticket on the control connection, directly.
                link.read(
                    InOp::Tensor {
                        ticket,
                        seq,
                        index: i as u32,
                        memory: Memory::Owned(buffer),
                        offset: 0,
                        reply: reply.clone(),
                    },
                    self.link_gone(),
                );
                ticket += 1;
            } else {
                #[cfg(feature = "efa")]
                if let Some(path) = self.efa_path(ch as usize) {
                    path.borrow_mut().recv(seq, i as u32, buffer, &data);
                    continue;
                }
                self.channels[ch as usize].do_send(RecvTensor {
                    seq,
                    index: i as u32,
                    buffer,
                    data,
                });
            }
        }
        self.in_ticket = ticket;
        if in_band {
            // This was the descriptor holding the prefetch back.
            self.prefetch.blocked = false;
        }
        self.arm_prefetch();
        (
            message,
            ReadState::Running {
                seq,
                payload_ticket,
                payloads_out: payload_ticket.is_some(),
                tensors_out,
                error: None,
                stand_ins: Vec::new(),
                #[cfg(feature = "cuda")]
                cuda: Default::default(),
            },
        )
    }

    /// Hands a tensor to the CUDA channel its descriptor names.
    #[cfg(feature = "cuda")]
    fn recv_cuda(
        &self,
        ch: usize,
        seq: u64,
        index: u32,
        buffer: Buffer,
        data: Vec<u8>,
        data_complete: bool,
    ) {
        self.channels[ch].do_send(super::super::channel::RecvCuda {
            seq,
            index,
            buffer,
            data,
            data_complete,
        });
    }

    /// Without the `cuda` feature no descriptor passes `check_descriptor` naming another channel.
    #[cfg(not(feature = "cuda"))]
    fn recv_cuda(&self, _: usize, _: u64, _: u32, _: Buffer, _: Vec<u8>, _: bool) {
        unreachable!("no CUDA channel in this build")
    }

    pub(super) fn pump_reads(&mut self) {
        while self.reads.front().is_some_and(PendingRead::finished) {
            let op = self.reads.pop_front().expect("front exists");
            self.read_cursor -= 1;
            match op {
                PendingRead::Caught { id, delivered } => {
                    // The read loop completed it (`catch`).
                    let (since, bytes) = delivered.expect("finished");
                    self.metrics.finished(OpKind::Read, since, Ok(bytes));
                    self.info.received_by_read_loop += 1;
                    tracing::trace!(parent: &self.span, id, "read done by the read loop");
                }
                PendingRead::Descriptor {
                    id,
                    since,
                    completer,
                    result,
                } => {
                    let descriptor = self.after_failure(result.expect("finished"), true);
                    let m = descriptor.as_ref().map(|_| 0);
                    self.metrics.finished(OpKind::ReadDescriptor, since, m);
                    completer.complete(DescriptorReady { id, descriptor })
                }
                PendingRead::Read {
                    id,
                    since,
                    completer,
                    message,
                    state,
                    ..
                } => {
                    #[cfg(feature = "cuda")]
                    let mut cuda = crate::cuda::CudaCompletion::default();
                    let mut stand_ins = Vec::new();
                    let result = match state {
                        ReadState::Finished(r) => r.map_err(|e| *e),
                        #[cfg(feature = "cuda")]
                        ReadState::Running {
                            error,
                            cuda: c,
                            stand_ins: s,
                            ..
                        } => {
                            cuda = c;
                            stand_ins = s;
                            error.map_or(Ok(()), |e| Err(*e))
                        }
                        #[cfg(not(feature = "cuda"))]
                        ReadState::Running {
                            error,
                            stand_ins: s,
                            ..
                        } => {
                            stand_ins = s;
                            error.map_or(Ok(()), |e| Err(*e))
                        }
                        ReadState::Waiting(_) | ReadState::Receiving(_) => {
                            unreachable!("not finished")
                        }
                    };
                    let result = self.after_failure(result, true);
                    let bytes = result.as_ref().map(|_| message.total_bytes());
                    self.metrics.finished(OpKind::Read, since, bytes);
                    tracing::trace!(parent: &self.span, id, ok = result.is_ok(), "read done");
                    completer.complete(ReadDone {
                        id,
                        result,
                        message,
                        stand_ins,
                        #[cfg(feature = "cuda")]
                        cuda,
                    });
                }
            }
        }
        self.stand_turn();
        self.maybe_closed();
    }

    pub(super) fn running_read(&mut self, seq: u64) -> Option<(&mut Message, &mut ReadState)> {
        self.reads.iter_mut().find_map(|op| match op {
            PendingRead::Read { message, state, .. } => match state {
                ReadState::Running { seq: s, .. } if *s == seq => Some((message, state)),
                _ => None,
            },
            _ => None,
        })
    }

    // ----- completions from the connection and channels ------------------------------------
}
