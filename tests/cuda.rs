//! The GPU suite: run for real where a CUDA GPU is, reported as ignored ("skipped: ...") with the
//! reason everywhere else (`harness = false`, libtest-mimic).
//!
//! The binary doubles as the second process of the IPC cases: started with
//! `ACTORPIPE_CUDA_CHILD` set, it runs that role instead of the suite (see [`child`]).
//! docs/cuda.md says how to build it here and run it on a GPU machine.

mod common;
#[path = "cuda/ipc_pipe.rs"]
mod ipc_pipe;
#[path = "cuda/pipe.rs"]
mod pipe;
#[path = "cuda/remote.rs"]
mod remote;

use std::io::{BufRead, Write as _};
use std::process::{Command, Stdio};
use std::sync::Arc;

use actorpipe::cuda::{self, CudaBuffer, CudaCompletion};
use actorpipe::internal::backend::cuda_ipc::ipc;
use libtest_mimic::{Arguments, Failed, Trial};

type Outcome = Result<(), Failed>;

fn fail(e: impl std::fmt::Display) -> Failed {
    e.to_string().into()
}

fn main() {
    if let Ok(role) = std::env::var("ACTORPIPE_CUDA_CHILD") {
        std::process::exit(match child(&role) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("child {role}: {}", e.message().unwrap_or("failed"));
                1
            }
        });
    }
    let args = Arguments::from_args();
    let skip = cuda::available().err();
    let gpus = cuda::device_count();
    let mut trials = Vec::new();
    // One trial at a time: several check the GPU's free memory before and after, and one
    // trial's allocations (or a child's mappings) would read as another's leak.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let mut add = |name: &'static str, need: u32, f: fn() -> Outcome| {
        let t = Trial::test(name, move || {
            let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
            f()
        });
        trials.push(match (&skip, gpus < need) {
            (Some(why), _) => t
                .with_ignored_flag(true)
                .with_kind(format!("skipped: {why}")),
            (None, true) => t
                .with_ignored_flag(true)
                .with_kind(format!("skipped: needs {need} GPUs, this host has {gpus}")),
            (None, false) => t,
        });
    };
    add("devices_are_listed", 1, devices_are_listed);
    add("buffers_round_trip_through_host", 1, buffers_round_trip);
    add("pools_reuse_events_and_streams", 1, pools_reuse);
    add("completion_waits_block_and_order", 1, completion_waits);
    add(
        "stream_done_callbacks_follow_their_work_in_order",
        1,
        stream_done_callbacks,
    );
    add("cudarc_slices_are_taken_without_copy", 1, cudarc_slices);
    add("ipc_handle_opens_in_another_process", 1, ipc_other_process);
    add("ipc_export_names_the_allocation", 1, ipc_export_offsets);
    add("peer_copy_between_two_gpus", 2, peer_copy);
    add("cuda_xth_moves_every_pair_in_order", 1, xth_pairs);
    add("cuda_xth_across_two_gpus", 2, xth_two_gpus);
    add("cuda_ipc_moves_tensors_between_processes", 1, ipc_pairs);
    add("cuda_ipc_measure_against_raw_copies", 1, ipc_measure);
    add("cuda_basic_pipeline_moves_and_measures", 1, basic_pipeline);
    add(
        "cuda_ipc_peer_killed_mid_transfer_leaks_nothing",
        1,
        ipc_peer_killed,
    );
    add("cuda_ipc_across_two_gpus_measure", 2, ipc_two_gpus);
    add(
        "pipe_cuda_xth_round_trips_mixed_messages",
        1,
        pipe::round_trips,
    );
    add(
        "pipe_cuda_xth_sender_stream_order",
        1,
        pipe::sender_stream_order,
    );
    add(
        "pipe_cuda_xth_data_complete_reads",
        1,
        pipe::data_complete_reads,
    );
    add(
        "pipe_cuda_xth_close_mid_transfer_leaks_nothing",
        1,
        pipe::close_mid_transfer,
    );
    add("pipe_cuda_xth_across_two_gpus", 2, pipe::across_two_gpus);
    add("pipe_cuda_xth_measure_round_trips", 1, pipe::measure);
    add(
        "pipe_cuda_ipc_round_trips_between_processes",
        1,
        ipc_pipe::round_trips,
    );
    add(
        "pipe_cuda_ipc_peer_killed_leaks_nothing",
        1,
        ipc_pipe::peer_killed,
    );
    add("pipe_cuda_ipc_measure_round_trips", 1, ipc_pipe::measure);
    add(
        "pipe_cuda_basic_round_trips_between_processes",
        1,
        ipc_pipe::basic_round_trips,
    );
    add(
        "remote_cuda_xth_reads_and_writes_device_memory",
        1,
        remote::xth,
    );
    add(
        "remote_cuda_basic_serves_device_memory_on_the_lane",
        1,
        remote::basic,
    );
    add("remote_cuda_ipc_maps_the_owners_memory", 1, remote::ipc);
    add(
        "remote_cuda_ipc_deregistration_outwaits_a_stopped_initiator",
        1,
        remote::stopped_mapper,
    );
    libtest_mimic::run(&args, trials).exit();
}

fn gpu0() -> Result<Arc<cuda::Gpu>, Failed> {
    cuda::gpu(0).map_err(fail)
}

fn filled(device: u32, seed: u64, len: usize) -> Result<(CudaBuffer, Vec<u8>), Failed> {
    let data = common::pattern(seed, len);
    let mut b = CudaBuffer::alloc(device, len).map_err(fail)?;
    b.copy_from_host(&data).map_err(fail)?;
    Ok((b, data))
}

fn devices_are_listed() -> Outcome {
    let list = cuda::devices().map_err(fail)?;
    for d in &list {
        println!(
            "cuda:{} {} {} MiB pci {} numa {:?}",
            d.ordinal,
            d.name,
            d.memory >> 20,
            d.pci_bus_id,
            d.numa_node
        );
        if d.name.is_empty() || d.memory == 0 || !d.pci_bus_id.contains(':') {
            return Err(fail(format!("incomplete listing {d:?}")));
        }
    }
    Ok(())
}

