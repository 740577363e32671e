//! Building a pipe: its channel actors, its control connection and the `Pipe` actor itself,
//! from what the handshake negotiated.

use super::*;
#[cfg(feature = "cuda")]
use crate::actors::hardware::cuda_ipc::driver::CudaIpcDriver;
#[cfg(feature = "efa")]
use crate::actors::hardware::efa::channel::driver::EfaDriver;
use crate::backend::cma::driver::CmaDriver;
#[cfg(feature = "cuda")]
use crate::backend::cuda_basic::driver::CudaBasicDriver;
#[cfg(feature = "cuda")]
use crate::backend::cuda_xth::driver::CudaXthDriver;
#[cfg(feature = "ibv")]
use crate::backend::ibv::channel::{driver::IbvDriver, IbvChannel};
use crate::backend::mpt::driver::MptDriver;
use crate::backend::xth::driver::XthDriver;
use crate::channel::driver::{Core, Idle};

/// Everything a pipe is built from: its control connection, what was negotiated, and each
/// channel's own connections.
pub(crate) struct PipeParts {
    /// The peer's address on the bootstrap connection (the one users know it by).
    pub peer: String,
    pub control: Halves,
    pub choice: Choice,
    pub lanes: Vec<Vec<Halves>>,
    /// The remote-memory lane, when both sides offered one, and its transport's name.
    pub remote: Option<(Halves, String)>,
}

/// The context's endpoint for a new pipe's `efa` channel.
#[cfg(feature = "efa")]
fn efa_port(
    config: &Config,
    origin: &Origin,
) -> crate::actors::hardware::efa::channel::ChannelPort {
    backend_of::<crate::actors::hardware::efa::channel::Efa>(config, "efa")
        .and_then(|c| c.fabric_port())
        .unwrap_or_else(|| crate::actors::hardware::efa::channel::ChannelPort {
            endpoint: Err(Error::protocol(
                "internal: the efa channel was negotiated but this context has none",
                origin,
            )),
            extra: Vec::new(),
            max_message: usize::MAX,
        })
}

/// What a new pipe is handed out after (the dialer's `Connect` answers it, the listener's
/// `Accepted` carries it): its `efa` channel's links attached to their endpoints, so that the
/// endpoint counts every pipe handed out (`FabricStats::pipes`); nothing for other channels.
/// See the efa channel's `Path::when_attached`.
#[must_use = "the pipe is handed out once this is over"]
pub(crate) struct Attached(Option<tokio::sync::oneshot::Receiver<()>>);

impl Attached {
    /// Whether there is anything to wait for.
    pub(crate) fn pending(&self) -> bool {
        self.0.is_some()
    }

    /// Waits for it, at most `limit` (a set-up that hangs fails the pipe on its own: the
    /// lane's keepalive).
    pub(crate) async fn wait(self, limit: std::time::Duration) {
        if let Some(rx) = self.0 {
            let _ = tokio::time::timeout(limit, rx).await;
        }
    }
}

