//! Pipe-level GPU trials of `cuda_ipc`: CUDA tensors through a real pipe between this process
//! and a second one (this binary again, in a child role: `ACTORPIPE_CUDA_CHILD`).

use std::process::Command;
use std::time::Duration;

use actix::Addr;
use actorpipe::cuda::CudaBuffer;
use actorpipe::{
    Allocation, Close, Connect, Context, Device, GetInfo, IpcCacheStats, Message, Pipe, Receive,
    Tensor, Write,
};
use libtest_mimic::Failed;

use super::pipe::{bytes, mixed, run};
use super::{common, fail, filled, gpu0, Outcome};

/// The child's roles.
pub const ECHO: &str = "pipe_echo";
pub const SEND_AND_HANG: &str = "pipe_send_and_hang";

/// Starts this binary as the peer in `role`, connecting to a listener of ours built from
/// `builder`; returns the child and our end of its pipe, after checking that `channel` carries
/// each of `pairs`.
async fn peer_with(
    role: &str,
    builder: actorpipe::ContextBuilder,
    channel: &str,
    pairs: &[&str],
) -> Result<(common::ChildProcess, Addr<Pipe>, common::Server), Failed> {
    let mut s = common::Server::start(builder, "tcp://127.0.0.1:0").await;
    let mut cmd = Command::new(std::env::current_exe().map_err(fail)?);
    cmd.env("ACTORPIPE_CUDA_CHILD", role)
        .env("ACTORPIPE_CUDA_URL", &s.url);
    let child = common::ChildProcess::spawn(cmd);
    let pipe = s.next().await;
    let info = pipe.send(GetInfo).await.map_err(fail)?;
    println!("pipe channels: {}", info.channel_list());
    for pair in pairs {
        let want = format!("{channel} ({pair})");
        if !info.channels.iter().any(|c| c.to_string() == want) {
            return Err(fail(format!(
                "{want} not negotiated: {}",
                info.channel_list()
            )));
        }
    }
    Ok((child, pipe, s))
}

/// [`peer_with`] every channel: cuda_ipc must carry cuda->cuda and cuda->cpu.
async fn peer(role: &str) -> Result<(common::ChildProcess, Addr<Pipe>, common::Server), Failed> {
    peer_with(
        role,
        Context::builder(),
        "cuda_ipc",
        &["cuda->cuda", "cuda->cpu"],
    )
    .await
}

/// Where each tensor of [`mixed`] comes back after the echo: cpu->cuda lands on the GPU only
/// where a channel carries that pair between processes (cuda_basic), else in host memory.
async fn echoed_devices(pipe: &Addr<Pipe>) -> Result<[Device; 4], Failed> {
    let info = pipe.send(GetInfo).await.map_err(fail)?;
    let up = info
        .channels
        .iter()
        .any(|c| c.to_string().ends_with("(cpu->cuda)"));
    let up = if up { Device::Cuda(0) } else { Device::Cpu };
    Ok([Device::Cpu, Device::Cuda(0), up, Device::Cpu])
}

/// 24 mixed messages sent to the echoing peer, many in flight: every byte checked, the order
/// kept, and our CUDA buffers back in `WriteDone`.
async fn mixed_round_trips(pipe: &Addr<Pipe>, seed: u64) -> Outcome {
    let want = echoed_devices(pipe).await?;
    let mut rng = common::Rng(seed);
    let mut writes = Vec::new();
    let mut sent = Vec::new();
    for i in 0..24u64 {
        let sizes = [0; 4].map(|_| common::draw_size(&mut rng));
        let (m, data) = mixed(i, sizes)?;
        writes.push(actix::spawn(pipe.send(Write::new(m))));
        sent.push(data);
    }
    for (i, data) in sent.iter().enumerate() {
        let done = pipe.send(Receive::new()).await.map_err(fail)?;
        done.result.map_err(fail)?;
        let m = &done.message;
        if m.metadata != (i as u64).to_le_bytes() {
            return Err(fail(format!("message {i} came back out of order")));
        }
        let devices: Vec<Device> = m.tensors.iter().map(|t| t.buffer.device()).collect();
        if devices != want {
            return Err(fail(format!(
                "message {i} came back on {devices:?}, expected {want:?}"
            )));
        }
        done.cuda.wait().map_err(fail)?;
        for (k, t) in m.tensors.iter().enumerate() {
            if bytes(&t.buffer, None)? != data[k] {
                return Err(fail(format!("message {i} tensor {k}: bytes differ")));
            }
        }
    }
    for (i, w) in writes.into_iter().enumerate() {
        let done = w.await.map_err(fail)?.map_err(fail)?;
        done.result.map_err(fail)?;
        if done.message.tensors[1].buffer.as_cuda().is_none() {
            return Err(fail(format!(
                "write {i}: the CUDA buffer did not come back"
            )));
        }
    }
    Ok(())
}