fn buffers_round_trip() -> Outcome {
    for len in [1usize, 7, 4097, 3 << 20] {
        let (b, data) = filled(0, len as u64, len)?;
        if b.to_vec().map_err(fail)? != data {
            return Err(fail(format!("{len} bytes changed on the way")));
        }
        let c = b.clone();
        if c.device_ptr() == b.device_ptr() || c.to_vec().map_err(fail)? != data {
            return Err(fail("clone is not a deep copy"));
        }
    }
    Ok(())
}

fn pools_reuse() -> Outcome {
    let g = gpu0()?;
    let raw = {
        let e = g.event(false).map_err(fail)?;
        e.raw()
    };
    let again = g.event(false).map_err(fail)?;
    if again.raw() != raw {
        return Err(fail("a returned event was not reused"));
    }
    let s = g.lease_stream().map_err(fail)?.arc().cu_stream();
    let s2 = g.lease_stream().map_err(fail)?;
    if s2.cu_stream() != s {
        return Err(fail("a returned stream was not reused"));
    }
    let pool = cuda::PinnedPool::new(1 << 20, 2);
    let p = pool.take().map_err(fail)?.as_ptr();
    if pool.take().map_err(fail)?.as_ptr() != p || pool.idle() != 1 {
        return Err(fail("a returned pinned buffer was not reused"));
    }
    Ok(())
}

fn completion_waits() -> Outcome {
    let g = gpu0()?;
    let len = 64 << 20;
    let (src, data) = filled(0, 3, len)?;
    let dst = CudaBuffer::alloc(0, len).map_err(fail)?;
    let copy = g.lease_stream().map_err(fail)?;
    // SAFETY: both buffers are `len` bytes of device 0 and live until the waits below.
    unsafe { cuda::copy_async((dst.device_ptr(), &g), (src.device_ptr(), &g), len, &copy) }
        .map_err(fail)?;
    let ev = g.event(false).map_err(fail)?;
    ev.record(&copy).map_err(fail)?;
    let done = CudaCompletion::new(vec![ev]);
    // Non-blocking: the destination's stream waits on the GPU, then reads.
    done.wait_on(dst.stream()).map_err(fail)?;
    if dst.to_vec().map_err(fail)? != data {
        return Err(fail("stream-ordered read saw other bytes"));
    }
    done.wait().map_err(fail)?;
    if !done.is_complete().map_err(fail)? {
        return Err(fail("complete after a blocking wait"));
    }
    Ok(())
}

/// `on_stream_done` (the device's watcher): each callback runs once, in queue order on one
/// stream; on two streams, an idle one's callback does not wait for the other's copies.
fn stream_done_callbacks() -> Outcome {
    use std::sync::mpsc;
    let g = gpu0()?;
    let len = 256 << 20;
    let (src, _) = filled(0, 5, len)?;
    let dst = CudaBuffer::alloc(0, len).map_err(fail)?;
    // Fresh streams: a pooled one may still carry another trial's work.
    let long = g.context().new_stream().map_err(fail)?;
    let short = g.context().new_stream().map_err(fail)?;
    // The long stream's work must outlast its enqueueing and the watcher's longest nap (1 ms)
    // many times over, on any GPU: at the 4.2 TB/s of an H200, eight copies of 256 MiB take
    // about 1 ms, and there the idle stream's callback once came last (2026-11-27). So each
    // of the long stream's eight callbacks follows at least 5 ms of copies, counted from one
    // timed copy.
    let copy = || {
        // SAFETY: both buffers are `len` bytes of device 0 and live until the end.
        unsafe { cuda::copy_async((dst.device_ptr(), &g), (src.device_ptr(), &g), len, &long) }
            .map_err(fail)
    };
    // Timed after one untimed copy (the stream's first may carry set-up); at most 100 a
    // callback, so that the 800 stay within what a stream queues without blocking the host.
    copy()?;
    long.synchronize().map_err(fail)?;
    let t = std::time::Instant::now();
    copy()?;
    long.synchronize().map_err(fail)?;
    let one = t.elapsed().as_secs_f64().max(1e-6);
    let per = (5e-3 / one).ceil().clamp(1.0, 100.0) as u32;
    print!(
        "{per} copies of 256 MiB a callback, {:.3} ms each: ",
        one * 1e3
    );
    let (tx, rx) = mpsc::channel();
    for i in 0..8u32 {
        for _ in 0..per {
            copy()?;
        }
        let tx = tx.clone();
        cuda::on_stream_done(&long, move || {
            let _ = tx.send(("long", i));
        })
        .map_err(fail)?;
    }
    let tx2 = tx.clone();
    cuda::on_stream_done(&short, move || {
        let _ = tx2.send(("short", 0));
    })
    .map_err(fail)?;
    drop(tx);
    let got: Vec<_> = rx.iter().collect();
    if got.len() != 9 {
        return Err(fail(format!("{} callbacks ran, not 9", got.len())));
    }
    let longs: Vec<u32> = got.iter().filter(|c| c.0 == "long").map(|c| c.1).collect();
    if longs != (0..8).collect::<Vec<_>>() {
        return Err(fail(format!(
            "callbacks of one stream out of order: {longs:?}"
        )));
    }
    if got.last().map(|c| c.0) == Some("short") {
        return Err(fail(
            format!(
                "the idle stream's callback waited for {} copies of 256 MiB ({:.0} ms) on another stream",
                8 * per,
                8.0 * per as f64 * one * 1e3
            ),
        ));
    }
    Ok(())
}

