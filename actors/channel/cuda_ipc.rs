//! The `cuda_ipc` side of the channel actor (feature `cuda`): CUDA tensors between two
//! processes of one host, through CUDA IPC handles (the engine is
//! [`crate::backend::cuda_ipc`]).
//!
//! - **Sending.** The pipe exports the tensor when it writes the descriptor (the ready event
//!   recorded on the tensor's stream, the allocation's handle from the context's cache for the
//!   device: [`crate::actors::hardware::cuda_ipc::IpcCaches`]) and puts the [`IpcTensor`] in the
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

use super::*;
use crate::actors::hardware::cuda_ipc::IpcCaches;
use crate::backend::cuda_ipc::{self as engine, IpcTensor, Outgoing};
use crate::backend::cuda_xth::End;
use crate::message::Buffer;

/// The state of a `cuda_ipc` channel.
pub(crate) struct IpcSide {
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

impl IpcSide {
    pub(crate) fn new(caches: Arc<IpcCaches>) -> Self {
        IpcSide {
            caches,
            sent: HashMap::new(),
            copying: HashMap::new(),
            early: HashMap::new(),
        }
    }

    /// Whether tensors are still out (the channel cannot stop yet).
    pub(super) fn busy(&self) -> bool {
        !self.sent.is_empty() || !self.copying.is_empty()
    }

    /// Whether copies from the peer's memory are still queued.
    pub(super) fn copying(&self) -> bool {
        !self.copying.is_empty()
    }
}

/// A copy from a peer's memory has run (posted by its watcher callback).
struct IpcCopied {
    seq: u64,
    index: u32,
}

impl Message for IpcCopied {
    type Result = ();
}

impl Channel {
    /// Gives a `cuda_ipc` channel the context's handle caches (before it starts).
    pub(crate) fn with_ipc(mut self, caches: Arc<IpcCaches>) -> Self {
        self.ipc = Some(IpcSide::new(caches));
        self
    }

    fn ipc_missing(&self) -> Error {
        Error::protocol(
            "internal: a cuda_ipc channel without its handle caches",
            &self.origin,
        )
    }

    pub(super) fn send_cuda_ipc(&mut self, m: SendCuda) {
        let SendCuda {
            seq,
            index,
            buffer,
            ipc,
        } = m;
        let result = match (&mut self.ipc, ipc) {
            // No connection to hear the ack on (a peer that negotiated none): refuse.
            (Some(_), Some(_)) if self.lanes.is_empty() => Err(Error::protocol(
                "cuda_ipc was negotiated without its connection",
                &self.origin,
            )),
            (Some(side), Some(out)) => match side.early.remove(&(seq, index)) {
                Some(ok) => {
                    let result = self.ack_result(ok);
                    return self.ipc_release(seq, index, buffer, out, result);
                }
                None => {
                    side.sent.insert((seq, index), (buffer, out));
                    return self.arm_ack();
                }
            },
            // Nothing to copy: the receiver expects no acknowledgement either.
            (Some(_), None) if buffer.is_empty() => Ok(()),
            (None, _) => Err(self.ipc_missing()),
            (Some(_), None) => Err(self.misrouted()),
        };
        self.cuda_to_pipe(CudaDone::wrote(seq, index, buffer, result));
    }

