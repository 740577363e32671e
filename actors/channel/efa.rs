//! The `efa` side of the channel actor (feature `efa`, see [`crate::channel::efa`]): set-up
//! over the channel's lane, then tagged sends and receives posted on the context's endpoint
//! actor straight from and into the held buffers, chunked at the agreed size.
//!
//! Set-up on the lane, both sides at once (neither waits for the other before writing):
//!
//! ```text
//! Ack{seq: our chunk limit, tensor: address length, ok} + our endpoint address   ───►
//!   (the peer's address goes into our AV: FabricAttach gives our pipe number)
//! Ack{seq: our pipe number, tensor: 0, ok}                                       ───►
//! ```
//!
//! (Two `Ack` frames, so the wire format has no frame kind for this channel alone.) Tensors the
//! pipe hands over before the set-up is done wait, in order. The lane then stays open with one
//! read posted: its end, or a failed set-up, fails every pending operation in order
//! (`FabricDetach`) and every later one at once.

use std::collections::VecDeque;

use super::*;
use crate::actors::fabric::{
    fabric_error, EndpointInfo, FabricAttach, FabricDescribe, FabricDetach, FabricEndpoint,
    FabricPostRegions, FabricQuarantine, RegionOp,
};
use crate::channel::efa::ChannelPort;
use crate::fabric::engine::{Finished, Kind, Region};
use crate::fabric::tag::{self, Stream as TagStream};
use crate::message::Payload;
use actix::fut::wrap_future;

/// The lane's index.
const LANE: usize = 0;

/// The longest endpoint address accepted from a peer.
const MAX_NAME: u32 = 1024;

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

/// The channel's state on the fabric.
pub(super) struct Fabric {
    ep: Option<Addr<FabricEndpoint>>,
    step: Step,
    failed: Option<Error>,
    chunk: usize,
    name: Vec<u8>,
    pipe: Option<u32>,
    peer_pipe: u32,
    /// Tensors handed over before the set-up finished: (sending, seq, index, buffer).
    waiting: VecDeque<(bool, u64, u32, Memory)>,
    /// The tensor of each chunk posted, in post order (the endpoint ends them in that order).
    sends: VecDeque<HeldKey>,
    /// Same for receives, with the chunk's length.
    recvs: VecDeque<(HeldKey, usize)>,
    send_seq: u32,
    recv_seq: u32,
}

impl Fabric {
    pub(super) fn new(port: ChannelPort) -> Fabric {
        let (ep, failed) = match port.endpoint {
            Ok(ep) => (Some(ep), None),
            Err(e) => (None, Some(e)),
        };
        Fabric {
            ep,
            step: Step::Describing,
            failed,
            chunk: port.max_message.max(1),
            name: Vec::new(),
            pipe: None,
            peer_pipe: 0,
            waiting: VecDeque::new(),
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            send_seq: 0,
            recv_seq: 0,
        }
    }

    /// Whether the actor must stay for the fabric's sake (an attach is under way: its pipe
    /// must be detached once it comes back).
    pub(super) fn busy(&self) -> bool {
        self.step == Step::Attaching
    }
}

impl Channel {
    fn fabric(&mut self) -> &mut Fabric {
        self.fabric
            .as_mut()
            .expect("an efa channel has its fabric state")
    }

    /// Starts the set-up (from `started`).
    pub(super) fn efa_start(&mut self, ctx: &mut Context<Self>) {
        let Some(ep) = self.fabric().ep.clone() else {
            return;
        };
        let ask = ep.send(FabricDescribe);
        ctx.spawn(wrap_future::<_, Self>(ask).map(|r, act, ctx| match r {
            Ok(info) => act.efa_described(info),
            Err(_) => act.efa_fail(gone(&act.origin), ctx),
        }));
    }

