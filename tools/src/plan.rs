//! A run, decided from the command line before anything starts: which backends both contexts
//! enable, what a round trip carries, which baseline it is compared with, and where the two
//! sides run. Every bad combination is refused here, as bad input.

use std::sync::Arc;
use std::time::Duration;

use actorpipe::channel::ChannelBackend;
use actorpipe::transport::Shm;
use actorpipe::{ContextBuilder, Message, Payload, Tensor};

use crate::baseline::Baseline;
use crate::cli::RunArgs;
use crate::failure::{bad, Failure};
use crate::measure::pattern;

/// The three round-trip benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 1 payload of the size.
    Transport,
    /// 1 tensor of the size.
    Channel,
    /// 1 payload of 64 B and 1 tensor of the size.
    Pipe,
}

impl Kind {
    /// The subcommand's name.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Transport => "transport",
            Kind::Channel => "channel",
            Kind::Pipe => "pipe",
        }
    }
}

/// Which transports both contexts enable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transports {
    /// TCP only.
    Tcp,
    /// Shared memory only (the pipe bootstraps on it directly).
    Shm,
    /// Both; negotiation moves a same-host pipe from its TCP bootstrap to shm.
    Both,
    /// TCP bootstrap, then ibv on the simulated device (feature `ibv`; both sides in this
    /// process: the simulation does not cross processes). Measures the code's own overhead.
    IbvSim,
}

impl Transports {
    fn parse(name: &str) -> Result<Transports, Failure> {
        match name {
            "tcp" => Ok(Transports::Tcp),
            "shm" => Ok(Transports::Shm),
            "auto" => Ok(Transports::Both),
            _ => Err(bad(format!(
                "unknown transport {name:?}: use tcp, shm or auto"
            ))),
        }
    }
}

/// How both sides build their context (the same on each side, so that negotiation picks what
/// the run is about).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// Enabled transports.
    pub transports: Transports,
    /// The only channel enabled, or `None` for the default set.
    pub channel: Option<&'static str>,
    /// mpt lanes, when set.
    pub lanes: Option<u32>,
    /// shm spin time, when set.
    pub spin: Option<Duration>,
    /// Heartbeats and TCP keepalive off.
    pub no_keepalive: bool,
    /// I/O pool threads, when set.
    pub io_threads: Option<u32>,
    /// Threads per large cma read, when set.
    pub cma_threads: Option<u32>,
    /// The largest tensor mpt sends inline on the pipe's connection, when set.
    pub mpt_inline_max: Option<u64>,
}

impl Setup {
    /// The context builder for either side: [`base_builder`]'s, with the options.
    pub fn builder(&self) -> ContextBuilder {
        let mut b = base_builder();
        if let Some(spin) = self.spin {
            b = b.transport(Arc::new(Shm::new().with_spin(spin)));
        }
        if let Some(n) = self.lanes {
            b = b.lanes(n);
        }
        b = match self.transports {
            Transports::Tcp => b.without("shm"),
            Transports::Shm => b.without("tcp"),
            Transports::Both => b,
            Transports::IbvSim => ibv_sim(b.without("shm")),
        };
        if let Some(c) = self.channel {
            b = b.only_channels(&[c]);
        }
        if self.no_keepalive {
            b = b.no_keepalive();
        }
        if let Some(n) = self.io_threads {
            b = b.io_threads(n as usize);
        }
        if let Some(n) = self.cma_threads {
            b = b.cma_threads(n as usize);
        }
        if let Some(n) = self.mpt_inline_max {
            b = b.mpt_inline_max(n);
        }
        b
    }

    /// Where a server listens unless told otherwise: loopback TCP, or a fresh shm name when
    /// TCP is off.
    pub fn default_listen(&self) -> &'static str {
        match self.transports {
            Transports::Shm => "shm://auto",
            _ => "tcp://127.0.0.1:0",
        }
    }
}

/// The builder every context of the command starts from: the library's defaults with the
/// `ACTORPIPE_*` environment variables applied (`ContextBuilder::from_env`), so that they work
/// as the docs say. `bench` checks them first ([`check_env`]); a malformed value met here all
/// the same ends the process with exit code 2.
pub fn base_builder() -> ContextBuilder {
    ContextBuilder::from_env().unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    })
}

