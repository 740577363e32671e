//! The `ibv` channel's driver (feature `ibv`): the pipe's tensors by RDMA write into the
//! receiver's registered buffer ([`super`]). The driver owns the channel's queue
//! pairs (through [`Rdma`]: one per device, usually one), bootstraps them over its one lane,
//! wakes on each completion queue's descriptor and on the lane's hang-up, and hands every
//! finished tensor back to the pipe. With several devices (links), a large tensor is cut into
//! mpt's stripes, one per link, held here until every stripe is back. `cuda_gdr`
//! (`src/backend/cuda_gdr/driver.rs`) runs on the same queue pairs; its GPU tensors take the links of their GPU's
//! NICs ([`crate::backend::ibv::channel::placement`]), striped the same way.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::core::{Finished, Rdma, RdmaBuf};
use super::placement::GpuLinks;
use super::{self as chan, Connected, Event, IbvChannel};
use crate::backend::ibv::LinkLayer;
use crate::channel::driver::{Cx, Driver, HeldKey, RecvTensor, SendTensor};
use crate::error::{Error, Origin};
use crate::handshake::Halves;
use crate::transport::stream::{Done, Memory};

/// An ibv (or cuda_gdr) channel's context.
pub(crate) type Ctx<'a> = Cx<'a, IbvEvent>;

/// What comes back to an ibv channel.
pub(crate) enum IbvEvent {
    /// The bootstrap has ended.
    Connected(Result<Connected, Error>),
    /// A queue pair's completion queue or the lane has something to say.
    Watch(Event),
    /// A sent CUDA tensor's stream has run the work queued before its write (`cuda_gdr`).
    #[cfg(feature = "cuda")]
    GdrReady { seq: u64, index: u32 },
}

/// A watch's events, as the driver's.
struct Watched(chan::Watch);

impl futures_core::Stream for Watched {
    type Item = IbvEvent;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<IbvEvent>> {
        std::pin::Pin::new(&mut self.0)
            .poll_next(cx)
            .map(|e| e.map(IbvEvent::Watch))
    }
}

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
pub(crate) struct IbvDriver {
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
    /// The further queue pairs handed to the bootstrap, until it ends.
    paired: Vec<Arc<Mutex<Rdma>>>,
    /// Tensors waiting for it, in order.
    waiting: VecDeque<Parked>,
    /// The lane and the port's link layer and number, until the bootstrap starts.
    setup: Option<(Halves, (LinkLayer, u8))>,
    /// Whether the watches on the completion queues (and the lane) run: once bootstrapped,
    /// until every queue pair has failed (cancelling them closes the lane, which tells the
    /// peer at once).
    watching: bool,
    /// The `cuda_gdr` channel's CUDA state around the queue pairs.
    #[cfg(feature = "cuda")]
    pub(crate) gdr: Option<crate::backend::cuda_gdr::driver::GdrSide>,
}

impl IbvDriver {
    /// Creates the queue pairs now (tensors can queue on them at once); the bootstrap over
    /// `lanes` (exactly one) starts with the actor.
    pub(crate) fn new(backend: &IbvChannel, mut lanes: Vec<Halves>, origin: &Origin) -> IbvDriver {
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
        IbvDriver {
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
            paired: Vec::new(),
            waiting: VecDeque::new(),
            setup,
            watching: false,
            #[cfg(feature = "cuda")]
            gdr: None,
        }
    }

