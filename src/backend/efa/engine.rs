//! The endpoint engine: one libfabric endpoint shared by every pipe on its domain, with the
//! `-FI_EAGAIN` backlog, per-pipe ordered completions and fault injection. Plain synchronous
//! code: the endpoint actor (`actors/hardware/efa/mod.rs`) decides *when* to call [`Engine::progress`];
//! tests drive it in a loop.
//!
//! **Posting.** [`Engine::post`] tries the provider at once unless the pipe already has an op of
//! the same kind in the backlog (then it queues behind it: a pipe's sends reach the provider in
//! the order they were posted, and so do its receives; neither waits for the other). `-FI_EAGAIN` puts the op at the back of the FIFO backlog. [`Engine::progress`] reads
//! the completion queue, then retries the backlog front to back; a pipe whose retry is refused
//! again is skipped for the rest of that pass, so none of its later ops overtakes it, while other
//! pipes' ops still go. A send of 1 byte up to the provider's inject size goes out with
//! `fi_tinject` instead of `fi_tsend`: the provider copies it at once and no completion follows,
//! so the op is done when the post returns (still handed out in its pipe's order).
//!
//! **Errors.** Any other post error, and any error completion, fails the pipe: its backlogged ops
//! fail at once, its posted ones are cancelled (`fi_cancel`), and every op of the pipe not
//! already finished completes with that error. Other pipes carry on.
//!
//! **A gone peer.** [`Engine::refuse_sends`] makes a pipe's sends, backlogged and later ones,
//! end with its error without reaching the provider, while its receives carry on (a peer that
//! died: nothing sent to it can arrive).
//!
//! **Order.** Each pipe has two queues, sends and receives, in post order. An op's result is
//! handed out ([`Finished`]) only when every earlier op of the same queue has been, so a pipe
//! sees its completions in the order it posted, errors included, whatever order the provider
//! completes them in.
//!
//! **Receive limits.** The provider takes at most `rx_size` receives at once (`shm`: 1,024;
//! past that `fi_trecv` fails with `-FI_ENOMEM`). The engine counts the receives it has posted
//! and keeps any beyond the limit in the backlog, as it does a post refused with `-FI_EAGAIN`
//! (an `-FI_ENOMEM` from `fi_trecv` is taken the same way): a full receive queue delays a
//! receive, it never fails a pipe.
//!
//! **Shared receives (the inbox).** Where the provider keeps unexpected messages of any size
//! ([`super::keeps_unexpected`]) the efa stream's messages do not need receives of their own
//! per pipe: [`Engine::set_inbox`] gives the endpoint a pool of receives that match any
//! control-stream message from any peer (the tag's pipe and sequence bits ignored), posted
//! once the first pipe asks for it ([`Engine::use_inbox`]). A message that lands in one is
//! handed to the pipe its tag names, as a receive's [`Finished`] whose `id` is the message's
//! sequence number, in the order the messages complete (the stream puts them in sequence),
//! and the receive goes back to the provider at once with a spare buffer
//! ([`Engine::recycle_inbox`] returns the ones the readers are done with). So the receives an
//! endpoint holds for its streams are the inbox's, whatever the number of pipes: what a
//! verbs shared receive queue does. A message for no such pipe is dropped (`Stats::stray`). A
//! pipe of the inbox that fails gets one receive end with the error (`id` `u64::MAX`), since
//! it has no receive of its own to carry it.
//!
//! **Memory.** Each op owns its buffer (`Vec<u8>`) from post to [`Finished`]; the provider may
//! touch it only in between. Context pointers point into boxed slots that are recycled, so
//! steady state allocates nothing per op. The engine drops its endpoint before its slots, so
//! memory is released only once the provider can no longer reach it.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;

#[cfg(feature = "faults")]
use super::eio;
#[cfg(feature = "faults")]
use super::faults::{Dice, Faults};
use super::regcache::RegCache;
use super::tag;
use super::{Attributes, Completion, Endpoint, FabricError, FiAddr, Mr, PostError};
use crate::keymap::KeyMap;

/// Which way an op moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A tagged send of the whole buffer.
    Send,
    /// A tagged receive into the buffer (at most its length).
    Recv,
}

/// One operation handed to the engine.
#[derive(Debug)]
pub struct Op {
    /// Send or receive.
    pub kind: Kind,
    /// The tag (see [`super::tag`]).
    pub tag: u64,
    /// The bytes to send, or the room to receive into; handed back in [`Finished`].
    pub mem: Vec<u8>,
    /// The caller's number for it, handed back.
    pub id: u64,
}

/// Caller memory an op moves in place (the `efa` channel): `len` bytes at `base + offset`,
/// inside the buffer of `buffer_len` bytes at `base` (the unit of registration, see
/// [`super::regcache`]). Addresses as integers, so that ops can travel in actor messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The whole buffer's address.
    pub base: usize,
    /// The whole buffer's length.
    pub buffer_len: usize,
    /// Where the op's bytes start within the buffer.
    pub offset: usize,
    /// How many bytes the op moves.
    pub len: usize,
}

/// Where an RMA op ([`Engine::post_rma`]) reaches into its peer's memory: `addr` of the
/// peer's registration `key` (its virtual address, or its offset in the registration where
/// the provider lacks `FI_MR_VIRT_ADDR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rma {
    /// Write the op's region there (else read from there into it).
    pub write: bool,
    /// The target address.
    pub addr: u64,
    /// The target registration's key.
    pub key: u64,
}

/// An operation's end, in the pipe's order.
#[derive(Debug)]
pub struct Finished {
    /// The pipe it belongs to.
    pub pipe: u32,
    /// The caller's number.
    pub id: u64,
    /// Send or receive.
    pub kind: Kind,
    /// The tag it was posted with; for a receive that completed, with the credits its message
    /// carried in its remote CQ data in the credits field ([`super::tag::received`]).
    pub tag: u64,
    /// The buffer, back (empty for an op posted with [`Engine::post_region`]).
    pub mem: Vec<u8>,
    /// Bytes received (receives), or sent.
    pub result: Result<usize, FabricError>,
}

