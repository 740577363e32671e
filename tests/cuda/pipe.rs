//! Pipe-level GPU trials: CUDA tensors through pipes between two contexts of one process (the
//! `cuda_xth` channel), with host tensors in the same messages.

use std::future::Future;
use std::time::Duration;

use actix::Addr;
use actorpipe::cuda::{self, CudaBuffer};
use actorpipe::{
    Allocation, Buffer, Close, Context, Device, GetInfo, Message, Payload, Pipe, Read,
    ReadDescriptor, Receive, Tensor, Write,
};
use libtest_mimic::Failed;

use super::{common, fail, filled, gpu0, Outcome};

/// Runs `f` in an actix system, bounded so a bug fails the trial instead of hanging the suite.
pub(super) fn run<F: Future<Output = Outcome>>(f: F) -> Outcome {
    actix::System::new().block_on(async move {
        match tokio::time::timeout(Duration::from_secs(120), f).await {
            Ok(r) => r,
            Err(_) => Err(fail("did not finish within 120 s")),
        }
    })
}

/// Two pipes between two contexts of this process; checks that cuda_xth carries every CUDA
/// device pair.
async fn xth_pair() -> Result<(Addr<Pipe>, Addr<Pipe>, common::Server), Failed> {
    let (tx, rx, s) = common::pair(Context::builder(), Context::builder()).await;
    let info = tx.send(GetInfo).await.map_err(fail)?;
    for pair in ["cpu->cuda", "cuda->cpu", "cuda->cuda"] {
        let want = format!("cuda_xth ({pair})");
        if !info.channels.iter().any(|c| c.to_string() == want) {
            return Err(fail(format!(
                "{want} not negotiated: {}",
                info.channel_list()
            )));
        }
    }
    println!("pipe channels: {}", info.channel_list());
    Ok((tx, rx, s))
}

/// The bytes of a buffer, read on `stream` when given (ordered only by what that stream waited
/// for), else on the buffer's own stream.
pub(super) fn bytes(b: &Buffer, stream: Option<&cuda::StreamLease>) -> Result<Vec<u8>, Failed> {
    match b {
        Buffer::Cpu(v) => Ok(v.clone()),
        Buffer::Cuda(c) => match stream {
            Some(s) => {
                let mut c = c.clone_handle()?;
                c.set_stream(s.arc().clone()).map_err(fail)?;
                c.to_vec().map_err(fail)
            }
            None => c.to_vec().map_err(fail),
        },
        _ => Err(fail("a buffer of an unknown kind")),
    }
}

trait CloneHandle {
    fn clone_handle(&self) -> Result<CudaBuffer, Failed>;
}

impl CloneHandle for CudaBuffer {
    /// The same memory under another stream (borrowed: dropping it frees nothing).
    fn clone_handle(&self) -> Result<CudaBuffer, Failed> {
        // SAFETY: the memory is `len` bytes of this device, kept alive by `self` for as long as
        // the handle is used (within the caller's scope); the stream is the device's.
        unsafe {
            CudaBuffer::from_raw(
                self.device_ptr(),
                self.len(),
                self.device(),
                self.stream().cu_stream(),
            )
        }
        .map_err(fail)
    }
}

/// The next descriptor.
async fn descriptor(rx: &Addr<Pipe>) -> Result<actorpipe::Descriptor, Failed> {
    rx.send(ReadDescriptor)
        .await
        .map_err(fail)?
        .descriptor
        .map_err(fail)
}

/// One message of each device pair: host, cuda->cuda, cpu->cuda, cuda->cpu, with a payload.
pub(super) fn mixed(i: u64, sizes: [usize; 4]) -> Result<(Message, Vec<Vec<u8>>), Failed> {
    let data: Vec<Vec<u8>> = (0..4)
        .map(|k| common::pattern(i * 8 + k, sizes[k as usize]))
        .collect();
    let host = Tensor::cpu(data[0].clone());
    let (dev, _) = filled(0, i * 8 + 1, sizes[1])?;
    let mut up = Tensor::cpu(data[2].clone());
    up.target_device = Some(Device::Cuda(0));
    let (down_buf, _) = filled(0, i * 8 + 3, sizes[3])?;
    let mut down = Tensor::cuda(down_buf);
    down.target_device = Some(Device::Cpu);
    let m = Message::new()
        .with_metadata(i.to_le_bytes().to_vec())
        .with_payload(Payload::new(common::pattern(i, 100)))
        .with_tensor(host)
        .with_tensor(Tensor::cuda(dev))
        .with_tensor(up)
        .with_tensor(down);
    Ok((m, data))
}

