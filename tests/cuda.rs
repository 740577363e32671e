//! The GPU suite: run for real where a CUDA GPU is, reported as ignored ("skipped: ...") with the
//! reason everywhere else (`harness = false`, libtest-mimic).
//!
//! The binary doubles as the second process of the IPC cases: started with
//! `ACTORPIPE_CUDA_CHILD` set, it runs that role instead of the suite (see [`child`]).
//! docs/cuda.md says how to build it here and run it on a GPU machine.

mod common;

use std::io::{BufRead, Write as _};
use std::process::{Command, Stdio};
use std::sync::Arc;

use actorpipe::cuda::{self, ipc, CudaBuffer, CudaCompletion};
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
    let mut add = |name: &'static str, need: u32, f: fn() -> Outcome| {
        let t = Trial::test(name, f);
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
    add("cudarc_slices_are_taken_without_copy", 1, cudarc_slices);
    add("ipc_handle_opens_in_another_process", 1, ipc_other_process);
    add("ipc_export_names_the_allocation", 1, ipc_export_offsets);
    add("peer_copy_between_two_gpus", 2, peer_copy);
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
