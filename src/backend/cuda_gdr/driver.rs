//! The `cuda_gdr` channel's driver (features `cuda` and `ibv`): CUDA tensors by RDMA write
//! between registered buffers ([`super`]). The queue pairs, their bootstrap, their watch and the
//! protocol are the `ibv` channel's ([`IbvDriver`], `src/backend/ibv/channel/`); this file adds
//! what CUDA memory needs around them:
//!
//! - **Sending.** A tensor in GPU memory goes to the queue pair only once its stream has run the
//!   work queued before the write (a watcher callback, [`crate::cuda::on_stream_done`]); tensors
//!   go in the order the pipe handed them over, whatever order their streams finish in.
//! - **Receiving.** Once the last write has landed, the read completes with an event recorded on
//!   the destination's stream (after `cuFlushGPUDirectRDMAWrites`), or, for a data-complete
//!   read, once a watcher callback after it has run. Host destinations (cuda->cpu) complete
//!   when the bytes are in.
//! - **Under 32 bytes** (the verbs minimum): both sides stage the tensor through a 32-byte host
//!   buffer, with a blocking copy on the tensor's stream (at most 31 bytes).
//! - **Links.** A tensor takes the links of its sender's GPU's NICs (the receiver learns the
//!   GPU from the descriptor's channel data), striped over them when large, as the ibv
//!   channel's host tensors are over every link; a striped tensor is held here
//!   until every stripe is back.

use std::collections::{HashMap, VecDeque};

use crate::backend::ibv::channel::core::{Finished, RdmaBuf};
use crate::backend::ibv::channel::driver::{Ctx, IbvDriver, IbvEvent};
use crate::backend::ibv::channel::placement::sender_gpu;
use crate::backend::ibv::MIN_OP_BYTES;
use crate::channel::driver::{post, post_when_done, CudaDone, CudaReply, RecvCuda, SendCuda};
use crate::error::Error;
use crate::message::Buffer;
use crate::transport::stream::Memory;

/// A sent tensor waiting for its stream, in pipe order.
struct Gated {
    seq: u64,
    index: u32,
    buffer: Buffer,
    ready: bool,
}

/// What a receive needs once its bytes are in.
struct Landing {
    data_complete: bool,
    /// The destination of a tensor under 32 bytes, received through a 32-byte host buffer.
    staged: Option<Buffer>,
}

/// The channel's CUDA state around the ibv queue pair.
pub(crate) struct GdrSide {
    gate: VecDeque<Gated>,
    landing: HashMap<(u64, u32), Landing>,
    /// Sent tensors under 32 bytes: the user's buffer, while a 32-byte copy travels.
    staged_out: HashMap<(u64, u32), Buffer>,
    /// Striped tensors, by (sending, seq, index), until every stripe is back.
    striped: HashMap<(bool, u64, u32), Striped>,
}

/// A tensor whose stripes are on several links.
struct Striped {
    buffer: RdmaBuf,
    out: usize,
    error: Option<Error>,
}

impl GdrSide {
    pub(crate) fn new() -> GdrSide {
        GdrSide {
            gate: VecDeque::new(),
            landing: HashMap::new(),
            staged_out: HashMap::new(),
            striped: HashMap::new(),
        }
    }

    /// Whether no sent tensor waits for its stream and none is striped.
    pub(crate) fn idle(&self) -> bool {
        self.gate.is_empty() && self.striped.is_empty()
    }

    /// Holds a tensor cut into `n` stripes until they are all back.
    pub(crate) fn hold(&mut self, key: (bool, u64, u32), buffer: RdmaBuf, n: usize) {
        let s = Striped {
            buffer,
            out: n,
            error: None,
        };
        self.striped.insert(key, s);
    }

    /// The actor is going away with stripes on the queue pairs (leaked with them): never free
    /// their tensors.
    pub(crate) fn forget_striped(&mut self) {
        for (_, s) in self.striped.drain() {
            std::mem::forget(s.buffer);
        }
    }

