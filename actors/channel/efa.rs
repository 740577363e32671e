//! The `efa` side of the channel actor (feature `efa`, see [`crate::backend::efa::channel`]): set-up
//! over the channel's lane of the data path ([`Path`]: tagged sends and receives posted on the
//! context's endpoint actor straight from and into the held buffers, chunked at the agreed
//! size), which the pipe then drives itself; this actor watches the lane, writes the
//! rendezvous's words on it, and fails the path.
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

use std::pin::Pin;
use std::task::Poll;

use super::*;
use crate::actors::hardware::efa::{EndpointInfo, FabricAttach, FabricDescribe, FabricShare};
use crate::backend::efa::channel::pair_domains;
use crate::backend::efa::tag;
use crate::message::Payload;
use actix::fut::wrap_future;

mod path;
use path::{gone, Link, Step};
pub(crate) use path::{LinkEnd, Path, PathEnds, SharedPath};

/// The lane's index.
const LANE: usize = 0;

/// The longest domain list accepted from a peer (bytes).
const MAX_HELLO: u32 = 64 << 10;

/// The most domains a list may name.
const MAX_DOMAINS: usize = 64;

/// The channel actor's side of an `efa` channel: the data path it shares with the pipe, and
/// the queue of rendezvous grants the path leaves for the lane.
pub(super) struct EfaSide {
    path: SharedPath,
    grants: Option<mpsc::UnboundedReceiver<Ack>>,
}

impl EfaSide {
    pub(super) fn new(path: SharedPath, grants: mpsc::UnboundedReceiver<Ack>) -> EfaSide {
        EfaSide {
            path,
            grants: Some(grants),
        }
    }

    /// Whether the actor must stay for the path's sake (see [`Path::busy`]).
    pub(super) fn busy(&self) -> bool {
        self.path.borrow().busy()
    }
}

/// A rendezvous grant the path left for the lane.
struct Grant(Ack);

impl actix::Message for Grant {
    type Result = ();
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
    /// The data path (a handle: a borrow of it must end before the next call that borrows it).
    fn path(&self) -> SharedPath {
        self.fabric
            .as_ref()
            .expect("an efa channel has its fabric state")
            .path
            .clone()
    }

    /// Starts the set-up (from `started`): every endpoint describes itself.
    pub(super) fn efa_start(&mut self, ctx: &mut Context<Self>) {
        if let Some(grants) = self.fabric.as_mut().and_then(|s| s.grants.take()) {
            ctx.add_stream(Grants(grants));
        }
        let path = self.path();
        let eps = path.borrow().eps.clone();
        path.borrow_mut().describing = eps.len();
        for (i, ep) in eps.into_iter().enumerate() {
            let ask = ep.send(FabricDescribe);
            ctx.spawn(wrap_future::<_, Self>(ask).map(move |r, act, ctx| {
                let path = act.path();
                let mut f = path.borrow_mut();
                f.describing -= 1;
                match r {
                    Ok(info) => f.infos[i] = Some(info),
                    // The transport's own endpoint is needed; a further one is left out.
                    Err(_) if i == 0 => {
                        drop(f);
                        return act.efa_fail(gone(&act.origin), ctx);
                    }
                    Err(_) => {}
                }
                if f.describing == 0 {
                    drop(f);
                    act.efa_described(ctx);
                }
            }));
        }
    }

