//! `actorpipe bench remote`: one-sided reads and writes of a registered region
//! (`actorpipe::remote`), next to the raw path in the same run.
//!
//! The owner and the initiator are two contexts of this process, on two threads (arbiters),
//! whose pipe negotiates only what the path needs (`--backend`):
//! - `xth`: the initiator copies; raw: the same spans copied between two plain buffers with
//!   `copy_large` (what the path uses, shared among the copy threads from 256 KiB);
//! - `cma`: the owner copies with `process_vm_writev` / `process_vm_readv` (towards this
//!   process's own pid: the kernel's path is the one it takes towards another process); raw:
//!   the same call on the same spans, with no actorpipe code around it;
//! - `tcp`, `shm`: the bytes travel on the pipe's remote lane; raw: the same bytes sent
//!   two-sided over a `basic` pipe of that transport between the same contexts (a `Write` on
//!   one side, `ReadDescriptor` and `Read` into a reused buffer on the other, timed to the
//!   read's completion), from the owner for a read, from the initiator for a write.
//!
//! Each row is a batch of `--batch` spans that together move the row's size (a batch of 64
//! gathers 64 pieces of the region, spread over it, into one contiguous buffer, as a KV-cache
//! read does); each cell is the median of `--iters` operations after a warm-up, each awaited
//! before the next.

use std::time::{Duration, Instant};

use actorpipe::prelude::*;
use actorpipe::remote::{RemoteRead, RemoteWrite, Span};
use actorpipe::{Allocation, Message, Pipe, Read, ReadDescriptor, Tensor, Write};

use crate::cli::RemoteArgs;
use crate::failure::{bad, Failure};
use crate::measure::pattern;
use crate::report::{emit, Provenance};
use crate::units::{gb_per_s, human_size};

/// Untimed operations before the timed ones.
pub(crate) const WARMUP: u32 = 3;

pub(crate) struct Row {
    pub op: &'static str,
    pub size: u64,
    pub batch: u32,
    pub path: &'static str,
    pub ours: Duration,
    pub raw: Duration,
}

impl Row {
    /// A row of the medians of `ours` and `raw`.
    pub(crate) fn of(
        op: &'static str,
        size: u64,
        batch: u32,
        path: &'static str,
        ours: Vec<Duration>,
        raw: Vec<Duration>,
    ) -> Row {
        let p50 = |mut v: Vec<Duration>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        Row {
            op,
            size,
            batch,
            path,
            ours: p50(ours),
            raw: p50(raw),
        }
    }
}

