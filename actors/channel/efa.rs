//! The `efa` side of the channel actor (feature `efa`, see [`crate::channel::efa`]): set-up
//! over the channel's lane, then tagged sends and receives posted on the context's endpoint
//! actor straight from and into the held buffers, chunked at the agreed size.
//!
//! Set-up on the lane, both sides at once (neither waits for the other before writing):
//!
//! ```text
//! Ack{seq: our chunk limit, tensor: list length, ok} + our domains' list        ───►
//!   list: per domain (ours first), u16 length + fabric, u16 length + endpoint address
//!   (both sides pair the lists: `pair_domains`; each pair is a link; the peer's address
//!    of each link goes into that link's endpoint's AV: FabricAttach gives our pipe number)
//! Ack{seq: our pipe number on link k, tensor: k, ok}, for each link k in order   ───►
//! ```
//!
//! (`Ack` frames only, so the wire format has no frame kind for this channel alone.) Tensors
//! the pipe hands over before the set-up is done wait, in order. The lane then stays open with
//! one read posted: its end, or a failed set-up, fails every pending operation in order
//! (`FabricDetach` on every link) and every later one at once.
//!
//! With several links, a tensor is cut into mpt's stripes (`channel::mpt::stripes`), stripe
//! `k` on link `k`, each chunked at the agreed size; every link numbers its own chunks.
//!
//! Where the provider does not keep a large unexpected message until a receive matches it
//! (rxm's passthru: `fabric::keeps_unexpected`), the receiver says on the lane how far it has
//! posted, and the sender posts a chunk only once its receive is posted (a rendezvous):
//!
//! ```text
//! Ack{seq: receives posted on link k so far (wrapping at 2^32), tensor: k, ok}   ◄───
//! ```

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use super::*;
use crate::actors::fabric::{
    fabric_error, EndpointInfo, FabricAttach, FabricDescribe, FabricDetach, FabricEndpoint,
    FabricQuarantine, FabricShare, Poster, RegionOp,
};
use crate::channel::efa::{pair_domains, ChannelPort};
use crate::fabric::engine::{Finished, Kind, Region};
use crate::fabric::tag::{self, Stream as TagStream};
use crate::message::Payload;
use actix::fut::wrap_future;

/// The lane's index.
const LANE: usize = 0;

/// The longest domain list accepted from a peer (bytes).
const MAX_HELLO: u32 = 64 << 10;

/// The most domains a list may name.
const MAX_DOMAINS: usize = 64;

/// Where the set-up stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
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
struct Link {
    ep: Addr<FabricEndpoint>,
    /// Posts straight into the endpoint's engine (from the attach on).
    poster: Option<Poster>,
    /// The peer endpoint's address (until attached).
    peer: Vec<u8>,
    pipe: Option<u32>,
    peer_pipe: u32,
    /// The tensor of each chunk posted, in post order (the endpoint ends them in that order).
    sends: VecDeque<HeldKey>,
    /// Same for receives, with the chunk's length.
    recvs: VecDeque<(HeldKey, usize)>,
    send_seq: u32,
    recv_seq: u32,
    /// Rendezvous only: how many receives the peer has posted on this link (its `recv_seq`,
    /// as it last told us), and our chunks that wait for theirs, each with its number.
    granted: u32,
    unsent: VecDeque<(u32, RegionOp)>,
}

impl Link {
    /// Posts the waiting chunks whose receives the peer has posted, in order (`scratch`: a
    /// list kept empty between calls).
    fn post_granted(&mut self, scratch: &mut Vec<RegionOp>) {
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
            // SAFETY: as in `efa_move`, which queued them: each region lies inside a tensor's
            // buffer held in `held` until the op ends; a failing channel empties `unsent` and
            // takes `pipe`, so nothing is posted after it has handed the buffers back.
            unsafe { poster.post_regions(pipe, scratch) };
            scratch.clear();
        }
    }
}