/// Builds the actors of a pipe and starts them; the pipe is to be handed out once [`Attached`]
/// is over.
pub(crate) fn spawn_pipe(parts: PipeParts, config: &Arc<Config>) -> (Addr<Pipe>, Attached) {
    let PipeParts {
        peer,
        control,
        choice,
        lanes,
        remote,
    } = parts;
    let id = NEXT_PIPE_ID.fetch_add(1, Ordering::Relaxed);
    let backend = format!(
        "{}/{}",
        choice.transport,
        choice
            .channels
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join("+")
    );
    let origin = Origin::new(peer.clone(), backend).with_pipe(id);
    let info = PipeInfo {
        id,
        peer,
        local: control.local.clone(),
        transport: choice.transport.clone(),
        channels: choice
            .channels
            .iter()
            .map(|c| ChannelInfo {
                name: c.name.clone(),
                devices: c.devices,
            })
            .collect(),
        tensors_on_control: 0,
        tensors_by_channel: 0,
        received_by_read_loop: 0,
        written_by_caller: 0,
        closed: false,
        fallbacks: 0,
        connections: choice
            .channels
            .iter()
            .zip(&lanes)
            .flat_map(|(c, lanes)| {
                lanes.iter().enumerate().map(|(i, h)| LaneInfo {
                    channel: c.name.clone(),
                    lane: i as u32,
                    local: h.local.clone(),
                    peer: h.peer.clone(),
                })
            })
            .collect(),
        remote: None,
    };
    // Loops leave the `LocalSet` only where the stream's readiness comes from the runtime's own
    // reactor: the efa and ibv streams are driven by actors on the arbiter's `LocalSet` (the
    // endpoint's progress, the queue pairs), and a loop on the other queue would wait for the
    // `LocalSet`'s turn on every message (efa 64 B in spin mode: 18 -> 57 us on 16 cores).
    let reactor_driven = matches!(choice.transport.as_str(), "tcp" | "shm");
    // Both loops on the runtime's queue for good, or the read loop following a standing
    // receive's handler there (`begin_stand`), unless asked not to.
    let mut read_roams = None;
    let queues = if !reactor_driven {
        Queues::LOCAL_SET
    } else if config.loops_on_runtime {
        Queues {
            read: ConnQueue::Runtime,
            write: ConnQueue::Runtime,
        }
    } else if config.read_loop_follows_handler {
        let wanted = read_roams.insert(Arc::new(Wanted::default()));
        Queues {
            read: ConnQueue::Roaming(wanted.clone()),
            write: ConnQueue::LocalSet,
        }
    } else {
        Queues::LOCAL_SET
    };
    let (conn, link) = Connection::start(
        control.read,
        control.write,
        config.limits,
        origin.clone(),
        config.heartbeat,
        queues,
    );
    let (reply, completions) = mpsc::unbounded_channel();
    let fallbacks = Arc::new(AtomicU64::new(0));
    #[cfg(feature = "cuda")]
    let (cuda_reply, cuda_completions) = mpsc::unbounded_channel();
    let chunk_size = config.chunk_size;
    let mut kinds = Vec::new();
    // The efa channel's data path, which the pipe shares (its index among the channels).
    #[cfg(feature = "efa")]
    let mut efa_path = None;
    #[allow(unused_mut)] // Set by the efa channel alone.
    let mut attached = None;
    let channels = choice
        .channels
        .iter()
        .zip(lanes)
        .map(|(c, lanes)| {
            let kind = channel_kind(&c.name, id, &choice.transport, config);
            kinds.push(kind);
            let core = |lanes| {
                Core::new(
                    lanes,
                    reply.clone(),
                    origin.clone(),
                    fallbacks.clone(),
                    #[cfg(feature = "cuda")]
                    kind.carries_cuda().then(|| cuda_reply.clone()),
                )
            };
            // The channel's own connections, each with its loops (the ibv and cuda_gdr
            // channels bootstrap their queue pairs over theirs themselves, as raw halves).
            let start_lanes = |lanes: Vec<Halves>| {
                let lanes = lanes
                    .into_iter()
                    .enumerate()
                    .map(|(i, h)| {
                        Connection::start_lane(
                            h.read,
                            h.write,
                            config.limits,
                            origin.clone(),
                            config.heartbeat,
                            // Lanes that stripe tensors get cores of their own, but the first:
                            // the pipe's thread moves its share (every lane on the pool
                            // measured no faster), and where small tensors are not inline it
                            // carries those whole, which then cross no thread. cma's side
                            // connections (acknowledgements) stay with the pipe.
                            (i > 0 && matches!(kind, ChannelKind::Mpt { .. }))
                                .then_some(&config.io),
                        )
                    })
                    .collect();
                super::super::channel::lanes(lanes)
            };
            // The one place a channel's kind picks its driver.
            match kind {
                ChannelKind::Basic { .. } => {
                    Channel::new(core(start_lanes(lanes)), Idle, kind).launch()
                }
                ChannelKind::Xth { pipe } => {
                    Channel::new(core(start_lanes(lanes)), XthDriver::new(pipe), kind).launch()
                }
                ChannelKind::Cma { threads, .. } => {
                    let driver = CmaDriver::new(threads, chunk_size);
                    Channel::new(core(start_lanes(lanes)), driver, kind).launch()
                }
                ChannelKind::Mpt { chunk_size, .. } => {
                    let driver = MptDriver::new(chunk_size);
                    Channel::new(core(start_lanes(lanes)), driver, kind).launch()
                }
                #[cfg(feature = "cuda")]
                ChannelKind::CudaXth { pipe } => {
                    let driver = CudaXthDriver::new(pipe);
                    Channel::new(core(start_lanes(lanes)), driver, kind).launch()
                }
                #[cfg(feature = "cuda")]
                ChannelKind::CudaIpc { pipe } => {
                    let driver = CudaIpcDriver::new(pipe, config.ipc.clone());
                    Channel::new(core(start_lanes(lanes)), driver, kind).launch()
                }
                #[cfg(feature = "cuda")]
                ChannelKind::CudaBasic => {
                    let driver = CudaBasicDriver::default();
                    Channel::new(core(start_lanes(lanes)), driver, kind).launch()
                }
                #[cfg(feature = "efa")]
                ChannelKind::Efa { .. } => {
                    let port = efa_port(config, &origin);
                    let (driver, path) = EfaDriver::new(port, reply.clone(), origin.clone());
                    attached = path.borrow_mut().when_attached();
                    efa_path = Some((kinds.len() - 1, path));
                    Channel::new(core(start_lanes(lanes)), driver, kind).launch()
                }
                #[cfg(feature = "ibv")]
                ChannelKind::Ibv { .. } => {
                    let backend = backend_of::<IbvChannel>(config, "ibv");
                    ibv_channel(backend, lanes, &origin, core(Vec::new()), kind, false)
                }
                #[cfg(all(feature = "cuda", feature = "ibv"))]
                ChannelKind::CudaGdr => {
                    let gdr = backend_of::<crate::backend::cuda_gdr::CudaGdr>(config, "cuda_gdr");
                    let backend = gdr.map(|g| g.ibv().clone());
                    ibv_channel(backend, lanes, &origin, core(Vec::new()), kind, true)
                }
            }
        })
        .collect();
    let cpu_channel = choice.channel_for(DevicePair::CPU).unwrap_or(0);
    let cpu_kind = kinds
        .get(cpu_channel)
        .copied()
        .unwrap_or(ChannelKind::Basic { chunk_size });
    let routes = Routes::new(&choice, &kinds, cpu_channel);
    let catcher_routes = routes.clone();
    let span = tracing::info_span!("pipe", id, peer = %info.peer, backend = %origin.backend);
    span.in_scope(|| tracing::debug!("pipe open"));
    let cpu_name = choice
        .channels
        .get(cpu_channel)
        .map_or("none", |c| c.name.as_str());
    let metrics = Arc::new(PipeMetrics::open(&choice.transport, cpu_name));
    let metrics_for_catcher = metrics.clone();
    let share = Arc::new(super::writer::WriteShare::new(
        origin.clone(),
        config.limits,
        cpu_channel,
        cpu_kind,
        routes.clone(),
        metrics.clone(),
        super::writer::Wire {
            parking: link.parking.clone(),
            out: link.out.clone(),
            reply: reply.clone(),
        },
    ));
    let lane_addresses = remote
        .as_ref()
        .map(|(h, _)| (h.local.clone(), h.peer.clone()));
    let remote_ops = match remote {
        Some((h, transport)) => {
            let (lane, loops) = crate::remote_core::lane::Lane::start(
                h.read,
                h.write,
                origin.clone(),
                config.cma_threads,
            );
            for l in loops {
                actix::spawn(l);
            }
            super::super::remote::PipeRemote {
                lane: Some(lane),
                transport: config
                    .transports
                    .iter()
                    .map(|(t, _)| t.name())
                    .find(|n| *n == transport)
                    .unwrap_or("lane"),
                addresses: lane_addresses,
                ..Default::default()
            }
        }
        None => Default::default(),
    };
    let pipe = Pipe {
        remote_ops,
        metrics,
        span,
        id,
        origin,
        info,
        limits: config.limits,
        cpu_channel,
        cpu_kind,
        routes,
        route_buf: Vec::new(),
        #[cfg(feature = "cuda")]
        cuda_completions: Some(cuda_completions),
        #[cfg(feature = "cuda")]
        ipc: kinds
            .iter()
            .any(|k| matches!(k, ChannelKind::CudaIpc { .. }))
            .then(|| config.ipc.clone()),
        #[cfg(feature = "cuda")]
        ipc_out: Vec::new(),
        conn: Some((conn, link)),
        channels,
        fallbacks,
        reply: Some(reply),
        completions: Some(completions),
        error: None,
        closed_sent: false,
        subscribers: Vec::new(),
        closers: Vec::new(),
        draining: None,
        reads_failed: false,
        writes_failed: false,
        writes: VecDeque::new(),
        share,
        reads: VecDeque::new(),
        read_cursor: 0,
        next_read_id: 0,
        in_ticket: 0,
        expect_seq: 0,
        prefetch: Prefetch::default(),
        current: None,
        catcher: Arc::new(super::catch::Catcher::new(
            catcher_routes,
            cpu_channel,
            cpu_kind.carried(),
            metrics_for_catcher,
        )),
        caught_through: 0,
        stand: None,
        stand_turning: false,
        read_roams,
        deferred: Vec::new(),
        #[cfg(feature = "efa")]
        efa: efa_path,
        #[cfg(feature = "efa")]
        efa_batch: Vec::new(),
        #[cfg(feature = "efa")]
        efa_out: Vec::new(),
    }
    .start();
    (pipe, Attached(attached))
}

