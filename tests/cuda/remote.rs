//! GPU trials of remote memory (docs/remote.md): regions of device memory, and local device
//! buffers, read and written one-sidedly on each path that carries them: `cuda_xth` (two
//! contexts of this process), `cuda_basic` (the owner serves device memory through the remote
//! lane, here between two contexts of this process with the GPU channels left out) and
//! `cuda_ipc` (the owner is a second process, this binary in a child role; this side maps the
//! owner's allocation and copies on its own stream).

use std::process::Command;
use std::time::{Duration, Instant};

use actix::Addr;
use actorpipe::cuda::CudaBuffer;
use actorpipe::prelude::*;
use actorpipe::remote::{
    Notification, RegionDescriptor, RemoteDone, RemoteRead, RemoteWrite, Span,
    SubscribeNotifications,
};
use actorpipe::{Context, Message, Pipe, Receive, Write};
use libtest_mimic::Failed;

use super::pipe::run;
use super::{common, fail, filled, Outcome};

/// The child's roles: the owner of a region of device memory; an initiator that maps one.
pub const OWNER: &str = "remote_owner";
pub const MAPPER: &str = "remote_mapper";

/// The owner's region (device memory of GPU 0), filled with `common::pattern(OWNER_SEED, ..)`.
const REGION: usize = 64 << 20;
const OWNER_SEED: u64 = 0x5eed;

/// Which memory a trial's local buffers are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mem {
    Host,
    Gpu,
}

fn local(mem: Mem, bytes: &[u8]) -> Result<Buffer, Failed> {
    Ok(match mem {
        Mem::Host => Buffer::Cpu(bytes.to_vec()),
        Mem::Gpu => {
            let mut b = CudaBuffer::alloc(0, bytes.len()).map_err(fail)?;
            b.copy_from_host(bytes).map_err(fail)?;
            Buffer::Cuda(b)
        }
    })
}

fn contents(b: &Buffer) -> Result<Vec<u8>, Failed> {
    match b {
        Buffer::Cuda(c) => c.to_vec().map_err(fail),
        other => other
            .as_cpu()
            .map(<[u8]>::to_vec)
            .ok_or_else(|| fail("no bytes")),
    }
}

