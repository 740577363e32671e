//! `actorpipe bench remote`: one-sided reads and writes of a registered region
//! (`actorpipe::remote`), next to the raw path in the same run.
//!
//! The path built so far is the in-process one (`xth`: the owner and the initiator are two
//! contexts of this process, on two threads), whose raw path is the copy itself: the same
//! spans copied between the same two buffers with `copy_large` (what the path uses, shared
//! among the copy threads from 256 KiB), with no actorpipe code around it. Each row is a batch
//! of `--batch` spans that together move the row's size (a batch of 64 gathers 64 pieces of the
//! region, spread over it, into one contiguous buffer, as a KV-cache read does); each cell is
//! the median of `--iters` operations after a warm-up, each awaited before the next.

use std::time::{Duration, Instant};

use actorpipe::prelude::*;
use actorpipe::remote::{RemoteRead, RemoteWrite, Span};

use crate::cli::RemoteArgs;
use crate::failure::{bad, Failure};
use crate::measure::pattern;
use crate::report::{emit, Provenance};
use crate::units::{gb_per_s, human_size};

/// Untimed operations before the timed ones.
const WARMUP: u32 = 3;

struct Row {
    op: &'static str,
    size: u64,
    batch: u32,
    path: &'static str,
    ours: Duration,
    raw: Duration,
}

pub fn run(args: &RemoteArgs) -> Result<(), Failure> {
    if args.backend != "xth" {
        return Err(bad(format!(
            "bench remote --backend {}: only xth (both sides in this process) is built",
            args.backend
        )));
    }
    let here = Provenance::here();
    let rows = actix::System::new().block_on(measure(args))?;
    let mut t = String::new();
    t += "actorpipe bench remote: one-sided reads and writes of a registered region, next to the raw copy\n";
    t += &format!("  machine:  {}\n", here.machine);
    t += &format!("  date:     {}\n", here.date);
    t += &format!("  command:  {}\n", here.command);
    t += &format!(
        "  path xth: owner and initiator are two contexts of this process; raw: the same spans \
         copied with copy_large; median of {} operations after {WARMUP}\n\n",
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
fn spans(size: u64, batch: u32, stride: u64) -> Vec<Span> {
    let piece = size / batch as u64;
    (0..batch as u64)
        .map(|i| Span::new(i * stride, i * piece, piece))
        .collect()
}

async fn measure(args: &RemoteArgs) -> Result<Vec<Row>, Failure> {
    let builder = || {
        actorpipe::Context::builder()
            .only_transports(&["tcp"])
            .only_channels(&["xth", "basic"])
    };
    // The owner's context on an arbiter of its own: the initiator's copies run on its pipe's
    // thread, the owner's on another, as between two workers.
    let arbiter = actix::Arbiter::new();
    let owner = builder().start_in(&arbiter.handle());
    let initiator = builder().start();
    let (to, mut accepted) = inbox::<Accepted>();
    let l = owner
        .listen(["tcp://127.0.0.1:0"], to)
        .await
        .map_err(|e| Failure::Failed(format!("listen: {e}")))?;
    let pipe = initiator
        .connect(l.urls[0].as_str())
        .await
        .map_err(|e| Failure::Failed(format!("connect: {e}")))?;
    let _peer = accepted.recv().await;
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
                // The raw path: the same spans between two plain buffers.
                let mut far = pattern(region_len as usize, size);
                let mut near = pattern(size as usize, size + 1);
                let mut raw = Vec::new();
                for i in 0..args.iters + WARMUP {
                    let t = Instant::now();
                    for s in &batch_spans {
                        let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
                        if op == "read" {
                            actorpipe::internal::copy::copy_large(
                                &mut near[l..l + n],
                                &far[r..r + n],
                            );
                        } else {
                            actorpipe::internal::copy::copy_large(
                                &mut far[r..r + n],
                                &near[l..l + n],
                            );
                        }
                    }
                    if i >= WARMUP {
                        raw.push(t.elapsed());
                    }
                }
                std::hint::black_box((&far, &near));
                let p50 = |mut v: Vec<Duration>| {
                    v.sort_unstable();
                    v[v.len() / 2]
                };
                rows.push(Row {
                    op,
                    size,
                    batch,
                    path,
                    ours: p50(ours),
                    raw: p50(raw),
                });
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
