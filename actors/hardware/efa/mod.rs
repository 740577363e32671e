//! The `FabricEndpoint` actor: one libfabric endpoint (with its completion queue and address
//! vector) per (context, fabric domain), shared by every pipe on that NIC.
//!
//! It owns an [`Engine`] (the backlog, ordering and fault injection live there), shared with
//! the pipes' [`Poster`]s behind one lock, and decides when to progress it:
//!
//! - **Wait fd** (providers whose CQ has one: `tcp;ofi_rxm`): after each pass the actor asks
//!   `fi_trywait` and then sleeps on the fd through tokio; idle, it costs nothing.
//! - **Polling** (no wait fd: `shm`; or any provider while the backlog holds ops, which need
//!   retries that no completion may announce): while ops are in flight the actor spins (below)
//!   for `spin` after the last completion or post, then sleeps between polls an eighth of the
//!   quiet so far, from `min_sleep` (25 µs) up to `max_sleep` (1 ms), on a `timerfd` (tokio's
//!   timer ticks in milliseconds: `timer.rs`). With nothing in flight and no wait fd it does not
//!   poll at all.
//! - **Spin** (opt-in on providers with a wait fd, [`EndpointConfig::busy_poll`]; the first
//!   `spin` of polling mode): while ops are in flight, for the spin window after the last
//!   completion or post, the endpoint reads the CQ on every turn of its thread and wakes
//!   itself again at once. The spin is a task of the thread of its own (`Spinner` in
//!   `spin.rs`), sharing the passes' state with the actor (`Progress` in `progress.rs`): no
//!   allocation per turn, no poll of the actor's mailbox and timers per turn, and no park of
//!   the runtime in between, so no `epoll_wait` per turn and no sleep on the wait fd; it tells
//!   the actor when it is over. Other tasks of the thread still run between turns, and other
//!   threads get the CPU every 20 µs (`sched_yield`; the shm transport's spin yields too). Any
//!   completion or post extends the window, and one that comes while the actor sleeps (on the
//!   fd, or between polls) starts a spin at once. Past the window the actor waits as above, so
//!   an idle endpoint costs what it costs without spin. In spin mode with nothing in flight
//!   inside the window (between a ping-pong's messages) only a timer for the window's end is
//!   armed: sleeping on the fd would take `fi_trywait`, after which `tcp;ofi_rxm` signals its
//!   wait fd again per completion.
//!
//! Operations come from a pipe's [`Poster`] (`poster.rs`: straight into the engine, under
//! the lock the actor's progress takes too, no mailbox hop) or as [`FabricPost`]; their ends
//! go to the pipe's unbounded queue, given at [`FabricAttach`], in the pipe's post order (no
//! hop back). The actor reads the CQ, and while it spins so may a waiting stream reader
//! ([`Poster::spin_pass`]).

pub mod channel;
mod drive;
mod metrics;
mod poster;
mod progress;
mod spin;
pub mod stream;
mod timer;
pub mod transport;
use std::cell::RefCell;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::backend::efa::engine::{Engine, Finished, Kind, Op, Region, Stats};
#[cfg(feature = "faults")]
use crate::backend::efa::faults::Faults;
use crate::backend::efa::{Attributes, Domain, Endpoint, FabricError, InfoList};
use crate::error::{Error, Origin};
use crate::transport::stream::Memory;
use drive::Drive;
use poster::KickSignal;
use poster::{deliver, lock, Core};
pub use poster::{Claim, Poster};
use progress::{Progress, Stamp};
use spin::Spinner;

