//! The `cuda_gdr` channel on the SIMULATED RDMA device, with a real GPU: CUDA tensors through
//! pipes between two contexts of this process, moved by simulated RDMA writes whose "DMA" is the
//! CUDA driver's copies (docs/ibv.md, `cuda_gdr`). No real HCA is involved anywhere: every trial
//! name says `sim`.
//!
//! `harness = false` (libtest-mimic): where no CUDA GPU is, every trial is reported as ignored
//! with the reason. Build here, run on a GPU machine: see docs/ibv.md, "Running the cuda_gdr
//! trials".

mod common;
// The CUDA suite's pipe helpers (`run`, `bytes`, `mixed`, the close check); its own trials are
// not registered here.
#[allow(dead_code)]
#[path = "cuda/pipe.rs"]
mod pipe;

use actix::Addr;
use actorpipe::channel::CudaGdr;
use actorpipe::channel::IbvChannel;
use actorpipe::cuda::{self, CudaBuffer};
use actorpipe::internal::backend::ibv::sim;
use actorpipe::internal::topology::{pci_address, PciDevice, Topology, VENDOR_NVIDIA};
use actorpipe::transport::Ibv;
use actorpipe::{
    Close, Context, ContextBuilder, Device, GetInfo, Message, Pipe, Receive, Tensor, Write,
};
use libtest_mimic::{Arguments, Failed, Trial};

type Outcome = Result<(), Failed>;

fn fail(e: impl std::fmt::Display) -> Failed {
    e.to_string().into()
}

/// What the shared pipe helpers' measuring trial needs (not run here).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn gpu0() -> Result<std::sync::Arc<cuda::Gpu>, Failed> {
    cuda::gpu(0).map_err(fail)
}

fn filled(device: u32, seed: u64, len: usize) -> Result<(CudaBuffer, Vec<u8>), Failed> {
    let data = common::pattern(seed, len);
    let mut b = CudaBuffer::alloc(device, len).map_err(fail)?;
    b.copy_from_host(&data).map_err(fail)?;
    Ok((b, data))
}

/// The chunk limit in these trials (1 GiB in use): tensors over 64 KiB take several writes.
const CHUNK: u64 = 64 << 10;