/// Whether the `ACTORPIPE_*` environment variables are well formed (bad input if not).
pub fn check_env() -> Result<(), crate::failure::Failure> {
    ContextBuilder::from_env()
        .map(drop)
        .map_err(|e| crate::failure::bad(e.to_string()))
}

/// Adds the ibv transport and the ibv channel on the simulated device.
#[cfg(feature = "ibv")]
fn ibv_sim(b: ContextBuilder) -> ContextBuilder {
    use actorpipe::channel::IbvChannel;
    use actorpipe::transport::Ibv;
    let ibv = Ibv::simulated().auto_listen("ibv://127.0.0.1:0");
    b.transport(Arc::new(ibv.clone()))
        .channel(Arc::new(IbvChannel::new(ibv)))
}

/// Without the feature, `plan` refuses ibv runs before any builder is made.
#[cfg(not(feature = "ibv"))]
fn ibv_sim(b: ContextBuilder) -> ContextBuilder {
    b
}

/// What one round trip carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// 1 payload of the size.
    Payload,
    /// 1 tensor of the size, no payload.
    Tensor,
    /// 1 payload of 64 B and 1 tensor of the size.
    PayloadAndTensor,
}

/// The payload that goes with the tensor in `pipe` runs.
pub const PIPE_PAYLOAD: usize = 64;

impl Shape {
    /// A message of this shape with `size` bytes of pattern.
    pub fn message(&self, size: u64) -> Message {
        let body = pattern(size as usize, size);
        match self {
            Shape::Payload => Message::new().with_payload(Payload::new(body)),
            Shape::Tensor => Message::new().with_tensor(Tensor::cpu(body)),
            Shape::PayloadAndTensor => Message::new()
                .with_payload(Payload::new(pattern(PIPE_PAYLOAD, 7)))
                .with_tensor(Tensor::cpu(body)),
        }
    }

    /// In words, for the report.
    pub fn describe(&self) -> &'static str {
        match self {
            Shape::Payload => "1 payload of each size, echoed back",
            Shape::Tensor => "1 tensor of each size (no payload), echoed back",
            Shape::PayloadAndTensor => "1 payload of 64 B + 1 tensor of each size, echoed back",
        }
    }
}

/// Where the two sides run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrangement {
    /// This process is the client; it spawns itself as the server (two processes, one host).
    Spawned,
    /// Both sides in this process, two contexts on two threads (xth needs it).
    InProcess,
    /// This process is the server only, at this URL.
    Listen(String),
    /// This process is the client only, of the server at this URL.
    Connect(String),
}

/// A whole run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Which benchmark.
    pub kind: Kind,
    /// `transport tcp`, `channel cma`, `pipe default`.
    pub label: String,
    /// How both contexts are built.
    pub setup: Setup,
    /// What a round trip carries.
    pub shape: Shape,
    /// The baseline, when it is known before connecting (`pipe` picks it from what the pipe
    /// negotiated).
    pub baseline: Option<Baseline>,
    /// mpt lanes as configured (the default when not given), for the baseline.
    pub lanes: u32,
    /// Where the two sides run.
    pub arrangement: Arrangement,
}

/// Checks a URL the way the runtime will parse it, so that a typo is reported before anything
/// starts.
pub fn check_url(url: &str) -> Result<(), Failure> {
    match actorpipe::transport::scheme(url)? {
        "tcp" => actorpipe::transport::Url::parse(url).map(drop)?,
        "shm" => actorpipe::internal::backend::shm::parse_url(url).map(drop)?,
        other => {
            return Err(bad(format!(
                "bad URL {url:?}: unknown scheme {other:?} (use tcp://host:port or shm://name)"
            )))
        }
    }
    Ok(())
}

const CHANNELS: [&str; 4] = ["basic", "xth", "cma", "mpt"];

