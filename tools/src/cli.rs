//! The command line, as clap parses it.

use clap::{Args, Parser, Subcommand};

use crate::bench::Api;
use crate::units::{parse_sizes, Sizes};

/// actorpipe: a tensor-aware communication runtime where every connection is an actor.
#[derive(Debug, Parser)]
#[command(name = "actorpipe", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The top-level commands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once; boxing would only obscure clap's derive
pub enum Command {
    /// List every backend this build knows, whether it can run here (and why not), and the
    /// domain descriptor it advertises.
    Info {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Measure round trips through actorpipe next to raw baselines from the same run.
    Bench {
        /// What to measure.
        #[command(subcommand)]
        what: BenchCommand,
    },
}

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// A message with 1 payload of each size, echoed back: the transport alone.
    ///
    /// --backend tcp|shm|ibv-sim (default tcp). ibv-sim (feature ibv) is the ibv transport on the
    /// SIMULATED device, both sides in this process: it measures the code's own overhead, not
    /// an HCA.
    Transport(RunArgs),
    /// A message with 1 tensor of each size (no payloads), echoed back: one channel.
    ///
    /// --backend basic|xth|cma|mpt|ibv-sim (default basic). xth works only inside one process, so
    /// its run has both sides in this process (two contexts on two threads). ibv-sim (feature
    /// ibv) is the ibv channel over the ibv transport on the SIMULATED device, both sides in this
    /// process: it measures the code's own overhead, not an HCA. cuda_xth and cuda_ipc (feature
    /// cuda) echo one CUDA tensor (on --device), next to the driver's copy of the same path, over
    /// --transport tcp (default) or shm (with --spin); cuda_ipc's echo runs in a second process
    /// and also gets a raw cross-process baseline; cuda_basic's rows add a host tensor through
    /// the same pipes (the CPU channel under it). cuda_gdr (features cuda and ibv) is the
    /// cuda_gdr channel on the SIMULATED verbs device, both sides in this process (the NIC's
    /// DMA is a CUDA copy: it measures the code's own overhead), with a second column striped
    /// over two simulated devices; without a GPU it says why it skips.
    Channel(RunArgs),
    /// A message with 1 payload of 64 B and 1 tensor of each size, echoed back, through what the
    /// two contexts negotiate.
    ///
    /// --backend default (every backend enabled, as `Context::builder()` does) or
    /// TRANSPORT+CHANNEL, like tcp+basic, tcp+mpt, shm+cma or shm+basic.
    Pipe(RunArgs),
    /// Open many pipes on one context and report the memory each costs while idle.
    Idle(IdleArgs),
    /// The floor under a 64 B shm round trip, one layer at a time: the shm transport's halves
    /// under tokio, then with one actor mailbox hop per message and side (both sides in this
    /// process, on two threads).
    Layers(LayersArgs),
    /// Large copies on one thread and shared among the copy threads (`actorpipe::internal::copy`), one
    /// process per thread count: the floor under same-host large messages.
    Copy(CopyArgs),
    /// One-sided reads and writes of a registered region (`actorpipe::remote`), batches of
    /// spans, next to the raw copy of the same spans in the same run.
    ///
    /// --backend xth (the default, and the one path built so far): the owner and the initiator
    /// are two contexts of this process, on two threads.
    Remote(RemoteArgs),
    /// libfabric tagged ping-pong through the endpoint actor next to a raw ping-pong written
    /// with the same binding, on each provider (feature `efa`).
    #[cfg(feature = "efa")]
    Efa(EfaArgs),
}

