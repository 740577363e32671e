//! The `ibv` side of the channel actor (feature `ibv`): the pipe's tensors by RDMA write into
//! the receiver's registered buffer (`src/backend/ibv/channel/`). The actor owns the channel's queue
//! pairs (through [`Rdma`]: one per device, usually one), bootstraps them over its one lane,
//! wakes on each completion queue's descriptor and on the lane's hang-up, and hands every
//! finished tensor back to the pipe. With several devices (links), a large tensor is cut into
//! mpt's stripes, one per link, held here until every stripe is back. `cuda_gdr`
//! (cuda_gdr.rs) runs on the same queue pairs; its GPU tensors take the links of their GPU's
//! NICs ([`crate::backend::ibv::channel::placement`]), striped the same way.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::*;
use crate::backend::ibv::channel::core::{Finished, Rdma, RdmaBuf};
use crate::backend::ibv::channel::placement::GpuLinks;
use crate::backend::ibv::channel::{self as chan, Event, IbvChannel};
use crate::backend::ibv::LinkLayer;
use crate::handshake::Halves;

/// A tensor waiting for the bootstrap.
struct Parked {
    sending: bool,
    seq: u64,
    index: u32,
    buffer: RdmaBuf,
    /// The sender's GPU (`None`: host memory), which picks the links.
    gpu: Option<u32>,
}

/// The channel's queue pairs, or why there are none (every tensor then fails with it).
pub(super) struct IbvSide {
    pub(super) rdma: Result<Arc<Mutex<Rdma>>, Error>,
    /// Queue pairs on further devices, with their ports, until the bootstrap starts.
    further: Vec<chan::FurtherQp>,
    /// The links: the first device's queue pair, then (after the bootstrap) each further one
    /// that paired with the peer's.
    links: Vec<Arc<Mutex<Rdma>>>,
    /// Which further queue pairs paired (positions among them), once bootstrapped.
    kept: Vec<usize>,
    /// The devices' names: the first's, then each further queue pair's.
    #[cfg(feature = "cuda")]
    names: Vec<String>,
    /// Per GPU, which of our devices its tensors take (`cuda_gdr`; empty: every link), and the
    /// peer's table, from the bootstrap: a received tensor takes the links its sender chose.
    gpus: GpuLinks,
    peer_gpus: GpuLinks,
    /// The backend (its topology places the devices).
    #[cfg(feature = "cuda")]
    backend: IbvChannel,
    /// Whether tensors wait for the bootstrap (further devices: the number of links is known
    /// only then).
    hold_back: bool,
    /// Tensors waiting for it, in order.
    waiting: VecDeque<Parked>,
    /// The lane and the port's link layer and number, until the bootstrap starts.
    setup: Option<(Halves, (LinkLayer, u8))>,
    /// The watches on the completion queues (and the lane), once bootstrapped. Cancelled once
    /// every queue pair has failed: that closes the lane, which tells the peer at once.
    watches: Vec<SpawnHandle>,
}

impl IbvSide {
    /// Creates the queue pairs now (tensors can queue on them at once); the bootstrap over
    /// `lanes` (exactly one) starts with the actor.
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
        let made = match &rdma {
            Ok(_) => chan::create_further(backend, origin),
            Err(_) => Vec::new(),
        };
        #[cfg(feature = "cuda")]
        let names = backend
            .caches()
            .map(|(d, _)| d.info().name.clone())
            .into_iter()
            .chain(made.iter().map(|(_, _, n)| n.clone()))
            .collect();
        let further: Vec<chan::FurtherQp> = made
            .into_iter()
            .map(|(r, port, _)| (Arc::new(Mutex::new(r)), port))
            .collect();
        IbvSide {
            links: rdma.iter().cloned().collect(),
            kept: Vec::new(),
            #[cfg(feature = "cuda")]
            names,
            gpus: GpuLinks::default(),
            peer_gpus: GpuLinks::default(),
            #[cfg(feature = "cuda")]
            backend: backend.clone(),
            hold_back: !further.is_empty(),
            rdma,
            further,
            waiting: VecDeque::new(),
            setup,
            watches: Vec::new(),
        }
    }

    /// Places this host's GPUs on the devices (`cuda_gdr`): each GPU's tensors take its NICs.
    #[cfg(feature = "cuda")]
    pub(super) fn place_gpus(&mut self) {
        self.gpus = crate::backend::cuda_gdr::gpu_links(&self.backend, &self.names);
    }

    /// The links (indices into `links`) a tensor takes: those of its sender's GPU's NICs (by
    /// our table when we send, the peer's when we receive), else every link.
    fn choose(&self, sending: bool, gpu: Option<u32>) -> Vec<usize> {
        let table = if sending { &self.gpus } else { &self.peer_gpus };
        let n = self.links.len();
        let chosen: Vec<usize> = table
            .links(gpu, &self.kept)
            .into_iter()
            .filter(|&l| l < n)
            .collect();
        if chosen.is_empty() {
            (0..n).collect()
        } else {
            chosen
        }
    }
}