/// How a [`FabricEndpoint`] progresses its completion queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointConfig {
    /// How long to keep polling on every turn after the last completion or post (no-fd mode).
    pub spin: Duration,
    /// The shortest sleep between polls past the spin window (no-fd mode). Each sleep is an
    /// eighth of the quiet so far (the time since the last completion or post), within
    /// `min_sleep` and `max_sleep`: a message that lands after a quiet of `q` is read at most
    /// `q / 8` later (or `max_sleep`), not up to `max_sleep` whatever the quiet.
    pub min_sleep: Duration,
    /// The longest sleep between polls while ops are in flight (no-fd mode).
    pub max_sleep: Duration,
    /// Fault injection (tests; feature `faults`).
    #[cfg(feature = "faults")]
    pub faults: Faults,
    /// Open the CQ without a wait fd and poll it, even where the provider offers one
    /// (`Endpoint::open_with`). Saves the provider's signalling of that fd, on `tcp;ofi_rxm` a
    /// `write` and a `read` system call per completion; costs the polling mode's idle CPU and
    /// its back-off: after `spin` without activity, a message that arrives waits for the next
    /// poll, up to `max_sleep` (docs/efa.md, "Progress").
    pub force_polling: bool,
    /// Register the memory of in-place ops (the `efa` channel's) even where the provider does
    /// not require it, through the registration cache (tests: the path `FI_MR_LOCAL`
    /// providers take).
    pub register_all: bool,
    /// Spin mode (zero: off, the default): busy-poll the CQ on every turn of the thread for
    /// this long after the last completion or post, instead of sleeping on the wait fd or
    /// yielding through the runtime. Bounded: the thread is busy at most `busy_poll` past the
    /// last activity. `ACTORPIPE_EFA_SPIN` sets it for the context's own `efa` endpoints
    /// ([`ContextBuilder::from_env`](crate::ContextBuilder::from_env)).
    pub busy_poll: Duration,
    /// In spin mode, a stream's reader that waits keeps reading the CQ within each poll (for up
    /// to `stream::READER_BURST`) only while its stream is in a quick exchange: this wait began
    /// less than this long after its previous one (a stream's first wait never does). Other
    /// waits read it once a poll, so that they hold up the thread's other tasks less. Default
    /// `stream::READER_HOT` (25 µs); `Duration::MAX` makes every wait but a stream's first
    /// burst, zero none.
    pub quick_exchange: Duration,
    /// Shared receives for the control streams of every pipe on the endpoint (the inbox,
    /// docs/efa.md "Many pipes on one endpoint"): the receives an endpoint holds for its streams
    /// are these, whatever the number of pipes, instead of `stream::WINDOW` + 2 per pipe. At
    /// most half the provider's `rx_size`. Only where the provider takes such shared receives
    /// ([`crate::backend::efa::shares_receives`]: rxm over tcp, not its passthru, not libfabric
    /// 1.17's `shm`); elsewhere every stream keeps its own. 0: no inbox anywhere. Default
    /// [`stream::INBOX`].
    pub inbox: usize,
    /// The most pipes the endpoint serves at once (each direction of an efa pipe's control
    /// stream is one, and of each link of its efa channel): an attach beyond it is refused
    /// ([`Error::Refused`], retryable), and a `Connect` that needs it fails so, the other
    /// pipes untouched. Without an inbox the provider's `rx_size` bounds it too (each stream
    /// keeps `stream::WINDOW` + 2 receives). Default [`MAX_PIPES`].
    pub max_pipes: usize,
}

/// The default of [`EndpointConfig::max_pipes`]: 8,192 efa pipes on the `basic` channel.
pub const MAX_PIPES: usize = 1 << 14;

impl Default for EndpointConfig {
    fn default() -> Self {
        EndpointConfig {
            spin: Duration::from_micros(200),
            min_sleep: Duration::from_micros(25),
            max_sleep: Duration::from_millis(1),
            #[cfg(feature = "faults")]
            faults: Faults::NONE,
            force_polling: false,
            register_all: false,
            busy_poll: Duration::ZERO,
            quick_exchange: stream::READER_HOT,
            inbox: stream::INBOX,
            max_pipes: MAX_PIPES,
        }
    }
}