fn cudarc_slices() -> Outcome {
    let g = gpu0()?;
    let stream = g.context().new_stream().map_err(fail)?;
    let data = common::pattern(9, 1 << 16);
    let slice = stream.clone_htod(&data).map_err(fail)?;
    let b = CudaBuffer::from_slice(slice, stream.clone()).map_err(fail)?;
    if b.to_vec().map_err(fail)? != data {
        return Err(fail("slice bytes differ"));
    }
    let exportable = ipc::export(&g, b.device_ptr()).map_err(fail)?;
    println!(
        "cudarc slice: exportable over IPC: {}",
        match &exportable {
            Ok(_) => "yes".to_string(),
            Err(e) => format!("no ({e})"),
        }
    );
    let ptr = b.device_ptr();
    let back = b.into_slice().map_err(|_| fail("not a slice"))?;
    let (p, _g) = cudarc::driver::DevicePtr::device_ptr(&back, &stream);
    if p != ptr {
        return Err(fail("the slice came back moved"));
    }
    Ok(())
}

fn ipc_export_offsets() -> Outcome {
    let g = gpu0()?;
    let b = CudaBuffer::alloc(0, 1 << 20).map_err(fail)?;
    let inner = b.device_ptr() + 4096;
    let e = ipc::export(&g, inner).map_err(fail)?.map_err(fail)?;
    let whole = ipc::export(&g, b.device_ptr())
        .map_err(fail)?
        .map_err(fail)?;
    if e.offset != 4096 || e.size < 1 << 20 || e.handle != whole.handle {
        return Err(fail(format!("{e:?} vs {whole:?}")));
    }
    // A new allocation, even at the same address, has another buffer id.
    let id = e.buffer_id;
    let addr = b.device_ptr();
    drop(b);
    let c = CudaBuffer::alloc(0, 1 << 20).map_err(fail)?;
    let e2 = ipc::export(&g, c.device_ptr())
        .map_err(fail)?
        .map_err(fail)?;
    println!(
        "reallocated at the same address: {}, buffer ids {id} -> {}",
        c.device_ptr() == addr,
        e2.buffer_id
    );
    if e2.buffer_id == id {
        return Err(fail("buffer id reused"));
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Result<[u8; N], Failed> {
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2).ok_or_else(|| fail("short"))?, 16)
            .map_err(fail)?;
    }
    Ok(out)
}

/// Parent: exports a buffer and an interprocess event recorded after its fill; the child opens
/// both, waits on the event on its stream, copies, and prints a checksum.
fn ipc_other_process() -> Outcome {
    let g = gpu0()?;
    let len = (8 << 20) + 13;
    let (src, data) = filled(0, 77, len)?;
    let e = ipc::export(&g, src.device_ptr())
        .map_err(fail)?
        .map_err(fail)?;
    let ev = g.event(true).map_err(fail)?;
    ev.record(src.stream()).map_err(fail)?;
    let evh = ipc::export_event(&ev).map_err(fail)?;
    let mut child = Command::new(std::env::current_exe().map_err(fail)?)
        .env("ACTORPIPE_CUDA_CHILD", "ipc_open")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(fail)?;
    writeln!(
        child.stdin.as_mut().expect("piped"),
        "{} {} {} {} {}",
        hex(&e.handle),
        e.offset,
        e.size,
        len,
        hex(&evh)
    )
    .map_err(fail)?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut line)
        .map_err(fail)?;
    let status = child.wait().map_err(fail)?;
    let want = common::checksum(&data);
    if !status.success() || line.trim() != want.to_string() {
        return Err(fail(format!(
            "child said {line:?} ({status}), expected {want}"
        )));
    }
    Ok(())
}

fn child(role: &str) -> Outcome {
    match role {
        "ipc_recv" => ipc_receiver(),
        ipc_pipe::ECHO => ipc_pipe::echo(),
        ipc_pipe::SEND_AND_HANG => ipc_pipe::send_and_hang(),
        remote::OWNER => remote::owner(),
        remote::MAPPER => remote::mapper(),
        "ipc_send" => ipc_sender(),
        "ipc_open" => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map_err(fail)?;
            let f: Vec<&str> = line.split_whitespace().collect();
            let handle = unhex::<64>(f[0])?;
            let offset: u64 = f[1].parse().map_err(fail)?;
            let size: u64 = f[2].parse().map_err(fail)?;
            let len: usize = f[3].parse().map_err(fail)?;
            let evh = unhex::<64>(f[4])?;
            let g = gpu0()?;
            let t = std::time::Instant::now();
            let opened = ipc::open(&g, &handle, size).map_err(fail)?;
            let open_us = t.elapsed().as_micros();
            let ev = ipc::open_event(&g, &evh).map_err(fail)?;
            let dst = CudaBuffer::alloc(0, len).map_err(fail)?;
            ev.wait_on(dst.stream()).map_err(fail)?;
            // SAFETY: the mapping holds `offset + len` bytes and lives until after `to_vec`.
            unsafe {
                cuda::copy_async(
                    (dst.device_ptr(), &g),
                    (opened.base() + offset, &g),
                    len,
                    dst.stream(),
                )
            }
            .map_err(fail)?;
            let bytes = dst.to_vec().map_err(fail)?;
            eprintln!("child: cuIpcOpenMemHandle took {open_us} us");
            println!("{}", common::checksum(&bytes));
            Ok(())
        }
        other => Err(fail(format!("unknown child role {other}"))),
    }
}

fn peer_copy() -> Outcome {
    let g0 = gpu0()?;
    let g1 = cuda::gpu(1).map_err(fail)?;
    println!(
        "peer access 0->1: {}, 1->0: {}",
        g0.can_access_peer(&g1),
        g1.can_access_peer(&g0)
    );
    g1.enable_peer_access(&g0).map_err(fail)?;
    let len = 32 << 20;
    let (src, data) = filled(0, 5, len)?;
    let dst = CudaBuffer::alloc(1, len).map_err(fail)?;
    let ready = g0.event(false).map_err(fail)?;
    ready.record(src.stream()).map_err(fail)?;
    ready.wait_on(dst.stream()).map_err(fail)?;
    // SAFETY: both buffers hold `len` bytes and live past the synchronizing `to_vec`.
    unsafe {
        cuda::copy_async(
            (dst.device_ptr(), &g1),
            (src.device_ptr(), &g0),
            len,
            dst.stream(),
        )
    }
    .map_err(fail)?;
    if dst.to_vec().map_err(fail)? != data {
        return Err(fail("peer copy changed the bytes"));
    }
    Ok(())
}

