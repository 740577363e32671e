//! `bench channel --backend cuda_xth|cuda_ipc|cuda_basic` (feature `cuda`): one CUDA tensor of
//! each size echoed through a pipe, next to the driver's own copy of the same path (device to
//! device on GPU 0, there and back, on one stream) in the same run, rounds alternating.
//!
//! - `cuda_xth`: both pipes in this process (two contexts on one thread).
//! - `cuda_ipc`: the echoing side is this program again, started as a child process
//!   (`ACTORPIPE_BENCH_CUDA_ECHO` names the listener), so every tensor crosses processes.
//! - `cuda_basic`: both pipes in this process, whose contexts leave the other CUDA channels
//!   out; the raw baseline is then the driver's pinned device-to-host plus host-to-device copy
//!   each way (what one staged transfer does), not a device-to-device copy.
//!
//! Each round trip: write, `Receive` into the last round's buffers, the echo's stream ordered
//! after the copy with `wait_on` (no CPU wait), write back, `Receive`, blocking `wait`.

use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::cuda::{self, CudaBuffer};
use actorpipe::{
    Allocation, Connect, Context, GetInfo, Listen, Message, Pipe, Receive, Tensor, Write,
};

use crate::cli::RunArgs;
use crate::failure::{bad, Failure};
use crate::report::Provenance;
use crate::units::human_size;

/// The variable that makes this program the echoing side of a `cuda_ipc` run.
const ECHO: &str = "ACTORPIPE_BENCH_CUDA_ECHO";

