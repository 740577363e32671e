//! The `efa` channel's data path: its links, the tensors it holds while their chunks are out,
//! and their ends. Shared by the channel actor, which sets it up over the lane and fails it,
//! and the pipe, which hands it tensors and reads its ends itself: an in-place tensor crosses
//! no mailbox between the two actors (before 2026-11-28 each tensor went to the channel actor
//! as a message, and each end came back through it: two hand-overs of the executor's a tensor,
//! git history's docs/efa-measurements.md, "An in-place tensor without the channel actor").
//!
//! Both actors run on the pipe's thread, so the path is an `Rc<RefCell<_>>`. Nothing it does
//! calls back into either actor: what it hands back goes to the pipe's completion queue, or
//! into the list the pipe passes in ([`Path::finished`]), and rendezvous grants go to the
//! channel actor's queue, which writes them on the lane.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use actix::Addr;
use tokio::sync::mpsc;

use super::{ChannelPort, STAND_IN_AFTER};
use crate::actors::hardware::efa::{
    FabricDetach, FabricEndpoint, FabricQuarantine, Poster, RegionOp,
};
use crate::backend::efa::engine::{Finished, Kind, Region};
use crate::backend::efa::tag::{self, Stream as TagStream};
use crate::channel::driver::{check_length, piece_ended, released, tensor_done, Held, HeldKey};
use crate::error::{Error, Origin};
use crate::keymap::KeyMap;
use crate::transport::stream::{Done, Memory, Reply};
use crate::wire::Ack;

/// The data path, as both actors hold it.
pub(crate) type SharedPath = Rc<RefCell<Path>>;

/// Where the set-up stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Asking the endpoint for its address.
    Describing,
    /// Our hello is out; waiting for the peer's.
    Hello,
    /// Reading the peer's address.
    Name,
    /// Attaching to the endpoint.
    Attaching,
    /// Waiting for the peer's pipe number.
    PeerPipe,
    /// Moving tensors; the lane's read watches for its end.
    Ready,
}

/// One pair of endpoints (ours on one domain, the peer's on the same fabric) and the channel's
/// pipe on it.
pub(super) struct Link {
    pub(super) ep: Addr<FabricEndpoint>,
    /// Posts straight into the endpoint's engine (from the attach on).
    pub(super) poster: Option<Poster>,
    /// The peer endpoint's address (until attached).
    pub(super) peer: Vec<u8>,
    pub(super) pipe: Option<u32>,
    pub(super) peer_pipe: u32,
    /// The tensor of each chunk posted, in post order (the endpoint ends them in that order).
    sends: VecDeque<HeldKey>,
    /// Same for receives, with the chunk's length.
    recvs: VecDeque<(HeldKey, usize)>,
    send_seq: u32,
    recv_seq: u32,
    /// Rendezvous only: how many receives the peer has posted on this link (its `recv_seq`,
    /// as it last told us), and our chunks that wait for theirs, each with its number.
    pub(super) granted: u32,
    unsent: VecDeque<(u32, RegionOp)>,
}

impl Link {
    /// A link to the peer endpoint at `peer` through `ep`, not yet attached.
    pub(super) fn new(ep: Addr<FabricEndpoint>, peer: Vec<u8>) -> Link {
        Link {
            ep,
            poster: None,
            peer,
            pipe: None,
            peer_pipe: 0,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            send_seq: 0,
            recv_seq: 0,
            granted: 0,
            unsent: VecDeque::new(),
        }
    }

