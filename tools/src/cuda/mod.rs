//! `bench channel --backend cuda_xth|cuda_ipc|cuda_basic|cuda_gdr` (feature `cuda`): one CUDA
//! tensor of each size echoed through a pipe, next to the driver's own copy of the same path in
//! the same run, rounds alternating.
//!
//! - `cuda_xth`: both pipes in this process (two contexts on one thread).
//! - `cuda_ipc`: the echoing side is this program again, started as a child process
//!   (`ACTORPIPE_BENCH_CUDA_ECHO` names the listener), so every tensor crosses processes. A
//!   second raw baseline runs between the same two processes ([`raw`]): what any two processes
//!   sharing a GPU pay, with no actorpipe code on the path.
//! - `cuda_basic`: both pipes in this process, whose contexts leave the other CUDA channels
//!   out; the raw baseline is then the driver's pinned device-to-host plus host-to-device copy
//!   each way (what one staged transfer does), and a host tensor of the same size goes through
//!   the same pipes (the CPU channel under `cuda_basic`).
//! - `cuda_gdr` (feature `ibv` too): both pipes in this process, on the SIMULATED verbs device
//!   ([`gdr`]); a second pair of pipes stripes each tensor over two simulated devices.
//!
//! `--device S,D` puts the sent tensor on GPU S and lands it on GPU D on the echoing side (the
//! raw baseline is then the driver's copy from S to D and back). `--transport shm` (with
//! `--spin`) carries the control stream over shared memory instead of loopback TCP.
//!
//! Each round trip: write, `Receive` into the last round's buffers, the echo's stream ordered
//! after the copy with `wait_on` (no CPU wait), write back, `Receive`, blocking `wait`.

#[cfg(feature = "ibv")]
mod gdr;
mod raw;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::cuda::{self, CudaBuffer};
use actorpipe::transport::Shm;
use actorpipe::{
    Allocation, Buffer, Connect, Context, ContextBuilder, Descriptor, GetInfo, Listen, Message,
    Pipe, Read, ReadDescriptor, Receive, Tensor, Write,
};

use crate::cli::RunArgs;
use crate::failure::{bad, Failure};
use crate::report::Provenance;
use crate::units::human_size;

/// The variable that makes this program the echoing side of a `cuda_ipc` run: the URL.
const ECHO: &str = "ACTORPIPE_BENCH_CUDA_ECHO";
/// The echoing side's setup: `spin=N;device=D;raw=PATH`.
const SETUP: &str = "ACTORPIPE_BENCH_CUDA_SETUP";

/// How both sides are set up.
#[derive(Debug, Clone, Default)]
struct Setup {
    backend: String,
    /// Control stream over shm instead of TCP.
    shm: bool,
    spin: Option<u64>,
    /// The sending side's GPU, and the GPU the echo lands tensors on.
    src: u32,
    dst: u32,
    /// cuda_gdr: the simulated devices of its channel.
    #[cfg(feature = "ibv")]
    sim: Vec<usize>,
}

impl Setup {
    fn from_args(args: &RunArgs) -> Result<Setup, Failure> {
        let backend = args.backend.clone().unwrap_or_default();
        if !matches!(
            backend.as_str(),
            "cuda_xth" | "cuda_ipc" | "cuda_basic" | "cuda_gdr"
        ) {
            return Err(bad(format!(
                "unknown CUDA channel {backend:?}: use cuda_xth, cuda_ipc, cuda_basic or cuda_gdr"
            )));
        }
        if backend == "cuda_gdr" && !cfg!(feature = "ibv") {
            return Err(bad("cuda_gdr needs a build with --features cuda,ibv"));
        }
        if args.json || args.listen.is_some() || !args.lanes.is_empty() {
            return Err(bad(
                "the cuda_* channels take --sizes, --iters, --warmup, --rounds, --transport, --spin and --device only",
            ));
        }
        let shm = match args.transport.as_deref() {
            None | Some("tcp") => false,
            Some("shm") => true,
            Some(t) => return Err(bad(format!("unknown transport {t:?}: use tcp or shm"))),
        };
        if args.spin.is_some() && !shm {
            return Err(bad("--spin is for --transport shm"));
        }
        let src = args.device.first().copied().unwrap_or(0);
        let dst = args.device.get(1).copied().unwrap_or(src);
        Ok(Setup {
            backend,
            shm,
            spin: args.spin,
            src,
            dst,
            #[cfg(feature = "ibv")]
            sim: gdr::ONE.to_vec(),
        })
    }

