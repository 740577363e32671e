//! The `efa` channel's driver (feature `efa`, see [`super`]): set-up over the channel's lane of
//! the data path ([`Path`]: tagged sends and receives posted on the
//! context's endpoint actor straight from and into the held buffers, chunked at the agreed
//! size), which the pipe then drives itself; the driver watches the lane, writes the
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

use actix::MailboxError;
use tokio::sync::mpsc;

use super::pair_domains;
use super::path::{gone, Link, Path, SharedPath, Step};
use crate::actors::hardware::efa::Poster;
use crate::actors::hardware::efa::{EndpointInfo, FabricAttach, FabricDescribe, FabricShare};
use crate::backend::efa::hello::{decode_domains, encode_domains, MAX_HELLO};
use crate::backend::efa::tag;
use crate::channel::driver::{Cx, Driver, ACKS};
use crate::error::{Error, Origin};
use crate::message::Payload;
use crate::transport::stream::Done;
use crate::wire::{Ack, Frame};

/// An efa channel's context.
type Ctx<'a> = Cx<'a, EfaEvent>;

/// The lane's index.
const LANE: usize = ACKS;

/// One pipe's `efa` channel: the data path it shares with the pipe, and the queue of
/// rendezvous grants the path leaves for the lane.
pub(crate) struct EfaDriver {
    path: SharedPath,
    grants: Option<mpsc::UnboundedReceiver<Ack>>,
}

/// What comes back to an efa channel.
pub(crate) enum EfaEvent {
    /// Endpoint `.0` described itself (or is gone).
    Described(usize, Result<EndpointInfo, MailboxError>),
    /// Link `.0`'s attach answered: its pipe number and poster, or why not.
    Attached(usize, Result<Result<(u32, Poster), Error>, MailboxError>),
    /// A rendezvous grant the path left for the lane.
    Grant(Ack),
}

/// The path's rendezvous grants, as events.
struct Grants(mpsc::UnboundedReceiver<Ack>);

impl futures_core::Stream for Grants {
    type Item = EfaEvent;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<EfaEvent>> {
        self.0.poll_recv(cx).map(|a| a.map(EfaEvent::Grant))
    }
}

impl EfaDriver {
    /// A channel over `port`, completing to `reply`; returns the data path the pipe shares
    /// with it ([`Path`]: the pipe hands it tensors and reads their ends).
    pub(crate) fn new(
        port: super::ChannelPort,
        reply: crate::transport::stream::Reply,
        origin: Origin,
    ) -> (EfaDriver, SharedPath) {
        let (path, grants) = Path::new(port, reply, origin);
        let d = EfaDriver {
            path: path.clone(),
            grants: Some(grants),
        };
        (d, path)
    }

    /// Every endpoint has answered: our hello goes out.
    fn described(&mut self, cx: &mut Ctx<'_>) {
        let path = self.path.clone();
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
        let ours: Vec<(&str, &[u8])> = (f.infos.iter().flatten())
            .map(|i| (i.attributes.fabric.as_str(), &i.name[..]))
            .collect();
        let list = encode_domains(&ours);
        let hello = Ack {
            seq: f.chunk as u64,
            tensor: list.len() as u32,
            ok: true,
        };
        drop(f);
        cx.core
            .lane_write_ack(LANE, hello, vec![Payload::new(list)]);
        cx.core.lane_read_frame(LANE);
    }