/// The channel's state on the fabric.
pub(super) struct Fabric {
    /// Our endpoints: the transport's domain first, then the further ones.
    eps: Vec<Addr<FabricEndpoint>>,
    /// What each said of itself (`None`: not yet, or it stopped: left out).
    infos: Vec<Option<EndpointInfo>>,
    /// Descriptions still awaited.
    describing: usize,
    step: Step,
    failed: Option<Error>,
    chunk: usize,
    /// The links, in stripe order (set once the peer's list is in).
    links: Vec<Link>,
    /// Attaches still out.
    attaching: usize,
    /// The next link whose peer pipe number is due.
    next_peer: usize,
    /// Tensors handed over before the set-up finished: (sending, seq, index, buffer).
    waiting: VecDeque<(bool, u64, u32, Memory)>,
    /// `efa_move`'s lists of ops, one per link, kept empty between tensors.
    posts: Vec<Vec<RegionOp>>,
    /// Whether in-place chunks wait for the peer's receives (the provider does not keep a large
    /// unexpected message: `fabric::keeps_unexpected`). Both sides decide alike: their
    /// transports' domains, which negotiation matched, name the provider as peers compare it.
    rendezvous: bool,
    /// `efa_move`'s rendezvous messages for the lane, kept empty between tensors.
    grants: Vec<Ack>,
}

impl Fabric {
    pub(super) fn new(port: ChannelPort) -> Fabric {
        let (eps, failed) = match port.endpoint {
            Ok(ep) => (std::iter::once(ep).chain(port.extra).collect(), None),
            Err(e) => (Vec::new(), Some(e)),
        };
        Fabric {
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
            grants: Vec::new(),
        }
    }

    /// Whether the actor must stay for the fabric's sake (an attach is under way: its pipe
    /// must be detached once it comes back).
    pub(super) fn busy(&self) -> bool {
        self.attaching > 0
    }
}

/// A link's ends, tagged with the link (pipe numbers of different endpoints may be equal).
struct LinkEnds {
    link: usize,
    rx: mpsc::UnboundedReceiver<Finished>,
}

/// One op's end on a link.
pub(super) struct LinkEnd(usize, Finished);

impl futures_core::Stream for LinkEnds {
    type Item = LinkEnd;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<LinkEnd>> {
        let link = self.link;
        self.rx.poll_recv(cx).map(|f| f.map(|f| LinkEnd(link, f)))
    }
}

/// Our domains' list for the hello: per domain, its fabric and endpoint address.
fn encode_domains(infos: &[&EndpointInfo]) -> Vec<u8> {
    let mut b = Vec::new();
    for i in infos {
        for part in [i.attributes.fabric.as_bytes(), &i.name] {
            b.extend_from_slice(&(part.len() as u16).to_le_bytes());
            b.extend_from_slice(part);
        }
    }
    b
}

/// The peer's list: (fabric, endpoint address) per domain; `None` if malformed.
fn decode_domains(mut b: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let take = |b: &mut &[u8]| -> Option<Vec<u8>> {
        let n = u16::from_le_bytes(b.get(..2)?.try_into().ok()?) as usize;
        let v = b.get(2..2 + n)?.to_vec();
        *b = &b[2 + n..];
        Some(v)
    };
    let mut out = Vec::new();
    while !b.is_empty() {
        let fabric = String::from_utf8(take(&mut b)?).ok()?;
        let name = take(&mut b)?;
        if name.is_empty() || out.len() == MAX_DOMAINS {
            return None;
        }
        out.push((fabric, name));
    }
    (!out.is_empty()).then_some(out)
}

impl Channel {
    fn fabric(&mut self) -> &mut Fabric {
        self.fabric
            .as_mut()
            .expect("an efa channel has its fabric state")
    }

    /// Starts the set-up (from `started`): every endpoint describes itself.
    pub(super) fn efa_start(&mut self, ctx: &mut Context<Self>) {
        let eps = self.fabric().eps.clone();
        self.fabric().describing = eps.len();
        for (i, ep) in eps.into_iter().enumerate() {
            let ask = ep.send(FabricDescribe);
            ctx.spawn(wrap_future::<_, Self>(ask).map(move |r, act, ctx| {
                let f = act.fabric();
                f.describing -= 1;
                match r {
                    Ok(info) => f.infos[i] = Some(info),
                    // The transport's own endpoint is needed; a further one is left out.
                    Err(_) if i == 0 => return act.efa_fail(gone(&act.origin), ctx),
                    Err(_) => {}
                }
                if act.fabric().describing == 0 {
                    act.efa_described(ctx);
                }
            }));
        }
    }