/// Counters of one engine (one endpoint).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Posts the provider accepted.
    pub posted: u64,
    /// `-FI_EAGAIN` answers (injected ones included).
    pub eagain: u64,
    /// Completions read from the CQ.
    pub completions: u64,
    /// Sends that went out as injects (`fi_tinject`, no completion to read); counted in
    /// `posted` too.
    pub injected: u64,
    /// Of those, sends injected straight from the caller's bytes, with no op and no end
    /// ([`Engine::inject`]: the efa stream's small messages).
    pub direct: u64,
    /// Errors: failed posts and error completions.
    pub errors: u64,
    /// Ops in the backlog now.
    pub backlog: usize,
    /// The largest backlog seen.
    pub backlog_max: usize,
    /// Ops posted to the provider and not completed.
    pub in_flight: usize,
    /// Pipes attached.
    pub pipes: usize,
    /// Memory registrations made for in-place ops (`fi_mr_reg` calls).
    pub registrations: u64,
    /// Buffers registered now.
    pub registered: usize,
    /// Bytes moved by successful operations (sent and received).
    pub bytes: u64,
    /// Progress passes (CQ reads) the endpoint actor has made (zero from the engine itself).
    pub polls: u64,
    /// CQ reads made by the efa stream's readers themselves while the endpoint spun, not
    /// counted in `polls` (`Poster::spin_pass`; zero from the engine itself).
    pub reader_passes: u64,
    /// Of the ends those passes read, the ones handed straight to the reader that read them
    /// (`Claim`), not through its pipe's queue (zero from the engine itself).
    pub reader_claims: u64,
    /// Sends ended without reaching the provider because their pipe's peer was gone
    /// ([`Engine::refuse_sends`]).
    pub refused: u64,
    /// Receives of pipes (not the inbox's) posted to the provider now.
    pub receives_posted: usize,
    /// The inbox's receives posted now ([`Engine::set_inbox`]).
    pub inbox_posted: usize,
    /// Messages the inbox received for no pipe of its own (dropped).
    pub stray: u64,
}

/// Room the provider may use in an op's context (`FI_CONTEXT2`: 8 pointers), then our index.
#[repr(C)]
struct Ctx {
    scratch: [usize; 8],
    index: usize,
}

#[derive(Debug)]
enum State {
    Backlog,
    Posted,
    Done(Result<usize, FabricError>),
}

struct Live {
    pipe: u32,
    kind: Kind,
    tag: u64,
    mem: Vec<u8>,
    /// Set: the op moves this caller memory instead of `mem`.
    region: Option<Region>,
    /// Whether the op holds a use of its region's registration in the cache.
    cached: bool,
    /// One of the inbox's receives (its `pipe` is [`INBOX`]).
    inbox: bool,
    /// An RMA op (a send in its pipe's order): the peer's memory it reads or writes.
    rma: Option<Rma>,
    id: u64,
    state: State,
    // Dropped when the op ends, after the provider is done with the memory.
    _mr: Option<Mr>,
}

impl Live {
    /// An op on caller memory (`post_region`, `post_rma`).
    fn in_place(
        pipe: u32,
        kind: Kind,
        tag: u64,
        region: Region,
        rma: Option<Rma>,
        id: u64,
    ) -> Live {
        Live {
            pipe,
            kind,
            tag,
            mem: Vec::new(),
            region: Some(region),
            cached: false,
            inbox: false,
            rma,
            id,
            state: State::Posted,
            _mr: None,
        }
    }
}

struct Slot {
    ctx: Box<Ctx>,
    live: Option<Live>,
}

struct PipeState {
    peer: FiAddr,
    peer_name: Vec<u8>,
    sends: VecDeque<usize>,
    recvs: VecDeque<usize>,
    /// Its sends and its receives in the backlog ([`side`]): each kind keeps its own post
    /// order, and neither waits for the other (a receive held back by the receive limit must
    /// not hold back the sends that the peer's receives wait for).
    backlogged: [usize; 2],
    error: Option<FabricError>,
    /// Sends end with this at once ([`Engine::refuse_sends`]).
    refused: Option<FabricError>,
    detached: bool,
    /// Its messages come through the inbox ([`Engine::use_inbox`]).
    inbox: bool,
}

/// The `pipe` of the inbox's receives: no pipe has it (pipe numbers fit in `tag::PIPE_BITS`).
const INBOX: u32 = u32::MAX;

/// The endpoint's shared receives for the efa stream (see the module docs).
struct Inbox {
    /// Receives to keep posted.
    count: usize,
    /// Each receive's buffer.
    size: usize,
    /// Whether its receives have been made (on the first [`Engine::use_inbox`]).
    started: bool,
    /// Its slots not posted now (refused by the provider: retried with the backlog).
    idle: Vec<usize>,
    /// Buffers back from the pipes (or never handed out), for the next reposts.
    spare: Vec<Vec<u8>>,
    /// Ends for pipes, handed out at the next drain.
    routed: Vec<Finished>,
    /// Pipes that use it, not yet forgotten.
    users: usize,
}

/// One endpoint and everything in flight on it. See the module docs.
pub struct Engine {
    // First field: dropped (closed) before the slots' memory and the registrations.
    ep: Endpoint,
    regs: RegCache,
    /// Registrations of memory that peers read and write ([`Engine::register_remote`]).
    remote: HashMap<u64, Mr>,
    next_remote: u64,
    register_all: bool,
    slots: Vec<Slot>,
    free: Vec<usize>,
    backlog: VecDeque<usize>,
    pipes: KeyMap<u32, PipeState>,
    peers: HashMap<Vec<u8>, (FiAddr, usize)>,
    next_pipe: u32,
    #[cfg(feature = "faults")]
    faults: Faults,
    #[cfg(feature = "faults")]
    dice: Dice,
    stats: Stats,
    /// Sends of 1 to this many bytes are injects.
    inject_limit: usize,
    // Reused between calls: no allocation per completion.
    batch: Vec<Completion>,
    dirty: Vec<u32>,
    /// Receives the provider takes at once (`rx_size`; `usize::MAX` where it reports none).
    rx_limit: usize,
    /// Pipes' receives posted now (not the inbox's).
    receives_posted: usize,
    inbox: Option<Inbox>,
}