/// In the child of a `cuda_ipc` run: echoes until the pipe closes, then exits.
pub fn echo_child() {
    let Ok(url) = std::env::var(ECHO) else {
        return;
    };
    let result = actix::System::new().block_on(async move {
        let ctx = Context::builder().start();
        let pipe = ctx.send(Connect::new(&url)).await??;
        echo(pipe).await;
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

/// Sends every message back, its CUDA tensors ordered after their copies on the GPU, receiving
/// into the buffers of the last echo; returns when the pipe closes.
async fn echo(pipe: Addr<Pipe>) {
    let mut spare = None::<Allocation>;
    loop {
        let Ok(got) = pipe
            .send(spare.take().map_or_else(Receive::new, Receive::reusing))
            .await
        else {
            return;
        };
        if got.result.is_err() {
            return;
        }
        for t in &got.message.tensors {
            if let Some(c) = t.buffer.as_cuda() {
                if got.cuda.wait_on(c.stream()).is_err() {
                    return;
                }
            }
        }
        match pipe.send(Write::new(got.message)).await {
            Ok(w) if w.result.is_ok() => spare = Some(Allocation::from(w.message)),
            _ => return,
        }
    }
}

fn failed<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> Failure + '_ {
    move |e| Failure::Failed(format!("{what}: {e}"))
}

/// Measures and prints the table.
pub fn run(args: &RunArgs) -> Result<(), Failure> {
    let backend = args.backend.as_deref().unwrap_or_default();
    if !matches!(backend, "cuda_xth" | "cuda_ipc" | "cuda_basic") {
        return Err(bad(format!(
            "unknown CUDA channel {backend:?}: use cuda_xth, cuda_ipc or cuda_basic"
        )));
    }
    if args.json || args.listen.is_some() || args.transport.is_some() {
        return Err(bad(
            "the cuda_* channels take --sizes, --iters, --warmup and --rounds only",
        ));
    }
    cuda::available().map_err(|why| Failure::Failed(format!("no CUDA GPU here: {why}")))?;
    let gpu = cuda::gpu(0).map_err(failed("GPU 0"))?;
    let name = cuda::devices()
        .ok()
        .and_then(|d| d.into_iter().next())
        .map_or_else(|| "GPU 0".to_string(), |d| d.name);
    let rows = actix::System::new().block_on(measure(backend, args, &gpu))?;
    let p = Provenance::here();
    let mut out = format!(
        "actorpipe bench channel {backend}: 1 CUDA tensor of each size on GPU 0, echoed{}\n",
        if backend == "cuda_ipc" {
            " by another process"
        } else {
            " by another context of this process"
        }
    );
    let raw = if backend == "cuda_basic" {
        "cuMemcpyDtoHAsync into pinned memory + cuMemcpyHtoDAsync back, each way, on one stream + synchronize (the driver's copies of the same path)"
    } else {
        "cuMemcpyDtoDAsync there and back on one stream + synchronize (the driver's copy of the same path)"
    };
    out += &format!(
        "  machine:  {}\n  gpu:      {name}\n  date:     {}\n  command:  {}\n",
        p.machine, p.date, p.command
    );
    out += &format!("  negotiated: {}\n", rows.0);
    out += &format!("  raw: {raw}\n\n");
    out += "| size | pipe p50 | pipe GB/s | raw p50 | raw GB/s | pipe / raw |\n";
    out += "| --- | --- | --- | --- | --- | --- |\n";
    for (size, pipe, raw) in rows.1 {
        let gbps = |d: Duration| 2.0 * size as f64 / d.as_secs_f64() / 1e9;
        out += &format!(
            "| {} | {:.1} us | {:.2} | {:.1} us | {:.2} | {:.0} % |\n",
            human_size(size),
            pipe.as_secs_f64() * 1e6,
            gbps(pipe),
            raw.as_secs_f64() * 1e6,
            gbps(raw),
            100.0 * raw.as_secs_f64() / pipe.as_secs_f64()
        );
    }
    crate::report::emit(&out)
}

type Rows = (String, Vec<(u64, Duration, Duration)>);

async fn measure(
    backend: &str,
    args: &RunArgs,
    gpu: &std::sync::Arc<cuda::Gpu>,
) -> Result<Rows, Failure> {
    let mut listening = listen(backend).await?;
    let mut child = None;
    let (tx, echo_side) = if backend == "cuda_ipc" {
        let c = std::process::Command::new(std::env::current_exe()?)
            .env(ECHO, &listening.url)
            .stdout(std::process::Stdio::null())
            .spawn()?;
        child = Some(Kill(c));
        (listening.accept().await?, None)
    } else {
        let other = builder(backend).start();
        let tx = other.send(Connect::new(&listening.url)).await??;
        let rx = listening.accept().await?;
        (tx, Some(actix::spawn(echo(rx))))
    };
    let info = tx.send(GetInfo).await?;
    let want = format!("{backend} (cuda->cuda)");
    if !info.channels.iter().any(|c| c.to_string() == want) {
        return Err(Failure::Failed(format!(
            "{want} was not negotiated: {}",
            info.channel_list()
        )));
    }
    let stream = gpu.lease_stream().map_err(failed("a stream"))?;
    let mut rows = Vec::new();
    for &size in &args.sizes.0 {
        let len = size as usize;
        let iters = args
            .iters
            .unwrap_or_else(|| ((256u64 << 20) / size.max(1)).clamp(20, 10_000) as u32);
        let warmup = args.warmup.unwrap_or((iters / 10).max(2));
        let a = CudaBuffer::alloc(0, len).map_err(failed("allocating"))?;
        let b = CudaBuffer::alloc(0, len).map_err(failed("allocating"))?;
        let pinned = match backend {
            "cuda_basic" => Some(
                cuda::PinnedPool::new(len, 0)
                    .take()
                    .map_err(failed("pinned memory"))?,
            ),
            _ => None,
        };
        let mut m = Message::new().with_tensor(Tensor::cuda(
            CudaBuffer::alloc(0, len).map_err(failed("allocating"))?,
        ));
        let mut spare = None::<Allocation>;
        let (mut pipe_t, mut raw_t) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            for i in 0..warmup * u32::from(round == 0) + iters {
                let t = Instant::now();
                for (dst, src) in [(&b, &a), (&a, &b)] {
                    match &pinned {
                        // SAFETY: both buffers hold `len` bytes of device 0 and are alive; the
                        // pinned buffer holds `len` bytes.
                        None => unsafe {
                            cuda::copy_async(
                                (dst.device_ptr(), gpu),
                                (src.device_ptr(), gpu),
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
                let t = Instant::now();
                let w = actix::spawn(tx.send(Write::new(m)));
                let home = tx
                    .send(spare.take().map_or_else(Receive::new, Receive::reusing))
                    .await?;
                home.result.map_err(failed("receiving the echo"))?;
                home.cuda.wait().map_err(failed("waiting for the echo"))?;
                let took = t.elapsed();
                let sent = w
                    .await
                    .map_err(|e| Failure::Failed(format!("the write task: {e}")))??;
                sent.result.map_err(failed("writing"))?;
                spare = Some(Allocation::from(sent.message));
                m = home.message;
                if round > 0 || i >= warmup {
                    raw_t.push(raw);
                    pipe_t.push(took);
                }
            }
        }
        rows.push((size, median(pipe_t), median(raw_t)));
    }
    drop(tx);
    if let Some(e) = echo_side {
        e.abort();
    }
    drop(child);
    Ok((info.channel_list(), rows))
}

/// A listening context of this process.
struct Listening {
    _ctx: Addr<Context>,
    _listener: Addr<actorpipe::Listener>,
    accepted: tokio::sync::mpsc::UnboundedReceiver<actorpipe::Accepted>,
    url: String,
}

/// A context offering `backend` and no other CUDA channel that would win over it.
fn builder(backend: &str) -> actorpipe::ContextBuilder {
    match backend {
        "cuda_basic" => Context::builder().without("cuda_xth").without("cuda_ipc"),
        _ => Context::builder(),
    }
}

async fn listen(backend: &str) -> Result<Listening, Failure> {
    let ctx = builder(backend).start();
    let (r, accepted) = actorpipe::inbox::<actorpipe::Accepted>();
    let l = ctx.send(Listen::new(["tcp://127.0.0.1:0"], r)).await??;
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
    gpu: &std::sync::Arc<cuda::Gpu>,
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