/// Our cache counters for device 0: (exports, opened memory).
async fn stats(
    s: &common::Server,
) -> Result<
    (
        actorpipe::internal::backend::cuda_ipc::cache::Stats,
        actorpipe::internal::backend::cuda_ipc::cache::Stats,
    ),
    Failed,
> {
    let (e, o, _) = s
        .ctx
        .send(IpcCacheStats(0))
        .await
        .map_err(fail)?
        .unwrap_or_default();
    Ok((e, o))
}

/// Sends `m` and checks that the echo brings back `data`; returns the write's buffers.
async fn echo_once(
    pipe: &Addr<Pipe>,
    m: Message,
    data: &[u8],
    what: &str,
) -> Result<Message, Failed> {
    let w = actix::spawn(pipe.send(Write::new(m)));
    let got = pipe.send(Receive::new()).await.map_err(fail)?;
    got.result.map_err(fail)?;
    got.cuda.wait().map_err(fail)?;
    if bytes(&got.message.tensors[0].buffer, None)? != data {
        return Err(fail(format!("{what}: the echo differs")));
    }
    let done = w.await.map_err(fail)?.map_err(fail)?;
    done.result.map_err(fail)?;
    Ok(done.message)
}

/// Mixed messages (host, cuda->cuda, cpu->cuda, cuda->cpu) to the other process and back, many
/// in flight, every byte checked and the order kept; then the stale-handle case (a tensor
/// freed and a new one allocated at the same address: the peer gets the new bytes) and a
/// resend of the same allocation with new bytes (a hit in both caches).
pub fn round_trips() -> Outcome {
    run(async {
        let (mut child, pipe, s) = peer(ECHO).await?;
        mixed_round_trips(&pipe, 0x1bc).await?;
        // Stale handle: free, allocate at the same address, send again.
        let len = 8 << 20;
        let (a, data_a) = filled(0, 1000, len)?;
        let back = echo_once(
            &pipe,
            Message::new().with_tensor(Tensor::cuda(a)),
            &data_a,
            "A",
        )
        .await?;
        let addr_a = back.tensors[0].buffer.as_cuda().map(|c| c.device_ptr());
        drop(back);
        let (mut b, data_b) = filled(0, 1001, len)?;
        let same = addr_a == Some(b.device_ptr());
        println!("reallocated at the same address: {same}");
        let (e0, _) = stats(&s).await?;
        let mut back = echo_once(
            &pipe,
            Message::new().with_tensor(Tensor::cuda(b)),
            &data_b,
            "B",
        )
        .await?;
        // Resend of the same allocation with new bytes: no new export.
        let data_c = common::pattern(1002, len);
        b = back
            .tensors
            .pop()
            .and_then(|t| t.buffer.into_cuda())
            .ok_or_else(|| fail("B lost"))?;
        b.copy_from_host(&data_c).map_err(fail)?;
        let (e1, _) = stats(&s).await?;
        echo_once(
            &pipe,
            Message::new().with_tensor(Tensor::cuda(b)),
            &data_c,
            "B again",
        )
        .await?;
        let (e2, _) = stats(&s).await?;
        println!("export cache: before B {e0:?}, after B {e1:?}, after the resend {e2:?}");
        if e1.misses != e0.misses + 1 || e2.hits != e1.hits + 1 || e2.misses != e1.misses {
            return Err(fail(
                "the new allocation was not a miss and its resend a hit",
            ));
        }
        pipe.send(Close::because("test over")).await.map_err(fail)?;
        let (_, line) = child
            .line("STATS", Duration::from_secs(20))
            .ok_or_else(|| fail(format!("no STATS from the peer: {}", child.tail())))?;
        println!("peer's cache (export hits, misses; open hits, misses, stale): {line}");
        let n: Vec<u64> = line
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if n.get(2).copied().unwrap_or(0) == 0 {
            return Err(fail("the peer's open cache never hit on the resend"));
        }
        Ok(())
    })
}

