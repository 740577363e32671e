//! The `cma` side of the channel actor: the receiver reads the sender's memory with
//! `process_vm_readv` on a blocking thread and acknowledges on the side connection; a refused
//! read falls back to streaming the bytes there.

use super::*;
use crate::backend::cma::{self, CmaError, RemoteBuffer};

/// The outcome of a cma read on a blocking thread.
struct CmaRead {
    seq: u64,
    index: u32,
    dst: Vec<u8>,
    result: Result<(), CmaError>,
}

impl Message for CmaRead {
    type Result = ();
}

impl Channel {
    pub(super) fn send_cma(&mut self, m: SendTensor) {
        let key = (true, m.seq, m.index);
        let empty = m.buffer.is_empty();
        self.held.insert(
            key,
            Held {
                buffer: m.buffer,
                out: usize::from(!empty),
                error: None,
                awaiting_ack: !empty,
            },
        );
        if empty {
            self.release(key);
        } else {
            self.arm_ack();
        }
    }

    pub(super) fn recv_cma(&mut self, m: RecvTensor, threads: usize, ctx: &mut Context<Self>) {
        let remote = match RemoteBuffer::decode(&m.data) {
            Some(r) if r.len == m.buffer.len() as u64 => r,
            _ => {
                return self.to_pipe(Done::Tensor {
                    seq: m.seq,
                    index: m.index,
                    memory: Memory::Owned(m.buffer),
                    result: Err(Error::protocol(
                        "cma channel data does not describe this tensor",
                        &self.origin,
                    )),
                })
            }
        };
        let (seq, index, mut dst) = (m.seq, m.index, m.buffer);
        if dst.is_empty() {
            // Nothing to read, and the sender expects no acknowledgement for it.
            return self.to_pipe(Done::Tensor {
                seq,
                index,
                memory: Memory::Owned(dst),
                result: Ok(()),
            });
        }
        let me = ctx.address();
        self.reading += 1;
        actix::spawn(async move {
            let read = tokio::task::spawn_blocking(move || {
                let result = cma::read_remote(&remote, &mut dst, threads);
                (dst, result)
            })
            .await;
            // The blocking task cannot panic short of a bug in the read loop; if it
            // did, its buffer is lost and the pipe reports the tensor as failed.
            let (dst, result) = read.unwrap_or_else(|e| {
                (
                    Vec::new(),
                    Err(CmaError::Other {
                        pid: remote.pid,
                        source: std::io::Error::other(e.to_string()),
                    }),
                )
            });
            me.do_send(CmaRead {
                seq,
                index,
                dst,
                result,
            });
        });
    }

    /// A stopping cma channel whose reads are over half-closes its acknowledgement connection:
    /// the acks already queued still go out, then the peer reads end-of-stream and knows it may
    /// hand back the buffers it was keeping for us. Our read side stays open for its acks.
    pub(super) fn close_acks(&mut self) {
        if !self.acked_by_peer() {
            return;
        }
        // cuda_ipc: the copies from the peer's memory must have run (and been acknowledged).
        #[cfg(feature = "cuda")]
        if self.ipc.as_ref().is_some_and(|s| s.copying()) {
            return;
        }
        if let Some(l) = self.lanes.get_mut(CMA_ACKS) {
            // Dropping the only sender ends the write loop, which then shuts the stream down.
            let (closed, _) = mpsc::unbounded_channel();
            l.link.out = closed;
        }
    }

    pub(super) fn arm_ack(&mut self) {
        if self.ack_armed || self.lanes.is_empty() {
            return;
        }
        self.ack_armed = true;
        self.lane_read_frame(CMA_ACKS);
    }

    pub(super) fn send_ack(&mut self, ack: Ack) {
        if self.lanes.get(CMA_ACKS).is_none() {
            return;
        }
        self.lane_write_ack(CMA_ACKS, ack, Vec::new());
    }

