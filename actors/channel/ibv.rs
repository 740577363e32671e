//! The `ibv` side of the channel actor (feature `ibv`): the pipe's tensors by RDMA write into
//! the receiver's registered buffer (`src/channel/ibv/`); `cuda_gdr` (cuda_gdr.rs) runs on it
//! too. The actor owns the channel's queue
//! pair (through [`Rdma`]), bootstraps it over its one lane, wakes on its completion queue's
//! descriptor and on the lane's hang-up, and hands every finished tensor back to the pipe.

use std::sync::Mutex;

use super::*;
use crate::channel::ibv::core::Rdma;
use crate::channel::ibv::{self as chan, Event, IbvChannel};
use crate::handshake::Halves;

/// The channel's queue pair, or why there is none (every tensor then fails with it).
pub(super) struct IbvSide {
    pub(super) rdma: Result<Arc<Mutex<Rdma>>, Error>,
    /// The lane and the port's link layer and number, until the bootstrap starts.
    setup: Option<(Halves, (crate::verbs::LinkLayer, u8))>,
    /// The watch on the completion queue and the lane, once bootstrapped. Cancelled once the
    /// queue pair has failed: that closes the lane, which tells the peer at once.
    watch: Option<SpawnHandle>,
}

impl IbvSide {
    /// Creates the queue pair now (tensors can queue on it at once); the bootstrap over `lanes`
    /// (exactly one) starts with the actor.
    pub(crate) fn new(backend: &IbvChannel, mut lanes: Vec<Halves>, origin: &Origin) -> IbvSide {
        let port = backend
            .caches()
            .map(|(d, _)| (d.port().link_layer, d.port().port));
        let rdma = chan::create(backend, origin).map(|r| Arc::new(Mutex::new(r)));
        let setup = match (lanes.pop(), port) {
            (Some(lane), Ok(port)) if lanes.is_empty() => Some((lane, port)),
            _ => None,
        };
        let rdma = match (rdma, &setup) {
            (Ok(_), None) => Err(Error::protocol(
                "the ibv channel needs exactly one connection of its own",
                origin,
            )),
            (r, _) => r,
        };
        IbvSide {
            rdma,
            setup,
            watch: None,
        }
    }
}

impl Channel {
    /// Starts the bootstrap of the channel's queue pair (the actor is starting).
    pub(super) fn ibv_start(&mut self, ctx: &mut Context<Self>) {
        let Some(side) = self.ibv.as_mut() else {
            return;
        };
        let (Ok(rdma), Some((lane, port))) = (&side.rdma, side.setup.take()) else {
            return;
        };
        let fut = chan::connect(rdma.clone(), lane, port, self.origin.clone());
        ctx.spawn(fut.into_actor(self).map(|result, act, ctx| {
            match result {
                Ok(watch) => {
                    let handle = ctx.add_stream(watch);
                    if let Some(side) = act.ibv.as_mut() {
                        side.watch = Some(handle);
                    }
                }
                Err(e) => {
                    if let Some(Ok(rdma)) = act.ibv.as_ref().map(|s| &s.rdma) {
                        chan::lock(rdma).fail(e);
                    }
                }
            }
            act.ibv_flush(ctx);
        }));
    }

    /// Sends one tensor (`SendTensor`); an empty one needs no transfer.
    pub(super) fn send_ibv(&mut self, m: SendTensor) {
        let result = if m.buffer.is_empty() {
            Ok(())
        } else {
            match self.ibv.as_ref().map(|s| &s.rdma) {
                Some(Ok(rdma)) => {
                    chan::lock(rdma).send(m.seq, m.index, m.buffer);
                    return;
                }
                Some(Err(e)) => Err(e.clone()),
                None => Err(self.misrouted()),
            }
        };
        self.to_pipe(Done::WroteTensor {
            seq: m.seq,
            index: m.index,
            memory: m.buffer,
            result,
        });
    }