    /// A context offering the backend and no other CUDA channel that would win over it, over
    /// the chosen transport.
    fn builder(&self) -> ContextBuilder {
        let mut b = match self.backend.as_str() {
            "cuda_basic" => crate::plan::base_builder()
                .without("cuda_xth")
                .without("cuda_ipc"),
            #[cfg(feature = "ibv")]
            "cuda_gdr" => gdr::with_gdr(crate::plan::base_builder(), &self.sim),
            _ => crate::plan::base_builder(),
        };
        if self.shm {
            b = b.without("tcp");
            if let Some(us) = self.spin {
                b = b.transport(Arc::new(Shm::new().with_spin(Duration::from_micros(us))));
            }
        } else {
            b = b.without("shm");
        }
        b
    }

    fn listen_url(&self) -> &'static str {
        if self.shm {
            "shm://auto"
        } else {
            "tcp://127.0.0.1:0"
        }
    }

    /// What the echoing child is told.
    fn encode(&self, raw: &std::path::Path) -> String {
        format!(
            "backend={};shm={};spin={};device={};raw={}",
            self.backend,
            self.shm,
            self.spin.map_or(String::new(), |s| s.to_string()),
            self.dst,
            raw.display()
        )
    }

    fn decode(s: &str) -> (Setup, Option<String>) {
        let mut setup = Setup::default();
        let mut raw = None;
        for kv in s.split(';') {
            match kv.split_once('=') {
                Some(("backend", v)) => setup.backend = v.to_string(),
                Some(("shm", v)) => setup.shm = v == "true",
                Some(("spin", v)) => setup.spin = v.parse().ok(),
                Some(("device", v)) => setup.dst = v.parse().unwrap_or(0),
                Some(("raw", v)) if !v.is_empty() => raw = Some(v.to_string()),
                _ => {}
            }
        }
        (setup, raw)
    }
}

/// In the child of a `cuda_ipc` run: echoes until the pipe closes, then exits.
pub fn echo_child() {
    let Ok(url) = std::env::var(ECHO) else {
        return;
    };
    let (setup, raw) = Setup::decode(&std::env::var(SETUP).unwrap_or_default());
    if let Some(path) = raw {
        let device = setup.dst;
        std::thread::spawn(move || raw::serve(path, device));
    }
    let result = actix::System::new().block_on(async move {
        let ctx = setup.builder().start();
        let pipe = ctx.send(Connect::new(&url)).await??;
        echo(pipe, setup.dst).await;
        Ok::<_, Failure>(())
    });
    std::process::exit(match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: cuda_ipc echo: {e}");
            1
        }
    });
}

/// Whether `a` holds buffers for `d` with its CUDA tensors on `device`.
fn fits(a: &Allocation, d: &Descriptor, device: u32) -> bool {
    a.tensors.len() == d.tensors.len()
        && a.tensors.iter().zip(&d.tensors).all(|(b, t)| {
            b.len() == t.length
                && match (b, t.landing()) {
                    (Buffer::Cuda(c), actorpipe::Device::Cuda(_)) => c.device() == device,
                    (Buffer::Cpu(_), actorpipe::Device::Cpu) => true,
                    _ => false,
                }
        })
}

/// Sends every message back, its CUDA tensors landed on `device` and ordered after their copies
/// on the GPU, receiving into the buffers of the last echo; returns when the pipe closes.
async fn echo(pipe: Addr<Pipe>, device: u32) {
    let mut spare = None::<Allocation>;
    loop {
        let Ok(ready) = pipe.send(ReadDescriptor).await else {
            return;
        };
        let Ok(d) = ready.descriptor else {
            return;
        };
        let allocation = match spare.take() {
            Some(a) if fits(&a, &d, device) => a,
            _ => match Allocation::for_descriptor_on(&d, device) {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("error: cuda echo: allocating: {e}");
                    return;
                }
            },
        };
        let Ok(got) = pipe.send(Read::new(allocation)).await else {
            return;
        };
        if got.result.is_err() {
            return;
        }
        let mut back = got.message;
        for (t, sent) in back.tensors.iter_mut().zip(&d.tensors) {
            if let Some(c) = t.buffer.as_cuda() {
                if got.cuda.wait_on(c.stream()).is_err() {
                    return;
                }
            }
            // Back where it came from: the sender's receive lands a tensor on the device its
            // descriptor suggests, and otherwise on this (the echo's) device.
            t.target_device = Some(sent.source_device);
        }
        match pipe.send(Write::new(back)).await {
            Ok(w) if w.result.is_ok() => spare = Some(Allocation::from(w.message)),
            _ => return,
        }
    }
}

