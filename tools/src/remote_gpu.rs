//! `actorpipe bench remote --backend cuda_xth|cuda_ipc` (feature `cuda`): one-sided reads and
//! writes of a region of device memory (GPU 0) into and out of a local device buffer (GPU 0),
//! next to the raw copy in the same run.
//!
//! - `cuda_xth`: owner and initiator are two contexts of this process; raw: the same spans
//!   copied with `cuMemcpyAsync` between two plain allocations, then the stream waited for.
//! - `cuda_ipc`: the owner is a second process (this binary again, `ACTORPIPE_REMOTE_OWNER` set);
//!   the initiator maps the owner's allocation (its lease over the remote lane) and copies on
//!   its own stream. Raw: the driver's copies through a mapping of the same allocation opened
//!   in this process (`cuIpcOpenMemHandle`), on one stream, then the stream waited for: what
//!   the path does, with no actorpipe code around it. The raw mapping is closed before the
//!   path's own is made (a handle opens once per process).
//!
//! A row's time is the median of `--iters` operations after a warm-up, each awaited: for ours,
//! from the message to the completion (the bytes in place), for raw, from the first copy to the
//! stream's end.

use std::time::Instant;

use actorpipe::cuda::{self, sys, CudaBuffer};
use actorpipe::internal::backend::cuda_ipc::ipc;
use actorpipe::prelude::*;
use actorpipe::remote::{RegionDescriptor, RemoteRead, RemoteWrite};
use actorpipe::{Connect, Message, Pipe, Receive, Write};

use crate::cli::RemoteArgs;
use crate::failure::Failure;
use crate::measure::pattern;
use crate::remote::{spans, Row, WARMUP};

/// The variable that makes this binary the owner of `bench remote --backend cuda_ipc`.
const OWNER: &str = "ACTORPIPE_REMOTE_OWNER";

fn failed(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::Failed(format!("{what}: {e}"))
}

/// The owner's side of `cuda_ipc` (returns at once unless `ACTORPIPE_REMOTE_OWNER` is set; never
/// returns otherwise): connects to the URL it names, and for each request (`alloc LEN SEED`)
/// registers `LEN` bytes of device memory filled with `pattern(LEN, SEED)`, answering with the
/// region's descriptor and the allocation's export (for the raw path); `free` deregisters it.
pub fn owner_child() {
    let Ok(url) = std::env::var(OWNER) else {
        return;
    };
    let code = actix::System::new().block_on(async move {
        match serve(&url).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("remote owner: {e}");
                1
            }
        }
    });
    std::process::exit(code);
}

async fn serve(url: &str) -> Result<(), Failure> {
    let ctx = actorpipe::Context::builder().start();
    let pipe = ctx
        .send(Connect::new(url))
        .await
        .map_err(|e| failed("connect", e))?
        .map_err(|e| failed("connect", e))?;
    let mut region = None;
    loop {
        let got = pipe
            .send(Receive::new())
            .await
            .map_err(|e| failed("receive", e))?;
        if got.result.is_err() {
            // The initiator is done.
            return Ok(());
        }
        let ask = String::from_utf8_lossy(&got.message.metadata).to_string();
        let words: Vec<&str> = ask.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["alloc", len, seed] => {
                let (len, seed): (usize, u64) = (
                    len.parse().map_err(|e| failed("alloc", e))?,
                    seed.parse().map_err(|e| failed("alloc", e))?,
                );
                drop(region.take());
                let mut b = CudaBuffer::alloc(0, len).map_err(|e| failed("alloc", e))?;
                b.copy_from_host(&pattern(len, seed))
                    .map_err(|e| failed("fill", e))?;
                let export = ipc::export(b.gpu(), b.device_ptr())
                    .map_err(|e| failed("export", e))?
                    .map_err(|e| failed("export", e))?;
                let r = ctx
                    .register(Buffer::Cuda(b))
                    .await
                    .map_err(|e| failed("register", e))?;
                let mut m = r.descriptor().to_bytes();
                let at = m.len() as u32;
                m.extend_from_slice(&export.handle);
                m.extend_from_slice(&export.offset.to_le_bytes());
                m.extend_from_slice(&export.size.to_le_bytes());
                m.extend_from_slice(&at.to_le_bytes());
                region = Some(r);
                m
            }
            ["free"] => {
                if let Some(r) = region.take() {
                    r.deregister().await;
                }
                b"freed".to_vec()
            }
            _ => return Err(failed("the initiator asked", &ask)),
        };
        pipe.send(Write::new(Message::new().with_metadata(reply)))
            .await
            .map_err(|e| failed("reply", e))?
            .result
            .map_err(|e| failed("reply", e))?;
    }
}