    /// Receives one tensor (`RecvTensor`): its channel data is its length.
    pub(super) fn recv_ibv(&mut self, m: RecvTensor) {
        let result = if m.data != (m.buffer.len() as u64).to_le_bytes() {
            Err(Error::protocol(
                format!(
                    "ibv channel data {:?} does not give the tensor's length {}",
                    m.data,
                    m.buffer.len()
                ),
                &self.origin,
            ))
        } else if m.buffer.is_empty() {
            Ok(())
        } else {
            match self.ibv.as_ref().map(|s| &s.rdma) {
                Some(Ok(rdma)) => {
                    chan::lock(rdma).recv(m.seq, m.index, m.buffer);
                    return;
                }
                Some(Err(e)) => Err(e.clone()),
                None => Err(self.misrouted()),
            }
        };
        self.to_pipe(Done::Tensor {
            seq: m.seq,
            index: m.index,
            memory: Memory::Owned(m.buffer),
            result,
        });
    }

    /// Fails the queue pair (the channel is stopping): everything it holds comes back.
    pub(super) fn stop_ibv(&mut self, e: Error) {
        if let Some(Ok(rdma)) = self.ibv.as_ref().map(|s| &s.rdma) {
            chan::lock(rdma).fail(e);
        }
    }

    /// Progresses the queue pair and hands every finished tensor to the pipe.
    pub(super) fn ibv_flush(&mut self, ctx: &mut Context<Self>) {
        if let Some(IbvSide {
            rdma: Ok(rdma),
            watch,
            ..
        }) = self.ibv.as_mut()
        {
            let mut r = chan::lock(rdma);
            r.progress();
            if r.failure().is_some() && r.is_idle() {
                if let Some(w) = watch.take() {
                    // The queue pair carries nothing more and its flush completions are all
                    // in: hang up the lane so the peer knows.
                    ctx.cancel_future(w);
                }
            }
            for f in r.take_done() {
                #[cfg(feature = "cuda")]
                if let Some(g) = self.gdr.as_mut() {
                    g.finished(f, self.cuda_reply.as_ref());
                    continue;
                }
                let Some(memory) = f.buffer.into_memory() else {
                    continue; // GPU memory goes to the `cuda_gdr` branch above
                };
                let _ = self.reply.send(if f.sending {
                    Done::WroteTensor {
                        seq: f.seq,
                        index: f.index,
                        memory,
                        result: f.result,
                    }
                } else {
                    Done::Tensor {
                        seq: f.seq,
                        index: f.index,
                        memory,
                        result: f.result,
                    }
                });
            }
        }
        self.maybe_stop(ctx);
    }

    /// Whether the queue pair holds no tensor.
    pub(super) fn ibv_idle(&self) -> bool {
        match self.ibv.as_ref().map(|s| &s.rdma) {
            Some(Ok(rdma)) => chan::lock(rdma).is_idle(),
            _ => true,
        }
    }

    /// The actor is going away with tensors still on the queue pair (the system stopping):
    /// leak them, queue pair included, rather than free memory the HCA may still touch.
    pub(super) fn ibv_forget(&mut self) {
        if !self.ibv_idle() {
            if let Some(side) = self.ibv.take() {
                std::mem::forget(side);
            }
        }
    }
}

impl StreamHandler<Event> for Channel {
    fn handle(&mut self, ev: Event, ctx: &mut Self::Context) {
        if let Some(Ok(rdma)) = self.ibv.as_ref().map(|s| &s.rdma) {
            let mut r = chan::lock(rdma);
            match ev {
                Event::Completions => chan::on_completions(&mut r),
                Event::PeerGone(why) => {
                    // Whatever landed before the hang-up counts.
                    r.progress();
                    let e = Error::PeerClosed {
                        reason: why,
                        graceful: false,
                        origin: self.origin.clone(),
                    };
                    r.fail(e);
                }
                Event::Broken(why) => {
                    let e = Error::io("ibv channel", std::io::Error::other(why), &self.origin);
                    r.fail(e);
                }
            }
        }
        self.ibv_flush(ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}