fn failed<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Failure + '_ {
    move |e| Failure::Failed(format!("{what}: {e}"))
}

/// One row: the size and the medians.
struct Row {
    size: u64,
    pipe: Duration,
    raw: Duration,
    /// cuda_ipc: the raw copy between the two processes; cuda_basic: a host tensor through the
    /// same pipes.
    other: Option<Duration>,
}

/// Measures and prints the table.
pub fn run(args: &RunArgs) -> Result<(), Failure> {
    let setup = Setup::from_args(args)?;
    cuda::available().map_err(|why| Failure::Failed(format!("no CUDA GPU here: {why}")))?;
    let src = cuda::gpu(setup.src).map_err(failed("the sending GPU"))?;
    let dst = cuda::gpu(setup.dst).map_err(failed("the echoing GPU"))?;
    let names: Vec<String> = cuda::devices()
        .ok()
        .map(|d| d.into_iter().map(|g| g.name).collect())
        .unwrap_or_default();
    let name = |i: u32| {
        names
            .get(i as usize)
            .cloned()
            .unwrap_or_else(|| format!("GPU {i}"))
    };
    let (negotiated, rows) = actix::System::new().block_on(measure(&setup, args, &src, &dst))?;
    crate::report::emit(&table(
        &setup,
        &negotiated,
        &rows,
        &name(setup.src),
        &name(setup.dst),
    ))
}

fn table(setup: &Setup, negotiated: &str, rows: &[Row], src: &str, dst: &str) -> String {
    let p = Provenance::here();
    let backend = setup.backend.as_str();
    let mut out = format!(
        "actorpipe bench channel {backend}{}: 1 CUDA tensor of each size on cuda:{}, echoed{} onto cuda:{}\n",
        if backend == "cuda_gdr" {
            " (SIMULATED RDMA device, real GPU)"
        } else {
            ""
        },
        setup.src,
        if backend == "cuda_ipc" {
            " by another process"
        } else {
            " by another context of this process"
        },
        setup.dst,
    );
    let same = setup.src == setup.dst;
    let raw = match (backend, same) {
        ("cuda_basic", _) => "cuMemcpyDtoHAsync into pinned memory + cuMemcpyHtoDAsync back, each way, on one stream + synchronize (the driver's copies of the same path)",
        (_, true) => "cuMemcpyDtoDAsync there and back on one stream + synchronize (the driver's copy of the same path, in one process)",
        (_, false) => "cuMemcpyPeerAsync there and back on one stream + synchronize (the driver's copy of the same path, in one process)",
    };
    out += &format!(
        "  machine:  {}\n  gpus:     cuda:{} {src}, cuda:{} {dst}\n  date:     {}\n  command:  {}\n",
        p.machine, setup.src, setup.dst, p.date, p.command
    );
    out += &format!(
        "  control:  {}\n",
        match (setup.shm, setup.spin) {
            (false, _) => "tcp (loopback)".to_string(),
            (true, None) => "shm, no spinning".to_string(),
            (true, Some(us)) => format!("shm, spinning {us} us"),
        }
    );
    #[cfg(feature = "ibv")]
    if backend == "cuda_gdr" {
        out += gdr::DEVICE_LINE;
    }
    out += &format!("  negotiated: {negotiated}\n");
    out += &format!("  raw: {raw}\n");
    let other = match backend {
        "cuda_ipc" => {
            out += "  raw 2-proc: the same copies between the same two processes through CUDA IPC handles, each stream waiting on the other's interprocess event, a byte on a Unix socket per turn (no actorpipe code)\n";
            Some("raw 2-proc")
        }
        "cuda_basic" => {
            out += "  cpu channel: a host tensor of the same size through the same pipes (the CPU channel under cuda_basic)\n";
            Some("cpu channel")
        }
        #[cfg(feature = "ibv")]
        "cuda_gdr" => {
            out += "  striped: the same tensor through a second pair of pipes whose cuda_gdr stripes it over two SIMULATED devices (tensors over 64 KiB; smaller ones stay whole on the first)\n";
            Some(gdr::STRIPED_LABEL)
        }
        _ => None,
    };
    out += "\n| size | pipe p50 | pipe GB/s | raw p50 | raw GB/s | pipe / raw |";
    let mut rule = String::from("| --- | --- | --- | --- | --- | --- |");
    if let Some(o) = other {
        let ratio = match backend {
            "cuda_gdr" => format!("{o} / raw"),
            _ => format!("pipe / {}", slowest(backend, o)),
        };
        out += &format!(" {o} p50 | {o} GB/s | {ratio} |");
        rule += " --- | --- | --- |";
    }
    out += &format!("\n{rule}\n");
    for r in rows {
        let gbps = |d: Duration| 2.0 * r.size as f64 / d.as_secs_f64() / 1e9;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let pct = |base: Duration| 100.0 * base.as_secs_f64() / r.pipe.as_secs_f64();
        out += &format!(
            "| {} | {:.1} us | {:.2} | {:.1} us | {:.2} | {:.0} % |",
            human_size(r.size),
            us(r.pipe),
            gbps(r.pipe),
            us(r.raw),
            gbps(r.raw),
            pct(r.raw)
        );
        if let Some(o) = r.other {
            // cuda_basic is held to the slower of its legs: the staged copies or the CPU
            // channel; cuda_gdr's striped pipes to the raw copy, like its one-device pipes.
            let ratio = match backend {
                "cuda_basic" => pct(o.max(r.raw)),
                "cuda_gdr" => 100.0 * r.raw.as_secs_f64() / o.as_secs_f64(),
                _ => pct(o),
            };
            out += &format!(" {:.1} us | {:.2} | {:.0} % |", us(o), gbps(o), ratio);
        }
        out += "\n";
    }
    out
}