    /// Makes the queue pairs carry CUDA tensors (`cuda_gdr`): this host's GPUs are placed on
    /// the devices, each GPU's tensors taking its NICs.
    #[cfg(feature = "cuda")]
    pub(crate) fn with_gdr(mut self) -> Self {
        self.gpus = crate::backend::cuda_gdr::gpu_links(&self.backend, &self.names);
        self.gdr = Some(crate::backend::cuda_gdr::driver::GdrSide::new());
        self
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

impl IbvDriver {
    /// Starts the bootstrap of the channel's queue pairs (the actor is starting).
    fn bootstrap(&mut self, cx: &mut Ctx<'_>) {
        let (Ok(rdma), Some((lane, port))) = (&self.rdma, self.setup.take()) else {
            return;
        };
        let further = std::mem::take(&mut self.further);
        self.paired = further.iter().map(|(r, _)| r.clone()).collect();
        let gpus = self.gpus.clone();
        let origin = cx.core.origin.clone();
        let fut = chan::connect(rdma.clone(), further, gpus, lane, port, origin);
        cx.fx
            .spawn(Box::pin(async move { IbvEvent::Connected(fut.await) }));
    }

    /// The bootstrap has ended: the links are known, and the tensors waiting go out.
    fn connected(&mut self, result: Result<Connected, Error>, cx: &mut Ctx<'_>) {
        match result {
            Ok(c) => {
                let paired = std::mem::take(&mut self.paired);
                self.links.extend(c.kept.iter().map(|&k| paired[k].clone()));
                self.kept = c.kept;
                self.peer_gpus = c.peer_gpus;
                for w in c.watches {
                    cx.fx.watch(Box::pin(Watched(w)));
                }
                self.watching = true;
            }
            Err(e) => {
                if let Ok(rdma) = &self.rdma {
                    chan::lock(rdma).fail(e);
                }
            }
        }
        self.hold_back = false;
        for p in std::mem::take(&mut self.waiting) {
            self.dispatch(p, cx);
        }
        self.flush(cx);
    }

    /// A tensor for the queue pairs (`gpu`: the sender's GPU, `None` for host memory): now,
    /// or after the bootstrap if it decides the links.
    pub(crate) fn tensor(
        &mut self,
        sending: bool,
        seq: u64,
        index: u32,
        buffer: RdmaBuf,
        gpu: Option<u32>,
        cx: &mut Ctx<'_>,
    ) {
        let p = Parked {
            sending,
            seq,
            index,
            buffer,
            gpu,
        };
        match self.hold_back {
            true => self.waiting.push_back(p),
            false => self.dispatch(p, cx),
        }
    }

    /// Puts a tensor on its links (every link, or its sender's GPU's: [`Self::choose`]):
    /// whole on the first, or (large, several links) one stripe of mpt's plan per link, the
    /// tensor held here until every stripe is back.
    fn dispatch(&mut self, p: Parked, cx: &mut Ctx<'_>) {
        let Parked {
            sending,
            seq,
            index,
            mut buffer,
            gpu,
        } = p;
        let chosen = self.choose(sending, gpu);
        let Some(&first) = chosen.first() else {
            let result = Err(cx.core.misrouted());
            let f = Finished {
                sending,
                seq,
                index,
                buffer,
                result,
            };
            return self.finished(f, cx);
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
            return put(&self.links[first], buffer);
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
        self.hold_stripes((sending, seq, index), buffer, regions.len(), cx);
        for (l, region) in regions {
            put(&self.links[l], region);
        }
    }

    /// Holds a striped tensor until its `n` stripes are back: a `cuda_gdr` one on the gdr
    /// side, a host one with the channel's held buffers.
    fn hold_stripes(&mut self, key: HeldKey, buffer: RdmaBuf, n: usize, cx: &mut Ctx<'_>) {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gdr.as_mut() {
            return g.hold(key, buffer, n);
        }
        match buffer.into_memory() {
            Some(memory) => cx.core.hold(key, memory, n),
            // GPU memory reaches only cuda_gdr's side (above); never freed under its stripes.
            None => tracing::error!("ibv channel: GPU memory striped outside cuda_gdr"),
        }
    }

    /// A tensor, or a stripe of one, the queue pairs have finished with: to the gdr side
    /// (`cuda_gdr`), or counted against its held tensor (a stripe), or back to the pipe.
    fn finished(&mut self, f: Finished, cx: &mut Ctx<'_>) {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gdr.as_mut() {
            return g.finished(f, cx.core.cuda_reply());
        }
        let key = (f.sending, f.seq, f.index);
        if cx.core.held.contains_key(&key) {
            // A stripe (a region of the held tensor): the tensor goes back with the last.
            cx.core.piece_done(key, f.result);
        } else if let Some(memory) = f.buffer.into_memory() {
            cx.core
                .hand_back(f.sending, f.seq, f.index, memory, f.result);
        }
    }

    /// Fails the queue pairs: everything they hold comes back.
    pub(crate) fn fail_all(&mut self, e: Error, cx: &mut Ctx<'_>) {
        self.hold_back = false;
        for l in &self.links {
            chan::lock(l).fail(e.clone());
        }
        for p in std::mem::take(&mut self.waiting) {
            let f = Finished {
                sending: p.sending,
                seq: p.seq,
                index: p.index,
                buffer: p.buffer,
                result: Err(e.clone()),
            };
            self.finished(f, cx);
        }
    }

    /// Fails the first queue pair with `e` (the tensors behind it would go wrong).
    #[cfg(feature = "cuda")]
    pub(crate) fn fail_first(&self, e: Error) {
        if let Ok(rdma) = &self.rdma {
            chan::lock(rdma).fail(e);
        }
    }

    /// Whether the channel has queue pairs (else every tensor fails with why not).
    pub(crate) fn usable(&self) -> Result<(), Error> {
        self.rdma.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// Progresses the queue pairs and hands every finished tensor to the pipe. A failure on one
    /// link fails them all.
    pub(crate) fn flush(&mut self, cx: &mut Ctx<'_>) {
        let links = self.links.clone();
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
        if ended && self.watching {
            // The queue pairs carry nothing more and their flush completions are all in: hang
            // up the lane so the peer knows.
            self.watching = false;
            cx.fx.cancel_watches();
        }
        let mut done = Vec::new();
        for l in &links {
            done.extend(chan::lock(l).take_done());
        }
        for f in done {
            self.finished(f, cx);
        }
    }

    /// Whether the queue pairs hold no tensor (and none waits for them).
    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.links.iter().all(|l| chan::lock(l).is_idle())
    }

    fn on_watch(&mut self, ev: Event, cx: &mut Ctx<'_>) {
        let links = self.links.clone();
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
                    origin: cx.core.origin.clone(),
                };
                for l in &links {
                    let mut r = chan::lock(l);
                    // Whatever landed before the hang-up counts.
                    r.progress();
                    r.fail(e.clone());
                }
            }
            Event::Broken(why) => {
                let e = Error::io("ibv channel", std::io::Error::other(why), &cx.core.origin);
                for l in &links {
                    chan::lock(l).fail(e.clone());
                }
            }
        }
        self.flush(cx);
    }
}