// ----- channel engines ---------------------------------------------------------------------

use actorpipe::internal::backend::cuda_ipc::{self, IpcTensor, Staging};
use actorpipe::internal::backend::cuda_xth::{self, End, Key, Sent, Wanted};
use std::sync::mpsc;

type XthResult = (
    mpsc::Receiver<Result<(), actorpipe::Error>>,
    mpsc::Receiver<Result<Option<cuda::Event>, actorpipe::Error>>,
);

/// Parks a send and a receive (in the given order) and returns where their completions land.
fn xth_once(
    key: Key,
    src: End,
    dst: End,
    len: usize,
    ready: Option<cuda::Event>,
    stream: Arc<cuda::CudaStream>,
    recv_first: bool,
) -> XthResult {
    let (ftx, frx) = mpsc::channel();
    let (dtx, drx) = mpsc::channel();
    let sent = Sent {
        src,
        len,
        ready,
        on_free: Box::new(move |r| {
            let _ = ftx.send(r);
        }),
    };
    let wanted = Wanted {
        dst,
        len,
        stream: Some(stream),
        on_done: Box::new(move |r| {
            let _ = dtx.send(r);
        }),
    };
    if recv_first {
        cuda_xth::recv(key, wanted);
        cuda_xth::send(key, sent);
    } else {
        cuda_xth::send(key, sent);
        cuda_xth::recv(key, wanted);
    }
    (frx, drx)
}

fn wait<T>(rx: &mpsc::Receiver<T>, what: &str) -> Result<T, Failed> {
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .map_err(|_| fail(format!("{what}: no completion within 20 s")))
}

fn dev(b: &CudaBuffer) -> End {
    End::Device {
        ptr: b.device_ptr(),
        gpu: b.gpu().clone(),
    }
}

/// cuda->cuda, cpu->cuda, cuda->cpu through the in-process engine; the sender's stream is still
/// writing the source when the transfer is queued, so data is only right if the ready event
/// orders the copy.
fn xth_pairs() -> Outcome {
    let g = gpu0()?;
    let mut seq = 0;
    for len in [1usize, 4097, (3 << 20) + 5, 64 << 20] {
        for recv_first in [false, true] {
            seq += 1;
            let key = Key {
                sender: 1,
                seq,
                index: 0,
            };
            // cuda -> cuda, the source filled asynchronously right before the send.
            let data = common::pattern(seq, len);
            let pinned = cuda::PinnedPool::new(len, 1);
            let mut host = pinned.take().map_err(fail)?;
            host.as_mut_slice().copy_from_slice(&data);
            let src = CudaBuffer::alloc(0, len).map_err(fail)?;
            g.bind().map_err(fail)?;
            // SAFETY: pinned source and device destination of `len` bytes, alive until synced.
            let r = unsafe {
                cuda::sys::cuMemcpyHtoDAsync_v2(
                    src.device_ptr(),
                    host.as_ptr().cast(),
                    len,
                    src.stream().cu_stream(),
                )
            };
            r.result().map_err(fail)?;
            let dst = CudaBuffer::alloc(0, len).map_err(fail)?;
            xth_device_pair(key, &src, &dst, &data, recv_first)?;
            // cpu -> cuda
            seq += 1;
            let key = Key {
                sender: 1,
                seq,
                index: 0,
            };
            let data2 = common::pattern(seq, len);
            let dst2 = CudaBuffer::alloc(0, len).map_err(fail)?;
            let (free, done) = xth_once(
                key,
                End::Host {
                    ptr: data2.as_ptr() as usize,
                },
                dev(&dst2),
                len,
                None,
                dst2.stream().clone(),
                recv_first,
            );
            let ev = wait(&done, "receive")?
                .map_err(fail)?
                .ok_or_else(|| fail("no event"))?;
            ev.synchronize().map_err(fail)?;
            wait(&free, "sender free")?.map_err(fail)?;
            if dst2.to_vec().map_err(fail)? != data2 {
                return Err(fail(format!("cpu->cuda {len} bytes: wrong data")));
            }
            // cuda -> cpu
            seq += 1;
            let key = Key {
                sender: 1,
                seq,
                index: 0,
            };
            let mut out = vec![0u8; len];
            let ready = g.event(false).map_err(fail)?;
            ready.record(dst2.stream()).map_err(fail)?;
            let (free, done) = xth_once(
                key,
                dev(&dst2),
                End::Host {
                    ptr: out.as_mut_ptr() as usize,
                },
                len,
                Some(ready),
                g.lease_stream().map_err(fail)?.arc().clone(),
                recv_first,
            );
            if wait(&done, "receive")?.map_err(fail)?.is_some() {
                return Err(fail("a host destination has no event"));
            }
            wait(&free, "sender free")?.map_err(fail)?;
            if out != data2 {
                return Err(fail(format!("cuda->cpu {len} bytes: wrong data")));
            }
        }
    }
    // A withdrawn send completes with the error, once.
    let key = Key {
        sender: 2,
        seq: 0,
        index: 0,
    };
    let (ftx, frx) = mpsc::channel();
    cuda_xth::send(
        key,
        Sent {
            src: End::Host { ptr: 0 },
            len: 0,
            ready: None,
            on_free: Box::new(move |r| {
                let _ = ftx.send(r);
            }),
        },
    );
    cuda_xth::withdraw(key, &actorpipe::Error::invalid("closing"));
    if wait(&frx, "withdraw")?.is_ok() {
        return Err(fail("a withdrawn send succeeded"));
    }
    Ok(())
}