/// How often an endpoint checks whether anyone still uses it.
const ORPHAN_CHECK: Duration = Duration::from_secs(2);

/// The next progress [`FabricEndpoint::schedule`] arms.
enum Plan {
    Spin,
    Defer(Duration),
    Wait,
    Poll(Duration),
    Nothing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    Idle,
    Polling,
    Waiting,
    Spinning,
    Deferred,
}

/// One endpoint actor. See the module docs.
pub struct FabricEndpoint {
    // Our own duplicate of the CQ's wait fd: it stays valid whenever libfabric closes its own.
    wait: Option<Rc<AsyncFd<OwnedFd>>>,
    // The engine, the pipes' queues and the quarantine, shared with the pipes' [`Poster`]s.
    core: Arc<Mutex<Core>>,
    // How the posters kick the actor when it does not spin (see `poster.rs`).
    signal: Arc<KickSignal>,
    config: EndpointConfig,
    /// What progress is armed ([`Drive`] acts on it), and when a timed one is due.
    driver: Driver,
    deadline: Option<tokio::time::Instant>,
    // What passes keep between them, shared with the spin task.
    progress: Rc<RefCell<Progress>>,
    origin: Origin,
    /// The transport instance it serves ([`EndpointInfo::instance`]).
    instance: u64,
}

/// What an endpoint is: its address and its domain's attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// The endpoint's address, for peers' address vectors.
    pub name: Vec<u8>,
    /// Provider, fabric, domain and limits.
    pub attributes: Attributes,
    /// Whether the CQ has a wait fd (else the actor polls).
    pub wait_fd: bool,
    /// The `efa` transport instance it serves (or its own number, opened on its own): the
    /// `endpoint` label of its `actorpipe_efa_backlog_operations` gauge.
    pub instance: u64,
}

/// Converts a libfabric failure into the crate's error (class `io`), naming the provider and
/// `fi_strerror`'s text.
pub fn fabric_error(e: FabricError, origin: &Origin) -> Error {
    let op = e.op;
    Error::io(op, std::io::Error::other(e), origin)
}

/// A descriptor of our own for the CQ's wait object (the same open file), so that tokio's
/// registration never outlives the descriptor it watches, whatever order things drop in.
fn duplicate(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor libfabric holds open while the endpoint lives
    // (the caller has the endpoint); the result is a new descriptor that we own.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if d < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `d` is a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(d) })
}