/// Options of `bench efa`.
#[cfg(feature = "efa")]
#[derive(Debug, Clone, Args)]
pub struct EfaArgs {
    /// libfabric providers to measure, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "tcp;ofi_rxm,shm"
    )]
    pub providers: Vec<String>,

    /// Message sizes: K, M and G are binary (KiB, MiB, GiB). The default has a size between
    /// 64 KiB and 64 MiB: a 4 MiB tensor on the `shm` provider took 2.8 times the raw ping-pong
    /// until 2026-11-28, and neither neighbour showed it.
    #[arg(
        long,
        value_name = "LIST",
        default_value = "64,64K,4M,64M",
        value_parser = parse_sizes
    )]
    pub sizes: Sizes,

    /// Timed round trips per size and round. [default: 256 MiB / size, between 20 and 10000]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub iters: Option<u32>,

    /// Rounds per size, alternating the raw baseline and the endpoint actor.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,

    /// Only these actorpipe rows, named as the table prints them (`actor`, `transport`,
    /// `channel`, `in-place`, `striped`, and with --spin `actor spin`, …; `raw` for the baseline, without
    /// which the ratio column is empty). [default: all]
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub rows: Vec<String>,

    /// Also run each actorpipe row in spin mode (`EndpointConfig::busy_poll`: the endpoint
    /// busy-polls its CQ for US microseconds after each completion or post), beside the rows
    /// without spin, against the same raw rounds.
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub spin: Option<u64>,

    /// How the pipe rows drive their pipes (as `bench transport --api`): receive (the default
    /// here, as in the earlier efa measurements), writer, standing (a `PipeWriter` and one
    /// standing receive, as `bench transport`'s targets are measured), handler (the fastest:
    /// the standing receive's handler writes the next message in place), fired or awaited.
    #[arg(long, value_enum, default_value = "receive")]
    pub api: Api,

    /// Instead: hold an endpoint with a receive posted for SECS seconds, per provider and
    /// progress mode (wait fd, polling), and print the CPU it used.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub idle: Option<u64>,

    /// Pin every row's two sides to the same two CPUs: the client (this thread, and the
    /// threads it starts) to CPU 0, the echo side's thread to CPU 1, the raw ping-pong's two
    /// threads alike. Without it the scheduler places each round's fresh threads anew.
    #[arg(long)]
    pub pin: bool,

    /// Every endpoint's CQ without a wait fd, only polled: the actorpipe rows' endpoints
    /// (`EndpointConfig::force_polling`) and the raw ping-pong's alike. Where the provider
    /// offers a wait fd (`tcp;ofi_rxm`), that saves its signalling, two system calls per
    /// completion.
    #[arg(long)]
    pub no_wait_fd: bool,
}