fn xth_two_gpus() -> Outcome {
    let len = 256 << 20;
    let (src, data) = filled(0, 41, len)?;
    let dst = CudaBuffer::alloc(1, len).map_err(fail)?;
    let key = Key {
        sender: 3,
        seq: 0,
        index: 0,
    };
    xth_device_pair(key, &src, &dst, &data, false)
}

/// One device-to-device cuda_xth transfer, ordered after the source stream's work so far: the
/// receiver waits on its completion event without blocking, then the data is checked.
fn xth_device_pair(
    key: Key,
    src: &CudaBuffer,
    dst: &CudaBuffer,
    data: &[u8],
    recv_first: bool,
) -> Outcome {
    let ready = src.gpu().event(false).map_err(fail)?;
    ready.record(src.stream()).map_err(fail)?;
    let (free, done) = xth_once(
        key,
        dev(src),
        dev(dst),
        src.len(),
        Some(ready),
        dst.stream().clone(),
        recv_first,
    );
    let ev = wait(&done, "receive")?
        .map_err(fail)?
        .ok_or_else(|| fail("no event"))?;
    ev.wait_on(dst.stream()).map_err(fail)?;
    wait(&free, "sender free")?.map_err(fail)?;
    if dst.to_vec().map_err(fail)? != data {
        return Err(fail(format!(
            "cuda:{} -> cuda:{}, {} bytes: wrong data",
            src.device(),
            dst.device(),
            src.len()
        )));
    }
    Ok(())
}

/// The receiving process of the IPC cases: reads commands on stdin, answers on stdout.
///
/// - `T <hex tensor> <len> <seed> <host>`: receive (into device memory, or host memory if
///   `host` is 1), wait for the copy, check against `pattern(seed)` (seed 0: no check), answer
///   `A ok|bad`.
/// - `S`: answer `S <open hits> <open misses> <stale> <entries>`.
fn ipc_receiver() -> Outcome {
    let device: u32 = std::env::var("ACTORPIPE_CUDA_DEVICE")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    let g = cuda::gpu(device).map_err(fail)?;
    let mut cache =
        actorpipe::internal::backend::cuda_ipc::cache::IpcCache::new(device, 64).map_err(fail)?;
    let stream = g.lease_stream().map_err(fail)?;
    let stream = stream.arc().clone();
    let mut dsts: std::collections::HashMap<usize, CudaBuffer> = Default::default();
    let out = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(fail)?;
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first().copied() {
            Some("T") => {
                let bytes: Vec<u8> = (0..f[1].len() / 2)
                    .map(|i| u8::from_str_radix(&f[1][2 * i..2 * i + 2], 16).unwrap_or(0))
                    .collect();
                let len: usize = f[2].parse().map_err(fail)?;
                let seed: u64 = f[3].parse().map_err(fail)?;
                let host = f[4] == "1";
                let t =
                    IpcTensor::decode(&bytes, len as u64).ok_or_else(|| fail("bad tensor data"))?;
                let (tx, rx) = mpsc::channel();
                let mut hbuf = vec![0u8; if host { len } else { 0 }];
                let dst = if host {
                    End::Host {
                        ptr: hbuf.as_mut_ptr() as usize,
                    }
                } else {
                    if let std::collections::hash_map::Entry::Vacant(e) = dsts.entry(len) {
                        e.insert(CudaBuffer::alloc(device, len).map_err(fail)?);
                    }
                    dev(&dsts[&len])
                };
                let t0 = std::time::Instant::now();
                let ev = cuda_ipc::receive(&mut cache, 1, &t, dst, len, &stream, move || {
                    let _ = tx.send(std::time::Instant::now());
                })
                .map_err(fail)?;
                let queued = t0.elapsed();
                let copied = rx.recv().map_err(fail)? - t0;
                let ok = if seed == 0 {
                    true
                } else if host {
                    hbuf == common::pattern(seed, len)
                } else {
                    ev.as_ref()
                        .map(|e| e.synchronize())
                        .transpose()
                        .map_err(fail)?;
                    let mut b = dsts.remove(&len).expect("present");
                    b.set_stream(stream.clone()).map_err(fail)?;
                    let ok = b.to_vec().map_err(fail)? == common::pattern(seed, len);
                    dsts.insert(len, b);
                    ok
                };
                let mut o = out.lock();
                writeln!(
                    o,
                    "A {} {:.2} {:.2}",
                    if ok { "ok" } else { "bad" },
                    queued.as_secs_f64() * 1e6,
                    copied.as_secs_f64() * 1e6
                )
                .map_err(fail)?;
                o.flush().map_err(fail)?;
            }
            Some("S") => {
                let (_, open, _) = cache.stats();
                let mut o = out.lock();
                writeln!(
                    o,
                    "S {} {} {} {}",
                    open.hits, open.misses, open.stale, open.entries
                )
                .map_err(fail)?;
                o.flush().map_err(fail)?;
            }
            _ => return Ok(()),
        }
    }
    Ok(())
}

struct Receiver {
    child: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

impl Receiver {
    fn start() -> Result<Receiver, Failed> {
        Self::on(0)
    }