    /// Every endpoint has answered: our hello goes out.
    fn efa_described(&mut self, ctx: &mut Context<Self>) {
        let f = self.fabric();
        if f.failed.is_some() {
            return;
        }
        // Endpoints that stopped before answering are left out (the first cannot be).
        let mut kept = Vec::new();
        let mut infos = Vec::new();
        for (ep, info) in f.eps.drain(..).zip(f.infos.drain(..)) {
            if let Some(info) = info {
                let max = usize::try_from(info.attributes.max_msg_size).unwrap_or(usize::MAX);
                f.chunk = f.chunk.min(max).max(1);
                kept.push(ep);
                infos.push(Some(info));
            }
        }
        f.eps = kept;
        f.infos = infos;
        f.rendezvous = f.infos.iter().flatten().any(|i| {
            let provider = &i.attributes.provider;
            !crate::fabric::keeps_unexpected(provider)
        });
        f.step = Step::Hello;
        let list = encode_domains(&f.infos.iter().flatten().collect::<Vec<_>>());
        let hello = Ack {
            seq: f.chunk as u64,
            tensor: list.len() as u32,
            ok: true,
        };
        self.lane_write_ack(LANE, hello, vec![Payload::new(list)]);
        self.lane_read_frame(LANE);
        // The lane's ends come on the own queue, which the hello may have just made: poll it
        // now. (Until 2026-11-27 this was left to the next handler that polls it, a tensor
        // handed over by the pipe: a tensor handed over before the endpoints had described
        // themselves came too early for that, and the set-up waited for ever.)
        self.poll_own(ctx);
    }

    /// A completion from the lane.
    pub(super) fn efa_lane(&mut self, d: Done, ctx: &mut Context<Self>) {
        if self.fabric().failed.is_some() {
            return;
        }
        let step = self.fabric().step;
        let bad = |what: &str, origin: &Origin| {
            Error::protocol(format!("efa channel set-up: {what}"), origin)
        };
        match (d, step) {
            (Done::Wrote { result: Err(e), .. }, _) => self.efa_fail(e, ctx),
            (Done::Wrote { .. }, _) => {}
            (
                Done::Frame {
                    result: Ok(Frame::Ack(a)),
                    ..
                },
                Step::Hello,
            ) => {
                if a.tensor == 0 || a.tensor > MAX_HELLO || a.seq == 0 {
                    let e = bad("a malformed hello", &self.origin);
                    return self.efa_fail(e, ctx);
                }
                let f = self.fabric();
                f.chunk = f.chunk.min(usize::try_from(a.seq).unwrap_or(usize::MAX));
                f.step = Step::Name;
                let reply = self.own();
                let l = &mut self.lanes[LANE];
                let ticket = l.in_ticket;
                l.in_ticket += 1;
                l.link.read(
                    InOp::Payloads {
                        ticket,
                        buffers: vec![vec![0; a.tensor as usize]],
                        reply,
                    },
                    lane_gone,
                );
            }
            (
                Done::Payloads {
                    result: Ok(()),
                    mut buffers,
                    ..
                },
                Step::Name,
            ) => {
                let Some(theirs) = decode_domains(&buffers.pop().unwrap_or_default()) else {
                    let e = bad("a malformed domain list", &self.origin);
                    return self.efa_fail(e, ctx);
                };
                self.efa_attach(theirs, ctx);
            }
            (
                Done::Frame {
                    result: Ok(Frame::Ack(a)),
                    ..
                },
                Step::PeerPipe,
            ) => {
                let f = self.fabric();
                let pipe = u32::try_from(a.seq).ok().filter(|p| *p <= tag::MAX_PIPE);
                let (Some(p), true) = (pipe, a.tensor as usize == f.next_peer) else {
                    let e = bad("a pipe number out of range or order", &self.origin);
                    return self.efa_fail(e, ctx);
                };
                f.links[f.next_peer].peer_pipe = p;
                f.next_peer += 1;
                if f.next_peer < f.links.len() {
                    return self.lane_read_frame(LANE);
                }
                f.step = Step::Ready;
                // The read that tells when the lane ends.
                self.lane_read_frame(LANE);
                while let Some((sending, seq, index, buffer)) = self.fabric().waiting.pop_front() {
                    self.efa_move(sending, seq, index, buffer, ctx);
                }
            }
            (Done::Frame { result: Err(e), .. } | Done::Payloads { result: Err(e), .. }, _) => {
                self.efa_fail(e, ctx)
            }
            (
                Done::Frame {
                    result: Ok(Frame::Ack(a)),
                    ..
                },
                Step::Ready,
            ) if self.fabric().rendezvous => {
                // The peer has posted receives on link `a.tensor` up to `a.seq`.
                let f = self.fabric();
                let (Some(l), Ok(seq)) = (f.links.get_mut(a.tensor as usize), u32::try_from(a.seq))
                else {
                    let e = bad("a rendezvous for no link", &self.origin);
                    return self.efa_fail(e, ctx);
                };
                // A count of receives posted only grows (wrapping at 2^32).
                if (seq.wrapping_sub(l.granted) as i32) < 0 {
                    let e = bad("a rendezvous count that went back", &self.origin);
                    return self.efa_fail(e, ctx);
                }
                l.granted = seq;
                // `efa_move`'s first list (empty between tensors) as the scratch list.
                let mut scratch = std::mem::take(&mut f.posts);
                if scratch.is_empty() {
                    scratch.push(Vec::new());
                }
                l.post_granted(&mut scratch[0]);
                f.posts = scratch;
                self.lane_read_frame(LANE);
            }
            (Done::Frame { result: Ok(_), .. }, Step::Ready) => {
                let e = Error::Closed {
                    reason: "the peer's efa channel connection ended".into(),
                    origin: self.origin.clone(),
                };
                self.efa_fail(e, ctx)
            }
            (other, _) => {
                tracing::debug!(?other, "efa channel: unexpected lane completion");
                let e = bad("an unexpected frame from the peer", &self.origin);
                self.efa_fail(e, ctx)
            }
        }
    }