/// Options of `bench transport|channel|pipe`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The backend to measure (see the subcommand's help for the names).
    #[arg(long, value_name = "NAME")]
    pub backend: Option<String>,

    /// channel only: the pipe's transport, tcp, shm or auto (both enabled; shm wins on one host).
    /// [default: tcp for basic and mpt, auto for cma and xth]
    #[arg(long, value_name = "NAME")]
    pub transport: Option<String>,

    /// Message sizes: K, M and G are binary (KiB, MiB, GiB).
    #[arg(long, value_name = "LIST", default_value = "64,4K,1M,64M", value_parser = parse_sizes)]
    pub sizes: Sizes,

    /// Timed round trips per size. [default: 256 MiB / size, between 20 and 10000]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub iters: Option<u32>,

    /// Untimed round trips per size before the timed ones. [default: iters / 10, at least 2]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=10_000_000))]
    pub warmup: Option<u32>,

    /// Rounds per size, alternating actorpipe and the baseline (so a slow spell of the machine
    /// weighs on both alike).
    #[arg(long, value_name = "N", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,

    /// Lanes (TCP connections) of the mpt channel, and sockets of its baseline. [default: 2]
    /// `channel --backend mpt` takes a list (`--lanes 1,2,4,8`): it then measures each count
    /// and single-stream tcp+basic in turn, and prints the scaling in one table.
    #[arg(long, value_name = "N[,N..]", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub lanes: Vec<u32>,

    /// Threads of each context's I/O pool, on which mpt's lanes run
    /// (`ContextBuilder::io_threads`). [default: the library's]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=256))]
    pub io_threads: Option<u32>,

    /// The largest tensor the mpt channel sends inline, after its descriptor on the pipe's
    /// connection, instead of over the lanes, both sides (`ContextBuilder::mpt_inline_max`; 0:
    /// every non-empty tensor over the lanes). [default: the library's, 256 KiB]
    #[arg(long, value_name = "BYTES", value_parser = crate::units::parse_limit)]
    pub mpt_inline_max: Option<u64>,

    /// Threads per large cma read, both sides (`ContextBuilder::cma_threads`). [default: the
    /// library's]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cma_threads: Option<u32>,

    /// Local addresses the client's mpt lanes leave from, one per NIC, round-robin
    /// (`ContextBuilder::lane_addresses`); the raw baseline's sockets are not bound.
    #[arg(long, value_name = "IP,IP", value_delimiter = ',')]
    pub lane_addresses: Vec<std::net::IpAddr>,

    /// Spin mode: poll the shm rings for this many microseconds before sleeping on a doorbell
    /// (the shm transport and its baseline alike).
    #[arg(long, value_name = "MICROS", value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub spin: Option<u64>,

    /// How the benchmark drives pipes: writer (actors that read with `Receive`, fired with
    /// `notify`, and write through a `PipeWriter`, which writes a small message from the
    /// actor's own handler), receive (the same, writing by sending `Write` to the pipe: the path
    /// before `PipeWriter`), fired (as receive, reading with `ReadDescriptor` then `Read`),
    /// awaited (async code that awaits `pipe.send(op)`, two-step reads), standing (as
    /// writer, reading with one standing receive, `ReceiveAll`, instead of a `Receive` each) or
    /// handler (as standing, with a handler called in place, `ReceiveAll::calling`, that writes
    /// the next message itself: no mailbox hop).
    #[arg(long, value_enum, default_value = "writer")]
    pub api: Api,

    /// Measure actorpipe only (for profiling: `perf record` then sees no baseline code).
    #[arg(long)]
    pub no_baseline: bool,

    /// Pin the client to CPU 0 and the server to CPU 1 (every thread of each side), so that
    /// the scheduler cannot queue a woken side behind the other on one core.
    #[arg(long)]
    pub pin: bool,

    /// Turn heartbeats and TCP keepalive off on both sides (`ContextBuilder::no_keepalive`),
    /// to measure what they cost.
    #[arg(long)]
    pub no_keepalive: bool,

    /// cuda_* channels only: the GPU of the sent tensor and the GPU the echoing side lands it
    /// on (`--device 0,1`: across two GPUs, next to the driver's peer copy). One ordinal: both
    /// sides on it. [default: 0]
    #[arg(long, value_name = "GPU[,GPU]", value_delimiter = ',', num_args = 1..=2)]
    pub device: Vec<u32>,

    /// Print the results as JSON on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Run only the server side, listening at URL (two hosts: start this one first). It prints
    /// its URLs, and serves until interrupted. The raw TCP baseline listens on port + 1.
    #[arg(long, value_name = "URL", conflicts_with = "connect")]
    pub listen: Option<String>,

    /// Run only the client side, against a server started with --listen.
    #[arg(long, value_name = "URL")]
    pub connect: Option<String>,

    /// With --connect: where the server's raw TCP baseline listens. [default: the --connect
    /// host, port + 1]
    #[arg(long, value_name = "HOST:PORT", requires = "connect")]
    pub baseline: Option<String>,

    /// Internal: this process is the server that a client spawned (watch stdin, answer on
    /// stdout).
    #[arg(long, hide = true, requires = "listen")]
    pub serve: bool,

    /// Internal: the shm baseline's descriptors, inherited from the client.
    #[arg(long, hide = true, value_name = "FDS")]
    pub shm_fds: Option<String>,
}

impl RunArgs {
    /// The one lane count given, if exactly one was.
    pub fn lanes(&self) -> Option<u32> {
        match self.lanes[..] {
            [n] => Some(n),
            _ => None,
        }
    }
}