fn main() {
    let args = Arguments::from_args();
    let skip = cuda::available().err();
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let trials = [
        (
            "sim_gdr_moves_every_pair_in_order",
            moves_every_pair as fn() -> Outcome,
        ),
        ("sim_gdr_waits_for_the_senders_stream", sender_stream_order),
        (
            "sim_gdr_close_mid_transfer_leaks_nothing",
            close_mid_transfer,
        ),
        (
            "sim_gdr_reallocated_memory_is_registered_anew",
            stale_registration,
        ),
        (
            "sim_gdr_stripes_one_tensor_over_two_devices",
            stripes_over_two_devices,
        ),
        (
            "sim_gdr_sends_a_gpus_tensor_through_its_nic",
            gpu_tensor_takes_its_nic,
        ),
    ]
    .into_iter()
    .map(|(name, f)| {
        let t = Trial::test(name, move || {
            // One at a time: free GPU memory is compared before and after.
            let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
            f()
        });
        match &skip {
            Some(why) => t
                .with_ignored_flag(true)
                .with_kind(format!("skipped: {why}")),
            None => t,
        }
    })
    .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// The channel of most trials: simulated device `sim0`, 64 KiB writes, `keep` bytes of idle
/// registrations kept.
fn sim0(keep: u64) -> IbvChannel {
    IbvChannel::new(Ibv::simulated())
        .with_chunk_limit(CHUNK)
        .with_registration_keep(keep)
}

/// A context with only `basic` (host tensors) and `cuda_gdr` on `chan`'s simulated devices,
/// over loopback TCP.
fn gdr_context(chan: IbvChannel) -> (ContextBuilder, CudaGdr) {
    let all = CudaGdr::all(chan);
    let first = all[0]
        .as_any()
        .and_then(|a| a.downcast_ref::<CudaGdr>())
        .expect("a CudaGdr")
        .clone();
    let b = all.into_iter().fold(
        Context::builder()
            .without("shm")
            .only_channels(&["basic", "cuda_gdr"]),
        |b, c| b.channel(c),
    );
    (b, first)
}

/// Two pipes whose CUDA pairs all run on cuda_gdr (each side's channel made by `chan`), and the
/// two sides' backends.
async fn gdr_pair(
    chan: impl Fn() -> IbvChannel,
) -> Result<(Addr<Pipe>, Addr<Pipe>, common::Server, CudaGdr, CudaGdr), Failed> {
    let ((a, ga), (b, gb)) = (gdr_context(chan()), gdr_context(chan()));
    let (tx, rx, s) = common::pair(a, b).await;
    let info = tx.send(GetInfo).await.map_err(fail)?;
    for pair in ["cpu->cuda", "cuda->cpu", "cuda->cuda"] {
        let want = format!("cuda_gdr ({pair})");
        if !info.channels.iter().any(|c| c.to_string() == want) {
            return Err(fail(format!(
                "{want} not negotiated: {}",
                info.channel_list()
            )));
        }
    }
    Ok((tx, rx, s, ga, gb))
}

/// A size: tiny (under the 32-byte verbs minimum), around the chunk limit, or several chunks.
fn size(rng: &mut common::Rng) -> usize {
    match rng.next() % 4 {
        0 => (rng.next() % 40) as usize,
        1 => CHUNK as usize - 1 + (rng.next() % 3) as usize,
        2 => (rng.next() % (5 * CHUNK)) as usize,
        _ => common::draw_size(rng).min(8 << 20),
    }
}

/// 24 messages in flight, each with a host tensor and one tensor of each CUDA pair: every byte
/// checked, order kept, each tensor landing where its route says, the sender's buffers back.
fn moves_every_pair() -> Outcome {
    pipe::run(async {
        let (tx, rx, _s, _, _) = gdr_pair(|| sim0(0)).await?;
        let mut rng = common::Rng(0x9d7);
        let mut writes = Vec::new();
        let mut sent = Vec::new();
        for i in 0..24u64 {
            let (m, data) = pipe::mixed(i, [0; 4].map(|_| size(&mut rng)))?;
            writes.push(actix::spawn(tx.send(Write::new(m))));
            sent.push(data);
        }
        for (i, data) in sent.iter().enumerate() {
            let done = rx.send(Receive::new()).await.map_err(fail)?;
            done.result.map_err(fail)?;
            let m = &done.message;
            if m.metadata != (i as u64).to_le_bytes() {
                return Err(fail(format!("message {i} arrived out of order")));
            }
            let devices: Vec<Device> = m.tensors.iter().map(|t| t.buffer.device()).collect();
            if devices != [Device::Cpu, Device::Cuda(0), Device::Cuda(0), Device::Cpu] {
                return Err(fail(format!("message {i} landed on {devices:?}")));
            }
            done.cuda.wait().map_err(fail)?;
            for (k, t) in m.tensors.iter().enumerate() {
                if pipe::bytes(&t.buffer, None)? != data[k] {
                    return Err(fail(format!(
                        "message {i} tensor {k} ({} bytes): bytes differ",
                        data[k].len()
                    )));
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
    })
}

/// Work queued on the sender's stream before the write is part of what is sent: a 64 MiB
/// device copy into the tensor is still running when the write is issued.
fn sender_stream_order() -> Outcome {
    pipe::run(async {
        let (tx, rx, _s, _, _) = gdr_pair(|| sim0(0)).await?;
        pipe::sends_after_stream_work(&tx, &rx, 64 << 20).await
    })
}

/// The receiver closes with CUDA writes in flight: every write completes in order (the first
/// `Ok`, the rest with an error), each with its buffer, and no GPU memory is left behind.
fn close_mid_transfer() -> Outcome {
    let g = gpu0()?;
    g.synchronize().map_err(fail)?;
    let free_before = g.memory().map_err(fail)?.0;
    pipe::run(async {
        let (tx, rx, _s, _, gb) = gdr_pair(|| sim0(0)).await?;
        let mut writes = Vec::new();
        for i in 0..6u64 {
            let (b, _) = filled(0, i, 8 << 20)?;
            writes.push(tx.send(Write::new(Message::new().with_tensor(Tensor::cuda(b)))));
        }
        let first = rx.send(Receive::new()).await.map_err(fail)?;
        first.cuda.wait().map_err(fail)?;
        first.result.map_err(fail)?;
        rx.send(Close::because("test: receiver gone"))
            .await
            .map_err(fail)?;
        pipe::first_ok_then_errors_in_order(writes).await?;
        let (_, caches) = gb.ibv().caches().map_err(fail)?;
        if !caches.recv.is_empty() {
            return Err(fail("a receive registration outlived the close"));
        }
        Ok(())
    })?;
    g.synchronize().map_err(fail)?;
    let free_after = g.memory().map_err(fail)?.0;
    println!(
        "free GPU memory: {} MiB before, {} MiB after",
        free_before >> 20,
        free_after >> 20
    );
    pipe::memory_given_back(free_before, free_after, 2 << 20)
}

/// With idle registrations kept (the dangerous setting), a tensor freed and another allocated
/// at the same address is registered anew (its buffer id differs) and the receiver gets the new
/// bytes.
fn stale_registration() -> Outcome {
    pipe::run(async {
        let (tx, rx, _s, ga, _) = gdr_pair(|| sim0(1 << 30)).await?;
        let (_, caches) = ga.ibv().caches().map_err(fail)?;
        let len = 1 << 20;
        let mut addr = None;
        for round in 0..3u64 {
            let (b, data) = filled(0, round + 100, len)?;
            let reused = addr == Some(b.device_ptr());
            addr = Some(b.device_ptr());
            let (stale_before, regs_before) =
                (caches.send.stale_replaced(), caches.send.registrations());
            let w = tx.send(Write::new(Message::new().with_tensor(Tensor::cuda(b))));
            let done = rx.send(Receive::new()).await.map_err(fail)?;
            done.result.map_err(fail)?;
            done.cuda.wait().map_err(fail)?;
            if pipe::bytes(&done.message.tensors[0].buffer, None)? != data {
                return Err(fail(format!("round {round}: the receiver got other bytes")));
            }
            let back = w.await.map_err(fail)?;
            back.result.as_ref().map_err(fail)?;
            println!(
                "round {round}: address {:#x} {}, registrations {} -> {}, stale {} -> {}",
                addr.unwrap_or(0),
                if reused { "reused" } else { "new" },
                regs_before,
                caches.send.registrations(),
                stale_before,
                caches.send.stale_replaced()
            );
            if reused && caches.send.stale_replaced() != stale_before + 1 {
                return Err(fail(format!(
                    "round {round}: reallocated memory at the same address reused a stale \
                     registration"
                )));
            }
            drop(back); // frees the tensor: the next allocation may take its address
        }
        Ok(())
    })
}

/// Sends `m` and receives it: the bytes of its tensors as they arrived, once the write is back.
async fn round_trip(tx: &Addr<Pipe>, rx: &Addr<Pipe>, m: Message) -> Result<Vec<Vec<u8>>, Failed> {
    let w = tx.send(Write::new(m));
    let done = rx.send(Receive::new()).await.map_err(fail)?;
    done.result.map_err(fail)?;
    done.cuda.wait().map_err(fail)?;
    let got = done
        .message
        .tensors
        .iter()
        .map(|t| pipe::bytes(&t.buffer, None))
        .collect::<Result<Vec<_>, _>>()?;
    let back = w.await.map_err(fail)?;
    back.result.map_err(fail)?;
    Ok(got)
}

/// Bytes moved by the queue pairs of simulated devices `devices` since `before`.
fn moved(devices: [usize; 2], before: [u64; 2]) -> [u64; 2] {
    [0, 1].map(|i| sim::bytes_moved(devices[i]) - before[i])
}

/// One 32 MiB CUDA tensor over two simulated devices placed nowhere (sim40 first, sim41
/// further; an empty topology), so it takes every link: each device carries a stripe, and
/// every byte arrives.
fn stripes_over_two_devices() -> Outcome {
    pipe::run(async {
        let devices = [40, 41];
        let chan = || {
            IbvChannel::new(Ibv::simulated_device(devices[0]))
                .with_devices(vec![Ibv::simulated_device(devices[1])])
                .with_topology(Topology::default())
        };
        let (tx, rx, _s, _, _) = gdr_pair(chan).await?;
        let len = 32 << 20;
        let before = devices.map(sim::bytes_moved);
        let (b, data) = filled(0, 40, len)?;
        let got = round_trip(&tx, &rx, Message::new().with_tensor(Tensor::cuda(b))).await?;
        if got != [data] {
            return Err(fail("the striped tensor arrived with other bytes"));
        }
        let m = moved(devices, before);
        println!("bytes moved: sim40 {}, sim41 {}", m[0], m[1]);
        if m.iter().any(|&n| n < len as u64 / 4) || m[0] + m[1] < len as u64 {
            return Err(fail(format!(
                "a {len}-byte tensor over two devices moved {m:?}: not striped over both"
            )));
        }
        Ok(())
    })
}

/// A tree with GPU `gpu` (a PCI address) behind a switch with one NIC, and another NIC on
/// another root complex; the simulated devices `near` and `far` placed at those NICs.
fn beside(gpu: &str, near: usize, far: usize) -> Topology {
    let dev = |address: &str, class: u32, path: &[&str]| PciDevice {
        address: address.into(),
        class,
        vendor: if class >> 16 == 0x03 {
            VENDOR_NVIDIA
        } else {
            0x15b3
        },
        path: path.iter().map(|p| p.to_string()).collect(),
    };
    let mut t = Topology::default();
    for d in [
        dev(gpu, 0x030200, &["pci0000:00", "switch", gpu]),
        dev(
            "0000:fe:00.0",
            0x020700,
            &["pci0000:00", "switch", "0000:fe:00.0"],
        ),
        dev(
            "0001:fe:00.0",
            0x020700,
            &["pci0001:00", "port", "0001:fe:00.0"],
        ),
    ] {
        t.devices.insert(d.address.clone(), d);
    }
    t.place(&format!("sim{near}"), "0000:fe:00.0")
        .place(&format!("sim{far}"), "0001:fe:00.0")
}

/// GPU 0's tensors take its own NIC: with the channel's first device (sim50) placed on another
/// root complex and its further device (sim51) behind GPU 0's switch, a 8 MiB and a 1 KiB CUDA
/// tensor move on sim51 alone. A host tensor (cpu->cuda) of the same pipe still takes every
/// link.
fn gpu_tensor_takes_its_nic() -> Outcome {
    let gpu = cuda::devices().map_err(fail)?[0].pci_bus_id.clone();
    let devices = [50, 51];
    let topology = beside(&pci_address(&gpu), devices[1], devices[0]);
    pipe::run(async {
        let chan = || {
            IbvChannel::new(Ibv::simulated_device(devices[0]))
                .with_devices(vec![Ibv::simulated_device(devices[1])])
                .with_topology(topology.clone())
        };
        let (tx, rx, _s, _, _) = gdr_pair(chan).await?;
        let before = devices.map(sim::bytes_moved);
        let (big, big_data) = filled(0, 50, 8 << 20)?;
        let (small, small_data) = filled(0, 51, 1 << 10)?;
        let m = Message::new()
            .with_tensor(Tensor::cuda(big))
            .with_tensor(Tensor::cuda(small));
        if round_trip(&tx, &rx, m).await? != [big_data, small_data] {
            return Err(fail("GPU 0's tensors arrived with other bytes"));
        }
        let m = moved(devices, before);
        println!(
            "GPU {gpu}'s tensors: bytes moved: sim50 (far) {}, sim51 (near) {}",
            m[0], m[1]
        );
        if m[0] != 0 || m[1] < 8 << 20 {
            return Err(fail(format!(
                "GPU 0's tensors should take sim51 alone; moved {m:?}"
            )));
        }
        let before = devices.map(sim::bytes_moved);
        let host_data = common::pattern(52, 8 << 20);
        let mut up = Tensor::cpu(host_data.clone());
        up.target_device = Some(Device::Cuda(0));
        if round_trip(&tx, &rx, Message::new().with_tensor(up)).await? != [host_data] {
            return Err(fail("the host tensor arrived with other bytes"));
        }
        let m = moved(devices, before);
        println!("a host tensor: bytes moved: sim50 {}, sim51 {}", m[0], m[1]);
        if m.contains(&0) {
            return Err(fail(format!(
                "a host tensor should take every link; moved {m:?}"
            )));
        }
        Ok(())
    })
}