    /// A finished tensor (or stripe: the tensor finishes with its last), for the pipe's CUDA
    /// queue.
    pub(crate) fn finished(&mut self, mut f: Finished, reply: Option<&CudaReply>) {
        let striped = (f.sending, f.seq, f.index);
        if let Some(s) = self.striped.get_mut(&striped) {
            s.out -= 1;
            if let Err(e) = f.result {
                s.error.get_or_insert(e);
            }
            if s.out > 0 {
                return;
            }
            let s = self.striped.remove(&striped).expect("present");
            f.buffer = s.buffer;
            f.result = s.error.map_or(Ok(()), Err);
        }
        let key = (f.seq, f.index);
        let d = if f.sending {
            let buffer = self
                .staged_out
                .remove(&key)
                .unwrap_or_else(|| to_buffer(f.buffer));
            CudaDone::wrote(f.seq, f.index, buffer, f.result)
        } else {
            let landing = self.landing.remove(&key);
            return landed(f, landing, reply);
        };
        match reply {
            Some(tx) => post(tx, d),
            None => tracing::error!("a cuda_gdr completion with no pipe queue to go to"),
        }
    }
}

/// The buffer as the pipe knows it.
fn to_buffer(b: RdmaBuf) -> Buffer {
    match b {
        RdmaBuf::Host(Memory::Owned(v)) => Buffer::Cpu(v),
        RdmaBuf::Host(Memory::Shared(b)) => Buffer::Shared(b),
        // Stripes: counted in `GdrSide::striped`, never handed to the pipe.
        RdmaBuf::Host(Memory::Region(_)) | RdmaBuf::GpuRegion(_) => Buffer::Cpu(Vec::new()),
        RdmaBuf::Cuda(b) => Buffer::Cuda(b),
    }
}

/// The bytes of a tensor under 32 bytes, padded to 32 (a blocking copy for GPU memory).
fn padded(b: &Buffer) -> Result<Vec<u8>, Error> {
    let mut v = match b {
        Buffer::Cuda(c) => c.to_vec()?,
        other => other.as_cpu().map(<[u8]>::to_vec).unwrap_or_default(),
    };
    v.resize(MIN_OP_BYTES as usize, 0);
    Ok(v)
}

/// A received tensor's completion: unstage, then an event (GPU memory) or nothing (host).
fn landed(f: Finished, landing: Option<Landing>, reply: Option<&CudaReply>) {
    let (seq, index) = (f.seq, f.index);
    let (data_complete, staged) = landing.map_or((false, None), |l| (l.data_complete, l.staged));
    let mut result = f.result;
    let mut buffer = match staged {
        Some(mut dst) => {
            if result.is_ok() {
                let n = dst.len() as usize;
                let bytes = &f.buffer.as_slice()[..n];
                result = match &mut dst {
                    Buffer::Cuda(c) => c.copy_from_host(bytes),
                    Buffer::Cpu(v) => {
                        v.copy_from_slice(bytes);
                        Ok(())
                    }
                    _ => Err(Error::invalid("cuda_gdr: a read into shared memory")),
                };
            }
            dst
        }
        None => to_buffer(f.buffer),
    };
    let Some(tx) = reply else {
        return tracing::error!("a cuda_gdr completion with no pipe queue to go to");
    };
    let done = |buffer, event, result| CudaDone::read(seq, index, buffer, event, result);
    let Buffer::Cuda(c) = &mut buffer else {
        // Host memory: the bytes are in.
        return post(tx, CudaDone::landed(seq, index, buffer, result));
    };
    if let Err(e) = result {
        return post(tx, CudaDone::landed(seq, index, buffer, Err(e)));
    }
    let (gpu, stream) = (c.gpu().clone(), c.stream().clone());
    let event =
        crate::backend::cuda_gdr::flush_rdma_writes(&gpu).and_then(|_| gpu.recorded(&stream));
    match event {
        Err(e) => post(tx, done(buffer, None, Err(e))),
        Ok(ev) if data_complete => {
            drop(ev);
            post_when_done(&stream, tx, done(buffer, None, Ok(())));
        }
        Ok(ev) => post(tx, done(buffer, Some((ev, stream)), Ok(()))),
    }
}

