//! Direct posting: what the endpoint actor shares with the pipes that post on it.
//!
//! The engine (endpoint, backlog, per-pipe order, fault injection) and the pipes' queues of ends
//! live in one [`Core`] behind one lock. The actor takes the lock for each progress pass (its
//! CQ reads) and for the messages it still handles; a [`Poster`] takes it to post a pipe's ops
//! straight into the engine, with no mailbox hop: [`Engine::post`] keeps its order rule under
//! the lock (an op of a pipe with ops in the backlog goes behind them; `-FI_EAGAIN` puts it at
//! the back of the backlog, which the actor retries after its next CQ read), and an end that a
//! post produces at once (the pipe already failed) goes to the pipe's queue before the lock is
//! released, in the pipe's order. The actor reads the CQ; while it spins, a stream's reader
//! with nothing to read does too ([`Poster::spin_pass`]). Both passes are [`Core::progress`],
//! and a CQ error fails every pipe inside the engine, whoever read it.
//!
//! Progress after a direct post: while the actor spins it reads the CQ on every turn anyway,
//! and the post only extends its window (`posted`). Otherwise the poster kicks the actor
//! (coalesced: none while one is pending), which reads the CQ at once and arms the next
//! progress, as a `FabricPost` did. Whether the actor spins is decided under the lock, together
//! with taking `posted`, so a post never falls between a spin's end and the wait that follows
//! it without a kick. A kick is no message: the poster raises a [`KickSignal`] and wakes the
//! actor's driver ([`super::drive::Drive`]), a future the actor runs for its whole life, which
//! looks at the signal (one atomic load) each time the actor's task runs. A kick message
//! through the mailbox boxed an envelope per kick and queued it: about 600 instructions a kick
//! (malloc and free, the queue, the mailbox's dispatch) against some 300 now (the flag, the
//! wake-up, the future's polls), and a 64 B round trip without spin makes 4 (`transport`) to 6
//! (`channel`) kicks (callgrind, git history's docs/efa-measurements.md, "Instruction counts").

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::{FabricEndpoint, RegionOp};
use crate::backend::efa::engine::{Engine, Finished, Op};
use crate::backend::efa::FabricError;
use crate::keymap::KeyMap;
use crate::transport::stream::Memory;

/// What the actor and its posters share (see the module docs).
pub(super) struct Core {
    // First: dropped (the endpoint closed) before the quarantined buffers below.
    pub(super) engine: Engine,
    /// Each pipe's queue of ends, given at `FabricAttach`.
    pub(super) sinks: KeyMap<u32, mpsc::UnboundedSender<Finished>>,
    /// Buffers of detached pipes that the provider may still touch, kept until the engine has
    /// forgotten their pipe (or has closed: they drop after it).
    pub(super) quarantine: KeyMap<u32, Vec<Arc<Mutex<Vec<Memory>>>>>,
    /// The actor is spinning: it reads the CQ on every turn, a post needs no kick.
    pub(super) spinning: bool,
    /// Ops were posted directly since the actor last looked (activity: extends its window).
    pub(super) posted: bool,
    /// A kick is on its way: [`Kicks`] has not taken it yet.
    pub(super) kicked: bool,
    /// The actor has stopped: nothing progresses the engine any more.
    pub(super) closed: bool,
    /// The actor spins in spin mode proper (`EndpointConfig::busy_poll`): stream readers may
    /// read the CQ themselves ([`Poster::spin_pass`]). Not in the polling window of a provider
    /// without a wait fd (`shm`): there a reader's passes would add to the time a process
    /// spends inside the provider's progress, holding the `shm` region's lock that a peer
    /// killed at that instant leaves held for ever (docs/efa.md, "A peer killed while it holds
    /// its region's lock": two `peer_killed_mid_transfer_efa_shm_*` trials hung that way in one
    /// CI run with readers passing in that window).
    pub(super) readers_spin: bool,
    /// Passes stream readers made themselves while the actor spun ([`Poster::spin_pass`]).
    pub(super) reader_passes: u64,
    /// Ends those passes handed straight to the reader that made them ([`Claim`]).
    pub(super) reader_claims: u64,
    /// Those passes handed out ends since the spin task last looked (activity, for its window).
    pub(super) reader_found: bool,
}