/// Round trips of mixed host and CUDA messages, many in flight at once: every byte checked,
/// order kept, each CUDA buffer landing on the device its route names, the read's completion
/// carrying one event for GPU 0, both waits giving the data, and the sender's buffers coming
/// back in `WriteDone`.
pub fn round_trips() -> Outcome {
    run(async {
        let (tx, rx, _s) = xth_pair().await?;
        let g = gpu0()?;
        let mut rng = common::Rng(0x5eed);
        let mut writes = Vec::new();
        let mut sent = Vec::new();
        for i in 0..24u64 {
            let sizes = [0; 4].map(|_| common::draw_size(&mut rng));
            let (m, data) = mixed(i, sizes)?;
            let ptrs: Vec<u64> = m
                .tensors
                .iter()
                .map(|t| t.buffer.as_cuda().map_or(0, |c| c.device_ptr()))
                .collect();
            // Polled from now on (an unpolled `send` beyond the mailbox's 16 slots never enqueues).
            writes.push(actix::spawn(tx.send(Write::new(m))));
            sent.push((data, ptrs));
        }
        for (i, (data, _)) in sent.iter().enumerate() {
            let done = rx.send(Receive::new()).await.map_err(fail)?;
            done.result.map_err(fail)?;
            let m = &done.message;
            if m.metadata != (i as u64).to_le_bytes() {
                return Err(fail(format!("message {i} arrived out of order")));
            }
            let devices: Vec<Device> = m.tensors.iter().map(|t| t.buffer.device()).collect();
            let want = [Device::Cpu, Device::Cuda(0), Device::Cuda(0), Device::Cpu];
            if devices != want {
                return Err(fail(format!("message {i} landed on {devices:?}")));
            }
            if done.cuda.devices().collect::<Vec<_>>() != [0] {
                return Err(fail(format!("message {i}: completion {:?}", done.cuda)));
            }
            // Even messages: the blocking wait; odd ones: another stream waits on the GPU.
            let lease = g.lease_stream().map_err(fail)?;
            let on = if i % 2 == 0 {
                done.cuda.wait().map_err(fail)?;
                None
            } else {
                done.cuda.wait_on(&lease).map_err(fail)?;
                Some(&lease)
            };
            for (k, t) in m.tensors.iter().enumerate() {
                if bytes(&t.buffer, on)? != data[k] {
                    return Err(fail(format!("message {i} tensor {k}: bytes differ")));
                }
            }
            if m.payloads[0].data != common::pattern(i as u64, 100) {
                return Err(fail(format!("message {i}: payload differs")));
            }
        }
        for (i, (w, (_, ptrs))) in writes.into_iter().zip(&sent).enumerate() {
            let done = w.await.map_err(fail)?.map_err(fail)?;
            done.result.map_err(fail)?;
            let back: Vec<u64> = done
                .message
                .tensors
                .iter()
                .map(|t| t.buffer.as_cuda().map_or(0, |c| c.device_ptr()))
                .collect();
            if &back != ptrs {
                return Err(fail(format!("write {i}: other buffers came back")));
            }
        }
        Ok(())
    })
}

/// Work queued on the sender's stream before the write is part of what is sent, with no CPU
/// wait: a 256 MiB device copy into the tensor is still running when the write is issued.
pub fn sender_stream_order() -> Outcome {
    run(async {
        let (tx, rx, _s) = xth_pair().await?;
        sends_after_stream_work(&tx, &rx, 256 << 20).await
    })
}

/// Writes a `len`-byte CUDA tensor from `tx` while a device copy into it is still queued on its
/// stream, and checks that `rx` receives the copy's bytes.
pub(super) async fn sends_after_stream_work(
    tx: &Addr<Pipe>,
    rx: &Addr<Pipe>,
    len: usize,
) -> Outcome {
    let g = gpu0()?;
    let (src, data) = filled(0, 77, len)?;
    let t = CudaBuffer::alloc(0, len).map_err(fail)?;
    // SAFETY: both are `len` bytes of device 0, alive until the transfer is over (the
    // source until the end of this function, the tensor until WriteDone).
    unsafe {
        cuda::copy_async(
            (t.device_ptr(), &g),
            (src.device_ptr(), &g),
            len,
            t.stream(),
        )
    }
    .map_err(fail)?;
    let w = tx.send(Write::new(Message::new().with_tensor(Tensor::cuda(t))));
    let done = rx.send(Receive::new()).await.map_err(fail)?;
    done.result.map_err(fail)?;
    let lease = g.lease_stream().map_err(fail)?;
    done.cuda.wait_on(&lease).map_err(fail)?;
    if bytes(&done.message.tensors[0].buffer, Some(&lease))? != data {
        return Err(fail(
            "the receiver did not see the work queued before the write",
        ));
    }
    w.await.map_err(fail)?.result.map_err(fail)?;
    Ok(())
}