/// The column header of the last ratio.
fn slowest(backend: &str, other: &str) -> String {
    match backend {
        "cuda_basic" => "slower of raw and cpu channel".into(),
        _ => other.into(),
    }
}

async fn measure(
    setup: &Setup,
    args: &RunArgs,
    gpu: &Arc<cuda::Gpu>,
    far: &Arc<cuda::Gpu>,
) -> Result<(String, Vec<Row>), Failure> {
    let mut listening = listen(setup).await?;
    let mut child = None;
    let mut raw2 = None;
    let (tx, echo_side) = if setup.backend == "cuda_ipc" {
        let peer = raw::RawPeer::listen()?;
        let c = std::process::Command::new(std::env::current_exe()?)
            .env(ECHO, &listening.url)
            .env(SETUP, setup.encode(peer.path()))
            .stdout(std::process::Stdio::null())
            .spawn()?;
        child = Some(Kill(c));
        raw2 = Some(peer);
        (listening.accept().await?, None)
    } else {
        let (tx, echo) = local_pair(setup, &mut listening).await?;
        (tx, Some(echo))
    };
    let info = negotiated(&tx, setup).await?;
    // cuda_gdr: a second pair of pipes, whose channel stripes over two simulated devices.
    #[cfg(feature = "ibv")]
    let mut striped = match setup.backend.as_str() {
        "cuda_gdr" => {
            let two = Setup {
                sim: gdr::STRIPED.to_vec(),
                ..setup.clone()
            };
            let mut l = listen(&two).await?;
            let (tx2, echo2) = local_pair(&two, &mut l).await?;
            negotiated(&tx2, &two).await?;
            Some((tx2, echo2, l))
        }
        _ => None,
    };
    #[cfg(not(feature = "ibv"))]
    let mut striped: Option<(Addr<Pipe>, tokio::task::JoinHandle<()>, Listening)> = None;
    let stream = gpu.lease_stream().map_err(failed("a stream"))?;
    // The raw copy between two GPUs goes the driver's best way: peer to peer where the two
    // can (a cuda_xth pipe of this process turns it on too; the cuda_ipc client has none).
    gpu.enable_peer_access(far).map_err(failed("peer access"))?;
    far.enable_peer_access(gpu).map_err(failed("peer access"))?;
    let mut rows = Vec::new();
    for &size in &args.sizes.0 {
        let len = size as usize;
        let iters = args
            .iters
            .unwrap_or_else(|| ((256u64 << 20) / size.max(1)).clamp(20, 10_000) as u32);
        let warmup = args.warmup.unwrap_or((iters / 10).max(2));
        let a = CudaBuffer::alloc(gpu.ordinal(), len).map_err(failed("allocating"))?;
        let b = CudaBuffer::alloc(far.ordinal(), len).map_err(failed("allocating"))?;
        let pinned = match setup.backend.as_str() {
            "cuda_basic" => Some(
                cuda::PinnedPool::new(len, 0)
                    .take()
                    .map_err(failed("pinned memory"))?,
            ),
            _ => None,
        };
        if let Some(p) = raw2.as_mut() {
            p.size(gpu, len)?;
        }
        let mut host = (setup.backend == "cuda_basic")
            .then(|| Message::new().with_tensor(Tensor::cpu(vec![7u8; len])));
        let mut m = Message::new().with_tensor(Tensor::cuda(
            CudaBuffer::alloc(gpu.ordinal(), len).map_err(failed("allocating"))?,
        ));
        let mut spare = None::<Allocation>;
        let mut host_spare = None::<Allocation>;
        let mut two = match striped {
            Some(_) => Some(Message::new().with_tensor(Tensor::cuda(
                CudaBuffer::alloc(gpu.ordinal(), len).map_err(failed("allocating"))?,
            ))),
            None => None,
        };
        let mut two_spare = None::<Allocation>;
        let (mut pipe_t, mut raw_t, mut other_t) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..args.rounds {
            for i in 0..warmup * u32::from(round == 0) + iters {
                let keep = round > 0 || i >= warmup;
                let t = Instant::now();
                for (dst, src) in [(&b, &a), (&a, &b)] {
                    match &pinned {
                        // SAFETY: both buffers hold `len` bytes of their devices and are alive;
                        // the stream is synchronized below.
                        None => unsafe {
                            cuda::copy_async(
                                (dst.device_ptr(), dst.gpu()),
                                (src.device_ptr(), src.gpu()),
                                len,
                                &stream,
                            )
                        }
                        .map_err(failed("raw copy"))?,
                        Some(p) => staged_copy(gpu, dst, src, p, &stream)?,
                    }
                }
                stream.synchronize().map_err(failed("raw copy"))?;
                let raw = t.elapsed();
                if let Some(p) = raw2.as_mut() {
                    let took = p.round_trip()?;
                    if keep {
                        other_t.push(took);
                    }
                }
                if let Some(h) = host.take() {
                    let (took, back, sent) = round_trip(&tx, h, host_spare.take()).await?;
                    host = Some(back);
                    host_spare = Some(sent);
                    if keep {
                        other_t.push(took);
                    }
                }
                if let (Some((tx2, ..)), Some(m2)) = (striped.as_ref(), two.take()) {
                    let (took, back, sent) = round_trip(tx2, m2, two_spare.take()).await?;
                    two = Some(back);
                    two_spare = Some(sent);
                    if keep {
                        other_t.push(took);
                    }
                }
                let (took, back, sent) = round_trip(&tx, m, spare.take()).await?;
                m = back;
                spare = Some(sent);
                if keep {
                    raw_t.push(raw);
                    pipe_t.push(took);
                }
            }
        }
        rows.push(Row {
            size,
            pipe: median(pipe_t),
            raw: median(raw_t),
            other: (!other_t.is_empty()).then(|| median(other_t)),
        });
    }
    drop(raw2);
    drop(tx);
    if let Some(e) = echo_side {
        e.abort();
    }
    if let Some((tx2, e, _)) = striped.take() {
        drop(tx2);
        e.abort();
    }
    drop(child);
    Ok((info.channel_list(), rows))
}