// SAFETY: what makes `Core` `!Send` is the libfabric objects under `engine` (opened with
// `FI_THREAD_DOMAIN`: the provider needs every call on the domain serialized, not made from one
// thread) and the `Rc<Domain>` they share. The endpoint's domain is opened for this engine alone
// (`FabricEndpoint::open`), every object holding one of those `Rc`s lives inside the engine
// (endpoint, CQ, AV, registrations) and none is handed out, so every call and every count
// change happens under the `Mutex` that holds the `Core` (or in its drop, which has it alone).
// The queues' senders and the quarantined buffers are `Send`.
unsafe impl Send for Core {}

impl Core {
    pub(super) fn new(engine: Engine) -> Core {
        Core {
            engine,
            sinks: KeyMap::default(),
            quarantine: KeyMap::default(),
            spinning: false,
            posted: false,
            kicked: false,
            closed: false,
            readers_spin: false,
            reader_passes: 0,
            reader_claims: 0,
            reader_found: false,
        }
    }

    /// Reads the CQ once (and retries the backlog), handing each end straight to its pipe's
    /// queue, and forgets the pipes that are done; says whether any end went out. The actor's
    /// passes and a spinning stream reader's ([`Poster::spin_pass`]) are this.
    pub(super) fn progress(&mut self) -> (Result<usize, FabricError>, bool) {
        self.progress_claiming(None)
    }

    /// [`Core::progress`], but the ends of `claim`'s pipe go to the claimant's hands instead
    /// of its queue, where they may (see [`Claim`]).
    fn progress_claiming(
        &mut self,
        mut claim: Option<&mut Claim<'_>>,
    ) -> (Result<usize, FabricError>, bool) {
        // Only while the pipe's queue is empty: every end its queue holds came before this
        // pass, and every end sent to it after comes after (ends are sent only under this
        // lock), so the claimant, which takes its claimed ends first, keeps the pipe's order.
        if claim.as_ref().is_some_and(|c| !c.queue.is_empty()) {
            claim = None;
        }
        let mut any = false;
        let mut claimed = 0;
        let Core { engine, sinks, .. } = self;
        let r = engine.progress(&mut |f| {
            any = true;
            match claim.as_mut() {
                Some(c) if c.pipe == f.pipe => {
                    claimed += 1;
                    c.into.push_back(f);
                }
                _ => deliver(sinks, f),
            }
        });
        self.reader_claims += claimed;
        if any {
            self.forget();
        }
        (r, any)
    }

    /// Drops the queues (and quarantined buffers) of pipes the engine has forgotten.
    pub(super) fn forget(&mut self) {
        if self.engine.stats().pipes < self.sinks.len() {
            let engine = &self.engine;
            self.sinks.retain(|p, _| engine.attached(*p));
        }
        if !self.quarantine.is_empty() {
            let engine = &self.engine;
            self.quarantine.retain(|p, _| engine.attached(*p));
        }
    }

    /// Posts `ops` for `pipe`; ends that come at once go to the pipe's queue.
    pub(super) fn post(&mut self, pipe: u32, ops: impl IntoIterator<Item = Op>) {
        let Core { engine, sinks, .. } = self;
        for op in ops {
            engine.post(pipe, op, &mut |f| deliver(sinks, f));
        }
    }

    /// Posts in-place ops for `pipe`, as [`Core::post`].
    ///
    /// # Safety
    /// [`Engine::post_region`]'s, for each op.
    pub(super) unsafe fn post_regions(&mut self, pipe: u32, ops: &[RegionOp]) {
        let Core { engine, sinks, .. } = self;
        for op in ops {
            // SAFETY: the caller's contract is `post_region`'s.
            unsafe {
                engine.post_region(pipe, op.kind, op.tag, op.region, op.id, &mut |f| {
                    deliver(sinks, f)
                })
            };
        }
    }
}

/// What a reader's own pass ([`Poster::spin_pass`]) may keep of what it reads: the ends of
/// its own pipe go straight into `into` instead of through the pipe's queue `queue`, when that
/// queue is empty. Through the queue, each end woke the reader's own task (its waker was
/// registered: the reader had found the queue empty), and the end was sent and received: a few
/// hundred instructions on the path from a message's arrival to its handler, and a poll of the
/// reader's task for nothing afterwards. The reader takes the ends in `into` before any
/// in `queue`, which keeps its order (see `Core::progress_claiming`).
pub struct Claim<'a> {
    /// The reader's pipe.
    pub pipe: u32,
    /// The pipe's queue of ends (only looked at: is it empty?).
    pub queue: &'a mpsc::UnboundedReceiver<Finished>,
    /// Where the pipe's ends go instead.
    pub into: &'a mut VecDeque<Finished>,
}