    fn efa_described(&mut self, info: EndpointInfo) {
        let max = usize::try_from(info.attributes.max_msg_size).unwrap_or(usize::MAX);
        let f = self.fabric();
        if f.failed.is_some() {
            return;
        }
        f.chunk = f.chunk.min(max).max(1);
        f.name = info.name.clone();
        f.step = Step::Hello;
        let hello = Ack {
            seq: f.chunk as u64,
            tensor: info.name.len() as u32,
            ok: true,
        };
        self.lane_write_ack(LANE, hello, vec![Payload::new(info.name)]);
        self.lane_read_frame(LANE);
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
                if a.tensor == 0 || a.tensor > MAX_NAME || a.seq == 0 {
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
                let peer = buffers.pop().unwrap_or_default();
                self.efa_attach(peer, ctx);
            }
            (
                Done::Frame {
                    result: Ok(Frame::Ack(a)),
                    ..
                },
                Step::PeerPipe,
            ) => {
                let Ok(p) = u32::try_from(a.seq).map_err(drop).and_then(|p| {
                    if p <= tag::MAX_PIPE {
                        Ok(p)
                    } else {
                        Err(())
                    }
                }) else {
                    let e = bad("a pipe number out of range", &self.origin);
                    return self.efa_fail(e, ctx);
                };
                let f = self.fabric();
                f.peer_pipe = p;
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

    fn efa_attach(&mut self, peer: Vec<u8>, ctx: &mut Context<Self>) {
        let Some(ep) = self.fabric().ep.clone() else {
            return;
        };
        self.fabric().step = Step::Attaching;
        let (sink, ends) = mpsc::unbounded_channel();
        ctx.add_stream(Queue(ends));
        let ask = ep.send(FabricAttach { peer, sink });
        ctx.spawn(wrap_future::<_, Self>(ask).map(|r, act, ctx| {
            act.fabric().step = Step::PeerPipe;
            match r {
                Ok(Ok(pipe)) => {
                    act.fabric().pipe = Some(pipe);
                    if act.stopping || act.fabric().failed.is_some() {
                        let e = act
                            .fabric()
                            .failed
                            .clone()
                            .unwrap_or_else(|| stopping(&act.origin));
                        return act.efa_fail(e, ctx);
                    }
                    let ack = Ack {
                        seq: pipe as u64,
                        tensor: 0,
                        ok: true,
                    };
                    act.lane_write_ack(LANE, ack, Vec::new());
                    act.lane_read_frame(LANE);
                    act.poll_own(ctx);
                }
                Ok(Err(e)) => act.efa_fail(e, ctx),
                Err(_) => act.efa_fail(gone(&act.origin), ctx),
            }
            act.maybe_stop(ctx);
        }));
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

    fn hand_back(&self, sending: bool, seq: u64, index: u32, memory: Memory, r: Result<(), Error>) {
        self.to_pipe(if sending {
            Done::WroteTensor {
                seq,
                index,
                memory,
                result: r,
            }
        } else {
            Done::Tensor {
                seq,
                index,
                memory,
                result: r,
            }
        });
    }

    /// Posts a tensor's chunks, straight from or into its buffer, which stays in `held` until
    /// every chunk has ended.
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
        let (Some(ep), Some(pipe)) = (f.ep.clone(), f.pipe) else {
            let e = f.failed.clone().unwrap_or_else(|| gone(&self.origin));
            return self.hand_back(sending, seq, index, buffer, Err(e));
        };
        if !ep.connected() {
            return self.hand_back(sending, seq, index, buffer, Err(gone(&self.origin)));
        }
        let mut ops = Vec::new();
        for (offset, n) in crate::channel::efa::chunks(len, f.chunk) {
            let (kind, t) = if sending {
                let t = tag::make(TagStream::Tensor, f.peer_pipe, f.send_seq);
                f.send_seq = f.send_seq.wrapping_add(1);
                f.sends.push_back(key);
                (Kind::Send, t)
            } else {
                let t = tag::make(TagStream::Tensor, pipe, f.recv_seq);
                f.recv_seq = f.recv_seq.wrapping_add(1);
                f.recvs.push_back((key, n));
                (Kind::Recv, t)
            };
            ops.push(RegionOp {
                kind,
                tag: t,
                region: Region {
                    base,
                    buffer_len: len,
                    offset,
                    len: n,
                },
                id: seq,
            });
        }
        let out = ops.len();
        self.hold(key, buffer, out);
        if out > 0 {
            // SAFETY: every region lies inside the tensor's buffer, whose heap memory stays in
            // `self.held`, untouched, until each op has ended (`efa_finished` counts them down;
            // `release` waits for zero; a failing channel hands back a stand-in and leaves the
            // buffer with the endpoint; a channel torn down with ops out forgets the buffer
            // rather than free it).
            ep.do_send(unsafe { FabricPostRegions::new(pipe, ops) });
        }
        self.maybe_stop(ctx);
    }

    /// One chunk ended (from the endpoint's queue for our pipe, in post order).
    pub(super) fn efa_finished(&mut self, done: Finished, ctx: &mut Context<Self>) {
        let origin = self.origin.clone();
        let f = self.fabric();
        let (key, want) = match done.kind {
            Kind::Send => (f.sends.pop_front(), None),
            Kind::Recv => match f.recvs.pop_front() {
                Some((k, n)) => (Some(k), Some(n)),
                None => (None, None),
            },
        };
        let Some(key) = key else {
            return tracing::warn!("efa channel: an end for no posted chunk");
        };
        let result = match (done.result, want) {
            // Once the channel has failed (and detached its pipe), its ops end with that error.
            (Err(e), _) => Err(f.failed.clone().unwrap_or_else(|| chunk_error(e, &origin))),
            // Short or long chunks: the two sides cut differently, and every later tag is off.
            (Ok(n), Some(w)) if n != w => Err(Error::protocol(
                format!("efa channel: a chunk of {n} bytes arrived where {w} were expected"),
                &origin,
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

    /// Fails the channel: waiting tensors go back with `e` now, and so do held ones: the pipe
    /// is detached from the endpoint (its ops end with the error, in order), but a posted op the
    /// provider cannot take back (a send to a dead peer) may hold its memory until the
    /// endpoint closes. So a held tensor goes back as a copy (a send's bytes; a receive's,
    /// which failed anyway, as zeros), and its own buffer is left with the endpoint
    /// (`FabricQuarantine`), which drops it once the provider has let go of it. Later tensors
    /// fail at once.
    pub(super) fn efa_fail(&mut self, e: Error, ctx: &mut Context<Self>) {
        let f = self.fabric();
        if f.failed.is_none() {
            f.failed = Some(e.clone());
        }
        let waiting = std::mem::take(&mut f.waiting);
        let detach = match (f.pipe.take(), &f.ep) {
            (Some(pipe), Some(ep)) => Some((pipe, ep.clone())),
            _ => None,
        };
        for (sending, seq, index, buffer) in waiting {
            self.hand_back(sending, seq, index, buffer, Err(e.clone()));
        }
        if let Some((pipe, ep)) = detach {
            ep.do_send(FabricDetach {
                pipe,
                reason: e.to_string(),
            });
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
                ep.do_send(FabricQuarantine {
                    pipe,
                    buffers: originals,
                });
            }
        }
        self.maybe_stop(ctx);
    }

    /// `StopChannel` for an efa channel: anything still out is failed through the endpoint.
    pub(super) fn efa_stop(&mut self, ctx: &mut Context<Self>) {
        self.shutdown_lanes();
        let e = self
            .fabric()
            .failed
            .clone()
            .unwrap_or_else(|| stopping(&self.origin));
        // While an attach is under way, its answer sees `failed` and detaches the pipe.
        self.efa_fail(e, ctx);
    }
}

impl StreamHandler<Finished> for Channel {
    fn handle(&mut self, f: Finished, ctx: &mut Self::Context) {
        self.efa_finished(f, ctx);
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