/// Up to `n` spans of random lengths inside `region` and `local` bytes, no two landing on the
/// same bytes of the local buffer (reads) or of the region (writes): each its own slice of
/// both, in a shuffled order.
fn spans(rng: &mut common::Rng, n: usize, region: u64, local: u64) -> Vec<Span> {
    let slice = region.min(local) / n as u64;
    let mut v: Vec<Span> = (0..n as u64)
        .map(|i| {
            let len = 1 + rng.below(slice);
            let r = i * slice + rng.below(slice - len + 1);
            let l = i * slice + rng.below(slice - len + 1);
            Span::new(r, l, len)
        })
        .collect();
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

/// Random batches both ways between a region and local buffers of `mem`, every byte checked
/// against a model of the region; `owner_view` reads the region as its owner sees it.
async fn batches(
    pipe: &Addr<Pipe>,
    d: &RegionDescriptor,
    model: &mut [u8],
    mem: Mem,
    path: &str,
    seed: u64,
    owner_view: &mut dyn FnMut() -> Result<Vec<u8>, Failed>,
) -> Outcome {
    let mut rng = common::Rng(seed);
    let region = model.len() as u64;
    for round in 0..6 {
        let n = [1, 3, 64, 7, 64, 2][round];
        let len = [4096usize, 1 << 20, 8 << 20, 123_457, 2 << 20, 16 << 20][round];
        // A read into a buffer of stale bytes.
        let batch = spans(&mut rng, n, region, len as u64);
        let before = common::pattern(seed + round as u64, len);
        let done = pipe
            .send(RemoteRead::new(d, batch.clone(), local(mem, &before)?))
            .await
            .map_err(fail)?;
        check_done(&done, path, "read")?;
        let got = contents(&done.buffer)?;
        let mut want = before;
        for s in &batch {
            let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
            want[l..l + n].copy_from_slice(&model[r..r + n]);
        }
        if got != want {
            return Err(fail(format!(
                "{path} {mem:?}: round {round}: the read's bytes"
            )));
        }
        // A write of new bytes.
        let batch = spans(&mut rng, n, region, len as u64);
        let src = common::pattern(seed * 31 + round as u64, len);
        let done = pipe
            .send(RemoteWrite::new(d, batch.clone(), local(mem, &src)?))
            .await
            .map_err(fail)?;
        check_done(&done, path, "write")?;
        for s in &batch {
            let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
            model[r..r + n].copy_from_slice(&src[l..l + n]);
        }
        if owner_view()? != model {
            return Err(fail(format!(
                "{path} {mem:?}: round {round}: the region after the write"
            )));
        }
        // The buffer comes back as it went.
        if mem == Mem::Gpu && done.buffer.as_cuda().is_none() {
            return Err(fail("the device buffer did not come back"));
        }
    }
    Ok(())
}

fn check_done(done: &RemoteDone, path: &str, what: &str) -> Outcome {
    if let Err(e) = &done.result {
        return Err(fail(format!("{path}: a {what} failed: {e}")));
    }
    if done.path != path {
        return Err(fail(format!("a {what} took {} for {path}", done.path)));
    }
    Ok(())
}

/// Two contexts of this process, the owner's region on GPU 0, on the path `builder` leaves.
async fn in_process(builder: fn() -> actorpipe::ContextBuilder, path: &str) -> Outcome {
    let mut s = common::Server::start(builder(), "tcp://127.0.0.1:0").await;
    let (pipe, _rx) = s.dial(&builder().start()).await;
    let (buffer, data) = filled(0, OWNER_SEED, REGION)?;
    let region = s.ctx.register(Buffer::Cuda(buffer)).await.map_err(fail)?;
    let d = region.descriptor().clone();
    if d.cuda_device() != Some(0) {
        return Err(fail(format!("the descriptor says {:?}", d.cuda_device())));
    }
    let mut model = data;
    let mut view = || {
        let mut v = vec![0; REGION];
        region.read_at(0, &mut v).map_err(fail)?;
        Ok(v)
    };
    for (i, mem) in [Mem::Host, Mem::Gpu].into_iter().enumerate() {
        batches(&pipe, &d, &mut model, mem, path, 11 + i as u64, &mut view).await?;
    }
    // A region of host memory read into and written from device memory takes the device path
    // too.
    let host = s
        .ctx
        .register(Buffer::Cpu(model.clone()))
        .await
        .map_err(fail)?;
    let hd = host.descriptor().clone();
    let mut host_view = || {
        let mut v = vec![0; REGION];
        host.read_at(0, &mut v).map_err(fail)?;
        Ok(v)
    };
    batches(&pipe, &hd, &mut model, Mem::Gpu, path, 21, &mut host_view).await?;
    // Notifications come after their data, as on every path.
    let (to, mut notes) = inbox::<Notification>();
    s.ctx.send(SubscribeNotifications(to)).await.map_err(fail)?;
    let w = RemoteWrite::new(
        &d,
        vec![Span::new(4096, 0, 4096)],
        local(Mem::Gpu, &[7; 4096])?,
    )
    .notify_owner(*b"seven");
    pipe.send(w).await.map_err(fail)?.result.map_err(fail)?;
    let n = common::within(10, "a notification", notes.recv())
        .await
        .ok_or_else(|| fail("no notification"))?;
    let mut block = vec![0; 4096];
    region.read_at(4096, &mut block).map_err(fail)?;
    if n.data != b"seven" || block != [7; 4096] {
        return Err(fail("the notification, or its data"));
    }
    // Deregistration hands the device memory back, and later operations fail clearly.
    let back = region.deregister().await;
    if back.as_cuda().map(|c| c.len()) != Some(REGION) {
        return Err(fail("the region's device memory did not come back"));
    }
    let late = pipe
        .send(RemoteRead::new(&d, vec![Span::whole(16)], vec![0; 16]))
        .await
        .map_err(fail)?;
    match late.result {
        Err(e) if e.to_string().contains("not registered") => Ok(()),
        other => Err(fail(format!("a read after deregistration: {other:?}"))),
    }
}

/// `cuda_xth`: both ends in this process; the initiator's copies are the driver's.
pub fn xth() -> Outcome {
    run(in_process(Context::builder, "cuda_xth"))
}

/// `cuda_basic`: the pipe has no GPU channel and no `xth`: the owner serves its device memory
/// through the remote lane, our device buffers travel through host memory.
pub fn basic() -> Outcome {
    run(in_process(
        || {
            Context::builder()
                .only_transports(&["tcp"])
                .only_channels(&["basic"])
        },
        "cuda_basic",
    ))
}

/// `cuda_ipc`: the owner is another process; we map its allocation. Random batches, a
/// notification, order of completions per kind, then deregistration: the owner's waits for our
/// mapping to close, and later operations fail. Prints the 4 KiB read's median and 64 MiB's
/// rate (the benchmark, `actorpipe bench remote --backend cuda_ipc`, measures properly).
pub fn ipc() -> Outcome {
    run(async {
        let mut s = common::Server::start(Context::builder(), "tcp://127.0.0.1:0").await;
        let mut cmd = Command::new(std::env::current_exe().map_err(fail)?);
        cmd.env("ACTORPIPE_CUDA_CHILD", OWNER)
            .env("ACTORPIPE_CUDA_URL", &s.url);
        let mut child = common::ChildProcess::spawn(cmd);
        let pipe = s.next().await;
        let got = common::within(30, "the descriptor", pipe.send(Receive::new()))
            .await
            .map_err(fail)?;
        got.result.map_err(fail)?;
        let d = RegionDescriptor::from_bytes(&got.message.metadata).map_err(fail)?;
        let mut model = common::pattern(OWNER_SEED, REGION);
        for (i, mem) in [Mem::Gpu, Mem::Host].into_iter().enumerate() {
            let mut rng = common::Rng(40 + i as u64);
            for round in 0..4 {
                let n = [1, 64, 5, 64][round];
                let len = [4096usize, 2 << 20, 1 << 20, 16 << 20][round];
                let batch = spans(&mut rng, n, REGION as u64, len as u64);
                let done = pipe
                    .send(RemoteRead::new(
                        &d,
                        batch.clone(),
                        local(mem, &vec![0; len])?,
                    ))
                    .await
                    .map_err(fail)?;
                check_done(&done, "cuda_ipc", "read")?;
                let got = contents(&done.buffer)?;
                for s in &batch {
                    let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
                    if got[l..l + n] != model[r..r + n] {
                        return Err(fail(format!("{mem:?} round {round}: the read's bytes")));
                    }
                }
                let batch = spans(&mut rng, n, REGION as u64, len as u64);
                let src = common::pattern(100 + round as u64, len);
                let done = pipe
                    .send(RemoteWrite::new(&d, batch.clone(), local(mem, &src)?))
                    .await
                    .map_err(fail)?;
                check_done(&done, "cuda_ipc", "write")?;
                for s in &batch {
                    let (r, l, n) = (s.remote as usize, s.local as usize, s.len as usize);
                    model[r..r + n].copy_from_slice(&src[l..l + n]);
                }
            }
        }
        // The region is mapped now: a descriptor of it with another token, or a longer length,
        // must not reach the mapping (the spans are checked against the descriptor's length).
        // (The forged length's span lies past the region's real end.)
        for (what, bad, at) in [
            ("token", common::forge(&d, |f| f.4[1] ^= 1), 0),
            ("length", common::forge(&d, |f| f.5 *= 2), REGION as u64),
        ] {
            let past = Span::new(at, 0, 4096);
            let done = pipe
                .send(RemoteRead::new(
                    &bad,
                    vec![past],
                    local(Mem::Gpu, &[0; 4096])?,
                ))
                .await
                .map_err(fail)?;
            if !matches!(done.result, Err(actorpipe::Error::Unauthenticated { .. })) {
                return Err(fail(format!(
                    "a descriptor with a forged {what}: {:?}",
                    done.result
                )));
            }
        }
        // A write with a notification: the owner checksums its region when it hears, and must
        // see the model.
        let w = RemoteWrite::new(
            &d,
            vec![Span::new(0, 0, 1 << 20)],
            local(Mem::Gpu, &[9; 1 << 20])?,
        )
        .notify_owner(*b"sum");
        pipe.send(w).await.map_err(fail)?.result.map_err(fail)?;
        model[..1 << 20].fill(9);
        let got_line = line(&mut child, "SUM").await?;
        let want = common::checksum(&model).to_string();
        if got_line.trim().trim_start_matches("SUM").trim() != want {
            return Err(fail(format!(
                "the owner saw {got_line}, the model is {want}"
            )));
        }
        // Completions in issue order per kind, a large read issued before many small ones.
        let (to, mut dones) = inbox::<RemoteDone>();
        let whole = vec![Span::whole(REGION as u64)];
        pipe.do_send(
            RemoteRead::new(&d, whole, local(Mem::Gpu, &vec![0; REGION])?).notify(to.clone()),
        );
        for _ in 0..16 {
            let small = RemoteRead::new(&d, vec![Span::new(64, 0, 4096)], vec![0; 4096]);
            pipe.do_send(small.notify(to.clone()));
        }
        let mut last = None;
        for _ in 0..17 {
            let done = common::within(20, "a completion", dones.recv())
                .await
                .ok_or_else(|| fail("a completion lost"))?;
            done.result.map_err(fail)?;
            if last.is_some_and(|l| done.id != l + 1) {
                return Err(fail(format!("read {} completed after {last:?}", done.id)));
            }
            last = Some(done.id);
        }
        // The latency and rate seen here.
        let mut lat = Vec::new();
        let mut small = Some(local(Mem::Gpu, &[0; 4096])?);
        for _ in 0..2000 {
            let t = Instant::now();
            let done = pipe
                .send(RemoteRead::new(
                    &d,
                    vec![Span::whole(4096)],
                    small.take().unwrap(),
                ))
                .await
                .map_err(fail)?;
            lat.push(t.elapsed());
            done.result.map_err(fail)?;
            small = Some(done.buffer);
        }
        lat.sort();
        let mut big = Some(local(Mem::Gpu, &vec![0; REGION])?);
        let t = Instant::now();
        for _ in 0..20 {
            let done = pipe
                .send(RemoteRead::new(
                    &d,
                    vec![Span::whole(REGION as u64)],
                    big.take().unwrap(),
                ))
                .await
                .map_err(fail)?;
            done.result.map_err(fail)?;
            big = Some(done.buffer);
        }
        let rate = 20.0 * REGION as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!(
            "cuda_ipc remote read: 4 KiB p50 {:?} p99 {:?}; 64 MiB {rate:.1} GB/s",
            lat[lat.len() / 2],
            lat[lat.len() * 99 / 100]
        );
        // Deregistration: the owner's waits for our mapping to close (REVOKE, REVOKED).
        pipe.send(Write::new(
            Message::new().with_metadata(b"deregister".to_vec()),
        ))
        .await
        .map_err(fail)?
        .result
        .map_err(fail)?;
        // Waited for without blocking this thread: our lane runs on it, and must answer the
        // owner's REVOKE.
        let line = line(&mut child, "DEREGISTERED").await?;
        println!("owner: {line}");
        let late = pipe
            .send(RemoteRead::new(
                &d,
                vec![Span::whole(16)],
                local(Mem::Gpu, &[0; 16])?,
            ))
            .await
            .map_err(fail)?;
        match late.result {
            Err(e) if e.to_string().contains("not registered") => {}
            other => return Err(fail(format!("a read after deregistration: {other:?}"))),
        }
        pipe.send(actorpipe::Close::because("test over"))
            .await
            .map_err(fail)?;
        Ok(())
    })
}

/// A stopped initiator holds its mapping of our region: deregistration waits while it lives
/// (its lane cannot answer `REVOKE`), and completes once it is killed: the memory is never
/// freed under a mapping that could still be used.
pub fn stopped_mapper() -> Outcome {
    run(async {
        let mut s = common::Server::start(Context::builder(), "tcp://127.0.0.1:0").await;
        let mut cmd = Command::new(std::env::current_exe().map_err(fail)?);
        cmd.env("ACTORPIPE_CUDA_CHILD", MAPPER)
            .env("ACTORPIPE_CUDA_URL", &s.url);
        let mut child = common::ChildProcess::spawn(cmd);
        let pipe = s.next().await;
        let (buffer, _) = filled(0, OWNER_SEED, 1 << 20)?;
        let region = s.ctx.register(Buffer::Cuda(buffer)).await.map_err(fail)?;
        let d = region.descriptor().to_bytes();
        pipe.send(Write::new(Message::new().with_metadata(d)))
            .await
            .map_err(fail)?
            .result
            .map_err(fail)?;
        let mapped = line(&mut child, "MAPPED").await?;
        println!("child: MAPPED {mapped}");
        let pid = child.id() as i32;
        // SAFETY: signals to our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let t = Instant::now();
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        actix::spawn(async move {
            let back = region.deregister().await;
            let _ = tx.send(back.len());
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        if rx.try_recv().is_ok() {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            return Err(fail(
                "deregistration did not wait for the stopped initiator",
            ));
        }
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let killed = Instant::now();
        let len = common::within(10, "the deregistration after the kill", rx)
            .await
            .map_err(fail)?;
        println!(
            "deregistration: pending {:?} while the initiator was stopped, done {:?} after its \
             kill ({len} bytes back)",
            killed - t,
            killed.elapsed()
        );
        Ok(())
    })
}

/// Child: maps the parent's region (one read), says `MAPPED`, and waits to be stopped and killed.
pub fn mapper() -> Outcome {
    run(async {
        let (_ctx, pipe) = super::ipc_pipe::connect().await?;
        let got = pipe.send(Receive::new()).await.map_err(fail)?;
        got.result.map_err(fail)?;
        let d = RegionDescriptor::from_bytes(&got.message.metadata).map_err(fail)?;
        let done = pipe
            .send(RemoteRead::new(
                &d,
                vec![Span::whole(4096)],
                local(Mem::Gpu, &[0; 4096])?,
            ))
            .await
            .map_err(fail)?;
        check_done(&done, "cuda_ipc", "read")?;
        common::tell_parent("MAPPED");
        tokio::time::sleep(Duration::from_secs(100)).await;
        Ok(())
    })
}

/// The child's next line tagged `tag`, within 20 s, waited for a few milliseconds at a time so
/// that this thread's actors (the pipe, its lane) keep running.
async fn line(child: &mut common::ChildProcess, tag: &str) -> Result<String, Failed> {
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if let Some((_, l)) = child.line(tag, Duration::from_millis(1)) {
            return Ok(l);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Err(fail(format!("no {tag} from the owner: {}", child.tail())))
}

// ----- the child's side ----------------------------------------------------------------------

/// Child: registers 64 MiB of device memory, sends its descriptor, checksums the region on
/// every notification (`SUM`), and deregisters when told (`DEREGISTERED` with the time it took).
pub fn owner() -> Outcome {
    run(async {
        let (ctx, pipe) = super::ipc_pipe::connect().await?;
        let (buffer, _) = filled(0, OWNER_SEED, REGION)?;
        let region = ctx.register(Buffer::Cuda(buffer)).await.map_err(fail)?;
        let region = std::sync::Arc::new(std::sync::Mutex::new(Some(region)));
        let (to, mut notes) = inbox::<Notification>();
        ctx.send(SubscribeNotifications(to)).await.map_err(fail)?;
        let d = region
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .descriptor()
            .to_bytes();
        pipe.send(Write::new(Message::new().with_metadata(d)))
            .await
            .map_err(fail)?
            .result
            .map_err(fail)?;
        let sums = region.clone();
        actix::spawn(async move {
            while let Some(n) = notes.recv().await {
                if n.data == b"sum" {
                    let mut v = vec![0; REGION];
                    if let Some(r) = sums.lock().unwrap().as_ref() {
                        let _ = r.read_at(0, &mut v);
                    }
                    common::tell_parent(&format!("SUM {}", common::checksum(&v)));
                }
            }
        });
        loop {
            let got = pipe.send(Receive::new()).await.map_err(fail)?;
            if got.result.is_err() {
                break;
            }
            if got.message.metadata == b"deregister" {
                let r = region.lock().unwrap().take();
                if let Some(r) = r {
                    let t = Instant::now();
                    let back = r.deregister().await;
                    common::tell_parent(&format!(
                        "DEREGISTERED in {:?}, {} bytes back",
                        t.elapsed(),
                        back.len()
                    ));
                }
            }
        }
        Ok(())
    })
}
