//! The `Context` actor: the registry of backends; it dials pipes and starts listeners.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::listener::Listener;
use super::messages::{Connect, GetMetricsAddr, Listen, ListenEndpoint, Listening, NotListening};
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

mod env;
#[cfg(test)]
mod tests;

/// Settings shared by every pipe of a context.
pub(crate) struct Config {
    pub(crate) limits: Limits,
    pub(crate) chunk_size: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_pending_pipes: usize,
    pub(crate) cma_threads: usize,
    /// The control connection's loops on the runtime's own queue, not the arbiter's `LocalSet`.
    pub(crate) loops_on_runtime: bool,
    /// Whether pipes get a remote-memory lane (see [`ContextBuilder::remote_lane`]).
    pub(crate) remote_lane: bool,
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
            remote: self.remote_lane,
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

/// The backends and settings, not the I/O pool's threads or the CUDA caches (which hold no
/// settings).
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
            .field("remote_lane", &self.remote_lane)
            .field("read_loop_follows_handler", &self.read_loop_follows_handler)
            .field("io_threads", &self.io.size())
            .field("cma_inline_max", &self.cma_inline_max)
            .field("metrics_addr", &self.metrics_addr)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("heartbeat", &self.heartbeat)
            .field(
                "transports",
                &self
                    .transports
                    .iter()
                    .map(|(t, p)| (t.name(), *p, t))
                    .collect::<Vec<_>>(),
            )
            .field(
                "channels",
                &self
                    .channels
                    .iter()
                    .map(|(c, p)| (c.name(), *p, c))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// How the context's own `efa` transport and channel are made (feature `efa`).
#[cfg(feature = "efa")]
#[derive(Debug, Clone, Default)]
struct EfaSettings {
    /// The provider ([`ContextBuilder::efa`]); `None`: `efa`.
    provider: Option<String>,
    /// The channel's domains ([`ContextBuilder::efa_domains`]); `None`: the transport's one.
    domains: Option<crate::actors::hardware::efa::channel::Domains>,
    /// The endpoints' settings ([`ContextBuilder::efa_config`]); `None`: the defaults.
    config: Option<crate::actors::hardware::efa::EndpointConfig>,
    /// Where its automatic bootstrap socket binds ([`ContextBuilder::efa_bootstrap_host`]).
    bootstrap_host: Option<std::net::IpAddr>,
}

/// Builds a [`Context`].
///
/// With no settings it enables every backend that can run here: transports `tcp` and `shm`,
/// channels `basic`, `xth`, `cma` (if a trial read of this process succeeds) and `mpt` (2 lanes);
/// with the `efa` feature the `efa` transport and channel where libfabric's `efa` provider runs;
/// and with the `cuda` feature the CUDA channels `cuda_xth`, `cuda_ipc` and `cuda_basic`, each
/// once per device pair it serves, where a CUDA GPU is (docs/cuda.md, "Channels"). Every backend
/// can be removed ([`without`](Self::without)), re-prioritised ([`priority`](Self::priority)) or
/// replaced by one configured differently ([`transport`](Self::transport),
/// [`channel`](Self::channel)). The builder reads no environment variable;
/// [`from_env`](Self::from_env) makes one from the `ACTORPIPE_*` variables
/// (docs/operations.md, "Environment variables").
///
/// # How the settings combine
///
/// Each call only records a setting: the order of the calls never matters. Building the context
/// ([`build`](Self::build), [`start`](Self::start), [`start_in`](Self::start_in)) resolves them
/// in these steps:
///
/// 1. **The builder's backends**: the defaults above, the `efa` pair made from
///    [`efa`](Self::efa), [`efa_domains`](Self::efa_domains), [`efa_config`](Self::efa_config)
///    and [`efa_bootstrap_host`](Self::efa_bootstrap_host).
/// 2. **Yours replace them**: a transport passed to [`transport`](Self::transport) replaces the
///    builder's of the same name, a channel passed to [`channel`](Self::channel) the builder's
///    of the same name and device pair; others are added (after the builder's, by name). The
///    `efa_*` settings do not reach an `efa` transport or channel of yours: configure it
///    yourself.
/// 3. **Adjustments, applied to the result, yours included**: [`lanes`](Self::lanes),
///    [`lane_addresses`](Self::lane_addresses) and [`mpt_inline_max`](Self::mpt_inline_max)
///    change the `mpt` channel (an [`Mpt`](crate::backend::mpt::Mpt) of yours is the base they
///    change, its other settings kept); [`keepalive`](Self::keepalive),
///    [`no_keepalive`](Self::no_keepalive) and [`tcp_keepalive`](Self::tcp_keepalive) change
///    the `tcp` transport's kernel keepalive (a [`Tcp`] of yours too), `tcp_keepalive` winning
///    over the other two for it. A transport or channel of that name but of another type is
///    left as it is.
/// 4. **Removals, applied to the result, yours included**: what [`without`](Self::without)
///    names, and what [`only_transports`](Self::only_transports) or
///    [`only_channels`](Self::only_channels) do not name (several calls: what all of them name),
///    is not offered, whenever it was added.
/// 5. **Priorities**: [`priority`](Self::priority) sets the priority of every backend left of
///    that name, yours included; the others keep their own default.
/// 6. At build only: backends that cannot run here are dropped (`actorpipe info` says why).
///
/// Calling one setter twice, or two setters of one setting (`keepalive` and `no_keepalive`;
/// `io_threads` and `io_threads_for_machine`; the provider of `efa` and `efa_domains`; two
/// transports of one name), keeps the last call's value: a builder from
/// [`from_env`](Self::from_env) holds the environment's values, which later calls override.
/// `Debug` shows the configuration steps 1 to 5 resolve to.
#[derive(Clone)]
pub struct ContextBuilder {
    limits: Limits,
    chunk_size: usize,
    connect_timeout: Duration,
    handshake_timeout: Duration,
    max_pending_pipes: usize,
    /// `None`: from the machine.
    cma_threads: Option<usize>,
    loops_on_runtime: bool,
    remote_lane: bool,
    read_loop_follows_handler: bool,
    /// `None`: from the machine.
    io_threads: Option<usize>,
    cma_inline_max: Option<u64>,
    metrics_addr: Option<std::net::SocketAddr>,
    secret: Option<Arc<[u8]>>,
    /// [`keepalive`](Self::keepalive): `Some(Some((interval, timeout)))`;
    /// [`no_keepalive`](Self::no_keepalive): `Some(None)`; neither: `None`.
    keepalive: Option<Option<(Duration, Duration)>>,
    /// [`tcp_keepalive`](Self::tcp_keepalive).
    tcp_keepalive: Option<crate::backend::tcp::Keepalive>,
    /// Yours: one per name.
    transports: Vec<Arc<dyn Transport>>,
    /// Yours: one per name and device pair.
    channels: Vec<Arc<dyn ChannelBackend>>,
    without: Vec<String>,
    only_transports: Option<Vec<String>>,
    only_channels: Option<Vec<String>>,
    /// One per name.
    priorities: Vec<(String, i32)>,
    lanes: Option<u32>,
    lane_addresses: Option<Vec<std::net::IpAddr>>,
    mpt_inline_max: Option<u64>,
    #[cfg(feature = "efa")]
    efa: EfaSettings,
    /// Process-wide: applied through [`crate::copy::set_threads`] at build
    /// (`ACTORPIPE_COPY_THREADS`).
    copy_threads: Option<usize>,
    /// Process-wide: applied through [`crate::cuda::set_watch_spin`] at build
    /// (`ACTORPIPE_CUDA_WATCH_SPIN_US`).
    #[cfg(feature = "cuda")]
    cuda_watch_spin: Option<Duration>,
}

impl Default for ContextBuilder {
    fn default() -> Self {
        ContextBuilder {
            limits: Limits::default(),
            chunk_size: DEFAULT_CHUNK_SIZE,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            max_pending_pipes: DEFAULT_MAX_PENDING_PIPES,
            cma_threads: None,
            loops_on_runtime: false,
            remote_lane: true,
            read_loop_follows_handler: true,
            io_threads: None,
            cma_inline_max: None,
            metrics_addr: None,
            secret: None,
            keepalive: None,
            tcp_keepalive: None,
            transports: Vec::new(),
            channels: Vec::new(),
            without: Vec::new(),
            only_transports: None,
            only_channels: None,
            priorities: Vec::new(),
            lanes: None,
            lane_addresses: None,
            mpt_inline_max: None,
            #[cfg(feature = "efa")]
            efa: EfaSettings::default(),
            copy_threads: None,
            #[cfg(feature = "cuda")]
            cuda_watch_spin: None,
        }
    }
}

/// The configuration the settings resolve to (before backends that cannot run here are
/// dropped), and the process-wide settings a build applies.
impl std::fmt::Debug for ContextBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("ContextBuilder");
        d.field("config", &self.resolve());
        d.field("copy_threads", &self.copy_threads);
        #[cfg(feature = "cuda")]
        d.field("cuda_watch_spin", &self.cuda_watch_spin);
        d.finish()
    }
}

