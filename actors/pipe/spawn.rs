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
use crate::backend::ibv::channel::driver::IbvDriver;
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

/// Builds the actors of a pipe and starts them.
pub(crate) fn spawn_pipe(parts: PipeParts, config: &Arc<Config>) -> Addr<Pipe> {
    let PipeParts {
        peer,
        control,
        choice,
        lanes,
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
            // The ibv and cuda_gdr channels bootstrap their queue pair over their lane
            // themselves.
            #[cfg(feature = "ibv")]
            if let Some((backend, gdr)) = queue_pair_backend(kind, config) {
                let driver = IbvDriver::new(&backend, lanes, &origin);
                #[cfg(feature = "cuda")]
                let driver = match gdr {
                    true => driver.with_gdr(),
                    false => driver,
                };
                #[cfg(not(feature = "cuda"))]
                let _ = gdr;
                return Channel::new(core(Vec::new()), driver, kind).launch();
            }
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
                        // the pipe's thread moves its share (every lane on the pool measured
                        // no faster), and where small tensors are not inline it carries those
                        // whole, which then cross no thread. cma's side connections
                        // (acknowledgements) stay with the pipe.
                        (i > 0 && matches!(kind, ChannelKind::Mpt { .. })).then_some(&config.io),
                    )
                })
                .collect();
            let core = core(super::super::channel::lanes(lanes));
            match kind {
                ChannelKind::Basic { .. } => Channel::new(core, Idle, kind).launch(),
                ChannelKind::Xth { pipe } => {
                    Channel::new(core, XthDriver::new(pipe), kind).launch()
                }
                ChannelKind::Cma { threads, .. } => {
                    Channel::new(core, CmaDriver::new(threads, chunk_size), kind).launch()
                }
                ChannelKind::Mpt { chunk_size, .. } => {
                    Channel::new(core, MptDriver::new(chunk_size), kind).launch()
                }
                #[cfg(feature = "cuda")]
                ChannelKind::CudaXth { pipe } => {
                    Channel::new(core, CudaXthDriver::new(pipe), kind).launch()
                }
                #[cfg(feature = "cuda")]
                ChannelKind::CudaIpc { pipe } => {
                    let driver = CudaIpcDriver::new(pipe, config.ipc.clone());
                    Channel::new(core, driver, kind).launch()
                }
                #[cfg(feature = "cuda")]
                ChannelKind::CudaBasic => {
                    Channel::new(core, CudaBasicDriver::default(), kind).launch()
                }
                #[cfg(feature = "efa")]
                ChannelKind::Efa { .. } => {
                    let (driver, path) =
                        EfaDriver::new(efa_port(config, &origin), reply.clone(), origin.clone());
                    efa_path = Some((kinds.len() - 1, path));
                    Channel::new(core, driver, kind).launch()
                }
                // Started above, on their queue pairs.
                #[cfg(feature = "ibv")]
                ChannelKind::Ibv { .. } => unreachable!("an ibv channel without its backend"),
                #[cfg(all(feature = "cuda", feature = "ibv"))]
                ChannelKind::CudaGdr => unreachable!("a cuda_gdr channel without its backend"),
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
    Pipe {
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
    .start()
}

/// What the channel negotiated as `name` runs as: the one place that maps a channel's name to
/// its backend's driver (the backends are this crate's: `ChannelBackend` is sealed, and
/// negotiation picks only names both contexts offer).
fn channel_kind(name: &str, pipe: u64, transport: &str, config: &Config) -> ChannelKind {
    let chunk_size = config.chunk_size;
    match name {
        "xth" => ChannelKind::Xth { pipe },
        "cma" => ChannelKind::Cma {
            threads: config.cma_threads,
            chunk_size,
            inline_max: config
                .cma_inline_max
                .unwrap_or_else(|| crate::backend::cma::inline_max(transport)),
        },
        "mpt" => ChannelKind::Mpt {
            chunk_size,
            inline_max: backend_of::<crate::backend::mpt::Mpt>(config, "mpt")
                .map_or(crate::backend::mpt::INLINE_MAX, |b| b.inline_max),
        },
        #[cfg(feature = "cuda")]
        "cuda_xth" => ChannelKind::CudaXth { pipe },
        #[cfg(feature = "cuda")]
        "cuda_ipc" => ChannelKind::CudaIpc { pipe },
        #[cfg(feature = "cuda")]
        "cuda_basic" => ChannelKind::CudaBasic,
        #[cfg(all(feature = "cuda", feature = "ibv"))]
        "cuda_gdr" => ChannelKind::CudaGdr,
        #[cfg(feature = "ibv")]
        "ibv" => ChannelKind::Ibv {
            chunk_size,
            inline_max: ibv_backend(config)
                .map_or(crate::backend::ibv::channel::MIN_INLINE, |b| b.inline_max()),
        },
        #[cfg(feature = "efa")]
        "efa" => ChannelKind::Efa {
            chunk_size,
            inline_max: backend_of::<crate::actors::hardware::efa::channel::Efa>(config, "efa")
                .map_or(crate::actors::hardware::efa::channel::INLINE_MAX, |b| {
                    b.inline_limit()
                }),
        },
        // `basic`. (A CUDA channel of a build without `cuda` is never offered.)
        name => {
            debug_assert_eq!(name, "basic", "a channel this build cannot run");
            ChannelKind::Basic { chunk_size }
        }
    }
}

/// The context's channel backend called `name`, as its concrete type.
fn backend_of<T: Clone + 'static>(config: &Config, name: &str) -> Option<T> {
    config
        .channels
        .iter()
        .find(|(c, _)| c.name() == name)
        .and_then(|(c, _)| c.as_any()?.downcast_ref::<T>().cloned())
}

/// The context's `ibv` channel backend.
#[cfg(feature = "ibv")]
fn ibv_backend(config: &Config) -> Option<crate::backend::ibv::channel::IbvChannel> {
    backend_of(config, "ibv")
}

/// For a channel of `kind` that runs on an ibv queue pair: the ibv channel backend whose device
/// it uses, and whether it carries CUDA tensors (`cuda_gdr`, whose instances share one).
#[cfg(feature = "ibv")]
fn queue_pair_backend(
    kind: ChannelKind,
    config: &Config,
) -> Option<(crate::backend::ibv::channel::IbvChannel, bool)> {
    match kind {
        ChannelKind::Ibv { .. } => ibv_backend(config).map(|b| (b, false)),
        #[cfg(feature = "cuda")]
        ChannelKind::CudaGdr => backend_of::<crate::backend::cuda_gdr::CudaGdr>(config, "cuda_gdr")
            .map(|g| (g.ibv().clone(), true)),
        _ => None,
    }
}
