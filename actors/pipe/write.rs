//! The write side of the pipe: limits, routing, the descriptor frame and the batch written at
//! once, and completing writes in order.

use super::*;

impl Pipe {
    /// The channel a tensor goes through: the one negotiated for its device pair (source, and
    /// target device or the source's kind), else the one for its source's kind on both ends
    /// (the target device is a suggestion: a host tensor suggested for a GPU goes to host
    /// memory over a pipe with no cpu->cuda channel, and its receiver's descriptor says so).
    pub(super) fn route(&self, t: &Tensor) -> Result<usize, Error> {
        self.routes
            .for_tensor(t.device(), t.target_device)
            .ok_or_else(|| Error::Unavailable {
                backend: "channel".into(),
                reason: format!(
                    "no channel this pipe carries for {} tensors (negotiated: {})",
                    t.device(),
                    self.info.channel_list()
                ),
            })
    }

    /// Bytes of channel data a tensor routed to channel `ch` takes in a descriptor.
    pub(super) fn channel_data_len(&self, ch: usize) -> usize {
        writer::channel_data_len(&self.routes, self.cpu_kind, ch)
    }

    pub(super) fn check_limits(&self, m: &Message) -> Result<(), Error> {
        let channel_data = (self.route_buf.iter())
            .map(|&ch| self.channel_data_len(ch as usize))
            .sum();
        writer::check_limits(&self.limits, &self.origin, m, channel_data)
    }

    /// Takes the writes a writer wrote in part into the queue: they precede anything the pipe
    /// issues or completes after this. Called before the pipe issues a write, looks one up or
    /// completes any.
    pub(super) fn adopt(&mut self) {
        let mut l = self.share.lock();
        self.writes.extend(l.handoff.drain(..));
    }

    /// From now on writers hand every write to the pipe (it has failed, or is draining).
    pub(super) fn close_wire(&mut self) {
        let mut l = self.share.lock();
        l.wire = None;
        self.writes.extend(l.handoff.drain(..));
    }

    // ----- writes -------------------------------------------------------------------------

