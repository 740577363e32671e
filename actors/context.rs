//! The `Context` actor: the registry of backends; it dials pipes and starts listeners.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::listener::Listener;
use super::messages::{Connect, Endpoint, GetMetricsAddr, Listen, Listening, NotListening};
use super::pipe::{spawn_pipe, Pipe, PipeParts};
use crate::backend::basic::{Basic, DEFAULT_CHUNK_SIZE};
use crate::backend::cma::Cma;
use crate::backend::mpt::Mpt;
use crate::backend::shm::Shm;
use crate::backend::tcp::Tcp;
use crate::backend::xth::Xth;
use crate::channel::ChannelBackend;
use crate::error::Error;
use crate::handshake::{self, Halves};
use crate::negotiate::{Brochure, Offer, Purpose};
use crate::transport::liveness::Heartbeat;
use crate::transport::{scheme, Acceptor, Transport};
use crate::wire::Limits;

/// Default of [`ContextBuilder::max_pending_pipes`].
pub const DEFAULT_MAX_PENDING_PIPES: usize = 128;

/// `ACTORPIPE_LOOPS_ON_RUNTIME` (`1`, `true` or `yes`): the default of
/// [`ContextBuilder::loops_on_runtime`].
fn loops_on_runtime_from_env() -> bool {
    std::env::var("ACTORPIPE_LOOPS_ON_RUNTIME")
        .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes"))
}

/// `ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER` (`0`, `false` or `no` turn it off): the default of
/// [`ContextBuilder::read_loop_follows_handler`] (on).
fn read_loop_follows_handler_from_env() -> bool {
    !std::env::var("ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER")
        .is_ok_and(|v| matches!(v.trim(), "0" | "false" | "no"))
}

/// Settings shared by every pipe of a context.
pub struct Config {
    pub(crate) limits: Limits,
    pub(crate) chunk_size: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_pending_pipes: usize,
    pub(crate) cma_threads: usize,
    /// The control connection's loops on the runtime's own queue, not the arbiter's `LocalSet`.
    pub(crate) loops_on_runtime: bool,
    /// The control connection's read loop on the runtime's own queue while a handler stands.
    pub(crate) read_loop_follows_handler: bool,
    /// The I/O threads channels' own connections (mpt lanes) run their loops on.
    pub(crate) io: Arc<super::pool::IoPool>,
    pub(crate) cma_inline_max: Option<u64>,
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    pub(crate) secret: Option<Arc<[u8]>>,
    pub(crate) heartbeat: Option<Heartbeat>,
    pub(crate) transports: Vec<(Arc<dyn Transport>, i32)>,
    pub(crate) channels: Vec<(Arc<dyn ChannelBackend>, i32)>,
    /// The CUDA IPC handle caches of this context, one actor per device (made on first use).
    #[cfg(feature = "cuda")]
    pub(crate) ipc: Arc<crate::actors::hardware::cuda_ipc::IpcCaches>,
}

impl Config {
    /// What this context offers in negotiation; `addresses` lists, per transport name, where a
    /// listener can be reached.
    pub(crate) fn brochure(&self, addresses: &[(String, String)]) -> Brochure {
        Brochure {
            transports: self
                .transports
                .iter()
                .map(|(t, priority)| Offer {
                    name: t.name().into(),
                    priority: *priority,
                    domain: t.domain(),
                    addresses: addresses
                        .iter()
                        .filter(|(n, _)| n == t.name())
                        .map(|(_, a)| a.clone())
                        .collect(),
                })
                .collect(),
            channels: self
                .channels
                .iter()
                .map(|(c, priority)| c.offer(*priority))
                .collect(),
        }
    }

    /// The read buffer of the connections of the channel called `name` (its lanes).
    pub(crate) fn lane_read_buffer(&self, name: &str) -> usize {
        self.channels
            .iter()
            .find(|(c, _)| c.name() == name)
            .map_or(crate::transport::stream::READ_BUFFER, |(c, _)| {
                c.lane_read_buffer()
            })
    }