/// `Read::data_complete`: `ReadDone` comes once the data has landed, with nothing to wait on;
/// a read into buffers of the wrong kind is refused and the pipe goes on.
pub fn data_complete_reads() -> Outcome {
    run(async {
        let (tx, rx, _s) = xth_pair().await?;
        let g = gpu0()?;
        for i in 0..4u64 {
            let (m, data) = mixed(i, [1000, 3 << 20, 70_000, 4096])?;
            let w = tx.send(Write::new(m));
            let d = descriptor(&rx).await?;
            if i == 0 {
                // Host memory for a tensor that lands on the GPU: refused, nothing lost.
                let mut wrong = Allocation::for_descriptor(&d).map_err(fail)?;
                wrong.tensors[1] = Buffer::Cpu(vec![0; d.tensors[1].length as usize]);
                let r = rx.send(Read::new(wrong)).await.map_err(fail)?;
                match r.result {
                    Err(e) if e.to_string().contains("lands in cuda memory") => {}
                    other => return Err(fail(format!("wrong kind: {other:?}"))),
                }
            }
            let alloc = Allocation::for_descriptor(&d).map_err(fail)?;
            let done = rx
                .send(Read::new(alloc).data_complete())
                .await
                .map_err(fail)?;
            done.result.map_err(fail)?;
            if !done.cuda.is_empty() {
                return Err(fail("a data-complete read carries events"));
            }
            // Read on a fresh stream that waited for nothing.
            let lease = g.lease_stream().map_err(fail)?;
            for (k, t) in done.message.tensors.iter().enumerate() {
                if bytes(&t.buffer, Some(&lease))? != data[k] {
                    return Err(fail(format!("message {i} tensor {k}: not landed")));
                }
            }
            w.await.map_err(fail)?.result.map_err(fail)?;
        }
        Ok(())
    })
}

/// The receiving pipe closes with CUDA writes in flight: every write completes with an error,
/// in order, its buffer comes back, and no GPU memory is left behind.
pub fn close_mid_transfer() -> Outcome {
    let g = gpu0()?;
    let free_before = g.memory().map_err(fail)?.0;
    run(async {
        let (tx, rx, _s) = xth_pair().await?;
        let mut writes = Vec::new();
        for i in 0..6u64 {
            let (b, _) = filled(0, i, 64 << 20)?;
            let m = Message::new().with_tensor(Tensor::cuda(b));
            writes.push(tx.send(Write::new(m)));
        }
        // The first message is read; the rest are in flight when the receiver closes.
        let first = rx.send(Receive::new()).await.map_err(fail)?;
        first.cuda.wait().map_err(fail)?;
        first.result.map_err(fail)?;
        rx.send(Close::because("test: receiver gone"))
            .await
            .map_err(fail)?;
        first_ok_then_errors_in_order(writes).await
    })?;
    let free_after = g.memory().map_err(fail)?.0;
    println!(
        "free before {} MiB, after {} MiB",
        free_before >> 20,
        free_after >> 20
    );
    memory_given_back(free_before, free_after, 16 << 20)
}

/// Awaits writes of one CUDA tensor each, issued in this order, of which the receiver read the
/// first before closing: that one `Ok`, every later one an error, completions in order, every
/// CUDA buffer back.
pub(super) async fn first_ok_then_errors_in_order<W>(writes: Vec<W>) -> Outcome
where
    W: Future<Output = Result<actorpipe::WriteDone, actix::MailboxError>>,
{
    let mut last = None;
    for (i, w) in writes.into_iter().enumerate() {
        let done = w.await.map_err(fail)?;
        if last.is_some_and(|id| done.id <= id) {
            return Err(fail("write completions out of order"));
        }
        last = Some(done.id);
        match (i, &done.result) {
            (0, Ok(())) | (1.., Err(_)) => {}
            (i, r) => return Err(fail(format!("write {i}: {r:?}"))),
        }
        if done.message.tensors[0].buffer.as_cuda().is_none() {
            return Err(fail(format!(
                "write {i}: the CUDA buffer did not come back"
            )));
        }
    }
    Ok(())
}

/// Fails unless the GPU's free memory `after` is back to `before`, give or take `slack` bytes.
pub(super) fn memory_given_back(before: usize, after: usize, slack: usize) -> Outcome {
    if after + slack < before {
        return Err(fail(format!(
            "{} MiB of GPU memory not given back",
            (before - after) >> 20
        )));
    }
    Ok(())
}