/// A number no other `efa` transport instance (nor endpoint opened on its own) of this process
/// has: which endpoint actors a transport shares with its clones, and the `endpoint` label of
/// their backlog gauge.
pub(crate) fn next_instance() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl FabricEndpoint {
    /// Opens an endpoint of `provider` (`efa`, `tcp;ofi_rxm`, `shm`) on its domain named
    /// `domain` (`None`: the provider's first), and starts its actor on the current arbiter.
    /// Its backlog gauge's `endpoint` label is a number of its own.
    pub fn open(
        provider: &str,
        domain: Option<&str>,
        config: EndpointConfig,
    ) -> Result<Addr<FabricEndpoint>, Error> {
        FabricEndpoint::open_for(next_instance(), provider, domain, config)
    }

    /// [`FabricEndpoint::open`] for the `efa` transport instance numbered `instance`: the
    /// `endpoint` label of its backlog gauge.
    pub(crate) fn open_for(
        instance: u64,
        provider: &str,
        domain: Option<&str>,
        config: EndpointConfig,
    ) -> Result<Addr<FabricEndpoint>, Error> {
        let origin = Origin::new("", format!("efa[{provider}]"));
        let list = InfoList::get(Some(provider)).map_err(|e| fabric_error(e, &origin))?;
        let info = list
            .iter()
            .find(|i| domain.is_none_or(|d| i.attributes().domain == d))
            .ok_or_else(|| Error::Unavailable {
                backend: "efa".into(),
                reason: format!(
                    "provider {provider} has no domain {:?} here",
                    domain.unwrap_or_default()
                ),
            })?;
        let dom = Domain::open(info).map_err(|e| fabric_error(e, &origin))?;
        let ep = Endpoint::open_with(&dom, info, !config.force_polling)
            .map_err(|e| fabric_error(e, &origin))?;
        let wait = match (ep.wait_fd(), config.force_polling) {
            (Some(fd), false) => {
                let fd =
                    duplicate(fd).map_err(|e| Error::io("duplicating the CQ fd", e, &origin))?;
                let afd = crate::backend::shm::fd::watch(fd)
                    .map_err(|e| Error::io("registering the CQ fd", e, &origin))?;
                Some(Rc::new(afd))
            }
            _ => None,
        };
        let lazily = wait.is_some() && config.busy_poll.is_zero();
        let a = ep.domain().attributes();
        let metrics = metrics::EndpointMetrics::open(&a.provider, &a.domain, instance);
        let inbox = crate::backend::efa::shares_receives(&a.provider)
            .then(|| stream::BOUNCE.min(a.max_msg_size.max(1) as usize));
        let mut engine = Engine::new(ep);
        #[cfg(feature = "faults")]
        engine.set_faults(config.faults);
        engine.set_register_all(config.register_all);
        if let Some(size) = inbox {
            engine.set_inbox(config.inbox, size);
        }
        let core = Arc::new(Mutex::new(Core::new(engine)));
        let progress = Progress {
            core: core.clone(),
            config,
            wait_fd: wait.is_some(),
            last_activity: Stamp::new(lazily),
            metrics,
            polls: 0,
            spin: None,
            spins: 0,
            spinner: None,
            closed: false,
            readers_seen: 0,
        };
        Ok(FabricEndpoint {
            wait,
            core,
            signal: Arc::default(),
            config,
            driver: Driver::Idle,
            deadline: None,
            progress: Rc::new(RefCell::new(progress)),
            origin,
            instance,
        }
        .start())
    }

    /// The shared core, locked.
    fn core(&self) -> std::sync::MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// Stops the actor once nobody holds its address and every pipe is detached: the
    /// endpoint, its CQ and AV close with it (once the pipes' [`Poster`]s are gone too). Ops of
    /// detached pipes that the provider still holds (a send to a dead peer that `fi_cancel`
    /// cannot take back) wait for the next orphan check (`late`): closing the endpoint is what
    /// frees them, and only then are their buffers dropped (the engine closes the endpoint
    /// first).
    fn maybe_stop(&mut self, ctx: &mut Context<Self>, late: bool) {
        if ctx.connected() {
            return;
        }
        let c = self.core();
        if c.engine.live_pipes() > 0 {
            return;
        }
        let idle = c.engine.stats().pipes == 0;
        drop(c);
        if idle || late {
            ctx.stop();
        }
    }

    /// One progress pass, then the next wake-up.
    fn tick(&mut self, ctx: &mut Context<Self>) {
        self.progress.borrow_mut().pass();
        self.schedule();
        self.maybe_stop(ctx, false);
    }

    /// A kick (a direct post while not spinning): reads the CQ now and arms the next progress.
    fn kicked(&mut self, ctx: &mut Context<Self>) {
        self.progress.borrow_mut().activity();
        // Manual-progress providers move data only when the CQ is read: read it now.
        self.tick(ctx);
    }

    /// Disarms what was armed: [`Drive`] ignores a state it no longer finds, and the spin
    /// task ends a spin at its next turn.
    fn cancel(&mut self) {
        self.progress.borrow_mut().spin = None;
        self.driver = Driver::Idle;
        self.deadline = None;
    }

    /// The spin task's word that its spin is over (no longer due): arms what comes next.
    fn spin_over(&mut self, ctx: &mut Context<Self>) {
        // Only while a spin drives the endpoint and none is under way: a spin cancelled
        // meanwhile (the actor armed something else), or followed by a newer one, is not ours
        // to end.
        if self.driver != Driver::Spinning || self.progress.borrow().spin.is_some() {
            return;
        }
        self.driver = Driver::Idle;
        self.schedule();
        self.maybe_stop(ctx, false);
    }

    /// What to arm next, decided under the lock: whether the actor spins is published to the
    /// posters (`Core::spinning`) in the same critical section that takes their `posted`, so
    /// a direct post either extends a spin that goes on or kicks a wait.
    fn plan(&mut self) -> Plan {
        let mut p = self.progress.borrow_mut();
        let mut c = lock(&self.core);
        if std::mem::take(&mut c.posted) {
            p.activity();
        }
        let (busy, backlogged) = (c.engine.busy(), c.engine.backlogged());
        let window = p.spin_window(backlogged);
        let fd_mode = self.wait.is_some() && !backlogged;
        let defer = if fd_mode && !busy {
            self.config.busy_poll
        } else {
            Duration::ZERO
        };
        // The clock only where a window is open (none without spin where there is a wait fd).
        let quiet = if (busy && !window.is_zero()) || !defer.is_zero() {
            p.last_activity.quiet(Instant::now())
        } else {
            Duration::MAX
        };
        let spin = busy && quiet < window;
        c.spinning = spin;
        // Readers pass only in spin mode proper, not in the polling window of a provider with
        // no wait fd: see `Core::readers_spin`.
        c.readers_spin = spin && !self.config.busy_poll.is_zero();
        if spin {
            return Plan::Spin;
        }
        if quiet < defer {
            return Plan::Defer(defer - quiet);
        }
        if fd_mode {
            return match c.engine.endpoint().trywait() {
                true => Plan::Wait,
                // Completions (or provider work) are pending: go round once more.
                false => Plan::Poll(Duration::ZERO),
            };
        }
        if !c.engine.busy() {
            return Plan::Nothing;
        }
        // Past the spin window (a spin was due otherwise): sleep between polls, a share of the
        // quiet so far.
        let quiet = if quiet == Duration::MAX {
            p.last_activity.quiet(Instant::now())
        } else {
            quiet
        };
        Plan::Poll(progress::poll_sleep(&self.config, quiet))
    }

    /// Arms the next progress: a spin, the wait fd, a poll, or nothing ([`Drive`] and the spin
    /// task act on it; nothing is spawned).
    fn schedule(&mut self) {
        match self.plan() {
            Plan::Spin => {
                // A spin that has just ended (its word not taken yet) runs no more.
                if self.driver != Driver::Spinning || self.progress.borrow().spin.is_none() {
                    self.cancel();
                    self.driver = Driver::Spinning;
                    self.progress.borrow_mut().start_spin();
                }
            }
            Plan::Defer(rest) => {
                // Spin mode, nothing in flight, within the window: a ping-pong's next post
                // comes soon and reads the CQ itself. Sleeping on the fd would first take
                // `fi_trywait`, which makes the provider signal its wait fd again for the next
                // completions. Only the window's end is armed: then the fd, as usual.
                if self.driver != Driver::Deferred {
                    self.cancel();
                    self.driver = Driver::Deferred;
                    self.deadline = Some(tokio::time::Instant::now() + rest);
                }
            }
            Plan::Wait => {
                if self.driver != Driver::Waiting && self.wait.is_some() {
                    self.cancel();
                    self.driver = Driver::Waiting;
                }
            }
            Plan::Poll(delay) => {
                if self.driver != Driver::Polling {
                    self.cancel();
                    self.driver = Driver::Polling;
                    // None: a yield.
                    self.deadline = (!delay.is_zero()).then(|| tokio::time::Instant::now() + delay);
                }
            }
            Plan::Nothing => self.cancel(),
        }
    }
}