    /// Issues a write and returns its id; `counted`: a writer handed it over, and the ledger
    /// counts it already.
    pub(super) fn submit_write(
        &mut self,
        mut message: Message,
        completer: Completer<WriteDone>,
        counted: bool,
    ) -> u64 {
        // The ledger is locked for the whole write: a writer on another thread waits for it.
        let share = self.share.clone();
        let mut ledger = share.lock();
        let l = &mut *ledger;
        self.writes.extend(l.handoff.drain(..));
        if !counted {
            l.outstanding += 1;
        }
        let id = l.next_id;
        l.next_id += 1;
        let mut w = PendingWrite {
            id,
            seq: u64::MAX,
            ticket: u64::MAX,
            since: self.metrics.start(),
            message: Message::default(),
            payloads_out: false,
            tensors_out: 0,
            error: None,
            stand_ins: Vec::new(),
            completer,
        };
        let refusal = match (&self.error, &self.draining) {
            (Some(e), _) => Some(e.clone()),
            (None, Some(reason)) => Some(Error::Closed {
                reason: format!("closing gracefully ({reason}): no new writes"),
                origin: self.origin.clone(),
            }),
            (None, None) => {
                // Each tensor's channel, kept for the descriptor and the hand-off below (the
                // vector is reused: nothing is allocated per message).
                let mut routes = mem::take(&mut self.route_buf);
                routes.clear();
                let routed = message.tensors.iter().try_for_each(|t| {
                    routes.push(self.route(t)? as u8);
                    Ok(())
                });
                self.route_buf = routes;
                routed
                    .and_then(|_| self.check_limits(&message))
                    .and_then(|_| self.ipc_export(&message))
                    .err()
            }
        };
        let Some(link) = self
            .conn
            .as_ref()
            .map(|c| &c.1)
            .filter(|_| refusal.is_none())
        else {
            #[cfg(feature = "cuda")]
            self.ipc_out.clear();
            w.error = refusal.map(Box::new);
            w.message = message;
            drop(ledger);
            self.writes.push_back(w);
            self.pump_writes();
            return id;
        };
        let seq = l.next_seq;
        let mut frame = l.frames.pop().unwrap_or_default();
        frame.clear();
        let cpu = self.cpu_channel as u8;
        let (kind, id_bytes) = (self.cpu_kind, self.id.to_le_bytes());
        let routes = &self.route_buf;
        #[cfg(feature = "cuda")]
        let ipc_out = &self.ipc_out;
        #[cfg(all(feature = "cuda", feature = "ibv"))]
        let routing = &self.routes;
        encode_frame(&mut frame, FrameKind::Descriptor, |b| {
            wire::encode_descriptor(b, seq, &message, |i, data| {
                if routes[i] != cpu {
                    // cuda_gdr: the sender's GPU, which picks the links the tensor takes.
                    #[cfg(all(feature = "cuda", feature = "ibv"))]
                    if routing.kind(routes[i] as usize) == Some(ChannelKind::CudaGdr) {
                        let gpu = message.tensors[i].buffer.as_cuda().map(|c| c.device());
                        data.set(&crate::backend::ibv::channel::placement::gpu_tag(gpu));
                        return routes[i];
                    }
                    // A CUDA channel: cuda_ipc's export, or the pipe id cuda_xth finds the
                    // sender's buffers by.
                    #[cfg(feature = "cuda")]
                    if let Some(Some(o)) = ipc_out.get(i) {
                        data.set(&o.data.encode());
                        return routes[i];
                    }
                    data.set(&id_bytes);
                    return routes[i];
                }
                match kind {
                    ChannelKind::Xth { .. } => data.set(&id_bytes),
                    ChannelKind::Cma { .. } => {
                        if let Some(buf) = message.tensors[i].buffer.as_cpu() {
                            if !kind.sends_on_control(buf.len() as u64) {
                                data.set(&RemoteBuffer::local(buf).encode())
                            }
                        }
                    }
                    // The length: never empty, unlike an inline tensor's.
                    k if k.gives_length() => {
                        let len = message.tensors[i].buffer.len();
                        if !kind.sends_on_control(len) {
                            data.set(&len.to_le_bytes())
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
            l.frames.push(frame);
            drop(ledger);
            #[cfg(feature = "cuda")]
            self.ipc_out.clear();
            self.writes.push_back(w);
            self.pump_writes();
            return id;
        }
        l.next_seq += 1;
        let ticket = l.out_ticket;
        let on_control = message
            .tensors
            .iter()
            .zip(&self.route_buf)
            .filter(|(t, &ch)| ch == cpu && kind.sends_on_control(t.buffer.len()))
            .count() as u64;
        l.out_ticket += 1 + on_control;
        l.sent_on_control += on_control;
        l.sent_by_channel += message.tensors.len() as u64 - on_control;
        let reply = self
            .reply
            .clone()
            .expect("reply queue lives while the connection does");
        // The message, then each tensor that travels on the control connection (basic, inline
        // cma), at consecutive tickets: written at once, in one vectored write, if the write
        // loop is idle (the usual case for a small message), and completed below with no trip
        // through the loop and the completion queue; whatever is not is queued on the
        // connection. Never through the channel actor.
        let mut batch = writer::start_batch(&mut l.batch, ticket, frame, &mut message, reply);
        let mut next = ticket + 1;
        let mut tensors_out = 0;
        // Tensors for the efa channel's data path, posted once the message is out.
        #[cfg(feature = "efa")]
        let mut efa_out = mem::take(&mut self.efa_out);
        for (i, t) in message.tensors.iter_mut().enumerate() {
            let ch = self.route_buf[i] as usize;
            if ch != self.cpu_channel {
                #[cfg(feature = "cuda")]
                let ipc = self.ipc_out.get_mut(i).and_then(Option::take);
                #[cfg(not(feature = "cuda"))]
                let ipc = None;
                self.send_cuda(ch, seq, i as u32, mem::take(&mut t.buffer), ipc);
                tensors_out += 1;
                continue;
            }
            // Routed to the CPU channel: host memory (`route` sends nothing else there).
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
                tensors_out += 1;
                #[cfg(feature = "efa")]
                if self.efa_path(self.cpu_channel).is_some() {
                    efa_out.push((i as u32, buffer));
                    continue;
                }
                self.channels[self.cpu_channel].do_send(SendTensor {
                    seq,
                    index: i as u32,
                    buffer,
                });
            }
        }
        let queued = batch.len();
        let written = link.write_batch(&mut batch, self.link_gone());
        #[cfg(feature = "efa")]
        if let Some(path) = self.efa_path(self.cpu_channel) {
            let mut path = path.borrow_mut();
            for (index, buffer) in efa_out.drain(..) {
                path.tensor(true, seq, index, buffer);
            }
        }
        #[cfg(feature = "efa")]
        {
            self.efa_out = efa_out;
        }
        // Tensors still out: those on other channels, and those queued on the connection.
        tensors_out += queued - written.max(1);
        w.payloads_out = written == 0;
        for op in batch.drain(..) {
            writer::give_back(op, &mut message, &mut l.frames);
        }
        l.batch = batch;
        drop(ledger);
        w.seq = seq;
        w.ticket = ticket;
        w.tensors_out = tensors_out;
        w.message = message;
        let done = !w.payloads_out && w.tensors_out == 0;
        self.writes.push_back(w);
        if done {
            self.pump_writes();
        }
        id
    }

    /// Hands a tensor to the CUDA channel it was routed to, with what cuda_ipc exported for it.
    #[cfg(feature = "cuda")]
    fn send_cuda(
        &self,
        ch: usize,
        seq: u64,
        index: u32,
        buffer: Buffer,
        ipc: Option<crate::backend::cuda_ipc::Outgoing>,
    ) {
        self.channels[ch].do_send(super::super::channel::SendCuda {
            seq,
            index,
            buffer,
            ipc,
        });
    }

    /// Without the `cuda` feature every tensor is routed to the CPU channel.
    #[cfg(not(feature = "cuda"))]
    fn send_cuda(&self, _: usize, _: u64, _: u32, _: Buffer, _: Option<std::convert::Infallible>) {
        unreachable!("no CUDA channel in this build")
    }

    /// Exports each non-empty tensor routed to a `cuda_ipc` channel for the descriptor (the
    /// ready event recorded on its stream, the allocation's handle from the cache of its
    /// device), into `ipc_out`. The CPU does not wait for the GPU. On failure nothing is kept.
    #[cfg(feature = "cuda")]
    fn ipc_export(&mut self, message: &Message) -> Result<(), Error> {
        self.ipc_out.clear();
        let Some(caches) = &self.ipc else {
            return Ok(());
        };
        for (t, &ch) in message.tensors.iter().zip(&self.route_buf) {
            let out = match (self.routes.kind(ch as usize), t.buffer.as_cuda()) {
                (Some(ChannelKind::CudaIpc { .. }), Some(b)) if !b.is_empty() => {
                    let cache = caches.device(b.device())?;
                    let mut shared = cache.lock();
                    let shared = &mut *shared;
                    match crate::backend::cuda_ipc::send(
                        &mut shared.cache,
                        &mut shared.staging,
                        self.id,
                        b,
                    ) {
                        Ok(o) => Some(o),
                        Err(e) => {
                            self.ipc_out.clear();
                            return Err(e);
                        }
                    }
                }
                _ => None,
            };
            self.ipc_out.push(out);
        }
        Ok(())
    }

    /// Without the `cuda` feature there is nothing to export.
    #[cfg(not(feature = "cuda"))]
    fn ipc_export(&mut self, _: &Message) -> Result<(), Error> {
        Ok(())
    }

    pub(super) fn pump_writes(&mut self) {
        let mut completed = 0;
        self.adopt();
        while self
            .writes
            .front()
            .is_some_and(|w| !w.payloads_out && w.tensors_out == 0)
        {
            let w = self.writes.pop_front().expect("front exists");
            completed += 1;
            let result = self.after_failure(w.error.map_or(Ok(()), |e| Err(*e)), false);
            let bytes = result.as_ref().map(|_| w.message.total_bytes());
            self.metrics.finished(OpKind::Write, w.since, bytes);
            tracing::trace!(parent: &self.span, id = w.id, ok = result.is_ok(), "write done");
            w.completer.complete(WriteDone {
                id: w.id,
                result,
                message: w.message,
                stand_ins: w.stand_ins,
            });
        }
        if completed > 0 {
            // Writers may write themselves again once nothing is pending here.
            self.share.lock().outstanding -= completed;
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