/// Options of `bench layers`.
#[derive(Debug, Clone, Args)]
pub struct LayersArgs {
    /// The transport: shm (the default), tcp (loopback, keepalive on as in a pipe), or efa
    /// (feature `efa`: over the libfabric provider `--provider` names).
    #[arg(long, value_name = "NAME", default_value = "shm")]
    pub transport: String,

    /// shm: spin for this many microseconds before sleeping on a doorbell (`Shm::with_spin`);
    /// efa: the endpoint's spin mode (`EndpointConfig::busy_poll`), 0 for none.
    #[arg(long, value_name = "MICROS", default_value_t = 20)]
    pub spin: u64,

    /// efa: the libfabric provider (`tcp;ofi_rxm`, `shm`, `efa`).
    #[arg(long, value_name = "NAME", default_value = "tcp;ofi_rxm")]
    pub provider: String,

    /// Timed round trips per round.
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub iters: u32,

    /// Untimed round trips before the timed ones, per round.
    #[arg(long, value_name = "N", default_value_t = 1_000)]
    pub warmup: u32,

    /// Rounds per layer, each over a new connection.
    #[arg(long, value_name = "N", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,

    /// Pin the client's thread to CPU 0 and the echo thread to CPU 1.
    #[arg(long)]
    pub pin: bool,

    /// The layers to run: `halves`, `actor` (`halves + actor`), or both, comma-separated (one
    /// alone, to count what it costs under a profiler).
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "halves,actor",
          value_parser = ["halves", "actor"])]
    pub layers: Vec<String>,

    /// Print the results as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `bench copy`.
#[derive(Debug, Clone, Args)]
pub struct CopyArgs {
    /// Copy sizes, comma-separated (K, M, G: KiB, MiB, GiB).
    #[arg(long, value_name = "LIST", default_value = "1M,16M,64M",
          value_parser = crate::units::parse_sizes)]
    pub sizes: crate::units::Sizes,

    /// Thread counts to compare, the caller included (1: no sharing), comma-separated; each
    /// runs in a process of its own.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "1,2,4,8",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: Vec<u32>,

    /// Timed copies per size and way.
    #[arg(long, value_name = "N", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub iters: u32,

    /// Print the results as JSON on stdout.
    #[arg(long)]
    pub json: bool,

    /// Measure in this process (one thread count) and print its JSON: what each process of a
    /// run does.
    #[arg(long, hide = true)]
    pub in_process: bool,
}

/// Options of `bench remote`.
#[derive(Debug, Clone, Args)]
pub struct RemoteArgs {
    /// The path: xth, cma, tcp or shm (the last two: the bytes on the pipe's remote lane);
    /// with feature `cuda`, cuda_xth or cuda_ipc (device memory on GPU 0).
    #[arg(long, default_value = "xth")]
    pub backend: String,

    /// Bytes per operation, comma-separated (K, M, G: KiB, MiB, GiB).
    #[arg(long, value_name = "LIST", default_value = "4K,1M,64M",
          value_parser = crate::units::parse_sizes)]
    pub sizes: crate::units::Sizes,

    /// Spans per operation, comma-separated: the size is cut into this many pieces, spread over
    /// the region.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "1,64",
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub batch: Vec<u32>,

    /// Timed operations per row.
    #[arg(long, value_name = "N", default_value_t = 50,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub iters: u32,
}

/// Options of `bench idle`.
#[derive(Debug, Clone, Args)]
pub struct IdleArgs {
    /// Pipes to open on one context.
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub pipes: u32,

    /// Which configurations to measure: tcp+basic, default, or both. [default: both]
    #[arg(long, value_name = "NAME")]
    pub backend: Option<String>,

    /// Seconds to leave the pipes idle while measuring the client's CPU time (heartbeats and
    /// timers are all that runs).
    #[arg(long, value_name = "SECS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub hold: u64,

    /// Print the results as JSON on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Internal: run as the server of an idle measurement, listening at URL.
    #[arg(long, hide = true, value_name = "URL")]
    pub serve: Option<String>,
}