impl Actor for FabricEndpoint {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // An endpoint opened and never used (a bootstrap that failed before attaching) has no
        // message left to notice that it is unused: look every 2 s.
        ctx.run_interval(ORPHAN_CHECK, |act, ctx| act.maybe_stop(ctx, true));
        ctx.spawn(Drive::new(self.signal.clone()));
        actix::spawn(Spinner::new(self.progress.clone(), self.signal.clone()));
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        self.cancel();
        self.progress.borrow_mut().close();
        // Nothing progresses the engine any more: posters stop posting, and the pipes' queues
        // close (their halves see the actor gone). The engine itself closes with the last
        // reference to the core.
        let mut c = self.core();
        c.closed = true;
        c.spinning = false;
        c.readers_spin = false;
        c.sinks.clear();
    }
}

/// Attaches a pipe to the peer at endpoint address `peer`: answers the pipe's number (the
/// peer uses it in the tags it sends to this pipe). Ends go to `sink`.
#[derive(Message)]
#[rtype(result = "Result<u32, Error>")]
pub struct FabricAttach {
    /// The peer endpoint's address.
    pub peer: Vec<u8>,
    /// Where this pipe's [`Finished`] ops go, in post order.
    pub sink: mpsc::UnboundedSender<Finished>,
}

/// Ends a pipe: its pending ops fail with `reason`, in order, and it is forgotten.
#[derive(Message)]
#[rtype(result = "()")]
pub struct FabricDetach {
    /// The pipe.
    pub pipe: u32,
    /// Why (in the ops' errors).
    pub reason: String,
}

