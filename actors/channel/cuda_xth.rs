//! The `cuda_xth` side of the channel actor (feature `cuda`): CUDA tensors between two contexts
//! of one process, through the rendezvous of [`crate::backend::cuda_xth`].
//!
//! The sender records a *ready* event on the tensor's stream (no CPU wait) and parks its buffer;
//! the receiver parks its destination and stream. Whichever arrives second queues one copy on the
//! receiver's stream after the ready event and records the receiver's completion event. The
//! receiver's tensor completes as soon as the copy is enqueued, with that event (or, for a
//! [`Read::data_complete`](crate::Read::data_complete) read, once a watcher callback queued after
//! the copy has run); the sender's once the copy has run (a watcher callback on the receiver's
//! stream). Completions come back here first, so the channel knows what is still parked when its
//! pipe closes, then go on to the pipe's CUDA completion queue.

use std::sync::Mutex;

use super::*;
use crate::backend::cuda_xth::{self as engine, End, Key, Sent, Wanted};
use crate::cuda::{CudaStream, Event};
use crate::message::Buffer;

/// The completion of one CUDA-routed tensor, for the pipe.
#[derive(Debug)]
pub(crate) enum CudaDone {
    /// A sent tensor's buffer is free again (or the send failed).
    Wrote {
        seq: u64,
        index: u32,
        buffer: Buffer,
        result: Result<(), Error>,
    },
    /// A received tensor's copy is enqueued (with the event recorded after it and the stream it
    /// runs on) or has landed (no event), or the receive failed.
    Read {
        seq: u64,
        index: u32,
        buffer: Buffer,
        event: Option<(Event, Arc<CudaStream>)>,
        result: Result<(), Error>,
    },
}

/// Where CUDA completions go.
pub(crate) type CudaReply = mpsc::UnboundedSender<CudaDone>;

/// Send one CUDA-routed tensor (its buffer may be host memory: the cpu->cuda pair).
#[derive(Debug)]
pub(crate) struct SendCuda {
    pub seq: u64,
    pub index: u32,
    pub buffer: Buffer,
    /// For `cuda_ipc`: what the pipe exported for the descriptor (`None` for an empty tensor).
    pub ipc: Option<crate::backend::cuda_ipc::Outgoing>,
}

impl Message for SendCuda {
    type Result = ();
}

/// Receive one CUDA-routed tensor into `buffer`; `data` is the channel's bytes from the
/// descriptor.
#[derive(Debug)]
pub(crate) struct RecvCuda {
    pub seq: u64,
    pub index: u32,
    pub buffer: Buffer,
    pub data: Vec<u8>,
    /// Complete only once the data has landed.
    pub data_complete: bool,
}

impl Message for RecvCuda {
    type Result = ();
}

/// Posts a completion from wherever it happens (the device's watcher thread included). A
/// watcher callback must not call the CUDA API, and dropping a buffer can (`cuMemFree`):
/// if nobody takes the completion any more, it is dropped on a thread of its own.
pub(super) fn post(tx: &CudaReply, d: CudaDone) {
    if let Err(mpsc::error::SendError(d)) = tx.send(d) {
        std::thread::spawn(move || drop(d));
    }
}

/// Posts `d` once the work queued on `stream` so far has run (a watcher callback queued after
/// it); if the function cannot be queued, posts `d` at once with that error instead.
pub(super) fn post_when_done(stream: &CudaStream, tx: &CudaReply, d: CudaDone) {
    let slot = Arc::new(Mutex::new(Some(d)));
    let (in_fn, later) = (slot.clone(), tx.clone());
    let queued = crate::cuda::on_stream_done(stream, move || {
        if let Some(d) = in_fn.lock().unwrap_or_else(|p| p.into_inner()).take() {
            post(&later, d)
        }
    });
    if let Err(e) = queued {
        if let Some(d) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
            post(tx, d.failed(e))
        }
    }
}

impl CudaDone {
    /// A sent tensor's completion.
    pub(super) fn wrote(seq: u64, index: u32, buffer: Buffer, result: Result<(), Error>) -> Self {
        CudaDone::Wrote {
            seq,
            index,
            buffer,
            result,
        }
    }