/// Hands `f` to its pipe's queue.
pub(super) fn deliver(sinks: &KeyMap<u32, mpsc::UnboundedSender<Finished>>, f: Finished) {
    if let Some(s) = sinks.get(&f.pipe) {
        // A pipe that dropped its queue no longer wants its buffers back.
        let _ = s.send(f);
    }
}

/// The lock, whether or not a holder panicked (the engine's state is consistent between calls).
pub(super) fn lock(core: &Mutex<Core>) -> MutexGuard<'_, Core> {
    core.lock().unwrap_or_else(|p| p.into_inner())
}

/// A handle that posts a pipe's ops straight into an endpoint's engine (see the module docs),
/// from any thread. `FabricShare` gives one.
#[derive(Clone)]
pub struct Poster {
    core: Arc<Mutex<Core>>,
    signal: Arc<KickSignal>,
    ep: Addr<FabricEndpoint>,
    quick_exchange: std::time::Duration,
}

impl Poster {
    pub(super) fn new(
        core: Arc<Mutex<Core>>,
        signal: Arc<KickSignal>,
        ep: Addr<FabricEndpoint>,
        quick_exchange: std::time::Duration,
    ) -> Poster {
        Poster {
            core,
            signal,
            ep,
            quick_exchange,
        }
    }

    /// The endpoint's `EndpointConfig::quick_exchange`: which waits of a stream's reader burst.
    pub fn quick_exchange(&self) -> std::time::Duration {
        self.quick_exchange
    }

    /// The endpoint actor (for the messages that still go through it: attach, detach, stats).
    pub fn endpoint(&self) -> &Addr<FabricEndpoint> {
        &self.ep
    }

    /// Posts `ops` for `pipe`, in order, as `FabricPost` does but without its mailbox hop:
    /// their ends come on the pipe's queue, in its order. After the actor has stopped the ops
    /// are dropped (the pipe's queue is closed then).
    pub fn post(&self, pipe: u32, ops: impl IntoIterator<Item = Op>) {
        let kick = {
            let mut c = lock(&self.core);
            if c.closed {
                return;
            }
            c.post(pipe, ops);
            c.after_post()
        };
        if kick {
            self.signal.raise();
        }
    }

    /// Whether the endpoint's control streams share its inbox (`Engine::set_inbox`) instead of
    /// keeping receives of their own.
    pub fn has_inbox(&self) -> bool {
        lock(&self.core).engine.has_inbox()
    }

    /// `pipe`'s control-stream messages come through the endpoint's inbox from now on
    /// (`Engine::use_inbox`); says whether they do.
    pub fn use_inbox(&self, pipe: u32) -> bool {
        let (used, kick) = {
            let mut c = lock(&self.core);
            if c.closed {
                return false;
            }
            let used = c.engine.use_inbox(pipe);
            (used, c.after_post())
        };
        if kick {
            self.signal.raise();
        }
        used
    }

    /// Gives the inbox back a buffer one of its ends carried (`Engine::recycle_inbox`), then
    /// posts `ops` for `pipe` as [`Poster::post`] does: one lock for both.
    pub fn recycle_inbox(&self, mem: Vec<u8>, pipe: u32, ops: impl IntoIterator<Item = Op>) {
        let kick = {
            let mut c = lock(&self.core);
            if c.closed {
                return;
            }
            c.engine.recycle_inbox(mem);
            c.post(pipe, ops);
            c.after_post()
        };
        if kick {
            self.signal.raise();
        }
    }

    /// Sends `bytes` for `pipe` with one `fi_tinject` from the caller's own bytes, with no op
    /// and no end ([`Engine::inject`]); says whether it went. If not (too large, a backlog
    /// ahead, an `-FI_EAGAIN`, the actor stopped), the caller posts the send as usual.
    pub fn inject(&self, pipe: u32, tag: u64, bytes: &[u8]) -> bool {
        let kick = {
            let mut c = lock(&self.core);
            if c.closed {
                return false;
            }
            let Core { engine, sinks, .. } = &mut *c;
            if !engine.inject(pipe, tag, bytes, &mut |f| deliver(sinks, f)) {
                return false;
            }
            c.after_post()
        };
        if kick {
            self.signal.raise();
        }
        true
    }