impl Driver for IbvDriver {
    type Event = IbvEvent;

    fn start(&mut self, cx: &mut Ctx<'_>) {
        self.bootstrap(cx);
    }

    /// Sends one tensor; an empty one needs no transfer.
    fn send(&mut self, m: SendTensor, cx: &mut Ctx<'_>) {
        let result = match self.usable() {
            _ if m.buffer.is_empty() => Ok(()),
            Ok(()) => {
                self.tensor(true, m.seq, m.index, m.buffer.into(), None, cx);
                return self.flush(cx);
            }
            Err(e) => Err(e),
        };
        cx.core.hand_back(true, m.seq, m.index, m.buffer, result);
    }

    /// Receives one tensor: its channel data is its length.
    fn recv(&mut self, m: RecvTensor, cx: &mut Ctx<'_>) {
        let result = match cx.core.check_length(&m, "ibv") {
            Err(e) => Err(e),
            Ok(()) if m.buffer.is_empty() => Ok(()),
            Ok(()) => match self.usable() {
                Ok(()) => {
                    let buffer = RdmaBuf::from(m.buffer);
                    self.tensor(false, m.seq, m.index, buffer, None, cx);
                    return self.flush(cx);
                }
                Err(e) => Err(e),
            },
        };
        cx.core
            .hand_back(false, m.seq, m.index, Memory::Owned(m.buffer), result);
    }

    #[cfg(feature = "cuda")]
    fn send_cuda(&mut self, m: crate::channel::driver::SendCuda, cx: &mut Ctx<'_>) {
        self.send_gdr(m, cx);
    }

    #[cfg(feature = "cuda")]
    fn recv_cuda(&mut self, m: crate::channel::driver::RecvCuda, cx: &mut Ctx<'_>) {
        self.recv_gdr(m, cx);
    }

    fn on_done(&mut self, d: Done, _: &mut Ctx<'_>) {
        tracing::error!(
            ?d,
            "a lane completion on an ibv channel, which has no lanes of that kind"
        );
    }

    fn on_event(&mut self, e: IbvEvent, cx: &mut Ctx<'_>) {
        match e {
            IbvEvent::Connected(r) => self.connected(r, cx),
            IbvEvent::Watch(ev) => self.on_watch(ev, cx),
            #[cfg(feature = "cuda")]
            IbvEvent::GdrReady { seq, index } => self.gdr_ready(seq, index, cx),
        }
    }

    fn stop(&mut self, e: Error, cx: &mut Ctx<'_>) {
        cx.core.shutdown_lanes();
        self.fail_all(e.clone(), cx);
        cx.core.fail_held(e);
        self.flush(cx);
    }

    fn drained(&mut self, cx: &mut Ctx<'_>) -> bool {
        #[cfg(feature = "cuda")]
        if self.gdr.as_ref().is_some_and(|g| !g.idle()) {
            return false;
        }
        self.idle() && cx.core.held.is_empty()
    }

    /// The actor is going away with tensors still on the queue pairs (the system stopping):
    /// leak them, queue pairs included, rather than free memory the HCA may still touch.
    fn forget(&mut self, _: &mut crate::channel::driver::Core) {
        if self.idle() {
            return;
        }
        for l in self.links.drain(..) {
            std::mem::forget(l);
        }
        if let Ok(r) = std::mem::replace(&mut self.rdma, Err(Error::invalid("forgotten"))) {
            std::mem::forget(r);
        }
        for p in self.waiting.drain(..) {
            std::mem::forget(p);
        }
        // Striped GPU tensors whose stripes are still on those queue pairs.
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gdr.as_mut() {
            g.forget_striped();
        }
    }
}