    /// A receiving process whose buffers live on `device`.
    fn on(device: u32) -> Result<Receiver, Failed> {
        let mut child = Command::new(std::env::current_exe().map_err(fail)?)
            .env("ACTORPIPE_CUDA_CHILD", "ipc_recv")
            .env("ACTORPIPE_CUDA_DEVICE", device.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(fail)?;
        let input = child.stdin.take().expect("piped");
        let output = std::io::BufReader::new(child.stdout.take().expect("piped"));
        Ok(Receiver {
            child,
            input,
            output,
        })
    }

    fn ask(&mut self, line: &str) -> Result<String, Failed> {
        writeln!(self.input, "{line}").map_err(fail)?;
        self.input.flush().map_err(fail)?;
        let mut a = String::new();
        self.output.read_line(&mut a).map_err(fail)?;
        if a.is_empty() {
            return Err(fail("the receiving process died"));
        }
        Ok(a.trim().to_string())
    }

    /// Sends one tensor; returns the receiver's time to queue the copy and until its
    /// acknowledgement callback ran, in µs.
    fn send(
        &mut self,
        t: &IpcTensor,
        len: usize,
        seed: u64,
        host: bool,
    ) -> Result<(f64, f64), Failed> {
        let a = self.ask(&format!(
            "T {} {len} {seed} {}",
            hex(&t.encode()),
            u8::from(host)
        ))?;
        let f: Vec<&str> = a.split_whitespace().collect();
        if f.get(..2) != Some(&["A", "ok"][..]) {
            return Err(fail(format!(
                "receiver answered {a:?} for {len} bytes (seed {seed})"
            )));
        }
        let num = |i: usize| f.get(i).and_then(|x| x.parse().ok()).unwrap_or(f64::NAN);
        Ok((num(2), num(3)))
    }

    fn stats(&mut self) -> Result<Vec<u64>, Failed> {
        let a = self.ask("S")?;
        Ok(a.split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect())
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "Q");
        let _ = self.child.wait();
    }
}

fn ipc_pairs() -> Outcome {
    let mut cache =
        actorpipe::internal::backend::cuda_ipc::cache::IpcCache::new(0, 64).map_err(fail)?;
    let mut staging = Staging::default();
    let mut rx = Receiver::start()?;
    let mut seed = 100;
    for len in [1usize, 4097, (3 << 20) + 5] {
        for host in [false, true] {
            seed += 1;
            let (b, _) = filled(0, seed, len)?;
            let out = cuda_ipc::send(&mut cache, &mut staging, 1, &b).map_err(fail)?;
            rx.send(&out.data, len, seed, host)?;
        }
    }
    // The same buffer again: both caches hit.
    let (b, _) = filled(0, 7, 1 << 20)?;
    for _ in 0..3 {
        let out = cuda_ipc::send(&mut cache, &mut staging, 1, &b).map_err(fail)?;
        rx.send(&out.data, 1 << 20, 7, false)?;
    }
    let s = rx.stats()?;
    let (export, _, _) = cache.stats();
    println!("export cache {export:?}; open cache hits/misses/stale/entries {s:?}");
    if export.hits < 2 || s[0] < 2 {
        return Err(fail("a resent buffer did not hit the caches"));
    }
    // Stale: free the buffer, allocate again (often at the same address), new data. The new
    // allocation overlaps the freed one in the sender's address space, so the receiver drops the
    // old mapping (which would otherwise keep the freed memory allocated).
    let before = rx.stats()?;
    let addr = b.device_ptr();
    drop(b);
    let (b2, _) = filled(0, 8, 1 << 20)?;
    let out = cuda_ipc::send(&mut cache, &mut staging, 1, &b2).map_err(fail)?;
    rx.send(&out.data, 1 << 20, 8, false)?;
    let after = rx.stats()?;
    let same = b2.device_ptr() == addr;
    println!("reallocated at the same address: {same}; open cache {before:?} -> {after:?}");
    if same && after[3] != before[3] {
        return Err(fail("the mapping of the freed allocation is still open"));
    }
    // Pool memory (cudarc's default allocator) goes through a staging copy.
    let g = gpu0()?;
    let stream = g.context().new_stream().map_err(fail)?;
    let data = common::pattern(9, 1 << 16);
    let slice = stream.clone_htod(&data).map_err(fail)?;
    let b3 = CudaBuffer::from_slice(slice, stream).map_err(fail)?;
    let out = cuda_ipc::send(&mut cache, &mut staging, 1, &b3).map_err(fail)?;
    if out.staging.is_none() {
        println!("note: the cudarc slice was exportable as is");
    }
    rx.send(&out.data, 1 << 16, 9, false)?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Prints the engine's figures next to the raw driver copy (nothing asserted on time).
fn ipc_measure() -> Outcome {
    let g = gpu0()?;
    let mut cache =
        actorpipe::internal::backend::cuda_ipc::cache::IpcCache::new(0, 64).map_err(fail)?;
    let mut staging = Staging::default();
    let mut rx = Receiver::start()?;
    let s = g.lease_stream().map_err(fail)?;
    for len in [4usize << 10, 1 << 30] {
        let src = CudaBuffer::alloc(0, len).map_err(fail)?;
        let dst = CudaBuffer::alloc(0, len).map_err(fail)?;
        let reps = if len > 1 << 20 { 5 } else { 200 };
        let mut raw = Vec::new();
        for _ in 0..reps {
            let t = std::time::Instant::now();
            // SAFETY: both buffers hold `len` bytes and are alive.
            unsafe { cuda::copy_async((dst.device_ptr(), &g), (src.device_ptr(), &g), len, &s) }
                .map_err(fail)?;
            s.synchronize().map_err(fail)?;
            raw.push(t.elapsed().as_secs_f64());
        }
        let (mut ipc, mut send_us, mut queue_us, mut ack_us) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..reps + 1 {
            let t = std::time::Instant::now();
            let out = cuda_ipc::send(&mut cache, &mut staging, 1, &src).map_err(fail)?;
            let sent = t.elapsed().as_secs_f64() * 1e6;
            let (q, a) = rx.send(&out.data, len, 0, false)?;
            if i > 0 {
                ipc.push(t.elapsed().as_secs_f64());
                send_us.push(sent);
                queue_us.push(q);
                ack_us.push(a);
            }
        }
        println!(
            "MEASURE size {len}: cached handles, medians: sender half {:.2} us, receiver half (open hits, wait, copy queued) {:.2} us, until the copy-done callback {:.2} us",
            median(send_us),
            median(queue_us),
            median(ack_us)
        );
        let (r, p) = (median(raw), median(ipc));
        println!(
            "MEASURE size {len}: raw D2D copy+sync {:.1} us ({:.1} GB/s); cuda_ipc send+remote copy+ack (stdin/stdout control) {:.1} us ({:.1} GB/s), {:.0}% of raw",
            r * 1e6,
            len as f64 / r / 1e9,
            p * 1e6,
            len as f64 / p / 1e9,
            100.0 * r / p
        );
    }
    Ok(())
}

/// cuda_basic's two legs with a host copy between them standing in for the CPU channel, chunk
/// n + 1's device-to-host copy overlapping chunk n's host hop and host-to-device copy; data
/// checked, then the pipeline's rate printed next to each leg alone.
fn basic_pipeline() -> Outcome {
    use actorpipe::internal::backend::cuda_basic::{stage_in, stage_out, CHUNK, DEPTH};
    let g = gpu0()?;
    let len = 256 << 20;
    let (src, data) = filled(0, 55, len)?;
    let dst = CudaBuffer::alloc(0, len).map_err(fail)?;
    let out_stream = g.lease_stream().map_err(fail)?;
    let in_stream = g.lease_stream().map_err(fail)?;
    let (pool_out, pool_in) = (
        cuda::PinnedPool::new(CHUNK, DEPTH),
        cuda::PinnedPool::new(CHUNK, DEPTH),
    );
    let run = |check: bool| -> Result<f64, Failed> {
        let (free_out_tx, free_out) = mpsc::channel::<cuda::PinnedBuf>();
        let (free_in_tx, free_in) = mpsc::channel::<cuda::PinnedBuf>();
        let (wire_tx, wire) = mpsc::channel::<(usize, usize, cuda::PinnedBuf)>();
        for _ in 0..DEPTH {
            free_out_tx
                .send(pool_out.take().map_err(fail)?)
                .map_err(fail)?;
            free_in_tx
                .send(pool_in.take().map_err(fail)?)
                .map_err(fail)?;
        }
        let t = std::time::Instant::now();
        let chunks: Vec<(usize, usize)> = (0..len)
            .step_by(CHUNK)
            .map(|o| (o, CHUNK.min(len - o)))
            .collect();
        let n_chunks = chunks.len();
        std::thread::scope(|sc| -> Outcome {
            let (g2, dptr, ins, fo) = (
                g.clone(),
                dst.device_ptr(),
                in_stream.arc().clone(),
                free_out_tx.clone(),
            );
            let hop = sc.spawn(move || -> Outcome {
                for _ in 0..n_chunks {
                    let (off, n, a) = wire.recv().map_err(fail)?;
                    let mut b = free_in.recv().map_err(fail)?;
                    b.as_mut_slice()[..n].copy_from_slice(&a.as_slice()[..n]);
                    fo.send(a).map_err(fail)?;
                    let back = free_in_tx.clone();
                    // SAFETY: `dst` holds `len` bytes and outlives the final synchronize.
                    unsafe {
                        stage_in(&g2, dptr + off as u64, n, b, &ins, move |b| {
                            let _ = back.send(b);
                        })
                    }
                    .map_err(fail)?;
                }
                Ok(())
            });
            for (off, n) in chunks {
                let a = free_out.recv().map_err(fail)?;
                let w = wire_tx.clone();
                // SAFETY: `src` holds `len` bytes and outlives the pipeline.
                unsafe {
                    stage_out(
                        &g,
                        src.device_ptr() + off as u64,
                        n,
                        a,
                        &out_stream,
                        move |a| {
                            let _ = w.send((off, n, a));
                        },
                    )
                }
                .map_err(fail)?;
            }
            hop.join().map_err(|_| fail("hop thread panicked"))??;
            Ok(())
        })?;
        in_stream.synchronize().map_err(fail)?;
        let secs = t.elapsed().as_secs_f64();
        if check {
            let mut d = dst.to_vec().map_err(fail)?;
            if d != data {
                let at = d.iter().zip(&data).position(|(a, b)| a != b);
                d.clear();
                return Err(fail(format!("pipeline data differs at {at:?}")));
            }
        }
        Ok(secs)
    };
    run(true)?;
    let pipe = median((0..5).map(|_| run(false)).collect::<Result<Vec<_>, _>>()?);
    // Each leg alone, whole tensor, through one pinned buffer of `len` bytes.
    let big = cuda::PinnedPool::new(len, 1);
    let host = big.take().map_err(fail)?;
    let leg = |d2h: bool| -> Result<f64, Failed> {
        let mut v = Vec::new();
        for _ in 0..5 {
            g.bind().map_err(fail)?;
            let t = std::time::Instant::now();
            // SAFETY: both sides hold `len` bytes; synchronized before the next use.
            let r = unsafe {
                if d2h {
                    cuda::sys::cuMemcpyDtoHAsync_v2(
                        host.as_ptr().cast(),
                        src.device_ptr(),
                        len,
                        out_stream.cu_stream(),
                    )
                } else {
                    cuda::sys::cuMemcpyHtoDAsync_v2(
                        dst.device_ptr(),
                        host.as_ptr().cast(),
                        len,
                        out_stream.cu_stream(),
                    )
                }
            };
            r.result().map_err(fail)?;
            out_stream.synchronize().map_err(fail)?;
            v.push(t.elapsed().as_secs_f64());
        }
        Ok(median(v))
    };
    let (d2h, h2d) = (leg(true)?, leg(false)?);
    let mut a = vec![0u8; CHUNK];
    let b = vec![1u8; CHUNK];
    let t = std::time::Instant::now();
    for _ in 0..len / CHUNK {
        a.copy_from_slice(&b);
    }
    let hop = t.elapsed().as_secs_f64();
    let gbs = |s: f64| len as f64 / s / 1e9;
    let slowest = d2h.max(h2d).max(hop);
    println!(
        "MEASURE cuda_basic 256 MiB: pipeline {:.1} GB/s; pinned D2H {:.1} GB/s, H2D {:.1} GB/s, host hop (4 MiB memcpy) {:.1} GB/s; pipeline = {:.0}% of the slowest leg",
        gbs(pipe), gbs(d2h), gbs(h2d), gbs(hop), 100.0 * slowest / pipe
    );
    Ok(())
}

/// The sending process of the kill case: exports four 256 MiB tensors, prints their channel
/// data, then waits to be killed.
fn ipc_sender() -> Outcome {
    let mut cache =
        actorpipe::internal::backend::cuda_ipc::cache::IpcCache::new(0, 64).map_err(fail)?;
    let mut staging = Staging::default();
    let mut keep = Vec::new();
    let out = std::io::stdout();
    for i in 0..4 {
        let (b, _) = filled(0, 200 + i, 256 << 20)?;
        let o = cuda_ipc::send(&mut cache, &mut staging, 1, &b).map_err(fail)?;
        let mut w = out.lock();
        writeln!(w, "{}", hex(&o.data.encode())).map_err(fail)?;
        w.flush().map_err(fail)?;
        keep.push((b, o));
    }
    std::thread::sleep(std::time::Duration::from_secs(60));
    Ok(())
}

/// A sending process killed (SIGKILL) while the receiver's copies from its memory are queued:
/// the receiver's copies end (the mapping keeps the memory alive until unmapped), closing the
/// peer unmaps everything, and the device's free memory comes back to what it was.
fn ipc_peer_killed() -> Outcome {
    let g = gpu0()?;
    let len = 256 << 20;
    // Our own working set first, so the measurement sees only the peer's share come and go.
    let dsts: Vec<CudaBuffer> = (0..4)
        .map(|_| CudaBuffer::alloc(0, len))
        .collect::<Result<_, _>>()
        .map_err(fail)?;
    let stream = g.lease_stream().map_err(fail)?;
    let mut cache =
        actorpipe::internal::backend::cuda_ipc::cache::IpcCache::new(0, 64).map_err(fail)?;
    g.synchronize().map_err(fail)?;
    let (free_before, _) = g.memory().map_err(fail)?;
    let mut child = Command::new(std::env::current_exe().map_err(fail)?)
        .env("ACTORPIPE_CUDA_CHILD", "ipc_send")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(fail)?;
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    let mut copied = Vec::new();
    for d in &dsts {
        let line = lines
            .next()
            .ok_or_else(|| fail("sender died early"))?
            .map_err(fail)?;
        let bytes: Vec<u8> = (0..line.len() / 2)
            .map(|i| u8::from_str_radix(&line[2 * i..2 * i + 2], 16).unwrap_or(0))
            .collect();
        let t = IpcTensor::decode(&bytes, len as u64).ok_or_else(|| fail("bad tensor data"))?;
        let (tx, rx) = mpsc::channel();
        let ev = cuda_ipc::receive(&mut cache, 7, &t, dev(d), len, stream.arc(), move || {
            let _ = tx.send(());
        })
        .map_err(fail)?;
        copied.push((rx, ev));
    }
    let (free_during, _) = g.memory().map_err(fail)?;
    // Kill the sender with the copies queued.
    child.kill().map_err(fail)?;
    child.wait().map_err(fail)?;
    for (rx, ev) in &copied {
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .map_err(|_| fail("a queued copy never ran"))?;
        if let Some(e) = ev {
            e.synchronize().map_err(fail)?;
        }
    }
    cache.close_peer(7);
    let (_, open, _) = cache.stats();
    let mut free_after = 0;
    for _ in 0..50 {
        free_after = g.memory().map_err(fail)?.0;
        if free_after + (64 << 20) >= free_before {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    println!(
        "free GPU memory: before {} MiB, with the peer's tensors mapped {} MiB, after the kill and close {} MiB; open cache {open:?}",
        free_before >> 20,
        free_during >> 20,
        free_after >> 20
    );
    if free_after + (64 << 20) < free_before {
        return Err(fail("GPU memory of the dead peer is still held"));
    }
    if open.entries != 0 {
        return Err(fail("mappings left open after the peer closed"));
    }
    Ok(())
}

/// cuda_ipc from GPU 0 to a process whose buffers are on GPU 1, data checked, then timed next to
/// the raw peer copy.
fn ipc_two_gpus() -> Outcome {
    let g0 = gpu0()?;
    let g1 = cuda::gpu(1).map_err(fail)?;
    let mut cache =
        actorpipe::internal::backend::cuda_ipc::cache::IpcCache::new(0, 64).map_err(fail)?;
    let mut staging = Staging::default();
    let mut rx = Receiver::on(1)?;
    let (b, _) = filled(0, 61, (16 << 20) + 3)?;
    let out = cuda_ipc::send(&mut cache, &mut staging, 1, &b).map_err(fail)?;
    rx.send(&out.data, b.len(), 61, false)?;
    drop(out);
    g1.enable_peer_access(&g0).map_err(fail)?;
    let len = 1 << 30;
    let src = CudaBuffer::alloc(0, len).map_err(fail)?;
    let dst = CudaBuffer::alloc(1, len).map_err(fail)?;
    let s = g1.lease_stream().map_err(fail)?;
    let mut raw = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        // SAFETY: both buffers hold `len` bytes and are alive.
        unsafe { cuda::copy_async((dst.device_ptr(), &g1), (src.device_ptr(), &g0), len, &s) }
            .map_err(fail)?;
        s.synchronize().map_err(fail)?;
        raw.push(t.elapsed().as_secs_f64());
    }
    let mut ipc = Vec::new();
    for i in 0..6 {
        let t = std::time::Instant::now();
        let out = cuda_ipc::send(&mut cache, &mut staging, 1, &src).map_err(fail)?;
        rx.send(&out.data, len, 0, false)?;
        if i > 0 {
            ipc.push(t.elapsed().as_secs_f64());
        }
    }
    let (r, p) = (median(raw), median(ipc));
    println!(
        "MEASURE cross-GPU 1 GiB: raw peer copy {:.1} GB/s; cuda_ipc {:.1} GB/s = {:.0}% of raw (peer access 0->1: {})",
        len as f64 / r / 1e9,
        len as f64 / p / 1e9,
        100.0 * r / p,
        g1.can_access_peer(&g0)
    );
    Ok(())
}