    /// The largest send [`Poster::inject`] takes (the provider's inject size, or the engine's
    /// lower limit).
    pub fn inject_limit(&self) -> usize {
        lock(&self.core).engine.inject_limit()
    }

    /// While the actor spins in spin mode (`busy_poll`), reads the CQ here, from the caller's
    /// task, and hands out what ended (as the spin task's pass does); says whether it did. A
    /// stream's reader with nothing to read calls it before it waits, and keeps calling it
    /// (waking its own task) while it says so: the reader's own message then reaches it in the
    /// same poll, with no turn of the spin task in between, and through `claim` (see [`Claim`])
    /// with no trip through its queue either (docs/efa.md, "Progress"). Not while another
    /// thread holds the lock: that one progresses the CQ.
    pub fn spin_pass(&self, mut claim: Claim<'_>) -> bool {
        let Ok(mut c) = self.core.try_lock() else {
            return false;
        };
        if !c.readers_spin || c.closed {
            return false;
        }
        let (r, _) = c.progress_claiming(Some(&mut claim));
        c.reader_found |= !matches!(r, Ok(0));
        c.reader_passes += 1;
        drop(c);
        if let Err(e) = r {
            tracing::warn!("{e}: every pipe on this endpoint failed");
        }
        true
    }

    /// Whether stream readers read the CQ themselves now ([`Poster::spin_pass`] would pass),
    /// without reading it. Not while another thread holds the lock.
    pub fn readers_spin(&self) -> bool {
        self.core
            .try_lock()
            .is_ok_and(|c| c.readers_spin && !c.closed)
    }

    /// Refuses the sends of `pipes` from now on ([`Engine::refuse_sends`]): each ends at once
    /// with an error naming `reason`, on its pipe's queue in order, while receives carry on. For
    /// a peer that is gone: nothing is sent to it any more.
    pub fn refuse_sends(&self, pipes: &[u32], reason: &str) {
        let mut c = lock(&self.core);
        if c.closed {
            return;
        }
        let e = FabricError {
            op: "fi_tsend",
            provider: c.engine.attributes().provider.clone(),
            code: libc::ECONNRESET,
            text: reason.into(),
        };
        let Core { engine, sinks, .. } = &mut *c;
        for &pipe in pipes {
            engine.refuse_sends(pipe, e.clone(), &mut |f| deliver(sinks, f));
        }
    }

    /// Posts ops that move caller memory in place, as [`Poster::post`] does.
    ///
    /// # Safety
    /// Each op's region stays allocated, and untouched by anyone else, until that op's end has
    /// come back on the pipe's queue (as [`Engine::post_region`] requires).
    pub unsafe fn post_regions(&self, pipe: u32, ops: &[RegionOp]) {
        let kick = {
            let mut c = lock(&self.core);
            if c.closed {
                return;
            }
            // SAFETY: this function's contract is `post_regions`'s.
            unsafe { c.post_regions(pipe, ops) };
            c.after_post()
        };
        if kick {
            self.signal.raise();
        }
    }
}

impl Core {
    /// Notes a direct post; says whether the actor needs a kick (it does not spin, and none is
    /// on its way).
    fn after_post(&mut self) -> bool {
        self.posted = true;
        let kick = !self.spinning && !self.kicked;
        self.kicked |= kick;
        kick
    }
}

/// How a poster (or the spin task) wakes the actor: flags and the waker of
/// [`super::drive::Drive`].
#[derive(Default)]
pub(super) struct KickSignal {
    /// A direct post while the actor does not spin.
    pub(super) raised: AtomicBool,
    /// The spin task's spin is over (it is no longer due).
    pub(super) spin_over: AtomicBool,
    pub(super) waker: Mutex<Option<Waker>>,
}

impl KickSignal {
    /// Raises the kick flag, then wakes the actor's driver if it waits (it re-reads the flags
    /// after arming).
    pub(super) fn raise(&self) {
        self.raised.store(true, Ordering::Release);
        self.wake();
    }

    /// Says that a spin is over, then wakes the actor's driver as [`KickSignal::raise`] does.
    pub(super) fn end_spin(&self) {
        self.spin_over.store(true, Ordering::Release);
        self.wake();
    }

    fn wake(&self) {
        let waker = self.waker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests;