fn channel_name(name: &str) -> Result<&'static str, Failure> {
    CHANNELS.into_iter().find(|c| *c == name).ok_or_else(|| {
        bad(format!(
            "unknown channel {name:?}: use basic, xth, cma or mpt"
        ))
    })
}

/// Decides the run from the command line.
pub fn plan(kind: Kind, args: &RunArgs) -> Result<Plan, Failure> {
    let default_lanes = actorpipe::channel::Mpt::default().lanes;
    let lanes = args.lanes().unwrap_or(default_lanes);
    let backend = args.backend.as_deref();
    if args.transport.is_some() && kind != Kind::Channel {
        return Err(bad(
            "--transport is for `bench channel`; use --backend here",
        ));
    }
    let (setup, baseline, label) = match kind {
        Kind::Transport => {
            let name = backend.unwrap_or("tcp");
            let transports = match name {
                "tcp" => Transports::Tcp,
                "shm" => Transports::Shm,
                "ibv-sim" if cfg!(feature = "ibv") => Transports::IbvSim,
                "ibv-sim" => return Err(bad("ibv-sim needs a build with --features ibv")),
                _ => {
                    return Err(bad(format!(
                        "unknown transport {name:?}: use tcp, shm or ibv-sim"
                    )))
                }
            };
            let setup = Setup {
                transports,
                channel: Some("basic"),
                lanes: None,
                spin: None,
                no_keepalive: false,
                io_threads: None,
                cma_threads: None,
                mpt_inline_max: None,
            };
            let (baseline, label) = if transports == Transports::IbvSim {
                // The simulated wire is a memcpy under a lock: compare with a plain memcpy.
                (
                    Baseline::Memcpy,
                    "transport ibv (SIMULATED device)".to_string(),
                )
            } else {
                (Baseline::for_transport(name), format!("transport {name}"))
            };
            (setup, Some(baseline), label)
        }
        Kind::Channel if backend == Some("ibv-sim") => {
            if !cfg!(feature = "ibv") {
                return Err(bad("ibv-sim needs a build with --features ibv"));
            }
            if args.transport.is_some() {
                return Err(bad(
                    "ibv-sim runs over the ibv transport on the same simulated device: drop --transport",
                ));
            }
            let setup = Setup {
                transports: Transports::IbvSim,
                channel: Some("ibv"),
                lanes: None,
                spin: None,
                no_keepalive: false,
                io_threads: None,
                cma_threads: None,
                mpt_inline_max: None,
            };
            // The simulated wire is a memcpy under a lock: compare with a plain memcpy.
            let label = "channel ibv over transport ibv (SIMULATED device)".to_string();
            (setup, Some(Baseline::Memcpy), label)
        }
        Kind::Channel => {
            let channel = channel_name(backend.unwrap_or("basic"))?;
            let default_transport = match channel {
                "basic" | "mpt" => "tcp",
                _ => "auto",
            };
            let transport = args.transport.as_deref().unwrap_or(default_transport);
            let setup = Setup {
                transports: Transports::parse(transport)?,
                channel: Some(channel),
                lanes: None,
                spin: None,
                no_keepalive: false,
                io_threads: None,
                cma_threads: None,
                mpt_inline_max: None,
            };
            let on = if setup.transports == Transports::Tcp {
                "tcp"
            } else {
                "shm"
            };
            let baseline = Baseline::for_channel(channel, on, lanes);
            (setup, Some(baseline), format!("channel {channel}"))
        }
        Kind::Pipe => {
            let name = backend.unwrap_or("default");
            let setup = if name == "default" {
                Setup {
                    transports: Transports::Both,
                    channel: None,
                    lanes: None,
                    spin: None,
                    no_keepalive: false,
                    io_threads: None,
                    cma_threads: None,
                    mpt_inline_max: None,
                }
            } else {
                let (t, c) = name.split_once('+').ok_or_else(|| {
                    bad(format!(
                        "unknown pipe backend {name:?}: use default or TRANSPORT+CHANNEL, like tcp+basic"
                    ))
                })?;
                let transports = match t {
                    "tcp" => Transports::Tcp,
                    "shm" => Transports::Shm,
                    _ => {
                        return Err(bad(format!(
                            "unknown transport {t:?} in {name:?}: use tcp or shm"
                        )))
                    }
                };
                Setup {
                    transports,
                    channel: Some(channel_name(c)?),
                    lanes: None,
                    spin: None,
                    no_keepalive: false,
                    io_threads: None,
                    cma_threads: None,
                    mpt_inline_max: None,
                }
            };
            (setup, None, format!("pipe {name}"))
        }
    };
    let mut setup = setup;
    setup.no_keepalive = args.no_keepalive;
    setup.io_threads = args.io_threads;
    setup.cma_threads = args.cma_threads;
    setup.mpt_inline_max = args.mpt_inline_max;
    if let Some(n) = args.lanes() {
        let mpt_possible = setup.channel.is_none() || setup.channel == Some("mpt");
        if !mpt_possible {
            return Err(bad(
                "--lanes configures the mpt channel, which this run does not use",
            ));
        }
        setup.lanes = Some(n);
    }
    if !args.lane_addresses.is_empty() {
        let mpt_possible = setup.channel.is_none() || setup.channel == Some("mpt");
        if !mpt_possible || setup.transports == Transports::Shm {
            return Err(bad(
                "--lane-addresses configures the mpt channel, which this run does not use",
            ));
        }
    }
    if let Some(us) = args.spin {
        if setup.transports == Transports::Tcp {
            return Err(bad(
                "--spin configures the shm transport, which this run does not use",
            ));
        }
        setup.spin = Some(Duration::from_micros(us));
    }
    if setup.channel == Some("cma") {
        if let Err(why) = actorpipe::channel::Cma.viable() {
            return Err(Failure::Failed(format!(
                "the cma channel cannot run here: {why}"
            )));
        }
    }
    let in_process = setup.channel == Some("xth") || setup.transports == Transports::IbvSim;
    let arrangement = match (&args.listen, &args.connect) {
        (Some(_), Some(_)) => return Err(bad("--listen and --connect go to different processes")),
        (Some(url), None) => {
            check_url(url)?;
            if in_process {
                return Err(bad(
                    "xth and the simulated ibv device work only inside one process: drop --listen",
                ));
            }
            Arrangement::Listen(url.clone())
        }
        (None, Some(url)) => {
            check_url(url)?;
            if in_process {
                return Err(bad(
                    "xth and the simulated ibv device work only inside one process: drop --connect",
                ));
            }
            Arrangement::Connect(url.clone())
        }
        (None, None) if in_process => Arrangement::InProcess,
        (None, None) => Arrangement::Spawned,
    };
    if let Some(b) = &args.baseline {
        b.parse::<std::net::SocketAddr>().map_err(|_| {
            bad(format!(
                "bad --baseline {b:?}: expected an address like 10.0.0.2:5001"
            ))
        })?;
    }
    Ok(Plan {
        kind,
        label,
        setup,
        shape: match kind {
            Kind::Transport => Shape::Payload,
            Kind::Channel => Shape::Tensor,
            Kind::Pipe => Shape::PayloadAndTensor,
        },
        baseline,
        lanes,
        arrangement,
    })
}

/// Which baseline servers a server process starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// The TCP echo server.
    pub tcp: bool,
    /// The memfd ring echo thread.
    pub shm: bool,
    /// The buffer for process_vm_readv.
    pub cma: bool,
}

impl Plan {
    /// The baseline servers this run's server side should provide. A `pipe` run learns its
    /// baseline only once negotiated, so its server offers every one that can apply. (A server
    /// for two hosts provides only the TCP one: the others need the same host.)
    pub fn needs(&self) -> Needs {
        let mut n = Needs::default();
        match self.baseline {
            Some(Baseline::Tcp { .. }) => n.tcp = true,
            Some(Baseline::ShmRing) => n.shm = true,
            Some(Baseline::Cma) => n.cma = true,
            Some(Baseline::Memcpy) => {}
            None => {
                n.tcp = true;
                n.shm = true;
                n.cma = actorpipe::channel::Cma.viable().is_ok();
            }
        }
        n
    }
}