/// Sender on GPU 0, receiver on GPU 1 (peer copy where the hardware allows it).
pub fn across_two_gpus() -> Outcome {
    run(async {
        let (tx, rx, _s) = xth_pair().await?;
        for (i, len) in [4096usize, 64 << 20].into_iter().enumerate() {
            let (b, data) = filled(0, 100 + i as u64, len)?;
            let w = tx.send(Write::new(Message::new().with_tensor(Tensor::cuda(b))));
            let d = descriptor(&rx).await?;
            let alloc = Allocation::for_descriptor_on(&d, 1).map_err(fail)?;
            let done = rx.send(Read::new(alloc)).await.map_err(fail)?;
            done.result.map_err(fail)?;
            if done.cuda.devices().collect::<Vec<_>>() != [1] {
                return Err(fail(format!("completion {:?}", done.cuda)));
            }
            done.cuda.wait().map_err(fail)?;
            let t = &done.message.tensors[0].buffer;
            if t.device() != Device::Cuda(1) || bytes(t, None)? != data {
                return Err(fail(format!("{len} bytes to cuda:1 differ")));
            }
            w.await.map_err(fail)?.result.map_err(fail)?;
        }
        Ok(())
    })
}

/// Prints one `MEASURE` line: the pipe's median round trip for `channel` next to the raw
/// copies' (times in seconds).
pub(super) fn print_measure(channel: &str, len: usize, raw: Vec<f64>, pipe: Vec<f64>) {
    let (r, p) = (super::median(raw), super::median(pipe));
    println!(
        "MEASURE pipe {channel} round trip, {len} B: p50 {:.1} us; raw D2D there and back {:.1} us ({:.0} % of raw{})",
        p * 1e6,
        r * 1e6,
        100.0 * r / p,
        if len >= 1 << 20 {
            format!(", {:.1} GB/s each way", 2.0 * len as f64 / p / 1e9)
        } else {
            String::new()
        }
    );
}

/// Times of `reps` raw device-to-device copies of `len` bytes there and back on `s` (the
/// baseline of the round-trip measures).
pub(super) fn raw_round_trips(
    g: &std::sync::Arc<cuda::Gpu>,
    s: &cuda::StreamLease,
    len: usize,
    reps: usize,
) -> Result<Vec<f64>, Failed> {
    let a = CudaBuffer::alloc(0, len).map_err(fail)?;
    let b = CudaBuffer::alloc(0, len).map_err(fail)?;
    let mut raw = Vec::new();
    for _ in 0..reps {
        let t = std::time::Instant::now();
        for (dst, src) in [(&b, &a), (&a, &b)] {
            // SAFETY: both buffers hold `len` bytes of device 0 and are alive.
            unsafe { cuda::copy_async((dst.device_ptr(), g), (src.device_ptr(), g), len, s) }
                .map_err(fail)?;
        }
        s.synchronize().map_err(fail)?;
        raw.push(t.elapsed().as_secs_f64());
    }
    Ok(raw)
}

/// Prints round trips of one CUDA tensor through a pipe pair (cuda_xth, both directions, the
/// receive into the spare buffers of the last one) next to the raw device-to-device copy of the
/// same size, twice (there and back). Nothing is asserted on time.
pub fn measure() -> Outcome {
    run(async {
        let (tx, rx, _s) = xth_pair().await?;
        let g = gpu0()?;
        let s = g.lease_stream().map_err(fail)?;
        for len in [4usize << 10, 64 << 20, 1 << 30] {
            let reps = if len >= 1 << 30 { 8 } else { 200 };
            let raw = raw_round_trips(&g, &s, len, reps)?;
            // Spare buffers for each side's receive, reused from one round to the next.
            let (mut at_rx, mut at_tx) = (None::<Allocation>, None::<Allocation>);
            let mut m =
                Message::new().with_tensor(Tensor::cuda(CudaBuffer::alloc(0, len).map_err(fail)?));
            let mut pipe = Vec::new();
            for i in 0..reps + 2 {
                let t = std::time::Instant::now();
                let w = actix::spawn(tx.send(Write::new(m)));
                let got = rx
                    .send(at_rx.take().map_or_else(Receive::new, Receive::reusing))
                    .await
                    .map_err(fail)?;
                got.result.map_err(fail)?;
                // Echo: the received tensor goes back, ordered after its copy on the GPU.
                let back = got.message;
                if let Some(c) = back.tensors[0].buffer.as_cuda() {
                    got.cuda.wait_on(c.stream()).map_err(fail)?;
                }
                let w2 = actix::spawn(rx.send(Write::new(back)));
                let home = tx
                    .send(at_tx.take().map_or_else(Receive::new, Receive::reusing))
                    .await
                    .map_err(fail)?;
                home.result.map_err(fail)?;
                home.cuda.wait().map_err(fail)?;
                let elapsed = t.elapsed().as_secs_f64();
                let sent = w.await.map_err(fail)?.map_err(fail)?;
                sent.result.map_err(fail)?;
                let echoed = w2.await.map_err(fail)?.map_err(fail)?;
                echoed.result.map_err(fail)?;
                at_rx = Some(Allocation::from(echoed.message));
                at_tx = Some(Allocation::from(sent.message));
                m = home.message;
                if i >= 2 {
                    pipe.push(elapsed);
                }
            }
            print_measure("cuda_xth", len, raw, pipe);
        }
        Ok(())
    })
}