/// What the channel negotiated as `name` runs as, as its backend plans it (negotiation picks
/// only names both contexts offer, so the context has the backend; `basic` if it somehow has
/// not).
fn channel_kind(name: &str, pipe: u64, transport: &str, config: &Config) -> ChannelKind {
    let at = crate::channel::sealed::Plan {
        pipe,
        transport,
        chunk_size: config.chunk_size,
        cma_threads: config.cma_threads,
        cma_inline_max: config.cma_inline_max,
    };
    match config.channels.iter().find(|(c, _)| c.name() == name) {
        Some((c, _)) => c.plan(&at),
        None => {
            debug_assert!(
                name == "basic",
                "a channel this context does not offer: {name}"
            );
            ChannelKind::Basic {
                chunk_size: config.chunk_size,
            }
        }
    }
}

/// The context's channel backend called `name`, as its concrete type.
#[cfg(any(feature = "efa", feature = "ibv"))]
fn backend_of<T: Clone + 'static>(config: &Config, name: &str) -> Option<T> {
    config
        .channels
        .iter()
        .find(|(c, _)| c.name() == name)
        .and_then(|(c, _)| c.as_any()?.downcast_ref::<T>().cloned())
}

/// An ibv channel (or, `gdr`, a cuda_gdr one) on `backend`'s device, its queue pairs
/// bootstrapped over `lanes`; without the backend (never negotiated so), every tensor fails.
#[cfg(feature = "ibv")]
fn ibv_channel(
    backend: Option<IbvChannel>,
    lanes: Vec<Halves>,
    origin: &Origin,
    core: Core,
    kind: ChannelKind,
    gdr: bool,
) -> super::super::channel::ChannelAddr {
    let Some(backend) = backend else {
        return Channel::new(core, Idle, kind).launch();
    };
    let driver = IbvDriver::new(&backend, lanes, origin);
    #[cfg(feature = "cuda")]
    let driver = match gdr {
        true => driver.with_gdr(),
        false => driver,
    };
    #[cfg(not(feature = "cuda"))]
    let _ = gdr;
    Channel::new(core, driver, kind).launch()
}