/// Posts ops for a pipe, in order.
#[derive(Message)]
#[rtype(result = "()")]
pub struct FabricPost {
    /// The pipe.
    pub pipe: u32,
    /// The ops, in order.
    pub ops: Vec<Op>,
}

/// One op that moves caller memory in place (the `efa` channel's, through
/// [`Poster::post_regions`]); its end comes back on the pipe's queue with an empty `mem`.
#[derive(Debug, Clone, Copy)]
pub struct RegionOp {
    /// Send or receive.
    pub kind: Kind,
    /// The tag.
    pub tag: u64,
    /// The memory.
    pub region: Region,
    /// The caller's number for it, handed back in its [`Finished`].
    pub id: u64,
}

/// Hands the endpoint buffers of a detached pipe that its provider may still read or write
/// (ops it could not cancel): the endpoint keeps its reference until the engine has forgotten
/// the pipe (every op back), or until it has closed. Several endpoints may share one set (a
/// channel striped over domains): the buffers are dropped when the last lets go.
#[derive(Message)]
#[rtype(result = "()")]
pub struct FabricQuarantine {
    /// The pipe.
    pub pipe: u32,
    /// The buffers (owned, or references to shared bytes).
    pub buffers: Arc<Mutex<Vec<Memory>>>,
}

/// Asks for a [`Poster`]: a handle that posts a pipe's ops without a message to the actor.
#[derive(Message)]
#[rtype(result = "Poster")]
pub struct FabricShare;

/// Asks for the endpoint's address and attributes.
#[derive(Message)]
#[rtype(result = "EndpointInfo")]
pub struct FabricDescribe;

/// Asks for the counters.
#[derive(Message)]
#[rtype(result = "Stats")]
pub struct FabricStats;

/// Replaces the fault-injection settings (feature `faults`).
#[cfg(feature = "faults")]
#[derive(Message)]
#[rtype(result = "()")]
pub struct FabricFaults(pub Faults);