impl ContextBuilder {
    /// Bounds on what peers may announce (frame size, counts, sizes, metadata).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Bytes per chunk when a tensor goes over a connection (basic, mpt, cma fallback).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = bytes.max(1);
        self
    }

    /// How long dialing a peer may take.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// How long the handshake of a new pipe may take, on either side.
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// How many pipes a listener of this context sets up at once (handshaking, or waiting for
    /// their extra connections to join); 128 by default. A `Hello` over the bound is refused at
    /// once with "too many pending handshakes" ([`Error::Refused`] on the connecting side), so a
    /// burst of connects cannot make every pipe wait on the others. Independently, a listener
    /// admits a pipe only if the descriptors its connections need fit under `RLIMIT_NOFILE`
    /// (docs/operations.md).
    pub fn max_pending_pipes(mut self, n: usize) -> Self {
        self.max_pending_pipes = n.max(1);
        self
    }

    /// Threads per cma read (large tensors are split across them, 1 MiB a thread at least; the
    /// process keeps its reader threads). The default is
    /// [`crate::backend::cma::default_threads`] of the CPUs this process may use: half of them,
    /// 2 to 8.
    pub fn cma_threads(mut self, n: usize) -> Self {
        self.cma_threads = Some(n.max(1));
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
    /// `ACTORPIPE_LOOPS_ON_RUNTIME=1` turns it on through [`from_env`](Self::from_env) (the
    /// CLI's contexts).
    pub fn loops_on_runtime(mut self, on: bool) -> Self {
        self.loops_on_runtime = on;
        self
    }

    /// Whether this context's pipes carry one-sided operations on registered memory
    /// ([`crate::remote`]): a pipe whose two sides both say yes (the default) opens one more
    /// connection at set-up, its remote lane, over the bootstrap transport; requests go both
    /// ways on it and the owner of a region serves them. Off, the pipe has no lane, and its
    /// remote operations work only between contexts of one process (`xth`).
    pub fn remote_lane(mut self, on: bool) -> Self {
        self.remote_lane = on;
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
    /// `ACTORPIPE_READ_LOOP_FOLLOWS_HANDLER=0` turns it off through [`from_env`](Self::from_env).
    pub fn read_loop_follows_handler(mut self, on: bool) -> Self {
        self.read_loop_follows_handler = on;
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
        self.io_threads = Some(n);
        self
    }

    /// [`io_threads`](Self::io_threads) sized from this machine (the CPUs this process may
    /// run on): none on 2 cores or fewer (where a second thread only adds wake-ups to every
    /// lane operation), half the cores above that, at most 16. This is the default.
    pub fn io_threads_for_machine(mut self) -> Self {
        self.io_threads = None;
        self
    }

    /// Tensors of at most this many bytes that would go over cma travel on the pipe's own
    /// connection instead, as basic ones do: for them a copy through the transport costs less
    /// than a cross-memory read and its acknowledgement. The default depends on the pipe's
    /// transport ([`crate::backend::cma::inline_max`]); 0 sends every non-empty tensor by cma.
    /// Only the sender's setting counts: the receiver follows the descriptor.
    pub fn cma_inline_max(mut self, bytes: u64) -> Self {
        self.cma_inline_max = Some(bytes);
        self
    }

    /// Requires peers to prove they know `secret` (a challenge–response over HMAC-SHA256 in the
    /// handshake; the secret never crosses the wire). Both sides must have the same secret; a
    /// side without one cannot open a pipe to a side with one, or the reverse.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secret = Some(Arc::from(secret.as_ref()));
        self
    }

    /// How a peer that stops without closing (killed, cable pulled, host frozen) is found out,
    /// on every connection of every pipe (control and lanes, any transport):
    ///
    /// - **heartbeats**: a writer with nothing to send sends a 5-byte ping after `interval`
    ///   (capped at `timeout` / 3); a read that waits `timeout` without receiving a byte fails
    ///   with [`Error::Timeout`], and with it every pending operation of the pipe, in order.
    ///   This works with data in flight, and never kills a live peer whose application merely
    ///   stops reading (docs/architecture.md, "Closing, liveness and authentication");
    /// - **TCP keepalive** with the same figures (whole seconds, at least 1 s), which also
    ///   cleans up connections whose pipe is not reading: set on the `tcp` transport, a
    ///   [`Tcp`] of yours too, unless [`tcp_keepalive`](Self::tcp_keepalive) sets it.
    ///
    /// Defaults: 2 s and 10 s. Replaces [`no_keepalive`](Self::no_keepalive).
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keepalive = Some(Some((interval, timeout)));
        self
    }

    /// The kernel's side of TCP liveness alone, including the abort of connections whose data
    /// stays unacknowledged (see [`Keepalive`](crate::backend::tcp::Keepalive) for the catch):
    /// set on the `tcp` transport, a [`Tcp`] of yours too, whatever
    /// [`keepalive`](Self::keepalive) or [`no_keepalive`](Self::no_keepalive) say. Heartbeats are
    /// left as they are.
    pub fn tcp_keepalive(mut self, k: crate::backend::tcp::Keepalive) -> Self {
        self.tcp_keepalive = Some(k);
        self
    }

    /// Turns heartbeats and TCP keepalive off (the latter unless
    /// [`tcp_keepalive`](Self::tcp_keepalive) sets it): a peer that vanishes without closing is
    /// then found out only by the kernel (hours), or by per-operation deadlines. Replaces
    /// [`keepalive`](Self::keepalive).
    pub fn no_keepalive(mut self) -> Self {
        self.keepalive = Some(None);
        self
    }

    /// Lanes of the mpt channel (at least 1), an [`Mpt`](crate::backend::mpt::Mpt) of yours
    /// too; nothing happens if mpt is removed.
    pub fn lanes(mut self, n: u32) -> Self {
        self.lanes = Some(n.max(1));
        self
    }

    /// Local addresses the mpt lanes this side dials leave from, one per NIC: lane `i` binds
    /// `addresses[i % len]` before connecting, so its traffic goes out through that address's
    /// interface. Each must be an address of this host, of the peer's address family; a lane
    /// that cannot bind fails the `Connect` with the reason. Lanes of pipes this side accepts
    /// are dialed by the peer, from its own lane addresses. Applies to an
    /// [`Mpt`](crate::backend::mpt::Mpt) of yours too; nothing happens if mpt is removed.
    pub fn lane_addresses(mut self, addresses: impl IntoIterator<Item = std::net::IpAddr>) -> Self {
        self.lane_addresses = Some(addresses.into_iter().collect());
        self
    }

    /// Tensors of 1 to `bytes` bytes that would go over mpt travel inline instead, after their
    /// descriptor on the pipe's own connection, as basic ones do
    /// ([`crate::backend::mpt::INLINE_MAX`], 256 KiB, by default: below that, striping costs
    /// more than it saves). 0 sends every non-empty tensor over the lanes (those under 64 KiB
    /// whole on the first lane, which runs on the context's thread). Only the sender's setting
    /// counts: the receiver follows the descriptor. Applies to an
    /// [`Mpt`](crate::backend::mpt::Mpt) of yours too; nothing happens if mpt is removed.
    pub fn mpt_inline_max(mut self, bytes: u64) -> Self {
        self.mpt_inline_max = Some(bytes);
        self
    }

    /// The `efa` transport and the `efa` channel over libfabric's `provider` (`efa`, the
    /// default; `tcp;ofi_rxm`, `shm`), on one endpoint per domain: enabled by default where the
    /// provider runs. See docs/efa.md.
    #[cfg(feature = "efa")]
    pub fn efa(mut self, provider: &str) -> Self {
        self.efa.provider = Some(provider.into());
        self
    }

    /// [`Self::efa`], with the `efa` channel also on these domains of the provider (empty: every
    /// domain it lists here): large tensors are striped over the domains both peers reach (one
    /// shared endpoint per domain). See docs/efa.md, "Several domains".
    #[cfg(feature = "efa")]
    pub fn efa_domains(mut self, provider: &str, domains: &[&str]) -> Self {
        use crate::actors::hardware::efa::channel::Domains;
        self.efa.provider = Some(provider.into());
        self.efa.domains = Some(if domains.is_empty() {
            Domains::All
        } else {
            Domains::Named(domains.iter().map(|d| d.to_string()).collect())
        });
        self
    }

    /// How the endpoints of the context's `efa` transport and channel progress (spin mode,
    /// polling, fault injection with the `faults` feature): [`EndpointConfig::default`] unless
    /// set.
    ///
    /// [`EndpointConfig::default`]: crate::actors::hardware::efa::EndpointConfig
    #[cfg(feature = "efa")]
    pub fn efa_config(mut self, config: crate::actors::hardware::efa::EndpointConfig) -> Self {
        self.efa.config = Some(config);
        self
    }

    /// The address a listener of this context binds the `efa` transport's bootstrap socket to
    /// when it enables `efa` by itself (a `Listen` that names no `efa://` URL); default: the
    /// host's first IPv4 address that is up and not loopback, else 127.0.0.1.
    #[cfg(feature = "efa")]
    pub fn efa_bootstrap_host(mut self, ip: std::net::IpAddr) -> Self {
        self.efa.bootstrap_host = Some(ip);
        self
    }

    /// Offers `t` at its default priority, in place of the builder's transport of the same name
    /// (and of one passed before under that name).
    pub fn transport(mut self, t: Arc<dyn Transport>) -> Self {
        self.transports.retain(|x| x.name() != t.name());
        self.transports.push(t);
        self
    }

    /// Offers `c` at its default priority, in place of the builder's channel of the same name
    /// and device pair (and of one passed before under them).
    pub fn channel(mut self, c: Arc<dyn ChannelBackend>) -> Self {
        self.channels
            .retain(|x| (x.name(), x.devices()) != (c.name(), c.devices()));
        self.channels.push(c);
        self
    }

    /// Offers no transport or channel called `name`, yours included.
    pub fn without(mut self, name: &str) -> Self {
        if !self.without.iter().any(|n| n == name) {
            self.without.push(name.into());
        }
        self
    }

    /// Offers only the transports named (and of those, only what another call of this names
    /// too); handy to force one. A `Listen` or `Connect` URL must still name an enabled
    /// transport.
    pub fn only_transports(mut self, names: &[&str]) -> Self {
        self.only_transports = Some(keep_named(self.only_transports.take(), names));
        self
    }

    /// Offers only the channels named (and of those, only what another call of this names
    /// too); handy to force one in tests.
    pub fn only_channels(mut self, names: &[&str]) -> Self {
        self.only_channels = Some(keep_named(self.only_channels.take(), names));
        self
    }

    /// Sets the priority of the transports and channels called `name` (higher wins), yours
    /// included.
    pub fn priority(mut self, name: &str, priority: i32) -> Self {
        self.priorities.retain(|(n, _)| n != name);
        self.priorities.push((name.into(), priority));
        self
    }

    /// Serves this process's metrics (Prometheus text) at `addr` when the context is built
    /// (`ACTORPIPE_METRICS_ADDR` through [`from_env`](Self::from_env)). One exporter serves the
    /// whole process; see [`crate::metrics::serve`].
    ///
    /// The address bound (port 0 picks one) or the bind failure is what
    /// [`Context::metrics_addr`] returns, and what [`GetMetricsAddr`] answers once the context
    /// runs.
    pub fn metrics(mut self, addr: std::net::SocketAddr) -> Self {
        self.metrics_addr = Some(addr);
        self
    }

    /// The configuration these settings resolve to, in the steps the type's docs list (all but
    /// the last: every backend is there, whether it can run here or not). Opens nothing, reads
    /// nothing from the environment and starts no thread.
    pub(crate) fn resolve(&self) -> Config {
        let cores = super::pool::available_cores();
        // 1. The builder's backends.
        let mut transports: Vec<Arc<dyn Transport>> =
            vec![Arc::new(Tcp::default()), Arc::new(Shm::new())];
        let mut channels: Vec<Arc<dyn ChannelBackend>> = Vec::new();
        #[cfg(feature = "efa")]
        {
            let (t, c) = self.efa_pair();
            transports.push(t);
            channels.push(c);
        }
        channels.extend([
            Arc::new(Basic) as Arc<dyn ChannelBackend>,
            Arc::new(Xth),
            Arc::new(Mpt::default()),
            Arc::new(Cma),
        ]);
        #[cfg(feature = "cuda")]
        {
            channels.extend(crate::backend::cuda_xth::CudaXth::all());
            channels.extend(crate::backend::cuda_ipc::CudaIpc::all());
            channels.extend(crate::backend::cuda_basic::CudaBasic::all());
        }
        // 2. Yours replace them, or come after them, by name.
        let mut extra: Vec<Arc<dyn Transport>> = Vec::new();
        for t in &self.transports {
            match transports.iter_mut().find(|x| x.name() == t.name()) {
                Some(slot) => *slot = t.clone(),
                None => extra.push(t.clone()),
            }
        }
        extra.sort_by_key(|t| t.name());
        transports.extend(extra);
        let mut extra: Vec<Arc<dyn ChannelBackend>> = Vec::new();
        for c in &self.channels {
            let key = (c.name(), c.devices());
            match channels.iter_mut().find(|x| (x.name(), x.devices()) == key) {
                Some(slot) => *slot = c.clone(),
                None => extra.push(c.clone()),
            }
        }
        extra.sort_by_key(|c| (c.name(), c.devices().to_string()));
        channels.extend(extra);
        // 3. Adjustments.
        for c in &mut channels {
            if let Some(m) = c.as_any().and_then(|a| a.downcast_ref::<Mpt>()) {
                if let Some(m) = self.adjust_mpt(m) {
                    *c = Arc::new(m);
                }
            }
        }
        let kernel = self.tcp_keepalive.map(Some).or(self.keepalive.map(|k| {
            k.map(|(interval, timeout)| crate::backend::tcp::Keepalive {
                interval,
                timeout,
                unacked_timeout: None,
            })
        }));
        if let Some(k) = kernel {
            for t in &mut transports {
                if let Some(tcp) = t.as_any().and_then(|a| a.downcast_ref::<Tcp>()) {
                    let mut tcp = *tcp;
                    tcp.keepalive = k;
                    *t = Arc::new(tcp);
                }
            }
        }
        // 4. Removals.
        let offered = |name: &str, only: &Option<Vec<String>>| {
            !self.without.iter().any(|n| n == name)
                && only.as_ref().is_none_or(|o| o.iter().any(|n| n == name))
        };
        transports.retain(|t| offered(t.name(), &self.only_transports));
        channels.retain(|c| offered(c.name(), &self.only_channels));
        // 5. Priorities.
        let priority = |name: &str, default: i32| {
            self.priorities
                .iter()
                .find(|(n, _)| n == name)
                .map_or(default, |(_, p)| *p)
        };
        let heartbeat = match self.keepalive {
            None => Some(Heartbeat::default()),
            Some(None) => None,
            Some(Some((interval, timeout))) => Some(Heartbeat::new(interval, timeout)),
        };
        Config {
            limits: self.limits,
            chunk_size: self.chunk_size,
            connect_timeout: self.connect_timeout,
            handshake_timeout: self.handshake_timeout,
            max_pending_pipes: self.max_pending_pipes,
            cma_threads: self
                .cma_threads
                .unwrap_or_else(|| crate::backend::cma::default_threads(cores)),
            loops_on_runtime: self.loops_on_runtime,
            remote_lane: self.remote_lane,
            read_loop_follows_handler: self.read_loop_follows_handler,
            // Sized from the machine by default (none on 2 cores or fewer); no thread starts
            // until an mpt pipe has a second lane.
            io: Arc::new(super::pool::IoPool::new(
                self.io_threads
                    .unwrap_or_else(|| super::pool::default_threads(cores)),
            )),
            cma_inline_max: self.cma_inline_max,
            metrics_addr: self.metrics_addr,
            secret: self.secret.clone(),
            heartbeat,
            transports: transports
                .into_iter()
                .map(|t| {
                    let p = priority(t.name(), t.priority());
                    (t, p)
                })
                .collect(),
            channels: channels
                .into_iter()
                .map(|c| {
                    let p = priority(c.name(), c.priority());
                    (c, p)
                })
                .collect(),
            #[cfg(feature = "cuda")]
            ipc: Default::default(),
        }
    }

    /// `m` with the mpt adjustments, if any is set.
    fn adjust_mpt(&self, m: &Mpt) -> Option<Mpt> {
        if self.lanes.is_none() && self.lane_addresses.is_none() && self.mpt_inline_max.is_none() {
            return None;
        }
        let mut m = m.clone();
        if let Some(n) = self.lanes {
            m.lanes = n;
        }
        if let Some(a) = &self.lane_addresses {
            m.sources = a.clone();
        }
        if let Some(b) = self.mpt_inline_max {
            m.inline_max = b;
        }
        Some(m)
    }

    /// The `efa` transport and channel the `efa_*` settings describe.
    #[cfg(feature = "efa")]
    fn efa_pair(&self) -> (Arc<dyn Transport>, Arc<dyn ChannelBackend>) {
        use crate::actors::hardware::efa::channel::Domains;
        use crate::actors::hardware::efa::transport::{Efa, DEFAULT_PROVIDER};
        let s = &self.efa;
        let mut t = Efa::new(s.provider.as_deref().unwrap_or(DEFAULT_PROVIDER))
            .with_config(s.config.unwrap_or_default());
        if let Some(ip) = s.bootstrap_host {
            t = t.bootstrap_host(ip);
        }
        let c = crate::actors::hardware::efa::channel::Efa::over(&t)
            .with_domains(s.domains.clone().unwrap_or(Domains::One));
        (Arc::new(t), Arc::new(c))
    }

    /// Applies the process-wide settings [`from_env`](Self::from_env) recorded.
    fn apply_process_wide(&self) {
        if let Some(n) = self.copy_threads {
            let asked = n.clamp(1, crate::copy::MAX_THREADS);
            match crate::copy::set_threads(n) {
                Err(in_force) if in_force != asked => tracing::warn!(
                    asked,
                    in_force,
                    "ACTORPIPE_COPY_THREADS not applied: the process made its first large copy before"
                ),
                _ => {}
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(spin) = self.cuda_watch_spin {
            crate::cuda::set_watch_spin(spin);
        }
    }

    /// Builds the context actor (start it with [`Actor::start`]): resolves the settings (see
    /// the type's docs), leaves out the backends that cannot run here, applies the process-wide
    /// settings [`from_env`](Self::from_env) read and serves metrics if asked.
    ///
    /// If metrics were asked for and cannot be served, the context still works, the failure is
    /// logged at error level and [`Context::metrics_addr`] returns it.
    pub fn build(self) -> Context {
        self.apply_process_wide();
        let mut config = self.resolve();
        // A backend that cannot run here is not offered (`actorpipe info` says why).
        config.transports.retain(|(t, _)| match t.viable() {
            Ok(()) => true,
            Err(why) => {
                tracing::info!(transport = t.name(), %why, "transport not offered");
                false
            }
        });
        config.channels.retain(|(c, _)| match c.viable() {
            Ok(()) => true,
            Err(why) => {
                tracing::info!(channel = c.name(), %why, "channel not offered");
                false
            }
        });
        let metrics = config.metrics_addr.map(crate::metrics::serve);
        if let Some(Err(e)) = &metrics {
            tracing::error!(error = %e, "metrics not served");
        }
        Context {
            config: Arc::new(config),
            metrics,
            remote: crate::remote_core::Owner::new(),
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

/// What an `only_*` call leaves: the names of `names` that every earlier call named too.
fn keep_named(before: Option<Vec<String>>, names: &[&str]) -> Vec<String> {
    let mut kept: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    if let Some(before) = before {
        kept.retain(|n| before.contains(n));
    }
    kept
}

/// The registry of backends; send it [`Connect`] and [`Listen`].
#[derive(Debug)]
pub struct Context {
    config: Arc<Config>,
    metrics: Option<Result<std::net::SocketAddr, Error>>,
    /// Its registered regions' owner: its number and notification subscribers.
    remote: Arc<crate::remote_core::Owner>,
}

impl Context {
    /// A builder with every backend that can run here, reading no environment variable
    /// ([`ContextBuilder::from_env`] reads them).
    pub fn builder() -> ContextBuilder {
        ContextBuilder::default()
    }

    /// Where this process's metrics are served, if this context was asked to serve them
    /// ([`ContextBuilder::metrics`], or `ACTORPIPE_METRICS_ADDR` through
    /// [`ContextBuilder::from_env`]): the address bound, or why binding failed
    /// ([`Error::Listen`]). A context that was not asked answers [`Error::Unavailable`].
    pub fn metrics_addr(&self) -> Result<std::net::SocketAddr, Error> {
        self.metrics.clone().unwrap_or_else(|| {
            Err(Error::Unavailable {
                backend: "metrics".into(),
                reason: "this context was not asked to serve metrics (ContextBuilder::metrics)"
                    .into(),
            })
        })
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

/// Asks a context for the counters of its `efa` endpoints (feature `efa`): one
/// [`EfaEndpointStats`] per endpoint open now, that is per domain its `efa` transport and
/// channel use (the transport's domain first, then the channel's further ones by name). An
/// endpoint opens with the first pipe on its domain and closes once no pipe uses it: a context
/// with no efa pipe has none to list (an empty list). A context without an `efa` transport or
/// channel answers [`Error::Unavailable`].
#[cfg(feature = "efa")]
#[derive(Debug, Clone, Copy)]
pub struct GetEfaStats;

#[cfg(feature = "efa")]
impl actix::Message for GetEfaStats {
    type Result = Result<Vec<EfaEndpointStats>, Error>;
}

/// The counters of one of a context's `efa` endpoints ([`GetEfaStats`]).
#[cfg(feature = "efa")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EfaEndpointStats {
    /// The libfabric provider (`efa`, `tcp;ofi_rxm`, `shm`).
    pub provider: String,
    /// The domain (NIC) the endpoint is on.
    pub domain: String,
    /// The `efa` transport instance it serves ([`Efa::instance`]): the `endpoint` label of its
    /// `actorpipe_efa_backlog_operations` gauge.
    ///
    /// [`Efa::instance`]: crate::transport::Efa::instance
    pub endpoint: u64,
    /// Its counters, as [`FabricStats`](crate::efa::FabricStats) answers them.
    pub stats: crate::backend::efa::engine::Stats,
}

#[cfg(feature = "efa")]
impl Context {
    /// The context's `efa` transports: its `efa` transport's, and its `efa` channel's where
    /// that runs over another instance (each once), or why there is none.
    fn efa_transports(&self) -> Result<Vec<crate::actors::hardware::efa::transport::Efa>, Error> {
        use crate::actors::hardware::efa::{channel, transport};
        let from_transport = (self.config.transports.iter())
            .filter(|(t, _)| t.name() == "efa")
            .filter_map(|(t, _)| t.as_any()?.downcast_ref::<transport::Efa>().cloned());
        let from_channel = (self.config.channels.iter())
            .filter(|(c, _)| c.name() == "efa")
            .filter_map(|(c, _)| c.as_any()?.downcast_ref::<channel::Efa>())
            .map(|c| c.transport().clone());
        let mut found: Vec<transport::Efa> = Vec::new();
        for t in from_transport.chain(from_channel) {
            if !found.iter().any(|f| f.instance() == t.instance()) {
                found.push(t);
            }
        }
        if found.is_empty() {
            return Err(Error::Unavailable {
                backend: "efa".into(),
                reason: "this context has no efa transport or channel".into(),
            });
        }
        Ok(found)
    }
}

#[cfg(feature = "efa")]
impl Handler<GetEfaStats> for Context {
    type Result = ResponseFuture<Result<Vec<EfaEndpointStats>, Error>>;

    fn handle(&mut self, _: GetEfaStats, _: &mut Self::Context) -> Self::Result {
        use crate::actors::hardware::efa::FabricStats;
        // The endpoints live on the thread of the pipes that use them: this context's.
        let endpoints = self.efa_transports().map(|ts| {
            ts.iter()
                .flat_map(|t| {
                    let (provider, endpoint) = (t.provider().to_string(), t.instance());
                    (t.open_endpoints().into_iter())
                        .map(move |(d, a)| (provider.clone(), d, endpoint, a))
                })
                .collect::<Vec<_>>()
        });
        Box::pin(async move {
            let mut out = Vec::new();
            for (provider, domain, endpoint, a) in endpoints? {
                // One that stopped meanwhile is no longer open: left out.
                if let Ok(stats) = a.send(FabricStats).await {
                    out.push(EfaEndpointStats {
                        provider,
                        domain,
                        endpoint,
                        stats,
                    });
                }
            }
            Ok(out)
        })
    }
}

impl Context {
    /// The owner of the regions registered with this context.
    pub(crate) fn remote_owner(&self) -> Arc<crate::remote_core::Owner> {
        self.remote.clone()
    }
}

impl Handler<GetMetricsAddr> for Context {
    type Result = Result<std::net::SocketAddr, Error>;

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
    let mut remote = None;
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
            Purpose::Remote => config.transport(&bootstrap)?.connect(&url, t).await?,
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
            Purpose::Remote => remote = Some((h, bootstrap.clone())),
        }
    }
    // The pipe exists once the listener says it has every connection.
    handshake::accepted(&mut hs.halves, &config.limits, config.handshake_timeout).await?;
    Ok(PipeParts {
        peer: hs.halves.peer.clone(),
        control: control.unwrap_or(hs.halves),
        choice,
        lanes,
        remote,
    })
}

impl Handler<Connect> for Context {
    type Result = ResponseFuture<Result<Addr<Pipe>, Error>>;

    fn handle(&mut self, msg: Connect, _: &mut Self::Context) -> Self::Result {
        let config = self.config.clone();
        Box::pin(async move {
            let mut attempt = 1;
            let mut wait = msg.retry.map(|r| r.backoff).unwrap_or_default();
            loop {
                match dial(config.clone(), msg.url.clone()).await {
                    Ok(parts) => {
                        let (pipe, attached) = spawn_pipe(parts, &config);
                        attached.wait(config.handshake_timeout).await;
                        return Ok(pipe);
                    }
                    Err(e) => {
                        crate::metrics::negotiation_failed(&e);
                        match msg.retry {
                            Some(r) if attempt < r.attempts && e.kind().is_transient() => {
                                tracing::debug!(
                                    "connect to {} failed (attempt {attempt} of {}), again in \
                                     {wait:?}: {e}",
                                    msg.url,
                                    r.attempts
                                );
                                tokio::time::sleep(wait).await;
                                wait = (wait * 2).min(r.max_backoff);
                                attempt += 1;
                            }
                            _ => return Err(e),
                        }
                    }
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
            let endpoints: Vec<ListenEndpoint> = acceptors
                .iter()
                .filter(|(n, _)| msg.urls.iter().any(|u| scheme(u).ok() == Some(n.as_str())))
                .flat_map(|(n, a)| {
                    a.urls().into_iter().map(|url| ListenEndpoint {
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