impl IbvDriver {
    /// Sends one CUDA-routed tensor: once its stream is done with what came before the write.
    pub(crate) fn send_gdr(&mut self, m: SendCuda, cx: &mut Ctx<'_>) {
        let SendCuda {
            seq, index, buffer, ..
        } = m;
        if self.gdr.is_none() {
            let e = cx.core.not_cuda();
            return cx
                .core
                .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Err(e)));
        }
        if buffer.is_empty() {
            return cx
                .core
                .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Ok(())));
        }
        let wait = match &buffer {
            Buffer::Cuda(c) => {
                let tx = cx.fx.sender();
                crate::cuda::on_stream_done(c.stream(), move || {
                    let _ = tx.send(IbvEvent::GdrReady { seq, index });
                })
                .map(|_| true)
            }
            _ => Ok(false),
        };
        let g = self.gdr.as_mut().expect("checked above");
        match wait {
            Ok(waits) => g.gate.push_back(Gated {
                seq,
                index,
                buffer,
                ready: !waits,
            }),
            Err(e) => {
                return cx
                    .core
                    .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Err(e)))
            }
        }
        self.gdr_pump(cx);
    }

    /// A sent tensor's stream has run the work queued before its write.
    pub(crate) fn gdr_ready(&mut self, seq: u64, index: u32, cx: &mut Ctx<'_>) {
        if let Some(g) = self.gdr.as_mut() {
            if let Some(t) = g.gate.iter_mut().find(|t| (t.seq, t.index) == (seq, index)) {
                t.ready = true;
            }
        }
        self.gdr_pump(cx);
    }

    /// Hands the ready tensors at the front of the gate to the queue pairs, in order, each
    /// with its GPU (which picks its links).
    fn gdr_pump(&mut self, cx: &mut Ctx<'_>) {
        if self.usable().is_err() {
            return;
        }
        let Some(g) = self.gdr.as_mut() else {
            return;
        };
        let mut ready = Vec::new();
        let mut failed = None;
        while g.gate.front().is_some_and(|t| t.ready) {
            let t = g.gate.pop_front().expect("present");
            let gpu = t.buffer.as_cuda().map(|c| c.device());
            let buffer = if t.buffer.len() < MIN_OP_BYTES {
                let v = padded(&t.buffer);
                g.staged_out.insert((t.seq, t.index), t.buffer);
                match v {
                    Ok(v) => RdmaBuf::from(v),
                    Err(e) => {
                        // The queue pairs' protocol has this tensor next: fail the channel (the
                        // empty buffer below then finishes with the error, in order).
                        failed.get_or_insert(e);
                        RdmaBuf::from(Vec::new())
                    }
                }
            } else {
                match t.buffer {
                    Buffer::Cuda(c) => RdmaBuf::Cuda(c),
                    host => RdmaBuf::Host(Memory::from(host)),
                }
            };
            ready.push((t.seq, t.index, buffer, gpu));
        }
        if let Some(e) = failed {
            self.fail_first(e);
        }
        for (seq, index, buffer, gpu) in ready {
            self.tensor(true, seq, index, buffer, gpu, cx);
        }
        self.flush(cx);
    }

    /// Receives one CUDA-routed tensor into the buffer the user allocated.
    pub(crate) fn recv_gdr(&mut self, m: RecvCuda, cx: &mut Ctx<'_>) {
        let RecvCuda {
            seq,
            index,
            buffer,
            data,
            data_complete,
        } = m;
        let refuse = |buffer, result| CudaDone::landed(seq, index, buffer, result);
        if self.gdr.is_none() || self.usable().is_err() {
            let e = cx.core.not_cuda();
            return cx.core.cuda_to_pipe(refuse(buffer, Err(e)));
        }
        if buffer.is_empty() {
            return cx.core.cuda_to_pipe(refuse(buffer, Ok(())));
        }
        let gpu = match sender_gpu(&data) {
            Ok(g) => g,
            Err(why) => {
                // The tensors behind this one would take the wrong links: fail the channel.
                let e = Error::protocol(why, &cx.core.origin);
                self.fail_first(e.clone());
                cx.core.cuda_to_pipe(refuse(buffer, Err(e)));
                return self.flush(cx);
            }
        };
        let (into, staged) = if buffer.len() < MIN_OP_BYTES {
            (
                RdmaBuf::from(vec![0u8; MIN_OP_BYTES as usize]),
                Some(buffer),
            )
        } else {
            match buffer {
                Buffer::Cuda(c) => (RdmaBuf::Cuda(c), None),
                Buffer::Cpu(v) => (RdmaBuf::from(v), None),
                // `Allocation::check` refuses read-only buffers before a read starts.
                shared => {
                    let e = Error::invalid("cuda_gdr: a read into read-only (shared) memory");
                    return cx.core.cuda_to_pipe(refuse(shared, Err(e)));
                }
            }
        };
        let g = self.gdr.as_mut().expect("checked above");
        g.landing.insert(
            (seq, index),
            Landing {
                data_complete,
                staged,
            },
        );
        self.tensor(false, seq, index, into, gpu, cx);
        self.flush(cx);
    }
}