impl Handler<FabricAttach> for FabricEndpoint {
    type Result = Result<u32, Error>;
    fn handle(&mut self, m: FabricAttach, _: &mut Context<Self>) -> Self::Result {
        let mut c = self.core();
        let mut limit = self.config.max_pipes;
        if !c.engine.has_inbox() {
            // Each stream's halves keep WINDOW + 2 receives between them.
            let per_pair = stream::WINDOW as usize + 2;
            limit = limit.min(c.engine.rx_limit().saturating_mul(2) / per_pair);
        }
        if c.engine.live_pipes() >= limit {
            return Err(Error::Refused {
                reason: format!(
                    "the {} endpoint serves its most pipes ({limit})",
                    c.engine.attributes().provider
                ),
                origin: self.origin.clone(),
            });
        }
        let pipe = c
            .engine
            .attach(&m.peer)
            .map_err(|e| fabric_error(e, &self.origin))?;
        c.sinks.insert(pipe, m.sink);
        Ok(pipe)
    }
}

impl Handler<FabricShare> for FabricEndpoint {
    type Result = MessageResult<FabricShare>;
    fn handle(&mut self, _: FabricShare, ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(Poster::new(
            self.core.clone(),
            self.signal.clone(),
            ctx.address(),
            self.config.quick_exchange,
        ))
    }
}

impl Handler<FabricDetach> for FabricEndpoint {
    type Result = ();
    fn handle(&mut self, m: FabricDetach, ctx: &mut Context<Self>) {
        {
            let mut c = self.core();
            let e = FabricError {
                op: "pipe",
                provider: c.engine.attributes().provider.clone(),
                code: crate::backend::efa::ecanceled(),
                text: m.reason,
            };
            let Core { engine, sinks, .. } = &mut *c;
            engine.detach(m.pipe, e, &mut |f| deliver(sinks, f));
            c.forget();
            // Its backlogged ops ended: the backlog gauge follows at once.
            let stats = c.engine.stats();
            drop(c);
            self.progress.borrow_mut().metrics.publish(stats);
        }
        self.schedule();
        self.maybe_stop(ctx, false);
    }
}

impl Handler<FabricPost> for FabricEndpoint {
    type Result = ();
    fn handle(&mut self, m: FabricPost, ctx: &mut Context<Self>) {
        self.core().post(m.pipe, m.ops);
        self.progress.borrow_mut().activity();
        // Manual-progress providers move data only when the CQ is read: read it now.
        self.tick(ctx);
    }
}

impl Handler<FabricQuarantine> for FabricEndpoint {
    type Result = ();
    fn handle(&mut self, m: FabricQuarantine, _: &mut Context<Self>) {
        let mut c = self.core();
        if c.engine.attached(m.pipe) {
            c.quarantine.entry(m.pipe).or_default().push(m.buffers);
        }
    }
}

impl Handler<FabricDescribe> for FabricEndpoint {
    type Result = MessageResult<FabricDescribe>;
    fn handle(&mut self, _: FabricDescribe, _: &mut Context<Self>) -> Self::Result {
        let c = self.core();
        MessageResult(EndpointInfo {
            name: c.engine.endpoint().name().to_vec(),
            attributes: c.engine.attributes().clone(),
            wait_fd: self.wait.is_some(),
            instance: self.instance,
        })
    }
}

impl Handler<FabricStats> for FabricEndpoint {
    type Result = MessageResult<FabricStats>;
    fn handle(&mut self, _: FabricStats, _: &mut Context<Self>) -> Self::Result {
        let (stats, reader_passes, reader_claims) = {
            let c = self.core();
            (c.engine.stats(), c.reader_passes, c.reader_claims)
        };
        let mut p = self.progress.borrow_mut();
        // What is returned is published too: a post the actor has not looked at yet (an
        // inject, which leaves nothing to progress) shows in both at once.
        p.metrics.publish(stats.clone());
        MessageResult(Stats {
            polls: p.polls,
            reader_passes,
            reader_claims,
            ..stats
        })
    }
}

#[cfg(feature = "faults")]
impl Handler<FabricFaults> for FabricEndpoint {
    type Result = ();
    fn handle(&mut self, m: FabricFaults, _: &mut Context<Self>) {
        self.core().engine.set_faults(m.0);
    }
}