/// The same mixed messages over `cuda_basic` alone (our side does not offer cuda_ipc): every
/// CUDA device pair staged through pinned chunks on the channel's own connection, cpu->cuda
/// included; large tensors (up to 64 MiB) cross many chunks.
pub fn basic_round_trips() -> Outcome {
    run(async {
        let (_child, pipe, _s) = peer_with(
            ECHO,
            Context::builder().without("cuda_ipc"),
            "cuda_basic",
            &["cuda->cuda", "cpu->cuda", "cuda->cpu"],
        )
        .await?;
        mixed_round_trips(&pipe, 0xba5e).await?;
        // Sizes around the chunk boundaries, one at a time.
        let chunk = actorpipe::internal::backend::cuda_basic::CHUNK;
        for (i, len) in [1, chunk - 1, chunk, chunk + 1, 5 * chunk + 3]
            .into_iter()
            .enumerate()
        {
            let (b, data) = filled(0, 700 + i as u64, len)?;
            echo_once(
                &pipe,
                Message::new().with_tensor(Tensor::cuda(b)),
                &data,
                "boundary",
            )
            .await?;
        }
        pipe.send(Close::because("test over")).await.map_err(fail)?;
        Ok(())
    })
}

/// The peer process is killed with transfers in flight both ways: our pending reads and our
/// write waiting for its acknowledgement all fail, the mappings of its memory are closed, and
/// the GPU's free memory comes back to what it was before the peer started.
pub fn peer_killed() -> Outcome {
    let g = gpu0()?;
    let len = 256 << 20;
    let (ours, _) = filled(0, 5, len)?;
    g.synchronize().map_err(fail)?;
    let (free_before, _) = g.memory().map_err(fail)?;
    let mut after = 0;
    // Our tensor comes back in the failed write's `WriteDone`; it stays allocated until the
    // measurement, so that its 256 MiB cannot hide a mapping of the peer's left open.
    let mut ours_back = None;
    run(async {
        let (mut child, pipe, s) = peer(SEND_AND_HANG).await?;
        child
            .line("SENT", Duration::from_secs(30))
            .ok_or_else(|| fail(format!("the peer did not send: {}", child.tail())))?;
        // The peer never reads: this write waits for an ack that never comes.
        let w = actix::spawn(pipe.send(Write::new(Message::new().with_tensor(Tensor::cuda(ours)))));
        let first = pipe.send(Receive::new()).await.map_err(fail)?;
        first.result.map_err(fail)?;
        first.cuda.wait().map_err(fail)?;
        if bytes(&first.message.tensors[0].buffer, None)? != common::pattern(300, len) {
            return Err(fail("the first tensor differs"));
        }
        drop(first.message);
        let reads: Vec<_> = (0..3)
            .map(|_| actix::spawn(pipe.send(Receive::new())))
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (_, open) = stats(&s).await?;
        println!("mappings open with the peer alive: {}", open.entries);
        child.kill();
        let done = w.await.map_err(fail)?.map_err(fail)?;
        if done.result.is_ok() || done.message.tensors[0].buffer.as_cuda().is_none() {
            return Err(fail(format!("the pending write: {:?}", done.result)));
        }
        println!("pending write: {:?}", done.result);
        ours_back = Some(done.message);
        let mut failed = 0;
        for r in reads {
            let r = r.await.map_err(fail)?.map_err(fail)?;
            if r.result.is_err() {
                failed += 1;
            }
        }
        // The peer sent two tensors: the second may have been read; the rest must fail.
        if failed < 2 {
            return Err(fail(format!("only {failed} of the pending reads failed")));
        }
        for _ in 0..100 {
            let (_, open) = stats(&s).await?;
            after = g.memory().map_err(fail)?.0;
            if open.entries == 0 && after + (64 << 20) >= free_before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (_, open) = stats(&s).await?;
        println!(
            "free GPU memory: before the peer {} MiB, after its death {} MiB; open cache {open:?}",
            free_before >> 20,
            after >> 20
        );
        if open.entries != 0 {
            return Err(fail("mappings of the dead peer left open"));
        }
        Ok(())
    })?;
    drop(ours_back);
    super::pipe::memory_given_back(free_before, after, 64 << 20)
}

/// Round trips of one CUDA tensor to the other process and back (it echoes into reused
/// buffers, so both caches hit), next to the raw device-to-device copy of the same size, twice.
/// Nothing is asserted on time.
pub fn measure() -> Outcome {
    run(async {
        let (_child, pipe, _s) = peer(ECHO).await?;
        let g = gpu0()?;
        let s = g.lease_stream().map_err(fail)?;
        for len in [4usize << 10, 64 << 20, 1 << 30] {
            let reps = if len >= 1 << 30 { 8 } else { 200 };
            let raw = super::pipe::raw_round_trips(&g, &s, len, reps)?;
            let mut m =
                Message::new().with_tensor(Tensor::cuda(CudaBuffer::alloc(0, len).map_err(fail)?));
            let mut spare = None::<Allocation>;
            let mut times = Vec::new();
            for i in 0..reps + 2 {
                let t = std::time::Instant::now();
                let w = actix::spawn(pipe.send(Write::new(m)));
                let home = pipe
                    .send(spare.take().map_or_else(Receive::new, Receive::reusing))
                    .await
                    .map_err(fail)?;
                home.result.map_err(fail)?;
                home.cuda.wait().map_err(fail)?;
                let elapsed = t.elapsed().as_secs_f64();
                let sent = w.await.map_err(fail)?.map_err(fail)?;
                sent.result.map_err(fail)?;
                spare = Some(Allocation::from(sent.message));
                m = home.message;
                if i >= 2 {
                    times.push(elapsed);
                }
            }
            super::pipe::print_measure("cuda_ipc (two processes)", len, raw, times);
        }
        Ok(())
    })
}

// ----- the child's side ----------------------------------------------------------------------

/// Connects to the parent's listener (`ACTORPIPE_CUDA_URL`).
pub(super) async fn connect() -> Result<(Addr<Context>, Addr<Pipe>), Failed> {
    common::die_with_parent();
    let url = std::env::var("ACTORPIPE_CUDA_URL").map_err(fail)?;
    let ctx = Context::builder().start();
    let pipe = ctx
        .send(Connect::new(&url))
        .await
        .map_err(fail)?
        .map_err(fail)?;
    Ok((ctx, pipe))
}

/// Child: sends every message back, its CUDA tensors ordered after their copies on the GPU
/// (no CPU wait), receiving into the buffers of the last echo; prints its cache counters once
/// the pipe closes.
pub fn echo() -> Outcome {
    actix::System::new().block_on(async {
        let (ctx, pipe) = connect().await?;
        let mut spare = None::<Allocation>;
        loop {
            let got = pipe
                .send(spare.take().map_or_else(Receive::new, Receive::reusing))
                .await
                .map_err(fail)?;
            if let Err(e) = &got.result {
                // The parent sees the pipe fail; the cause is on this side.
                eprintln!("echo child: receive ended: {e}");
                break;
            }
            for t in &got.message.tensors {
                if let Some(c) = t.buffer.as_cuda() {
                    got.cuda.wait_on(c.stream()).map_err(fail)?;
                }
            }
            let back = pipe.send(Write::new(got.message)).await.map_err(fail)?;
            if let Err(e) = &back.result {
                eprintln!("echo child: write ended: {e}");
                break;
            }
            spare = Some(Allocation::from(back.message));
        }
        let (e, o, _) = ctx
            .send(IpcCacheStats(0))
            .await
            .map_err(fail)?
            .unwrap_or_default();
        common::tell_parent(&format!(
            "STATS {} {} {} {} {}",
            e.hits, e.misses, o.hits, o.misses, o.stale
        ));
        Ok(())
    })
}

/// Child: sends two 256 MiB CUDA tensors, says so, and hangs (the parent kills it).
pub fn send_and_hang() -> Outcome {
    actix::System::new().block_on(async {
        let (_ctx, pipe) = connect().await?;
        let mut writes = Vec::new();
        for seed in [300, 301] {
            let (b, _) = filled(0, seed, 256 << 20)?;
            writes.push(actix::spawn(
                pipe.send(Write::new(Message::new().with_tensor(Tensor::cuda(b)))),
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        common::tell_parent("SENT");
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(writes);
        Ok(())
    })
}