impl Engine {
    /// An engine over `ep`.
    pub fn new(ep: Endpoint) -> Engine {
        let inject_limit = ep.domain().attributes().inject_size as usize;
        let rx_limit = match ep.domain().attributes().rx_size {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        Engine {
            rx_limit,
            receives_posted: 0,
            inbox: None,
            inject_limit,
            ep,
            regs: RegCache::default(),
            remote: HashMap::new(),
            next_remote: 0,
            register_all: false,
            slots: Vec::new(),
            free: Vec::new(),
            backlog: VecDeque::new(),
            pipes: KeyMap::default(),
            peers: HashMap::new(),
            next_pipe: 0,
            #[cfg(feature = "faults")]
            dice: Dice::new(Faults::NONE.seed),
            #[cfg(feature = "faults")]
            faults: Faults::NONE,
            stats: Stats::default(),
            batch: Vec::with_capacity(64),
            dirty: Vec::new(),
        }
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// The domain's attributes.
    pub fn attributes(&self) -> &Attributes {
        self.ep.domain().attributes()
    }

    /// Replaces the fault settings (none at first).
    #[cfg(feature = "faults")]
    pub fn set_faults(&mut self, faults: Faults) {
        self.dice = Dice::new(faults.seed);
        self.faults = faults;
    }

    /// Registers the memory of in-place ops ([`Engine::post_region`]) even where the provider
    /// does not require it (tests; measuring what registration costs).
    pub fn set_register_all(&mut self, on: bool) {
        self.register_all = on;
    }

    /// Sends of at most `limit` bytes (capped at the provider's inject size) go out as
    /// injects: `fi_tinject` copies them at once and generates no completion, so the op ends
    /// when the post returns. `0` sends everything with `fi_tsend` (tests of the completion
    /// path; measuring what injects save).
    pub fn set_inject_limit(&mut self, limit: usize) {
        self.inject_limit = limit.min(self.attributes().inject_size as usize);
    }

    /// The largest send that goes out as an inject ([`Engine::set_inject_limit`]).
    pub fn inject_limit(&self) -> usize {
        self.inject_limit
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        Stats {
            backlog: self.backlog.len(),
            pipes: self.pipes.len(),
            registrations: self.regs.registrations(),
            registered: self.regs.live(),
            receives_posted: self.receives_posted,
            inbox_posted: self.inbox_posted(),
            ..self.stats.clone()
        }
    }

    /// Whether anything is posted or backlogged (the CQ then needs progress). The inbox's
    /// receives count only while a pipe uses it.
    pub fn busy(&self) -> bool {
        let idle_inbox = match &self.inbox {
            Some(i) if i.users == 0 => self.inbox_posted(),
            _ => 0,
        };
        self.stats.in_flight > idle_inbox
            || !self.backlog.is_empty()
            || self.inbox.as_ref().is_some_and(|i| !i.idle.is_empty())
    }

    fn inbox_posted(&self) -> usize {
        self.inbox
            .as_ref()
            .filter(|i| i.started)
            .map_or(0, |i| i.count - i.idle.len())
    }

    /// Receives the provider takes at once, as this engine counts them (its `rx_size`).
    pub fn rx_limit(&self) -> usize {
        self.rx_limit
    }

    /// Lowers the receive limit (tests: a small limit is met with few pipes). Above the
    /// provider's own, it changes nothing.
    pub fn set_rx_limit(&mut self, limit: usize) {
        let own = match self.attributes().rx_size {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        self.rx_limit = limit.min(own);
    }

    /// Gives the endpoint an inbox of `count` shared receives of `size` bytes each (see the
    /// module docs), made when the first pipe asks for it ([`Engine::use_inbox`]); at most
    /// half the receive limit. Once made, it stays as it is. `count` 0: no inbox.
    pub fn set_inbox(&mut self, count: usize, size: usize) {
        if self.inbox.as_ref().is_some_and(|i| i.started) {
            return;
        }
        let count = count.min(self.rx_limit / 2);
        self.inbox = (count > 0 && size > 0).then(|| Inbox {
            count,
            size,
            started: false,
            idle: Vec::new(),
            spare: Vec::new(),
            routed: Vec::new(),
            users: 0,
        });
    }

    /// Whether the endpoint has an inbox ([`Engine::set_inbox`]).
    pub fn has_inbox(&self) -> bool {
        self.inbox.is_some()
    }

    /// `pipe`'s messages of the control stream come through the inbox from now on (posting its
    /// receives the first time); says whether they do (not without an inbox, nor for a pipe
    /// not attached).
    pub fn use_inbox(&mut self, pipe: u32) -> bool {
        let Some(p) = self.pipes.get_mut(&pipe) else {
            return false;
        };
        let Some(inbox) = self.inbox.as_mut() else {
            return false;
        };
        if !p.inbox {
            p.inbox = true;
            inbox.users += 1;
        }
        if !inbox.started {
            inbox.started = true;
            let (count, size) = (inbox.count, inbox.size);
            for _ in 0..count {
                let index = self.slot();
                self.slots[index].live = Some(Live {
                    pipe: INBOX,
                    kind: Kind::Recv,
                    tag: tag::make(tag::Stream::Control, 0, 0),
                    mem: vec![0; size],
                    region: None,
                    cached: false,
                    inbox: true,
                    rma: None,
                    id: 0,
                    state: State::Backlog,
                    _mr: None,
                });
                if let Some(i) = self.inbox.as_mut() {
                    i.idle.push(index);
                }
            }
            self.post_inbox();
        }
        true
    }

    /// Hands back a buffer an inbox end carried, for a later receive (dropped if the inbox
    /// has spares enough, or it is not the inbox's size).
    pub fn recycle_inbox(&mut self, mem: Vec<u8>) {
        if let Some(i) = self.inbox.as_mut() {
            if mem.len() == i.size && i.spare.len() < i.count {
                i.spare.push(mem);
            }
        }
    }

    /// Posts the inbox's idle receives, until the provider refuses one.
    fn post_inbox(&mut self) {
        while let Some(index) = self.inbox.as_mut().and_then(|i| i.idle.pop()) {
            match self.try_post(index) {
                Ok(()) => {}
                Err(e) => {
                    if let PostError::Failed(e) = e {
                        tracing::warn!("efa inbox receive: {e}");
                    }
                    if let Some(i) = self.inbox.as_mut() {
                        i.idle.push(index);
                    }
                    return;
                }
            }
        }
    }

    /// Whether `pipe` is attached (a detached pipe stays until its ops have come back).
    pub fn attached(&self, pipe: u32) -> bool {
        self.pipes.contains_key(&pipe)
    }

    /// Pipes attached and not detached.
    pub fn live_pipes(&self) -> usize {
        self.pipes.values().filter(|p| !p.detached).count()
    }

    /// Whether the backlog holds ops (they need retries, not just completions).
    pub fn backlogged(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// A new pipe to the peer whose endpoint address is `peer_name`; the address goes into the
    /// address vector (once per peer, shared by its pipes). Returns the pipe's number: the
    /// peer puts it in the tags it sends to this pipe.
    pub fn attach(&mut self, peer_name: &[u8]) -> Result<u32, FabricError> {
        let peer = match self.peers.get_mut(peer_name) {
            Some((addr, n)) => {
                *n += 1;
                *addr
            }
            None => {
                let addr = self.ep.insert(peer_name)?;
                self.peers.insert(peer_name.to_vec(), (addr, 1));
                addr
            }
        };
        let mut pipe = self.next_pipe;
        while self.pipes.contains_key(&pipe) {
            pipe = (pipe + 1) & super::tag::MAX_PIPE;
        }
        self.next_pipe = (pipe + 1) & super::tag::MAX_PIPE;
        self.pipes.insert(
            pipe,
            PipeState {
                peer,
                peer_name: peer_name.to_vec(),
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                backlogged: [0; 2],
                error: None,
                refused: None,
                detached: false,
                inbox: false,
            },
        );
        Ok(pipe)
    }

    /// Ends a pipe: its pending ops fail with `error` (in order, through `out`), and the pipe
    /// is forgotten once every op the provider holds has come back.
    pub fn detach(&mut self, pipe: u32, error: FabricError, out: &mut impl FnMut(Finished)) {
        let Some(p) = self.pipes.get_mut(&pipe) else {
            return;
        };
        p.detached = true;
        if p.error.is_none() {
            self.fail_pipe(pipe, error);
        }
        self.drain(pipe, out);
        self.drain_dirty(out);
    }

    /// Refuses `pipe`'s sends from now on: each, and each still in the backlog, ends with
    /// `error` (in order, through `out`) without reaching the provider. Its receives carry on,
    /// and sends the provider already holds end as they will. For a peer known to be gone: a
    /// send to a dead peer reaches nobody, and the `shm` provider's can hang on the lock of a
    /// peer killed while it held it (docs/efa.md, "A peer killed while it holds its region's
    /// lock"). A failed or unknown pipe is left as it is.
    pub fn refuse_sends(&mut self, pipe: u32, error: FabricError, out: &mut impl FnMut(Finished)) {
        let Some(p) = self.pipes.get_mut(&pipe) else {
            return;
        };
        if p.error.is_some() || p.refused.is_some() {
            return;
        }
        p.refused = Some(error.clone());
        let mut ended = 0;
        for &index in &p.sends {
            if let Some(l) = self.slots[index].live.as_mut() {
                if matches!(l.state, State::Backlog) {
                    l.state = State::Done(Err(error.clone()));
                    ended += 1;
                }
            }
        }
        if ended > 0 {
            p.backlogged[side(Kind::Send)] = p.backlogged[side(Kind::Send)].saturating_sub(ended);
            self.stats.refused += ended as u64;
            let slots = &self.slots;
            self.backlog.retain(|&i| {
                matches!(
                    slots[i].live.as_ref().map(|l| &l.state),
                    Some(State::Backlog)
                )
            });
        }
        self.drain(pipe, out);
    }

    /// Posts `op` for `pipe` (see the module docs). Its end comes through `out`, now or from a
    /// later [`Engine::progress`].
    pub fn post(&mut self, pipe: u32, op: Op, out: &mut impl FnMut(Finished)) {
        let live = Live {
            pipe,
            kind: op.kind,
            tag: op.tag,
            mem: op.mem,
            region: None,
            cached: false,
            inbox: false,
            rma: None,
            id: op.id,
            state: State::Posted,
            _mr: None,
        };
        self.post_live(live, out);
    }

    /// Sends `bytes` for `pipe` at once with `fi_tinject` if nothing stands in the way, with no
    /// op and no end: no slot, no [`Finished`], and the caller keeps its bytes (the provider
    /// has copied them when this returns). Says whether it went; if not, the caller posts the
    /// send ([`Engine::post`]) as usual, which keeps every order rule:
    ///
    /// - not for an empty send, one over the inject limit, a pipe not attached, one that has
    ///   failed, refuses its sends or has ops in the backlog (they go first);
    /// - nor on `-FI_EAGAIN`, real or injected (counted as any other);
    /// - a post error other than `-FI_EAGAIN` fails the pipe as a posted op's would (its ends
    ///   through `out`) and says no: the caller's post then ends with that error, in order.
    ///
    /// An inject may overtake the pipe's posted sends that are still in flight: only for
    /// streams whose receiver matches each message by its own tag (the efa stream's sequence
    /// numbers), where order on the wire does not matter.
    pub fn inject(
        &mut self,
        pipe: u32,
        tag: u64,
        bytes: &[u8],
        out: &mut impl FnMut(Finished),
    ) -> bool {
        let len = bytes.len();
        if len == 0 || len > self.inject_limit {
            return false;
        }
        let Some(p) = self.pipes.get(&pipe) else {
            return false;
        };
        if p.error.is_some() || p.refused.is_some() || p.backlogged[side(Kind::Send)] > 0 {
            return false;
        }
        let peer = p.peer;
        if self.refused_by_faults() {
            return false;
        }
        match counted_inject(&self.ep, &mut self.stats, bytes, peer, tag) {
            Ok(()) => {
                self.stats.direct += 1;
                if let Some(e) = self.injected_error() {
                    // The message went out, but its "completion" failed: as a posted send's
                    // error would, it fails the pipe, and the caller's post ends with it.
                    self.stats.errors += 1;
                    self.fail_pipe(pipe, e);
                    self.drain_dirty(out);
                    return false;
                }
                self.stats.bytes += len as u64;
                true
            }
            Err(PostError::Again) => false,
            Err(PostError::Failed(e)) => {
                self.fail_pipe(pipe, e);
                self.drain_dirty(out);
                false
            }
        }
    }

    /// Posts an op that moves `region` in place (the `efa` channel), for `pipe`, as
    /// [`Engine::post`] does; its [`Finished`] hands back an empty `mem`. Where the provider
    /// requires registered memory, the region's buffer is registered through the cache (see
    /// [`super::regcache`]).
    ///
    /// # Safety
    /// The region's bytes (and its whole buffer) stay allocated, and nobody else reads or writes
    /// them (a send's may be read), until the op's [`Finished`] has come out.
    pub unsafe fn post_region(
        &mut self,
        pipe: u32,
        kind: Kind,
        tag: u64,
        region: Region,
        id: u64,
        out: &mut impl FnMut(Finished),
    ) {
        self.post_live(Live::in_place(pipe, kind, tag, region, None, id), out);
    }

    /// Posts an RMA op for `pipe`: reads `rma`'s peer memory into `region`, or writes `region`
    /// there, in the order of the pipe's sends; its [`Finished`] (kind [`Kind::Send`]) hands back
    /// an empty `mem` and the bytes moved. A write's end says its bytes are in the peer's memory
    /// (delivery complete).
    ///
    /// # Safety
    /// As [`Engine::post_region`]: the region's bytes stay allocated, and untouched by anyone
    /// else, until the op's [`Finished`] has come out.
    pub unsafe fn post_rma(
        &mut self,
        pipe: u32,
        rma: Rma,
        region: Region,
        id: u64,
        out: &mut impl FnMut(Finished),
    ) {
        let live = Live::in_place(pipe, Kind::Send, 0, region, Some(rma), id);
        self.post_live(live, out);
    }

    /// Registers `len` bytes at `base` for peers to read with RMA, and to write if `writable`
    /// (a write into a registration without it fails at the initiator): answers a handle
    /// for [`Engine::release_remote`], the key peers name it by, and the address of its first
    /// byte in their RMA ops (the virtual address, or 0 where the provider counts offsets).
    ///
    /// # Safety
    /// The memory stays allocated until the registration is released (or the engine dropped),
    /// and peers may write into it meanwhile if `writable`.
    pub unsafe fn register_remote(
        &mut self,
        base: usize,
        len: usize,
        writable: bool,
    ) -> Result<(u64, u64, u64), FabricError> {
        // SAFETY: the caller's contract.
        let mr = unsafe {
            self.ep
                .domain()
                .register_remote(base as *const u8, len, writable)
        }?;
        self.stats.registrations += 1;
        let handle = self.next_remote;
        self.next_remote += 1;
        let key = mr.key();
        self.remote.insert(handle, mr);
        let addr = if self.ep.domain().attributes().virt_addr {
            base as u64
        } else {
            0
        };
        Ok((handle, key, addr))
    }

    /// Closes a registration of [`Engine::register_remote`]: peers' RMA ops naming its key fail
    /// from now on.
    pub fn release_remote(&mut self, handle: u64) {
        self.remote.remove(&handle);
    }

    /// Registrations for peers' RMA open now.
    pub fn remote_registrations(&self) -> usize {
        self.remote.len()
    }

    fn post_live(&mut self, mut live: Live, out: &mut impl FnMut(Finished)) {
        let pipe = live.pipe;
        let index = self.slot();
        let Some(p) = self.pipes.get_mut(&pipe) else {
            self.free.push(index);
            out(Finished {
                pipe,
                id: live.id,
                kind: live.kind,
                tag: live.tag,
                mem: live.mem,
                result: Err(FabricError {
                    op: "post",
                    provider: self.ep.provider().into(),
                    code: super::ecanceled(),
                    text: format!("pipe {pipe} is not attached to this endpoint"),
                }),
            });
            return;
        };
        match live.kind {
            Kind::Send => p.sends.push_back(index),
            Kind::Recv => p.recvs.push_back(index),
        }
        let state = if let Some(e) = &p.error {
            State::Done(Err(e.clone()))
        } else if let (Kind::Send, Some(e)) = (live.kind, &p.refused) {
            self.stats.refused += 1;
            State::Done(Err(e.clone()))
        } else if p.backlogged[side(live.kind)] > 0 {
            State::Backlog
        } else {
            State::Posted
        };
        let queue_behind = matches!(state, State::Backlog);
        let failed = matches!(state, State::Done(_));
        live.state = state;
        self.slots[index].live = Some(live);
        if queue_behind {
            self.push_backlog(index);
        } else if !failed {
            match self.try_post(index) {
                Ok(()) => {}
                Err(PostError::Again) => self.push_backlog(index),
                Err(PostError::Failed(e)) => {
                    self.set_state(index, State::Done(Err(e.clone())));
                    self.fail_pipe(pipe, e);
                }
            }
        }
        self.drain(pipe, out);
        self.drain_dirty(out);
    }

    /// Reads the completion queue, then retries the backlog. Returns the number of completions
    /// read. An `Err` is a failure of the CQ itself: every pipe is then failed with it.
    pub fn progress(&mut self, out: &mut impl FnMut(Finished)) -> Result<usize, FabricError> {
        let mut total = 0;
        loop {
            let mut batch = std::mem::take(&mut self.batch);
            let read = self.ep.poll(|c| batch.push(c));
            let n = match read {
                Ok(n) => n,
                Err(e) => {
                    self.batch = batch;
                    self.stats.errors += 1;
                    let pipes: Vec<u32> = self.pipes.keys().copied().collect();
                    for pipe in pipes {
                        self.fail_pipe(pipe, e.clone());
                    }
                    self.drain_dirty(out);
                    return Err(e);
                }
            };
            for c in batch.drain(..) {
                self.complete(c);
            }
            self.batch = batch;
            total += n;
            if n < 64 {
                break;
            }
        }
        self.retry_backlog();
        self.drain_dirty(out);
        Ok(total)
    }

    fn drain_dirty(&mut self, out: &mut impl FnMut(Finished)) {
        if let Some(i) = self.inbox.as_mut() {
            for f in i.routed.drain(..) {
                out(f);
            }
        }
        while let Some(pipe) = self.dirty.pop() {
            self.drain(pipe, out);
        }
    }

    fn slot(&mut self) -> usize {
        if let Some(i) = self.free.pop() {
            return i;
        }
        let index = self.slots.len();
        self.slots.push(Slot {
            ctx: Box::new(Ctx {
                scratch: [0; 8],
                index,
            }),
            live: None,
        });
        index
    }

    fn set_state(&mut self, index: usize, state: State) {
        if let Some(l) = self.slots[index].live.as_mut() {
            l.state = state;
        }
    }

    fn push_backlog(&mut self, index: usize) {
        let Some(l) = self.slots[index].live.as_mut() else {
            return;
        };
        l.state = State::Backlog;
        if let Some(p) = self.pipes.get_mut(&l.pipe) {
            p.backlogged[side(l.kind)] += 1;
        }
        self.backlog.push_back(index);
        self.stats.backlog_max = self.stats.backlog_max.max(self.backlog.len());
    }

    /// Fault injection's answer to a post: `-FI_EAGAIN` for the chosen fraction (counted).
    #[cfg(feature = "faults")]
    fn refused_by_faults(&mut self) -> bool {
        let refused = self.faults.eagain > 0.0 && self.dice.roll(self.faults.eagain);
        self.stats.eagain += u64::from(refused);
        refused
    }

    /// Without the `faults` feature no post is refused but by the provider.
    #[cfg(not(feature = "faults"))]
    #[inline(always)]
    fn refused_by_faults(&mut self) -> bool {
        false
    }

    /// The error fault injection turns this op's successful end into, if its dice say so: a
    /// posted op's completion, an inject's post, or a direct inject (which then fails its pipe,
    /// and the caller's post ends with the error). Injects stay on with errors injected, so the
    /// faults meet the production send path.
    #[cfg(feature = "faults")]
    fn injected_error(&mut self) -> Option<FabricError> {
        let hit = self.faults.cq_error > 0.0 && self.dice.roll(self.faults.cq_error);
        hit.then(|| FabricError {
            op: "completion",
            provider: self.ep.provider().to_string(),
            code: eio(),
            text: "injected completion error (fault injection)".into(),
        })
    }

    /// Without the `faults` feature no end is turned into an error.
    #[cfg(not(feature = "faults"))]
    #[inline(always)]
    fn injected_error(&mut self) -> Option<FabricError> {
        None
    }

    /// Hands the op at `index` to the provider (or to fault injection).
    fn try_post(&mut self, index: usize) -> Result<(), PostError> {
        if self.refused_by_faults() {
            return Err(PostError::Again);
        }
        let mr_local = self.ep.domain().attributes().mr_local;
        let slot = &mut self.slots[index];
        let ctx: *mut c_void = (&mut *slot.ctx as *mut Ctx).cast();
        let Some(l) = slot.live.as_mut() else {
            return Ok(());
        };
        let peer = if l.inbox {
            Endpoint::any_source()
        } else {
            let Some(peer) = self.pipes.get(&l.pipe).map(|p| p.peer) else {
                return Ok(());
            };
            peer
        };
        // The provider's receive queue: the inbox's share is kept for it.
        let inbox_share = self.inbox.as_ref().map_or(0, |i| i.count);
        if l.kind == Kind::Recv
            && !l.inbox
            && self.receives_posted >= self.rx_limit.saturating_sub(inbox_share)
        {
            self.stats.eagain += 1;
            return Err(PostError::Again);
        }
        let len = l.region.map_or(l.mem.len(), |r| r.len);
        if l.kind == Kind::Send && l.rma.is_none() && len > 0 && len <= self.inject_limit {
            let bytes = match l.region {
                // SAFETY: `post_region`'s contract keeps the region's bytes allocated and
                // unwritten until the op's end, which is after this call.
                Some(r) => unsafe {
                    std::slice::from_raw_parts((r.base + r.offset) as *const u8, r.len)
                },
                None => &l.mem[..],
            };
            let r = counted_inject(&self.ep, &mut self.stats, bytes, peer, l.tag);
            if r.is_ok() {
                let pipe = l.pipe;
                let result = self.finish(pipe, Ok(len));
                self.end_op(index, pipe, result);
            }
            return r;
        }
        // Providers that need registered local memory (FI_MR_LOCAL: efa) get it per op for the
        // engine's own buffers, and through the cache for caller memory (regions).
        if let Some(r) = l
            .region
            .filter(|r| (mr_local || self.register_all) && r.len > 0)
        {
            if !l.cached {
                // SAFETY: `post_region`'s contract keeps the buffer alive until the op's end,
                // where `drain` releases this use before handing the op out.
                let desc = unsafe { self.regs.acquire(self.ep.domain(), r.base, r.buffer_len) };
                if let Err(e) = desc {
                    return Err(PostError::Failed(e));
                }
                l.cached = true;
            }
        } else if mr_local && l._mr.is_none() && !l.mem.is_empty() {
            // SAFETY: the memory is owned by the op, which outlives the registration (the Mr is
            // dropped with the op, after its completion).
            let mr = unsafe { self.ep.domain().register(l.mem.as_ptr(), l.mem.len()) };
            match mr {
                Ok(mr) => l._mr = Some(mr),
                Err(e) => return Err(PostError::Failed(e)),
            }
        }
        let desc = match (&l._mr, l.region) {
            (Some(m), _) => m.desc(),
            (None, Some(r)) if l.cached => self.regs.desc(r.base, r.buffer_len),
            _ => std::ptr::null_mut(),
        };
        let (ptr, len) = match l.region {
            Some(r) => ((r.base + r.offset) as *mut u8, r.len),
            None => (l.mem.as_mut_ptr(), l.mem.len()),
        };
        // SAFETY: the memory is owned by the op (or, for a region, kept alive by the caller per
        // `post_region`'s contract) and the context by its boxed slot; neither is freed, moved
        // or touched until the op's completion has been read (`complete`), or the endpoint
        // closed (it drops first).
        let r = unsafe {
            match (l.kind, l.rma) {
                (Kind::Send, Some(rma)) => self
                    .ep
                    .rma(rma.write, ptr, len, desc, peer, rma.addr, rma.key, ctx),
                (Kind::Send, None) => {
                    let (wire, data) = tag::on_the_wire(l.tag);
                    self.ep.tsend(ptr, len, desc, peer, wire, data, ctx)
                }
                (Kind::Recv, _) => {
                    // The inbox's receives match any message of the stream: pipe and sequence
                    // ignored.
                    let ignore = if l.inbox {
                        ((tag::MAX_PIPE as u64) << 32) | u64::from(u32::MAX)
                    } else {
                        0
                    };
                    self.ep.trecv(ptr, len, desc, peer, l.tag, ignore, ctx)
                }
            }
        };
        // A full receive queue (`shm`: -FI_ENOMEM past its `rx_size`) waits as -FI_EAGAIN does.
        let r = match r {
            Err(PostError::Failed(e)) if l.kind == Kind::Recv && e.code == libc::ENOMEM => {
                Err(PostError::Again)
            }
            r => r,
        };
        match &r {
            Ok(()) => {
                l.state = State::Posted;
                self.stats.posted += 1;
                self.stats.in_flight += 1;
                if l.kind == Kind::Recv && !l.inbox {
                    self.receives_posted += 1;
                }
            }
            Err(PostError::Again) => self.stats.eagain += 1,
            Err(PostError::Failed(_)) => self.stats.errors += 1,
        }
        r
    }

    /// Records one completion; returns its pipe.
    fn complete(&mut self, c: Completion) -> Option<u32> {
        self.stats.completions += 1;
        // SAFETY: every context we post is the address of a live boxed Ctx of ours; the
        // provider hands it back unchanged.
        let index = unsafe { (*(c.context as *const Ctx)).index };
        let l = self.slots.get_mut(index)?.live.as_mut()?;
        if !matches!(l.state, State::Posted) {
            return None;
        }
        self.stats.in_flight -= 1;
        if l.inbox {
            return self.inbox_completed(index, c);
        }
        if l.kind == Kind::Recv {
            self.receives_posted -= 1;
        }
        let pipe = l.pipe;
        let result = c.result.map(|()| match l.kind {
            Kind::Recv => {
                // The posted name (not the reported tag: not every provider reports it), with
                // the credits the message carried in its CQ data.
                l.tag = tag::received(l.tag, c.data);
                c.len as usize
            }
            Kind::Send => l.region.map_or(l.mem.len(), |r| r.len),
        });
        let result = self.finish(pipe, result);
        self.end_op(index, pipe, result);
        Some(pipe)
    }

    /// One of the inbox's receives completed: its message goes to the pipe its tag names (or
    /// its error, where the provider says which message failed), and the receive goes back to
    /// the provider with a spare buffer. Returns the pipe it went to.
    fn inbox_completed(&mut self, index: usize, c: Completion) -> Option<u32> {
        let (stream, pipe, seq) = tag::split(c.tag);
        let ours = stream == tag::Stream::Control as u8
            && self
                .pipes
                .get(&pipe)
                .is_some_and(|p| p.inbox && p.error.is_none());
        let inbox = self.inbox.as_mut()?;
        let l = self.slots[index].live.as_mut()?;
        l.state = State::Backlog;
        let to = match c.result {
            Ok(()) if ours => {
                let fresh = inbox.spare.pop().unwrap_or_else(|| vec![0; inbox.size]);
                let mem = std::mem::replace(&mut l.mem, fresh);
                self.stats.bytes += c.len;
                inbox.routed.push(Finished {
                    pipe,
                    id: u64::from(seq),
                    kind: Kind::Recv,
                    tag: tag::received(c.tag & !tag::IGNORE, c.data),
                    mem,
                    result: Ok(c.len as usize),
                });
                Some(pipe)
            }
            Ok(()) => {
                self.stats.stray += 1;
                None
            }
            // Closing: the endpoint cancels what it holds; nothing to post again.
            Err(e) if e.code == super::ecanceled() => return None,
            Err(e) => {
                // A message the inbox could not take (longer than its buffers: a peer that
                // breaks the protocol): its pipe fails, where the provider names it.
                self.stats.errors += 1;
                tracing::warn!("efa inbox receive: {e}");
                if ours {
                    self.fail_pipe(pipe, e);
                    Some(pipe)
                } else {
                    None
                }
            }
        };
        if let Some(i) = self.inbox.as_mut() {
            i.idle.push(index);
        }
        self.post_inbox();
        if let Some(pipe) = to {
            self.mark(pipe);
        }
        to
    }

    /// Records `result` as the op's end, fails its pipe if that is the pipe's first error,
    /// and marks the pipe for draining.
    fn end_op(&mut self, index: usize, pipe: u32, result: Result<usize, FabricError>) {
        let first = match &result {
            Err(e) if self.pipes.get(&pipe).is_some_and(|p| p.error.is_none()) => Some(e.clone()),
            _ => None,
        };
        self.set_state(index, State::Done(result));
        if let Some(e) = first {
            self.fail_pipe(pipe, e);
        }
        self.mark(pipe);
    }

    /// The result an op of `pipe` that ended with `result` (a completion, or an inject's
    /// post) is handed out with: an injected fault's error, or the pipe's own if it has
    /// failed. The caller records it as the op's state, then fails the pipe with it if it is a
    /// new error (`end_op`).
    fn finish(
        &mut self,
        pipe: u32,
        result: Result<usize, FabricError>,
    ) -> Result<usize, FabricError> {
        let result = match result {
            Ok(n) => self.injected_error().map_or(Ok(n), Err),
            e => e,
        };
        match (result, self.pipes.get(&pipe).and_then(|p| p.error.clone())) {
            (Err(e), None) => {
                self.stats.errors += 1;
                Err(e)
            }
            (_, Some(e)) => Err(e),
            (Ok(n), None) => {
                self.stats.bytes += n as u64;
                Ok(n)
            }
        }
    }

    fn mark(&mut self, pipe: u32) {
        if !self.dirty.contains(&pipe) {
            self.dirty.push(pipe);
        }
    }

    /// Fails `pipe` with `e`: backlogged ops fail now, posted ones are cancelled.
    fn fail_pipe(&mut self, pipe: u32, e: FabricError) {
        let Some(p) = self.pipes.get_mut(&pipe) else {
            return;
        };
        if p.error.is_some() {
            return;
        }
        p.error = Some(e.clone());
        p.backlogged = [0; 2];
        if p.inbox {
            if let Some(i) = self.inbox.as_mut() {
                i.routed.push(Finished {
                    pipe,
                    id: u64::MAX,
                    kind: Kind::Recv,
                    tag: 0,
                    mem: Vec::new(),
                    result: Err(e.clone()),
                });
            }
        }
        if !self.dirty.contains(&pipe) {
            self.dirty.push(pipe);
        }
        let ops: Vec<usize> = p.sends.iter().chain(p.recvs.iter()).copied().collect();
        self.backlog.retain(|i| !ops.contains(i));
        for index in ops {
            let slot = &mut self.slots[index];
            let Some(l) = slot.live.as_mut() else {
                continue;
            };
            match l.state {
                State::Backlog => l.state = State::Done(Err(e.clone())),
                // SAFETY: the op is posted and its completion not read yet: its context is live.
                State::Posted => unsafe { self.ep.cancel((&mut *slot.ctx as *mut Ctx).cast()) },
                State::Done(_) => {}
            }
        }
    }

    fn retry_backlog(&mut self) {
        self.post_inbox();
        if self.backlog.is_empty() {
            return;
        }
        let old = std::mem::take(&mut self.backlog);
        let mut blocked: Vec<(u32, Kind)> = Vec::new();
        let mut keep = VecDeque::with_capacity(old.len());
        for index in old {
            let Some(l) = self.slots[index].live.as_ref() else {
                continue;
            };
            if !matches!(l.state, State::Backlog) {
                continue; // failed with its pipe meanwhile
            }
            let (pipe, kind) = (l.pipe, l.kind);
            if blocked.contains(&(pipe, kind)) {
                keep.push_back(index);
                continue;
            }
            match self.try_post(index) {
                Ok(()) => {
                    if let Some(p) = self.pipes.get_mut(&pipe) {
                        p.backlogged[side(kind)] = p.backlogged[side(kind)].saturating_sub(1);
                    }
                }
                Err(PostError::Again) => {
                    blocked.push((pipe, kind));
                    keep.push_back(index);
                }
                Err(PostError::Failed(e)) => {
                    self.set_state(index, State::Done(Err(e.clone())));
                    self.fail_pipe(pipe, e);
                }
            }
        }
        // fail_pipe may have dropped entries meanwhile: keep only those still backlogged.
        keep.retain(|&i| {
            matches!(
                self.slots[i].live.as_ref().map(|l| &l.state),
                Some(State::Backlog)
            )
        });
        self.backlog = keep;
    }

    /// Hands out `pipe`'s finished ops from the front of each queue.
    fn drain(&mut self, pipe: u32, out: &mut impl FnMut(Finished)) {
        let Some(p) = self.pipes.get_mut(&pipe) else {
            return;
        };
        for queue in [&mut p.sends, &mut p.recvs] {
            while let Some(&index) = queue.front() {
                let done = matches!(
                    self.slots[index].live.as_ref().map(|l| &l.state),
                    Some(State::Done(_))
                );
                if !done {
                    break;
                }
                queue.pop_front();
                let Some(l) = self.slots[index].live.take() else {
                    continue;
                };
                self.free.push(index);
                if let (true, Some(r)) = (l.cached, l.region) {
                    // The op is over: its use of the registration ends before the caller hears.
                    self.regs.release(r.base, r.buffer_len);
                }
                let State::Done(result) = l.state else {
                    unreachable!("checked above")
                };
                out(Finished {
                    pipe,
                    id: l.id,
                    kind: l.kind,
                    tag: l.tag,
                    mem: l.mem,
                    result,
                });
            }
        }
        if p.detached && p.sends.is_empty() && p.recvs.is_empty() {
            let name = std::mem::take(&mut p.peer_name);
            if p.inbox {
                if let Some(i) = self.inbox.as_mut() {
                    i.users -= 1;
                }
            }
            self.pipes.remove(&pipe);
            if let Some((addr, n)) = self.peers.get_mut(&name) {
                *n -= 1;
                if *n == 0 {
                    let addr = *addr;
                    self.peers.remove(&name);
                    if let Err(e) = self.ep.remove(addr) {
                        tracing::debug!("{e}");
                    }
                }
            }
        }
    }
}

/// Where an op of `kind` counts in [`PipeState::backlogged`].
fn side(kind: Kind) -> usize {
    match kind {
        Kind::Send => 0,
        Kind::Recv => 1,
    }
}

/// `fi_tinject` of `bytes`, counted: a post and an inject if it went, an `-FI_EAGAIN` or an
/// error if not.
fn counted_inject(
    ep: &Endpoint,
    stats: &mut Stats,
    bytes: &[u8],
    peer: FiAddr,
    tag: u64,
) -> Result<(), PostError> {
    let (wire, data) = tag::on_the_wire(tag);
    let r = ep.tinject(bytes, peer, wire, data);
    match &r {
        Ok(()) => {
            stats.posted += 1;
            stats.injected += 1;
        }
        Err(PostError::Again) => stats.eagain += 1,
        Err(PostError::Failed(_)) => stats.errors += 1,
    }
    r
}

#[cfg(test)]
mod tests;