/// What `--backend` names: the path, the pipe's transport, its channels, and the raw path.
fn path_of(name: &str) -> Result<(&'static str, &'static [&'static str], &'static str), Failure> {
    Ok(match name {
        "xth" => (
            "tcp",
            &["xth", "basic"],
            "the same spans copied with copy_large",
        ),
        "cma" => (
            "tcp",
            &["cma", "basic"],
            "process_vm_writev / process_vm_readv of the same spans towards this process",
        ),
        "tcp" => (
            "tcp",
            &["basic"],
            "the same bytes two-sided over a basic pipe on tcp",
        ),
        "shm" => (
            "shm",
            &["basic"],
            "the same bytes two-sided over a basic pipe on shm",
        ),
        #[cfg(feature = "cuda")]
        "cuda_xth" | "cuda_ipc" => ("tcp", &[], crate::remote_gpu::raw_path(name)),
        other => {
            return Err(bad(format!(
                "bench remote --backend {other}: one of xth, cma, tcp, shm{}",
                if cfg!(feature = "cuda") {
                    ", cuda_xth, cuda_ipc"
                } else {
                    " (cuda_xth and cuda_ipc need feature `cuda`)"
                }
            )))
        }
    })
}

pub fn run(args: &RemoteArgs) -> Result<(), Failure> {
    let (_, _, raw_path) = path_of(&args.backend)?;
    let here = Provenance::here();
    #[cfg(feature = "cuda")]
    let rows = if args.backend.starts_with("cuda_") {
        actix::System::new().block_on(crate::remote_gpu::measure(args))?
    } else {
        actix::System::new().block_on(measure(args))?
    };
    #[cfg(not(feature = "cuda"))]
    let rows = actix::System::new().block_on(measure(args))?;
    let mut t = String::new();
    t += "actorpipe bench remote: one-sided reads and writes of a registered region, next to the raw copy\n";
    t += &format!("  machine:  {}\n", here.machine);
    t += &format!("  date:     {}\n", here.date);
    t += &format!("  command:  {}\n", here.command);
    t += &format!(
        "  path {}: owner and initiator are {}; raw: {raw_path}; median of {} operations after \
         {WARMUP}\n\n",
        args.backend,
        if args.backend == "cuda_ipc" {
            "two processes, the region on GPU 0, the local buffer on GPU 0"
        } else if args.backend == "cuda_xth" {
            "two contexts of this process, the region and the local buffer on GPU 0"
        } else {
            "two contexts of this process"
        },
        args.iters
    );
    t += "| op | size | spans | path | p50 | GB/s | raw p50 | raw GB/s | time / raw |\n";
    t += "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n";
    for r in &rows {
        t += &format!(
            "| {} | {} | {} | {} | {:.1} µs | {:.2} | {:.1} µs | {:.2} | {:.2}x |\n",
            r.op,
            human_size(r.size),
            r.batch,
            r.path,
            r.ours.as_secs_f64() * 1e6,
            gb_per_s(r.size, r.ours),
            r.raw.as_secs_f64() * 1e6,
            gb_per_s(r.size, r.raw),
            r.ours.as_secs_f64() / r.raw.as_secs_f64().max(1e-12),
        );
    }
    emit(&t)
}

/// `batch` spans moving `size` bytes in all: piece `i` from slot `i` of the region (spread
/// over it, `stride` apart) to offset `i * piece` of the local buffer.
pub(crate) fn spans(size: u64, batch: u32, stride: u64) -> Vec<Span> {
    let piece = size / batch as u64;
    (0..batch as u64)
        .map(|i| Span::new(i * stride, i * piece, piece))
        .collect()
}

async fn measure(args: &RemoteArgs) -> Result<Vec<Row>, Failure> {
    let (transport, channels, _) = path_of(&args.backend)?;
    let builder = || {
        actorpipe::Context::builder()
            .only_transports(&[transport])
            .only_channels(channels)
    };
    // The owner's context on an arbiter of its own: the initiator's copies run on its pipe's
    // thread, the owner's on another, as between two workers.
    let arbiter = actix::Arbiter::new();
    let owner = builder().start_in(&arbiter.handle());
    let initiator = builder().start();
    let (to, mut accepted) = inbox::<Accepted>();
    let url = if transport == "shm" {
        "shm://"
    } else {
        "tcp://127.0.0.1:0"
    };
    let l = owner
        .listen([url], to)
        .await
        .map_err(|e| Failure::Failed(format!("listen: {e}")))?;
    let pipe = initiator
        .connect(l.urls[0].as_str())
        .await
        .map_err(|e| Failure::Failed(format!("connect: {e}")))?;
    let peer = accepted
        .recv()
        .await
        .ok_or_else(|| Failure::Failed("no pipe accepted".into()))?
        .pipe;
    let mut rows = Vec::new();
    for &size in &args.sizes.0 {
        for &batch in &args.batch {
            let piece = size / batch as u64;
            if piece == 0 {
                continue;
            }
            // The region holds the batch's pieces spread out: 2 x the size.
            let stride = 2 * piece;
            let region_len = stride * batch as u64;
            let region = owner
                .register(Buffer::Cpu(pattern(region_len as usize, size)))
                .await
                .map_err(|e| Failure::Failed(format!("register: {e}")))?;
            let d = region.descriptor().clone();
            let batch_spans = spans(size, batch, stride);
            for op in ["read", "write"] {
                let mut local = Buffer::Cpu(pattern(size as usize, size + 1));
                let mut ours = Vec::new();
                let mut path = "";
                for i in 0..args.iters + WARMUP {
                    let t = Instant::now();
                    let done = if op == "read" {
                        pipe.remote_read(RemoteRead::new(&d, batch_spans.clone(), local))
                            .await
                    } else {
                        pipe.remote_write(RemoteWrite::new(&d, batch_spans.clone(), local))
                            .await
                    }
                    .map_err(|e| Failure::Failed(format!("remote {op}: {e}")))?;
                    if i >= WARMUP {
                        ours.push(t.elapsed());
                    }
                    path = done.path;
                    local = done.buffer;
                }
                let raw = match args.backend.as_str() {
                    // On a blocking thread, so that this thread's pipes keep beating.
                    "xth" | "cma" => {
                        let (spans, iters, cma) =
                            (batch_spans.clone(), args.iters, args.backend == "cma");
                        let raw = tokio::task::spawn_blocking(move || {
                            if cma {
                                raw_cma(op, &spans, region_len, size, iters)
                            } else {
                                Ok(raw_copies(op, &spans, region_len, size, iters))
                            }
                        });
                        raw.await
                            .map_err(|e| Failure::Failed(format!("raw path: {e}")))??
                    }
                    _ => {
                        let (from, to) = if op == "read" {
                            (&peer, &pipe)
                        } else {
                            (&pipe, &peer)
                        };
                        raw_two_sided(from, to, size, args.iters).await?
                    }
                };
                rows.push(Row::of(op, size, batch, path, ours, raw));
            }
            // The last write's bytes are in the region: check one span.
            let s = batch_spans[batch as usize - 1];
            let mut got = vec![0u8; s.len as usize];
            region
                .read_at(s.remote, &mut got)
                .map_err(|e| Failure::Failed(e.to_string()))?;
            let want = pattern(size as usize, size + 1);
            if got[..] != want[s.local as usize..(s.local + s.len) as usize] {
                return Err(Failure::Failed(format!(
                    "remote write of {} left wrong bytes",
                    human_size(size)
                )));
            }
            drop(region);
        }
    }
    arbiter.stop();
    Ok(rows)
}

/// The `xth` path's raw copy: the same spans between two plain buffers.
fn raw_copies(op: &str, spans: &[Span], region_len: u64, size: u64, iters: u32) -> Vec<Duration> {
    let mut far = pattern(region_len as usize, size);
    let mut near = pattern(size as usize, size + 1);
    let mut raw = Vec::new();
    for i in 0..iters + WARMUP {
        let t = Instant::now();
        for s in spans {
            let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
            if op == "read" {
                actorpipe::internal::copy::copy_large(&mut near[l..l + n], &far[r..r + n]);
            } else {
                actorpipe::internal::copy::copy_large(&mut far[r..r + n], &near[l..l + n]);
            }
        }
        if i >= WARMUP {
            raw.push(t.elapsed());
        }
    }
    std::hint::black_box((&far, &near));
    raw
}

/// The `cma` path's raw call: `process_vm_writev` (a read: the region's spans out to the
/// initiator's buffer) or `process_vm_readv` (a write), one call for the batch, towards this
/// process.
fn raw_cma(
    op: &str,
    spans: &[Span],
    region_len: u64,
    size: u64,
    iters: u32,
) -> Result<Vec<Duration>, Failure> {
    let mut far = pattern(region_len as usize, size);
    let mut near = pattern(size as usize, size + 1);
    let pid = std::process::id() as libc::pid_t;
    let mut raw = Vec::new();
    for i in 0..iters + WARMUP {
        let t = Instant::now();
        let ours: Vec<libc::iovec> = spans
            .iter()
            .map(|s| libc::iovec {
                iov_base: far[s.remote as usize..].as_mut_ptr().cast(),
                iov_len: s.len as usize,
            })
            .collect();
        let theirs: Vec<libc::iovec> = spans
            .iter()
            .map(|s| libc::iovec {
                iov_base: near[s.local as usize..].as_mut_ptr().cast(),
                iov_len: s.len as usize,
            })
            .collect();
        // SAFETY: every iovec names bytes inside `far` or `near`, which live across the call;
        // the kernel copies between them (both in this process).
        let n = unsafe {
            if op == "read" {
                libc::process_vm_writev(
                    pid,
                    ours.as_ptr(),
                    ours.len() as _,
                    theirs.as_ptr(),
                    theirs.len() as _,
                    0,
                )
            } else {
                libc::process_vm_readv(
                    pid,
                    ours.as_ptr(),
                    ours.len() as _,
                    theirs.as_ptr(),
                    theirs.len() as _,
                    0,
                )
            }
        };
        if n as u64 != size {
            return Err(Failure::Failed(format!(
                "raw cma call moved {n} of {size} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        if i >= WARMUP {
            raw.push(t.elapsed());
        }
    }
    std::hint::black_box((&far, &near));
    Ok(raw)
}

/// The lane paths' raw path: `size` bytes sent two-sided from `from` to `to` (a `Write`, then
/// `ReadDescriptor` and `Read` into a reused buffer), timed to the read's completion.
async fn raw_two_sided(
    from: &actix::Addr<Pipe>,
    to: &actix::Addr<Pipe>,
    size: u64,
    iters: u32,
) -> Result<Vec<Duration>, Failure> {
    let fail = |e: &dyn std::fmt::Display| Failure::Failed(format!("two-sided {size} bytes: {e}"));
    let mut data = Some(pattern(size as usize, size + 2));
    let mut spare: Option<Allocation> = None;
    let mut raw = Vec::new();
    for i in 0..iters + WARMUP {
        let t = Instant::now();
        let message = Message::new().with_tensor(Tensor::cpu(data.take().expect("the buffer")));
        let write = from.send(Write::new(message));
        let descriptor = to
            .send(ReadDescriptor)
            .await
            .map_err(|e| fail(&e))?
            .descriptor
            .map_err(|e| fail(&e))?;
        let allocation = match spare.take() {
            Some(a) if a.check(&descriptor).is_ok() => a,
            _ => Allocation::for_descriptor(&descriptor).map_err(|e| fail(&e))?,
        };
        let read = to.send(Read::new(allocation)).await.map_err(|e| fail(&e))?;
        read.result.map_err(|e| fail(&e))?;
        if i >= WARMUP {
            raw.push(t.elapsed());
        }
        spare = Some(Allocation::from(read.message));
        let written = write.await.map_err(|e| fail(&e))?;
        written.result.map_err(|e| fail(&e))?;
        let mut back = written.message;
        data = Some(match back.tensors.pop().map(|t| t.buffer) {
            Some(Buffer::Cpu(v)) => v,
            _ => pattern(size as usize, size + 2),
        });
    }
    Ok(raw)
}