    /// A completion from the lane.
    fn lane(&mut self, d: Done, cx: &mut Ctx<'_>) {
        let path = self.path.clone();
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
            (Done::Wrote { result: Err(e), .. }, _) => self.fail(e),
            (Done::Wrote { .. }, _) => {}
            (
                Done::Frame {
                    result: Ok(Frame::Ack(a)),
                    ..
                },
                Step::Hello,
            ) => {
                if a.tensor == 0 || a.tensor > MAX_HELLO || a.seq == 0 {
                    return self.fail(bad("a malformed hello", &cx.core.origin));
                }
                {
                    let mut f = path.borrow_mut();
                    f.chunk = f.chunk.min(usize::try_from(a.seq).unwrap_or(usize::MAX));
                    f.step = Step::Name;
                }
                cx.core
                    .lane_read_payloads(LANE, vec![vec![0; a.tensor as usize]]);
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
                    return self.fail(bad("a malformed domain list", &cx.core.origin));
                };
                self.attach(theirs, cx);
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
                    let e = bad("a pipe number out of range or order", &cx.core.origin);
                    return self.fail(e);
                };
                let k = f.next_peer;
                f.links[k].peer_pipe = p;
                f.next_peer += 1;
                if f.next_peer < f.links.len() {
                    drop(f);
                    return cx.core.lane_read_frame(LANE);
                }
                // Tensors handed over meanwhile move now, in order.
                f.ready();
                drop(f);
                // The read that tells when the lane ends.
                cx.core.lane_read_frame(LANE);
            }
            (Done::Frame { result: Err(e), .. } | Done::Payloads { result: Err(e), .. }, _) => {
                self.fail(e)
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
                    return self.fail(bad(what, &cx.core.origin));
                }
                cx.core.lane_read_frame(LANE);
            }
            (Done::Frame { result: Ok(_), .. }, Step::Ready) => {
                let e = Error::Closed {
                    reason: "the peer's efa channel connection ended".into(),
                    origin: cx.core.origin.clone(),
                };
                self.fail(e)
            }
            (other, _) => {
                tracing::debug!(?other, "efa channel: unexpected lane completion");
                self.fail(bad("an unexpected frame from the peer", &cx.core.origin))
            }
        }
    }

    /// Pairs our domains with the peer's (`theirs`: fabric and address each) and attaches a
    /// pipe on each pair's endpoint.
    fn attach(&mut self, theirs: Vec<(String, Vec<u8>)>, cx: &mut Ctx<'_>) {
        let path = self.path.clone();
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
            cx.fx.spawn(Box::pin(async move {
                let answer = async {
                    let pipe = attach.await?;
                    let poster = share.await?;
                    Ok::<_, MailboxError>(pipe.map(|p| (p, poster)))
                };
                EfaEvent::Attached(k, answer.await)
            }));
        }
    }

    /// Link `k`'s attach answered.
    fn attached_one(
        &mut self,
        k: usize,
        r: Result<Result<(u32, Poster), Error>, MailboxError>,
        cx: &mut Ctx<'_>,
    ) {
        let path = self.path.clone();
        path.borrow_mut().attaching -= 1;
        match r {
            Ok(Ok((pipe, poster))) => {
                let l = &mut path.borrow_mut().links[k];
                l.pipe = Some(pipe);
                l.poster = Some(poster);
            }
            Ok(Err(e)) => self.fail(e),
            Err(_) => self.fail(gone(&cx.core.origin)),
        }
        if path.borrow().attaching == 0 {
            self.attached(cx);
        }
    }

    /// Every attach has answered: our pipe numbers go out (or, after a failure, the pipes are
    /// detached).
    fn attached(&mut self, cx: &mut Ctx<'_>) {
        let path = self.path.clone();
        let mut f = path.borrow_mut();
        f.step = Step::PeerPipe;
        // The endpoints count the channel's pipes now: the pipe may be handed out.
        f.attach_over();
        if cx.core.stopping || f.failed.is_some() {
            let e = f.failed.clone().unwrap_or_else(|| cx.core.stopping_error());
            drop(f);
            return self.fail(e);
        }
        let pipes: Vec<Option<u32>> = f.links.iter().map(|l| l.pipe).collect();
        drop(f);
        for (k, pipe) in pipes.into_iter().enumerate() {
            let ack = Ack {
                seq: pipe.unwrap_or_default() as u64,
                tensor: k as u32,
                ok: true,
            };
            cx.core.lane_write_ack(LANE, ack, Vec::new());
        }
        cx.core.lane_read_frame(LANE);
    }

    /// Fails the channel ([`Path::fail`]).
    fn fail(&mut self, e: Error) {
        self.path.borrow_mut().fail(e);
    }
}

impl Driver for EfaDriver {
    type Event = EfaEvent;

    /// Starts the set-up: every endpoint describes itself.
    fn start(&mut self, cx: &mut Ctx<'_>) {
        if let Some(grants) = self.grants.take() {
            cx.fx.watch(Box::pin(Grants(grants)));
        }
        let eps = self.path.borrow().eps.clone();
        self.path.borrow_mut().describing = eps.len();
        for (i, ep) in eps.into_iter().enumerate() {
            let ask = ep.send(FabricDescribe);
            cx.fx
                .spawn(Box::pin(async move { EfaEvent::Described(i, ask.await) }));
        }
    }

    fn on_done(&mut self, d: Done, cx: &mut Ctx<'_>) {
        self.lane(d, cx);
    }

    fn on_event(&mut self, e: EfaEvent, cx: &mut Ctx<'_>) {
        match e {
            EfaEvent::Described(i, r) => {
                let path = self.path.clone();
                let mut f = path.borrow_mut();
                f.describing -= 1;
                match r {
                    Ok(info) => f.infos[i] = Some(info),
                    // The transport's own endpoint is needed; a further one is left out.
                    Err(_) if i == 0 => {
                        drop(f);
                        return self.fail(gone(&cx.core.origin));
                    }
                    Err(_) => {}
                }
                if f.describing == 0 {
                    drop(f);
                    self.described(cx);
                }
            }
            EfaEvent::Attached(k, r) => self.attached_one(k, r, cx),
            EfaEvent::Grant(ack) => cx.core.lane_write_ack(LANE, ack, Vec::new()),
        }
    }

    /// Anything still out is failed through the endpoints.
    fn stop(&mut self, _: Error, cx: &mut Ctx<'_>) {
        cx.core.shutdown_lanes();
        let failed = self.path.borrow().failed.clone();
        let e = failed.unwrap_or_else(|| cx.core.stopping_error());
        // While attaches are under way, their answers see `failed` and detach the pipes.
        self.fail(e);
    }

    /// The channel stays for the path's sake while it holds tensors (see [`Path::busy`]).
    fn drained(&mut self, cx: &mut Ctx<'_>) -> bool {
        !self.path.borrow().busy() && cx.core.held.is_empty()
    }
}
