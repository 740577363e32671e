//! The `cuda_ipc` channel's driver (feature `cuda`): CUDA tensors between two
//! processes of one host, through CUDA IPC handles (the engine is
//! [`crate::backend::cuda_ipc`]).
//!
//! - **Sending.** The pipe exports the tensor when it writes the descriptor (the ready event
//!   recorded on the tensor's stream, the allocation's handle from the context's cache for the
//!   device: [`IpcCaches`]) and puts the [`IpcTensor`] in the
//!   descriptor as the channel data. It hands the tensor here with its [`Outgoing`]: the channel
//!   holds both until the receiver's acknowledgement on the side connection, then drops the
//!   `Outgoing` (ready event back to its pool, staging copy back to the cache) and completes
//!   the write with the buffer.
//! - **Receiving.** The channel opens the handles through the cache of the landing device,
//!   queues the copy on the destination's stream after the ready event, and completes the
//!   tensor at once with the event recorded after the copy (or, for a data-complete read, once
//!   the copy has run). A watcher callback queued after the copy tells this actor it has run; the
//!   actor then acknowledges the tensor on the side connection.
//! - **Closing.** A stopping channel waits for its copies to run and half-closes its side of the
//!   connection; the tensors it sent go back when the peer acknowledges or hangs up (or after a
//!   grace period). A lost side connection fails every tensor still waiting for an ack.
//!
//! Per tensor: one descriptor's 164 bytes of channel data, one ack frame back, no mailbox hop
//! beyond the pipe's hand-off; on a cache hit no `cuIpcGetMemHandle` / `cuIpcOpenMemHandle`.

use std::collections::HashMap;
use std::sync::Arc;

use super::IpcCaches;
use crate::backend::cuda_ipc::{self as engine, IpcTensor, Outgoing};
use crate::backend::cuda_xth::End;
use crate::channel::driver::{CudaDone, Cx, Driver, RecvCuda, SendCuda, ACKS};
use crate::error::Error;
use crate::message::Buffer;
use crate::transport::stream::Done;
use crate::wire::Ack;

/// A `cuda_ipc` channel's context.
type Ctx<'a> = Cx<'a, IpcEvent>;

/// One pipe's `cuda_ipc` channel.
pub(crate) struct CudaIpcDriver {
    /// This pipe's id, the key of its entries in the caches.
    pipe: u64,
    caches: Arc<IpcCaches>,
    /// Tensors sent, waiting for the receiver's acknowledgement.
    sent: HashMap<(u64, u32), (Buffer, Outgoing)>,
    /// Copies queued whose watcher callback has not run yet, with the completion of a
    /// data-complete read (posted once the copy has run).
    copying: HashMap<(u64, u32), Option<CudaDone>>,
    /// Acknowledgements that came before the pipe's hand-off of their tensor reached this actor
    /// (its mailbox and the connection are separate queues), with their `ok`.
    early: HashMap<(u64, u32), bool>,
}

/// Acknowledgements of tensors not handed over yet that a channel keeps; past that the peer is
/// acknowledging what was never sent.
const MAX_EARLY_ACKS: usize = 4096;

impl CudaIpcDriver {
    pub(crate) fn new(pipe: u64, caches: Arc<IpcCaches>) -> Self {
        CudaIpcDriver {
            pipe,
            caches,
            sent: HashMap::new(),
            copying: HashMap::new(),
            early: HashMap::new(),
        }
    }
}

/// What comes back to a `cuda_ipc` channel.
pub(crate) enum IpcEvent {
    /// A copy from a peer's memory has run (posted by its watcher callback).
    Copied { seq: u64, index: u32 },
    /// A stopping channel's grace period is over: its side connection goes.
    Grace,
}

impl CudaIpcDriver {
    /// What an acknowledgement says about the write.
    fn ack_result(ok: bool, cx: &Ctx<'_>) -> Result<(), Error> {
        match ok {
            true => Ok(()),
            false => Err(Error::Device {
                detail: "the receiver could not open or copy this CUDA tensor".into(),
                origin: cx.core.origin.clone(),
            }),
        }
    }