    pub(super) fn on_ack(&mut self, ack: Ack, chunk_size: usize) {
        let key = (true, ack.seq, ack.tensor);
        let Some(h) = self.held.get_mut(&key).filter(|h| h.awaiting_ack) else {
            return self.fail_held(Error::protocol(
                format!(
                    "cma acknowledgement for message {} tensor {}, which is not waiting for one",
                    ack.seq, ack.tensor
                ),
                &self.origin,
            ));
        };
        h.awaiting_ack = false;
        if ack.ok {
            h.out -= 1;
            self.release(key);
            return;
        }
        // The receiver cannot read our memory: stream the bytes over the data connection.
        let n = h.buffer.len();
        let ptr = h.buffer.base_ptr();
        // SAFETY: the buffer stays in `self.held`, untouched, until this operation completes
        // (its `Done` decrements `out`, which is still 1 for the ack we were waiting for); the
        // operation is a write, so shared bytes are only read through the region.
        let region = unsafe { Region::new(ptr, n) };
        let reply = self.own();
        let l = &mut self.lanes[CMA_DATA];
        let ticket = l.out_ticket;
        l.out_ticket += 1;
        l.link.write(
            OutOp::Tensor {
                ticket,
                seq: ack.seq,
                index: ack.tensor,
                memory: Memory::Region(region),
                offset: 0,
                chunk_size,
                reply,
            },
            lane_gone,
        );
    }

    fn on_cma_read(&mut self, r: CmaRead, ctx: &mut Context<Self>) {
        self.reading -= 1;
        let key = (false, r.seq, r.index);
        match r.result {
            Ok(()) => {
                self.send_ack(Ack {
                    seq: r.seq,
                    tensor: r.index,
                    ok: true,
                });
                self.to_pipe(Done::Tensor {
                    seq: r.seq,
                    index: r.index,
                    memory: Memory::Owned(r.dst),
                    result: Ok(()),
                });
            }
            Err(CmaError::NotPermitted { .. }) if self.lanes.len() > CMA_DATA => {
                crate::metrics::fallback("cma");
                let n = self.fallbacks.fetch_add(1, Ordering::Relaxed);
                if n == 0 {
                    tracing::warn!(pipe = ?self.origin.pipe, "cma read refused by the kernel; falling back to the side connection");
                }
                self.send_ack(Ack {
                    seq: r.seq,
                    tensor: r.index,
                    ok: false,
                });
                let mut dst = r.dst;
                let n = dst.len();
                let ptr = dst.as_mut_ptr();
                self.held.insert(
                    key,
                    Held {
                        buffer: Memory::Owned(dst),
                        out: 1,
                        error: None,
                        awaiting_ack: false,
                    },
                );
                // SAFETY: as in `stripe`: `dst` stays in `self.held` until this read completes.
                let region = unsafe { Region::new(ptr, n) };
                let reply = self.own();
                let l = &mut self.lanes[CMA_DATA];
                let ticket = l.in_ticket;
                l.in_ticket += 1;
                l.link.read(
                    InOp::Tensor {
                        ticket,
                        seq: r.seq,
                        index: r.index,
                        memory: Memory::Region(region),
                        offset: 0,
                        reply,
                    },
                    lane_gone,
                );
            }
            Err(e) => self.to_pipe(Done::Tensor {
                seq: r.seq,
                index: r.index,
                memory: Memory::Owned(r.dst),
                result: Err(e.into_error(&self.origin)),
            }),
        }
        self.maybe_stop(ctx);
    }
}

impl Handler<CmaRead> for Channel {
    type Result = ();

    fn handle(&mut self, r: CmaRead, ctx: &mut Self::Context) {
        self.on_cma_read(r, ctx);
        self.poll_own(ctx);
    }
}

/// The cma lane carrying acknowledgements (each side's, for the other's sends).
pub(super) const CMA_ACKS: usize = 0;
/// The cma lane carrying fallback bytes (each side's, for the other's refused reads).
pub(super) const CMA_DATA: usize = 1;

/// How long a stopping cma sender waits for its peer to finish reading its buffers.
pub(super) const CMA_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