/// The owner's region: its descriptor, and its allocation's export when another process owns it.
struct Owned {
    descriptor: RegionDescriptor,
    export: Option<([u8; ipc::HANDLE_LEN], u64, u64)>,
    /// The region, when this process owns it.
    region: Option<actorpipe::remote::Region>,
}

/// Who owns the regions: a context of this process, or the child at the end of `pipe`.
enum Owner {
    /// The owner's context, and its end of the pipe (held: the pipe closes without it).
    Here {
        ctx: actix::Addr<actorpipe::Context>,
        _peer: actix::Addr<Pipe>,
    },
    Child {
        pipe: actix::Addr<Pipe>,
        _child: KillOnDrop,
    },
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Owner {
    async fn alloc(&self, len: usize, seed: u64) -> Result<Owned, Failure> {
        match self {
            Owner::Here { ctx, .. } => {
                let mut b = CudaBuffer::alloc(0, len).map_err(|e| failed("alloc", e))?;
                b.copy_from_host(&pattern(len, seed))
                    .map_err(|e| failed("fill", e))?;
                let r = ctx
                    .register(Buffer::Cuda(b))
                    .await
                    .map_err(|e| failed("register", e))?;
                Ok(Owned {
                    descriptor: r.descriptor().clone(),
                    export: None,
                    region: Some(r),
                })
            }
            Owner::Child { pipe, .. } => {
                let m = ask(pipe, format!("alloc {len} {seed}")).await?;
                let n = m.len();
                let at = u32::from_le_bytes(m[n - 4..].try_into().expect("4 bytes")) as usize;
                let descriptor =
                    RegionDescriptor::from_bytes(&m[..at]).map_err(|e| failed("descriptor", e))?;
                let h = &m[at..at + ipc::HANDLE_LEN];
                let word = |i: usize| {
                    let o = at + ipc::HANDLE_LEN + 8 * i;
                    u64::from_le_bytes(m[o..o + 8].try_into().expect("8 bytes"))
                };
                Ok(Owned {
                    descriptor,
                    export: Some((h.try_into().expect("a handle"), word(0), word(1))),
                    region: None,
                })
            }
        }
    }

    async fn free(&self, owned: Owned) -> Result<(), Failure> {
        if let Some(r) = owned.region {
            r.deregister().await;
        }
        if let Owner::Child { pipe, .. } = self {
            ask(pipe, "free".into()).await?;
        }
        Ok(())
    }
}

async fn ask(pipe: &actix::Addr<Pipe>, what: String) -> Result<Vec<u8>, Failure> {
    pipe.send(Write::new(Message::new().with_metadata(what.into_bytes())))
        .await
        .map_err(|e| failed("ask", e))?
        .result
        .map_err(|e| failed("ask", e))?;
    let got = pipe
        .send(Receive::new())
        .await
        .map_err(|e| failed("answer", e))?;
    got.result.map_err(|e| failed("answer", e))?;
    Ok(got.message.metadata)
}

pub fn raw_path(backend: &str) -> &'static str {
    if backend == "cuda_ipc" {
        "cuMemcpyAsync of the same spans through a mapping of the owner's allocation opened in \
         this process, then the stream waited for"
    } else {
        "cuMemcpyAsync of the same spans between two allocations, then the stream waited for"
    }
}