    /// A completion on the side connection: an acknowledgement of a tensor we sent, or the
    /// connection's end.
    fn on_lane(&mut self, d: Done, cx: &mut Ctx<'_>) {
        match d {
            Done::Frame { result, .. } => {
                match cx.core.ack_of(result, "cuda_ipc") {
                    Ok(a) => self.acked(a, cx),
                    Err(e) => self.fail_sent(e, cx),
                }
                // Early acks keep the reading going too: their tensors are on their way.
                if !self.sent.is_empty() || !self.early.is_empty() {
                    cx.core.arm_ack();
                }
            }
            Done::Wrote { result, .. } => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "cuda_ipc acknowledgement not sent");
                }
            }
            other => tracing::error!(
                ?other,
                "unexpected completion on a cuda_ipc side connection"
            ),
        }
    }

    fn acked(&mut self, a: Ack, cx: &mut Ctx<'_>) {
        let key = (a.seq, a.tensor);
        let Some((buffer, out)) = self.sent.remove(&key) else {
            // The pipe's hand-off may still be in our mailbox; a flood of them is a peer
            // acknowledging what was never sent.
            if self.early.len() < MAX_EARLY_ACKS && self.early.insert(key, a.ok).is_none() {
                return;
            }
            let e = Error::protocol(
                format!(
                    "cuda_ipc acknowledgement for message {} tensor {}, which is not waiting for one",
                    a.seq, a.tensor
                ),
                &cx.core.origin,
            );
            return self.fail_sent(e, cx);
        };
        let result = Self::ack_result(a.ok, cx);
        self.release(a.seq, a.tensor, buffer, out, result, cx);
    }

    /// Completes a sent tensor: its ready event goes back to the pool, its staging copy to the
    /// cache, its buffer to the pipe.
    fn release(
        &mut self,
        seq: u64,
        index: u32,
        buffer: Buffer,
        out: Outgoing,
        result: Result<(), Error>,
        cx: &mut Ctx<'_>,
    ) {
        let Outgoing { staging, .. } = out;
        if let Some(s) = staging {
            if let Ok(c) = self.caches.device(s.device()) {
                c.lock().staging.put(s);
            }
        }
        cx.core
            .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, result));
    }

    /// The side connection is gone: every tensor waiting for an ack fails with `e`.
    fn fail_sent(&mut self, e: Error, cx: &mut Ctx<'_>) {
        let sent: Vec<_> = self.sent.drain().collect();
        for ((seq, index), (buffer, out)) in sent {
            self.release(seq, index, buffer, out, Err(e.clone()), cx);
        }
    }

    /// Refuses a tensor we could not read: the sender hears it on the side connection.
    fn refuse(seq: u64, index: u32, cx: &mut Ctx<'_>) {
        cx.core.send_ack(Ack {
            seq,
            tensor: index,
            ok: false,
        });
    }
}

impl Driver for CudaIpcDriver {
    type Event = IpcEvent;