/// Writes `m`, receives its echo into `spare` (or new buffers) and waits for its CUDA tensors:
/// the time, the echo, and the written message's buffers for the next receive.
async fn round_trip(
    tx: &Addr<Pipe>,
    m: Message,
    spare: Option<Allocation>,
) -> Result<(Duration, Message, Allocation), Failure> {
    let sent_devices: Vec<actorpipe::Device> = m.tensors.iter().map(|t| t.device()).collect();
    let t = Instant::now();
    let w = actix::spawn(tx.send(Write::new(m)));
    let home = tx
        .send(spare.map_or_else(Receive::new, Receive::reusing))
        .await?;
    home.result.map_err(failed("receiving the echo"))?;
    home.cuda.wait().map_err(failed("waiting for the echo"))?;
    let took = t.elapsed();
    // Every tensor came home to the device it left: a round trip that stayed on the echo's
    // GPU would measure one device's copies under a two-device label.
    for (back, went) in home.message.tensors.iter().zip(&sent_devices) {
        if back.device() != *went {
            return Err(Failure::Failed(format!(
                "an echoed tensor landed on {:?}, not on {went:?} where it was sent from",
                back.device()
            )));
        }
    }
    let sent = w
        .await
        .map_err(|e| Failure::Failed(format!("the write task: {e}")))??;
    sent.result.map_err(failed("writing"))?;
    Ok((took, home.message, Allocation::from(sent.message)))
}