pub async fn measure(args: &RemoteArgs) -> Result<Vec<Row>, Failure> {
    cuda::available().map_err(|e| failed("CUDA", e))?;
    let ipc_path = args.backend == "cuda_ipc";
    let arbiter = actix::Arbiter::new();
    let initiator = actorpipe::Context::builder().start();
    let (pipe, owner) = if ipc_path {
        let (to, mut accepted) = inbox::<Accepted>();
        let l = initiator
            .listen(["tcp://127.0.0.1:0"], to)
            .await
            .map_err(|e| failed("listen", e))?;
        let child = std::process::Command::new(
            std::env::current_exe().map_err(|e| failed("this binary", e))?,
        )
        .env(OWNER, l.urls[0].as_str())
        .spawn()
        .map_err(|e| failed("the owner", e))?;
        let pipe = accepted
            .recv()
            .await
            .ok_or_else(|| failed("the owner", "never connected"))?
            .pipe;
        (
            pipe.clone(),
            Owner::Child {
                pipe,
                _child: KillOnDrop(child),
            },
        )
    } else {
        let owner = actorpipe::Context::builder().start_in(&arbiter.handle());
        let (to, mut accepted) = inbox::<Accepted>();
        let l = owner
            .listen(["tcp://127.0.0.1:0"], to)
            .await
            .map_err(|e| failed("listen", e))?;
        let pipe = initiator
            .connect(l.urls[0].as_str())
            .await
            .map_err(|e| failed("connect", e))?;
        // The owner's end of the pipe: kept, or the pipe closes when it is dropped.
        let peer = accepted
            .recv()
            .await
            .ok_or_else(|| failed("the owner", "accepted no pipe"))?
            .pipe;
        (
            pipe,
            Owner::Here {
                ctx: owner,
                _peer: peer,
            },
        )
    };
    let gpu = cuda::gpu(0).map_err(|e| failed("GPU 0", e))?;
    let stream = gpu.alloc_stream().map_err(|e| failed("stream", e))?;
    let mut rows = Vec::new();
    for &size in &args.sizes.0 {
        for &batch in &args.batch {
            let piece = size / batch as u64;
            if piece == 0 {
                continue;
            }
            let stride = 2 * piece;
            let region_len = stride * batch as u64;
            let owned = owner.alloc(region_len as usize, size).await?;
            let d = owned.descriptor.clone();
            let batch_spans = spans(size, batch, stride);
            let mut local = Some(Buffer::Cuda(
                CudaBuffer::alloc(0, size as usize).map_err(|e| failed("alloc", e))?,
            ));
            for op in ["read", "write"] {
                // The raw copies first: their mapping is closed before the path makes its own.
                let raw = {
                    let (mut mapping, mut plain) = (None, None);
                    let far = match owned.export {
                        Some((handle, offset, alloc)) => {
                            let o = ipc::open(&gpu, &handle, alloc)
                                .map_err(|e| failed("cuIpcOpenMemHandle", e))?;
                            let at = o.base() + offset;
                            mapping = Some(o);
                            at
                        }
                        None => {
                            let b = CudaBuffer::alloc(0, region_len as usize)
                                .map_err(|e| failed("alloc", e))?;
                            let at = b.device_ptr();
                            plain = Some(b);
                            at
                        }
                    };
                    let near = local
                        .as_ref()
                        .and_then(Buffer::as_cuda)
                        .map(CudaBuffer::device_ptr)
                        .unwrap_or(0);
                    let mut raw = Vec::new();
                    for i in 0..args.iters + WARMUP {
                        let t = Instant::now();
                        for s in &batch_spans {
                            let (r, l) = (far + s.remote, near + s.local);
                            let (dst, src) = if op == "read" { (l, r) } else { (r, l) };
                            gpu.bind().map_err(|e| failed("bind", e))?;
                            // SAFETY: both ranges lie inside live allocations (the mapping or
                            // our buffer, held across the loop); the stream is waited for below.
                            let rc = unsafe {
                                sys::cuMemcpyAsync(dst, src, s.len as usize, stream.cu_stream())
                            };
                            if rc != sys::CUresult::CUDA_SUCCESS {
                                return Err(failed("cuMemcpyAsync", format!("{rc:?}")));
                            }
                        }
                        stream
                            .synchronize()
                            .map_err(|e| failed("cuStreamSynchronize", e))?;
                        if i >= WARMUP {
                            raw.push(t.elapsed());
                        }
                    }
                    drop((mapping, plain));
                    raw
                };
                let mut ours = Vec::new();
                let mut path = "";
                for i in 0..args.iters + WARMUP {
                    let b = local.take().expect("the local buffer");
                    let t = Instant::now();
                    let done = if op == "read" {
                        pipe.remote_read(RemoteRead::new(&d, batch_spans.clone(), b))
                            .await
                    } else {
                        pipe.remote_write(RemoteWrite::new(&d, batch_spans.clone(), b))
                            .await
                    }
                    .map_err(|e| failed(&format!("remote {op}"), e))?;
                    if i >= WARMUP {
                        ours.push(t.elapsed());
                    }
                    path = done.path;
                    local = Some(done.buffer);
                }
                if op == "read" {
                    // The last read's bytes: each span's piece of the region's pattern.
                    let got = match &local {
                        Some(Buffer::Cuda(c)) => c.to_vec().map_err(|e| failed("check", e))?,
                        _ => Vec::new(),
                    };
                    let want = pattern(region_len as usize, size);
                    let s = batch_spans[batch as usize - 1];
                    let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
                    if got.get(l..l + n) != Some(&want[r..r + n]) {
                        return Err(failed("remote read", "wrong bytes"));
                    }
                }
                rows.push(Row::of(op, size, batch, path, ours, raw));
            }
            owner.free(owned).await?;
        }
    }
    arbiter.stop();
    Ok(rows)
}