    fn send_cuda(&mut self, m: SendCuda, cx: &mut Ctx<'_>) {
        let SendCuda {
            seq,
            index,
            buffer,
            ipc,
        } = m;
        let result = match ipc {
            // No connection to hear the ack on (a peer that negotiated none): refuse.
            Some(_) if cx.core.lanes.is_empty() => Err(Error::protocol(
                "cuda_ipc was negotiated without its connection",
                &cx.core.origin,
            )),
            Some(out) => match self.early.remove(&(seq, index)) {
                Some(ok) => {
                    let result = Self::ack_result(ok, cx);
                    return self.release(seq, index, buffer, out, result, cx);
                }
                None => {
                    self.sent.insert((seq, index), (buffer, out));
                    return cx.core.arm_ack();
                }
            },
            // Nothing to copy: the receiver expects no acknowledgement either.
            None if buffer.is_empty() => Ok(()),
            None => Err(cx.core.misrouted()),
        };
        cx.core
            .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, result));
    }

    fn recv_cuda(&mut self, m: RecvCuda, cx: &mut Ctx<'_>) {
        let RecvCuda {
            seq,
            index,
            mut buffer,
            data,
            data_complete,
        } = m;
        let len = buffer.len();
        let done = |buffer, event, result| CudaDone::read(seq, index, buffer, event, result);
        if len == 0 {
            return cx.core.cuda_to_pipe(done(buffer, None, Ok(())));
        }
        let Some(t) = IpcTensor::decode(&data, len) else {
            // Without a handle the sender's tensor cannot be read; the sender hears it.
            Self::refuse(seq, index, cx);
            let e = Error::protocol(
                "cuda_ipc channel data does not describe this tensor",
                &cx.core.origin,
            );
            return cx.core.cuda_to_pipe(done(buffer, None, Err(e)));
        };
        let caches = self.caches.clone();
        let pipe = self.pipe;
        let me = cx.fx.sender();
        let copied = move || {
            let _ = me.send(IpcEvent::Copied { seq, index });
        };
        // The copy runs on the destination's stream, on its device; into host memory (the
        // cuda->cpu pair), on a stream of the sender's device, synchronized before returning.
        let started = (|| {
            let (device, dst, stream, lease) = match &mut buffer {
                Buffer::Cuda(b) => (b.device(), End::of(b), b.stream().clone(), None),
                Buffer::Cpu(v) => {
                    let lease = crate::cuda::gpu(t.device)?.lease_stream()?;
                    let stream = lease.arc().clone();
                    let ptr = v.as_mut_ptr() as usize;
                    (t.device, End::Host { ptr }, stream, Some(lease))
                }
                // `Allocation::check` refuses read-only buffers before a read starts.
                _ => {
                    return Err(Error::invalid(
                        "cuda_ipc: a read into read-only (shared) memory",
                    ))
                }
            };
            let cache = caches.device(device)?;
            let mut shared = cache.lock();
            let event = engine::receive(
                &mut shared.cache,
                pipe,
                &t,
                dst,
                len as usize,
                &stream,
                copied,
            )?;
            drop(lease);
            Ok::<_, Error>(event.map(|e| (e, stream)))
        })();
        let key = (seq, index);
        match started {
            // Completes once the copy has run.
            Ok(Some(_)) if data_complete => {
                self.copying.insert(key, Some(done(buffer, None, Ok(()))));
            }
            // Completes now, with the event to wait on (none for host memory: the bytes have
            // landed).
            Ok(event) => {
                self.copying.insert(key, None);
                cx.core.cuda_to_pipe(done(buffer, event, Ok(())));
            }
            Err(e) => {
                Self::refuse(seq, index, cx);
                cx.core.cuda_to_pipe(done(buffer, None, Err(e)));
            }
        }
    }

    fn on_done(&mut self, d: Done, cx: &mut Ctx<'_>) {
        self.on_lane(d, cx);
    }

    /// A copy has run: the sender may have its buffer back.
    fn on_event(&mut self, e: IpcEvent, cx: &mut Ctx<'_>) {
        let IpcEvent::Copied { seq, index } = e else {
            return cx.core.shutdown_lanes();
        };
        let later = self.copying.remove(&(seq, index));
        cx.core.send_ack(Ack {
            seq,
            tensor: index,
            ok: true,
        });
        if let Some(Some(d)) = later {
            cx.core.cuda_to_pipe(d);
        }
    }

    /// As cma's: the tensors we sent go back once the peer acknowledges or hangs up, or after
    /// a grace period.
    fn stop(&mut self, _: Error, cx: &mut Ctx<'_>) {
        cx.fx
            .later(crate::backend::cma::driver::GRACE, IpcEvent::Grace);
    }

    /// Once the copies from the peer's memory have run (and been acknowledged), our side of the
    /// connection is half-closed (see cma's driver).
    fn drained(&mut self, cx: &mut Ctx<'_>) -> bool {
        if !self.copying.is_empty() {
            return false;
        }
        cx.core.close_lane_writes(ACKS);
        self.sent.is_empty() && cx.core.held.is_empty()
    }
}