    /// Pairs our domains with the peer's (`theirs`: fabric and address each) and attaches a
    /// pipe on each pair's endpoint.
    fn efa_attach(&mut self, theirs: Vec<(String, Vec<u8>)>, ctx: &mut Context<Self>) {
        let f = self.fabric();
        let ours: Vec<String> = f
            .infos
            .iter()
            .flatten()
            .map(|i| i.attributes.fabric.clone())
            .collect();
        let fabrics: Vec<String> = theirs.iter().map(|(fabric, _)| fabric.clone()).collect();
        f.links = pair_domains(&ours, &fabrics)
            .into_iter()
            .map(|(i, j)| Link {
                ep: f.eps[i].clone(),
                poster: None,
                peer: theirs[j].1.clone(),
                pipe: None,
                peer_pipe: 0,
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                send_seq: 0,
                recv_seq: 0,
                granted: 0,
                unsent: VecDeque::new(),
            })
            .collect();
        f.step = Step::Attaching;
        f.attaching = f.links.len();
        for k in 0..f.links.len() {
            let f = self.fabric();
            let (sink, rx) = mpsc::unbounded_channel();
            ctx.add_stream(LinkEnds { link: k, rx });
            let l = &mut f.links[k];
            let attach = l.ep.send(FabricAttach {
                peer: std::mem::take(&mut l.peer),
                sink,
            });
            let share = l.ep.send(FabricShare);
            let ask = async move {
                let pipe = attach.await?;
                let poster = share.await?;
                Ok::<_, MailboxError>(pipe.map(|p| (p, poster)))
            };
            ctx.spawn(wrap_future::<_, Self>(ask).map(move |r, act, ctx| {
                act.fabric().attaching -= 1;
                match r {
                    Ok(Ok((pipe, poster))) => {
                        let l = &mut act.fabric().links[k];
                        l.pipe = Some(pipe);
                        l.poster = Some(poster);
                    }
                    Ok(Err(e)) => act.efa_fail(e, ctx),
                    Err(_) => act.efa_fail(gone(&act.origin), ctx),
                }
                if act.fabric().attaching == 0 {
                    act.efa_attached(ctx);
                }
                act.maybe_stop(ctx);
            }));
        }
    }

    /// Every attach has answered: our pipe numbers go out (or, after a failure, the pipes are
    /// detached).
    fn efa_attached(&mut self, ctx: &mut Context<Self>) {
        let stop = self.stopping;
        let f = self.fabric();
        f.step = Step::PeerPipe;
        if stop || f.failed.is_some() {
            let e = f.failed.clone().unwrap_or_else(|| stopping(&self.origin));
            return self.efa_fail(e, ctx);
        }
        let pipes: Vec<Option<u32>> = f.links.iter().map(|l| l.pipe).collect();
        for (k, pipe) in pipes.into_iter().enumerate() {
            let ack = Ack {
                seq: pipe.unwrap_or_default() as u64,
                tensor: k as u32,
                ok: true,
            };
            self.lane_write_ack(LANE, ack, Vec::new());
        }
        self.lane_read_frame(LANE);
        self.poll_own(ctx);
    }

