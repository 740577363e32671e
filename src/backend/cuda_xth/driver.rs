//! The `cuda_xth` channel's driver: CUDA tensors between two contexts of one process, through
//! the rendezvous of [`super`].
//!
//! The sender records a *ready* event on the tensor's stream (no CPU wait) and parks its buffer;
//! the receiver parks its destination and stream. Whichever arrives second queues one copy on the
//! receiver's stream after the ready event and records the receiver's completion event. The
//! receiver's tensor completes as soon as the copy is enqueued, with that event (or, for a
//! [`Read::data_complete`](crate::Read::data_complete) read, once a watcher callback queued after
//! the copy has run); the sender's once the copy has run (a watcher callback on the receiver's
//! stream). Completions come back to the channel first, so that it knows what is still parked
//! when its pipe closes, then go on to the pipe's CUDA completion queue.

use std::sync::Arc;

use super::{End, Key, Sent, Wanted};
use crate::channel::driver::{post, post_when_done, CudaDone, Cx, Driver, RecvCuda, SendCuda};
use crate::cuda::{CudaStream, Event};
use crate::error::Error;
use crate::message::Buffer;

/// One pipe's `cuda_xth` channel.
#[derive(Debug)]
pub(crate) struct CudaXthDriver {
    pipe: u64,
    /// Parked tensors, with their direction (`true` when sending).
    keys: Vec<(bool, Key)>,
}

impl CudaXthDriver {
    pub(crate) fn new(pipe: u64) -> Self {
        CudaXthDriver {
            pipe,
            keys: Vec::new(),
        }
    }
}

impl Driver for CudaXthDriver {
    type Event = ();

    fn send_cuda(&mut self, m: SendCuda, cx: &mut Cx<'_, ()>) {
        let SendCuda {
            seq, index, buffer, ..
        } = m;
        let (src, ready) = match &buffer {
            Buffer::Cuda(b) => {
                // Captures the work the user queued on the tensor's stream so far; the copy
                // waits for it on the GPU.
                match b.gpu().recorded(b.stream()) {
                    Ok(e) => (End::of(b), Some(e)),
                    Err(e) => {
                        return cx
                            .core
                            .cuda_to_pipe(CudaDone::wrote(seq, index, buffer, Err(e)))
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
            sender: self.pipe,
            seq,
            index,
        };
        self.keys.push((true, key));
        let tx = cx.core.own_cuda();
        let len = buffer.len() as usize;
        super::send(
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

    fn recv_cuda(&mut self, m: RecvCuda, cx: &mut Cx<'_, ()>) {
        let RecvCuda {
            seq,
            index,
            mut buffer,
            data,
            data_complete,
        } = m;
        let refuse = |buffer, e| CudaDone::landed(seq, index, buffer, Err(e));
        let Ok(sender) = <[u8; 8]>::try_from(data.as_slice()).map(u64::from_le_bytes) else {
            let e = Error::protocol("cuda_xth channel data is not a pipe id", &cx.core.origin);
            return cx.core.cuda_to_pipe(refuse(buffer, e));
        };
        let (dst, stream) = match &mut buffer {
            Buffer::Cuda(b) => (End::of(b), Some(b.stream().clone())),
            Buffer::Cpu(v) => (
                End::Host {
                    ptr: v.as_mut_ptr() as usize,
                },
                None,
            ),
            // `Allocation::check` refuses read-only buffers before a read starts.
            _ => {
                let e = Error::invalid("cuda_xth: a read into read-only (shared) memory");
                return cx.core.cuda_to_pipe(refuse(buffer, e));
            }
        };
        let key = Key { sender, seq, index };
        self.keys.push((false, key));
        let tx = cx.core.own_cuda();
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
        super::recv(
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
    fn on_cuda(&mut self, d: CudaDone, cx: &mut Cx<'_, ()>) {
        let (out, seq, index) = d.key();
        self.keys
            .retain(|(o, k)| !(*o == out && (k.seq, k.index) == (seq, index)));
        cx.core.cuda_to_pipe(d);
    }

    /// Everything still parked completes with `e` (through the queue).
    fn stop(&mut self, e: Error, _: &mut Cx<'_, ()>) {
        for (_, k) in &self.keys {
            super::withdraw(*k, &e);
        }
    }

    fn drained(&mut self, _: &mut Cx<'_, ()>) -> bool {
        self.keys.is_empty()
    }
}