/// A pipe to `listening` from another context of this process, and the task echoing on the
/// accepted end.
async fn local_pair(
    setup: &Setup,
    listening: &mut Listening,
) -> Result<(Addr<Pipe>, tokio::task::JoinHandle<()>), Failure> {
    let other = setup.builder().start();
    let tx = other.send(Connect::new(&listening.url)).await??;
    let rx = listening.accept().await?;
    Ok((tx, actix::spawn(echo(rx, setup.dst))))
}

/// The pipe's info, once it shows the backend carrying cuda->cuda.
async fn negotiated(tx: &Addr<Pipe>, setup: &Setup) -> Result<actorpipe::PipeInfo, Failure> {
    let info = tx.send(GetInfo).await?;
    let want = format!("{} (cuda->cuda)", setup.backend);
    if !info.channels.iter().any(|c| c.to_string() == want) {
        return Err(Failure::Failed(format!(
            "{want} was not negotiated: {}",
            info.channel_list()
        )));
    }
    Ok(info)
}

/// A listening context of this process.
struct Listening {
    _ctx: Addr<Context>,
    _listener: Addr<actorpipe::Listener>,
    accepted: tokio::sync::mpsc::UnboundedReceiver<actorpipe::Accepted>,
    url: String,
}

async fn listen(setup: &Setup) -> Result<Listening, Failure> {
    let ctx = setup.builder().start();
    let (r, accepted) = actorpipe::inbox::<actorpipe::Accepted>();
    let l = ctx.send(Listen::new([setup.listen_url()], r)).await??;
    Ok(Listening {
        _ctx: ctx,
        _listener: l.listener,
        accepted,
        url: l.urls[0].clone(),
    })
}

impl Listening {
    async fn accept(&mut self) -> Result<Addr<Pipe>, Failure> {
        match tokio::time::timeout(Duration::from_secs(30), self.accepted.recv()).await {
            Ok(Some(a)) => Ok(a.pipe),
            _ => Err(Failure::Failed(
                "the echoing side did not connect within 30 s".into(),
            )),
        }
    }
}

/// Kills and reaps the child however the run ends.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The driver's copies of one staged transfer: `src` device-to-host into `pinned`, then
/// host-to-device into `dst`, queued on `stream`.
fn staged_copy(
    gpu: &Arc<cuda::Gpu>,
    dst: &CudaBuffer,
    src: &CudaBuffer,
    pinned: &cuda::PinnedBuf,
    stream: &cuda::StreamLease,
) -> Result<(), Failure> {
    use actorpipe::cuda::sys;
    let len = src.len();
    gpu.bind().map_err(failed("binding the GPU"))?;
    let check = |call: &str, r: sys::CUresult| match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(Failure::Failed(format!("raw copy: {call}: {e:?}"))),
    };
    // SAFETY: `src` and `dst` hold `len` bytes of this device, `pinned` at least `len` host
    // bytes, all alive until the caller synchronizes the stream.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            pinned.as_ptr().cast(),
            src.device_ptr(),
            len,
            stream.cu_stream(),
        )
    })?;
    // SAFETY: as above; the host-to-device copy follows on the same stream.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst.device_ptr(),
            pinned.as_ptr().cast(),
            len,
            stream.cu_stream(),
        )
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}