    /// Sends (`sending`) or receives a tensor: now if the set-up is done, else later.
    pub(super) fn efa_tensor(
        &mut self,
        sending: bool,
        seq: u64,
        index: u32,
        buffer: Memory,
        ctx: &mut Context<Self>,
    ) {
        let f = self.fabric();
        if let Some(e) = f.failed.clone() {
            return self.hand_back(sending, seq, index, buffer, Err(e));
        }
        if f.step != Step::Ready {
            f.waiting.push_back((sending, seq, index, buffer));
            return;
        }
        self.efa_move(sending, seq, index, buffer, ctx);
    }

    /// A tensor to receive in place: its channel data must give its length (an inline one's is
    /// empty, and the pipe reads it itself).
    pub(super) fn efa_recv(&mut self, m: RecvTensor, ctx: &mut Context<Self>) {
        if let Err(e) = self.check_length(&m, "efa") {
            return self.hand_back(false, m.seq, m.index, Memory::Owned(m.buffer), Err(e));
        }
        self.efa_tensor(false, m.seq, m.index, Memory::Owned(m.buffer), ctx)
    }

    /// Posts a tensor's chunks, straight from or into its buffer, which stays in `held` until
    /// every chunk has ended: stripe `k` of mpt's plan on link `k`, chunked.
    fn efa_move(
        &mut self,
        sending: bool,
        seq: u64,
        index: u32,
        mut buffer: Memory,
        ctx: &mut Context<Self>,
    ) {
        let key = (sending, seq, index);
        let len = buffer.len();
        // Shared bytes come only with `sending`: they are sent from, never received into.
        let base = buffer.base_ptr() as usize;
        let f = self.fabric.as_mut().expect("efa state");
        let ready = !f.links.is_empty()
            && f.links
                .iter()
                .all(|l| l.pipe.is_some() && l.poster.is_some() && l.ep.connected());
        if !ready {
            let e = f.failed.clone().unwrap_or_else(|| gone(&self.origin));
            return self.hand_back(sending, seq, index, buffer, Err(e));
        }
        // One list of ops per link, reused from tensor to tensor (no allocation per tensor).
        let mut posts = std::mem::take(&mut f.posts);
        posts.resize_with(f.links.len(), Vec::new);
        let stripes = crate::channel::mpt::stripes(len as u64, f.links.len() as u32);
        for (k, start, n) in stripes {
            let l = &mut f.links[k as usize];
            let start = start as usize;
            for (offset, n) in crate::channel::efa::chunks(n as usize, f.chunk) {
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
        self.hold(key, buffer, out);
        let f = self.fabric();
        let rendezvous = f.rendezvous;
        let mut grants = std::mem::take(&mut f.grants);
        for (k, (l, ops)) in f.links.iter_mut().zip(&mut posts).enumerate() {
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
            if rendezvous && !sending && !ops.is_empty() {
                // After the receives below: the peer sends into them once it hears.
                let grant = Ack {
                    seq: l.recv_seq as u64,
                    tensor: k as u32,
                    ok: true,
                };
                grants.push(grant);
            }
            if !ops.is_empty() {
                // SAFETY: every region lies inside the tensor's buffer (the stripes and their
                // chunks are disjoint ranges of it), whose heap memory stays in `self.held`,
                // untouched, until each op has ended (`efa_finished` counts them down;
                // `release` waits for zero; a failing channel hands back a stand-in and leaves
                // the buffer with the endpoints; a channel torn down with ops out forgets the
                // buffer rather than free it).
                unsafe { poster.post_regions(pipe, ops) };
                ops.clear();
            }
        }
        f.posts = posts;
        for grant in grants.drain(..) {
            self.lane_write_ack(LANE, grant, Vec::new());
        }
        self.fabric().grants = grants;
        self.maybe_stop(ctx);
    }

    /// One chunk ended on link `link` (from that endpoint's queue for our pipe, in post order).
    pub(super) fn efa_finished(&mut self, link: usize, done: Finished, ctx: &mut Context<Self>) {
        // The origin is borrowed, not cloned: only an error needs it.
        let origin = &self.origin;
        let f = self.fabric.as_mut().expect("efa state");
        let Some(l) = f.links.get_mut(link) else {
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
            (Err(e), _) => Err(f.failed.clone().unwrap_or_else(|| chunk_error(e, origin))),
            // Short or long chunks: the two sides cut differently, and every later tag is off.
            (Ok(n), Some(w)) if n != w => Err(Error::protocol(
                format!("efa channel: a chunk of {n} bytes arrived where {w} were expected"),
                origin,
            )),
            (Ok(_), _) => Ok(()),
        };
        if let Err(e) = &result {
            // The endpoint failed the pipe's other ops too; the channel fails as a whole.
            self.efa_fail(e.clone(), ctx);
        }
        self.piece_done(key, result);
        self.maybe_stop(ctx);
    }

    /// Fails the channel: waiting tensors go back with `e` now, and so do held ones: the pipes
    /// are detached from their endpoints (their ops end with the error, in order), but a posted
    /// op the provider cannot take back (a send to a dead peer) may hold its memory until the
    /// endpoint closes. So a held tensor goes back as a copy (a send's bytes; a receive's,
    /// which failed anyway, as zeros), and its own buffer is left with the endpoints
    /// (`FabricQuarantine`, shared by every link's), dropped once each has let go of it. Later
    /// tensors fail at once.
    pub(super) fn efa_fail(&mut self, e: Error, ctx: &mut Context<Self>) {
        let f = self.fabric();
        if f.failed.is_none() {
            f.failed = Some(e.clone());
        }
        let waiting = std::mem::take(&mut f.waiting);
        // Chunks that wait for the peer's receives are never posted.
        for l in &mut f.links {
            l.unsent.clear();
        }
        let detach: Vec<(u32, Addr<FabricEndpoint>)> = f
            .links
            .iter_mut()
            .filter_map(|l| Some((l.pipe.take()?, l.ep.clone())))
            .collect();
        for (sending, seq, index, buffer) in waiting {
            self.hand_back(sending, seq, index, buffer, Err(e.clone()));
        }
        if detach.is_empty() {
            return self.maybe_stop(ctx);
        }
        for (pipe, ep) in &detach {
            ep.do_send(FabricDetach {
                pipe: *pipe,
                reason: e.to_string(),
            });
        }
        let keys: Vec<HeldKey> = self.held.keys().copied().collect();
        let mut originals = Vec::new();
        for k in keys {
            if let Some(h) = self.held.get_mut(&k).filter(|h| h.out > 0) {
                let stand_in = match &h.buffer {
                    Memory::Shared(b) => Memory::Shared(b.clone()),
                    m if h.sending => Memory::Owned(m.as_slice().to_vec()),
                    m => Memory::Owned(vec![0; m.len()]),
                };
                originals.push(std::mem::replace(&mut h.buffer, stand_in));
                h.out = 0;
                h.error.get_or_insert(e.clone());
            }
            self.release(k);
        }
        if !originals.is_empty() {
            let kept = Arc::new(Mutex::new(originals));
            for (pipe, ep) in detach {
                ep.do_send(FabricQuarantine {
                    pipe,
                    buffers: kept.clone(),
                });
            }
        }
        self.maybe_stop(ctx);
    }

    /// `StopChannel` for an efa channel: anything still out is failed through the endpoints.
    pub(super) fn efa_stop(&mut self, ctx: &mut Context<Self>) {
        self.shutdown_lanes();
        let e = self
            .fabric()
            .failed
            .clone()
            .unwrap_or_else(|| stopping(&self.origin));
        // While attaches are under way, their answers see `failed` and detach the pipes.
        self.efa_fail(e, ctx);
    }
}

impl StreamHandler<LinkEnd> for Channel {
    fn handle(&mut self, LinkEnd(link, f): LinkEnd, ctx: &mut Self::Context) {
        self.efa_finished(link, f, ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

/// A chunk's failure as the pipe's error: a connection to the peer that the provider found
/// lost (`tcp;ofi_rxm` reports a dead peer as `ENOTCONN`, `ECONNRESET`, or `ECANCELED` with
/// "not connected" in its own text; `shm` as `EIO`, its answer when the cross-memory copy
/// to or from the peer's process fails, which for buffers the runtime holds means that process
/// is gone) is `PeerClosed`, as on every other backend; anything else is an I/O error naming
/// the provider. The provider's text stays in the reason either way.
fn chunk_error(e: crate::fabric::FabricError, origin: &Origin) -> Error {
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
    fabric_error(e, origin)
}

fn gone(origin: &Origin) -> Error {
    Error::Closed {
        reason: "the fabric endpoint actor stopped".into(),
        origin: origin.clone(),
    }
}

fn stopping(origin: &Origin) -> Error {
    Error::Closed {
        reason: "channel stopping".into(),
        origin: origin.clone(),
    }
}