    /// Every endpoint has answered: our hello goes out.
    fn efa_described(&mut self, ctx: &mut Context<Self>) {
        let path = self.path();
        let mut f = path.borrow_mut();
        if f.failed.is_some() {
            return;
        }
        // Endpoints that stopped before answering are left out (the first cannot be).
        let mut kept = Vec::new();
        let mut infos = Vec::new();
        let (eps, all) = (std::mem::take(&mut f.eps), std::mem::take(&mut f.infos));
        for (ep, info) in eps.into_iter().zip(all) {
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
            !crate::backend::efa::keeps_unexpected(provider)
        });
        f.step = Step::Hello;
        let list = encode_domains(&f.infos.iter().flatten().collect::<Vec<_>>());
        let hello = Ack {
            seq: f.chunk as u64,
            tensor: list.len() as u32,
            ok: true,
        };
        drop(f);
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
        let path = self.path();
        let (failed, step, rendezvous) = {
            let f = path.borrow();
            (f.failed.is_some(), f.step, f.rendezvous)
        };
        if failed {
            return;
        }
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
                {
                    let mut f = path.borrow_mut();
                    f.chunk = f.chunk.min(usize::try_from(a.seq).unwrap_or(usize::MAX));
                    f.step = Step::Name;
                }
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
                let mut f = path.borrow_mut();
                let pipe = u32::try_from(a.seq).ok().filter(|p| *p <= tag::MAX_PIPE);
                let (Some(p), true) = (pipe, a.tensor as usize == f.next_peer) else {
                    drop(f);
                    let e = bad("a pipe number out of range or order", &self.origin);
                    return self.efa_fail(e, ctx);
                };
                let k = f.next_peer;
                f.links[k].peer_pipe = p;
                f.next_peer += 1;
                if f.next_peer < f.links.len() {
                    drop(f);
                    return self.lane_read_frame(LANE);
                }
                // Tensors handed over meanwhile move now, in order.
                f.ready();
                drop(f);
                // The read that tells when the lane ends.
                self.lane_read_frame(LANE);
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
            ) if rendezvous => {
                // The peer has posted receives on link `a.tensor` up to `a.seq`.
                let granted = {
                    let mut f = path.borrow_mut();
                    let f = &mut *f;
                    match (f.links.get_mut(a.tensor as usize), u32::try_from(a.seq)) {
                        // A count of receives posted only grows (wrapping at 2^32).
                        (Some(l), Ok(seq)) if (seq.wrapping_sub(l.granted) as i32) >= 0 => {
                            l.granted = seq;
                            // The path's first list of ops (empty between tensors) as the
                            // scratch list.
                            if f.posts.is_empty() {
                                f.posts.push(Vec::new());
                            }
                            l.post_granted(&mut f.posts[0]);
                            Ok(())
                        }
                        (Some(_), Ok(_)) => Err("a rendezvous count that went back"),
                        _ => Err("a rendezvous for no link"),
                    }
                };
                if let Err(what) = granted {
                    let e = bad(what, &self.origin);
                    return self.efa_fail(e, ctx);
                }
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
        let path = self.path();
        let mut f = path.borrow_mut();
        let ours: Vec<String> = f
            .infos
            .iter()
            .flatten()
            .map(|i| i.attributes.fabric.clone())
            .collect();
        let fabrics: Vec<String> = theirs.iter().map(|(fabric, _)| fabric.clone()).collect();
        f.links = pair_domains(&ours, &fabrics)
            .into_iter()
            .map(|(i, j)| Link::new(f.eps[i].clone(), theirs[j].1.clone()))
            .collect();
        f.step = Step::Attaching;
        f.attaching = f.links.len();
        for k in 0..f.links.len() {
            // The pipe reads the link's ends itself (`PathEnds`).
            let (sink, rx) = mpsc::unbounded_channel();
            f.add_ends(k, rx);
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
                let path = act.path();
                path.borrow_mut().attaching -= 1;
                match r {
                    Ok(Ok((pipe, poster))) => {
                        let l = &mut path.borrow_mut().links[k];
                        l.pipe = Some(pipe);
                        l.poster = Some(poster);
                    }
                    Ok(Err(e)) => act.efa_fail(e, ctx),
                    Err(_) => act.efa_fail(gone(&act.origin), ctx),
                }
                if path.borrow().attaching == 0 {
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
        let path = self.path();
        let mut f = path.borrow_mut();
        f.step = Step::PeerPipe;
        if stop || f.failed.is_some() {
            let e = f.failed.clone().unwrap_or_else(|| stopping(&self.origin));
            drop(f);
            return self.efa_fail(e, ctx);
        }
        let pipes: Vec<Option<u32>> = f.links.iter().map(|l| l.pipe).collect();
        drop(f);
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

    /// Fails the channel ([`Path::fail`]).
    pub(super) fn efa_fail(&mut self, e: Error, ctx: &mut Context<Self>) {
        self.path().borrow_mut().fail(e);
        self.maybe_stop(ctx);
    }

    /// `StopChannel` for an efa channel: anything still out is failed through the endpoints.
    pub(super) fn efa_stop(&mut self, ctx: &mut Context<Self>) {
        self.shutdown_lanes();
        let failed = self.path().borrow().failed.clone();
        let e = failed.unwrap_or_else(|| stopping(&self.origin));
        // While attaches are under way, their answers see `failed` and detach the pipes.
        self.efa_fail(e, ctx);
    }
}

impl StreamHandler<Grant> for Channel {
    fn handle(&mut self, Grant(ack): Grant, _: &mut Self::Context) {
        self.lane_write_ack(LANE, ack, Vec::new());
    }

    fn finished(&mut self, _: &mut Self::Context) {}
}

/// The path's rendezvous grants, as a stream of the channel actor's.
struct Grants(mpsc::UnboundedReceiver<Ack>);

impl futures_core::Stream for Grants {
    type Item = Grant;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<Grant>> {
        self.0.poll_recv(cx).map(|a| a.map(Grant))
    }
}

fn stopping(origin: &Origin) -> Error {
    Error::Closed {
        reason: "channel stopping".into(),
        origin: origin.clone(),
    }
}