    /// Posts the waiting chunks whose receives the peer has posted, in order (`scratch`: a
    /// list kept empty between calls).
    pub(super) fn post_granted(&mut self, scratch: &mut Vec<RegionOp>) {
        let (Some(poster), Some(pipe)) = (&self.poster, self.pipe) else {
            return;
        };
        // `granted` runs ahead of a waiting chunk's number by less than 2^31.
        while let Some((seq, _)) = self.unsent.front() {
            if self.granted.wrapping_sub(*seq) as i32 <= 0 {
                break;
            }
            scratch.extend(self.unsent.pop_front().map(|(_, op)| op));
        }
        if !scratch.is_empty() {
            // SAFETY: as in `Path::move_tensor`, which queued them: each region lies inside a
            // tensor's buffer held in `held` until the op ends; a failing path empties `unsent`
            // and takes `pipe`, so nothing is posted after it has handed the buffers back.
            unsafe { poster.post_regions(pipe, scratch) };
            scratch.clear();
        }
    }
}

/// The channel's state on the fabric.
pub(crate) struct Path {
    /// Our endpoints: the transport's domain first, then the further ones.
    pub(super) eps: Vec<Addr<FabricEndpoint>>,
    /// What each said of itself (`None`: not yet, or it stopped: left out).
    pub(super) infos: Vec<Option<crate::actors::hardware::efa::EndpointInfo>>,
    /// Descriptions still awaited.
    pub(super) describing: usize,
    pub(super) step: Step,
    pub(super) failed: Option<Error>,
    pub(super) chunk: usize,
    /// The links, in stripe order (set once the peer's list is in).
    pub(super) links: Vec<Link>,
    /// Attaches still out.
    pub(super) attaching: usize,
    /// The next link whose peer pipe number is due.
    pub(super) next_peer: usize,
    /// Tensors handed over before the set-up finished: (sending, seq, index, buffer).
    waiting: VecDeque<(bool, u64, u32, Memory)>,
    /// `move_tensor`'s lists of ops, one per link, kept empty between tensors.
    pub(super) posts: Vec<Vec<RegionOp>>,
    /// Whether in-place chunks wait for the peer's receives (the provider does not keep a large
    /// unexpected message: `fabric::keeps_unexpected`). Both sides decide alike: their
    /// transports' domains, which negotiation matched, name the provider as peers compare it.
    pub(super) rendezvous: bool,
    /// Rendezvous grants, to the channel actor, which writes them on the lane.
    grants: mpsc::UnboundedSender<Ack>,
    /// Tensors whose chunks are out, until each has ended.
    held: KeyMap<HeldKey, Held>,
    /// The pipe's completion queue.
    reply: Reply,
    /// Where [`Path::finished`] hands tensors back instead of `reply`, while it runs.
    batch: Option<Vec<Done>>,
    origin: Origin,
    /// Each link's ends, read by the pipe ([`PathEnds`]); `None` once its endpoint let go.
    ends: Vec<Option<mpsc::UnboundedReceiver<Finished>>>,
    /// The pipe's task, woken when a link's ends are added.
    ends_waker: Option<Waker>,
    /// Told once every link has attached to its endpoint, or the set-up has failed
    /// ([`Path::when_attached`]).
    attached: Option<tokio::sync::oneshot::Sender<()>>,
    /// Once failed with tensors held: each link's pipe as it was detached from its endpoint,
    /// and when the tensors still held go back as stand-ins ([`STAND_IN_AFTER`]).
    detached: Vec<(u32, Addr<FabricEndpoint>)>,
    stand_in_at: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Path {
    /// The path of a new channel on `port`'s endpoints, handing tensors back to `reply`, and
    /// the queue of its rendezvous grants for the channel actor.
    pub(crate) fn new(
        port: ChannelPort,
        reply: Reply,
        origin: Origin,
    ) -> (SharedPath, mpsc::UnboundedReceiver<Ack>) {
        let (eps, failed) = match port.endpoint {
            Ok(ep) => (std::iter::once(ep).chain(port.extra).collect(), None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let (grants, grants_rx) = mpsc::unbounded_channel();
        let path = Path {
            infos: vec![None; eps.len()],
            eps,
            describing: 0,
            step: Step::Describing,
            failed,
            chunk: port.max_message.max(1),
            links: Vec::new(),
            attaching: 0,
            next_peer: 0,
            waiting: VecDeque::new(),
            posts: Vec::new(),
            rendezvous: false,
            grants,
            held: KeyMap::default(),
            reply,
            batch: None,
            origin,
            ends: Vec::new(),
            ends_waker: None,
            attached: None,
            detached: Vec::new(),
            stand_in_at: None,
        };
        (Rc::new(RefCell::new(path)), grants_rx)
    }

    /// Whether the channel actor must stay for the path's sake (an attach is under way: its
    /// pipe must be detached once it comes back).
    pub(super) fn busy(&self) -> bool {
        self.attaching > 0
    }

    /// What tells when every link has attached to its endpoint (its pipe number on it given,
    /// so the endpoint counts the channel's pipe), or the set-up has failed, or the path is
    /// gone; `None` if it has failed already. The pipe is handed out then (`spawn_pipe`): the
    /// attach follows the peer's hello on the lane, which the peer sends as its pipe starts, so
    /// waiting for it adds no round trip, and a tensor waits for more (the peer's pipe number).
    pub(crate) fn when_attached(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        if self.failed.is_some() {
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.attached = Some(tx);
        Some(rx)
    }

    /// Every link has attached, or the set-up is over without: [`Path::when_attached`] is told.
    pub(super) fn attach_over(&mut self) {
        if let Some(tx) = self.attached.take() {
            let _ = tx.send(());
        }
    }

    /// Link `link`'s ends, for the pipe to read.
    pub(super) fn add_ends(&mut self, link: usize, rx: mpsc::UnboundedReceiver<Finished>) {
        if self.ends.len() <= link {
            self.ends.resize_with(link + 1, || None);
        }
        self.ends[link] = Some(rx);
        if let Some(w) = self.ends_waker.take() {
            w.wake();
        }
    }

    fn emit(&mut self, d: Done) {
        match &mut self.batch {
            Some(batch) => batch.push(d),
            None => {
                let _ = self.reply.send(d);
            }
        }
    }

    fn hand_back(&mut self, key: HeldKey, memory: Memory, r: Result<(), Error>) {
        self.emit(tensor_done(key, memory, r));
    }

    fn release(&mut self, key: HeldKey) {
        if let Some(d) = released(&mut self.held, key) {
            self.emit(d);
        }
    }

    /// A tensor to receive in place: its channel data must give its length (an inline one's is
    /// empty, and the pipe reads it itself).
    pub(crate) fn recv(&mut self, seq: u64, index: u32, buffer: Vec<u8>, data: &[u8]) {
        if let Err(e) = check_length(data, buffer.len(), "efa", &self.origin) {
            return self.hand_back((false, seq, index), Memory::Owned(buffer), Err(e));
        }
        self.tensor(false, seq, index, Memory::Owned(buffer))
    }

    /// Sends (`sending`) or receives a tensor: now if the set-up is done, else once it is.
    pub(crate) fn tensor(&mut self, sending: bool, seq: u64, index: u32, buffer: Memory) {
        if let Some(e) = self.failed.clone() {
            return self.hand_back((sending, seq, index), buffer, Err(e));
        }
        if self.step != Step::Ready {
            self.waiting.push_back((sending, seq, index, buffer));
            return;
        }
        self.move_tensor((sending, seq, index), buffer);
    }

    /// The set-up is done: the tensors handed over meanwhile move, in order.
    pub(super) fn ready(&mut self) {
        self.step = Step::Ready;
        while let Some((sending, seq, index, buffer)) = self.waiting.pop_front() {
            self.move_tensor((sending, seq, index), buffer);
        }
    }

    /// Posts a tensor's chunks, straight from or into its buffer, which stays in `held` until
    /// every chunk has ended: stripe `k` of mpt's plan on link `k`, chunked.
    fn move_tensor(&mut self, key: HeldKey, mut buffer: Memory) {
        let (sending, seq, _) = key;
        let len = buffer.len();
        // Shared bytes come only with `sending`: they are sent from, never received into.
        let base = buffer.base_ptr() as usize;
        let ready = !self.links.is_empty()
            && self
                .links
                .iter()
                .all(|l| l.pipe.is_some() && l.poster.is_some() && l.ep.connected());
        if !ready {
            let e = self.failed.clone().unwrap_or_else(|| gone(&self.origin));
            return self.hand_back(key, buffer, Err(e));
        }
        // One list of ops per link, reused from tensor to tensor (no allocation per tensor).
        let mut posts = std::mem::take(&mut self.posts);
        posts.resize_with(self.links.len(), Vec::new);
        let stripes = crate::backend::mpt::stripes(len as u64, self.links.len() as u32);
        for (k, start, n) in stripes {
            let l = &mut self.links[k as usize];
            let start = start as usize;
            for (offset, n) in crate::actors::hardware::efa::channel::chunks(n as usize, self.chunk)
            {
                let (kind, t) = if sending {
                    let t = tag::make(TagStream::Tensor, l.peer_pipe, l.send_seq);
                    l.send_seq = l.send_seq.wrapping_add(1);
                    l.sends.push_back(key);
                    (Kind::Send, t)
                } else {
                    let pipe = l.pipe.unwrap_or_default();
                    let t = tag::make(TagStream::Tensor, pipe, l.recv_seq);
                    l.recv_seq = l.recv_seq.wrapping_add(1);
                    l.recvs.push_back((key, n));
                    (Kind::Recv, t)
                };
                posts[k as usize].push(RegionOp {
                    kind,
                    tag: t,
                    region: Region {
                        base,
                        buffer_len: len,
                        offset: start + offset,
                        len: n,
                    },
                    id: seq,
                });
            }
        }
        let out = posts.iter().map(Vec::len).sum();
        // The buffer moves into `held`; its heap memory, which the regions name, does not.
        self.held.insert(key, Held::new(buffer, out));
        let rendezvous = self.rendezvous;
        for (k, (l, ops)) in self.links.iter_mut().zip(&mut posts).enumerate() {
            if rendezvous && sending && !ops.is_empty() {
                // Each chunk waits for the peer's receive (numbered as `send_seq` counted).
                let first = l.send_seq.wrapping_sub(ops.len() as u32);
                let numbered = (0..).map(|i| first.wrapping_add(i));
                l.unsent.extend(numbered.zip(ops.drain(..)));
                l.post_granted(ops);
                continue;
            }
            let (Some(poster), Some(pipe)) = (&l.poster, l.pipe) else {
                ops.clear();
                continue; // not reached: `ready` above checked every link's pipe
            };
            if !ops.is_empty() {
                // SAFETY: every region lies inside the tensor's buffer (the stripes and their
                // chunks are disjoint ranges of it), whose heap memory stays in `self.held`,
                // untouched, until each op has ended (`finished` counts them down; `release`
                // waits for zero; a failing path hands back a stand-in and leaves the buffer
                // with the endpoints; a path dropped with ops out forgets the buffer rather
                // than free it).
                unsafe { poster.post_regions(pipe, ops) };
                ops.clear();
                if rendezvous && !sending {
                    // After the receives: the peer sends into them once it hears.
                    let grant = Ack {
                        seq: l.recv_seq as u64,
                        tensor: k as u32,
                        ok: true,
                    };
                    let _ = self.grants.send(grant);
                }
            }
        }
        self.posts = posts;
        // Nothing to move (an empty tensor): back at once.
        self.release(key);
    }

    /// One chunk ended on link `link` (from that endpoint's queue for our pipe, in post order);
    /// what it hands back goes into `batch` (kept empty between calls), for the pipe.
    pub(crate) fn finished(&mut self, LinkEnd(link, done): LinkEnd, batch: &mut Vec<Done>) {
        self.batch = Some(std::mem::take(batch));
        self.on_end(link, done);
        *batch = self.batch.take().unwrap_or_default();
    }

    fn on_end(&mut self, link: usize, done: Finished) {
        let Some(l) = self.links.get_mut(link) else {
            return tracing::warn!("efa channel: an end on no link");
        };
        let (key, want) = match done.kind {
            Kind::Send => (l.sends.pop_front(), None),
            Kind::Recv => match l.recvs.pop_front() {
                Some((k, n)) => (Some(k), Some(n)),
                None => (None, None),
            },
        };
        let Some(key) = key else {
            return tracing::warn!("efa channel: an end for no posted chunk");
        };
        let result = match (done.result, want) {
            // Once the channel has failed (and detached its pipes), its ops end with that error.
            (Err(e), _) => Err(self
                .failed
                .clone()
                .unwrap_or_else(|| chunk_error(e, &self.origin))),
            // Short or long chunks: the two sides cut differently, and every later tag is off.
            (Ok(n), Some(w)) if n != w => Err(Error::protocol(
                format!("efa channel: a chunk of {n} bytes arrived where {w} were expected"),
                &self.origin,
            )),
            (Ok(_), _) => Ok(()),
        };
        if let Err(e) = &result {
            // The endpoint failed the pipe's other ops too; the channel fails as a whole.
            self.fail(e.clone());
        }
        piece_ended(&mut self.held, key, result);
        self.release(key);
    }

    /// Fails the path: waiting tensors go back with `e` now, and so do held ones once their
    /// ops have ended: the pipes are detached from their endpoints (their backlogged ops end
    /// with the error, posted ones are cancelled where the provider can). A posted op the
    /// provider cannot take back (a send to a dead peer on `shm`) would hold its memory until
    /// the endpoint closes, so a tensor still held [`STAND_IN_AFTER`] later goes back as a
    /// copy ([`Path::stand_ins`]). Later tensors fail at once.
    pub(super) fn fail(&mut self, e: Error) {
        if self.failed.is_none() {
            self.failed = Some(e.clone());
        }
        self.attach_over();
        let waiting = std::mem::take(&mut self.waiting);
        // Chunks that wait for the peer's receives are never posted: they end here. They are
        // the last sends of their link, in post order.
        let mut ended = Vec::new();
        for l in &mut self.links {
            for _ in 0..l.unsent.len() {
                if let Some(k) = l.sends.pop_back() {
                    piece_ended(&mut self.held, k, Err(e.clone()));
                    ended.push(k);
                }
            }
            l.unsent.clear();
        }
        for k in ended {
            self.release(k);
        }
        let detach: Vec<(u32, Addr<FabricEndpoint>)> = self
            .links
            .iter_mut()
            .filter_map(|l| Some((l.pipe.take()?, l.ep.clone())))
            .collect();
        for (sending, seq, index, buffer) in waiting {
            self.hand_back((sending, seq, index), buffer, Err(e.clone()));
        }
        if detach.is_empty() {
            return;
        }
        for (pipe, ep) in &detach {
            ep.do_send(FabricDetach {
                pipe: *pipe,
                reason: e.to_string(),
            });
        }
        for h in self.held.values_mut() {
            h.error.get_or_insert(e.clone());
        }
        if !self.held.is_empty() {
            self.detached = detach;
            self.stand_in_at = Some(Box::pin(tokio::time::sleep(STAND_IN_AFTER)));
            // The pipe's task polls the timer with the ends.
            if let Some(w) = self.ends_waker.take() {
                w.wake();
            }
        }
    }

    /// [`STAND_IN_AFTER`] has passed since the path failed: each tensor still held goes back
    /// as a copy of the same length (a send's bytes; a receive's, which failed anyway, as
    /// zeros), flagged as a stand-in, and its own buffer is left with the endpoints
    /// (`FabricQuarantine`, shared by every link's), dropped once each has let go of it.
    fn stand_ins(&mut self) {
        let keys: Vec<HeldKey> = self.held.keys().copied().collect();
        let mut originals = Vec::new();
        for k in keys {
            if let Some(h) = self.held.get_mut(&k).filter(|h| h.out > 0) {
                let stand_in = match &h.buffer {
                    Memory::Shared(b) => Memory::Shared(b.clone()),
                    m if k.0 => Memory::Owned(m.as_slice().to_vec()),
                    m => Memory::Owned(vec![0; m.len()]),
                };
                originals.push(std::mem::replace(&mut h.buffer, stand_in));
                // Shared bytes are reference-counted: the clone is the caller's own.
                h.stand_in = !matches!(h.buffer, Memory::Shared(_));
                h.out = 0;
            }
            self.release(k);
        }
        let detached = std::mem::take(&mut self.detached);
        if !originals.is_empty() {
            tracing::warn!(
                tensors = originals.len(),
                "efa channel: the provider still holds buffers of a failed pipe; \
                 they go back as stand-in copies"
            );
            let kept = Arc::new(Mutex::new(originals));
            for (pipe, ep) in detached {
                ep.do_send(FabricQuarantine {
                    pipe,
                    buffers: kept.clone(),
                });
            }
        }
    }
}

impl Drop for Path {
    fn drop(&mut self) {
        // Torn down with chunks out (the system shutting down, both actors gone): the
        // endpoints may still touch those buffers, so they are never freed.
        for (_, h) in self.held.drain() {
            std::mem::forget(h.buffer);
        }
    }
}

/// One op's end on a link.
pub(crate) struct LinkEnd(pub(super) usize, pub(super) Finished);

/// The path's ends, as a stream of the pipe's: each link's in its order.
pub(crate) struct PathEnds(pub(crate) SharedPath);

impl futures_core::Stream for PathEnds {
    type Item = LinkEnd;
    fn poll_next(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<LinkEnd>> {
        let mut p = self.0.borrow_mut();
        if p.held.is_empty() {
            // Every tensor of the failed path came back itself.
            p.stand_in_at = None;
        }
        if let Some(t) = &mut p.stand_in_at {
            if t.as_mut().poll(cx).is_ready() {
                p.stand_in_at = None;
                p.stand_ins();
            }
        }
        for (k, slot) in p.ends.iter_mut().enumerate() {
            let Some(rx) = slot else { continue };
            match rx.poll_recv(cx) {
                Poll::Ready(Some(f)) => return Poll::Ready(Some(LinkEnd(k, f))),
                // The endpoint let go of our pipe there: nothing more comes.
                Poll::Ready(None) => *slot = None,
                Poll::Pending => {}
            }
        }
        if !p
            .ends_waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            p.ends_waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// A chunk's failure as the pipe's error: a connection to the peer that the provider found
/// lost (`tcp;ofi_rxm` reports a dead peer as `ENOTCONN`, `ECONNRESET`, or `ECANCELED` with
/// "not connected" in its own text; `shm` as `EIO`, its answer when the cross-memory copy
/// to or from the peer's process fails, which for buffers the runtime holds means that process
/// is gone) is `PeerClosed`, as on every other backend; anything else is an I/O error naming
/// the provider. The provider's text stays in the reason either way.
fn chunk_error(e: crate::backend::efa::FabricError, origin: &Origin) -> Error {
    let lost = [
        libc::ENOTCONN,
        libc::ECONNRESET,
        libc::ECONNABORTED,
        libc::EPIPE,
        libc::EHOSTUNREACH,
    ]
    .contains(&e.code)
        || (e.code == libc::ECANCELED && e.text.contains("not connected"))
        || (e.code == libc::EIO && e.provider == "shm");
    if lost {
        return Error::PeerClosed {
            reason: e.to_string(),
            graceful: false,
            origin: origin.clone(),
        };
    }
    crate::actors::hardware::efa::fabric_error(e, origin)
}

/// The error of a tensor whose endpoint stopped.
pub(super) fn gone(origin: &Origin) -> Error {
    Error::Closed {
        reason: "the fabric endpoint actor stopped".into(),
        origin: origin.clone(),
    }
}