    pub(super) fn recv_cuda_ipc(&mut self, m: RecvCuda, ctx: &mut Context<Self>) {
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
            return self.cuda_to_pipe(done(buffer, None, Ok(())));
        }
        let Some(t) = IpcTensor::decode(&data, len) else {
            // Without a handle the sender's tensor cannot be read; the sender hears it.
            self.send_ack(Ack {
                seq,
                tensor: index,
                ok: false,
            });
            let e = Error::protocol(
                "cuda_ipc channel data does not describe this tensor",
                &self.origin,
            );
            return self.cuda_to_pipe(done(buffer, None, Err(e)));
        };
        let Some(caches) = self.ipc.as_ref().map(|s| s.caches.clone()) else {
            let e = self.ipc_missing();
            return self.cuda_to_pipe(done(buffer, None, Err(e)));
        };
        let pipe = pipe_of(&self.kind);
        let me = ctx.address();
        let copied = move || me.do_send(IpcCopied { seq, index });
        // The copy runs on the destination's stream, on its device; into host memory (the
        // cuda->cpu pair), on a stream of the sender's device, synchronized before returning.
        let started = (|| {
            let (device, dst, stream, lease) = match &mut buffer {
                Buffer::Cuda(b) => (
                    b.device(),
                    End::Device {
                        ptr: b.device_ptr(),
                        gpu: b.gpu().clone(),
                    },
                    b.stream().clone(),
                    None,
                ),
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
            Ok(event) => {
                let side = self.ipc.as_mut().expect("checked above");
                match (event, data_complete) {
                    // Completes once the copy has run.
                    (Some(_), true) => {
                        side.copying.insert(key, Some(done(buffer, None, Ok(()))));
                    }
                    // Completes now, with the event to wait on (none for host memory: the
                    // bytes have landed).
                    (event, _) => {
                        side.copying.insert(key, None);
                        self.cuda_to_pipe(done(buffer, event, Ok(())));
                    }
                }
            }
            Err(e) => {
                self.send_ack(Ack {
                    seq,
                    tensor: index,
                    ok: false,
                });
                self.cuda_to_pipe(done(buffer, None, Err(e)));
            }
        }
    }

    /// A completion on the side connection: an acknowledgement of a tensor we sent, or the
    /// connection's end.
    pub(super) fn ipc_lane(&mut self, d: Done) {
        match d {
            Done::Frame { result, .. } => {
                self.ack_armed = false;
                match result {
                    Ok(Frame::Ack(a)) => self.ipc_acked(a),
                    Ok(f) => {
                        let e = crate::transport::stream::unexpected(
                            f,
                            "a cuda_ipc acknowledgement",
                            &self.origin,
                        );
                        self.ipc_fail_sent(e)
                    }
                    Err(e) => self.ipc_fail_sent(e),
                }
                // Early acks keep the reading going too: their tensors are on their way.
                if self
                    .ipc
                    .as_ref()
                    .is_some_and(|s| !s.sent.is_empty() || !s.early.is_empty())
                {
                    self.arm_ack();
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

    fn ipc_acked(&mut self, a: Ack) {
        let Some(side) = self.ipc.as_mut() else {
            return;
        };
        let key = (a.seq, a.tensor);
        let Some((buffer, out)) = side.sent.remove(&key) else {
            // The pipe's hand-off may still be in our mailbox; a flood of them is a peer
            // acknowledging what was never sent.
            if side.early.len() < MAX_EARLY_ACKS && side.early.insert(key, a.ok).is_none() {
                return;
            }
            let e = Error::protocol(
                format!(
                    "cuda_ipc acknowledgement for message {} tensor {}, which is not waiting for one",
                    a.seq, a.tensor
                ),
                &self.origin,
            );
            return self.ipc_fail_sent(e);
        };
        let result = self.ack_result(a.ok);
        self.ipc_release(a.seq, a.tensor, buffer, out, result);
    }

    /// What an acknowledgement says about the write.
    fn ack_result(&self, ok: bool) -> Result<(), Error> {
        match ok {
            true => Ok(()),
            false => Err(Error::Device {
                detail: "the receiver could not open or copy this CUDA tensor".into(),
                origin: self.origin.clone(),
            }),
        }
    }

    /// Completes a sent tensor: its ready event goes back to the pool, its staging copy to the
    /// cache, its buffer to the pipe.
    fn ipc_release(
        &mut self,
        seq: u64,
        index: u32,
        buffer: Buffer,
        out: Outgoing,
        result: Result<(), Error>,
    ) {
        let Outgoing { staging, .. } = out;
        if let (Some(s), Some(side)) = (staging, &self.ipc) {
            if let Ok(c) = side.caches.device(s.device()) {
                c.lock().staging.put(s);
            }
        }
        self.cuda_to_pipe(CudaDone::wrote(seq, index, buffer, result));
    }

    /// The side connection is gone: every tensor waiting for an ack fails with `e`.
    fn ipc_fail_sent(&mut self, e: Error) {
        let sent: Vec<_> = self
            .ipc
            .as_mut()
            .map(|s| s.sent.drain().collect())
            .unwrap_or_default();
        for ((seq, index), (buffer, out)) in sent {
            self.ipc_release(seq, index, buffer, out, Err(e.clone()));
        }
    }
}

/// The pipe id of a `cuda_ipc` channel (its key in the caches).
fn pipe_of(kind: &ChannelKind) -> u64 {
    match *kind {
        ChannelKind::CudaIpc { pipe } => pipe,
        _ => u64::MAX,
    }
}

impl Handler<IpcCopied> for Channel {
    type Result = ();

    fn handle(&mut self, m: IpcCopied, ctx: &mut Self::Context) {
        let later = self
            .ipc
            .as_mut()
            .and_then(|s| s.copying.remove(&(m.seq, m.index)));
        self.send_ack(Ack {
            seq: m.seq,
            tensor: m.index,
            ok: true,
        });
        if let Some(Some(d)) = later {
            self.cuda_to_pipe(d);
        }
        self.maybe_stop(ctx);
        self.poll_own(ctx);
    }
}