impl Channel {
    /// Starts the bootstrap of the channel's queue pairs (the actor is starting).
    pub(super) fn ibv_start(&mut self, ctx: &mut Context<Self>) {
        let Some(side) = self.ibv.as_mut() else {
            return;
        };
        let (Ok(rdma), Some((lane, port))) = (&side.rdma, side.setup.take()) else {
            return;
        };
        let further = std::mem::take(&mut side.further);
        let paired: Vec<Arc<Mutex<Rdma>>> = further.iter().map(|(r, _)| r.clone()).collect();
        let gpus = side.gpus.clone();
        let fut = chan::connect(rdma.clone(), further, gpus, lane, port, self.origin.clone());
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            let Some(side) = act.ibv.as_mut() else {
                return;
            };
            match result {
                Ok(c) => {
                    side.links.extend(c.kept.iter().map(|&k| paired[k].clone()));
                    side.kept = c.kept;
                    side.peer_gpus = c.peer_gpus;
                    for w in c.watches {
                        let handle = ctx.add_stream(w);
                        if let Some(side) = act.ibv.as_mut() {
                            side.watches.push(handle);
                        }
                    }
                }
                Err(e) => {
                    if let Ok(rdma) = &side.rdma {
                        chan::lock(rdma).fail(e);
                    }
                }
            }
            if let Some(side) = act.ibv.as_mut() {
                side.hold_back = false;
                let waiting = std::mem::take(&mut side.waiting);
                for p in waiting {
                    act.ibv_dispatch(p);
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
                Some(Ok(_)) => return self.ibv_tensor(true, m.seq, m.index, m.buffer.into(), None),
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
        let result = match self.check_length(&m, "ibv") {
            Err(e) => Err(e),
            Ok(()) if m.buffer.is_empty() => Ok(()),
            Ok(()) => match self.ibv.as_ref().map(|s| &s.rdma) {
                Some(Ok(_)) => {
                    let buffer = RdmaBuf::from(m.buffer);
                    return self.ibv_tensor(false, m.seq, m.index, buffer, None);
                }
                Some(Err(e)) => Err(e.clone()),
                None => Err(self.misrouted()),
            },
        };
        self.hand_back(false, m.seq, m.index, Memory::Owned(m.buffer), result);
    }

    /// A tensor for the queue pairs (`gpu`: the sender's GPU, `None` for host memory): now,
    /// or after the bootstrap if it decides the links.
    pub(super) fn ibv_tensor(
        &mut self,
        sending: bool,
        seq: u64,
        index: u32,
        buffer: RdmaBuf,
        gpu: Option<u32>,
    ) {
        let p = Parked {
            sending,
            seq,
            index,
            buffer,
            gpu,
        };
        match self.ibv.as_mut().filter(|s| s.hold_back) {
            Some(side) => side.waiting.push_back(p),
            None => self.ibv_dispatch(p),
        }
    }

    /// Puts a tensor on its links (every link, or its sender's GPU's: [`IbvSide::choose`]):
    /// whole on the first, or (large, several links) one stripe of mpt's plan per link, the
    /// tensor held here until every stripe is back.
    fn ibv_dispatch(&mut self, p: Parked) {
        let Parked {
            sending,
            seq,
            index,
            mut buffer,
            gpu,
        } = p;
        let (links, chosen) = match self.ibv.as_ref() {
            Some(s) => (s.links.clone(), s.choose(sending, gpu)),
            None => (Vec::new(), Vec::new()),
        };
        let Some(&first) = chosen.first() else {
            let result = Err(self.misrouted());
            return self.ibv_finished(Finished {
                sending,
                seq,
                index,
                buffer,
                result,
            });
        };
        let put = |link: &Mutex<Rdma>, b: RdmaBuf| {
            let mut r = chan::lock(link);
            if sending {
                r.send(seq, index, b);
            } else {
                r.recv(seq, index, b);
            }
        };
        let stripes: Vec<(u32, u64, u64)> =
            crate::backend::mpt::stripes(buffer.len() as u64, chosen.len() as u32).collect();
        if stripes.len() <= 1 {
            return put(&links[first], buffer);
        }
        let regions: Vec<(usize, RdmaBuf)> = stripes
            .into_iter()
            .map(|(k, offset, n)| {
                // SAFETY: the stripes are disjoint ranges inside the tensor's buffer, which
                // stays held here (`hold_stripes`), untouched, until every stripe has come back
                // from its queue pair (`piece_done` or the gdr side counts them), and a queue
                // pair hands a stripe back only once the HCA can no longer touch it. Shared
                // bytes come only with `sending`: regions of them are written from, never into.
                (chosen[k as usize], unsafe { buffer.region(offset, n) })
            })
            .collect();
        self.hold_stripes((sending, seq, index), buffer, regions.len());
        for (l, region) in regions {
            put(&links[l], region);
        }
    }

    /// Holds a striped tensor until its `n` stripes are back: a `cuda_gdr` one on the gdr
    /// side, a host one with the channel's held buffers.
    fn hold_stripes(&mut self, key: HeldKey, buffer: RdmaBuf, n: usize) {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gdr.as_mut() {
            return g.hold(key, buffer, n);
        }
        match buffer.into_memory() {
            Some(memory) => self.hold(key, memory, n),
            // GPU memory reaches only cuda_gdr's side (above); never freed under its stripes.
            None => tracing::error!("ibv channel: GPU memory striped outside cuda_gdr"),
        }
    }

    /// A tensor, or a stripe of one, the queue pairs have finished with: to the gdr side
    /// (`cuda_gdr`), or counted against its held tensor (a stripe), or back to the pipe.
    fn ibv_finished(&mut self, f: Finished) {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gdr.as_mut() {
            return g.finished(f, self.cuda_reply.as_ref());
        }
        let key = (f.sending, f.seq, f.index);
        if self.held.contains_key(&key) {
            // A stripe (a region of the held tensor): the tensor goes back with the last.
            self.piece_done(key, f.result);
        } else if let Some(memory) = f.buffer.into_memory() {
            self.hand_back(f.sending, f.seq, f.index, memory, f.result);
        }
    }

    /// Fails the queue pairs (the channel is stopping): everything they hold comes back.
    pub(super) fn stop_ibv(&mut self, e: Error) {
        let Some(side) = self.ibv.as_mut() else {
            return;
        };
        side.hold_back = false;
        for l in &side.links {
            chan::lock(l).fail(e.clone());
        }
        let waiting = std::mem::take(&mut side.waiting);
        for p in waiting {
            self.ibv_finished(Finished {
                sending: p.sending,
                seq: p.seq,
                index: p.index,
                buffer: p.buffer,
                result: Err(e.clone()),
            });
        }
    }

    /// Progresses the queue pairs and hands every finished tensor to the pipe. A failure on one
    /// link fails them all.
    pub(super) fn ibv_flush(&mut self, ctx: &mut Context<Self>) {
        let Some(side) = self.ibv.as_mut() else {
            return self.maybe_stop(ctx);
        };
        let links = side.links.clone();
        let mut failure = None;
        for l in &links {
            let mut r = chan::lock(l);
            r.progress();
            if failure.is_none() {
                failure = r.failure().cloned();
            }
        }
        if let Some(e) = failure.filter(|_| links.len() > 1) {
            for l in &links {
                let mut r = chan::lock(l);
                r.fail(e.clone());
                r.progress();
            }
        }
        let ended = !links.is_empty()
            && links.iter().all(|l| {
                let r = chan::lock(l);
                r.failure().is_some() && r.is_idle()
            });
        if ended {
            // The queue pairs carry nothing more and their flush completions are all in: hang
            // up the lane so the peer knows.
            for w in side.watches.drain(..) {
                ctx.cancel_future(w);
            }
        }
        let mut done = Vec::new();
        for l in &links {
            done.extend(chan::lock(l).take_done());
        }
        for f in done {
            self.ibv_finished(f);
        }
        self.maybe_stop(ctx);
    }

    /// Whether the queue pairs hold no tensor (and none waits for them).
    pub(super) fn ibv_idle(&self) -> bool {
        match self.ibv.as_ref() {
            Some(side) => {
                side.waiting.is_empty() && side.links.iter().all(|l| chan::lock(l).is_idle())
            }
            None => true,
        }
    }

    /// The actor is going away with tensors still on the queue pairs (the system stopping):
    /// leak them, queue pairs included, rather than free memory the HCA may still touch.
    pub(super) fn ibv_forget(&mut self) {
        if !self.ibv_idle() {
            if let Some(side) = self.ibv.take() {
                std::mem::forget(side);
            }
            // Striped GPU tensors whose stripes are still on those queue pairs.
            #[cfg(feature = "cuda")]
            if let Some(g) = self.gdr.as_mut() {
                g.forget_striped();
            }
        }
    }
}

impl StreamHandler<Event> for Channel {
    fn handle(&mut self, ev: Event, ctx: &mut Self::Context) {
        let links = self
            .ibv
            .as_ref()
            .map(|s| s.links.clone())
            .unwrap_or_default();
        match ev {
            Event::Completions(k) => {
                if let Some(l) = links.get(k) {
                    chan::on_completions(&mut chan::lock(l));
                }
            }
            Event::PeerGone(why) => {
                let e = Error::PeerClosed {
                    reason: why,
                    graceful: false,
                    origin: self.origin.clone(),
                };
                for l in &links {
                    let mut r = chan::lock(l);
                    // Whatever landed before the hang-up counts.
                    r.progress();
                    r.fail(e.clone());
                }
            }
            Event::Broken(why) => {
                let e = Error::io("ibv channel", std::io::Error::other(why), &self.origin);
                for l in &links {
                    chan::lock(l).fail(e.clone());
                }
            }
        }
        self.ibv_flush(ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}