    /// A received tensor's completion, with the event its copies were recorded in (if any).
    pub(super) fn read(
        seq: u64,
        index: u32,
        buffer: Buffer,
        event: Option<(Event, Arc<CudaStream>)>,
        result: Result<(), Error>,
    ) -> Self {
        CudaDone::Read {
            seq,
            index,
            buffer,
            event,
            result,
        }
    }

    /// A received tensor's completion with nothing to wait on (landed, or failed).
    pub(super) fn landed(seq: u64, index: u32, buffer: Buffer, result: Result<(), Error>) -> Self {
        CudaDone::Read {
            seq,
            index,
            buffer,
            event: None,
            result,
        }
    }

    /// The same completion, failed with `e` (no event to wait on).
    fn failed(self, e: Error) -> Self {
        match self {
            CudaDone::Wrote {
                seq, index, buffer, ..
            } => CudaDone::wrote(seq, index, buffer, Err(e)),
            CudaDone::Read {
                seq, index, buffer, ..
            } => CudaDone::landed(seq, index, buffer, Err(e)),
        }
    }

    fn key(&self) -> (bool, u64, u32) {
        match self {
            CudaDone::Wrote { seq, index, .. } => (true, *seq, *index),
            CudaDone::Read { seq, index, .. } => (false, *seq, *index),
        }
    }
}

impl Channel {
    /// A sender into the channel's CUDA completion queue, made on first use; the handler that
    /// makes it hands the receiving end to the context ([`Self::poll_own`]).
    fn own_cuda(&mut self) -> CudaReply {
        let rx = &mut self.cuda_rx;
        self.cuda_own
            .get_or_insert_with(|| {
                let (tx, r) = mpsc::unbounded_channel();
                *rx = Some(r);
                tx
            })
            .clone()
    }

    /// The error for a CUDA-routed tensor that reached a channel of another kind.
    pub(super) fn not_cuda(&self) -> Error {
        Error::protocol(
            "internal: a CUDA-routed tensor reached a channel that does not carry CUDA tensors",
            &self.origin,
        )
    }

    pub(super) fn cuda_to_pipe(&self, d: CudaDone) {
        match &self.cuda_reply {
            Some(tx) => post(tx, d),
            None => tracing::error!("a CUDA completion with no pipe queue to go to"),
        }
    }