    pub(crate) fn transport(&self, name: &str) -> Result<&Arc<dyn Transport>, Error> {
        self.transports
            .iter()
            .map(|(t, _)| t)
            .find(|t| t.name() == name)
            .ok_or_else(|| Error::Unavailable {
                backend: name.into(),
                reason: format!(
                    "no transport named {name:?} is enabled in this context (enabled: {})",
                    self.transports
                        .iter()
                        .map(|(t, _)| t.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("limits", &self.limits)
            .field("chunk_size", &self.chunk_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_pending_pipes", &self.max_pending_pipes)
            .field("cma_threads", &self.cma_threads)
            .field("loops_on_runtime", &self.loops_on_runtime)
            .field("read_loop_follows_handler", &self.read_loop_follows_handler)
            .field("io_threads", &self.io.size())
            .field("cma_inline_max", &self.cma_inline_max)
            .field("metrics_addr", &self.metrics_addr)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field(
                "transports",
                &self
                    .transports
                    .iter()
                    .map(|(t, p)| (t.name(), *p))
                    .collect::<Vec<_>>(),
            )
            .field(
                "channels",
                &self
                    .channels
                    .iter()
                    .map(|(c, p)| (c.name(), *p))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Builds a [`Context`].
///
/// With no settings it enables every backend that can run here: transports `tcp` and `shm`,
/// channels `basic`, `xth`, `cma` (if a trial read of this process succeeds) and `mpt` (2 lanes),
/// and with the `cuda` feature `cuda_xth` (one per device pair) where a CUDA GPU is, and
/// `cuda_ipc` and `cuda_basic` there too when asked for (`ACTORPIPE_CUDA_IPC=1`,
/// `ACTORPIPE_CUDA_BASIC=1`: docs/cuda.md).
/// Every backend can be removed ([`without`](Self::without)), re-prioritised
/// ([`priority`](Self::priority)) or replaced by one configured differently
/// ([`transport`](Self::transport), [`channel`](Self::channel)).
#[derive(Debug)]
pub struct ContextBuilder {
    config: Config,
    /// The settings `lanes` and `lane_addresses` build the mpt channel from.
    mpt: Mpt,
}

impl Default for ContextBuilder {
    fn default() -> Self {
        let mut b = ContextBuilder {
            mpt: Mpt::default(),
            config: Config {
                limits: Limits::default(),
                chunk_size: DEFAULT_CHUNK_SIZE,
                connect_timeout: Duration::from_secs(10),
                handshake_timeout: Duration::from_secs(10),
                max_pending_pipes: DEFAULT_MAX_PENDING_PIPES,
                cma_threads: crate::backend::cma::default_threads(super::pool::available_cores()),
                loops_on_runtime: loops_on_runtime_from_env(),
                read_loop_follows_handler: read_loop_follows_handler_from_env(),
                // Sized from the machine (none on 2 cores or fewer); no thread starts until
                // an mpt pipe has a second lane.
                io: Arc::new(super::pool::IoPool::new(super::pool::default_threads(
                    super::pool::available_cores(),
                ))),
                cma_inline_max: None,
                metrics_addr: None,
                secret: None,
                heartbeat: Some(Heartbeat::default()),
                transports: Vec::new(),
                channels: Vec::new(),
                #[cfg(feature = "cuda")]
                ipc: Default::default(),
            },
        };
        b = b
            .transport(Arc::new(Tcp::default()))
            .transport(Arc::new(Shm::new()));
        #[cfg(feature = "efa")]
        {
            // Offered only where its provider runs (efa, or ACTORPIPE_EFA_PROVIDER).
            let efa = crate::actors::hardware::efa::transport::Efa::from_env();
            if efa.viable().is_ok() {
                let channel = crate::backend::efa::channel::Efa::over(&efa).domains_from_env();
                b = b.transport(Arc::new(efa)).channel(Arc::new(channel));
            }
        }
        b = b
            .channel(Arc::new(Basic))
            .channel(Arc::new(Xth))
            .channel(Arc::new(Mpt::default()));
        b = b.channel(Arc::new(Cma));
        #[cfg(feature = "cuda")]
        for c in crate::backend::cuda_xth::CudaXth::all() {
            b = b.channel(c);
        }
        #[cfg(feature = "cuda")]
        for c in crate::backend::cuda_ipc::CudaIpc::all() {
            b = b.channel(c);
        }
        #[cfg(feature = "cuda")]
        for c in crate::backend::cuda_basic::CudaBasic::all() {
            b = b.channel(c);
        }
        b
    }
}

impl ContextBuilder {
    /// Bounds on what peers may announce (frame size, counts, sizes, metadata).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.config.limits = limits;
        self
    }

    /// Bytes per chunk when a tensor goes over a connection (basic, mpt, cma fallback).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.config.chunk_size = bytes.max(1);
        self
    }

    /// How long dialing a peer may take.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.config.connect_timeout = t;
        self
    }

    /// How long the handshake of a new pipe may take, on either side.
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.config.handshake_timeout = t;
        self
    }

    /// How many pipes a listener of this context sets up at once (handshaking, or waiting for
    /// their extra connections to join); 128 by default. A `Hello` over the bound is refused at
    /// once with "too many pending handshakes" ([`Error::Refused`] on the connecting side), so a
    /// burst of connects cannot make every pipe wait on the others. Independently, a listener
    /// admits a pipe only if the descriptors its connections need fit under `RLIMIT_NOFILE`
    /// (docs/operations.md).
    pub fn max_pending_pipes(mut self, n: usize) -> Self {
        self.config.max_pending_pipes = n.max(1);
        self
    }

    /// Threads per cma read (large tensors are split across them, 1 MiB a thread at least; the
    /// process keeps its reader threads). The default is
    /// [`crate::backend::cma::default_threads`] of the CPUs this process may use: half of them,
    /// 2 to 8.
    pub fn cma_threads(mut self, n: usize) -> Self {
        self.config.cma_threads = n.max(1);
        self
    }

    /// Runs each pipe's control connection loops (its read and write loops) on the queue of the
    /// arbiter's tokio runtime itself rather than on the arbiter's `LocalSet`, where actors run:
    /// one layer of scheduling fewer for every message the read loop hands to a handler
    /// ([`ReceiveAll::calling`](crate::ReceiveAll::calling)) or that a
    /// [`PipeWriter`](crate::PipeWriter) writes in place. Off by default: every message handed to
    /// an actor then crosses from one scheduler to the other and costs more (in spin mode,
    /// `Shm::with_spin`, a 64 B shm round trip to a recipient actor took 3.2–3.6 µs instead of
    /// 1.8–2.1 µs on 16 cores; git history's docs/performance-limits.md, "The loops on the runtime's
    /// queue"). For applications that read through handlers. Only pipes over `tcp` and `shm`
    /// take it: the `efa` and `ibv` streams are driven by actors on the `LocalSet`, and their
    /// loops stay there.
    ///
    /// A handler called from such a loop runs outside the arbiter's `LocalSet`, inside a spare
    /// `LocalSet` of the thread's: `actix::spawn`, `Actor::start` and `spawn_local` work there,
    /// and what they start runs on the same thread
    /// ([`read_loop_follows_handler`](Self::read_loop_follows_handler) says how).
    /// `ACTORPIPE_LOOPS_ON_RUNTIME=1` turns it on for contexts built with defaults (the CLI's).
    pub fn loops_on_runtime(mut self, on: bool) -> Self {
        self.config.loops_on_runtime = on;
        self
    }

    /// While a standing receive calls a handler in place
    /// ([`ReceiveAll::calling`](crate::ReceiveAll::calling)), runs the pipe's control connection
    /// read loop on the queue of the arbiter's tokio runtime itself, and back on the arbiter's
    /// `LocalSet` once the stand ends: the read loop runs where its messages go. On by default;
    /// only pipes over `tcp` and `shm` (as [`loops_on_runtime`](Self::loops_on_runtime), which
    /// puts both loops there for good and overrides this).
    ///
    /// A handler's messages then skip the `LocalSet`'s layer of scheduling: on 16 cores a 64 B
    /// shm round trip without spin answered by a handler took 1.18× the raw eventfd ring instead
    /// of 1.26× (medians of 20 runs; git history's docs/performance-limits.md, "Twelfth round"). The handler
    /// is called inside a spare `LocalSet` of the thread, polled by a task of the arbiter's:
    /// `actix::spawn`, `Actor::start` and tokio's `spawn_local` work in it as on the arbiter's
    /// `LocalSet`, and what they start runs on the same thread. The loop moves at its next
    /// message after the stand begins or ends (a spawn).
    /// `ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER=0` turns it off for contexts built with defaults.
    pub fn read_loop_follows_handler(mut self, on: bool) -> Self {
        self.config.read_loop_follows_handler = on;
        self
    }

    /// Threads of the context's I/O pool, on which the read and write loops of a channel's own
    /// connections run (mpt's lanes, one thread per lane, round robin), so that a channel
    /// striped over several connections uses several cores. The pipe, its channels and its
    /// control connection stay on the context's arbiter, which keeps ordering, and so does
    /// each pipe's first lane, which carries the tensors too small to stripe. 0 runs every loop
    /// on the context's arbiter. The default is [`io_threads_for_machine`]'s size: none on 2
    /// cores or fewer, half the cores above that, at most 16. The threads start when the first
    /// lane needs one and stop when the context and the last loop on them are gone.
    ///
    /// [`io_threads_for_machine`]: Self::io_threads_for_machine
    pub fn io_threads(mut self, n: usize) -> Self {
        self.config.io = Arc::new(super::pool::IoPool::new(n));
        self
    }

    /// [`io_threads`](Self::io_threads) sized from this machine (the CPUs this process may
    /// run on): none on 2 cores or fewer (where a second thread only adds wake-ups to every
    /// lane operation), half the cores above that, at most 16. This is the default.
    pub fn io_threads_for_machine(self) -> Self {
        let n = super::pool::default_threads(super::pool::available_cores());
        self.io_threads(n)
    }

    /// Tensors of at most this many bytes that would go over cma travel on the pipe's own
    /// connection instead, as basic ones do: for them a copy through the transport costs less
    /// than a cross-memory read and its acknowledgement. The default depends on the pipe's
    /// transport ([`crate::backend::cma::inline_max`]); 0 sends every non-empty tensor by cma.
    /// Only the sender's setting counts: the receiver follows the descriptor.
    pub fn cma_inline_max(mut self, bytes: u64) -> Self {
        self.config.cma_inline_max = Some(bytes);
        self
    }

    /// Requires peers to prove they know `secret` (a challenge–response over HMAC-SHA256 in the
    /// handshake; the secret never crosses the wire). Both sides must have the same secret; a
    /// side without one cannot open a pipe to a side with one, or the reverse.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.config.secret = Some(Arc::from(secret.as_ref()));
        self
    }

    /// How a peer that stops without closing (killed, cable pulled, host frozen) is found out,
    /// on every connection of every pipe (control and lanes, any transport):
    ///
    /// - **heartbeats**: a writer with nothing to send sends a 5-byte ping after `interval`
    ///   (capped at `timeout` / 3); a read that waits `timeout` without receiving a byte fails
    ///   with [`Error::Timeout`], and with it every pending operation of the pipe, in order.
    ///   This works with data in flight, and never kills a live peer whose application merely
    ///   stops reading (see [`liveness`](crate::transport::liveness));
    /// - **TCP keepalive** with the same figures (whole seconds, at least 1 s), which also
    ///   cleans up connections whose pipe is not reading.
    ///
    /// Defaults: 2 s and 10 s.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.config.heartbeat = Some(Heartbeat::new(interval, timeout));
        self.tcp(Some(crate::backend::tcp::Keepalive {
            interval,
            timeout,
            unacked_timeout: None,
        }))
    }

    /// The kernel's side of TCP liveness alone, including the abort of connections whose data
    /// stays unacknowledged (see [`Keepalive`](crate::backend::tcp::Keepalive) for the catch).
    /// Heartbeats are left as they are.
    pub fn tcp_keepalive(self, k: crate::backend::tcp::Keepalive) -> Self {
        self.tcp(Some(k))
    }

    /// Turns heartbeats and TCP keepalive off: a peer that vanishes without closing is then
    /// found out only by the kernel (hours), or by per-operation deadlines.
    pub fn no_keepalive(mut self) -> Self {
        self.config.heartbeat = None;
        self.tcp(None)
    }

    fn tcp(mut self, k: Option<crate::backend::tcp::Keepalive>) -> Self {
        for (t, _) in &mut self.config.transports {
            if t.name() == "tcp" {
                *t = Arc::new(Tcp::with_keepalive(k));
            }
        }
        self
    }

    /// Lanes of the mpt channel, keeping its priority; nothing happens if mpt was removed.
    pub fn lanes(self, n: u32) -> Self {
        self.mpt(|m| m.lanes = n.max(1))
    }

    /// Local addresses the mpt lanes this side dials leave from, one per NIC: lane `i` binds
    /// `addresses[i % len]` before connecting, so its traffic goes out through that address's
    /// interface. Each must be an address of this host, of the peer's address family; a lane
    /// that cannot bind fails the `Connect` with the reason. Lanes of pipes this side accepts
    /// are dialed by the peer, from its own lane addresses. Nothing happens if mpt was removed.
    pub fn lane_addresses(self, addresses: impl IntoIterator<Item = std::net::IpAddr>) -> Self {
        let sources: Vec<_> = addresses.into_iter().collect();
        self.mpt(move |m| m.sources = sources)
    }

    /// Tensors of 1 to `bytes` bytes that would go over mpt travel inline instead, after their
    /// descriptor on the pipe's own connection, as basic ones do
    /// ([`crate::backend::mpt::INLINE_MAX`], 256 KiB, by default: below that, striping costs
    /// more than it saves). 0 sends every non-empty tensor over the lanes (those under 64 KiB
    /// whole on the first lane, which runs on the context's thread). Only the sender's setting
    /// counts: the receiver follows the descriptor. Nothing happens if mpt was removed.
    pub fn mpt_inline_max(self, bytes: u64) -> Self {
        self.mpt(|m| m.inline_max = bytes)
    }

    /// Changes the mpt channel's settings, keeping its priority.
    fn mpt(mut self, change: impl FnOnce(&mut Mpt)) -> Self {
        change(&mut self.mpt);
        for (c, _) in &mut self.config.channels {
            if c.name() == "mpt" {
                *c = Arc::new(self.mpt.clone());
            }
        }
        self
    }

    /// Enables the `efa` transport and the `efa` channel over libfabric's `provider` (`efa`,
    /// `tcp;ofi_rxm`, `shm`), on one endpoint per domain, replacing the default ones (which use
    /// `efa`, or `ACTORPIPE_EFA_PROVIDER`). See docs/efa.md.
    #[cfg(feature = "efa")]
    pub fn efa(self, provider: &str) -> Self {
        let t = crate::actors::hardware::efa::transport::Efa::new(provider);
        let c = crate::backend::efa::channel::Efa::over(&t);
        self.transport(Arc::new(t)).channel(Arc::new(c))
    }

    /// [`Self::efa`], with the `efa` channel also on these domains of the provider (empty: every
    /// domain it lists here): large tensors are striped over the domains both peers reach (one
    /// shared endpoint per domain). See docs/efa.md, "Several domains".
    #[cfg(feature = "efa")]
    pub fn efa_domains(self, provider: &str, domains: &[&str]) -> Self {
        let t = crate::actors::hardware::efa::transport::Efa::new(provider);
        let c = crate::backend::efa::channel::Efa::over(&t);
        let c = if domains.is_empty() {
            c.all_domains()
        } else {
            c.domains(domains)
        };
        self.transport(Arc::new(t)).channel(Arc::new(c))
    }

    /// Adds a transport at its default priority, replacing one of the same name.
    pub fn transport(mut self, t: Arc<dyn Transport>) -> Self {
        let p = t.priority();
        self.config.transports.retain(|(x, _)| x.name() != t.name());
        self.config.transports.push((t, p));
        self
    }

    /// Adds a channel at its default priority, replacing one of the same name and device pair.
    pub fn channel(mut self, c: Arc<dyn ChannelBackend>) -> Self {
        let p = c.priority();
        self.config
            .channels
            .retain(|(x, _)| (x.name(), x.devices()) != (c.name(), c.devices()));
        self.config.channels.push((c, p));
        self
    }

    /// Removes the transport or channel called `name`.
    pub fn without(mut self, name: &str) -> Self {
        self.config.transports.retain(|(t, _)| t.name() != name);
        self.config.channels.retain(|(c, _)| c.name() != name);
        self
    }

    /// Keeps only the transports named; handy to force one. A `Listen` or `Connect` URL must
    /// still name an enabled transport.
    pub fn only_transports(mut self, names: &[&str]) -> Self {
        self.config
            .transports
            .retain(|(t, _)| names.contains(&t.name()));
        self
    }

    /// Keeps only the channels named (plus nothing else); handy to force one in tests.
    pub fn only_channels(mut self, names: &[&str]) -> Self {
        self.config
            .channels
            .retain(|(c, _)| names.contains(&c.name()));
        self
    }

    /// Sets the priority of the transport or channel called `name` (higher wins).
    pub fn priority(mut self, name: &str, priority: i32) -> Self {
        for (t, p) in &mut self.config.transports {
            if t.name() == name {
                *p = priority;
            }
        }
        for (c, p) in &mut self.config.channels {
            if c.name() == name {
                *p = priority;
            }
        }
        self
    }

    /// Serves this process's metrics (Prometheus text) at `addr` when the context is built.
    /// Without it, `ACTORPIPE_METRICS_ADDR` (an address, or a port on 127.0.0.1) is used if set.
    /// One exporter serves the whole process; see [`crate::metrics::serve`].
    ///
    /// The address bound (port 0 picks one) or the bind failure is what
    /// [`Context::metrics_addr`] returns, and what [`GetMetricsAddr`] answers once the context
    /// runs.
    pub fn metrics(mut self, addr: std::net::SocketAddr) -> Self {
        self.config.metrics_addr = Some(addr);
        self
    }

    /// Builds the context actor (start it with [`Actor::start`]).
    ///
    /// If metrics were asked for and cannot be served, the context still works, the failure is
    /// logged at error level and [`Context::metrics_addr`] returns it.
    pub fn build(mut self) -> Context {
        // A backend that cannot run here is not offered (`actorpipe info` says why).
        self.config.transports.retain(|(t, _)| match t.viable() {
            Ok(()) => true,
            Err(why) => {
                tracing::info!(transport = t.name(), %why, "transport not offered");
                false
            }
        });
        self.config.channels.retain(|(c, _)| match c.viable() {
            Ok(()) => true,
            Err(why) => {
                tracing::info!(channel = c.name(), %why, "channel not offered");
                false
            }
        });
        let addr = match self.config.metrics_addr {
            Some(a) => Ok(Some(a)),
            None => crate::metrics::addr_from_env(),
        };
        let metrics = match addr {
            Ok(None) => None,
            Ok(Some(a)) => Some(crate::metrics::serve(a)),
            Err(e) => Some(Err(e)),
        };
        if let Some(Err(e)) = &metrics {
            tracing::error!(error = %e, "metrics not served");
        }
        Context {
            config: Arc::new(self.config),
            metrics,
        }
    }

    /// Builds and starts the context on the current arbiter.
    pub fn start(self) -> Addr<Context> {
        self.build().start()
    }

    /// Builds the context here and starts it on another arbiter (another thread: see
    /// `actix::Arbiter`). Its pipes and listeners run there; the returned address works from
    /// any thread.
    pub fn start_in(self, arbiter: &actix::ArbiterHandle) -> Addr<Context> {
        let context = self.build();
        Context::start_in_arbiter(arbiter, move |_| context)
    }
}

/// The registry of backends; send it [`Connect`] and [`Listen`].
#[derive(Debug)]
pub struct Context {
    config: Arc<Config>,
    metrics: Option<Result<std::net::SocketAddr, Error>>,
}

impl Context {
    /// A builder with every backend that can run here.
    pub fn builder() -> ContextBuilder {
        ContextBuilder::default()
    }

    /// Where this process's metrics are served, if this context was asked to serve them
    /// ([`ContextBuilder::metrics`] or `ACTORPIPE_METRICS_ADDR`): the address bound, or why
    /// binding failed. `None` if it was not asked.
    pub fn metrics_addr(&self) -> Option<Result<std::net::SocketAddr, Error>> {
        self.metrics.clone()
    }
}

/// The counters of this context's CUDA IPC handle cache for a device (exports, opened memory,
/// opened events); `None` if no pipe of the context has used CUDA IPC on that device yet.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy)]
pub struct IpcCacheStats(pub u32);

#[cfg(feature = "cuda")]
impl actix::Message for IpcCacheStats {
    type Result = Option<(
        crate::backend::cuda_ipc::cache::Stats,
        crate::backend::cuda_ipc::cache::Stats,
        crate::backend::cuda_ipc::cache::Stats,
    )>;
}

#[cfg(feature = "cuda")]
impl Handler<IpcCacheStats> for Context {
    type Result = ResponseFuture<<IpcCacheStats as actix::Message>::Result>;

    fn handle(&mut self, m: IpcCacheStats, _: &mut Self::Context) -> Self::Result {
        use crate::actors::hardware::cuda_ipc::GetStats;
        let cache = self
            .config
            .ipc
            .devices()
            .contains(&m.0)
            .then(|| self.config.ipc.device(m.0).ok())
            .flatten();
        Box::pin(async move {
            match cache {
                Some(c) => c.addr.send(GetStats).await.ok(),
                None => None,
            }
        })
    }
}

impl Handler<GetMetricsAddr> for Context {
    type Result = Option<Result<std::net::SocketAddr, Error>>;

    fn handle(&mut self, _: GetMetricsAddr, _: &mut Self::Context) -> Self::Result {
        self.metrics_addr()
    }
}

impl Actor for Context {
    type Context = actix::Context<Self>;
}

/// Dials `url`, handshakes, opens every extra connection the choice needs.
async fn dial(config: Arc<Config>, url: String) -> Result<PipeParts, Error> {
    let bootstrap = scheme(&url)?.to_string();
    let t = config.connect_timeout;
    let stream = config.transport(&bootstrap)?.connect(&url, t).await?;
    let secret = config.secret.as_deref();
    let mut hs = handshake::connect(
        stream,
        &config.brochure(&[]),
        secret,
        &config.limits,
        config.handshake_timeout,
    )
    .await?;
    let choice = hs.choice;
    let mut control: Option<Halves> = None;
    let mut lanes: Vec<Vec<Halves>> = choice.channels.iter().map(|_| Vec::new()).collect();
    for purpose in choice.joins(&bootstrap) {
        let stream = match purpose {
            Purpose::Control => {
                let addr = hs
                    .theirs
                    .transports
                    .iter()
                    .find(|o| o.name == choice.transport)
                    .and_then(|o| o.addresses.first())
                    .ok_or_else(|| Error::Unavailable {
                        backend: choice.transport.clone(),
                        reason: "the peer offers it but gives no address for it".into(),
                    })?;
                config
                    .transport(&choice.transport)?
                    .connect(addr, t)
                    .await?
            }
            Purpose::Channel { channel, lane } => {
                let transport = config.transport(&bootstrap)?;
                let name = &choice.channels[channel as usize].name;
                let source = config
                    .channels
                    .iter()
                    .find(|(c, _)| c.name() == name)
                    .and_then(|(c, _)| c.lane_source(lane));
                match source {
                    Some(ip) => transport.connect_from(&url, t, ip).await?,
                    None => transport.connect(&url, t).await?,
                }
            }
        };
        let h = handshake::join(
            stream,
            (&hs.listener_nonce, choice.token),
            purpose,
            secret,
            config.handshake_timeout,
        )
        .await?;
        match purpose {
            Purpose::Control => control = Some(h),
            Purpose::Channel { channel, .. } => {
                let size = config.lane_read_buffer(&choice.channels[channel as usize].name);
                lanes[channel as usize].push(h.with_read_buffer(size));
            }
        }
    }
    // The pipe exists once the listener says it has every connection.
    handshake::accepted(&mut hs.halves, &config.limits, config.handshake_timeout).await?;
    Ok(PipeParts {
        peer: hs.halves.peer.clone(),
        control: control.unwrap_or(hs.halves),
        choice,
        lanes,
    })
}

impl Handler<Connect> for Context {
    type Result = ResponseFuture<Result<Addr<Pipe>, Error>>;

    fn handle(&mut self, msg: Connect, _: &mut Self::Context) -> Self::Result {
        let config = self.config.clone();
        Box::pin(async move {
            match dial(config.clone(), msg.url).await {
                Ok(parts) => Ok(spawn_pipe(parts, &config)),
                Err(e) => {
                    crate::metrics::negotiation_failed(&e);
                    Err(e)
                }
            }
        })
    }
}

impl Handler<Listen> for Context {
    type Result = ResponseFuture<Result<Listening, Error>>;

    fn handle(&mut self, msg: Listen, _: &mut Self::Context) -> Self::Result {
        let config = self.config.clone();
        Box::pin(async move {
            if msg.urls.is_empty() {
                return Err(Error::invalid("Listen needs at least one URL"));
            }
            let mut acceptors: Vec<(String, Box<dyn Acceptor>)> = Vec::new();
            for u in &msg.urls {
                let name = scheme(u)?.to_string();
                let a = config.transport(&name)?.listen(u).await?;
                acceptors.push((name, a));
            }
            // Transports a pipe may move to after bootstrapping need an endpoint too.
            let mut not_listening = Vec::new();
            for (t, _) in &config.transports {
                if acceptors.iter().any(|(n, _)| n == t.name()) {
                    continue;
                }
                if let Some(u) = t.auto_listen_url() {
                    match t.listen(&u).await {
                        Ok(a) => acceptors.push((t.name().to_string(), a)),
                        Err(e) => {
                            tracing::info!(transport = t.name(), url = %u, error = %e, "not listening");
                            not_listening.push(NotListening {
                                transport: t.name().to_string(),
                                url: u,
                                reason: e.to_string(),
                            });
                        }
                    }
                }
            }
            let endpoints: Vec<Endpoint> = acceptors
                .iter()
                .filter(|(n, _)| msg.urls.iter().any(|u| scheme(u).ok() == Some(n.as_str())))
                .flat_map(|(n, a)| {
                    a.urls().into_iter().map(|url| Endpoint {
                        transport: n.clone(),
                        url,
                    })
                })
                .collect();
            let urls = endpoints.iter().map(|e| e.url.clone()).collect();
            let listener = Listener::new(acceptors, msg.subscriber, config, &msg.require).start();
            Ok(Listening {
                listener,
                urls,
                endpoints,
                not_listening,
            })
        })
    }
}