    pub(super) fn send_cuda_xth(&mut self, pipe: u64, m: SendCuda) {
        let SendCuda {
            seq, index, buffer, ..
        } = m;
        let (src, ready) = match &buffer {
            Buffer::Cuda(b) => {
                // Captures the work the user queued on the tensor's stream so far; the copy
                // waits for it on the GPU.
                let ready = b.gpu().recorded(b.stream());
                match ready {
                    Ok(e) => (
                        End::Device {
                            ptr: b.device_ptr(),
                            gpu: b.gpu().clone(),
                        },
                        Some(e),
                    ),
                    Err(e) => {
                        return self.cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Err(e)))
                    }
                }
            }
            // Host memory (the cpu->cuda pair), owned or shared: it stays put until `on_free`.
            host => (
                End::Host {
                    ptr: host.as_cpu().map_or(0, |b| b.as_ptr() as usize),
                },
                None,
            ),
        };
        let key = Key {
            sender: pipe,
            seq,
            index,
        };
        self.cuda_keys.push((true, key));
        let tx = self.own_cuda();
        let len = buffer.len() as usize;
        engine::send(
            key,
            Sent {
                src,
                len,
                ready,
                on_free: Box::new(move |result| {
                    post(&tx, CudaDone::wrote(seq, index, buffer, result))
                }),
            },
        );
    }

    pub(super) fn recv_cuda_xth(&mut self, m: RecvCuda) {
        let RecvCuda {
            seq,
            index,
            mut buffer,
            data,
            data_complete,
        } = m;
        let refuse = |buffer, e| CudaDone::landed(seq, index, buffer, Err(e));
        let Ok(sender) = <[u8; 8]>::try_from(data.as_slice()).map(u64::from_le_bytes) else {
            let e = Error::protocol("cuda_xth channel data is not a pipe id", &self.origin);
            return self.cuda_to_pipe(refuse(buffer, e));
        };
        let (dst, stream) = match &mut buffer {
            Buffer::Cuda(b) => (
                End::Device {
                    ptr: b.device_ptr(),
                    gpu: b.gpu().clone(),
                },
                Some(b.stream().clone()),
            ),
            Buffer::Cpu(v) => (
                End::Host {
                    ptr: v.as_mut_ptr() as usize,
                },
                None,
            ),
            // `Allocation::check` refuses read-only buffers before a read starts.
            _ => {
                let e = Error::invalid("cuda_xth: a read into read-only (shared) memory");
                return self.cuda_to_pipe(refuse(buffer, e));
            }
        };
        let key = Key { sender, seq, index };
        self.cuda_keys.push((false, key));
        let tx = self.own_cuda();
        let len = buffer.len() as usize;
        let on = stream.clone();
        let on_done = move |r: Result<Option<Event>, Error>| {
            let done = move |event: Option<(Event, Arc<CudaStream>)>, result| {
                CudaDone::read(seq, index, buffer, event, result)
            };
            match (r, on) {
                (Ok(Some(ev)), Some(stream)) if data_complete => {
                    // Completes once the copy has run: a watcher callback after it on the same
                    // stream. The event is not needed.
                    drop(ev);
                    post_when_done(&stream, &tx, done(None, Ok(())));
                }
                (Ok(Some(ev)), Some(stream)) => post(&tx, done(Some((ev, stream)), Ok(()))),
                // Host memory: the bytes have landed.
                (Ok(_), _) => post(&tx, done(None, Ok(()))),
                (Err(e), _) => post(&tx, done(None, Err(e))),
            }
        };
        engine::recv(
            key,
            Wanted {
                dst,
                len,
                stream,
                on_done: Box::new(on_done),
            },
        );
    }

    /// A completion from the rendezvous: the tensor is no longer parked; on to the pipe.
    pub(super) fn on_cuda(&mut self, d: CudaDone) {
        let (out, seq, index) = d.key();
        self.cuda_keys
            .retain(|(o, k)| !(*o == out && (k.seq, k.index) == (seq, index)));
        self.cuda_to_pipe(d);
    }

    /// The pipe is closing: everything still parked completes with `e` (through the queue).
    pub(super) fn withdraw_cuda(&mut self, e: &Error) {
        for (_, k) in &self.cuda_keys {
            engine::withdraw(*k, e);
        }
    }
}

impl StreamHandler<CudaDone> for Channel {
    fn handle(&mut self, d: CudaDone, ctx: &mut Self::Context) {
        self.on_cuda(d);
        self.maybe_stop(ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

impl Handler<SendCuda> for Channel {
    type Result = ();

    fn handle(&mut self, m: SendCuda, ctx: &mut Self::Context) {
        match self.kind {
            ChannelKind::CudaXth { pipe } => self.send_cuda_xth(pipe, m),
            ChannelKind::CudaIpc { .. } => self.send_cuda_ipc(m),
            ChannelKind::CudaBasic => self.send_cuda_basic(m, ctx),
            #[cfg(feature = "ibv")]
            ChannelKind::CudaGdr => self.send_cuda_gdr(m, ctx),
            _ => self.cuda_to_pipe(CudaDone::wrote(
                m.seq,
                m.index,
                m.buffer,
                Err(self.not_cuda()),
            )),
        }
        self.poll_own(ctx);
    }
}

impl Handler<RecvCuda> for Channel {
    type Result = ();

    fn handle(&mut self, m: RecvCuda, ctx: &mut Self::Context) {
        match self.kind {
            ChannelKind::CudaXth { .. } => self.recv_cuda_xth(m),
            ChannelKind::CudaIpc { .. } => self.recv_cuda_ipc(m, ctx),
            ChannelKind::CudaBasic => self.recv_cuda_basic(m, ctx),
            #[cfg(feature = "ibv")]
            ChannelKind::CudaGdr => self.recv_cuda_gdr(m, ctx),
            _ => self.cuda_to_pipe(CudaDone::landed(
                m.seq,
                m.index,
                m.buffer,
                Err(self.not_cuda()),
            )),
        }
        self.poll_own(ctx);
    }
}
